//! An operator's forced release of a stuck lock (`lockcell-cell force-release`).
//!
//! The command writes a [`ForceRelease`] record at `/sys/force-release` before it asks
//! the holder's proxy to end the holder's session, so the audit trail says who broke
//! which hold, and why, next to the `expired` event of the hold itself.

use serde::{Deserialize, Serialize};

/// Who forced which hold off, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForceRelease {
    /// The lock (or election) name.
    pub lock: String,
    /// `exclusive` or `shared`.
    pub mode: String,
    /// The hold's fencing token, `EPOCH:REVISION`.
    pub token: String,
    /// The holder's session and identity, and the proxy that granted the hold.
    pub session: String,
    pub holder: String,
    pub proxy: String,
    /// Who ran the command (`--operator`, default USER@HOST).
    pub operator: String,
    pub reason: String,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
}
