//! The pure transition function: given the job as it is and what a caller
//! asks, either the one event that records the change, or why not.

use chrono::Duration;
use serde_json::{json, Value};
use uuid::Uuid;

use super::admission::Admission;
use super::apply::counters_after;
use super::command::{Command, Ctx, Fence, NewJob, Rejection};
use super::digest::{digest, event_hash, fmt_time, to_micros};
use super::event::{Event, EventBody};
use super::fence::{holding_for, holding_leased, release_digest};
use super::model::{
    ErrorClass, ExpiryPolicy, Job, JobState, NextAction, Policy, ReceiptPolicy, ReceiptStatus, ReleaseOp,
};
use super::reason::Reason;
use super::workflow::WorkflowTie;

/// An event before it is numbered and hashed.
pub(super) struct Draft {
    pub(super) body: EventBody,
    pub(super) to: JobState,
    pub(super) reason: Reason,
    pub(super) error_class: Option<ErrorClass>,
    pub(super) token: i64,
    pub(super) attempt: i32,
    pub(super) run: i32,
}

pub(super) fn draft(job: &Job, body: EventBody, to: JobState, reason: Reason) -> Draft {
    // The one rule for the counters, which `apply` checks on replay.
    let (token, attempt, run) = counters_after(job, &body);
    Draft {
        body,
        to,
        reason,
        error_class: None,
        token,
        attempt,
        run,
    }
}

fn seal(job: &Job, d: Draft, ctx: &Ctx) -> Event {
    let mut ev = Event {
        job_id: job.job_id,
        version: job.version + 1,
        epoch: job.epoch,
        token: d.token,
        attempt: d.attempt,
        run: d.run,
        from_state: Some(job.state),
        to_state: d.to,
        reason: d.reason,
        error_class: d.error_class,
        actor: ctx.actor.clone(),
        recorded_at: to_micros(ctx.now),
        body: d.body,
        prev_hash: Some(job.last_hash.clone()),
        hash: String::new(),
    };
    ev.hash = event_hash(&ev);
    ev
}

/// `ms` after now; saturates at the last representable instant instead of
/// overflowing (the ledger refuses such delays from outside before this).
fn later(ctx: &Ctx, ms: i64) -> chrono::DateTime<chrono::Utc> {
    let at = Duration::try_milliseconds(ms.max(0))
        .and_then(|d| ctx.now.checked_add_signed(d))
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
    to_micros(at)
}

/// The first event of a job.
/// `policy` is the resolved policy (the caller's, the kind's or the default).
pub fn decide_enqueue(job_id: Uuid, epoch: i64, new: &NewJob, policy: &Policy, ctx: &Ctx) -> Event {
    decide_enqueue_tied(job_id, epoch, new, policy, None, ctx)
}

/// The first event of a job that is a workflow's parent or step: a parent
/// starts `running`, a step with prerequisites `waiting`.
pub fn decide_enqueue_tied(
    job_id: Uuid,
    epoch: i64,
    new: &NewJob,
    policy: &Policy,
    tie: Option<&WorkflowTie>,
    ctx: &Ctx,
) -> Event {
    let (to_state, reason) = super::steps::initial(tie);
    let run_at = match (new.run_at, new.delay_ms) {
        (Some(at), _) => to_micros(at),
        (None, Some(ms)) => later(ctx, ms),
        (None, None) => to_micros(ctx.now),
    };
    let mut ev = Event {
        job_id,
        version: 1,
        epoch,
        token: 0,
        attempt: 0,
        run: 0,
        from_state: None,
        to_state,
        reason,
        error_class: None,
        actor: ctx.actor.clone(),
        recorded_at: to_micros(ctx.now),
        body: EventBody::Enqueued {
            queue: new.queue.clone(),
            kind: new.kind.clone(),
            job_key: new.job_key.clone(),
            payload: new.payload.clone(),
            payload_digest: digest(&new.payload),
            priority: new.priority,
            run_at,
            policy: policy.clone(),
            workflow: tie.cloned().map(Box::new),
            admission: admission_of(new, ctx),
            traceparent: ctx.trace.clone(),
        },
        prev_hash: None,
        hash: String::new(),
    };
    ev.hash = event_hash(&ev);
    ev
}

