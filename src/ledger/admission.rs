//! The claim of a queue with limits, and the answers to "why has this job
//! not started yet?" (docs/admission.md).
//!
//! A claim first runs the plain claim statement, which leases nothing from
//! a queue whose control row is paused, limited or rated; only when it
//! found nothing does the claim look at the queue's row and, for a limited
//! queue, take this path. A queue without controls therefore pays nothing.
//!
//! Lock order inside one limited claim: the queue's row (rated queues
//! only), then job rows (SKIP LOCKED: never waits), then the keys' advisory
//! locks, sorted. Every limited claim takes them in that order, so two
//! claims cannot wait on each other in a cycle.

use std::collections::{BTreeSet, HashMap};

use sqlx::PgConnection;
use uuid::Uuid;

use super::error::LedgerResult;
use super::lease::Lease;
use super::Ledger;
use crate::domain::admission::RateLimit;
use crate::domain::{Job, JobState};
use crate::store::admission::{self as adm, Candidate};
use crate::store::jobs::Locked;
use crate::store::StoreError;

/// How many rows a limited claim looks at per lease it may grant: enough
/// that keys at their cap leave room for the others in one pass.
const POOL_PER_LEASE: i64 = 2;
/// How many keys a limited claim walks per row of its pool.
const KEYS_PER_LEASE: i64 = 4;

impl Ledger {
    /// The limited claim: at most `limit` leases, within the rate budget
    /// and every covering concurrency cap, keys taken in turn (the first
    /// job of each key, then the second of each, ...) so one hot key
    /// cannot take every lease of a claim.
    pub(super) async fn claim_limited(
        &self,
        queue: &str,
        holder: &str,
        lease_ms: i64,
        limit: i64,
    ) -> LedgerResult<Vec<Lease>> {
        let started = std::time::SystemTime::now();
        let mut tx = self.pool.begin().await?;
        let rate = rate_terms(&mut tx, queue).await?;
        let mut limit = limit;
        if let Some(r) = rate {
            let (used, _) = adm::rate_used(&mut *tx, queue, r.per_ms).await?;
            limit = limit.min(i64::from(r.max) - used);
            if limit <= 0 {
                return Ok(vec![]);
            }
        }
        let pool = limit * POOL_PER_LEASE;
        let keys = self.walk_keys(&mut tx, queue, pool).await?;
        let candidates = adm::lock_candidates(&mut tx, queue, holder, pool, &keys).await?;
        let chosen = admit(&mut tx, queue, candidates, limit).await?;
        let (results, spans) = super::ops::write_claims(&mut tx, chosen, holder, lease_ms, started).await?;
        let granted = results.iter().filter(|r| r.committed()).count() as i64;
        if let (Some(r), true) = (rate, granted > 0) {
            adm::record_rate(&mut tx, queue, granted, r.per_ms).await?;
        }
        tx.commit().await?;
        Ok(self.leases_of(results, spans))
    }
}

impl Ledger {
    /// Keys whose first jobs the claim considers: up to `KEYS_PER_LEASE`
    /// per lease, walked from after where this queue's last walk ended
    /// (from the start once a walk reached the end), the ones at their cap
    /// left out. So every key gets its turn however many keys there are,
    /// and a claim costs the same for ten keys or a million.
    async fn walk_keys(&self, conn: &mut PgConnection, queue: &str, pool: i64) -> LedgerResult<Vec<String>> {
        let budget = pool * KEYS_PER_LEASE;
        let after = self.key_cursors.lock().expect("cursors").get(queue).cloned();
        let walked = adm::walk_keys(&mut *conn, queue, after.as_deref(), budget).await?;
        let mut cursors = self.key_cursors.lock().expect("cursors");
        match walked.last() {
            Some((k, _)) if walked.len() as i64 >= budget => cursors.insert(queue.to_string(), k.clone()),
            _ => cursors.remove(queue),
        };
        Ok(walked
            .into_iter()
            .filter(|(_, full)| !full)
            .map(|(k, _)| k)
            .collect())
    }
}

async fn rate_terms(conn: &mut PgConnection, queue: &str) -> LedgerResult<Option<RateLimit>> {
    // The claim found the queue controlled already; its row is locked here
    // (rated queues' claims serialise on it) and the terms read under it.
    let Some(v) = adm::lock_rate(conn, queue).await? else {
        return Ok(None);
    };
    Ok(Some(serde_json::from_value(v).map_err(|e| {
        StoreError::Corrupt(format!("queue {queue:?} rate: {e}"))
    })?))
}

