//! The Kv service: small keys under `/k/` with conditional writes; a write with a
//! session is ephemeral (on the session's proxy lease, deleted when the session ends).
//! Txn is a small multi-key compare-and-swap, checked whole before etcd sees it.

use std::sync::Arc;

use lockcell_cell::kv::{Condition, Entry, Write, Writer};
use lockcell_cell::locklog::Grant;
use lockcell_cell::LockName;
use lockcell_proto::v1::condition::When;
use lockcell_proto::v1::kv_server::Kv as KvApi;
use lockcell_proto::v1::txn_write::Op;
use lockcell_proto::v1::{
    DeleteRequest, DeleteResponse, GetRequest, GetResponse, KeyValue, PutRequest, PutResponse,
    TxnRequest, TxnResponse,
};
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::access::Right;
use crate::errors::ProxyError;
use crate::mirror::WriteSize;
use crate::sessions::Session;
use crate::state::ProxyState;

/// Most compares and writes, together, in one Txn. etcd refuses a transaction whose
/// compares, success ops or failure ops outnumber its `--max-txn-ops` (default 128),
/// and ours has one failure op (a get) per compared key on top of the compares and the
/// writes; 64 in all keeps every list at most half the default, and the call small.
pub const MAX_TXN_OPS: usize = 64;

/// Most bytes of keys and put values in one Txn. Each value is within
/// `--max-value-bytes`, but 64 of them could pass etcd's `--max-request-bytes`
/// (default 1.5 MiB), which etcd would refuse as a store error instead of a bad request.
pub const MAX_TXN_BYTES: usize = 1024 * 1024;

pub struct KvService {
    pub state: Arc<ProxyState>,
}

impl KvService {
    /// Who a call without a session writes as, for the audit trail.
    fn writer(&self, caller: Option<String>) -> Writer {
        Writer {
            identity: caller.unwrap_or_default(),
            proxy: self.state.proxy_id.clone(),
            ..Writer::default()
        }
    }
}

/// A key as shown to a caller who may write it but not read it: its revisions, never
/// its value or the lease it lives on.
fn unread(kv: KeyValue) -> KeyValue {
    KeyValue {
        value: Vec::new(),
        lease: 0,
        ..kv
    }
}

/// The session a Put names, for an ephemeral key: open, and with room for the key
/// (a new ephemeral key counts against the identity's keys; writing one the session
/// has already does not; its bytes count past what they were). `None` for none.
fn ephemeral_session(
    state: &ProxyState,
    req: &PutRequest,
    name: &LockName,
) -> Result<Option<Session>, ProxyError> {
    if req.session_id.is_empty() {
        return Ok(None);
    }
    let s = state
        .sessions
        .get(&req.session_id, Instant::now())
        .map_err(|gone| ProxyError::session(&req.session_id, gone))?;
    let key = lockcell_cell::keyspace::kv_key(name);
    let (keys, bytes) = s.adds(&key, (key.len() + req.value.len()) as u64);
    state.admit_keys(&s.id, keys, bytes)?;
    Ok(Some(s))
}

/// Records an ephemeral key written with `session` for the session's clean-up; if
/// the session ended meanwhile, the key goes with it, and the caller hears the
/// session is gone.
fn record_ephemeral(
    state: &ProxyState,
    session: &Session,
    name: &LockName,
    current: &Entry,
    value_bytes: usize,
) -> Result<(), ProxyError> {
    let grant = Grant::ephemeral(name, current.create_revision, current.mod_revision)
        .with_value_bytes(value_bytes);
    if !state
        .sessions
        .record_grant(&session.id, session.incarnation, grant.clone(), None)
    {
        state.cleanup.push(session.lease, vec![grant]);
        return Err(ProxyError::session(
            &session.id,
            crate::sessions::Gone::Unknown,
        ));
    }
    Ok(())
}

