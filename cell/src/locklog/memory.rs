//! A [`LockStore`] that answers as one etcd member does, in memory, for tests of the
//! lock log and of the proxy's runtime above it that run without etcd (and with paused
//! time). End-to-end tests stay on real etcd; one of them (`memory_store` in the e2e
//! suite) sends a seeded run of requests to etcd and to this store and compares every
//! answer.
//!
//! What it keeps of etcd's semantics: one revision per write transaction, shared by
//! every key it writes; create and mod revisions and versions; every version of every
//! key, so a read at a past revision sees that revision; compares over a key or a range
//! (a value compare on no key fails); ranges with limits, sorts and revision filters as
//! etcd applies them (equal keys stay in key order, either way; with no sort order
//! named, a limit reads its keys in key order before a target's default sort; a
//! count-only range tells no `more`); nested transactions whose compares all see the
//! state before the transaction. And etcd's refusals, in etcd's order, before anything
//! is written: its API's first (an empty key, a value with `ignore_value`, a lease with
//! `ignore_lease`, more than [`MAX_TXN_OPS`] operations, a request that writes one key
//! twice), then on the branches taken a put on a lease that does not exist or keeping
//! the value or lease of a key that is not there, then a read of a revision still to
//! come. As in etcd's check, a delete from a key onwards (range end `\0`) counts as
//! writing no key twice.
//!
//! What it does not keep: compaction, watches, auth, lease TTLs (a lease lives until
//! [`MemoryStore::revoke_lease`]), another `--max-txn-ops`. Nor what etcd does with two
//! requests its callers must not send: a delete whose range ends before its key (etcd's
//! check for a key written twice then depends on the shape of its interval tree), and a
//! put keeping a key's value or lease after a delete from a key onwards removed the key
//! in the same transaction (etcd stops with a panic).
//!
//! Faults a test can set: a store that answers nothing ([`MemoryStore::set_down`]),
//! writes applied whose answers are lost ([`MemoryStore::lose_answers`]), and
//! transactions held in flight until the test lets them through
//! ([`MemoryStore::hold_txns`]), to order two calls that race.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use etcd_client::proto::{PbEvent, PbKeyValue, PbTxnOpResponse, PbTxnRequest, PbTxnResponse};
use etcd_client::{
    EventType, GetOptions, GetResponse, PutOptions, PutResponse, Txn, TxnOp, TxnResponse,
};
use tonic::Status;

use super::store::{LockStore, StoreFuture};

mod eval;

/// etcd's words for the refusals it shares with this store.
pub const DUPLICATE_KEY: &str = "etcdserver: duplicate key given in txn request";
pub const LEASE_NOT_FOUND: &str = "etcdserver: requested lease not found";
pub const FUTURE_REVISION: &str = "etcdserver: mvcc: required revision is a future revision";
pub const EMPTY_KEY: &str = "etcdserver: key is not provided";
pub const KEY_NOT_FOUND: &str = "etcdserver: key not found";
pub const VALUE_PROVIDED: &str = "etcdserver: value is provided";
pub const LEASE_PROVIDED: &str = "etcdserver: lease is provided";
pub const TOO_MANY_OPS: &str = "etcdserver: too many operations in txn request";

/// Most compares, or operations of a branch, in a transaction: etcd's default
/// `--max-txn-ops`. A nested transaction has what its parent leaves.
pub const MAX_TXN_OPS: usize = 128;

/// One etcd member's key space, in memory.
pub struct MemoryStore {
    inner: Mutex<Inner>,
    /// Open while true: held transactions wait for it ([`MemoryStore::hold_txns`]).
    gate: tokio::sync::watch::Sender<bool>,
}

#[derive(Default)]
struct Inner {
    revision: i64,
    /// Every version of every key, oldest first; `None` marks a deletion.
    history: BTreeMap<Vec<u8>, Vec<(i64, Option<PbKeyValue>)>>,
    leases: BTreeSet<i64>,
    down: bool,
    lose_answers: usize,
    /// How many of the next transactions are held at the gate, and how many wait there.
    to_hold: usize,
    at_gate: usize,
    writes: u64,
}

