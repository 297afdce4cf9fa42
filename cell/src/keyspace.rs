//! Every etcd key lockcell uses is built here and nowhere else.
//!
//! | key | what | lease |
//! | --- | --- | --- |
//! | `/sys/epoch` | the epoch record | none |
//! | `/l/<lock>/!x` | the exclusive holder of `<lock>` | the holder session's proxy lease |
//! | `/l/<lock>/!s/<session>` | one shared holder of `<lock>` | same |
//! | `/l/<lock>/!r` | written with every clean release, for lock-delay and the audit trail; deleted by the next grant | the releasing holder's proxy lease |
//! | `/s/<session>` | the fence of a session that moved between proxies | its proxy lease |
//! | `/s/!proxy/<proxy id>` | a running proxy: its zone, addresses and version | one of that proxy's leases |
//! | `/q/<lock>/!x/<session>`, `/q/<lock>/!s/<session>` | a waiter of a fair class, in line by create revision | the waiter's proxy lease |
//! | `/k/<key>` | a small key | none, or its writer session's proxy lease |
//! | `/s/!etcd-leased/<key>` | the etcd API client lease small key `<key>` was written with, written in the key's own transaction | none: swept once its key is gone |
//!
//! Lock names are `/`-separated paths (`billing/nightly`), so one lock's name may be a
//! prefix of another's. The keys of a lock therefore sit under a marker segment that
//! starts with `!`, a byte no lock name may contain: the range `/l/<lock>/!` holds
//! exactly the keys of `<lock>` and never those of `<lock>/<more>`. The holders of a
//! lock are the range `[/l/<lock>/!s, /l/<lock>/!y)`: shared holders and the exclusive
//! holder, not the release marker.

use std::fmt;

/// Longest lock name accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 512;

/// The byte that starts every marker segment; lock names may not contain it.
pub const RESERVED: char = '!';

const SYS_ROOT: &str = "/sys/";
const EPOCH_KEY: &str = "/sys/epoch";
const LOCKS_ROOT: &str = "/l/";
const QUEUES_ROOT: &str = "/q/";
const KV_ROOT: &str = "/k/";
const SESSIONS_ROOT: &str = "/s/";
const PRESENCE_ROOT: &str = "/s/!proxy/";
/// Where proxies record who made their latest small-key write.
const WRITER_ROOT: &str = "/s/!writer/";
const LEASE_BLOCKS_KEY: &str = "/s/!etcd-lease-blocks";
const ETCD_LEASED_ROOT: &str = "/s/!etcd-leased/";
const ETCD_LEASE_CLAIM_ROOT: &str = "/s/!etcd-lease/";
const OWNER_ROOT: &str = "/s/!owner/";
const MARK: &str = "/!";

/// Why a lock name was refused. The message names the rule the name broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("lock name is empty")]
    Empty,
    #[error("lock name {name:?} is {len} bytes, over the limit of {max} bytes")]
    TooLong {
        name: String,
        len: usize,
        max: usize,
    },
    #[error("lock name {name:?} has an empty segment (it starts or ends with '/' or has '//')")]
    EmptySegment { name: String },
    #[error(
        "lock name {name:?} has a '.' or '..' segment; names may not point outside their prefix"
    )]
    DotSegment { name: String },
    #[error("lock name {name:?} contains a control character at byte {at}")]
    ControlChar { name: String, at: usize },
    #[error("lock name {name:?} contains '{RESERVED}' at byte {at}; '{RESERVED}' is reserved for lockcell's own key layout")]
    Reserved { name: String, at: usize },
}

