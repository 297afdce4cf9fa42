//! The lock log: the etcd transactions that grant, release, queue and clean up locks.
//!
//! A grant is one transaction that compares the lock's holders compatible with the
//! mode asked (the whole holder range empty for exclusive, no exclusive holder for
//! shared) and puts the holder key on the session's proxy lease; the key's create
//! revision is the fencing token. Every delete is guarded by the key's create revision
//! and lease, so a delayed release or clean-up never removes a later grant's key.

use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, KvClient, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse,
};
use serde::{Deserialize, Serialize};

use crate::error::{with_timeout, CellError};
use crate::keyspace::{self, prefix_end, LockName, Mode};

/// Most guarded deletes sent in one transaction (etcd refuses more than 128 operations).
pub const MAX_DELETES_PER_TXN: usize = 64;

/// The value of a holder key: who holds the lock, for idempotent retries, for elections
/// (the leader's value) and for people reading etcd during an investigation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderRecord {
    /// The session that holds the lock.
    pub session: String,
    /// The acquire (or campaign) call that made the grant: the same call retried gets
    /// this grant back; any other call of the session is a new acquire and is refused
    /// while this grant stands (a lock is not re-entrant). Empty in records written
    /// before calls were named.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub call: String,
    /// The proxy that made the grant.
    pub proxy: String,
    /// The identity the client gave when it opened its session.
    pub identity: String,
    /// The zone of the proxy that made the grant.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    /// Whether the lock is an election (its holder is the leader).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub election: bool,
    /// Wall-clock time of the grant (milliseconds since the Unix epoch), for people only.
    pub acquired_at_ms: u64,
    /// An election leader's value (empty for plain locks).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
}

/// What an acquire transaction found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// The session holds the lock; `revision` is the holder key's create revision.
    /// `fresh` is false when the same call had already been granted it (a retry).
    Granted { revision: i64, fresh: bool },
    /// Another holder is in the way. `seen_at` is the store revision the transaction
    /// saw: any release that lets a waiter in happens after it.
    Busy { seen_at: i64 },
}

/// A holder key as read back: its record and its grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub record: HolderRecord,
    pub revision: i64,
    pub lease: i64,
}

/// A lock's holds and line, as [`LockLog::describe`] read them at `revision`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    pub holders: Vec<(Mode, Holder)>,
    /// Mode, the waiter's name (its session, a dash, a nonce) and its place.
    pub waiters: Vec<(Mode, String, i64)>,
    pub revision: i64,
}

/// Where a fair waiter stands in line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// Nobody earlier in line blocks this waiter; `seen_at` is the read's revision.
    Head { seen_at: i64 },
    /// This waiter key is the one just ahead; wait for its deletion.
    Behind { predecessor: Vec<u8>, seen_at: i64 },
}

/// Runs lock-log transactions against one etcd cluster.
#[derive(Clone)]
pub struct LockLog {
    /// Cheap to clone: a handle on the shared connection to etcd.
    kv: KvClient,
    /// Deadline for each etcd call, so a store that went away turns into an error.
    timeout: Duration,
    /// The mod revision of the epoch record this log's tokens are minted under; every
    /// grant compares it, so no grant is made after the epoch was raised.
    epoch_revision: Option<i64>,
}

impl LockLog {
    pub fn new(kv: KvClient, timeout: Duration) -> Self {
        LockLog {
            kv,
            timeout,
            epoch_revision: None,
        }
    }

    /// Grants only while the epoch record is the one written at `mod_revision`: a grant
    /// after `bump-epoch` fails with [`CellError::CellChanged`] instead of minting a
    /// token of the old epoch.
    pub fn with_epoch_guard(mut self, mod_revision: i64) -> Self {
        self.epoch_revision = Some(mod_revision);
        self
    }

