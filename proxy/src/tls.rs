//! The gRPC service's TLS, read again when its files change: a renewed serving
//! certificate, or a rotated client CA, applies to every connection made after it,
//! with no restart (connections already made keep the TLS they began with).
//!
//! The proxy accepts TCP itself and does each handshake with the configuration in
//! force, then hands the TLS stream to the gRPC server; tonic still sees the client's
//! certificate (`Request::peer_certs`), which the prefix grants know it by.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

use crate::metrics as m;

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the files are looked at for a change.
const CHECK_EVERY: Duration = Duration::from_secs(2);

/// The files the TLS configuration is read from.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When set, clients must present a certificate this CA signed (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

/// The TLS configuration in force, and what its files looked like when it was read.
pub struct ReloadingTls {
    files: TlsFiles,
    current: RwLock<(Arc<ServerConfig>, Vec<Stamp>)>,
}

/// A file's identity and size and modification time: a change of any is a new file
/// (a Kubernetes Secret update swaps a symbolic link, which changes the first).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp(Option<(u64, u64, Option<SystemTime>)>);

impl Stamp {
    fn of(path: &Path) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp(
            std::fs::metadata(path)
                .ok()
                .map(|m| (m.ino(), m.len(), m.modified().ok())),
        )
    }
}

impl ReloadingTls {
    /// Reads the files; an error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> anyhow::Result<ReloadingTls> {
        let stamps = stamps(&files);
        let config = build(&files)?;
        Ok(ReloadingTls {
            files,
            current: RwLock::new((Arc::new(config), stamps)),
        })
    }

    fn config(&self) -> Arc<ServerConfig> {
        self.current.read().expect("tls lock").0.clone()
    }

    /// Reads the files again if they changed since they were last read. A set that does
    /// not make a configuration (a key not yet written beside its new certificate) is
    /// refused, and the one in force stays; it is tried again at the next change.
    pub fn reload_if_changed(&self) -> bool {
        let stamps = stamps(&self.files);
        if stamps == self.current.read().expect("tls lock").1 {
            return false;
        }
        match build(&self.files) {
            Ok(config) => {
                *self.current.write().expect("tls lock") = (Arc::new(config), stamps);
                metrics::counter!(m::TLS_RELOADS).increment(1);
                tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
                true
            }
            Err(e) => {
                // Not looked at again until the files change once more.
                self.current.write().expect("tls lock").1 = stamps;
                metrics::counter!(m::TLS_RELOAD_FAILURES).increment(1);
                tracing::warn!("TLS files changed but were refused, the previous ones stay: {e:#}");
                false
            }
        }
    }

    /// Looks at the files every few seconds, for as long as the proxy runs.
    pub async fn watch(self: Arc<Self>) {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.reload_if_changed();
        }
    }
}

fn stamps(files: &TlsFiles) -> Vec<Stamp> {
    [
        Some(&files.cert),
        Some(&files.key),
        files.client_ca.as_ref(),
    ]
    .into_iter()
    .flatten()
    .map(|p| Stamp::of(p))
    .collect()
}

fn build(files: &TlsFiles) -> anyhow::Result<ServerConfig> {
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "reading the TLS certificate (--tls-cert) {}",
                files.cert.display()
            )
        })?;
    anyhow::ensure!(
        !certs.is_empty(),
        "the TLS certificate file (--tls-cert) {} holds no certificate",
        files.cert.display()
    );
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("reading the TLS key (--tls-key) {}", files.key.display()))?;
    let builder = ServerConfig::builder();
    let builder = match &files.client_ca {
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
    let mut config = builder.with_single_cert(certs, key).with_context(|| {
        format!(
            "the TLS key {} does not go with the certificate {}",
            files.key.display(),
            files.cert.display()
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The connections `listener` accepts, each once its TLS handshake is done with the
/// configuration in force when it began (within [`HANDSHAKE_TIMEOUT`]; a client that
/// fails or stalls it is dropped without holding up the others).
pub fn incoming(
    listener: TcpListener,
    tls: Arc<ReloadingTls>,
) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
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
                    tracing::warn!(error = %e, "accepting a client connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            tune(&tcp);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.config());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Replies go out at once (no Nagle), and a peer that vanished is noticed.
fn tune(tcp: &TcpStream) {
    let _ = tcp.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(30));
    let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive);
}
