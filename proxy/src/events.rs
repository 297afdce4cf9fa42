//! What the proxy learns from its watch over the lock log, and who it tells.
//!
//! One etcd watch over `/l/` (every holder and release-marker event) and one over `/q/`
//! (fair waiters leaving the line) per proxy, however many clients wait or observe.
//! From them it:
//! - wakes the waiters of a lock when a holder key of it is deleted (per-lock channels
//!   carrying the revision of the latest delete; a waiter subscribes *before* it tries,
//!   so a delete between try and wait is not missed);
//! - wakes a fair waiter when the waiter just ahead of it leaves (per-key channels);
//! - tells election observers every change of an exclusive holder key, in order;
//! - remembers locks whose holder vanished without a clean release, for lock-delay.
//!
//! A missed event (the watch broke or was compacted) only delays a grant: waiters also
//! look again on a timer, and a compaction wakes every waiter.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use etcd_client::{EventType, WatchFilterType, WatchOptions};
use lockcell_cell::keyspace::{self, KeyKind, LockName};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::queues::Queues;

/// A change of an exclusive holder key, for election observers.
#[derive(Debug, Clone)]
pub struct HolderChange {
    /// The holder key's value after the change (None: deleted).
    pub value: Option<Vec<u8>>,
    pub create_revision: i64,
    /// The revision of the change.
    pub revision: i64,
}

/// Observer backlog per election; an observer that falls further behind re-reads.
const OBSERVER_BACKLOG: usize = 64;

/// The proxy's listeners on the lock log.
pub struct LockEvents {
    /// Per lock with local waiters: revision of the latest holder delete.
    locks: DashMap<LockName, watch::Sender<i64>>,
    /// Per waiter key a local fair waiter stands behind: revision of its delete.
    keys: DashMap<Vec<u8>, watch::Sender<i64>>,
    /// Per election with local observers.
    observers: DashMap<LockName, broadcast::Sender<HolderChange>>,
    /// Locks whose holder vanished without a clean release, and when this proxy saw it.
    unclean: DashMap<LockName, Instant>,
    /// When this proxy started watching: a holder that vanished just before it did went
    /// unseen, so lock-delay counts every lock as vanished at this instant.
    started: Instant,
    /// The local queues whose heads a release wakes.
    queues: Arc<Queues>,
    /// The revision of the last change under the locks root applied. The root is
    /// followed in order, so every change of a lock up to it has been applied.
    lock_log: watch::Sender<i64>,
}

/// A waiter's interest in one channel; dropping it forgets the channel when nobody waits.
pub struct Subscription<K: Eq + std::hash::Hash + Clone> {
    map: Arc<LockEvents>,
    key: K,
    rx: Option<watch::Receiver<i64>>,
    forget: fn(&LockEvents, &K),
}

impl Default for LockEvents {
    fn default() -> Self {
        Self::new()
    }
}

impl LockEvents {
    pub fn new() -> Self {
        LockEvents {
            locks: DashMap::new(),
            keys: DashMap::new(),
            observers: DashMap::new(),
            unclean: DashMap::new(),
            started: Instant::now(),
            queues: Arc::default(),
            lock_log: watch::channel(0).0,
        }
    }

    /// The local wait queues (classes that are not fair) this watch wakes.
    pub fn queues(&self) -> &Arc<Queues> {
        &self.queues
    }

    /// Wakes on every holder delete of `lock` after subscribing.
    pub fn subscribe_lock(self: &Arc<Self>, lock: &LockName) -> Subscription<LockName> {
        let rx = self
            .locks
            .entry(lock.clone())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Subscription {
            map: self.clone(),
            key: lock.clone(),
            rx: Some(rx),
            forget: |events, lock| {
                events
                    .locks
                    .remove_if(lock, |_, tx| tx.receiver_count() == 0);
            },
        }
    }

    /// Wakes when `key` (a fair waiter's predecessor) is deleted.
    pub fn subscribe_key(self: &Arc<Self>, key: &[u8]) -> Subscription<Vec<u8>> {
        let rx = self
            .keys
            .entry(key.to_vec())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Subscription {
            map: self.clone(),
            key: key.to_vec(),
            rx: Some(rx),
            forget: |events, key| {
                events.keys.remove_if(key, |_, tx| tx.receiver_count() == 0);
            },
        }
    }

    /// Every later change of `lock`'s exclusive holder key.
    pub fn observe(&self, lock: &LockName) -> broadcast::Receiver<HolderChange> {
        self.observers
            .entry(lock.clone())
            .or_insert_with(|| broadcast::channel(OBSERVER_BACKLOG).0)
            .subscribe()
    }

    /// When a grant of `lock` becomes allowed under a lock-delay of `delay`: `None` when
    /// it is allowed now.
    pub fn delayed_until(&self, lock: &LockName, delay: Duration) -> Option<Instant> {
        if delay.is_zero() {
            return None;
        }
        let now = Instant::now();
        let seen = self.unclean.get(lock).map(|at| *at + delay);
        let unseen = self.started + delay;
        seen.into_iter()
            .chain([unseen])
            .filter(|at| *at > now)
            .max()
    }

