//! The cell-wide bound on what small keys hold (`--max-kv-total-bytes`), as one proxy
//! keeps it: its copy of every small key says what the cell holds, and the writes it
//! let through that its copy does not show yet are reserved here, so writes racing on
//! this proxy never pass the bound together.
//!
//! Writes racing on other proxies are not seen until their copies meet: each proxy lets
//! at most [`IN_FLIGHT_SHARE`] of the bound be in flight at once (or one write, if that
//! write is larger), which bounds how far the cell can pass it to that share per proxy.

use std::sync::Mutex;

use crate::errors::ProxyError;
use crate::feed::Feed;

/// The share of the bound one proxy may have in flight (written, not yet in its copy).
pub const IN_FLIGHT_SHARE: usize = 32;

/// How long a write waits for this proxy's writes in flight to land.
const PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// How often it looks again while writes are in flight.
const RETRY: std::time::Duration = std::time::Duration::from_millis(5);

/// Writes this proxy let through that its copy may not show yet.
#[derive(Debug, Default)]
pub struct KvBudget {
    reserved: Mutex<Reserved>,
}

#[derive(Debug, Default)]
struct Reserved {
    next: u64,
    /// Ticket, the revision the write landed at (0 while in flight) and its growth.
    writes: Vec<(u64, i64, usize)>,
}

/// A write let through: hold it until the write answers, then say where it landed.
#[must_use]
pub struct Admitted<'a> {
    budget: &'a KvBudget,
    ticket: Option<u64>,
}

impl KvBudget {
    /// Lets `writes` (each a key and its new value's length, or `None` for a delete)
    /// through if the cell's small keys, with what is reserved, stay within `limit`;
    /// refuses (RESOURCE_EXHAUSTED, naming the limit) otherwise. While this proxy has
    /// its share in flight, waits (up to [`PATIENCE`]) for its copy to show the writes
    /// that landed, then refuses as busy (UNAVAILABLE: try again).
    pub async fn admit<'a>(
        &'a self,
        feed: &Feed,
        limit: usize,
        writes: &[(&str, Option<usize>)],
    ) -> Result<Admitted<'a>, ProxyError> {
        let give_up = tokio::time::Instant::now() + PATIENCE;
        loop {
            let wait_for = match self.try_admit(feed, limit, writes)? {
                Ok(admitted) => return Ok(admitted),
                Err(wait_for) => wait_for,
            };
            let now = tokio::time::Instant::now();
            if now >= give_up {
                let keys: Vec<&str> = writes.iter().map(|(name, _)| *name).collect();
                return Err(ProxyError::Busy(format!(
                    "writing {keys:?} now would put more than 1/{IN_FLIGHT_SHARE} of \
                     --max-kv-total-bytes ({} bytes) in flight through this proxy; try again \
                     once the writes in flight land",
                    limit / IN_FLIGHT_SHARE
                )));
            }
            match wait_for {
                Some(revision) => {
                    feed.applied_through(revision, give_up - now).await;
                }
                None => tokio::time::sleep(RETRY.min(give_up - now)).await,
            }
        }
    }

    /// One look: admitted, refused, or `Err(Some(revision))` to wait until the copy
    /// shows `revision` (`None`: until writes in flight land) before looking again.
    fn try_admit<'a>(
        &'a self,
        feed: &Feed,
        limit: usize,
        writes: &[(&str, Option<usize>)],
    ) -> Result<Result<Admitted<'a>, Option<i64>>, ProxyError> {
        let (held, revision, growth) =
            feed.with_mirror(|m| (m.bytes(), m.revision(), m.net_growth(writes)));
        let mut reserved = self.reserved.lock().expect("kv budget lock");
        if growth <= 0 {
            return Ok(Ok(Admitted {
                budget: self,
                ticket: None,
            }));
        }
        let growth = growth as usize;
        // What the copy shows now needs no reservation any more.
        reserved
            .writes
            .retain(|(_, landed, _)| *landed == 0 || *landed > revision);
        let pending: usize = reserved.writes.iter().map(|(_, _, g)| g).sum();
        let total = held + pending + growth;
        if total > limit {
            let keys: Vec<&str> = writes.iter().map(|(name, _)| *name).collect();
            return Err(ProxyError::Exhausted(format!(
                "writing {keys:?} would take the cell's small keys to {total} bytes, over the \
                 limit of {limit} bytes (--max-kv-total-bytes; every proxy keeps a copy of \
                 every small key); they hold {held} bytes now{}: delete keys no longer \
                 needed, or raise the limit on every proxy",
                if pending > 0 {
                    format!(", and {pending} more are being written through this proxy")
                } else {
                    String::new()
                }
            )));
        }
        if pending > 0 && pending + growth > limit / IN_FLIGHT_SHARE {
            let landed = reserved.writes.iter().map(|(_, landed, _)| *landed).max();
            return Ok(Err(landed.filter(|r| *r > 0)));
        }
        reserved.next += 1;
        let ticket = reserved.next;
        reserved.writes.push((ticket, 0, growth));
        Ok(Ok(Admitted {
            budget: self,
            ticket: Some(ticket),
        }))
    }
}

impl Admitted<'_> {
    /// The write landed at `revision` (or wrote nothing, `None`): its reservation lasts
    /// until the copy shows that revision.
    pub fn landed(mut self, revision: Option<i64>) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let mut reserved = self.budget.reserved.lock().expect("kv budget lock");
        match revision {
            Some(revision) => {
                if let Some(w) = reserved.writes.iter_mut().find(|w| w.0 == ticket) {
                    w.1 = revision.max(1);
                }
            }
            None => reserved.writes.retain(|w| w.0 != ticket),
        }
    }
}

impl Drop for Admitted<'_> {
    /// A write that failed (or whose outcome is unknown) frees its reservation: if it
    /// did land, the copy shows it soon.
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let mut reserved = self.budget.reserved.lock().expect("kv budget lock");
            reserved.writes.retain(|w| w.0 != ticket);
        }
    }
}
