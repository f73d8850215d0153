//! docs/scenarios.md scenarios 8-11: cancel, retry classes, duplicate enqueue, purge
//! and key reuse; plus replay, receipts, sweeper policies and release.

mod common;

use chrono::Utc;
use common::{fresh, new_job};
use jobledger::domain::{ErrorClass, JobState, Outcome, Policy, Reason, ReceiptStatus};
use jobledger::ledger::{Found, LedgerError};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

/// Scenario 8: cancel before start, during execution (confirmed at a step
/// boundary), after submit, and repeated.
#[tokio::test]
async fn cancel_in_every_phase() {
    let db = fresh().await;

    // Before start: straight to cancelled; nothing to claim.
    let queued = db.enqueue(None, json!({"n": 1})).await;
    let r = db
        .ledger
        .cancel(queued.job_id, Some("double booking"))
        .await
        .unwrap();
    assert_eq!(
        (r.outcome, r.job.as_ref().unwrap().state),
        (Outcome::Committed, JobState::Cancelled)
    );
    assert_eq!(r.job.as_ref().unwrap().reason, Reason::CancelledBeforeStart);
    let again = db.ledger.cancel(queued.job_id, None).await.unwrap();
    assert_eq!(
        again.outcome,
        Outcome::AlreadyCommitted,
        "repeating a cancel is harmless"
    );
    assert_eq!(db.job(queued.job_id).await.version, 2, "and writes nothing");
    db.claim_none("w").await;

    // During: a request; heartbeats and steps are refused so the worker stops
    // its side effects, then confirms.
    let running = db.enqueue(None, json!({"n": 2})).await;
    let lease = db.claim_one("w").await;
    let r = db.ledger.cancel(running.job_id, None).await.unwrap();
    assert_eq!(r.job.unwrap().state, JobState::CancelRequested);
    assert_eq!(
        db.ledger.cancel(running.job_id, None).await.unwrap().outcome,
        Outcome::AlreadyCommitted
    );
    let hb = lease.heartbeat(Duration::from_secs(30)).await.unwrap();
    assert_eq!(hb.outcome, Outcome::InvalidTransition);
    assert_eq!(hb.job.unwrap().state, JobState::CancelRequested);
    assert_eq!(
        lease.progress("next-step", None).await.unwrap().outcome,
        Outcome::InvalidTransition
    );
    let done = lease.confirm_cancel().await.unwrap();
    assert_eq!(
        (done.outcome, done.job.unwrap().reason),
        (Outcome::Committed, Reason::CancelConfirmed)
    );
    assert_eq!(
        lease.confirm_cancel().await.unwrap().outcome,
        Outcome::AlreadyCommitted
    );

    // A worker that finishes anyway: succeeded, and the reason says why.
    let late = db.enqueue(None, json!({"n": 3})).await;
    let lease = db.claim_one("w").await;
    db.ledger.cancel(late.job_id, None).await.unwrap();
    let r = lease.complete(Some(json!({"done": true}))).await.unwrap();
    assert_eq!(
        (r.outcome, r.job.unwrap().reason),
        (Outcome::Committed, Reason::CancelAfterSubmit)
    );

    // After submit: the side effect is out; the cancel is recorded, not applied.
    let submitted = db.enqueue(None, json!({"n": 4})).await;
    let lease = db.claim_one("w").await;
    assert!(lease.submit("rcpt-4").await.unwrap().committed());
    let r = db.ledger.cancel(submitted.job_id, None).await.unwrap();
    assert_eq!(r.outcome, Outcome::Committed);
    let j = r.job.unwrap();
    assert_eq!(
        (j.state, j.reason),
        (JobState::AwaitingReceipt, Reason::CancelAfterSubmit)
    );
    assert_eq!(
        db.ledger.cancel(submitted.job_id, None).await.unwrap().outcome,
        Outcome::AlreadyCommitted
    );
    let r = db
        .ledger
        .receipt(submitted.job_id, "rcpt-4", ReceiptStatus::Succeeded)
        .await
        .unwrap();
    assert_eq!(r.job.unwrap().state, JobState::Succeeded);

    // A finished job is not cancelled after the fact.
    let r = db.ledger.cancel(submitted.job_id, None).await.unwrap();
    assert_eq!(
        (r.outcome, r.job.unwrap().state),
        (Outcome::InvalidTransition, JobState::Succeeded)
    );
    db.assert_verified().await;
}

