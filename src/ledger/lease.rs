//! `Lease`: the only handle through which a worker writes. Every method is a
//! fenced write carrying the lease's (epoch, token); the answer is one of the
//! five outcomes, never a guess.

use serde_json::Value;
use sqlx::PgConnection;
use std::time::Duration;
use tracing::{instrument, Instrument};
use uuid::Uuid;

use super::engine::{record_refusal, run_transition, transition_in, transition_many, WriteResult};
use super::error::LedgerResult;
use super::Ledger;
use crate::domain::{Command, ErrorClass, EventBody, Fence, Job, NextAction};

#[derive(Clone, Debug)]
pub struct Lease {
    ledger: Ledger,
    job_id: Uuid,
    fence: Fence,
    holder: String,
    /// The job as the claim left it (absent for a handle rebuilt from ids).
    /// Shared: a worker clones its lease for the in-flight map, the handler
    /// and the committer, and a clone of the job each time was a tenth of a
    /// drain's client time (issue 15).
    claimed: Option<std::sync::Arc<Job>>,
    /// The claim took an expired lease over (rather than a queued job).
    taken_over: bool,
    /// The span the lease's writes descend from (W3C `traceparent`): the
    /// claim's, or the handler's once it runs. `None` when tracing is off.
    trace: Option<String>,
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Lease {
    /// The lease a committed claim handed out, if it left the job held (a
    /// claim can also end a job whose lease expired on its last attempt).
    pub(crate) fn from_claim(ledger: &Ledger, r: &WriteResult) -> Option<Self> {
        Self::holding(ledger, r, r.job.clone())
    }

    /// `from_claim`, taking the job out of the answer instead of copying it.
    pub(crate) fn from_claim_owned(ledger: &Ledger, mut r: WriteResult) -> Option<Self> {
        let job = r.job.take();
        Self::holding(ledger, &r, job)
    }

    /// The lease of claim answer `r`, whose job (taken or copied out of it)
    /// is `job`.
    fn holding(ledger: &Ledger, r: &WriteResult, job: Option<Job>) -> Option<Self> {
        let job = job.filter(|j| r.committed() && j.state.is_held())?;
        let taken_over = matches!(
            r.event.as_ref().map(|e| &e.body),
            Some(EventBody::TakenOver { .. })
        );
        Some(Lease {
            ledger: ledger.clone(),
            job_id: job.job_id,
            fence: Fence {
                epoch: job.epoch,
                token: job.token,
            },
            holder: job.holder.clone().unwrap_or_default(),
            claimed: Some(std::sync::Arc::new(job)),
            taken_over,
            trace: None,
        })
    }

    /// A handle for a lease issued elsewhere (another process, the CLI): the
    /// fence decides whether its writes count, so nothing is trusted here.
    pub fn resume(ledger: Ledger, job_id: Uuid, epoch: i64, token: i64, holder: impl Into<String>) -> Self {
        Lease {
            ledger,
            job_id,
            fence: Fence { epoch, token },
            holder: holder.into(),
            claimed: None,
            taken_over: false,
            trace: None,
        }
    }

    pub fn job_id(&self) -> Uuid {
        self.job_id
    }
    pub fn fence(&self) -> Fence {
        self.fence
    }
    pub fn holder(&self) -> &str {
        &self.holder
    }
    /// The job as claimed: payload, kind, key, attempt, next action, lease end.
    pub fn job(&self) -> Option<&Job> {
        self.claimed.as_deref()
    }
    /// The trace context its writes continue (see the field).
    pub fn trace(&self) -> Option<&str> {
        self.trace.as_deref()
    }
    /// This lease, its writes continuing `trace` (the handler's span). A
    /// value that is not a W3C trace context is dropped, as everywhere one
    /// comes from outside: the write then starts no trace of its own
    /// choosing (the stored CHECKs would refuse it, failing the write).
    pub fn under(mut self, trace: Option<String>) -> Self {
        self.trace = trace.filter(|t| crate::telemetry::context_of(t).is_some());
        self
    }
    /// Whether this lease came from taking over an expired one.
    pub fn taken_over(&self) -> bool {
        self.taken_over
    }
    pub fn next_action(&self) -> NextAction {
        self.claimed
            .as_ref()
            .map_or(NextAction::Execute, |j| j.next_action)
    }

    async fn write(&self, cmd: Command) -> LedgerResult<WriteResult> {
        // A handle rebuilt from ids (`resume`) names its holder unchecked:
        // the fence decides, but the name is recorded, so it is checked.
        self.ledger.limits.name("worker id", &self.holder)?;
        let span = self.span(&format_args!("jobledger.{}", cmd.name()));
        run_transition(&self.ledger.pool, self.job_id, &self.holder, cmd)
            .instrument(span)
            .await
    }

    /// The span of one write through this lease, named by what it does (its
    /// command): in the job's trace by `telemetry::parent_for`, whatever task
    /// or span it is called from (a handler's own task, a library caller).
    /// The name is only formatted when the span is enabled.
    fn span(&self, name: &dyn std::fmt::Display) -> tracing::Span {
        let span =
            tracing::info_span!("write", otel.name = %name, job_id = %self.job_id, token = self.fence.token);
        crate::telemetry::place_for_job(&span, self.trace.as_deref());
        span
    }

    #[instrument(level = "debug", skip(self), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn heartbeat(&self, lease: Duration) -> LedgerResult<WriteResult> {
        self.ledger.limits.lease(lease)?;
        self.write(Command::Heartbeat {
            fence: self.fence,
            lease_ms: millis(lease),
        })
        .await
    }

