//! The proxy's copy of the small-key space (`/k/`), fed by its one watch over the cell.
//!
//! Linearizable reads are answered from it once it has applied the revision a read
//! barrier fixed (`crate::barrier`); the events it applies carry the value each key
//! had before, so watchers asking for previous values cost etcd nothing more.

use std::collections::BTreeMap;
use std::ops::Bound;

use lockcell_cell::kv::Entry;

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Put,
    Delete,
}

/// One change of a small key, as watchers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEvent {
    pub kind: EventKind,
    /// The key after the change; for a delete, the key with the delete's revision as
    /// its `mod_revision` and nothing else.
    pub entry: Entry,
    /// The key before the change, when it existed.
    pub prev: Option<Entry>,
}

impl KeyEvent {
    /// The revision of the change.
    pub fn revision(&self) -> i64 {
        self.entry.mod_revision
    }

    /// A delete of `name` at `revision`, in the shape etcd reports it.
    pub fn deleted(name: String, revision: i64, prev: Option<Entry>) -> KeyEvent {
        KeyEvent {
            kind: EventKind::Delete,
            entry: Entry {
                name,
                value: Vec::new(),
                create_revision: 0,
                mod_revision: revision,
                version: 0,
                lease: 0,
                client_lease: 0,
            },
            prev,
        }
    }
}

/// What a key or a prefix names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Topic {
    /// The key's name, or the start of the names (without the `/k/` root).
    pub name: String,
    pub prefix: bool,
}

impl Topic {
    pub fn matches(&self, name: &str) -> bool {
        if self.prefix {
            name.starts_with(&self.name)
        } else {
            name == self.name
        }
    }
}

/// What one small key counts for against `--max-kv-total-bytes`: its name and value,
/// and a fixed share for what holding it costs besides (every proxy keeps every key).
pub fn key_bytes(name: &str, value_len: usize) -> usize {
    name.len() + value_len + PER_KEY_BYTES
}

/// The fixed share of each key in [`key_bytes`].
pub const PER_KEY_BYTES: usize = 128;

/// Every small key, as of one revision of the cell.
#[derive(Debug, Default)]
pub struct Mirror {
    entries: BTreeMap<String, Entry>,
    /// The mod revision of each client lease record (`keyspace::etcd_leased_root`), by
    /// its key's name: those no key shows any more are swept.
    records: std::collections::HashMap<String, i64>,
    /// The cell revision the mirror reflects: every change at or before it is applied.
    revision: i64,
    /// The sum of [`key_bytes`] over every key.
    bytes: usize,
}

impl Mirror {
    /// A mirror of `entries`, read at `revision`.
    pub fn new(entries: impl IntoIterator<Item = Entry>, revision: i64) -> Mirror {
        let entries: BTreeMap<String, Entry> =
            entries.into_iter().map(|e| (e.name.clone(), e)).collect();
        let bytes = entries.values().map(Self::bytes_of).sum();
        Mirror {
            entries,
            records: Default::default(),
            revision,
            bytes,
        }
    }

    /// With the client lease records read with the keys: each one's mod revision, by
    /// its key's name.
    pub fn with_records(mut self, records: impl IntoIterator<Item = (String, i64)>) -> Mirror {
        self.records = records.into_iter().collect();
        self
    }

    /// Takes in the client lease records written or deleted in revisions up to the
    /// mirror's (`Some` mod revision, `None` deleted).
    pub fn records_changed(&mut self, changes: impl IntoIterator<Item = (String, Option<i64>)>) {
        for (name, written) in changes {
            match written {
                Some(revision) => self.records.insert(name, revision),
                None => self.records.remove(&name),
            };
        }
    }

    /// Up to `limit` client lease records no key shows any more (its key is gone, or
    /// written since by a write that left the record alone), with their mod revisions.
    pub fn orphan_records(&self, limit: usize) -> Vec<(String, i64)> {
        self.records
            .iter()
            .filter(|(name, written)| {
                self.entries.get(*name).map(|e| e.mod_revision) != Some(**written)
            })
            .take(limit)
            .map(|(name, written)| (name.clone(), *written))
            .collect()
    }

