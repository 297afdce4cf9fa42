//! Prefix grants: which identities may lock, read, write and watch which names,
//! declared in a TOML file (`--grants`, example in deploy/config/grants.toml). The
//! proxies check every call against them, and the audit tailer every history query.
//!
//! An entry is `""` (every name), a prefix ending in `/` (every name under it) or one
//! whole name; never a bare beginning of names (`billing` does not cover `billingx/…`).
//! A `[[token]]` names a bearer token by its SHA-256; a token shorter than
//! [`MIN_TOKEN_LEN`] is never taken, so that guessing one offline from its hash is
//! hopeless.

use std::collections::HashMap;
use std::fmt;

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Shortest bearer token taken: shorter ones could be guessed from their hash.
pub const MIN_TOKEN_LEN: usize = 32;

/// What a grant allows on the names under its prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Right {
    /// Acquire, release and check locks; campaign, proclaim and resign in elections.
    Lock,
    /// Read small keys and election leaders.
    Read,
    /// Write and delete small keys (membership included).
    Write,
    /// Watch small keys and observe elections.
    Watch,
}

impl fmt::Display for Right {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Right::Lock => "lock",
            Right::Read => "read",
            Right::Write => "write",
            Right::Watch => "watch",
        })
    }
}

/// One `[[grant]]`: an identity (or `*`, any identified caller) and its prefixes.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    pub identity: String,
    #[serde(default)]
    pub lock: Vec<String>,
    #[serde(default)]
    pub read: Vec<String>,
    #[serde(default)]
    pub write: Vec<String>,
    #[serde(default)]
    pub watch: Vec<String>,
}

impl Grant {
    fn prefixes(&self, right: Right) -> &[String] {
        match right {
            Right::Lock => &self.lock,
            Right::Read => &self.read,
            Right::Write => &self.write,
            Right::Watch => &self.watch,
        }
    }
}

/// One `[[token]]`: a bearer token's SHA-256 (hex) and the identity it stands for.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Token {
    identity: String,
    sha256: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    grant: Vec<Grant>,
    #[serde(default)]
    token: Vec<Token>,
    #[serde(default)]
    limit: Vec<LimitEntry>,
}

/// One `[[limit]]`: what one identity (or `*`: every identity without an entry of its
/// own) may have on each proxy at once, and how fast it may call. A field left out
/// takes the `*` entry's value, then [`Quota::DEFAULT`]'s.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitEntry {
    identity: String,
    sessions: Option<u64>,
    keys: Option<u64>,
    bytes: Option<u64>,
    stored_bytes: Option<u64>,
    watches: Option<u64>,
    waiting: Option<u64>,
    requests_per_second: Option<u64>,
}

/// What one identity may have on one proxy at once, and how fast it may call it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Open sessions (lockcell sessions and etcd API leases).
    pub sessions: u64,
    /// Keys its sessions hold: lock holder and waiter keys, ephemeral keys.
    pub keys: u64,
    /// What those keys take in etcd, in bytes: each key's name and the value its
    /// session wrote.
    pub bytes: u64,
    /// What the small keys it wrote on no session (persistent keys, the last write of
    /// each its own) take in the whole cell, in bytes: each key's name and value and 128
    /// bytes for keeping it (`--max-kv-total-bytes` counts them so too). Counted from
    /// every proxy's copy of the keys, so it bounds the identity across the cell.
    pub stored_bytes: u64,
    /// Open watches (each watch of an etcd API Watch stream counts).
    pub watches: u64,
    /// Acquires and campaigns in progress (waiting for their turn, or trying).
    pub waiting: u64,
    /// Calls a second, with a burst of as many; keepalives and the calls that end
    /// something (release, close, resign, revoke) are never counted nor refused.
    pub requests_per_second: u64,
}

impl Quota {
    /// The limits of an identity the file says nothing about: sized so that one
    /// identity may be a whole zone's fleet on one proxy, and no more.
    pub const DEFAULT: Quota = Quota {
        sessions: 50_000,
        keys: 250_000,
        bytes: 64 * 1024 * 1024,
        stored_bytes: 32 * 1024 * 1024,
        watches: 100_000,
        waiting: 50_000,
        requests_per_second: 20_000,
    };

