//! A log reader's memory of where it met each job's highest version
//! (docs/log-reader.md, trap 2): `left_out` does not look up a version the
//! reader met at or before a batch's end.

use chrono::{DateTime, Utc};
use std::collections::HashMap;
use uuid::Uuid;

/// Where a job's highest version seen lies in the reader's order.
#[derive(Clone, Copy)]
pub(super) struct Place {
    pub(super) version: i64,
    pub(super) at: (i64, i64),
}

/// The places of the jobs a reader has met, in two generations of at most
/// `SEEN_JOBS` each: when the young one fills it becomes the old one and
/// the old one is dropped, so memory stays bounded (about 43 MB; about 54
/// MB for a moment while the young one's table grows to its last size) and
/// recent jobs are kept. An event's `(txid, position)` never changes
/// (the log is append-only), so a place is true whatever batch, reader
/// order or checkpoint asks; forgetting one only costs a probe.
///
/// "Never changes" holds within one history of the database: restored from
/// a backup, created again or failed over under a running process, the
/// log may hold other events at the places remembered, so each read names
/// the history it read (`readers::log_history`) and a new one forgets all.
#[derive(Default)]
pub(super) struct Seen {
    young: HashMap<Uuid, Place>,
    old: HashMap<Uuid, Place>,
    pub(super) history: Option<History>,
}

/// `readers::log_history`: the events table's oid and the server's start.
pub(super) type History = (i64, DateTime<Utc>);

/// A rebuild of a 1,000,000-event log meets about 333,000 jobs, enqueued
/// long before they are claimed: one generation keeps them. Seven eighths
/// of 2^19, so that a full generation's table still has 2^19 buckets of
/// 41 bytes (about 21 MB) instead of growing to 2^20.
const SEEN_JOBS: usize = 7 << 16;

impl Seen {
    /// Forgets everything remembered of another history than `history`.
    pub(super) fn follow(&mut self, history: History) {
        if self.history != Some(history) {
            *self = Seen {
                history: Some(history),
                ..Seen::default()
            };
        }
    }

    pub(super) fn get(&self, job: &Uuid) -> Option<Place> {
        self.young.get(job).or_else(|| self.old.get(job)).copied()
    }

    /// Remembers where `job`'s version lies, if it is the job's highest yet.
    pub(super) fn remember(&mut self, job: Uuid, place: Place) {
        if self.get(&job).is_some_and(|p| p.version >= place.version) {
            return;
        }
        if self.young.len() >= SEEN_JOBS && !self.young.contains_key(&job) {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(job, place);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(version: i64) -> Place {
        Place {
            version,
            at: (version, version),
        }
    }

    #[test]
    fn seen_keeps_each_jobs_highest_version() {
        let mut seen = Seen::default();
        let job = Uuid::new_v4();
        seen.remember(job, place(3));
        seen.remember(job, place(2));
        assert_eq!(seen.get(&job).map(|p| p.version), Some(3));
        seen.remember(job, place(4));
        assert_eq!(seen.get(&job).map(|p| (p.version, p.at)), Some((4, (4, 4))));
    }

    #[test]
    fn another_history_forgets_everything() {
        let mut seen = Seen::default();
        let (job, at) = (Uuid::new_v4(), DateTime::<Utc>::UNIX_EPOCH);
        seen.follow((1, at));
        seen.remember(job, place(2));
        seen.follow((1, at));
        assert!(seen.get(&job).is_some(), "the same history keeps it");
        seen.follow((2, at));
        assert!(seen.get(&job).is_none(), "another table forgets it");
        seen.remember(job, place(2));
        seen.follow((2, at + chrono::Duration::seconds(1)));
        assert!(seen.get(&job).is_none(), "another server start forgets it");
        assert_eq!(seen.history, Some((2, at + chrono::Duration::seconds(1))));
    }

    #[test]
    fn seen_forgets_the_oldest_generation_only() {
        let mut seen = Seen::default();
        let first = Uuid::new_v4();
        seen.remember(first, place(1));
        for _ in 1..SEEN_JOBS {
            seen.remember(Uuid::new_v4(), place(1));
        }
        // The young generation is full: the next job moves it to the old one.
        seen.remember(Uuid::new_v4(), place(1));
        assert!(seen.get(&first).is_some(), "kept in the old generation");
        // A job of the old generation that moves is remembered anew, young.
        seen.remember(first, place(2));
        assert_eq!(seen.get(&first).map(|p| p.version), Some(2));
        let forgotten = seen.old.keys().find(|k| **k != first).copied().unwrap();
        for _ in 0..SEEN_JOBS {
            seen.remember(Uuid::new_v4(), place(1));
        }
        assert!(seen.get(&forgotten).is_none(), "two generations on, forgotten");
        assert!(seen.young.len() + seen.old.len() <= 2 * SEEN_JOBS);
    }
}
