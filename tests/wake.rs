//! Issue 15: wake-ups (`jobledger_events`, `jobledger_queued`,
//! `jobledger_cancel`) are sent after the ledger's own transactions commit,
//! not from inside them, where PostgreSQL's notify lock made every write
//! transaction commit one after another (src/ledger/wake.rs). Listeners
//! still get every wake-up they got before, with the same payloads, and a
//! write inside a caller's transaction still wakes only when it commits.

mod common;

use common::{fresh, new_job, within};
use serde_json::json;
use sqlx::postgres::{PgListener, PgNotification};
use std::time::Duration;

async fn listener(url: &str) -> PgListener {
    let mut l = PgListener::connect(url).await.expect("listener");
    l.listen_all([
        "jobledger_events",
        "jobledger_queued",
        "jobledger_cancel",
        "sentinel",
    ])
    .await
    .expect("listen");
    l
}

async fn next(l: &mut PgListener) -> (String, String) {
    let n: PgNotification = within("a notification", l.recv()).await.expect("recv");
    (n.channel().to_string(), n.payload().to_string())
}

/// Receives until `want` arrives; returns what came before it.
async fn until(l: &mut PgListener, want: (&str, &str)) -> Vec<(String, String)> {
    let mut before = vec![];
    loop {
        let got = next(l).await;
        if (got.0.as_str(), got.1.as_str()) == want {
            return before;
        }
        before.push(got);
    }
}

/// Fails on the code before the change: the log's and the jobs' triggers
/// called `pg_notify`, inside every write transaction.
#[tokio::test]
async fn no_write_notifies_from_inside_its_transaction() {
    let db = fresh().await;
    let n = db
        .count(
            "SELECT count(*) FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid \
             WHERE t.tgrelid IN ('jobledger.events'::regclass, 'jobledger.jobs'::regclass) \
               AND p.prosrc ILIKE '%notify%'",
        )
        .await;
    assert_eq!(n, 0, "a trigger on the log or the jobs still notifies");
}

/// The wake-ups workers and log readers wait for still arrive, with the
/// payloads they read: the queue of a job that became claimable, the id of
/// a job whose cancel was requested.
#[tokio::test]
async fn every_wake_up_still_arrives_with_its_payload() {
    let db = fresh().await;
    let mut l = listener(&db.url).await;
    let job = db
        .ledger
        .enqueue(new_job("wq", None, json!({})))
        .await
        .expect("enqueue")
        .job;
    let mut got = vec![next(&mut l).await, next(&mut l).await];
    got.sort();
    assert_eq!(
        got,
        vec![
            ("jobledger_events".into(), String::new()),
            ("jobledger_queued".into(), "wq".into())
        ]
    );
    let leases = db
        .ledger
        .claim("wq", "w1", Duration::from_secs(60), 1)
        .await
        .expect("claim");
    assert_eq!(leases.len(), 1);
    assert_eq!(next(&mut l).await, ("jobledger_events".into(), String::new()));
    db.ledger.cancel(job.job_id, None).await.expect("cancel");
    let before = until(&mut l, ("jobledger_cancel", &job.job_id.to_string())).await;
    assert!(before.iter().all(|(c, _)| c == "jobledger_events"), "{before:?}");
}

/// Inside a caller's transaction the wake-up is the transaction's own: it
/// arrives when, and only if, the caller commits. A sentinel notified and
/// committed from elsewhere while the caller's transaction is open must
/// arrive first (notifications arrive in commit order).
#[tokio::test]
async fn a_wake_up_inside_the_callers_transaction_waits_for_its_commit() {
    let db = fresh().await;
    let mut l = listener(&db.url).await;
    let mut caller = db.conn().await;
    sqlx::query("BEGIN").execute(&mut caller).await.unwrap();
    db.ledger
        .enqueue_in(&mut caller, new_job("tq", None, json!({})))
        .await
        .expect("enqueue_in");
    let mut other = db.conn().await;
    sqlx::query("SELECT pg_notify('sentinel', 'open')")
        .execute(&mut other)
        .await
        .unwrap();
    assert_eq!(next(&mut l).await, ("sentinel".into(), "open".into()));
    sqlx::query("COMMIT").execute(&mut caller).await.unwrap();
    let mut got = vec![next(&mut l).await, next(&mut l).await];
    got.sort();
    assert_eq!(
        got,
        vec![
            ("jobledger_events".into(), String::new()),
            ("jobledger_queued".into(), "tq".into())
        ]
    );
    // And a caller that rolls back wakes nobody.
    sqlx::query("BEGIN").execute(&mut caller).await.unwrap();
    db.ledger
        .enqueue_in(&mut caller, new_job("tq", None, json!({})))
        .await
        .expect("enqueue_in");
    sqlx::query("ROLLBACK").execute(&mut caller).await.unwrap();
    sqlx::query("SELECT pg_notify('sentinel', 'after')")
        .execute(&mut other)
        .await
        .unwrap();
    assert_eq!(next(&mut l).await, ("sentinel".into(), "after".into()));
}
