//! Sessions moving between proxies (docs/design.md §6): taking a session over from
//! another proxy (Resume), telling clients when to move, and draining before a stop.
//!
//! A resumed session keeps its id. Its keys move onto this proxy's lease in
//! transactions guarded by "create revision unchanged and lease == the lease the client
//! last held them on", so fencing tokens do not change and a key that was lost meanwhile
//! (its old proxy expired the session, etcd revoked the old lease, the lock was granted
//! again) is never taken back: it is reported lost instead.

use std::sync::Arc;
use std::time::Duration;

use lockcell_cell::keyspace::{self, LockName};
use lockcell_cell::locklog::{Grant, Moved, Resume, NOT_ITS_OWN};
use lockcell_proto::v1::{HeldKey, HeldKind, LostKey, ResumeRequest, ResumeResponse};
use tokio::time::Instant;

use crate::access::Right;
use crate::core::moving::{check_session_id, refusal, Landed, Plan};
use crate::errors::ProxyError;
use crate::metrics as m;
use crate::sessions::Session;
use crate::state::ProxyState;
use crate::wire::millis;

pub use crate::core::moving::MAX_RESUME_KEYS;
#[cfg(test)]
mod over_memory;

/// Share of the drain timeout over which a draining proxy spreads its requests to move,
/// so its clients' resumes reach etcd as a stream rather than all at once.
const DRAIN_SPREAD: f64 = 0.6;

/// Why a session should move to another proxy now, if it should: the proxy is draining
/// and the turn of the keep-alive stream renewing it has come (each stream, one per
/// client, draws a turn in [0, 1); turns are spread over part of the drain timeout, as
/// a client moves all its sessions at once), or its lease is overdue for renewal (etcd
/// unreachable: `left`, the validity the lease can still back, is shrinking towards
/// zero).
pub fn move_hint(
    state: &ProxyState,
    turn: f64,
    left: Duration,
    now: Instant,
) -> Option<&'static str> {
    if state.is_draining() {
        let spread = state.config.drain_timeout.as_secs_f64() * DRAIN_SPREAD;
        let elapsed = state
            .drain_started
            .get()
            .map_or(0.0, |at| now.saturating_duration_since(*at).as_secs_f64());
        return (elapsed >= spread * turn)
            .then_some("this proxy is draining; resume the session on another proxy");
    }
    lease_trouble(state, left)
        .then_some("this proxy cannot renew its etcd lease; resume the session on another proxy")
}

/// Whether a lease that can still back `left` of validity
/// ([`LeaseBook::left`](crate::leases::LeaseBook::left)) is overdue for renewal.
pub(crate) fn lease_trouble(state: &ProxyState, left: Duration) -> bool {
    let config = &state.config;
    // A lease renewed on time has at least `lease_ttl - renew_interval` left; two
    // renewals missed (or half the TTL, if the interval is long) is trouble.
    let trouble = config
        .lease_ttl
        .saturating_sub(2 * config.renew_interval())
        .min(config.lease_ttl / 2);
    left + config.validity_margin < trouble
}

/// Takes over `req`'s session: records it here, moves its keys onto this proxy's lease
/// (fenced, see [`LockLog::resume`](lockcell_cell::locklog::LockLog::resume)), and
/// grants it validity as an Open would. Keys that did not move are reported lost.
///
/// The session is recorded before its keys move, so that if etcd fails midway (some
/// keys moved, the reply lost) the keys that did move are still deleted when the
/// session ends here, rather than left on this proxy's lease for good.
///
/// Every refusal before a key moves is FAILED_PRECONDITION (draining, no lease, a lease
/// in trouble, the cover rule, a fence moved on), so the client knows nothing moved; an
/// etcd failure during the move is UNAVAILABLE, and its outcome unknown.
/// `principal`: the caller's identity when the proxy checks prefix grants.
pub async fn resume(
    state: &ProxyState,
    req: ResumeRequest,
    principal: Option<String>,
) -> Result<ResumeResponse, ProxyError> {
    let started = Instant::now();
    let result = resume_stay(state, req, principal).await;
    record_resume(started, result.is_ok());
    result
}

/// Counts one session's resume (in every cell it has a stay in) begun at `started`.
pub fn record_resume(started: Instant, ok: bool) {
    let outcome = if ok { "ok" } else { "refused" };
    metrics::histogram!(m::RESUME_SECONDS, "outcome" => outcome)
        .record(started.elapsed().as_secs_f64());
    if ok {
        metrics::counter!(m::SESSIONS_RESUMED).increment(1);
    }
}