/// A lock name that has passed validation; the only way to build a lock key. Shown in
/// messages as the quoted name, as a client wrote it.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(String);

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl LockName {
    /// Validates `name`: 1 to 512 bytes, `/`-separated non-empty segments, no `.` or `..`
    /// segment, no control characters, no `!`.
    pub fn parse(name: &str) -> Result<Self, NameError> {
        if name.is_empty() {
            return Err(NameError::Empty);
        }
        // Shown names are cut so an error about a huge name stays readable.
        let shown = || shorten(name);
        if name.len() > MAX_NAME_BYTES {
            return Err(NameError::TooLong {
                name: shown(),
                len: name.len(),
                max: MAX_NAME_BYTES,
            });
        }
        if let Some((at, _)) = name.char_indices().find(|(_, c)| c.is_control()) {
            return Err(NameError::ControlChar { name: shown(), at });
        }
        if let Some(at) = name.find(RESERVED) {
            return Err(NameError::Reserved { name: shown(), at });
        }
        for segment in name.split('/') {
            match segment {
                "" => return Err(NameError::EmptySegment { name: shown() }),
                "." | ".." => return Err(NameError::DotSegment { name: shown() }),
                _ => {}
            }
        }
        Ok(LockName(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Every key of this lock under `/l/`: holders and the release marker.
    pub fn keys_prefix(&self) -> String {
        format!("{LOCKS_ROOT}{}{MARK}", self.0)
    }

    /// `[start, end)` holding every holder key of this lock, exclusive and shared.
    pub fn holders_range(&self) -> (String, String) {
        (
            format!("{LOCKS_ROOT}{}{MARK}s", self.0),
            format!("{LOCKS_ROOT}{}{MARK}y", self.0),
        )
    }

    /// The key of the exclusive holder.
    pub fn exclusive_key(&self) -> String {
        format!("{LOCKS_ROOT}{}{MARK}x", self.0)
    }

    /// The prefix of the shared holders' keys.
    pub fn shared_prefix(&self) -> String {
        format!("{LOCKS_ROOT}{}{MARK}s/", self.0)
    }

    /// The key of `session`'s shared hold.
    pub fn shared_key(&self, session: &str) -> String {
        format!("{}{session}", self.shared_prefix())
    }

    /// The key a clean release writes, so that lock-delay can tell it from a holder that
    /// vanished.
    pub fn released_key(&self) -> String {
        format!("{LOCKS_ROOT}{}{MARK}r", self.0)
    }

    /// The holder key of `session` in `mode`.
    pub fn holder_key(&self, mode: Mode, session: &str) -> String {
        match mode {
            Mode::Exclusive => self.exclusive_key(),
            Mode::Shared => self.shared_key(session),
        }
    }

    /// Every waiter of this lock (fair classes), both modes.
    pub fn queue_prefix(&self) -> String {
        format!("{QUEUES_ROOT}{}{MARK}", self.0)
    }

    /// The waiters for exclusive holds.
    pub fn exclusive_queue_prefix(&self) -> String {
        format!("{QUEUES_ROOT}{}{MARK}x/", self.0)
    }

    /// A waiter's key in `mode`. `waiter` names one acquire call (the session and a
    /// nonce), so two calls of one session never share a place in line.
    pub fn waiter_key(&self, mode: Mode, waiter: &str) -> String {
        let m = match mode {
            Mode::Exclusive => 'x',
            Mode::Shared => 's',
        };
        format!("{QUEUES_ROOT}{}{MARK}{m}/{waiter}", self.0)
    }
}

/// How a lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    Exclusive,
    Shared,
}

impl Mode {
    /// The other mode.
    pub fn other(self) -> Mode {
        match self {
            Mode::Exclusive => Mode::Shared,
            Mode::Shared => Mode::Exclusive,
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Exclusive => "exclusively",
            Mode::Shared => "shared",
        })
    }
}

/// What a key under `/l/` or `/q/` is, for the watch that follows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind {
    Exclusive,
    Shared,
    Released,
    Waiter,
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn shorten(name: &str) -> String {
    const SHOWN: usize = 64;
    if name.len() <= SHOWN {
        return name.to_owned();
    }
    let mut end = SHOWN;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &name[..end])
}

/// The shard map's key: every cell of a shard map holds a copy of it, and a proxy grants
/// in a cell only what that cell's own copy routes to it.
pub fn shardmap_key() -> &'static str {
    "/sys/shardmap"
}

/// Where `lockcell-cell force-release` records who forced which hold off, and why
/// (see [`crate::forced`]); the audit trail turns each write into a `force_released`
/// event.
pub fn force_release_key() -> &'static str {
    "/sys/force-release"
}

