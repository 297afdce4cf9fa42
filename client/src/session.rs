//! Sessions: what the application holds to stay a holder. A session's validity decides
//! whether the locks acquired through it may still be acted on.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::proxies::Channel;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::CloseRequest;
use tokio::time::Instant;
use tonic::Status;

use crate::client::{Client, UNARY_TIMEOUT};
use crate::error::{no_answer, Call, Error};
use crate::holdings::{Held, Holding, SessionEvents};
use crate::shared::SessionShared;
use crate::validity::{SessionState, Stamp};

/// What to ask for when opening a session.
///
/// ```
/// use std::time::Duration;
///
/// use lockcell_client::SessionOptions;
///
/// // Named for the audit trail; the default TTL of 12 s, renewed every 4 s.
/// let options = SessionOptions {
///     identity: "billing-worker-7".to_owned(),
///     ..SessionOptions::default()
/// };
/// assert_eq!(options.ttl, Duration::from_secs(12));
/// ```
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Requested TTL: how long the proxy keeps the session without hearing a renewal.
    /// The proxy clamps it to its bounds (by default 1 s to 120 s; a lock class may set
    /// others); [`Session::ttl`] says what was granted, and the SDK logs a warning when
    /// that is not what was asked.
    pub ttl: Duration,
    /// Who this client is, recorded with every grant so an operator can tell which
    /// process held a lock.
    pub identity: String,
}

impl Default for SessionOptions {
    /// A 12 s TTL (renewed every 4 s) and `"<hostname>/<pid>"` as identity.
    fn default() -> Self {
        SessionOptions {
            ttl: Duration::from_secs(12),
            identity: default_identity(),
        }
    }
}

/// `"<hostname-or-unknown>/<pid>"`: enough to find the process in an incident.
fn default_identity() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_owned());
    format!("{host}/{}", std::process::id())
}

/// Whether a failed call got no answer from its proxy ([`no_answer`]) or the proxy does
/// not know the session: the proxy is gone, or the session has left it.
pub(crate) fn left_behind(status: &Status) -> bool {
    status.code() == tonic::Code::NotFound || no_answer(status)
}

/// A call that may grant, failed.
#[derive(Debug)]
pub(crate) struct CallFailed {
    pub(crate) error: Error,
    /// Its proxy is gone, or the session has left it: worth asking again once the
    /// session has moved.
    pub(crate) left_behind: bool,
}

impl CallFailed {
    fn final_(error: Error) -> Self {
        CallFailed {
            error,
            left_behind: false,
        }
    }
}

/// How long a call that failed on a proxy waits, at most, for the session to move
/// before it gives the error back.
const MOVE_PATIENCE: Duration = Duration::from_secs(10);

/// When and where a call that may grant was sent: the instant its `valid_for` counts
/// from, the session's move epoch, and the lease its keys were on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sent {
    pub(crate) at: Stamp,
    epoch: u64,
    lease: i64,
}

/// An open session. Cheap to clone: all clones (and the [`LockGuard`](crate::LockGuard)s
/// acquired through them) are the same session.
///
/// While any of them lives, the client renews the session. When the last one is dropped
/// the renewals stop and the session is closed in the background, releasing its locks.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::{SessionOptions, Wait};
///
/// let session = client.open_session(SessionOptions::default()).await?;
/// // One session for the whole worker: each task gets a clone of it.
/// for shard in 0..4 {
///     let session = session.clone();
///     tokio::spawn(async move {
///         let lock = format!("jobs/reindex/{shard}");
///         if let Ok(Some(guard)) = session.acquire(&lock, Wait::Try).await {
///             reindex_shard(shard, guard.token()).await;
///         }
///     });
/// }
/// # Ok(()) }
/// # async fn reindex_shard(_shard: u32, _token: lockcell_client::FencingToken) {}
/// ```
#[derive(Clone, Debug)]
pub struct Session {
    inner: Arc<SessionInner>,
}

