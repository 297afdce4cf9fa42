//! Lock classes in force: shared and exclusive holds, the rules a class sets, a fair
//! writer among readers, lock-delay, and a bad classes file refused.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Error, Wait};
use lockcell_proto::v1::{AcquireRequest, AcquireResponse, LockMode, OpenRequest};
use lockcell_tests::eventually;
use tonic::Code;

use crate::contention::{classed_cell, connect_all, CLASSES};
use crate::support::{raw, short_session};

pub async fn readers_share_and_a_writer_excludes_them() -> anyhow::Result<()> {
    let (_etcd, proxies, _) = classed_cell(CLASSES).await?;
    let clients = connect_all(&proxies).await?;
    let mut readers = Vec::new();
    for c in &clients {
        let s = c
            .open_session(short_session(Duration::from_secs(10)))
            .await?;
        let g = s
            .acquire_shared("rw", Wait::Try)
            .await?
            .context("a reader was refused while only readers hold")?;
        readers.push((s, g));
    }
    let writer = clients[0]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    ensure!(
        writer.acquire("rw", Wait::Try).await?.is_none(),
        "a writer got in beside readers"
    );
    let waiting = tokio::spawn({
        let writer = writer.clone();
        async move {
            writer
                .acquire("rw", Wait::Timeout(Duration::from_secs(30)))
                .await
        }
    });
    let mut tokens = Vec::new();
    for (s, g) in readers {
        tokens.push(g.token());
        g.release().await?;
        drop(s);
    }
    let held = waiting
        .await??
        .context("the writer never got in after the readers left")?;
    ensure!(
        tokens.iter().all(|t| *t < held.token()),
        "the writer's token is not above the readers'"
    );
    let late = clients[1]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    ensure!(
        late.acquire_shared("rw", Wait::Try).await?.is_none(),
        "a reader got in beside a writer"
    );
    held.release().await?;
    ensure!(late.acquire_shared("rw", Wait::Try).await?.is_some());
    Ok(())
}

pub async fn a_fair_writer_is_not_starved_by_new_readers() -> anyhow::Result<()> {
    let (_etcd, proxies, _) = classed_cell(CLASSES).await?;
    let clients = connect_all(&proxies).await?;
    let first = clients[0]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let reading = first
        .acquire_shared("fair/rw", Wait::Try)
        .await?
        .context("first reader refused")?;
    let writer = clients[1]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let writing = tokio::spawn({
        let writer = writer.clone();
        async move {
            writer
                .acquire("fair/rw", Wait::Timeout(Duration::from_secs(30)))
                .await
        }
    });
    // Readers keep arriving after the writer: none may pass it.
    let mut late_readers = Vec::new();
    for (i, c) in clients.iter().cycle().take(6).enumerate() {
        let s = c
            .open_session(short_session(Duration::from_secs(10)))
            .await?;
        if i == 0 {
            // The writer is in line once a later reader's try is refused.
            eventually("the writer is in line", Duration::from_secs(10), || {
                let s = s.clone();
                async move {
                    Ok(s.acquire_shared("fair/rw", Wait::Try)
                        .await?
                        .is_none()
                        .then_some(()))
                }
            })
            .await?;
        } else {
            ensure!(
                s.acquire_shared("fair/rw", Wait::Try).await?.is_none(),
                "reader {i} passed the waiting writer"
            );
        }
        let waiting = tokio::spawn({
            let s = s.clone();
            async move {
                s.acquire_shared("fair/rw", Wait::Timeout(Duration::from_secs(30)))
                    .await
            }
        });
        late_readers.push((s, waiting));
    }
    reading.release().await?;
    let written = writing.await??.context("the fair writer was starved")?;
    let writer_token = written.token();
    written.release().await?;
    for (_, waiting) in late_readers {
        let g = waiting.await??.context("a late reader never got in")?;
        ensure!(
            g.token() > writer_token,
            "a reader that came after the writer was served before it"
        );
    }
    Ok(())
}

