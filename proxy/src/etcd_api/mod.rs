//! etcd's own v3 gRPC API on the proxy (`--etcd-listen`), so that etcd clients in any
//! language use the cell through the proxy unchanged (docs/etcd-api.md).
//!
//! # Layout
//! - [`keys`]: the namespace: client key `K` is lockcell's small key `/k/K`.
//! - [`auth`]: who calls: a client certificate, or a login with a grants file token.
//! - [`ids`]: lease IDs unique across the cell.
//! - [`lease`]: a lease is a session of this proxy's.
//! - [`handoff`]: a draining proxy hands its leases over to the next proxy their
//!   clients reach.
//! - [`forward`]: a call on a lease that lives at another proxy is forwarded there.
//! - [`kv`]: ranges, puts, deletes and transactions over the small keys.
//! - [`watch`]: client watch streams relayed to etcd's.
//! - [`lock`]: etcd's Lock service, as etcd's own recipe on the caller's lease.
//! - [`election`]: etcd's Election service, the same way.
//! - [`turns`]: calls on one key (a lease's take-over, a lock key's placing) taking
//!   turns.
//! - [`gateway`]: etcd's JSON gateway (`POST /v3/kv/range`, …) over the services above.
//! - this file: Maintenance and Cluster, what they refuse, and the server.

pub mod auth;
pub mod election;
pub mod forward;
pub mod gateway;
pub mod handoff;
pub mod ids;
pub mod keys;
pub mod kv;
pub mod lease;
pub mod lock;
mod turns;
pub mod watch;

use std::pin::Pin;
use std::sync::Arc;

use dashmap::DashMap;
use etcd_client::proto::*;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::state::ProxyState;

/// The etcd API of one proxy, on the one cell it serves.
#[derive(Clone)]
pub struct EtcdApi {
    state: Arc<ProxyState>,
    ids: Arc<ids::LeaseIds>,
    /// The cell's id, as etcd headers carry it.
    cluster_id: u64,
    /// This proxy's member id: stable for its proxy id.
    member_id: u64,
    /// Held shared by each leased write from its session's lookup until its key is
    /// recorded; a hand-off takes it alone, so its records name every key.
    writes: Arc<tokio::sync::RwLock<()>>,
    /// Held shared by each leased write from its last look at its lease's session
    /// until etcd answers it; a revoke takes it alone, after it closed the session, so
    /// every write on the lease has then landed or will never be sent.
    sending: Arc<tokio::sync::RwLock<()>>,
    /// By lease: the session fence's mod revision, for leases taken over here.
    fences: Arc<DashMap<i64, i64>>,
    /// By lease: the turn of each take-over under way.
    taking: Arc<turns::Turns<i64>>,
    /// By lock key: the turn of each Lock or Campaign placing it, so a second call of
    /// one lease finds the first's key recorded as the lease's.
    placing: Arc<turns::Turns<Vec<u8>>>,
    /// Turns true once a drain's hand-off is written ([`ProxyState::handed_off`]).
    handed_off: Arc<tokio::sync::watch::Sender<bool>>,
    /// The other proxies, for calls on leases that live there.
    peers: Arc<forward::Peers>,
    /// Turns to have a client write in etcd (`--etcd-writes-in-flight`), first come
    /// first served.
    in_etcd: Arc<tokio::sync::Semaphore>,
    /// Held by a Txn's gather of its leases, from its check of the identity's limits
    /// until its leases are here: gathers one at a time, so each checks what the last
    /// brought.
    gathering: Arc<tokio::sync::Mutex<()>>,
}

impl EtcdApi {
    pub fn new(state: Arc<ProxyState>) -> Self {
        let cluster_id = u64::from_str_radix(&state.cell.record.cluster_id, 16).unwrap_or_default();
        let member_id = member_id(&state.proxy_id);
        let handed_off = tokio::sync::watch::Sender::new(false);
        let _ = state.handed_off.set(handed_off.subscribe());
        // A key deleted, or written without its lease, is no longer the lease's: its
        // session forgets it (as etcd detaches it), so that the session's records hold
        // only what its end must delete.
        let weak = Arc::downgrade(&state);
        state.reads.feed.on_detached(Box::new(move |lost| {
            let Some(state) = weak.upgrade() else {
                return;
            };
            for key in lost {
                state.sessions.forget_detached(
                    &lease::session_of(key.client_lease),
                    &format!("{}{}", lockcell_cell::keyspace::kv_root(), key.name),
                    key.created,
                    key.at,
                );
            }
        }));
        let in_etcd = Arc::new(tokio::sync::Semaphore::new(
            state.config.etcd_writes_in_flight as usize,
        ));
        EtcdApi {
            state,
            ids: Arc::default(),
            cluster_id,
            member_id,
            writes: Arc::default(),
            sending: Arc::default(),
            fences: Arc::default(),
            taking: Arc::default(),
            placing: Arc::default(),
            handed_off: Arc::new(handed_off),
            peers: Arc::default(),
            in_etcd,
            gathering: Arc::default(),
        }
    }

