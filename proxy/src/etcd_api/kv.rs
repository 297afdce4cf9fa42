//! etcd's KV service over lockcell's small keys. Reads of now are answered from the
//! proxy's copy of the small keys (after a read barrier unless serializable), as the
//! lockcell API's are; reads at a past revision go to etcd. Each write is one etcd transaction guarded by
//! the cell's shard map copy, with the proxy's writer record for the audit trail, as
//! the lockcell API's writes are. A put with a lease writes the key on the lease's
//! session's proxy lease and records it in the session, which deletes it when it ends.

use etcd_client::proto::{
    PbCompare, PbDeleteRequest, PbDeleteResponse, PbKeyValue, PbKvService, PbPutRequest,
    PbPutResponse, PbRangeRequest, PbRangeResponse, PbResponseOp, PbTxnOpRequest, PbTxnOpResponse,
    PbTxnRequest, PbTxnRequestOp, PbTxnResponse,
};
use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace;
use lockcell_cell::kv::{Entry, Writer};
use lockcell_cell::locklog::{check_map, map_guard, Grant};
use std::ops::Bound;
use tonic::{Request, Response, Status};

use super::keys::{self, inner, inner_range};
use super::lease::LEASE_NOT_FOUND;
use super::EtcdApi;
use crate::access::Right;
use crate::errors::ProxyError;
use crate::metrics;
use crate::mirror::Mirror;
use crate::mirror::WriteSize;
use crate::sessions::Session;

/// Most operations in one Txn, counting each branch's and nested ones': etcd's default
/// `--max-txn-ops`, less the proxy's own guard and writer record.
pub const MAX_TXN_OPS: usize = 120;

/// Longest key a client may write: etcd bounds keys only by its request size, which
/// would let a key hold far more than a value may.
pub const MAX_KEY_BYTES: usize = 4096;

/// Most bytes of keys and values one Txn may write, as lockcell's own Txn.
pub const MAX_TXN_BYTES: usize = crate::service::kv::MAX_TXN_BYTES;

mod inward;
mod shown;
mod txn;
mod write;

use self::inward::*;
pub(super) use self::shown::deleted_with_record;
use self::shown::*;

#[tonic::async_trait]
impl PbKvService for EtcdApi {
    async fn range(
        &self,
        request: Request<PbRangeRequest>,
    ) -> Result<Response<PbRangeResponse>, Status> {
        let req = request.get_ref();
        if req.key.is_empty() {
            return Err(Status::invalid_argument("etcdserver: key is not provided"));
        }
        self.authorize_range(&request, Right::Read, &req.key, &req.range_end)?;
        self.state.pace(self.caller(&request)?.as_deref())?;
        let req = request.into_inner();
        if let Some(mut reply) = self.range_from_mirror(&req).await? {
            // Leases are the client's already (`mirror_range`).
            reply.kvs.iter_mut().for_each(outward_key);
            return Ok(Response::new(reply));
        }
        let (key, options) = get_options(&req)?;
        let state = &self.state;
        ::metrics::counter!(metrics::KV_READS, "path" => "etcd").increment(1);
        let got = with_timeout(
            "api range",
            state.config.etcd_timeout,
            state.etcd.kv_client().get(key, Some(options)),
        )
        .await
        .map_err(super::etcd_error)?;
        let mut reply = got.0;
        if reply.kvs.iter().any(|kv| kv.lease != 0) {
            self.caught_up(reply.header.as_ref().map_or(0, |h| h.revision))
                .await;
        }
        self.outward_range(&mut reply);
        Ok(Response::new(reply))
    }

