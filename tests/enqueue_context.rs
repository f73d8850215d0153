//! A single enqueue takes its epoch, time and policy from what the ledger
//! remembers of its last read (ledger::context), and its insert checks them:
//! whatever the ledger remembers wrongly is refused and read again, never
//! written.

mod common;

use chrono::{DateTime, TimeDelta, Utc};
use common::{fresh, new_job};
use jobledger::domain::Policy;
use jobledger::ledger::Ledger;
use serde_json::json;
use std::time::Duration;

/// The test database's ledger, its remembered context used however slowly
/// the test runs (the insert's check still bounds the time).
fn remembering(db: &common::TestDb) -> Ledger {
    db.ledger.clone().remember_context_for(Duration::from_secs(3600))
}

async fn enqueue(l: &Ledger, key: Option<&str>, n: i64) -> jobledger::domain::Job {
    l.enqueue(new_job("q", key, json!({ "n": n }))).await.unwrap().job
}

async fn db_clock(l: &Ledger) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(l.pool())
        .await
        .unwrap()
}

/// A policy registered after the ledger read (and remembered) that its
/// (queue, kind) had none applies to the next enqueue, also when another
/// process registered it.
#[tokio::test]
async fn a_policy_registered_after_the_read_applies_to_the_next_enqueue() {
    let db = fresh().await;
    let l = remembering(&db);
    let first = enqueue(&l, None, 1).await;
    assert_eq!(first.policy, Policy::default());
    let other = Ledger::connect(&db.url, 2).await.unwrap();
    let seven = Policy {
        max_attempts: 7,
        ..Policy::default()
    };
    other.register_policy("q", "refund", &seven).await.unwrap();
    assert_eq!(
        enqueue(&l, None, 2).await.policy,
        seven,
        "the remembered 'no policy' was refused"
    );
    // Remembered again (the refusal's retry read afresh but kept nothing),
    // then changed.
    assert_eq!(enqueue(&l, None, 3).await.policy, seven);
    let three = Policy {
        max_attempts: 3,
        ..Policy::default()
    };
    other.register_policy("q", "refund", &three).await.unwrap();
    assert_eq!(
        enqueue(&l, None, 4).await.policy,
        three,
        "the remembered 7 was refused"
    );
    db.assert_verified().await;
}

/// A remembered clock ahead of the database's (a clock stepped back, a
/// client's clock running fast) or too far behind it is refused: the job's
/// time is read again, so it is never after the database clock at its
/// insert nor more than a second before it.
#[tokio::test]
async fn a_remembered_clock_ahead_or_far_behind_is_read_again() {
    let db = fresh().await;
    let l = remembering(&db);
    let cases = [
        (TimeDelta::hours(1), true),
        (TimeDelta::seconds(-10), true),
        // Behind by what the reading lagged already plus 200 ms.
        (TimeDelta::milliseconds(-200), false),
    ];
    for (n, (shift, refused)) in cases.into_iter().enumerate() {
        // Remember a reading (a refusal's retry leaves none), then skew it.
        let primed = enqueue(&l, None, 2 * n as i64).await;
        l.shift_remembered_clock(shift);
        let before = db_clock(&l).await;
        let job = enqueue(&l, None, 2 * n as i64 + 1).await;
        let after = db_clock(&l).await;
        assert!(
            job.created_at <= after,
            "shift {shift}: {} after the clock {after}",
            job.created_at
        );
        assert!(
            job.created_at >= before - TimeDelta::seconds(1),
            "shift {shift}: {} more than a second before {before}",
            job.created_at
        );
        // Taken from memory: the next epoch of the primer's block; refused
        // and read afresh: a new block, far above it.
        assert_eq!(
            job.epoch != primed.epoch + 1,
            refused,
            "shift {shift}: refused {refused}"
        );
    }
    db.assert_verified().await;
}

/// A remembered epoch below the one of a purged lifecycle of the same key
/// is refused (JL002) and the enqueue draws afresh instead of handing out
/// the next remembered one.
#[tokio::test]
async fn a_remembered_epoch_below_a_purged_lifecycle_is_drawn_again() {
    let db = fresh().await;
    let l = remembering(&db);
    let first = enqueue(&l, None, 0).await; // remembers a block above it
    let other = Ledger::connect(&db.url, 2).await.unwrap();
    let purged = enqueue(&other, Some("K"), 1).await;
    assert!(
        purged.epoch > first.epoch + 63,
        "drawn after the remembered block"
    );
    other.cancel(purged.job_id, None).await.unwrap();
    assert_eq!(other.purge(Duration::ZERO, 10).await.unwrap(), 1);
    let e = l
        .enqueue(new_job("q", Some("K"), json!({"n": 2})))
        .await
        .expect("drawn again, not refused");
    assert!(e.created);
    assert!(
        e.job.epoch > purged.epoch,
        "{} above the purged {}",
        e.job.epoch,
        purged.epoch
    );
    db.assert_verified().await;
}

/// The notifications that arrive before a sentinel sent after them
/// (PostgreSQL delivers them in commit order), sorted.
async fn notes_until_sentinel(
    db: &common::TestDb,
    listener: &mut sqlx::postgres::PgListener,
) -> Vec<(String, String)> {
    sqlx::query("SELECT pg_notify('sentinel', '')")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let mut got = Vec::new();
    loop {
        let note = common::within("a notification", listener.recv()).await.unwrap();
        if note.channel() == "sentinel" {
            got.sort();
            return got;
        }
        got.push((note.channel().to_string(), note.payload().to_string()));
    }
}

