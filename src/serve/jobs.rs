//! `/v1/jobs`: enqueue, show, history and the operators' writes.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::{written, ApiError, ApiResult, App, Authed, Body, ErrorBody, JobPath};
use crate::cli::output::WriteAnswer;
use jobledger::domain::{JobState, NewJob};
use jobledger::ledger::tokens::Action;
use jobledger::ledger::Found;

/// The body as `T`, or 400 with serde's one-line reason.
pub(super) fn body<T: DeserializeOwned>(raw: &Body) -> ApiResult<T> {
    serde_json::from_slice(&raw.0)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("bad request body: {e}")))
}

/// An optional body: empty is `T::default()`.
pub(super) fn body_or_default<T: DeserializeOwned + Default>(raw: &Body) -> ApiResult<T> {
    if raw.0.is_empty() {
        Ok(T::default())
    } else {
        body(raw)
    }
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnqueueBody {
    queue: String,
    kind: String,
    key: Option<String>,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    #[schema(minimum = -32768, maximum = 32767)]
    priority: i16,
    delay_ms: Option<i64>,
    run_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Jobs of the queue with the same key share a concurrency limit's slots.
    concurrency_key: Option<String>,
    /// With `key`: how long the key names this job (docs/admission.md).
    unique_for_ms: Option<i64>,
}

/// Enqueues one job; idempotent by (queue, key).
#[utoipa::path(post, path = "/v1/jobs", tag = "jobs", request_body = EnqueueBody,
    responses((status = 201, description = "created", body = serde_json::Value),
        (status = 200, description = "the job this key already names", body = serde_json::Value),
        (status = 409, description = "the key names a job with another payload", body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn enqueue(State(app): State<App>, auth: Authed, raw: Body) -> ApiResult<Response> {
    let caller = auth.may(Action::Enqueue)?;
    let actor = format!("token:{}", caller.name);
    let b: EnqueueBody = body(&raw)?;
    let e = app.ledger.enqueue_as(b.into_new()?, &actor).await?;
    let status = if e.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(crate::cli::output::enqueued_json(&e))).into_response())
}

impl EnqueueBody {
    pub(super) fn into_new(self) -> ApiResult<NewJob> {
        if self.delay_ms.is_some() && self.run_at.is_some() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "give delay_ms or run_at, not both",
            ));
        }
        Ok(NewJob {
            queue: self.queue,
            kind: self.kind,
            job_key: self.key,
            payload: self.payload,
            priority: self.priority,
            run_at: self.run_at,
            delay_ms: self.delay_ms,
            policy: None,
            concurrency_key: self.concurrency_key,
            unique_for_ms: self.unique_for_ms,
        })
    }
}

