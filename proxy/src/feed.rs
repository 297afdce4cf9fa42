//! The proxy's one watch over the cell, feeding its [`Mirror`] of the small keys and its
//! watch [`Fanout`].
//!
//! The watch covers every key of the etcd cluster, not only `/k/`: every revision of
//! the store changes at least one key, so every revision reaches the proxy as an event
//! and the proxy always knows exactly how far it has applied the log. That is what the
//! read barrier waits on, and what lets a catching-up watcher join the fan-out with no
//! gap and no duplicate. (Progress notifications cannot stand in for it: etcd 3.4 may
//! send one ahead of events it has not delivered yet.) The cost is the cell's write
//! traffic to each proxy, which is small: session renewals write nothing.

use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use etcd_client::{
    EventType, GetOptions, KvClient, SortOrder, SortTarget, WatchClient, WatchOptions,
};
use lockcell_cell::error::{header_revision, with_timeout};
use lockcell_cell::keyspace::{self, prefix_end};
use lockcell_cell::kv::Entry;
use lockcell_cell::CellError;
use tokio::sync::{watch, Notify};

use crate::fanout::{End, Fanout};
use crate::metrics;
use crate::mirror::{EventKind, KeyEvent, Mirror};
use crate::routes::Routes;

mod follow;

pub use self::follow::run;

/// Largest watch response the proxy accepts: a proxy lease revoked with tens of
/// thousands of keys on it arrives as one revision.
pub const MAX_WATCH_MESSAGE_BYTES: usize = 512 * 1024 * 1024;
/// Watchers catching up on history at once (each reads the cell's whole history from
/// its start revision, a fragment of etcd's request size at a time, and holds a few
/// MiB while its reader takes them): the others wait their turn.
const MAX_CATCH_UPS: usize = 4;
/// Keys per read while loading the mirror.
const LOAD_PAGE: i64 = 1_000;
/// Failed restarts of the cell watch in a row, without an event between them, after
/// which the proxy stops trusting its view and loads it again.
const RESTARTS_BEFORE_RELOAD: u32 = 5;

/// A hole in the revisions a watch over every key delivered: etcd lost events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    /// The last revision seen whole.
    pub after: i64,
    /// The revision that came next.
    pub got: i64,
}

impl std::fmt::Display for Gap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "etcd's watch went from revision {} to {}: the revisions between were never delivered",
            self.after, self.got
        )
    }
}

/// Checks that `revisions` (in delivery order) continue a log seen whole through
/// `seen` with no hole, and returns the last one. Every revision of the store but the
/// first (an empty store is at revision 1) changes at least one key, so a watch over
/// every key shows each of them; a hole means etcd dropped events (etcd 3.4 can, around
/// compactions), and nothing built on the watch may be trusted past it.
pub fn contiguous(seen: i64, revisions: impl IntoIterator<Item = i64>) -> Result<i64, Gap> {
    let mut last = seen;
    for got in revisions {
        if got == last || got == last + 1 || (last <= 1 && got == 2) {
            last = got;
        } else {
            return Err(Gap { after: last, got });
        }
    }
    Ok(last)
}

/// The mirror, the fan-out and how far both have applied the cell's log.
pub struct Feed {
    mirror: RwLock<Mirror>,
    /// The revision applied to the mirror and published to the fan-out (0: not loaded).
    applied: watch::Sender<i64>,
    /// True while the mirror is loaded and followed without a gap.
    live: watch::Sender<bool>,
    /// Told when a read waited in vain for the mirror: the watch may be stuck.
    stalled: Notify,
    pub fanout: Arc<Fanout>,
    backlog: usize,
    /// Catch-ups of watchers from older revisions allowed at once.
    pub catch_ups: Arc<tokio::sync::Semaphore>,
    /// The cell's copy of the shard map, kept as of the applied revision at least: a
    /// read that waited for the feed to reach its barrier checks its name against it.
    routes: Arc<Routes>,
    /// Told of the keys that etcd API leases lost in each revision ([`Feed::on_detached`]).
    detach: OnceLock<DetachHook>,
    /// Told of lockcell's ephemeral keys that left their proxy lease in each revision
    /// ([`Feed::on_ephemeral_lost`]).
    ephemeral_lost: OnceLock<DetachHook>,
}

/// What the feed calls with the keys client leases lost in a revision.
pub type DetachHook = Box<dyn Fn(&[Detached]) + Send + Sync>;

/// A small key that an etcd API client's lease held until a revision deleted it or
/// wrote it without that lease: as in etcd, the key is no longer the lease's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detached {
    pub name: String,
    /// The key's create revision while the lease held it.
    pub created: i64,
    pub client_lease: i64,
    /// The revision that took it from the lease.
    pub at: i64,
}