/// Scenario 9: transient errors re-queue with backoff and jitter and are not
/// claimable before run_at; permanent errors are dead at once; exhausted
/// attempts are dead with the last class and the count.
#[tokio::test]
async fn retry_classes() {
    let db = fresh().await;
    let policy = Policy {
        max_attempts: 3,
        backoff_base_ms: 10_000,
        backoff_cap_ms: 60_000,
        ..Policy::default()
    };
    let job = db.enqueue_with(policy.clone()).await;

    let lease = db.claim_one("w").await;
    let before = Utc::now();
    let r = lease
        .fail(ErrorClass::Transient, "provider_busy", Some("503"))
        .await
        .unwrap();
    let j = r.job.unwrap();
    assert_eq!(
        (j.state, j.reason, j.attempt),
        (JobState::Queued, Reason::RetryScheduled, 1)
    );
    let delay = (j.run_at - before).num_milliseconds();
    assert!(
        (4_000..=11_000).contains(&delay),
        "first retry waits 5-10 s with jitter, got {delay} ms"
    );
    db.claim_none("w").await; // not claimable before run_at

    db.make_due(job.job_id).await;
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job().unwrap().attempt, 2);
    let j = lease
        .fail(ErrorClass::Transient, "provider_busy", None)
        .await
        .unwrap()
        .job
        .unwrap();
    let delay = (j.run_at - Utc::now()).num_milliseconds();
    assert!(
        (8_000..=21_000).contains(&delay),
        "second retry waits 10-20 s, got {delay} ms"
    );

    db.make_due(job.job_id).await;
    let lease = db.claim_one("w").await;
    let j = lease
        .fail(ErrorClass::Transient, "provider_busy", None)
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!(
        (j.state, j.reason, j.attempt),
        (JobState::Dead, Reason::AttemptsExhausted, 3)
    );
    let err = j.last_error.unwrap();
    assert_eq!(
        (err.class, err.code.as_str()),
        (ErrorClass::Transient, "provider_busy")
    );

    // Permanent: dead at once, whatever attempts are left.
    let perm = db.enqueue_with(policy).await;
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job_id(), perm.job_id);
    let j = lease
        .fail(ErrorClass::Permanent, "authorization_revoked", None)
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!(
        (j.state, j.reason, j.attempt),
        (JobState::Dead, Reason::PermanentError, 1)
    );
    assert_eq!(j.last_error.unwrap().class, ErrorClass::Permanent);
    // No verify here: the time-travel hooks edited the projection on purpose.
}

/// Jitter spreads a batch that failed together.
#[tokio::test]
async fn backoff_jitter_spreads_retries() {
    let db = fresh().await;
    let policy = Policy {
        backoff_base_ms: 60_000,
        backoff_cap_ms: 60_000,
        ..Policy::default()
    };
    for _ in 0..10 {
        db.enqueue_with(policy.clone()).await;
    }
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 10)
        .await
        .unwrap();
    // The delay each retry got, measured from its own failure's time (the
    // failures happen one after another, so their run_at would differ even
    // without jitter): "equal jitter" puts it in [base/2, base].
    let mut delays = vec![];
    for l in &leases {
        let r = l.fail(ErrorClass::Transient, "busy", None).await.unwrap();
        let failed_at = r.event.expect("the failure's event").recorded_at;
        let run_at = r.job.unwrap().run_at;
        delays.push((run_at - failed_at).num_milliseconds());
    }
    assert!(
        delays.iter().all(|d| (30_000..=60_000).contains(d)),
        "within [base/2, base]: {delays:?}"
    );
    delays.sort();
    delays.dedup();
    assert!(delays.len() >= 8, "retries should not wake together: {delays:?}");
}

