//! The SDK against the fake proxy: renewals over one shared stream, expiry, jeopardy
//! and recovery, locks (exclusive and shared), sequencer checks, and cleanup on drop.

mod fake;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fake::{start, Fake, PATIENCE};
use lockcell_client::{
    Client, Error, FencingToken, Mode, Sequencer, SessionOptions, SessionState, Wait,
};
use lockcell_proto::v1::LockMode;
use tokio::time::timeout;

fn opts(ttl_ms: u64) -> SessionOptions {
    SessionOptions {
        ttl: Duration::from_millis(ttl_ms),
        identity: "test/1".into(),
    }
}

/// Waits until session `id` has been renewed at least `n` times.
async fn renewed(fake: &Fake, id: &str, n: u64) {
    let mut rx = fake.renewals.subscribe();
    timeout(
        PATIENCE,
        rx.wait_for(|m| m.get(id).copied().unwrap_or(0) >= n),
    )
    .await
    .unwrap_or_else(|_| panic!("session {id} was not renewed {n} times"))
    .unwrap();
}

#[tokio::test]
async fn sessions_share_one_stream_and_stay_valid_past_their_ttl() {
    let proxy = start(300).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let sessions = [
        client.open_session(opts(300)).await.unwrap(),
        client.open_session(opts(300)).await.unwrap(),
        client.clone().open_session(opts(300)).await.unwrap(),
    ];
    for s in &sessions {
        assert_eq!(s.ttl(), Duration::from_millis(300));
        renewed(&proxy.fake, s.id(), 5).await; // ≥ 5 × 100 ms: well past the TTL
    }
    for s in &sessions {
        assert_eq!(s.state(), SessionState::Valid, "{}", s.id());
        assert!(s.deadline() > tokio::time::Instant::now());
    }
    assert_eq!(*proxy.fake.streams_opened.borrow(), 1);
}

#[tokio::test]
async fn an_expired_reply_expires_the_session() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let session = client.open_session(opts(600)).await.unwrap();
    proxy
        .fake
        .killed
        .lock()
        .unwrap()
        .push(session.id().to_owned());
    timeout(PATIENCE, session.jeopardy())
        .await
        .expect("jeopardy");
    assert_eq!(session.state(), SessionState::Expired);
    assert!(session
        .expired_reason()
        .unwrap()
        .contains("killed by the test"));
    let err = session.acquire("a", Wait::Try).await.expect_err("refused");
    assert!(
        matches!(err, Error::SessionExpired { ref session } if !session.is_empty()),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_silent_proxy_puts_the_session_in_jeopardy_and_recovery_ends_it() {
    let proxy = start(400).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let session = client.open_session(opts(400)).await.unwrap();
    renewed(&proxy.fake, session.id(), 2).await;
    proxy.fake.mute.store(true, Ordering::Relaxed);
    timeout(PATIENCE, session.jeopardy())
        .await
        .expect("jeopardy while unanswered");
    assert_eq!(
        session.state(),
        SessionState::Jeopardy,
        "not expired: nobody said so"
    );
    // Unanswered renewals mark the stream as stuck: the client opens another.
    let mut streams = proxy.fake.streams_opened.subscribe();
    timeout(PATIENCE, streams.wait_for(|n| *n >= 2))
        .await
        .expect("stream replaced")
        .unwrap();
    proxy.fake.mute.store(false, Ordering::Relaxed);
    let mut renewals = proxy.fake.renewals.subscribe();
    timeout(PATIENCE, async {
        while session.state() != SessionState::Valid {
            renewals.changed().await.unwrap();
        }
    })
    .await
    .expect("valid again");
}

#[tokio::test]
async fn locks_are_granted_refused_and_released() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts(5_000)).await.unwrap();
    let b = client.open_session(opts(5_000)).await.unwrap();

    let guard = a
        .acquire("jobs/nightly", Wait::Timeout(Duration::from_secs(1)))
        .await
        .unwrap()
        .expect("granted");
    assert_eq!(guard.lock(), "jobs/nightly");
    assert_eq!(guard.token().to_string(), "1:100");
    assert!(guard.is_valid());
    assert!(b
        .acquire("jobs/nightly", Wait::Try)
        .await
        .unwrap()
        .is_none());

    match b.acquire("bad name", Wait::Try).await {
        Err(Error::InvalidArgument(message)) => assert!(message.contains("bad name"), "{message}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }

    assert!(guard.release().await.unwrap());
    let again = b
        .acquire("jobs/nightly", Wait::Try)
        .await
        .unwrap()
        .expect("free now");
    assert!(
        again.token()
            > lockcell_client::FencingToken {
                epoch: 1,
                revision: 100
            }
    );

    // A dropped guard is released in the background.
    let mut released = proxy.fake.released.subscribe();
    drop(again);
    timeout(PATIENCE, released.wait_for(|r| r.len() == 2))
        .await
        .expect("released")
        .unwrap();

    assert_eq!(a.close().await.unwrap(), 0);
}

#[tokio::test]
async fn shared_holders_coexist_and_keep_an_exclusive_holder_out() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts(5_000)).await.unwrap();
    let b = client.open_session(opts(5_000)).await.unwrap();
    let c = client.open_session(opts(5_000)).await.unwrap();

    let ra = a
        .acquire_shared("cfg", Wait::Try)
        .await
        .unwrap()
        .expect("granted");
    let rb = b
        .acquire_shared("cfg", Wait::Try)
        .await
        .unwrap()
        .expect("granted alongside");
    assert_eq!((ra.mode(), rb.mode()), (Mode::Shared, Mode::Shared));
    assert!(c.acquire("cfg", Wait::Try).await.unwrap().is_none());

    assert!(ra.release().await.unwrap());
    assert!(rb.release().await.unwrap());
    assert_eq!(
        proxy.fake.release_modes.lock().unwrap().as_slice(),
        [LockMode::Shared, LockMode::Shared],
        "a release says which mode it releases"
    );
    let w = c
        .acquire("cfg", Wait::Try)
        .await
        .unwrap()
        .expect("free now");
    assert_eq!(w.mode(), Mode::Exclusive);
    assert!(a.acquire_shared("cfg", Wait::Try).await.unwrap().is_none());
    assert!(w.release().await.unwrap());
    assert_eq!(
        proxy.fake.release_modes.lock().unwrap().last(),
        Some(&LockMode::Exclusive)
    );
}

