//! A job's story in plain words (note 003): "queued; taken by worker-3; the
//! provider timed out; retry planned at 10:42; cancelled by alice before the
//! retry → cancelled". One sentence per event, written from the event's
//! kind, reason code and data — never from free text alone — so the
//! console's job page and `history --story` tell the same story.

use chrono::{DateTime, Utc};

use crate::domain::digest::fmt_time;
use crate::domain::{Event, EventBody, JobState, Reason};
use crate::store::rejections::RejectionRow;

fn at(t: &DateTime<Utc>) -> String {
    fmt_time(*t)
}

fn said(note: &Option<String>) -> String {
    note.as_ref().map(|n| format!(": “{n}”")).unwrap_or_default()
}

/// The sentence for one event, ending in "→ STATE" when it ended the job.
pub fn sentence(e: &Event) -> String {
    let mut s = body_words(e);
    if e.to_state.is_terminal() && e.from_state != Some(e.to_state) {
        s.push_str(&format!(" → {}", e.to_state));
    }
    super::validate::one_line(&s)
}

fn body_words(e: &Event) -> String {
    let who = &e.actor;
    match &e.body {
        EventBody::Enqueued { queue, kind, .. } => {
            let waits = if e.to_state == JobState::Waiting {
                ", waiting for its prerequisites"
            } else {
                ""
            };
            format!("enqueued by {who} as {kind} in {queue}{waits}")
        }
        _ => more_words(e),
    }
}

fn more_words(e: &Event) -> String {
    let who = &e.actor;
    match &e.body {
        EventBody::Claimed { holder, .. } => format!("taken by {holder} (attempt {})", e.attempt),
        EventBody::TakenOver { holder, previous_holder, .. } => format!(
            "taken over by {holder} after the lease of {} expired; it must first find out what that holder did",
            previous_holder.as_deref().unwrap_or("the previous holder")
        ),
        EventBody::LeaseExtended { lease_until } => format!("{who} extended its lease to {}", at(lease_until)),
        EventBody::Progressed { step, .. } => format!("{who} reached step {step:?}"),
        EventBody::Succeeded { .. } => format!("completed by {who}"),
        EventBody::Submitted { receipt_id, receipt_deadline, .. } => format!(
            "handed to the outside world by {who}; waiting for receipt {receipt_id:?} until {}",
            at(receipt_deadline)
        ),
        EventBody::Failed { code, message, run_at, .. } => failed_words(e, code, message, run_at),
        EventBody::CancelRequested { note } => {
            format!("{who} asked for a cancel{}; the worker stops at its next step boundary", said(note))
        }
        EventBody::Cancelled { note } => match e.reason {
            Reason::CancelledAfterFailure => format!("cancelled by {who} before the retry{}", said(note)),
            Reason::DependencyFailed => "cancelled: a prerequisite failed".to_string(),
            _ => format!("cancelled by {who} before it started{}", said(note)),
        },
        EventBody::CancelConfirmed { .. } => format!("{who} stopped and confirmed the cancel"),
        EventBody::CancelRefused { note } => format!(
            "{who}'s cancel was refused{}: the work was already handed to the outside world",
            said(note)
        ),
        EventBody::ReceiptResolved { receipt_id, status, .. } => format!("receipt {receipt_id:?} arrived: {status}"),
        EventBody::ReceiptTimedOut { .. } => "no receipt arrived in time".to_string(),
        EventBody::LeaseExpired { previous_holder } => format!(
            "the lease of {} expired ({})",
            previous_holder.as_deref().unwrap_or("its holder"),
            e.reason
        ),
        EventBody::Released { .. } => format!("{who} gave it back unstarted (no attempt used)"),
        EventBody::Snoozed { run_at, .. } => format!("{who} snoozed it until {}", at(run_at)),
        EventBody::Replayed { operator, note } => format!("replayed by {operator}: “{note}”"),
        EventBody::Observed { key, .. } => format!("{who} recorded evidence {key:?}"),
        EventBody::Purged {} => "purged (its events stay in the log)".to_string(),
        EventBody::StepFinished { step, status, .. } => format!("step {step:?} ended {status}"),
        EventBody::StepReopened { step, .. } => format!("step {step:?} was reopened"),
        EventBody::DependenciesResolved { failed: None } => "all prerequisites succeeded: released".to_string(),
        EventBody::DependenciesResolved { failed: Some(p) } => format!("prerequisite {p:?} failed ({})", e.reason),
        EventBody::HoldReleased { operator, note } => format!("{operator} released the hold: “{note}”"),
        EventBody::ResolvedByOperator { operator, note, .. } => {
            format!("resolved by {operator} after checking by hand: “{note}”")
        }
        EventBody::Annotated { operator, corrects_version, note, .. } => {
            format!("{operator} corrected v{corrects_version}: “{note}”")
        }
        EventBody::Enqueued { .. } => unreachable!("handled by body_words"),
    }
}

fn failed_words(e: &Event, code: &str, message: &Option<String>, run_at: &Option<DateTime<Utc>>) -> String {
    let why = match message {
        Some(m) => format!("{code}: {m}"),
        None => code.to_string(),
    };
    match (e.reason, run_at) {
        (_, Some(t)) => format!("failed ({why}); retry planned at {}", at(t)),
        (Reason::PermanentError, None) => format!("failed permanently ({why})"),
        (Reason::AttemptsExhausted, None) => format!("failed ({why}) with no attempts left"),
        _ => format!("failed ({why})"),
    }
}

/// A write the fence refused, in words.
pub fn refused(r: &RejectionRow) -> String {
    let s = format!(
        "refused: {} by {} with token {} was {} ({})",
        r.command,
        r.actor,
        r.token.map_or("-".into(), |t| t.to_string()),
        r.outcome,
        r.detail
    );
    super::validate::one_line(&s)
}
