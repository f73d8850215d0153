//! Issue 11: workflows on the one write path. A parent whose named steps are
//! real jobs; a step waits until its prerequisites succeeded, released in
//! the same transaction as the last one's success; a failed prerequisite
//! cancels, runs or holds its dependents; the parent's state is the rule
//! table over its tally, in its own hash-chained stream.

mod common;

use common::workers::{base, start, stop};
use common::workflows::{finish_next, id_of, seed, spec, step, steps_by_state};
use common::{eventually, fresh, within};
use jobledger::domain::workflow::{DependencyPolicy, WorkflowSpec};
use jobledger::domain::{JobState, Reason};
use jobledger::ledger::LedgerError;
use jobledger::worker::{HandlerOutcome, JobContext};
use serde_json::json;

#[tokio::test]
async fn the_seed_workflow_with_real_workers_ends_per_step() {
    let db = fresh().await;
    let mut spec = seed("note-7", DependencyPolicy::Cancel);
    spec.finally = Some(jobledger::domain::workflow::FinallySpec {
        name: "report".into(),
        queue: None,
        kind: "report".into(),
        priority: 0,
        policy: None,
    });
    let created = db.ledger.workflow(&spec).await.unwrap();
    let parent = created.parent.job.job_id;
    assert_eq!(created.parent.job.state, JobState::Running);
    assert_eq!(db.state_of(id_of(&created, "review")).await, JobState::Waiting);
    let view = db.ledger.workflow_view(parent).await.unwrap();
    let review = view.steps.iter().find(|s| s.step == "review").unwrap();
    assert_eq!(
        review.waiting_for,
        vec!["render".to_string()],
        "show says what it waits for"
    );

    let (ran_tx, mut ran) = tokio::sync::mpsc::unbounded_channel();
    let worker = base(&db, "w1")
        .handler("render", {
            let ran = ran_tx.clone();
            move |_ctx: JobContext| {
                let ran = ran.clone();
                async move {
                    ran.send("render").unwrap();
                    HandlerOutcome::success(json!({ "pages": 3 }))
                }
            }
        })
        .handler("review", {
            let ran = ran_tx.clone();
            move |_ctx: JobContext| {
                let ran = ran.clone();
                async move {
                    ran.send("review").unwrap();
                    HandlerOutcome::permanent("rejected_by_editor")
                }
            }
        })
        .handler("publish", {
            let ran = ran_tx.clone();
            move |_ctx: JobContext| {
                let ran = ran.clone();
                async move {
                    ran.send("publish").unwrap();
                    HandlerOutcome::success(json!({}))
                }
            }
        })
        .handler("report", {
            let ran = ran_tx.clone();
            move |_ctx: JobContext| {
                let ran = ran.clone();
                async move {
                    ran.send("report").unwrap();
                    HandlerOutcome::success(json!({ "told": "editor" }))
                }
            }
        })
        .build()
        .unwrap();
    let running = start(worker);
    eventually("the workflow ends", || async {
        db.state_of(parent).await.is_terminal()
    })
    .await;
    stop(running).await;
    drop(ran_tx);
    let mut order = vec![];
    while let Some(s) = ran.recv().await {
        order.push(s);
    }
    assert_eq!(
        order,
        vec!["render", "review", "report"],
        "publish never ran, the fan-in once"
    );
    assert_eq!(
        steps_by_state(&db, parent).await,
        vec![
            ("publish".into(), JobState::Cancelled, Reason::DependencyFailed),
            ("render".into(), JobState::Succeeded, Reason::Completed),
            ("report".into(), JobState::Succeeded, Reason::Completed),
            ("review".into(), JobState::Dead, Reason::PermanentError),
        ]
    );
    let p = db.job(parent).await;
    assert_eq!(
        p.state,
        JobState::Dead,
        "a dead step: the workflow is dead, not cancelled"
    );
    assert_eq!(
        p.result,
        Some(json!({ "open": 0, "succeeded": 2, "cancelled": 1, "dead": 1 }))
    );
    // The fan-in ran with the summary of how each step ended.
    let report: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM jobledger.jobs WHERE kind = 'report'")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let s = &report["steps"];
    assert_eq!(
        (
            s["render"]["state"].as_str(),
            s["review"]["state"].as_str(),
            s["publish"]["state"].as_str()
        ),
        (Some("succeeded"), Some("dead"), Some("cancelled"))
    );
    // The parent's own stream tells the story, step by step.
    let parent_events: Vec<(String, serde_json::Value)> = sqlx::query_as(
        "SELECT to_state, data FROM jobledger.events WHERE job_id = $1 AND type = 'step_finished' ORDER BY version",
    )
    .bind(parent)
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    let told: Vec<(String, String, String)> = parent_events
        .iter()
        .map(|(to, d)| {
            (
                d["step"].as_str().unwrap().into(),
                d["status"].as_str().unwrap().into(),
                to.clone(),
            )
        })
        .collect();
    assert_eq!(
        told,
        vec![
            ("render".into(), "succeeded".into(), "running".into()),
            ("review".into(), "dead".into(), "failing".into()),
            ("publish".into(), "cancelled".into(), "failing".into()),
            ("report".into(), "succeeded".into(), "dead".into()),
        ]
    );
    db.assert_verified().await;
}

