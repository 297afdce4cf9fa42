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
use lockcell_cell::{CellError, LockName, Mode};
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
    let result = if class.fair {
        fair(state, &call, &class, give_up, session).await
    } else {
        arbitrated(state, &call, &class, give_up, session).await
    };
    if let Ok(Some(g)) = &result {
        if g.fresh {
            metrics::counter!(m::LOCKS_GRANTED).increment(1);
            metrics::histogram!(m::ACQUIRE_SECONDS).record(started.elapsed().as_secs_f64());
        }
    }
    result
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
                    let woke = ticket.turn(patience).await;
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

/// Waits in line in etcd: behind the waiter just ahead, then, at the head, for the
/// holders. What to do when is [`core::fair::FairWaiter`]'s to decide; this does it.
async fn fair(
    state: &Arc<ProxyState>,
    call: &Call,
    class: &LockClass,
    give_up: Option<Instant>,
    session: Session,
) -> Result<Option<Granted>, ProxyError> {
    // A retried call that already holds the lock must not join the line behind the
    // waiters its own hold keeps out (and another call of the session is refused).
    if let Some(granted) = own_grant(state, call, &session).await? {
        return Ok(Some(granted));
    }
    // One key per call: two calls of one session never share (or remove) a place; a
    // retried call (same call id) finds its key, also if it was queued elsewhere.
    let id = format!("{}-{}", call.session_id, call.call_id);
    let served = state.routes.serve(call.lock.as_str())?;
    // Out of line on every way out but a grant (which deletes the key itself).
    let mut line = join_line(state, call, &session, &id, served.map_revision).await?;
    let queued = line.waiter.revision;
    let _waiting = m::Counted::in_gauge(m::WAITERS);
    let mut waiter = FairWaiter::default();
    let mut session = session;
    // The lock's changes, watched from a head turn's first read on, and the revision
    // of the last read.
    let mut lock_changes = None;
    let mut seen_at = 0;
    let fault = |e: ProxyError| fault(e, &call.lock);
    let mut step = waiter.start();
    loop {
        step = match step {
            FairStep::Refresh => {
                session = live(state, &call.session_id)?;
                lock_changes = None;
                let own = decided_by_own_hold(state, call, &session).await;
                waiter.refreshed(own.map_err(fault))
            }
            FairStep::NewTurn => match give_up {
                Some(g) if Instant::now() >= g => waiter.time_up(),
                _ => FairStep::Refresh,
            },
            FairStep::ReadPlace => {
                let place = state.locklog.place(&call.lock, call.mode, queued).await;
                waiter.placed(
                    place
                        .map(|place| match place {
                            Place::Behind { predecessor, .. } => Some(predecessor),
                            Place::Head { .. } => None,
                        })
                        .map_err(|e| fault(e.into())),
                )
            }
            FairStep::WaitBehind(predecessor) => {
                let waited =
                    wait_behind(state, call, &session, give_up, queued, &predecessor).await;
                if let Ok(Some(true)) = waited {
                    line.woken = Some(Instant::now());
                }
                waiter.behind(waited.map(|w| w.is_some()).map_err(fault))
            }
            FairStep::CheckDelay => {
                let delayed = match state.events.delayed_until(&call.lock, class.lock_delay) {
                    Some(until) => Some(sleep_until(until, give_up).await),
                    None => None,
                };
                waiter.delay(delayed)
            }
            FairStep::ReadHeld => {
                lock_changes.get_or_insert_with(|| state.events.subscribe_lock(&call.lock));
                let held = state.locklog.is_held(&call.lock, call.mode).await;
                if let Ok((_, at)) = held {
                    seen_at = at;
                }
                waiter.held(held.map(|(held, _)| held).map_err(|e| fault(e.into())))
            }
            FairStep::TryGrant => {
                let reply = grant(state, call, &session, Some((&id, queued))).await;
                waiter.granted(reply.map_err(fault))
            }
            // Free, yet not granted: someone got in first, or this waiter's key is no
            // longer here (its session moved, and the key with it).
            FairStep::CheckInLine => {
                let here = state
                    .locklog
                    .in_line(&call.lock, call.mode, &id, queued, session.lease)
                    .await;
                waiter.in_line(here.map_err(|e| fault(e.into())))
            }
            FairStep::WaitRelease => {
                session = live(state, &call.session_id)?;
                match wait_budget(&session, give_up) {
                    None => waiter.out_of_time(),
                    Some(wait) => {
                        let changes = lock_changes.as_mut().expect("watched since the read");
                        if changes.changed_after(seen_at, wait).await {
                            line.woken = Some(Instant::now());
                        }
                        waiter.waited()
                    }
                }
            }
            // A grant attempt that failed midway may have been applied: the lock is
            // then this session's own, and no turn in line would ever find it free.
            FairStep::Recover => {
                session = live(state, &call.session_id)?;
                waiter.recovered(own_grant(state, call, &session).await)
            }
            FairStep::Pause => match wait_budget(&session, give_up) {
                None => waiter.out_of_time(),
                Some(pause) => {
                    tokio::time::sleep(pause.min(RETRY_PAUSE)).await;
                    waiter.paused()
                }
            },
            FairStep::Done(outcome) => {
                return match outcome {
                    FairOutcome::Granted(granted) => {
                        line.left();
                        handed_over(line.woken, "fair");
                        Ok(Some(granted))
                    }
                    // Its key leaves the line as the wait ends.
                    FairOutcome::Held(granted) => Ok(Some(granted)),
                    FairOutcome::TimedOut => Ok(None),
                    FairOutcome::LostPlace => Err(ProxyError::Refused(format!(
                        "this acquire of lock {:?} lost its place in line here: its session \
                         moved to another proxy, where the acquire goes on",
                        call.lock.as_str()
                    ))),
                    FairOutcome::Failed(e) => Err(e),
                };
            }
        };
    }
}

