//! The claim loop, the per-job task, and writing a handler's outcome.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;
use uuid::Uuid;

use super::background::{self, InFlight};
use super::committer;
use super::handler::{BoxFuture, HandlerOutcome, JobContext, Signal, StopReason};
use super::metrics as m;
use super::{Config, Counters, WorkerReport};
use crate::domain::{ErrorClass, Outcome};
use crate::ledger::{Lease, Ledger, LedgerResult, WriteResult};

/// Test hooks: gates between the runtime's steps.
#[derive(Clone, Default)]
#[allow(clippy::type_complexity)]
pub struct Hooks {
    /// Runs after a claim committed and before its jobs start.
    pub after_claim: Option<Arc<dyn Fn(Vec<Uuid>) -> BoxFuture<()> + Send + Sync>>,
    /// Runs before each batch of heartbeats: blocking it freezes the worker's
    /// lease keeping, as a stalled process would.
    pub before_heartbeat: Option<Arc<dyn Fn() -> BoxFuture<()> + Send + Sync>>,
    /// Runs each time the claim loop has claimed what it could and is about
    /// to wait for a wake-up (a notification, a freed slot, the poll): a
    /// test knows from it that only a wake-up starts the next claim.
    pub idle: Option<Arc<dyn Fn() -> BoxFuture<()> + Send + Sync>>,
}

struct Shared {
    ledger: Ledger,
    cfg: Arc<Config>,
    counters: Arc<Counters>,
    inflight: InFlight,
    committer: mpsc::Sender<committer::Item>,
    /// A handler finished: its slot is free before its outcome is written,
    /// so claiming the next jobs overlaps writing the last ones.
    freed: Notify,
    /// The handlers' recent run time (for the default prefetch).
    pace: super::pace::Pace,
    /// Jobs held that wait for a slot (claimed ahead).
    waiting: std::sync::atomic::AtomicUsize,
    /// Tells waiting jobs to check whether they are beyond the prefetch.
    shed: Notify,
}

impl Shared {
    /// Whether one waiting job should be given back: more are waiting than
    /// the prefetch allows now. Takes that job off the count if so.
    fn take_excess(&self) -> bool {
        let allowed = self
            .cfg
            .prefetch
            .now(self.cfg.concurrency, self.pace.average(self.cfg.concurrency));
        self.waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                (w > allowed).then(|| w - 1)
            })
            .is_ok()
    }
}

pub(crate) async fn run(
    ledger: Ledger,
    cfg: Arc<Config>,
    counters: Arc<Counters>,
    shutdown: CancellationToken,
) -> LedgerResult<WorkerReport> {
    for (kind, policy) in &cfg.policies {
        for q in &cfg.queues {
            ledger.register_policy(q, kind, policy).await?;
        }
    }
    let inflight: InFlight = Arc::new(Mutex::new(Default::default()));
    let wake = Arc::new(Notify::new());
    let bg_stop = CancellationToken::new();
    let (tx, rx) = mpsc::channel(cfg.complete_batch * 4);
    let mut bg = JoinSet::new();
    bg.spawn(background::listen(
        ledger.clone(),
        cfg.queues.clone(),
        wake.clone(),
        inflight.clone(),
        bg_stop.clone(),
    ));
    bg.spawn(background::keep_leases(
        ledger.clone(),
        inflight.clone(),
        cfg.lease,
        cfg.heartbeat,
        cfg.hooks.before_heartbeat.clone(),
        bg_stop.clone(),
    ));
    if let Some(every) = cfg.sweep_every {
        bg.spawn(background::sweep(
            ledger.clone(),
            every,
            counters.clone(),
            bg_stop.clone(),
        ));
    }
    if let Some(every) = cfg.schedule_every {
        bg.spawn(super::scheduler::schedule(
            ledger.clone(),
            every,
            cfg.holder.clone(),
            bg_stop.clone(),
        ));
    }
    let committer_task = tokio::spawn(committer::run(ledger.clone(), rx, cfg.complete_batch));
    let shared = Arc::new(Shared {
        ledger,
        cfg: cfg.clone(),
        counters: counters.clone(),
        inflight,
        committer: tx,
        freed: Notify::new(),
        pace: Default::default(),
        waiting: Default::default(),
        shed: Notify::new(),
    });
    // `held`: jobs this worker holds a lease on (running or waiting for a
    // slot); `slots`: handlers running at once.
    let most = cfg.concurrency + cfg.prefetch.most(cfg.concurrency);
    let held = Arc::new(Semaphore::new(most));
    let slots = Arc::new(Semaphore::new(cfg.concurrency));
    let mut jobs: JoinSet<()> = JoinSet::new();

    // Debug: it lasts as long as the worker; as a trace it would never end.
    let span = tracing::debug_span!("worker", holder = %cfg.holder);
    async {
        while !shutdown.is_cancelled() {
            while jobs.try_join_next().is_some() {}
            // Hold the running jobs and the prefetch the pace asks for now.
            let ahead = cfg
                .prefetch
                .now(cfg.concurrency, shared.pace.average(cfg.concurrency));
            // Only a real slowdown sheds (more than twice what is allowed
            // waits): a pace that wobbles must not release and claim again
            // on every turn, each a pair of events in the log.
            if shared.waiting.load(Ordering::SeqCst) > 2 * ahead {
                shared.shed.notify_waiters();
            }
            let holding = most - held.available_permits();
            let want = (cfg.concurrency + ahead).saturating_sub(holding);
            let mut started = 0;
            if want > 0 {
                match claim_and_start(&shared, (&held, &slots), &mut jobs, want, &shutdown).await {
                    Ok(n) => started = n,
                    Err(e) => {
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!("claim failed ({e}); retrying after the poll interval");
                    }
                }
            }
            if started > 0 && started == want {
                continue; // possibly more due work: claim again as slots free up
            }
            if let Some(idle) = &cfg.hooks.idle {
                idle().await;
            }
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = wake.notified() => {}
                _ = shared.freed.notified() => {}
                _ = tokio::time::sleep(cfg.poll) => {}
                Some(_) = jobs.join_next(), if !jobs.is_empty() => {}
            }
        }
        drain(&shared, &mut jobs).await;
    }
    .instrument(span)
    .await;

    drop(shared);
    let _ = committer_task.await;
    bg_stop.cancel();
    while bg.join_next().await.is_some() {}
    Ok(counters.report())
}

