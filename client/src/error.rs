//! The SDK's one error type, and the one place a gRPC status becomes it.

use std::error::Error as StdError;

use tonic::{Code, Status};

/// Why a call through the SDK failed.
///
/// The variants an application is expected to act on are their own: a bad argument is a
/// bug to fix, an unavailable proxy is worth retrying, an expired session must be
/// reopened (and everything it held is lost).
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::{Error, Wait};
///
/// match session.acquire("billing/nightly", Wait::Try).await {
///     Ok(Some(guard)) => run_nightly_billing(guard.token()).await,
///     Ok(None) => println!("another worker runs the nightly billing"),
///     // Gone, with everything it held: start over with a new session.
///     Err(Error::SessionExpired { session }) => eprintln!("session {session} expired"),
///     Err(Error::PermissionDenied(why)) => eprintln!("not ours to run: {why}"),
///     Err(error) => return Err(error),
/// }
/// # Ok(()) }
/// # async fn run_nightly_billing(_token: lockcell_client::FencingToken) {}
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// The proxy refused a call about a grant (a Release, a Proclaim, a Resign) because
    /// the grant it names is no longer the current one: the lock passed on or the
    /// leadership ended. The text is the proxy's, naming the lock or election and the
    /// token. Stop acting as holder or leader; the session itself may still be fine.
    #[error("{0}")]
    NotHolder(String),
    /// The session already holds the lock (or leads the election) it asked for, through
    /// another guard: a lock is not re-entrant. Release (or drop) that guard first; the
    /// text names the lock and the hold.
    #[error("{0}")]
    AlreadyHeld(String),
    /// The proxy's prefix grants do not let this client do that to that name; the text
    /// names the identity, the right and the name.
    #[error("{0}")]
    PermissionDenied(String),
    /// The proxy checks prefix grants and could not tell who this client is: connect
    /// with a client certificate or a token ([`ClientOptions`](crate::ClientOptions)).
    #[error("{0}")]
    Unauthenticated(String),
    /// The proxy (or its etcd) cannot serve right now; retrying later may succeed.
    #[error("lockcell proxy unavailable: {0}")]
    Unavailable(String),
    /// The call would pass a limit of the cell or the proxy (such as what all small keys
    /// may hold together); the text names the limit. Retrying changes nothing until
    /// something is freed (keys deleted) or the limit raised.
    #[error("{0}")]
    ResourceExhausted(String),
    /// A watch fell too far behind the events it was sent, and the proxy cut it off
    /// rather than buffer without bound. Nothing is lost: the [`Watcher`](crate::Watcher)
    /// that reported it resumes from `resume_from` at its next call, with no gap and no
    /// duplicate. It is reported (once per cut-off) because it means the application
    /// consumes events more slowly than they come.
    #[error(
        "the watch on {key:?} fell too far behind and the proxy cut it off; it resumes from revision {resume_from}"
    )]
    WatchCutOff {
        /// The key or prefix watched.
        key: String,
        /// The revision the watch goes on from.
        resume_from: i64,
    },
    /// A watch asked for revisions that etcd has compacted away, so the events it would
    /// have seen are lost. This is the end of that watch: read the key (or prefix) again
    /// and watch from that read's revision + 1.
    #[error(
        "cannot watch {key:?} from the revision asked: etcd compacted the revisions before {compact_revision} (read it again and watch from the read's revision + 1)"
    )]
    Compacted {
        /// The key or prefix watched.
        key: String,
        /// The oldest revision a watch can start from now (one past etcd's compact
        /// revision: etcd keeps the state at that revision, not the deletes made at it).
        compact_revision: i64,
    },
    /// A watch's position is a revision of one cell, and another cell serves the
    /// watched names now (their prefix moved, or the cell was restored from a backup):
    /// revisions of two cells are unrelated, so the watch cannot go on from there. This
    /// is the end of that watch, as for [`Error::Compacted`]: read the key (or prefix)
    /// again and watch from that read's revision + 1. [`Members`](crate::Members) does
    /// so by itself.
    #[error(
        "the watch on {key:?} cannot go on from its position: the key is at position {cell:?} now (its prefix moved, or the cell was restored), and revisions of two positions are unrelated (read it again and watch from the read's revision + 1)"
    )]
    WatchMoved {
        /// The key or prefix watched.
        key: String,
        /// The position of the key's revisions as the proxy saw it when it refused the
        /// watch (`CLUSTER/EPOCH/ROUTE-EPOCH`), for messages: it may still change as a
        /// move completes, so never go on from it; read again.
        cell: String,
    },
    /// The proxy's reply broke the protocol (a bug on one side or the other).
    #[error("protocol violation by the proxy: {0}")]
    Protocol(String),
    /// Any other refusal or failure the proxy answered with: its gRPC code, in the
    /// SDK's own terms, and its message, which names what it is about.
    #[error("lockcell call failed ({code}): {message}")]
    Status {
        /// The gRPC code of the proxy's answer.
        code: StatusCode,
        /// The proxy's text.
        message: String,
    },
}

