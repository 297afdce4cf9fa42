//! Watch fan-out: every local watcher of a key or prefix gets the events of the proxy's
//! one watch over the cell, without asking etcd for anything.
//!
//! Watchers of the same key or prefix share one topic; an event is matched to topics by
//! looking up its key and each of the key's prefixes, so the cost of an event does not
//! grow with the number of topics. Delivery never waits: each watcher has a bounded
//! backlog, and a watcher whose backlog is full is cut off (told the revision to resume
//! from) instead of slowing the others.
//!
//! Watchers of a single key (a lock recipe waiting for its predecessor's delete) are
//! handed their events as the revision is published. Watchers of prefixes (membership
//! groups, configuration trees) are handed theirs by a paced lane ([`Fanout::pace`]),
//! a few at a time with the runtime's other work in between: when a zone's sessions
//! end, the survivors' membership events (millions at the seed's sizes) would otherwise
//! fill the proxy's run queue for seconds, and every lock waiter's wake-up, reply and
//! next transaction would queue behind them. The revision through which every watcher
//! has been handed its events is [`Fanout::delivered`]; a progress claim never goes past
//! it.
//!
//! The fan-out also keeps the events of its last revisions (up to [`HISTORY_BYTES`]), so
//! a watcher that starts a little in the past — the usual case: it read at a revision
//! and watches from the one after — joins with those events in hand and costs etcd
//! nothing.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::{mpsc, watch, Notify};

use crate::mirror::{key_bytes, KeyEvent, Topic};

mod history;
mod topics;

use self::history::*;
use self::topics::*;

/// What the fan-out's history of recent events holds by default
/// (`--watch-history-bytes`): names and values (and previous values) with
/// [`crate::mirror::PER_KEY_BYTES`] for each event.
pub const HISTORY_BYTES: usize = 16 << 20;

/// The most a watcher takes from the history when it joins: one further behind reads
/// etcd's history instead, a response at a time, at the pace its client reads.
pub const HISTORY_START_BYTES: usize = 4 << 20;

/// About the most event bytes one watch response carries (whole revisions; a revision
/// bigger than this goes alone): clients refuse messages over 4 MiB by default.
pub const RESPONSE_BYTES: usize = 1 << 20;

/// How many prefix watchers the paced lane hands a batch to before it lets the
/// runtime's other tasks run.
const LANE_STEP: usize = 64;

/// What an event weighs in a response: its name, its values and a share for the rest.
pub fn event_bytes(event: &KeyEvent) -> usize {
    event.entry.name.len()
        + event.entry.value.len()
        + event.prev.as_ref().map_or(0, |p| p.value.len())
        + 64
}

/// `events` (in revision order) cut into runs of whole revisions of about `limit`
/// bytes, each with the last revision it covers; the last run covers through `through`.
pub fn in_chunks(events: Vec<KeyEvent>, through: i64, limit: usize) -> Vec<(i64, Vec<KeyEvent>)> {
    let mut chunks: Vec<(i64, Vec<KeyEvent>)> = Vec::new();
    let mut current: Vec<KeyEvent> = Vec::new();
    let mut bytes = 0;
    for event in events {
        let revision = event.revision();
        if bytes >= limit && current.last().is_some_and(|e| e.revision() != revision) {
            let last = current.last().map_or(through, KeyEvent::revision);
            chunks.push((last, std::mem::take(&mut current)));
            bytes = 0;
        }
        bytes += event_bytes(&event);
        current.push(event);
    }
    if !current.is_empty() {
        chunks.push((through, current));
    }
    chunks
}

/// Events of whole revisions for one topic; `revision` is the last revision they cover.
#[derive(Debug)]
pub struct Batch {
    pub revision: i64,
    pub events: Vec<KeyEvent>,
}

impl Batch {
    /// The first revision in the batch.
    pub fn first_revision(&self) -> i64 {
        self.events
            .first()
            .map(KeyEvent::revision)
            .unwrap_or(self.revision)
    }
}

/// Why a watcher's deliveries stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Its backlog overflowed; every event before `resume` was delivered.
    CutOff { resume: i64 },
    /// The proxy's view of the cell broke (a compaction while etcd was away, or the
    /// proxy is stopping); the watcher resumes from its last revision + 1.
    FeedLost,
}

