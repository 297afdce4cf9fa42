//! The audit store the cell is configured with: SQLite by default, ClickHouse when the
//! spec is an `http(s)://` URL. Both keep every event by (revision, seq) for queries.

use super::clickhouse::ClickHouseStore;
use super::sqlite::SqliteStore;
use super::{AuditError, AuditEvent};

/// How many days of events a store keeps unless configured otherwise.
pub const DEFAULT_KEEP_DAYS: u32 = 90;

/// The ClickHouse database when the URL names none.
pub const DEFAULT_DATABASE: &str = "lockcell";

/// The table (SQLite and ClickHouse) when the URL names none.
pub const DEFAULT_TABLE: &str = "audit_events";

const DAY_MS: i64 = 86_400_000;

/// The first millisecond a store keeps when it keeps `keep_days` days before the UTC day
/// of `now_ms` (and that day itself): midnight UTC `keep_days` days before today. Both
/// back ends expire by it, so SQLite deletes the rows of exactly the days ClickHouse
/// drops the partitions of.
pub fn cutoff_ms(keep_days: u32, now_ms: i64) -> i64 {
    (now_ms.div_euclid(DAY_MS) - i64::from(keep_days)) * DAY_MS
}

/// An audit store. Every write is atomic and skips events at or below the store's
/// checkpoint, so the tailer may replay from an older revision without duplicating.
#[derive(Debug, Clone)]
pub enum Store {
    Sqlite(SqliteStore),
    ClickHouse(ClickHouseStore),
}

impl Store {
    /// Opens the store `spec` names: `http://` or `https://` is ClickHouse's HTTP
    /// interface, with the database and table in the query
    /// (`http://127.0.0.1:8123/?database=lockcell&table=audit_events`, defaults
    /// [`DEFAULT_DATABASE`] and [`DEFAULT_TABLE`]); anything else is a SQLite file path.
    /// Creates what is missing (file, database, table).
    pub async fn open(spec: &str) -> Result<Store, AuditError> {
        let lower = spec.to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            let mut url = reqwest::Url::parse(spec).map_err(|e| AuditError::BadSpec {
                spec: redact(spec),
                reason: format!("not a URL: {e}"),
            })?;
            let mut database = DEFAULT_DATABASE.to_owned();
            let mut table = DEFAULT_TABLE.to_owned();
            let mut rest = Vec::new();
            for (key, value) in url.query_pairs() {
                match key.as_ref() {
                    "database" => database = value.into_owned(),
                    "table" => table = value.into_owned(),
                    _ => rest.push((key.into_owned(), value.into_owned())),
                }
            }
            // Other parameters (user, password, settings) go with every request.
            url.set_query(None);
            if !rest.is_empty() {
                url.query_pairs_mut().extend_pairs(rest);
            }
            let store = ClickHouseStore::open(url.as_str(), &database, &table).await?;
            Ok(Store::ClickHouse(store))
        } else if spec.is_empty() {
            Err(AuditError::BadSpec {
                spec: String::new(),
                reason: "empty; give a SQLite file path or a ClickHouse http(s):// URL".into(),
            })
        } else {
            Ok(Store::Sqlite(SqliteStore::open(spec).await?))
        }
    }

    /// The highest revision stored, 0 when empty: the tailer resumes after it.
    pub async fn checkpoint(&self) -> Result<i64, AuditError> {
        match self {
            Store::Sqlite(s) => s.checkpoint().await,
            Store::ClickHouse(s) => s.checkpoint().await,
        }
    }

    /// Stores `events` (sorted by (revision, seq), whole revisions) all or nothing,
    /// skipping those at or below the checkpoint.
    pub async fn write(&self, events: &[AuditEvent]) -> Result<(), AuditError> {
        match self {
            Store::Sqlite(s) => s.write(events).await,
            Store::ClickHouse(s) => s.write(events).await,
        }
    }

    /// The events of the lock or key `name` at or after `since_ms`, oldest first in
    /// (revision, seq) order, at most `limit`.
    pub async fn history(
        &self,
        name: &str,
        since_ms: Option<i64>,
        limit: usize,
    ) -> Result<Vec<AuditEvent>, AuditError> {
        match self {
            Store::Sqlite(s) => s.history(name, since_ms, limit).await,
            Store::ClickHouse(s) => s.history(name, since_ms, limit).await,
        }
    }

    /// Every event in (revision, seq) order (for comparing stores and rebuilding).
    pub async fn all(&self) -> Result<Vec<AuditEvent>, AuditError> {
        match self {
            Store::Sqlite(s) => s.all().await,
            Store::ClickHouse(s) => s.all().await,
        }
    }

    /// Removes the events of UTC days more than `keep_days` before the day of `now_ms`
    /// (see [`cutoff_ms`]); the newest revision stays, being the checkpoint. Returns
    /// what went: ROWS for SQLite, day PARTITIONS for ClickHouse.
    pub async fn expire(&self, keep_days: u32, now_ms: i64) -> Result<u64, AuditError> {
        match self {
            Store::Sqlite(s) => s.expire(keep_days, now_ms).await,
            Store::ClickHouse(s) => s.expire(keep_days, now_ms).await,
        }
    }

    /// Deletes every event (for `audit rebuild`), leaving the table in place.
    pub async fn clear(&self) -> Result<(), AuditError> {
        match self {
            Store::Sqlite(s) => s.clear().await,
            Store::ClickHouse(s) => s.clear().await,
        }
    }

    /// Where the store is, for logs: the file path, or the URL with database and
    /// table and without credentials.
    pub fn describe(&self) -> String {
        match self {
            Store::Sqlite(s) => s.describe(),
            Store::ClickHouse(s) => s.describe(),
        }
    }
}

