//! Watches and membership through the SDK against the fake proxy: resuming broken
//! streams with no gap and no duplicate, cut-offs, compaction, giving up, progress, and
//! following a group's members.

mod fake;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fake::{start, Fake, Running, WatchFault, PATIENCE};
use lockcell_client::{
    Client, Error, EventKind, MemberChange, Members, SessionOptions, WatchBatch, WatchOptions,
    Watcher,
};
use tokio::time::timeout;
use tonic::Code;

fn plan(fake: &Fake, faults: &[WatchFault]) {
    fake.watch_plan
        .lock()
        .unwrap()
        .extend(faults.iter().copied());
}

async fn next(watcher: &mut Watcher) -> Result<WatchBatch, Error> {
    timeout(PATIENCE, watcher.next())
        .await
        .expect("a batch")
        .expect("the watch goes on")
}

/// Reads batches until one reaches `revision`; returns every event as (revision, key,
/// value), in the order delivered.
async fn events_through(watcher: &mut Watcher, revision: i64) -> Vec<(i64, String, String)> {
    let mut seen = Vec::new();
    while watcher.revision() < revision {
        let batch = next(watcher).await.expect("no error");
        assert!(batch.revision <= revision, "{batch:?}");
        for e in batch.events {
            let value = String::from_utf8(e.entry.value).unwrap();
            seen.push((e.entry.mod_revision, e.entry.key, value));
        }
        assert_eq!(watcher.revision(), batch.revision);
    }
    seen
}

