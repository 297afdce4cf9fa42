//! Sessions moving between proxies (docs/design.md §6): a killed proxy's clients
//! resume elsewhere with their locks, tokens and ephemeral keys; with no proxy reachable
//! a session expires after its grace period and its locks pass on; a rolling restart of
//! every proxy (SIGTERM drains) under load loses no session and no lock; a proxy cut off
//! from etcd sends its clients away before its lease ends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{
    Client, ClientOptions, Condition, FencingToken, LockGuard, Session, SessionEvent, SessionState,
    Wait,
};
use lockcell_tests::{eventually, ProxyOptions, ProxyProcess, Relay};
use nix::sys::signal::Signal;

use crate::support::{cell, lease_count, raw, short_session};

/// Session TTL of these tests; the proxies' lease TTL is 3 s.
const TTL: Duration = Duration::from_secs(2);

/// The create revision and lease of a key in etcd, if it is there.
async fn etcd_key(
    etcd: &lockcell_tests::EtcdCluster,
    key: &str,
) -> anyhow::Result<Option<(i64, i64)>> {
    let mut client = etcd.client().await?;
    let resp = client.get(key, None).await?;
    Ok(resp
        .kvs()
        .first()
        .map(|kv| (kv.create_revision(), kv.lease())))
}

/// Every event the session has had so far.
async fn events_so_far(events: &mut lockcell_client::SessionEvents) -> Vec<SessionEvent> {
    let mut seen = Vec::new();
    while let Ok(Some(event)) = tokio::time::timeout(Duration::from_millis(50), events.next()).await
    {
        seen.push(event);
    }
    seen
}

pub async fn a_killed_proxys_clients_resume_elsewhere_with_locks_and_tokens_unchanged(
) -> anyhow::Result<()> {
    let (etcd, mut proxies) = cell(&["a", "b", "c"]).await?;
    let addrs: Vec<String> = proxies.iter().map(|p| p.url()).collect();
    let options = ClientOptions::new(addrs.clone()).fail_back_after(Duration::from_secs(1));
    let client = Client::connect_with(options).await?;
    let session = client.open_session(short_session(TTL)).await?;
    ensure!(
        session.proxy_id().starts_with("a-"),
        "own zone first: {}",
        session.proxy_id()
    );
    let mut events = session.events();
    let lock = session
        .acquire("handover/x", Wait::Try)
        .await?
        .context("free lock not granted")?;
    let shared = session
        .acquire_shared("handover/s", Wait::Try)
        .await?
        .context("free shared lock not granted")?;
    let member = session
        .put_ephemeral("members/handover/1", b"here", Condition::Always)
        .await?;
    let member_created = member
        .current
        .context("no entry after a put")?
        .create_revision;
    let (x_created, a_lease) = etcd_key(&etcd, "/l/handover/x/!x")
        .await?
        .context("the holder key is not in etcd")?;
    ensure!(x_created == lock.token().revision);

    let killed = tokio::time::Instant::now();
    proxies[0].signal(Signal::SIGKILL)?;
    let moved_to = eventually(
        "the session moves to another proxy",
        Duration::from_secs(15),
        || async {
            let id = session.proxy_id();
            Ok((!id.starts_with("a-") && session.state() == SessionState::Valid).then_some(id))
        },
    )
    .await?;
    let took = killed.elapsed();
    // Past the dead proxy's lease TTL, etcd has revoked its leases: what stayed on them
    // is gone, what moved is not.
    eventually(
        "etcd drops the dead proxy's leases",
        Duration::from_secs(15),
        || async { Ok((lease_count(&etcd).await? == 8).then_some(())) },
    )
    .await?;
    let (created, lease) = etcd_key(&etcd, "/l/handover/x/!x")
        .await?
        .context("the moved lock's holder key is gone")?;
    ensure!(
        created == x_created && lease != a_lease,
        "key moved with its create revision kept"
    );
    ensure!(
        lock.is_valid() && shared.is_valid(),
        "the guards stay valid after the move"
    );
    let check = client.check_sequencer("handover/x", lock.token()).await?;
    ensure!(
        check.current,
        "the token {} is still the lock's current grant",
        lock.token()
    );
    let entry = client
        .get("members/handover/1")
        .await?
        .context("the ephemeral key did not move with the session")?;
    ensure!(entry.create_revision == member_created && entry.ephemeral);
    // Another session is still kept out.
    let other = client.open_session(short_session(TTL)).await?;
    ensure!(
        other.acquire("handover/x", Wait::Try).await?.is_none(),
        "a moved lock was granted twice"
    );
    let seen = events_so_far(&mut events).await;
    ensure!(
        seen.iter()
            .any(|e| matches!(e, SessionEvent::Moved { proxy_id } if *proxy_id == moved_to)),
        "no Moved event: {seen:?}"
    );
    ensure!(
        !seen
            .iter()
            .any(|e| matches!(e, SessionEvent::Lost { .. } | SessionEvent::Expired { .. })),
        "nothing was lost: {seen:?}"
    );
    // Proxy a comes back on its address: the session goes home (its own zone first),
    // still with the same lock.
    let mut again = ProxyOptions::new("a", etcd.endpoints());
    again.listen = Some(proxies[0].addr.clone());
    proxies[0] = ProxyProcess::start(&again, &etcd.dir).await?;
    eventually(
        "the session goes back to proxy a",
        Duration::from_secs(15),
        || async { Ok(session.proxy_id().starts_with("a-").then_some(())) },
    )
    .await?;
    ensure!(
        lock.is_valid() && shared.is_valid(),
        "the guards stay valid after going home"
    );
    let check = client.check_sequencer("handover/x", lock.token()).await?;
    ensure!(
        check.current,
        "the token {} is still the current grant",
        lock.token()
    );
    println!(
        "moved to {moved_to} {took:?} after the kill (lease TTL 3 s); token {} kept; back home once a returned",
        lock.token()
    );
    Ok(())
}

