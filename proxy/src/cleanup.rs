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
//! from everyone.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use lockcell_cell::locklog::Grant;
use tokio::time::Instant;

use crate::state::ProxyState;

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
    pub async fn run(&self, state: &ProxyState) {
        self.look_out(state).await;
        let work = std::mem::take(&mut *self.pending.lock().expect("cleanup queue"));
        let leases = state.leases.leases();
        for (lease, grants) in work {
            if !leases.contains(&lease) {
                continue;
            }
            // Ended sessions' holds vanished without a release: no clean-release marker.
            match state.locklog.delete_guarded(&grants, lease, false).await {
                Ok(deleted) => tracing::debug!(lease, deleted, "cleaned up ended sessions' locks"),
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
    async fn look_out(&self, state: &ProxyState) {
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
        let leases = state.leases.leases();
        for (lease, grant) in due {
            if !leases.contains(&lease) {
                continue;
            }
            match state
                .locklog
                .settle(std::slice::from_ref(&grant), lease)
                .await
            {
                Ok(found) if !found.is_empty() => {
                    // Unless a retry of the same call has since taken it as its own, or
                    // is about to (its own record of the key is there, settled or not).
                    let session = grant.made_by.as_ref().map(|m| m.session.as_str());
                    let found: Vec<Grant> = found
                        .into_iter()
                        .filter(|g| {
                            !session.is_some_and(|s| {
                                state.sessions.holds(s, &g.key, g.revision)
                                    || state.sessions.has_other_record(s, &g.key, &grant)
                            })
                        })
                        .collect();
                    if !found.is_empty() {
                        tracing::info!(key = %grant.key, "a key whose transaction had no answer turned up; deleting it");
                        self.push(lease, found);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(key = %grant.key, error = %e, "could not look for an unsettled key; will look again")
                }
            }
        }
    }
}
