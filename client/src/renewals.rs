//! The keep-alive multiplexer's bookkeeping, without I/O: when each session's next
//! renewal is due, and which renewals are in flight (so a reply can be paired with the
//! instant its request was sent, and a stream that stopped answering can be noticed).
//!
//! The driver in [`crate::keepalive`] carries out what this decides.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// A renewal unanswered for longer than this (or than its session's renewal interval,
/// whichever is longer) means the stream is stuck: it is dropped and reopened.
pub(crate) const MIN_STALL: Duration = Duration::from_secs(2);

/// One renewal sent and not yet answered.
#[derive(Debug)]
struct InFlight {
    session: String,
    seq: u64,
    /// The instant the request was handed to the stream: the start of what it grants.
    sent: Instant,
    /// If still unanswered then, the stream is considered stuck.
    stall_at: Instant,
}

/// Renewal schedule and in-flight renewals for all sessions of one client.
#[derive(Debug, Default)]
pub(crate) struct Renewals {
    /// Due times, earliest first. Entries whose generation no longer matches `due` are
    /// stale (rescheduled or dropped) and skipped.
    heap: BinaryHeap<Reverse<(Instant, u64, String)>>,
    /// The current due time and generation of each scheduled session.
    due: HashMap<String, (Instant, u64)>,
    /// Generation counter that tells current heap entries from stale ones.
    generation: u64,
    /// Renewals sent on the current stream, oldest first. The proxy answers in order.
    in_flight: VecDeque<InFlight>,
}

impl Renewals {
    /// Sets (or replaces) when `session`'s next renewal is due.
    pub(crate) fn schedule(&mut self, session: &str, at: Instant) {
        self.generation += 1;
        self.due.insert(session.to_owned(), (at, self.generation));
        self.heap
            .push(Reverse((at, self.generation, session.to_owned())));
    }

    /// Moves `session`'s next renewal earlier if it is scheduled later than `at`. Used
    /// when a reply grants less than before: the renewal should not wait for the
    /// interval computed from the older, longer grant.
    pub(crate) fn schedule_no_later(&mut self, session: &str, at: Instant) {
        if matches!(self.due.get(session), Some(&(current, _)) if current > at) {
            self.schedule(session, at);
        }
    }

