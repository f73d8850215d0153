//! `verify`: recompute every hash, replay every job's events through the pure
//! state machine, and compare with the inline projection and tombstones.

use serde::Serialize;
use std::collections::HashMap;
use uuid::Uuid;

use super::error::LedgerResult;
use super::Ledger;
use crate::domain::checkpoint::LOG_STREAM;
use crate::domain::{apply, EventBody, Job};
use crate::store::{events, jobs, schema, tombstones, workflows, EventRow, JobRow, TombstoneRow};

#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    pub job_id: Uuid,
    pub version: Option<i64>,
    pub position: Option<i64>,
    pub detail: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    pub jobs: u64,
    pub events: u64,
    /// Leaves of the log's Merkle tree walked, and signed checkpoints
    /// checked against them (whole-log verify only).
    pub leaves: u64,
    pub checkpoints: u64,
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

const PAGE_JOBS: i64 = 500;

impl Ledger {
    /// Verifies one job, or every job when `job` is `None`.
    pub async fn verify(&self, job: Option<Uuid>) -> LedgerResult<VerifyReport> {
        self.verify_with(job, None, &[]).await
    }

    /// `verify`, and with `key` also every checkpoint's signature. The
    /// whole log's verify also walks the Merkle tree (`audit::check`).
    pub async fn verify_with(
        &self,
        job: Option<Uuid>,
        key: Option<&ed25519_dalek::VerifyingKey>,
        held: &[crate::domain::checkpoint::Checkpoint],
    ) -> LedgerResult<VerifyReport> {
        let mut tx = self.pool.begin().await?;
        schema::snapshot_read_only(&mut tx).await?;
        let mut report = VerifyReport::default();
        if job.is_none() || job == Some(LOG_STREAM) {
            let tree = crate::audit::check::check_tree(&mut tx, key, held)
                .await
                .map_err(|e| super::LedgerError::Store(crate::store::StoreError::Corrupt(e.to_string())))?;
            (report.leaves, report.checkpoints) = (tree.leaves, tree.checkpoints);
            report.problems.extend(tree.problems);
            if job.is_some() {
                return Ok(report);
            }
        }
        if let Some(id) = job {
            let rows = events::job_events(&mut *tx, id).await?;
            if rows.is_empty() && jobs::find_job(&mut *tx, id).await?.is_none() {
                return Err(super::LedgerError::NotFound(id));
            }
            let projected = jobs::jobs_by_ids(&mut *tx, &[id]).await?;
            let graves = tombstones::tombstones_by_ids(&mut *tx, &[id]).await?;
            check_page(&rows, projected, graves, &mut report);
            if rows.is_empty() {
                report
                    .problems
                    .push(problem(id, None, None, "projection row has no events".into()));
            }
            check_workflows(&mut tx, Some(id), &mut report).await?;
            return Ok(report);
        }
        let mut after = None;
        loop {
            let mut rows = events::events_of_jobs_after(&mut *tx, after, PAGE_JOBS).await?;
            let Some(last) = rows.last() else { break };
            after = Some(last.job_id);
            // The log's own stream (checkpoints) is no job: the tree check
            // above covers it.
            rows.retain(|r| r.job_id != LOG_STREAM);
            let mut ids: Vec<Uuid> = rows.iter().map(|r| r.job_id).collect();
            ids.dedup();
            let projected = jobs::jobs_by_ids(&mut *tx, &ids).await?;
            let graves = tombstones::tombstones_by_ids(&mut *tx, &ids).await?;
            check_page(&rows, projected, graves, &mut report);
        }
        for id in jobs::orphan_job_ids(&mut *tx).await? {
            report
                .problems
                .push(problem(id, None, None, "projection row has no events".into()));
        }
        for id in tombstones::orphan_tombstone_ids(&mut *tx).await? {
            report
                .problems
                .push(problem(id, None, None, "tombstone has no events".into()));
        }
        check_workflows(&mut tx, None, &mut report).await?;
        // Queue controls are streams of their own (no job id), read in the
        // same snapshot.
        for detail in self.verify_queues_in(&mut tx).await? {
            report.problems.push(problem(Uuid::nil(), None, None, detail));
        }
        for detail in self.verify_schedules_in(&mut tx).await? {
            report.problems.push(problem(Uuid::nil(), None, None, detail));
        }
        Ok(report)
    }
}