    async fn put(&self, request: Request<PbPutRequest>) -> Result<Response<PbPutResponse>, Status> {
        let caller = self.caller(&request)?;
        // The key's rules first: a key that is not text is a bad argument, whatever the
        // caller's grants.
        key_within(&request.get_ref().key)?;
        self.authorize_range(&request, Right::Write, &request.get_ref().key, &[])?;
        let lease = request.get_ref().lease;
        let put = "/etcdserverpb.KV/Put";
        let here = || self.put_here(caller.clone(), request.get_ref());
        self.on_lease((lease, put), &request, caller.as_deref(), |_| false, here)
            .await
    }
    async fn delete_range(
        &self,
        request: Request<PbDeleteRequest>,
    ) -> Result<Response<PbDeleteResponse>, Status> {
        let caller = self.caller(&request)?;
        let req = request.get_ref();
        self.authorize_range(&request, Right::Write, &req.key, &req.range_end)?;
        self.state.pace(caller.as_deref())?;
        let req = request.into_inner();
        if req.key.is_empty() {
            return Err(Status::invalid_argument("etcdserver: key is not provided"));
        }
        let map_revision = self.map_revision(&req.key, &req.range_end)?;
        let feed = &self.state.reads.feed;
        self.state.space.admit_delete(
            &format!(
                "deleting {:?}",
                String::from_utf8_lossy(&req.key).into_owned()
            ),
            || feed.is_live() && feed.with_mirror(|m| finds_none(m, &req.key, &req.range_end)),
        )?;
        let range = inner_range(&req.key, &req.range_end);
        let records = records_deleted(&range);
        let owners = owners_deleted(&range);
        let mut options = DeleteOptions::new();
        if !range.end.is_empty() {
            options = options.with_range(range.end);
        }
        if req.prev_kv {
            options = options.with_prev_key();
        }
        let op = TxnOp::delete(range.key, Some(options));
        let outcome = self
            .guarded(
                vec![op, records, owners],
                map_revision,
                &self.writer(caller, None),
            )
            .await
            .map_err(super::etcd_error)?;
        let revision = outcome.header.as_ref().map_or(0, |h| h.revision);
        let mut responses = outcome.responses.into_iter();
        let (delete, records) = (responses.next(), responses.next());
        let mut deleted = match delete.and_then(|op| op.response) {
            Some(PbTxnOpResponse::ResponseDeleteRange(d)) => d,
            _ => PbDeleteResponse::default(),
        };
        let before = records_before(records.as_ref());
        for kv in &mut deleted.prev_kvs {
            outward_prev(kv, &before);
        }
        deleted.header = Some(self.header(revision));
        Ok(Response::new(deleted))
    }

    async fn txn(&self, request: Request<PbTxnRequest>) -> Result<Response<PbTxnResponse>, Status> {
        let caller = self.caller(&request)?;
        let mut ops = 0;
        check_txn(
            request.get_ref(),
            self.state.config.max_value_bytes,
            &mut ops,
        )?;
        if ops > MAX_TXN_OPS {
            return Err(Status::invalid_argument(format!(
                "etcdserver: too many operations in txn request ({ops} compares and operations, over lockcell's limit of {MAX_TXN_OPS})"
            )));
        }
        self.authorize_txn(&request, request.get_ref())?;
        // A Txn that puts with leases runs where the first of them (the lowest ID)
        // lives, and brings the others there: so two Txns on the same leases gather
        // them at one proxy, not each at its own.
        let mut leases: Vec<i64> = txn_puts(request.get_ref())
            .iter()
            .map(|p| p.lease)
            .filter(|lease| *lease != 0)
            .collect();
        leases.sort_unstable();
        leases.dedup();
        let first = leases.first().copied().unwrap_or(0);
        let txn = "/etcdserverpb.KV/Txn";
        let here = || self.txn_here(caller.clone(), &leases, &request);
        self.on_lease((first, txn), &request, caller.as_deref(), |_| false, here)
            .await
    }
    type RangeStreamStream = std::pin::Pin<
        Box<
            dyn tokio_stream::Stream<
                    Item = Result<etcd_client::proto::PbRangeStreamResponse, Status>,
                > + Send,
        >,
    >;

    async fn range_stream(
        &self,
        _request: Request<PbRangeRequest>,
    ) -> Result<Response<Self::RangeStreamStream>, Status> {
        Err(Status::unimplemented(
            "RangeStream is not served through a lockcell proxy; use Range",
        ))
    }

    async fn compact(
        &self,
        _request: Request<etcd_client::proto::PbCompactionRequest>,
    ) -> Result<Response<etcd_client::proto::PbCompactionResponse>, Status> {
        Err(Status::unimplemented(
            "Compact is not served through a lockcell proxy: the cell's operators compact etcd",
        ))
    }
}

