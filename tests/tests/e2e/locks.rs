//! Exclusive locks: expiry hands a lock on, tokens rise, retries are idempotent.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Client, FencingToken, SessionState, Wait};
use lockcell_proto::v1::{
    AcquireRequest, LockMode, OpenRequest, OpenResponse, ReleaseRequest, SessionState as WireState,
};
use lockcell_tests::{eventually, FencedResource};

use crate::support::{cell, raw, renew_once, short_session, silent_holder};

pub async fn holder_that_stops_renewing_loses_its_lock() -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a"]).await?;
    let proxy = &proxies[0];
    // The holder speaks the raw protocol and never renews.
    let (mut sessions, holder, first) = silent_holder(proxy, "jobs/report").await?;

    let client = Client::connect(&proxy.url()).await?;
    let waiter = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let guard = waiter
        .acquire("jobs/report", Wait::Timeout(Duration::from_secs(20)))
        .await?
        .context("the waiter did not get the lock after the holder stopped renewing")?;
    ensure!(
        guard.token() > first,
        "token {} is not above the expired holder's {first}",
        guard.token()
    );

    // The holder's session is over: the proxy says so.
    let reply = renew_once(&mut sessions, &holder.session_id, &holder.session_secret).await?;
    ensure!(
        reply.state == WireState::Expired as i32,
        "holder's session is {:?}, not expired",
        reply.state
    );
    ensure!(
        guard.release().await?,
        "release of a held lock did not delete it"
    );
    Ok(())
}

pub async fn two_clients_hammering_one_lock_are_fenced() -> anyhow::Result<()> {
    const ROUNDS: usize = 25;
    let (_etcd, proxies) = cell(&["a", "b"]).await?;
    let resource = Arc::new(FencedResource::default());
    // Tokens in grant order, appended while holding the lock.
    let grants: Arc<Mutex<Vec<FencingToken>>> = Arc::default();
    let mut workers = Vec::new();
    for (i, proxy) in proxies.iter().enumerate() {
        let url = proxy.url();
        let (resource, grants) = (resource.clone(), grants.clone());
        workers.push(tokio::spawn(async move {
            let name = format!("client-{i}");
            let client = Client::connect(&url).await?;
            let session = client
                .open_session(short_session(Duration::from_secs(5)))
                .await?;
            for _ in 0..ROUNDS {
                let guard = session
                    .acquire("hammer", Wait::Timeout(Duration::from_secs(20)))
                    .await?
                    .context("no grant within 20 s")?;
                ensure!(guard.is_valid(), "{name} got a grant on an invalid session");
                grants.lock().unwrap().push(guard.token());
                ensure!(
                    resource.write(&name, guard.token()),
                    "the fenced resource refused {name}, the current holder, with token {}",
                    guard.token()
                );
                tokio::task::yield_now().await;
                ensure!(
                    resource.write(&name, guard.token()),
                    "refused a second write by the holder"
                );
                ensure!(
                    guard.release().await?,
                    "{name}'s release did not delete its grant"
                );
            }
            session.close().await?;
            anyhow::Ok(())
        }));
    }
    for worker in workers {
        worker.await??;
    }
    let grants = grants.lock().unwrap().clone();
    ensure!(grants.len() == 2 * ROUNDS);
    for pair in grants.windows(2) {
        ensure!(
            pair[0] < pair[1],
            "tokens did not strictly increase: {} then {}",
            pair[0],
            pair[1]
        );
    }
    // Every earlier holder is stale now: the resource must refuse each of them.
    for stale in &grants[..grants.len() - 1] {
        ensure!(
            !resource.write("stale", *stale),
            "the resource accepted stale token {stale}"
        );
    }
    ensure!(resource.refused().len() == grants.len() - 1);
    // Each proxy timed its grants.
    for proxy in &proxies {
        let page = proxy.metrics().await?;
        let count = proxy
            .metric("lockcell_acquire_duration_seconds_count")
            .await?;
        ensure!(
            page.contains("lockcell_acquire_duration_seconds_bucket"),
            "no acquire histogram:\n{page}"
        );
        ensure!(
            count >= ROUNDS as f64,
            "proxy {} timed {count} acquires, not {ROUNDS}",
            proxy.zone
        );
    }
    Ok(())
}

