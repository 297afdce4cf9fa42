//! A fleet of client sessions, each kept alive with one message per renewal, spread
//! over zones and over many client connections.
//!
//! For lockcell a session is a proxy session renewed on a `KeepAlive` stream; for bare
//! etcd (direct or through grpc-proxy) it is an etcd lease renewed on a
//! `LeaseKeepAlive` stream. Each connection carries one stream with the renewals of its
//! sessions, paced so the fleet's renewals are spread evenly over the renewal period.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lockcell_loadtest::pacing::{share, Schedule};
use lockcell_loadtest::stats::Samples;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{KeepAliveRequest, OpenRequest, SessionState};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::cluster::{Cell, Target};
use crate::etcdpb::lease_client::LeaseClient;
use crate::etcdpb::{LeaseGrantRequest, LeaseKeepAliveRequest};

/// A session's handle for lock calls.
#[derive(Debug, Clone)]
pub enum SessionKey {
    /// A session's id and the secret every call on it carries.
    Lockcell {
        id: Arc<str>,
        secret: Arc<str>,
    },
    Etcd(i64),
}

/// One session of the fleet.
#[derive(Debug, Clone)]
pub struct Member {
    pub zone: usize,
    pub key: SessionKey,
}

/// The fleet's shape.
#[derive(Debug, Clone, Copy)]
pub struct FleetSpec {
    pub sessions: usize,
    pub ttl: Duration,
    pub renewals_per_ttl: u32,
    pub connections: usize,
}

impl FleetSpec {
    pub fn period(&self) -> Duration {
        self.ttl / self.renewals_per_ttl.max(1)
    }
}

/// Counters the progress bars read while the fleet runs.
#[derive(Default)]
pub struct Live {
    pub opened: AtomicU64,
    pub sent: AtomicU64,
    pub answered: AtomicU64,
}

/// What one connection's keepalive worker saw.
#[derive(Default)]
pub struct WorkerStats {
    pub sent: u64,
    pub answered: u64,
    pub latency: Samples,
    /// (offset of the send since the phase start, round trip).
    pub timeline: Vec<(Duration, Duration)>,
    /// Sessions the target declared expired although they were renewed.
    pub expired: HashSet<usize>,
    /// Stream failures (reconnects are not attempted: a broken stream is a finding).
    pub stream_errors: u64,
}

/// A running fleet.
pub struct Fleet {
    pub members: Vec<Member>,
    pub live: Arc<Live>,
    connections: Vec<(usize, Channel)>,
    workers: JoinSet<WorkerStats>,
    zone_stop: Vec<watch::Sender<bool>>,
    /// When the measured window starts; workers count round trips from then on.
    measure: watch::Sender<Option<Instant>>,
}

/// Sessions opened at once, fleet-wide, so opening does not swamp the target.
const OPEN_CONCURRENCY: usize = 256;

impl Fleet {
    /// Connects and opens every session (members `share(n, c, i)` on connection `i`,
    /// connection `i` in zone `i % zones`). Each connection starts renewing its
    /// sessions as soon as they are open, so none expires while the rest open.
    pub async fn open(cell: &Cell, spec: FleetSpec, live: Arc<Live>) -> anyhow::Result<Fleet> {
        let zones = cell.zones.len();
        let mut connections = Vec::with_capacity(spec.connections);
        for c in 0..spec.connections {
            let zone = c % zones;
            let url = format!("http://{}", cell.zones[zone].endpoint);
            let channel = Endpoint::from_shared(url)?
                .tcp_nodelay(true)
                .connect_timeout(Duration::from_secs(10))
                .connect_lazy();
            connections.push((zone, channel));
        }
        let zone_stop: Vec<watch::Sender<bool>> =
            (0..zones).map(|_| watch::channel(false).0).collect();
        let (measure, _) = watch::channel(None);
        let gate = Arc::new(Semaphore::new(OPEN_CONCURRENCY));
        let epoch = Instant::now();
        let mut workers = JoinSet::new();
        let mut opened = Vec::new();
        for (c, (zone, channel)) in connections.iter().enumerate() {
            let range = share(spec.sessions, spec.connections, c);
            if range.is_empty() {
                continue;
            }
            let (ready_tx, ready_rx) = oneshot::channel();
            opened.push((range.start, ready_rx));
            let worker = Worker {
                target: cell.target,
                channel: channel.clone(),
                zone: *zone,
                range,
                spec,
                epoch,
                gate: gate.clone(),
                stop: zone_stop[*zone].subscribe(),
                measure: measure.subscribe(),
                live: live.clone(),
            };
            workers.spawn(worker.run(ready_tx));
        }
        let mut parts = Vec::new();
        for (start, ready) in opened {
            match ready.await {
                Ok(Ok(members)) => parts.push((start, members)),
                Ok(Err(e)) => return Err(e),
                Err(_) => anyhow::bail!("a connection's worker ended before opening its sessions"),
            }
        }
        parts.sort_by_key(|(start, _)| *start);
        let members = parts.into_iter().flat_map(|(_, m)| m).collect();
        Ok(Fleet {
            members,
            live,
            connections,
            workers,
            zone_stop,
            measure,
        })
    }

