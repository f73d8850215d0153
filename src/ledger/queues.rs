//! Queue pause and resume: operators' recorded actions (domain::queue),
//! appended to the queue's own hash-chained stream with the state they
//! leave, in one transaction. A paused queue is not claimed (nor are its
//! expired leases taken over); running jobs go on and may complete, and an
//! operator's `claim_job` of one named job still works. A claim already
//! running when the pause commits may still lease from it: the pause holds
//! for every claim that starts after it.

use chrono::{DateTime, Utc};

use super::error::{LedgerError, LedgerResult};
use super::validate::typed;
use super::Ledger;
use crate::domain::admission::{ConcurrencyLimit, RateLimit};
use crate::domain::queue::{
    apply_queue, decide_queue, Pause, QueueAction, QueueCommand, QueueControl, QueueEvent, QueueRefusal,
};
use crate::store::queues::{self, QueueEventRow, QueueRow};
use std::collections::BTreeMap;

/// A queue's controls as `queue list` and the API show them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct QueueStatus {
    pub queue: String,
    pub paused: bool,
    pub paused_at: Option<DateTime<Utc>>,
    pub paused_by: Option<String>,
    pub reason: Option<String>,
    /// Concurrency limits by name.
    pub limits: BTreeMap<String, ConcurrencyLimit>,
    pub rate: Option<RateLimit>,
    pub version: i64,
}

impl TryFrom<QueueRow> for QueueStatus {
    type Error = LedgerError;

    fn try_from(r: QueueRow) -> LedgerResult<Self> {
        let (limits, rate) = terms_of(&r)?;
        Ok(QueueStatus {
            queue: r.queue,
            paused: r.paused,
            paused_at: r.paused_at,
            paused_by: r.paused_by,
            reason: r.reason,
            limits,
            rate,
            version: r.version,
        })
    }
}

type Terms = (BTreeMap<String, ConcurrencyLimit>, Option<RateLimit>);

fn terms_of(r: &QueueRow) -> LedgerResult<Terms> {
    let corrupt =
        |e: serde_json::Error| crate::store::StoreError::Corrupt(format!("queue {:?} limits: {e}", r.queue));
    let limits = serde_json::from_value(r.limits.clone()).map_err(corrupt)?;
    let rate = r
        .rate
        .clone()
        .map(serde_json::from_value)
        .transpose()
        .map_err(corrupt)?;
    Ok((limits, rate))
}

fn control_of(queue: &str, row: Option<&QueueRow>) -> LedgerResult<QueueControl> {
    let Some(r) = row else {
        return Ok(QueueControl {
            queue: queue.into(),
            ..Default::default()
        });
    };
    let (limits, rate) = terms_of(r)?;
    Ok(QueueControl {
        queue: queue.into(),
        paused: r.paused.then(|| Pause {
            since: r.paused_at.unwrap_or_default(),
            by: r.paused_by.clone().unwrap_or_default(),
            reason: r.reason.clone().unwrap_or_default(),
        }),
        limits,
        rate,
        version: r.version,
        last_hash: Some(r.last_hash.clone()),
    })
}

/// The answer to a pause or resume.
#[derive(Debug, Clone, serde::Serialize)]
pub struct QueueChange {
    /// False when there was nothing to do (pausing a paused queue).
    pub changed: bool,
    pub status: QueueStatus,
    pub detail: Option<String>,
}

fn to_event(r: QueueEventRow) -> LedgerResult<QueueEvent> {
    Ok(QueueEvent {
        action: QueueAction::parse(&r.action)
            .ok_or_else(|| crate::store::StoreError::Corrupt(format!("queue action {:?}", r.action)))?,
        queue: r.queue,
        version: r.version,
        actor: r.actor,
        reason: r.reason,
        data: r.data,
        recorded_at: r.recorded_at,
        prev_hash: r.prev_hash,
        hash: r.hash,
    })
}

fn never_paused(queue: &str) -> QueueStatus {
    QueueStatus {
        queue: queue.into(),
        paused: false,
        paused_at: None,
        paused_by: None,
        reason: None,
        limits: BTreeMap::new(),
        rate: None,
        version: 0,
    }
}

impl Ledger {
    /// Pauses `queue` (recorded with `operator` and `reason`).
    pub async fn pause_queue(&self, queue: &str, operator: &str, reason: &str) -> LedgerResult<QueueChange> {
        self.control_queue(queue, QueueCommand::Pause, operator, reason)
            .await
    }

    /// Resumes `queue` (recorded with `operator` and `reason`).
    pub async fn resume_queue(&self, queue: &str, operator: &str, reason: &str) -> LedgerResult<QueueChange> {
        self.control_queue(queue, QueueCommand::Resume, operator, reason)
            .await
    }

