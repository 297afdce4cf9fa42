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

use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};

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

/// HTTP/2 for gRPC; HTTP/1.1 too, for etcd's JSON gateway on the etcd listener, whose
/// HTTP clients (Python's, for one) offer only that.
fn build(files: &TlsFiles) -> anyhow::Result<ServerConfig> {
    lockcell_cell::tls::server_config(
        &files.cert,
        &files.key,
        files.client_ca.as_deref(),
        &[b"h2", b"http/1.1"],
    )
}

/// The connections `listener` accepts, each once its TLS handshake is done with the
/// configuration in force when it began (within [`HANDSHAKE_TIMEOUT`]).
pub fn incoming(
    listener: TcpListener,
    tls: Arc<ReloadingTls>,
) -> impl Stream<Item = std::io::Result<TlsStream<TcpStream>>> {
    let handshaken = lockcell_cell::tls::accept(listener, move || tls.config(), HANDSHAKE_TIMEOUT);
    ReceiverStream::new(handshaken).map(|(stream, _)| Ok(stream))
}
