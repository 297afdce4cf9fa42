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
/// How often, and how many times, a renewal of a lease that moved is looked for again
/// while it is still found at the proxy that said it moved.
const MOVED_LOOK: Duration = Duration::from_millis(50);
const MOVED_LOOKS: u32 = 3;

/// What a proxy answers to a renewal forwarded by another proxy for a lease it does
/// not have (it moved away, or was revoked, or is not the caller's), as against 0 for
/// one that expired there: the forwarding proxy looks for it again. Never reaches a
/// client.
const MOVED_TTL: i64 = -1;

const KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";

/// etcd's text for a lease ID that is taken (clients match it).
pub const LEASE_EXISTS: &str = "etcdserver: lease already exists";

/// Whole seconds of `d`, rounded down: what etcd's TTL fields carry. Never more than the
/// proxy can back.
fn seconds(d: Duration) -> i64 {
    d.as_secs() as i64
}

#[tonic::async_trait]
impl PbLeaseService for EtcdApi {
    async fn lease_grant(
        &self,
        request: Request<PbLeaseGrantRequest>,
    ) -> Result<Response<PbLeaseGrantResponse>, Status> {
        let principal = self.caller(&request)?;
        let req = request.into_inner();
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
        if let Some(there) = self
            .forward_unary(id, REVOKE, &request, caller.as_deref(), |_| false)
            .await?
        {
            return Ok(there);
        }
        let session = session_of(id);
        self.lease_session(id, caller.as_deref()).await?;
        crate::service::session::close_stay(&self.state, &session, None)
            .await
            .map_err(|e| match e {
                crate::errors::ProxyError::UnknownSession { .. }
                | crate::errors::ProxyError::ExpiredSession { .. } => {
                    Status::not_found(LEASE_NOT_FOUND)
                }
                other => other.into(),
            })?;
        Ok(Response::new(PbLeaseRevokeResponse {
            header: Some(self.header(self.state.cell.seen())),
        }))
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
        let mut input = request.into_inner();
        let (tx, rx) = mpsc::channel(KEEPALIVE_BUFFER);
        let api = self.clone();
        // Dropped with this stream's task: its streams to other proxies end with it.
        let relays = Arc::new(Relays {
            api: api.clone(),
            caller: caller.clone(),
            metadata,
            tx: tx.clone(),
            open: Default::default(),
            looking: Default::default(),
        });
        // Owned by the stream: it ends when the client hangs up, the reply stream is
        // dropped, or the proxy shuts down.
        tokio::spawn(async move {
            let mut shutdown = api.state.shutdown.clone();
            let pace = crate::limits::StreamPace::new(api.state.config.max_keepalives_per_stream);
            loop {
                tokio::select! {
                    () = pace.turn() => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
                let msg = tokio::select! {
                    msg = input.message() => msg,
                    _ = shutdown.wait_for(|stop| *stop) => return,
                };
                let req = match msg {
                    Ok(Some(req)) => req,
                    Ok(None) => return,
                    // A request that did not read (over etcd's JSON gateway: one that
                    // is not JSON): the client hears why.
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                metrics::counter!(m::KEEPALIVES).increment(1);
                if leader_required && api.without_leader() {
                    let _ = tx.send(Err(Status::unavailable(super::NO_LEADER))).await;
                    return;
                }
                // etcd's TTLs are whole seconds. A renewal the proxy cannot back for a
                // whole second now (its own etcd lease is near its lower bound, as it
                // is just before each of its renewals with a short lease TTL) is
                // answered once it can, after the proxy renews its lease; until then
                // the client counts down its own TTL, as it would with etcd slow.
                let ttl = match renew(&api.state, req.id, caller.as_deref()) {
                    Renewal::Ttl(ttl) => ttl,
                    Renewal::Unbacked => {
                        tokio::spawn(answer_when_backed_here_or_there(relays.clone(), req.id));
                        continue;
                    }
                    // At another proxy (forwarded there), or handed over by a draining
                    // proxy (taken over here first). Finding it reads etcd, so each
                    // lookup is paced as a call of the caller's, and a lease already
                    // being looked for on this stream is not looked for twice (that
                    // lookup's answer answers the client).
                    Renewal::Unknown => {
                        if !relays.start_looking(req.id) {
                            continue;
                        }
                        if let Err(refused) = api.state.pace(caller.as_deref()) {
                            relays.done_looking(req.id);
                            let _ = tx.send(Err(refused.into())).await;
                            return;
                        }
                        let relays = relays.clone();
                        tokio::spawn(async move {
                            relays.clone().unknown(req.id, None).await;
                            relays.done_looking(req.id);
                        });
                        continue;
                    }
                    // On its way to a proxy that asked for it: answered once there.
                    Renewal::HandedOff if !api.state.is_draining() => {
                        tokio::spawn(answer_once_moved(relays.clone(), req.id));
                        continue;
                    }
                    // The client goes on with another proxy (its stream ends here).
                    Renewal::HandedOff => {
                        let _ = tx.send(Err(super::refused_handed_off())).await;
                        return;
                    }
                };
                if tx.send(Ok(api.kept_alive(req.id, ttl))).await.is_err() {
                    return;
                }
            }
        });
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
        if let Some(there) = self
            .forward_unary(
                id,
                forward::TIME_TO_LIVE,
                &request,
                caller.as_deref(),
                moved,
            )
            .await?
        {
            return Ok(there);
        }
        // Another proxy asking for the lease, to run a Txn writing with it there
        // (a signed call: `caller` checked its signature).
        let hand_over = request.metadata().contains_key(forward::FORWARDED_FOR)
            && request.metadata().contains_key(forward::HAND_OVER);
        let req = request.into_inner();
        let now = Instant::now();
        let header = Some(self.header(self.state.cell.seen()));
        let found = match self.lease_session(req.id, caller.as_deref()).await {
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

/// Answers a renewal of lease `id` the proxy could not back when it came, once the
/// proxy can (it renews its own etcd lease within a renew interval), or not at all.
/// Returns true, having answered nothing, when the lease moved away meanwhile.
async fn answer_when_backed(relays: &Relays, id: i64) -> bool {
    let api = &relays.api;
    let give_up = Instant::now() + api.state.config.renew_interval();
    let mut look = tokio::time::interval(UNBACKED_LOOK);
    while Instant::now() < give_up {
        look.tick().await;
        let ttl = match renew(&api.state, id, relays.caller.as_deref()) {
            Renewal::Ttl(ttl) => ttl,
            Renewal::Unbacked => continue,
            Renewal::Unknown => return true,
            Renewal::HandedOff => return false,
        };
        let _ = relays.tx.send(Ok(api.kept_alive(id, ttl))).await;
        return false;
    }
    false
}

/// Answers a renewal the proxy could not back when it came ([`answer_when_backed`]),
/// or where the lease went if it moved away meanwhile.
async fn answer_when_backed_here_or_there(relays: Arc<Relays>, id: i64) {
    if answer_when_backed(&relays, id).await {
        relays.unknown(id, None).await;
    }
}

/// Answers a renewal of lease `id`, which this proxy is handing to a proxy that asked
/// for it: renewed where it ends up.
async fn answer_once_moved(relays: Arc<Relays>, id: i64) {
    let api = &relays.api;
    api.hand_over_settled(id).await;
    let ttl = match renew(&api.state, id, relays.caller.as_deref()) {
        Renewal::Ttl(ttl) => ttl,
        Renewal::Unbacked => return answer_when_backed_here_or_there(relays, id).await,
        Renewal::Unknown => return relays.unknown(id, None).await,
        Renewal::HandedOff => {
            let _ = relays.tx.send(Err(super::refused_handed_off())).await;
            return;
        }
    };
    let _ = relays.tx.send(Ok(api.kept_alive(id, ttl))).await;
}

/// Answers a renewal of lease `id`, unknown here: taken over first if a draining proxy
/// handed it over (see [`super::handoff`]), else TTL 0, as etcd answers (or
/// [`MOVED_TTL`] to a proxy that forwarded it).
async fn take_over_and_answer(relays: Arc<Relays>, id: i64) {
    use super::handoff::TakeOver;
    let api = &relays.api;
    let caller = relays.caller.as_deref();
    let ttl = match api.take_over(id, caller).await {
        Ok(TakeOver::Taken(_)) => match renew(&api.state, id, caller) {
            Renewal::Ttl(ttl) => ttl,
            Renewal::Unbacked => {
                if answer_when_backed(&relays, id).await {
                    relays.not_here()
                } else {
                    return;
                }
            }
            Renewal::Unknown | Renewal::HandedOff => relays.not_here(),
        },
        Ok(TakeOver::NoRecord) => relays.not_here(),
        Err(refused) => {
            let _ = relays.tx.send(Err(refused)).await;
            return;
        }
    };
    let _ = relays.tx.send(Ok(api.kept_alive(id, ttl))).await;
}

/// A client keepalive stream's streams to the other proxies, for its leases that live
/// there: one per proxy, opened at the first such lease.
struct Relays {
    api: EtcdApi,
    caller: Option<String>,
    /// The client's call's metadata.
    metadata: tonic::metadata::MetadataMap,
    /// The client's replies.
    tx: Replies,
    /// By proxy id: the stream to it.
    open: std::sync::Mutex<HashMap<String, Relayed>>,
    /// The leases this stream's client renewed that are being looked for at the other
    /// proxies now.
    looking: std::sync::Mutex<std::collections::HashSet<i64>>,
}

/// A keepalive stream's replies to its client.
type Replies = mpsc::Sender<Result<PbLeaseKeepAliveResponse, Status>>;

/// The leases sent on a stream to another proxy and not yet answered.
type Waiting = Arc<std::sync::Mutex<Vec<i64>>>;

/// A stream to another proxy: its requests, and the leases sent on it and not yet
/// answered.
#[derive(Clone)]
struct Relayed {
    requests: mpsc::Sender<PbLeaseKeepAliveRequest>,
    waiting: Waiting,
}

impl Relays {
    /// Marks lease `id` as being looked for; false when it already is.
    fn start_looking(&self, id: i64) -> bool {
        self.looking.lock().expect("looking lock").insert(id)
    }

    fn done_looking(&self, id: i64) {
        self.looking.lock().expect("looking lock").remove(&id);
    }

    /// Answers a renewal of lease `id`, which this proxy does not have: forwarded to
    /// the proxy it lives at, or taken over here (or TTL 0, as etcd answers, when it is
    /// nowhere). `denied` is the proxy that has just answered it does not have the
    /// lease: it is looked for again, a few times while it is still found there (it may
    /// have moved away and back), and then the client is told TTL 0.
    async fn unknown(self: Arc<Self>, id: i64, denied: Option<String>) {
        let api = &self.api;
        let caller = self.caller.as_deref();
        let mut look = tokio::time::interval(MOVED_LOOK);
        let mut looks = 0;
        let peer = loop {
            if denied.is_some() {
                look.tick().await;
            }
            let peer = match api
                .route(id, &self.metadata, caller, denied.is_some())
                .await
            {
                Ok(Some(peer)) => peer,
                Ok(None) => return take_over_and_answer(self.clone(), id).await,
                // The client hears why (its stream ends; clients open another).
                Err(refused) => {
                    tracing::warn!(error = %refused.message(), lease = format_args!("{id:x}"), "could not find where a lease lives");
                    let _ = self.tx.send(Err(refused)).await;
                    return;
                }
            };
            if denied.as_deref() != Some(peer.proxy.as_str()) {
                break peer;
            }
            looks += 1;
            if looks == MOVED_LOOKS {
                // Still found only there: it has no such lease (ended, or not the
                // caller's), as etcd answers.
                let _ = self.tx.send(Ok(api.kept_alive(id, 0))).await;
                return;
            }
        };
        let request = PbLeaseKeepAliveRequest { id };
        for _ in 0..2 {
            let Some(relayed) = self.stream_to(&peer) else {
                return;
            };
            metrics::counter!(m::ETCD_API_FORWARDED).increment(1);
            relayed.waiting.lock().expect("waiting lock").push(id);
            if relayed.requests.send(request).await.is_ok() {
                return;
            }
            relayed
                .waiting
                .lock()
                .expect("waiting lock")
                .retain(|w| *w != id);
            self.open.lock().expect("relays lock").remove(&peer.proxy);
        }
    }

    /// The TTL answered for a lease that is not here: 0 to a client, as etcd answers
    /// for a lease it does not have; [`MOVED_TTL`] to a proxy that forwarded the
    /// renewal, which then looks for the lease again.
    fn not_here(&self) -> i64 {
        match self.metadata.contains_key(forward::FORWARDED_FOR) {
            true => MOVED_TTL,
            false => 0,
        }
    }

    /// A new set of relays for the same client, with no stream open: what a renewal
    /// still unanswered uses once the client has half-closed its stream (and so let go
    /// of its relays), so the client still hears its answer.
    fn detached(&self) -> Arc<Relays> {
        Arc::new(Relays {
            api: self.api.clone(),
            caller: self.caller.clone(),
            metadata: self.metadata.clone(),
            tx: self.tx.clone(),
            open: Default::default(),
            looking: Default::default(),
        })
    }

    /// The stream to `peer`, opened if it is not yet.
    fn stream_to(self: &Arc<Self>, peer: &super::forward::Peer) -> Option<Relayed> {
        let mut open = self.open.lock().expect("relays lock");
        if let Some(relayed) = open.get(&peer.proxy) {
            return Some(relayed.clone());
        }
        let (sender, requests) = mpsc::channel(KEEPALIVE_BUFFER);
        let call = self
            .api
            .forwarded(
                &self.metadata,
                ReceiverStream::new(requests),
                self.caller.as_deref(),
            )
            .ok()?;
        let relayed = Relayed {
            requests: sender,
            waiting: Arc::default(),
        };
        open.insert(peer.proxy.clone(), relayed.clone());
        tokio::spawn(relay(
            Arc::downgrade(self),
            self.detached(),
            peer.clone(),
            call,
            relayed.waiting.clone(),
        ));
        Some(relayed)
    }
}

/// Relays the replies of the keepalive stream to `peer` to the client: a lease the
/// peer no longer has is looked for again before the client hears TTL 0. A stream that
/// fails or ends with renewals unanswered ends the client's stream with why, so the
/// client opens another and renews again (looked for afresh). Holds the relays weakly,
/// so the stream ends with the client's.
async fn relay(
    relays: std::sync::Weak<Relays>,
    detached: Arc<Relays>,
    peer: super::forward::Peer,
    call: Request<ReceiverStream<PbLeaseKeepAliveRequest>>,
    waiting: Waiting,
) {
    let tx = detached.tx.clone();
    let opened = peer
        .streaming::<_, PbLeaseKeepAliveRequest, PbLeaseKeepAliveResponse>(KEEP_ALIVE, call)
        .await;
    let mut replies = opened.map(Response::into_inner);
    loop {
        let reply = match &mut replies {
            Ok(replies) => replies.message().await,
            Err(status) => Err(status.clone()),
        };
        if let Ok(Some(reply)) = &reply {
            let mut waiting = waiting.lock().expect("waiting lock");
            if let Some(at) = waiting.iter().position(|w| *w == reply.id) {
                waiting.remove(at);
            }
        }
        match reply {
            // Renewed there, or expired there (a lease that expired never lives again).
            Ok(Some(reply)) if reply.ttl >= 0 => {
                if reply.ttl == 0 {
                    if let Some(relays) = relays.upgrade() {
                        relays.api.peers.forget(reply.id);
                    }
                }
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
            // Not there: it moved.
            Ok(Some(reply)) => {
                // The client may have half-closed its stream since: it still hears.
                let relays = relays.upgrade().unwrap_or_else(|| detached.detached());
                relays.api.peers.forget(reply.id);
                tokio::spawn(relays.unknown(reply.id, Some(peer.proxy.clone())));
            }
            // The peer is gone, draining or refusing: its leases are looked for again
            // at their next renewal.
            ended => {
                if let Some(relays) = relays.upgrade() {
                    relays.open.lock().expect("relays lock").remove(&peer.proxy);
                    relays.api.peers.forget_proxy(&peer.proxy);
                }
                if !waiting.lock().expect("waiting lock").is_empty() {
                    let why = match ended {
                        Err(status) => status,
                        _ => Status::unavailable(format!(
                            "etcdserver: proxy {}, where a lease of this stream lives, ended its stream; renew again",
                            peer.proxy
                        )),
                    };
                    let _ = tx.send(Err(why)).await;
                }
                return;
            }
        }
    }
}

impl EtcdApi {
    fn kept_alive(&self, id: i64, ttl: i64) -> PbLeaseKeepAliveResponse {
        PbLeaseKeepAliveResponse {
            header: Some(self.header(self.state.cell.seen())),
            id,
            ttl,
        }
    }
}

/// How often a renewal waiting for the proxy's lease looks again.
const UNBACKED_LOOK: Duration = Duration::from_millis(50);

/// What a renewal from memory found.
enum Renewal {
    /// The TTL to answer (0: the lease expired, as etcd answers).
    Ttl(i64),
    /// The proxy cannot back even a second of it now.
    Unbacked,
    /// Not here: perhaps handed over by another proxy.
    Unknown,
    /// Handed over by this proxy, draining.
    HandedOff,
}

/// Renews lease `id` from memory.
fn renew(state: &ProxyState, id: i64, caller: Option<&str>) -> Renewal {
    let now = Instant::now();
    let validity = |r: Renewed| {
        let left = state.leases.left(r.bucket, r.lease, now);
        left.min(state.leases.within(r.ttl))
    };
    match state.sessions.renew(&session_of(id), caller, now, validity) {
        Ok(valid_for) if valid_for >= Duration::from_secs(1) => Renewal::Ttl(seconds(valid_for)),
        Ok(_) => {
            metrics::counter!(m::ETCD_API_KEEPALIVES_UNBACKED).increment(1);
            Renewal::Unbacked
        }
        Err(Gone::HandedOff) => Renewal::HandedOff,
        Err(Gone::Unknown) => Renewal::Unknown,
        Err(Gone::Expired(_)) => Renewal::Ttl(0),
    }
}
