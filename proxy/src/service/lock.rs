//! The Lock service: acquire (waiting, per the lock's class), release and the
//! sequencer check, through the lock log.

use std::sync::Arc;
use std::time::Duration;

use lockcell_cell::{LockName, Mode};
use lockcell_proto::v1::lock_server::Lock as LockApi;
use lockcell_proto::v1::{
    AcquireRequest, AcquireResponse, CheckSequencerRequest, CheckSequencerResponse,
    DescribeRequest, DescribeResponse, LockHolder, LockMode, LockWaiter, ReleaseRequest,
    ReleaseResponse,
};
use lockcell_proto::FencingToken;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::millis;
use crate::access::Right;
use crate::acquire::{self, Call};
use crate::errors::ProxyError;
use crate::metrics as m;
use crate::state::ProxyState;

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
        self.state.authorize_session(
            &request,
            Right::Lock,
            &request.get_ref().lock,
            &request.get_ref().session_id,
            &request.get_ref().session_secret,
        )?;
        let req = request.into_inner();
        let withdraw = req.withdraw;
        if withdraw && req.call_id.is_empty() {
            return Err(ProxyError::BadArgument(
                "a withdrawal names the call it withdraws, and call_id is empty".into(),
            )
            .into());
        }
        let call = Call {
            mode: mode(req.mode)?,
            lock: LockName::parse(&req.lock).map_err(ProxyError::from)?,
            session_id: req.session_id,
            wait: req.wait_timeout_ms.map(Duration::from_millis),
            value: String::new(),
            election: false,
            call_id: acquire::call_id(req.call_id)?,
        };
        if withdraw {
            withdrawn(&self.state, &call).await?;
            return Ok(Response::new(AcquireResponse::default()));
        }
        let reply = match acquire::acquire(&self.state, call).await? {
            Some(granted) => AcquireResponse {
                granted: true,
                token: Some(granted.token().into()),
                valid_for_ms: millis(granted.valid_for),
            },
            None => AcquireResponse {
                granted: false,
                token: None,
                valid_for_ms: 0,
            },
        };
        Ok(Response::new(reply))
    }

    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id, lock.name = %request.get_ref().lock))]
    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        self.state.authorize_session(
            &request,
            Right::Lock,
            &request.get_ref().lock,
            &request.get_ref().session_id,
            &request.get_ref().session_secret,
        )?;
        let req = request.into_inner();
        let mode = mode(req.mode)?;
        let released = release(&self.state, &req.session_id, &req.lock, mode, req.token).await?;
        Ok(Response::new(ReleaseResponse { released }))
    }

    #[tracing::instrument(skip_all, fields(lock.name = %request.get_ref().lock))]
    async fn check_sequencer(
        &self,
        request: Request<CheckSequencerRequest>,
    ) -> Result<Response<CheckSequencerResponse>, Status> {
        let caller = self.state.grants.current().authorize_any(
            &request,
            &[Right::Lock, Right::Read],
            &request.get_ref().lock,
        )?;
        self.state.pace(caller.as_deref())?;
        let req = request.into_inner();
        let lock = LockName::parse(&req.lock).map_err(ProxyError::from)?;
        let token = token_of(&lock, req.token)?;
        let (holder, _) = self
            .state
            .locklog
            .exclusive_holder(&lock)
            .await
            .map_err(ProxyError::from)?;
        let holder = holder.map(|h| self.state.token(lock.as_str(), h.revision));
        Ok(Response::new(CheckSequencerResponse {
            current: holder == Some(token),
            holder: holder.map(Into::into),
        }))
    }

    #[tracing::instrument(skip_all, fields(lock.name = %request.get_ref().lock))]
    async fn describe(
        &self,
        request: Request<DescribeRequest>,
    ) -> Result<Response<DescribeResponse>, Status> {
        let caller = self.state.grants.current().authorize_any(
            &request,
            &[Right::Lock, Right::Read],
            &request.get_ref().lock,
        )?;
        self.state.pace(caller.as_deref())?;
        let lock = LockName::parse(&request.get_ref().lock).map_err(ProxyError::from)?;
        let described = self
            .state
            .locklog
            .describe(&lock)
            .await
            .map_err(ProxyError::from)?;
        let wire = |mode: Mode| match mode {
            Mode::Exclusive => LockMode::Exclusive as i32,
            Mode::Shared => LockMode::Shared as i32,
        };
        let holders = described
            .holders
            .into_iter()
            .map(|(mode, h)| LockHolder {
                mode: wire(mode),
                token: Some(self.state.token(lock.as_str(), h.revision).into()),
                session_id: h.record.session,
                identity: h.record.identity,
                proxy_id: h.record.proxy,
                zone: h.record.zone,
                acquired_at_ms: h.record.acquired_at_ms,
                election: h.record.election,
                value: h.record.value,
            })
            .collect();
        let waiters = described
            .waiters
            .into_iter()
            .map(|(mode, waiter, revision)| LockWaiter {
                mode: wire(mode),
                session_id: waiter.split('-').next().unwrap_or_default().to_owned(),
                revision,
            })
            .collect();
        Ok(Response::new(DescribeResponse {
            holders,
            waiters,
            revision: described.revision,
        }))
    }
}

