//! `noisy-neighbour`: the keepalive fleet, measured twice on fresh cells: alone, then
//! with one client misbehaving at full speed beside it, in zone a: a few tasks that
//! each open a session (an etcd lease) and write a 64 KiB key on it, in a loop, never
//! renewing. On lockcell the proxies check grants and the noisy identity has limits
//! (`cluster::NOISY_LIMITS`); on bare etcd and etcd's grpc-proxy nothing bounds it. The
//! report puts the fleet's keepalive round trips and false expiries of both runs side
//! by side, with what the noisy client got through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockcell_loadtest::report::Report;
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{OpenRequest, PutRequest};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::transport::Endpoint;

use super::keepalive;
use crate::cluster::{Cell, CellOptions, Target, NOISY_LIMITS, NOISY_TOKEN};
use crate::fleet::Bearer;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The fleet's sessions.
    #[arg(long, default_value_t = 20_000)]
    pub sessions: usize,
    /// Session TTL (the fleet's and the noisy client's).
    #[arg(long, default_value = "12s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// How long to measure each run, once every session is open.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Client connections the fleet's sessions are spread over.
    #[arg(long, default_value_t = 500)]
    pub connections: usize,
    #[command(flatten)]
    pub noise: NoiseArgs,
}

/// The noisy client.
#[derive(Debug, Clone, clap::Args)]
pub struct NoiseArgs {
    /// Concurrent loops of the noisy client.
    #[arg(long, default_value_t = 8)]
    pub noisy_tasks: usize,
    /// Bytes of each key it writes.
    #[arg(long, default_value_t = 64 * 1024)]
    pub noisy_value_bytes: usize,
}

pub async fn run(target: Target, cell: &CellOptions, args: &Args) -> anyhow::Result<Report> {
    let guarded = CellOptions {
        guarded: true,
        ..cell.clone()
    };
    let fleet = keepalive::Args {
        sessions: args.sessions,
        ttl: args.ttl,
        renewals_per_ttl: 3,
        duration: args.duration,
        connections: args.connections,
    };
    let mut report = Report::new("noisy-neighbour", target.name());
    report.param("sessions", args.sessions);
    report.param("ttl_s", args.ttl.as_secs_f64());
    report.param("duration_s", args.duration.as_secs_f64());
    report.param("connections", args.connections);
    report.param("noisy_tasks", args.noise.noisy_tasks);
    report.param("noisy_value_bytes", args.noise.noisy_value_bytes);
    if target == Target::Lockcell {
        report.param("noisy_limits", NOISY_LIMITS.replace('\n', ", "));
    }
    for (phase, noise) in [("alone", None), ("noisy", Some(&args.noise))] {
        let run = keepalive::measure(target, &guarded, &fleet, noise).await?;
        for metric in [
            "keepalive_p50_ms",
            "keepalive_p99_ms",
            "keepalive_max_ms",
            "keepalive_rate_vs_target",
            "false_expiries",
            "sessions_unanswered",
            "etcd_cpu_s",
            "proxy_cpu_s",
            "etcd_peak_rss_bytes",
            "proxy_peak_rss_bytes",
        ] {
            if let Some(value) = run.metrics.get(metric) {
                report.metric(&format!("{phase}_{metric}"), *value);
            }
        }
        for (metric, value) in run.metrics.iter().filter(|(k, _)| k.starts_with("noisy_")) {
            report.metric(metric, *value);
        }
        report
            .evidence
            .extend(run.evidence.into_iter().map(|e| format!("{phase}: {e}")));
    }
    Ok(report)
}

/// The noisy client, running until [`Noise::finish`].
pub struct Noise {
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    /// Keys written (each on a session of its own).
    written: AtomicU64,
    /// Calls refused at a limit (RESOURCE_EXHAUSTED).
    refused: AtomicU64,
    /// Calls that failed otherwise.
    failed: AtomicU64,
}

