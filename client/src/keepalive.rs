//! The keep-alive multiplexer: one task per [`Client`](crate::Client) that renews all of
//! its sessions over ONE `Session.KeepAlive` bidi stream, pairs each reply with the
//! instant its request was sent, and moves deadlines (or expires sessions) accordingly.
//!
//! When the stream breaks (or stops answering) the driver moves: it tries the client's
//! other proxies in order of preference (the one that failed last), resumes every
//! session on the first that answers (their keys move onto its lease, tokens unchanged)
//! and renews there. A proxy that asks its clients to go (draining, or unable to renew
//! its etcd lease) is left the same way while it still answers. Meanwhile no deadline
//! moves, so sessions fall into jeopardy on their own if that takes too long: the
//! driver never has to decide that a session is in danger, the clock does. A session
//! in jeopardy for longer than the grace period with no proxy reached expires.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::proxies::Channel;
use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use dashmap::DashMap;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{
    CellStay, CloseRequest, HeldKey, HeldKind, KeepAliveRequest, KeepAliveResponse, ResumeRequest,
    SessionState as WireState,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};

use crate::client::UNARY_TIMEOUT;
use crate::error::Error;
use crate::proxies::Proxies;
use crate::renewals::Renewals;
use crate::shared::{Home, SessionShared};
use crate::validity::Stamp;
use lockcell_proto::suspend;

/// How long a Resume may take before the proxy counts as unreachable.
/// Largest Resume reply taken: 4,096 keys of 512-byte names, each with its reason.
const RESUME_REPLY_BYTES: usize = 16 << 20;

const RESUME_TIMEOUT: Duration = Duration::from_secs(3);

/// How many of the keys a Resume names move in the transaction that raises the
/// session's fence (the proto's `HeldKey.mod_revision`).
const KEYS_MOVED_WITH_THE_FENCE: usize = 64;
/// How often sessions are checked against the grace period.
const GRACE_SWEEP: Duration = Duration::from_millis(250);
/// After a proxy asked its clients to go and no other proxy took them, how long before
/// trying again.
const MOVE_RETRY: Duration = Duration::from_secs(1);
/// The longest wait between tries to move (or to resume here) that failed.
const MOVE_RETRY_MAX: Duration = Duration::from_secs(16);
/// Resumes in flight at once during a move.
const RESUMES_AT_ONCE: usize = 16;

/// Registrations waiting for the driver. Opening sessions is rare; a full queue only
/// makes `open_session` wait a moment.
const COMMAND_QUEUE: usize = 64;
/// Renewals queued for the stream. If the stream cannot take more, the renewals due are
/// put off by [`FULL_RETRY`] rather than piling up stale requests.
const OUTBOUND_QUEUE: usize = 256;
/// When the outbound queue is full, renewals due are tried again this much later.
const FULL_RETRY: Duration = Duration::from_millis(5);

/// A year: a fail-back period longer than this is never.
const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

/// When the stream fails to deliver, retry at this pace: quickly at first, because the
/// deadlines keep running while it is down.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// Sessions by id, for reply dispatch. A session is here while some handle to it lives
/// and it has not been closed; removing it stops its renewals.
pub(crate) type SessionTable = DashMap<String, Arc<SessionShared>>;

enum Command {
    /// Start renewing a session; its first renewal is due at `first_due`. `generation`
    /// is the client's proxy generation when it was opened: a session opened on a proxy
    /// the client has left since is resumed on the current one.
    Register {
        id: String,
        first_due: Instant,
        generation: u64,
    },
    /// The proxy the client was on at `generation` refused to open a session, or gave
    /// no answer: move the client (its sessions, if any) to another proxy unless it
    /// has moved since, and say whether it is elsewhere now.
    Move {
        generation: u64,
        moved: oneshot::Sender<bool>,
    },
}

/// The client's handle on its keep-alive driver. Dropping it (with the last
/// [`Client`](crate::Client) clone) stops the driver.
#[derive(Debug)]
pub(crate) struct KeepAlive {
    sessions: Arc<SessionTable>,
    commands: mpsc::Sender<Command>,
    task: JoinHandle<()>,
}

