//! What follows a workflow step's edge, in the same transaction (lock
//! order in `ledger/workflow.rs`): the parent counts it, the steps waiting
//! for it are released, cancelled or held, and when every other step has
//! ended the fan-in is created.

use sqlx::PgConnection;
use std::collections::{HashMap, HashSet};
use tracing::Instrument;
use uuid::Uuid;

use super::engine::{self, WriteResult};
use super::error::{LedgerError, LedgerResult};
use crate::domain::workflow::{DependencyPolicy, Membership, StepLink, StepStatus, Tally, WorkflowTie};
use crate::domain::{decide, Command, Job, JobState, NewJob};
use crate::store::{jobs, workflows, StoreError};

/// What a committed step edge tells its parent.
struct Note {
    parent: Uuid,
    command: Command,
    /// The steps to look at once the parent has counted this one.
    then: Vec<Uuid>,
}

fn notes(results: &[WriteResult]) -> Vec<Note> {
    let mut out = vec![];
    for r in results.iter().filter(|r| r.committed()) {
        let (Some(job), Some(ev)) = (&r.job, &r.event) else {
            continue;
        };
        let Some(Membership::Step(link)) = &job.workflow else {
            continue;
        };
        let was_ended = ev.from_state.is_some_and(JobState::is_terminal);
        let command = if ev.to_state.is_terminal() && !was_ended {
            Command::StepFinished {
                step: link.step.clone(),
                job_id: job.job_id,
                status: StepStatus::of(ev.to_state),
                version: ev.version,
                reason: ev.reason,
            }
        } else if was_ended && !ev.to_state.is_terminal() {
            Command::StepReopened {
                step: link.step.clone(),
                job_id: job.job_id,
                previous: StepStatus::of(ev.from_state.expect("was ended")),
                version: ev.version,
            }
        } else {
            continue;
        };
        let then = match command {
            Command::StepFinished { .. } => link.then.clone(),
            _ => vec![],
        };
        out.push(Note {
            parent: link.parent,
            command,
            then,
        });
    }
    out
}

/// Everything that follows the committed edges in `first`, in the same
/// transaction, until nothing more follows: each finished or reopened step
/// is counted by its parent, then the steps waiting for a finished one are
/// released, cancelled or held, and their own ends are counted in turn.
pub(crate) async fn follow(conn: &mut PgConnection, first: &[WriteResult]) -> LedgerResult<()> {
    // Parents this transaction holds, as they are after its own writes: a
    // parent is locked once, however many of its steps end here.
    let mut held: HashMap<Uuid, (Job, chrono::DateTime<chrono::Utc>)> = HashMap::new();
    // Jobs this transaction wrote (and so holds): their state is known
    // without asking, for the steps that wait for them.
    let mut known: HashMap<Uuid, JobState> = written_states(first);
    let mut pending = notes(first);
    while !pending.is_empty() {
        // Every parent counts its steps first (one note per parent per
        // round: two notes are two versions); the steps waiting for them
        // are then decided once, on the states after all those ends (eight
        // branches of a fan-out ending in one batch release the join once).
        let mut dependents: Vec<Uuid> = vec![];
        while !pending.is_empty() {
            let (mut round, mut later) = (vec![], vec![]);
            let mut seen = HashSet::new();
            for n in pending {
                if seen.insert(n.parent) {
                    round.push(n);
                } else {
                    later.push(n);
                }
            }
            count_round(conn, &mut held, &round).await?;
            dependents.extend(round.into_iter().flat_map(|n| n.then));
            pending = later;
        }
        dependents.sort();
        dependents.dedup();
        if !dependents.is_empty() {
            let released = resolve(conn, &held, &known, &dependents).await?;
            known.extend(written_states(&released));
            pending = notes(&released);
        }
    }
    Ok(())
}

fn written_states(results: &[WriteResult]) -> HashMap<Uuid, JobState> {
    results
        .iter()
        .filter(|r| r.committed())
        .filter_map(|r| r.job.as_ref().map(|j| (j.job_id, j.state)))
        .collect()
}