    /// Counts round trips and rates from `from` on (earlier replies only count as
    /// expiries).
    pub fn measure_from(&self, from: Instant) {
        let _ = self.measure.send(Some(from));
    }

    /// Stops the renewals of every session in `zone` (its clients died).
    pub fn stop_zone(&self, zone: usize) {
        let _ = self.zone_stop[zone].send(true);
    }

    /// Stops every renewal and collects what each worker saw.
    pub async fn finish(mut self) -> Vec<WorkerStats> {
        for stop in &self.zone_stop {
            let _ = stop.send(true);
        }
        let mut out = Vec::new();
        while let Some(done) = self.workers.join_next().await {
            if let Ok(stats) = done {
                out.push(stats);
            }
        }
        out
    }

    /// The connection member `i` renews on.
    pub fn member_channel(&self, i: usize) -> Channel {
        let c = (0..self.connections.len())
            .find(|c| share(self.members.len(), self.connections.len(), *c).contains(&i))
            .expect("every member has a connection");
        self.connections[c].1.clone()
    }

    /// Every connection's channel with the members that renew on it, so other calls of
    /// those members (membership) share the connection as a process's client would.
    pub fn connections(&self) -> impl Iterator<Item = (&Channel, std::ops::Range<usize>)> {
        let (n, c) = (self.members.len(), self.connections.len());
        self.connections
            .iter()
            .enumerate()
            .map(move |(i, (_, channel))| (channel, share(n, c, i)))
    }

    /// A channel of `zone` for lock calls (lockcell).
    pub fn channel(&self, zone: usize, hint: usize) -> Channel {
        let in_zone: Vec<&Channel> = self
            .connections
            .iter()
            .filter(|(z, _)| *z == zone)
            .map(|(_, c)| c)
            .collect();
        in_zone[hint % in_zone.len()].clone()
    }
}

async fn open_one(target: Target, channel: &Channel, ttl: Duration) -> anyhow::Result<SessionKey> {
    if target.is_lockcell() {
        let reply = SessionClient::new(channel.clone())
            .open(OpenRequest {
                ttl_ms: ttl.as_millis() as u64,
                identity: "loadtest".into(),
            })
            .await
            .context("opening a lockcell session")?
            .into_inner();
        Ok(SessionKey::Lockcell {
            id: reply.session_id.into(),
            secret: reply.session_secret.into(),
        })
    } else {
        let reply = LeaseClient::new(channel.clone())
            .lease_grant(LeaseGrantRequest {
                ttl: ttl.as_secs() as i64,
                id: 0,
            })
            .await
            .context("granting an etcd lease")?
            .into_inner();
        Ok(SessionKey::Etcd(reply.id))
    }
}

/// Opens one connection's sessions, then renews them over one stream.
struct Worker {
    target: Target,
    channel: Channel,
    zone: usize,
    /// The fleet indices of this connection's sessions.
    range: std::ops::Range<usize>,
    spec: FleetSpec,
    /// The fleet's common time origin: renewal slots are spread evenly from it.
    epoch: Instant,
    gate: Arc<Semaphore>,
    stop: watch::Receiver<bool>,
    measure: watch::Receiver<Option<Instant>>,
    live: Arc<Live>,
}

/// A reply from either protocol: which session, and whether it is still alive.
struct Reply {
    local: usize,
    alive: bool,
}

impl Worker {
    async fn run(mut self, ready: oneshot::Sender<anyhow::Result<Vec<Member>>>) -> WorkerStats {
        let mut stats = WorkerStats::default();
        let mut members = Vec::with_capacity(self.range.len());
        for _ in self.range.clone() {
            let _permit = self.gate.acquire().await.expect("gate open");
            match open_one(self.target, &self.channel, self.spec.ttl).await {
                Ok(key) => members.push(Member {
                    zone: self.zone,
                    key,
                }),
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return stats;
                }
            }
            self.live.opened.fetch_add(1, Ordering::Relaxed);
        }
        let _ = ready.send(Ok(members.clone()));

        let period = self.spec.period();
        let first = self.range.start;
        let mut schedule = Schedule::new(period, self.spec.sessions, first, self.range.len());
        // Start at the next period boundary after opening, so these sessions take their
        // even slots instead of bursting to catch up on slots that passed while opening.
        let periods = (self.epoch.elapsed().as_secs_f64() / period.as_secs_f64()).ceil() as u32;
        let start = self.epoch + period * periods;

