//! Lease IDs for the etcd API's leases: unique across the cell, and never equal to an
//! ID etcd itself hands out.
//!
//! etcd's clients name keys after their lease ID (Go's `concurrency.Mutex` and
//! `Election`, etcd's Lock service, the npm client): two leases with one ID on one
//! prefix would both believe they hold the lock. An ID is
//! `MARK << 48 | block << 16 | index`: each proxy takes blocks of 65,536 IDs by raising
//! the cell's block count in one etcd transaction (so blocks are never shared, nor used
//! twice), and hands their IDs out in order. etcd's own lease IDs put the low 15 bits of
//! the granting member's ID in bits 48 to 62; [`MARK`] there is lockcell's, and a proxy
//! says so at start if a member of its cell has those bits too.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace::lease_blocks_key;
use tokio::sync::Mutex;

use crate::errors::ProxyError;
use crate::state::ProxyState;

/// etcd's text for a lease it does not know (clients match it).
pub const LEASE_NOT_FOUND: &str = "etcdserver: requested lease not found";

/// The session of lease `id`: its ID in hex (16 digits, where the lockcell API's are
/// 32, so the two never meet).
pub fn session_of(id: i64) -> String {
    format!("{id:016x}")
}

/// The lease of session `session`, if it is an etcd API lease's.
pub fn lease_of(session: &str) -> Option<i64> {
    if session.len() != 16 {
        return None;
    }
    i64::from_str_radix(session, 16).ok().filter(|id| *id > 0)
}

/// Bits 48 to 62 of every etcd API lease ID: "lc".
pub const MARK: i64 = 0x6c63;

/// IDs in one block.
const BLOCK: u64 = 1 << 16;

/// Blocks there can be (32 bits between the mark and the index).
const BLOCKS: u64 = 1 << 32;

/// The IDs this proxy hands out.
#[derive(Default)]
pub struct LeaseIds {
    /// The block taken, the next index in it, and whether the proxy's presence record
    /// names the block yet.
    next: Mutex<Option<(u64, u64, bool)>>,
}

impl LeaseIds {
    /// A new ID, taking the next block from the cell when this one is used up. No ID of
    /// a block is handed out before the proxy's presence record names the block, so
    /// that every proxy of the cell finds the lease's proxy from its ID (see
    /// [`super::forward`]).
    pub async fn take(&self, state: &ProxyState) -> Result<i64, ProxyError> {
        let timeout = state.config.etcd_timeout;
        let mut next = self.next.lock().await;
        let (block, index, announced) = match *next {
            Some((block, index, announced)) if index < BLOCK => (block, index, announced),
            _ => {
                let block = take_block(&state.etcd.kv_client(), timeout).await?;
                state.etcd_lease_blocks.lock().await.push(block);
                (block, 0, false)
            }
        };
        *next = Some((block, index, announced));
        if !announced {
            let lease = state.leases.lease(0).ok_or_else(|| {
                ProxyError::EtcdUnavailable("this proxy holds no etcd lease right now".into())
            })?;
            crate::lease_keeper::announce_on(state, lease).await?;
            *next = Some((block, index, true));
        }
        *next = Some((block, index + 1, true));
        Ok(id(block, index))
    }
}

/// The block lease `id` is from.
pub fn block_of(id: i64) -> u64 {
    (id as u64 >> 16) % BLOCKS
}

/// The ID of `index` in `block`.
pub fn id(block: u64, index: u64) -> i64 {
    (MARK << 48) | ((block % BLOCKS) << 16) as i64 | index as i64
}

/// Whether `id` is one of the etcd API's.
pub fn is_ours(id: i64) -> bool {
    id > 0 && id >> 48 == MARK
}

/// Takes the cell's next block: reads the count and raises it, guarded by the revision
/// read, until the guard holds.
async fn take_block(kv: &etcd_client::KvClient, timeout: Duration) -> Result<u64, ProxyError> {
    let key = lease_blocks_key();
    for _ in 0..32 {
        let read = with_timeout("read lease blocks", timeout, kv.clone().get(key, None)).await?;
        let (taken, guard) = match read.kvs().first() {
            Some(kv) => {
                let text = std::str::from_utf8(kv.value()).unwrap_or_default();
                let taken: u64 = text.trim().parse().map_err(|_| {
                    ProxyError::Refused(format!(
                        "the cell's lease block count at {key} is {text:?}, not a number; an operator must repair it"
                    ))
                })?;
                (
                    taken,
                    Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision()),
                )
            }
            None => (0, Compare::create_revision(key, CompareOp::Equal, 0)),
        };
        if taken >= BLOCKS {
            return Err(ProxyError::Exhausted(format!(
                "the cell has handed out all {BLOCKS} blocks of etcd API lease IDs"
            )));
        }
        let raise =
            Txn::new()
                .when([guard])
                .and_then([TxnOp::put(key, (taken + 1).to_string(), None)]);
        let done = with_timeout("take a lease block", timeout, kv.clone().txn(raise)).await?;
        if done.succeeded() {
            return Ok(taken);
        }
    }
    Err(ProxyError::Busy(
        "could not take a block of lease IDs: the cell's count kept changing; try again".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_the_mark_and_are_distinct_across_blocks() {
        let a = id(0, 0);
        let b = id(0, BLOCK - 1);
        let c = id(1, 0);
        assert!(is_ours(a) && is_ours(b) && is_ours(c));
        assert!(a < b && b < c, "{a:x} {b:x} {c:x}");
        assert_eq!((block_of(a), block_of(b), block_of(c)), (0, 0, 1));
        assert_eq!(block_of(id(BLOCKS - 1, 5)), BLOCKS - 1);
        assert!(a > 0, "a positive ID, as etcd's are");
        assert_eq!(id(BLOCKS - 1, BLOCK - 1) >> 48, MARK);
    }

    #[test]
    fn an_etcd_lease_id_is_not_ours_unless_its_member_bits_are_the_mark() {
        // Whether etcd member `member_id` could hand out lease IDs that look like ours.
        let member_shares_mark = |member_id: u64| (member_id & 0x7fff) as i64 == MARK;
        // etcd: member ID's low 16 bits at 48..63, bit 63 cleared.
        let etcd_id = |member: u64, n: u64| ((member << 48) as i64 & i64::MAX) | n as i64;
        assert!(!is_ours(etcd_id(0x8e2f, 7)));
        assert!(member_shares_mark(0x1234_0000_0000_6c63));
        assert!(is_ours(etcd_id(0x6c63, 7)));
        assert!(!member_shares_mark(0x1234_0000_0000_8e2f));
    }
}