/// A watcher's end of the fan-out. Dropping it leaves the topic.
pub struct Subscription {
    /// The revision the fan-out had published when the watcher joined: it receives every
    /// batch after it.
    pub joined_at: i64,
    pub batches: mpsc::Receiver<Arc<Batch>>,
    /// Set before the sender is dropped, when deliveries stop for a reason.
    pub end: Arc<OnceLock<End>>,
    fanout: Arc<Fanout>,
    topic: Topic,
    id: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.fanout.leave(&self.topic, self.id);
    }
}

/// What a publish did, for metrics.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Batches handed to watchers.
    pub delivered: u64,
    /// Watchers cut off for a full backlog.
    pub cut_off: u64,
}

/// The proxy's watchers, by topic.
pub struct Fanout {
    topics: Mutex<Topics>,
    history_bytes: usize,
    /// The revision through which every watcher has been handed its batches.
    delivered: watch::Sender<i64>,
    /// True once [`Fanout::pace`] runs: prefix batches wait for it in the lane.
    paced: AtomicBool,
    lane_ready: Notify,
}

impl Default for Fanout {
    fn default() -> Fanout {
        Fanout::with_history(HISTORY_BYTES)
    }
}

impl Fanout {
    /// A fan-out that keeps up to `history_bytes` of recent events (see [`History`]).
    pub fn with_history(history_bytes: usize) -> Fanout {
        Fanout {
            topics: Mutex::default(),
            history_bytes,
            delivered: watch::channel(0).0,
            paced: AtomicBool::new(false),
            lane_ready: Notify::new(),
        }
    }

    /// Starts (or restarts) delivering, from a view of the cell at `revision`.
    pub fn open(&self, revision: i64) {
        let mut topics = self.topics.lock().expect("fan-out lock");
        topics.open = true;
        topics.revision = revision;
        topics.history.restart(revision);
        topics.lane.clear();
        self.delivered.send_replace(revision);
    }

    /// The revision through which every watcher has been handed its batches: a watcher
    /// that has taken everything queued for it has every event through it.
    pub fn delivered(&self) -> i64 {
        *self.delivered.borrow()
    }

    pub fn subscribe_delivered(&self) -> watch::Receiver<i64> {
        self.delivered.subscribe()
    }

    /// Joins `topic` with a backlog of `backlog` batches. While the fan-out is not open
    /// the subscription comes back already ended ([`End::FeedLost`]).
    pub fn subscribe(self: &Arc<Self>, topic: Topic, backlog: usize) -> Subscription {
        self.subscribe_from(topic, backlog, i64::MAX).0
    }

    /// Joins `topic` as [`Self::subscribe`] does, and answers the topic's events from
    /// revision `from` through the join position, when the history still holds all of
    /// them (`None`: it does not, or `from` is past the join position).
    pub fn subscribe_from(
        self: &Arc<Self>,
        topic: Topic,
        backlog: usize,
        from: i64,
    ) -> (Subscription, Option<Vec<KeyEvent>>) {
        let (tx, rx) = mpsc::channel(backlog.max(1));
        let end = Arc::new(OnceLock::new());
        let mut topics = self.topics.lock().expect("fan-out lock");
        if !topics.open {
            let _ = end.set(End::FeedLost);
            let sub = Subscription {
                joined_at: topics.revision,
                batches: rx,
                end,
                fanout: self.clone(),
                topic,
                id: u64::MAX,
            };
            return (sub, None);
        }
        let past = (from <= topics.revision)
            .then(|| topics.history.since(&topic, from))
            .flatten();
        let id = topics.next_id;
        topics.next_id += 1;
        topics.watchers += 1;
        let joined_at = topics.revision;
        topics
            .of(topic.prefix)
            .entry(topic.name.clone())
            .or_default()
            .push(Watcher {
                id,
                joined_at,
                tx,
                end: end.clone(),
            });
        let sub = Subscription {
            joined_at,
            batches: rx,
            end,
            fanout: self.clone(),
            topic,
            id,
        };
        (sub, past)
    }

    /// The last revision published.
    pub fn revision(&self) -> i64 {
        self.topics.lock().expect("fan-out lock").revision
    }

    /// Watchers and distinct topics now.
    pub fn counts(&self) -> (usize, usize) {
        let topics = self.topics.lock().expect("fan-out lock");
        (topics.watchers, topics.exact.len() + topics.prefixes.len())
    }

