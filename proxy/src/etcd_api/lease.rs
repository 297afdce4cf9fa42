//! etcd's Lease service: a lease is a lockcell session on this proxy. A grant opens one
//! (nothing written to etcd but, once per 65,536 grants, a block of IDs), keepalives
//! renew it from memory, a revoke closes it and answers once its keys are gone, and its
//! expiry deletes its keys as any session's does.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::proto::{
    PbLeaseGrantRequest, PbLeaseGrantResponse, PbLeaseKeepAliveRequest, PbLeaseKeepAliveResponse,
    PbLeaseLeasesRequest, PbLeaseLeasesResponse, PbLeaseRevokeRequest, PbLeaseRevokeResponse,
    PbLeaseService, PbLeaseStatus, PbLeaseTimeToLiveRequest, PbLeaseTimeToLiveResponse,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace;
use lockcell_cell::locklog::Grant;

use super::{forward, ids, keys, EtcdApi};

mod keepalive;

use self::keepalive::*;
use crate::metrics as m;
use crate::sessions::{Gone, Renewed, Session};
use crate::state::ProxyState;

/// The shortest lease TTL granted, as etcd's with its default election timeout.
const MIN_TTL: Duration = Duration::from_secs(2);

/// Replies buffered per keepalive stream before the proxy stops reading that stream.
const KEEPALIVE_BUFFER: usize = 64;

pub use super::ids::{lease_of, session_of, LEASE_NOT_FOUND};

/// The Lease calls forwarded to the proxy a lease lives at.
const REVOKE: &str = "/etcdserverpb.Lease/LeaseRevoke";
/// etcd's text for a lease ID that is taken (clients match it).
pub const LEASE_EXISTS: &str = "etcdserver: lease already exists";

/// Whole seconds of `d`, rounded down: what etcd's TTL fields carry. Never more than the
/// proxy can back.
fn seconds(d: Duration) -> i64 {
    d.as_secs() as i64
}

