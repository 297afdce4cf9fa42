//! Fault runs: a cell of real processes (3 etcd members, 3 proxies, client processes
//! contending for locks), faults injected in a seeded random order, and the safety
//! checker over what every client recorded.
//!
//! Faults: a client paused (SIGSTOP) for longer than its TTL, the "GC pause", taken
//! while it holds a lock; a proxy SIGKILLed and started again on its address; a proxy
//! paused (SIGSTOP) past its lease TTL; a proxy cut off from etcd (its link black-holed)
//! past its lease TTL; that link slowed down; etcd's answers to that proxy lost, past
//! its etcd deadline, just after a grant, an enqueue or an ephemeral write went through
//! (outcomes unknown); a proxy cut off from its clients (their
//! link black-holed); the etcd leader SIGKILLed (and started again); a whole zone lost
//! (its etcd member, its proxy and the clients whose own zone it is, all SIGKILLed, then
//! started again); a client or proxy started again with its clocks running fast or
//! slow within the proxies' clock-rate bound (libfaketime); etcd compacted at its
//! current revision; a client killed and started again at once; the small keys' prefix
//! moved to a second cell (one etcd member, behind the same shard map) and back while
//! clients write, read and watch it. Clients know every proxy and move their sessions
//! (locks and tokens unchanged) when theirs fails.
//!
//! Every run has a lock of the default class (waiters in each proxy's arbiter) and one
//! of a fair class (waiters in line in the store). Besides the checks over the clients'
//! records, the run watches the store's holder and waiter keys: every guard a client
//! was told is valid must match a holder key living at that time, and no lock may stay
//! free long while a waiter key stands in its line; every small-key write the service
//! acknowledged must be in the store's history at the revision it was acknowledged
//! with; and once every client is gone, no holder or waiter key may be left.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use etcd_client::{EventType, WatchOptions};

use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::process::Command;

use crate::checker::{self, StoreBounds, StoreEvent, Verdict};
use crate::fenced_server::FencedServer;
use crate::kvcheck::{self, History, KvEvent};
use crate::process::Managed;
use crate::{bins, eventually, EtcdCluster, ProxyOptions, ProxyProcess, Relay};

/// The kinds of fault a run injects, each once, in an order the seed picks.
pub const FAULTS: [&str; 13] = [
    "pause-client",
    "kill-proxy",
    "pause-proxy",
    "partition-proxy-from-etcd",
    "delay-proxy-etcd",
    "unknown-outcomes",
    "cut-clients-from-proxy",
    "kill-etcd-leader",
    "lose-zone",
    "skew-clock",
    "compact-etcd",
    "restart-client",
    "move-prefix",
];

/// The fault kinds this machine can inject: every one, "skew-clock" only where
/// libfaketime is installed (`make setup` installs it).
pub fn available_faults() -> Vec<&'static str> {
    let faketime = bins::faketime_env(1.0).is_some();
    FAULTS
        .into_iter()
        .filter(|f| *f != "skew-clock" || faketime)
        .collect()
}

/// The proxies' clock-rate bound (`--clock-rate-bound`): how much faster or slower than
/// a proxy's clock a client's may run, and a proxy's than etcd's, with every validity
/// still safe. The "skew-clock" fault stays within four fifths of it.
pub const CLOCK_RATE_BOUND: f64 = 0.01;

/// The classes of a run's proxies: its second lock (`chaos/fair/l1`) is of a fair
/// class, whose waiters stand in line in the store.
const CLASSES: &str = r#"[[class]]
name = "chaos-fair"
prefix = "chaos/fair/"
fair = true
"#;

/// The prefix the "move-prefix" fault moves to the run's second cell and back: the
/// clients' persistent small keys (a move waits for no holder or ephemeral key, and
/// there are none under it).
const MOVED: &str = "chaos/kv/";

