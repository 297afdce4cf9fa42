//! Fault runs: a cell of real processes (3 etcd members, 3 proxies, client processes
//! contending for locks), faults injected in a seeded random order, and the safety
//! checker over what every client recorded.
//!
//! Faults: a client paused (SIGSTOP) for longer than its TTL, the "GC pause", taken
//! while it holds a lock; a proxy SIGKILLed and started again on its address; a proxy
//! paused (SIGSTOP) past its lease TTL; a proxy cut off from etcd (its link black-holed)
//! past its lease TTL; that link slowed down; a proxy cut off from its clients (their
//! link black-holed); the etcd leader SIGKILLed (and started again); a whole zone lost
//! (its etcd member, its proxy and the clients whose own zone it is, all SIGKILLed, then
//! started again). Clients know every proxy and move their sessions (locks and tokens
//! unchanged) when theirs fails. Besides the lock checks, every small-key write the
//! service acknowledged must be in the store's history at the revision it was
//! acknowledged with.

use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::process::Command;

use crate::checker::{self, Verdict};
use crate::fenced_server::FencedServer;
use crate::process::Managed;
use crate::{bins, eventually, EtcdCluster, ProxyOptions, ProxyProcess, Relay};

/// The kinds of fault a run injects, each once, in an order the seed picks.
pub const FAULTS: [&str; 9] = [
    "pause-client",
    "kill-proxy",
    "pause-proxy",
    "partition-proxy-from-etcd",
    "delay-proxy-etcd",
    "unknown-outcomes",
    "cut-clients-from-proxy",
    "kill-etcd-leader",
    "lose-zone",
];

/// How long the "unknown-outcomes" fault keeps etcd's answers from proxy c: past its
/// etcd deadline (2 s), within its lease TTL (3 s).
const ANSWERS_LOST_FOR: Duration = Duration::from_millis(2500);

/// How much the slowed link holds back every chunk.
const LINK_DELAY: Duration = Duration::from_millis(150);

/// The size of a run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub seed: u64,
    pub clients: usize,
    pub locks: usize,
    /// Client session TTL.
    pub ttl: Duration,
    /// Quiet time before, between and after faults.
    pub settle: Duration,
    /// The faults to inject (each once, in an order the seed picks).
    pub faults: Vec<&'static str>,
}

impl RunOptions {
    pub fn new(seed: u64) -> Self {
        RunOptions {
            seed,
            clients: 4,
            locks: 2,
            ttl: Duration::from_secs(2),
            settle: Duration::from_secs(2),
            faults: FAULTS.to_vec(),
        }
    }
}

/// What a run did and what the checker found.
#[derive(Debug)]
pub struct RunReport {
    pub seed: u64,
    pub faults: Vec<&'static str>,
    pub verdict: Verdict,
    /// Writes the fenced resources accepted.
    pub accepted: usize,
    /// The client paused while holding a lock, and the hold it had then.
    pub paused: Option<Paused>,
    /// Every client's record.
    pub records: Vec<checker::Record>,
    /// Acknowledged small-key writes checked against the store's history.
    pub kv_writes: usize,
}

/// A client paused while it held a lock.
#[derive(Debug, Clone)]
pub struct Paused {
    pub client: String,
    pub lock: String,
    pub token: String,
}

/// Runs one fault run with its files in a fresh temporary folder, which it returns (to
/// keep, with `TempDir::keep`, when the run broke a rule).
pub async fn run_in_temp_dir(
    options: &RunOptions,
) -> anyhow::Result<(tempfile::TempDir, RunReport)> {
    let dir = tempfile::Builder::new()
        .prefix("lockcell-chaos-")
        .tempdir()?;
    let report = run(dir.path(), options).await?;
    Ok((dir, report))
}

