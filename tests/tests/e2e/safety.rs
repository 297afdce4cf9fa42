//! The lock's first promise against what real clients do: guards dropped and the lock
//! taken again at once, a second acquire of a lock the session holds, and etcd
//! answering a grant, an enqueue or an ephemeral write after the proxy's deadline (the
//! outcome unknown).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use lockcell_client::{Client, Error, FencingToken, Wait};
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::{
    AcquireRequest, CloseRequest, LockMode, OpenRequest, PutRequest, ReleaseRequest,
};
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess, Relay};

use crate::contention::CLASSES;
use crate::support::{cell, raw, short_session};

/// The most common loop there is: acquire, work, drop the guard, acquire again at
/// once, against a second session that wants the lock too. Each grant must be a new
/// one (its token above the last), and while a guard is in hand the lock's holder key
/// in etcd must be that grant's. A session whose next acquire was handed its previous
/// grant (whose release was still on its way) broke both.
pub async fn a_dropped_guard_and_the_next_acquire_never_share_a_grant() -> anyhow::Result<()> {
    const ROUNDS: usize = 300;
    const LOCK: &str = "job";
    let (etcd, proxies) = cell(&["a", "b"]).await?;
    let store = etcd.client().await?;
    let a = Client::connect(&proxies[0].url()).await?;
    let session = a
        .open_session(short_session(Duration::from_secs(10)))
        .await?;

    // The rival takes the lock whenever it is free, and drops its guard at once too.
    let stop = Arc::new(AtomicBool::new(false));
    let rival_grants = Arc::new(AtomicUsize::new(0));
    let rival = tokio::spawn({
        let (url, stop, grants, mut store) = (
            proxies[1].url(),
            stop.clone(),
            rival_grants.clone(),
            store.clone(),
        );
        async move {
            let b = Client::connect(&url).await?;
            let s = b
                .open_session(short_session(Duration::from_secs(10)))
                .await?;
            while !stop.load(Ordering::SeqCst) {
                let Some(guard) = s
                    .acquire(LOCK, Wait::Timeout(Duration::from_millis(200)))
                    .await?
                else {
                    continue;
                };
                grants.fetch_add(1, Ordering::SeqCst);
                let held = holder_revision(&mut store, LOCK).await?;
                ensure!(
                    !guard.is_valid() || held == Some(guard.token().revision),
                    "the rival holds a valid guard with token {} while etcd's holder is {held:?}",
                    guard.token()
                );
                drop(guard);
            }
            anyhow::Ok(())
        }
    });

    let mut store_a = store.clone();
    let mut last: Option<FencingToken> = None;
    for round in 0..ROUNDS {
        let guard = session
            .acquire(LOCK, Wait::Timeout(Duration::from_secs(10)))
            .await?
            .with_context(|| format!("round {round}: not granted within 10 s"))?;
        let token = guard.token();
        if let Some(last) = last {
            ensure!(
                token > last,
                "round {round}: the acquire was handed token {token}, not a grant above the last one ({last})"
            );
        }
        last = Some(token);
        // The work: a sequencer check, as a resource would make.
        let current = a.check_sequencer(LOCK, token).await?.current;
        let held = holder_revision(&mut store_a, LOCK).await?;
        ensure!(
            !guard.is_valid() || (current && held == Some(token.revision)),
            "round {round}: a valid guard with token {token}, but the sequencer says current={current} and etcd's holder is {held:?}"
        );
        drop(guard);
    }
    stop.store(true, Ordering::SeqCst);
    rival.await??;
    ensure!(
        rival_grants.load(Ordering::SeqCst) > 0,
        "the rival never got the lock: the test raced nothing"
    );
    Ok(())
}

/// A session asking again for what it holds is refused with a clear error, whatever
/// the mode and whether lock or election; a guard just dropped is no obstacle.
pub async fn a_second_acquire_of_a_held_lock_is_refused_by_name() -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a", "b"]).await?;
    let client = Client::connect(&proxies[0].url()).await?;
    let s = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let other = Client::connect(&proxies[1].url())
        .await?
        .open_session(short_session(Duration::from_secs(10)))
        .await?;

    let first = s
        .acquire("twice", Wait::Try)
        .await?
        .context("free lock not granted")?;
    for (what, again) in [
        ("exclusive", s.acquire("twice", Wait::Try).await),
        ("shared", s.acquire_shared("twice", Wait::Try).await),
        (
            "campaign",
            s.campaign("twice", "v", Wait::Try).await.map(|_| None),
        ),
    ] {
        match again {
            Err(Error::AlreadyHeld(message)) => ensure!(
                message.contains("\"twice\"") && message.contains("not re-entrant"),
                "the {what} refusal does not name the lock and the rule: {message}"
            ),
            other => bail!(
                "a second {what} acquire of a held lock gave {}",
                outcome(&other)
            ),
        }
    }
    ensure!(first.is_valid(), "a refused second acquire broke the first");
    ensure!(
        other.acquire("twice", Wait::Try).await?.is_none(),
        "another session got a held lock"
    );
    let token = first.token();
    ensure!(first.release().await?, "the release deleted nothing");
    let next = s
        .acquire("twice", Wait::Try)
        .await?
        .context("the lock released was not granted again")?;
    ensure!(next.token() > token, "the new grant reused token {token}");

    let shared = s
        .acquire_shared("readers", Wait::Try)
        .await?
        .context("shared not granted")?;
    match s.acquire_shared("readers", Wait::Try).await {
        Err(Error::AlreadyHeld(_)) => {}
        other => bail!(
            "a second shared hold of one session gave {}",
            outcome(&other)
        ),
    }
    drop(shared);

    let leader = s
        .campaign("leader", "v1", Wait::Try)
        .await?
        .context("not elected in an empty election")?;
    match s.campaign("leader", "v2", Wait::Try).await {
        Err(Error::AlreadyHeld(_)) => {}
        other => bail!(
            "a second campaign of the leader gave {}",
            outcome(&other.map(|l| l.map(|l| l.token())))
        ),
    }
    drop(leader);
    // Dropped guards release in the background; the next acquire waits for that.
    for name in ["readers", "leader"] {
        let _guard = s
            .acquire(name, Wait::Try)
            .await?
            .with_context(|| format!("{name} not granted just after its guard was dropped"))?;
    }
    Ok(())
}

