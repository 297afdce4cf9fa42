//! A keepalive stream: renewals answered from memory, or once the proxy can back them,
//! or by the proxy a lease lives at (relayed there), or once a lease handed over here
//! has arrived.

use super::*;

mod relay;

use self::relay::relay;

use crate::etcd_api::forward::{pause_if_denied_by, MOVED_LOOKS};

/// What a proxy answers to a renewal forwarded by another proxy for a lease it does
/// not have (it moved away, or was revoked, or is not the caller's), as against 0 for
/// one that expired there: the forwarding proxy looks for it again. Never reaches a
/// client.
const MOVED_TTL: i64 = -1;

const KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";

/// Answers a renewal of lease `id` the proxy could not back when it came, once the
/// proxy can (it renews its own etcd lease within a renew interval), or not at all.
/// Returns true, having answered nothing, when the lease moved away meanwhile.
async fn answer_when_backed(relays: &Relays, id: i64) -> bool {
    let api = &relays.api;
    let give_up = Instant::now() + api.state.config.renew_interval();
    let mut look = tokio::time::interval(UNBACKED_LOOK);
    while Instant::now() < give_up {
        look.tick().await;
        let ttl = match renew(&api.state, id, relays.caller.as_deref()) {
            Renewal::Ttl(ttl) => ttl,
            Renewal::Unbacked => continue,
            Renewal::Unknown => return true,
            Renewal::HandedOff => return false,
        };
        let _ = relays.tx.send(Ok(api.kept_alive(id, ttl))).await;
        return false;
    }
    false
}

/// Answers a renewal the proxy could not back when it came ([`answer_when_backed`]),
/// or where the lease went if it moved away meanwhile.
async fn answer_when_backed_here_or_there(relays: Arc<Relays>, id: i64) {
    if answer_when_backed(&relays, id).await {
        relays.unknown(id, None).await;
    }
}

/// Answers a renewal of lease `id`, which this proxy is handing to a proxy that asked
/// for it: renewed where it ends up.
async fn answer_once_moved(relays: Arc<Relays>, id: i64) {
    let api = &relays.api;
    api.hand_over_settled(id).await;
    let ttl = match renew(&api.state, id, relays.caller.as_deref()) {
        Renewal::Ttl(ttl) => ttl,
        Renewal::Unbacked => return answer_when_backed_here_or_there(relays, id).await,
        Renewal::Unknown => return relays.unknown(id, None).await,
        Renewal::HandedOff => {
            let _ = relays
                .tx
                .send(Err(crate::etcd_api::refused_handed_off()))
                .await;
            return;
        }
    };
    let _ = relays.tx.send(Ok(api.kept_alive(id, ttl))).await;
}

/// Answers a renewal of lease `id`, unknown here: taken over first if a draining proxy
/// handed it over (see [`crate::etcd_api::handoff`]), else TTL 0, as etcd answers (or
/// [`MOVED_TTL`] to a proxy that forwarded it).
async fn take_over_and_answer(relays: Arc<Relays>, id: i64) {
    use crate::etcd_api::handoff::TakeOver;
    let api = &relays.api;
    let caller = relays.caller.as_deref();
    let ttl = match api.take_over(id, caller).await {
        Ok(TakeOver::Taken(_)) => match renew(&api.state, id, caller) {
            Renewal::Ttl(ttl) => ttl,
            Renewal::Unbacked => {
                if answer_when_backed(&relays, id).await {
                    relays.not_here()
                } else {
                    return;
                }
            }
            Renewal::Unknown | Renewal::HandedOff => relays.not_here(),
        },
        Ok(TakeOver::NoRecord) => relays.not_here(),
        Err(refused) => {
            let _ = relays.tx.send(Err(refused)).await;
            return;
        }
    };
    let _ = relays.tx.send(Ok(api.kept_alive(id, ttl))).await;
}

/// A client keepalive stream's streams to the other proxies, for its leases that live
/// there: one per proxy, opened at the first such lease.
pub(super) struct Relays {
    api: EtcdApi,
    caller: Option<String>,
    /// The client's call's metadata.
    metadata: tonic::metadata::MetadataMap,
    /// The client's replies.
    tx: Replies,
    /// By proxy id: the stream to it.
    open: std::sync::Mutex<HashMap<String, Relayed>>,
    /// The leases this stream's client renewed that are being looked for at the other
    /// proxies now.
    looking: std::sync::Mutex<std::collections::HashSet<i64>>,
}

/// A keepalive stream's replies to its client.
pub(super) type Replies = mpsc::Sender<Result<PbLeaseKeepAliveResponse, Status>>;

/// The leases sent on a stream to another proxy and not yet answered, each with how
/// many proxies have said of this renewal that the lease is not there.
type Waiting = Arc<std::sync::Mutex<Vec<(i64, u32)>>>;

/// A proxy that answered a renewal that the lease is not there, and how many have.
struct Denied {
    proxy: String,
    times: u32,
}

