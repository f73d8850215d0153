//! The log reader shared by the relay and async projections.
//!
//! Contract (docs/log-reader.md): nothing is ever
//! skipped, and each job's versions come out in order without gaps;
//! duplicates are allowed (a consumer drops them by version).
//!
//! Technique (docs/log-reader.md): follow `(txid, position)` only below the
//! log horizon (`jobledger.log_horizon()`: the oldest transaction still in
//! progress that is not proven to belong to another database) — every
//! transaction of this database with a smaller id has finished, so a slow
//! transaction that took a smaller position can never commit behind the
//! checkpoint. Because a transaction may take its xid before it locks a job
//! and then append version n+1 with a smaller txid than version n's, a batch
//! can hold a job's v1 and v3 while v2 comes later in txid order. So for
//! every job in a batch the reader also hands out every version up to the
//! job's highest one in the batch that the batch left out (it comes again
//! later: a duplicate), and sorts the batch by (job, version).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio_util::task::AbortOnDropHandle;
use uuid::Uuid;

use crate::domain::Event;
use crate::ledger::{LedgerError, LedgerResult};
use crate::store::readers::{self, DataAs, LogHistory, LoggedEvent};

mod seen;
use seen::Seen;

/// Everything at or before `(txid, position)` in the reader's order was handled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Checkpoint {
    pub txid: i64,
    pub position: i64,
}

/// One event as stored; `event()` parses it into the domain type (the relay
/// does not need to, and skips that cost).
#[derive(Clone, Debug)]
pub struct LogEvent {
    pub position: i64,
    pub row: crate::store::EventRow,
    /// Read by `LogReader::read_raw`: the event's data as stored, unparsed
    /// (`row.data` is then JSON `null`), also on a version handed out early.
    /// `None` otherwise.
    pub raw_data: Option<Box<serde_json::value::RawValue>>,
}

