//! JSON lines on stdout; exit codes.

use serde::Serialize;
use serde_json::{json, Value};
use uuid::Uuid;

use jobledger::domain::{digest::fmt_time, Job, JobState, NextAction, Outcome, Reason};
use jobledger::ledger::{Enqueued, LedgerError, WriteResult};
use jobledger::store::TombstoneRow;

pub const OK: i32 = 0;
pub const FAILURE: i32 = 1;
pub const BAD_INPUT: i32 = 2;
pub const STALE: i32 = 3;
pub const CONFLICT: i32 = 4;
pub const INVALID_TRANSITION: i32 = 5;
pub const NOT_FOUND: i32 = 6;

pub fn line(v: &Value) {
    println!("{v}");
}

pub fn outcome_code(o: Outcome) -> i32 {
    match o {
        Outcome::Committed | Outcome::AlreadyCommitted => OK,
        Outcome::Stale => STALE,
        Outcome::Conflict => CONFLICT,
        Outcome::InvalidTransition => INVALID_TRANSITION,
    }
}

pub fn error_code(e: &anyhow::Error) -> i32 {
    match e.downcast_ref::<LedgerError>() {
        Some(LedgerError::BadInput(_) | LedgerError::TooLarge { .. }) => BAD_INPUT,
        Some(LedgerError::KeyConflict { .. }) => CONFLICT,
        Some(LedgerError::NotFound(_)) => NOT_FOUND,
        _ if e.downcast_ref::<BadInput>().is_some() => BAD_INPUT,
        _ => FAILURE,
    }
}

/// Bad input found by the CLI itself (unreadable JSON argument, ...).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// The job's current state, as `show` prints it.
pub fn job_json(j: &Job) -> Value {
    let t = |o: Option<chrono::DateTime<chrono::Utc>>| o.map(fmt_time);
    json!({
        "job_id": j.job_id, "queue": j.queue, "kind": j.kind, "key": j.job_key,
        "state": j.state, "reason": j.reason, "epoch": j.epoch, "token": j.token, "run": j.run,
        "attempt": j.attempt, "max_attempts": j.policy.max_attempts, "priority": j.priority,
        "next_action": j.next_action, "run_at": fmt_time(j.run_at), "lease_until": t(j.lease_until),
        "holder": j.holder, "step": j.step, "receipt_id": j.receipt_id,
        "receipt_deadline": t(j.receipt_deadline), "result": j.result, "last_error": j.last_error,
        "payload": j.payload, "version": j.version,
        "concurrency_key": j.admission.as_ref().and_then(|a| a.concurrency_key.clone()),
        "unique_until": t(j.admission.as_ref().and_then(|a| a.unique_until)),
        "created_at": fmt_time(j.created_at), "updated_at": fmt_time(j.updated_at),
    })
}

/// A fenced write's answer, as the CLI prints it and the API returns it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WriteAnswer {
    pub outcome: Outcome,
    pub job_id: Uuid,
    /// The job after the write (or as found when refused); absent if purged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<JobState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i32>,
    /// When a queued job is due.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub purged: bool,
    /// The log position of the appended event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<i64>,
    /// Why a write was refused, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl From<&WriteResult> for WriteAnswer {
    fn from(r: &WriteResult) -> Self {
        let j = r.job.as_ref();
        WriteAnswer {
            outcome: r.outcome,
            job_id: r.job_id,
            state: j.map(|j| j.state),
            reason: j.map(|j| j.reason),
            epoch: j.map(|j| j.epoch),
            token: j.map(|j| j.token),
            attempt: j.map(|j| j.attempt),
            run_at: j
                .filter(|j| j.state == JobState::Queued)
                .map(|j| fmt_time(j.run_at)),
            lease_until: j.and_then(|j| j.lease_until).map(fmt_time),
            purged: r.purged,
            position: r.position,
            detail: r.detail.clone(),
        }
    }
}

pub fn write_json(r: &WriteResult) -> Value {
    serde_json::to_value(WriteAnswer::from(r)).expect("plain data")
}

/// A lease a claim handed out: what the worker needs to do the work and to
/// write through the fence.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LeaseGrant {
    pub job_id: Uuid,
    pub epoch: i64,
    pub token: i64,
    pub attempt: i32,
    /// `execute`, or `reconcile` after a takeover: find out what the last
    /// holder did before doing it again.
    pub next_action: NextAction,
    pub queue: String,
    pub kind: String,
    pub key: Option<String>,
    #[schema(value_type = Object)]
    pub payload: Value,
    pub lease_until: Option<String>,
    /// The last progress step the previous holder recorded.
    pub step: Option<String>,
    /// The claim's span (W3C trace context) when the server traces: pass
    /// it on (as `traceparent`) so the handler's spans join the job's trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl From<&Job> for LeaseGrant {
    fn from(j: &Job) -> Self {
        LeaseGrant {
            job_id: j.job_id,
            epoch: j.epoch,
            token: j.token,
            attempt: j.attempt,
            next_action: j.next_action,
            queue: j.queue.clone(),
            kind: j.kind.clone(),
            key: j.job_key.clone(),
            payload: j.payload.clone(),
            lease_until: j.lease_until.map(fmt_time),
            step: j.step.clone(),
            traceparent: None,
        }
    }
}

