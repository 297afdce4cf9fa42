//! The lock log: the etcd transactions that grant, release, queue and clean up locks.
//!
//! A grant is one transaction that compares the lock's holders compatible with the
//! mode asked (the whole holder range empty for exclusive, no exclusive holder for
//! shared) and puts the holder key on the session's proxy lease; the key's create
//! revision is the fencing token. Every delete is guarded by the key's create revision
//! and lease, so a delayed release or clean-up never removes a later grant's key.
//!
//! # Layout
//! - this module: [`LockLog`], one thin async call per transaction or read, and the
//!   records they return;
//! - `txn`: the grant transaction built and read as pure functions, and the compares
//!   and reply readers every transaction shares;
//! - `line`: a fair class's waiting line (waiter keys);
//! - `moves`: keys moving between leases (a session resuming on another proxy);
//! - `cleanup`: guarded deletes (releases, ended sessions) and unsettled keys;
//! - `grant`: [`Grant`], what a session holds in etcd;
//! - `store`: [`LockStore`], the calls the log makes of etcd, and `memory`, a store
//!   that answers them as etcd does, in memory, for tests without etcd.

use std::time::Duration;

use std::sync::Arc;

use etcd_client::{
    Compare, CompareOp, GetOptions, KvClient, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use serde::{Deserialize, Serialize};

use crate::error::{with_timeout, CellError};
use crate::keyspace::{self, LockName, Mode};

mod cleanup;
mod grant;
mod line;
pub mod memory;
mod moves;
#[cfg(test)]
mod over_memory;
mod store;
mod txn;

pub use cleanup::Deleted;
pub use grant::{Grant, MadeBy, Proof, ETCD_API_KEYS};
pub use moves::{Moved, Resume, NOT_ITS_OWN};
pub use store::{LockStore, StoreFuture};
pub use txn::{check_map, map_guard};
use txn::{decode, guarded_delete, txn_revision};

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
    /// Cheap to clone: etcd's client (a handle on the shared connection), or another
    /// store that answers as etcd does.
    kv: Arc<dyn LockStore>,
    /// Deadline for each etcd call, so a store that went away turns into an error.
    timeout: Duration,
    /// The mod revision of the epoch record this log's tokens are minted under; every
    /// grant compares it, so no grant is made after the epoch was raised.
    epoch_revision: Option<i64>,
}

impl LockLog {
    pub fn new(kv: KvClient, timeout: Duration) -> Self {
        Self::over(Arc::new(kv), timeout)
    }

    /// A lock log over `store` (see [`memory::MemoryStore`] for tests without etcd).
    pub fn over(store: Arc<dyn LockStore>, timeout: Duration) -> Self {
        LockLog {
            kv: store,
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
        let shape = txn::GrantTxn {
            lock,
            mode,
            lease,
            record,
            queued,
            map_revision,
            epoch_revision: self.epoch_revision,
        };
        let resp = with_timeout("acquire txn", self.timeout, self.kv.txn(shape.txn())).await?;
        shape.read(&resp)
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
            self.kv.get(key.as_bytes().to_vec(), Some(options)),
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
            self.kv.get(key.as_bytes().to_vec(), None),
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
            self.kv.get(
                start.as_bytes().to_vec(),
                Some(GetOptions::new().with_range(end)),
            ),
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
            self.kv.get(
                lock.queue_prefix().into_bytes(),
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
        let resp = with_timeout("release txn", self.timeout, self.kv.txn(txn)).await?;
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
        let resp = with_timeout("proclaim txn", self.timeout, self.kv.txn(txn)).await?;
        Ok(resp.succeeded())
    }
}
