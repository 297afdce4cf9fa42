//! An acquire waiting in the proxy's queue (arbitrated classes, docs/design.md §5): when
//! it tries for the grant, when it waits for its turn, when it reads before trying
//! again, and when it gives up.
//!
//! The rules:
//! - the first attempt needs no turn; after an attempt that found the lock held, the
//!   waiter waits for its turn in the queue and reads whether the lock is free before
//!   it tries again (a read is not a proposal through etcd's log);
//! - an attempt that failed midway (etcd slow, no answer) may have been applied, so the
//!   lock may be the session's own: the waiter then never reads (a read would see its
//!   own hold and wait on it forever) and only another attempt tells; if its wait runs
//!   out meanwhile, it makes that attempt once more before it gives up;
//! - a call that already holds its grant (a retry, or an attempt whose reply was lost)
//!   gets it back at the start of each later round;
//! - a transient etcd failure is ridden out until the wait runs out, and is then the
//!   call's error; any other error ends the call at once.
//!
//! [`Waiter`] holds only these decisions. Its driver (`acquire::arbitrated`) refreshes
//! the session, asks etcd, waits for the queue and the clock, and feeds each result
//! back; at most one [`Step::Done`] with a grant comes out, and only after a reply that
//! said granted.

use super::Fault;

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<G, E> {
    /// Look the session up again (it may have ended meanwhile: that ends the call) and,
    /// if `own_hold`, whether it already holds this call's grant; then
    /// [`Waiter::refreshed`].
    Refresh { own_hold: bool },
    /// Wait for this waiter's turn in the queue, as long as the session and the call's
    /// wait allow; then [`Waiter::turned`], or [`Waiter::out_of_time`] if no time is left.
    WaitForTurn,
    /// Read whether a holder stands in the way; then [`Waiter::held`].
    ReadHeld,
    /// Hold back while the lock's lock-delay runs, then try; [`Waiter::delay`].
    CheckDelay,
    /// Try the grant transaction; then [`Waiter::granted`].
    TryGrant,
    /// The wait ran out after an attempt whose outcome is unknown: try once more, to
    /// find the grant if it was made; then [`Waiter::settled`].
    Settle,
    /// The call is over.
    Done(Outcome<G, E>),
}

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<G, E> {
    Granted(G),
    /// The wait ran out without a grant.
    TimedOut,
    Failed(E),
}

/// One waiting acquire's state between steps.
#[derive(Debug)]
pub struct Waiter<E> {
    /// An attempt was made (or its outcome is unknown): later ones wait for a turn.
    tried: bool,
    /// The last attempt failed midway: the lock may be the session's own.
    unsettled: bool,
    /// The last etcd failure ridden out, said if the wait runs out.
    trouble: Option<E>,
}

impl<E> Default for Waiter<E> {
    fn default() -> Self {
        Waiter {
            tried: false,
            unsettled: false,
            trouble: None,
        }
    }
}

impl<E> Waiter<E> {
    /// The first round, with the session the call was checked against; `may_try`:
    /// whether the queue lets this waiter try now.
    pub fn start<G>(&mut self, may_try: bool) -> Step<G, E> {
        self.wait_or_try(may_try)
    }

    /// The session is still there; `own` is what the check of its own hold found
    /// (`None` when not asked); `may_try` as for [`Self::start`].
    pub fn refreshed<G>(
        &mut self,
        own: Option<Result<Option<G>, Fault<E>>>,
        may_try: bool,
    ) -> Step<G, E> {
        match own {
            Some(Ok(Some(granted))) => return Step::Done(Outcome::Granted(granted)),
            Some(Ok(None)) | None => {}
            Some(Err(fault)) => {
                if let Some(done) = self.ride_out(fault) {
                    return done;
                }
                // Its outcome is unknown: a later attempt tells.
                self.unsettled = true;
                self.tried = true;
            }
        }
        self.wait_or_try(may_try)
    }