#[tonic::async_trait]
impl KvApi for KvService {
    #[tracing::instrument(skip_all, fields(kv.key = %request.get_ref().key))]
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let caller = self.state.grants.current().authorize_key(
            &request,
            Right::Read,
            &request.get_ref().key,
            request.get_ref().prefix,
        )?;
        self.state.pace(caller.as_deref())?;
        let req = request.into_inner();
        if req.limit < 0 || req.revision < 0 {
            return Err(ProxyError::BadArgument(format!(
                "read of {:?}: limit and revision may not be negative",
                req.key
            ))
            .into());
        }
        let (read, cell) = self
            .state
            .reads
            .get(
                &req.key,
                req.prefix,
                req.limit,
                (req.revision, &req.cell),
                req.serializable,
            )
            .await?;
        Ok(Response::new(GetResponse {
            kvs: read.entries.into_iter().map(wire).collect(),
            revision: read.revision,
            more: read.more,
            cell,
        }))
    }

    #[tracing::instrument(skip_all, fields(kv.key = %request.get_ref().key))]
    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        // The caller is identified once: it must write the key, own the session it
        // names, and is shown the key's value only if it may read it.
        let put = request.get_ref();
        let grants = self.state.grants.current();
        let caller = grants.caller(&request)?;
        let readable = match &caller {
            Some(caller) => {
                grants.check(caller, Right::Write, &put.key)?;
                grants.check(caller, Right::Read, &put.key).is_ok()
            }
            None => true,
        };
        if !put.session_id.is_empty() {
            crate::credential::check(&put.session_id, &put.session_secret, caller.as_deref())?;
        }
        self.state.pace(caller.as_deref())?;
        let req = request.into_inner();
        let state = &self.state;
        let name = key_name(&req.key)?;
        value_within(&req.key, &req.value, state.config.max_value_bytes)?;
        let write = WriteSize::put(name.as_str(), req.value.len(), req.session_id.is_empty());
        let admitted = state.admit_writes(caller.as_deref(), &[write]).await?;
        let condition = condition(&req.key, req.condition)?;
        let session = ephemeral_session(state, &req, &name)?;
        let served = state.routes.serve(name.as_str())?;
        let value_bytes = req.value.len();
        let pending = session
            .as_ref()
            .map(|s| Grant::unsettled_ephemeral(&name, &s.id, &req.value));
        let writer = Writer {
            identity: session
                .as_ref()
                .map(|s| s.identity.clone())
                .or(caller)
                .unwrap_or_default(),
            session: req.session_id.clone(),
            proxy: state.proxy_id.clone(),
            ..Writer::default()
        };
        let put = state.kv.put(
            &name,
            req.value,
            session.as_ref().map(|s| s.lease),
            condition,
            served.map_revision,
            &writer,
        );
        let written = match (&session, pending) {
            // A write that goes with a session is the session's even if no answer comes.
            (Some(s), Some(pending)) => crate::unsettled::owned_write(
                state.owners(),
                s,
                pending,
                put,
                crate::unsettled::unknown_outcome,
            )
            .await
            .ok_or_else(|| ProxyError::session(&req.session_id, crate::sessions::Gone::Unknown))?,
            _ => put.await,
        };
        let written = written.map_err(ProxyError::from)?;
        admitted.landed(written.succeeded.then_some(written.revision));
        if let (true, Some(session), Some(current)) =
            (written.succeeded, &session, &written.current)
        {
            record_ephemeral(state, session, &name, current, value_bytes)?;
        }
        Ok(Response::new(PutResponse {
            succeeded: written.succeeded,
            revision: written.revision,
            current: written
                .current
                .map(wire)
                .map(|kv| if readable { kv } else { unread(kv) }),
        }))
    }

    #[tracing::instrument(skip_all, fields(kv.key = %request.get_ref().key))]
    async fn delete(
        &self,
        request: Request<DeleteRequest>,
    ) -> Result<Response<DeleteResponse>, Status> {
        let caller = self.state.grants.current().authorize(
            &request,
            Right::Write,
            &[&request.get_ref().key],
        )?;
        self.state.pace(caller.as_deref())?;
        let writer = self.writer(caller);
        let req = request.into_inner();
        let name = key_name(&req.key)?;
        let feed = &self.state.reads.feed;
        self.state
            .space
            .admit_delete(&format!("deleting {:?}", req.key), || {
                feed.is_live() && feed.with_mirror(|m| m.get(name.as_str()).is_none())
            })?;
        let condition = condition(&req.key, req.condition)?;
        let served = self.state.routes.serve(name.as_str())?;
        let (written, deleted) = self
            .state
            .kv
            .delete(&name, condition, served.map_revision, &writer)
            .await
            .map_err(ProxyError::from)?;
        Ok(Response::new(DeleteResponse {
            succeeded: written.succeeded,
            deleted,
            revision: written.revision,
        }))
    }

    #[tracing::instrument(skip_all, fields(
        kv.compares = request.get_ref().compares.len(),
        kv.writes = request.get_ref().writes.len(),
    ))]
    async fn txn(&self, request: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        let caller = {
            let txn = request.get_ref();
            let grants = self.state.grants.current();
            let compared: Vec<&str> = txn.compares.iter().map(|c| c.key.as_str()).collect();
            let written: Vec<&str> = txn.writes.iter().map(|w| w.key.as_str()).collect();
            let caller = grants.authorize(&request, Right::Read, &compared)?;
            if let Some(caller) = &caller {
                written
                    .iter()
                    .try_for_each(|name| grants.check(caller, Right::Write, name))?;
            }
            caller
        };
        self.state.pace(caller.as_deref())?;
        let writer = self.writer(caller);
        let checked = check_txn(request.into_inner(), self.state.config.max_value_bytes)?;
        let sizes: Vec<WriteSize> = checked
            .writes
            .iter()
            .map(|w| match w {
                Write::Put(name, value) => WriteSize::put(name.as_str(), value.len(), true),
                Write::Delete(name) => WriteSize::delete(name.as_str()),
            })
            .collect();
        // Past the space line, a Txn that only deletes keys none of which exist would
        // still write a revision (its writer record): refused, as such a Delete is.
        let feed = &self.state.reads.feed;
        self.state
            .space
            .admit_delete("a transaction of deletes only", || {
                feed.is_live()
                    && !sizes.is_empty()
                    && feed.with_mirror(|m| {
                        sizes
                            .iter()
                            .all(|w| w.value.is_none() && m.get(w.name).is_none())
                    })
            })?;
        let identity = Some(writer.identity.as_str()).filter(|i| !i.is_empty());
        let admitted = self.state.admit_writes(identity, &sizes).await?;
        let names = checked.when.iter().map(|(n, _)| n.as_str());
        let map_revision = self
            .state
            .routes
            .serve_all(names.chain(checked.writes.iter().map(|w| w.name().as_str())))?;
        let outcome = self
            .state
            .kv
            .txn(&checked.when, checked.writes, map_revision, &writer)
            .await
            .map_err(ProxyError::from)?;
        admitted.landed(outcome.succeeded.then_some(outcome.revision));
        Ok(Response::new(TxnResponse {
            succeeded: outcome.succeeded,
            revision: outcome.revision,
            current: outcome.current.into_iter().map(wire).collect(),
        }))
    }
}

