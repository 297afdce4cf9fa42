//! The Watch service: watchers of small keys, fanned out from the proxy's one watch over
//! the cell (see [`crate::feed`]).
//!
//! A watcher from now joins the fan-out at once. A watcher from an older revision first
//! catches up on a watch of its own (over every key, so it sees every revision and knows
//! exactly when it has reached the fan-out's position), while the fan-out queues what
//! comes after; then it goes on from the queue, with no gap and no duplicate.

use std::sync::Arc;
use std::time::Duration;

use lockcell_proto::v1::watch_event::Kind;
use lockcell_proto::v1::watch_server::Watch as WatchApi;
use lockcell_proto::v1::{WatchEvent, WatchRequest, WatchResponse};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use crate::access::Right;
use crate::catchup::{Before, CatchUp, CatchUpError, CaughtUp};
use crate::errors::ProxyError;
use crate::fanout::{in_chunks, Batch, End, Subscription, RESPONSE_BYTES};
use crate::limits::Taken;
use crate::metrics;
use crate::mirror::{EventKind, KeyEvent, Topic};
use crate::service::kv::wire;
use crate::state::ProxyState;
use lockcell_cell::grants::Limit;

/// Responses a watcher's stream holds before the fan-out backlog takes over.
const STREAM_BUFFER: usize = 8;
/// Shortest progress interval a watcher may ask for.
const MIN_PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

pub struct WatchService {
    pub state: Arc<ProxyState>,
}

type Sent = Result<WatchResponse, Status>;

#[tonic::async_trait]
impl WatchApi for WatchService {
    type WatchStream = ReceiverStream<Sent>;

    #[tracing::instrument(skip_all, fields(watch.key = %request.get_ref().key, watch.prefix = request.get_ref().prefix))]
    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let caller = self.state.grants.current().authorize_key(
            &request,
            Right::Watch,
            &request.get_ref().key,
            request.get_ref().prefix,
        )?;
        self.state.pace(caller.as_deref())?;
        let place = self.state.take(caller.as_deref(), Limit::Watches)?;
        let req = request.into_inner();
        let state = &self.state;
        if req.start_revision < 0 {
            return Err(ProxyError::BadArgument(format!(
                "watch of {:?}: start revision {} is negative",
                req.key, req.start_revision
            ))
            .into());
        }
        if req.prefix && req.key.trim_end_matches('/').is_empty() && !req.all_keys {
            return Err(ProxyError::BadArgument(
                "a watch on the empty prefix watches every small key; set all_keys to mean it (lockctl watch --all)"
                    .to_owned(),
            )
            .into());
        }
        let topic = crate::reads::topic(&req.key, req.prefix)?;
        // Whether the names are served here as of what the feed applied, and the
        // position the watch's revisions are of: a watch is never set up in a cell its
        // names left (the deletes that follow a move there are no changes of theirs).
        // (The copy's revision first: a change after it is looked at again.)
        let checked_copy = std::sync::atomic::AtomicI64::new(state.routes.copy_changes());
        let cell = state.routes.read_here(&topic.name, topic.prefix)?;
        if !req.cell.is_empty() {
            crate::routes::check_position_syntax(&req.cell)?;
        }
        if req.start_revision > 0 && !req.cell.is_empty() {
            if req.cell != cell {
                return Err(moved(&describe(&req), &req.cell, &cell));
            }
            let place = state.routes.place(&topic.name, topic.prefix);
            if req.start_revision < place.since {
                return Err(ProxyError::BeforePosition {
                    what: format!(
                        "watch of {} from revision {}",
                        describe(&req),
                        req.start_revision
                    ),
                    revision: req.start_revision,
                    since: place.since,
                    now: place.position,
                }
                .into());
            }
        }
        let feed = &state.reads.feed;
        if !feed.live_within(state.config.etcd_timeout).await {
            return Err(ProxyError::EtcdUnavailable(
                "the proxy is still loading the cell's small keys".to_owned(),
            )
            .into());
        }
        // From a past revision the fan-out's history may still hold, the events since
        // come with the subscription.
        let from = match req.start_revision {
            0 => i64::MAX,
            r => r,
        };
        let (sub, kept) = feed
            .fanout
            .subscribe_from(topic.clone(), feed.backlog(), from);
        if sub.end.get().is_some() {
            return Err(ProxyError::EtcdUnavailable(
                "the proxy is reloading the cell's small keys".to_owned(),
            )
            .into());
        }
        let joined = sub.joined_at;
        let start = match req.start_revision {
            0 => joined + 1,
            r if r > joined + 1 => {
                let now = state.reads.barrier().await?;
                if r > now + 1 {
                    return Err(ProxyError::BadArgument(format!(
                        "watch of {:?} from revision {r}: that revision is in the future (the store is at {now})",
                        req.key
                    ))
                    .into());
                }
                r
            }
            r => r,
        };
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let pump = Pump {
            _place: place,
            cell,
            checked_copy,
            routes: state.routes.clone(),
            tx,
            what: describe(&req),
            topic,
            start,
            prev_kv: req.prev_kv,
            progress: (req.progress_interval_ms > 0).then(|| {
                Duration::from_millis(req.progress_interval_ms.into()).max(MIN_PROGRESS_INTERVAL)
            }),
            applied: feed.fanout.subscribe_delivered(),
            shutdown: state.shutdown.clone(),
            backlog: feed.backlog(),
        };
        let catch_up = match start <= joined {
            true => Some(Before::choose(state, start, joined, kept).await),
            false => None,
        };
        tokio::spawn(pump.run(sub, catch_up));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

fn describe(req: &WatchRequest) -> String {
    if req.prefix {
        format!("prefix {:?}", req.key)
    } else {
        format!("key {:?}", req.key)
    }
}

/// One watcher's delivery: catch-up, then the fan-out's queue.
struct Pump {
    /// Its place among the watches its identity may have open.
    _place: Taken,
    /// The cell whose revisions these are (in the created response).
    cell: String,
    /// The cell's copy of the shard map, as of what the feed applied: once it moves
    /// the names, the watch ends before the batch that would deliver later revisions
    /// (the move's deletes of the copied keys among them).
    routes: Arc<crate::routes::Routes>,
    /// The copies taken in when the position was last found unchanged.
    checked_copy: std::sync::atomic::AtomicI64,
    tx: mpsc::Sender<Sent>,
    what: String,
    topic: Topic,
    /// The first revision the watcher wants.
    start: i64,
    prev_kv: bool,
    progress: Option<Duration>,
    applied: watch::Receiver<i64>,
    shutdown: watch::Receiver<bool>,
    backlog: usize,
}

impl Pump {
    async fn run(mut self, mut sub: Subscription, catch_up: Option<Before>) {
        let _counted = metrics::Counted::in_gauge(metrics::WATCHERS);
        self.deliver(&mut sub, catch_up).await;
    }

