//! The overview, search and dead-jobs pages.

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use serde_json::Value;
use std::collections::BTreeMap;

use super::{frame, Fields, PageError, PageResult, Session};
use crate::serve::App;
use jobledger::domain::digest::fmt_time;
use jobledger::domain::{Job, JobState};
use jobledger::ledger::search::Search;
use jobledger::ledger::tokens::Action;
use jobledger::reader::LogReader;

/// How far back the overview's "last minutes" reach.
const MINUTES: i32 = 10;

/// `key=value`, URL-encoded (a queue name may hold `&` or `#`).
fn encoded(key: &str, value: &str) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair(key, value)
        .finish()
}

fn count(v: &Value, key: &str) -> i64 {
    v[key].as_i64().unwrap_or(0)
}

pub async fn overview(State(app): State<App>, session: Session) -> PageResult<Markup> {
    session.may(Action::Read)?;
    let reader = LogReader::source(app.ledger.pool().clone());
    let projections = crate::cli::projections::status_json(&app.ledger, &reader, true).await?;
    let stats = projections.iter().find(|p| p["projection"] == "queue_stats");
    let queues = crate::cli::projections::queue_stats_rows(&app.ledger, &projections).await?;
    let readers = crate::cli::reads::readers_json(&app.ledger).await?;
    let controls: std::collections::HashMap<String, jobledger::ledger::queues::QueueStatus> = app
        .ledger
        .queue_controls()
        .await?
        .into_iter()
        .map(|q| (q.queue.clone(), q))
        .collect();
    let may_operate = session.caller.role.may(Action::Operate);
    let o = app.ledger.overview(MINUTES).await?;
    let mut per_minute: BTreeMap<DateTime<Utc>, BTreeMap<String, i64>> = BTreeMap::new();
    for (at, kind, n) in &o.per_minute {
        per_minute.entry(*at).or_default().insert(kind.clone(), *n);
    }
    let body = html! {
        section {
            h2 { "Queues" }
            @if stats.is_none() {
                p.hint { "No projection yet: start " code { "jobledger projections run" } "." }
            }
            table.queues {
                tr { th { "queue" } th { "queued" } th { "waiting" } th { "leased" } th { "cancel requested" }
                     th { "awaiting receipt" } th { "succeeded" } th { "cancelled" } th { "dead" } th { "takeovers" } th { "oldest pending since" } th { "claims" } }
                @for q in &queues {
                    tr {
                        td { a href={ "/console/search?" (encoded("queue", q["queue"].as_str().unwrap_or(""))) } { (q["queue"].as_str().unwrap_or("")) } }
                        @for k in ["queued", "waiting", "leased", "cancel_requested", "awaiting_receipt", "succeeded", "cancelled", "dead", "takeovers"] {
                            td.n { (count(q, k)) }
                        }
                        td { (q["oldest_pending_at"].as_str().unwrap_or("—")) }
                        td { (queue_control(q["queue"].as_str().unwrap_or(""), controls.get(q["queue"].as_str().unwrap_or("")), may_operate, &session.csrf)) }
                    }
                }
                // A paused queue without jobs (yet) still shows, to be resumed.
                @for (name, c) in &controls {
                    @if !queues.iter().any(|q| q["queue"].as_str() == Some(name.as_str())) {
                        tr {
                            td { (name) }
                            @for _ in 0..9 { td.n { "—" } }
                            td { "—" }
                            td { (queue_control(name, Some(c), may_operate, &session.csrf)) }
                        }
                    }
                }
            }
        }
        section {
            h2 { "The last " (MINUTES) " minutes" }
            table.minutes {
                tr { th { "minute" } th { "claimed" } th { "taken over" } th { "succeeded" } th { "failed" } th { "cancelled" } }
                @for (at, kinds) in &per_minute {
                    tr {
                        td { (fmt_time(*at)) }
                        @for k in ["claimed", "taken_over", "succeeded", "failed", "cancelled"] {
                            td.n { (kinds.get(k).copied().unwrap_or(0)) }
                        }
                    }
                }
            }
            p { "Refused writes: "
                @if o.refused.is_empty() { "none" }
                @for (outcome, n) in &o.refused { span.badge { (outcome) " " (n) } " " }
            }
        }
        section {
            h2 { "Dead jobs by reason" }
            ul {
                @for (reason, n) in &o.dead_by_reason {
                    li { a href={ "/console/dead?" (encoded("reason", reason)) } { (reason) } " — " (n) }
                }
                @if o.dead_by_reason.is_empty() { li { "none" } }
            }
        }
        section {
            h2 { "Relay and projections" }
            table.lag {
                tr { th { "reader" } th { "behind (events)" } th { "behind (s)" } th { "horizon held by" } }
                @for r in &readers {
                    tr { td { (r["reader"].as_str().unwrap_or("")) } td.n { (count(r, "lag_events")) }
                         td.n { (r["lag_seconds"].as_f64().map_or("—".into(), |s| format!("{s:.1}"))) }
                         td { (r["horizon_held_by"].to_string()) } }
                }
                @for p in &projections {
                    tr { td { "projection " (p["projection"].as_str().unwrap_or("")) } td.n { (count(p, "lag_events")) }
                         td.n { (p["lag_seconds"].as_f64().map_or("—".into(), |s| format!("{s:.1}"))) }
                         td { @if p["rebuild_table"].is_string() { "rebuilding: " (count(p, "rebuild_remaining_events")) " events left" } } }
                }
            }
        }
    };
    Ok(frame("Overview", Some(&session), body))
}

