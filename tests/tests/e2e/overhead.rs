//! The proxy's own time on a call (`lockcell_proxy_overhead_seconds{call}`): every call
//! counted, and a call's wait for a holder left out of it.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use lockcell_client::{Client, Wait};
use lockcell_proto::v1::{AcquireRequest, OpenRequest, OpenResponse};
use lockcell_tests::{eventually, ProxyProcess};

use crate::support::{cell, raw, short_session};

/// The `_sum` and `_count` of the proxy's overhead histogram for `call`.
async fn overhead(proxy: &ProxyProcess, call: &str) -> anyhow::Result<(f64, f64)> {
    let page = proxy.metrics().await?;
    let series = |part: &str| {
        let prefix = format!("lockcell_proxy_overhead_seconds_{part}{{call=\"{call}\"}} ");
        page.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .map_or(Ok(0.0), |v| v.trim().parse::<f64>())
    };
    Ok((series("sum")?, series("count")?))
}

pub async fn a_wait_for_a_holder_is_not_the_proxys_own_time() -> anyhow::Result<()> {
    const WAIT: Duration = Duration::from_millis(1500);
    let (_etcd, proxies) = cell(&["a"]).await?;
    let proxy = &proxies[0];
    let client = Client::connect(&proxy.url()).await?;
    let holder = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let waiter = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let held = holder
        .acquire("overhead/x", Wait::Try)
        .await?
        .context("a free lock was not granted")?;
    let (sum_before, count_before) = overhead(proxy, "acquire").await?;
    ensure!(
        count_before >= 1.0,
        "the holder's acquire was not counted: {count_before}"
    );

    let started = Instant::now();
    let refused = waiter.acquire("overhead/x", Wait::Timeout(WAIT)).await?;
    let took = started.elapsed();
    ensure!(
        refused.is_none(),
        "a held lock was granted to a second session"
    );
    ensure!(
        took >= WAIT,
        "the wait ended after {took:?}, before its {WAIT:?}"
    );

    let (sum, count) = eventually(
        "the waiter's acquire is counted",
        Duration::from_secs(10),
        || async {
            let (sum, count) = overhead(proxy, "acquire").await?;
            Ok((count > count_before).then_some((sum, count)))
        },
    )
    .await?;
    ensure!(
        count == count_before + 1.0,
        "one acquire made {} observations",
        count - count_before
    );
    let own = sum - sum_before;
    ensure!(
        own >= 0.0 && own < WAIT.as_secs_f64() / 3.0,
        "the proxy's own time on an acquire that waited {took:?} was counted as {own} s: the wait was not left out"
    );

    ensure!(
        held.release().await?,
        "the holder's release deleted nothing"
    );
    let (_, releases) = overhead(proxy, "release").await?;
    ensure!(releases >= 1.0, "the release was not counted");
    Ok(())
}

/// A waiting call withdrawn from another connection (as a client that gave up does)
/// ends its wait by the withdrawal: neither it nor the withdrawal counts the wait as the
/// proxy's own time.
pub async fn a_withdrawn_wait_is_not_the_proxys_own_time() -> anyhow::Result<()> {
    // Half-way through a poll of the lock (once a second), so a wait dropped without
    // being counted would leave about half a second behind.
    const WAITED: Duration = Duration::from_millis(1500);
    let (_etcd, proxies) = cell(&["a"]).await?;
    let proxy = &proxies[0];
    let (mut sessions, mut locks) = raw(proxy).await?;
    let open = |identity: &str| OpenRequest {
        ttl_ms: 30_000,
        identity: identity.into(),
    };
    let holder = sessions.open(open("holder")).await?.into_inner();
    let waiter = sessions.open(open("waiter")).await?.into_inner();
    let request = |session: &OpenResponse, wait: u64, withdraw: bool| AcquireRequest {
        session_id: session.session_id.clone(),
        session_secret: session.session_secret.clone(),
        lock: "overhead/withdrawn".into(),
        wait_timeout_ms: Some(wait),
        mode: 0,
        call_id: "withdrawncall".into(),
        withdraw,
    };
    let held = locks
        .acquire(request(&holder, 0, false))
        .await?
        .into_inner();
    ensure!(held.granted, "a free lock was not granted");
    let (sum_before, count_before) = overhead(proxy, "acquire").await?;

    let started = Instant::now();
    let mut waiting_locks = locks.clone();
    let waiting_request = request(&waiter, 20_000, false);
    let wait = tokio::spawn(async move { waiting_locks.acquire(waiting_request).await });
    eventually(
        "the waiter has waited a second and a half",
        Duration::from_secs(10),
        || async {
            let waiting = proxy.metric("lockcell_waiters").await? >= 1.0;
            Ok((waiting && started.elapsed() >= WAITED).then_some(()))
        },
    )
    .await?;
    let (_, mut other_locks) = raw(proxy).await?;
    other_locks.acquire(request(&waiter, 0, true)).await?;
    let ended = wait.await??.into_inner();
    ensure!(!ended.granted, "a withdrawn call was granted");
    let waited = started.elapsed();

    let (sum, count) = eventually(
        "the waiting call and its withdrawal are counted",
        Duration::from_secs(10),
        || async {
            let (sum, count) = overhead(proxy, "acquire").await?;
            Ok((count >= count_before + 2.0).then_some((sum, count)))
        },
    )
    .await?;
    ensure!(
        count == count_before + 2.0,
        "two calls made {} observations",
        count - count_before
    );
    let own = sum - sum_before;
    ensure!(
        own >= 0.0 && own < WAITED.as_secs_f64() / 6.0,
        "the proxy's own time on a call that waited {waited:?} and its withdrawal was counted as {own} s: the wait was not left out"
    );
    Ok(())
}
