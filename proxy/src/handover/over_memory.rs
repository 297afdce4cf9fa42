//! Moves over the in-memory store: what a resume leaves when etcd's answer is lost, or
//! when two resumes of one session race on one proxy.

use lockcell_cell::keyspace::Mode;

use super::*;
use crate::acquire::{acquire, Call};
use crate::testing::{rig, Rig};

const TTL: Duration = Duration::from_secs(30);

/// Session `id` acquires `lock` exclusively as call `call_id`; returns the grant's key
/// and revision.
async fn take(rig: &Rig, id: &str, lock: &str, call_id: &str) -> (String, i64) {
    let call = Call {
        session_id: id.to_owned(),
        lock: LockName::parse(lock).expect("a lock name"),
        mode: Mode::Exclusive,
        wait: None,
        value: String::new(),
        election: false,
        call_id: call_id.into(),
    };
    let key = call.lock.exclusive_key();
    let granted = acquire(&rig.state, call)
        .await
        .expect("no error")
        .expect("granted");
    (key, granted.revision)
}

/// A resume of session `id` from lease `from`, naming `held`.
fn resume_request(id: &str, secret: &str, from: i64, held: Vec<HeldKey>) -> ResumeRequest {
    ResumeRequest {
        session_id: id.to_owned(),
        session_secret: secret.to_owned(),
        ttl_ms: millis(TTL),
        identity: "test".into(),
        from_lease_id: from,
        keys: held,
        ..ResumeRequest::default()
    }
}

/// A client that lost its connection to its proxy resumes its session on that same
/// proxy, naming nothing: the grant of an acquire whose reply it never got is a key it
/// does not know. etcd applies the move but its answer is lost. The stay the grant was
/// recorded in is gone, so the grant must be deleted, or it holds the lock for good on
/// a lease the proxy keeps renewing.
#[tokio::test(start_paused = true)]
async fn a_resume_without_an_answer_leaves_no_key_of_the_earlier_stay_unowned() {
    let rig = rig(&["--leases", "2"], "").await;
    let (id, secret) = rig.open_with_secret(TTL);
    let (key, revision) = take(&rig, &id, "jobs/x", "c1").await;
    let from = rig.state.sessions.peek(&id).expect("the stay").lease;
    rig.store.lose_answers(1);
    let refused = resume(&rig.state, resume_request(&id, &secret, from, vec![]), None).await;
    assert!(
        matches!(refused, Err(ProxyError::StoreDuring { .. })),
        "{refused:?}"
    );
    let stay = rig.state.sessions.peek(&id).expect("the new stay");
    assert_ne!(stay.lease, from, "the move went to another lease");
    assert!(!rig.state.sessions.holds(&id, &key, revision));
    assert!(rig.store.key(&key).is_some(), "the grant is still in etcd");
    let state = &rig.state;
    state
        .cleanup
        .run(&state.leases, &state.locklog, &state.sessions)
        .await;
    assert!(
        rig.store.key(&key).is_none(),
        "a grant no stay owns was left in etcd"
    );
}

/// A client resumes its session on this proxy twice at once (a retry sent while the
/// first try's answer is slow): the first try's move reaches etcd last and is refused,
/// as the second moved the session's fence. The session is the second try's stay from
/// then on, with the key it moved; what the stay both took the place of had that no try
/// named (a grant whose reply was lost) is deleted, not left on a lease the proxy keeps.
#[tokio::test(start_paused = true)]
async fn a_resume_refused_after_a_newer_one_landed_leaves_the_newer_stay() {
    let rig = rig(&["--leases", "3"], "").await;
    let (id, secret) = rig.open_with_secret(TTL);
    let (named, named_at) = take(&rig, &id, "jobs/x", "c1").await;
    let (unnamed, _) = take(&rig, &id, "jobs/y", "c2").await;
    let from = rig.state.sessions.peek(&id).expect("the stay").lease;
    let held = vec![HeldKey {
        kind: HeldKind::Exclusive as i32,
        name: "jobs/x".into(),
        revision: named_at,
        ..HeldKey::default()
    }];

    rig.store.hold_txns(1);
    let first = tokio::spawn({
        let (state, request) = (
            rig.state.clone(),
            resume_request(&id, &secret, from, held.clone()),
        );
        async move { resume(&state, request, None).await }
    });
    for _ in 0..1_000 {
        if rig.store.at_gate() == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(rig.store.at_gate(), 1, "the first try's move is in flight");
    let second = resume(&rig.state, resume_request(&id, &secret, from, held), None)
        .await
        .expect("the second try moves the session");
    rig.store.release();
    let first = first.await.expect("no panic");
    assert!(
        matches!(first, Err(ProxyError::FencedOut { .. })),
        "{first:?}"
    );

    let stay = rig.state.sessions.peek(&id).expect("a stay");
    assert_eq!(
        (stay.incarnation, stay.lease),
        (second.incarnation, second.lease_id),
        "the session is the stay of the resume that moved it"
    );
    assert!(rig.state.sessions.holds(&id, &named, named_at));
    let state = &rig.state;
    state
        .cleanup
        .run(&state.leases, &state.locklog, &state.sessions)
        .await;
    let kept = rig.store.key(&named).expect("the moved key is kept");
    assert_eq!(kept.lease, second.lease_id, "on the new stay's lease");
    assert!(
        rig.store.key(&unnamed).is_none(),
        "a grant no stay owns was left in etcd"
    );
}
