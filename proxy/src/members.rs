//! One etcd client per member of a cell, for the proxy's lease renewals.
//!
//! The proxy's main client balances calls over every member, and goes on handing new
//! streams to a member that stopped answering (a dead host, a frozen process) while its
//! connection looks open: a lease whose renewals keep landing there is lost. Renewals
//! go instead to one member at a time, the first listed (the zone's own, by the
//! deployment's convention) until a renewal fails, then the next.
//!
//! "The next" skips a member that went silent (a call to it got no reply in time) within
//! [`SILENT_FOR`], unless every other member did too. Losing the etcd leader makes this
//! matter: the frozen leader goes silent, and the live members refuse with "no leader"
//! until they elect a new one, within about a second. Moving on from a refusal in plain
//! order would come back to the frozen member, and an attempt there waits the whole
//! attempt time, long enough to outlast a short lease.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex as SyncMutex;
use std::time::Duration;

use etcd_client::ConnectOptions;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// How long a member that gave no reply in time is passed over when renewals move.
pub const SILENT_FOR: Duration = Duration::from_secs(30);

/// How a call through a member failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No reply in time: the member may be frozen or its host gone.
    Silent,
    /// The member answered with an error (no leader, connection refused, a stream that
    /// ended): it is there, and may serve again soon.
    Answered,
}

/// The cell's members, each with a client made when first needed.
pub struct Members {
    endpoints: Vec<String>,
    options: ConnectOptions,
    connect_timeout: Duration,
    clients: Vec<Mutex<Option<etcd_client::Client>>>,
    /// When each member last gave no reply in time, while that still counts.
    silent: SyncMutex<Vec<Option<Instant>>>,
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
            silent: SyncMutex::new(vec![None; endpoints.len()]),
            current: AtomicUsize::new(0),
        }
    }

    /// The member renewals go to now, and a lease client of it, or how connecting to it
    /// failed within the connect timeout (the caller moves on with [`Members::failed`]).
    pub async fn lease_client(&self) -> (usize, Result<etcd_client::LeaseClient, Failure>) {
        let at = self.current.load(Ordering::Relaxed) % self.endpoints.len().max(1);
        let Some(slot) = self.clients.get(at) else {
            return (at, Err(Failure::Answered));
        };
        let mut slot = slot.lock().await;
        if let Some(client) = slot.as_ref() {
            return (at, Ok(client.lease_client()));
        }
        let connect =
            etcd_client::Client::connect([self.endpoints[at].clone()], Some(self.options.clone()));
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(client)) => (at, Ok(slot.insert(client).lease_client())),
            Ok(Err(error)) => {
                tracing::warn!(member = %self.endpoints[at], %error, "cannot reach this etcd member for lease renewals");
                (at, Err(Failure::Answered))
            }
            Err(_) => {
                tracing::warn!(member = %self.endpoints[at], "this etcd member did not answer in time for lease renewals");
                (at, Err(Failure::Silent))
            }
        }
    }

    /// A renewal through member `at` succeeded: it counts as silent no longer.
    pub fn answered(&self, at: usize) {
        if let Some(mark) = self.silent.lock().expect("silent marks").get_mut(at) {
            *mark = None;
        }
    }

    /// A renewal through member `at` failed: the next renewals go to the next member
    /// that has not gone silent lately (once, however many renewals saw `at` fail), on a
    /// new connection when they come back to it.
    pub async fn failed(&self, at: usize, how: Failure) {
        let next = {
            let mut silent = self.silent.lock().expect("silent marks");
            let now = Instant::now();
            if how == Failure::Silent {
                if let Some(mark) = silent.get_mut(at) {
                    *mark = Some(now);
                }
            }
            next_member(at, &silent, now)
        };
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

/// The member after `at` in the list that has not gone silent within [`SILENT_FOR`] of
/// `now`; the plain next when every other member has.
fn next_member(at: usize, silent: &[Option<Instant>], now: Instant) -> usize {
    let n = silent.len().max(1);
    let quiet = |i: usize| silent[i].is_some_and(|since| now.duration_since(since) < SILENT_FOR);
    (1..n)
        .map(|step| (at + step) % n)
        .find(|&i| !quiet(i))
        .unwrap_or((at + 1) % n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_in_order_when_no_member_went_silent() {
        let now = Instant::now();
        assert_eq!(next_member(0, &[None, None, None], now), 1);
        assert_eq!(next_member(2, &[None, None, None], now), 0);
        assert_eq!(next_member(0, &[None], now), 0);
    }

    #[test]
    fn passes_over_a_member_that_went_silent_lately() {
        let now = Instant::now();
        // The leader (0) froze; 1 refuses with "no leader": renewals go to 2, and from
        // 2 back to 1, never to the frozen leader.
        let silent = [Some(now), None, None];
        assert_eq!(next_member(1, &silent, now), 2);
        assert_eq!(next_member(2, &silent, now), 1);
    }

    #[test]
    fn a_silence_long_past_counts_no_more() {
        let now = Instant::now();
        let then = now.checked_sub(SILENT_FOR).expect("an instant in the past");
        assert_eq!(next_member(2, &[Some(then), None, None], now), 0);
    }

    #[test]
    fn when_every_other_member_went_silent_moves_in_order() {
        let now = Instant::now();
        let silent = [None, Some(now), Some(now)];
        assert_eq!(next_member(0, &silent, now), 1);
        assert_eq!(next_member(1, &silent, now), 0);
    }
}
