//! An acquire standing in line in etcd (fair classes, docs/design.md §5): its key is a
//! waiter key under `/q/`, in line by its create revision, and it takes turns until it
//! is granted, its wait runs out, or it fails.
//!
//! The rules:
//! - each turn starts by looking the session up (it may have ended: that ends the call)
//!   and asking whether it already holds the lock: then the grant transaction decides
//!   at once, never a wait in line behind the session's own hold;
//! - behind another waiter, it waits for that waiter to change (leave, or be granted),
//!   then takes another turn: only the head ever tries, so no grant is out of turn;
//! - at the head, it holds back while the lock's lock-delay runs, reads whether a
//!   holder stands in the way (a read is not a proposal), and tries the grant only when
//!   none does; a grant refused although the lock was free means someone got in first
//!   or this waiter's key is no longer in line here (its session moved, and the key
//!   with it): a read tells which, and a key gone ends the call ([`Outcome::LostPlace`]);
//! - while the lock is held it waits for a release, reading again after each change,
//!   and takes another turn once it is free;
//! - a transient etcd failure is ridden out: the session is looked up again, and asked
//!   whether a grant attempt that failed midway was applied after all (the lock is then
//!   this call's own); then a pause, and another turn. Any other error ends the call;
//! - between turns, a call whose wait has run out ends: timed out, or with the last
//!   failure ridden out.
//!
//! [`FairWaiter`] holds only these decisions. Its driver (`acquire::fair`) asks etcd,
//! watches keys and the clock, and feeds each result back; at most one grant comes
//! out, and only from a reply that said granted.

use super::Fault;

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<K, G, E> {
    /// Look the session up again (it may have ended meanwhile: that ends the call), and
    /// let the session's own hold of the lock, if any, decide; then
    /// [`FairWaiter::refreshed`].
    Refresh,
    /// A turn is over: if the call's wait has run out, [`FairWaiter::time_up`]; else
    /// [`Step::Refresh`].
    NewTurn,
    /// Read the waiter's place in line; then [`FairWaiter::placed`].
    ReadPlace,
    /// Behind waiter `K`: watch it, look again (it may have left meanwhile), and if it
    /// is still the one ahead, wait for it to change, as long as the session and the
    /// call's wait allow; then [`FairWaiter::behind`].
    WaitBehind(K),
    /// At the head: hold back while the lock's lock-delay runs; then
    /// [`FairWaiter::delay`].
    CheckDelay,
    /// At the head: watch the lock (from the first read of a head turn on), then read
    /// whether a holder stands in the way; then [`FairWaiter::held`].
    ReadHeld,
    /// Try the grant transaction with this waiter's key; then [`FairWaiter::granted`].
    TryGrant,
    /// Read whether this waiter's key is still in line here; then
    /// [`FairWaiter::in_line`].
    CheckInLine,
    /// The lock is held: look the session up again (its end ends the call) and wait for
    /// a change of the lock, as long as the session and the call's wait allow; then
    /// [`FairWaiter::waited`], or [`FairWaiter::out_of_time`] if no time is left.
    WaitRelease,
    /// A failure was ridden out: look the session up again (its end ends the call) and
    /// whether this call holds the lock after all; then [`FairWaiter::recovered`].
    Recover,
    /// Pause before the next turn, as long as the call's wait allows; then
    /// [`FairWaiter::paused`], or [`FairWaiter::out_of_time`] if no time is left.
    Pause,
    /// The call is over.
    Done(Outcome<G, E>),
}

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<G, E> {
    /// Granted by a transaction that took this waiter's key out of line.
    Granted(G),
    /// The session held the lock already, and the grant transaction said this call's:
    /// the waiter's key is still in line, for the driver to take out.
    Held(G),
    /// The wait ran out without a grant.
    TimedOut,
    /// The waiter's key is no longer in line here (its session moved).
    LostPlace,
    Failed(E),
}

