//! The proxy's metric names, registered once. Lock names and session ids are never
//! labels: a fleet has too many of both.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

pub const SESSIONS_OPEN: &str = "lockcell_sessions_open";
pub const SESSIONS_OPENED: &str = "lockcell_sessions_opened_total";
pub const SESSIONS_EXPIRED: &str = "lockcell_sessions_expired_total";
pub const KEEPALIVES: &str = "lockcell_keepalives_received_total";
pub const LEASE_RENEWALS: &str = "lockcell_etcd_lease_renewals_total";
pub const LEASES_LOST: &str = "lockcell_etcd_leases_lost_total";
pub const ACQUIRE_SECONDS: &str = "lockcell_acquire_duration_seconds";
pub const LOCKS_GRANTED: &str = "lockcell_locks_granted_total";
pub const LOCKS_RELEASED: &str = "lockcell_locks_released_total";
pub const CLEANUPS_PENDING: &str = "lockcell_cleanups_pending";
pub const CLASSES_RELOADS: &str = "lockcell_classes_reloads_total";
pub const CLASSES_RELOAD_FAILURES: &str = "lockcell_classes_reload_failures_total";
pub const WAITERS: &str = "lockcell_waiters";
pub const GRANT_ATTEMPTS: &str = "lockcell_grant_attempts_total";

/// Histogram buckets for acquire latency, in seconds: 1 ms to 30 s.
pub const ACQUIRE_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// Gives every metric its help text (call once, after the recorder is installed).
pub fn describe() {
    describe_gauge!(SESSIONS_OPEN, "Client sessions held by this proxy now.");
    describe_counter!(SESSIONS_OPENED, "Client sessions opened.");
    describe_counter!(
        SESSIONS_EXPIRED,
        "Client sessions expired (no renewal within TTL, or their proxy lease was lost)."
    );
    describe_counter!(
        KEEPALIVES,
        "Session keepalives received from clients (answered from memory)."
    );
    describe_counter!(
        LEASE_RENEWALS,
        "Keepalives of the proxy's own etcd leases sent to etcd (K leases, each every renew interval)."
    );
    describe_counter!(
        LEASES_LOST,
        "Proxy etcd leases given up (revoked by etcd, or not renewed before their lower bound)."
    );
    describe_histogram!(
        ACQUIRE_SECONDS,
        Unit::Seconds,
        "Time from an Acquire call to its grant, waiting included."
    );
    describe_counter!(
        LOCKS_GRANTED,
        "Locks granted (retried acquires that found their own grant not counted)."
    );
    describe_counter!(LOCKS_RELEASED, "Locks released by their holder.");
    describe_gauge!(
        CLEANUPS_PENDING,
        "Key clean-ups of ended sessions still waiting for etcd."
    );
}
