//! Projections over the log: catch-up with the checkpoint in the same
//! transaction, idempotent redelivery, a versioned rebuild that keeps the
//! old table serving until an atomic switch (part of docs/scenarios.md scenario 14),
//! and a minimum-position read.

mod common;

use common::gated::gated;
use common::{fresh, within, TestDb};
use jobledger::reader::LogReader;
use jobledger_projections::runner::{reached, Runner};
use jobledger_projections::shipped::JobTimeline;
use jobledger_projections::{BoxFuture, Event, Projection};
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

async fn timeline_rows(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM jobledger_proj.job_timeline").await
}

/// Version 2 of the timeline: one more column (a schema change).
struct TimelineV2;
impl Projection for TimelineV2 {
    fn name(&self) -> &str {
        "job_timeline"
    }
    fn version(&self) -> i32 {
        2
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid, version bigint, type text, epoch bigint, PRIMARY KEY (job_id, version))"
            ))
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "INSERT INTO {table} SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::text[], $4::int8[]) ON CONFLICT DO NOTHING"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.kind.clone()).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.epoch).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn catch_up_rebuild_and_switch() {
    let db = fresh().await;
    for i in 0..10 {
        db.enqueue(Some(&format!("k{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
    let v1: &dyn Projection = &JobTimeline;
    let s = within("a catch-up", runner.catch_up(&[v1])).await.unwrap();
    assert_eq!(s.applied, 10);
    assert_eq!(timeline_rows(&db).await, 10);
    assert_eq!(
        within("a catch-up", runner.catch_up(&[v1]))
            .await
            .unwrap()
            .applied,
        0,
        "nothing applied twice"
    );

    // Read-your-writes: a new event's position is reached only once applied.
    let e = db.enqueue(Some("late"), json!({})).await;
    let (txid, position): (i64, i64) = sqlx::query_as(
        "SELECT txid::text::bigint, position FROM jobledger.events WHERE job_id = $1 AND version = 1",
    )
    .bind(e.job_id)
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    assert!(
        !reached(db.ledger.pool(), "job_timeline", txid, position)
            .await
            .unwrap(),
        "pending while behind"
    );
    within("a catch-up", runner.catch_up(&[v1])).await.unwrap();
    assert!(reached(db.ledger.pool(), "job_timeline", txid, position)
        .await
        .unwrap());

    // A schema change: v2 is built from position 0 while v1 keeps serving
    // (and keeps following the live tail), then the view switches.
    let v2: &dyn Projection = &TimelineV2;
    let first = runner.step(&[v1, v2]).await.unwrap();
    // At most one batch of 4 (fewer if the horizon holds some back for
    // this one read); either way not switched.
    assert!(first.rebuilt <= 4, "{first:?}");
    assert_eq!(first.switched_to, None);
    db.enqueue(Some("during-rebuild"), json!({})).await;
    let served: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns WHERE table_schema = 'jobledger_proj' \
         AND table_name = 'job_timeline' ORDER BY ordinal_position",
    )
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    assert!(
        served.contains(&"actor".to_string()),
        "the old version still serves: {served:?}"
    );
    let rest = within("a catch-up", runner.catch_up(&[v1, v2])).await.unwrap();
    assert_eq!(rest.switched_to, Some(2));
    let rows: Vec<(i64, String)> = sqlx::query_as("SELECT epoch, type FROM jobledger_proj.job_timeline")
        .fetch_all(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(rows.len(), 12, "every event, in the new shape");
    let tables: i64 = db
        .count("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'jobledger_proj' AND table_name LIKE 'job_timeline_v%'")
        .await;
    assert_eq!(tables, 1, "the old table is gone");
}

/// `jobs_rebuilt` from the log equals `jobledger.jobs` after a randomised
/// run (claims, takeovers, retries, failures, cancels, purges), also when
/// caught up in several steps while the run goes on; an edited projection
/// row is found.
#[tokio::test]
async fn jobs_rebuilt_equals_the_inline_projection() {
    use jobledger::domain::ErrorClass;
    use jobledger::rebuilt::JobsRebuilt;
    use rand::{Rng, SeedableRng};
    let db = fresh().await;
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 7).await.unwrap();
    let rebuilt: &dyn Projection = &JobsRebuilt;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for round in 0..6 {
        for i in 0..10 {
            db.enqueue(Some(&format!("r{round}-{i}")), json!({ "round": round, "i": i }))
                .await;
        }
        let leases = db
            .ledger
            .claim("q", "w", std::time::Duration::from_secs(30), 12)
            .await
            .unwrap();
        for l in leases {
            match rng.gen_range(0..6) {
                0 => drop(l.complete(Some(json!({"ok": round}))).await.unwrap()),
                1 => drop(l.fail(ErrorClass::Transient, "busy", None).await.unwrap()),
                2 => drop(l.fail(ErrorClass::Permanent, "nope", None).await.unwrap()),
                3 => drop(db.ledger.cancel(l.job_id(), None).await.unwrap()),
                4 => drop(l.heartbeat(std::time::Duration::from_secs(60)).await.unwrap()),
                _ => drop(l.submit(&format!("rc-{round}")).await.unwrap()),
            }
        }
        runner.step(&[rebuilt]).await.unwrap(); // partly caught up while writes go on
        if round == 3 {
            db.ledger.purge(std::time::Duration::ZERO, 100).await.unwrap();
        }
    }
    within("a catch-up", runner.catch_up(&[rebuilt])).await.unwrap();
    // queue_stats agrees with the inline projection too (a takeover first).
    db.enqueue(Some("taken"), json!({})).await;
    let l = db
        .ledger
        .claim("q", "w", std::time::Duration::from_secs(30), 100)
        .await
        .unwrap();
    for lease in &l {
        db.expire_lease(lease.job_id()).await;
    }
    db.ledger
        .claim("q", "w2", std::time::Duration::from_secs(30), 100)
        .await
        .unwrap();
    within("a catch-up", runner.catch_up(&[rebuilt])).await.unwrap();
    let stats: &dyn Projection = &jobledger_projections::shipped::QueueStats;
    within("a catch-up", runner.catch_up(&[stats])).await.unwrap();
    let expected: Vec<(i64, i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'queued'), count(*) FILTER (WHERE state = 'leased'), \
         count(*) FILTER (WHERE state = 'cancel_requested'), count(*) FILTER (WHERE state = 'awaiting_receipt'), \
         count(*) FILTER (WHERE state = 'succeeded'), count(*) FILTER (WHERE state = 'cancelled'), \
         count(*) FILTER (WHERE state = 'dead') FROM jobledger.jobs",
    )
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    let got: Vec<(i64, i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT queued, leased, cancel_requested, awaiting_receipt, succeeded, cancelled, dead FROM jobledger_proj.queue_stats",
    )
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(got, expected);
    let takeovers = db.count("SELECT takeovers FROM jobledger_proj.queue_stats").await;
    assert_eq!(
        takeovers,
        db.count("SELECT count(*) FROM jobledger.events WHERE type = 'taken_over'")
            .await
    );
    assert!(takeovers > 0);
    let oldest_ok: bool = sqlx::query_scalar(
        "SELECT oldest_pending_at IS NOT DISTINCT FROM (SELECT min(created_at) FROM jobledger.jobs \
         WHERE state NOT IN ('succeeded', 'cancelled', 'dead')) FROM jobledger_proj.queue_stats",
    )
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    assert!(oldest_ok, "oldest pending age");
    let problems = db.ledger.compare_rebuilt().await.unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert!(
        db.count("SELECT count(*) FROM jobledger_proj.jobs_rebuilt WHERE purged")
            .await
            > 0,
        "purges were replayed"
    );

    let some: Uuid = sqlx::query_scalar("SELECT job_id FROM jobledger.jobs LIMIT 1")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    db.around_the_log(
        "UPDATE jobledger.jobs SET attempt = attempt + 1 WHERE job_id = $1",
        some,
    )
    .await;
    assert_eq!(db.ledger.compare_rebuilt().await.unwrap().len(), 1);
}

/// Issue 15: `queue_stats` finds each queue's oldest open job through a
/// partial index of its side table. Before version 3 it scanned every job
/// the projection had ever seen, once per batch, so a rebuild slowed as the
/// log grew. The index must exist and serve the lookup's shape.
#[tokio::test]
async fn queue_stats_finds_the_oldest_open_job_through_an_index() {
    use jobledger_projections::shipped::QueueStats;
    let db = fresh().await;
    let reader = LogReader::source(db.ledger.pool().clone());
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    let first = db.enqueue(Some("o1"), json!({})).await;
    let second = db.enqueue(Some("o2"), json!({})).await;
    within("a catch-up", runner.catch_up(&[&QueueStats]))
        .await
        .unwrap();
    let oldest = |db: &TestDb| {
        let pool = db.ledger.pool().clone();
        async move {
            sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
                "SELECT oldest_pending_at FROM jobledger_proj.queue_stats WHERE queue = 'q'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(oldest(&db).await, Some(first.created_at));
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job_id(), first.job_id);
    lease.complete(None).await.unwrap();
    within("a catch-up", runner.catch_up(&[&QueueStats]))
        .await
        .unwrap();
    assert_eq!(
        oldest(&db).await,
        Some(second.created_at),
        "the first left the backlog"
    );

    let side: String = sqlx::query_scalar(
        "SELECT active_table || '__jobs' FROM jobledger_proj.registry WHERE name = 'queue_stats'",
    )
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    let mut conn = db.conn().await;
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN SELECT min(created_at) FROM jobledger_proj.\"{side}\" WHERE queue = 'q' \
         AND state IN ('queued', 'leased', 'cancel_requested', 'awaiting_receipt', 'waiting')"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        plan.iter()
            .any(|l| l.contains("Index") && l.contains("queue_created_at"))
            && !plan.iter().any(|l| l.contains("Seq Scan")),
        "{plan:#?}"
    );
}

/// A crash mid-batch rolls the batch and its checkpoint back together; the
/// next run applies it once: the numbers equal a fresh rebuild.
#[tokio::test]
async fn a_crash_mid_batch_neither_doubles_nor_skips() {
    let db = fresh().await;
    for i in 0..9 {
        db.enqueue(Some(&format!("c{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
    let crashy = common::counting::Counting::new("crashy_counts", 1, true);
    assert!(runner.step(&[&crashy]).await.is_err(), "the first batch crashes");
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.crashy_counts")
            .await,
        0,
        "nothing half-applied"
    );
    within("a catch-up", runner.catch_up(&[&crashy])).await.unwrap();
    within("a catch-up", runner.catch_up(&[&crashy])).await.unwrap(); // a second run applies nothing
    within("a catch-up", runner.catch_up(&[&JobTimeline]))
        .await
        .unwrap();
    let a: Vec<(uuid::Uuid, i64, i32)> =
        sqlx::query_as("SELECT job_id, version, applied FROM jobledger_proj.crashy_counts ORDER BY 1, 2")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap();
    let b: Vec<(uuid::Uuid, i64, i32)> =
        sqlx::query_as("SELECT job_id, version, 1 FROM jobledger_proj.job_timeline ORDER BY 1, 2")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(a.len(), 9);
    assert_eq!(a, b, "every event applied exactly once, as in a fresh build");
}

/// A minimum-position read while the runner is held back answers pending;
/// once the runner moves, the same read is answered.
#[tokio::test]
async fn a_minimum_position_read_waits_or_says_pending() {
    use jobledger_projections::runner::{wait_for, Freshness};
    let db = fresh().await;
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    within("a catch-up", runner.catch_up(&[&JobTimeline]))
        .await
        .unwrap();
    let e = db
        .ledger
        .enqueue(common::new_job("q", Some("w"), json!({})))
        .await
        .unwrap();
    let position = e.position.unwrap();
    let txid: i64 = sqlx::query_scalar("SELECT txid::text::bigint FROM jobledger.events WHERE position = $1")
        .bind(position)
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    let short = std::time::Duration::from_millis(50);
    // The runner is held back (nobody steps it): pending, never a stale answer.
    assert_eq!(
        wait_for(db.ledger.pool(), "job_timeline", txid, position, short)
            .await
            .unwrap(),
        Freshness::Pending
    );
    // A reader waits while the runner catches up.
    let pool = db.ledger.pool().clone();
    let waiting = tokio::spawn(async move {
        wait_for(
            &pool,
            "job_timeline",
            txid,
            position,
            std::time::Duration::from_secs(30),
        )
        .await
        .unwrap()
    });
    within("a catch-up", runner.catch_up(&[&JobTimeline]))
        .await
        .unwrap();
    assert_eq!(waiting.await.unwrap(), Freshness::Reached);
}

/// Issue 9 item 2: runner A reads the rebuild's first batch; runner B steps
/// the same rebuild meanwhile; A then finds the checkpoint moved. That lost
/// race is not "caught up": A must not switch the view to the partly built
/// table. The view never serves a table behind the one it replaced.
#[tokio::test]
async fn a_lost_race_never_switches_in_a_partial_rebuild() {
    let db = fresh().await;
    for i in 0..30 {
        db.enqueue(Some(&format!("r{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let b = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    within("a catch-up", b.catch_up(&[&JobTimeline])).await.unwrap();
    assert_eq!(timeline_rows(&db).await, 30);
    b.start_rebuild(&JobTimeline).await.unwrap();

    // The rebuild's first read is the only one from position 0.
    let (log, mut gate) = gated(&reader, jobledger_projections::Checkpoint::default(), 0);
    let a = Runner::new(db.ledger.pool().clone(), &log, 10).await.unwrap();
    let a_step = a.step(&[&JobTimeline]);
    let b_moves = async {
        gate.wait_held().await; // A holds its first rebuild batch
        let s = b.step(&[&JobTimeline]).await.unwrap();
        assert_eq!(
            (s.rebuilt, s.switched_to),
            (10, None),
            "B built the first 10 of 30"
        );
        gate.release().await;
    };
    let (a_result, ()) = tokio::join!(a_step, b_moves);
    let s = a_result.unwrap();
    assert_eq!(s.rebuilt, 0, "A's batch would have applied twice: not applied");
    assert_eq!(s.switched_to, None, "a lost race is not caught up: no switch");
    assert_eq!(
        timeline_rows(&db).await,
        30,
        "the view still serves the full table"
    );

    let done = within("a catch-up", b.catch_up(&[&JobTimeline])).await.unwrap();
    assert_eq!(done.switched_to, Some(1));
    assert_eq!(timeline_rows(&db).await, 30, "the rebuilt table is complete");
}

/// Review of issue 9: a rebuild that caught up switches in even while an
/// open transaction of this database holds the horizon and commits wait
/// behind it (under steady load some always do); it is not behind the
/// serving table, which cannot have them either.
#[tokio::test]
async fn a_caught_up_rebuild_switches_while_commits_wait_behind_the_horizon() {
    let db = fresh().await;
    for i in 0..5 {
        db.enqueue(Some(&format!("h{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    within("a catch-up", r.catch_up(&[&JobTimeline])).await.unwrap();
    r.start_rebuild(&JobTimeline).await.unwrap();

    let mut holder = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *holder)
        .await
        .unwrap();
    db.enqueue(Some("waits"), json!({})).await;
    let first = r.step(&[&JobTimeline]).await.unwrap();
    assert_eq!((first.rebuilt, first.switched_to), (5, None));
    let second = r.step(&[&JobTimeline]).await.unwrap();
    assert_eq!(
        second.switched_to,
        Some(1),
        "caught up with the serving table: switched although a commit waits behind the horizon"
    );
    assert_eq!(timeline_rows(&db).await, 5);
    holder.rollback().await.unwrap();
    within("a catch-up", r.catch_up(&[&JobTimeline])).await.unwrap();
    assert_eq!(timeline_rows(&db).await, 6, "the waiting commit arrives");
}

/// A runner reads the registry before it decides and locks its row only to
/// write (`registry::get`, then `registry::lock` in the batch's
/// transaction). Locking it on every read cost each step two transactions
/// that waited for a WAL flush, and made a runner with nothing to apply
/// wait for another runner's batch: here a transaction holds the row as a
/// runner applying a batch does, and a caught-up step still returns.
#[tokio::test]
async fn a_caught_up_step_does_not_wait_for_a_runner_holding_the_registry() {
    let db = fresh().await;
    db.enqueue(None, json!({})).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    within("a catch-up", r.catch_up(&[&JobTimeline])).await.unwrap();
    let mut other = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM jobledger_proj.registry WHERE name = 'job_timeline' FOR UPDATE")
        .execute(&mut *other)
        .await
        .unwrap();
    let s = within("a caught-up step", r.step(&[&JobTimeline])).await.unwrap();
    assert_eq!((s.applied, s.rebuilt), (0, 0), "caught up");
    other.rollback().await.unwrap();
}