    /// Grants `lock` in `mode` to `record.session` on `lease` unless a holder is in the
    /// way. With `queued` (fair classes: the waiter's id and the create revision of its
    /// waiter key) the waiter key must still be there and goes in the same transaction.
    ///
    /// Idempotent per call, never per session: the call that made the grant
    /// (`record.call`) gets it back when it asks again; any other call of a session that
    /// holds the lock, in either mode, fails with [`CellError::AlreadyHeld`] and writes
    /// nothing, since two calls sharing one grant would let one release end the other's.
    pub async fn acquire(
        &self,
        lock: &LockName,
        mode: Mode,
        lease: i64,
        record: &HolderRecord,
        queued: Option<(&str, i64)>,
        map_revision: i64,
    ) -> Result<Acquired, CellError> {
        let key = lock.holder_key(mode, &record.session);
        // The session's key in the other mode: it would hold the lock too.
        let other = lock.holder_key(mode.other(), &record.session);
        let body = serde_json::to_vec(record).expect("holder record serializes");
        let mut when = vec![
            holders_compatible(lock, mode),
            // A shared grant never writes over the session's own shared key (an
            // exclusive one is covered by the compare above).
            Compare::create_revision(key.as_bytes(), CompareOp::Equal, 0),
            map_guard(map_revision),
        ];
        let mut then = vec![
            TxnOp::put(
                key.as_bytes(),
                body,
                Some(PutOptions::new().with_lease(lease)),
            ),
            // The last clean release's marker has done its work (its write was seen).
            TxnOp::delete(lock.released_key().as_bytes(), None),
        ];
        if let Some((waiter, queued)) = queued {
            let waiter = lock.waiter_key(mode, waiter);
            when.push(Compare::create_revision(
                waiter.as_bytes(),
                CompareOp::Equal,
                queued,
            ));
            // And still on this proxy's lease: a waiter key that moved with its session
            // to another proxy is that proxy's to grant.
            when.push(Compare::lease(waiter.as_bytes(), CompareOp::Equal, lease));
            then.push(TxnOp::delete(waiter.as_bytes(), None));
        }
        let mut otherwise = vec![
            TxnOp::get(key.as_bytes(), None),
            TxnOp::get(other.as_bytes(), None),
            TxnOp::get(keyspace::shardmap_key(), None),
        ];
        if let Some(epoch_revision) = self.epoch_revision {
            let epoch = keyspace::epoch_key();
            when.push(Compare::mod_revision(
                epoch,
                CompareOp::Equal,
                epoch_revision,
            ));
            otherwise.push(TxnOp::get(epoch, None));
        }
        let txn = Txn::new().when(when).and_then(then).or_else(otherwise);
        let resp = with_timeout("acquire txn", self.timeout, self.kv.clone().txn(txn)).await?;
        // A reply without a revision would read as a grant at revision 0.
        let seen_at = resp
            .header()
            .map(|h| h.revision())
            .filter(|r| *r > 0)
            .ok_or_else(|| CellError::CorruptRecord {
                key: key.clone(),
                reason: "etcd's reply to the acquire carries no revision".to_owned(),
            })?;
        if resp.succeeded() {
            // The key was absent, so the put created it: its create revision is the
            // transaction's.
            return Ok(Acquired::Granted {
                revision: seen_at,
                fresh: true,
            });
        }
        let ops = resp.op_responses();
        self.check_epoch(&ops)?;
        check_map(&ops, map_revision)?;
        for (held_key, held_mode) in [(&key, mode), (&other, mode.other())] {
            let Some(kv) = kv_of(&ops, held_key) else {
                continue;
            };
            let held = decode(held_key, kv.value())?;
            // The exclusive key is every session's; a key on another lease is being
            // moved or cleaned up and is waited for like any holder.
            if held.session != record.session || kv.lease() != lease {
                continue;
            }
            let same_call = !held.call.is_empty()
                && held.call == record.call
                && held.election == record.election;
            if held_mode == mode && same_call {
                return Ok(Acquired::Granted {
                    revision: kv.create_revision(),
                    fresh: false,
                });
            }
            return Err(CellError::AlreadyHeld {
                lock: lock.as_str().to_owned(),
                mode: held_mode,
                revision: kv.create_revision(),
            });
        }
        Ok(Acquired::Busy { seen_at })
    }

    /// Fails when the epoch record read back by a refused grant is not the one this
    /// log mints tokens under.
    fn check_epoch(&self, ops: &[TxnOpResponse]) -> Result<(), CellError> {
        let Some(expected) = self.epoch_revision else {
            return Ok(());
        };
        let epoch = keyspace::epoch_key();
        match kv_of(ops, epoch) {
            Some(kv) if kv.mod_revision() == expected => Ok(()),
            Some(kv) => Err(CellError::CellChanged {
                reason: format!(
                    "the epoch record {epoch} was rewritten at revision {} (it was written at {expected} when this proxy started): the cell was restored and its epoch raised; restart the proxy to serve the new epoch",
                    kv.mod_revision()
                ),
            }),
            None => Err(CellError::CellChanged {
                reason: format!("the epoch record {epoch} is gone; the store is not the cell this proxy started on"),
            }),
        }
    }

    /// Whether a holder stands in the way of `mode` now, and the revision of that answer.
    /// A read, not a transaction: waiters use it to learn whether trying again is worth
    /// a proposal through the raft log.
    pub async fn is_held(&self, lock: &LockName, mode: Mode) -> Result<(bool, i64), CellError> {
        let (key, options) = match mode {
            Mode::Exclusive => {
                let (start, end) = lock.holders_range();
                (start, GetOptions::new().with_range(end).with_count_only())
            }
            Mode::Shared => (lock.exclusive_key(), GetOptions::new().with_count_only()),
        };
        let resp = with_timeout(
            "holder read",
            self.timeout,
            self.kv.clone().get(key.as_bytes(), Some(options)),
        )
        .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        Ok((resp.count() > 0, revision))
    }

    /// The exclusive holder of `lock`, if any, and the revision the read reflects.
    pub async fn exclusive_holder(
        &self,
        lock: &LockName,
    ) -> Result<(Option<Holder>, i64), CellError> {
        let key = lock.exclusive_key();
        let resp = with_timeout(
            "holder read",
            self.timeout,
            self.kv.clone().get(key.as_bytes(), None),
        )
        .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        let holder = match resp.kvs().first() {
            Some(kv) => Some(Holder {
                record: decode(&key, kv.value())?,
                revision: kv.create_revision(),
                lease: kv.lease(),
            }),
            None => None,
        };
        Ok((holder, revision))
    }

