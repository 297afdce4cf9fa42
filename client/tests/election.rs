//! Elections through the SDK against the fake proxy: campaigning, leader queries,
//! proclaim and resign, a superseded leader, observing, and the timing rule for
//! Campaign replies.

mod fake;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fake::{start, Cut, PATIENCE};
use lockcell_client::{
    Client, Error, LeaderInfo, LeaderStream, SessionOptions, SessionState, Wait,
};
use tokio::time::{timeout, Instant};

fn opts(identity: &str) -> SessionOptions {
    SessionOptions {
        ttl: Duration::from_secs(5),
        identity: identity.into(),
    }
}

/// The next leader the stream reports (`None`: nobody leads).
async fn next(leaders: &mut LeaderStream) -> Option<LeaderInfo> {
    timeout(PATIENCE, leaders.next())
        .await
        .expect("a report")
        .expect("the stream goes on")
        .expect("a leader or none")
}

#[tokio::test]
async fn one_session_leads_and_the_next_takes_over_when_it_resigns() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts("a/1")).await.unwrap();
    let b = client.open_session(opts("b/2")).await.unwrap();
    assert_eq!(client.leader("db").await.unwrap(), None);

    let lead = a
        .campaign("db", "10.0.0.1", Wait::Forever)
        .await
        .unwrap()
        .expect("elected");
    assert_eq!(lead.election(), "db");
    assert_eq!(lead.session().id(), a.id());
    assert!(lead.is_valid());
    assert_eq!(
        client.leader("db").await.unwrap(),
        Some(LeaderInfo {
            session_id: a.id().to_owned(),
            identity: "a/1".into(),
            proxy_id: "fake".into(),
            value: "10.0.0.1".into(),
            token: lead.token(),
        })
    );
    assert!(b
        .campaign("db", "10.0.0.2", Wait::Try)
        .await
        .unwrap()
        .is_none());
    let waiting = tokio::spawn({
        let b = b.clone();
        async move { b.campaign("db", "10.0.0.2", Wait::Timeout(PATIENCE)).await }
    });

    lead.proclaim("10.0.0.9").await.unwrap();
    assert_eq!(
        client.leader("db").await.unwrap().unwrap().value,
        "10.0.0.9"
    );
    let first = lead.token();
    assert!(lead.resign().await.unwrap());

    let next = timeout(PATIENCE, waiting)
        .await
        .expect("b's campaign ended")
        .unwrap()
        .unwrap()
        .expect("b elected");
    assert!(next.token() > first);
    let leader = client.leader("db").await.unwrap().unwrap();
    assert_eq!(
        (leader.session_id.as_str(), leader.value.as_str()),
        (b.id(), "10.0.0.2")
    );

    // A dropped leadership resigns in the background.
    let mut resigned = proxy.fake.resigned.subscribe();
    drop(next);
    timeout(PATIENCE, resigned.wait_for(|r| r.len() == 2))
        .await
        .expect("resigned")
        .unwrap();
    assert_eq!(client.leader("db").await.unwrap(), None);
}

#[tokio::test]
async fn a_superseded_leader_gets_the_proxys_refusal_and_keeps_its_session() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts("a/1")).await.unwrap();
    let b = client.open_session(opts("b/2")).await.unwrap();
    let stale = a
        .campaign("db", "old", Wait::Try)
        .await
        .unwrap()
        .expect("elected");
    // The proxy hands leadership on behind a's back (as after a lost renewal).
    proxy.fake.leaders.send_modify(|l| {
        l.remove("db");
    });
    let _new = b
        .campaign("db", "new", Wait::Try)
        .await
        .unwrap()
        .expect("elected");
    match stale.proclaim("old again").await {
        Err(Error::NotHolder(message)) => {
            assert!(
                message.contains("not the leader of election \"db\""),
                "{message}"
            );
            assert!(message.contains(&stale.token().to_string()), "{message}");
        }
        other => panic!("expected NotHolder, got {other:?}"),
    }
    assert_eq!(
        a.state(),
        SessionState::Valid,
        "a stale grant is not a dead session"
    );
    assert!(!stale.resign().await.unwrap(), "nothing left to resign");
    assert_eq!(client.leader("db").await.unwrap().unwrap().value, "new");
}

#[tokio::test]
async fn a_campaign_reply_extends_the_deadline_from_when_it_was_sent() {
    let proxy = start(1_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let session = client.open_session(opts("a/1")).await.unwrap();
    // No renewal answers from here on: only the Campaign can move the deadline.
    proxy.fake.mute.store(true, Ordering::Relaxed);
    proxy.fake.valid_for_ms.store(60_000, Ordering::Relaxed);
    let before = Instant::now();
    let _lead = session
        .campaign("db", "v", Wait::Try)
        .await
        .unwrap()
        .expect("elected");
    let after = Instant::now();
    let deadline = session.deadline();
    assert!(deadline >= before + Duration::from_secs(60), "{deadline:?}");
    assert!(
        deadline <= after + Duration::from_secs(60),
        "counted from the send"
    );
}

#[tokio::test]
async fn observe_reports_the_leader_then_every_change_and_goes_on_after_a_break() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts("a/1")).await.unwrap();
    let mut leaders = client.observe("db").await.unwrap();
    assert_eq!(next(&mut leaders).await, None);

    let lead = a
        .campaign("db", "v1", Wait::Try)
        .await
        .unwrap()
        .expect("elected");
    let seen = next(&mut leaders).await.expect("a leads");
    assert_eq!((seen.value.as_str(), seen.token), ("v1", lead.token()));
    lead.proclaim("v2").await.unwrap();
    assert_eq!(next(&mut leaders).await.expect("a leads").value, "v2");

    // A break: observed again, the same leader is not reported twice, the next change is.
    let reported = tokio::spawn(async move {
        let next = next(&mut leaders).await;
        (leaders, next)
    });
    proxy.fake.cut_observers_once(Cut::WithError).await;
    assert!(lead.resign().await.unwrap());
    let (mut leaders, after) = timeout(PATIENCE, reported)
        .await
        .expect("a report")
        .unwrap();
    assert_eq!(after, None, "the change after the break, not v2 again");
    let again = a
        .campaign("db", "v3", Wait::Try)
        .await
        .unwrap()
        .expect("elected");
    assert_eq!(next(&mut leaders).await.expect("a leads").value, "v3");
    drop(again);
}

#[tokio::test]
async fn an_observation_the_proxy_ends_is_observed_again() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts("a/1")).await.unwrap();
    let mut leaders = client.observe("db").await.unwrap();
    assert_eq!(next(&mut leaders).await, None);
    proxy.fake.cut_observers_once(Cut::Cleanly).await;
    let lead = a
        .campaign("db", "v1", Wait::Try)
        .await
        .unwrap()
        .expect("elected");
    let seen = next(&mut leaders).await.expect("a leads");
    assert_eq!((seen.value.as_str(), seen.token), ("v1", lead.token()));
}

#[tokio::test]
async fn a_refused_election_name_is_invalid_argument() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let a = client.open_session(opts("a/1")).await.unwrap();
    match a.campaign("bad name", "v", Wait::Try).await {
        Err(Error::InvalidArgument(message)) => assert!(message.contains("bad name")),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(a.state(), SessionState::Valid);
}