impl KeepAlive {
    /// Spawns the driver on the current runtime.
    pub(crate) fn start(
        proxies: Arc<Proxies>,
        grace: Duration,
        fail_back_after: Duration,
        move_stall: Duration,
    ) -> KeepAlive {
        // Longer than a year is never (and keeps `Instant` arithmetic from overflowing).
        let fail_back_after = fail_back_after.min(YEAR);
        let sessions = Arc::new(SessionTable::new());
        let (commands, rx) = mpsc::channel(COMMAND_QUEUE);
        let driver = Driver {
            sent_generation: suspend::generation(),
            proxies,
            grace,
            sessions: sessions.clone(),
            commands: rx,
            book: Renewals::default(),
            link: Link::Down {
                retry_at: Instant::now(),
            },
            backoff: backoff(),
            move_on_retry: false,
            leave: None,
            leave_again_at: Instant::now(),
            leave_backoff: MOVE_RETRY,
            adopt_again_at: Instant::now(),
            adopt_backoff: MOVE_RETRY,
            home_again_at: Instant::now() + fail_back_after,
            fail_back_after,
            move_stall,
            orphans: HashSet::new(),
        };
        let task = tokio::spawn(driver.run());
        KeepAlive {
            sessions,
            commands,
            task,
        }
    }

    /// Starts renewing `session`.
    pub(crate) async fn register(
        &self,
        session: Arc<SessionShared>,
        first_due: Instant,
        generation: u64,
    ) -> Result<(), Error> {
        let id = session.id.clone();
        self.sessions.insert(id.clone(), session);
        if self
            .commands
            .send(Command::Register {
                id: id.clone(),
                first_due,
                generation,
            })
            .await
            .is_err()
        {
            self.sessions.remove(&id);
            return Err(Error::Unavailable(
                "the client's keep-alive task has stopped".into(),
            ));
        }
        Ok(())
    }

    /// Moves the client away from the proxy it was on at `generation`, which refused to
    /// open a session ("use another proxy") or did not answer. Returns whether the
    /// client is on another proxy now.
    pub(crate) async fn move_away(&self, generation: u64) -> bool {
        let (moved, answer) = oneshot::channel();
        let command = Command::Move { generation, moved };
        if self.commands.send(command).await.is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }

    /// The sessions renewed now.
    pub(crate) fn open_sessions(&self) -> Vec<Arc<SessionShared>> {
        self.sessions.iter().map(|s| s.value().clone()).collect()
    }

    /// Stops renewing a session. Synchronous so that `Drop` can call it.
    pub(crate) fn unregister(&self, id: &str) {
        self.sessions.remove(id);
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        // The command channel closing stops the driver too; aborting also covers a
        // driver that is in the middle of a reconnect.
        self.task.abort();
    }
}

/// A status in one short line (its `Display` includes the whole source chain).
fn brief(status: &Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

fn backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(RECONNECT_MIN)
        .with_max_delay(RECONNECT_MAX)
        .with_jitter()
        .without_max_times()
        .build()
}

type OpenCall = Pin<
    Box<dyn Future<Output = Result<tonic::Response<Streaming<KeepAliveResponse>>, Status>> + Send>,
>;

/// The state of the one stream.
enum Link {
    /// No stream; try to open one at `retry_at`.
    Down { retry_at: Instant },
    /// The call is being set up. Renewals can already be queued on `tx`.
    Opening {
        tx: mpsc::Sender<KeepAliveRequest>,
        call: OpenCall,
    },
    /// Replies arrive on `inbound`.
    Up {
        tx: mpsc::Sender<KeepAliveRequest>,
        inbound: Box<Streaming<KeepAliveResponse>>,
    },
}

enum LinkEvent {
    RetryDue,
    Opened(Result<Streaming<KeepAliveResponse>, Status>),
    Reply(Result<Option<KeepAliveResponse>, Status>),
}

impl Link {
    fn tx(&self) -> Option<&mpsc::Sender<KeepAliveRequest>> {
        match self {
            Link::Down { .. } => None,
            Link::Opening { tx, .. } | Link::Up { tx, .. } => Some(tx),
        }
    }

