//! etcd's Watch service: each client watch stream is relayed to one etcd watch stream of
//! the proxy's, with every key moved into the small-key space on the way in and out of
//! it on the way back. Watch IDs, revisions, progress notifications, compaction and
//! cancellation are etcd's own, so clients that resume from a revision or order by it
//! (Go's `concurrency` package) see what etcd would show them.
//!
//! A relay costs etcd one watch stream per client stream: joining the proxy's fan-out
//! (one etcd watch for every client) is still to come (docs/etcd-api.md).

use std::pin::Pin;

use etcd_client::proto::{PbWatchRequest, PbWatchRequestUnion, PbWatchResponse, PbWatchService};
use etcd_client::{WatchFilterType, WatchOptions, WatchRequestSender, WatchResponseStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::keys::inner_range;
use super::EtcdApi;
use crate::grants::Right;

/// Replies buffered per client stream before the relay stops reading etcd's.
const BUFFER: usize = 64;

type Replies = mpsc::Sender<Result<PbWatchResponse, Status>>;

#[tonic::async_trait]
impl PbWatchService for EtcdApi {
    type WatchStream = Pin<Box<dyn Stream<Item = Result<PbWatchResponse, Status>> + Send>>;

    async fn watch(
        &self,
        request: Request<Streaming<PbWatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let identity = self.caller(&request)?;
        let leader_required = self.check_leader(&request)?;
        let input = request.into_inner();
        let (tx, rx) = mpsc::channel(BUFFER);
        let api = self.clone();
        tokio::spawn(async move {
            if let Err(status) = api.relay(input, identity, leader_required, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Why a stream ends when the proxy stops.
pub(super) const STOPPING: &str = "etcdserver: this proxy is shutting down; use another endpoint";

impl EtcdApi {
    /// Relays one client watch stream until either side ends it or the proxy stops.
    async fn relay(
        &self,
        mut input: Streaming<PbWatchRequest>,
        identity: Option<String>,
        leader_required: bool,
        tx: &Replies,
    ) -> Result<(), Status> {
        let mut shutdown = self.state.shutdown.clone();
        let mut look = tokio::time::interval(super::LEADER_LOOK);
        // The etcd stream, opened with the first watch the client creates.
        let mut etcd: Option<(WatchRequestSender, WatchResponseStream)> = None;
        // A client that half-closes its stream keeps its watches, as etcd keeps them
        // (etcd's JSON gateway half-closes once the request body is read).
        let mut asking = true;
        loop {
            let from_etcd = async {
                match etcd.as_mut() {
                    Some((_, replies)) => replies.message().await,
                    None => std::future::pending().await,
                }
            };
            enum Next {
                Asked(Result<Option<PbWatchRequest>, Status>),
                Told(Result<Option<etcd_client::WatchResponse>, etcd_client::Error>),
                Look,
                Stop,
            }
            let next = tokio::select! {
                asked = input.message(), if asking => Next::Asked(asked),
                told = from_etcd => Next::Told(told),
                _ = look.tick(), if leader_required => Next::Look,
                _ = shutdown.wait_for(|stop| *stop) => Next::Stop,
                _ = tx.closed() => return Ok(()),
            };
            match next {
                Next::Look => {
                    if self.without_leader() {
                        return Err(Status::unavailable(super::NO_LEADER));
                    }
                }
                Next::Asked(asked) => {
                    let Some(asked) = asked? else {
                        asking = false;
                        continue;
                    };
                    self.forward(asked, identity.as_deref(), &mut etcd, tx)
                        .await?;
                }
                Next::Told(told) => {
                    let told = told
                        .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?
                        .ok_or_else(|| {
                            Status::unavailable("etcd ended the watch stream; watch again")
                        })?;
                    let mut reply = told.0;
                    let mut kvs = Vec::new();
                    for event in &reply.events {
                        for kv in event.kv.iter().chain(&event.prev_kv) {
                            kvs.push((kv.key.as_slice(), kv.lease, kv.mod_revision));
                        }
                    }
                    self.settle_leased(&kvs).await;
                    self.outward_watch(&mut reply);
                    if tx.send(Ok(reply)).await.is_err() {
                        return Ok(());
                    }
                }
                // UNAVAILABLE, as etcd ends a stream when a member stops: clients
                // watch again at another endpoint (an OK end reads as the end of the
                // watch to Go's clientv3).
                Next::Stop => return Err(Status::unavailable(STOPPING)),
            }
        }
    }

    /// Sends one client request on to etcd, its keys moved into the small-key space; a
    /// watch the caller may not make is answered as etcd answers one: created, and
    /// cancelled at once with the reason.
    async fn forward(
        &self,
        mut asked: PbWatchRequest,
        identity: Option<&str>,
        etcd: &mut Option<(WatchRequestSender, WatchResponseStream)>,
        tx: &Replies,
    ) -> Result<(), Status> {
        if let Some(PbWatchRequestUnion::CreateRequest(create)) = asked.request_union.as_mut() {
            if let Err(refused) = self.may_watch(identity, &create.key, &create.range_end) {
                let reply = PbWatchResponse {
                    header: Some(self.header(self.state.cell.seen())),
                    watch_id: create.watch_id,
                    created: true,
                    canceled: true,
                    cancel_reason: refused.message().to_owned(),
                    ..PbWatchResponse::default()
                };
                let _ = tx.send(Ok(reply)).await;
                return Ok(());
            }
            let range = inner_range(&create.key, &create.range_end);
            create.key = range.key;
            create.range_end = range.end;
            if etcd.is_none() {
                let mut options = WatchOptions::new()
                    .with_start_revision(create.start_revision)
                    .with_watch_id(create.watch_id);
                if !create.range_end.is_empty() {
                    options = options.with_range(create.range_end.clone());
                }
                if create.progress_notify {
                    options = options.with_progress_notify();
                }
                if create.prev_kv {
                    options = options.with_prev_key();
                }
                if create.fragment {
                    options = options.with_fragment();
                }
                let filters: Vec<WatchFilterType> = create
                    .filters
                    .iter()
                    .filter_map(|f| WatchFilterType::try_from(*f).ok())
                    .collect();
                if !filters.is_empty() {
                    options = options.with_filters(filters);
                }
                let stream = self
                    .state
                    .etcd
                    .watch_client()
                    .watch(create.key.clone(), Some(options))
                    .await
                    .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?;
                *etcd = Some(stream.split());
                return Ok(());
            }
        }
        match etcd.as_mut() {
            Some((sender, _)) => sender
                .0
                .send(asked)
                .await
                .map_err(|_| Status::unavailable("etcd ended the watch stream; watch again")),
            // A cancel or progress request before any watch: nothing to do.
            None => Ok(()),
        }
    }

    /// Whether `identity` may watch the client range.
    fn may_watch(
        &self,
        identity: Option<&str>,
        key: &[u8],
        range_end: &[u8],
    ) -> Result<(), Status> {
        let Some(identity) = identity else {
            return Ok(());
        };
        let grants = self.state.grants.current();
        super::auth::check_range(&grants, identity, Right::Watch, key, range_end)
    }

    fn outward_watch(&self, reply: &mut PbWatchResponse) {
        let revision = reply.header.as_ref().map_or(0, |h| h.revision);
        reply.header = Some(self.header(revision));
        for event in &mut reply.events {
            if let Some(kv) = event.kv.as_mut() {
                self.outward_kv(kv);
            }
            if let Some(kv) = event.prev_kv.as_mut() {
                self.outward_kv(kv);
            }
        }
    }
}