    /// The limit named `limit`.
    pub fn of(&self, limit: Limit) -> u64 {
        match limit {
            Limit::Sessions => self.sessions,
            Limit::Keys => self.keys,
            Limit::Bytes => self.bytes,
            Limit::Stored => self.stored_bytes,
            Limit::Watches => self.watches,
            Limit::Waiting => self.waiting,
            Limit::Rate => self.requests_per_second,
        }
    }

    /// This quota with the fields `entry` sets.
    fn with(mut self, entry: &LimitEntry) -> Quota {
        let set = |field: &mut u64, value: Option<u64>| {
            if let Some(v) = value {
                *field = v;
            }
        };
        set(&mut self.sessions, entry.sessions);
        set(&mut self.keys, entry.keys);
        set(&mut self.bytes, entry.bytes);
        set(&mut self.stored_bytes, entry.stored_bytes);
        set(&mut self.watches, entry.watches);
        set(&mut self.waiting, entry.waiting);
        set(&mut self.requests_per_second, entry.requests_per_second);
        self
    }
}

/// One of the limits of a [`Quota`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    Sessions,
    Keys,
    Bytes,
    Stored,
    Watches,
    Waiting,
    Rate,
}

impl Limit {
    pub const ALL: [Limit; 7] = [
        Limit::Sessions,
        Limit::Keys,
        Limit::Bytes,
        Limit::Stored,
        Limit::Watches,
        Limit::Waiting,
        Limit::Rate,
    ];

    /// Its name in the grants file (and in metrics).
    pub fn field(self) -> &'static str {
        match self {
            Limit::Sessions => "sessions",
            Limit::Keys => "keys",
            Limit::Bytes => "bytes",
            Limit::Stored => "stored_bytes",
            Limit::Watches => "watches",
            Limit::Waiting => "waiting",
            Limit::Rate => "requests_per_second",
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::Sessions => "open sessions",
            Limit::Keys => "keys held",
            Limit::Bytes => "bytes of keys held",
            Limit::Stored => "bytes of persistent keys written",
            Limit::Watches => "open watches",
            Limit::Waiting => "acquires in progress",
            Limit::Rate => "calls a second",
        })
    }
}

/// Why a grants file was refused: the rule it broke, and the line when known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesError {
    pub line: Option<usize>,
    pub message: String,
}

/// A validated grants file. Immutable: a reload builds a new one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rules {
    grants: Vec<Grant>,
    /// Token hash (lowercase hex) → identity.
    tokens: HashMap<String, String>,
    /// The quota of every identity without a `[[limit]]` of its own.
    default_quota: Option<Quota>,
    /// The identities with a `[[limit]]` of their own, and their quotas.
    quotas: HashMap<String, Quota>,
}

