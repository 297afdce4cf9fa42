//! What a session holds (locks, leaderships, ephemeral keys), so that a resume on
//! another proxy can name every key to move, and the events the application follows:
//! jeopardy, safe again, moved, a hold lost, expired.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use lockcell_proto::v1::{HeldKey, HeldKind};
use lockcell_proto::FencingToken;
use tokio::sync::{broadcast, watch};
use tokio::time::{sleep_until, Instant};

use crate::stream::{Steps, Stream};
use crate::validity::{SessionState, Validity};
use lockcell_proto::suspend;

/// Events kept for a slow reader of [`SessionEvents`] before the oldest are dropped.
const EVENT_BACKLOG: usize = 64;

/// A key the session holds, as the application knows it.
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) {
/// use lockcell_client::{Held, SessionEvent};
///
/// let mut events = session.events();
/// while let Some(event) = events.next().await {
///     if let SessionEvent::Lost { held, reason } = event {
///         match held {
///             Held::Exclusive { lock, token } | Held::Shared { lock, token } => {
///                 eprintln!("lost {lock} (token {token}): {reason}")
///             }
///             Held::Ephemeral { key, .. } => eprintln!("{key} is no longer ours: {reason}"),
///         }
///     }
/// }
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// A lock held exclusively, or an election's leadership.
    Exclusive {
        /// The lock's (or the election's) name.
        lock: String,
        /// The grant's fencing token.
        token: FencingToken,
    },
    /// A lock held shared.
    Shared {
        /// The lock's name.
        lock: String,
        /// The grant's fencing token.
        token: FencingToken,
    },
    /// An ephemeral small key, created at `create_revision` and written by this session
    /// last at `mod_revision` (its write's revision).
    Ephemeral {
        /// The key's name.
        key: String,
        /// The revision that created the key.
        create_revision: i64,
        /// The revision of this session's last write of the key.
        mod_revision: i64,
    },
}

impl Held {
    /// For messages: how it is held, with its token.
    pub(crate) fn describe(&self) -> String {
        match self {
            Held::Exclusive { token, .. } => format!("exclusively, token {token}"),
            Held::Shared { token, .. } => format!("shared, token {token}"),
            Held::Ephemeral {
                create_revision, ..
            } => format!("an ephemeral key created at revision {create_revision}"),
        }
    }

    /// On the wire, on `lease` as far as the client knows.
    pub(crate) fn wire(&self, lease: i64) -> HeldKey {
        let (kind, name, revision, mod_revision) = match self {
            Held::Exclusive { lock, token } => (HeldKind::Exclusive, lock, token.revision, 0),
            Held::Shared { lock, token } => (HeldKind::Shared, lock, token.revision, 0),
            Held::Ephemeral {
                key,
                create_revision,
                mod_revision,
            } => (HeldKind::Ephemeral, key, *create_revision, *mod_revision),
        };
        HeldKey {
            kind: kind as i32,
            name: name.clone(),
            revision,
            lease_id: lease,
            mod_revision,
        }
    }

    /// For an ephemeral key, the revision of the session's last write of it.
    fn written(&self) -> i64 {
        match self {
            Held::Ephemeral { mod_revision, .. } => *mod_revision,
            _ => 0,
        }
    }
}

