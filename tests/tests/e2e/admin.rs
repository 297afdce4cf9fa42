//! The admin endpoints of the proxy and of the audit tailer: alive, ready, metrics, drain.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_tests::proxy::http_call;
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess, Relay};

/// A gauge's value on a `/metrics` page.
fn gauge(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
}

pub async fn the_admin_endpoints_answer_and_readyz_goes_unready_when_etcd_is_cut_off(
) -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let link = Relay::start(&etcd.endpoints()[0]).await?;
    let mut proxy =
        ProxyProcess::start(&ProxyOptions::new("a", vec![link.addr.clone()]), &etcd.dir).await?;
    let admin = proxy.admin_addr.clone();

    let (status, _, body) = http_call(&admin, "GET", "/healthz").await?;
    ensure!(status == 200, "/healthz: {status} {body}");
    let ready = eventually("/readyz answers 200", Duration::from_secs(10), || async {
        let (status, _, body) = http_call(&admin, "GET", "/readyz").await?;
        Ok((status == 200).then_some(body))
    })
    .await?;
    ensure!(
        ready.contains("leases 4/4") && ready.contains("etcd reachable"),
        "/readyz does not say how the leases stand:\n{ready}"
    );
    // A session, its renewals and a grant, for the metrics to show.
    let client = lockcell_client::Client::connect(&proxy.url()).await?;
    let session = client
        .open_session(crate::support::short_session(Duration::from_secs(5)))
        .await?;
    let lock = session
        .acquire(
            "admin/x",
            lockcell_client::Wait::Timeout(Duration::from_secs(5)),
        )
        .await?
        .context("admin/x not granted")?;
    // A handover: a second session waits for admin/x and gets it on the release.
    let waiting = client
        .open_session(crate::support::short_session(Duration::from_secs(5)))
        .await?;
    let waiter = tokio::spawn(async move {
        let lock = waiting
            .acquire(
                "admin/x",
                lockcell_client::Wait::Timeout(Duration::from_secs(10)),
            )
            .await;
        (waiting, lock)
    });
    // Waiting for its turn (counted once it waits): the release is what wakes it.
    eventually(
        "the second session waits",
        Duration::from_secs(10),
        || async {
            let page = proxy.metrics().await?;
            Ok((gauge(&page, "lockcell_waiters") == Some(1.0)).then_some(()))
        },
    )
    .await?;
    lock.release().await?;
    let (waiting, handed) = waiter.await?;
    handed?
        .context("admin/x was not handed over")?
        .release()
        .await?;
    waiting.close().await?;
    let page = eventually(
        "the metrics show renewals",
        Duration::from_secs(10),
        || async {
            let page = proxy.metrics().await?;
            Ok(gauge(&page, "lockcell_validity_granted_seconds_count")
                .is_some_and(|n| n > 0.0)
                .then_some(page))
        },
    )
    .await?;
    ensure!(
        gauge(&page, "lockcell_etcd_reachable") == Some(1.0)
            && gauge(&page, "lockcell_etcd_lease_remaining_seconds").is_some_and(|s| s > 0.0)
            && gauge(&page, "lockcell_etcd_watches").is_some_and(|n| n >= 3.0)
            && gauge(&page, "lockcell_lock_handover_duration_seconds_count{queueing=\"arbitrated\"}") == Some(1.0)
            && page.contains("lockcell_etcd_request_duration_seconds_bucket{call=\"acquire txn\",outcome=\"ok\"")
            && page.contains("lockcell_etcd_request_duration_seconds_bucket{call=\"lease keepalive\",outcome=\"ok\""),
        "the metrics do not show a proxy that renews its leases, watches etcd and grants:\n{page}"
    );

    // etcd cut off: unready (and the gauges say why) once renewals are late; alive all along.
    link.cut(true);
    let unready = eventually("/readyz goes unready", Duration::from_secs(15), || async {
        let (status, _, body) = http_call(&admin, "GET", "/readyz").await?;
        Ok((status == 503).then_some(body))
    })
    .await?;
    ensure!(
        unready.contains("not renewing in time"),
        "/readyz does not say why it is unready:\n{unready}"
    );
    let page = proxy.metrics().await?;
    ensure!(
        gauge(&page, "lockcell_etcd_reachable") == Some(0.0),
        "lockcell_etcd_reachable is not 0 with etcd cut off:\n{page}"
    );
    let (status, _, _) = http_call(&admin, "GET", "/healthz").await?;
    ensure!(
        status == 200,
        "/healthz is not 200 while etcd is cut off: {status}"
    );

    // etcd back: ready again (new leases if the old ones ran out).
    link.cut(false);
    eventually(
        "/readyz is ready again",
        Duration::from_secs(20),
        || async {
            let (status, _, _) = http_call(&admin, "GET", "/readyz").await?;
            Ok((status == 200).then_some(()))
        },
    )
    .await?;

    // POST /drain: unready at once (while it waits for its session to move, which has
    // nowhere to go), then the proxy stops on its own.
    let _staying = client
        .open_session(crate::support::short_session(Duration::from_secs(5)))
        .await?;
    let (status, _, body) = http_call(&admin, "POST", "/drain").await?;
    ensure!(
        status == 202 && body.contains("draining"),
        "/drain: {status} {body}"
    );
    let (status, _, body) = http_call(&admin, "GET", "/readyz").await?;
    ensure!(
        status == 503 && body.contains("draining"),
        "/readyz is not unready while draining: {status} {body}"
    );
    // Cleanly, with the status that says a drain stopped it.
    let exit = proxy.process.wait_exit(Duration::from_secs(30)).await?;
    ensure!(
        exit.code() == Some(3),
        "the drained proxy did not stop with status 3: {exit}"
    );
    Ok(())
}

