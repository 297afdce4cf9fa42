//! Leader election on the lock log: one leader at a time across proxies, observers see
//! every change in order, a leader whose session expires is replaced.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{LeaderInfo, Wait};
use lockcell_proto::v1::election_client::ElectionClient;
use lockcell_proto::v1::{CampaignRequest, OpenRequest, ProclaimRequest};
use tonic::transport::Channel;
use tonic::Code;

use crate::contention::{classed_cell, connect_all, CLASSES};
use crate::support::{raw, short_session};

const ELECTION: &str = "svc/leader";

pub async fn one_leader_at_a_time_and_observers_see_every_change_in_order() -> anyhow::Result<()> {
    let (_etcd, proxies, _) = classed_cell(CLASSES).await?;
    let clients = connect_all(&proxies).await?;
    let mut observer = clients[2].observe(ELECTION).await?;
    let mut seen: Vec<Option<LeaderInfo>> =
        vec![observer.next().await.context("observe ended")??];
    ensure!(
        seen[0].is_none(),
        "a leader before any campaign: {:?}",
        seen[0]
    );

    let mut sessions = Vec::new();
    for c in &clients {
        sessions.push(
            c.open_session(short_session(Duration::from_secs(10)))
                .await?,
        );
    }
    let first = sessions[0]
        .campaign(ELECTION, "a", Wait::Try)
        .await?
        .context("an uncontested campaign lost")?;
    let waiting: Vec<_> = ["b", "c"]
        .iter()
        .zip(&sessions[1..])
        .map(|(value, s)| {
            let s = s.clone();
            tokio::spawn(async move {
                s.campaign(ELECTION, value, Wait::Timeout(Duration::from_secs(30)))
                    .await
            })
        })
        .collect();
    let leader = clients[1]
        .leader(ELECTION)
        .await?
        .context("no leader seen from another proxy")?;
    ensure!(
        leader.value == "a" && leader.token == first.token(),
        "{leader:?}"
    );

    first.proclaim("a2").await?;
    // Only the leader may proclaim.
    let channel = Channel::from_shared(proxies[1].url())?.connect().await?;
    let refused = ElectionClient::new(channel)
        .proclaim(ProclaimRequest {
            session_id: sessions[1].id().to_owned(),
            session_secret: sessions[1].secret().to_owned(),
            election: ELECTION.into(),
            token: Some(first.token().into()),
            value: "usurper".into(),
        })
        .await
        .expect_err("a non-leader proclaimed");
    ensure!(
        refused.code() == Code::FailedPrecondition && refused.message().contains("leader"),
        "{refused:?}"
    );

    let mut tokens = vec![first.token()];
    ensure!(first.resign().await?, "resign did not end the leadership");
    let mut rest = waiting;
    for _ in 0..2 {
        // Exactly one of the remaining candidates leads next.
        let (done, index, others) = futures_select(rest).await;
        let next = done??.context("a candidate never became leader")?;
        ensure!(
            next.token() > *tokens.last().unwrap(),
            "leadership tokens did not rise"
        );
        for other in &others {
            ensure!(
                !other.is_finished(),
                "two candidates became leader at once (index {index})"
            );
        }
        tokens.push(next.token());
        ensure!(next.resign().await?);
        rest = others;
    }

    // None, a, a2, then for each next leader: gone, elected; finally gone.
    while seen.len() < 8 {
        let change = tokio::time::timeout(Duration::from_secs(10), observer.next())
            .await
            .context("the observer stopped hearing changes")?
            .context("observe ended")??;
        seen.push(change);
    }
    let values: Vec<Option<&str>> = seen
        .iter()
        .map(|l| l.as_ref().map(|l| l.value.as_str()))
        .collect();
    ensure!(
        values[..4] == [None, Some("a"), Some("a2"), None],
        "observed {values:?}"
    );
    ensure!(
        values[5].is_none() && values[7].is_none() && values[4].is_some() && values[6].is_some(),
        "observed {values:?}"
    );
    let observed: Vec<_> = seen.iter().flatten().map(|l| l.token).collect();
    ensure!(
        observed.windows(2).all(|w| w[0] <= w[1]),
        "observed tokens out of order: {observed:?}"
    );
    Ok(())
}

/// Waits for the first of `tasks` to finish; returns its result, its index and the rest.
async fn futures_select<T>(
    tasks: Vec<tokio::task::JoinHandle<T>>,
) -> (
    Result<T, tokio::task::JoinError>,
    usize,
    Vec<tokio::task::JoinHandle<T>>,
) {
    loop {
        if let Some(i) = tasks.iter().position(|t| t.is_finished()) {
            let mut tasks = tasks;
            let done = tasks.remove(i);
            return (done.await, i, tasks);
        }
        tokio::time::sleep(lockcell_tests::wait::POLL).await;
    }
}