/// The epoch record's key.
pub fn epoch_key() -> &'static str {
    EPOCH_KEY
}

/// The prefix of every lock's holder and marker keys (for the proxy's one watch).
pub fn locks_root() -> &'static str {
    LOCKS_ROOT
}

/// The etcd key of small key `name` (names follow the lock-name rules).
pub fn kv_key(name: &LockName) -> String {
    format!("{KV_ROOT}{}", name.as_str())
}

/// The etcd prefix of small keys starting with `prefix` (a valid name, possibly
/// followed by '/'), or of all small keys for "".
pub fn kv_prefix(prefix: &str) -> Result<String, NameError> {
    let trimmed = prefix.strip_suffix('/').unwrap_or(prefix);
    if trimmed.is_empty() {
        return Ok(KV_ROOT.to_owned());
    }
    let name = LockName::parse(trimmed)?;
    Ok(format!(
        "{KV_ROOT}{}{}",
        name.as_str(),
        if prefix.ends_with('/') { "/" } else { "" }
    ))
}

/// The name of a small key from its etcd key.
pub fn kv_name(key: &[u8]) -> Option<&str> {
    std::str::from_utf8(key).ok()?.strip_prefix(KV_ROOT)
}

/// The fence of a session that has moved between proxies: `/s/<session>`, on the lease
/// of the proxy it lives on. Every resume compares its mod revision with the one the
/// client last heard of and raises it, so a resume the client gave up on can never land
/// after a later one.
pub fn session_fence_key(session: &str) -> String {
    format!("{SESSIONS_ROOT}{session}")
}

/// Where a running proxy says so: `/s/!proxy/<proxy id>`, on one of its leases, so
/// the key lives exactly as long as the proxy holds a lease in the cell. Session ids
/// never contain `!`, so no session fence is under it.
pub fn proxy_presence_key(proxy_id: &str) -> String {
    format!("{PRESENCE_ROOT}{proxy_id}")
}

/// Where proxy `proxy_id` records who made its latest small-key write (see
/// [`crate::kv::Writer`]), in the write's own transaction.
pub fn writer_key(proxy_id: &str) -> String {
    format!("{WRITER_ROOT}{proxy_id}")
}

/// The count of lease ID blocks the cell's proxies have taken for the etcd API's
/// leases: each proxy takes the next block by raising it, so no two leases of the cell
/// ever share an ID. Under `/s/`, which proxies write; session ids never contain `!`.
pub fn lease_blocks_key() -> &'static str {
    LEASE_BLOCKS_KEY
}

/// Where a lease ID an etcd client chose is claimed while its lease lives:
/// `/s/!etcd-lease/<id in hex>`, on the proxy lease of the lease's session, so no two
/// proxies hand out one ID at once.
pub fn etcd_lease_claim_key(id: i64) -> String {
    format!("{ETCD_LEASE_CLAIM_ROOT}{id:016x}")
}

/// Whether `key`'s value names the proxy whose lease the key is on: a session fence
/// (`/s/<session>`: session ids never contain `!`) or a lease ID claim
/// ([`etcd_lease_claim_key`]). lockcell's other records under `/s/` hold other values.
pub fn value_names_proxy(key: &[u8]) -> bool {
    match key.strip_prefix(SESSIONS_ROOT.as_bytes()) {
        Some(rest) => !rest.starts_with(b"!") || key.starts_with(ETCD_LEASE_CLAIM_ROOT.as_bytes()),
        None => false,
    }
}

/// The cell's key for the calls its proxies forward to each other on etcd API leases
/// (an HMAC key, random, written once by the first proxy that needs it): only
/// proxies read lockcell's own keys.
pub fn etcd_forward_key() -> &'static str {
    "/s/!etcd-forward-key"
}

/// Where a draining proxy hands an etcd API lease over to whichever proxy its client
/// reaches next: `/s/!etcd-handoff/<id in hex>`, on the proxy lease of the lease's
/// session, so it goes with that lease (see the proxy's `etcd_api::handoff`).
pub fn etcd_lease_handoff_key(id: i64) -> String {
    format!("{}{id:016x}", etcd_lease_handoff_root())
}