    /// Every hold of `lock` (mode, holder) and every waiter in its line (mode, the
    /// waiter's name, its place), read at one revision, which is returned too.
    pub async fn describe(&self, lock: &LockName) -> Result<Described, CellError> {
        let (start, end) = lock.holders_range();
        let held = with_timeout(
            "holders read",
            self.timeout,
            self.kv
                .clone()
                .get(start.as_bytes(), Some(GetOptions::new().with_range(end))),
        )
        .await?;
        let revision = held.header().map(|h| h.revision()).unwrap_or_default();
        let mut holders = Vec::new();
        for kv in held.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            let mode = match keyspace::parse_key(kv.key()) {
                Some((_, keyspace::KeyKind::Exclusive)) => Mode::Exclusive,
                Some((_, keyspace::KeyKind::Shared)) => Mode::Shared,
                _ => continue,
            };
            holders.push((
                mode,
                Holder {
                    record: decode(&key, kv.value())?,
                    revision: kv.create_revision(),
                    lease: kv.lease(),
                },
            ));
        }
        let exclusive = lock.exclusive_queue_prefix();
        let line = with_timeout(
            "waiters read",
            self.timeout,
            self.kv.clone().get(
                lock.queue_prefix(),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_revision(revision)
                        .with_sort(SortTarget::Create, SortOrder::Ascend),
                ),
            ),
        )
        .await?;
        let waiters = line
            .kvs()
            .iter()
            .map(|kv| {
                let mode = if kv.key().starts_with(exclusive.as_bytes()) {
                    Mode::Exclusive
                } else {
                    Mode::Shared
                };
                (
                    mode,
                    String::from_utf8_lossy(kv.value()).into_owned(),
                    kv.create_revision(),
                )
            })
            .collect();
        Ok(Described {
            holders,
            waiters,
            revision,
        })
    }

    /// Puts waiter `waiter`'s key for `mode` in line (fair classes), or finds the one it
    /// already has. `waiter` names one acquire call. Returns the key's create revision:
    /// the waiter's place in line. A key the waiter has on another lease (its session
    /// moved here from another proxy, and the call was retried) moves onto `lease` and
    /// keeps its place.
    pub async fn enqueue(
        &self,
        lock: &LockName,
        mode: Mode,
        waiter: &str,
        lease: i64,
        map_revision: i64,
    ) -> Result<i64, CellError> {
        let key = lock.waiter_key(mode, waiter);
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.as_bytes(), CompareOp::Equal, 0),
                map_guard(map_revision),
            ])
            .and_then([
                TxnOp::put(
                    key.as_bytes(),
                    waiter,
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::get(key.as_bytes(), None),
            ])
            .or_else([
                TxnOp::get(key.as_bytes(), None),
                TxnOp::get(keyspace::shardmap_key(), None),
            ]);
        let resp = with_timeout("enqueue txn", self.timeout, self.kv.clone().txn(txn)).await?;
        if !resp.succeeded() {
            check_map(&resp.op_responses(), map_revision)?;
        }
        match first_kv(&resp.op_responses()) {
            Some(kv) if kv.lease() == lease => Ok(kv.create_revision()),
            Some(kv) if kv.value() == waiter.as_bytes() => {
                let place = Grant::waiting(lock, mode, waiter, kv.create_revision());
                match self
                    .move_keys(&[(place.clone(), kv.lease())], lease)
                    .await?[..]
                {
                    [Ok(_)] => Ok(place.revision),
                    // Left the line meanwhile (granted, or taken out): queue afresh.
                    _ => Box::pin(self.enqueue(lock, mode, waiter, lease, map_revision)).await,
                }
            }
            Some(kv) => Err(CellError::CorruptRecord {
                key,
                reason: format!(
                    "waiter key is on lease {:x}, not the waiter's {lease:x}",
                    kv.lease()
                ),
            }),
            None => Err(CellError::CorruptRecord {
                key,
                reason: "waiter key did not read back".to_owned(),
            }),
        }
    }

    /// Where the waiter queued at `queued` for `mode` stands: an exclusive waiter is
    /// behind every earlier waiter, a shared one only behind earlier exclusive waiters.
    /// Earlier waiters only ever leave the line, so the answer cannot be overtaken by a
    /// later arrival.
    pub async fn place(
        &self,
        lock: &LockName,
        mode: Mode,
        queued: i64,
    ) -> Result<Place, CellError> {
        let prefix = match mode {
            Mode::Exclusive => lock.queue_prefix(),
            Mode::Shared => lock.exclusive_queue_prefix(),
        };
        let options = GetOptions::new()
            .with_range(prefix_end(prefix.as_bytes()))
            .with_max_create_revision(queued - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1)
            .with_keys_only();
        let resp = with_timeout(
            "queue read",
            self.timeout,
            self.kv.clone().get(prefix.as_bytes(), Some(options)),
        )
        .await?;
        let seen_at = resp.header().map(|h| h.revision()).unwrap_or_default();
        Ok(match resp.kvs().first() {
            Some(kv) => Place::Behind {
                predecessor: kv.key().to_vec(),
                seen_at,
            },
            None => Place::Head { seen_at },
        })
    }

    /// `session`'s `mode` hold of `lock` on `lease`, if it has one: the caller compares
    /// its call with the record's (a retried call finds its grant without joining the
    /// line; another call of the session is refused).
    pub async fn held_by(
        &self,
        lock: &LockName,
        mode: Mode,
        session: &str,
        lease: i64,
    ) -> Result<Option<Holder>, CellError> {
        let key = lock.holder_key(mode, session);
        let resp = with_timeout(
            "holder read",
            self.timeout,
            self.kv.clone().get(key.as_bytes(), None),
        )
        .await?;
        for kv in resp.kvs() {
            let record = decode(&key, kv.value())?;
            if kv.lease() == lease && record.session == session {
                return Ok(Some(Holder {
                    record,
                    revision: kv.create_revision(),
                    lease: kv.lease(),
                }));
            }
        }
        Ok(None)
    }

    /// Whether waiter `waiter` is still in line at `queued` on `lease`.
    pub async fn in_line(
        &self,
        lock: &LockName,
        mode: Mode,
        waiter: &str,
        queued: i64,
        lease: i64,
    ) -> Result<bool, CellError> {
        let key = lock.waiter_key(mode, waiter);
        let resp = with_timeout(
            "queue read",
            self.timeout,
            self.kv.clone().get(key.as_bytes(), None),
        )
        .await?;
        Ok(resp
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == queued && kv.lease() == lease))
    }

    /// Takes a waiter out of line (it gave up), if it is still the one queued at `queued`.
    pub async fn dequeue(
        &self,
        lock: &LockName,
        mode: Mode,
        waiter: &str,
        queued: i64,
    ) -> Result<bool, CellError> {
        let key = lock.waiter_key(mode, waiter);
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.as_bytes(),
                CompareOp::Equal,
                queued,
            )])
            .and_then([TxnOp::delete(key.as_bytes(), None)]);
        let resp = with_timeout("dequeue txn", self.timeout, self.kv.clone().txn(txn)).await?;
        Ok(resp.succeeded())
    }

    /// Releases `session`'s `mode` hold of `lock` if it is still the grant made at
    /// `revision` on `lease`, writing the release marker in the same revision: it tells
    /// lock-delay and the audit trail a clean release from a vanished holder. Returns
    /// the marker it wrote ([`Grant::release_marker`]) when it deleted the hold.
    pub async fn release(
        &self,
        lock: &LockName,
        mode: Mode,
        session: &str,
        revision: i64,
        lease: i64,
    ) -> Result<Option<Grant>, CellError> {
        let hold = Grant::hold(lock, mode, session, revision);
        let txn = guarded_delete(&hold, lease, true);
        let resp = with_timeout("release txn", self.timeout, self.kv.clone().txn(txn)).await?;
        Ok(resp
            .succeeded()
            .then(|| Grant::release_marker(lock, txn_revision(&resp).unwrap_or_default())))
    }

    /// Replaces the value of an exclusive grant (an election leader's Proclaim), if the
    /// grant is still `revision` on `lease`. The key keeps its create revision.
    pub async fn rewrite(
        &self,
        lock: &LockName,
        revision: i64,
        lease: i64,
        record: &HolderRecord,
    ) -> Result<bool, CellError> {
        let key = lock.exclusive_key();
        let body = serde_json::to_vec(record).expect("holder record serializes");
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.as_bytes(), CompareOp::Equal, revision),
                Compare::lease(key.as_bytes(), CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::put(
                key.as_bytes(),
                body,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let resp = with_timeout("proclaim txn", self.timeout, self.kv.clone().txn(txn)).await?;
        Ok(resp.succeeded())
    }

    /// Moves `keys`, each from the lease it is on (the second of each pair), onto lease
    /// `to`, each under its own guard: still the grant (its create revision, or for an
    /// ephemeral key its mod revision, see [`Grant::written`]) and its lease the one
    /// given. A move keeps the key's value and create revision, so fencing tokens do not
    /// change. A key already on `to`, still the grant, counts as moved. Returns what
    /// became of each key.
    pub async fn move_keys(&self, keys: &[(Grant, i64)], to: i64) -> Result<Vec<Moved>, CellError> {
        let mut outcomes = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(MAX_DELETES_PER_TXN) {
            let txn = Txn::new().and_then(moves(chunk, to));
            let resp = with_timeout("move txn", self.timeout, self.kv.clone().txn(txn)).await?;
            let revision = txn_revision(&resp)?;
            outcomes.extend(move_outcomes(chunk, &resp.op_responses(), revision));
        }
        Ok(outcomes)
    }

    /// Moves a resuming session's `keys` onto lease `to` (as [`move_keys`]), fenced: the
    /// first transaction compares the session's fence (`/s/<session>`) with `fence`,
    /// the mod revision the client last heard of (0: none yet), and puts it on `to` at a
    /// new revision; later transactions (over 64 keys) compare that new revision. So a
    /// resume the client gave up on (its reply lost) can never land after a later one.
    ///
    /// [`move_keys`]: LockLog::move_keys
    pub async fn resume(
        &self,
        session: &LockName,
        fence: i64,
        keys: &[(Grant, i64)],
        to: i64,
        proxy: &str,
    ) -> Result<Resume, CellError> {
        self.resume_guarded(session, fence, keys, to, proxy, None)
            .await
    }

    /// [`resume`](LockLog::resume), with one more guard on the first transaction: the
    /// key `guard` names is still at that mod revision, and is deleted by the move (a
    /// hand-off record, which only one move may take). A guard that fails reads as
    /// [`Resume::FenceMoved`]: nothing moved.
    pub async fn resume_guarded(
        &self,
        session: &LockName,
        fence: i64,
        keys: &[(Grant, i64)],
        to: i64,
        proxy: &str,
        guard: Option<(&str, i64)>,
    ) -> Result<Resume, CellError> {
        let fence_key = crate::keyspace::session_fence_key(session.as_str());
        let mut chunks = keys.chunks(MAX_DELETES_PER_TXN);
        let first = chunks.next().unwrap_or(&[]);
        let compare = if fence == 0 {
            Compare::create_revision(fence_key.as_bytes(), CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(fence_key.as_bytes(), CompareOp::Equal, fence)
        };
        let mut then = vec![
            TxnOp::put(
                fence_key.as_bytes(),
                proxy,
                Some(PutOptions::new().with_lease(to)),
            ),
            TxnOp::get(fence_key.as_bytes(), None),
        ];
        then.extend(moves(first, to));
        let mut when = vec![compare];
        if let Some((key, revision)) = guard {
            when.push(Compare::mod_revision(key, CompareOp::Equal, revision));
            then.push(TxnOp::delete(key, None));
        }
        let txn = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([TxnOp::get(fence_key.as_bytes(), None)]);
        let resp = match with_timeout("resume txn", self.timeout, self.kv.clone().txn(txn)).await {
            // Turned away before it was proposed: nothing moved.
            Err(e) if e.turned_away() => return Ok(Resume::TurnedAway(e.to_string())),
            other => other?,
        };
        let ops = resp.op_responses();
        let found = first_kv(&ops).map(|kv| (kv.mod_revision(), kv.create_revision(), kv.lease()));
        if !resp.succeeded() {
            if let Some(reason) = first_kv(&ops).and_then(ended) {
                return Ok(Resume::Ended { reason });
            }
            let (revision, _, lease) = found.unwrap_or_default();
            return Ok(Resume::FenceMoved { revision, lease });
        }
        let (revision, created, _) = found.ok_or_else(|| CellError::CorruptRecord {
            key: fence_key.clone(),
            reason: "the session fence did not read back".to_owned(),
        })?;
        let mut outcomes: Vec<Moved> =
            move_outcomes(first, &ops[2..], txn_revision(&resp)?).collect();
        for chunk in chunks {
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    fence_key.as_bytes(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then(moves(chunk, to))
                .or_else([TxnOp::get(fence_key.as_bytes(), None)]);
            let resp = with_timeout("resume txn", self.timeout, self.kv.clone().txn(txn)).await?;
            if !resp.succeeded() {
                if let Some(reason) = first_kv(&resp.op_responses()).and_then(ended) {
                    return Ok(Resume::Ended { reason });
                }
                let now = first_kv(&resp.op_responses()).map(|kv| (kv.mod_revision(), kv.lease()));
                let (revision, lease) = now.unwrap_or_default();
                return Ok(Resume::FenceMoved { revision, lease });
            }
            let revision = txn_revision(&resp)?;
            outcomes.extend(move_outcomes(chunk, &resp.op_responses(), revision));
        }
        Ok(Resume::Moved {
            fence: Grant::fence(session, created),
            fence_revision: revision,
            outcomes,
        })
    }

    /// Marks `session` ended by an operator for `reason`: its fence (on `lease`, the
    /// session's lease here) says so, and since every resume compares the fence, no
    /// proxy takes the session again, this one included. Returns the fence's create
    /// revision when this write created it (the session never moved), for its clean-up.
    pub async fn end_fence(
        &self,
        session: &LockName,
        lease: i64,
        reason: &str,
    ) -> Result<Option<i64>, CellError> {
        let key = crate::keyspace::session_fence_key(session.as_str());
        let resp = with_timeout(
            "end session fence",
            self.timeout,
            self.kv.clone().put(
                key,
                format!("{ENDED}{reason}"),
                Some(PutOptions::new().with_lease(lease).with_prev_key()),
            ),
        )
        .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        Ok(resp.prev_key().is_none().then_some(revision))
    }

    /// Deletes every grant still on `lease`, each under its own guard, in as few
    /// transactions as etcd allows. `clean` marks the deletes as releases (a closed
    /// session) rather than a holder that vanished (an expired one), for lock-delay.
    /// Returns how many keys it deleted, and the release markers it wrote.
    ///
    /// A grant whose outcome was unknown (revision 0, see [`Grant::unsettled_hold`]) is
    /// read first and deleted only if it turns out to be that call's key on `lease`.
    pub async fn delete_guarded(
        &self,
        grants: &[Grant],
        lease: i64,
        clean: bool,
    ) -> Result<Deleted, CellError> {
        let (unknown, mut grants): (Vec<Grant>, Vec<Grant>) =
            grants.iter().cloned().partition(Grant::is_unsettled);
        for found in self.settle(&unknown, lease).await? {
            if !grants.contains(&found) {
                grants.push(found);
            }
        }
        let mut deleted = Deleted::default();
        for chunk in grants.chunks(MAX_DELETES_PER_TXN) {
            // One release marker per lock per transaction: etcd refuses a request that
            // writes one key twice, nested transactions included (a session can name
            // two holds of one lock when a release's reply was lost).
            let mut marked = std::collections::HashSet::new();
            let marks: Vec<bool> = chunk
                .iter()
                .map(|g| clean && !g.waiter && marked.insert(&g.lock))
                .collect();
            let nested: Vec<TxnOp> = chunk
                .iter()
                .zip(&marks)
                .map(|(g, mark)| TxnOp::txn(guarded_delete(g, lease, *mark)))
                .collect();
            let txn = Txn::new().and_then(nested);
            let resp = with_timeout("clean-up txn", self.timeout, self.kv.clone().txn(txn)).await?;
            // (A reply without a revision, which etcd never sends, leaves the markers be:
            // a guard on revision 0 holds for no key.)
            let revision = txn_revision(&resp).unwrap_or_default();
            for ((g, mark), op) in chunk.iter().zip(&marks).zip(resp.op_responses()) {
                if !matches!(op, TxnOpResponse::Txn(t) if t.succeeded()) {
                    continue;
                }
                deleted.keys += 1;
                if *mark {
                    deleted
                        .markers
                        .push(Grant::release_marker(&g.lock, revision));
                }
            }
        }
        Ok(deleted)
    }
}

/// What [`LockLog::delete_guarded`] did: how many keys it deleted, and the release
/// markers it wrote (see [`Grant::release_marker`]).
#[derive(Debug, Default)]
pub struct Deleted {
    pub keys: usize,
    pub markers: Vec<Grant>,
}

impl LockLog {}

/// A key a session has in etcd: a holder key (a grant), a waiter key of a fair class,
/// or an ephemeral key, with its create revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The lock (or, for an ephemeral key, the key's name).
    pub lock: LockName,
    pub key: String,
    /// The key's create revision; 0 while unsettled (see `made_by`).
    pub revision: i64,
    /// For an ephemeral key: the mod revision of the session's own last write of it (or
    /// of the move that brought it to the session's lease), which its clean-up and its
    /// moves compare. Any session may write a small key, and a write keeps the key's
    /// create revision and (from a session on the same proxy lease) its lease, so only
    /// the mod revision tells that no one wrote the key since. 0 for holder and waiter
    /// keys: only a grant creates them, so their create revision is theirs alone.
    pub written: i64,
    /// Not a hold (a waiter key or an ephemeral key): deleting it releases nothing.
    pub waiter: bool,
    /// Set while the transaction that would create the key has an unknown outcome (sent,
    /// not answered in time): the call it belongs to, so that reading the key tells
    /// whether it is this call's. Such a key is still the session's to delete.
    pub made_by: Option<MadeBy>,
    /// The length of the key's value as the session wrote it, for its identity's
    /// `bytes` limit; 0 where the session never wrote it here (a fence, a waiter key,
    /// a key a resume brought along).
    pub value_bytes: u64,
}

/// The name the keys etcd's own API writes with a lease are reported under in their
/// session's records ([`Grant::etcd_api_key`]): their own keys are any bytes.
pub const ETCD_API_KEYS: &str = "etcd-api";

/// The call behind an unsettled key, and what the key, found, must show to be its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MadeBy {
    pub session: String,
    pub proof: Proof,
    /// Tells two attempts of one call apart, so that the record of one whose outcome
    /// is still unknown is never taken for (and forgotten with) another's.
    pub attempt: u64,
}

