//! The small-key checks of fault runs: every acknowledged write, read and watch a client
//! recorded, compared with the store's history of the small keys as the run's own watch
//! on etcd saw it.
//!
//! - an acknowledged write is in the history: the key had that value at that revision;
//! - a linearizable read shows, for every key under its prefix, no value older than a
//!   write acknowledged before the read was sent, and only values the key really had;
//! - a watch delivers, from the revision it (re)started at through the last revision it
//!   reported, exactly the changes the history has under its prefix: none missed,
//!   doubled, reordered or made up;
//! - an ephemeral key stays while the session that wrote it last is valid: no delete of
//!   it arrives before the deadline that session's write left, unless its client
//!   closed the session meanwhile.

use std::collections::{BTreeMap, HashMap};

use crate::checker::Record;

/// A change of a small key (its name without the `/k/` root) as the run's watch on the
/// store delivered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// When the watch delivered it (the machine's monotonic clock): at or after the
    /// change, never before.
    pub at_ns: u64,
    pub revision: i64,
    pub key: String,
    /// The value put; `None` for a delete.
    pub value: Option<String>,
}

/// What the checks compare the records with.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// Every change of a small key from `from` on, in the store's order.
    pub events: Vec<KvEvent>,
    /// The first revision the history covers.
    pub from: i64,
}

impl History {
    /// The value `key` had at `revision`, if the history covers it: `Some(None)` absent.
    fn value_at(&self, key: &str, revision: i64) -> Option<Option<&str>> {
        if revision < self.from {
            return None;
        }
        let mut value = None;
        let mut seen = false;
        for e in self.events.iter().filter(|e| e.key == key) {
            if e.revision > revision {
                break;
            }
            seen = true;
            value = e.value.as_deref();
        }
        // A key the history never touched before `revision` had its value from before
        // the history began: unknown.
        seen.then_some(value)
    }

    /// The changes under `prefix` with revisions in `from..=through`, as watches
    /// report them.
    fn changes(&self, prefix: &str, from: i64, through: i64) -> Vec<(i64, String, bool)> {
        self.events
            .iter()
            .filter(|e| e.revision >= from && e.revision <= through && e.key.starts_with(prefix))
            .map(|e| (e.revision, e.key.clone(), e.value.is_some()))
            .collect()
    }
}

/// What the checks looked at.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    pub writes: usize,
    pub reads: usize,
    /// Events delivered by watches and compared with the history.
    pub watched: usize,
}

/// Runs every check over `records` (all clients') against `history`; appends what it
/// finds to `violations`.
pub fn check(records: &[Record], history: &History, violations: &mut Vec<String>) -> Checked {
    let mut checked = Checked::default();
    check_writes(records, history, violations, &mut checked);
    check_reads(records, history, violations, &mut checked);
    check_watches(records, history, violations, &mut checked);
    check_ephemeral(records, history, violations);
    checked
}

fn check_writes(
    records: &[Record],
    history: &History,
    violations: &mut Vec<String>,
    checked: &mut Checked,
) {
    for record in records {
        let Record::KvWrite {
            key,
            value,
            revision,
            ..
        } = record
        else {
            continue;
        };
        let found = history
            .events
            .iter()
            .find(|e| e.revision == *revision && e.key == *key);
        if *revision < history.from {
            continue;
        }
        checked.writes += 1;
        if found.and_then(|e| e.value.as_deref()) != Some(value.as_str()) {
            violations.push(format!(
                "the acknowledged write of {value:?} to {key} at revision {revision} is not in the store's history"
            ));
        }
    }
}

fn check_reads(
    records: &[Record],
    history: &History,
    violations: &mut Vec<String>,
    checked: &mut Checked,
) {
    // The persistent writes acknowledged, by key: (acknowledged at, revision).
    let mut acked: HashMap<&str, Vec<(u64, i64)>> = HashMap::new();
    for record in records {
        if let Record::KvWrite {
            key,
            revision,
            acked_ns,
            deadline_ns: 0,
            ..
        } = record
        {
            if *acked_ns > 0 {
                acked.entry(key).or_default().push((*acked_ns, *revision));
            }
        }
    }
    for record in records {
        let Record::Read {
            client,
            prefix,
            began_ns,
            entries,
        } = record
        else {
            continue;
        };
        checked.reads += 1;
        let found: HashMap<&str, (i64, &str)> = entries
            .iter()
            .map(|(k, r, v)| (k.as_str(), (*r, v.as_str())))
            .collect();
        for (key, writes) in acked.iter().filter(|(k, _)| k.starts_with(prefix.as_str())) {
            let Some(newest) = writes
                .iter()
                .filter(|(at, _)| at < began_ns)
                .map(|(_, r)| *r)
                .max()
            else {
                continue;
            };
            match found.get(key) {
                Some((revision, _)) if *revision >= newest => {}
                seen => violations.push(format!(
                    "{client}'s read of {prefix} at {began_ns} ns saw {key} at {:?}, older than its write at revision {newest}, acknowledged before the read was sent",
                    seen.map(|(r, _)| *r)
                )),
            }
        }
        for (key, (revision, value)) in &found {
            match history.value_at(key, *revision) {
                Some(Some(had)) if had == *value => {}
                None => {}
                had => violations.push(format!(
                    "{client}'s read of {prefix} at {began_ns} ns saw {key} = {value:?} at revision {revision}, which the store's history has as {had:?}"
                )),
            }
        }
    }
}

