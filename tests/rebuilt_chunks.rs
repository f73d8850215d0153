//! `jobs_rebuilt` folds a batch in chunks of whole jobs, each on a
//! blocking thread while the chunk before it is written (issue 15). A
//! batch of several chunks must land as small batches do: every job right,
//! rows that do not parse left alone in whichever chunk they fall, and the
//! whole batch in one transaction.

mod common;

use common::{fresh, new_job, TestDb};
use jobledger::domain::ErrorClass;
use jobledger::ledger::Lease;
use serde_json::json;
use std::time::Duration;
use uuid::Uuid;

/// Three chunks of at most 1,000 jobs (`rebuilt::CHUNK_JOBS`).
const JOBS: usize = 2_500;
/// One batch holds every event of the test.
const BATCH: i64 = 10_000;

async fn enqueue_all(db: &TestDb) -> Vec<Uuid> {
    let news = (0..JOBS).map(|i| new_job("q", None, json!({ "i": i }))).collect();
    let mut ids: Vec<Uuid> = db
        .ledger
        .enqueue_many_as(news, "test")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.job.job_id)
        .collect();
    // The reader hands a batch out in job order: the last id is in the last chunk.
    ids.sort();
    ids
}

/// Cancels every seventh job (one event, so that the others' two straddle
/// any fixed count of events), claims the rest, completes two of three of
/// those and fails the third. Returns how many succeeded.
async fn work_all(db: &TestDb, ids: &[Uuid]) -> i64 {
    for id in ids.iter().step_by(7) {
        assert!(db.ledger.cancel(*id, None).await.unwrap().committed());
    }
    let to_claim = JOBS - ids.len().div_ceil(7);
    let mut leases = vec![];
    while leases.len() < to_claim {
        let got = db
            .ledger
            .claim("q", "w", Duration::from_secs(60), 500)
            .await
            .unwrap();
        assert!(!got.is_empty(), "{} of {to_claim} jobs claimed", leases.len());
        leases.extend(got);
    }
    let (fail, complete): (Vec<_>, Vec<_>) = leases.iter().enumerate().partition(|(i, _)| i % 3 == 0);
    let succeeded = complete.len() as i64;
    let items = complete
        .into_iter()
        .map(|(i, l)| (l, Some(json!({ "done": i }))))
        .collect();
    for r in Lease::complete_many(&db.ledger, items).await.unwrap() {
        assert!(r.committed(), "{r:?}");
    }
    for (_, l) in fail {
        assert!(l
            .fail(ErrorClass::Permanent, "no", None)
            .await
            .unwrap()
            .committed());
    }
    succeeded
}

/// The table `jobs_rebuilt` serves from.
async fn rebuilt_table(db: &TestDb) -> String {
    sqlx::query_scalar("SELECT active_table FROM jobledger_proj.registry WHERE name = 'jobs_rebuilt'")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap()
}

/// Marks `job`'s first event as written in a schema newer than this build.
async fn newer_schema(db: &TestDb, job: Uuid) {
    db.around_the_log(
        "UPDATE jobledger.events SET schema = 99 WHERE job_id = $1 AND version = 1",
        job,
    )
    .await;
}

/// Makes every insert into `table` whose row meets `when` (SQL over `NEW`)
/// fail with `boom`.
async fn failing_inserts(db: &TestDb, table: &str, when: &str) {
    for sql in [
        format!(
            "CREATE FUNCTION public.boom() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF {when} THEN RAISE EXCEPTION 'boom'; END IF; RETURN NEW; END $$"
        ),
        format!(
            "CREATE TRIGGER boom BEFORE INSERT ON jobledger_proj.\"{table}\" \
             FOR EACH ROW EXECUTE FUNCTION public.boom()"
        ),
    ] {
        sqlx::query(&sql).execute(db.ledger.pool()).await.unwrap();
    }
}

async fn rebuilt_rows(db: &TestDb, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobledger_proj.jobs_rebuilt WHERE state = $1")
        .bind(state)
        .fetch_one(db.ledger.pool())
        .await
        .unwrap()
}

/// New jobs inserted in three chunks, then read back and updated in three:
/// every row equals the inline projection.
#[tokio::test]
async fn a_batch_of_several_chunks_rebuilds_every_job() {
    let db = fresh().await;
    let ids = enqueue_all(&db).await;
    common::catch_up_jobs_rebuilt(&db, BATCH).await.unwrap();
    assert_eq!(rebuilt_rows(&db, "queued").await, JOBS as i64);
    let succeeded = work_all(&db, &ids).await;
    common::catch_up_jobs_rebuilt(&db, BATCH).await.unwrap();
    let problems = db.ledger.compare_rebuilt().await.unwrap();
    assert!(problems.is_empty(), "{:?}", &problems[..problems.len().min(3)]);
    assert_eq!(rebuilt_rows(&db, "succeeded").await, succeeded);
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.jobs_rebuilt").await,
        JOBS as i64
    );
}

