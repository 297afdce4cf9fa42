//! Access: the grants file (docs/security.md), which identities may lock, read, write and watch
//! which name prefixes, declared in a TOML file kept in Git (`--grants`, example in
//! deploy/config/grants.toml) and reloaded like the lock classes.
//!
//! A caller's identity is the subject common name of its TLS client certificate (the
//! proxy then runs with `--tls-client-ca`), or, where certificates are not set up (the
//! dev cell), a bearer token in the `authorization` metadata whose SHA-256 the file
//! lists. Without `--grants` every call is allowed, as before. The rules themselves
//! (the file, what an entry covers, tokens) are [`lockcell_cell::grants`], which the
//! audit tailer checks its queries against too.

use std::path::Path;

use tonic::{Request, Status};

use crate::declared::{Declared, FileError};
use crate::errors::ProxyError;
pub use lockcell_cell::grants::{Right, Rules};

/// The grants in force, or none (every call allowed). Immutable: a reload builds a new
/// one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AccessRules {
    rules: Rules,
    /// False when the proxy runs without `--grants`: everything is allowed.
    enforced: bool,
}

/// The grants in force: the last good grants file.
pub type AccessBook = crate::declared::Book<AccessRules>;

impl Declared for AccessRules {
    const WHAT: &'static str = "prefix grants";
    const RELOADS: &'static str = crate::metrics::GRANTS_RELOADS;
    const RELOAD_FAILURES: &'static str = crate::metrics::GRANTS_RELOAD_FAILURES;

    fn parse(text: &str, path: &Path) -> Result<Self, FileError> {
        let rules = Rules::parse(text).map_err(|e| FileError {
            file: path.to_owned(),
            line: e.line,
            message: e.message,
        })?;
        Ok(AccessRules {
            rules,
            enforced: true,
        })
    }

    fn count(&self) -> usize {
        self.rules.count()
    }
}

impl AccessRules {
    /// No grants file: every call is allowed.
    pub fn open() -> AccessRules {
        AccessRules::default()
    }

    /// Whether the proxy checks grants at all.
    pub fn enforced(&self) -> bool {
        self.enforced
    }

    /// What `identity` may have on this proxy at once (the file's `[[limit]]`s).
    pub fn quota(&self, identity: &str) -> lockcell_cell::grants::Quota {
        self.rules.quota(identity)
    }

