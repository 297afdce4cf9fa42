//! The session table: every client session this proxy holds, in memory.
//!
//! Opening and renewing a session touch only this table, never etcd. Expiry is found
//! through a min-heap of deadlines that renewals do not touch: when an entry comes due,
//! the reaper checks the session's real deadline and puts it back if it was renewed
//! meanwhile, so each session costs the heap about one push per TTL.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use lockcell_cell::locklog::{Grant, ETCD_API_KEYS};
use tokio::time::Instant;

use crate::core::life::{Life, Refused};

mod held;
mod tally;

pub use self::tally::Tally;

/// A session's id as clients see it: 128 random bits in hex.
pub type SessionId = Arc<str>;

/// How long the table remembers that a session expired, so that a late client is told
/// "expired" rather than "unknown".
pub const TOMBSTONE_RETENTION: Duration = Duration::from_secs(600);

/// One client session.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: SessionId,
    /// Recorded with every grant, for people investigating.
    pub identity: String,
    /// The identity that opened the session, when the proxy checks prefix grants: no
    /// other identity may use it (session ids are not secret: Leader shows them).
    pub principal: Option<Arc<str>>,
    /// Its renewals, the validity granted to its client, an operator's end, a hand-over.
    pub life: Life,
    /// The lease bucket and the lease in it when the session was opened: every key of
    /// the session is attached to `lease`.
    pub bucket: usize,
    pub lease: i64,
    /// Random per Open or Resume here, so a stale Close of an earlier stay is told apart.
    pub incarnation: u64,
    /// Keys the session has in the log: its holds, and its waiter keys on fair
    /// classes. Deleted (guarded) when the session ends.
    pub held: Vec<Grant>,
}

impl Session {
    /// A session starting its stay here at `now` (opened, or resumed with `held`), on
    /// `lease` in `bucket`, with a fresh incarnation; its client may act until
    /// `valid_until`.
    pub fn arriving(
        id: SessionId,
        identity: String,
        ttl: Duration,
        (bucket, lease): (usize, i64),
        held: Vec<Grant>,
        now: Instant,
        valid_until: Instant,
    ) -> Session {
        Session {
            id,
            identity,
            principal: None,
            life: Life::new(ttl, now, valid_until),
            bucket,
            lease,
            incarnation: rand::random::<u64>() | 1,
            held,
        }
    }

    /// Whether `caller` (None: grants not checked) may use the session.
    pub fn owned_by(&self, caller: Option<&str>) -> bool {
        match (&self.principal, caller) {
            (Some(owner), Some(caller)) => &**owner == caller,
            _ => true,
        }
    }

    /// What writing `key` with a value, `bytes` in all with its name, adds to the
    /// session's keys: a key, unless the session has a record of it already, and the
    /// bytes past that record's.
    pub fn adds(&self, key: &str, bytes: u64) -> (u64, u64) {
        let recorded = self
            .held
            .iter()
            .filter(|g| g.key == key)
            .map(Grant::bytes)
            .max();
        match recorded {
            None => (1, bytes),
            Some(before) => (0, bytes.saturating_sub(before)),
        }
    }

    /// A TTL after the last renewal: no validity may be granted past it.
    pub fn lapses_at(&self) -> Instant {
        self.life.lapses_at()
    }

    /// When the session expires ([`Life::expires_at`]): never before the latest validity
    /// granted to its client has run out (the fault runs' checker caught a session that
    /// did, a client paused right after a grant whose validity was counted from the
    /// grant rather than from the last renewal).
    pub fn expires_at(&self) -> Instant {
        self.life.expires_at()
    }

    pub fn ttl(&self) -> Duration {
        self.life.ttl
    }
}

/// Why a session is no longer in the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gone {
    /// Never opened here, closed, or forgotten long ago.
    Unknown,
    /// Expired, for the reason given.
    Expired(Arc<str>),
    /// Handed over to the next proxy its client reaches (see [`Session::handed_off`]):
    /// renewed here no more.
    HandedOff,
}

/// What a renewal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    pub bucket: usize,
    pub lease: i64,
    pub ttl: Duration,
}

