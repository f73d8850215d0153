//! Folding events into the projection. `verify` replays the log through this.

use thiserror::Error;

use super::decide::next_action_after;
use super::event::{Event, EventBody};
use super::model::{ErrorClass, Job, JobState, LastError, NextAction, ReceiptStatus, Release, ReleaseOp};
use super::reason::Reason;
use super::steps::initial;
use super::workflow::{parent_state, Membership, StepStatus, Tally, WorkflowTie};
use JobState::*;

#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApplyError {
    #[error("the first event must be `enqueued`, found `{0}`")]
    MissingEnqueue(&'static str),
    #[error("`enqueued` may only be the first event")]
    EnqueueNotFirst,
    #[error("version {got} follows version {expected_prev}")]
    VersionGap { expected_prev: i64, got: i64 },
    #[error("event says from {event}, job was {job}")]
    FromState { event: String, job: String },
    #[error("event belongs to epoch {event}, job has epoch {job}")]
    Epoch { event: i64, job: i64 },
    #[error("event belongs to another job")]
    JobId,
    #[error("no edge `{kind}` from {from} to {to}")]
    IllegalEdge {
        kind: &'static str,
        from: String,
        to: String,
    },
    #[error("chain broken: prev_hash does not match the previous event's hash")]
    Chain,
    #[error("workflow: {0}")]
    Workflow(String),
    #[error("operator's event: {0}")]
    Operator(String),
    #[error("annotation of version {corrects} in event version {at}: only earlier events are corrected")]
    AnnotationAhead { corrects: i64, at: i64 },
    #[error(
        "`{kind}` carries token {}, attempt {}, run {}; after the event before it they are {}, {}, {}",
        event.0, event.1, event.2, expected.0, expected.1, expected.2
    )]
    Counters {
        kind: &'static str,
        event: (i64, i32, i32),
        expected: (i64, i32, i32),
    },
}

/// The fencing token, attempt and run a job has after an event of kind
/// `body`: a claim or a takeover starts a new holding (a new token and
/// attempt), giving a job back unstarted (released, snoozed) returns the
/// attempt it took, a replay starts a new run from attempt 0, and every
/// other event keeps all three. `decide` drafts by this rule and `apply`
/// refuses an event that breaks it, so a token or attempt written around
/// the write path (a forged row resumed by a lease) shows in `verify`.
pub fn counters_after(prev: &Job, body: &EventBody) -> (i64, i32, i32) {
    let (token, attempt, run) = (prev.token, prev.attempt, prev.run);
    match body {
        EventBody::Claimed { .. } | EventBody::TakenOver { .. } => (token + 1, attempt + 1, run),
        EventBody::Released { .. } | EventBody::Snoozed { .. } => (token, (attempt - 1).max(0), run),
        EventBody::Replayed { .. } => (token, 0, run + 1),
        _ => (token, attempt, run),
    }
}

/// Every edge of the state machine: (event type, from, to). The diagram in
/// docs/state-machine.md is this table.
pub fn edge_allowed(body: &EventBody, from: JobState, to: JobState) -> bool {
    match body {
        EventBody::Enqueued { .. } => false,
        EventBody::Claimed { .. } => (from, to) == (Queued, Leased),
        EventBody::TakenOver { .. } => from.is_held() && to == from,
        EventBody::LeaseExtended { .. } | EventBody::Progressed { .. } => (from, to) == (Leased, Leased),
        EventBody::Succeeded { .. } => from.is_held() && to == Succeeded,
        EventBody::Submitted { .. } => from.is_held() && to == AwaitingReceipt,
        EventBody::Failed { .. } => matches!(
            (from, to),
            (Leased, Queued) | (Leased, Dead) | (CancelRequested, Cancelled) | (CancelRequested, Dead)
        ),
        EventBody::CancelRequested { .. } => {
            (from, to) == (Leased, CancelRequested) || (matches!(from, Running | Failing) && to == from)
        }
        EventBody::Cancelled { .. } => matches!((from, to), (Queued | Waiting, Cancelled)),
        EventBody::CancelConfirmed { .. } => (from, to) == (CancelRequested, Cancelled),
        EventBody::CancelRefused { .. } => (from, to) == (AwaitingReceipt, AwaitingReceipt),
        EventBody::ReceiptResolved { .. } => {
            from == AwaitingReceipt && matches!(to, Succeeded | Queued | Dead | AwaitingReceipt)
        }
        EventBody::ReceiptTimedOut { .. } => from == AwaitingReceipt && matches!(to, Dead | Queued),
        EventBody::LeaseExpired { .. } => matches!(
            (from, to),
            (Leased, Queued) | (Leased, Dead) | (CancelRequested, Cancelled) | (CancelRequested, Dead)
        ),
        EventBody::Released { .. } => matches!((from, to), (Leased, Queued) | (CancelRequested, Cancelled)),
        EventBody::Snoozed { .. } => (from, to) == (Leased, Queued),
        EventBody::Replayed { .. } => (from, to) == (Dead, Queued),
        EventBody::Observed { .. } => from == to,
        EventBody::Purged {} => from.is_terminal() && from == to,
        // The parent's target state is checked against its tally in `apply`.
        EventBody::StepFinished { .. } => matches!(from, Running | Failing) && to.is_parent_state(),
        EventBody::StepReopened { .. } => from.is_parent_state() && to.is_parent_state(),
        EventBody::DependenciesResolved { .. } => {
            from == Waiting && matches!(to, Queued | Cancelled | Waiting)
        }
        EventBody::HoldReleased { .. } => (from, to) == (Waiting, Queued),
        EventBody::ResolvedByOperator { .. } => {
            matches!(from, Dead | AwaitingReceipt) && matches!(to, Succeeded | Cancelled)
        }
        EventBody::Annotated { .. } => from == to,
    }
}