    /// The wait for a turn ended; `may_try`: whether the queue lets this waiter try now.
    pub fn turned<G>(&mut self, may_try: bool) -> Step<G, E> {
        if !may_try {
            return self.next_round();
        }
        // Heads on other proxies were woken by the same release: a read (not a
        // proposal) tells whether one of them already has it. Not after an attempt
        // whose outcome is unknown: the read would see this session's own hold.
        if self.tried && !self.unsettled {
            return Step::ReadHeld;
        }
        Step::CheckDelay
    }

    /// What the read found: whether a holder stands in the way.
    pub fn held<G>(&mut self, held: Result<bool, Fault<E>>) -> Step<G, E> {
        match held {
            Ok(true) => {
                self.trouble = None;
                self.next_round()
            }
            Ok(false) => {
                self.trouble = None;
                Step::CheckDelay
            }
            Err(fault) => match self.ride_out(fault) {
                Some(done) => done,
                None => self.next_round(),
            },
        }
    }

    /// The lock-delay check: `None` when no delay held the lock back; `Some(true)` when
    /// one did and ran out within the call's wait, `Some(false)` when the wait ran out
    /// first.
    pub fn delay<G>(&mut self, delayed: Option<bool>) -> Step<G, E> {
        match delayed {
            None => Step::TryGrant,
            Some(true) => self.next_round(),
            Some(false) => Step::Done(Outcome::TimedOut),
        }
    }

    /// What the grant attempt found: the grant, or `None` when a holder was in the way.
    pub fn granted<G>(&mut self, reply: Result<Option<G>, Fault<E>>) -> Step<G, E> {
        match reply {
            Ok(Some(granted)) => return Step::Done(Outcome::Granted(granted)),
            Ok(None) => {
                self.trouble = None;
                self.unsettled = false;
            }
            Err(fault) => {
                if let Some(done) = self.ride_out(fault) {
                    return done;
                }
                self.unsettled = true;
            }
        }
        self.tried = true;
        self.next_round()
    }

    /// No time is left to wait for a turn.
    pub fn out_of_time<G>(&mut self) -> Step<G, E> {
        if self.unsettled {
            return Step::Settle;
        }
        match self.trouble.take() {
            Some(e) => Step::Done(Outcome::Failed(e)),
            None => Step::Done(Outcome::TimedOut),
        }
    }

    /// What the last attempt (after the wait ran out) found. Any error ends the call.
    pub fn settled<G>(&mut self, reply: Result<Option<G>, E>) -> Step<G, E> {
        Step::Done(match reply {
            Ok(Some(granted)) => Outcome::Granted(granted),
            Ok(None) => Outcome::TimedOut,
            Err(e) => Outcome::Failed(e),
        })
    }

    /// After a failed attempt, or when the queue says not yet: wait for a turn.
    fn wait_or_try<G>(&mut self, may_try: bool) -> Step<G, E> {
        if self.tried || !may_try {
            Step::WaitForTurn
        } else {
            Step::CheckDelay
        }
    }

    fn next_round<G>(&self) -> Step<G, E> {
        Step::Refresh {
            own_hold: !self.unsettled,
        }
    }