impl EtcdApi {
    /// A Txn run here: the first of its `leases` is here (or nowhere); the others are
    /// gathered here first.
    async fn txn_here(
        &self,
        caller: Option<String>,
        leases: &[i64],
        request: &Request<PbTxnRequest>,
    ) -> Result<Response<PbTxnResponse>, Status> {
        self.state.pace(caller.as_deref())?;
        // What the Txn's leased puts may add, each as a new key, for a gather's check.
        let adding = txn_puts(request.get_ref())
            .iter()
            .filter(|p| p.lease != 0)
            .fold((0, 0), |(keys, bytes), p| {
                (keys + 1, bytes + (p.key.len() + 3 + p.value.len()) as u64)
            });
        let writes = self
            .gather(leases, request.metadata(), caller.as_deref(), adding)
            .await?;
        self.txn_holding(caller, request.get_ref(), writes)
            .await
            .map(Response::new)
    }

    /// A Put run here: its lease, if it names one, is here (or nowhere).
    async fn put_here(
        &self,
        caller: Option<String>,
        req: &PbPutRequest,
    ) -> Result<Response<PbPutResponse>, Status> {
        self.state.pace(caller.as_deref())?;
        let state = &self.state;
        check_put(req, state.config.max_value_bytes)?;
        let shown = String::from_utf8_lossy(&req.key).into_owned();
        // A leased write holds off a hand-off until its key is recorded.
        let _writes = match req.lease {
            0 => None,
            _ => Some(self.writes.read().await),
        };
        let session = match req.lease {
            0 => None,
            lease => Some(self.lease_session(lease, caller.as_deref()).await?),
        };
        // A leased key is recorded in its session, which keeps keys as text.
        let key = match &session {
            Some(_) => Some(leased_key(&req.key)?),
            None => None,
        };
        // A key new to the lease counts against its identity's keys, and its bytes
        // past what the lease's record of it counts.
        if let (Some(s), Some(key)) = (&session, &key) {
            let (keys, bytes) = s.adds(key, (key.len() + req.value.len()) as u64);
            state.admit_keys(&s.id, keys, bytes)?;
        }
        let write = WriteSize::put(shown.as_str(), req.value.len(), session.is_none());
        let admitted = state.admit_writes(caller.as_deref(), &[write]).await?;
        let map_revision = state.routes.serve_all([shown.as_str()])?;
        let writer = self.writer(caller, session.as_ref());
        let options = PutOptions::new().with_prev_key();
        let options = match &session {
            Some(s) => options.with_lease(s.lease),
            None => options,
        };
        let op = TxnOp::put(inner(&req.key), req.value.clone(), Some(options));
        let record = record_op(&req.key, session.as_ref().map(|_| req.lease));
        let owner = owner_op(&req.key, session.is_none(), &writer);
        let owners: Vec<&Session> = session.iter().collect();
        let write = self.guarded_for(&owners, vec![op, record, owner], map_revision, &writer);
        let outcome = match (&session, &key) {
            (Some(s), Some(key)) => {
                let pending = Grant::unsettled_etcd_api_key(key.clone(), &s.id, &req.value);
                crate::unsettled::owned_write(
                    state.owners(),
                    s,
                    pending,
                    write,
                    crate::unsettled::unknown_outcome,
                )
                .await
                .ok_or_else(|| Status::not_found(LEASE_NOT_FOUND))?
            }
            _ => write.await,
        }
        .map_err(super::etcd_error)?;
        admitted.landed(Some(outcome.header.as_ref().map_or(0, |h| h.revision)));
        let leased = session.as_ref().zip(key);
        Ok(Response::new(self.put_reply(req, leased, outcome)))
    }

    /// Checks `right` on a client range: one key, a prefix (the key's successor as
    /// `range_end`), or any other range, which takes the right on every small key.
    pub(super) fn authorize_range<T>(
        &self,
        request: &Request<T>,
        right: Right,
        key: &[u8],
        range_end: &[u8],
    ) -> Result<(), Status> {
        let Some(identity) = self.caller(request)? else {
            return Ok(());
        };
        let grants = self.state.grants.current();
        super::auth::check_range(&grants, &identity, right, key, range_end)
    }

