//! Least privilege: a worker connected as `jobledger_worker` does its work
//! but cannot rewrite history, even with hand-written SQL; a reader reads.

mod common;

use common::fresh;
use jobledger::ledger::Ledger;
use serde_json::json;
use sqlx::Connection;
use std::time::Duration;

fn as_role(url: &str, role: &str) -> String {
    url.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1)
}

/// Runs hand-written SQL (several statements allowed) as `jobledger_worker`.
async fn as_worker(db: &common::TestDb, sql: &str) -> Result<(), sqlx::Error> {
    let mut conn = sqlx::PgConnection::connect(&as_role(&db.url, "jobledger_worker"))
        .await
        .unwrap();
    sqlx::raw_sql(sql).execute(&mut conn).await.map(|_| ())
}

#[tokio::test]
async fn a_worker_role_cannot_rewrite_history() {
    let db = fresh().await;
    let worker = Ledger::connect(&as_role(&db.url, "jobledger_worker"), 4)
        .await
        .unwrap();
    let job = worker
        .enqueue(common::new_job("q", Some("k"), json!({})))
        .await
        .unwrap()
        .job;
    let lease = worker
        .claim("q", "w", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert!(lease
        .complete(Some(json!({"ok": true})))
        .await
        .unwrap()
        .committed());
    assert!(worker.sweep(10).await.unwrap().is_empty());

    let mut conn = sqlx::PgConnection::connect(&as_role(&db.url, "jobledger_worker"))
        .await
        .unwrap();
    for sql in [
        "UPDATE jobledger.events SET actor = 'mallory'",
        "DELETE FROM jobledger.events",
        "TRUNCATE jobledger.events",
        "ALTER TABLE jobledger.events DISABLE TRIGGER events_no_update",
        "SET session_replication_role = replica",
        "DELETE FROM jobledger.jobs",
        "DROP TABLE jobledger.events",
    ] {
        let err = sqlx::query(sql).execute(&mut conn).await.unwrap_err();
        let code = common::sqlstate(&err);
        assert_eq!(
            code.as_deref(),
            Some("42501"),
            "{sql}: insufficient privilege, not {err}"
        );
    }
    // Purging is the admin's, not the worker's.
    assert!(worker.purge(Duration::ZERO, 10).await.is_err());
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 3);
    assert!(db.ledger.verify(Some(job.job_id)).await.unwrap().ok());

    let reader = Ledger::connect(&as_role(&db.url, "jobledger_reader"), 2)
        .await
        .unwrap();
    assert!(reader.verify(None).await.unwrap().ok());
    assert!(
        reader
            .enqueue(common::new_job("q", None, json!({})))
            .await
            .is_err(),
        "a reader cannot write"
    );
    // The CLI runs as a least-privilege role too (it does not migrate then).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args(["show", &job.job_id.to_string()])
        .env("DATABASE_URL", as_role(&db.url, "jobledger_reader"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let admin = Ledger::connect(&as_role(&db.url, "jobledger_admin"), 2)
        .await
        .unwrap();
    assert_eq!(admin.purge(Duration::ZERO, 10).await.unwrap(), 1);
}

/// Issue 9 item 8: the projection cannot be changed without the event that
/// produces it. As `jobledger_worker` (and as the admin), a hand-written
/// update or insert of `jobledger.jobs` is refused at commit with SQLSTATE
/// JL001, and an event appended in an earlier transaction does not count.
#[tokio::test]
async fn the_projection_cannot_change_without_its_event() {
    let db = fresh().await;
    let job = db.enqueue(Some("k"), json!({"amount": 5})).await;
    for role in ["jobledger_worker", "jobledger_admin"] {
        let mut conn = sqlx::PgConnection::connect(&as_role(&db.url, role))
            .await
            .unwrap();
        for sql in [
            "UPDATE jobledger.jobs SET state = 'succeeded', reason = 'completed' WHERE job_id = $1",
            "UPDATE jobledger.jobs SET lease_until = now() + interval '1 day' WHERE job_id = $1",
            "UPDATE jobledger.jobs SET payload = '{\"amount\": 500}' WHERE job_id = $1",
            "INSERT INTO jobledger.jobs SELECT gen_random_uuid(), queue, kind, 'forged', epoch + 1000, token, run, \
             attempt, state, priority, payload, payload_digest, policy, run_at, lease_until, holder, next_action, \
             step, receipt_id, receipt_deadline, result, release, last_error, reason, created_at, updated_at, \
             version, last_hash FROM jobledger.jobs WHERE job_id = $1",
        ] {
            let err = sqlx::query(sql).bind(job.job_id).execute(&mut conn).await.unwrap_err();
            let code = common::sqlstate(&err);
            assert_eq!(code.as_deref(), Some(jobledger::store::ROW_WITHOUT_EVENT), "{role}: {sql}: {err}");
            let msg = err.to_string();
            assert!(
                ["without its event", "not one event", "never change"].iter().any(|m| msg.contains(m)),
                "{msg}"
            );
        }
    }
    // An event appended in the same transaction does not license rewriting
    // what the job is (payload, key, policy), nor a row that does not match
    // the event (here: the state and the from-state).
    let forge = |row_update: &'static str| {
        format!(
            "BEGIN; \
             INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, actor, epoch, token, \
               attempt, run, data, recorded_at, prev_hash, hash) \
             SELECT job_id, version + 1, 'observed', state, state, 'observation', 'mallory', epoch, token, attempt, \
               run, '{{\"key\": \"x\", \"data\": {{}}, \"digest\": \"d\"}}', clock_timestamp(), last_hash, 'forged' \
             FROM jobledger.jobs WHERE job_id = '{id}'; \
             UPDATE jobledger.jobs j SET version = e.version, last_hash = e.hash, updated_at = e.recorded_at, {row_update} \
             FROM jobledger.events e WHERE j.job_id = '{id}' AND e.job_id = j.job_id AND e.version = j.version + 1; \
             COMMIT;",
            id = job.job_id
        )
    };
    for update in [
        "payload = '{\"amount\": 1000000}'",
        "job_key = 'renamed'",
        "policy = '{\"max_attempts\": 999}'",
        "state = 'succeeded'",
    ] {
        let err = as_worker(&db, &forge(update)).await.unwrap_err();
        let code = common::sqlstate(&err);
        assert_eq!(
            code.as_deref(),
            Some(jobledger::store::ROW_WITHOUT_EVENT),
            "{update}: {err}"
        );
    }
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        1,
        "nothing kept"
    );
    let j = db.job(job.job_id).await;
    assert_eq!(
        (j.state, j.payload),
        (jobledger::domain::JobState::Queued, json!({"amount": 5}))
    );
    db.assert_verified().await;
}