/// What a key found after an unknown outcome shows when it is the call's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// A holder key: its record names the session and this acquire's call id.
    Call(String),
    /// A waiter key: its value is this waiter id.
    Waiter(String),
    /// An ephemeral key: its value has this SHA-256. Nothing in etcd names a small
    /// key's writer, so a write of the same value by another session on the same
    /// lease reads the same.
    Value([u8; 32]),
}

impl MadeBy {
    fn new(session: &str, proof: Proof) -> MadeBy {
        MadeBy {
            session: session.to_owned(),
            proof,
            attempt: rand::random(),
        }
    }

    /// Whether `value`, found at `key`, is what this call wrote.
    fn shown_by(&self, key: &str, value: &[u8]) -> bool {
        match &self.proof {
            Proof::Call(call) => {
                decode(key, value).is_ok_and(|r| r.session == self.session && r.call == *call)
            }
            Proof::Waiter(waiter) => value == waiter.as_bytes(),
            Proof::Value(digest) => value_digest(value) == *digest,
        }
    }
}

impl LockLog {
    /// Reads each unsettled grant in `unknown` and returns, with its create revision,
    /// every one that turns out to exist on `lease` as its call's key; the others were
    /// never made (or are gone).
    pub async fn settle(&self, unknown: &[Grant], lease: i64) -> Result<Vec<Grant>, CellError> {
        let mut found = Vec::new();
        for grant in unknown {
            let Some(made_by) = &grant.made_by else {
                continue;
            };
            let resp = with_timeout(
                "settle read",
                self.timeout,
                self.kv.clone().get(grant.key.as_bytes(), None),
            )
            .await?;
            let Some(kv) = resp.kvs().first().filter(|kv| kv.lease() == lease) else {
                continue;
            };
            if made_by.shown_by(&grant.key, kv.value()) {
                found.push(Grant {
                    revision: kv.create_revision(),
                    written: if grant.written_guard() {
                        kv.mod_revision()
                    } else {
                        0
                    },
                    made_by: None,
                    ..grant.clone()
                });
            }
        }
        Ok(found)
    }
}