/// The audit tailer's admin endpoints: alive all along, ready only while etcd answers,
/// and POST /drain stops it as SIGTERM does (everything written, exit 0).
pub async fn the_audit_tailers_readyz_follows_etcd_and_drain_stops_it() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let link = Relay::start(&etcd.endpoints()[0]).await?;
    let data = etcd.dir.join("cell-data");
    let mut tailer = lockcell_tests::audit::AuditProcess::start(
        "run",
        &[link.url()],
        &data,
        &[],
        &etcd.dir.join("audit.log"),
    )
    .await?;
    let addr = tailer.addr.clone();
    let ready = eventually(
        "the tailer's /readyz answers 200",
        Duration::from_secs(15),
        || async {
            let (status, _, body) = http_call(&addr, "GET", "/readyz").await?;
            Ok((status == 200).then_some(body))
        },
    )
    .await?;
    ensure!(
        ready.contains("etcd answered") && ready.contains("checkpoint revision"),
        "/readyz does not say what it is ready on:\n{ready}"
    );

    link.cut(true);
    let unready = eventually(
        "the tailer's /readyz goes unready",
        Duration::from_secs(20),
        || async {
            let (status, _, body) = http_call(&addr, "GET", "/readyz").await?;
            Ok((status == 503).then_some(body))
        },
    )
    .await?;
    ensure!(
        unready.contains("etcd has not answered"),
        "/readyz does not say why it is unready:\n{unready}"
    );
    let (_, _, page) = http_call(&addr, "GET", "/metrics").await?;
    ensure!(
        gauge(&page, "lockcell_etcd_reachable") == Some(0.0),
        "lockcell_etcd_reachable is not 0 with etcd cut off:\n{page}"
    );
    let (status, _, _) = http_call(&addr, "GET", "/healthz").await?;
    ensure!(
        status == 200,
        "/healthz is not 200 while etcd is cut off: {status}"
    );

    link.cut(false);
    eventually(
        "the tailer's /readyz is ready again",
        Duration::from_secs(20),
        || async {
            let (status, _, _) = http_call(&addr, "GET", "/readyz").await?;
            Ok((status == 200).then_some(()))
        },
    )
    .await?;

    let (status, _, body) = http_call(&addr, "POST", "/drain").await?;
    ensure!(
        status == 202 && body.contains("draining"),
        "/drain: {status} {body}"
    );
    let exit = tailer.process.wait_exit(Duration::from_secs(30)).await?;
    ensure!(
        exit.success(),
        "the drained tailer did not stop cleanly: {exit}\n{}",
        tailer.process.log_tail(20)
    );
    Ok(())
}

/// Every counter the proxy names, from its source: `pub const X: &str = "…_total";`.
fn proxy_counters() -> Vec<&'static str> {
    include_str!("../../../proxy/src/metrics.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("pub const ")?.split_once(": &str = \""))
        .filter_map(|(_, rest)| rest.strip_suffix("\";"))
        .filter(|name| name.ends_with("_total"))
        .collect()
}

/// An alert on `increase(counter[…])` misses the counter's first event when the
/// counter appears with it: a proxy's first refused classes file raised nothing. Every
/// counter is on the page, at 0, before anything has happened.
pub async fn a_fresh_proxy_exports_every_counter_at_zero() -> anyhow::Result<()> {
    let counters = proxy_counters();
    ensure!(
        counters.len() >= 20 && counters.contains(&"lockcell_classes_reload_failures_total"),
        "the counters were not read from the proxy's source: {counters:?}"
    );
    let etcd = EtcdCluster::start(1).await?;
    let proxy = ProxyProcess::start(&ProxyOptions::new("a", etcd.endpoints()), &etcd.dir).await?;
    let page = proxy.metrics().await?;
    let missing: Vec<&str> = counters
        .iter()
        .copied()
        .filter(|name| {
            !page.lines().any(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
        })
        .collect();
    ensure!(
        missing.is_empty(),
        "a fresh proxy's /metrics lacks these counters: {missing:?}"
    );
    for name in [
        "lockcell_classes_reload_failures_total",
        "lockcell_grants_reload_failures_total",
        "lockcell_etcd_leases_lost_total",
        "lockcell_keys_lost_on_resume_total",
        "lockcell_tls_reload_failures_total",
    ] {
        ensure!(
            gauge(&page, name) == Some(0.0),
            "{name} is not 0 on a fresh proxy:\n{page}"
        );
    }
    Ok(())
}
