//! etcd's Watch service, served from the proxy's fan-out (see [`crate::fanout`]): a
//! client's watches join the proxy's one watch over the cell, so a million client
//! watches cost etcd what one does. Keys are the client's (the small-key space, with
//! `/k/` taken off), revisions and watch IDs are etcd's rules: a watch from a past
//! revision gets every event since (from the fan-out's history, or etcd's when that is
//! too short), a compacted start is answered with the compact revision, progress
//! requests are answered only once every watch of the stream has caught up.
//!
//! Each watch of a stream has a source: it joins the fan-out at the watch's next
//! revision, catches up when it joined in the past, and joins again from where it was
//! when the fan-out drops it (a full backlog, or the proxy reloading its view of the
//! cell). The stream interleaves what its sources deliver.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use etcd_client::proto::{
    PbEvent, PbKeyValue, PbWatchRequest, PbWatchRequestUnion, PbWatchResponse, PbWatchService,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt, StreamMap};
use tonic::{Request, Response, Status, Streaming};

use super::EtcdApi;
use crate::access::Right;
use crate::catchup::{Before, CatchUpError, CaughtUp};
use crate::fanout::{in_chunks, Subscription, RESPONSE_BYTES};
use crate::limits::Taken;
use crate::metrics;
use crate::mirror::{EventKind, KeyEvent, Topic};
use crate::state::ProxyState;
use lockcell_cell::grants::Limit;

mod range;
mod source;

use self::range::*;
use self::source::*;

/// Replies buffered per client stream before its sources wait (each at most about
/// [`RESPONSE_BYTES`] of events).
const BUFFER: usize = 16;
/// How often a watch that asked for progress notifications gets one: etcd's default.
const PROGRESS_NOTIFY: Duration = Duration::from_secs(600);
/// A watch ID etcd never hands out: the ID of a progress answer for the whole stream,
/// and of a create etcd refused.
const NO_WATCH: i64 = -1;

type Replies = mpsc::Sender<Result<PbWatchResponse, Status>>;
type Sources = StreamMap<i64, Pin<Box<dyn Stream<Item = Arrival> + Send>>>;

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
            let stream = WatchStream {
                api: &api,
                identity,
                tx: &tx,
                watches: HashMap::new(),
                sources: StreamMap::new(),
                next_id: 0,
                progress_asked: false,
            };
            if let Err(status) = stream.serve(input, leader_required).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Why a stream ends when the proxy stops.
pub(super) const STOPPING: &str = "etcdserver: this proxy is shutting down; use another endpoint";

/// One client watch stream.
struct WatchStream<'a> {
    api: &'a EtcdApi,
    identity: Option<String>,
    tx: &'a Replies,
    watches: HashMap<i64, Watching>,
    sources: Sources,
    /// The next ID to hand out, as etcd does: counting from 0, skipping IDs in use.
    next_id: i64,
    /// The client asked for progress while a watch was catching up: answered once
    /// every watch has.
    progress_asked: bool,
}

/// One watch of a stream: what it selects.
struct Watching {
    select: Selection,
    prev_kv: bool,
    progress_notify: bool,
    /// True while its source follows the fan-out: every event through the revision
    /// the feed applied is then queued for it.
    synced: Arc<AtomicBool>,
    /// Its place among the watches its identity may have open.
    _place: Taken,
}

/// What a watch's source delivers.
enum Arrival {
    /// The source's events of the revisions through `revision`.
    Events {
        revision: i64,
        events: Vec<KeyEvent>,
    },
    /// The source follows the fan-out again: a progress the stream owes may be due.
    Synced,
    /// etcd compacted the history the watch starts in: the oldest start it can serve.
    Compacted(i64),
    /// The watch cannot go on; the stream ends with this, to be watched again.
    Failed(Status),
}

enum Next {
    Asked(Result<Option<PbWatchRequest>, Status>),
    Arrived(i64, Arrival),
    Look,
    Notify,
    Stop,
    Gone,
}