/// The terms a new job carries: its key, and the end of its window by
/// the clock of its enqueue.
fn admission_of(new: &NewJob, ctx: &Ctx) -> Option<Admission> {
    let a = Admission {
        concurrency_key: new.concurrency_key.clone(),
        unique_until: new.unique_for_ms.map(|ms| later(ctx, ms)),
    };
    (!a.is_empty()).then_some(a)
}

pub fn decide(job: &Job, cmd: &Command, ctx: &Ctx) -> Result<Event, Rejection> {
    let d = match cmd {
        Command::Claim { holder, lease_ms } => claim(job, holder, *lease_ms, ctx)?,
        Command::Heartbeat { fence, lease_ms } => {
            holding_leased(job, *fence)?;
            let body = EventBody::LeaseExtended {
                lease_until: later(ctx, *lease_ms),
            };
            draft(job, body, job.state, Reason::LeaseExtended)
        }
        Command::Progress {
            fence,
            step,
            lease_ms,
        } => {
            holding_leased(job, *fence)?;
            let body = EventBody::Progressed {
                step: step.clone(),
                lease_until: lease_ms.map(|ms| later(ctx, ms)),
            };
            draft(job, body, job.state, Reason::StepProgress)
        }
        Command::Complete { fence, result } => {
            let dg = release_digest(ReleaseOp::Complete, result.clone().unwrap_or(Value::Null));
            holding_for(job, *fence, ReleaseOp::Complete, &dg)?;
            let reason = after_cancel(job, Reason::Completed);
            // A JSON null result is no result: stored, `{"result": null}`
            // reads back as none, so a job that kept `Some(null)` differed
            // from its own replay (review of issue 15: `verify` refused it).
            let result = result.clone().filter(|v| !v.is_null());
            draft(
                job,
                EventBody::Succeeded { result, digest: dg },
                JobState::Succeeded,
                reason,
            )
        }
        Command::Submit { fence, receipt_id } => {
            let dg = release_digest(ReleaseOp::Submit, json!(receipt_id));
            holding_for(job, *fence, ReleaseOp::Submit, &dg)?;
            let body = EventBody::Submitted {
                receipt_id: receipt_id.clone(),
                receipt_deadline: later(ctx, job.policy.receipt_timeout_ms),
                digest: dg,
            };
            draft(
                job,
                body,
                JobState::AwaitingReceipt,
                after_cancel(job, Reason::Submitted),
            )
        }
        Command::Fail {
            fence,
            class,
            code,
            message,
        } => fail(job, *fence, *class, code, message, ctx)?,
        Command::ConfirmCancel { fence } => {
            let dg = release_digest(ReleaseOp::ConfirmCancel, Value::Null);
            holding_for(job, *fence, ReleaseOp::ConfirmCancel, &dg)?;
            if job.state != JobState::CancelRequested {
                return Err(Rejection::invalid("no cancel was requested"));
            }
            draft(
                job,
                EventBody::CancelConfirmed { digest: dg },
                JobState::Cancelled,
                Reason::CancelConfirmed,
            )
        }
        Command::Release { fence } => {
            let dg = release_digest(ReleaseOp::Release, Value::Null);
            holding_for(job, *fence, ReleaseOp::Release, &dg)?;
            let body = EventBody::Released { digest: dg };
            if job.state == JobState::CancelRequested {
                draft(job, body, JobState::Cancelled, Reason::CancelledBeforeStart)
            } else {
                draft(job, body, JobState::Queued, Reason::ReleasedUnstarted)
            }
        }
        Command::Snooze { fence, delay_ms } => {
            let dg = release_digest(ReleaseOp::Snooze, json!(delay_ms));
            holding_for(job, *fence, ReleaseOp::Snooze, &dg)?;
            if job.state != JobState::Leased {
                return Err(Rejection::invalid("cancel requested: a snooze would outlive it"));
            }
            let body = EventBody::Snoozed {
                run_at: later(ctx, *delay_ms),
                digest: dg,
            };
            draft(job, body, JobState::Queued, Reason::Snoozed)
        }
        Command::Observe {
            fence,
            key,
            data,
            existing,
        } => {
            if let Some(f) = fence.filter(|f| f.epoch != job.epoch) {
                return Err(Rejection::stale(format!(
                    "epoch {} is not this job's lifecycle",
                    f.epoch
                )));
            }
            let dg = digest(data);
            match existing {
                Some(e) if *e == dg => {
                    return Err(Rejection::already_committed(format!(
                        "observation {key} already recorded"
                    )))
                }
                Some(_) => {
                    return Err(Rejection::conflict(format!(
                        "observation {key} was recorded with different data"
                    )))
                }
                None => {}
            }
            let body = EventBody::Observed {
                key: key.clone(),
                data: data.clone(),
                digest: dg,
                by: *fence,
            };
            draft(job, body, job.state, Reason::Observation)
        }
        Command::Cancel { note } => cancel(job, note)?,
        Command::Receipt { receipt_id, status } => receipt(job, receipt_id, *status, ctx)?,
        Command::Replay { operator, note } => super::operator::replay(job, operator, note)?,
        Command::ResolveByOperator {
            operator,
            verdict,
            note,
            evidence,
            expected_version,
        } => super::operator::resolve(job, operator, *verdict, note, evidence, *expected_version)?,
        Command::Annotate {
            operator,
            corrects_position,
            corrects_version,
            note,
        } => super::operator::annotate(job, operator, *corrects_position, *corrects_version, note)?,
        Command::Expire => expire(job, ctx)?,
        Command::Purge => {
            if !job.state.is_terminal() {
                return Err(Rejection::invalid(format!(
                    "only terminal jobs are purged (job is {})",
                    job.state
                )));
            }
            draft(job, EventBody::Purged {}, job.state, Reason::Purged)
        }
        Command::StepFinished {
            step,
            job_id,
            status,
            version,
            reason,
        } => super::steps::finished(job, step, *job_id, *status, *version, *reason)?,
        Command::StepReopened {
            step,
            job_id,
            previous,
            version,
        } => super::steps::reopened(job, step, *job_id, *previous, *version)?,
        Command::Resolve {
            prerequisites,
            workflow_cancelled,
        } => super::steps::resolve(job, prerequisites, *workflow_cancelled)?,
        Command::ReleaseHold {
            operator,
            note,
            prerequisites,
        } => super::steps::release_hold(job, operator, note, prerequisites)?,
        Command::CancelWorkflow { note } => super::steps::cancel_workflow(job, note)?,
    };
    Ok(seal(job, d, ctx))
}

