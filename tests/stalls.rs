//! Issue 10: a catch-up that cannot move gives up instead of hanging its
//! caller. In a binary of its own: it holds the snapshot horizon on purpose,
//! and tests/projections.rs asserts batch sizes.

mod common;

use common::{fresh, within};
use jobledger::reader::LogReader;
use jobledger_projections::runner::Runner;
use jobledger_projections::shipped::JobTimeline;
use serde_json::json;

/// `held` is the runner giving up on `job_timeline` after its patience
/// (300 ms here), for the reason `why` names.
fn assert_stalled<T: std::fmt::Debug>(held: Result<T, jobledger_projections::ProjectionError>, why: &str) {
    match held {
        Err(jobledger_projections::ProjectionError::Stalled { name, waited }) => {
            assert_eq!(name, "job_timeline");
            assert!(waited >= std::time::Duration::from_millis(300), "{waited:?}");
        }
        other => panic!("{why} is a stall, got {other:?}"),
    }
}

/// A session in a transaction that has read the serving view: a switch's
/// DDL waits for it to end.
async fn reading_the_view(db: &common::TestDb) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut viewer = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM jobledger_proj.job_timeline")
        .execute(&mut *viewer)
        .await
        .unwrap();
    viewer
}

/// Issue 10: a catch-up that cannot move (a commit waits behind an open
/// transaction) gives up after the runner's patience with an error that
/// says why, instead of hanging its caller; once the transaction ends the
/// same runner catches up.
#[tokio::test]
async fn a_catch_up_held_by_an_open_transaction_reports_a_stall() {
    let db = fresh().await;
    db.enqueue(Some("before"), json!({})).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10)
        .await
        .unwrap()
        .with_patience(std::time::Duration::from_millis(300));
    within("a catch-up", r.catch_up(&[&JobTimeline])).await.unwrap();

    let mut holder = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *holder)
        .await
        .unwrap();
    db.enqueue(Some("waits"), json!({})).await;
    let held = within("a stalled catch-up", r.catch_up(&[&JobTimeline])).await;
    assert_stalled(held, "a held horizon");
    holder.rollback().await.unwrap();
    within("a catch-up", r.catch_up(&[&JobTimeline])).await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.job_timeline").await,
        2,
        "the waiting commit arrives"
    );
}

/// A session that keeps the view open (a transaction that read it) cannot
/// block the switch's DDL, and every runner behind it, for longer than the
/// switch's lock wait: the catch-up returns without switching, and switches
/// once the session is gone.
#[tokio::test]
async fn a_reader_holding_the_view_delays_the_switch_without_hanging() {
    let db = fresh().await;
    db.enqueue(Some("v"), json!({})).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    within("a catch-up", r.catch_up(&[&JobTimeline])).await.unwrap();
    r.start_rebuild(&JobTimeline).await.unwrap();
    let viewer = reading_the_view(&db).await;
    let held = within("a catch-up beside a reader", r.catch_up(&[&JobTimeline]))
        .await
        .unwrap();
    assert_eq!(held.switched_to, None, "not switched while the view is read");
    viewer.rollback().await.unwrap();
    // The next try comes after the retry pause (readers of the view are not
    // made to queue behind a switch again and again meanwhile).
    let switched = within("the switch after the reader left", async {
        loop {
            if let Some(v) = r.catch_up(&[&JobTimeline]).await.unwrap().switched_to {
                return v;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(switched, 1);
}

/// `projections rebuild` (`Runner::finish_rebuild`) gives up like
/// `catch_up` when nothing moves for the runner's patience, here a session
/// keeping the view open so that every switch times out; it waited for
/// good before (review, helper-51). Once the session is gone, it finishes.
#[tokio::test]
async fn a_rebuild_whose_switch_keeps_timing_out_reports_a_stall() {
    let db = fresh().await;
    db.enqueue(Some("v"), json!({})).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10)
        .await
        .unwrap()
        .with_patience(std::time::Duration::from_millis(300));
    within("a catch-up", r.catch_up(&[&JobTimeline])).await.unwrap();
    let table = r.start_rebuild(&JobTimeline).await.unwrap();
    let viewer = reading_the_view(&db).await;
    let held = within(
        "a rebuild beside a reader",
        r.finish_rebuild(&JobTimeline, &table, |_| {}),
    )
    .await;
    assert_stalled(held, "a switch that keeps timing out");
    viewer.rollback().await.unwrap();
    // A runner without the first one's pause before its next switch.
    let r2 = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    let v = within(
        "the rebuild after the reader left",
        r2.finish_rebuild(&JobTimeline, &table, |_| {}),
    )
    .await
    .unwrap();
    assert_eq!(v, 1);
}