#[derive(Debug)]
struct SessionInner {
    client: Client,
    shared: Arc<SessionShared>,
    /// Set by [`Session::close`], so that dropping the last handle afterwards does not
    /// close it a second time.
    closed: AtomicBool,
}

impl Session {
    pub(crate) fn new(client: Client, shared: Arc<SessionShared>) -> Session {
        Session {
            inner: Arc::new(SessionInner {
                client,
                shared,
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// The session id the proxy assigned. It is public (Leader shows it): on its own it
    /// lets no one act for the session.
    ///
    /// ```no_run
    /// # async fn example(
    /// #     client: lockcell_client::Client,
    /// #     session: lockcell_client::Session,
    /// # ) -> Result<(), lockcell_client::Error> {
    /// // Whether this process is the one that leads the reports.
    /// let leader = client.leader("reports/leader").await?;
    /// let leading = leader.is_some_and(|leader| leader.session_id == session.id());
    /// # Ok(()) }
    /// ```
    pub fn id(&self) -> &str {
        &self.inner.shared.id
    }

    /// The session's secret: what proves to any proxy that a call on the session is
    /// this client's. The SDK sends it with every call; a program needs it only to
    /// speak the wire protocol itself. Never log it, and hand it only to a process you
    /// would hand this client's own credentials to.
    ///
    /// ```no_run
    /// # fn example(session: lockcell_client::Session) -> std::io::Result<()> {
    /// use std::process::Command;
    ///
    /// // A report uploader that speaks the wire protocol itself, on this session: the
    /// // secret goes in its environment, never on its command line (which anyone sees).
    /// let uploader = Command::new("/usr/local/bin/report-uploader")
    ///     .env("REPORTS_SESSION_ID", session.id())
    ///     .env("REPORTS_SESSION_SECRET", session.secret())
    ///     .spawn()?;
    /// # Ok(()) }
    /// ```
    pub fn secret(&self) -> &str {
        &self.inner.shared.secret
    }

    /// The TTL the proxy granted (not necessarily the one requested).
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use std::time::Duration;
    ///
    /// use lockcell_client::SessionOptions;
    ///
    /// let asked = Duration::from_secs(300);
    /// let options = SessionOptions {
    ///     ttl: asked,
    ///     ..SessionOptions::default()
    /// };
    /// let session = client.open_session(options).await?;
    /// if session.ttl() != asked {
    ///     eprintln!("the proxy granted a TTL of {:?}", session.ttl()); // 120 s by default
    /// }
    /// # Ok(()) }
    /// ```
    pub fn ttl(&self) -> Duration {
        self.inner.shared.ttl
    }

    /// The id of the proxy holding the session now (it changes when the session moves).
    ///
    /// ```no_run
    /// # fn example(session: lockcell_client::Session) {
    /// // For the billing worker's logs: which proxy serves it now.
    /// eprintln!("session {} on proxy {}", session.id(), session.proxy_id());
    /// # }
    /// ```
    pub fn proxy_id(&self) -> String {
        self.inner.shared.home().proxy_id
    }

    /// What happens to the session from now on: jeopardy, safe again, moved to another
    /// proxy, a hold lost, expired (the last). A lock's own fate is also on its guard
    /// ([`LockGuard::lost`](crate::LockGuard::lost)).
    ///
    /// ```no_run
    /// # fn example(session: lockcell_client::Session) {
    /// use lockcell_client::SessionEvent;
    ///
    /// let mut events = session.events();
    /// tokio::spawn(async move {
    ///     while let Some(event) = events.next().await {
    ///         match event {
    ///             SessionEvent::Moved { proxy_id } => eprintln!("session moved to {proxy_id}"),
    ///             SessionEvent::Expired { reason } => eprintln!("session over: {reason}"),
    ///             other => eprintln!("session: {other:?}"),
    ///         }
    ///     }
    /// });
    /// # }
    /// ```
    pub fn events(&self) -> SessionEvents {
        self.inner.shared.events()
    }

    /// Until when (exclusive) the application may act on what this session holds.
    /// Renewals move it forward. Two things move it back: a grant from a proxy the
    /// session is leaving counts for nothing until the move settles (the deadline is
    /// then now), and after the machine slept every earlier grant counts for nothing
    /// ([`state`](Session::state) says `Jeopardy` even while the deadline is ahead).
    /// Check [`state`](Session::state), or race the work against a guard's `revoked()`.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) {
    /// use std::time::Duration;
    ///
    /// use lockcell_client::SessionState;
    /// use tokio::time::Instant;
    ///
    /// // Start the next billing run only if it can end well before the deadline.
    /// let run = Duration::from_secs(3);
    /// let time_left = session.deadline().saturating_duration_since(Instant::now());
    /// if session.state() == SessionState::Valid && time_left > run {
    ///     run_billing().await;
    /// }
    /// # }
    /// # async fn run_billing() {}
    /// ```
    pub fn deadline(&self) -> Instant {
        self.inner.shared.deadline()
    }

    /// Where the session stands right now.
    ///
    /// ```no_run
    /// use lockcell_client::{Session, SessionState};
    ///
    /// // The health check of a billing worker: it takes jobs only while its session is
    /// // valid (in jeopardy, its locks may pass on at any moment).
    /// fn ready(session: &Session) -> bool {
    ///     session.state() == SessionState::Valid
    /// }
    /// ```
    pub fn state(&self) -> SessionState {
        self.inner.shared.state()
    }

    /// Why the session expired, once it has.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) {
    /// if session.valid().await.is_err() {
    ///     let reason = session.expired_reason().unwrap_or_default();
    ///     eprintln!("session {} is over: {reason}", session.id());
    /// }
    /// # }
    /// ```
    pub fn expired_reason(&self) -> Option<String> {
        self.inner.shared.expired_reason()
    }

    /// Resolves as soon as the session is past its deadline or expired: from then on the
    /// proxy may give its locks to someone else, so the application must stop acting as
    /// holder. Race the work done under a lock against this.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Wait;
    ///
    /// if let Some(guard) = session.acquire("billing/nightly", Wait::Try).await? {
    ///     tokio::select! {
    ///         _ = run_nightly_billing(guard.token()) => {}
    ///         _ = session.jeopardy() => eprintln!("stopped: the lock may pass on at any moment"),
    ///     }
    /// }
    /// # Ok(()) }
    /// # async fn run_nightly_billing(_token: lockcell_client::FencingToken) {}
    /// ```
    pub async fn jeopardy(&self) {
        self.inner.shared.jeopardy().await
    }

    /// Resolves once the session is valid: at once if it is, or when a renewal or a move
    /// brings it back from jeopardy with everything still held (each hold's own
    /// `is_valid` says whether it survived). Fails if the session expires instead.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// loop {
    ///     // Waits out a jeopardy (a proxy restarting, say); fails once the session expired.
    ///     session.valid().await?;
    ///     tokio::select! {
    ///         _ = publish_rates() => break,
    ///         _ = session.jeopardy() => eprintln!("paused: no word from a proxy in time"),
    ///     }
    /// }
    /// # Ok(()) }
    /// # async fn publish_rates() {}
    /// ```
    pub async fn valid(&self) -> Result<(), Error> {
        if self.inner.shared.valid().await {
            Ok(())
        } else {
            Err(self.expired_error())
        }
    }

    /// Stops renewals and closes the session, releasing everything it holds. Returns
    /// how many of its keys the close deleted (holds, ephemeral keys, and its fence once
    /// it has moved between proxies).
    ///
    /// A session is one however many clones of it there are: closing through any of
    /// them closes it for all. It counts as expired from the moment the Close is sent
    /// (the proxy may hand its locks on at once), for every clone and guard still
    /// around, whose calls then fail with [`Error::SessionExpired`].
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::SessionOptions;
    ///
    /// let session = client.open_session(SessionOptions::default()).await?;
    /// session.announce("web", "host-7", b"10.0.3.7:8080").await?;
    /// serve_until_told_to_stop().await;
    /// // Out of the group, and every lock released, at once rather than a TTL later.
    /// let deleted = session.close().await?;
    /// println!("session closed, {deleted} keys deleted");
    /// # Ok(()) }
    /// # async fn serve_until_told_to_stop() {}
    /// ```
    pub async fn close(&self) -> Result<u32, Error> {
        let inner = &self.inner;
        inner.closed.store(true, Ordering::Relaxed);
        inner.client.keepalive().unregister(&inner.shared.id);
        inner.shared.expire("closed by the application");
        close(inner.client.channel(), &inner.shared)
            .await
            .map_err(|status| Error::from_status(status, Call::Session(self.id())))
    }

    pub(crate) fn client(&self) -> &Client {
        &self.inner.client
    }

    pub(crate) fn shared(&self) -> &Arc<SessionShared> {
        &self.inner.shared
    }

    /// Makes a call that may grant something (Acquire, Campaign, an ephemeral Put) and
    /// returns its reply with when and where the request was sent (see [`Sent`]).
    ///
    /// Refused locally once the session has expired, and abandoned if it expires while
    /// the call waits: the proxy would refuse the grant anyway. A refusal from a proxy
    /// the session started leaving meanwhile does not end the session (it lives on
    /// elsewhere): it is an [`Error::Unavailable`], to ask again.
    pub(crate) async fn grant_request<T, F>(
        &self,
        call: impl FnOnce(Channel) -> F,
    ) -> Result<(T, Sent), Error>
    where
        F: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.grant_call(call).await.map_err(|failed| failed.error)
    }

    /// Sends a call that may grant (an Acquire, a Campaign), made by `call` for what is
    /// left of `wait`, and asks again on the session's new proxy whenever the one asked
    /// went away mid-call ([`left_behind`]) and the session has moved, until `wait` is
    /// over. `call` must send the same call id every time: a retry then gets the call's
    /// grant back, and a fair waiter keeps its place in line. `name` is for logs.
    pub(crate) async fn grant_moving<T, F>(
        &self,
        name: &str,
        wait: crate::Wait,
        mut call: impl FnMut(crate::Wait, Channel) -> F,
    ) -> Result<(T, Sent), Error>
    where
        F: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        loop {
            let left = wait.remaining(started.elapsed());
            let generation = self.client().proxies().generation();
            match self.grant_call(|channel| call(left, channel)).await {
                Err(failed)
                    if failed.left_behind
                        && self.moved_since(generation).await
                        && !wait.is_over(started.elapsed()) =>
                {
                    tracing::debug!(name, error = %failed.error, "asked again on the session's new proxy");
                }
                Err(failed) => return Err(failed.error),
                Ok(granted) => return Ok(granted),
            }
        }
    }

    /// As [`grant_request`](Session::grant_request), saying also whether the call
    /// failed because its proxy is gone or the session has left it (worth asking again
    /// once the session has moved).
    ///
    /// `call` is given the channel to send on, read only after the move epoch: a move
    /// switches the channel before it ends, so a request that went to the proxy the
    /// session was leaving always carries an epoch from before the move's end, and its
    /// grant is never taken as settled (see [`accept_grant`](Session::accept_grant)).
    pub(crate) async fn grant_call<T, F>(
        &self,
        call: impl FnOnce(Channel) -> F,
    ) -> Result<(T, Sent), CallFailed>
    where
        F: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let shared = self.shared();
        if shared.is_expired() {
            return Err(CallFailed::final_(self.expired_error()));
        }
        // Taken before the channel is read and the call first polled (which is when
        // the request goes out).
        let sent = Sent {
            at: Stamp::now(),
            epoch: shared.move_epoch(),
            lease: shared.home().lease,
        };
        let call = call(self.client().channel());
        tokio::select! {
            reply = call => match reply {
                Ok(reply) => Ok((reply.into_inner(), sent)),
                Err(status) if shared.moved_since_epoch(sent.epoch) => {
                    // What the proxy left behind said, for the message only: the session
                    // lives on where it went.
                    let cause = Error::from_status(status, Call::Unbound).into_reason();
                    Err(CallFailed {
                        error: Error::Unavailable(format!(
                            "{cause}; the session moved meanwhile (to another proxy, or \
                             resumed on this one): ask again"
                        )),
                        left_behind: true,
                    })
                }
                Err(status) => Err(CallFailed {
                    left_behind: left_behind(&status),
                    error: self.call_failed(status),
                }),
            },
            _ = shared.expired() => Err(CallFailed::final_(self.expired_error())),
        }
    }

    /// Resolves, with the reason, once `holding` is lost: the session expired, or a
    /// resume found the hold gone.
    pub(crate) async fn hold_lost(&self, holding: &Holding) -> String {
        let shared = self.shared();
        tokio::select! {
            _ = shared.expired() => shared.expired_reason().unwrap_or_default(),
            reason = holding.lost() => reason.to_string(),
        }
    }

    /// Takes in what a call sent at `sent` granted: registers the hold, and applies the
    /// grant's validity, unless the session started moving after the request went out.
    /// Then the grant may have been made by the proxy it was leaving, on that proxy's
    /// lease, after the move read what to move: the session stops acting until a resume
    /// has moved the new key too (or found it lost).
    pub(crate) fn accept_grant(
        &self,
        sent: &Sent,
        valid_for_ms: Option<u64>,
        held: Held,
    ) -> Arc<Holding> {
        let shared = self.shared();
        // Registered first: a move that starts after this includes it.
        let holding = shared.holdings.add(held, sent.lease);
        if !shared.moved_since_epoch(sent.epoch) {
            if let Some(valid_for_ms) = valid_for_ms {
                shared.grant(sent.at, valid_for_ms);
            }
        } else {
            tracing::info!(session.id = %self.id(), "granted by the proxy the session was leaving; resuming it again");
            shared.unsettle();
        }
        holding
    }

    /// Whether the client moves to another proxy (after `generation`) within a TTL, with
    /// the session still alive: a call that failed because its proxy went away can then
    /// be asked again.
    ///
    /// It waits for the move to end, too: a call sent while the move still runs may get
    /// a grant that does not count until the session is resumed again (see
    /// [`accept_grant`](Session::accept_grant)).
    pub(crate) async fn moved_since(&self, generation: u64) -> bool {
        let proxies = self.client().proxies();
        let patience = self.ttl().min(MOVE_PATIENCE);
        if !proxies.switched_since(generation, patience).await {
            return false;
        }
        self.lives_after_move().await
    }

    /// Waits (a while) for the move under way to end; whether the session lives on.
    async fn lives_after_move(&self) -> bool {
        let patience = self.ttl().min(MOVE_PATIENCE);
        let _ = tokio::time::timeout(patience, self.shared().move_over()).await;
        !self.shared().is_expired()
    }

    /// Whether a call sent when the client's proxy generation was `generation` failed
    /// because the session has left that proxy, so that it is to be asked again where
    /// the session is now: no answer, or the proxy does not know the session (then a
    /// move is waited for); or the proxy says the session is gone while the client has
    /// already moved away from it (a proxy that was stopped, and woke after its lease
    /// ran out, says its sessions expired: they live on elsewhere).
    pub(crate) async fn left(&self, status: &Status, generation: u64) -> bool {
        if left_behind(status) {
            return self.moved_since(generation).await;
        }
        self.answered_by_a_left_proxy(status, generation) && self.lives_after_move().await
    }

    /// Whether `status` says the session is gone, from a proxy the client had already
    /// switched away from when it answered (`generation` is when the call was sent).
    fn answered_by_a_left_proxy(&self, status: &Status, generation: u64) -> bool {
        matches!(
            status.code(),
            tonic::Code::NotFound | tonic::Code::FailedPrecondition
        ) && crate::error::names_a_gone_session(status.message())
            && self.client().proxies().generation() != generation
    }

    /// Turns a failed request's status (Acquire, Campaign) into an [`Error`]; when the
    /// proxy says the session is gone, the local session expires too, so every handle
    /// and guard learns of it.
    pub(crate) fn call_failed(&self, status: Status) -> Error {
        self.failed(status, Call::Session(self.id()))
    }

    /// As [`call_failed`](Session::call_failed), for a call about a grant the session
    /// holds (Release, Proclaim, Resign): a stale grant is [`Error::NotHolder`] and
    /// leaves the session as it is.
    ///
    /// A proxy the client had left when it answered (the call was sent at
    /// `generation`) saying the session is gone does not end it: [`Error::Unavailable`].
    pub(crate) fn grant_call_failed(&self, status: Status, generation: u64) -> Error {
        if self.answered_by_a_left_proxy(&status, generation) {
            return Error::Unavailable(format!(
                "{}; said by a proxy the session has left (it lives on where it went): ask again",
                status.message()
            ));
        }
        self.failed(status, Call::Grant(self.id()))
    }

    fn failed(&self, status: Status, call: Call<'_>) -> Error {
        let message = status.message().to_owned();
        if status.code() == tonic::Code::NotFound && !self.shared().is_expired() {
            // The proxy asked does not know the session: the session has moved on (the
            // call went to the proxy it left), or that proxy restarted. Not an expiry:
            // the keep-alive driver resumes the session where the client is now.
            return Error::Unavailable(format!(
                "{message}; the session is moving to another proxy, try again"
            ));
        }
        let error = Error::from_status(status, call);
        if matches!(error, Error::SessionExpired { .. }) {
            self.inner.shared.expire(&message);
        }
        error
    }

    /// The error for a call refused locally because the session has already expired.
    pub(crate) fn expired_error(&self) -> Error {
        Error::SessionExpired {
            session: self.id().to_owned(),
        }
    }
}

impl Drop for SessionInner {
    /// The last handle is gone: stop renewing (nothing could act on the session any
    /// more) and close it in the background, so its locks are released now rather than
    /// when the TTL runs out.
    fn drop(&mut self) {
        let keepalive = self.client.keepalive();
        keepalive.unregister(&self.shared.id);
        if self.closed.load(Ordering::Relaxed) || self.shared.is_expired() {
            return;
        }
        self.shared.expire("dropped by the application");
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send from; the proxy expires the session after its TTL.
            return;
        };
        let channel = self.client.channel();
        let shared = self.shared.clone();
        // Owned by its own bound: it ends when the call answers or times out.
        self.client.spawn_background(&runtime, async move {
            match close(channel, &shared).await {
                Ok(released) => {
                    tracing::debug!(session.id = %shared.id, released, "dropped session closed");
                }
                Err(status) => {
                    tracing::debug!(session.id = %shared.id, %status, "dropped session not closed");
                }
            }
        });
    }
}

/// Closes `session` on the proxy at `channel` (whichever stay it has there); how many of
/// its keys the close deleted.
pub(crate) async fn close(channel: Channel, session: &SessionShared) -> Result<u32, Status> {
    let mut request = tonic::Request::new(CloseRequest {
        session_id: session.id.clone(),
        incarnation: 0,
        cells: Vec::new(),
        session_secret: session.secret.clone(),
    });
    request.set_timeout(UNARY_TIMEOUT);
    let reply = SessionClient::new(channel).close(request).await?;
    Ok(reply.into_inner().released)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_options() {
        let opts = SessionOptions::default();
        assert_eq!(opts.ttl, Duration::from_secs(12));
        let (host, pid) = opts.identity.rsplit_once('/').expect("host/pid");
        assert!(!host.is_empty());
        assert_eq!(pid, std::process::id().to_string());
    }
}
