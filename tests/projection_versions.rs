//! Projection names and versions: names whose tables could be another
//! projection's are refused; code older than the serving version neither
//! rebuilds it nor reads it as its own; `projections rebuild` ends once its
//! table serves, whoever switched it in, and carries no other rebuild on.

mod common;

use common::gated::gated;
use common::tagged::{six_jobs, tagged, Renamed, Tagged};
use common::{fresh, within};
use jobledger_projections::registry;
use jobledger_projections::runner::Runner;
use jobledger_projections::{Projection, ProjectionError};
use serde_json::json;

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
    let err = r.check_serving(&Tagged::new(3)).await.unwrap_err();
    assert!(matches!(err, ProjectionError::NotServing { .. }), "{err}");
}

/// Review of issue 15: `projections rebuild` stepped until its own step
/// switched the table in, so when the `projections run` service switched
/// it in first it looped for good. A rebuild switched in by another runner
/// is finished, also when the next rebuild has begun, which it leaves alone
/// (helper-45: it built that one to the end and reported it as its own);
/// one a newer version's build replaced says so.
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
    let next = another_rebuild(&service, &v1, &table).await;
    let mut rebuilt = 0;
    let v = within(
        "the rebuild's end",
        ours.finish_rebuild(&v1, &table, |n| rebuilt += n),
    )
    .await;
    assert_eq!((v.unwrap(), rebuilt), (1, 0), "switched in by the service");
    next_untouched(&db, &table, &next).await;

    let table = ours.start_rebuild(&v1).await.unwrap();
    assert_eq!(table, next, "the rebuild under way is resumed");
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

/// A new rebuild of `p` by `r`, once its table's name (the millisecond it
/// starts in) is not `than`'s, which serves.
async fn another_rebuild(r: &Runner<'_>, p: &dyn Projection, than: &str) -> String {
    loop {
        match r.start_rebuild(p).await {
            Ok(t) if t != than => return t,
            _ => tokio::task::yield_now().await,
        }
    }
}

/// `table` serves and `next` is being built, not stepped yet.
async fn next_untouched(db: &common::TestDb, table: &str, next: &str) {
    let e = registry::entries(db.ledger.pool()).await.unwrap().remove(0);
    assert_eq!(
        (e.active_table.as_str(), e.building_table.as_deref()),
        (table, Some(next))
    );
    assert_eq!(e.b_position, 0, "the next rebuild was not stepped");
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

/// Review of issue 15 (helper-46): between `finish_rebuild`'s look at the
/// registry and its step's, another runner switched its table in and
/// started the next rebuild; the step carried that one on and counted it
/// as this rebuild's progress. A step for one rebuild leaves any other
/// alone.
#[tokio::test]
async fn a_step_for_one_rebuild_leaves_the_next_alone() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let v1 = Tagged::new(1);
    let service = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", service.catch_up(&[&v1])).await.unwrap();
    db.enqueue(None, json!({ "i": 6 })).await; // the serving table is behind
    let serving = registry::entries(db.ledger.pool()).await.unwrap()[0].checkpoint();
    let (log, mut gate) = gated(&reader, serving, 0);
    let ours = Runner::new(db.ledger.pool().clone(), &log, 2).await.unwrap();
    let table = ours.start_rebuild(&v1).await.unwrap();
    let mut rebuilt = 0;
    let one: [&dyn Projection; 1] = [&v1];
    let finish = ours.finish_rebuild(one[0], &table, |n| rebuilt += n);
    let meanwhile = async {
        gate.wait_held().await; // our step holds the serving table's batch
        let s = within("the service", service.catch_up(&[&v1])).await.unwrap();
        assert_eq!(s.switched_to, Some(1));
        let next = another_rebuild(&service, &v1, &table).await;
        gate.release().await;
        next
    };
    let (v, next) = tokio::join!(within("the rebuild's end", finish), meanwhile);
    assert_eq!(v.unwrap(), 1);
    assert_eq!(rebuilt, 0, "no progress of another rebuild");
    next_untouched(&db, &table, &next).await;
}

/// Review of issue 15 (helper-46): `check_serving` refused only a newer
/// version, so with version 1 serving while version 3 builds (a skipped
/// version), version 2's `verify --rebuilt` read version 1's table.
#[tokio::test]
async fn check_serving_refuses_an_older_version_too() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let (v1, v2, v3) = (Tagged::new(1), Tagged::new(2), Tagged::new(3));
    let r = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    within("a catch-up", r.catch_up(&[&v1])).await.unwrap();
    assert_eq!(
        r.step(&[&v1, &v3]).await.unwrap().rebuilt,
        2,
        "v3's build has begun"
    );
    let s = within("v2's catch-up", r.catch_up(&[&v2])).await.unwrap();
    assert_eq!(s.switched_to, None);
    let err = r.check_serving(&v2).await.unwrap_err();
    assert!(
        matches!(
            err,
            ProjectionError::NotServing {
                serving: 1,
                ours: 2,
                ..
            }
        ),
        "{err}"
    );
    r.check_serving(&v1).await.unwrap();
}

/// Review of issue 15 (helper-46, helper-47): a name already taken in the
/// schema by an index (`tagged_v1_pkey`), a table or a type failed every
/// step on a database error; it is refused as a name.
#[tokio::test]
async fn a_name_an_index_has_is_refused() {
    let db = fresh().await;
    let reader = six_jobs(&db).await;
    let r = Runner::new(db.ledger.pool().clone(), &reader, 10).await.unwrap();
    within("a catch-up", r.catch_up(&[&Tagged::new(1)]))
        .await
        .unwrap();
    sqlx::query("CREATE TYPE jobledger_proj.footype AS ENUM ('a')")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    for name in ["tagged_v1_pkey", "registry_pkey", "footype"] {
        let p = Renamed(name, Tagged::new(1));
        let err = r.step(&[&p]).await.unwrap_err();
        assert!(matches!(err, ProjectionError::BadName { .. }), "{name}: {err}");
    }
}