    /// Waits for whatever the current state waits for. Cancel-safe: the call and the
    /// stream live in `self`, only the waiting is dropped.
    async fn next_event(&mut self) -> LinkEvent {
        match self {
            Link::Down { retry_at } => {
                sleep_until(*retry_at).await;
                LinkEvent::RetryDue
            }
            Link::Opening { call, .. } => {
                LinkEvent::Opened(call.as_mut().await.map(|r| r.into_inner()))
            }
            Link::Up { inbound, .. } => LinkEvent::Reply(inbound.message().await),
        }
    }
}

/// The task that owns the stream. Ends when its [`KeepAlive`] is dropped.
struct Driver {
    /// The suspend generation the renewals in flight were sent in: replies to renewals
    /// sent before a suspend of the machine grant nothing.
    sent_generation: u64,
    proxies: Arc<Proxies>,
    /// How long a session may stay in jeopardy, no proxy reached, before it expires.
    grace: Duration,
    sessions: Arc<SessionTable>,
    commands: mpsc::Receiver<Command>,
    book: Renewals,
    link: Link,
    backoff: ExponentialBackoff,
    /// The stream was lost: the next retry moves (the current proxy is tried last).
    move_on_retry: bool,
    /// The current proxy asked its clients to go, saying why: move now.
    leave: Option<String>,
    /// A proxy that asked to be left is not asked again before this.
    leave_again_at: Instant,
    /// How long to stay before asking again, after a failed try (doubles, to a cap).
    leave_backoff: Duration,
    /// Sessions the current proxy could not resume are not asked again before this.
    adopt_again_at: Instant,
    adopt_backoff: Duration,
    /// When to try going back to a more preferred proxy (see [`Driver::fail_back`]).
    home_again_at: Instant,
    fail_back_after: Duration,
    /// Test hook (zero otherwise): a wait between resuming and switching in a move.
    move_stall: Duration,
    /// Sessions the current proxy does not know (opened before a move, or a proxy that
    /// restarted on its address): resumed there.
    orphans: HashSet<String>,
}

