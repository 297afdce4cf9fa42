//! The part of a session that both the application's handles and the keep-alive driver
//! see: its id and TTL, its renewal sequence, and its validity (a watch channel, so
//! waiters learn about a new deadline or an expiry the moment it happens).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{sleep_until, Instant};

use crate::holdings::{Holdings, SessionEvent, SessionEvents};
use crate::validity::{deadline_from, renew_interval, SessionState, Stamp, Validity};
use lockcell_proto::suspend;

/// Where a session lives: its proxy, the etcd lease its keys are on (a resume names
/// the lease they move from) and its stay there (a close of the session left behind
/// names it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Home {
    pub(crate) proxy_id: String,
    pub(crate) lease: i64,
    pub(crate) incarnation: u64,
    /// The session fence's revision from the last resume (0: never resumed).
    pub(crate) fence: i64,
    /// The cell's epoch as the last Open or Resume reply said (0: unknown).
    pub(crate) epoch: u64,
    /// On a proxy that serves several cells: the session's stay in each (named back in
    /// a Resume and a Close).
    pub(crate) cells: Vec<lockcell_proto::v1::CellStay>,
}

/// One session's shared state. Held by the session's handles and, for reply dispatch,
/// by the client's keep-alive driver.
#[derive(Debug)]
pub(crate) struct SessionShared {
    pub(crate) id: String,
    /// The session's credential from its Open reply, sent with every call naming it.
    pub(crate) secret: String,
    /// The TTL the proxy granted.
    pub(crate) ttl: Duration,
    /// As given at open; named again in a resume.
    pub(crate) identity: String,
    /// Where the session lives now.
    home: Mutex<Home>,
    /// What the session holds, and its events.
    pub(crate) holdings: Holdings,
    /// Raised when a move of the session starts and when it ends: a grant whose request
    /// went out in another epoch, or that arrives while a move runs, may have been made
    /// on the proxy it is leaving, on that proxy's lease.
    move_epoch: AtomicU64,
    moving: AtomicBool,
    /// Told when a move ends.
    move_ended: tokio::sync::Notify,
    /// The last `seq` used in a renewal; each renewal takes the next one, so a reply
    /// names exactly one request.
    seq: AtomicU64,
    /// The last `valid_for` granted, in ms: it shortens the renewal interval when the
    /// proxy grants less than the TTL (e.g. while it cannot reach etcd).
    last_valid_for_ms: AtomicU64,
    validity: watch::Sender<Validity>,
}

impl SessionShared {
    /// A session just opened: `sent` is when the Open request went out.
    pub(crate) fn new(id: String, ttl: Duration, sent: Stamp, valid_for_ms: u64) -> Self {
        SessionShared {
            id,
            secret: String::new(),
            ttl,
            identity: String::new(),
            home: Mutex::default(),
            holdings: Holdings::default(),
            move_epoch: AtomicU64::new(0),
            moving: AtomicBool::new(false),
            move_ended: tokio::sync::Notify::new(),
            seq: AtomicU64::new(0),
            last_valid_for_ms: AtomicU64::new(valid_for_ms),
            validity: watch::Sender::new(Validity::new(
                deadline_from(sent.at, valid_for_ms),
                sent.generation,
            )),
        }
    }

    /// Applies a grant of `valid_for_ms` for a request sent at `sent`; nothing if the
    /// machine was suspended since (the grant's time is not what the clock says).
    pub(crate) fn grant(&self, sent: Stamp, valid_for_ms: u64) {
        if sent.generation != suspend::generation() {
            return;
        }
        self.last_valid_for_ms
            .store(valid_for_ms, Ordering::Relaxed);
        let candidate = deadline_from(sent.at, valid_for_ms);
        self.validity
            .send_if_modified(|v| v.extend(candidate, sent.generation));
    }

    /// Records where the session lives.
    pub(crate) fn set_home(&self, home: Home) {
        *self.home.lock().expect("session home") = home;
    }

    pub(crate) fn home(&self) -> Home {
        self.home.lock().expect("session home").clone()
    }

    pub(crate) fn with_identity(mut self, identity: String) -> Self {
        self.identity = identity;
        self
    }

    /// The session now lives at `home`; `sent` is when the Resume went out and
    /// `valid_for_ms` what the new proxy granted.
    ///
    /// `named` is what the resume named, read when the holdings were at `version`: those
    /// keys are on the new lease now. The session settles (grants count again) only if
    /// nothing was added since; otherwise it stays unsettled and is resumed again.
    /// `rewritten` are the ephemeral keys the move wrote (the reply's `moved`).
    pub(crate) fn moved(
        &self,
        home: Home,
        sent: Stamp,
        valid_for_ms: u64,
        named: &[lockcell_proto::v1::HeldKey],
        rewritten: &[lockcell_proto::v1::HeldKey],
        version: u64,
    ) {
        let changed = self.home().proxy_id != home.proxy_id;
        let proxy_id = home.proxy_id.clone();
        self.holdings.moved_to(home.lease, named, rewritten);
        self.set_home(home);
        if self.holdings.version() == version {
            self.validity.send_if_modified(Validity::settle);
        }
        self.grant(sent, valid_for_ms);
        if changed {
            tracing::info!(session.id = %self.id, proxy.id = %proxy_id, "session moved");
            self.holdings.publish(SessionEvent::Moved { proxy_id });
        }
    }

