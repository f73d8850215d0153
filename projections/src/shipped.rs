//! Projections shipped with the crate.

use sqlx::postgres::PgArguments;
use sqlx::{Arguments, PgConnection};

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
    /// No event's data: the timeline keeps the event's columns only.
    fn data_of(&self) -> Option<&'static [&'static str]> {
        Some(&[])
    }
    /// Nor its hashes.
    fn reads_hashes(&self) -> bool {
        false
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
    /// A plain insert; the idempotent one only when the plain one meets a
    /// row the table has ([`crate::insert_plainly`]).
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let rows = crate::unnested(&[
                "uuid",
                "int8",
                "int8",
                "timestamptz",
                "text",
                "text",
                "text",
                "text",
                "text",
                "int8",
            ]);
            let insert = format!("INSERT INTO {table} SELECT {rows}");
            let fallback = format!("{insert} ON CONFLICT DO NOTHING");
            crate::insert_plainly(tx, &insert, &fallback, timeline_rows(events)?).await
        })
    }
}

/// The batch's rows, as the insert's arguments.
fn timeline_rows(events: &[Event]) -> Result<PgArguments, sqlx::Error> {
    let col = |f: fn(&Event) -> String| events.iter().map(f).collect::<Vec<_>>();
    let mut args = PgArguments::default();
    let add = |r: Result<(), sqlx::error::BoxDynError>| r.map_err(sqlx::Error::Encode);
    add(args.add(events.iter().map(|e| e.job_id).collect::<Vec<_>>()))?;
    add(args.add(events.iter().map(|e| e.version).collect::<Vec<_>>()))?;
    add(args.add(events.iter().map(|e| e.position).collect::<Vec<_>>()))?;
    add(args.add(events.iter().map(|e| e.recorded_at).collect::<Vec<_>>()))?;
    add(args.add(col(|e| e.kind.clone())))?;
    add(args.add(events.iter().map(|e| e.from_state.clone()).collect::<Vec<_>>()))?;
    add(args.add(col(|e| e.to_state.clone())))?;
    add(args.add(col(|e| e.reason.clone())))?;
    add(args.add(col(|e| e.actor.clone())))?;
    add(args.add(events.iter().map(|e| e.token).collect::<Vec<_>>()))?;
    Ok(args)
}

pub use crate::queue_stats::QueueStats;
