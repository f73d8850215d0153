//! The remote worker protocol: claim, then write through the fence exactly
//! as a `Lease` does in the library (heartbeat, progress, complete, fail,
//! submit, confirm-cancel, release, snooze), one job or a batch at a time.
//! The fence `(epoch, token)` decides whether a write counts; the log
//! records the holder as `TOKEN/WORKER`, so an auditor can tell which
//! credential and which process wrote. A worker learns that an operator
//! asked for a cancel from any write's answer: `state: cancel_requested`.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::Duration;
use utoipa::ToSchema;
use uuid::Uuid;

use super::jobs::body;
use super::{written, ApiError, ApiResult, App, Authed, Body, ErrorBody, JobPath};
use crate::cli::output::{LeaseGrant, WriteAnswer};
use jobledger::domain::{ErrorClass, ReceiptStatus};
use jobledger::ledger::tokens::Action;
use jobledger::ledger::Lease;

/// Claims and batches take at most this many jobs per request.
const MAX_BATCH: usize = 1000;

fn default_lease_ms() -> u64 {
    30_000
}
fn one() -> usize {
    1
}

/// The holder the log records: which token, which worker process.
fn holder(app: &App, auth: &Authed, worker: &str) -> ApiResult<String> {
    let caller = auth.may(Action::Work)?;
    app.ledger.limits().name("worker", worker)?;
    Ok(format!("{}/{}", caller.name, worker))
}

fn lease(app: &App, auth: &Authed, job: Uuid, f: &Fenced) -> ApiResult<Lease> {
    Ok(Lease::resume(
        app.ledger.clone(),
        job,
        f.epoch,
        f.token,
        holder(app, auth, &f.worker)?,
    ))
}

fn batch_size(n: usize) -> ApiResult<()> {
    if n > MAX_BATCH {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("{n} items: a batch takes at most {MAX_BATCH}"),
        ));
    }
    Ok(())
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    /// This worker process's name (the log records `TOKEN/WORKER`).
    worker: String,
    /// How long the lease lasts unless extended (default 30,000).
    #[serde(default = "default_lease_ms")]
    lease_ms: u64,
    /// How many jobs at most (default 1, at most 1,000).
    #[serde(default = "one")]
    limit: usize,
}

#[derive(Serialize, ToSchema)]
pub struct Claimed {
    /// Expired leases taken over first (next_action reconcile), then due jobs.
    leases: Vec<LeaseGrant>,
}

/// Claims up to `limit` jobs of the queue (none due: an empty list).
#[utoipa::path(post, path = "/v1/queues/{queue}/claim", tag = "worker",
    params(("queue" = String, Path, description = "The queue to claim from")),
    request_body = ClaimBody,
    responses((status = 200, body = Claimed), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn claim(
    State(app): State<App>,
    auth: Authed,
    Path(queue): Path<String>,
    raw: Body,
) -> ApiResult<Json<Claimed>> {
    auth.may(Action::Work)?; // the role before the body: 403, not 400
    let b: ClaimBody = body(&raw)?;
    batch_size(b.limit)?;
    let holder = holder(&app, &auth, &b.worker)?;
    let leases = app
        .ledger
        .claim(&queue, &holder, Duration::from_millis(b.lease_ms), b.limit as i64)
        .await?;
    Ok(Json(Claimed {
        leases: leases.iter().filter_map(LeaseGrant::of).collect(),
    }))
}

/// The fence every lease write carries.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Fenced {
    worker: String,
    epoch: i64,
    token: i64,
    /// heartbeat (required), progress (optional): the new lease length.
    lease_ms: Option<u64>,
    /// progress: the step reached.
    step: Option<String>,
    /// complete: the job's result.
    result: Option<Value>,
    /// fail: retries are decided on the class, never on the text.
    class: Option<ErrorClass>,
    /// fail: a stable error code.
    code: Option<String>,
    /// fail: free text for people.
    message: Option<String>,
    /// submit: the provider's receipt id to wait for.
    receipt_id: Option<String>,
    /// snooze: run again after this long (no attempt burnt).
    delay_ms: Option<u64>,
}