pub async fn a_leader_whose_session_expires_is_replaced() -> anyhow::Result<()> {
    let (_etcd, proxies, _) = classed_cell(CLASSES).await?;
    let (mut sessions, _) = raw(&proxies[0]).await?;
    let silent = sessions
        .open(OpenRequest {
            ttl_ms: 1_000,
            identity: "silent leader".into(),
        })
        .await?
        .into_inner();
    let channel = Channel::from_shared(proxies[0].url())?.connect().await?;
    let elected = ElectionClient::new(channel)
        .campaign(CampaignRequest {
            session_id: silent.session_id.clone(),
            session_secret: silent.session_secret.clone(),
            election: ELECTION.into(),
            value: "silent".into(),
            wait_timeout_ms: Some(0),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(elected.elected);
    let client = lockcell_client::Client::connect(&proxies[1].url()).await?;
    let candidate = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    // Replaced within the old leader's TTL and a margin.
    let next = candidate
        .campaign(ELECTION, "next", Wait::Timeout(Duration::from_secs(1 + 5)))
        .await?
        .context("the expired leader was not replaced within TTL + 5 s")?;
    ensure!(next.token().revision > elected.token.context("token")?.revision);
    let leader = client.leader(ELECTION).await?.context("no leader")?;
    ensure!(leader.value == "next", "{leader:?}");
    Ok(())
}

pub async fn sequencer_checks_and_refusals_name_the_rule() -> anyhow::Result<()> {
    let (_etcd, proxies, _) = classed_cell(CLASSES).await?;
    let clients = connect_all(&proxies).await?;
    let a = clients[0]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let b = clients[1]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let first = a
        .acquire("seq/x", Wait::Try)
        .await?
        .context("free lock refused")?;
    let other = a
        .acquire("seq/y", Wait::Try)
        .await?
        .context("free lock refused")?;
    let old = first.token();
    let check = clients[2].check_sequencer("seq/x", old).await?;
    ensure!(check.current && check.holder == Some(old), "{check:?}");

    // A token of another lock of the same session is refused by name.
    let channel = Channel::from_shared(proxies[0].url())?.connect().await?;
    let mut locks = lockcell_proto::v1::lock_client::LockClient::new(channel.clone());
    let wrong = locks
        .release(lockcell_proto::v1::ReleaseRequest {
            session_id: a.id().to_owned(),
            session_secret: a.secret().to_owned(),
            lock: "seq/x".into(),
            token: Some(other.token().into()),
            ..Default::default()
        })
        .await
        .expect_err("a token of another lock was accepted");
    ensure!(
        wrong.code() == Code::FailedPrecondition && wrong.message().contains("seq/y"),
        "{wrong:?}"
    );

    first.release().await?;
    let next = b
        .acquire("seq/x", Wait::Try)
        .await?
        .context("released lock refused")?;
    let stale = clients[2].check_sequencer("seq/x", old).await?;
    ensure!(
        !stale.current && stale.holder == Some(next.token()),
        "{stale:?}"
    );

    // Resigning an election one does not lead is an error, not a quiet success.
    let led = b
        .campaign("seq/election", "b", Wait::Try)
        .await?
        .context("uncontested campaign lost")?;
    let refused = ElectionClient::new(channel)
        .resign(lockcell_proto::v1::ResignRequest {
            session_id: a.id().to_owned(),
            session_secret: a.secret().to_owned(),
            election: "seq/election".into(),
            token: Some(led.token().into()),
        })
        .await
        .expect_err("a non-leader resigned");
    ensure!(
        refused.code() == Code::FailedPrecondition && refused.message().contains("does not lead"),
        "{refused:?}"
    );
    ensure!(led.resign().await?);
    Ok(())
}

/// The next report of `observer`, within 20 s.
async fn next(observer: &mut lockcell_client::LeaderStream) -> anyhow::Result<Option<LeaderInfo>> {
    tokio::time::timeout(Duration::from_secs(20), observer.next())
        .await
        .context("no report within 20 s")?
        .context("the observer ended")?
        .map_err(anyhow::Error::from)
}

/// An observer whose proxy is SIGKILLed goes on through the next proxy: it reports the
/// next change, neither an error nor the leader it already reported.
pub async fn an_observer_goes_on_through_its_proxys_death() -> anyhow::Result<()> {
    use lockcell_client::{Client, ClientOptions};
    use nix::sys::signal::Signal;
    let (_etcd, proxies) = crate::support::cell(&["a", "b"]).await?;
    let both = [proxies[0].addr.clone(), proxies[1].addr.clone()];
    let watching = Client::connect_with(ClientOptions::new(both)).await?;
    let mut observer = watching.observe("observed/e").await?;
    ensure!(next(&mut observer).await?.is_none(), "nobody leads yet");
    let leading = Client::connect(&proxies[1].url()).await?;
    let session = leading
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let leader = session
        .campaign("observed/e", "v1", Wait::Try)
        .await?
        .context("an uncontested campaign lost")?;
    ensure!(
        next(&mut observer).await?.is_some_and(|l| l.value == "v1"),
        "the leader"
    );
    proxies[0].signal(Signal::SIGKILL)?;
    leader.proclaim("v2").await?;
    let after = next(&mut observer).await?;
    ensure!(
        after.as_ref().is_some_and(|l| l.value == "v2"),
        "after the kill the observer reported {after:?}, not the new value"
    );
    Ok(())
}
