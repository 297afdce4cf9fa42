//! A session's life on this proxy, as time passes (docs/design.md §4): its renewals,
//! the validity granted to its client, an operator's end, a hand-over to another proxy.
//!
//! The rules:
//! - a session lapses a TTL after its last renewal (or its arrival here), and no
//!   validity is granted past that;
//! - it expires when it lapses, but never before the latest validity granted to its
//!   client has run out: until then its client may still act on its locks, so its keys
//!   must stay;
//! - an ended session (an operator's `force-release`) is renewed no more and expires
//!   as soon as the validity granted to it has run out, with the operator's reason;
//! - a session handed over to another proxy is renewed here no more (and no validity
//!   is granted after): it leaves when the other proxy takes it, or expires here;
//! - an expired session is renewed no more: the renewal is told why it is over.
//!
//! Time is an argument: nothing here reads a clock.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// Why a session expired when no one ended it.
pub const NOT_RENEWED: &str = "no renewal arrived within its TTL";

/// Why a renewal was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// Handed over to another proxy: renewed here no more.
    HandedOff,
    /// Over, for the reason given.
    Over(Arc<str>),
}

/// One session's life here.
#[derive(Debug, Clone)]
pub struct Life {
    pub ttl: Duration,
    /// When the last renewal (or the arrival here) was.
    renewed_at: Instant,
    /// The end of the latest validity granted to the client (this proxy's clock). The
    /// client's own deadline ends no later, so once this has passed the session's keys
    /// may be deleted without any client still believing it holds them.
    valid_until: Instant,
    /// Set when an operator ended the session.
    ended: Option<Arc<str>>,
    /// Set while the session takes no calls here: a draining proxy handed it over, or
    /// (etcd API) a lease's stay is arriving by take-over and its keys are not here yet.
    /// Cleared when a hand-over is taken back, or the keys have arrived.
    handed_off: bool,
}

impl Life {
    /// A life starting at `now` with `ttl`, its client allowed to act until
    /// `valid_until` (a session resumed here keeps what it was granted before).
    pub fn new(ttl: Duration, now: Instant, valid_until: Instant) -> Life {
        Life {
            ttl,
            renewed_at: now,
            valid_until,
            ended: None,
            handed_off: false,
        }
    }

    /// The same life, as if last renewed so that it lapses `left` after `now` (a session
    /// handed over keeps what its TTL had left).
    pub fn lapsing_in(mut self, now: Instant, left: Duration) -> Life {
        self.renewed_at = now
            .checked_sub(self.ttl.saturating_sub(left))
            .unwrap_or(now);
        self
    }

    /// A TTL after the last renewal: no validity may be granted past it.
    pub fn lapses_at(&self) -> Instant {
        self.renewed_at + self.ttl
    }

    /// When the session expires: when it lapses, but never before the latest validity
    /// granted to its client has run out (an ended session: as soon as that has). Grants
    /// are capped at the lapse time, so the second rule only guards against a grant
    /// that was not: without it a session could expire, and its locks pass on, while
    /// its client still believes it holds them.
    pub fn expires_at(&self) -> Instant {
        if self.ended.is_some() {
            return self.valid_until;
        }
        self.lapses_at().max(self.valid_until)
    }

    /// Why the session is over at `now`, if it is: ended by an operator, or no renewal
    /// in time.
    pub fn over(&self, now: Instant) -> Option<Arc<str>> {
        match &self.ended {
            Some(reason) => Some(reason.clone()),
            None if self.expires_at() <= now => Some(NOT_RENEWED.into()),
            None => None,
        }
    }

    /// Why the session expired, once it has.
    pub fn expiry_reason(&self) -> Arc<str> {
        self.ended.clone().unwrap_or_else(|| NOT_RENEWED.into())
    }

    /// A renewal at `now`: the validity `valid_for` gives its client from now on (it
    /// never shortens what was granted before), or why it is refused.
    pub fn renew(
        &mut self,
        now: Instant,
        valid_for: impl FnOnce() -> Duration,
    ) -> Result<Duration, Refused> {
        if self.handed_off {
            return Err(Refused::HandedOff);
        }
        if let Some(reason) = self.over(now) {
            return Err(Refused::Over(reason));
        }
        self.renewed_at = now;
        let valid_for = valid_for();
        self.granted(now + valid_for);
        Ok(valid_for)
    }

    /// A validity until `until` was granted to the client (with a lock, say).
    pub fn granted(&mut self, until: Instant) {
        self.valid_until = self.valid_until.max(until);
    }

    /// The end of the latest validity granted to the client.
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// An operator ends the session; ending it again keeps the first reason.
    pub fn end(&mut self, reason: Arc<str>) {
        self.ended.get_or_insert(reason);
    }

    /// The operator's reason, if one ended the session.
    pub fn ended(&self) -> Option<&Arc<str>> {
        self.ended.as_ref()
    }

    /// Hands the session over; false when it was already, or has ended.
    pub fn hand_off(&mut self) -> bool {
        if self.handed_off || self.ended.is_some() {
            return false;
        }
        self.handed_off = true;
        true
    }

