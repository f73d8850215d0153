//! How many jobs a worker holds beyond the ones running: the default
//! prefetch follows the handlers' pace.
//!
//! Why (issue 15): a drain of fast jobs is bound by transactions, not by
//! work. With 16 slots and 16 jobs fetched ahead, a no-op drain committed
//! about six jobs per transaction; 240 fetched ahead more than doubled the
//! rate (docs/benchmarks.md). A fixed large prefetch is wrong for slow
//! handlers, though: jobs would wait in this worker's local queue, holding
//! leases, while another worker could have run them. So by default a worker
//! holds as many jobs as its slots will start within `HORIZON` at the pace
//! its handlers have recently run: never fewer than its concurrency (the
//! fixed default before), never more than `CAP`. Slow handlers therefore
//! fetch exactly as before; only fast ones fetch more, and a job fetched
//! ahead is expected to start within the horizon. When the pace slows
//! (a run that takes longer than the average counts before it ends, for
//! its own slot) so far that more than twice the new number of jobs wait,
//! the jobs held ahead beyond the new number are given back unstarted, without
//! burning an attempt, at the claim loop's next turn (at the latest one
//! poll interval). An explicit `WorkerBuilder::prefetch(n)` fixes the
//! number instead.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// A job fetched ahead should start within this, at the recent pace.
pub(crate) const HORIZON: Duration = Duration::from_millis(50);
/// The most jobs a worker fetches ahead by default.
pub(crate) const CAP: usize = 256;
/// Weight of the newest handler run in the average.
const ALPHA: f64 = 0.1;

/// The prefetch: a fixed number, or the handlers' pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prefetch {
    Fixed(usize),
    Auto,
}

impl Prefetch {
    /// The most jobs this setting can ever hold ahead (the semaphore's
    /// size beyond the slots).
    pub(crate) fn most(self, concurrency: usize) -> usize {
        match self {
            Prefetch::Fixed(n) => n,
            Prefetch::Auto => CAP.max(concurrency),
        }
    }

    /// Jobs to hold ahead now, given the handlers' average run time.
    pub(crate) fn now(self, concurrency: usize, avg_run: Option<Duration>) -> usize {
        match self {
            Prefetch::Fixed(n) => n,
            Prefetch::Auto => auto(concurrency, avg_run),
        }
    }
}

/// As many as `concurrency` slots start within `HORIZON` at `avg_run` per
/// job, clamped to `[concurrency, CAP]`; `concurrency` before any run.
pub(crate) fn auto(concurrency: usize, avg_run: Option<Duration>) -> usize {
    let floor = concurrency;
    let cap = CAP.max(floor);
    let Some(avg) = avg_run else {
        return floor;
    };
    // A run of 0 (a coarse clock) counts as 1 µs: the cap then applies.
    let per_slot = HORIZON.as_secs_f64() / avg.as_secs_f64().max(1e-6);
    let n = concurrency as f64 * per_slot;
    if n >= cap as f64 {
        cap
    } else {
        (n as usize).clamp(floor, cap)
    }
}

/// The handlers' recent run time: an exponentially weighted average of the
/// runs that ended (panicked ones too; each counted as at most one horizon
/// longer than the average), corrected for the runs still going.
/// A run still going slows only its own slot: the slots start jobs at the
/// summed rate of 1 / max(average, its time so far) per busy slot and
/// 1 / average per idle one, and the effective run time is the slots over
/// that rate. So a pace learnt from fast jobs does not outlive slow ones
/// that fill every slot, while one slow run among many fast ones (review:
/// the longest run alone shed the whole prefetch, over and over) barely
/// moves it.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    avg: Mutex<Option<f64>>,
    running: Mutex<HashMap<Uuid, Instant>>,
}

impl Pace {
    pub(crate) fn begin(&self, job: Uuid) {
        self.running.lock().expect("pace").insert(job, Instant::now());
    }

    pub(crate) fn end(&self, job: Uuid) {
        let Some(began) = self.running.lock().expect("pace").remove(&job) else {
            return;
        };
        self.record(began.elapsed());
    }

    /// One run ended. A run counts as at most one horizon longer than the
    /// average: the prefetch only asks how many runs fit in the horizon, and
    /// one slow run among fast ones (review: a 30 s run made the average
    /// 3 s when it ended, and the whole prefetch was given back and claimed
    /// again) then moves it by at most `ALPHA * HORIZON`. Runs that stay
    /// slow bring the average to the floor's side within a dozen runs, and
    /// while they run, each slows its own slot at once (`average`).
    pub(crate) fn record(&self, run: Duration) {
        let mut avg = self.avg.lock().expect("pace");
        let s = run.as_secs_f64();
        *avg = Some(match *avg {
            None => s,
            Some(a) => a + ALPHA * (s.min(a + HORIZON.as_secs_f64()) - a),
        });
    }