pub async fn class_rules_refuse_a_mode_and_a_ttl() -> anyhow::Result<()> {
    let (_etcd, proxies, _) = classed_cell(CLASSES).await?;
    let (mut sessions, mut locks) = raw(&proxies[0]).await?;
    let session = sessions
        .open(OpenRequest {
            ttl_ms: 10_000,
            identity: "rules".into(),
        })
        .await?
        .into_inner();
    let shared = locks
        .acquire(AcquireRequest {
            session_id: session.session_id.clone(),
            session_secret: session.session_secret.clone(),
            lock: "x-only/a".into(),
            wait_timeout_ms: Some(0),
            mode: LockMode::Shared as i32,
            call_id: String::new(),
            withdraw: false,
        })
        .await
        .expect_err("a shared hold on an exclusive-only class was granted");
    ensure!(shared.code() == Code::InvalidArgument, "{shared:?}");
    ensure!(
        shared.message().contains("x-only/a") && shared.message().contains("exclusive-only"),
        "{shared:?}"
    );
    let short = sessions
        .open(OpenRequest {
            ttl_ms: 2_000,
            identity: "short".into(),
        })
        .await?
        .into_inner();
    let ttl = locks
        .acquire(AcquireRequest {
            session_id: short.session_id.clone(),
            session_secret: short.session_secret.clone(),
            lock: "x-only/a".into(),
            wait_timeout_ms: Some(0),
            mode: LockMode::Exclusive as i32,
            call_id: String::new(),
            withdraw: false,
        })
        .await
        .expect_err("a session TTL outside the class bounds was accepted");
    ensure!(
        ttl.code() == Code::FailedPrecondition && ttl.message().contains("outside"),
        "{ttl:?}"
    );
    Ok(())
}