/// Where a head turn stands: before its grant attempt, or after it (or after a wait
/// for a release), when a free lock means another turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    First,
    Again,
}

/// One waiter's state between steps.
#[derive(Debug)]
pub struct FairWaiter<E> {
    head: Head,
    /// The last etcd failure ridden out, said if the wait runs out before a turn goes
    /// through.
    trouble: Option<E>,
}

impl<E> Default for FairWaiter<E> {
    fn default() -> Self {
        FairWaiter {
            head: Head::First,
            trouble: None,
        }
    }
}

impl<E> FairWaiter<E> {
    /// The first turn, once the waiter's key is in line.
    pub fn start<K, G>(&mut self) -> Step<K, G, E> {
        Step::Refresh
    }

    /// The session is still there; `own` is what its own hold decided (`None`: it
    /// holds nothing of the lock).
    pub fn refreshed<K, G>(&mut self, own: Result<Option<G>, Fault<E>>) -> Step<K, G, E> {
        match own {
            Ok(Some(granted)) => Step::Done(Outcome::Held(granted)),
            Ok(None) => Step::ReadPlace,
            Err(fault) => self.failed(fault),
        }
    }

    /// The call's wait ran out between turns.
    pub fn time_up<K, G>(&mut self) -> Step<K, G, E> {
        Step::Done(match self.trouble.take() {
            Some(e) => Outcome::Failed(e),
            None => Outcome::TimedOut,
        })
    }

    /// The waiter's place: behind `Some(predecessor)`, or at the head (`None`).
    pub fn placed<K, G>(&mut self, place: Result<Option<K>, Fault<E>>) -> Step<K, G, E> {
        match place {
            Ok(Some(predecessor)) => Step::WaitBehind(predecessor),
            Ok(None) => {
                self.head = Head::First;
                Step::CheckDelay
            }
            Err(fault) => self.failed(fault),
        }
    }

    /// The wait behind the predecessor ended (it changed, the look found another place,
    /// or the patience of one wait ran out): another turn. `Ok(false)`: no time was
    /// left to wait.
    pub fn behind<K, G>(&mut self, waited: Result<bool, Fault<E>>) -> Step<K, G, E> {
        match waited {
            Ok(true) => self.turn_over(),
            Ok(false) => Step::Done(Outcome::TimedOut),
            Err(fault) => self.failed(fault),
        }
    }

    /// The lock-delay check: `None` when no delay held the lock back; `Some(true)` when
    /// one did and ran out within the call's wait, `Some(false)` when the wait ran out
    /// first.
    pub fn delay<K, G>(&mut self, delayed: Option<bool>) -> Step<K, G, E> {
        match delayed {
            None => Step::ReadHeld,
            Some(true) => self.turn_over(),
            Some(false) => Step::Done(Outcome::TimedOut),
        }
    }

    /// What the read found: whether a holder stands in the way.
    pub fn held<K, G>(&mut self, held: Result<bool, Fault<E>>) -> Step<K, G, E> {
        match (held, self.head) {
            (Ok(true), _) => Step::WaitRelease,
            (Ok(false), Head::First) => Step::TryGrant,
            (Ok(false), Head::Again) => self.turn_over(),
            (Err(fault), _) => self.failed(fault),
        }
    }

    /// What the grant attempt found: the grant, or `None` when it was refused.
    pub fn granted<K, G>(&mut self, reply: Result<Option<G>, Fault<E>>) -> Step<K, G, E> {
        self.head = Head::Again;
        match reply {
            Ok(Some(granted)) => Step::Done(Outcome::Granted(granted)),
            Ok(None) => Step::CheckInLine,
            Err(fault) => self.failed(fault),
        }
    }

    /// Whether the waiter's key is still in line here, after a refused grant.
    pub fn in_line<K, G>(&mut self, here: Result<bool, Fault<E>>) -> Step<K, G, E> {
        match here {
            Ok(true) => Step::ReadHeld,
            Ok(false) => Step::Done(Outcome::LostPlace),
            Err(fault) => self.failed(fault),
        }
    }