/// A row edited into text that does not parse, in the batch's last chunk,
/// leaves only its own job behind; the other chunks' jobs move on.
#[tokio::test]
async fn an_unreadable_row_in_a_later_chunk_stops_only_its_job() {
    let db = fresh().await;
    let ids = enqueue_all(&db).await;
    common::catch_up_jobs_rebuilt(&db, BATCH).await.unwrap();
    let last = *ids.last().unwrap();
    let table = rebuilt_table(&db).await;
    sqlx::query(&format!(
        "UPDATE jobledger_proj.\"{table}\" SET job = 'not json' WHERE job_id = $1"
    ))
    .bind(last)
    .execute(db.ledger.pool())
    .await
    .unwrap();
    work_all(&db, &ids).await;
    common::catch_up_jobs_rebuilt(&db, BATCH).await.unwrap();
    let problems = db.ledger.compare_rebuilt().await.unwrap();
    let named: Vec<Uuid> = problems.iter().map(|p| p.job_id).collect();
    assert_eq!(named, vec![last], "{problems:?}");
    assert_eq!(
        rebuilt_rows(&db, "queued").await,
        1,
        "the unreadable job stays as it was"
    );
}

/// An event of a schema newer than this build, in the batch's last chunk,
/// fails the whole batch: nothing of it lands and the checkpoint stays
/// where it was. (Such a batch folds whole before it writes; the test after
/// the next one fails a later chunk's write instead.)
#[tokio::test]
async fn a_newer_schema_in_the_last_chunk_lands_nothing_of_the_batch() {
    let db = fresh().await;
    let ids = enqueue_all(&db).await;
    newer_schema(&db, *ids.last().unwrap()).await;
    let err = common::catch_up_jobs_rebuilt(&db, BATCH)
        .await
        .expect_err("an unreadable schema stops the projection");
    assert!(err.to_string().contains("upgrade jobledger"), "{err}");
    assert_nothing_landed(&db).await;
}

/// A write that fails in an earlier chunk does not hide an event of a newer
/// schema in a later one: the batch says to upgrade, as it did when it was
/// folded whole before its write (review, helper-52).
#[tokio::test]
async fn a_newer_schema_in_a_later_chunk_is_named_before_a_write_fails() {
    let db = fresh().await;
    common::catch_up_jobs_rebuilt(&db, BATCH).await.unwrap(); // the table, empty
    let ids = enqueue_all(&db).await;
    newer_schema(&db, *ids.last().unwrap()).await;
    let table = rebuilt_table(&db).await;
    failing_inserts(&db, &table, "true").await;
    let err = common::catch_up_jobs_rebuilt(&db, BATCH)
        .await
        .expect_err("an unreadable schema stops the projection");
    assert!(err.to_string().contains("upgrade jobledger"), "{err}");
}

/// A write that fails in the batch's last chunk rolls back the chunks
/// written before it: the batch is one transaction, its checkpoint with it.
#[tokio::test]
async fn a_write_failing_in_the_last_chunk_lands_nothing_of_the_batch() {
    let db = fresh().await;
    common::catch_up_jobs_rebuilt(&db, BATCH).await.unwrap(); // the table, empty
    let ids = enqueue_all(&db).await;
    let table = rebuilt_table(&db).await;
    let last = ids.last().unwrap();
    failing_inserts(&db, &table, &format!("NEW.job_id = '{last}'")).await;
    let err = common::catch_up_jobs_rebuilt(&db, BATCH)
        .await
        .expect_err("the last chunk's insert fails");
    assert!(err.to_string().contains("boom"), "{err}");
    assert_nothing_landed(&db).await;
}

/// A shared buffer for a scoped subscriber's output.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Folding runs on a blocking thread; its warnings still reach the
/// caller's subscriber, scoped to the caller's thread, inside the caller's
/// span (review, helper-52: they went to the global subscriber).
#[tokio::test]
async fn a_folding_warning_reaches_a_scoped_subscriber_in_the_callers_span() {
    use tracing::Instrument;
    let db = fresh().await;
    let job = db.enqueue(Some("k-edited"), json!({"n": 1})).await;
    common::catch_up_jobs_rebuilt(&db, BATCH).await.unwrap();
    sqlx::query("UPDATE jobledger_proj.jobs_rebuilt SET job = 'not json' WHERE job_id = $1")
        .bind(job.job_id)
        .execute(db.ledger.pool())
        .await
        .unwrap();
    db.ledger.cancel(job.job_id, None).await.unwrap();
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _scoped = tracing::subscriber::set_default(subscriber);
    common::catch_up_jobs_rebuilt(&db, BATCH)
        .instrument(tracing::info_span!("the_catch_up"))
        .await
        .unwrap();
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("does not parse"))
        .unwrap_or_else(|| panic!("no warning captured:\n{text}"));
    assert!(line.contains("the_catch_up"), "{line}");
    assert!(line.contains(&job.job_id.to_string()), "{line}");
}

/// No row of the batch in the table, and the checkpoint still at 0.
async fn assert_nothing_landed(db: &TestDb) {
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.jobs_rebuilt").await,
        0
    );
    assert_eq!(
        db.count("SELECT position FROM jobledger_proj.registry WHERE name = 'jobs_rebuilt'")
            .await,
        0
    );
}
