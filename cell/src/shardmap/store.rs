//! The etcd side of `lockcell-cell shardmap`: writing a cell's copy over the one read,
//! and finding, copying and deleting the keys of a moving route. Each call is one etcd
//! request or one paged scan ([`same_in`] only compares two scans' finds);
//! [`super::plan`] decides what to do with them.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KvClient, Txn, TxnOp};

use super::plan::{self, Moving};
use super::ShardMap;
use crate::error::{with_timeout, CellError};
use crate::keyspace;
use crate::kv::{put_if_absent_with, PutIfAbsent, Writer};

/// Keys per page of a scan.
const PAGE: i64 = 1000;

/// A key as a scan found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub key: Vec<u8>,
    /// Empty when scanned without values.
    pub value: Vec<u8>,
    pub lease: i64,
    pub mod_revision: i64,
}

impl Found {
    /// The key, for messages.
    pub fn shown(&self) -> String {
        String::from_utf8_lossy(&self.key).into_owned()
    }
}

/// Writes `map` as the cell's copy if the copy is still the one read: written at mod
/// revision `read`, or absent for `None`. Returns the new copy's mod revision, or `None`
/// when the copy changed in between (nothing was written). A write of the copy stops
/// every grant and write in flight in the cell: they compare its mod revision.
pub async fn write(
    kv: &mut KvClient,
    map: &ShardMap,
    read: Option<i64>,
    timeout: Duration,
) -> Result<Option<i64>, CellError> {
    let key = keyspace::shardmap_key();
    let unchanged = match read {
        Some(revision) => Compare::mod_revision(key, CompareOp::Equal, revision),
        None => Compare::version(key, CompareOp::Equal, 0),
    };
    let txn = Txn::new()
        .when([unchanged])
        .and_then([TxnOp::put(key, map.encode(), None)]);
    let resp = with_timeout("write shard map", timeout, kv.txn(txn)).await?;
    if !resp.succeeded() {
        return Ok(None);
    }
    Ok(Some(
        resp.header().map(|h| h.revision()).unwrap_or_default(),
    ))
}

/// Every key that starts with `prefix`, read in pages at one revision; with their values
/// only when `values`.
pub async fn scan(
    kv: &mut KvClient,
    prefix: &str,
    values: bool,
    timeout: Duration,
) -> Result<Vec<Found>, CellError> {
    let end = keyspace::prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = 0;
    let mut found = Vec::new();
    loop {
        let mut options = GetOptions::new()
            .with_range(end.clone())
            .with_limit(PAGE)
            .with_revision(revision);
        if !values {
            options = options.with_keys_only();
        }
        let resp = with_timeout("scan keys", timeout, kv.get(from.clone(), Some(options))).await?;
        if revision == 0 {
            revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        }
        found.extend(resp.kvs().iter().map(|kv| Found {
            key: kv.key().to_vec(),
            value: kv.value().to_vec(),
            lease: kv.lease(),
            mod_revision: kv.mod_revision(),
        }));
        match (resp.more(), resp.kvs().last()) {
            (true, Some(last)) => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok(found),
        }
    }
}

/// The keys of the cell that a move of the route `prefix` (as `map` has it) finds to be
/// `kind`: [`Moving::Held`] (without values) or [`Moving::Persistent`] (with them).
pub async fn moving_keys(
    kv: &mut KvClient,
    map: &ShardMap,
    prefix: &str,
    kind: Moving,
    timeout: Duration,
) -> Result<Vec<Found>, CellError> {
    let [locks, queues, small] = plan::key_prefixes(prefix);
    let scans = match kind {
        Moving::Persistent => vec![(small, true)],
        _ => vec![(locks, false), (queues, false), (small, false)],
    };
    let mut keys = Vec::new();
    for (under, values) in scans {
        let found = scan(kv, &under, values, timeout).await?;
        keys.extend(
            found
                .into_iter()
                .filter(|f| plan::classify(map, prefix, &f.key, f.lease) == kind),
        );
    }
    Ok(keys)
}

/// The names of every key under `/l/`, `/q/` and `/k/` of the cell.
pub async fn names(kv: &mut KvClient, timeout: Duration) -> Result<Vec<String>, CellError> {
    let mut names = Vec::new();
    for under in plan::key_prefixes("") {
        let found = scan(kv, &under, false, timeout).await?;
        names.extend(found.iter().filter_map(|f| plan::name_of(&f.key)));
    }
    Ok(names)
}

/// What [`copy_key`] found in the target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Copied {
    Written,
    /// The target already had the key with the same value.
    AlreadyThere,
    /// The target has the key with another value (shown); nothing was written.
    Differs(Vec<u8>),
}