pub async fn a_bad_classes_file_is_refused_and_the_last_good_one_stays() -> anyhow::Result<()> {
    let (_etcd, proxies, file) = classed_cell(CLASSES).await?;
    let client = lockcell_client::Client::connect(&proxies[0].url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let refused = |r: Result<Option<lockcell_client::LockGuard>, Error>| {
        matches!(r, Err(Error::InvalidArgument(_)))
    };
    ensure!(
        refused(session.acquire_shared("x-only/b", Wait::Try).await),
        "shared allowed before the change"
    );

    std::fs::write(&file, "[[class]]\nname = \"broken\"\nprefix = \n")?;
    eventually(
        "the proxy refuses the bad file",
        Duration::from_secs(20),
        || async {
            Ok((proxies[0]
                .metric("lockcell_classes_reload_failures_total")
                .await?
                >= 1.0)
                .then_some(()))
        },
    )
    .await?;
    ensure!(
        refused(session.acquire_shared("x-only/b", Wait::Try).await),
        "the previous classes are not in force"
    );
    ensure!(
        session.acquire("x-only/b", Wait::Try).await?.is_some(),
        "exclusive stopped working"
    );
    let log = std::fs::read_to_string(proxies[0].log_path())?;
    let named = log
        .match_indices("classes.toml:")
        .any(|(at, m)| log[at + m.len()..].starts_with(|c: char| c.is_ascii_digit()));
    ensure!(named, "the refusal does not name the file and line:\n{log}");

    std::fs::write(
        &file,
        CLASSES.replace(
            "modes = [\"exclusive\"]",
            "modes = [\"exclusive\", \"shared\"]",
        ),
    )?;
    eventually("the good file is in force", Duration::from_secs(20), || {
        let session = session.clone();
        async move {
            Ok(session
                .acquire_shared("x-only/c", Wait::Try)
                .await
                .ok()
                .flatten()
                .map(|_held| ()))
        }
    })
    .await?;
    Ok(())
}

pub async fn lock_delay_holds_back_a_vanished_holders_lock_but_not_a_released_one(
) -> anyhow::Result<()> {
    let (etcd, proxies, _) = classed_cell(CLASSES).await?;
    let clients = connect_all(&proxies).await?;
    // A clean release lets the next in at once.
    let a = clients[0]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let b = clients[1]
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    // A proxy that just started counts every delayed lock as vanished at its start.
    let g = a
        .acquire("delayed/clean", Wait::Timeout(Duration::from_secs(15)))
        .await?
        .context("free lock refused after the lock-delay")?;
    g.release().await?;
    let _next = eventually(
        "a cleanly released delayed lock is free at once",
        Duration::from_secs(3),
        || {
            let b = b.clone();
            async move { Ok(b.acquire("delayed/clean", Wait::Try).await?) }
        },
    )
    .await?;

    // A holder whose session expires (raw, never renewed) vanishes uncleanly.
    let raw = raw(&proxies[0]).await?;
    let (_, grant) = silent_holder(raw, "delayed/vanish").await?;
    ensure!(grant.granted);
    // Wait until the key is gone, then the lock must still be refused for a while.
    let store = etcd.client().await?;
    eventually("the expired holder's key is deleted", Duration::from_secs(10), || {
        let mut etcd = store.clone();
        async move { Ok((etcd.get("/l/delayed/vanish/!x", None).await?.count() == 0).then_some(())) }
    })
    .await?;
    ensure!(
        b.acquire("delayed/vanish", Wait::Try).await?.is_none(),
        "granted at once although its holder vanished"
    );
    let later = b
        .acquire("delayed/vanish", Wait::Timeout(Duration::from_secs(30)))
        .await?
        .context("never granted after the lock-delay")?;
    ensure!(later.token().revision > grant.token.context("token")?.revision);
    Ok(())
}

/// A session of 1 s that is never renewed, opened through `raw`, tries `lock`: when
/// the try was sent, and its answer. Granted, the holder vanishes uncleanly.
async fn silent_holder(
    (mut sessions, mut locks): Raw,
    lock: &str,
) -> anyhow::Result<(tokio::time::Instant, AcquireResponse)> {
    let silent = sessions
        .open(OpenRequest {
            ttl_ms: 1_000,
            identity: "silent".into(),
        })
        .await?
        .into_inner();
    let sent = tokio::time::Instant::now();
    let grant = locks
        .acquire(AcquireRequest {
            session_id: silent.session_id,
            session_secret: silent.session_secret,
            lock: lock.into(),
            wait_timeout_ms: Some(0),
            mode: LockMode::Exclusive as i32,
            call_id: String::new(),
            withdraw: false,
        })
        .await?
        .into_inner();
    Ok((sent, grant))
}

type Raw = (
    lockcell_proto::v1::session_client::SessionClient<tonic::transport::Channel>,
    lockcell_proto::v1::lock_client::LockClient<tonic::transport::Channel>,
);

/// Tries that spin on a delayed lock while its holder's session expires, on the
/// holder's own proxy, never get it inside the lock-delay: not even a try that lands
/// between the holder key's delete and the proxy's sight of it. Each grant comes at
/// least the delay after the end of the vanished holder's validity, and a clean release
/// afterwards lets the next in at once.
pub async fn tries_racing_a_holders_expiry_wait_out_the_lock_delay() -> anyhow::Result<()> {
    const DELAY: Duration = Duration::from_secs(4);
    const SPINNERS: usize = 4;
    let (_etcd, proxies, _) = classed_cell(CLASSES).await?;
    let clients = connect_all(&proxies).await?;
    let raw = raw(&proxies[0]).await?;
    let mut contenders = Vec::new();
    for _ in 0..SPINNERS {
        contenders.push(
            clients[0]
                .open_session(short_session(Duration::from_secs(30)))
                .await?,
        );
    }
    // A proxy that just started counts every delayed lock as vanished at its start.
    let warm = contenders[0]
        .acquire("delayed/warm", Wait::Timeout(Duration::from_secs(15)))
        .await?
        .context("free lock refused after the start's lock-delay")?;
    warm.release().await?;

    for round in 0..6 {
        let lock = format!("delayed/race-{round}");
        let (sent, grant) = silent_holder(raw.clone(), &lock).await?;
        ensure!(
            grant.granted,
            "round {round}: the silent holder got no grant"
        );
        // The holder may act until here, never renews, and its session then expires.
        let holder_deadline = sent + Duration::from_millis(grant.valid_for_ms);
        // Every spinner tries without pause until one is granted.
        let won = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut spins = tokio::task::JoinSet::new();
        for contender in &contenders {
            let (contender, lock, won) = (contender.clone(), lock.clone(), won.clone());
            spins.spawn(async move {
                while !won.load(std::sync::atomic::Ordering::SeqCst) {
                    if let Some(held) = contender.acquire(&lock, Wait::Try).await? {
                        won.store(true, std::sync::atomic::Ordering::SeqCst);
                        return anyhow::Ok(Some((tokio::time::Instant::now(), held)));
                    }
                    ensure!(
                        sent.elapsed() < Duration::from_secs(30),
                        "round {round}: never granted after the lock-delay"
                    );
                }
                Ok(None)
            });
        }
        let mut granted = Vec::new();
        while let Some(spun) = spins.join_next().await {
            granted.extend(spun??);
        }
        ensure!(
            granted.len() == 1,
            "round {round}: {} spinners were granted",
            granted.len()
        );
        let (at, _) = &granted[0];
        ensure!(
            *at >= holder_deadline + DELAY,
            "round {round}: granted {:?} after the vanished holder's validity ended, inside the {DELAY:?} lock-delay",
            at.saturating_duration_since(holder_deadline)
        );
        for (_, held) in granted {
            held.release().await?;
        }
        ensure!(
            contenders[0].acquire(&lock, Wait::Try).await?.is_some(),
            "round {round}: a clean release was followed by a delay"
        );
    }
    Ok(())
}