/// Idempotency is per call, never per session: the same call again gets its grant
/// back; another call of the session that holds the lock (in either mode, or with no
/// call id) is refused by name and changes nothing; a retried release deletes nothing.
pub async fn retried_acquire_and_release_are_idempotent() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let (mut sessions, mut locks) = raw(&proxies[0]).await?;
    let session = sessions
        .open(OpenRequest {
            ttl_ms: 10_000,
            identity: "retrier".into(),
        })
        .await?
        .into_inner();
    let request = |call: &str, mode: LockMode| AcquireRequest {
        session_id: session.session_id.clone(),
        session_secret: session.session_secret.clone(),
        lock: "idem".into(),
        wait_timeout_ms: Some(0),
        mode: mode as i32,
        call_id: call.into(),
        withdraw: false,
    };
    // As if the first reply were lost: the same call again.
    let first = locks
        .acquire(request("c1", LockMode::Exclusive))
        .await?
        .into_inner();
    let again = locks
        .acquire(request("c1", LockMode::Exclusive))
        .await?
        .into_inner();
    ensure!(first.granted && again.granted);
    ensure!(
        first.token == again.token,
        "a retried acquire got {:?}, not the first grant {:?}",
        again.token,
        first.token
    );
    let revision = first.token.context("token")?.revision;
    for (call, mode) in [
        ("c2", LockMode::Exclusive),
        ("", LockMode::Exclusive),
        ("c3", LockMode::Shared),
    ] {
        let refused = locks
            .acquire(request(call, mode))
            .await
            .err()
            .with_context(|| {
                format!("a second call ({call:?}, {mode:?}) of the holding session was granted")
            })?;
        ensure!(
            refused.code() == tonic::Code::FailedPrecondition
                && refused.metadata().get("lockcell-already-held").is_some()
                && refused.message().contains("\"idem\"")
                && refused.message().contains("not re-entrant"),
            "a second call was refused without naming the rule: {refused:?}"
        );
    }
    let key = etcd
        .client()
        .await?
        .get("/l/idem/!x", None)
        .await?
        .kvs()
        .first()
        .map(|kv| (kv.create_revision(), kv.mod_revision()));
    ensure!(
        key == Some((revision, revision)),
        "the refused calls changed the holder key: {key:?}"
    );
    let release = ReleaseRequest {
        session_id: session.session_id.clone(),
        session_secret: session.session_secret.clone(),
        lock: "idem".into(),
        token: first.token,
        ..Default::default()
    };
    ensure!(locks.release(release.clone()).await?.into_inner().released);
    ensure!(
        !locks.release(release).await?.into_inner().released,
        "a retried release deleted something"
    );
    // Released, the lock is the next call's: a new grant.
    let next = locks
        .acquire(request("c2", LockMode::Exclusive))
        .await?
        .into_inner();
    ensure!(
        next.granted && next.token.context("token")?.revision > revision,
        "after the release a new call got {next:?}"
    );
    Ok(())
}

/// Used by the fault tests: waits until an SDK session is no longer valid.
pub async fn until_not_valid(
    session: &lockcell_client::Session,
    within: Duration,
) -> anyhow::Result<()> {
    eventually("the session leaves the valid state", within, || async {
        Ok((session.state() != SessionState::Valid).then_some(()))
    })
    .await
}