/// A holder that finishes after a cancel was requested says so in the reason.
fn after_cancel(job: &Job, normal: Reason) -> Reason {
    if job.state == JobState::CancelRequested {
        Reason::CancelAfterSubmit
    } else {
        normal
    }
}

fn claim(job: &Job, holder: &str, lease_ms: i64, ctx: &Ctx) -> Result<Draft, Rejection> {
    let lease_until = later(ctx, lease_ms);
    match job.state {
        JobState::Queued => {
            if job.run_at > ctx.now {
                return Err(Rejection::invalid(format!(
                    "not due before {}",
                    fmt_time(job.run_at)
                )));
            }
            let body = EventBody::Claimed {
                holder: holder.to_string(),
                lease_until,
                next_action: job.next_action,
            };
            Ok(draft(job, body, JobState::Leased, Reason::Claimed))
        }
        s if s.is_held() => {
            expired_lease(job, ctx)?;
            // A holder never takes over its own lease: the job is still
            // running in that process, which should heartbeat it, not start
            // it a second time. (A restarted process has a new holder id.)
            if job.holder.as_deref() == Some(holder) {
                return Err(Rejection::invalid(
                    "the lease is the claimer's own: heartbeat it instead",
                ));
            }
            if job.policy.on_lease_expiry != ExpiryPolicy::Reconcile {
                return Err(Rejection::invalid(format!(
                    "expired lease under policy {} is the sweeper's",
                    job.policy.on_lease_expiry
                )));
            }
            if let Some(d) = exhausted_on_expiry(job) {
                return Ok(d);
            }
            let body = EventBody::TakenOver {
                holder: holder.to_string(),
                previous_holder: job.holder.clone(),
                lease_until,
            };
            Ok(draft(job, body, job.state, Reason::LeaseExpiredTakeover))
        }
        s => Err(Rejection::invalid(format!("a {s} job cannot be claimed"))),
    }
}

