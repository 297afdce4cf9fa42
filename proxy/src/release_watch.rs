//! Wakes the proxy's waiting acquires when a lock's holder key is deleted.
//!
//! One etcd watch over all holder keys (deletes only) per proxy, however many clients
//! wait; each lock with local waiters has a channel carrying the revision of its latest
//! delete. A waiter subscribes *before* its acquire transaction, so a delete that lands
//! between the transaction and the wait is not missed. A missed event (the watch broke
//! or was compacted) only delays a grant: waiters also retry on a timer.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use etcd_client::{EventType, WatchClient, WatchFilterType, WatchOptions};
use lockcell_cell::keyspace::{self, LockName};
use tokio::sync::watch;

/// Local waiters per lock, each lock keyed to the revision of its latest delete.
#[derive(Default)]
pub struct ReleaseWatch {
    locks: DashMap<LockName, watch::Sender<i64>>,
}

/// A waiter's interest in one lock; dropping it forgets the lock when nobody waits.
pub struct Subscription {
    watch: Arc<ReleaseWatch>,
    lock: LockName,
    rx: Option<watch::Receiver<i64>>,
}

impl ReleaseWatch {
    pub fn subscribe(self: &Arc<Self>, lock: &LockName) -> Subscription {
        let rx = self
            .locks
            .entry(lock.clone())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Subscription {
            watch: self.clone(),
            lock: lock.clone(),
            rx: Some(rx),
        }
    }

    /// A holder key of `lock` was deleted at `revision`.
    pub fn deleted(&self, lock: &LockName, revision: i64) {
        if let Some(tx) = self.locks.get(lock) {
            tx.send_if_modified(|seen| {
                let newer = revision > *seen;
                if newer {
                    *seen = revision;
                }
                newer
            });
        }
    }

    /// Events may have been missed up to `revision`: wake every waiter to retry.
    pub fn wake_all(&self, revision: i64) {
        for entry in self.locks.iter() {
            entry
                .value()
                .send_modify(|seen| *seen = (*seen).max(revision));
        }
    }

    /// Locks with local waiters now.
    pub fn len(&self) -> usize {
        self.locks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.locks.is_empty()
    }
}

impl Subscription {
    /// Waits until a delete newer than `seen_at` is seen, or `patience` has passed.
    pub async fn released_after(&mut self, seen_at: i64, patience: Duration) {
        let rx = self.rx.as_mut().expect("receiver lives until drop");
        let _ = tokio::time::timeout(patience, rx.wait_for(|rev| *rev > seen_at)).await;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        drop(self.rx.take());
        self.watch
            .locks
            .remove_if(&self.lock, |_, tx| tx.receiver_count() == 0);
    }
}

/// Follows deletes under the lock prefix from `start` and feeds them to `releases`,
/// reconnecting for as long as the proxy runs.
pub async fn follow(mut client: WatchClient, releases: Arc<ReleaseWatch>, mut start: i64) {
    let root = keyspace::locks_root();
    loop {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(start)
            .with_filters([WatchFilterType::NoPut]);
        let mut stream = match client.watch(root, Some(options)).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "release watch could not start; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(resp)) => {
                    if resp.compact_revision() > 0 {
                        // History before our start is gone: we may have missed deletes.
                        tracing::warn!(
                            compacted = resp.compact_revision(),
                            "release watch compacted; waking all waiters"
                        );
                        releases.wake_all(resp.compact_revision());
                        start = resp.compact_revision();
                        break;
                    }
                    if resp.canceled() {
                        tracing::warn!(
                            reason = resp.cancel_reason(),
                            "release watch cancelled; restarting"
                        );
                        break;
                    }
                    for event in resp.events() {
                        if event.event_type() != EventType::Delete {
                            continue;
                        }
                        let Some(kv) = event.kv() else { continue };
                        if let Some(lock) = keyspace::lock_of_key(kv.key()) {
                            releases.deleted(&lock, kv.mod_revision());
                        }
                        start = start.max(kv.mod_revision() + 1);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "release watch broke; restarting");
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_delete_after_subscribing_wakes_the_waiter() {
        let releases = Arc::new(ReleaseWatch::default());
        let lock = LockName::parse("a").unwrap();
        let mut sub = releases.subscribe(&lock);
        releases.deleted(&lock, 10);
        let started = tokio::time::Instant::now();
        sub.released_after(9, Duration::from_secs(60)).await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "woken by the delete, not the timer"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_older_delete_does_not_wake_and_the_timer_does() {
        let releases = Arc::new(ReleaseWatch::default());
        let lock = LockName::parse("a").unwrap();
        let mut sub = releases.subscribe(&lock);
        releases.deleted(&lock, 5);
        let started = tokio::time::Instant::now();
        sub.released_after(9, Duration::from_secs(2)).await;
        assert!(started.elapsed() >= Duration::from_secs(2));
    }

    #[test]
    fn the_last_waiter_leaving_forgets_the_lock() {
        let releases = Arc::new(ReleaseWatch::default());
        let lock = LockName::parse("a").unwrap();
        let one = releases.subscribe(&lock);
        let two = releases.subscribe(&lock);
        drop(one);
        assert_eq!(releases.len(), 1);
        drop(two);
        assert!(releases.is_empty());
    }
}