    /// Takes every session whose renewal is due at `now`. They are unscheduled until
    /// the caller schedules them again (a session that is gone simply is not).
    pub(crate) fn take_due(&mut self, now: Instant) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Reverse((at, _, _))) = self.heap.peek() {
            if *at > now {
                break;
            }
            let Reverse((_, generation, session)) = self.heap.pop().expect("peeked");
            if self
                .due
                .get(&session)
                .is_some_and(|&(_, g)| g == generation)
            {
                self.due.remove(&session);
                out.push(session);
            }
        }
        out
    }

    /// Records a renewal handed to the stream.
    pub(crate) fn sent(&mut self, session: &str, seq: u64, sent: Instant, interval: Duration) {
        self.in_flight.push_back(InFlight {
            session: session.to_owned(),
            seq,
            sent,
            stall_at: sent + interval.max(MIN_STALL),
        });
    }

    /// Pairs a reply with its request and returns when that request was sent, or `None`
    /// for a reply that matches nothing in flight (which must not grant anything, since
    /// its start is unknown). Requests older than the matched one were skipped by the
    /// proxy and are forgotten.
    pub(crate) fn answered(&mut self, session: &str, seq: u64) -> Option<Instant> {
        let pos = self
            .in_flight
            .iter()
            .position(|r| r.seq == seq && r.session == session)?;
        self.in_flight.drain(..pos);
        self.in_flight.pop_front().map(|r| r.sent)
    }

    /// Whether the oldest renewal in flight has waited too long for its reply.
    pub(crate) fn stalled(&self, now: Instant) -> bool {
        self.in_flight.front().is_some_and(|r| r.stall_at <= now)
    }

    /// Forgets everything in flight: the stream they were sent on is gone, and no reply
    /// to them can arrive on a new one.
    pub(crate) fn stream_lost(&mut self) -> usize {
        let lost = self.in_flight.len();
        self.in_flight.clear();
        lost
    }

    /// When the driver must next wake up: the earliest due renewal (only if it can send
    /// right now) or the moment the oldest in-flight renewal counts as stalled.
    pub(crate) fn next_wakeup(&mut self, can_send: bool) -> Option<Instant> {
        let stall = self.in_flight.front().map(|r| r.stall_at);
        let due = if can_send { self.next_due() } else { None };
        match (due, stall) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn next_due(&mut self) -> Option<Instant> {
        // Drop stale entries from the top so the answer is a real due time.
        while let Some(Reverse((at, generation, session))) = self.heap.peek() {
            if self
                .due
                .get(session)
                .is_some_and(|&(_, g)| g == *generation)
            {
                return Some(*at);
            }
            self.heap.pop();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn schedule_hands_out_due_sessions_in_order() {
        let t0 = Instant::now();
        let mut r = Renewals::default();
        r.schedule("b", t0 + ms(200));
        r.schedule("a", t0 + ms(100));
        r.schedule("c", t0 + ms(300));
        assert_eq!(r.next_wakeup(true), Some(t0 + ms(100)));
        assert_eq!(
            r.next_wakeup(false),
            None,
            "nothing to wait for without a stream"
        );
        assert!(r.take_due(t0 + ms(99)).is_empty());
        assert_eq!(
            r.take_due(t0 + ms(250)),
            vec!["a".to_owned(), "b".to_owned()]
        );
        assert_eq!(r.next_wakeup(true), Some(t0 + ms(300)));
        // Taken sessions are unscheduled until scheduled again.
        assert!(r.take_due(t0 + ms(250)).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn rescheduling_replaces_the_old_due_time() {
        let t0 = Instant::now();
        let mut r = Renewals::default();
        r.schedule("a", t0 + ms(100));
        r.schedule("a", t0 + ms(500));
        assert_eq!(r.next_wakeup(true), Some(t0 + ms(500)));
        assert!(r.take_due(t0 + ms(400)).is_empty());
        r.schedule_no_later("a", t0 + ms(700));
        assert_eq!(r.next_wakeup(true), Some(t0 + ms(500)), "never later");
        r.schedule_no_later("a", t0 + ms(200));
        assert_eq!(r.next_wakeup(true), Some(t0 + ms(200)));
        assert_eq!(r.take_due(t0 + ms(200)), vec!["a".to_owned()]);
        assert!(
            r.take_due(t0 + ms(900)).is_empty(),
            "the stale entry is skipped"
        );
        r.schedule_no_later("a", t0 + ms(100));
        assert_eq!(
            r.next_wakeup(true),
            None,
            "an unscheduled session stays unscheduled"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn replies_pair_with_the_send_instant() {
        let t0 = Instant::now();
        let mut r = Renewals::default();
        r.sent("a", 1, t0, ms(4000));
        r.sent("b", 1, t0 + ms(10), ms(4000));
        r.sent("a", 2, t0 + ms(20), ms(4000));
        assert_eq!(r.answered("a", 1), Some(t0));
        assert_eq!(r.answered("a", 1), None, "answered once");
        assert_eq!(r.answered("zzz", 1), None);
        // The proxy skipped b/1: answering a/2 forgets it.
        assert_eq!(r.answered("a", 2), Some(t0 + ms(20)));
        assert_eq!(r.answered("b", 1), None);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unanswered_renewal_marks_the_stream_stalled() {
        let t0 = Instant::now();
        let mut r = Renewals::default();
        r.sent("a", 1, t0, ms(100));
        // Short intervals still get MIN_STALL before the stream is blamed.
        assert_eq!(r.next_wakeup(false), Some(t0 + MIN_STALL));
        assert!(!r.stalled(t0 + MIN_STALL - ms(1)));
        assert!(r.stalled(t0 + MIN_STALL));
        r.sent("b", 1, t0, ms(5000));
        assert_eq!(r.stream_lost(), 2);
        assert!(!r.stalled(t0 + ms(10_000)));
        assert_eq!(r.answered("a", 1), None, "no reply pairs across streams");
    }
}
