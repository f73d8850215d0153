//! The log reader remembers where it met each job's lowest and highest
//! versions, and looks up in the log only the versions a batch lacks that it
//! has not met at or before the batch's end (`reader::seen`): the same events
//! come out, with fewer lookups, and a version it met past a batch's end is
//! still handed out early.

mod common;

use common::reading::{drain, drain_probed, early_xid_trap};
use common::{fresh, TestDb};
use jobledger::ledger::LedgerError;
use jobledger::reader::{Checkpoint, LogEvent, LogReader, ReaderHooks};
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
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

/// Where `version` of `job` lies in the log, as a checkpoint.
async fn place(pool: &sqlx::PgPool, job: Uuid, version: i64) -> Checkpoint {
    let (txid, position) = sqlx::query_as(
        "SELECT txid::text::bigint, position FROM jobledger.events WHERE job_id = $1 AND version = $2",
    )
    .bind(job)
    .bind(version)
    .fetch_one(pool)
    .await
    .unwrap();
    Checkpoint { txid, position }
}

/// Trap 2 on J at v1: T1 takes its xid, J v2 commits, T1 appends v3 (with
/// the smaller txid, before v2 in log order).
async fn small_xid_trap(db: &TestDb, j: Uuid) {
    let mut t1 = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *t1)
        .await
        .unwrap();
    db.ledger.observe(j, None, "a", json!({}), "w").await.unwrap();
    db.ledger
        .observe_in(&mut t1, j, None, "b", json!({}), "w")
        .await
        .unwrap();
    t1.commit().await.unwrap();
}