/// Where the etcd API records the client lease a small key was written with:
/// `/s/!etcd-leased/<key>`, its value the lease ID in decimal. Written in the same
/// transaction as the key, so its mod revision is the key's as long as the record is
/// about that write; readers take it only then, so a record left behind never lies.
/// On no lease: a proxy lease that ends deletes its keys alone (a lost zone costs etcd
/// no more), and records no key shows are swept later. Every proxy of the cell reads
/// them, so an etcd client sees its own lease on a key whichever proxy wrote it.
pub fn etcd_leased_root() -> &'static str {
    ETCD_LEASED_ROOT
}

/// The client lease record ([`etcd_leased_root`]) of etcd key `key`, or of the end of a
/// range of etcd keys: a key under `/k/` maps to the record of the same name, the end
/// of the small-key space to the end of the records. `None` for any other key.
pub fn etcd_leased_key(key: &[u8]) -> Option<Vec<u8>> {
    record_under(ETCD_LEASED_ROOT, key)
}

/// The record under `root` of etcd key `key` (a key under `/k/`: the record of the same
/// name), or of the end of the small-key space (the end of the records).
fn record_under(root: &str, key: &[u8]) -> Option<Vec<u8>> {
    if let Some(name) = key.strip_prefix(KV_ROOT.as_bytes()) {
        let mut record = root.as_bytes().to_vec();
        record.extend_from_slice(name);
        return Some(record);
    }
    (key == prefix_end(KV_ROOT.as_bytes())).then(|| prefix_end(root.as_bytes()))
}

/// Where a proxy records the identity that wrote a small key on no lease (a persistent
/// key): `/s/!owner/<key>`, its value the identity. Written in the same transaction as
/// the key, so its mod revision is the key's as long as the record is about that write;
/// readers take it only then, as they do a client lease record. What an identity's
/// persistent keys hold across the cell is counted from these records (the `stored_bytes`
/// limit), on every proxy, whichever proxy wrote them.
pub fn owner_root() -> &'static str {
    OWNER_ROOT
}

/// The owner record ([`owner_root`]) of etcd key `key`, or of the end of a range of etcd
/// keys, as [`etcd_leased_key`] maps keys to client lease records.
pub fn owner_key(key: &[u8]) -> Option<Vec<u8>> {
    record_under(OWNER_ROOT, key)
}

/// The small key's name an owner record is about, if `key` is one.
pub fn owner_name(key: &[u8]) -> Option<&str> {
    std::str::from_utf8(key).ok()?.strip_prefix(OWNER_ROOT)
}

/// The small key's name a client lease record is about, if `key` is one.
pub fn etcd_leased_name(key: &[u8]) -> Option<&str> {
    std::str::from_utf8(key)
        .ok()?
        .strip_prefix(ETCD_LEASED_ROOT)
}

/// The prefix of every hand-off record ([`etcd_lease_handoff_key`]).
pub fn etcd_lease_handoff_root() -> &'static str {
    "/s/!etcd-handoff/"
}

/// The prefix of every proxy's writer key.
pub fn writer_root() -> &'static str {
    WRITER_ROOT
}

/// Where `lockcell-cell` records what its small-key writes (a shard map move's copies
/// and clean-ups) were part of.
pub fn admin_writer_key() -> &'static str {
    "/sys/writer"
}

/// The prefix of every proxy's presence key.
pub fn proxy_presence_root() -> &'static str {
    PRESENCE_ROOT
}

/// The prefix of every fair-class waiter key (for the proxy's one watch).
pub fn queues_root() -> &'static str {
    QUEUES_ROOT
}

/// The prefix of the cell's own records (the epoch record, the shard map): written only
/// by `lockcell-cell`, read by everyone.
pub fn sys_root() -> &'static str {
    SYS_ROOT
}

/// The prefix of every small key.
pub fn kv_root() -> &'static str {
    KV_ROOT
}

/// The prefix of every session fence.
pub fn sessions_root() -> &'static str {
    SESSIONS_ROOT
}

