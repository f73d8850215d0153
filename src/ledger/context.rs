//! An enqueue's context, remembered between enqueues: one statement before
//! the commit instead of two (the wake-up follows the commit, migration
//! 20261207000001).
//!
//! The `enqueued` event's hash covers its epoch, its time and its policy,
//! so the client must know all three before the insert. Reading them costs
//! a statement of its own per enqueue (issue 15, W1). A single enqueue
//! outside a caller's transaction (`Ledger::enqueue_as`) instead takes them
//! from what the ledger remembers of the last read:
//! - epochs: a read draws a block of them from the sequence and the ledger
//!   hands the rest out. An epoch is still drawn once and used once; the
//!   ones never handed out are gaps, as a rolled-back enqueue leaves. A
//!   key whose purged lifecycle has a higher epoch refuses a lower one
//!   (JL002) as before, and the retry reads afresh.
//! - time: the database clock as read, plus what the client's monotonic
//!   clock measured since the answer arrived. That lags the database
//!   clock by at least the answer's way back.
//! - policies: the registered policy of each (queue, kind) as read.
//!
//! Nothing is trusted: the insert checks, in its own statement, that the
//! time is not ahead of the database clock nor more than `WITHIN_MS`
//! behind it, and that each policy is still the registered one
//! (`store::jobs::insert_new_jobs_checked`). When either fails it writes
//! nothing, the ledger forgets what it remembered and the enqueue reads
//! afresh. So a remembered time or policy is never staler than the
//! database allows (epochs are forgotten with a stale reading), and a
//! policy registered before an enqueue starts always applies to it (a
//! fresh read races a concurrent registration the same way).

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::store::jobs::ContextCheck;

/// Epochs a read draws beyond what its enqueue needs (a block of 64 with
/// a single enqueue's own).
pub(super) const BLOCK: usize = 63;
/// How long a clock reading is extrapolated before an enqueue reads again.
const FRESH_FOR: Duration = Duration::from_millis(500);
/// How far behind the database clock the insert accepts a remembered time
/// (it accepts none ahead of it).
const WITHIN_MS: i64 = 1_000;
/// More remembered policies than this and the ledger forgets them all.
const MAX_POLICIES: usize = 1_024;

/// What one ledger (and its clones) remembers.
#[derive(Clone, Default)]
pub(crate) struct ContextCache(
    Arc<Mutex<Option<Remembered>>>,
    Option<Duration>,
    Option<sqlx::PgPool>,
);

impl std::fmt::Debug for ContextCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ContextCache")
    }
}

struct Remembered {
    epochs: VecDeque<i64>,
    db_now: DateTime<Utc>,
    read_at: Instant,
    /// Per (queue, kind): the registered policy, None when none was.
    policies: HashMap<(String, String), Option<Value>>,
}

/// A context taken from memory: what the enqueue uses, and what its insert
/// must check.
pub(super) struct Taken {
    pub epochs: Vec<i64>,
    pub now: DateTime<Utc>,
    /// The registered policies among the wanted pairs.
    pub registered: Vec<(String, String, Value)>,
    pub check: ContextCheck,
}

impl ContextCache {
    /// The same memory, with its readings used for `d` instead of
    /// `FRESH_FOR` (tests: the remembered path taken however slow the
    /// machine; the insert's check still bounds the time).
    pub(super) fn fresh_for_testing(&self, d: Duration) -> Self {
        ContextCache(self.0.clone(), Some(d), self.2.clone())
    }

    /// Memory for the ledger of `pool`, which sends a wake-up an enqueue
    /// dropped after its commit could not (ledger::enqueue).
    pub(super) fn for_pool(pool: sqlx::PgPool) -> Self {
        ContextCache(Default::default(), None, Some(pool))
    }

    pub(super) fn pool(&self) -> Option<sqlx::PgPool> {
        self.2.clone()
    }

    fn fresh_for(&self) -> Duration {
        self.1.unwrap_or(FRESH_FOR)
    }

    /// `n` epochs, the time and the policies of `pairs`, when all are
    /// remembered and the clock reading is fresh enough.
    pub(super) fn take(&self, n: usize, pairs: &[(String, String)]) -> Option<Taken> {
        let mut guard = self.0.lock().expect("context lock");
        let r = guard.as_mut()?;
        let elapsed = r.read_at.elapsed();
        if elapsed > self.fresh_for() {
            // Epochs go with the reading: an old block would hand out
            // epochs below lifecycles purged since, each refused (JL002).
            *guard = None;
            return None;
        }
        if r.epochs.len() < n || !pairs.iter().all(|p| r.policies.contains_key(p)) {
            return None;
        }
        // Microseconds, as the database keeps time: the hash covers the
        // time as stored.
        let micros = TimeDelta::microseconds(elapsed.as_micros() as i64);
        let now = r.db_now + micros;
        let epochs = r.epochs.drain(..n).collect();
        let mut registered = Vec::new();
        let mut seen = Vec::with_capacity(pairs.len());
        for (q, k) in pairs {
            let p = r.policies[&(q.clone(), k.clone())].clone();
            seen.push(serde_json::json!([q, k, p]));
            if let Some(p) = p {
                registered.push((q.clone(), k.clone(), p));
            }
        }
        Some(Taken {
            epochs,
            now,
            registered,
            check: ContextCheck {
                now,
                within_ms: WITHIN_MS,
                policies: Value::Array(seen),
            },
        })
    }

    /// Remembers what a fresh read brought beyond its own enqueue's needs:
    /// `epochs` left over, the clock as read (the answer arrived at
    /// `read_at`) and the policies of `pairs` (`registered` those that are).
    pub(super) fn remember(
        &self,
        epochs: Vec<i64>,
        db_now: DateTime<Utc>,
        read_at: Instant,
        pairs: &[(String, String)],
        registered: &[(String, String, Value)],
    ) {
        let mut guard = self.0.lock().expect("context lock");
        if guard
            .as_ref()
            .is_some_and(|r| r.read_at.elapsed() > self.fresh_for())
        {
            *guard = None;
        }
        let r = guard.get_or_insert_with(|| Remembered {
            epochs: VecDeque::new(),
            db_now,
            read_at,
            policies: HashMap::new(),
        });
        // The epochs go with the newest reading only: a block drawn with
        // an older one would outlive it (and be handed out below
        // lifecycles purged since, each refused: JL002). Those dropped are
        // gaps.
        if read_at >= r.read_at {
            (r.db_now, r.read_at) = (db_now, read_at);
            r.epochs = epochs.into();
        }
        if r.policies.len() + pairs.len() > MAX_POLICIES {
            r.policies.clear();
        }
        for p in pairs {
            r.policies.insert(p.clone(), None);
        }
        for (q, k, v) in registered {
            r.policies.insert((q.clone(), k.clone()), Some(v.clone()));
        }
    }

    /// Moves the remembered clock reading by `by`: a test's way to make the
    /// client's idea of the database clock wrong.
    pub(super) fn shift(&self, by: TimeDelta) {
        if let Some(r) = self.0.lock().expect("context lock").as_mut() {
            r.db_now += by;
        }
    }

    /// Forgets everything: the database refused what was remembered (or an
    /// enqueue failed and will read afresh).
    pub(super) fn forget(&self) {
        *self.0.lock().expect("context lock") = None;
    }
}
