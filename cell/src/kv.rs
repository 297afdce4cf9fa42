//! Small keys under `/k/`: configuration, and ephemeral keys that live on a session's
//! proxy lease. Conditional writes, single or multi-key ([`Kv::txn`]), are single
//! transactions, so a refused condition writes nothing.

use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, KvClient, PutOptions, Txn, TxnOp, TxnOpResponse,
};

use serde::{Deserialize, Serialize};

use crate::error::{with_timeout, CellError};
use crate::keyspace::{self, prefix_end, LockName};
use crate::locklog::{check_map, map_guard};

/// Who wrote the small keys of one transaction, for the audit trail: each write puts it,
/// in the same transaction, at the writer's own key ([`keyspace::writer_key`] for a
/// proxy, [`keyspace::admin_writer_key`] for `lockcell-cell`), so the trail knows who
/// made each revision's writes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Writer {
    /// The caller's identity (its session's, or its credential's).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub identity: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub session: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub proxy: String,
    /// What the writes were part of, when not a client's own call (a shard map move's
    /// copy or clean-up).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// When the writer made the write (its clock, ms since the Unix epoch): the trail's
    /// time for the write, as a grant's own time is for a grant, so the trails of two
    /// cells merge in the order the writes were made.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub at_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Writer {
    /// The put that records this writer at `key`, for a transaction's writes, stamped
    /// with the time now.
    pub fn op(&self, key: &str) -> TxnOp {
        let stamped = Writer {
            at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or_default(),
            ..self.clone()
        };
        TxnOp::put(
            key,
            serde_json::to_vec(&stamped).expect("a writer serializes"),
            None,
        )
    }
}

/// What [`put_if_absent`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutIfAbsent {
    Written,
    /// The key was there, with this value (`None`: gone again by the read).
    Present(Option<Vec<u8>>),
}

/// Writes `key` (without a lease) only if it does not exist, in one transaction; else
/// reads what is there. `call` names the etcd call in errors and metrics.
pub async fn put_if_absent(
    kv: &mut KvClient,
    key: &[u8],
    value: Vec<u8>,
    call: &'static str,
    timeout: Duration,
) -> Result<PutIfAbsent, CellError> {
    put_if_absent_with(kv, key, value, Vec::new(), call, timeout).await
}

/// [`put_if_absent`], with more writes (`also`) in the same transaction.
pub async fn put_if_absent_with(
    kv: &mut KvClient,
    key: &[u8],
    value: Vec<u8>,
    also: Vec<TxnOp>,
    call: &'static str,
    timeout: Duration,
) -> Result<PutIfAbsent, CellError> {
    let mut then = vec![TxnOp::put(key, value, None)];
    then.extend(also);
    let txn = Txn::new()
        .when([Compare::version(key, CompareOp::Equal, 0)])
        .and_then(then)
        .or_else([TxnOp::get(key, None)]);
    let resp = with_timeout(call, timeout, kv.txn(txn)).await?;
    if resp.succeeded() {
        return Ok(PutIfAbsent::Written);
    }
    Ok(PutIfAbsent::Present(
        resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        }),
    ))
}

/// When a conditional write applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    Always,
    /// The key does not exist.
    Absent,
    /// The key's last write was at this revision.
    ModRevision(i64),
    /// The key has been written this many times since it was created.
    Version(i64),
}

/// A small key as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key's name (without the `/k/` root).
    pub name: String,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    /// The etcd lease the key is on (a proxy's lease; 0: none).
    pub lease: i64,
    /// The lease an etcd API client wrote the key with, as etcd clients see it (0: none,
    /// or not known where the key was read): see `keyspace::etcd_leased_root`.
    pub client_lease: i64,
}

/// What a conditional write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub succeeded: bool,
    pub revision: i64,
    /// The key after the write, or as it was when the condition failed.
    pub current: Option<Entry>,
}

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub entries: Vec<Entry>,
    pub revision: i64,
    pub more: bool,
}

/// One write of a multi-key transaction. Never on a lease: a transaction changes
/// configuration, and an ephemeral key is written with [`Kv::put`] by its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    Put(LockName, Vec<u8>),
    Delete(LockName),
}

impl Write {
    /// The key written.
    pub fn name(&self) -> &LockName {
        match self {
            Write::Put(name, _) | Write::Delete(name) => name,
        }
    }
}

/// What a multi-key transaction did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnOutcome {
    /// False when a compare did not hold; nothing was written.
    pub succeeded: bool,
    pub revision: i64,
    /// When a compare failed: the compared keys that exist, as they are now, so the
    /// caller can retry without another read.
    pub current: Vec<Entry>,
}

/// Runs small-key calls against one etcd cluster.
#[derive(Clone)]
pub struct Kv {
    kv: KvClient,
    timeout: Duration,
    /// Where each write records its [`Writer`], if anywhere.
    writer_key: Option<String>,
}

impl Kv {
    pub fn new(kv: KvClient, timeout: Duration) -> Self {
        Kv {
            kv,
            timeout,
            writer_key: None,
        }
    }

