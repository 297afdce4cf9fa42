//! How the proxy listens: the bounds of every client connection, the TLS files of its
//! APIs, and its TCP options.

use std::time::Duration;

use tokio::net::TcpListener;
use tower::layer::util::{Identity, Stack};

use crate::config::ProxyConfig;
use crate::overhead::{Api, OverheadLayer};
use crate::tls;

/// The bounds every client connection has, on either API: at most
/// `--max-streams-per-connection` calls open at once (each call is one HTTP/2 stream,
/// so this is also the bound on its calls in flight), and pings while it is quiet
/// (`--client-ping-interval`), so a vanished client's connection does not stay open.
/// Each call of `api`'s own time in the proxy is measured ([`crate::overhead`]).
pub(crate) fn client_server(
    config: &ProxyConfig,
    api: Api,
) -> tonic::transport::Server<Stack<OverheadLayer, Identity>> {
    let every = config.client_ping_interval;
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(config.max_streams_per_connection))
        .http2_keepalive_interval(Some(every))
        .http2_keepalive_timeout(Some(every))
        .tcp_keepalive(Some(every))
        .layer(OverheadLayer(api))
}

/// The TLS files of the client APIs, when --tls-cert and --tls-key are given (and
/// mutual TLS with --tls-client-ca).
pub(crate) fn tls_files(config: &ProxyConfig) -> Option<tls::TlsFiles> {
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
        return None;
    };
    Some(tls::TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: config.tls_client_ca.clone(),
    })
}

/// Client connections with Nagle's algorithm off: replies are small and go out at once
/// (with it on, a reply can wait for the client's delayed ACK, some 40 ms).
pub(crate) fn incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)))
}
