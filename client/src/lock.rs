//! Locks: acquiring one (exclusive or shared) through a session, the guard that holds
//! it, and the sequencer check for resources that cannot keep the highest token.

use std::time::Duration;

use lockcell_proto::v1::lock_client::LockClient;
use lockcell_proto::v1::{
    AcquireRequest, AcquireResponse, CheckSequencerRequest, DescribeRequest, LockMode,
    ReleaseRequest,
};
use lockcell_proto::FencingToken;
use tracing::Instrument as _;

use std::sync::Arc;

use crate::client::{Client, UNARY_TIMEOUT};
use crate::error::{Call, Error};
use crate::holdings::{Held, Holding};
use crate::revoked::Revoked;
use crate::session::{Sent, Session};
use crate::validity::SessionState;
use crate::withdraw::{Asked, Withdraw};
use tokio_util::sync::CancellationToken;

/// Extra time the gRPC deadline of a waiting Acquire gets beyond the wait itself, so the
/// proxy's "not granted" answer arrives before the call is cut off.
const ACQUIRE_SLACK: Duration = Duration::from_secs(5);

/// The longest wait an acquire or campaign asks for: a longer `Wait::Timeout` is this
/// (a deadline gRPC can say).
const LONGEST_WAIT: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// How long an Acquire may wait while another session holds the lock.
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
/// use std::time::Duration;
///
/// use lockcell_client::Wait;
///
/// // Queue for up to a minute behind the worker running the nightly billing.
/// let wait = Wait::Timeout(Duration::from_secs(60));
/// match session.acquire("billing/nightly", wait).await? {
///     Some(guard) => run_nightly_billing(guard.token()).await,
///     None => eprintln!("billing/nightly still held after a minute"),
/// }
/// # Ok(()) }
/// # async fn run_nightly_billing(_token: lockcell_client::FencingToken) {}
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Try once; do not wait.
    Try,
    /// Wait up to this long.
    Timeout(Duration),
    /// Wait until granted, or until the session ends (an error). Rarely a proxy ends
    /// such a wait without a grant (one it had to take back at once), which reads as
    /// `Ok(None)` like a wait that ran out: handle `None` here too, by asking again.
    Forever,
}

impl Wait {
    /// The wire's `wait_timeout_ms`: absent means forever, 0 means try once.
    pub(crate) fn wait_timeout_ms(self) -> Option<u64> {
        match self {
            Wait::Try => Some(0),
            Wait::Timeout(d) => {
                Some(u64::try_from(d.min(LONGEST_WAIT).as_millis()).unwrap_or(u64::MAX))
            }
            Wait::Forever => None,
        }
    }

    /// What is left of the wait after `elapsed` of it.
    pub(crate) fn remaining(self, elapsed: Duration) -> Wait {
        match self {
            Wait::Timeout(d) => Wait::Timeout(d.saturating_sub(elapsed)),
            other => other,
        }
    }

    /// Whether a wait of this kind is over after `elapsed` (never for try-once, whose one
    /// try may be repeated after a move).
    pub(crate) fn is_over(self, elapsed: Duration) -> bool {
        matches!(self, Wait::Timeout(d) if elapsed >= d)
    }

    /// The gRPC deadline for the call: the wait plus slack, none when waiting forever.
    pub(crate) fn call_timeout(self) -> Option<Duration> {
        match self {
            Wait::Try => Some(ACQUIRE_SLACK),
            // gRPC cannot say a deadline of thousands of years: ten years is forever.
            Wait::Timeout(d) => Some(d.min(LONGEST_WAIT).saturating_add(ACQUIRE_SLACK)),
            Wait::Forever => None,
        }
    }
}

/// A fresh id for one acquire or campaign (it need only be unique within a session),
/// sent on every retry of that call.
pub(crate) fn call_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    format!("{:016x}", h.finish())
}

