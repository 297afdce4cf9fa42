//! Keys moving from one lease to another (a session resuming on another proxy), each
//! under its own guard, fenced by the session's fence.

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

use super::txn::{first_kv, txn_revision};
use super::{Grant, LockLog, MAX_DELETES_PER_TXN};
use crate::error::{with_timeout, CellError};
use crate::keyspace::LockName;

impl LockLog {
    /// Moves `keys`, each from the lease it is on (the second of each pair), onto lease
    /// `to`, each under its own guard: still the grant (its create revision, or for an
    /// ephemeral key its mod revision, see [`Grant::written`]) and its lease the one
    /// given. A move keeps the key's value and create revision, so fencing tokens do not
    /// change. A key already on `to`, still the grant, counts as moved. Returns what
    /// became of each key.
    pub async fn move_keys(&self, keys: &[(Grant, i64)], to: i64) -> Result<Vec<Moved>, CellError> {
        let mut outcomes = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(MAX_DELETES_PER_TXN) {
            let txn = Txn::new().and_then(moves(chunk, to));
            let resp = with_timeout("move txn", self.timeout, self.kv.txn(txn)).await?;
            let revision = txn_revision(&resp)?;
            outcomes.extend(move_outcomes(chunk, &resp.op_responses(), revision));
        }
        Ok(outcomes)
    }

    /// Moves a resuming session's `keys` onto lease `to` (as [`move_keys`]), fenced: the
    /// first transaction compares the session's fence (`/s/<session>`) with `fence`,
    /// the mod revision the client last heard of (0: none yet), and puts it on `to` at a
    /// new revision; later transactions (over 64 keys) compare that new revision. So a
    /// resume the client gave up on (its reply lost) can never land after a later one.
    ///
    /// [`move_keys`]: LockLog::move_keys
    pub async fn resume(
        &self,
        session: &LockName,
        fence: i64,
        keys: &[(Grant, i64)],
        to: i64,
        proxy: &str,
    ) -> Result<Resume, CellError> {
        self.resume_guarded(session, fence, keys, to, proxy, None)
            .await
    }

