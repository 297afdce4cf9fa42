//! Waiting in line in etcd, for the fair classes: the waiter key that holds a call's
//! place, the wait behind the one ahead and, at the head, for the holders.

use super::grant::own_grant;
use super::*;

/// The fair waiter's decisions, over this proxy's keys, grants and errors.
type Waiter = FairWaiter<ProxyError>;
type WaiterStep = FairStep<Vec<u8>, Granted, ProxyError>;

/// Waits in line in etcd: behind the waiter just ahead, then, at the head, for the
/// holders. What to do when is [`core::fair::FairWaiter`]'s to decide; [`FairRun`]
/// does it.
pub(super) async fn fair(
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
    let line = join_line(state, call, &session, &id, served.map_revision).await?;
    let mut run = FairRun {
        state,
        call,
        class,
        give_up,
        session,
        queued: line.waiter.revision,
        id,
        line,
        lock_changes: None,
        _waiting: m::Counted::in_gauge(m::WAITERS),
        seen_at: 0,
    };
    let mut waiter = Waiter::default();
    let mut step = waiter.start();
    loop {
        step = match step {
            FairStep::Done(outcome) => return run.finish(outcome),
            FairStep::NewTurn
            | FairStep::WaitBehind(_)
            | FairStep::CheckDelay
            | FairStep::WaitRelease
            | FairStep::Pause => run.wait(&mut waiter, step).await?,
            step => run.look(&mut waiter, step).await?,
        };
    }
}

/// What a fair wait keeps between the steps of its [`FairWaiter`]: the session as last
/// seen, its place in line, and what it watches.
struct FairRun<'a> {
    state: &'a Arc<ProxyState>,
    call: &'a Call,
    class: &'a LockClass,
    give_up: Option<Instant>,
    session: Session,
    /// The waiter key's id and create revision (its place).
    id: String,
    queued: i64,
    /// The lock's changes, watched from a head turn's first read on, and the revision
    /// of the last read.
    lock_changes: Option<crate::events::Subscription<LockName>>,
    seen_at: i64,
    /// Counted in `lockcell_waiters` while it waits. Fields drop in this order: the
    /// watch, the count, then the place in line.
    _waiting: m::Counted,
    line: LeaveLine,
}

