//! Many at once: a batch of jobs, a workflow (a DAG of steps), and the
//! replay of every dead job that died of one reason within a time range.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::jobs::{body, body_or_default, EnqueueBody, ReasonBody};
use super::{ApiError, ApiResult, App, Authed, Body, ErrorBody, JobPath};
use crate::cli::output::{enqueued_json, WriteAnswer};
use crate::cli::workflow::{created_json, view_head_json};
use jobledger::domain::workflow::WorkflowSpec;
use jobledger::ledger::tokens::Action;

/// One statement writes a batch; at most this many jobs.
const MAX_JOBS: usize = 1000;

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchEnqueue {
    /// At most 1,000; all are written or none.
    jobs: Vec<EnqueueBody>,
}

/// Enqueues up to 1,000 jobs atomically (each idempotent by its key).
#[utoipa::path(post, path = "/v1/jobs/batch", tag = "jobs", request_body = BatchEnqueue,
    responses((status = 200, description = "one answer per job, in order", body = serde_json::Value),
        (status = 409, description = "a key names a job with another payload; nothing written", body = ErrorBody),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn enqueue_batch(State(app): State<App>, auth: Authed, raw: Body) -> ApiResult<Json<Value>> {
    let caller = auth.may(Action::Enqueue)?;
    let actor = format!("token:{}", caller.name);
    let b: BatchEnqueue = body(&raw)?;
    if b.jobs.is_empty() || b.jobs.len() > MAX_JOBS {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("a batch holds 1 to {MAX_JOBS} jobs, not {}", b.jobs.len()),
        ));
    }
    let news = b
        .jobs
        .into_iter()
        .map(EnqueueBody::into_new)
        .collect::<ApiResult<Vec<_>>>()?;
    let done = app.ledger.enqueue_many_as(news, &actor).await?;
    Ok(Json(
        json!({ "jobs": done.iter().map(enqueued_json).collect::<Vec<_>>() }),
    ))
}

/// Creates a workflow from its spec (docs/workflows.md: steps with `after`,
/// per-step policy, an optional `finally`), all in one transaction.
#[utoipa::path(post, path = "/v1/workflows", tag = "workflows",
    request_body(content = serde_json::Value, description = "a workflow spec, as `workflow create` reads it"),
    responses((status = 201, body = serde_json::Value), (status = 200, description = "the same spec under the same key", body = serde_json::Value),
        (status = 409, description = "the key names another spec", body = ErrorBody),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn create_workflow(State(app): State<App>, auth: Authed, raw: Body) -> ApiResult<Response> {
    let caller = auth.may(Action::Enqueue)?;
    let spec: WorkflowSpec = body(&raw)?;
    let c = app
        .ledger
        .workflow_as(&spec, &format!("token:{}", caller.name))
        .await?;
    let status = if c.parent.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(created_json(&c))).into_response())
}

/// A workflow per step: state, reason and what a waiting step waits for.
#[utoipa::path(get, path = "/v1/workflows/{id}", tag = "workflows",
    params(("id" = Uuid, Path, description = "The workflow's parent job")),
    responses((status = 200, body = serde_json::Value), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn show_workflow(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
) -> ApiResult<Json<Value>> {
    auth.may(Action::Read)?;
    let v = app.ledger.workflow_view(id).await?;
    let mut head = view_head_json(&v);
    head["steps"] = serde_json::to_value(&v.steps).expect("plain data");
    Ok(Json(head))
}

/// Cancels a workflow: the parent records the request, then every open
/// step gets the usual cancel semantics. One answer per write.
#[utoipa::path(post, path = "/v1/workflows/{id}/cancel", tag = "workflows",
    params(("id" = Uuid, Path, description = "The workflow's parent job")),
    request_body(content = Option<ReasonBody>, description = "optional: an empty body is no reason"),
    responses((status = 200, body = serde_json::Value), (status = 409, body = serde_json::Value),
        (status = 422, body = serde_json::Value), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn cancel_workflow(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
    raw: Body,
) -> ApiResult<Response> {
    let caller = auth.may(Action::Operate)?;
    let b: ReasonBody = body_or_default(&raw)?;
    let out = app
        .ledger
        .cancel_workflow_as(id, &format!("operator:{}", caller.name), b.reason.as_deref())
        .await?;
    // The parent's own answer decides the status: the steps' follow it.
    let status = super::status_of(out[0].outcome);
    let answers: Vec<WriteAnswer> = out.iter().map(WriteAnswer::from).collect();
    Ok((status, Json(json!({ "answers": answers }))).into_response())
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchReplay {
    /// The reason code the jobs died with (`attempts_exhausted`, ...).
    reason_code: String,
    /// Died at or after (RFC 3339).
    since: DateTime<Utc>,
    /// Died before (RFC 3339).
    until: DateTime<Utc>,
    /// Why they are replayed (recorded on every replay).
    reason: String,
}

/// Replays every dead job that died with `reason_code` within
/// `[since, until)`, job by job. 200 with one answer per job.
#[utoipa::path(post, path = "/v1/replays", tag = "operator", request_body = BatchReplay,
    responses((status = 200, body = super::work::BatchAnswers), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn replay_batch(State(app): State<App>, auth: Authed, raw: Body) -> ApiResult<Json<Value>> {
    let caller = auth.may(Action::Operate)?;
    let b: BatchReplay = body(&raw)?;
    if b.since >= b.until {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "since must be before until",
        ));
    }
    let out = app
        .ledger
        .replay_batch(&b.reason_code, b.since, b.until, &caller.name, &b.reason)
        .await?;
    let answers: Vec<WriteAnswer> = out.iter().map(WriteAnswer::from).collect();
    Ok(Json(json!({ "answers": answers })))
}
