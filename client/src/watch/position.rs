//! The pure core of a [`Watcher`](super::Watcher): how far a watch has been delivered,
//! what a response adds to it, and events off the wire. No I/O.

use lockcell_proto::v1::watch_event::Kind;
use lockcell_proto::v1::{WatchEvent as WireEvent, WatchResponse};

use super::{EventKind, WatchBatch, WatchEvent};
use crate::error::Error;
use crate::kv::entry;

/// How far a watch has been delivered: the pure core of a [`Watcher`].
///
/// Two revisions, because a progress report claims more than it shows: `revision` is
/// what the proxy has said is complete (where a resumed watch goes on from), and
/// `last_event` the newest event handed out. Duplicates are told by `last_event`, so an
/// event the proxy sends after a progress report that claimed past it (the proxy being
/// wrong) is still delivered rather than lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Position {
    /// Every event at or before this revision has been delivered; never goes back.
    pub(super) revision: i64,
    /// No event at or before this revision is delivered (again): the newest event
    /// delivered, or the start of the watch.
    last_event: i64,
}

impl Position {
    /// A watch just set up, asked to start at `start` (0: now), whose `created`
    /// response said `created`. Asked for a start, the application expects every event
    /// from it on, so that decides (the proxy's `created` is `start - 1` then).
    pub(super) fn created(start: i64, created: i64) -> Position {
        let revision = if start > 0 { start - 1 } else { created };
        Position {
            revision,
            last_event: revision,
        }
    }

    /// The watch set up again from `from`: nothing before `from` is wanted any more
    /// (the proxy said so after a cut-off), and nothing delivered is wanted again.
    pub(super) fn resumed(&mut self, from: i64, created: i64) {
        let at = Position::created(from, created).revision;
        self.revision = self.revision.max(at);
    }

    /// Applies a response: `Some` batch to deliver, or `None` when it brings nothing
    /// new (a replay of what was delivered).
    pub(super) fn accept(&mut self, response: WatchResponse) -> Result<Option<WatchBatch>, Error> {
        let had_events = !response.events.is_empty();
        let mut events = Vec::with_capacity(response.events.len());
        for event in response.events {
            let event = event_from_wire(event)?;
            if event.entry.mod_revision > self.last_event {
                events.push(event);
            }
        }
        let newest = events.iter().map(|e| e.entry.mod_revision).max();
        let through = newest.map_or(response.revision, |n| n.max(response.revision));
        if events.is_empty() && had_events && through <= self.revision {
            return Ok(None);
        }
        if let Some(newest) = newest {
            self.last_event = newest;
        }
        self.revision = self.revision.max(through);
        Ok(Some(WatchBatch {
            revision: self.revision,
            events,
        }))
    }
}

