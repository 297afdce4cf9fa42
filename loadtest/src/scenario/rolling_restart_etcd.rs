//! `rolling-restart` through the proxies' etcd API: N leases of bare etcd clients, each
//! with one leased key and one lock taken through etcd's Lock service on the lease,
//! spread over clients that each know their zone's proxy only (an etcd client given
//! one address, as docs/etcd-api.md asks for now). Each client renews its leases on one
//! keepalive stream, opened again whenever it breaks, as etcd's clients do. The proxies
//! restart one at a time as in the SDK's run; a draining proxy hands its leases over and
//! takes them back once it is up again. Afterwards every lease, key and lock is read
//! back: lost, or changed (its create revision, the token of a lock taken through
//! etcd's Lock service).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use etcd_client::{LockOptions, PutOptions};
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::secs;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

use super::rolling_restart::{restart_all, Args, ProxyCounters};
use crate::cluster::{Cell, CellOptions, Target};
use crate::etcdpb::lease_client::LeaseClient;
use crate::etcdpb::LeaseKeepAliveRequest;
use crate::fleet::stopped;
use crate::progress;

/// Lease setups (grant, put, lock) and read-backs in flight at once.
const CONCURRENCY: usize = 64;

/// How long a client waits before opening its keepalive stream again.
const RECONNECT_AFTER: Duration = Duration::from_millis(250);

/// One lease and what it holds.
struct Held {
    client: usize,
    lease: i64,
    key: String,
    key_revision: i64,
    lock_key: String,
    lock_revision: i64,
}

/// What the clients' keepalives saw.
#[derive(Default)]
struct Kept {
    /// Leases the proxies answered TTL 0 for (gone).
    gone: Mutex<HashMap<i64, Instant>>,
    renewals_sent: AtomicU64,
    renewals_answered: AtomicU64,
    stream_breaks: AtomicU64,
}

pub async fn run(
    target: Target,
    cell_options: &CellOptions,
    args: &Args,
    mut report: Report,
) -> anyhow::Result<Report> {
    let mut cell_options = cell_options.clone();
    cell_options.lease_ttl = args.ttl;
    cell_options.drain_timeout = Some(args.drain_timeout);
    let mut cell = Cell::start(target, &cell_options).await?;
    let addrs: Vec<String> = cell.zones.iter().map(|z| z.endpoint.clone()).collect();
    let clients = args.clients.clamp(1, args.sessions.max(1));
    let lease_ttl = args.etcd_lease_ttl;
    report.param("leases", args.sessions);
    report.param("clients", clients);
    report.param("proxy_lease_ttl_s", args.ttl.as_secs_f64());
    report.param("etcd_lease_ttl_s", lease_ttl.as_secs_f64());
    report.param("drain_timeout_s", args.drain_timeout.as_secs_f64());
    report.param("baseline_s", args.baseline.as_secs_f64());

    let mut connected = Vec::with_capacity(clients);
    for c in 0..clients {
        let options =
            etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(10));
        let endpoint = addrs[c % addrs.len()].as_str();
        connected.push(etcd_client::Client::connect([endpoint], Some(options)).await?);
    }
    let held = hold(&connected, args.sessions, lease_ttl).await?;

    let kept = Arc::new(Kept::default());
    let (stop_tx, stop) = watch::channel(false);
    let mut keepers = JoinSet::new();
    for c in 0..clients {
        let leases: Vec<i64> = held
            .iter()
            .filter(|h| h.client == c)
            .map(|h| h.lease)
            .collect();
        keepers.spawn(keep_alive(
            addrs[c % addrs.len()].clone(),
            leases,
            lease_ttl / 3,
            kept.clone(),
            stop.clone(),
        ));
    }

    let bar = progress::timed("before the restarts", args.baseline);
    let baseline_from = Instant::now();
    while baseline_from.elapsed() < args.baseline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        bar.set_position(baseline_from.elapsed().as_secs());
    }
    bar.finish_and_clear();

    let etcd_before = cell.etcd_counters().await?;
    let restarts_from = Instant::now();
    let mut counted = restart_all(&mut cell, args, None, &mut report).await?;
    let restarts_took = restarts_from.elapsed();
    let etcd_after = cell.etcd_counters().await?;
    // One lease TTL more, so every lease has been renewed where it ended up.
    tokio::time::sleep(lease_ttl).await;
    stop_tx.send_replace(true);
    while keepers.join_next().await.is_some() {}
    for zone in 0..cell.zones.len() {
        let proxy = cell
            .proxy(zone)
            .context("a lockcell zone without a proxy")?;
        counted.add(&ProxyCounters::read(proxy).await?);
    }

    let checked = read_back(&connected, &held).await;
    let gone = kept.gone.lock().expect("gone leases").len();
    report.metric("leases_before", held.len() as f64);
    report.metric("leases_answered_gone", gone as f64);
    report.metric("leases_lost", checked.leases_lost as f64);
    report.metric("keys_lost", checked.keys_lost as f64);
    report.metric("keys_changed", checked.keys_changed as f64);
    report.metric("locks_lost", checked.locks_lost as f64);
    report.metric("tokens_changed", checked.tokens_changed as f64);
    report.metric("read_back_errors", checked.errors as f64);
    report.metric(
        "renewals_sent",
        kept.renewals_sent.load(Ordering::Relaxed) as f64,
    );
    report.metric(
        "renewals_answered",
        kept.renewals_answered.load(Ordering::Relaxed) as f64,
    );
    report.metric(
        "keepalive_stream_breaks",
        kept.stream_breaks.load(Ordering::Relaxed) as f64,
    );
    report.metric("proxy_leases_taken_over", counted.sessions_resumed);
    report.metric("proxy_keys_moved", counted.keys_moved);
    report.metric("proxy_keys_lost_on_resume", counted.keys_lost);
    let delta = etcd_after.delta(&etcd_before);
    report.metric(
        "etcd_proposals_during_restarts",
        delta.get("proposals_committed"),
    );
    report.metric("etcd_txns_during_restarts", delta.get("txns"));
    report.metric("restarts_s", secs(restarts_took));
    for (lease, at) in kept.gone.lock().expect("gone leases").iter().take(20) {
        report.evidence.push(format!(
            "lease {lease:x} answered gone {:.3} s after the restarts began",
            secs(at.saturating_duration_since(restarts_from))
        ));
    }
    Ok(report)
}

