//! `jobledger workflow create|show|cancel|release-hold`: parse, call the
//! ledger, render.

use anyhow::Result;
use serde_json::{json, Value};

use super::args::WorkflowCmd;
use super::output::{self, job_json, line, outcome_code, write_json, BadInput};
use super::parse::json_arg;
use jobledger::domain::workflow::{Membership, WorkflowSpec};
use jobledger::domain::Job;
use jobledger::ledger::{Ledger, WorkflowCreated, WorkflowView};

pub async fn run(ledger: &Ledger, action: &WorkflowCmd, max_bytes: usize) -> Result<i32> {
    match action {
        WorkflowCmd::Create { spec } => {
            let v = json_arg("spec", spec, max_bytes).map_err(BadInput)?;
            let spec: WorkflowSpec =
                serde_json::from_value(v).map_err(|e| BadInput(format!("workflow spec: {e}")))?;
            line(&created_json(&ledger.workflow(&spec).await?));
            Ok(output::OK)
        }
        WorkflowCmd::Show { parent } => {
            let v = ledger.workflow_view(*parent).await?;
            line(&view_head_json(&v));
            for s in &v.steps {
                line(&serde_json::to_value(s)?);
            }
            Ok(output::OK)
        }
        WorkflowCmd::Cancel { parent, reason } => {
            let out = ledger.cancel_workflow(*parent, reason.as_deref()).await?;
            for r in &out {
                line(&write_json(r));
            }
            Ok(out.first().map_or(output::OK, |r| outcome_code(r.outcome)))
        }
        WorkflowCmd::ReleaseHold {
            job,
            operator,
            reason,
        } => {
            let r = ledger.release_hold(*job, operator, reason).await?;
            line(&write_json(&r));
            Ok(outcome_code(r.outcome))
        }
    }
}

/// `show JOB`: the job, and for a workflow's parent or step its place in it
/// (a waiting step says what it waits for).
pub async fn shown(ledger: &Ledger, j: &Job) -> Result<Value> {
    let mut v = job_json(j);
    let o = v.as_object_mut().expect("object");
    match &j.workflow {
        Some(Membership::Parent { steps, .. }) => {
            o.insert("workflow".into(), json!({ "role": "parent", "steps": steps }));
        }
        Some(Membership::Step(l)) => {
            o.insert(
                "workflow".into(),
                json!({ "role": "step", "parent": l.parent, "step": l.step }),
            );
            let waiting = ledger.waiting_for(j).await?;
            if !waiting.is_empty() {
                o.insert("waiting_for".into(), json!(waiting));
            }
        }
        None => {}
    }
    // Why a due job has not started: its queue is paused, rate-limited,
    // or its concurrency key holds every slot its limit gives.
    let mut waits = ledger.admission_waits(j).await?;
    if j.state == jobledger::domain::JobState::Queued {
        let q = ledger.queue_status(&j.queue).await?;
        if q.paused {
            let since = q
                .paused_at
                .map(jobledger::domain::digest::fmt_time)
                .unwrap_or_default();
            let by = q.paused_by.unwrap_or_default();
            let why = q.reason.unwrap_or_default();
            waits.insert(0, format!("queue paused since {since} by {by}: {why}"));
        }
    }
    if let Some(first) = waits.first() {
        o.insert("waiting_because".into(), json!(first));
        o.insert("waiting_because_all".into(), json!(waits));
    }
    Ok(v)
}

/// A created (or found) workflow, as `workflow create` and `POST
/// /v1/workflows` answer.
pub fn created_json(c: &WorkflowCreated) -> Value {
    let steps: Vec<Value> = c
        .steps
        .iter()
        .map(|(name, e)| json!({ "step": name, "job_id": e.job.job_id, "state": e.job.state }))
        .collect();
    json!({
        "workflow_id": c.parent.job.job_id, "state": c.parent.job.state, "created": c.parent.created,
        "position": c.parent.position, "steps": steps,
    })
}

/// The parent's line of `workflow show` (its steps follow).
pub fn view_head_json(v: &WorkflowView) -> Value {
    json!({
        "workflow_id": v.parent.job_id, "name": v.parent.kind, "state": v.parent.state,
        "reason": v.parent.reason, "tally": v.parent.result,
    })
}
