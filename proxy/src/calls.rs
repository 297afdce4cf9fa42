//! Acquires and campaigns under way, by session and call id, so that a client that gave
//! up on one (its future dropped before the answer) can withdraw it for certain: its
//! wait ends, a grant attempt of it already sent to etcd finishes first, and only then
//! is what the call holds looked for and released (`acquire::withdraw`). Asking again
//! with the same call id could not do that: a call still in line would be granted after
//! the second ask was answered "nothing held".
//!
//! A withdrawn call id stays withdrawn for [`WITHDRAWN_FOR`]: the call arriving late
//! (sent before the withdrawal, on another connection) is answered "not granted".

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long a withdrawn call id is refused.
pub const WITHDRAWN_FOR: Duration = Duration::from_secs(60);

type Key = (String, String);

/// The calls under way, by (session id, call id).
#[derive(Default)]
pub struct Calls {
    calls: Arc<DashMap<Key, Arc<CallState>>>,
}

struct CallState {
    /// Set once the call is withdrawn, with when.
    withdrawn: watch::Sender<Option<Instant>>,
    /// Parts of the call under way: its wait, and each grant attempt it sent.
    running: watch::Sender<usize>,
}

/// One part of a call under way; the call counts as running until every part is dropped.
pub struct Running {
    state: Arc<CallState>,
    calls: Arc<DashMap<Key, Arc<CallState>>>,
    key: Key,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.state.running.send_modify(|n| *n -= 1);
        // A call that ended and was never withdrawn is forgotten at once.
        self.calls.remove_if(&self.key, |_, c| {
            *c.running.borrow() == 0 && c.withdrawn.borrow().is_none()
        });
    }
}

impl Running {
    /// Resolves once the call is withdrawn.
    pub async fn withdrawn(&self) {
        let mut rx = self.state.withdrawn.subscribe();
        let _ = rx.wait_for(Option::is_some).await;
    }
}

impl Calls {
    /// Counts a part of call `call` of `session` as running; `None` if the call was
    /// withdrawn.
    pub fn enter(&self, session: &str, call: &str) -> Option<Running> {
        let running = self.part(session, call);
        let withdrawn = running.state.withdrawn.borrow().is_some();
        (!withdrawn).then_some(running)
    }

    /// Counts a part of the call as running, withdrawn or not (a grant attempt that
    /// must be waited for all the same).
    pub fn part(&self, session: &str, call: &str) -> Running {
        let key = (session.to_owned(), call.to_owned());
        let state = self.state(&key);
        state.running.send_modify(|n| *n += 1);
        Running {
            state,
            calls: self.calls.clone(),
            key,
        }
    }

    fn state(&self, key: &Key) -> Arc<CallState> {
        self.calls
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(CallState {
                    withdrawn: watch::Sender::new(None),
                    running: watch::Sender::new(0),
                })
            })
            .clone()
    }

    /// Withdraws call `call` of `session`: its wait ends, and this resolves once no
    /// part of it runs any more, or after `patience` (a grant attempt is bounded by
    /// etcd's timeout).
    pub async fn withdraw(&self, session: &str, call: &str, patience: Duration) {
        self.prune();
        let now = Instant::now();
        let state = self.state(&(session.to_owned(), call.to_owned()));
        state.withdrawn.send_if_modified(|at| {
            let first = at.is_none();
            at.get_or_insert(now);
            first
        });
        let mut running = state.running.subscribe();
        let _ = tokio::time::timeout(patience, running.wait_for(|n| *n == 0)).await;
    }

    /// Forgets the withdrawals older than [`WITHDRAWN_FOR`] whose calls no longer run.
    pub fn prune(&self) {
        let now = Instant::now();
        self.calls.retain(|_, c| {
            *c.running.borrow() > 0
                || c.withdrawn
                    .borrow()
                    .is_some_and(|at| now < at + WITHDRAWN_FOR)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_withdrawal_waits_for_every_part_and_refuses_the_call_after() {
        let calls = Calls::default();
        let wait = calls.enter("s", "c1").expect("a new call");
        let attempt = calls.part("s", "c1");
        let calls = Arc::new(calls);
        let withdrawing = tokio::spawn({
            let calls = calls.clone();
            async move { calls.withdraw("s", "c1", Duration::from_secs(10)).await }
        });
        tokio::time::timeout(Duration::from_secs(1), wait.withdrawn())
            .await
            .expect("the wait hears of the withdrawal");
        drop(wait);
        tokio::task::yield_now().await;
        assert!(!withdrawing.is_finished(), "the attempt still runs");
        drop(attempt);
        withdrawing.await.expect("no panic");
        assert!(
            calls.enter("s", "c1").is_none(),
            "a late arrival of the call is refused"
        );
        assert!(calls.enter("s", "c2").is_some(), "another call is not");
        assert_eq!(
            calls.calls.len(),
            1,
            "a call that ended is forgotten at once"
        );
        tokio::time::advance(WITHDRAWN_FOR + Duration::from_secs(1)).await;
        calls.prune();
        assert!(calls.enter("s", "c1").is_some(), "forgotten after a while");
    }
}
