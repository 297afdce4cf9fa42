//! The lease multiplexer's bookkeeping: K buckets, each with the proxy's current etcd
//! lease and a lower bound of when etcd could revoke it.
//!
//! The lower bound is `time the renewal was sent + TTL etcd granted`, the TTL shortened
//! by the clock-rate bound: etcd starts the TTL no earlier than it receives the request
//! and counts it on its own clock, which may run that much faster than this one, so the
//! lease cannot expire before then. Every validity the proxy grants a client ends before
//! it, and before the session's own end, each shortened again by the clock-rate bound
//! for the client's clock (docs/design.md §4). This module is plain data;
//! [`crate::lease_keeper`] performs the renewals.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use lockcell_proto::suspend;
use tokio::time::Instant;

/// A lease id etcd never hands out; marks a bucket whose lease is being replaced.
pub const NO_LEASE: i64 = 0;

/// The proxy's K leases and how long each is certainly alive.
pub struct LeaseBook {
    /// Origin of the bounds below, which are stored as nanoseconds after it so that a
    /// keepalive can read a bucket without a lock.
    base: Instant,
    buckets: Vec<Bucket>,
    /// Taken off every validity, for the time a renewal spends in etcd and on the way.
    margin: Duration,
    /// The clock-rate bound: how much faster or slower than this proxy's clock the
    /// clocks of etcd's members and of clients may run (0.01: 1 %). Every span the proxy
    /// counts on another's behalf is shortened by it.
    rate: f64,
    /// Reads the suspend generation ([`suspend::generation`]; another in unit tests).
    generation: fn() -> u64,
}

struct Bucket {
    /// The etcd lease sessions in this bucket attach their keys to, or [`NO_LEASE`].
    lease: AtomicI64,
    /// Lower bound of the lease's expiry, in nanoseconds after `base`.
    bound: AtomicU64,
    /// The suspend generation the bound was counted in ([`suspend::generation`]): after
    /// a suspend of this machine the bound, counted on the monotonic clock, which stopped
    /// while etcd's time went on, backs no validity until a renewal sent since moves it.
    generation: AtomicU64,
    /// Sessions assigned here, so new sessions go to the emptiest bucket.
    sessions: AtomicUsize,
}

impl LeaseBook {
    pub fn new(k: usize, margin: Duration, rate: f64, base: Instant) -> Self {
        let buckets = (0..k)
            .map(|_| Bucket {
                lease: AtomicI64::new(NO_LEASE),
                bound: AtomicU64::new(0),
                generation: AtomicU64::new(0),
                sessions: AtomicUsize::new(0),
            })
            .collect();
        LeaseBook {
            base,
            buckets,
            margin,
            rate,
            generation: suspend::generation,
        }
    }