/// Something that happened to a session; see [`Session::events`](crate::Session::events).
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) {
/// use lockcell_client::SessionEvent;
///
/// let mut events = session.events();
/// while let Some(event) = events.next().await {
///     match event {
///         SessionEvent::Jeopardy => eprintln!("stop acting: no word from a proxy in time"),
///         SessionEvent::Safe => eprintln!("valid again"),
///         SessionEvent::Moved { proxy_id } => eprintln!("moved to {proxy_id}"),
///         SessionEvent::Lost { held, reason } => eprintln!("lost {held:?}: {reason}"),
///         SessionEvent::Expired { reason } => eprintln!("session over: {reason}"),
///     }
/// }
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionEvent {
    /// Past the deadline: stop acting as holder of anything the session holds. The SDK
    /// keeps trying to reach a proxy for the grace period.
    Jeopardy,
    /// Valid again after jeopardy: what the session holds is still held (except what a
    /// [`Lost`](SessionEvent::Lost) event named), with the same tokens.
    Safe,
    /// The session now lives on another proxy.
    Moved {
        /// The proxy it lives on now, as [`Session::proxy_id`](crate::Session::proxy_id)
        /// names it.
        proxy_id: String,
    },
    /// A key the session held is no longer its own (found gone or granted again when
    /// the session moved).
    Lost {
        /// What it held.
        held: Held,
        /// Why it is gone, as the proxy said.
        reason: String,
    },
    /// The session has ended and everything it held is lost. The last event.
    Expired {
        /// Why: the proxy's word, or the application's (a close, the last handle
        /// dropped, [`Client::shutdown`](crate::Client::shutdown)).
        reason: String,
    },
}

/// One hold registered with its session; its guard watches `lost`.
#[derive(Debug)]
pub(crate) struct Holding {
    pub(crate) held: Held,
    /// The lease its key is on as far as the client knows: the lease of the proxy that
    /// granted it, then of each proxy it moved to.
    lease: AtomicI64,
    /// For an ephemeral key, the mod revision of the session's last write of it: the
    /// Put's, then each move's (a move writes the key). The proxy moves and cleans up
    /// the key only while it has not been written since.
    written: AtomicI64,
    lost: watch::Sender<Option<Arc<str>>>,
    /// Its guard let go and the release (or resignation) is under way: still named by
    /// the session's moves, so the key moves with the session and the release sent again
    /// on the new proxy finds it; its loss is no news to anyone.
    releasing: AtomicBool,
}

impl Holding {
    /// Marks the hold as being released by its guard (see `releasing`).
    pub(crate) fn let_go(&self) {
        self.releasing.store(true, Ordering::Relaxed);
    }

    fn wire(&self) -> HeldKey {
        HeldKey {
            mod_revision: self.written.load(Ordering::Relaxed),
            ..self.held.wire(self.lease.load(Ordering::Relaxed))
        }
    }

    /// For an ephemeral key, the mod revision of the session's last write of it.
    pub(crate) fn written(&self) -> i64 {
        self.written.load(Ordering::Relaxed)
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// Why the hold was reported lost, if it was.
    pub(crate) fn lost_reason(&self) -> Option<String> {
        self.lost.borrow().as_deref().map(str::to_owned)
    }

    /// Resolves with the reason once the hold is reported lost.
    pub(crate) async fn lost(&self) -> Arc<str> {
        let mut rx = self.lost.subscribe();
        // Cloned out at once: the borrow must not live across an await (Send futures).
        let reason = rx.wait_for(Option::is_some).await.map(|r| r.clone());
        match reason {
            Ok(reason) => reason.expect("waited for Some"),
            Err(_) => std::future::pending().await,
        }
    }
}

/// The holds of one session and the channel of its discrete events.
#[derive(Debug)]
pub(crate) struct Holdings {
    held: Mutex<Vec<Arc<Holding>>>,
    /// Raised by every hold added, so a resume can tell whether it named them all.
    version: AtomicU64,
    /// Raised by every hold a proxy reported lost, so a move can tell it lost one.
    losses: AtomicU64,
    events: broadcast::Sender<SessionEvent>,
    /// Releases of dropped guards still under way, by lock name: the session's next
    /// acquire of that lock waits for them, so it is never sent while the old hold
    /// stands (the proxy would refuse it as a second hold of one lock).
    releasing: Mutex<HashMap<String, Arc<watch::Sender<usize>>>>,
}

impl Default for Holdings {
    fn default() -> Self {
        Holdings {
            held: Mutex::default(),
            version: AtomicU64::new(0),
            losses: AtomicU64::new(0),
            events: broadcast::Sender::new(EVENT_BACKLOG),
            releasing: Mutex::default(),
        }
    }
}

/// A release of `lock` under way (a dropped guard's); it counts until dropped.
#[derive(Debug)]
pub(crate) struct Releasing(Arc<watch::Sender<usize>>);

impl Drop for Releasing {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

impl Holdings {
    /// Registers a hold whose key is on `lease`. An ephemeral key replaces the record
    /// of an earlier write of the same key (and is not registered if a later write's is
    /// there: two writes may be answered out of order).
    pub(crate) fn add(&self, held: Held, lease: i64) -> Arc<Holding> {
        let holding = Arc::new(Holding {
            written: AtomicI64::new(held.written()),
            held,
            lease: AtomicI64::new(lease),
            lost: watch::Sender::new(None),
            releasing: AtomicBool::new(false),
        });
        let mut all = self.held.lock().expect("holdings");
        if let Held::Ephemeral { key, .. } = &holding.held {
            let same = |h: &Holding| matches!(&h.held, Held::Ephemeral { key: k, .. } if k == key);
            let written = holding.written.load(Ordering::Relaxed);
            if all
                .iter()
                .any(|h| same(h) && h.written.load(Ordering::Relaxed) > written)
            {
                return holding;
            }
            all.retain(|h| !same(h));
        }
        all.push(holding.clone());
        self.version.fetch_add(1, Ordering::SeqCst);
        holding
    }

    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }

    /// Forgets a hold (released, or its guard dropped).
    pub(crate) fn remove(&self, holding: &Arc<Holding>) {
        self.held
            .lock()
            .expect("holdings")
            .retain(|h| !Arc::ptr_eq(h, holding));
    }

    /// The session's record of its ephemeral `key`, if it wrote it.
    pub(crate) fn ephemeral(&self, key: &str) -> Option<Arc<Holding>> {
        self.held
            .lock()
            .expect("holdings")
            .iter()
            .find(|h| matches!(&h.held, Held::Ephemeral { key: k, .. } if k == key))
            .cloned()
    }

    /// The live hold of `lock` in either mode (a lock or a leadership), if the session
    /// has one: a second acquire of it is refused, since a lock is not re-entrant.
    pub(crate) fn holding_of(&self, lock: &str) -> Option<Held> {
        self.held
            .lock()
            .expect("holdings")
            .iter()
            .find(|h| match &h.held {
                Held::Exclusive { lock: l, .. } | Held::Shared { lock: l, .. } => l == lock,
                Held::Ephemeral { .. } => false,
            })
            .map(|h| h.held.clone())
    }

    /// Counts a release of `lock` as under way until the returned value is dropped.
    pub(crate) fn releasing(&self, lock: &str) -> Releasing {
        let mut all = self.releasing.lock().expect("releasing");
        all.retain(|_, n| *n.borrow() > 0);
        let count = all
            .entry(lock.to_owned())
            .or_insert_with(|| Arc::new(watch::Sender::new(0)))
            .clone();
        count.send_modify(|n| *n += 1);
        Releasing(count)
    }

    /// Resolves once no release of `lock` is under way (each is bounded by its own
    /// deadline).
    pub(crate) async fn released(&self, lock: &str) {
        let count = self.releasing.lock().expect("releasing").get(lock).cloned();
        if let Some(count) = count {
            let mut rx = count.subscribe();
            let _ = rx.wait_for(|n| *n == 0).await;
        }
    }

    /// Every key to name in a resume, each once.
    pub(crate) fn wire(&self) -> Vec<HeldKey> {
        let all = self.held.lock().expect("holdings");
        let mut keys: Vec<HeldKey> = Vec::with_capacity(all.len());
        for key in all.iter().map(|h| h.wire()) {
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        keys
    }

    /// The holds among `named` (what a resume named) that are still held are on `lease`
    /// now; others keep the lease they were on. `rewritten` are the ephemeral keys the
    /// move wrote, with their new mod revisions.
    pub(crate) fn moved_to(&self, lease: i64, named: &[HeldKey], rewritten: &[HeldKey]) {
        for h in self.held.lock().expect("holdings").iter() {
            let wire = h.wire();
            if named.iter().any(|k| same_key(k, &wire)) {
                h.lease.store(lease, Ordering::Relaxed);
                if let Some(k) = rewritten.iter().find(|k| same_key(k, &wire)) {
                    h.written.fetch_max(k.mod_revision, Ordering::Relaxed);
                }
            }
        }
    }

    /// How many holds proxies have reported lost so far.
    pub(crate) fn losses(&self) -> u64 {
        self.losses.load(Ordering::Relaxed)
    }

    /// Marks the hold a proxy reported lost, and says so on the event channel.
    pub(crate) fn lose(&self, key: &HeldKey, reason: &str) {
        let lost: Vec<Arc<Holding>> = {
            let mut all = self.held.lock().expect("holdings");
            let (lost, kept) = all.drain(..).partition(|h| same_key(&h.wire(), key));
            *all = kept;
            lost
        };
        for holding in lost {
            let reason: Arc<str> = reason.into();
            holding.lost.send_replace(Some(reason.clone()));
            if holding.releasing.load(Ordering::Relaxed) {
                // Already released, most likely: what its guard let go is no loss.
                continue;
            }
            self.losses.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(held = ?holding.held, %reason, "hold lost");
            self.publish(SessionEvent::Lost {
                held: holding.held.clone(),
                reason: reason.to_string(),
            });
        }
    }

    pub(crate) fn publish(&self, event: SessionEvent) {
        // No receiver is fine: nobody follows the events.
        let _ = self.events.send(event);
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<SessionEvent> {
        self.events.subscribe()
    }
}

/// Whether two held keys name the same key and grant, whatever lease each says.
fn same_key(a: &HeldKey, b: &HeldKey) -> bool {
    a.kind == b.kind && a.name == b.name && a.revision == b.revision
}

/// The events of one session, in order, as a [`Stream`](tokio_stream::Stream); see
/// [`Session::events`](crate::Session::events).
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) {
/// use lockcell_client::SessionEvent;
///
/// let mut events = session.events();
/// while let Some(event) = events.next().await {
///     if let SessionEvent::Lost { held, reason } = event {
///         eprintln!("lost {held:?}: {reason}");
///     }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct SessionEvents {
    steps: Steps<Events, SessionEvent>,
}

/// What a [`SessionEvents`] keeps between events.
#[derive(Debug)]
struct Events {
    /// Keeps the session's channels open while events are followed.
    _session: Arc<crate::shared::SessionShared>,
    discrete: broadcast::Receiver<SessionEvent>,
    validity: watch::Receiver<Validity>,
    last: SessionState,
    done: bool,
}

impl SessionEvents {
    pub(crate) fn new(
        session: Arc<crate::shared::SessionShared>,
        discrete: broadcast::Receiver<SessionEvent>,
        validity: watch::Receiver<Validity>,
    ) -> Self {
        let last = validity
            .borrow()
            .state_at(Instant::now(), suspend::generation());
        let events = Events {
            _session: session,
            discrete,
            validity,
            last,
            done: false,
        };
        SessionEvents {
            steps: Steps::new(events, |mut events| {
                Box::pin(async move {
                    let event = events.next().await;
                    (events, event)
                })
            }),
        }
    }

    /// The next event; `None` after [`SessionEvent::Expired`]. Events a slow reader
    /// missed (more than 64 behind) are skipped; the state changes are never missed,
    /// since they are read off the session's state. Cancel-safe.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) {
    /// use lockcell_client::SessionEvent;
    ///
    /// let mut events = session.events();
    /// while let Some(event) = events.next().await {
    ///     match event {
    ///         SessionEvent::Jeopardy => eprintln!("stop acting: the session may be gone"),
    ///         SessionEvent::Safe => eprintln!("the session is valid again"),
    ///         other => eprintln!("{other:?}"),
    ///     }
    /// }
    /// # }
    /// ```
    pub async fn next(&mut self) -> Option<SessionEvent> {
        crate::stream::next(self).await
    }
}

impl Stream for SessionEvents {
    type Item = SessionEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<SessionEvent>> {
        self.steps.poll_step(cx)
    }
}

impl Events {
    /// The next item of [`SessionEvents::next`].
    async fn next(&mut self) -> Option<SessionEvent> {
        loop {
            if self.done {
                return None;
            }
            match self.discrete.try_recv() {
                Ok(event) => return Some(event),
                Err(broadcast::error::TryRecvError::Lagged(_)) => continue,
                Err(_) => {}
            }
            let (state, deadline, reason) = {
                let v = self.validity.borrow_and_update();
                let state = v.state_at(Instant::now(), suspend::generation());
                (state, v.deadline, v.expired.clone())
            };
            if state == SessionState::Expired
                && self.last == SessionState::Valid
                && deadline <= Instant::now()
            {
                // The deadline passed before the expiry was read: jeopardy came first.
                self.last = SessionState::Jeopardy;
                return Some(SessionEvent::Jeopardy);
            }
            if state != self.last {
                self.last = state;
                return Some(match state {
                    SessionState::Valid => SessionEvent::Safe,
                    SessionState::Jeopardy => SessionEvent::Jeopardy,
                    SessionState::Expired => {
                        self.done = true;
                        SessionEvent::Expired {
                            reason: reason.as_deref().unwrap_or("expired").to_owned(),
                        }
                    }
                });
            }
            tokio::select! {
                // Lagged: skipped. Closed cannot happen while the session is held.
                event = self.discrete.recv() => if let Ok(event) = event {
                    return Some(event);
                },
                _ = self.validity.changed() => {}
                _ = sleep_until(deadline), if state == SessionState::Valid => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock(name: &str, revision: i64) -> Held {
        Held::Exclusive {
            lock: name.into(),
            token: FencingToken { epoch: 1, revision },
        }
    }

    #[tokio::test]
    async fn holds_are_named_once_move_together_and_are_lost_one_by_one() {
        let holdings = Holdings::default();
        let mut events = holdings.subscribe();
        let a = holdings.add(lock("a", 5), 10);
        let _a_again = holdings.add(lock("a", 5), 10); // the same key recorded twice
        let b = holdings.add(lock("b", 7), 11);
        assert_eq!(holdings.holding_of("a"), Some(lock("a", 5)));
        assert_eq!(holdings.holding_of("c"), None);
        let wire = holdings.wire();
        assert_eq!(wire.len(), 2, "one key named once: {wire:?}");
        assert_eq!((wire[0].lease_id, wire[1].lease_id), (10, 11));
        holdings.moved_to(20, &wire[..1], &[]);
        let now = holdings.wire();
        assert_eq!(
            (now[0].lease_id, now[1].lease_id),
            (20, 11),
            "only what the resume named moved"
        );
        holdings.moved_to(20, &wire, &[]);

        // A proxy reports b lost (naming it on the lease it was asked to move it from).
        holdings.lose(&lock("b", 7).wire(20), "gone");
        assert!(b.is_lost() && !a.is_lost());
        assert_eq!(&*b.lost().await, "gone");
        assert_eq!(
            events.recv().await.unwrap(),
            SessionEvent::Lost {
                held: lock("b", 7),
                reason: "gone".into()
            }
        );
        assert_eq!(holdings.wire().len(), 1, "a lost hold is not named again");
        holdings.remove(&a);
    }

    #[tokio::test(start_paused = true)]
    async fn an_acquire_waits_for_the_releases_of_its_lock_under_way() {
        use std::time::Duration;
        let holdings = Holdings::default();
        holdings.released("a").await; // none under way
        let first = holdings.releasing("a");
        let second = holdings.releasing("a");
        let other = holdings.releasing("b");
        drop(first);
        drop(other);
        let waited = tokio::time::timeout(Duration::from_secs(1), holdings.released("a")).await;
        assert!(waited.is_err(), "one release of a is still under way");
        holdings.released("b").await;
        drop(second);
        tokio::time::timeout(Duration::from_secs(1), holdings.released("a"))
            .await
            .expect("the wait ends once every release of a is done");
    }

    #[test]
    fn an_ephemeral_key_written_again_replaces_its_record() {
        let holdings = Holdings::default();
        let key = |create_revision, mod_revision| Held::Ephemeral {
            key: "members/g/1".into(),
            create_revision,
            mod_revision,
        };
        holdings.add(key(3, 3), 1);
        holdings.add(key(9, 9), 1);
        holdings.add(key(9, 12), 1);
        // Answered after the write at 12: an earlier write, not registered.
        holdings.add(key(9, 10), 1);
        let wire = holdings.wire();
        assert_eq!(wire.len(), 1);
        assert_eq!((wire[0].revision, wire[0].mod_revision), (9, 12));

        // A move writes the key: the next resume names the move's revision.
        let mut moved = wire[0].clone();
        moved.mod_revision = 20;
        holdings.moved_to(7, &wire, &[moved]);
        let wire = holdings.wire();
        assert_eq!((wire[0].lease_id, wire[0].mod_revision), (7, 20));
    }
}
