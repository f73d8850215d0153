//! Rebuilds beside the serving table: their batches commit without a
//! flush; a batch read for a table that has since changed (a switch, a new
//! rebuild, a new version) never lands; runners of different versions, and
//! runners racing each other, build each version once and with its own code.

mod common;

use common::gated::gated;
use common::tagged::{six_jobs, tagged, Tagged};
use common::{fresh, within};
use jobledger::reader::LogReader;
use jobledger_projections::registry;
use jobledger_projections::runner::Runner;
use jobledger_projections::shipped::JobTimeline;
use jobledger_projections::{Projection, ProjectionError};
use serde_json::json;
use tokio::sync::mpsc;

/// A rebuild's batches commit without waiting for their flush (no one reads
/// the table being built, and the switch's commit flushes them); a serving
/// table's batches wait for theirs, before the rebuild and after it.
#[tokio::test]
async fn only_a_rebuild_commits_without_a_flush() {
    let db = fresh().await;
    for i in 0..5 {
        db.enqueue(None, json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "flush").await.unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let v1 = Tagged::new(1);
    let flushes = || async {
        sqlx::query_scalar::<_, String>("SELECT flush FROM jobledger_proj.tagged ORDER BY job_id, version")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap()
    };
    within("a catch-up", runner.catch_up(&[&v1])).await.unwrap();
    assert_eq!(
        flushes().await,
        vec!["on"; 5],
        "the serving table's first catch-up"
    );

    runner.start_rebuild(&v1).await.unwrap();
    let s = within("a rebuild", runner.catch_up(&[&v1])).await.unwrap();
    assert_eq!(s.switched_to, Some(1));
    assert_eq!(flushes().await, vec!["off"; 5], "the rebuilt table, now serving");

    db.enqueue(None, json!({ "i": 5 })).await;
    within("a catch-up", runner.catch_up(&[&v1])).await.unwrap();
    let after = flushes().await;
    assert_eq!(after.iter().filter(|f| *f == "on").count(), 1, "{after:?}");
}

/// Review of issue 15: runner A reads a rebuild's first batch from position
/// 0 and stalls; meanwhile B finishes that rebuild, switches it in and
/// starts another, whose checkpoint is at position 0 again. A's batch must
/// not land: not in the table that now serves, and not as the new
/// rebuild's progress (the new table would miss those events for good).
#[tokio::test]
async fn a_batch_read_for_a_rebuild_that_switched_meanwhile_is_not_applied() {
    let db = fresh().await;
    for i in 0..30 {
        db.enqueue(Some(&format!("s{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let b = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    within("a catch-up", b.catch_up(&[&JobTimeline])).await.unwrap();
    b.start_rebuild(&JobTimeline).await.unwrap();

    let (log, mut gate) = gated(&reader, jobledger_projections::Checkpoint::default(), 0);
    let a = Runner::new(db.ledger.pool().clone(), &log, 100).await.unwrap();
    let a_step = a.step(&[&JobTimeline]);
    let b_moves = async {
        gate.wait_held().await; // A holds the first rebuild's first batch
        let done = within("a rebuild", b.catch_up(&[&JobTimeline])).await.unwrap();
        assert_eq!(done.switched_to, Some(1), "the first rebuild switched in");
        b.start_rebuild(&JobTimeline).await.unwrap();
        gate.release().await;
    };
    let (a_result, ()) = tokio::join!(a_step, b_moves);
    assert_eq!(a_result.unwrap().rebuilt, 0, "A's stale batch is not applied");
    let building: (i64,) =
        sqlx::query_as("SELECT b_position FROM jobledger_proj.registry WHERE name = 'job_timeline'")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(building.0, 0, "the new rebuild has not moved");

    let done = within("a rebuild", b.catch_up(&[&JobTimeline])).await.unwrap();
    assert_eq!(done.switched_to, Some(1));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.job_timeline").await,
        30,
        "the second rebuilt table is complete"
    );
}

/// Review of issue 15: during a rolling upgrade a runner with only version
/// 1's code keeps version 1 current and never writes version 2's rebuild,
/// nor switches it in.
#[tokio::test]
async fn an_older_runner_leaves_a_newer_versions_rebuild_alone() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2) = (Tagged::new(1), Tagged::new(2));
    let new = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", new.catch_up(&[&v1])).await.unwrap();
    let s = new.step(&[&v1, &v2]).await.unwrap();
    assert_eq!((s.rebuilt, s.switched_to), (2, None), "v2's build has begun");

    let old = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let s = within("a catch-up", old.catch_up(&[&v1])).await.unwrap();
    assert_eq!((s.rebuilt, s.switched_to), (0, None), "v1's code built nothing");
    assert_eq!(tagged(&db).await, (6, 0, 1), "v1 serves, all by v1");

    let s = within("a catch-up", new.catch_up(&[&v1, &v2])).await.unwrap();
    assert_eq!(s.switched_to, Some(2));
    assert_eq!(tagged(&db).await, (6, 0, 2), "v2 serves, all by v2");
}

/// Review of issue 15: runner B reads version 1's serving checkpoint and
/// stalls; runner S meanwhile finishes version 2's rebuild and switches it
/// in. B's step neither writes version 1's batch into version 2's table nor
/// fails on the rebuild that is gone.
#[tokio::test]
async fn a_step_across_another_runners_switch_is_a_lost_race() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2) = (Tagged::new(1), Tagged::new(2));
    let s_runner = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", s_runner.catch_up(&[&v1])).await.unwrap();
    s_runner.step(&[&v1, &v2]).await.unwrap(); // v2's build begins
    db.enqueue(None, json!({ "i": 6 })).await; // v1's serving table is behind
    let serving = registry::entries(db.ledger.pool()).await.unwrap()[0].checkpoint();
    let (log, mut gate) = gated(&reader, serving, 0);
    let b = Runner::new(db.ledger.pool().clone(), &log, 2).await.unwrap();
    let both: [&dyn Projection; 2] = [&v1, &v2];
    let b_step = b.step(&both);
    let s_switches = async {
        gate.wait_held().await; // B holds v1's serving batch
        let s = within("a rebuild", s_runner.catch_up(&[&v1, &v2])).await.unwrap();
        assert_eq!(s.switched_to, Some(2));
        gate.release().await;
    };
    let (b_result, ()) = tokio::join!(b_step, s_switches);
    let s = b_result.expect("a lost race, not an error");
    assert_eq!((s.applied, s.rebuilt, s.raced), (0, 0, true));
    assert_eq!(tagged(&db).await, (7, 0, 2), "v2 serves, all by v2");
}