impl WatchStream<'_> {
    async fn serve(
        mut self,
        mut input: Streaming<PbWatchRequest>,
        leader_required: bool,
    ) -> Result<(), Status> {
        let state = &self.api.state;
        let mut shutdown = state.shutdown.clone();
        let mut look = tokio::time::interval(super::LEADER_LOOK);
        let start = tokio::time::Instant::now() + PROGRESS_NOTIFY;
        let mut notify = tokio::time::interval_at(start, PROGRESS_NOTIFY);
        // A client that half-closes its stream keeps its watches, as etcd keeps them
        // (etcd's JSON gateway half-closes once the request body is read).
        let mut asking = true;
        loop {
            let next = tokio::select! {
                asked = input.message(), if asking => Next::Asked(asked),
                Some((id, arrival)) = self.sources.next(), if !self.sources.is_empty() => {
                    Next::Arrived(id, arrival)
                }
                _ = look.tick(), if leader_required => Next::Look,
                _ = notify.tick() => Next::Notify,
                _ = shutdown.wait_for(|stop| *stop) => Next::Stop,
                _ = self.tx.closed() => Next::Gone,
            };
            match next {
                Next::Asked(asked) => match asked? {
                    Some(asked) => self.asked(asked).await?,
                    None => asking = false,
                },
                Next::Arrived(id, arrival) => self.arrived(id, arrival).await?,
                Next::Look => {
                    if self.api.without_leader() {
                        return Err(Status::unavailable(super::NO_LEADER));
                    }
                }
                Next::Notify => {
                    let Some(revision) = self.caught_up().await? else {
                        continue;
                    };
                    let due: Vec<i64> = self
                        .watches
                        .iter()
                        .filter(|(_, w)| w.progress_notify && w.synced.load(Ordering::Acquire))
                        .map(|(id, _)| *id)
                        .collect();
                    for id in due {
                        send(self.tx, self.reply(id, revision)).await?;
                    }
                }
                // UNAVAILABLE, as etcd ends a stream when a member stops: clients
                // watch again at another endpoint (an OK end reads as the end of the
                // watch to Go's clientv3).
                Next::Stop => return Err(Status::unavailable(STOPPING)),
                Next::Gone => return Ok(()),
            }
            if self.progress_asked {
                if let Some(revision) = self.caught_up().await? {
                    self.progress_asked = false;
                    send(self.tx, self.reply(NO_WATCH, revision)).await?;
                }
            }
        }
    }

    /// Delivers everything the sources have queued; then, if every watch follows the
    /// fan-out, the revision through which every event of every watch was sent.
    async fn caught_up(&mut self) -> Result<Option<i64>, Status> {
        // Read first: every batch through it is queued already.
        let applied = self.api.state.reads.feed.fanout.delivered();
        while let Some((id, arrival)) = ready(&mut self.sources).await {
            self.arrived(id, arrival).await?;
        }
        let synced = self
            .watches
            .values()
            .all(|w| w.synced.load(Ordering::Acquire));
        Ok(synced.then_some(applied))
    }

    async fn asked(&mut self, asked: PbWatchRequest) -> Result<(), Status> {
        match asked.request_union {
            Some(PbWatchRequestUnion::CreateRequest(create)) => {
                let filters = |f| create.filters.contains(&f);
                let watching = Watching {
                    prev_kv: create.prev_kv,
                    select: Selection {
                        range: ClientRange {
                            key: create.key,
                            end: create.range_end,
                        },
                        no_put: filters(etcd_client::WatchFilterType::NoPut as i32),
                        no_delete: filters(etcd_client::WatchFilterType::NoDelete as i32),
                    },
                    progress_notify: create.progress_notify,
                    synced: Arc::new(AtomicBool::new(false)),
                    _place: Taken::none(),
                };
                self.create(create.watch_id, create.start_revision, watching)
                    .await
            }
            Some(PbWatchRequestUnion::CancelRequest(cancel)) => {
                // etcd answers only the cancel of a watch it has.
                if self.watches.remove(&cancel.watch_id).is_some() {
                    self.sources.remove(&cancel.watch_id);
                    let revision = self.api.state.reads.feed.applied();
                    let reply = PbWatchResponse {
                        canceled: true,
                        ..self.reply(cancel.watch_id, revision)
                    };
                    send(self.tx, reply).await?;
                }
                Ok(())
            }
            Some(PbWatchRequestUnion::ProgressRequest(_)) => {
                self.progress_asked = true;
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Why a watch is refused as etcd refuses it, if it is, and under which ID: one
    /// outside the grants under the ID asked for, one etcd's watch store turns down
    /// under no ID at all.
    fn refusal(
        &self,
        asked_id: i64,
        start_revision: i64,
        range: &ClientRange,
    ) -> Option<(i64, String)> {
        if let Err(refused) = self.may_watch(range) {
            Some((asked_id, refused.message().to_owned()))
        } else if range.is_empty() {
            Some((NO_WATCH, "mvcc: watcher range is empty".to_owned()))
        } else if asked_id != 0 && self.watches.contains_key(&asked_id) {
            Some((
                NO_WATCH,
                "mvcc: duplicate watch ID provided on the WatchStream".to_owned(),
            ))
        } else if start_revision < 0 {
            Some((
                NO_WATCH,
                format!("etcdserver: a watch cannot start at revision {start_revision}"),
            ))
        } else {
            None
        }
    }

    /// The ID of a new watch: the one asked for, else the stream's next free one.
    fn new_id(&mut self, asked_id: i64) -> i64 {
        if asked_id != 0 {
            return asked_id;
        }
        while self.watches.contains_key(&self.next_id) {
            self.next_id += 1;
        }
        self.next_id += 1;
        self.next_id - 1
    }

    async fn create(
        &mut self,
        asked_id: i64,
        start_revision: i64,
        watching: Watching,
    ) -> Result<(), Status> {
        let state = &self.api.state;
        let refusal = self.refusal(asked_id, start_revision, &watching.select.range);
        // Past its identity's rate or open watches: refused under the ID asked for, as
        // a watch outside the grants is.
        let identity = self.identity.as_deref();
        let (refusal, watching) = match refusal {
            Some(refused) => (Some(refused), watching),
            None => match state
                .pace(identity)
                .and_then(|()| state.take(identity, Limit::Watches))
            {
                Ok(place) => (
                    None,
                    Watching {
                        _place: place,
                        ..watching
                    },
                ),
                Err(refused) => (Some((asked_id, refused.to_string())), watching),
            },
        };
        if let Some((id, reason)) = refusal {
            let revision = state.reads.feed.applied();
            let reply = PbWatchResponse {
                created: true,
                canceled: true,
                cancel_reason: reason,
                ..self.reply(id, revision)
            };
            return send(self.tx, reply).await;
        }
        let id = self.new_id(asked_id);
        // From now: the store's revision now, so the watch sees exactly the changes
        // that come after the call, as etcd's does.
        let (start, created_at) = match start_revision {
            0 => {
                let now = state.reads.barrier().await?;
                (now + 1, now)
            }
            start => (start, state.reads.feed.applied()),
        };
        let source = Source {
            state: state.clone(),
            topic: watching.select.range.topic(),
            select: watching.select.clone(),
            prev_kv: watching.prev_kv,
            next: start,
            synced: watching.synced.clone(),
            phase: Phase::Join,
            pending: Default::default(),
        };
        send(
            self.tx,
            PbWatchResponse {
                created: true,
                ..self.reply(id, created_at)
            },
        )
        .await?;
        self.watches.insert(id, watching);
        self.sources.insert(id, Box::pin(source.into_stream()));
        Ok(())
    }

    async fn arrived(&mut self, id: i64, arrival: Arrival) -> Result<(), Status> {
        let Some(watching) = self.watches.get(&id) else {
            return Ok(());
        };
        match arrival {
            Arrival::Events { revision, events } => {
                if events.is_empty() {
                    return Ok(());
                }
                let events = client_events(&events, watching.prev_kv);
                ::metrics::counter!(metrics::WATCH_EVENTS_SENT).increment(events.len() as u64);
                let reply = PbWatchResponse {
                    events,
                    ..self.reply(id, revision)
                };
                send(self.tx, reply).await
            }
            Arrival::Compacted(oldest) => {
                self.watches.remove(&id);
                let revision = self.api.state.reads.feed.applied();
                let reply = PbWatchResponse {
                    compact_revision: oldest,
                    canceled: true,
                    cancel_reason: "etcdserver: mvcc: required revision has been compacted"
                        .to_owned(),
                    ..self.reply(id, revision)
                };
                send(self.tx, reply).await
            }
            Arrival::Synced => Ok(()),
            Arrival::Failed(status) => Err(status),
        }
    }
}

/// The events as etcd shows them to the client: its keys, and its leases.
fn client_events(events: &[KeyEvent], prev_kv: bool) -> Vec<PbEvent> {
    let kv = |e: &lockcell_cell::kv::Entry| PbKeyValue {
        key: e.name.as_bytes().to_vec(),
        create_revision: e.create_revision,
        mod_revision: e.mod_revision,
        version: e.version,
        value: e.value.clone(),
        lease: e.client_lease,
    };
    events
        .iter()
        .map(|e| PbEvent {
            r#type: match e.kind {
                EventKind::Put => 0,
                EventKind::Delete => 1,
            },
            kv: Some(kv(&e.entry)),
            prev_kv: if prev_kv {
                e.prev.as_ref().map(kv)
            } else {
                None
            },
        })
        .collect()
}

impl WatchStream<'_> {
    /// Whether the caller may watch the client range.
    fn may_watch(&self, range: &ClientRange) -> Result<(), Status> {
        let Some(identity) = self.identity.as_deref() else {
            return Ok(());
        };
        let grants = self.api.state.grants.current();
        super::auth::check_range(&grants, identity, Right::Watch, &range.key, &range.end)
    }

    fn reply(&self, watch_id: i64, revision: i64) -> PbWatchResponse {
        PbWatchResponse {
            header: Some(self.api.header(revision)),
            watch_id,
            ..PbWatchResponse::default()
        }
    }
}