/// The projection after `ev`. Checks that the event continues the job's
/// stream (version, epoch, from-state, chain) and is a legal edge.
pub fn apply(job: Option<&Job>, ev: &Event) -> Result<Job, ApplyError> {
    let Some(prev) = job else { return first(ev) };
    check(prev, ev)?;
    let mut j = prev.clone();
    fold(&mut j, ev)?;
    Ok(j)
}

/// `apply`, consuming the job: no copy of it (the offline audit replays
/// millions of events). A refused event leaves nothing.
pub fn apply_owned(job: Option<Job>, ev: &Event) -> Result<Job, ApplyError> {
    let Some(mut j) = job else { return first(ev) };
    check(&j, ev)?;
    fold(&mut j, ev)?;
    Ok(j)
}

/// Whether `ev` may follow `prev`: the same job and lifecycle, the next
/// version, linked, from the state the job is in, along an allowed edge.
fn check(prev: &Job, ev: &Event) -> Result<(), ApplyError> {
    if let EventBody::Enqueued { .. } = ev.body {
        return Err(ApplyError::EnqueueNotFirst);
    }
    if ev.job_id != prev.job_id {
        return Err(ApplyError::JobId);
    }
    if ev.version != prev.version + 1 {
        return Err(ApplyError::VersionGap {
            expected_prev: prev.version,
            got: ev.version,
        });
    }
    if ev.epoch != prev.epoch {
        return Err(ApplyError::Epoch {
            event: ev.epoch,
            job: prev.epoch,
        });
    }
    if ev.from_state != Some(prev.state) {
        return Err(ApplyError::FromState {
            event: ev.from_state.map_or("-".into(), |s| s.to_string()),
            job: prev.state.to_string(),
        });
    }
    if ev.prev_hash.as_deref() != Some(prev.last_hash.as_str()) {
        return Err(ApplyError::Chain);
    }
    if !edge_allowed(&ev.body, prev.state, ev.to_state) {
        return Err(ApplyError::IllegalEdge {
            kind: ev.body.type_name(),
            from: prev.state.to_string(),
            to: ev.to_state.to_string(),
        });
    }
    let expected = counters_after(prev, &ev.body);
    if (ev.token, ev.attempt, ev.run) != expected {
        return Err(ApplyError::Counters {
            kind: ev.body.type_name(),
            event: (ev.token, ev.attempt, ev.run),
            expected,
        });
    }
    Ok(())
}