/// Scenario 10: a double click or a gateway retry is one job; a different
/// payload under the same key is an error, never a second job.
#[tokio::test]
async fn duplicate_enqueue_is_one_job() {
    let db = fresh().await;
    let first = db
        .ledger
        .enqueue(new_job("q", Some("order-7"), json!({"a": 1, "b": 2})))
        .await
        .unwrap();
    assert!(first.created);
    let again = db
        .ledger
        .enqueue(new_job("q", Some("order-7"), json!({"b": 2, "a": 1})))
        .await
        .unwrap();
    assert!(!again.created);
    assert_eq!(again.job.job_id, first.job.job_id);

    let err = db
        .ledger
        .enqueue(new_job("q", Some("order-7"), json!({"a": 2})))
        .await
        .unwrap_err();
    assert!(
        matches!(err, LedgerError::KeyConflict { job_id, .. } if job_id == first.job.job_id),
        "{err}"
    );
    // Another queue is another namespace.
    assert!(
        db.ledger
            .enqueue(new_job("other", Some("order-7"), json!({})))
            .await
            .unwrap()
            .created
    );

    // Concurrent identical requests.
    let barrier = Arc::new(Barrier::new(8));
    let mut tasks = vec![];
    for _ in 0..8 {
        let (ledger, barrier) = (db.ledger.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            ledger
                .enqueue(new_job("q", Some("order-8"), json!({"x": 1})))
                .await
                .unwrap()
        }));
    }
    let mut ids = vec![];
    let mut created = 0;
    for t in tasks {
        let e = t.await.unwrap();
        ids.push(e.job.job_id);
        created += e.created as usize;
    }
    ids.dedup();
    assert_eq!((ids.len(), created), (1, 1));
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 3);
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        3,
        "one enqueued event per job"
    );
}

/// Enqueue inside the caller's transaction: rolled back with it.
#[tokio::test]
async fn enqueue_in_callers_transaction() {
    let db = fresh().await;
    let mut tx = db.ledger.pool().begin().await.unwrap();
    db.ledger
        .enqueue_in(&mut tx, new_job("q", Some("k"), json!({})))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 0);

    let mut tx = db.ledger.pool().begin().await.unwrap();
    let e = db
        .ledger
        .enqueue_in(&mut tx, new_job("q", Some("k"), json!({})))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(db.job(e.job.job_id).await.state, JobState::Queued);
}

/// Scenario 11: purge keeps a tombstone; a reused key is a new job with a
/// new epoch; anything from the old lifecycle is stale and never touches the
/// new job. The old job's history still reads from the log.
#[tokio::test]
async fn purge_and_key_reuse() {
    let db = fresh().await;
    let old = db.enqueue(Some("refund-77"), json!({"amount": 77})).await;
    let old_lease = db.claim_one("w-old").await;
    assert!(old_lease
        .complete(Some(json!({"refund_id": "re_77"})))
        .await
        .unwrap()
        .committed());

    assert_eq!(
        db.ledger.purge(Duration::from_secs(3600), 100).await.unwrap(),
        0,
        "too young"
    );
    assert_eq!(db.ledger.purge(Duration::ZERO, 100).await.unwrap(), 1);
    assert!(matches!(db.ledger.show(old.job_id).await.unwrap(), Found::Purged(t) if t.epoch == old.epoch));

    let new = db.enqueue(Some("refund-77"), json!({"amount": 77})).await;
    assert_ne!(new.job_id, old.job_id);
    assert!(new.epoch > old.epoch, "a reused key gets a new epoch");

    // Requests from the old lifecycle: stale, the new job untouched.
    let r = old_lease
        .complete(Some(json!({"refund_id": "re_77"})))
        .await
        .unwrap();
    assert_eq!((r.outcome, r.purged), (Outcome::Stale, true));
    assert_eq!(
        old_lease
            .fail(ErrorClass::Transient, "late", None)
            .await
            .unwrap()
            .outcome,
        Outcome::Stale
    );
    assert_eq!(
        db.ledger.cancel(old.job_id, None).await.unwrap().outcome,
        Outcome::Stale
    );
    let new_now = db.job(new.job_id).await;
    assert_eq!((new_now.state, new_now.version), (JobState::Queued, 1));

    // The old history is still the log's.
    let h = db.ledger.history(old.job_id).await.unwrap();
    assert_eq!(h.last().unwrap().event.body.type_name(), "purged");
    db.assert_verified().await;

    // Events can never be deleted, even though the job row was.
    let err = sqlx::query("DELETE FROM jobledger.events WHERE job_id = $1")
        .bind(old.job_id)
        .execute(db.ledger.pool())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("append-only"), "{err}");
}

