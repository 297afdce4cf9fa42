//! How the store answers a transaction: its checks, its compares, its path through
//! nested transactions, and each read and write, as etcd does them. The checks follow
//! etcd's order: its API's (`check_request`, then `check_writes` of each branch), then
//! those of the branches taken (every put, then every read).

use std::cmp::Ordering;
use std::collections::BTreeSet;

use etcd_client::proto::{
    PbCompare, PbCompareTarget, PbDeleteResponse, PbKeyValue, PbPutResponse, PbRangeResponse,
    PbResponseHeader, PbResponseOp, PbTargetUnion, PbTxnOpRequest, PbTxnOpResponse, PbTxnRequest,
    PbTxnRequestOp, PbTxnResponse,
};
use etcd_client::{SortOrder, SortTarget};
use tonic::Status;

use super::{
    Call, Inner, Span, DUPLICATE_KEY, EMPTY_KEY, FUTURE_REVISION, KEY_NOT_FOUND, LEASE_NOT_FOUND,
    LEASE_PROVIDED, MAX_TXN_OPS, TOO_MANY_OPS, VALUE_PROVIDED,
};

impl Inner {
    pub(super) fn at(&self, key: &[u8], revision: i64) -> Option<&PbKeyValue> {
        let versions = self.history.get(key)?;
        let (_, kv) = versions.iter().rev().find(|(at, _)| *at <= revision)?;
        kv.as_ref()
    }

    pub(super) fn current(&self) -> impl Iterator<Item = &PbKeyValue> {
        self.history
            .values()
            .filter_map(|versions| versions.last().and_then(|(_, kv)| kv.as_ref()))
    }