/// Keeps a copy of each of the `tables` (`public.kept_<table>`), to load
/// again with `load_kept`.
async fn keep(pool: &sqlx::PgPool, tables: &[&str]) {
    for table in tables {
        sqlx::query(&format!(
            "CREATE TABLE public.kept_{table} AS SELECT * FROM jobledger.{table}"
        ))
        .execute(pool)
        .await
        .unwrap();
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

    // A second pass from the same checkpoint (a rebuild through a reader
    // that has read the log): each job's v1 is the lowest it met.
    let (again, _, probed) = drain_probed(&reader, cp, 100).await;
    let stranger = LogReader::source(db.ledger.pool().clone());
    let (fresh_again, _, _) = drain_probed(&stranger, cp, 100).await;
    assert_eq!(versions(&again), versions(&fresh_again));
    assert_eq!(probed, 0, "each job's v1 was met before the batch");
}

/// The reader meets J's v3 as J's highest, reading from past v4; read again
/// from before v4, the batch holding v4 lacks v3, which lies past its end:
/// v3 is looked up and handed out early, not taken as read.
#[tokio::test]
async fn a_version_met_past_a_batchs_end_is_still_handed_out_early() {
    let db = fresh().await;
    let reader = LogReader::source(db.ledger.pool().clone());
    let (j, _, cp) = early_xid_trap(&db, &reader).await;
    let past_v4 = place(db.ledger.pool(), j.job_id, 4).await;
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

fn sh(cmd: &str) {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Restored from a backup under a running process, the log holds another
/// J v2 at another place than the one the reader met: the reader forgets
/// what it met and hands out what a stranger does (review, helper-54: it
/// handed out J v3 without v2).
#[tokio::test]
async fn a_reader_forgets_what_it_met_when_the_database_is_restored() {
    let db = fresh().await;
    let reader = LogReader::source(db.ledger.pool().clone());
    let j = db.enqueue(None, json!({})).await.job_id;
    let dump = std::env::temp_dir().join(format!("{}.dump", db.name));
    let (server, dump) = (common::server_url(), dump.display().to_string());
    sh(&format!("pg_dump -Fc -d {server}/{} -f {dump}", db.name));
    db.ledger.observe(j, None, "lost", json!({}), "w").await.unwrap(); // J v2, not in the backup
    let (before, _) = drain(&reader, Checkpoint::default(), 100).await;
    assert_eq!(versions(&before), vec![(j, 1), (j, 2)]);

    sh(&format!(
        "psql -q {server}/postgres -c 'DROP DATABASE {0} WITH (FORCE)' -c 'CREATE DATABASE {0}'",
        db.name
    ));
    sh(&format!("pg_restore -d {server}/{} {dump}", db.name));
    std::fs::remove_file(&dump).unwrap();

    // A consumer whose checkpoint was restored with the log is back at J v1.
    let at_v1 = place(db.ledger.pool(), j, 1).await;
    small_xid_trap(&db, j).await;

    let met = reader.read(at_v1, 1).await.unwrap();
    let stranger = LogReader::source(db.ledger.pool().clone());
    let fresh_read = stranger.read(at_v1, 1).await.unwrap();
    assert_eq!(versions(&met.events), vec![(j, 2), (j, 3)], "v2 early, then v3");
    assert_eq!(versions(&met.events), versions(&fresh_read.events));
}

/// The log truncated and loaded again around the append-only triggers (a
/// data-only restore into the live database, `session_replication_role =
/// replica`): the same table, new storage. The reader forgets what it met,
/// as after a restore (review, helper-56: it handed out J v3 without v2).
#[tokio::test]
async fn a_reader_forgets_what_it_met_when_the_log_is_truncated_and_loaded_again() {
    let db = fresh().await;
    let pool = db.ledger.pool();
    let reader = LogReader::source(pool.clone());
    let j = db.enqueue(None, json!({})).await.job_id;
    keep(pool, &["events", "jobs"]).await;
    db.ledger.observe(j, None, "lost", json!({}), "w").await.unwrap(); // J v2, not kept
    let (before, _) = drain(&reader, Checkpoint::default(), 100).await;
    assert_eq!(versions(&before), vec![(j, 1), (j, 2)]);

    load_kept(pool, true).await;

    let at_v1 = place(pool, j, 1).await;
    small_xid_trap(&db, j).await;

    let met = reader.read(at_v1, 1).await.unwrap();
    let stranger = LogReader::source(pool.clone());
    let fresh_read = stranger.read(at_v1, 1).await.unwrap();
    assert_eq!(versions(&fresh_read.events), vec![(j, 2), (j, 3)]);
    assert_eq!(versions(&met.events), vec![(j, 2), (j, 3)], "v2 early, then v3");
}

/// Loads the kept events (and with `jobs` the kept jobs) in place of what
/// the tables hold, around the append-only triggers.
async fn load_kept(pool: &sqlx::PgPool, jobs: bool) {
    // The jobs' generated columns are computed again, not copied.
    let job_columns: String = sqlx::query_scalar(
        "SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position) \
         FROM information_schema.columns \
         WHERE table_schema = 'jobledger' AND table_name = 'jobs' AND is_generated = 'NEVER'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let mut sql = vec![
        "SET session_replication_role = replica".to_string(),
        "TRUNCATE jobledger.events".to_string(),
        "INSERT INTO jobledger.events OVERRIDING SYSTEM VALUE SELECT * FROM public.kept_events".to_string(),
    ];
    if jobs {
        sql.push("DELETE FROM jobledger.jobs".to_string());
        sql.push(format!(
            "INSERT INTO jobledger.jobs ({job_columns}) SELECT {job_columns} FROM public.kept_jobs"
        ));
    }
    sql.push("RESET session_replication_role".to_string());
    let mut repair = pool.acquire().await.unwrap();
    for sql in sql {
        sqlx::query(&sql).execute(&mut *repair).await.unwrap();
    }
}

/// A gate before a read's lookups that runs `f` with the number of calls
/// before it, and counts the calls.
fn counted_hook<F>(f: F) -> (ReaderHooks, Arc<AtomicUsize>)
where
    F: Fn(usize) -> jobledger::worker::BoxFuture<()> + Send + Sync + 'static,
{
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let hook = move || f(counted.fetch_add(1, Ordering::SeqCst));
    let hooks = ReaderHooks {
        before_lookups: Some(Arc::new(hook)),
    };
    (hooks, calls)
}

/// A gate that loads the kept events at each of its first `times` calls.
fn replacing_hook(pool: &sqlx::PgPool, times: usize) -> (ReaderHooks, Arc<AtomicUsize>) {
    let pool = pool.clone();
    counted_hook(move |n| {
        let pool = pool.clone();
        Box::pin(async move {
            if n < times {
                load_kept(&pool, false).await;
            }
        })
    })
}

/// The log replaced between a read's batch and its lookups: the batch
/// (J v3) came from the log before, whose J v2 lay past its end; the lookup
/// looked in the new log, which has no J v2 there. The read is made again
/// on the new log instead of handing out J v3 without v2 (review,
/// helper-56: a table swapped during one read went unnoticed).
#[tokio::test]
async fn a_log_replaced_between_a_batch_and_its_lookups_is_read_again() {
    let db = fresh().await;
    let pool = db.ledger.pool();
    let j = db.enqueue(None, json!({})).await.job_id;
    let at_v1 = place(pool, j, 1).await;
    small_xid_trap(&db, j).await;
    // The new log: J v2's row becomes K v1, in T1's transaction, before
    // J v3.
    let k = Uuid::new_v4();
    keep(pool, &["events"]).await;
    sqlx::query(
        "UPDATE public.kept_events SET job_id = $2, version = 1, epoch = epoch + 1000000, \
         txid = (SELECT txid FROM jobledger.events WHERE job_id = $1 AND version = 3) \
         WHERE job_id = $1 AND version = 2",
    )
    .bind(j)
    .bind(k)
    .execute(pool)
    .await
    .unwrap();

    let (hooks, calls) = replacing_hook(pool, 1);
    let reader = LogReader::source(pool.clone()).with_hooks(hooks);
    let met = reader.read(at_v1, 1).await.unwrap();
    let stranger = LogReader::source(pool.clone());
    let fresh_read = stranger.read(at_v1, 1).await.unwrap();
    assert_eq!(versions(&fresh_read.events), vec![(k, 1)]);
    assert_eq!(versions(&met.events), vec![(k, 1)], "the new log's batch");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "read twice");

    // Replaced at every read: the reader gives up after a few.
    sqlx::query(
        "UPDATE public.kept_events SET job_id = $1, version = 2, epoch = epoch - 1000000 WHERE job_id = $2",
    )
    .bind(j)
    .bind(k)
    .execute(pool)
    .await
    .unwrap();
    let (hooks, calls) = replacing_hook(pool, usize::MAX);
    let reader = LogReader::source(pool.clone()).with_hooks(hooks);
    load_kept(pool, false).await;
    let err = reader.read(at_v1, 1).await.unwrap_err();
    assert!(matches!(err, LedgerError::LogReplaced(3)), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// Clones share their memory. While clone A's batch (J v3, of the log
/// before) waits for its lookups, the log is replaced and clone R reads the
/// new one, meeting J v2 at or before A's end. That memory is of another
/// history than A's batch: it must not spare A's lookup of v2 (review,
/// helper-58: with it, A handed out J v3 alone and never checked the
/// history again, as it had looked nothing up).
#[tokio::test]
async fn a_clones_memory_of_another_history_spares_no_lookup() {
    let db = fresh().await;
    let pool = db.ledger.pool();
    let j = db.enqueue(None, json!({})).await.job_id;
    let at_v1 = place(pool, j, 1).await;
    small_xid_trap(&db, j).await;
    // The new log: J v2 in v1's transaction, before A's end.
    keep(pool, &["events"]).await;
    sqlx::query(
        "UPDATE public.kept_events \
         SET txid = (SELECT txid FROM jobledger.events WHERE job_id = $1 AND version = 1) \
         WHERE job_id = $1 AND version = 2",
    )
    .bind(j)
    .execute(pool)
    .await
    .unwrap();

    let r = LogReader::source(pool.clone());
    let (hook_pool, hook_r) = (pool.clone(), r.clone());
    let (hooks, calls) = counted_hook(move |n| {
        let (pool, r) = (hook_pool.clone(), hook_r.clone());
        Box::pin(async move {
            if n == 0 {
                load_kept(&pool, false).await;
                let met = r.read(Checkpoint::default(), 2).await.unwrap();
                assert_eq!(versions(&met.events), vec![(j, 1), (j, 2)]);
            }
        })
    });
    let a = r.clone().with_hooks(hooks);
    let got = a.read(at_v1, 1).await.unwrap();
    assert_eq!(versions(&got.events), vec![(j, 2)], "the new log's batch");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "read again");
    // A's read of the older log left R's memory of the new one as it was:
    // J v1, met before the batch, is not looked up again.
    assert_eq!(got.probed, 0, "R's memory of the new log was kept");
}
