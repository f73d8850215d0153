//! Issue 10 item 4: a rebuild whose process died resumes from its own
//! checkpoint (it neither starts over nor skips), with a projection that
//! counts every application, so a double apply cannot hide; and the
//! switch's guard against a rebuild that fell behind the serving table.
//! No test here holds the snapshot horizon, so the gated runners below see
//! every commit.

mod common;

use common::counting::Counting;
use common::gated::gated;
use common::{fresh, within, TestDb};
use jobledger::reader::LogReader;
use jobledger_projections::registry;
use jobledger_projections::runner::Runner;
use serde_json::json;

fn counts(version: i32) -> Counting {
    Counting::new("counts", version, false)
}

/// A fresh database with `n` enqueued jobs (keys `<prefix><i>`) and the
/// projections' reader.
async fn with_jobs(prefix: &str, n: usize) -> (TestDb, LogReader) {
    let db = fresh().await;
    for i in 0..n {
        db.enqueue(Some(&format!("{prefix}{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    (db, reader)
}

/// The `counts` entry of the registry.
async fn counts_entry(db: &TestDb) -> registry::Entry {
    registry::entries(db.ledger.pool())
        .await
        .unwrap()
        .into_iter()
        .find(|e| e.name == "counts")
        .unwrap()
}

/// Every one of the `n` events applied exactly once to `counts`.
async fn assert_each_applied_once(db: &TestDb, n: usize) {
    let rows: Vec<(i64, i32)> = sqlx::query_as("SELECT version, applied FROM jobledger_proj.counts")
        .fetch_all(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(rows.len(), n, "nothing skipped");
    assert!(
        rows.iter().all(|(_, n)| *n == 1),
        "nothing applied twice: {rows:?}"
    );
}

#[tokio::test]
async fn a_crashed_rebuild_resumes_from_its_own_checkpoint() {
    let (db, reader) = with_jobs("r", 10).await;
    {
        let first = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
        within("a catch-up", first.catch_up(&[&counts(1)])).await.unwrap();
        let s = first.step(&[&counts(1), &counts(2)]).await.unwrap();
        assert!(s.rebuilt >= 1 && s.switched_to.is_none(), "{s:?}");
        // The process dies here: nothing but the database remembers.
    }
    let building: i64 = db.count("SELECT count(*) FROM jobledger_proj.counts_v2").await;
    assert!(
        (1..10).contains(&building),
        "part of the rebuild is done: {building}"
    );
    let second = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
    let done = within("the resumed rebuild", second.catch_up(&[&counts(1), &counts(2)]))
        .await
        .unwrap();
    assert_eq!(done.switched_to, Some(2));
    assert_each_applied_once(&db, 10).await;
}

/// Issue 10: the switch's own guard, alone. Runner A finds the rebuild
/// caught up (an empty read) and is held before it switches; meanwhile new
/// events commit and runner B applies them to the serving table only (B is
/// held before its rebuild batch). A's switch must then refuse: the rebuild
/// is behind the table it would replace. `Raced` cannot help here, A read
/// nothing.
#[tokio::test]
async fn a_switch_never_serves_a_rebuild_behind_the_serving_table() {
    let (db, reader) = with_jobs("s", 6).await;
    let setup = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    within("a catch-up", setup.catch_up(&[&counts(1)])).await.unwrap();
    setup.start_rebuild(&counts(1)).await.unwrap();
    let s = setup.step(&[&counts(1)]).await.unwrap();
    assert_eq!((s.rebuilt, s.switched_to), (6, None), "rebuilt, not yet switched");
    let entry = counts_entry(&db).await;
    let at = entry.checkpoint();
    assert_eq!(entry.building_checkpoint(), at, "both tables at the same place");

    // Both runners let their serving read from `at` pass and hold the
    // rebuild read that follows it.
    let (log_a, mut gate_a) = gated(&reader, at, 1);
    let (log_b, mut gate_b) = gated(&reader, at, 1);
    let a = Runner::new(db.ledger.pool().clone(), &log_a, 100).await.unwrap();
    let b = Runner::new(db.ledger.pool().clone(), &log_b, 100).await.unwrap();
    let c = counts(1);
    let versions: [&dyn jobledger_projections::Projection; 1] = [&c];
    let (a_done, a_finished) = tokio::sync::oneshot::channel();
    let a_step = async {
        let s = a.step(&versions).await;
        a_done.send(()).unwrap();
        s
    };
    let director = async {
        gate_a.wait_held().await; // A's rebuild read came back empty
        for i in 0..3 {
            db.enqueue(Some(&format!("late{i}")), json!({ "i": i })).await;
        }
        let b_step = b.step(&versions);
        let order = async {
            gate_b.wait_held().await; // B applied the 3 to the serving table
            gate_a.release().await;
            within("A's switch", a_finished).await.unwrap();
            gate_b.release().await;
        };
        tokio::join!(b_step, order).0
    };
    let (a_result, b_result) = tokio::join!(a_step, director);
    let (sa, sb) = (a_result.unwrap(), b_result.unwrap());
    assert_eq!(sb.applied, 3, "B moved the serving table past the rebuild");
    assert_eq!(
        (sa.rebuilt, sa.switched_to),
        (0, None),
        "A must not switch in a rebuild behind the serving table"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.counts").await,
        9,
        "the view serves every event"
    );
    let done = within("a catch-up", setup.catch_up(&[&counts(1)])).await.unwrap();
    assert_eq!(done.switched_to, Some(1));
    assert_eq!(db.count("SELECT count(*) FROM jobledger_proj.counts").await, 9);
}

/// Issue 15: a runner reads its next batch while it applies one. When
/// another runner moves the checkpoint past that batch before it is used,
/// the batch read ahead is stale and must be dropped: applied, its events
/// would count twice.
#[tokio::test]
async fn a_batch_read_ahead_is_dropped_once_another_runner_applied_it() {
    let (db, reader) = with_jobs("a", 8).await;
    let a = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let b = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let c = counts(1);
    // A applies events 1-2 and reads 3-4 ahead; B applies 3-4 itself.
    assert_eq!(a.step(&[&c]).await.unwrap().applied, 2);
    assert_eq!(b.step(&[&c]).await.unwrap().applied, 2);
    // A's batch 3-4 is stale: A must read 5-6 instead.
    assert_eq!(a.step(&[&c]).await.unwrap().applied, 2);
    let twice = db
        .count("SELECT count(*) FROM jobledger_proj.counts WHERE applied > 1")
        .await;
    assert_eq!(twice, 0, "no event applied twice");
    within("a catch-up", a.catch_up(&[&c])).await.unwrap();
    within("a catch-up", b.catch_up(&[&c])).await.unwrap();
    assert_each_applied_once(&db, 8).await;
}

/// Issue 15 review: code newer than the serving version is caught up only
/// once its rebuild has switched in. With the view held by a reader, the
/// switch times out; `catch_up` must then say it stalled, never return as
/// if the view served the new version (`verify --rebuilt` compared against
/// the old table right after an upgrade), and never wait forever while new
/// jobs keep the tables moving.
#[tokio::test]
async fn a_catch_up_of_a_newer_version_is_not_done_before_its_switch() {
    use jobledger_projections::ProjectionError;
    let (db, reader) = with_jobs("u", 5).await;
    let old = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    within("a catch-up", old.catch_up(&[&counts(1)])).await.unwrap();
    let mut holder = db.conn().await;
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM jobledger_proj.counts")
        .execute(&mut holder)
        .await
        .unwrap();
    let upgraded = Runner::new(db.ledger.pool().clone(), &reader, 100)
        .await
        .unwrap()
        .with_patience(std::time::Duration::from_secs(3));
    // Jobs keep coming meanwhile: the tables keep moving, which must not
    // count as progress towards the switch (it kept catch_up going forever).
    let writing = async {
        for i in 0.. {
            db.enqueue(Some(&format!("w{i}")), json!({ "i": i })).await;
        }
    };
    let v2 = counts(2);
    let versions: [&dyn jobledger_projections::Projection; 1] = [&v2];
    let held = tokio::select! {
        held = within("a catch-up with the view held", upgraded.catch_up(&versions)) => held,
        _ = writing => unreachable!("writes forever"),
    };
    let serving = counts_entry(&db).await.version;
    match held {
        Err(ProjectionError::Stalled { .. }) => assert_eq!(serving, 1),
        other => assert_eq!(serving, 2, "returned {other:?} while version 1 still serves"),
    }
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    // A runner of its own: `upgraded` waits out its retry delay.
    let next = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    let done = within("a catch-up", next.catch_up(&[&counts(2)])).await.unwrap();
    assert_eq!(done.switched_to, Some(2));
}