/// Withdraws `call` (an acquire or a campaign its client gave up on) and releases what
/// it holds; see [`acquire::withdraw`].
pub async fn withdrawn(state: &Arc<ProxyState>, call: &Call) -> Result<(), ProxyError> {
    if let Some(held) = acquire::withdraw(state, call).await? {
        let token = Some(held.token().into());
        let released = release(
            state,
            &call.session_id,
            call.lock.as_str(),
            call.mode,
            token,
        )
        .await?;
        tracing::info!(session.id = %call.session_id, lock.name = %call.lock.as_str(), released, "a call given up on had a grant; released");
    }
    Ok(())
}

/// Releases `session`'s `mode` hold of `lock` granted with `token`; idempotent.
pub async fn release(
    state: &ProxyState,
    session_id: &str,
    lock: &str,
    mode: Mode,
    token: Option<lockcell_proto::v1::FencingToken>,
) -> Result<bool, ProxyError> {
    let lock = LockName::parse(lock)?;
    let token = token_of(&lock, token)?;
    let session = state
        .sessions
        .get(session_id, Instant::now())
        .map_err(|gone| ProxyError::session(session_id, gone))?;
    if token.epoch != state.routes.token_epoch(lock.as_str()) {
        // A grant of another epoch is not a current grant: nothing of it is ours to delete.
        return Ok(false);
    }
    if let Some(other) = session
        .held
        .iter()
        .find(|g| !g.waiter && g.revision == token.revision && g.lock != lock)
    {
        return Err(ProxyError::Refused(format!(
            "token {token} is this session's grant of lock {:?}, not of lock {lock:?}",
            other.lock.as_str()
        )));
    }
    let key = lock.holder_key(mode, session_id);
    if !session
        .held
        .iter()
        .any(|g| !g.waiter && g.key == key && g.revision == token.revision)
    {
        // Not a grant of this session's (the exclusive key and the lease are every
        // session's on this lease; the token is public): nothing of it is ours to
        // delete, whoever holds it.
        return Ok(false);
    }
    let marker = state
        .locklog
        .release(&lock, mode, session_id, token.revision, session.lease)
        .await?;
    state.sessions.forget_grant(
        session_id,
        &lock.holder_key(mode, session_id),
        token.revision,
    );
    let Some(marker) = marker else {
        return Ok(false);
    };
    metrics::counter!(m::LOCKS_RELEASED).increment(1);
    // Its write has been made, which is all anyone reads of it.
    state.cleanup.push(session.lease, vec![marker]);
    Ok(true)
}

pub fn mode(wire: i32) -> Result<Mode, ProxyError> {
    match LockMode::try_from(wire) {
        Ok(LockMode::Exclusive) => Ok(Mode::Exclusive),
        Ok(LockMode::Shared) => Ok(Mode::Shared),
        Err(_) => Err(ProxyError::BadArgument(format!(
            "lock mode {wire} is not one of EXCLUSIVE (0) or SHARED (1)"
        ))),
    }
}

/// The fencing token a call about `lock` must carry.
pub fn token_of(
    lock: &LockName,
    token: Option<lockcell_proto::v1::FencingToken>,
) -> Result<FencingToken, ProxyError> {
    let token: FencingToken = token
        .ok_or_else(|| {
            ProxyError::BadArgument(format!(
                "the call about lock {lock:?} carries no fencing token"
            ))
        })?
        .into();
    if token.revision <= 0 {
        return Err(ProxyError::BadArgument(format!(
            "fencing token {token} for lock {lock:?} has no revision; tokens come from grants"
        )));
    }
    Ok(token)
}