/// The proxy's sessions.
#[derive(Default)]
pub struct SessionTable {
    live: DashMap<SessionId, Session>,
    /// Sessions by the deadline they had when last queued; may be stale (see module doc).
    due: Mutex<BinaryHeap<Reverse<(Instant, SessionId)>>>,
    /// Expired sessions and why, kept for [`TOMBSTONE_RETENTION`].
    tombstones: DashMap<SessionId, Arc<str>>,
    /// The leases of stays that left the table (closed, replaced, expired), by session,
    /// kept as long as tombstones: a session resuming here again never lands on one, so
    /// a delete still pending for an earlier stay (guarded by that lease) cannot reach a
    /// key the new stay holds.
    departed: DashMap<SessionId, Vec<(i64, Instant)>>,
    tombstone_order: Mutex<VecDeque<(Instant, SessionId)>>,
    /// The live sessions and the keys they hold, by the identity that opened them (see
    /// [`Session::principal`]), for that identity's limits ([`crate::limits`]).
    tally: DashMap<Arc<str>, Tally>,
    /// The sessions with a record of each of lockcell's ephemeral keys (settled), by
    /// etcd key, once per record: a key deleted by other means than its session's end
    /// is forgotten by the sessions that recorded it ([`SessionTable::forget_lost`]).
    ephemeral: DashMap<String, Vec<SessionId>>,
}

/// Whether `g` is a settled record of one of lockcell's own ephemeral keys (the etcd
/// API's keys are followed by their client lease, see `etcd_api`).
fn tracked(g: &Grant) -> bool {
    g.written != 0 && !g.is_unsettled() && g.lock.as_str() != ETCD_API_KEYS
}

impl SessionTable {
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn insert(&self, session: Session) {
        let due = session.expires_at();
        let id = session.id.clone();
        self.count(&session, 1);
        if let Some(old) = self.live.insert(id.clone(), session) {
            self.count(&old, -1);
        }
        self.due.lock().expect("due heap").push(Reverse((due, id)));
    }

    /// Records `session`, replacing (and returning) an entry with the same id: a session
    /// that resumes here again after it moved away.
    pub fn replace(&self, session: Session) -> Option<Session> {
        let due = session.expires_at();
        let id = session.id.clone();
        self.count(&session, 1);
        let old = self.live.insert(id.clone(), session);
        self.tombstones.remove(&id);
        if let Some(old) = &old {
            self.count(old, -1);
            self.depart(old, Instant::now());
        }
        self.due.lock().expect("due heap").push(Reverse((due, id)));
        old
    }

    /// The leases other stays of `id` use or used here: the live one's, and those of
    /// the stays that left (see `departed`).
    pub fn stay_leases(&self, id: &str) -> Vec<i64> {
        let mut leases: Vec<i64> = self
            .departed
            .get(id)
            .map(|d| d.iter().map(|(lease, _)| *lease).collect())
            .unwrap_or_default();
        leases.extend(self.live.get(id).map(|s| s.lease));
        leases
    }

    /// Takes back a stay that never held anything (a resume refused before any key
    /// moved): unlike a close, it leaves nothing to avoid.
    pub fn withdraw(&self, id: &str, incarnation: u64) -> Option<Session> {
        let (_, s) = self
            .live
            .remove_if(id, |_, s| s.incarnation == incarnation)?;
        self.count(&s, -1);
        Some(s)
    }

    /// Records that `stay` left the table at `now`: a later stay of its session avoids
    /// its lease (see `departed`).
    pub fn depart(&self, stay: &Session, now: Instant) {
        self.departed
            .entry(stay.id.clone())
            .or_default()
            .push((stay.lease, now));
    }

    /// Renews `id` at `now` and grants it the validity `validity` computes, which it
    /// returns. A session whose deadline has passed is not renewed even if the reaper
    /// has not reached it yet.
    /// `caller`: the identity renewing, when the proxy checks grants; another
    /// identity's session is as unknown to it.
    pub fn renew(
        &self,
        id: &str,
        caller: Option<&str>,
        now: Instant,
        validity: impl FnOnce(Renewed) -> Duration,
    ) -> Result<Duration, Gone> {
        match self.live.get_mut(id) {
            Some(s) if !s.owned_by(caller) => Err(Gone::Unknown),
            // A session handed off: its record names the validity granted so far, and
            // none is granted after.
            Some(mut s) => {
                let renewed = Renewed {
                    bucket: s.bucket,
                    lease: s.lease,
                    ttl: s.life.ttl,
                };
                s.life
                    .renew(now, || validity(renewed))
                    .map_err(|refused| match refused {
                        Refused::HandedOff => Gone::HandedOff,
                        Refused::Over(reason) => Gone::Expired(reason),
                    })
            }
            None => Err(self.gone(id)),
        }
    }