async fn claim_and_start(
    shared: &Arc<Shared>,
    (held, slots): (&Arc<Semaphore>, &Arc<Semaphore>),
    jobs: &mut JoinSet<()>,
    free: usize,
    shutdown: &CancellationToken,
) -> LedgerResult<usize> {
    let cfg = &shared.cfg;
    let mut started = 0;
    for queue in &cfg.queues {
        let want = free - started;
        if want == 0 {
            break;
        }
        let t = Instant::now();
        let leases = shared
            .ledger
            .claim(queue, &cfg.holder, cfg.lease, want as i64)
            .await?;
        metrics::histogram!(m::CLAIM_SECONDS).record(t.elapsed().as_secs_f64());
        if leases.is_empty() {
            continue;
        }
        if let Some(hook) = &cfg.hooks.after_claim {
            hook(leases.iter().map(|l| l.job_id()).collect()).await;
        }
        for lease in leases {
            shared.counters.claimed.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::CLAIMED, "queue" => queue.clone()).increment(1);
            if lease.taken_over() {
                shared.counters.takeovers.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::TAKEOVERS, "queue" => queue.clone()).increment(1);
            }
            // Shutdown began between the claim and the start: give the job
            // back without burning an attempt.
            if shutdown.is_cancelled() {
                release(shared, &lease).await;
                continue;
            }
            let permit = held
                .clone()
                .try_acquire_owned()
                .expect("claimed no more than the free slots");
            jobs.spawn(run_job(
                shared.clone(),
                lease,
                permit,
                slots.clone(),
                shutdown.clone(),
            ));
            started += 1;
        }
    }
    Ok(started)
}

async fn release(shared: &Shared, lease: &Lease) {
    match lease.release().await {
        Ok(r) if r.committed() => {
            shared.counters.released.fetch_add(1, Ordering::Relaxed);
        }
        Ok(r) => note_write(shared, &r),
        Err(e) => tracing::warn!(job_id = %lease.job_id(), "release failed ({e}); the lease will expire"),
    }
}

/// Stops claiming has already happened; lets running handlers finish within
/// the drain timeout, then tells the rest to stop and abandons them (their
/// leases expire and are taken over and reconciled).
async fn drain(shared: &Arc<Shared>, jobs: &mut JoinSet<()>) {
    let finished = tokio::time::timeout(shared.cfg.drain_timeout, async {
        while jobs.join_next().await.is_some() {}
    })
    .await;
    if finished.is_ok() {
        return;
    }
    tracing::warn!(
        "{} handler(s) still running after the drain timeout; signalling them",
        jobs.len()
    );
    for (_, sig) in shared.inflight.lock().expect("inflight").values() {
        sig.fire(StopReason::Shutdown);
    }
    let grace = shared.cfg.drain_timeout.min(Duration::from_secs(5));
    if tokio::time::timeout(grace, async { while jobs.join_next().await.is_some() {} })
        .await
        .is_err()
    {
        jobs.abort_all();
        while jobs.join_next().await.is_some() {}
    }
}

