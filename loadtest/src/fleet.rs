//! A fleet of client sessions, each kept alive with one message per renewal, spread
//! over zones and over many client connections.
//!
//! For lockcell a session is a proxy session renewed on a `KeepAlive` stream; for bare
//! etcd (direct or through grpc-proxy) it is an etcd lease renewed on a
//! `LeaseKeepAlive` stream. Each connection carries one stream with the renewals of its
//! sessions. Each session is renewed as its own client would renew it: every renewal
//! period from the moment its open was sent, starting while the rest of the fleet is
//! still opening. The opens are spread evenly over one renewal period (over longer when
//! the target opens more slowly), each connection's in turn with the others', so the
//! renewals spread evenly over the period too.
//!
//! A session the target declares gone is judged by what its client knows: a false
//! expiry when the renewal that met "gone" left within a TTL of the last renewal
//! answered alive (or of the open), so the target owed the session its life; otherwise
//! the load generator renewed it late, which is counted apart and never against the
//! target. Each expiry keeps its timeline (open, last alive, recent renewals, the
//! target's answer) as evidence.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lockcell_loadtest::expiry::{Expiry, Track, Verdict};
use lockcell_loadtest::pacing::{due_offset, interleaved, share};
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::Samples;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{KeepAliveRequest, OpenRequest, SessionState};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint};

use crate::cluster::{Cell, Target};
use crate::etcdpb::lease_client::LeaseClient;
use crate::etcdpb::{LeaseGrantRequest, LeaseKeepAliveRequest};

/// A fleet connection as its calls use it: the channel, with the cell's bearer token on
/// every call when its proxies check grants.
pub type Conn = InterceptedService<Channel, Bearer>;

/// The `authorization` metadata a guarded cell's callers send (none for the others).
#[derive(Clone, Default)]
pub struct Bearer(pub Option<MetadataValue<Ascii>>);

impl Bearer {
    pub fn token(token: &str) -> anyhow::Result<Bearer> {
        Ok(Bearer(Some(format!("Bearer {token}").parse()?)))
    }

    /// `channel` with this token on every call.
    pub fn on(&self, channel: Channel) -> Conn {
        InterceptedService::new(channel, self.clone())
    }
}

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        Ok(request)
    }
}

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

    /// Refuses a shape no careful client has, or that the targets would not run alike:
    /// a TTL that is not a whole number of seconds (etcd's lease TTLs are whole
    /// seconds), and fewer than two renewals per TTL (renewing once per TTL expires
    /// every session by design).
    pub fn check(&self) -> anyhow::Result<()> {
        if self.ttl.is_zero() || self.ttl.subsec_nanos() != 0 {
            anyhow::bail!(
                "--ttl {} is not a whole number of seconds (at least 1 s): etcd's lease TTLs are whole seconds, and every target must run the same TTL",
                humantime::format_duration(self.ttl)
            );
        }
        if self.renewals_per_ttl < 2 {
            anyhow::bail!(
                "--renewals-per-ttl {} is below 2: a session renewed once per TTL (or never) expires by design",
                self.renewals_per_ttl
            );
        }
        Ok(())
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
    /// How late each renewal left the load generator against its due time (its own
    /// lateness, which it must not count against the target).
    pub send_lag: Samples,
    /// (offset of the send since the phase start, round trip).
    pub timeline: Vec<(Duration, Duration)>,
    /// Sessions the target declared gone although the client renewed them in time.
    pub false_expiries: Vec<Expiry>,
    /// Sessions that expired because the load generator itself renewed them late: not
    /// the target's doing, reported apart.
    pub renewed_late: Vec<Expiry>,
    /// Sessions whose renewals in time went unanswered for a TTL when the run ended.
    pub unanswered: Vec<Expiry>,
    /// Stream failures (reconnects are not attempted: a broken stream is a finding).
    pub stream_errors: u64,
    /// Sessions not declared gone that a broken stream cut off: renewed no more, and
    /// not judged.
    pub sessions_cut_off: u64,
    /// Renewals due while the stream was stalled (its buffers full: the target read
    /// nothing), so they were never sent.
    pub renewals_not_sent: u64,
}