/// A Txn request that passed every check.
#[derive(Debug)]
struct CheckedTxn {
    /// Each compared key with its condition, never [`Condition::Always`].
    when: Vec<(LockName, Condition)>,
    /// At least one; each key once.
    writes: Vec<Write>,
}

/// Checks a Txn request whole, so that etcd never sees one it would refuse and a bad
/// one writes nothing: its compares (each with a condition) and its writes (at least
/// one, each key once, values within `max_value_bytes`).
fn check_txn(req: TxnRequest, max_value_bytes: usize) -> Result<CheckedTxn, ProxyError> {
    let ops = req.compares.len() + req.writes.len();
    if ops > MAX_TXN_OPS {
        return Err(ProxyError::BadArgument(format!(
            "transaction has {} compares and {} writes, over the limit of {MAX_TXN_OPS} in all",
            req.compares.len(),
            req.writes.len()
        )));
    }
    if req.writes.is_empty() {
        return Err(ProxyError::BadArgument(
            "transaction has no writes; it needs at least one (to read keys, use Get)".into(),
        ));
    }
    let at = |place: String, e: ProxyError| ProxyError::BadArgument(format!("{place}: {e}"));
    let mut when = Vec::with_capacity(req.compares.len());
    for (i, compare) in req.compares.into_iter().enumerate() {
        let place = || format!("compares[{i}]");
        let name = key_name(&compare.key).map_err(|e| at(place(), e))?;
        match condition(&compare.key, compare.condition).map_err(|e| at(place(), e))? {
            Condition::Always => {
                return Err(ProxyError::BadArgument(format!(
                    "{}: the compare on key {:?} has no condition, so it would compare \
                     nothing; set absent, mod_revision or version",
                    place(),
                    compare.key
                )))
            }
            condition => when.push((name, condition)),
        }
    }
    let mut writes: Vec<Write> = Vec::with_capacity(req.writes.len());
    let mut bytes = 0;
    for (i, write) in req.writes.into_iter().enumerate() {
        let place = || format!("writes[{i}]");
        let name = key_name(&write.key).map_err(|e| at(place(), e))?;
        if let Some(first) = writes.iter().position(|w| w.name() == &name) {
            return Err(ProxyError::BadArgument(format!(
                "key {:?} is written twice (writes[{first}] and writes[{i}]); a transaction \
                 may write each key once",
                write.key
            )));
        }
        bytes += write.key.len();
        writes.push(match write.op {
            Some(Op::Put(value)) => {
                value_within(&write.key, &value, max_value_bytes).map_err(|e| at(place(), e))?;
                bytes += value.len();
                Write::Put(name, value)
            }
            Some(Op::Delete(true)) => Write::Delete(name),
            None | Some(Op::Delete(false)) => {
                return Err(ProxyError::BadArgument(format!(
                    "{}: the write to key {:?} is neither a put nor a delete",
                    place(),
                    write.key
                )))
            }
        });
    }
    if bytes > MAX_TXN_BYTES {
        return Err(ProxyError::BadArgument(format!(
            "transaction writes {bytes} bytes of keys and values, over the limit of \
             {MAX_TXN_BYTES} bytes per transaction"
        )));
    }
    Ok(CheckedTxn { when, writes })
}

