//! The epoch record at `/sys/epoch`: which cell this is and which epoch it is in.
//!
//! Created on first start when absent, by whichever process gets there first (a
//! create-if-absent transaction, so two starting proxies agree). The epoch is raised on
//! every restore from backup, so fencing tokens keep rising across a restore.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, KvClient, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};

use crate::error::{with_timeout, CellError};
use crate::keyspace;

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
            epoch: 1,
        }
    }
}

/// Reads the epoch record, creating it (epoch 1, a new cluster id) when absent.
pub async fn ensure(kv: &mut KvClient, timeout: Duration) -> Result<EpochRecord, CellError> {
    let key = keyspace::epoch_key();
    let fresh = EpochRecord::fresh();
    let body = serde_json::to_vec(&fresh).expect("epoch record serializes");
    let txn = Txn::new()
        .when([Compare::version(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key, body, None)])
        .or_else([TxnOp::get(key, None)]);
    let resp = with_timeout("epoch create-if-absent", timeout, kv.txn(txn)).await?;
    if resp.succeeded() {
        tracing::info!(cluster.id = %fresh.cluster_id, epoch = fresh.epoch, "created epoch record");
        return Ok(fresh);
    }
    let stored = resp.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    });
    let Some(stored) = stored else {
        return Err(CellError::CorruptRecord {
            key: key.to_owned(),
            reason: "present in the compare, absent in the read".to_owned(),
        });
    };
    serde_json::from_slice(&stored).map_err(|e| CellError::CorruptRecord {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}