    /// Keeps a transient failure to say if the wait runs out; a fatal one ends the call.
    fn ride_out<G>(&mut self, fault: Fault<E>) -> Option<Step<G, E>> {
        match fault {
            Fault::Transient(e) => {
                self.trouble = Some(e);
                None
            }
            Fault::Fatal(e) => Some(Step::Done(Outcome::Failed(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    type W = Waiter<&'static str>;
    type S = Step<u32, &'static str>;

    #[test]
    fn the_first_attempt_needs_no_turn_and_a_grant_ends_the_wait() {
        let mut w = W::default();
        assert_eq!(w.start::<u32>(true), S::CheckDelay);
        assert_eq!(w.delay::<u32>(None), S::TryGrant);
        assert_eq!(w.granted(Ok(Some(7))), S::Done(Outcome::Granted(7)));
    }

    #[test]
    fn a_waiter_the_queue_holds_back_waits_for_its_turn_first() {
        let mut w = W::default();
        assert_eq!(w.start::<u32>(false), S::WaitForTurn);
        assert_eq!(
            w.turned::<u32>(false),
            S::Refresh { own_hold: true },
            "woken, but not its turn: look again"
        );
        assert_eq!(w.refreshed::<u32>(Some(Ok(None)), true), S::CheckDelay);
    }

    #[test]
    fn after_finding_the_lock_held_a_waiter_reads_before_it_tries_again() {
        let mut w = W::default();
        w.start::<u32>(true);
        w.delay::<u32>(None);
        assert_eq!(w.granted::<u32>(Ok(None)), S::Refresh { own_hold: true });
        assert_eq!(w.refreshed::<u32>(Some(Ok(None)), true), S::WaitForTurn);
        assert_eq!(w.turned::<u32>(true), S::ReadHeld);
        assert_eq!(
            w.held::<u32>(Ok(true)),
            S::Refresh { own_hold: true },
            "another proxy's head got it: wait again, without a proposal"
        );
        w.refreshed::<u32>(Some(Ok(None)), true);
        w.turned::<u32>(true);
        assert_eq!(w.held::<u32>(Ok(false)), S::CheckDelay);
        assert_eq!(w.delay::<u32>(None), S::TryGrant);
    }

    #[test]
    fn after_an_unknown_outcome_a_waiter_never_reads_and_settles_before_giving_up() {
        let mut w = W::default();
        w.start::<u32>(true);
        w.delay::<u32>(None);
        assert_eq!(
            w.granted::<u32>(Err(Fault::Transient("timed out"))),
            S::Refresh { own_hold: false },
            "its own hold is looked for by the next attempt, not by a read"
        );
        assert_eq!(w.refreshed::<u32>(None, true), S::WaitForTurn);
        assert_eq!(
            w.turned::<u32>(true),
            S::CheckDelay,
            "a read would see the session's own hold and wait on it forever"
        );
        w.delay::<u32>(None);
        w.granted::<u32>(Err(Fault::Transient("timed out again")));
        w.refreshed::<u32>(None, true);
        assert_eq!(w.out_of_time::<u32>(), S::Settle);
        assert_eq!(w.settled(Ok(Some(9))), S::Done(Outcome::Granted(9)));
    }

    #[test]
    fn a_wait_that_runs_out_says_the_last_etcd_failure() {
        let mut w = W::default();
        w.start::<u32>(true);
        w.delay::<u32>(None);
        w.granted::<u32>(Ok(None));
        w.refreshed::<u32>(Some(Ok(None)), true);
        w.turned::<u32>(true);
        w.held::<u32>(Err(Fault::Transient("etcd away")));
        w.refreshed::<u32>(Some(Ok(None)), true);
        assert_eq!(
            w.out_of_time::<u32>(),
            S::Done(Outcome::Failed("etcd away"))
        );
        let mut quiet = W::default();
        quiet.start::<u32>(false);
        assert_eq!(quiet.out_of_time::<u32>(), S::Done(Outcome::TimedOut));
    }

    #[test]
    fn a_fatal_error_ends_the_call_at_once() {
        let mut w = W::default();
        w.start::<u32>(true);
        w.delay::<u32>(None);
        assert_eq!(
            w.granted::<u32>(Err(Fault::Fatal("already held"))),
            S::Done(Outcome::Failed("already held"))
        );
    }

    #[test]
    fn a_lock_delay_that_outlasts_the_wait_times_the_call_out() {
        let mut w = W::default();
        w.start::<u32>(true);
        assert_eq!(w.delay::<u32>(Some(false)), S::Done(Outcome::TimedOut));
        let mut w = W::default();
        w.start::<u32>(true);
        assert_eq!(w.delay::<u32>(Some(true)), S::Refresh { own_hold: true });
    }

    #[test]
    fn a_retried_call_that_holds_its_grant_gets_it_back() {
        let mut w = W::default();
        w.start::<u32>(false);
        w.turned::<u32>(false);
        assert_eq!(
            w.refreshed(Some(Ok(Some(5))), false),
            S::Done(Outcome::Granted(5))
        );
    }

    /// What the driver feeds back for one step, chosen by the test.
    #[derive(Debug, Clone)]
    enum Answer {
        Granted,
        Busy,
        Transient,
        Fatal,
        /// For waits and checks: the queue lets it try (or the delay ran out in time).
        Yes,
        No,
        OutOfTime,
    }

    fn answer() -> impl Strategy<Value = Answer> {
        prop_oneof![
            1 => Just(Answer::Granted),
            4 => Just(Answer::Busy),
            2 => Just(Answer::Transient),
            1 => Just(Answer::Fatal),
            3 => Just(Answer::Yes),
            2 => Just(Answer::No),
            1 => Just(Answer::OutOfTime),
        ]
    }

    fn reply(a: &Answer, grant: u32) -> Result<Option<u32>, Fault<&'static str>> {
        match a {
            Answer::Granted => Ok(Some(grant)),
            Answer::Transient => Err(Fault::Transient("transient")),
            Answer::Fatal => Err(Fault::Fatal("fatal")),
            _ => Ok(None),
        }
    }

    proptest! {
        /// Driven by any sequence of answers: a grant comes out only as the answer to
        /// an attempt (or the check of its own hold) that said granted, and nothing
        /// comes after it; after an attempt whose outcome is unknown the waiter never
        /// reads until an attempt has answered; after a busy attempt it tries again only
        /// after a turn; a wait that runs out after an unknown outcome settles first.
        #[test]
        fn any_run_keeps_the_waiters_rules(
            start in any::<bool>(),
            answers in proptest::collection::vec(answer(), 1..60),
        ) {
            let mut w = W::default();
            let mut step = w.start::<u32>(start);
            let (mut unsettled, mut busy, mut turned) = (false, false, false);
            let mut grants_offered = Vec::new();
            for (i, a) in answers.iter().enumerate() {
                let grant = i as u32;
                step = match step {
                    Step::Done(_) => break,
                    Step::Refresh { own_hold } => {
                        prop_assert_eq!(own_hold, !unsettled);
                        let own = own_hold.then(|| reply(a, grant));
                        if let Some(Ok(Some(g))) = &own { grants_offered.push(*g); }
                        if matches!(own, Some(Err(Fault::Transient(_)))) {
                            unsettled = true;
                            busy = true;
                        }
                        w.refreshed(own, !matches!(a, Answer::No))
                    }
                    Step::WaitForTurn => {
                        if matches!(a, Answer::OutOfTime) {
                            w.out_of_time()
                        } else {
                            turned = !matches!(a, Answer::No);
                            w.turned(turned)
                        }
                    }
                    Step::ReadHeld => {
                        prop_assert!(!unsettled, "read after an unknown outcome");
                        let held = match a {
                            Answer::Transient => Err(Fault::Transient("transient")),
                            Answer::Fatal => Err(Fault::Fatal("fatal")),
                            Answer::Busy | Answer::No => Ok(true),
                            _ => Ok(false),
                        };
                        w.held(held)
                    }
                    Step::CheckDelay => w.delay(match a {
                        Answer::Yes => Some(true),
                        Answer::OutOfTime => Some(false),
                        _ => None,
                    }),
                    Step::TryGrant => {
                        prop_assert!(!busy || turned || unsettled, "tried again without a turn");
                        let r = reply(a, grant);
                        match &r {
                            Ok(Some(g)) => grants_offered.push(*g),
                            Ok(None) => { unsettled = false; busy = true; turned = false; }
                            Err(Fault::Transient(_)) => { unsettled = true; busy = true; turned = false; }
                            Err(Fault::Fatal(_)) => {}
                        }
                        w.granted(r)
                    }
                    Step::Settle => {
                        prop_assert!(unsettled, "settled without an unknown outcome");
                        let r = match reply(a, grant) {
                            Ok(g) => Ok(g),
                            Err(Fault::Transient(e) | Fault::Fatal(e)) => Err(e),
                        };
                        if let Ok(Some(g)) = &r { grants_offered.push(*g); }
                        w.settled(r)
                    }
                };
            }
            if let Step::Done(Outcome::Granted(g)) = step {
                prop_assert_eq!(grants_offered.last().copied(), Some(g));
            } else {
                prop_assert!(
                    grants_offered.is_empty(),
                    "a grant was answered but the waiter went on: {:?}", grants_offered
                );
            }
        }
    }
}