/// Refuses a value over `limit`, naming the key and the limit.
fn value_within(key: &str, value: &[u8], limit: usize) -> Result<(), ProxyError> {
    if value.len() > limit {
        return Err(ProxyError::BadArgument(format!(
            "the value for key {key:?} is {} bytes, over the limit of {limit} bytes",
            value.len()
        )));
    }
    Ok(())
}

/// A small key's name: the lock-name rules, with errors that say "key".
fn key_name(key: &str) -> Result<LockName, ProxyError> {
    LockName::parse(key)
        .map_err(|e| ProxyError::BadArgument(e.to_string().replacen("lock name", "key", 1)))
}

fn condition(
    key: &str,
    wire: Option<lockcell_proto::v1::Condition>,
) -> Result<Condition, ProxyError> {
    let bad = |what: &str, n: i64| {
        ProxyError::BadArgument(format!(
            "condition on key {key:?}: {what} {n} is not a revision or version (must be positive)"
        ))
    };
    Ok(match wire.and_then(|c| c.when) {
        None | Some(When::Absent(false)) => Condition::Always,
        Some(When::Absent(true)) => Condition::Absent,
        Some(When::ModRevision(r)) if r > 0 => Condition::ModRevision(r),
        Some(When::ModRevision(r)) => return Err(bad("mod_revision", r)),
        Some(When::Version(v)) if v > 0 => Condition::Version(v),
        Some(When::Version(v)) => return Err(bad("version", v)),
    })
}

