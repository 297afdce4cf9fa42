//! Taking over a lease another proxy handed off: its keys move onto this proxy's lease,
//! and its session opens here.

use super::*;

impl EtcdApi {
    /// Takes lease `id` over from the proxy that handed it over, for `caller`, if a
    /// record of it is there and the caller owns it. Calls for one lease take turns, so
    /// a keepalive and a put arriving together take it once.
    pub(in crate::etcd_api) async fn take_over(
        &self,
        id: i64,
        caller: Option<&str>,
    ) -> Result<TakeOver, Status> {
        let _turn = self.taking.take(id).await;
        self.take_over_now(id, caller).await
    }

    pub(in crate::etcd_api) async fn take_over_now(
        &self,
        id: i64,
        caller: Option<&str>,
    ) -> Result<TakeOver, Status> {
        let state = &self.state;
        let session_id = session_of(id);
        if let Ok(here) = state.sessions.get(&session_id, Instant::now()) {
            // Taken by the call before this one.
            return Ok(TakeOver::Taken(here));
        }
        let key = keyspace::etcd_lease_handoff_key(id);
        let Some((record, revision, left)) = self.record_to_take(&key, caller).await? else {
            return Ok(TakeOver::NoRecord);
        };
        let (bucket, lease) = self
            .lease_to_take_on(&session_id, record.acting_for_ms)
            .await?;
        let moving = record.moving();
        let incarnation = arrive(state, &session_id, &record, &moving, (bucket, lease), left);
        let name = LockName::parse(&session_id).expect("16 hex digits name a lock");
        let resumed = state
            .locklog
            .resume_guarded(
                &name,
                record.fence,
                &moving,
                lease,
                &state.proxy_id,
                Some((key.as_str(), revision)),
            )
            .await;
        let (fence, fence_revision, outcomes) = match resumed {
            Ok(Resume::Moved {
                fence,
                fence_revision,
                outcomes,
            }) => (fence, fence_revision, outcomes),
            // Taken by another proxy, or withdrawn by the handing one: nothing moved.
            Ok(_) => {
                self.forget_stay(&session_id, incarnation, bucket);
                return Ok(TakeOver::NoRecord);
            }
            // Unknown whether the keys moved: the stay stays, to clean up what did.
            Err(source) => {
                state.sessions.keep(&session_id);
                return Err(crate::errors::ProxyError::StoreDuring {
                    context: format!("taking lease {id:x} over"),
                    source,
                }
                .into());
            }
        };
        let fence = (fence, fence_revision);
        let kept = self.arrived(id, (incarnation, lease), &moving, &outcomes, fence)?;
        metrics::counter!(m::SESSIONS_RESUMED).increment(1);
        metrics::counter!(m::KEYS_MOVED).increment(kept as u64);
        state.publish_sessions_open();
        tracing::info!(
            lease = format_args!("{id:x}"),
            from = %record.proxy,
            keys = kept,
            lost = moving.len() - kept,
            "etcd API lease taken over"
        );
        state
            .sessions
            .get(&session_id, Instant::now())
            .map(TakeOver::Taken)
            .map_err(|_| Status::not_found(LEASE_NOT_FOUND))
    }

    /// Completes the arrival of lease `id`'s stay `incarnation` on proxy lease `lease`
    /// once the keys `moving` moved (`outcomes`) with the session fence `fence` (and
    /// its mod revision): the stay records what moved here and takes calls. Returns how
    /// many keys moved.
    fn arrived(
        &self,
        id: i64,
        (incarnation, lease): (u64, i64),
        moving: &[(Grant, i64)],
        outcomes: &[lockcell_cell::locklog::Moved],
        (fence, fence_revision): (Grant, i64),
    ) -> Result<usize, Status> {
        let state = &self.state;
        let session_id = session_of(id);
        if !state
            .sessions
            .record_grant(&session_id, incarnation, fence.clone(), None)
        {
            // The stay ended while its keys were on their way (it expired): what
            // moved here goes with it.
            let mut moved = moved_keys(moving, outcomes);
            moved.push(fence);
            state.cleanup.push(lease, moved);
            return Err(Status::not_found(LEASE_NOT_FOUND));
        }
        self.fences.insert(id, fence_revision);
        let kept = self.settle_moved(&session_id, incarnation, moving, outcomes);
        // Here now: its calls go on (see `arrive`).
        state.sessions.keep(&session_id);
        if state.is_draining() {
            // A drain began while the keys moved here: handed over as the drain's
            // others were (once the write that took it, if any, is recorded).
            let api = self.clone();
            tokio::spawn(async move {
                let written = api.hand_off(|s| lease_of(&s.id) == Some(id)).await;
                api.follow(written, None).await;
            });
        }
        Ok(kept)
    }

