//! Rebuilds beside the serving table: their batches commit without a
//! flush; a batch read for a table that has since changed (a switch, a new
//! rebuild, a new version) never lands; runners of different versions, and
//! runners racing each other, build each version once and with its own code.

mod common;

use common::gated::gated;
use common::{fresh, within};
use jobledger::reader::LogReader;
use jobledger_projections::registry;
use jobledger_projections::runner::Runner;
use jobledger_projections::shipped::JobTimeline;
use jobledger_projections::{BoxFuture, Event, Projection, ProjectionError};
use serde_json::json;
use sqlx::PgConnection;
use tokio::sync::{mpsc, Mutex};

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

/// Version `.0` of a projection named `tagged` whose rows say which
/// version's code wrote them, and the `synchronous_commit` their batch was
/// applied under. When `.1` is armed, its `create` reports
/// (first sender) and waits (second receiver) once, with the table created
/// and its transaction open.
type CreateGate = Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>;
struct Tagged(i32, CreateGate);
impl Tagged {
    fn new(version: i32) -> Self {
        Tagged(version, Mutex::new(None))
    }
}
impl Projection for Tagged {
    fn name(&self) -> &str {
        "tagged"
    }
    fn version(&self) -> i32 {
        self.0
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid, version bigint, by int, flush text, \
                 PRIMARY KEY (job_id, version))"
            ))
            .execute(&mut *tx)
            .await?;
            let gate = self.1.lock().await.take();
            if let Some((held, mut open)) = gate {
                held.send(()).await.expect("gate");
                open.recv().await.expect("gate");
            }
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
                "INSERT INTO {table} SELECT j, v, $3, current_setting('synchronous_commit') \
                 FROM UNNEST($1::uuid[], $2::int8[]) AS u(j, v) ON CONFLICT DO NOTHING"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .bind(self.0)
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

/// (rows, rows written by code of another version than the one serving)
/// of what the view serves, and the serving version.
async fn tagged(db: &common::TestDb) -> (i64, i64, i64) {
    let version = db
        .count("SELECT version::int8 FROM jobledger_proj.registry WHERE name = 'tagged'")
        .await;
    let rows = db.count("SELECT count(*) FROM jobledger_proj.tagged").await;
    let foreign = db
        .count(&format!(
            "SELECT count(*) FROM jobledger_proj.tagged WHERE by <> {version}"
        ))
        .await;
    (rows, foreign, version)
}

async fn six_jobs(db: &common::TestDb) -> LogReader {
    for i in 0..6 {
        db.enqueue(None, json!({ "i": i })).await;
    }
    LogReader::open(db.ledger.pool().clone(), "tagged").await.unwrap()
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

/// `tagged`'s code under another name.
struct Renamed(&'static str, Tagged);
impl Projection for Renamed {
    fn name(&self) -> &str {
        self.0
    }
    fn version(&self) -> i32 {
        self.1.version()
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        self.1.create(tx, table)
    }
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        self.1.apply(tx, table, events)
    }
}

/// A name whose tables could be another projection's is refused before
/// anything is created: `foo_v2_`'s first table `foo_v2__v1` reads as a side
/// table of `foo_v2`'s, which `foo`'s switch drops; past 30 bytes a
/// rebuild's side table passes 63, and PostgreSQL cuts the name silently.
#[tokio::test]
async fn a_name_whose_tables_could_be_another_projections_is_refused() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    let long: &'static str = Box::leak("x".repeat(31).into_boxed_str());
    // Review of issue 15 (helper-45): `foo_v2` passed, and its view then
    // held the name of `foo`'s version 2 table, so `foo` never upgraded.
    let bad = [
        ("foo_v2_", 1),
        ("foo__x", 1),
        ("Foo", 1),
        ("9x", 1),
        ("", 1),
        ("a-b", 1),
        ("a b", 1),
        ("ü", 1),
        (long, 1),
        ("foo_v2", 1),
        ("foo_v12_r1733400000000", 1),
        ("registry", 1),
        ("ok", 0),
        ("ok", -1),
    ];
    for (name, version) in bad {
        let p = Renamed(name, Tagged::new(version));
        let err = r.step(&[&p]).await.unwrap_err();
        assert!(matches!(err, ProjectionError::BadName { .. }), "{name:?}: {err}");
        let err = r.start_rebuild(&p).await.unwrap_err();
        assert!(matches!(err, ProjectionError::BadName { .. }), "{name:?}: {err}");
    }
    let tables =
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'jobledger_proj' AND tablename <> 'registry'";
    assert_eq!(db.count(tables).await, 0, "nothing was created");
    assert_eq!(db.count("SELECT count(*) FROM jobledger_proj.registry").await, 0);
    let fine = Renamed("foo_v2x", Tagged::new(1));
    within("a catch-up", r.catch_up(&[&fine])).await.unwrap();
    let at_limit = Renamed(&long[1..], Tagged::new(1));
    within("a catch-up", r.catch_up(&[&at_limit])).await.unwrap();
    assert_eq!(db.count(tables).await, 2);
}