#[tokio::test]
async fn sequencer_checks_tell_the_current_grant_from_stale_ones() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts(5_000)).await.unwrap();
    let guard = a
        .acquire("jobs/x", Wait::Try)
        .await
        .unwrap()
        .expect("granted");
    let token = guard.token();
    assert_eq!(
        client.check_sequencer("jobs/x", token).await.unwrap(),
        Sequencer {
            current: true,
            holder: Some(token)
        }
    );
    let older = FencingToken {
        revision: token.revision - 1,
        ..token
    };
    assert_eq!(
        client.check_sequencer("jobs/x", older).await.unwrap(),
        Sequencer {
            current: false,
            holder: Some(token)
        }
    );
    assert!(guard.release().await.unwrap());
    assert_eq!(
        client.check_sequencer("jobs/x", token).await.unwrap(),
        Sequencer {
            current: false,
            holder: None
        }
    );
}

#[tokio::test]
async fn dropping_the_last_handle_stops_renewals_and_closes() {
    let proxy = start(300).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let dropped = client.open_session(opts(300)).await.unwrap();
    let id = dropped.id().to_owned();
    let guard = dropped
        .acquire("x", Wait::Try)
        .await
        .unwrap()
        .expect("granted");
    renewed(&proxy.fake, &id, 2).await;

    let mut closed = proxy.fake.closed.subscribe();
    drop(dropped);
    // The guard still holds the session: it is renewed on.
    let now = proxy.fake.renewals.borrow()[&id];
    renewed(&proxy.fake, &id, now + 2).await;
    assert!(closed.borrow().is_empty());

    drop(guard);
    timeout(PATIENCE, closed.wait_for(|c| c.contains(&id)))
        .await
        .expect("closed")
        .unwrap();
    assert_eq!(
        proxy.fake.released.borrow().as_slice(),
        ["x"],
        "released before the close"
    );

    // Renewals stopped: another session gets several while the dropped one gets at
    // most the one that may have been in flight.
    let at_close = proxy.fake.renewals.borrow()[&id];
    let other = client.open_session(opts(300)).await.unwrap();
    renewed(&proxy.fake, other.id(), 4).await;
    assert!(proxy.fake.renewals.borrow()[&id] <= at_close + 1);
}

#[tokio::test]
async fn an_unreachable_proxy_is_a_connect_error() {
    let proxy = start(1_000).await;
    let addr = proxy.addr.clone();
    drop(proxy);
    // Wait until the port refuses, without sleeping blindly.
    let err = timeout(PATIENCE, async {
        loop {
            if let Err(e) = Client::connect(&addr).await {
                return e;
            }
        }
    })
    .await
    .expect("refused");
    assert!(
        matches!(err, Error::Connect { addr: ref a, .. } if *a == addr),
        "{err:?}"
    );
    assert!(err.to_string().contains(&addr));
}