impl Session {
    /// Before an acquire or campaign of `lock`: refused while the session holds it (a
    /// lock is not re-entrant), and held back until the releases of dropped guards of
    /// it are done, so the proxy never sees the new call while the old hold stands.
    pub(crate) async fn before_grant_of(&self, lock: &str) -> Result<(), Error> {
        let holdings = &self.shared().holdings;
        holdings.released(lock).await;
        match holdings.holding_of(lock) {
            Some(held) => Err(Error::AlreadyHeld(format!(
                "session {} already holds {lock:?} ({}); a lock is not re-entrant: release \
                 that guard (or drop it) before acquiring or campaigning again",
                self.id(),
                held.describe()
            ))),
            None => Ok(()),
        }
    }
}

/// How a lock is held.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::Mode;
///
/// let state = client.describe("billing/prices").await?;
/// let readers = state
///     .holders
///     .iter()
///     .filter(|h| h.mode == Mode::Shared)
///     .count();
/// println!("{readers} readers of the price list");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// One holder at a time: the holder may change what the lock protects.
    Exclusive,
    /// Any number of holders at once, and none while an exclusive holder has the lock:
    /// enough to read what the lock protects without it changing underneath.
    Shared,
}

impl Mode {
    /// The wire's `LockMode`.
    pub(crate) fn wire(self) -> LockMode {
        match self {
            Mode::Exclusive => LockMode::Exclusive,
            Mode::Shared => LockMode::Shared,
        }
    }
}

impl Session {
    /// Acquires `lock` exclusively, waiting as `wait` says while another session holds
    /// it. `Ok(None)`: not granted (tried once, or the wait ran out).
    ///
    /// The grant is valid only while the session is: check [`LockGuard::is_valid`] or
    /// race the work against [`Session::jeopardy`], and pass [`LockGuard::token`] to
    /// every resource touched, so a stale holder is refused.
    ///
    /// A lock is not re-entrant: while the session holds `lock` (a guard of it is
    /// alive, in either mode), acquiring it again fails with [`Error::AlreadyHeld`].
    /// A guard dropped just before is no obstacle: its release is sent in the
    /// background, and this acquire waits for it first.
    ///
    /// Cancel-safe: if this future is dropped before it answers (a timeout around it,
    /// a `select!`), the call is withdrawn in the background. A grant the proxy made as
    /// the caller gave up is released, and the session's next acquire of `lock` waits
    /// for that. Without a tokio runtime to send from, such a grant is released when
    /// the session ends.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Wait;
    ///
    /// // Wait as long as it takes, unless the service is told to stop (the call is
    /// // withdrawn then).
    /// let acquired = tokio::select! {
    ///     acquired = session.acquire("billing/invoices", Wait::Forever) => acquired?,
    ///     _ = tokio::signal::ctrl_c() => return Ok(()),
    /// };
    /// if let Some(guard) = acquired {
    ///     tokio::select! {
    ///         _ = send_invoices(guard.token()) => {}
    ///         revoked = guard.revoked() => eprintln!("stopped sending invoices: {revoked}"),
    ///     }
    /// }
    /// # Ok(()) }
    /// # async fn send_invoices(_token: lockcell_client::FencingToken) {}
    /// ```
    pub async fn acquire(&self, lock: &str, wait: Wait) -> Result<Option<LockGuard>, Error> {
        self.acquire_mode(lock, Mode::Exclusive, wait).await
    }

    /// Acquires `lock` shared, waiting as `wait` says while an exclusive holder has it.
    /// Otherwise as [`acquire`](Session::acquire); the lock's class must allow shared
    /// holders.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use std::time::Duration;
    ///
    /// use lockcell_client::Wait;
    ///
    /// // Readers of the price list hold it together; whoever changes it waits for them.
    /// let wait = Wait::Timeout(Duration::from_secs(5));
    /// if let Some(guard) = session.acquire_shared("billing/prices", wait).await? {
    ///     let prices = load_prices().await;
    ///     guard.release().await?;
    /// }
    /// # Ok(()) }
    /// # async fn load_prices() {}
    /// ```
    pub async fn acquire_shared(&self, lock: &str, wait: Wait) -> Result<Option<LockGuard>, Error> {
        self.acquire_mode(lock, Mode::Shared, wait).await
    }