    /// A reply header at the cell's `revision`.
    fn header(&self, revision: i64) -> PbResponseHeader {
        PbResponseHeader {
            cluster_id: self.cluster_id,
            member_id: self.member_id,
            revision,
            raft_term: 0,
        }
    }

    /// Forgets the session fences of leases whose session is gone.
    pub fn prune(&self) {
        let sessions = &self.state.sessions;
        self.fences
            .retain(|id, _| sessions.peek(&lease::session_of(*id)).is_some());
    }

    /// Whether the proxy is cut off from etcd as far as a client that requires a leader
    /// is concerned: one of its etcd leases is missing, or overdue for renewal (the
    /// point at which it asks its own clients to move).
    pub(crate) fn without_leader(&self) -> bool {
        let (state, now) = (&self.state, tokio::time::Instant::now());
        (0..state.leases.len()).any(|bucket| match state.leases.lease(bucket) {
            Some(lease) => {
                crate::handover::lease_trouble(state, state.leases.left(bucket, lease, now))
            }
            None => true,
        })
    }

    /// Refuses a stream that requires a leader while the proxy is cut off from etcd.
    pub(crate) fn check_leader<T>(&self, request: &Request<T>) -> Result<bool, Status> {
        let required = requires_leader(request);
        if required && self.without_leader() {
            return Err(Status::unavailable(NO_LEADER));
        }
        Ok(required)
    }

    /// The live session of lease `id`, the caller's own: here, or taken over now from
    /// a proxy that handed it off. NOT_FOUND (etcd's text) for any other lease;
    /// UNAVAILABLE ([`refused_handed_off`]) for one this proxy handed off, once a hand-over
    /// to a proxy that asked for it has settled: nothing was done, and the call goes on
    /// where the lease is ([`EtcdApi::on_lease`]), or, from a draining proxy, the client
    /// goes on elsewhere.
    pub(super) async fn lease_session(
        &self,
        id: i64,
        caller: Option<&str>,
    ) -> Result<crate::sessions::Session, Status> {
        use crate::sessions::Gone;
        let not_found = || Status::not_found(lease::LEASE_NOT_FOUND);
        let session_id = lease::session_of(id);
        let sessions = &self.state.sessions;
        let moving = sessions.is_handed_off(&session_id);
        if moving {
            // On its way to a proxy that asked for it, or arriving here: the call goes
            // on where it ends up.
            self.hand_over_settled(id).await;
        }
        let session = match sessions.get(&session_id, tokio::time::Instant::now()) {
            Ok(s) => s,
            Err(Gone::Unknown) => match self.take_over(id, caller).await? {
                handoff::TakeOver::Taken(s) => s,
                // Gone on to another proxy while the call waited.
                handoff::TakeOver::NoRecord if moving => return Err(refused_handed_off()),
                handoff::TakeOver::NoRecord => return Err(not_found()),
            },
            Err(Gone::Expired(_)) => return Err(not_found()),
            Err(Gone::HandedOff) => return Err(refused_handed_off()),
        };
        if !session.owned_by(caller) {
            return Err(not_found());
        }
        if session.life.is_handed_off() {
            return Err(refused_handed_off());
        }
        Ok(session)
    }