/// Issue 9 review: what only the database may write. A worker cannot name
/// an event's `txid` or `position` (a forged txid below a reader's
/// checkpoint is never read; one far ahead keeps every reader "behind"),
/// nor touch the per-key epoch floor; an admin cannot delete a job without
/// its purge, nor re-insert it at a later version as another job.
#[tokio::test]
async fn the_log_order_and_the_key_floors_are_the_databases_alone() {
    let db = fresh().await;
    let job = db.enqueue(Some("k"), json!({"amount": 5})).await;
    let append = |cols: &str, vals: &str| {
        format!(
            "INSERT INTO jobledger.events ({cols}job_id, version, type, from_state, to_state, reason, actor, epoch, \
               token, attempt, run, data, recorded_at, prev_hash, hash) \
             SELECT {vals}job_id, version + 1, 'observed', state, state, 'observation', 'mallory', epoch, token, \
               attempt, run, '{{\"key\": \"x\", \"data\": {{}}, \"digest\": \"d\"}}', clock_timestamp(), last_hash, \
               'forged' FROM jobledger.jobs WHERE job_id = '{}'",
            job.job_id
        )
    };
    let mut worker = sqlx::PgConnection::connect(&as_role(&db.url, "jobledger_worker"))
        .await
        .unwrap();
    for sql in [
        append("txid, ", "'3'::xid8, "),
        append("position, ", "1, ").replace(") SELECT", ") OVERRIDING SYSTEM VALUE SELECT"),
        "UPDATE jobledger.key_floors SET epoch = 0".into(),
        "INSERT INTO jobledger.key_floors VALUES ('q', 'k', 9223372036854775806)".into(),
    ] {
        let err = sqlx::raw_sql(&sql).execute(&mut worker).await.unwrap_err();
        let code = common::sqlstate(&err);
        assert_eq!(code.as_deref(), Some("42501"), "{sql}: {err}");
    }

    let mut admin = sqlx::PgConnection::connect(&as_role(&db.url, "jobledger_admin"))
        .await
        .unwrap();
    let id = job.job_id;
    let vanish = format!("DELETE FROM jobledger.jobs WHERE job_id = '{id}'");
    // Deleted, then back at version 2 as a done job, next to a second
    // `enqueued` event that matches the row in every column checked.
    let reborn = format!(
        "BEGIN; \
         CREATE TEMP TABLE old ON COMMIT DROP AS SELECT * FROM jobledger.jobs WHERE job_id = '{id}'; \
         DELETE FROM jobledger.jobs WHERE job_id = '{id}'; \
         INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, actor, epoch, token, \
           attempt, run, data, recorded_at, prev_hash, hash) \
         SELECT e.job_id, 2, 'enqueued', e.from_state, 'succeeded', e.reason, 'mallory', e.epoch, e.token, e.attempt, \
           e.run, e.data, e.recorded_at, e.hash, 'forged' FROM jobledger.events e WHERE e.job_id = '{id}'; \
         UPDATE old SET state = 'succeeded', version = 2, last_hash = 'forged'; \
         INSERT INTO jobledger.jobs ({cols}) SELECT {cols} FROM old; \
         COMMIT;",
        // By name: `ended_at` is generated, and columns come after it.
        cols = jobledger::store::rows::JOB_COLUMNS
    );
    // A bare tombstone would raise the key's epoch floor (a key nobody can
    // enqueue) or squat on a live job's id (its purge would fail).
    let squat = format!(
        "INSERT INTO jobledger.tombstones (job_id, queue, job_key, epoch, token, state, version, last_hash, purged_at) \
         VALUES ('{id}', 'q', 'k', 9000000000000000000, 0, 'succeeded', 2, 'x', now())"
    );
    for sql in [vanish, reborn, squat] {
        let err = sqlx::raw_sql(&sql).execute(&mut admin).await.unwrap_err();
        let code = common::sqlstate(&err);
        assert_eq!(
            code.as_deref(),
            Some(jobledger::store::ROW_WITHOUT_EVENT),
            "{sql}: {err}"
        );
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut admin).await;
    }
    let j = db.job(id).await;
    assert_eq!((j.state, j.version), (jobledger::domain::JobState::Queued, 1));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        1,
        "nothing kept"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.key_floors").await,
        0,
        "no floor raised"
    );

    // The honest way out still works, as the admin: a purge.
    let admin_ledger = Ledger::connect(&as_role(&db.url, "jobledger_admin"), 2)
        .await
        .unwrap();
    assert!(admin_ledger.cancel(id, None).await.unwrap().committed());
    assert_eq!(admin_ledger.purge(Duration::ZERO, 10).await.unwrap(), 1);
    assert!(matches!(
        db.ledger.show(id).await.unwrap(),
        jobledger::ledger::Found::Purged(_)
    ));
    db.assert_verified().await;
}