/// Each note's parent counts it (at most one note per parent).
async fn count_round(
    conn: &mut PgConnection,
    held: &mut HashMap<Uuid, (Job, chrono::DateTime<chrono::Utc>)>,
    round: &[Note],
) -> LedgerResult<()> {
    let mut new: Vec<Uuid> = round
        .iter()
        .map(|n| n.parent)
        .filter(|p| !held.contains_key(p))
        .collect();
    new.sort();
    if !new.is_empty() {
        for (j, now) in engine::to_jobs(jobs::lock_jobs(conn, &new).await?)? {
            held.insert(j.job_id, (j, now));
        }
    }
    let mut decided = Vec::with_capacity(round.len());
    for n in round {
        // A purged parent has nobody left to count for: its steps ended. A
        // reopened step would run outside any workflow (a replay that raced
        // the purge past `transition_in`'s check): refused, nothing written.
        let Some((job, now)) = held.get(&n.parent) else {
            if matches!(n.command, Command::StepReopened { .. }) {
                return Err(LedgerError::BadInput(format!(
                    "workflow {} was purged: nothing could count this step any more",
                    n.parent
                )));
            }
            continue;
        };
        let d = decide(job, &n.command, &engine::ctx(*now, "workflow"));
        decided.push((job.clone(), d));
    }
    for w in engine::write_wave(conn, decided).await? {
        if !w.committed() {
            return Err(StoreError::Corrupt(format!(
                "workflow {} refused a step's edge: {}",
                w.job_id,
                w.detail.unwrap_or_default()
            ))
            .into());
        }
        if let Some(parent) = w.job {
            fan_in_if_due(conn, &parent).await?;
            let now = held
                .get(&parent.job_id)
                .map(|(_, t)| *t)
                .unwrap_or_else(chrono::Utc::now);
            held.insert(parent.job_id, (parent, now));
        }
    }
    Ok(())
}

/// A waiting step is locked only under its parent's lock (lock order in
/// ledger/workflow.rs): for the commands that can reach one, the parent is
/// locked first.
pub(crate) async fn lock_parent_first(
    conn: &mut PgConnection,
    job_id: Uuid,
    cmd: &Command,
) -> LedgerResult<()> {
    // A fenced observation comes from a holder: its job is held, never
    // waiting, so the worker's path pays no extra query.
    if matches!(
        cmd,
        Command::Cancel { .. } | Command::ReleaseHold { .. } | Command::Observe { fence: None, .. }
    ) {
        if let Some(parent) = workflows::parent_of_waiting(&mut *conn, job_id).await? {
            jobs::lock_jobs(conn, &[parent]).await?;
        }
    }
    Ok(())
}

/// The current state of each prerequisite of `jobs` (steps), by job id.
/// Those in `known` (written, so locked, by this transaction) are not read
/// again: in a chain the only prerequisite is the step that just ended.
async fn prerequisite_states(
    conn: &mut PgConnection,
    jobs: &[&Job],
    known: &HashMap<Uuid, JobState>,
) -> LedgerResult<HashMap<Uuid, JobState>> {
    let mut states = HashMap::new();
    let mut wanted: Vec<Uuid> = vec![];
    for id in jobs
        .iter()
        .filter_map(|j| match &j.workflow {
            Some(Membership::Step(l)) => Some(l.after.iter().map(|r| r.job_id)),
            _ => None,
        })
        .flatten()
    {
        match known.get(&id) {
            Some(s) => {
                states.insert(id, *s);
            }
            None => wanted.push(id),
        }
    }
    wanted.sort();
    wanted.dedup();
    if wanted.is_empty() {
        return Ok(states);
    }
    for (id, s) in workflows::states_of(&mut *conn, &wanted).await? {
        let s = JobState::parse(&s).ok_or_else(|| StoreError::Corrupt(format!("state {s:?} of {id}")))?;
        states.insert(id, s);
    }
    Ok(states)
}

/// `(step name, state)` of each prerequisite of `job`, in `after` order.
pub(crate) async fn prerequisites_of(
    conn: &mut PgConnection,
    job: &Job,
) -> LedgerResult<Vec<(String, JobState)>> {
    let states = prerequisite_states(conn, &[job], &HashMap::new()).await?;
    named(job, &states)
}