/// Waits for a handler slot; None when the worker stops, the job is
/// cancelled or its lease lost, or the prefetch shrank below what waits
/// (the job is then given back by the caller).
async fn wait_for_slot(
    shared: &Shared,
    slots: Arc<Semaphore>,
    shutdown: &CancellationToken,
    signal: &Signal,
) -> Option<OwnedSemaphorePermit> {
    shared.waiting.fetch_add(1, Ordering::SeqCst);
    let acquire = slots.acquire_owned();
    tokio::pin!(acquire);
    loop {
        tokio::select! {
            // In this order: a stop or a lost lease wins over a slot (the
            // job must not start), and a slot already granted wins over a
            // shed in the same turn.
            biased;
            _ = shutdown.cancelled() => {
                shared.waiting.fetch_sub(1, Ordering::SeqCst);
                break None;
            }
            _ = signal.token.cancelled() => {
                shared.waiting.fetch_sub(1, Ordering::SeqCst);
                break None;
            }
            p = &mut acquire => {
                shared.waiting.fetch_sub(1, Ordering::SeqCst);
                break p.ok();
            }
            // The pace slowed: beyond the prefetch, give it back.
            _ = shared.shed.notified() => {
                // (Counted as released, like a job given back at shutdown.)
                if shared.take_excess() {
                    break None;
                }
            }
        }
    }
}

async fn run_job(
    shared: Arc<Shared>,
    lease: Lease,
    held: OwnedSemaphorePermit,
    slots: Arc<Semaphore>,
    shutdown: CancellationToken,
) {
    let job = lease.job().expect("claimed leases carry their job");
    let span = tracing::info_span!("job", otel.name = "jobledger.handle", job_id = %job.job_id, epoch = job.epoch, token = job.token, queue = %job.queue, kind = %job.kind);
    // The handler continues the job's trace, under its claim.
    crate::telemetry::adopt(&span, lease.trace());
    async {
        let signal = Signal::default();
        // Heartbeats and cancels cover the job from its claim on, also while
        // it waits for a slot.
        shared.inflight.lock().expect("inflight").insert(job.job_id, (lease.clone(), signal.clone()));
        let permit = wait_for_slot(&shared, slots, &shutdown, &signal).await;
        let Some(permit) = permit else {
            // Never started: give it back without burning an attempt (a
            // requested cancel becomes `cancelled`), unless it is not ours.
            if signal.reason() != Some(StopReason::LeaseLost) {
                Box::pin(release(&shared, &lease)).await;
            }
            shared.inflight.lock().expect("inflight").remove(&job.job_id);
            drop(held);
            shared.freed.notify_one();
            return;
        };
        metrics::counter!(m::HANDLER_RUNS, "kind" => job.kind.clone(), "next_action" => job.next_action.as_str())
            .increment(1);
        // The handler's writes and its outcome continue this span: its
        // traceparent is formatted once per job, not once per use.
        // Else the claim's, as before (a handler span a strict filter left
        // unrecorded has none of its own).
        let traced = lease
            .clone()
            .under(crate::telemetry::here().or_else(|| lease.trace().map(str::to_owned)));
        let outcome = match shared.cfg.handlers.get(&job.kind).or(shared.cfg.fallback.as_ref()) {
            None => HandlerOutcome::Permanent { code: "unknown_kind".into(), message: Some(format!("no handler for kind {}", job.kind)) },
            Some(handler) => {
                let ctx = JobContext {
                    lease: traced.clone(),
                    job: job.clone(),
                    signal: signal.clone(),
                    lease_len: shared.cfg.lease,
                    pool: shared.ledger.pool().clone(),
                };
                // Its own task, so a panic becomes an outcome; aborted with us.
                shared.pace.begin(job.job_id);
                let ran = AbortOnDropHandle::new(tokio::spawn(handler(ctx).in_current_span())).await;
                // Every run counts, a panicked one too.
                shared.pace.end(job.job_id);
                match ran {
                    Ok(o) => o,
                    Err(e) if e.is_panic() => {
                        HandlerOutcome::Transient { code: "handler_panicked".into(), message: Some(e.to_string()) }
                    }
                    Err(_) => HandlerOutcome::LeaseLost,
                }
            }
        };
        drop(permit);
        drop(held);
        shared.freed.notify_one();
        finish(&shared, &traced, outcome).await;
        shared.inflight.lock().expect("inflight").remove(&job.job_id);
    }
    .instrument(span)
    .await
}

