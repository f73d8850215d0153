//! `jobs_rebuilt`: the current-state projection rebuilt from the log by the
//! same pure `apply` as the inline one; `verify --rebuilt` compares the two.

use jobledger_projections::{BoxFuture, Event as LogEvent, Projection};
use sqlx::postgres::PgArguments;
use sqlx::{Arguments, PgConnection};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use uuid::Uuid;

use crate::domain::{apply, EventBody, Job};
use crate::store::EventRow;

pub struct JobsRebuilt;

/// The event as the domain reads it; its data is read where it lies.
fn to_event(e: &LogEvent) -> Result<crate::domain::Event, String> {
    let row = EventRow {
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
        data: serde_json::Value::Null,
        recorded_at: e.recorded_at,
        prev_hash: e.prev_hash.clone(),
        hash: e.hash.clone(),
        schema: e.schema,
        trace: None,
    };
    row.into_event_with(Cow::Borrowed(&e.data))
        .map_err(|err| err.to_string())
}

fn refused(msg: String) -> sqlx::Error {
    sqlx::Error::Protocol(msg)
}

/// Whether the batch holds each job's whole stream so far: its versions
/// here run 1, 2, … without a gap (a version may come twice in a row). Such
/// a job is folded from nothing, without reading its row back: in a rebuild
/// from position 0 that is every job in the batch that enqueues it. Any
/// other shape (a redelivered version 1 met after a later one, a stream
/// that starts mid-way) reads the row back; the reader's early versions
/// (`Projection::apply`) make both happen.
fn whole_streams(events: &[LogEvent]) -> HashMap<Uuid, bool> {
    let mut seen: HashMap<Uuid, (i64, bool)> = HashMap::new();
    for e in events {
        // An event of a schema newer than this build fails the batch unless
        // the row is already past it (another build applied it): read back.
        let current = e.schema <= crate::domain::schema::CURRENT;
        seen.entry(e.job_id)
            .and_modify(|(last, whole)| {
                *whole &= current && (e.version == *last || e.version == *last + 1);
                *last = e.version.max(*last);
            })
            .or_insert((e.version, current && e.version == 1));
    }
    seen.into_iter().map(|(id, (_, whole))| (id, whole)).collect()
}

/// A job folded in this batch.
struct Folded {
    job: Job,
    purged: bool,
    /// Its row was read back (so it is there to update).
    stored: bool,
    /// An event of this batch moved it.
    moved: bool,
}

/// Version 2 (issue 15) kept each job as `json`, not `jsonb`: the table is
/// written and read as whole documents, and parsing them into `jsonb` and
/// printing them back was a third of a rebuild's time. Version 3 keeps
/// the same JSON as `text`: `json` checks every document's syntax on the
/// way in, 36 ms of a 60 ms insert of 10,000 documents (psql), for
/// documents serde just wrote. SQL over it casts: `job::json->>'state'`.
impl Projection for JobsRebuilt {
    fn name(&self) -> &str {
        "jobs_rebuilt"
    }
    fn version(&self) -> i32 {
        3
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid PRIMARY KEY, state text NOT NULL, version bigint NOT NULL, \
                 purged boolean NOT NULL, job text NOT NULL)"
            ))
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }

    /// Loads the batch's jobs it does not hold whole (`whole_streams`),
    /// folds their events (skipping versions already applied:
    /// redeliveries), writes back the jobs that moved. The batch goes in
    /// chunks of whole jobs: a chunk is folded on a blocking thread while
    /// the one before it is written, because folding (parsing the rows read
    /// back, serialising the documents) was a third of a rebuild's time and
    /// the connection sat idle through it (issue 15).
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [LogEvent],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let mut rows = read_back(tx, table, events).await?;
            // A batch that may fail for an event of a newer schema folds
            // whole before it writes, as it did in one piece: the error
            // then names the batch's first such event and no write error
            // of an earlier chunk can hide it (review, helper-52).
            let per_chunk = if events.iter().any(|e| e.schema > crate::domain::schema::CURRENT) {
                usize::MAX
            } else {
                CHUNK_JOBS
            };
            let mut folding: Option<tokio::task::JoinHandle<Result<Rows, sqlx::Error>>> = None;
            for jobs in chunks(events, per_chunk) {
                let chunk = Chunk::take(jobs, &mut rows);
                let next = off_the_task(move || chunk.fold());
                if let Some(done) = folding.replace(next) {
                    write(tx, table, joined(done).await?).await?;
                }
            }
            if let Some(done) = folding {
                write(tx, table, joined(done).await?).await?;
            }
            Ok(())
        })
    }
}

