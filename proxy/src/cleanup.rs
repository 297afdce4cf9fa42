//! Keys of ended sessions that still have to be deleted from etcd, and keys whose
//! creating transaction's outcome is unknown.
//!
//! When a session ends (expired or closed) its grants are deleted in guarded
//! transactions. If etcd does not answer, the work waits here and the reaper retries it;
//! work for a lease the proxy has since lost is dropped, since etcd removes those keys
//! with the lease.
//!
//! A key that a transaction without an answer may have created (an unsettled grant,
//! see [`Grant::unsettled_hold`]) is looked for once a second for [`LOOKOUT`]: a
//! transaction held up on its way to etcd can still be applied after a first read
//! found nothing, and a key nobody owns would keep its lock, or its place in line,
//! from everyone. A waiter key found is deleted unless a call waiting in line now
//! claims it ([`Claims`]): a retry of its call (same call id) that took it up.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockcell_cell::locklog::{Grant, LockLog};
use tokio::time::Instant;

use crate::leases::LeaseBook;
use crate::sessions::SessionTable;

/// How long an unsettled key is looked for. etcd gives up on a request it has not
/// applied within its request timeout (about 7 s with default settings); the rest is
/// for a request held up on the way there (a stalled link).
pub const LOOKOUT: Duration = Duration::from_secs(60);
/// How often an unsettled key is looked for.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Grants to delete, by the lease they are attached to.
#[derive(Default)]
pub struct CleanupQueue {
    pending: Mutex<BTreeMap<i64, Vec<Grant>>>,
    unsettled: Mutex<Vec<Lookout>>,
    /// The waiter keys calls stand in line with now.
    pub claims: Claims,
}

/// The waiter keys that calls waiting in line on this proxy stand with (or are about
/// to: claimed before the enqueue goes out). Such a call takes its key out of line
/// itself when its wait ends; any other waiter key of the proxy's whose outcome was
/// unknown belongs to no wait, and would keep every waiter behind it waiting.
#[derive(Default, Clone)]
pub struct Claims(Arc<Mutex<HashMap<String, usize>>>);

/// A call's claim on its waiter key, given up when dropped.
pub struct Claim {
    claims: Claims,
    key: String,
}

impl Claims {
    /// Claims `key` for a call until the returned claim drops (two attempts of one call
    /// may hold claims on one key at once).
    pub fn claim(&self, key: &str) -> Claim {
        *self
            .0
            .lock()
            .expect("claims")
            .entry(key.to_owned())
            .or_default() += 1;
        Claim {
            claims: self.clone(),
            key: key.to_owned(),
        }
    }

    pub fn is_claimed(&self, key: &str) -> bool {
        self.0.lock().expect("claims").contains_key(key)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut claims = self.claims.0.lock().expect("claims");
        if let Some(count) = claims.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                claims.remove(&self.key);
            }
        }
    }
}

/// An unsettled key to look for, and delete if it turns up.
struct Lookout {
    lease: i64,
    grant: Grant,
    next: Instant,
    until: Instant,
}

impl CleanupQueue {
    /// Queues `grants` on `lease` for deletion; unsettled ones are looked for until
    /// [`LOOKOUT`] from now, and deleted if they turn up.
    pub fn push(&self, lease: i64, grants: Vec<Grant>) {
        let (unsettled, grants): (Vec<Grant>, Vec<Grant>) =
            grants.into_iter().partition(Grant::is_unsettled);
        if !unsettled.is_empty() {
            let now = Instant::now();
            let mut lookouts = self.unsettled.lock().expect("cleanup queue");
            for grant in unsettled {
                if !lookouts
                    .iter()
                    .any(|l| l.lease == lease && l.grant == grant)
                {
                    lookouts.push(Lookout {
                        lease,
                        grant,
                        next: now,
                        until: now + LOOKOUT,
                    });
                }
            }
        }
        if grants.is_empty() {
            return;
        }
        self.pending
            .lock()
            .expect("cleanup queue")
            .entry(lease)
            .or_default()
            .extend(grants);
    }