pub async fn with_every_proxy_unreachable_a_session_expires_and_its_locks_pass_on(
) -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a", "b"]).await?;
    let relays = [
        Relay::start(&proxies[0].addr).await?,
        Relay::start(&proxies[1].addr).await?,
    ];
    let grace = Duration::from_secs(2);
    let client =
        Client::connect_with(ClientOptions::new(relays.iter().map(Relay::url)).grace(grace))
            .await?;
    let session = client.open_session(short_session(TTL)).await?;
    let mut events = session.events();
    let lock = session
        .acquire("unreachable/x", Wait::Try)
        .await?
        .context("free lock not granted")?;

    proxies[0].signal(Signal::SIGKILL)?;
    relays[1].cut(true);
    let reason = tokio::time::timeout(TTL + grace + Duration::from_secs(10), lock.lost())
        .await
        .context("the guard never reported its lock lost")?;
    ensure!(
        session.state() == SessionState::Expired,
        "expired after the grace period"
    );
    ensure!(!lock.is_valid());
    let seen = events_so_far(&mut events).await;
    let jeopardy = seen.iter().position(|e| *e == SessionEvent::Jeopardy);
    let expired = seen
        .iter()
        .position(|e| matches!(e, SessionEvent::Expired { .. }));
    ensure!(
        matches!((jeopardy, expired), (Some(j), Some(x)) if j < x),
        "jeopardy, then expired: {seen:?}"
    );

    // Someone who can reach a proxy gets the lock once the dead proxy's lease is gone.
    let other = Client::connect(&proxies[1].url()).await?;
    let taker = other.open_session(short_session(TTL)).await?;
    let taken = taker
        .acquire("unreachable/x", Wait::Timeout(Duration::from_secs(15)))
        .await?
        .context("the expired session's lock never passed on")?;
    ensure!(taken.token() > lock.token());
    println!("lost: {reason}");
    Ok(())
}

/// One client of the rolling restart: a session holding a lock and an ephemeral key.
struct Holder {
    session: Session,
    guard: LockGuard,
    token: FencingToken,
    events: lockcell_client::SessionEvents,
}