/// A stream to another proxy: its requests, and the leases sent on it and not yet
/// answered.
#[derive(Clone)]
struct Relayed {
    requests: mpsc::Sender<PbLeaseKeepAliveRequest>,
    waiting: Waiting,
}

impl Relays {
    pub(super) fn new(
        api: EtcdApi,
        caller: Option<String>,
        metadata: tonic::metadata::MetadataMap,
        tx: Replies,
    ) -> Arc<Self> {
        Arc::new(Relays {
            api,
            caller,
            metadata,
            tx,
            open: Default::default(),
            looking: Default::default(),
        })
    }

    /// Serves a client's keepalive stream: one renewal at a time, at most
    /// `--max-keepalives-per-stream` a second, until the client hangs up, its reply
    /// stream is dropped, or the proxy shuts down.
    pub(super) async fn serve(
        self: Arc<Self>,
        mut input: Streaming<PbLeaseKeepAliveRequest>,
        leader_required: bool,
    ) {
        let state = &self.api.state;
        let mut shutdown = state.shutdown.clone();
        let pace = crate::limits::StreamPace::new(state.config.max_keepalives_per_stream);
        loop {
            tokio::select! {
                () = pace.turn() => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            let msg = tokio::select! {
                msg = input.message() => msg,
                _ = shutdown.wait_for(|stop| *stop) => return,
            };
            let req = match msg {
                Ok(Some(req)) => req,
                Ok(None) => return,
                // A request that did not read (over etcd's JSON gateway: one that
                // is not JSON): the client hears why.
                Err(status) => {
                    let _ = self.tx.send(Err(status)).await;
                    return;
                }
            };
            metrics::counter!(m::KEEPALIVES).increment(1);
            if leader_required && self.api.without_leader() {
                let _ = self
                    .tx
                    .send(Err(Status::unavailable(crate::etcd_api::NO_LEADER)))
                    .await;
                return;
            }
            if !self.answer(req.id).await {
                return;
            }
        }
    }

    /// Answers a renewal of lease `id`, now or later; false when the stream ends.
    ///
    /// etcd's TTLs are whole seconds. A renewal the proxy cannot back for a whole
    /// second now (its own etcd lease is near its lower bound, as it is just before
    /// each of its renewals with a short lease TTL) is answered once it can, after the
    /// proxy renews its lease; until then the client counts down its own TTL, as it
    /// would with etcd slow.
    async fn answer(self: &Arc<Self>, id: i64) -> bool {
        let state = &self.api.state;
        let ttl = match renew(state, id, self.caller.as_deref()) {
            Renewal::Ttl(ttl) => ttl,
            Renewal::Unbacked => {
                tokio::spawn(answer_when_backed_here_or_there(self.clone(), id));
                return true;
            }
            // At another proxy (forwarded there), or handed over by a draining proxy
            // (taken over here first). Finding it reads etcd, so each lookup is paced
            // as a call of the caller's, and a lease already being looked for on this
            // stream is not looked for twice (that lookup's answer answers the client).
            Renewal::Unknown => {
                if !self.start_looking(id) {
                    return true;
                }
                if let Err(refused) = state.pace(self.caller.as_deref()) {
                    self.done_looking(id);
                    let _ = self.tx.send(Err(refused.into())).await;
                    return false;
                }
                let relays = self.clone();
                tokio::spawn(async move {
                    relays.clone().unknown(id, None).await;
                    relays.done_looking(id);
                });
                return true;
            }
            // On its way to a proxy that asked for it: answered once there.
            Renewal::HandedOff if !state.is_draining() => {
                tokio::spawn(answer_once_moved(self.clone(), id));
                return true;
            }
            // The client goes on with another proxy (its stream ends here).
            Renewal::HandedOff => {
                let _ = self
                    .tx
                    .send(Err(crate::etcd_api::refused_handed_off()))
                    .await;
                return false;
            }
        };
        self.tx.send(Ok(self.api.kept_alive(id, ttl))).await.is_ok()
    }

    /// Marks lease `id` as being looked for; false when it already is.
    fn start_looking(&self, id: i64) -> bool {
        self.looking.lock().expect("looking lock").insert(id)
    }

    fn done_looking(&self, id: i64) {
        self.looking.lock().expect("looking lock").remove(&id);
    }

    /// Answers a renewal of lease `id`, which this proxy does not have: forwarded to
    /// the proxy it lives at, or taken over here (or TTL 0, as etcd answers, when it is
    /// nowhere). `denied` is the proxy that has just answered it does not have the
    /// lease: it is looked for afresh, and relayed again even where it was denied (it
    /// may have moved away and back) after a pause, until [`MOVED_LOOKS`] proxies have
    /// denied it; then the client is told TTL 0.
    async fn unknown(self: Arc<Self>, id: i64, denied: Option<Denied>) {
        let api = &self.api;
        let caller = self.caller.as_deref();
        let times = denied.as_ref().map_or(0, |d| d.times);
        if times >= MOVED_LOOKS {
            // Denied everywhere it was found: it has no such lease (ended, or not the
            // caller's), as etcd answers.
            let _ = self.tx.send(Ok(api.kept_alive(id, 0))).await;
            return;
        }
        let peer = match api
            .route(id, &self.metadata, caller, denied.is_some())
            .await
        {
            Ok(Some(peer)) => peer,
            Ok(None) => return take_over_and_answer(self.clone(), id).await,
            // The client hears why (its stream ends; clients open another).
            Err(refused) => {
                tracing::warn!(error = %refused.message(), lease = format_args!("{id:x}"), "could not find where a lease lives");
                let _ = self.tx.send(Err(refused)).await;
                return;
            }
        };
        pause_if_denied_by(denied.as_ref().map(|d| d.proxy.as_str()), &peer.proxy).await;
        let request = PbLeaseKeepAliveRequest { id };
        for _ in 0..2 {
            let Some(relayed) = self.stream_to(&peer) else {
                return;
            };
            metrics::counter!(m::ETCD_API_FORWARDED).increment(1);
            relayed
                .waiting
                .lock()
                .expect("waiting lock")
                .push((id, times));
            if relayed.requests.send(request).await.is_ok() {
                return;
            }
            relayed
                .waiting
                .lock()
                .expect("waiting lock")
                .retain(|w| w.0 != id);
            self.open.lock().expect("relays lock").remove(&peer.proxy);
        }
    }

    /// The TTL answered for a lease that is not here: 0 to a client, as etcd answers
    /// for a lease it does not have; [`MOVED_TTL`] to a proxy that forwarded the
    /// renewal, which then looks for the lease again.
    fn not_here(&self) -> i64 {
        match self.metadata.contains_key(forward::FORWARDED_FOR) {
            true => MOVED_TTL,
            false => 0,
        }
    }

    /// A new set of relays for the same client, with no stream open: what a renewal
    /// still unanswered uses once the client has half-closed its stream (and so let go
    /// of its relays), so the client still hears its answer.
    fn detached(&self) -> Arc<Relays> {
        Arc::new(Relays {
            api: self.api.clone(),
            caller: self.caller.clone(),
            metadata: self.metadata.clone(),
            tx: self.tx.clone(),
            open: Default::default(),
            looking: Default::default(),
        })
    }

    /// The stream to `peer`, opened if it is not yet.
    fn stream_to(self: &Arc<Self>, peer: &crate::etcd_api::forward::Peer) -> Option<Relayed> {
        let mut open = self.open.lock().expect("relays lock");
        if let Some(relayed) = open.get(&peer.proxy) {
            return Some(relayed.clone());
        }
        let (sender, requests) = mpsc::channel(KEEPALIVE_BUFFER);
        let call = self
            .api
            .forwarded(
                &self.metadata,
                ReceiverStream::new(requests),
                self.caller.as_deref(),
            )
            .ok()?;
        let relayed = Relayed {
            requests: sender,
            waiting: Arc::default(),
        };
        open.insert(peer.proxy.clone(), relayed.clone());
        tokio::spawn(relay(
            Arc::downgrade(self),
            self.detached(),
            peer.clone(),
            call,
            relayed.waiting.clone(),
        ));
        Some(relayed)
    }
}

impl EtcdApi {
    fn kept_alive(&self, id: i64, ttl: i64) -> PbLeaseKeepAliveResponse {
        PbLeaseKeepAliveResponse {
            header: Some(self.header(self.state.cell.seen())),
            id,
            ttl,
        }
    }
}

/// How often a renewal waiting for the proxy's lease looks again.
const UNBACKED_LOOK: Duration = Duration::from_millis(50);

/// What a renewal from memory found.
enum Renewal {
    /// The TTL to answer (0: the lease expired, as etcd answers).
    Ttl(i64),
    /// The proxy cannot back even a second of it now.
    Unbacked,
    /// Not here: perhaps handed over by another proxy.
    Unknown,
    /// Handed over by this proxy, draining.
    HandedOff,
}

/// Renews lease `id` from memory.
fn renew(state: &ProxyState, id: i64, caller: Option<&str>) -> Renewal {
    let now = Instant::now();
    let validity = |r: Renewed| {
        let left = state.leases.left(r.bucket, r.lease, now);
        left.min(state.leases.within(r.ttl))
    };
    match state.sessions.renew(&session_of(id), caller, now, validity) {
        Ok(valid_for) if valid_for >= Duration::from_secs(1) => Renewal::Ttl(seconds(valid_for)),
        Ok(_) => {
            metrics::counter!(m::ETCD_API_KEEPALIVES_UNBACKED).increment(1);
            Renewal::Unbacked
        }
        Err(Gone::HandedOff) => Renewal::HandedOff,
        Err(Gone::Unknown) => Renewal::Unknown,
        Err(Gone::Expired(_)) => Renewal::Ttl(0),
    }
}