/// What a source has ready now, without waiting. Outside tokio's cooperative budget: a
/// task that has done enough work sees a queue with batches in it as empty otherwise,
/// and a progress would be claimed past events still queued.
async fn ready(sources: &mut Sources) -> Option<(i64, Arrival)> {
    let poll = std::future::poll_fn(|context| {
        Poll::Ready(match Pin::new(&mut *sources).poll_next(context) {
            Poll::Ready(next) => next,
            Poll::Pending => None,
        })
    });
    tokio::task::unconstrained(poll).await
}

async fn send(tx: &Replies, reply: PbWatchResponse) -> Result<(), Status> {
    // A client gone ends the stream quietly: the loop sees `tx` closed.
    let _ = tx.send(Ok(reply)).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(key: &str, end: &[u8]) -> ClientRange {
        ClientRange {
            key: key.as_bytes().to_vec(),
            end: end.to_vec(),
        }
    }

    #[test]
    fn a_range_selects_what_etcd_would() {
        let one = range("a", b"");
        assert!(one.contains(b"a") && !one.contains(b"ab"));
        let prefix = range("a/", b"a0");
        assert!(prefix.contains(b"a/") && prefix.contains(b"a/x") && !prefix.contains(b"a0"));
        assert!(!prefix.contains(b"a"));
        let from = range("m", b"\0");
        assert!(from.contains(b"m") && from.contains(b"zz") && !from.contains(b"l"));
        let all = range("\0", b"\0");
        assert!(all.contains(b"a") && all.contains(b"/x"));
        assert!(range("b", b"a").is_empty() && range("a", b"a").is_empty());
        assert!(!range("a", b"").is_empty() && !range("a", b"\0").is_empty());
    }

    #[test]
    fn a_ranges_topic_holds_every_key_of_the_range() {
        let topic = |r: ClientRange| (r.topic().name, r.topic().prefix);
        assert_eq!(topic(range("a", b"")), ("a".into(), false));
        assert_eq!(topic(range("a/", b"a0")), ("a".into(), true));
        assert_eq!(topic(range("jobs/a", b"jobs/c")), ("jobs/".into(), true));
        assert_eq!(topic(range("m", b"\0")), ("".into(), true));
        assert_eq!(topic(range("\0", b"\0")), ("".into(), true));
        // Ends that share half a character: the topic stops before it.
        let r = ClientRange {
            key: "é".as_bytes().to_vec(),
            end: vec![0xc3, 0xaa],
        };
        assert_eq!(topic(r), ("".into(), true));
    }
}