/// A grant transaction etcd applies after the proxy's deadline: the proxy does not
/// know whether it granted. The key is the session's all the same: the same call
/// retried gets that grant back, and the session's close deletes it.
pub async fn a_grant_etcd_applied_after_the_deadline_is_still_the_sessions() -> anyhow::Result<()> {
    let (etcd, link, proxy) = proxy_through_link("a", None).await?;
    let store = etcd.client().await?;
    let (mut sessions, mut locks) = raw(&proxy).await?;
    let session = sessions
        .open(OpenRequest {
            ttl_ms: 60_000,
            identity: "late".into(),
        })
        .await?
        .into_inner();
    let acquire = |lock: &str, call: &str| AcquireRequest {
        session_id: session.session_id.clone(),
        session_secret: session.session_secret.clone(),
        lock: lock.into(),
        wait_timeout_ms: Some(0),
        mode: 0,
        call_id: call.into(),
        withdraw: false,
    };

    for (lock, call) in [("late/a", "c1"), ("late/b", "c2")] {
        // etcd applies the grant, and the proxy hears nothing from etcd for longer
        // than a try-once acquire takes (two attempts and a read after each, 2 s
        // apiece): the client hears that the outcome is unknown.
        link.cut_replies_after(format!("/l/{lock}/").as_bytes(), Duration::from_secs(10));
        let refused = locks.acquire(acquire(lock, call)).await;
        ensure!(!link.trap_pending(), "the grant never crossed the link");
        let refused = refused
            .err()
            .context("the grant was answered in time: the test injected nothing")?;
        ensure!(
            refused.code() == tonic::Code::Unavailable,
            "an unknown outcome is not UNAVAILABLE: {refused:?}"
        );
        eventually(
            "etcd applies the late grant",
            Duration::from_secs(15),
            || {
                let mut store = store.clone();
                async move { holder_revision(&mut store, lock).await }
            },
        )
        .await?;
    }

    // The call retried (as a client does after UNAVAILABLE, until the proxy's link to
    // etcd is back): its grant, not a new one.
    let made = holder_revision(&mut store.clone(), "late/a").await?;
    let again = eventually(
        "the retried call is answered",
        Duration::from_secs(15),
        || {
            let mut locks = locks.clone();
            let request = acquire("late/a", "c1");
            async move {
                match locks.acquire(request).await {
                    Ok(reply) => Ok(Some(reply.into_inner())),
                    Err(s) if s.code() == tonic::Code::Unavailable => Ok(None),
                    Err(s) => Err(s.into()),
                }
            }
        },
    )
    .await?;
    ensure!(
        again.granted && again.token.map(|t| t.revision) == made,
        "the retried call got {again:?}, not the grant made at {made:?}"
    );
    locks
        .release(ReleaseRequest {
            session_id: session.session_id.clone(),
            session_secret: session.session_secret.clone(),
            lock: "late/a".into(),
            token: again.token,
            mode: 0,
        })
        .await?;

    // The other is never asked for again: the session's close takes it away.
    sessions
        .close(CloseRequest {
            session_id: session.session_id.clone(),
            session_secret: session.session_secret.clone(),
            ..Default::default()
        })
        .await?;
    eventually(
        "the close deletes the grant whose answer never came",
        Duration::from_secs(10),
        || {
            let mut store = store.clone();
            async move {
                Ok(holder_revision(&mut store, "late/b")
                    .await?
                    .is_none()
                    .then_some(()))
            }
        },
    )
    .await?;
    let next = lockcell_client::Client::connect(&proxy.url())
        .await?
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let _guard = next
        .acquire("late/b", Wait::Try)
        .await?
        .context("the lock was not free after the session closed")?;
    Ok(())
}

