//! `queue_stats`: per queue, jobs in each state, takeovers, and when the
//! oldest unfinished job was enqueued.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use std::collections::HashMap;
use uuid::Uuid;

use crate::{BoxFuture, Event, Projection, UNIQUE_VIOLATION};

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
    fn data_keys(&self) -> Option<&'static [&'static str]> {
        Some(&["queue"])
    }
    fn reads_hashes(&self) -> bool {
        false
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

    /// A job whose first event in the batch is its `enqueued` (version 1)
    /// is taken for new without reading the side table back, and inserted
    /// plainly; a version 1 that comes again (handed out early before) meets
    /// its row there, and the batch is undone to a savepoint and applied
    /// again reading every job back. In a rebuild a third of the batches
    /// are enqueues: their read-back found nothing, and the upsert's
    /// `ON CONFLICT` probed the key a second time for every row.
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("SAVEPOINT jobledger_queue_stats")
                .execute(&mut *tx)
                .await?;
            match apply_batch(tx, table, events, true).await {
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(UNIQUE_VIOLATION) => {
                    sqlx::query("ROLLBACK TO SAVEPOINT jobledger_queue_stats")
                        .execute(&mut *tx)
                        .await?;
                    apply_batch(tx, table, events, false).await?;
                }
                r => r?,
            }
            sqlx::query("RELEASE SAVEPOINT jobledger_queue_stats")
                .execute(&mut *tx)
                .await?;
            Ok(())
        })
    }
}

/// A job as the side table has it, and what this batch did to it.
struct Job {
    queue: String,
    state: String,
    version: i64,
    created_at: DateTime<Utc>,
    /// Read back from the side table (else inserted).
    stored: bool,
    /// An event of this batch moved it (else it is not written).
    moved: bool,
}

/// The counts' changes: per (queue, state), and takeovers per queue.
#[derive(Default)]
struct Deltas {
    states: HashMap<(String, &'static str), i64>,
    takeovers: HashMap<String, i64>,
}

/// One batch: the side table's jobs, then each queue's counts and oldest
/// open job. `new_streams`: trust a job whose first event here is version 1
/// to be absent from the side table (its plain insert fails if it is not).
async fn apply_batch(
    tx: &mut PgConnection,
    table: &str,
    events: &[Event],
    new_streams: bool,
) -> Result<(), sqlx::Error> {
    let mut jobs = read_back(tx, table, events, new_streams).await?;
    let deltas = fold(&mut jobs, events);
    write_jobs(tx, table, &jobs).await?;
    let mut queues: Vec<String> = deltas
        .states
        .keys()
        .map(|(q, _)| q.clone())
        .chain(deltas.takeovers.keys().cloned())
        .collect();
    queues.sort();
    queues.dedup();
    for queue in &queues {
        add_counts(tx, table, queue, &deltas).await?;
    }
    // The states are spelled out as the index's predicate is: a bound array
    // would not let the planner prove it.
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
}

/// The side table's rows of the batch's jobs; with `new_streams`, only of
/// those whose first event here is not their first (the reader hands out
/// each job's versions in order, so the first seen is the lowest).
async fn read_back(
    tx: &mut PgConnection,
    table: &str,
    events: &[Event],
    new_streams: bool,
) -> Result<HashMap<Uuid, Job>, sqlx::Error> {
    let mut seen = std::collections::HashSet::new();
    let ids: Vec<Uuid> = events
        .iter()
        .filter(|e| seen.insert(e.job_id) && !(new_streams && e.version == 1))
        .map(|e| e.job_id)
        .collect();
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<(Uuid, String, String, i64, DateTime<Utc>)> = sqlx::query_as(&format!(
        "SELECT job_id, queue, state, version, created_at FROM {} WHERE job_id = ANY($1)",
        side(table)
    ))
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, queue, state, version, created_at)| {
            let job = Job {
                queue,
                state,
                version,
                created_at,
                stored: true,
                moved: false,
            };
            (id, job)
        })
        .collect())
}