    /// A wait for a release ended (a change, or the patience of one wait): read again.
    pub fn waited<K, G>(&mut self) -> Step<K, G, E> {
        self.head = Head::Again;
        Step::ReadHeld
    }

    /// No time is left to wait (for a release, or in a pause).
    pub fn out_of_time<K, G>(&mut self) -> Step<K, G, E> {
        self.time_up()
    }

    /// What the look for this call's own grant found, after a failure: the grant (an
    /// attempt that failed midway was applied), or nothing. A failure of the look
    /// itself changes nothing: the pause comes, and the next turn looks again.
    pub fn recovered<K, G>(&mut self, own: Result<Option<G>, E>) -> Step<K, G, E> {
        match own {
            Ok(Some(granted)) => Step::Done(Outcome::Granted(granted)),
            Ok(None) | Err(_) => Step::Pause,
        }
    }

    /// The pause is over: another turn, keeping the failure to say if the wait runs out.
    pub fn paused<K, G>(&mut self) -> Step<K, G, E> {
        Step::NewTurn
    }

    /// A turn went through: the failures before it are over.
    fn turn_over<K, G>(&mut self) -> Step<K, G, E> {
        self.trouble = None;
        Step::NewTurn
    }

    /// Keeps a transient failure and recovers from it; a fatal one ends the call.
    fn failed<K, G>(&mut self, fault: Fault<E>) -> Step<K, G, E> {
        match fault {
            Fault::Transient(e) => {
                self.trouble = Some(e);
                Step::Recover
            }
            Fault::Fatal(e) => Step::Done(Outcome::Failed(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    type W = FairWaiter<&'static str>;
    type S = Step<&'static str, u32, &'static str>;

    fn slow() -> Fault<&'static str> {
        Fault::Transient("etcd slow")
    }

    #[test]
    fn the_head_of_a_free_lock_is_granted_and_leaves_the_line_with_its_grant() {
        let mut w = W::default();
        assert_eq!(w.start::<&str, u32>(), S::Refresh);
        assert_eq!(w.refreshed(Ok(None)), S::ReadPlace);
        assert_eq!(w.placed(Ok(None)), S::CheckDelay);
        assert_eq!(w.delay::<&str, u32>(None), S::ReadHeld);
        assert_eq!(w.held(Ok(false)), S::TryGrant);
        assert_eq!(w.granted(Ok(Some(7))), S::Done(Outcome::Granted(7)));
    }

    #[test]
    fn a_waiter_behind_another_never_tries_and_takes_a_turn_when_it_changes() {
        let mut w = W::default();
        w.start::<&str, u32>();
        w.refreshed::<&str, u32>(Ok(None));
        assert_eq!(w.placed(Ok(Some("/q/l/!x/a"))), S::WaitBehind("/q/l/!x/a"));
        assert_eq!(w.behind(Ok(true)), S::NewTurn);
        assert_eq!(w.behind(Ok(false)), S::Done(Outcome::TimedOut));
    }

    #[test]
    fn a_session_holding_the_lock_decides_at_once_and_its_key_stays_for_the_driver() {
        let mut w = W::default();
        w.start::<&str, u32>();
        assert_eq!(w.refreshed(Ok(Some(3))), S::Done(Outcome::Held(3)));
        let mut w = W::default();
        assert_eq!(
            w.refreshed(Err(Fault::Fatal("held by another call"))),
            S::Done(Outcome::Failed("held by another call"))
        );
    }

    #[test]
    fn a_held_lock_is_waited_for_and_a_free_one_after_the_wait_is_another_turn() {
        let mut w = W::default();
        w.placed::<&str, u32>(Ok(None));
        w.delay::<&str, u32>(None);
        assert_eq!(w.held(Ok(true)), S::WaitRelease);
        assert_eq!(w.waited::<&str, u32>(), S::ReadHeld);
        assert_eq!(w.held(Ok(true)), S::WaitRelease);
        assert_eq!(w.waited::<&str, u32>(), S::ReadHeld);
        // Free after a wait: the next turn looks at its place and the delay first.
        assert_eq!(w.held(Ok(false)), S::NewTurn);
        assert_eq!(w.out_of_time::<&str, u32>(), S::Done(Outcome::TimedOut));
    }

    #[test]
    fn a_refused_grant_reads_whether_the_key_is_still_in_line() {
        let mut w = W::default();
        w.placed::<&str, u32>(Ok(None));
        w.delay::<&str, u32>(None);
        w.held::<&str, u32>(Ok(false));
        assert_eq!(w.granted(Ok(None)), S::CheckInLine);
        assert_eq!(w.in_line(Ok(true)), S::ReadHeld);
        // Someone got in first: wait for them, then a new turn.
        assert_eq!(w.held(Ok(true)), S::WaitRelease);
        let mut w = W::default();
        w.placed::<&str, u32>(Ok(None));
        w.held::<&str, u32>(Ok(false));
        w.granted::<&str, u32>(Ok(None));
        assert_eq!(w.in_line(Ok(false)), S::Done(Outcome::LostPlace));
    }

    #[test]
    fn a_lock_delay_holds_the_head_back_and_can_outlast_the_wait() {
        let mut w = W::default();
        w.placed::<&str, u32>(Ok(None));
        assert_eq!(w.delay::<&str, u32>(Some(true)), S::NewTurn);
        assert_eq!(
            w.delay::<&str, u32>(Some(false)),
            S::Done(Outcome::TimedOut)
        );
    }

    #[test]
    fn a_failure_is_ridden_out_and_said_when_the_wait_runs_out() {
        let mut w = W::default();
        w.placed::<&str, u32>(Ok(None));
        w.held::<&str, u32>(Ok(false));
        assert_eq!(w.granted(Err(slow())), S::Recover);
        // Nothing of its own: pause, then another turn.
        assert_eq!(w.recovered(Ok(None)), S::Pause);
        assert_eq!(w.paused::<&str, u32>(), S::NewTurn);
        assert_eq!(
            w.time_up::<&str, u32>(),
            S::Done(Outcome::Failed("etcd slow"))
        );
    }

    #[test]
    fn an_attempt_that_failed_midway_but_was_applied_is_found_and_granted() {
        let mut w = W::default();
        w.placed::<&str, u32>(Ok(None));
        w.held::<&str, u32>(Ok(false));
        w.granted::<&str, u32>(Err(slow()));
        assert_eq!(w.recovered(Ok(Some(9))), S::Done(Outcome::Granted(9)));
        // A look that fails itself changes nothing.
        let mut w = W::default();
        w.placed::<&str, u32>(Err(slow()));
        assert_eq!(w.recovered::<&str, u32>(Err("still slow")), S::Pause);
    }

    #[test]
    fn a_turn_that_goes_through_forgets_the_failures_before_it() {
        let mut w = W::default();
        w.placed::<&str, u32>(Err(slow()));
        w.recovered::<&str, u32>(Ok(None));
        w.paused::<&str, u32>();
        w.refreshed::<&str, u32>(Ok(None));
        w.placed::<&str, u32>(Ok(Some("/q/l/!x/a")));
        assert_eq!(w.behind::<&str, u32>(Ok(true)), S::NewTurn);
        assert_eq!(w.time_up::<&str, u32>(), S::Done(Outcome::TimedOut));
    }

    #[test]
    fn a_fatal_error_anywhere_ends_the_call() {
        let fatal = || Fault::Fatal("corrupt record");
        let done = S::Done(Outcome::Failed("corrupt record"));
        assert_eq!(W::default().refreshed(Err(fatal())), done);
        assert_eq!(W::default().placed(Err(fatal())), done);
        assert_eq!(W::default().behind(Err(fatal())), done);
        assert_eq!(W::default().held(Err(fatal())), done);
        assert_eq!(W::default().granted(Err(fatal())), done);
        assert_eq!(W::default().in_line(Err(fatal())), done);
    }

    /// What happened, as a driver could report it.
    #[derive(Debug, Clone)]
    enum Event {
        Own(Option<u32>),
        Place(Option<&'static str>),
        Behind(bool),
        Delay(Option<bool>),
        Held(bool),
        Reply(Option<u32>),
        InLine(bool),
        Slow,
        TimeUp(bool),
        Found(Option<u32>),
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            proptest::option::of(0u32..3).prop_map(Event::Own),
            proptest::option::of(Just("/q/l/!x/a")).prop_map(Event::Place),
            any::<bool>().prop_map(Event::Behind),
            proptest::option::of(any::<bool>()).prop_map(Event::Delay),
            any::<bool>().prop_map(Event::Held),
            proptest::option::of(0u32..3).prop_map(Event::Reply),
            any::<bool>().prop_map(Event::InLine),
            Just(Event::Slow),
            any::<bool>().prop_map(Event::TimeUp),
            proptest::option::of(0u32..3).prop_map(Event::Found),
        ]
    }

    proptest! {
        /// Driven by any answers, the waiter tries a grant only after a read at the
        /// head found the lock free in that same turn; it ends with a grant only from a
        /// reply (or a look for its own) that carried one; and it never asks for a step
        /// after it is done.
        #[test]
        fn grants_come_only_from_replies_and_tries_only_at_a_free_head(
            events in proptest::collection::vec(event(), 1..60)
        ) {
            let mut w = W::default();
            let mut step: S = w.start();
            let mut free_at_head = false;
            let mut given = Vec::new();
            for e in events {
                if let Step::Done(_) = step { break; }
                if step == S::TryGrant {
                    prop_assert!(free_at_head, "a grant tried without a free lock at the head");
                }
                step = match (&step, e) {
                    (Step::Refresh, Event::Own(own)) => { if let Some(g) = own { given.push(g); } w.refreshed(Ok(own)) }
                    (Step::Refresh, Event::Slow) => w.refreshed(Err(slow())),
                    (Step::NewTurn, Event::TimeUp(true)) => w.time_up(),
                    (Step::NewTurn, _) => { free_at_head = false; Step::Refresh }
                    (Step::ReadPlace, Event::Place(p)) => w.placed(Ok(p)),
                    (Step::ReadPlace, Event::Slow) => w.placed(Err(slow())),
                    (Step::WaitBehind(_), Event::Behind(b)) => w.behind(Ok(b)),
                    (Step::CheckDelay, Event::Delay(d)) => w.delay(d),
                    (Step::ReadHeld, Event::Held(h)) => { free_at_head = !h; w.held(Ok(h)) }
                    (Step::ReadHeld, Event::Slow) => w.held(Err(slow())),
                    (Step::TryGrant, Event::Reply(r)) => { free_at_head = false; if let Some(g) = r { given.push(g); } w.granted(Ok(r)) }
                    (Step::TryGrant, Event::Slow) => { free_at_head = false; w.granted(Err(slow())) }
                    (Step::CheckInLine, Event::InLine(here)) => w.in_line(Ok(here)),
                    (Step::WaitRelease, Event::TimeUp(true)) => w.out_of_time(),
                    (Step::WaitRelease, _) => w.waited(),
                    (Step::Recover, Event::Found(f)) => { if let Some(g) = f { given.push(g); } w.recovered(Ok(f)) }
                    (Step::Recover, _) => w.recovered(Err("still slow")),
                    (Step::Pause, Event::TimeUp(true)) => w.out_of_time(),
                    (Step::Pause, _) => w.paused(),
                    (current, _) => current.clone(),
                };
            }
            if let Step::Done(Outcome::Granted(g) | Outcome::Held(g)) = step {
                prop_assert!(given.contains(&g), "granted {} that no reply carried", g);
            }
        }
    }
}