/// A waiter whose grant attempt goes unanswered (etcd slow, as in a lost zone's storm)
/// and whose next attempt goes unanswered too rides both out: its wait ends granted once
/// etcd answers again, with its own grant, not with an error while it has time left.
pub async fn a_waiter_rides_out_grant_attempts_etcd_does_not_answer() -> anyhow::Result<()> {
    let (etcd, link, proxy) = proxy_through_link("a", None).await?;
    let mut store = etcd.client().await?;
    let (sessions, locks) = raw(&proxy).await?;
    let lock = "ride/x";
    let open = |who: &str| {
        let request = OpenRequest {
            ttl_ms: 60_000,
            identity: who.into(),
        };
        let mut sessions = sessions.clone();
        async move { sessions.open(request).await.map(|r| r.into_inner()) }
    };
    let (holder, waiter) = (open("holder").await?, open("waiter").await?);
    let acquire = |session_id: &str, secret: &str, wait_ms: u64| AcquireRequest {
        session_id: session_id.into(),
        session_secret: secret.into(),
        lock: lock.into(),
        wait_timeout_ms: Some(wait_ms),
        mode: 0,
        call_id: "c1".into(),
        withdraw: false,
    };
    let held = locks
        .clone()
        .acquire(acquire(&holder.session_id, &holder.session_secret, 0))
        .await?
        .into_inner();
    ensure!(held.granted, "the holder was not granted a free lock");
    let waiting = tokio::spawn({
        let mut locks = locks.clone();
        let request = acquire(&waiter.session_id, &waiter.session_secret, 60_000);
        async move { locks.acquire(request).await }
    });
    eventually(
        "the second session waits",
        Duration::from_secs(10),
        || async { Ok((proxy.metric("lockcell_waiters").await? >= 1.0).then_some(())) },
    )
    .await?;

    // The waiter's grant carries its session's id; etcd's answers to it, and to
    // everything else, are lost for longer than two attempts take (2 s apiece).
    link.cut_replies_after(waiter.session_id.as_bytes(), Duration::from_secs(6));
    locks
        .clone()
        .release(ReleaseRequest {
            session_id: holder.session_id.clone(),
            session_secret: holder.session_secret.clone(),
            lock: lock.into(),
            token: held.token,
            mode: 0,
        })
        .await?;
    let granted = tokio::time::timeout(Duration::from_secs(40), waiting)
        .await
        .context("the waiter was not answered within 40 s")??
        .context("the waiter's wait ended in an error while it had time left")?
        .into_inner();
    ensure!(
        !link.trap_pending(),
        "the waiter's grant never crossed the link"
    );
    ensure!(granted.granted, "the waiter was not granted: {granted:?}");
    let made = holder_revision(&mut store, lock).await?;
    ensure!(
        granted.token.map(|t| t.revision) == made,
        "the waiter was answered {:?}, but the lock's holder key is at {made:?}",
        granted.token
    );

    // A third session waits, and hangs up while etcd is not answering its grant: the
    // grant may have been applied, and is its session's all the same; the session's
    // close frees the lock for the next caller.
    let quitter = open("quitter").await?;
    let quitting = tokio::spawn({
        let mut locks = locks.clone();
        let request = acquire(&quitter.session_id, &quitter.session_secret, 60_000);
        async move { locks.acquire(request).await }
    });
    eventually(
        "the third session waits",
        Duration::from_secs(10),
        || async { Ok((proxy.metric("lockcell_waiters").await? >= 1.0).then_some(())) },
    )
    .await?;
    link.cut_replies_after(quitter.session_id.as_bytes(), Duration::from_secs(6));
    locks
        .clone()
        .release(ReleaseRequest {
            session_id: waiter.session_id.clone(),
            session_secret: waiter.session_secret.clone(),
            lock: lock.into(),
            token: granted.token,
            mode: 0,
        })
        .await?;
    eventually(
        "the third session's grant crosses the link",
        Duration::from_secs(10),
        || async { Ok((!link.trap_pending()).then_some(())) },
    )
    .await?;
    quitting.abort();
    let _ = quitting.await;
    eventually(
        "the third session closes once etcd answers again",
        Duration::from_secs(30),
        || {
            let mut sessions = sessions.clone();
            let close = CloseRequest {
                session_id: quitter.session_id.clone(),
                session_secret: quitter.session_secret.clone(),
                ..Default::default()
            };
            async move {
                // A close that failed while etcd was away may have closed it already.
                match sessions.close(close).await {
                    Ok(_) => Ok(Some(())),
                    Err(e) if e.code() == tonic::Code::NotFound => Ok(Some(())),
                    Err(e) => Err(anyhow::anyhow!("close: {e}")),
                }
            }
        },
    )
    .await?;
    let next = eventually(
        "the lock is free after the close",
        Duration::from_secs(15),
        || {
            let mut locks = locks.clone();
            let request = acquire(&holder.session_id, &holder.session_secret, 0);
            async move {
                let reply = locks.acquire(request).await?.into_inner();
                Ok(reply.granted.then_some(reply))
            }
        },
    )
    .await?;
    ensure!(
        next.token.map(|t| t.revision) == holder_revision(&mut store, lock).await?,
        "the next holder's token is not the lock's holder key"
    );
    Ok(())
}

/// A fair waiter whose call ends (its wait ran out) while its proxy cannot reach etcd:
/// its waiter key could not be deleted then, and it must leave the line as soon as etcd
/// answers again, not when its session ends (which may be days away), or every waiter
/// behind it waits that long.
pub async fn a_waiter_whose_call_ended_while_etcd_was_away_leaves_the_line_when_it_is_back(
) -> anyhow::Result<()> {
    const LOCK: &str = "fair/away";
    let mut line = FairLine::held(LOCK).await?;
    // A waiter of a long session, through the proxy whose link to etcd the test cuts.
    let (mut sessions, mut locks) = raw(&line.slow).await?;
    let waiter = sessions
        .open(OpenRequest {
            ttl_ms: 120_000,
            identity: "waiter".into(),
        })
        .await?
        .into_inner();
    let waiting = tokio::spawn(async move {
        locks
            .acquire(AcquireRequest {
                session_id: waiter.session_id.clone(),
                session_secret: waiter.session_secret.clone(),
                lock: LOCK.into(),
                wait_timeout_ms: Some(2_000),
                mode: 0,
                call_id: "w1".into(),
                withdraw: false,
            })
            .await
    });
    eventually(
        "the waiter stands in line",
        Duration::from_secs(10),
        || async { Ok((line.in_line(LOCK).await? == 1).then_some(())) },
    )
    .await?;
    line.link.cut(true);
    let ended = waiting.await?;
    ensure!(
        !matches!(&ended, Ok(reply) if reply.get_ref().granted),
        "the waiter was granted a held lock: {ended:?}"
    );
    line.slow
        .wait_for_log("could not leave the line", Duration::from_secs(10))
        .await?;
    line.link.cut(false);
    line.next_is_granted(LOCK, "one whose call had ended").await
}