/// Which call a request came as: a lone put looks its lease up before its key, as
/// etcd's applier does; a get is no write.
#[derive(Clone, Copy, PartialEq)]
enum Call {
    Get,
    Put,
    Txn,
}

/// A key range as etcd names one: one key (no end), every key from `key` (end `\0`), or
/// `[key, end)`.
struct Span<'a> {
    key: &'a [u8],
    end: &'a [u8],
}

impl Span<'_> {
    fn holds(&self, k: &[u8]) -> bool {
        match self.end {
            [] => k == self.key,
            [0] => k >= self.key,
            end => k >= self.key && k < end,
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        MemoryStore {
            inner: Mutex::new(Inner {
                revision: 1,
                ..Inner::default()
            }),
            gate: tokio::sync::watch::Sender::new(true),
        }
    }

    /// Makes lease `id` exist, as a grant in etcd does.
    pub fn grant_lease(&self, id: i64) {
        self.inner.lock().expect("store").leases.insert(id);
    }

    /// Revokes lease `id`: its keys go, in one revision. Returns how many.
    pub fn revoke_lease(&self, id: i64) -> usize {
        let mut inner = self.inner.lock().expect("store");
        inner.leases.remove(&id);
        let keys: Vec<Vec<u8>> = inner
            .current()
            .filter(|kv| kv.lease == id)
            .map(|kv| kv.key.clone())
            .collect();
        if !keys.is_empty() {
            inner.revision += 1;
            let at = inner.revision;
            for key in &keys {
                inner
                    .history
                    .entry(key.clone())
                    .or_default()
                    .push((at, None));
            }
        }
        keys.len()
    }

    /// While `down`, every call fails as if etcd could not be reached, and writes
    /// nothing.
    pub fn set_down(&self, down: bool) {
        self.inner.lock().expect("store").down = down;
    }

    /// The next `n` writes are applied, and their answers lost: the caller gets an
    /// error and does not know the outcome.
    pub fn lose_answers(&self, n: usize) {
        self.inner.lock().expect("store").lose_answers = n;
    }

    /// Holds the next `n` transactions in flight, unapplied, until [`release`]: each is
    /// applied when let through, in the order they are polled, as etcd applies a
    /// request that was slow to arrive.
    ///
    /// [`release`]: MemoryStore::release
    pub fn hold_txns(&self, n: usize) {
        self.inner.lock().expect("store").to_hold = n;
        self.gate.send_replace(false);
    }

    /// Lets every held transaction through.
    pub fn release(&self) {
        self.gate.send_replace(true);
    }

    /// How many transactions wait at the gate now.
    pub fn at_gate(&self) -> usize {
        self.inner.lock().expect("store").at_gate
    }

    /// The store's revision now.
    pub fn revision(&self) -> i64 {
        self.inner.lock().expect("store").revision
    }

    /// How many transactions and puts were applied (answered or not).
    pub fn writes(&self) -> u64 {
        self.inner.lock().expect("store").writes
    }

    /// The keys under `prefix` now, in key order.
    pub fn keys_under(&self, prefix: &str) -> Vec<PbKeyValue> {
        let inner = self.inner.lock().expect("store");
        inner
            .current()
            .filter(|kv| kv.key.starts_with(prefix.as_bytes()))
            .cloned()
            .collect()
    }

    /// Key `key` now, if it is there.
    pub fn key(&self, key: &str) -> Option<PbKeyValue> {
        let inner = self.inner.lock().expect("store");
        inner.at(key.as_bytes(), inner.revision).cloned()
    }

    /// What a watch of every key would have told after revision `after`, in order: a
    /// put with its key, a delete with the key and the revision that deleted it.
    pub fn events_after(&self, after: i64) -> Vec<etcd_client::Event> {
        let inner = self.inner.lock().expect("store");
        let mut events: Vec<(i64, PbEvent)> = Vec::new();
        for (key, versions) in &inner.history {
            for (at, kv) in versions.iter().filter(|(at, _)| *at > after) {
                let event = match kv {
                    Some(kv) => PbEvent {
                        r#type: EventType::Put as i32,
                        kv: Some(kv.clone()),
                        prev_kv: None,
                    },
                    None => PbEvent {
                        r#type: EventType::Delete as i32,
                        kv: Some(PbKeyValue {
                            key: key.clone(),
                            mod_revision: *at,
                            ..PbKeyValue::default()
                        }),
                        prev_kv: None,
                    },
                };
                events.push((*at, event));
            }
        }
        events.sort_by_key(|(at, _)| *at);
        events
            .into_iter()
            .map(|(_, e)| etcd_client::Event(e))
            .collect()
    }

    /// Runs `request`, made by `call`, as etcd would; a lost answer is a write's.
    fn answer(&self, request: PbTxnRequest, call: Call) -> Result<PbTxnResponse, Status> {
        let mut inner = self.inner.lock().expect("store");
        if inner.down {
            return Err(Status::unavailable("etcdserver: the store is down"));
        }
        let before = inner.revision;
        let answer = inner.txn(&request, call)?;
        if inner.revision != before || call != Call::Get {
            inner.writes += 1;
            if inner.lose_answers > 0 {
                inner.lose_answers -= 1;
                return Err(Status::unavailable(
                    "etcdserver: request timed out (applied; the answer was lost)",
                ));
            }
        }
        Ok(answer)
    }
}

