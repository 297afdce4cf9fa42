//! The proxy's front: routes each call to the cell that serves its name (docs/operations.md,
//! "Adding a cell and moving a prefix").
//!
//! A proxy serves every cell of the shard map it found at start, one cell part
//! ([`ProxyState`]) per cell. A call about one name (a lock, an election, a small key)
//! goes to the cell the newest copy of the map routes it to; that cell's part grants or
//! writes only what its own copy routes to it, unpaused (see [`crate::routes`]). A read
//! or watch of a prefix goes to the one cell that serves every name under it, and is
//! refused when those names are in several cells.
//!
//! A session spans every cell: it has a stay (lease bucket, fence, incarnation) in each,
//! opened, renewed, resumed and closed together; its validity is the shortest of its
//! stays'. Replies carry each stay ([`CellStay`]) for the client to name in its next
//! Resume or Close. With one cell the front hands every call to that cell's part
//! unchanged.

use std::sync::Arc;

use lockcell_cell::shardmap::StoredMap;
use lockcell_proto::v1::election_server::Election as ElectionApi;
use lockcell_proto::v1::kv_server::Kv as KvApi;
use lockcell_proto::v1::lock_server::Lock as LockApi;
use lockcell_proto::v1::session_server::Session as SessionApi;
use lockcell_proto::v1::watch_server::Watch as WatchApi;
use lockcell_proto::v1::*;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use crate::errors::ProxyError;
use crate::service::election::ElectionService;
use crate::service::kv::KvService;
use crate::service::lock::LockService;
use crate::service::session::{self, SessionService};
use crate::service::watch::WatchService;
use crate::state::ProxyState;

mod stays;

/// Metadata of a resume refused for an older fence in one cell: which cell.
pub const FENCE_CELL: &str = "lockcell-fence-cell";

#[derive(Clone)]
pub struct Router {
    /// One cell part per cell; the first is the cell the proxy started on.
    engines: Arc<[Arc<ProxyState>]>,
    /// Ticks whenever any cell's copy of the shard map changes (several cells only).
    map_changes: watch::Receiver<u64>,
}

impl Router {
    /// The front over `engines`, one cell part per cell (call within the runtime: with
    /// several cells it follows their copies of the map).
    pub fn new(engines: Vec<Arc<ProxyState>>) -> Self {
        assert!(!engines.is_empty(), "a proxy serves at least one cell");
        let (changed, map_changes) = watch::channel(0u64);
        if engines.len() > 1 {
            let changed = Arc::new(changed);
            for engine in &engines {
                let mut copy = engine.routes.subscribe();
                let changed = changed.clone();
                // Lives as long as the cell part's copy does: the whole run.
                tokio::spawn(async move {
                    while copy.changed().await.is_ok() {
                        changed.send_modify(|n| *n += 1);
                    }
                });
            }
        }
        Router {
            engines: engines.into(),
            map_changes,
        }
    }

    /// The cell part when the proxy serves one cell.
    fn single(&self) -> Option<&Arc<ProxyState>> {
        match &self.engines[..] {
            [only] => Some(only),
            _ => None,
        }
    }

    /// The newest copy of the shard map among the cells (a move writes the source's copy
    /// first, then the target's, then the rest).
    fn newest_map(&self) -> Option<Arc<StoredMap>> {
        self.engines
            .iter()
            .filter_map(|e| e.routes.copy())
            .max_by_key(|c| c.map.version)
    }

    fn engine_named(&self, cell: &str) -> Result<&Arc<ProxyState>, ProxyError> {
        self.engines
            .iter()
            .find(|e| e.cell_name.as_deref() == Some(cell))
            .ok_or_else(|| {
                ProxyError::Moving(format!(
                    "cell {cell:?} is in the shard map but this proxy does not serve it: restart the proxy to connect to it"
                ))
            })
    }