/// A fair waiter whose caller hangs up while its enqueue is on its way (a dropped
/// acquire future, a client deadline): etcd still writes the key. Nobody waits with it
/// any more, so it must leave the line, not stand at its head until the session ends.
pub async fn a_waiter_that_hung_up_during_its_enqueue_leaves_no_key_in_line() -> anyhow::Result<()>
{
    const LOCK: &str = "fair/gone";
    let line = FairLine::held(LOCK).await?;
    let (mut sessions, mut locks) = raw(&line.slow).await?;
    let waiter = sessions
        .open(OpenRequest {
            ttl_ms: 120_000,
            identity: "impatient".into(),
        })
        .await?
        .into_inner();
    // etcd writes the key; its answer is held up past the caller's patience.
    line.link
        .cut_replies_after(format!("/q/{LOCK}/").as_bytes(), Duration::from_secs(3));
    let mut ask = tonic::Request::new(AcquireRequest {
        session_id: waiter.session_id.clone(),
        session_secret: waiter.session_secret.clone(),
        lock: LOCK.into(),
        wait_timeout_ms: Some(20_000),
        mode: 0,
        call_id: "w1".into(),
        withdraw: false,
    });
    ask.set_timeout(Duration::from_millis(500));
    let gave_up = locks.acquire(ask).await;
    ensure!(
        !line.link.trap_pending(),
        "the enqueue never crossed the link"
    );
    ensure!(
        gave_up.is_err(),
        "the acquire was answered before its caller gave up: {gave_up:?}"
    );
    eventually(
        "etcd writes the waiter key",
        Duration::from_secs(10),
        || async { Ok((line.in_line(LOCK).await? == 1).then_some(())) },
    )
    .await?;
    line.next_is_granted(LOCK, "one whose caller hung up").await
}

/// An ephemeral write etcd applies after the proxy's deadline: the key lives on the
/// proxy's lease, which outlives the session, so unless the session owns it, it stays
/// (a member announced by nobody). Its close must take it away, whether the proxy could
/// read it back at once or only at the close, or its caller hung up before either.
pub async fn an_ephemeral_write_etcd_applied_after_the_deadline_is_still_the_sessions(
) -> anyhow::Result<()> {
    let (etcd, link, proxy) = proxy_through_link("a", None).await?;
    let store = etcd.client().await?;
    let (mut sessions, _) = raw(&proxy).await?;
    let channel = tonic::transport::Channel::from_shared(proxy.url())?
        .connect()
        .await?;
    let mut kv = KvClient::new(channel);
    let session = sessions
        .open(OpenRequest {
            ttl_ms: 60_000,
            identity: "late".into(),
        })
        .await?
        .into_inner();
    let present = |key: &'static str| {
        let mut store = store.clone();
        async move {
            let found = store.get(format!("/k/{key}"), None).await?;
            anyhow::Ok(found.kvs().first().map(|kv| kv.lease()))
        }
    };

    // Cut for longer than the write and the read back after it take (2 s each), and
    // for less: either way the client hears the outcome is unknown.
    // The last one's caller hangs up (a client deadline) before the proxy gives up.
    const KEYS: [(&str, u64, Option<u64>); 3] = [
        ("members/late-a", 10, None),
        ("members/late-b", 3, None),
        ("members/late-c", 3, Some(500)),
    ];
    for (key, cut, patience) in KEYS {
        link.cut_replies_after(format!("/k/{key}").as_bytes(), Duration::from_secs(cut));
        let mut put = tonic::Request::new(PutRequest {
            key: key.into(),
            value: b"here".to_vec(),
            condition: None,
            session_id: session.session_id.clone(),
            session_secret: session.session_secret.clone(),
        });
        if let Some(ms) = patience {
            put.set_timeout(Duration::from_millis(ms));
        }
        let refused = kv.put(put).await;
        ensure!(!link.trap_pending(), "the write never crossed the link");
        let refused = refused
            .err()
            .context("the write was answered in time: the test injected nothing")?;
        ensure!(
            match patience {
                None => matches!(
                    refused.code(),
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                ),
                // The client's own deadline ends the call on its side.
                Some(_) => refused.code() == tonic::Code::Cancelled,
            },
            "an unknown outcome is neither UNAVAILABLE nor DEADLINE_EXCEEDED, nor the client's own timeout: {refused:?}"
        );
        eventually(
            "etcd applies the late write",
            Duration::from_secs(15),
            || {
                let found = present(key);
                async move { Ok(found.await?.map(|_| ())) }
            },
        )
        .await?;
    }

    // The close may find etcd's answers still held up: then it says the keys go when
    // etcd answers, and they must.
    let closed = sessions
        .close(CloseRequest {
            session_id: session.session_id.clone(),
            session_secret: session.session_secret.clone(),
            ..Default::default()
        })
        .await;
    ensure!(
        closed.is_ok()
            || closed
                .as_ref()
                .is_err_and(|e| e.code() == tonic::Code::Unavailable),
        "the close failed: {closed:?}"
    );
    for (key, _, _) in KEYS {
        eventually(
            &format!("the close deletes {key}, whose write had no answer"),
            Duration::from_secs(10),
            || {
                let found = present(key);
                async move { Ok(found.await?.is_none().then_some(())) }
            },
        )
        .await?;
    }
    Ok(())
}

