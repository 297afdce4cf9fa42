//! The Lock service: exclusive acquire (waiting) and release, through the lock log.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockcell_cell::locklog::{Acquired, HolderRecord};
use lockcell_cell::LockName;
use lockcell_proto::v1::lock_server::Lock as LockApi;
use lockcell_proto::v1::{AcquireRequest, AcquireResponse, ReleaseRequest, ReleaseResponse};
use lockcell_proto::FencingToken;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::millis;
use crate::errors::ProxyError;
use crate::metrics as m;
use crate::state::ProxyState;

/// A waiter retries on this period even without a release event, so a missed watch
/// event delays a grant by at most this much.
const POLL: Duration = Duration::from_secs(1);

pub struct LockService {
    pub state: Arc<ProxyState>,
}

#[tonic::async_trait]
impl LockApi for LockService {
    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id, lock.name = %request.get_ref().lock))]
    async fn acquire(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        let req = request.into_inner();
        Ok(Response::new(acquire(&self.state, req).await?))
    }

    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id, lock.name = %request.get_ref().lock))]
    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let req = request.into_inner();
        Ok(Response::new(release(&self.state, req).await?))
    }
}

async fn acquire(state: &ProxyState, req: AcquireRequest) -> Result<AcquireResponse, ProxyError> {
    let started = Instant::now();
    let lock = LockName::parse(&req.lock)?;
    let id = req.session_id;
    let session = state
        .sessions
        .get(&id, started)
        .map_err(|gone| ProxyError::session(&id, gone))?;
    let give_up = req
        .wait_timeout_ms
        .map(|ms| started + Duration::from_millis(ms));
    let record = HolderRecord {
        session: id.clone(),
        proxy: state.proxy_id.clone(),
        identity: session.identity.clone(),
        acquired_at_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default(),
    };
    // Subscribed before the first attempt, so a release between attempt and wait is seen.
    let mut releases = state.releases.subscribe(&lock);
    loop {
        let now = Instant::now();
        // The session must still be alive for every attempt; waiting does not renew it.
        let session = state
            .sessions
            .get(&id, now)
            .map_err(|gone| ProxyError::session(&id, gone))?;
        match state
            .locklog
            .acquire_exclusive(&lock, session.lease, &record)
            .await?
        {
            Acquired::Granted { revision, fresh } => {
                if *state.shutdown.borrow() {
                    // The proxy's leases are about to be revoked with every key on them:
                    // this grant would not outlive the reply.
                    return Err(ProxyError::ShuttingDown);
                }
                let now = Instant::now();
                let valid_for =
                    state
                        .leases
                        .valid_for(session.bucket, session.lease, session.ttl, now);
                if !state
                    .sessions
                    .record_grant(&id, &lock, revision, now + valid_for)
                {
                    // The session ended while the grant was in flight: undo it.
                    state
                        .cleanup
                        .push(session.lease, vec![(lock.clone(), revision)]);
                    let gone = state.sessions.get(&id, Instant::now()).unwrap_err();
                    return Err(ProxyError::session(&id, gone));
                }
                if fresh {
                    metrics::counter!(m::LOCKS_GRANTED).increment(1);
                    metrics::histogram!(m::ACQUIRE_SECONDS).record(started.elapsed().as_secs_f64());
                    tracing::debug!(revision, "granted");
                }
                return Ok(AcquireResponse {
                    granted: true,
                    token: Some(
                        FencingToken {
                            epoch: state.epoch,
                            revision,
                        }
                        .into(),
                    ),
                    valid_for_ms: millis(valid_for),
                });
            }
            Acquired::Busy { mut seen_at } => loop {
                // Wait for a release, then read before trying again: a grant attempt is
                // a proposal through etcd's log, a read is not.
                let now = Instant::now();
                let session = state
                    .sessions
                    .get(&id, now)
                    .map_err(|gone| ProxyError::session(&id, gone))?;
                let mut patience = POLL.min(session.expires_at().saturating_duration_since(now));
                if let Some(give_up) = give_up {
                    if now >= give_up {
                        return Ok(AcquireResponse {
                            granted: false,
                            token: None,
                            valid_for_ms: 0,
                        });
                    }
                    patience = patience.min(give_up - now);
                }
                releases.released_after(seen_at, patience).await;
                let (held, at) = state.locklog.is_held(&lock).await?;
                if !held {
                    break;
                }
                seen_at = at;
            },
        }
    }
}

async fn release(state: &ProxyState, req: ReleaseRequest) -> Result<ReleaseResponse, ProxyError> {
    let lock = LockName::parse(&req.lock)?;
    let id = req.session_id;
    let token: FencingToken = req
        .token
        .ok_or_else(|| {
            ProxyError::BadArgument(format!("release of lock {lock:?} carries no fencing token"))
        })?
        .into();
    let session = state
        .sessions
        .get(&id, Instant::now())
        .map_err(|gone| ProxyError::session(&id, gone))?;
    if token.epoch != state.epoch {
        // A grant of another epoch is not a current grant: nothing of it is ours to delete.
        return Ok(ReleaseResponse { released: false });
    }
    let released = state
        .locklog
        .release(&lock, token.revision, session.lease)
        .await?;
    state.sessions.forget_grant(&id, &lock, token.revision);
    if released {
        metrics::counter!(m::LOCKS_RELEASED).increment(1);
    }
    Ok(ReleaseResponse { released })
}