    async fn acquire_mode(
        &self,
        lock: &str,
        mode: Mode,
        wait: Wait,
    ) -> Result<Option<LockGuard>, Error> {
        self.before_grant_of(lock).await?;
        let call_id = call_id();
        // Dropped before the answer (a timeout, a `select!`), the call is withdrawn.
        let withdraw = Withdraw::arm(self, lock, Asked::Lock(mode), &call_id);
        let asked = ask_acquire(self, lock, mode, &call_id, wait).await;
        withdraw.disarm();
        let (reply, sent) = asked?;
        if !reply.granted {
            return Ok(None);
        }
        let token = reply
            .token
            .ok_or_else(|| {
                Error::Protocol(format!("lock {lock:?} granted without a fencing token"))
            })?
            .into();
        tracing::debug!(session.id = %self.id(), lock.name = lock, ?mode, %token, "lock granted");
        let held = match mode {
            Mode::Exclusive => Held::Exclusive {
                lock: lock.to_owned(),
                token,
            },
            Mode::Shared => Held::Shared {
                lock: lock.to_owned(),
                token,
            },
        };
        Ok(Some(LockGuard {
            holding: self.accept_grant(&sent, Some(reply.valid_for_ms), held),
            session: self.clone(),
            lock: lock.to_owned(),
            mode,
            token,
            released: false,
            ended: CancellationToken::new(),
        }))
    }
}

/// A held lock. Keeps its session alive (renewed) while it lives.
///
/// Dropping it without [`release`](LockGuard::release) releases it in the background
/// (when a tokio runtime is around); releasing explicitly tells whether it worked.
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::Wait;
///
/// if let Some(guard) = session.acquire("billing/invoices", Wait::Try).await? {
///     send_invoices(guard.token()).await;
/// } // the guard is dropped here: released in the background
/// # Ok(()) }
/// # async fn send_invoices(_token: lockcell_client::FencingToken) {}
/// ```
#[derive(Debug)]
#[must_use = "dropping a LockGuard releases the lock"]
pub struct LockGuard {
    session: Session,
    /// Registered with the session, so a resume moves the lock and reports it lost.
    holding: Arc<Holding>,
    lock: String,
    /// Sent with the release: the proxy keeps shared and exclusive holders apart.
    mode: Mode,
    token: FencingToken,
    /// Set once released, so `Drop` does not release again.
    released: bool,
    /// Cancelled when the hold is let go: ends the tokens of [`cancellation`](Self::cancellation).
    ended: CancellationToken,
}

impl LockGuard {
    /// The lock's name.
    ///
    /// ```no_run
    /// fn log_hold(guard: &lockcell_client::LockGuard) {
    ///     eprintln!("holding {} with token {}", guard.lock(), guard.token());
    /// }
    /// ```
    pub fn lock(&self) -> &str {
        &self.lock
    }