fn expired_lease(job: &Job, ctx: &Ctx) -> Result<(), Rejection> {
    match job.lease_until {
        Some(until) if until > ctx.now => Err(Rejection::invalid(format!(
            "lease held until {}",
            fmt_time(until)
        ))),
        _ => Ok(()),
    }
}

/// A lease that expired on the last allowed attempt ends the job: a job that
/// keeps killing its workers must not be retried forever.
fn exhausted_on_expiry(job: &Job) -> Option<Draft> {
    if job.attempt < job.policy.max_attempts {
        return None;
    }
    let body = EventBody::LeaseExpired {
        previous_holder: job.holder.clone(),
    };
    let mut d = draft(job, body, JobState::Dead, Reason::AttemptsExhausted);
    d.error_class = Some(ErrorClass::Transient);
    Some(d)
}

fn fail(
    job: &Job,
    fence: Fence,
    class: ErrorClass,
    code: &str,
    message: &Option<String>,
    ctx: &Ctx,
) -> Result<Draft, Rejection> {
    let dg = release_digest(ReleaseOp::Fail, json!({ "class": class.as_str(), "code": code }));
    holding_for(job, fence, ReleaseOp::Fail, &dg)?;
    let retry_at = later(ctx, job.policy.backoff_ms(job.attempt, ctx.jitter));
    let (to, reason, run_at) = match class {
        ErrorClass::Permanent => (JobState::Dead, Reason::PermanentError, None),
        ErrorClass::Transient if job.state == JobState::CancelRequested => {
            (JobState::Cancelled, Reason::CancelledAfterFailure, None)
        }
        ErrorClass::Transient if job.attempt >= job.policy.max_attempts => {
            (JobState::Dead, Reason::AttemptsExhausted, None)
        }
        ErrorClass::Transient => (JobState::Queued, Reason::RetryScheduled, Some(retry_at)),
    };
    let body = EventBody::Failed {
        code: code.to_string(),
        message: message.clone(),
        digest: dg,
        run_at,
        // A reconcile that failed must still reconcile next time: the outside
        // world may have acted on the first execution.
        next_action: job.next_action,
    };
    let mut d = draft(job, body, to, reason);
    d.error_class = Some(class);
    Ok(d)
}

fn cancel(job: &Job, note: &Option<String>) -> Result<Draft, Rejection> {
    match job.state {
        JobState::Running | JobState::Failing => Err(Rejection::invalid(
            "a workflow is cancelled step by step (`workflow cancel`), not as one job",
        )),
        JobState::Queued | JobState::Waiting => Ok(draft(
            job,
            EventBody::Cancelled { note: note.clone() },
            JobState::Cancelled,
            Reason::CancelledBeforeStart,
        )),
        JobState::Leased => Ok(draft(
            job,
            EventBody::CancelRequested { note: note.clone() },
            JobState::CancelRequested,
            Reason::CancelRequested,
        )),
        JobState::CancelRequested | JobState::Cancelled => Err(Rejection::already_committed(format!(
            "job is already {}",
            job.state
        ))),
        JobState::AwaitingReceipt if job.reason == Reason::CancelAfterSubmit => Err(
            Rejection::already_committed("cancel already arrived after submit"),
        ),
        // The side effect was already submitted: a cancel cannot take it back.
        // It is recorded so "why did it still happen?" has an answer.
        JobState::AwaitingReceipt => Ok(draft(
            job,
            EventBody::CancelRefused { note: note.clone() },
            JobState::AwaitingReceipt,
            Reason::CancelAfterSubmit,
        )),
        s => Err(Rejection::invalid(format!(
            "job already ended as {s} ({})",
            job.reason
        ))),
    }
}

