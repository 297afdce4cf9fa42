//! The audit trail: what happened to every lock, leader and key, as evidence.
//!
//! The tailer ([`tailer`]) follows the whole key space with a read-only watch that
//! carries previous values and turns each change into [`AuditEvent`]s. Events go to
//! sinks: the audit store (SQLite in the cell's data folder by default, ClickHouse when
//! configured) and the archive (compressed JSON-lines segments in object storage).
//!
//! Every sink writes whole revisions at a time and knows the highest revision it holds
//! (its checkpoint), so a tailer that restarts from the lowest checkpoint of its sinks
//! neither loses nor duplicates an event: each sink skips what it already has.

use serde::{Deserialize, Serialize};

pub mod archive;
pub mod clickhouse;
pub mod error;
pub mod sqlite;
pub mod store;
pub mod tailer;

pub use error::AuditError;

/// What happened. Stored as its snake_case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A lock was granted: a new holder key (its create revision is the token).
    Granted,
    /// A holder let go: its key was deleted together with the lock's release marker.
    Released,
    /// A holder's key went without a release: its session expired or its proxy's lease
    /// ended.
    Expired,
    /// A holder's key moved to another proxy's lease (a session moved); same token.
    Moved,
    /// An election has a new leader, or its leader proclaimed a new value.
    LeaderChanged,
    /// A fair-class waiter took its place in line.
    Waiting,
    /// A small key was written (`detail` carries the value, cut to 256 bytes).
    KeyWritten,
    /// A small key was deleted, or an ephemeral key went with its session.
    KeyDeleted,
    /// A cell record under `/sys` (epoch, shard map) was written or deleted.
    ConfigChanged,
    /// An operator forced a hold off (`lockcell-cell force-release`): `identity` is
    /// the operator, `session` and `token` the hold's, `detail` the reason and the
    /// holder's identity. The hold's own `expired` event follows once its holder's
    /// validity has run out.
    ForceReleased,
    /// The tailer could not read some revisions (etcd had compacted them away);
    /// `detail` names the range.
    Gap,
}

impl EventKind {
    pub const ALL: [EventKind; 11] = [
        EventKind::Granted,
        EventKind::Released,
        EventKind::Expired,
        EventKind::Moved,
        EventKind::LeaderChanged,
        EventKind::Waiting,
        EventKind::KeyWritten,
        EventKind::KeyDeleted,
        EventKind::ConfigChanged,
        EventKind::ForceReleased,
        EventKind::Gap,
    ];

    /// The stored name, e.g. `leader_changed`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Granted => "granted",
            EventKind::Released => "released",
            EventKind::Expired => "expired",
            EventKind::Moved => "moved",
            EventKind::LeaderChanged => "leader_changed",
            EventKind::Waiting => "waiting",
            EventKind::KeyWritten => "key_written",
            EventKind::KeyDeleted => "key_deleted",
            EventKind::ConfigChanged => "config_changed",
            EventKind::ForceReleased => "force_released",
            EventKind::Gap => "gap",
        }
    }

    /// The kind named `name` (as stored).
    pub fn parse(name: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One audit event. `(revision, seq)` names it uniquely: `revision` is the etcd
/// revision of the change, `seq` its place among the events of that revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEvent {
    pub revision: i64,
    pub seq: u32,
    /// Milliseconds since the Unix epoch: the grant's own time for grants and leader
    /// changes, the writer's for small-key writes, otherwise when the tailer saw the
    /// change (etcd keeps no times).
    pub time_ms: i64,
    pub kind: EventKind,
    /// The lock or election name, the small key's name, or the `/sys` key.
    pub name: String,
    /// `exclusive` or `shared` for lock events, empty otherwise.
    #[serde(default)]
    pub mode: String,
    /// The fencing token `EPOCH:REVISION` of the grant the event is about, empty when
    /// none.
    #[serde(default)]
    pub token: String,
    #[serde(default)]
    pub session: String,
    #[serde(default)]
    pub proxy: String,
    #[serde(default)]
    pub zone: String,
    #[serde(default)]
    pub identity: String,
    /// The etcd lease the key is on (0 for none).
    #[serde(default)]
    pub lease: i64,
    /// Kind-specific: a leader's or small key's value (cut), a gap's range.
    #[serde(default)]
    pub detail: String,
}

impl AuditEvent {
    /// An event of `kind` about `name` at `time_ms`, every other field empty (the
    /// tailer sets revision and seq when it places the event).
    pub fn new(kind: EventKind, name: String, time_ms: i64) -> AuditEvent {
        AuditEvent {
            revision: 0,
            seq: 0,
            time_ms,
            kind,
            name,
            mode: String::new(),
            token: String::new(),
            session: String::new(),
            proxy: String::new(),
            zone: String::new(),
            identity: String::new(),
            lease: 0,
            detail: String::new(),
        }
    }

    /// The event's date (UTC) as `YYYY-MM-DD`, for day partitions and archive paths.
    pub fn day(&self) -> String {
        day_of(self.time_ms)
    }
}

/// `YYYY-MM-DD` (UTC) of a time in milliseconds since the Unix epoch.
pub fn day_of(time_ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(time_ms)
        .unwrap_or_default()
        .format("%Y-%m-%d")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_are_utc_calendar_dates() {
        assert_eq!(day_of(0), "1970-01-01");
        assert_eq!(day_of(86_400_000 - 1), "1970-01-01");
        assert_eq!(day_of(951_782_400_000), "2000-02-29");
        assert_eq!(day_of(1_795_910_400_000), "2026-11-29");
    }

    #[test]
    fn kinds_round_trip_by_name() {
        for kind in EventKind::ALL {
            assert_eq!(EventKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(EventKind::parse("granted2"), None);
    }
}