/// Jobs per chunk: each chunk's statements cost about a millisecond of
/// their own, and a chunk of 1,000 jobs folds in 10–16 ms on 2 cores.
const CHUNK_JOBS: usize = 1000;

/// `f` on a blocking thread, its warnings in the caller's span and to the
/// caller's subscriber: a scoped one (`tracing::subscriber::set_default`)
/// is the thread's own, and without it they went to the global one, or
/// nowhere (review, helper-52).
fn off_the_task<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> tokio::task::JoinHandle<T> {
    let span = tracing::Span::current();
    let dispatch = tracing::dispatcher::get_default(|d| d.clone());
    tokio::task::spawn_blocking(move || tracing::dispatcher::with_default(&dispatch, || span.in_scope(f)))
}

async fn joined(folding: tokio::task::JoinHandle<Result<Rows, sqlx::Error>>) -> Result<Rows, sqlx::Error> {
    match folding.await {
        Ok(folded) => folded,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(refused(format!(
            "jobs_rebuilt: folding a chunk was cancelled: {e}"
        ))),
    }
}

/// The batch's events in groups of about `jobs` whole jobs each: a job's
/// events are all in one group, in the batch's order.
fn chunks(events: &[LogEvent], jobs: usize) -> Vec<Vec<&LogEvent>> {
    let mut group_of: HashMap<Uuid, usize> = HashMap::new();
    let mut groups: Vec<Vec<&LogEvent>> = vec![];
    let mut in_last = 0;
    for e in events {
        let g = *group_of.entry(e.job_id).or_insert_with(|| {
            if groups.is_empty() || in_last == jobs {
                groups.push(vec![]);
                in_last = 0;
            }
            in_last += 1;
            groups.len() - 1
        });
        groups[g].push(e);
    }
    groups
}

/// One chunk's events and the rows read back for its jobs, owned, so that
/// it folds off the connection's task.
struct Chunk {
    events: Vec<LogEvent>,
    rows: HashMap<Uuid, (bool, String)>,
}

impl Chunk {
    /// The chunk's events, and its jobs' rows taken out of those read back.
    fn take(events: Vec<&LogEvent>, rows: &mut HashMap<Uuid, (bool, String)>) -> Self {
        let mut mine = HashMap::new();
        for e in &events {
            if let Some(row) = rows.remove(&e.job_id) {
                mine.insert(e.job_id, row);
            }
        }
        // Cloned: `Projection::apply` lends the batch, and a blocking thread
        // needs what it folds owned. The copy is the one piece of client
        // work left on the connection's task (review, helper-52); handing
        // projections an owned batch would change every projection's
        // signature for it.
        Chunk {
            events: events.into_iter().cloned().collect(),
            rows: mine,
        }
    }

    /// The chunk's jobs that moved. A row that does not parse as a job
    /// (edited around the projection: the `text` column takes anything)
    /// leaves its job as it is, as a refused event does: failing the batch
    /// stopped the projection for every job behind it (review of issue
    /// 15); `verify --rebuilt` names it.
    fn fold(self) -> Result<Rows, sqlx::Error> {
        let mut jobs = HashMap::new();
        let mut unreadable = HashSet::new();
        for (id, (purged, doc)) in self.rows {
            match serde_json::from_str::<Job>(&doc) {
                Ok(job) => {
                    let read = Folded {
                        job,
                        purged,
                        stored: true,
                        moved: false,
                    };
                    jobs.insert(id, read);
                }
                Err(err) => {
                    tracing::warn!(job_id = %id, %err,
                        "jobs_rebuilt: the job's row does not parse; the job is left as it is");
                    unreadable.insert(id);
                }
            }
        }
        for e in self.events.iter().filter(|e| !unreadable.contains(&e.job_id)) {
            fold(&mut jobs, e)?;
        }
        Rows::of(jobs.into_values().filter(|f| f.moved))
    }
}