/// The gRPC code of an answer the SDK has no variant of its own for
/// ([`Error::Status`]), so that a caller can match it without depending on a gRPC
/// crate. Shown as gRPC names it (`FAILED_PRECONDITION`).
///
/// ```
/// use lockcell_client::{Error, ErrorKind, StatusCode};
///
/// let refused = Error::Status {
///     code: StatusCode::FailedPrecondition,
///     message: "lock class \"jobs/\" allows no shared locks".into(),
/// };
/// assert_eq!(refused.kind(), ErrorKind::Fatal);
/// assert!(refused.to_string().contains("FAILED_PRECONDITION"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StatusCode {
    /// The call was cancelled (by the caller, or by the proxy stopping it).
    Cancelled,
    /// An error the proxy could not classify.
    Unknown,
    /// The request's content was refused.
    InvalidArgument,
    /// The call's deadline passed before an answer.
    DeadlineExceeded,
    /// What the call names does not exist.
    NotFound,
    /// What the call would create exists already.
    AlreadyExists,
    /// The caller may not do that.
    PermissionDenied,
    /// A limit or quota would be passed.
    ResourceExhausted,
    /// The state does not allow the call now.
    FailedPrecondition,
    /// The call was abandoned, usually for a conflict; it may be retried.
    Aborted,
    /// A position outside the valid range (such as a compacted revision).
    OutOfRange,
    /// The proxy does not implement the call.
    Unimplemented,
    /// The proxy broke an invariant of its own.
    Internal,
    /// The proxy cannot serve now.
    Unavailable,
    /// Data was lost or corrupted.
    DataLoss,
    /// The caller's identity could not be established.
    Unauthenticated,
}

impl StatusCode {
    fn of(code: Code) -> StatusCode {
        match code {
            Code::Cancelled => StatusCode::Cancelled,
            Code::InvalidArgument => StatusCode::InvalidArgument,
            Code::DeadlineExceeded => StatusCode::DeadlineExceeded,
            Code::NotFound => StatusCode::NotFound,
            Code::AlreadyExists => StatusCode::AlreadyExists,
            Code::PermissionDenied => StatusCode::PermissionDenied,
            Code::ResourceExhausted => StatusCode::ResourceExhausted,
            Code::FailedPrecondition => StatusCode::FailedPrecondition,
            Code::Aborted => StatusCode::Aborted,
            Code::OutOfRange => StatusCode::OutOfRange,
            Code::Unimplemented => StatusCode::Unimplemented,
            Code::Internal => StatusCode::Internal,
            Code::Unavailable => StatusCode::Unavailable,
            Code::DataLoss => StatusCode::DataLoss,
            Code::Unauthenticated => StatusCode::Unauthenticated,
            // OK is no failure; a failure that says it is one is unclassifiable.
            Code::Ok | Code::Unknown => StatusCode::Unknown,
        }
    }