pub(crate) fn wire(e: Entry) -> KeyValue {
    KeyValue {
        key: e.name,
        value: e.value,
        create_revision: e.create_revision,
        mod_revision: e.mod_revision,
        version: e.version,
        lease: e.lease,
    }
}

#[cfg(test)]
mod tests {
    use lockcell_proto::v1::{Compare, TxnWrite};

    use super::*;

    const LIMIT: usize = 16;

    fn compare(key: &str, when: Option<When>) -> Compare {
        Compare {
            key: key.into(),
            condition: when.map(|w| lockcell_proto::v1::Condition { when: Some(w) }),
        }
    }

    fn put(key: &str, value: &[u8]) -> TxnWrite {
        TxnWrite {
            key: key.into(),
            op: Some(Op::Put(value.to_vec())),
        }
    }

    fn delete(key: &str) -> TxnWrite {
        TxnWrite {
            key: key.into(),
            op: Some(Op::Delete(true)),
        }
    }

    fn refusal(compares: Vec<Compare>, writes: Vec<TxnWrite>) -> String {
        match check_txn(TxnRequest { compares, writes }, LIMIT) {
            Err(ProxyError::BadArgument(message)) => message,
            other => panic!("not refused as a bad argument: {other:?}"),
        }
    }

    fn name(s: &str) -> LockName {
        LockName::parse(s).unwrap()
    }

    #[test]
    fn a_good_txn_keeps_its_compares_and_writes_in_order() {
        let CheckedTxn { when, writes } = check_txn(
            TxnRequest {
                compares: vec![
                    compare("acct/a", Some(When::ModRevision(7))),
                    compare("acct/b", Some(When::Absent(true))),
                    compare("acct/c", Some(When::Version(2))),
                ],
                writes: vec![put("acct/a", b"9"), delete("acct/c"), put("acct/b", b"1")],
            },
            LIMIT,
        )
        .unwrap();
        assert_eq!(
            when,
            [
                (name("acct/a"), Condition::ModRevision(7)),
                (name("acct/b"), Condition::Absent),
                (name("acct/c"), Condition::Version(2)),
            ]
        );
        assert_eq!(
            writes,
            [
                Write::Put(name("acct/a"), b"9".to_vec()),
                Write::Delete(name("acct/c")),
                Write::Put(name("acct/b"), b"1".to_vec()),
            ]
        );
        // No compares at all: an unconditional batch of writes.
        let CheckedTxn { when, .. } = check_txn(
            TxnRequest {
                compares: vec![],
                writes: vec![put("a", b"")],
            },
            LIMIT,
        )
        .unwrap();
        assert!(when.is_empty());
    }

    #[test]
    fn each_refusal_names_the_key_and_the_rule() {
        let ok = || compare("a", Some(When::Absent(true)));
        let cases = [
            (vec![ok()], vec![], vec!["no writes"]),
            (
                vec![ok()],
                vec![put("a/../b", b"1")],
                vec!["writes[0]", "a/../b", "'..'"],
            ),
            (
                vec![compare("", Some(When::Absent(true)))],
                vec![put("a", b"1")],
                vec!["compares[0]", "key is empty"],
            ),
            (
                vec![ok(), compare("b", None)],
                vec![put("a", b"1")],
                vec!["compares[1]", "\"b\"", "no condition"],
            ),
            (
                vec![compare("b", Some(When::Absent(false)))],
                vec![put("a", b"1")],
                vec!["compares[0]", "\"b\"", "no condition"],
            ),
            (
                vec![compare("b", Some(When::ModRevision(0)))],
                vec![put("a", b"1")],
                vec!["compares[0]", "\"b\"", "must be positive"],
            ),
            (
                vec![ok()],
                vec![put("a", b"1"), put("b", b"2"), delete("a")],
                vec!["\"a\"", "written twice", "writes[0] and writes[2]"],
            ),
            (
                vec![ok()],
                vec![put("b", b"1"), put("a", &[0; LIMIT + 1])],
                vec!["writes[1]", "\"a\"", "17 bytes", "limit of 16 bytes"],
            ),
            (
                vec![ok()],
                vec![TxnWrite {
                    key: "a".into(),
                    op: None,
                }],
                vec!["writes[0]", "\"a\"", "neither a put nor a delete"],
            ),
        ];
        for (compares, writes, words) in cases {
            let message = refusal(compares, writes);
            for word in words {
                assert!(message.contains(word), "{message:?} lacks {word:?}");
            }
        }
    }