    /// Whether the lock is held exclusively or shared.
    ///
    /// ```no_run
    /// use lockcell_client::{LockGuard, Mode};
    ///
    /// // Only an exclusive holder may change the price list; shared holders read it.
    /// fn may_change_prices(guard: &LockGuard) -> bool {
    ///     guard.mode() == Mode::Exclusive && guard.is_valid()
    /// }
    /// ```
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The grant's fencing token: hand it to every resource acted on under the lock.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Wait;
    ///
    /// if let Some(guard) = session.acquire("reports/nightly", Wait::Try).await? {
    ///     // The store refuses any token older than the highest it has seen.
    ///     if let Err(refused) = write_report(guard.token(), "nightly").await {
    ///         eprintln!("the store refused a stale token: {refused}");
    ///     }
    /// }
    /// # Ok(()) }
    /// # async fn write_report(_: lockcell_client::FencingToken, _: &str) -> Result<(), String> {
    /// #     Ok(())
    /// # }
    /// ```
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The session this lock was acquired through.
    ///
    /// ```no_run
    /// fn describe_hold(guard: &lockcell_client::LockGuard) -> String {
    ///     let session = guard.session();
    ///     format!(
    ///         "{} held by session {} on proxy {}",
    ///         guard.lock(),
    ///         session.id(),
    ///         session.proxy_id()
    ///     )
    /// }
    /// ```
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Whether the application may still act as holder: its session is before its
    /// deadline and not expired, and the lock was not lost when the session moved.
    ///
    /// ```no_run
    /// # async fn example(guard: lockcell_client::LockGuard, invoices: Vec<String>) {
    /// for invoice in invoices {
    ///     if !guard.is_valid() {
    ///         break; // another worker may hold the lock by now
    ///     }
    ///     send_invoice(guard.token(), &invoice).await;
    /// }
    /// # }
    /// # async fn send_invoice(_token: lockcell_client::FencingToken, _invoice: &str) {}
    /// ```
    pub fn is_valid(&self) -> bool {
        self.session.state() == SessionState::Valid && !self.holding.is_lost()
    }

    /// Resolves, with the reason, once the lock is lost for good: the session expired,
    /// or the lock was found gone when the session moved to another proxy. (Jeopardy
    /// comes earlier and may pass: race work against [`Session::jeopardy`] too.)
    ///
    /// ```no_run
    /// # async fn example(guard: lockcell_client::LockGuard) {
    /// let reason = guard.lost().await;
    /// eprintln!("{} is gone for good: {reason}", guard.lock());
    /// # }
    /// ```
    pub async fn lost(&self) -> String {
        self.session.hold_lost(&self.holding).await
    }

    /// Resolves as soon as the lock may no longer be acted on: the session fell into
    /// jeopardy ([`Revoked::Jeopardy`], which may pass: see [`Session::valid`]) or the
    /// lock is gone for good ([`Revoked::Lost`], with why). At once if that is so now.
    /// Race the work done as holder against it.
    ///
    /// ```no_run
    /// # async fn example(guard: lockcell_client::LockGuard, invoices: Vec<String>) {
    /// for invoice in invoices {
    ///     tokio::select! {
    ///         _ = send_invoice(guard.token(), &invoice) => {}
    ///         revoked = guard.revoked() => {
    ///             eprintln!("stopped before invoice {invoice}: {revoked}");
    ///             break;
    ///         }
    ///     }
    /// }
    /// # }
    /// # async fn send_invoice(_token: lockcell_client::FencingToken, _invoice: &str) {}
    /// ```
    pub async fn revoked(&self) -> Revoked {
        crate::revoked::revoked(self.session.shared(), &self.holding).await
    }

    /// Until when the lock may be acted on, as far as the client knows now (the
    /// session's deadline; renewals push it on); `None` once it may not.
    ///
    /// ```no_run
    /// # async fn example(guard: lockcell_client::LockGuard) {
    /// use std::time::Duration;
    ///
    /// use tokio::time::Instant;
    ///
    /// // Start the next export only if it can end before the lock may pass on.
    /// let step = Duration::from_secs(2);
    /// match guard.valid_until() {
    ///     Some(until) if until > Instant::now() + step => export_batch(guard.token()).await,
    ///     _ => eprintln!("not enough time left on {}", guard.lock()),
    /// }
    /// # }
    /// # async fn export_batch(_token: lockcell_client::FencingToken) {}
    /// ```
    pub fn valid_until(&self) -> Option<tokio::time::Instant> {
        crate::revoked::valid_until(self.session.shared(), &self.holding)
    }

