//! The catch-up runner: one batch at a time, the projection's writes and its
//! checkpoint in one transaction; versioned rebuilds with an atomic switch.

use sqlx::PgPool;

use crate::registry::{self, Entry};
use crate::{Checkpoint, Event, LogSource, Projection, ProjectionError};

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub applied: usize,
    pub rebuilt: usize,
    pub switched_to: Option<i32>,
    /// Another runner moved a table between this step's read and its write:
    /// progress, but nothing is known about being caught up.
    pub raced: bool,
}

/// What one `advance` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Advanced {
    /// Applied this many events and moved the checkpoint.
    Applied(usize),
    /// The read was empty: nothing below the horizon past the checkpoint.
    Empty,
    /// Another runner moved the checkpoint between our read and our write:
    /// nothing was applied, and nothing is known about being caught up.
    Raced,
}

impl Advanced {
    fn count(self) -> usize {
        match self {
            Advanced::Applied(n) => n,
            Advanced::Empty | Advanced::Raced => 0,
        }
    }
}

pub struct Runner<'a> {
    pool: PgPool,
    log: &'a dyn LogSource,
    batch: i64,
    pub(crate) patience: std::time::Duration,
    /// After a switch could not take its locks, the next try waits this
    /// long: each try queues an exclusive lock that new readers of the view
    /// wait behind.
    next_switch: std::sync::Mutex<Option<std::time::Instant>>,
    /// The batch read while the previous one was being applied (see
    /// `advance`).
    ahead: std::sync::Mutex<std::collections::HashMap<(String, bool), Ahead>>,
}

/// A batch read ahead, kept per table (projection name, rebuild or not):
/// used only by that table's next `advance` and only if it starts where that
/// one starts. A batch read from a checkpoint stays a valid batch from it:
/// everything in it was committed below the horizon when it was read, and
/// what commits later sorts after it.
struct Ahead {
    from: Checkpoint,
    /// The data it was read with (`Projection::data_wanted`): after a
    /// switch the table's next batch is the new version's, which may need
    /// data the old one did not read.
    data: crate::DataWanted,
    events: Vec<Event>,
    next: Checkpoint,
}

/// How long `catch_up` waits with nothing moving before it gives up: long
/// enough for a slow commit, short enough that a forgotten open transaction
/// is reported instead of hanging the caller.
pub const DEFAULT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a switch waits for sessions reading the view or the old table.
pub const SWITCH_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long after a switch that timed out the next one is tried.
pub const SWITCH_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether `newest` is to be built: it is newer than the serving version,
/// and no rebuild is under way but one of an older version. That one only
/// code of its own version builds (`step`), and no running binary may have
/// it any more (a version skipped in an upgrade, or `projections rebuild`
/// run just before one): left alone, it would hold the projection still for
/// good. A rebuild of a newer version is left to the newer code (a rolling
/// upgrade).
fn builds_anew(e: &Entry, newest: &dyn Projection) -> bool {
    e.version < newest.version() && e.building_version.is_none_or(|b| b < newest.version())
}

/// Starts building `p` into a new `table` in `tx` (which holds the registry
/// row), replacing the rebuild in `older` if any, and commits. `table` is
/// created, never dropped: a name that exists (a rebuild's timestamped name
/// met again, on a clock set back) fails the creation instead of dropping
/// what may be the serving table.
async fn build_into(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    p: &dyn Projection,
    older: Option<&str>,
    table: &str,
) -> Result<(), ProjectionError> {
    if let Some(older) = older {
        registry::drop_table(&mut tx, older).await?;
    }
    p.create(&mut tx, &format!("jobledger_proj.\"{table}\"")).await?;
    registry::start_build(&mut tx, p.name(), p.version(), table).await?;
    tx.commit().await?;
    Ok(())
}

/// Waits between tries that moved nothing: 5 ms, doubling up to 250 ms,
/// and back to 5 ms after a try that moved something.
pub(crate) struct Backoff(std::time::Duration);

impl Backoff {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(5);
    const MOST: std::time::Duration = std::time::Duration::from_millis(250);

    pub(crate) fn new() -> Self {
        Backoff(Self::FIRST)
    }
    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Self::MOST);
    }
    pub(crate) fn reset(&mut self) {
        self.0 = Self::FIRST;
    }
}

fn serves(versions: &[&dyn Projection], e: &Entry) -> bool {
    versions.iter().any(|p| p.version() == e.version)
}

