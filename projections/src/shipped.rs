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
            let insert = format!(
                "INSERT INTO {table} SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::int8[], $4::timestamptz[], \
                 $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::int8[])"
            );
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

/// Per queue: jobs in each state, takeovers, and when the oldest unfinished
/// job was enqueued. Set-based per batch; a side table (`<table>__jobs`)
/// keeps each job's queue, state and last applied version, so redelivered
/// events change nothing.
pub struct QueueStats;

/// Version 2 (issue 11) adds the workflow states: a step `waiting` for its
/// prerequisites, a parent `running` or `failing`. Version 1 did not count
/// them; the runner rebuilds version 2 from position 0 beside it.
/// Version 3 (issue 15) indexes the side table's open jobs by queue and
/// age: each batch's `oldest_pending_at` scanned every job ever seen (47 ms a
/// batch at 333,000 jobs, growing with the log), and is now the index's
/// first entry.
const STATES: [&str; 10] = [
    "queued",
    "leased",
    "cancel_requested",
    "awaiting_receipt",
    "succeeded",
    "cancelled",
    "dead",
    "waiting",
    "running",
    "failing",
];
/// Work not finished yet, for `oldest_pending_at` (a parent is no work of
/// its own: its steps are).
const OPEN: [&str; 5] = [
    "queued",
    "leased",
    "cancel_requested",
    "awaiting_receipt",
    "waiting",
];

impl Projection for QueueStats {
    fn name(&self) -> &str {
        "queue_stats"
    }
    fn version(&self) -> i32 {
        3
    }
    /// A job's queue, from its `enqueued` event.
    fn data_of(&self) -> Option<&'static [&'static str]> {
        Some(&["enqueued"])
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let states: Vec<String> = STATES
                .iter()
                .map(|s| format!("{s} bigint NOT NULL DEFAULT 0"))
                .collect();
            sqlx::query(&format!(
                "CREATE TABLE {table} (queue text PRIMARY KEY, {}, takeovers bigint NOT NULL DEFAULT 0, \
                 oldest_pending_at timestamptz)",
                states.join(", ")
            ))
            .execute(&mut *tx)
            .await?;
            sqlx::query(&format!(
                "CREATE TABLE {} (job_id uuid PRIMARY KEY, queue text NOT NULL, state text NOT NULL, \
                 version bigint NOT NULL, created_at timestamptz NOT NULL)",
                side(table)
            ))
            .execute(&mut *tx)
            .await?;
            // Only open jobs enter it, so it stays the size of the backlog.
            sqlx::query(&format!(
                "CREATE INDEX ON {} (queue, created_at) WHERE state IN ({})",
                side(table),
                open_list()
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
            use std::collections::HashMap;
            let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.job_id).collect();
            let known: Vec<(uuid::Uuid, String, String, i64, chrono::DateTime<chrono::Utc>)> =
                sqlx::query_as(&format!(
                    "SELECT job_id, queue, state, version, created_at FROM {} WHERE job_id = ANY($1)",
                    side(table)
                ))
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await?;
            let mut jobs: HashMap<uuid::Uuid, (String, String, i64, chrono::DateTime<chrono::Utc>)> = known
                .into_iter()
                .map(|(id, q, s, v, c)| (id, (q, s, v, c)))
                .collect();
            let mut delta: HashMap<(String, &str), i64> = HashMap::new();
            let mut takeovers: HashMap<String, i64> = HashMap::new();
            for e in events {
                let state = |s: &str| STATES.iter().copied().find(|x| *x == s);
                match jobs.get_mut(&e.job_id) {
                    Some((_, _, v, _)) if *v >= e.version => continue, // redelivered
                    None if e.kind == "enqueued" => {
                        let queue = e
                            .data
                            .get("queue")
                            .and_then(|q| q.as_str())
                            .unwrap_or_default()
                            .to_string();
                        if let Some(to) = state(&e.to_state) {
                            *delta.entry((queue.clone(), to)).or_default() += 1;
                        }
                        jobs.insert(e.job_id, (queue, e.to_state.clone(), e.version, e.recorded_at));
                    }
                    None => continue, // cannot happen: the reader hands out predecessors first
                    Some((queue, current, v, _)) => {
                        *v = e.version;
                        if e.kind == "taken_over" {
                            *takeovers.entry(queue.clone()).or_default() += 1;
                        }
                        let to = if e.kind == "purged" {
                            "purged".to_string()
                        } else {
                            e.to_state.clone()
                        };
                        if *current != to {
                            if let Some(from) = state(current) {
                                *delta.entry((queue.clone(), from)).or_default() -= 1;
                            }
                            if let Some(t) = state(&to) {
                                *delta.entry((queue.clone(), t)).or_default() += 1;
                            }
                            *current = to;
                        }
                    }
                }
            }
            let (mut id, mut q, mut s, mut v, mut c) = (vec![], vec![], vec![], vec![], vec![]);
            for (k, (queue, state, version, created)) in &jobs {
                id.push(*k);
                q.push(queue.clone());
                s.push(state.clone());
                v.push(*version);
                c.push(*created);
            }
            sqlx::query(&format!(
                "INSERT INTO {} SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::timestamptz[]) \
                 ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, version = EXCLUDED.version",
                side(table)
            ))
            .bind(id)
            .bind(q)
            .bind(s)
            .bind(v)
            .bind(c)
            .execute(&mut *tx)
            .await?;
            let mut queues: Vec<String> = delta
                .keys()
                .map(|(q, _)| q.clone())
                .chain(takeovers.keys().cloned())
                .collect();
            queues.sort();
            queues.dedup();
            for queue in &queues {
                let counts: Vec<i64> = STATES
                    .iter()
                    .map(|st| delta.get(&(queue.clone(), *st)).copied().unwrap_or(0))
                    .collect();
                let cols = STATES.join(", ");
                let adds: Vec<String> = STATES
                    .iter()
                    .map(|st| format!("{st} = {table}.{st} + EXCLUDED.{st}"))
                    .collect();
                let slots: Vec<String> = (2..STATES.len() + 3).map(|i| format!("${i}")).collect();
                let sql = format!(
                    "INSERT INTO {table} (queue, {cols}, takeovers) VALUES ($1, {}) \
                     ON CONFLICT (queue) DO UPDATE SET {}, takeovers = {table}.takeovers + EXCLUDED.takeovers",
                    slots.join(", "),
                    adds.join(", ")
                );
                let mut q = sqlx::query(&sql).bind(queue);
                for c in &counts {
                    q = q.bind(*c);
                }
                q.bind(takeovers.get(queue).copied().unwrap_or(0))
                    .execute(&mut *tx)
                    .await?;
            }
            // The states are spelled out as the index's predicate is: a
            // bound array would not let the planner prove it.
            sqlx::query(&format!(
                "UPDATE {table} t SET oldest_pending_at = (SELECT min(created_at) FROM {} j \
                 WHERE j.queue = t.queue AND j.state IN ({})) WHERE t.queue = ANY($1)",
                side(table),
                open_list()
            ))
            .bind(&queues)
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

/// `'queued', 'leased', …`: the open states as SQL literals (constants, not
/// input).
fn open_list() -> String {
    OPEN.iter()
        .map(|s| format!("'{s}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `jobledger_proj."x_v1"` → `jobledger_proj."x_v1__jobs"`.
fn side(table: &str) -> String {
    match table.strip_suffix('"') {
        Some(t) => format!("{t}__jobs\""),
        None => format!("{table}__jobs"),
    }
}
