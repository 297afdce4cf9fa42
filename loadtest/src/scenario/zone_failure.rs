//! `zone-failure`: the seed's fleet (2,000 services × 60 processes over 3 zones, 5,000
//! locks, scaled by `--scale`), every process holding a session, lock holders spread
//! over zones. Every process announces itself in its service's group and watches the
//! group. Zone a dies at once; survivors wait on the locks it held and see a third of
//! each group leave. Measures how long each lock takes to reach a survivor, how long the
//! departures take to reach every survivor, and what the storm cost etcd.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use lockcell_loadtest::membership;
use lockcell_loadtest::prom::Counters;
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::{cumulative, Samples};
use lockcell_proto::v1::lock_client::LockClient;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Endpoint;

use super::{open_fleet, Overhead, Resources};
use crate::cluster::{Cell, CellOptions, Target};
use crate::fleet::{report_expiries, FleetSpec};
use crate::locks::Locker;
use crate::members::{Membership, Setup};
use crate::progress;
use lockcell_tests::eventually;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Fleet size: 1.0 is 2,000 services × 60 processes (120,000 sessions) and 5,000
    /// locks held.
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Session TTL (and lockcell proxy lease TTL).
    #[arg(long, default_value = "12s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// Client connections the sessions are spread over.
    #[arg(long, default_value_t = 3_000)]
    pub connections: usize,
    /// Leave membership out (no announcements, no group watches): the lock storm alone.
    #[arg(long)]
    pub no_membership: bool,
}

const SERVICES: f64 = 2_000.0;
const PROCESSES_PER_SERVICE: usize = 60;
const LOCKS: f64 = 5_000.0;
/// Lock calls in flight at once while the holders take their locks.
const SETUP_CONCURRENCY: usize = 64;
/// Lock clients per zone (each a connection).
const LOCKERS_PER_ZONE: usize = 64;

