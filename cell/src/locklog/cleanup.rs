//! Guarded deletes: a release, an ended session's keys, and keys whose creating
//! transaction's outcome was unknown.

use etcd_client::{Txn, TxnOp, TxnOpResponse};

use super::txn::{guarded_delete, txn_revision};
use super::{Grant, LockLog, MAX_DELETES_PER_TXN};
use crate::error::{with_timeout, CellError};

impl LockLog {
    /// Deletes every grant still on `lease`, each under its own guard, in as few
    /// transactions as etcd allows. `clean` marks the deletes as releases (a closed
    /// session) rather than a holder that vanished (an expired one), for lock-delay.
    /// Returns how many keys it deleted, and the release markers it wrote.
    ///
    /// A grant whose outcome was unknown (revision 0, see [`Grant::unsettled_hold`]) is
    /// read first and deleted only if it turns out to be that call's key on `lease`.
    pub async fn delete_guarded(
        &self,
        grants: &[Grant],
        lease: i64,
        clean: bool,
    ) -> Result<Deleted, CellError> {
        let (unknown, mut grants): (Vec<Grant>, Vec<Grant>) =
            grants.iter().cloned().partition(Grant::is_unsettled);
        for found in self.settle(&unknown, lease).await? {
            if !grants.contains(&found) {
                grants.push(found);
            }
        }
        let mut deleted = Deleted::default();
        for chunk in grants.chunks(MAX_DELETES_PER_TXN) {
            // One release marker per lock per transaction: etcd refuses a request that
            // writes one key twice, nested transactions included (a session can name
            // two holds of one lock when a release's reply was lost).
            let mut marked = std::collections::HashSet::new();
            let marks: Vec<bool> = chunk
                .iter()
                .map(|g| clean && !g.waiter && marked.insert(&g.lock))
                .collect();
            let nested: Vec<TxnOp> = chunk
                .iter()
                .zip(&marks)
                .map(|(g, mark)| TxnOp::txn(guarded_delete(g, lease, *mark)))
                .collect();
            let txn = Txn::new().and_then(nested);
            let resp = with_timeout("clean-up txn", self.timeout, self.kv.txn(txn)).await?;
            // (A reply without a revision, which etcd never sends, leaves the markers be:
            // a guard on revision 0 holds for no key.)
            let revision = txn_revision(&resp).unwrap_or_default();
            for ((g, mark), op) in chunk.iter().zip(&marks).zip(resp.op_responses()) {
                if !matches!(op, TxnOpResponse::Txn(t) if t.succeeded()) {
                    continue;
                }
                deleted.keys += 1;
                if *mark {
                    deleted
                        .markers
                        .push(Grant::release_marker(&g.lock, revision));
                }
            }
        }
        Ok(deleted)
    }

    /// Reads each unsettled grant in `unknown` and returns, with its create revision,
    /// every one that turns out to exist on `lease` as its call's key; the others were
    /// never made (or are gone).
    pub async fn settle(&self, unknown: &[Grant], lease: i64) -> Result<Vec<Grant>, CellError> {
        let mut found = Vec::new();
        for grant in unknown {
            let Some(made_by) = &grant.made_by else {
                continue;
            };
            let resp = with_timeout(
                "settle read",
                self.timeout,
                self.kv.get(grant.key.as_bytes().to_vec(), None),
            )
            .await?;
            let Some(kv) = resp.kvs().first().filter(|kv| kv.lease() == lease) else {
                continue;
            };
            if made_by.shown_by(&grant.key, kv.value()) {
                found.push(Grant {
                    revision: kv.create_revision(),
                    written: if grant.written_guard() {
                        kv.mod_revision()
                    } else {
                        0
                    },
                    made_by: None,
                    ..grant.clone()
                });
            }
        }
        Ok(found)
    }
}

/// What [`LockLog::delete_guarded`] did: how many keys it deleted, and the release
/// markers it wrote (see [`Grant::release_marker`]).
#[derive(Debug, Default)]
pub struct Deleted {
    pub keys: usize,
    pub markers: Vec<Grant>,
}
