//! A watcher's catch-up: the events of a key or prefix from a past revision through the
//! revision the watcher joined the fan-out at, read from etcd's history when the
//! fan-out's own history no longer holds them.
//!
//! The catch-up watches every key, not only the watcher's: every revision has an event
//! there, so reaching the join revision is certain and seen.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{WatchClient, WatchOptions};
use lockcell_cell::keyspace;
use tokio::sync::{mpsc, Semaphore};

use crate::fanout::{in_chunks, RESPONSE_BYTES};
use crate::feed::{self, Gap, MAX_WATCH_MESSAGE_BYTES};
use crate::metrics;
use crate::mirror::{EventKind, KeyEvent, Topic};

/// What a catch-up reads with.
pub struct CatchUp {
    pub client: WatchClient,
    /// The last revision to deliver: the watcher's join position.
    pub through: i64,
    /// Catch-ups allowed at once.
    pub slots: Arc<Semaphore>,
}

/// What a watcher from a past revision gets before the fan-out's queue.
pub enum Before {
    /// The events the fan-out's history kept, through the join position.
    Kept(Vec<KeyEvent>),
    /// A catch-up from etcd's history.
    Etcd(Box<CatchUp>),
}

impl Before {
    /// For a watcher from `start` whose subscription joined at `joined` with `kept`
    /// from the fan-out's history: that history, used only as far back as etcd keeps
    /// its own (a watch from a compacted revision is answered as one), else a catch-up
    /// on etcd's.
    /// `reads` tells how far back etcd keeps history; a catch-up watches with `etcd`.
    pub async fn choose(
        (reads, etcd): (&crate::reads::Reads, &etcd_client::Client),
        start: i64,
        joined: i64,
        kept: Option<Vec<KeyEvent>>,
    ) -> Before {
        if let Some(events) = kept {
            if reads.history_kept_from(start - 1).await {
                ::metrics::counter!(metrics::WATCH_HISTORY_STARTS).increment(1);
                return Before::Kept(events);
            }
        }
        let feed = &reads.feed;
        Before::Etcd(Box::new(CatchUp {
            client: etcd.watch_client(),
            through: joined,
            slots: feed.catch_ups.clone(),
        }))
    }
}

/// Events delivered by a catch-up: every event of the watcher's topic in the revisions
/// up to `reached`, from the start or the last batch on.
#[derive(Debug)]
pub struct CaughtUp {
    pub reached: i64,
    pub events: Vec<KeyEvent>,
}

/// Why a catch-up stopped short.
#[derive(Debug)]
pub enum CatchUpError {
    /// etcd compacted its history through this revision.
    Compacted(i64),
    /// etcd's history skips revisions from the start on: resuming cannot help.
    Gap(Gap),
    Etcd(String),
    /// Whoever wanted the events did not take them for [`SLOW_READER`]: the catch-up
    /// gives its slot and etcd's stream up, to start again from where it was.
    Slow,
    /// Whoever wanted the events stopped listening.
    ClientGone,
}

/// How long a catch-up waits for its reader to take a response before giving up its
/// slot (catch-ups are few at a time: one reader that stops must not hold one).
pub const SLOW_READER: Duration = Duration::from_secs(5);

impl CatchUp {
    /// Sends `topic`'s events from revision `start` through [`CatchUp::through`] to
    /// `out`, previous values included when `prev_kv`, and drops `out` when done.
    pub async fn run(
        self,
        topic: &Topic,
        start: i64,
        prev_kv: bool,
        out: mpsc::Sender<CaughtUp>,
    ) -> Result<(), CatchUpError> {
        tokio::select! {
            result = self.read(topic, start, prev_kv, &out) => result,
            _ = out.closed() => Err(CatchUpError::ClientGone),
        }
    }

