//! Issue 11, what the adversarial review of workflows proved, each fixed and
//! kept fixed: a deadlock between a finished step and a worker completing an
//! already released dependent, a held step let go while a prerequisite was
//! open, a workflow cancel that released a step, an unchecked fan-in, purged
//! steps missing from answers, a replay outside any workflow, and counts
//! `verify` did not question.

mod common;

use common::workflows::{finish_next, id_of, seed, spec, step};
use common::{eventually, fresh, within, TestDb};
use jobledger::domain::workflow::{DependencyPolicy, FinallySpec, StepSpec};
use jobledger::domain::{ErrorClass, JobState, Outcome, Policy, Reason};
use jobledger::ledger::LedgerError;
use serde_json::json;
use std::time::Duration;

fn with(mut s: StepSpec, policy: DependencyPolicy) -> StepSpec {
    s.on_dependency_failure = policy;
    s
}

/// `a` and `b`, and `d` after both with the `hold` policy.
fn held_join(key: &str) -> jobledger::domain::workflow::WorkflowSpec {
    spec(
        key,
        vec![
            step("a", &[]),
            step("b", &[]),
            with(step("d", &["a", "b"]), DependencyPolicy::Hold),
        ],
    )
}

/// Sessions waiting for a lock (the first waiter for a row waits for the
/// holder's transaction, the next ones for the row's tuple lock).
async fn waiters(db: &TestDb) -> i64 {
    db.count("SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted")
        .await
}

/// `a` dies, `d` (policy run) is released and claimed; `a` is replayed and
/// claimed. Both complete while a gate holds the parent: A's transaction
/// gets the parent first and must not wait for D's row, which D's own
/// completion holds while it waits for the parent.
#[tokio::test]
async fn a_finished_step_never_waits_for_a_released_dependent() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&spec(
            "dl",
            vec![step("a", &[]), with(step("d", &["a"]), DependencyPolicy::Run)],
        ))
        .await
        .unwrap();
    finish_next(&db, "a", false).await;
    let d = db.claim_one("w").await;
    assert_eq!(d.job().unwrap().kind, "d");
    assert!(db
        .ledger
        .replay(id_of(&created, "a"), "ops", "again")
        .await
        .unwrap()
        .committed());
    let a = db.claim_one("w").await;

    let mut gate = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM jobledger.jobs WHERE job_id = $1 FOR UPDATE")
        .bind(created.parent.job.job_id)
        .execute(&mut *gate)
        .await
        .unwrap();
    let a_done = tokio::spawn(async move { a.complete(None).await });
    eventually("A waits for the parent", || async { waiters(&db).await == 1 }).await;
    let d_done = tokio::spawn(async move { d.complete(None).await });
    eventually("D waits for the parent too", || async { waiters(&db).await == 2 }).await;
    gate.commit().await.unwrap();
    let (ra, rd) = (
        within("A", a_done).await.unwrap(),
        within("D", d_done).await.unwrap(),
    );
    assert!(ra.unwrap().committed(), "no deadlock for A");
    assert!(rd.unwrap().committed(), "no deadlock for D");
    assert_eq!(db.state_of(created.parent.job.job_id).await, JobState::Succeeded);
    db.assert_verified().await;
}

/// A person lets a held step go only once every prerequisite has ended.
#[tokio::test]
async fn a_held_step_is_not_let_go_while_a_prerequisite_is_open() {
    let db = fresh().await;
    let created = db.ledger.workflow(&held_join("hold")).await.unwrap();
    finish_next(&db, "a", false).await;
    let d = id_of(&created, "d");
    assert_eq!(db.job(d).await.reason, Reason::DependencyHeld);
    let early = db.ledger.release_hold(d, "ops", "go").await.unwrap();
    assert_eq!(early.outcome, Outcome::InvalidTransition, "{early:?}");
    assert!(early.detail.unwrap().contains("still waiting for b"));
    finish_next(&db, "b", true).await;
    assert!(db.ledger.release_hold(d, "ops", "go").await.unwrap().committed());
    db.assert_verified().await;
}

/// A held step whose failed prerequisite was replayed and succeeded waits
/// for the others again, not for a person.
#[tokio::test]
async fn a_hold_lifts_when_the_failed_prerequisite_recovers() {
    let db = fresh().await;
    let created = db.ledger.workflow(&held_join("lift")).await.unwrap();
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 2)
        .await
        .unwrap();
    let a = leases.iter().find(|l| l.job().unwrap().kind == "a").unwrap();
    let b = leases.iter().find(|l| l.job().unwrap().kind == "b").unwrap();
    assert!(a
        .fail(ErrorClass::Permanent, "no", None)
        .await
        .unwrap()
        .committed());
    let d = id_of(&created, "d");
    assert_eq!(db.job(d).await.reason, Reason::DependencyHeld);
    assert!(db
        .ledger
        .replay(id_of(&created, "a"), "ops", "again")
        .await
        .unwrap()
        .committed());
    finish_next(&db, "a", true).await;
    let job = db.job(d).await;
    assert_eq!(
        (job.state, job.reason),
        (JobState::Waiting, Reason::WaitingForDependencies),
        "b is still open"
    );
    assert!(b.complete(None).await.unwrap().committed());
    assert_eq!(db.job(d).await.reason, Reason::DependenciesMet);
}