    fn in_span<'a>(&'a self, span: &'a Span<'a>, revision: i64) -> Vec<&'a PbKeyValue> {
        self.history
            .keys()
            .filter(|k| span.holds(k))
            .filter_map(|k| self.at(k, revision))
            .collect()
    }

    fn header(&self) -> Option<PbResponseHeader> {
        Some(PbResponseHeader {
            revision: self.revision,
            ..PbResponseHeader::default()
        })
    }

    /// One transaction: checked whole, its compares read before anything is written,
    /// and every write at one new revision.
    pub(super) fn txn(
        &mut self,
        request: &PbTxnRequest,
        call: Call,
    ) -> Result<PbTxnResponse, Status> {
        check_request(request, MAX_TXN_OPS)?;
        check_writes(&request.success)?;
        check_writes(&request.failure)?;
        let path = self.path(request);
        on_path(request, &mut path.iter(), &mut |op| {
            self.check_put(op, call)
        })?;
        on_path(request, &mut path.iter(), &mut |op| self.check_read(op))?;
        let at = self.revision + 1;
        let mut wrote = false;
        let mut path = path.into_iter();
        let mut response = self.run(request, &mut path, at, &mut wrote);
        if wrote {
            self.revision = at;
        }
        response.header = self.header();
        Ok(response)
    }

    /// Which branch each transaction takes (the outer one first, then its nested ones
    /// in order), every compare read against the state before the transaction.
    fn path(&self, request: &PbTxnRequest) -> Vec<bool> {
        let mut path = Vec::new();
        self.walk(request, &mut path);
        path
    }

    fn walk(&self, request: &PbTxnRequest, path: &mut Vec<bool>) {
        let succeeded = request.compare.iter().all(|c| self.holds(c));
        path.push(succeeded);
        let branch = if succeeded {
            &request.success
        } else {
            &request.failure
        };
        for op in branch {
            if let Some(PbTxnOpRequest::RequestTxn(nested)) = &op.request {
                self.walk(nested, path);
            }
        }
    }

    fn holds(&self, compare: &PbCompare) -> bool {
        let span = Span {
            key: &compare.key,
            end: &compare.range_end,
        };
        let kvs = self.in_span(&span, self.revision);
        let target = compare.target;
        if kvs.is_empty() {
            return target != PbCompareTarget::Value as i32
                && compares(compare, &PbKeyValue::default());
        }
        kvs.iter().all(|kv| compares(compare, kv))
    }

    /// Refuses a put on a lease that does not exist, or keeping the value or lease of a
    /// key that is not there; a lone put looks its lease up first, a transaction the key.
    fn check_put(&self, op: &PbTxnOpRequest, call: Call) -> Result<(), Status> {
        let PbTxnOpRequest::RequestPut(put) = op else {
            return Ok(());
        };
        let lease = || match put.lease != 0 && !self.leases.contains(&put.lease) {
            true => Err(Status::not_found(LEASE_NOT_FOUND)),
            false => Ok(()),
        };
        let kept = put.ignore_value || put.ignore_lease;
        let key = || match kept && self.at(&put.key, self.revision).is_none() {
            true => Err(Status::invalid_argument(KEY_NOT_FOUND)),
            false => Ok(()),
        };
        match call {
            Call::Put => lease().and_then(|_| key()),
            _ => key().and_then(|_| lease()),
        }
    }

    /// Refuses a read of a revision still to come.
    fn check_read(&self, op: &PbTxnOpRequest) -> Result<(), Status> {
        match op {
            PbTxnOpRequest::RequestRange(range) if range.revision > self.revision => {
                Err(Status::out_of_range(FUTURE_REVISION))
            }
            _ => Ok(()),
        }
    }

    fn run(
        &mut self,
        request: &PbTxnRequest,
        path: &mut std::vec::IntoIter<bool>,
        at: i64,
        wrote: &mut bool,
    ) -> PbTxnResponse {
        let succeeded = path.next().unwrap_or(false);
        let branch = if succeeded {
            &request.success
        } else {
            &request.failure
        };
        let responses = branch
            .iter()
            .map(|op| PbResponseOp {
                response: op.request.as_ref().map(|r| self.op(r, path, at, wrote)),
            })
            .collect();
        PbTxnResponse {
            header: None,
            succeeded,
            responses,
        }
    }

    fn op(
        &mut self,
        request: &PbTxnOpRequest,
        path: &mut std::vec::IntoIter<bool>,
        at: i64,
        wrote: &mut bool,
    ) -> PbTxnOpResponse {
        match request {
            PbTxnOpRequest::RequestRange(r) => {
                let ask = RangeAsk {
                    span: Span {
                        key: &r.key,
                        end: &r.range_end,
                    },
                    limit: r.limit,
                    sort_order: r.sort_order,
                    sort_target: r.sort_target,
                    keys_only: r.keys_only,
                    count_only: r.count_only,
                    mod_revisions: (r.min_mod_revision, r.max_mod_revision),
                    create_revisions: (r.min_create_revision, r.max_create_revision),
                };
                // Reads within a writing transaction see its earlier writes.
                let revision = if r.revision > 0 { r.revision } else { at };
                PbTxnOpResponse::ResponseRange(self.range(&ask, revision))
            }
            PbTxnOpRequest::RequestPut(p) => {
                let prev = self.at(&p.key, at).cloned();
                let kv = PbKeyValue {
                    key: p.key.clone(),
                    create_revision: prev.as_ref().map_or(at, |kv| kv.create_revision),
                    mod_revision: at,
                    version: prev.as_ref().map_or(1, |kv| kv.version + 1),
                    value: match (&prev, p.ignore_value) {
                        (Some(kv), true) => kv.value.clone(),
                        _ => p.value.clone(),
                    },
                    lease: match (&prev, p.ignore_lease) {
                        (Some(kv), true) => kv.lease,
                        _ => p.lease,
                    },
                };
                self.write(&p.key, at, Some(kv));
                *wrote = true;
                PbTxnOpResponse::ResponsePut(PbPutResponse {
                    header: None,
                    prev_kv: prev.filter(|_| p.prev_kv),
                })
            }
            PbTxnOpRequest::RequestDeleteRange(d) => {
                let span = Span {
                    key: &d.key,
                    end: &d.range_end,
                };
                let gone: Vec<PbKeyValue> = self.in_span(&span, at).into_iter().cloned().collect();
                for kv in &gone {
                    self.write(&kv.key, at, None);
                    *wrote = true;
                }
                PbTxnOpResponse::ResponseDeleteRange(PbDeleteResponse {
                    header: None,
                    deleted: gone.len() as i64,
                    prev_kvs: if d.prev_kv { gone } else { Vec::new() },
                })
            }
            PbTxnOpRequest::RequestTxn(nested) => {
                PbTxnOpResponse::ResponseTxn(self.run(nested, path, at, wrote))
            }
        }
    }

    fn write(&mut self, key: &[u8], at: i64, kv: Option<PbKeyValue>) {
        let versions = self.history.entry(key.to_vec()).or_default();
        match versions.last_mut() {
            // A second write of one key in one transaction never passes the checks; a
            // delete of a key put earlier in it replaces the put.
            Some((rev, last)) if *rev == at => *last = kv,
            _ => versions.push((at, kv)),
        }
    }

    /// A range as etcd reads one: `count` is every key in the span; the filters, the
    /// sort and then the limit apply to what it returns (the first `limit + 1` keys when
    /// no sort order and no filter is named), and a count-only range returns nothing
    /// else, not even `more`.
    fn range(&self, ask: &RangeAsk<'_>, revision: i64) -> PbRangeResponse {
        let found = self.in_span(&ask.span, revision);
        let count = found.len() as i64;
        if ask.count_only {
            return PbRangeResponse {
                count,
                ..PbRangeResponse::default()
            };
        }
        let within =
            |n: i64, (min, max): (i64, i64)| (min == 0 || n >= min) && (max == 0 || n <= max);
        let mut kvs: Vec<PbKeyValue> = found
            .into_iter()
            .filter(|kv| within(kv.mod_revision, ask.mod_revisions))
            .filter(|kv| within(kv.create_revision, ask.create_revisions))
            .cloned()
            .collect();
        // A request naming no sort order and no filter has etcd read only `limit + 1`
        // keys, in key order: a target's default order then sorts those alone.
        let filtered = ask.mod_revisions != (0, 0) || ask.create_revisions != (0, 0);
        if ask.sort_order == 0 && !filtered && ask.limit > 0 {
            kvs.truncate(ask.limit as usize + 1);
        }
        let target = ask.sort_target;
        // etcd's SortOrder (NONE, ASCEND, DESCEND) and SortTarget (KEY, VERSION, CREATE,
        // MOD, VALUE); a target other than the key sorts ascending by default.
        let order = match (ask.sort_order, target) {
            (0, t) if t != SortTarget::Key as i32 => SortOrder::Ascend as i32,
            (order, _) => order,
        };
        let by = |a: &PbKeyValue, b: &PbKeyValue| match target {
            1 => a.version.cmp(&b.version),
            2 => a.create_revision.cmp(&b.create_revision),
            3 => a.mod_revision.cmp(&b.mod_revision),
            4 => a.value.cmp(&b.value),
            _ => a.key.cmp(&b.key),
        };
        // A stable sort, reversed by its comparison: equal kvs stay in key order either
        // way, as etcd's sort (insertion sort for up to 12) leaves them.
        match order {
            1 => kvs.sort_by(by),
            2 => kvs.sort_by(|a, b| by(b, a)),
            _ => {}
        }
        let more = ask.limit > 0 && kvs.len() as i64 > ask.limit;
        if more {
            kvs.truncate(ask.limit as usize);
        }
        if ask.keys_only {
            kvs.iter_mut().for_each(|kv| kv.value.clear());
        }
        PbRangeResponse {
            header: None,
            kvs,
            more,
            count,
        }
    }
}

