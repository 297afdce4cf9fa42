//! The timing rule, as plain arithmetic: how a grant's `valid_for_ms` becomes a
//! deadline, how deadlines combine, and how often to renew.
//!
//! Everything here is pure so the safety-critical part of the SDK can be tested with
//! paused time and no network.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// Renewals never go out closer together than this, so a proxy that grants (almost)
/// nothing is not flooded by its clients.
pub(crate) const MIN_RENEW_GAP: Duration = Duration::from_millis(50);

/// Where a session stands, as far as the application may act on it.
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::SessionState;
///
/// match session.state() {
///     SessionState::Valid => send_invoices().await,
///     // Stop acting; `valid` waits for it to come back (or fails: it expired).
///     SessionState::Jeopardy => session.valid().await?,
///     SessionState::Expired => eprintln!("session over: {:?}", session.expired_reason()),
/// }
/// # Ok(()) }
/// # async fn send_invoices() {}
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SessionState {
    /// Before the deadline: the application may act as holder of what it acquired.
    Valid,
    /// Past the deadline: the proxy may give the session's locks away at any moment, so
    /// the application must stop acting as holder. Renewals continue; a later reply can
    /// bring the session back to `Valid`.
    Jeopardy,
    /// The session is over. Terminal. The proxy said it is gone, or the application
    /// closed it (or called [`Client::shutdown`](crate::Client::shutdown)), or it stayed
    /// in jeopardy past the client's grace period
    /// ([`ClientOptions::grace`](crate::ClientOptions::grace)) with no proxy answering.
    Expired,
}

/// When a request went out: the instant, and the suspend generation then (see
/// [`lockcell_proto::suspend`]). A reply to a request sent before a suspend of the
/// machine grants nothing: its instant is earlier than the clock says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub(crate) at: Instant,
    pub(crate) generation: u64,
}

impl Stamp {
    pub(crate) fn now() -> Stamp {
        Stamp {
            generation: lockcell_proto::suspend::generation(),
            at: Instant::now(),
        }
    }
}

/// The deadline a grant gives: the instant the request was *sent* plus `valid_for`.
///
/// Measuring from the send (not the reply) is what makes the deadline end before the
/// proxy's own view of the session can: the proxy computed `valid_for` at some moment
/// after we sent, so counting from the send only ever shortens it.
pub(crate) fn deadline_from(sent: Instant, valid_for_ms: u64) -> Instant {
    sent.checked_add(Duration::from_millis(valid_for_ms))
        // Only reachable with absurd grants; a far deadline is still "later".
        .unwrap_or_else(|| sent + Duration::from_secs(86_400 * 365))
}

/// How long to wait after sending a renewal before sending the next one.
///
/// A third of the shorter of the session TTL and the last granted validity: two
/// renewals can be lost before the deadline is reached. Never below [`MIN_RENEW_GAP`].
pub(crate) fn renew_interval(ttl: Duration, last_valid_for: Duration) -> Duration {
    (ttl.min(last_valid_for) / 3).max(MIN_RENEW_GAP)
}

/// A session's current right to act: the deadline, and whether it has ended for good.
#[derive(Clone, Debug)]
pub(crate) struct Validity {
    /// Until when the application may act as holder (exclusive).
    pub(crate) deadline: Instant,
    /// The suspend generation the deadline was counted in
    /// ([`lockcell_proto::suspend::generation`]): after a suspend of the machine the
    /// deadline, an `Instant`, is late by the time it slept, and counts for nothing.
    pub(crate) generation: u64,
    /// Set once the session is gone; the text says why (from the proxy, or "closed").
    pub(crate) expired: Option<Arc<str>>,
    /// Set while where the session's keys are is unknown: no grant moves the deadline.
    pub(crate) unsettled: bool,
}

impl Validity {
    pub(crate) fn new(deadline: Instant, generation: u64) -> Self {
        Validity {
            deadline,
            generation,
            expired: None,
            unsettled: false,
        }
    }

    /// Applies a grant's deadline, counted from a request sent in suspend generation
    /// `generation` (the caller drops a grant whose request went out before a suspend).
    /// Deadlines only move forward: an older reply that arrives late (or a grant measured
    /// from a long-ago send, like a slow Acquire) must never shorten what a newer reply
    /// already granted; but a deadline of an earlier generation counts for nothing, and
    /// any of this one replaces it. Returns whether anything changed.
    pub(crate) fn extend(&mut self, candidate: Instant, generation: u64) -> bool {
        if self.expired.is_some() || self.unsettled {
            return false;
        }
        if generation == self.generation && candidate <= self.deadline {
            return false;
        }
        self.deadline = candidate;
        self.generation = generation;
        true
    }