    /// The code as gRPC names it.
    ///
    /// ```
    /// assert_eq!(lockcell_client::StatusCode::OutOfRange.as_str(), "OUT_OF_RANGE");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            StatusCode::Cancelled => "CANCELLED",
            StatusCode::Unknown => "UNKNOWN",
            StatusCode::InvalidArgument => "INVALID_ARGUMENT",
            StatusCode::DeadlineExceeded => "DEADLINE_EXCEEDED",
            StatusCode::NotFound => "NOT_FOUND",
            StatusCode::AlreadyExists => "ALREADY_EXISTS",
            StatusCode::PermissionDenied => "PERMISSION_DENIED",
            StatusCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
            StatusCode::FailedPrecondition => "FAILED_PRECONDITION",
            StatusCode::Aborted => "ABORTED",
            StatusCode::OutOfRange => "OUT_OF_RANGE",
            StatusCode::Unimplemented => "UNIMPLEMENTED",
            StatusCode::Internal => "INTERNAL",
            StatusCode::Unavailable => "UNAVAILABLE",
            StatusCode::DataLoss => "DATA_LOSS",
            StatusCode::Unauthenticated => "UNAUTHENTICATED",
        }
    }
}

impl std::fmt::Display for StatusCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a caller can do about an [`Error`] ([`Error::kind`]).
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use std::time::Duration;
///
/// use lockcell_client::ErrorKind;
///
/// // Load the rates, waiting out a proxy that restarts; give up on anything else.
/// let rates = loop {
///     match client.get_prefix("config/rates/").await {
///         Ok(rates) => break rates,
///         Err(error) if error.kind() == ErrorKind::Retry => {
///             eprintln!("rates not loaded yet: {error}");
///             tokio::time::sleep(Duration::from_secs(1)).await;
///         }
///         Err(error) => return Err(error),
///     }
/// };
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Try the call again after a pause: no proxy answered, the proxy or its etcd could
    /// not serve it now, or a limit refused it that may free up (a call rate, sessions
    /// or keys others end). [`Error::Connect`] is here too, although an address that
    /// does not parse, or a TLS setup the proxy refuses, needs fixing first: its message
    /// says which. The SDK has already retried what it safely could: across
    /// proxies, the waits of acquires and campaigns whose proxy went away.
    Retry,
    /// The session is gone and everything it held with it: open a new session.
    NewSession,
    /// Trying again changes nothing: a request to fix, a refusal to take (grants, a lock
    /// already held), a hold that has ended, a watch to start again from a fresh read.
    Fatal,
}

impl Error {
    /// What a caller can do about this error: retry, open a new session, or give up.
    ///
    /// ```
    /// use lockcell_client::{Error, ErrorKind};
    ///
    /// let cut_off = Error::WatchCutOff {
    ///     key: "config/rates/".into(),
    ///     resume_from: 4522,
    /// };
    /// assert_eq!(cut_off.kind(), ErrorKind::Retry); // the watcher goes on by itself
    /// let expired = Error::SessionExpired {
    ///     session: "7f3a9c".into(),
    /// };
    /// assert_eq!(expired.kind(), ErrorKind::NewSession);
    /// let refused = Error::PermissionDenied("\"reports\" may not lock \"billing/nightly\"".into());
    /// assert_eq!(refused.kind(), ErrorKind::Fatal);
    /// ```
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Connect { .. }
            | Error::Unavailable(_)
            | Error::ResourceExhausted(_)
            | Error::WatchCutOff { .. } => ErrorKind::Retry,
            Error::SessionExpired { .. } => ErrorKind::NewSession,
            Error::Status { code, .. } => match code {
                StatusCode::Unavailable
                | StatusCode::DeadlineExceeded
                | StatusCode::Aborted
                | StatusCode::Cancelled
                | StatusCode::Unknown
                | StatusCode::ResourceExhausted => ErrorKind::Retry,
                _ => ErrorKind::Fatal,
            },
            Error::InvalidArgument(_)
            | Error::NotHolder(_)
            | Error::AlreadyHeld(_)
            | Error::PermissionDenied(_)
            | Error::Unauthenticated(_)
            | Error::Compacted { .. }
            | Error::WatchMoved { .. }
            | Error::Protocol(_) => ErrorKind::Fatal,
        }
    }
}

impl From<Status> for Error {
    fn from(status: Status) -> Self {
        Error::from_status(status, Call::Unbound)
    }
}