    /// The same, recording each write's [`Writer`] at `key` in the write's transaction.
    pub fn with_writer_key(mut self, key: String) -> Self {
        self.writer_key = Some(key);
        self
    }

    /// `ops`, and the put of `writer` when writes record it.
    fn signed(&self, mut ops: Vec<TxnOp>, writer: &Writer) -> Vec<TxnOp> {
        if let Some(key) = &self.writer_key {
            ops.push(writer.op(key));
        }
        ops
    }

    /// The op that keeps the owner record (`keyspace::owner_root`) of etcd key `key`
    /// with a write of it by `writer`: for a put on no lease (`persistent`) by an
    /// identified writer, the writer's identity; for any other write, no record. `None`
    /// when writes record no writer (`lockcell-cell`'s own writes).
    fn owner_op(&self, key: &str, persistent: bool, writer: &Writer) -> Option<TxnOp> {
        self.writer_key.as_ref()?;
        let record = keyspace::owner_key(key.as_bytes())?;
        Some(if persistent && !writer.identity.is_empty() {
            TxnOp::put(record, writer.identity.as_bytes(), None)
        } else {
            TxnOp::delete(record, None)
        })
    }

    /// One key, or every key under `prefix` (see [`keyspace::kv_prefix`]).
    pub async fn get(
        &self,
        key: &str,
        prefix: bool,
        limit: i64,
        revision: i64,
        serializable: bool,
    ) -> Result<Read, CellError> {
        let (start, mut options) = if prefix {
            let start = keyspace::kv_prefix(key).map_err(|e| bad(key, e))?;
            let end = prefix_end(start.as_bytes());
            (start, GetOptions::new().with_range(end))
        } else {
            let name = LockName::parse(key).map_err(|e| bad(key, e))?;
            (keyspace::kv_key(&name), GetOptions::new())
        };
        options = options.with_limit(limit).with_revision(revision);
        if serializable {
            options = options.with_serializable();
        }
        let resp = with_timeout(
            "kv read",
            self.timeout,
            self.kv.clone().get(start.as_bytes(), Some(options)),
        )
        .await?;
        Ok(Read {
            entries: resp.kvs().iter().filter_map(entry).collect(),
            revision: resp.header().map(|h| h.revision()).unwrap_or_default(),
            more: resp.more(),
        })
    }

    /// Writes `name` if `condition` holds; on `lease` (ephemeral) when given.
    pub async fn put(
        &self,
        name: &LockName,
        value: Vec<u8>,
        lease: Option<i64>,
        condition: Condition,
        map_revision: i64,
        writer: &Writer,
    ) -> Result<Written, CellError> {
        let key = keyspace::kv_key(name);
        let options = lease.map(|l| PutOptions::new().with_lease(l));
        let mut ops = vec![
            TxnOp::put(key.as_bytes(), value, options),
            TxnOp::get(key.as_bytes(), None),
        ];
        ops.extend(self.owner_op(&key, lease.is_none(), writer));
        let txn = Txn::new()
            .when(guarded(compares(&key, condition), map_revision))
            .and_then(self.signed(ops, writer))
            .or_else(read_back_with_map(&key));
        let resp = with_timeout("kv write", self.timeout, self.kv.clone().txn(txn)).await?;
        if !resp.succeeded() {
            check_map(&resp.op_responses(), map_revision)?;
        }
        Ok(Written {
            succeeded: resp.succeeded(),
            revision: resp.header().map(|h| h.revision()).unwrap_or_default(),
            current: read_back(&resp.op_responses()),
        })
    }

    /// Deletes `name` if `condition` holds. Returns what was there.
    pub async fn delete(
        &self,
        name: &LockName,
        condition: Condition,
        map_revision: i64,
        writer: &Writer,
    ) -> Result<(Written, i64), CellError> {
        let key = keyspace::kv_key(name);
        let mut ops = vec![TxnOp::delete(key.as_bytes(), None)];
        ops.extend(self.owner_op(&key, false, writer));
        let txn = Txn::new()
            .when(guarded(compares(&key, condition), map_revision))
            .and_then(self.signed(ops, writer))
            .or_else(read_back_with_map(&key));
        let resp = with_timeout("kv delete", self.timeout, self.kv.clone().txn(txn)).await?;
        if !resp.succeeded() {
            check_map(&resp.op_responses(), map_revision)?;
        }
        let deleted = resp
            .op_responses()
            .iter()
            .map(|op| match op {
                TxnOpResponse::Delete(d) => d.deleted(),
                _ => 0,
            })
            .sum();
        let written = Written {
            succeeded: resp.succeeded(),
            revision: resp.header().map(|h| h.revision()).unwrap_or_default(),
            current: read_back(&resp.op_responses()),
        };
        Ok((written, deleted))
    }