/// Appends, as `jobledger_worker` and in one transaction, forged
/// `observed` events (queued → queued) after the job's last version, each
/// linked to the one before, then runs `row_update` on the job's row.
/// Answers the SQLSTATE the transaction fails with (`None`: it committed).
async fn forged_events_then(
    db: &common::TestDb,
    job: uuid::Uuid,
    events: i64,
    row_update: &str,
) -> Option<String> {
    let mut sql = String::from("BEGIN; ");
    for n in 1..=events {
        let prev = if n == 1 {
            "last_hash".to_string()
        } else {
            format!("'forged-{}'", n - 1)
        };
        sql += &format!(
            "INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, actor, epoch, token, \
               attempt, run, data, recorded_at, prev_hash, hash) \
             SELECT job_id, version + {n}, 'observed', state, state, 'observation', 'mallory', epoch, token, attempt, \
               run, '{{\"key\": \"x{n}\", \"data\": {{}}, \"digest\": \"d\"}}', clock_timestamp(), {prev}, 'forged-{n}' \
             FROM jobledger.jobs WHERE job_id = '{job}'; "
        );
    }
    sql += &format!(
        "UPDATE jobledger.jobs j SET version = e.version, last_hash = e.hash, updated_at = e.recorded_at, \
           reason = e.reason, {row_update} \
         FROM jobledger.events e WHERE j.job_id = '{job}' AND e.job_id = j.job_id AND e.version = j.version + {events}; \
         COMMIT;"
    );
    as_worker(db, &sql)
        .await
        .err()
        .map(|e| common::sqlstate(&e).unwrap_or_else(|| e.to_string()))
}

