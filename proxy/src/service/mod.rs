//! The lockcell.v1 gRPC services: one file per service.

pub mod election;
pub mod kv;
pub mod lock;
pub mod session;
pub mod watch;

use std::time::Duration;

pub(crate) fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}
