//! Scenario 15 and the append-only guarantees: the database refuses to
//! rewrite history, and `verify` finds any row edited around it.

mod common;

use common::fresh;
use serde_json::json;
use uuid::Uuid;

/// A superuser's connection with the database's triggers off: the attacker
/// who can rewrite rows around every check the database makes.
async fn around_the_triggers(db: &common::TestDb) -> sqlx::PgConnection {
    let mut conn = db.conn().await;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

async fn finished_job(db: &common::TestDb) -> Uuid {
    let job = db.enqueue(Some("k-1"), json!({"amount": 5})).await;
    let lease = db.claim_one("w").await;
    assert!(lease
        .complete(Some(json!({"refund_id": "re_5"})))
        .await
        .unwrap()
        .committed());
    job.job_id
}

#[tokio::test]
async fn database_refuses_update_delete_truncate_of_events() {
    let db = fresh().await;
    finished_job(&db).await;
    for sql in [
        "UPDATE jobledger.events SET reason = 'completed' WHERE version = 1",
        "DELETE FROM jobledger.events",
        "TRUNCATE jobledger.events",
    ] {
        let err = sqlx::query(sql).execute(db.ledger.pool()).await.unwrap_err();
        assert!(err.to_string().contains("append-only"), "{sql}: {err}");
    }
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 3);
}

#[tokio::test]
async fn database_refuses_a_broken_chain_link() {
    let db = fresh().await;
    let id = finished_job(&db).await;
    let err = sqlx::query(
        "INSERT INTO jobledger.events (job_id, version, type, to_state, reason, actor, epoch, token, attempt, run, \
         data, recorded_at, prev_hash, hash) \
         VALUES ($1, 4, 'observed', 'succeeded', 'observation', 'x', 1, 1, 1, 0, '{}', now(), 'forged', 'h')",
    )
    .bind(id)
    .execute(db.ledger.pool())
    .await
    .unwrap_err();
    assert!(err.to_string().contains("does not link"), "{err}");
    let gap = sqlx::query(
        "INSERT INTO jobledger.events (job_id, version, type, to_state, reason, actor, epoch, token, attempt, run, \
         data, recorded_at, prev_hash, hash) \
         VALUES ($1, 9, 'observed', 'succeeded', 'observation', 'x', 1, 1, 1, 0, '{}', now(), NULL, 'h')",
    )
    .bind(id)
    .execute(db.ledger.pool())
    .await;
    let gap = gap.unwrap_err().to_string();
    assert!(gap.contains("does not link"), "a version gap is refused: {gap}");
    // Two linked versions in one statement, the later one first in the
    // log: refused, as the row trigger refused it (found in review). The
    // control: the same two in their order are accepted.
    let two_versions = |order: &str| {
        format!(
            "INSERT INTO jobledger.events (job_id, version, type, to_state, reason, actor, epoch, token, attempt, run, \
             data, recorded_at, prev_hash, hash) \
             SELECT $1, v, 'observed', 'succeeded', 'observation', 'x', 1, 1, 1, 0, jsonb_build_object('key', v::text), \
               now(), CASE WHEN v = 4 THEN (SELECT hash FROM jobledger.events WHERE job_id = $1 AND version = 3) \
               ELSE 'h4' END, 'h' || v \
             FROM (VALUES (4), (5)) AS t(v) ORDER BY v {order}"
        )
    };
    let ahead = sqlx::query(&two_versions("DESC"))
        .bind(id)
        .execute(db.ledger.pool())
        .await;
    let ahead = ahead.unwrap_err().to_string();
    assert!(
        ahead.contains("event 5") && ahead.contains("does not link"),
        "{ahead}"
    );
    sqlx::query(&two_versions("ASC"))
        .bind(id)
        .execute(db.ledger.pool())
        .await
        .expect("linked versions in their order");
}

