//! The connection to the proxies: the one in use (its gRPC channel) and one keep-alive
//! driver, shared by every session opened through it, that moves them all to another
//! proxy when that one fails.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::proxies::Channel;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::OpenRequest;
use tokio_util::task::TaskTracker;

use crate::error::{Call, Error};
use crate::keepalive::KeepAlive;
use crate::proxies::{ClientTls, Proxies, Security};
use crate::session::{Session, SessionOptions};
use crate::shared::{Home, SessionShared};
use crate::validity::Stamp;

/// Bound on unary calls that touch only the proxy's memory or one etcd write (Open,
/// Close, Release): a hung call must not hang the application.
pub(crate) const UNARY_TIMEOUT: Duration = Duration::from_secs(10);

/// How a client reaches the service. Its `Debug` output never shows the token.
///
/// ```no_run
/// # async fn example() -> Result<(), lockcell_client::Error> {
/// use std::time::Duration;
///
/// use lockcell_client::{Client, ClientOptions};
///
/// // Own zone first; sessions ride out a minute with no proxy reached.
/// let options = ClientOptions::new(["10.0.1.7:7420", "10.0.2.7:7420", "10.0.3.7:7420"])
///     .grace(Duration::from_secs(60));
/// let client = Client::connect_with(options).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClientOptions {
    /// Proxy addresses in order of preference: the client's own zone first, then the
    /// others. The client uses the first that answers and moves its sessions to the next
    /// when that one dies, stops answering, cannot reach etcd, or drains.
    pub proxies: Vec<String>,
    /// How long a session may stay in jeopardy (past its deadline, no proxy reached)
    /// before the client gives it up as expired. Reaching a proxy within it resumes the
    /// session with its locks and tokens, unless they were lost meanwhile (each guard
    /// says so). Default 45 s.
    pub grace: Duration,
    /// How long the client stays on a proxy that is not its first choice (after a move)
    /// before it tries to move back to a more preferred one, so a zone's proxy is not
    /// left idle once it is back. Default 30 s.
    pub fail_back_after: Duration,
    /// TLS to the proxies (needed when they run with --tls-cert); none by default.
    pub tls: Option<ClientTls>,
    /// A bearer token for proxies that check prefix grants without client
    /// certificates (the dev cell); none by default.
    pub token: Option<String>,
    /// Test hook: how long a move of the sessions waits between resuming them on the
    /// new proxy and sending calls there (zero outside tests). See
    /// [`ClientOptions::stall_moves_for_tests`].
    pub(crate) move_stall: Duration,
}

impl std::fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientOptions")
            .field("proxies", &self.proxies)
            .field("grace", &self.grace)
            .field("fail_back_after", &self.fail_back_after)
            .field("tls", &self.tls.is_some())
            .field("token", &self.token.as_ref().map(|_| "***"))
            .finish()
    }
}

impl ClientOptions {
    /// `proxies` in order of preference, with the default grace period.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use lockcell_client::ClientOptions;
    ///
    /// let options = ClientOptions::new(["10.0.1.7:7420", "10.0.2.7:7420"]);
    /// assert_eq!(options.proxies, ["10.0.1.7:7420", "10.0.2.7:7420"]);
    /// assert_eq!(options.grace, Duration::from_secs(45));
    /// assert!(options.tls.is_none() && options.token.is_none());
    /// ```
    pub fn new<S: Into<String>>(proxies: impl IntoIterator<Item = S>) -> Self {
        ClientOptions {
            proxies: proxies
                .into_iter()
                .map(|proxy| proxy.into().trim().to_owned())
                .filter(|proxy| !proxy.is_empty())
                .collect(),
            grace: Duration::from_secs(45),
            fail_back_after: Duration::from_secs(30),
            tls: None,
            token: None,
            move_stall: Duration::ZERO,
        }
    }