/// Across streams: every count in a parent's stream is backed by its step's
/// edge at that version, and every step's end is counted by its parent
/// (each stream alone already replays through `apply`).
async fn check_workflows(
    conn: &mut sqlx::PgConnection,
    job: Option<Uuid>,
    report: &mut VerifyReport,
) -> LedgerResult<()> {
    let mut found = workflows::counts_without_step_edge(&mut *conn, job).await?;
    found.extend(workflows::step_edges_not_counted(&mut *conn, job).await?);
    found.extend(workflows::counts_twice_or_foreign(&mut *conn, job).await?);
    for (id, version, position, detail) in found {
        report
            .problems
            .push(problem(id, Some(version), Some(position), detail));
    }
    Ok(())
}

fn problem(job_id: Uuid, version: Option<i64>, position: Option<i64>, detail: String) -> Problem {
    Problem {
        job_id,
        version,
        position,
        detail,
    }
}

/// Checks the events of a page of jobs (sorted by job, version).
fn check_page(
    rows: &[EventRow],
    projected: Vec<JobRow>,
    graves: Vec<TombstoneRow>,
    report: &mut VerifyReport,
) {
    let mut projected: HashMap<Uuid, JobRow> = projected.into_iter().map(|r| (r.job_id, r)).collect();
    let graves: HashMap<Uuid, TombstoneRow> = graves.into_iter().map(|t| (t.job_id, t)).collect();
    for stream in rows.chunk_by(|a, b| a.job_id == b.job_id) {
        report.jobs += 1;
        report.events += stream.len() as u64;
        let id = stream[0].job_id;
        match replay(stream, report) {
            Some((job, purged)) => compare(id, &job, purged, projected.remove(&id), graves.get(&id), report),
            None => {
                projected.remove(&id);
            }
        }
    }
}

/// Folds one job's events; reports the first break and stops there.
fn replay(stream: &[EventRow], report: &mut VerifyReport) -> Option<(Job, bool)> {
    fold(stream).map_err(|p| report.problems.push(p)).ok()
}

fn fold(stream: &[EventRow]) -> Result<(Job, bool), Problem> {
    let mut state: Option<Job> = None;
    let mut purged = false;
    for row in stream {
        let p = |d: String| problem(row.job_id, Some(row.version), Some(row.position), d);
        let ev = row.to_event().map_err(|e| p(e.to_string()))?;
        let recomputed = row.stored_hash();
        if recomputed != ev.hash {
            return Err(p(format!(
                "hash mismatch: stored {}, recomputed {recomputed}",
                ev.hash
            )));
        }
        state = Some(apply(state.as_ref(), &ev).map_err(|e| p(format!("replay refused the event: {e}")))?);
        purged = matches!(ev.body, EventBody::Purged {});
    }
    let job = state.expect("a stream has at least one event");
    Ok((job, purged))
}

fn compare(
    id: Uuid,
    replayed: &Job,
    purged: bool,
    row: Option<JobRow>,
    grave: Option<&TombstoneRow>,
    report: &mut VerifyReport,
) {
    let p = |d: String| problem(id, Some(replayed.version), None, d);
    if !purged && grave.is_some() {
        report
            .problems
            .push(p("tombstone of a job the log says was never purged".into()));
    }
    match (purged, row, grave) {
        (false, Some(row), _) => match Job::try_from(row) {
            Ok(stored) if stored == *replayed => {}
            Ok(stored) => report.problems.push(p(format!(
                "projection differs from replay: {}",
                diff(&stored, replayed)
            ))),
            Err(e) => report.problems.push(p(e.to_string())),
        },
        (false, None, _) => report
            .problems
            .push(p("events exist but the projection row is missing".into())),
        (true, Some(_), _) => report
            .problems
            .push(p("purged job still has a projection row".into())),
        (true, None, None) => report.problems.push(p("purged job has no tombstone".into())),
        (true, None, Some(t)) => {
            if t.version != replayed.version || t.last_hash != replayed.last_hash || t.token != replayed.token
            {
                report
                    .problems
                    .push(p("tombstone does not match the end of the log".into()));
            }
        }
    }
}

/// Names the fields that differ, for a readable report.
fn diff(stored: &Job, replayed: &Job) -> String {
    let a = serde_json::to_value(stored).unwrap_or_default();
    let b = serde_json::to_value(replayed).unwrap_or_default();
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return "unreadable".into();
    };
    let fields: Vec<String> = a
        .iter()
        .filter(|(k, v)| b.get(*k) != Some(*v))
        .map(|(k, v)| {
            format!(
                "{k}: stored {v}, log says {}",
                b.get(k).cloned().unwrap_or_default()
            )
        })
        .collect();
    fields.join("; ")
}