    #[instrument(level = "debug", skip(self), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn progress(&self, step: &str, lease: Option<Duration>) -> LedgerResult<WriteResult> {
        self.ledger.limits.name("step", step)?;
        if let Some(l) = lease {
            self.ledger.limits.lease(l)?;
        }
        self.write(Command::Progress {
            fence: self.fence,
            step: step.into(),
            lease_ms: lease.map(millis),
        })
        .await
    }

    #[instrument(level = "debug", skip(self, result), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn complete(&self, result: Option<Value>) -> LedgerResult<WriteResult> {
        self.check_result(&result)?;
        self.write(Command::Complete {
            fence: self.fence,
            result,
        })
        .await
    }

    fn check_result(&self, result: &Option<Value>) -> LedgerResult<()> {
        match result {
            Some(r) => self.ledger.limits.json("result", r),
            None => Ok(()),
        }
    }

    /// Completes inside the caller's transaction, so the caller's business
    /// writes commit together with the completion or not at all. Commit the
    /// transaction only when the answer is `committed`; on anything else
    /// (including `already_committed`: the first attempt already made those
    /// business writes) drop or roll it back.
    #[instrument(level = "debug", skip(self, conn, result), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        result: Option<Value>,
    ) -> LedgerResult<WriteResult> {
        self.check_result(&result)?;
        self.ledger.limits.name("worker id", &self.holder)?;
        let cmd = Command::Complete {
            fence: self.fence,
            result,
        };
        let span = self.span(&format_args!("jobledger.{}", cmd.name()));
        let out = transition_in(conn, self.job_id, &self.holder, cmd.clone())
            .instrument(span)
            .await?;
        record_refusal(&self.ledger.pool, &cmd, &self.holder, &out).await?;
        Ok(out)
    }

    #[instrument(level = "debug", skip(self), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn submit(&self, receipt_id: &str) -> LedgerResult<WriteResult> {
        self.ledger.limits.name("receipt id", receipt_id)?;
        self.write(Command::Submit {
            fence: self.fence,
            receipt_id: receipt_id.into(),
        })
        .await
    }

    #[instrument(level = "debug", skip(self, message), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn fail(
        &self,
        class: ErrorClass,
        code: &str,
        message: Option<&str>,
    ) -> LedgerResult<WriteResult> {
        self.ledger.limits.name("error code", code)?;
        if let Some(m) = message {
            self.ledger.limits.text("error message", m)?;
        }
        let cmd = Command::Fail {
            fence: self.fence,
            class,
            code: code.into(),
            message: message.map(Into::into),
        };
        self.write(cmd).await
    }

    #[instrument(level = "debug", skip(self), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn confirm_cancel(&self) -> LedgerResult<WriteResult> {
        self.write(Command::ConfirmCancel { fence: self.fence }).await
    }

    /// Gives the job back without burning an attempt (its work never started).
    #[instrument(level = "debug", skip(self), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn release(&self) -> LedgerResult<WriteResult> {
        self.write(Command::Release { fence: self.fence }).await
    }

    #[instrument(level = "debug", skip(self), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn snooze(&self, delay: Duration) -> LedgerResult<WriteResult> {
        self.ledger.limits.delay(delay)?;
        self.write(Command::Snooze {
            fence: self.fence,
            delay_ms: millis(delay),
        })
        .await
    }

    /// Records outside evidence (a provider's answer, a webhook). Allowed even
    /// after this lease was superseded: evidence is kept, state is not touched.
    #[instrument(level = "debug", skip(self, data), fields(job_id = %self.job_id, token = self.fence.token))]
    pub async fn observe(&self, key: &str, data: Value) -> LedgerResult<WriteResult> {
        let span = self.span(&"jobledger.observe");
        self.ledger
            .observe(self.job_id, Some(self.fence), key, data, &self.holder)
            .instrument(span)
            .await
    }

    /// Completes several leases in one transaction; each is fenced on its own
    /// and gets its own answer (in order). A worker's batched completions.
    pub async fn complete_many(
        ledger: &Ledger,
        items: Vec<(&Lease, Option<Value>)>,
    ) -> LedgerResult<Vec<WriteResult>> {
        for (_, r) in &items {
            if let Some(r) = r {
                ledger.limits.json("result", r)?;
            }
        }
        let cmds = items
            .into_iter()
            .map(|(l, result)| {
                (
                    l.job_id,
                    l.holder.clone(),
                    Command::Complete {
                        fence: l.fence,
                        result,
                    },
                    // Under its handler's span.
                    l.trace.clone(),
                    l.claimed.as_deref(),
                )
            })
            .collect();
        transition_many(&ledger.pool, cmds, "jobledger.complete").await
    }

    /// Extends several leases in one transaction, each fenced on its own.
    pub async fn heartbeat_many(
        ledger: &Ledger,
        leases: &[&Lease],
        lease: Duration,
    ) -> LedgerResult<Vec<WriteResult>> {
        ledger.limits.lease(lease)?;
        let cmds = leases
            .iter()
            .map(|l| {
                (
                    l.job_id,
                    l.holder.clone(),
                    Command::Heartbeat {
                        fence: l.fence,
                        lease_ms: millis(lease),
                    },
                    l.trace.clone(),
                    l.claimed.as_deref(),
                )
            })
            .collect();
        transition_many(&ledger.pool, cmds, "jobledger.heartbeat").await
    }
}
