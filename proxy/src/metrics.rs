//! The proxy's metric names, registered once. Lock names and session ids are never
//! labels: a fleet has too many of both.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

pub const SESSIONS_OPEN: &str = "lockcell_sessions_open";
pub const SESSIONS_OPENED: &str = "lockcell_sessions_opened_total";
pub const SESSIONS_EXPIRED: &str = "lockcell_sessions_expired_total";
pub const KEEPALIVES: &str = "lockcell_keepalives_received_total";
pub const ETCD_API_KEEPALIVES_UNBACKED: &str = "lockcell_etcd_api_keepalives_unbacked_total";
pub const LEASE_RENEWALS: &str = "lockcell_etcd_lease_renewals_total";
pub const LEASES_LOST: &str = "lockcell_etcd_leases_lost_total";
pub const ACQUIRE_SECONDS: &str = "lockcell_acquire_duration_seconds";
pub const HANDOVER_SECONDS: &str = "lockcell_lock_handover_duration_seconds";
pub const LOCKS_GRANTED: &str = "lockcell_locks_granted_total";
pub const LOCKS_RELEASED: &str = "lockcell_locks_released_total";
pub const CLEANUPS_PENDING: &str = "lockcell_cleanups_pending";
pub const CLASSES_RELOADS: &str = "lockcell_classes_reloads_total";
pub const CLASSES_RELOAD_FAILURES: &str = "lockcell_classes_reload_failures_total";
pub const GRANTS_RELOADS: &str = "lockcell_grants_reloads_total";
pub const GRANTS_RELOAD_FAILURES: &str = "lockcell_grants_reload_failures_total";
pub const LIMIT_REFUSALS: &str = "lockcell_limit_refusals_total";
pub const ETCD_DB_BYTES: &str = "lockcell_etcd_db_bytes";
pub const RESIDENT_BYTES: &str = "lockcell_proxy_resident_bytes";
pub const MEMORY_REFUSALS: &str = "lockcell_memory_refusals_total";
pub const ETCD_SPACE_LIMIT_BYTES: &str = "lockcell_etcd_space_limit_bytes";
pub const ETCD_SPACE_REFUSALS: &str = "lockcell_etcd_space_refusals_total";
pub const WAITERS: &str = "lockcell_waiters";
pub const GRANT_ATTEMPTS: &str = "lockcell_grant_attempts_total";
pub const GRANTS_TAKEN_BACK: &str = "lockcell_grants_taken_back_total";
pub const WATCHERS: &str = "lockcell_watchers";
pub const WAIT_RETRIES: &str = "lockcell_wait_retries_total";
pub const WATCH_EVENTS_SENT: &str = "lockcell_watch_events_sent_total";
pub const WATCH_BATCHES_SENT: &str = "lockcell_watch_batches_fanned_out_total";
pub const WATCHERS_CUT_OFF: &str = "lockcell_watchers_cut_off_total";
pub const WATCH_CATCH_UPS: &str = "lockcell_watch_catch_ups_total";
pub const WATCH_HISTORY_STARTS: &str = "lockcell_watch_history_starts_total";
pub const FEED_RELOADS: &str = "lockcell_feed_reloads_total";
pub const FEED_GAPS: &str = "lockcell_feed_gaps_total";
pub const READ_BARRIERS: &str = "lockcell_read_barriers_total";
pub const READ_BARRIER_BATCH: &str = "lockcell_read_barrier_batch_size";
pub const KV_READS: &str = "lockcell_kv_reads_total";
pub const KV_BYTES: &str = "lockcell_kv_bytes";
pub const TLS_RELOADS: &str = "lockcell_tls_reloads_total";
pub const TLS_RELOAD_FAILURES: &str = "lockcell_tls_reload_failures_total";
pub const SESSIONS_RESUMED: &str = "lockcell_sessions_resumed_total";
pub const KEYS_MOVED: &str = "lockcell_keys_moved_total";
pub const ETCD_API_LEASES_HANDED_OFF: &str = "lockcell_etcd_api_leases_handed_off_total";
pub const ETCD_API_LEASES_GATHERED: &str = "lockcell_etcd_api_leases_gathered_total";
pub const ETCD_API_FORWARDED: &str = "lockcell_etcd_api_forwarded_total";
pub const ETCD_API_GATEWAY_CALLS: &str = "lockcell_etcd_api_gateway_calls_total";
pub const ETCD_API_WRITES_WAITING: &str = "lockcell_etcd_api_writes_waiting";
pub const ETCD_API_WRITES_QUEUED: &str = "lockcell_etcd_api_writes_queued_total";
pub const KEYS_LOST_ON_RESUME: &str = "lockcell_keys_lost_on_resume_total";
pub const DRAINING: &str = "lockcell_draining";
pub const LEASE_REMAINING: &str = "lockcell_etcd_lease_remaining_seconds";
pub const ETCD_REQUEST_SECONDS: &str = lockcell_cell::error::ETCD_REQUEST_SECONDS;
pub const RESUME_SECONDS: &str = "lockcell_resume_duration_seconds";
pub const VALIDITY_GRANTED: &str = "lockcell_validity_granted_seconds";
pub const ETCD_WATCHES: &str = "lockcell_etcd_watches";
pub const ETCD_REACHABLE: &str = "lockcell_etcd_reachable";
pub const OVERHEAD_SECONDS: &str = "lockcell_proxy_overhead_seconds";

