//! A log reader's memory of where it met each job's events (docs/log-reader.md,
//! trap 2): `left_out` does not look up a version the reader met at or
//! before a batch's end.

use std::collections::HashMap;
use uuid::Uuid;

use crate::store::readers::LogHistory;

/// Where the reader met a job's lowest and highest versions, in its order
/// `(txid, position)`. The lowest answers a pass that starts again from an
/// earlier checkpoint (a rebuild through a reader that has read the log: a
/// claim batch asks for v1), the highest one that follows on (a completion
/// batch asks for the claim). Versions past `u32::MAX` are not remembered.
#[derive(Clone, Copy)]
struct Ends {
    low: u32,
    high: u32,
    low_at: (i64, i64),
    high_at: (i64, i64),
}

/// The jobs a reader has met, at most `SEEN_JOBS`; when full it starts
/// again from nothing, keeping its table (about 30 MB at most, 45 MB for a
/// moment while the table grows to its last size). An event's
/// `(txid, position)` never changes (the log is append-only), so a place
/// is true whatever batch, reader order or checkpoint asks; forgetting one
/// only costs a probe.
///
/// "Never changes" holds within one history of the database: restored from
/// a backup, created again, truncated and loaded again, or failed over
/// under a running process, the log may hold other events at the places
/// remembered. So a read reads only from the history the memory is of
/// (`readers::LogHistory`, checked in the read's own statement), and a new
/// one forgets all. Rows deleted or written again in place around the
/// append-only triggers keep the history: stop the readers for such a
/// repair, as for any process holding log positions in memory
/// (docs/log-reader.md).
#[derive(Default)]
pub(super) struct Seen {
    jobs: HashMap<Uuid, Ends>,
    pub(super) history: Option<LogHistory>,
}

/// A rebuild of a 1,000,000-event log meets about 333,000 jobs, enqueued
/// long before they are claimed: they all fit. Seven eighths of 2^19, so
/// that a full table still has 2^19 buckets of 57 bytes instead of growing
/// to 2^20.
const SEEN_JOBS: usize = 7 << 16;

impl Seen {
    /// Forgets everything remembered of another history than `history`.
    pub(super) fn follow(&mut self, history: LogHistory) {
        if self.history != Some(history) {
            self.jobs = HashMap::new();
            self.history = Some(history);
        }
    }

    /// Where the reader met `version` of `job` in `history`, if it
    /// remembers. Memory of another history (a clone met a newer one
    /// meanwhile, or the asking read is of an older one) answers nothing.
    pub(super) fn at(&self, history: LogHistory, job: &Uuid, version: i64) -> Option<(i64, i64)> {
        if self.history != Some(history) {
            return None;
        }
        let ends = self.jobs.get(job)?;
        let version = u32::try_from(version).ok()?;
        if ends.low == version {
            Some(ends.low_at)
        } else if ends.high == version {
            Some(ends.high_at)
        } else {
            None
        }
    }

    /// Remembers the places a read of `history` met, unless a clone has
    /// read a newer history meanwhile (a connection still on the old
    /// primary after a failover): they are not of it.
    pub(super) fn remember_read(
        &mut self,
        history: LogHistory,
        places: impl Iterator<Item = (Uuid, i64, (i64, i64))>,
    ) {
        if self.history != Some(history) {
            return;
        }
        for (job, version, at) in places {
            self.remember(job, version, at);
        }
    }

    /// Remembers where `version` of `job` lies, if it is the job's lowest
    /// or highest met yet.
    fn remember(&mut self, job: Uuid, version: i64, at: (i64, i64)) {
        let Ok(v) = u32::try_from(version) else {
            return;
        };
        if let Some(ends) = self.jobs.get_mut(&job) {
            if v < ends.low {
                (ends.low, ends.low_at) = (v, at);
            }
            if v > ends.high {
                (ends.high, ends.high_at) = (v, at);
            }
            return;
        }
        if self.jobs.len() >= SEEN_JOBS {
            self.jobs.clear();
        }
        let ends = Ends {
            low: v,
            high: v,
            low_at: at,
            high_at: at,
        };
        self.jobs.insert(job, ends);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, Utc};