impl Grant {
    /// The fence of `session` (its id, which follows the name rules), created at
    /// `revision`: deleted with the session's keys where the session ends.
    pub fn fence(session: &LockName, revision: i64) -> Grant {
        Grant {
            lock: session.clone(),
            key: crate::keyspace::session_fence_key(session.as_str()),
            revision,
            waiter: true,
            written: 0,
            made_by: None,
            value_bytes: 0,
        }
    }

    /// An ephemeral key `name` created at `revision`, last written by the session (or
    /// moved to its lease) at `written`.
    pub fn ephemeral(name: &LockName, revision: i64, written: i64) -> Grant {
        Grant {
            lock: name.clone(),
            key: crate::keyspace::kv_key(name),
            revision,
            waiter: true,
            written,
            made_by: None,
            value_bytes: 0,
        }
    }
}

impl Grant {
    /// The release marker a clean release of `lock` wrote at `revision` on the holder's
    /// lease. Only its write is ever read (as a watch event, see [`guarded_delete`]), so
    /// its proxy deletes it afterwards, guarded by that revision: without that, each
    /// lock name ever released would leave a marker until its proxy's lease ends.
    pub fn release_marker(lock: &LockName, revision: i64) -> Grant {
        Grant {
            lock: lock.clone(),
            key: lock.released_key(),
            revision,
            waiter: true,
            written: revision,
            made_by: None,
            value_bytes: 0,
        }
    }