/// The job's current state (a workflow parent answers per step; a purged
/// job answers with its tombstone).
#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs", params(("id" = Uuid, Path, description = "The job")),
    responses((status = 200, body = serde_json::Value), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn show(State(app): State<App>, auth: Authed, JobPath(id): JobPath) -> ApiResult<Json<Value>> {
    auth.may(Action::Read)?;
    Ok(Json(match app.ledger.show(id).await? {
        Found::Live(j) => crate::cli::workflow::shown(&app.ledger, &j).await.map_err(|e| {
            tracing::error!("show {id}: {e:#}");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error (logged)")
        })?,
        Found::Purged(t) => crate::cli::output::tombstone_json(&t),
    }))
}

/// The job's timeline: every event with its words, the refused writes
/// beside them and corrections under the event they correct.
#[utoipa::path(get, path = "/v1/jobs/{id}/history", tag = "jobs", params(("id" = Uuid, Path, description = "The job")),
    responses((status = 200, body = serde_json::Value), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn history(State(app): State<App>, auth: Authed, JobPath(id): JobPath) -> ApiResult<Json<Value>> {
    auth.may(Action::Read)?;
    // An unknown job is the timeline's own NotFound (404); a purged job's
    // events are still told.
    let lines = jobledger::ledger::timeline::json_lines(&app.ledger, id).await?;
    Ok(Json(json!({ "job_id": id, "entries": lines })))
}

#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasonBody {
    pub(super) reason: Option<String>,
}

/// Cancels a job (before start: cancelled; running: cancel requested).
#[utoipa::path(post, path = "/v1/jobs/{id}/cancel", tag = "operator", params(("id" = Uuid, Path, description = "The job")),
    request_body(content = Option<ReasonBody>, description = "optional: an empty body is no reason"),
    responses((status = 200, description = "committed or already_committed", body = WriteAnswer),
        (status = 409, description = "stale or conflict", body = WriteAnswer),
        (status = 422, description = "invalid_transition", body = WriteAnswer),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn cancel(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
    raw: Body,
) -> ApiResult<Response> {
    let caller = auth.may(Action::Operate)?;
    let b: ReasonBody = body_or_default(&raw)?;
    let actor = format!("operator:{}", caller.name);
    Ok(written(
        &app.ledger.cancel_as(id, &actor, b.reason.as_deref()).await?,
    ))
}

/// Replays a dead or cancelled job: a new run under a new token.
#[utoipa::path(post, path = "/v1/jobs/{id}/replay", tag = "operator", params(("id" = Uuid, Path, description = "The job")),
    request_body = ReasonBody,
    responses((status = 200, description = "committed or already_committed", body = WriteAnswer),
        (status = 409, description = "stale or conflict", body = WriteAnswer),
        (status = 422, description = "invalid_transition", body = WriteAnswer),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn replay(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
    raw: Body,
) -> ApiResult<Response> {
    let caller = auth.may(Action::Operate)?;
    let b: ReasonBody = body(&raw)?;
    let reason = b
        .reason
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "a replay needs a reason"))?;
    Ok(written(&app.ledger.replay(id, &caller.name, &reason).await?))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveBody {
    verdict: String,
    reason: String,
    /// What the operator checked, as JSON (kept with its digest).
    evidence: Value,
    version: i64,
}

/// Records an operator's verdict on a dead job or one awaiting its receipt,
/// fenced on the job's version.
#[utoipa::path(post, path = "/v1/jobs/{id}/resolve", tag = "operator", params(("id" = Uuid, Path, description = "The job")),
    request_body = ResolveBody,
    responses((status = 200, description = "committed or already_committed", body = WriteAnswer),
        (status = 409, description = "stale or conflict", body = WriteAnswer),
        (status = 422, description = "invalid_transition", body = WriteAnswer),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn resolve(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
    raw: Body,
) -> ApiResult<Response> {
    let caller = auth.may(Action::Operate)?;
    let b: ResolveBody = body(&raw)?;
    // Any state name parses; the ledger refuses all but the two verdicts.
    let verdict = JobState::parse(&b.verdict)
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "verdict is succeeded or cancelled"))?;
    let r = app
        .ledger
        .resolve(id, &caller.name, verdict, &b.reason, b.evidence, b.version)
        .await?;
    Ok(written(&r))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AnnotateBody {
    corrects: i64,
    reason: String,
}

/// Appends a correction beside an earlier event; changes no state.
#[utoipa::path(post, path = "/v1/jobs/{id}/annotate", tag = "operator", params(("id" = Uuid, Path, description = "The job")),
    request_body = AnnotateBody,
    responses((status = 200, description = "committed or already_committed", body = WriteAnswer),
        (status = 409, description = "stale or conflict", body = WriteAnswer),
        (status = 422, description = "invalid_transition", body = WriteAnswer),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn annotate(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
    raw: Body,
) -> ApiResult<Response> {
    let caller = auth.may(Action::Operate)?;
    let b: AnnotateBody = body(&raw)?;
    Ok(written(
        &app.ledger
            .annotate(id, &caller.name, b.corrects, &b.reason)
            .await?,
    ))
}
