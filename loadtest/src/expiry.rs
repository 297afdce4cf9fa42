//! Judging a session the target declared gone, from what its client knows.
//!
//! A client counts its session's TTL from the moment it sent the latest renewal the
//! target answered alive (or its open). When a renewal meets "gone", it either left
//! within that TTL — the target expired a session it still owed its life: a false
//! expiry — or after it, when the client (the load generator) renewed it late, which is
//! its own lateness and never the target's.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Which side an expiry is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The renewal that met "gone" was sent in time: the target's fault.
    False,
    /// It was sent a TTL or more after the session was last known alive: the client's.
    Late,
    /// The run ended with renewals sent in time still unanswered, a TTL or more after
    /// the session was last known alive: its client could no longer count on it.
    Unanswered,
}

/// A session the target declared gone, with what its client knows: times are offsets
/// from a common origin (when the fleet started opening).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiry {
    /// The session's index in the fleet.
    pub session: usize,
    pub verdict: Verdict,
    /// When its open was sent.
    pub opened: Duration,
    /// When the latest renewal answered alive was sent (the open, if none was).
    pub alive_since: Duration,
    /// When the renewal answered "gone" was sent, and when that answer came (for
    /// [`Verdict::Unanswered`]: the oldest renewal unanswered, and the run's end).
    pub sent: Duration,
    pub answered: Duration,
    /// The latest renewals' send times, oldest first (the one that met "gone" last).
    pub renewals: Vec<Duration>,
    /// The target's answer: its state and reason.
    pub answer: String,
}

impl Expiry {
    /// One line for a person: when the session opened, was last known alive and was
    /// renewed, and what the target said.
    pub fn line(&self) -> String {
        let s = |d: Duration| format!("{:.6}", d.as_secs_f64());
        let renewals: Vec<String> = self.renewals.iter().map(|d| s(*d)).collect();
        format!(
            "session {}: opened at {} s, alive since {} s, renewal sent at {} s ({} s later), \
             answered at {} s: {}; recent renewals sent at [{}]",
            self.session,
            s(self.opened),
            s(self.alive_since),
            s(self.sent),
            s(self.sent.saturating_sub(self.alive_since)),
            s(self.answered),
            self.answer,
            renewals.join(", "),
        )
    }
}

/// Send times kept per session for an expiry's evidence.
const RECENT: usize = 6;

/// What the client of one session knows of it.
#[derive(Debug)]
pub struct Track {
    opened: Instant,
    /// When the latest renewal answered alive (or the open) was sent.
    alive_since: Instant,
    /// Renewals sent and not answered yet, oldest first, each with its sequence number
    /// when the target echoes one.
    in_flight: VecDeque<(Option<u64>, Instant)>,
    /// The latest renewals' send times, for an expiry's evidence.
    recent: VecDeque<Instant>,
    /// The target declared the session gone: it is renewed no more.
    gone: bool,
}

impl Track {
    /// A session whose open was sent at `opened`.
    pub fn new(opened: Instant) -> Self {
        Track {
            opened,
            alive_since: opened,
            in_flight: VecDeque::new(),
            recent: VecDeque::with_capacity(RECENT),
            gone: false,
        }
    }

    /// Whether the target declared the session gone.
    pub fn is_gone(&self) -> bool {
        self.gone
    }

    /// A renewal left at `at`, numbered `seq` when the target echoes it.
    pub fn sent(&mut self, seq: Option<u64>, at: Instant) {
        self.in_flight.push_back((seq, at));
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(at);
    }