/// [`resume`] of one cell's stay of a session, unrecorded: a proxy of several cells
/// records the whole resume itself ([`record_resume`]). Checks the caller and the keys
/// it may bring, then moves the session ([`resume_named`]).
pub async fn resume_stay(
    state: &ProxyState,
    mut req: ResumeRequest,
    principal: Option<String>,
) -> Result<ResumeResponse, ProxyError> {
    // Only the session's opener may move it: its secret and identity, checked here on
    // whatever proxy the resume reaches (a proxy that never saw the session included).
    crate::credential::check(&req.session_id, &req.session_secret, principal.as_deref())
        .map_err(|refused| ProxyError::PermissionDenied(refused.message().to_owned()))?;
    crate::credential::check_label(&req.identity)?;
    // Keys of another epoch move nowhere: after a restore from backup their revisions
    // may be other grants' now. Keys the caller's grants do not cover move nowhere
    // either. The session resumes without them.
    let mut stale = Vec::new();
    if req.epoch != 0 && req.epoch != state.epoch() {
        let reason = format!(
            "the cell's epoch is {} now, not {} when the session got it (the cell was restored from a backup)",
            state.epoch(),
            req.epoch
        );
        stale.extend(
            std::mem::take(&mut req.keys)
                .into_iter()
                .map(|key| LostKey {
                    key: Some(key),
                    reason: reason.clone(),
                }),
        );
    }
    if let Some(caller) = &principal {
        let grants = state.grants.current();
        let (kept, refused): (Vec<HeldKey>, Vec<HeldKey>) =
            std::mem::take(&mut req.keys).into_iter().partition(|key| {
                let right = if key.kind == HeldKind::Ephemeral as i32 {
                    Right::Write
                } else {
                    Right::Lock
                };
                grants.check(caller, right, &key.name).is_ok()
            });
        req.keys = kept;
        stale.extend(refused.into_iter().map(|key| LostKey {
            reason: format!("{caller:?} has no grant on {:?}", key.name),
            key: Some(key),
        }));
    }
    let mut reply = resume_named(state, req, principal).await?;
    metrics::counter!(m::KEYS_LOST_ON_RESUME).increment(stale.len() as u64);
    reply.lost.extend(stale);
    Ok(reply)
}

/// The stay a Resume opens here, holding `held` on `(bucket, lease)`: valid never
/// before the client's old deadline, as the keys moved here are what it acts on.
fn arriving(
    req: &ResumeRequest,
    id: &Arc<str>,
    principal: Option<String>,
    ttl: Duration,
    on: (usize, i64),
    held: Vec<Grant>,
) -> Session {
    let now = Instant::now();
    let acting_until = now + Duration::from_millis(req.acting_for_ms);
    let mut session = Session::arriving(
        id.clone(),
        crate::credential::labelled(principal.as_deref(), req.identity.clone()),
        ttl,
        on,
        held,
        now,
        acting_until,
    );
    session.principal = principal.map(Into::into);
    session
}

async fn resume_named(
    state: &ProxyState,
    req: ResumeRequest,
    principal: Option<String>,
) -> Result<ResumeResponse, ProxyError> {
    if state.is_draining() {
        return Err(ProxyError::Refused(
            "this proxy is draining; resume the session on another proxy".into(),
        ));
    }
    let session_name = check_session_id(&req.session_id)?;
    let mut plan = Plan::new(&req.session_id, &req.keys, req.from_lease_id)?;
    not_anothers(state, &req.session_id, &mut plan.moving).await?;
    let ttl = state
        .config
        .session_ttl_for(Duration::from_millis(req.ttl_ms));
    let (bucket, lease) = lease_for(state, &req.session_id, req.acting_for_ms).await?;
    let id: Arc<str> = req.session_id.as_str().into();
    let session = arriving(&req, &id, principal, ttl, (bucket, lease), plan.held());
    let incarnation = session.incarnation;
    let earlier = state.sessions.replace(session);
    state.publish_sessions_open();
    let resumed = state
        .locklog
        .resume(
            &session_name,
            req.fence_revision,
            &plan.moving,
            lease,
            &state.proxy_id,
        )
        .await;
    let refused = match resumed {
        Ok(Resume::Moved {
            fence,
            fence_revision,
            outcomes,
        }) => {
            return resumed_here(
                state,
                Arrived {
                    id,
                    incarnation,
                    ttl,
                    lease,
                    fence,
                    fence_revision,
                },
                req.keys,
                &plan,
                &outcomes,
                earlier,
            );
        }
        Ok(refused) => refusal(&req.session_id, refused),
        // Unknown whether keys moved: the stay stays, to clean up what did. What the
        // earlier stay had that the client did not name moved nowhere and is no stay's.
        Err(source) => {
            let_go(state, earlier, &plan, &session_name);
            return Err(ProxyError::StoreDuring {
                context: format!("resuming session {:?}", req.session_id),
                source,
            });
        }
    };
    // Nothing moved: the stay that was here (if any) is here again, unless a newer
    // resume of the session took this one's place meanwhile. That resume's stay is the
    // session's now, and the earlier one is gone as after a move.
    if forget(state, &id, incarnation, bucket) {
        if let Some(earlier) = earlier {
            state.sessions.replace(earlier);
        }
    } else {
        let_go(state, earlier, &plan, &session_name);
    }
    Err(refused)
}

