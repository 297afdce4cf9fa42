//! Keys of ended sessions that still have to be deleted from etcd.
//!
//! When a session ends (expired or closed) its grants are deleted in guarded
//! transactions. If etcd does not answer, the work waits here and the reaper retries it;
//! work for a lease the proxy has since lost is dropped, since etcd removes those keys
//! with the lease.

use std::collections::BTreeMap;
use std::sync::Mutex;

use lockcell_cell::locklog::Grant;

use crate::state::ProxyState;

/// Grants to delete, by the lease they are attached to.
#[derive(Default)]
pub struct CleanupQueue {
    pending: Mutex<BTreeMap<i64, Vec<Grant>>>,
}

impl CleanupQueue {
    pub fn push(&self, lease: i64, grants: Vec<Grant>) {
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
        self.pending
            .lock()
            .expect("cleanup queue")
            .values()
            .map(Vec::len)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tries every pending delete once; what etcd refused stays queued.
    pub async fn run(&self, state: &ProxyState) {
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
}