/// The candidates that fit: per capped key, no more than its cap less the
/// leases it holds (counted under the key's lock), keys in turn.
async fn admit(
    conn: &mut PgConnection,
    queue: &str,
    candidates: Vec<Candidate>,
    limit: i64,
) -> LedgerResult<Vec<Locked>> {
    let keys: Vec<String> = candidates
        .iter()
        .filter(|c| c.cap.is_some())
        .filter_map(|c| c.ckey.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    adm::lock_keys(conn, queue, &keys).await?;
    let ids: Vec<Uuid> = candidates.iter().map(|c| c.locked.row.job_id).collect();
    let held: HashMap<String, i64> = adm::held_per_key(&mut *conn, queue, &keys, &ids)
        .await?
        .into_iter()
        .collect();
    // The smallest cap among a key's candidates (kinds may differ) wins.
    let mut cap: HashMap<String, i64> = HashMap::new();
    for c in &candidates {
        if let (Some(k), Some(m)) = (&c.ckey, c.cap) {
            let e = cap.entry(k.clone()).or_insert(i64::from(m));
            *e = (*e).min(i64::from(m));
        }
    }
    let mut room: HashMap<String, i64> = cap
        .into_iter()
        .map(|(k, m)| {
            let h = held.get(&k).copied().unwrap_or(0);
            (k, m - h)
        })
        .collect();
    let mut chosen = in_turn(candidates, &mut room, limit);
    // The claims' time is read now, after the count that admitted them: a
    // lease that freed a slot ended (and committed) before the count, so
    // in the log every lease starts after the one it replaced ended — the
    // candidates' clock, read before waiting for the keys, could be older.
    let now = crate::store::queues::the_clock(conn).await?;
    for c in &mut chosen {
        c.db_now = now;
    }
    Ok(chosen)
}

/// Round-robin over keys in the candidates' order: each key's n-th job
/// comes before any key's n+1-th (unkeyed jobs count as their own key).
fn in_turn(candidates: Vec<Candidate>, room: &mut HashMap<String, i64>, limit: i64) -> Vec<Locked> {
    let mut seen: HashMap<Option<String>, usize> = HashMap::new();
    let mut ranked: Vec<(usize, usize, Candidate)> = candidates
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let n = seen
                .entry(c.ckey.clone().filter(|_| c.cap.is_some()))
                .or_default();
            *n += 1;
            // Unkeyed and uncapped jobs: each its own turn 1.
            let turn = if c.cap.is_some() { *n } else { 1 };
            (turn, i, c)
        })
        .collect();
    ranked.sort_by_key(|(turn, i, _)| (*turn, *i));
    let mut out = vec![];
    for (_, _, c) in ranked {
        if out.len() as i64 >= limit {
            break;
        }
        if let (Some(k), Some(_)) = (&c.ckey, c.cap) {
            let left = room.entry(k.clone()).or_insert(0);
            if *left <= 0 {
                continue;
            }
            *left -= 1;
        }
        out.push(c.locked);
    }
    // The claim decides in job-id order, as the plain claim does.
    out.sort_by_key(|l| l.row.job_id);
    out
}

/// Why a queued job has not been leased, beyond its run_at: one line per
/// reason (its queue's pause is said elsewhere).
impl Ledger {
    pub async fn admission_waits(&self, j: &Job) -> LedgerResult<Vec<String>> {
        let mut why = vec![];
        if j.state != JobState::Queued {
            return Ok(why);
        }
        let status = self.queue_status(&j.queue).await?;
        if let Some(r) = status.rate {
            let (used, frees) = adm::rate_used(&self.pool, &j.queue, r.per_ms).await?;
            if used >= i64::from(r.max) {
                let at = frees.map(crate::domain::digest::fmt_time).unwrap_or_default();
                why.push(format!(
                    "queue rate limit: {used} of {} claims in the last {} ms; the next frees at {at}",
                    r.max, r.per_ms
                ));
            }
        }
        let key = j.admission.as_ref().and_then(|a| a.concurrency_key.as_deref());
        if let Some(key) = key {
            let covering: Vec<(&String, i32)> = status
                .limits
                .iter()
                .filter(|(_, l)| l.covers(&j.kind, key))
                .map(|(n, l)| (n, l.max))
                .collect();
            if let Some((name, cap)) = covering.iter().min_by_key(|(_, m)| *m) {
                let held = adm::held_per_key(&self.pool, &j.queue, &[key.to_string()], &[])
                    .await?
                    .first()
                    .map_or(0, |(_, n)| *n);
                if held >= i64::from(*cap) {
                    why.push(format!(
                        "concurrency key {key:?}: {held} of {cap} leased (limit {name:?})"
                    ));
                }
            }
        }
        Ok(why)
    }
}
