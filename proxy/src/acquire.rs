//! Acquiring a lock (or an election) for a session: the class's rules, the wait, and
//! the grant.
//!
//! Two ways to wait, by class:
//! - **fair**: the session's waiter key joins the line in etcd (`/q/<lock>/…`, ordered
//!   by create revision); a waiter watches only the waiter just ahead of it, and the head
//!   waits for the holders; the grant deletes the waiter key in the same transaction;
//! - **arbitrated**: the proxy's local queue ([`crate::queues`]); on a release only its
//!   head tries.
//!
//! Either way a waiter reads before it tries again (a read is not a proposal through
//! etcd's log), lock-delay holds back grants of locks whose holder vanished, and the
//! grant itself runs in a task of its own, so a client that hangs up mid-grant cannot
//! leave a grant the session does not know about.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockcell_cell::grants::Limit;
use lockcell_cell::locklog::{Acquired, Grant, HolderRecord, Place};
use lockcell_cell::{timing, CellError, LockName, Mode};
use tokio::time::Instant;

use crate::classes::LockClass;
use crate::core::fair::{FairWaiter, Outcome as FairOutcome, Step as FairStep};
use crate::core::waiter::{Outcome, Step, Waiter};
use crate::core::Fault;
use crate::errors::ProxyError;
use crate::metrics as m;
use crate::sessions::Session;
use crate::state::ProxyState;
use crate::unsettled;

mod grant;
mod line;
#[cfg(test)]
mod over_memory;

use self::grant::{decided_by_own_hold, grant};
use self::line::fair;

/// A waiter looks again on this period even without an event, so a missed watch event
/// delays a grant by at most this much (a read each time, never a proposal).
pub const POLL: Duration = Duration::from_secs(1);
/// Pause of a fair waiter after etcd failed its turn.
const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// One acquire or campaign.
#[derive(Clone)]
pub struct Call {
    pub session_id: String,
    pub lock: LockName,
    pub mode: Mode,
    /// None: wait until granted, the session ends or the caller hangs up.
    pub wait: Option<Duration>,
    /// An election leader's value.
    pub value: String,
    /// Whether the lock is an election (said in the holder record, for the audit trail).
    pub election: bool,
    /// The client's id for this acquire, the same on every retry (checked: letters and
    /// digits; a random one when the client gave none, so such calls are never taken
    /// for one another). A retried call gets its grant back, and a fair waiter that
    /// retries, here or on another proxy, keeps its place; another call of a session
    /// that holds the lock is refused.
    pub call_id: String,
}

/// Checks a client's call id: up to 32 ASCII letters and digits; an empty one is
/// replaced by a fresh random id (the call is then its own, never a retry).
pub fn call_id(id: String) -> Result<String, ProxyError> {
    if id.is_empty() {
        return Ok(format!("p{:016x}", rand::random::<u64>()));
    }
    if id.len() > 32 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(ProxyError::BadArgument(format!(
            "call id {id:?} must be 1 to 32 ASCII letters and digits"
        )));
    }
    Ok(id)
}

/// A grant as the caller sees it.
pub struct Granted {
    pub revision: i64,
    /// The epoch of its fencing token (see [`crate::routes`]).
    pub epoch: u64,
    pub valid_for: Duration,
    /// False for a retried call that found the grant it already had.
    pub fresh: bool,
}

impl Granted {
    /// The grant's fencing token.
    pub fn token(&self) -> lockcell_proto::FencingToken {
        lockcell_proto::FencingToken {
            epoch: self.epoch,
            revision: self.revision,
        }
    }
}

/// Acquires per the lock's class; `Ok(None)` when the wait ran out.
pub async fn acquire(state: &Arc<ProxyState>, call: Call) -> Result<Option<Granted>, ProxyError> {
    let started = Instant::now();
    if let Some(reason) = state.cell.changed() {
        return Err(CellError::CellChanged {
            reason: reason.to_owned(),
        }
        .into());
    }
    let session = live(state, &call.session_id)?;
    let class = state
        .classes
        .current()
        .class_for(call.lock.as_str())
        .clone();
    class
        .check_mode(call.lock.as_str(), call.mode == Mode::Shared)
        .map_err(ProxyError::BadArgument)?;
    class
        .check_ttl(call.lock.as_str(), session.ttl())
        .map_err(ProxyError::Refused)?;
    let give_up = call.wait.map(|d| started + d);
    let principal = session.principal.clone();
    state.pace(principal.as_deref())?;
    if let Some(granted) = decided_by_own_hold(state, &call, &session).await? {
        return Ok(Some(granted));
    }
    // A new key (the hold, or a waiter key on a fair class) counts against the
    // identity's keys; the call itself is one of its acquires in progress.
    let key = call.lock.holder_key(call.mode, &call.session_id);
    state.admit_keys(&call.session_id, 1, (key.len() + call.value.len()) as u64)?;
    state.space.admit(
        &format!("acquiring {:?}", call.lock.as_str()),
        (call.lock.as_str().len() + call.value.len()) as u64,
    )?;
    let _in_progress = state.take(principal.as_deref(), Limit::Waiting)?;
    // A call the client withdrew waits no more (a grant attempt it sent runs on).
    let Some(running) = state.calls.enter(&call.session_id, &call.call_id) else {
        return Ok(None);
    };
    let waiting = async {
        if class.fair {
            fair(state, &call, &class, give_up, session).await
        } else {
            arbitrated(state, &call, &class, give_up, session).await
        }
    };
    let result = tokio::select! {
        result = waiting => result,
        _ = running.withdrawn() => Ok(None),
    };
    if let Ok(Some(g)) = &result {
        if g.fresh {
            metrics::counter!(m::LOCKS_GRANTED).increment(1);
            metrics::histogram!(m::ACQUIRE_SECONDS).record(started.elapsed().as_secs_f64());
        }
    }
    result
}