/// Grants `leases` leases spread over `clients`, each with a leased key and a lock
/// taken through etcd's Lock service.
async fn hold(
    clients: &[etcd_client::Client],
    leases: usize,
    ttl: Duration,
) -> anyhow::Result<Vec<Held>> {
    let bar = progress::count("granting leases", leases as u64);
    let gate = Arc::new(Semaphore::new(CONCURRENCY));
    let mut setting_up = JoinSet::new();
    for i in 0..leases {
        let c = i % clients.len();
        let client = clients[c].clone();
        let gate = gate.clone();
        setting_up.spawn(async move {
            let _turn = gate.acquire_owned().await?;
            let lease = client
                .lease_client()
                .grant(ttl.as_secs() as i64, None)
                .await?
                .id();
            let key = format!("rolling/key/{i}");
            let put = client
                .kv_client()
                .put(
                    key.as_str(),
                    "held",
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await?;
            let key_revision = put.header().map_or(0, |h| h.revision());
            let locked = client
                .lock_client()
                .lock(
                    format!("rolling/lock/{i}"),
                    Some(LockOptions::new().with_lease(lease)),
                )
                .await?;
            let lock_key = String::from_utf8(locked.key().to_vec())?;
            let lock_revision = first_create_revision(&client, &lock_key).await?;
            anyhow::Ok(Held {
                client: c,
                lease,
                key,
                key_revision,
                lock_key,
                lock_revision: lock_revision.context("the lock's key is not there")?,
            })
        });
    }
    let mut held = Vec::with_capacity(leases);
    while let Some(done) = setting_up.join_next().await {
        held.push(done??);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(held)
}

async fn first_create_revision(
    client: &etcd_client::Client,
    key: &str,
) -> anyhow::Result<Option<i64>> {
    let got = client.kv_client().get(key, None).await?;
    Ok(got.kvs().first().map(|kv| kv.create_revision()))
}

/// Renews `leases` every `every` on one keepalive stream to `addr`, opened again
/// whenever it breaks (a proxy restarting, or refusing a lease it handed over), until
/// `stop`.
async fn keep_alive(
    addr: String,
    leases: Vec<i64>,
    every: Duration,
    kept: Arc<Kept>,
    mut stop: watch::Receiver<bool>,
) {
    let Ok(endpoint) = Endpoint::from_shared(format!("http://{addr}")) else {
        return;
    };
    let channel = endpoint
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy();
    loop {
        let (tx, rx) = mpsc::channel(leases.len().max(1));
        let opened = LeaseClient::new(channel.clone())
            .lease_keep_alive(ReceiverStream::new(rx))
            .await;
        let mut replies = match opened {
            Ok(replies) => replies.into_inner(),
            Err(_) => {
                kept.stream_breaks.fetch_add(1, Ordering::Relaxed);
                tokio::select! {
                    _ = tokio::time::sleep(RECONNECT_AFTER) => continue,
                    _ = stopped(&mut stop) => return,
                }
            }
        };
        let mut tick = tokio::time::interval(every);
        let broken = loop {
            tokio::select! {
                _ = stopped(&mut stop) => return,
                _ = tick.tick() => {
                    for &id in &leases {
                        if kept.gone.lock().expect("gone leases").contains_key(&id) {
                            continue;
                        }
                        if tx.send(LeaseKeepAliveRequest { id }).await.is_err() {
                            break;
                        }
                        kept.renewals_sent.fetch_add(1, Ordering::Relaxed);
                    }
                }
                reply = replies.message() => match reply {
                    Ok(Some(reply)) => {
                        kept.renewals_answered.fetch_add(1, Ordering::Relaxed);
                        if reply.ttl <= 0 {
                            kept.gone
                                .lock()
                                .expect("gone leases")
                                .entry(reply.id)
                                .or_insert_with(Instant::now);
                        }
                    }
                    Ok(None) | Err(_) => break true,
                },
            }
        };
        if broken {
            kept.stream_breaks.fetch_add(1, Ordering::Relaxed);
            tokio::select! {
                _ = tokio::time::sleep(RECONNECT_AFTER) => {}
                _ = stopped(&mut stop) => return,
            }
        }
    }
}

#[derive(Default)]
struct Checked {
    leases_lost: u64,
    keys_lost: u64,
    keys_changed: u64,
    locks_lost: u64,
    tokens_changed: u64,
    errors: u64,
}

/// Reads every lease, key and lock back through its own client.
async fn read_back(clients: &[etcd_client::Client], held: &[Held]) -> Checked {
    let gate = Arc::new(Semaphore::new(CONCURRENCY));
    let mut reading = JoinSet::new();
    for h in held {
        let client = clients[h.client].clone();
        let gate = gate.clone();
        let (lease, key, lock_key) = (h.lease, h.key.clone(), h.lock_key.clone());
        let (key_revision, lock_revision) = (h.key_revision, h.lock_revision);
        reading.spawn(async move {
            let _turn = gate.acquire_owned().await?;
            let mut checked = Checked::default();
            let alive = client.lease_client().time_to_live(lease, None).await?;
            checked.leases_lost += u64::from(alive.ttl() <= 0);
            let got = client.kv_client().get(key.as_str(), None).await?;
            match got.kvs().first() {
                None => checked.keys_lost += 1,
                Some(kv) if kv.create_revision() != key_revision || kv.lease() != lease => {
                    checked.keys_changed += 1
                }
                Some(_) => {}
            }
            match first_create_revision(&client, &lock_key).await? {
                None => checked.locks_lost += 1,
                Some(r) if r != lock_revision => checked.tokens_changed += 1,
                Some(_) => {}
            }
            anyhow::Ok(checked)
        });
    }
    let mut total = Checked::default();
    while let Some(done) = reading.join_next().await {
        match done {
            Ok(Ok(c)) => {
                total.leases_lost += c.leases_lost;
                total.keys_lost += c.keys_lost;
                total.keys_changed += c.keys_changed;
                total.locks_lost += c.locks_lost;
                total.tokens_changed += c.tokens_changed;
            }
            _ => total.errors += 1,
        }
    }
    total
}
