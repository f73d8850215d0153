//! Issue 11, the views on workflows: the CLI (`workflow create|show`,
//! `show` of a step, `history PARENT`), the `workflows` projection, and
//! what `verify` checks of a parent and its steps.

mod common;

use common::workflows::{finish_next, id_of, seed};
use common::{fresh, within};
use jobledger::domain::workflow::DependencyPolicy;
use jobledger::reader::LogReader;
use jobledger_projections::runner::Runner;
use jobledger_projections::workflows::Workflows;
use serde_json::json;

/// The CLI: a spec from standard input, `show` of a waiting step, the
/// tree, and bad specs as exit 2 with a one-line reason and nothing written.
#[tokio::test]
async fn the_cli_creates_shows_and_refuses() {
    use common::cli::{jl, jl_stdin};
    let db = fresh().await;
    let spec = r#"{"queue":"q","name":"publish_note","key":"n1","steps":[
        {"name":"render","kind":"render","payload":{"note":1}},
        {"name":"review","kind":"review","after":["render"]},
        {"name":"publish","kind":"publish","after":["review"],"on_dependency_failure":"hold"}]}"#;
    let created = jl_stdin(&db.url, &["workflow", "create", "@-"], Some(spec));
    assert_eq!(created.code, 0, "{}", created.stderr);
    let c = created.json();
    assert_eq!(c["state"], "running");
    let review = c["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == "review")
        .unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_string();
    let shown = jl(&db.url, &["show", &review]).json();
    assert_eq!(shown["state"], "waiting");
    assert_eq!(shown["waiting_for"], json!(["render"]));
    assert_eq!(shown["workflow"]["step"], "review");
    let tree = jl(&db.url, &["workflow", "show", c["workflow_id"].as_str().unwrap()]);
    assert_eq!(tree.code, 0, "{}", tree.stderr);
    let lines = tree.lines();
    assert_eq!(lines[0]["tally"]["open"], 3);
    assert_eq!(lines.len(), 4, "the parent and three steps");

    for (bad, says) in [
        (
            r#"{"queue":"q","name":"w","steps":[{"name":"a","kind":"k","after":["a"]}]}"#,
            "waits for itself",
        ),
        (
            r#"{"queue":"q","name":"w","steps":[{"name":"a","kind":"k","aftr":[]}]}"#,
            "unknown field",
        ),
        (
            r#"{"queue":"q","name":"w","steps":[{"name":"a","kind":"k","on_dependency_failure":"maybe"}]}"#,
            "unknown variant",
        ),
        ("[1,2", "spec"),
    ] {
        let r = jl_stdin(&db.url, &["workflow", "create", "@-"], Some(bad));
        assert_eq!(r.code, 2, "{bad}: {}", r.stderr);
        assert!(r.stderr.contains(says), "{bad}: {}", r.stderr);
        assert_eq!(r.stderr.trim().lines().count(), 1, "one line: {}", r.stderr);
    }
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 4);

    // history PARENT: the parent's edges and its steps', in time.
    finish_next(&db, "render", true).await;
    let parent = c["workflow_id"].as_str().unwrap();
    let h = jl(&db.url, &["history", parent, "--text"]);
    assert_eq!(h.code, 0, "{}", h.stderr);
    let at = |needle: &str| {
        h.stdout
            .lines()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in\n{}", h.stdout))
    };
    assert!(at("[render]") < at("step_finished"), "{}", h.stdout);
    assert!(at("succeeded") < at("step_finished"));
    assert!(at("step_finished") < at("dependencies_resolved"), "{}", h.stdout);
    assert!(h
        .stdout
        .lines()
        .find(|l| l.contains("dependencies_resolved"))
        .unwrap()
        .starts_with("[review]"));
    let json_lines = jl(&db.url, &["history", parent, "--json"]).lines();
    assert!(json_lines
        .iter()
        .any(|l| l["step"] == "render" && l["type"] == "succeeded"));
}