/// Operator replay: one job, and a batch by reason code and time range.
#[tokio::test]
async fn operator_replay() {
    let db = fresh().await;
    let mut dead = vec![];
    for i in 0..3 {
        let j = db.enqueue(None, json!({"i": i})).await;
        let l = db.claim_one("w").await;
        let code = if i == 2 {
            "bad_request"
        } else {
            "authorization_revoked"
        };
        l.fail(ErrorClass::Permanent, code, None).await.unwrap();
        dead.push(j.job_id);
    }
    let live = db.enqueue(None, json!({"live": true})).await;
    let r = db.ledger.replay(live.job_id, "alice", "checked").await.unwrap();
    assert_eq!(
        r.outcome,
        Outcome::InvalidTransition,
        "only dead jobs are replayed"
    );

    let r = db
        .ledger
        .replay(dead[0], "alice", "provider fixed the account")
        .await
        .unwrap();
    let j = r.job.unwrap();
    assert_eq!((j.state, j.run, j.attempt, j.token), (JobState::Queued, 1, 0, 1));
    let ev = r.event.unwrap();
    assert_eq!(ev.actor, "operator:alice");

    // Batch: the two remaining permanent_error deaths (both reasons equal);
    // a range that excludes them replays nothing.
    let since = Utc::now() - chrono::Duration::hours(1);
    let until = Utc::now() + chrono::Duration::minutes(1);
    let none = db
        .ledger
        .replay_batch("permanent_error", since, since, "bob", "nothing")
        .await
        .unwrap();
    assert!(none.is_empty());
    let batch = db
        .ledger
        .replay_batch("permanent_error", since, until, "bob", "incident 42")
        .await
        .unwrap();
    assert_eq!(batch.len(), 2);
    assert!(batch.iter().all(|r| r.committed()));
    assert!(db
        .ledger
        .replay_batch("no_such_reason", since, until, "bob", "x")
        .await
        .is_err());

    // The replayed job runs again, with a fresh attempt count and a new token.
    let leases = db
        .ledger
        .claim("q", "w2", Duration::from_secs(30), 10)
        .await
        .unwrap();
    let l = leases.iter().find(|l| l.job_id() == dead[0]).unwrap();
    assert_eq!(
        (l.fence().token, l.job().unwrap().attempt, l.job().unwrap().run),
        (2, 1, 1)
    );
    db.assert_verified().await;
}

/// The payload limit is 1 MiB of canonical JSON, inclusive: a payload of
/// exactly 1 048 576 bytes is stored, one byte more is refused and writes
/// nothing.
#[tokio::test]
async fn a_payload_of_exactly_one_mib_is_stored_and_one_byte_more_is_refused() {
    let db = fresh().await;
    let limit = 1024 * 1024;
    // `{"p":"…"}`: 8 bytes around the string.
    let payload = |n: usize| json!({ "p": "x".repeat(n - 8) });
    let over = db.ledger.enqueue(new_job("q", None, payload(limit + 1))).await;
    assert!(
        matches!(over, Err(LedgerError::TooLarge { size, limit: l }) if size == limit + 1 && l == limit),
        "{:?}",
        over.map(|e| e.job.job_id)
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        0,
        "nothing written"
    );
    let at = db
        .ledger
        .enqueue(new_job("q", None, payload(limit)))
        .await
        .expect("1 MiB is allowed");
    assert!(at.created);
}