/// Puts the expiries of the sessions `counted` selects into `report`: the target's
/// false expiries, the sessions the load generator renewed late, and one line of
/// evidence for each of the first few of both.
pub fn report_expiries(
    report: &mut Report,
    workers: &[WorkerStats],
    counted: impl Fn(usize) -> bool,
) {
    let pick = |of: fn(&WorkerStats) -> &Vec<Expiry>| {
        let mut all: Vec<&Expiry> = workers
            .iter()
            .flat_map(|w| of(w).iter())
            .filter(|e| counted(e.session))
            .collect();
        all.sort_by_key(|e| e.answered);
        all
    };
    let (false_expiries, late) = (pick(|w| &w.false_expiries), pick(|w| &w.renewed_late));
    let unanswered = pick(|w| &w.unanswered);
    report.metric("false_expiries", false_expiries.len() as f64);
    report.metric("expiries_renewed_late", late.len() as f64);
    report.metric("sessions_unanswered", unanswered.len() as f64);
    for (kind, list) in [
        ("false expiry", &false_expiries),
        ("unanswered", &unanswered),
        ("renewed late", &late),
    ] {
        for e in list.iter().take(EVIDENCE_LINES) {
            report.evidence.push(format!("{kind}: {}", e.line()));
        }
        if list.len() > EVIDENCE_LINES {
            report
                .evidence
                .push(format!("{kind}: {} more", list.len() - EVIDENCE_LINES));
        }
    }
}

/// Expiries of each kind a report describes one by one.
const EVIDENCE_LINES: usize = 20;

/// A running fleet.
pub struct Fleet {
    pub members: Vec<Member>,
    pub live: Arc<Live>,
    connections: Vec<(usize, Channel)>,
    workers: JoinSet<WorkerStats>,
    zone_stop: Vec<watch::Sender<bool>>,
    /// The measured window: workers count the round trips of renewals sent in it.
    measure: watch::Sender<Option<Window>>,
}

/// The measured window of a run.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub from: Instant,
    pub until: Instant,
}

impl Window {
    fn holds(&self, at: Instant) -> bool {
        at >= self.from && at < self.until
    }
}

/// Sessions opened at once, fleet-wide, so opening does not swamp the target.
const OPEN_CONCURRENCY: usize = 256;

impl Fleet {
    /// Connects and opens every session (members `share(n, c, i)` on connection `i`,
    /// connection `i` in zone `i % zones`). Each session is renewed from the moment it
    /// opens, so none waits for the rest of the fleet.
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
                channel: cell.bearer().on(channel.clone()),
                zone: *zone,
                connection: c,
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
                Err(_) => anyhow::bail!(
                    "a connection's worker ended before opening its sessions (it panicked)"
                ),
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

    /// Counts the round trips of renewals sent from `from` until `until` (replies to
    /// other renewals only count as expiries).
    pub fn measure(&self, from: Instant, until: Instant) {
        let _ = self.measure.send(Some(Window { from, until }));
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
}

async fn open_one(target: Target, channel: &Conn, ttl: Duration) -> anyhow::Result<SessionKey> {
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
        let asked = ttl.as_secs() as i64;
        let reply = LeaseClient::new(channel.clone())
            .lease_grant(LeaseGrantRequest { ttl: asked, id: 0 })
            .await
            .context("granting an etcd lease")?
            .into_inner();
        if reply.ttl != asked {
            anyhow::bail!(
                "etcd granted a lease of {} s for the {asked} s asked (below its minimum lease TTL?): the targets would not run the same TTL",
                reply.ttl
            );
        }
        Ok(SessionKey::Etcd(reply.id))
    }
}

/// Opens one connection's sessions and renews each over the connection's one stream,
/// every period from the moment it was opened, while the rest are still opening.
struct Worker {
    target: Target,
    channel: Conn,
    zone: usize,
    /// This connection's place among the fleet's.
    connection: usize,
    /// The fleet indices of this connection's sessions.
    range: std::ops::Range<usize>,
    spec: FleetSpec,
    /// When the fleet started opening: the evidence's times count from it.
    epoch: Instant,
    gate: Arc<Semaphore>,
    stop: watch::Receiver<bool>,
    measure: watch::Receiver<Option<Window>>,
    live: Arc<Live>,
}

/// A reply from either protocol: which session, the renewal's number when the target
/// echoes it, and, when the target declared the session gone, its answer (state and
/// reason).
struct Reply {
    key: ReplyKey,
    seq: Option<u64>,
    gone: Option<String>,
}

/// Whether a renewal went into the stream.
enum Queued {
    Yes,
    /// The stream's buffer is full: the target is not reading.
    Stalled,
    Closed,
}

