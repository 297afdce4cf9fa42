//! The system under test: a three-zone etcd cluster and, per zone, what clients of the
//! target connect to (a lockcell proxy, an etcd grpc-proxy, or the zone's etcd member).

use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use lockcell_loadtest::procstat::ProcTracker;
use lockcell_loadtest::prom::{self, Counters};
use lockcell_tests::etcd::EtcdOptions;
use lockcell_tests::ports::free_port;
use lockcell_tests::process::Managed;
use lockcell_tests::proxy::http_get;
use lockcell_tests::{bins, eventually, EtcdCluster, ProxyOptions, ProxyProcess};
use nix::sys::signal::Signal;
use tokio::time::Instant;

/// How long a restarted proxy may take to reach etcd, get its leases and serve.
const PROXY_START_TIMEOUT: Duration = Duration::from_secs(30);

/// What the clients talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// lockcell proxies, one per zone, multiplexing sessions onto a few leases.
    Lockcell,
    /// Bare etcd: one lease per client session, the txn lock recipe, direct watches.
    Etcd,
    /// The bare-etcd client through `etcd grpc-proxy`, one per zone.
    EtcdGrpcProxy,
    /// The bare-etcd client, unchanged, through the lockcell proxies' etcd API
    /// (`--etcd-listen`): its leases become sessions of the proxies.
    LockcellEtcdApi,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Lockcell => "lockcell",
            Target::Etcd => "etcd",
            Target::EtcdGrpcProxy => "etcd-grpc-proxy",
            Target::LockcellEtcdApi => "lockcell-etcd-api",
        }
    }

    /// True when clients speak lockcell.v1 rather than etcd's API.
    pub fn is_lockcell(self) -> bool {
        self == Target::Lockcell
    }
}

/// How to start the cell.
#[derive(Debug, Clone)]
pub struct CellOptions {
    /// Use this running etcd cluster (one endpoint per zone) instead of starting one.
    pub endpoints: Option<Vec<String>>,
    /// TTL of the lockcell proxies' etcd leases (the sessions' TTL in the scenarios).
    pub lease_ttl: Duration,
    /// The lockcell proxies' `--drain-timeout` (the test harness's default when unset).
    pub drain_timeout: Option<Duration>,
    /// The lockcell proxies check prefix grants ([`GRANTS`]): the fleet calls as
    /// [`FLEET_TOKEN`]'s identity, a noisy client as [`NOISY_TOKEN`]'s, with limits.
    pub guarded: bool,
}

/// The fleet's bearer token on a guarded cell.
pub const FLEET_TOKEN: &str = "fleet-token-0123456789abcdef0123456789";
/// The noisy neighbour's bearer token on a guarded cell.
pub const NOISY_TOKEN: &str = "noisy-token-0123456789abcdef0123456789";
/// What the noisy identity may have on each proxy of a guarded cell.
pub const NOISY_LIMITS: &str =
    "sessions = 2000\nkeys = 2000\nwatches = 1000\nwaiting = 100\nrequests_per_second = 500";

/// A guarded cell's grants file: every identified caller may do anything; `noisy`
/// has [`NOISY_LIMITS`], the fleet the defaults.
fn grants_file() -> String {
    use lockcell_tests::certs::token_sha256;
    format!(
        "[[grant]]\nidentity = \"*\"\nlock = [\"\"]\nread = [\"\"]\nwrite = [\"\"]\nwatch = [\"\"]\n\n\
         [[limit]]\nidentity = \"noisy\"\n{NOISY_LIMITS}\n\n\
         [[token]]\nidentity = \"fleet\"\nsha256 = \"{}\"\n\n\
         [[token]]\nidentity = \"noisy\"\nsha256 = \"{}\"\n",
        token_sha256(FLEET_TOKEN),
        token_sha256(NOISY_TOKEN)
    )
}

/// One zone's way in for clients.
pub struct Zone {
    /// What this zone's clients connect to (`127.0.0.1:PORT`).
    pub endpoint: String,
    proxy: Option<ProxyProcess>,
    /// How the lockcell proxy was started, so a restart starts it the same way.
    proxy_options: Option<ProxyOptions>,
    grpc_proxy: Option<Managed>,
}

/// A running cell; dropping it stops everything it started.
pub struct Cell {
    pub target: Target,
    /// Member client addresses, zone by zone.
    pub etcd_endpoints: Vec<String>,
    pub zones: Vec<Zone>,
    /// Whether the proxies check grants (see [`CellOptions::guarded`]).
    pub guarded: bool,
    etcd: Option<EtcdCluster>,
    /// Data and logs of what the cell started; removed with the cell.
    dir: tempfile::TempDir,
}

