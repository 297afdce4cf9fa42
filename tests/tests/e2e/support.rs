//! Shared pieces of the end-to-end tests.

use std::future::Future;
use std::time::Duration;

use anyhow::Context;
use libtest_mimic::Trial;
use lockcell_proto::v1::lock_client::LockClient;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{KeepAliveRequest, KeepAliveResponse};
use lockcell_tests::{EtcdCluster, ProxyOptions, ProxyProcess};
use tonic::transport::Channel;

/// A test as a trial with its own tokio runtime; an error fails it with its causes.
pub fn trial<F, Fut>(name: &str, test: F) -> Trial
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>>,
{
    Trial::test(name, move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime
            .block_on(test())
            .map_err(|e| format!("{e:#}").into())
    })
}

/// A one-member etcd and `zones` proxies on it, with short TTLs.
pub async fn cell(zones: &[&str]) -> anyhow::Result<(EtcdCluster, Vec<ProxyProcess>)> {
    let etcd = EtcdCluster::start(1).await?;
    let mut proxies = Vec::new();
    for zone in zones {
        let options = ProxyOptions::new(zone, etcd.endpoints());
        proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    }
    Ok((etcd, proxies))
}

/// One renewal of session `id` on a fresh keepalive stream, and its reply.
pub async fn renew_once(
    sessions: &mut SessionClient<Channel>,
    id: &str,
    secret: &str,
) -> anyhow::Result<KeepAliveResponse> {
    sessions
        .keep_alive(tokio_stream::iter([KeepAliveRequest {
            session_id: id.to_owned(),
            session_secret: secret.to_owned(),
            seq: 1,
        }]))
        .await?
        .into_inner()
        .message()
        .await?
        .context("no keepalive reply")
}

/// Raw protocol clients, for tests that must behave unlike the SDK (stop renewing,
/// send bad input).
pub async fn raw(
    proxy: &ProxyProcess,
) -> anyhow::Result<(SessionClient<Channel>, LockClient<Channel>)> {
    let channel = Channel::from_shared(proxy.url())?.connect().await?;
    Ok((
        SessionClient::new(channel.clone()),
        LockClient::new(channel),
    ))
}

/// Session options for tests: a short TTL.
pub fn short_session(ttl: Duration) -> lockcell_client::SessionOptions {
    lockcell_client::SessionOptions {
        ttl,
        identity: "e2e".to_owned(),
    }
}

/// Number of leases etcd holds now.
pub async fn lease_count(etcd: &EtcdCluster) -> anyhow::Result<usize> {
    Ok(etcd.client().await?.leases().await?.leases().len())
}

/// Transactions etcd has handled, from its own /metrics (summed over members).
pub async fn etcd_txns(etcd: &EtcdCluster) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for endpoint in etcd.endpoints() {
        let page = lockcell_tests::proxy::http_get(&endpoint, "/metrics").await?;
        total += page
            .lines()
            .filter(|l| {
                l.starts_with("grpc_server_handled_total{") && l.contains("grpc_method=\"Txn\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    Ok(total)
}

/// A session that holds `lock` and never renews (the raw protocol, TTL 1 s): its grant
/// expires. Returns the session client it used, its session id and the grant's token.
pub async fn silent_holder(
    proxy: &ProxyProcess,
    lock: &str,
) -> anyhow::Result<(
    SessionClient<Channel>,
    lockcell_proto::v1::OpenResponse,
    lockcell_proto::FencingToken,
)> {
    use anyhow::Context as _;
    use lockcell_proto::v1::{AcquireRequest, OpenRequest};
    let (mut sessions, mut locks) = raw(proxy).await?;
    let holder = sessions
        .open(OpenRequest {
            ttl_ms: 1_000,
            identity: "silent holder".into(),
        })
        .await?
        .into_inner();
    let grant = locks
        .acquire(AcquireRequest {
            session_id: holder.session_id.clone(),
            session_secret: holder.session_secret.clone(),
            lock: lock.into(),
            wait_timeout_ms: Some(0),
            ..Default::default()
        })
        .await?
        .into_inner();
    anyhow::ensure!(
        grant.granted,
        "the silent holder was not granted the free lock {lock}"
    );
    let token = grant.token.context("grant without token")?.into();
    Ok((sessions, holder, token))
}
