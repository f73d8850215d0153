//! Issue 12's operator transitions: a verdict by hand on a job nothing else
//! will finish (`resolve`), and a correction beside an earlier event
//! (`annotate`). Both are edges of the state machine in the log, fenced and
//! verified like every other; neither edits a table.

mod common;

use common::fresh;
use jobledger::domain::{ErrorClass, EventBody, JobState, Outcome, Reason};
use serde_json::json;

/// A dead job and the version an operator would read from `show`.
async fn dead_job(db: &common::TestDb, key: &str) -> (uuid::Uuid, i64) {
    let job = db.enqueue(Some(key), json!({ "amount": 10 })).await;
    let lease = db.claim_one("w").await;
    assert!(lease
        .fail(ErrorClass::Permanent, "provider_unknown", None)
        .await
        .unwrap()
        .committed());
    let j = db.job(job.job_id).await;
    assert_eq!(j.state, JobState::Dead);
    (job.job_id, j.version)
}

#[tokio::test]
async fn an_operator_resolves_a_dead_job_with_evidence_and_a_second_one_is_refused() {
    let db = fresh().await;
    let (id, version) = dead_job(&db, "refund-r1").await;
    let evidence = json!({ "dashboard": "refund re_9 settled", "checked_at": "2026-12-02T10:00:00Z" });
    let first = db
        .ledger
        .resolve(
            id,
            "alice",
            JobState::Succeeded,
            "refund seen in the provider's dashboard",
            evidence.clone(),
            version,
        )
        .await
        .unwrap();
    assert!(first.committed(), "{first:?}");
    let j = db.job(id).await;
    assert_eq!(
        (j.state, j.reason, j.version),
        (JobState::Succeeded, Reason::ResolvedByOperator, version + 1)
    );
    let ev = first.event.unwrap();
    assert_eq!(ev.actor, "operator:alice");
    match ev.body {
        EventBody::ResolvedByOperator {
            operator,
            evidence: e,
            ..
        } => {
            assert_eq!((operator.as_str(), e), ("alice", evidence));
        }
        other => panic!("wrong event {other:?}"),
    }
    // Bob looked at the same version: the job moved under him.
    let second = db
        .ledger
        .resolve(
            id,
            "bob",
            JobState::Cancelled,
            "no refund in the dashboard",
            json!({ "checked": true }),
            version,
        )
        .await
        .unwrap();
    assert_eq!(second.outcome, Outcome::Stale, "{second:?}");
    assert!(second.detail.unwrap().contains("moved since version"));
    assert_eq!(
        db.job(id).await.state,
        JobState::Succeeded,
        "the first verdict stands"
    );
    let refused = db.ledger.rejections(id).await.unwrap();
    assert_eq!(refused.len(), 1, "the refused verdict is in the history");
    assert_eq!(
        (refused[0].command.as_str(), refused[0].actor.as_str()),
        ("resolve_by_operator", "operator:bob")
    );
    db.assert_verified().await;
}

#[tokio::test]
async fn a_job_awaiting_a_receipt_is_resolved_and_its_deadline_cleared() {
    let db = fresh().await;
    let job = db.enqueue(Some("refund-r2"), json!({})).await;
    let lease = db.claim_one("w").await;
    assert!(lease.submit("rcpt-1").await.unwrap().committed());
    let j = db.job(job.job_id).await;
    assert_eq!(j.state, JobState::AwaitingReceipt);
    let r = db
        .ledger
        .resolve(
            job.job_id,
            "alice",
            JobState::Cancelled,
            "the provider never got it",
            json!({ "ticket": 7 }),
            j.version,
        )
        .await
        .unwrap();
    assert!(r.committed(), "{r:?}");
    let j = db.job(job.job_id).await;
    assert_eq!(j.state, JobState::Cancelled);
    assert_eq!(
        j.receipt_deadline, None,
        "no receipt deadline left for the sweeper"
    );
    db.assert_verified().await;
}

