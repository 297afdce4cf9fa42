//! One etcd client per member of a cell, for the proxy's lease renewals.
//!
//! The proxy's main client balances calls over every member, and goes on handing new
//! streams to a member that stopped answering (a dead host, a frozen process) while its
//! connection looks open: a lease whose renewals keep landing there is lost. Renewals
//! go instead to one member at a time, the first listed (the zone's own, by the
//! deployment's convention) until a renewal fails, then the next.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::ConnectOptions;
use tokio::sync::Mutex;

/// The cell's members, each with a client made when first needed.
pub struct Members {
    endpoints: Vec<String>,
    options: ConnectOptions,
    connect_timeout: Duration,
    clients: Vec<Mutex<Option<etcd_client::Client>>>,
    /// The member renewals go to now.
    current: AtomicUsize,
}

impl Members {
    pub fn new(
        endpoints: &[String],
        options: ConnectOptions,
        connect_timeout: Duration,
    ) -> Members {
        Members {
            endpoints: endpoints.to_vec(),
            options,
            connect_timeout,
            clients: endpoints.iter().map(|_| Mutex::new(None)).collect(),
            current: AtomicUsize::new(0),
        }
    }

    /// The member renewals go to now, and a lease client of it; `None` when it cannot
    /// be reached within the connect timeout (the caller moves on with [`Members::failed`]).
    pub async fn lease_client(&self) -> (usize, Option<etcd_client::LeaseClient>) {
        let at = self.current.load(Ordering::Relaxed) % self.endpoints.len().max(1);
        let Some(slot) = self.clients.get(at) else {
            return (at, None);
        };
        let mut slot = slot.lock().await;
        if slot.is_none() {
            let connect = etcd_client::Client::connect(
                [self.endpoints[at].clone()],
                Some(self.options.clone()),
            );
            match tokio::time::timeout(self.connect_timeout, connect).await {
                Ok(Ok(client)) => *slot = Some(client),
                Ok(Err(error)) => {
                    tracing::warn!(member = %self.endpoints[at], %error, "cannot reach this etcd member for lease renewals");
                    return (at, None);
                }
                Err(_) => {
                    tracing::warn!(member = %self.endpoints[at], "this etcd member did not answer in time for lease renewals");
                    return (at, None);
                }
            }
        }
        (at, slot.as_ref().map(etcd_client::Client::lease_client))
    }

    /// A renewal through member `at` failed: the next renewals go to the next member
    /// (once, however many renewals saw `at` fail), on a new connection when they come
    /// back to it.
    pub async fn failed(&self, at: usize) {
        let next = (at + 1) % self.endpoints.len().max(1);
        if self
            .current
            .compare_exchange(at, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            if let Some(slot) = self.clients.get(at) {
                *slot.lock().await = None;
            }
            tracing::info!(
                from = %self.endpoints[at],
                to = %self.endpoints[next],
                "lease renewals move to another etcd member"
            );
        }
    }
}
