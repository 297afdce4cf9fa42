//! etcd's space, as one proxy keeps it (docs/operations.md, "etcd's space"): at its
//! space quota etcd raises the NOSPACE alarm and refuses every write with a put in it,
//! lockcell's releases (which write a release marker), lease grants and session
//! clean-ups among them. So the proxy refuses new keys and values first, while etcd's
//! database is below `--etcd-space-limit-percent` of `--etcd-quota-bytes`, and lets
//! through everything that only deletes, and its own writes (lease renewals,
//! releases, clean-ups), which the room left is for.
//!
//! The database's size is read from etcd's Status every [`POLL`]; what this proxy let
//! through since is added to it, so writes racing through one proxy do not pass the
//! line together. Writes through other proxies show in the next reading: until then
//! each of the cell's P running proxies lets through at most a 2P-th of the room left
//! below the line (half of it in all, since what etcd's pages take per write is more
//! than the proxy can count), so all of them together do not pass it either. A small
//! key's write holds its room until it lands; one refused later, or that wrote nothing
//! (its compare failed), gives it back. A lock grant is only checked against the room
//! left: a call that waits, or is refused at the lock, takes none.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockcell_cell::error::with_timeout;
use tokio::sync::watch;

use crate::errors::ProxyError;
use crate::metrics as m;

/// How often the proxy reads etcd's database size.
pub const POLL: Duration = Duration::from_secs(2);

/// What a write costs etcd beyond its key and value (revision, index, the writer and
/// owner records, page slack).
const OVERHEAD: u64 = 1024;

/// etcd's database size as last read, and what this proxy let through since.
pub struct Space {
    /// Refuse new keys and values from this size on.
    limit: u64,
    quota: u64,
    percent: u8,
    read: AtomicU64,
    since: AtomicU64,
    /// Counts the readings: room taken before the last one is not given back after it.
    readings: AtomicU64,
    /// The cell's running proxies as last counted (at least 1): each may let through
    /// its share of the room left.
    proxies: AtomicU64,
}

impl Space {
    pub fn new(quota: u64, percent: u8) -> Space {
        Space {
            limit: quota / 100 * u64::from(percent.min(100)),
            quota,
            percent,
            read: AtomicU64::new(0),
            since: AtomicU64::new(0),
            readings: AtomicU64::new(0),
            proxies: AtomicU64::new(1),
        }
    }

    /// The size from which new keys and values are refused.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Lets a write that adds `bytes` of keys and values through, or refuses it
    /// (RESOURCE_EXHAUSTED) when this proxy's share of the room left below the line is
    /// taken. Takes nothing of the room: for lock grants, small and paced, which the
    /// next reading counts. A write that adds nothing (a delete) always passes.
    pub fn admit(&self, what: &str, bytes: u64) -> Result<(), ProxyError> {
        if bytes == 0 {
            return Ok(());
        }
        let read = self.read.load(Ordering::Acquire);
        let since = self.since.load(Ordering::Acquire);
        if since + bytes + OVERHEAD < self.share(read) {
            return Ok(());
        }
        Err(self.refusal(what, read))
    }

    /// [`Self::admit`] for a small-key write, taking its room until the write lands
    /// ([`Room::keep`]); a write dropped before (refused later, or written nothing)
    /// gives it back.
    pub fn reserve(&self, what: &str, bytes: u64) -> Result<Room<'_>, ProxyError> {
        let cost = bytes + OVERHEAD;
        let readings = self.readings.load(Ordering::Acquire);
        let read = self.read.load(Ordering::Acquire);
        let share = self.share(read);
        let since = self.since.fetch_add(cost, Ordering::AcqRel);
        if since + cost < share {
            return Ok(Room {
                space: self,
                cost,
                readings,
                kept: false,
            });
        }
        self.give_back(cost, readings);
        Err(self.refusal(what, read))
    }

    fn give_back(&self, cost: u64, readings: u64) {
        if self.readings.load(Ordering::Acquire) == readings {
            let _ = self
                .since
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                    Some(s.saturating_sub(cost))
                });
        }
    }

    fn refusal(&self, what: &str, read: u64) -> ProxyError {
        metrics::counter!(m::ETCD_SPACE_REFUSALS).increment(1);
        ProxyError::Exhausted(format!(
            "{what}: etcd's database was {} of its {} space quota (--etcd-quota-bytes) when \
             last read, near the {}% line past which lockcell refuses new keys and values \
             (--etcd-space-limit-percent), and this proxy's share of the room left until the \
             next reading is taken; releases, deletes and session clean-ups still go through. \
             Try again in a moment; if it lasts, delete keys, or have an operator compact and \
             defragment etcd or raise its quota",
            mib(read),
            mib(self.quota),
            self.percent,
        ))
    }

    /// Refuses, past the line, a delete that would delete nothing (`finds_none`, as the
    /// proxy's copy of the small keys says): it would still write a revision (with its
    /// writer record), and a caller looping on it could fill the room kept past the
    /// line for releases and clean-ups. A delete that finds a key always passes.
    /// `finds_none` is asked only past the line: below it, no delete costs a look.
    pub fn admit_delete(
        &self,
        what: &str,
        finds_none: impl FnOnce() -> bool,
    ) -> Result<(), ProxyError> {
        let read = self.read.load(Ordering::Acquire);
        let since = self.since.load(Ordering::Acquire);
        // Past the line as new keys are: no room left for the least write.
        if since + OVERHEAD < self.share(read) || !finds_none() {
            return Ok(());
        }
        metrics::counter!(m::ETCD_SPACE_REFUSALS).increment(1);
        Err(ProxyError::Exhausted(format!(
            "{what}: etcd's database was {} of its {} space quota (--etcd-quota-bytes) when \
             last read, at the {}% line (--etcd-space-limit-percent), and this delete finds no \
             key to delete; it would still write. (A key written elsewhere a moment ago may \
             not be seen here yet: try again in a moment.)",
            mib(read),
            mib(self.quota),
            self.percent,
        )))
    }

    /// This proxy's share of the room left below the line, the database being `read`.
    fn share(&self, read: u64) -> u64 {
        self.limit.saturating_sub(read) / (2 * self.proxies.load(Ordering::Acquire))
    }

    /// Takes a new count of the cell's running proxies.
    fn set_proxies(&self, running: usize) {
        self.proxies.store(running.max(1) as u64, Ordering::Release);
    }

    /// Takes a new reading of the database's size.
    fn set(&self, bytes: u64) {
        self.read.store(bytes, Ordering::Release);
        self.since.store(0, Ordering::Release);
        self.readings.fetch_add(1, Ordering::AcqRel);
        metrics::gauge!(m::ETCD_DB_BYTES).set(bytes as f64);
    }
}