    /// The cell part of the cell that serves `name`.
    fn route(&self, name: &str) -> Result<&Arc<ProxyState>, Status> {
        if let Some(only) = self.single() {
            return Ok(only);
        }
        let map = self.newest_map().ok_or_else(|| {
            ProxyError::NotServed("no cell of this proxy has a shard map".to_owned())
        })?;
        let route = map.map.route(name).ok_or_else(|| {
            ProxyError::NotServed(format!(
                "no cell serves {name:?}: no route of the shard map (version {}) matches it",
                map.map.version
            ))
        })?;
        Ok(self.engine_named(&route.cell)?)
    }

    /// The cell part of the one cell that serves every name under `prefix`.
    fn route_prefix(&self, prefix: &str) -> Result<&Arc<ProxyState>, Status> {
        if let Some(only) = self.single() {
            return Ok(only);
        }
        let map = self.newest_map().ok_or_else(|| {
            ProxyError::NotServed("no cell of this proxy has a shard map".to_owned())
        })?;
        let cells = cells_under(&map.map, prefix);
        match &cells[..] {
            [] => Err(ProxyError::NotServed(format!(
                "no cell serves names under {prefix:?} (shard map version {})",
                map.map.version
            ))
            .into()),
            [cell] => Ok(self.engine_named(cell)?),
            _ => Err(ProxyError::NotServed(format!(
                "the names under {prefix:?} are in cells {} (shard map version {}): read or watch each cell's part with a longer prefix",
                cells.join(", "),
                map.map.version
            ))
            .into()),
        }
    }

    /// The cell part of the one cell that serves all of `names`.
    fn route_all(&self, names: &[&str]) -> Result<&Arc<ProxyState>, Status> {
        let Some((first, rest)) = names.split_first() else {
            return Ok(&self.engines[0]);
        };
        let engine = self.route(first)?;
        for name in rest {
            if !Arc::ptr_eq(self.route(name)?, engine) {
                return Err(ProxyError::NotServed(format!(
                    "a transaction stays within one cell: {first:?} and {name:?} are in different cells of the shard map"
                ))
                .into());
            }
        }
        Ok(engine)
    }

    /// The cell part of the cell that serves `name`, its copy of the map caught up.
    async fn engine_for(&self, name: &str) -> Result<Arc<ProxyState>, Status> {
        let engine = self.route(name)?;
        Ok(self.caught_up(engine, &[name], false).await)
    }

    /// The cell part of the one cell that serves every name under `prefix`, caught up.
    async fn engine_for_prefix(&self, prefix: &str) -> Result<Arc<ProxyState>, Status> {
        let engine = self.route_prefix(prefix)?;
        Ok(self.caught_up(engine, &[prefix], true).await)
    }

    /// The cell part of the one cell that serves all of `names`, caught up.
    async fn engine_for_all(&self, names: &[&str]) -> Result<Arc<ProxyState>, Status> {
        let engine = self.route_all(names)?;
        Ok(self.caught_up(engine, names, false).await)
    }

    /// `cell part`, its copy of the shard map read again first when the call would be
    /// refused there only because this proxy has not yet taken in that copy.
    ///
    /// A move writes the source cell's copy, then the target's, and this proxy follows
    /// each through its own watch: it may route names by the source's new copy to the
    /// target while the target's copy it holds still sends them back. A call made right
    /// after `lockcell-cell shardmap move` returned would then be refused as moving.
    /// Costs one read of the copy, and only in that window.
    async fn caught_up(
        &self,
        engine: &Arc<ProxyState>,
        names: &[&str],
        prefix: bool,
    ) -> Arc<ProxyState> {
        let engine = engine.clone();
        if self.single().is_some() {
            return engine;
        }
        let version = |c: Option<Arc<StoredMap>>| c.map_or(0, |c| c.map.version);
        let behind = version(engine.routes.copy()) < version(self.newest_map());
        let refused = || {
            names.iter().any(|name| {
                if prefix {
                    engine.routes.read_here(name, true).is_err()
                } else {
                    engine.routes.serve(name).is_err()
                }
            })
        };
        if behind && refused() {
            let read = engine
                .routes
                .refresh(&mut engine.etcd.kv_client(), engine.config.etcd_timeout)
                .await;
            if let Err(e) = read {
                tracing::debug!(error = %e, cell = ?engine.cell_name, "could not read the cell's shard map copy again");
            }
        }
        engine
    }
}

