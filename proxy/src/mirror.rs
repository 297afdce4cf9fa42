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

/// The length of small key `name`'s etcd key (under `/k/`).
fn keyspace_len(name: &str) -> usize {
    "/k/".len() + name.len()
}

/// One small-key write, as the bounds on what keys hold see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSize<'a> {
    pub name: &'a str,
    /// The new value's length; `None` for a delete.
    pub value: Option<usize>,
    /// A put on no lease: the key is then its writer's (`stored_bytes`).
    pub persistent: bool,
}

impl<'a> WriteSize<'a> {
    pub fn put(name: &'a str, len: usize, persistent: bool) -> Self {
        WriteSize {
            name,
            value: Some(len),
            persistent,
        }
    }

    pub fn delete(name: &'a str) -> Self {
        WriteSize {
            name,
            value: None,
            persistent: false,
        }
    }
}

/// Every small key, as of one revision of the cell.
#[derive(Debug, Default)]
pub struct Mirror {
    entries: BTreeMap<String, Entry>,
    /// The mod revision of each client lease record (`keyspace::etcd_leased_root`), by
    /// its key's name: those no key shows any more are swept.
    records: std::collections::HashMap<String, i64>,
    /// Each owner record (`keyspace::owner_root`), by its key's name: the identity that
    /// wrote the key on no lease, and the record's mod revision.
    owners: std::collections::HashMap<String, (String, i64)>,
    /// By identity, what the persistent keys whose owner record is about their last
    /// write hold ([`key_bytes`]).
    stored: std::collections::HashMap<String, usize>,
    /// By etcd API client lease, how many keys it has and what they take in etcd (each
    /// key's etcd name and value): what a session of that lease would bring to a proxy
    /// that gathers it.
    by_client_lease: std::collections::HashMap<i64, (u64, u64)>,
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
        let mut mirror = Mirror {
            entries: BTreeMap::new(),
            records: Default::default(),
            owners: Default::default(),
            stored: Default::default(),
            by_client_lease: Default::default(),
            revision,
            bytes,
        };
        for entry in entries.values() {
            mirror.count_client_lease(entry, 1);
        }
        mirror.entries = entries;
        mirror
    }

    /// Counts `entry` in (`1`) or out (`-1`) of its client lease's keys.
    fn count_client_lease(&mut self, entry: &Entry, sign: i64) {
        if entry.client_lease == 0 {
            return;
        }
        let bytes = (keyspace_len(&entry.name) + entry.value.len()) as i64;
        let held = self.by_client_lease.entry(entry.client_lease).or_default();
        held.0 = (held.0 as i64 + sign).max(0) as u64;
        held.1 = (held.1 as i64 + sign * bytes).max(0) as u64;
        if held.0 == 0 {
            self.by_client_lease.remove(&entry.client_lease);
        }
    }

    /// How many keys etcd API client lease `lease` has, and what they take in etcd
    /// (each key's etcd name and value).
    pub fn client_lease_keys(&self, lease: i64) -> (u64, u64) {
        self.by_client_lease
            .get(&lease)
            .copied()
            .unwrap_or_default()
    }

    /// With the owner records read with the keys: each one's identity and mod revision,
    /// by its key's name.
    pub fn with_owners(
        mut self,
        owners: impl IntoIterator<Item = (String, (String, i64))>,
    ) -> Mirror {
        for (name, owner) in owners {
            let before = self.share(&name);
            self.owners.insert(name.clone(), owner);
            self.recount(&name, before);
        }
        self
    }

    /// Takes in the owner records written (`Some` identity and mod revision) or deleted
    /// (`None`) in revisions up to the mirror's.
    pub fn owners_changed(
        &mut self,
        changes: impl IntoIterator<Item = (String, Option<(String, i64)>)>,
    ) {
        for (name, written) in changes {
            let before = self.share(&name);
            match written {
                Some(owner) => self.owners.insert(name.clone(), owner),
                None => self.owners.remove(&name),
            };
            self.recount(&name, before);
        }
    }

    /// Up to `limit` owner records no key shows any more (its key is gone, or written
    /// since by a write that left the record alone), with their mod revisions.
    pub fn orphan_owners(&self, limit: usize) -> Vec<(String, i64)> {
        self.owners
            .iter()
            .filter(|(name, (_, written))| {
                self.entries.get(*name).map(|e| e.mod_revision) != Some(*written)
            })
            .take(limit)
            .map(|(name, (_, written))| (name.clone(), *written))
            .collect()
    }

    /// Whose persistent key `name` is, and what it counts for: a key on no lease whose
    /// owner record is about its last write.
    fn share(&self, name: &str) -> Option<(String, usize)> {
        let entry = self.entries.get(name)?;
        let (identity, written) = self.owners.get(name)?;
        (entry.lease == 0 && *written == entry.mod_revision)
            .then(|| (identity.clone(), Self::bytes_of(entry)))
    }

    /// Moves `name`'s share of [`Self::stored`] from what it was (`before`) to what it is.
    fn recount(&mut self, name: &str, before: Option<(String, usize)>) {
        let after = self.share(name);
        if before == after {
            return;
        }
        if let Some((identity, bytes)) = before {
            if let Some(held) = self.stored.get_mut(&identity) {
                *held -= bytes;
                if *held == 0 {
                    self.stored.remove(&identity);
                }
            }
        }
        if let Some((identity, bytes)) = after {
            *self.stored.entry(identity).or_default() += bytes;
        }
    }

    /// What `identity`'s persistent keys hold ([`key_bytes`]), across the cell.
    pub fn stored(&self, identity: &str) -> usize {
        self.stored.get(identity).copied().unwrap_or_default()
    }

    /// What `writes` by `identity` change [`Self::stored`] of `identity` by: each
    /// persistent put makes its key the identity's, and every write takes the key from
    /// whoever it was before.
    pub fn stored_growth(&self, identity: &str, writes: &[WriteSize]) -> i64 {
        writes
            .iter()
            .map(|w| {
                let before = match self.share(w.name) {
                    Some((owner, bytes)) if owner == identity => bytes as i64,
                    _ => 0,
                };
                let after = match w.value {
                    Some(len) if w.persistent => key_bytes(w.name, len) as i64,
                    _ => 0,
                };
                after - before
            })
            .sum()
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
    pub fn net_growth(&self, writes: &[WriteSize]) -> i64 {
        writes
            .iter()
            .map(|w| {
                let before = self.entries.get(w.name).map_or(0, Self::bytes_of) as i64;
                let after = w.value.map_or(0, |len| key_bytes(w.name, len)) as i64;
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
            let before = self.share(&name);
            let event = match put {
                Some(entry) => {
                    self.bytes += Self::bytes_of(&entry);
                    self.count_client_lease(&entry, 1);
                    let prev = self.entries.insert(name.clone(), entry.clone());
                    self.bytes -= prev.as_ref().map_or(0, Self::bytes_of);
                    if let Some(prev) = &prev {
                        self.count_client_lease(prev, -1);
                    }
                    KeyEvent {
                        kind: EventKind::Put,
                        entry,
                        prev,
                    }
                }
                None => {
                    let prev = self.entries.remove(&name);
                    self.bytes -= prev.as_ref().map_or(0, Self::bytes_of);
                    if let Some(prev) = &prev {
                        self.count_client_lease(prev, -1);
                    }
                    KeyEvent::deleted(name.clone(), at, prev)
                }
            };
            self.recount(&name, before);
            events.push(event);
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
        let put = |name, len| WriteSize::put(name, len, true);
        assert_eq!(
            mirror.net_growth(&[put("a", 1)]),
            0,
            "a value no longer adds nothing"
        );
        assert_eq!(mirror.net_growth(&[put("a", 4)]), 3);
        assert_eq!(mirror.net_growth(&[put("c", 0)]), key_bytes("c", 0) as i64);
        let freed = -(key_bytes("bb", 3) as i64);
        assert_eq!(mirror.net_growth(&[WriteSize::delete("bb")]), freed);
        assert_eq!(
            mirror.net_growth(&[WriteSize::delete("bb"), put("a", 1)]),
            freed
        );
        mirror.apply(13, [("a".into(), 13, None), ("zz".into(), 13, None)]);
        assert_eq!(mirror.bytes(), key_bytes("bb", 3));
    }

    fn owner(identity: &str, rev: i64) -> Option<(String, i64)> {
        Some((identity.to_owned(), rev))
    }

    #[test]
    fn persistent_keys_count_against_their_last_writer_only_while_their_record_holds() {
        let leased = Entry {
            lease: 7,
            ..entry("eph", "xx", 4)
        };
        let mut mirror = Mirror::new([entry("a", "123", 5), entry("b", "1", 6), leased], 10)
            .with_owners([
                ("a".to_owned(), ("batch".to_owned(), 5)),
                // Written since by a write that left the record alone: nobody's.
                ("b".to_owned(), ("batch".to_owned(), 3)),
                // On a lease: its session's, never a writer's.
                ("eph".to_owned(), ("batch".to_owned(), 4)),
            ]);
        assert_eq!(mirror.stored("batch"), key_bytes("a", 3));
        assert_eq!(mirror.stored("web"), 0);
        // web writes a over: it is web's now; batch's "b" record is made good.
        mirror.apply(11, [("a".into(), 11, Some(entry("a", "12", 11)))]);
        assert_eq!(
            mirror.stored("batch"),
            0,
            "a record about an older write counts for nobody"
        );
        mirror.owners_changed([("a".to_owned(), owner("web", 11))]);
        assert_eq!(mirror.stored("web"), key_bytes("a", 2));
        mirror.apply(12, [("b".into(), 12, Some(entry("b", "1", 12)))]);
        mirror.owners_changed([("b".to_owned(), owner("batch", 12))]);
        assert_eq!(mirror.stored("batch"), key_bytes("b", 1));
        // What writes would change, for each writer.
        let writes = [WriteSize::put("a", 10, true), WriteSize::delete("b")];
        assert_eq!(
            mirror.stored_growth("batch", &writes),
            key_bytes("a", 10) as i64 - key_bytes("b", 1) as i64
        );
        assert_eq!(
            mirror.stored_growth("web", &writes),
            key_bytes("a", 10) as i64 - key_bytes("a", 2) as i64
        );
        assert_eq!(
            mirror.stored_growth("web", &[WriteSize::put("a", 10, false)]),
            -(key_bytes("a", 2) as i64),
            "a leased put takes the key out of its writer's count"
        );
        // A delete frees its writer's share; its record is then an orphan.
        mirror.apply(13, [("a".into(), 13, None)]);
        assert_eq!(mirror.stored("web"), 0);
        let mut orphans = mirror.orphan_owners(10);
        orphans.sort();
        assert_eq!(orphans, [("a".to_owned(), 11)]);
        mirror.owners_changed([("a".to_owned(), None), ("eph".to_owned(), None)]);
        assert!(mirror.orphan_owners(10).is_empty());
        assert!(
            mirror.stored.values().all(|b| *b > 0),
            "no identity is kept at zero"
        );
    }

    #[test]
    fn keys_are_counted_by_their_client_lease() {
        let on = |name: &str, value: &str, rev: i64, lease: i64| Entry {
            lease: 99,
            client_lease: lease,
            ..entry(name, value, rev)
        };
        let mut mirror = Mirror::new([on("a", "12", 1, 7), entry("b", "1", 2)], 2);
        assert_eq!(mirror.client_lease_keys(7), (1, 3 + 1 + 2));
        mirror.apply(
            4,
            [
                ("c".into(), 3, Some(on("c", "x", 3, 7))),
                ("a".into(), 4, Some(on("a", "1234", 4, 8))),
            ],
        );
        assert_eq!(mirror.client_lease_keys(7), (1, 3 + 1 + 1));
        assert_eq!(mirror.client_lease_keys(8), (1, 3 + 1 + 4));
        mirror.apply(5, [("c".into(), 5, None)]);
        assert_eq!(mirror.client_lease_keys(7), (0, 0));
        assert!(!mirror.by_client_lease.contains_key(&7));
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