/// What a failed call was made for. NOT_FOUND and FAILED_PRECONDITION mean different
/// things depending on it, so every call says which kind it is.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Call<'a> {
    /// A call without a session: Open, Leader, Observe, CheckSequencer.
    Unbound,
    /// A session's call that asks for something: Acquire, Campaign, Close.
    Session(&'a str),
    /// A session's call about a grant it holds: Release, Proclaim, Resign.
    Grant(&'a str),
    /// A Watch of this key or prefix: OUT_OF_RANGE and RESOURCE_EXHAUSTED end it with the
    /// revision to go on from in the status's metadata.
    Watch(&'a str),
}

/// Metadata of an OUT_OF_RANGE that ends a Watch: the oldest revision still available.
pub(crate) const COMPACT_REVISION: &str = "lockcell-compact-revision";
/// Metadata of an OUT_OF_RANGE that ends a Watch whose names another cell serves now:
/// that cell.
pub(crate) const WATCH_CELL: &str = "lockcell-watch-cell";
/// Metadata of a FAILED_PRECONDITION refusing an acquire or campaign because the
/// session holds the lock through another call: that hold's revision.
pub(crate) const ALREADY_HELD: &str = "lockcell-already-held";
/// Metadata of a RESOURCE_EXHAUSTED that ends a Watch: where to watch from to go on with
/// no gap and no duplicate.
pub(crate) const RESUME_REVISION: &str = "lockcell-resume-revision";

/// Whether `status` is no answer of the proxy's: the connection broke, or the call
/// timed out, before a reply came. tonic makes such a status itself, with the
/// transport's error as its source, under whatever code it picks (UNKNOWN "transport
/// error" when a TLS connection ends mid-call); a status the proxy sent has no source.
pub(crate) fn no_answer(status: &Status) -> bool {
    StdError::source(status).is_some()
}

impl Error {
    /// Maps a gRPC status to an [`Error`], given what the call was for.
    ///
    /// The proxy answers NOT_FOUND for a session it does not know ("… is not known …")
    /// and FAILED_PRECONDITION for one that expired ("… has expired …"); both mean the
    /// session is gone. On a call about a held grant, any other FAILED_PRECONDITION (or
    /// NOT_FOUND) means the grant is no longer current, which is [`Error::NotHolder`]
    /// with the proxy's text.
    ///
    /// A Watch that ends with OUT_OF_RANGE is [`Error::Compacted`], one that ends with
    /// RESOURCE_EXHAUSTED is [`Error::WatchCutOff`], each with the revision the proxy put
    /// in the metadata. Without it, the status did not come from the proxy's watch
    /// (tonic says the same codes about oversized messages) and stays a plain status.
    pub(crate) fn from_status(status: Status, call: Call<'_>) -> Error {
        let plain = |status: Status| Error::Status {
            code: StatusCode::of(status.code()),
            message: status.message().to_owned(),
        };
        let status = with_tls_hint(status);
        if let Some(cause) = StdError::source(&status) {
            // No answer (see `no_answer`): tonic's message, then what the transport said.
            let mut text = status.message().to_owned();
            let causes = chain(cause);
            if !text.contains(&causes) {
                text = format!("{text}: {causes}");
            }
            return Error::Unavailable(tls_hint(format!(
                "no answer from the proxy ({:?}: {text})",
                status.code()
            )));
        }
        let gone = |id: &str| Error::SessionExpired {
            session: id.to_owned(),
        };
        match (status.code(), call) {
            (Code::OutOfRange, Call::Watch(key)) => {
                let cell = status
                    .metadata()
                    .get(WATCH_CELL)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                match (revision_in(&status, COMPACT_REVISION), cell) {
                    (Some(compact_revision), _) => Error::Compacted {
                        key: key.to_owned(),
                        compact_revision,
                    },
                    (None, Some(cell)) => Error::WatchMoved {
                        key: key.to_owned(),
                        cell,
                    },
                    (None, None) => plain(status),
                }
            }
            (Code::ResourceExhausted, Call::Watch(key)) => {
                match revision_in(&status, RESUME_REVISION) {
                    Some(resume_from) => Error::WatchCutOff {
                        key: key.to_owned(),
                        resume_from,
                    },
                    None => plain(status),
                }
            }
            (Code::ResourceExhausted, _) => Error::ResourceExhausted(status.message().to_owned()),
            // The proxy's gRPC layer refusing a request over its message size, before
            // any of lockcell's own checks (which name the key and the limit) could run.
            (Code::OutOfRange, _) if status.message().contains("message length too large") => {
                Error::InvalidArgument(format!(
                    "the request is larger than the proxy accepts: {}",
                    status.message()
                ))
            }
            (Code::FailedPrecondition, _) if status.metadata().get(ALREADY_HELD).is_some() => {
                Error::AlreadyHeld(status.message().to_owned())
            }
            (Code::InvalidArgument, _) => Error::InvalidArgument(status.message().to_owned()),
            (Code::PermissionDenied, _) => Error::PermissionDenied(status.message().to_owned()),
            (Code::Unauthenticated, _) => Error::Unauthenticated(status.message().to_owned()),
            (Code::Unavailable, _) => Error::Unavailable(status.message().to_owned()),
            (Code::NotFound | Code::FailedPrecondition, Call::Session(id) | Call::Grant(id))
                if names_a_gone_session(status.message()) =>
            {
                gone(id)
            }
            (Code::NotFound | Code::FailedPrecondition, Call::Grant(_)) => {
                Error::NotHolder(status.message().to_owned())
            }
            // The proxy's answer for a session it does not know, whatever the wording.
            (Code::NotFound, Call::Session(id)) => gone(id),
            _ => plain(status),
        }
    }

    /// What went wrong, to go inside another error's message: an
    /// [`Error::Unavailable`]'s own text (its "proxy unavailable" is said by the
    /// outer error), any other error's whole text.
    pub(crate) fn into_reason(self) -> String {
        match self {
            Error::Unavailable(reason) => reason,
            other => other.to_string(),
        }
    }

    /// A transport error, with its causes, for [`Error::Connect`]: tonic's own text is
    /// often just "transport error", the useful part is further down the chain.
    pub(crate) fn connect(addr: &str, err: &(dyn StdError + 'static)) -> Error {
        Error::Connect {
            addr: addr.to_owned(),
            reason: tls_hint(chain(err)),
        }
    }
}

/// `err`'s text followed by its causes' that say something more.
fn chain(err: &(dyn StdError + 'static)) -> String {
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
    reason
}

/// The revision in metadata entry `name` of `status`, if there is a well-formed one.
fn revision_in(status: &Status, name: &str) -> Option<i64> {
    status
        .metadata()
        .get(name)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `status`, saying what to do when it is what plain HTTP/2 makes of a TLS server's
/// answer (the TLS record read as a frame header).
fn with_tls_hint(status: Status) -> Status {
    let message = status.message();
    if !reads_tls_as_http2(message) {
        return status;
    }
    Status::new(status.code(), tls_hint(message.to_owned()))
}

/// `text`, saying what to do when it is what plain HTTP/2 makes of a TLS server's answer.
fn tls_hint(text: String) -> String {
    if !reads_tls_as_http2(&text) {
        return text;
    }
    format!(
        "{text} (the proxy may serve TLS: give the CA that signed its certificate, ClientOptions::tls or lockctl --tls-ca / LOCKCELL_TLS_CA)"
    )
}

fn reads_tls_as_http2(text: &str) -> bool {
    text.contains("frame with invalid size") || text.contains("FRAME_SIZE_ERROR")
}

/// Whether the proxy's message says the session itself is gone (expired, or unknown to
/// it), as opposed to a grant of a live session being stale.
pub(crate) fn names_a_gone_session(message: &str) -> bool {
    message.contains("has expired") || message.contains("is not known")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http2_to_a_tls_proxy_says_to_give_the_ca() {
        for status in [
            Status::internal(
                "h2 protocol error: http2 error: connection error detected: frame with invalid size",
            ),
            Status::unavailable("connection error: FRAME_SIZE_ERROR"),
        ] {
            let code = status.code();
            let e = Error::from_status(status, Call::Unbound);
            let text = e.to_string();
            assert!(text.contains("--tls-ca"), "{text}");
            assert_eq!(
                matches!(e, Error::Unavailable(_)),
                code == Code::Unavailable,
                "the kind of error stays"
            );
        }
    }

    /// What tonic makes of a TLS connection that ended mid-call: UNKNOWN, with the
    /// transport's error as its source.
    fn broken_mid_call() -> Status {
        let eof = std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "peer closed connection without sending TLS close_notify",
        );
        let mut status = Status::unknown("transport error");
        status.set_source(std::sync::Arc::new(eof));
        status
    }

    #[test]
    fn no_answer_is_unavailable_whatever_code_tonic_gave_it() {
        for call in [Call::Unbound, Call::Session("s1"), Call::Grant("s1")] {
            let e = Error::from_status(broken_mid_call(), call);
            assert!(
                matches!(e, Error::Unavailable(ref m) if m.contains("transport error") && m.contains("close_notify")),
                "{e:?}"
            );
            assert_eq!(e.kind(), ErrorKind::Retry);
        }
        // The proxy's own UNKNOWN (no source) is its answer, not a broken connection.
        let e = Error::from_status(Status::unknown("transport error"), Call::Unbound);
        assert!(matches!(e, Error::Status { .. }), "{e:?}");
        assert!(no_answer(&broken_mid_call()));
        assert!(!no_answer(&Status::unavailable("draining")));
    }

    #[test]
    fn every_error_says_what_to_do_about_it() {
        let kind = |status, call| Error::from_status(status, call).kind();
        assert_eq!(
            kind(Status::unavailable("draining"), Call::Unbound),
            ErrorKind::Retry
        );
        assert_eq!(
            kind(
                Status::resource_exhausted("identity \"x\" calls too often"),
                Call::Unbound
            ),
            ErrorKind::Retry
        );
        assert_eq!(
            kind(Status::failed_precondition(EXPIRED), Call::Session("s1")),
            ErrorKind::NewSession
        );
        assert_eq!(
            kind(
                Status::failed_precondition("lock \"x\" passed on"),
                Call::Grant("s1")
            ),
            ErrorKind::Fatal
        );
        assert_eq!(
            kind(Status::invalid_argument("bad"), Call::Unbound),
            ErrorKind::Fatal
        );
        assert_eq!(
            kind(Status::permission_denied("no"), Call::Unbound),
            ErrorKind::Fatal
        );
        assert_eq!(
            kind(Status::internal("bug"), Call::Unbound),
            ErrorKind::Fatal
        );
        assert_eq!(
            kind(Status::deadline_exceeded("slow"), Call::Unbound),
            ErrorKind::Retry
        );
    }

    const EXPIRED: &str = "session \"s1\" has expired: missed renewals";
    const UNKNOWN: &str =
        "session \"s1\" is not known to this proxy (never opened here, or closed)";

    fn is_expired(e: &Error) -> bool {
        matches!(e, Error::SessionExpired { session } if session == "s1")
    }

    #[test]
    fn maps_codes_in_one_place() {
        let e = Error::from_status(
            Status::invalid_argument("lock name \"\" is empty"),
            Call::Session("s1"),
        );
        assert!(matches!(e, Error::InvalidArgument(ref m) if m == "lock name \"\" is empty"));
        let e = Error::from_status(Status::unavailable("no lease"), Call::Unbound);
        assert!(matches!(e, Error::Unavailable(ref m) if m == "no lease"));
        let e = Error::from_status(Status::internal("boom"), Call::Session("s1"));
        assert!(matches!(
            e,
            Error::Status {
                code: StatusCode::Internal,
                ..
            }
        ));
        // Without a session, NOT_FOUND and FAILED_PRECONDITION mean nothing more specific.
        for status in [Status::not_found("x"), Status::failed_precondition(EXPIRED)] {
            let code = status.code();
            let e = Error::from_status(status, Call::Unbound);
            assert!(
                matches!(e, Error::Status { code: c, .. } if c == StatusCode::of(code)),
                "{e:?}"
            );
        }
    }

    #[test]
    fn a_gone_session_is_told_apart_from_a_stale_grant_by_the_message() {
        for call in [Call::Session("s1"), Call::Grant("s1")] {
            let e = Error::from_status(Status::failed_precondition(EXPIRED), call);
            assert!(is_expired(&e), "{call:?}: {e:?}");
            let e = Error::from_status(Status::not_found(UNKNOWN), call);
            assert!(is_expired(&e), "{call:?}: {e:?}");
        }
        for stale in [
            "not the leader of election \"db\"",
            "token 1:4521 is not the current grant of lock \"jobs/x\"",
        ] {
            let e = Error::from_status(Status::failed_precondition(stale), Call::Grant("s1"));
            assert!(matches!(e, Error::NotHolder(ref m) if m == stale), "{e:?}");
            assert_eq!(e.to_string(), stale, "the proxy's text reaches the caller");
        }
        // A session's request refused for another reason does not end the session...
        let e = Error::from_status(
            Status::failed_precondition("lock class \"jobs/\" allows no shared locks"),
            Call::Session("s1"),
        );
        assert!(matches!(
            e,
            Error::Status {
                code: StatusCode::FailedPrecondition,
                ..
            }
        ));
        // ...but NOT_FOUND on one is the proxy not knowing the session.
        let e = Error::from_status(Status::not_found("x"), Call::Session("s1"));
        assert!(is_expired(&e), "{e:?}");
    }

    /// A status as the proxy ends a watch with: `code`, and `revision` under `name`.
    fn watch_end(code: Code, name: &'static str, revision: &str) -> Status {
        let mut status = Status::new(code, "watch ended");
        status
            .metadata_mut()
            .insert(name, revision.parse().expect("ascii"));
        status
    }

    #[test]
    fn a_watch_ended_for_compaction_or_for_falling_behind_names_the_revision() {
        let e = Error::from_status(
            watch_end(Code::OutOfRange, COMPACT_REVISION, "4200"),
            Call::Watch("config/"),
        );
        assert!(
            matches!(e, Error::Compacted { ref key, compact_revision: 4200 } if key == "config/"),
            "{e:?}"
        );
        assert!(e.to_string().contains("4200"), "{e}");
        let e = Error::from_status(
            watch_end(Code::ResourceExhausted, RESUME_REVISION, "4321"),
            Call::Watch("config/"),
        );
        assert!(
            matches!(e, Error::WatchCutOff { ref key, resume_from: 4321 } if key == "config/"),
            "{e:?}"
        );
        assert!(e.to_string().contains("4321"), "{e}");
    }

    #[test]
    fn watch_codes_without_the_proxys_metadata_stay_plain_statuses() {
        for status in [
            // No metadata: tonic's own complaint about an oversized message, say.
            Status::out_of_range("message too large"),
            Status::resource_exhausted("message too large"),
            // Metadata under the other code's name, or not a number.
            watch_end(Code::OutOfRange, RESUME_REVISION, "7"),
            watch_end(Code::ResourceExhausted, RESUME_REVISION, "soon"),
        ] {
            let code = status.code();
            let e = Error::from_status(status, Call::Watch("k"));
            assert!(
                matches!(e, Error::Status { code: c, .. } if c == StatusCode::of(code)),
                "{e:?}"
            );
        }
        // An oversized request, refused by the proxy's gRPC layer, is a bad argument.
        let e = Error::from_status(
            Status::out_of_range(
                "decoded message length too large: found 2097170 bytes, the limit is: 1101824 bytes",
            ),
            Call::Unbound,
        );
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("larger than the proxy accepts")),
            "{e:?}"
        );
        // The same codes from other calls mean nothing watch-specific.
        let e = Error::from_status(
            watch_end(Code::OutOfRange, COMPACT_REVISION, "7"),
            Call::Unbound,
        );
        assert!(matches!(e, Error::Status { .. }), "{e:?}");
        // The other codes map as for any call.
        let e = Error::from_status(Status::unavailable("stopping"), Call::Watch("k"));
        assert!(
            matches!(e, Error::Unavailable(ref m) if m == "stopping"),
            "{e:?}"
        );
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