/// A fair waiter's enqueue etcd applies after the proxy's deadline: the waiter key
/// must not stay in line with nobody behind it, or every later waiter waits forever.
pub async fn an_enqueue_etcd_applied_after_the_deadline_leaves_no_waiter_in_line(
) -> anyhow::Result<()> {
    const LOCK: &str = "fair/q";
    let line = FairLine::held(LOCK).await?;
    let (mut sessions, mut locks) = raw(&line.slow).await?;
    let waiter = sessions
        .open(OpenRequest {
            ttl_ms: 30_000,
            identity: "late waiter".into(),
        })
        .await?
        .into_inner();
    line.link
        .cut_replies_after(format!("/q/{LOCK}/").as_bytes(), Duration::from_secs(3));
    let refused = locks
        .acquire(AcquireRequest {
            session_id: waiter.session_id.clone(),
            session_secret: waiter.session_secret.clone(),
            lock: LOCK.into(),
            wait_timeout_ms: Some(20_000),
            mode: 0,
            call_id: "w1".into(),
            withdraw: false,
        })
        .await;
    ensure!(
        !line.link.trap_pending(),
        "the enqueue never crossed the link"
    );
    let refused = refused
        .err()
        .context("the enqueue was answered in time: the test injected nothing")?;
    ensure!(
        refused.code() == tonic::Code::Unavailable,
        "an unknown outcome is not UNAVAILABLE: {refused:?}"
    );
    line.next_is_granted(LOCK, "a late enqueue").await
}

/// A session moves from proxy b back to a (its first choice); the move is held open
/// between the resume on a and the switch of calls to a (a test hook of the SDK), and
/// the application acquires locks just then, so the acquires reach b, the proxy being
/// left. b grants them on its own lease and then closes the session's stay there,
/// deleting what is still on that lease. A guard that counts such a grant as settled is
/// valid with no holder key behind it; every guard must be either valid with its key in
/// etcd, or not valid.
pub async fn a_grant_from_the_proxy_a_session_is_leaving_never_counts_as_settled(
) -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let mut store = etcd.client().await?;
    let mut a_options = ProxyOptions::new("a", etcd.endpoints());
    let a_addr = format!("127.0.0.1:{}", lockcell_tests::ports::free_port());
    a_options.listen = Some(a_addr.clone());
    let b = ProxyProcess::start(&ProxyOptions::new("b", etcd.endpoints()), &etcd.dir).await?;
    let options = lockcell_client::ClientOptions::new([format!("http://{a_addr}"), b.url()])
        .fail_back_after(Duration::from_secs(1))
        .stall_moves_for_tests(Duration::from_millis(600));
    let client = Client::connect_with(options).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    ensure!(
        session.proxy_id().starts_with("b-"),
        "the session is not on b"
    );
    let mut events = session.events();
    let _a = ProxyProcess::start(&a_options, &etcd.dir).await?;

    // The session is resumed on a (it says so as the resume ends); calls still go to b
    // for the next 600 ms. Acquire then, as an application that knows nothing of it.
    tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(event) = events.next().await {
            if matches!(&event, lockcell_client::SessionEvent::Moved { proxy_id } if proxy_id.starts_with("a-"))
            {
                return Ok(());
            }
        }
        bail!("the session's events ended")
    })
    .await
    .context("the session never moved to a")??;
    let mut guards = Vec::new();
    // The grants b made after the session was resumed on a.
    let mut suspects = Vec::new();
    for i in 0..20 {
        let lock = format!("moving/{i}");
        let Some(guard) = session.acquire(&lock, Wait::Try).await? else {
            bail!("free lock {lock} not granted");
        };
        let record = store.get(format!("/l/{lock}/!x"), None).await?;
        if record
            .kvs()
            .first()
            .is_some_and(|kv| kv.value_str().is_ok_and(|v| v.contains("\"b-")))
        {
            suspects.push(guards.len());
        }
        guards.push((lock, guard));
    }
    ensure!(
        !suspects.is_empty(),
        "nothing to check: b granted nothing during the move"
    );
    // Until the move has settled (on a, valid, b's stay closed), and once more after:
    // a guard valid at any look must have its key in etcd (read first).
    let broken = std::sync::Mutex::new(Vec::new());
    let look = || {
        let (mut store, guards, suspects, broken) = (store.clone(), &guards, &suspects, &broken);
        async move {
            for &i in suspects {
                let (lock, guard) = &guards[i];
                let held = holder_revision(&mut store, lock).await?;
                if held != Some(guard.token().revision) && guard.is_valid() {
                    broken.lock().unwrap().push(format!(
                        "{lock}: a valid guard with token {} while etcd's holder is {held:?}",
                        guard.token()
                    ));
                }
            }
            anyhow::Ok(())
        }
    };
    eventually("the move settles", Duration::from_secs(15), || async {
        look().await?;
        let settled = session.state() == lockcell_client::SessionState::Valid
            && b.metric("lockcell_sessions_open").await? == 0.0;
        Ok(settled.then_some(()))
    })
    .await?;
    look().await?;
    let broken = broken.into_inner().unwrap();
    ensure!(
        broken.is_empty(),
        "{} looks found a valid guard without its key, e.g. {}",
        broken.len(),
        broken[..broken.len().min(3)].join("; ")
    );
    Ok(())
}

