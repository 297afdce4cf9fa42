//! The read barrier (docs/design.md §7, "Reads"): one linearizable etcd request fixes a
//! revision for every read that arrived before it was sent.
//!
//! A read that arrives while a barrier request is in flight waits for the next one: the
//! request in flight may have been ordered before a write that finished before the read
//! arrived. So each read costs at most two etcd round trips of waiting, and one round
//! trip serves every read that queued meanwhile.

use std::time::Duration;

use etcd_client::{GetOptions, KvClient};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace;
use tokio::sync::{mpsc, oneshot};

use crate::metrics;

type Waiter = oneshot::Sender<Result<i64, String>>;

/// Hands out barrier revisions; cheap to clone.
#[derive(Clone)]
pub struct Barrier {
    tx: mpsc::UnboundedSender<Waiter>,
}

impl Barrier {
    /// Starts the barrier loop on `kv`; it ends when every handle is dropped.
    pub fn start(kv: KvClient, timeout: Duration) -> Barrier {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(kv, timeout, rx));
        Barrier { tx }
    }

    /// A revision at least as new as every write that finished before this call.
    pub async fn revision(&self) -> Result<i64, String> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(tx)
            .map_err(|_| "the read barrier has stopped".to_owned())?;
        lockcell_cell::timing::waiting(rx)
            .await
            .map_err(|_| "the read barrier has stopped".to_owned())?
    }
}

async fn run(kv: KvClient, timeout: Duration, mut rx: mpsc::UnboundedReceiver<Waiter>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        // Any key will do: a linearizable read of it returns the store's revision as of
        // a point after it was sent.
        let read = with_timeout(
            "read barrier",
            timeout,
            kv.clone().get(
                keyspace::epoch_key(),
                Some(GetOptions::new().with_count_only()),
            ),
        )
        .await
        .and_then(|resp| lockcell_cell::error::header_revision(resp.header(), "read barrier"))
        .map_err(|e| e.to_string());
        ::metrics::counter!(metrics::READ_BARRIERS).increment(1);
        ::metrics::histogram!(metrics::READ_BARRIER_BATCH).record(batch.len() as f64);
        for waiter in batch {
            let _ = waiter.send(read.clone());
        }
    }
}
