//! A client's requests in the small-key space: the checks a Range or Txn passes, and
//! the Txn as lockcell runs it (keys under `/k/`, records kept with each write, lease
//! compares decided on client leases).

use super::*;

/// Tries of a Txn whose lease compares keep finding their keys written meanwhile.
pub(super) const LEASE_COMPARE_TRIES: usize = 5;

/// By client key, the client lease and mod revision each key a lease compare names had
/// when read (0 and 0: no such key).
pub(super) type LeasesCompared = std::collections::HashMap<Vec<u8>, (i64, i64)>;

/// The keys the LEASE compares of `txn` name, nested ones too.
pub(super) fn lease_compares(txn: &PbTxnRequest, keys: &mut Vec<Vec<u8>>) {
    let lease = etcd_client::proto::PbCompareTarget::Lease as i32;
    keys.extend(
        txn.compare
            .iter()
            .filter(|c| c.target == lease)
            .map(|c| c.key.clone()),
    );
    for op in txn.success.iter().chain(&txn.failure) {
        if let Some(PbTxnOpRequest::RequestTxn(t)) = &op.request {
            lease_compares(t, keys);
        }
    }
}

/// The etcd key of a key put with a lease, as text: a session keeps its keys' names as
/// text, so such a key must be UTF-8.
pub(super) fn leased_key(key: &[u8]) -> Result<String, Status> {
    String::from_utf8(inner(key)).map_err(|_| {
        Status::invalid_argument(format!(
            "key {:?} is not UTF-8 text, which a key put with a lease through lockcell must be",
            String::from_utf8_lossy(key)
        ))
    })
}

/// The etcd key and options of a client's range read.
pub(super) fn get_options(req: &PbRangeRequest) -> Result<(Vec<u8>, GetOptions), Status> {
    if req.key.is_empty() {
        return Err(Status::invalid_argument("etcdserver: key is not provided"));
    }
    let range = inner_range(&req.key, &req.range_end);
    let mut options = GetOptions::new()
        .with_limit(req.limit)
        .with_revision(req.revision)
        .with_min_mod_revision(req.min_mod_revision)
        .with_max_mod_revision(req.max_mod_revision)
        .with_min_create_revision(req.min_create_revision)
        .with_max_create_revision(req.max_create_revision);
    if !range.end.is_empty() {
        options = options.with_range(range.end);
    }
    let target = SortTarget::try_from(req.sort_target).map_err(|_| {
        Status::invalid_argument(format!(
            "sort target {} is not one of etcd's",
            req.sort_target
        ))
    })?;
    let order = SortOrder::try_from(req.sort_order).map_err(|_| {
        Status::invalid_argument(format!(
            "sort order {} is not one of etcd's",
            req.sort_order
        ))
    })?;
    options = options.with_sort(target, order);
    if req.serializable {
        options = options.with_serializable();
    }
    if req.keys_only {
        options = options.with_keys_only();
    }
    if req.count_only {
        options = options.with_count_only();
    }
    Ok((range.key, options))
}

/// Refuses what the etcd API does not take in a Txn (a compare on the leases of a range, a leased key
/// that is not UTF-8, a value over the limit), counting operations as it goes.
pub(super) fn check_txn(
    txn: &PbTxnRequest,
    max_value: usize,
    ops: &mut usize,
) -> Result<(), Status> {
    let mut bytes = 0;
    check_txn_part(txn, max_value, ops, &mut bytes)?;
    if bytes > MAX_TXN_BYTES {
        return Err(Status::invalid_argument(format!(
            "the transaction writes {bytes} bytes of keys and values, over lockcell's limit of {MAX_TXN_BYTES} bytes per transaction"
        )));
    }
    Ok(())
}