/// Waits behind `predecessor` in line: watches it, looks again (it may have left
/// between), and waits for it to change if it is still the one ahead, as long as the
/// session and the call's wait allow. `Some(whether a change woke it)` when the turn
/// is over; `None` when no time was left to wait.
async fn wait_behind(
    state: &Arc<ProxyState>,
    call: &Call,
    session: &Session,
    give_up: Option<Instant>,
    queued: i64,
    predecessor: &[u8],
) -> Result<Option<bool>, ProxyError> {
    let mut sub = state.events.subscribe_key(predecessor);
    let Place::Behind {
        predecessor: again,
        seen_at,
    } = state.locklog.place(&call.lock, call.mode, queued).await?
    else {
        return Ok(Some(false));
    };
    let Some(patience) = wait_budget(session, give_up) else {
        return Ok(None);
    };
    Ok(Some(
        again == predecessor && sub.changed_after(seen_at, patience).await,
    ))
}

/// Puts the fair waiter `id` in line (see [`enqueue`]) in a task of its own, run to
/// completion even if the caller hangs up meanwhile: the guard that takes the key out
/// of line again is made in the task, and if nobody awaits it any more it is dropped
/// with the task's output, so a key etcd wrote never stands in line for nobody. The
/// key is claimed before the enqueue goes out: a clean-up looking for an earlier
/// attempt's key leaves it to this call from then on.
async fn join_line(
    state: &Arc<ProxyState>,
    call: &Call,
    session: &Session,
    id: &str,
    map_revision: i64,
) -> Result<LeaveLine, ProxyError> {
    let (state, call, session, id) = (state.clone(), call.clone(), session.clone(), id.to_owned());
    let joining = tokio::spawn(async move {
        let claim = state
            .cleanup
            .claims
            .claim(&call.lock.waiter_key(call.mode, &id));
        let waiter = enqueue(&state, &call, &session, &id, map_revision).await?;
        tracing::debug!(key = %waiter.key, queued = waiter.revision, lease = session.lease, "in line");
        Ok(LeaveLine {
            state,
            waiter,
            session: call.session_id,
            lease: session.lease,
            done: false,
            woken: None,
            _claim: claim,
        })
    });
    joining
        .await
        .map_err(|e| ProxyError::Internal(format!("joining the line failed: {e}")))?
}

/// Puts the fair waiter `id` in line and records its key in the session. The key is
/// recorded as unsettled before the enqueue goes out, so that an enqueue whose answer
/// never came (applied or not, nobody knows) still leaves a key the session owns: it is
/// looked for and taken out of line at once, and if etcd does not answer that either,
/// when the session ends.
async fn enqueue(
    state: &Arc<ProxyState>,
    call: &Call,
    session: &Session,
    id: &str,
    map_revision: i64,
) -> Result<Grant, ProxyError> {
    let pending = Grant::unsettled_waiter(&call.lock, call.mode, &call.session_id, id);
    if !state
        .sessions
        .record_grant(&call.session_id, session.incarnation, pending.clone(), None)
    {
        return Err(gone(state, &call.session_id));
    }
    let queued = state
        .locklog
        .enqueue(&call.lock, call.mode, id, session.lease, map_revision)
        .await;
    let queued = match queued {
        Ok(queued) => queued,
        Err(e) if unsettled::unknown_outcome(&e) => {
            // Left in line, perhaps: a waiter nobody follows would keep the lock from
            // every waiter behind it. The clean-up looks for it (and takes it out) as
            // soon as etcd answers; the session keeps its record too, for its end.
            tracing::warn!(lock = %call.lock, error = %e, "an enqueue's outcome is unknown; taking the waiter out of line");
            state.cleanup.push(session.lease, vec![pending]);
            return Err(e.into());
        }
        Err(e) => {
            state.sessions.forget(&call.session_id, &pending);
            return Err(e.into());
        }
    };
    let waiter = Grant::waiting(&call.lock, call.mode, id, queued);
    let recorded =
        state
            .sessions
            .record_grant(&call.session_id, session.incarnation, waiter.clone(), None);
    state.sessions.forget(&call.session_id, &pending);
    if !recorded {
        state.cleanup.push(session.lease, vec![waiter]);
        return Err(gone(state, &call.session_id));
    }
    Ok(waiter)
}