/// Scenario 15: someone with superuser rights disables the triggers and
/// edits an event; verify names the job, the version and the broken hash.
#[tokio::test]
async fn verify_finds_an_edited_event() {
    let db = fresh().await;
    let id = finished_job(&db).await;
    let _other = finished_job_with_key(&db, "k-2").await;
    db.assert_verified().await;

    let mut conn = around_the_triggers(&db).await;
    sqlx::query(
        "UPDATE jobledger.events SET data = jsonb_set(data, '{result,refund_id}', '\"re_EVIL\"') \
         WHERE job_id = $1 AND version = 3",
    )
    .bind(id)
    .execute(&mut conn)
    .await
    .unwrap();

    let report = db.ledger.verify(None).await.unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    let p = &report.problems[0];
    assert_eq!((p.job_id, p.version), (id, Some(3)));
    assert!(p.detail.contains("hash mismatch"), "{}", p.detail);
    assert!(!db.ledger.verify(Some(id)).await.unwrap().ok());
}

async fn finished_job_with_key(db: &common::TestDb, key: &str) -> Uuid {
    let job = db.enqueue(Some(key), json!({"amount": 6})).await;
    let lease = db.claim_one("w").await;
    lease.complete(None).await.unwrap();
    job.job_id
}

/// An event rewritten with a recomputed hash still breaks the chain link of
/// its successor; a deleted last event leaves the projection ahead of the log.
#[tokio::test]
async fn verify_finds_rehashed_and_deleted_events() {
    let db = fresh().await;
    let id = finished_job(&db).await;
    let mut conn = around_the_triggers(&db).await;
    sqlx::query("UPDATE jobledger.events SET hash = 'f00d' WHERE job_id = $1 AND version = 2")
        .bind(id)
        .execute(&mut conn)
        .await
        .unwrap();
    let report = db.ledger.verify(Some(id)).await.unwrap();
    assert!(
        report.problems[0].detail.contains("hash mismatch"),
        "{:?}",
        report.problems
    );

    let other = finished_job_with_key(&db, "k-3").await;
    sqlx::query("DELETE FROM jobledger.events WHERE job_id = $1 AND version = 3")
        .bind(other)
        .execute(&mut conn)
        .await
        .unwrap();
    let report = db.ledger.verify(Some(other)).await.unwrap();
    assert!(
        report.problems[0].detail.contains("projection differs"),
        "{:?}",
        report.problems
    );
}

/// The projection is checked too: a state written around the log (by a
/// superuser with the triggers off; anyone else is refused, see roles.rs)
/// is found.
#[tokio::test]
async fn verify_finds_a_projection_written_around_the_log() {
    let db = fresh().await;
    let id = finished_job(&db).await;
    db.around_the_log("UPDATE jobledger.jobs SET state = 'queued' WHERE job_id = $1", id)
        .await;
    let report = db.ledger.verify(None).await.unwrap();
    assert_eq!(report.problems.len(), 1);
    assert!(
        report.problems[0].detail.contains("state"),
        "{}",
        report.problems[0].detail
    );
}

/// The hash survives the jsonb round trip for awkward values: negative zero,
/// huge and tiny floats, u64 and i64 extremes, escapes and non-ASCII text.
#[tokio::test]
async fn verify_is_stable_for_awkward_json() {
    let db = fresh().await;
    let payload: serde_json::Value = serde_json::from_str(
        r#"{"z": -0.0, "big": 1e300, "tiny": 5e-324, "u": 18446744073709551615, "i": -9223372036854775808,
            "frac": 0.1, "drift": -949675544961.4701, "sum": 0.30000000000000004, "max": 1.7976931348623157e308, "huge_int": 123456789012345678901234567890, "s": "tab\t \"q\" \\ \u00e9 \ud83d\ude00 <>&",
            "nested": {"b": [1, 2.50, {"y": null, "x": false}], "a": ""}}"#,
    )
    .unwrap();
    let job = db.enqueue(Some("awkward"), payload.clone()).await;
    let lease = db.claim_one("w").await;
    assert!(lease.complete(Some(payload.clone())).await.unwrap().committed());
    assert_eq!(
        lease.complete(Some(payload)).await.unwrap().outcome,
        jobledger::domain::Outcome::AlreadyCommitted
    );
    let report = db.ledger.verify(Some(job.job_id)).await.unwrap();
    assert!(report.ok(), "{:?}", report.problems);
}

