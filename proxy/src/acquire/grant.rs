//! A grant attempt, run to completion whatever the caller does, and a call's own hold
//! found again.

use super::*;

/// One grant attempt, run to completion even if the caller hangs up meanwhile, so a
/// grant etcd made is always recorded in the session (or undone).
///
/// The hold is recorded as unsettled before the transaction goes out: if etcd's answer
/// never comes, the key it may have written is still the session's (read back now, and
/// deleted when the session ends), never a key nobody owns.
pub(super) async fn grant(
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
    // A withdrawal of the call waits for this attempt to end.
    let running = caller.calls.part(&call.session_id, &call.call_id);
    let attempt = tokio::spawn(timing::measured(async move {
        let _running = running;
        metrics::counter!(m::GRANT_ATTEMPTS).increment(1);
        let pending = Grant::unsettled_hold(&lock, mode, &session.id, &record.call)
            .with_value_bytes(record.value.len());
        let queued = queued.as_ref().map(|(id, rev)| (id.as_str(), *rev));
        let attempt = attempt_grant(&state, &lock, mode, &session, &record, queued);
        let unknown =
            |e: &ProxyError| matches!(e, ProxyError::Store(e) if unsettled::unknown_outcome(e));
        unsettled::owned_write(state.owners(), &session, pending, attempt, unknown)
            .await
            .unwrap_or_else(|| Err(gone(&state, &session.id)))
    }));
    let (outcome, outside) = attempt
        .await
        .map_err(|e| ProxyError::Internal(format!("grant attempt failed: {e}")))?;
    timing::add_outside(outside);
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
    let Some((revision, fresh, epoch)) =
        grant_txn(state, lock, mode, session, record, queued).await?
    else {
        return Ok(None);
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
        if inside_lock_delay(state, lock, revision).await {
            take_back(state, lock, mode, session, revision).await;
            return Ok(None);
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

/// Whether a fresh grant of `lock` at `revision` fell inside the lock's lock-delay.
/// The check before the attempt knew of vanished holders only as far as this proxy had
/// followed the lock log, so a holder that vanished just before the attempt (its
/// session expired here, or its proxy's lease ran out) can have been missed. Once the
/// log is followed through the grant, every earlier vanishing is known. A log not
/// followed that far within etcd's timeout counts as inside the delay.
async fn inside_lock_delay(state: &ProxyState, lock: &LockName, revision: i64) -> bool {
    let delay = state.classes.current().class_for(lock.as_str()).lock_delay;
    if delay.is_zero() {
        return false;
    }
    let followed = timing::waiting(
        state
            .events
            .lock_log_through(revision, state.config.etcd_timeout),
    )
    .await;
    !followed || state.events.delayed_until(lock, delay).is_some()
}

/// Takes back a grant made inside its lock-delay, which no caller has seen: released as
/// a holder releases (a clean release starts no delay of its own), or, if etcd does not
/// answer, deleted by the clean-up.
async fn take_back(
    state: &ProxyState,
    lock: &LockName,
    mode: Mode,
    session: &Session,
    revision: i64,
) {
    metrics::counter!(m::GRANTS_TAKEN_BACK).increment(1);
    match state
        .locklog
        .release(lock, mode, &session.id, revision, session.lease)
        .await
    {
        Ok(Some(marker)) => state.cleanup.push(session.lease, vec![marker]),
        Ok(None) => {}
        Err(_) => state.cleanup.push(
            session.lease,
            vec![Grant::hold(lock, mode, &session.id, revision)],
        ),
    }
}

/// The grant transaction of one attempt: `Some((revision, fresh, epoch))` when the
/// lock is this session's, `None` when it is busy.
async fn grant_txn(
    state: &Arc<ProxyState>,
    lock: &LockName,
    mode: Mode,
    session: &Session,
    record: &HolderRecord,
    queued: Option<(&str, i64)>,
) -> Result<Option<(i64, bool, u64)>, ProxyError> {
    Ok(Some(match state.routes.serve(lock.as_str()) {
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
    }))
}

/// When the session holds `call`'s lock here (in either mode, this call's grant or
/// another's), the grant transaction decides at once, never a wait in line behind the
/// session's own hold: this call's grant comes back; another call is refused
/// ([`CellError::AlreadyHeld`]). Checked as a call starts and at each turn of its wait
/// (another call of the session may be granted meanwhile). `None`: no hold here, or it
/// went meanwhile; wait as usual.
pub(super) async fn decided_by_own_hold(
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
pub(super) async fn own_grant(
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
