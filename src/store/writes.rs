//! The write of accepted transitions: projections and events together.

use sqlx::PgConnection;
use uuid::Uuid;

use super::columns::{unnest, EventArrays, EVENT_TYPES};
use super::rows::{to_json, EventRow, EVENT_COLUMNS};
use super::{StoreError, StoreResult};
use crate::domain::Job;

/// The columns a transition may change, as arrays borrowed from the jobs
/// after it. What a job is (queue, kind, payload, policy, workflow,
/// admission) never changes, so it is neither copied nor serialised here
/// (issue 15: serialising each job's policy and cloning its payload, only
/// for the update to leave them out, was a twentieth of a drain's client
/// time).
struct Changes<'a> {
    job_id: Vec<Uuid>,
    token: Vec<i64>,
    run: Vec<i32>,
    attempt: Vec<i32>,
    state: Vec<&'static str>,
    run_at: Vec<chrono::DateTime<chrono::Utc>>,
    lease_until: Vec<Option<chrono::DateTime<chrono::Utc>>>,
    holder: Vec<Option<&'a str>>,
    next_action: Vec<&'static str>,
    step: Vec<Option<&'a str>>,
    receipt_id: Vec<Option<&'a str>>,
    receipt_deadline: Vec<Option<chrono::DateTime<chrono::Utc>>>,
    result: Vec<Option<&'a serde_json::Value>>,
    release: Vec<Option<serde_json::Value>>,
    last_error: Vec<Option<serde_json::Value>>,
    reason: Vec<&'static str>,
    updated_at: Vec<chrono::DateTime<chrono::Utc>>,
    version: Vec<i64>,
    last_hash: Vec<&'a str>,
}

impl<'a> Changes<'a> {
    fn of(next: &[&'a Job]) -> Self {
        Changes {
            job_id: next.iter().map(|j| j.job_id).collect(),
            token: next.iter().map(|j| j.token).collect(),
            run: next.iter().map(|j| j.run).collect(),
            attempt: next.iter().map(|j| j.attempt).collect(),
            state: next.iter().map(|j| j.state.as_str()).collect(),
            run_at: next.iter().map(|j| j.run_at).collect(),
            lease_until: next.iter().map(|j| j.lease_until).collect(),
            holder: next.iter().map(|j| j.holder.as_deref()).collect(),
            next_action: next.iter().map(|j| j.next_action.as_str()).collect(),
            step: next.iter().map(|j| j.step.as_deref()).collect(),
            receipt_id: next.iter().map(|j| j.receipt_id.as_deref()).collect(),
            receipt_deadline: next.iter().map(|j| j.receipt_deadline).collect(),
            result: next.iter().map(|j| j.result.as_ref()).collect(),
            release: next.iter().map(|j| to_json(&j.release)).collect(),
            last_error: next.iter().map(|j| to_json(&j.last_error)).collect(),
            reason: next.iter().map(|j| j.reason.as_str()).collect(),
            updated_at: next.iter().map(|j| j.updated_at).collect(),
            version: next.iter().map(|j| j.version).collect(),
            last_hash: next.iter().map(|j| j.last_hash.as_str()).collect(),
        }
    }
}

/// In one statement: updates the projections of jobs whose rows this
/// transaction holds locked, each conditioned on the generation it was
/// decided against (job_id, epoch, token, state, version), and appends their
/// events. Every row must match its fence, or nothing is kept (the caller's
/// transaction is rolled back). Returns `(job_id, position)` per event.
pub async fn write_transitions(
    conn: &mut PgConnection,
    prev: &[&Job],
    next: &[&Job],
    events: Vec<EventRow>,
) -> StoreResult<Vec<(Uuid, i64)>> {
    let expected = next.len() as i64;
    let a = Changes::of(next);
    let sql = format!(
        "WITH u AS ( \
           UPDATE jobledger.jobs j SET token = u.token, run = u.run, attempt = u.attempt, state = u.state, \
             run_at = u.run_at, lease_until = u.lease_until, holder = u.holder, next_action = u.next_action, \
             step = u.step, receipt_id = u.receipt_id, receipt_deadline = u.receipt_deadline, result = u.result, \
             release = u.release, last_error = u.last_error, reason = u.reason, updated_at = u.updated_at, \
             version = u.version, last_hash = u.last_hash \
           FROM UNNEST($1::uuid[], $2::int8[], $3::int4[], $4::int4[], $5::text[], $6::timestamptz[], \
                       $7::timestamptz[], $8::text[], $9::text[], $10::text[], $11::text[], $12::timestamptz[], \
                       $13::jsonb[], $14::jsonb[], $15::jsonb[], $16::text[], $17::timestamptz[], $18::int8[], \
                       $19::text[], $20::int8[], $21::int8[], $22::text[], $23::int8[]) \
             AS u(job_id, token, run, attempt, state, run_at, lease_until, holder, next_action, step, receipt_id, \
                  receipt_deadline, result, release, last_error, reason, updated_at, version, last_hash, \
                  prev_epoch, prev_token, prev_state, prev_version) \
           WHERE j.job_id = u.job_id AND j.epoch = u.prev_epoch AND j.token = u.prev_token \
             AND j.state = u.prev_state AND j.version = u.prev_version \
           RETURNING j.job_id), \
         e AS ( \
           INSERT INTO jobledger.events ({EVENT_COLUMNS}) SELECT * FROM {} AS e({EVENT_COLUMNS}) \
           ORDER BY e.job_id, e.version RETURNING job_id, position) \
         SELECT (SELECT count(*) FROM u), e.job_id, e.position FROM e",
        unnest(EVENT_TYPES, 24)
    );
    let q = sqlx::query_as::<_, (i64, Uuid, i64)>(&sql)
        .bind(a.job_id)
        .bind(a.token)
        .bind(a.run)
        .bind(a.attempt)
        .bind(a.state)
        .bind(a.run_at)
        .bind(a.lease_until)
        .bind(a.holder)
        .bind(a.next_action)
        .bind(a.step)
        .bind(a.receipt_id)
        .bind(a.receipt_deadline)
        .bind(a.result)
        .bind(a.release)
        .bind(a.last_error)
        .bind(a.reason)
        .bind(a.updated_at)
        .bind(a.version)
        .bind(a.last_hash)
        .bind(prev.iter().map(|j| j.epoch).collect::<Vec<_>>())
        .bind(prev.iter().map(|j| j.token).collect::<Vec<_>>())
        .bind(prev.iter().map(|j| j.state.as_str()).collect::<Vec<_>>())
        .bind(prev.iter().map(|j| j.version).collect::<Vec<_>>());
    let rows = EventArrays::of(events).bind_all(q).fetch_all(conn).await?;
    let updated = rows.first().map_or(0, |r| r.0);
    if updated != expected {
        return Err(StoreError::FenceRace(format!(
            "{updated} of {expected} locked rows matched their fence"
        )));
    }
    Ok(rows.into_iter().map(|(_, id, p)| (id, p)).collect())
}