impl Noise {
    /// Starts the noisy client against zone a's endpoint of `cell`.
    pub async fn start(cell: &Cell, args: &NoiseArgs) -> anyhow::Result<Noise> {
        let endpoint = cell.zones[0].endpoint.clone();
        let (stop, _) = watch::channel(false);
        let counts = Arc::new(Counts::default());
        let mut tasks = JoinSet::new();
        let value = vec![b'n'; args.noisy_value_bytes];
        for task in 0..args.noisy_tasks {
            let (stop, counts, value) = (stop.subscribe(), counts.clone(), value.clone());
            match cell.target {
                Target::Lockcell => {
                    let channel = Endpoint::from_shared(format!("http://{endpoint}"))?
                        .tcp_nodelay(true)
                        .connect_lazy();
                    let bearer = match cell.guarded {
                        true => Bearer::token(NOISY_TOKEN)?,
                        false => Bearer::default(),
                    };
                    let conn = bearer.on(channel);
                    tasks.spawn(lockcell_loop(conn, task, value, stop, counts));
                }
                _ => {
                    let client = etcd_client::Client::connect([endpoint.as_str()], None).await?;
                    tasks.spawn(etcd_loop(client, task, value, stop, counts));
                }
            }
        }
        Ok(Noise {
            stop,
            tasks,
            counts,
        })
    }

    /// Stops it and reports what it got through.
    pub async fn finish(mut self, report: &mut Report) {
        self.stop.send_replace(true);
        while self.tasks.join_next().await.is_some() {}
        let c = &self.counts;
        report.metric(
            "noisy_keys_written",
            c.written.load(Ordering::Relaxed) as f64,
        );
        report.metric(
            "noisy_calls_refused",
            c.refused.load(Ordering::Relaxed) as f64,
        );
        report.metric(
            "noisy_calls_failed",
            c.failed.load(Ordering::Relaxed) as f64,
        );
    }
}

impl Counts {
    fn count<T>(&self, result: &Result<T, tonic::Status>) {
        match result {
            Ok(_) => {}
            Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Opens a session and writes one ephemeral key on it, again and again.
async fn lockcell_loop(
    conn: crate::fleet::Conn,
    task: usize,
    value: Vec<u8>,
    stop: watch::Receiver<bool>,
    counts: Arc<Counts>,
) {
    let mut sessions = SessionClient::new(conn.clone());
    let mut kv = KvClient::new(conn);
    for i in 0u64.. {
        if *stop.borrow() {
            return;
        }
        let opened = sessions
            .open(OpenRequest {
                ttl_ms: 12_000,
                identity: "noisy".into(),
            })
            .await;
        counts.count(&opened);
        let Ok(opened) = opened.map(tonic::Response::into_inner) else {
            continue;
        };
        let put = kv
            .put(PutRequest {
                key: format!("noise/{task}/{i}"),
                value: value.clone(),
                session_id: opened.session_id,
                session_secret: opened.session_secret,
                ..Default::default()
            })
            .await;
        counts.count(&put);
        if put.is_ok() {
            counts.written.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Grants a lease and writes one key on it, again and again.
async fn etcd_loop(
    client: etcd_client::Client,
    task: usize,
    value: Vec<u8>,
    stop: watch::Receiver<bool>,
    counts: Arc<Counts>,
) {
    let (mut leases, mut kv) = (client.lease_client(), client.kv_client());
    for i in 0u64.. {
        if *stop.borrow() {
            return;
        }
        let lease = match leases.grant(12, None).await {
            Ok(lease) => lease.id(),
            Err(e) => {
                counts.count::<()>(&Err(status_of(e)));
                continue;
            }
        };
        let options = etcd_client::PutOptions::new().with_lease(lease);
        match kv
            .put(format!("noise/{task}/{i}"), value.clone(), Some(options))
            .await
        {
            Ok(_) => {
                counts.written.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => counts.count::<()>(&Err(status_of(e))),
        }
    }
}

fn status_of(error: etcd_client::Error) -> tonic::Status {
    match error {
        etcd_client::Error::GRpcStatus(status) => status,
        other => tonic::Status::unknown(other.to_string()),
    }
}