async fn listening(db: &common::TestDb) -> sqlx::postgres::PgListener {
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener
        .listen_all(["jobledger_queued", "jobledger_events", "sentinel"])
        .await
        .unwrap();
    listener
}

fn both(queue: &str) -> Vec<(String, String)> {
    vec![
        ("jobledger_events".into(), String::new()),
        ("jobledger_queued".into(), queue.into()),
    ]
}

/// A single enqueue wakes workers and log readers after its commit, once
/// each (the insert's triggers sent nothing, the ledger's next statement
/// did), and the statement's switch does not outlive it: a later
/// transaction on the same session, or a switch set for the whole
/// database, leaves every other write's triggers notifying.
#[tokio::test]
async fn a_single_enqueue_wakes_after_its_commit_once() {
    let db = fresh().await;
    // One connection: every write below runs on the same session.
    let one = Ledger::connect(&db.url, 1)
        .await
        .unwrap()
        .remember_context_for(Duration::from_secs(3600));
    let mut listener = listening(&db).await;
    let mut last: Option<i64> = None;
    for n in 0..3 {
        let job = enqueue(&one, None, n).await;
        if let Some(prev) = last {
            assert_eq!(job.epoch, prev + 1, "enqueue {n}: taken from memory");
        }
        last = Some(job.epoch);
        assert_eq!(
            notes_until_sentinel(&db, &mut listener).await,
            both("q"),
            "enqueue {n}"
        );
    }
    one.enqueue_many_as(vec![new_job("other", None, json!({}))], "api")
        .await
        .unwrap();
    assert_eq!(notes_until_sentinel(&db, &mut listener).await, both("other"));
    // Set for every session of the database: no statement's own time.
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" SET jobledger.wake_after_commit = 'on'",
        db.name
    ))
    .execute(db.ledger.pool())
    .await
    .unwrap();
    let late = Ledger::connect(&db.url, 1).await.unwrap();
    late.enqueue_many_as(vec![new_job("third", None, json!({}))], "api")
        .await
        .unwrap();
    assert_eq!(notes_until_sentinel(&db, &mut listener).await, both("third"));
    db.assert_verified().await;
}

/// A caller that stops waiting once the insert has committed (an HTTP
/// client gone) does not stop the wake-up. The job has a key: it is
/// enqueued alone, in the caller's own future (a job without one is
/// written by a shared statement's task, which the caller cannot stop:
/// ledger::combine).
#[tokio::test]
async fn a_caller_gone_after_the_commit_still_wakes() {
    use jobledger::ledger::LedgerHooks;
    use std::sync::Arc;
    use tokio::sync::{mpsc, Mutex};
    let db = fresh().await;
    let (reached, mut at_gate) = mpsc::channel::<()>(1);
    let (open, gate) = mpsc::channel::<()>(1);
    let gate = Arc::new(Mutex::new(gate));
    let hooked = remembering(&db).with_hooks(LedgerHooks {
        after_epochs: None,
        before_wake: Some(Arc::new(move || {
            let (reached, gate) = (reached.clone(), gate.clone());
            Box::pin(async move {
                reached.send(()).await.unwrap();
                gate.lock().await.recv().await;
            })
        })),
    });
    let primer = hooked.clone();
    let priming = tokio::spawn(async move { enqueue(&primer, None, 0).await });
    // The first enqueue read afresh: its triggers notified, no hook ran.
    let first = common::within("the primer", priming).await.unwrap();
    let mut listener = listening(&db).await;
    let caller = {
        let hooked = hooked.clone();
        tokio::spawn(async move { enqueue(&hooked, Some("gone"), 1).await })
    };
    common::within("the insert's commit", at_gate.recv())
        .await
        .unwrap();
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM jobledger.jobs WHERE epoch = $1")
        .bind(first.epoch + 1)
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(committed, 1, "committed before the caller left");
    open.send(()).await.unwrap();
    let note = common::within("the wake-up", listener.recv()).await.unwrap();
    assert!(["jobledger_events", "jobledger_queued"].contains(&note.channel()));
    db.assert_verified().await;
}

/// Remembered epochs go with their clock reading: once it is too old to
/// use, so are they, and the next enqueue draws a new block (an old block
/// would hand out epochs below lifecycles purged since).
#[tokio::test]
async fn remembered_epochs_go_with_a_stale_reading() {
    let db = fresh().await;
    // Every reading is stale by the next enqueue.
    let l = db.ledger.clone().remember_context_for(Duration::ZERO);
    let first = enqueue(&l, None, 0).await;
    let second = enqueue(&l, None, 1).await;
    assert_eq!(
        second.epoch,
        first.epoch + 64,
        "a new block, not the rest of the first"
    );
    // A fresh read for a (queue, kind) not yet remembered replaces the
    // block of the reading before it.
    let fresh_l = Ledger::connect(&db.url, 2)
        .await
        .unwrap()
        .remember_context_for(Duration::from_secs(3600));
    let a = enqueue(&fresh_l, None, 2).await;
    let mut other_kind = new_job("q", None, json!({}));
    other_kind.kind = "other".into();
    let b = fresh_l.enqueue(other_kind).await.unwrap().job;
    assert_eq!(b.epoch, a.epoch + 64);
    let c = enqueue(&fresh_l, None, 3).await;
    assert_eq!(c.epoch, b.epoch + 1, "from the newest block");
    db.assert_verified().await;
}
