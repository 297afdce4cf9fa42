//! How keys are shown to etcd clients (client keys, client leases, ranges answered from
//! the proxy's copy of the small keys) and the records kept beside them (client lease
//! and owner records) with each write.

use super::*;

/// What etcd answers to `req` at the mirror's revision, from the mirror: the keys of
/// the client's range, then etcd's own steps (its `Range` apply) — the count of every key
/// in the range, the revision filters, the sort (ascending by default when the target is
/// not the key), the limit and `more`, `keys_only`, `count_only`. Keys are etcd's (under
/// `/k/`) and leases the client's. `None` when a bound is not text.
pub(super) fn mirror_range(mirror: &Mirror, req: &PbRangeRequest) -> Option<PbRangeResponse> {
    let key = if req.key == [0] {
        ""
    } else {
        std::str::from_utf8(&req.key).ok()?
    };
    let in_range: Vec<&Entry> = match &req.range_end[..] {
        [] => mirror.get(key).into_iter().collect(),
        [0] => mirror.range(key, Bound::Unbounded).collect(),
        end => {
            let end = std::str::from_utf8(end).ok()?;
            if key >= end {
                Vec::new()
            } else {
                mirror.range(key, Bound::Excluded(end)).collect()
            }
        }
    };
    let count = in_range.len() as i64;
    let within =
        |value: i64, min: i64, max: i64| (min == 0 || value >= min) && (max == 0 || value <= max);
    let mut kvs: Vec<&Entry> = if req.count_only {
        Vec::new()
    } else {
        in_range
            .into_iter()
            .filter(|e| {
                within(e.mod_revision, req.min_mod_revision, req.max_mod_revision)
                    && within(
                        e.create_revision,
                        req.min_create_revision,
                        req.max_create_revision,
                    )
            })
            .collect()
    };
    sort(&mut kvs, req)?;
    let mut more = false;
    if let Ok(limit) = usize::try_from(req.limit) {
        if limit > 0 && kvs.len() > limit {
            kvs.truncate(limit);
            more = true;
        }
    }
    let kvs = kvs
        .into_iter()
        .map(|e| PbKeyValue {
            key: inner(e.name.as_bytes()),
            create_revision: e.create_revision,
            mod_revision: e.mod_revision,
            version: e.version,
            value: if req.keys_only {
                Vec::new()
            } else {
                e.value.clone()
            },
            lease: e.client_lease,
        })
        .collect();
    Some(PbRangeResponse {
        header: None,
        kvs,
        more,
        count,
    })
}

/// Sorts a range's keys as the request asks (etcd sorts by key, ascending, when asked
/// to sort by another target in no order); `None` for a sort etcd does not know.
fn sort(kvs: &mut [&Entry], req: &PbRangeRequest) -> Option<()> {
    let target = SortTarget::try_from(req.sort_target).ok()?;
    let order = match SortOrder::try_from(req.sort_order).ok()? {
        SortOrder::None if target != SortTarget::Key => SortOrder::Ascend,
        order => order,
    };
    if order != SortOrder::None {
        kvs.sort_by(|a, b| {
            let by = match target {
                SortTarget::Key => a.name.cmp(&b.name),
                SortTarget::Version => a.version.cmp(&b.version),
                SortTarget::Create => a.create_revision.cmp(&b.create_revision),
                SortTarget::Mod => a.mod_revision.cmp(&b.mod_revision),
                SortTarget::Value => a.value.cmp(&b.value),
            };
            match order {
                SortOrder::Descend => by.reverse(),
                _ => by,
            }
        });
    }
    Some(())
}

/// Whether the proxy's copy shows no key in the client's range from `key` to
/// `range_end` (etcd's forms: one key, a range, from a key on).
pub(super) fn finds_none(mirror: &Mirror, key: &[u8], range_end: &[u8]) -> bool {
    let count = PbRangeRequest {
        key: key.to_vec(),
        range_end: range_end.to_vec(),
        count_only: true,
        ..PbRangeRequest::default()
    };
    mirror_range(mirror, &count).is_some_and(|found| found.count == 0)
}

