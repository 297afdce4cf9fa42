//! The small-key checks of fault runs: every acknowledged write, read and watch a client
//! recorded, compared with the store's history of the small keys as the run's own watch
//! on each cell's etcd saw it.
//!
//! A prefix can move between cells during a run: its keys are copied to the other cell
//! (with new revisions there) and deleted from the one they left. Reads and watches name
//! the cell their revisions are of and are compared with that cell's history.
//!
//! - an acknowledged write is in a cell's history: the key had that value at that
//!   revision;
//! - a linearizable read shows, for every key under its prefix, no value older than a
//!   write acknowledged before the read was sent, and only values the key really had in
//!   the read's cell. A write made in one cell reaches another as a copy with the same
//!   value: its place in the read's cell is the first change there to that value
//!   (values are never written twice);
//! - a watch delivers, from the revision it (re)started at through the last revision it
//!   reported, exactly the changes its cell's history has under its prefix: none missed,
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

/// What the checks compare the records with: one cell's history.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// The cell's cluster id: the first part of the positions its reads and watches
    /// name (`cluster/epoch/route epoch`).
    pub cluster: String,
    /// Every change of a small key from `from` on, in the store's order.
    pub events: Vec<KvEvent>,
    /// The first revision the history covers.
    pub from: i64,
}

/// The history of the cell `cell` (a position) names; the first one when it names none
/// (a proxy that does not say).
fn history_of<'h>(histories: &'h [History], cell: &str) -> Option<&'h History> {
    if cell.is_empty() {
        return histories.first();
    }
    let cluster = cell.split('/').next().unwrap_or_default();
    histories.iter().find(|h| h.cluster == cluster)
}

/// [`history_of`], counting a read or watch made in another cell than the first.
fn cell_history<'h>(
    histories: &'h [History],
    cell: &str,
    checked: &mut Checked,
) -> Option<&'h History> {
    let history = history_of(histories, cell);
    if history.is_some_and(|h| !std::ptr::eq(h, &histories[0])) {
        checked.elsewhere += 1;
    }
    history
}

impl History {
    /// The first revision at which `key` took `value` (values are never written twice:
    /// later ones are copies made by a prefix move).
    fn first_put(&self, key: &str, value: &str) -> Option<i64> {
        self.events
            .iter()
            .find(|e| e.key == key && e.value.as_deref() == Some(value))
            .map(|e| e.revision)
    }

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
    /// Reads and watches (from one start each) made in another cell than the first
    /// (after a prefix moved there).
    pub elsewhere: usize,
}

/// Runs every check over `records` (all clients') against `histories` (one per cell,
/// the run's own first); appends what it finds to `violations`.
pub fn check(records: &[Record], histories: &[History], violations: &mut Vec<String>) -> Checked {
    let mut checked = Checked::default();
    check_writes(records, histories, violations, &mut checked);
    check_reads(records, histories, violations, &mut checked);
    check_watches(records, histories, violations, &mut checked);
    for history in histories {
        check_ephemeral(records, history, violations);
    }
    checked
}

fn check_writes(
    records: &[Record],
    histories: &[History],
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
        // Which cell took it is not recorded: one whose history has it at that revision.
        let found = histories.iter().any(|h| {
            h.events.iter().any(|e| {
                e.revision == *revision && e.key == *key && e.value.as_deref() == Some(value)
            })
        });
        if histories.iter().all(|h| *revision < h.from) {
            continue;
        }
        checked.writes += 1;
        if !found {
            violations.push(format!(
                "the acknowledged write of {value:?} to {key} at revision {revision} is not in any cell's history"
            ));
        }
    }
}