fn writes(keys: &[(i64, &str, &str)]) -> Vec<(i64, String, String)> {
    keys.iter()
        .map(|(r, k, v)| (*r, (*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn connect(proxy: &Running) -> Client {
    Client::connect(&proxy.addr).await.unwrap()
}

#[tokio::test]
async fn a_broken_stream_is_resumed_from_the_next_revision_and_nothing_is_seen_twice() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    plan(
        fake,
        &[
            // The first stream stops after two events, as a stopping proxy does...
            WatchFault::EndAfter {
                responses: 2,
                code: Code::Unavailable,
            },
            // ...the proxy is not back at once...
            WatchFault::Refuse(Code::Unavailable),
            WatchFault::Refuse(Code::Unavailable),
            // ...the next stream just ends after one event...
            WatchFault::EndAfter {
                responses: 1,
                code: Code::Ok,
            },
            // ...and the next one replays what was already delivered.
            WatchFault::Replay(3),
        ],
    );
    let client = connect(&proxy).await;
    let mut watcher = client.watch("cfg/", WatchOptions::prefix()).await.unwrap();
    assert_eq!(watcher.revision(), 0);
    assert_eq!(watcher.key(), "cfg/");
    fake.put("cfg/a", "1");
    fake.put("other", "x"); // not watched
    fake.put("cfg/b", "2");
    fake.put("cfg/a", "3");
    fake.put("cfg/c", "4");
    fake.delete("cfg/b");
    fake.put("cfg/a", "7");
    let seen = events_through(&mut watcher, 7).await;
    assert_eq!(
        seen,
        writes(&[
            (1, "cfg/a", "1"),
            (3, "cfg/b", "2"),
            (4, "cfg/a", "3"),
            (5, "cfg/c", "4"),
            (6, "cfg/b", ""),
            (7, "cfg/a", "7"),
        ])
    );
    // Each resumption started right after what had been delivered.
    assert_eq!(*fake.watch_starts.borrow(), [0, 4, 4, 4, 5]);
    // The replaying stream goes on as normal afterwards.
    fake.put("cfg/d", "8");
    let batch = next(&mut watcher).await.unwrap();
    assert_eq!(batch.revision, 8);
    assert_eq!(batch.events.len(), 1);
    assert_eq!(batch.events[0].kind, EventKind::Put);
}

#[tokio::test]
async fn a_cut_off_is_reported_once_and_the_next_call_resumes_where_the_proxy_said() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    plan(
        fake,
        &[WatchFault::EndAfter {
            responses: 2,
            code: Code::ResourceExhausted,
        }],
    );
    for (key, value) in [("k", "1"), ("k", "2"), ("k", "3"), ("k", "4")] {
        fake.put(key, value);
    }
    let client = connect(&proxy).await;
    let mut watcher = client
        .watch("k", WatchOptions::default().from_revision(1).with_prev_kv())
        .await
        .unwrap();
    assert_eq!(watcher.revision(), 0, "asked to start at 1");
    let seen = events_through(&mut watcher, 2).await;
    assert_eq!(seen, writes(&[(1, "k", "1"), (2, "k", "2")]));
    match next(&mut watcher).await {
        Err(Error::WatchCutOff { key, resume_from }) => {
            assert_eq!((key.as_str(), resume_from), ("k", 3));
        }
        other => panic!("expected a cut-off, got {other:?}"),
    }
    let batch = next(&mut watcher)
        .await
        .expect("resumed, not cut off again");
    assert_eq!(batch.revision, 3);
    let event = &batch.events[0];
    assert_eq!(event.entry.value, b"3");
    assert_eq!(
        event.prev.as_ref().map(|p| p.value.as_slice()),
        Some(&b"2"[..])
    );
    assert_eq!(
        events_through(&mut watcher, 4).await,
        writes(&[(4, "k", "4")])
    );
    assert_eq!(*fake.watch_starts.borrow(), [1, 3]);
}

#[tokio::test]
async fn compaction_is_reported_with_the_revision_and_ends_the_watch() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    for value in ["1", "2", "3", "4", "5"] {
        fake.put("k", value);
    }
    fake.compacted.store(4, Ordering::Relaxed);
    let client = connect(&proxy).await;
    match client
        .watch("k", WatchOptions::default().from_revision(2))
        .await
    {
        Err(Error::Compacted {
            key,
            compact_revision,
        }) => assert_eq!((key.as_str(), compact_revision), ("k", 4)),
        other => panic!("expected compaction, got {other:?}"),
    }

    // A watch whose resumption point is compacted while it is away ends the same way.
    plan(
        fake,
        &[WatchFault::EndAfter {
            responses: 1,
            code: Code::Unavailable,
        }],
    );
    let mut watcher = client
        .watch("k", WatchOptions::default().from_revision(4))
        .await
        .unwrap();
    assert_eq!(
        events_through(&mut watcher, 4).await,
        writes(&[(4, "k", "4")])
    );
    fake.compacted.store(6, Ordering::Relaxed);
    let err = next(&mut watcher).await.expect_err("compacted");
    assert!(
        matches!(
            err,
            Error::Compacted {
                compact_revision: 6,
                ..
            }
        ),
        "{err:?}"
    );
    // The error ended the stream: every later call says so, without asking the proxy.
    for _ in 0..2 {
        let after = timeout(PATIENCE, watcher.next()).await.expect("at once");
        assert!(after.is_none(), "{after:?}");
    }
    assert_eq!(*fake.watch_starts.borrow(), [2, 4, 5]);
}

#[tokio::test]
async fn a_proxy_that_stays_away_ends_the_wait_and_a_later_call_goes_on_from_there() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    plan(
        fake,
        &[WatchFault::EndAfter {
            responses: 1,
            code: Code::Unavailable,
        }],
    );
    plan(fake, &[WatchFault::Refuse(Code::Unavailable); 50]);
    let client = connect(&proxy).await;
    let opts = WatchOptions::default().reconnecting_for(Duration::from_millis(300));
    let mut watcher = client.watch("k", opts).await.unwrap();
    fake.put("k", "1");
    assert_eq!(
        events_through(&mut watcher, 1).await,
        writes(&[(1, "k", "1")])
    );
    fake.put("k", "2");
    let err = next(&mut watcher).await.expect_err("gave up");
    assert!(
        matches!(err, Error::Unavailable(ref m) if m.contains("\"k\"") && m.contains("revision 2")),
        "{err:?}"
    );
    fake.watch_plan.lock().unwrap().clear();
    assert_eq!(
        events_through(&mut watcher, 2).await,
        writes(&[(2, "k", "2")])
    );
}

