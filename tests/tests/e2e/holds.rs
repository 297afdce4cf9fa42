//! One "stop acting" signal per hold: `revoked()` and the cancellation token fire when
//! the session falls into jeopardy and when the hold is lost for good, say which, and
//! `Session::valid()` tells when a jeopardy has passed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use lockcell_client::{Client, ClientOptions, Revoked, Wait};
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

/// What the candidates of [`a_lead_loop_keeps_one_term_at_a_time_through_a_proxy_kill`]
/// share: who is in a term now, what went wrong, and the fenced resource they write.
#[derive(Default)]
struct Terms {
    active: std::sync::Mutex<Option<String>>,
    overlaps: std::sync::Mutex<Vec<String>>,
    begun: std::sync::atomic::AtomicUsize,
    resource: lockcell_tests::FencedResource,
}

/// Ends a term in [`Terms`] when its work ends or is dropped.
struct InTerm<'a>(&'a Terms, String);

impl Drop for InTerm<'_> {
    fn drop(&mut self) {
        let mut active = self.0.active.lock().expect("terms");
        if active.as_deref() == Some(self.1.as_str()) {
            *active = None;
        }
    }
}

/// Candidate `name` leads `lead/e` through `addrs` with `Session::lead`; each term
/// writes the fenced resource ten times, 20 ms apart, then lets go.
async fn candidate(
    name: &'static str,
    addrs: Vec<String>,
    terms: Arc<Terms>,
) -> anyhow::Result<()> {
    let client = Client::connect_with(ClientOptions::new(addrs)).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(2)))
        .await?;
    session
        .lead("lead/e", name, |term| {
            let terms = terms.clone();
            async move {
                {
                    let mut active = terms.active.lock().expect("terms");
                    if let Some(other) = active.as_ref() {
                        terms.overlaps.lock().expect("terms").push(format!(
                            "{name}'s term {} began while {other}'s ran",
                            term.token
                        ));
                    }
                    *active = Some(name.to_owned());
                }
                terms.begun.fetch_add(1, Ordering::SeqCst);
                let _in_term = InTerm(&terms, name.to_owned());
                for _ in 0..10 {
                    terms.resource.write(name, term.token);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
        .await?;
    Ok(())
}

/// Two services lead one election with `Session::lead` through two proxies; the proxy
/// the leader of the moment lives on is SIGKILLed. Terms go on (the loop requeues), and no two terms
/// ever run at once, nor does a write with an older term's token reach the resource
/// after a newer one's.
pub async fn a_lead_loop_keeps_one_term_at_a_time_through_a_proxy_kill() -> anyhow::Result<()> {
    let (_etcd, proxies) = crate::support::cell(&["a", "b"]).await?;
    let (a, b) = (proxies[0].addr.clone(), proxies[1].addr.clone());
    let terms = Arc::new(Terms::default());
    let first = tokio::spawn(candidate("one", vec![a.clone(), b.clone()], terms.clone()));
    let second = tokio::spawn(candidate("two", vec![b, a], terms.clone()));
    let begun = |at_least: usize| {
        let terms = terms.clone();
        move || {
            let terms = terms.clone();
            async move { Ok((terms.begun.load(Ordering::SeqCst) >= at_least).then_some(())) }
        }
    };
    eventually("four terms", Duration::from_secs(20), begun(4)).await?;
    // The proxy of whoever leads now dies under its term.
    let leader = eventually("a term running", Duration::from_secs(10), || async {
        Ok(terms.active.lock().expect("terms").clone())
    })
    .await?;
    let dead = usize::from(leader == "two");
    proxies[dead].signal(Signal::SIGKILL)?;
    let before = terms.begun.load(Ordering::SeqCst);
    eventually(
        "four more terms after the kill",
        Duration::from_secs(30),
        begun(before + 4),
    )
    .await?;
    first.abort();
    second.abort();
    let overlaps = terms.overlaps.lock().expect("terms").clone();
    ensure!(overlaps.is_empty(), "terms overlapped: {overlaps:?}");
    let refused = terms.resource.refused();
    ensure!(
        refused.is_empty(),
        "stale writes reached the resource: {refused:?}"
    );
    let writers: std::collections::BTreeSet<String> = terms
        .resource
        .accepted()
        .into_iter()
        .map(|(w, _)| w)
        .collect();
    ensure!(
        writers.len() == 2,
        "both candidates led in turn: {writers:?}"
    );
    Ok(())
}