fn named(job: &Job, states: &HashMap<Uuid, JobState>) -> LedgerResult<Vec<(String, JobState)>> {
    let Some(Membership::Step(l)) = &job.workflow else {
        return Ok(vec![]);
    };
    l.after
        .iter()
        .map(|r| {
            let s = states.get(&r.job_id).copied().ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "prerequisite {} of step {} is gone",
                    r.job_id, job.job_id
                ))
            })?;
            Ok((r.step.clone(), s))
        })
        .collect()
}

/// Decides every waiting step in `ids` on its prerequisites' states now
/// (and on whether its workflow is being cancelled: `held` has the parents).
async fn resolve(
    conn: &mut PgConnection,
    held: &HashMap<Uuid, (Job, chrono::DateTime<chrono::Utc>)>,
    known: &HashMap<Uuid, JobState>,
    ids: &[Uuid],
) -> LedgerResult<Vec<WriteResult>> {
    let waiting = engine::to_jobs(workflows::lock_waiting(conn, ids).await?)?;
    let steps: Vec<&Job> = waiting.iter().map(|(j, _)| j).collect();
    let states = prerequisite_states(conn, &steps, known).await?;
    let mut decided = Vec::with_capacity(waiting.len());
    for (job, now) in waiting {
        let Some(Membership::Step(l)) = &job.workflow else {
            continue;
        };
        let workflow_cancelled = held
            .get(&l.parent)
            .and_then(|(p, _)| Tally::from_value(p.result.as_ref()))
            .is_some_and(|t| t.cancel_requested);
        let cmd = Command::Resolve {
            prerequisites: named(&job, &states)?,
            workflow_cancelled,
        };
        let d = decide(&job, &cmd, &engine::ctx(now, "workflow"));
        decided.push((job, d));
    }
    // A step still waiting for another prerequisite is refused here, which
    // is no news: only what was written counts.
    Ok(engine::write_wave(conn, decided)
        .await?
        .into_iter()
        .filter(WriteResult::committed)
        .collect())
}

/// Creates the fan-in step when every other step of `parent` has ended: in
/// this same transaction, under the parent's lock, once (a step replayed
/// after the fan-in was created does not create it again).
async fn fan_in_if_due(conn: &mut PgConnection, parent: &Job) -> LedgerResult<()> {
    let Some(Membership::Parent { fan_in: Some(f), .. }) = &parent.workflow else {
        return Ok(());
    };
    let open = Tally::from_value(parent.result.as_ref()).map_or(0, |t| t.open);
    if open != 1 || !workflows::states_of(&mut *conn, &[f.job_id]).await?.is_empty() {
        return Ok(());
    }
    // Every step the parent lists, also one already purged.
    let members: HashMap<Uuid, String> = workflows::members_of(&mut *conn, parent.job_id)
        .await?
        .into_iter()
        .filter(|(id, _)| *id != f.job_id)
        .collect();
    let ids: Vec<Uuid> = members.keys().copied().collect();
    let mut summary = serde_json::Map::new();
    for (id, state, reason) in workflows::ends_of(&mut *conn, &ids).await? {
        if let Some(step) = members.get(&id) {
            summary.insert(
                step.clone(),
                serde_json::json!({ "job_id": id, "state": state, "reason": reason }),
            );
        }
    }
    let new = NewJob {
        queue: f.queue.clone(),
        kind: f.kind.clone(),
        job_key: None,
        payload: serde_json::json!({ "workflow": parent.job_id, "steps": summary }),
        priority: f.priority,
        run_at: None,
        delay_ms: None,
        policy: f.policy.clone(),
        concurrency_key: None,
        unique_for_ms: None,
    };
    let tie = WorkflowTie::Step(StepLink {
        parent: parent.job_id,
        step: f.step.clone(),
        after: vec![],
        then: vec![],
        on_dependency_failure: DependencyPolicy::Run,
    });
    // The fan-in joins its workflow's trace, whoever ended the last step.
    let span = tracing::info_span!("fan_in", otel.name = "jobledger.fan_in", parent = %parent.job_id);
    crate::telemetry::place_for_job(&span, parent.traceparent.as_deref());
    super::enqueue::insert_drafts(conn, vec![(new, Some((f.job_id, tie)))], None, "api", None)
        .instrument(span)
        .await?;
    Ok(())
}
