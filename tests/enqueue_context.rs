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
    let first = db.enqueue(None, json!({"n": 1})).await;
    assert_eq!(first.policy, Policy::default());
    let other = Ledger::connect(&db.url, 2).await.unwrap();
    let seven = Policy {
        max_attempts: 7,
        ..Policy::default()
    };
    other.register_policy("q", "refund", &seven).await.unwrap();
    let second = db.enqueue(None, json!({"n": 2})).await;
    assert_eq!(second.policy, seven, "the remembered 'no policy' was refused");
    let again = Policy {
        max_attempts: 3,
        ..Policy::default()
    };
    other.register_policy("q", "refund", &again).await.unwrap();
    assert_eq!(db.enqueue(None, json!({"n": 3})).await.policy, again);
    db.assert_verified().await;
}

/// A remembered clock ahead of the database's (a clock stepped back, a
/// client's clock running fast) or too far behind it is refused: the job's
/// time is read again, so it is never after the database clock at its
/// insert nor more than a second before it.
#[tokio::test]
async fn a_remembered_clock_ahead_or_far_behind_is_read_again() {
    let db = fresh().await;
    db.enqueue(None, json!({"n": 0})).await;
    for (shift, n) in [
        (TimeDelta::hours(1), 1),
        (TimeDelta::seconds(-10), 2),
        (TimeDelta::milliseconds(2), 3),
    ] {
        db.ledger.shift_remembered_clock(shift);
        let before = db_clock(&db.ledger).await;
        let job = db.enqueue(None, json!({ "n": n })).await;
        let after = db_clock(&db.ledger).await;
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
    }
    db.assert_verified().await;
}

/// A remembered epoch below the one of a purged lifecycle of the same key
/// is refused (JL002) and the enqueue draws afresh instead of handing out
/// the next remembered one.
#[tokio::test]
async fn a_remembered_epoch_below_a_purged_lifecycle_is_drawn_again() {
    let db = fresh().await;
    let first = db.enqueue(None, json!({"n": 0})).await; // remembers a block above it
    let other = Ledger::connect(&db.url, 2).await.unwrap();
    let purged = other
        .enqueue(new_job("q", Some("K"), json!({"n": 1})))
        .await
        .unwrap()
        .job;
    assert!(
        purged.epoch > first.epoch + 63,
        "drawn after the remembered block"
    );
    other.cancel(purged.job_id, None).await.unwrap();
    assert_eq!(other.purge(Duration::ZERO, 10).await.unwrap(), 1);
    let e = db
        .ledger
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

/// A single enqueue wakes workers and log readers after its commit (its
/// insert leaves the notifications to the ledger's next statement): every
/// enqueue is announced on both channels, the job is visible by then, and
/// the statement's setting does not outlive it, so a later write on the
/// same connection notifies from its triggers as before.
#[tokio::test]
async fn a_single_enqueue_wakes_after_its_commit() {
    use sqlx::postgres::PgListener;
    let db = fresh().await;
    // One connection: every write below runs on the same session.
    let one = Ledger::connect(&db.url, 1).await.unwrap();
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener
        .listen_all(["jobledger_queued", "jobledger_events"])
        .await
        .unwrap();
    for n in 0..3 {
        let job = one
            .enqueue(new_job("q", None, json!({ "n": n })))
            .await
            .unwrap()
            .job;
        let mut got = Vec::new();
        for _ in 0..2 {
            let note = common::within("a wake-up", listener.recv()).await.unwrap();
            got.push((note.channel().to_string(), note.payload().to_string()));
        }
        got.sort();
        assert_eq!(
            got,
            [
                ("jobledger_events".into(), String::new()),
                ("jobledger_queued".into(), "q".into())
            ],
            "enqueue {n}"
        );
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM jobledger.jobs WHERE job_id = $1")
            .bind(job.job_id)
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
        assert_eq!(seen, 1, "enqueue {n}: visible when announced");
    }
    // A batch in its own transaction, on the same session: its triggers
    // notify (nothing was left switched off).
    one.enqueue_many_as(vec![new_job("other", None, json!({}))], "api")
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        let note = common::within("the batch's wake-up", listener.recv())
            .await
            .unwrap();
        got.push(note.channel().to_string());
    }
    got.sort();
    assert_eq!(got, ["jobledger_events", "jobledger_queued"]);
    db.assert_verified().await;
}