/// The names of a run's locks: even ones of the default class, odd ones fair.
fn lock_names(locks: usize) -> Vec<String> {
    (0..locks)
        .map(|l| {
            if l % 2 == 1 {
                format!("chaos/fair/l{l}")
            } else {
                format!("chaos/l{l}")
            }
        })
        .collect()
}

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
            faults: available_faults(),
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
    /// Acknowledged small-key writes, reads and watched events checked against the
    /// store's history.
    pub kv: kvcheck::Checked,
    /// Which process the "skew-clock" fault started again, at what rate.
    pub skewed: Option<String>,
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
    // The second cell, behind one shard map with the first: every name is served by
    // the first until the "move-prefix" fault moves the small keys.
    let other_dir = dir.join("other-cell");
    std::fs::create_dir_all(&other_dir)?;
    let other = EtcdCluster::start_in(&other_dir, 1).await?;
    let clusters = [
        etcd.init_cell().await?.cluster_id,
        other.init_cell().await?.cluster_id,
    ];
    let map = dir.join("shardmap.toml");
    std::fs::write(
        &map,
        format!(
            "[cells.main]\nendpoints = {:?}\n[cells.other]\nendpoints = {:?}\n\n[[route]]\nprefix = \"\"\ncell = \"main\"\n",
            etcd.endpoints(),
            other.endpoints()
        ),
    )?;
    let main_endpoint = etcd.endpoints()[0].clone();
    let shardmap = |args: &[&str]| {
        let mut all = vec!["shardmap"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--etcd", &main_endpoint]);
        let all: Vec<String> = all.into_iter().map(str::to_owned).collect();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            crate::etcd::lockcell_cell(&args)
        })
    };
    shardmap(&["set", &map.display().to_string()]).await??;
    let relay = Relay::start(&etcd.endpoints()[0]).await?;
    let proxy_options = ProxyShape::new(dir)?;
    let mut proxies = Vec::new();
    for zone in ["a", "b", "c"] {
        // Proxy c reaches etcd only through the relay, which a fault black-holes.
        let endpoints = if zone == "c" {
            vec![relay.addr.clone()]
        } else {
            etcd.endpoints()
        };
        proxies.push(ProxyProcess::start(&proxy_options.of(zone, endpoints), dir).await?);
    }
    let lease_ttl = ProxyOptions::new("c", Vec::new()).lease_ttl;
    let watch = StoreWatch::start(&etcd).await?;
    let other_watch = StoreWatch::start(&other).await?;
    // Clients reach each proxy through a relay of their own, which a fault black-holes.
    let mut client_relays = Vec::new();
    for proxy in &proxies {
        client_relays.push(Relay::start(&proxy.addr).await?);
    }
    let fenced = FencedServer::start().await?;
    let locks = lock_names(options.locks);
    let mut clients = Vec::new();
    for c in 0..options.clients {
        let mut order: Vec<String> = client_relays.iter().map(|r| r.url()).collect();
        order.rotate_left(c % proxies.len());
        let shape = ClientShape {
            proxies: order,
            locks: locks.clone(),
            ttl: options.ttl,
            seed: options.seed * 1000 + c as u64,
            hold_for: None,
        };
        clients.push(shape.spawn(dir, c, &fenced.addr, &[])?);
    }

    let mut faults = options.faults.clone();
    faults.shuffle(&mut rng);
    let mut paused = None;
    let mut skewed = None;
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
                // A grant, a fair waiter's enqueue or an ephemeral write.
                let pattern: &[u8] = [&b"/l/chaos/"[..], b"/q/chaos/fair/", b"/k/chaos/members/"]
                    [rng.random_range(0..3)];
                relay.cut_replies_after(pattern, ANSWERS_LOST_FOR);
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
                client_relays[p].heal();
            }
            "kill-proxy" => {
                // a or b: c's fault is the partition.
                let p = rng.random_range(0..2);
                proxies[p].process.kill();
                let again = proxy_options.again(&proxies[p], etcd.endpoints());
                tokio::time::sleep(options.settle).await;
                proxies[p] = ProxyProcess::start(&again, dir).await?;
            }
            "partition-proxy-from-etcd" => {
                relay.cut(true);
                // Past the proxy's lease TTL: its leases, and what stayed on them, go.
                tokio::time::sleep(lease_ttl * 2).await;
                relay.heal();
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
                let again = proxy_options.again(&proxies[z], etcd.endpoints());
                proxies[z] = ProxyProcess::start(&again, dir).await?;
                for &c in &own {
                    clients[c].respawn()?;
                }
            }
            "compact-etcd" => {
                // At the store's revision now (once the run's own watch has seen it): a
                // watch or feed that resumes there must not take it for whole (etcd has
                // dropped the deletes made at it).
                let now = watch.mark(&etcd).await?;
                etcd.client().await?.compact(now, None).await?;
                tokio::time::sleep(options.settle).await;
            }
            "restart-client" => {
                // Killed and started at once: its new session announces the same member
                // while the old one still lives, until its TTL ends. A client of proxy a,
                // where the two sessions share one etcd lease.
                let own_a: Vec<usize> = (0..clients.len()).filter(|c| c % 3 == 0).collect();
                let c = own_a[rng.random_range(0..own_a.len())];
                clients[c].kill();
                clients[c].respawn()?;
                tokio::time::sleep(options.ttl * 3).await;
            }
            "move-prefix" => {
                // To the second cell and back, each move waiting for none of its names
                // to be held (there are only persistent keys under it), while clients
                // write (refused during the pause), read and watch it.
                for to in ["other", "main"] {
                    shardmap(&["move", MOVED, "--to", to, "--wait", "60s"])
                        .await?
                        .with_context(|| format!("moving {MOVED} to cell {to}"))?;
                    tokio::time::sleep(options.ttl * 3).await;
                }
            }
            "skew-clock" => {
                // Within the bound, so the checker must find nothing. The process keeps
                // its clocks' rate for the rest of the run.
                let rate = 1.0 + rng.random_range(-0.8..0.8) * CLOCK_RATE_BOUND;
                let env = bins::faketime_env(rate).context("libfaketime is not installed")?;
                if rng.random_bool(0.5) {
                    let c = rng.random_range(0..clients.len());
                    clients[c].respawn_with_env(&env)?;
                    skewed = Some(format!("client-{c} at x{rate:.4}"));
                } else {
                    // a or b (c's link to etcd goes through the relay).
                    let p = rng.random_range(0..2);
                    proxies[p].process.kill();
                    let mut again = proxy_options.again(&proxies[p], etcd.endpoints());
                    again.env = env;
                    proxies[p] = ProxyProcess::start(&again, dir).await?;
                    skewed = Some(format!("proxy {} at x{rate:.4}", proxies[p].zone));
                }
                tokio::time::sleep(options.ttl * 3).await;
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
    let (mut verdict, mut history) = watch
        .verdict(&etcd, &records, options.ttl, lease_ttl)
        .await?;
    history.cluster = clusters[0].clone();
    let other_history = other_watch.history(&other, &clusters[1]).await?;
    let kv = kvcheck::check(&records, &[history, other_history], &mut verdict.violations);
    // Every client is gone: once their sessions have expired (and a dead proxy's leases
    // with them), no holder, waiter or membership key may be left. One that is belongs
    // to nobody.
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
        kv,
        skewed,
    })
}