    /// A Put's reply, from the etcd transaction that wrote it (the put, then the key's
    /// client lease record): records a leased put in its session, and answers the
    /// previous value as the client sees it, if asked for.
    fn put_reply(
        &self,
        req: &PbPutRequest,
        leased: Option<(&Session, String)>,
        outcome: etcd_client::proto::PbTxnResponse,
    ) -> PbPutResponse {
        let revision = outcome.header.as_ref().map_or(0, |h| h.revision);
        let mut responses = outcome.responses.into_iter();
        let (put, record) = (responses.next(), responses.next());
        let mut prev_kv = match put.and_then(|op| op.response) {
            Some(PbTxnOpResponse::ResponsePut(put)) => put.prev_kv,
            _ => None,
        };
        if let Some((session, key)) = leased {
            let created = prev_kv.as_ref().map_or(revision, |kv| kv.create_revision);
            self.record_leased(session, key, created, revision, req.value.len());
        }
        if let Some(kv) = prev_kv.as_mut() {
            outward_prev(kv, &records_before(record.as_ref()));
        }
        PbPutResponse {
            header: Some(self.header(revision)),
            prev_kv: if req.prev_kv { prev_kv } else { None },
        }
    }

    /// A Range of now answered from the proxy's copy of the small keys: a linearizable
    /// one once the copy has applied the revision a read barrier fixed (one etcd read
    /// shared by the reads of the moment), a serializable one at once. `None` when etcd
    /// must answer: a read at a past revision, a bound that is not text, or a copy that
    /// is loading or lags.
    pub(super) async fn range_from_mirror(
        &self,
        req: &PbRangeRequest,
    ) -> Result<Option<PbRangeResponse>, Status> {
        let reads = &self.state.reads;
        if req.revision != 0 || !reads.feed.is_live() {
            return Ok(None);
        }
        let path = if req.serializable {
            "mirror"
        } else {
            let at = reads.barrier().await?;
            if !reads
                .feed
                .applied_through(at, self.state.config.etcd_timeout)
                .await
            {
                reads.feed.report_stall();
                return Ok(None);
            }
            "barrier"
        };
        let reply = reads.feed.with_mirror(|mirror| {
            let mut reply = mirror_range(mirror, req)?;
            reply.header = Some(self.header(mirror.revision()));
            Some(reply)
        });
        if reply.is_some() {
            ::metrics::counter!(metrics::KV_READS, "path" => path).increment(1);
        }
        Ok(reply)
    }

    /// Records a leased put in its session, for the session's clean-up, and remembers
    /// the client's lease for the key.
    pub(super) fn record_leased(
        &self,
        session: &Session,
        key: String,
        created: i64,
        revision: i64,
        value_bytes: usize,
    ) {
        let grant =
            Grant::etcd_api_key(key.clone(), created, revision).with_value_bytes(value_bytes);
        let state = &self.state;
        if !state
            .sessions
            .record_grant(&session.id, session.incarnation, grant.clone(), None)
        {
            // The lease ended while the write was on its way: the write happened, and
            // the key goes with the lease, as in etcd when a revoke follows a put. The
            // put is not refused: a refusal would say nothing was written.
            state.cleanup.push(session.lease, vec![grant]);
            return;
        }
        // Deleted or rewritten by someone already, and the copy has applied it (so the
        // feed's [`crate::feed::Detached`] came before the record): forgotten here.
        let name = keys::outer(key.as_bytes()).and_then(|k| std::str::from_utf8(k).ok());
        let lost = state.reads.feed.with_mirror(|mirror| {
            mirror.revision() >= revision
                && name
                    .and_then(|n| mirror.get(n))
                    .map(|e| (e.create_revision, e.client_lease))
                    != Some((
                        created,
                        super::lease::lease_of(&session.id).unwrap_or_default(),
                    ))
        });
        // Only this write's record: a later write of the key with the lease, recorded
        // meanwhile, is the session's.
        if lost {
            state.sessions.forget(&session.id, &grant);
        }
    }

    /// A key etcd answered with as the client sees it: its client key, and its client
    /// lease ([`EtcdApi::client_lease`]).
    pub(super) fn outward_kv(&self, kv: &mut PbKeyValue) {
        kv.lease = self.client_lease(kv);
        outward_key(kv);
    }

