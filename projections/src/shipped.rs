//! Projections shipped with the crate.

use sqlx::PgConnection;

use crate::{BoxFuture, Event, Projection};

/// Per job, a compact history for UIs and auditors: one row per version.
/// Idempotent per (job, version), so redelivered events change nothing.
pub struct JobTimeline;

impl Projection for JobTimeline {
    fn name(&self) -> &str {
        "job_timeline"
    }
    fn version(&self) -> i32 {
        1
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid NOT NULL, version bigint NOT NULL, position bigint NOT NULL, \
                 at timestamptz NOT NULL, type text NOT NULL, from_state text, to_state text NOT NULL, \
                 reason text NOT NULL, actor text NOT NULL, token bigint NOT NULL, PRIMARY KEY (job_id, version))"
            ))
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let col = |f: fn(&Event) -> String| events.iter().map(f).collect::<Vec<_>>();
            sqlx::query(&format!(
                "INSERT INTO {table} SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::int8[], $4::timestamptz[], \
                 $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::int8[]) ON CONFLICT DO NOTHING"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.position).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.recorded_at).collect::<Vec<_>>())
            .bind(col(|e| e.kind.clone()))
            .bind(events.iter().map(|e| e.from_state.clone()).collect::<Vec<_>>())
            .bind(col(|e| e.to_state.clone()))
            .bind(col(|e| e.reason.clone()))
            .bind(col(|e| e.actor.clone()))
            .bind(events.iter().map(|e| e.token).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}