/// The release of a dependent is part of the prerequisite's own commit: in
/// the caller's transaction, rolled back with it, and committed with it.
#[tokio::test]
async fn a_prerequisites_success_and_the_release_commit_together() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&seed("atomic", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let review = id_of(&created, "review");
    let lease = db.claim_one("w").await;

    let mut tx = db.ledger.pool().begin().await.unwrap();
    let r = lease.complete_in(&mut tx, Some(json!({}))).await.unwrap();
    assert!(r.committed());
    let inside: String = sqlx::query_scalar("SELECT state FROM jobledger.jobs WHERE job_id = $1")
        .bind(review)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(inside, "queued", "released inside the same transaction");
    assert_eq!(
        db.state_of(review).await,
        JobState::Waiting,
        "not visible before the commit"
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        db.state_of(review).await,
        JobState::Waiting,
        "rolled back together"
    );
    assert_eq!(db.state_of(lease.job_id()).await, JobState::Leased);

    let mut tx = db.ledger.pool().begin().await.unwrap();
    assert!(lease
        .complete_in(&mut tx, Some(json!({})))
        .await
        .unwrap()
        .committed());
    tx.commit().await.unwrap();
    assert_eq!(db.state_of(review).await, JobState::Queued);
    let txids: i64 = db
        .count(&format!(
            "SELECT count(DISTINCT txid) FROM jobledger.events WHERE version > 1 AND job_id IN \
             ('{}', '{}', '{}')",
            lease.job_id(),
            review,
            created.parent.job.job_id
        ))
        .await;
    assert_eq!(
        txids, 2,
        "the claim, then one transaction for the success, the parent's count and the release"
    );
}

#[tokio::test]
async fn bad_specs_are_refused_and_nothing_is_written() {
    let db = fresh().await;
    let cases: Vec<(WorkflowSpec, &str)> = vec![
        (
            spec("c", vec![step("a", &["c"]), step("b", &["a"]), step("c", &["b"])]),
            "form a cycle",
        ),
        (
            spec("u", vec![step("a", &["nope"])]),
            "not a step of this workflow",
        ),
        (spec("d", vec![step("a", &[]), step("a", &[])]), "used twice"),
        (spec("s", vec![step("a", &["a"])]), "waits for itself"),
        (spec("e", vec![]), "at least one step"),
        (
            spec("big", (0..10_001).map(|i| step(&format!("s{i}"), &[])).collect()),
            "at most 10000 steps",
        ),
    ];
    for (s, says) in cases {
        match db.ledger.workflow(&s).await {
            Err(LedgerError::BadInput(m)) => assert!(m.contains(says), "{m:?} should say {says:?}"),
            other => panic!("{says}: expected bad input, got {other:?}"),
        }
    }
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 0);
}

#[tokio::test]
async fn the_same_spec_under_the_same_key_is_the_same_workflow() {
    let db = fresh().await;
    let first = db
        .ledger
        .workflow(&seed("once", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let again = db
        .ledger
        .workflow(&seed("once", DependencyPolicy::Cancel))
        .await
        .unwrap();
    assert!(first.parent.created && !again.parent.created);
    assert_eq!(first.parent.job.job_id, again.parent.job.job_id);
    assert_eq!(again.steps.len(), 3);
    let other = db.ledger.workflow(&seed("once", DependencyPolicy::Hold)).await;
    assert!(matches!(other, Err(LedgerError::KeyConflict { .. })), "{other:?}");
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 4);
}

/// Two steps of one parent finish at the same instant: the second waits for
/// the parent's row (held by the first until it commits), then is counted
/// too; the step waiting for both is released once, by the second.
#[tokio::test]
async fn two_steps_finishing_at_once_are_both_counted() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&spec(
            "fan",
            vec![step("a", &[]), step("b", &[]), step("c", &["a", "b"])],
        ))
        .await
        .unwrap();
    let parent = created.parent.job.job_id;
    let (la, lb) = (db.claim_one("wa").await, db.claim_one("wb").await);

    let mut first = db.ledger.pool().begin().await.unwrap();
    assert!(la
        .complete_in(&mut first, Some(json!({})))
        .await
        .unwrap()
        .committed());
    let second = tokio::spawn(async move { lb.complete(Some(json!({}))).await.unwrap() });
    eventually("the second completion waits for the parent's lock", || async {
        db.count("SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'")
            .await
            == 1
    })
    .await;
    first.commit().await.unwrap();
    let r = within("the second completion", second).await.unwrap();
    assert!(r.committed(), "{r:?}");
    let p = db.job(parent).await;
    assert_eq!(
        p.result,
        Some(json!({ "open": 1, "succeeded": 2, "cancelled": 0, "dead": 0 }))
    );
    assert_eq!(p.state, JobState::Running);
    assert_eq!(db.state_of(id_of(&created, "c")).await, JobState::Queued);
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM jobledger.events WHERE job_id = '{}' AND type = 'dependencies_resolved'",
            id_of(&created, "c")
        ))
        .await,
        1
    );
    finish_next(&db, "c", true).await;
    assert_eq!(db.state_of(parent).await, JobState::Succeeded);
    db.assert_verified().await;
}