/// Folds an accepted event into the job.
fn fold(j: &mut Job, ev: &Event) -> Result<(), ApplyError> {
    let prev_reason = j.reason;
    j.token = ev.token;
    j.attempt = ev.attempt;
    j.run = ev.run;
    j.state = ev.to_state;
    j.reason = ev.reason;
    // A correction changes nothing about the job, not even its time.
    if !matches!(ev.body, EventBody::Annotated { .. }) {
        j.updated_at = ev.recorded_at;
    }
    j.version = ev.version;
    j.last_hash = ev.hash.clone();
    let release = |op, digest: &String| {
        Some(Release {
            token: ev.token,
            op,
            digest: digest.clone(),
        })
    };
    let error = |code: &str, message: Option<String>| {
        Some(LastError {
            class: ev.error_class.unwrap_or(ErrorClass::Transient),
            code: code.to_string(),
            message,
        })
    };
    if ev.to_state == Queued {
        j.next_action = next_action_after(&ev.body, j.next_action);
    }
    match &ev.body {
        EventBody::Enqueued { .. } => unreachable!("checked above"),
        EventBody::Claimed {
            holder,
            lease_until,
            next_action,
        } => {
            j.holder = Some(holder.clone());
            j.lease_until = Some(*lease_until);
            j.next_action = *next_action;
            j.receipt_id = None;
            j.receipt_deadline = None;
        }
        EventBody::TakenOver {
            holder, lease_until, ..
        } => {
            j.holder = Some(holder.clone());
            j.lease_until = Some(*lease_until);
            j.next_action = NextAction::Reconcile;
        }
        EventBody::LeaseExtended { lease_until } => j.lease_until = Some(*lease_until),
        EventBody::Progressed { step, lease_until } => {
            j.step = Some(step.clone());
            if let Some(until) = lease_until {
                j.lease_until = Some(*until);
            }
        }
        EventBody::Succeeded { result, digest } => {
            j.result = result.clone();
            j.release = release(ReleaseOp::Complete, digest);
            unlease(j);
        }
        EventBody::Submitted {
            receipt_id,
            receipt_deadline,
            digest,
        } => {
            j.receipt_id = Some(receipt_id.clone());
            j.receipt_deadline = Some(*receipt_deadline);
            j.release = release(ReleaseOp::Submit, digest);
            unlease(j);
        }
        EventBody::Failed {
            code,
            message,
            digest,
            run_at,
            ..
        } => {
            j.last_error = error(code, message.clone());
            j.release = release(ReleaseOp::Fail, digest);
            if let Some(at) = run_at {
                j.run_at = *at;
            }
            unlease(j);
        }
        EventBody::CancelRequested { .. } if ev.to_state != CancelRequested => {
            // A workflow's cancel: its tally remembers the request.
            let mut t = Tally::from_value(j.result.as_ref())
                .ok_or_else(|| ApplyError::Workflow("a workflow cancel on a job with no tally".into()))?;
            t.cancel_requested = true;
            j.result = Some(t.to_value());
        }
        EventBody::CancelRequested { .. } | EventBody::CancelRefused { .. } | EventBody::Observed { .. } => {}
        EventBody::Cancelled { .. } | EventBody::Purged {} => {}
        EventBody::CancelConfirmed { digest } => {
            j.release = release(ReleaseOp::ConfirmCancel, digest);
            unlease(j);
        }
        EventBody::ReceiptResolved { status, run_at, .. } => {
            if *status != ReceiptStatus::Pending {
                j.receipt_deadline = None;
            }
            if *status == ReceiptStatus::Failed {
                j.last_error = error("receipt_failed", None);
            }
            if let Some(at) = run_at {
                j.run_at = *at;
            }
        }
        EventBody::ReceiptTimedOut { .. } => {
            j.receipt_deadline = None;
            j.last_error = error("receipt_timeout", None);
            j.run_at = ev.recorded_at;
        }
        EventBody::LeaseExpired { .. } => {
            j.last_error = error("lease_expired", None);
            j.run_at = ev.recorded_at;
            unlease(j);
        }
        EventBody::Released { digest } => {
            j.release = release(ReleaseOp::Release, digest);
            j.run_at = ev.recorded_at;
            unlease(j);
        }
        EventBody::Snoozed { run_at, digest } => {
            j.release = release(ReleaseOp::Snooze, digest);
            j.run_at = *run_at;
            unlease(j);
        }
        EventBody::Replayed { .. } => {
            j.run_at = ev.recorded_at;
            j.result = None;
            j.receipt_id = None;
            j.receipt_deadline = None;
            unlease(j);
        }
        EventBody::StepFinished { status, .. } => tally(j, ev, StepStatus::Open, *status)?,
        EventBody::StepReopened { previous, .. } => tally(j, ev, *previous, StepStatus::Open)?,
        EventBody::DependenciesResolved { .. } | EventBody::HoldReleased { .. } => {
            if !matches!(j.workflow, Some(Membership::Step(_))) {
                return Err(ApplyError::Workflow(
                    "a dependency event on a job that is no step".into(),
                ));
            }
        }
        // A verdict on a step would leave its parent's count behind.
        EventBody::ResolvedByOperator { .. } if j.workflow.is_some() => {
            return Err(ApplyError::Workflow(
                "an operator's verdict on a workflow's parent or step".into(),
            ))
        }
        EventBody::ResolvedByOperator {
            operator,
            note,
            evidence,
            evidence_digest,
        } => {
            let why = if ev.reason != Reason::ResolvedByOperator {
                Some("its reason is not resolved_by_operator")
            } else if operator.trim().is_empty() || note.trim().is_empty() {
                Some("no operator or no reason")
            } else if *evidence_digest != crate::domain::digest(evidence) {
                Some("the evidence digest does not match the evidence")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(ApplyError::Operator(why.into()));
            }
            j.receipt_deadline = None;
            unlease(j);
        }
        EventBody::Annotated {
            corrects_version,
            operator,
            note,
            ..
        } => {
            if *corrects_version < 1 || *corrects_version >= ev.version {
                return Err(ApplyError::AnnotationAhead {
                    corrects: *corrects_version,
                    at: ev.version,
                });
            }
            if ev.reason != prev_reason || operator.trim().is_empty() || note.trim().is_empty() {
                return Err(ApplyError::Operator(
                    "an annotation keeps the job's reason and names an operator and a reason".into(),
                ));
            }
        }
    }
    Ok(())
}