impl LeaseGrant {
    /// The grant of a claimed lease, with its claim's trace.
    pub fn of(l: &jobledger::ledger::Lease) -> Option<Self> {
        let mut g = LeaseGrant::from(l.job()?);
        g.traceparent = l.trace().map(str::to_owned);
        Some(g)
    }
}

/// What is left of a purged job, as `show` and `GET /v1/jobs/{id}` print it.
pub fn tombstone_json(t: &TombstoneRow) -> Value {
    json!({
        "job_id": t.job_id, "state": t.state, "purged": true, "purged_at": fmt_time(t.purged_at),
        "queue": t.queue, "key": t.job_key, "epoch": t.epoch, "token": t.token, "version": t.version,
    })
}

/// An enqueue's answer, as `enqueue` and `POST /v1/jobs` print it.
pub fn enqueued_json(e: &Enqueued) -> Value {
    json!({
        "job_id": e.job.job_id, "epoch": e.job.epoch, "token": e.job.token,
        "state": e.job.state, "created": e.created, "position": e.position,
    })
}

/// A job as a search lists it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct JobSummary {
    pub job_id: Uuid,
    pub queue: String,
    pub kind: String,
    pub key: Option<String>,
    pub state: JobState,
    pub reason: Reason,
    pub attempt: i32,
    pub epoch: i64,
    pub token: i64,
    pub version: i64,
    pub created_at: String,
    pub updated_at: String,
}

impl From<&Job> for JobSummary {
    fn from(j: &Job) -> Self {
        JobSummary {
            job_id: j.job_id,
            queue: j.queue.clone(),
            kind: j.kind.clone(),
            key: j.job_key.clone(),
            state: j.state,
            reason: j.reason,
            attempt: j.attempt,
            epoch: j.epoch,
            token: j.token,
            version: j.version,
            created_at: fmt_time(j.created_at),
            updated_at: fmt_time(j.updated_at),
        }
    }
}

/// A progress bar with rate and ETA on a terminal's stderr; nothing when
/// stderr is not a terminal (indicatif hides itself).
pub fn progress_bar(len: u64, unit: &str) -> indicatif::ProgressBar {
    indicatif::ProgressBar::new(len).with_style(
        indicatif::ProgressStyle::with_template(&format!(
            "[{{bar:40}}] {{human_pos}}/{{human_len}} {unit}, ETA {{eta}}"
        ))
        .expect("template")
        .progress_chars("=> "),
    )
}

/// Draws a `Progress` that the operation advances (from any thread), with
/// rate and ETA, until dropped; nothing at all when stderr is not a
/// terminal. `bytes`: the unit is bytes (an audit reads compressed files).
pub struct Ticker {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    bar: Option<indicatif::ProgressBar>,
}

impl Ticker {
    pub fn start(progress: std::sync::Arc<jobledger::audit::Progress>, unit: &str, bytes: bool) -> Ticker {
        use std::sync::atomic::Ordering::Relaxed;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let bar = progress_bar(0, unit);
        if bytes {
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "[{bar:40}] {bytes}/{total_bytes} read, {bytes_per_sec}, ETA {eta}",
                )
                .expect("template")
                .progress_chars("=> "),
            );
        }
        if bar.is_hidden() {
            return Ticker {
                stop,
                thread: None,
                bar: None,
            };
        }
        // Not drawn until the total is known (an empty bar reads as done).
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        let halt = stop.clone();
        let shown = bar.clone();
        let thread = std::thread::spawn(move || {
            while !halt.load(Relaxed) {
                if bar.is_hidden() && progress.total.load(Relaxed) > 0 {
                    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                }
                bar.set_length(progress.total.load(Relaxed));
                bar.set_position(progress.done.load(Relaxed));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            bar.finish_and_clear();
        });
        Ticker {
            stop,
            thread: Some(thread),
            bar: Some(shown),
        }
    }

    /// Whether a bar is drawn (stderr is a terminal).
    pub fn drawing(&self) -> bool {
        self.bar.is_some()
    }

    /// The bar, for printing around it (`ProgressBar::suspend`).
    pub fn bar(&self) -> Option<indicatif::ProgressBar> {
        self.bar.clone()
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
