//! Prefix grants (DESIGN.md section 9): which identities may lock, read, write and watch
//! which name prefixes, declared in a TOML file kept in Git (`--grants`, example in
//! deploy/config/grants.toml) and reloaded like the lock classes.
//!
//! A caller's identity is the subject common name of its TLS client certificate (the
//! proxy then runs with `--tls-client-ca`), or, where certificates are not set up (the
//! dev cell), a bearer token in the `authorization` metadata whose SHA-256 the file
//! lists. Without `--grants` every call is allowed, as before.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::{Request, Status};

use crate::declared::{Declared, FileError};

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
}

/// A validated grants file. Immutable: a reload builds a new one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Grants {
    grants: Vec<Grant>,
    /// Token hash (lowercase hex) → identity.
    tokens: HashMap<String, String>,
    /// False when the proxy runs without `--grants`: everything is allowed.
    enforced: bool,
}

/// The grants in force: the last good grants file.
pub type GrantBook = crate::declared::Book<Grants>;

impl Declared for Grants {
    const WHAT: &'static str = "prefix grants";
    const RELOADS: &'static str = crate::metrics::GRANTS_RELOADS;
    const RELOAD_FAILURES: &'static str = crate::metrics::GRANTS_RELOAD_FAILURES;

    fn parse(text: &str, path: &Path) -> Result<Self, FileError> {
        let error = |line: Option<usize>, message: String| FileError {
            file: path.to_owned(),
            line,
            message,
        };
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
        Ok(Grants {
            grants: file.grant,
            tokens,
            enforced: true,
        })
    }

    fn count(&self) -> usize {
        self.grants.len() + self.tokens.len()
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
    if prefix.contains(lockcell_cell::keyspace::RESERVED) {
        return Err("contains '!', which no name may contain");
    }
    if prefix.split('/').any(|s| s == ".." || s == ".") {
        return Err("has a '.' or '..' segment");
    }
    Ok(())
}

impl Grants {
    /// No grants file: every call is allowed.
    pub fn open() -> Grants {
        Grants::default()
    }

    /// Whether the proxy checks grants at all.
    pub fn enforced(&self) -> bool {
        self.enforced
    }

    /// Who is calling: the TLS client certificate's common name, else the identity of
    /// a known bearer token.
    pub fn identify<T>(&self, request: &Request<T>) -> Result<String, Status> {
        // A client that sent a certificate is known by it, or not at all.
        if let Some(certs) = request.peer_certs() {
            return certs
                .first()
                .and_then(|cert| certificate_name(cert.as_ref()))
                .ok_or_else(|| {
                    Status::unauthenticated(
                        "the client certificate has no single UTF-8 subject common name to know it by",
                    )
                });
        }
        let bearer = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(token)
            });
        match bearer {
            Some(token) => {
                let hash = hex(&Sha256::digest(token.as_bytes()));
                self.tokens.get(&hash).cloned().ok_or_else(|| {
                    Status::unauthenticated("the bearer token is not one the proxy's grants file lists")
                })
            }
            None => Err(Status::unauthenticated(
                "this proxy checks prefix grants: call with a TLS client certificate or a bearer token (authorization: Bearer TOKEN)",
            )),
        }
    }

    /// Refuses `identity` `right` on `name` (a lock, election or key name, or a prefix
    /// being read or watched) unless one of its grants, or a `*` grant, covers it.
    pub fn check(&self, identity: &str, right: Right, name: &str) -> Result<(), Status> {
        self.check_by(identity, right, name, covers)
    }

    /// As [`Self::check`] for a request on every name under `prefix` (a prefix Get or
    /// Watch): only `""` and entries ending in `/` cover a prefix.
    pub fn check_prefix(&self, identity: &str, right: Right, prefix: &str) -> Result<(), Status> {
        self.check_by(identity, right, prefix, covers_prefix)
    }

    /// Identifies the caller and checks `right` on `key`, or on every name under it when
    /// `prefix` is set.
    pub fn authorize_key<T>(
        &self,
        request: &Request<T>,
        right: Right,
        key: &str,
        prefix: bool,
    ) -> Result<(), Status> {
        if !self.enforced {
            return Ok(());
        }
        let identity = self.identify(request)?;
        if prefix {
            self.check_prefix(&identity, right, key)
        } else {
            self.check(&identity, right, key)
        }
    }

    fn check_by(
        &self,
        identity: &str,
        right: Right,
        name: &str,
        covered: fn(&str, &str) -> bool,
    ) -> Result<(), Status> {
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
        Err(Status::permission_denied(format!(
            "{identity:?} may not {right} {name:?}: no grant covers it (its {right} prefixes: {held:?})"
        )))
    }

    /// Identifies the caller and checks `right` on every name in `names`.
    pub fn authorize<T>(
        &self,
        request: &Request<T>,
        right: Right,
        names: &[&str],
    ) -> Result<(), Status> {
        if !self.enforced {
            return Ok(());
        }
        let identity = self.identify(request)?;
        names
            .iter()
            .try_for_each(|name| self.check(&identity, right, name))
    }

    /// The caller's identity when the proxy checks grants, `None` when it does not.
    pub fn caller<T>(&self, request: &Request<T>) -> Result<Option<String>, Status> {
        if !self.enforced {
            return Ok(None);
        }
        self.identify(request).map(Some)
    }

    /// Identifies the caller and checks that it has one of `rights` on `name`.
    pub fn authorize_any<T>(
        &self,
        request: &Request<T>,
        rights: &[Right],
        name: &str,
    ) -> Result<(), Status> {
        if !self.enforced {
            return Ok(());
        }
        let identity = self.identify(request)?;
        let mut refusal = None;
        for right in rights {
            match self.check(&identity, *right, name) {
                Ok(()) => return Ok(()),
                Err(e) => refusal = Some(e),
            }
        }
        Err(refusal.unwrap_or_else(|| Status::permission_denied("no right given")))
    }

    /// Identifies the caller of a call that names nothing (sessions): any identified
    /// caller may.
    pub fn authenticate<T>(&self, request: &Request<T>) -> Result<(), Status> {
        if !self.enforced {
            return Ok(());
        }
        self.identify(request).map(drop)
    }
}