impl Rules {
    /// Parses and checks a grants file's text.
    pub fn parse(text: &str) -> Result<Rules, RulesError> {
        let error = |line: Option<usize>, message: String| RulesError { line, message };
        let file: File = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|span| text[..span.start].matches('\n').count() + 1);
            error(line, e.message().to_owned())
        })?;
        if file.grant.is_empty() {
            return Err(error(
                None,
                "the file has no [[grant]]: every caller would be refused (a half-written or emptied file?); say who may do what".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for grant in &file.grant {
            let who = &grant.identity;
            if who.is_empty() {
                return Err(error(
                    None,
                    "a [[grant]] has an empty identity (use \"*\" for every identified caller)"
                        .into(),
                ));
            }
            if !seen.insert(who.clone()) {
                return Err(error(
                    None,
                    format!("identity {who:?} has two [[grant]] entries; merge them"),
                ));
            }
            for right in [Right::Lock, Right::Read, Right::Write, Right::Watch] {
                for prefix in grant.prefixes(right) {
                    check_prefix(prefix).map_err(|why| {
                        error(
                            None,
                            format!("grant of {who:?}: {right} prefix {prefix:?} {why}"),
                        )
                    })?;
                }
            }
        }
        let mut tokens = HashMap::new();
        for token in &file.token {
            let hash = token.sha256.to_ascii_lowercase();
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(error(None, format!("token of {:?}: sha256 must be 64 hex digits (the SHA-256 of the token, e.g. `printf %s TOKEN | sha256sum`)", token.identity)));
            }
            if tokens.insert(hash, token.identity.clone()).is_some() {
                return Err(error(
                    None,
                    format!(
                        "token of {:?}: the same token is listed twice",
                        token.identity
                    ),
                ));
            }
        }
        let (default_quota, quotas) = quotas(&file.limit).map_err(|m| error(None, m))?;
        Ok(Rules {
            grants: file.grant,
            tokens,
            default_quota: Some(default_quota),
            quotas,
        })
    }

    /// What `identity` may have on each proxy at once (`[[limit]]`).
    pub fn quota(&self, identity: &str) -> Quota {
        self.quotas
            .get(identity)
            .copied()
            .or(self.default_quota)
            .unwrap_or(Quota::DEFAULT)
    }

    /// Whether the file names `identity` (a grant, a token or a limit of its own): its
    /// name may label metrics. Any other caller is counted as `*`.
    pub fn names(&self, identity: &str) -> bool {
        self.quotas.contains_key(identity)
            || self.grants.iter().any(|g| g.identity == identity)
            || self.tokens.values().any(|i| i == identity)
    }

    /// How many grants and tokens the file lists.
    pub fn count(&self) -> usize {
        self.grants.len() + self.tokens.len()
    }

    /// The identity a bearer token stands for; `Err` says why none.
    pub fn identity_of_token(&self, token: &str) -> Result<&str, &'static str> {
        if token.len() < MIN_TOKEN_LEN {
            return Err("the bearer token is too short to be safe (at least 32 characters)");
        }
        let hash = hex(&Sha256::digest(token.as_bytes()));
        self.tokens
            .get(&hash)
            .map(String::as_str)
            .ok_or("the bearer token is not one the grants file lists")
    }

    /// Refuses `identity` `right` on `name` (a lock, election or key name) unless one
    /// of its grants, or a `*` grant, covers it; the refusal names the identity, the
    /// right, the name and the entries it holds.
    pub fn check(&self, identity: &str, right: Right, name: &str) -> Result<(), String> {
        self.check_by(identity, right, name, covers)
    }

    /// As [`Self::check`] for a request on every name under `prefix` (a prefix read or
    /// watch): only `""` and entries ending in `/` cover a prefix.
    pub fn check_prefix(&self, identity: &str, right: Right, prefix: &str) -> Result<(), String> {
        self.check_by(identity, right, prefix, covers_prefix)
    }

    fn check_by(
        &self,
        identity: &str,
        right: Right,
        name: &str,
        covered: fn(&str, &str) -> bool,
    ) -> Result<(), String> {
        let covering = self
            .grants
            .iter()
            .filter(|g| g.identity == identity || g.identity == "*");
        let mut held: Vec<&str> = Vec::new();
        for grant in covering {
            for prefix in grant.prefixes(right) {
                if covered(prefix, name) {
                    return Ok(());
                }
                held.push(prefix);
            }
        }
        Err(format!(
            "{identity:?} may not {right} {name:?}: no grant covers it (its {right} prefixes: {held:?})"
        ))
    }
}

/// Whether a grant's entry covers `name`: `""` covers every name, an entry ending in
/// `/` every name under it, and any other entry that one name alone. An entry is never
/// a bare beginning of a name: `billing` must not cover `billingx/…`.
pub fn covers(entry: &str, name: &str) -> bool {
    entry.is_empty() || name == entry || (entry.ends_with('/') && name.starts_with(entry))
}

/// Whether a grant's entry covers every name under `prefix`.
pub fn covers_prefix(entry: &str, prefix: &str) -> bool {
    entry.is_empty() || (entry.ends_with('/') && prefix.starts_with(entry))
}

