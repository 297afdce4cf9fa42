//! etcd API leases across a drain or a restart of their proxy.
//!
//! A lockcell SDK client moves its session itself (a Resume, see
//! [`crate::handover`]); an etcd client knows nothing of that. So a draining proxy hands
//! each of its etcd API leases over in etcd: one record per lease,
//! `/s/!etcd-handoff/<id>`, put on the proxy lease the session's keys are on, naming
//! its owner, TTL, keys and session fence ([`Record`]). The proxy then renews the lease
//! no more and ends its keepalive streams; the client's next call, on whichever proxy
//! it reaches (another endpoint, or this address once the proxy is back), takes the
//! lease over ([`EtcdApi::take_over`]).
//!
//! A take-over is a resume done by the proxy for the client: the keys move onto the new
//! proxy's lease in the resume's transactions (each key guarded by its revision and its
//! lease, the session fence by its revision), and the first also compares the record's
//! revision and deletes it, so one proxy takes a lease, once. The handing proxy deletes
//! a record that nobody took before the lease lapses, under the same compare, and only
//! then lets the session expire as any other: a lease is taken over or expires, never
//! both. A proxy that stops leaves the proxy lease of records not yet taken to run out
//! rather than revoking it ([`SessionTable::handed_off_leases`]), so the client has
//! until then (at most the proxy lease TTL) to reach a proxy; each record also carries
//! the wall-clock time its lease lapses, past which no proxy takes it.
//!
//! A running proxy hands one lease over the same way when another proxy asks for it,
//! to run a Txn writing with leases of several proxies ([`EtcdApi::hand_over_one`]);
//! the asking proxy takes it over at once.
//!
//! [`SessionTable::handed_off_leases`]: crate::sessions::SessionTable::handed_off_leases

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace;
use lockcell_cell::locklog::{Grant, Resume};
use lockcell_cell::LockName;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tonic::Status;

use super::ids::{lease_of, session_of, LEASE_NOT_FOUND};
use super::EtcdApi;
use crate::metrics as m;
use crate::sessions::Session;

mod take;

/// How often a draining proxy looks for its records taken, and for leases about to
/// lapse.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// How often a proxy that handed a lease to a proxy that asked for it looks for its
/// record taken: calls on the lease wait for that.
const FOLLOW_ASKED_EVERY: Duration = Duration::from_millis(20);

/// A record not taken is deleted this long before its lease lapses here, so the delete
/// lands before the session expires.
const LAPSE_MARGIN: Duration = Duration::from_secs(1);

/// Records written per transaction.
const RECORDS_PER_TXN: usize = 64;

/// An etcd API lease handed over: what the proxy that takes it needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The proxy that handed it over.
    pub proxy: String,
    pub identity: String,
    /// The identity that owns the lease when proxies check grants: only it takes it.
    pub principal: Option<String>,
    pub ttl_ms: u64,
    /// How long, from the record's writing, the client may still act on the handing
    /// proxy's word: the taking proxy's lease must outlive that.
    pub acting_for_ms: u64,
    /// When the lease lapses on the handing proxy's word (ms since 1970, wall clock):
    /// no proxy takes it after that.
    pub lapses_at_unix_ms: u64,
    /// The proxy lease the keys are on.
    pub lease: i64,
    /// The session fence's mod revision; 0 when the lease never moved before.
    pub fence: i64,
    pub keys: Vec<RecordKey>,
}

/// One key of a lease handed over: its etcd key, create revision and the mod revision
/// of the lease's last write of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordKey {
    pub key: String,
    pub revision: i64,
    pub written: i64,
}