    /// A token for worker tasks that act as holder: cancelled as soon as
    /// [`revoked`](Self::revoked) would resolve, or once the lock is let go (or its
    /// handle dropped). It stays cancelled: after a jeopardy that passed, ask for a new
    /// one. Needs a tokio runtime.
    ///
    /// ```no_run
    /// # async fn example(guard: lockcell_client::LockGuard) {
    /// let (stop, token) = (guard.cancellation(), guard.token());
    /// let reindex = tokio::spawn(async move {
    ///     tokio::select! {
    ///         _ = reindex_invoices(token) => {}
    ///         _ = stop.cancelled() => eprintln!("reindex stopped: the lock may pass on"),
    ///     }
    /// });
    /// let _ = reindex.await;
    /// # }
    /// # async fn reindex_invoices(_token: lockcell_client::FencingToken) {}
    /// ```
    pub fn cancellation(&self) -> CancellationToken {
        crate::revoked::cancellation(
            self.session.shared().clone(),
            self.holding.clone(),
            &self.ended,
        )
    }

    /// Releases the lock. `Ok(false)`: the proxy found it no longer held by this grant
    /// (lost in a move of the session, say); it may also say so with
    /// [`Error::NotHolder`]. A session that has expired does not ask the proxy:
    /// [`Error::SessionExpired`] (its locks are gone with it).
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Wait;
    ///
    /// if let Some(guard) = session.acquire("billing/invoices", Wait::Try).await? {
    ///     send_invoices(guard.token()).await;
    ///     if !guard.release().await? {
    ///         eprintln!("billing/invoices had passed on before the release");
    ///     }
    /// }
    /// # Ok(()) }
    /// # async fn send_invoices(_token: lockcell_client::FencingToken) {}
    /// ```
    pub async fn release(mut self) -> Result<bool, Error> {
        self.released = true;
        let holdings = &self.session.shared().holdings;
        // An acquire of this lock by another task of the session waits for this.
        let _releasing = holdings.releasing(&self.lock);
        if self.session.shared().is_expired() {
            holdings.remove(&self.holding);
            return Err(self.session.expired_error());
        }
        // Still named by a move of the session until answered: the key moves with it,
        // and the release sent again on the new proxy finds it there.
        self.holding.let_go();
        let released = release(&self.session, &self.lock, self.mode, self.token).await;
        holdings.remove(&self.holding);
        released
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.ended.cancel();
        if self.released || self.session.shared().is_expired() {
            return;
        }
        let holdings = &self.session.shared().holdings;
        if self.holding.is_lost() {
            holdings.remove(&self.holding);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing to send from; the lock goes when the session does.
            holdings.remove(&self.holding);
            return;
        };
        // Counted before the hold is forgotten: the session's next acquire of this
        // lock waits for this release.
        let releasing = holdings.releasing(&self.lock);
        self.holding.let_go();
        let holding = self.holding.clone();
        let session = self.session.clone();
        let client = session.client().clone();
        let lock = std::mem::take(&mut self.lock);
        let (mode, token) = (self.mode, self.token);
        // Owned by its own bound: the call answers or times out. It holds the session,
        // so the session is closed only after the release.
        let span = tracing::debug_span!("release", session.id = %session.id(), lock.name = %lock);
        let task = async move {
            let _releasing = releasing;
            match release(&session, &lock, mode, token).await {
                Ok(released) => tracing::debug!(released, "dropped guard released"),
                Err(error) => tracing::warn!(%error, "dropped guard not released"),
            }
            session.shared().holdings.remove(&holding);
        };
        client.spawn_background(&runtime, task.instrument(span));
    }
}

/// Asks for `lock` in `mode` as call `call_id`, waiting up to `wait`, on whichever
/// proxy the session lives on ([`Session::grant_moving`]).
pub(crate) async fn ask_acquire(
    session: &Session,
    lock: &str,
    mode: Mode,
    call_id: &str,
    wait: Wait,
) -> Result<(AcquireResponse, Sent), Error> {
    send_acquire(session, lock, mode, call_id, wait, false).await
}