    /// The ids of the live sessions that `keep` keeps.
    pub fn ids_where(&self, keep: impl Fn(&Session) -> bool) -> Vec<SessionId> {
        self.live
            .iter()
            .filter(|s| keep(s.value()))
            .map(|s| s.key().clone())
            .collect()
    }

    /// Whether session `id` is here in its stay `incarnation`: not closed, expired or
    /// taken over since.
    pub fn is_open(&self, id: &str, incarnation: u64) -> bool {
        self.live
            .get(id)
            .is_some_and(|s| s.incarnation == incarnation)
    }

    /// A copy of session `id` as it is, ended or not.
    pub fn peek(&self, id: &str) -> Option<Session> {
        self.live.get(id).map(|s| s.clone())
    }

    /// Ends session `id` for an operator: from now on it is renewed no more, gets
    /// nothing new, and its client is told `reason` as the session's expiry; its keys
    /// are deleted once the validity granted to it has run out, as for any expiry, so no
    /// client still believes it holds them. Returns the session as ended, or `None`
    /// when it is not here. Ending it again keeps the first reason.
    pub fn end(&self, id: &str, reason: Arc<str>) -> Option<Session> {
        let mut s = self.live.get_mut(id)?;
        s.life.end(reason);
        let ended = s.clone();
        drop(s);
        self.due
            .lock()
            .expect("due heap")
            .push(Reverse((ended.expires_at(), id.into())));
        Some(ended)
    }

    /// Marks every live session `pick` picks as handed off (see
    /// [`Session::handed_off`]); returns copies of them as marked.
    pub fn hand_off(&self, pick: impl Fn(&Session) -> bool) -> Vec<Session> {
        let mut marked = Vec::new();
        for mut s in self.live.iter_mut() {
            if !s.life.is_handed_off() && s.life.ended().is_none() && pick(s.value()) {
                s.life.hand_off();
                marked.push(s.clone());
            }
        }
        marked
    }

    /// Whether session `id` is here and handed off.
    pub fn is_handed_off(&self, id: &str) -> bool {
        self.live.get(id).is_some_and(|s| s.life.is_handed_off())
    }

    /// Takes back the hand-off of session `id` (its record could not be written): it is
    /// renewed here again.
    pub fn keep(&self, id: &str) {
        if let Some(mut s) = self.live.get_mut(id) {
            s.life.keep();
        }
    }

    /// How many live sessions were not handed off.
    pub fn staying(&self) -> usize {
        self.live.iter().filter(|s| !s.life.is_handed_off()).count()
    }

    /// The leases of the sessions handed off and still here: their keys wait on them
    /// for the proxy that takes them over.
    pub fn handed_off_leases(&self) -> Vec<i64> {
        let mut leases: Vec<i64> = self
            .live
            .iter()
            .filter(|s| s.life.is_handed_off())
            .map(|s| s.lease)
            .collect();
        leases.sort_unstable();
        leases.dedup();
        leases
    }

    /// The identity that owns session `id`, if the proxy checks grants and knows it.
    pub fn principal(&self, id: &str) -> Option<Arc<str>> {
        self.live.get(id).and_then(|s| s.principal.clone())
    }

    /// A copy of the session, if it is alive at `now`.
    pub fn get(&self, id: &str, now: Instant) -> Result<Session, Gone> {
        match self.live.get(id) {
            Some(s) => match s.life.over(now) {
                None => Ok(s.clone()),
                Some(reason) => Err(Gone::Expired(reason)),
            },
            None => Err(self.gone(id)),
        }
    }

    /// Removes a session that its client closed; with `incarnation`, only that stay of
    /// it (`Ok(None)`: the session is here, but as a later stay).
    pub fn close(&self, id: &str, incarnation: Option<u64>) -> Result<Option<Session>, Gone> {
        if !self.live.contains_key(id) {
            return Err(self.gone(id));
        }
        let closed = self
            .live
            .remove_if(id, |_, s| incarnation.is_none_or(|i| i == s.incarnation))
            .map(|(_, s)| s);
        if let Some(stay) = &closed {
            self.count(stay, -1);
            self.depart(stay, Instant::now());
        }
        Ok(closed)
    }

