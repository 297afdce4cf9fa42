//! Sessions are multiplexed onto K proxy leases and renewed without touching etcd.

use std::time::Duration;

use anyhow::ensure;
use lockcell_client::{Client, SessionState};
use lockcell_tests::eventually;

use crate::support::{cell, lease_count, short_session};

const SESSIONS: usize = 1_000;
const K: usize = 4;

pub async fn thousand_sessions_use_k_leases_and_write_nothing() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let proxy = &proxies[0];
    let client = Client::connect(&proxy.url()).await?;
    let ttl = Duration::from_secs(2);
    let mut sessions = Vec::with_capacity(SESSIONS);
    for _ in 0..SESSIONS {
        sessions.push(client.open_session(short_session(ttl)).await?);
    }
    ensure!(proxy.metric("lockcell_sessions_open").await? == SESSIONS as f64);

    let leases = lease_count(&etcd).await?;
    ensure!(
        leases == K,
        "{SESSIONS} sessions through one proxy left {leases} leases in etcd, not {K}"
    );

    let revision_before = etcd.revision().await?;
    let renewals_before = proxy.metric("lockcell_etcd_lease_renewals_total").await?;
    // Several TTLs of renewals: 3 per TTL per session, so 5 TTLs is 15 per session.
    let target = (SESSIONS * 15) as f64;
    eventually(
        "five TTLs of keepalives reach the proxy",
        Duration::from_secs(60),
        || async {
            Ok((proxy.metric("lockcell_keepalives_received_total").await? >= target).then_some(()))
        },
    )
    .await?;
    let revision_after = etcd.revision().await?;
    ensure!(
        revision_after == revision_before,
        "keepalives moved the cell's revision from {revision_before} to {revision_after}"
    );
    let renewals = proxy.metric("lockcell_etcd_lease_renewals_total").await? - renewals_before;
    ensure!(
        renewals > 0.0,
        "the proxy never renewed its own leases meanwhile"
    );
    ensure!(lease_count(&etcd).await? == K);
    let expired = proxy.metric("lockcell_sessions_expired_total").await?;
    ensure!(
        expired == 0.0,
        "{expired} sessions expired while being kept alive"
    );
    let invalid = sessions
        .iter()
        .filter(|s| s.state() != SessionState::Valid)
        .count();
    ensure!(
        invalid == 0,
        "{invalid} sessions are not valid after being kept alive"
    );
    Ok(())
}
