//! The epoch record at `/sys/epoch`: which cell this is and which epoch it is in.
//!
//! Created once per cell by `lockcell-cell init` (a create-if-absent transaction, so two
//! runs agree); proxies only read it and refuse to serve without it. The epoch is raised
//! by `lockcell-cell bump-epoch` after every restore from backup: a restored store's
//! revisions go back to the backup's, and the epoch, the first part of every fencing
//! token, keeps the tokens rising across it. A bump also rises above the route epochs of
//! the cell's shard map copy ([`crate::shardmap`]), the floor of moved names' tokens.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, KvClient, Txn, TxnOp};
use serde::{Deserialize, Serialize};

use crate::error::{with_timeout, CellError};
use crate::keyspace;
use crate::kv::{put_if_absent, PutIfAbsent};
use crate::shardmap::{self, ShardMap};

/// The content of `/sys/epoch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// Names this cell; lets a proxy notice it was pointed at a different cluster.
    pub cluster_id: String,
    /// Raised on every restore from backup; the first part of every fencing token.
    pub epoch: u64,
}

impl EpochRecord {
    fn fresh() -> Self {
        EpochRecord {
            cluster_id: format!("{:016x}", rand::random::<u64>()),
            epoch: next_epoch(0),
        }
    }
}

/// The epoch after `epoch`: the current Unix time in seconds, or `epoch + 1` if that is
/// not above it. A cell cannot remember the epochs it served before a restore (the
/// restored record is the backup's), so a plain `+ 1` could hand out an epoch again: a
/// backup from epoch 2 restored into a cell at epoch 3 would be raised to 3. The clock
/// keeps every raise above every earlier one, restores of old backups and wiped cells
/// set up anew included, as long as it does not go back by more than the time between
/// two raises.
pub fn next_epoch(epoch: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    now.max(epoch + 1)
}

/// The epoch record as stored: its content and the etcd mod revision it was written at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub record: EpochRecord,
    pub mod_revision: i64,
}

/// Reads the epoch record; `None` when the cell has none yet.
pub async fn read(kv: &mut KvClient, timeout: Duration) -> Result<Option<Stored>, CellError> {
    let key = keyspace::epoch_key();
    let resp = with_timeout("read epoch record", timeout, kv.get(key, None)).await?;
    resp.kvs()
        .first()
        .map(|kv| {
            Ok(Stored {
                record: decode(kv.value())?,
                mod_revision: kv.mod_revision(),
            })
        })
        .transpose()
}