/// The key `event` took from the client lease that held it, if it took one.
pub fn detached(event: &KeyEvent) -> Option<Detached> {
    let prev = event.prev.as_ref().filter(|p| p.client_lease != 0)?;
    let now = &event.entry;
    let lost = match event.kind {
        EventKind::Delete => true,
        // Written again on no lease, or with another client's: a rewrite that keeps
        // the key on a proxy lease with no client lease read is not taken for one.
        EventKind::Put => {
            now.lease == 0
                || (now.client_lease != 0 && now.client_lease != prev.client_lease)
                || now.create_revision != prev.create_revision
        }
    };
    lost.then(|| Detached {
        name: prev.name.clone(),
        created: prev.create_revision,
        client_lease: prev.client_lease,
        at: event.revision(),
    })
}

/// The ephemeral key of lockcell's own API (on a proxy lease, with no etcd client lease)
/// that `event` deleted or wrote on no lease, if it did: whoever wrote it, it is no
/// longer the session's that had it. A key moved to another proxy lease (its session
/// resumed there), or written again on one, is not taken for lost.
pub fn ephemeral_lost(event: &KeyEvent) -> Option<Detached> {
    let prev = event
        .prev
        .as_ref()
        .filter(|p| p.lease != 0 && p.client_lease == 0)?;
    let now = &event.entry;
    let lost = match event.kind {
        EventKind::Delete => true,
        EventKind::Put => now.lease == 0 || now.create_revision != prev.create_revision,
    };
    lost.then(|| Detached {
        name: prev.name.clone(),
        created: prev.create_revision,
        client_lease: 0,
        at: event.revision(),
    })
}

impl Feed {
    /// A feed whose watchers may fall `backlog` batches behind, and whose fan-out keeps
    /// `history_bytes` of the latest events.
    pub fn new(backlog: usize, history_bytes: usize, routes: Arc<Routes>) -> Feed {
        Feed {
            routes,
            mirror: RwLock::default(),
            applied: watch::channel(0).0,
            live: watch::channel(false).0,
            stalled: Notify::new(),
            fanout: Arc::new(Fanout::with_history(history_bytes)),
            backlog,
            catch_ups: Arc::new(tokio::sync::Semaphore::new(MAX_CATCH_UPS)),
            detach: OnceLock::new(),
            ephemeral_lost: OnceLock::new(),
        }
    }

    /// Calls `hook` with the keys etcd API client leases lose, revision by revision,
    /// once the copy shows the change (the first hook set is the one kept).
    pub fn on_detached(&self, hook: DetachHook) {
        let _ = self.detach.set(hook);
    }

    /// Calls `hook` with lockcell's ephemeral keys that `event`s deleted or wrote on no
    /// lease ([`ephemeral_lost`]), revision by revision, once the copy shows the change
    /// (the first hook set is the one kept).
    pub fn on_ephemeral_lost(&self, hook: DetachHook) {
        let _ = self.ephemeral_lost.set(hook);
    }

    /// Backlog of each watcher, in batches.
    pub fn backlog(&self) -> usize {
        self.backlog
    }

    /// True while the mirror is loaded and followed without a gap.
    pub fn is_live(&self) -> bool {
        *self.live.borrow()
    }

