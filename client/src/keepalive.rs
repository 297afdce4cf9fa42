//! The keep-alive multiplexer: one task per [`Client`](crate::Client) that renews all of
//! its sessions over ONE `Session.KeepAlive` bidi stream, pairs each reply with the
//! instant its request was sent, and moves deadlines (or expires sessions) accordingly.
//!
//! When the stream breaks it is reopened with backoff. Meanwhile no deadline moves, so
//! sessions fall into jeopardy on their own if that takes too long: the driver never has
//! to decide that a session is in danger, the clock does.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use dashmap::DashMap;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{KeepAliveRequest, KeepAliveResponse, SessionState as WireState};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

use crate::error::Error;
use crate::renewals::Renewals;
use crate::shared::SessionShared;

/// Registrations waiting for the driver. Opening sessions is rare; a full queue only
/// makes `open_session` wait a moment.
const COMMAND_QUEUE: usize = 64;
/// Renewals queued for the stream. If the stream cannot take more, a renewal is skipped
/// (its session is retried at its next interval) rather than piling up stale requests.
const OUTBOUND_QUEUE: usize = 256;
/// When the stream fails to deliver, retry at this pace: quickly at first, because the
/// deadlines keep running while it is down.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// Sessions by id, for reply dispatch. A session is here while some handle to it lives
/// and it has not been closed; removing it stops its renewals.
pub(crate) type SessionTable = DashMap<String, Arc<SessionShared>>;

enum Command {
    /// Start renewing a session; its first renewal is due at `first_due`.
    Register { id: String, first_due: Instant },
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
    pub(crate) fn start(channel: Channel) -> KeepAlive {
        let sessions = Arc::new(SessionTable::new());
        let (commands, rx) = mpsc::channel(COMMAND_QUEUE);
        let driver = Driver {
            channel,
            sessions: sessions.clone(),
            commands: rx,
            book: Renewals::default(),
            link: Link::Down {
                retry_at: Instant::now(),
            },
            backoff: backoff(),
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
    ) -> Result<(), Error> {
        let id = session.id.clone();
        self.sessions.insert(id.clone(), session);
        if self
            .commands
            .send(Command::Register {
                id: id.clone(),
                first_due,
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
    channel: Channel,
    sessions: Arc<SessionTable>,
    commands: mpsc::Receiver<Command>,
    book: Renewals,
    link: Link,
    backoff: ExponentialBackoff,
}

impl Driver {
    async fn run(mut self) {
        loop {
            let wakeup = self.book.next_wakeup(self.link.tx().is_some());
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Register { id, first_due }) => self.book.schedule(&id, first_due),
                    None => return, // the client is gone
                },
                event = self.link.next_event() => self.on_link_event(event),
                _ = sleep_until(wakeup.unwrap_or_else(Instant::now)), if wakeup.is_some() => {
                    self.on_timer();
                }
            }
        }
    }

    fn on_link_event(&mut self, event: LinkEvent) {
        match event {
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

    /// Starts opening a stream. Its request side is fed from a bounded channel.
    fn open(&mut self) {
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let mut client = SessionClient::new(self.channel.clone());
        let call: OpenCall =
            Box::pin(async move { client.keep_alive(ReceiverStream::new(rx)).await });
        self.link = Link::Opening { tx, call };
    }

    /// The stream is gone: forget what was in flight and retry after a backoff.
    fn lost(&mut self, why: &str) {
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
        let now = Instant::now();
        if self.book.stalled(now) {
            self.lost("the proxy stopped answering renewals");
            return;
        }
        let Some(tx) = self.link.tx().cloned() else {
            return;
        };
        let mut closed = false;
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
            let interval = session.renew_interval();
            let seq = session.next_seq();
            let sent = Instant::now();
            match tx.try_send(KeepAliveRequest {
                session_id: id.clone(),
                seq,
            }) {
                Ok(()) => self.book.sent(&id, seq, sent, interval),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    tracing::debug!(session.id = %id, "keep-alive stream full; renewal skipped");
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
                session.grant(sent, reply.valid_for_ms);
                // A shorter grant than before calls for an earlier renewal.
                self.book
                    .schedule_no_later(&session.id, sent + session.renew_interval());
            }
            Ok(state @ (WireState::NotFound | WireState::Expired)) => {
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