/// `hold` keeps the dependent waiting for a person; replaying the dead step
/// reopens the parent, and its success releases the held step.
#[tokio::test]
async fn a_held_step_waits_for_a_person_and_a_replay_reopens_the_parent() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&seed("held", DependencyPolicy::Hold))
        .await
        .unwrap();
    let (parent, review, publish) = (
        created.parent.job.job_id,
        id_of(&created, "review"),
        id_of(&created, "publish"),
    );
    finish_next(&db, "render", true).await;
    finish_next(&db, "review", false).await;
    let held = db.job(publish).await;
    assert_eq!(
        (held.state, held.reason),
        (JobState::Waiting, Reason::DependencyHeld)
    );
    assert_eq!(
        db.state_of(parent).await,
        JobState::Failing,
        "a dead step, an open one"
    );
    db.claim_none("w").await;

    let r = db
        .ledger
        .replay(review, "ops", "editor changed their mind")
        .await
        .unwrap();
    assert!(r.committed());
    assert_eq!(
        db.state_of(parent).await,
        JobState::Running,
        "reopened: nothing ended badly now"
    );
    finish_next(&db, "review", true).await;
    assert_eq!(
        db.state_of(publish).await,
        JobState::Queued,
        "the held step goes once its prerequisite succeeded"
    );
    finish_next(&db, "publish", true).await;
    assert_eq!(db.state_of(parent).await, JobState::Succeeded);
    db.assert_verified().await;
}

#[tokio::test]
async fn an_operator_releases_a_held_step_and_run_runs_anyway() {
    let db = fresh().await;
    let mut held = seed("op", DependencyPolicy::Hold);
    held.steps.push({
        let mut s = step("notify", &["review"]);
        s.on_dependency_failure = DependencyPolicy::Run;
        s
    });
    let created = db.ledger.workflow(&held).await.unwrap();
    finish_next(&db, "render", true).await;
    finish_next(&db, "review", false).await;
    let notify = db.job(id_of(&created, "notify")).await;
    assert_eq!(
        (notify.state, notify.reason),
        (JobState::Queued, Reason::DependencyFailedRun)
    );
    let publish = id_of(&created, "publish");
    let refused = db
        .ledger
        .release_hold(id_of(&created, "render"), "ops", "go")
        .await
        .unwrap();
    assert_eq!(
        refused.outcome,
        jobledger::domain::Outcome::InvalidTransition,
        "only a held step"
    );
    let r = db
        .ledger
        .release_hold(publish, "ops", "published by hand review")
        .await
        .unwrap();
    assert!(r.committed(), "{r:?}");
    assert_eq!(db.job(publish).await.reason, Reason::HoldReleased);
    db.assert_verified().await;
}

/// Cancelling a waiting step is counted by the parent and cascades to the
/// steps that wait for it (policy `cancel`).
#[tokio::test]
async fn cancelling_a_waiting_step_cascades_and_is_counted() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&seed("cx", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let r = db
        .ledger
        .cancel(id_of(&created, "review"), Some("not needed"))
        .await
        .unwrap();
    assert!(r.committed(), "{r:?}");
    assert_eq!(db.state_of(id_of(&created, "publish")).await, JobState::Cancelled);
    let p = db.job(created.parent.job.job_id).await;
    assert_eq!(p.state, JobState::Failing, "render still open, two cancelled");
    finish_next(&db, "render", true).await;
    assert_eq!(db.state_of(created.parent.job.job_id).await, JobState::Cancelled);
    db.assert_verified().await;
}