/// The rows (`purged`, the document unparsed) of the batch's jobs it does
/// not hold whole.
async fn read_back(
    tx: &mut PgConnection,
    table: &str,
    events: &[LogEvent],
) -> Result<HashMap<Uuid, (bool, String)>, sqlx::Error> {
    let mut ids: Vec<Uuid> = whole_streams(events)
        .into_iter()
        .filter_map(|(id, whole)| (!whole).then_some(id))
        .collect();
    if ids.is_empty() {
        return Ok(HashMap::new()); // a batch of new jobs: no round trip
    }
    ids.sort();
    let rows: Vec<(Uuid, bool, String)> = sqlx::query_as(&format!(
        "SELECT job_id, purged, job FROM {table} WHERE job_id = ANY($1)"
    ))
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, purged, doc)| (id, (purged, doc)))
        .collect())
}

/// Applies one event to its job, unless the job is already at or past it.
fn fold(jobs: &mut HashMap<Uuid, Folded>, e: &LogEvent) -> Result<(), sqlx::Error> {
    let current = jobs.get(&e.job_id);
    if current.is_some_and(|f| f.job.version >= e.version) {
        return Ok(());
    }
    // An event of a schema newer than this build fails the batch: an
    // upgrade reads it. Any other event that does not parse or that `apply`
    // refuses was written around the write path (a forged token, edited
    // data, an edited chain): it leaves its job at the last event it
    // accepted, and so every later one (each is refused for the gap).
    // Failing the batch instead stopped this projection for every job
    // behind it, for good. The job then differs from the inline row, or is
    // missing, and `verify --rebuilt` names it; `verify` names the event.
    if e.schema > crate::domain::schema::CURRENT {
        return Err(refused(format!(
            "job {} v{}: event schema {} is newer than this build reads: upgrade jobledger",
            e.job_id, e.version, e.schema
        )));
    }
    let applied = to_event(e).and_then(|ev| {
        apply(current.map(|f| &f.job), &ev)
            .map(|next| (next, matches!(ev.body, EventBody::Purged {})))
            .map_err(|err| err.to_string())
    });
    match applied {
        Ok((job, purged)) => {
            let stored = current.is_some_and(|f| f.stored);
            jobs.insert(
                e.job_id,
                Folded {
                    job,
                    purged,
                    stored,
                    moved: true,
                },
            );
        }
        Err(err) => tracing::warn!(job_id = %e.job_id, version = e.version, %err,
            "jobs_rebuilt: the log's event is refused; the job stays at its last accepted event"),
    }
    Ok(())
}

/// Jobs read back are updated; the others inserted plainly, and only when
/// one meets a row (a redelivered stream) does the insert become an upsert
/// that keeps whichever version is newer. In psql, 10,000 documents: 59–66
/// ms inserted plainly, 86–94 ms with `ON CONFLICT`; updated 114 ms, 166 ms
/// through `ON CONFLICT … DO UPDATE`. `queue_stats` upserts its stored
/// rows instead: planned for the array at hand, its `UPDATE … FROM UNNEST`
/// hashed the whole (narrow) side table now and then; on this wider table
/// the statement log showed no such plan (14–29 ms a batch throughout).
async fn write(tx: &mut PgConnection, table: &str, rows: Rows) -> Result<(), sqlx::Error> {
    let columns = jobledger_projections::unnested(&["uuid", "text", "int8", "bool", "text"]);
    if let Some(update) = rows.update {
        sqlx::query_with(
            &format!(
                "UPDATE {table} t SET state = u.state, version = u.version, purged = u.purged, job = u.doc \
                 FROM (SELECT {columns}) AS u(id, state, version, purged, doc) WHERE t.job_id = u.id"
            ),
            update,
        )
        .execute(&mut *tx)
        .await?;
    }
    if let Some(new) = rows.insert {
        let insert = format!("INSERT INTO {table} SELECT {columns}");
        let upsert = format!(
            "{insert} ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, version = EXCLUDED.version, \
             purged = EXCLUDED.purged, job = EXCLUDED.job WHERE {table}.version < EXCLUDED.version"
        );
        jobledger_projections::insert_plainly(tx, &insert, &upsert, new).await?;
    }
    Ok(())
}