/// A range request's fields, as read from the request.
struct RangeAsk<'a> {
    span: Span<'a>,
    limit: i64,
    sort_order: i32,
    sort_target: i32,
    keys_only: bool,
    count_only: bool,
    mod_revisions: (i64, i64),
    create_revisions: (i64, i64),
}

/// Whether `kv` passes `compare`, as etcd reads a compare.
fn compares(compare: &PbCompare, kv: &PbKeyValue) -> bool {
    let number = |n: i64| match compare.target_union {
        Some(PbTargetUnion::Version(v))
        | Some(PbTargetUnion::CreateRevision(v))
        | Some(PbTargetUnion::ModRevision(v))
        | Some(PbTargetUnion::Lease(v)) => n.cmp(&v),
        _ => n.cmp(&0),
    };
    let order = match PbCompareTarget::try_from(compare.target) {
        Ok(PbCompareTarget::Version) => number(kv.version),
        Ok(PbCompareTarget::Create) => number(kv.create_revision),
        Ok(PbCompareTarget::Mod) => number(kv.mod_revision),
        Ok(PbCompareTarget::Lease) => number(kv.lease),
        Ok(PbCompareTarget::Value) => match &compare.target_union {
            Some(PbTargetUnion::Value(v)) => kv.value.as_slice().cmp(v.as_slice()),
            _ => kv.value.as_slice().cmp(&[]),
        },
        Err(_) => return false,
    };
    // etcd's CompareResult: EQUAL, GREATER, LESS, NOT_EQUAL.
    match compare.result {
        0 => order == Ordering::Equal,
        1 => order == Ordering::Greater,
        2 => order == Ordering::Less,
        3 => order != Ordering::Equal,
        _ => false,
    }
}