pub async fn a_rolling_restart_of_every_proxy_loses_no_session_and_no_lock() -> anyhow::Result<()> {
    let (etcd, mut proxies) = cell(&["a", "b", "c"]).await?;
    let addrs: Vec<String> = proxies.iter().map(|p| p.url()).collect();
    let mut holders = Vec::new();
    for i in 0..6 {
        let mut order = addrs.clone();
        order.rotate_left(i % 3);
        let client = Client::connect_with(ClientOptions::new(order)).await?;
        let session = client.open_session(short_session(TTL)).await?;
        let events = session.events();
        let guard = session
            .acquire(&format!("roll/{i}"), Wait::Try)
            .await?
            .context("free lock not granted")?;
        session
            .put_ephemeral(&format!("members/roll/{i}"), b"up", Condition::Always)
            .await?;
        holders.push(Holder {
            token: guard.token(),
            session,
            guard,
            events,
        });
    }
    // Load: sessions taking and releasing a few busy locks throughout.
    let stop = Arc::new(tokio::sync::Notify::new());
    let grants = Arc::new(AtomicUsize::new(0));
    let mut load = tokio::task::JoinSet::new();
    for w in 0..4 {
        let mut order = addrs.clone();
        order.rotate_left(w % 3);
        let client = Client::connect_with(ClientOptions::new(order)).await?;
        let session = client.open_session(short_session(TTL)).await?;
        let (stop, grants) = (stop.clone(), grants.clone());
        load.spawn(async move {
            let work = async {
                loop {
                    let lock = format!("roll/busy/{}", grants.load(Ordering::Relaxed) % 3);
                    match session
                        .acquire(&lock, Wait::Timeout(Duration::from_millis(500)))
                        .await
                    {
                        Ok(Some(guard)) => {
                            grants.fetch_add(1, Ordering::Relaxed);
                            guard.release().await?;
                        }
                        Ok(None) => {}
                        Err(lockcell_client::Error::SessionExpired { session: id }) => {
                            anyhow::bail!(
                                "load session {id} expired: {:?}",
                                session.expired_reason()
                            )
                        }
                        // A proxy went away mid-call: the session moves; go on.
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            };
            tokio::select! {
                result = work => result,
                _ = stop.notified() => Ok(session),
            }
            .map(|_: Session| ())
        });
    }

    for (p, proxy) in proxies.iter_mut().enumerate() {
        let before = grants.load(Ordering::Relaxed);
        proxy.signal(Signal::SIGTERM)?;
        let status = proxy.process.wait_exit(Duration::from_secs(20)).await?;
        ensure!(
            status.success(),
            "proxy {p} exited with {status:?} on SIGTERM"
        );
        let log = std::fs::read_to_string(proxy.log_path())?;
        ensure!(
            log.contains("drained: every session moved"),
            "proxy {p} stopped with sessions still on it:\n{log}"
        );
        let mut again = ProxyOptions::new(&proxy.zone.clone(), etcd.endpoints());
        again.listen = Some(proxy.addr.clone());
        *proxy = ProxyProcess::start(&again, &etcd.dir).await?;
        eventually("the load goes on", Duration::from_secs(10), || async {
            Ok((grants.load(Ordering::Relaxed) > before).then_some(()))
        })
        .await?;
    }
    stop.notify_waiters();
    while let Some(done) = load.join_next().await {
        done??;
    }

    let probe = Client::connect(&addrs[0]).await?;
    for (i, h) in holders.iter_mut().enumerate() {
        eventually("the session is valid", Duration::from_secs(10), || async {
            Ok((h.session.state() == SessionState::Valid).then_some(()))
        })
        .await?;
        ensure!(h.guard.is_valid(), "holder {i}'s lock is valid");
        let check = probe.check_sequencer(&format!("roll/{i}"), h.token).await?;
        ensure!(
            check.current,
            "holder {i}'s token {} is the current grant",
            h.token
        );
        ensure!(
            probe.get(&format!("members/roll/{i}")).await?.is_some(),
            "holder {i}'s ephemeral key survived"
        );
        let seen = events_so_far(&mut h.events).await;
        // A drain moves sessions while their proxy still answers: none falls into
        // jeopardy, let alone loses anything.
        ensure!(
            !seen.iter().any(|e| matches!(
                e,
                SessionEvent::Jeopardy | SessionEvent::Lost { .. } | SessionEvent::Expired { .. }
            )),
            "holder {i} fell into jeopardy or lost something: {seen:?}"
        );
        ensure!(
            seen.iter()
                .filter(|e| matches!(e, SessionEvent::Moved { .. }))
                .count()
                >= 1,
            "holder {i} moved at least once: {seen:?}"
        );
    }
    println!(
        "{} load grants through the restarts",
        grants.load(Ordering::Relaxed)
    );
    Ok(())
}

pub async fn a_proxy_cut_off_from_etcd_sends_its_clients_elsewhere_before_its_lease_ends(
) -> anyhow::Result<()> {
    let etcd = lockcell_tests::EtcdCluster::start(1).await?;
    // Proxy a reaches etcd through a relay the test cuts; b directly.
    let link = Relay::start(&etcd.endpoints()[0]).await?;
    let a =
        ProxyProcess::start(&ProxyOptions::new("a", vec![link.addr.clone()]), &etcd.dir).await?;
    let b = ProxyProcess::start(&ProxyOptions::new("b", etcd.endpoints()), &etcd.dir).await?;
    let client = Client::connect_with(ClientOptions::new([a.url(), b.url()])).await?;
    let session = client.open_session(short_session(TTL)).await?;
    let mut events = session.events();
    let lock = session
        .acquire("partitioned/x", Wait::Try)
        .await?
        .context("free lock not granted")?;

    link.cut(true);
    eventually(
        "the session moves off the cut-off proxy",
        Duration::from_secs(15),
        || async { Ok(session.proxy_id().starts_with("b-").then_some(())) },
    )
    .await?;
    // Past the cut-off proxy's lease TTL its leases are gone; the lock moved before.
    eventually(
        "etcd drops the cut-off proxy's leases",
        Duration::from_secs(15),
        || async { Ok((lease_count(&etcd).await? == 4).then_some(())) },
    )
    .await?;
    ensure!(lock.is_valid(), "the lock stays valid on the new proxy");
    ensure!(
        client
            .check_sequencer("partitioned/x", lock.token())
            .await?
            .current,
        "the token is still the lock's current grant"
    );
    let seen = events_so_far(&mut events).await;
    ensure!(
        !seen
            .iter()
            .any(|e| matches!(e, SessionEvent::Lost { .. } | SessionEvent::Expired { .. })),
        "nothing was lost: {seen:?}"
    );
    link.cut(false);
    Ok(())
}

/// A resume the client never heard back from must not land after a later one: every
/// resume compares the session's fence with the revision the client last heard of.
/// Played with the raw protocol: a resume on b whose reply "was lost", a resume on c
/// naming the old fence (refused, told where the keys went), again with the fence it
/// was told (moves them to c), then the "delayed" resume on b again (refused: the keys
/// stay on c).
pub async fn a_resume_the_client_gave_up_on_cannot_land_after_a_later_one() -> anyhow::Result<()> {
    use lockcell_proto::v1::{
        AcquireRequest, HeldKey, HeldKind, KeepAliveRequest, OpenRequest, ResumeRequest,
    };
    let (etcd, proxies) = cell(&["a", "b", "c"]).await?;
    let (mut sessions_a, mut locks_a) = raw(&proxies[0]).await?;
    let (mut sessions_b, _) = raw(&proxies[1]).await?;
    let (mut sessions_c, _) = raw(&proxies[2]).await?;
    let opened = sessions_a
        .open(OpenRequest {
            ttl_ms: 10_000,
            identity: "fence".into(),
        })
        .await?
        .into_inner();
    let granted = locks_a
        .acquire(AcquireRequest {
            session_id: opened.session_id.clone(),
            session_secret: opened.session_secret.clone(),
            lock: "fenced/x".into(),
            wait_timeout_ms: Some(0),
            ..Default::default()
        })
        .await?
        .into_inner();
    let token = granted.token.context("no token")?.revision;
    let resume = |fence: i64, from: i64| ResumeRequest {
        session_id: opened.session_id.clone(),
        session_secret: opened.session_secret.clone(),
        ttl_ms: 10_000,
        identity: "fence".into(),
        from_lease_id: from,
        keys: vec![HeldKey {
            kind: HeldKind::Exclusive as i32,
            name: "fenced/x".into(),
            revision: token,
            lease_id: 0,
            mod_revision: 0,
        }],
        acting_for_ms: 0,
        fence_revision: fence,
        epoch: opened.epoch,
        cells: Vec::new(),
    };
    let on_b = sessions_b
        .resume(resume(0, opened.lease_id))
        .await?
        .into_inner();
    ensure!(on_b.lost.is_empty() && on_b.fence_revision > 0, "{on_b:?}");
    // The client did not hear of b's resume: it names fence 0.
    let refused = sessions_c
        .resume(resume(0, opened.lease_id))
        .await
        .expect_err("a resume naming an old fence was taken");
    ensure!(
        refused.code() == tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    let told = |key: &str| -> anyhow::Result<i64> {
        Ok(refused
            .metadata()
            .get(key)
            .context("no fence metadata")?
            .to_str()?
            .parse()?)
    };
    let (fence, lease) = (
        told("lockcell-fence-revision")?,
        told("lockcell-fence-lease")?,
    );
    ensure!(fence == on_b.fence_revision && lease == on_b.lease_id);
    let on_c = sessions_c.resume(resume(fence, lease)).await?.into_inner();
    ensure!(on_c.lost.is_empty(), "the keys moved from b to c: {on_c:?}");
    // b's resume, "delayed", arrives again: refused, and the key stays on c.
    let late = sessions_b.resume(resume(0, opened.lease_id)).await;
    ensure!(late.is_err(), "a late resume naming an old fence was taken");
    let (created, on_lease) = etcd_key(&etcd, "/l/fenced/x/!x")
        .await?
        .context("the holder key is gone")?;
    ensure!(
        created == token && on_lease == on_c.lease_id,
        "key on c's lease, token kept"
    );
    // The session lives on c: it renews there.
    let mut renewals = sessions_c
        .keep_alive(tokio_stream::iter([KeepAliveRequest {
            session_id: opened.session_id.clone(),
            session_secret: opened.session_secret.clone(),
            seq: 1,
        }]))
        .await?
        .into_inner();
    let renewed = renewals.message().await?.context("no renewal reply")?;
    ensure!(renewed.valid_for_ms > 0, "{renewed:?}");

    // A resume from another epoch (as after a restore from backup) moves nothing: the
    // key is reported lost and stays where it is.
    let mut stale = resume(on_c.fence_revision, on_c.lease_id);
    stale.epoch = opened.epoch + 1;
    let on_b = sessions_b.resume(stale).await?.into_inner();
    ensure!(
        on_b.lost.len() == 1 && on_b.lost[0].reason.contains("restored"),
        "a resume of another epoch did not report the key lost: {on_b:?}"
    );
    let (_, on_lease) = etcd_key(&etcd, "/l/fenced/x/!x")
        .await?
        .context("the holder key is gone")?;
    ensure!(
        on_lease == on_c.lease_id,
        "a resume of another epoch moved the key"
    );
    Ok(())
}

/// A service waits for a lock held elsewhere, over TLS, and its proxy is SIGKILLed
/// under the wait. Over TLS a connection that breaks mid-call surfaces in tonic as
/// UNKNOWN "transport error", not UNAVAILABLE: the SDK must still see a proxy that gave
/// no answer, move the session and wait on where it went, and the lock must come to it
/// once the holder lets go.
pub async fn a_wait_over_tls_goes_on_after_its_proxy_is_killed() -> anyhow::Result<()> {
    let etcd = lockcell_tests::EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let ca = lockcell_tests::certs::Authority::new(&dir.path().join("certs"))?;
    let server = ca.server("proxy")?;
    let mut proxies = Vec::new();
    for zone in ["a", "b"] {
        let mut options = ProxyOptions::new(zone, etcd.endpoints());
        options.extra_args = vec![
            "--tls-cert".into(),
            server.cert.display().to_string(),
            "--tls-key".into(),
            server.key.display().to_string(),
        ];
        proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    }
    let tls = || lockcell_client::ClientTls {
        ca_pem: std::fs::read(&ca.ca).expect("the CA"),
        identity_pem: None,
        domain: Some("localhost".into()),
    };
    let on = |addrs: Vec<String>| ClientOptions::new(addrs).tls(tls());
    let holder_client = Client::connect_with(on(vec![proxies[1].addr.clone()])).await?;
    let holder = holder_client.open_session(short_session(TTL)).await?;
    let held = holder
        .acquire("tls-wait/x", Wait::Try)
        .await?
        .context("a free lock was not granted")?;
    let led = holder
        .campaign("tls-wait/e", "holder", Wait::Try)
        .await?
        .context("an election with no leader was not won")?;

    let addrs = proxies.iter().map(|p| p.addr.clone()).collect();
    let client = Client::connect_with(on(addrs)).await?;
    let session = client.open_session(short_session(TTL)).await?;
    ensure!(
        session.proxy_id().starts_with("a-"),
        "{}",
        session.proxy_id()
    );
    let mut events = session.events();
    let candidate = client.open_session(short_session(TTL)).await?;
    let mut waiting = tokio::spawn(async move {
        let granted = session
            .acquire("tls-wait/x", Wait::Timeout(Duration::from_secs(60)))
            .await;
        (session, granted)
    });
    let campaigning = tokio::spawn(async move {
        let elected = candidate
            .campaign("tls-wait/e", "candidate", Wait::Forever)
            .await;
        (candidate, elected)
    });
    eventually(
        "the acquire and the campaign wait on proxy a",
        Duration::from_secs(10),
        || async { Ok((proxies[0].metric("lockcell_waiters").await? >= 2.0).then_some(())) },
    )
    .await?;
    proxies[0].signal(Signal::SIGKILL)?;
    let moved = eventually(
        "the waiting session moves to proxy b",
        Duration::from_secs(15),
        || async { Ok((proxies[1].metric("lockcell_waiters").await? >= 2.0).then_some(())) },
    );
    tokio::select! {
        moved = moved => moved?,
        ended = &mut waiting => {
            anyhow::bail!("the wait ended on its proxy's death: {:?}", ended?.1.map(|g| g.is_some()))
        }
    }
    let token = held.token();
    held.release().await?;
    let (session, granted) = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .context("the wait did not end once the lock was free")??;
    let guard = granted
        .map_err(|e| anyhow::anyhow!("the wait failed on its proxy's death: {e:?}"))?
        .context("a wait of 60 s answered 'not granted'")?;
    ensure!(
        guard.is_valid() && guard.token().revision > token.revision,
        "the grant after the holder's release is current: {} after {}; session {:?}, events {:?}",
        guard.token(),
        token,
        session.state(),
        events_so_far(&mut events).await,
    );
    ensure!(
        session.proxy_id().starts_with("b-"),
        "{}",
        session.proxy_id()
    );
    ensure!(
        !campaigning.is_finished(),
        "the campaign ended while another led"
    );
    led.resign().await?;
    let (_candidate, elected) = tokio::time::timeout(Duration::from_secs(20), campaigning)
        .await
        .context("the campaign did not end once the leader resigned")??;
    let leadership = elected
        .map_err(|e| anyhow::anyhow!("the campaign failed on its proxy's death: {e:?}"))?
        .context("a campaign waiting forever answered 'not elected'")?;
    ensure!(
        leadership.is_valid(),
        "the new leader's leadership is valid"
    );
    Ok(())
}

/// `lockctl --proxy A,B lock` started while A, the first proxy named, drains: A refuses
/// new sessions but still answers (a session that cannot move keeps it up). The command
/// must run through B, as it would were A down, not exit "unavailable".
pub async fn a_new_lockctl_passes_over_a_draining_first_proxy() -> anyhow::Result<()> {
    let etcd = lockcell_tests::EtcdCluster::start(1).await?;
    let mut proxies = Vec::new();
    for zone in ["a", "b"] {
        let mut options = ProxyOptions::new(zone, etcd.endpoints());
        options.drain_timeout = Duration::from_secs(20);
        proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    }
    let only_a = || Client::connect_with(ClientOptions::new([proxies[0].url()]));
    let stuck = only_a().await?;
    let _stays = stuck.open_session(short_session(TTL)).await?;
    proxies[0].signal(Signal::SIGTERM)?;
    eventually(
        "proxy a refuses new sessions",
        Duration::from_secs(10),
        || async {
            let refused = only_a().await?.open_session(short_session(TTL)).await;
            Ok(matches!(refused, Err(lockcell_client::Error::Unavailable(_))).then_some(()))
        },
    )
    .await?;
    let dir = tempfile::tempdir()?;
    let both = format!("{},{}", proxies[0].addr, proxies[1].addr);
    let command =
        crate::faults::lockctl_command(&both, ("2s", "1s"), "drain/x", "echo held", dir.path());
    let out = tokio::time::timeout(Duration::from_secs(20), command?.output())
        .await
        .context("lockctl did not finish within 20 s")??;
    ensure!(
        out.status.code() == Some(0) && String::from_utf8_lossy(&out.stdout).trim() == "held",
        "lockctl exited {:?}: {}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A lock released, and a leadership resigned, just after their proxy was SIGKILLed:
/// the release and the resignation follow the session to the next proxy and find the
/// keys there (the move named them), so another session gets both at once, not when
/// the dead proxy's etcd lease (30 s here) runs out.
pub async fn a_release_sent_to_a_killed_proxy_releases_where_the_session_went() -> anyhow::Result<()>
{
    let etcd = lockcell_tests::EtcdCluster::start(1).await?;
    let mut proxies = Vec::new();
    for zone in ["a", "b"] {
        let mut options = ProxyOptions::new(zone, etcd.endpoints());
        options.lease_ttl = Duration::from_secs(30);
        proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    }
    let both = vec![proxies[0].addr.clone(), proxies[1].addr.clone()];
    let client = Client::connect_with(ClientOptions::new(both)).await?;
    let session = client.open_session(short_session(TTL)).await?;
    ensure!(
        session.proxy_id().starts_with("a-"),
        "{}",
        session.proxy_id()
    );
    let guard = session
        .acquire("released/x", Wait::Try)
        .await?
        .context("a free lock was not granted")?;
    let led = session
        .campaign("released/e", "v", Wait::Try)
        .await?
        .context("an election with no leader was not won")?;
    proxies[0].signal(Signal::SIGKILL)?;
    let released = guard.release().await?;
    let resigned = led.resign().await?;
    ensure!(
        released && resigned,
        "released {released}, resigned {resigned}"
    );
    let other = Client::connect(&proxies[1].url()).await?;
    let second = other.open_session(short_session(TTL)).await?;
    ensure!(
        second.acquire("released/x", Wait::Try).await?.is_some(),
        "the released lock is still held"
    );
    ensure!(
        second
            .campaign("released/e", "w", Wait::Try)
            .await?
            .is_some(),
        "the resigned election is still led"
    );
    Ok(())
}

/// Every kind of call over TLS to a proxy that is frozen (SIGSTOP) or dead (SIGKILL),
/// with no other proxy to go to: each fails as a retryable error (`ErrorKind::Retry`)
/// that says the proxy did not answer, never as a refusal or a bare transport error;
/// and once the proxy is back, the same calls go through on the same client.
pub async fn every_call_over_tls_to_a_frozen_or_dead_proxy_says_retry() -> anyhow::Result<()> {
    use lockcell_client::{ErrorKind, WatchOptions};

    let etcd = lockcell_tests::EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let ca = lockcell_tests::certs::Authority::new(&dir.path().join("certs"))?;
    let server = ca.server("proxy")?;
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec![
        "--tls-cert".into(),
        server.cert.display().to_string(),
        "--tls-key".into(),
        server.key.display().to_string(),
    ];
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    let tls = lockcell_client::ClientTls {
        ca_pem: std::fs::read(&ca.ca)?,
        identity_pem: None,
        domain: Some("localhost".into()),
    };
    let addr = proxy.addr.clone();
    let client = Client::connect_with(ClientOptions::new([addr.clone()]).tls(tls.clone())).await?;
    let session = client.open_session(short_session(TTL)).await?;

    // Each call once, each given 30 s (the SDK's own deadlines are shorter); what each
    // returned, by name. The first two go alone: by the time they fail, the client has
    // given up the connection to the frozen proxy, and the others need a new one (the
    // kernel accepts it for the stopped process, whose TLS handshake never comes).
    type Outcome = Result<Result<(), lockcell_client::Error>, tokio::time::error::Elapsed>;
    let calls = || async {
        let patience = Duration::from_secs(30);
        let get = tokio::time::timeout(patience, client.get("tls-calls/k")).await;
        let put =
            tokio::time::timeout(patience, client.put("tls-calls/k", b"v", Condition::Always))
                .await;
        let connecting =
            || Client::connect_with(ClientOptions::new([addr.clone()]).tls(tls.clone()));
        let (acquire, campaign, leader, observe, watch, open, connect) = tokio::join!(
            tokio::time::timeout(patience, session.acquire("tls-calls/x", Wait::Try)),
            tokio::time::timeout(patience, session.campaign("tls-calls/e", "me", Wait::Try)),
            tokio::time::timeout(patience, client.leader("tls-calls/e")),
            tokio::time::timeout(patience, client.observe("tls-calls/e")),
            tokio::time::timeout(patience, client.watch("tls-calls/", WatchOptions::prefix())),
            tokio::time::timeout(patience, client.open_session(short_session(TTL))),
            tokio::time::timeout(patience, connecting()),
        );
        let results: Vec<(&str, Outcome)> = vec![
            ("get", get.map(|r| r.map(drop))),
            ("put", put.map(|r| r.map(drop))),
            ("acquire", acquire.map(|r| r.map(drop))),
            ("campaign", campaign.map(|r| r.map(drop))),
            ("leader", leader.map(|r| r.map(drop))),
            ("observe", observe.map(|r| r.map(drop))),
            ("watch", watch.map(|r| r.map(drop))),
            ("open a session", open.map(|r| r.map(drop))),
            ("connect a new client", connect.map(|r| r.map(drop))),
        ];
        results
    };
    let all_retry = |phase: &str, results: Vec<(&str, Outcome)>| {
        let mut wrong = Vec::new();
        for (call, result) in results {
            match result {
                // Said once: a message that repeats itself hides what it says.
                Ok(Err(e)) if e.to_string().matches("unavailable").count() > 1 => {
                    wrong.push(format!("{call}: says it twice: {e}"))
                }
                Ok(Err(e)) if lockcell_client::Error::kind(&e) == ErrorKind::Retry => {
                    println!("{phase}: {call}: {e}")
                }
                Ok(other) => wrong.push(format!("{call}: {other:?}")),
                Err(_) => wrong.push(format!("{call}: no answer within 30 s")),
            }
        }
        ensure!(
            wrong.is_empty(),
            "{phase}: calls that did not fail as retryable: {wrong:#?}"
        );
        Ok(())
    };

    proxy.signal(Signal::SIGSTOP)?;
    let frozen = calls().await;
    proxy.signal(Signal::SIGCONT)?;
    all_retry("frozen", frozen)?;

    proxy.signal(Signal::SIGKILL)?;
    let dead = calls().await;
    all_retry("dead", dead)?;

    // Back on the same address: the same client goes on with a new session.
    let mut restarted = options.clone();
    restarted.listen = Some(proxy.addr.clone());
    restarted.zone = "a-again".into();
    let _proxy = ProxyProcess::start(&restarted, &etcd.dir).await?;
    eventually(
        "a call through the restarted proxy",
        Duration::from_secs(20),
        || async { Ok(client.get("tls-calls/k").await.ok()) },
    )
    .await?;
    let again = client.open_session(short_session(TTL)).await?;
    ensure!(
        again.acquire("tls-calls/x", Wait::Try).await?.is_some(),
        "the lock was not granted through the restarted proxy"
    );
    Ok(())
}

/// A release sent to a proxy that then stops (SIGSTOP) waits there while the session
/// moves on; the proxy wakes after its etcd lease ran out and answers that the session
/// has expired. That is the word of a proxy the session left: the session lives on,
/// the release is asked again where it went, and the session's other lock stays held.
pub async fn a_proxy_that_wakes_after_its_session_left_does_not_end_it() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a", "b"]).await?;
    let addrs = vec![proxies[0].addr.clone(), proxies[1].addr.clone()];
    let client = Client::connect_with(ClientOptions::new(addrs)).await?;
    let session = client.open_session(short_session(TTL)).await?;
    ensure!(
        session.proxy_id().starts_with("a-"),
        "{}",
        session.proxy_id()
    );
    let x = session
        .acquire("wake/x", Wait::Try)
        .await?
        .context("wake/x was not granted")?;
    let y = session
        .acquire("wake/y", Wait::Try)
        .await?
        .context("wake/y was not granted")?;
    let leases_before: Vec<i64> = etcd
        .client()
        .await?
        .leases()
        .await?
        .leases()
        .iter()
        .map(|l| l.id())
        .collect();

    proxies[0].signal(Signal::SIGSTOP)?;
    let releasing = tokio::spawn(async move { x.release().await });
    eventually(
        "the session moves to proxy b",
        Duration::from_secs(15),
        || async { Ok(session.proxy_id().starts_with("b-").then_some(())) },
    )
    .await?;
    // Proxy a's lease runs out while it is stopped.
    eventually(
        "a lease of the stopped proxy runs out",
        Duration::from_secs(20),
        || async {
            let now = etcd.client().await?.leases().await?;
            let now: Vec<i64> = now.leases().iter().map(|l| l.id()).collect();
            Ok(leases_before
                .iter()
                .any(|id| !now.contains(id))
                .then_some(()))
        },
    )
    .await?;
    proxies[0].signal(Signal::SIGCONT)?;

    let released = tokio::time::timeout(Duration::from_secs(20), releasing)
        .await
        .context("the release did not end within 20 s of the wake")??;
    ensure!(
        matches!(released, Ok(true)),
        "the release after the wake: {released:?}"
    );
    ensure!(
        session.state() != SessionState::Expired,
        "the session expired on the word of the proxy it had left: {:?}",
        session.expired_reason()
    );
    eventually(
        "the session valid on proxy b",
        Duration::from_secs(10),
        || async { Ok((session.state() == SessionState::Valid).then_some(())) },
    )
    .await?;
    ensure!(y.is_valid(), "wake/y is no longer valid after the wake");
    let check = client.check_sequencer("wake/y", y.token()).await?;
    ensure!(check.current, "wake/y's token is no longer current");
    y.release().await?;
    session.close().await?;
    Ok(())
}

/// A member leaves its group while its proxy is SIGKILLed under it: asked again after a
/// retryable error, as the SDK says to, the leave lands where the session went (the
/// move rewrote the key), the member is gone, and a second leave finds nothing.
pub async fn a_leave_racing_its_proxys_death_takes_the_member_out() -> anyhow::Result<()> {
    use lockcell_client::ErrorKind;

    let (_etcd, proxies) = cell(&["a", "b"]).await?;
    let addrs = vec![proxies[0].addr.clone(), proxies[1].addr.clone()];
    let client = Client::connect_with(ClientOptions::new(addrs)).await?;
    let session = client.open_session(short_session(TTL)).await?;
    session.announce("race", "m", "10.0.0.1").await?;
    proxies[0].signal(Signal::SIGKILL)?;
    let left = eventually("the leave lands", Duration::from_secs(20), || async {
        match session.leave("race", "m").await {
            Ok(left) => Ok(Some(left)),
            Err(e) if e.kind() == ErrorKind::Retry => Ok(None),
            Err(e) => Err(e.into()),
        }
    })
    .await?;
    ensure!(left, "the member was not taken out");
    ensure!(
        client.get("members/race/m").await?.is_none(),
        "the member's key is still there"
    );
    ensure!(!session.leave("race", "m").await?, "the member left twice");
    ensure!(
        session.state() != SessionState::Expired,
        "the session ended"
    );
    Ok(())
}