/// The backoff is capped: with base = cap = 1 s, the third transient
/// failure (nominally 4 s) is retried at most 1 s after it.
#[tokio::test]
async fn backoff_never_exceeds_its_cap() {
    let db = fresh().await;
    let job = db
        .enqueue_with(Policy {
            max_attempts: 10,
            backoff_base_ms: 1_000,
            backoff_cap_ms: 1_000,
            ..Policy::default()
        })
        .await;
    for attempt in 1..=3 {
        let l = db.claim_one("w").await;
        assert_eq!(l.job().unwrap().attempt, attempt);
        assert!(l
            .fail(ErrorClass::Transient, "timeout", None)
            .await
            .unwrap()
            .committed());
        let j = db.job(job.job_id).await;
        let wait = (j.run_at - j.updated_at).num_milliseconds();
        assert!(
            (500..=1_000).contains(&wait),
            "attempt {attempt}: retry in {wait} ms"
        );
        db.make_due(job.job_id).await;
    }
}

/// `replay --since`: a dead job that died before the range is not replayed
/// (the range's lower bound counts, not only its upper one).
#[tokio::test]
async fn a_batch_replay_leaves_jobs_that_died_before_its_range() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    let l = db.claim_one("w").await;
    assert!(l
        .fail(ErrorClass::Permanent, "bad_request", None)
        .await
        .unwrap()
        .committed());
    let died = db.job(job.job_id).await.updated_at;
    let after: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert!(after > died);
    let later = db
        .ledger
        .replay_batch(
            "permanent_error",
            after,
            after + chrono::Duration::hours(1),
            "bob",
            "x",
        )
        .await
        .unwrap();
    assert!(later.is_empty(), "died before the range: {later:?}");
    assert_eq!(db.state_of(job.job_id).await, JobState::Dead);
    // The control: a range that holds the death replays it.
    let holding = db
        .ledger
        .replay_batch("permanent_error", died, after, "bob", "x")
        .await
        .unwrap();
    assert_eq!(holding.len(), 1);
    assert!(holding[0].committed());
}

/// Review of issue 15 (helper-32): a payload nested deeper than the log's
/// readers parse (serde_json stops at 128 levels) was stored, and then
/// failed every read of its batch: `jobs_rebuilt` stopped for every job
/// behind it. The ledger now refuses data nested deeper than
/// `MAX_JSON_DEPTH` with a clear error, and stores what it accepts in a
/// form every reader reads back.
#[tokio::test]
async fn a_payload_nested_deeper_than_the_readers_parse_is_refused() {
    use jobledger::ledger::MAX_JSON_DEPTH;
    let db = fresh().await;
    let nested = |levels: usize| (0..levels).fold(json!(1), |v, _| json!([v]));
    let deepest = db.enqueue(None, nested(MAX_JSON_DEPTH)).await;
    let err = db
        .ledger
        .enqueue(new_job("q", None, nested(MAX_JSON_DEPTH + 1)))
        .await
        .expect_err("too deep");
    assert!(
        matches!(&err, LedgerError::BadInput(m) if m.contains("nests deeper than")),
        "{err}"
    );
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job_id(), deepest.job_id);
    assert!(matches!(
        lease.complete(Some(nested(MAX_JSON_DEPTH + 1))).await,
        Err(LedgerError::BadInput(_))
    ));
    assert!(lease
        .complete(Some(nested(MAX_JSON_DEPTH)))
        .await
        .unwrap()
        .committed());
    // What was accepted reads back everywhere: the rebuild replays it.
    common::catch_up_jobs_rebuilt(&db, 10)
        .await
        .expect("the deepest accepted payload reads back");
    assert!(db.ledger.compare_rebuilt().await.unwrap().is_empty());
}