    /// Serves the etcd API on `listener` until `stop` (with the lockcell API's TLS, when
    /// it has one).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        tls: Option<Arc<crate::tls::ReloadingTls>>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let pruning = tokio::spawn({
            let api = self.clone();
            let mut stop = stop.clone();
            async move {
                let mut tick = tokio::time::interval(std::time::Duration::from_secs(30));
                loop {
                    tokio::select! {
                        _ = tick.tick() => api.prune(),
                        _ = stop.wait_for(|s| *s) => return,
                    }
                }
            }
        });
        let handing_off = tokio::spawn(self.clone().hand_off_on_drain());
        let keyed = tokio::spawn(self.clone().load_forward_key());
        let size = self.state.config.max_value_bytes + 64 * 1024;
        let size = size.max(2 * 1024 * 1024);
        let grpc = tonic::service::Routes::new(
            PbKvServer::new(self.clone()).max_decoding_message_size(size),
        )
        .add_service(PbLeaseServer::new(self.clone()))
        .add_service(PbWatchServer::new(self.clone()))
        .add_service(PbMaintenanceServer::new(self.clone()))
        .add_service(PbClusterServer::new(self.clone()))
        .add_service(lockcell_proto::etcd_auth::auth_server::AuthServer::new(
            self.clone(),
        ))
        .add_service(lockcell_proto::etcd_lock::lock_server::LockServer::new(
            self.clone(),
        ))
        .add_service(
            lockcell_proto::etcd_election::election_server::ElectionServer::new(self.clone()),
        )
        .prepare();
        let server = crate::listen::client_server(&self.state.config, crate::overhead::Api::Etcd);
        let api = self;
        // etcd's JSON gateway beside the gRPC services, on HTTP/1.1 as well as HTTP/2:
        // base64 and JSON take up to 3 bytes of request for each byte of the call.
        let routes = gateway::router(api, grpc, 3 * size);
        let router = server
            .accept_http1(true)
            .add_routes(tonic::service::Routes::from(routes));
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let served = match tls {
            Some(tls) => {
                router
                    .serve_with_incoming_shutdown(crate::tls::incoming(listener, tls), stopped)
                    .await
            }
            None => {
                router
                    .serve_with_incoming_shutdown(crate::listen::incoming(listener), stopped)
                    .await
            }
        };
        pruning.abort();
        handing_off.abort();
        keyed.abort();
        served.map_err(|e| anyhow::anyhow!("the etcd API's server failed: {e}"))
    }
}

/// An etcd call's failure as the etcd API answers it: a refusal of etcd's own that a
/// retry will not change (a duplicate key in a transaction, a request too large, a
/// revision compacted or not yet written) with etcd's code and text, as a client of
/// etcd expects them; anything else (no answer, no leader) as the lockcell API does.
pub(crate) fn etcd_error(e: lockcell_cell::CellError) -> Status {
    use tonic::Code;
    if let lockcell_cell::CellError::Etcd {
        source: etcd_client::Error::GRpcStatus(status),
        ..
    } = &e
    {
        if matches!(
            status.code(),
            Code::InvalidArgument
                | Code::OutOfRange
                | Code::FailedPrecondition
                | Code::NotFound
                | Code::PermissionDenied
                | Code::ResourceExhausted
        ) {
            return Status::new(status.code(), status.message());
        }
    }
    crate::errors::ProxyError::from(e).into()
}

/// etcd's refusal of a stream that asks for a leader when there is none.
pub(crate) const NO_LEADER: &str = "etcdserver: no leader";

/// Whether a client asked that its stream end when etcd has no leader (Go's
/// `clientv3.WithRequireLeader`: the `hasleader` metadata).
pub(crate) fn requires_leader<T>(request: &Request<T>) -> bool {
    request
        .metadata()
        .get("hasleader")
        .is_some_and(|v| v.as_bytes() == b"true")
}

/// How long a write through the etcd API waits for etcd: etcd's own request timeout
/// (5 s and two election timeouts), so a client waits on a busy cell as long as it
/// would on etcd itself, and never less than `--etcd-timeout`. An answer that does not
/// come is an unknown outcome, kept as one (see `crate::unsettled`).
pub(crate) fn write_timeout(etcd_timeout: std::time::Duration) -> std::time::Duration {
    etcd_timeout.max(std::time::Duration::from_secs(7))
}

/// How often a stream that requires a leader looks again.
pub(crate) const LEADER_LOOK: std::time::Duration = std::time::Duration::from_secs(1);

/// The refusal of a call on a lease this proxy handed off while draining.
pub(crate) fn refused_handed_off() -> Status {
    Status::unavailable(
        "etcdserver: this proxy handed the lease over (it is shutting down, or another proxy asked for the lease); call again, at another endpoint if this one is going away",
    )
}

