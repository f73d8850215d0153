//! The operator's console: server-rendered pages (maud, escaped by
//! construction), one stylesheet embedded in the binary, no script build.
//! A thin adapter like the JSON API: the same ledger calls, rendered as HTML.
//!
//! Sign-in: the browser posts an API token once; it is kept in an
//! `HttpOnly`, `SameSite=Strict` cookie scoped to `/console`, and each
//! request is authenticated with it like a bearer token (revoking the
//! token signs the browser out). Cross-site requests: every form carries a
//! CSRF value derived from the session's token (SHA-256 of a fixed label
//! and the token, so another site can neither read nor compute it), and a
//! write whose `Origin` names another host is refused as well.

mod job;
mod pages;

use axum::extract::{FromRequestParts, State};
use axum::http::{header, request::Parts, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::{html, Markup, DOCTYPE};
use sha2::{Digest, Sha256};

use super::App;
use jobledger::ledger::tokens::{Action, Caller};

const COOKIE: &str = "jl_session";
const STYLE: &str = include_str!("style.css");

pub fn router() -> Router<App> {
    Router::new()
        .route("/console", get(pages::overview))
        .route("/console/", get(|| async { Redirect::to("/console") }))
        .route("/console/style.css", get(style))
        .route("/console/login", get(login_page).post(login))
        .route("/console/logout", post(logout))
        .route("/console/search", get(pages::search))
        .route("/console/dead", get(pages::dead))
        .route("/console/dead/replay", post(pages::replay_selected))
        .route("/console/queues/{queue}/{action}", post(pages::control_queue))
        .route("/console/jobs/{id}", get(job::page))
        .route("/console/jobs/{id}/{action}", post(job::act))
}

async fn style() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE).into_response()
}

/// A console page's failure, shown as a page with its status.
pub struct PageError(StatusCode, String);

impl PageError {
    pub fn new(status: StatusCode, why: impl Into<String>) -> Self {
        PageError(status, why.into())
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let body = frame(
            "Error",
            None,
            html! { p.error { (self.0.as_u16()) " — " (self.1) } p { a href="/console" { "Back to the overview" } } },
        );
        (self.0, body).into_response()
    }
}

impl From<jobledger::ledger::LedgerError> for PageError {
    fn from(e: jobledger::ledger::LedgerError) -> Self {
        let api: super::ApiError = e.into();
        PageError(api.0, api.1)
    }
}

impl From<anyhow::Error> for PageError {
    fn from(e: anyhow::Error) -> Self {
        tracing::error!("console: {e:#}");
        PageError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error (logged)".into(),
        )
    }
}

pub type PageResult<T = Response> = Result<T, PageError>;

/// The signed-in operator (or reader) behind the session cookie. Without a
/// valid one, a page redirects to the sign-in form.
pub struct Session {
    pub caller: Caller,
    /// The value every form of this session must carry back.
    pub csrf: String,
}

fn csrf_of(token: &str) -> String {
    hex::encode(Sha256::digest(format!("jobledger-console-csrf\0{token}")))
}

fn cookie_token(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
}

impl FromRequestParts<App> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, app: &App) -> Result<Self, Self::Rejection> {
        let to_login = || Redirect::to("/console/login").into_response();
        let token = cookie_token(&parts.headers).ok_or_else(to_login)?;
        match app.ledger.authenticate(&token).await {
            Ok(Some(caller)) => Ok(Session {
                caller,
                csrf: csrf_of(&token),
            }),
            Ok(None) => Err(to_login()),
            Err(e) => Err(PageError::from(e).into_response()),
        }
    }
}

impl Session {
    pub fn may(&self, action: Action) -> PageResult<()> {
        if self.caller.role.may(action) {
            return Ok(());
        }
        Err(PageError::new(
            StatusCode::FORBIDDEN,
            format!(
                "{} has role {}, which may not do this",
                self.caller.name,
                self.caller.role.as_str()
            ),
        ))
    }

    /// An operator's form: the role, then the form's CSRF value and the
    /// request's origin; the parsed form when all hold.
    pub fn operator_form(&self, headers: &HeaderMap, body: &[u8]) -> PageResult<Fields> {
        self.may(Action::Operate)?;
        let f = Fields::parse(body);
        self.check_write(headers, &f)?;
        Ok(f)
    }