/// Withdraws `call`, which its client gave up on: its wait ends, a grant attempt of it
/// under way finishes first (within etcd's timeout), and then the grant the call holds,
/// if any, is returned for the caller to release. Nothing is ever granted by it.
pub async fn withdraw(state: &Arc<ProxyState>, call: &Call) -> Result<Option<Granted>, ProxyError> {
    let patience = state.config.etcd_timeout * 2;
    // Waiting for the call's parts to end is waiting on another call.
    timing::waiting(
        state
            .calls
            .withdraw(&call.session_id, &call.call_id, patience),
    )
    .await;
    let session = live(state, &call.session_id)?;
    match grant::own_grant(state, call, &session).await {
        // Another call's hold of the lock: nothing of this call's.
        Err(ProxyError::Store(CellError::AlreadyHeld { .. })) => Ok(None),
        found => found,
    }
}

/// Waits in the proxy's local queue; only the head tries when the lock is released.
/// What to do when is [`core::waiter::Waiter`]'s to decide; this does it.
async fn arbitrated(
    state: &Arc<ProxyState>,
    call: &Call,
    class: &LockClass,
    give_up: Option<Instant>,
    session: Session,
) -> Result<Option<Granted>, ProxyError> {
    let mut ticket = state.queues.join(&call.lock, call.mode);
    let mut waiter = Waiter::default();
    // Counted in `lockcell_waiters` from its first wait for a turn on.
    let mut waiting = None;
    // When this waiter was last woken by a release, for the handover latency.
    let mut woken = None;
    let mut session = session;
    let mut step = waiter.start(ticket.may_try());
    loop {
        step = match step {
            Step::Refresh { own_hold } => {
                session = live(state, &call.session_id)?;
                let own = if own_hold {
                    Some(
                        decided_by_own_hold(state, call, &session)
                            .await
                            .map_err(|e| fault(e, &call.lock)),
                    )
                } else {
                    None
                };
                waiter.refreshed(own, ticket.may_try())
            }
            Step::WaitForTurn => match wait_budget(&session, give_up) {
                None => waiter.out_of_time(),
                Some(patience) => {
                    waiting.get_or_insert_with(|| m::Counted::in_gauge(m::WAITERS));
                    let woke = timing::waiting(ticket.turn(patience)).await;
                    let may_try = ticket.may_try();
                    if may_try && woke {
                        woken = Some(Instant::now());
                    }
                    waiter.turned(may_try)
                }
            },
            Step::ReadHeld => {
                let held = state.locklog.is_held(&call.lock, call.mode).await;
                waiter.held(
                    held.map(|(held, _)| held)
                        .map_err(|e| fault(e.into(), &call.lock)),
                )
            }
            Step::CheckDelay => {
                let delayed = match state.events.delayed_until(&call.lock, class.lock_delay) {
                    Some(until) => Some(sleep_until(until, give_up).await),
                    None => None,
                };
                waiter.delay(delayed)
            }
            // A session that ended while this waiter waited is caught when the grant
            // is recorded (and the grant undone).
            Step::TryGrant => {
                let reply = grant(state, call, &session, None).await;
                let step = waiter.granted(reply.map_err(|e| fault(e, &call.lock)));
                if matches!(step, Step::Done(Outcome::Granted(_))) {
                    handed_over(woken, "arbitrated");
                }
                step
            }
            Step::Settle => waiter.settled(grant(state, call, &session, None).await),
            Step::Done(outcome) => {
                return match outcome {
                    Outcome::Granted(granted) => {
                        ticket.granted();
                        Ok(Some(granted))
                    }
                    Outcome::TimedOut => Ok(None),
                    Outcome::Failed(e) => Err(e),
                };
            }
        };
    }
}