fn need<T>(v: Option<T>, what: &str, op: &str) -> ApiResult<T> {
    v.ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, format!("{op} needs {what}")))
}

/// One route per fenced write, each documented in the OpenAPI document.
macro_rules! lease_write {
    ($($name:ident => $path:tt, $summary:tt;)+) => {$(
        #[doc = $summary]
        #[utoipa::path(post, path = $path, tag = "worker",
            params(("id" = Uuid, Path, description = "The job")),
            request_body = Fenced,
            responses((status = 200, description = "committed or already_committed", body = WriteAnswer),
                (status = 409, description = "stale (a newer token holds the job) or conflict", body = WriteAnswer),
                (status = 422, description = "invalid_transition", body = WriteAnswer),
                (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
                (status = 404, body = ErrorBody), (status = 413, body = ErrorBody)),
            security(("bearer" = [])))]
        pub async fn $name(State(app): State<App>, auth: Authed, JobPath(id): JobPath, raw: Body) -> ApiResult<Response> {
            fenced_write(&app, &auth, id, &raw, stringify!($name)).await
        }
    )+};
}

lease_write! {
    heartbeat => "/v1/jobs/{id}/heartbeat", "Extends the lease by `lease_ms`.";
    progress => "/v1/jobs/{id}/progress", "Records the step reached (and optionally extends the lease).";
    complete => "/v1/jobs/{id}/complete", "Ends the job succeeded, with an optional result.";
    fail => "/v1/jobs/{id}/fail", "Records a failure; the policy retries a transient one while attempts remain.";
    submit => "/v1/jobs/{id}/submit", "Hands the work to the outside world: the job awaits its receipt.";
    confirm_cancel => "/v1/jobs/{id}/confirm-cancel", "Confirms a requested cancel at a step boundary.";
    release => "/v1/jobs/{id}/release", "Gives the job back without burning an attempt.";
    snooze => "/v1/jobs/{id}/snooze", "Runs the job again after `delay_ms` without burning an attempt.";
}

async fn fenced_write(app: &App, auth: &Authed, id: Uuid, raw: &Body, write: &str) -> ApiResult<Response> {
    auth.may(Action::Work)?;
    let f: Fenced = body(raw)?;
    let l = lease(app, auth, id, &f)?;
    let ms = Duration::from_millis;
    let r = match write {
        "heartbeat" => {
            l.heartbeat(ms(need(f.lease_ms, "lease_ms", "heartbeat")?))
                .await?
        }
        "progress" => {
            let step = need(f.step, "step", "progress")?;
            l.progress(&step, f.lease_ms.map(ms)).await?
        }
        "complete" => l.complete(f.result).await?,
        "fail" => {
            let class = need(f.class, "class (transient or permanent)", "fail")?;
            let code = need(f.code, "code", "fail")?;
            l.fail(class, &code, f.message.as_deref()).await?
        }
        "submit" => l.submit(&need(f.receipt_id, "receipt_id", "submit")?).await?,
        "confirm_cancel" => l.confirm_cancel().await?,
        "release" => l.release().await?,
        "snooze" => l.snooze(ms(need(f.delay_ms, "delay_ms", "snooze")?)).await?,
        _ => unreachable!("one handler per write"),
    };
    Ok(written(&r))
}

/// One lease of a batch.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchItem {
    job_id: Uuid,
    epoch: i64,
    token: i64,
    /// complete: the job's result.
    result: Option<Value>,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    worker: String,
    /// heartbeat: the new lease length.
    lease_ms: Option<u64>,
    /// At most 1,000.
    items: Vec<BatchItem>,
}

#[derive(Serialize, ToSchema)]
pub struct BatchAnswers {
    /// One answer per item, in order; each fenced on its own.
    answers: Vec<WriteAnswer>,
}