    /// Renewals sent and not answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The answer to renewal `seq` (None: the oldest in flight, for a target that answers
    /// each renewal in order without echoing a number) came at `now`: alive (`gone` is
    /// `None`) or gone, with the target's words. Older renewals that the answer passed
    /// over were never answered and are dropped. Returns the answered renewal's send
    /// time (None for an answer to nothing sent), and the expiry, judged, the first time
    /// the session is declared gone.
    pub fn answered(
        &mut self,
        seq: Option<u64>,
        now: Instant,
        gone: Option<String>,
        ttl: Duration,
        origin: Instant,
        session: usize,
    ) -> (Option<Instant>, Option<Expiry>) {
        let sent = match seq {
            None => self.in_flight.pop_front().map(|(_, at)| at),
            Some(seq) => {
                while self
                    .in_flight
                    .front()
                    .is_some_and(|(s, _)| s.is_some_and(|s| s < seq))
                {
                    self.in_flight.pop_front();
                }
                match self.in_flight.front() {
                    Some((Some(s), at)) if *s == seq => {
                        let at = *at;
                        self.in_flight.pop_front();
                        Some(at)
                    }
                    _ => None,
                }
            }
        };
        let Some(sent) = sent else {
            return (None, None);
        };
        let answer = match gone {
            None => {
                self.alive_since = self.alive_since.max(sent);
                return (Some(sent), None);
            }
            Some(_) if self.gone => return (Some(sent), None),
            Some(answer) => answer,
        };
        self.gone = true;
        let at = |t: Instant| t.saturating_duration_since(origin);
        let expiry = Expiry {
            session,
            verdict: if sent < self.alive_since + ttl {
                Verdict::False
            } else {
                Verdict::Late
            },
            opened: at(self.opened),
            alive_since: at(self.alive_since),
            sent: at(sent),
            answered: at(now),
            renewals: self.recent.iter().map(|t| at(*t)).collect(),
            answer,
        };
        (Some(sent), Some(expiry))
    }