fn check_watches(
    records: &[Record],
    history: &History,
    violations: &mut Vec<String>,
    checked: &mut Checked,
) {
    // Each client's watch, segment by segment: (prefix, from, last through, delivered).
    type Segment = (String, i64, i64, Vec<(i64, String, bool)>);
    let mut segments: BTreeMap<&str, Vec<Segment>> = BTreeMap::new();
    for record in records {
        match record {
            Record::WatchFrom {
                client,
                prefix,
                from,
            } => segments.entry(client).or_default().push((
                prefix.clone(),
                *from,
                from - 1,
                Vec::new(),
            )),
            Record::Watched {
                client,
                through,
                events,
            } => {
                let Some(segment) = segments.get_mut(client.as_str()).and_then(|s| s.last_mut())
                else {
                    violations.push(format!("{client} recorded a watch batch before any watch"));
                    continue;
                };
                if *through < segment.2 {
                    violations.push(format!(
                        "{client}'s watch of {} went back from revision {} to {through}",
                        segment.0, segment.2
                    ));
                }
                segment.2 = segment.2.max(*through);
                segment.3.extend(events.iter().cloned());
            }
            _ => {}
        }
    }
    for (client, segments) in segments {
        for (prefix, from, through, delivered) in segments {
            // Only what the history covers is compared.
            let start = from.max(history.from);
            let mut got: Vec<(i64, String, bool)> =
                delivered.into_iter().filter(|e| e.0 >= start).collect();
            if let Some(w) = got.windows(2).find(|w| w[1].0 < w[0].0) {
                violations.push(format!(
                    "{client}'s watch of {prefix} from {from} delivered revision {} after {}",
                    w[1].0, w[0].0
                ));
            }
            if got.iter().any(|e| e.0 > through) {
                violations.push(format!(
                    "{client}'s watch of {prefix} from {from} delivered an event past the revision it reported ({through})"
                ));
            }
            let mut want = history.changes(&prefix, start, through);
            checked.watched += got.len();
            // Within one revision the order of keys is not compared.
            got.sort();
            want.sort();
            if got != want {
                let missed: Vec<_> = want.iter().filter(|e| !got.contains(e)).take(3).collect();
                let extra: Vec<_> = got.iter().filter(|e| !want.contains(e)).take(3).collect();
                violations.push(format!(
                    "{client}'s watch of {prefix} from {from} through {through}: {} events, the store had {}; missed {missed:?}, not in the store or doubled {extra:?}",
                    got.len(),
                    want.len()
                ));
            }
        }
    }
}

