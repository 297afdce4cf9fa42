//! Keepalive probes: one raw lockcell session per proxy address, renewed every
//! [`PROBE_INTERVAL`] on a connection of its own, timing every renewal's round trip.
//!
//! The SDK does not say how long its renewals take, so a scenario that drives SDK
//! sessions measures the proxies' keepalive path with these instead. A probe behaves as
//! a polite raw client: when its proxy asks it to move (draining), it closes its session
//! there, and it opens a new one once the address serves again (a restarted proxy). So
//! while a proxy is down its probe has no samples; what the probes measure is how fast
//! the proxies that do serve answer renewals, not how long a move takes.

use std::collections::HashMap;
use std::time::Duration;

use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{CloseRequest, KeepAliveRequest, OpenRequest, SessionState};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::fleet::stopped;

/// How often each probe renews its session: 20 round trips per second per proxy, a
/// small load next to the sessions under test.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(50);
/// How long to wait before opening a session again on an address that refused.
const REOPEN_DELAY: Duration = Duration::from_millis(100);
/// Bound on one Open or Close call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// What all probes saw.
#[derive(Debug, Default)]
pub struct ProbeStats {
    /// (when the renewal was sent, its round trip), for every renewal answered.
    pub round_trips: Vec<(Instant, Duration)>,
    /// Renewals that got no answer because the stream broke first.
    pub unanswered: u64,
    /// Sessions the probes opened (one per probe, plus one per reopen).
    pub sessions_opened: u64,
}

/// Running probes; [`Probes::finish`] stops them.
pub struct Probes {
    stop: watch::Sender<bool>,
    tasks: JoinSet<ProbeStats>,
}

impl Probes {
    /// Starts one probe per address (`127.0.0.1:PORT`), with sessions of `ttl`.
    pub fn start(addrs: &[String], ttl: Duration) -> anyhow::Result<Probes> {
        let (stop, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        for addr in addrs {
            let channel = Endpoint::from_shared(format!("http://{addr}"))?
                .tcp_nodelay(true)
                .connect_timeout(Duration::from_secs(1))
                .connect_lazy();
            tasks.spawn(probe(channel, ttl, stop.subscribe()));
        }
        Ok(Probes { stop, tasks })
    }

    /// Stops every probe (closing its session) and merges what they saw.
    pub async fn finish(mut self) -> ProbeStats {
        let _ = self.stop.send(true);
        let mut all = ProbeStats::default();
        while let Some(done) = self.tasks.join_next().await {
            if let Ok(stats) = done {
                all.round_trips.extend(stats.round_trips);
                all.unanswered += stats.unanswered;
                all.sessions_opened += stats.sessions_opened;
            }
        }
        all
    }
}

/// How one session's renewals ended.
enum Ended {
    Stopped,
    /// The proxy asked its clients to move (it drains).
    AskedToMove,
    /// The stream broke, or the proxy no longer knows the session.
    Broken,
}

/// One probe: open a session, renew it until the proxy asks to move or goes away, and
/// again, until stopped.
async fn probe(channel: Channel, ttl: Duration, mut stop: watch::Receiver<bool>) -> ProbeStats {
    let mut stats = ProbeStats::default();
    while !*stop.borrow() {
        let Some(id) = open(&channel, ttl).await else {
            tokio::select! {
                _ = tokio::time::sleep(REOPEN_DELAY) => {}
                _ = stop.changed() => {}
            }
            continue;
        };
        stats.sessions_opened += 1;
        match renew(&channel, &id, &mut stats, &mut stop).await {
            Ended::Stopped | Ended::AskedToMove => close(&channel, &id).await,
            Ended::Broken => {}
        }
    }
    stats
}

/// Opens a session; `None` while the address does not serve (down, draining, no lease).
/// An open session: its id and the secret every call on it carries.
struct Credential {
    id: String,
    secret: String,
}

async fn open(channel: &Channel, ttl: Duration) -> Option<Credential> {
    let mut request = tonic::Request::new(OpenRequest {
        ttl_ms: ttl.as_millis() as u64,
        identity: "loadtest/probe".into(),
    });
    request.set_timeout(CALL_TIMEOUT);
    let reply = SessionClient::new(channel.clone()).open(request).await;
    reply.ok().map(|r| {
        let r = r.into_inner();
        Credential {
            id: r.session_id,
            secret: r.session_secret,
        }
    })
}

async fn close(channel: &Channel, session: &Credential) {
    let id = &session.id;
    let mut request = tonic::Request::new(CloseRequest {
        session_id: id.to_owned(),
        session_secret: session.secret.clone(),
        incarnation: 0,
        cells: Vec::new(),
    });
    request.set_timeout(CALL_TIMEOUT);
    if let Err(status) = SessionClient::new(channel.clone()).close(request).await {
        tracing::debug!(session.id = id, %status, "probe session not closed");
    }
}

/// Renews `id` every [`PROBE_INTERVAL`] on one stream, recording round trips.
async fn renew(
    channel: &Channel,
    session: &Credential,
    stats: &mut ProbeStats,
    stop: &mut watch::Receiver<bool>,
) -> Ended {
    let (tx, rx) = mpsc::channel(16);
    let Ok(reply) = SessionClient::new(channel.clone())
        .keep_alive(ReceiverStream::new(rx))
        .await
    else {
        return Ended::Broken;
    };
    let mut replies = reply.into_inner();
    let mut in_flight: HashMap<u64, Instant> = HashMap::new();
    let mut seq = 0;
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ended = loop {
        tokio::select! {
            _ = stopped(stop) => break Ended::Stopped,
            _ = tick.tick() => {
                seq += 1;
                in_flight.insert(seq, Instant::now());
                let request = KeepAliveRequest {
                    session_id: session.id.clone(),
                    seq,
                    session_secret: session.secret.clone(),
                };
                if tx.send(request).await.is_err() {
                    break Ended::Broken;
                }
            }
            reply = replies.message() => match reply {
                Ok(Some(reply)) => {
                    if let Some(sent) = in_flight.remove(&reply.seq) {
                        stats.round_trips.push((sent, sent.elapsed()));
                    }
                    if reply.state != SessionState::Alive as i32 {
                        break Ended::Broken;
                    }
                    if reply.move_elsewhere {
                        break Ended::AskedToMove;
                    }
                }
                Ok(None) | Err(_) => break Ended::Broken,
            },
        }
    };
    if matches!(ended, Ended::Broken) {
        stats.unanswered += in_flight.len() as u64;
    }
    ended
}