/// Review of issue 15: runner A reads a rebuild's first batch and stalls
/// while runner B steps that rebuild on. A's `catch_up` took its lost race
/// for "caught up" and returned with the rebuild behind; it carries on.
#[tokio::test]
async fn a_catch_up_that_loses_a_race_carries_on() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let v1 = Tagged::new(1);
    let b = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", b.catch_up(&[&v1])).await.unwrap();
    b.start_rebuild(&v1).await.unwrap();
    let (log, mut gate) = gated(&reader, jobledger_projections::Checkpoint::default(), 0);
    let a = Runner::new(db.ledger.pool().clone(), &log, 2).await.unwrap();
    let one: [&dyn Projection; 1] = [&v1];
    let a_catches_up = a.catch_up(&one);
    let b_steps = async {
        gate.wait_held().await; // A holds the rebuild's first batch
        assert_eq!(b.step(&[&v1]).await.unwrap().rebuilt, 2);
        gate.release().await;
    };
    let (a_result, ()) = tokio::join!(within("a catch-up", a_catches_up), b_steps);
    assert_eq!(a_result.unwrap().switched_to, Some(1), "A went on to the switch");
    assert_eq!(tagged(&db).await, (6, 0, 1));
}

/// Review of issue 15: two runners start version 2's build at once. The
/// second waits for the first (the start is decided again under the
/// registry lock) and builds on its table, instead of failing on it or
/// dropping it.
#[tokio::test]
async fn two_runners_start_one_build() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2) = (Tagged::new(1), Tagged::new(2));
    let (held_tx, mut held) = mpsc::channel(1);
    let (open, open_rx) = mpsc::channel(1);
    *v2.1.lock().await = Some((held_tx, open_rx));
    let a = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let b = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", a.catch_up(&[&v1])).await.unwrap();
    let both: [&dyn Projection; 2] = [&v1, &v2];
    let a_step = a.step(&both);
    let b_step = async {
        within("A's create", held.recv()).await.unwrap(); // A's build is uncommitted
        let waits = common::eventually("B waits for A's build", || async {
            db.count("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()")
                .await
                > 0
        });
        let (b_result, ()) = tokio::join!(b.step(&both), async {
            waits.await;
            open.send(()).await.unwrap();
        });
        b_result
    };
    let (a_result, b_result) = tokio::join!(a_step, b_step);
    a_result.unwrap();
    b_result.expect("B builds on A's table");
    let s = within("a catch-up", b.catch_up(&[&v1, &v2])).await.unwrap();
    assert_eq!(s.switched_to, Some(2));
    assert_eq!(tagged(&db).await, (6, 0, 2));
}

/// Review of issue 15: a rebuild that no running code can build (version 2's
/// build begun, then version 3 deployed; or `projections rebuild` run with
/// version 1 just before version 2) is replaced by the newest code's build,
/// instead of holding the projection still while `catch_up` says Ok. Older
/// code asked to rebuild while a newer version builds says so.
#[tokio::test]
async fn a_rebuild_no_running_code_can_build_is_replaced() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2, v3) = (Tagged::new(1), Tagged::new(2), Tagged::new(3));
    let r = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", r.catch_up(&[&v1])).await.unwrap();
    assert_eq!(r.step(&[&v2]).await.unwrap().rebuilt, 2, "v2's build has begun");
    let err = r.start_rebuild(&v1).await.unwrap_err();
    assert!(
        matches!(
            err,
            ProjectionError::NewerRebuild {
                building: 2,
                ours: 1,
                ..
            }
        ),
        "{err}"
    );
    for i in 0..4 {
        db.enqueue(None, json!({ "skipped": i })).await;
    }
    let s = within("a catch-up", r.catch_up(&[&v3])).await.unwrap();
    assert_eq!(s.switched_to, Some(3), "v3 replaced v2's build and switched in");
    assert_eq!(tagged(&db).await, (10, 0, 3));

    r.start_rebuild(&v3).await.unwrap(); // `projections rebuild`, then an upgrade
    db.enqueue(None, json!({ "late": true })).await;
    let v4 = Tagged::new(4);
    let s = within("a catch-up", r.catch_up(&[&v4])).await.unwrap();
    assert_eq!(s.switched_to, Some(4));
    assert_eq!(tagged(&db).await, (11, 0, 4));
    let tables = db
        .count(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'jobledger_proj' AND tablename LIKE 'tagged%'",
        )
        .await;
    assert_eq!(tables, 1, "the replaced builds' tables are gone");
}