impl LockStore for MemoryStore {
    fn txn(&self, txn: Txn) -> StoreFuture<'_, TxnResponse> {
        let held = {
            let mut inner = self.inner.lock().expect("store");
            let held = inner.to_hold > 0;
            if held {
                inner.to_hold -= 1;
                inner.at_gate += 1;
            }
            held
        };
        if !held {
            let answer = self.answer(txn.into(), Call::Txn);
            return Box::pin(async move { Ok(TxnResponse(answer?)) });
        }
        let mut open = self.gate.subscribe();
        Box::pin(async move {
            // Dropped while held, the transaction was never applied (nor is it counted
            // as waiting any more, which a test of a cancel would have to allow for).
            let _ = open.wait_for(|open| *open).await;
            self.inner.lock().expect("store").at_gate -= 1;
            Ok(TxnResponse(self.answer(txn.into(), Call::Txn)?))
        })
    }

    fn get(&self, key: Vec<u8>, options: Option<GetOptions>) -> StoreFuture<'_, GetResponse> {
        let answer = self.answer(one_op(TxnOp::get(key, options)), Call::Get);
        Box::pin(async move {
            match only_response(answer?) {
                Some(PbTxnOpResponse::ResponseRange(range)) => Ok(GetResponse(range)),
                other => unreachable!("a range answered with {other:?}"),
            }
        })
    }

    fn put(
        &self,
        key: Vec<u8>,
        value: Vec<u8>,
        options: Option<PutOptions>,
    ) -> StoreFuture<'_, PutResponse> {
        let answer = self.answer(one_op(TxnOp::put(key, value, options)), Call::Put);
        Box::pin(async move {
            match only_response(answer?) {
                Some(PbTxnOpResponse::ResponsePut(put)) => Ok(PutResponse(put)),
                other => unreachable!("a put answered with {other:?}"),
            }
        })
    }
}

fn one_op(op: TxnOp) -> PbTxnRequest {
    Txn::new().and_then([op]).into()
}

fn only_response(mut txn: PbTxnResponse) -> Option<PbTxnOpResponse> {
    let mut header = txn.header.take();
    let mut response = txn.responses.pop()?.response?;
    // A lone call's header is the transaction's.
    match &mut response {
        PbTxnOpResponse::ResponseRange(r) => r.header = header.take(),
        PbTxnOpResponse::ResponsePut(r) => r.header = header.take(),
        _ => {}
    }
    Some(response)
}

#[cfg(test)]
mod tests;
