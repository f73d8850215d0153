//! `decide` for what a person does by hand: replay a dead job, resolve a
//! job nothing else will finish with a verdict and evidence, annotate an
//! earlier event. Manual fixes are transitions, never table edits.

use serde_json::Value;

use super::command::Rejection;
use super::decide::{draft, Draft};
use super::digest::digest;
use super::event::EventBody;
use super::model::{Job, JobState};
use super::reason::Reason;
use super::workflow::Membership;

pub(super) fn replay(job: &Job, operator: &str, note: &str) -> Result<Draft, Rejection> {
    if matches!(job.workflow, Some(Membership::Parent { .. })) {
        return Err(Rejection::invalid(
            "a workflow is not replayed: replay its dead step, and the workflow reopens",
        ));
    }
    if job.state != JobState::Dead {
        return Err(Rejection::invalid(format!(
            "only dead jobs are replayed (job is {})",
            job.state
        )));
    }
    let body = EventBody::Replayed {
        operator: operator.to_string(),
        note: note.to_string(),
    };
    Ok(draft(job, body, JobState::Queued, Reason::ReplayedByOperator))
}

/// A verdict from `dead` or `awaiting_receipt` to `succeeded` or
/// `cancelled`, decided against the version the operator looked at: the
/// second of two operators finds the job moved and is refused as stale.
pub(super) fn resolve(
    job: &Job,
    operator: &str,
    verdict: JobState,
    note: &str,
    evidence: &Value,
    expected_version: i64,
) -> Result<Draft, Rejection> {
    if !matches!(verdict, JobState::Succeeded | JobState::Cancelled) {
        return Err(Rejection::invalid(format!(
            "a verdict is succeeded or cancelled, not {verdict}"
        )));
    }
    if note.trim().is_empty() {
        return Err(Rejection::invalid("a resolution needs a reason"));
    }
    if expected_version != job.version {
        return Err(Rejection::stale(format!(
            "the job moved since version {expected_version}: it is {} at version {}",
            job.state, job.version
        )));
    }
    // A step's verdict would have to move its parent's count and its
    // dependents (a dead step resolved as succeeded releases them): not
    // decided yet, so refused rather than half done.
    if job.workflow.is_some() {
        return Err(Rejection::invalid(
            "a workflow's parent or step is not resolved by hand: replay the dead step or cancel the workflow",
        ));
    }
    if !matches!(job.state, JobState::Dead | JobState::AwaitingReceipt) {
        return Err(Rejection::invalid(format!(
            "only dead jobs and jobs awaiting a receipt are resolved by hand (job is {})",
            job.state
        )));
    }
    let body = EventBody::ResolvedByOperator {
        operator: operator.to_string(),
        note: note.to_string(),
        evidence: evidence.clone(),
        evidence_digest: digest(evidence),
    };
    Ok(draft(job, body, verdict, Reason::ResolvedByOperator))
}

/// A correction of this job's event `corrects_version` (at
/// `corrects_position`), in any state: the job stays as it is.
pub(super) fn annotate(
    job: &Job,
    operator: &str,
    corrects_position: i64,
    corrects_version: i64,
    note: &str,
) -> Result<Draft, Rejection> {
    if note.trim().is_empty() {
        return Err(Rejection::invalid("an annotation needs a reason"));
    }
    if !(1..=job.version).contains(&corrects_version) {
        return Err(Rejection::invalid(format!(
            "version {corrects_version} is not an event of this job (versions 1 to {})",
            job.version
        )));
    }
    let body = EventBody::Annotated {
        operator: operator.to_string(),
        corrects_position,
        corrects_version,
        note: note.to_string(),
    };
    // The job's own reason stays: a correction is no cause of its state.
    Ok(draft(job, body, job.state, job.reason))
}
