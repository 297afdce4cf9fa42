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
