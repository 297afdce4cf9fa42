//! The scenarios, each run against one target at a time and turned into a [`Report`].

pub mod acquire;
pub mod contention;
pub mod keepalive;
pub mod noisy_neighbour;
pub mod reads;
pub mod rolling_restart;
pub mod rolling_restart_etcd;
pub mod zone_failure;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lockcell_loadtest::procstat::{ProcSample, ProcTracker};
use lockcell_loadtest::prom::{self, Sample};
use lockcell_loadtest::report::Report;

use crate::cluster::Cell;
use crate::fleet::{Fleet, FleetSpec, Live};
use crate::progress;

/// Opens a fleet with a progress bar.
pub async fn open_fleet(cell: &Cell, spec: FleetSpec) -> anyhow::Result<Fleet> {
    let live = Arc::new(Live::default());
    let bar = progress::count("opening sessions", spec.sessions as u64);
    let opening = Fleet::open(cell, spec, live.clone());
    tokio::pin!(opening);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let fleet = loop {
        tokio::select! {
            fleet = &mut opening => break fleet?,
            _ = tick.tick() => bar.set_position(live.opened.load(Ordering::Relaxed)),
        }
    };
    bar.finish_and_clear();
    Ok(fleet)
}

/// CPU and memory of the processes under test (and of the load generator itself), and
/// the longest the load generator's own runtime went without running a task.
pub struct Resources {
    trackers: Vec<(&'static str, ProcTracker)>,
    own: ProcTracker,
    stalls: StallWatch,
}

impl Resources {
    pub fn start(cell: &Cell) -> Self {
        Resources {
            trackers: cell.trackers(),
            own: ProcTracker::start(std::process::id()),
            stalls: StallWatch::start(),
        }
    }

    pub fn sample(&mut self) {
        for (_, t) in self.trackers.iter_mut() {
            t.sample();
        }
        self.own.sample();
    }

    /// Adds cpu and memory figures per process kind; `sessions` sizes the per-session
    /// memory figures.
    pub fn finish(self, report: &mut Report, sessions: usize) {
        let Resources {
            trackers,
            own,
            stalls,
        } = self;
        report.metric("loadgen_max_stall_s", stalls.finish().as_secs_f64());
        let finished: Vec<(&str, ProcSample)> =
            trackers.into_iter().map(|(k, t)| (k, t.finish())).collect();
        for kind in ["etcd", "proxy"] {
            let samples: Vec<&ProcSample> = finished
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, s)| s)
                .collect();
            if samples.is_empty() {
                continue;
            }
            let cpu: f64 = samples.iter().map(|s| s.cpu_seconds).sum();
            let peak = samples.iter().map(|s| s.peak_rss_bytes).max().unwrap_or(0);
            let rss: u64 = samples.iter().map(|s| s.rss_bytes).sum();
            report.metric(&format!("{kind}_cpu_s"), cpu);
            report.metric(&format!("{kind}_peak_rss_bytes"), peak as f64);
            if sessions > 0 {
                report.metric(
                    &format!("{kind}_rss_bytes_per_session"),
                    rss as f64 / sessions as f64,
                );
            }
        }
        report.metric("loadgen_cpu_s", own.finish().cpu_seconds);
    }
}

/// How late a task of the load generator's runtime that wakes every [`StallWatch::EVERY`]
/// ran, at worst: when it is seconds, replies sat unread in the generator for that
/// long, and round trips and unanswered renewals measured then are the generator's.
struct StallWatch {
    worst_us: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl StallWatch {
    const EVERY: Duration = Duration::from_millis(20);

    fn start() -> Self {
        let worst_us = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let worst = worst_us.clone();
        let task = tokio::spawn(async move {
            let mut last = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(Self::EVERY).await;
                let now = tokio::time::Instant::now();
                let late = (now - last).saturating_sub(Self::EVERY);
                worst.fetch_max(late.as_micros() as u64, Ordering::Relaxed);
                last = now;
            }
        });
        StallWatch { worst_us, task }
    }

    fn finish(self) -> Duration {
        self.task.abort();
        Duration::from_micros(self.worst_us.load(Ordering::Relaxed))
    }
}

/// Records `figure` (a CPU time in seconds already in `report`) per operation, in
/// milliseconds, as `name`; nothing when the report has no such figure.
pub fn per_operation(report: &mut Report, figure: &str, name: &str, operations: usize) {
    if let Some(seconds) = report.metrics.get(figure).copied() {
        report.metric(name, seconds * 1e3 / operations.max(1) as f64);
    }
}

/// The proxies' own time on each call over a phase, from their
/// `lockcell_proxy_overhead_seconds` histograms: what a proxy adds to a call beyond its
/// etcd round trips and its waits.
pub struct Overhead {
    before: Vec<Option<Vec<Sample>>>,
}

impl Overhead {
    const HISTOGRAM: &'static str = "lockcell_proxy_overhead_seconds";

    pub async fn start(cell: &Cell) -> Self {
        Overhead {
            before: cell.proxy_samples().await,
        }
    }

    /// Adds `proxy_overhead_<call>_p50_us` and `_p99_us` for every call the proxies
    /// answered during the phase (nothing for targets without lockcell proxies). A
    /// proxy that stopped answering in the phase (a killed zone) is left out.
    pub async fn finish(self, cell: &Cell, report: &mut Report) {
        let after = cell.proxy_samples().await;
        let mut by_call: std::collections::BTreeMap<String, Vec<(f64, f64)>> = Default::default();
        for (before, after) in self.before.iter().zip(&after) {
            let (Some(before), Some(after)) = (before, after) else {
                continue;
            };
            for call in Self::calls(after) {
                let filter = [("call", call.as_str())];
                let gained = prom::histogram_delta(
                    &prom::histogram(after, Self::HISTOGRAM, &filter),
                    &prom::histogram(before, Self::HISTOGRAM, &filter),
                );
                prom::add_buckets(by_call.entry(call).or_default(), &gained);
            }
        }
        for (call, buckets) in by_call {
            for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
                if let Some(seconds) = prom::quantile(&buckets, q) {
                    report.metric(&format!("proxy_overhead_{call}_{name}_us"), seconds * 1e6);
                }
            }
        }
    }

    /// The calls a proxy's page has an overhead histogram for.
    fn calls(samples: &[Sample]) -> Vec<String> {
        let bucket = format!("{}_bucket", Self::HISTOGRAM);
        let mut calls: Vec<String> = samples
            .iter()
            .filter(|s| s.name == bucket)
            .filter_map(|s| s.labels.get("call").cloned())
            .collect();
        calls.sort();
        calls.dedup();
        calls
    }
}
