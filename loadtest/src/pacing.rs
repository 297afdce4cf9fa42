//! Rate pacing: when each of `n` periodic jobs (session renewals, acquires) is due, so
//! a scenario offers a steady aggregate rate instead of bursts that would measure the
//! load generator's own queueing.

use std::ops::Range;
use std::time::Duration;

/// Spreads `n` periodic jobs (e.g. session renewals) evenly over one `period`, so the aggregate rate is n/period with no bursts:
/// job i's k-th run is due at start + period * k + period * i / n.
///
/// Computed in integer nanoseconds so offsets never drift with `k`, and job `i < n`
/// always lands strictly inside `[k * period, (k + 1) * period)`. With `n == 0` every
/// job is due at the start of its period.
pub fn due_offset(period: Duration, n: usize, i: usize, k: u64) -> Duration {
    let period_ns = period.as_nanos();
    let within = if n == 0 {
        0
    } else {
        period_ns * i as u128 / n as u128
    };
    let total = period_ns * u128::from(k) + within;
    Duration::from_nanos(u64::try_from(total).unwrap_or(u64::MAX))
}

/// The jobs worker `w` of `workers` should own when `n` jobs are split between them:
/// contiguous, disjoint, covering `0..n`, sizes differing by at most one. A worker may
/// get an empty range when `n < workers`; it should then not build a [`Schedule`].
pub fn share(n: usize, workers: usize, w: usize) -> Range<usize> {
    assert!(w < workers, "worker {w} out of range for {workers} workers");
    let base = n / workers;
    let extra = n % workers;
    let start = w * base + w.min(extra);
    let len = base + usize::from(w < extra);
    start..start + len
}

/// The slot in `0..n` of the `j`-th job of worker `w` of `workers` (its jobs being
/// `share(n, workers, w)`): the workers take turns, so each worker's jobs spread over
/// the whole period instead of sitting side by side. Every job of every share gets its
/// own slot.
pub fn interleaved(workers: usize, w: usize, j: usize) -> usize {
    j * workers + w
}

/// A pacer for one worker owning jobs `first..first+count` of `n`: yields (job index, due offset) in due order, endlessly.
///
/// Offsets are since the scenario's start. A worker that sleeps until `start + offset`
/// and, when late, runs the job at once instead of skipping it makes its lateness show
/// up as a lower achieved rate rather than vanish.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Length of one round in which every job runs once.
    period: Duration,
    /// Total jobs across all workers, which sets the spacing between due times.
    n: usize,
    /// First job this worker owns.
    first: usize,
    /// How many consecutive jobs this worker owns.
    count: usize,
    /// Position within this worker's jobs of the next job to yield.
    j: usize,
    /// Round of the next job to yield.
    k: u64,
}

impl Schedule {
    /// Panics if `count` is zero (an endless schedule of nothing has no next job) or if
    /// the jobs reach past `n`: both are driver bugs, best caught at setup.
    pub fn new(period: Duration, n: usize, first: usize, count: usize) -> Self {
        assert!(count > 0, "a Schedule needs at least one job");
        assert!(
            first + count <= n,
            "jobs {first}..{} reach past the {n} jobs in the schedule",
            first + count
        );
        Self {
            period,
            n,
            first,
            count,
            j: 0,
            k: 0,
        }
    }

    /// The next (job index, due offset). Within a round, offsets grow with the job
    /// index, and every offset of round `k` is below every offset of round `k + 1`, so
    /// walking jobs in index order, round by round, is due order.
    // Not `Iterator::next`: the schedule never ends, and a tuple spares callers an
    // unwrap on every renewal.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> (usize, Duration) {
        let job = self.first + self.j;
        let due = due_offset(self.period, self.n, job, self.k);
        self.j += 1;
        if self.j == self.count {
            self.j = 0;
            self.k += 1;
        }
        (job, due)
    }
}

