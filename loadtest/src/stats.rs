//! Latency samples and the figures drawn from them: exact nearest-rank percentiles,
//! per-second series for "latency over time" plots, and cumulative counts for
//! "re-granted since the kill" plots.

use std::collections::BTreeMap;
use std::time::Duration;

/// Exact-percentile latency store; durations kept as microseconds (u32, saturating).
///
/// Exact rather than a histogram because a p99 that moves by a bucket width between
/// targets would be a lie in a side-by-side table; four bytes per sample keeps a
/// million keepalives at 4 MB. Saturating at `u32::MAX` µs (about 71 minutes) is far
/// beyond any latency a run can observe.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    /// Latencies in microseconds, in recording order until the first percentile query.
    us: Vec<u32>,
    /// Whether `us` is currently sorted, so repeated percentile queries sort once.
    sorted: bool,
}

impl Samples {
    pub fn new() -> Self {
        Self::default()
    }

    /// Pre-sizes the store so a hot recording loop never reallocates.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            us: Vec::with_capacity(n),
            sorted: false,
        }
    }

    pub fn record(&mut self, d: Duration) {
        self.us.push(to_us(d));
        self.sorted = false;
    }

    /// Folds in another worker's samples, so each worker can record without sharing.
    pub fn merge(&mut self, other: &Samples) {
        self.us.extend_from_slice(&other.us);
        self.sorted = false;
    }

    pub fn len(&self) -> usize {
        self.us.len()
    }

    pub fn is_empty(&self) -> bool {
        self.us.is_empty()
    }

    /// Nearest-rank percentile, p in [0,100]; None when empty. Sorts lazily (cache a sorted flag).
    ///
    /// Nearest rank always returns a latency that was actually observed, so p100 is the
    /// maximum and no interpolation invents values. `p` outside [0,100] is clamped.
    pub fn percentile(&mut self, p: f64) -> Option<Duration> {
        if self.us.is_empty() {
            return None;
        }
        if !self.sorted {
            self.us.sort_unstable();
            self.sorted = true;
        }
        Some(Duration::from_micros(u64::from(
            self.us[nearest_rank_index(self.us.len(), p)],
        )))
    }

    /// The worst latency; kept apart from `percentile` so it needs no sort and no `&mut`.
    pub fn max(&self) -> Option<Duration> {
        self.us
            .iter()
            .max()
            .map(|&us| Duration::from_micros(u64::from(us)))
    }
}

/// Index into a sorted slice of `len > 0` values of the nearest-rank `p`th percentile:
/// rank = ceil(p/100 * len), at least 1.
fn nearest_rank_index(len: usize, p: f64) -> usize {
    let p = if p.is_nan() { 0.0 } else { p.clamp(0.0, 100.0) };
    // Multiply before dividing, and forgive float noise, so that p99 of 100 samples is
    // rank 99 and not 100 because 0.99 * 100 came out as 99.00000000000001.
    let rank = (p * len as f64 / 100.0 - 1e-9).ceil() as usize;
    rank.clamp(1, len) - 1
}