pub async fn run(
    target: Target,
    cell_options: &CellOptions,
    args: &Args,
) -> anyhow::Result<Report> {
    let mut cell_options = cell_options.clone();
    cell_options.lease_ttl = args.ttl;
    let mut cell = Cell::start(target, &cell_options).await?;
    let services = ((SERVICES * args.scale).round() as usize).max(1);
    let sessions = services * PROCESSES_PER_SERVICE;
    let locks = ((LOCKS * args.scale).round() as usize).max(3);
    let spec = FleetSpec {
        sessions,
        ttl: args.ttl,
        renewals_per_ttl: 3,
        connections: args.connections.clamp(3, sessions),
    };
    spec.check()?;
    let mut report = Report::new("zone-failure", target.name());
    report.param("scale", args.scale);
    report.param("sessions", sessions);
    report.param("locks", locks);
    report.param("ttl_s", args.ttl.as_secs_f64());
    report.param("connections", spec.connections);

    let fleet = open_fleet(&cell, spec).await?;
    let lock_runtime = LockRuntime::start()?;
    let lockers = lockers(&cell, &lock_runtime).await?;
    let by_zone: Vec<Vec<usize>> = (0..cell.zones.len())
        .map(|z| {
            (0..fleet.members.len())
                .filter(|i| fleet.members[*i].zone == z)
                .collect()
        })
        .collect();

    // Every lock gets a holder; holders are spread over the zones.
    let bar = progress::count("taking locks", locks as u64);
    let gate = Arc::new(Semaphore::new(SETUP_CONCURRENCY));
    let mut taking = JoinSet::new();
    for j in 0..locks {
        let zone = j % by_zone.len();
        let member = by_zone[zone][(j / by_zone.len()) % by_zone[zone].len()];
        let (locker, key, gate) = (
            lockers[zone][j % LOCKERS_PER_ZONE].clone(),
            fleet.members[member].key.clone(),
            gate.clone(),
        );
        taking.spawn(async move {
            let _permit = gate.acquire().await.expect("gate open");
            let grant = locker.acquire(&key, &lock_name(j), Duration::ZERO).await;
            (j, grant)
        });
    }
    // A target that cannot keep its sessions alive loses some before they lock: those
    // locks are counted and left out, not a reason to stop.
    let mut held = Vec::new();
    let mut not_taken = 0;
    while let Some(done) = taking.join_next().await {
        match done? {
            (j, Ok(Some(_))) => held.push(j),
            (j, Ok(None)) => bail!("free lock {} was not granted", lock_name(j)),
            (j, Err(e)) => {
                not_taken += 1;
                tracing::warn!(lock = %lock_name(j), error = %e, "could not take a lock");
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    report.metric("locks_not_taken", not_taken as f64);

    // Membership is in place before the storm: every process announced and watching.
    let patience = args.ttl * 3 + Duration::from_secs(120);
    let mut membership = if args.no_membership {
        report.param("membership", "off");
        None
    } else {
        let groups = membership::deal(&by_zone, PROCESSES_PER_SERVICE);
        match Membership::start(&cell, &fleet, &groups, 0, patience).await? {
            Setup::Ready(m) => {
                report.param("membership", "on");
                Some(m)
            }
            Setup::Unsupported(why) => {
                tracing::warn!(
                    target = target.name(),
                    %why,
                    "membership left out: the target does not implement it"
                );
                report.param("membership", format!("unsupported by the target: {why}"));
                None
            }
        }
    };

    // Survivors wait on every lock zone a holds.
    held.sort_unstable();
    let doomed: Vec<usize> = held
        .into_iter()
        .filter(|j| j % by_zone.len() == 0)
        .collect();
    let regranted = Arc::new(AtomicU64::new(0));
    let placed = cell.etcd_counters().await?;
    let mut waiting = JoinSet::new();
    for (n, &j) in doomed.iter().enumerate() {
        let zone = 1 + n % (by_zone.len() - 1);
        let member = by_zone[zone][n % by_zone[zone].len()];
        let (locker, key, regranted) = (
            lockers[zone][n % LOCKERS_PER_ZONE].clone(),
            fleet.members[member].key.clone(),
            regranted.clone(),
        );
        let wait = async move {
            let grant = locker.acquire(&key, &lock_name(j), patience).await;
            regranted.fetch_add(1, Ordering::Relaxed);
            (grant.map(|g| g.map(|g| g.stages)), Instant::now())
        };
        waiting.spawn_on(wait, lock_runtime.handle());
    }
    // Every waiter's first attempt is one transaction that finds its lock held: the
    // storm starts once etcd has seen them all.
    let waiters = doomed.len() as f64;
    eventually(
        "every survivor waits on its lock",
        Duration::from_secs(60),
        || async {
            let txns = cell.etcd_counters().await?.delta(&placed).get("txns");
            Ok((txns >= waiters).then_some(()))
        },
    )
    .await?;

    let before = cell.etcd_counters().await?;
    let overhead = Overhead::start(&cell).await;
    let mut resources = Resources::start(&cell);
    let killed = Instant::now();
    if let Some(m) = membership.as_mut() {
        m.kill(killed);
    }
    cell.kill_zone(0)?;
    fleet.stop_zone(0);

    // The storm: until every lock is re-granted (or its wait gave up) and every
    // survivor has seen its group's departures (or the same patience ran out).
    let bar = progress::count("locks re-granted", doomed.len() as u64);
    let mut regrants = Samples::new();
    // The etcd recipe's two steps: the holder's key seen deleted, the granting write.
    let (mut heard_free, mut writes) = (Samples::new(), Samples::new());
    let mut offsets = Vec::new();
    let mut failed = 0;
    let mut watch_load = WatchLoad::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let (mut locks_done, mut members_done) = (false, membership.is_none());
    while !(locks_done && members_done) {
        tokio::select! {
            done = waiting.join_next(), if !locks_done => match done {
                Some(Ok((Ok(Some(stages)), at))) => {
                    regrants.record(at - killed);
                    if let Some(stages) = stages {
                        heard_free.record(stages.heard_free.saturating_duration_since(killed));
                        writes.record(stages.write);
                    }
                    offsets.push((at - killed).as_secs_f64());
                    bar.inc(1);
                }
                Some(Ok((Ok(None), _))) => {
                    failed += 1;
                    bar.inc(1);
                    tracing::warn!("a lock of the dead zone was still held when its wait ran out");
                }
                Some(Ok((Err(e), _))) => {
                    failed += 1;
                    bar.inc(1);
                    tracing::warn!(error = %e, "a wait on a lock of the dead zone failed");
                }
                Some(Err(e)) => {
                    failed += 1;
                    bar.inc(1);
                    tracing::warn!(error = %e, "a waiter task failed");
                }
                None => locks_done = true,
            },
            _ = all_seen(&mut membership), if !members_done => members_done = true,
            _ = tokio::time::sleep_until(killed + patience), if !members_done => {
                members_done = true;
            }
            _ = tick.tick() => {
                resources.sample();
                // From a second after the kill: the dead zone's watches have closed.
                if killed.elapsed() >= Duration::from_secs(1) {
                    if let Ok(now) = cell.etcd_counters().await {
                        watch_load.sample(&now);
                    }
                }
                if let Some(m) = &membership {
                    let (waiting, seen) = m.progress();
                    bar.set_message(format!("survivors with every departure: {seen}/{waiting}"));
                }
            }
        }
    }
    bar.finish_and_clear();
    let after = cell.etcd_counters().await?;
    overhead.finish(&cell, &mut report).await;
    watch_load.sample(&after);
    if let Some(m) = membership {
        m.finish(&mut report).await;
    }
    let workers = fleet.finish().await;
    if regrants.is_empty() && failed > 0 {
        bail!("no lock of the dead zone reached a survivor ({failed} waits failed)");
    }

    let delta = after.delta(&before);
    report.metric("locks_of_dead_zone", doomed.len() as f64);
    report.metric("locks_not_regranted", failed as f64);
    for (name, p) in [("regrant_p50_s", 50.0), ("regrant_p99_s", 99.0)] {
        if let Some(d) = regrants.percentile(p) {
            report.metric(name, d.as_secs_f64());
        }
    }
    if let Some(d) = regrants.max() {
        report.metric("regrant_max_s", d.as_secs_f64());
    }
    for (name, samples) in [
        ("regrant_heard_free", &mut heard_free),
        ("regrant_write", &mut writes),
    ] {
        for (stat, p) in [("p50", 50.0), ("p99", 99.0)] {
            if let Some(d) = samples.percentile(p) {
                report.metric(&format!("{name}_{stat}_s"), d.as_secs_f64());
            }
        }
        if let Some(d) = samples.max() {
            report.metric(&format!("{name}_max_s"), d.as_secs_f64());
        }
    }
    report.metric(
        "etcd_proposals_during_storm",
        delta.get("proposals_committed"),
    );
    report.metric(
        "etcd_lease_revokes_during_storm",
        delta.get("lease_revokes"),
    );
    report.metric("etcd_watch_streams", watch_load.streams);
    report.metric("etcd_watchers", watch_load.watchers);
    report.metric("etcd_watch_events_sent", delta.get("watch_events_sent"));
    // The dead zone's sessions expire by design; only the survivors' count.
    report_expiries(&mut report, &workers, |i| {
        by_zone[0].binary_search(&i).is_err()
    });
    resources.finish(&mut report, sessions);
    report
        .series
        .insert("regranted_since_kill".into(), cumulative(&offsets));
    Ok(report)
}

/// The most watch streams and watchers etcd had open at once during the storm (etcd's
/// gauges, summed over members, sampled every second).
#[derive(Debug, Default)]
struct WatchLoad {
    streams: f64,
    watchers: f64,
}

impl WatchLoad {
    fn sample(&mut self, now: &Counters) {
        self.streams = self.streams.max(now.get("watch_streams_open"));
        self.watchers = self.watchers.max(now.get("watchers_open"));
    }
}

/// Resolves once every survivor has seen its departures; never without membership.
async fn all_seen(membership: &mut Option<Membership>) {
    match membership {
        Some(m) => m.all_seen().await,
        None => std::future::pending().await,
    }
}

fn lock_name(j: usize) -> String {
    format!("zf/lock-{j}")
}

/// The lock clients' own runtime: one thread, apart from the fleet's.
///
/// The generator plays 120,000 processes in one process. On one runtime a lock
/// waiter's wake-up would queue behind the 80,000 survivors' membership watches, which
/// no real lock client waits behind (each is a process of its own); on a thread of
/// their own the lock clients get their share of the CPU from the kernel as they need
/// it, whatever the target.
struct LockRuntime(Option<tokio::runtime::Runtime>);

impl LockRuntime {
    fn start() -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lock-clients")
            .enable_all()
            .build()?;
        Ok(LockRuntime(Some(runtime)))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("running until dropped").handle()
    }
}

impl Drop for LockRuntime {
    fn drop(&mut self) {
        // Dropped from async code: a blocking shutdown would panic there.
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// Lock clients per zone, each with connections of its own on `runtime` (their tasks
/// run there).
async fn lockers(cell: &Cell, runtime: &LockRuntime) -> anyhow::Result<Vec<Vec<Locker>>> {
    let target = cell.target;
    let endpoints: Vec<String> = cell.zones.iter().map(|z| z.endpoint.clone()).collect();
    let connect = async move {
        let mut out = Vec::new();
        for endpoint in endpoints {
            let mut pool = Vec::new();
            for _ in 0..LOCKERS_PER_ZONE {
                pool.push(match target {
                    Target::Lockcell => {
                        let channel = Endpoint::from_shared(format!("http://{endpoint}"))?
                            .tcp_nodelay(true)
                            .connect_timeout(Duration::from_secs(10))
                            .connect_lazy();
                        Locker::Lockcell(LockClient::new(channel))
                    }
                    _ => Locker::connect_etcd(&endpoint).await?,
                });
            }
            out.push(pool);
        }
        anyhow::Ok(out)
    };
    runtime.handle().spawn(connect).await?
}
