//! etcd's Election service (jetcd's and the Go and Rust clients' election calls), as
//! etcd itself serves it: the recipe of Go's `concurrency.Election`, run in the proxy on
//! the caller's lease, beside the Lock service's ([`super::lock`]). A candidate's key is
//! `NAME/<lease in hex>`, created on its lease with its value; the leader is the key
//! under `NAME/` with the earliest create revision; a proclamation rewrites the
//! leader's value while its key still has the create revision it led with; resigning
//! deletes the key, and so does the lease's end. Campaign, Proclaim and Resign take the
//! lock right on the name, Leader and Observe the read right.

use std::pin::Pin;

use etcd_client::proto::{PbCompare, PbCompareTarget, PbPutRequest, PbTargetUnion};
use etcd_client::proto::{PbTxnOpRequest, PbTxnRequest, PbTxnRequestOp};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, SortOrder, SortTarget, TxnOp, WatchOptions,
};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace::prefix_end;
use lockcell_proto::etcd_election::election_server::Election;
use lockcell_proto::etcd_election::{
    CampaignRequest, CampaignResponse, KeyValue, LeaderKey, LeaderRequest, LeaderResponse,
    ProclaimRequest, ProclaimResponse, ResignRequest, ResignResponse, ResponseHeader,
};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::keys::inner;
use super::EtcdApi;
use crate::access::Right;

/// etcd's text when a proclamation or resignation names a key that no longer leads.
pub const NOT_LEADER: &str = "election: not leader";

/// etcd's text when an election has no candidate.
pub const NO_LEADER: &str = "election: no leader";

/// Leaders buffered per Observe stream.
const OBSERVE_BUFFER: usize = 16;

#[tonic::async_trait]
impl Election for EtcdApi {
    async fn campaign(
        &self,
        request: Request<CampaignRequest>,
    ) -> Result<Response<CampaignResponse>, Status> {
        let caller = self.caller(&request)?;
        self.may(caller.as_deref(), Right::Lock, &request.get_ref().name)?;
        let (lease, campaign) = (request.get_ref().lease, "/v3electionpb.Election/Campaign");
        let here = || self.campaign_here(caller.clone(), request.get_ref());
        self.on_lease(
            (lease, campaign),
            &request,
            caller.as_deref(),
            |_| false,
            here,
        )
        .await
    }

    async fn proclaim(
        &self,
        request: Request<ProclaimRequest>,
    ) -> Result<Response<ProclaimResponse>, Status> {
        let caller = self.caller(&request)?;
        let lease = request.get_ref().leader.as_ref().map_or(0, |l| l.lease);
        let proclaim = "/v3electionpb.Election/Proclaim";
        if let Some(there) = self
            .forward_unary(lease, proclaim, &request, caller.as_deref(), |_| false)
            .await?
        {
            return Ok(there);
        }
        let req = request.into_inner();
        let leader = req
            .leader
            .ok_or_else(|| Status::invalid_argument("a proclamation names its leader key"))?;
        self.may(caller.as_deref(), Right::Lock, &leader.name)?;
        let revision = self
            .proclaim_as(caller, &leader.key, leader.rev, leader.lease, &req.value)
            .await?;
        Ok(Response::new(ProclaimResponse {
            header: Some(self.election_header(revision)),
        }))
    }

    async fn leader(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        let caller = self.caller(&request)?;
        let name = request.into_inner().name;
        self.may(caller.as_deref(), Right::Read, &name)?;
        self.state.pace(caller.as_deref())?;
        let (revision, kv) = self.first_candidate(&name).await?;
        let kv = kv.ok_or_else(|| Status::unknown(NO_LEADER))?;
        Ok(Response::new(LeaderResponse {
            header: Some(self.election_header(revision)),
            kv: Some(kv),
        }))
    }

    type ObserveStream = Pin<Box<dyn Stream<Item = Result<LeaderResponse, Status>> + Send>>;