    async fn deliver(&mut self, sub: &mut Subscription, catch_up: Option<Before>) {
        let mut last = self.start - 1;
        let created = WatchResponse {
            cell: self.cell.clone(),
            ..response(true, last, Vec::new())
        };
        if !self.send(created).await {
            return;
        }
        let catch_up = match catch_up {
            Some(Before::Kept(events)) => {
                for (revision, events) in in_chunks(events, sub.joined_at, RESPONSE_BYTES) {
                    let events = events.iter().map(|e| self.event(e)).collect();
                    if !self.send(response(false, revision, events)).await {
                        return;
                    }
                }
                last = sub.joined_at;
                None
            }
            other => other,
        };
        if let Some(Before::Etcd(catch_up)) = catch_up {
            let through = catch_up.through;
            let mut shutdown = self.shutdown.clone();
            let result = tokio::select! {
                result = self.catch_up(*catch_up) => result,
                _ = self.tx.closed() => Err(CatchUpError::ClientGone),
                _ = async { let _ = shutdown.wait_for(|s| *s).await; } => {
                    Err(CatchUpError::Etcd("this proxy is shutting down".into()))
                }
            };
            match result {
                Ok(()) => last = through,
                Err(CatchUpError::ClientGone) => return,
                Err(CatchUpError::Compacted(compacted)) => {
                    // etcd keeps the state at its compact revision but not the deletes
                    // made at it: a watch can start one past it at the earliest.
                    let oldest = compacted + 1;
                    let mut status = Status::out_of_range(format!(
                        "watch of {} from revision {}: history through revision {compacted} is compacted, so a watch can start at revision {oldest} at the earliest; read the keys again and watch from the read's revision + 1",
                        self.what, self.start
                    ));
                    insert(&mut status, "lockcell-compact-revision", oldest);
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
                Err(CatchUpError::Gap(gap)) => {
                    let mut status = Status::out_of_range(format!(
                        "watch of {} from revision {}: {gap}; read the keys again and watch from the read's revision + 1",
                        self.what, self.start
                    ));
                    insert(&mut status, "lockcell-compact-revision", gap.got);
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
                Err(CatchUpError::Slow) => {
                    let status = Status::unavailable(format!(
                        "watch of {} from revision {}: the watcher took no events for {} s while catching up; resume from the revision after the last one received",
                        self.what,
                        self.start,
                        crate::catchup::SLOW_READER.as_secs()
                    ));
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
                Err(CatchUpError::Etcd(why)) => {
                    let status = Status::unavailable(format!(
                        "watch of {} could not catch up from revision {}: {why}; resume from the revision after the last one received",
                        self.what, self.start
                    ));
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
            }
        }
        let mut shutdown = self.shutdown.clone();
        loop {
            let quiet = async {
                match self.progress {
                    Some(every) => tokio::time::sleep(every).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                queued = sub.batches.recv() => {
                    if !self.forward(queued, sub.end.get().copied(), &mut last).await {
                        return;
                    }
                }
                _ = quiet => {
                    // Everything delivered up to `applied` is in the queue already.
                    // Read before draining: a batch this watcher was cut off at was
                    // dropped before `applied` reached it, so the drain then finds the
                    // queue closed and no progress past it is claimed.
                    let applied = *self.applied.borrow();
                    loop {
                        let queued = match sub.batches.try_recv() {
                            Ok(batch) => Some(batch),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => None,
                        };
                        if !self.forward(queued, sub.end.get().copied(), &mut last).await {
                            return;
                        }
                    }
                    last = last.max(applied);
                    if !self.send(response(false, last, Vec::new())).await {
                        return;
                    }
                }
                _ = self.tx.closed() => return,
                _ = async { let _ = shutdown.wait_for(|s| *s).await; } => {
                    let status = Status::unavailable(format!(
                        "this proxy is shutting down; resume the watch of {} from revision {} on another proxy",
                        self.what, last + 1
                    ));
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
            }
        }
    }

    /// Sends a queued batch on, or (`None`: the queue closed) the reason deliveries
    /// ended. False when the stream is over.
    async fn forward(&self, queued: Option<Arc<Batch>>, end: Option<End>, last: &mut i64) -> bool {
        let Some(batch) = queued else {
            let _ = self.tx.send(Err(self.ended(end, *last))).await;
            return false;
        };
        match self.batch(&batch, *last) {
            Some(response) => {
                if let Some(now) = self.moved_away() {
                    let _ = self.tx.send(Err(moved(&self.what, &self.cell, &now))).await;
                    return false;
                }
                *last = batch.revision;
                self.send(response).await
            }
            None => true,
        }
    }

    /// The names' position now, if it is no longer the watch's (looked at only when the
    /// cell's copy of the shard map changed since the last look).
    fn moved_away(&self) -> Option<String> {
        let copy = self.routes.copy_changes();
        if copy == self.checked_copy.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let now = self.routes.position(&self.topic.name, self.topic.prefix);
        if now != self.cell {
            return Some(now);
        }
        self.checked_copy
            .store(copy, std::sync::atomic::Ordering::Relaxed);
        None
    }

    /// The response for a fan-out batch: its events from the watcher's start on.
    fn batch(&self, batch: &Batch, last: i64) -> Option<WatchResponse> {
        if batch.revision <= last {
            return None;
        }
        let events: Vec<WatchEvent> = batch
            .events
            .iter()
            .filter(|e| e.revision() >= self.start && e.revision() > last)
            .map(|e| self.event(e))
            .collect();
        (!events.is_empty()).then(|| response(false, batch.revision, events))
    }

    fn event(&self, e: &KeyEvent) -> WatchEvent {
        WatchEvent {
            kind: match e.kind {
                EventKind::Put => Kind::Put,
                EventKind::Delete => Kind::Delete,
            } as i32,
            kv: Some(wire(e.entry.clone())),
            prev_kv: if self.prev_kv {
                e.prev.clone().map(wire)
            } else {
                None
            },
        }
    }

    async fn send(&self, response: WatchResponse) -> bool {
        if !response.events.is_empty() {
            ::metrics::counter!(metrics::WATCH_EVENTS_SENT).increment(response.events.len() as u64);
        }
        self.tx.send(Ok(response)).await.is_ok()
    }

    fn ended(&self, end: Option<End>, last: i64) -> Status {
        match end {
            Some(End::CutOff { resume }) => {
                // A watcher that asked to start past the join position was queued
                // batches from before its start; it never resumes before it.
                let resume = resume.max(self.start);
                let mut status = Status::resource_exhausted(format!(
                    "watch of {} cut off: the watcher fell more than {} batches of events behind; resume from revision {resume}",
                    self.what, self.backlog
                ));
                insert(&mut status, "lockcell-resume-revision", resume);
                status
            }
            Some(End::FeedLost) | None => Status::unavailable(format!(
                "watch of {} ended: the proxy lost its view of the cell and is reloading it; resume from revision {}",
                self.what,
                last + 1
            )),
        }
    }

    /// Sends the watcher's events from its start through the catch-up's end.
    async fn catch_up(&self, catch_up: CatchUp) -> Result<(), CatchUpError> {
        let (out, mut caught) = mpsc::channel(1);
        let read = catch_up.run(&self.topic, self.start, self.prev_kv, out);
        // Owns `caught`: a relay that stops closes the channel, which ends the read.
        let relay = async move {
            while let Some(CaughtUp { reached, events }) = caught.recv().await {
                let events = events.iter().map(|e| self.event(e)).collect();
                if !self.send(response(false, reached, events)).await {
                    return;
                }
            }
        };
        tokio::join!(read, relay).0
    }
}

fn response(created: bool, revision: i64, events: Vec<WatchEvent>) -> WatchResponse {
    WatchResponse {
        created,
        revision,
        events,
        cell: String::new(),
    }
}

/// The end of a watch whose position is a revision of cell `was`, while cell `now`
/// serves its names: revisions of two cells are unrelated.
pub fn moved(what: &str, was: &str, now: &str) -> Status {
    ProxyError::OtherCell {
        what: format!("watch of {what}"),
        was: was.to_owned(),
        now: now.to_owned(),
    }
    .into()
}

pub use crate::errors::WATCH_CELL;

fn insert(status: &mut Status, key: &'static str, revision: i64) {
    if let Ok(value) = MetadataValue::try_from(revision.to_string()) {
        status.metadata_mut().insert(key, value);
    }
}