/// Runs one fault run with its files under `dir`.
pub async fn run(dir: &Path, options: &RunOptions) -> anyhow::Result<RunReport> {
    let mut rng = StdRng::seed_from_u64(options.seed);
    let mut etcd = EtcdCluster::start_in(dir, 3).await?;
    let relay = Relay::start(&etcd.endpoints()[0]).await?;
    let mut proxies = Vec::new();
    for zone in ["a", "b", "c"] {
        // Proxy c reaches etcd only through the relay, which a fault black-holes.
        let endpoints = if zone == "c" {
            vec![relay.addr.clone()]
        } else {
            etcd.endpoints()
        };
        proxies.push(ProxyProcess::start(&ProxyOptions::new(zone, endpoints), dir).await?);
    }
    let lease_ttl = ProxyOptions::new("c", Vec::new()).lease_ttl;
    // Clients reach each proxy through a relay of their own, which a fault black-holes.
    let mut client_relays = Vec::new();
    for proxy in &proxies {
        client_relays.push(Relay::start(&proxy.addr).await?);
    }
    let fenced = FencedServer::start().await?;
    let locks: Vec<String> = (0..options.locks).map(|l| format!("chaos/l{l}")).collect();
    let client_bin = bins::workspace_bin("lockcell-chaos-client")?;
    let mut clients = Vec::new();
    for c in 0..options.clients {
        let mut order: Vec<String> = client_relays.iter().map(|r| r.url()).collect();
        order.rotate_left(c % proxies.len());
        let mut cmd = Command::new(&client_bin);
        cmd.arg("--proxies")
            .arg(order.join(","))
            .arg("--locks")
            .arg(locks.join(","))
            .arg("--log")
            .arg(dir.join(format!("client-{c}.jsonl")))
            .arg("--fenced")
            .arg(&fenced.addr)
            .arg("--name")
            .arg(format!("client-{c}"))
            .arg("--ttl")
            .arg(format!("{}ms", options.ttl.as_millis()))
            .arg("--seed")
            .arg((options.seed * 1000 + c as u64).to_string());
        let log = dir.join(format!("client-{c}.log"));
        clients.push(Managed::spawn(format!("client {c}"), cmd, &log)?);
    }

    let mut faults = options.faults.clone();
    faults.shuffle(&mut rng);
    let mut paused = None;
    tokio::time::sleep(options.settle).await;
    for fault in &faults {
        match *fault {
            "pause-client" => {
                let c = rng.random_range(0..clients.len());
                let record = dir.join(format!("client-{c}.jsonl"));
                let hold = holding(&record, Duration::from_secs(20)).await;
                clients[c].signal(Signal::SIGSTOP)?;
                paused = hold.ok();
                tokio::time::sleep(options.ttl * 3).await;
                clients[c].signal(Signal::SIGCONT)?;
            }
            "pause-proxy" => {
                // a or b: past its lease TTL, so its leases (and what stayed on them) go.
                let p = rng.random_range(0..2);
                proxies[p].signal(Signal::SIGSTOP)?;
                tokio::time::sleep(lease_ttl * 2).await;
                proxies[p].signal(Signal::SIGCONT)?;
            }
            "delay-proxy-etcd" => {
                relay.delay(LINK_DELAY);
                tokio::time::sleep(lease_ttl * 2).await;
                relay.delay(Duration::ZERO);
            }
            "unknown-outcomes" => {
                // The next grant proxy c sends reaches etcd and is applied, but neither
                // its answer nor any other comes back before c's etcd deadline: c does
                // not know whether it granted, and its session must still own the key.
                relay.cut_replies_after(b"/l/chaos/", ANSWERS_LOST_FOR);
                let sprung = eventually("proxy c sends a grant", options.ttl * 10, || async {
                    Ok((!relay.trap_pending()).then_some(()))
                })
                .await;
                if sprung.is_err() {
                    // No client used c meanwhile: nothing to lose.
                    relay.disarm();
                }
                tokio::time::sleep(ANSWERS_LOST_FOR).await;
            }
            "cut-clients-from-proxy" => {
                let p = rng.random_range(0..client_relays.len());
                client_relays[p].cut(true);
                tokio::time::sleep(options.ttl * 3).await;
                client_relays[p].cut(false);
            }
            "kill-proxy" => {
                // a or b: c's fault is the partition.
                let p = rng.random_range(0..2);
                proxies[p].process.kill();
                let mut again = ProxyOptions::new(&proxies[p].zone.clone(), etcd.endpoints());
                again.listen = Some(proxies[p].addr.clone());
                tokio::time::sleep(options.settle).await;
                proxies[p] = ProxyProcess::start(&again, dir).await?;
            }
            "partition-proxy-from-etcd" => {
                relay.cut(true);
                // Past the proxy's lease TTL: its leases, and what stayed on them, go.
                tokio::time::sleep(lease_ttl * 2).await;
                relay.cut(false);
            }
            "kill-etcd-leader" => {
                let leader = leader_of(&etcd).await?;
                etcd.members[leader].process.kill();
                tokio::time::sleep(options.settle).await;
                etcd.members[leader].process.respawn()?;
            }
            "lose-zone" => {
                // b or c (a's member is proxy c's only way to etcd: losing it would be
                // two faults at once).
                let z = rng.random_range(1..3);
                etcd.members[z].process.kill();
                proxies[z].process.kill();
                let own: Vec<usize> = (0..clients.len()).filter(|c| c % 3 == z).collect();
                for &c in &own {
                    clients[c].kill();
                }
                tokio::time::sleep(lease_ttl * 2).await;
                etcd.members[z].process.respawn()?;
                let mut again = ProxyOptions::new(&proxies[z].zone.clone(), etcd.endpoints());
                again.listen = Some(proxies[z].addr.clone());
                proxies[z] = ProxyProcess::start(&again, dir).await?;
                for &c in &own {
                    clients[c].respawn()?;
                }
            }
            other => anyhow::bail!("unknown fault {other}"),
        }
        tokio::time::sleep(options.settle).await;
    }
    for client in clients.iter_mut() {
        client.kill();
    }

    let mut records = Vec::new();
    for c in 0..options.clients {
        let text =
            std::fs::read_to_string(dir.join(format!("client-{c}.jsonl"))).unwrap_or_default();
        records.extend(checker::read_records(&text));
    }
    let mut verdict = checker::check(&records);
    let kv_writes = check_writes(&etcd, &records, &mut verdict.violations).await?;
    // Every client is gone: once their sessions have expired (and a dead proxy's leases
    // with them), no holder or waiter key may be left. One that is belongs to nobody.
    let within = options.ttl.max(lease_ttl) * 3 + Duration::from_secs(5);
    if let Err(left) = eventually("every lock and queue is empty", within, || async {
        let left = keys_left(&etcd).await?;
        Ok(left.is_empty().then_some(()))
    })
    .await
    {
        let keys = keys_left(&etcd).await.unwrap_or_default();
        verdict.violations.push(format!(
            "{left}: after every client was gone, keys were left that nobody owns: {keys:?}"
        ));
    }
    for lock in &locks {
        if let Some(resource) = fenced.resource(lock) {
            let accepted = resource.accepted();
            if accepted.windows(2).any(|w| w[1].1 < w[0].1) {
                verdict.violations.push(format!(
                    "{lock}: the fenced resource accepted a lower token"
                ));
            }
        }
    }
    Ok(RunReport {
        seed: options.seed,
        faults,
        verdict,
        accepted: fenced.accepted(),
        paused,
        records,
        kv_writes,
    })
}