    /// Judges the session when the run ends at `end`: [`Verdict::Unanswered`] when it
    /// is not declared gone, was last known alive a TTL or more before `end`, and has a
    /// renewal in flight that was sent in time. (A session whose renewals the generator
    /// could not send at all, its stream being stalled, has none in flight and is not
    /// judged here; `renewals_not_sent` counts them.)
    pub fn at_end(
        &self,
        end: Instant,
        ttl: Duration,
        origin: Instant,
        session: usize,
    ) -> Option<Expiry> {
        if self.gone || self.alive_since + ttl > end {
            return None;
        }
        let (_, oldest) = *self
            .in_flight
            .iter()
            .find(|(_, at)| *at < self.alive_since + ttl)?;
        let at = |t: Instant| t.saturating_duration_since(origin);
        Some(Expiry {
            session,
            verdict: Verdict::Unanswered,
            opened: at(self.opened),
            alive_since: at(self.alive_since),
            sent: at(oldest),
            answered: at(end),
            renewals: self.recent.iter().map(|t| at(*t)).collect(),
            answer: format!(
                "no answer by the end of the run to {} renewal(s)",
                self.in_flight.len()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(4);
    const S: Duration = Duration::from_secs(1);

    fn gone() -> Option<String> {
        Some("SESSION_STATE_EXPIRED: no renewal arrived within its TTL".into())
    }

    #[test]
    fn a_renewal_sent_within_a_ttl_of_the_last_alive_one_makes_a_false_expiry() {
        let t0 = Instant::now();
        let mut track = Track::new(t0);
        track.sent(None, t0 + S);
        track.sent(None, t0 + 4 * S);
        assert_eq!(
            track
                .answered(None, t0 + S, None, TTL, t0, 7)
                .1
                .map(|e| e.verdict),
            None
        );
        // 3 s after the last renewal answered alive: the target owed it its life.
        let (sent, expiry) = track.answered(None, t0 + 4 * S, gone(), TTL, t0, 7);
        assert_eq!(sent, Some(t0 + 4 * S));
        let expiry = expiry.expect("judged");
        assert_eq!(expiry.verdict, Verdict::False);
        assert_eq!(expiry.session, 7);
        assert_eq!(expiry.alive_since, S);
        assert_eq!(expiry.renewals, vec![S, 4 * S]);
        assert!(
            expiry.line().contains("no renewal arrived"),
            "{}",
            expiry.line()
        );
        assert!(track.is_gone());
    }

    #[test]
    fn a_first_renewal_a_ttl_after_the_open_is_the_clients_lateness() {
        // What the old pacing did: the session waited for the whole fleet to open.
        let t0 = Instant::now();
        let mut track = Track::new(t0);
        track.sent(None, t0 + TTL + Duration::from_millis(47));
        let expiry = track
            .answered(None, t0 + 5 * S, gone(), TTL, t0, 0)
            .1
            .unwrap();
        assert_eq!(expiry.verdict, Verdict::Late);
        assert_eq!(expiry.opened, Duration::ZERO);
    }

    #[test]
    fn the_ttl_runs_from_the_send_of_the_renewal_answered_alive_not_its_answer() {
        let t0 = Instant::now();
        let mut track = Track::new(t0);
        track.sent(None, t0 + S);
        // Answered late, at 2 s: the client still counts from 1 s.
        track.answered(None, t0 + 2 * S, None, TTL, t0, 0);
        track.sent(None, t0 + 5 * S + Duration::from_millis(500));
        let expiry = track
            .answered(None, t0 + 6 * S, gone(), TTL, t0, 0)
            .1
            .unwrap();
        assert_eq!(expiry.verdict, Verdict::Late);
    }

    #[test]
    fn only_the_first_gone_answer_is_judged() {
        let t0 = Instant::now();
        let mut track = Track::new(t0);
        track.sent(None, t0 + S);
        track.sent(None, t0 + 2 * S);
        assert!(track.answered(None, t0 + S, gone(), TTL, t0, 0).1.is_some());
        let (sent, again) = track.answered(None, t0 + 2 * S, gone(), TTL, t0, 0);
        assert_eq!(sent, Some(t0 + 2 * S));
        assert!(again.is_none());
        assert_eq!(
            track.answered(None, t0 + 3 * S, None, TTL, t0, 0),
            (None, None)
        );
    }

    #[test]
    fn an_echoed_number_pairs_the_answer_with_its_renewal_past_unanswered_ones() {
        let t0 = Instant::now();
        let mut track = Track::new(t0);
        track.sent(Some(1), t0 + S);
        track.sent(Some(2), t0 + 2 * S);
        track.sent(Some(3), t0 + 3 * S);
        // Renewal 1 was never answered; 2's answer must not be taken for 1's.
        let (sent, _) = track.answered(Some(2), t0 + 2 * S, None, TTL, t0, 0);
        assert_eq!(sent, Some(t0 + 2 * S));
        assert_eq!(track.in_flight(), 1);
        // An answer to a number not in flight is an answer to nothing.
        assert_eq!(
            track.answered(Some(9), t0 + 3 * S, None, TTL, t0, 0),
            (None, None)
        );
        assert_eq!(track.in_flight(), 0);
    }

    #[test]
    fn renewals_in_time_left_unanswered_for_a_ttl_are_judged_at_the_end() {
        let t0 = Instant::now();
        let mut track = Track::new(t0);
        track.sent(Some(1), t0 + S);
        track.answered(Some(1), t0 + S, None, TTL, t0, 3);
        track.sent(Some(2), t0 + 2 * S);
        // Within a TTL of the last answer: nothing to say yet.
        assert!(track.at_end(t0 + 4 * S, TTL, t0, 3).is_none());
        let expiry = track.at_end(t0 + 6 * S, TTL, t0, 3).expect("judged");
        assert_eq!(expiry.verdict, Verdict::Unanswered);
        assert_eq!(expiry.sent, 2 * S);
        // Declared gone already: judged then, not again.
        track.answered(Some(2), t0 + 6 * S, gone(), TTL, t0, 3);
        assert!(track.at_end(t0 + 7 * S, TTL, t0, 3).is_none());
    }
}