/// A chunk's jobs that moved, bound for `write`: those read back to update,
/// the others to insert (`None`: no such job).
struct Rows {
    update: Option<PgArguments>,
    insert: Option<PgArguments>,
}

impl Rows {
    fn of(moved: impl Iterator<Item = Folded>) -> Result<Self, sqlx::Error> {
        let (mut old, mut new) = (Columns::default(), Columns::default());
        for f in moved {
            if f.stored { &mut old } else { &mut new }.push(f);
        }
        let bound = |c: Columns| (!c.id.is_empty()).then(|| c.args()).transpose();
        Ok(Rows {
            update: bound(old)?,
            insert: bound(new)?,
        })
    }
}

#[derive(Default)]
struct Columns {
    id: Vec<Uuid>,
    state: Vec<&'static str>,
    version: Vec<i64>,
    purged: Vec<bool>,
    doc: Vec<String>,
}

impl Columns {
    fn push(&mut self, f: Folded) {
        self.id.push(f.job.job_id);
        self.state.push(f.job.state.as_str());
        self.version.push(f.job.version);
        self.purged.push(f.purged);
        self.doc
            .push(serde_json::to_string(&f.job).expect("jobs serialise"));
    }

    fn args(self) -> Result<PgArguments, sqlx::Error> {
        let mut args = PgArguments::default();
        let enc = sqlx::Error::Encode;
        args.add(self.id).map_err(enc)?;
        args.add(self.state).map_err(enc)?;
        args.add(self.version).map_err(enc)?;
        args.add(self.purged).map_err(enc)?;
        args.add(self.doc).map_err(enc)?;
        Ok(args)
    }
}

/// Rows of the view as `projections query` shows them: each job's JSON
/// text (version 3) as the object it is; a row whose text does not parse
/// stays a string.
pub(crate) fn show_documents(rows: &mut [serde_json::Value]) {
    for row in rows {
        if let Some(job) = row.get_mut("job") {
            if let Some(parsed) = job.as_str().and_then(|t| serde_json::from_str(t).ok()) {
                *job = parsed;
            }
        }
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
                match (serde_json::from_str::<Job>(doc), live.get(id)) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn event(job: u8, version: i64) -> LogEvent {
        LogEvent {
            position: 0,
            job_id: Uuid::from_u128(job as u128 + 1),
            version,
            kind: "enqueued".into(),
            from_state: None,
            to_state: "queued".into(),
            reason: "enqueued".into(),
            error_class: None,
            actor: "test".into(),
            epoch: 1,
            token: 0,
            attempt: 0,
            run: 0,
            data: serde_json::Value::Null,
            recorded_at: chrono::Utc::now(),
            prev_hash: None,
            hash: String::new(),
            schema: 1,
        }
    }

    proptest! {
        /// Every job's events land in one chunk, in the batch's order; no
        /// chunk holds more than `per` jobs; nothing is lost or added.
        #[test]
        fn chunks_keep_jobs_whole(jobs in prop::collection::vec(0u8..40, 0..300), per in 1usize..12) {
            let events: Vec<LogEvent> = jobs.iter().enumerate().map(|(i, j)| event(*j, i as i64)).collect();
            let groups = chunks(&events, per);
            let mut home: HashMap<Uuid, usize> = HashMap::new();
            let mut seen = 0;
            for (g, group) in groups.iter().enumerate() {
                prop_assert!(!group.is_empty());
                let mine: HashSet<Uuid> = group.iter().map(|e| e.job_id).collect();
                prop_assert!(mine.len() <= per);
                for e in group {
                    prop_assert_eq!(*home.entry(e.job_id).or_insert(g), g, "a job in two chunks");
                }
                // The batch's order within the chunk (versions here are indexes).
                prop_assert!(group.windows(2).all(|w| w[0].version < w[1].version));
                seen += group.len();
            }
            prop_assert_eq!(seen, events.len());
        }
    }
}