    /// Whether the file names `identity` (its name may then label metrics).
    pub fn names(&self, identity: &str) -> bool {
        self.rules.names(identity)
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
                    ProxyError::Unauthenticated(
                        "the client certificate has no single UTF-8 subject common name, nor (without one) a single URI subject alternative name, to know it by".to_owned(),
                    )
                    .into()
                });
        }
        let bearer = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(lockcell_cell::access::bearer);
        match bearer {
            Some(token) => self
                .rules
                .identity_of_token(token)
                .map(str::to_owned)
                .map_err(|e| ProxyError::Unauthenticated(e.to_string()).into()),
            None => Err(ProxyError::Unauthenticated(
                "this proxy checks prefix grants: call with a TLS client certificate or a bearer token (authorization: Bearer TOKEN)".to_owned(),
            )
            .into()),
        }
    }

    /// The identity whose bearer token is `token`.
    pub fn identity_of_token(&self, token: &str) -> Result<String, Status> {
        self.rules
            .identity_of_token(token)
            .map(str::to_owned)
            .map_err(Status::unauthenticated)
    }

    /// Refuses `identity` `right` on `name` (a lock, election or key name) unless one
    /// of its grants, or a `*` grant, covers it.
    pub fn check(&self, identity: &str, right: Right, name: &str) -> Result<(), Status> {
        self.rules
            .check(identity, right, name)
            .map_err(Status::permission_denied)
    }

    /// As [`Self::check`] for a request on every name under `prefix` (a prefix Get or
    /// Watch): only `""` and entries ending in `/` cover a prefix.
    pub fn check_prefix(&self, identity: &str, right: Right, prefix: &str) -> Result<(), Status> {
        self.rules
            .check_prefix(identity, right, prefix)
            .map_err(Status::permission_denied)
    }

    /// Identifies the caller and checks `right` on `key`, or on every name under it when
    /// `prefix` is set.
    pub fn authorize_key<T>(
        &self,
        request: &Request<T>,
        right: Right,
        key: &str,
        prefix: bool,
    ) -> Result<Option<String>, Status> {
        if !self.enforced {
            return Ok(None);
        }
        let identity = self.identify(request)?;
        if prefix {
            self.check_prefix(&identity, right, key)?;
        } else {
            self.check(&identity, right, key)?;
        }
        Ok(Some(identity))
    }

    /// Identifies the caller and checks `right` on every name in `names`; returns who
    /// it is, as [`Self::caller`].
    pub fn authorize<T>(
        &self,
        request: &Request<T>,
        right: Right,
        names: &[&str],
    ) -> Result<Option<String>, Status> {
        if !self.enforced {
            return Ok(None);
        }
        let identity = self.identify(request)?;
        names
            .iter()
            .try_for_each(|name| self.check(&identity, right, name))?;
        Ok(Some(identity))
    }

    /// The caller's identity when the proxy checks grants, `None` when it does not.
    pub fn caller<T>(&self, request: &Request<T>) -> Result<Option<String>, Status> {
        if !self.enforced {
            return Ok(None);
        }
        self.identify(request).map(Some)
    }

    /// Identifies the caller and checks that it has one of `rights` on `name`; returns
    /// who it is, as [`Self::caller`].
    pub fn authorize_any<T>(
        &self,
        request: &Request<T>,
        rights: &[Right],
        name: &str,
    ) -> Result<Option<String>, Status> {
        if !self.enforced {
            return Ok(None);
        }
        let identity = self.identify(request)?;
        let mut refusal = None;
        for right in rights {
            match self.check(&identity, *right, name) {
                Ok(()) => return Ok(Some(identity)),
                Err(e) => refusal = Some(e),
            }
        }
        Err(refusal
            .unwrap_or_else(|| ProxyError::PermissionDenied("no right given".to_owned()).into()))
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
/// Without a common name, its one URI subject alternative name (a SPIFFE ID such as
/// `spiffe://example.org/ns/billing/sa/api`, as workload identity systems issue them).
fn certificate_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let mut names = cert.subject().iter_common_name();
    if let Some(first) = names.next() {
        let name = first.as_str().ok()?.to_owned();
        return names.next().is_none().then_some(name);
    }
    let alternatives = cert.subject_alternative_name().ok()??;
    let uris: Vec<&str> = alternatives
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::URI(uri) => Some(*uri),
            _ => None,
        })
        .collect();
    match uris[..] {
        [uri] => Some(uri.to_owned()),
        _ => None,
    }
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
sha256 = "22966485fdedde14118dd7c680b416c8a8f6f6947d44750491f69f41ac2ab956"
"#;

    fn grants(text: &str) -> Result<AccessRules, FileError> {
        AccessRules::parse(text, Path::new("grants.toml"))
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
        request.metadata_mut().insert(
            "authorization",
            "Bearer password-0123456789abcdef0123456789"
                .parse()
                .unwrap(),
        );
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
        let g = AccessRules::open();
        assert!(g
            .authorize(&Request::new(()), Right::Write, &["anything"])
            .is_ok());
    }

    #[test]
    fn a_certificate_is_known_by_its_common_name_or_else_its_one_uri_name() {
        use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};
        let der = |cn: Option<&str>, uris: &[&str]| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name = DistinguishedName::new();
            if let Some(cn) = cn {
                params.distinguished_name.push(DnType::CommonName, cn);
            }
            params.subject_alt_names = uris
                .iter()
                .map(|u| SanType::URI((*u).try_into().unwrap()))
                .collect();
            let key = KeyPair::generate().unwrap();
            params.self_signed(&key).unwrap().der().to_vec()
        };
        let spiffe = "spiffe://example.org/ns/billing/sa/api";
        assert_eq!(
            certificate_name(&der(Some("billing"), &[spiffe])).as_deref(),
            Some("billing")
        );
        assert_eq!(
            certificate_name(&der(None, &[spiffe])).as_deref(),
            Some(spiffe)
        );
        assert_eq!(
            certificate_name(&der(None, &[spiffe, "spiffe://example.org/other"])),
            None
        );
        assert_eq!(certificate_name(&der(None, &[])), None);
    }
}