impl FairRun<'_> {
    fn fault(&self, e: ProxyError) -> Fault<ProxyError> {
        fault(e, &self.call.lock)
    }

    /// Does a step that reads or writes etcd, and tells `waiter` what came of it.
    async fn look(
        &mut self,
        waiter: &mut Waiter,
        step: WaiterStep,
    ) -> Result<WaiterStep, ProxyError> {
        let (state, call) = (self.state, self.call);
        Ok(match step {
            FairStep::Refresh => {
                self.session = live(state, &call.session_id)?;
                self.lock_changes = None;
                let own = decided_by_own_hold(state, call, &self.session).await;
                waiter.refreshed(own.map_err(|e| self.fault(e)))
            }
            FairStep::ReadPlace => {
                let place = state
                    .locklog
                    .place(&call.lock, call.mode, self.queued)
                    .await;
                waiter.placed(
                    place
                        .map(|place| match place {
                            Place::Behind { predecessor, .. } => Some(predecessor),
                            Place::Head { .. } => None,
                        })
                        .map_err(|e| self.fault(e.into())),
                )
            }
            FairStep::ReadHeld => {
                self.lock_changes
                    .get_or_insert_with(|| state.events.subscribe_lock(&call.lock));
                let held = state.locklog.is_held(&call.lock, call.mode).await;
                if let Ok((_, at)) = held {
                    self.seen_at = at;
                }
                waiter.held(held.map(|(held, _)| held).map_err(|e| self.fault(e.into())))
            }
            FairStep::TryGrant => {
                let reply = grant(state, call, &self.session, Some((&self.id, self.queued))).await;
                waiter.granted(reply.map_err(|e| self.fault(e)))
            }
            // Free, yet not granted: someone got in first, or this waiter's key is no
            // longer here (its session moved, and the key with it).
            FairStep::CheckInLine => {
                let here = state
                    .locklog
                    .in_line(
                        &call.lock,
                        call.mode,
                        &self.id,
                        self.queued,
                        self.session.lease,
                    )
                    .await;
                waiter.in_line(here.map_err(|e| self.fault(e.into())))
            }
            // A grant attempt that failed midway may have been applied: the lock is
            // then this session's own, and no turn in line would ever find it free.
            FairStep::Recover => {
                self.session = live(state, &call.session_id)?;
                waiter.recovered(own_grant(state, call, &self.session).await)
            }
            _ => unreachable!("a wait step is not a look"),
        })
    }

    /// Does a step that waits (for a change, a turn, the lock-delay or a pause), and
    /// tells `waiter` how it ended.
    async fn wait(
        &mut self,
        waiter: &mut Waiter,
        step: WaiterStep,
    ) -> Result<WaiterStep, ProxyError> {
        let (state, call, give_up) = (self.state, self.call, self.give_up);
        Ok(match step {
            FairStep::NewTurn => match give_up {
                Some(g) if Instant::now() >= g => waiter.time_up(),
                _ => FairStep::Refresh,
            },
            FairStep::WaitBehind(predecessor) => {
                let waited = wait_behind(
                    state,
                    call,
                    &self.session,
                    give_up,
                    self.queued,
                    &predecessor,
                )
                .await;
                if let Ok(Some(true)) = waited {
                    self.line.woken = Some(Instant::now());
                }
                waiter.behind(waited.map(|w| w.is_some()).map_err(|e| self.fault(e)))
            }
            FairStep::CheckDelay => {
                let delayed = match state
                    .events
                    .delayed_until(&call.lock, self.class.lock_delay)
                {
                    Some(until) => Some(sleep_until(until, give_up).await),
                    None => None,
                };
                waiter.delay(delayed)
            }
            FairStep::WaitRelease => {
                self.session = live(state, &call.session_id)?;
                match wait_budget(&self.session, give_up) {
                    None => waiter.out_of_time(),
                    Some(wait) => {
                        let changes = self.lock_changes.as_mut().expect("watched since the read");
                        if timing::waiting(changes.changed_after(self.seen_at, wait)).await {
                            self.line.woken = Some(Instant::now());
                        }
                        waiter.waited()
                    }
                }
            }
            FairStep::Pause => match wait_budget(&self.session, give_up) {
                None => waiter.out_of_time(),
                Some(pause) => {
                    timing::waiting(tokio::time::sleep(pause.min(RETRY_PAUSE))).await;
                    waiter.paused()
                }
            },
            _ => unreachable!("a look step is not a wait"),
        })
    }

    /// The wait's end: out of line (by the grant's own transaction, or by the line's
    /// guard as it drops).
    fn finish(
        mut self,
        outcome: FairOutcome<Granted, ProxyError>,
    ) -> Result<Option<Granted>, ProxyError> {
        match outcome {
            FairOutcome::Granted(granted) => {
                self.line.left();
                handed_over(self.line.woken, "fair");
                Ok(Some(granted))
            }
            FairOutcome::Held(granted) => Ok(Some(granted)),
            FairOutcome::TimedOut => Ok(None),
            FairOutcome::LostPlace => Err(ProxyError::Refused(format!(
                "this acquire of lock {:?} lost its place in line here: its session \
                 moved to another proxy, where the acquire goes on",
                self.call.lock.as_str()
            ))),
            FairOutcome::Failed(e) => Err(e),
        }
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
        again == predecessor && timing::waiting(sub.changed_after(seen_at, patience)).await,
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
    let joining = tokio::spawn(timing::measured(async move {
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
    }));
    let (joined, outside) = joining
        .await
        .map_err(|e| ProxyError::Internal(format!("joining the line failed: {e}")))?;
    timing::add_outside(outside);
    joined
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
