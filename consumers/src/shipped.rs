//! The two shipped consumers: a status mirror and an audit-log sink.

use sqlx::{PgConnection, PgPool};

use crate::consumer::{EventHandler, Handled, HandlerFuture};
use crate::decode::JobEvent;

/// Every job's latest state, as a read model in the consumer's database.
pub struct StatusMirror;

impl EventHandler for StatusMirror {
    fn handle<'a>(&'a self, conn: &'a mut PgConnection, ev: &'a JobEvent) -> HandlerFuture<'a> {
        Box::pin(async move {
            // The log's own events (signed checkpoints, the nil stream id)
            // are no job's state.
            if ev.job_id.is_nil() {
                return Ok(Handled::Applied);
            }
            let b = &ev.body;
            let s = |k: &str| b.get(k).and_then(|v| v.as_str()).map(str::to_string);
            let at = s("recorded_at")
                .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t).ok())
                .map(|t| t.to_utc());
            sqlx::query(
                "INSERT INTO jobledger_consumer.status_mirror \
                   (job_id, job_key, queue, state, reason, epoch, token, version, position, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, coalesce($10, now())) \
                 ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, reason = EXCLUDED.reason, \
                   epoch = EXCLUDED.epoch, token = EXCLUDED.token, version = EXCLUDED.version, \
                   position = EXCLUDED.position, updated_at = EXCLUDED.updated_at \
                 WHERE status_mirror.version < EXCLUDED.version",
            )
            .bind(ev.job_id)
            .bind(s("job_key"))
            .bind(s("queue"))
            .bind(&ev.to_state)
            .bind(&ev.reason)
            .bind(ev.epoch)
            .bind(ev.token)
            .bind(ev.version)
            .bind(ev.position)
            .bind(at)
            .execute(&mut *conn)
            .await?;
            Ok(Handled::Applied)
        })
    }
}

/// An append-only copy of every event with its hash (`jobledger verify
/// --audit-log` checks it against the chain). Not behind the staleness
/// fence: it records every `(job_id, version)` it has not recorded yet, in
/// whatever order they arrive (a resend, a purged-and-reused key, a
/// reordering upstream), so no delivery can leave a permanent hole.
pub struct AuditLog;

impl EventHandler for AuditLog {
    fn handle<'a>(&'a self, conn: &'a mut PgConnection, ev: &'a JobEvent) -> HandlerFuture<'a> {
        Box::pin(async move {
            // The log's own events (signed checkpoints) are copied like any
            // event: the copy holds the operator to every signed head.
            let b = &ev.body;
            let inserted = sqlx::query(
                "INSERT INTO jobledger_consumer.audit_log (job_id, version, position, hash, prev_hash, body) \
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (job_id, version) DO NOTHING",
            )
            .bind(ev.job_id)
            .bind(ev.version)
            .bind(ev.position)
            .bind(&ev.hash)
            .bind(b.get("prev_hash").and_then(|v| v.as_str()))
            .bind(b)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            Ok(if inserted == 1 {
                Handled::Applied
            } else {
                Handled::AlreadyRecorded
            })
        })
    }

    fn fenced(&self) -> bool {
        false
    }
}

/// `(job_id, state, version)` of every mirrored job.
pub async fn mirror_rows(pool: &PgPool) -> Result<Vec<(uuid::Uuid, String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT job_id, state, version FROM jobledger_consumer.status_mirror ORDER BY job_id")
        .fetch_all(pool)
        .await
}

/// The audit copy, in (job_id, version) order: bodies as received.
pub async fn audit_rows(pool: &PgPool) -> Result<Vec<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar("SELECT body FROM jobledger_consumer.audit_log ORDER BY job_id, version")
        .fetch_all(pool)
        .await
}

pub async fn dead_letter_count(pool: &PgPool, group: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM jobledger_consumer.dead_letters WHERE grp = $1")
        .bind(group)
        .fetch_one(pool)
        .await
}