/// Lets go of the stay a resume took the place of, when the resume's move may not have
/// named all it had: what the client did not name is deleted under that stay's lease
/// ([`Plan::unnamed`]).
fn let_go(state: &ProxyState, earlier: Option<Session>, plan: &Plan, session: &LockName) {
    if let Some(earlier) = earlier {
        state.leases.unassign(earlier.bucket);
        let fence = keyspace::session_fence_key(session.as_str());
        state
            .cleanup
            .push(earlier.lease, plan.unnamed(earlier.held, &fence));
    }
}

/// The lease a session resuming here moves onto: never one another stay of the session
/// uses or used here (a delete still pending for that stay, guarded by its lease, could
/// otherwise reach the keys moved now), from a proxy that can renew it, and covering what
/// the client may still do on its previous proxy's word ([`cover`]).
async fn lease_for(
    state: &ProxyState,
    session: &str,
    acting_for_ms: u64,
) -> Result<(usize, i64), ProxyError> {
    let avoid = state.sessions.stay_leases(session);
    let (bucket, lease) = state.leases.assign_avoiding(&avoid).ok_or_else(|| {
        ProxyError::Refused(
            "this proxy holds no etcd lease this session may use right now; resume elsewhere"
                .into(),
        )
    })?;
    // A proxy that cannot renew its own lease would only add writes to a struggling
    // etcd (a whole fleet moving at once): it takes no one in.
    if state.is_draining() || lease_trouble(state, state.leases.left(bucket, lease, Instant::now()))
    {
        state.leases.unassign(bucket);
        return Err(ProxyError::Refused(
            "this proxy cannot renew its etcd lease either (or is draining); resume elsewhere"
                .into(),
        ));
    }
    if let Err(e) = cover(state, bucket, lease, acting_for_ms).await {
        state.leases.unassign(bucket);
        return Err(e);
    }
    Ok((bucket, lease))
}

/// Marks every exclusive holder key among `moving` that is not proven `session`'s own
/// ([`NOT_ITS_OWN`]: it is read, never moved, and reported lost). The exclusive key of a
/// lock is every session's; a resume naming another's grant (its revision is public:
/// Leader and CheckSequencer show it) must not move it, or a close of the resumed
/// session would end another session's hold. So the key must exist now, at the revision
/// named, with a record naming this session: a key granted later at that revision (to
/// whoever waits) is not moved either. A shared holder key is named by its session, and
/// a moved key keeps its record, so this read is enough: the move compares the create
/// revision, which no other grant can have.
async fn not_anothers(
    state: &ProxyState,
    session: &str,
    moving: &mut [(Grant, i64)],
) -> Result<(), ProxyError> {
    for (grant, from) in moving.iter_mut() {
        if grant.waiter || grant.key != grant.lock.exclusive_key() {
            continue;
        }
        let (holder, _) = state
            .locklog
            .exclusive_holder(&grant.lock)
            .await
            .map_err(|source| ProxyError::StoreDuring {
                context: format!("reading the holder of lock {:?}", grant.lock.as_str()),
                source,
            })?;
        if !holder.is_some_and(|h| h.revision == grant.revision && h.record.session == session) {
            *from = NOT_ITS_OWN;
        }
    }
    Ok(())
}

/// A stay whose keys moved here.
struct Arrived {
    id: Arc<str>,
    incarnation: u64,
    ttl: Duration,
    lease: i64,
    fence: Grant,
    fence_revision: i64,
}

