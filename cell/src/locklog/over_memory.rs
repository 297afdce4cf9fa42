//! The lock log's calls run against the in-memory store: each transaction it builds is
//! applied as etcd applies it, so what these tests see is what etcd would hold.

use std::sync::Arc;
use std::time::Duration;

use super::memory::MemoryStore;
use super::*;
use crate::keyspace::LockName;

const A: i64 = 0xa;
const B: i64 = 0xb;

fn log() -> (Arc<MemoryStore>, LockLog) {
    let store = Arc::new(MemoryStore::new());
    store.grant_lease(A);
    store.grant_lease(B);
    let log = LockLog::over(store.clone(), Duration::from_secs(1));
    (store, log)
}

fn record(session: &str, call: &str) -> HolderRecord {
    HolderRecord {
        session: session.into(),
        call: call.into(),
        proxy: "p".into(),
        identity: "i".into(),
        ..HolderRecord::default()
    }
}

fn lock(name: &str) -> LockName {
    LockName::parse(name).expect("a lock name")
}

async fn acquire(
    log: &LockLog,
    lock: &LockName,
    mode: Mode,
    lease: i64,
    (session, call): (&str, &str),
) -> Result<Acquired, CellError> {
    log.acquire(lock, mode, lease, &record(session, call), None, 0)
        .await
}

fn granted(acquired: Result<Acquired, CellError>) -> i64 {
    match acquired {
        Ok(Acquired::Granted { revision, .. }) => revision,
        other => panic!("not granted: {other:?}"),
    }
}

#[tokio::test]
async fn one_exclusive_holder_at_a_time_and_a_retry_finds_its_own_grant() {
    let (store, log) = log();
    let x = lock("jobs/x");
    let first = acquire(&log, &x, Mode::Exclusive, A, ("sa", "c1")).await;
    assert!(matches!(first, Ok(Acquired::Granted { fresh: true, .. })));
    let revision = granted(first);
    assert_eq!(
        acquire(&log, &x, Mode::Exclusive, A, ("sa", "c1"))
            .await
            .ok(),
        Some(Acquired::Granted {
            revision,
            fresh: false
        }),
        "the same call asking again gets its grant back"
    );
    assert!(
        matches!(
            acquire(&log, &x, Mode::Exclusive, A, ("sa", "c2")).await,
            Err(CellError::AlreadyHeld { .. })
        ),
        "another call of the holding session shares no grant"
    );
    assert!(matches!(
        acquire(&log, &x, Mode::Exclusive, B, ("sb", "c1")).await,
        Ok(Acquired::Busy { .. })
    ));
    assert!(matches!(
        acquire(&log, &x, Mode::Shared, B, ("sb", "c2")).await,
        Ok(Acquired::Busy { .. })
    ));
    let writes = store.writes();
    assert!(log
        .release(&x, Mode::Exclusive, "sa", revision, A)
        .await
        .unwrap()
        .is_some());
    assert_eq!(store.writes(), writes + 1, "a release is one transaction");
    let next = granted(acquire(&log, &x, Mode::Exclusive, B, ("sb", "c3")).await);
    assert!(next > revision, "fencing tokens only grow");
    // A release of the old grant, late, leaves the new one be.
    assert!(log
        .release(&x, Mode::Exclusive, "sa", revision, A)
        .await
        .unwrap()
        .is_none());
    let (holder, _) = log.exclusive_holder(&x).await.unwrap();
    assert_eq!(
        holder.map(|h| (h.record.session, h.revision)),
        Some(("sb".into(), next))
    );
}

#[tokio::test]
async fn an_acquire_whose_answer_was_lost_is_found_again_by_its_retry() {
    let (store, log) = log();
    let x = lock("jobs/lost");
    store.lose_answers(1);
    assert!(acquire(&log, &x, Mode::Exclusive, A, ("sa", "c1"))
        .await
        .is_err());
    let key = x.holder_key(Mode::Exclusive, "sa");
    let landed = store.key(&key).expect("the grant landed unanswered");
    assert_eq!(
        acquire(&log, &x, Mode::Exclusive, A, ("sa", "c1"))
            .await
            .ok(),
        Some(Acquired::Granted {
            revision: landed.create_revision,
            fresh: false
        })
    );
    assert!(
        matches!(
            acquire(&log, &x, Mode::Exclusive, A, ("sa", "c2")).await,
            Err(CellError::AlreadyHeld { .. })
        ),
        "a new call of the session does not take the unanswered grant as its own"
    );
}

#[tokio::test]
async fn shared_holders_keep_an_exclusive_one_out_until_the_last_leaves() {
    let (_store, log) = log();
    let x = lock("cfg/shared");
    let a = granted(acquire(&log, &x, Mode::Shared, A, ("sa", "c")).await);
    let b = granted(acquire(&log, &x, Mode::Shared, B, ("sb", "c")).await);
    assert!(matches!(
        acquire(&log, &x, Mode::Exclusive, A, ("sc", "c")).await,
        Ok(Acquired::Busy { .. })
    ));
    log.release(&x, Mode::Shared, "sa", a, A).await.unwrap();
    assert!(matches!(
        acquire(&log, &x, Mode::Exclusive, A, ("sc", "c")).await,
        Ok(Acquired::Busy { .. })
    ));
    log.release(&x, Mode::Shared, "sb", b, B).await.unwrap();
    granted(acquire(&log, &x, Mode::Exclusive, A, ("sc", "c")).await);
}