        let (tx, rx) = mpsc::channel::<Request>(4096);
        let (reply_tx, mut replies) = mpsc::channel::<Option<Reply>>(4096);
        let index: Arc<Index> = Arc::new(Index::new(&members));
        let mut io = JoinSet::new();
        io.spawn(drive_stream(
            self.target,
            self.channel.clone(),
            rx,
            reply_tx,
            index,
        ));
        let mut in_flight: Vec<VecDeque<Instant>> = vec![VecDeque::new(); members.len()];
        let mut seq = 0u64;
        let (mut job, mut due) = schedule.next();
        loop {
            tokio::select! {
                biased;
                _ = stopped(&mut self.stop) => break,
                reply = replies.recv() => match reply {
                    Some(Some(reply)) => {
                        let Some(sent) = in_flight[reply.local].pop_front() else { continue };
                        let now = Instant::now();
                        self.live.answered.fetch_add(1, Ordering::Relaxed);
                        if !reply.alive {
                            stats.expired.insert(first + reply.local);
                        }
                        if let Some(from) = *self.measure.borrow() {
                            if sent >= from {
                                stats.answered += 1;
                                stats.latency.record(now - sent);
                                stats.timeline.push((sent - from, now - sent));
                            }
                        }
                    }
                    Some(None) | None => {
                        stats.stream_errors += 1;
                        break;
                    }
                },
                _ = tokio::time::sleep_until(start + due) => {
                    let local = job - first;
                    seq += 1;
                    let request = match &members[local].key {
                        SessionKey::Lockcell { id, secret } => Request::Lockcell(KeepAliveRequest {
                            session_id: id.to_string(),
                            seq,
                            session_secret: secret.to_string(),
                        }),
                        SessionKey::Etcd(id) => Request::Etcd(LeaseKeepAliveRequest { id: *id }),
                    };
                    let sent = Instant::now();
                    in_flight[local].push_back(sent);
                    if tx.send(request).await.is_err() {
                        stats.stream_errors += 1;
                        break;
                    }
                    if self.measure.borrow().is_some_and(|from| sent >= from) {
                        stats.sent += 1;
                    }
                    self.live.sent.fetch_add(1, Ordering::Relaxed);
                    (job, due) = schedule.next();
                }
            }
        }
        io.abort_all();
        stats
    }
}

/// Resolves once `stop` turns true (or its sender is gone).
pub async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

enum Request {
    Lockcell(KeepAliveRequest),
    Etcd(LeaseKeepAliveRequest),
}

/// Maps a reply's session id or lease id to the worker's local index.
struct Index {
    lockcell: HashMap<Arc<str>, usize>,
    etcd: HashMap<i64, usize>,
}

impl Index {
    fn new(members: &[Member]) -> Self {
        let mut index = Index {
            lockcell: HashMap::new(),
            etcd: HashMap::new(),
        };
        for (i, m) in members.iter().enumerate() {
            match &m.key {
                SessionKey::Lockcell { id, .. } => index.lockcell.insert(id.clone(), i),
                SessionKey::Etcd(id) => index.etcd.insert(*id, i),
            };
        }
        index
    }
}

/// Opens the stream and pumps requests out and replies back; `None` marks its end.
async fn drive_stream(
    target: Target,
    channel: Channel,
    mut requests: mpsc::Receiver<Request>,
    replies: mpsc::Sender<Option<Reply>>,
    index: Arc<Index>,
) {
    if target.is_lockcell() {
        let (out_tx, out_rx) = mpsc::channel(4096);
        let forward = async move {
            while let Some(Request::Lockcell(r)) = requests.recv().await {
                if out_tx.send(r).await.is_err() {
                    break;
                }
            }
        };
        let receive = async {
            let Ok(resp) = SessionClient::new(channel)
                .keep_alive(ReceiverStream::new(out_rx))
                .await
            else {
                return;
            };
            let mut stream = resp.into_inner();
            while let Ok(Some(reply)) = stream.message().await {
                let Some(&local) = index.lockcell.get(reply.session_id.as_str()) else {
                    continue;
                };
                let alive = reply.state == SessionState::Alive as i32;
                if replies.send(Some(Reply { local, alive })).await.is_err() {
                    return;
                }
            }
        };
        tokio::select! { _ = forward => {}, _ = receive => {} }
    } else {
        let (out_tx, out_rx) = mpsc::channel(4096);
        let forward = async move {
            while let Some(Request::Etcd(r)) = requests.recv().await {
                if out_tx.send(r).await.is_err() {
                    break;
                }
            }
        };
        let receive = async {
            let Ok(resp) = LeaseClient::new(channel)
                .lease_keep_alive(ReceiverStream::new(out_rx))
                .await
            else {
                return;
            };
            let mut stream = resp.into_inner();
            while let Ok(Some(reply)) = stream.message().await {
                let Some(&local) = index.etcd.get(&reply.id) else {
                    continue;
                };
                if replies
                    .send(Some(Reply {
                        local,
                        alive: reply.ttl > 0,
                    }))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        };
        tokio::select! { _ = forward => {}, _ = receive => {} }
    }
    let _ = replies.send(None).await;
}