/// A LeaseGrant's own rules: a positive TTL, and an ID that is positive and not in the
/// range lockcell hands out itself (or none).
fn check_grant(req: &PbLeaseGrantRequest) -> Result<(), Status> {
    let chosen = req.id != 0;
    if req.id < 0 {
        return Err(Status::invalid_argument(format!(
            "lease ID {} is negative; etcd's lease IDs are positive",
            req.id
        )));
    }
    if chosen && ids::is_ours(req.id) {
        return Err(Status::invalid_argument(format!(
            "lease ID {:016x} is in the range lockcell hands out itself ({:04x} in its top bits); choose another, or leave the ID unset",
            req.id,
            ids::MARK
        )));
    }
    if req.ttl <= 0 {
        return Err(Status::invalid_argument(format!(
            "lease TTL {} is not a number of seconds above zero",
            req.ttl
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl PbLeaseService for EtcdApi {
    async fn lease_grant(
        &self,
        request: Request<PbLeaseGrantRequest>,
    ) -> Result<Response<PbLeaseGrantResponse>, Status> {
        let principal = self.caller(&request)?;
        let req = request.into_inner();
        check_grant(&req)?;
        let chosen = req.id != 0;
        let state = &self.state;
        if state.is_draining() {
            return Err(Status::unavailable(
                "etcdserver: this proxy is shutting down; use another endpoint",
            ));
        }
        state.pace(principal.as_deref())?;
        state.admit_session(principal.as_deref())?;
        let id = if chosen {
            if state.sessions.peek(&session_of(req.id)).is_some() {
                return Err(Status::failed_precondition(LEASE_EXISTS));
            }
            // A chosen ID is claimed with a key of its own.
            state
                .space
                .admit(&format!("granting lease {:016x}", req.id), 64)?;
            req.id
        } else {
            self.ids.take(state).await?
        };
        // etcd raises a TTL under its minimum (2 s with its default election timeout);
        // so does the proxy, also to the session classes' minimum: a lease of 1 s could
        // never be answered a whole second of TTL.
        let ttl = state
            .config
            .session_ttl_for(Duration::from_secs(req.ttl as u64))
            .max(MIN_TTL);
        let (bucket, lease) = state.leases.assign().ok_or_else(|| {
            Status::unavailable("etcdserver: no leader (this proxy holds no etcd lease right now)")
        })?;
        let held = if chosen {
            match self.claim(id, lease).await {
                Ok(claim) => vec![claim],
                Err(refused) => {
                    state.leases.unassign(bucket);
                    return Err(refused);
                }
            }
        } else {
            Vec::new()
        };
        let now = Instant::now();
        let valid_for = state.leases.valid_for(bucket, lease, ttl, now);
        let identity = principal.clone().unwrap_or_default();
        let mut session = Session::arriving(
            session_of(id).into(),
            identity,
            ttl,
            (bucket, lease),
            held,
            now,
            now + valid_for,
        );
        session.principal = principal.map(Into::into);
        state.sessions.insert(session);
        state.publish_sessions_open();
        metrics::counter!(m::SESSIONS_OPENED).increment(1);
        Ok(Response::new(PbLeaseGrantResponse {
            header: Some(self.header(state.cell.seen())),
            id,
            ttl: seconds(ttl),
            error: String::new(),
        }))
    }

    async fn lease_revoke(
        &self,
        request: Request<PbLeaseRevokeRequest>,
    ) -> Result<Response<PbLeaseRevokeResponse>, Status> {
        let caller = self.caller(&request)?;
        let id = request.get_ref().id;
        let here = || self.revoke_here(id, caller.as_deref());
        self.on_lease((id, REVOKE), &request, caller.as_deref(), |_| false, here)
            .await
    }

    type LeaseKeepAliveStream =
        Pin<Box<dyn Stream<Item = Result<PbLeaseKeepAliveResponse, Status>> + Send>>;

    async fn lease_keep_alive(
        &self,
        request: Request<Streaming<PbLeaseKeepAliveRequest>>,
    ) -> Result<Response<Self::LeaseKeepAliveStream>, Status> {
        let caller = self.caller(&request)?;
        let leader_required = self.check_leader(&request)?;
        let metadata = request.metadata().clone();
        let input = request.into_inner();
        let (tx, rx) = mpsc::channel(KEEPALIVE_BUFFER);
        // Dropped with this stream's task: its streams to other proxies end with it.
        let relays = Relays::new(self.clone(), caller, metadata, tx);
        // Owned by the stream: it ends when the client hangs up, the reply stream is
        // dropped, or the proxy shuts down.
        tokio::spawn(relays.serve(input, leader_required));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn lease_time_to_live(
        &self,
        request: Request<PbLeaseTimeToLiveRequest>,
    ) -> Result<Response<PbLeaseTimeToLiveResponse>, Status> {
        let caller = self.caller(&request)?;
        if !request.metadata().contains_key(forward::FORWARDED_FOR) {
            // (A forwarded call was paced where it arrived.)
            self.state.pace(caller.as_deref())?;
        }
        let id = request.get_ref().id;
        let moved = |reply: &PbLeaseTimeToLiveResponse| reply.ttl == -1;
        let here = || self.time_to_live_here(&request, caller.as_deref());
        self.on_lease(
            (id, forward::TIME_TO_LIVE),
            &request,
            caller.as_deref(),
            moved,
            here,
        )
        .await
    }

    async fn lease_leases(
        &self,
        request: Request<PbLeaseLeasesRequest>,
    ) -> Result<Response<PbLeaseLeasesResponse>, Status> {
        let caller = self.caller(&request)?;
        if !request.metadata().contains_key(forward::FORWARDED_FOR) {
            self.state.pace(caller.as_deref())?;
        }
        let mut leases: Vec<PbLeaseStatus> = self
            .state
            .sessions
            .ids_where(|s| s.owned_by(caller.as_deref()))
            .iter()
            .filter_map(|id| lease_of(id))
            .map(|id| PbLeaseStatus { id })
            .collect();
        // And the caller's leases at the other proxies, unless this is another proxy
        // asking.
        if !request
            .metadata()
            .contains_key(super::forward::FORWARDED_FOR)
        {
            leases.extend(self.leases_elsewhere(&request, caller.as_deref()).await?);
            leases.sort_by_key(|l| l.id);
            leases.dedup_by_key(|l| l.id);
        }
        Ok(Response::new(PbLeaseLeasesResponse {
            header: Some(self.header(self.state.cell.seen())),
            leases,
        }))
    }
}

impl EtcdApi {
    /// A LeaseRevoke run here: answered once the lease's keys are gone.
    async fn revoke_here(
        &self,
        id: i64,
        caller: Option<&str>,
    ) -> Result<Response<PbLeaseRevokeResponse>, Status> {
        use crate::service::session::{close_now, release_closed};
        let session = session_of(id);
        // (A stay arriving here is closed once its keys are here, never while they
        // are on their way: it counts as on its way until then.)
        self.lease_session(id, caller).await?;
        let closed = {
            // No hand-off marks it between the look and the close.
            let _writes = self.writes.read().await;
            if self.state.sessions.is_handed_off(&session) {
                // Handed over meanwhile: revoked where it goes.
                return Err(super::refused_handed_off());
            }
            close_now(&self.state, &session, None)
        };
        let not_found = |e| match e {
            crate::errors::ProxyError::UnknownSession { .. }
            | crate::errors::ProxyError::ExpiredSession { .. } => {
                Status::not_found(LEASE_NOT_FOUND)
            }
            other => other.into(),
        };
        let Some(mut stay) = closed.map_err(not_found)? else {
            return Ok(Response::new(PbLeaseRevokeResponse {
                header: Some(self.header(self.state.cell.seen())),
            }));
        };
        // A leased write queued for etcd is refused now (its lease is closed); one
        // already sent is waited for, and its key, if it landed, goes with the others:
        // no key of the lease lands after the revoke answers.
        drop(self.sending.write().await);
        let unsettled: Vec<Grant> = stay
            .held
            .iter()
            .filter(|g| g.is_unsettled())
            .cloned()
            .collect();
        stay.held.retain(|g| !g.is_unsettled());
        let landed = self.state.locklog.settle(&unsettled, stay.lease).await;
        stay.held.extend(
            landed
                .as_ref()
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .cloned(),
        );
        release_closed(&self.state, stay).await.map_err(not_found)?;
        if let Err(source) = landed {
            // Still looked for by the clean-up, and deleted if they landed.
            return Err(crate::errors::ProxyError::StoreDuring {
                context: format!("lease {id:x} is revoked; writes on it that were on their way are deleted when etcd answers"),
                source,
            }
            .into());
        }
        Ok(Response::new(PbLeaseRevokeResponse {
            header: Some(self.header(self.state.cell.seen())),
        }))
    }

    /// A LeaseTimeToLive run here: the lease is here, or nowhere (TTL -1).
    async fn time_to_live_here(
        &self,
        request: &Request<PbLeaseTimeToLiveRequest>,
        caller: Option<&str>,
    ) -> Result<Response<PbLeaseTimeToLiveResponse>, Status> {
        // Another proxy asking for the lease, to run a Txn writing with it there
        // (a signed call: `caller` checked its signature).
        let hand_over = request.metadata().contains_key(forward::FORWARDED_FOR)
            && request.metadata().contains_key(forward::HAND_OVER);
        let req = request.get_ref();
        let now = Instant::now();
        let header = Some(self.header(self.state.cell.seen()));
        let found = match self.lease_session(req.id, caller).await {
            Ok(session) => Some(session),
            Err(refused) if refused.code() == tonic::Code::NotFound => None,
            Err(refused) => return Err(refused),
        };
        let Some(session) = found else {
            // etcd: -1 for a lease it does not have.
            return Ok(Response::new(PbLeaseTimeToLiveResponse {
                header,
                id: req.id,
                ttl: -1,
                granted_ttl: 0,
                keys: Vec::new(),
            }));
        };
        if hand_over {
            self.hand_over_one(req.id).await?;
        }
        let keys = if req.keys {
            session
                .held
                .iter()
                .filter(|g| !g.is_unsettled())
                .filter_map(|g| keys::outer(g.key.as_bytes()).map(<[u8]>::to_vec))
                .collect()
        } else {
            Vec::new()
        };
        Ok(Response::new(PbLeaseTimeToLiveResponse {
            header,
            id: req.id,
            ttl: seconds(session.expires_at().saturating_duration_since(now)),
            granted_ttl: seconds(session.ttl()),
            keys,
        }))
    }

    /// Claims lease ID `id`, which a client chose, for a session on proxy lease `lease`:
    /// its claim key is created there, or the ID is taken (etcd's "lease already exists").
    /// Returns the claim as the session's key, deleted when the session ends.
    async fn claim(&self, id: i64, lease: i64) -> Result<Grant, Status> {
        let state = &self.state;
        let key = keyspace::etcd_lease_claim_key(id);
        let value = state.proxy_id.clone();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        // A client's write like any other: it waits its turn to go to etcd.
        let sent = match self
            .turn_in_etcd("claim a lease ID", state.config.etcd_timeout)
            .await
        {
            Ok((_turn, waited)) => {
                with_timeout(
                    "claim a lease ID",
                    state.config.etcd_timeout.saturating_sub(waited),
                    state.etcd.kv_client().txn(txn),
                )
                .await
            }
            Err(queued) => Err(queued),
        };
        match sent {
            Ok(done) if done.succeeded() => {
                let revision = done.header().map_or(0, |h| h.revision());
                Ok(Grant::etcd_api_key(key, revision, revision))
            }
            Ok(_) => Err(Status::failed_precondition(LEASE_EXISTS)),
            Err(e) => {
                if crate::unsettled::unknown_outcome(&e) {
                    // It may have landed: the clean-up reads it back and deletes it if so.
                    let pending =
                        Grant::unsettled_etcd_api_key(key, &session_of(id), value.as_bytes());
                    state.cleanup.push(lease, vec![pending]);
                }
                Err(crate::errors::ProxyError::from(e).into())
            }
        }
    }
}
