//! The proxies a client may use, in order of preference (its own zone's first), and
//! the one it uses now. Every call goes to the current proxy; the keep-alive driver
//! switches to another when the current one dies, stops answering, cannot reach etcd
//! or drains, after resuming every session there.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::deadline::Deadline;
use crate::error::Error;

/// A connection to one proxy, with the client's credentials on every call.
pub(crate) type Channel = InterceptedService<Deadline<tonic::transport::Channel>, Credentials>;

/// TLS to the proxies: the CA that signed their certificates, and the client's own
/// certificate for proxies that require one (its subject common name is the identity
/// the proxy's prefix grants know the client by). All PEM.
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use lockcell_client::{Client, ClientOptions, ClientTls};
///
/// // Proxies reached by address, whose certificates all name one service.
/// let tls = ClientTls {
///     ca_pem: std::fs::read("/etc/billing/lockcell/ca.pem")?,
///     domain: Some("proxy.lockcell.internal".to_owned()),
///     ..ClientTls::default()
/// };
/// let options = ClientOptions::new(["10.0.1.7:7420", "10.0.2.7:7420"]).tls(tls);
/// let client = Client::connect_with(options).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct ClientTls {
    /// The CA that signed the proxies' certificates.
    pub ca_pem: Vec<u8>,
    /// The client certificate and its key, for mutual TLS.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    /// The name the proxies' certificates are checked against; by default the host
    /// of each proxy address.
    pub domain: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    /// Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("client_certificate", &self.identity_pem.is_some())
            .field("domain", &self.domain)
            .finish()
    }
}

/// Adds the client's bearer token (if any) to every call.
#[derive(Clone, Default)]
pub struct Credentials {
    bearer: Option<MetadataValue<Ascii>>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.bearer.is_some() {
            "Credentials(bearer ***)"
        } else {
            "Credentials(none)"
        })
    }
}

impl Interceptor for Credentials {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(bearer) = &self.bearer {
            request
                .metadata_mut()
                .insert("authorization", bearer.clone());
        }
        Ok(request)
    }
}

/// How the client reaches and proves itself to the proxies.
#[derive(Clone, Debug, Default)]
pub(crate) struct Security {
    pub tls: Option<ClientTls>,
    pub credentials: Credentials,
}

impl Security {
    pub(crate) fn new(tls: Option<ClientTls>, token: Option<&str>) -> Result<Security, Error> {
        let bearer = token
            .map(|t| {
                let mut value: MetadataValue<Ascii> =
                    format!("Bearer {t}").parse().map_err(|_| {
                        Error::InvalidArgument(
                            "the token has characters a header cannot carry".into(),
                        )
                    })?;
                // Never indexed by HTTP/2 header compression.
                value.set_sensitive(true);
                Ok::<_, Error>(value)
            })
            .transpose()?;
        if bearer.is_some() && tls.is_none() {
            tracing::warn!(
                "a bearer token without TLS crosses the network in clear; set ClientOptions::tls"
            );
        }
        Ok(Security {
            tls,
            credentials: Credentials { bearer },
        })
    }
}

/// How long establishing the TCP connection may take before the proxy counts as
/// unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A move tries the next proxy sooner than a first connect gives up: the session's
/// deadline is running.
pub(crate) const MOVE_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 pings on an otherwise quiet connection, so a dead proxy is noticed even
/// between renewals.
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(10);
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub(crate) struct Proxies {
    addrs: Vec<String>,
    security: Arc<Security>,
    current: Mutex<(usize, Channel)>,
    /// Bumped on every switch, so calls that failed on the old proxy can wait for the
    /// new one.
    generation: watch::Sender<u64>,
}

