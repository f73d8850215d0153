//! `jobledger demo`: the main job end to end on a real database. Enqueues
//! refund jobs against an in-process fake provider, runs several workers,
//! stalls one worker past its lease so another takes over and reconciles,
//! resumes the stalled one (its writes are rejected as stale), cancels some
//! jobs, fails some, and checks the invariants.

use anyhow::{bail, Context, Result};
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use jobledger::domain::{ErrorClass, JobState, NewJob, NextAction, Outcome, Policy};
use jobledger::fake_provider::{FakeProvider, ProviderError};
use jobledger::ledger::{Found, Lease, Ledger, WriteResult};

const LEASE: Duration = Duration::from_millis(1500);
const ZOMBIES: i64 = 3;

#[derive(Default)]
struct Counters {
    stale: AtomicU64,
    processed: AtomicU64,
}

impl Counters {
    fn note(&self, r: &WriteResult) {
        if r.outcome == Outcome::Stale {
            self.stale.fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct Shared {
    ledger: Ledger,
    provider: FakeProvider,
    counters: Counters,
    queue: String,
    /// Slow jobs announce themselves here after their first step and wait
    /// for the canceller's answer before the next one.
    cancel_tx: mpsc::Sender<(uuid::Uuid, oneshot::Sender<()>)>,
}

pub async fn run(url: &str, jobs: usize, workers: usize) -> Result<i32> {
    let started = Instant::now();
    let ledger = Ledger::connect_and_migrate(url, (workers as u32 + 4).max(8))
        .await
        .with_context(|| format!("cannot reach PostgreSQL at {url}; start it or pass --database-url"))?;
    let queue = format!("demo-refunds-{}", uuid::Uuid::now_v7().simple());
    eprintln!("demo: queue {queue}, {jobs} refund jobs, {workers} workers");
    let (cancel_tx, cancel_rx) = mpsc::channel(16);
    let shared = Arc::new(Shared {
        ledger: ledger.clone(),
        provider: FakeProvider::new(),
        counters: Counters::default(),
        queue: queue.clone(),
        cancel_tx,
    });
    let keys = enqueue_all(&shared, jobs).await?;

    // The zombie claims the first jobs (highest priority) and stalls in the
    // provider call past its lease.
    let zombie_leases = ledger.claim(&queue, "worker-zombie", LEASE, ZOMBIES).await?;
    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    let canceller = tokio::spawn(canceller(shared.clone(), cancel_rx));
    let zombie = tokio::spawn(zombie(shared.clone(), zombie_leases));
    for w in 0..workers {
        tasks.spawn(worker(shared.clone(), format!("worker-{w}"), stop.clone()));
    }
    let zombie_report = zombie.await??;
    wait_until_settled(&shared, Duration::from_secs(45)).await?;
    stop.cancel();
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    canceller.abort();
    summary(&shared, &keys, zombie_report, started).await
}

async fn enqueue_all(shared: &Shared, jobs: usize) -> Result<Vec<String>> {
    let policy = Policy {
        max_attempts: 3,
        backoff_base_ms: 50,
        backoff_cap_ms: 200,
        ..Policy::default()
    };
    let mut news = Vec::with_capacity(jobs);
    let mut keys = Vec::with_capacity(jobs);
    for i in 0..jobs {
        let key = format!("refund-{i:04}");
        match i {
            _ if i % 23 == 5 => shared.provider.fail_always(&key),
            _ if i % 17 == 4 => shared.provider.refuse(&key),
            _ if i % 7 == 3 => shared.provider.fail_once(&key),
            _ => {}
        }
        news.push(NewJob {
            queue: shared.queue.clone(),
            kind: "refund".into(),
            job_key: Some(key.clone()),
            payload: json!({ "order": format!("ord-{i}"), "amount_cents": 1000 + i, "slow": i % 29 == 9 }),
            priority: if (i as i64) < ZOMBIES { -1 } else { 0 },
            run_at: None,
            delay_ms: None,
            policy: policy.clone(),
            next_action: NextAction::Execute,
        });
        keys.push(key);
    }
    let mut tx = shared.ledger.pool().begin().await?;
    let enqueued = shared.ledger.enqueue_many_in(&mut tx, news).await?;
    tx.commit().await?;
    // A double click: the same request again is the same job.
    let again = shared
        .ledger
        .enqueue(NewJob {
            ..demo_copy(&enqueued[10].job)
        })
        .await?;
    if again.created || again.job.job_id != enqueued[10].job.job_id {
        bail!("duplicate enqueue created a second job");
    }
    for (i, e) in enqueued.iter().enumerate() {
        if i % 13 == 7 {
            shared.counters.note(
                &shared
                    .ledger
                    .cancel(e.job.job_id, Some("customer withdrew"))
                    .await?,
            );
        }
    }
    Ok(keys)
}

fn demo_copy(j: &jobledger::domain::Job) -> NewJob {
    NewJob {
        queue: j.queue.clone(),
        kind: j.kind.clone(),
        job_key: j.job_key.clone(),
        payload: j.payload.clone(),
        priority: j.priority,
        run_at: None,
        delay_ms: None,
        policy: j.policy.clone(),
        next_action: NextAction::Execute,
    }
}

/// Works one lease the way a careful refund worker does: reconcile first when
/// told to, stop at step boundaries when cancelled, never guess on zero rows.
async fn work(shared: &Shared, lease: Lease) -> Result<()> {
    let job = lease.job().expect("claimed").clone();
    let key = job.job_key.clone().unwrap_or_default();
    let c = &shared.counters;
    c.processed.fetch_add(1, Ordering::Relaxed);
    if lease.next_action() == NextAction::Reconcile {
        if let Some(refund_id) = shared.provider.lookup(&key) {
            c.note(
                &lease
                    .complete(Some(json!({ "refund_id": refund_id, "reconciled": true })))
                    .await?,
            );
            return Ok(());
        }
    }
    let step = lease.progress("prepared", Some(LEASE)).await?;
    if !step.committed() {
        return finish_rejected(shared, &lease, &step).await;
    }
    if job.payload["slow"] == json!(true) {
        let (ack_tx, ack_rx) = oneshot::channel();
        shared.cancel_tx.send((job.job_id, ack_tx)).await?;
        ack_rx.await?;
    }
    let step = lease.progress("calling_provider", Some(LEASE)).await?;
    if !step.committed() {
        return finish_rejected(shared, &lease, &step).await;
    }
    let r = match shared.provider.refund(&key) {
        Ok(id) => lease.complete(Some(json!({ "refund_id": id }))).await?,
        Err(ProviderError::Transient) => lease.fail(ErrorClass::Transient, "provider_busy", None).await?,
        Err(ProviderError::Permanent(code)) => lease.fail(ErrorClass::Permanent, &code, None).await?,
    };
    c.note(&r);
    Ok(())
}

/// A step was refused: confirm a requested cancel, or count the stale write.
async fn finish_rejected(shared: &Shared, lease: &Lease, r: &WriteResult) -> Result<()> {
    shared.counters.note(r);
    if r.job
        .as_ref()
        .is_some_and(|j| j.state == JobState::CancelRequested)
    {
        shared.counters.note(&lease.confirm_cancel().await?);
    }
    Ok(())
}

async fn worker(shared: Arc<Shared>, id: String, stop: CancellationToken) -> Result<()> {
    while !stop.is_cancelled() {
        let leases = shared.ledger.claim(&shared.queue, &id, LEASE, 4).await?;
        if leases.is_empty() {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        for lease in leases {
            work(&shared, lease).await?;
        }
    }
    Ok(())
}

async fn canceller(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<(uuid::Uuid, oneshot::Sender<()>)>,
) -> Result<()> {
    while let Some((job, ack)) = rx.recv().await {
        shared.counters.note(
            &shared
                .ledger
                .cancel(job, Some("operator stopped it mid-flight"))
                .await?,
        );
        let _ = ack.send(());
    }
    Ok(())
}

struct ZombieReport {
    stalled: Vec<uuid::Uuid>,
    rejected: u64,
    observed: u64,
}

/// Calls the provider, "loses" the response, stays stalled until another
/// worker has taken the job over and finished it, then tries every write a
/// late worker might make. All must be stale.
async fn zombie(shared: Arc<Shared>, leases: Vec<Lease>) -> Result<ZombieReport> {
    let mut report = ZombieReport {
        stalled: vec![],
        rejected: 0,
        observed: 0,
    };
    for lease in &leases {
        let key = lease.job().and_then(|j| j.job_key.clone()).unwrap_or_default();
        shared
            .provider
            .refund(&key)
            .map_err(|e| anyhow::anyhow!("zombie refund: {e}"))?;
        report.stalled.push(lease.job_id());
    }
    for lease in &leases {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Found::Live(j) = shared.ledger.show(lease.job_id()).await? {
                if j.state.is_terminal() {
                    break;
                }
            }
            if Instant::now() > deadline {
                bail!("job {} was never taken over", lease.job_id());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let attempts = [
            lease.complete(Some(json!({ "refund_id": "late" }))).await?,
            lease
                .fail(ErrorClass::Transient, "socket_timeout", Some("late timeout"))
                .await?,
            lease.fail(ErrorClass::Permanent, "manual_review", None).await?,
        ];
        for r in &attempts {
            shared.counters.note(r);
            if r.outcome == Outcome::Stale {
                report.rejected += 1;
            }
        }
        // The late provider response is evidence: kept, not applied.
        let obs = lease
            .observe("provider-response", json!({ "late": true }))
            .await?;
        report.observed += u64::from(obs.committed());
    }
    Ok(report)
}

async fn wait_until_settled(shared: &Shared, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let counts = shared.ledger.counts_by_state_in(&shared.queue).await?;
        let open: i64 = counts
            .iter()
            .filter(|(s, _)| !JobState::parse(s).is_some_and(|s| s.is_terminal()))
            .map(|(_, n)| n)
            .sum();
        if open == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{open} jobs still open after {limit:?}: {counts:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn summary(shared: &Shared, keys: &[String], zombie: ZombieReport, started: Instant) -> Result<i32> {
    let l = &shared.ledger;
    let counts = l.counts_by_state_in(&shared.queue).await?;
    let takeovers = l.count_events_in(&shared.queue, "taken_over").await?;
    let duplicates = shared.provider.duplicate_refunds();
    let (calls, lookups) = shared.provider.traffic();
    let stale = shared.counters.stale.load(Ordering::Relaxed);
    let multi = keys.iter().filter(|k| shared.provider.executions(k) > 1).count();
    let mut problems = vec![];
    let mut verified = 0u64;
    for id in l.jobs_with_event_in(&shared.queue, "enqueued").await? {
        let r = l.verify(Some(id)).await?;
        verified += r.events;
        problems.extend(r.problems);
    }
    eprintln!("\n== jobledger demo: summary ==");
    for (state, n) in &counts {
        eprintln!("  {state:<18} {n}");
    }
    eprintln!("  takeovers                  {takeovers}");
    eprintln!(
        "  stale writes rejected      {stale} (zombie: {} of its late writes)",
        zombie.rejected
    );
    eprintln!("  late receipts observed     {}", zombie.observed);
    eprintln!("  provider refunds / lookups {calls} / {lookups}");
    eprintln!("  duplicate external refunds {duplicates}");
    eprintln!(
        "  events verified            {verified} (hash chains + replay), problems: {}",
        problems.len()
    );
    if let Some(id) = zombie.stalled.first() {
        eprintln!("\n== history of taken-over job {id} ==");
        for line in super::timeline::lines(l, *id).await? {
            eprintln!("{line}");
        }
    }
    let ok = duplicates == 0
        && multi == 0
        && takeovers >= zombie.stalled.len() as i64
        && zombie.rejected == 3 * zombie.stalled.len() as u64
        && problems.is_empty()
        && counts
            .iter()
            .all(|(s, _)| JobState::parse(s).is_some_and(|s| s.is_terminal()));
    let by_state: serde_json::Map<_, _> = counts.iter().map(|(s, n)| (s.clone(), json!(n))).collect();
    println!(
        "{}",
        json!({
            "ok": ok, "queue": shared.queue, "jobs": keys.len(), "by_state": by_state,
            "takeovers": takeovers, "stale_rejected": stale, "duplicate_refunds": duplicates,
            "provider_calls": calls, "provider_lookups": lookups, "verified_events": verified,
            "problems": problems.len(), "seconds": started.elapsed().as_secs_f64(),
        })
    );
    eprintln!(
        "\ninvariants {} in {:.1}s",
        if ok { "held" } else { "VIOLATED" },
        started.elapsed().as_secs_f64()
    );
    Ok(if ok { 0 } else { 1 })
}