    /// Waits until the feed is live, for at most `patience`.
    pub async fn live_within(&self, patience: Duration) -> bool {
        let mut rx = self.live.subscribe();
        tokio::time::timeout(patience, rx.wait_for(|l| *l))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The revision applied so far (0 while the mirror loads).
    pub fn applied(&self) -> i64 {
        *self.applied.borrow()
    }

    pub fn subscribe_applied(&self) -> watch::Receiver<i64> {
        self.applied.subscribe()
    }

    /// Runs `f` on the mirror.
    pub fn with_mirror<T>(&self, f: impl FnOnce(&Mirror) -> T) -> T {
        f(&self.mirror.read().expect("mirror lock"))
    }

    /// Says a read waited in vain for the mirror to reach a barrier revision: the watch
    /// is stuck somewhere (a member without a leader, a response it cannot take), so the
    /// proxy stops trusting its view and loads it again.
    pub fn report_stall(&self) {
        if self.is_live() {
            self.stalled.notify_one();
        }
    }

    /// Waits until the mirror has applied `revision`, for at most `patience`.
    pub async fn applied_through(&self, revision: i64, patience: Duration) -> bool {
        let mut rx = self.applied.subscribe();
        let applied = tokio::time::timeout(patience, rx.wait_for(|r| *r >= revision));
        lockcell_cell::timing::waiting(applied)
            .await
            .is_ok_and(|r| r.is_ok())
    }

    fn load(&self, (mirror, map): (Mirror, Option<etcd_client::KeyValue>)) {
        let revision = mirror.revision();
        match &map {
            Some(kv) => self.routes.changed(Some(kv.value()), kv.mod_revision()),
            None => self.routes.changed(None, revision),
        }
        *self.mirror.write().expect("mirror lock") = mirror;
        self.fanout.open(revision);
        self.applied.send_replace(revision);
        self.live.send_replace(true);
    }

    /// Applies one watch response: events of whole revisions, in order, continuing
    /// the applied revision with no hole.
    fn apply(&self, events: &[etcd_client::Event]) -> Result<(), Gap> {
        if events.is_empty() {
            return Ok(());
        }
        let revisions = events
            .iter()
            .filter_map(|e| e.kv())
            .map(|kv| kv.mod_revision());
        let revision = contiguous(self.applied(), revisions)?;
        let map_key = keyspace::shardmap_key().as_bytes();
        for event in events {
            if let Some(kv) = event.kv().filter(|kv| kv.key() == map_key) {
                let put = event.event_type() == EventType::Put;
                self.routes
                    .changed(put.then(|| kv.value()), kv.mod_revision());
            }
        }
        let leased = leased_in(events);
        let owners = owners_in(events);
        let changes = events.iter().filter_map(|e| change(e, &leased));
        let mut mirror = self.mirror.write().expect("mirror lock");
        let events = mirror.apply(revision, changes);
        let mut records: Vec<(&(String, i64), &LeaseRecord)> = leased.iter().collect();
        records.sort_by_key(|((_, revision), _)| *revision);
        mirror.records_changed(records.into_iter().map(|((name, revision), record)| {
            (name.clone(), (record.lease != 0).then_some(*revision))
        }));
        mirror.owners_changed(owners);
        drop(mirror);
        if let Some(hook) = self.detach.get() {
            let lost: Vec<Detached> = events.iter().filter_map(detached).collect();
            if !lost.is_empty() {
                hook(&lost);
            }
        }
        if let Some(hook) = self.ephemeral_lost.get() {
            let lost: Vec<Detached> = events.iter().filter_map(ephemeral_lost).collect();
            if !lost.is_empty() {
                hook(&lost);
            }
        }
        let done = self.fanout.publish(revision, &events);
        self.applied.send_replace(revision);
        ::metrics::counter!(metrics::WATCH_BATCHES_SENT).increment(done.delivered);
        ::metrics::counter!(metrics::WATCHERS_CUT_OFF).increment(done.cut_off);
        Ok(())
    }
}

/// A small key's change in an etcd event: its name, revision, and the key after it
/// (`None` for a delete), with the client lease `leased` (the records written in the
/// same events, [`leased_in`]) gives it. Events outside `/k/` give nothing.
pub fn change(event: &etcd_client::Event, leased: &Leased) -> Option<(String, i64, Option<Entry>)> {
    let kv = event.kv()?;
    let name = keyspace::kv_name(kv.key())?.to_owned();
    let revision = kv.mod_revision();
    let put = (event.event_type() == EventType::Put).then(|| {
        let mut entry = entry(&name, kv);
        // A write of the key that did not write its record is no etcd API leased put.
        if entry.lease != 0 {
            entry.client_lease = leased.get(&(name.clone(), revision)).map_or(0, |r| r.lease);
        }
        entry
    });
    Some((name, revision, put))
}

/// The owner records (`keyspace::owner_root`) written or deleted in `events`, in order:
/// each key's name, and the identity and mod revision written (`None`: deleted).
pub fn owners_in(events: &[etcd_client::Event]) -> Vec<(String, Option<(String, i64)>)> {
    events
        .iter()
        .filter_map(|event| {
            let kv = event.kv()?;
            let name = keyspace::owner_name(kv.key())?.to_owned();
            let owner = (event.event_type() == EventType::Put).then(|| {
                (
                    String::from_utf8_lossy(kv.value()).into_owned(),
                    kv.mod_revision(),
                )
            });
            Some((name, owner))
        })
        .collect()
}

/// What the client lease record of one small key became in one revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The client lease the key was written with (0: the record was deleted).
    pub lease: i64,
    /// The record before: its lease and mod revision.
    pub prev: Option<(i64, i64)>,
}

/// By small key name and revision, the client lease records written in `events`.
pub type Leased = std::collections::HashMap<(String, i64), LeaseRecord>;

/// The client lease records (`keyspace::etcd_leased_root`) written in `events`. A
/// record is written in its key's own transaction, so a watch response, which holds
/// whole revisions, holds both.
pub fn leased_in(events: &[etcd_client::Event]) -> Leased {
    events
        .iter()
        .filter_map(|event| {
            let kv = event.kv()?;
            let name = keyspace::etcd_leased_name(kv.key())?.to_owned();
            let lease = match event.event_type() {
                EventType::Put => record_lease(kv.value()),
                EventType::Delete => 0,
            };
            let prev = event
                .prev_kv()
                .map(|p| (record_lease(p.value()), p.mod_revision()));
            Some(((name, kv.mod_revision()), LeaseRecord { lease, prev }))
        })
        .collect()
}