/// The session a reply is about, as the protocol names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum ReplyKey {
    Lockcell(Arc<str>),
    Etcd(i64),
}

impl SessionKey {
    fn reply_key(&self) -> ReplyKey {
        match self {
            SessionKey::Lockcell { id, .. } => ReplyKey::Lockcell(id.clone()),
            SessionKey::Etcd(id) => ReplyKey::Etcd(*id),
        }
    }
}

impl Worker {
    async fn run(mut self, ready: oneshot::Sender<anyhow::Result<Vec<Member>>>) -> WorkerStats {
        let mut stats = WorkerStats::default();
        let mut ready = Some(ready);
        let (opened_tx, mut opened) = mpsc::unbounded_channel();
        // Opens spread over one renewal period (longer if the target opens slower), so
        // renewals counted from each open spread evenly too.
        let (epoch, period, sessions) = (self.epoch, self.spec.period(), self.spec.sessions);
        let (connections, connection) = (self.spec.connections, self.connection);
        let mut io = JoinSet::new();
        let opening = Opening {
            target: self.target,
            channel: self.channel.clone(),
            ttl: self.spec.ttl,
            gate: self.gate.clone(),
            live: self.live.clone(),
            slots: (0..self.range.len())
                .map(|j| {
                    epoch + due_offset(period, sessions, interleaved(connections, connection, j), 0)
                })
                .collect(),
        };
        io.spawn(opening.run(opened_tx));
        let (reply_tx, mut replies) = mpsc::channel::<Result<Reply, String>>(4096);
        let outbox = Outbox::open(self.target, self.channel.clone(), reply_tx, &mut io);

        let (ttl, first) = (self.spec.ttl, self.range.start);
        let mut members: Vec<Member> = Vec::with_capacity(self.range.len());
        let mut tracks: Vec<Track> = Vec::with_capacity(self.range.len());
        let mut index: HashMap<ReplyKey, usize> = HashMap::with_capacity(self.range.len());
        // Each session's next renewal, due a period after the one before, the first a
        // period after its open was sent: its client counts its TTL from there.
        let mut due: BinaryHeap<Reverse<(Instant, usize)>> = BinaryHeap::new();
        let mut seq = 0u64;
        let broken = loop {
            let next = due.peek().map(|Reverse((at, _))| *at);
            tokio::select! {
                biased;
                _ = stopped(&mut self.stop) => break None,
                event = opened.recv(), if ready.is_some() => match event {
                    Some(Opened::Session(sent, key)) => {
                        let local = members.len();
                        index.insert(SessionKey::reply_key(&key), local);
                        members.push(Member { zone: self.zone, key });
                        tracks.push(Track::new(sent));
                        due.push(Reverse((sent + period, local)));
                    }
                    Some(Opened::Failed(e)) => {
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(Err(e));
                        }
                        break None;
                    }
                    Some(Opened::All) | None => {
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(Ok(members.clone()));
                        }
                    }
                },
                reply = replies.recv() => match reply {
                    Some(Ok(reply)) => self.judge(reply, &index, &mut tracks, &mut stats),
                    Some(Err(why)) => break Some(why),
                    None => break Some("the stream ended".into()),
                },
                _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                    let Reverse((at, local)) = due.pop().expect("peeked");
                    if tracks[local].is_gone() {
                        continue;
                    }
                    due.push(Reverse((at + period, local)));
                    seq += 1;
                    let sent = Instant::now();
                    match outbox.renew(&members[local].key, seq) {
                        Queued::Yes => {
                            tracks[local].sent(self.target.is_lockcell().then_some(seq), sent);
                            if self.measure.borrow().is_some_and(|w| w.holds(sent)) {
                                stats.sent += 1;
                                stats.send_lag.record(sent - at);
                            }
                            self.live.sent.fetch_add(1, Ordering::Relaxed);
                        }
                        // The target reads nothing: the renewal cannot leave, and the
                        // session's own clock runs on.
                        Queued::Stalled => stats.renewals_not_sent += 1,
                        Queued::Closed => break Some("the stream was closed".into()),
                    }
                }
            }
        };
        if let Some(why) = broken {
            stats.stream_errors += 1;
            stats.sessions_cut_off = tracks.iter().filter(|t| !t.is_gone()).count() as u64;
            if let Some(ready) = ready.take() {
                let _ = ready.send(Err(anyhow::anyhow!(
                    "the keepalive stream of connection {} broke while its sessions opened: {why}",
                    self.connection
                )));
            }
        } else {
            // Answers to renewals already sent still count: wait for them a little.
            let drain = Instant::now() + period.min(Duration::from_secs(2));
            while tracks.iter().any(|t| t.in_flight() > 0) {
                tokio::select! {
                    reply = replies.recv() => match reply {
                        Some(Ok(reply)) => self.judge(reply, &index, &mut tracks, &mut stats),
                        Some(Err(_)) | None => break,
                    },
                    _ = tokio::time::sleep_until(drain) => break,
                }
            }
            let end = Instant::now();
            for (local, track) in tracks.iter().enumerate() {
                if let Some(e) = track.at_end(end, ttl, self.epoch, first + local) {
                    stats.unanswered.push(e);
                }
            }
        }
        io.abort_all();
        stats
    }

    /// Takes one reply: pairs it with its renewal, times it, and judges an expiry.
    fn judge(
        &self,
        reply: Reply,
        index: &HashMap<ReplyKey, usize>,
        tracks: &mut [Track],
        stats: &mut WorkerStats,
    ) {
        let Some(&local) = index.get(&reply.key) else {
            return;
        };
        let now = Instant::now();
        let (sent, expiry) = tracks[local].answered(
            reply.seq,
            now,
            reply.gone,
            self.spec.ttl,
            self.epoch,
            self.range.start + local,
        );
        let Some(sent) = sent else { return };
        self.live.answered.fetch_add(1, Ordering::Relaxed);
        match expiry {
            Some(e) if e.verdict == Verdict::False => stats.false_expiries.push(e),
            Some(e) => stats.renewed_late.push(e),
            None => {}
        }
        if self.measure.borrow().is_some_and(|w| w.holds(sent)) {
            let from = self.measure.borrow().expect("measured").from;
            stats.answered += 1;
            stats.latency.record(now - sent);
            stats.timeline.push((sent - from, now - sent));
        }
    }
}

