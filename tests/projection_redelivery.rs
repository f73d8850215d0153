//! `job_timeline` inserts each batch plainly and falls back to the
//! idempotent insert only when a (job, version) comes again: a redelivered
//! row changes nothing, and the rest of its batch is still written.

mod common;

use common::{fresh, within};
use jobledger::rebuilt::JobsRebuilt;
use jobledger_projections::shipped::{JobTimeline, QueueStats};
use jobledger_projections::{Event, Projection};
use serde_json::Value;
use uuid::Uuid;

fn event(job_id: Uuid, version: i64, actor: &str) -> Event {
    Event {
        position: version,
        job_id,
        version,
        kind: "observed".into(),
        from_state: Some("queued".into()),
        to_state: "queued".into(),
        reason: "observed".into(),
        error_class: None,
        actor: actor.into(),
        epoch: 1,
        token: 0,
        attempt: 0,
        run: 0,
        data: Value::Null,
        recorded_at: chrono::Utc::now(),
        prev_hash: None,
        hash: String::new(),
        schema: 1,
    }
}

/// After the fallback, no savepoint of the insert is left open either: a
/// caller applying many batches in one transaction does not nest
/// subtransactions.
#[tokio::test]
async fn a_redelivered_version_changes_nothing_and_the_batch_is_written() {
    let db = fresh().await;
    let table = "public.timeline_redelivery";
    let mut tx = db.ledger.pool().begin().await.unwrap();
    JobTimeline.create(&mut tx, table).await.unwrap();
    let job = Uuid::now_v7();
    JobTimeline
        .apply(&mut tx, table, &[event(job, 1, "first"), event(job, 2, "first")])
        .await
        .unwrap();
    // Version 2 again (handed out early, then met in log order), with a
    // different actor that must not land, beside a new version 3.
    JobTimeline
        .apply(&mut tx, table, &[event(job, 2, "again"), event(job, 3, "first")])
        .await
        .expect("a redelivered version is not an error");
    let rows: Vec<(i64, String)> =
        sqlx::query_as(&format!("SELECT version, actor FROM {table} ORDER BY version"))
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    let want: Vec<(i64, String)> = vec![(1, "first".into()), (2, "first".into()), (3, "first".into())];
    assert_eq!(rows, want);
    let left = sqlx::query("RELEASE SAVEPOINT jobledger_plain_insert")
        .execute(&mut *tx)
        .await
        .expect_err("no savepoint left to release");
    assert!(left.to_string().contains("does not exist"), "{left}");
}

