//! Per-key concurrency limits, per-queue rate limits and uniqueness
//! windows, enforced in PostgreSQL across workers and checked from the
//! event log afterwards (docs/admission.md).

mod common;

use common::{eventually, fresh, new_job, TestDb};
use jobledger::domain::{JobState, NewJob};
use jobledger::ledger::Found;
use jobledger::worker::{HandlerOutcome, JobContext, Worker};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Barrier, Semaphore};
use tokio_util::sync::CancellationToken;

fn keyed(key: &str, i: usize) -> NewJob {
    let mut n = new_job("q", None, json!({ "i": i }));
    n.concurrency_key = Some(key.into());
    n
}

/// From the log alone (the chaos checker's query): per concurrency key,
/// the most leases held at once.
async fn most_leased_per_key(db: &TestDb) -> Vec<(String, i64)> {
    jobledger::store::audit::most_leased_per_key(db.ledger.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_limit_of_two_per_key_holds_under_eight_workers() {
    let db = fresh().await;
    let l = &db.ledger;
    let set = l
        .set_concurrency_limit(
            "q",
            "per-tenant",
            None,
            Some("tenant-*"),
            2,
            "ops",
            "the provider allows 2 per tenant",
        )
        .await
        .unwrap();
    assert!(set.changed && set.status.limits["per-tenant"].max == 2);
    let news: Vec<NewJob> = (0..40).map(|i| keyed(&format!("tenant-{}", i % 4), i)).collect();
    l.enqueue_many_as(news, "test").await.unwrap();
    // Handlers hold their jobs until the test opens the gate.
    let gate = Arc::new(Semaphore::new(0));
    let stop = CancellationToken::new();
    let mut runs = vec![];
    for w in 0..8 {
        let g = gate.clone();
        let worker = Worker::builder(l.clone())
            .name(&format!("w{w}"))
            .queue("q")
            .concurrency(4)
            .poll_every(Duration::from_millis(20))
            .sweeper(None)
            .scheduler(None)
            .handler("refund", move |_ctx: JobContext| {
                let g = g.clone();
                async move {
                    g.acquire().await.unwrap().forget();
                    HandlerOutcome::success(json!({}))
                }
            })
            .build()
            .unwrap();
        let s = stop.clone();
        runs.push(tokio::spawn(async move { worker.run(s).await.unwrap() }));
    }
    // 32 handler slots, 4 keys: the cap, not the workers, stops at 8.
    eventually("every key holds its two leases", || async {
        db.count("SELECT count(*) FROM jobledger.jobs WHERE state = 'leased'")
            .await
            == 8
    })
    .await;
    let queued = db
        .count("SELECT count(*) FROM jobledger.jobs WHERE state = 'queued'")
        .await;
    assert_eq!(queued, 32);
    // `show` of a waiting job says why.
    let waiting: uuid::Uuid =
        sqlx::query_scalar("SELECT job_id FROM jobledger.jobs WHERE state = 'queued' LIMIT 1")
            .fetch_one(l.pool())
            .await
            .unwrap();
    let Found::Live(j) = l.show(waiting).await.unwrap() else {
        panic!()
    };
    let why = l.admission_waits(&j).await.unwrap();
    assert!(
        why.len() == 1 && why[0].contains("2 of 2 leased (limit \"per-tenant\")"),
        "{why:?}"
    );
    gate.add_permits(1000);
    eventually("all succeed", || async {
        db.count("SELECT count(*) FROM jobledger.jobs WHERE state = 'succeeded'")
            .await
            == 40
    })
    .await;
    stop.cancel();
    for r in runs {
        r.await.unwrap();
    }
    let most = most_leased_per_key(&db).await;
    assert_eq!(most.len(), 4, "{most:?}");
    for (k, n) in &most {
        assert_eq!(
            *n, 2,
            "key {k}: at most 2 leased at once, and the cap was reached"
        );
    }
    db.assert_verified().await;
}

#[tokio::test]
async fn eight_claims_at_once_never_share_a_free_slot() {
    let db = fresh().await;
    let l = &db.ledger;
    l.set_concurrency_limit("q", "one-key", None, None, 2, "ops", "r")
        .await
        .unwrap();
    let news: Vec<NewJob> = (0..20).map(|i| keyed("k", i)).collect();
    l.enqueue_many_as(news, "test").await.unwrap();
    let start = Arc::new(Barrier::new(8));
    let mut claims = vec![];
    for w in 0..8 {
        let (l, start) = (l.clone(), start.clone());
        claims.push(tokio::spawn(async move {
            start.wait().await;
            l.claim("q", &format!("w{w}"), Duration::from_secs(30), 5)
                .await
                .unwrap()
                .len()
        }));
    }
    let mut total = 0;
    for c in claims {
        total += c.await.unwrap();
    }
    assert_eq!(total, 2, "the key's two slots, whoever won them");
    assert_eq!(most_leased_per_key(&db).await, [("k".to_string(), 2)]);
}

#[tokio::test]
async fn a_hot_key_does_not_starve_the_others() {
    let db = fresh().await;
    let l = &db.ledger;
    l.set_concurrency_limit("q", "each", None, None, 1, "ops", "r")
        .await
        .unwrap();
    // The hot key's backlog is older (and so first in line) than anyone's.
    let hot: Vec<NewJob> = (0..100).map(|i| keyed("hot", i)).collect();
    l.enqueue_many_as(hot, "test").await.unwrap();
    let cold: Vec<NewJob> = (0..5).map(|i| keyed(&format!("cold-{i}"), i)).collect();
    l.enqueue_many_as(cold, "test").await.unwrap();
    // An unkeyed job is under no limit.
    l.enqueue(new_job("q", None, json!({}))).await.unwrap();
    let key_of =
        |x: &jobledger::ledger::Lease| x.job().unwrap().admission.clone().and_then(|a| a.concurrency_key);
    let first = l.claim("q", "w", Duration::from_secs(30), 3).await.unwrap();
    let keys: Vec<Option<String>> = first.iter().map(key_of).collect();
    assert_eq!(first.len(), 3, "{keys:?}");
    assert_eq!(
        keys.iter().filter(|k| k.as_deref() == Some("hot")).count(),
        1,
        "{keys:?}"
    );
    // The hot key is at its cap: the next claim is all others.
    let second = l.claim("q", "w", Duration::from_secs(30), 10).await.unwrap();
    let keys: Vec<Option<String>> = second.iter().map(key_of).collect();
    assert!(!keys.iter().any(|k| k.as_deref() == Some("hot")), "{keys:?}");
    assert_eq!(first.len() + second.len(), 7, "1 hot, 5 cold, 1 unkeyed");
    // Removing the limit is recorded, and the backlog flows again.
    let off = l
        .remove_concurrency_limit("q", "each", "ops", "done")
        .await
        .unwrap();
    assert!(off.changed && off.status.limits.is_empty());
    assert_eq!(
        l.claim("q", "w", Duration::from_secs(30), 10)
            .await
            .unwrap()
            .len(),
        10
    );
    let history = l.queue_history("q").await.unwrap();
    let actions: Vec<&str> = history.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["limit_set", "limit_removed"]);
    db.assert_verified().await;
}

#[tokio::test]
async fn the_rate_limit_holds_across_claimers_and_its_window_moves() {
    let db = fresh().await;
    let l = &db.ledger;
    l.set_rate_limit("q", 5, Duration::from_secs(3600), "ops", "the provider's quota")
        .await
        .unwrap();
    let news: Vec<NewJob> = (0..50).map(|i| new_job("q", None, json!({ "i": i }))).collect();
    l.enqueue_many_as(news, "test").await.unwrap();
    let start = Arc::new(Barrier::new(8));
    let mut claims = vec![];
    for w in 0..8 {
        let (l, start) = (l.clone(), start.clone());
        claims.push(tokio::spawn(async move {
            start.wait().await;
            l.claim("q", &format!("w{w}"), Duration::from_secs(30), 3)
                .await
                .unwrap()
                .len()
        }));
    }
    let mut total = 0;
    for c in claims {
        total += c.await.unwrap();
    }
    assert_eq!(total, 5, "five claims in the window, across eight claimers");
    db.claim_none("late").await;
    let waiting: uuid::Uuid =
        sqlx::query_scalar("SELECT job_id FROM jobledger.jobs WHERE state = 'queued' LIMIT 1")
            .fetch_one(l.pool())
            .await
            .unwrap();
    let why = common::cli::jl(&db.url, &["show", &waiting.to_string()]).json();
    let why = why["waiting_because"].as_str().unwrap_or_default().to_string();
    assert!(
        why.starts_with("queue rate limit: 5 of 5 claims in the last 3600000 ms"),
        "{why}"
    );
    // An hour passes (the window's claims move into the past).
    sqlx::query("UPDATE jobledger.rate_claims SET at = at - interval '61 minutes'")
        .execute(l.pool())
        .await
        .unwrap();
    assert_eq!(
        l.claim("q", "w", Duration::from_secs(30), 10)
            .await
            .unwrap()
            .len(),
        5
    );
    db.claim_none("late").await;
    // The log agrees: ten claims in all.
    let claimed = db
        .count("SELECT count(*) FROM jobledger.events WHERE type = 'claimed'")
        .await;
    assert_eq!(claimed, 10);
    l.remove_rate_limit("q", "ops", "quota lifted").await.unwrap();
    assert_eq!(
        l.claim("q", "w", Duration::from_secs(30), 100)
            .await
            .unwrap()
            .len(),
        40
    );
    db.assert_verified().await;
}

#[tokio::test]
async fn a_uniqueness_window_expires_into_a_new_epoch() {
    let db = fresh().await;
    let l = &db.ledger;
    let mut n = new_job("q", Some("nightly-report"), json!({ "day": 1 }));
    n.unique_for_ms = Some(3_600_000);
    let first = l.enqueue(n.clone()).await.unwrap();
    assert!(first.created);
    let again = l.enqueue(n.clone()).await.unwrap();
    assert!(
        !again.created && again.job.job_id == first.job.job_id,
        "within the window: the same job"
    );
    let lease = db.claim_one("w");
    let lease = lease.await;
    // Open after the window's end: the key stays with the open job.
    db.around_the_log(
        "UPDATE jobledger.jobs SET admission = jsonb_set(admission, '{unique_until}', \
         to_jsonb(now() - interval '1 second')) WHERE job_id = $1",
        first.job.job_id,
    )
    .await;
    let open = l.enqueue(n.clone()).await.unwrap();
    assert!(
        !open.created && open.job.job_id == first.job.job_id,
        "one key never names two open jobs"
    );
    assert!(lease.complete(None).await.unwrap().committed());
    // Finished and past its window: a new lifecycle, even with another payload.
    let mut next = n.clone();
    next.payload = json!({ "day": 2 });
    let second = l.enqueue(next).await.unwrap();
    assert!(second.created && second.job.job_id != first.job.job_id);
    assert!(second.job.epoch > first.job.epoch, "a higher epoch");
    match l.show(first.job.job_id).await.unwrap() {
        Found::Purged(t) => assert_eq!(t.epoch, first.job.epoch),
        other => panic!("the old lifecycle is a tombstone: {other:?}"),
    }
    let history = l.history(first.job.job_id).await.unwrap();
    let last = &history.last().unwrap().event;
    assert_eq!(last.body.type_name(), "purged");
    assert_eq!(last.actor, "unique-window:api");
    // Its stale writes are refused as such.
    assert_eq!(
        lease.complete(None).await.unwrap().outcome,
        jobledger::domain::Outcome::Stale
    );
    // A window needs a key, and a sane length.
    let mut bad = new_job("q", None, json!({}));
    bad.unique_for_ms = Some(1000);
    assert!(l.enqueue(bad).await.is_err());
    assert_eq!(db.state_of(second.job.job_id).await, JobState::Queued);
    db.assert_verified().await;
}

#[tokio::test]
async fn many_keys_each_get_their_turn() {
    let db = fresh().await;
    let l = &db.ledger;
    l.set_concurrency_limit("q", "each", None, None, 1, "ops", "r")
        .await
        .unwrap();
    // 300 keys, two jobs each; a claim of one walks only a few keys, and
    // the keys at their cap must not hide the rest from later claims.
    let news: Vec<NewJob> = (0..600).map(|i| keyed(&format!("k{:03}", i % 300), i)).collect();
    l.enqueue_many_as(news, "test").await.unwrap();
    let mut keys = std::collections::BTreeSet::new();
    for _ in 0..300 {
        let got = l.claim("q", "w", Duration::from_secs(30), 1).await.unwrap();
        assert_eq!(got.len(), 1, "after {} keys", keys.len());
        keys.insert(
            got[0]
                .job()
                .unwrap()
                .admission
                .clone()
                .unwrap()
                .concurrency_key
                .unwrap(),
        );
    }
    assert_eq!(keys.len(), 300, "every key once: its cap is 1");
    db.claim_none("w").await;
    assert!(most_leased_per_key(&db).await.iter().all(|(_, n)| *n == 1));
}

#[tokio::test]
async fn slot_keys_belong_to_the_schedules() {
    let db = fresh().await;
    let n = new_job(
        "q",
        Some("schedule:nightly:2026-12-03T03:00:00.000000Z"),
        json!({}),
    );
    let e = db.ledger.enqueue(n).await.unwrap_err();
    assert!(e.to_string().contains("schedules' own"), "{e}");
}

/// The reviewer's case: a claim used to lock the first jobs of every key
/// and take a lock per key; with 20,000 keys it ran for minutes and failed
/// with "out of shared memory". A claim of one locks about its pool.
#[tokio::test]
async fn a_claim_of_a_queue_with_many_keys_locks_only_its_pool() {
    let db = fresh().await;
    let l = &db.ledger;
    for start in (0..20_000).step_by(1000) {
        let news: Vec<NewJob> = (start..start + 1000)
            .map(|i| keyed(&format!("key-{i:05}"), i))
            .collect();
        l.enqueue_many_as(news, "test").await.unwrap();
    }
    l.set_concurrency_limit("q", "each", None, None, 1, "ops", "r")
        .await
        .unwrap();
    let got = l.claim("q", "w", Duration::from_secs(30), 1).await.unwrap();
    assert_eq!(got.len(), 1);
    // While a claim holds its candidates, another finds plenty left.
    let mut tx = l.pool().begin().await.unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM jobledger.jobs WHERE queue = 'q' AND state = 'queued' \
         FOR UPDATE SKIP LOCKED) x",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(held, 19_999, "nothing stays locked after the claim");
    tx.rollback().await.unwrap();
    assert_eq!(
        l.claim("q", "w", Duration::from_secs(30), 10)
            .await
            .unwrap()
            .len(),
        10
    );
}
