//! `reads`: linearizable reads of small configuration keys by C concurrent clients.
//! lockcell serves them through its read barrier (one linearizable etcd request per
//! batch of reads, answered from the proxy's mirror); bare etcd and the grpc-proxy
//! answer each with a linearizable range request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lockcell_loadtest::pacing;
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::{ms, Samples};
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::{GetRequest, PutRequest};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use super::Resources;
use crate::cluster::{Cell, CellOptions, Target};
use crate::progress;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Concurrent readers, each on its own connection.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Configuration keys read (each 4 KiB, as in the design's state estimate).
    #[arg(long, default_value_t = 1_000)]
    pub keys: usize,
    /// How long to measure.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
}

const VALUE_BYTES: usize = 4 * 1024;

/// One reader's way to read a key linearizably.
enum Reader {
    Lockcell(KvClient<Channel>),
    Etcd(Box<etcd_client::KvClient>),
}

impl Reader {
    async fn connect(cell: &Cell, zone: usize) -> anyhow::Result<Reader> {
        let endpoint = &cell.zones[zone].endpoint;
        Ok(match cell.target {
            Target::Lockcell => {
                let channel = Endpoint::from_shared(format!("http://{endpoint}"))?
                    .tcp_nodelay(true)
                    .connect()
                    .await
                    .with_context(|| format!("connecting to proxy {endpoint}"))?;
                Reader::Lockcell(KvClient::new(channel))
            }
            _ => {
                let client = etcd_client::Client::connect([endpoint], None).await?;
                Reader::Etcd(Box::new(client.kv_client()))
            }
        })
    }

    async fn put(&mut self, key: &str, value: Vec<u8>) -> anyhow::Result<()> {
        match self {
            Reader::Lockcell(kv) => {
                kv.put(PutRequest {
                    key: key.to_owned(),
                    value,
                    ..Default::default()
                })
                .await?;
            }
            Reader::Etcd(kv) => {
                kv.put(format!("/k/{key}"), value, None).await?;
            }
        }
        Ok(())
    }

    /// Reads `key` linearizably; returns the size of the value found.
    async fn get(&mut self, key: &str) -> anyhow::Result<usize> {
        let len = match self {
            Reader::Lockcell(kv) => kv
                .get(GetRequest {
                    key: key.to_owned(),
                    ..Default::default()
                })
                .await?
                .into_inner()
                .kvs
                .first()
                .map(|kv| kv.value.len()),
            Reader::Etcd(kv) => kv
                .get(format!("/k/{key}"), None)
                .await?
                .kvs()
                .first()
                .map(|kv| kv.value().len()),
        };
        len.with_context(|| format!("configuration key {key} is missing"))
    }
}

fn key(i: usize) -> String {
    format!("config/svc-{}/routes", i)
}

pub async fn run(
    target: Target,
    cell_options: &CellOptions,
    args: &Args,
) -> anyhow::Result<Report> {
    let cell = Cell::start(target, cell_options).await?;
    let clients = args.clients.max(1);
    let keys = args.keys.max(1);
    let mut report = Report::new("reads", target.name());
    report.param("clients", clients);
    report.param("keys", keys);
    report.param("value_bytes", VALUE_BYTES);
    report.param("duration_s", args.duration.as_secs_f64());

    let mut writer = Reader::connect(&cell, 0).await?;
    let bar = progress::count("writing configuration keys", keys as u64);
    for i in 0..keys {
        writer.put(&key(i), vec![b'r'; VALUE_BYTES]).await?;
        bar.inc(1);
    }
    bar.finish_and_clear();

    let mut readers = Vec::new();
    for c in 0..clients {
        readers.push(Reader::connect(&cell, c % cell.zones.len()).await?);
    }
    let before = cell.etcd_counters().await?;
    let done = Arc::new(AtomicU64::new(0));
    let mut resources = Resources::start(&cell);
    let start = Instant::now();
    let end = start + args.duration;
    let mut tasks = JoinSet::new();
    for (c, mut reader) in readers.into_iter().enumerate() {
        let done = done.clone();
        tasks.spawn(async move {
            let mut latency = Samples::new();
            let mut i = c;
            while Instant::now() < end {
                let t0 = Instant::now();
                let len = reader.get(&key(i % keys)).await?;
                anyhow::ensure!(len == VALUE_BYTES, "key {} has {len} bytes", key(i % keys));
                latency.record(t0.elapsed());
                done.fetch_add(1, Ordering::Relaxed);
                i += clients;
            }
            anyhow::Ok(latency)
        });
    }
    let bar = progress::timed(&format!("reads {}", target.name()), args.duration);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() < end {
        tick.tick().await;
        resources.sample();
        bar.set_position(start.elapsed().as_secs());
        bar.set_message(format!("{} reads", done.load(Ordering::Relaxed)));
    }
    let mut latency = Samples::new();
    while let Some(result) = tasks.join_next().await {
        latency.merge(&result??);
    }
    let elapsed = start.elapsed();
    bar.finish_and_clear();
    let delta = cell.etcd_counters().await?.delta(&before);

    let reads = latency.len() as u64;
    report.metric("reads", reads as f64);
    report.metric("reads_per_s", pacing::rate(reads, elapsed));
    if let Some(p) = latency.percentile(50.0) {
        report.metric("read_p50_ms", ms(p));
    }
    if let Some(p) = latency.percentile(99.0) {
        report.metric("read_p99_ms", ms(p));
    }
    let ranges = delta.get("ranges");
    if reads > 0 {
        report.metric("etcd_ranges_per_read", ranges / reads as f64);
    }
    resources.finish(&mut report, 0);
    Ok(report)
}