/// What the opening of one connection's sessions tells its worker.
enum Opened {
    /// A session opened, with the time its open was sent.
    Session(Instant, SessionKey),
    /// An open failed; the rest were not tried.
    Failed(anyhow::Error),
    /// Every session is open.
    All,
}

/// One connection's sessions to open, one after another, each at its slot and when
/// the fleet's gate lets it.
struct Opening {
    target: Target,
    channel: Conn,
    ttl: Duration,
    gate: Arc<Semaphore>,
    live: Arc<Live>,
    /// When each session may open at the earliest.
    slots: Vec<Instant>,
}

impl Opening {
    /// Hands each session to the worker as it opens, then says they are all open (or
    /// the first failure).
    async fn run(self, opened: mpsc::UnboundedSender<Opened>) {
        for slot in &self.slots {
            tokio::time::sleep_until(*slot).await;
            let _permit = self.gate.acquire().await.expect("gate open");
            let sent = Instant::now();
            match open_one(self.target, &self.channel, self.ttl).await {
                Ok(key) => {
                    let _ = opened.send(Opened::Session(sent, key));
                }
                Err(e) => {
                    let _ = opened.send(Opened::Failed(e));
                    return;
                }
            }
            self.live.opened.fetch_add(1, Ordering::Relaxed);
        }
        let _ = opened.send(Opened::All);
    }
}

/// Resolves once `stop` turns true (or its sender is gone).
pub async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Where a worker puts its renewals: the request side of its connection's stream.
enum Outbox {
    Lockcell(mpsc::Sender<KeepAliveRequest>),
    Etcd(mpsc::Sender<LeaseKeepAliveRequest>),
}

impl Outbox {
    /// Opens the connection's renewal stream; its replies go to `replies`, and why it
    /// ended as the last, from a task spawned on `io`.
    fn open(
        target: Target,
        channel: Conn,
        replies: mpsc::Sender<Result<Reply, String>>,
        io: &mut JoinSet<()>,
    ) -> Outbox {
        let read = replies.clone();
        let (outbox, stream): (Outbox, Pin<Box<dyn Future<Output = String> + Send>>) =
            if target.is_lockcell() {
                let (tx, rx) = mpsc::channel(4096);
                (
                    Outbox::Lockcell(tx),
                    Box::pin(lockcell_replies(channel, rx, read)),
                )
            } else {
                let (tx, rx) = mpsc::channel(4096);
                (Outbox::Etcd(tx), Box::pin(etcd_replies(channel, rx, read)))
            };
        io.spawn(async move {
            let why = stream.await;
            let _ = replies.send(Err(why)).await;
        });
        outbox
    }

