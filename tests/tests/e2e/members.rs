//! Membership through the SDK against real proxies: announce, follow the group, and see
//! members leave when their session closes, expires, or their proxy dies; a watcher
//! that goes on across a restart of its own proxy misses nothing.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Client, Condition, EventKind, MemberChange, Members, WatchOptions};
use lockcell_tests::{ProxyOptions, ProxyProcess};

use crate::support::{cell, short_session};

/// Waits for the next changes of `members`, with a deadline.
async fn next(members: &mut Members, within: Duration) -> anyhow::Result<Vec<MemberChange>> {
    tokio::time::timeout(within, members.changed())
        .await
        .with_context(|| format!("no membership change within {within:?}"))?
        .map_err(Into::into)
}

pub async fn members_leave_when_their_session_ends_or_their_proxy_dies() -> anyhow::Result<()> {
    let (etcd, mut proxies) = cell(&["a", "b", "c"]).await?;
    let (a, b) = (
        Client::connect(&proxies[0].url()).await?,
        Client::connect(&proxies[1].url()).await?,
    );
    let watcher = Client::connect(&proxies[2].url()).await?;
    let mut group = watcher.members("api").await?;
    ensure!(group.current().is_empty());

    let closing = a
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    closing.announce("api", "host-1", b"10.0.0.1").await?;
    let dying = b
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    dying.announce("api", "host-2", b"10.0.0.2").await?;
    while group.current().len() < 2 {
        next(&mut group, Duration::from_secs(10)).await?;
    }
    ensure!(group.current().get("host-1").map(Vec::as_slice) == Some(&b"10.0.0.1"[..]));

    closing.close().await?;
    let left = next(&mut group, Duration::from_secs(10)).await?;
    ensure!(
        left == [MemberChange::Left {
            member: "host-1".into()
        }],
        "{left:?}"
    );
    // The proxy of host-2 dies: it leaves when etcd expires that proxy's lease.
    proxies[1].process.kill();
    let left = next(&mut group, Duration::from_secs(20)).await?;
    ensure!(
        left == [MemberChange::Left {
            member: "host-2".into()
        }],
        "{left:?}"
    );
    ensure!(group.current().is_empty());

    // An SDK watcher across a restart of its own proxy: it resumes from its last
    // revision and sees every write once, in order.
    let addr = proxies[0].addr.clone();
    let mut watch = a
        .watch(
            "cfg/",
            WatchOptions::prefix().reconnecting_for(Duration::from_secs(30)),
        )
        .await?;
    let writer = Client::connect(&proxies[2].url()).await?;
    let mut want = Vec::new();
    for i in 0..5 {
        want.push(
            writer
                .put(&format!("cfg/{i}"), b"v", Condition::Always)
                .await?
                .revision,
        );
    }
    let mut got = Vec::new();
    while got.len() < 3 {
        let batch = tokio::time::timeout(Duration::from_secs(10), watch.next()).await??;
        got.extend(batch.events.iter().map(|e| e.entry.mod_revision));
    }
    proxies[0].process.kill();
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.listen = Some(addr);
    let _restarted = ProxyProcess::start(&options, &etcd.dir).await?;
    for i in 5..10 {
        want.push(
            writer
                .put(&format!("cfg/{i}"), b"v", Condition::Always)
                .await?
                .revision,
        );
    }
    while got.len() < want.len() {
        let batch = tokio::time::timeout(Duration::from_secs(30), watch.next()).await??;
        ensure!(batch.events.iter().all(|e| e.kind == EventKind::Put));
        got.extend(batch.events.iter().map(|e| e.entry.mod_revision));
    }
    ensure!(
        got == want,
        "across the restart: got {got:?}, want {want:?}"
    );
    Ok(())
}
