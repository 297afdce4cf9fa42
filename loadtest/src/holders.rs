//! SDK sessions that hold something: each opens through a [`Client`] that knows every
//! proxy (its own zone's first), takes one exclusive lock and writes one ephemeral key,
//! and is followed through its events while the scenario does its worst; afterwards
//! every lock's token and every key is read back.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use lockcell_client::{
    Client, ClientOptions, Condition, LockGuard, Session, SessionEvent, SessionOptions, Wait,
};
use lockcell_loadtest::pacing::share;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::fleet::stopped;
use crate::progress;

/// Session setups (open, lock, ephemeral key), read-backs and closes in flight at once.
const CONCURRENCY: usize = 64;

/// One session and what it holds.
pub struct Holder {
    /// The client it was opened through, for the read-back.
    client: Client,
    pub session: Session,
    pub guard: LockGuard,
    /// Its ephemeral key, and that key's create revision when written.
    key: String,
    key_revision: i64,
    /// The proxy it was opened on: its zone's.
    pub home_proxy: String,
}

impl Holder {
    /// Whether the guard's `lost()` has resolved: the session expired, or the lock was
    /// found gone when the session moved.
    pub fn lock_lost(&self) -> bool {
        resolved(self.guard.lost()).is_some()
    }
}

/// Connects `clients` clients (client `c` in zone `c % zones`, its zone's proxy first,
/// then the others in zone order) and has `sessions` sessions, spread evenly over them,
/// open (with `ttl`), lock and write their key.
pub async fn hold(
    addrs: &[String],
    clients: usize,
    sessions: usize,
    ttl: Duration,
    grace: Duration,
) -> anyhow::Result<Vec<Holder>> {
    let bar = progress::count("opening sessions", sessions as u64);
    let gate = Arc::new(Semaphore::new(CONCURRENCY));
    let mut setting_up = JoinSet::new();
    for c in 0..clients {
        let zone = c % addrs.len();
        let preference = (0..addrs.len()).map(|k| addrs[(zone + k) % addrs.len()].clone());
        let client = Client::connect_with(ClientOptions::new(preference).grace(grace))
            .await
            .with_context(|| format!("connecting client {c} (zone {})", addrs[zone]))?;
        for i in share(sessions, clients, c) {
            let (client, gate) = (client.clone(), gate.clone());
            setting_up.spawn(async move {
                let _permit = gate.acquire().await.expect("gate open");
                hold_one(&client, i, ttl)
                    .await
                    .with_context(|| format!("setting up session {i}"))
            });
        }
    }
    let mut holders = Vec::with_capacity(sessions);
    while let Some(done) = setting_up.join_next().await {
        holders.push(done??);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(holders)
}

async fn hold_one(client: &Client, i: usize, ttl: Duration) -> anyhow::Result<Holder> {
    let session = client
        .open_session(SessionOptions {
            ttl,
            identity: format!("loadtest/rolling-restart/{i}"),
        })
        .await?;
    let lock = format!("rolling/lock-{i}");
    let Some(guard) = session.acquire(&lock, Wait::Try).await? else {
        bail!("free lock {lock} was not granted");
    };
    let key = format!("rolling/alive-{i}");
    let written = session
        .put_ephemeral(&key, b"alive", Condition::Absent)
        .await?;
    let key_revision = match (written.succeeded, written.current) {
        (true, Some(entry)) => entry.create_revision,
        _ => bail!("ephemeral key {key} was not written (it already exists?)"),
    };
    Ok(Holder {
        client: client.clone(),
        home_proxy: session.proxy_id(),
        session,
        guard,
        key,
        key_revision,
    })
}

/// What one session went through, from its events.
#[derive(Debug, Default)]
pub struct Seen {
    pub moves: u64,
    pub jeopardies: u64,
    /// `Lost` events: a lock or key found gone when the session moved.
    pub holds_lost: u64,
}

/// Every session followed through its events, each by a task of its own.
pub struct Followers {
    /// Moves seen so far, for progress messages.
    pub moves: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<(Holder, Seen)>,
}

impl Followers {
    pub fn start(holders: Vec<Holder>) -> Followers {
        let moves = Arc::new(AtomicU64::new(0));
        let (stop, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        for holder in holders {
            tasks.spawn(follow(holder, moves.clone(), stop.subscribe()));
        }
        Followers { moves, stop, tasks }
    }

    /// Stops following; hands every session back with what it went through.
    pub async fn finish(mut self) -> anyhow::Result<Vec<(Holder, Seen)>> {
        let _ = self.stop.send(true);
        let mut followed = Vec::with_capacity(self.tasks.len());
        while let Some(done) = self.tasks.join_next().await {
            followed.push(done?);
        }
        Ok(followed)
    }
}

/// Follows one session's events until `stop`; hands the session back.
async fn follow(
    holder: Holder,
    moves: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) -> (Holder, Seen) {
    let mut events = holder.session.events();
    let mut seen = Seen::default();
    let mut ended = false;
    loop {
        tokio::select! {
            event = events.next(), if !ended => match event {
                Some(SessionEvent::Moved { .. }) => {
                    seen.moves += 1;
                    moves.fetch_add(1, Ordering::Relaxed);
                }
                Some(SessionEvent::Jeopardy) => seen.jeopardies += 1,
                Some(SessionEvent::Lost { held, reason }) => {
                    seen.holds_lost += 1;
                    tracing::warn!(session.id = holder.session.id(), ?held, %reason, "hold lost");
                }
                Some(SessionEvent::Expired { reason }) => {
                    tracing::warn!(session.id = holder.session.id(), %reason, "session expired");
                }
                Some(SessionEvent::Safe) => {}
                None => ended = true,
            },
            _ = stopped(&mut stop) => break,
        }
    }
    (holder, seen)
}

/// What reading every lock's holder and every key back found.
#[derive(Debug, Default)]
pub struct Checked {
    /// Locks whose current token is not the one granted at the start.
    pub tokens_changed: u64,
    /// Ephemeral keys gone, or there with another create revision.
    pub keys_lost: u64,
    /// Read-backs that failed (and so checked nothing).
    pub errors: u64,
}

/// Asks, through each session's own client, whether its lock's token is still current
/// (CheckSequencer) and whether its ephemeral key is still the one it wrote.
pub async fn read_back(followed: &[(Holder, Seen)]) -> Checked {
    let bar = progress::count("reading back", followed.len() as u64);
    let gate = Arc::new(Semaphore::new(CONCURRENCY));
    let mut reading = JoinSet::new();
    for (h, _) in followed {
        let (client, gate) = (h.client.clone(), gate.clone());
        let (lock, token) = (h.guard.lock().to_owned(), h.guard.token());
        let (key, revision) = (h.key.clone(), h.key_revision);
        reading.spawn(async move {
            let _permit = gate.acquire().await.expect("gate open");
            let sequencer = client.check_sequencer(&lock, token).await?;
            let entry = client.get(&key).await?;
            let kept = entry.is_some_and(|e| e.create_revision == revision && e.ephemeral);
            anyhow::Ok((sequencer.current, kept))
        });
    }
    let mut checked = Checked::default();
    while let Some(done) = reading.join_next().await {
        match done {
            Ok(Ok((current, kept))) => {
                checked.tokens_changed += u64::from(!current);
                checked.keys_lost += u64::from(!kept);
            }
            Ok(Err(e)) => {
                checked.errors += 1;
                tracing::warn!(error = %e, "read-back failed");
            }
            Err(e) => {
                checked.errors += 1;
                tracing::warn!(error = %e, "read-back task failed");
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    checked
}

/// Closes every session before the cell stops, so no release is left to fail later.
pub async fn close_all(followed: Vec<(Holder, Seen)>) {
    let gate = Arc::new(Semaphore::new(CONCURRENCY));
    let mut closing = JoinSet::new();
    for (holder, _) in followed {
        let gate = gate.clone();
        closing.spawn(async move {
            let _permit = gate.acquire().await.expect("gate open");
            let Holder { session, guard, .. } = holder;
            let closed = session.close().await;
            drop(guard);
            closed
        });
    }
    let mut failed = 0;
    while let Some(done) = closing.join_next().await {
        failed += usize::from(!matches!(done, Ok(Ok(_))));
    }
    if failed > 0 {
        tracing::warn!(failed, "sessions not closed at the end");
    }
}

/// What `future` yields if it is ready at once, without waiting: whether a guard's
/// `lost()` has resolved by now. (Polled here rather than awaited in each follower
/// because `LockGuard::lost()` is not `Send`, so a spawned task cannot await it.)
fn resolved<F: Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}