fn event_from_wire(event: WireEvent) -> Result<WatchEvent, Error> {
    let kind = match Kind::try_from(event.kind) {
        Ok(Kind::Put) => EventKind::Put,
        Ok(Kind::Delete) => EventKind::Delete,
        Err(_) => {
            return Err(Error::Protocol(format!(
                "a watch event of unknown kind {}",
                event.kind
            )))
        }
    };
    let kv = event
        .kv
        .ok_or_else(|| Error::Protocol("a watch event without its key".to_owned()))?;
    Ok(WatchEvent {
        kind,
        entry: entry(kv),
        prev: event.prev_kv.map(entry),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockcell_proto::v1::KeyValue;

    fn kv(key: &str, value: &str, revision: i64) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: value.into(),
            create_revision: 3,
            mod_revision: revision,
            version: 2,
            lease: 0,
        }
    }

    fn put(key: &str, value: &str, revision: i64) -> WireEvent {
        WireEvent {
            kind: Kind::Put as i32,
            kv: Some(kv(key, value, revision)),
            prev_kv: None,
        }
    }

    fn response(revision: i64, events: Vec<WireEvent>) -> WatchResponse {
        WatchResponse {
            created: false,
            revision,
            events,
            cell: String::new(),
        }
    }

    fn revisions(batch: &WatchBatch) -> Vec<i64> {
        batch.events.iter().map(|e| e.entry.mod_revision).collect()
    }

    #[test]
    fn events_come_off_the_wire_whole() {
        let wire = WireEvent {
            kind: Kind::Delete as i32,
            kv: Some(KeyValue {
                lease: 0,
                value: Vec::new(),
                ..kv("members/web/a", "", 9)
            }),
            prev_kv: Some(KeyValue {
                lease: 77,
                ..kv("members/web/a", "10.0.0.1", 5)
            }),
        };
        let event = event_from_wire(wire).unwrap();
        assert_eq!(event.kind, EventKind::Delete);
        assert_eq!(event.entry.key, "members/web/a");
        assert_eq!(event.entry.mod_revision, 9);
        assert!(!event.entry.ephemeral);
        let prev = event.prev.expect("prev");
        assert_eq!(
            (prev.value.as_slice(), prev.ephemeral),
            (&b"10.0.0.1"[..], true)
        );

        let keyless = WireEvent {
            kv: None,
            ..put("a", "1", 1)
        };
        assert!(matches!(event_from_wire(keyless), Err(Error::Protocol(_))));
        let strange = WireEvent {
            kind: 7,
            ..put("a", "1", 1)
        };
        assert!(matches!(event_from_wire(strange), Err(Error::Protocol(_))));
    }

    #[test]
    fn a_watch_from_now_starts_after_the_created_revision_and_one_from_a_revision_before_it() {
        assert_eq!(Position::created(0, 41).revision, 41);
        assert_eq!(Position::created(30, 29).revision, 29);
        // Asked for 30 on, the application wants 30 whatever the proxy claims.
        assert_eq!(Position::created(30, 41).revision, 29);
    }

    #[test]
    fn responses_move_the_position_and_progress_is_an_empty_batch() {
        let mut at = Position::created(0, 10);
        let batch = at
            .accept(response(12, vec![put("a", "1", 11), put("b", "2", 12)]))
            .unwrap()
            .unwrap();
        assert_eq!((batch.revision, revisions(&batch)), (12, vec![11, 12]));
        let progress = at.accept(response(20, vec![])).unwrap().unwrap();
        assert_eq!((progress.revision, progress.events.len()), (20, 0));
        assert_eq!(at.revision, 20);
        // A response's revision never moves the position back.
        let stale = at.accept(response(15, vec![])).unwrap().unwrap();
        assert_eq!(stale.revision, 20);
    }

    #[test]
    fn what_was_delivered_is_never_delivered_again() {
        let mut at = Position::created(0, 10);
        at.accept(response(12, vec![put("a", "1", 11), put("b", "2", 12)]))
            .unwrap();
        // A replay of delivered revisions brings nothing.
        assert_eq!(
            at.accept(response(12, vec![put("b", "2", 12)])).unwrap(),
            None
        );
        // A response that overlaps delivers only what is new.
        let batch = at
            .accept(response(14, vec![put("b", "2", 12), put("c", "3", 14)]))
            .unwrap()
            .unwrap();
        assert_eq!((batch.revision, revisions(&batch)), (14, vec![14]));
        // Resuming from an earlier revision than delivered keeps the position...
        at.resumed(11, 10);
        assert_eq!(at.revision, 14);
        // ...and resuming from a later one (after a cut-off) moves it there.
        at.resumed(30, 29);
        assert_eq!(at.revision, 29);
    }

    #[test]
    fn events_below_an_overreaching_progress_report_are_delivered_not_dropped() {
        let mut at = Position::created(0, 10);
        at.accept(response(11, vec![put("a", "1", 11)])).unwrap();
        // The proxy claims everything through 20 was sent...
        at.accept(response(20, vec![])).unwrap();
        // ...then, resumed from an earlier revision after a cut-off, shows 15 after all.
        at.resumed(12, 11);
        let batch = at
            .accept(response(15, vec![put("a", "1", 11), put("b", "2", 15)]))
            .unwrap()
            .unwrap();
        assert_eq!((batch.revision, revisions(&batch)), (20, vec![15]));
        // What was delivered still is not delivered again.
        assert_eq!(
            at.accept(response(15, vec![put("b", "2", 15)])).unwrap(),
            None
        );
    }
}