/// [`ask_acquire`], or with `withdraw` the withdrawal of call `call_id` (see the
/// proto's `AcquireRequest.withdraw`).
pub(crate) async fn send_acquire(
    session: &Session,
    lock: &str,
    mode: Mode,
    call_id: &str,
    wait: Wait,
    withdraw: bool,
) -> Result<(AcquireResponse, Sent), Error> {
    let call = |wait: Wait, channel| {
        let mut request = tonic::Request::new(AcquireRequest {
            session_id: session.id().to_owned(),
            session_secret: session.secret().to_owned(),
            lock: lock.to_owned(),
            wait_timeout_ms: wait.wait_timeout_ms(),
            mode: mode.wire().into(),
            call_id: call_id.to_owned(),
            withdraw,
        });
        if let Some(timeout) = wait.call_timeout() {
            request.set_timeout(timeout);
        }
        async move { LockClient::new(channel).acquire(request).await }
    };
    session.grant_moving(lock, wait, call).await
}

pub(crate) async fn release(
    session: &Session,
    lock: &str,
    mode: Mode,
    token: FencingToken,
) -> Result<bool, Error> {
    let mut request = tonic::Request::new(ReleaseRequest {
        session_id: session.id().to_owned(),
        session_secret: session.secret().to_owned(),
        lock: lock.to_owned(),
        token: Some(token.into()),
        mode: mode.wire().into(),
    });
    request.set_timeout(UNARY_TIMEOUT);
    // Sent again (it is idempotent) when the session moved to another proxy meanwhile:
    // the lock moved with it and must be released there.
    for _ in 0..MOVES_FOLLOWED {
        let generation = session.client().proxies().generation();
        let reply = LockClient::new(session.client().channel())
            .release(clone_request(&request))
            .await;
        match reply {
            Err(status) if session.left(&status, generation).await => continue,
            Err(status) => return Err(session.grant_call_failed(status, generation)),
            Ok(reply) => return Ok(reply.into_inner().released),
        }
    }
    Err(Error::Unavailable(format!(
        "the release of lock {lock:?} kept meeting proxies the session had left"
    )))
}

/// How many moves of its session one call follows before giving up.
pub(crate) const MOVES_FOLLOWED: usize = 4;

fn clone_request<T: Clone>(request: &tonic::Request<T>) -> tonic::Request<T> {
    let mut copy = tonic::Request::new(request.get_ref().clone());
    copy.set_timeout(UNARY_TIMEOUT);
    copy
}

/// The answer of a sequencer check.
///
/// ```no_run
/// # use lockcell_client::{Client, Error, FencingToken};
/// # async fn example(client: Client, token: FencingToken) -> Result<(), Error> {
/// let check = client.check_sequencer("billing/invoices", token).await?;
/// if !check.current {
///     let holder = check.holder.map_or("nobody".to_owned(), |t| t.to_string());
///     eprintln!("refusing a charge under {token}: the exclusive holder is {holder}");
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequencer {
    /// Whether the token checked is the lock's current exclusive grant.
    pub current: bool,
    /// The current exclusive grant's token; `None` when nobody holds the lock
    /// exclusively (it is free, or held shared).
    pub holder: Option<FencingToken>,
}

impl Client {
    /// Asks whether `token` is still the current exclusive grant of `lock` (a sequencer
    /// check). For a resource that cannot remember the highest token it has
    /// seen: it checks each request's token here before acting on it.
    ///
    /// The answer is already old when it arrives; a resource that can keep the highest
    /// token is safer comparing tokens itself.
    ///
    /// ```no_run
    /// # use lockcell_client::{Client, Error, FencingToken};
    /// # async fn example(client: Client, token: FencingToken) -> Result<(), Error> {
    /// // A payment gateway that keeps no state asks before each charge.
    /// let check = client.check_sequencer("billing/invoices", token).await?;
    /// if check.current {
    ///     charge_the_card().await;
    /// }
    /// # Ok(()) }
    /// # async fn charge_the_card() {}
    /// ```
    pub async fn check_sequencer(
        &self,
        lock: &str,
        token: FencingToken,
    ) -> Result<Sequencer, Error> {
        let mut request = tonic::Request::new(CheckSequencerRequest {
            lock: lock.to_owned(),
            token: Some(token.into()),
        });
        request.set_timeout(UNARY_TIMEOUT);
        let reply = LockClient::new(self.channel())
            .check_sequencer(request)
            .await
            .map_err(|status| Error::from_status(status, Call::Unbound))?
            .into_inner();
        sequencer(lock, token, reply.current, reply.holder.map(Into::into))
    }
}

