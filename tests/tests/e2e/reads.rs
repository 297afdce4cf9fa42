//! Reads are never stale: a linearizable read through any proxy sees every write that
//! finished before it was issued, whichever proxy took the write. A serializable read
//! may be stale, and this test shows it is, so the first half tests something.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::{GetRequest, KeyValue, PutRequest};
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess, Relay};
use rand::Rng;
use tonic::transport::Channel;

const TASKS: usize = 8;
const ROUNDS: usize = 40;

async fn kv(proxy: &ProxyProcess) -> anyhow::Result<KvClient<Channel>> {
    Ok(KvClient::new(
        Channel::from_shared(proxy.url())?.connect().await?,
    ))
}

async fn read(
    kv: &KvClient<Channel>,
    key: &str,
    serializable: bool,
) -> Result<Option<KeyValue>, tonic::Status> {
    let mut request = tonic::Request::new(GetRequest {
        key: key.to_owned(),
        serializable,
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(10));
    Ok(kv
        .clone()
        .get(request)
        .await?
        .into_inner()
        .kvs
        .into_iter()
        .next())
}

async fn put(kv: &KvClient<Channel>, key: &str, value: &str) -> anyhow::Result<i64> {
    Ok(kv
        .clone()
        .put(PutRequest {
            key: key.to_owned(),
            value: value.as_bytes().to_vec(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .revision)
}

pub async fn a_linearizable_read_through_any_proxy_sees_every_finished_write() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start(3).await?;
    // Proxy c reaches etcd through a relay the test can freeze.
    let relay = Relay::start(&etcd.endpoints()[0]).await?;
    let mut proxies = Vec::new();
    for zone in ["a", "b"] {
        let options = ProxyOptions::new(zone, etcd.endpoints());
        proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    }
    let options = ProxyOptions::new("c", vec![relay.addr.clone()]);
    proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    let mut clients = Vec::new();
    for p in &proxies {
        clients.push(kv(p).await?);
    }
    let clients = Arc::new(clients);

    // Many interleavings: each task writes its own key through a random proxy, then
    // reads it back through another random proxy, linearizably and serializably.
    let stale_serializable = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let (clients, stale_serializable) = (clients.clone(), stale_serializable.clone());
        tasks.spawn(async move {
            let key = format!("r/{t}");
            for round in 0..ROUNDS {
                let (w, r, s) = {
                    let mut rng = rand::rng();
                    (
                        rng.random_range(0..3),
                        rng.random_range(0..3),
                        rng.random_range(0..3),
                    )
                };
                let value = format!("{round}");
                let written = put(&clients[w], &key, &value).await?;
                let seen = read(&clients[r], &key, false)
                    .await?
                    .with_context(|| format!("{key} missing through proxy {r}"))?;
                ensure!(
                    seen.mod_revision >= written && seen.value == value.as_bytes(),
                    "stale linearizable read of {key} through proxy {r} after a write through {w}: \
                     revision {} value {:?}, written at {written} with {value:?}",
                    seen.mod_revision,
                    String::from_utf8_lossy(&seen.value)
                );
                let maybe = read(&clients[s], &key, true).await?;
                if maybe.is_none_or(|kv| kv.mod_revision < written) {
                    stale_serializable.fetch_add(1, Ordering::Relaxed);
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let stale = stale_serializable.load(Ordering::Relaxed);
    println!(
        "{} linearizable reads, none stale; {stale} of {} serializable reads stale",
        TASKS * ROUNDS,
        TASKS * ROUNDS
    );

    // Proxy c cut off from etcd: its serializable read answers from what it last saw
    // (stale), its linearizable read refuses rather than answer stale.
    let key = "r/frozen";
    put(&clients[0], key, "old").await?;
    eventually(
        "proxy c has seen the old value",
        Duration::from_secs(10),
        || async {
            Ok(read(&clients[2], key, true)
                .await?
                .is_some_and(|kv| kv.value == b"old")
                .then_some(()))
        },
    )
    .await?;
    relay.cut_replies(true);
    let written = put(&clients[0], key, "new").await?;
    let serializable = read(&clients[2], key, true)
        .await?
        .context("the old value")?;
    ensure!(
        serializable.value == b"old" && serializable.mod_revision < written,
        "a serializable read through the cut-off proxy may be stale, and is: {serializable:?}"
    );
    match read(&clients[2], key, false).await {
        Ok(kv) => {
            let kv = kv.context("the key")?;
            ensure!(kv.value == b"new", "a linearizable read was stale: {kv:?}");
        }
        Err(status) => ensure!(
            status.code() == tonic::Code::Unavailable,
            "a cut-off proxy refuses a linearizable read as unavailable: {status:?}"
        ),
    }
    relay.cut_replies(false);
    eventually(
        "proxy c reads the new value once etcd answers again",
        Duration::from_secs(30),
        || async {
            Ok(read(&clients[2], key, false)
                .await
                .ok()
                .flatten()
                .is_some_and(|kv| kv.value == b"new")
                .then_some(()))
        },
    )
    .await?;
    let barriers = proxies[0].metric("lockcell_read_barriers_total").await?;
    let served = proxies[0]
        .metrics()
        .await?
        .lines()
        .filter(|l| l.starts_with("lockcell_kv_reads_total{path=\"barrier\"}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    ensure!(
        served > 0.0 && barriers > 0.0,
        "proxy a served linearizable reads from its mirror behind barriers ({served} reads, {barriers} barriers)"
    );
    Ok(())
}
