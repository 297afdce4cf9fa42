//! Sweeps the etcd API's client lease records (see `keyspace::etcd_leased_root`) and
//! the owner records of persistent keys (`keyspace::owner_root`) that no key shows any
//! more.
//!
//! A record is on no lease, so when its key's lease ends (a session's proxy gone with
//! its zone) etcd deletes the key alone, and a key written through lockcell's own API
//! leaves its record as it was. An owner record goes with its key's delete, but
//! `lockcell-cell`'s own writes (a shard map move's clean-up) leave it. Such a record is never read as the key's (readers take
//! a record only when its mod revision is its key's), but it takes room in etcd and in
//! every proxy's copy of the keys. One proxy of the cell sweeps them, the one whose id
//! comes first among the running proxies' presence records, a few transactions at a
//! time: a lost zone's records go over seconds after the storm, not in it. Each delete
//! is guarded by the record's mod revision, so a record written again meanwhile stays.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace;
use lockcell_cell::CellError;
use tokio::sync::watch;

use crate::state::ProxyState;

/// How often the sweeper looks for records to sweep.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// Records deleted per transaction.
const PER_TXN: usize = 64;
/// Records deleted per look, at most.
const PER_ROUND: usize = 2048;
/// The pause between two of the sweeper's transactions.
const PACE: Duration = Duration::from_millis(100);

/// Sweeps until `stop`.
pub async fn run(state: Arc<ProxyState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        match sweep_once(&state).await {
            Ok(0) => {}
            Ok(swept) => tracing::info!(
                swept,
                "swept client lease and owner records no key shows any more"
            ),
            Err(error) => tracing::debug!(%error, "could not sweep client lease and owner records"),
        }
    }
}

/// One look: deletes up to [`PER_ROUND`] records no key shows, if this proxy is the
/// sweeper. Returns how many it deleted.
async fn sweep_once(state: &ProxyState) -> Result<usize, CellError> {
    let feed = &state.reads.feed;
    if !feed.is_live() {
        return Ok(0);
    }
    let orphans: Vec<(Vec<u8>, i64)> = feed.with_mirror(|m| {
        let record = |name: &str, of: fn(&[u8]) -> Option<Vec<u8>>| {
            of(format!("{}{name}", keyspace::kv_root()).as_bytes())
        };
        let leased = m
            .orphan_records(PER_ROUND)
            .into_iter()
            .filter_map(|(name, written)| {
                Some((record(&name, keyspace::etcd_leased_key)?, written))
            });
        let owned = m
            .orphan_owners(PER_ROUND)
            .into_iter()
            .filter_map(|(name, written)| Some((record(&name, keyspace::owner_key)?, written)));
        leased.chain(owned).take(PER_ROUND).collect()
    });
    if orphans.is_empty() || !first_proxy(state).await? {
        return Ok(0);
    }
    let mut swept = 0;
    for (i, chunk) in orphans.chunks(PER_TXN).enumerate() {
        if i > 0 {
            tokio::time::sleep(PACE).await;
        }
        let deletes: Vec<TxnOp> = chunk
            .iter()
            .map(|(record, written)| {
                let unchanged =
                    Compare::mod_revision(record.as_slice(), CompareOp::Equal, *written);
                TxnOp::txn(
                    Txn::new()
                        .when([unchanged])
                        .and_then([TxnOp::delete(record.as_slice(), None)]),
                )
            })
            .collect();
        let done = with_timeout(
            "sweep client lease records",
            state.config.etcd_timeout,
            state.etcd.kv_client().txn(Txn::new().and_then(deletes)),
        )
        .await?;
        swept += done
            .op_responses()
            .iter()
            .filter(|op| matches!(op, TxnOpResponse::Txn(t) if t.succeeded()))
            .count();
    }
    Ok(swept)
}

/// Whether this proxy's id comes first among the running proxies' presence records.
async fn first_proxy(state: &ProxyState) -> Result<bool, CellError> {
    let root = keyspace::proxy_presence_root();
    let running = state.keys_under("read the running proxies", root).await?;
    let first = running
        .iter()
        .filter_map(|kv| kv.key().strip_prefix(root.as_bytes()))
        .min();
    Ok(first == Some(state.proxy_id.as_bytes()))
}