fn check_reads(
    records: &[Record],
    histories: &[History],
    violations: &mut Vec<String>,
    checked: &mut Checked,
) {
    // The persistent writes acknowledged, by key: (acknowledged at, value).
    let mut acked: HashMap<&str, Vec<(u64, &str)>> = HashMap::new();
    for record in records {
        if let Record::KvWrite {
            key,
            value,
            acked_ns,
            deadline_ns: 0,
            ..
        } = record
        {
            if *acked_ns > 0 {
                acked.entry(key).or_default().push((*acked_ns, value));
            }
        }
    }
    for record in records {
        let Record::Read {
            client,
            prefix,
            began_ns,
            entries,
            cell,
        } = record
        else {
            continue;
        };
        checked.reads += 1;
        let Some(history) = cell_history(histories, cell, checked) else {
            violations.push(format!(
                "{client}'s read of {prefix} at {began_ns} ns names cell {cell:?}, which is none of the run's"
            ));
            continue;
        };
        let found: HashMap<&str, (i64, &str)> = entries
            .iter()
            .map(|(k, r, v)| (k.as_str(), (*r, v.as_str())))
            .collect();
        for (key, writes) in acked.iter().filter(|(k, _)| k.starts_with(prefix.as_str())) {
            // Where the newest value acknowledged before the read stands in the read's
            // cell (written there, or copied there by a move).
            let Some(newest) = writes
                .iter()
                .filter(|(at, _)| at < began_ns)
                .filter_map(|(_, value)| history.first_put(key, value))
                .max()
            else {
                continue;
            };
            match found.get(key) {
                Some((revision, _)) if *revision >= newest => {}
                seen => violations.push(format!(
                    "{client}'s read of {prefix} at {began_ns} ns in cell {cell:?} saw {key} at {:?}, older than revision {newest}, where a write acknowledged before the read was sent stands in that cell",
                    seen.map(|(r, _)| *r)
                )),
            }
        }
        for (key, (revision, value)) in &found {
            match history.value_at(key, *revision) {
                Some(Some(had)) if had == *value => {}
                None => {}
                had => violations.push(format!(
                    "{client}'s read of {prefix} at {began_ns} ns saw {key} = {value:?} at revision {revision}, which cell {cell:?}'s history has as {had:?}"
                )),
            }
        }
    }
}