    /// [`resume`](LockLog::resume), with one more guard on the first transaction: the
    /// key `guard` names is still at that mod revision, and is deleted by the move (a
    /// hand-off record, which only one move may take). A guard that fails reads as
    /// [`Resume::FenceMoved`]: nothing moved.
    pub async fn resume_guarded(
        &self,
        session: &LockName,
        fence: i64,
        keys: &[(Grant, i64)],
        to: i64,
        proxy: &str,
        guard: Option<(&str, i64)>,
    ) -> Result<Resume, CellError> {
        let fence_key = crate::keyspace::session_fence_key(session.as_str());
        let mut chunks = keys.chunks(MAX_DELETES_PER_TXN);
        let first = chunks.next().unwrap_or(&[]);
        let txn = resume_txn(&fence_key, fence, first, to, proxy, guard);
        let resp = match with_timeout("resume txn", self.timeout, self.kv.txn(txn)).await {
            // Turned away before it was proposed: nothing moved.
            Err(e) if e.turned_away() => return Ok(Resume::TurnedAway(e.to_string())),
            other => other?,
        };
        let ops = resp.op_responses();
        let found = first_kv(&ops).map(|kv| (kv.mod_revision(), kv.create_revision(), kv.lease()));
        if !resp.succeeded() {
            if let Some(reason) = first_kv(&ops).and_then(ended) {
                return Ok(Resume::Ended { reason });
            }
            let (revision, _, lease) = found.unwrap_or_default();
            return Ok(Resume::FenceMoved { revision, lease });
        }
        let (revision, created, _) = found.ok_or_else(|| CellError::CorruptRecord {
            key: fence_key.clone(),
            reason: "the session fence did not read back".to_owned(),
        })?;
        let mut outcomes: Vec<Moved> =
            move_outcomes(first, &ops[2..], txn_revision(&resp)?).collect();
        for chunk in chunks {
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    fence_key.as_bytes(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then(moves(chunk, to))
                .or_else([TxnOp::get(fence_key.as_bytes(), None)]);
            let resp = with_timeout("resume txn", self.timeout, self.kv.txn(txn)).await?;
            if !resp.succeeded() {
                if let Some(reason) = first_kv(&resp.op_responses()).and_then(ended) {
                    return Ok(Resume::Ended { reason });
                }
                let now = first_kv(&resp.op_responses()).map(|kv| (kv.mod_revision(), kv.lease()));
                let (revision, lease) = now.unwrap_or_default();
                return Ok(Resume::FenceMoved { revision, lease });
            }
            let revision = txn_revision(&resp)?;
            outcomes.extend(move_outcomes(chunk, &resp.op_responses(), revision));
        }
        Ok(Resume::Moved {
            fence: Grant::fence(session, created),
            fence_revision: revision,
            outcomes,
        })
    }

    /// Marks `session` ended by an operator for `reason`: its fence (on `lease`, the
    /// session's lease here) says so, and since every resume compares the fence, no
    /// proxy takes the session again, this one included. Returns the fence's create
    /// revision when this write created it (the session never moved), for its clean-up.
    pub async fn end_fence(
        &self,
        session: &LockName,
        lease: i64,
        reason: &str,
    ) -> Result<Option<i64>, CellError> {
        let key = crate::keyspace::session_fence_key(session.as_str());
        let resp = with_timeout(
            "end session fence",
            self.timeout,
            self.kv.put(
                key.into_bytes(),
                format!("{ENDED}{reason}").into_bytes(),
                Some(PutOptions::new().with_lease(lease).with_prev_key()),
            ),
        )
        .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        Ok(resp.prev_key().is_none().then_some(revision))
    }
}

/// What a fenced resume did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The fence now has `fence_revision`; per key, what became of it. `fence` is the
    /// fence key as a grant of the session (deleted with its keys when the session ends
    /// here).
    Moved {
        fence: Grant,
        fence_revision: i64,
        outcomes: Vec<Moved>,
    },
    /// The fence is at `revision` on `lease`, not what the client said: a resume it did
    /// not hear the end of landed. Nothing moved.
    FenceMoved { revision: i64, lease: i64 },
    /// An operator ended the session (see [`LockLog::end_fence`]), for `reason`:
    /// nothing moved, and no proxy takes the session again.
    Ended { reason: String },
    /// etcd turned the first transaction away (too busy): nothing moved.
    TurnedAway(String),
}

/// The first transaction of a move: if the session's fence is still `fence` (0: there
/// is none), it takes the fence onto lease `to` for `proxy` and moves the keys of
/// `first` there; with `guard`, only if that key is still at that mod revision, which
/// it deletes. It reads the fence back either way.
pub(super) fn resume_txn(
    fence_key: &str,
    fence: i64,
    first: &[(Grant, i64)],
    to: i64,
    proxy: &str,
    guard: Option<(&str, i64)>,
) -> Txn {
    let compare = if fence == 0 {
        Compare::create_revision(fence_key.as_bytes(), CompareOp::Equal, 0)
    } else {
        Compare::mod_revision(fence_key.as_bytes(), CompareOp::Equal, fence)
    };
    let mut then = vec![
        TxnOp::put(
            fence_key.as_bytes(),
            proxy,
            Some(PutOptions::new().with_lease(to)),
        ),
        TxnOp::get(fence_key.as_bytes(), None),
    ];
    then.extend(moves(first, to));
    let mut when = vec![compare];
    if let Some((key, revision)) = guard {
        when.push(Compare::mod_revision(key, CompareOp::Equal, revision));
        then.push(TxnOp::delete(key, None));
    }
    Txn::new()
        .when(when)
        .and_then(then)
        .or_else([TxnOp::get(fence_key.as_bytes(), None)])
}

/// What became of one key a move named: on the new lease, with (for an ephemeral key,
/// see [`Grant::written`]) the mod revision it has there now, 0 for any other key; or
/// lost, with what was found instead.
pub type Moved = Result<i64, String>;

/// The nested move transactions of `keys` onto `to`.
fn moves(keys: &[(Grant, i64)], to: i64) -> Vec<TxnOp> {
    keys.iter()
        .map(|(g, from)| TxnOp::txn(guarded_move(g, *from, to)))
        .collect()
}