/// Whose clocks run off the machine's in a [`skewed_holder_run`], and at what rate.
#[derive(Debug, Clone, Copy)]
pub enum Skewed {
    /// The holder's: slow, it believes its deadline later than it is.
    Holder(f64),
    /// The proxy's: fast, it ends sessions sooner than the validity it told.
    Proxy(f64),
}

/// What the clock-rate bound is for, shown: one proxy, and two clients contending for one
/// lock, the first holding for long. Once it holds, its link to the proxy is cut: its
/// session expires at the proxy, which lets the lock go to the second client, while the
/// first still acts until the deadline its own clock shows. With the holder's or the
/// proxy's clocks off by less than the bound, the holder's deadline comes before the
/// proxy lets go; off by more (a holder slower, a proxy faster), the checker sees two
/// holders at once. Returns the checker's verdict, records and store checks both.
pub async fn skewed_holder_run(dir: &Path, skewed: Skewed) -> anyhow::Result<Verdict> {
    let rate = match skewed {
        Skewed::Holder(rate) | Skewed::Proxy(rate) => rate,
    };
    let env = bins::faketime_env(rate).context("libfaketime is not installed")?;
    let (holder_env, proxy_env) = match skewed {
        Skewed::Holder(_) => (env, Vec::new()),
        Skewed::Proxy(_) => (Vec::new(), env),
    };
    let ttl = Duration::from_secs(2);
    let etcd = EtcdCluster::start_in(dir, 1).await?;
    let mut options = ProxyShape::new(dir)?.of("a", etcd.endpoints());
    options.env = proxy_env;
    let proxy = ProxyProcess::start(&options, dir).await?;
    let relays = [
        Relay::start(&proxy.addr).await?,
        Relay::start(&proxy.addr).await?,
    ];
    let fenced = FencedServer::start().await?;
    let watch = StoreWatch::start(&etcd).await?;
    let shape = |c: usize, hold_for| ClientShape {
        proxies: vec![relays[c].url()],
        locks: lock_names(1),
        ttl,
        seed: c as u64,
        hold_for,
    };
    let mut holder = shape(0, Some(ttl * 5)).spawn(dir, 0, &fenced.addr, &holder_env)?;
    let mut other = shape(1, None).spawn(dir, 1, &fenced.addr, &[])?;
    let held = holding(&dir.join("client-0.jsonl"), Duration::from_secs(30)).await?;
    relays[0].cut(true);
    let cut_at = checker::now_ns();
    // The other client is granted the lock once the proxy has let it go, and the first
    // stops believing once its own clock shows its deadline passed.
    let records_of = |c: usize| {
        let text =
            std::fs::read_to_string(dir.join(format!("client-{c}.jsonl"))).unwrap_or_default();
        checker::read_records(&text)
    };
    eventually("the other client is granted the lock", ttl * 5, || async {
        Ok(records_of(1)
            .iter()
            .any(|r| matches!(r, checker::Record::Grant { at_ns, .. } if *at_ns > cut_at))
            .then_some(()))
    })
    .await?;
    eventually(
        "the first client stops believing it holds the lock",
        ttl * 5,
        || async {
            Ok(records_of(0)
                .iter()
                .any(|r| matches!(r, checker::Record::End { token, .. } if *token == held.token))
                .then_some(()))
        },
    )
    .await?;
    holder.kill();
    other.kill();
    let records: Vec<_> = records_of(0).into_iter().chain(records_of(1)).collect();
    let lease_ttl = ProxyOptions::new("a", Vec::new()).lease_ttl;
    Ok(watch.verdict(&etcd, &records, ttl, lease_ttl).await?.0)
}