    /// Puts one renewal of `key` into the stream, never waiting: a full buffer means
    /// the target has stopped reading, and the worker must go on answering and judging.
    fn renew(&self, key: &SessionKey, seq: u64) -> Queued {
        use mpsc::error::TrySendError;
        let queued = match (self, key) {
            (Outbox::Lockcell(tx), SessionKey::Lockcell { id, secret }) => tx
                .try_send(KeepAliveRequest {
                    session_id: id.to_string(),
                    seq,
                    session_secret: secret.to_string(),
                })
                .map_err(|e| matches!(e, TrySendError::Full(_))),
            (Outbox::Etcd(tx), SessionKey::Etcd(id)) => tx
                .try_send(LeaseKeepAliveRequest { id: *id })
                .map_err(|e| matches!(e, TrySendError::Full(_))),
            _ => unreachable!("a fleet's sessions are all of its target's kind"),
        };
        match queued {
            Ok(()) => Queued::Yes,
            Err(true) => Queued::Stalled,
            Err(false) => Queued::Closed,
        }
    }
}

/// Reads a lockcell keepalive stream's replies until it ends; returns why it ended.
async fn lockcell_replies(
    channel: Conn,
    requests: mpsc::Receiver<KeepAliveRequest>,
    replies: mpsc::Sender<Result<Reply, String>>,
) -> String {
    let opened = SessionClient::new(channel)
        .keep_alive(ReceiverStream::new(requests))
        .await;
    relay(opened, replies, |reply| {
        let gone = (reply.state != SessionState::Alive as i32).then(|| {
            let state = SessionState::try_from(reply.state)
                .map_or_else(|_| reply.state.to_string(), |s| s.as_str_name().to_owned());
            format!("{state}: {}", reply.reason)
        });
        Reply {
            key: ReplyKey::Lockcell(reply.session_id.into()),
            seq: Some(reply.seq),
            gone,
        }
    })
    .await
}

/// Reads an etcd lease keepalive stream's replies until it ends; returns why it ended.
/// etcd answers each renewal in order and echoes no number.
async fn etcd_replies(
    channel: Conn,
    requests: mpsc::Receiver<LeaseKeepAliveRequest>,
    replies: mpsc::Sender<Result<Reply, String>>,
) -> String {
    let opened = LeaseClient::new(channel)
        .lease_keep_alive(ReceiverStream::new(requests))
        .await;
    relay(opened, replies, |reply| Reply {
        key: ReplyKey::Etcd(reply.id),
        seq: None,
        gone: (reply.ttl <= 0).then(|| format!("lease TTL {}", reply.ttl)),
    })
    .await
}

/// Hands each message of an opened stream to the worker as a [`Reply`]; returns why
/// the stream ended.
async fn relay<T>(
    opened: Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>,
    replies: mpsc::Sender<Result<Reply, String>>,
    reply: impl Fn(T) -> Reply,
) -> String {
    let mut stream = match opened {
        Ok(resp) => resp.into_inner(),
        Err(e) => return format!("the keepalive stream could not open: {e}"),
    };
    loop {
        match stream.message().await {
            Ok(Some(message)) => {
                if replies.send(Ok(reply(message))).await.is_err() {
                    return "the worker stopped".into();
                }
            }
            Ok(None) => return "the target ended the stream".into(),
            Err(e) => return format!("the stream failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(ttl: Duration, renewals_per_ttl: u32) -> FleetSpec {
        FleetSpec {
            sessions: 10,
            ttl,
            renewals_per_ttl,
            connections: 1,
        }
    }

    #[test]
    fn shapes_no_careful_client_has_are_refused_by_name() {
        spec(Duration::from_secs(4), 4).check().unwrap();
        for (ttl, renewals, named) in [
            (Duration::from_millis(1500), 4, "--ttl 1s 500ms"),
            (Duration::ZERO, 4, "--ttl 0s"),
            (Duration::from_secs(4), 1, "--renewals-per-ttl 1"),
            (Duration::from_secs(4), 0, "--renewals-per-ttl 0"),
        ] {
            let e = spec(ttl, renewals).check().unwrap_err().to_string();
            assert!(e.contains(named), "{e}");
        }
    }
}
