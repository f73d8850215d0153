//! `jobledger serve`: the HTTP front door (JSON under `/v1`). A thin adapter
//! like the CLI: parse the request, check the caller's token and role, call
//! the ledger, render; the same operations and the same five write outcomes.
//! Statuses (docs/http.md): committed and already_committed 200 (an enqueue
//! that created its job 201); stale and conflict 409; invalid_transition
//! 422; bad input 400; over the payload limit 413; no or unknown token 401;
//! a role without the right 403; unknown job 404. A stale or conflicting
//! write is never a 5xx and never a 200.

mod batches;
mod console;
mod jobs;
mod openapi;
mod search;
mod status;
mod work;

use axum::extract::{DefaultBodyLimit, FromRequestParts};
use axum::http::{request::Parts, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use jobledger::domain::Outcome;
use jobledger::ledger::tokens::{Action, Caller};
use jobledger::ledger::{Ledger, LedgerError, WriteResult};

/// A refusal with its status and a one-line reason.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl ApiError {
    fn new(status: StatusCode, why: impl Into<String>) -> Self {
        ApiError(status, why.into())
    }
}

/// Every refusal's body: one line saying why.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    error: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
        let status = match &e {
            LedgerError::BadInput(_) => StatusCode::BAD_REQUEST,
            LedgerError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            LedgerError::KeyConflict { .. } => StatusCode::CONFLICT,
            LedgerError::NotFound(_) => StatusCode::NOT_FOUND,
            LedgerError::LogReplaced(_) => StatusCode::SERVICE_UNAVAILABLE,
            // Text PostgreSQL cannot store (U+0000) that slipped past the
            // checks: the client's input, so a 400, never a 500.
            LedgerError::Store(s) if s.sqlstate().as_deref() == Some("22021") => {
                return ApiError::new(StatusCode::BAD_REQUEST, "the request holds a U+0000 character");
            }
            // A time chrono parses but PostgreSQL cannot hold (before 4713 BC).
            LedgerError::Store(s) if s.sqlstate().as_deref() == Some("22008") => {
                return ApiError::new(StatusCode::BAD_REQUEST, "a time is out of range");
            }
            _ => {
                tracing::error!("request failed: {e}");
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error (logged)");
            }
        };
        ApiError::new(status, e.to_string())
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// A write's answer: the status says the outcome, the body is the CLI's.
fn written(r: &WriteResult) -> Response {
    (status_of(r.outcome), Json(crate::cli::output::write_json(r))).into_response()
}

fn status_of(o: Outcome) -> StatusCode {
    match o {
        Outcome::Committed | Outcome::AlreadyCommitted => StatusCode::OK,
        Outcome::Stale | Outcome::Conflict => StatusCode::CONFLICT,
        Outcome::InvalidTransition => StatusCode::UNPROCESSABLE_ENTITY,
    }
}

#[derive(Clone)]
struct App {
    ledger: Ledger,
    max_body: usize,
}

/// A request's body within the limit; over it, 413 with a one-line reason
/// in JSON like every other refusal (axum's own is plain text).
pub struct Body(pub axum::body::Bytes);

impl<S: Send + Sync> axum::extract::FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => Ok(Body(b)),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "the request body is over the payload limit",
            )),
            Err(e) => Err(ApiError::new(StatusCode::BAD_REQUEST, e.body_text())),
        }
    }
}

/// The `{id}` of a job route, as a job id; anything else is a 400 in JSON.
pub struct JobPath(pub uuid::Uuid);

impl<S: Send + Sync> FromRequestParts<S> for JobPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Path(raw) = axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.body_text()))?;
        uuid::Uuid::parse_str(&raw)
            .map(JobPath)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("bad job id {raw:?}: {e}")))
    }
}

/// The caller behind `Authorization: Bearer <token>`.
struct Authed(Caller);

impl Authed {
    fn may(&self, action: Action) -> ApiResult<&Caller> {
        if self.0.role.may(action) {
            Ok(&self.0)
        } else {
            Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "token {:?} has role {}, which may not do this",
                    self.0.name,
                    self.0.role.as_str()
                ),
            ))
        }
    }
}

impl FromRequestParts<App> for Authed {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &App) -> Result<Self, Self::Rejection> {
        let unauthorized = |why: &str| ApiError::new(StatusCode::UNAUTHORIZED, why);
        let mut headers = parts.headers.get_all(axum::http::header::AUTHORIZATION).iter();
        let header = headers
            .next()
            .ok_or_else(|| unauthorized("no bearer token (Authorization: Bearer …)"))?;
        if headers.next().is_some() {
            return Err(unauthorized("more than one Authorization header"));
        }
        let header = header
            .to_str()
            .map_err(|_| unauthorized("the Authorization header is not ASCII"))?;
        // The scheme is case-insensitive (RFC 9110, 11.1).
        let token = match header.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
            _ => return Err(unauthorized("the Authorization header is not Bearer")),
        };
        match app.ledger.authenticate(token).await? {
            Some(c) => Ok(Authed(c)),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unknown or revoked token",
            )),
        }
    }
}