    async fn read(
        self,
        topic: &Topic,
        start: i64,
        prev_kv: bool,
        out: &mpsc::Sender<CaughtUp>,
    ) -> Result<(), CatchUpError> {
        let CatchUp {
            client,
            through,
            slots,
        } = self;
        // A catch-up reads the cell's history, not only this watcher's keys: a few at a
        // time, the others wait their turn.
        let _slot = slots
            .acquire_owned()
            .await
            .map_err(|_| CatchUpError::Etcd("the proxy is stopping".into()))?;
        let mut stream = history(client, start, prev_kv).await?;
        ::metrics::counter!(metrics::WATCH_CATCH_UPS).increment(1);
        let _counted = metrics::Counted::in_gauge(metrics::ETCD_WATCHES);
        let mut seen = start - 1;
        // The events of the last revision of a fragment, whose next fragment may hold
        // more of that revision: taken with it, so every revision goes whole.
        let mut held: Vec<etcd_client::Event> = Vec::new();
        loop {
            let resp = match stream.message().await {
                Ok(Some(resp)) => resp,
                Ok(None) => return Err(CatchUpError::Etcd("etcd ended the watch".into())),
                Err(e) => return Err(CatchUpError::Etcd(e.to_string())),
            };
            if resp.compact_revision() > 0 {
                return Err(CatchUpError::Compacted(resp.compact_revision()));
            }
            if resp.canceled() {
                return Err(CatchUpError::Etcd(resp.cancel_reason().to_owned()));
            }
            let mut whole = std::mem::take(&mut held);
            whole.extend(resp.events().iter().cloned());
            if resp.0.fragment {
                held = hold_back_last_revision(&mut whole);
            }
            if whole.is_empty() {
                continue;
            }
            let revisions = whole
                .iter()
                .filter_map(|e| e.kv())
                .map(|kv| kv.mod_revision());
            // A hole in history etcd serves is there for every retry too.
            let reached = feed::contiguous(seen, revisions).map_err(CatchUpError::Gap)?;
            seen = reached;
            let leased = feed::leased_in(&whole);
            let events: Vec<KeyEvent> = whole
                .iter()
                .filter_map(|e| event(e, &leased, topic, start, through))
                .collect();
            drop(whole);
            hand_over(out, events, reached.min(through)).await?;
            if reached >= through {
                return Ok(());
            }
        }
    }
}

/// etcd's history from `start` on, by a watch of every key: one revision early, as
/// etcd accepts a watch from exactly its compact revision but has dropped the deletes
/// made at it, so a watch from `start` could skip them unseen (from `start - 1`, a
/// compaction at `start` is refused as one). In fragments: etcd sends a batch of
/// history (up to a thousand revisions, with their previous values) as one response,
/// which could take hundreds of MiB of the proxy's memory per catch-up; fragments are
/// at most etcd's request size.
async fn history(
    client: WatchClient,
    start: i64,
    prev_kv: bool,
) -> Result<etcd_client::WatchStream, CatchUpError> {
    let mut options = WatchOptions::new()
        .with_all_keys()
        .with_fragment()
        .with_start_revision((start - 1).max(1));
    if prev_kv {
        options = options.with_prev_key();
    }
    let mut client = client.max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES);
    client
        .watch(vec![0u8], Some(options))
        .await
        .map_err(|e| CatchUpError::Etcd(e.to_string()))
}

/// Hands `events` (through revision `through`) to the reader: a response at a time, in
/// whole revisions of a bounded size, each taken by the reader before the next is read.
async fn hand_over(
    out: &mpsc::Sender<CaughtUp>,
    events: Vec<KeyEvent>,
    through: i64,
) -> Result<(), CatchUpError> {
    for (reached, events) in in_chunks(events, through, RESPONSE_BYTES) {
        match tokio::time::timeout(SLOW_READER, out.send(CaughtUp { reached, events })).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(CatchUpError::ClientGone),
            Err(_) => return Err(CatchUpError::Slow),
        }
    }
    Ok(())
}

/// Takes the events of the last revision in `events` out and returns them.
fn hold_back_last_revision(events: &mut Vec<etcd_client::Event>) -> Vec<etcd_client::Event> {
    let revision = |e: &etcd_client::Event| e.kv().map(|kv| kv.mod_revision());
    let Some(last) = events.last().and_then(revision) else {
        return Vec::new();
    };
    let cut = events
        .iter()
        .position(|e| revision(e) == Some(last))
        .unwrap_or(events.len());
    events.split_off(cut)
}

/// An etcd event as a small key's event, if it is one of `topic`'s in the revisions
/// from `start` through `through`.
/// `leased`: the client lease records written in the same response, which give the key
/// its client lease and, when the write rewrote or deleted the record of the key's
/// previous write, the previous key its own (0 when the write left the record alone).
fn event(
    e: &etcd_client::Event,
    leased: &feed::Leased,
    topic: &Topic,
    start: i64,
    through: i64,
) -> Option<KeyEvent> {
    let (name, revision, put) = feed::change(e, leased)?;
    if revision < start || revision > through || !topic.matches(&name) {
        return None;
    }
    let prev = e.prev_kv().and_then(|kv| {
        let mut prev = feed::entry(keyspace::kv_name(kv.key())?, kv);
        let record = leased.get(&(name.clone(), revision)).and_then(|r| r.prev);
        if let Some((lease, written)) = record {
            if prev.lease != 0 && written == prev.mod_revision {
                prev.client_lease = lease;
            }
        }
        Some(prev)
    });
    Some(match put {
        Some(entry) => KeyEvent {
            kind: EventKind::Put,
            entry,
            prev,
        },
        None => KeyEvent::deleted(name, revision, prev),
    })
}