    /// Sets the grace period.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use lockcell_client::ClientOptions;
    ///
    /// // A batch job that would rather wait out a long outage than start over.
    /// let options = ClientOptions::new(["10.0.1.7:7420"]).grace(Duration::from_secs(120));
    /// assert_eq!(options.grace, Duration::from_secs(120));
    /// ```
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Sets TLS to the proxies.
    ///
    /// ```no_run
    /// # fn example() -> std::io::Result<()> {
    /// use lockcell_client::{ClientOptions, ClientTls};
    ///
    /// // Mutual TLS: the certificate's common name is the identity the grants know.
    /// let tls = ClientTls {
    ///     ca_pem: std::fs::read("/etc/billing/lockcell/ca.pem")?,
    ///     identity_pem: Some((
    ///         std::fs::read("/etc/billing/lockcell/client.pem")?,
    ///         std::fs::read("/etc/billing/lockcell/client.key")?,
    ///     )),
    ///     domain: None,
    /// };
    /// let options = ClientOptions::new(["proxy.zone-a:7420", "proxy.zone-b:7420"]).tls(tls);
    /// # Ok(()) }
    /// ```
    pub fn tls(mut self, tls: ClientTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sets the bearer token sent with every call.
    ///
    /// ```
    /// use lockcell_client::ClientOptions;
    ///
    /// let options = ClientOptions::new(["proxy.zone-a:7420"]).token("billing-7f3a9c");
    /// assert_eq!(options.token.as_deref(), Some("billing-7f3a9c"));
    /// // Safe to log.
    /// assert!(!format!("{options:?}").contains("billing-7f3a9c"));
    /// ```
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Sets how long before trying to go back to a more preferred proxy.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use lockcell_client::ClientOptions;
    ///
    /// let options = ClientOptions::new(["10.0.1.7:7420", "10.0.2.7:7420"])
    ///     .fail_back_after(Duration::from_secs(300));
    /// assert_eq!(options.fail_back_after, Duration::from_secs(300));
    /// ```
    pub fn fail_back_after(mut self, after: Duration) -> Self {
        self.fail_back_after = after;
        self
    }

    /// For tests only: every move of the sessions to another proxy waits `stall` after
    /// they were resumed there and before calls go there, widening the moment in which
    /// a call can still reach the proxy being left (which must never count as settled).
    #[doc(hidden)]
    pub fn stall_moves_for_tests(mut self, stall: Duration) -> Self {
        self.move_stall = stall;
        self
    }
}

/// A connection to the lockcell proxies. Cheap to clone; all clones share the connection
/// and the single keep-alive stream that renews every session opened through them.
///
/// The connection (and its keep-alive task) lives while any clone, [`Session`] or
/// [`LockGuard`](crate::LockGuard) made from it lives.
///
/// ```no_run
/// # async fn example() -> Result<(), lockcell_client::Error> {
/// let client = lockcell_client::Client::connect("10.0.1.7:7420,10.0.2.7:7420").await?;
/// // Another handle on the same connection, for a task of its own.
/// let rates = client.clone();
/// tokio::spawn(async move { rates.get_prefix("config/rates/").await });
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Client {
    inner: Arc<ClientInner>,
}

#[derive(Debug)]
struct ClientInner {
    proxies: Arc<Proxies>,
    keepalive: KeepAlive,
    /// What drops started and still runs: releases, resignations, closes, withdrawals.
    background: TaskTracker,
}

impl Client {
    /// Connects to a proxy at `addr` (`"127.0.0.1:7420"` or `"http://127.0.0.1:7420"`),
    /// or to the first that answers of several separated by commas, in order of
    /// preference (`"10.0.1.7:7420,10.0.2.7:7420,10.0.3.7:7420"`), with the default
    /// grace period. Sessions move between the proxies given; with one address they can
    /// still resume on it (a restarted proxy).
    ///
    /// Connects eagerly, so a wrong or unreachable address is reported here, naming the
    /// address (the last one tried, when none of several answers), rather than at the
    /// first call.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Client;
    ///
    /// let client = Client::connect("10.0.1.7:7420,10.0.2.7:7420,10.0.3.7:7420").await?;
    /// println!("connected to {}", client.addr());
    /// # Ok(()) }
    /// ```
    pub async fn connect(addr: &str) -> Result<Client, Error> {
        let addrs = addr.split(',').map(str::trim).filter(|a| !a.is_empty());
        Client::connect_with(ClientOptions::new(addrs)).await
    }