    /// Sets (or changes) the concurrency limit `name` of `queue`: at most
    /// `max` of its jobs with the same concurrency key leased at once, for
    /// jobs of `kind` (any if None) whose key matches the glob `key` (any
    /// if None). Recorded with `operator` and `reason`.
    #[allow(clippy::too_many_arguments)]
    pub async fn set_concurrency_limit(
        &self,
        queue: &str,
        name: &str,
        kind: Option<&str>,
        key: Option<&str>,
        max: i32,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<QueueChange> {
        self.limits.name("limit name", name)?;
        typed("limit name", name)?;
        if let Some(k) = kind {
            self.limits.name("kind", k)?;
        }
        if let Some(k) = key {
            self.limits.name("key pattern", k)?;
        }
        let limit = ConcurrencyLimit::new(kind.map(Into::into), key.map(Into::into), max);
        let cmd = QueueCommand::SetLimit {
            name: name.into(),
            limit,
        };
        self.control_queue(queue, cmd, operator, reason).await
    }

    pub async fn remove_concurrency_limit(
        &self,
        queue: &str,
        name: &str,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<QueueChange> {
        let cmd = QueueCommand::RemoveLimit { name: name.into() };
        self.control_queue(queue, cmd, operator, reason).await
    }

    /// At most `max` claims from `queue` in any window of `per`.
    pub async fn set_rate_limit(
        &self,
        queue: &str,
        max: i32,
        per: std::time::Duration,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<QueueChange> {
        let per_ms = i64::try_from(per.as_millis()).unwrap_or(i64::MAX);
        let cmd = QueueCommand::SetRate(RateLimit { max, per_ms });
        self.control_queue(queue, cmd, operator, reason).await
    }

    pub async fn remove_rate_limit(
        &self,
        queue: &str,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<QueueChange> {
        self.control_queue(queue, QueueCommand::RemoveRate, operator, reason)
            .await
    }

    async fn control_queue(
        &self,
        queue: &str,
        cmd: QueueCommand,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<QueueChange> {
        self.limits.name("queue", queue)?;
        self.limits.control("operator", operator, reason)?;
        let mut tx = self.pool.begin().await?;
        let row = queues::lock_queue(&mut tx, queue).await?;
        let current = control_of(queue, row.as_ref())?;
        let now = queues::the_clock(&mut tx).await?;
        let e = match decide_queue(&current, &cmd, operator, reason, now) {
            Ok(e) => e,
            // From the row this transaction holds: asking the pool here
            // would wait on a connection that waits on this lock.
            Err(QueueRefusal::Already(why)) => {
                let status = match row {
                    Some(r) => r.try_into()?,
                    None => never_paused(queue),
                };
                return Ok(QueueChange {
                    changed: false,
                    status,
                    detail: Some(why.into()),
                });
            }
            Err(QueueRefusal::Invalid(why)) => return Err(LedgerError::BadInput(why)),
        };
        let next = apply_queue(&current, &e).map_err(LedgerError::BadInput)?;
        let row = QueueEventRow {
            queue: e.queue.clone(),
            version: e.version,
            action: e.action.as_str().into(),
            actor: e.actor.clone(),
            reason: e.reason.clone(),
            data: e.data.clone(),
            recorded_at: e.recorded_at,
            prev_hash: e.prev_hash.clone(),
            hash: e.hash.clone(),
        };
        let limits = serde_json::to_value(&next.limits).expect("limits serialise");
        let rate = next
            .rate
            .map(|r| serde_json::to_value(r).expect("rate serialises"));
        let st = queues::QueueStateRow {
            paused: next.paused.is_some(),
            limits: &limits,
            rate: rate.as_ref(),
        };
        queues::append_queue_event(&mut tx, &row, st).await?;
        tx.commit().await?;
        Ok(QueueChange {
            changed: true,
            status: self.queue_status(queue).await?,
            detail: None,
        })
    }

    /// The queue's controls (never paused: not paused, version 0).
    pub async fn queue_status(&self, queue: &str) -> LedgerResult<QueueStatus> {
        Ok(match queues::queue_state(&self.pool, queue).await? {
            Some(r) => r.try_into()?,
            None => never_paused(queue),
        })
    }

    /// Every queue that was ever paused.
    pub async fn queue_controls(&self) -> LedgerResult<Vec<QueueStatus>> {
        queues::controlled_queues(&self.pool)
            .await?
            .into_iter()
            .map(TryInto::try_into)
            .collect()
    }

    /// A queue's pauses and resumes, oldest first.
    pub async fn queue_history(&self, queue: &str) -> LedgerResult<Vec<QueueEvent>> {
        queues::queue_events(&self.pool, Some(queue))
            .await?
            .into_iter()
            .map(to_event)
            .collect()
    }

    /// Replays every queue's stream: each hash and link, and the state it
    /// leaves against `jobledger.queues` (every column). One line per
    /// problem. Run it inside one snapshot (verify's), or a pause between
    /// its two reads would look like corruption.
    pub async fn verify_queues_in(&self, conn: &mut sqlx::PgConnection) -> LedgerResult<Vec<String>> {
        let mut problems = vec![];
        let mut folded: std::collections::BTreeMap<String, QueueControl> = Default::default();
        for r in queues::queue_events(&mut *conn, None).await? {
            let e = to_event(r)?;
            let q = folded.entry(e.queue.clone()).or_insert_with(|| QueueControl {
                queue: e.queue.clone(),
                ..Default::default()
            });
            match apply_queue(q, &e) {
                Ok(next) => *q = next,
                Err(why) => problems.push(why),
            }
        }
        for row in queues::controlled_queues(&mut *conn).await? {
            let f = folded.remove(&row.queue).unwrap_or_default();
            let p = f.paused.as_ref();
            let same = control_of(&row.queue, Some(&row))
                .is_ok_and(|c| c.limits == f.limits && c.rate == f.rate)
                && f.version == row.version
                && f.paused.is_some() == row.paused
                && f.last_hash.as_deref() == Some(row.last_hash.as_str())
                && p.map(|p| p.since) == row.paused_at
                && p.map(|p| p.by.as_str()) == row.paused_by.as_deref()
                && p.map(|p| p.reason.as_str()) == row.reason.as_deref();
            if !same {
                problems.push(format!(
                    "queue {:?}: the state (v{}, paused {}, limits, rate) is not what its events leave (v{}, paused {})",
                    row.queue,
                    row.version,
                    row.paused,
                    f.version,
                    f.paused.is_some()
                ));
            }
        }
        for (queue, _) in folded {
            problems.push(format!("queue {queue:?}: events without a state row"));
        }
        Ok(problems)
    }
}