    /// A move of the session starts now.
    pub(crate) fn begin_move(&self) {
        self.moving.store(true, Ordering::SeqCst);
        self.move_epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// The move of the session is over (moved or not).
    pub(crate) fn end_move(&self) {
        self.move_epoch.fetch_add(1, Ordering::SeqCst);
        self.moving.store(false, Ordering::SeqCst);
        self.move_ended.notify_waiters();
    }

    /// Resolves once no move of the session runs: a call sent from then on counts as
    /// sent where the session lives.
    pub(crate) async fn move_over(&self) {
        loop {
            let ended = self.move_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if !self.moving.load(Ordering::SeqCst) {
                return;
            }
            ended.await;
        }
    }

    pub(crate) fn move_epoch(&self) -> u64 {
        self.move_epoch.load(Ordering::SeqCst)
    }

    /// Whether a grant sent in `epoch` may be on the lease of a proxy the session was
    /// leaving: a move started or ended since, or runs now.
    pub(crate) fn moved_since_epoch(&self, epoch: u64) -> bool {
        self.moving.load(Ordering::SeqCst) || self.move_epoch() != epoch
    }

    /// Where the session's keys are is unknown until a resume settles it: stop acting
    /// now (the deadline ends), and let no grant or renewal count meanwhile.
    pub(crate) fn unsettle(&self) {
        let now = Instant::now();
        self.validity.send_if_modified(|v| v.suspend(now));
    }

    pub(crate) fn is_unsettled(&self) -> bool {
        self.validity.borrow().unsettled
    }

    /// How long from `sent` the application may still act on the current deadline.
    pub(crate) fn acting_for(&self, sent: Instant) -> Duration {
        self.deadline().saturating_duration_since(sent)
    }

    /// The session's events from now on.
    pub(crate) fn events(self: &Arc<Self>) -> SessionEvents {
        SessionEvents::new(
            self.clone(),
            self.holdings.subscribe(),
            self.validity.subscribe(),
        )
    }

    /// Ends the session for good (terminal), remembering why.
    pub(crate) fn expire(&self, reason: &str) {
        let reason: Arc<str> = reason.into();
        if self.validity.send_if_modified(|v| v.expire(reason.clone())) {
            tracing::debug!(session.id = %self.id, %reason, "session expired");
        }
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// How long after a renewal the next one should go out.
    pub(crate) fn renew_interval(&self) -> Duration {
        let valid_for = Duration::from_millis(self.last_valid_for_ms.load(Ordering::Relaxed));
        renew_interval(self.ttl, valid_for)
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.validity.borrow().deadline
    }

    pub(crate) fn state(&self) -> SessionState {
        self.validity
            .borrow()
            .state_at(Instant::now(), suspend::generation())
    }

    pub(crate) fn is_expired(&self) -> bool {
        self.validity.borrow().expired.is_some()
    }

    pub(crate) fn expired_reason(&self) -> Option<String> {
        self.validity.borrow().expired.as_deref().map(str::to_owned)
    }

    /// Resolves once the session is past its deadline or expired. Wakes on every change
    /// of the validity, because a renewal that lands before the deadline moves it.
    pub(crate) async fn jeopardy(&self) {
        let mut rx = self.validity.subscribe();
        loop {
            let deadline = {
                let v = rx.borrow_and_update();
                if v.state_at(Instant::now(), suspend::generation()) != SessionState::Valid {
                    return;
                }
                v.deadline
            };
            tokio::select! {
                // Re-checked at the top: a renewal may have landed at the same moment.
                _ = sleep_until(deadline) => {}
                changed = rx.changed() => {
                    if changed.is_err() {
                        // No more updates can come: only the clock matters now.
                        sleep_until(deadline).await;
                    }
                }
            }
        }
    }

    /// Resolves once the session has expired (not merely past its deadline).
    /// Resolves once the session is valid (before its deadline, settled): at once if it
    /// is. False if it expired instead.
    pub(crate) async fn valid(&self) -> bool {
        let mut rx = self.validity.subscribe();
        loop {
            match rx
                .borrow_and_update()
                .state_at(Instant::now(), suspend::generation())
            {
                SessionState::Valid => return true,
                SessionState::Expired => return false,
                // Only a renewal (a change) brings it back.
                SessionState::Jeopardy => {}
            }
            if rx.changed().await.is_err() {
                return false;
            }
        }
    }

    pub(crate) async fn expired(&self) {
        let mut rx = self.validity.subscribe();
        // An error means the sender is gone, which cannot happen while `self` lives.
        let _ = rx.wait_for(|v| v.expired.is_some()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holdings::Held;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A request sent at `instant`, with no suspend since.
    fn at(instant: Instant) -> Stamp {
        Stamp {
            at: instant,
            generation: suspend::generation(),
        }
    }

    /// Lets spawned tasks run to their next await point (time is paused, so this does
    /// not wait for anything real).
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn jeopardy_resolves_at_the_deadline() {
        let t0 = Instant::now();
        let s = Arc::new(SessionShared::new("s".into(), ms(900), at(t0), 900));
        let waiter = tokio::spawn({
            let s = s.clone();
            async move {
                s.jeopardy().await;
                Instant::now()
            }
        });
        let resolved = waiter.await.unwrap();
        assert_eq!(resolved, t0 + ms(900));
        assert_eq!(s.state(), SessionState::Jeopardy);
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_before_the_deadline_postpones_jeopardy() {
        let t0 = Instant::now();
        let s = Arc::new(SessionShared::new("s".into(), ms(900), at(t0), 900));
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.jeopardy().await }
        });
        tokio::time::advance(ms(600)).await;
        s.grant(at(t0 + ms(500)), 900); // new deadline t0 + 1400
        settle().await;
        tokio::time::advance(ms(400)).await; // t0 + 1000: past the old deadline
        settle().await;
        assert!(!waiter.is_finished());
        assert_eq!(s.state(), SessionState::Valid);
        tokio::time::advance(ms(400)).await; // t0 + 1400
        settle().await;
        assert!(waiter.is_finished());
        assert_eq!(s.state(), SessionState::Jeopardy);
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_resolves_jeopardy_and_expired_at_once() {
        let t0 = Instant::now();
        let s = Arc::new(SessionShared::new("s".into(), ms(12_000), at(t0), 12_000));
        let jeopardy = tokio::spawn({
            let s = s.clone();
            async move { s.jeopardy().await }
        });
        let expired = tokio::spawn({
            let s = s.clone();
            async move { s.expired().await }
        });
        settle().await;
        assert!(!jeopardy.is_finished() && !expired.is_finished());
        s.expire("session \"s\" has expired: missed renewals");
        settle().await;
        assert!(jeopardy.is_finished() && expired.is_finished());
        assert_eq!(Instant::now(), t0, "no time had to pass");
        assert_eq!(s.state(), SessionState::Expired);
        assert_eq!(
            s.expired_reason().as_deref(),
            Some("session \"s\" has expired: missed renewals")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_unsettled_session_stops_acting_and_takes_no_grant_until_it_moves() {
        let t0 = Instant::now();
        let s = SessionShared::new("s".into(), ms(9_000), at(t0), 9_000);
        tokio::time::advance(ms(1_000)).await;
        s.unsettle();
        assert_eq!(s.state(), SessionState::Jeopardy, "stops acting at once");
        s.grant(at(Instant::now()), 9_000);
        assert_eq!(
            s.state(),
            SessionState::Jeopardy,
            "a renewal does not count"
        );
        let home = Home {
            proxy_id: "b".into(),
            lease: 7,
            incarnation: 1,
            fence: 12,
            epoch: 1,
            cells: Vec::new(),
        };
        // A resume that named what the session held when it was sent...
        let version = s.holdings.version();
        s.holdings.add(
            Held::Ephemeral {
                key: "k".into(),
                create_revision: 3,
                mod_revision: 3,
            },
            7,
        );
        // ...but a hold came in after it read them: still unsettled.
        s.moved(home.clone(), at(Instant::now()), 9_000, &[], &[], version);
        assert!(s.is_unsettled());
        assert_eq!(s.state(), SessionState::Jeopardy);
        // A resume that named everything settles it.
        let (version, named) = (s.holdings.version(), s.holdings.wire());
        s.moved(
            home.clone(),
            at(Instant::now()),
            9_000,
            &named,
            &[],
            version,
        );
        assert!(!s.is_unsettled());
        assert_eq!(s.state(), SessionState::Valid, "a resume settles it");
        assert_eq!(s.home(), home);
    }

    #[tokio::test]
    async fn a_grant_sent_before_or_during_a_move_counts_as_moved() {
        let s = SessionShared::new("s".into(), ms(9_000), at(Instant::now()), 9_000);
        let epoch = s.move_epoch();
        assert!(!s.moved_since_epoch(epoch));
        s.begin_move();
        assert!(s.moved_since_epoch(epoch), "sent before the move began");
        assert!(s.moved_since_epoch(s.move_epoch()), "sent while it runs");
        let during = s.move_epoch();
        s.end_move();
        assert!(s.moved_since_epoch(during), "sent during, taken in after");
        assert!(!s.moved_since_epoch(s.move_epoch()));
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_interval_tracks_the_last_grant() {
        let t0 = Instant::now();
        let s = SessionShared::new("s".into(), ms(12_000), at(t0), 12_000);
        assert_eq!(s.renew_interval(), ms(4_000));
        s.grant(at(t0), 1_500);
        assert_eq!(s.renew_interval(), ms(500));
        assert_eq!(
            s.deadline(),
            t0 + ms(12_000),
            "the shorter grant did not shorten the deadline"
        );
        assert_eq!((s.next_seq(), s.next_seq()), (1, 2));
    }
}