#[tokio::test]
async fn only_dead_and_receipt_jobs_take_a_verdict_and_bad_verdicts_write_nothing() {
    let db = fresh().await;
    let (dead, version) = dead_job(&db, "refund-r4").await;
    let queued = db.enqueue(Some("refund-r3"), json!({})).await;
    let r = db
        .ledger
        .resolve(
            queued.job_id,
            "alice",
            JobState::Succeeded,
            "looks done",
            json!({ "checked": true }),
            1,
        )
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::InvalidTransition, "{r:?}");
    // Not a verdict, an empty reason, an oversized evidence: refused up front.
    let bad = db
        .ledger
        .resolve(
            dead,
            "alice",
            JobState::Queued,
            "retry",
            json!({ "t": 1 }),
            version,
        )
        .await;
    assert!(
        matches!(bad, Err(jobledger::ledger::LedgerError::BadInput(_))),
        "{bad:?}"
    );
    for (operator, note, evidence, v) in [
        ("alice", " ", json!({ "t": 1 }), version),
        ("alice\n     99 v9 forged line", "r", json!({ "t": 1 }), version),
        ("alice", "r", json!({}), version),
        ("alice", "r", json!(null), version),
        ("alice", "r", json!([1]), version),
        ("alice", "r", json!({ "t": 1 }), 0),
        ("alice", "r", json!({ "t": 1 }), -5),
    ] {
        let r = db
            .ledger
            .resolve(dead, operator, JobState::Succeeded, note, evidence.clone(), v)
            .await;
        assert!(
            matches!(r, Err(jobledger::ledger::LedgerError::BadInput(_))),
            "{operator:?} {note:?} {evidence} {v}: {r:?}"
        );
    }
    assert!(
        db.ledger.rejections(dead).await.unwrap().is_empty(),
        "bad input is not a refused write"
    );
    let big = json!({ "blob": "x".repeat(2 * 1024 * 1024) });
    let big = db
        .ledger
        .resolve(dead, "alice", JobState::Succeeded, "proof", big, version)
        .await;
    assert!(
        matches!(big, Err(jobledger::ledger::LedgerError::TooLarge { .. })),
        "{big:?}"
    );
    let j = db.job(dead).await;
    assert_eq!(
        (j.state, j.version),
        (JobState::Dead, version),
        "nothing was written"
    );
    db.assert_verified().await;
}

#[tokio::test]
async fn a_workflow_step_is_not_resolved_by_hand() {
    let db = fresh().await;
    let spec = common::workflows::seed("res", jobledger::domain::workflow::DependencyPolicy::Cancel);
    let created = db.ledger.workflow(&spec).await.unwrap();
    let step = common::workflows::id_of(&created, "render");
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job_id(), step);
    assert!(lease
        .fail(ErrorClass::Permanent, "render_broken", None)
        .await
        .unwrap()
        .committed());
    let v = db.job(step).await.version;
    let r = db
        .ledger
        .resolve(
            step,
            "alice",
            JobState::Succeeded,
            "rendered by hand",
            json!({ "checked": true }),
            v,
        )
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::InvalidTransition, "{r:?}");
    assert!(r.detail.unwrap().contains("workflow"));
    db.assert_verified().await;
}

