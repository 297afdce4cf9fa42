//! The fenced resource of fault runs, served over TCP so client processes can write to
//! it: one line `LOCK TOKEN WRITER` per write, answered `ok` or `refused` (a lower token
//! than one already accepted for that lock).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::FencedResource;

/// A fenced resource per lock name, listening on loopback until dropped.
pub struct FencedServer {
    /// `127.0.0.1:PORT`
    pub addr: String,
    resources: Arc<Mutex<HashMap<String, Arc<FencedResource>>>>,
    accept: JoinHandle<()>,
}

impl FencedServer {
    pub async fn start() -> anyhow::Result<FencedServer> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let resources: Arc<Mutex<HashMap<String, Arc<FencedResource>>>> = Arc::default();
        let shared = resources.clone();
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let (read, mut write) = stream.into_split();
                    let mut lines = BufReader::new(read).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let reply = match answer(&shared, &line) {
                            Some(true) => "ok\n",
                            Some(false) => "refused\n",
                            None => "bad\n",
                        };
                        if write.write_all(reply.as_bytes()).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Ok(FencedServer {
            addr,
            resources,
            accept,
        })
    }

    /// The resource of `lock`, if anyone wrote to it.
    pub fn resource(&self, lock: &str) -> Option<Arc<FencedResource>> {
        self.resources.lock().expect("resources").get(lock).cloned()
    }

    /// Writes refused, over every lock.
    pub fn refused(&self) -> usize {
        let resources = self.resources.lock().expect("resources");
        resources.values().map(|r| r.refused().len()).sum()
    }

    /// Writes accepted, over every lock.
    pub fn accepted(&self) -> usize {
        let resources = self.resources.lock().expect("resources");
        resources.values().map(|r| r.accepted().len()).sum()
    }
}

impl Drop for FencedServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn answer(resources: &Mutex<HashMap<String, Arc<FencedResource>>>, line: &str) -> Option<bool> {
    let mut parts = line.split_whitespace();
    let (lock, token, writer) = (parts.next()?, parts.next()?.parse().ok()?, parts.next()?);
    let resource = resources
        .lock()
        .expect("resources")
        .entry(lock.to_owned())
        .or_default()
        .clone();
    Some(resource.write(writer, token))
}