/// Completes many leases in one transaction, each fenced on its own. The
/// request is 200 whatever each lease's outcome: read every answer.
#[utoipa::path(post, path = "/v1/leases/complete", tag = "worker",
    request_body = BatchBody,
    responses((status = 200, body = BatchAnswers), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn complete_batch(
    State(app): State<App>,
    auth: Authed,
    raw: Body,
) -> ApiResult<Json<BatchAnswers>> {
    let (b, leases) = batch_leases(&app, &auth, &raw)?;
    let items = leases.iter().zip(b.items).map(|(l, i)| (l, i.result)).collect();
    let results = Lease::complete_many(&app.ledger, items).await?;
    Ok(Json(BatchAnswers {
        answers: results.iter().map(WriteAnswer::from).collect(),
    }))
}

/// Extends many leases by `lease_ms` in one transaction, each fenced on its
/// own. 200 whatever each lease's outcome: read every answer (a
/// `cancel_requested` state asks that worker to stop at a step boundary).
#[utoipa::path(post, path = "/v1/leases/heartbeat", tag = "worker",
    request_body = BatchBody,
    responses((status = 200, body = BatchAnswers), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn heartbeat_batch(
    State(app): State<App>,
    auth: Authed,
    raw: Body,
) -> ApiResult<Json<BatchAnswers>> {
    let (b, leases) = batch_leases(&app, &auth, &raw)?;
    let ms = need(b.lease_ms, "lease_ms", "heartbeat")?;
    if b.items.iter().any(|i| i.result.is_some()) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "a heartbeat carries no result",
        ));
    }
    let refs: Vec<&Lease> = leases.iter().collect();
    let results = Lease::heartbeat_many(&app.ledger, &refs, Duration::from_millis(ms)).await?;
    Ok(Json(BatchAnswers {
        answers: results.iter().map(WriteAnswer::from).collect(),
    }))
}

fn batch_leases(app: &App, auth: &Authed, raw: &Body) -> ApiResult<(BatchBody, Vec<Lease>)> {
    auth.may(Action::Work)?;
    let b: BatchBody = body(raw)?;
    batch_size(b.items.len())?;
    let holder = holder(app, auth, &b.worker)?;
    let leases = b
        .items
        .iter()
        .map(|i| Lease::resume(app.ledger.clone(), i.job_id, i.epoch, i.token, holder.clone()))
        .collect();
    Ok((b, leases))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ObserveBody {
    /// Observations are kept once per key.
    key: String,
    data: Value,
    worker: String,
    /// The fence of the lease that saw it, if any: evidence from a
    /// superseded lease is kept too, it just changes no state.
    epoch: Option<i64>,
    token: Option<i64>,
}

/// Records outside evidence (a provider's answer) on a job.
#[utoipa::path(post, path = "/v1/jobs/{id}/observe", tag = "worker",
    params(("id" = Uuid, Path, description = "The job")),
    request_body = ObserveBody,
    responses((status = 200, body = WriteAnswer), (status = 409, body = WriteAnswer), (status = 422, body = WriteAnswer),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn observe(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
    raw: Body,
) -> ApiResult<Response> {
    auth.may(Action::Work)?;
    let b: ObserveBody = body(&raw)?;
    let actor = holder(&app, &auth, &b.worker)?;
    let fence = match (b.epoch, b.token) {
        (Some(epoch), Some(token)) => Some(jobledger::domain::Fence { epoch, token }),
        (None, None) => None,
        _ => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "give both epoch and token, or neither",
            ))
        }
    };
    Ok(written(
        &app.ledger.observe(id, fence, &b.key, b.data, &actor).await?,
    ))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReceiptBody {
    receipt_id: String,
    status: ReceiptStatus,
}

/// The outside world's answer to a submitted job (a provider's webhook).
#[utoipa::path(post, path = "/v1/jobs/{id}/receipt", tag = "worker",
    params(("id" = Uuid, Path, description = "The job")),
    request_body = ReceiptBody,
    responses((status = 200, body = WriteAnswer), (status = 409, body = WriteAnswer), (status = 422, body = WriteAnswer),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn receipt(
    State(app): State<App>,
    auth: Authed,
    JobPath(id): JobPath,
    raw: Body,
) -> ApiResult<Response> {
    let caller = auth.may(Action::Work)?;
    let actor = format!("token:{}", caller.name);
    let b: ReceiptBody = body(&raw)?;
    Ok(written(
        &app.ledger.receipt_as(id, &actor, &b.receipt_id, b.status).await?,
    ))
}
