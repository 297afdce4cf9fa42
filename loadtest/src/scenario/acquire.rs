//! `acquire`: uncontended acquire and release of distinct locks by C concurrent
//! clients. Measures acquire latency through the target.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lockcell_loadtest::pacing;
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::{ms, Samples};
use lockcell_proto::v1::lock_client::LockClient;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{open_fleet, per_operation, Overhead, Resources};
use crate::cluster::{Cell, CellOptions, Target};
use crate::fleet::FleetSpec;
use crate::locks::Locker;
use crate::progress;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Concurrent clients, each with its own session and connection.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// How long to measure.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
}

pub async fn run(
    target: Target,
    cell_options: &CellOptions,
    args: &Args,
) -> anyhow::Result<Report> {
    let cell = Cell::start(target, cell_options).await?;
    let clients = args.clients.max(1);
    let spec = FleetSpec {
        sessions: clients,
        ttl: Duration::from_secs(12),
        renewals_per_ttl: 3,
        connections: clients,
    };
    let mut report = Report::new("acquire", target.name());
    report.param("clients", clients);
    report.param("duration_s", args.duration.as_secs_f64());

    let fleet = open_fleet(&cell, spec).await?;
    let done = Arc::new(AtomicU64::new(0));
    let mut resources = Resources::start(&cell);
    let overhead = Overhead::start(&cell).await;
    let etcd_before = cell.etcd_counters().await?;
    let start = Instant::now();
    let end = start + args.duration;
    let mut tasks = JoinSet::new();
    for c in 0..clients {
        let member = fleet.members[c].clone();
        let locker = match target {
            Target::Lockcell => Locker::Lockcell(LockClient::new(fleet.member_channel(c))),
            _ => Locker::connect_etcd(&cell.zones[member.zone].endpoint).await?,
        };
        let done = done.clone();
        tasks.spawn(async move {
            let (mut acquire, mut release) = (Samples::new(), Samples::new());
            let mut i = 0u64;
            while Instant::now() < end {
                let name = format!("acq/{c}/{i}");
                let t0 = Instant::now();
                let grant = locker
                    .acquire(&member.key, &name, Duration::ZERO)
                    .await?
                    .with_context(|| format!("uncontended lock {name} was not granted"))?;
                let t1 = Instant::now();
                locker.release(&member.key, &name, grant).await?;
                acquire.record(t1 - t0);
                release.record(t1.elapsed());
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            anyhow::Ok((acquire, release))
        });
    }
    let bar = progress::timed(&format!("acquire {}", target.name()), args.duration);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() < end {
        tick.tick().await;
        resources.sample();
        bar.set_position(start.elapsed().as_secs());
        bar.set_message(format!("{} acquires", done.load(Ordering::Relaxed)));
    }
    let (mut acquire, mut release) = (Samples::new(), Samples::new());
    while let Some(result) = tasks.join_next().await {
        let (a, r) = result??;
        acquire.merge(&a);
        release.merge(&r);
    }
    bar.finish_and_clear();
    let etcd = cell.etcd_counters().await?.delta(&etcd_before);
    overhead.finish(&cell, &mut report).await;
    fleet.finish().await;

    report.metric("acquires", acquire.len() as f64);
    // Each acquire is followed by its release: the pair is one operation here.
    report.metric(
        "etcd_proposals_per_acquire",
        etcd.get("proposals_committed") / acquire.len().max(1) as f64,
    );
    report.metric(
        "acquires_per_s",
        pacing::rate(acquire.len() as u64, start.elapsed()),
    );
    for (name, samples) in [("acquire", &mut acquire), ("release", &mut release)] {
        if let Some(p) = samples.percentile(50.0) {
            report.metric(&format!("{name}_p50_ms"), ms(p));
        }
        if let Some(p) = samples.percentile(99.0) {
            report.metric(&format!("{name}_p99_ms"), ms(p));
        }
    }
    resources.finish(&mut report, clients);
    per_operation(
        &mut report,
        "proxy_cpu_s",
        "proxy_cpu_ms_per_acquire",
        acquire.len(),
    );
    Ok(report)
}