/// The cells that serve names under `prefix`: the route of `prefix` itself and every
/// route carved out under it. Sorted, without repeats.
pub fn cells_under(map: &lockcell_cell::shardmap::ShardMap, prefix: &str) -> Vec<String> {
    let mut cells: Vec<String> = map
        .route(prefix)
        .into_iter()
        .chain(map.routes.iter().filter(|r| r.prefix.starts_with(prefix)))
        .map(|r| r.cell.clone())
        .collect();
    cells.sort();
    cells.dedup();
    cells
}

#[tonic::async_trait]
impl LockApi for Router {
    async fn acquire(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        let state = self.engine_for(&request.get_ref().lock).await?;
        LockService { state }.acquire(request).await
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let state = self.engine_for(&request.get_ref().lock).await?;
        LockService { state }.release(request).await
    }

    async fn check_sequencer(
        &self,
        request: Request<CheckSequencerRequest>,
    ) -> Result<Response<CheckSequencerResponse>, Status> {
        let state = self.engine_for(&request.get_ref().lock).await?;
        LockService { state }.check_sequencer(request).await
    }

    async fn describe(
        &self,
        request: Request<DescribeRequest>,
    ) -> Result<Response<DescribeResponse>, Status> {
        let state = self.engine_for(&request.get_ref().lock).await?;
        LockService { state }.describe(request).await
    }
}

#[tonic::async_trait]
impl ElectionApi for Router {
    async fn campaign(
        &self,
        request: Request<CampaignRequest>,
    ) -> Result<Response<CampaignResponse>, Status> {
        let state = self.engine_for(&request.get_ref().election).await?;
        ElectionService { state }.campaign(request).await
    }

    async fn proclaim(
        &self,
        request: Request<ProclaimRequest>,
    ) -> Result<Response<ProclaimResponse>, Status> {
        let state = self.engine_for(&request.get_ref().election).await?;
        ElectionService { state }.proclaim(request).await
    }

    async fn leader(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        let state = self.engine_for(&request.get_ref().election).await?;
        ElectionService { state }.leader(request).await
    }

    type ObserveStream = Replies<LeaderResponse>;

    async fn observe(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        let election = request.get_ref().election.clone();
        let state = self.engine_for(&election).await?;
        let cell = state.cell_name.clone();
        let inner = ElectionService { state }
            .observe(request)
            .await?
            .into_inner();
        if self.single().is_some() {
            return Ok(Response::new(inner));
        }
        Ok(Response::new(self.ending_on_move(
            inner,
            Watched::Key(election),
            cell,
        )))
    }

    async fn resign(
        &self,
        request: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        let state = self.engine_for(&request.get_ref().election).await?;
        ElectionService { state }.resign(request).await
    }
}

#[tonic::async_trait]
impl KvApi for Router {
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let req = request.get_ref();
        let state = if req.prefix {
            self.engine_for_prefix(&req.key).await?
        } else {
            self.engine_for(&req.key).await?
        };
        KvService { state }.get(request).await
    }

    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        let state = self.engine_for(&request.get_ref().key).await?;
        KvService { state }.put(request).await
    }

    async fn delete(
        &self,
        request: Request<DeleteRequest>,
    ) -> Result<Response<DeleteResponse>, Status> {
        let state = self.engine_for(&request.get_ref().key).await?;
        KvService { state }.delete(request).await
    }

    async fn txn(&self, request: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        let txn = request.get_ref();
        let names: Vec<&str> = txn
            .compares
            .iter()
            .map(|c| c.key.as_str())
            .chain(txn.writes.iter().map(|w| w.key.as_str()))
            .collect();
        let state = self.engine_for_all(&names).await?;
        KvService { state }.txn(request).await
    }
}