/// Completes a resume whose keys moved: records the fence, reports what did not move,
/// cleans up after an earlier stay here, and grants validity as an Open does. From here
/// on keys have moved, so any failure is UNAVAILABLE (outcome unknown to the client).
fn resumed_here(
    state: &ProxyState,
    here: Arrived,
    keys: Vec<HeldKey>,
    plan: &Plan,
    outcomes: &[Moved],
    earlier: Option<Session>,
) -> Result<ResumeResponse, ProxyError> {
    let Arrived {
        id,
        incarnation,
        ttl,
        lease,
        fence,
        fence_revision,
    } = here;
    if let Some(earlier) = earlier {
        state.leases.unassign(earlier.bucket);
        let behind = plan.left_behind(earlier.held, outcomes, &fence.key);
        state.cleanup.push(earlier.lease, behind);
    }
    let unknown_outcome = |what: &str| {
        ProxyError::EtcdUnavailable(format!(
            "session {id:?} moved here, but {what}; resume it again"
        ))
    };
    if !state.sessions.record_grant(&id, incarnation, fence, None) {
        return Err(unknown_outcome("its stay ended meanwhile"));
    }
    let Landed {
        lost,
        forget,
        rewritten,
    } = plan.landed(keys, outcomes, lease);
    for grant in &forget {
        state.sessions.forget_grant(&id, &grant.key, grant.revision);
    }
    let mut told = Vec::with_capacity(rewritten.len());
    for (record, key) in rewritten {
        if !state.sessions.record_grant(&id, incarnation, record, None) {
            return Err(unknown_outcome("its stay ended meanwhile"));
        }
        told.push(key);
    }
    let named = plan.named.len();
    metrics::counter!(m::KEYS_MOVED).increment((named - lost.len()) as u64);
    metrics::counter!(m::KEYS_LOST_ON_RESUME).increment(lost.len() as u64);
    // Counted from now, as for an Open: the session was renewed when it was recorded.
    let now = Instant::now();
    let renewed =
        |r: crate::sessions::Renewed| state.leases.valid_for(r.bucket, r.lease, r.ttl, now);
    let valid_for = state
        .sessions
        .renew(&id, None, now, renewed)
        .map_err(|_| unknown_outcome("its stay expired meanwhile"))?;
    tracing::info!(
        session.id = %id,
        lease = format_args!("{lease:x}"),
        fence_revision,
        moved = named - lost.len(),
        lost = lost.len(),
        "session resumed here"
    );
    Ok(ResumeResponse {
        ttl_ms: millis(ttl),
        valid_for_ms: millis(valid_for),
        proxy_id: state.proxy_id.clone(),
        lease_id: lease,
        lost,
        incarnation,
        fence_revision,
        epoch: state.epoch(),
        cells: Vec::new(),
        moved: told,
    })
}

/// Drops the stay a refused resume recorded (nothing moved onto its lease). False if
/// it was no longer there: another stay of the session took its place.
fn forget(state: &ProxyState, id: &str, incarnation: u64, bucket: usize) -> bool {
    if state.sessions.withdraw(id, incarnation).is_none() {
        return false;
    }
    state.leases.unassign(bucket);
    state.publish_sessions_open();
    true
}

/// Makes sure the lease the keys move onto outlives what the client may still do on its
/// previous proxy's word (`acting_for_ms` from its send, which was before now): renews
/// the lease at once if its lower bound is too close, and refuses if that fails.
pub(crate) async fn cover(
    state: &ProxyState,
    bucket: usize,
    lease: i64,
    acting_for_ms: u64,
) -> Result<(), ProxyError> {
    let needed = Duration::from_millis(acting_for_ms);
    let covered = || state.leases.left(bucket, lease, Instant::now()) >= needed;
    if covered() {
        return Ok(());
    }
    // One renewal at a time per bucket: the resumes waiting for it look again after.
    let _renewing = state.renewing[bucket].lock().await;
    if covered() || (crate::lease_keeper::renew_now(state, bucket, lease).await && covered()) {
        return Ok(());
    }
    Err(ProxyError::Refused(format!(
        "this proxy's lease cannot outlive the {needed:?} the client may still act on its \
         previous proxy's word; resume elsewhere, or here later"
    )))
}

/// Waits until every session has left (its client resumed it elsewhere and closed it
/// here) or the drain timeout has passed. Returns how many sessions stayed.
pub async fn drain(state: &ProxyState) -> usize {
    let timeout = state.config.drain_timeout;
    tracing::info!(
        sessions = state.sessions.len(),
        timeout = ?timeout,
        "draining: asking clients to resume their sessions on other proxies"
    );
    let _ = state.drain_started.set(Instant::now());
    let give_up = Instant::now() + timeout;
    if let Some(handed_off) = state.handed_off.get() {
        let mut handed_off = handed_off.clone();
        let written = tokio::time::timeout_at(give_up, handed_off.wait_for(|done| *done));
        if written.await.is_err() {
            tracing::warn!("the etcd API's leases were not handed over within the drain timeout");
        }
    }
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    // Sessions handed off (etcd API leases) wait in etcd for whichever proxy their
    // clients reach next, on a lease this proxy leaves to run out rather than revoke.
    while state.sessions.staying() > 0 && Instant::now() < give_up {
        tick.tick().await;
    }
    let stayed = state.sessions.staying();
    if stayed > 0 {
        tracing::warn!(stayed, "drain timeout passed with sessions still here");
    } else {
        tracing::info!("drained: every session moved");
    }
    stayed
}
