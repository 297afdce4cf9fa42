//! A TCP relay between a client and a server on loopback that a test can cut: for
//! losing a reply after the server acted on the request, or partitioning a proxy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Forwards every connection made to [`Relay::addr`] to the target.
pub struct Relay {
    /// `127.0.0.1:PORT` to connect to instead of the target.
    pub addr: String,
    /// While set, bytes from the target to the client are dropped (black-holed).
    replies_cut: Arc<AtomicBool>,
    /// While set, bytes from the client to the target are dropped.
    requests_cut: Arc<AtomicBool>,
    accept: JoinHandle<()>,
}

impl Relay {
    pub async fn start(target: &str) -> anyhow::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let (replies_cut, requests_cut) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let target = target.to_owned();
        let (rc, qc) = (replies_cut.clone(), requests_cut.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, qc.clone()));
                tokio::spawn(pump(server_read, client_write, rc.clone()));
            }
        });
        Ok(Relay {
            addr,
            replies_cut,
            requests_cut,
            accept,
        })
    }

    /// The relay's address as a URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Drops (true) or passes (false) what the target sends back.
    pub fn cut_replies(&self, cut: bool) {
        self.replies_cut.store(cut, Ordering::SeqCst);
    }

    /// Drops (true) or passes (false) what clients send.
    pub fn cut_requests(&self, cut: bool) {
        self.requests_cut.store(cut, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cut.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