    fn bytes_of(entry: &Entry) -> usize {
        key_bytes(&entry.name, entry.value.len())
    }

    /// What every small key counts for together ([`key_bytes`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// What `writes` (each a key and its new value's length, or `None` for a delete)
    /// change [`Self::bytes`] by, together: a delete frees what its key holds.
    pub fn net_growth(&self, writes: &[(&str, Option<usize>)]) -> i64 {
        writes
            .iter()
            .map(|(name, len)| {
                let before = self.entries.get(*name).map_or(0, Self::bytes_of) as i64;
                let after = len.map_or(0, |len| key_bytes(name, len)) as i64;
                after - before
            })
            .sum()
    }

    pub fn revision(&self) -> i64 {
        self.revision
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Applies the changes of revisions up to `revision` (in order; `Some` a put, `None`
    /// a delete of the named key) and returns them as events, each with the key's value
    /// before it. Changes at or below the mirror's revision were applied already and are
    /// skipped.
    pub fn apply(
        &mut self,
        revision: i64,
        changes: impl IntoIterator<Item = (String, i64, Option<Entry>)>,
    ) -> Vec<KeyEvent> {
        let mut events = Vec::new();
        for (name, at, put) in changes {
            if at <= self.revision {
                continue;
            }
            events.push(match put {
                Some(entry) => {
                    self.bytes += Self::bytes_of(&entry);
                    let prev = self.entries.insert(name, entry.clone());
                    self.bytes -= prev.as_ref().map_or(0, Self::bytes_of);
                    KeyEvent {
                        kind: EventKind::Put,
                        entry,
                        prev,
                    }
                }
                None => {
                    let prev = self.entries.remove(&name);
                    self.bytes -= prev.as_ref().map_or(0, Self::bytes_of);
                    KeyEvent::deleted(name, at, prev)
                }
            });
        }
        self.revision = self.revision.max(revision);
        events
    }

    /// The key named `name`.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// The keys from `start` on, before `end`, in order of their names.
    pub fn range<'a>(
        &'a self,
        start: &'a str,
        end: Bound<&'a str>,
    ) -> impl Iterator<Item = &'a Entry> + 'a {
        self.entries
            .range::<str, _>((Bound::Included(start), end))
            .map(|(_, e)| e)
    }

    /// The key, or the keys under the prefix, at most `limit` of them (0: all); and
    /// whether more matched.
    pub fn read(&self, topic: &Topic, limit: i64) -> (Vec<Entry>, bool) {
        if !topic.prefix {
            return (
                self.entries.get(&topic.name).cloned().into_iter().collect(),
                false,
            );
        }
        let limit = usize::try_from(limit)
            .ok()
            .filter(|l| *l > 0)
            .unwrap_or(usize::MAX);
        let mut matched = self
            .entries
            .range::<str, _>((Bound::Included(topic.name.as_str()), Bound::Unbounded))
            .take_while(|(name, _)| name.starts_with(&topic.name))
            .map(|(_, e)| e);
        let entries: Vec<Entry> = matched.by_ref().take(limit).cloned().collect();
        let more = matched.next().is_some();
        (entries, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, value: &str, rev: i64) -> Entry {
        Entry {
            name: name.into(),
            value: value.into(),
            create_revision: rev,
            mod_revision: rev,
            version: 1,
            lease: 0,
            client_lease: 0,
        }
    }

    fn prefix(name: &str) -> Topic {
        Topic {
            name: name.into(),
            prefix: true,
        }
    }

    #[test]
    fn events_carry_the_previous_value_and_old_changes_are_skipped() {
        let mut mirror = Mirror::new([entry("a", "1", 5)], 10);
        let events = mirror.apply(
            12,
            [
                ("a".into(), 9, Some(entry("a", "stale", 9))),
                ("a".into(), 11, Some(entry("a", "2", 11))),
                ("b".into(), 12, Some(entry("b", "x", 12))),
                ("a".into(), 12, None),
            ],
        );
        assert_eq!(events.len(), 3, "the change at 9 was applied before");
        assert_eq!(events[0].prev.as_ref().unwrap().value, b"1");
        assert_eq!(events[2].kind, EventKind::Delete);
        assert_eq!(events[2].revision(), 12);
        assert_eq!(events[2].prev.as_ref().unwrap().value, b"2");
        assert_eq!(mirror.revision(), 12);
        assert_eq!(mirror.len(), 1);
    }

    #[test]
    fn a_revision_without_small_key_changes_still_advances_the_mirror() {
        let mut mirror = Mirror::new([], 3);
        assert!(mirror.apply(7, []).is_empty());
        assert_eq!(mirror.revision(), 7);
    }

    #[test]
    fn prefix_reads_stop_at_the_prefix_and_honour_the_limit() {
        let mirror = Mirror::new(
            [
                entry("m/a/1", "", 1),
                entry("m/a/2", "", 2),
                entry("m/a/3", "", 3),
                entry("m/ab", "", 4),
                entry("m/b/1", "", 5),
            ],
            5,
        );
        let (all, more) = mirror.read(&prefix("m/a/"), 0);
        assert_eq!(all.len(), 3);
        assert!(!more);
        let (two, more) = mirror.read(&prefix("m/a/"), 2);
        assert_eq!(two.len(), 2);
        assert!(more);
        let (loose, _) = mirror.read(&prefix("m/a"), 0);
        assert_eq!(loose.len(), 4, "a prefix without '/' takes m/ab too");
        let (one, _) = mirror.read(
            &Topic {
                name: "m/ab".into(),
                prefix: false,
            },
            0,
        );
        assert_eq!(one.len(), 1);
    }

    #[test]
    fn the_mirror_counts_what_its_keys_hold() {
        let mut mirror = Mirror::new([entry("a", "12345", 5)], 10);
        assert_eq!(mirror.bytes(), key_bytes("a", 5));
        mirror.apply(
            12,
            [
                ("a".into(), 11, Some(entry("a", "1", 11))),
                ("bb".into(), 12, Some(entry("bb", "xyz", 12))),
            ],
        );
        assert_eq!(mirror.bytes(), key_bytes("a", 1) + key_bytes("bb", 3));
        assert_eq!(
            mirror.net_growth(&[("a", Some(1))]),
            0,
            "a value no longer adds nothing"
        );
        assert_eq!(mirror.net_growth(&[("a", Some(4))]), 3);
        assert_eq!(
            mirror.net_growth(&[("c", Some(0))]),
            key_bytes("c", 0) as i64
        );
        let freed = -(key_bytes("bb", 3) as i64);
        assert_eq!(mirror.net_growth(&[("bb", None)]), freed);
        assert_eq!(mirror.net_growth(&[("bb", None), ("a", Some(1))]), freed);
        mirror.apply(13, [("a".into(), 13, None), ("zz".into(), 13, None)]);
        assert_eq!(mirror.bytes(), key_bytes("bb", 3));
    }

    #[test]
    fn records_no_key_shows_are_orphans() {
        let records = [
            ("a".to_owned(), 5),
            ("b".to_owned(), 4),
            ("c".to_owned(), 3),
        ];
        let mut mirror =
            Mirror::new([entry("a", "1", 5), entry("b", "1", 6)], 10).with_records(records);
        let mut orphans = mirror.orphan_records(10);
        orphans.sort();
        // b was written since without its record; c is gone.
        assert_eq!(orphans, [("b".to_owned(), 4), ("c".to_owned(), 3)]);
        mirror.records_changed([("b".to_owned(), None), ("a".to_owned(), Some(11))]);
        let mut orphans = mirror.orphan_records(10);
        orphans.sort();
        assert_eq!(orphans, [("a".to_owned(), 11), ("c".to_owned(), 3)]);
        assert_eq!(mirror.orphan_records(1).len(), 1);
    }
}
