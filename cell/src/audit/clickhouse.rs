//! The audit store on ClickHouse, over its HTTP interface, for cells whose trail
//! outgrows one file or is queried by other tools.
//!
//! Written for ClickHouse 18.16 (what Debian bookworm ships) and later: plain
//! `MergeTree` partitioned by UTC day, rows in and out as `JSONEachRow`, no query
//! parameters (18.16 has none, so the one string a query takes is escaped here) and no
//! TTL clause (18.16 has none either, so [`ClickHouseStore::expire`] drops old day
//! partitions itself).

use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDate;
use reqwest::Url;
use serde::{Deserialize, Serialize};

use super::store::{cutoff_ms, redact};
use super::{day_of, AuditError, AuditEvent};

/// How long connecting may take before the store counts as away.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one statement may take (a large batch insert included).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// ClickHouse's default `max_insert_block_size`: an insert of more rows than this is
/// split into several blocks unless the setting is raised for it.
const DEFAULT_INSERT_BLOCK: usize = 1_048_576;

/// The columns in [`AuditEvent`] field order, for every SELECT.
const COLUMNS: &str =
    "revision, seq, time_ms, kind, name, mode, token, session, proxy, zone, identity, lease, detail";

/// An audit store in a ClickHouse table. Clones share one HTTP client.
#[derive(Clone)]
pub struct ClickHouseStore {
    inner: Arc<Inner>,
}

/// Shows where the store is, never its credentials.
impl std::fmt::Debug for ClickHouseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClickHouseStore")
            .field("url", &self.inner.shown)
            .finish()
    }
}

struct Inner {
    client: reqwest::Client,
    /// The server's URL with the parameters every request carries (user, password,
    /// settings), credentials moved out of it into `auth`.
    url: Url,
    /// Basic-auth user and password from the URL's user info, if any.
    auth: Option<(String, Option<String>)>,
    /// `` `database`.`table` `` as statements name it.
    table: String,
    /// The URL without credentials, with database and table, for messages and logs.
    shown: String,
    database: String,
    table_name: String,
}

/// One row as inserted: the event and the day partition it lands in.
#[derive(Serialize)]
struct Row<'a> {
    date: String,
    #[serde(flatten)]
    event: &'a AuditEvent,
}

impl ClickHouseStore {
    /// Connects to the ClickHouse HTTP interface at `url` (user info and parameters
    /// such as `user`/`password` are kept for every request) and creates `database` and
    /// `table` if missing. Names must be plain identifiers (letters, digits, `_`).
    pub async fn open(url: &str, database: &str, table: &str) -> Result<Self, AuditError> {
        let bad = |reason: String| AuditError::BadSpec {
            spec: redact(url),
            reason,
        };
        for (what, name) in [("database", database), ("table", table)] {
            if !is_identifier(name) {
                return Err(bad(format!(
                    "{what} name {name:?} is not a plain identifier (letters, digits and _, \
                     not starting with a digit)"
                )));
            }
        }
        let mut parsed = Url::parse(url).map_err(|e| bad(format!("not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(bad("ClickHouse is reached over http:// or https://".into()));
        }
        let auth = (!parsed.username().is_empty()).then(|| {
            (
                percent_decode(parsed.username()),
                parsed.password().map(percent_decode),
            )
        });
        let _ = parsed.set_username("");
        let _ = parsed.set_password(None);

        let mut shown = Url::parse(&redact(url)).map_err(|e| bad(format!("not a URL: {e}")))?;
        shown
            .query_pairs_mut()
            .append_pair("database", database)
            .append_pair("table", table);
        let shown = shown.to_string();

        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|source| AuditError::ClickHouseRequest {
                url: shown.clone(),
                op: "building the HTTP client",
                source,
            })?;
        let store = ClickHouseStore {
            inner: Arc::new(Inner {
                client,
                url: parsed,
                auth,
                table: format!("`{database}`.`{table}`"),
                shown,
                database: database.to_owned(),
                table_name: table.to_owned(),
            }),
        };
        store
            .execute(
                "creating the database",
                format!("CREATE DATABASE IF NOT EXISTS `{database}`"),
            )
            .await?;
        store
            .execute(
                "creating the table",
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (\
                     date Date, revision Int64, seq UInt32, time_ms Int64, kind String, \
                     name String, mode String, token String, session String, proxy String, \
                     zone String, identity String, lease Int64, detail String\
                     ) ENGINE = MergeTree() PARTITION BY date ORDER BY (revision, seq)",
                    store.inner.table
                ),
            )
            .await?;
        Ok(store)
    }

    /// The URL without credentials, with database and table, for logs.
    pub fn describe(&self) -> String {
        self.inner.shown.clone()
    }