    /// Ends the current deadline at `now` at the latest (see
    /// [`SessionShared::unsettle`](crate::shared::SessionShared::unsettle)); the next
    /// grant that counts sets a new one.
    pub(crate) fn suspend(&mut self, now: Instant) -> bool {
        let changed = !self.unsettled || self.deadline > now;
        self.unsettled = true;
        self.deadline = self.deadline.min(now);
        changed
    }

    /// Where the keys are is known again (a resume named them all): grants count.
    pub(crate) fn settle(&mut self) -> bool {
        std::mem::replace(&mut self.unsettled, false)
    }

    /// Marks the session gone. The first reason wins; returns whether anything changed.
    pub(crate) fn expire(&mut self, reason: Arc<str>) -> bool {
        if self.expired.is_some() {
            return false;
        }
        self.expired = Some(reason);
        true
    }

    /// Where the session stands at `now`, in suspend generation `generation`.
    pub(crate) fn state_at(&self, now: Instant, generation: u64) -> SessionState {
        if self.expired.is_some() {
            SessionState::Expired
        } else if now >= self.deadline || generation != self.generation {
            SessionState::Jeopardy
        } else {
            SessionState::Valid
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn deadline_counts_from_the_send() {
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(700)).await; // the reply took a while
        assert_eq!(
            deadline_from(sent, 5_000),
            sent + Duration::from_millis(5_000)
        );
        assert_eq!(deadline_from(sent, 0), sent);
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_only_moves_forward() {
        let t0 = Instant::now();
        let mut v = Validity::new(t0 + Duration::from_secs(10), 0);
        assert!(
            !v.extend(t0 + Duration::from_secs(4), 0),
            "a shorter grant must not shorten"
        );
        assert_eq!(v.deadline, t0 + Duration::from_secs(10));
        assert!(!v.extend(t0 + Duration::from_secs(10), 0));
        assert!(v.extend(t0 + Duration::from_secs(12), 0));
        assert_eq!(v.deadline, t0 + Duration::from_secs(12));
    }

    #[tokio::test(start_paused = true)]
    async fn a_suspend_ends_the_deadline_and_a_grant_after_it_starts_anew() {
        let t0 = Instant::now();
        let mut v = Validity::new(t0 + Duration::from_secs(10), 0);
        // The machine slept: the monotonic clock says 1 s passed, the deadline is junk.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(v.state_at(later, 1), SessionState::Jeopardy);
        // A grant of the new generation counts, even if shorter than the old deadline.
        assert!(v.extend(t0 + Duration::from_secs(4), 1));
        assert_eq!(v.state_at(later, 1), SessionState::Valid);
        assert!(
            !v.extend(t0 + Duration::from_secs(3), 1),
            "forward only again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn state_follows_the_clock_and_expiry_is_terminal() {
        let t0 = Instant::now();
        let mut v = Validity::new(t0 + Duration::from_secs(1), 0);
        assert_eq!(v.state_at(t0, 0), SessionState::Valid);
        assert_eq!(
            v.state_at(t0 + Duration::from_millis(999), 0),
            SessionState::Valid
        );
        assert_eq!(
            v.state_at(t0 + Duration::from_secs(1), 0),
            SessionState::Jeopardy
        );
        // A renewal brings a session in jeopardy back.
        assert!(v.extend(t0 + Duration::from_secs(3), 0));
        assert_eq!(
            v.state_at(t0 + Duration::from_secs(2), 0),
            SessionState::Valid
        );
        assert!(v.expire("gone".into()));
        assert!(!v.expire("again".into()), "first reason wins");
        assert_eq!(v.expired.as_deref(), Some("gone"));
        assert!(
            !v.extend(t0 + Duration::from_secs(30), 0),
            "no grant revives an expired session"
        );
        assert_eq!(v.state_at(t0, 0), SessionState::Expired);
    }

    #[test]
    fn renewal_interval_is_a_third_of_the_shorter_of_ttl_and_validity() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(renew_interval(s(12), s(12)), s(4));
        assert_eq!(renew_interval(s(12), s(3)), s(1));
        assert_eq!(renew_interval(s(3), s(12)), s(1));
        // A proxy granting nothing (partitioned) gets retried quickly, but not flooded.
        assert_eq!(renew_interval(s(12), ms(0)), MIN_RENEW_GAP);
        assert_eq!(renew_interval(ms(90), ms(90)), MIN_RENEW_GAP);
        assert_eq!(renew_interval(ms(300), ms(600)), ms(100));
    }
}
