//! The default audit store: one SQLite file in the cell's data folder.
//!
//! SQLite calls block, so each runs on tokio's blocking pool holding the one
//! connection; the store is written by one tailer and read by occasional queries.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, OptionalExtension};

use super::store::cutoff_ms;
use super::{AuditError, AuditEvent, EventKind};

/// The table and its indexes. `WITHOUT ROWID` keeps rows in (revision, seq) order, the
/// order every reader wants; the name index serves `history`, the time index `expire`.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS audit_events (
    revision INTEGER NOT NULL,
    seq      INTEGER NOT NULL,
    time_ms  INTEGER NOT NULL,
    kind     TEXT    NOT NULL,
    name     TEXT    NOT NULL,
    mode     TEXT    NOT NULL,
    token    TEXT    NOT NULL,
    session  TEXT    NOT NULL,
    proxy    TEXT    NOT NULL,
    zone     TEXT    NOT NULL,
    identity TEXT    NOT NULL,
    lease    INTEGER NOT NULL,
    detail   TEXT    NOT NULL,
    PRIMARY KEY (revision, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS audit_events_name ON audit_events (name, revision);
CREATE INDEX IF NOT EXISTS audit_events_time ON audit_events (time_ms);
";

/// The columns in [`AuditEvent`] field order, for every SELECT.
const COLUMNS: &str =
    "revision, seq, time_ms, kind, name, mode, token, session, proxy, zone, identity, lease, detail";

/// An audit store in a SQLite file.
#[derive(Clone)]
pub struct SqliteStore {
    /// The file, for messages.
    path: PathBuf,
    /// The one connection; a blocking task holds the lock for one step.
    conn: Arc<Mutex<Connection>>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SqliteStore {
    /// Opens the store at `path`, creating its folder, the file and the schema if
    /// missing, in WAL mode (readers do not stop the tailer's writes).
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteStore, AuditError> {
        let path = path.as_ref().to_path_buf();
        let shown = path.display().to_string();
        let opened = path.clone();
        let conn = tokio::task::spawn_blocking(move || -> Result<Connection, AuditError> {
            if let Some(parent) = opened.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|source| AuditError::Io {
                    path: parent.display().to_string(),
                    op: "creating the store's folder",
                    source,
                })?;
            }
            let sqlite = |op| {
                let path = opened.display().to_string();
                move |source| AuditError::Sqlite { path, op, source }
            };
            let conn = Connection::open(&opened).map_err(sqlite("opening the file"))?;
            conn.busy_timeout(std::time::Duration::from_secs(5))
                .map_err(sqlite("setting the busy timeout"))?;
            let mode: String = conn
                .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
                .map_err(sqlite("switching to WAL mode"))?;
            if !mode.eq_ignore_ascii_case("wal") {
                tracing::warn!(store.path = %opened.display(), journal_mode = %mode, "SQLite audit store is not in WAL mode");
            }
            conn.execute_batch("PRAGMA synchronous = NORMAL;")
                .map_err(sqlite("setting synchronous"))?;
            conn.execute_batch(SCHEMA)
                .map_err(sqlite("creating the schema"))?;
            Ok(conn)
        })
        .await
        .map_err(|source| AuditError::Task {
            path: shown,
            op: "opening",
            source,
        })??;
        Ok(SqliteStore {
            path,
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    /// The file's path, for logs.
    pub fn describe(&self) -> String {
        self.path.display().to_string()
    }

    /// The highest revision stored, 0 when empty.
    pub async fn checkpoint(&self) -> Result<i64, AuditError> {
        self.run("reading the checkpoint", |conn| max_revision(conn))
            .await
    }

    /// Stores `events` in one transaction, skipping those at or below the checkpoint
    /// (a replay after a restart), so the store never holds an event twice.
    pub async fn write(&self, events: &[AuditEvent]) -> Result<(), AuditError> {
        if events.is_empty() {
            return Ok(());
        }
        let events = events.to_vec();
        self.run("writing events", move |conn| {
            let tx = conn.transaction()?;
            let checkpoint = max_revision(&tx)?;
            {
                let mut insert = tx.prepare_cached(
                    "INSERT INTO audit_events (revision, seq, time_ms, kind, name, mode, token, \
                     session, proxy, zone, identity, lease, detail) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
                )?;
                for e in events.iter().filter(|e| e.revision > checkpoint) {
                    insert.execute(params![
                        e.revision,
                        e.seq,
                        e.time_ms,
                        e.kind.as_str(),
                        e.name,
                        e.mode,
                        e.token,
                        e.session,
                        e.proxy,
                        e.zone,
                        e.identity,
                        e.lease,
                        e.detail,
                    ])?;
                }
            }
            tx.commit()
        })
        .await
    }

    /// The events of the lock or key `name` at or after `since_ms`, oldest first in
    /// (revision, seq) order, at most `limit` of them.
    pub async fn history(
        &self,
        name: &str,
        since_ms: Option<i64>,
        limit: usize,
    ) -> Result<Vec<AuditEvent>, AuditError> {
        let name = name.to_owned();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.run("reading a history", move |conn| {
            let mut select = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM audit_events \
                 WHERE name = ?1 AND time_ms >= ?2 ORDER BY revision, seq LIMIT ?3"
            ))?;
            let rows =
                select.query_map(params![name, since_ms.unwrap_or(i64::MIN), limit], event)?;
            rows.collect()
        })
        .await
    }

    /// Every event in (revision, seq) order.
    pub async fn all(&self) -> Result<Vec<AuditEvent>, AuditError> {
        self.run("reading all events", |conn| {
            let mut select = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM audit_events ORDER BY revision, seq"
            ))?;
            let rows = select.query_map([], event)?;
            rows.collect()
        })
        .await
    }

    /// Deletes the events of days (UTC) more than `keep_days` before the day of
    /// `now_ms`, the same days ClickHouse drops, and returns how many ROWS went. The
    /// newest revision stays whatever its age: it is the checkpoint.
    pub async fn expire(&self, keep_days: u32, now_ms: i64) -> Result<u64, AuditError> {
        let cutoff = cutoff_ms(keep_days, now_ms);
        self.run("expiring old events", move |conn| {
            let removed = conn.execute(
                "DELETE FROM audit_events WHERE time_ms < ?1 \
                 AND revision < (SELECT MAX(revision) FROM audit_events)",
                [cutoff],
            )?;
            Ok(removed as u64)
        })
        .await
    }

    /// Deletes every event (for `audit rebuild`).
    pub async fn clear(&self) -> Result<(), AuditError> {
        self.run("clearing the table", |conn| {
            conn.execute("DELETE FROM audit_events", []).map(|_| ())
        })
        .await
    }

    /// Runs `step` on the connection on the blocking pool; `op` names it in errors.
    async fn run<T, F>(&self, op: &'static str, step: F) -> Result<T, AuditError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        let path = self.describe();
        let shown = path.clone();
        tokio::task::spawn_blocking(move || {
            // A step that panicked poisons the lock, but the connection itself is fine:
            // SQLite rolled back the transaction it was in.
            let mut conn = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            step(&mut conn).map_err(|source| AuditError::Sqlite { path, op, source })
        })
        .await
        .map_err(|source| AuditError::Task {
            path: shown,
            op,
            source,
        })?
    }
}