    pub fn hold(lock: &LockName, mode: Mode, session: &str, revision: i64) -> Grant {
        Grant {
            lock: lock.clone(),
            key: lock.holder_key(mode, session),
            revision,
            waiter: false,
            written: 0,
            made_by: None,
            value_bytes: 0,
        }
    }

    pub fn waiting(lock: &LockName, mode: Mode, waiter: &str, revision: i64) -> Grant {
        Grant {
            lock: lock.clone(),
            key: lock.waiter_key(mode, waiter),
            revision,
            waiter: true,
            written: 0,
            made_by: None,
            value_bytes: 0,
        }
    }

    /// The hold call `call` of `session` asks for, before etcd has answered: recorded
    /// in the session first, so that a grant whose answer never arrives is still the
    /// session's (deleted when it ends, after a read shows it is this call's).
    pub fn unsettled_hold(lock: &LockName, mode: Mode, session: &str, call: &str) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Call(call.to_owned()))),
            ..Grant::hold(lock, mode, session, 0)
        }
    }

    /// The waiter key `waiter` of `session` before etcd has answered its enqueue.
    pub fn unsettled_waiter(lock: &LockName, mode: Mode, session: &str, waiter: &str) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Waiter(waiter.to_owned()))),
            ..Grant::waiting(lock, mode, waiter, 0)
        }
    }

    /// A key written with a lease through etcd's own API: its etcd key `key` (under
    /// `/k/`, or a record of the session's), which need not follow the lock-name rules.
    /// Only the key and its revisions guard and delete it; its `lock` is
    /// [`ETCD_API_KEYS`], the name such keys are reported under.
    pub fn etcd_api_key(key: String, revision: i64, written: i64) -> Grant {
        Grant {
            lock: LockName::parse(ETCD_API_KEYS).expect("a valid name"),
            key,
            revision,
            waiter: true,
            written,
            made_by: None,
            value_bytes: 0,
        }
    }

    /// The key `key` that `session` writes `value` to through etcd's own API, before
    /// etcd has answered the write (see [`Grant::etcd_api_key`]).
    pub fn unsettled_etcd_api_key(key: String, session: &str, value: &[u8]) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Value(value_digest(value)))),
            value_bytes: value.len() as u64,
            ..Grant::etcd_api_key(key, 0, 0)
        }
    }

    /// The ephemeral key `name` that `session` writes `value` to, before etcd has
    /// answered the write.
    pub fn unsettled_ephemeral(name: &LockName, session: &str, value: &[u8]) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Value(value_digest(value)))),
            value_bytes: value.len() as u64,
            ..Grant::ephemeral(name, 0, 0)
        }
    }

    /// The client lease record of a key written through etcd's own API (see
    /// `keyspace::etcd_leased_root`), which goes wherever the key goes.
    fn lease_record(&self) -> Option<Vec<u8>> {
        if self.lock.as_str() != ETCD_API_KEYS {
            return None;
        }
        crate::keyspace::etcd_leased_key(self.key.as_bytes())
    }

    /// This record, of a key whose value is `value_bytes` long.
    pub fn with_value_bytes(self, value_bytes: usize) -> Grant {
        Grant {
            value_bytes: value_bytes as u64,
            ..self
        }
    }

    /// What the key takes in etcd, as far as its session knows: its name and value.
    pub fn bytes(&self) -> u64 {
        self.key.len() as u64 + self.value_bytes
    }

    /// Whether the key's outcome is still unknown.
    pub fn is_unsettled(&self) -> bool {
        self.made_by.is_some()
    }

    /// Whether the key is guarded by the session's last write of it (an ephemeral key)
    /// rather than by its create revision alone.
    pub fn written_guard(&self) -> bool {
        self.written != 0 || matches!(&self.made_by, Some(m) if matches!(m.proof, Proof::Value(_)))
    }

    /// The compares that hold while the key is still this record's on `lease`: for an
    /// ephemeral key, no one has written it since the session did; for any other, it is
    /// the same grant (create revision).
    fn unchanged(&self, lease: i64) -> [Compare; 2] {
        let key = self.key.as_bytes();
        let revision = if self.written != 0 {
            Compare::mod_revision(key, CompareOp::Equal, self.written)
        } else {
            Compare::create_revision(key, CompareOp::Equal, self.revision)
        };
        [revision, Compare::lease(key, CompareOp::Equal, lease)]
    }
}