/// Histogram buckets for acquire latency, in seconds: 1 ms to 30 s.
pub const ACQUIRE_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// Histogram buckets for the proxy's own time on a call, in seconds: 10 µs to 1 s.
pub const OVERHEAD_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.00075, 0.001,
    0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Histogram buckets for etcd calls and resumes, in seconds: 0.5 ms to 10 s.
pub const ETCD_BUCKETS: &[f64] = lockcell_cell::error::ETCD_BUCKETS;

/// Histogram buckets for the validity granted to clients, in seconds.
pub const VALIDITY_BUCKETS: &[f64] = &[0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0];

/// One of something counted in a gauge while it lives (an etcd watch stream of the
/// proxy's own in [`ETCD_WATCHES`], a client watch in [`WATCHERS`], an acquire in line
/// in [`WAITERS`], a write waiting for etcd in [`ETCD_API_WRITES_WAITING`]): counted down when dropped, also when its task is cancelled.
pub struct Counted(&'static str);

impl Counted {
    pub fn in_gauge(gauge: &'static str) -> Self {
        metrics::gauge!(gauge).increment(1.0);
        Counted(gauge)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        metrics::gauge!(self.0).decrement(1.0);
    }
}

/// Gives every metric its help text (call once, after the recorder is installed), and
/// exports every counter at 0 from the start: `increase()` over a counter that appears
/// with its first event misses that event, and an alert on it would not fire.
pub fn describe() {
    describe_etcd();
    describe_sessions();
    describe_locks();
    describe_reads();
}

/// The proxy's own health: etcd, its leases, its space, its reloads.
fn describe_etcd() {
    describe_histogram!(
        ETCD_REQUEST_SECONDS,
        Unit::Seconds,
        "etcd request latency, by call (`call`) and outcome (`ok`, `error`, `timeout`)."
    );
    describe_gauge!(
        ETCD_WATCHES,
        "etcd watch streams the proxy holds (its cell watch, lock-log watches, record watches, catch-ups of watchers that started in the past), whatever the number of client watchers."
    );
    counter(
        ETCD_API_WRITES_QUEUED,
        "Client writes through the etcd API that waited for their turn to go to etcd.",
    );
    describe_gauge!(
        ETCD_API_WRITES_WAITING,
        "Client writes through the etcd API waiting for their turn to go to etcd (--etcd-writes-in-flight are in etcd at once)."
    );
    describe_gauge!(
        LEASE_REMAINING,
        Unit::Seconds,
        "Least time left, over the proxy's etcd leases (every cell's), before the lower bound of a lease less the validity margin: what the proxy can still grant its clients if etcd stops answering now; 0 while a lease is missing."
    );
    describe_gauge!(
        ETCD_REACHABLE,
        "1 while every etcd lease of the proxy (every cell's) is held and was renewed within the renew interval plus the etcd timeout, else 0."
    );
    describe_gauge!(
        DRAINING,
        "1 while the proxy is draining (asking its clients to move before it stops)."
    );
    counter(
        LEASE_RENEWALS,
        "Keepalives of the proxy's own etcd leases sent to etcd (K leases, each every renew interval)."
    );
    counter(
        LEASES_LOST,
        "Proxy etcd leases given up (revoked by etcd, or not renewed before their lower bound).",
    );
    counter(
        CLASSES_RELOADS,
        "Lock classes files loaded (at start, on SIGHUP or when the file changed).",
    );
    counter(
        CLASSES_RELOAD_FAILURES,
        "Lock classes files refused (the last good one stays in force).",
    );
    counter(
        GRANTS_RELOADS,
        "Prefix grants files loaded (at start, on SIGHUP or when the file changed).",
    );
    counter(
        GRANTS_RELOAD_FAILURES,
        "Prefix grants files refused (the last good one stays in force).",
    );
    describe_gauge!(
        ETCD_DB_BYTES,
        Unit::Bytes,
        "etcd's database size as the proxy last read it (Status, every 2 s)."
    );
    describe_gauge!(
        ETCD_SPACE_LIMIT_BYTES,
        Unit::Bytes,
        "The database size from which the proxy refuses new keys and values (--etcd-space-limit-percent of --etcd-quota-bytes)."
    );
    counter(
        TLS_RELOADS,
        "Times the proxy read its TLS certificate, key and client CA again after they changed.",
    );
    counter(
        TLS_RELOAD_FAILURES,
        "Changed TLS files the proxy refused (the previous ones stay in force); the log says why.",
    );
    describe_gauge!(
        CLEANUPS_PENDING,
        "Key clean-ups of ended sessions still waiting for etcd."
    );
}

/// Client sessions: opened, renewed, moved, ended.
fn describe_sessions() {
    describe_histogram!(
        RESUME_SECONDS,
        Unit::Seconds,
        "Time to take a session over from another proxy (a Resume: its keys moved under their guards), by outcome."
    );
    describe_histogram!(
        VALIDITY_GRANTED,
        Unit::Seconds,
        "Validity granted to clients by keepalives: how long each may act on its locks without hearing from the proxy again."
    );
    describe_gauge!(SESSIONS_OPEN, "Client sessions held by this proxy now.");
    counter(SESSIONS_OPENED, "Client sessions opened.");
    counter(
        SESSIONS_RESUMED,
        "Client sessions taken over from another proxy (Resume, or an etcd API lease handed off).",
    );
    counter(
        ETCD_API_LEASES_HANDED_OFF,
        "etcd API leases this proxy handed over: draining, to the next proxy their clients reach, or to a proxy that asked for one to run a Txn writing with leases of several proxies.",
    );
    counter(
        ETCD_API_LEASES_GATHERED,
        "etcd API leases this proxy asked another proxy for and took over, to run a Txn writing with leases of several proxies as one transaction.",
    );
    counter(
        KEYS_MOVED,
        "Keys moved onto this proxy's leases by resumed sessions (tokens unchanged).",
    );
    counter(
        KEYS_LOST_ON_RESUME,
        "Keys a resuming session named that were gone or changed: reported lost to the client.",
    );
    counter(
        SESSIONS_EXPIRED,
        "Client sessions expired (no renewal within TTL, or their proxy lease was lost); with several cells, counted by each session's stay in the proxy's first cell."
    );
    counter(
        KEEPALIVES,
        "Session keepalives received from clients (answered from memory).",
    );
    counter(
        ETCD_API_FORWARDED,
        "etcd API calls on a lease that lives at another proxy, forwarded there (keepalives count once per forwarded keepalive).",
    );
    counter(
        ETCD_API_GATEWAY_CALLS,
        "Calls on etcd's JSON gateway (the etcd listener's HTTP paths), by `path` and the gRPC `code` of their answer (a stream's: of its first message).",
    );
    counter(
        ETCD_API_KEEPALIVES_UNBACKED,
        "Lease keepalives on the etcd API left unanswered because the proxy could not back even a second of the lease then (its own etcd lease too near its lower bound).",
    );
}

/// Locks and the limits on what clients take.
fn describe_locks() {
    describe_histogram!(
        HANDOVER_SECONDS,
        Unit::Seconds,
        "Time from a waiter hearing that the lock it waits for was let go (its proxy's watch saw the release, expiry or the waiter ahead leave) to its grant, a class's lock delay included: the proxy's part of a handover, by the lock's queueing (`fair` or `arbitrated`)."
    );
    describe_histogram!(
        ACQUIRE_SECONDS,
        Unit::Seconds,
        "Time from an Acquire call to its grant, waiting included."
    );
    describe_histogram!(
        OVERHEAD_SECONDS,
        Unit::Seconds,
        "The proxy's own time on a call, by call (acquire, release, put, etcd_txn, ...): from the request to the answer, less its etcd round trips and its waits (for a turn, a holder, the proxy's copy of the cell, another proxy)."
    );
    counter(
        LOCKS_GRANTED,
        "Locks granted (retried acquires that found their own grant not counted).",
    );
    counter(LOCKS_RELEASED, "Locks released by their holder.");
    describe_gauge!(
        WAITERS,
        "Acquires waiting now: for their turn in the proxy's queue, or, for a fair class, in the lock's line in etcd."
    );
    counter(
        GRANT_ATTEMPTS,
        "Grant transactions tried (a waiter's turn, or an acquire's first try).",
    );
    counter(
        GRANTS_TAKEN_BACK,
        "Grants taken back before any caller saw them: made inside the lock's lock-delay, for a holder that vanished just before (the call waits on, or finds the lock busy).",
    );
    describe_gauge!(
        RESIDENT_BYTES,
        Unit::Bytes,
        "The proxy's resident size as it last read it (every second), against --max-memory-bytes."
    );
    counter(
        MEMORY_REFUSALS,
        "New sessions and watches refused because the proxy was past --max-memory-bytes.",
    );
    counter(
        ETCD_SPACE_REFUSALS,
        "Writes of new keys or values refused because etcd's database was at the proxy's space line.",
    );
    counter(
        LIMIT_REFUSALS,
        "Calls refused because the caller's identity was at one of its limits (grants file `[[limit]]`), by identity (`*`: one the file does not name) and limit.",
    );
    counter(
        WAIT_RETRIES,
        "Turns of waiting acquires that etcd failed (slow or away); the waiter tried again.",
    );
    describe_gauge!(
        KV_BYTES,
        "What the cell's small keys hold, as --max-kv-total-bytes counts it (names, values, 128 bytes a key), in this proxy's copy of them."
    );
}

/// Reads and watches: the copy of the small keys, the fan-out.
fn describe_reads() {
    for path in ["barrier", "mirror", "etcd"] {
        metrics::counter!(KV_READS, "path" => path).absolute(0);
    }
    describe_gauge!(WATCHERS, "Watch streams open on this proxy.");
    counter(
        WATCH_EVENTS_SENT,
        "Watch events sent to clients (fanned out from the proxy's one watch, or caught up).",
    );
    counter(
        WATCH_BATCHES_SENT,
        "Batches of events the fan-out handed to watchers.",
    );
    counter(
        WATCHERS_CUT_OFF,
        "Watchers cut off because they fell more than the backlog behind.",
    );
    counter(
        WATCH_CATCH_UPS,
        "Watchers that started from an older revision and caught up on a watch of their own.",
    );
    counter(
        WATCH_HISTORY_STARTS,
        "Watchers that started from an older revision the proxy's history of recent events still held (no etcd catch-up).",
    );
    counter(
        FEED_RELOADS,
        "Times the proxy reloaded its view of the small keys (a compaction passed it, etcd lost events, the store went back, or the watch stalled)."
    );
    counter(
        FEED_GAPS,
        "Holes in the revisions the proxy's watch delivered (etcd lost events); each one reloads the proxy's view."
    );
    counter(
        READ_BARRIERS,
        "Linearizable etcd requests made to fix a revision for a batch of reads.",
    );
    describe_histogram!(
        READ_BARRIER_BATCH,
        "Reads served by one read barrier request."
    );
    describe_counter!(
        KV_READS,
        "Small-key reads, by how they were served: barrier (linearizable, from the mirror), mirror (serializable), etcd (directly)."
    );
}

/// Describes the counter `name` and exports it at 0.
fn counter(name: &'static str, help: &'static str) {
    describe_counter!(name, help);
    metrics::counter!(name).absolute(0);
}

#[cfg(test)]
mod tests {
    /// Every metric this file names has its help text in [`super::describe`], which is
    /// what `/metrics` shows an operator.
    #[test]
    fn every_metric_is_described() {
        let source = include_str!("metrics.rs");
        let body = &source[source.find("pub fn describe()").expect("describe")..];
        let names = source
            .lines()
            .filter_map(|l| l.strip_prefix("pub const "))
            .filter_map(|l| l.split_once(": &str").map(|(name, _)| name));
        let missing: Vec<&str> = names
            .filter(|name| {
                !body.contains(&format!("({name},"))
                    && !body.contains(&format!("        {name},\n"))
            })
            .collect();
        assert!(
            missing.is_empty(),
            "metrics without a description: {missing:?}"
        );
    }
}