    /// The client lease of a key etcd answered with: the one the proxy's copy of the
    /// small keys shows for that write of the key (its mod revision and proxy lease),
    /// which every proxy reads from the key's record. 0 for a key on no lease, and for
    /// one written again since that the copy no longer knows; callers wait for the copy
    /// to catch up with etcd's answer first ([`EtcdApi::caught_up`]).
    pub(super) fn client_lease(&self, kv: &PbKeyValue) -> i64 {
        let Some(name) = (kv.lease != 0)
            .then(|| keyspace::kv_name(&kv.key))
            .flatten()
        else {
            return 0;
        };
        self.state.reads.feed.with_mirror(|mirror| {
            mirror
                .get(name)
                .filter(|e| e.mod_revision == kv.mod_revision && e.lease == kv.lease)
                .map_or(0, |e| e.client_lease)
        })
    }

    pub(super) fn outward_range(&self, reply: &mut PbRangeResponse) {
        let revision = reply.header.as_ref().map_or(0, |h| h.revision);
        reply.header = Some(self.header(revision));
        for kv in &mut reply.kvs {
            self.outward_kv(kv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_range_over_a_leased_key_waits_for_the_copy() {
        let op = |response: PbTxnOpResponse| PbResponseOp {
            response: Some(response),
        };
        let range = |lease: i64| {
            op(PbTxnOpResponse::ResponseRange(PbRangeResponse {
                kvs: vec![PbKeyValue {
                    key: b"/k/a".to_vec(),
                    lease,
                    ..PbKeyValue::default()
                }],
                ..PbRangeResponse::default()
            }))
        };
        let txn = |responses: Vec<PbResponseOp>| PbTxnResponse {
            responses,
            ..PbTxnResponse::default()
        };
        let put = || op(PbTxnOpResponse::ResponsePut(PbPutResponse::default()));
        assert!(!ranges_leased_keys(&txn(vec![put()])));
        assert!(!ranges_leased_keys(&txn(vec![put(), range(0)])));
        assert!(ranges_leased_keys(&txn(vec![put(), range(7)])));
        let nested = op(PbTxnOpResponse::ResponseTxn(txn(vec![range(7)])));
        assert!(ranges_leased_keys(&txn(vec![nested])));
    }

    fn mirror() -> Mirror {
        let entry = |name: &str, value: &str, create: i64, modified: i64, version: i64| Entry {
            name: name.into(),
            value: value.as_bytes().to_vec(),
            create_revision: create,
            mod_revision: modified,
            version,
            lease: 0,
            client_lease: 0,
        };
        Mirror::new(
            [
                entry("a", "3", 2, 9, 4),
                entry("b/1", "1", 3, 3, 1),
                entry("b/2", "2", 4, 8, 2),
                entry("c", "0", 5, 5, 1),
            ],
            9,
        )
    }

    fn range(key: &[u8], end: &[u8]) -> PbRangeRequest {
        PbRangeRequest {
            key: key.to_vec(),
            range_end: end.to_vec(),
            ..PbRangeRequest::default()
        }
    }

    fn names(reply: &PbRangeResponse) -> Vec<String> {
        reply
            .kvs
            .iter()
            .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
            .collect()
    }

    #[test]
    fn the_mirror_answers_a_range_as_etcd_would() {
        let m = mirror();
        let one = mirror_range(&m, &range(b"a", b"")).unwrap();
        assert_eq!(
            (names(&one), one.count, one.more),
            (vec!["/k/a".into()], 1, false)
        );
        let prefix = mirror_range(&m, &range(b"b/", b"b0")).unwrap();
        assert_eq!(names(&prefix), ["/k/b/1", "/k/b/2"]);
        let from = mirror_range(&m, &range(b"b/2", b"\0")).unwrap();
        assert_eq!(names(&from), ["/k/b/2", "/k/c"]);
        let all = mirror_range(&m, &range(b"\0", b"\0")).unwrap();
        assert_eq!(all.count, 4);
        let backwards = mirror_range(&m, &range(b"c", b"a")).unwrap();
        assert_eq!((backwards.count, backwards.kvs.len()), (0, 0));
        // A limit cuts after the sort, and says more; the count is of the whole range.
        let page = mirror_range(
            &m,
            &PbRangeRequest {
                limit: 2,
                sort_target: SortTarget::Mod as i32,
                sort_order: SortOrder::Descend as i32,
                ..range(b"\0", b"\0")
            },
        )
        .unwrap();
        assert_eq!(
            (names(&page), page.count, page.more),
            (vec!["/k/a".into(), "/k/b/2".into()], 4, true)
        );
        // A target other than the key sorts ascending when no order is given.
        let by_version = mirror_range(
            &m,
            &PbRangeRequest {
                sort_target: SortTarget::Version as i32,
                ..range(b"\0", b"\0")
            },
        )
        .unwrap();
        assert_eq!(by_version.kvs.last().map(|kv| kv.version), Some(4));
        // Revision filters leave the count alone; keys_only drops values.
        let filtered = mirror_range(
            &m,
            &PbRangeRequest {
                min_create_revision: 3,
                max_mod_revision: 5,
                keys_only: true,
                ..range(b"\0", b"\0")
            },
        )
        .unwrap();
        assert_eq!(
            (names(&filtered), filtered.count),
            (vec!["/k/b/1".into(), "/k/c".into()], 4)
        );
        assert!(filtered.kvs.iter().all(|kv| kv.value.is_empty()));
        let counted = mirror_range(
            &m,
            &PbRangeRequest {
                count_only: true,
                ..range(b"b/", b"b0")
            },
        )
        .unwrap();
        assert_eq!((counted.count, counted.kvs.len()), (2, 0));
        // A bound that is not text is left to etcd.
        assert!(mirror_range(&m, &range(b"b/", &[0xff, 0xfe])).is_none());
    }

    fn lease_compare(key: &str, result: CompareOp, lease: i64) -> PbCompare {
        PbCompare {
            result: result as i32,
            target: etcd_client::proto::PbCompareTarget::Lease as i32,
            key: key.as_bytes().to_vec(),
            target_union: Some(etcd_client::proto::PbTargetUnion::Lease(lease)),
            range_end: Vec::new(),
        }
    }

    #[test]
    fn a_lease_compare_is_decided_on_the_client_lease_read() {
        let leases: LeasesCompared = [
            (b"held".to_vec(), (7, 20)),
            (b"plain".to_vec(), (0, 21)),
            (b"absent".to_vec(), (0, 0)),
        ]
        .into();
        // Always true: a mod revision above -1; always false: one below 0.
        let always = |holds: bool| match holds {
            true => (CompareOp::Greater as i32, -1),
            false => (CompareOp::Less as i32, 0),
        };
        for (key, op, lease, holds) in [
            ("held", CompareOp::Equal, 7, true),
            ("held", CompareOp::Equal, 8, false),
            ("held", CompareOp::NotEqual, 7, false),
            ("held", CompareOp::Greater, 6, true),
            ("held", CompareOp::Less, 7, false),
            ("plain", CompareOp::Equal, 0, true),
            ("absent", CompareOp::Equal, 0, true),
            ("absent", CompareOp::NotEqual, 7, true),
            ("absent", CompareOp::Less, 7, true),
        ] {
            let inward = inward_compare(&lease_compare(key, op, lease), &leases).unwrap();
            let pb: PbTxnRequest = Txn::new().when([inward]).into();
            let pb = pb.compare[0].clone();
            let got = match pb.target_union {
                Some(etcd_client::proto::PbTargetUnion::ModRevision(r)) => (pb.result, r),
                other => panic!("{key} {op:?} {lease}: {other:?}"),
            };
            assert_eq!(got, always(holds), "{key} {op:?} {lease}");
            assert_eq!(pb.key, inner(key.as_bytes()));
        }
    }

    #[test]
    fn a_lease_compare_names_one_key_and_counts_twice() {
        let txn = |compare: Vec<PbCompare>| PbTxnRequest {
            compare,
            ..PbTxnRequest::default()
        };
        let mut ops = 0;
        check_txn(
            &txn(vec![lease_compare("k", CompareOp::Equal, 1)]),
            10,
            &mut ops,
        )
        .unwrap();
        assert_eq!(ops, 2);
        let ranged = PbCompare {
            range_end: b"l".to_vec(),
            ..lease_compare("k", CompareOp::Equal, 1)
        };
        let refused = check_txn(&txn(vec![ranged]), 10, &mut 0).unwrap_err();
        assert!(refused.message().contains("names one key"), "{refused:?}");
        let empty = lease_compare("", CompareOp::Equal, 1);
        let refused = check_txn(&txn(vec![empty]), 10, &mut 0).unwrap_err();
        assert_eq!(refused.message(), "etcdserver: key is not provided");
    }
}