/// One job enqueued, claimed and completed, and its three events as the
/// log hands them to projections.
async fn finished_job(db: &common::TestDb) -> (Uuid, Vec<Event>) {
    use jobledger_projections::{Checkpoint, DataWanted, LogSource};
    let job = db.enqueue(None, serde_json::json!({"n": 1})).await;
    let lease = db.claim_one("w").await;
    assert!(lease.complete(None).await.unwrap().committed());
    let reader = jobledger::reader::LogReader::open(db.ledger.pool().clone(), "redelivery")
        .await
        .unwrap();
    // One read need not hand out all three: the horizon is cluster-wide,
    // and a transaction of another test's database that ends while a read
    // looks at it holds the horizon for that read (CI saw [1, 2]). Read on.
    let v = within("the job's three events pass the log horizon", async {
        let (mut at, mut v) = (Checkpoint::default(), Vec::<Event>::new());
        while v.len() < 3 {
            let (log, next) = LogSource::read(&reader, at, 10, DataWanted::default())
                .await
                .unwrap();
            // Versions come again (duplicates) but never past a gap.
            for e in log.into_iter().filter(|e| e.job_id == job.job_id) {
                if e.version > v.len() as i64 {
                    assert_eq!(e.version, v.len() as i64 + 1, "a gap after {:?}", v.len());
                    v.push(e);
                }
            }
            if next == at {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            at = next;
        }
        v
    })
    .await;
    assert_eq!(v.iter().map(|e| e.version).collect::<Vec<_>>(), [1, 2, 3]);
    (job.job_id, v)
}

/// `jobs_rebuilt` folds a job whose stream a batch holds whole (versions 1,
/// 2, … without a gap) from nothing, without reading its row back; any
/// other shape reads it back. Each batch below is one the reader can hand
/// out: versions handed out early come again in log order.
#[tokio::test]
async fn jobs_rebuilt_meets_redelivered_streams_at_their_newest_version() {
    let db = fresh().await;
    let (job, v) = finished_job(&db).await;
    let table = "public.rebuilt_redelivery";
    let mut tx = db.ledger.pool().begin().await.unwrap();
    JobsRebuilt.create(&mut tx, table).await.unwrap();
    let mut apply = async |batch: &[&Event]| {
        let batch: Vec<Event> = batch.iter().map(|e| (*e).clone()).collect();
        JobsRebuilt.apply(&mut tx, table, &batch).await.unwrap();
        sqlx::query_as::<_, (i64, String)>(&format!("SELECT version, state FROM {table}"))
            .fetch_one(&mut *tx)
            .await
            .unwrap()
    };
    assert_eq!(apply(&[&v[0], &v[1]]).await, (2, "leased".into()));
    // Version 1 again, then 3: not whole (2 is missing), so read back.
    assert_eq!(apply(&[&v[0], &v[2]]).await, (3, "succeeded".into()));
    // Whole streams that end at or before the row's version leave it.
    assert_eq!(apply(&[&v[0]]).await, (3, "succeeded".into()));
    assert_eq!(apply(&[&v[0], &v[1], &v[1]]).await, (3, "succeeded".into()));
    assert_eq!(apply(&[&v[0], &v[1], &v[2]]).await, (3, "succeeded".into()));
    let doc: String = sqlx::query_scalar(&format!("SELECT job FROM {table}"))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let rebuilt: jobledger::domain::Job = serde_json::from_str(&doc).unwrap();
    assert_eq!(rebuilt, db.job(job).await);
}

/// A stream redelivered with an event of a schema newer than this build,
/// which the row is already past (a newer build applied it), is read back
/// and skipped, not refused: only an event still to apply fails the batch.
#[tokio::test]
async fn jobs_rebuilt_skips_a_redelivered_event_of_a_newer_schema() {
    let db = fresh().await;
    let (_, mut v) = finished_job(&db).await;
    let table = "public.rebuilt_newer";
    let mut tx = db.ledger.pool().begin().await.unwrap();
    JobsRebuilt.create(&mut tx, table).await.unwrap();
    JobsRebuilt.apply(&mut tx, table, &v).await.unwrap();
    v[2].schema = jobledger::domain::schema::CURRENT + 1;
    JobsRebuilt
        .apply(&mut tx, table, &v)
        .await
        .expect("already applied: skipped");
    JobsRebuilt
        .create(&mut tx, "public.rebuilt_newer_fresh")
        .await
        .unwrap();
    let err = JobsRebuilt
        .apply(&mut tx, "public.rebuilt_newer_fresh", &v)
        .await
        .expect_err("still to apply: refused");
    assert!(err.to_string().contains("upgrade jobledger"), "{err}");
}

/// `queue_stats` takes a job whose first event in a batch is version 1 for
/// new, without reading it back; when that version 1 comes again (handed
/// out early, then met in log order) its insert meets the row, and the
/// batch is applied again reading every job back: each job is counted
/// once, and no savepoint is left open.
#[tokio::test]
async fn queue_stats_counts_a_redelivered_stream_once() {
    let db = fresh().await;
    let (_, v) = finished_job(&db).await;
    let other = db.enqueue(None, serde_json::json!({"n": 2})).await;
    let (table, side) = ("public.stats_redelivery", "public.stats_redelivery__jobs");
    let mut tx = db.ledger.pool().begin().await.unwrap();
    QueueStats.create(&mut tx, table).await.unwrap();
    let mut apply = async |batch: Vec<Event>| {
        QueueStats.apply(&mut tx, table, &batch).await.unwrap();
        let counts = sqlx::query_as::<_, (String, i64, i64, i64)>(&format!(
            "SELECT queue, queued, leased, succeeded FROM {table} ORDER BY queue"
        ))
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        let jobs = sqlx::query_as::<_, (String, i64)>(&format!(
            "SELECT state, version FROM {side} ORDER BY version"
        ))
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        (counts, jobs)
    };
    let q = || v[0].data["queue"].as_str().unwrap().to_string();
    let (counts, _) = apply(v[..2].to_vec()).await;
    assert_eq!(counts, [(q(), 0, 1, 0)]);
    // The whole stream again beside a new job: version 1's insert meets
    // its row; the batch is applied again, and the new job once.
    let mut batch = v.clone();
    let mut new = v[0].clone();
    new.job_id = other.job_id;
    batch.push(new);
    let (counts, jobs) = apply(batch).await;
    assert_eq!(counts, [(q(), 1, 0, 1)], "each job counted once");
    assert_eq!(jobs, [("queued".to_string(), 1), ("succeeded".to_string(), 3)]);
    // Only version 1 again: nothing changes.
    let (counts, _) = apply(v[..1].to_vec()).await;
    assert_eq!(counts, [(q(), 1, 0, 1)]);
    let left = sqlx::query("RELEASE SAVEPOINT jobledger_queue_stats")
        .execute(&mut *tx)
        .await
        .expect_err("no savepoint left to release");
    assert!(left.to_string().contains("does not exist"), "{left}");
}