/// The real attack on one event (issue 10): a superuser rewrites event v2
/// (who did it) and recomputes its hash correctly, so the event checks out
/// alone; its successor's link to it no longer does, and verify says so.
/// (Rewriting the whole rest of the chain too is not found by `verify`:
/// that needs signed checkpoints held outside the database.)
#[tokio::test]
async fn verify_finds_an_event_rewritten_with_a_recomputed_hash() {
    let db = fresh().await;
    let id = finished_job(&db).await;
    let mut v2 = db.ledger.history(id).await.unwrap()[1].event.clone();
    assert_eq!(v2.version, 2);
    v2.actor = "mallory".into();
    let rehashed = jobledger::domain::event_hash(&v2);
    let mut conn = around_the_triggers(&db).await;
    sqlx::query("UPDATE jobledger.events SET actor = 'mallory', hash = $2 WHERE job_id = $1 AND version = 2")
        .bind(id)
        .bind(&rehashed)
        .execute(&mut conn)
        .await
        .unwrap();
    let report = db.ledger.verify(None).await.unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    let p = &report.problems[0];
    assert_eq!(
        (p.job_id, p.version),
        (id, Some(3)),
        "found at the successor: {p:?}"
    );
    assert!(
        !p.detail.contains("hash mismatch"),
        "v2's own hash is right: {}",
        p.detail
    );
}