/// Takes a fair waiter's key out of line when its wait ends without a grant.
struct LeaveLine {
    state: Arc<ProxyState>,
    waiter: Grant,
    session: String,
    lease: i64,
    done: bool,
    /// When the waiter was last woken by a change ahead of it, for the handover latency.
    woken: Option<Instant>,
    /// The call's claim on its key, while it stands in line with it.
    _claim: crate::cleanup::Claim,
}

impl LeaveLine {
    /// The waiter left the line by its grant (whose transaction deleted its key).
    fn left(&mut self) {
        self.done = true;
        self.state
            .sessions
            .forget_grant(&self.session, &self.waiter.key, self.waiter.revision);
    }
}

impl Drop for LeaveLine {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let (state, waiter, session, lease) = (
            self.state.clone(),
            self.waiter.clone(),
            self.session.clone(),
            self.lease,
        );
        // Bounded by the etcd timeout. On failure the proxy's clean-up queue retries it
        // until etcd answers: a waiter key whose call is over must not wait for its
        // session's end (which may be days away) while every waiter behind it waits.
        tokio::spawn(async move {
            match state
                .locklog
                .delete_guarded(std::slice::from_ref(&waiter), lease, false)
                .await
            {
                Ok(deleted) => {
                    tracing::debug!(key = %waiter.key, lease, deleted = deleted.keys, "left the line");
                    state
                        .sessions
                        .forget_grant(&session, &waiter.key, waiter.revision)
                }
                Err(e) => {
                    tracing::warn!(error = %e, key = %waiter.key, "could not leave the line; retrying");
                    state.cleanup.push(lease, vec![waiter]);
                }
            }
        });
    }
}

/// One grant attempt, run to completion even if the caller hangs up meanwhile, so a
/// grant etcd made is always recorded in the session (or undone).
///
/// The hold is recorded as unsettled before the transaction goes out: if etcd's answer
/// never comes, the key it may have written is still the session's (read back now, and
/// deleted when the session ends), never a key nobody owns.
async fn grant(
    state: &Arc<ProxyState>,
    call: &Call,
    session: &Session,
    queued: Option<(&str, i64)>,
) -> Result<Option<Granted>, ProxyError> {
    let record = HolderRecord {
        session: call.session_id.clone(),
        call: call.call_id.clone(),
        proxy: state.proxy_id.clone(),
        identity: session.identity.clone(),
        zone: state.config.zone.clone(),
        election: call.election,
        acquired_at_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default(),
        value: call.value.clone(),
    };
    let caller = state;
    let (state, lock, mode, session) =
        (state.clone(), call.lock.clone(), call.mode, session.clone());
    let queued = queued.map(|(id, rev)| (id.to_owned(), rev));
    let attempt = tokio::spawn(async move {
        metrics::counter!(m::GRANT_ATTEMPTS).increment(1);
        let pending = Grant::unsettled_hold(&lock, mode, &session.id, &record.call)
            .with_value_bytes(record.value.len());
        let queued = queued.as_ref().map(|(id, rev)| (id.as_str(), *rev));
        let attempt = attempt_grant(&state, &lock, mode, &session, &record, queued);
        let unknown =
            |e: &ProxyError| matches!(e, ProxyError::Store(e) if unsettled::unknown_outcome(e));
        unsettled::owned_write(&state, &session, pending, attempt, unknown)
            .await
            .unwrap_or_else(|| Err(gone(&state, &session.id)))
    });
    let outcome = attempt
        .await
        .map_err(|e| ProxyError::Internal(format!("grant attempt failed: {e}")))?;
    if let Err(ProxyError::Store(CellError::CellChanged { reason })) = &outcome {
        caller.cell_changed(reason);
    }
    outcome
}