/// The longest a lock may stay free while a waiter key stands in its line: a waiter
/// whose client is gone, paused or cut off leaves with its session (the TTL, and the
/// proxy's reaper); one whose proxy is dead or cut off from etcd, with its proxy's lease
/// (whose count etcd starts again when its leader changes). Twice each covers both
/// and the watch's delay; a waiter key nobody owns stays for ever.
fn free_while_waited(ttl: Duration, lease_ttl: Duration) -> u64 {
    ((ttl + lease_ttl) * 2).as_nanos() as u64
}

/// How a run starts its proxies: with the run's classes and the clock-rate bound.
struct ProxyShape {
    classes: std::path::PathBuf,
}

impl ProxyShape {
    fn new(dir: &Path) -> anyhow::Result<ProxyShape> {
        let classes = dir.join("classes.toml");
        std::fs::write(&classes, CLASSES)?;
        Ok(ProxyShape { classes })
    }

    /// How `proxy` starts again, on its address.
    fn again(&self, proxy: &ProxyProcess, etcd: Vec<String>) -> ProxyOptions {
        let mut options = self.of(&proxy.zone, etcd);
        options.listen = Some(proxy.addr.clone());
        options
    }

    fn of(&self, zone: &str, etcd: Vec<String>) -> ProxyOptions {
        let mut options = ProxyOptions::new(zone, etcd);
        if zone == "a" {
            // Every session of proxy a on one etcd lease: a restarted client's new
            // session shares its lease with the old one (see "restart-client").
            options.leases = 1;
        }
        options.extra_args = vec![
            "--classes".into(),
            self.classes.display().to_string(),
            "--clock-rate-bound".into(),
            format!("{}%", CLOCK_RATE_BOUND * 100.0),
        ];
        options
    }
}

/// How a run starts a client process.
struct ClientShape {
    /// The proxies' addresses, its own first.
    proxies: Vec<String>,
    locks: Vec<String>,
    ttl: Duration,
    seed: u64,
    /// How long it holds every lock (`None`: a random 50 to 300 ms).
    hold_for: Option<Duration>,
}

