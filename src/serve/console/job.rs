//! The job page: the job's story in plain words (note 003), every line
//! expandable to the raw event, refused writes interleaved, each event's
//! delivery state; and the operator's actions on it (cancel, replay,
//! resolve with evidence), which redirect back to the page.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{html, Markup};

use super::{frame, Fields, PageError, PageResult, Session};
use crate::serve::App;
use jobledger::domain::digest::fmt_time;
use jobledger::domain::workflow::Membership;
use jobledger::domain::{Job, JobState};
use jobledger::ledger::timeline::{self, Delivery, StoryLine};
use jobledger::ledger::tokens::Action;
use jobledger::ledger::Found;

fn job_id(raw: &str) -> PageResult<uuid::Uuid> {
    uuid::Uuid::parse_str(raw)
        .map_err(|_| PageError::new(StatusCode::BAD_REQUEST, format!("bad job id {raw:?}")))
}

fn delivery(d: &Option<Delivery>) -> Markup {
    match d {
        Some(Delivery::Published) => html! { span.badge.published { "published" } },
        Some(Delivery::Sending) => html! { span.badge.sending { "committed, sending" } },
        Some(Delivery::NoRelay) => html! { span.badge { "committed (no relay running)" } },
        None => html! {},
    }
}

fn story_line(l: &StoryLine) -> Markup {
    let raw = serde_json::to_string_pretty(&l.raw).unwrap_or_default();
    html! {
        li class={ @if l.refused { "refused" } @else { "event" } } {
            details {
                summary {
                    time { (fmt_time(l.at)) }
                    " "
                    @if let Some(s) = &l.step { span.step { "[" (s) "] " } }
                    span.words { (l.words) }
                    " " (delivery(&l.delivery))
                }
                pre.raw { (raw) }
            }
            @for c in &l.corrections { p.correction { "↳ corrected: " (c) } }
        }
    }
}

fn facts(j: &Job) -> Markup {
    html! {
        dl.facts {
            dt { "state" } dd { span class={ "state " (j.state.as_str()) } { (j.state) } " (" (j.reason) ")" }
            dt { "queue / kind" } dd { (j.queue) " / " (j.kind) }
            dt { "key" } dd { (j.job_key.as_deref().unwrap_or("—")) }
            dt { "attempt" } dd { (j.attempt) " of " (j.policy.max_attempts) }
            dt { "epoch / token" } dd { (j.epoch) " / " (j.token) }
            dt { "version" } dd { (j.version) }
            dt { "holder" } dd { (j.holder.as_deref().unwrap_or("—")) }
            dt { "next run" } dd { (fmt_time(j.run_at)) }
        }
    }
}

fn actions(j: &Job, s: &Session) -> Markup {
    if !s.caller.role.may(Action::Operate) {
        return html! {};
    }
    let step = matches!(j.workflow, Some(Membership::Step(_)));
    let parent = matches!(j.workflow, Some(Membership::Parent { .. }));
    let form = |action: &str, inner: Markup| {
        html! {
            form.action method="post" action={ "/console/jobs/" (j.job_id) "/" (action) } {
                input type="hidden" name="csrf" value=(s.csrf);
                input type="hidden" name="version" value=(j.version);
                (inner)
            }
        }
    };
    let mut forms = vec![];
    if !j.state.is_terminal() && !parent {
        forms.push(form(
            "cancel",
            html! { label { "Reason " input name="reason"; } button { "Cancel" } },
        ));
    }
    if matches!(j.state, JobState::Dead | JobState::Cancelled) && !parent {
        forms.push(form(
            "replay",
            html! { label { "Reason " input name="reason" required; } button { "Replay" } },
        ));
    }
    if matches!(j.state, JobState::Dead | JobState::AwaitingReceipt) && !step && !parent {
        forms.push(form("resolve", html! {
            label { "Verdict " select name="verdict" { option value="succeeded" { "succeeded" } option value="cancelled" { "cancelled" } } }
            label { "Reason " input name="reason" required; }
            label { "Evidence (JSON) " textarea name="evidence" required rows="3" { } }
            button { "Resolve" }
        }));
    }
    if forms.is_empty() {
        return html! {};
    }
    html! { section.actions { h2 { "Actions" } @for f in forms { (f) } } }
}