    /// The hand-off record at `key`, its mod revision and how long the lease has left,
    /// when `caller` may take it over now: `None` when there is none, it does not
    /// parse, it is another identity's, or it has lapsed.
    async fn record_to_take(
        &self,
        key: &str,
        caller: Option<&str>,
    ) -> Result<Option<(Record, i64, Duration)>, Status> {
        let state = &self.state;
        let got = with_timeout(
            "read a hand-off record",
            state.config.etcd_timeout,
            state.etcd.kv_client().get(key, None),
        )
        .await
        .map_err(crate::errors::ProxyError::from)?;
        let Some(kv) = got.kvs().first() else {
            return Ok(None);
        };
        let revision = kv.mod_revision();
        let record: Record = match serde_json::from_slice(kv.value()) {
            Ok(record) => record,
            Err(error) => {
                tracing::warn!(%error, key, "a hand-off record does not parse; not taken");
                return Ok(None);
            }
        };
        // Only its owner takes a lease: the same identity, or none on both sides (a
        // lease granted without grants is no identity's, and one with is not anyone's).
        let owned = record.principal.as_deref() == caller;
        let now_unix = unix_ms(SystemTime::now());
        if !owned || now_unix >= record.lapses_at_unix_ms {
            return Ok(None);
        }
        // The lease lapses here when it would have there: a take-over is no renewal.
        let left = Duration::from_millis(record.lapses_at_unix_ms - now_unix);
        Ok(Some((record, revision, left)))
    }

    /// Records in the session each key a take-over moved onto this proxy's lease (as
    /// written now), and forgets each it found deleted or rewritten; returns how many
    /// moved.
    fn settle_moved(
        &self,
        session_id: &str,
        incarnation: u64,
        moving: &[(Grant, i64)],
        outcomes: &[lockcell_cell::locklog::Moved],
    ) -> usize {
        let state = &self.state;
        let mut kept = 0;
        for ((grant, _), outcome) in moving.iter().zip(outcomes) {
            match outcome {
                Ok(written) => {
                    kept += 1;
                    let now = as_moved(grant, *written);
                    state
                        .sessions
                        .record_grant(session_id, incarnation, now, None);
                }
                // Deleted or rewritten meanwhile: no longer the lease's.
                Err(_) => state
                    .sessions
                    .forget_grant(session_id, &grant.key, grant.revision),
            }
        }
        kept
    }

    /// The proxy lease a lease taken over goes on: one that covers the `acting_for_ms`
    /// its clients may still act for, and never one an earlier stay of it here used (a
    /// delete still queued for that stay is guarded by that lease, and a moved key keeps
    /// its create revision, so the guard would match the key the new stay holds).
    async fn lease_to_take_on(
        &self,
        session_id: &str,
        acting_for_ms: u64,
    ) -> Result<(usize, i64), Status> {
        let state = &self.state;
        if state.is_draining() {
            return Err(Status::unavailable(
                "etcdserver: this proxy is shutting down; use another endpoint",
            ));
        }
        let avoid = state.sessions.stay_leases(session_id);
        let (bucket, lease) = state.leases.assign_avoiding(&avoid).ok_or_else(|| {
            Status::unavailable("etcdserver: no leader (this proxy holds no etcd lease it may use for this lease right now)")
        })?;
        if let Err(refused) = crate::handover::cover(state, bucket, lease, acting_for_ms).await {
            state.leases.unassign(bucket);
            return Err(Status::unavailable(refused.to_string()));
        }
        Ok((bucket, lease))
    }

    /// Drops a stay whose take-over moved nothing.
    pub(super) fn forget_stay(&self, id: &str, incarnation: u64, bucket: usize) {
        if self.state.sessions.withdraw(id, incarnation).is_some() {
            self.state.leases.unassign(bucket);
        }
    }
}

/// The keys of `moving` that a take-over moved, as written on the new lease.
fn moved_keys(moving: &[(Grant, i64)], outcomes: &[lockcell_cell::locklog::Moved]) -> Vec<Grant> {
    moving
        .iter()
        .zip(outcomes)
        .filter_map(|((grant, _), outcome)| Some(as_moved(grant, *outcome.as_ref().ok()?)))
        .collect()
}

/// `grant` as a move wrote it (`written`, or 0 when the move rewrote nothing).
fn as_moved(grant: &Grant, written: i64) -> Grant {
    Grant {
        written: if written != 0 { written } else { grant.written },
        ..grant.clone()
    }
}

/// Opens the session of a lease taken over here, on `(bucket, lease)`, holding the
/// keys `moving` and lapsing when it would have at the proxy that handed it off
/// (`left` from now): a take-over is no renewal. Returns its incarnation.
fn arrive(
    state: &crate::state::ProxyState,
    session_id: &str,
    record: &Record,
    moving: &[(Grant, i64)],
    (bucket, lease): (usize, i64),
    left: Duration,
) -> u64 {
    let ttl = Duration::from_millis(record.ttl_ms);
    let now = Instant::now();
    let mut session = Session::arriving(
        session_id.into(),
        record.identity.clone(),
        ttl,
        (bucket, lease),
        moving.iter().map(|(g, _)| g.clone()).collect(),
        now,
        now + Duration::from_millis(record.acting_for_ms),
    );
    session.principal = record.principal.as_deref().map(Into::into);
    session.life = session.life.clone().lapsing_in(now, left);
    // Until its keys are here it counts as on its way: its calls wait (a put on it
    // would write on a lease the take-over may yet give up), and it is renewed here
    // only once it has arrived.
    session.life.hand_off();
    let incarnation = session.incarnation;
    state.sessions.insert(session);
    incarnation
}