/// Raises the epoch ([`next_epoch`]) above the record's and every route epoch of the
/// cell's shard map copy, keeping the cluster id: the step after a restore from backup.
/// Returns the record before and after. Refuses a cell with no record (a cell that was
/// never initialised, or etcd pointed at the wrong data) rather than creating one.
/// With `quiet_since`, refuses too if a proxy wrote its presence record after that
/// revision (a proxy started while the caller looked for running ones).
pub async fn bump(
    kv: &mut KvClient,
    timeout: Duration,
    quiet_since: Option<i64>,
) -> Result<(EpochRecord, Stored), CellError> {
    let key = keyspace::epoch_key();
    let Some(before) = read(kv, timeout).await? else {
        return Err(CellError::CorruptRecord {
            key: key.to_owned(),
            reason: "there is no epoch record to raise; a new cell is set up with `lockcell-cell init`, and a restored one keeps the record of its backup".to_owned(),
        });
    };
    let map = shardmap::read(kv, timeout).await?;
    let after = EpochRecord {
        epoch: raised(before.record.epoch, map.as_ref().map(|m| &m.map)),
        ..before.record.clone()
    };
    let body = serde_json::to_vec(&after).expect("epoch record serializes");
    // Only over the record and the shard map copy just read: two bumps at once raise
    // it once each, never to the same number, and a route moved in meanwhile is not
    // missed.
    let map_unchanged = match &map {
        Some(stored) => Compare::mod_revision(
            keyspace::shardmap_key(),
            CompareOp::Equal,
            stored.mod_revision,
        ),
        None => Compare::version(keyspace::shardmap_key(), CompareOp::Equal, 0),
    };
    let mut when = vec![
        Compare::mod_revision(key, CompareOp::Equal, before.mod_revision),
        map_unchanged,
    ];
    if let Some(revision) = quiet_since {
        let root = keyspace::proxy_presence_root();
        when.push(
            Compare::mod_revision(root, CompareOp::Less, revision + 1)
                .with_range(keyspace::prefix_end(root.as_bytes())),
        );
    }
    let txn = Txn::new()
        .when(when)
        .and_then([TxnOp::put(key, body, None)]);
    let resp = with_timeout("raise epoch", timeout, kv.txn(txn)).await?;
    if !resp.succeeded() {
        return Err(CellError::CorruptRecord {
            key: key.to_owned(),
            reason: "the record or the cell's shard map changed while it was being raised (another bump-epoch, or a shard map move?), or a proxy started on the cell meanwhile; nothing was raised: look again (lockcell-cell status) and decide".to_owned(),
        });
    }
    let mod_revision = resp.header().map(|h| h.revision()).unwrap_or_default();
    tracing::warn!(cluster.id = %after.cluster_id, from = before.record.epoch, to = after.epoch, "raised the cell's epoch");
    Ok((
        before.record,
        Stored {
            record: after,
            mod_revision,
        },
    ))
}

/// The epoch a bump raises `epoch` to: above it and above every route epoch of the
/// cell's copy of the shard map. Names moved into the cell got tokens at their route's
/// epoch, which may be above the cell's; a restore must not repeat them.
fn raised(epoch: u64, map: Option<&ShardMap>) -> u64 {
    let routes = map.into_iter().flat_map(|m| &m.routes);
    next_epoch(routes.map(|r| r.epoch).fold(epoch, u64::max))
}

fn decode(body: &[u8]) -> Result<EpochRecord, CellError> {
    serde_json::from_slice(body).map_err(|e| CellError::CorruptRecord {
        key: keyspace::epoch_key().to_owned(),
        reason: e.to_string(),
    })
}

/// Reads the epoch record, creating it (epoch 1, a new cluster id) when absent.
pub async fn ensure(kv: &mut KvClient, timeout: Duration) -> Result<EpochRecord, CellError> {
    let key = keyspace::epoch_key();
    let fresh = EpochRecord::fresh();
    let body = serde_json::to_vec(&fresh).expect("epoch record serializes");
    let put = put_if_absent(kv, key.as_bytes(), body, "epoch create-if-absent", timeout).await?;
    let PutIfAbsent::Present(stored) = put else {
        tracing::info!(cluster.id = %fresh.cluster_id, epoch = fresh.epoch, "created epoch record");
        return Ok(fresh);
    };
    let Some(stored) = stored else {
        return Err(CellError::CorruptRecord {
            key: key.to_owned(),
            reason: "present in the compare, absent in the read".to_owned(),
        });
    };
    decode(&stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raised_epoch_is_above_the_clock_and_the_old_one() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(next_epoch(1) >= now);
        assert_eq!(next_epoch(now + 100), now + 101);
    }

    #[test]
    fn a_bump_rises_above_every_route_epoch_of_the_cells_copy() {
        let far = 4_000_000_000;
        assert!(raised(7, None) > 7);
        let map: ShardMap = serde_json::from_str(&format!(
            r#"{{"version":3,"cells":{{"a":{{"endpoints":["x"]}}}},
                "routes":[{{"prefix":"","cell":"a"}},{{"prefix":"b/","cell":"a","epoch":{far}}}]}}"#
        ))
        .unwrap();
        assert_eq!(raised(7, Some(&map)), far + 1);
        assert_eq!(raised(far + 5, Some(&map)), far + 6);
    }
}