/// The lease a client lease record names (0 when it does not read as one).
pub fn record_lease(value: &[u8]) -> i64 {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A small key from etcd's record of it.
pub fn entry(name: &str, kv: &etcd_client::KeyValue) -> Entry {
    Entry {
        name: name.to_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: kv.lease(),
        client_lease: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_must_follow_on_without_a_hole() {
        assert_eq!(contiguous(10, [11, 11, 12, 13]), Ok(13));
        assert_eq!(contiguous(10, []), Ok(10));
        assert_eq!(
            contiguous(10, [11, 13]),
            Err(Gap { after: 11, got: 13 }),
            "revision 12 went missing"
        );
        assert_eq!(contiguous(10, [12]), Err(Gap { after: 10, got: 12 }));
        assert_eq!(contiguous(10, [9]), Err(Gap { after: 10, got: 9 }));
        assert_eq!(
            contiguous(0, [2, 3]),
            Ok(3),
            "an empty store is at revision 1, which changed nothing"
        );
    }

    fn entry(created: i64, lease: i64, client_lease: i64) -> Entry {
        Entry {
            name: "svc/a".into(),
            value: Vec::new(),
            create_revision: created,
            mod_revision: created,
            version: 1,
            lease,
            client_lease,
        }
    }

    /// A change at revision 6.
    fn event(kind: EventKind, now: Entry, prev: Option<Entry>) -> KeyEvent {
        KeyEvent {
            kind,
            entry: Entry {
                mod_revision: 6,
                ..now
            },
            prev,
        }
    }

    #[test]
    fn an_ephemeral_key_is_lost_to_its_session_when_deleted_or_written_on_no_lease() {
        let held = entry(5, 100, 0);
        let lost = Some(Detached {
            name: "svc/a".into(),
            created: 5,
            client_lease: 0,
            at: 6,
        });
        let (put, delete) = (EventKind::Put, EventKind::Delete);
        assert_eq!(
            ephemeral_lost(&event(delete, entry(0, 0, 0), Some(held.clone()))),
            lost
        );
        assert_eq!(
            ephemeral_lost(&event(put, entry(5, 0, 0), Some(held.clone()))),
            lost
        );
        assert_eq!(
            ephemeral_lost(&event(put, entry(6, 100, 0), Some(held.clone()))),
            lost,
            "created again"
        );
        assert_eq!(
            ephemeral_lost(&event(put, entry(5, 200, 0), Some(held.clone()))),
            None,
            "moved with its session to another proxy lease"
        );
        assert_eq!(
            ephemeral_lost(&event(put, entry(5, 100, 0), Some(held))),
            None,
            "written again on its lease"
        );
        assert_eq!(
            ephemeral_lost(&event(delete, entry(0, 0, 0), Some(entry(5, 0, 0)))),
            None,
            "a persistent key is no session's"
        );
        assert_eq!(
            ephemeral_lost(&event(delete, entry(0, 0, 0), Some(entry(5, 100, 7)))),
            None,
            "an etcd API lease's key is followed by its client lease"
        );
    }

    #[test]
    fn a_key_leaves_its_client_lease_when_deleted_or_written_without_it() {
        let held = entry(5, 100, 7);
        let lost = |at| {
            Some(Detached {
                name: "svc/a".into(),
                created: 5,
                client_lease: 7,
                at,
            })
        };
        let (put, delete) = (EventKind::Put, EventKind::Delete);
        assert_eq!(
            detached(&event(delete, entry(0, 0, 0), Some(held.clone()))),
            lost(6)
        );
        assert_eq!(
            detached(&event(put, entry(5, 0, 0), Some(held.clone()))),
            lost(6),
            "no lease"
        );
        assert_eq!(
            detached(&event(put, entry(5, 100, 8), Some(held.clone()))),
            lost(6),
            "another"
        );
        assert_eq!(
            detached(&event(put, entry(5, 100, 7), Some(held.clone()))),
            None,
            "again"
        );
        assert_eq!(
            detached(&event(put, entry(5, 200, 0), Some(held.clone()))),
            None,
            "moved to another proxy's lease: still the client's until shown otherwise"
        );
        assert_eq!(
            detached(&event(put, entry(9, 100, 7), None)),
            None,
            "created"
        );
        assert_eq!(
            detached(&event(delete, entry(0, 0, 0), Some(entry(5, 100, 0)))),
            None,
            "no client lease held it"
        );
    }
}