/// How long one proxy's restart took.
#[derive(Debug, Clone, Copy)]
pub struct Restart {
    /// From SIGTERM until the old process exited (its drain and shutdown).
    pub exited: Duration,
    /// From SIGTERM until the new process answered `/readyz` with 200.
    pub healthy: Duration,
    /// The old process did not exit by itself within the deadline and was killed.
    pub killed: bool,
}

impl Cell {
    pub async fn start(target: Target, options: &CellOptions) -> anyhow::Result<Cell> {
        let dir = tempfile::Builder::new()
            .prefix("lockcell-loadtest-")
            .tempdir()?;
        let (etcd, endpoints) = match &options.endpoints {
            Some(endpoints) => (None, endpoints.clone()),
            None => {
                // Authentication off, as in the runs these figures are compared with.
                let etcd =
                    EtcdCluster::start_in_with(dir.path(), 3, &EtcdOptions::without_auth()).await?;
                let endpoints = etcd.endpoints();
                (Some(etcd), endpoints)
            }
        };
        let guarded = options.guarded && matches!(target, Target::Lockcell);
        let grants = dir.path().join("grants.toml");
        if guarded {
            std::fs::write(&grants, grants_file())?;
        }
        let mut zones = Vec::new();
        for (i, member) in endpoints.iter().enumerate() {
            let name = ((b'a' + i as u8) as char).to_string();
            let zone = match target {
                Target::Etcd => Zone {
                    endpoint: member.clone(),
                    proxy: None,
                    proxy_options: None,
                    grpc_proxy: None,
                },
                Target::Lockcell | Target::LockcellEtcdApi => {
                    let mut opts = ProxyOptions::new(&name, endpoints.clone());
                    opts.etcd_auth = None;
                    opts.lease_ttl = options.lease_ttl;
                    opts.extra_args = vec!["--session-ttl-max".into(), "600s".into()];
                    if guarded {
                        opts.extra_args.extend([
                            "--grants".into(),
                            grants.display().to_string(),
                            "--grants-without-tls".into(),
                        ]);
                    }
                    // The etcd API's address, the same across restarts.
                    let etcd_api = format!("127.0.0.1:{}", free_port());
                    if target == Target::LockcellEtcdApi {
                        opts.extra_args
                            .extend(["--etcd-listen".into(), etcd_api.clone()]);
                    }
                    if let Some(timeout) = options.drain_timeout {
                        opts.drain_timeout = timeout;
                    }
                    let proxy = ProxyProcess::start(&opts, dir.path()).await?;
                    // A restart takes the same address, so clients find it again.
                    opts.listen = Some(proxy.addr.clone());
                    Zone {
                        endpoint: if target == Target::Lockcell {
                            proxy.addr.clone()
                        } else {
                            etcd_api
                        },
                        proxy: Some(proxy),
                        proxy_options: Some(opts),
                        grpc_proxy: None,
                    }
                }
                Target::EtcdGrpcProxy => {
                    let (process, endpoint) =
                        start_grpc_proxy(&name, &endpoints, dir.path()).await?;
                    Zone {
                        endpoint,
                        proxy: None,
                        proxy_options: None,
                        grpc_proxy: Some(process),
                    }
                }
            };
            zones.push(zone);
        }
        Ok(Cell {
            target,
            etcd_endpoints: endpoints,
            zones,
            guarded,
            etcd,
            dir,
        })
    }

    /// What the fleet's calls carry: its bearer token on a guarded cell.
    pub fn bearer(&self) -> crate::fleet::Bearer {
        match self.guarded {
            true => crate::fleet::Bearer::token(FLEET_TOKEN).expect("a valid token"),
            false => crate::fleet::Bearer::default(),
        }
    }

    /// Zone `zone`'s lockcell proxy, if the target has one.
    pub fn proxy(&self, zone: usize) -> Option<&ProxyProcess> {
        self.zones[zone].proxy.as_ref()
    }