/// A stable member id for a proxy: its id's hash (never 0).
fn member_id(proxy_id: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(proxy_id.as_bytes());
    let mut bytes = [0; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(bytes).max(1)
}

/// What the etcd API refuses on purpose: UNIMPLEMENTED, naming the RPC and why.
fn refused(rpc: &str, why: &str) -> Status {
    Status::unimplemented(format!(
        "{rpc} is not served through a lockcell proxy: {why}"
    ))
}

const OPERATORS: &str = "it acts on etcd's members, which the cell's operators run";

#[tonic::async_trait]
impl PbMaintenanceService for EtcdApi {
    async fn alarm(&self, _: Request<PbAlarmRequest>) -> Result<Response<PbAlarmResponse>, Status> {
        Err(refused("Alarm", OPERATORS))
    }

    async fn status(
        &self,
        _: Request<PbStatusRequest>,
    ) -> Result<Response<PbStatusResponse>, Status> {
        let revision = self.state.cell.seen();
        Ok(Response::new(PbStatusResponse {
            header: Some(self.header(revision)),
            version: format!("lockcell-proxy {}", env!("CARGO_PKG_VERSION")),
            leader: self.member_id,
            raft_index: revision.max(0) as u64,
            raft_applied_index: revision.max(0) as u64,
            ..PbStatusResponse::default()
        }))
    }

    async fn defragment(
        &self,
        _: Request<PbDefragmentRequest>,
    ) -> Result<Response<PbDefragmentResponse>, Status> {
        Err(refused("Defragment", OPERATORS))
    }

    async fn hash(&self, _: Request<PbHashRequest>) -> Result<Response<PbHashResponse>, Status> {
        Err(refused("Hash", OPERATORS))
    }

    async fn hash_kv(
        &self,
        _: Request<PbHashKvRequest>,
    ) -> Result<Response<PbHashKvResponse>, Status> {
        Err(refused("HashKV", OPERATORS))
    }

    type SnapshotStream = Pin<Box<dyn Stream<Item = Result<PbSnapshotResponse, Status>> + Send>>;

    async fn snapshot(
        &self,
        _: Request<PbSnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        Err(refused(
            "Snapshot",
            "back the cell up from etcd itself (docs/operations.md, backups)",
        ))
    }

    async fn move_leader(
        &self,
        _: Request<PbMoveLeaderRequest>,
    ) -> Result<Response<PbMoveLeaderResponse>, Status> {
        Err(refused("MoveLeader", OPERATORS))
    }

    async fn downgrade(
        &self,
        _: Request<PbDowngradeRequest>,
    ) -> Result<Response<PbDowngradeResponse>, Status> {
        Err(refused("Downgrade", OPERATORS))
    }
}

#[tonic::async_trait]
impl PbClusterService for EtcdApi {
    async fn member_add(
        &self,
        _: Request<PbMemberAddRequest>,
    ) -> Result<Response<PbMemberAddResponse>, Status> {
        Err(refused("MemberAdd", OPERATORS))
    }

    async fn member_remove(
        &self,
        _: Request<PbMemberRemoveRequest>,
    ) -> Result<Response<PbMemberRemoveResponse>, Status> {
        Err(refused("MemberRemove", OPERATORS))
    }

    async fn member_update(
        &self,
        _: Request<PbMemberUpdateRequest>,
    ) -> Result<Response<PbMemberUpdateResponse>, Status> {
        Err(refused("MemberUpdate", OPERATORS))
    }

    /// This proxy, as the one member: a client that syncs its endpoints keeps to the
    /// proxy and never goes around it to etcd.
    /// The cell's proxies that serve the etcd API (this one first), each at its
    /// advertised address: clients that sync their endpoints find the proxies, never
    /// etcd.
    async fn member_list(
        &self,
        _: Request<PbMemberListRequest>,
    ) -> Result<Response<PbMemberListResponse>, Status> {
        let config = &self.state.config;
        let scheme = if crate::listen::tls_files(config).is_some() {
            "https"
        } else {
            "http"
        };
        let member = |proxy: &str, address: Option<String>| PbMember {
            id: member_id(proxy),
            name: proxy.to_owned(),
            peer_ur_ls: Vec::new(),
            client_ur_ls: address
                .map(|a| format!("{scheme}://{a}"))
                .into_iter()
                .collect(),
            is_learner: false,
        };
        let mut members = vec![member(&self.state.proxy_id, config.etcd_advertised())];
        for other in self.presence(true).await.unwrap_or_default().iter() {
            if other.proxy_id != self.state.proxy_id && other.etcd.is_some() {
                members.push(member(&other.proxy_id, other.etcd.clone()));
            }
        }
        Ok(Response::new(PbMemberListResponse {
            header: Some(self.header(self.state.cell.seen())),
            members,
        }))
    }

    async fn member_promote(
        &self,
        _: Request<PbMemberPromoteRequest>,
    ) -> Result<Response<PbMemberPromoteResponse>, Status> {
        Err(refused("MemberPromote", OPERATORS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proxys_member_id_is_stable_and_its_own() {
        assert_eq!(member_id("a-1"), member_id("a-1"));
        assert_ne!(member_id("a-1"), member_id("a-2"));
        assert_ne!(member_id(""), 0);
    }
}