#[tokio::test]
async fn a_quiet_watch_reports_progress() {
    let proxy = start(5_000).await;
    proxy.fake.put("k", "1");
    proxy.fake.put("other", "1");
    let client = connect(&proxy).await;
    let opts = WatchOptions::default()
        .from_revision(1)
        .with_progress(Duration::from_millis(20));
    let mut watcher = client.watch("k", opts).await.unwrap();
    assert_eq!(
        events_through(&mut watcher, 1).await,
        writes(&[(1, "k", "1")])
    );
    let progress = next(&mut watcher).await.unwrap();
    assert!(progress.events.is_empty(), "{progress:?}");
    assert_eq!(
        progress.revision, 2,
        "nothing happened to k up to revision 2"
    );
}

fn group(members: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
    members
        .iter()
        .map(|(m, v)| ((*m).to_owned(), v.as_bytes().to_vec()))
        .collect()
}

async fn changed(members: &mut Members) -> Vec<MemberChange> {
    timeout(PATIENCE, members.changed())
        .await
        .expect("a change")
        .unwrap()
}

fn joined(member: &str, value: &str) -> MemberChange {
    MemberChange::Joined {
        member: member.into(),
        value: value.into(),
    }
}

#[tokio::test]
async fn members_follow_announcements_and_sessions_ending() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    let client = connect(&proxy).await;
    let a = client
        .open_session(SessionOptions::default())
        .await
        .unwrap();
    let b = client
        .open_session(SessionOptions::default())
        .await
        .unwrap();
    let written = a.announce("web", "a", b"10.0.0.1").await.unwrap();
    assert!(written.succeeded);
    let entry = written.current.expect("the member's key");
    assert_eq!(entry.key, "members/web/a");
    assert!(entry.ephemeral);
    for bad in ["", "x/y"] {
        let err = a.announce("web", bad, b"v").await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{bad:?}: {err:?}");
    }

    let mut members = client.members("web").await.unwrap();
    assert_eq!(*members.current(), group(&[("a", "10.0.0.1")]));
    assert_eq!(members.revision(), 1);

    b.announce("web", "b", b"10.0.0.2").await.unwrap();
    assert_eq!(changed(&mut members).await, [joined("b", "10.0.0.2")]);
    // Neither a nested group nor an unchanged value is a change of this group.
    b.announce("web/api", "x", b"1").await.unwrap();
    a.announce("web", "a", b"10.0.0.1").await.unwrap();
    a.announce("web", "a", b"10.0.0.9").await.unwrap();
    assert_eq!(
        changed(&mut members).await,
        [MemberChange::Updated {
            member: "a".into(),
            value: "10.0.0.9".into()
        }]
    );
    b.close().await.unwrap();
    assert_eq!(
        changed(&mut members).await,
        [MemberChange::Left { member: "b".into() }]
    );
    assert_eq!(*members.current(), group(&[("a", "10.0.0.9")]));
    // Closing b deleted two keys (revisions 6 and 7), in either order.
    assert!(
        (6..=7).contains(&members.revision()),
        "{}",
        members.revision()
    );
    assert_eq!(fake.store.borrow().revision, 7);
}

#[tokio::test]
async fn members_read_the_group_again_when_the_watch_was_compacted_away() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    plan(
        fake,
        &[WatchFault::EndAfter {
            responses: 1,
            code: Code::Unavailable,
        }],
    );
    let client = connect(&proxy).await;
    let a = client
        .open_session(SessionOptions::default())
        .await
        .unwrap();
    let b = client
        .open_session(SessionOptions::default())
        .await
        .unwrap();
    a.announce("web", "a", b"1").await.unwrap();
    let mut members = client.members("web").await.unwrap();
    b.announce("web", "b", b"2").await.unwrap();
    assert_eq!(changed(&mut members).await, [joined("b", "2")]);
    // While the stream is down: c joins, b leaves, and history is compacted past both.
    let c = client
        .open_session(SessionOptions::default())
        .await
        .unwrap();
    c.announce("web", "c", b"3").await.unwrap();
    b.close().await.unwrap();
    let now = fake.store.borrow().revision;
    fake.compacted.store(now + 1, Ordering::Relaxed);
    assert_eq!(
        changed(&mut members).await,
        [MemberChange::Left { member: "b".into() }, joined("c", "3")]
    );
    assert_eq!(*members.current(), group(&[("a", "1"), ("c", "3")]));
    assert_eq!(members.revision(), now);
    a.announce("web", "a", b"10").await.unwrap();
    assert_eq!(
        changed(&mut members).await,
        [MemberChange::Updated {
            member: "a".into(),
            value: "10".into()
        }]
    );
}