/// The lock a key under `/l/` or `/q/` belongs to, and what the key is.
pub fn parse_key(key: &[u8]) -> Option<(LockName, KeyKind)> {
    let key = std::str::from_utf8(key).ok()?;
    let (rest, in_queue) = match key.strip_prefix(LOCKS_ROOT) {
        Some(rest) => (rest, false),
        None => (key.strip_prefix(QUEUES_ROOT)?, true),
    };
    let end = rest.find(MARK)?;
    let lock = LockName::parse(&rest[..end]).ok()?;
    let kind = match (in_queue, &rest[end + MARK.len()..]) {
        (true, _) => KeyKind::Waiter,
        (false, "x") => KeyKind::Exclusive,
        (false, "r") => KeyKind::Released,
        (false, tail) if tail.starts_with("s/") => KeyKind::Shared,
        _ => return None,
    };
    Some((lock, kind))
}

/// The lock a holder key belongs to, or `None` for a key that is not a holder key.
pub fn lock_of_key(key: &[u8]) -> Option<LockName> {
    match parse_key(key)? {
        (lock, KeyKind::Exclusive | KeyKind::Shared) => Some(lock),
        _ => None,
    }
}

/// The first key after every key that starts with `prefix`: the `range_end` of a
/// prefix range in etcd.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // A prefix of only 0xff bytes (or empty) ranges to the end of the key space.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_paths() {
        for ok in [
            "a",
            "billing/nightly-report",
            "jobs/sched:leader",
            "é/ü",
            "a b",
        ] {
            assert!(LockName::parse(ok).is_ok(), "{ok} should be accepted");
        }
    }

    #[test]
    fn refuses_each_rule_with_its_reason() {
        assert_eq!(LockName::parse(""), Err(NameError::Empty));
        let long = "a".repeat(MAX_NAME_BYTES + 1);
        assert!(matches!(
            LockName::parse(&long),
            Err(NameError::TooLong {
                len: 513,
                max: 512,
                ..
            })
        ));
        assert!(LockName::parse(&"a".repeat(MAX_NAME_BYTES)).is_ok());
        for bad in ["/a", "a/", "a//b"] {
            assert!(
                matches!(LockName::parse(bad), Err(NameError::EmptySegment { .. })),
                "{bad}"
            );
        }
        for bad in ["..", "a/../b", "./a", "a/."] {
            assert!(
                matches!(LockName::parse(bad), Err(NameError::DotSegment { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            LockName::parse("a\u{0}b"),
            Err(NameError::ControlChar { at: 1, .. })
        ));
        assert!(matches!(
            LockName::parse("a\nb"),
            Err(NameError::ControlChar { .. })
        ));
        assert!(matches!(
            LockName::parse("a/!x"),
            Err(NameError::Reserved { at: 2, .. })
        ));
        let msg = LockName::parse("a/../b").unwrap_err().to_string();
        assert!(msg.contains("a/../b") && msg.contains(".."), "{msg}");
        // A dot inside a segment is fine.
        assert!(LockName::parse("a/..b/c.d").is_ok());
    }

    #[test]
    fn nested_names_have_disjoint_holder_ranges() {
        let parent = LockName::parse("a").unwrap();
        let child = LockName::parse("a/x").unwrap();
        for key in [
            child.exclusive_key(),
            child.shared_key("s1"),
            child.released_key(),
        ] {
            assert!(!key.starts_with(&parent.keys_prefix()), "{key}");
        }
        assert!(!child
            .waiter_key(Mode::Exclusive, "s1")
            .starts_with(&parent.queue_prefix()));
        assert!(!parent.exclusive_key().starts_with(&child.keys_prefix()));
        assert_eq!(parent.exclusive_key(), "/l/a/!x");
        let (start, end) = parent.holders_range();
        let inside = |k: &str| k >= start.as_str() && k < end.as_str();
        assert!(inside(&parent.exclusive_key()) && inside(&parent.shared_key("s1")));
        assert!(
            !inside(&parent.released_key()),
            "the release marker is not a holder"
        );
        assert!(!inside(&child.exclusive_key()));
    }

    #[test]
    fn lock_of_key_inverts_the_builders() {
        let name = LockName::parse("svc/leader").unwrap();
        assert_eq!(
            lock_of_key(name.exclusive_key().as_bytes()),
            Some(name.clone())
        );
        assert_eq!(
            lock_of_key(name.shared_key("s1").as_bytes()),
            Some(name.clone())
        );
        assert_eq!(lock_of_key(name.released_key().as_bytes()), None);
        let waiter = name.waiter_key(Mode::Shared, "s1");
        assert_eq!(
            parse_key(waiter.as_bytes()),
            Some((name.clone(), KeyKind::Waiter))
        );
        assert_eq!(
            parse_key(name.released_key().as_bytes()),
            Some((name, KeyKind::Released))
        );
        assert_eq!(lock_of_key(b"/sys/epoch"), None);
        assert_eq!(lock_of_key(b"/l/no-marker"), None);
    }

    #[test]
    fn a_client_lease_record_maps_small_keys_and_their_ranges() {
        assert_eq!(
            etcd_leased_key(b"/k/a/b"),
            Some(b"/s/!etcd-leased/a/b".to_vec())
        );
        assert_eq!(etcd_leased_name(b"/s/!etcd-leased/a/b"), Some("a/b"));
        // The end of the small keys is the end of the records.
        let end = etcd_leased_key(&prefix_end(KV_ROOT.as_bytes())).unwrap();
        assert_eq!(end, prefix_end(ETCD_LEASED_ROOT.as_bytes()));
        assert_eq!(etcd_leased_key(b"/l/a/!x"), None);
        assert_eq!(owner_key(b"/k/a/b"), Some(b"/s/!owner/a/b".to_vec()));
        assert_eq!(owner_name(b"/s/!owner/a/b"), Some("a/b"));
        assert_eq!(
            owner_key(&prefix_end(KV_ROOT.as_bytes())).unwrap(),
            prefix_end(OWNER_ROOT.as_bytes())
        );
        assert_eq!(owner_key(b"/l/a/!x"), None);
        assert!(!value_names_proxy(b"/s/!owner/a/b"));
        // Only fences and claims name a proxy in their value.
        assert!(value_names_proxy(b"/s/6c63000000010002"));
        assert!(value_names_proxy(etcd_lease_claim_key(7).as_bytes()));
        for other in [
            &b"/s/!etcd-leased/a"[..],
            b"/s/!etcd-handoff/07",
            b"/s/!writer/p",
        ] {
            assert!(!value_names_proxy(other), "{other:?}");
        }
        assert_eq!(etcd_leased_name(b"/k/a"), None);
    }

    #[test]
    fn prefix_end_increments_last_byte() {
        assert_eq!(prefix_end(b"/l/a/!"), b"/l/a/\"".to_vec());
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(prefix_end(&[0xff]), vec![0]);
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// Names from the characters that matter to the rules (separators, dots, the
        /// reserved byte, a control character, non-ASCII), often enough to break each.
        fn name() -> impl Strategy<Value = String> {
            prop_oneof![
                proptest::collection::vec(
                    prop_oneof![
                        Just('a'),
                        Just('/'),
                        Just('.'),
                        Just('!'),
                        Just('\n'),
                        Just('é'),
                        Just('\u{7f}')
                    ],
                    0..12,
                )
                .prop_map(|c| c.into_iter().collect::<String>()),
                "\\PC{0,40}",
                "[a/]{500,520}",
            ]
        }

        proptest! {
            /// Whatever passes keeps every rule, and whatever keeps every rule passes.
            #[test]
            fn a_name_passes_exactly_when_it_keeps_every_rule(name in name()) {
                let keeps = !name.is_empty()
                    && name.len() <= MAX_NAME_BYTES
                    && !name.chars().any(char::is_control)
                    && !name.contains(RESERVED)
                    && name.split('/').all(|s| !s.is_empty() && s != "." && s != "..");
                prop_assert_eq!(LockName::parse(&name).is_ok(), keeps, "{:?}", name);
            }
        }
    }
}