/// The fan-in runs exactly once, when every other step has ended, with
/// their summary as its payload; it is counted like any step, and a replay
/// after it ran does not create it again.
#[tokio::test]
async fn the_fan_in_runs_once_with_the_summary() {
    let db = fresh().await;
    let mut s = seed("fan-in", DependencyPolicy::Cancel);
    s.finally = Some(jobledger::domain::workflow::FinallySpec {
        name: "report".into(),
        queue: None,
        kind: "report".into(),
        priority: 0,
        policy: None,
    });
    let created = db.ledger.workflow(&s).await.unwrap();
    let parent = created.parent.job.job_id;
    assert_eq!(
        db.job(parent).await.result.unwrap()["open"],
        4,
        "the fan-in is counted from the start"
    );
    finish_next(&db, "render", true).await;
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs WHERE kind = 'report'")
            .await,
        0
    );
    finish_next(&db, "review", false).await;
    // publish was cancelled by the dependency: every other step has ended.
    let lease = db.claim_one("w").await;
    let job = lease.job().unwrap().clone();
    assert_eq!(job.kind, "report");
    assert_eq!(job.payload["workflow"], json!(parent.to_string()));
    assert_eq!(job.payload["steps"]["review"]["state"], "dead");
    assert_eq!(job.payload["steps"]["publish"]["reason"], "dependency_failed");
    assert_eq!(job.payload["steps"]["render"]["state"], "succeeded");
    assert_eq!(
        db.state_of(parent).await,
        JobState::Failing,
        "the fan-in is still open"
    );
    assert!(lease
        .complete(Some(json!({ "sent": true })))
        .await
        .unwrap()
        .committed());
    assert_eq!(db.state_of(parent).await, JobState::Dead);

    let review = id_of(&created, "review");
    assert!(db
        .ledger
        .replay(review, "ops", "again")
        .await
        .unwrap()
        .committed());
    finish_next(&db, "review", true).await;
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs WHERE kind = 'report'")
            .await,
        1,
        "created once"
    );
    assert_eq!(
        db.state_of(parent).await,
        JobState::Cancelled,
        "publish stays cancelled, nothing dead now"
    );
    db.assert_verified().await;
}

/// `workflow cancel`: every open step gets the usual cancel semantics, the
/// parent records the request and counts each end.
#[tokio::test]
async fn cancelling_a_workflow_cancels_each_open_step() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&spec(
            "wc",
            vec![
                step("render", &[]),
                step("upload", &[]),
                step("review", &["render"]),
                step("publish", &["review", "upload"]),
            ],
        ))
        .await
        .unwrap();
    let parent = created.parent.job.job_id;
    let render = db.claim_one("w").await;
    let upload = db.claim_one("w").await;
    assert!(
        upload.submit("rcpt-1").await.unwrap().committed(),
        "upload awaits a receipt"
    );

    let out = db
        .ledger
        .cancel_workflow(parent, Some("note withdrawn"))
        .await
        .unwrap();
    let outcomes: Vec<_> = out.iter().map(|r| r.outcome.as_str()).collect();
    assert_eq!(
        outcomes[0], "committed",
        "the parent records the request: {outcomes:?}"
    );
    assert_eq!(db.state_of(id_of(&created, "review")).await, JobState::Cancelled);
    assert_eq!(db.state_of(id_of(&created, "publish")).await, JobState::Cancelled);
    assert_eq!(db.state_of(render.job_id()).await, JobState::CancelRequested);
    let u = db.job(upload.job_id()).await;
    assert_eq!(
        (u.state, u.reason),
        (JobState::AwaitingReceipt, Reason::CancelAfterSubmit)
    );
    assert_eq!(db.state_of(parent).await, JobState::Failing);
    let plain = db.ledger.cancel(parent, None).await.unwrap();
    assert_eq!(
        plain.outcome.as_str(),
        "invalid_transition",
        "a workflow is not cancelled as one job"
    );
    let again = db.ledger.cancel_workflow(parent, None).await.unwrap();
    assert_eq!(again[0].outcome.as_str(), "already_committed");

    assert!(render.confirm_cancel().await.unwrap().committed());
    let r = db
        .ledger
        .receipt(
            upload.job_id(),
            "rcpt-1",
            jobledger::domain::ReceiptStatus::Succeeded,
        )
        .await
        .unwrap();
    assert!(r.committed());
    let p = db.job(parent).await;
    assert_eq!(p.state, JobState::Cancelled);
    assert_eq!(
        p.result,
        Some(json!({ "open": 0, "succeeded": 1, "cancelled": 3, "dead": 0, "cancel_requested": true }))
    );
    db.assert_verified().await;
}