/// `workflow cancel` cancels a waiting `run` step; it is never queued on
/// the way (a worker could claim it there).
#[tokio::test]
async fn a_workflow_cancel_never_releases_a_step() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&spec(
            "wc",
            vec![
                step("x", &[]),
                step("m", &["x"]),
                with(step("n", &["m"]), DependencyPolicy::Run),
            ],
        ))
        .await
        .unwrap();
    db.ledger
        .cancel_workflow(created.parent.job.job_id, None)
        .await
        .unwrap();
    let n = id_of(&created, "n");
    assert_eq!(db.state_of(n).await, JobState::Cancelled);
    let queued = db
        .count(&format!(
            "SELECT count(*) FROM jobledger.events WHERE job_id = '{n}' AND to_state = 'queued'"
        ))
        .await;
    assert_eq!(queued, 0, "n was never claimable");
    assert_eq!(db.state_of(created.parent.job.job_id).await, JobState::Cancelled);
    db.assert_verified().await;
}

#[tokio::test]
async fn the_fan_in_is_checked_like_any_job() {
    let db = fresh().await;
    let bad = |queue: &str, policy: Option<Policy>| {
        let mut s = seed("f", DependencyPolicy::Cancel);
        s.finally = Some(FinallySpec {
            name: "report".into(),
            queue: Some(queue.into()),
            kind: "report".into(),
            priority: 0,
            policy,
        });
        s
    };
    let zero = Policy {
        max_attempts: 0,
        ..Policy::default()
    };
    for (s, says) in [
        (bad("", None), "queue must not be empty"),
        (bad(&"q".repeat(300), None), "over the limit"),
        (bad("q\u{0}", None), "U+0000"),
        (bad("q", Some(zero)), "max attempts 0"),
    ] {
        match db.ledger.workflow(&s).await {
            Err(e @ LedgerError::BadInput(_)) => {
                assert!(e.to_string().contains(says), "{e} should say {says:?}")
            }
            other => panic!("{says}: expected bad input, got {other:?}"),
        }
    }
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs").await,
        0,
        "nothing written"
    );
}

/// A purged step is still in `workflow show` and in the fan-in's summary.
#[tokio::test]
async fn purged_steps_stay_in_the_answers() {
    let db = fresh().await;
    let mut s = spec("p", vec![step("a", &[]), step("b", &[])]);
    s.finally = Some(FinallySpec {
        name: "report".into(),
        queue: None,
        kind: "report".into(),
        priority: 0,
        policy: None,
    });
    let created = db.ledger.workflow(&s).await.unwrap();
    finish_next(&db, "a", true).await;
    assert_eq!(
        db.ledger.purge(Duration::ZERO, 100).await.unwrap(),
        1,
        "a is purged"
    );
    let view = db.ledger.workflow_view(created.parent.job.job_id).await.unwrap();
    let a = view.steps.iter().find(|s| s.step == "a").expect("a is listed");
    assert_eq!((a.state, a.reason), (JobState::Succeeded, Reason::Completed));
    finish_next(&db, "b", true).await;
    let lease = db.claim_one("w").await;
    let summary = &lease.job().unwrap().payload["steps"];
    assert_eq!(summary["a"]["state"], "succeeded", "{summary}");
    assert_eq!(summary["b"]["state"], "succeeded");
    assert_eq!(summary["a"]["job_id"], json!(id_of(&created, "a").to_string()));
}

/// A dead step of a purged workflow has nobody to count it: its replay is
/// refused instead of running outside any workflow.
#[tokio::test]
async fn a_step_of_a_purged_workflow_is_not_replayed() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&spec("gone", vec![step("y", &[])]))
        .await
        .unwrap();
    finish_next(&db, "y", false).await;
    let y = id_of(&created, "y");
    let parent = created.parent.job.job_id;
    db.around_the_log(
        "UPDATE jobledger.jobs SET updated_at = updated_at - interval '1 hour' WHERE job_id = $1",
        parent,
    )
    .await;
    // Only the parent is old enough: its row as the superuser moved it back.
    let purged = db.ledger.purge(Duration::from_secs(600), 100).await.unwrap();
    assert_eq!(purged, 1);
    let r = db.ledger.replay(y, "ops", "again").await.unwrap();
    assert_eq!(r.outcome, Outcome::InvalidTransition, "{r:?}");
    assert!(r.detail.unwrap().contains("workflow was purged"));
}

/// A count of a job that is no step of the parent, and a step's edge
/// counted twice, are found by `verify` (each stream alone may replay).
#[tokio::test]
async fn verify_finds_a_foreign_count_and_a_double_count() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&spec("two", vec![step("a", &[]), step("b", &[])]))
        .await
        .unwrap();
    let parent = created.parent.job.job_id;
    finish_next(&db, "a", true).await;
    // v3: the same count again (the parent then says succeeded, b is open).
    db.around_the_log(
        "INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, error_class, actor, \
           epoch, token, attempt, run, data, recorded_at, prev_hash, hash) \
         SELECT job_id, 3, type, 'running', 'succeeded', reason, error_class, actor, epoch, token, attempt, run, \
           data, recorded_at, hash, 'forged' FROM jobledger.events WHERE job_id = $1 AND version = 2",
        parent,
    )
    .await;
    let report = db.ledger.verify(Some(parent)).await.unwrap();
    assert!(
        report.problems.iter().any(|p| p.detail.contains("a second time")),
        "{:?}",
        report.problems
    );
    let stranger = db.enqueue(Some("stranger"), json!({})).await.job_id;
    db.around_the_log(
        &format!(
            "UPDATE jobledger.events SET data = jsonb_set(data, '{{job_id}}', '\"{stranger}\"') \
             WHERE job_id = $1 AND version = 2"
        ),
        parent,
    )
    .await;
    let report = db.ledger.verify(Some(parent)).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.detail.contains("no step of this workflow")),
        "{:?}",
        report.problems
    );
}
