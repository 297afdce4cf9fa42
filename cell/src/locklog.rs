//! The lock log: the etcd transactions that grant, release and clean up exclusive locks.
//!
//! Every grant is one transaction that compares the lock's whole holder range empty and
//! puts the holder key on the session's proxy lease; the key's create revision is the
//! fencing token. Every delete is guarded by the holder key's create revision and lease,
//! so a delayed release or clean-up can never remove a later holder's key.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KvClient, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};

use crate::error::{with_timeout, CellError};
use crate::keyspace::{prefix_end, LockName};

/// Most guarded deletes sent in one transaction (etcd refuses more than 128 operations).
pub const MAX_DELETES_PER_TXN: usize = 64;

/// The value of a holder key: who holds the lock, for idempotent retries and for people
/// reading etcd during an investigation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderRecord {
    /// The session that holds the lock; a retried acquire by it gets the same grant.
    pub session: String,
    /// The proxy that made the grant.
    pub proxy: String,
    /// The identity the client gave when it opened its session.
    pub identity: String,
    /// Wall-clock time of the grant (milliseconds since the Unix epoch), for people only.
    pub acquired_at_ms: u64,
}

/// What an acquire transaction found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// The session holds the lock; `revision` is the holder key's create revision.
    /// `fresh` is false when the session already held it (a retried acquire).
    Granted { revision: i64, fresh: bool },
    /// Another holder has it. `seen_at` is the store revision the transaction saw:
    /// any release that lets a waiter in happens after it.
    Busy { seen_at: i64 },
}

/// Runs lock-log transactions against one etcd cluster.
#[derive(Clone)]
pub struct LockLog {
    /// Cheap to clone: a handle on the shared connection to etcd.
    kv: KvClient,
    /// Deadline for each etcd call, so a store that went away turns into an error.
    timeout: Duration,
}

impl LockLog {
    pub fn new(kv: KvClient, timeout: Duration) -> Self {
        LockLog { kv, timeout }
    }

    /// Grants `lock` exclusively to `record.session` on `lease`, unless another holder
    /// (exclusive or shared) has it. Idempotent for the session that holds it.
    pub async fn acquire_exclusive(
        &self,
        lock: &LockName,
        lease: i64,
        record: &HolderRecord,
    ) -> Result<Acquired, CellError> {
        let prefix = lock.holders_prefix();
        let key = lock.exclusive_key();
        let body = serde_json::to_vec(record).expect("holder record serializes");
        let txn = Txn::new()
            // A range compare: true only when no key at all lies in the holder range.
            .when([
                Compare::create_revision(prefix.as_bytes(), CompareOp::Equal, 0)
                    .with_range(prefix_end(prefix.as_bytes())),
            ])
            .and_then([TxnOp::put(
                key.as_bytes(),
                body,
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key.as_bytes(), None)]);
        let resp = with_timeout("acquire txn", self.timeout, self.kv.clone().txn(txn)).await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        if resp.succeeded() {
            // The put is the transaction's only write, so it was created at the revision
            // the transaction produced.
            return Ok(Acquired::Granted {
                revision,
                fresh: true,
            });
        }
        for op in resp.op_responses() {
            let TxnOpResponse::Get(get) = op else {
                continue;
            };
            let Some(kv) = get.kvs().first() else {
                continue;
            };
            let holder: HolderRecord =
                serde_json::from_slice(kv.value()).map_err(|e| CellError::CorruptRecord {
                    key: key.clone(),
                    reason: e.to_string(),
                })?;
            if holder.session == record.session && kv.lease() == lease {
                return Ok(Acquired::Granted {
                    revision: kv.create_revision(),
                    fresh: false,
                });
            }
        }
        Ok(Acquired::Busy { seen_at: revision })
    }

    /// Whether `lock` has any holder now, and the store revision that answer is from.
    /// A read, not a transaction: waiters use it to learn whether trying again is
    /// worth a proposal through the raft log.
    pub async fn is_held(&self, lock: &LockName) -> Result<(bool, i64), CellError> {
        let prefix = lock.holders_prefix();
        let options = GetOptions::new()
            .with_range(prefix_end(prefix.as_bytes()))
            .with_count_only();
        let resp = with_timeout(
            "holder read",
            self.timeout,
            self.kv.clone().get(prefix.as_bytes(), Some(options)),
        )
        .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        Ok((resp.count() > 0, revision))
    }

    /// Deletes the exclusive holder key of `lock` if it is still the grant made at
    /// `revision` on `lease`. Returns whether it deleted it.
    pub async fn release(
        &self,
        lock: &LockName,
        revision: i64,
        lease: i64,
    ) -> Result<bool, CellError> {
        let txn = guarded_delete(lock, revision, lease);
        let resp = with_timeout("release txn", self.timeout, self.kv.clone().txn(txn)).await?;
        Ok(resp.succeeded())
    }

    /// Deletes every `(lock, revision)` grant still on `lease`, each under its own guard,
    /// in as few transactions as etcd allows. Returns how many keys it deleted.
    pub async fn delete_guarded(
        &self,
        grants: &[(LockName, i64)],
        lease: i64,
    ) -> Result<usize, CellError> {
        let mut deleted = 0;
        for chunk in grants.chunks(MAX_DELETES_PER_TXN) {
            let nested: Vec<TxnOp> = chunk
                .iter()
                .map(|(lock, revision)| TxnOp::txn(guarded_delete(lock, *revision, lease)))
                .collect();
            let txn = Txn::new().and_then(nested);
            let resp = with_timeout("clean-up txn", self.timeout, self.kv.clone().txn(txn)).await?;
            deleted += resp
                .op_responses()
                .iter()
                .filter(|op| matches!(op, TxnOpResponse::Txn(t) if t.succeeded()))
                .count();
        }
        Ok(deleted)
    }
}

/// Delete the exclusive key of `lock` only while it is the grant `revision` on `lease`.
fn guarded_delete(lock: &LockName, revision: i64, lease: i64) -> Txn {
    let key = lock.exclusive_key();
    Txn::new()
        .when([
            Compare::create_revision(key.as_bytes(), CompareOp::Equal, revision),
            Compare::lease(key.as_bytes(), CompareOp::Equal, lease),
        ])
        .and_then([TxnOp::delete(key.as_bytes(), None)])
}