fn receipt(job: &Job, receipt_id: &str, status: ReceiptStatus, ctx: &Ctx) -> Result<Draft, Rejection> {
    let same_receipt = job.receipt_id.as_deref() == Some(receipt_id);
    if job.state != JobState::AwaitingReceipt {
        if same_receipt && status == ReceiptStatus::Succeeded && job.state == JobState::Succeeded {
            return Err(Rejection::already_committed(
                "receipt already resolved as succeeded",
            ));
        }
        return Err(Rejection::invalid(format!(
            "job is {}, not awaiting a receipt",
            job.state
        )));
    }
    if !same_receipt {
        return Err(Rejection::conflict(format!(
            "receipt {receipt_id} does not match the submitted {}",
            job.receipt_id.as_deref().unwrap_or("-")
        )));
    }
    let (to, reason, run_at, class) = match status {
        ReceiptStatus::Succeeded => (JobState::Succeeded, Reason::ReceiptSucceeded, None, None),
        ReceiptStatus::Pending => (JobState::AwaitingReceipt, Reason::ReceiptPending, None, None),
        ReceiptStatus::Failed if job.attempt >= job.policy.max_attempts => (
            JobState::Dead,
            Reason::AttemptsExhausted,
            None,
            Some(ErrorClass::Transient),
        ),
        ReceiptStatus::Failed => (
            JobState::Queued,
            Reason::ReceiptFailed,
            Some(later(ctx, job.policy.backoff_ms(job.attempt, ctx.jitter))),
            Some(ErrorClass::Transient),
        ),
    };
    let body = EventBody::ReceiptResolved {
        receipt_id: receipt_id.to_string(),
        status,
        run_at,
    };
    let mut d = draft(job, body, to, reason);
    d.error_class = class;
    Ok(d)
}

fn expire(job: &Job, ctx: &Ctx) -> Result<Draft, Rejection> {
    match job.state {
        s if s.is_held() => {
            expired_lease(job, ctx)?;
            if let Some(d) = exhausted_on_expiry(job) {
                return Ok(d);
            }
            let body = EventBody::LeaseExpired {
                previous_holder: job.holder.clone(),
            };
            let (to, reason) = match (job.policy.on_lease_expiry, s) {
                (ExpiryPolicy::Reconcile, _) => {
                    return Err(Rejection::invalid(
                        "reconcile policy: the next claim takes it over",
                    ))
                }
                (ExpiryPolicy::Requeue, JobState::CancelRequested) => {
                    (JobState::Cancelled, Reason::CancelledLeaseExpired)
                }
                (ExpiryPolicy::Requeue, _) => (JobState::Queued, Reason::LeaseExpiredRequeued),
                (ExpiryPolicy::Dead, _) => (JobState::Dead, Reason::LeaseExpiredUncertain),
            };
            let mut d = draft(job, body, to, reason);
            d.error_class = (to == JobState::Dead).then_some(ErrorClass::Transient);
            Ok(d)
        }
        JobState::AwaitingReceipt => {
            match job.receipt_deadline {
                Some(deadline) if deadline > ctx.now => {
                    return Err(Rejection::invalid(format!(
                        "receipt due by {}",
                        fmt_time(deadline)
                    )))
                }
                _ => {}
            }
            let body = EventBody::ReceiptTimedOut {
                receipt_id: job.receipt_id.clone(),
            };
            let (to, reason) = match job.policy.on_receipt_timeout {
                ReceiptPolicy::Dead => (JobState::Dead, Reason::ReceiptTimeout),
                ReceiptPolicy::Reconcile if job.attempt >= job.policy.max_attempts => {
                    (JobState::Dead, Reason::AttemptsExhausted)
                }
                ReceiptPolicy::Reconcile => (JobState::Queued, Reason::ReceiptTimeoutReconcile),
            };
            let mut d = draft(job, body, to, reason);
            d.error_class = Some(ErrorClass::Transient);
            Ok(d)
        }
        s => Err(Rejection::invalid(format!("nothing expires on a {s} job"))),
    }
}

/// What the next claim of a re-queued job must do.
pub fn next_action_after(body: &EventBody, current: NextAction) -> NextAction {
    match body {
        EventBody::Failed { next_action, .. } => *next_action,
        EventBody::ReceiptTimedOut { .. } => NextAction::Reconcile,
        EventBody::Replayed { .. } | EventBody::LeaseExpired { .. } | EventBody::ReceiptResolved { .. } => {
            NextAction::Execute
        }
        _ => current,
    }
}