/// A queue's claim state, with the form that pauses or resumes it.
fn queue_control(
    queue: &str,
    c: Option<&jobledger::ledger::queues::QueueStatus>,
    may: bool,
    csrf: &str,
) -> Markup {
    let paused = c.is_some_and(|c| c.paused);
    let action = if paused { "resume" } else { "pause" };
    html! {
        @if let Some(c) = c.filter(|c| c.paused) {
            span.badge.sending title=(c.reason.as_deref().unwrap_or("")) {
                "paused by " (c.paused_by.as_deref().unwrap_or("")) " since " (c.paused_at.map(fmt_time).unwrap_or_default())
            }
        } @else { span.badge.published { "claiming" } }
        @if may {
            form.inline method="post" action={ "/console/queues/" (encoded_path(queue)) "/" (action) } {
                input type="hidden" name="csrf" value=(csrf);
                input name="reason" required placeholder="why" aria-label={ "why " (action) };
                button { @if paused { "Resume" } @else { "Pause" } }
            }
        }
    }
}

/// One path segment, percent-encoded (a form encoder would write a space
/// as `+`, which a path keeps as a plus: another queue).
fn encoded_path(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Pauses or resumes a queue from the overview, then shows the overview.
pub async fn control_queue(
    State(app): State<App>,
    session: Session,
    axum::extract::Path((queue, action)): axum::extract::Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> PageResult<Response> {
    let f = session.operator_form(&headers, &body)?;
    let reason = f.need("reason")?;
    let actor = format!("operator:{}", session.caller.name);
    match action.as_str() {
        "pause" => app.ledger.pause_queue(&queue, &actor, reason).await?,
        "resume" => app.ledger.resume_queue(&queue, &actor, reason).await?,
        other => {
            return Err(PageError::new(
                StatusCode::NOT_FOUND,
                format!("no action {other:?}"),
            ))
        }
    };
    Ok(Redirect::to("/console").into_response())
}

fn time_field(f: &Fields, key: &str) -> PageResult<Option<DateTime<Utc>>> {
    f.get(key)
        .map(|t| {
            DateTime::parse_from_rfc3339(t)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| {
                    PageError::new(
                        StatusCode::BAD_REQUEST,
                        format!("{key}: {t:?} is not an RFC 3339 time"),
                    )
                })
        })
        .transpose()
}

fn search_of(f: &Fields) -> PageResult<Search> {
    Ok(Search {
        queue: f.get("queue").map(Into::into),
        kind: f.get("kind").map(Into::into),
        states: f
            .get("state")
            .map(|s| s.split(',').map(|s| s.trim().to_string()).collect())
            .unwrap_or_default(),
        key: f.get("key").map(Into::into),
        reason: f.get("reason").map(Into::into),
        since: time_field(f, "since")?,
        until: time_field(f, "until")?,
        cursor: f.get("cursor").map(Into::into),
        limit: Some(50),
    })
}

fn jobs_table(jobs: &[Job], select: Option<&str>) -> Markup {
    html! {
        table.jobs {
            tr { @if select.is_some() { th {} } th { "job" } th { "queue" } th { "kind" } th { "key" } th { "state" }
                 th { "reason" } th { "attempt" } th { "enqueued" } th { "updated" } }
            @for j in jobs {
                tr {
                    @if let Some(name) = select { td { input type="checkbox" name=(name) value=(j.job_id) aria-label="select"; } }
                    td { a href={ "/console/jobs/" (j.job_id) } { code { (j.job_id) } } }
                    td { (j.queue) } td { (j.kind) } td { (j.job_key.as_deref().unwrap_or("")) }
                    td { span class={ "state " (j.state.as_str()) } { (j.state) } }
                    td { (j.reason) } td.n { (j.attempt) }
                    td { (fmt_time(j.created_at)) } td { (fmt_time(j.updated_at)) }
                }
            }
        }
    }
}

/// The link to the next page: the same query with the cursor replaced.
fn next_link(path: &str, f: &Fields, next: &Option<String>) -> Markup {
    let Some(c) = next else { return html! {} };
    let mut q = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in f.0.iter().filter(|(k, _)| k != "cursor") {
        q.append_pair(k, v);
    }
    q.append_pair("cursor", c);
    html! { p { a.next href={ (path) "?" (q.finish()) } { "Older →" } } }
}

fn filter_form(f: &Fields, action: &str, fields: &[&str]) -> Markup {
    html! {
        form.filters method="get" action=(action) {
            @for k in fields {
                label { (k) " " input name=(k) value=(f.get(k).unwrap_or("")); }
            }
            button { "Filter" }
        }
    }
}

pub async fn search(State(app): State<App>, session: Session, RawQuery(q): RawQuery) -> PageResult<Response> {
    session.may(Action::Read)?;
    let f = Fields::parse(q.unwrap_or_default().as_bytes());
    if let Some(q) = f.get("q") {
        // A job id pasted anywhere opens the job; anything else is a key.
        if let Ok(id) = uuid::Uuid::parse_str(q) {
            return Ok(Redirect::to(&format!("/console/jobs/{id}")).into_response());
        }
    }
    let mut s = search_of(&f)?;
    if let (Some(q), None) = (f.get("q"), &s.key) {
        s.key = Some(q.to_string());
        if s.queue.is_none() {
            return Err(PageError::new(
                StatusCode::BAD_REQUEST,
                format!("{q:?} is no job id; to find a key, give its queue too"),
            ));
        }
    }
    let page = app.ledger.search(&s).await?;
    let body = html! {
        (filter_form(&f, "/console/search", &["queue", "kind", "state", "key", "reason", "since", "until"]))
        p.hint { (page.jobs.len()) " job(s), newest first." }
        (jobs_table(&page.jobs, None))
        (next_link("/console/search", &f, &page.next))
    };
    Ok(frame("Search", Some(&session), body).into_response())
}

pub async fn dead(State(app): State<App>, session: Session, RawQuery(q): RawQuery) -> PageResult<Markup> {
    session.may(Action::Read)?;
    let f = Fields::parse(q.unwrap_or_default().as_bytes());
    let mut s = search_of(&f)?;
    s.states = vec![JobState::Dead.as_str().into()];
    let page = app.ledger.search(&s).await?;
    let may_replay = session.caller.role.may(Action::Operate);
    let body = html! {
        (filter_form(&f, "/console/dead", &["queue", "kind", "reason", "since", "until"]))
        // A reader sees the list, without the form.
        @if may_replay {
            form method="post" action="/console/dead/replay" {
                input type="hidden" name="csrf" value=(session.csrf);
                (jobs_table(&page.jobs, Some("job")))
                @if !page.jobs.is_empty() {
                    p.actions {
                        label { "Reason " input name="reason" required placeholder="why replay them"; }
                        button name="go" value="replay" { "Replay selected" }
                    }
                }
            }
        } @else {
            (jobs_table(&page.jobs, None))
        }
        (next_link("/console/dead", &f, &page.next))
    };
    Ok(frame("Dead jobs", Some(&session), body))
}

pub async fn replay_selected(
    State(app): State<App>,
    session: Session,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> PageResult<Response> {
    let f = session.operator_form(&headers, &body)?;
    let reason = f.need("reason")?;
    let ids = f
        .all("job")
        .into_iter()
        .map(|s| {
            uuid::Uuid::parse_str(s)
                .map_err(|_| PageError::new(StatusCode::BAD_REQUEST, format!("bad job id {s:?}")))
        })
        .collect::<PageResult<Vec<_>>>()?;
    if ids.is_empty() {
        return Err(PageError::new(StatusCode::BAD_REQUEST, "select at least one job"));
    }
    // Job by job, like `/v1/replays`: one that is gone (purged since the
    // page was drawn) is reported and the others still replay.
    let mut results = vec![];
    for id in ids {
        let answer = match app.ledger.replay(id, &session.caller.name, reason).await {
            Ok(r) => match &r.detail {
                Some(d) => format!("{} ({d})", r.outcome),
                None => r.outcome.to_string(),
            },
            Err(jobledger::ledger::LedgerError::NotFound(_)) => "not found (purged?)".to_string(),
            Err(e) => return Err(e.into()),
        };
        results.push((id, answer));
    }
    let body = html! {
        p { "Replayed " (results.len()) " job(s):" }
        ul.results {
            @for (id, r) in &results {
                li { a href={ "/console/jobs/" (id) } { code { (id) } } " — " (r) }
            }
        }
        p { a href="/console/dead" { "Back to the dead jobs" } }
    };
    Ok(frame("Replayed", Some(&session), body).into_response())
}