/// The transaction of one grant attempt, and the grant recorded in the session.
async fn attempt_grant(
    state: &Arc<ProxyState>,
    lock: &LockName,
    mode: Mode,
    session: &Session,
    record: &HolderRecord,
    queued: Option<(&str, i64)>,
) -> Result<Option<Granted>, ProxyError> {
    // Waiters already in line when the cell was found changed grant nothing more.
    if let Some(reason) = state.cell.changed() {
        return Err(CellError::CellChanged {
            reason: reason.to_owned(),
        }
        .into());
    }
    let seen = state.cell.seen();
    let (revision, fresh, epoch) = match state.routes.serve(lock.as_str()) {
        Ok(served) => {
            let outcome = state
                .locklog
                .acquire(
                    lock,
                    mode,
                    session.lease,
                    record,
                    queued,
                    served.map_revision,
                )
                .await?;
            match outcome {
                Acquired::Granted { revision, fresh } => (revision, fresh, served.epoch),
                Acquired::Busy { seen_at } => {
                    state.cell.saw(seen_at);
                    return Ok(None);
                }
            }
        }
        // No new grant here now (the name is moving, or served elsewhere); but a grant
        // this call made earlier (its reply lost) is this session's hold all the same:
        // recorded, so the session lets go of it (a move waits for it).
        Err(refused) => {
            let Some(epoch) = state.routes.paused_here(lock.as_str()) else {
                return Err(refused);
            };
            match state
                .locklog
                .held_by(lock, mode, &session.id, session.lease)
                .await?
            {
                Some(held)
                    if held.record.call == record.call
                        && held.record.election == record.election =>
                {
                    (held.revision, false, epoch)
                }
                _ => return Err(refused),
            }
        }
    };
    if fresh {
        if let Err(e) = state.cell.check_grant(revision, seen) {
            // Made in a store that is not the one this proxy knew: take it back.
            state.cleanup.push(
                session.lease,
                vec![Grant::hold(lock, mode, &session.id, revision)],
            );
            return Err(e.into());
        }
    }
    if *state.shutdown.borrow() {
        // The proxy's leases are about to be revoked with every key on them.
        return Err(ProxyError::ShuttingDown);
    }
    let now = Instant::now();
    // Never past the session's own end: the client counts this validity from its
    // request, and the session may expire a TTL after its last renewal, which can be
    // most of a TTL before this grant. (A grant does not renew the session.)
    let valid_for = state.leases.valid_for(
        session.bucket,
        session.lease,
        session.lapses_at().saturating_duration_since(now),
        now,
    );
    let hold = Grant::hold(lock, mode, &session.id, revision).with_value_bytes(record.value.len());
    if !state.sessions.record_grant(
        &session.id,
        session.incarnation,
        hold.clone(),
        Some(now + valid_for),
    ) {
        // The session ended while the grant was in flight: undo it.
        state.cleanup.push(session.lease, vec![hold]);
        return Err(gone(state, &session.id));
    }
    Ok(Some(Granted {
        revision,
        epoch,
        valid_for,
        fresh,
    }))
}

/// When the session holds `call`'s lock here (in either mode, this call's grant or
/// another's), the grant transaction decides at once, never a wait in line behind the
/// session's own hold: this call's grant comes back; another call is refused
/// ([`CellError::AlreadyHeld`]). Checked as a call starts and at each turn of its wait
/// (another call of the session may be granted meanwhile). `None`: no hold here, or it
/// went meanwhile; wait as usual.
async fn decided_by_own_hold(
    state: &Arc<ProxyState>,
    call: &Call,
    session: &Session,
) -> Result<Option<Granted>, ProxyError> {
    if !session
        .held
        .iter()
        .any(|g| !g.waiter && g.lock == call.lock)
    {
        return Ok(None);
    }
    grant(state, call, session, None).await
}

/// The grant this call already has on the lock, recorded again: for a retried call,
/// and for a grant attempt that failed midway but was applied. Another call of the
/// session holding it is refused ([`CellError::AlreadyHeld`]).
async fn own_grant(
    state: &Arc<ProxyState>,
    call: &Call,
    session: &Session,
) -> Result<Option<Granted>, ProxyError> {
    let other = call.mode.other();
    let held_other = state
        .locklog
        .held_by(&call.lock, other, &call.session_id, session.lease)
        .await?;
    if let Some(held) = held_other {
        // A call never changes mode: whatever call holds the lock in the other mode,
        // this one is a second hold.
        return Err(CellError::AlreadyHeld {
            lock: call.lock.as_str().to_owned(),
            mode: other,
            revision: held.revision,
        }
        .into());
    }
    let held = state
        .locklog
        .held_by(&call.lock, call.mode, &call.session_id, session.lease)
        .await?;
    match held {
        Some(held) if held.record.call == call.call_id && held.record.election == call.election => {
            grant(state, call, session, None).await
        }
        Some(held) => Err(CellError::AlreadyHeld {
            lock: call.lock.as_str().to_owned(),
            mode: call.mode,
            revision: held.revision,
        }
        .into()),
        None => Ok(None),
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
            tokio::time::sleep_until(g).await;
            false
        }
        _ => {
            tokio::time::sleep_until(until).await;
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
