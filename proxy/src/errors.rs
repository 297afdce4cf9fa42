//! The proxy's errors and the one place they become gRPC statuses.
//!
//! Every status of the lockcell API is made here, from a [`ProxyError`]. The etcd API
//! answers in etcd's own codes and words, which its clients match (`etcdserver:
//! requested lease not found`): those statuses are made where `etcd_api` answers,
//! beside the etcd behaviour they stand for.

use lockcell_cell::{CellError, NameError};
use tonic::Status;

use crate::sessions::Gone;

/// Why a call to the proxy failed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("{0}")]
    BadName(#[from] NameError),
    #[error("session {id:?} is not known to this proxy (never opened here, or closed)")]
    UnknownSession { id: String },
    #[error("session {id:?} has expired: {reason}")]
    ExpiredSession { id: String, reason: String },
    #[error("{0}")]
    BadArgument(String),
    /// The call is well-formed but breaks a rule of the lock's class or of its grant.
    #[error("{0}")]
    Refused(String),
    /// The caller's identity may not do this (prefix grants, another's session).
    #[error("{0}")]
    PermissionDenied(String),
    #[error("this proxy holds no etcd lease right now (etcd unreachable?); try again or use another proxy")]
    NoLease,
    /// No cell serves the name, or this proxy's cell does not: FAILED_PRECONDITION.
    #[error("{0}")]
    NotServed(String),
    /// The name's prefix is moving between cells, or moved to one this proxy does not
    /// serve yet: UNAVAILABLE (try again).
    #[error("{0}")]
    Moving(String),
    #[error("this proxy is shutting down; use another proxy")]
    ShuttingDown,
    /// etcd did not answer (the text says which call and why).
    #[error("etcd is unavailable: {0}")]
    EtcdUnavailable(String),
    /// The revision asked for is no longer kept.
    #[error("{0}")]
    OutOfRange(String),
    /// A read or watch from a revision of cell position `was`, while `now` serves its
    /// names: revisions of two cells are unrelated. OUT_OF_RANGE, naming `now` in the
    /// metadata ([`WATCH_CELL`]).
    #[error("{what}: its revisions are those of cell position {was:?}, and these names are at cell position {now:?} now (their prefix moved, or the cell was restored): read them again and go on from that read's revision")]
    OtherCell {
        what: String,
        was: String,
        now: String,
    },
    /// A read or watch from a revision older than the position it names: from before
    /// the names' routes took their epochs in this cell (a move brought them here, or
    /// back), or before the cell's epoch. OUT_OF_RANGE, as [`ProxyError::OtherCell`].
    #[error("{what}: revision {revision} is from before position {now:?} began at revision {since} (the names moved here then, or the cell was restored): read them again and go on from that read's revision")]
    BeforePosition {
        what: String,
        revision: i64,
        since: i64,
        now: String,
    },
    /// The call would pass a limit of the cell or the proxy: RESOURCE_EXHAUSTED.
    #[error("{0}")]
    Exhausted(String),
    /// The proxy has too much of this in hand right now; the same call may go through
    /// in a moment: UNAVAILABLE.
    #[error("{0}")]
    Busy(String),
    /// A resume named an older session fence than the store has: a resume the client
    /// did not hear the end of landed, moving the keys to `lease`.
    #[error("session {session:?} was resumed at fence revision {revision}, after the fence this resume names; resume again with that revision and the lease in this refusal's metadata")]
    FencedOut {
        session: String,
        revision: i64,
        lease: i64,
    },
    /// The caller is not known: no certificate or token it can be known by.
    #[error("{0}")]
    Unauthenticated(String),
    /// A watch's history from its start revision is gone (compacted, or a hole in
    /// it): OUT_OF_RANGE, with the oldest revision it can start at in the metadata
    /// ([`COMPACT_REVISION`]).
    #[error("{message}")]
    Compacted { message: String, oldest: i64 },
    /// A watcher fell too far behind and was cut off: RESOURCE_EXHAUSTED, with the
    /// revision to resume from in the metadata ([`RESUME_REVISION`]).
    #[error("{message}")]
    CutOff { message: String, resume: i64 },
    /// A stream ends for a reason of the proxy's (it stops, reloads, or its catch-up
    /// failed): UNAVAILABLE, and the text says where to resume.
    #[error("{0}")]
    StreamEnded(String),
    /// A stream's names moved out of the cell it read them in: OUT_OF_RANGE, with the
    /// names' position now in the metadata ([`WATCH_CELL`]) when one cell serves them.
    #[error("{message}")]
    MovedOut {
        message: String,
        now: Option<String>,
    },
    /// The caller left before its answer: CANCELLED (no one hears it).
    #[error("{0}")]
    Cancelled(String),
    /// The proxy's own fault (a task of the call's panicked): INTERNAL, never the
    /// caller's.
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    Store(#[from] CellError),
    #[error("{context}: {source}")]
    StoreDuring {
        context: String,
        #[source]
        source: CellError,
    },
}

impl ProxyError {
    pub fn session(id: &str, gone: Gone) -> Self {
        match gone {
            // Only etcd API leases are handed off, and they never reach here.
            Gone::Unknown | Gone::HandedOff => ProxyError::UnknownSession { id: id.to_owned() },
            Gone::Expired(reason) => ProxyError::ExpiredSession {
                id: id.to_owned(),
                reason: reason.to_string(),
            },
        }
    }
}

/// Metadata of a resume refused for an older fence: the fence's revision and lease now.
pub const FENCE_REVISION: &str = "lockcell-fence-revision";
pub const FENCE_LEASE: &str = "lockcell-fence-lease";
/// Metadata of an acquire refused because the session holds the lock through another
/// call: the revision of that hold.
pub const ALREADY_HELD: &str = "lockcell-already-held";
/// Metadata of an OUT_OF_RANGE refusing a read or ending a watch whose revisions are
/// another cell's than the one serving its names now: that cell's position.
pub const WATCH_CELL: &str = "lockcell-watch-cell";
/// Metadata of a watch refused for history that is gone: the oldest revision it can
/// start at.
pub const COMPACT_REVISION: &str = "lockcell-compact-revision";
/// Metadata of a watch cut off for falling behind: the revision to resume from.
pub const RESUME_REVISION: &str = "lockcell-resume-revision";

/// `status`, with `revision` under `key` in its metadata.
fn with_revision(mut status: Status, key: &'static str, revision: i64) -> Status {
    status
        .metadata_mut()
        .insert(key, revision.to_string().parse().expect("digits"));
    status
}

impl From<ProxyError> for Status {
    fn from(e: ProxyError) -> Status {
        let message = e.to_string();
        match e {
            ProxyError::BadName(_) | ProxyError::BadArgument(_) => {
                Status::invalid_argument(message)
            }
            ProxyError::UnknownSession { .. } => Status::not_found(message),
            ProxyError::PermissionDenied(_) => Status::permission_denied(message),
            ProxyError::ExpiredSession { .. }
            | ProxyError::Refused(_)
            | ProxyError::NotServed(_) => Status::failed_precondition(message),
            ProxyError::NoLease
            | ProxyError::ShuttingDown
            | ProxyError::EtcdUnavailable(_)
            | ProxyError::Moving(_)
            | ProxyError::Busy(_) => Status::unavailable(message),
            ProxyError::OutOfRange(_) => Status::out_of_range(message),
            ProxyError::Unauthenticated(_) => Status::unauthenticated(message),
            ProxyError::Cancelled(_) => Status::cancelled(message),
            ProxyError::StreamEnded(_) => Status::unavailable(message),
            ProxyError::Compacted { oldest, .. } => {
                with_revision(Status::out_of_range(message), COMPACT_REVISION, oldest)
            }
            ProxyError::CutOff { resume, .. } => {
                with_revision(Status::resource_exhausted(message), RESUME_REVISION, resume)
            }
            ProxyError::MovedOut { now, .. } => {
                let mut status = Status::out_of_range(message);
                if let Some(value) = now.and_then(|now| now.parse().ok()) {
                    status.metadata_mut().insert(WATCH_CELL, value);
                }
                status
            }
            ProxyError::OtherCell { ref now, .. } | ProxyError::BeforePosition { ref now, .. } => {
                let mut status = Status::out_of_range(message);
                if let Ok(value) = now.parse() {
                    status.metadata_mut().insert(WATCH_CELL, value);
                }
                status
            }
            ProxyError::Exhausted(_) => Status::resource_exhausted(message),
            ProxyError::Internal(_) => Status::internal(message),
            ProxyError::FencedOut {
                revision, lease, ..
            } => {
                let mut status = Status::failed_precondition(message);
                let meta = status.metadata_mut();
                meta.insert(
                    FENCE_REVISION,
                    revision.to_string().parse().expect("digits"),
                );
                meta.insert(FENCE_LEASE, lease.to_string().parse().expect("digits"));
                status
            }
            ProxyError::Store(CellError::BadKey { .. }) => Status::invalid_argument(message),
            ProxyError::Store(CellError::AlreadyHeld { revision, .. }) => {
                let mut status = Status::failed_precondition(message);
                status
                    .metadata_mut()
                    .insert(ALREADY_HELD, revision.to_string().parse().expect("digits"));
                status
            }
            // Another proxy, started on the changed cell, may serve the call.
            ProxyError::Store(CellError::CellChanged { .. }) => Status::unavailable(message),
            ProxyError::Store(ref c) | ProxyError::StoreDuring { source: ref c, .. } => {
                if c.is_retriable() {
                    Status::unavailable(message)
                } else {
                    Status::internal(message)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn metadata(status: &Status, key: &str) -> Option<String> {
        let value = status.metadata().get(key)?;
        Some(value.to_str().expect("text").to_owned())
    }

    #[test]
    fn a_stream_that_ends_says_where_to_go_on_in_its_code_and_metadata() {
        let gone = Status::from(ProxyError::Compacted {
            message: "history gone".to_owned(),
            oldest: 41,
        });
        assert_eq!(gone.code(), Code::OutOfRange);
        assert_eq!(gone.message(), "history gone");
        assert_eq!(metadata(&gone, COMPACT_REVISION).as_deref(), Some("41"));
        let cut = Status::from(ProxyError::CutOff {
            message: "behind".to_owned(),
            resume: 90,
        });
        assert_eq!(cut.code(), Code::ResourceExhausted);
        assert_eq!(metadata(&cut, RESUME_REVISION).as_deref(), Some("90"));
        let moved = Status::from(ProxyError::MovedOut {
            message: "moved".to_owned(),
            now: Some("c2@7".to_owned()),
        });
        assert_eq!(moved.code(), Code::OutOfRange);
        assert_eq!(metadata(&moved, WATCH_CELL).as_deref(), Some("c2@7"));
        let nowhere = Status::from(ProxyError::MovedOut {
            message: "moved".to_owned(),
            now: None,
        });
        assert_eq!(metadata(&nowhere, WATCH_CELL), None);
        let ended = Status::from(ProxyError::StreamEnded("reloading".to_owned()));
        assert_eq!(ended.code(), Code::Unavailable);
        assert_eq!(ended.message(), "reloading");
    }

    #[test]
    fn the_callers_faults_and_the_proxys_own_have_their_codes() {
        let code = |e: ProxyError| Status::from(e).code();
        assert_eq!(
            code(ProxyError::Unauthenticated("who".into())),
            Code::Unauthenticated
        );
        assert_eq!(
            code(ProxyError::PermissionDenied("no".into())),
            Code::PermissionDenied
        );
        assert_eq!(code(ProxyError::Cancelled("left".into())), Code::Cancelled);
        // A task of the call's that panicked is the proxy's fault, never the caller's.
        assert_eq!(
            code(ProxyError::Internal("panicked".into())),
            Code::Internal
        );
        assert_eq!(
            code(ProxyError::BadArgument("bad".into())),
            Code::InvalidArgument
        );
    }
}