    /// Connects to the first proxy of `options` that answers.
    ///
    /// ```no_run
    /// # async fn example(token: &str) -> Result<(), Box<dyn std::error::Error>> {
    /// use lockcell_client::{Client, ClientOptions, ClientTls};
    ///
    /// let tls = ClientTls {
    ///     ca_pem: std::fs::read("/etc/billing/lockcell/ca.pem")?,
    ///     ..ClientTls::default()
    /// };
    /// let options = ClientOptions::new(["proxy.zone-a:7420", "proxy.zone-b:7420"])
    ///     .tls(tls)
    ///     .token(token);
    /// let client = Client::connect_with(options).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(options: ClientOptions) -> Result<Client, Error> {
        if options.tls.is_some() {
            // rustls needs one crypto provider per process; keep the application's if
            // it chose one.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let security = Security::new(options.tls, options.token.as_deref())?;
        let proxies = Arc::new(Proxies::connect(options.proxies, security).await?);
        let keepalive = KeepAlive::start(
            proxies.clone(),
            options.grace,
            options.fail_back_after,
            options.move_stall,
        );
        Ok(Client {
            inner: Arc::new(ClientInner {
                proxies,
                keepalive,
                background: TaskTracker::new(),
            }),
        })
    }

    /// Opens a session and starts renewing it on the shared keep-alive stream.
    ///
    /// The session is valid until `send time of the Open + valid_for` and is kept valid
    /// by renewals; see [`Session::jeopardy`] for what the application must watch.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use std::time::Duration;
    ///
    /// use lockcell_client::SessionOptions;
    ///
    /// let session = client
    ///     .open_session(SessionOptions {
    ///         ttl: Duration::from_secs(10),
    ///         identity: "billing-worker-7".to_owned(),
    ///     })
    ///     .await?;
    /// println!("session {} with a TTL of {:?}", session.id(), session.ttl());
    /// # Ok(()) }
    /// ```
    pub async fn open_session(&self, opts: SessionOptions) -> Result<Session, Error> {
        // A proxy that refuses ("use another proxy": draining, no lease, etcd away) or
        // does not answer is left for the next that takes the client, each at most once.
        let mut others = self.inner.proxies.count() - 1;
        let (reply, sent, generation) = loop {
            let mut request = tonic::Request::new(OpenRequest {
                // 0 would ask for the proxy's default: the shortest it allows is meant.
                ttl_ms: u64::try_from(opts.ttl.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
                identity: opts.identity.clone(),
            });
            request.set_timeout(UNARY_TIMEOUT);
            let generation = self.inner.proxies.generation();
            let sent = Stamp::now();
            match SessionClient::new(self.channel()).open(request).await {
                Ok(reply) => break (reply.into_inner(), sent, generation),
                Err(status) => {
                    let error = Error::from_status(status, Call::Unbound);
                    if !matches!(error, Error::Unavailable(_)) || others == 0 {
                        return Err(error);
                    }
                    others -= 1;
                    tracing::info!(proxy = %self.addr(), %error, "cannot open a session there; trying another proxy");
                    if !self.inner.keepalive.move_away(generation).await {
                        return Err(error);
                    }
                }
            }
        };
        if reply.session_id.is_empty() || reply.session_secret.is_empty() {
            return Err(Error::Protocol(
                "Open answered without a session id and secret".into(),
            ));
        }
        let ttl = Duration::from_millis(reply.ttl_ms);
        if ttl != opts.ttl {
            tracing::warn!(
                session.id = %reply.session_id,
                asked = %humantime::format_duration(opts.ttl),
                granted = %humantime::format_duration(ttl),
                "the proxy granted another session TTL than asked (its bounds for sessions)"
            );
        }
        let mut shared = SessionShared::new(reply.session_id, ttl, sent, reply.valid_for_ms)
            .with_identity(opts.identity);
        shared.secret = reply.session_secret;
        shared.set_home(Home {
            proxy_id: reply.proxy_id.clone(),
            lease: reply.lease_id,
            incarnation: reply.incarnation,
            fence: 0,
            epoch: reply.epoch,
            cells: reply.cells.clone(),
        });
        let shared = Arc::new(shared);
        let first_due = sent.at + shared.renew_interval();
        tracing::debug!(
            session.id = %shared.id,
            proxy.id = %reply.proxy_id,
            ttl_ms = reply.ttl_ms,
            valid_for_ms = reply.valid_for_ms,
            "session opened"
        );
        let session = Session::new(self.clone(), shared.clone());
        // From here on, dropping `session` unregisters and closes it.
        self.inner
            .keepalive
            .register(shared, first_due, generation)
            .await?;
        Ok(session)
    }

    /// The address of the proxy in use now.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let session = client.open_session(Default::default()).await?;
    /// // Changes when the client moves its sessions to another proxy.
    /// println!("session {} via {}", session.id(), client.addr());
    /// # Ok(()) }
    /// ```
    pub fn addr(&self) -> &str {
        self.inner.proxies.addr(self.inner.proxies.current())
    }

    pub(crate) fn channel(&self) -> Channel {
        self.inner.proxies.channel()
    }

    pub(crate) fn proxies(&self) -> &Proxies {
        &self.inner.proxies
    }

    pub(crate) fn keepalive(&self) -> &KeepAlive {
        &self.inner.keepalive
    }

    /// Runs `task` on `runtime`: a release, resignation, close or withdrawal that a drop
    /// started. Counted until it ends, so that [`Client::shutdown`] waits for it.
    pub(crate) fn spawn_background(
        &self,
        runtime: &tokio::runtime::Handle,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        runtime.spawn(self.inner.background.track_future(task));
    }

    /// Lets go of everything before the program ends: waits for the releases and
    /// resignations of the guards dropped so far (and the withdrawals of calls given up
    /// on), then closes every session of this client still open, which releases what
    /// it holds. Each call is bounded by its own timeout.
    ///
    /// Call it before `main` returns. A runtime that shuts down drops the tasks that
    /// would have released dropped guards, and their locks then pass on only when their
    /// sessions' TTLs run out. After it, the client's sessions are expired: open new
    /// ones to go on. Returns the first error of a close (the others are still sent);
    /// a session whose close failed expires on the proxy after its TTL.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), lockcell_client::Error> {
    /// let client = lockcell_client::Client::connect("127.0.0.1:7420").await?;
    /// let session = client.open_session(Default::default()).await?;
    /// let _guard = session.acquire("jobs/nightly", lockcell_client::Wait::Try).await?;
    /// // ... the work; the guard and the session are dropped here or earlier ...
    /// client.shutdown().await
    /// # }
    /// ```
    pub async fn shutdown(&self) -> Result<(), Error> {
        let background = &self.inner.background;
        background.close();
        background.wait().await;
        background.reopen();
        let mut closes = tokio::task::JoinSet::new();
        for session in self.inner.keepalive.open_sessions() {
            self.inner.keepalive.unregister(&session.id);
            session.expire("closed by Client::shutdown");
            let channel = self.channel();
            closes.spawn(async move {
                let closed = crate::session::close(channel, &session).await;
                closed.map_err(|status| Error::from_status(status, Call::Session(&session.id)))
            });
        }
        let mut first = Ok(());
        while let Some(closed) = closes.join_next().await {
            if let Ok(Err(e)) = closed {
                tracing::warn!(error = %e, "a session did not close at shutdown");
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxies::endpoint_uri;

    #[test]
    fn options_never_show_the_token() {
        let options = ClientOptions::new(["a:1"]).token("s3cret");
        let shown = format!("{options:?}");
        assert!(
            !shown.contains("s3cret") && shown.contains("***"),
            "{shown}"
        );
    }

    #[test]
    fn addresses_are_trimmed_and_empty_ones_dropped() {
        let options = ClientOptions::new(["a:1", " b:2 ", ""]);
        assert_eq!(options.proxies, ["a:1", "b:2"]);
    }

    #[test]
    fn bare_addresses_get_a_scheme() {
        assert_eq!(
            endpoint_uri("127.0.0.1:7420", false),
            "http://127.0.0.1:7420"
        );
        assert_eq!(
            endpoint_uri("127.0.0.1:7420", true),
            "https://127.0.0.1:7420"
        );
        assert_eq!(
            endpoint_uri("http://127.0.0.1:7420", true),
            "http://127.0.0.1:7420"
        );
        assert_eq!(
            endpoint_uri("https://proxy.zone-a:7420", false),
            "https://proxy.zone-a:7420"
        );
    }

    #[tokio::test]
    async fn a_bad_address_is_a_connect_error_naming_it() {
        for addr in ["not an address", "127.0.0.1:1"] {
            match Client::connect(addr).await {
                Err(Error::Connect {
                    addr: named,
                    reason,
                }) => {
                    assert_eq!(named, addr);
                    assert!(!reason.is_empty());
                }
                other => panic!("{addr}: expected a connect error, got {other:?}"),
            }
        }
    }
}