/// The highest revision in the table, 0 when empty.
fn max_revision(conn: &Connection) -> rusqlite::Result<i64> {
    let max: Option<i64> = conn
        .query_row("SELECT MAX(revision) FROM audit_events", [], |row| {
            row.get(0)
        })
        .optional()?
        .flatten();
    Ok(max.unwrap_or(0))
}

/// One row, selected as [`COLUMNS`], as an event.
fn event(row: &rusqlite::Row<'_>) -> rusqlite::Result<AuditEvent> {
    let kind: String = row.get(3)?;
    let kind = EventKind::parse(&kind).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            3,
            rusqlite::types::Type::Text,
            format!("unknown event kind {kind:?}").into(),
        )
    })?;
    Ok(AuditEvent {
        revision: row.get(0)?,
        seq: row.get(1)?,
        time_ms: row.get(2)?,
        kind,
        name: row.get(4)?,
        mode: row.get(5)?,
        token: row.get(6)?,
        session: row.get(7)?,
        proxy: row.get(8)?,
        zone: row.get(9)?,
        identity: row.get(10)?,
        lease: row.get(11)?,
        detail: row.get(12)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::store::tests::{event, DAY_MS};

    async fn store() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("sub/audit.db"))
            .await
            .unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn open_creates_file_and_schema_once() {
        let (dir, store) = store().await;
        assert_eq!(store.checkpoint().await.unwrap(), 0);
        store.write(&[event(3, 0, 1_000, "a")]).await.unwrap();
        drop(store);
        let again = SqliteStore::open(dir.path().join("sub/audit.db"))
            .await
            .unwrap();
        assert_eq!(again.checkpoint().await.unwrap(), 3);
        let conn = again.conn.lock().unwrap();
        let mode: String = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
    }

    #[tokio::test]
    async fn a_replay_skips_what_is_stored_and_adds_the_rest() {
        let (_dir, store) = store().await;
        let first = [
            event(5, 0, 1_000, "a"),
            event(5, 1, 1_000, "b"),
            event(7, 0, 2_000, "a"),
        ];
        store.write(&first).await.unwrap();
        assert_eq!(store.checkpoint().await.unwrap(), 7);

        // The tailer restarts from a lower checkpoint and sends 5..9 again.
        let replay = [
            event(5, 0, 1_000, "a"),
            event(5, 1, 1_000, "b"),
            event(7, 0, 2_000, "a"),
            event(9, 0, 3_000, "a"),
            event(9, 1, 3_000, "c"),
        ];
        store.write(&replay).await.unwrap();
        assert_eq!(store.all().await.unwrap(), replay);
        assert_eq!(store.checkpoint().await.unwrap(), 9);
    }

    #[tokio::test]
    async fn a_failed_write_stores_nothing_of_its_batch() {
        let (_dir, store) = store().await;
        // The same (revision, seq) twice in one batch breaks the primary key.
        let bad = [
            event(2, 0, 1, "a"),
            event(3, 0, 1, "a"),
            event(3, 0, 1, "b"),
        ];
        let err = store.write(&bad).await.unwrap_err();
        assert!(err.to_string().contains("audit.db"), "{err}");
        assert!(store.all().await.unwrap().is_empty());
        assert_eq!(store.checkpoint().await.unwrap(), 0);
    }

    #[tokio::test]
    async fn history_is_one_names_events_in_order_from_a_time() {
        let (_dir, store) = store().await;
        let events = [
            event(1, 0, 100, "a"),
            event(2, 0, 200, "b"),
            event(3, 0, 300, "a"),
            event(3, 1, 300, "a"),
            event(4, 0, 400, "a"),
        ];
        store.write(&events).await.unwrap();
        let all_a = store.history("a", None, 100).await.unwrap();
        let revs: Vec<_> = all_a.iter().map(|e| (e.revision, e.seq)).collect();
        assert_eq!(revs, [(1, 0), (3, 0), (3, 1), (4, 0)]);
        let since = store.history("a", Some(300), 2).await.unwrap();
        let revs: Vec<_> = since.iter().map(|e| (e.revision, e.seq)).collect();
        assert_eq!(revs, [(3, 0), (3, 1)]);
        assert!(store.history("zz", None, 10).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn expire_deletes_whole_old_days_and_clear_empties() {
        let (_dir, store) = store().await;
        let now = 100 * DAY_MS + 12 * 3_600_000;
        let events = [
            event(1, 0, 9 * DAY_MS, "a"),      // day 9: 91 days before day 100
            event(2, 0, 10 * DAY_MS + 5, "a"), // day 10: exactly 90 days before
            event(3, 0, 100 * DAY_MS, "a"),    // today
        ];
        store.write(&events).await.unwrap();
        assert_eq!(store.expire(90, now).await.unwrap(), 1);
        let left: Vec<_> = store
            .all()
            .await
            .unwrap()
            .iter()
            .map(|e| e.revision)
            .collect();
        assert_eq!(left, [2, 3]);
        assert_eq!(store.expire(90, now).await.unwrap(), 0);

        store.clear().await.unwrap();
        assert!(store.all().await.unwrap().is_empty());
        assert_eq!(store.checkpoint().await.unwrap(), 0);
    }
}