    #[test]
    fn size_limits_count_the_whole_txn() {
        let keys: Vec<String> = (0..MAX_TXN_OPS).map(|i| format!("k{i}")).collect();
        let writes = |n: usize| keys[..n].iter().map(|k| put(k, b"v")).collect::<Vec<_>>();
        assert!(check_txn(
            TxnRequest {
                compares: vec![],
                writes: writes(MAX_TXN_OPS),
            },
            LIMIT
        )
        .is_ok());
        let message = refusal(
            vec![compare("x", Some(When::Version(1)))],
            writes(MAX_TXN_OPS),
        );
        assert!(
            message.contains("1 compares and 64 writes") && message.contains("limit of 64"),
            "{message}"
        );
        // Values each within the per-value limit, together over the per-call one.
        let big = vec![0u8; MAX_TXN_BYTES / 2];
        let message = match check_txn(
            TxnRequest {
                compares: vec![],
                writes: vec![put("a", &big), put("b", &big), put("c", b"1")],
            },
            MAX_TXN_BYTES,
        ) {
            Err(ProxyError::BadArgument(message)) => message,
            other => panic!("{other:?}"),
        };
        assert!(
            message.contains(&format!("limit of {MAX_TXN_BYTES} bytes")),
            "{message}"
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// A transaction passes only when it keeps every rule: at most 64 operations,
            /// at least one write, each key written once and a valid name, each value
            /// within the limit; whatever passes is exactly what was asked.
            #[test]
            fn a_txn_passes_exactly_when_it_keeps_every_rule(
                keys in proptest::collection::vec("[ab/!.]{0,4}", 0..70),
                sizes in proptest::collection::vec(0usize..24, 0..70),
            ) {
                let writes: Vec<TxnWrite> = keys
                    .iter()
                    .zip(sizes.iter().chain(std::iter::repeat(&0)))
                    .map(|(k, n)| if *n % 5 == 0 { delete(k) } else { put(k, &vec![b'v'; *n]) })
                    .collect();
                let names_ok = keys.iter().all(|k| LockName::parse(k).is_ok());
                let distinct = keys.iter().enumerate().all(|(i, k)| !keys[..i].contains(k));
                let values_ok = writes.iter().all(|w| match &w.op {
                    Some(Op::Put(v)) => v.len() <= LIMIT,
                    _ => true,
                });
                let fine = !writes.is_empty()
                    && writes.len() <= MAX_TXN_OPS
                    && names_ok
                    && distinct
                    && values_ok;
                let checked = check_txn(TxnRequest { compares: Vec::new(), writes }, LIMIT);
                prop_assert_eq!(checked.is_ok(), fine, "{:?} {:?}", keys, sizes);
                if let Ok(checked) = checked {
                    let kept: Vec<&str> = checked.writes.iter().map(|w| w.name().as_str()).collect();
                    prop_assert_eq!(kept, keys.iter().map(String::as_str).collect::<Vec<_>>());
                }
            }
        }
    }
}
