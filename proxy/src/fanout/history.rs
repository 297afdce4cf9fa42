//! The fan-out's recent history: the events of the last revisions, for watchers that
//! join from a recent revision.

use super::*;

/// The events of the last revisions published, oldest first.
#[derive(Default)]
pub(super) struct History {
    pub(super) events: VecDeque<KeyEvent>,
    pub(super) bytes: usize,
    /// Every event from this revision on is in `events`.
    pub(super) complete_from: i64,
}

impl History {
    pub(super) fn restart(&mut self, revision: i64) {
        self.events.clear();
        self.bytes = 0;
        self.complete_from = revision + 1;
    }

    pub(super) fn cost(event: &KeyEvent) -> usize {
        key_bytes(&event.entry.name, event.entry.value.len())
            + event.prev.as_ref().map_or(0, |p| p.value.len())
    }

    pub(super) fn push(&mut self, events: &[KeyEvent], limit: usize) {
        if limit == 0 {
            // No history kept: nothing to copy.
            if let Some(last) = events.last() {
                self.complete_from = last.revision() + 1;
            }
            return;
        }
        for event in events {
            self.bytes += Self::cost(event);
            self.events.push_back(event.clone());
        }
        while self.bytes > limit {
            let Some(oldest) = self.events.pop_front() else {
                break;
            };
            self.bytes -= Self::cost(&oldest);
            // Events of one revision leave together: a revision is whole or absent.
            self.complete_from = oldest.revision() + 1;
            while self
                .events
                .front()
                .is_some_and(|e| e.revision() == oldest.revision())
            {
                let same = self.events.pop_front().expect("looked at");
                self.bytes -= Self::cost(&same);
            }
        }
    }

    /// The events of `topic` from revision `from` on, if every one of them is kept and
    /// they come to at most [`HISTORY_START_BYTES`].
    pub(super) fn since(&self, topic: &Topic, from: i64) -> Option<Vec<KeyEvent>> {
        if from < self.complete_from {
            return None;
        }
        let first = self.events.partition_point(|e| e.revision() < from);
        let mut bytes = 0;
        let mut since = Vec::new();
        for event in self.events.range(first..) {
            if topic.matches(&event.entry.name) {
                bytes += event_bytes(event);
                if bytes > HISTORY_START_BYTES {
                    return None;
                }
                since.push(event.clone());
            }
        }
        Some(since)
    }
}
