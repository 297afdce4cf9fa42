//! The cell-wide bound on what small keys hold (`--max-kv-total-bytes`), as one proxy
//! keeps it: its copy of every small key says what the cell holds, and the writes it
//! let through that its copy does not show yet are reserved here, so writes racing on
//! this proxy never pass the bound together.
//!
//! Writes racing on other proxies are not seen until their copies meet: each proxy lets
//! at most [`IN_FLIGHT_SHARE`] of the bound be in flight at once (or one write, if that
//! write is larger), which bounds how far the cell can pass it to that share per proxy.
//!
//! The same copy says what each identity's persistent keys hold (`stored_bytes` in the
//! grants file, see [`crate::mirror::Mirror::stored`]), and the same reservations keep
//! one identity's writes racing on this proxy from passing its limit together.

use std::sync::Mutex;

use crate::access::AccessRules;
use crate::errors::ProxyError;
use crate::feed::Feed;
use crate::mirror::WriteSize;

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
    writes: Vec<Reservation>,
}

/// What a write adds to its writer's persistent keys, to reserve while it is in flight:
/// refused past the writer's `stored_bytes`, counting what its other writes in flight
/// (`writes`) reserved. `stored` is what the copy shows it holds, and the write's
/// growth of it.
fn stored_share(
    writes: &[Reservation],
    writer: Option<Writer<'_>>,
    stored: Option<(usize, i64)>,
) -> Result<Option<(String, usize)>, ProxyError> {
    Ok(match (writer, stored) {
        (Some(writer), Some((held, growth))) if growth > 0 => {
            let growth = growth as u64;
            let pending: u64 = writes
                .iter()
                .filter_map(|w| w.stored.as_ref())
                .filter(|(identity, _)| identity == writer.identity)
                .map(|(_, g)| *g as u64)
                .sum();
            let max = writer.grants.quota(writer.identity).stored_bytes;
            if held as u64 + pending + growth > max {
                return Err(crate::limits::refusal_of_stored(
                    writer.grants,
                    writer.identity,
                    held as u64,
                    pending,
                    growth,
                    max,
                ));
            }
            Some((writer.identity.to_owned(), growth as usize))
        }
        _ => None,
    })
}

#[derive(Debug)]
struct Reservation {
    ticket: u64,
    /// The revision the write landed at (0 while in flight).
    landed: i64,
    /// What it adds to the cell's small keys.
    growth: usize,
    /// The writer, and what it adds to the writer's persistent keys.
    stored: Option<(String, usize)>,
}

/// The identity that writes, and the grants file that says its limits.
#[derive(Clone, Copy)]
pub struct Writer<'a> {
    pub grants: &'a AccessRules,
    pub identity: &'a str,
}

/// A write let through: hold it until the write answers, then say where it landed.
#[must_use]
pub struct Admitted<'a> {
    budget: &'a KvBudget,
    ticket: Option<u64>,
    /// The room it took below etcd's space line, kept if it lands.
    room: Option<crate::space::Room<'a>>,
}

impl KvBudget {
    /// Lets `writes` through if the cell's small keys, with what is reserved, stay
    /// within `limit`, and the persistent keys of `writer` (when the proxy knows
    /// identities) within its `stored_bytes`; refuses (RESOURCE_EXHAUSTED, naming the
    /// limit) otherwise. While this proxy has its
    /// share in flight, waits (up to [`PATIENCE`]) for its copy to show the writes that
    /// landed, then refuses as busy (UNAVAILABLE: try again).
    pub async fn admit<'a>(
        &'a self,
        feed: &Feed,
        limit: usize,
        writer: Option<Writer<'_>>,
        writes: &[WriteSize<'_>],
    ) -> Result<Admitted<'a>, ProxyError> {
        let give_up = tokio::time::Instant::now() + PATIENCE;
        loop {
            let wait_for = match self.try_admit(feed, limit, writer, writes)? {
                Ok(admitted) => return Ok(admitted),
                Err(wait_for) => wait_for,
            };
            let now = tokio::time::Instant::now();
            if now >= give_up {
                let keys: Vec<&str> = writes.iter().map(|w| w.name).collect();
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
        writer: Option<Writer<'_>>,
        writes: &[WriteSize<'_>],
    ) -> Result<Result<Admitted<'a>, Option<i64>>, ProxyError> {
        let (held, revision, growth, stored) = feed.with_mirror(|m| {
            let stored =
                writer.map(|w| (m.stored(w.identity), m.stored_growth(w.identity, writes)));
            (m.bytes(), m.revision(), m.net_growth(writes), stored)
        });
        let mut reserved = self.reserved.lock().expect("kv budget lock");
        // What the copy shows now needs no reservation any more.
        reserved
            .writes
            .retain(|w| w.landed == 0 || w.landed > revision);
        let stored = stored_share(&reserved.writes, writer, stored)?;
        if growth <= 0 && stored.is_none() {
            return Ok(Ok(Admitted {
                budget: self,
                ticket: None,
                room: None,
            }));
        }
        let growth = growth.max(0) as usize;
        let pending: usize = reserved.writes.iter().map(|w| w.growth).sum();
        let total = held + pending + growth;
        if growth > 0 && total > limit {
            let keys: Vec<&str> = writes.iter().map(|w| w.name).collect();
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
        if growth > 0 && pending > 0 && pending + growth > limit / IN_FLIGHT_SHARE {
            let landed = reserved.writes.iter().map(|w| w.landed).max();
            return Ok(Err(landed.filter(|r| *r > 0)));
        }
        reserved.next += 1;
        let ticket = reserved.next;
        reserved.writes.push(Reservation {
            ticket,
            landed: 0,
            growth,
            stored,
        });
        Ok(Ok(Admitted {
            budget: self,
            ticket: Some(ticket),
            room: None,
        }))
    }
}

impl<'a> Admitted<'a> {
    /// With the room the write took below etcd's space line.
    pub fn with_room(mut self, room: crate::space::Room<'a>) -> Self {
        self.room = Some(room);
        self
    }

    /// The write landed at `revision` (or wrote nothing, `None`): its reservation lasts
    /// until the copy shows that revision, and its room below the line until the next
    /// reading of etcd's size.
    pub fn landed(mut self, revision: Option<i64>) {
        if let (Some(room), Some(_)) = (self.room.take(), revision) {
            room.keep();
        }
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let mut reserved = self.budget.reserved.lock().expect("kv budget lock");
        match revision {
            Some(revision) => {
                if let Some(w) = reserved.writes.iter_mut().find(|w| w.ticket == ticket) {
                    w.landed = revision.max(1);
                }
            }
            None => reserved.writes.retain(|w| w.ticket != ticket),
        }
    }
}

impl Drop for Admitted<'_> {
    /// A write that failed (or whose outcome is unknown) frees its reservation: if it
    /// did land, the copy shows it soon.
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let mut reserved = self.budget.reserved.lock().expect("kv budget lock");
            reserved.writes.retain(|w| w.ticket != ticket);
        }
    }
}
