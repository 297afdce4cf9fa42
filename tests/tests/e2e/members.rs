//! Membership through the SDK against real proxies: announce, follow the group, and see
//! members leave when their session closes, expires, or their proxy dies; a watcher
//! that goes on across a restart of its own proxy misses nothing.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Client, Condition, EventKind, MemberChange, Members, WatchOptions};
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{
    CloseRequest, HeldKey, HeldKind, OpenRequest, OpenResponse, PutRequest, PutResponse,
    ResumeRequest,
};
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess};
use tonic::transport::Channel;

use crate::support::{cell, raw, short_session};

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
        let batch = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await?
            .context("the watch ended")??;
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
        let batch = tokio::time::timeout(Duration::from_secs(30), watch.next())
            .await?
            .context("the watch ended")??;
        ensure!(batch.events.iter().all(|e| e.kind == EventKind::Put));
        got.extend(batch.events.iter().map(|e| e.entry.mod_revision));
    }
    ensure!(
        got == want,
        "across the restart: got {got:?}, want {want:?}"
    );
    Ok(())
}

/// A raw session (never renewed) on `proxy`, with `ttl_ms`.
async fn raw_session(
    proxy: &ProxyProcess,
    ttl_ms: u64,
) -> anyhow::Result<(SessionClient<Channel>, OpenResponse)> {
    let (mut sessions, _) = raw(proxy).await?;
    let opened = sessions
        .open(OpenRequest {
            ttl_ms,
            identity: "earlier run".into(),
        })
        .await?
        .into_inner();
    Ok((sessions, opened))
}