impl Driver {
    async fn run(mut self) {
        let mut sweep = tokio::time::interval(GRACE_SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if let Some(why) = self.leave.take() {
                self.leave_proxy(&why).await;
            }
            if !self.orphans.is_empty() && matches!(self.link, Link::Up { .. }) {
                self.adopt_orphans().await;
            }
            if matches!(self.link, Link::Up { .. }) {
                self.fail_back().await;
            }
            let wakeup = self.book.next_wakeup(self.link.tx().is_some());
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Register { id, first_due, generation }) => {
                        if generation != self.proxies.generation() {
                            self.orphans.insert(id.clone());
                        }
                        self.book.schedule(&id, first_due);
                    }
                    Some(Command::Move { generation, moved }) => {
                        let elsewhere = generation != self.proxies.generation()
                            || self.relocate(true).await;
                        let _ = moved.send(elsewhere);
                    }
                    None => return, // the client is gone
                },
                event = self.link.next_event() => self.on_link_event(event).await,
                _ = sleep_until(wakeup.unwrap_or_else(Instant::now)), if wakeup.is_some() => {
                    self.on_timer();
                }
                _ = sweep.tick() => self.sweep(),
            }
        }
    }

    /// Expires every session that has been in jeopardy for longer than the grace
    /// period (no proxy could be reached to resume it), and queues every unsettled
    /// session for a resume where the client is now.
    fn sweep(&mut self) {
        self.notice_suspend();
        let now = Instant::now();
        for entry in self.sessions.iter() {
            let session = entry.value();
            if session.is_unsettled() && !session.is_expired() {
                self.orphans.insert(session.id.clone());
            }
            if !session.is_expired() && session.deadline() + self.grace <= now {
                session.expire(&format!(
                    "no proxy renewed or resumed the session within the grace period of {:?} \
                     after its deadline",
                    self.grace
                ));
            }
        }
    }

    /// After a suspend of the machine: every deadline (an `Instant`, stopped while the
    /// machine slept) is junk, and so is every renewal in flight. Each session stops
    /// acting (its state says so already) and is resumed where the client is, which
    /// tells whether the proxy still has it.
    fn notice_suspend(&mut self) {
        let generation = suspend::generation();
        if generation == self.sent_generation {
            return;
        }
        self.sent_generation = generation;
        self.book.stream_lost();
        tracing::warn!(
            "this machine was suspended: every session stops acting until it is resumed"
        );
        for entry in self.sessions.iter() {
            if !entry.value().is_expired() {
                entry.value().unsettle();
                self.orphans.insert(entry.value().id.clone());
            }
        }
    }

    /// The sessions to carry along in a move.
    fn live_sessions(&self) -> Vec<Arc<SessionShared>> {
        self.sessions
            .iter()
            .map(|e| e.value().clone())
            .filter(|s| !s.is_expired())
            .collect()
    }

    /// Moves every session to another proxy: the first, in order of preference, that
    /// resumes them all. `avoid_current`: the current proxy asked to be left, so it is
    /// not among the candidates. Returns whether the client moved.
    async fn relocate(&mut self, avoid_current: bool) -> bool {
        let candidates = self.proxies.move_order(avoid_current);
        self.relocate_to(candidates).await
    }

    /// Moves every session to the first of `candidates` that resumes them all.
    async fn relocate_to(&mut self, candidates: Vec<usize>) -> bool {
        let sessions = self.live_sessions();
        let from = self.proxies.current();
        let old = self.proxies.channel();
        let left: Vec<LeftBehind> = sessions
            .iter()
            .map(|s| {
                let home = s.home();
                LeftBehind {
                    id: s.id.clone(),
                    secret: s.secret.clone(),
                    incarnation: home.incarnation,
                    cells: home.cells,
                    held_until: s.deadline(),
                    losses: s.holdings.losses(),
                    lost: false,
                }
            })
            .collect();
        for index in candidates {
            let addr = self.proxies.addr(index).to_owned();
            let channel = match self.proxies.open(index).await {
                Ok(channel) => channel,
                Err(e) => {
                    tracing::warn!(proxy = %addr, error = %e, "cannot move there");
                    continue;
                }
            };
            let resumed = resume_all(&channel, &sessions).await;
            if let Err(status) = resumed {
                end_moves(&sessions);
                tracing::warn!(proxy = %addr, status = %brief(&status), "resume failed there");
                continue;
            }
            tracing::info!(proxy = %addr, sessions = sessions.len(), "sessions resumed");
            if !self.move_stall.is_zero() {
                tokio::time::sleep(self.move_stall).await;
            }
            // Calls read the channel after the move epoch: switched before the move
            // ends, a call sent to the old proxy always counts as sent during the move.
            self.proxies.switch(index, channel);
            end_moves(&sessions);
            self.book.stream_lost();
            self.backoff = backoff();
            self.open();
            if index != from {
                let mut left = left;
                for (stay, session) in left.iter_mut().zip(&sessions) {
                    stay.lost = session.holdings.losses() != stay.losses;
                    // A renewal from the old proxy may have landed during the move.
                    stay.held_until = stay.held_until.max(session.deadline());
                }
                close_left_behind(old, left);
            }
            self.home_again_at = Instant::now() + self.fail_back_after;
            return true;
        }
        // No candidate took them all; the client stays where it is. A session that one
        // of them did take lives there now, not here: renewals from here must not count
        // for it until it is resumed here again.
        for (session, before) in sessions.iter().zip(&left) {
            if session.home().incarnation != before.incarnation {
                session.unsettle();
            }
        }
        false
    }

    /// Away from the first proxy of the list (the client's own zone) for a while and
    /// all is well: try to go back to a more preferred one, so a zone's proxy is not
    /// left idle after a restart. Staying is fine; it is tried again later.
    async fn fail_back(&mut self) {
        let current = self.proxies.current();
        if current == 0 || Instant::now() < self.home_again_at {
            return;
        }
        if !self.relocate_to((0..current).collect()).await {
            self.home_again_at = Instant::now() + self.fail_back_after;
        }
    }

    /// The current proxy asked its clients to go: move while it still answers. If no
    /// other proxy takes the sessions, stay (it still renews them) and ask again later.
    async fn leave_proxy(&mut self, why: &str) {
        if Instant::now() < self.leave_again_at {
            return;
        }
        tracing::info!(proxy = %self.proxies.addr(self.proxies.current()), why, "moving");
        if self.relocate(true).await {
            self.leave_backoff = MOVE_RETRY;
        } else {
            // Staying, and asking again later, less often each time: when every proxy
            // struggles (etcd itself slow), moving would only add to its load.
            tracing::warn!(why, retry_in = ?self.leave_backoff, "no other proxy took the sessions; staying for now");
            self.leave_again_at = Instant::now() + self.leave_backoff;
            self.leave_backoff = (self.leave_backoff * 2).min(MOVE_RETRY_MAX);
        }
    }

    /// Resumes the sessions the current proxy said it does not know.
    async fn adopt_orphans(&mut self) {
        if Instant::now() < self.adopt_again_at {
            return;
        }
        let ids = std::mem::take(&mut self.orphans);
        let sessions: Vec<Arc<SessionShared>> = ids
            .iter()
            .filter_map(|id| self.sessions.get(id).map(|s| s.value().clone()))
            .filter(|s| !s.is_expired())
            .collect();
        let resumed = resume_all(&self.proxies.channel(), &sessions).await;
        end_moves(&sessions);
        match resumed {
            Ok(()) => self.adopt_backoff = MOVE_RETRY,
            // No answer: the proxy is gone; move.
            Err(status) if crate::session::left_behind(&status) => {
                self.orphans = ids;
                self.lost(&format!(
                    "could not resume sessions here: {}",
                    brief(&status)
                ));
            }
            // The proxy answered but could not take them now: ask again later.
            Err(status) => {
                self.orphans = ids;
                tracing::warn!(status = %brief(&status), retry_in = ?self.adopt_backoff, "could not resume sessions here; asking again later");
                self.adopt_again_at = Instant::now() + self.adopt_backoff;
                self.adopt_backoff = (self.adopt_backoff * 2).min(MOVE_RETRY_MAX);
            }
        }
    }

    async fn on_link_event(&mut self, event: LinkEvent) {
        match event {
            LinkEvent::RetryDue if std::mem::take(&mut self.move_on_retry) => {
                if !self.relocate(false).await {
                    self.lost("no proxy could take the sessions");
                }
            }
            LinkEvent::RetryDue => self.open(),
            LinkEvent::Opened(Ok(inbound)) => {
                if let Link::Opening { tx, .. } = std::mem::replace(
                    &mut self.link,
                    Link::Down {
                        retry_at: Instant::now(),
                    },
                ) {
                    tracing::debug!("keep-alive stream open");
                    self.link = Link::Up {
                        tx,
                        inbound: Box::new(inbound),
                    };
                }
            }
            LinkEvent::Opened(Err(status)) => self.lost(&format!(
                "could not open the keep-alive stream: {}",
                brief(&status)
            )),
            LinkEvent::Reply(Ok(Some(reply))) => {
                // A reply proves the stream works end to end: start backoff afresh.
                self.backoff = backoff();
                self.on_reply(reply);
            }
            LinkEvent::Reply(Ok(None)) => self.lost("the proxy ended the keep-alive stream"),
            LinkEvent::Reply(Err(status)) => {
                self.lost(&format!("keep-alive stream failed: {}", brief(&status)))
            }
        }
    }

    /// Starts opening a stream to the current proxy. Its request side is fed from a
    /// bounded channel.
    fn open(&mut self) {
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let mut client = SessionClient::new(self.proxies.channel());
        let call: OpenCall =
            Box::pin(async move { client.keep_alive(ReceiverStream::new(rx)).await });
        self.link = Link::Opening { tx, call };
    }

    /// The stream is gone: forget what was in flight and move after a backoff.
    fn lost(&mut self, why: &str) {
        self.move_on_retry = true;
        let in_flight = self.book.stream_lost();
        let delay = self.backoff.next().unwrap_or(RECONNECT_MAX);
        tracing::warn!(
            in_flight,
            retry_in = ?delay,
            "{why}; session deadlines stop moving until it is back"
        );
        self.link = Link::Down {
            retry_at: Instant::now() + delay,
        };
    }

    fn on_timer(&mut self) {
        self.notice_suspend();
        let now = Instant::now();
        if self.book.stalled(now) {
            self.lost("the proxy stopped answering renewals");
            return;
        }
        let Some(tx) = self.link.tx().cloned() else {
            return;
        };
        let mut closed = false;
        let mut full = false;
        for id in self.book.take_due(now) {
            // Gone from the table: the application dropped or closed it. Not rescheduled.
            let Some(session) = self.sessions.get(&id).map(|s| s.value().clone()) else {
                continue;
            };
            if session.is_expired() {
                continue;
            }
            if closed {
                // Sent as soon as a new stream is there.
                self.book.schedule(&id, now);
                continue;
            }
            if full {
                // Sent as soon as the stream has room, not a whole interval later: a
                // burst of renewals due at once (sessions opened together) must not
                // push most of them past their TTL.
                self.book.schedule(&id, now + FULL_RETRY);
                continue;
            }
            let interval = session.renew_interval();
            let seq = session.next_seq();
            let sent = Instant::now();
            match tx.try_send(KeepAliveRequest {
                session_id: id.clone(),
                seq,
                session_secret: session.secret.clone(),
            }) {
                Ok(()) => self.book.sent(&id, seq, sent, interval),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    tracing::debug!(session.id = %id, "keep-alive stream full; renewal put off");
                    full = true;
                    self.book.schedule(&id, now + FULL_RETRY);
                    continue;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    closed = true;
                    self.book.schedule(&id, now);
                    continue;
                }
            }
            self.book.schedule(&id, sent + interval);
        }
        if closed {
            self.lost("the keep-alive stream closed");
        }
    }

    fn on_reply(&mut self, reply: KeepAliveResponse) {
        let Some(sent) = self.book.answered(&reply.session_id, reply.seq) else {
            tracing::debug!(
                session.id = %reply.session_id,
                seq = reply.seq,
                "reply to no renewal in flight; ignored"
            );
            return;
        };
        let Some(session) = self
            .sessions
            .get(&reply.session_id)
            .map(|s| s.value().clone())
        else {
            return; // dropped or closed meanwhile
        };
        match WireState::try_from(reply.state) {
            Ok(WireState::Alive) => {
                let sent = Stamp {
                    at: sent,
                    generation: self.sent_generation,
                };
                session.grant(sent, reply.valid_for_ms);
                // A shorter grant than before calls for an earlier renewal.
                self.book
                    .schedule_no_later(&session.id, sent.at + session.renew_interval());
                if reply.move_elsewhere && self.leave.is_none() {
                    self.leave = Some(reply.reason);
                }
            }
            // Not known here (a proxy restarted on its address): resume it here.
            Ok(WireState::NotFound) => {
                tracing::info!(session.id = %session.id, "proxy does not know the session; resuming it");
                self.orphans.insert(session.id.clone());
            }
            Ok(state @ WireState::Expired) => {
                let reason = if reply.reason.is_empty() {
                    format!("the proxy answered {}", state.as_str_name())
                } else {
                    reply.reason
                };
                tracing::warn!(session.id = %session.id, %reason, "session expired");
                session.expire(&reason);
            }
            Ok(WireState::Unspecified) | Err(_) => {
                tracing::warn!(
                    session.id = %session.id,
                    state = reply.state,
                    "renewal reply with an unknown state; ignored"
                );
            }
        }
    }
}