/// Who holds a lock and who waits for it in line ([`Client::describe`]).
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// let state = client.describe("billing/invoices").await?;
/// if state.holders.is_empty() {
///     println!("billing/invoices is free ({} waiting)", state.waiters.len());
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockState {
    /// Every hold: one exclusive, or any number of shared.
    pub holders: Vec<LockHolder>,
    /// A fair class's waiters, in line order (other classes' waiters are not listed:
    /// they wait in their proxies' memory).
    pub waiters: Vec<LockWaiter>,
    /// The store revision read.
    pub revision: i64,
}

/// One hold of a lock.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// for holder in client.describe("billing/invoices").await?.holders {
///     let held_for = holder.acquired_at.elapsed().unwrap_or_default();
///     println!(
///         "{} (session {}) has held it for {held_for:?} through {} in zone {}",
///         holder.identity, holder.session_id, holder.proxy_id, holder.zone
///     );
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockHolder {
    /// Exclusive or shared.
    pub mode: Mode,
    /// The grant's fencing token.
    pub token: FencingToken,
    /// The session that holds it.
    pub session_id: String,
    /// The identity its client gave when it opened its session.
    pub identity: String,
    /// The proxy that made the grant, and its zone.
    pub proxy_id: String,
    /// The zone of that proxy.
    pub zone: String,
    /// When the grant was made (the granting proxy's clock).
    pub acquired_at: std::time::SystemTime,
    /// For an election: its leader's value.
    pub value: Option<String>,
}

/// One waiter in a fair class's line.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// let state = client.describe("billing/invoices").await?;
/// for (place, waiter) in state.waiters.iter().enumerate() {
///     println!(
///         "{place}: session {} waits ({:?})",
///         waiter.session_id, waiter.mode
///     );
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockWaiter {
    /// The hold it waits for: exclusive or shared.
    pub mode: Mode,
    /// The waiting session.
    pub session_id: String,
    /// Its place in line (lower goes first).
    pub revision: i64,
}

impl Client {
    /// Who holds `lock` and who waits for it, for people investigating a lock that is
    /// not released (needs the lock or read right on the name).
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let state = client.describe("billing/invoices").await?;
    /// match state.holders.first() {
    ///     Some(holder) => println!("held by {} under token {}", holder.identity, holder.token),
    ///     None => println!("free"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn describe(&self, lock: &str) -> Result<LockState, Error> {
        let mut request = tonic::Request::new(DescribeRequest {
            lock: lock.to_owned(),
        });
        request.set_timeout(UNARY_TIMEOUT);
        let reply = LockClient::new(self.channel())
            .describe(request)
            .await
            .map_err(|status| Error::from_status(status, Call::Unbound))?
            .into_inner();
        let mode = |wire: i32| match LockMode::try_from(wire) {
            Ok(LockMode::Shared) => Mode::Shared,
            _ => Mode::Exclusive,
        };
        let holders = reply
            .holders
            .into_iter()
            .map(|h| LockHolder {
                mode: mode(h.mode),
                token: h.token.map(Into::into).unwrap_or(FencingToken {
                    epoch: 0,
                    revision: 0,
                }),
                session_id: h.session_id,
                identity: h.identity,
                proxy_id: h.proxy_id,
                zone: h.zone,
                acquired_at: std::time::UNIX_EPOCH + Duration::from_millis(h.acquired_at_ms),
                value: h.election.then_some(h.value),
            })
            .collect();
        let waiters = reply
            .waiters
            .into_iter()
            .map(|w| LockWaiter {
                mode: mode(w.mode),
                session_id: w.session_id,
                revision: w.revision,
            })
            .collect();
        Ok(LockState {
            holders,
            waiters,
            revision: reply.revision,
        })
    }
}