/// Every stream of the SDK is a `Stream`; a `next()` dropped half-way (a `select!` that
/// took another branch) loses nothing: the next call delivers what the dropped one was
/// waiting for, once, and `current` and `revision` stay readable meanwhile.
#[tokio::test]
async fn streams_take_combinators_and_a_dropped_next_loses_nothing() {
    use tokio_stream::StreamExt;

    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    let client = connect(&proxy).await;
    let mut watcher = client.watch("k", WatchOptions::default()).await.unwrap();
    let mut members = client.members("web").await.unwrap();

    // Nothing to deliver yet: both calls are dropped while they wait.
    assert!(timeout(Duration::from_millis(50), watcher.next())
        .await
        .is_err());
    assert!(timeout(Duration::from_millis(50), members.next())
        .await
        .is_err());
    assert!(members.current().is_empty());
    assert_eq!(members.revision(), 0);

    fake.put("k", "1");
    fake.put("k", "2");
    let session = client
        .open_session(SessionOptions::default())
        .await
        .unwrap();
    session.announce("web", "a", "10.0.0.1").await.unwrap();

    // Through the `Stream` trait, with its combinators.
    let mut values = Vec::new();
    {
        let mut batches = (&mut watcher).map(|batch| batch.expect("no error").events);
        while values.len() < 2 {
            let events = timeout(PATIENCE, batches.next())
                .await
                .expect("a batch")
                .expect("the watch goes on");
            values.extend(
                events
                    .into_iter()
                    .map(|event| String::from_utf8(event.entry.value).unwrap()),
            );
        }
    }
    assert_eq!(values, ["1", "2"]);
    assert_eq!(watcher.revision(), 2);
    let joined_now = timeout(PATIENCE, StreamExt::next(&mut members))
        .await
        .expect("a change")
        .expect("a member list never ends")
        .unwrap();
    assert_eq!(joined_now, [joined("a", "10.0.0.1")]);
    assert_eq!(*members.current(), group(&[("a", "10.0.0.1")]));
    assert_eq!(members.revision(), 3);

    // A session's events and an election's leaders are streams too.
    let mut events = session.events();
    let mut leaders = client.observe("e").await.unwrap();
    let first = timeout(PATIENCE, StreamExt::next(&mut leaders))
        .await
        .expect("the current leader");
    assert!(matches!(first, Some(Ok(None))), "{first:?}");
    session.close().await.unwrap();
    let ended = timeout(PATIENCE, (&mut events).collect::<Vec<_>>())
        .await
        .expect("the events end with the session");
    assert!(
        matches!(
            ended.last(),
            Some(lockcell_client::SessionEvent::Expired { .. })
        ),
        "{ended:?}"
    );
}

/// A refusal ends a watch as compaction does: handed out once, then `None`, and a
/// member list built on it ends the same way.
#[tokio::test]
async fn a_refused_reopening_ends_the_stream_after_one_error() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    fake.put("k", "1");
    // The first stream ends after its first event; opened again, the grants refuse it.
    plan(
        fake,
        &[
            WatchFault::EndAfter {
                responses: 1,
                code: Code::Unavailable,
            },
            WatchFault::Refuse(Code::PermissionDenied),
        ],
    );
    let client = connect(&proxy).await;
    let mut watcher = client
        .watch("k", WatchOptions::default().from_revision(1))
        .await
        .unwrap();
    assert_eq!(
        events_through(&mut watcher, 1).await,
        writes(&[(1, "k", "1")])
    );
    let refused = next(&mut watcher).await.expect_err("refused");
    assert!(matches!(refused, Error::PermissionDenied(_)), "{refused:?}");
    for _ in 0..2 {
        let after = timeout(PATIENCE, watcher.next()).await.expect("at once");
        assert!(after.is_none(), "{after:?}");
    }
}