/// A second call of a session that holds a lock is refused at once whatever the class
/// and the wait: on a fair class in the other mode (it would otherwise queue behind its
/// own hold), and on an arbitrated class while another session waits in the proxy's
/// line (it would otherwise wait there, never the head, and time out).
pub async fn a_second_call_is_refused_at_once_in_line_and_in_the_other_mode() -> anyhow::Result<()>
{
    let (_etcd, proxies, _) = crate::contention::classed_cell(CLASSES).await?;
    let (mut sessions, mut locks) = raw(&proxies[0]).await?;
    let s = sessions.open(opening("holder")).await?.into_inner();
    let request = |lock: &str, mode: LockMode, call: &str, wait: u64| AcquireRequest {
        session_id: s.session_id.clone(),
        session_secret: s.session_secret.clone(),
        lock: lock.into(),
        wait_timeout_ms: Some(wait),
        mode: mode as i32,
        call_id: call.into(),
        withdraw: false,
    };
    let refused_at_once =
        |what: &str, outcome: Result<tonic::Response<_>, tonic::Status>| match outcome {
            Err(status)
                if status.code() == tonic::Code::FailedPrecondition
                    && status.metadata().get("lockcell-already-held").is_some() =>
            {
                Ok(())
            }
            Err(status) => Err(anyhow::anyhow!("{what}: refused otherwise: {status:?}")),
            Ok(reply) => {
                let reply: lockcell_proto::v1::AcquireResponse = reply.into_inner();
                Err(anyhow::anyhow!("{what}: answered {reply:?}, not refused"))
            }
        };
    for (held, asked) in [
        (LockMode::Exclusive, LockMode::Shared),
        (LockMode::Shared, LockMode::Exclusive),
    ] {
        let lock = format!("fair/{held:?}");
        let first = locks
            .acquire(request(&lock, held, "c1", 0))
            .await?
            .into_inner();
        ensure!(first.granted, "{lock}: not granted");
        let started = std::time::Instant::now();
        let again = locks.acquire(request(&lock, asked, "c2", 5_000)).await;
        refused_at_once(&format!("{lock}: a {asked:?} call"), again)?;
        ensure!(
            started.elapsed() < Duration::from_secs(4),
            "{lock}: the refusal waited out the call's wait"
        );
        let same = locks.acquire(request(&lock, asked, "c1", 0)).await;
        refused_at_once(&format!("{lock}: the holding call in the other mode"), same)?;
    }

    // Arbitrated: another session waits in the proxy's line for the held lock.
    let held = locks
        .acquire(request("arb/x", LockMode::Exclusive, "c1", 0))
        .await?
        .into_inner();
    ensure!(held.granted, "arb/x not granted");
    let other = sessions.open(opening("waiter")).await?.into_inner();
    let mut waiting = locks.clone();
    let waiter = tokio::spawn(async move {
        waiting
            .acquire(AcquireRequest {
                session_id: other.session_id,
                session_secret: other.session_secret.clone(),
                lock: "arb/x".into(),
                wait_timeout_ms: Some(15_000),
                mode: 0,
                call_id: "w".into(),
                withdraw: false,
            })
            .await
    });
    eventually(
        "the other session waits",
        Duration::from_secs(10),
        || async { Ok((proxies[0].metric("lockcell_waiters").await? >= 1.0).then_some(())) },
    )
    .await?;
    let started = std::time::Instant::now();
    let again = locks
        .acquire(request("arb/x", LockMode::Exclusive, "c2", 5_000))
        .await;
    refused_at_once("arb/x: a second call while another waits", again)?;
    ensure!(
        started.elapsed() < Duration::from_secs(4),
        "arb/x: the refusal waited out the call's wait"
    );
    let retried = locks
        .acquire(request("arb/x", LockMode::Exclusive, "c1", 5_000))
        .await?
        .into_inner();
    ensure!(
        retried.granted && retried.token == held.token,
        "arb/x: the holding call retried got {retried:?}"
    );
    waiter.abort();
    Ok(())
}

