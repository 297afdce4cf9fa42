//! A TCP relay between a client and a server on loopback that a test can cut: for
//! losing a reply after the server acted on the request, or partitioning a proxy.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// Milliseconds every chunk waits before it is passed on, both ways.
    delay_ms: Arc<AtomicU64>,
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
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (rc, qc, delay) = (replies_cut.clone(), requests_cut.clone(), delay_ms.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, qc.clone(), delay.clone()));
                tokio::spawn(pump(server_read, client_write, rc.clone(), delay.clone()));
            }
        });
        Ok(Relay {
            addr,
            replies_cut,
            requests_cut,
            delay_ms,
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

    /// Black-holes (true) or restores (false) both directions.
    pub fn cut(&self, cut: bool) {
        self.cut_requests(cut);
        self.cut_replies(cut);
    }

    /// Holds every chunk back this long before passing it on, both ways (zero: none).
    pub fn delay(&self, delay: std::time::Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
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
    delay_ms: Arc<AtomicU64>,
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
        let delay = delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