/// Tombstones are checked against the log: a tombstone of a job with no
/// events, one of a job the log says is live, and an edited one.
#[tokio::test]
async fn verify_finds_forged_and_edited_tombstones() {
    let db = fresh().await;
    let purged = finished_job_with_key(&db, "k-gone").await;
    assert_eq!(db.ledger.purge(std::time::Duration::ZERO, 10).await.unwrap(), 1);
    let still_live = db.enqueue(Some("k-live"), json!({})).await.job_id;
    db.assert_verified().await;

    let mut conn = around_the_triggers(&db).await;
    let forge =
        "INSERT INTO jobledger.tombstones (job_id, queue, job_key, epoch, token, state, version, last_hash, \
                 purged_at) VALUES ($1, 'q', NULL, $2, 0, 'succeeded', 9, 'x', now())";
    let nobody = Uuid::now_v7();
    for (job, epoch) in [(nobody, 900_001_i64), (still_live, 900_002)] {
        sqlx::query(forge)
            .bind(job)
            .bind(epoch)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    sqlx::query("UPDATE jobledger.tombstones SET token = token + 5 WHERE job_id = $1")
        .bind(purged)
        .execute(&mut conn)
        .await
        .unwrap();
    let report = db.ledger.verify(None).await.unwrap();
    let found = |job: Uuid, what: &str| {
        report
            .problems
            .iter()
            .any(|p| p.job_id == job && p.detail.contains(what))
    };
    assert!(found(nobody, "tombstone has no events"), "{:?}", report.problems);
    assert!(found(still_live, "never purged"), "{:?}", report.problems);
    assert!(found(purged, "tombstone does not match"), "{:?}", report.problems);
    assert_eq!(report.problems.len(), 3, "{:?}", report.problems);
}

/// Claims `job` (the next due job, token 1), forges token 99 on its row with
/// the triggers off, and completes it through a lease resumed with that
/// token: the write path takes the row as it finds it, so this commits.
async fn completed_with_a_forged_token(db: &common::TestDb, job: Uuid) {
    let honest = db.claim_one("w").await;
    assert_eq!(honest.job_id(), job);
    assert_eq!(honest.fence().token, 1);
    db.around_the_log("UPDATE jobledger.jobs SET token = 99 WHERE job_id = $1", job)
        .await;
    let forged = jobledger::ledger::Lease::resume(db.ledger.clone(), job, honest.fence().epoch, 99, "w");
    assert!(forged.complete(None).await.unwrap().committed());
}

/// A fencing token forged on the row (triggers off) and a lease resumed with
/// it: the write path takes the row as it finds it, so the completion
/// commits, with an event whose token does not follow from the event before
/// it. Every event keeps its job's token, attempt and run except those that
/// change them by rule (`apply::counters_after`), so `verify` names the
/// event. Review of issue 15 (helper-27): `verify` found nothing.
#[tokio::test]
async fn verify_finds_a_token_that_does_not_follow_from_the_event_before() {
    let db = fresh().await;
    let job = db.enqueue(Some("k-forged-token"), json!({"amount": 5})).await;
    completed_with_a_forged_token(&db, job.job_id).await;
    let report = db.ledger.verify(Some(job.job_id)).await.unwrap();
    assert!(!report.ok(), "verify found nothing");
    let details: Vec<&str> = report.problems.iter().map(|p| p.detail.as_str()).collect();
    assert!(
        details
            .iter()
            .any(|d| d.contains("token 99") && d.contains("they are 1, 1, 0")),
        "{details:?}"
    );
}

/// The same forgery seen by `jobs_rebuilt` (review of this change): the
/// refused event stops only its own job, at its last accepted event. The
/// projection catches up every other job, and `verify --rebuilt`'s
/// comparison names the forged one. A refused event failed the whole
/// batch before, and the projection never got past it.
#[tokio::test]
async fn a_refused_event_stops_only_its_own_job_in_jobs_rebuilt() {
    let db = fresh().await;
    let forged_job = db.enqueue(Some("k-forged"), json!({"amount": 5})).await;
    db.enqueue(Some("k-honest"), json!({"amount": 6})).await;
    completed_with_a_forged_token(&db, forged_job.job_id).await;
    let other = db.claim_one("w2").await;
    assert!(other.complete(None).await.unwrap().committed());
    // Batches of 2: the refused event shares its batch with other jobs'.
    let done = common::catch_up_jobs_rebuilt(&db, 2)
        .await
        .expect("a refused event does not stop the projection");
    assert_eq!(done.applied, 6);
    let problems = db.ledger.compare_rebuilt().await.unwrap();
    let named: Vec<uuid::Uuid> = problems.iter().map(|p| p.job_id).collect();
    assert_eq!(named, vec![forged_job.job_id], "{problems:?}");
    let state: String = sqlx::query_scalar("SELECT state FROM jobledger_proj.jobs_rebuilt WHERE job_id = $1")
        .bind(other.job_id())
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(state, "succeeded");
}

/// A job whose first event `apply` refuses (forged counters) or that does
/// not parse (forged data) has no row in `jobs_rebuilt`; the projection
/// goes on with the others, and the comparison names both jobs (review of
/// this change: it said only that some job was missing, under the nil id,
/// and forged data stopped the projection for good).
#[tokio::test]
async fn jobs_whose_first_event_is_refused_are_named_missing_from_jobs_rebuilt() {
    let db = fresh().await;
    let counters = db.enqueue(Some("k-counters"), json!({"amount": 5})).await;
    let data = db.enqueue(Some("k-data"), json!({"amount": 7})).await;
    db.enqueue(Some("k-good"), json!({"amount": 6})).await;
    let mut conn = around_the_triggers(&db).await;
    for (sql, id) in [
        (
            "UPDATE jobledger.events SET token = 4 WHERE job_id = $1 AND version = 1",
            counters.job_id,
        ),
        (
            "UPDATE jobledger.events SET data = '{\"queue\": 5}' WHERE job_id = $1 AND version = 1",
            data.job_id,
        ),
    ] {
        sqlx::query(sql).bind(id).execute(&mut conn).await.unwrap();
    }
    common::catch_up_jobs_rebuilt(&db, 1)
        .await
        .expect("a refused first event does not stop the projection");
    let problems = db.ledger.compare_rebuilt().await.unwrap();
    let named: Vec<(Uuid, &str)> = problems.iter().map(|p| (p.job_id, p.detail.as_str())).collect();
    let missing = "in jobledger.jobs, missing from jobs_rebuilt";
    assert_eq!(
        named,
        vec![(counters.job_id, missing), (data.job_id, missing)],
        "{problems:?}"
    );
}

/// An event of a schema newer than this build still stops `jobs_rebuilt`,
/// saying to upgrade: no later event makes that job right, an upgrade does.
#[tokio::test]
async fn an_event_of_a_newer_schema_stops_jobs_rebuilt_asking_for_an_upgrade() {
    let db = fresh().await;
    let job = db.enqueue(Some("k-newer"), json!({"amount": 5})).await;
    let mut conn = around_the_triggers(&db).await;
    sqlx::query("UPDATE jobledger.events SET schema = 99 WHERE job_id = $1 AND version = 1")
        .bind(job.job_id)
        .execute(&mut conn)
        .await
        .unwrap();
    let err = common::catch_up_jobs_rebuilt(&db, 10)
        .await
        .expect_err("an unreadable schema stops the projection");
    assert!(err.to_string().contains("upgrade jobledger"), "{err}");
}

/// `jobs_rebuilt` keeps each job's JSON as text (version 3). A row edited
/// into text that does not parse is named by `verify --rebuilt`'s
/// comparison, which still compares the others; `projections query` shows
/// the parsed rows as objects and the broken one as the string it is.
#[tokio::test]
async fn a_rebuilt_row_that_does_not_parse_is_named_and_the_rest_shown_as_objects() {
    let db = fresh().await;
    let broken = db.enqueue(Some("k-broken"), json!({"n": 1})).await;
    let fine = db.enqueue(Some("k-fine"), json!({"n": 2})).await;
    common::catch_up_jobs_rebuilt(&db, 10).await.unwrap();
    sqlx::query("UPDATE jobledger_proj.jobs_rebuilt SET job = left(job, 20) WHERE job_id = $1")
        .bind(broken.job_id)
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let problems = db.ledger.compare_rebuilt().await.expect("compared");
    let named: Vec<(Uuid, bool)> = problems
        .iter()
        .map(|p| (p.job_id, p.detail.starts_with("unreadable rebuilt row")))
        .collect();
    assert_eq!(named, vec![(broken.job_id, true)], "{problems:?}");
    let shown = db
        .ledger
        .projection_rows("jobs_rebuilt", Some(fine.job_id))
        .await
        .unwrap();
    assert_eq!(shown[0]["job"]["state"], "queued", "{shown:?}");
    let shown = db
        .ledger
        .projection_rows("jobs_rebuilt", Some(broken.job_id))
        .await
        .unwrap();
    assert!(shown[0]["job"].is_string(), "{shown:?}");
    // The broken row stops only its own job: the batch that moves it and
    // a new job is applied, the new job rebuilt, the broken row left.
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job_id(), broken.job_id);
    let later = db.enqueue(Some("k-later"), json!({"n": 3})).await;
    common::catch_up_jobs_rebuilt(&db, 10)
        .await
        .expect("a row that does not parse stops only its own job");
    let shown = db
        .ledger
        .projection_rows("jobs_rebuilt", Some(later.job_id))
        .await
        .unwrap();
    assert_eq!(shown[0]["job"]["state"], "queued", "{shown:?}");
    let problems = db.ledger.compare_rebuilt().await.expect("compared");
    let named: Vec<Uuid> = problems.iter().map(|p| p.job_id).collect();
    assert_eq!(named, vec![broken.job_id], "{problems:?}");
}