    /// The effective run time of `slots` slots; None before any run ended
    /// (the floor applies).
    pub(crate) fn average(&self, slots: usize) -> Option<Duration> {
        let avg = (*self.avg.lock().expect("pace"))?.max(1e-6);
        let slots = slots.max(1);
        let running = self.running.lock().expect("pace");
        let busy = running.len().min(slots);
        let rate: f64 = running
            .values()
            .take(slots)
            .map(|t| 1.0 / t.elapsed().as_secs_f64().max(avg))
            .sum::<f64>()
            + (slots - busy) as f64 / avg;
        Some(Duration::from_secs_f64(slots as f64 / rate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Within [concurrency, CAP] (the concurrency wins over a smaller
        /// CAP), and never more for slower handlers.
        #[test]
        fn auto_stays_in_bounds_and_falls_as_handlers_slow(
            c in 1usize..600,
            a in 0u64..10_000_000,
            b in 0u64..10_000_000,
        ) {
            let (fast, slow) = (Duration::from_micros(a.min(b)), Duration::from_micros(a.max(b)));
            let f = auto(c, Some(fast));
            let s = auto(c, Some(slow));
            prop_assert!(f >= c && f <= CAP.max(c));
            prop_assert!(s >= c && s <= CAP.max(c));
            prop_assert!(s <= f, "slower handlers fetch no more: {s} > {f}");
            prop_assert_eq!(auto(c, None), c);
        }

        /// Jobs fetched ahead start within the horizon at the pace given,
        /// unless the floor (the concurrency) holds them.
        #[test]
        fn auto_fetches_no_more_than_the_slots_start_within_the_horizon(
            c in 1usize..64,
            us in 1u64..1_000_000,
        ) {
            let avg = Duration::from_micros(us);
            let n = auto(c, Some(avg));
            if n > c {
                let wait = avg.as_secs_f64() * n as f64 / c as f64;
                prop_assert!(wait <= HORIZON.as_secs_f64() + 1e-9, "{n} ahead wait {wait} s");
            }
        }
    }

    #[test]
    fn slow_handlers_fetch_as_before_and_fast_ones_up_to_the_cap() {
        assert_eq!(auto(16, Some(Duration::from_millis(200))), 16);
        assert_eq!(auto(16, Some(Duration::from_micros(20))), CAP);
        assert_eq!(auto(16, Some(Duration::from_millis(1))), 800.min(CAP));
        assert_eq!(auto(2, Some(Duration::from_millis(1))), 100);
        assert_eq!(auto(16, Some(Duration::ZERO)), CAP);
        let p = Pace::default();
        assert_eq!(p.average(1), None);
        p.record(Duration::from_millis(10));
        p.record(Duration::from_millis(20));
        let avg = p.average(1).unwrap().as_secs_f64();
        assert!((avg - 0.011).abs() < 1e-9, "{avg}");
        // A run still going that has taken longer raises the average.
        let id = Uuid::now_v7();
        p.running
            .lock()
            .unwrap()
            .insert(id, Instant::now() - Duration::from_secs(30));
        assert!(p.average(1).unwrap() >= Duration::from_secs(30));
        assert_eq!(auto(16, p.average(1)), 16);
        // One slow run among 16 slots barely moves the pace (review: the
        // longest run alone set it, and shed the whole prefetch).
        let among = p.average(16).unwrap();
        assert!(among < Duration::from_millis(12), "{among:?}");
        assert!(auto(16, Some(among)) > 60, "{}", auto(16, Some(among)));
        p.end(id);
        let after = p.average(1).unwrap();
        assert!(
            after > Duration::from_millis(11),
            "the slow run counts once it ended"
        );
        // Review: ended, it counts as one horizon longer than the average
        // (11 ms + 50 ms), so the prefetch stays above twice the floor and
        // nothing is given back (the whole average made it 3 s: the floor).
        assert!(auto(16, Some(after)) > 2 * 16, "{after:?}");
        // Runs that stay slow bring the prefetch to the floor.
        for _ in 0..20 {
            p.record(Duration::from_secs(1));
        }
        assert_eq!(auto(16, p.average(16)), 16, "{:?}", p.average(16));
    }
}