/// Checks a CheckSequencer reply for consistency: a current token is the holder.
fn sequencer(
    lock: &str,
    token: FencingToken,
    current: bool,
    holder: Option<FencingToken>,
) -> Result<Sequencer, Error> {
    match (current, holder) {
        (true, Some(holder)) if holder != token => Err(Error::Protocol(format!(
            "CheckSequencer on lock {lock:?} called token {token} current while naming \
             {holder} as the holder"
        ))),
        // The holder may be left out of a "current" answer: it is the token asked about.
        (true, _) => Ok(Sequencer {
            current,
            holder: Some(token),
        }),
        (false, holder) => Ok(Sequencer { current, holder }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(revision: i64) -> FencingToken {
        FencingToken { epoch: 1, revision }
    }

    /// Compiles only if waiting for a lost lock can be spawned on a runtime.
    #[allow(dead_code)]
    fn lost_can_be_awaited_in_a_spawned_task(guard: LockGuard) {
        fn send<T: Send>(_: T) {}
        send(async move { guard.lost().await });
    }

    #[test]
    fn modes_map_to_the_wire() {
        assert_eq!(Mode::Exclusive.wire(), LockMode::Exclusive);
        assert_eq!(Mode::Shared.wire(), LockMode::Shared);
        // The wire values the proto fixes: exclusive is the default (0).
        assert_eq!(i32::from(Mode::Exclusive.wire()), 0);
        assert_eq!(i32::from(Mode::Shared.wire()), 1);
    }

    #[test]
    fn sequencer_answers_are_checked() {
        assert_eq!(
            sequencer("l", t(7), true, Some(t(7))).unwrap(),
            Sequencer {
                current: true,
                holder: Some(t(7))
            }
        );
        assert_eq!(sequencer("l", t(7), true, None).unwrap().holder, Some(t(7)));
        assert_eq!(
            sequencer("l", t(7), false, Some(t(9))).unwrap(),
            Sequencer {
                current: false,
                holder: Some(t(9))
            }
        );
        assert_eq!(
            sequencer("l", t(7), false, None).unwrap(),
            Sequencer {
                current: false,
                holder: None
            }
        );
        let err = sequencer("l", t(7), true, Some(t(9))).unwrap_err();
        assert!(matches!(err, Error::Protocol(_)), "{err:?}");
    }

    #[test]
    fn wait_maps_to_the_wire() {
        assert_eq!(Wait::Try.wait_timeout_ms(), Some(0));
        assert_eq!(
            Wait::Timeout(Duration::from_millis(1500)).wait_timeout_ms(),
            Some(1500)
        );
        assert_eq!(Wait::Timeout(Duration::ZERO).wait_timeout_ms(), Some(0));
        assert_eq!(Wait::Forever.wait_timeout_ms(), None);
        // Longer than gRPC can say is ten years.
        assert_eq!(
            Wait::Timeout(Duration::MAX).wait_timeout_ms(),
            Some(LONGEST_WAIT.as_millis() as u64)
        );
    }

    #[test]
    fn call_deadline_leaves_room_for_the_answer() {
        let s = Duration::from_secs;
        assert_eq!(Wait::Try.call_timeout(), Some(ACQUIRE_SLACK));
        assert_eq!(
            Wait::Timeout(s(30)).call_timeout(),
            Some(s(30) + ACQUIRE_SLACK)
        );
        assert_eq!(
            Wait::Timeout(Duration::MAX).call_timeout(),
            Some(LONGEST_WAIT + ACQUIRE_SLACK)
        );
        // A deadline gRPC can say: tonic refuses (panics on) one it cannot.
        let mut request = tonic::Request::new(());
        request.set_timeout(Wait::Timeout(Duration::MAX).call_timeout().unwrap());
        assert_eq!(Wait::Forever.call_timeout(), None);
    }
}