impl Proxies {
    /// Connects to the first of `addrs` that answers, in order.
    pub(crate) async fn connect(addrs: Vec<String>, security: Security) -> Result<Proxies, Error> {
        let security = Arc::new(security);
        if addrs.is_empty() {
            return Err(Error::InvalidArgument(
                "a client needs at least one proxy address".into(),
            ));
        }
        let mut last = None;
        for (index, addr) in addrs.iter().enumerate() {
            match connect(addr, &security, CONNECT_TIMEOUT).await {
                Ok(channel) => {
                    tracing::debug!(proxy = addr, "connected");
                    return Ok(Proxies {
                        current: Mutex::new((index, channel)),
                        generation: watch::Sender::new(0),
                        addrs,
                        security,
                    });
                }
                Err(e) => {
                    tracing::debug!(proxy = addr, error = %e, "proxy unreachable");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one address was tried"))
    }

    pub(crate) fn channel(&self) -> Channel {
        self.current.lock().expect("current proxy").1.clone()
    }

    pub(crate) fn current(&self) -> usize {
        self.current.lock().expect("current proxy").0
    }

    /// How many proxies the client was given.
    pub(crate) fn count(&self) -> usize {
        self.addrs.len()
    }

    pub(crate) fn addr(&self, index: usize) -> &str {
        &self.addrs[index]
    }

    /// The proxies to try when moving: in order of preference, the current one last
    /// (it just failed), or not at all with `avoid_current` (it asked its clients to go).
    pub(crate) fn move_order(&self, avoid_current: bool) -> Vec<usize> {
        let current = self.current();
        let mut order: Vec<usize> = (0..self.addrs.len()).filter(|&i| i != current).collect();
        if !avoid_current {
            order.push(current);
        }
        order
    }

    /// Opens a connection to proxy `index` for a move.
    pub(crate) async fn open(&self, index: usize) -> Result<Channel, Error> {
        connect(&self.addrs[index], &self.security, MOVE_CONNECT_TIMEOUT).await
    }

    /// Makes proxy `index` (reached over `channel`) the current one.
    pub(crate) fn switch(&self, index: usize, channel: Channel) {
        *self.current.lock().expect("current proxy") = (index, channel);
        self.generation.send_modify(|g| *g += 1);
    }

    pub(crate) fn generation(&self) -> u64 {
        *self.generation.borrow()
    }

    /// Resolves once the client has switched proxies since `generation`, or after
    /// `timeout`. Returns whether it switched.
    pub(crate) async fn switched_since(&self, generation: u64, timeout: Duration) -> bool {
        let mut rx = self.generation.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|g| *g != generation))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

async fn connect(addr: &str, security: &Security, timeout: Duration) -> Result<Channel, Error> {
    if security.tls.is_some() && addr.starts_with("http://") {
        return Err(Error::InvalidArgument(format!(
            "{addr} is a plain-HTTP address, but the client is set up for TLS: write https://{} or the bare address",
            addr.trim_start_matches("http://")
        )));
    }
    let mut endpoint = Endpoint::from_shared(endpoint_uri(addr, security.tls.is_some()))
        .map_err(|e| Error::connect(addr, &e))?
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(HTTP2_PING_INTERVAL)
        .keep_alive_timeout(HTTP2_PING_TIMEOUT)
        .keep_alive_while_idle(true);
    if let Some(tls) = &security.tls {
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
        if let Some((cert, key)) = &tls.identity_pem {
            config = config.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &tls.domain {
            config = config.domain_name(domain.clone());
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| Error::connect(addr, &e))?;
    }
    // `connect_timeout` bounds the TCP connect only; a stopped proxy's kernel completes
    // that, and the TLS or HTTP/2 handshake after it never ends.
    let channel = tokio::time::timeout(timeout, endpoint.connect())
        .await
        .map_err(|_| Error::Connect {
            addr: addr.to_owned(),
            reason: format!(
                "the proxy accepted the connection but did not answer within {} (stopped or overloaded?)",
                humantime::format_duration(timeout)
            ),
        })?
        .map_err(|e| Error::connect(addr, &e))?;
    Ok(InterceptedService::new(
        Deadline(channel),
        security.credentials.clone(),
    ))
}

/// Accepts a bare `host:port` by assuming HTTP/2, over TLS when the client has TLS set.
pub(crate) fn endpoint_uri(addr: &str, tls: bool) -> String {
    match (addr.contains("://"), tls) {
        (true, _) => addr.to_owned(),
        (false, true) => format!("https://{addr}"),
        (false, false) => format!("http://{addr}"),
    }
}