/// Applies the events to `jobs` (skipping versions already applied) and
/// returns what the counts gain and lose.
fn fold(jobs: &mut HashMap<Uuid, Job>, events: &[Event]) -> Deltas {
    let state = |s: &str| STATES.iter().copied().find(|x| *x == s);
    let mut d = Deltas::default();
    for e in events {
        match jobs.get_mut(&e.job_id) {
            Some(job) if job.version >= e.version => continue, // redelivered
            None if e.kind == "enqueued" => {
                let queue = e
                    .data
                    .get("queue")
                    .and_then(|q| q.as_str())
                    .unwrap_or_default()
                    .to_string();
                if let Some(to) = state(&e.to_state) {
                    *d.states.entry((queue.clone(), to)).or_default() += 1;
                }
                let job = Job {
                    queue,
                    state: e.to_state.clone(),
                    version: e.version,
                    created_at: e.recorded_at,
                    stored: false,
                    moved: true,
                };
                jobs.insert(e.job_id, job);
            }
            None => continue, // cannot happen: the reader hands out predecessors first
            Some(job) => {
                job.version = e.version;
                job.moved = true;
                if e.kind == "taken_over" {
                    *d.takeovers.entry(job.queue.clone()).or_default() += 1;
                }
                let to = if e.kind == "purged" {
                    "purged".to_string()
                } else {
                    e.to_state.clone()
                };
                if job.state != to {
                    if let Some(from) = state(&job.state) {
                        *d.states.entry((job.queue.clone(), from)).or_default() -= 1;
                    }
                    if let Some(t) = state(&to) {
                        *d.states.entry((job.queue.clone(), t)).or_default() += 1;
                    }
                    job.state = to;
                }
            }
        }
    }
    d
}

/// The side table's rows of one statement, as its arrays.
#[derive(Default)]
struct SideRows<'a> {
    id: Vec<Uuid>,
    queue: Vec<&'a str>,
    state: Vec<&'a str>,
    version: Vec<i64>,
    created_at: Vec<DateTime<Utc>>,
}

/// New jobs inserted plainly, stored ones that moved upserted; the rest are
/// not written.
async fn write_jobs(
    tx: &mut PgConnection,
    table: &str,
    jobs: &HashMap<Uuid, Job>,
) -> Result<(), sqlx::Error> {
    let (mut new, mut stored) = (SideRows::default(), SideRows::default());
    for (id, job) in jobs.iter().filter(|(_, j)| j.moved) {
        let rows = if job.stored { &mut stored } else { &mut new };
        rows.id.push(*id);
        rows.queue.push(&job.queue);
        rows.state.push(&job.state);
        rows.version.push(job.version);
        rows.created_at.push(job.created_at);
    }
    let insert = format!(
        "INSERT INTO {} SELECT {}",
        side(table),
        crate::unnested(&["uuid", "text", "text", "int8", "timestamptz"])
    );
    // The stored ones through an upsert, not `UPDATE … FROM UNNEST`: planned
    // for the array at hand (the first five times a statement runs, and
    // again now and then), the join scanned and hashed the whole side
    // table, 85–156 ms against 14 ms; an upsert probes the key row by row,
    // whatever the plan. Their `queue` and `created_at` stay as stored (no
    // job changes queue).
    let upsert = format!(
        "{insert} ON CONFLICT (job_id) DO UPDATE SET state = EXCLUDED.state, version = EXCLUDED.version"
    );
    for (sql, rows) in [(&insert, new), (&upsert, stored)] {
        if rows.id.is_empty() {
            continue;
        }
        sqlx::query(sql)
            .bind(rows.id)
            .bind(rows.queue)
            .bind(rows.state)
            .bind(rows.version)
            .bind(rows.created_at)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Adds one queue's deltas to its row (created at zero if new).
async fn add_counts(tx: &mut PgConnection, table: &str, queue: &str, d: &Deltas) -> Result<(), sqlx::Error> {
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
    for st in STATES {
        q = q.bind(d.states.get(&(queue.to_string(), st)).copied().unwrap_or(0));
    }
    q.bind(d.takeovers.get(queue).copied().unwrap_or(0))
        .execute(&mut *tx)
        .await?;
    Ok(())
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