    /// Hands the events of the revisions up to `revision` to every watcher they match:
    /// single-key watchers at once, prefix watchers through the lane (at once too while
    /// [`Fanout::pace`] does not run).
    pub fn publish(&self, revision: i64, events: &[KeyEvent]) -> Published {
        let mut topics = self.topics.lock().expect("fan-out lock");
        topics.revision = topics.revision.max(revision);
        let limit = self.history_bytes;
        topics.history.push(events, limit);
        let mut done = Published::default();
        if events.is_empty() || topics.watchers == 0 {
            self.through(&mut topics, revision);
            return done;
        }
        let mut matched: HashMap<(bool, &str), Vec<KeyEvent>> = HashMap::new();
        for event in events {
            let name = event.entry.name.as_str();
            if topics.exact.contains_key(name) {
                matched
                    .entry((false, name))
                    .or_default()
                    .push(event.clone());
            }
            let cuts = name.char_indices().map(|(i, _)| i).chain([name.len()]);
            for cut in cuts {
                if topics.prefixes.contains_key(&name[..cut]) {
                    matched
                        .entry((true, &name[..cut]))
                        .or_default()
                        .push(event.clone());
                }
            }
        }
        let matched: Vec<(bool, String, Arc<Batch>)> = matched
            .into_iter()
            .map(|((prefix, name), events)| {
                (
                    prefix,
                    name.to_owned(),
                    Arc::new(Batch { revision, events }),
                )
            })
            .collect();
        // Single keys now; prefixes through the lane, after what it holds already.
        let mut queued = false;
        for (prefix, name, batch) in matched {
            if prefix {
                topics.lane.push_back(Queued::Batch(name, batch));
                queued = true;
            } else {
                topics.hand(false, &name, &batch, &mut done);
            }
        }
        self.through(&mut topics, revision);
        drop(topics);
        if !queued {
            return done;
        }
        if self.paced.load(Ordering::Acquire) {
            self.lane_ready.notify_one();
        } else {
            let handed = self.hand_queued(usize::MAX).0;
            done.delivered += handed.delivered;
            done.cut_off += handed.cut_off;
        }
        done
    }

    /// Marks `revision` delivered once the lane has handed over what it holds.
    fn through(&self, topics: &mut Topics, revision: i64) {
        if topics.lane.is_empty() {
            self.delivered.send_replace(revision);
        } else {
            topics.lane.push_back(Queued::Through(revision));
        }
    }

    /// Hands up to `most` queued prefix batches to their topics' watchers; true when
    /// more are queued.
    fn hand_queued(&self, most: usize) -> (Published, bool) {
        let mut topics = self.topics.lock().expect("fan-out lock");
        let mut done = Published::default();
        let mut handed = 0;
        while handed < most {
            match topics.lane.pop_front() {
                Some(Queued::Batch(name, batch)) => {
                    handed += topics.prefixes.get(&name).map_or(0, Vec::len);
                    topics.hand(true, &name, &batch, &mut done);
                }
                Some(Queued::Through(revision)) => {
                    self.delivered.send_replace(revision);
                }
                None => break,
            }
        }
        let more = !topics.lane.is_empty();
        (done, more)
    }