    /// Waits until the changes under the locks root are applied through `revision`, for
    /// at most `patience`; whether they were. Then every holder that vanished before
    /// `revision` counts in [`Self::delayed_until`].
    pub async fn lock_log_through(&self, revision: i64, patience: Duration) -> bool {
        let mut rx = self.lock_log.subscribe();
        let reached = tokio::time::timeout(patience, rx.wait_for(|seen| *seen >= revision))
            .await
            .is_ok_and(|seen| seen.is_ok());
        reached
    }

    /// Forgets vanished holders older than `longest` delay.
    pub fn prune(&self, longest: Duration) {
        let now = Instant::now();
        self.unclean
            .retain(|_, at| now.saturating_duration_since(*at) < longest);
        self.observers.retain(|_, tx| tx.receiver_count() > 0);
    }

    /// Events may have been missed up to `revision`: wake every waiter to look again.
    pub fn wake_all(&self, revision: i64) {
        self.queues.wake_all();
        for entry in self.locks.iter() {
            entry
                .value()
                .send_modify(|seen| *seen = (*seen).max(revision));
        }
        for entry in self.keys.iter() {
            entry
                .value()
                .send_modify(|seen| *seen = (*seen).max(revision));
        }
    }

    /// Locks with local waiters now.
    pub fn waited_locks(&self) -> usize {
        self.locks.len()
    }

    fn holder_deleted(&self, lock: &LockName, revision: i64, clean: bool) {
        if !clean {
            self.unclean.insert(lock.clone(), Instant::now());
        }
        self.queues.released(lock);
        if let Some(tx) = self.locks.get(lock) {
            tx.send_if_modified(|seen| std::mem::replace(seen, (*seen).max(revision)) < revision);
        }
    }

    fn key_deleted(&self, key: &[u8], revision: i64) {
        if let Some(tx) = self.keys.get(key) {
            tx.send_if_modified(|seen| std::mem::replace(seen, (*seen).max(revision)) < revision);
        }
    }

    fn holder_changed(&self, lock: &LockName, change: HolderChange) {
        if let Some(tx) = self.observers.get(lock) {
            let _ = tx.send(change);
        }
    }

    /// Applies one watch response's events (all of one or more whole revisions).
    pub fn apply(&self, events: &[etcd_client::Event]) {
        // A clean release deletes the holder key and writes the release marker in the
        // same revision.
        let marked: HashSet<(LockName, i64)> = events
            .iter()
            .filter(|e| e.event_type() == EventType::Put)
            .filter_map(|e| e.kv())
            .filter_map(|kv| match keyspace::parse_key(kv.key()) {
                Some((lock, KeyKind::Released)) => Some((lock, kv.mod_revision())),
                _ => None,
            })
            .collect();
        let locks_root = keyspace::locks_root().as_bytes();
        let mut lock_log = None;
        for event in events {
            let Some(kv) = event.kv() else { continue };
            if kv.key().starts_with(locks_root) {
                lock_log = lock_log.max(Some(kv.mod_revision()));
            }
            let Some((lock, kind)) = keyspace::parse_key(kv.key()) else {
                continue;
            };
            let revision = kv.mod_revision();
            let deleted = event.event_type() == EventType::Delete;
            match kind {
                KeyKind::Exclusive | KeyKind::Shared if deleted => {
                    let clean = marked.contains(&(lock.clone(), revision));
                    self.holder_deleted(&lock, revision, clean);
                }
                KeyKind::Waiter if deleted => self.key_deleted(kv.key(), revision),
                _ => {}
            }
            if kind == KeyKind::Exclusive {
                self.holder_changed(
                    &lock,
                    HolderChange {
                        value: (!deleted).then(|| kv.value().to_vec()),
                        create_revision: kv.create_revision(),
                        revision,
                    },
                );
            }
        }
        if let Some(last) = lock_log {
            self.lock_log.send_if_modified(|seen| {
                let later = last > *seen;
                *seen = (*seen).max(last);
                later
            });
        }
    }
}

impl<K: Eq + std::hash::Hash + Clone> Subscription<K> {
    /// Waits until a delete newer than `seen_at` is seen, or `patience` has passed.
    pub async fn changed_after(&mut self, seen_at: i64, patience: Duration) -> bool {
        let rx = self.rx.as_mut().expect("receiver lives until drop");
        matches!(
            tokio::time::timeout(patience, rx.wait_for(|rev| *rev > seen_at)).await,
            Ok(Ok(_))
        )
    }
}

impl<K: Eq + std::hash::Hash + Clone> Drop for Subscription<K> {
    fn drop(&mut self) {
        drop(self.rx.take());
        (self.forget)(&self.map, &self.key);
    }
}