/// `jobs_need_event_update` compares the row's state with its event's `to_state`:
/// a row written next to an event that matches it in everything else
/// (version, hash, reason, time, token, from-state) but says the job stayed
/// queued cannot mark the job succeeded.
#[tokio::test]
async fn a_row_cannot_take_a_state_its_event_does_not_name() {
    let db = fresh().await;
    let job = db.enqueue(Some("k"), json!({})).await;
    let code = forged_events_then(&db, job.job_id, 1, "state = 'succeeded'").await;
    assert_eq!(code.as_deref(), Some(jobledger::store::ROW_WITHOUT_EVENT));
    // The control: the same forgery with the event's own state is accepted
    // by the trigger, so the refusal above is the state's alone.
    let code = forged_events_then(&db, job.job_id, 1, "state = e.to_state").await;
    assert_eq!(code, None, "a row matching its event is accepted");
    let j = db.job(job.job_id).await;
    assert_eq!((j.state, j.version), (jobledger::domain::JobState::Queued, 2));
}

/// Issue 15: the row checks run at the end of each statement, not at the
/// commit. A row update whose event is appended by a later statement of the
/// same transaction is refused at once, even though that event would match
/// it (with the deferred row trigger before, this was accepted at commit);
/// the event first and then the row, as `forged_events_then` does, is still
/// accepted (`a_row_cannot_take_a_state_its_event_does_not_name`).
#[tokio::test]
async fn a_row_update_needs_its_event_by_the_end_of_its_statement() {
    let db = fresh().await;
    let job = db.enqueue(Some("k"), json!({})).await;
    let at = "'2030-01-01T00:00:00Z'";
    let sql = format!(
        "BEGIN; \
         UPDATE jobledger.jobs SET version = version + 1, last_hash = 'forged-1', updated_at = {at}, \
           reason = 'observation' WHERE job_id = '{id}'; \
         INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, actor, epoch, token, \
           attempt, run, data, recorded_at, prev_hash, hash) \
         SELECT j.job_id, j.version, 'observed', j.state, j.state, 'observation', 'mallory', j.epoch, j.token, \
           j.attempt, j.run, '{{\"key\": \"x\", \"data\": {{}}, \"digest\": \"d\"}}', {at}, e.hash, 'forged-1' \
         FROM jobledger.jobs j JOIN jobledger.events e ON e.job_id = j.job_id AND e.version = 1 \
         WHERE j.job_id = '{id}'; \
         COMMIT;",
        id = job.job_id
    );
    let err = as_worker(&db, &sql)
        .await
        .expect_err("the row went ahead of its event");
    let code = common::sqlstate(&err);
    assert_eq!(
        code.as_deref(),
        Some(jobledger::store::ROW_WITHOUT_EVENT),
        "{err}"
    );
    assert!(err.to_string().contains("without its event"), "{err}");
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        1,
        "nothing kept"
    );
    assert_eq!(db.job(job.job_id).await.version, 1);
}

/// `jobs_need_event_update`: one update, one version. Two linked events appended
/// in the same transaction do not let the row skip from v1 to v3.
#[tokio::test]
async fn a_row_update_moves_the_version_by_exactly_one() {
    let db = fresh().await;
    let job = db.enqueue(Some("k"), json!({})).await;
    let code = forged_events_then(&db, job.job_id, 2, "state = e.to_state").await;
    assert_eq!(code.as_deref(), Some(jobledger::store::ROW_WITHOUT_EVENT));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        1,
        "nothing kept"
    );
    assert_eq!(db.job(job.job_id).await.version, 1);
}

/// `jobledger migrate` as a role that may not apply the migrations is an
/// error. (Other commands skip migrating as such a role, by design; migrate
/// used to share that path and printed `"migrated": true` over an empty
/// database.)
#[tokio::test]
async fn migrate_as_a_role_that_may_not_is_an_error() {
    let name = format!("jlt_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&format!("{}/postgres", common::server_url()))
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .unwrap();
    let url = format!("{}/{name}", common::server_url());
    let run = common::cli::jl(&as_role(&url, "jobledger_reader"), &["migrate"]);
    assert_ne!(run.code, 0, "{} / {}", run.stdout, run.stderr);
    assert!(run.stderr.contains("applying migrations"), "{}", run.stderr);
    assert!(run.stderr.contains("permission denied"), "{}", run.stderr);
    assert!(!run.stdout.contains("\"migrated\":true"), "{}", run.stdout);
    // The owner then migrates it.
    let run = common::cli::jl(&url, &["migrate"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
}