    /// Restarts zone `zone`'s lockcell proxy as an operator would: SIGTERM (the proxy
    /// drains: its clients move elsewhere), wait up to `exit_within` for it to exit (then
    /// SIGKILL), start it again on the same address, and wait until its `/readyz`
    /// answers 200.
    pub async fn restart_proxy(
        &mut self,
        zone: usize,
        exit_within: Duration,
    ) -> anyhow::Result<Restart> {
        let z = &mut self.zones[zone];
        let (Some(proxy), Some(options)) = (z.proxy.as_mut(), z.proxy_options.as_ref()) else {
            bail!("zone {zone} has no lockcell proxy to restart");
        };
        let signalled = Instant::now();
        proxy.signal(Signal::SIGTERM)?;
        let killed = match proxy.process.wait_exit(exit_within).await {
            Ok(status) => {
                if !status.success() {
                    tracing::warn!(zone = %proxy.zone, %status, "a draining proxy exited with an error");
                }
                false
            }
            Err(e) => {
                tracing::warn!(zone = %proxy.zone, error = %e, "proxy did not exit after SIGTERM; killing it");
                proxy.process.kill();
                true
            }
        };
        let exited = signalled.elapsed();
        let started = ProxyProcess::spawn(options, self.dir.path())?;
        let admin = started.admin_addr.clone();
        *proxy = started;
        eventually(
            "the restarted proxy answers /readyz",
            PROXY_START_TIMEOUT,
            || {
                let admin = admin.clone();
                async move { Ok(http_get(&admin, "/readyz").await.ok().map(|_| ())) }
            },
        )
        .await
        .with_context(|| format!("log:\n{}", proxy.process.log_tail(20)))?;
        Ok(Restart {
            exited,
            healthy: signalled.elapsed(),
            killed,
        })
    }

    /// Kills zone `zone`'s proxy with SIGKILL (bare etcd has none: its clients just stop).
    pub fn kill_zone(&mut self, zone: usize) -> anyhow::Result<()> {
        let z = &mut self.zones[zone];
        if let Some(proxy) = &z.proxy {
            proxy.signal(Signal::SIGKILL)?;
        }
        if let Some(process) = &z.grpc_proxy {
            process.signal(Signal::SIGKILL)?;
        }
        Ok(())
    }

    /// etcd's own request counters, summed over members, and the proposals one member
    /// committed (every member commits every proposal, so one member counts each once).
    pub async fn etcd_counters(&self) -> anyhow::Result<Counters> {
        let mut total = Counters::default();
        for (i, member) in self.etcd_endpoints.iter().enumerate() {
            let page = http_get(member, "/metrics")
                .await
                .with_context(|| format!("etcd /metrics at {member}"))?;
            let mut counters = prom::etcd_counters(&page);
            if i > 0 {
                counters.0.remove("proposals_committed");
                counters.0.remove("proposals_applied");
            }
            total.add(&counters);
        }
        Ok(total)
    }

    /// Each zone's lockcell proxy's metrics, zone by zone: `None` for a zone without
    /// one (the other targets) or whose proxy does not answer (killed).
    pub async fn proxy_samples(&self) -> Vec<Option<Vec<prom::Sample>>> {
        let mut out = Vec::with_capacity(self.zones.len());
        for zone in &self.zones {
            let page = match &zone.proxy {
                Some(proxy) => tokio::time::timeout(Duration::from_secs(5), proxy.metrics())
                    .await
                    .ok()
                    .and_then(Result::ok),
                None => None,
            };
            out.push(page.map(|page| prom::parse(&page)));
        }
        out
    }

    /// Trackers for the CPU and memory of every process the cell started, by kind.
    pub fn trackers(&self) -> Vec<(&'static str, ProcTracker)> {
        let mut out = Vec::new();
        if let Some(etcd) = &self.etcd {
            for m in &etcd.members {
                if let Some(pid) = m.process.pid() {
                    out.push(("etcd", ProcTracker::start(pid)));
                }
            }
        }
        for z in &self.zones {
            let pid = z
                .proxy
                .as_ref()
                .and_then(|p| p.process.pid())
                .or(z.grpc_proxy.as_ref().and_then(|p| p.pid()));
            if let Some(pid) = pid {
                out.push(("proxy", ProcTracker::start(pid)));
            }
        }
        out
    }
}

async fn start_grpc_proxy(
    zone: &str,
    endpoints: &[String],
    dir: &std::path::Path,
) -> anyhow::Result<(Managed, String)> {
    let etcd = bins::on_path("etcd").context("no etcd on PATH")?;
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = Command::new(etcd);
    cmd.arg("grpc-proxy")
        .arg("start")
        .arg(format!("--endpoints={}", endpoints.join(",")))
        .arg(format!("--listen-addr={addr}"));
    let log = dir.join(format!("grpc-proxy-{zone}.log"));
    let mut process = Managed::spawn(format!("grpc-proxy {zone}"), cmd, &log)?;
    eventually("etcd grpc-proxy listens", Duration::from_secs(20), || {
        let running = process.is_running();
        let addr = addr.clone();
        let tail = process.log_tail(10);
        async move {
            if !running {
                bail!("grpc-proxy exited:\n{tail}");
            }
            Ok(tokio::net::TcpStream::connect(&addr).await.ok().map(|_| ()))
        }
    })
    .await?;
    Ok((process, addr))
}