    /// Checks a form's CSRF value and the request's origin (a write).
    pub fn check_write(&self, headers: &HeaderMap, form: &Fields) -> PageResult<()> {
        let forbidden = |why: &str| PageError::new(StatusCode::FORBIDDEN, why);
        if form.get("csrf") != Some(self.csrf.as_str()) {
            return Err(forbidden(
                "this form did not come from this console (CSRF check failed)",
            ));
        }
        same_origin(headers)
    }
}

/// A URL-encoded form body or query string, repeated keys kept.
pub struct Fields(Vec<(String, String)>);

impl Fields {
    pub fn parse(raw: &[u8]) -> Self {
        Fields(url::form_urlencoded::parse(raw).into_owned().collect())
    }

    /// The first non-empty value of `key`, trimmed.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.trim())
            .find(|v| !v.is_empty())
    }

    pub fn all(&self, key: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn need(&self, key: &str) -> PageResult<&str> {
        self.get(key)
            .ok_or_else(|| PageError::new(StatusCode::BAD_REQUEST, format!("the form needs {key}")))
    }
}

/// Every page's frame: the stylesheet, the navigation, and a box where a
/// pasted job id opens the job.
pub fn frame(title: &str, session: Option<&Session>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " — jobledger" }
                link rel="stylesheet" href="/console/style.css";
            }
            body {
                header {
                    a.brand href="/console" { "jobledger" }
                    nav {
                        a href="/console" { "Overview" }
                        a href="/console/search" { "Search" }
                        a href="/console/dead" { "Dead jobs" }
                    }
                    form.find method="get" action="/console/search" {
                        input name="q" placeholder="job id, or search…" aria-label="Find a job";
                    }
                    @if let Some(s) = session {
                        form.who method="post" action="/console/logout" {
                            span { (s.caller.name) " (" (s.caller.role.as_str()) ")" }
                            input type="hidden" name="csrf" value=(s.csrf);
                            button { "Sign out" }
                        }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

async fn login_page() -> Markup {
    frame(
        "Sign in",
        None,
        html! {
            form.card method="post" action="/console/login" {
                label { "API token " input type="password" name="token" autocomplete="off" required; }
                button { "Sign in" }
            }
            p.hint { "Create one with " code { "jobledger token create --role operator --name NAME" } "." }
        },
    )
}

async fn login(State(app): State<App>, headers: HeaderMap, body: axum::body::Bytes) -> PageResult {
    let form = Fields::parse(&body);
    // No session yet, so no CSRF value: another site's sign-in form (which
    // would sign the browser in as the attacker) is refused by its origin.
    same_origin(&headers)?;
    let token = form.need("token")?;
    if app.ledger.authenticate(token).await?.is_none() {
        return Err(PageError::new(
            StatusCode::UNAUTHORIZED,
            "unknown or revoked token",
        ));
    }
    let cookie = format!("{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/console");
    Ok(([(header::SET_COOKIE, cookie)], Redirect::to("/console")).into_response())
}

async fn logout(session: Session, headers: HeaderMap, body: axum::body::Bytes) -> PageResult {
    session.check_write(&headers, &Fields::parse(&body))?;
    let cookie = format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/console; Max-Age=0");
    Ok(([(header::SET_COOKIE, cookie)], Redirect::to("/console/login")).into_response())
}

/// A request whose `Origin` names another host:port is refused. The scheme
/// is not compared: behind a TLS proxy the browser says `https://` for the
/// very host this server answers as plain HTTP.
fn same_origin(headers: &HeaderMap) -> PageResult<()> {
    if let (Some(origin), Some(host)) = (headers.get(header::ORIGIN), headers.get(header::HOST)) {
        let origin = origin.to_str().unwrap_or("");
        let host = host.to_str().unwrap_or("");
        let bare = origin.split_once("://").map_or(origin, |(_, rest)| rest);
        if bare != host {
            return Err(PageError::new(
                StatusCode::FORBIDDEN,
                "a request from another site",
            ));
        }
    }
    Ok(())
}