/// Writes the handler's outcome through the fence.
async fn finish(shared: &Shared, lease: &Lease, outcome: HandlerOutcome) {
    let c = &shared.counters;
    let written = match outcome {
        HandlerOutcome::LeaseLost => {
            c.lost_leases.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::LOST_LEASES).increment(1);
            return;
        }
        HandlerOutcome::Written(r) => Ok(*r),
        HandlerOutcome::Success(result) => complete(shared, lease, result).await,
        other => Box::pin(with_retries(|| write_other(lease, &other))).await,
    };
    match written {
        Ok(r) => note_write(shared, &r),
        Err(e) => {
            c.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!("could not write the outcome ({e}); the lease will expire and be reconciled");
        }
    }
}

async fn write_other(lease: &Lease, outcome: &HandlerOutcome) -> LedgerResult<WriteResult> {
    match outcome {
        HandlerOutcome::Submitted(receipt) => lease.submit(receipt).await,
        HandlerOutcome::Transient { code, message } => {
            lease.fail(ErrorClass::Transient, code, message.as_deref()).await
        }
        HandlerOutcome::Permanent { code, message } => {
            lease.fail(ErrorClass::Permanent, code, message.as_deref()).await
        }
        HandlerOutcome::Snooze(d) => lease.snooze(*d).await,
        HandlerOutcome::Cancelled => lease.confirm_cancel().await,
        HandlerOutcome::Success(_) | HandlerOutcome::Written(_) | HandlerOutcome::LeaseLost => {
            unreachable!("handled by finish")
        }
    }
}

/// The fenced writes are idempotent (a retry of a write that did commit
/// answers `already_committed`), so a retryable error is retried.
async fn with_retries<'a, F, Fut>(mut f: F) -> LedgerResult<WriteResult>
where
    F: FnMut() -> Fut + 'a,
    Fut: std::future::Future<Output = LedgerResult<WriteResult>> + 'a,
{
    let mut delay = Duration::from_millis(100);
    for _ in 0..4 {
        match f().await {
            Err(e) if e.is_retryable() => {
                tracing::warn!("write failed ({e}); retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            other => return other,
        }
    }
    f().await
}

async fn complete(
    shared: &Shared,
    lease: &Lease,
    result: Option<serde_json::Value>,
) -> LedgerResult<WriteResult> {
    let (tx, rx) = oneshot::channel();
    if shared
        .committer
        .send((lease.clone(), result.clone(), tx))
        .await
        .is_ok()
    {
        if let Ok(r) = rx.await {
            if !matches!(&r, Err(e) if e.is_retryable()) {
                return r;
            }
        }
    }
    // Boxed, as the rare outcomes' writes: inline, this fallback made every
    // job's task about 15 KB, copied at each spawn (1.7 KB boxed).
    Box::pin(with_retries(|| lease.complete(result.clone()))).await
}

fn note_write(shared: &Shared, r: &WriteResult) {
    let c = &shared.counters;
    metrics::counter!(m::OUTCOMES, "outcome" => r.outcome.as_str()).increment(1);
    match r.outcome {
        Outcome::Stale => {
            c.lost_leases.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::STALE_WRITES).increment(1);
            metrics::counter!(m::LOST_LEASES).increment(1);
            tracing::info!(job_id = %r.job_id, "write refused as stale: a newer token owns the job");
        }
        Outcome::Committed => {
            let counter = match r.job.as_ref().map(|j| j.state) {
                Some(crate::domain::JobState::Succeeded) => &c.succeeded,
                Some(crate::domain::JobState::Queued)
                    if r.event.as_ref().is_some_and(|e| e.body.type_name() == "snoozed") =>
                {
                    &c.snoozed
                }
                Some(crate::domain::JobState::Queued) => &c.retried,
                Some(crate::domain::JobState::Dead) => &c.dead,
                Some(crate::domain::JobState::Cancelled) => &c.cancelled,
                Some(crate::domain::JobState::AwaitingReceipt) => &c.submitted,
                _ => return,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        _ => tracing::warn!(job_id = %r.job_id, outcome = %r.outcome, detail = ?r.detail, "write refused"),
    }
}