#[tokio::test]
async fn an_annotation_sits_beside_the_event_it_corrects_and_changes_nothing() {
    let db = fresh().await;
    let (id, version) = dead_job(&db, "refund-a1").await;
    let history = db.ledger.history(id).await.unwrap();
    let failed = history.last().unwrap();
    let r = db
        .ledger
        .annotate(
            id,
            "carol",
            failed.position,
            "the provider was down, not the card",
        )
        .await
        .unwrap();
    assert!(r.committed(), "{r:?}");
    let j = db.job(id).await;
    assert_eq!(
        (j.state, j.reason, j.version),
        (JobState::Dead, Reason::PermanentError, version + 1)
    );
    // Nothing the purger, a batch replay or a hold goes by has moved.
    assert_eq!(
        j.updated_at, failed.event.recorded_at,
        "the job's time is its last real edge's"
    );
    let lines = jobledger::ledger::timeline::lines(&db.ledger, id).await.unwrap();
    let at = lines
        .iter()
        .position(|l| l.contains(" failed "))
        .expect("the failed event's line");
    assert!(
        lines[at + 1].contains("corrected at position") && lines[at + 1].contains("carol"),
        "the correction follows the corrected event: {lines:#?}"
    );
    assert!(lines.last().unwrap().contains("annotated") && lines.last().unwrap().contains("corrects v"));
    // Still found by its reason code, and replayable: no edge of its own.
    let since = chrono::Utc::now() - chrono::Duration::hours(1);
    let until = chrono::Utc::now() + chrono::Duration::hours(1);
    let replayed = db
        .ledger
        .replay_batch("permanent_error", since, until, "carol", "after the fix")
        .await
        .unwrap();
    assert_eq!(
        replayed.len(),
        1,
        "the annotated dead job is replayed by its reason code"
    );
    assert!(replayed[0].committed());
    db.assert_verified().await;
}

#[tokio::test]
async fn an_annotation_names_an_event_of_its_own_job() {
    let db = fresh().await;
    let a = db.enqueue(Some("a"), json!({})).await;
    let b = db.enqueue(Some("b"), json!({})).await;
    let b_first = db.ledger.history(b.job_id).await.unwrap()[0].position;
    let other = db.ledger.annotate(a.job_id, "carol", b_first, "wrong job").await;
    assert!(
        matches!(other, Err(jobledger::ledger::LedgerError::BadInput(_))),
        "{other:?}"
    );
    let none = db
        .ledger
        .annotate(a.job_id, "carol", 1_000_000, "no such event")
        .await;
    assert!(
        matches!(none, Err(jobledger::ledger::LedgerError::BadInput(_))),
        "{none:?}"
    );
    assert_eq!(db.job(a.job_id).await.version, 1, "nothing was written");
}

#[tokio::test]
async fn history_prints_the_next_action_and_the_operators_words() {
    let db = fresh().await;
    let (id, _) = dead_job(&db, "refund-h1").await;
    assert!(db
        .ledger
        .replay(id, "dave", "provider fixed")
        .await
        .unwrap()
        .committed());
    let lines = jobledger::ledger::timeline::lines(&db.ledger, id).await.unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" claimed ") && l.contains("next=execute")),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" replayed ") && l.contains("\"provider fixed\"")),
        "{lines:#?}"
    );
}

