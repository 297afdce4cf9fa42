//! One "stop acting" signal per hold: `revoked()` and the cancellation token fire when
//! the session falls into jeopardy and when the hold is lost for good, say which, and
//! `Session::valid()` tells when a jeopardy has passed.

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use lockcell_client::{Client, Revoked, Wait};
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess};
use nix::sys::signal::Signal;

use crate::support::short_session;

/// The proxy's etcd lease outlives the pauses of these tests by far: a paused proxy
/// comes back with every key it had.
fn lasting_proxy(etcd: &EtcdCluster) -> ProxyOptions {
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.lease_ttl = Duration::from_secs(30);
    options
}

pub async fn revoked_fires_in_jeopardy_and_valid_tells_when_it_passed() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let proxy = ProxyProcess::start(&lasting_proxy(&etcd), &etcd.dir).await?;
    let client = Client::connect(&proxy.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(2)))
        .await?;
    let guard = session
        .acquire("holds/x", Wait::Try)
        .await?
        .context("a free lock was not granted")?;
    let token = guard.cancellation();
    ensure!(
        guard.valid_until().is_some() && !token.is_cancelled(),
        "a fresh hold is valid"
    );

    proxy.signal(Signal::SIGSTOP)?;
    let revoked = tokio::time::timeout(Duration::from_secs(10), guard.revoked()).await;
    proxy.signal(Signal::SIGCONT)?;
    match revoked {
        Ok(Revoked::Jeopardy) => {}
        other => bail!("revoked() with the proxy paused: {other:?}"),
    }
    eventually("the token is cancelled", Duration::from_secs(5), || async {
        Ok(token.is_cancelled().then_some(()))
    })
    .await?;

    tokio::time::timeout(Duration::from_secs(15), session.valid())
        .await
        .context("the session was not valid again within 15 s of the proxy's return")??;
    ensure!(
        guard.is_valid() && guard.valid_until().is_some(),
        "the hold survived the pause"
    );
    let again = guard.cancellation();
    ensure!(
        !again.is_cancelled(),
        "a new token of a valid hold is not cancelled"
    );
    guard.release().await?;
    ensure!(
        again.is_cancelled(),
        "letting go of the hold cancels its tokens"
    );
    Ok(())
}

pub async fn revoked_says_why_a_hold_was_lost() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let proxy = ProxyProcess::start(&lasting_proxy(&etcd), &etcd.dir).await?;
    let client = Client::connect(&proxy.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let led = session
        .campaign("holds/e", "me", Wait::Try)
        .await?
        .context("an election with no leader was not won")?;
    let token = led.cancellation();
    let path = format!(
        "/sessions/end?session={}&lock=holds/e&token={}&reason=stuck",
        session.id(),
        led.token()
    );
    let (status, _, body) =
        lockcell_tests::proxy::http_call(&proxy.admin_addr, "POST", &path).await?;
    ensure!(
        status == 200,
        "POST /sessions/end answered {status}: {body}"
    );
    match tokio::time::timeout(Duration::from_secs(10), led.revoked()).await {
        Ok(Revoked::Lost(reason)) if reason.contains("operator") => {}
        other => bail!("revoked() after an operator ended the session: {other:?}"),
    }
    eventually("the token is cancelled", Duration::from_secs(5), || async {
        Ok(token.is_cancelled().then_some(()))
    })
    .await?;
    ensure!(led.valid_until().is_none() && session.valid().await.is_err());
    Ok(())
}
