//! `decide` for workflow commands: the parent's tally moves by exactly one
//! step per event, and a waiting step goes, waits, is held or is cancelled
//! by the rule in `workflow::release`.

use super::command::Rejection;
use super::decide::{draft, Draft};
use super::event::EventBody;
use super::model::{Job, JobState};
use super::reason::Reason;
use super::workflow::{parent_state, release, Membership, Release, StepStatus, Tally, WorkflowTie};
use uuid::Uuid;

/// The state and reason of a job's first event.
pub(crate) fn initial(tie: Option<&WorkflowTie>) -> (JobState, Reason) {
    match tie {
        Some(WorkflowTie::Parent { .. }) => (JobState::Running, Reason::WorkflowStarted),
        Some(WorkflowTie::Step(l)) if !l.after.is_empty() => {
            (JobState::Waiting, Reason::WaitingForDependencies)
        }
        _ => (JobState::Queued, Reason::New),
    }
}

fn tally_of(job: &Job) -> Result<Tally, Rejection> {
    if !matches!(job.workflow, Some(Membership::Parent { .. })) {
        return Err(Rejection::invalid("not a workflow"));
    }
    Tally::from_value(job.result.as_ref()).ok_or_else(|| Rejection::invalid("the workflow has no tally"))
}

pub(super) fn finished(
    job: &Job,
    step: &str,
    job_id: Uuid,
    status: StepStatus,
    version: i64,
    reason: Reason,
) -> Result<Draft, Rejection> {
    if status == StepStatus::Open {
        return Err(Rejection::invalid("an open step has not finished"));
    }
    let tally = tally_of(job)?
        .moved(StepStatus::Open, status)
        .ok_or_else(|| Rejection::invalid("every step of the workflow is already counted as ended"))?;
    let body = EventBody::StepFinished {
        step: step.to_string(),
        job_id,
        status,
        version,
        reason,
    };
    Ok(draft(job, body, parent_state(tally), Reason::StepFinished))
}

pub(super) fn reopened(
    job: &Job,
    step: &str,
    job_id: Uuid,
    previous: StepStatus,
    version: i64,
) -> Result<Draft, Rejection> {
    let tally = tally_of(job)?
        .moved(previous, StepStatus::Open)
        .ok_or_else(|| Rejection::invalid(format!("no step of the workflow is counted as {previous}")))?;
    let body = EventBody::StepReopened {
        step: step.to_string(),
        job_id,
        previous,
        version,
    };
    Ok(draft(job, body, parent_state(tally), Reason::StepReopened))
}

pub(super) fn resolve(
    job: &Job,
    prerequisites: &[(String, JobState)],
    workflow_cancelled: bool,
) -> Result<Draft, Rejection> {
    let Some(Membership::Step(link)) = &job.workflow else {
        return Err(Rejection::invalid("not a workflow step"));
    };
    if job.state != JobState::Waiting {
        return Err(Rejection::invalid(format!(
            "the step is {}, not waiting",
            job.state
        )));
    }
    if workflow_cancelled {
        // Never released into a workflow being cancelled, whatever its policy.
        let body = EventBody::Cancelled {
            note: Some("workflow cancelled".into()),
        };
        return Ok(draft(
            job,
            body,
            JobState::Cancelled,
            Reason::CancelledBeforeStart,
        ));
    }
    let (to, reason, failed) = match release(link.on_dependency_failure, prerequisites) {
        Release::Go { failed: None } => (JobState::Queued, Reason::DependenciesMet, None),
        Release::Go { failed } => (JobState::Queued, Reason::DependencyFailedRun, failed),
        Release::Cancel { failed } => (JobState::Cancelled, Reason::DependencyFailed, Some(failed)),
        Release::Hold { .. } if job.reason == Reason::DependencyHeld => {
            return Err(Rejection::already_committed("the step is already held"))
        }
        Release::Hold { failed } => (JobState::Waiting, Reason::DependencyHeld, Some(failed)),
        // Held, but what failed was replayed and succeeded: the step waits
        // for the others again, not for a person.
        Release::Wait { .. } if job.reason == Reason::DependencyHeld => {
            (JobState::Waiting, Reason::WaitingForDependencies, None)
        }
        Release::Wait { open } => {
            return Err(Rejection::invalid(format!("waiting for {}", open.join(", "))));
        }
    };
    Ok(draft(job, EventBody::DependenciesResolved { failed }, to, reason))
}

pub(super) fn release_hold(
    job: &Job,
    operator: &str,
    note: &str,
    prerequisites: &[(String, JobState)],
) -> Result<Draft, Rejection> {
    if job.state != JobState::Waiting || job.reason != Reason::DependencyHeld {
        return Err(Rejection::invalid(format!(
            "only a held step is released (this one is {}, {})",
            job.state, job.reason
        )));
    }
    let open: Vec<&str> = prerequisites
        .iter()
        .filter(|(_, s)| !s.is_terminal())
        .map(|(n, _)| n.as_str())
        .collect();
    if !open.is_empty() {
        return Err(Rejection::invalid(format!(
            "still waiting for {}: a held step goes once every prerequisite has ended",
            open.join(", ")
        )));
    }
    let body = EventBody::HoldReleased {
        operator: operator.to_string(),
        note: note.to_string(),
    };
    Ok(draft(job, body, JobState::Queued, Reason::HoldReleased))
}

pub(super) fn cancel_workflow(job: &Job, note: &Option<String>) -> Result<Draft, Rejection> {
    if !matches!(job.workflow, Some(Membership::Parent { .. })) {
        return Err(Rejection::invalid("not a workflow"));
    }
    match job.state {
        JobState::Running | JobState::Failing if tally_of(job)?.cancel_requested => Err(
            Rejection::already_committed("the workflow's cancel was already requested"),
        ),
        JobState::Running | JobState::Failing => Ok(draft(
            job,
            EventBody::CancelRequested { note: note.clone() },
            job.state,
            Reason::CancelRequested,
        )),
        s => Err(Rejection::invalid(format!("the workflow already ended as {s}"))),
    }
}
