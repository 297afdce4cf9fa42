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

mod pump;

use self::pump::Pump;

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
        check_watch(&req)?;
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
        check_position(state, &req, &topic, &cell)?;
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
        let start = start_revision(state, &req, joined).await?;
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
            true => Some(Before::choose((&state.reads, &state.etcd), start, joined, kept).await),
            false => None,
        };
        tokio::spawn(pump.run(sub, catch_up));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A watch's own rules: a start revision of zero or more, and a watch of every small
/// key only when asked for by `all_keys`.
fn check_watch(req: &WatchRequest) -> Result<(), ProxyError> {
    if req.start_revision < 0 {
        return Err(ProxyError::BadArgument(format!(
            "watch of {:?}: start revision {} is negative",
            req.key, req.start_revision
        )));
    }
    if req.prefix && req.key.trim_end_matches('/').is_empty() && !req.all_keys {
        return Err(ProxyError::BadArgument(
            "a watch on the empty prefix watches every small key; set all_keys to mean it (lockctl watch --all)"
                .to_owned(),
        ));
    }
    Ok(())
}

/// A watch from a revision of a position (`req.cell`) is refused when its names moved
/// since, to `cell` or from before where this cell's position starts.
fn check_position(
    state: &ProxyState,
    req: &WatchRequest,
    topic: &Topic,
    cell: &str,
) -> Result<(), Status> {
    if req.start_revision > 0 && !req.cell.is_empty() {
        if req.cell != cell {
            return Err(moved(&describe(req), &req.cell, cell));
        }
        let place = state.routes.place(&topic.name, topic.prefix);
        if req.start_revision < place.since {
            return Err(ProxyError::BeforePosition {
                what: format!(
                    "watch of {} from revision {}",
                    describe(req),
                    req.start_revision
                ),
                revision: req.start_revision,
                since: place.since,
                now: place.position,
            }
            .into());
        }
    }
    Ok(())
}

/// The first revision a watch delivers: the one after it joined the fan-out when it
/// asked for none, else the one it asked for, if the store has reached it.
async fn start_revision(
    state: &ProxyState,
    req: &WatchRequest,
    joined: i64,
) -> Result<i64, Status> {
    Ok(match req.start_revision {
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
    })
}

fn describe(req: &WatchRequest) -> String {
    if req.prefix {
        format!("prefix {:?}", req.key)
    } else {
        format!("key {:?}", req.key)
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