/// The room a small-key write took below the line: given back when dropped, unless the
/// write landed ([`Room::keep`]).
#[must_use = "the room is given back when this is dropped"]
pub struct Room<'a> {
    space: &'a Space,
    cost: u64,
    readings: u64,
    kept: bool,
}

impl std::fmt::Debug for Room<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Room").field("cost", &self.cost).finish()
    }
}

impl Room<'_> {
    /// The write landed: its room stays taken until the next reading counts it.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Room<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.space.give_back(self.cost, self.readings);
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Reads etcd's database size, and counts the cell's running proxies, every [`POLL`]
/// until `stop`, for `space`.
pub async fn keep_reading(
    space: Arc<Space>,
    etcd: etcd_client::Client,
    timeout: Duration,
    mut stop: watch::Receiver<bool>,
) {
    metrics::gauge!(m::ETCD_SPACE_LIMIT_BYTES).set(space.limit() as f64);
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let status = with_timeout(
            "read etcd's status",
            timeout,
            etcd.maintenance_client().status(),
        )
        .await;
        let root = lockcell_cell::keyspace::proxy_presence_root();
        let count = etcd_client::GetOptions::new()
            .with_prefix()
            .with_count_only();
        let running = with_timeout(
            "count the running proxies",
            timeout,
            etcd.kv_client().get(root, Some(count)),
        )
        .await;
        match running {
            Ok(running) => space.set_proxies(running.count().max(0) as usize),
            Err(error) => tracing::debug!(%error, "could not count the running proxies"),
        }
        match status {
            Ok(status) => space.set(status.db_size().max(0) as u64),
            Err(error) => tracing::debug!(%error, "could not read etcd's database size"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;

    #[test]
    fn new_bytes_are_refused_at_the_line_and_deletes_never() {
        // Line at 92,160; read at 71,680: 20 KiB left, half of it for the one proxy.
        let space = Space::new(100 * KIB, 90);
        space.set(70 * KIB);
        let a = space.reserve("put a", 3 * KIB).unwrap();
        let b = space.reserve("put b", 3 * KIB).unwrap();
        let refused = space.reserve("put c", 3 * KIB).unwrap_err().to_string();
        assert!(refused.contains("put c"), "{refused}");
        assert!(refused.contains("--etcd-quota-bytes"), "{refused}");
        assert!(refused.contains("90%"), "{refused}");
        assert!(
            space.admit("a lock", 3 * KIB).is_err(),
            "a grant sees the room taken"
        );
        space.admit("delete", 0).expect("a delete always passes");
        a.keep();
        b.keep();
        // A new reading counts again from what etcd says.
        space.set(50 * KIB);
        space.reserve("put c", 3 * KIB).unwrap().keep();
    }

    #[test]
    fn a_write_that_did_not_land_gives_its_room_back() {
        let space = Space::new(100 * KIB, 90);
        space.set(70 * KIB);
        for _ in 0..100 {
            // Refused later, or written nothing: its room comes back.
            drop(space.reserve("put a", 3 * KIB).unwrap());
        }
        let kept = space.reserve("put a", 3 * KIB).unwrap();
        kept.keep();
        // Room taken before a reading is not given back after it.
        let old = space.reserve("put b", 3 * KIB).unwrap();
        space.set(70 * KIB);
        let new = space.reserve("put c", 3 * KIB).unwrap();
        drop(old);
        let refused = space.reserve("put d", 6 * KIB);
        assert!(
            refused.is_err(),
            "the old write gave back room it never took"
        );
        drop(new);
    }

    #[test]
    fn each_of_several_proxies_lets_through_its_share_of_the_room_left() {
        let space = Space::new(100 * KIB, 90);
        space.set_proxies(3);
        space.set(30 * KIB);
        // 60 KiB left below the line: 10 KiB for each of three proxies.
        space.reserve("put a", 3 * KIB).unwrap().keep();
        assert!(
            space.admit_delete("delete nothing", || true).is_ok(),
            "room left"
        );
        space.reserve("put b", 3 * KIB).unwrap().keep();
        assert!(space.reserve("put c", 3 * KIB).is_err(), "past its share");
        // 2 KiB left here: a delete finding nothing fits until the room is gone.
        space.reserve("put d", 500).unwrap().keep();
        assert!(
            space.admit_delete("delete nothing", || true).is_err(),
            "no room left"
        );
        space.set_proxies(1);
        space.set(30 * KIB);
        for i in 0..7 {
            space.reserve(&format!("put {i}"), 3 * KIB).unwrap().keep();
        }
    }
}
