//! The proxy's own time on a call (`lockcell_proxy_overhead_seconds{call}`): every call
//! counted, and a call's wait for a holder left out of it.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use lockcell_client::{Client, Wait};
use lockcell_tests::{eventually, ProxyProcess};

use crate::support::{cell, short_session};

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