pub async fn a_lost_acquire_reply_and_its_retry_make_one_grant() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let (mut sessions, mut locks) = raw(&proxies[0]).await?;
    let holder = sessions
        .open(OpenRequest {
            ttl_ms: 30_000,
            identity: "holder".into(),
        })
        .await?
        .into_inner();
    let waiter = sessions
        .open(OpenRequest {
            ttl_ms: 30_000,
            identity: "waiter".into(),
        })
        .await?
        .into_inner();
    let request = |session: &OpenResponse, wait: u64| AcquireRequest {
        session_id: session.session_id.clone(),
        session_secret: session.session_secret.clone(),
        lock: "lost/reply".into(),
        wait_timeout_ms: Some(wait),
        mode: 0,
        call_id: "lostreply".into(),
        withdraw: false,
    };
    let held = locks.acquire(request(&holder, 0)).await?.into_inner();
    ensure!(held.granted);

    // The waiter's call goes through a relay that will lose the reply.
    let relay = lockcell_tests::Relay::start(&proxies[0].addr).await?;
    let channel = tonic::transport::Channel::from_shared(relay.url())?
        .connect()
        .await?;
    let mut relayed = lockcell_proto::v1::lock_client::LockClient::new(channel);
    let first = request(&waiter, 20_000);
    let pending = tokio::spawn(async move { relayed.acquire(first).await });
    eventually("the waiter waits", Duration::from_secs(10), || async {
        Ok((proxies[0].metric("lockcell_waiters").await? >= 1.0).then_some(()))
    })
    .await?;
    relay.cut_replies(true);
    relay.cut_requests(true);
    locks
        .release(ReleaseRequest {
            session_id: holder.session_id.clone(),
            session_secret: holder.session_secret.clone(),
            lock: "lost/reply".into(),
            token: held.token,
            mode: 0,
        })
        .await?;
    // The proxy grants; the reply is lost on the way back.
    let store = etcd.client().await?;
    let granted_at = eventually(
        "the proxy grants the waiter",
        Duration::from_secs(10),
        || {
            let mut store = store.clone();
            let waiter = waiter.session_id.clone();
            async move {
                let resp = store.get("/l/lost/reply/!x", None).await?;
                Ok(resp
                    .kvs()
                    .first()
                    .filter(|kv| kv.value_str().is_ok_and(|v| v.contains(&waiter)))
                    .map(|kv| kv.create_revision()))
            }
        },
    )
    .await?;
    pending.abort();

    // The retry finds the grant it already has.
    let retry = locks.acquire(request(&waiter, 0)).await?.into_inner();
    ensure!(retry.granted, "the retry was refused");
    let token = retry.token.context("token")?;
    ensure!(
        token.revision == granted_at,
        "the retry got {token:?}, not the grant made at {granted_at}"
    );
    let holders = store
        .clone()
        .get(
            "/l/lost/reply/!s",
            Some(
                etcd_client::GetOptions::new()
                    .with_range("/l/lost/reply/!y")
                    .with_count_only(),
            ),
        )
        .await?
        .count();
    ensure!(
        holders == 1,
        "{holders} holder keys after a lost reply and a retry"
    );
    Ok(())
}