/// A key's etcd key as the client's.
pub(super) fn outward_key(kv: &mut PbKeyValue) {
    if let Some(outer) = keys::outer(&kv.key) {
        kv.key = outer.to_vec();
    }
}

/// By etcd key, the client lease records a write replaced or deleted (its lease, its
/// mod revision): from the response of the record op that went with the write.
pub(super) type RecordsBefore = std::collections::HashMap<Vec<u8>, (i64, i64)>;

pub(super) fn records_before(record: Option<&PbResponseOp>) -> RecordsBefore {
    let prev: Vec<&PbKeyValue> = match record.and_then(|r| r.response.as_ref()) {
        Some(PbTxnOpResponse::ResponsePut(p)) => p.prev_kv.iter().collect(),
        Some(PbTxnOpResponse::ResponseDeleteRange(d)) => d.prev_kvs.iter().collect(),
        _ => Vec::new(),
    };
    prev.into_iter()
        .filter_map(|kv| {
            let name = keyspace::etcd_leased_name(&kv.key)?;
            let lease = crate::feed::record_lease(&kv.value);
            Some((inner(name.as_bytes()), (lease, kv.mod_revision)))
        })
        .collect()
}

/// A key as it was before a write, as the client sees it: its client key, and the
/// client lease its record (replaced or deleted by the same write) gave that write of it.
pub(super) fn outward_prev(kv: &mut PbKeyValue, before: &RecordsBefore) {
    kv.lease = match before.get(&kv.key) {
        Some((lease, written)) if kv.lease != 0 && *written == kv.mod_revision => *lease,
        _ => 0,
    };
    outward_key(kv);
}

/// The op that keeps the client lease record of client key `key` with a put of it: the
/// client lease written with, or no record. Each reads the record as it was, for the
/// previous key's lease. A record is on no lease: when its key's lease ends, etcd
/// deletes the key alone, and the record, about a write no key shows any more, is
/// swept later ([`crate::sweep`]).
pub(super) fn record_op(key: &[u8], lease: Option<i64>) -> TxnOp {
    let record = keyspace::etcd_leased_key(&inner(key)).expect("a small key has a record");
    match lease {
        Some(lease) => TxnOp::put(
            record,
            lease.to_string(),
            Some(PutOptions::new().with_prev_key()),
        ),
        None => TxnOp::delete(record, Some(DeleteOptions::new().with_prev_key())),
    }
}

/// The op that keeps the owner record (`keyspace::owner_root`) of client key `key` with
/// a put of it by `writer`: the writer's identity for a put on no lease (`persistent`),
/// no record for a leased one.
pub(super) fn owner_op(key: &[u8], persistent: bool, writer: &Writer) -> TxnOp {
    let record = keyspace::owner_key(&inner(key)).expect("a small key has a record");
    if persistent && !writer.identity.is_empty() {
        TxnOp::put(record, writer.identity.as_bytes(), None)
    } else {
        TxnOp::delete(record, None)
    }
}

/// The op that deletes the owner records of the small keys a delete of `range` (etcd
/// keys) deletes.
pub(super) fn owners_deleted(range: &keys::Range) -> TxnOp {
    let record = |key: &[u8]| keyspace::owner_key(key).expect("a small-key range");
    let mut options = DeleteOptions::new();
    if !range.end.is_empty() {
        options = options.with_range(record(&range.end));
    }
    TxnOp::delete(record(&range.key), Some(options))
}

/// The ops that delete client key `key` and its client lease record.
pub(in crate::etcd_api) fn deleted_with_record(key: &[u8]) -> [TxnOp; 2] {
    let record = keyspace::etcd_leased_key(&inner(key)).expect("a small key has a record");
    [TxnOp::delete(inner(key), None), TxnOp::delete(record, None)]
}

/// The op that deletes the client lease records of the small keys a delete of `range`
/// (etcd keys) deletes, reading them as they were.
pub(super) fn records_deleted(range: &keys::Range) -> TxnOp {
    let record = |key: &[u8]| keyspace::etcd_leased_key(key).expect("a small-key range");
    let mut options = DeleteOptions::new().with_prev_key();
    if !range.end.is_empty() {
        options = options.with_range(record(&range.end));
    }
    TxnOp::delete(record(&range.key), Some(options))
}