async fn workflow_part(app: &App, j: &Job) -> PageResult<Markup> {
    Ok(match &j.workflow {
        Some(Membership::Parent { .. }) => {
            let v = app.ledger.workflow_view(j.job_id).await?;
            html! {
                section { h2 { "Steps" }
                    table.jobs { tr { th { "step" } th { "state" } th { "reason" } th { "waiting for" } }
                        @for s in &v.steps {
                            tr { td { a href={ "/console/jobs/" (s.job_id) } { (s.step) } }
                                 td { span class={ "state " (s.state.as_str()) } { (s.state) } } td { (s.reason) }
                                 td { (s.waiting_for.join(", ")) } }
                        }
                    }
                }
            }
        }
        Some(Membership::Step(l)) => html! {
            p { "Step " strong { (l.step) } " of workflow " a href={ "/console/jobs/" (l.parent) } { code { (l.parent) } } }
        },
        None => html! {},
    })
}

/// The notice after an action, from `ACTION.OUTCOME` only: a link cannot
/// make the page say anything else.
fn flash(done: &str) -> Option<String> {
    let (action, outcome) = done.split_once('.')?;
    let action = ["cancel", "replay", "resolve"]
        .into_iter()
        .find(|a| *a == action)?;
    let outcome = jobledger::domain::Outcome::parse(outcome)?;
    Some(format!("Your {action} was {outcome}"))
}

pub async fn page(
    State(app): State<App>,
    session: Session,
    Path(raw): Path<String>,
    axum::extract::RawQuery(q): axum::extract::RawQuery,
) -> PageResult<Markup> {
    session.may(Action::Read)?;
    let id = job_id(&raw)?;
    let head = match app.ledger.show(id).await? {
        Found::Live(j) => html! {
            (facts(&j))
            (workflow_part(&app, &j).await?)
            (actions(&j, &session))
        },
        Found::Purged(t) => html! {
            p.hint { "Purged at " (fmt_time(t.purged_at)) " in state " (t.state) "; its events stay in the log." }
        },
    };
    let story = timeline::story(&app.ledger, id).await?;
    let done = Fields::parse(q.unwrap_or_default().as_bytes());
    let body = html! {
        @if let Some(d) = done.get("done").and_then(flash) { p.flash { (d) } }
        (head)
        section {
            h2 { "What happened" }
            ol.story { @for l in &story { (story_line(l)) } }
        }
    };
    Ok(frame(&format!("Job {id}"), Some(&session), body))
}

pub async fn act(
    State(app): State<App>,
    session: Session,
    Path((raw, action)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> PageResult<Response> {
    let f = session.operator_form(&headers, &body)?;
    let id = job_id(&raw)?;
    let name = &session.caller.name;
    let r = match action.as_str() {
        "cancel" => {
            app.ledger
                .cancel_as(id, &format!("operator:{name}"), f.get("reason"))
                .await?
        }
        "replay" => app.ledger.replay(id, name, f.need("reason")?).await?,
        "resolve" => {
            let verdict = JobState::parse(f.need("verdict")?).ok_or_else(|| {
                PageError::new(StatusCode::BAD_REQUEST, "verdict is succeeded or cancelled")
            })?;
            let evidence: serde_json::Value = serde_json::from_str(f.need("evidence")?)
                .map_err(|e| PageError::new(StatusCode::BAD_REQUEST, format!("evidence is not JSON: {e}")))?;
            let version = f
                .need("version")?
                .parse()
                .map_err(|_| PageError::new(StatusCode::BAD_REQUEST, "bad version"))?;
            app.ledger
                .resolve(id, name, verdict, f.need("reason")?, evidence, version)
                .await?
        }
        other => {
            return Err(PageError::new(
                StatusCode::NOT_FOUND,
                format!("no action {other:?}"),
            ))
        }
    };
    if !r.committed() && r.outcome != jobledger::domain::Outcome::AlreadyCommitted {
        let why = r.detail.clone().unwrap_or_default();
        return Err(PageError::new(
            crate::serve::status_of(r.outcome),
            format!("{action} was {}: {why}", r.outcome),
        ));
    }
    let done = format!("{action}.{}", r.outcome);
    let q: String = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("done", &done)
        .finish();
    Ok(Redirect::to(&format!("/console/jobs/{id}?{q}")).into_response())
}