/// Review of issue 15: `projections rebuild` with code older than the
/// serving version would switch the view back to the older table (which
/// newer runners would then build anew). It is refused; and a reader of the
/// view with older code (`verify --rebuilt`) learns it serves a newer one.
#[tokio::test]
async fn older_code_does_not_rebuild_over_a_newer_version() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2) = (Tagged::new(1), Tagged::new(2));
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    within("a catch-up", r.catch_up(&[&v1])).await.unwrap();
    let s = within("a catch-up", r.catch_up(&[&v1, &v2])).await.unwrap();
    assert_eq!(s.switched_to, Some(2));
    let err = r.start_rebuild(&v1).await.unwrap_err();
    assert!(
        matches!(
            err,
            ProjectionError::OlderThanServing {
                serving: 2,
                ours: 1,
                ..
            }
        ),
        "{err}"
    );
    let e = registry::entries(db.ledger.pool()).await.unwrap().remove(0);
    assert_eq!((e.version, e.building_version), (2, None));
    assert_eq!(tagged(&db).await, (6, 0, 2));
    let err = r.check_serving(&v1).await.unwrap_err();
    assert!(matches!(err, ProjectionError::OlderThanServing { .. }), "{err}");
    r.check_serving(&v2).await.unwrap();
    r.check_serving(&Tagged::new(3)).await.unwrap();
}

/// Review of issue 15: `projections rebuild` stepped until its own step
/// switched the table in, so when the `projections run` service switched
/// it in first it looped for good. A rebuild switched in by another runner
/// is finished; one a newer version's build replaced says so.
#[tokio::test]
async fn a_rebuild_another_runner_switches_in_or_replaces_ends() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2) = (Tagged::new(1), Tagged::new(2));
    let ours = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let service = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", ours.catch_up(&[&v1])).await.unwrap();
    let table = ours.start_rebuild(&v1).await.unwrap();
    let s = within("the service", service.catch_up(&[&v1])).await.unwrap();
    assert_eq!(s.switched_to, Some(1));
    let mut rebuilt = 0;
    let v = within(
        "the rebuild's end",
        ours.finish_rebuild(&v1, &table, |n| rebuilt += n),
    )
    .await;
    assert_eq!((v.unwrap(), rebuilt), (1, 0), "switched in by the service");

    let table = ours.start_rebuild(&v1).await.unwrap();
    assert!(
        service.step(&[&v1, &v2]).await.unwrap().rebuilt > 0,
        "v2's build replaced it"
    );
    let err = within("the rebuild's end", ours.finish_rebuild(&v1, &table, |_| ())).await;
    assert!(
        matches!(&err, Err(ProjectionError::RebuildReplaced { table: t, .. }) if *t == table),
        "{err:?}"
    );
    let s = within("a catch-up", ours.catch_up(&[&v1, &v2])).await.unwrap();
    assert_eq!(s.switched_to, Some(2));
    assert_eq!(tagged(&db).await, (6, 0, 2));
}

/// Review of issue 15 (helper-45): a rebuild of an older version than the
/// one serving (left by an older binary) was resumed by `start_rebuild` and
/// carried on and switched in by older code's steps, serving the older
/// version again. Older code now leaves it alone (and its `catch_up` does
/// not wait for it); the serving version's `start_rebuild` replaces it.
#[tokio::test]
async fn a_rebuild_older_than_the_serving_version_is_never_switched_in() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2) = (Tagged::new(1), Tagged::new(2));
    let r = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", r.catch_up(&[&v1])).await.unwrap();
    let s = within("a catch-up", r.catch_up(&[&v1, &v2])).await.unwrap();
    assert_eq!(s.switched_to, Some(2));
    for sql in [
        "CREATE TABLE jobledger_proj.tagged_v1_r1 (job_id uuid, version bigint, by int, flush text, \
         PRIMARY KEY (job_id, version))",
        "UPDATE jobledger_proj.registry SET building_version = 1, building_table = 'tagged_v1_r1', \
         b_txid = 0, b_position = 0 WHERE name = 'tagged'",
    ] {
        sqlx::query(sql).execute(db.ledger.pool()).await.unwrap();
    }
    let err = r.start_rebuild(&v1).await.unwrap_err();
    assert!(matches!(err, ProjectionError::OlderThanServing { .. }), "{err}");
    let s = within("older code's catch-up", r.catch_up(&[&v1])).await.unwrap();
    assert_eq!((s.rebuilt, s.switched_to), (0, None));
    assert_eq!(tagged(&db).await, (6, 0, 2), "v2 still serves");

    let table = r.start_rebuild(&v2).await.unwrap();
    assert_ne!(table, "tagged_v1_r1", "replaced");
    let v = within("the rebuild", r.finish_rebuild(&v2, &table, |_| ())).await;
    assert_eq!(v.unwrap(), 2);
    assert_eq!(tagged(&db).await, (6, 0, 2));
}

/// Review of issue 15 (helper-45): `finish_rebuild` trusted any step's
/// progress and switch, so once the service had switched its table in and
/// someone started another rebuild, it built that one to the end and
/// reported it as its own. It ends as soon as its own table serves.
#[tokio::test]
async fn finishing_a_rebuild_leaves_the_next_one_alone() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let v1 = Tagged::new(1);
    let ours = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let service = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", ours.catch_up(&[&v1])).await.unwrap();
    let table = ours.start_rebuild(&v1).await.unwrap();
    let s = within("the service", service.catch_up(&[&v1])).await.unwrap();
    assert_eq!(s.switched_to, Some(1));
    let next = loop {
        // A rebuild's table is named by the millisecond it starts in.
        match service.start_rebuild(&v1).await {
            Ok(t) if t != table => break t,
            _ => tokio::task::yield_now().await,
        }
    };
    let mut rebuilt = 0;
    let v = within(
        "the rebuild's end",
        ours.finish_rebuild(&v1, &table, |n| rebuilt += n),
    )
    .await;
    assert_eq!((v.unwrap(), rebuilt), (1, 0));
    let e = registry::entries(db.ledger.pool()).await.unwrap().remove(0);
    assert_eq!((e.active_table, e.building_table), (table, Some(next)));
    assert_eq!(e.b_position, 0, "the next rebuild was not stepped");
}