impl LogEvent {
    pub fn job_id(&self) -> Uuid {
        self.row.job_id
    }
    pub fn version(&self) -> i64 {
        self.row.version
    }
    pub fn event(&self) -> LedgerResult<Event> {
        Ok(self.row.to_event()?)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// In per-job version order (jobs interleaved).
    pub events: Vec<LogEvent>,
    /// The checkpoint to store once `events` are handled.
    pub next: Checkpoint,
    /// Versions handed out ahead of their place in txid order so that no
    /// job's versions have a gap (they will come again: duplicates).
    pub early: usize,
    /// Versions the batch lacked that were looked up by key, to see whether
    /// they lie past its end (those this reader had met were not; the rare
    /// walk further down is not counted).
    pub probed: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Lag {
    pub events: i64,
    pub seconds: f64,
    /// The open transaction holding the snapshot horizon back, if any.
    pub horizon_holder: Option<HorizonHolder>,
}

/// The transaction at the log horizon: an open session's transaction
/// (`kind` "session", with its pid and query), a prepared transaction
/// ("prepared", with its gid), or one that could not be attributed
/// ("unknown": it ended a moment ago, or its owner is invisible to us).
#[derive(Clone, Debug, Serialize)]
pub struct HorizonHolder {
    pub kind: String,
    pub xid: i64,
    pub pid: Option<i32>,
    pub database: Option<String>,
    pub open_seconds: Option<f64>,
    pub state: Option<String>,
    pub query: Option<String>,
    pub gid: Option<String>,
}

#[derive(Clone)]
pub struct LogReader {
    pool: PgPool,
    name: String,
    /// Where this reader (and its clones) met each job's lowest and highest
    /// versions: spares `left_out` the probe of a version it has met.
    seen: Arc<Mutex<Seen>>,
    hooks: ReaderHooks,
}

/// Test hooks: a gate between the steps of a read, so tests can force an
/// interleaving without sleeps.
#[derive(Clone, Default)]
#[allow(clippy::type_complexity)]
pub struct ReaderHooks {
    /// Runs after a read's batch came back, before the versions it lacks
    /// are looked up.
    pub before_lookups: Option<Arc<dyn Fn() -> crate::worker::BoxFuture<()> + Send + Sync>>,
}

/// Reads in a row that found the log of another history than the one they
/// started from (before the batch: a reader idle across a restore uses one;
/// or between the batch and its lookups), before `read` gives up with
/// `LedgerError::LogReplaced`.
const READ_ATTEMPTS: usize = 3;

fn to_projection_event(e: LogEvent) -> jobledger_projections::Event {
    jobledger_projections::Event {
        position: e.position,
        job_id: e.row.job_id,
        version: e.row.version,
        kind: e.row.kind,
        from_state: e.row.from_state,
        to_state: e.row.to_state,
        reason: e.row.reason,
        error_class: e.row.error_class,
        actor: e.row.actor,
        epoch: e.row.epoch,
        token: e.row.token,
        attempt: e.row.attempt,
        run: e.row.run,
        data: e.row.data,
        recorded_at: e.row.recorded_at,
        prev_hash: e.row.prev_hash,
        hash: e.row.hash,
        schema: e.row.schema,
    }
}

fn to_log(e: LoggedEvent) -> LogEvent {
    LogEvent {
        position: e.row.position,
        row: e.row,
        raw_data: e.raw_data.map(|j| j.0),
    }
}

/// The versions the batch `rows` (read after `after`, ending at `next`)
/// left out: for each job, those below its highest version in the batch
/// that lie past the batch's end (docs/log-reader.md, trap 2). Only the
/// versions the batch lacks can be past its end: the one below its lowest
/// and any gap between its own, each one probe of the `(job_id, version)`
/// key, unless this reader has met the version below the lowest at or
/// before the batch's end (`Seen`; returned: how many were probed). Only
/// when the version below the lowest one is itself past the end (the
/// predecessor trap at a batch's start, rare) is the job walked further
/// down, to the first version the checkpoint passed. Their data is read as
/// the batch's was (`data`).
async fn left_out(
    conn: &mut sqlx::PgConnection,
    after: Checkpoint,
    next: Checkpoint,
    rows: &[LoggedEvent],
    data: DataAs<'_>,
    seen: &Mutex<Seen>,
    history: LogHistory,
) -> LedgerResult<(Vec<LoggedEvent>, usize)> {
    let mut versions: HashMap<Uuid, Vec<i64>> = HashMap::new();
    for r in rows {
        versions.entry(r.row.job_id).or_default().push(r.row.version);
    }
    let end = (next.txid, next.position);
    let (mut jobs, mut missing) = (vec![], vec![]);
    let mut lowest: HashMap<Uuid, i64> = HashMap::new();
    {
        // Only read: a read of an older history must not wipe a newer one's
        // memory (`Seen::at` answers nothing of another history).
        let seen = seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (id, mut vs) in versions {
            vs.sort_unstable();
            // Not past the end if this reader met it at or before the end
            // (then this batch or an earlier one held it): in a rebuild,
            // nearly every job's version below the lowest.
            let below = vs[0] - 1;
            if below > 0 && seen.at(history, &id, below).is_none_or(|at| at > end) {
                jobs.push(id);
                missing.push(below);
                lowest.insert(id, vs[0]);
            }
            for w in vs.windows(2) {
                for v in w[0] + 1..w[1] {
                    jobs.push(id);
                    missing.push(v);
                }
            }
        }
    }
    let probed = jobs.len();
    if probed == 0 {
        return Ok((vec![], 0));
    }
    let mut early = readers::versions_past(conn, end, &jobs, &missing, data).await?;
    // Jobs whose version below the batch's lowest is past the end too.
    let deeper: Vec<(Uuid, i64)> = early
        .iter()
        .filter(|e| lowest.get(&e.row.job_id) == Some(&(e.row.version + 1)))
        .map(|e| (e.row.job_id, e.row.version))
        .collect();
    if !deeper.is_empty() {
        let (jobs, up_to): (Vec<Uuid>, Vec<i64>) = deeper.into_iter().unzip();
        let walked =
            readers::versions_below_walked(conn, (after.txid, after.position), end, &jobs, &up_to, data)
                .await?;
        early.extend(walked);
    }
    Ok((early, probed))
}

impl LogReader {
    pub async fn open(pool: PgPool, name: &str) -> LedgerResult<Self> {
        readers::ensure_reader(&pool, name).await?;
        Ok(LogReader {
            pool,
            name: name.to_string(),
            seen: Arc::default(),
            hooks: ReaderHooks::default(),
        })
    }

    /// A reader for a caller that keeps its own checkpoint (the projection
    /// runner keeps one per projection in its registry, in the transaction
    /// of what it applied): no row in `jobledger.readers`, so `stats` shows
    /// no checkpoint that nothing moves.
    pub fn source(pool: PgPool) -> Self {
        LogReader {
            pool,
            name: String::new(),
            seen: Arc::default(),
            hooks: ReaderHooks::default(),
        }
    }

    /// Test hooks between the steps of a read.
    pub fn with_hooks(mut self, hooks: ReaderHooks) -> Self {
        self.hooks = hooks;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub async fn checkpoint(&self) -> LedgerResult<Checkpoint> {
        let (txid, position) = readers::reader_checkpoint(&self.pool, &self.name)
            .await?
            .unwrap_or((0, 0));
        Ok(Checkpoint { txid, position })
    }

    /// The next batch after `after` (reads only; storing the checkpoint is
    /// the caller's, once it has handled the batch).
    pub async fn read(&self, after: Checkpoint, limit: i64) -> LedgerResult<Batch> {
        self.read_data(after, limit, None, None, true).await
    }

    /// `read`, with `data` only on events of the kinds `kinds` names (JSON
    /// `null` on the others; `None`: on all), and of it only the top-level
    /// `keys` (an object of exactly those keys; one the data lacks is
    /// `null`; `None`: all of it). Without `hashes`, each event's
    /// `prev_hash` is `None` and its `hash` empty. Versions handed out early
    /// come read the same way: a (job, version) comes with the same data
    /// and hashes each time.
    pub async fn read_data(
        &self,
        after: Checkpoint,
        limit: i64,
        kinds: Option<&[&str]>,
        keys: Option<&[&str]>,
        hashes: bool,
    ) -> LedgerResult<Batch> {
        let data = DataAs::Parsed { kinds, keys, hashes };
        self.read_as(after, limit, data).await
    }

    /// `read`, with each event's data unparsed in `raw_data` (also on a
    /// version handed out early): for a reader that passes the data on as
    /// it is (the relay).
    pub async fn read_raw(&self, after: Checkpoint, limit: i64) -> LedgerResult<Batch> {
        self.read_as(after, limit, DataAs::Raw).await
    }

    async fn read_as(&self, after: Checkpoint, limit: i64, data: DataAs<'_>) -> LedgerResult<Batch> {
        let mut conn = self.pool.acquire().await?;
        for _ in 0..READ_ATTEMPTS {
            if let Some(batch) = self.read_once(&mut conn, after, limit, data).await? {
                return Ok(batch);
            }
        }
        Err(LedgerError::LogReplaced(READ_ATTEMPTS))
    }

    /// One read: `None` when the log is of another history than the one
    /// the reader's memory is of, or was replaced between the batch and the
    /// lookups of the versions it lacks (what the reader met is then
    /// forgotten; the caller reads again).
    async fn read_once(
        &self,
        conn: &mut sqlx::PgConnection,
        after: Checkpoint,
        limit: i64,
        data: DataAs<'_>,
    ) -> LedgerResult<Option<Batch>> {
        // Read only from the history the reader's memory is of (a new
        // reader asks first): the batch is then of that history, checked in
        // its own statement.
        let known = self.seen().history;
        let history = match known {
            Some(h) => h,
            None => {
                let h = readers::log_history(&mut *conn).await?;
                let mut seen = self.seen();
                // (Unless a clone has met one meanwhile.)
                if seen.history.is_none() {
                    seen.follow(h);
                }
                h
            }
        };
        let rows =
            readers::events_after(&mut *conn, after.txid, after.position, limit, data, Some(history)).await?;
        let Some(last) = rows.last() else {
            // Nothing, or another history: an idle poll asks which.
            if self.replaced(conn, history).await? {
                return Ok(None);
            }
            return Ok(Some(Batch {
                next: after,
                ..Batch::default()
            }));
        };
        let next = Checkpoint {
            txid: last.txid,
            position: last.row.position,
        };
        if let Some(hook) = &self.hooks.before_lookups {
            hook().await;
        }
        // Read as `events_after` reads them: a (job, version) comes with the
        // same data each time it comes.
        let (early, probed) = left_out(&mut *conn, after, next, &rows, data, &self.seen, history).await?;
        // The lookups are statements of their own: they must have looked in
        // the log the batch came from. (A table swapped out and back by
        // renames between the two passes for the same history: a repair
        // under the log, docs/log-reader.md.)
        if probed > 0 && self.replaced(conn, history).await? {
            return Ok(None);
        }
        let places = rows.iter().chain(&early);
        self.seen().remember_read(
            history,
            places.map(|e| (e.row.job_id, e.row.version, (e.txid, e.row.position))),
        );
        let n_early = early.len();
        let mut events: Vec<LogEvent> = early.into_iter().chain(rows).map(to_log).collect();
        // Per job in version order; a job's events keep their relative order
        // and jobs stay roughly in log order.
        events.sort_by_key(|e| (e.row.job_id, e.row.version));
        events.dedup_by_key(|e| (e.row.job_id, e.row.version));
        Ok(Some(Batch {
            events,
            next,
            early: n_early,
            probed,
        }))
    }

    /// Whether the log is now of another history than `history`; if so,
    /// the reader forgets what it met and follows the new one.
    async fn replaced(&self, conn: &mut sqlx::PgConnection, history: LogHistory) -> LedgerResult<bool> {
        let now = readers::log_history(conn).await?;
        if now == history {
            return Ok(false);
        }
        self.seen().follow(now);
        Ok(true)
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether committed events lie past `at`. An empty batch does not say
    /// "caught up": an open transaction of this database (or one not proven
    /// to be elsewhere) holds the horizon back, and what committed after it
    /// waits until it ends.
    pub async fn behind(&self, at: Checkpoint) -> LedgerResult<bool> {
        Ok(readers::any_after(&self.pool, at.txid, at.position).await?)
    }

    pub async fn lag(&self, at: Checkpoint) -> LedgerResult<Lag> {
        let (events, oldest) = readers::lag(&self.pool, at.txid, at.position).await?;
        let seconds = oldest.map_or(0.0, |t: DateTime<Utc>| {
            (Utc::now() - t).num_milliseconds() as f64 / 1000.0
        });
        let horizon_holder = readers::horizon_holder(&self.pool).await?.map(|h| HorizonHolder {
            kind: h.kind,
            xid: h.xid,
            pid: h.pid,
            database: h.database,
            open_seconds: h.open_seconds,
            state: h.state,
            query: h.query,
            gid: h.gid,
        });
        Ok(Lag {
            events,
            seconds: seconds.max(0.0),
            horizon_holder,
        })
    }

    /// Stores a checkpoint without a lease (a projection does this in its own
    /// transaction through the store).
    pub async fn store(&self, cp: Checkpoint) -> LedgerResult<()> {
        readers::store_checkpoint(&self.pool, &self.name, cp.txid, cp.position).await?;
        Ok(())
    }

    /// Moves the checkpoint to the current end of the log: the reader will
    /// hand out only what is written from now on. The no-gap promise is a
    /// promise from position 0: a job straddling the cut is seen from the
    /// middle of its stream (docs/log-reader.md, "Starting mid-log").
    pub async fn skip_to_end(&self) -> LedgerResult<Checkpoint> {
        let (txid, position) = readers::log_tail(&self.pool).await?.unwrap_or((0, 0));
        let cp = Checkpoint { txid, position };
        self.store(cp).await?;
        Ok(cp)
    }

    /// Takes the reader's fenced lease (relay): `None` while another holder's
    /// lease is live.
    pub async fn acquire(
        &self,
        holder: &str,
        lease: std::time::Duration,
    ) -> LedgerResult<Option<ReaderLease>> {
        let ms = lease.as_millis() as i64;
        Ok(readers::acquire_reader_lease(&self.pool, &self.name, holder, ms)
            .await?
            .map(|token| ReaderLease {
                reader: self.clone(),
                token,
                lease_ms: ms,
            }))
    }
}

/// The fenced right to advance one reader's checkpoint.
#[derive(Clone)]
pub struct ReaderLease {
    reader: LogReader,
    token: i64,
    lease_ms: i64,
}

impl ReaderLease {
    pub fn token(&self) -> i64 {
        self.token
    }

    /// False when a newer holder took the reader over.
    pub async fn renew(&self) -> LedgerResult<bool> {
        Ok(
            readers::renew_reader_lease(&self.reader.pool, &self.reader.name, self.token, self.lease_ms)
                .await?,
        )
    }

    /// Gives the lease up (it expires now), so a successor need not wait.
    pub async fn release(&self) -> LedgerResult<bool> {
        Ok(readers::renew_reader_lease(&self.reader.pool, &self.reader.name, self.token, 0).await?)
    }

    /// Advances the checkpoint; false (nothing written) when fenced out.
    pub async fn advance(&self, to: Checkpoint) -> LedgerResult<bool> {
        Ok(readers::advance_checkpoint(
            &self.reader.pool,
            &self.reader.name,
            self.token,
            to.txid,
            to.position,
        )
        .await?)
    }
}

/// The projections crate reads the log through this reader (one reader for
/// the relay and the projections).
impl jobledger_projections::LogSource for LogReader {
    fn read(
        &self,
        after: jobledger_projections::Checkpoint,
        limit: i64,
        data: jobledger_projections::DataWanted,
    ) -> jobledger_projections::BoxFuture<
        '_,
        Result<
            (
                Vec<jobledger_projections::Event>,
                jobledger_projections::Checkpoint,
            ),
            jobledger_projections::ProjectionError,
        >,
    > {
        // On a task of its own: decoding a batch is about a third of a
        // rebuild's client work, and the runner reads the next batch while
        // it applies this one (`Runner::advance`). Polled in the runner's
        // task, the two took turns on one thread; `jobs_rebuilt`'s rebuild
        // was bound by that thread (issue 15). Dropping the read aborts it.
        let reader = self.clone();
        let read = AbortOnDropHandle::new(tokio::spawn(async move {
            let from = Checkpoint {
                txid: after.txid,
                position: after.position,
            };
            let batch = reader
                .read_data(from, limit, data.kinds, data.keys, data.hashes)
                .await?;
            let events = batch.events.into_iter().map(to_projection_event).collect();
            let next = jobledger_projections::Checkpoint {
                txid: batch.next.txid,
                position: batch.next.position,
            };
            Ok::<_, LedgerError>((events, next))
        }));
        Box::pin(async move {
            let log = |e: String| jobledger_projections::ProjectionError::Log(e);
            read.await
                .map_err(|e| log(e.to_string()))?
                .map_err(|e| log(e.to_string()))
        })
    }

    fn behind(
        &self,
        after: jobledger_projections::Checkpoint,
    ) -> jobledger_projections::BoxFuture<'_, Result<bool, jobledger_projections::ProjectionError>> {
        Box::pin(async move {
            LogReader::behind(
                self,
                Checkpoint {
                    txid: after.txid,
                    position: after.position,
                },
            )
            .await
            .map_err(|e| jobledger_projections::ProjectionError::Log(e.to_string()))
        })
    }
}
