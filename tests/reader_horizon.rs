//! The log reader's horizon: which open or prepared transactions hold it
//! back (only this database's), and how `lag` names the holder.

mod common;

use common::fresh;
use common::reading::drain;
use jobledger::reader::{Checkpoint, LogReader};
use serde_json::json;
use std::time::Duration;

/// The horizon's holder as `lag` names it, once it is of `kind`: for one
/// statement, a transaction of another database that ended between the
/// snapshot and the activity lookup is unproven and named `unknown` (it holds
/// the horizon for that statement only: waiting, never skipping).
async fn holder_named(reader: &LogReader, at: Checkpoint, kind: &str) -> jobledger::reader::HorizonHolder {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let h = reader.lag(at).await.unwrap().horizon_holder;
        match h {
            Some(h) if h.kind == kind => return h,
            other => assert!(
                std::time::Instant::now() < deadline,
                "after 10 s the horizon is still held by {other:?}, not a {kind}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Issue 9 item 9: a transaction holding an xid open in another database of
/// the same server does not delay this database's events; one in this
/// database still does.
#[tokio::test]
async fn only_this_databases_open_transactions_hold_the_reader() {
    let db = fresh().await;
    let elsewhere = fresh().await;
    let reader = LogReader::open(db.ledger.pool().clone(), "r").await.unwrap();

    let mut foreign = elsewhere.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *foreign)
        .await
        .unwrap();
    let a = db.enqueue(Some("a"), json!({})).await;
    // This test itself holds an older xid elsewhere: anything the reader
    // hands out now is past it.
    // Drained, not one read: a transaction of another test's database that
    // ended between the snapshot and the activity lookup counts as ours for
    // that one statement (unproven: the reader waits, never skips).
    let (first, next) = drain(&reader, Checkpoint::default(), 100).await;
    assert_eq!(
        first.iter().map(|e| e.job_id()).collect::<Vec<_>>(),
        vec![a.job_id],
        "an open transaction in another database does not hold this one's reader"
    );
    let lag = reader.lag(next).await.unwrap();
    assert_eq!(lag.events, 0);

    let mut local = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *local)
        .await
        .unwrap();
    let c = db.enqueue(Some("c"), json!({})).await;
    let held = reader.read(next, 100).await.unwrap();
    assert!(
        held.events.is_empty(),
        "an open transaction in this database holds the reader"
    );
    let lag = reader.lag(next).await.unwrap();
    assert_eq!(lag.events, 1);
    let h = holder_named(&reader, next, "session").await;
    assert_eq!(
        (h.kind.as_str(), h.database.as_deref()),
        ("session", Some(db.name.as_str()))
    );
    local.rollback().await.unwrap();
    let (rest, _) = drain(&reader, next, 100).await;
    assert_eq!(
        rest.iter().map(|e| e.job_id()).collect::<Vec<_>>(),
        vec![c.job_id]
    );
    foreign.rollback().await.unwrap();
}

/// Issue 9 item 7: a prepared transaction holds the horizon like an open one
/// (in this database), is named in the lag report with its gid, and one
/// prepared in another database does not hold this database's reader.
/// Needs `max_prepared_transactions > 0` (scripts/test sets it).
#[tokio::test]
async fn a_prepared_transaction_holds_the_horizon_and_is_named() {
    use sqlx::Connection;
    let db = fresh().await;
    let enabled: String = sqlx::query_scalar("SHOW max_prepared_transactions")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert_ne!(
        enabled, "0",
        "max_prepared_transactions is 0: run scripts/test, which enables it"
    );
    let elsewhere = fresh().await;
    let prepare = |url: String, gid: String| async move {
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::raw_sql(&format!(
            "BEGIN; SELECT pg_current_xact_id(); PREPARE TRANSACTION '{gid}'"
        ))
        .execute(&mut c)
        .await
        .unwrap();
        Prepared { url, gid }
    };
    let (gid_far, gid_here) = (format!("far-{}", db.name), format!("here-{}", db.name));
    let far = prepare(elsewhere.url.clone(), gid_far).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "r").await.unwrap();
    let a = db.enqueue(Some("a"), json!({})).await;
    let (first, next) = drain(&reader, Checkpoint::default(), 100).await;
    assert_eq!(
        first.iter().map(|e| e.job_id()).collect::<Vec<_>>(),
        vec![a.job_id],
        "a transaction prepared in another database does not hold this reader"
    );

    let here = prepare(db.url.clone(), gid_here.clone()).await;
    db.enqueue(Some("c"), json!({})).await;
    let held = reader.read(next, 100).await.unwrap();
    assert!(
        held.events.is_empty(),
        "a prepared transaction here holds the reader"
    );
    let h = holder_named(&reader, next, "prepared").await;
    assert_eq!(h.gid.as_deref(), Some(gid_here.as_str()));
    assert_eq!(h.database.as_deref(), Some(db.name.as_str()));
    drop(here);
    drop(far);
    let (rest, _) = drain(&reader, next, 100).await;
    assert_eq!(rest.len(), 1);
}

/// A prepared transaction, rolled back when dropped (also when the test
/// fails: a leftover one would hold back vacuum on the whole server).
struct Prepared {
    url: String,
    gid: String,
}

impl Drop for Prepared {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .arg(&self.url)
            .arg("-qc")
            .arg(format!("ROLLBACK PREPARED '{}'", self.gid))
            .status();
    }
}