    /// Removes and returns every session whose deadline is at or before `now`.
    pub fn take_expired(&self, now: Instant) -> Vec<Session> {
        let mut expired = Vec::new();
        let mut due = self.due.lock().expect("due heap");
        while let Some(Reverse((at, _))) = due.peek() {
            if *at > now {
                break;
            }
            let Reverse((_, id)) = due.pop().expect("peeked");
            let removed = self.live.remove_if(&id, |_, s| s.expires_at() <= now);
            match removed {
                Some((_, s)) => expired.push(s),
                None => {
                    // Renewed since it was queued (or closed): queue its real deadline.
                    if let Some(s) = self.live.get(&id) {
                        due.push(Reverse((s.expires_at(), id)));
                    }
                }
            }
        }
        drop(due);
        for s in &expired {
            self.count(s, -1);
            let reason = s.life.expiry_reason();
            self.bury(s, reason, now);
        }
        expired
    }

    /// Removes and returns every session attached to `lease` (the lease was lost).
    pub fn take_on_lease(&self, lease: i64, reason: Arc<str>, now: Instant) -> Vec<Session> {
        let ids: Vec<SessionId> = self
            .live
            .iter()
            .filter(|s| s.lease == lease)
            .map(|s| s.id.clone())
            .collect();
        let taken: Vec<Session> = ids
            .iter()
            .filter_map(|id| self.live.remove(id).map(|(_, s)| s))
            .collect();
        for s in &taken {
            self.count(s, -1);
            self.bury(s, reason.clone(), now);
        }
        taken
    }

    /// Drops tombstones older than [`TOMBSTONE_RETENTION`].
    pub fn prune_tombstones(&self, now: Instant) {
        let mut order = self.tombstone_order.lock().expect("tombstone order");
        while let Some((at, _)) = order.front() {
            if now.saturating_duration_since(*at) < TOMBSTONE_RETENTION {
                break;
            }
            let (_, id) = order.pop_front().expect("peeked");
            self.tombstones.remove(&id);
        }
        drop(order);
        self.departed.retain(|_, stays| {
            stays.retain(|(_, at)| now.saturating_duration_since(*at) < TOMBSTONE_RETENTION);
            !stays.is_empty()
        });
    }

    fn bury(&self, stay: &Session, reason: Arc<str>, now: Instant) {
        self.depart(stay, now);
        if stay.life.is_handed_off() {
            // Handed over (or still arriving): it may live on at another proxy, so
            // this one must not answer that it expired; it is only gone from here.
            return;
        }
        self.tombstones.insert(stay.id.clone(), reason);
        self.tombstone_order
            .lock()
            .expect("tombstone order")
            .push_back((now, stay.id.clone()));
    }