fn to_us(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Per-second time series for "latency over time" plots: record (offset since start, latency);
/// `p99_per_second()` gives (second, p99_ms) points; `count_per_second()` gives (second, count).
///
/// A single p99 over a whole run hides the seconds in which a zone failure stalled
/// keepalives; bucketing by second shows them.
#[derive(Debug, Default, Clone)]
pub struct TimeSeries {
    /// Samples bucketed by whole second since the start of the run.
    buckets: BTreeMap<u64, Samples>,
}

impl TimeSeries {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one latency observed `at` after the start of the run.
    pub fn record(&mut self, at: Duration, latency: Duration) {
        self.buckets
            .entry(at.as_secs())
            .or_default()
            .record(latency);
    }

    /// Folds in another worker's series.
    pub fn merge(&mut self, other: &TimeSeries) {
        for (second, samples) in &other.buckets {
            self.buckets.entry(*second).or_default().merge(samples);
        }
    }

    /// (second, p99 in ms) for every second that saw at least one sample; a second with
    /// no samples has no latency to report, and a gap in the line says so.
    pub fn p99_per_second(&self) -> Vec<(f64, f64)> {
        self.buckets
            .iter()
            .filter_map(|(second, samples)| {
                let p99 = samples.clone().percentile(99.0)?;
                Some((*second as f64, ms(p99)))
            })
            .collect()
    }

    /// (second, count) for every second from 0 to the last one recorded, zeros
    /// included, because a second in which nothing completed is exactly the stall a
    /// throughput plot must show.
    pub fn count_per_second(&self) -> Vec<(f64, f64)> {
        let Some(&last) = self.buckets.keys().next_back() else {
            return Vec::new();
        };
        (0..=last)
            .map(|second| {
                let n = self.buckets.get(&second).map_or(0, Samples::len);
                (second as f64, n as f64)
            })
            .collect()
    }
}

/// Cumulative count over time, for "locks re-granted since the kill": from a list of offsets (seconds) returns a step series (t, n) sorted by t, starting at (0,0).
///
/// Each distinct offset contributes two points, (t, count before) and (t, count after),
/// so a line plot draws stairs rather than ramps between sparse events. Negative
/// offsets (an event stamped a hair before the kill by another task's clock read) count
/// as at 0; NaN offsets are dropped.
pub fn cumulative(offsets_s: &[f64]) -> Vec<(f64, f64)> {
    let mut sorted: Vec<f64> = offsets_s
        .iter()
        .filter(|t| !t.is_nan())
        .map(|t| t.max(0.0))
        .collect();
    sorted.sort_by(f64::total_cmp);
    let mut out = vec![(0.0, 0.0)];
    let mut n = 0usize;
    let mut i = 0;
    while i < sorted.len() {
        let t = sorted[i];
        let before = n;
        while i < sorted.len() && sorted[i] == t {
            n += 1;
            i += 1;
        }
        if t == 0.0 && before == 0 {
            out.push((0.0, n as f64));
        } else {
            out.push((t, before as f64));
            out.push((t, n as f64));
        }
    }
    out
}

/// Milliseconds as a float, the unit of every latency figure in the reports.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Seconds as a float, the unit of re-grant times and plot axes.
pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_to_hundred_ms() -> Samples {
        let mut s = Samples::new();
        // Recorded out of order so the lazy sort is exercised.
        for i in (1..=100).rev() {
            s.record(Duration::from_millis(i));
        }
        s
    }

    #[test]
    fn nearest_rank_on_one_to_hundred() {
        let mut s = one_to_hundred_ms();
        assert_eq!(s.percentile(50.0), Some(Duration::from_millis(50)));
        assert_eq!(s.percentile(99.0), Some(Duration::from_millis(99)));
        assert_eq!(s.percentile(100.0), Some(Duration::from_millis(100)));
        assert_eq!(s.percentile(100.0), s.max());
        assert_eq!(s.percentile(0.0), Some(Duration::from_millis(1)));
        assert_eq!(s.percentile(99.5), Some(Duration::from_millis(100)));
        assert_eq!(s.percentile(1.0), Some(Duration::from_millis(1)));
        assert_eq!(s.percentile(1.01), Some(Duration::from_millis(2)));
    }

    #[test]
    fn nearest_rank_is_exact_for_decimal_percentiles() {
        let mut s = Samples::new();
        for i in 1..=1000 {
            s.record(Duration::from_micros(i));
        }
        assert_eq!(s.percentile(99.9), Some(Duration::from_micros(999)));
        assert_eq!(s.percentile(99.0), Some(Duration::from_micros(990)));
    }

    #[test]
    fn small_sets() {
        let mut s = Samples::new();
        s.record(Duration::from_millis(7));
        assert_eq!(s.percentile(50.0), Some(Duration::from_millis(7)));
        s.record(Duration::from_millis(3));
        assert_eq!(s.percentile(50.0), Some(Duration::from_millis(3)));
        assert_eq!(s.percentile(51.0), Some(Duration::from_millis(7)));
    }

    #[test]
    fn empty_is_none() {
        let mut s = Samples::with_capacity(10);
        assert!(s.is_empty());
        assert_eq!(s.percentile(50.0), None);
        assert_eq!(s.max(), None);
    }

    #[test]
    fn merge_combines_and_resorts() {
        let mut a = Samples::new();
        a.record(Duration::from_millis(10));
        assert_eq!(a.percentile(100.0), Some(Duration::from_millis(10)));
        let mut b = Samples::new();
        b.record(Duration::from_millis(1));
        b.record(Duration::from_millis(20));
        a.merge(&b);
        assert_eq!(a.len(), 3);
        assert_eq!(a.percentile(0.0), Some(Duration::from_millis(1)));
        assert_eq!(a.percentile(100.0), Some(Duration::from_millis(20)));
    }

    #[test]
    fn saturates_at_u32_micros() {
        let mut s = Samples::new();
        s.record(Duration::from_secs(10 * 24 * 3600));
        let cap = Duration::from_micros(u64::from(u32::MAX));
        assert_eq!(s.max(), Some(cap));
        assert_eq!(s.percentile(50.0), Some(cap));
    }

    #[test]
    fn time_series_buckets_by_second() {
        let mut ts = TimeSeries::new();
        for i in 1..=100 {
            ts.record(Duration::from_millis(200), Duration::from_millis(i));
        }
        ts.record(Duration::from_millis(2500), Duration::from_millis(4));
        let mut other = TimeSeries::new();
        other.record(Duration::from_millis(2900), Duration::from_millis(8));
        ts.merge(&other);
        assert_eq!(ts.p99_per_second(), vec![(0.0, 99.0), (2.0, 8.0)]);
        assert_eq!(
            ts.count_per_second(),
            vec![(0.0, 100.0), (1.0, 0.0), (2.0, 2.0)]
        );
        assert!(TimeSeries::new().count_per_second().is_empty());
    }

    #[test]
    fn cumulative_steps() {
        assert_eq!(cumulative(&[]), vec![(0.0, 0.0)]);
        assert_eq!(
            cumulative(&[2.0, 1.0, 2.0, -0.001, f64::NAN]),
            vec![
                (0.0, 0.0),
                (0.0, 1.0),
                (1.0, 1.0),
                (1.0, 2.0),
                (2.0, 2.0),
                (2.0, 4.0)
            ]
        );
    }

    #[test]
    fn units() {
        assert_eq!(ms(Duration::from_micros(1500)), 1.5);
        assert_eq!(secs(Duration::from_millis(2500)), 2.5);
    }
}
