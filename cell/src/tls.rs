//! Serving TLS on a TCP listener, for the proxies' gRPC service and the audit tailer's
//! HTTPS: certificates read from PEM files, and handshakes done one per connection so a
//! client that stalls its handshake holds up no one.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

/// A server configuration from the certificate chain at `cert` and its key at `key`
/// (PEM), asking clients for a certificate signed by `client_ca` when given (mutual
/// TLS), offering `alpn`. An error names the file and what is wrong with it.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> anyhow::Result<ServerConfig> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "reading the TLS certificate (--tls-cert) {}",
                cert.display()
            )
        })?;
    anyhow::ensure!(
        !certs.is_empty(),
        "the TLS certificate file (--tls-cert) {} holds no certificate",
        cert.display()
    );
    let private = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading the TLS key (--tls-key) {}", key.display()))?;
    let builder = ServerConfig::builder();
    let builder = match client_ca {
        Some(ca) => {
            let what = || {
                format!(
                    "the client CA certificate (--tls-client-ca) {}",
                    ca.display()
                )
            };
            let mut roots = rustls::RootCertStore::empty();
            for cert in
                CertificateDer::pem_file_iter(ca).with_context(|| format!("reading {}", what()))?
            {
                roots
                    .add(cert.with_context(|| format!("reading {}", what()))?)
                    .with_context(what)?;
            }
            let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .with_context(what)?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, private).with_context(|| {
        format!(
            "the TLS key {} does not go with the certificate {}",
            key.display(),
            cert.display()
        )
    })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// The connections `listener` accepts, each once its TLS handshake is done with the
/// configuration `config` gives when it begins (within `handshake_timeout`; a client
/// that fails or stalls it is dropped). Accepting ends when the receiver is dropped.
pub fn accept(
    listener: TcpListener,
    config: impl Fn() -> Arc<ServerConfig> + Send + 'static,
    handshake_timeout: Duration,
) -> mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            tune(&tcp);
            let acceptor = tokio_rustls::TlsAcceptor::from(config());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send((stream, peer)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    rx
}

/// Replies go out at once (no Nagle), and a peer that vanished is noticed.
fn tune(tcp: &TcpStream) {
    let _ = tcp.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(30));
    let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive);
}
