//! The grant transaction, built and read as pure functions, and the compares and reply
//! readers every lock-log transaction shares. Nothing here talks to etcd: the unit
//! tests below check the compares a transaction makes and how each reply reads.

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};

use super::{Acquired, Grant, HolderRecord};
use crate::error::CellError;
use crate::keyspace::{self, LockName, Mode};

/// The transaction that grants `lock` in `mode` to `record.session` on `lease` (see
/// [`LockLog::acquire`](super::LockLog::acquire)), and how its reply reads.
#[derive(Debug, Clone, Copy)]
pub(super) struct GrantTxn<'a> {
    pub lock: &'a LockName,
    pub mode: Mode,
    pub lease: i64,
    pub record: &'a HolderRecord,
    /// Fair classes: the waiter's id and the create revision of its waiter key, which
    /// must still be there (on `lease`) and goes in the same transaction.
    pub queued: Option<(&'a str, i64)>,
    pub map_revision: i64,
    /// The mod revision of the epoch record tokens are minted under, when guarded.
    pub epoch_revision: Option<i64>,
}

impl GrantTxn<'_> {
    /// The session's holder key in the mode asked.
    fn key(&self) -> String {
        self.lock.holder_key(self.mode, &self.record.session)
    }

    /// The session's key in the other mode: it would hold the lock too.
    fn other(&self) -> String {
        self.lock
            .holder_key(self.mode.other(), &self.record.session)
    }

    /// If the lock's holders let `mode` in, the holder key is absent, the shard map and
    /// the epoch record are as the proxy knows them and (fair classes) the waiter key is
    /// still in line on this lease: put the holder key on the lease, delete the lock's
    /// release marker and the waiter key. Otherwise read what stood in the way.
    pub fn txn(&self) -> Txn {
        let (lock, key) = (self.lock, self.key());
        let body = serde_json::to_vec(self.record).expect("holder record serializes");
        let mut when = vec![
            holders_compatible(lock, self.mode),
            // A shared grant never writes over the session's own shared key (an
            // exclusive one is covered by the compare above).
            Compare::create_revision(key.as_bytes(), CompareOp::Equal, 0),
            map_guard(self.map_revision),
        ];
        let mut then = vec![
            TxnOp::put(
                key.as_bytes(),
                body,
                Some(PutOptions::new().with_lease(self.lease)),
            ),
            // The last clean release's marker has done its work (its write was seen).
            TxnOp::delete(lock.released_key().as_bytes(), None),
        ];
        if let Some((waiter, queued)) = self.queued {
            let waiter = lock.waiter_key(self.mode, waiter);
            when.push(Compare::create_revision(
                waiter.as_bytes(),
                CompareOp::Equal,
                queued,
            ));
            // And still on this proxy's lease: a waiter key that moved with its session
            // to another proxy is that proxy's to grant.
            when.push(Compare::lease(
                waiter.as_bytes(),
                CompareOp::Equal,
                self.lease,
            ));
            then.push(TxnOp::delete(waiter.as_bytes(), None));
        }
        let mut otherwise = vec![
            TxnOp::get(key.as_bytes(), None),
            TxnOp::get(self.other().as_bytes(), None),
            TxnOp::get(keyspace::shardmap_key(), None),
        ];
        if let Some(epoch_revision) = self.epoch_revision {
            let epoch = keyspace::epoch_key();
            when.push(Compare::mod_revision(
                epoch,
                CompareOp::Equal,
                epoch_revision,
            ));
            otherwise.push(TxnOp::get(epoch, None));
        }
        Txn::new().when(when).and_then(then).or_else(otherwise)
    }

    /// What the reply to [`Self::txn`] says: granted (fresh, or this same call's grant
    /// found again), or busy as of the reply's revision. The session holding the lock
    /// through another call is [`CellError::AlreadyHeld`]; a changed epoch record or
    /// shard map is an error too.
    pub fn read(&self, resp: &TxnResponse) -> Result<Acquired, CellError> {
        let key = self.key();
        // A reply without a revision would read as a grant at revision 0.
        let seen_at = resp
            .header()
            .map(|h| h.revision())
            .filter(|r| *r > 0)
            .ok_or_else(|| CellError::CorruptRecord {
                key: key.clone(),
                reason: "etcd's reply to the acquire carries no revision".to_owned(),
            })?;
        if resp.succeeded() {
            // The key was absent, so the put created it: its create revision is the
            // transaction's.
            return Ok(Acquired::Granted {
                revision: seen_at,
                fresh: true,
            });
        }
        let ops = resp.op_responses();
        check_epoch(self.epoch_revision, &ops)?;
        check_map(&ops, self.map_revision)?;
        let (mode, record) = (self.mode, self.record);
        for (held_key, held_mode) in [(&key, mode), (&self.other(), mode.other())] {
            let Some(kv) = kv_of(&ops, held_key) else {
                continue;
            };
            let held = decode(held_key, kv.value())?;
            // The exclusive key is every session's; a key on another lease is being
            // moved or cleaned up and is waited for like any holder.
            if held.session != record.session || kv.lease() != self.lease {
                continue;
            }
            let same_call = !held.call.is_empty()
                && held.call == record.call
                && held.election == record.election;
            if held_mode == mode && same_call {
                return Ok(Acquired::Granted {
                    revision: kv.create_revision(),
                    fresh: false,
                });
            }
            return Err(CellError::AlreadyHeld {
                lock: self.lock.as_str().to_owned(),
                mode: held_mode,
                revision: kv.create_revision(),
            });
        }
        Ok(Acquired::Busy { seen_at })
    }
}

