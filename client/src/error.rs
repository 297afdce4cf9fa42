//! The SDK's one error type, and the one place a gRPC status becomes it.

use std::error::Error as StdError;

use tonic::{Code, Status};

/// Why a call through the SDK failed.
///
/// The variants an application is expected to act on are their own: a bad argument is a
/// bug to fix, an unavailable proxy is worth retrying, an expired session must be
/// reopened (and everything it held is lost).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address did not parse or nothing answered there.
    #[error("cannot reach the lockcell proxy at {addr}: {reason}")]
    Connect {
        /// The address as the application gave it.
        addr: String,
        /// The transport's explanation, with its causes.
        reason: String,
    },
    /// The proxy refused the request's content (e.g. a bad lock name); its message says
    /// what was wrong.
    #[error("{0}")]
    InvalidArgument(String),
    /// The session is gone: the proxy does not know it or it expired, or the application
    /// closed it. Its locks are released or about to be; open a new session.
    #[error("session {session} has expired; its locks are lost (open a new session)")]
    SessionExpired {
        /// The session's id.
        session: String,
    },
    /// The proxy (or its etcd) cannot serve right now; retrying later may succeed.
    #[error("lockcell proxy unavailable: {0}")]
    Unavailable(String),
    /// The proxy's reply broke the protocol (a bug on one side or the other).
    #[error("protocol violation by the proxy: {0}")]
    Protocol(String),
    /// Any other gRPC failure.
    #[error("lockcell call failed ({:?}): {}", .0.code(), .0.message())]
    Status(#[from] Status),
}

impl Error {
    /// Maps a gRPC status to an [`Error`]. `session` is the session the call was made
    /// for, if any: the proxy answers NOT_FOUND for a session it does not know and
    /// FAILED_PRECONDITION for one that expired, and both mean the same to the caller.
    pub(crate) fn from_status(status: Status, session: Option<&str>) -> Error {
        match (status.code(), session) {
            (Code::InvalidArgument, _) => Error::InvalidArgument(status.message().to_owned()),
            (Code::Unavailable, _) => Error::Unavailable(status.message().to_owned()),
            (Code::NotFound | Code::FailedPrecondition, Some(session)) => Error::SessionExpired {
                session: session.to_owned(),
            },
            _ => Error::Status(status),
        }
    }

    /// A transport error, with its causes, for [`Error::Connect`]: tonic's own text is
    /// often just "transport error", the useful part is further down the chain.
    pub(crate) fn connect(addr: &str, err: &(dyn StdError + 'static)) -> Error {
        let mut reason = err.to_string();
        let mut source = err.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !reason.contains(&text) {
                reason.push_str(": ");
                reason.push_str(&text);
            }
            source = cause.source();
        }
        Error::Connect {
            addr: addr.to_owned(),
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_codes_in_one_place() {
        let e = Error::from_status(
            Status::invalid_argument("lock name \"\" is empty"),
            Some("s1"),
        );
        assert!(matches!(e, Error::InvalidArgument(ref m) if m == "lock name \"\" is empty"));
        let e = Error::from_status(Status::unavailable("no lease"), None);
        assert!(matches!(e, Error::Unavailable(ref m) if m == "no lease"));
        for status in [Status::not_found("x"), Status::failed_precondition("y")] {
            let e = Error::from_status(status, Some("s1"));
            assert!(matches!(e, Error::SessionExpired { ref session } if session == "s1"));
        }
        // Without a session, NOT_FOUND means nothing more specific.
        let e = Error::from_status(Status::not_found("x"), None);
        assert!(matches!(e, Error::Status(ref s) if s.code() == Code::NotFound));
        let e = Error::from_status(Status::internal("boom"), Some("s1"));
        assert!(matches!(e, Error::Status(ref s) if s.code() == Code::Internal));
    }

    #[test]
    fn connect_error_names_the_address_and_the_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let e = Error::connect("127.0.0.1:1", &io);
        let text = e.to_string();
        assert!(text.contains("127.0.0.1:1"), "{text}");
        assert!(text.contains("connection refused"), "{text}");
    }
}