    /// The suspend generation now, as this book reads it: pass it with a renewal's
    /// send time.
    pub fn generation(&self) -> u64 {
        (self.generation)()
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// The lease currently in `bucket`, if it has one.
    pub fn lease(&self, bucket: usize) -> Option<i64> {
        match self.buckets[bucket].lease.load(Ordering::Acquire) {
            NO_LEASE => None,
            id => Some(id),
        }
    }

    /// Every lease the proxy holds now.
    pub fn leases(&self) -> Vec<i64> {
        (0..self.len()).filter_map(|b| self.lease(b)).collect()
    }

    /// Puts a freshly granted lease in `bucket`. `sent` is when the grant request left,
    /// with the suspend generation then.
    pub fn install(&self, bucket: usize, lease: i64, sent: (Instant, u64), ttl: Duration) {
        let b = &self.buckets[bucket];
        b.bound.store(0, Ordering::Release);
        b.lease.store(lease, Ordering::Release);
        self.renewed(bucket, lease, sent, ttl);
    }

    /// Records a successful renewal of `lease` sent at `sent` (an instant and the
    /// suspend generation then) for which etcd granted `ttl`. Ignored when the bucket
    /// holds another lease by now, or when the machine was suspended since it was sent.
    pub fn renewed(&self, bucket: usize, lease: i64, sent: (Instant, u64), ttl: Duration) {
        let (sent, generation) = sent;
        let b = &self.buckets[bucket];
        if b.lease.load(Ordering::Acquire) != lease || generation != (self.generation)() {
            return;
        }
        let bound = self.nanos(sent + self.within(ttl));
        if b.generation.swap(generation, Ordering::AcqRel) == generation {
            b.bound.fetch_max(bound, Ordering::AcqRel);
        } else {
            // The bound of before the suspend is junk, larger or not.
            b.bound.store(bound, Ordering::Release);
        }
    }

    /// Empties `bucket` if it still holds `lease`; returns whether it did.
    pub fn clear(&self, bucket: usize, lease: i64) -> bool {
        self.buckets[bucket]
            .lease
            .compare_exchange(lease, NO_LEASE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// True once `now` is past the bucket's lower bound: etcd may have revoked the lease.
    pub fn past_bound(&self, bucket: usize, now: Instant) -> bool {
        self.nanos(now) >= self.buckets[bucket].bound.load(Ordering::Acquire)
    }

    /// How long a client of a session on (`bucket`, `lease`) that ends `ttl` from `now`
    /// (on this proxy's clock) may act, counted on its own clock from `now`:
    /// `min(within(ttl), left)`, zero when the lease is gone.
    pub fn valid_for(&self, bucket: usize, lease: i64, ttl: Duration, now: Instant) -> Duration {
        self.left(bucket, lease, now).min(self.within(ttl))
    }

    /// How long from `now` the lease can still back a client's validity: its lower
    /// bound, as a client's clock may count it, less the margin; zero when the lease is
    /// gone.
    pub fn left(&self, bucket: usize, lease: i64, now: Instant) -> Duration {
        let b = &self.buckets[bucket];
        if b.lease.load(Ordering::Acquire) != lease
            || b.generation.load(Ordering::Acquire) != (self.generation)()
        {
            return Duration::ZERO;
        }
        let bound = b.bound.load(Ordering::Acquire);
        self.within(Duration::from_nanos(bound.saturating_sub(self.nanos(now))))
            .saturating_sub(self.margin)
    }

    /// A span of this proxy's clock as another clock may count it at most, running up
    /// to the clock-rate bound slower: the span it may be told.
    pub fn within(&self, span: Duration) -> Duration {
        span.mul_f64(1.0 - self.rate)
    }

    /// Picks the bucket with a live lease and the fewest sessions, and counts the new
    /// session there. `None` while no bucket has a lease.
    pub fn assign(&self) -> Option<(usize, i64)> {
        self.assign_avoiding(&[])
    }

    /// As [`assign`](LeaseBook::assign), never on one of `avoid`.
    pub fn assign_avoiding(&self, avoid: &[i64]) -> Option<(usize, i64)> {
        let (bucket, lease) = (0..self.len())
            .filter_map(|b| self.lease(b).map(|l| (b, l)))
            .filter(|(_, l)| !avoid.contains(l))
            .min_by_key(|(b, _)| self.buckets[*b].sessions.load(Ordering::Relaxed))?;
        self.buckets[bucket]
            .sessions
            .fetch_add(1, Ordering::Relaxed);
        Some((bucket, lease))
    }

    /// Counts a session out of `bucket`.
    pub fn unassign(&self, bucket: usize) {
        let _ =
            self.buckets[bucket]
                .sessions
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    fn nanos(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.base).as_nanos() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn validity_ends_before_the_lease_lower_bound() {
        let t0 = Instant::now();
        let book = LeaseBook::new(2, Duration::from_millis(500), 0.0, t0);
        book.install(0, 7, (t0, book.generation()), 10 * S);
        // Right after the grant: capped by the session TTL.
        assert_eq!(book.valid_for(0, 7, 5 * S, t0), 5 * S);
        // Later: capped by bound - now - margin.
        assert_eq!(
            book.valid_for(0, 7, 12 * S, t0 + 4 * S),
            Duration::from_millis(5500)
        );
        // Past the bound, or for a lease the bucket no longer holds: nothing.
        assert_eq!(book.valid_for(0, 7, 12 * S, t0 + 10 * S), Duration::ZERO);
        assert_eq!(book.valid_for(0, 8, 12 * S, t0), Duration::ZERO);
        assert!(book.past_bound(0, t0 + 10 * S));
        assert!(!book.past_bound(0, t0 + 9 * S));
    }

    #[test]
    fn the_clock_rate_bound_shortens_the_ttl_and_the_lease_bound() {
        let t0 = Instant::now();
        // 1 %: a client's clock (or etcd's) may run 1 % slower (faster) than this one.
        let book = LeaseBook::new(1, Duration::from_millis(500), 0.01, t0);
        book.install(0, 7, (t0, book.generation()), 10 * S);
        // The session's own end, 2 s away, is told as 1.98 s.
        assert_eq!(book.valid_for(0, 7, 2 * S, t0), Duration::from_millis(1980));
        // etcd's 10 s may be 9.9 s here; what is left, 9.9 s, may be 9.801 s to a
        // client; less the margin.
        assert_eq!(
            book.valid_for(0, 7, 60 * S, t0),
            Duration::from_millis(9801 - 500)
        );
        assert!(book.past_bound(0, t0 + Duration::from_millis(9900)));
        assert!(!book.past_bound(0, t0 + Duration::from_millis(9899)));
    }

    thread_local! {
        static GENERATION: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    fn fake_generation() -> u64 {
        GENERATION.with(|g| g.get())
    }

    #[test]
    fn after_a_suspend_the_lease_backs_nothing_until_a_renewal_sent_since() {
        let t0 = Instant::now();
        let mut book = LeaseBook::new(1, Duration::ZERO, 0.0, t0);
        book.generation = fake_generation;
        book.install(0, 7, (t0, 0), 10 * S);
        assert_eq!(book.valid_for(0, 7, 60 * S, t0), 10 * S);
        GENERATION.with(|g| g.set(1)); // the machine slept
        assert_eq!(book.valid_for(0, 7, 60 * S, t0), Duration::ZERO);
        // A reply to a renewal sent before the suspend counts for nothing.
        book.renewed(0, 7, (t0, 0), 10 * S);
        assert_eq!(book.valid_for(0, 7, 60 * S, t0), Duration::ZERO);
        // One sent since does, even with a bound below the junk one of before.
        book.renewed(0, 7, (t0 + S, 1), 5 * S);
        assert_eq!(book.valid_for(0, 7, 60 * S, t0 + S), 5 * S);
    }

    #[test]
    fn renewals_move_the_bound_forward_only_for_the_current_lease() {
        let t0 = Instant::now();
        let book = LeaseBook::new(1, Duration::ZERO, 0.0, t0);
        book.install(0, 7, (t0, book.generation()), 10 * S);
        book.renewed(0, 7, (t0 + 3 * S, book.generation()), 10 * S);
        assert_eq!(book.valid_for(0, 7, 60 * S, t0), 13 * S);
        // A late reply to an older renewal does not pull the bound back.
        book.renewed(0, 7, (t0 + S, book.generation()), 10 * S);
        assert_eq!(book.valid_for(0, 7, 60 * S, t0), 13 * S);
        // A renewal of a replaced lease is ignored.
        assert!(book.clear(0, 7));
        book.install(0, 9, (t0, book.generation()), 2 * S);
        book.renewed(0, 7, (t0 + 5 * S, book.generation()), 10 * S);
        assert_eq!(book.valid_for(0, 9, 60 * S, t0), 2 * S);
        assert!(
            !book.clear(0, 7),
            "clear of a replaced lease must not empty the bucket"
        );
    }

    #[test]
    fn assigns_to_the_emptiest_bucket_with_a_lease() {
        let t0 = Instant::now();
        let book = LeaseBook::new(3, Duration::ZERO, 0.0, t0);
        assert_eq!(book.assign(), None);
        book.install(1, 11, (t0, book.generation()), 10 * S);
        book.install(2, 12, (t0, book.generation()), 10 * S);
        let picks: Vec<usize> = (0..4).map(|_| book.assign().unwrap().0).collect();
        assert_eq!(picks.iter().filter(|b| **b == 1).count(), 2);
        assert_eq!(picks.iter().filter(|b| **b == 2).count(), 2);
        book.unassign(1);
        assert_eq!(book.assign(), Some((1, 11)));
        assert_eq!(book.leases(), vec![11, 12]);
    }
}