/// Moves one step in the parent's tally and checks that the event's state
/// is the rule table's answer for the new tally.
fn tally(j: &mut Job, ev: &Event, from: StepStatus, to: StepStatus) -> Result<(), ApplyError> {
    if !matches!(j.workflow, Some(Membership::Parent { .. })) {
        return Err(ApplyError::Workflow(
            "a step event on a job that is no workflow".into(),
        ));
    }
    let t = Tally::from_value(j.result.as_ref())
        .and_then(|t| t.moved(from, to))
        .map(|mut t| {
            // A reopened step is new work: a later cancel is a new request.
            t.cancel_requested &= to != StepStatus::Open;
            t
        })
        .ok_or_else(|| ApplyError::Workflow(format!("no step counted as {from} is left to end as {to}")))?;
    if ev.to_state != parent_state(t) {
        return Err(ApplyError::Workflow(format!(
            "the event says {}, the steps say {}",
            ev.to_state,
            parent_state(t)
        )));
    }
    j.result = Some(t.to_value());
    Ok(())
}

fn unlease(j: &mut Job) {
    j.lease_until = None;
    j.holder = None;
}

fn first(ev: &Event) -> Result<Job, ApplyError> {
    let EventBody::Enqueued {
        queue,
        kind,
        job_key,
        payload,
        payload_digest,
        priority,
        run_at,
        policy,
        workflow,
        admission,
        traceparent,
    } = &ev.body
    else {
        return Err(ApplyError::MissingEnqueue(ev.body.type_name()));
    };
    if (ev.token, ev.attempt, ev.run) != (0, 0, 0) {
        return Err(ApplyError::Counters {
            kind: "enqueued",
            event: (ev.token, ev.attempt, ev.run),
            expected: (0, 0, 0),
        });
    }
    let workflow = workflow.as_deref();
    if (ev.to_state, ev.reason) != initial(workflow) {
        return Err(ApplyError::IllegalEdge {
            kind: "enqueued",
            from: "-".into(),
            to: ev.to_state.to_string(),
        });
    }
    let result = match workflow {
        Some(t @ WorkflowTie::Parent { .. }) => match t.membership() {
            Membership::Parent { steps, .. } => Some(Tally::new(steps).to_value()),
            Membership::Step(_) => unreachable!("a parent tie is a parent"),
        },
        _ => None,
    };
    if ev.version != 1 {
        return Err(ApplyError::VersionGap {
            expected_prev: 0,
            got: ev.version,
        });
    }
    if ev.prev_hash.is_some() {
        return Err(ApplyError::Chain);
    }
    Ok(Job {
        job_id: ev.job_id,
        queue: queue.clone(),
        kind: kind.clone(),
        job_key: job_key.clone(),
        epoch: ev.epoch,
        token: ev.token,
        run: ev.run,
        attempt: ev.attempt,
        state: ev.to_state,
        priority: *priority,
        payload: payload.clone(),
        payload_digest: payload_digest.clone(),
        policy: policy.clone(),
        run_at: *run_at,
        lease_until: None,
        holder: None,
        next_action: NextAction::Execute,
        step: None,
        receipt_id: None,
        receipt_deadline: None,
        result,
        release: None,
        last_error: None,
        reason: ev.reason,
        created_at: ev.recorded_at,
        updated_at: ev.recorded_at,
        version: 1,
        last_hash: ev.hash.clone(),
        workflow: workflow.map(WorkflowTie::membership),
        admission: admission.clone(),
        traceparent: traceparent.clone(),
    })
}