    /// The highest revision stored, 0 when empty.
    pub async fn checkpoint(&self) -> Result<i64, AuditError> {
        #[derive(Deserialize)]
        struct Max {
            r: i64,
        }
        let op = "reading the checkpoint";
        let rows: Vec<Max> = self
            .select(
                op,
                format!("SELECT max(revision) AS r FROM {}", self.inner.table),
            )
            .await?;
        match rows.as_slice() {
            [max] => Ok(max.r),
            _ => Err(self.answer(op, format!("{} rows for one max()", rows.len()))),
        }
    }

    /// Inserts `events` above the checkpoint in one request and one block: ClickHouse
    /// takes a block whole or not at all. The whole batch is filed under the day of its
    /// first event (a batch spanning midnight would otherwise be one part per day, each
    /// committed on its own), so retention is by day to within one batch. The insert's
    /// query id names the batch: a retry sent while a slow first try still runs is
    /// refused by ClickHouse (and retried once it is done, then skipped by the
    /// checkpoint) instead of inserting the rows twice.
    pub async fn write(&self, events: &[AuditEvent]) -> Result<(), AuditError> {
        if events.is_empty() {
            return Ok(());
        }
        let checkpoint = self.checkpoint().await?;
        let fresh: Vec<&AuditEvent> = events.iter().filter(|e| e.revision > checkpoint).collect();
        let (Some(first), Some(last)) = (fresh.first(), fresh.last()) else {
            return Ok(());
        };
        let date = day_of(first.time_ms);
        let query_id = format!(
            "lockcell-audit-{}-{}-{}-{}",
            first.revision, first.seq, last.revision, last.seq
        );
        let mut body = Vec::new();
        let mut rows = 0;
        for event in fresh {
            let row = Row {
                date: date.clone(),
                event,
            };
            serde_json::to_writer(&mut body, &row)
                .map_err(|e| self.answer("encoding events", e.to_string()))?;
            body.push(b'\n');
            rows += 1;
        }
        if rows == 0 {
            return Ok(());
        }
        let mut url = self.inner.url.clone();
        url.query_pairs_mut()
            .append_pair(
                "query",
                &format!("INSERT INTO {} FORMAT JSONEachRow", self.inner.table),
            )
            .append_pair(
                "max_insert_block_size",
                &rows.max(DEFAULT_INSERT_BLOCK).to_string(),
            )
            .append_pair("query_id", &query_id);
        self.send("writing events", url, body).await.map(drop)
    }

    /// The events of the lock or key `name` at or after `since_ms`, oldest first in
    /// (revision, seq) order, at most `limit`.
    pub async fn history(
        &self,
        name: &str,
        since_ms: Option<i64>,
        limit: usize,
    ) -> Result<Vec<AuditEvent>, AuditError> {
        let since = since_ms
            .map(|ms| format!(" AND time_ms >= {ms}"))
            .unwrap_or_default();
        self.select(
            "reading a history",
            format!(
                "SELECT {COLUMNS} FROM {} WHERE name = {}{since} ORDER BY revision, seq LIMIT {limit}",
                self.inner.table,
                literal(name)
            ),
        )
        .await
    }

    /// Every event in (revision, seq) order.
    pub async fn all(&self) -> Result<Vec<AuditEvent>, AuditError> {
        self.select(
            "reading all events",
            format!(
                "SELECT {COLUMNS} FROM {} ORDER BY revision, seq",
                self.inner.table
            ),
        )
        .await
    }

    /// Drops the day partitions more than `keep_days` before the UTC day of `now_ms`,
    /// except the one holding the newest revision (the checkpoint), and returns how
    /// many PARTITIONS went.
    pub async fn expire(&self, keep_days: u32, now_ms: i64) -> Result<u64, AuditError> {
        #[derive(Deserialize)]
        struct Part {
            partition: String,
        }
        #[derive(Deserialize)]
        struct Newest {
            date: String,
        }
        let cutoff = chrono::DateTime::from_timestamp_millis(cutoff_ms(keep_days, now_ms))
            .unwrap_or_default()
            .date_naive();
        let newest: Vec<Newest> = self
            .select(
                "finding the newest day",
                format!(
                    "SELECT toString(date) AS date FROM {} ORDER BY revision DESC, seq DESC LIMIT 1",
                    self.inner.table
                ),
            )
            .await?;
        let parts: Vec<Part> = self
            .select(
                "listing partitions",
                format!(
                    "SELECT DISTINCT partition FROM system.parts \
                     WHERE database = {} AND table = {} AND active",
                    literal(&self.inner.database),
                    literal(&self.inner.table_name)
                ),
            )
            .await?;
        let mut dropped = 0;
        for part in parts {
            // A Date partition key shows as `YYYY-MM-DD`, possibly quoted.
            let day = part.partition.trim_matches('\'');
            let Ok(date) = NaiveDate::parse_from_str(day, "%Y-%m-%d") else {
                tracing::warn!(store = %self.inner.shown, partition = %part.partition, "partition is not a day; left alone");
                continue;
            };
            if date >= cutoff || newest.iter().any(|n| n.date == day) {
                continue;
            }
            self.execute(
                "dropping an old partition",
                format!(
                    "ALTER TABLE {} DROP PARTITION {}",
                    self.inner.table,
                    literal(day)
                ),
            )
            .await?;
            dropped += 1;
        }
        Ok(dropped)
    }

