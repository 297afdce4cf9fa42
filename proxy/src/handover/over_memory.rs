//! Moves over the in-memory store: what a resume leaves when etcd's answer is lost.

use lockcell_cell::keyspace::{LockName, Mode};

use super::*;
use crate::acquire::{acquire, Call};
use crate::testing::rig;

const TTL: Duration = Duration::from_secs(30);

/// A client that lost its connection to its proxy resumes its session on that same
/// proxy, naming nothing: the grant of an acquire whose reply it never got is a key it
/// does not know. etcd applies the move but its answer is lost. The stay the grant was
/// recorded in is gone, so the grant must be deleted, or it holds the lock for good on
/// a lease the proxy keeps renewing.
#[tokio::test(start_paused = true)]
async fn a_resume_without_an_answer_leaves_no_key_of_the_earlier_stay_unowned() {
    let rig = rig(&["--leases", "2"], "").await;
    let (id, secret) = rig.open_with_secret(TTL);
    let call = Call {
        session_id: id.clone(),
        lock: LockName::parse("jobs/x").expect("a lock name"),
        mode: Mode::Exclusive,
        wait: None,
        value: String::new(),
        election: false,
        call_id: "c1".into(),
    };
    let key = call.lock.exclusive_key();
    let granted = acquire(&rig.state, call)
        .await
        .expect("no error")
        .expect("granted");
    let from = rig.state.sessions.peek(&id).expect("the stay").lease;
    rig.store.lose_answers(1);
    let request = ResumeRequest {
        session_id: id.clone(),
        session_secret: secret,
        ttl_ms: millis(TTL),
        identity: "test".into(),
        from_lease_id: from,
        ..ResumeRequest::default()
    };
    let refused = resume(&rig.state, request, None).await;
    assert!(
        matches!(refused, Err(ProxyError::StoreDuring { .. })),
        "{refused:?}"
    );
    let stay = rig.state.sessions.peek(&id).expect("the new stay");
    assert_ne!(stay.lease, from, "the move went to another lease");
    assert!(!rig.state.sessions.holds(&id, &key, granted.revision));
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