fn check_watches(
    records: &[Record],
    histories: &[History],
    violations: &mut Vec<String>,
    checked: &mut Checked,
) {
    /// One watch from one (re)start: its cell, start, last revision reported, and the
    /// events delivered.
    struct Segment<'r> {
        cell: &'r str,
        from: i64,
        through: i64,
        delivered: Vec<(i64, String, bool)>,
    }
    // Each client's watch of each prefix, segment by segment.
    let mut segments: BTreeMap<(&str, &str), Vec<Segment>> = BTreeMap::new();
    for record in records {
        match record {
            Record::WatchFrom {
                client,
                prefix,
                from,
                cell,
            } => segments.entry((client, prefix)).or_default().push(Segment {
                cell,
                from: *from,
                through: from - 1,
                delivered: Vec::new(),
            }),
            Record::Watched {
                client,
                prefix,
                through,
                events,
            } => {
                let Some(segment) = segments
                    .get_mut(&(client.as_str(), prefix.as_str()))
                    .and_then(|s| s.last_mut())
                else {
                    violations.push(format!(
                        "{client} recorded a batch of its watch of {prefix} before any watch"
                    ));
                    continue;
                };
                if *through < segment.through {
                    violations.push(format!(
                        "{client}'s watch of {prefix} went back from revision {} to {through}",
                        segment.through
                    ));
                }
                segment.through = segment.through.max(*through);
                segment.delivered.extend(events.iter().cloned());
            }
            _ => {}
        }
    }
    for ((client, prefix), segments) in segments {
        for segment in segments {
            let Segment {
                cell,
                from,
                through,
                delivered,
            } = segment;
            let Some(history) = cell_history(histories, cell, checked) else {
                violations.push(format!(
                    "{client}'s watch of {prefix} from {from} names cell {cell:?}, which is none of the run's"
                ));
                continue;
            };
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
            // A move deletes the keys it copied from the cell they left: those deletes
            // are no change of the keys, and a watch must end before them.
            for (revision, key, _) in got.iter().filter(|e| !e.2) {
                let Some(Some(had)) = history.value_at(key, revision - 1) else {
                    continue;
                };
                let copied = histories
                    .iter()
                    .filter(|h| !std::ptr::eq(*h, history))
                    .any(|h| h.first_put(key, had).is_some());
                if copied {
                    violations.push(format!(
                        "{client}'s watch of {prefix} from {from} in cell {cell:?} delivered the delete of {key} at revision {revision}, which a move made after copying its value {had:?} to another cell"
                    ));
                }
            }
            let mut want = history.changes(prefix, start, through);
            checked.watched += got.len();
            // Within one revision the order of keys is not compared.
            got.sort();
            want.sort();
            if got != want {
                let missed: Vec<_> = want.iter().filter(|e| !got.contains(e)).take(3).collect();
                let extra: Vec<_> = got.iter().filter(|e| !want.contains(e)).take(3).collect();
                violations.push(format!(
                    "{client}'s watch of {prefix} from {from} through {through} in cell {cell:?}: {} events, the store had {}; missed {missed:?}, not in the store or doubled {extra:?}",
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

    /// c1's read of `kv/` in `cell`, sent at `began_ns`, finding `entries`.
    fn read_in(cell: &str, began_ns: u64, entries: &[(&str, i64, &str)]) -> Record {
        Record::Read {
            client: "c1".into(),
            prefix: "kv/".into(),
            began_ns,
            entries: entries
                .iter()
                .map(|(k, r, v)| ((*k).to_owned(), *r, (*v).to_owned()))
                .collect(),
            cell: cell.into(),
        }
    }

    fn history() -> History {
        History {
            cluster: "ca".into(),
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
        check(records, &[history()], &mut violations);
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
        let read = |began_ns, entries: &[(&str, i64, &str)]| read_in("", began_ns, entries);
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
            cell: "ca/1/0".into(),
        };
        let batch = |through, events: &[(i64, &str, bool)]| Record::Watched {
            client: "c2".into(),
            prefix: "kv/".into(),
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
    fn reads_and_watches_are_checked_in_the_cell_they_name() {
        // kv/a moved from cell ca to cell cb after revision 15: copied there at 3 with
        // the value it had, deleted from ca at 16; written in cb at 4.
        let mut a = history();
        a.events.push(delete(16, "kv/a", 160));
        let b = History {
            cluster: "cb".into(),
            from: 1,
            events: vec![put(3, "kv/a", "a3", 155), put(4, "kv/a", "a4", 170)],
        };
        let histories = [a, b];
        let run = |records: &[Record]| {
            let mut violations = Vec::new();
            check(records, &histories, &mut violations);
            violations
        };
        let read = read_in;
        // Acknowledged in ca at 15: a read in cb after sees the copy (3) or later.
        let acked = write("kv/a", "a3", 15, 151, 0);
        assert!(run(&[acked.clone(), read("cb/1/2", 160, &[("kv/a", 3, "a3")])]).is_empty());
        let second = write("kv/a", "a4", 4, 171, 0);
        assert!(
            run(std::slice::from_ref(&second)).is_empty(),
            "a write found in cb"
        );
        let stale = run(&[second, read("cb/1/2", 180, &[("kv/a", 3, "a3")])]);
        assert!(stale[0].contains("older"), "{stale:?}");
        // A value of cb's read as ca's is one the key never had there.
        let crossed = run(&[read("ca/1/0", 160, &[("kv/a", 15, "a4")])]);
        assert!(crossed[0].contains("history has"), "{crossed:?}");
        let stranger = run(&[read("cz/1/0", 160, &[])]);
        assert!(stranger[0].contains("none of the run's"), "{stranger:?}");
        // A watch in cb from 1 sees cb's changes, not ca's.
        let from = Record::WatchFrom {
            client: "c2".into(),
            prefix: "kv/".into(),
            from: 1,
            cell: "cb/1/2".into(),
        };
        let batch = |events: &[(i64, &str, bool)]| Record::Watched {
            client: "c2".into(),
            prefix: "kv/".into(),
            through: 4,
            events: events
                .iter()
                .map(|(r, k, p)| (*r, (*k).to_owned(), *p))
                .collect(),
        };
        let whole = [from.clone(), batch(&[(3, "kv/a", true), (4, "kv/a", true)])];
        assert!(run(&whole).is_empty(), "{:?}", run(&whole));
        let mut checked = Checked::default();
        check_watches(&whole, &histories, &mut Vec::new(), &mut checked);
        assert_eq!(checked.elsewhere, 1);
        let missed = run(&[from, batch(&[(4, "kv/a", true)])]);
        assert!(missed[0].contains("missed [(3"), "{missed:?}");
        // A watch in ca that goes on past the move delivers its delete of the copy.
        let in_a = [
            Record::WatchFrom {
                client: "c3".into(),
                prefix: "kv/".into(),
                from: 15,
                cell: "ca/1/0".into(),
            },
            Record::Watched {
                client: "c3".into(),
                prefix: "kv/".into(),
                through: 16,
                events: vec![(15, "kv/a".into(), true), (16, "kv/a".into(), false)],
            },
        ];
        let phantom = run(&in_a);
        assert!(phantom[0].contains("which a move made"), "{phantom:?}");
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
