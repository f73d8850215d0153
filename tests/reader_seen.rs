//! The log reader remembers where it met each job's highest version, and
//! looks up in the log only the versions a batch lacks that it has not met
//! at or before the batch's end (`reader::Seen`): the same events come out,
//! with fewer lookups, and a version it met past a batch's end is still
//! handed out early.

mod common;

use common::reading::{drain, drain_probed, early_xid_trap};
use common::{fresh, TestDb};
use jobledger::reader::{Checkpoint, LogEvent, LogReader};
use serde_json::json;
use uuid::Uuid;

fn versions(events: &[LogEvent]) -> Vec<(Uuid, i64)> {
    events.iter().map(|e| (e.job_id(), e.version())).collect()
}

async fn work_all(db: &TestDb, jobs: usize) {
    for _ in 0..jobs {
        let lease = db.claim_one("w").await;
        assert!(lease.complete(Some(json!({}))).await.unwrap().committed());
    }
}

#[tokio::test]
async fn a_reader_that_met_each_jobs_predecessor_looks_none_up() {
    let db = fresh().await;
    let reader = LogReader::source(db.ledger.pool().clone());
    for _ in 0..20 {
        db.enqueue(None, json!({})).await;
    }
    let (enqueued, cp) = drain(&reader, Checkpoint::default(), 100).await;
    assert_eq!(enqueued.len(), 20);
    work_all(&db, 20).await;

    // Batches of 7 cut between a job's v2 and v3 too.
    let (met, end, probed) = drain_probed(&reader, cp, 7).await;
    let stranger = LogReader::source(db.ledger.pool().clone());
    let (fresh_read, fresh_end, fresh_probed) = drain_probed(&stranger, cp, 7).await;
    assert_eq!(met.len(), 40, "every job's v2 and v3, none early");
    assert_eq!(
        versions(&met),
        versions(&fresh_read),
        "the same events either way"
    );
    assert_eq!(end, fresh_end);
    assert_eq!(
        probed, 0,
        "every predecessor was met at or before its batch's end"
    );
    assert!(
        fresh_probed >= 20,
        "a reader that met none looks each job's up: {fresh_probed}"
    );
}

/// The reader meets J's v3 as J's highest, reading from past v4; read again
/// from before v4, the batch holding v4 lacks v3, which lies past its end:
/// v3 is looked up and handed out early, not taken as read.
#[tokio::test]
async fn a_version_met_past_a_batchs_end_is_still_handed_out_early() {
    let db = fresh().await;
    let reader = LogReader::source(db.ledger.pool().clone());
    let (j, _, cp) = early_xid_trap(&db, &reader).await;
    let (v4_txid, v4_position): (i64, i64) = sqlx::query_as(
        "SELECT txid::text::bigint, position FROM jobledger.events WHERE job_id = $1 AND version = 4",
    )
    .bind(j.job_id)
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    let past_v4 = Checkpoint {
        txid: v4_txid,
        position: v4_position,
    };
    let (tail, _) = drain(&reader, past_v4, 100).await;
    assert_eq!(versions(&tail), vec![(j.job_id, 3)], "the reader met v3 alone");

    // Batches of 2 from v2: the other job's v1 and J's v4, ending before v3.
    let (again, _, probed) = drain_probed(&reader, cp, 2).await;
    let js: Vec<i64> = again
        .iter()
        .filter(|e| e.job_id() == j.job_id)
        .map(|e| e.version())
        .collect();
    assert_eq!(js, vec![3, 4, 3], "v3 early, v4, then v3 again in its place");
    assert!(probed >= 1);
}