/// `spec` without a password, for messages: user info and `password=` are cut.
pub(crate) fn redact(spec: &str) -> String {
    match reqwest::Url::parse(spec) {
        Ok(mut url) => {
            let _ = url.set_username("");
            let _ = url.set_password(None);
            let pairs: Vec<(String, String)> = url
                .query_pairs()
                .filter(|(k, _)| k != "password")
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            url.set_query(None);
            if !pairs.is_empty() {
                url.query_pairs_mut().extend_pairs(pairs);
            }
            url.to_string()
        }
        Err(_) => match spec.find('@') {
            Some(at) => format!("…{}", &spec[at..]),
            None => spec.to_owned(),
        },
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::audit::EventKind;

    pub(crate) const DAY_MS: i64 = super::DAY_MS;

    /// A granted event of `name` at (revision, seq) and `time_ms`.
    pub(crate) fn event(revision: i64, seq: u32, time_ms: i64, name: &str) -> AuditEvent {
        AuditEvent {
            revision,
            seq,
            time_ms,
            kind: EventKind::Granted,
            name: name.to_owned(),
            mode: "exclusive".into(),
            token: format!("1:{revision}"),
            session: "s1".into(),
            proxy: "p1".into(),
            zone: "a".into(),
            identity: "it's \"me\"\\".into(),
            lease: 7_000 + revision,
            detail: String::new(),
        }
    }

    #[test]
    fn cutoff_is_midnight_keep_days_before_today() {
        let now = 100 * DAY_MS + 5;
        assert_eq!(cutoff_ms(90, now), 10 * DAY_MS);
        assert_eq!(cutoff_ms(0, now), 100 * DAY_MS);
        assert_eq!(cutoff_ms(1, 0), -DAY_MS);
    }

    #[test]
    fn redact_drops_credentials() {
        assert_eq!(
            redact("http://bob:secret@ch:8123/?user=bob&password=secret&database=x"),
            "http://ch:8123/?user=bob&database=x"
        );
        assert_eq!(redact("/var/lib/audit.db"), "/var/lib/audit.db");
    }

    #[tokio::test]
    async fn a_path_opens_sqlite_and_an_empty_spec_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.db");
        let store = Store::open(path.to_str().unwrap()).await.unwrap();
        assert!(matches!(store, Store::Sqlite(_)));
        assert_eq!(store.describe(), path.display().to_string());
        store.write(&[event(4, 0, 1, "a")]).await.unwrap();
        assert_eq!(store.checkpoint().await.unwrap(), 4);
        let err = Store::open("").await.unwrap_err();
        assert!(err.to_string().contains("SQLite file path"), "{err}");
    }

    #[tokio::test]
    async fn a_url_names_clickhouse_and_an_unreachable_one_says_where() {
        // Nothing listens on port 9 of loopback: the error names the URL, not the
        // password.
        let err = Store::open("http://u:pw@127.0.0.1:9/?database=d&table=t")
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("http://127.0.0.1:9/"), "{text}");
        assert!(!text.contains("pw"), "{text}");
        assert!(err.is_retriable(), "{text}");
    }
}
