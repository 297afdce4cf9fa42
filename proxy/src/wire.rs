//! How the proxy's spans go on the wire.

use std::time::Duration;

/// `d` in whole milliseconds, as the wire's `*_ms` fields carry spans.
pub fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}
