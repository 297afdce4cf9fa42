//! A TCP relay between a client and a server on loopback that a test can cut: for
//! losing a reply after the server acted on the request, or partitioning a proxy.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
    /// A one-shot trap: the first request chunk that holds the pattern passes, and
    /// every reply on every connection is dropped for a while from then on.
    trap: TrapSlot,
    /// The pumps of every connection so far, for [`Relay::reset`].
    pumps: Pumps,
    /// While set, connections are closed as soon as they are made.
    refusing: Arc<AtomicBool>,
    /// Counts heals: a connection made before the last heal passes nothing more.
    heals: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

/// The tasks that pump relayed connections.
type Pumps = Arc<Mutex<Vec<JoinHandle<()>>>>;

/// Where a relay keeps its trap until it is sprung.
type TrapSlot = Arc<Mutex<Option<Trap>>>;

/// See [`Relay::cut_replies_after`].
#[derive(Clone)]
struct Trap {
    pattern: Vec<u8>,
    cut_for: std::time::Duration,
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
        let trap: TrapSlot = Arc::default();
        let (rc, qc, delay) = (replies_cut.clone(), requests_cut.clone(), delay_ms.clone());
        let traps = trap.clone();
        let pumps: Pumps = Arc::default();
        let running = pumps.clone();
        let refusing = Arc::new(AtomicBool::new(false));
        let refused = refusing.clone();
        let heals = Arc::new(AtomicU64::new(0));
        let healed = heals.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if refused.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let born = healed.load(Ordering::SeqCst);
                let requests = Pump {
                    cut: qc.clone(),
                    delay_ms: delay.clone(),
                    trap: Some((traps.clone(), rc.clone())),
                    heals: (healed.clone(), born),
                };
                let replies = Pump {
                    cut: rc.clone(),
                    delay_ms: delay.clone(),
                    trap: None,
                    heals: (healed.clone(), born),
                };
                let mut running = running.lock().expect("pumps");
                running.retain(|p| !p.is_finished());
                running.push(tokio::spawn(requests.run(client_read, server_write)));
                running.push(tokio::spawn(replies.run(server_read, client_write)));
            }
        });
        Ok(Relay {
            addr,
            replies_cut,
            requests_cut,
            delay_ms,
            trap,
            pumps,
            refusing,
            heals,
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

    /// Lets the next request chunk that contains `pattern` (for a gRPC peer, a key or
    /// value in a request's body) through, and from that moment drops every reply on
    /// every connection for `cut_for`: the server acts on the request, and its sender
    /// hears nothing back (nor of anything else it asks meanwhile) until its deadline
    /// has passed: an outcome it cannot know.
    pub fn cut_replies_after(&self, pattern: &[u8], cut_for: std::time::Duration) {
        *self.trap.lock().expect("trap") = Some(Trap {
            pattern: pattern.to_vec(),
            cut_for,
        });
    }

    /// Takes back a trap set by [`cut_replies_after`](Relay::cut_replies_after) that has
    /// not been sprung.
    pub fn disarm(&self) {
        *self.trap.lock().expect("trap") = None;
    }

    /// Whether the trap set by [`cut_replies_after`](Relay::cut_replies_after) has not
    /// been sprung yet.
    pub fn trap_pending(&self) -> bool {
        self.trap.lock().expect("trap").is_some()
    }

    /// Ends a cut as a long partition ends: both directions pass again, and every
    /// connection that went through the cut is closed (its peers would have given up on
    /// it; and the bytes the cut dropped leave its streams unusable, or worse, missing
    /// whole messages that a gRPC peer would read past).
    ///
    /// The connections are marked before the cut is lifted: a chunk one of them reads
    /// in between (say, the frame of a message written as the cut ends) must not pass,
    /// or its peer would read that message after the ones the cut dropped.
    pub fn heal(&self) {
        self.heals.fetch_add(1, Ordering::SeqCst);
        self.cut(false);
        self.reset();
    }

    /// Closes every connection relayed so far (new ones are relayed as before): the
    /// client sees its streams break at once, as when a peer restarts.
    pub fn reset(&self) {
        for pump in self.pumps.lock().expect("pumps").drain(..) {
            pump.abort();
        }
    }

    /// While `refuse` holds, closes every connection at once (those made before too):
    /// the client's calls fail at once, as with a peer that is down.
    pub fn refuse(&self, refuse: bool) {
        self.refusing.store(refuse, Ordering::SeqCst);
        if refuse {
            self.reset();
        }
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
        self.reset();
    }
}

/// How many traps have been sprung, in this process.
static SPRUNG: AtomicU64 = AtomicU64::new(0);

/// One direction of a relayed connection.
struct Pump {
    cut: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
    /// Requests only: the one-shot trap to look out for, and the replies' cut switch.
    trap: Option<(TrapSlot, Arc<AtomicBool>)>,
    /// The relay's heal count, and what it was when the connection was made.
    heals: (Arc<AtomicU64>, u64),
}

impl Pump {
    async fn run(
        self,
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if self.cut.load(Ordering::SeqCst) {
                continue;
            }
            // Healed since the connection was made: it went through the cut.
            if self.heals.0.load(Ordering::SeqCst) != self.heals.1 {
                return;
            }
            self.spring(&buf[..n]);
            let delay = self.delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    /// Springs the trap if this chunk holds its pattern (once): replies are cut from
    /// now, before the chunk goes on, and restored after the trap's time.
    fn spring(&self, chunk: &[u8]) {
        let Some((trap, replies_cut)) = &self.trap else {
            return;
        };
        let mut trap = trap.lock().expect("trap");
        let Some(set) = trap.as_ref() else {
            return;
        };
        if !chunk
            .windows(set.pattern.len())
            .any(|w| w == set.pattern.as_slice())
        {
            return;
        }
        let cut_for = set.cut_for;
        *trap = None;
        replies_cut.store(true, Ordering::SeqCst);
        // A later trap's cut outlasts this one's restore.
        let sprung = SPRUNG.fetch_add(1, Ordering::SeqCst) + 1;
        let replies_cut = replies_cut.clone();
        tokio::spawn(async move {
            tokio::time::sleep(cut_for).await;
            if SPRUNG.load(Ordering::SeqCst) == sprung {
                replies_cut.store(false, Ordering::SeqCst);
            }
        });
    }
}