impl ClientShape {
    /// Starts client `c` with `env` added to its environment, its record at
    /// `client-{c}.jsonl` under `dir`.
    fn spawn(
        &self,
        dir: &Path,
        c: usize,
        fenced: &str,
        env: &[(String, String)],
    ) -> anyhow::Result<Managed> {
        let mut cmd = Command::new(bins::workspace_bin("lockcell-chaos-client")?);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--proxies")
            .arg(self.proxies.join(","))
            .arg("--locks")
            .arg(self.locks.join(","))
            .arg("--log")
            .arg(dir.join(format!("client-{c}.jsonl")))
            .arg("--fenced")
            .arg(fenced)
            .arg("--name")
            .arg(format!("client-{c}"))
            .arg("--ttl")
            .arg(format!("{}ms", self.ttl.as_millis()))
            .arg("--seed")
            .arg(self.seed.to_string());
        if let Some(hold) = self.hold_for {
            cmd.arg("--hold-for").arg(format!("{}ms", hold.as_millis()));
        }
        let log = dir.join(format!("client-{c}.log"));
        Managed::spawn(format!("client {c}"), cmd, &log)
    }
}

/// The watched range: from `/k/` to the end of `/q/` (small keys, holder keys, release
/// markers, waiter keys, and the run's mark between them).
const WATCHED: (&str, &str) = ("/k/", "/q0");

/// A key in the watched range no lockcell process uses: written at the end of a run to
/// know when its watch has caught up with the store.
const WATCH_MARK: &str = "/o~chaos-watch-mark";

/// What the run's watch has seen: the changes to holder and waiter keys, those to small
/// keys, and the highest revision of anything in the watched range.
#[derive(Default)]
struct Seen {
    events: Vec<StoreEvent>,
    kv: Vec<KvEvent>,
    revision: i64,
}

/// The run's watch on the store's holder and waiter keys, each change stamped with when
/// it arrived; it starts again where it stopped when its etcd member goes.
struct StoreWatch {
    seen: Arc<Mutex<Seen>>,
    /// The revision the watch started at.
    from: i64,
    task: tokio::task::JoinHandle<()>,
}

impl StoreWatch {
    async fn start(etcd: &EtcdCluster) -> anyhow::Result<StoreWatch> {
        // A client of its own: the cluster's shared one, made after the faults, must not
        // have seen members go (its channel can keep routing to a member that went).
        let root = etcd.credentials(lockcell_cell::rbac::ROOT_USER);
        let mut client = match &root {
            Some(root) => etcd.client_as(root).await?,
            None => etcd_client::Client::connect(etcd.endpoints(), None).await?,
        };
        let now = client.get(WATCH_MARK, None).await?;
        let from = now.header().map_or(1, |h| h.revision() + 1);
        let seen = Arc::new(Mutex::new(Seen::default()));
        let task = tokio::spawn(watch_store(client, from, seen.clone()));
        Ok(StoreWatch { seen, from, task })
    }

    /// Writes the run's mark and waits until the watch has seen it; returns its
    /// revision.
    async fn mark(&self, etcd: &EtcdCluster) -> anyhow::Result<i64> {
        let client = etcd.client().await?;
        let mark = eventually(
            "the run's watch mark is written",
            Duration::from_secs(15),
            || {
                let mut client = client.clone();
                async move {
                    Ok(match client.put(WATCH_MARK, "", None).await {
                        Ok(put) => Some(put.header().map_or(0, |h| h.revision())),
                        Err(e) => {
                            eprintln!("writing the watch mark: {e}");
                            None
                        }
                    })
                }
            },
        )
        .await?;
        eventually(
            "the run's watch catches up with the store",
            Duration::from_secs(15),
            || async { Ok((self.seen.lock().expect("seen").revision >= mark).then_some(())) },
        )
        .await?;
        Ok(mark)
    }

    /// The checker's verdict on `records` ([`checker::check`]) and on them against what
    /// the watch saw ([`checker::check_store`]), once it has caught up; and the history
    /// of the small keys it saw, for [`kvcheck::check`].
    async fn verdict(
        self,
        etcd: &EtcdCluster,
        records: &[checker::Record],
        ttl: Duration,
        lease_ttl: Duration,
    ) -> anyhow::Result<(Verdict, History)> {
        let mut verdict = checker::check(records);
        let from = self.from;
        let (events, kv, watched_until_ns) = self.finish(etcd).await?;
        let bounds = StoreBounds {
            free_while_waited_ns: free_while_waited(ttl, lease_ttl),
            watched_until_ns,
        };
        verdict
            .violations
            .extend(checker::check_store(records, &events, bounds));
        let history = History {
            cluster: String::new(),
            events: kv,
            from,
        };
        Ok((verdict, history))
    }