/// Target rate in per-second terms, and the achieved/target ratio.
///
/// The target is `rate(n, period)` and the achieved rate `rate(done, elapsed)`: both
/// come from here so their ratio compares like with like. Zero for a zero interval.
pub fn rate(count: u64, over: Duration) -> f64 {
    let s = over.as_secs_f64();
    if s > 0.0 {
        count as f64 / s
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_job_once_per_period_strictly_inside_it() {
        let period = Duration::from_secs(1);
        for n in [1, 3, 7, 1000] {
            for k in 0..3u64 {
                let lo = period * k as u32;
                let hi = period * (k as u32 + 1);
                let mut offsets: Vec<Duration> =
                    (0..n).map(|i| due_offset(period, n, i, k)).collect();
                assert!(offsets.iter().all(|o| lo <= *o && *o < hi), "n={n} k={k}");
                let before = offsets.len();
                offsets.dedup();
                assert_eq!(offsets.len(), before, "distinct due times for n={n}");
                assert!(offsets.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }

    #[test]
    fn spacing_is_even() {
        let period = Duration::from_secs(10);
        let gaps: Vec<Duration> = (0..4)
            .map(|i| due_offset(period, 4, i + 1, 0) - due_offset(period, 4, i, 0))
            .collect();
        assert!(gaps.iter().all(|g| *g == Duration::from_millis(2500)));
    }

    #[test]
    fn aggregate_rate_is_n_over_period() {
        let period = Duration::from_secs(2);
        let n = 1000;
        let window = period * 5;
        let mut due = 0u64;
        for i in 0..n {
            for k in 0.. {
                if due_offset(period, n, i, k) >= window {
                    break;
                }
                due += 1;
            }
        }
        assert_eq!(rate(due, window), rate(n as u64, period));
        assert_eq!(rate(n as u64, period), 500.0);
    }

    #[test]
    fn schedule_is_in_due_order_across_rounds() {
        let period = Duration::from_millis(100);
        let mut s = Schedule::new(period, 10, 3, 4);
        let got: Vec<(usize, Duration)> = (0..12).map(|_| s.next()).collect();
        let jobs: Vec<usize> = got.iter().map(|(j, _)| *j).collect();
        assert_eq!(jobs, [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6]);
        assert!(got.windows(2).all(|w| w[0].1 < w[1].1));
        assert_eq!(got[4].1, got[0].1 + period);
    }

    #[test]
    fn split_over_workers_covers_all_jobs_once() {
        for (n, workers) in [(10, 3), (3, 8), (1000, 7), (0, 2)] {
            let mut seen = vec![0u32; n];
            let period = Duration::from_secs(1);
            let mut all_offsets = Vec::new();
            for w in 0..workers {
                let r = share(n, workers, w);
                assert!(r.len() <= n / workers + 1);
                if r.is_empty() {
                    continue;
                }
                let mut s = Schedule::new(period, n, r.start, r.len());
                for _ in 0..r.len() {
                    let (job, due) = s.next();
                    seen[job] += 1;
                    all_offsets.push(due);
                }
            }
            assert!(seen.iter().all(|c| *c == 1), "n={n} workers={workers}");
            all_offsets.sort();
            all_offsets.dedup();
            assert_eq!(all_offsets.len(), n);
        }
    }

    #[test]
    fn interleaved_slots_are_every_slot_once() {
        for (n, workers) in [(10, 3), (9, 3), (2, 5), (120_000, 3_000), (7, 7)] {
            let mut slots: Vec<usize> = (0..workers)
                .flat_map(|w| {
                    (0..share(n, workers, w).len()).map(move |j| interleaved(workers, w, j))
                })
                .collect();
            slots.sort_unstable();
            assert_eq!(
                slots,
                (0..n).collect::<Vec<_>>(),
                "n {n}, workers {workers}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "at least one job")]
    fn empty_schedule_is_refused() {
        Schedule::new(Duration::from_secs(1), 4, 0, 0);
    }

    #[test]
    fn rate_of_nothing_is_zero() {
        assert_eq!(rate(5, Duration::ZERO), 0.0);
        assert_eq!(rate(0, Duration::from_secs(1)), 0.0);
    }
}