#[tokio::test]
async fn a_fair_line_grants_its_head_and_the_grant_takes_the_waiter_key() {
    let (store, log) = log();
    let x = lock("jobs/fair");
    let first = log
        .enqueue(&x, Mode::Exclusive, "sa-1", A, 0)
        .await
        .unwrap();
    let second = log
        .enqueue(&x, Mode::Exclusive, "sb-1", B, 0)
        .await
        .unwrap();
    assert_eq!(
        log.enqueue(&x, Mode::Exclusive, "sa-1", A, 0)
            .await
            .unwrap(),
        first,
        "a waiter enqueued again keeps its place"
    );
    assert!(matches!(
        log.place(&x, Mode::Exclusive, first).await.unwrap(),
        Place::Head { .. }
    ));
    match log.place(&x, Mode::Exclusive, second).await.unwrap() {
        Place::Behind { predecessor, .. } => {
            assert_eq!(
                predecessor,
                x.waiter_key(Mode::Exclusive, "sa-1").into_bytes()
            )
        }
        other => panic!("the second waiter is at {other:?}"),
    }
    let queued = Some(("sa-1", first));
    let revision = granted(
        log.acquire(&x, Mode::Exclusive, A, &record("sa", "1"), queued, 0)
            .await,
    );
    assert!(store.key(&x.waiter_key(Mode::Exclusive, "sa-1")).is_none());
    // A waiter key that moved to another lease is not this proxy's to grant.
    let moved = Some(("sb-1", second));
    log.release(&x, Mode::Exclusive, "sa", revision, A)
        .await
        .unwrap();
    assert!(matches!(
        log.acquire(&x, Mode::Exclusive, A, &record("sb", "1"), moved, 0)
            .await,
        Ok(Acquired::Busy { .. })
    ));
    assert!(log
        .dequeue(&x, Mode::Exclusive, "sb-1", second)
        .await
        .unwrap());
    assert!(!log
        .dequeue(&x, Mode::Exclusive, "sb-1", second)
        .await
        .unwrap());
}

#[tokio::test]
async fn no_grant_is_made_once_the_epoch_or_the_shard_map_changed() {
    let (store, log) = log();
    store
        .put(keyspace::epoch_key().into(), b"1".to_vec(), None)
        .await
        .unwrap();
    let log = log.with_epoch_guard(store.revision());
    let x = lock("jobs/epoch");
    granted(acquire(&log, &x, Mode::Exclusive, A, ("sa", "c")).await);
    store
        .put(keyspace::shardmap_key().into(), b"{}".to_vec(), None)
        .await
        .unwrap();
    assert!(matches!(
        acquire(&log, &x, Mode::Exclusive, A, ("sb", "c")).await,
        Err(CellError::MapChanged { .. })
    ));
    let map = store.revision();
    store
        .put(keyspace::epoch_key().into(), b"2".to_vec(), None)
        .await
        .unwrap();
    let y = lock("jobs/epoch2");
    assert!(matches!(
        log.acquire(&y, Mode::Exclusive, A, &record("sb", "c"), None, map)
            .await,
        Err(CellError::CellChanged { .. })
    ));
    assert!(store
        .keys_under(&y.holder_key(Mode::Exclusive, "sb"))
        .is_empty());
}

#[tokio::test]
async fn guarded_deletes_take_only_the_grants_named_in_one_request_each() {
    let (store, log) = log();
    let mut grants = Vec::new();
    // More than one transaction's worth, and two holds of one lock (a release whose
    // answer was lost, then granted again): one release marker per lock.
    for i in 0..70 {
        let x = lock(&format!("bulk/{i}"));
        let revision = granted(acquire(&log, &x, Mode::Shared, A, ("sa", "c")).await);
        grants.push(Grant::hold(&x, Mode::Shared, "sa", revision));
    }
    let again = lock("bulk/1");
    let released = grants[1].revision;
    let twice = lock("bulk/0");
    grants.insert(1, Grant::hold(&twice, Mode::Shared, "sa", 1));
    // One grant was taken again since: its key is a later grant.
    log.release(&again, Mode::Shared, "sa", released, A)
        .await
        .unwrap();
    let later = granted(acquire(&log, &again, Mode::Shared, A, ("sa", "d")).await);
    let deleted = log.delete_guarded(&grants, A, true).await.unwrap();
    assert_eq!(
        deleted.keys, 69,
        "every grant named but the one taken again"
    );
    let left = store.key(&again.holder_key(Mode::Shared, "sa"));
    assert_eq!(left.map(|kv| kv.create_revision), Some(later));
}