    /// The history of the small keys it saw (of the cell whose cluster id is
    /// `cluster`), once it has caught up.
    async fn history(self, etcd: &EtcdCluster, cluster: &str) -> anyhow::Result<History> {
        let from = self.from;
        let (_, events, _) = self.finish(etcd).await?;
        Ok(History {
            cluster: cluster.to_owned(),
            events,
            from,
        })
    }

    /// Waits until the watch has seen everything written so far, stops it, and returns
    /// what it saw and when it had caught up.
    async fn finish(
        self,
        etcd: &EtcdCluster,
    ) -> anyhow::Result<(Vec<StoreEvent>, Vec<KvEvent>, u64)> {
        let caught_up = self.mark(etcd).await;
        self.task.abort();
        caught_up?;
        let until = checker::now_ns();
        let mut seen = self.seen.lock().expect("seen");
        let events = std::mem::take(&mut seen.events);
        let kv = std::mem::take(&mut seen.kv);
        Ok((events, kv, until))
    }
}

/// Follows the watched range from revision `next` on, for ever.
async fn watch_store(mut client: etcd_client::Client, mut next: i64, seen: Arc<Mutex<Seen>>) {
    // Each live key's create revision, for deletes that come without the key before.
    let mut created: HashMap<String, i64> = HashMap::new();
    loop {
        let options = WatchOptions::new()
            .with_range(WATCHED.1)
            .with_prev_key()
            .with_start_revision(next);
        if let Ok(mut stream) = client.watch(WATCHED.0, Some(options)).await {
            while let Ok(Some(reply)) = stream.message().await {
                if reply.canceled() {
                    break;
                }
                let at_ns = checker::now_ns();
                let mut seen = seen.lock().expect("seen");
                for event in reply.events() {
                    let Some(kv) = event.kv() else {
                        continue;
                    };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    let revision = kv.mod_revision();
                    next = next.max(revision + 1);
                    seen.revision = seen.revision.max(revision);
                    let deleted = event.event_type() == EventType::Delete;
                    if let Some(name) = key.strip_prefix("/k/") {
                        seen.kv.push(KvEvent {
                            at_ns,
                            revision,
                            key: name.to_owned(),
                            value: (!deleted)
                                .then(|| String::from_utf8_lossy(kv.value()).into_owned()),
                        });
                        continue;
                    }
                    if !key.starts_with("/l/") && !key.starts_with("/q/") {
                        continue;
                    }
                    let create_revision = if deleted {
                        let before = event.prev_kv().map(|p| p.create_revision());
                        created.remove(&key).or(before).unwrap_or(0)
                    } else {
                        created.insert(key.clone(), kv.create_revision());
                        kv.create_revision()
                    };
                    seen.events.push(StoreEvent {
                        at_ns,
                        revision,
                        key,
                        create_revision,
                        deleted,
                    });
                }
            }
        }
        // Its member went away: the client tries another; pace the retries.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The holder keys under `/l/` (release markers aside), the waiter keys under `/q/` and
/// the clients' ephemeral membership keys in the store, each with its value.
async fn keys_left(etcd: &EtcdCluster) -> anyhow::Result<Vec<String>> {
    let mut client = etcd.client().await?;
    let mut left = Vec::new();
    for prefix in ["/l/", "/q/", "/k/chaos/members/"] {
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

/// The index of the member that leads now, once one does (an election may be under
/// way just after an earlier fault).
async fn leader_of(etcd: &EtcdCluster) -> anyhow::Result<usize> {
    eventually("an etcd member leads", Duration::from_secs(15), || async {
        for i in 0..etcd.members.len() {
            let Ok(mut client) = etcd.member_client(i).await else {
                continue;
            };
            let Ok(status) = client.status().await else {
                continue;
            };
            let me = status.header().map(|h| h.member_id());
            if me == Some(status.leader()) {
                return Ok(Some(i));
            }
        }
        Ok(None)
    })
    .await
}