/// Fails when the epoch record read back by a refused grant is not the one written at
/// `expected`, which tokens are minted under (no check without one).
fn check_epoch(expected: Option<i64>, ops: &[TxnOpResponse]) -> Result<(), CellError> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let epoch = keyspace::epoch_key();
    match kv_of(ops, epoch) {
        Some(kv) if kv.mod_revision() == expected => Ok(()),
        Some(kv) => Err(CellError::CellChanged {
            reason: format!(
                "the epoch record {epoch} was rewritten at revision {} (it was written at {expected} when this proxy started): the cell was restored and its epoch raised; restart the proxy to serve the new epoch",
                kv.mod_revision()
            ),
        }),
        None => Err(CellError::CellChanged {
            reason: format!("the epoch record {epoch} is gone; the store is not the cell this proxy started on"),
        }),
    }
}

/// The compare that lets `mode` in: no holder at all for exclusive, no exclusive holder
/// for shared. A range compare holds only when every key in the range satisfies it, and
/// an empty range compares as an absent key.
pub(super) fn holders_compatible(lock: &LockName, mode: Mode) -> Compare {
    match mode {
        Mode::Exclusive => {
            let (start, end) = lock.holders_range();
            Compare::create_revision(start.as_bytes(), CompareOp::Equal, 0)
                .with_range(end.as_bytes())
        }
        Mode::Shared => {
            Compare::create_revision(lock.exclusive_key().as_bytes(), CompareOp::Equal, 0)
        }
    }
}

/// The compare every grant and write makes: the cell's copy of the shard map is still
/// the one the proxy checked the name against (mod revision 0: the cell has none). A
/// prefix that starts to move pauses in its cell by a write of that copy, which fails
/// every grant in flight there.
pub fn map_guard(map_revision: i64) -> Compare {
    Compare::mod_revision(keyspace::shardmap_key(), CompareOp::Equal, map_revision)
}