/// A session resumes naming another session's exclusive grant (its revision is public;
/// say the lease was guessed): the key must not move, and closing the resuming session
/// must leave the other's hold alone.
pub async fn a_resume_naming_another_sessions_grant_moves_nothing() -> anyhow::Result<()> {
    use lockcell_proto::v1::{HeldKey, HeldKind, ResumeRequest};
    let (etcd, proxies) = cell(&["a", "b"]).await?;
    let mut store = etcd.client().await?;
    let (mut sessions_a, mut locks_a) = raw(&proxies[0]).await?;
    let (_victim, token) = victim_holding(&mut sessions_a, &mut locks_a, "jobs/nightly").await?;
    let key = store.get("/l/jobs/nightly/!x", None).await?;
    let victim_lease = key.kvs().first().context("no holder key")?.lease();

    let (mut sessions_b, mut locks_b) = raw(&proxies[1]).await?;
    let attacker = sessions_b.open(opening("attacker")).await?.into_inner();
    let resumed = sessions_b
        .resume(ResumeRequest {
            session_id: attacker.session_id.clone(),
            session_secret: attacker.session_secret.clone(),
            ttl_ms: 20_000,
            identity: "attacker".into(),
            from_lease_id: attacker.lease_id,
            keys: vec![HeldKey {
                kind: HeldKind::Exclusive as i32,
                name: "jobs/nightly".into(),
                revision: token.revision,
                lease_id: victim_lease,
                mod_revision: 0,
            }],
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        resumed.lost.len() == 1,
        "the resume did not report the other's key lost: {resumed:?}"
    );
    ensure!(
        !format!("{resumed:?}").contains(&format!("{victim_lease:x}")),
        "the resume's reply shows the other session's lease"
    );
    sessions_b
        .close(CloseRequest {
            session_id: attacker.session_id.clone(),
            session_secret: attacker.session_secret.clone(),
            ..Default::default()
        })
        .await?;
    let key = store.get("/l/jobs/nightly/!x", None).await?;
    let kv = key.kvs().first().context("the victim's hold was deleted")?;
    ensure!(
        kv.create_revision() == token.revision && kv.lease() == victim_lease,
        "the victim's hold was moved"
    );
    let third = sessions_b.open(opening("third")).await?.into_inner();
    let taken = locks_b
        .acquire(AcquireRequest {
            session_id: third.session_id,
            session_secret: third.session_secret.clone(),
            lock: "jobs/nightly".into(),
            wait_timeout_ms: Some(0),
            mode: 0,
            call_id: "t".into(),
            withdraw: false,
        })
        .await?
        .into_inner();
    ensure!(
        !taken.granted,
        "a third session was granted the victim's lock"
    );
    Ok(())
}

/// Sessions of one proxy share its leases (here one), and a grant's token is public
/// (CheckSequencer shows it): another session of the same lease must neither release
/// the grant with it, nor take it over by resuming a session that names it, even onto
/// the very lease the grant is on.
pub async fn another_session_on_the_same_lease_can_neither_release_nor_take_a_grant(
) -> anyhow::Result<()> {
    use lockcell_proto::v1::{HeldKey, HeldKind, ResumeRequest};
    let etcd = EtcdCluster::start(1).await?;
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.leases = 1;
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    let mut store = etcd.client().await?;
    let (mut sessions, mut locks) = raw(&proxy).await?;
    let (victim, token) = victim_holding(&mut sessions, &mut locks, "jobs/shared-lease").await?;
    let attacker = sessions.open(opening("attacker")).await?.into_inner();
    ensure!(
        attacker.lease_id == victim.lease_id,
        "the two sessions are on different leases"
    );
    let released = locks
        .release(ReleaseRequest {
            session_id: attacker.session_id.clone(),
            session_secret: attacker.session_secret.clone(),
            lock: "jobs/shared-lease".into(),
            token: Some(token),
            mode: 0,
        })
        .await?
        .into_inner();
    ensure!(
        !released.released,
        "another session released the grant with its public token"
    );
    // A session of another proxy resumed here, onto the grant's lease, naming it.
    let other = ProxyProcess::start(&ProxyOptions::new("b", etcd.endpoints()), &etcd.dir).await?;
    let (mut elsewhere, _) = raw(&other).await?;
    let mover = elsewhere.open(opening("mover")).await?.into_inner();
    let naming = |session_id: &str, session_secret: &str| ResumeRequest {
        session_id: session_id.to_owned(),
        session_secret: session_secret.to_owned(),
        ttl_ms: 20_000,
        identity: "attacker".into(),
        from_lease_id: victim.lease_id,
        keys: vec![HeldKey {
            kind: HeldKind::Exclusive as i32,
            name: "jobs/shared-lease".into(),
            revision: token.revision,
            lease_id: victim.lease_id,
            mod_revision: 0,
        }],
        ..Default::default()
    };
    let resumed = sessions
        .resume(naming(&mover.session_id, &mover.session_secret))
        .await?
        .into_inner();
    ensure!(
        resumed.lease_id == victim.lease_id,
        "the resume did not land on the grant's lease"
    );
    ensure!(
        resumed.lost.len() == 1,
        "the resume did not report the other's key lost: {resumed:?}"
    );
    // A made-up session id, with a made-up secret, is no session at all.
    let refused = sessions
        .resume(naming(&format!("{:032x}", 0xfeed_u128), "00"))
        .await
        .expect_err("a made-up session id was resumed");
    ensure!(
        refused.code() == tonic::Code::PermissionDenied,
        "{refused:?}"
    );
    sessions
        .close(CloseRequest {
            session_id: mover.session_id.clone(),
            session_secret: mover.session_secret.clone(),
            ..Default::default()
        })
        .await?;
    let key = store.get("/l/jobs/shared-lease/!x", None).await?;
    let kv = key.kvs().first().context("the victim's hold was deleted")?;
    ensure!(
        kv.create_revision() == token.revision,
        "the victim's hold changed"
    );
    Ok(())
}

/// A raw Open of a 20 s session labelled `identity`.
/// A session named "victim" that holds `lock` (call "v1"), and its grant's token.
async fn victim_holding(
    sessions: &mut lockcell_proto::v1::session_client::SessionClient<tonic::transport::Channel>,
    locks: &mut lockcell_proto::v1::lock_client::LockClient<tonic::transport::Channel>,
    lock: &str,
) -> anyhow::Result<(
    lockcell_proto::v1::OpenResponse,
    lockcell_proto::v1::FencingToken,
)> {
    let victim = sessions.open(opening("victim")).await?.into_inner();
    let granted = locks
        .acquire(AcquireRequest {
            session_id: victim.session_id.clone(),
            session_secret: victim.session_secret.clone(),
            lock: lock.into(),
            wait_timeout_ms: Some(0),
            mode: 0,
            call_id: "v1".into(),
            withdraw: false,
        })
        .await?
        .into_inner();
    let token = granted.token.context("no token")?;
    Ok((victim, token))
}

fn opening(identity: &str) -> OpenRequest {
    OpenRequest {
        ttl_ms: 20_000,
        identity: identity.into(),
    }
}

/// Eight acquires of one free lock by one session at once, each a call of its own:
/// exactly one is granted; the others are refused as second holds or not granted, and
/// etcd holds one key for the lock.
pub async fn concurrent_calls_of_one_session_make_one_grant() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let (mut sessions, locks) = raw(&proxies[0]).await?;
    let s = sessions.open(opening("racer")).await?.into_inner();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..8 {
        let mut locks = locks.clone();
        let request = AcquireRequest {
            session_id: s.session_id.clone(),
            session_secret: s.session_secret.clone(),
            lock: "race/one".into(),
            wait_timeout_ms: Some(1_000),
            mode: 0,
            call_id: format!("c{i}"),
            withdraw: false,
        };
        calls.spawn(async move { locks.acquire(request).await });
    }
    let mut tokens = Vec::new();
    while let Some(outcome) = calls.join_next().await {
        match outcome? {
            Ok(reply) if reply.get_ref().granted => tokens.push(reply.into_inner().token),
            Ok(_) => {}
            Err(status) if status.metadata().get("lockcell-already-held").is_some() => {}
            Err(status) => bail!("a concurrent call failed otherwise: {status:?}"),
        }
    }
    ensure!(
        tokens.len() == 1,
        "{} of 8 concurrent calls were granted",
        tokens.len()
    );
    let mut store = etcd.client().await?;
    let held = holder_revision(&mut store, "race/one").await?;
    ensure!(
        held == tokens[0].map(|t| t.revision),
        "etcd's holder {held:?} is not the one grant {:?}",
        tokens[0]
    );
    Ok(())
}