/// The `workflows` projection serves the tree with each step's state, from
/// the log alone, and a second run over the same events changes nothing.
#[tokio::test]
async fn the_workflows_projection_serves_the_tree() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&seed("tree", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let parent = created.parent.job.job_id;
    db.enqueue(Some("not-a-step"), json!({})).await;
    finish_next(&db, "render", true).await;
    finish_next(&db, "review", false).await;
    let reader = LogReader::source(db.ledger.pool().clone());
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 3).await.unwrap();
    within("a catch-up", runner.catch_up(&[&Workflows]))
        .await
        .unwrap();
    let rows: Vec<(Option<String>, String, String, i64)> = sqlx::query_as(
        "SELECT step, state, reason, version FROM jobledger_proj.workflows WHERE workflow_id = $1 ORDER BY step NULLS FIRST",
    )
    .bind(parent)
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    let parent_version = db.job(parent).await.version;
    assert_eq!(
        rows,
        vec![
            (None, "dead".into(), "step_finished".into(), parent_version),
            (
                Some("publish".into()),
                "cancelled".into(),
                "dependency_failed".into(),
                2
            ),
            (Some("render".into()), "succeeded".into(), "completed".into(), 3),
            (Some("review".into()), "dead".into(), "permanent_error".into(), 4),
        ]
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.workflows").await,
        4,
        "only workflows"
    );
    // `projections query workflows --job PARENT` is the tree.
    let q = common::cli::jl(
        &db.url,
        &["projections", "query", "workflows", "--job", &parent.to_string()],
    );
    assert_eq!(q.code, 0, "{}", q.stderr);
    assert_eq!(q.lines().len(), 4);
}

/// A forged parent event that claims a state the tally does not give is
/// found by `verify`, which replays parents like any job.
#[tokio::test]
async fn verify_replays_the_parent_against_the_rule_table() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&seed("v", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let parent = created.parent.job.job_id;
    finish_next(&db, "render", true).await;
    db.assert_verified().await;
    // As the superuser around the triggers, the attacker's way: the
    // parent's count says `succeeded` after one of three steps, with the
    // hash recomputed, so only the rule table can catch it.
    let mut forged = db.ledger.history(parent).await.unwrap().pop().unwrap().event;
    assert_eq!(forged.body.type_name(), "step_finished");
    forged.to_state = jobledger::domain::JobState::Succeeded;
    forged.hash = jobledger::domain::event_hash(&forged);
    db.around_the_log(
        &format!(
            "UPDATE jobledger.events SET to_state = 'succeeded', hash = '{}' WHERE job_id = $1 AND version = {}",
            forged.hash, forged.version
        ),
        parent,
    )
    .await;
    let report = db.ledger.verify(Some(parent)).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.detail.contains("the steps say running")),
        "the rule table finds the forged state: {:?}",
        report.problems
    );
    assert!(
        report
            .problems
            .iter()
            .all(|p| !p.detail.contains("hash mismatch")),
        "{:?}",
        report.problems
    );
}

/// Across streams: a parent that forgot to count a step, or counts an end
/// its step's log does not have, is found by `verify` (each stream alone
/// still replays).
#[tokio::test]
async fn verify_matches_each_parent_with_its_steps() {
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&seed("x", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let parent = created.parent.job.job_id;
    finish_next(&db, "render", true).await;
    db.assert_verified().await;
    // The count names the step's v3 as dead; its log says succeeded.
    db.around_the_log(
        "UPDATE jobledger.events SET data = jsonb_set(data, '{status}', '\"dead\"') \
         WHERE job_id = $1 AND type = 'step_finished'",
        parent,
    )
    .await;
    let report = db.ledger.verify(None).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.job_id == parent && p.detail.contains("its log says succeeded to succeeded")),
        "{:?}",
        report.problems
    );
    // A step's end that no parent event counts.
    let render = id_of(&created, "render");
    db.around_the_log(
        "UPDATE jobledger.events SET data = jsonb_set(data, '{version}', '99') \
         WHERE job_id = (SELECT (workflow ->> 'parent')::uuid FROM jobledger.jobs WHERE job_id = $1) \
           AND type = 'step_finished'",
        render,
    )
    .await;
    let report = db.ledger.verify(Some(render)).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.job_id == render && p.detail.contains("is not counted by workflow")),
        "{:?}",
        report.problems
    );
}

/// `queue_stats` version 2 counts the workflow states (version 1 left a
/// waiting step or a running parent out of every column).
#[tokio::test]
async fn queue_stats_counts_waiting_steps_and_running_parents() {
    use jobledger_projections::shipped::QueueStats;
    let db = fresh().await;
    db.ledger
        .workflow(&seed("stats", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let reader = LogReader::source(db.ledger.pool().clone());
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    within("a catch-up", runner.catch_up(&[&QueueStats]))
        .await
        .unwrap();
    let row: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT queued, waiting, running, failing FROM jobledger_proj.queue_stats WHERE queue = 'q'",
    )
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(
        row,
        (1, 2, 1, 0),
        "render queued, review and publish waiting, the parent running"
    );
    finish_next(&db, "render", true).await;
    finish_next(&db, "review", false).await;
    within("a catch-up", runner.catch_up(&[&QueueStats]))
        .await
        .unwrap();
    let row: (i64, i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT queued, waiting, running, succeeded, cancelled, dead FROM jobledger_proj.queue_stats WHERE queue = 'q'",
    )
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(
        row,
        (0, 0, 0, 1, 1, 2),
        "render, publish, review and the parent (dead)"
    );
}
