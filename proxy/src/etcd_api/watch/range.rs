//! What a client's watch selects: its range of client keys, and its filters.

use super::*;

/// Which events of its topic a watch delivers: those in its range, less the kinds its
/// filters drop.
#[derive(Debug, Clone)]
pub(super) struct Selection {
    pub(super) range: ClientRange,
    pub(super) no_put: bool,
    pub(super) no_delete: bool,
}

/// A client range as etcd's API spells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ClientRange {
    pub(super) key: Vec<u8>,
    /// Empty: the key alone; `\0`: every key from `key` on; else the first key past.
    pub(super) end: Vec<u8>,
}

impl Selection {
    pub(super) fn wants(&self, event: &KeyEvent) -> bool {
        let kind = match event.kind {
            EventKind::Put => !self.no_put,
            EventKind::Delete => !self.no_delete,
        };
        kind && self.range.contains(event.entry.name.as_bytes())
    }
}

impl ClientRange {
    pub(super) fn contains(&self, name: &[u8]) -> bool {
        match &self.end[..] {
            [] => name == self.key,
            [0] => name >= &self.key[..],
            end => name >= &self.key[..] && name < end,
        }
    }

    /// Whether no key can be in it (etcd refuses such a watch).
    pub(super) fn is_empty(&self) -> bool {
        !matches!(&self.end[..], [] | [0]) && self.key >= self.end
    }

    /// The fan-out topic whose events include every key of the range: the key, or the
    /// longest text both ends of the range start with.
    pub(super) fn topic(&self) -> Topic {
        if self.end.is_empty() {
            return Topic {
                name: String::from_utf8_lossy(&self.key).into_owned(),
                prefix: false,
            };
        }
        let end: &[u8] = if self.end == [0] { &[] } else { &self.end };
        let common = self.key.iter().zip(end).take_while(|(a, b)| a == b).count();
        let shared = &self.key[..common];
        let text = match std::str::from_utf8(shared) {
            Ok(text) => text,
            Err(e) => std::str::from_utf8(&shared[..e.valid_up_to()]).expect("valid up to"),
        };
        Topic {
            name: text.to_owned(),
            prefix: true,
        }
    }
}
