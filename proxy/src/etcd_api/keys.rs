//! The etcd API's namespace: an etcd client sees only lockcell's small keys. Client key
//! `K` is etcd key `/k/K`, in requests, replies and compares; lockcell's own keys (locks,
//! queues, sessions, the cell's records) are outside every range a client can name.

use lockcell_cell::keyspace::{kv_root, prefix_end};

/// A range as etcd's API spells it: a key, and a `range_end` that is empty (the key
/// alone), `\0` (every key from `key` on) or the first key past the range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub key: Vec<u8>,
    pub end: Vec<u8>,
}

/// The etcd key of client key `key`.
pub fn inner(key: &[u8]) -> Vec<u8> {
    let mut inner = kv_root().as_bytes().to_vec();
    inner.extend_from_slice(key);
    inner
}

/// The client key of etcd key `key`, if it is in the small-key space.
pub fn outer(key: &[u8]) -> Option<&[u8]> {
    key.strip_prefix(kv_root().as_bytes())
}

/// The etcd range of the client's range (`key`, `range_end`), clipped to the small-key
/// space: the "from key" form (`range_end` `\0`) and the whole space (`key` and
/// `range_end` both `\0`) end where the small keys end, never in lockcell's own keys.
pub fn inner_range(key: &[u8], range_end: &[u8]) -> Range {
    let space_end = prefix_end(kv_root().as_bytes());
    let key = if key == [0] { Vec::new() } else { key.to_vec() };
    let end = match range_end {
        [] => Vec::new(),
        [0] => space_end,
        end => inner(end),
    };
    Range {
        key: inner(&key),
        end,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_key_lives_under_the_small_key_root() {
        assert_eq!(inner(b"config/a"), b"/k/config/a");
        assert_eq!(outer(b"/k/config/a"), Some(&b"config/a"[..]));
        assert_eq!(outer(b"/l/jobs/!x"), None);
        assert_eq!(outer(&inner(b"/leading")), Some(&b"/leading"[..]));
    }

    #[test]
    fn a_single_key_range_stays_one_key() {
        let r = inner_range(b"a", b"");
        assert_eq!((r.key, r.end), (b"/k/a".to_vec(), Vec::new()));
    }

    #[test]
    fn a_prefix_range_maps_both_ends() {
        // etcdctl get --prefix a: range_end is the prefix's successor.
        let r = inner_range(b"a", b"b");
        assert_eq!((r.key, r.end), (b"/k/a".to_vec(), b"/k/b".to_vec()));
    }

    #[test]
    fn from_key_and_whole_space_end_with_the_small_keys() {
        let r = inner_range(b"m", b"\0");
        assert_eq!((r.key, r.end), (b"/k/m".to_vec(), b"/k0".to_vec()));
        let all = inner_range(b"\0", b"\0");
        assert_eq!((&all.key[..], &all.end[..]), (&b"/k/"[..], &b"/k0"[..]));
        // Neither reaches lockcell's own keys.
        for own in [&b"/l/jobs"[..], b"/q/x", b"/s/x", b"/sys/epoch"] {
            assert!(
                !(own >= &all.key[..] && own < &all.end[..]),
                "{own:?} is in range"
            );
        }
    }
}