#[tokio::test]
async fn a_move_keeps_each_token_and_reports_a_key_no_longer_the_grant() {
    let (store, log) = log();
    let x = lock("mv/x");
    let y = lock("mv/y");
    let rx = granted(acquire(&log, &x, Mode::Exclusive, A, ("sa", "c")).await);
    let ry = granted(acquire(&log, &y, Mode::Exclusive, A, ("sa", "c")).await);
    log.release(&y, Mode::Exclusive, "sa", ry, A).await.unwrap();
    let keys = [
        (Grant::hold(&x, Mode::Exclusive, "sa", rx), A),
        (Grant::hold(&y, Mode::Exclusive, "sa", ry), A),
    ];
    let moved = log.move_keys(&keys, B).await.unwrap();
    assert!(moved[0].is_ok() && moved[1].is_err(), "{moved:?}");
    let kv = store.key(&x.exclusive_key()).expect("x's key");
    assert_eq!((kv.create_revision, kv.lease), (rx, B));
    // Moved again, it is already there: still counted as moved.
    let again = log.move_keys(&keys[..1], B).await.unwrap();
    assert!(again[0].is_ok());
}

#[tokio::test]
async fn a_store_that_is_down_writes_nothing() {
    let (store, log) = log();
    store.set_down(true);
    let x = lock("down/x");
    assert!(acquire(&log, &x, Mode::Exclusive, A, ("sa", "c"))
        .await
        .is_err());
    store.set_down(false);
    assert!(store.keys_under("").is_empty());
    assert_eq!(store.writes(), 0);
}

mod properties {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    const SESSIONS: [(&str, i64); 3] = [("sa", A), ("sb", B), ("sc", 0xc)];

    #[derive(Debug, Clone)]
    enum Op {
        Acquire {
            session: usize,
            call: usize,
            shared: bool,
        },
        Release {
            session: usize,
        },
        /// The next write is applied and its answer lost.
        LoseAnswer,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..3usize, 0..2usize, any::<bool>())
                .prop_map(|(session, call, shared)| Op::Acquire { session, call, shared }),
            2 => (0..3usize).prop_map(|session| Op::Release { session }),
            1 => Just(Op::LoseAnswer),
        ]
    }

    /// The holder keys of `lock` in etcd now: (exclusive?, session).
    fn holders(store: &MemoryStore, lock: &LockName) -> Vec<(bool, String)> {
        let (start, end) = lock.holders_range();
        store
            .keys_under("")
            .into_iter()
            .filter(|kv| {
                kv.key.as_slice() >= start.as_bytes() && kv.key.as_slice() < end.as_bytes()
            })
            .map(|kv| {
                let record: HolderRecord = serde_json::from_slice(&kv.value).expect("a record");
                (kv.key == lock.exclusive_key().as_bytes(), record.session)
            })
            .collect()
    }

    proptest! {
        /// Whatever sessions ask, retry, release, and whichever answers are lost: the
        /// holders in etcd are one exclusive or any shared ones, never both; every grant
        /// a call is told of is that call's alone (no two calls share one); and a
        /// grant is told fresh only once.
        #[test]
        fn grants_stay_one_calls_each_and_holders_compatible(ops in proptest::collection::vec(op(), 1..40)) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            runtime.block_on(async {
                let (store, log) = log();
                store.grant_lease(0xc);
                let x = lock("prop/x");
                // By the grant's revision: the session and call told of it, and its mode.
                let mut told: HashMap<i64, (usize, usize, bool)> = HashMap::new();
                // What each session knows it holds: revision and mode.
                let mut known: HashMap<usize, (i64, bool)> = HashMap::new();
                for op in ops {
                    match op {
                        Op::LoseAnswer => store.lose_answers(1),
                        Op::Acquire { session, call, shared } => {
                            let (name, lease) = SESSIONS[session];
                            let mode = if shared { Mode::Shared } else { Mode::Exclusive };
                            let call_id = format!("c{call}");
                            match acquire(&log, &x, mode, lease, (name, &call_id)).await {
                                Ok(Acquired::Granted { revision, fresh }) => {
                                    let before = told.insert(revision, (session, call, shared));
                                    prop_assert!(
                                        before.is_none_or(|b| b == (session, call, shared)),
                                        "grant {} told to {:?}, then to {:?}", revision, before, (session, call, shared)
                                    );
                                    prop_assert!(fresh == before.is_none() || !fresh, "a grant told fresh twice");
                                    known.insert(session, (revision, shared));
                                }
                                Ok(Acquired::Busy { .. }) | Err(_) => {}
                            }
                        }
                        Op::Release { session } => {
                            if let Some((revision, shared)) = known.remove(&session) {
                                let (name, lease) = SESSIONS[session];
                                let mode = if shared { Mode::Shared } else { Mode::Exclusive };
                                let _ = log.release(&x, mode, name, revision, lease).await;
                            }
                        }
                    }
                    let now = holders(&store, &x);
                    let exclusive = now.iter().filter(|(e, _)| *e).count();
                    prop_assert!(
                        exclusive == 0 || now.len() == 1,
                        "holders at once: {:?}", now
                    );
                }
                Ok(())
            })?;
        }
    }
}