/// Resumes `sessions` on the proxy behind `channel`, at most [`RESUMES_AT_ONCE`] at a
/// time. Fails (with the first failure) if the proxy did not answer one of them: the
/// move goes elsewhere. A session the proxy refused outright expires.
///
/// The move begins here and is ended by the caller with [`end_moves`], once calls go to
/// the proxy the sessions are on now.
async fn resume_all(channel: &Channel, sessions: &[Arc<SessionShared>]) -> Result<(), Status> {
    // From here a grant whose request went out earlier may be missing from the keys the
    // resumes name: such a grant unsettles its session (see `Session::accept_grant`).
    for session in sessions {
        session.begin_move();
    }
    resume_each(channel, sessions).await
}

/// Ends the move [`resume_all`] began.
fn end_moves(sessions: &[Arc<SessionShared>]) {
    for session in sessions {
        session.end_move();
    }
}

async fn resume_each(channel: &Channel, sessions: &[Arc<SessionShared>]) -> Result<(), Status> {
    let mut tasks = tokio::task::JoinSet::new();
    let mut pending = sessions.iter().cloned();
    let mut failed = None;
    loop {
        while tasks.len() < RESUMES_AT_ONCE && failed.is_none() {
            let Some(session) = pending.next() else { break };
            tasks.spawn(resume_one(channel.clone(), session));
        }
        match tasks.join_next().await {
            Some(Ok(Ok(()))) => {}
            Some(Ok(Err(status))) => {
                failed.get_or_insert(status);
            }
            Some(Err(join)) => {
                failed.get_or_insert(Status::internal(format!("resume task failed: {join}")));
            }
            None => break,
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Resumes one session. A proxy whose lease cannot outlive what the session may still
/// do on its old proxy's word refuses (FAILED_PRECONDITION): the move goes elsewhere, or
/// is tried again later, when less of the old deadline is left (none, in jeopardy).
///
/// A resume whose outcome is unknown (no answer, or etcd failed midway) may have moved
/// the keys all the same: the session is unsettled (stops acting, takes no renewal)
/// until a resume settles it. A proxy that finds the session's fence moved past what
/// the client knows (such a resume did land) says where to: the resume is asked again
/// from there.
async fn resume_one(channel: Channel, session: Arc<SessionShared>) -> Result<(), Status> {
    // The fences corrected so far, by cell (`None`: the session's only fence). A fence
    // is corrected again only to a higher revision (a proxy of several cells that moved
    // some cells before another refused may move them again on the next try), and the
    // corrections are bounded.
    let mut corrected: Vec<(Option<String>, i64)> = Vec::new();
    let mut corrections_left = 2 * (session.home().cells.len() + 1);
    loop {
        let sent = Stamp::now();
        let home = session.home();
        // What to name, then how long the client may act: a grant taken in after the
        // first is not named (and keeps the session unsettled, see `moved`), one taken
        // in before is covered by the second.
        let version = session.holdings.version();
        let keys = session.holdings.wire();
        // Rounded up: the proxy must cover at least the whole of it.
        let acting_for = session.acting_for(sent.at).as_millis() as u64 + 1;
        let mut request = tonic::Request::new(ResumeRequest {
            session_id: session.id.clone(),
            ttl_ms: session.ttl.as_millis() as u64,
            identity: session.identity.clone(),
            from_lease_id: home.lease,
            keys: keys.clone(),
            acting_for_ms: acting_for,
            fence_revision: home.fence,
            epoch: home.epoch,
            cells: home.cells.clone(),
            session_secret: session.secret.clone(),
        });
        request.set_timeout(RESUME_TIMEOUT);
        // A resume of many keys, all lost, answers with a reason for each: more than
        // gRPC's default 4 MiB for the largest resume the proxy takes.
        let mut sessions =
            SessionClient::new(channel.clone()).max_decoding_message_size(RESUME_REPLY_BYTES);
        let status = match sessions.resume(request).await {
            Ok(reply) => {
                let reply = reply.into_inner();
                for lost in reply.lost {
                    if let Some(key) = lost.key {
                        session.holdings.lose(&key, &lost.reason);
                    }
                }
                let home = Home {
                    proxy_id: reply.proxy_id,
                    lease: reply.lease_id,
                    incarnation: reply.incarnation,
                    fence: reply.fence_revision,
                    epoch: reply.epoch,
                    cells: reply.cells,
                };
                session.moved(home, sent, reply.valid_for_ms, &keys, &reply.moved, version);
                return Ok(());
            }
            Err(status) => status,
        };
        if let Some((fence, lease, cell)) = fenced_out(&status) {
            let again = corrected.iter().any(|(c, to)| *c == cell && *to >= fence);
            if again || corrections_left == 0 {
                return Err(status);
            }
            corrections_left -= 1;
            corrected.push((cell.clone(), fence));
            tracing::info!(session.id = %session.id, fence, "an earlier resume landed; resuming from there");
            session.unsettle();
            if let Some(cell) = cell {
                // A proxy of several cells: the fence of one cell's stay moved. Its keys
                // there moved to `lease` (that proxy moves each cell's keys from its
                // stay's lease).
                let mut cells = home.cells.clone();
                match cells.iter_mut().find(|s| s.cell == cell) {
                    Some(stay) => {
                        stay.lease_id = lease;
                        stay.fence_revision = fence;
                    }
                    None => cells.push(CellStay {
                        cell,
                        lease_id: lease,
                        fence_revision: fence,
                        ..Default::default()
                    }),
                }
                session.set_home(Home { cells, ..home });
                continue;
            }
            // The resume that landed named what was held then; those moved to `lease`.
            // The first keys it named moved in the transaction that raised the fence:
            // an ephemeral key among them that moved was written at `fence` (see the
            // proto's `HeldKey.mod_revision`). Any other is reported lost next time.
            let rewritten: Vec<HeldKey> = keys
                .iter()
                .take(KEYS_MOVED_WITH_THE_FENCE)
                .filter(|k| k.kind == HeldKind::Ephemeral as i32)
                .map(|k| HeldKey {
                    mod_revision: fence,
                    ..k.clone()
                })
                .collect();
            session.holdings.moved_to(lease, &keys, &rewritten);
            session.set_home(Home {
                lease,
                fence,
                ..home
            });
            continue;
        }
        return match status.code() {
            // Refused before anything moved: the cover rule, or a bad request.
            Code::FailedPrecondition => Err(status),
            Code::InvalidArgument | Code::NotFound | Code::Unimplemented => {
                session.expire(&format!("resume refused: {}", status.message()));
                Ok(())
            }
            _ => {
                session.unsettle();
                Err(status)
            }
        };
    }
}

/// The session fence's revision and lease a refused resume reports, if that is why,
/// and the cell whose fence it is on a proxy of several cells.
fn fenced_out(status: &Status) -> Option<(i64, i64, Option<String>)> {
    let meta = status.metadata();
    let number = |key| meta.get(key)?.to_str().ok()?.parse().ok();
    let cell = meta
        .get(FENCE_CELL)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    Some((number(FENCE_REVISION)?, number(FENCE_LEASE)?, cell))
}

/// Metadata of a resume refused for the fence of one cell's stay: which cell.
const FENCE_CELL: &str = "lockcell-fence-cell";

/// Metadata of a resume refused because the session's fence moved (see `ResumeRequest`).
const FENCE_REVISION: &str = "lockcell-fence-revision";
const FENCE_LEASE: &str = "lockcell-fence-lease";

/// A session's stay on the proxy it moved away from, to close there.
struct LeftBehind {
    id: String,
    secret: String,
    incarnation: u64,
    cells: Vec<CellStay>,
    /// The session's deadline before the move: until then its holds stood on that
    /// proxy's word, and the application may act on one the move found lost.
    held_until: Instant,
    /// [`Holdings::losses`](crate::holdings::Holdings) before the move.
    losses: u64,
    /// Whether the move reported a hold lost (a key it did not move).
    lost: bool,
}

/// Closes the moved sessions on the proxy they left, in the background: it then deletes
/// what is still on its lease (keys the client never heard of, such as a grant whose
/// reply was lost) and, draining, sees them gone. What moved is not on its lease.
///
/// A stay whose move reported a hold lost is closed only once its old deadline has
/// passed: the lost hold's key is still on that proxy's lease, the application heard
/// of the loss only now and may be acting on it until that deadline, and the close
/// would let the lock pass at once.
///
/// Each close names the stay it ends, so one that arrives late (after the client came
/// back to that proxy) closes nothing.
fn close_left_behind(channel: Channel, left: Vec<LeftBehind>) {
    tokio::spawn(async move {
        let (now, mut later): (Vec<_>, Vec<_>) = left.into_iter().partition(|s| !s.lost);
        later.sort_by_key(|s| s.held_until);
        let mut tasks = tokio::task::JoinSet::new();
        for stay in now.into_iter().chain(later) {
            if stay.lost {
                sleep_until(stay.held_until).await;
            }
            while tasks.len() >= RESUMES_AT_ONCE {
                tasks.join_next().await;
            }
            let mut request = tonic::Request::new(CloseRequest {
                session_id: stay.id.clone(),
                incarnation: stay.incarnation,
                cells: stay.cells,
                session_secret: stay.secret,
            });
            request.set_timeout(UNARY_TIMEOUT);
            let mut client = SessionClient::new(channel.clone());
            let id = stay.id;
            tasks.spawn(async move {
                if let Err(status) = client.close(request).await {
                    tracing::debug!(session.id = %id, status = %brief(&status), "not closed on the proxy left behind");
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    });
}
