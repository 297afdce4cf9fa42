//! A fair class's waiting line: each waiting acquire's key under `/q/`, in the order
//! of their create revisions.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};

use super::txn::{check_map, decode, first_kv, map_guard};
use super::{Grant, Holder, LockLog, Place};
use crate::error::{with_timeout, CellError};
use crate::keyspace::{self, prefix_end, LockName, Mode};

impl LockLog {
    /// Puts waiter `waiter`'s key for `mode` in line (fair classes), or finds the one it
    /// already has. `waiter` names one acquire call. Returns the key's create revision:
    /// the waiter's place in line. A key the waiter has on another lease (its session
    /// moved here from another proxy, and the call was retried) moves onto `lease` and
    /// keeps its place.
    pub async fn enqueue(
        &self,
        lock: &LockName,
        mode: Mode,
        waiter: &str,
        lease: i64,
        map_revision: i64,
    ) -> Result<i64, CellError> {
        let key = lock.waiter_key(mode, waiter);
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.as_bytes(), CompareOp::Equal, 0),
                map_guard(map_revision),
            ])
            .and_then([
                TxnOp::put(
                    key.as_bytes(),
                    waiter,
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::get(key.as_bytes(), None),
            ])
            .or_else([
                TxnOp::get(key.as_bytes(), None),
                TxnOp::get(keyspace::shardmap_key(), None),
            ]);
        let resp = with_timeout("enqueue txn", self.timeout, self.kv.txn(txn)).await?;
        if !resp.succeeded() {
            check_map(&resp.op_responses(), map_revision)?;
        }
        match first_kv(&resp.op_responses()) {
            Some(kv) if kv.lease() == lease => Ok(kv.create_revision()),
            Some(kv) if kv.value() == waiter.as_bytes() => {
                let place = Grant::waiting(lock, mode, waiter, kv.create_revision());
                match self
                    .move_keys(&[(place.clone(), kv.lease())], lease)
                    .await?[..]
                {
                    [Ok(_)] => Ok(place.revision),
                    // Left the line meanwhile (granted, or taken out): queue afresh.
                    _ => Box::pin(self.enqueue(lock, mode, waiter, lease, map_revision)).await,
                }
            }
            Some(kv) => Err(CellError::CorruptRecord {
                key,
                reason: format!(
                    "waiter key is on lease {:x}, not the waiter's {lease:x}",
                    kv.lease()
                ),
            }),
            None => Err(CellError::CorruptRecord {
                key,
                reason: "waiter key did not read back".to_owned(),
            }),
        }
    }

    /// Where the waiter queued at `queued` for `mode` stands: an exclusive waiter is
    /// behind every earlier waiter, a shared one only behind earlier exclusive waiters.
    /// Earlier waiters only ever leave the line, so the answer cannot be overtaken by a
    /// later arrival.
    pub async fn place(
        &self,
        lock: &LockName,
        mode: Mode,
        queued: i64,
    ) -> Result<Place, CellError> {
        let prefix = match mode {
            Mode::Exclusive => lock.queue_prefix(),
            Mode::Shared => lock.exclusive_queue_prefix(),
        };
        let options = GetOptions::new()
            .with_range(prefix_end(prefix.as_bytes()))
            .with_max_create_revision(queued - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1)
            .with_keys_only();
        let resp = with_timeout(
            "queue read",
            self.timeout,
            self.kv.get(prefix.as_bytes().to_vec(), Some(options)),
        )
        .await?;
        let seen_at = resp.header().map(|h| h.revision()).unwrap_or_default();
        Ok(match resp.kvs().first() {
            Some(kv) => Place::Behind {
                predecessor: kv.key().to_vec(),
                seen_at,
            },
            None => Place::Head { seen_at },
        })
    }

    /// `session`'s `mode` hold of `lock` on `lease`, if it has one: the caller compares
    /// its call with the record's (a retried call finds its grant without joining the
    /// line; another call of the session is refused).
    pub async fn held_by(
        &self,
        lock: &LockName,
        mode: Mode,
        session: &str,
        lease: i64,
    ) -> Result<Option<Holder>, CellError> {
        let key = lock.holder_key(mode, session);
        let resp = with_timeout(
            "holder read",
            self.timeout,
            self.kv.get(key.as_bytes().to_vec(), None),
        )
        .await?;
        for kv in resp.kvs() {
            let record = decode(&key, kv.value())?;
            if kv.lease() == lease && record.session == session {
                return Ok(Some(Holder {
                    record,
                    revision: kv.create_revision(),
                    lease: kv.lease(),
                }));
            }
        }
        Ok(None)
    }

    /// Whether waiter `waiter` is still in line at `queued` on `lease`.
    pub async fn in_line(
        &self,
        lock: &LockName,
        mode: Mode,
        waiter: &str,
        queued: i64,
        lease: i64,
    ) -> Result<bool, CellError> {
        let key = lock.waiter_key(mode, waiter);
        let resp = with_timeout(
            "queue read",
            self.timeout,
            self.kv.get(key.as_bytes().to_vec(), None),
        )
        .await?;
        Ok(resp
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == queued && kv.lease() == lease))
    }

    /// Takes a waiter out of line (it gave up), if it is still the one queued at `queued`.
    pub async fn dequeue(
        &self,
        lock: &LockName,
        mode: Mode,
        waiter: &str,
        queued: i64,
    ) -> Result<bool, CellError> {
        let key = lock.waiter_key(mode, waiter);
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.as_bytes(),
                CompareOp::Equal,
                queued,
            )])
            .and_then([TxnOp::delete(key.as_bytes(), None)]);
        let resp = with_timeout("dequeue txn", self.timeout, self.kv.txn(txn)).await?;
        Ok(resp.succeeded())
    }
}