    /// Deletes every event (for `audit rebuild`), leaving the table in place.
    pub async fn clear(&self) -> Result<(), AuditError> {
        self.execute(
            "clearing the table",
            format!("TRUNCATE TABLE {}", self.inner.table),
        )
        .await
    }

    /// Runs a statement that returns nothing.
    async fn execute(&self, op: &'static str, sql: String) -> Result<(), AuditError> {
        self.send(op, self.inner.url.clone(), sql.into_bytes())
            .await
            .map(drop)
    }

    /// Runs a SELECT and reads its rows as `JSONEachRow`, 64-bit numbers unquoted.
    async fn select<T: serde::de::DeserializeOwned>(
        &self,
        op: &'static str,
        sql: String,
    ) -> Result<Vec<T>, AuditError> {
        let mut url = self.inner.url.clone();
        url.query_pairs_mut()
            .append_pair("output_format_json_quote_64bit_integers", "0");
        let body = self
            .send(op, url, format!("{sql} FORMAT JSONEachRow").into_bytes())
            .await?;
        body.lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                serde_json::from_str(line).map_err(|e| self.answer(op, format!("{e} in {line:?}")))
            })
            .collect()
    }

    /// POSTs `body` to `url` and returns the answer, or ClickHouse's error.
    async fn send(&self, op: &'static str, url: Url, body: Vec<u8>) -> Result<String, AuditError> {
        let mut request = self.inner.client.post(url).body(body);
        if let Some((user, password)) = &self.inner.auth {
            request = request.basic_auth(user, password.as_ref());
        }
        let request_failed = |source| AuditError::ClickHouseRequest {
            url: self.inner.shown.clone(),
            op,
            source,
        };
        let response = request.send().await.map_err(request_failed)?;
        let status = response.status();
        let text = response.text().await.map_err(request_failed)?;
        if status.is_success() {
            return Ok(text);
        }
        let message: String = text.trim().chars().take(2_000).collect();
        Err(AuditError::ClickHouse {
            url: self.inner.shown.clone(),
            op,
            status: status.as_u16(),
            code: error_code(&message),
            message,
        })
    }

    fn answer(&self, op: &'static str, reason: String) -> AuditError {
        AuditError::ClickHouseAnswer {
            url: self.inner.shown.clone(),
            op,
            reason,
        }
    }
}

/// True for a name ClickHouse takes unquoted, so it can go into statements as is.
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `text` as a ClickHouse string literal: quoted, with `\` and `'` escaped.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// The number in ClickHouse's `Code: 60, e.displayText() = ...`.
fn error_code(message: &str) -> Option<u32> {
    let rest = message.split("Code: ").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// A URL's percent-encoded user or password as written by the operator.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::store::tests::event;

    #[test]
    fn literals_escape_quotes_and_backslashes() {
        assert_eq!(literal("plain"), "'plain'");
        assert_eq!(literal(r"a'b\c"), r"'a\'b\\c'");
    }

    #[test]
    fn only_plain_identifiers_pass() {
        assert!(is_identifier("audit_events"));
        assert!(is_identifier("_x1"));
        assert!(!is_identifier("1x"));
        assert!(!is_identifier("a.b"));
        assert!(!is_identifier("a`b"));
        assert!(!is_identifier(""));
    }

    #[test]
    fn error_codes_are_read_from_messages() {
        let message = "Code: 60, e.displayText() = DB::Exception: Table x doesn't exist.";
        assert_eq!(error_code(message), Some(60));
        assert_eq!(error_code("Bad gateway"), None);
    }

    #[test]
    fn user_info_is_decoded() {
        assert_eq!(percent_decode("p%40ss%2Fw"), "p@ss/w");
        assert_eq!(percent_decode("100%"), "100%");
    }

    #[test]
    fn rows_carry_their_day_and_every_field() {
        let e = event(12, 3, 951_782_400_000, "x");
        let row = serde_json::to_value(Row {
            date: day_of(e.time_ms),
            event: &e,
        })
        .unwrap();
        assert_eq!(row["date"], "2000-02-29");
        assert_eq!(row["revision"], 12);
        assert_eq!(row["kind"], "granted");
        assert_eq!(row["identity"], "it's \"me\"\\");
    }

    #[tokio::test]
    async fn bad_names_are_refused_before_connecting() {
        let err = ClickHouseStore::open("http://127.0.0.1:9/", "lockcell", "a;drop")
            .await
            .unwrap_err();
        assert!(err.to_string().contains("\"a;drop\""), "{err}");
        assert!(!err.is_retriable());
    }
}
