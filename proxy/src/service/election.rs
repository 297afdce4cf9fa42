//! The Election service: leader election on the lock log. An election is an exclusive
//! lock whose holder record carries the leader's value; the leader's fencing token is
//! its grant's token.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lockcell_cell::locklog::{Holder, HolderRecord};
use lockcell_cell::{LockName, Mode};
use lockcell_proto::v1::election_server::Election as ElectionApi;
use lockcell_proto::v1::{
    CampaignRequest, CampaignResponse, Leader, LeaderRequest, LeaderResponse, ProclaimRequest,
    ProclaimResponse, ResignRequest, ResignResponse,
};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::lock::{release, token_of};
use super::millis;
use crate::access::Right;
use crate::acquire::{self, Call};
use crate::errors::ProxyError;
use crate::state::ProxyState;

/// Longest leader value accepted, in bytes.
pub const MAX_VALUE_BYTES: usize = 4096;

pub struct ElectionService {
    pub state: Arc<ProxyState>,
}

type LeaderStream = Pin<Box<dyn Stream<Item = Result<LeaderResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ElectionApi for ElectionService {
    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id, lock.name = %request.get_ref().election))]
    async fn campaign(
        &self,
        request: Request<CampaignRequest>,
    ) -> Result<Response<CampaignResponse>, Status> {
        self.state.authorize_session(
            &request,
            Right::Lock,
            &request.get_ref().election,
            &request.get_ref().session_id,
            &request.get_ref().session_secret,
        )?;
        let req = request.into_inner();
        let election = LockName::parse(&req.election).map_err(ProxyError::from)?;
        check_value(&election, &req.value)?;
        let withdraw = req.withdraw;
        if withdraw && req.call_id.is_empty() {
            return Err(ProxyError::BadArgument(
                "a withdrawal names the call it withdraws, and call_id is empty".into(),
            )
            .into());
        }
        let call = Call {
            session_id: req.session_id,
            lock: election,
            mode: Mode::Exclusive,
            wait: req.wait_timeout_ms.map(Duration::from_millis),
            value: req.value,
            election: true,
            call_id: acquire::call_id(req.call_id)?,
        };
        if withdraw {
            crate::service::lock::withdrawn(&self.state, &call).await?;
            return Ok(Response::new(CampaignResponse::default()));
        }
        let reply = match acquire::acquire(&self.state, call).await? {
            Some(granted) => CampaignResponse {
                elected: true,
                token: Some(granted.token().into()),
                valid_for_ms: millis(granted.valid_for),
            },
            None => CampaignResponse {
                elected: false,
                token: None,
                valid_for_ms: 0,
            },
        };
        Ok(Response::new(reply))
    }

    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id, lock.name = %request.get_ref().election))]
    async fn proclaim(
        &self,
        request: Request<ProclaimRequest>,
    ) -> Result<Response<ProclaimResponse>, Status> {
        self.state.authorize_session(
            &request,
            Right::Lock,
            &request.get_ref().election,
            &request.get_ref().session_id,
            &request.get_ref().session_secret,
        )?;
        let req = request.into_inner();
        let state = &self.state;
        let election = LockName::parse(&req.election).map_err(ProxyError::from)?;
        check_value(&election, &req.value)?;
        let token = token_of(&election, req.token)?;
        let session = state
            .sessions
            .get(&req.session_id, Instant::now())
            .map_err(|gone| ProxyError::session(&req.session_id, gone))?;
        state.pace(session.principal.as_deref())?;
        // A larger value counts against the identity's bytes and etcd's space.
        let key = election.exclusive_key();
        let (_, grows) = session.adds(&key, (key.len() + req.value.len()) as u64);
        state.admit_keys(&req.session_id, 0, grows)?;
        state.space.admit(
            &format!("proclaiming in election {:?}", election.as_str()),
            req.value.len() as u64,
        )?;
        let not_leader = || {
            ProxyError::Refused(format!(
                "session {:?} does not lead election {election:?} with token {token}; only the leader may proclaim",
                req.session_id
            ))
        };
        if token.epoch != state.routes.token_epoch(election.as_str())
            || !state
                .sessions
                .holds(&req.session_id, &election.exclusive_key(), token.revision)
        {
            return Err(not_leader().into());
        }
        let (holder, _) = state
            .locklog
            .exclusive_holder(&election)
            .await
            .map_err(ProxyError::from)?;
        let Some(holder) = holder.filter(|h| h.revision == token.revision) else {
            return Err(not_leader().into());
        };
        let record = HolderRecord {
            value: req.value,
            ..holder.record
        };
        let value_bytes = record.value.len();
        if !state
            .locklog
            .rewrite(&election, token.revision, session.lease, &record)
            .await
            .map_err(ProxyError::from)?
        {
            return Err(not_leader().into());
        }
        state
            .sessions
            .set_value_bytes(&req.session_id, &key, token.revision, value_bytes);
        Ok(Response::new(ProclaimResponse {}))
    }

    #[tracing::instrument(skip_all, fields(lock.name = %request.get_ref().election))]
    async fn leader(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        let caller = self.state.grants.current().authorize(
            &request,
            Right::Read,
            &[&request.get_ref().election],
        )?;
        self.state.pace(caller.as_deref())?;
        let election = LockName::parse(&request.into_inner().election).map_err(ProxyError::from)?;
        let (holder, revision) = self
            .state
            .locklog
            .exclusive_holder(&election)
            .await
            .map_err(ProxyError::from)?;
        Ok(Response::new(LeaderResponse {
            leader: holder.map(|h| leader(&self.state, &election, h)),
            revision,
        }))
    }

    type ObserveStream = LeaderStream;

    #[tracing::instrument(skip_all, fields(lock.name = %request.get_ref().election))]
    async fn observe(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        let caller = self.state.grants.current().authorize(
            &request,
            Right::Watch,
            &[&request.get_ref().election],
        )?;
        self.state.pace(caller.as_deref())?;
        // An observer is a watch: it counts as one of its identity's while it lasts.
        let place = self
            .state
            .take(caller.as_deref(), lockcell_cell::grants::Limit::Watches)?;
        let election = LockName::parse(&request.into_inner().election).map_err(ProxyError::from)?;
        let state = self.state.clone();
        // Subscribed before the first read, so no change between the two is missed.
        let mut changes = state.events.observe(&election);
        let (holder, mut seen) = state
            .locklog
            .exclusive_holder(&election)
            .await
            .map_err(ProxyError::from)?;
        let (tx, rx) = mpsc::channel(16);
        let first = LeaderResponse {
            leader: holder.map(|h| leader(&state, &election, h)),
            revision: seen,
        };
        tx.send(Ok(first))
            .await
            .map_err(|_| ProxyError::Cancelled("observer left".to_owned()))?;
        // Owned by the stream: ends when the observer hangs up or the proxy stops.
        tokio::spawn(async move {
            let _place = place;
            let mut shutdown = state.shutdown.clone();
            loop {
                let next = tokio::select! {
                    next = changes.recv() => next,
                    _ = shutdown.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                };
                let reply = match next {
                    Ok(change) if change.revision <= seen => continue,
                    Ok(change) => {
                        seen = change.revision;
                        leader_after(&state, &election, change)
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        // Too far behind to replay: say where things stand now.
                        match state.locklog.exclusive_holder(&election).await {
                            Ok((holder, revision)) => {
                                seen = revision;
                                LeaderResponse {
                                    leader: holder.map(|h| leader(&state, &election, h)),
                                    revision,
                                }
                            }
                            Err(e) => {
                                let _ = tx.send(Err(ProxyError::from(e).into())).await;
                                return;
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id, lock.name = %request.get_ref().election))]
    async fn resign(
        &self,
        request: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        self.state.authorize_session(
            &request,
            Right::Lock,
            &request.get_ref().election,
            &request.get_ref().session_id,
            &request.get_ref().session_secret,
        )?;
        let req = request.into_inner();
        let election = LockName::parse(&req.election).map_err(ProxyError::from)?;
        let token = token_of(&election, req.token)?;
        if !self
            .state
            .sessions
            .holds(&req.session_id, &election.exclusive_key(), token.revision)
        {
            // Unlike a retried release, resigning what one does not lead is an error: the
            // caller believed it led.
            let gone = self
                .state
                .sessions
                .get(&req.session_id, Instant::now())
                .err();
            return Err(match gone {
                Some(gone) => ProxyError::session(&req.session_id, gone),
                None => ProxyError::Refused(format!(
                    "session {:?} does not lead election {election:?} with token {token}; only the leader may resign",
                    req.session_id
                )),
            }
            .into());
        }
        let resigned = release(
            &self.state,
            &req.session_id,
            &req.election,
            Mode::Exclusive,
            Some(token.into()),
        )
        .await?;
        Ok(Response::new(ResignResponse { resigned }))
    }
}

/// What an observer hears of a change of the election's holder: the new leader, if
/// any.
fn leader_after(
    state: &ProxyState,
    election: &LockName,
    change: crate::events::HolderChange,
) -> LeaderResponse {
    let leader = change.value.and_then(|v| {
        let record = serde_json::from_slice::<HolderRecord>(&v).ok()?;
        Some(leader(
            state,
            election,
            Holder {
                record,
                revision: change.create_revision,
                lease: 0,
            },
        ))
    });
    LeaderResponse {
        leader,
        revision: change.revision,
    }
}

fn leader(state: &ProxyState, election: &LockName, holder: Holder) -> Leader {
    Leader {
        session_id: holder.record.session,
        identity: holder.record.identity,
        proxy_id: holder.record.proxy,
        value: holder.record.value,
        token: Some(state.token(election.as_str(), holder.revision).into()),
    }
}

fn check_value(election: &LockName, value: &str) -> Result<(), ProxyError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(ProxyError::BadArgument(format!(
            "the value for election {election:?} is {} bytes, over the limit of {MAX_VALUE_BYTES} bytes",
            value.len()
        )));
    }
    Ok(())
}
