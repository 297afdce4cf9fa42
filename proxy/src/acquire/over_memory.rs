//! The acquire runtime over the in-memory store, with paused time: waits, turns,
//! grants and give-ups as the proxy carries them out, with no etcd.

use std::time::Duration;

use super::*;
use crate::testing::{rig, Rig};

const TTL: Duration = Duration::from_secs(30);
const FAIR: &str = "[[class]]\nname = \"fair\"\nprefix = \"fair/\"\nfair = true\n";

fn call(session: &str, lock: &str, id: &str, wait: Option<Duration>) -> Call {
    Call {
        session_id: session.into(),
        lock: LockName::parse(lock).expect("a lock name"),
        mode: Mode::Exclusive,
        wait,
        value: String::new(),
        election: false,
        call_id: id.into(),
    }
}

async fn granted(rig: &Rig, call: Call) -> Granted {
    acquire(&rig.state, call)
        .await
        .expect("no error")
        .expect("granted")
}

/// Releases `session`'s hold of `lock` granted as `granted`, as the client's Release.
async fn release(rig: &Rig, session: &str, lock: &str, granted: &Granted) {
    let token = Some(granted.token().into());
    let done = crate::service::lock::release(&rig.state, session, lock, Mode::Exclusive, token)
        .await
        .expect("released");
    assert!(done, "the release found its hold");
}

/// Session `session`'s call `c1` for `lock`, waiting as long as it takes, in a task.
fn wait(
    rig: &Rig,
    session: &str,
    lock: &str,
) -> tokio::task::JoinHandle<Result<Option<Granted>, ProxyError>> {
    let (state, session, lock) = (rig.state.clone(), session.to_owned(), lock.to_owned());
    tokio::spawn(async move { acquire(&state, call(&session, &lock, "c1", None)).await })
}

/// Lets every task that can run, run, with time standing still.
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiter_is_granted_as_soon_as_the_release_is_seen() {
    let rig = rig(&[], "").await;
    let (a, b) = (rig.open(TTL), rig.open(TTL));
    let first = granted(&rig, call(&a, "jobs/x", "c1", None)).await;
    let waiting = wait(&rig, &b, "jobs/x");
    settle().await;
    assert!(!waiting.is_finished(), "granted while the lock was held");
    release(&rig, &a, "jobs/x", &first).await;
    let released = Instant::now();
    rig.feed();
    let second = waiting.await.unwrap().unwrap().expect("granted");
    assert_eq!(
        Instant::now(),
        released,
        "woken by the release, not by its next look"
    );
    assert!(second.revision > first.revision && second.fresh);
}