/// Writes `key` as an ephemeral key of the raw session `s`; returns the Put's reply.
async fn raw_put(
    proxy: &ProxyProcess,
    s: &OpenResponse,
    key: &str,
    value: &[u8],
) -> anyhow::Result<PutResponse> {
    let mut kv = KvClient::new(Channel::from_shared(proxy.url())?.connect().await?);
    let reply = kv
        .put(PutRequest {
            key: key.into(),
            value: value.to_vec(),
            session_id: s.session_id.clone(),
            session_secret: s.session_secret.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(reply.succeeded, "the put of {key} did not succeed");
    Ok(reply)
}

/// The value of `key` now (a linearizable read), if it is there.
async fn value_of(client: &Client, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
    Ok(client.get(key).await?.map(|e| e.value))
}

/// A process restarts and its new session announces the member again, while its old
/// session is still open: the last session to announce a name owns it, so the old
/// session's end (a close, an expiry) or move must leave the member alone. With one
/// proxy lease the two sessions' keys share a lease, so only the key's last write tells
/// them apart.
pub async fn a_re_announced_member_survives_its_previous_sessions_end() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.leases = 1;
    let a = ProxyProcess::start(&options, &etcd.dir).await?;
    let client = Client::connect(&a.url()).await?;
    let restarted = client
        .open_session(short_session(Duration::from_secs(20)))
        .await?;
    let gone = |key: &'static str| {
        let client = client.clone();
        move || {
            let client = client.clone();
            async move { Ok(value_of(&client, key).await?.is_none().then_some(())) }
        }
    };

    // The old session closes.
    let old = client
        .open_session(short_session(Duration::from_secs(20)))
        .await?;
    old.announce("web", "host-1", b"old").await?;
    old.announce("web", "only-old-1", b"x").await?;
    restarted.announce("web", "host-1", b"new").await?;
    old.close().await?;
    eventually(
        "the closed session's own member left",
        Duration::from_secs(10),
        gone("members/web/only-old-1"),
    )
    .await?;
    let host_1 = value_of(&client, "members/web/host-1").await?;
    ensure!(
        host_1.as_deref() == Some(&b"new"[..]),
        "the old session's close took the re-announced member with it: {host_1:?}"
    );

    // The old session expires.
    let (_sessions, old) = raw_session(&a, 1_000).await?;
    raw_put(&a, &old, "members/web/host-2", b"old").await?;
    raw_put(&a, &old, "members/web/only-old-2", b"x").await?;
    restarted.announce("web", "host-2", b"new").await?;
    eventually(
        "the expired session's own member left",
        Duration::from_secs(15),
        gone("members/web/only-old-2"),
    )
    .await?;
    let host_2 = value_of(&client, "members/web/host-2").await?;
    ensure!(
        host_2.as_deref() == Some(&b"new"[..]),
        "the old session's expiry took the re-announced member with it: {host_2:?}"
    );

    // The old session moves to another proxy, naming the member as its own write.
    let b = ProxyProcess::start(&ProxyOptions::new("b", etcd.endpoints()), &etcd.dir).await?;
    let (_, old) = raw_session(&a, 20_000).await?;
    let first = raw_put(&a, &old, "members/web/host-3", b"old").await?;
    let kept = raw_put(&a, &old, "members/web/only-old-3", b"x").await?;
    restarted.announce("web", "host-3", b"new").await?;
    let held = |key: &str, put: &PutResponse| {
        let kv = put.current.clone().unwrap_or_default();
        HeldKey {
            kind: HeldKind::Ephemeral as i32,
            name: key.into(),
            revision: kv.create_revision,
            lease_id: old.lease_id,
            mod_revision: put.revision,
        }
    };
    let (mut elsewhere, _) = raw(&b).await?;
    let resumed = elsewhere
        .resume(ResumeRequest {
            session_id: old.session_id.clone(),
            session_secret: old.session_secret.clone(),
            ttl_ms: 20_000,
            identity: "earlier run".into(),
            from_lease_id: old.lease_id,
            keys: vec![
                held("members/web/host-3", &first),
                held("members/web/only-old-3", &kept),
            ],
            ..Default::default()
        })
        .await?
        .into_inner();
    let lost: Vec<&str> = resumed
        .lost
        .iter()
        .filter_map(|l| l.key.as_ref().map(|k| k.name.as_str()))
        .collect();
    ensure!(
        lost == ["members/web/host-3"],
        "the move did not report the re-announced member lost: {:?}",
        resumed.lost
    );
    ensure!(
        resumed.moved.len() == 1
            && resumed.moved[0].name == "members/web/only-old-3"
            && resumed.moved[0].mod_revision > kept.revision,
        "the reply does not give the moved key's new mod revision: {:?}",
        resumed.moved
    );
    elsewhere
        .close(CloseRequest {
            session_id: old.session_id.clone(),
            session_secret: old.session_secret.clone(),
            ..Default::default()
        })
        .await?;
    // The key that moved went with the close (its record names the move's write)...
    eventually(
        "the moved session's own member left with its close",
        Duration::from_secs(10),
        gone("members/web/only-old-3"),
    )
    .await?;
    // ...and the re-announced one stayed where it was.
    let host_3 = value_of(&client, "members/web/host-3").await?;
    ensure!(
        host_3.as_deref() == Some(&b"new"[..]),
        "the old session's move and close took the re-announced member with it: {host_3:?}"
    );
    // A persistent key named as a session's own, on no lease: never taken (its close
    // would delete a configuration key).
    client.put("cfg/limit", b"200", Condition::Always).await?;
    let limit = client.get("cfg/limit").await?.context("cfg/limit")?;
    let (mut sessions, taker) = raw_session(&b, 20_000).await?;
    let resumed = sessions
        .resume(ResumeRequest {
            session_id: taker.session_id.clone(),
            session_secret: taker.session_secret.clone(),
            ttl_ms: 20_000,
            identity: "earlier run".into(),
            from_lease_id: 0,
            keys: vec![HeldKey {
                kind: HeldKind::Ephemeral as i32,
                name: "cfg/limit".into(),
                revision: limit.create_revision,
                lease_id: 0,
                mod_revision: limit.mod_revision,
            }],
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        resumed.lost.len() == 1 && resumed.moved.is_empty(),
        "a persistent key was taken by a resume: {resumed:?}"
    );
    sessions
        .close(CloseRequest {
            session_id: taker.session_id.clone(),
            session_secret: taker.session_secret.clone(),
            ..Default::default()
        })
        .await?;
    ensure!(
        value_of(&client, "cfg/limit").await?.as_deref() == Some(&b"200"[..]),
        "a persistent key went with the close of a session that named it"
    );

    restarted.close().await?;
    for key in [
        "members/web/host-1",
        "members/web/host-2",
        "members/web/host-3",
    ] {
        ensure!(
            value_of(&client, key).await?.is_none(),
            "{key} outlived the close of the session that announced it last"
        );
    }
    Ok(())
}

/// `Members::watch` as a cache: it starts with the group as read and follows a join, a
/// value and a leave.
pub async fn a_member_cache_follows_joins_and_leaves() -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a"]).await?;
    let client = Client::connect(&proxies[0].url()).await?;
    let first = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    first.announce("cache", "host-1", b"10.0.0.1").await?;
    let cache = client.members("cache").await?.watch();
    ensure!(
        cache.borrow().keys().eq(["host-1"]),
        "the cache starts with the group as read: {:?}",
        cache.borrow()
    );
    let second = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    second.announce("cache", "host-2", b"10.0.0.2").await?;
    let seen = |want: &'static [&'static str]| {
        let mut cache = cache.clone();
        async move {
            tokio::time::timeout(
                Duration::from_secs(10),
                cache.wait_for(|members| {
                    members.keys().map(String::as_str).eq(want.iter().copied())
                }),
            )
            .await
            .with_context(|| format!("the cache never showed {want:?}"))?
            .context("the cache's task ended")?;
            anyhow::Ok(())
        }
    };
    seen(&["host-1", "host-2"]).await?;
    ensure!(
        cache.borrow()["host-2"] == b"10.0.0.2",
        "the value announced"
    );
    first.close().await?;
    seen(&["host-2"]).await?;
    Ok(())
}
