//! What the system is doing: queues (from the `queue_stats` projection),
//! the log readers' lag, and the projections (status and rebuild).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::{ApiError, ApiResult, App, Authed, ErrorBody};
use jobledger::ledger::tokens::Action;
use jobledger::ledger::LedgerError;
use jobledger::reader::LogReader;

/// The CLI's helpers answer `anyhow`: a bad input stays a 400, the rest is
/// the server's own failure.
fn internal(e: anyhow::Error) -> ApiError {
    if let Some(b) = e.downcast_ref::<crate::cli::output::BadInput>() {
        return ApiError::new(StatusCode::BAD_REQUEST, b.0.clone());
    }
    // A rebuild this server's code may not start now (a newer version's is
    // under way, or a newer version serves): the projection's state, not
    // the server's failure.
    use jobledger_projections::ProjectionError as P;
    if let Some(p @ (P::NewerRebuild { .. } | P::OlderThanServing { .. })) = e.downcast_ref::<P>() {
        return ApiError::new(StatusCode::CONFLICT, p.to_string());
    }
    match e.downcast::<LedgerError>() {
        Ok(l) => l.into(),
        Err(e) => {
            tracing::error!("request failed: {e:#}");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error (logged)")
        }
    }
}

/// Per queue: jobs by state, takeovers and the oldest pending job, as the
/// `queue_stats` projection has them, with how far behind the log it is.
#[utoipa::path(get, path = "/v1/queues", tag = "status",
    responses((status = 200, body = serde_json::Value), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn queues(State(app): State<App>, auth: Authed) -> ApiResult<Json<Value>> {
    auth.may(Action::Read)?;
    let reader = LogReader::source(app.ledger.pool().clone());
    let status = crate::cli::projections::status_json(&app.ledger, &reader, true)
        .await
        .map_err(internal)?;
    let rows = crate::cli::projections::queue_stats_rows(&app.ledger, &status)
        .await
        .map_err(internal)?;
    let freshness = status
        .into_iter()
        .find(|v| v["projection"] == "queue_stats")
        .unwrap_or(Value::Null);
    let controls = app.ledger.queue_controls().await?;
    Ok(Json(
        json!({ "queues": rows, "projection": freshness, "controls": controls }),
    ))
}

/// Every named log reader (relay, consumers): checkpoint, lag in events
/// and seconds, and which transaction holds the log horizon back.
#[utoipa::path(get, path = "/v1/readers", tag = "status",
    responses((status = 200, body = serde_json::Value), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn readers(State(app): State<App>, auth: Authed) -> ApiResult<Json<Value>> {
    auth.may(Action::Read)?;
    let readers = crate::cli::reads::readers_json(&app.ledger)
        .await
        .map_err(internal)?;
    Ok(Json(json!({ "readers": readers })))
}

/// Each projection: version, serving table, checkpoint, lag, and a rebuild
/// in progress with what it has left.
#[utoipa::path(get, path = "/v1/projections", tag = "status",
    responses((status = 200, body = serde_json::Value), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn projections(State(app): State<App>, auth: Authed) -> ApiResult<Json<Value>> {
    auth.may(Action::Read)?;
    let reader = LogReader::source(app.ledger.pool().clone());
    let status = crate::cli::projections::status_json(&app.ledger, &reader, true)
        .await
        .map_err(internal)?;
    Ok(Json(json!({ "projections": status })))
}

/// Starts rebuilding a projection from position 0 into a fresh table while
/// the serving one keeps serving; the projections service (`jobledger
/// projections run`) carries it on and switches when it has caught up.
/// Follow it on `GET /v1/projections`.
#[utoipa::path(post, path = "/v1/projections/{name}/rebuild", tag = "status",
    params(("name" = String, Path, description = "job_timeline, queue_stats, jobs_rebuilt or workflows")),
    responses((status = 202, body = serde_json::Value), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 409, description = "a newer version serves, or its rebuild is under way", body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn rebuild(State(app): State<App>, auth: Authed, Path(name): Path<String>) -> ApiResult<Response> {
    auth.may(Action::Administer)?;
    // The projections' boxed futures are not provably `Send` for every
    // lifetime (rustc's higher-ranked auto-trait limitation), which an axum
    // handler must be: start the rebuild on a blocking thread instead. It
    // is one short transaction.
    let ledger = app.ledger.clone();
    let n = name.clone();
    let rt = tokio::runtime::Handle::current();
    let table =
        tokio::task::spawn_blocking(move || rt.block_on(crate::cli::projections::start_rebuild(&ledger, &n)))
            .await
            .map_err(|e| internal(e.into()))?
            .map_err(internal)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "projection": name, "rebuild_table": table })),
    )
        .into_response())
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QueueControlBody {
    /// Why (recorded with the token's name).
    reason: String,
}

/// One route per control, each documented.
macro_rules! queue_control {
    ($($name:ident => $path:tt, $method:ident, $summary:tt;)+) => {$(
        #[doc = $summary]
        #[utoipa::path(post, path = $path, tag = "operator",
            params(("queue" = String, Path, description = "The queue")),
            request_body = QueueControlBody,
            responses((status = 200, description = "`changed: false` when there was nothing to do", body = serde_json::Value),
                (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
                (status = 413, body = ErrorBody)),
            security(("bearer" = [])))]
        pub async fn $name(
            State(app): State<App>,
            auth: Authed,
            Path(queue): Path<String>,
            raw: super::Body,
        ) -> ApiResult<Json<Value>> {
            let caller = auth.may(Action::Operate)?;
            let b: QueueControlBody = super::jobs::body(&raw)?;
            let actor = format!("operator:{}", caller.name);
            let change = app.ledger.$method(&queue, &actor, &b.reason).await?;
            Ok(Json(serde_json::to_value(change).expect("plain data")))
        }
    )+};
}

queue_control! {
    pause => "/v1/queues/{queue}/pause", pause_queue,
        "Pauses a queue: nothing more is claimed from it; running jobs go on.";
    resume => "/v1/queues/{queue}/resume", resume_queue, "Resumes a paused queue.";
}
