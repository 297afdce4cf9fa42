//! Errors of the audit sinks: the stores (SQLite, ClickHouse) and the archive.

/// What can go wrong when writing or reading audit events.
///
/// Every message names the store (file, URL or bucket) and the step that failed, so a
/// log line alone says where to look. [`AuditError::is_retriable`] separates a sink that
/// is briefly away (the tailer keeps its place and tries again) from one that is set up
/// wrong or holds data it cannot read.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// A store or archive spec (path, URL, `s3://` location) cannot be used.
    #[error("bad audit sink {spec:?}: {reason}")]
    BadSpec { spec: String, reason: String },

    /// SQLite refused or failed a step.
    #[error("SQLite audit store {path}: {op} failed: {source}")]
    Sqlite {
        path: String,
        op: &'static str,
        #[source]
        source: rusqlite::Error,
    },

    /// A file or folder the store needs could not be created or read.
    #[error("audit store {path}: {op} failed: {source}")]
    Io {
        path: String,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// ClickHouse could not be reached, or the connection broke.
    #[error("ClickHouse audit store {url}: {op}: request failed: {source}")]
    ClickHouseRequest {
        url: String,
        op: &'static str,
        #[source]
        source: reqwest::Error,
    },

    /// ClickHouse answered with an error (its own message follows).
    #[error("ClickHouse audit store {url}: {op}: ClickHouse answered {status}: {message}")]
    ClickHouse {
        url: String,
        op: &'static str,
        status: u16,
        /// ClickHouse's error code (`Code: 252` in its message), when it gave one.
        code: Option<u32>,
        message: String,
    },

    /// ClickHouse answered with something that is not what was asked for.
    #[error("ClickHouse audit store {url}: {op}: unreadable answer: {reason}")]
    ClickHouseAnswer {
        url: String,
        op: &'static str,
        reason: String,
    },

    /// The object store behind the archive failed a step.
    #[error("audit archive {location}: {op} failed: {source}")]
    ObjectStore {
        location: String,
        op: &'static str,
        #[source]
        source: object_store::Error,
    },

    /// An archive segment could not be read back (not gzip, not JSON lines, bad name).
    #[error("audit archive {location}: segment {path} is not readable: {reason}")]
    BadSegment {
        location: String,
        path: String,
        reason: String,
    },

    /// The blocking task running a SQLite step panicked or was cancelled.
    #[error("SQLite audit store {path}: {op}: the worker task failed: {source}")]
    Task {
        path: String,
        op: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
}

/// ClickHouse error codes that pass by themselves: timeouts (159, 209), network (210),
/// memory (241), too many queries or parts (202, 252), a table being dropped or altered
/// (473), a query with the same id still running (216: a retried insert).
const CLICKHOUSE_TRANSIENT: [u32; 8] = [159, 202, 209, 210, 241, 252, 473, 216];

impl AuditError {
    /// True when the same call may succeed later: the server or object store was away,
    /// slow or busy. False for a bad spec, unreadable data or a refused statement.
    pub fn is_retriable(&self) -> bool {
        match self {
            AuditError::ClickHouseRequest { .. } | AuditError::ObjectStore { .. } => true,
            // ClickHouse answers 500 for bad queries too, so its code decides.
            AuditError::ClickHouse { status, code, .. } => {
                *status == 503 || code.is_some_and(|c| CLICKHOUSE_TRANSIENT.contains(&c))
            }
            AuditError::Sqlite { source, .. } => matches!(
                source.sqlite_error_code(),
                Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
            ),
            AuditError::Io { .. } => true,
            AuditError::BadSpec { .. }
            | AuditError::ClickHouseAnswer { .. }
            | AuditError::BadSegment { .. }
            | AuditError::Task { .. } => false,
        }
    }
}