/// What [`follow`] reads with and tells of what it reads.
pub struct Following {
    pub events: Arc<LockEvents>,
    pub etcd: etcd_client::Client,
    /// Told of the revisions seen, to find a store that went back.
    pub cell: Arc<crate::cellguard::CellGuard>,
    pub timeout: Duration,
}

/// Follows `root` from `start` (deletes only when `deletes_only`) and feeds `events`,
/// reconnecting for as long as the proxy runs.
pub async fn follow(with: Following, root: &'static str, deletes_only: bool, mut start: i64) {
    let Following {
        events,
        etcd,
        cell,
        timeout,
    } = with;
    // Whole lease revocations arrive as one message.
    let mut client = etcd
        .watch_client()
        .max_decoding_message_size(crate::feed::MAX_WATCH_MESSAGE_BYTES);
    loop {
        let mut options = WatchOptions::new().with_prefix().with_start_revision(start);
        if deletes_only {
            options = options.with_filters([WatchFilterType::NoPut]);
        }
        let mut stream = match client.watch(root, Some(options)).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(root, error = %e, "lock-log watch could not start; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let _counted = crate::metrics::Counted::in_gauge(crate::metrics::ETCD_WATCHES);
        loop {
            match stream.message().await {
                Ok(Some(resp)) => {
                    if let Some(header) = resp.header() {
                        if resp.created() && header.revision() < start - 1 {
                            // The store answers a watch from `start` at its revision
                            // now, which is at least `start - 1` unless it went back
                            // (or the member lags: a linearizable read decides).
                            let (cell, etcd) = (cell.clone(), etcd.clone());
                            tokio::spawn(async move {
                                cell.check_not_behind(&etcd, start - 1, timeout).await
                            });
                        } else if !resp.created() {
                            cell.saw(header.revision());
                        }
                    }
                    if resp.compact_revision() > 0 {
                        tracing::warn!(
                            root,
                            compacted = resp.compact_revision(),
                            "lock-log watch compacted; waking all waiters"
                        );
                        events.wake_all(resp.compact_revision());
                        start = resp.compact_revision();
                        break;
                    }
                    if resp.canceled() {
                        tracing::warn!(
                            root,
                            reason = resp.cancel_reason(),
                            "lock-log watch cancelled; restarting"
                        );
                        break;
                    }
                    events.apply(resp.events());
                    if let Some(last) = resp
                        .events()
                        .iter()
                        .filter_map(|e| e.kv())
                        .map(|kv| kv.mod_revision())
                        .max()
                    {
                        start = start.max(last + 1);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(root, error = %e, "lock-log watch broke; restarting");
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
        let events = Arc::new(LockEvents::new());
        let lock = LockName::parse("a").unwrap();
        let mut sub = events.subscribe_lock(&lock);
        events.holder_deleted(&lock, 10, true);
        let started = Instant::now();
        sub.changed_after(9, Duration::from_secs(60)).await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "woken by the delete, not the timer"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_older_delete_does_not_wake_and_the_timer_does() {
        let events = Arc::new(LockEvents::new());
        let key = b"/q/a/!x/s1".to_vec();
        let mut sub = events.subscribe_key(&key);
        events.key_deleted(&key, 5);
        let started = Instant::now();
        sub.changed_after(9, Duration::from_secs(2)).await;
        assert!(started.elapsed() >= Duration::from_secs(2));
    }

    #[test]
    fn the_last_waiter_leaving_forgets_the_lock() {
        let events = Arc::new(LockEvents::new());
        let lock = LockName::parse("a").unwrap();
        let one = events.subscribe_lock(&lock);
        let two = events.subscribe_lock(&lock);
        drop(one);
        assert_eq!(events.waited_locks(), 1);
        drop(two);
        assert_eq!(events.waited_locks(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn only_an_unclean_vanishing_delays_a_grant() {
        let events = LockEvents::new();
        let lock = LockName::parse("a").unwrap();
        let delay = Duration::from_secs(10);
        tokio::time::advance(delay).await;
        events.holder_deleted(&lock, 5, true);
        assert_eq!(
            events.delayed_until(&lock, delay),
            None,
            "a clean release lets the next in at once"
        );
        events.holder_deleted(&lock, 6, false);
        let until = events.delayed_until(&lock, delay).expect("delayed");
        assert_eq!(until, Instant::now() + delay);
        assert_eq!(
            events.delayed_until(&lock, Duration::ZERO),
            None,
            "no delay on fenced classes"
        );
        tokio::time::advance(delay).await;
        assert_eq!(events.delayed_until(&lock, delay), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_proxy_counts_every_lock_as_vanished_at_its_start() {
        let events = LockEvents::new();
        let lock = LockName::parse("never-seen").unwrap();
        assert_eq!(
            events.delayed_until(&lock, Duration::from_secs(5)),
            Some(Instant::now() + Duration::from_secs(5))
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(events.delayed_until(&lock, Duration::from_secs(5)), None);
    }
}
