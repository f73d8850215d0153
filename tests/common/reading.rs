//! Reading the whole log through a `LogReader`, as the reader tests do.

use super::TestDb;
use jobledger::domain::Job;
use jobledger::reader::{Batch, Checkpoint, LogEvent, LogReader};
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;

/// Reads until every committed event of this database is behind the
/// checkpoint. An empty batch alone does not mean that: the snapshot horizon
/// is cluster-wide, so another test's open transaction (these tests hold some
/// on purpose) can hold the reader back for a while. It must never make the
/// reader skip anything, which is what the callers assert.
pub async fn drain(reader: &LogReader, from: Checkpoint, limit: i64) -> (Vec<LogEvent>, Checkpoint) {
    drain_data_of(reader, from, limit, None, None).await
}

/// `drain` with `data` only on the named kinds of event, and of it only
/// the named keys.
pub async fn drain_data_of(
    reader: &LogReader,
    from: Checkpoint,
    limit: i64,
    data_of: Option<&[&str]>,
    keys: Option<&[&str]>,
) -> (Vec<LogEvent>, Checkpoint) {
    drain_wanted(reader, from, limit, data_of, keys, true).await
}

/// `drain_data_of`, with the hash chain's columns only when `hashes`.
pub async fn drain_wanted(
    reader: &LogReader,
    from: Checkpoint,
    limit: i64,
    data_of: Option<&[&str]>,
    keys: Option<&[&str]>,
    hashes: bool,
) -> (Vec<LogEvent>, Checkpoint) {
    drain_by(reader, from, |cp| {
        reader.read_data(cp, limit, data_of, keys, hashes)
    })
    .await
}

/// `drain` with each event's data unparsed (`read_raw`, as the relay reads).
pub async fn drain_raw(reader: &LogReader, from: Checkpoint, limit: i64) -> (Vec<LogEvent>, Checkpoint) {
    drain_by(reader, from, |cp| reader.read_raw(cp, limit)).await
}

/// `drain`, also counting the versions the reader looked up in the log
/// (`Batch::probed`).
pub async fn drain_probed(
    reader: &LogReader,
    from: Checkpoint,
    limit: i64,
) -> (Vec<LogEvent>, Checkpoint, usize) {
    probed_by(reader, from, |cp| reader.read(cp, limit)).await
}

async fn drain_by<F, R>(reader: &LogReader, from: Checkpoint, read: F) -> (Vec<LogEvent>, Checkpoint)
where
    F: Fn(Checkpoint) -> R,
    R: std::future::Future<Output = jobledger::ledger::LedgerResult<Batch>>,
{
    let (events, cp, _) = probed_by(reader, from, read).await;
    (events, cp)
}

async fn probed_by<F, R>(reader: &LogReader, from: Checkpoint, read: F) -> (Vec<LogEvent>, Checkpoint, usize)
where
    F: Fn(Checkpoint) -> R,
    R: std::future::Future<Output = jobledger::ledger::LedgerResult<Batch>>,
{
    let (mut cp, mut out, mut probed) = (from, vec![], 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let b = read(cp).await.unwrap();
        if b.events.is_empty() {
            if !reader.behind(cp).await.unwrap() {
                return (out, cp, probed);
            }
            if std::time::Instant::now() > deadline {
                let lag = reader.lag(cp).await.unwrap();
                panic!("the reader is still held back after 30 s: {lag:?}");
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            continue;
        }
        out.extend(b.events);
        cp = b.next;
        probed += b.probed;
    }
}

/// Trap 2 of docs/log-reader.md, set by gates: job J at v1 and v2, read by
/// `reader` up to the returned checkpoint; then a transaction that took its
/// xid first (enqueueing another job) appends J's v4 after waiting for
/// v3's, so v4's txid is below v3's and the log reads J v4 before J v3.
pub async fn early_xid_trap(db: &TestDb, reader: &LogReader) -> (Job, Vec<LogEvent>, Checkpoint) {
    let j = db.enqueue(Some("J"), json!({})).await;
    let lease = db.claim_one("w").await;
    let (before, cp) = drain(reader, Checkpoint::default(), 100).await;
    assert_eq!(before.len(), 2, "v1 and v2 of J are behind the checkpoint");

    let mut t1 = db.ledger.pool().begin().await.unwrap();
    db.ledger
        .enqueue_in(&mut t1, super::new_job("q", Some("other"), json!({})))
        .await
        .unwrap(); // xid taken
    let mut t2 = db.ledger.pool().begin().await.unwrap();
    assert!(lease
        .complete_in(&mut t2, Some(json!({"v": 3})))
        .await
        .unwrap()
        .committed()); // J v3, larger xid

    let ledger = db.ledger.clone();
    let t1_task = tokio::spawn(async move {
        let r = ledger
            .observe_in(&mut t1, j.job_id, None, "late-receipt", json!({}), "w")
            .await
            .unwrap();
        assert!(r.committed());
        t1.commit().await.unwrap();
    });
    super::eventually("a transaction waits on J's row lock", || async {
        db.count("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()")
            .await
            > 0
    })
    .await;
    t2.commit().await.unwrap();
    t1_task.await.unwrap();

    let txids: HashMap<i64, i64> = sqlx::query_as::<_, (i64, i64)>(
        "SELECT version, txid::text::bigint FROM jobledger.events WHERE job_id = $1",
    )
    .bind(j.job_id)
    .fetch_all(db.ledger.pool())
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert!(
        txids[&4] < txids[&3],
        "the trap is set: v4's txid {} < v3's {}",
        txids[&4],
        txids[&3]
    );
    (j, before, cp)
}