    /// When every key in `when` meets its condition, does every write, in one etcd
    /// transaction; otherwise reads the compared keys. The caller makes sure each key
    /// is written once (etcd refuses the transaction otherwise) and that the
    /// transaction fits etcd's limits on operations and request size.
    pub async fn txn(
        &self,
        when: &[(LockName, Condition)],
        writes: Vec<Write>,
        map_revision: i64,
        writer: &Writer,
    ) -> Result<TxnOutcome, CellError> {
        let checks: Vec<Compare> = when
            .iter()
            .flat_map(|(name, condition)| compares(&keyspace::kv_key(name), *condition))
            .chain([map_guard(map_revision)])
            .collect();
        // Each write with its owner record, in a transaction of its own with no
        // compares, so the writes count once against etcd's `--max-txn-ops`.
        let ops: Vec<TxnOp> = writes
            .into_iter()
            .map(|write| {
                let key = keyspace::kv_key(write.name());
                let owner = self.owner_op(&key, matches!(write, Write::Put(..)), writer);
                let op = match write {
                    Write::Put(_, value) => TxnOp::put(key, value, None),
                    Write::Delete(_) => TxnOp::delete(key, None),
                };
                match owner {
                    Some(owner) => TxnOp::txn(Txn::new().and_then([op, owner])),
                    None => op,
                }
            })
            .collect();
        let reads: Vec<TxnOp> = read_back_keys(when)
            .into_iter()
            .map(|key| TxnOp::get(key, None))
            .chain([TxnOp::get(keyspace::shardmap_key(), None)])
            .collect();
        let txn = Txn::new()
            .when(checks)
            .and_then(self.signed(ops, writer))
            .or_else(reads);
        let resp = with_timeout("kv txn", self.timeout, self.kv.clone().txn(txn)).await?;
        if !resp.succeeded() {
            check_map(&resp.op_responses(), map_revision)?;
        }
        let current = if resp.succeeded() {
            Vec::new()
        } else {
            resp.op_responses()
                .iter()
                .filter_map(|op| match op {
                    TxnOpResponse::Get(get) => get.kvs().first().and_then(entry),
                    _ => None,
                })
                .collect()
        };
        Ok(TxnOutcome {
            succeeded: resp.succeeded(),
            revision: resp.header().map(|h| h.revision()).unwrap_or_default(),
            current,
        })
    }
}

/// The etcd keys a failed transaction reads back: each compared key once, in the order
/// of its first compare.
fn read_back_keys(when: &[(LockName, Condition)]) -> Vec<String> {
    let mut keys: Vec<String> = Vec::with_capacity(when.len());
    for (name, _) in when {
        let key = keyspace::kv_key(name);
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys
}

fn compares(key: &str, condition: Condition) -> Vec<Compare> {
    match condition {
        Condition::Always => Vec::new(),
        Condition::Absent => vec![Compare::create_revision(
            key.as_bytes(),
            CompareOp::Equal,
            0,
        )],
        Condition::ModRevision(r) => {
            vec![Compare::mod_revision(key.as_bytes(), CompareOp::Equal, r)]
        }
        Condition::Version(v) => vec![Compare::version(key.as_bytes(), CompareOp::Equal, v)],
    }
}

fn read_back(ops: &[TxnOpResponse]) -> Option<Entry> {
    ops.iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().and_then(entry),
        _ => None,
    })
}

fn entry(kv: &etcd_client::KeyValue) -> Option<Entry> {
    Some(Entry {
        name: keyspace::kv_name(kv.key())?.to_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: kv.lease(),
        client_lease: 0,
    })
}

fn bad(key: &str, e: crate::keyspace::NameError) -> CellError {
    CellError::BadKey {
        key: key.to_owned(),
        reason: e.to_string().replacen("lock name", "key", 1),
    }
}

/// `compares` and the shard map guard (see [`map_guard`]).
fn guarded(mut compares: Vec<Compare>, map_revision: i64) -> Vec<Compare> {
    compares.push(map_guard(map_revision));
    compares
}

/// What a refused write reads back: the key, and the shard map copy it was guarded by.
fn read_back_with_map(key: &str) -> [TxnOp; 2] {
    [
        TxnOp::get(key.as_bytes(), None),
        TxnOp::get(keyspace::shardmap_key(), None),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> LockName {
        LockName::parse(s).unwrap()
    }

    #[test]
    fn a_failed_txn_reads_each_compared_key_once_in_order() {
        let when = [
            (name("acct/b"), Condition::ModRevision(4)),
            (name("acct/a"), Condition::Absent),
            (name("acct/b"), Condition::Version(2)),
        ];
        assert_eq!(read_back_keys(&when), ["/k/acct/b", "/k/acct/a"]);
        assert!(read_back_keys(&[]).is_empty());
    }

    #[test]
    fn each_condition_is_one_compare_and_always_is_none() {
        assert!(compares("/k/a", Condition::Always).is_empty());
        for condition in [
            Condition::Absent,
            Condition::ModRevision(3),
            Condition::Version(1),
        ] {
            assert_eq!(compares("/k/a", condition).len(), 1, "{condition:?}");
        }
    }

    #[test]
    fn a_write_names_its_key() {
        assert_eq!(Write::Put(name("a/b"), b"1".to_vec()).name(), &name("a/b"));
        assert_eq!(Write::Delete(name("c")).name(), &name("c"));
    }
}