/// A Put's own rules: its key's, its value's size, and no `ignore_value` or
/// `ignore_lease`, which lockcell does not serve.
pub(super) fn check_put(req: &PbPutRequest, max_value_bytes: usize) -> Result<(), Status> {
    if req.ignore_value || req.ignore_lease {
        return Err(Status::invalid_argument(format!(
            "put of key {:?}: ignore_value and ignore_lease are not supported through lockcell",
            String::from_utf8_lossy(&req.key)
        )));
    }
    key_within(&req.key)?;
    if req.value.len() > max_value_bytes {
        return Err(ProxyError::BadArgument(format!(
            "the value for key {:?} is {} bytes, over the limit of {} bytes",
            String::from_utf8_lossy(&req.key),
            req.value.len(),
            max_value_bytes
        ))
        .into());
    }
    Ok(())
}

/// A key a client writes: not empty, UTF-8 text, and within [`MAX_KEY_BYTES`].
///
/// lockcell's small keys are text: the proxies' copy of them, which reads and watches
/// are served from, holds text names.
pub(super) fn key_within(key: &[u8]) -> Result<(), Status> {
    if key.is_empty() {
        return Err(Status::invalid_argument("etcdserver: key is not provided"));
    }
    if let Err(e) = std::str::from_utf8(key) {
        let shown = String::from_utf8_lossy(&key[..key.len().min(64)]).into_owned();
        return Err(Status::invalid_argument(format!(
            "key {shown:?} is not UTF-8 text (byte {} is not), which every key written through lockcell must be",
            e.valid_up_to()
        )));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Status::invalid_argument(format!(
            "key {:?}… is {} bytes, over lockcell's limit of {MAX_KEY_BYTES} bytes",
            String::from_utf8_lossy(&key[..64]),
            key.len()
        )));
    }
    Ok(())
}