/// Fails with [`CellError::MapChanged`] when a refused transaction read back a shard map
/// copy other than the one it was guarded by.
pub fn check_map(ops: &[TxnOpResponse], map_revision: i64) -> Result<(), CellError> {
    let now = kv_of(ops, keyspace::shardmap_key())
        .map(|kv| kv.mod_revision())
        .unwrap_or_default();
    if now == map_revision {
        Ok(())
    } else {
        Err(CellError::MapChanged { now })
    }
}

/// Delete `grant`'s key only while it is still that grant on `lease` (for an ephemeral
/// key: no one wrote it since the session did, see [`Grant::written`]); a clean release
/// also writes the lock's release marker in the same revision. Only that write is read
/// (as a watch event); the marker itself lives on the holder's lease and is deleted by
/// its proxy afterwards ([`Grant::release_marker`]), or by the next grant of the lock,
/// so markers never pile up.
pub(super) fn guarded_delete(grant: &Grant, lease: i64, clean: bool) -> Txn {
    let mut then = vec![TxnOp::delete(grant.key.as_bytes(), None)];
    // A key of the etcd API goes with its client lease record.
    if let Some(record) = grant.lease_record() {
        then.push(TxnOp::delete(record, None));
    }
    if clean {
        then.push(TxnOp::put(
            grant.lock.released_key().as_bytes(),
            grant.revision.to_string(),
            Some(PutOptions::new().with_lease(lease)),
        ));
    }
    let txn = Txn::new().when(grant.unchanged(lease)).and_then(then);
    match grant.lease_record().filter(|_| grant.written != 0) {
        // The key was written since by a write that left its record alone (lockcell's
        // own API): the record is still about the session's write, and goes with it.
        Some(record) => txn.or_else([TxnOp::txn(
            Txn::new()
                .when([Compare::mod_revision(
                    record.as_slice(),
                    CompareOp::Equal,
                    grant.written,
                )])
                .and_then([TxnOp::delete(record, None)]),
        )]),
        None => txn,
    }
}

/// The revision of a transaction's reply (for one that wrote: the revision it wrote at).
pub(super) fn txn_revision(resp: &etcd_client::TxnResponse) -> Result<i64, CellError> {
    resp.header()
        .map(|h| h.revision())
        .filter(|r| *r > 0)
        .ok_or_else(|| CellError::CorruptRecord {
            key: "move txn".to_owned(),
            reason: "etcd's reply carries no revision".to_owned(),
        })
}

/// The key-value `key` read by one of `ops`, if it was there.
pub(super) fn kv_of<'a>(ops: &'a [TxnOpResponse], key: &str) -> Option<&'a etcd_client::KeyValue> {
    ops.iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().filter(|kv| kv.key() == key.as_bytes()),
        _ => None,
    })
}

pub(super) fn first_kv(ops: &[TxnOpResponse]) -> Option<&etcd_client::KeyValue> {
    ops.iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first(),
        _ => None,
    })
}

