//! Workflow test support: specs of named steps, the seed example
//! (render → review → publish), and finishing the next claimable step.

use super::TestDb;
use jobledger::domain::workflow::{DependencyPolicy, StepSpec, WorkflowSpec};
use jobledger::domain::{ErrorClass, JobState, Reason};
use jobledger::ledger::WorkflowCreated;
use serde_json::json;
use uuid::Uuid;

pub fn step(name: &str, after: &[&str]) -> StepSpec {
    StepSpec {
        name: name.into(),
        queue: None,
        kind: name.into(),
        key: None,
        payload: json!({ "step": name }),
        after: after.iter().map(|s| s.to_string()).collect(),
        on_dependency_failure: DependencyPolicy::Cancel,
        priority: 0,
        policy: None,
    }
}

pub fn spec(key: &str, steps: Vec<StepSpec>) -> WorkflowSpec {
    WorkflowSpec {
        queue: "q".into(),
        name: "publish_note".into(),
        key: Some(key.into()),
        payload: json!({ "note": 7 }),
        steps,
        finally: None,
    }
}

/// The seed example: render → review → publish.
pub fn seed(key: &str, publish: DependencyPolicy) -> WorkflowSpec {
    let mut publish_step = step("publish", &["review"]);
    publish_step.on_dependency_failure = publish;
    spec(
        key,
        vec![step("render", &[]), step("review", &["render"]), publish_step],
    )
}

pub fn id_of(c: &WorkflowCreated, name: &str) -> Uuid {
    c.steps
        .iter()
        .find(|(n, _)| n == name)
        .expect("step")
        .1
        .job
        .job_id
}

pub async fn steps_by_state(db: &TestDb, parent: Uuid) -> Vec<(String, JobState, Reason)> {
    let view = db.ledger.workflow_view(parent).await.unwrap();
    view.steps
        .into_iter()
        .map(|s| (s.step, s.state, s.reason))
        .collect()
}

/// Completes the only claimable job of queue `q`, which must be `kind`.
pub async fn finish_next(db: &TestDb, kind: &str, ok: bool) {
    let lease = db.claim_one("w").await;
    assert_eq!(lease.job().unwrap().kind, kind, "claimed the wrong step");
    let r = if ok {
        lease.complete(Some(json!({ "done": kind }))).await.unwrap()
    } else {
        lease.fail(ErrorClass::Permanent, "rejected", None).await.unwrap()
    };
    assert!(r.committed(), "{r:?}");
}