/// The subject common name of a client certificate (DER), when it has exactly one.
fn certificate_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let mut names = cert.subject().iter_common_name();
    let name = names.next()?.as_str().ok()?.to_owned();
    names.next().is_none().then_some(name)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[[grant]]
identity = "billing"
lock = ["billing/"]
read = ["billing/", "config/"]
write = ["billing/"]
watch = ["config/"]

[[grant]]
identity = "*"
read = ["public/"]

[[token]]
identity = "dev"
sha256 = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"
"#;

    fn grants(text: &str) -> Result<Grants, FileError> {
        Grants::parse(text, Path::new("grants.toml"))
    }

    #[test]
    fn a_grant_covers_names_under_its_prefixes_for_its_rights_only() {
        let g = grants(FILE).unwrap();
        assert!(g.check("billing", Right::Lock, "billing/nightly").is_ok());
        assert!(g.check("billing", Right::Read, "config/flags").is_ok());
        assert!(
            g.check("billing", Right::Read, "public/motd").is_ok(),
            "* grants apply to all"
        );
        let refused = g
            .check("billing", Right::Write, "config/flags")
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("config/flags") && refused.message().contains("write"));
        assert!(g.check("billing", Right::Lock, "billingx").is_err());
        assert!(g.check("other", Right::Lock, "billing/nightly").is_err());
        assert!(g.check("other", Right::Read, "public/x").is_ok());
    }

    #[test]
    fn tokens_are_known_by_their_hash() {
        let g = grants(FILE).unwrap();
        let mut request = Request::new(());
        request
            .metadata_mut()
            .insert("authorization", "Bearer password".parse().unwrap());
        assert_eq!(g.identify(&request).unwrap(), "dev");
        request
            .metadata_mut()
            .insert("authorization", "Bearer wrong".parse().unwrap());
        assert_eq!(
            g.identify(&request).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            g.identify(&Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }

    #[test]
    fn bad_files_are_refused_by_rule() {
        let two = "[[grant]]\nidentity = \"a\"\n[[grant]]\nidentity = \"a\"\n";
        assert!(grants(two).unwrap_err().message.contains("two [[grant]]"));
        let bang = "[[grant]]\nidentity = \"a\"\nlock = [\"x!\"]\n";
        assert!(grants(bang).unwrap_err().message.contains("'!'"));
        let hash = "[[grant]]\nidentity = \"a\"\n[[token]]\nidentity = \"a\"\nsha256 = \"abc\"\n";
        assert!(grants(hash).unwrap_err().message.contains("64 hex"));
        assert!(grants("").unwrap_err().message.contains("no [[grant]]"));
        let slash = "[[grant]]\nidentity = \"a\"\nread = [\"/billing/\"]\n";
        assert!(grants(slash)
            .unwrap_err()
            .message
            .contains("starts with '/'"));
        let field = "[[grant]]\nidentity = \"a\"\nadmin = [\"\"]\n";
        assert!(grants(field).unwrap_err().line == Some(3));
    }

    #[test]
    fn the_example_file_parses() {
        let text = include_str!("../../deploy/config/grants.toml");
        let g = grants(text).unwrap();
        assert!(g
            .check("billing-api", Right::Lock, "billing/nightly")
            .is_ok());
        assert!(g
            .check("anyone", Right::Write, "members/web/host-1")
            .is_ok());
    }

    #[test]
    fn without_a_file_everything_is_allowed() {
        let g = Grants::open();
        assert!(g
            .authorize(&Request::new(()), Right::Write, &["anything"])
            .is_ok());
    }

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

    mod properties {
        use super::grants;
        use crate::grants::{covers, covers_prefix, Right};
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
                if covers(&entry, &name) {
                    prop_assert!(
                        entry.is_empty()
                            || name == entry
                            || (entry.ends_with('/') && name.starts_with(&entry))
                    );
                    if !entry.is_empty() && !entry.ends_with('/') {
                        prop_assert_eq!(&name, &entry);
                    }
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

            /// A check by one identity never passes on another identity's grant.
            #[test]
            fn a_grant_serves_its_identity_only(name in text(), who in "[a-z]{1,4}") {
                let g = grants("[[grant]]\nidentity = \"owner\"\nlock = [\"\"]\n").unwrap();
                if who != "owner" {
                    prop_assert!(g.check(&who, Right::Lock, &name).is_err());
                }
                prop_assert!(g.check("owner", Right::Lock, &name).is_ok());
                prop_assert!(g.check("owner", Right::Read, &name).is_err());
            }
        }
    }
}
