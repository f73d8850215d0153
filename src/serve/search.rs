//! `GET /v1/jobs`: job search, newest first, cursor-paginated.

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, ApiResult, App, Authed, ErrorBody};
use crate::cli::output::JobSummary;
use jobledger::ledger::search::Search;
use jobledger::ledger::tokens::Action;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SearchQuery {
    queue: Option<String>,
    kind: Option<String>,
    /// One state or several, comma-separated (`dead,cancelled`).
    state: Option<String>,
    /// A job key; needs `queue` (keys are unique per queue).
    key: Option<String>,
    /// A reason code (`attempts_exhausted`, `cancelled_by_operator`, ...).
    reason: Option<String>,
    /// Enqueued at or after (RFC 3339).
    since: Option<DateTime<Utc>>,
    /// Enqueued before (RFC 3339).
    until: Option<DateTime<Utc>>,
    /// The previous page's `next`.
    cursor: Option<String>,
    /// 1 to 500, default 50.
    limit: Option<i64>,
}

#[derive(Serialize, ToSchema)]
pub struct SearchPage {
    /// Newest first (by enqueue time, then id).
    jobs: Vec<JobSummary>,
    /// Pass as `cursor` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<String>,
}

/// Jobs by queue, kind, state, key, reason code and enqueue time.
#[utoipa::path(get, path = "/v1/jobs", tag = "jobs", params(SearchQuery),
    responses((status = 200, body = SearchPage), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn search(
    State(app): State<App>,
    auth: Authed,
    q: Result<Query<SearchQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<SearchPage>> {
    auth.may(Action::Read)?;
    let Query(q) = q.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.body_text()))?;
    let states = q
        .state
        .map(|s| s.split(',').map(|s| s.trim().to_string()).collect())
        .unwrap_or_default();
    let page = app
        .ledger
        .search(&Search {
            queue: q.queue,
            kind: q.kind,
            states,
            key: q.key,
            reason: q.reason,
            since: q.since,
            until: q.until,
            cursor: q.cursor,
            limit: q.limit,
        })
        .await?;
    Ok(Json(SearchPage {
        jobs: page.jobs.iter().map(JobSummary::from).collect(),
        next: page.next,
    }))
}