    /// Hands the prefix watchers their batches, [`LANE_STEP`] watchers at a time with
    /// the runtime's other tasks run in between, for as long as the proxy runs.
    pub async fn pace(self: Arc<Self>) {
        self.paced.store(true, Ordering::Release);
        // Anything published before the lane ran.
        self.lane_ready.notify_one();
        loop {
            self.lane_ready.notified().await;
            loop {
                let (done, more) = self.hand_queued(LANE_STEP);
                ::metrics::counter!(crate::metrics::WATCH_BATCHES_SENT).increment(done.delivered);
                ::metrics::counter!(crate::metrics::WATCHERS_CUT_OFF).increment(done.cut_off);
                if !more {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
    }

    /// Ends every watcher: the proxy can no longer promise them every event.
    pub fn end_all(&self, why: End) {
        let mut topics = self.topics.lock().expect("fan-out lock");
        topics.open = false;
        for watcher in topics
            .exact
            .values()
            .chain(topics.prefixes.values())
            .flatten()
        {
            let _ = watcher.end.set(why);
        }
        topics.exact.clear();
        topics.prefixes.clear();
        topics.lane.clear();
        topics.watchers = 0;
    }

    fn leave(&self, topic: &Topic, id: u64) {
        let mut topics = self.topics.lock().expect("fan-out lock");
        let map = topics.of(topic.prefix);
        let Some(watchers) = map.get_mut(&topic.name) else {
            return;
        };
        let before = watchers.len();
        watchers.retain(|w| w.id != id);
        let left = before - watchers.len();
        if watchers.is_empty() {
            map.remove(&topic.name);
        }
        topics.watchers -= left;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::EventKind;
    use lockcell_cell::kv::Entry;

    fn put(name: &str, rev: i64) -> KeyEvent {
        KeyEvent {
            kind: EventKind::Put,
            entry: Entry {
                name: name.into(),
                value: Vec::new(),
                create_revision: rev,
                mod_revision: rev,
                version: 1,
                lease: 0,
                client_lease: 0,
            },
            prev: None,
        }
    }

    fn topic(name: &str, prefix: bool) -> Topic {
        Topic {
            name: name.into(),
            prefix,
        }
    }

    #[test]
    fn events_reach_exactly_the_topics_they_match() {
        let fanout = Arc::new(Fanout::default());
        fanout.open(0);
        let mut group = fanout.subscribe(topic("members/a/", true), 8);
        let mut loose = fanout.subscribe(topic("members/a", true), 8);
        let mut key = fanout.subscribe(topic("members/a/1", false), 8);
        let mut other = fanout.subscribe(topic("members/b/", true), 8);
        let mut all = fanout.subscribe(topic("", true), 8);
        assert_eq!(fanout.counts(), (5, 5));
        fanout.publish(10, &[put("members/a/1", 9), put("members/ab", 10)]);
        let names = |b: Arc<Batch>| -> Vec<String> {
            b.events.iter().map(|e| e.entry.name.clone()).collect()
        };
        assert_eq!(names(group.batches.try_recv().unwrap()), ["members/a/1"]);
        assert_eq!(
            names(loose.batches.try_recv().unwrap()),
            ["members/a/1", "members/ab"]
        );
        assert_eq!(names(key.batches.try_recv().unwrap()), ["members/a/1"]);
        assert_eq!(all.batches.try_recv().unwrap().revision, 10);
        assert!(other.batches.try_recv().is_err());
        assert_eq!(fanout.revision(), 10);
    }

    #[test]
    fn prefix_watchers_wait_for_the_lane_and_joiners_meanwhile_skip_what_it_holds() {
        let fanout = Arc::new(Fanout::default());
        fanout.paced.store(true, Ordering::Release);
        fanout.open(0);
        let mut key = fanout.subscribe(topic("locks/a", false), 8);
        let mut group = fanout.subscribe(topic("members/", true), 8);
        fanout.publish(1, &[put("locks/a", 1), put("members/x", 1)]);
        assert_eq!(
            key.batches.try_recv().unwrap().revision,
            1,
            "a single key at once"
        );
        assert!(
            group.batches.try_recv().is_err(),
            "a prefix waits for the lane"
        );
        assert_eq!(
            fanout.delivered(),
            0,
            "no progress past what the lane holds"
        );
        // Joined after revision 1 was published: it has it from the history.
        let (mut late, past) = fanout.subscribe_from(topic("members/", true), 8, 1);
        assert_eq!(past.map(|p| p.len()), Some(1));
        fanout.publish(2, &[put("members/y", 2)]);
        assert!(fanout.hand_queued(1).1, "one watcher a step");
        assert!(!fanout.hand_queued(usize::MAX).1);
        assert_eq!(fanout.delivered(), 2);
        let revisions = |sub: &mut Subscription| -> Vec<i64> {
            std::iter::from_fn(|| sub.batches.try_recv().ok())
                .map(|b| b.revision)
                .collect()
        };
        assert_eq!(revisions(&mut group), [1, 2]);
        assert_eq!(revisions(&mut late), [2], "revision 1 only once");
        // Nothing queued: delivered moves with the publish.
        fanout.publish(3, &[put("locks/a", 3)]);
        assert_eq!(fanout.delivered(), 3);
        fanout.publish(4, &[put("members/z", 4)]);
        fanout.end_all(End::FeedLost);
        fanout.open(9);
        assert!(!fanout.hand_queued(usize::MAX).1, "a reload drops the lane");
        assert_eq!(fanout.delivered(), 9);
    }

    #[test]
    fn a_full_backlog_cuts_off_only_that_watcher_with_its_resume_revision() {
        let fanout = Arc::new(Fanout::default());
        fanout.open(0);
        let mut slow = fanout.subscribe(topic("k", false), 2);
        let mut fast = fanout.subscribe(topic("k", false), 2);
        for rev in 1..=5 {
            let done = fanout.publish(rev, &[put("k", rev)]);
            let _ = fast.batches.try_recv().unwrap();
            if rev == 3 {
                assert_eq!(done.cut_off, 1);
            }
        }
        assert_eq!(slow.end.get(), Some(&End::CutOff { resume: 3 }));
        let got: Vec<i64> = std::iter::from_fn(|| slow.batches.try_recv().ok())
            .map(|b| b.revision)
            .collect();
        assert_eq!(got, [1, 2], "everything before the resume revision");
        assert_eq!(fanout.counts(), (1, 1));
    }

    #[test]
    fn leaving_forgets_the_topic_and_joining_reports_the_position() {
        let fanout = Arc::new(Fanout::default());
        fanout.open(0);
        fanout.publish(7, &[]);
        let one = fanout.subscribe(topic("p/", true), 4);
        assert_eq!(one.joined_at, 7);
        drop(one);
        assert_eq!(fanout.counts(), (0, 0));
        let two = fanout.subscribe(topic("p/", true), 4);
        fanout.end_all(End::FeedLost);
        assert_eq!(two.end.get(), Some(&End::FeedLost));
        drop(two);
        assert_eq!(fanout.counts(), (0, 0));
        let three = fanout.subscribe(topic("p/", true), 4);
        assert_eq!(
            three.end.get(),
            Some(&End::FeedLost),
            "nobody joins a fan-out that may have missed events"
        );
    }

    #[test]
    fn a_watcher_from_a_recent_revision_joins_with_the_events_since() {
        let fanout = Arc::new(Fanout::default());
        fanout.open(4);
        fanout.publish(5, &[put("a/1", 5)]);
        fanout.publish(6, &[put("b/1", 6)]);
        fanout.publish(7, &[put("a/2", 7)]);
        let names = |events: Vec<KeyEvent>| -> Vec<String> {
            events.into_iter().map(|e| e.entry.name).collect()
        };
        let (sub, past) = fanout.subscribe_from(topic("a/", true), 8, 6);
        assert_eq!(sub.joined_at, 7);
        assert_eq!(names(past.unwrap()), ["a/2"]);
        let (_, past) = fanout.subscribe_from(topic("a/", true), 8, 5);
        assert_eq!(names(past.unwrap()), ["a/1", "a/2"]);
        let (_, past) = fanout.subscribe_from(topic("a/", true), 8, 8);
        assert_eq!(
            past, None,
            "a start past the join position needs no history"
        );
        let (_, past) = fanout.subscribe_from(topic("a/", true), 8, 4);
        assert_eq!(
            past, None,
            "revision 4 came before the view: not in the history"
        );
    }

    #[test]
    fn events_are_cut_between_revisions_only() {
        let events = vec![put("a", 1), put("b", 1), put("c", 2), put("d", 3)];
        let one = event_bytes(&events[0]);
        let shape = |limit| -> Vec<(i64, usize)> {
            in_chunks(events.clone(), 9, limit)
                .iter()
                .map(|(r, e)| (*r, e.len()))
                .collect()
        };
        assert_eq!(
            shape(one),
            [(1, 2), (2, 1), (9, 1)],
            "revision 1 stays whole"
        );
        assert_eq!(shape(2 * one + 1), [(2, 3), (9, 1)]);
        assert_eq!(in_chunks(events, 9, usize::MAX).len(), 1);
        assert!(in_chunks(Vec::new(), 9, 1).is_empty());
    }

    #[test]
    fn the_history_forgets_whole_revisions_past_its_size() {
        let one = key_bytes("k", 0);
        let fanout = Arc::new(Fanout::with_history(3 * one));
        fanout.open(0);
        fanout.publish(1, &[put("k", 1)]);
        fanout.publish(2, &[put("k", 2), put("k", 2)]);
        fanout.publish(3, &[put("k", 3)]);
        // Revision 1 left to make room; revision 2 is whole.
        let (_, past) = fanout.subscribe_from(topic("k", false), 8, 2);
        assert_eq!(past.map(|p| p.len()), Some(3));
        assert_eq!(fanout.subscribe_from(topic("k", false), 8, 1).1, None);
        fanout.publish(4, &[put("k", 4)]);
        // Revision 2 went whole, not one of its two events.
        assert_eq!(fanout.subscribe_from(topic("k", false), 8, 2).1, None);
        let (_, past) = fanout.subscribe_from(topic("k", false), 8, 3);
        assert_eq!(past.map(|p| p.len()), Some(2));
        // A reload starts the history again.
        fanout.end_all(End::FeedLost);
        fanout.open(10);
        assert_eq!(fanout.subscribe_from(topic("k", false), 8, 4).1, None);
        assert_eq!(fanout.subscribe_from(topic("k", false), 8, 11).1, None);
    }
}