/// The holder keys under `/l/` (release markers aside) and the waiter keys under `/q/`
/// in the store, each with its value.
async fn keys_left(etcd: &EtcdCluster) -> anyhow::Result<Vec<String>> {
    let mut client = etcd.client().await?;
    let mut left = Vec::new();
    for prefix in ["/l/", "/q/"] {
        let resp = client
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await?;
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            if key.ends_with("!r") {
                continue;
            }
            left.push(format!("{key} = {}", String::from_utf8_lossy(kv.value())));
        }
    }
    Ok(left)
}

/// Checks that every acknowledged small-key write is in the store's history: the key
/// had the value written at the revision acknowledged. Returns how many it checked.
async fn check_writes(
    etcd: &EtcdCluster,
    records: &[checker::Record],
    violations: &mut Vec<String>,
) -> anyhow::Result<usize> {
    let mut client = etcd.client().await?;
    let mut checked = 0;
    for record in records {
        let checker::Record::KvWrite {
            key,
            value,
            revision,
            ..
        } = record
        else {
            continue;
        };
        checked += 1;
        let at = etcd_client::GetOptions::new().with_revision(*revision);
        let found = client.get(format!("/k/{key}"), Some(at)).await?;
        let ok = found
            .kvs()
            .first()
            .is_some_and(|kv| kv.mod_revision() == *revision && kv.value() == value.as_bytes());
        if !ok {
            violations.push(format!(
                "the acknowledged write of {value:?} to {key} at revision {revision} is not in the store's history"
            ));
        }
    }
    Ok(checked)
}

/// Waits until the client writing `record` holds a lock (its last record is a grant or
/// an act), and says which.
async fn holding(record: &Path, within: Duration) -> anyhow::Result<Paused> {
    crate::eventually("a client holding a lock", within, || async {
        let text = std::fs::read_to_string(record).unwrap_or_default();
        let last = checker::read_records(&text).pop();
        Ok(match last {
            Some(checker::Record::Grant {
                client,
                lock,
                token,
                ..
            })
            | Some(checker::Record::Act {
                client,
                lock,
                token,
                ..
            }) => Some(Paused {
                client,
                lock,
                token,
            }),
            _ => None,
        })
    })
    .await
}

/// The index of the member that leads now.
async fn leader_of(etcd: &EtcdCluster) -> anyhow::Result<usize> {
    for i in 0..etcd.members.len() {
        let Ok(mut client) = etcd.member_client(i).await else {
            continue;
        };
        let Ok(status) = client.status().await else {
            continue;
        };
        let me = status.header().map(|h| h.member_id());
        if me == Some(status.leader()) {
            return Ok(i);
        }
    }
    anyhow::bail!("no etcd member says it leads")
}