/// The API's routes and its OpenAPI document, from the same list: a route
/// cannot be served without being documented, nor documented unserved.
fn api() -> (Router<App>, utoipa::openapi::OpenApi) {
    use utoipa_axum::{router::OpenApiRouter, routes};
    OpenApiRouter::with_openapi(openapi::info())
        .routes(routes!(jobs::enqueue, search::search))
        .routes(routes!(jobs::show))
        .routes(routes!(jobs::history))
        .routes(routes!(jobs::cancel))
        .routes(routes!(jobs::replay))
        .routes(routes!(jobs::resolve))
        .routes(routes!(jobs::annotate))
        .routes(routes!(batches::enqueue_batch))
        .routes(routes!(batches::create_workflow))
        .routes(routes!(batches::show_workflow))
        .routes(routes!(batches::cancel_workflow))
        .routes(routes!(batches::replay_batch))
        .routes(routes!(status::queues))
        .routes(routes!(status::pause))
        .routes(routes!(status::resume))
        .routes(routes!(status::readers))
        .routes(routes!(status::projections))
        .routes(routes!(status::rebuild))
        .routes(routes!(work::claim))
        .routes(routes!(work::heartbeat))
        .routes(routes!(work::progress))
        .routes(routes!(work::complete))
        .routes(routes!(work::fail))
        .routes(routes!(work::submit))
        .routes(routes!(work::confirm_cancel))
        .routes(routes!(work::release))
        .routes(routes!(work::snooze))
        .routes(routes!(work::observe))
        .routes(routes!(work::receipt))
        .routes(routes!(work::complete_batch))
        .routes(routes!(work::heartbeat_batch))
        .split_for_parts()
}

fn router(app: App) -> Router {
    // The limit on a whole body: the largest payload plus room for the rest
    // of the request; the ledger still checks each payload exactly.
    let limit = app.max_body + 64 * 1024;
    let (routes, doc) = api();
    let doc = std::sync::Arc::new(doc);
    routes
        .route(
            "/v1/openapi.json",
            get(move || async move { Json(doc.as_ref().clone()) }),
        )
        .merge(console::router())
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "this route does not take that method",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(traced))
        .with_state(app)
}

/// With tracing on, each request is a span that continues the caller's
/// trace (its `traceparent` header): a job enqueued here joins the trace
/// of the service that asked for it. A malformed header starts a new trace.
async fn traced(req: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use tracing::Instrument;
    if !jobledger::telemetry::enabled() {
        return next.run(req).await;
    }
    // The route's pattern, never the raw path: a client must not be able to
    // mint a span name per request.
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let name = format!("{} {route}", req.method());
    let span = tracing::info_span!("request", otel.name = %name, otel.kind = "server", http.route = %route);
    // Exactly one header, or none is continued (W3C: duplicates are invalid).
    let mut all = req.headers().get_all(jobledger::telemetry::TRACEPARENT).iter();
    let parent = match (all.next(), all.next()) {
        (Some(v), None) => v.to_str().ok(),
        _ => None,
    };
    jobledger::telemetry::adopt(&span, parent);
    next.run(req).instrument(span).await
}

/// Serves until `stop` (SIGTERM / Ctrl-C), then drains open requests for at
/// most `drain`. Prints `{"listening": ADDR}` once bound.
pub async fn serve(
    ledger: Ledger,
    listen: std::net::SocketAddr,
    max_body: usize,
    stop: CancellationToken,
    drain: Duration,
) -> anyhow::Result<()> {
    if !listen.ip().is_loopback() {
        tracing::warn!("serving on {listen}, not a loopback address: put TLS in front of it");
    }
    let listener = tokio::net::TcpListener::bind(listen).await?;
    crate::cli::output::line(&json!({ "listening": listener.local_addr()?.to_string() }));
    serve_on(listener, ledger, max_body, stop, drain).await
}

/// `serve` on a listener the caller bound (the bench binds its own port).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    ledger: Ledger,
    max_body: usize,
    stop: CancellationToken,
    drain: Duration,
) -> anyhow::Result<()> {
    let app = router(App { ledger, max_body });
    let graceful = {
        let stop = stop.clone();
        async move { stop.cancelled().await }
    };
    let server =
        tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(graceful).await });
    stop.cancelled().await;
    match tokio::time::timeout(drain, server).await {
        Ok(r) => r??,
        Err(_) => tracing::warn!("requests still open after {drain:?}: stopping anyway"),
    }
    Ok(())
}
