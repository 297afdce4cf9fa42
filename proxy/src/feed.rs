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

use std::sync::{Arc, RwLock};
use std::time::Duration;

use etcd_client::{
    EventType, GetOptions, KvClient, SortOrder, SortTarget, WatchClient, WatchOptions,
};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace::{self, prefix_end};
use lockcell_cell::kv::Entry;
use tokio::sync::watch;

use crate::fanout::{End, Fanout};
use crate::metrics;
use crate::mirror::Mirror;

/// Largest watch response the proxy accepts: a proxy lease revoked with tens of
/// thousands of keys on it arrives as one revision.
pub const MAX_WATCH_MESSAGE_BYTES: usize = 512 * 1024 * 1024;
/// Keys per read while loading the mirror.
const LOAD_PAGE: i64 = 1_000;

/// The mirror, the fan-out and how far both have applied the cell's log.
pub struct Feed {
    mirror: RwLock<Mirror>,
    /// The revision applied to the mirror and published to the fan-out (0: not loaded).
    applied: watch::Sender<i64>,
    /// True while the mirror is loaded and followed without a gap.
    live: watch::Sender<bool>,
    pub fanout: Arc<Fanout>,
    backlog: usize,
}

impl Feed {
    pub fn new(backlog: usize) -> Feed {
        Feed {
            mirror: RwLock::default(),
            applied: watch::channel(0).0,
            live: watch::channel(false).0,
            fanout: Arc::default(),
            backlog,
        }
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

    /// Waits until the mirror has applied `revision`, for at most `patience`.
    pub async fn applied_through(&self, revision: i64, patience: Duration) -> bool {
        let mut rx = self.applied.subscribe();
        tokio::time::timeout(patience, rx.wait_for(|r| *r >= revision))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    fn load(&self, mirror: Mirror) {
        let revision = mirror.revision();
        *self.mirror.write().expect("mirror lock") = mirror;
        self.fanout.open(revision);
        self.applied.send_replace(revision);
        self.live.send_replace(true);
    }

    /// Applies one watch response: events of whole revisions, in order.
    fn apply(&self, events: &[etcd_client::Event]) {
        let Some(revision) = events
            .iter()
            .filter_map(|e| e.kv())
            .map(|kv| kv.mod_revision())
            .max()
        else {
            return;
        };
        let changes = events.iter().filter_map(change);
        let events = self
            .mirror
            .write()
            .expect("mirror lock")
            .apply(revision, changes);
        let done = self.fanout.publish(revision, &events);
        self.applied.send_replace(revision);
        ::metrics::counter!(metrics::WATCH_BATCHES_SENT).increment(done.delivered);
        ::metrics::counter!(metrics::WATCHERS_CUT_OFF).increment(done.cut_off);
    }
}

/// A small key's change in an etcd event: its name, revision, and the key after it
/// (`None` for a delete). Events outside `/k/` give nothing.
pub fn change(event: &etcd_client::Event) -> Option<(String, i64, Option<Entry>)> {
    let kv = event.kv()?;
    let name = keyspace::kv_name(kv.key())?.to_owned();
    let revision = kv.mod_revision();
    let put = (event.event_type() == EventType::Put).then(|| entry(&name, kv));
    Some((name, revision, put))
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
    }
}

/// Loads the mirror and follows the cell for as long as the proxy runs. When the watch
/// cannot resume where it broke (the log was compacted meanwhile), every watcher is told
/// and the mirror is loaded again.
pub async fn run(feed: Arc<Feed>, kv: KvClient, watch: WatchClient, timeout: Duration) {
    let mut watch = watch.max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES);
    let mut kv = kv.max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES);
    let pause = Duration::from_millis(300);
    loop {
        let mirror = match load(&mut kv, timeout).await {
            Ok(mirror) => mirror,
            Err(e) => {
                tracing::warn!(error = %e, "could not load the small keys; retrying");
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        tracing::info!(
            keys = mirror.len(),
            revision = mirror.revision(),
            "small keys loaded; following the cell"
        );
        feed.load(mirror);
        follow(&feed, &mut watch, pause).await;
        feed.live.send_replace(false);
        feed.fanout.end_all(End::FeedLost);
        ::metrics::counter!(metrics::FEED_RELOADS).increment(1);
    }
}

/// Follows the cell from the mirror's revision until a compaction leaves a gap.
async fn follow(feed: &Feed, client: &mut WatchClient, pause: Duration) {
    loop {
        let from = feed.applied() + 1;
        let options = WatchOptions::new()
            .with_all_keys()
            .with_start_revision(from);
        let mut stream = match client.watch(vec![0u8], Some(options)).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, from, "the cell watch could not start; retrying");
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(resp)) if resp.compact_revision() > 0 => {
                    tracing::warn!(
                        from,
                        compacted = resp.compact_revision(),
                        "the cell's log was compacted past the proxy's position; reloading"
                    );
                    return;
                }
                Ok(Some(resp)) if resp.canceled() => {
                    tracing::warn!(
                        reason = resp.cancel_reason(),
                        "the cell watch was cancelled; restarting"
                    );
                    break;
                }
                Ok(Some(resp)) => feed.apply(resp.events()),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "the cell watch broke; restarting");
                    break;
                }
            }
        }
        tokio::time::sleep(pause).await;
    }
}

/// Reads every small key at one revision, a page at a time.
async fn load(kv: &mut KvClient, timeout: Duration) -> Result<Mirror, lockcell_cell::CellError> {
    let root = keyspace::kv_prefix("").expect("the root prefix is valid");
    let end = prefix_end(root.as_bytes());
    let mut start = root.into_bytes();
    let mut revision = 0;
    let mut entries = Vec::new();
    loop {
        let options = GetOptions::new()
            .with_range(end.clone())
            .with_limit(LOAD_PAGE)
            .with_revision(revision)
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        let resp = with_timeout(
            "load small keys",
            timeout,
            kv.get(start.clone(), Some(options)),
        )
        .await?;
        if revision == 0 {
            revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        }
        for kv in resp.kvs() {
            if let Some(name) = keyspace::kv_name(kv.key()) {
                entries.push(entry(name, kv));
            }
        }
        match (resp.more(), resp.kvs().last()) {
            (true, Some(last)) => {
                start = last.key().to_vec();
                start.push(0);
            }
            _ => return Ok(Mirror::new(entries, revision)),
        }
    }
}
