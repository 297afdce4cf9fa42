//! The proxy's own memory against `--max-memory-bytes` (docs/operations.md, "Limits
//! per identity"): past it, the proxy sheds new sessions and new watches with
//! RESOURCE_EXHAUSTED, and never what keeps existing sessions alive (keepalives,
//! resumes, releases). The resident size is read from `/proc/self/status` every
//! [`POLL`]; where there is none (not Linux), nothing is shed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::errors::ProxyError;
use crate::metrics as m;

/// How often the proxy reads its resident size.
pub const POLL: Duration = Duration::from_secs(1);

/// The proxy's resident size as last read, against its bound (0: no bound).
#[derive(Debug, Default)]
pub struct Memory {
    limit: u64,
    resident: AtomicU64,
}

impl Memory {
    pub fn new(limit: u64) -> Memory {
        Memory {
            limit,
            resident: AtomicU64::new(0),
        }
    }

    /// Refuses a new `what` (a session, a watch) while the proxy is past its bound.
    pub fn admit(&self, what: &str) -> Result<(), ProxyError> {
        let resident = self.resident.load(Ordering::Acquire);
        if self.limit == 0 || resident < self.limit {
            return Ok(());
        }
        metrics::counter!(m::MEMORY_REFUSALS).increment(1);
        Err(ProxyError::Exhausted(format!(
            "this proxy uses {} MiB, past its bound of {} MiB (--max-memory-bytes): it takes no \
             new {what} until it uses less; existing sessions go on. Use another proxy",
            resident / (1024 * 1024),
            self.limit / (1024 * 1024)
        )))
    }

    fn set(&self, resident: u64) {
        self.resident.store(resident, Ordering::Release);
        metrics::gauge!(m::RESIDENT_BYTES).set(resident as f64);
    }
}

/// The resident size of this process, from `/proc/self/status`.
fn resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Reads the resident size every [`POLL`] until `stop`.
pub async fn keep_reading(memory: Arc<Memory>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        match resident() {
            Some(bytes) => memory.set(bytes),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_things_are_shed_past_the_bound_only() {
        let memory = Memory::new(100 * 1024 * 1024);
        memory.set(50 * 1024 * 1024);
        memory.admit("sessions").unwrap();
        memory.set(120 * 1024 * 1024);
        let refused = memory.admit("sessions").unwrap_err().to_string();
        assert!(refused.contains("120 MiB"), "{refused}");
        assert!(refused.contains("--max-memory-bytes"), "{refused}");
        Memory::new(0)
            .admit("watches")
            .expect("no bound, nothing shed");
        assert!(
            resident().is_some_and(|b| b > 0),
            "reads this process's size"
        );
    }
}