/// What an acquire gave, in a few words.
fn outcome<T: Tokened>(result: &Result<Option<T>, Error>) -> String {
    match result {
        Ok(Some(held)) => format!("a grant with token {}", held.token()),
        Ok(None) => "no grant".to_owned(),
        Err(e) => format!("error: {e}"),
    }
}

/// Whatever carries a fencing token.
trait Tokened {
    fn token(&self) -> FencingToken;
}

impl Tokened for lockcell_client::LockGuard {
    fn token(&self) -> FencingToken {
        lockcell_client::LockGuard::token(self)
    }
}

impl Tokened for FencingToken {
    fn token(&self) -> FencingToken {
        *self
    }
}

/// The create revision of `lock`'s exclusive holder key, if it has one.
async fn holder_revision(
    store: &mut etcd_client::Client,
    lock: &str,
) -> anyhow::Result<Option<i64>> {
    let resp = store.get(format!("/l/{lock}/!x"), None).await?;
    Ok(resp.kvs().first().map(|kv| kv.create_revision()))
}

/// A fair lock held through one proxy (`fast`, reaching etcd directly) while a waiter
/// will ask through another (`slow`, through a link the test can stall).
struct FairLine {
    etcd: EtcdCluster,
    link: Relay,
    slow: ProxyProcess,
    fast: Client,
    _fast_proxy: ProxyProcess,
    held: lockcell_client::LockGuard,
    /// Keeps the holder's session open.
    _holder: lockcell_client::Session,
}

impl FairLine {
    async fn held(lock: &str) -> anyhow::Result<FairLine> {
        let (etcd, link, slow) = proxy_through_link("a", Some(CLASSES)).await?;
        let mut options = ProxyOptions::new("b", etcd.endpoints());
        options.extra_args = vec![
            "--classes".into(),
            etcd.dir.join("classes.toml").to_string_lossy().into_owned(),
        ];
        let fast_proxy = ProxyProcess::start(&options, &etcd.dir).await?;
        let fast = Client::connect(&fast_proxy.url()).await?;
        let holder = fast
            .open_session(short_session(Duration::from_secs(20)))
            .await?;
        let held = holder
            .acquire(lock, Wait::Try)
            .await?
            .context("free lock not granted")?;
        Ok(FairLine {
            etcd,
            link,
            slow,
            fast,
            _fast_proxy: fast_proxy,
            held,
            _holder: holder,
        })
    }

    /// How many waiter keys stand in `lock`'s line.
    async fn in_line(&self, lock: &str) -> anyhow::Result<i64> {
        waiter_keys(&self.etcd, lock).await
    }

    /// The holder lets go, and a waiter coming after must be granted the lock, with no
    /// waiter key left in line: `what` says which waiter could have been in the way.
    async fn next_is_granted(self, lock: &str, what: &str) -> anyhow::Result<()> {
        let FairLine {
            etcd, fast, held, ..
        } = self;
        held.release().await?;
        let next = fast
            .open_session(short_session(Duration::from_secs(20)))
            .await?;
        let _guard = next
            .acquire(lock, Wait::Timeout(Duration::from_secs(10)))
            .await?
            .with_context(|| format!("a waiter behind {what} was not granted a free lock"))?;
        let left = waiter_keys(&etcd, lock).await?;
        ensure!(left == 0, "{left} waiter keys left in line");
        Ok(())
    }
}

/// How many waiter keys stand in `lock`'s line.
async fn waiter_keys(etcd: &EtcdCluster, lock: &str) -> anyhow::Result<i64> {
    let mut store = etcd.client().await?;
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    Ok(store
        .get(format!("/q/{lock}/"), Some(options))
        .await?
        .count())
}

/// A one-member etcd and a proxy of `zone` that reaches it through a relay the test
/// can stall, with a lease TTL long enough to ride out the stalls (the proxy's lease
/// renewals cross the same link). With `classes`, the proxy reads that classes file
/// (written to `classes.toml` in the cell's directory).
async fn proxy_through_link(
    zone: &str,
    classes: Option<&str>,
) -> anyhow::Result<(EtcdCluster, Relay, ProxyProcess)> {
    let etcd = EtcdCluster::start(1).await?;
    let link = Relay::start(&etcd.endpoints()[0]).await?;
    let mut options = ProxyOptions::new(zone, vec![link.addr.clone()]);
    options.lease_ttl = Duration::from_secs(30);
    if let Some(classes) = classes {
        let file = etcd.dir.join("classes.toml");
        std::fs::write(&file, classes)?;
        options.extra_args = vec!["--classes".into(), file.to_string_lossy().into_owned()];
    }
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    Ok((etcd, link, proxy))
}