/// A grant entry is `""`, a prefix ending in `/`, or one whole name: no control
/// characters, no `!`, no `..` segment.
fn check_prefix(prefix: &str) -> Result<(), &'static str> {
    if prefix.starts_with('/') || prefix.contains("//") {
        return Err("starts with '/' or has an empty segment; names start with their first segment (\"billing/\", not \"/billing/\")");
    }
    if prefix.chars().any(char::is_control) {
        return Err("contains a control character");
    }
    if prefix.contains(crate::keyspace::RESERVED) {
        return Err("contains '!', which no name may contain");
    }
    if prefix.split('/').any(|s| s == ".." || s == ".") {
        return Err("has a '.' or '..' segment");
    }
    Ok(())
}

/// The `*` quota and each identity's own, from the `[[limit]]` entries.
fn quotas(entries: &[LimitEntry]) -> Result<(Quota, HashMap<String, Quota>), String> {
    let mut seen = std::collections::HashSet::new();
    for entry in entries {
        let who = &entry.identity;
        if who.is_empty() {
            return Err(
                "a [[limit]] has an empty identity (use \"*\" for the defaults of every identity)"
                    .into(),
            );
        }
        if !seen.insert(who.clone()) {
            return Err(format!(
                "identity {who:?} has two [[limit]] entries; merge them"
            ));
        }
        let fields = [
            ("sessions", entry.sessions),
            ("keys", entry.keys),
            ("bytes", entry.bytes),
            ("stored_bytes", entry.stored_bytes),
            ("watches", entry.watches),
            ("waiting", entry.waiting),
            ("requests_per_second", entry.requests_per_second),
        ];
        for (field, value) in fields {
            if value == Some(0) {
                return Err(format!(
                    "limit of {who:?}: {field} = 0 would refuse every call; to keep an identity out, give it no grant"
                ));
            }
        }
    }
    let default = entries
        .iter()
        .find(|e| e.identity == "*")
        .map_or(Quota::DEFAULT, |e| Quota::DEFAULT.with(e));
    let own = entries
        .iter()
        .filter(|e| e.identity != "*")
        .map(|e| (e.identity.clone(), default.with(e)))
        .collect();
    Ok((default, own))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_everything_a_subtree_or_one_name_never_a_bare_beginning() {
        assert!(covers("", "anything/at/all"));
        assert!(covers("billing/", "billing/nightly"));
        assert!(covers("billing/", "billing/"));
        assert!(!covers("billing/", "billingx/nightly"));
        assert!(covers("billing", "billing"));
        assert!(!covers("billing", "billingx/nightly"));
        assert!(!covers("billing", "billing/nightly"));
        assert!(!covers("cfg/db", "cfg/db2"));
        // A prefix read or watch is covered by a subtree only.
        assert!(covers_prefix("cfg/", "cfg/app/"));
        assert!(covers_prefix("", "cfg"));
        assert!(!covers_prefix("cfg/db", "cfg/db"));
        assert!(!covers_prefix("cfg/", "cf"));
    }

    #[test]
    fn an_identitys_limits_override_the_defaults_field_by_field() {
        let file = "[[grant]]\nidentity = \"*\"\nlock = [\"\"]\n\
                    [[limit]]\nidentity = \"*\"\nsessions = 100\nwatches = 7\n\
                    [[limit]]\nidentity = \"batch\"\nsessions = 3\nbytes = 4096\n";
        let rules = Rules::parse(file).unwrap();
        let batch = rules.quota("batch");
        assert_eq!(batch.sessions, 3);
        assert_eq!(batch.of(Limit::Bytes), 4096);
        assert_eq!(batch.watches, 7, "a field batch leaves out comes from *");
        assert_eq!(
            batch.keys,
            Quota::DEFAULT.keys,
            "then from the built-in default"
        );
        assert_eq!(rules.quota("other").sessions, 100);
        assert!(rules.names("batch"));
        assert!(!rules.names("other"));
        let none = Rules::parse("[[grant]]\nidentity = \"a\"\nlock = [\"\"]\n").unwrap();
        assert_eq!(none.quota("a"), Quota::DEFAULT);
    }

    #[test]
    fn a_limit_that_refuses_everything_or_twice_given_is_refused() {
        let grant = "[[grant]]\nidentity = \"a\"\nlock = [\"\"]\n";
        let zero = format!("{grant}[[limit]]\nidentity = \"a\"\nkeys = 0\n");
        let e = Rules::parse(&zero).unwrap_err();
        assert!(e.message.contains("keys = 0"), "{}", e.message);
        let twice = format!("{grant}[[limit]]\nidentity = \"a\"\n[[limit]]\nidentity = \"a\"\n");
        assert!(Rules::parse(&twice)
            .unwrap_err()
            .message
            .contains("two [[limit]]"));
        let unknown = format!("{grant}[[limit]]\nidentity = \"a\"\nsesions = 1\n");
        assert!(
            Rules::parse(&unknown).is_err(),
            "a misspelt limit is an error, not ignored"
        );
    }

    #[test]
    fn a_token_too_short_to_be_safe_is_never_taken() {
        let short = "password";
        let file = format!(
            "[[grant]]\nidentity = \"a\"\nlock = [\"\"]\n[[token]]\nidentity = \"a\"\nsha256 = \"{}\"\n",
            hex(&Sha256::digest(short.as_bytes()))
        );
        let rules = Rules::parse(&file).unwrap();
        assert!(rules
            .identity_of_token(short)
            .unwrap_err()
            .contains("too short"));
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// Names and entries from a small alphabet, so that near misses are common:
        /// shared beginnings, slashes in every place, and some non-ASCII letters.
        fn text() -> impl Strategy<Value = String> {
            proptest::collection::vec(
                prop_oneof![Just('a'), Just('b'), Just('/'), Just('é'), Just('x')],
                0..8,
            )
            .prop_map(|chars| chars.into_iter().collect())
        }

        proptest! {
            /// An entry covers a name only if the name is the entry, lies under it
            /// (the entry ends in '/'), or the entry is empty: never because the name
            /// merely begins with it.
            #[test]
            fn covering_never_crosses_a_segment(entry in text(), name in text()) {
                if covers(&entry, &name) && !entry.is_empty() && !entry.ends_with('/') {
                    prop_assert_eq!(&name, &entry);
                }
                if covers(&entry, &name) && entry.ends_with('/') {
                    prop_assert!(name.starts_with(&entry));
                }
            }

            /// Whatever a prefix request covers, each name under it is covered by the
            /// same entry: a prefix read never reaches a name the entry does not grant.
            #[test]
            fn a_covered_prefix_covers_only_covered_names(entry in text(), prefix in text(), rest in text()) {
                if covers_prefix(&entry, &prefix) {
                    let name = format!("{prefix}{rest}");
                    prop_assert!(covers(&entry, &name), "{:?} under {:?}", name, entry);
                }
            }

            /// A check by one identity never passes on another identity's grant, nor
            /// for another right.
            #[test]
            fn a_grant_serves_its_identity_and_right_only(name in text(), who in "[a-z]{1,4}") {
                let rules = Rules::parse("[[grant]]\nidentity = \"owner\"\nlock = [\"\"]\n").unwrap();
                if who != "owner" {
                    prop_assert!(rules.check(&who, Right::Lock, &name).is_err());
                }
                prop_assert!(rules.check("owner", Right::Lock, &name).is_ok());
                prop_assert!(rules.check("owner", Right::Read, &name).is_err());
            }

            /// Any unicode name is refused by a grant that does not cover it.
            #[test]
            fn an_uncovered_unicode_name_is_refused(name in "\\PC{0,30}") {
                let rules = Rules::parse("[[grant]]\nidentity = \"a\"\nread = [\"cfg/\", \"one\"]\n").unwrap();
                let covered = name.starts_with("cfg/") || name == "one";
                prop_assert_eq!(rules.check("a", Right::Read, &name).is_ok(), covered);
            }
        }
    }
}