/// What each move of `keys` did, from the nested transactions' responses in the
/// transaction of `revision`.
fn move_outcomes<'a>(
    keys: &'a [(Grant, i64)],
    ops: &'a [TxnOpResponse],
    revision: i64,
) -> impl Iterator<Item = Moved> + 'a {
    keys.iter()
        .zip(ops)
        .map(move |((grant, _), op)| move_outcome(grant, op, revision))
}

/// A `from` lease that marks a key as not the moving session's own: it is only read,
/// never moved, and reported lost (no lease has this id).
pub const NOT_ITS_OWN: i64 = -1;

/// Already on `to`, still the grant's (see [`Grant::unchanged`]): nothing to do.
/// Otherwise, on `from` and still the grant's: put it on `to`, keeping its value.
/// Otherwise read it, to say what became of it. A key marked [`NOT_ITS_OWN`] is only
/// read, even if it is on `to` already (another session of the same lease bucket holds
/// it).
fn guarded_move(grant: &Grant, from: i64, to: i64) -> Txn {
    let key = grant.key.as_str();
    let unchanged = |lease| grant.unchanged(lease);
    if from == NOT_ITS_OWN {
        let read = Txn::new()
            .when(unchanged(NOT_ITS_OWN))
            .or_else([TxnOp::get(key.as_bytes(), None)]);
        return Txn::new()
            .when(unchanged(NOT_ITS_OWN))
            .or_else([TxnOp::txn(read)]);
    }
    let mut then = vec![TxnOp::put(
        key.as_bytes(),
        Vec::new(),
        Some(PutOptions::new().with_lease(to).with_ignore_value()),
    )];
    // A key of the etcd API takes its client lease record along (rewritten in the same
    // revision, on no lease as ever), when the record is about the session's write of
    // the key (it is, unless the key was written before proxies kept records).
    if let Some(record) = grant.lease_record().filter(|_| grant.written != 0) {
        let along = Txn::new()
            .when([Compare::mod_revision(
                record.as_slice(),
                CompareOp::Equal,
                grant.written,
            )])
            .and_then([TxnOp::put(
                record.as_slice(),
                Vec::new(),
                Some(PutOptions::new().with_ignore_value()),
            )]);
        then.push(TxnOp::txn(along));
    }
    let take = Txn::new()
        .when(unchanged(from))
        .and_then(then)
        .or_else([TxnOp::get(key.as_bytes(), None)]);
    Txn::new().when(unchanged(to)).or_else([TxnOp::txn(take)])
}

/// What a [`guarded_move`] in the transaction of `revision` did, from its response.
fn move_outcome(grant: &Grant, op: &TxnOpResponse, revision: i64) -> Moved {
    let shape = || "the move transaction answered out of shape".to_owned();
    let TxnOpResponse::Txn(outer) = op else {
        return Err(shape());
    };
    if outer.succeeded() {
        // There already: unchanged.
        return Ok(grant.written);
    }
    let inner = outer.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Txn(inner) => Some(inner),
        _ => None,
    });
    let Some(inner) = inner else {
        return Err(shape());
    };
    if inner.succeeded() {
        // Put on the new lease in this transaction: written at its revision.
        return Ok(if grant.written != 0 { revision } else { 0 });
    }
    Err(match first_kv(&inner.op_responses()) {
        None => format!("{} is gone", grant.key),
        Some(kv) if kv.create_revision() != grant.revision => format!(
            "{} was created again at revision {} (held at {})",
            grant.key,
            kv.create_revision(),
            grant.revision
        ),
        Some(kv) if grant.written != 0 && kv.mod_revision() != grant.written => format!(
            "{} was written again at revision {} (by this session at {})",
            grant.key,
            kv.mod_revision(),
            grant.written
        ),
        // The lease is not said: lease ids are no one else's business.
        Some(_) => format!(
            "{} is another session's, or on a lease this session does not have",
            grant.key
        ),
    })
}

/// The value of a session fence an operator ended: this prefix, then why.
const ENDED: &str = "!ended ";

/// Why the session of `fence` was ended, if an operator ended it.
fn ended(fence: &etcd_client::KeyValue) -> Option<String> {
    let value = std::str::from_utf8(fence.value()).ok()?;
    value.strip_prefix(ENDED).map(str::to_owned)
}