/// Records a handover: a waiter woken at `woken` by a release was just granted.
fn handed_over(woken: Option<Instant>, queueing: &'static str) {
    if let Some(woken) = woken {
        metrics::histogram!(m::HANDOVER_SECONDS, "queueing" => queueing)
            .record(woken.elapsed().as_secs_f64());
    }
}

/// [`ride_out`], as a fault for a decision of [`crate::core`].
fn fault(e: ProxyError, lock: &LockName) -> Fault<ProxyError> {
    match ride_out(e, lock) {
        Ok(e) => Fault::Transient(e),
        Err(e) => Fault::Fatal(e),
    }
}

/// An etcd failure a waiter rides out (etcd slow or away for a moment, as in the storm
/// of a lost zone): the waiter tries again on its next turn, until its wait runs out.
/// Retrying is safe: a grant whose reply was lost is found again as the session's own.
/// Any other error ends the wait.
fn ride_out(e: ProxyError, lock: &LockName) -> Result<ProxyError, ProxyError> {
    match &e {
        ProxyError::Store(c) | ProxyError::StoreDuring { source: c, .. } if c.is_retriable() => {
            tracing::debug!(lock = %lock, error = %e, "etcd failed a waiter's turn; trying again");
            metrics::counter!(m::WAIT_RETRIES).increment(1);
            Ok(e)
        }
        _ => Err(e),
    }
}

fn live(state: &ProxyState, id: &str) -> Result<Session, ProxyError> {
    state
        .sessions
        .get(id, Instant::now())
        .map_err(|g| ProxyError::session(id, g))
}

fn gone(state: &ProxyState, id: &str) -> ProxyError {
    match state.sessions.get(id, Instant::now()) {
        Ok(_) => ProxyError::session(id, crate::sessions::Gone::Unknown),
        Err(g) => ProxyError::session(id, g),
    }
}

/// How long to wait before looking again: the poll period, cut to the session's end
/// and the caller's give-up time. `None` when the give-up time has come.
fn wait_budget(session: &Session, give_up: Option<Instant>) -> Option<Duration> {
    let now = Instant::now();
    let mut patience = POLL.min(session.expires_at().saturating_duration_since(now));
    if let Some(give_up) = give_up {
        if now >= give_up {
            return None;
        }
        patience = patience.min(give_up - now);
    }
    Some(patience)
}

/// Sleeps until `until`, or until the caller gives up first; false in that case.
async fn sleep_until(until: Instant, give_up: Option<Instant>) -> bool {
    match give_up {
        Some(g) if g < until => {
            timing::waiting(tokio::time::sleep_until(g)).await;
            false
        }
        _ => {
            timing::waiting(tokio::time::sleep_until(until)).await;
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockcell_cell::CellError;

    #[test]
    fn a_waiter_rides_out_etcd_being_slow_but_not_other_errors() {
        let lock = LockName::parse("a").unwrap();
        let slow = ProxyError::Store(CellError::Timeout {
            op: "acquire txn",
            after: Duration::from_secs(2),
        });
        assert!(ride_out(slow, &lock).is_ok());
        let during = ProxyError::StoreDuring {
            context: "placing a waiter".into(),
            source: CellError::Timeout {
                op: "read",
                after: Duration::from_secs(2),
            },
        };
        assert!(ride_out(during, &lock).is_ok());
        let corrupt = ProxyError::Store(CellError::CorruptRecord {
            key: "/l/a/!x".into(),
            reason: "not json".into(),
        });
        assert!(ride_out(corrupt, &lock).is_err());
        assert!(ride_out(ProxyError::ShuttingDown, &lock).is_err());
        let gone = ProxyError::session("s", crate::sessions::Gone::Unknown);
        assert!(ride_out(gone, &lock).is_err());
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// A call id passes only as 1 to 32 ASCII letters and digits, unchanged; an
            /// empty one becomes a fresh id of the same kind.
            #[test]
            fn a_call_id_passes_only_when_short_and_alphanumeric(id in "\\PC{0,40}|[a-zA-Z0-9]{0,40}") {
                let fine = !id.is_empty() && id.len() <= 32 && id.bytes().all(|b| b.is_ascii_alphanumeric());
                match call_id(id.clone()) {
                    Ok(kept) if id.is_empty() => prop_assert!(kept.len() <= 32 && kept.bytes().all(|b| b.is_ascii_alphanumeric())),
                    Ok(kept) => { prop_assert!(fine); prop_assert_eq!(kept, id); }
                    Err(e) => { prop_assert!(!fine); prop_assert!(e.to_string().contains("call id")); }
                }
            }
        }
    }
}