/// How an unsettled ephemeral write knows its value again (see [`Proof::Value`]).
fn value_digest(value: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(value).into()
}

/// The compare that lets `mode` in: no holder at all for exclusive, no exclusive holder
/// for shared. A range compare holds only when every key in the range satisfies it, and
/// an empty range compares as an absent key.
fn holders_compatible(lock: &LockName, mode: Mode) -> Compare {
    match mode {
        Mode::Exclusive => {
            let (start, end) = lock.holders_range();
            Compare::create_revision(start.as_bytes(), CompareOp::Equal, 0)
                .with_range(end.as_bytes())
        }
        Mode::Shared => {
            Compare::create_revision(lock.exclusive_key().as_bytes(), CompareOp::Equal, 0)
        }
    }
}

/// The compare every grant and write makes: the cell's copy of the shard map is still
/// the one the proxy checked the name against (mod revision 0: the cell has none). A
/// prefix that starts to move pauses in its cell by a write of that copy, which fails
/// every grant in flight there.
pub fn map_guard(map_revision: i64) -> Compare {
    Compare::mod_revision(keyspace::shardmap_key(), CompareOp::Equal, map_revision)
}

/// Fails with [`CellError::MapChanged`] when a refused transaction read back a shard map
/// copy other than the one it was guarded by.
pub fn check_map(ops: &[TxnOpResponse], map_revision: i64) -> Result<(), CellError> {
    let now = kv_of(ops, keyspace::shardmap_key())
        .map(|kv| kv.mod_revision())
        .unwrap_or_default();
    if now == map_revision {
        Ok(())
    } else {
        Err(CellError::MapChanged { now })
    }
}

/// Delete `grant`'s key only while it is still that grant on `lease` (for an ephemeral
/// key: no one wrote it since the session did, see [`Grant::written`]); a clean release
/// also writes the lock's release marker in the same revision. Only that write is read
/// (as a watch event); the marker itself lives on the holder's lease and is deleted by
/// its proxy afterwards ([`Grant::release_marker`]), or by the next grant of the lock,
/// so markers never pile up.
fn guarded_delete(grant: &Grant, lease: i64, clean: bool) -> Txn {
    let mut then = vec![TxnOp::delete(grant.key.as_bytes(), None)];
    // A key of the etcd API goes with its client lease record.
    if let Some(record) = grant.lease_record() {
        then.push(TxnOp::delete(record, None));
    }
    if clean {
        then.push(TxnOp::put(
            grant.lock.released_key().as_bytes(),
            grant.revision.to_string(),
            Some(PutOptions::new().with_lease(lease)),
        ));
    }
    let txn = Txn::new().when(grant.unchanged(lease)).and_then(then);
    match grant.lease_record().filter(|_| grant.written != 0) {
        // The key was written since by a write that left its record alone (lockcell's
        // own API): the record is still about the session's write, and goes with it.
        Some(record) => txn.or_else([TxnOp::txn(
            Txn::new()
                .when([Compare::mod_revision(
                    record.as_slice(),
                    CompareOp::Equal,
                    grant.written,
                )])
                .and_then([TxnOp::delete(record, None)]),
        )]),
        None => txn,
    }
}

/// What a fenced resume did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The fence now has `fence_revision`; per key, what became of it. `fence` is the
    /// fence key as a grant of the session (deleted with its keys when the session ends
    /// here).
    Moved {
        fence: Grant,
        fence_revision: i64,
        outcomes: Vec<Moved>,
    },
    /// The fence is at `revision` on `lease`, not what the client said: a resume it did
    /// not hear the end of landed. Nothing moved.
    FenceMoved { revision: i64, lease: i64 },
    /// An operator ended the session (see [`LockLog::end_fence`]), for `reason`:
    /// nothing moved, and no proxy takes the session again.
    Ended { reason: String },
    /// etcd turned the first transaction away (too busy): nothing moved.
    TurnedAway(String),
}