pub(super) fn check_txn_part(
    txn: &PbTxnRequest,
    max_value: usize,
    ops: &mut usize,
    bytes: &mut usize,
) -> Result<(), Status> {
    *ops += txn.compare.len();
    for c in &txn.compare {
        if c.key.is_empty() {
            return Err(Status::invalid_argument("etcdserver: key is not provided"));
        }
        let lease = c.target == etcd_client::proto::PbCompareTarget::Lease as i32;
        // A lease compare is also a compare of the key's mod revision in the proxy's
        // guard, one level up, which etcd counts against the levels below it.
        if lease {
            *ops += 1;
        }
        if lease && !c.range_end.is_empty() {
            return Err(Status::invalid_argument(format!(
                "the compare on the leases of the keys from {:?} to {:?}: a lease compare through lockcell names one key",
                String::from_utf8_lossy(&c.key),
                String::from_utf8_lossy(&c.range_end)
            )));
        }
    }
    for op in txn.success.iter().chain(&txn.failure) {
        *ops += 1;
        match &op.request {
            Some(PbTxnOpRequest::RequestPut(p)) => {
                key_within(&p.key)?;
                if p.ignore_value || p.ignore_lease {
                    return Err(Status::invalid_argument(format!(
                        "the put of key {:?}: ignore_value and ignore_lease are not supported through lockcell",
                        String::from_utf8_lossy(&p.key)
                    )));
                }
                if p.value.len() > max_value {
                    return Err(Status::invalid_argument(format!(
                        "the value for key {:?} is {} bytes, over the limit of {max_value} bytes",
                        String::from_utf8_lossy(&p.key),
                        p.value.len()
                    )));
                }
                if p.lease != 0 {
                    leased_key(&p.key)?;
                }
                *bytes += p.key.len() + p.value.len();
            }
            Some(PbTxnOpRequest::RequestTxn(t)) => check_txn_part(t, max_value, ops, bytes)?,
            Some(PbTxnOpRequest::RequestDeleteRange(d)) if d.key.is_empty() => {
                return Err(Status::invalid_argument("etcdserver: key is not provided"))
            }
            Some(PbTxnOpRequest::RequestRange(r)) if r.key.is_empty() => {
                return Err(Status::invalid_argument("etcdserver: key is not provided"))
            }
            None => {
                return Err(Status::invalid_argument(
                    "etcdserver: a Txn operation has no request",
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// The sessions of the leases a Txn's puts name, by lease.
pub(super) type Sessions = std::collections::HashMap<i64, Session>;

/// Every put of `txn`, nested ones too, in either branch.
/// Whether a Txn's answer ranges over a key on a lease, at any depth.
pub(super) fn ranges_leased_keys(reply: &PbTxnResponse) -> bool {
    reply.responses.iter().any(|op| match &op.response {
        Some(PbTxnOpResponse::ResponseRange(r)) => r.kvs.iter().any(|kv| kv.lease != 0),
        Some(PbTxnOpResponse::ResponseTxn(t)) => ranges_leased_keys(t),
        _ => false,
    })
}

/// Whether a Txn puts or deletes anything, in either branch, nested ones included.
pub(super) fn txn_writes(txn: &PbTxnRequest) -> bool {
    txn.success
        .iter()
        .chain(&txn.failure)
        .any(|op| match &op.request {
            Some(PbTxnOpRequest::RequestPut(_) | PbTxnOpRequest::RequestDeleteRange(_)) => true,
            Some(PbTxnOpRequest::RequestTxn(t)) => txn_writes(t),
            _ => false,
        })
}

/// The operations of `txn` that `pick` takes, of either branch, nested ones too.
fn txn_ops<'a, T>(
    txn: &'a PbTxnRequest,
    pick: fn(&'a PbTxnOpRequest) -> Option<&'a T>,
) -> Vec<&'a T> {
    let mut picked = Vec::new();
    for op in txn.success.iter().chain(&txn.failure) {
        match &op.request {
            Some(PbTxnOpRequest::RequestTxn(t)) => picked.extend(txn_ops(t, pick)),
            Some(request) => picked.extend(pick(request)),
            None => {}
        }
    }
    picked
}

/// The deletes of a Txn, of either branch, nested ones too.
pub(super) fn txn_deletes(txn: &PbTxnRequest) -> Vec<&PbDeleteRequest> {
    txn_ops(txn, |request| match request {
        PbTxnOpRequest::RequestDeleteRange(d) => Some(d),
        _ => None,
    })
}

/// The puts of a Txn, of either branch, nested ones too.
pub(super) fn txn_puts(txn: &PbTxnRequest) -> Vec<&PbPutRequest> {
    txn_ops(txn, |request| match request {
        PbTxnOpRequest::RequestPut(p) => Some(p),
        _ => None,
    })
}

/// The client's Txn with every key in the small-key space, each write with the ops that
/// keep its keys' client lease and owner records (`writer` owns its persistent puts),
/// and each lease compare decided by `leases`.
pub(super) fn inward_txn(
    req: &PbTxnRequest,
    leased: &Sessions,
    leases: &LeasesCompared,
    writer: &Writer,
) -> Result<Txn, Status> {
    let compares = req
        .compare
        .iter()
        .map(|c| inward_compare(c, leases))
        .collect::<Result<Vec<_>, _>>()?;
    let ops = |ops: &[PbTxnRequestOp]| {
        ops.iter()
            .map(|op| inward_op(op, leased, leases, writer))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok(Txn::new()
        .when(compares)
        .and_then(ops(&req.success)?)
        .or_else(ops(&req.failure)?))
}

/// A client's compare in the small-key space. A compare on a key's lease compares the
/// client lease the key was written with, never the proxy lease it is on (which every
/// key of a proxy's sessions shares): it is decided by the lease the proxy read for the
/// key (`leases`), and stands as a compare that is always true or always false; the
/// transaction's guard checks the key is still as read.
pub(super) fn inward_compare(c: &PbCompare, leases: &LeasesCompared) -> Result<Compare, Status> {
    use etcd_client::proto::{PbCompareTarget as Target, PbTargetUnion as Union};
    let op = CompareOp::try_from(c.result).map_err(|_| {
        Status::invalid_argument(format!("compare result {} is not one of etcd's", c.result))
    })?;
    let range = inner_range(&c.key, &c.range_end);
    let key = range.key;
    if c.target == Target::Lease as i32 {
        let wanted = match &c.target_union {
            Some(Union::Lease(l)) => *l,
            None => 0,
            Some(_) => {
                return Err(Status::invalid_argument(format!(
                    "the compare on key {:?} has a target ({}) that does not match its value",
                    String::from_utf8_lossy(&c.key),
                    c.target
                )))
            }
        };
        let (lease, _) = leases.get(&c.key).copied().unwrap_or_default();
        let holds = match op {
            CompareOp::Equal => lease == wanted,
            CompareOp::NotEqual => lease != wanted,
            CompareOp::Greater => lease > wanted,
            CompareOp::Less => lease < wanted,
        };
        // A mod revision is never negative: an absent key's is 0.
        return Ok(match holds {
            true => Compare::mod_revision(key, CompareOp::Greater, -1),
            false => Compare::mod_revision(key, CompareOp::Less, 0),
        });
    }
    let compare = match (Target::try_from(c.target), &c.target_union) {
        (Ok(Target::Version), Some(Union::Version(v))) => Compare::version(key, op, *v),
        (Ok(Target::Create), Some(Union::CreateRevision(r))) => {
            Compare::create_revision(key, op, *r)
        }
        (Ok(Target::Mod), Some(Union::ModRevision(r))) => Compare::mod_revision(key, op, *r),
        (Ok(Target::Value), Some(Union::Value(v))) => Compare::value(key, op, v.clone()),
        // An absent union is the field's zero value, as etcd reads it.
        (Ok(Target::Version), None) => Compare::version(key, op, 0),
        (Ok(Target::Create), None) => Compare::create_revision(key, op, 0),
        (Ok(Target::Mod), None) => Compare::mod_revision(key, op, 0),
        (Ok(Target::Value), None) => Compare::value(key, op, Vec::new()),
        _ => {
            return Err(Status::invalid_argument(format!(
                "the compare on key {:?} has a target ({}) that does not match its value",
                String::from_utf8_lossy(&c.key),
                c.target
            )))
        }
    };
    Ok(if range.end.is_empty() {
        compare
    } else {
        compare.with_range(range.end)
    })
}

/// A client's Txn operation in the small-key space. A write goes with the ops that keep
/// its keys' client lease and owner records, in a transaction of its own with no
/// compares (which `settle_txn` answers as the write alone: the write's reply first,
/// then the lease records').
pub(super) fn inward_op(
    op: &PbTxnRequestOp,
    leased: &Sessions,
    leases: &LeasesCompared,
    writer: &Writer,
) -> Result<TxnOp, Status> {
    let with_record = |write: TxnOp, record: TxnOp, owner: TxnOp| {
        TxnOp::txn(Txn::new().and_then([write, record, owner]))
    };
    Ok(match &op.request {
        Some(PbTxnOpRequest::RequestRange(r)) => {
            let (key, options) = get_options(r)?;
            TxnOp::get(key, Some(options))
        }
        Some(PbTxnOpRequest::RequestPut(p)) => {
            // A leased put goes on its session's proxy lease, and always reads the key
            // as it was, whose create revision its session's record needs.
            let session = leased.get(&p.lease);
            let options = match session {
                Some(session) => Some(PutOptions::new().with_prev_key().with_lease(session.lease)),
                None if p.prev_kv => Some(PutOptions::new().with_prev_key()),
                None => None,
            };
            let record = record_op(&p.key, session.map(|_| p.lease));
            let owner = owner_op(&p.key, session.is_none(), writer);
            with_record(
                TxnOp::put(inner(&p.key), p.value.clone(), options),
                record,
                owner,
            )
        }
        Some(PbTxnOpRequest::RequestDeleteRange(d)) => {
            let range = inner_range(&d.key, &d.range_end);
            let records = records_deleted(&range);
            let owners = owners_deleted(&range);
            let mut options = DeleteOptions::new();
            if !range.end.is_empty() {
                options = options.with_range(range.end);
            }
            if d.prev_kv {
                options = options.with_prev_key();
            }
            with_record(TxnOp::delete(range.key, Some(options)), records, owners)
        }
        Some(PbTxnOpRequest::RequestTxn(t)) => TxnOp::txn(inward_txn(t, leased, leases, writer)?),
        None => {
            return Err(Status::invalid_argument(
                "etcdserver: a Txn operation has no request",
            ))
        }
    })
}