/// The checks etcd's API makes of a request before it is applied (its
/// `checkTxnRequest`): at most `most` operations at this level, and a nested
/// transaction at most what this one leaves; no empty key; a put with `ignore_value`
/// sends no value, one with `ignore_lease` no lease. Both branches, taken or not.
fn check_request(request: &PbTxnRequest, most: usize) -> Result<(), Status> {
    let ops = request.compare.len();
    let ops = ops.max(request.success.len()).max(request.failure.len());
    if ops > most {
        return Err(Status::invalid_argument(TOO_MANY_OPS));
    }
    let empty = || Err(Status::invalid_argument(EMPTY_KEY));
    if request.compare.iter().any(|c| c.key.is_empty()) {
        return empty();
    }
    for op in request.success.iter().chain(&request.failure) {
        match &op.request {
            Some(PbTxnOpRequest::RequestRange(r)) if r.key.is_empty() => return empty(),
            Some(PbTxnOpRequest::RequestDeleteRange(d)) if d.key.is_empty() => return empty(),
            Some(put @ PbTxnOpRequest::RequestPut(_)) => check_put_request(put)?,
            Some(PbTxnOpRequest::RequestTxn(nested)) => check_request(nested, most - ops)?,
            _ => {}
        }
    }
    Ok(())
}

fn check_put_request(op: &PbTxnOpRequest) -> Result<(), Status> {
    let PbTxnOpRequest::RequestPut(put) = op else {
        return Ok(());
    };
    if put.key.is_empty() {
        return Err(Status::invalid_argument(EMPTY_KEY));
    }
    if put.ignore_value && !put.value.is_empty() {
        return Err(Status::invalid_argument(VALUE_PROVIDED));
    }
    if put.ignore_lease && put.lease != 0 {
        return Err(Status::invalid_argument(LEASE_PROVIDED));
    }
    Ok(())
}

/// Runs `check` on every operation of the branches `path` takes, nested ones included.
fn on_path(
    request: &PbTxnRequest,
    path: &mut std::slice::Iter<'_, bool>,
    check: &mut dyn FnMut(&PbTxnOpRequest) -> Result<(), Status>,
) -> Result<(), Status> {
    let branch = if *path.next().unwrap_or(&false) {
        &request.success
    } else {
        &request.failure
    };
    for op in branch {
        match &op.request {
            Some(PbTxnOpRequest::RequestTxn(nested)) => on_path(nested, path, check)?,
            Some(op) => check(op)?,
            None => {}
        }
    }
    Ok(())
}

/// Refuses a branch that writes one key twice, as etcd does: a put and another put or
/// a delete of the same key, nested transactions included (the two branches of one
/// nested transaction may put the same key, as only one of them runs).
fn check_writes(branch: &[PbTxnRequestOp]) -> Result<(), Status> {
    writes_of(branch).map(|_| ())
}

type Writes = (BTreeSet<Vec<u8>>, Vec<(Vec<u8>, Vec<u8>)>);

fn writes_of(branch: &[PbTxnRequestOp]) -> Result<Writes, Status> {
    let duplicate = || Status::invalid_argument(DUPLICATE_KEY);
    let mut deletes: Vec<(Vec<u8>, Vec<u8>)> = branch
        .iter()
        .filter_map(|op| match &op.request {
            Some(PbTxnOpRequest::RequestDeleteRange(d)) => {
                Some((d.key.clone(), d.range_end.clone()))
            }
            _ => None,
        })
        .collect();
    // etcd's check reads a range end `\0` as a string, not as "every key onwards": a
    // delete from a key onwards covers no key here.
    let deleted = |deletes: &[(Vec<u8>, Vec<u8>)], key: &[u8]| {
        deletes
            .iter()
            .any(|(k, end)| end != &[0] && Span { key: k, end }.holds(key))
    };
    let mut puts: BTreeSet<Vec<u8>> = BTreeSet::new();
    for op in branch {
        let Some(PbTxnOpRequest::RequestTxn(nested)) = &op.request else {
            continue;
        };
        let (then_puts, then_deletes) = writes_of(&nested.success)?;
        let (else_puts, else_deletes) = writes_of(&nested.failure)?;
        for key in &then_puts {
            if puts.contains(key) || deleted(&deletes, key) {
                return Err(duplicate());
            }
        }
        puts.extend(then_puts.iter().cloned());
        for key in else_puts {
            if (puts.contains(&key) && !then_puts.contains(&key)) || deleted(&deletes, &key) {
                return Err(duplicate());
            }
            puts.insert(key);
        }
        deletes.extend(then_deletes);
        deletes.extend(else_deletes);
    }
    for op in branch {
        if let Some(PbTxnOpRequest::RequestPut(p)) = &op.request {
            if !puts.insert(p.key.clone()) || deleted(&deletes, &p.key) {
                return Err(duplicate());
            }
        }
    }
    Ok((puts, deletes))
}
