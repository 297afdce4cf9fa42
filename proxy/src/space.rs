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
//! each of the cell's P running proxies lets through at most a P-th of the room left
//! below the line, so all of them together do not pass it either.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockcell_cell::error::with_timeout;
use tokio::sync::watch;

use crate::errors::ProxyError;
use crate::metrics as m;

/// How often the proxy reads etcd's database size.
pub const POLL: Duration = Duration::from_secs(2);

/// What a write costs etcd beyond its key and value (revision, index, page slack).
const OVERHEAD: u64 = 512;

/// etcd's database size as last read, and what this proxy let through since.
pub struct Space {
    /// Refuse new keys and values from this size on.
    limit: u64,
    quota: u64,
    percent: u8,
    read: AtomicU64,
    since: AtomicU64,
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
            proxies: AtomicU64::new(1),
        }
    }

    /// The size from which new keys and values are refused.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Lets a write that adds `bytes` of keys and values through, or refuses it
    /// (RESOURCE_EXHAUSTED) when etcd's database, with what this proxy let through
    /// since it was read, would reach the limit. A write that adds nothing (a delete)
    /// always passes.
    pub fn admit(&self, what: &str, bytes: u64) -> Result<(), ProxyError> {
        if bytes == 0 {
            return Ok(());
        }
        let cost = bytes + OVERHEAD;
        let read = self.read.load(Ordering::Acquire);
        let share = self.share(read);
        let since = self.since.fetch_add(cost, Ordering::AcqRel);
        if since + cost < share {
            return Ok(());
        }
        self.since.fetch_sub(cost, Ordering::AcqRel);
        metrics::counter!(m::ETCD_SPACE_REFUSALS).increment(1);
        Err(ProxyError::Exhausted(format!(
            "{what}: etcd's database is {} of its {} space quota (--etcd-quota-bytes), at the \
             {}% line past which lockcell refuses new keys and values (--etcd-space-limit-percent); \
             releases, deletes and session clean-ups still go through. Delete keys, or have an \
             operator compact and defragment etcd or raise its quota",
            mib(read + since),
            mib(self.quota),
            self.percent,
        )))
    }

    /// Refuses, past the line, a delete that would delete nothing (`finds_none`, as the
    /// proxy's copy of the small keys says): it would still write a revision (with its
    /// writer record), and a caller looping on it could fill the room kept past the
    /// line for releases and clean-ups. A delete that finds a key always passes.
    pub fn admit_delete(&self, what: &str, finds_none: bool) -> Result<(), ProxyError> {
        let read = self.read.load(Ordering::Acquire);
        let since = self.since.load(Ordering::Acquire);
        // Past the line as new keys are: no room left for the least write.
        if !finds_none || since + OVERHEAD < self.share(read) {
            return Ok(());
        }
        metrics::counter!(m::ETCD_SPACE_REFUSALS).increment(1);
        Err(ProxyError::Exhausted(format!(
            "{what}: etcd's database is {} of its {} space quota (--etcd-quota-bytes), past \
             the {}% line (--etcd-space-limit-percent), and this delete finds no key to \
             delete; it would still write. (A key written elsewhere a moment ago may not be \
             seen here yet: try again in a moment.)",
            mib(read + since),
            mib(self.quota),
            self.percent,
        )))
    }

    /// This proxy's share of the room left below the line, the database being `read`.
    fn share(&self, read: u64) -> u64 {
        self.limit.saturating_sub(read) / self.proxies.load(Ordering::Acquire)
    }

    /// Takes a new count of the cell's running proxies.
    fn set_proxies(&self, running: usize) {
        self.proxies.store(running.max(1) as u64, Ordering::Release);
    }

    /// Takes a new reading of the database's size.
    fn set(&self, bytes: u64) {
        self.read.store(bytes, Ordering::Release);
        self.since.store(0, Ordering::Release);
        metrics::gauge!(m::ETCD_DB_BYTES).set(bytes as f64);
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

    #[test]
    fn new_bytes_are_refused_at_the_line_and_deletes_never() {
        let space = Space::new(100 * 1024, 90);
        space.set(80 * 1024);
        space.admit("put a", 4096).unwrap();
        space.admit("put b", 4096).unwrap();
        let refused = space.admit("put c", 4096).unwrap_err().to_string();
        assert!(refused.contains("put c"), "{refused}");
        assert!(refused.contains("--etcd-quota-bytes"), "{refused}");
        assert!(refused.contains("90%"), "{refused}");
        space.admit("delete", 0).expect("a delete always passes");
        // A new reading counts again from what etcd says.
        space.set(50 * 1024);
        space.admit("put c", 4096).unwrap();
    }

    #[test]
    fn each_of_several_proxies_lets_through_its_share_of_the_room_left() {
        let space = Space::new(100 * 1024, 90);
        space.set_proxies(3);
        space.set(60 * 1024);
        // 30 KiB left below the line: 10 KiB for this proxy.
        space.admit("put a", 4096).unwrap();
        assert!(
            space.admit_delete("delete nothing", true).is_ok(),
            "room left"
        );
        space.admit("put b", 4096).unwrap();
        assert!(
            space.admit("put c", 4096).is_err(),
            "past a third of the room"
        );
        // 1 KiB left here: a delete finding nothing fits until the room is gone.
        space.admit("put d", 500).unwrap();
        assert!(
            space.admit_delete("delete nothing", true).is_err(),
            "no room left"
        );
        space.set_proxies(1);
        space.set(60 * 1024);
        for i in 0..5 {
            space.admit(&format!("put {i}"), 4096).unwrap();
        }
    }
}