/// Puts a persistent small key into the target only if the target has no such key.
/// `why` says in the audit trail what the copy is part of.
pub async fn copy_key(
    kv: &mut KvClient,
    key: &[u8],
    value: &[u8],
    why: &Writer,
    timeout: Duration,
) -> Result<Copied, CellError> {
    let note = vec![why.op(keyspace::admin_writer_key())];
    let put =
        put_if_absent_with(kv, key, value.to_vec(), note, "copy a small key", timeout).await?;
    let PutIfAbsent::Present(there) = put else {
        return Ok(Copied::Written);
    };
    let there = there.unwrap_or_default();
    Ok(if there == value {
        Copied::AlreadyThere
    } else {
        Copied::Differs(there)
    })
}

/// The value of `key` in the cell, if it has the key.
pub async fn value(
    kv: &mut KvClient,
    key: &[u8],
    timeout: Duration,
) -> Result<Option<Vec<u8>>, CellError> {
    let resp = with_timeout("read a small key", timeout, kv.get(key, None)).await?;
    Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
}

/// Deletes `key` only while it is as read (last written at `mod_revision`); whether it
/// did. `why` says in the audit trail what the deletion is part of.
pub async fn delete_key(
    kv: &mut KvClient,
    key: &[u8],
    mod_revision: i64,
    why: &Writer,
    timeout: Duration,
) -> Result<bool, CellError> {
    let txn = Txn::new()
        .when([Compare::mod_revision(key, CompareOp::Equal, mod_revision)])
        .and_then([
            TxnOp::delete(key, None),
            why.op(keyspace::admin_writer_key()),
        ]);
    let resp = with_timeout("delete a small key", timeout, kv.txn(txn)).await?;
    Ok(resp.succeeded())
}

/// Deletes `key` only while it is as read (last written at `mod_revision`) and the
/// cell's copy of the shard map is still the one written at `map_revision`; whether it
/// did. The second compare keeps `move --abort` from deleting a key that a move started
/// since has found in the target and counts as copied: that move writes the target's
/// copy before it copies.
pub async fn delete_key_under_map(
    kv: &mut KvClient,
    key: &[u8],
    mod_revision: i64,
    map_revision: i64,
    why: &Writer,
    timeout: Duration,
) -> Result<bool, CellError> {
    let map_key = keyspace::shardmap_key();
    let txn = Txn::new()
        .when([
            Compare::mod_revision(key, CompareOp::Equal, mod_revision),
            Compare::mod_revision(map_key, CompareOp::Equal, map_revision),
        ])
        .and_then([
            TxnOp::delete(key, None),
            why.op(keyspace::admin_writer_key()),
        ]);
    let resp = with_timeout("delete a small key", timeout, kv.txn(txn)).await?;
    Ok(resp.succeeded())
}

/// Deletes the cell's copy of the shard map if it is still the one written at
/// `mod_revision`; whether it did. Without a copy the cell serves every name again.
pub async fn remove(
    kv: &mut KvClient,
    mod_revision: i64,
    timeout: Duration,
) -> Result<bool, CellError> {
    let key = keyspace::shardmap_key();
    let txn = Txn::new()
        .when([Compare::mod_revision(key, CompareOp::Equal, mod_revision)])
        .and_then([TxnOp::delete(key, None)]);
    let resp = with_timeout("delete shard map", timeout, kv.txn(txn)).await?;
    Ok(resp.succeeded())
}

/// Splits `keys` into those `other` holds with the same value (a move's copies, in the
/// cell it copied to, of the keys of the cell it copied from) and how many others.
pub fn same_in(keys: Vec<Found>, other: &[Found]) -> (Vec<Found>, usize) {
    let values: std::collections::BTreeMap<&[u8], &[u8]> = other
        .iter()
        .map(|f| (f.key.as_slice(), f.value.as_slice()))
        .collect();
    let (same, differ): (Vec<Found>, Vec<Found>) = keys
        .into_iter()
        .partition(|f| values.get(f.key.as_slice()) == Some(&f.value.as_slice()));
    (same, differ.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(key: &str, value: &str, mod_revision: i64) -> Found {
        Found {
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
            lease: 0,
            mod_revision,
        }
    }

    #[test]
    fn only_keys_with_the_same_value_count_as_copied() {
        let target = vec![
            found("/k/billing/rate", "7", 40),
            found("/k/billing/owner", "eve", 41),
            found("/k/billing/extra", "1", 42),
        ];
        let source = [
            found("/k/billing/rate", "7", 3),
            found("/k/billing/owner", "bob", 4),
        ];
        let (same, others) = same_in(target, &source);
        assert_eq!(
            same,
            vec![found("/k/billing/rate", "7", 40)],
            "the target's revision"
        );
        assert_eq!(others, 2, "changed since the copy, or not the source's");
    }
}