    fn at(v: i64) -> (i64, i64) {
        (v, 10 * v)
    }

    fn history(table: i64, storage: i64, started: DateTime<Utc>) -> LogHistory {
        LogHistory {
            table,
            storage,
            started,
        }
    }

    /// The history the tests of one history read.
    fn h0() -> LogHistory {
        history(1, 1, DateTime::<Utc>::UNIX_EPOCH)
    }

    fn of_h0() -> Seen {
        let mut seen = Seen::default();
        seen.follow(h0());
        seen
    }

    #[test]
    fn seen_keeps_each_jobs_lowest_and_highest_version() {
        let mut seen = of_h0();
        let job = Uuid::new_v4();
        seen.remember(job, 2, at(2));
        seen.remember(job, 3, at(3));
        seen.remember(job, 1, at(1));
        assert_eq!(seen.at(h0(), &job, 1), Some(at(1)));
        assert_eq!(seen.at(h0(), &job, 3), Some(at(3)));
        assert_eq!(seen.at(h0(), &job, 2), None, "neither end: looked up");
        seen.remember(job, 4, at(4));
        assert_eq!(seen.at(h0(), &job, 4), Some(at(4)));
        assert_eq!(seen.at(h0(), &job, 3), None);
        assert_eq!(seen.at(h0(), &Uuid::new_v4(), 1), None);
        let huge = i64::from(u32::MAX) + 1;
        seen.remember(job, huge, at(5));
        assert_eq!(seen.at(h0(), &job, huge), None, "past u32: not remembered");
        assert_eq!(seen.at(h0(), &job, 4), Some(at(4)));
    }

    #[test]
    fn another_history_forgets_everything() {
        let mut seen = Seen::default();
        let (job, start) = (Uuid::new_v4(), DateTime::<Utc>::UNIX_EPOCH);
        let (h, table, storage) = (history(1, 1, start), history(2, 1, start), history(2, 2, start));
        seen.follow(h);
        seen.remember(job, 2, at(2));
        seen.follow(h);
        assert!(seen.at(h, &job, 2).is_some(), "the same history keeps it");
        // Asked of another history, it answers nothing and keeps it.
        assert!(seen.at(table, &job, 2).is_none(), "of another history");
        assert!(seen.at(h, &job, 2).is_some(), "kept");
        seen.follow(table);
        assert!(seen.at(table, &job, 2).is_none(), "another table forgets it");
        seen.remember(job, 2, at(2));
        seen.follow(storage);
        assert!(seen.at(storage, &job, 2).is_none(), "another storage forgets it");
        seen.remember(job, 2, at(2));
        let later = history(2, 2, start + chrono::Duration::seconds(1));
        seen.follow(later);
        assert!(
            seen.at(later, &job, 2).is_none(),
            "another server start forgets it"
        );
        assert_eq!(seen.history, Some(later));
        // A read of the history before, ending after the change: not kept.
        seen.remember_read(storage, [(job, 3, at(3))].into_iter());
        assert!(seen.at(later, &job, 3).is_none(), "a place of another history");
        seen.remember_read(later, [(job, 3, at(3))].into_iter());
        assert_eq!(seen.at(later, &job, 3), Some(at(3)));
    }

    #[test]
    fn a_full_memory_starts_again() {
        let mut seen = of_h0();
        let first = Uuid::new_v4();
        seen.remember(first, 1, at(1));
        for _ in 1..SEEN_JOBS {
            seen.remember(Uuid::new_v4(), 1, at(1));
        }
        // Full: a job it has still moves; a new one starts it again.
        seen.remember(first, 2, at(2));
        assert_eq!(seen.at(h0(), &first, 2), Some(at(2)));
        assert_eq!(seen.jobs.len(), SEEN_JOBS);
        let next = Uuid::new_v4();
        seen.remember(next, 1, at(1));
        assert_eq!(seen.at(h0(), &first, 1), None, "forgotten");
        assert_eq!(seen.at(h0(), &next, 1), Some(at(1)));
        assert_eq!(seen.jobs.len(), 1);
    }
}
