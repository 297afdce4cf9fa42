//! The connection to a zone proxy: one gRPC channel and one keep-alive driver, shared by
//! every session opened through it.

use std::sync::Arc;
use std::time::Duration;

use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::OpenRequest;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::error::{Call, Error};
use crate::keepalive::KeepAlive;
use crate::session::{Session, SessionOptions};
use crate::shared::SessionShared;

/// How long establishing the TCP connection may take before the proxy counts as
/// unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings on an otherwise quiet connection, so a dead proxy is noticed even
/// between renewals.
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(10);
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on unary calls that touch only the proxy's memory or one etcd write (Open,
/// Close, Release): a hung call must not hang the application.
pub(crate) const UNARY_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to one lockcell proxy. Cheap to clone; all clones share the connection
/// and the single keep-alive stream that renews every session opened through them.
///
/// The connection (and its keep-alive task) lives while any clone, [`Session`] or
/// [`LockGuard`](crate::LockGuard) made from it lives.
#[derive(Clone, Debug)]
pub struct Client {
    inner: Arc<ClientInner>,
}

#[derive(Debug)]
struct ClientInner {
    /// The address as given, for error messages.
    addr: String,
    channel: Channel,
    keepalive: KeepAlive,
}

impl Client {
    /// Connects to a proxy at `addr` (`"127.0.0.1:7420"` or `"http://127.0.0.1:7420"`).
    ///
    /// Connects eagerly, so a wrong or unreachable address is reported here, naming the
    /// address, rather than at the first call.
    pub async fn connect(addr: &str) -> Result<Client, Error> {
        let endpoint = Endpoint::from_shared(endpoint_uri(addr))
            .map_err(|e| Error::connect(addr, &e))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(HTTP2_PING_INTERVAL)
            .keep_alive_timeout(HTTP2_PING_TIMEOUT)
            .keep_alive_while_idle(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| Error::connect(addr, &e))?;
        tracing::debug!(proxy = addr, "connected");
        let keepalive = KeepAlive::start(channel.clone());
        Ok(Client {
            inner: Arc::new(ClientInner {
                addr: addr.to_owned(),
                channel,
                keepalive,
            }),
        })
    }

    /// Opens a session and starts renewing it on the shared keep-alive stream.
    ///
    /// The session is valid until `send time of the Open + valid_for` and is kept valid
    /// by renewals; see [`Session::jeopardy`] for what the application must watch.
    pub async fn open_session(&self, opts: SessionOptions) -> Result<Session, Error> {
        let mut request = tonic::Request::new(OpenRequest {
            ttl_ms: u64::try_from(opts.ttl.as_millis()).unwrap_or(u64::MAX),
            identity: opts.identity,
        });
        request.set_timeout(UNARY_TIMEOUT);
        let sent = Instant::now();
        let reply = SessionClient::new(self.channel())
            .open(request)
            .await
            .map_err(|status| Error::from_status(status, Call::Unbound))?
            .into_inner();
        if reply.session_id.is_empty() {
            return Err(Error::Protocol("Open answered without a session id".into()));
        }
        let ttl = Duration::from_millis(reply.ttl_ms);
        let shared = Arc::new(SessionShared::new(
            reply.session_id,
            ttl,
            sent,
            reply.valid_for_ms,
        ));
        let first_due = sent + shared.renew_interval();
        tracing::debug!(
            session.id = %shared.id,
            proxy.id = %reply.proxy_id,
            ttl_ms = reply.ttl_ms,
            valid_for_ms = reply.valid_for_ms,
            "session opened"
        );
        let session = Session::new(self.clone(), shared.clone(), reply.proxy_id);
        // From here on, dropping `session` unregisters and closes it.
        self.inner.keepalive.register(shared, first_due).await?;
        Ok(session)
    }

    /// The address this client was connected with.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    pub(crate) fn channel(&self) -> Channel {
        self.inner.channel.clone()
    }

    pub(crate) fn keepalive(&self) -> &KeepAlive {
        &self.inner.keepalive
    }
}

/// Accepts a bare `host:port` by assuming plain HTTP/2.
fn endpoint_uri(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_addresses_get_a_scheme() {
        assert_eq!(endpoint_uri("127.0.0.1:7420"), "http://127.0.0.1:7420");
        assert_eq!(
            endpoint_uri("http://127.0.0.1:7420"),
            "http://127.0.0.1:7420"
        );
        assert_eq!(
            endpoint_uri("https://proxy.zone-a:7420"),
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