/// What became of one key a move named: on the new lease, with (for an ephemeral key,
/// see [`Grant::written`]) the mod revision it has there now, 0 for any other key; or
/// lost, with what was found instead.
pub type Moved = Result<i64, String>;

/// The nested move transactions of `keys` onto `to`.
fn moves(keys: &[(Grant, i64)], to: i64) -> Vec<TxnOp> {
    keys.iter()
        .map(|(g, from)| TxnOp::txn(guarded_move(g, *from, to)))
        .collect()
}

/// What each move of `keys` did, from the nested transactions' responses in the
/// transaction of `revision`.
fn move_outcomes<'a>(
    keys: &'a [(Grant, i64)],
    ops: &'a [TxnOpResponse],
    revision: i64,
) -> impl Iterator<Item = Moved> + 'a {
    keys.iter()
        .zip(ops)
        .map(move |((grant, _), op)| move_outcome(grant, op, revision))
}

/// A `from` lease that marks a key as not the moving session's own: it is only read,
/// never moved, and reported lost (no lease has this id).
pub const NOT_ITS_OWN: i64 = -1;

/// Already on `to`, still the grant's (see [`Grant::unchanged`]): nothing to do.
/// Otherwise, on `from` and still the grant's: put it on `to`, keeping its value.
/// Otherwise read it, to say what became of it. A key marked [`NOT_ITS_OWN`] is only
/// read, even if it is on `to` already (another session of the same lease bucket holds
/// it).
fn guarded_move(grant: &Grant, from: i64, to: i64) -> Txn {
    let key = grant.key.as_str();
    let unchanged = |lease| grant.unchanged(lease);
    if from == NOT_ITS_OWN {
        let read = Txn::new()
            .when(unchanged(NOT_ITS_OWN))
            .or_else([TxnOp::get(key.as_bytes(), None)]);
        return Txn::new()
            .when(unchanged(NOT_ITS_OWN))
            .or_else([TxnOp::txn(read)]);
    }
    let mut then = vec![TxnOp::put(
        key.as_bytes(),
        Vec::new(),
        Some(PutOptions::new().with_lease(to).with_ignore_value()),
    )];
    // A key of the etcd API takes its client lease record along (rewritten in the same
    // revision, on no lease as ever), when the record is about the session's write of
    // the key (it is, unless the key was written before proxies kept records).
    if let Some(record) = grant.lease_record().filter(|_| grant.written != 0) {
        let along = Txn::new()
            .when([Compare::mod_revision(
                record.as_slice(),
                CompareOp::Equal,
                grant.written,
            )])
            .and_then([TxnOp::put(
                record.as_slice(),
                Vec::new(),
                Some(PutOptions::new().with_ignore_value()),
            )]);
        then.push(TxnOp::txn(along));
    }
    let take = Txn::new()
        .when(unchanged(from))
        .and_then(then)
        .or_else([TxnOp::get(key.as_bytes(), None)]);
    Txn::new().when(unchanged(to)).or_else([TxnOp::txn(take)])
}

/// What a [`guarded_move`] in the transaction of `revision` did, from its response.
fn move_outcome(grant: &Grant, op: &TxnOpResponse, revision: i64) -> Moved {
    let shape = || "the move transaction answered out of shape".to_owned();
    let TxnOpResponse::Txn(outer) = op else {
        return Err(shape());
    };
    if outer.succeeded() {
        // There already: unchanged.
        return Ok(grant.written);
    }
    let inner = outer.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Txn(inner) => Some(inner),
        _ => None,
    });
    let Some(inner) = inner else {
        return Err(shape());
    };
    if inner.succeeded() {
        // Put on the new lease in this transaction: written at its revision.
        return Ok(if grant.written != 0 { revision } else { 0 });
    }
    Err(match first_kv(&inner.op_responses()) {
        None => format!("{} is gone", grant.key),
        Some(kv) if kv.create_revision() != grant.revision => format!(
            "{} was created again at revision {} (held at {})",
            grant.key,
            kv.create_revision(),
            grant.revision
        ),
        Some(kv) if grant.written != 0 && kv.mod_revision() != grant.written => format!(
            "{} was written again at revision {} (by this session at {})",
            grant.key,
            kv.mod_revision(),
            grant.written
        ),
        // The lease is not said: lease ids are no one else's business.
        Some(_) => format!(
            "{} is another session's, or on a lease this session does not have",
            grant.key
        ),
    })
}

/// The revision of a transaction's reply (for one that wrote: the revision it wrote at).
fn txn_revision(resp: &etcd_client::TxnResponse) -> Result<i64, CellError> {
    resp.header()
        .map(|h| h.revision())
        .filter(|r| *r > 0)
        .ok_or_else(|| CellError::CorruptRecord {
            key: "move txn".to_owned(),
            reason: "etcd's reply carries no revision".to_owned(),
        })
}

/// The key-value `key` read by one of `ops`, if it was there.
fn kv_of<'a>(ops: &'a [TxnOpResponse], key: &str) -> Option<&'a etcd_client::KeyValue> {
    ops.iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().filter(|kv| kv.key() == key.as_bytes()),
        _ => None,
    })
}

/// The value of a session fence an operator ended: this prefix, then why.
const ENDED: &str = "!ended ";

/// Why the session of `fence` was ended, if an operator ended it.
fn ended(fence: &etcd_client::KeyValue) -> Option<String> {
    let value = std::str::from_utf8(fence.value()).ok()?;
    value.strip_prefix(ENDED).map(str::to_owned)
}

fn first_kv(ops: &[TxnOpResponse]) -> Option<&etcd_client::KeyValue> {
    ops.iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first(),
        _ => None,
    })
}

fn decode(key: &str, value: &[u8]) -> Result<HolderRecord, CellError> {
    serde_json::from_slice(value).map_err(|e| CellError::CorruptRecord {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}
