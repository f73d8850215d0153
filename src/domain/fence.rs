//! The fence as the pure state machine sees it: whether a writer holding
//! `(epoch, token)` still holds the job, and how a retried write is answered.

use serde_json::{json, Value};

use super::command::{Fence, Rejection};
use super::digest::digest;
use super::model::{Job, JobState, Release, ReleaseOp};

/// Whose turn it is, as far as a fenced writer is concerned.
pub(crate) enum Tenure<'a> {
    Holding,
    Released(&'a Release),
}

pub(crate) fn tenure(job: &Job, fence: Fence) -> Result<Tenure<'_>, Rejection> {
    if fence.epoch != job.epoch {
        return Err(Rejection::stale(format!(
            "epoch {} is not this job's lifecycle (epoch {})",
            fence.epoch, job.epoch
        )));
    }
    if fence.token == job.token && job.state.is_held() {
        return Ok(Tenure::Holding);
    }
    if let Some(r) = job.release.as_ref().filter(|r| r.token == fence.token) {
        return Ok(Tenure::Released(r));
    }
    Err(if fence.token > job.token {
        Rejection::stale(format!(
            "token {} was never issued (current {})",
            fence.token, job.token
        ))
    } else if fence.token < job.token {
        Rejection::stale(format!(
            "token {} was superseded by token {}",
            fence.token, job.token
        ))
    } else {
        Rejection::stale(format!(
            "token {} no longer holds the job (now {})",
            fence.token, job.state
        ))
    })
}

/// A retried token-ending write: the same op and digest is the lost-response
/// case; anything else is a different result for the same token.
pub(crate) fn retried(r: &Release, op: ReleaseOp, digest: &str) -> Rejection {
    if r.op == op && r.digest == digest {
        Rejection::already_committed(format!("token {} already committed this {}", r.token, op))
    } else {
        Rejection::conflict(format!(
            "token {} already committed a different result ({} {})",
            r.token, r.op, r.digest
        ))
    }
}

/// Checks the fence for a write that ends the token's tenure.
pub(crate) fn holding_for(job: &Job, fence: Fence, op: ReleaseOp, digest: &str) -> Result<(), Rejection> {
    match tenure(job, fence)? {
        Tenure::Holding => Ok(()),
        Tenure::Released(r) => Err(retried(r, op, digest)),
    }
}

/// Checks the fence for a write made while working (heartbeat, progress).
pub(crate) fn holding_leased(job: &Job, fence: Fence) -> Result<(), Rejection> {
    match tenure(job, fence)? {
        Tenure::Released(r) => Err(Rejection::invalid(format!(
            "token {} already ended its lease ({})",
            r.token, r.op
        ))),
        Tenure::Holding if job.state == JobState::CancelRequested => Err(Rejection::invalid(
            "cancel requested: stop at the next step boundary and confirm-cancel",
        )),
        Tenure::Holding => Ok(()),
    }
}

pub(crate) fn release_digest(op: ReleaseOp, value: Value) -> String {
    digest(&json!({ "op": op.as_str(), "value": value }))
}
