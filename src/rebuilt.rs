//! `jobs_rebuilt`: the current-state projection rebuilt from the log by the
//! same pure `apply` as the inline one; `verify --rebuilt` compares the two.

use jobledger_projections::{BoxFuture, Event as LogEvent, Projection};
use sqlx::types::Json;
use sqlx::PgConnection;
use std::collections::HashMap;
use uuid::Uuid;

use crate::domain::{apply, EventBody, Job};
use crate::store::EventRow;

pub struct JobsRebuilt;

fn to_row(e: &LogEvent) -> EventRow {
    EventRow {
        position: e.position,
        job_id: e.job_id,
        version: e.version,
        kind: e.kind.clone(),
        from_state: e.from_state.clone(),
        to_state: e.to_state.clone(),
        reason: e.reason.clone(),
        error_class: e.error_class.clone(),
        actor: e.actor.clone(),
        epoch: e.epoch,
        token: e.token,
        attempt: e.attempt,
        run: e.run,
        data: e.data.clone(),
        recorded_at: e.recorded_at,
        prev_hash: e.prev_hash.clone(),
        hash: e.hash.clone(),
        schema: e.schema,
        trace: None,
    }
}

fn refused(msg: String) -> sqlx::Error {
    sqlx::Error::Protocol(msg)
}

/// Version 2 (issue 15) keeps each job as `json`, not `jsonb`: the table is
/// written and read as whole documents, and parsing them into `jsonb` and
/// printing them back was a third of a rebuild's time. SQL over it still
/// works (`job->>'state'`), a little slower.
impl Projection for JobsRebuilt {
    fn name(&self) -> &str {
        "jobs_rebuilt"
    }
    fn version(&self) -> i32 {
        2
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid PRIMARY KEY, state text NOT NULL, version bigint NOT NULL, \
                 purged boolean NOT NULL, job json NOT NULL)"
            ))
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }

    /// Loads the batch's jobs, folds their events (skipping versions already
    /// applied: redeliveries), writes them back in one statement.
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [LogEvent],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let mut ids: Vec<Uuid> = events.iter().map(|e| e.job_id).collect();
            ids.sort();
            ids.dedup();
            let rows: Vec<(Uuid, bool, Json<Job>)> = sqlx::query_as(&format!(
                "SELECT job_id, purged, job FROM {table} WHERE job_id = ANY($1)"
            ))
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?;
            let mut jobs: HashMap<Uuid, (Job, bool)> = rows
                .into_iter()
                .map(|(id, purged, Json(job))| (id, (job, purged)))
                .collect();
            for e in events {
                let current = jobs.get(&e.job_id);
                if current.is_some_and(|(j, _)| j.version >= e.version) {
                    continue;
                }
                // An event of a schema newer than this build fails the
                // batch: an upgrade reads it. Any other event that does not
                // parse or that `apply` refuses was written around the write
                // path (a forged token, edited data, an edited chain): it
                // leaves its job at the last event it accepted, and so every
                // later one (each is refused for the gap). Failing the batch
                // instead stopped this projection for every job behind it,
                // for good. The job then differs from the inline row, or is
                // missing, and `verify --rebuilt` names it; `verify` names
                // the event.
                if e.schema > crate::domain::schema::CURRENT {
                    return Err(refused(format!(
                        "job {} v{}: event schema {} is newer than this build reads: upgrade jobledger",
                        e.job_id, e.version, e.schema
                    )));
                }
                let read = to_row(e).into_event().map_err(|err| err.to_string());
                let (next, ev) = match read.and_then(|ev| {
                    apply(current.map(|(j, _)| j), &ev)
                        .map(|next| (next, ev))
                        .map_err(|err| err.to_string())
                }) {
                    Ok(applied) => applied,
                    Err(err) => {
                        tracing::warn!(job_id = %e.job_id, version = e.version, %err,
                            "jobs_rebuilt: the log's event is refused; the job stays at its last accepted event");
                        continue;
                    }
                };
                jobs.insert(e.job_id, (next, matches!(ev.body, EventBody::Purged {})));
            }
            let (mut id, mut state, mut version, mut purged, mut doc) =
                (vec![], vec![], vec![], vec![], vec![]);
            for (k, (j, p)) in jobs {
                id.push(k);
                state.push(j.state.as_str().to_string());
                version.push(j.version);
                purged.push(p);
                doc.push(serde_json::to_string(&j).expect("jobs serialise"));
            }
            // Sent as text and cast: `json` only checks the syntax.
            sqlx::query(&format!(
                "INSERT INTO {table} SELECT u.id, u.state, u.version, u.purged, u.doc::json \
                 FROM UNNEST($1::uuid[], $2::text[], $3::int8[], $4::bool[], $5::text[]) AS u(id, state, version, purged, doc) \
                 ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, version = EXCLUDED.version, \
                 purged = EXCLUDED.purged, job = EXCLUDED.job"
            ))
            .bind(id)
            .bind(state)
            .bind(version)
            .bind(purged)
            .bind(doc)
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

impl crate::ledger::Ledger {
    /// Compares `jobs_rebuilt` (caught up by the caller) with the inline
    /// projection: every live job equal, none missing on either side.
    pub async fn compare_rebuilt(&self) -> crate::ledger::LedgerResult<Vec<crate::ledger::Problem>> {
        use crate::store::jobs;
        let problem = |job_id, detail: &str| crate::ledger::Problem {
            job_id,
            version: None,
            position: None,
            detail: detail.into(),
        };
        let rebuilt = jobs::rebuilt_jobs(self.pool()).await?;
        let mut problems = vec![];
        for chunk in rebuilt.chunks(1000) {
            let ids: Vec<Uuid> = chunk.iter().map(|(id, _)| *id).collect();
            let live: HashMap<Uuid, Job> = jobs::jobs_by_ids(self.pool(), &ids)
                .await?
                .into_iter()
                .map(|r| Job::try_from(r).map(|j| (j.job_id, j)))
                .collect::<Result<_, _>>()?;
            for (id, doc) in chunk {
                match (serde_json::from_value::<Job>(doc.clone()), live.get(id)) {
                    (Ok(r), Some(l)) if r == *l => {}
                    (Ok(_), Some(_)) => {
                        problems.push(problem(*id, "jobs_rebuilt differs from jobledger.jobs"))
                    }
                    (Ok(_), None) => {
                        problems.push(problem(*id, "in jobs_rebuilt, missing from jobledger.jobs"))
                    }
                    (Err(e), _) => problems.push(problem(*id, &format!("unreadable rebuilt row: {e}"))),
                }
            }
        }
        // Named one by one: a count said only that some were missing (a job
        // whose first event `apply` refuses has no rebuilt row), and one
        // extra row elsewhere could hide it.
        for id in jobs::jobs_not_rebuilt(self.pool()).await? {
            problems.push(problem(id, "in jobledger.jobs, missing from jobs_rebuilt"));
        }
        Ok(problems)
    }
}