pub fn table_name(name: &str, version: i32) -> String {
    format!("{name}_v{version}")
}

impl<'a> Runner<'a> {
    pub async fn new(pool: PgPool, log: &'a dyn LogSource, batch: i64) -> Result<Self, ProjectionError> {
        registry::install(&pool).await?;
        Ok(Runner {
            pool,
            log,
            batch,
            patience: DEFAULT_PATIENCE,
            next_switch: std::sync::Mutex::new(None),
            ahead: std::sync::Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// Sets how long `catch_up` may go without progress (see
    /// [`DEFAULT_PATIENCE`]).
    pub fn with_patience(mut self, patience: std::time::Duration) -> Self {
        self.patience = patience;
        self
    }

    /// Registers the projection if new, starts a rebuild if its code is
    /// newer than what serves, and advances both tables by one batch.
    /// `versions` are all loaded versions of one projection name: the one
    /// matching the serving version keeps the old table current while the
    /// newest is rebuilt.
    pub async fn step(&self, versions: &[&dyn Projection]) -> Result<Step, ProjectionError> {
        self.step_only(versions, None).await
    }

    /// `step`, carrying on only the rebuild into `only` when it is given
    /// (`finish_rebuild`): another runner may have switched that one in and
    /// started the next since the caller looked.
    pub(crate) async fn step_only(
        &self,
        versions: &[&dyn Projection],
        only: Option<&str>,
    ) -> Result<Step, ProjectionError> {
        let newest = *versions
            .iter()
            .max_by_key(|p| p.version())
            .ok_or_else(|| ProjectionError::Unknown("none".into()))?;
        let name = newest.name().to_string();
        let entry = self.ensure(newest).await?;
        let entry = if builds_anew(&entry, newest) {
            self.start_build(newest).await?
        } else {
            entry
        };
        let mut step = Step::default();
        if let Some(serving) = versions.iter().find(|p| p.version() == entry.version) {
            let served = self.advance(*serving, &entry, false).await?;
            step.applied = served.count();
            step.raced |= served == Advanced::Raced;
        }
        // Only the code of the version being built builds it: an older
        // runner (a rolling upgrade) keeps its serving table current and
        // leaves a newer version's rebuild alone.
        let builder = entry
            .live_building_version()
            .and_then(|v| versions.iter().find(|p| p.version() == v));
        if let Some(builder) = builder {
            // Read again: another runner may have switched and started a
            // new rebuild since this step read the row, and an empty read
            // from the old rebuild's checkpoint would say nothing of it.
            let now = self.entry(&name).await?;
            if only.is_some_and(|t| now.building_table.as_deref() != Some(t)) {
                return Ok(step);
            }
            let built = self.advance(*builder, &now, true).await?;
            step.rebuilt = built.count();
            step.raced |= built == Advanced::Raced;
            // Only a genuinely empty read says the rebuild caught up; a lost
            // race (another runner moved the checkpoint) says nothing.
            let due = self
                .next_switch
                .lock()
                .expect("not poisoned")
                .is_none_or(|t| std::time::Instant::now() >= t);
            if built == Advanced::Empty && due {
                let table = now.building_table.as_deref().unwrap_or_default();
                step.switched_to = self.switch(&name, table).await?;
            }
        }
        Ok(step)
    }

    /// Starts building `newest` beside the serving table if, under the
    /// registry lock, it still should (`builds_anew`): `step` decided on an
    /// unlocked read, and acting on a stale one let two runners build at
    /// once (one failed or dropped the other's table) and let a runner that
    /// read before a switch drop the table that now served. A rebuild of an
    /// older version is dropped and replaced.
    async fn start_build(&self, newest: &dyn Projection) -> Result<Entry, ProjectionError> {
        let name = newest.name();
        let mut tx = self.pool.begin().await?;
        let now = registry::lock(&mut tx, name)
            .await?
            .ok_or_else(|| ProjectionError::Unknown(name.into()))?;
        if !builds_anew(&now, newest) {
            return Ok(now);
        }
        let table = table_name(name, newest.version());
        registry::drop_table(&mut tx, &table).await?; // a build that never finished restarts cleanly
        build_into(tx, newest, now.building_table.as_deref(), &table).await?;
        self.entry(name).await
    }

    /// Rebuilds the current version from position 0 into a fresh table
    /// while the serving one keeps serving; `step` carries it on (also after
    /// a crash: the rebuild's table and checkpoint are in the registry).
    pub async fn start_rebuild(&self, p: &dyn Projection) -> Result<String, ProjectionError> {
        self.ensure(p).await?;
        let mut tx = self.pool.begin().await?;
        let e = registry::lock(&mut tx, p.name())
            .await?
            .ok_or_else(|| ProjectionError::Unknown(p.name().into()))?;
        // Older code (a rollback) would switch the view back to an older
        // version, which newer runners then build anew.
        crate::rebuild::not_older_than_serving(&e, p)?;
        match (e.building_version, &e.building_table) {
            // One rebuild at a time: resume one of this version.
            (Some(v), Some(t)) if v == p.version() => return Ok(t.clone()),
            (Some(v), Some(_)) if v > p.version() => {
                return Err(ProjectionError::NewerRebuild {
                    name: p.name().into(),
                    building: v,
                    ours: p.version(),
                })
            }
            // An older version's (its code may be gone) is replaced.
            _ => {}
        }
        let table = format!(
            "{}_r{}",
            table_name(p.name(), p.version()),
            chrono::Utc::now().timestamp_millis()
        );
        build_into(tx, p, e.building_table.as_deref(), &table).await?;
        Ok(table)
    }

    pub(crate) async fn entry(&self, name: &str) -> Result<Entry, ProjectionError> {
        let mut conn = self.pool.acquire().await?;
        registry::get(&mut conn, name)
            .await?
            .ok_or_else(|| ProjectionError::Unknown(name.into()))
    }

    async fn ensure(&self, p: &dyn Projection) -> Result<Entry, ProjectionError> {
        // Registered already (every step but the first): no transaction.
        if let Some(e) = registry::get(&mut *self.pool.acquire().await?, p.name()).await? {
            return Ok(e);
        }
        crate::rebuild::check_projection(p.name(), p.version())?;
        let mut tx = self.pool.begin().await?;
        // Two runners registering a new projection at once would both
        // create its table (there is no registry row to lock yet).
        registry::lock_name(&mut tx, p.name()).await?;
        if let Some(e) = registry::lock(&mut tx, p.name()).await? {
            return Ok(e);
        }
        if registry::name_taken(&mut tx, p.name()).await? {
            return Err(ProjectionError::BadName {
                name: p.name().into(),
                reason: "a table, index, sequence or type of jobledger_proj has that name",
            });
        }
        let table = table_name(p.name(), p.version());
        p.create(&mut tx, &format!("jobledger_proj.\"{table}\"")).await?;
        registry::register(&mut tx, p.name(), p.version(), &table).await?;
        registry::point_view(&mut tx, p.name(), &table).await?;
        tx.commit().await?;
        self.entry(p.name()).await
    }

    /// One batch into the serving table or the one being rebuilt, as
    /// `before` (the registry row, read unlocked) places it. The read
    /// happens before the transaction (a transaction holding an xid would
    /// hold back the reader's own horizon); the transaction then locks the
    /// registry row and applies only if nobody moved the checkpoint meanwhile.
    ///
    /// While a full batch is applied, the next one is read on another
    /// connection (a rebuild from position 0 spent about as long reading as
    /// applying). Our own open transaction holds that read's horizon back,
    /// so it may come back short or empty; an empty one is dropped, never
    /// taken for "caught up", and the next `advance` reads again.
    async fn advance(
        &self,
        p: &dyn Projection,
        before: &Entry,
        building: bool,
    ) -> Result<Advanced, ProjectionError> {
        let name = before.name.as_str();
        // No rebuild any more: another runner switched it in meanwhile.
        let Some((from, table, _)) = before.target(building) else {
            return Ok(Advanced::Raced);
        };
        let table = table.to_string();
        let (events, next) = match self.take_ahead(name, building, from, p.data_wanted()) {
            Some(batch) => batch,
            None => self.log.read(from, self.batch, p.data_wanted()).await?,
        };
        if events.is_empty() {
            return Ok(Advanced::Empty);
        }
        // The log's own events (signed checkpoints) are no job's: read
        // models of jobs never see them, and the checkpoint still moves
        // past them.
        let read = events.len();
        let full = read as i64 >= self.batch;
        let events: Vec<Event> = events.into_iter().filter(|e| !e.is_log_event()).collect();
        let mut tx = self.pool.begin().await?;
        let now = registry::lock(&mut tx, name)
            .await?
            .ok_or_else(|| ProjectionError::Unknown(name.into()))?;
        // Another runner moved the checkpoint (our batch would apply twice),
        // or the table or its version changed under us: a switch and a new
        // rebuild both start a checkpoint at (0, 0), so a batch read for the
        // rebuild before them would otherwise land in the table that now
        // serves and move the new rebuild's checkpoint past events it never
        // got; and a switch meanwhile would have old code write the new
        // version's table.
        if now.target(building) != Some((from, table.as_str(), p.version())) {
            return Ok(Advanced::Raced);
        }
        let table = format!("jobledger_proj.\"{table}\"");
        if building {
            // Each batch's commit waited for its flush: about a twentieth of
            // a rebuild (issue 15). The switch's commit flushes them all.
            registry::commit_without_flush(&mut tx).await?;
        }
        let apply = async {
            p.apply(&mut tx, &table, &events).await?;
            registry::set_checkpoint(&mut tx, name, building, next).await?;
            tx.commit().await?;
            Ok::<_, ProjectionError>(())
        };
        let read_ahead = async {
            if full {
                self.log.read(next, self.batch, p.data_wanted()).await.ok()
            } else {
                None
            }
        };
        let (applied, ahead) = tokio::join!(apply, read_ahead);
        applied?;
        if let Some((events, after)) = ahead.filter(|(e, _)| !e.is_empty()) {
            self.ahead.lock().expect("not poisoned").insert(
                (name.to_string(), building),
                Ahead {
                    from: next,
                    data: p.data_wanted(),
                    events,
                    next: after,
                },
            );
        }
        Ok(Advanced::Applied(read))
    }

    /// Whether one of `versions` is the serving one.
    async fn serves(&self, versions: &[&dyn Projection]) -> Result<bool, ProjectionError> {
        let name = versions.first().map(|p| p.name()).unwrap_or_default();
        Ok(serves(versions, &self.entry(name).await?))
    }

    /// The batch read ahead for this table from `from` with `data`, if
    /// there is one (any other is stale and dropped).
    fn take_ahead(
        &self,
        name: &str,
        building: bool,
        from: Checkpoint,
        data: crate::DataWanted,
    ) -> Option<(Vec<Event>, Checkpoint)> {
        let a = self
            .ahead
            .lock()
            .expect("not poisoned")
            .remove(&(name.to_string(), building))?;
        (a.from == from && a.data == data).then_some((a.events, a.next))
    }

    /// The rebuilt table caught up with the live tail: the view moves to it
    /// and the old table goes, in one transaction. Under the registry lock
    /// (which every runner's write takes), and only when the rebuild's
    /// checkpoint is not behind the serving table's: the view never serves a
    /// table behind the one it replaced (both follow the same reader, so the
    /// one further along holds every version the other holds). Events
    /// committed behind an open transaction do not stop the switch: the
    /// serving table cannot have them either, and under steady load some
    /// always wait there (waiting for a quiet log starved the switch).
    /// Otherwise the next step tries again; so it does when a session keeps
    /// the view or the old table open (a transaction that read it): the DDL
    /// waits at most `SWITCH_LOCK_WAIT` for it instead of blocking every
    /// runner behind the registry lock.
    async fn switch(&self, name: &str, built: &str) -> Result<Option<i32>, ProjectionError> {
        let mut tx = self.pool.begin().await?;
        let Some(e) = registry::lock(&mut tx, name).await? else {
            return Ok(None);
        };
        // Only the rebuild this step found caught up: another runner may
        // have switched it in and started the next one meanwhile.
        let Some(new_table) = e.building_table.clone().filter(|t| t == built) else {
            return Ok(None);
        };
        if e.building_checkpoint() < e.checkpoint() || e.live_building_version().is_none() {
            return Ok(None);
        }
        registry::limit_lock_wait(&mut tx, SWITCH_LOCK_WAIT).await?;
        let moved = async {
            registry::point_view(&mut tx, name, &new_table).await?;
            registry::promote(&mut tx, name).await?;
            registry::drop_table(&mut tx, &e.active_table).await
        }
        .await;
        match moved {
            Err(e) if registry::is_lock_timeout(&e) => {
                // Rolled back; tried again after SWITCH_RETRY, not at once.
                *self.next_switch.lock().expect("not poisoned") =
                    Some(std::time::Instant::now() + SWITCH_RETRY);
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
            Ok(()) => {}
        }
        tx.commit().await?;
        Ok(e.building_version)
    }

    /// Runs steps until one finds nothing more to apply and nothing waiting
    /// behind the log horizon: the serving table (and any rebuild) then has
    /// every event committed before the call. Under a steady stream of
    /// commits it keeps applying them as they come. While an open
    /// transaction of this database holds the horizon back, later commits
    /// wait behind it, and so does this (backing off up to 250 ms between
    /// tries). A wait in which no checkpoint moves (this runner's or another
    /// one's) for longer than the runner's patience ends in
    /// `ProjectionError::Stalled`, so a held horizon is reported instead of
    /// hanging the caller. A rebuild whose switch cannot take its locks
    /// (`SWITCH_LOCK_WAIT`) is left for a later step: the call returns
    /// without it (`switched_to` is `None`).
    pub async fn catch_up(&self, versions: &[&dyn Projection]) -> Result<Step, ProjectionError> {
        let mut total = Step::default();
        let mut idle = Backoff::new();
        let mut moved = std::time::Instant::now();
        // Progress is the registry's checkpoints moving, also by another
        // runner that keeps winning the race for the same batches.
        let mut seen: Option<(Checkpoint, Checkpoint)> = None;
        // A switch that keeps timing out (a session holds the view) is not
        // progress, however much the tables move: from the first timeout in
        // this call, the patience runs without resetting.
        let timed_out_before = *self.next_switch.lock().expect("not poisoned");
        let mut switch_blocked: Option<std::time::Instant> = None;
        loop {
            let s = self.step(versions).await?;
            total.applied += s.applied;
            total.rebuilt += s.rebuilt;
            total.switched_to = total.switched_to.or(s.switched_to);
            let switch_timed_out = *self.next_switch.lock().expect("not poisoned") != timed_out_before;
            if total.switched_to.is_none() && switch_timed_out && !self.serves(versions).await? {
                let since = *switch_blocked.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() >= self.patience {
                    let name = versions.first().map(|p| p.name()).unwrap_or_default();
                    return Err(ProjectionError::Stalled {
                        name: name.to_string(),
                        waited: since.elapsed(),
                    });
                }
            }
            // A lost race is progress (another runner applied that batch),
            // not a sign of being caught up.
            if s.applied == 0 && s.rebuilt == 0 && s.switched_to.is_none() && !s.raced {
                let name = versions.first().map(|p| p.name()).unwrap_or_default();
                let e = self.entry(name).await?;
                // Code older than the serving version never advances it.
                let serves = serves(versions, &e);
                // Code newer than it is caught up only once its rebuild has
                // switched in: until then the view serves the old version
                // (a lost race or a switch that timed out moved nothing).
                let ours_unswitched = !serves
                    && e.live_building_version()
                        .is_some_and(|v| versions.iter().any(|p| p.version() == v));
                if !ours_unswitched && (!serves || !self.log.behind(e.checkpoint()).await?) {
                    return Ok(total);
                }
                let now_at = (e.checkpoint(), e.building_checkpoint());
                if seen.is_some_and(|s| s != now_at) {
                    moved = std::time::Instant::now();
                }
                seen = Some(now_at);
                if moved.elapsed() >= self.patience {
                    return Err(ProjectionError::Stalled {
                        name: name.to_string(),
                        waited: moved.elapsed(),
                    });
                }
                idle.wait().await;
            } else {
                idle.reset();
                moved = std::time::Instant::now();
            }
        }
    }
}

/// Whether `name`'s serving table has applied the event at `position`
/// (`txid` of that event from the log): read-your-writes.
pub async fn reached(pool: &PgPool, name: &str, txid: i64, position: i64) -> Result<bool, ProjectionError> {
    let entries = registry::entries(pool).await?;
    let e = entries
        .iter()
        .find(|e| e.name == name)
        .ok_or_else(|| ProjectionError::Unknown(name.into()))?;
    Ok(e.checkpoint() >= Checkpoint { txid, position })
}

/// The answer to a minimum-position read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// The projection has applied the event at the asked position.
    Reached,
    /// It has not within the timeout: the caller says `pending` rather than
    /// silently showing an older generation.
    Pending,
}

/// Waits up to `timeout` for `name` to reach the event at (`txid`,
/// `position`).
pub async fn wait_for(
    pool: &PgPool,
    name: &str,
    txid: i64,
    position: i64,
    timeout: std::time::Duration,
) -> Result<Freshness, ProjectionError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if reached(pool, name, txid, position).await? {
            return Ok(Freshness::Reached);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(Freshness::Pending);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