pub(super) fn decode(key: &str, value: &[u8]) -> Result<HolderRecord, CellError> {
    serde_json::from_slice(value).map_err(|e| CellError::CorruptRecord {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use etcd_client::proto::{
        PbCompare, PbKeyValue, PbRangeResponse, PbResponseHeader, PbResponseOp, PbTargetUnion,
        PbTxnOpRequest, PbTxnOpResponse, PbTxnRequest, PbTxnResponse,
    };
    use proptest::prelude::*;

    use super::*;

    const LEASE: i64 = 0x10;
    const MAP: i64 = 40;
    const EPOCH: i64 = 3;

    fn lock() -> LockName {
        LockName::parse("jobs/nightly").unwrap()
    }

    fn record(session: &str, call: &str) -> HolderRecord {
        HolderRecord {
            session: session.to_owned(),
            call: call.to_owned(),
            proxy: "p1".to_owned(),
            ..HolderRecord::default()
        }
    }

    fn grant<'a>(lock: &'a LockName, mode: Mode, record: &'a HolderRecord) -> GrantTxn<'a> {
        GrantTxn {
            lock,
            mode,
            lease: LEASE,
            record,
            queued: None,
            map_revision: MAP,
            epoch_revision: Some(EPOCH),
        }
    }

    /// A compare as text: `create(KEY..END) = 0`, `mod(KEY) = 40`, `lease(KEY) = 16`.
    fn compare(c: &PbCompare) -> String {
        let key = String::from_utf8_lossy(&c.key);
        let range = if c.range_end.is_empty() {
            String::new()
        } else {
            format!("..{}", String::from_utf8_lossy(&c.range_end))
        };
        let (what, value) = match &c.target_union {
            Some(PbTargetUnion::CreateRevision(v)) => ("create", *v),
            Some(PbTargetUnion::ModRevision(v)) => ("mod", *v),
            Some(PbTargetUnion::Lease(v)) => ("lease", *v),
            other => panic!("unexpected compare {other:?}"),
        };
        assert_eq!(c.result, 0, "every compare here is an equality");
        format!("{what}({key}{range}) = {value}")
    }

    /// An operation as text: `put KEY lease L`, `delete KEY`, `get KEY`.
    fn op(op: &etcd_client::proto::PbTxnRequestOp) -> String {
        match op.request.as_ref().expect("an operation") {
            PbTxnOpRequest::RequestPut(p) => {
                format!("put {} lease {}", String::from_utf8_lossy(&p.key), p.lease)
            }
            PbTxnOpRequest::RequestDeleteRange(d) => {
                format!("delete {}", String::from_utf8_lossy(&d.key))
            }
            PbTxnOpRequest::RequestRange(r) => format!("get {}", String::from_utf8_lossy(&r.key)),
            PbTxnOpRequest::RequestTxn(_) => "txn".to_owned(),
        }
    }

    fn shown(txn: Txn) -> (Vec<String>, Vec<String>, Vec<String>) {
        let req: PbTxnRequest = txn.into();
        (
            req.compare.iter().map(compare).collect(),
            req.success.iter().map(op).collect(),
            req.failure.iter().map(op).collect(),
        )
    }

    fn kv(key: &str, value: &[u8], create: i64, modified: i64, lease: i64) -> PbKeyValue {
        PbKeyValue {
            key: key.as_bytes().to_vec(),
            create_revision: create,
            mod_revision: modified,
            version: 1,
            value: value.to_vec(),
            lease,
        }
    }

    /// A reply at `revision`; when it failed, one range reply per `read` (empty: the
    /// key was absent), in the order the transaction asked.
    fn reply(revision: i64, succeeded: bool, read: Vec<Option<PbKeyValue>>) -> TxnResponse {
        TxnResponse(PbTxnResponse {
            header: (revision > 0).then(|| PbResponseHeader {
                revision,
                ..PbResponseHeader::default()
            }),
            succeeded,
            responses: read
                .into_iter()
                .map(|kv| PbResponseOp {
                    response: Some(PbTxnOpResponse::ResponseRange(PbRangeResponse {
                        count: kv.is_some() as i64,
                        kvs: kv.into_iter().collect(),
                        ..PbRangeResponse::default()
                    })),
                })
                .collect(),
        })
    }

    /// The reads of a refused grant: the session's key, its key in the other mode, the
    /// shard map and the epoch record as the proxy knows them.
    fn refused(at: i64, own: Option<PbKeyValue>, other: Option<PbKeyValue>) -> TxnResponse {
        let map = kv(keyspace::shardmap_key(), b"{}", 1, MAP, 0);
        let epoch = kv(keyspace::epoch_key(), b"{}", 1, EPOCH, 0);
        reply(at, false, vec![own, other, Some(map), Some(epoch)])
    }

    fn held_by(record: &HolderRecord, key: &str, create: i64, lease: i64) -> PbKeyValue {
        kv(
            key,
            &serde_json::to_vec(record).unwrap(),
            create,
            create,
            lease,
        )
    }

    #[test]
    fn an_exclusive_grant_compares_every_holder_the_map_and_the_epoch() {
        let (lock, me) = (lock(), record("s1", "c1"));
        let (compares, then, otherwise) = shown(grant(&lock, Mode::Exclusive, &me).txn());
        let (start, end) = lock.holders_range();
        let key = lock.holder_key(Mode::Exclusive, "s1");
        let other = lock.holder_key(Mode::Shared, "s1");
        assert_eq!(
            compares,
            vec![
                format!("create({start}..{end}) = 0"),
                format!("create({key}) = 0"),
                format!("mod({}) = {MAP}", keyspace::shardmap_key()),
                format!("mod({}) = {EPOCH}", keyspace::epoch_key()),
            ]
        );
        assert_eq!(
            then,
            vec![
                format!("put {key} lease {LEASE}"),
                format!("delete {}", lock.released_key()),
            ]
        );
        assert_eq!(
            otherwise,
            vec![
                format!("get {key}"),
                format!("get {other}"),
                format!("get {}", keyspace::shardmap_key()),
                format!("get {}", keyspace::epoch_key()),
            ]
        );
    }

    #[test]
    fn a_shared_grant_compares_only_the_exclusive_holder() {
        let (lock, me) = (lock(), record("s1", "c1"));
        let mut txn = grant(&lock, Mode::Shared, &me);
        txn.epoch_revision = None;
        let (compares, then, otherwise) = shown(txn.txn());
        let key = lock.holder_key(Mode::Shared, "s1");
        assert_eq!(
            compares,
            vec![
                format!("create({}) = 0", lock.exclusive_key()),
                format!("create({key}) = 0"),
                format!("mod({}) = {MAP}", keyspace::shardmap_key()),
            ],
            "no epoch compare without an epoch guard"
        );
        assert_eq!(then[0], format!("put {key} lease {LEASE}"));
        assert_eq!(otherwise.len(), 3);
    }

    #[test]
    fn a_fair_grant_takes_its_own_waiter_key_on_this_lease_out_of_line() {
        let (lock, me) = (lock(), record("s1", "c1"));
        let mut txn = grant(&lock, Mode::Exclusive, &me);
        txn.queued = Some(("s1-w1", 31));
        let (compares, then, _) = shown(txn.txn());
        let waiter = lock.waiter_key(Mode::Exclusive, "s1-w1");
        assert!(compares.contains(&format!("create({waiter}) = 31")));
        assert!(
            compares.contains(&format!("lease({waiter}) = {LEASE}")),
            "a waiter key that moved to another proxy's lease is that proxy's to grant"
        );
        assert!(then.contains(&format!("delete {waiter}")));
    }

    #[test]
    fn a_grant_that_went_through_is_fresh_at_the_replys_revision() {
        let (lock, me) = (lock(), record("s1", "c1"));
        let read = grant(&lock, Mode::Exclusive, &me).read(&reply(57, true, vec![]));
        assert_eq!(
            read.unwrap(),
            Acquired::Granted {
                revision: 57,
                fresh: true
            }
        );
    }

    #[test]
    fn a_reply_without_a_revision_is_never_a_grant() {
        let (lock, me) = (lock(), record("s1", "c1"));
        let read = grant(&lock, Mode::Exclusive, &me).read(&reply(0, true, vec![]));
        assert!(matches!(read, Err(CellError::CorruptRecord { .. })));
    }

    #[test]
    fn a_retried_call_finds_its_grant_and_another_call_of_the_session_is_refused() {
        let lock = lock();
        let key = lock.holder_key(Mode::Exclusive, "s1");
        let mine = held_by(&record("s1", "c1"), &key, 20, LEASE);
        let retry = record("s1", "c1");
        let read =
            grant(&lock, Mode::Exclusive, &retry).read(&refused(60, Some(mine.clone()), None));
        assert_eq!(
            read.unwrap(),
            Acquired::Granted {
                revision: 20,
                fresh: false
            }
        );
        let second = record("s1", "c2");
        let read = grant(&lock, Mode::Exclusive, &second).read(&refused(60, Some(mine), None));
        assert!(
            matches!(read, Err(CellError::AlreadyHeld { revision: 20, .. })),
            "two calls sharing one grant would let one release end the other's: {read:?}"
        );
    }

    #[test]
    fn a_hold_in_the_other_mode_is_the_sessions_too() {
        let lock = lock();
        let shared = lock.holder_key(Mode::Shared, "s1");
        let mine = held_by(&record("s1", "c1"), &shared, 20, LEASE);
        let same_call = record("s1", "c1");
        let read = grant(&lock, Mode::Exclusive, &same_call).read(&refused(60, None, Some(mine)));
        assert!(
            matches!(
                read,
                Err(CellError::AlreadyHeld {
                    mode: Mode::Shared,
                    ..
                })
            ),
            "the same call asking in the other mode is not its grant: {read:?}"
        );
    }

    #[test]
    fn a_refused_grant_whose_epoch_or_map_changed_is_an_error() {
        let (lock, me) = (lock(), record("s1", "c1"));
        let txn = grant(&lock, Mode::Exclusive, &me);
        let map = kv(keyspace::shardmap_key(), b"{}", 1, MAP, 0);
        let raised = kv(keyspace::epoch_key(), b"{}", 1, EPOCH + 5, 0);
        let read = txn.read(&reply(
            60,
            false,
            vec![None, None, Some(map.clone()), Some(raised)],
        ));
        assert!(
            matches!(read, Err(CellError::CellChanged { .. })),
            "{read:?}"
        );
        let read = txn.read(&reply(60, false, vec![None, None, Some(map), None]));
        assert!(
            matches!(read, Err(CellError::CellChanged { .. })),
            "epoch gone: {read:?}"
        );
        let moved = kv(keyspace::shardmap_key(), b"{}", 1, MAP + 1, 0);
        let epoch = kv(keyspace::epoch_key(), b"{}", 1, EPOCH, 0);
        let read = txn.read(&reply(
            60,
            false,
            vec![None, None, Some(moved), Some(epoch)],
        ));
        assert!(
            matches!(read, Err(CellError::MapChanged { now } ) if now == MAP + 1),
            "{read:?}"
        );
    }

    #[test]
    fn a_move_takes_the_fence_it_found_and_only_with_a_hand_off_record_as_read() {
        use super::super::moves::resume_txn;
        let lock = lock();
        let held = vec![(Grant::hold(&lock, Mode::Exclusive, "s1", 20), LEASE)];
        let fence = "/s/fence";
        // No fence yet: the move is the session's first, and takes it only if none
        // was written meanwhile.
        let (compares, then, otherwise) = shown(resume_txn(fence, 0, &held, 99, "p2", None));
        assert_eq!(compares, vec![format!("create({fence}) = 0")]);
        assert_eq!(
            then,
            vec![
                format!("put {fence} lease 99"),
                format!("get {fence}"),
                "txn".to_owned()
            ],
            "the fence goes on the new lease, is read back, and each key moves in a txn of its own"
        );
        assert_eq!(otherwise, vec![format!("get {fence}")]);
        // A fence seen at revision 7: only if no other proxy took it since.
        let (compares, _, _) = shown(resume_txn(fence, 7, &held, 99, "p2", None));
        assert_eq!(compares, vec![format!("mod({fence}) = 7")]);
        // Taken over from a hand-off record: only the record as read, deleted with it.
        let (compares, then, _) = shown(resume_txn(
            fence,
            7,
            &held,
            99,
            "p2",
            Some(("/s/handoff/1", 30)),
        ));
        assert_eq!(
            compares,
            vec![
                format!("mod({fence}) = 7"),
                "mod(/s/handoff/1) = 30".to_owned()
            ]
        );
        assert_eq!(then.last().map(String::as_str), Some("delete /s/handoff/1"));
    }

    #[test]
    fn a_guarded_delete_compares_the_grant_and_its_lease() {
        let lock = lock();
        let hold = Grant::hold(&lock, Mode::Exclusive, "s1", 20);
        let (compares, then, _) = shown(guarded_delete(&hold, LEASE, true));
        assert_eq!(
            compares,
            vec![
                format!("create({}) = 20", hold.key),
                format!("lease({}) = {LEASE}", hold.key),
            ]
        );
        assert_eq!(
            then,
            vec![
                format!("delete {}", hold.key),
                format!("put {} lease {LEASE}", lock.released_key()),
            ],
            "a clean release writes the lock's release marker in the same revision"
        );
        let (_, then, _) = shown(guarded_delete(&hold, LEASE, false));
        assert_eq!(
            then,
            vec![format!("delete {}", hold.key)],
            "a vanished holder: no marker"
        );
        // An ephemeral key is the session's while nobody wrote it since: its mod revision.
        let member = Grant::ephemeral(&LockName::parse("members/a").unwrap(), 8, 12);
        let (compares, _, _) = shown(guarded_delete(&member, LEASE, false));
        assert_eq!(compares[0], format!("mod({}) = 12", member.key));
        // A release marker is deleted only while it is the write it was.
        let marker = Grant::release_marker(&lock, 70);
        let (compares, then, _) = shown(guarded_delete(&marker, LEASE, false));
        assert_eq!(
            compares,
            vec![
                format!("mod({}) = 70", lock.released_key()),
                format!("lease({}) = {LEASE}", lock.released_key()),
            ]
        );
        assert_eq!(then, vec![format!("delete {}", lock.released_key())]);
    }

    proptest! {
        /// However the keys a refused grant reads back stand (whose session, which
        /// call, which lease, which mode), the reply is a grant only for the very call
        /// that made it, on this lease and in this mode, and never a fresh one.
        #[test]
        fn a_refused_grant_is_only_ever_the_same_calls_grant(
            exclusive in any::<bool>(),
            found_own_mode in any::<bool>(),
            same_session in any::<bool>(),
            same_call in any::<bool>(),
            empty_call in any::<bool>(),
            election_differs in any::<bool>(),
            same_lease in any::<bool>(),
        ) {
            let lock = lock();
            let mode = if exclusive { Mode::Exclusive } else { Mode::Shared };
            let me = record("s1", "c1");
            let mut found = record(
                if same_session { "s1" } else { "s2" },
                if empty_call { "" } else if same_call { "c1" } else { "c2" },
            );
            found.election = election_differs;
            let found_mode = if found_own_mode { mode } else { mode.other() };
            let key = lock.holder_key(found_mode, "s1");
            let lease = if same_lease { LEASE } else { LEASE + 1 };
            let held = held_by(&found, &key, 20, lease);
            let reply = if found_own_mode {
                refused(60, Some(held), None)
            } else {
                refused(60, None, Some(held))
            };
            let read = grant(&lock, mode, &me).read(&reply);
            let its_own = same_session && same_lease;
            let same = its_own && found_own_mode && same_call && !empty_call && !election_differs;
            match read {
                Ok(Acquired::Granted { revision, fresh }) => {
                    prop_assert!(same, "granted to another call's hold");
                    prop_assert!(!fresh);
                    prop_assert_eq!(revision, 20);
                }
                Ok(Acquired::Busy { seen_at }) => {
                    prop_assert!(!its_own, "the session's own hold read as busy");
                    prop_assert_eq!(seen_at, 60);
                }
                Err(CellError::AlreadyHeld { .. }) => prop_assert!(its_own && !same),
                Err(other) => prop_assert!(false, "unexpected {:?}", other),
            }
        }
    }
}