    async fn observe(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        let caller = self.caller(&request)?;
        let name = request.into_inner().name;
        // Each value proclaimed, as it changes: a read over time, as Observe is on the
        // lockcell API (docs/security.md).
        self.may(caller.as_deref(), Right::Watch, &name)?;
        self.state.pace(caller.as_deref())?;
        // An observer is a watch: it counts as one of its identity's while it lasts.
        let place = self
            .state
            .take(caller.as_deref(), lockcell_cell::grants::Limit::Watches)?;
        let (tx, rx) = mpsc::channel(OBSERVE_BUFFER);
        let api = self.clone();
        tokio::spawn(async move {
            let _place = place;
            let mut shutdown = api.state.shutdown.clone();
            let ended = tokio::select! {
                ended = api.observe_leaders(&name, &tx) => ended,
                _ = tx.closed() => Ok(()),
                _ = shutdown.wait_for(|stop| *stop) => {
                    Err(Status::unavailable(super::watch::STOPPING))
                }
            };
            if let Err(e) = ended {
                let _ = tx.send(Err(e)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn resign(
        &self,
        request: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        let caller = self.caller(&request)?;
        let leader = request
            .into_inner()
            .leader
            .ok_or_else(|| Status::invalid_argument("a resignation names its leader key"))?;
        self.may(caller.as_deref(), Right::Lock, &leader.name)?;
        self.paced_unless_shown(caller.as_deref(), &leader.key)?;
        let key = inner(&leader.key);
        let map_revision = self.map_revision(&leader.key, &[])?;
        // As etcd's: a key that no longer leads with that revision is left alone.
        let outcome = self
            .guarded(
                vec![TxnOp::txn(
                    etcd_client::Txn::new()
                        .when([Compare::create_revision(
                            key.clone(),
                            CompareOp::Equal,
                            leader.rev,
                        )])
                        .and_then(super::kv::deleted_with_record(&leader.key)),
                )],
                map_revision,
                &self.writer(caller, None),
            )
            .await
            .map_err(super::etcd_error)?;
        let revision = outcome.header.as_ref().map_or(0, |h| h.revision);
        Ok(Response::new(ResignResponse {
            header: Some(self.election_header(revision)),
        }))
    }
}

impl EtcdApi {
    /// A Campaign run here: its lease is here (or nowhere).
    async fn campaign_here(
        &self,
        caller: Option<String>,
        req: &CampaignRequest,
    ) -> Result<Response<CampaignResponse>, Status> {
        if req.lease == 0 {
            return Err(Status::invalid_argument(format!(
                "a campaign in {:?} needs a lease: grant one and name it",
                String::from_utf8_lossy(&req.name)
            )));
        }
        let in_progress =
            self.admit_wait(caller.as_deref(), &req.name, req.lease, req.value.len())?;
        let key = candidate_key(&req.name, req.lease);
        // As a Lock call: the wait runs on its own, and a caller who hangs up takes out
        // only a key this call made.
        let (done, answer) = oneshot::channel();
        let api = self.clone();
        let (lease, value) = (req.lease, req.value.clone());
        tokio::spawn(async move {
            let _in_progress = in_progress;
            let placed = match api.place(caller.clone(), &key, lease, &value).await {
                Ok(placed) => placed,
                Err(refused) => {
                    let _ = done.send(Err(refused));
                    return;
                }
            };
            // An earlier campaign of the lease stands with another value: this one
            // proclaims its own, as etcd's does.
            if !placed.created && placed.value != value {
                let proclaimed = api
                    .proclaim_as(caller, &key, placed.revision, lease, &value)
                    .await;
                if let Err(refused) = proclaimed {
                    let _ = done.send(Err(refused));
                    return;
                }
            }
            let granted = |revision| (key.clone(), placed.revision, revision);
            api.wait_turn(&key, &placed, lease, done, granted).await;
        });
        // The task's etcd calls and its wait count as time outside the proxy.
        let (key, created, revision) = lockcell_cell::timing::waiting(answer)
            .await
            .map_err(|_| Status::unavailable("the campaign's wait ended with the proxy"))??;
        Ok(Response::new(CampaignResponse {
            header: Some(self.election_header(revision)),
            leader: Some(LeaderKey {
                name: req.name.clone(),
                key,
                rev: created,
                lease,
            }),
        }))
    }

    fn election_header(&self, revision: i64) -> ResponseHeader {
        let h = self.header(revision);
        ResponseHeader {
            cluster_id: h.cluster_id,
            member_id: h.member_id,
            revision: h.revision,
            raft_term: h.raft_term,
        }
    }

    /// Rewrites the value of candidate `key` (client key) on `lease` if its create
    /// revision is still `created`: etcd's "not leader" otherwise. Through a Txn, so
    /// the key is recorded in the lease's session as any leased put.
    async fn proclaim_as(
        &self,
        caller: Option<String>,
        key: &[u8],
        created: i64,
        lease: i64,
        value: &[u8],
    ) -> Result<i64, Status> {
        let txn = PbTxnRequest {
            compare: vec![PbCompare {
                result: CompareOp::Equal as i32,
                target: PbCompareTarget::Create as i32,
                key: key.to_vec(),
                target_union: Some(PbTargetUnion::CreateRevision(created)),
                range_end: Vec::new(),
            }],
            success: vec![PbTxnRequestOp {
                request: Some(PbTxnOpRequest::RequestPut(PbPutRequest {
                    key: key.to_vec(),
                    value: value.to_vec(),
                    lease,
                    ..PbPutRequest::default()
                })),
            }],
            failure: Vec::new(),
        };
        let reply = self.txn_as(caller, txn).await?;
        if !reply.succeeded {
            return Err(Status::failed_precondition(NOT_LEADER));
        }
        Ok(reply.header.as_ref().map_or(0, |h| h.revision))
    }

    /// The revision read at, and the election `name`'s first candidate, if any.
    async fn first_candidate(&self, name: &[u8]) -> Result<(i64, Option<KeyValue>), Status> {
        let state = &self.state;
        let prefix = candidates(name);
        let options = GetOptions::new()
            .with_range(inner(&prefix_end(&prefix)))
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let got = with_timeout(
            "api election leader",
            state.config.etcd_timeout,
            state.etcd.kv_client().get(inner(&prefix), Some(options)),
        )
        .await
        .map_err(super::etcd_error)?;
        let revision = got.header().map_or(0, |h| h.revision());
        let first = match got.kvs().first() {
            Some(kv) => Some(self.outward(kv).await),
            None => None,
        };
        Ok((revision, first))
    }

    /// A key as a client of the election sees it, its client lease as the proxy's copy
    /// of the small keys shows it once caught up with the key's write.
    async fn outward(&self, kv: &etcd_client::KeyValue) -> KeyValue {
        if kv.lease() != 0 {
            self.caught_up(kv.mod_revision()).await;
        }
        let mut pb = etcd_client::proto::PbKeyValue {
            key: kv.key().to_vec(),
            create_revision: kv.create_revision(),
            mod_revision: kv.mod_revision(),
            version: kv.version(),
            value: kv.value().to_vec(),
            lease: kv.lease(),
        };
        self.outward_kv(&mut pb);
        KeyValue {
            key: pb.key,
            create_revision: pb.create_revision,
            mod_revision: pb.mod_revision,
            version: pb.version,
            value: pb.value,
            lease: pb.lease,
        }
    }

    /// Sends each leader of election `name` in turn, and each of its proclamations, as
    /// etcd's Observe does: the first candidate (or, with none, the first key put under
    /// the name), then its key's changes until it is deleted, then the next.
    async fn observe_leaders(
        &self,
        name: &[u8],
        tx: &mpsc::Sender<Result<LeaderResponse, Status>>,
    ) -> Result<(), Status> {
        let prefix = candidates(name);
        loop {
            let (mut revision, first) = self.first_candidate(name).await?;
            let leader = match first {
                Some(kv) => kv,
                None => {
                    let (rev, kv) = self.first_put(&prefix, revision + 1).await?;
                    revision = rev;
                    kv
                }
            };
            let key = inner(&leader.key);
            if tx
                .send(Ok(self.leader_response(revision, leader)))
                .await
                .is_err()
            {
                return Ok(());
            }
            let options = WatchOptions::new().with_start_revision(revision + 1);
            let (_watcher, mut events) = self
                .state
                .etcd
                .watch_client()
                .watch(key, Some(options))
                .await
                .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?
                .split();
            'leading: loop {
                let told = events
                    .message()
                    .await
                    .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?
                    .ok_or_else(|| Status::unavailable("etcd ended the election's watch"))?;
                if told.canceled() {
                    return Err(Status::unavailable(format!(
                        "etcd cancelled the election's watch: {}",
                        told.cancel_reason()
                    )));
                }
                let at = told.header().map_or(0, |h| h.revision());
                for event in told.events() {
                    if event.event_type() == EventType::Delete {
                        break 'leading;
                    }
                    if let Some(kv) = event.kv() {
                        let leader = self.outward(kv).await;
                        let sent = tx.send(Ok(self.leader_response(at, leader)));
                        if sent.await.is_err() {
                            return Ok(());
                        }
                    }
                }
            }
        }
    }

    /// Waits for the first key put under `prefix` (client keys) from `revision` on.
    async fn first_put(&self, prefix: &[u8], revision: i64) -> Result<(i64, KeyValue), Status> {
        let options = WatchOptions::new()
            .with_start_revision(revision)
            .with_range(inner(&prefix_end(prefix)));
        let (_watcher, mut events) = self
            .state
            .etcd
            .watch_client()
            .watch(inner(prefix), Some(options))
            .await
            .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?
            .split();
        loop {
            let told = events
                .message()
                .await
                .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?
                .ok_or_else(|| Status::unavailable("etcd ended the election's watch"))?;
            let at = told.header().map_or(0, |h| h.revision());
            let put = told
                .events()
                .iter()
                .find(|e| e.event_type() == EventType::Put)
                .and_then(|e| e.kv());
            if let Some(kv) = put {
                return Ok((at, self.outward(kv).await));
            }
        }
    }

    fn leader_response(&self, revision: i64, kv: KeyValue) -> LeaderResponse {
        LeaderResponse {
            header: Some(self.election_header(revision)),
            kv: Some(kv),
        }
    }
}

/// The prefix of election `name`'s candidate keys (client keys): `NAME/`.
fn candidates(name: &[u8]) -> Vec<u8> {
    let mut prefix = name.to_vec();
    prefix.push(b'/');
    prefix
}

/// The key lease `lease` campaigns with in election `name` (client key).
fn candidate_key(name: &[u8], lease: i64) -> Vec<u8> {
    let mut key = candidates(name);
    key.extend_from_slice(format!("{lease:x}").as_bytes());
    key
}