/// A clean release writes the lock's release marker (lock-delay and the audit trail
/// read its write); its proxy deletes it afterwards, so a client releasing many lock
/// names, one by one or by closing its session, leaves no marker behind.
pub async fn release_markers_do_not_pile_up() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let mut store = etcd.client().await?;
    let start = store
        .get("/", None)
        .await?
        .header()
        .map_or(0, |h| h.revision())
        + 1;
    let client = Client::connect(&proxies[0].url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    const RELEASED: usize = 20;
    const CLOSED: usize = 5;
    for i in 0..RELEASED {
        let guard = session
            .acquire(&format!("markers/released-{i}"), Wait::Try)
            .await?
            .with_context(|| format!("markers/released-{i} is free"))?;
        ensure!(guard.release().await?, "release {i} released nothing");
    }
    // One lock released and taken again at once, over and over: its next grant may
    // delete the marker before the proxy does, and the proxy's delete is guarded by
    // the write it was for, so it never takes a later release's marker.
    const AGAIN: usize = 10;
    for i in 0..AGAIN {
        let guard = session
            .acquire("markers/again", Wait::Try)
            .await?
            .with_context(|| format!("markers/again is free on round {i}"))?;
        ensure!(
            guard.release().await?,
            "release {i} of markers/again released nothing"
        );
    }
    let closing = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let mut held = Vec::new();
    for i in 0..CLOSED {
        held.push(
            closing
                .acquire(&format!("markers/closed-{i}"), Wait::Try)
                .await?
                .with_context(|| format!("markers/closed-{i} is free"))?,
        );
    }
    closing.close().await?;

    let is_marker = |key: &[u8]| {
        matches!(
            lockcell_cell::keyspace::parse_key(key),
            Some((_, lockcell_cell::keyspace::KeyKind::Released))
        )
    };
    eventually(
        "every release marker deleted",
        Duration::from_secs(10),
        || {
            let mut store = store.clone();
            async move {
                let keys = store
                    .get(
                        "/l/",
                        Some(
                            etcd_client::GetOptions::new()
                                .with_prefix()
                                .with_keys_only(),
                        ),
                    )
                    .await?;
                let left = keys.kvs().iter().filter(|kv| is_marker(kv.key())).count();
                Ok((left == 0).then_some(()))
            }
        },
    )
    .await?;
    // Each was written first, in its release's revision (that write is what is read),
    // then deleted.
    let mut history = store
        .watch(
            "/l/",
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(start),
            ),
        )
        .await?;
    let (mut written, mut deleted) = (0, 0);
    let expected = RELEASED + AGAIN + CLOSED;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    while written < expected || deleted < expected {
        let Ok(reply) = tokio::time::timeout_at(give_up, history.message()).await else {
            break;
        };
        let reply = reply?.context("the watch of /l/ ended")?;
        for event in reply.events() {
            if !event.kv().is_some_and(|kv| is_marker(kv.key())) {
                continue;
            }
            match event.event_type() {
                etcd_client::EventType::Put => written += 1,
                etcd_client::EventType::Delete => deleted += 1,
            }
        }
    }
    ensure!(
        written == expected && deleted == expected,
        "{written} release markers were written and {deleted} deleted, for {expected} clean releases"
    );
    Ok(())
}

/// A program takes a lock and a leadership and returns from `main` with its guards
/// dropped and a session still open, calling `Client::shutdown` last: its runtime then
/// ends (dropping every task it still had), and another client must find the lock and
/// the election free at once, not a TTL later.
pub async fn a_client_shut_down_as_main_returns_leaves_nothing_held() -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a"]).await?;
    let url = proxies[0].url();
    let program = {
        let url = url.clone();
        std::thread::spawn(move || -> anyhow::Result<()> {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(async {
                let client = Client::connect(&url).await?;
                let session = client
                    .open_session(short_session(Duration::from_secs(30)))
                    .await?;
                let lock = session
                    .acquire("shutdown/x", Wait::Try)
                    .await?
                    .context("x")?;
                let kept = session
                    .acquire("shutdown/kept", Wait::Try)
                    .await?
                    .context("kept")?;
                let led = session
                    .campaign("shutdown/e", "v", Wait::Try)
                    .await?
                    .context("e")?;
                drop((lock, led));
                // `kept` and the session live on: the close must let go of them.
                client.shutdown().await?;
                drop((kept, session));
                anyhow::Ok(())
            })?;
            drop(runtime);
            Ok(())
        })
    };
    program.join().expect("the program thread")?;
    let other = Client::connect(&url).await?;
    let session = other
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    for lock in ["shutdown/x", "shutdown/kept"] {
        ensure!(
            session.acquire(lock, Wait::Try).await?.is_some(),
            "{lock} was still held after the program shut its client down and ended"
        );
    }
    ensure!(
        session
            .campaign("shutdown/e", "w", Wait::Try)
            .await?
            .is_some(),
        "the election was still led after the program shut its client down and ended"
    );
    Ok(())
}
