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