type Replies<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl WatchApi for Router {
    type WatchStream = Replies<WatchResponse>;

    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let req = request.get_ref();
        let watched = match (req.all_keys, req.prefix) {
            (true, _) => Watched::Prefix(String::new()),
            (false, true) => Watched::Prefix(req.key.clone()),
            (false, false) => Watched::Key(req.key.clone()),
        };
        let state = match &watched {
            Watched::Prefix(prefix) => self.engine_for_prefix(prefix).await?,
            Watched::Key(key) => self.engine_for(key).await?,
        };
        let cell = state.cell_name.clone();
        let inner = WatchService { state }.watch(request).await?.into_inner();
        if self.single().is_some() {
            return Ok(Response::new(Box::pin(inner)));
        }
        Ok(Response::new(self.ending_on_move(inner, watched, cell)))
    }
}

/// What a watch covers.
enum Watched {
    Key(String),
    Prefix(String),
}

impl Router {
    /// `inner` (a watch's or an observer's replies), ended with OUT_OF_RANGE once the
    /// shard map sends the watched names to
    /// another cell than `cell`: the revisions the watcher knows are that cell's, so it
    /// must read the names again (from the cell that serves them now) and watch from
    /// that read's revision.
    fn ending_on_move<T: Send + 'static>(
        &self,
        mut inner: impl tokio_stream::Stream<Item = Result<T, Status>> + Send + Unpin + 'static,
        watched: Watched,
        cell: Option<String>,
    ) -> Replies<T> {
        use tokio_stream::StreamExt;
        let router = self.clone();
        let mut changes = self.map_changes.clone();
        changes.borrow_and_update();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        // Owned by the stream: ends with it, or when the watcher hangs up. Looks at the
        // routes only when a copy of the map changed.
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    item = inner.next() => match item {
                        Some(item) => if tx.send(item).await.is_err() { return },
                        None => return,
                    },
                    Ok(()) = changes.changed() => {
                        let now = match &watched {
                            Watched::Prefix(prefix) => router.route_prefix(prefix),
                            Watched::Key(key) => router.route(key),
                        };
                        let still = matches!(&now, Ok(e) if e.cell_name == cell);
                        if !still {
                            let (Watched::Prefix(name) | Watched::Key(name)) = &watched;
                            let left = cell.as_deref().unwrap_or_default();
                            let status = match &now {
                                // The names are in several cells now (a longer prefix under
                                // them moved), or none: no one stream can go on.
                                Err(refused) => Status::new(
                                    refused.code(),
                                    format!(
                                        "the names of this stream ({name:?}) are no longer all in cell {left:?} (the shard map changed), so it ends: {}",
                                        refused.message()
                                    ),
                                ),
                                Ok(engine) => {
                                    let topic = crate::reads::topic(
                                        name,
                                        matches!(watched, Watched::Prefix(_)),
                                    );
                                    ProxyError::MovedOut {
                                        message: format!(
                                            "the names of this stream ({name:?}) moved out of cell {left:?} (the shard map changed): revisions there are not the same; read them again and watch from that read's revision + 1",
                                        ),
                                        now: topic
                                            .ok()
                                            .map(|t| engine.position_id(&t.name, t.prefix)),
                                    }
                                    .into()
                                }
                            };
                            let _ = tx.send(Err(status)).await;
                            return;
                        }
                    }
                    _ = tx.closed() => return,
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockcell_cell::shardmap::{CellSpec, Route, ShardMap};

    #[test]
    fn a_prefix_is_served_by_one_cell_only_when_no_route_under_it_goes_elsewhere() {
        let route = |prefix: &str, cell: &str| Route {
            prefix: prefix.into(),
            cell: cell.into(),
            paused: false,
            epoch: 0,
        };
        let spec = CellSpec {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            cluster_id: String::new(),
        };
        let map = ShardMap {
            version: 1,
            cells: [("a".to_owned(), spec.clone()), ("b".to_owned(), spec)].into(),
            routes: vec![
                route("", "a"),
                route("billing/", "b"),
                route("billing/eu/", "b"),
            ],
        };
        assert_eq!(cells_under(&map, "orders/"), ["a"]);
        assert_eq!(cells_under(&map, "billing/"), ["b"]);
        assert_eq!(cells_under(&map, "billing/eu/x"), ["b"]);
        assert_eq!(cells_under(&map, "bil"), ["a", "b"]);
        assert_eq!(cells_under(&map, ""), ["a", "b"]);
    }
}