    fn gone(&self, id: &str) -> Gone {
        match self.tombstones.get(id) {
            Some(reason) => Gone::Expired(reason.clone()),
            None => Gone::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn session(id: &str, lease: i64, ttl: Duration, now: Instant) -> Session {
        Session {
            id: id.into(),
            identity: "test".into(),
            principal: None,
            life: Life::new(ttl, now, now),
            bucket: 0,
            lease,
            incarnation: 1,
            held: Vec::new(),
        }
    }

    #[test]
    fn an_ended_session_is_renewed_no_more_and_goes_when_its_validity_runs_out() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 1, 10 * S, t0));
        let granted = table.renew("a", None, t0, |_| 3 * S).unwrap();
        assert_eq!(granted, 3 * S);
        let ended = table.end("a", "stuck".into()).unwrap();
        assert_eq!(ended.expires_at(), t0 + 3 * S);
        assert!(table.end("b", "stuck".into()).is_none(), "not here");
        assert_eq!(
            table.renew("a", None, t0 + S, |_| 3 * S),
            Err(Gone::Expired("stuck".into()))
        );
        assert!(table.get("a", t0 + S).is_err(), "gets nothing new");
        assert!(
            table.take_expired(t0 + 2 * S).is_empty(),
            "kept while its client may still act"
        );
        let gone = table.take_expired(t0 + 3 * S);
        assert_eq!(gone.len(), 1);
        assert_eq!(table.gone("a"), Gone::Expired("stuck".into()));
    }

    #[test]
    fn a_stay_handed_over_that_lapses_here_leaves_no_tombstone() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("moved", 1, 2 * S, t0));
        table.insert(session("stayed", 2, 2 * S, t0));
        assert_eq!(table.hand_off(|s| &*s.id == "moved").len(), 1);
        let gone = table.take_expired(t0 + 2 * S);
        assert_eq!(gone.len(), 2);
        // It may live on at the proxy that took it: unknown here, not expired.
        assert_eq!(table.gone("moved"), Gone::Unknown);
        assert_eq!(
            table.gone("stayed"),
            Gone::Expired(crate::core::life::NOT_RENEWED.into())
        );
        assert_eq!(
            table.stay_leases("moved"),
            vec![1],
            "a later stay avoids its lease"
        );
    }

    #[test]
    fn an_identitys_sessions_and_keys_are_counted_in_and_out_on_every_path() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        let owned = |id: &str, lease: i64| {
            let mut s = session(id, lease, S, t0);
            s.principal = Some("batch".into());
            s
        };
        let name = |n: &str| lockcell_cell::LockName::parse(n).unwrap();
        table.insert(owned("a", 1));
        table.insert(owned("b", 2));
        table.insert(owned("c", 3));
        table.insert(session("anonymous", 1, S, t0));
        let usage = |sessions, keys, bytes| Tally {
            sessions,
            keys,
            bytes,
        };
        assert_eq!(table.usage("batch"), usage(3, 0, 0));
        let hold = Grant::hold(&name("jobs/x"), lockcell_cell::Mode::Exclusive, "a", 7)
            .with_value_bytes(10);
        let hold_bytes = hold.bytes() as i64;
        assert_eq!(hold_bytes, hold.key.len() as i64 + 10);
        assert!(table.record_grant("a", 1, hold.clone(), None));
        assert!(table.record_grant("a", 1, hold, None), "recorded twice");
        let member = |written, value| {
            Grant::ephemeral(&name("members/a"), 8, written).with_value_bytes(value)
        };
        assert!(table.record_grant("b", 1, member(8, 1000), None));
        let member_key = member(8, 0).key.len() as i64;
        assert_eq!(
            table.usage("batch"),
            usage(3, 2, hold_bytes + member_key + 1000)
        );
        // A later write of the same ephemeral key replaces the record, and its bytes.
        assert!(table.record_grant("b", 1, member(9, 3), None));
        assert_eq!(
            table.usage("batch"),
            usage(3, 2, hold_bytes + member_key + 3)
        );
        assert_eq!(
            table
                .get("b", t0)
                .unwrap()
                .adds(&member(9, 3).key, member_key as u64 + 50),
            (0, 47),
            "a rewrite adds only the bytes past the record's"
        );
        let held_key = name("jobs/x").holder_key(lockcell_cell::Mode::Exclusive, "a");
        table.forget_grant("a", &held_key, 7);
        assert_eq!(
            table.usage("batch"),
            usage(3, 1, member_key + 3),
            "a release"
        );
        table.close("c", None).unwrap();
        assert_eq!(table.usage("batch"), usage(2, 1, member_key + 3), "a close");
        assert_eq!(table.take_on_lease(2, "lost".into(), t0).len(), 1);
        assert_eq!(
            table.usage("batch"),
            usage(1, 0, 0),
            "a lost lease, with its key"
        );
        assert_eq!(table.take_expired(t0 + 2 * S).len(), 2);
        assert_eq!(table.usage("batch"), usage(0, 0, 0), "an expiry");
        assert!(
            table.tally.is_empty(),
            "nothing kept for an identity with nothing"
        );
    }

    #[test]
    fn a_key_lost_by_other_means_leaves_its_sessions_records_and_tally() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        let mut owned = session("a", 1, S, t0);
        owned.principal = Some("batch".into());
        table.insert(owned);
        let name = lockcell_cell::LockName::parse("members/a").unwrap();
        let member = Grant::ephemeral(&name, 8, 9).with_value_bytes(100);
        let key = member.key.clone();
        assert!(table.record_grant("a", 1, member, None));
        assert_eq!(table.usage("batch").keys, 1);
        table.forget_lost(&key, 8, 9);
        assert_eq!(
            table.usage("batch").keys,
            1,
            "a delete at the write's own revision is no later"
        );
        table.forget_lost(&key, 7, 12);
        assert_eq!(
            table.usage("batch").keys,
            1,
            "another key of that name (created at 7)"
        );
        table.forget_lost(&key, 8, 12);
        assert_eq!(
            table.usage("batch"),
            Tally {
                sessions: 1,
                keys: 0,
                bytes: 0
            }
        );
        assert!(table.get("a", t0).unwrap().held.is_empty());
        assert!(table.ephemeral.is_empty(), "nothing left in the index");
        // Rewritten after the loss: the session's again, and indexed again.
        assert!(table.record_grant("a", 1, Grant::ephemeral(&name, 13, 13), None));
        assert_eq!(table.usage("batch").keys, 1);
        table.close("a", None).unwrap();
        assert!(
            table.ephemeral.is_empty(),
            "a closed session leaves nothing indexed"
        );
    }

    #[test]
    fn another_identity_cannot_renew_a_session() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        let mut owned = session("a", 1, S, t0);
        owned.principal = Some("billing".into());
        table.insert(owned);
        assert!(table.renew("a", Some("billing"), t0, |_| S).is_ok());
        assert!(matches!(
            table.renew("a", Some("stranger"), t0, |_| S),
            Err(Gone::Unknown)
        ));
        assert!(
            table.renew("a", None, t0, |_| S).is_ok(),
            "grants off: no owner check"
        );
    }

    #[test]
    fn renewal_postpones_expiry() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 1, 3 * S, t0));
        table.insert(session("b", 1, 3 * S, t0));
        assert!(table.renew("a", None, t0 + 2 * S, |_| S).is_ok());
        let expired = table.take_expired(t0 + 3 * S);
        assert_eq!(expired.iter().map(|s| &*s.id).collect::<Vec<_>>(), ["b"]);
        assert!(table.take_expired(t0 + 4 * S).is_empty());
        assert_eq!(table.take_expired(t0 + 5 * S).len(), 1);
        assert!(table.is_empty());
    }

    #[test]
    fn expired_and_unknown_are_told_apart() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 1, S, t0));
        assert!(
            matches!(
                table.renew("a", None, t0 + 2 * S, |_| S),
                Err(Gone::Expired(_))
            ),
            "past deadline, not yet reaped"
        );
        table.take_expired(t0 + 2 * S);
        assert!(matches!(
            table.renew("a", None, t0 + 2 * S, |_| S),
            Err(Gone::Expired(_))
        ));
        assert_eq!(table.renew("zz", None, t0, |_| S), Err(Gone::Unknown));
        table.prune_tombstones(t0 + 2 * S + TOMBSTONE_RETENTION);
        assert_eq!(table.renew("a", None, t0, |_| S), Err(Gone::Unknown));
    }

    #[test]
    fn grants_follow_the_session() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 1, S, t0));
        let lock = lockcell_cell::LockName::parse("x").unwrap();
        let hold = Grant::hold(&lock, lockcell_cell::Mode::Exclusive, "a", 5);
        let waiter = Grant::waiting(&lock, lockcell_cell::Mode::Shared, "a", 4);
        assert!(table.record_grant("a", 1, waiter.clone(), None));
        assert_eq!(table.holders_valid_until(), None, "a waiter holds nothing");
        assert!(table.record_grant("a", 1, hold.clone(), Some(t0 + S)));
        assert!(
            table.record_grant("a", 1, hold.clone(), Some(t0 + S)),
            "idempotent"
        );
        assert_eq!(
            table.get("a", t0).unwrap().held,
            vec![waiter.clone(), hold.clone()]
        );
        assert!(table.holds("a", &hold.key, 5) && !table.holds("a", &hold.key, 6));
        assert_eq!(table.holders_valid_until(), Some(t0 + S));
        table.renew("a", None, t0 + S / 2, |_| S).unwrap();
        assert_eq!(
            table.holders_valid_until(),
            Some(t0 + S + S / 2),
            "renewals extend it"
        );
        // A key written at 7, taken from the session at 8 and written again at 9: the
        // write at 9 stays, whichever is learnt first.
        let early = Grant::etcd_api_key("/k/e".into(), 7, 7);
        let again = Grant::etcd_api_key("/k/e".into(), 7, 9);
        assert!(table.record_grant("a", 1, early.clone(), None));
        assert!(table.record_grant("a", 1, again.clone(), None));
        table.forget_detached("a", "/k/e", 7, 8);
        assert!(
            table.holds("a", "/k/e", 7),
            "the write after the detach was forgotten"
        );
        table.forget_detached("a", "/k/e", 7, 10);
        assert!(!table.holds("a", "/k/e", 7));
        table.forget_grant("a", &hold.key, 5);
        table.forget_grant("a", &waiter.key, 4);
        assert!(table.get("a", t0).unwrap().held.is_empty());
        assert_eq!(table.holders_valid_until(), None);
        assert!(!table.record_grant("nobody", 1, hold.clone(), None));
        assert!(
            !table.record_grant("a", 2, hold, None),
            "a grant made in another stay of the session is not this stay's"
        );
    }

    #[test]
    fn a_session_outlives_the_validity_granted_to_it() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 1, 3 * S, t0));
        // Renewed at 2 s, then a grant at 2.9 s valid for a full TTL (to 5.9 s); the
        // client renews no more (paused).
        table.renew("a", None, t0 + 2 * S, |_| 3 * S).unwrap();
        let lock = lockcell_cell::LockName::parse("x").unwrap();
        let hold = Grant::hold(&lock, lockcell_cell::Mode::Exclusive, "a", 5);
        let until = t0 + 2 * S + S * 9 / 10 + 3 * S;
        assert!(table.record_grant("a", 1, hold, Some(until)));
        assert!(
            table.take_expired(t0 + 5 * S).is_empty(),
            "a TTL after the last renewal, the client may still act on its grant"
        );
        assert!(table.take_expired(until - S / 10).is_empty());
        assert_eq!(table.take_expired(until).len(), 1);
    }

    #[test]
    fn a_session_resuming_here_again_knows_the_leases_its_other_stays_used() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 1, 9 * S, t0));
        assert_eq!(table.stay_leases("a"), vec![1], "the live stay's");
        let mut again = session("a", 2, 9 * S, t0);
        again.incarnation = 2;
        assert!(table.replace(again).is_some());
        let mut leases = table.stay_leases("a");
        leases.sort();
        assert_eq!(leases, vec![1, 2], "the replaced stay's and the live one's");
        let mut refused = session("a", 3, 9 * S, t0);
        refused.incarnation = 3;
        table.replace(refused);
        assert!(table.withdraw("a", 3).is_some());
        assert!(
            !table.stay_leases("a").contains(&3),
            "a stay withdrawn before it held anything leaves nothing to avoid"
        );
        let mut moved = session("a", 4, 9 * S, t0);
        moved.incarnation = 4;
        table.replace(moved);
        let left = table.withdraw("a", 4).expect("the stay that moved away");
        table.depart(&left, t0);
        assert!(
            table.stay_leases("a").contains(&4),
            "a stay that moved away leaving clean-ups behind leaves its lease to avoid"
        );
        table.prune_tombstones(t0 + TOMBSTONE_RETENTION + S);
        assert!(table.stay_leases("a").is_empty());
    }

    #[test]
    fn losing_a_lease_takes_only_its_sessions() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 1, 9 * S, t0));
        table.insert(session("b", 2, 9 * S, t0));
        let taken = table.take_on_lease(1, "lease lost".into(), t0);
        assert_eq!(taken.len(), 1);
        assert_eq!(
            table.get("a", t0).unwrap_err(),
            Gone::Expired("lease lost".into())
        );
        assert!(table.get("b", t0).is_ok());
    }

    #[test]
    fn each_attempt_of_one_call_keeps_its_own_unsettled_record() {
        let t0 = Instant::now();
        let table = SessionTable::default();
        table.insert(session("a", 7, 10 * S, t0));
        let incarnation = table.get("a", t0).unwrap().incarnation;
        let lock = lockcell_cell::LockName::parse("jobs/x").unwrap();
        let mode = lockcell_cell::Mode::Exclusive;
        // Two attempts of call c1; the first's outcome is unknown, the second's known.
        let first = Grant::unsettled_hold(&lock, mode, "a", "c1");
        let second = Grant::unsettled_hold(&lock, mode, "a", "c1");
        assert!(table.record_grant("a", incarnation, first.clone(), None));
        assert!(table.record_grant("a", incarnation, second.clone(), None));
        table.forget("a", &second);
        assert_eq!(
            table.get("a", t0).unwrap().held,
            vec![first],
            "the first attempt's record stays: its key may still appear"
        );
    }
}
