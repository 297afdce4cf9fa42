//! The arbiter's runtime: the proxy's local wait queues (for classes that are not
//! fair) and the wake-ups that go with them.
//!
//! The queue itself is [`lockcell_cell::arbiter::Arbiter`], plain data. Here each
//! waiter gets a ticket with its own `Notify`; a release of a lock wakes only the
//! waiters the arbiter names (the head, or a run of shared waiters), so a release costs
//! at most one grant attempt from this proxy however many of its clients wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use lockcell_cell::arbiter::{Arbiter, Waiter};
use lockcell_cell::{LockName, Mode};
use tokio::sync::Notify;

/// The proxy's local wait queues.
#[derive(Default)]
pub struct Queues {
    arbiter: Mutex<Arbiter<LockName>>,
    /// Each queued waiter's wake-up.
    wakers: DashMap<u64, Arc<Notify>>,
    next: AtomicU64,
}

/// A waiter's place in its lock's local queue; dropping it leaves the queue.
pub struct Ticket {
    queues: Arc<Queues>,
    lock: LockName,
    id: u64,
    notify: Arc<Notify>,
    granted: bool,
}

impl Queues {
    /// Queues a waiter for `lock` in `mode`. A waiter that may try at once finds its
    /// first [`Ticket::turn`] already signalled.
    pub fn join(self: &Arc<Self>, lock: &LockName, mode: Mode) -> Ticket {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        self.wakers.insert(id, notify.clone());
        let may_try = self
            .arbiter
            .lock()
            .expect("arbiter")
            .join(lock, Waiter { id, mode });
        if may_try {
            notify.notify_one();
        }
        Ticket {
            queues: self.clone(),
            lock: lock.clone(),
            id,
            notify,
            granted: false,
        }
    }

    /// A holder of `lock` went away: wake whoever's turn it is.
    pub fn released(&self, lock: &LockName) {
        let ids = self.arbiter.lock().expect("arbiter").on_release(lock);
        self.wake(&ids);
    }

    /// Events may have been missed: wake every head.
    pub fn wake_all(&self) {
        for waker in self.wakers.iter() {
            waker.value().notify_one();
        }
    }

    fn wake(&self, ids: &[u64]) {
        for id in ids {
            if let Some(waker) = self.wakers.get(id) {
                waker.notify_one();
            }
        }
    }
}

impl Ticket {
    /// Waits until it may be this waiter's turn (a release woke it), or `patience` has
    /// passed. Returns true when woken.
    pub async fn turn(&self, patience: Duration) -> bool {
        tokio::time::timeout(patience, self.notify.notified())
            .await
            .is_ok()
    }

    /// Whether this waiter may try for a grant now.
    pub fn may_try(&self) -> bool {
        self.queues
            .arbiter
            .lock()
            .expect("arbiter")
            .may_try(&self.lock, self.id)
    }

    /// Marks the ticket granted: leaving the queue then wakes nobody but a shared run.
    pub fn granted(&mut self) {
        self.granted = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.queues.wakers.remove(&self.id);
        let ids =
            self.queues
                .arbiter
                .lock()
                .expect("arbiter")
                .leave(&self.lock, self.id, self.granted);
        self.queues.wake(&ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_head_is_woken_by_a_release_and_the_next_by_its_leaving() {
        let queues = Arc::new(Queues::default());
        let lock = LockName::parse("l").unwrap();
        let mut first = queues.join(&lock, Mode::Exclusive);
        let second = queues.join(&lock, Mode::Exclusive);
        assert!(
            first.turn(Duration::from_secs(1)).await,
            "an empty queue lets the first try at once"
        );
        assert!(
            !second.turn(Duration::from_secs(1)).await,
            "the second waits"
        );
        queues.released(&lock);
        assert!(first.turn(Duration::from_secs(1)).await);
        assert!(
            !second.turn(Duration::from_millis(10)).await,
            "only the head is woken"
        );
        first.granted();
        drop(first);
        assert!(
            !second.turn(Duration::from_millis(10)).await,
            "a granted head wakes nobody"
        );
        assert!(second.may_try());
        queues.released(&lock);
        assert!(second.turn(Duration::from_secs(1)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_giving_up_wakes_the_next() {
        let queues = Arc::new(Queues::default());
        let lock = LockName::parse("l").unwrap();
        let first = queues.join(&lock, Mode::Exclusive);
        let second = queues.join(&lock, Mode::Exclusive);
        drop(first);
        assert!(second.turn(Duration::from_secs(1)).await);
    }
}