#[tokio::test(start_paused = true)]
async fn a_release_missed_by_the_watch_is_found_by_the_next_look() {
    let rig = rig(&[], "").await;
    let (a, b) = (rig.open(TTL), rig.open(TTL));
    let first = granted(&rig, call(&a, "jobs/x", "c1", None)).await;
    let waiting = wait(&rig, &b, "jobs/x");
    settle().await;
    release(&rig, &a, "jobs/x", &first).await;
    let released = Instant::now();
    // The release's event never comes.
    let second = waiting.await.unwrap().unwrap().expect("granted");
    assert!(Instant::now() - released <= POLL);
    assert!(second.revision > first.revision);
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_runs_out_leaves_nothing_and_no_one_behind_it_waits_for_it() {
    let rig = rig(&[], "").await;
    let (a, b, c) = (rig.open(TTL), rig.open(TTL), rig.open(TTL));
    let first = granted(&rig, call(&a, "jobs/x", "c1", None)).await;
    let keys = rig.store.keys_under("");
    let started = Instant::now();
    let gave_up = acquire(
        &rig.state,
        call(&b, "jobs/x", "c1", Some(Duration::from_secs(2))),
    )
    .await
    .expect("no error");
    assert!(gave_up.is_none());
    assert_eq!(Instant::now() - started, Duration::from_secs(2));
    assert_eq!(rig.store.keys_under(""), keys, "the wait left a key behind");
    let waiting = wait(&rig, &c, "jobs/x");
    settle().await;
    release(&rig, &a, "jobs/x", &first).await;
    let released = Instant::now();
    rig.feed();
    waiting.await.unwrap().unwrap().expect("granted");
    assert_eq!(
        Instant::now(),
        released,
        "the waiter that gave up held the line"
    );
}

#[tokio::test(start_paused = true)]
async fn a_grant_whose_answer_was_lost_is_the_calls_and_no_other_calls() {
    let rig = rig(&[], "").await;
    let a = rig.open(TTL);
    rig.store.lose_answers(1);
    let first = granted(&rig, call(&a, "jobs/lost", "c1", None)).await;
    let x = LockName::parse("jobs/lost").unwrap();
    let key = rig
        .store
        .key(&x.holder_key(Mode::Exclusive, &a))
        .expect("the grant");
    assert_eq!(
        first.revision, key.create_revision,
        "the call was told of the grant that landed"
    );
    let revision = rig.store.revision();
    let other = acquire(&rig.state, call(&a, "jobs/lost", "c2", None)).await;
    assert!(
        other.is_err(),
        "another call shared the grant: {:?}",
        other.ok().flatten().map(|g| g.revision)
    );
    assert_eq!(rig.store.revision(), revision, "a refused call wrote");
    let again = granted(&rig, call(&a, "jobs/lost", "c1", None)).await;
    assert_eq!((again.revision, again.fresh), (first.revision, false));
}

#[tokio::test(start_paused = true)]
async fn a_fair_line_grants_in_the_order_it_was_joined() {
    let rig = rig(&[], FAIR).await;
    let holder = rig.open(TTL);
    let first = granted(&rig, call(&holder, "fair/x", "c1", None)).await;
    let mut waits = Vec::new();
    for _ in 0..3 {
        let session = rig.open(TTL);
        let state = rig.state.clone();
        let id = session.clone();
        waits.push((
            session,
            tokio::spawn(async move { acquire(&state, call(&id, "fair/x", "c1", None)).await }),
        ));
        settle().await;
        rig.feed();
    }
    let mut last = (holder, first);
    for (session, wait) in waits {
        settle().await;
        assert!(!wait.is_finished(), "granted out of turn");
        release(&rig, &last.0, "fair/x", &last.1).await;
        rig.feed();
        let next = wait.await.unwrap().unwrap().expect("granted");
        assert!(next.revision > last.1.revision);
        rig.feed();
        last = (session, next);
    }
    let x = LockName::parse("fair/x").unwrap();
    assert!(
        rig.store.keys_under(&x.queue_prefix()).is_empty(),
        "the line is empty"
    );
}

#[tokio::test(start_paused = true)]
async fn a_silent_holders_lock_passes_only_once_its_client_may_no_longer_act() {
    let rig = rig(&["--session-ttl-min", "1s"], "").await;
    let (a, b) = (rig.open(Duration::from_secs(3)), rig.open(TTL));
    let first = granted(&rig, call(&a, "jobs/silent", "c1", None)).await;
    let may_act_until = Instant::now() + first.valid_for;
    assert!(first.valid_for > Duration::ZERO);
    rig.follow();
    tokio::spawn(crate::reaper::run(rig.state.clone()));
    // The holder never renews; the waiter waits.
    let second = granted(&rig, call(&b, "jobs/silent", "c1", None)).await;
    assert!(
        Instant::now() >= may_act_until,
        "granted while the silent holder could still act on its grant"
    );
    assert!(second.revision > first.revision);
    let x = LockName::parse("jobs/silent").unwrap();
    let kv = rig.store.key(&x.exclusive_key()).expect("the second grant");
    assert_eq!(kv.create_revision, second.revision);
}