impl Record {
    /// The record of `session`, handed over at `now` by proxy `proxy`, with its session
    /// fence at `fence`. Keys whose write has no answer yet stay with the handing proxy
    /// (its clean-up settles them); so does the fence, which a take-over writes anew.
    pub fn of(session: &Session, proxy: &str, fence: i64, now: Instant) -> Record {
        let fence_key = keyspace::session_fence_key(&session.id);
        let keys = session
            .held
            .iter()
            .filter(|g| !g.is_unsettled() && g.key != fence_key)
            .map(|g| RecordKey {
                key: g.key.clone(),
                revision: g.revision,
                written: g.written,
            })
            .collect();
        let lapses_in = session.lapses_at().saturating_duration_since(now);
        Record {
            proxy: proxy.to_owned(),
            identity: session.identity.clone(),
            principal: session.principal.as_deref().map(str::to_owned),
            ttl_ms: session.ttl().as_millis() as u64,
            acting_for_ms: session
                .life
                .valid_until()
                .saturating_duration_since(now)
                .as_millis() as u64,
            lapses_at_unix_ms: unix_ms(SystemTime::now() + lapses_in),
            lease: session.lease,
            fence,
            keys,
        }
    }

    /// The keys to move, each from the lease it is on.
    fn moving(&self) -> Vec<(Grant, i64)> {
        self.keys
            .iter()
            .map(|k| {
                let grant = Grant::etcd_api_key(k.key.clone(), k.revision, k.written);
                (grant, self.lease)
            })
            .collect()
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a take-over found.
pub enum TakeOver {
    /// The lease is here now.
    Taken(Session),
    /// No record to take: the lease is unknown (never handed over, taken by another
    /// proxy, or lapsed).
    NoRecord,
}

impl EtcdApi {
    /// Hands every etcd API lease of this proxy over (see the module doc), once the
    /// proxy starts draining, and follows the records until the proxy stops.
    pub(super) async fn hand_off_on_drain(self) {
        let mut drain = self.state.drain.subscribe();
        if drain.wait_for(|d| *d).await.is_err() {
            return;
        }
        let written = self.hand_off(|_| true).await;
        metrics::counter!(m::ETCD_API_LEASES_HANDED_OFF).increment(written.len() as u64);
        tracing::info!(
            leases = written.len(),
            "etcd API leases handed over to the next proxy their clients reach"
        );
        self.handed_off.send_replace(true);
        self.follow(written, None).await;
    }

    /// Hands lease `id`, which lives here, over to the proxy that asked for it (a Txn
    /// writing with leases of several proxies runs where all of them are, see
    /// [`EtcdApi::gather`]), and follows its record until that proxy takes it.
    ///
    /// [`EtcdApi::gather`]: super::EtcdApi::gather
    pub(super) async fn hand_over_one(&self, id: i64) -> Result<(), Status> {
        let written = self.hand_off(|s| lease_of(&s.id) == Some(id)).await;
        if !written.contains_key(&id) {
            return Err(Status::unavailable(format!(
                "etcdserver: lease {id:x} could not be handed to the proxy that asked for it; try again"
            )));
        }
        metrics::counter!(m::ETCD_API_LEASES_HANDED_OFF).increment(1);
        // The asking proxy takes it at once; a record it never took is withdrawn well
        // before the lease lapses, and the lease renewed here again.
        let until = Instant::now() + self.state.config.etcd_timeout * 2;
        let api = self.clone();
        tokio::spawn(async move { api.follow(written, Some(until)).await });
        Ok(())
    }

    /// Waits while lease `id` is on its way from this proxy to one that asked for it
    /// ([`Self::hand_over_one`]), until the asking proxy took it or its record was
    /// withdrawn: a call on the lease then runs where the lease ended up. Returns at
    /// once for a lease not handed over, or handed over by a draining proxy.
    pub(super) async fn hand_over_settled(&self, id: i64) {
        let state = &self.state;
        let session = session_of(id);
        if state.is_draining() || !state.sessions.is_handed_off(&session) {
            return;
        }
        let until = Instant::now() + state.config.etcd_timeout * 3;
        let mut look = tokio::time::interval(FOLLOW_ASKED_EVERY);
        while state.sessions.is_handed_off(&session) && Instant::now() < until {
            look.tick().await;
        }
    }

    /// The sessions to hand off with their unanswered writes settled: a write whose
    /// answer never came may have landed (a lock key a retry then stood on), so it is
    /// read, and named in the record if it did. A session whose writes cannot be read
    /// stays here.
    async fn settled(&self, sessions: Vec<Session>) -> Vec<Session> {
        let state = &self.state;
        let mut settled = Vec::with_capacity(sessions.len());
        for mut s in sessions {
            let unsettled: Vec<Grant> = s
                .held
                .iter()
                .filter(|g| g.is_unsettled())
                .cloned()
                .collect();
            if unsettled.is_empty() {
                settled.push(s);
                continue;
            }
            match state.locklog.settle(&unsettled, s.lease).await {
                Ok(found) => {
                    s.held.retain(|g| !g.is_unsettled());
                    s.held.extend(found);
                    settled.push(s);
                }
                Err(error) => {
                    tracing::warn!(%error, session = %s.id, "could not read a lease's unanswered writes; it stays here");
                    state.sessions.keep(&s.id);
                }
            }
        }
        settled
    }

    /// Marks the etcd API sessions `pick` chooses handed off, once no leased write is on
    /// its way, and writes their records. Returns each recorded session's record
    /// revision, by lease.
    async fn hand_off(&self, pick: impl Fn(&Session) -> bool) -> HashMap<i64, (Session, i64)> {
        let state = &self.state;
        let sessions = {
            // Waits for the leased writes on their way: each records its key in its
            // session before letting go, so the records below name every key.
            let _no_writes = self.writes.write().await;
            state
                .sessions
                .hand_off(|s| lease_of(&s.id).is_some() && pick(s))
        };
        let mut written = HashMap::new();
        if sessions.is_empty() {
            return written;
        }
        let sessions = self.settled(sessions).await;
        let now = Instant::now();
        for chunk in sessions.chunks(RECORDS_PER_TXN) {
            let mut puts = Vec::with_capacity(chunk.len());
            for s in chunk {
                let id = lease_of(&s.id).expect("picked as an etcd API lease");
                let fence = self.fences.get(&id).map_or(0, |f| *f);
                let record = Record::of(s, &state.proxy_id, fence, now);
                let body = serde_json::to_vec(&record).expect("a record serializes");
                puts.push(TxnOp::put(
                    keyspace::etcd_lease_handoff_key(id),
                    body,
                    Some(PutOptions::new().with_lease(s.lease)),
                ));
            }
            let sent = with_timeout(
                "hand etcd API leases over",
                state.config.etcd_timeout,
                state.etcd.kv_client().txn(Txn::new().and_then(puts)),
            )
            .await;
            match sent {
                Ok(done) => {
                    let revision = done.header().map_or(0, |h| h.revision());
                    for s in chunk {
                        let id = lease_of(&s.id).expect("an etcd API lease");
                        written.insert(id, (s.clone(), revision));
                    }
                }
                // Not handed over: those leases stay here, and end with the proxy.
                Err(error) => {
                    tracing::warn!(
                        %error,
                        leases = chunk.len(),
                        "could not hand etcd API leases over; they stay here"
                    );
                    for s in chunk {
                        state.sessions.keep(&s.id);
                    }
                }
            }
        }
        written
    }

    /// Until every record is taken or withdrawn: drops the sessions whose record another
    /// proxy took, and deletes the record of each lease about to lapse here (or still
    /// not taken at `until`), so that it expires here instead.
    async fn follow(&self, mut written: HashMap<i64, (Session, i64)>, until: Option<Instant>) {
        let state = &self.state;
        let mut tick = tokio::time::interval(match until {
            Some(_) => FOLLOW_ASKED_EVERY,
            None => FOLLOW_EVERY,
        });
        while !written.is_empty() {
            tick.tick().await;
            let present = match self.records_present().await {
                Ok(present) => present,
                Err(error) => {
                    tracing::debug!(%error, "could not read the hand-off records");
                    continue;
                }
            };
            let now = Instant::now();
            let mut done = Vec::new();
            for (id, (session, revision)) in &written {
                if !present.contains_key(id) || present[id] != *revision {
                    self.taken_away(session);
                    done.push(*id);
                } else if session.expires_at().saturating_duration_since(now) < LAPSE_MARGIN
                    || until.is_some_and(|until| now >= until)
                {
                    match self.withdraw_record(*id, *revision).await {
                        // Left here, where it expires as any session; a proxy that
                        // is not draining renews it again (no proxy can take it now).
                        Ok(true) => {
                            if !state.is_draining() {
                                state.sessions.keep(&session.id);
                            }
                            done.push(*id)
                        }
                        Ok(false) => {
                            self.taken_away(session);
                            done.push(*id);
                        }
                        Err(error) => {
                            tracing::warn!(%error, lease = format_args!("{id:x}"), "could not withdraw a hand-off record")
                        }
                    }
                }
            }
            for id in done {
                written.remove(&id);
            }
            state.publish_sessions_open();
        }
    }

    /// The hand-off records in etcd: their mod revision, by lease.
    async fn records_present(&self) -> Result<HashMap<i64, i64>, lockcell_cell::CellError> {
        let root = keyspace::etcd_lease_handoff_root();
        let records = self.state.keys_under("read hand-off records", root).await?;
        Ok(records
            .iter()
            .filter_map(|kv| {
                let hex = kv.key().strip_prefix(root.as_bytes())?;
                let id = i64::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
                Some((id, kv.mod_revision()))
            })
            .collect())
    }

    /// Deletes lease `id`'s record if it is still at `revision`: true if it was (no
    /// proxy can take the lease now), false if it was not there.
    async fn withdraw_record(
        &self,
        id: i64,
        revision: i64,
    ) -> Result<bool, lockcell_cell::CellError> {
        let key = keyspace::etcd_lease_handoff_key(id);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.as_str(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::delete(key.as_str(), None)]);
        let state = &self.state;
        let done = with_timeout(
            "withdraw a hand-off record",
            state.config.etcd_timeout,
            state.etcd.kv_client().txn(txn),
        )
        .await?;
        Ok(done.succeeded())
    }

    /// Forgets a session another proxy took over: its keys are on that proxy's lease
    /// now. Keys whose write had no answer are still this proxy's to settle.
    fn taken_away(&self, session: &Session) {
        let state = &self.state;
        if let Some(left) = state.sessions.withdraw(&session.id, session.incarnation) {
            state.leases.unassign(left.bucket);
            if left.held.iter().any(Grant::is_unsettled) {
                // Clean-ups guarded by its lease stay behind: a later stay avoids it.
                state.sessions.depart(&left, Instant::now());
            }
            let unsettled = left.held.into_iter().filter(Grant::is_unsettled).collect();
            state.cleanup.push(left.lease, unsettled);
        }
        if let Some(id) = lease_of(&session.id) {
            self.fences.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn session(held: Vec<Grant>) -> Session {
        let now = Instant::now();
        Session::arriving(
            Arc::from("6c63000000010002"),
            "app".into(),
            Duration::from_secs(10),
            (0, 77),
            held,
            now,
            now + Duration::from_secs(3),
        )
    }

    #[test]
    fn a_record_names_the_settled_keys_but_not_the_fence() {
        let fence = Grant::fence(&LockName::parse("6c63000000010002").unwrap(), 40);
        let settled = Grant::etcd_api_key("/k/a".into(), 10, 12);
        let unsettled = Grant::unsettled_etcd_api_key("/k/b".into(), "6c63000000010002", b"v");
        let record = Record::of(
            &session(vec![fence, settled, unsettled]),
            "p1",
            41,
            Instant::now(),
        );
        assert_eq!(
            record.keys,
            vec![RecordKey {
                key: "/k/a".into(),
                revision: 10,
                written: 12
            }]
        );
        assert_eq!(
            (record.lease, record.fence, record.ttl_ms),
            (77, 41, 10_000)
        );
        assert!(
            (2_900..=3_000).contains(&record.acting_for_ms),
            "{}",
            record.acting_for_ms
        );
        let later = unix_ms(SystemTime::now() + Duration::from_secs(9));
        assert!(
            record.lapses_at_unix_ms >= later,
            "lapses a TTL after the renewal"
        );
    }

    #[test]
    fn a_record_moves_each_key_from_the_lease_it_names() {
        let record = Record::of(
            &session(vec![Grant::etcd_api_key("/k/a".into(), 10, 12)]),
            "p1",
            0,
            Instant::now(),
        );
        let round: Record = serde_json::from_slice(&serde_json::to_vec(&record).unwrap()).unwrap();
        assert_eq!(round, record);
        assert_eq!(
            round.moving(),
            vec![(Grant::etcd_api_key("/k/a".into(), 10, 12), 77)]
        );
    }
}
