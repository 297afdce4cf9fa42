//! Errors at the boundary between lockcell and etcd.

use std::time::Duration;

/// What can go wrong when the cell talks to etcd.
///
/// [`CellError::is_retriable`] separates a store that is briefly away (retry within the
/// caller's deadline) from a state that retrying will not fix.
#[derive(Debug, thiserror::Error)]
pub enum CellError {
    /// etcd answered with an error or the connection failed.
    #[error("etcd {op} failed: {source}")]
    Etcd {
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// etcd did not answer in time.
    #[error("etcd did not answer {op} within {after:?}")]
    Timeout { op: &'static str, after: Duration },
    /// A small key's name broke a rule (the reason names it).
    #[error("{reason}")]
    BadKey { key: String, reason: String },
    /// A record in etcd could not be read; someone wrote it by hand or a newer version did.
    #[error("record at {key} is not readable: {reason}")]
    CorruptRecord { key: String, reason: String },
    /// The cell is not the one the caller knew: its epoch record changed (a restore from
    /// backup and `bump-epoch`) or its revisions went backwards (a restore without one).
    /// Granting on would hand out tokens out of order; the proxy stops instead.
    #[error("the cell changed under this proxy: {reason}")]
    CellChanged { reason: String },
    /// The call waited its whole deadline for its turn to go to etcd, behind the other
    /// writes the proxy had in etcd: it was never sent, so nothing of it happened.
    #[error("{op} waited {waited:?} for its turn behind this proxy's other writes in etcd (--etcd-writes-in-flight) and was not sent; nothing was written")]
    Queued { op: &'static str, waited: Duration },
    /// The cell's copy of the shard map changed while the call was in flight (a prefix
    /// began to move, or moved): nothing was written. The call is tried again under the
    /// new map, which may route it elsewhere or refuse it while its prefix moves.
    #[error("the shard map in this cell changed (now at revision {now}) while the call was in flight; nothing was written")]
    MapChanged { now: i64 },
    /// The session already holds the lock through another call (an acquire, campaign
    /// or grant it made earlier): a lock is not re-entrant, and a second call sharing
    /// the first one's grant would let either call's release end the other's hold.
    #[error("this session already holds lock {lock:?} {mode} (token revision {revision}) through another acquire; a lock is not re-entrant: release that hold first, or retry the same call (same call id) to get it back")]
    AlreadyHeld {
        lock: String,
        mode: crate::keyspace::Mode,
        revision: i64,
    },
}

impl CellError {
    /// True when the same call may succeed later (etcd unreachable, slow or electing).
    pub fn is_retriable(&self) -> bool {
        matches!(
            self,
            CellError::Etcd { .. }
                | CellError::Timeout { .. }
                | CellError::MapChanged { .. }
                | CellError::Queued { .. }
        )
    }

    /// Whether etcd turned the request away before proposing it (it is too far behind
    /// applying what it committed): nothing of it happened.
    pub fn turned_away(&self) -> bool {
        match self {
            CellError::Etcd {
                source: etcd_client::Error::GRpcStatus(status),
                ..
            } => status.message().contains("too many requests"),
            _ => false,
        }
    }
}

/// etcd request latency, by call (`call`, the name [`with_timeout`] gives it) and
/// outcome (`ok`, `error`, `timeout`), in seconds.
pub const ETCD_REQUEST_SECONDS: &str = "lockcell_etcd_request_duration_seconds";

/// Histogram buckets of [`ETCD_REQUEST_SECONDS`] (proxies and the audit tailer alike),
/// in seconds: 0.5 ms to 10 s.
pub const ETCD_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

/// Records one etcd call's latency in [`ETCD_REQUEST_SECONDS`].
pub fn record_etcd_call(call: &'static str, outcome: &'static str, took: Duration) {
    metrics::histogram!(ETCD_REQUEST_SECONDS, "call" => call, "outcome" => outcome)
        .record(took.as_secs_f64());
}

/// Runs one etcd call with a deadline, naming the call in any error (and in its
/// latency, [`ETCD_REQUEST_SECONDS`]); its time counts as time the current call spent
/// outside the process ([`crate::timing`]).
pub async fn with_timeout<T>(
    op: &'static str,
    after: Duration,
    call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, CellError> {
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(after, call).await;
    let outcome = match &result {
        Ok(Ok(_)) => "ok",
        Ok(Err(_)) => "error",
        Err(_) => "timeout",
    };
    let took = started.elapsed();
    record_etcd_call(op, outcome, took);
    crate::timing::add_outside(took);
    match result {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(CellError::Etcd { op, source }),
        Err(_) => Err(CellError::Timeout { op, after }),
    }
}

/// The revision in an etcd reply's header; a reply without one is refused rather than
/// read as revision 0, which every later revision would pass.
pub fn header_revision(
    header: Option<&etcd_client::ResponseHeader>,
    op: &'static str,
) -> Result<i64, CellError> {
    header
        .map(|h| h.revision())
        .filter(|r| *r > 0)
        .ok_or_else(|| CellError::CorruptRecord {
            key: op.to_owned(),
            reason: "etcd's reply carries no revision".to_owned(),
        })
}