    pub fn len(&self) -> usize {
        let pending: usize = self
            .pending
            .lock()
            .expect("cleanup queue")
            .values()
            .map(Vec::len)
            .sum();
        pending + self.unsettled.lock().expect("cleanup queue").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Looks for the unsettled keys that are due, then tries every pending delete once;
    /// what etcd refused stays queued.
    pub async fn run(&self, leases: &LeaseBook, locklog: &LockLog, sessions: &SessionTable) {
        self.look_out(leases, locklog, sessions).await;
        let work = std::mem::take(&mut *self.pending.lock().expect("cleanup queue"));
        let leases = leases.leases();
        for (lease, grants) in work {
            if !leases.contains(&lease) {
                continue;
            }
            // Ended sessions' holds vanished without a release: no clean-release marker.
            match locklog.delete_guarded(&grants, lease, false).await {
                Ok(deleted) => {
                    tracing::debug!(
                        lease,
                        deleted = deleted.keys,
                        "cleaned up ended sessions' keys"
                    )
                }
                Err(e) => {
                    tracing::warn!(lease, error = %e, grants = grants.len(), "clean-up failed; will retry");
                    self.push(lease, grants);
                }
            }
        }
        metrics::gauge!(crate::metrics::CLEANUPS_PENDING).set(self.len() as f64);
    }

    /// Reads each unsettled key that is due; one that turned up is queued for its
    /// guarded delete. Each is looked for until its time is up, even once found: two
    /// attempts of one call may both be on their way.
    async fn look_out(&self, leases: &LeaseBook, locklog: &LockLog, sessions: &SessionTable) {
        let now = Instant::now();
        let due: Vec<(i64, Grant)> = {
            let mut lookouts = self.unsettled.lock().expect("cleanup queue");
            lookouts.retain(|l| l.until > now);
            lookouts
                .iter_mut()
                .filter(|l| l.next <= now)
                .map(|l| {
                    l.next = now + LOOK_EVERY;
                    (l.lease, l.grant.clone())
                })
                .collect()
        };
        let leases = leases.leases();
        for (lease, grant) in due {
            if !leases.contains(&lease) {
                continue;
            }
            match locklog.settle(std::slice::from_ref(&grant), lease).await {
                Ok(found) if !found.is_empty() => {
                    // Unless a retry of the same call has since taken it as its own, or
                    // is about to: a waiter key, if a call in line claims it; a grant or
                    // an ephemeral key, if the session has its own record of it
                    // (settled or not), since deleting it could race that call.
                    let session = grant.made_by.as_ref().map(|m| m.session.as_str());
                    let found: Vec<Grant> = found
                        .into_iter()
                        .filter(|g| {
                            if g.key.starts_with(lockcell_cell::keyspace::queues_root()) {
                                return !self.claims.is_claimed(&g.key);
                            }
                            !session.is_some_and(|s| {
                                sessions.holds(s, &g.key, g.revision)
                                    || sessions.has_other_record(s, &g.key, &grant)
                            })
                        })
                        .collect();
                    if found.is_empty() {
                        tracing::debug!(key = %grant.key, "a key whose transaction had no answer turned up; the session has it as its own");
                    } else {
                        tracing::info!(key = %grant.key, "a key whose transaction had no answer turned up; deleting it");
                        self.push(lease, found);
                    }
                }
                Ok(_) => tracing::debug!(key = %grant.key, lease, "an unsettled key is not there"),
                Err(e) => {
                    tracing::debug!(key = %grant.key, error = %e, "could not look for an unsettled key; will look again")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockcell_cell::keyspace::{LockName, Mode};
    use lockcell_cell::locklog::memory::MemoryStore;
    use lockcell_cell::locklog::{Acquired, HolderRecord};

    const LEASE: i64 = 0x1ea5e;

    /// A queue, and the lock log, lease book and sessions it runs against, over an
    /// in-memory store holding this proxy's one lease.
    struct Bench {
        store: Arc<MemoryStore>,
        locklog: LockLog,
        leases: LeaseBook,
        sessions: SessionTable,
        queue: CleanupQueue,
    }

    impl Bench {
        fn new() -> Self {
            let store = Arc::new(MemoryStore::new());
            store.grant_lease(LEASE);
            let now = Instant::now();
            let leases = LeaseBook::new(1, Duration::from_millis(500), 0.0, now);
            leases.install(
                0,
                LEASE,
                (now, leases.generation()),
                Duration::from_secs(10),
            );
            Bench {
                locklog: LockLog::over(store.clone(), Duration::from_secs(1)),
                store,
                leases,
                sessions: SessionTable::default(),
                queue: CleanupQueue::default(),
            }
        }

        async fn run(&self) {
            self.queue
                .run(&self.leases, &self.locklog, &self.sessions)
                .await
        }

        /// `session`'s call `call` grants it `lock`, as a transaction applied late.
        async fn grant(&self, lock: &LockName, session: &str, call: &str) -> i64 {
            let record = HolderRecord {
                session: session.into(),
                call: call.into(),
                ..HolderRecord::default()
            };
            match self
                .locklog
                .acquire(lock, Mode::Exclusive, LEASE, &record, None, 0)
                .await
            {
                Ok(Acquired::Granted { revision, .. }) => revision,
                other => panic!("not granted: {other:?}"),
            }
        }

        fn held(&self, lock: &LockName, session: &str) -> bool {
            self.store
                .key(&lock.holder_key(Mode::Exclusive, session))
                .is_some()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_whose_answer_never_came_is_deleted_when_it_lands_late() {
        let bench = Bench::new();
        let lock = LockName::parse("jobs/late").unwrap();
        let unknown = Grant::unsettled_hold(&lock, Mode::Exclusive, "sa", "call-1");
        bench.queue.push(LEASE, vec![unknown]);
        bench.run().await;
        assert_eq!(bench.queue.len(), 1, "not there yet: still looked for");
        // Held up on its way, the transaction is applied 30 s later.
        tokio::time::advance(Duration::from_secs(30)).await;
        bench.grant(&lock, "sa", "call-1").await;
        bench.run().await;
        assert!(
            !bench.held(&lock, "sa"),
            "a key no call owns keeps its lock from everyone"
        );
        // Looked for until the lookout ends, in case another attempt is on its way.
        assert_eq!(bench.queue.len(), 1);
        tokio::time::advance(LOOKOUT).await;
        bench.run().await;
        assert!(bench.queue.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn another_calls_grant_at_the_same_key_is_left_be() {
        let bench = Bench::new();
        let lock = LockName::parse("jobs/other").unwrap();
        let unknown = Grant::unsettled_hold(&lock, Mode::Exclusive, "sa", "call-1");
        bench.queue.push(LEASE, vec![unknown]);
        // The call never landed; a later call of the session holds the lock.
        bench.grant(&lock, "sa", "call-2").await;
        for _ in 0..3 {
            tokio::time::advance(LOOK_EVERY).await;
            bench.run().await;
        }
        assert!(bench.held(&lock, "sa"), "another call's grant was deleted");
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_that_lands_after_the_lookout_is_no_longer_looked_for() {
        let bench = Bench::new();
        let lock = LockName::parse("jobs/later").unwrap();
        let unknown = Grant::unsettled_hold(&lock, Mode::Exclusive, "sa", "call-1");
        bench.queue.push(LEASE, vec![unknown]);
        tokio::time::advance(LOOKOUT + LOOK_EVERY).await;
        bench.run().await;
        assert!(bench.queue.is_empty());
        let writes = bench.store.writes();
        bench.grant(&lock, "sa", "call-1").await;
        bench.run().await;
        assert_eq!(
            bench.store.writes(),
            writes + 1,
            "only the late grant wrote"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_clean_up_etcd_did_not_take_is_tried_again_and_done_once() {
        let bench = Bench::new();
        let lock = LockName::parse("jobs/retry").unwrap();
        let revision = bench.grant(&lock, "sa", "call-1").await;
        let hold = Grant::hold(&lock, Mode::Exclusive, "sa", revision);
        bench.queue.push(LEASE, vec![hold.clone()]);
        bench.store.set_down(true);
        bench.run().await;
        assert_eq!(bench.queue.len(), 1, "kept for the next run");
        bench.store.set_down(false);
        // The delete applied, its answer lost: tried again, and found done.
        bench.store.lose_answers(1);
        bench.run().await;
        assert!(!bench.held(&lock, "sa"));
        assert_eq!(bench.queue.len(), 1);
        // The session holds the lock again, at the same key, before the retry.
        let again = bench.grant(&lock, "sa", "call-2").await;
        bench.run().await;
        assert!(bench.queue.is_empty());
        assert!(again > revision);
        assert!(
            bench.held(&lock, "sa"),
            "the retried delete took the later grant"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn clean_ups_on_a_lease_this_proxy_lost_are_dropped() {
        let bench = Bench::new();
        let lock = LockName::parse("jobs/lost-lease").unwrap();
        let revision = bench.grant(&lock, "sa", "call-1").await;
        bench.queue.push(
            LEASE,
            vec![Grant::hold(&lock, Mode::Exclusive, "sa", revision)],
        );
        assert!(bench.leases.clear(0, LEASE));
        let writes = bench.store.writes();
        bench.run().await;
        assert!(bench.queue.is_empty());
        assert_eq!(
            bench.store.writes(),
            writes,
            "etcd removes the keys with the lease"
        );
    }

    #[test]
    fn a_claim_lasts_until_its_last_holder_lets_go() {
        let claims = Claims::default();
        let first = claims.claim("/q/l/!x/w");
        let second = claims.claim("/q/l/!x/w");
        assert!(claims.is_claimed("/q/l/!x/w"));
        assert!(!claims.is_claimed("/q/l/!x/v"));
        drop(first);
        assert!(
            claims.is_claimed("/q/l/!x/w"),
            "the second attempt still claims it"
        );
        drop(second);
        assert!(!claims.is_claimed("/q/l/!x/w"));
    }
}