/// The CLI's `resolve` and `annotate`: the same outcomes as the library,
/// with their exit codes (stale = 3), and bad input refused before a write.
#[tokio::test]
async fn the_cli_resolves_and_annotates() {
    use common::cli::jl;
    let db = fresh().await;
    let (id, version) = dead_job(&db, "refund-c1").await;
    let (id_s, v_s) = (id.to_string(), version.to_string());
    let bad = jl(
        &db.url,
        &[
            "resolve",
            &id_s,
            "--as",
            "queued",
            "--reason",
            "r",
            "--evidence",
            "{}",
            "--version",
            &v_s,
            "--operator",
            "o",
        ],
    );
    assert_eq!(bad.code, 2, "clap refuses a verdict that is none: {}", bad.stderr);
    let not_json = jl(
        &db.url,
        &[
            "resolve",
            &id_s,
            "--as",
            "succeeded",
            "--reason",
            "r",
            "--evidence",
            "{",
            "--version",
            &v_s,
            "--operator",
            "o",
        ],
    );
    assert_eq!(not_json.code, 2, "{}", not_json.stderr);
    assert_eq!(db.job(id).await.version, version, "nothing was written");
    let ok = jl(
        &db.url,
        &[
            "resolve",
            &id_s,
            "--as",
            "succeeded",
            "--reason",
            "seen in the dashboard",
            "--evidence",
            r#"{"refund":"re_1"}"#,
            "--version",
            &v_s,
            "--operator",
            "alice",
        ],
    );
    assert_eq!(ok.code, 0, "{} {}", ok.stdout, ok.stderr);
    assert_eq!(ok.json()["outcome"], "committed");
    let again = jl(
        &db.url,
        &[
            "resolve",
            &id_s,
            "--as",
            "cancelled",
            "--reason",
            "r",
            "--evidence",
            r#"{"checked":true}"#,
            "--version",
            &v_s,
            "--operator",
            "bob",
        ],
    );
    assert_eq!((again.code, again.json()["outcome"].as_str()), (3, Some("stale")));
    let first = db.ledger.history(id).await.unwrap()[0].position.to_string();
    let note = jl(
        &db.url,
        &[
            "annotate",
            &id_s,
            "--corrects",
            &first,
            "--reason",
            "key was mistyped",
            "--operator",
            "carol",
        ],
    );
    assert_eq!(note.code, 0, "{} {}", note.stdout, note.stderr);
    let history = jl(&db.url, &["history", &id_s, "--text"]);
    assert!(
        history.stdout.contains("corrected at position") && history.stdout.contains("key was mistyped"),
        "{}",
        history.stdout
    );
    db.assert_verified().await;
}

/// A held step that was annotated is still released by hand (the hold is
/// its reason, which the annotation keeps).
#[tokio::test]
async fn an_annotated_held_step_is_still_released() {
    use jobledger::domain::workflow::DependencyPolicy;
    let db = fresh().await;
    let mut spec = common::workflows::seed("hold", DependencyPolicy::Cancel);
    spec.steps[1].on_dependency_failure = DependencyPolicy::Hold;
    let created = db.ledger.workflow(&spec).await.unwrap();
    let render = common::workflows::id_of(&created, "render");
    let review = common::workflows::id_of(&created, "review");
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job_id(), render);
    assert!(lease
        .fail(ErrorClass::Permanent, "broken", None)
        .await
        .unwrap()
        .committed());
    assert_eq!(db.job(review).await.reason, Reason::DependencyHeld);
    let first = db.ledger.history(review).await.unwrap()[0].position;
    assert!(db
        .ledger
        .annotate(review, "carol", first, "typo in the key")
        .await
        .unwrap()
        .committed());
    assert_eq!(db.job(review).await.reason, Reason::DependencyHeld);
    let r = db
        .ledger
        .release_hold(review, "carol", "run it anyway")
        .await
        .unwrap();
    assert!(r.committed(), "{r:?}");
    db.assert_verified().await;
}

/// `apply` (and so `verify`) refuses a verdict whose evidence digest or
/// reason was forged, even with the hash recomputed.
#[tokio::test]
async fn a_forged_verdict_does_not_replay() {
    let db = fresh().await;
    let (id, version) = dead_job(&db, "refund-f1").await;
    let before = db.job(id).await;
    let r = db
        .ledger
        .resolve(
            id,
            "alice",
            JobState::Succeeded,
            "seen",
            json!({ "re": 1 }),
            version,
        )
        .await
        .unwrap();
    let good = r.event.unwrap();
    assert!(jobledger::domain::apply(Some(&before), &good).is_ok());
    let mut digest = good.clone();
    if let EventBody::ResolvedByOperator { evidence_digest, .. } = &mut digest.body {
        *evidence_digest = "v1:0000".into();
    }
    let mut reason = good.clone();
    reason.reason = Reason::Completed;
    for mut forged in [digest, reason] {
        forged.hash = jobledger::domain::event_hash(&forged);
        let e = jobledger::domain::apply(Some(&before), &forged).unwrap_err();
        assert!(e.to_string().contains("operator"), "{e}");
    }
}
