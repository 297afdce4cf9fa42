//! `contention`: W waiters on L locks, spread over the zones. Every lock starts held;
//! once every waiter waits, the holders let go and each lock passes from waiter to
//! waiter until each has had it once. Measures handover latency (a holder's release to
//! the next holder's grant) and what each handover cost etcd in transactions.
//!
//! lockcell waits through its proxies (the arbiter's local queues, default class);
//! bare etcd and its grpc-proxy use etcd's own Lock API, which queues each waiter
//! behind its predecessor.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use etcd_client::LockOptions;
use lockcell_loadtest::prom;
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::{ms, Samples};
use lockcell_proto::v1::lock_client::LockClient;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{open_fleet, per_operation, Overhead, Resources};
use crate::cluster::{Cell, CellOptions, Target};
use crate::fleet::{FleetSpec, SessionKey};
use crate::locks::{Grant, Locker};
use crate::progress;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Waiters in all.
    #[arg(long, default_value_t = 600)]
    pub waiters: usize,
    /// Locks they wait on (each gets waiters / locks of them).
    #[arg(long, default_value_t = 6)]
    pub locks: usize,
    /// How long waiters get to line up before the holders let go.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub settle: Duration,
}

/// Per lock: when its current holder started to let go.
type Releases = Arc<Vec<Mutex<Option<Instant>>>>;

pub async fn run(
    target: Target,
    cell_options: &CellOptions,
    args: &Args,
) -> anyhow::Result<Report> {
    let cell = Cell::start(target, cell_options).await?;
    let locks = args.locks.max(1);
    let waiters = args.waiters.max(locks);
    // The first `locks` sessions hold the locks at the start; the rest wait.
    let sessions = locks + waiters;
    let spec = FleetSpec {
        sessions,
        ttl: Duration::from_secs(12),
        renewals_per_ttl: 3,
        connections: sessions.min(300),
    };
    let mut report = Report::new("contention", target.name());
    report.param("waiters", waiters);
    report.param("locks", locks);

    let fleet = open_fleet(&cell, spec).await?;
    let lockers = Arc::new(lockers(&cell, &fleet, sessions).await?);
    let releases: Releases = Arc::new((0..locks).map(|_| Mutex::new(None)).collect());
    let mut holders = Vec::new();
    for l in 0..locks {
        let held = take(&lockers[l], &fleet.members[l].key, &name(l))
            .await?
            .context("free lock not granted")?;
        holders.push(held);
    }

    let handovers = Arc::new(Mutex::new(Samples::new()));
    let mut tasks = JoinSet::new();
    for w in 0..waiters {
        let member = locks + w;
        let l = w % locks;
        let (locker, key) = (lockers[member].clone(), fleet.members[member].key.clone());
        let (releases, handovers) = (releases.clone(), handovers.clone());
        tasks.spawn(async move {
            let held = take(&locker, &key, &name(l))
                .await?
                .context("a waiter was never granted")?;
            let granted = Instant::now();
            if let Some(released) = releases[l].lock().expect("releases").take() {
                handovers
                    .lock()
                    .expect("handovers")
                    .record(granted - released);
            }
            *releases[l].lock().expect("releases") = Some(Instant::now());
            give_back(&locker, &key, &name(l), held).await
        });
    }
    // A settle period, not a measurement: every waiter has sent its call by then.
    tokio::time::sleep(args.settle).await;

    let before = cell.etcd_counters().await?;
    let overhead = Overhead::start(&cell).await;
    let mut resources = Resources::start(&cell);
    let started = Instant::now();
    for (l, held) in holders.into_iter().enumerate() {
        *releases[l].lock().expect("releases") = Some(Instant::now());
        give_back(&lockers[l], &fleet.members[l].key, &name(l), held).await?;
    }
    let bar = progress::count("handovers", waiters as u64);
    while let Some(done) = tasks.join_next().await {
        done??;
        bar.inc(1);
        resources.sample();
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    let after = cell.etcd_counters().await?;
    overhead.finish(&cell, &mut report).await;
    fleet.finish().await;

    let delta = after.delta(&before);
    let mut handovers = handovers.lock().expect("handovers").clone();
    report.metric("handovers", waiters as f64);
    report.metric("handovers_per_s", waiters as f64 / elapsed.as_secs_f64());
    if let Some(p) = handovers.percentile(50.0) {
        report.metric("handover_p50_ms", ms(p));
    }
    if let Some(p) = handovers.percentile(99.0) {
        report.metric("handover_p99_ms", ms(p));
    }
    report.metric("etcd_txns_per_handover", delta.get("txns") / waiters as f64);
    report.metric(
        "etcd_requests_per_handover",
        prom::etcd_requests(&delta) / waiters as f64,
    );
    report.metric(
        "etcd_proposals_per_handover",
        delta.get("proposals_committed") / waiters as f64,
    );
    resources.finish(&mut report, sessions);
    per_operation(
        &mut report,
        "proxy_cpu_s",
        "proxy_cpu_ms_per_handover",
        waiters,
    );
    Ok(report)
}

fn name(l: usize) -> String {
    format!("contended/{l}")
}

/// One lock client per session: lockcell shares the session's connection; etcd's Lock
/// API gets a client on the session's zone member (or grpc-proxy).
async fn lockers(
    cell: &Cell,
    fleet: &crate::fleet::Fleet,
    n: usize,
) -> anyhow::Result<Vec<Locker>> {
    let mut out = Vec::with_capacity(n);
    let mut shared: Vec<Option<Locker>> = vec![None; cell.zones.len()];
    for i in 0..n {
        let zone = fleet.members[i].zone;
        out.push(match cell.target {
            Target::Lockcell => Locker::Lockcell(LockClient::new(fleet.member_channel(i))),
            _ => {
                if shared[zone].is_none() {
                    shared[zone] = Some(Locker::connect_etcd(&cell.zones[zone].endpoint).await?);
                }
                shared[zone].clone().expect("connected")
            }
        });
    }
    Ok(out)
}

/// What a hold needs to be given back: a lockcell grant or an etcd Lock API key.
enum Held {
    Lockcell(Grant),
    Etcd(Vec<u8>),
}

/// Waits for `lock` as its target's users do.
async fn take(locker: &Locker, key: &SessionKey, lock: &str) -> anyhow::Result<Option<Held>> {
    match (locker, key) {
        (Locker::Etcd(client), SessionKey::Etcd(lease)) => {
            let options = LockOptions::new().with_lease(*lease);
            let resp = client
                .lock_client()
                .lock(format!("/loadtest/contended/{lock}"), Some(options))
                .await?;
            Ok(Some(Held::Etcd(resp.key().to_vec())))
        }
        _ => Ok(locker
            .acquire(key, lock, Duration::from_secs(600))
            .await?
            .map(Held::Lockcell)),
    }
}

async fn give_back(
    locker: &Locker,
    key: &SessionKey,
    lock: &str,
    held: Held,
) -> anyhow::Result<()> {
    match (locker, held) {
        (Locker::Etcd(client), Held::Etcd(etcd_key)) => {
            client.lock_client().unlock(etcd_key).await?;
            Ok(())
        }
        (_, Held::Lockcell(grant)) => locker.release(key, lock, grant).await,
        _ => anyhow::bail!("hold and locker speak different protocols"),
    }
}