fn check_ephemeral(records: &[Record], history: &History, violations: &mut Vec<String>) {
    // Ephemeral writes acknowledged, by (key, revision): (client, acknowledged, deadline).
    let mut ephemeral: HashMap<(&str, i64), (&str, u64, u64)> = HashMap::new();
    // When each client closed a session.
    let mut closed: HashMap<&str, Vec<u64>> = HashMap::new();
    for record in records {
        match record {
            Record::KvWrite {
                client,
                key,
                revision,
                acked_ns,
                deadline_ns,
                ..
            } if *deadline_ns > 0 => {
                ephemeral.insert((key, *revision), (client, *acked_ns, *deadline_ns));
            }
            Record::Closed { client, at_ns } => closed.entry(client).or_default().push(*at_ns),
            _ => {}
        }
    }
    // The last put of each key so far, as the history goes.
    let mut last_put: HashMap<&str, i64> = HashMap::new();
    for e in &history.events {
        if e.value.is_some() {
            last_put.insert(&e.key, e.revision);
            continue;
        }
        let Some(put) = last_put.remove(e.key.as_str()) else {
            continue;
        };
        if let Some((client, acked, deadline)) = ephemeral.get(&(e.key.as_str(), put)) {
            let closed_since = closed
                .get(client)
                .is_some_and(|at| at.iter().any(|at| at >= acked && *at <= e.at_ns));
            if e.at_ns < *deadline && !closed_since {
                violations.push(format!(
                    "{}: the ephemeral key {client} wrote at revision {put} was deleted at revision {} ({} ms before its session's deadline)",
                    e.key,
                    e.revision,
                    (deadline - e.at_ns) / 1_000_000
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(revision: i64, key: &str, value: &str, at_ns: u64) -> KvEvent {
        KvEvent {
            at_ns,
            revision,
            key: key.into(),
            value: Some(value.into()),
        }
    }

    fn delete(revision: i64, key: &str, at_ns: u64) -> KvEvent {
        KvEvent {
            at_ns,
            revision,
            key: key.into(),
            value: None,
        }
    }

    fn write(key: &str, value: &str, revision: i64, acked_ns: u64, deadline_ns: u64) -> Record {
        Record::KvWrite {
            client: "c0".into(),
            key: key.into(),
            value: value.into(),
            revision,
            at_ns: acked_ns.saturating_sub(1),
            acked_ns,
            deadline_ns,
        }
    }

    fn history() -> History {
        History {
            from: 10,
            events: vec![
                put(10, "kv/a", "a1", 100),
                put(11, "kv/b", "b1", 110),
                put(12, "members/m", "m1", 120),
                put(13, "kv/a", "a2", 130),
                delete(14, "members/m", 140),
                put(15, "kv/a", "a3", 150),
            ],
        }
    }

    fn run(records: &[Record]) -> Vec<String> {
        let mut violations = Vec::new();
        check(records, &history(), &mut violations);
        violations
    }

    #[test]
    fn acknowledged_writes_must_be_in_the_history() {
        assert!(run(&[write("kv/a", "a2", 13, 131, 0)]).is_empty());
        let lost = run(&[write("kv/a", "a9", 13, 131, 0)]);
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert!(
            run(&[write("kv/a", "old", 5, 50, 0)]).is_empty(),
            "before the history"
        );
    }

    #[test]
    fn a_read_sees_every_write_acknowledged_before_it_and_only_real_values() {
        let read = |began_ns, entries: &[(&str, i64, &str)]| Record::Read {
            client: "c1".into(),
            prefix: "kv/".into(),
            began_ns,
            entries: entries
                .iter()
                .map(|(k, r, v)| ((*k).to_owned(), *r, (*v).to_owned()))
                .collect(),
        };
        let acked = write("kv/a", "a2", 13, 131, 0);
        // Sent after the ack: must see 13 or later.
        assert!(run(&[acked.clone(), read(140, &[("kv/a", 13, "a2")])]).is_empty());
        assert!(run(&[acked.clone(), read(160, &[("kv/a", 15, "a3")])]).is_empty());
        let stale = run(&[acked.clone(), read(140, &[("kv/a", 10, "a1")])]);
        assert!(stale[0].contains("older"), "{stale:?}");
        let missing = run(&[acked.clone(), read(140, &[])]);
        assert_eq!(missing.len(), 1, "{missing:?}");
        // Sent before the ack: may still see the older value.
        assert!(run(&[acked.clone(), read(125, &[("kv/a", 10, "a1")])]).is_empty());
        // A value the key never had at that revision.
        let made_up = run(&[read(140, &[("kv/a", 13, "zz")])]);
        assert!(made_up[0].contains("history"), "{made_up:?}");
    }

    #[test]
    fn a_watch_delivers_exactly_the_history_from_its_start() {
        let from = |from| Record::WatchFrom {
            client: "c2".into(),
            prefix: "kv/".into(),
            from,
        };
        let batch = |through, events: &[(i64, &str, bool)]| Record::Watched {
            client: "c2".into(),
            through,
            events: events
                .iter()
                .map(|(r, k, p)| (*r, (*k).to_owned(), *p))
                .collect(),
        };
        let whole = [
            from(11),
            batch(12, &[(11, "kv/b", true)]),
            batch(15, &[(13, "kv/a", true), (15, "kv/a", true)]),
        ];
        assert!(run(&whole).is_empty(), "{:?}", run(&whole));
        let missed = run(&[
            from(11),
            batch(15, &[(11, "kv/b", true), (15, "kv/a", true)]),
        ]);
        assert!(missed[0].contains("missed [(13"), "{missed:?}");
        let doubled = run(&[
            from(11),
            batch(13, &[(11, "kv/b", true), (13, "kv/a", true)]),
            batch(13, &[(13, "kv/a", true)]),
        ]);
        assert_eq!(doubled.len(), 1, "{doubled:?}");
        let reordered = run(&[
            from(11),
            batch(13, &[(13, "kv/a", true), (11, "kv/b", true)]),
        ]);
        assert!(reordered[0].contains("after"), "{reordered:?}");
        // Restarted after an error: each segment from its own start.
        let restarted = [
            from(10),
            batch(11, &[(10, "kv/a", true), (11, "kv/b", true)]),
            from(15),
            batch(15, &[(15, "kv/a", true)]),
        ];
        assert!(run(&restarted).is_empty(), "{:?}", run(&restarted));
    }

    #[test]
    fn an_ephemeral_key_stays_while_its_last_writers_session_is_valid() {
        // Written at 12, valid until 200; deleted at 140: taken early.
        let early = run(&[write("members/m", "m1", 12, 121, 200)]);
        assert_eq!(early.len(), 1, "{early:?}");
        assert!(early[0].contains("before its session's deadline"));
        // Valid until 130: deleted after, as its session's end does.
        assert!(run(&[write("members/m", "m1", 12, 121, 130)]).is_empty());
        // Its client closed the session after the write: the close took it.
        let close = Record::Closed {
            client: "c0".into(),
            at_ns: 135,
        };
        assert!(run(&[write("members/m", "m1", 12, 121, 200), close]).is_empty());
    }
}
