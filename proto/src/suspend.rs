//! Noticing that this machine was suspended, for the timing rules of both sides.
//!
//! Every deadline lockcell keeps is an `Instant`, read from CLOCK_MONOTONIC, which stops
//! while a machine or VM is suspended; CLOCK_BOOTTIME goes on. After a suspend every
//! such deadline is late by the time the machine slept, while the time of the other
//! side (etcd counting a proxy's lease, a proxy counting a client's session) went on.
//! The two clocks differ only by the time spent suspended, so a growth of their
//! difference is a suspend: [`generation`] counts them, and a deadline set (or a request
//! sent) in an earlier generation cannot be trusted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Growth of the clocks' difference taken as a suspend. They advance together otherwise
/// (rate corrections apply to both); the margin is for reading them one after the other.
pub const TOLERANCE: Duration = Duration::from_millis(20);

/// How many suspends this process has noticed; see [`generation`].
static GENERATION: AtomicU64 = AtomicU64::new(0);
/// The clocks' difference at the last look, in nanoseconds ([`UNSEEN`] before the first).
/// Atomics, not a lock: every `is_valid()` of the SDK looks.
static LAST_GAP: AtomicU64 = AtomicU64::new(UNSEEN);
const UNSEEN: u64 = u64::MAX;

/// How many suspends of the machine this process has noticed, looking now. A deadline
/// set, or a request sent, while the generation was another one is over.
pub fn generation() -> u64 {
    if let Some(gap) = gap() {
        let gap = u64::try_from(gap.as_nanos()).unwrap_or(UNSEEN - 1);
        let mut last = LAST_GAP.load(Ordering::SeqCst);
        loop {
            let (next, jumped) = look(last, gap);
            if next == last {
                break;
            }
            match LAST_GAP.compare_exchange(last, next, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => {
                    if jumped {
                        GENERATION.fetch_add(1, Ordering::SeqCst);
                    }
                    break;
                }
                Err(now) => last = now,
            }
        }
    }
    GENERATION.load(Ordering::SeqCst)
}

/// One look: the difference to remember after the last one (`last`, in nanoseconds,
/// [`UNSEEN`] at first) and `gap` now, and whether it grew past [`TOLERANCE`]. The first
/// look only records; a smaller reading (the clocks read in the other order) keeps the
/// larger, which never hides a later growth.
fn look(last: u64, gap: u64) -> (u64, bool) {
    if last == UNSEEN {
        return (gap, false);
    }
    let tolerance = TOLERANCE.as_nanos() as u64;
    (last.max(gap), gap > last.saturating_add(tolerance))
}

/// CLOCK_BOOTTIME less CLOCK_MONOTONIC: the time this machine spent suspended since it
/// booted. `None` where the clocks cannot be read (then no suspend is ever noticed).
fn gap() -> Option<Duration> {
    let monotonic = read(nix::time::ClockId::CLOCK_MONOTONIC)?;
    let boottime = read(nix::time::ClockId::CLOCK_BOOTTIME)?;
    Some(boottime.saturating_sub(monotonic))
}

fn read(clock: nix::time::ClockId) -> Option<Duration> {
    let t = nix::time::clock_gettime(clock).ok()?;
    Some(Duration::new(
        u64::try_from(t.tv_sec()).ok()?,
        u32::try_from(t.tv_nsec()).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_growth_of_the_clocks_difference_is_a_suspend_once() {
        let ms = |n: u64| n * 1_000_000;
        let mut last = UNSEEN;
        let mut step = |gap| {
            let (next, jumped) = look(last, gap);
            last = next;
            jumped
        };
        assert!(!step(ms(5_000)), "the first look only records");
        assert!(!step(ms(5_010)), "within the tolerance");
        assert!(!step(ms(5_000)), "read in the other order");
        assert!(step(ms(9_000)), "slept four seconds");
        assert!(!step(ms(9_000)), "noticed once");
        assert!(step(ms(9_500)));
    }

    #[test]
    fn the_clocks_can_be_read_here_and_no_suspend_is_seen_at_rest() {
        assert!(
            gap().is_some(),
            "CLOCK_BOOTTIME and CLOCK_MONOTONIC are readable"
        );
        let first = generation();
        assert_eq!(generation(), first);
    }
}