    /// Takes a hand-over back, or ends an arrival: renewed here again.
    pub fn keep(&mut self) {
        self.handed_off = false;
    }

    pub fn is_handed_off(&self) -> bool {
        self.handed_off
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn life(now: Instant) -> Life {
        Life::new(3 * S, now, now)
    }

    #[test]
    fn a_session_lapses_a_ttl_after_its_last_renewal() {
        let t0 = Instant::now();
        let mut l = life(t0);
        assert_eq!(l.expires_at(), t0 + 3 * S);
        assert_eq!(l.renew(t0 + 2 * S, || 2 * S), Ok(2 * S));
        assert_eq!(l.lapses_at(), t0 + 5 * S);
        assert_eq!(l.over(t0 + 4 * S), None);
        assert_eq!(l.over(t0 + 5 * S).as_deref(), Some(NOT_RENEWED));
        assert_eq!(
            l.renew(t0 + 6 * S, || S),
            Err(Refused::Over(NOT_RENEWED.into())),
            "an expired session is renewed no more"
        );
    }

    #[test]
    fn a_validity_granted_past_the_lapse_keeps_the_session_until_it_runs_out() {
        let t0 = Instant::now();
        let mut l = life(t0);
        l.granted(t0 + 10 * S);
        assert_eq!(l.expires_at(), t0 + 10 * S);
        assert_eq!(l.over(t0 + 9 * S), None);
        // A shorter one later never shortens it.
        l.granted(t0 + 4 * S);
        assert_eq!(l.valid_until(), t0 + 10 * S);
        assert_eq!(l.renew(t0 + S, || S), Ok(S));
        assert_eq!(l.valid_until(), t0 + 10 * S);
    }

    #[test]
    fn an_ended_session_goes_once_its_validity_runs_out_with_the_first_reason() {
        let t0 = Instant::now();
        let mut l = life(t0);
        l.renew(t0, || 2 * S).unwrap();
        l.end("force-release by ops".into());
        l.end("again".into());
        assert_eq!(l.expires_at(), t0 + 2 * S, "not its lapse: its validity");
        assert_eq!(
            l.renew(t0 + S, || S),
            Err(Refused::Over("force-release by ops".into()))
        );
        assert_eq!(&*l.expiry_reason(), "force-release by ops");
        assert!(!l.hand_off(), "an ended session is not handed over");
    }

    #[test]
    fn a_session_handed_over_is_renewed_here_no_more_until_taken_back() {
        let t0 = Instant::now();
        let mut l = life(t0);
        assert!(l.hand_off());
        assert!(!l.hand_off(), "once");
        assert_eq!(l.renew(t0 + S, || S), Err(Refused::HandedOff));
        assert_eq!(l.lapses_at(), t0 + 3 * S);
        l.keep();
        assert_eq!(l.renew(t0 + S, || S), Ok(S));
    }

    #[test]
    fn a_session_handed_over_keeps_what_its_ttl_had_left() {
        let t0 = Instant::now() + 10 * S;
        let l = life(t0).lapsing_in(t0, S);
        assert_eq!(l.lapses_at(), t0 + S);
    }

    #[derive(Debug, Clone)]
    enum Event {
        Renew(u64),
        Grant(u64),
        End,
        HandOff,
        Keep,
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            (0u64..5000).prop_map(Event::Renew),
            (0u64..8000).prop_map(Event::Grant),
            Just(Event::End),
            Just(Event::HandOff),
            Just(Event::Keep),
        ]
    }

    proptest! {
        /// Whatever happens, at whatever times: the session never expires before a
        /// validity granted to its client has run out, a renewal never succeeds once
        /// it is over or handed off, and once over it stays over.
        #[test]
        fn no_expiry_while_a_client_may_act_and_no_renewal_once_over(
            steps in proptest::collection::vec((0u64..2000, event()), 1..40)
        ) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut l = life(t0);
            let mut latest_validity = t0;
            let mut was_over = false;
            for (advance, e) in steps {
                now += Duration::from_millis(advance);
                let over = l.over(now).is_some();
                prop_assert!(!was_over || over, "an expired session came back");
                was_over = over;
                match e {
                    Event::Renew(ms) => {
                        let handed = l.is_handed_off();
                        match l.renew(now, || Duration::from_millis(ms)) {
                            Ok(v) => {
                                prop_assert!(!over && !handed);
                                latest_validity = latest_validity.max(now + v);
                            }
                            Err(_) => prop_assert!(over || handed),
                        }
                    }
                    Event::Grant(ms) => {
                        if !over {
                            let until = now + Duration::from_millis(ms);
                            l.granted(until);
                            latest_validity = latest_validity.max(until);
                        }
                    }
                    Event::End => l.end("ended".into()),
                    Event::HandOff => { l.hand_off(); }
                    Event::Keep => l.keep(),
                }
                prop_assert!(l.expires_at() >= latest_validity);
            }
        }
    }
}
