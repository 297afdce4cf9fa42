//! Session credentials: what proves a call on a session comes from the session's opener.
//!
//! A session id is public: Leader shows it, holder records and the audit trail carry
//! it. So Open also hands out a secret, and the id is derived from the secret and the
//! opener's identity (when the proxy checks grants). A call naming the session presents
//! the secret; any proxy, in any cell, checks it by deriving the id again, with no
//! state shared between proxies: a proxy that never saw the session checks a Resume as
//! surely as the one that opened it. Another identity holding the secret still fails
//! (the identity is part of the derivation), and the id alone, or a guessed one,
//! proves nothing.

use std::collections::HashMap;

use lockcell_cell::grants::hex;
use sha2::{Digest, Sha256};

use crate::errors::ProxyError;

/// Bytes of randomness in a secret (hex-encoded on the wire).
const SECRET_BYTES: usize = 32;

/// Hex digits of a derived session id (128 bits).
const ID_DIGITS: usize = 32;

/// Separates the derivation from any other use of SHA-256 over the same bytes.
const DOMAIN: &[u8] = b"lockcell session id v1\0";

/// A new session's secret and the id it derives for `principal`.
pub fn new_session(principal: Option<&str>) -> (String, String) {
    let secret = hex(&rand::random::<[u8; SECRET_BYTES]>());
    let id = derive(&secret, principal);
    (id, secret)
}

/// The session id `secret` derives for `principal` (the caller's identity, when the
/// proxy checks grants).
pub fn derive(secret: &str, principal: Option<&str>) -> String {
    hex(&digest(secret, principal))
}

/// The bytes of the id `secret` derives for `principal`.
fn digest(secret: &str, principal: Option<&str>) -> [u8; ID_DIGITS / 2] {
    let mut digest = Sha256::new();
    digest.update(DOMAIN);
    digest.update(principal.unwrap_or("").as_bytes());
    digest.update(b"\0");
    digest.update(secret.as_bytes());
    let full = digest.finalize();
    let mut id = [0; ID_DIGITS / 2];
    id.copy_from_slice(&full[..ID_DIGITS / 2]);
    id
}

/// The bytes a session id's hex digits spell, if it is one a proxy hands out.
fn id_bytes(id: &str) -> Option<[u8; ID_DIGITS / 2]> {
    let digits = id.as_bytes();
    if digits.len() != ID_DIGITS {
        return None;
    }
    let value = |d: u8| (d as char).to_digit(16).map(|v| v as u8);
    let mut bytes = [0; ID_DIGITS / 2];
    for (byte, pair) in bytes.iter_mut().zip(digits.chunks(2)) {
        *byte = value(pair[0])? << 4 | value(pair[1])?;
    }
    Some(bytes)
}

/// Whether `secret` proves that session `id` is `principal`'s, as a refusal that names
/// the session (never the secret): PERMISSION_DENIED, since the caller may be anyone.
pub fn check(id: &str, secret: &str, principal: Option<&str>) -> Result<(), tonic::Status> {
    if secret.is_empty() {
        return Err(ProxyError::PermissionDenied(format!(
            "a call on session {id:?} must carry the session_secret its Open returned"
        ))
        .into());
    }
    // A secret far longer than any Open hands out is refused before it is hashed; the
    // rest are compared as bytes (every renewal is checked: no text is made for it).
    let proven =
        || id_bytes(id).is_some_and(|id| constant_time_eq(&digest(secret, principal), &id));
    if secret.len() > 2 * SECRET_BYTES || !proven() {
        return Err(ProxyError::PermissionDenied(format!(
            "session {id:?} was not opened with this session_secret{}: only its opener may use it",
            match principal {
                Some(p) => format!(" by {p:?}"),
                None => String::new(),
            }
        ))
        .into());
    }
    Ok(())
}

/// The sessions one keepalive stream has proven its own (its caller is the same for
/// its whole life), so that each renewal after the first compares its secret with the
/// one proven instead of deriving the id again.
#[derive(Default)]
pub struct Proven(HashMap<String, String>);

impl Proven {
    /// Most sessions remembered per stream (about 1.5 MB); past it the stream starts
    /// afresh. The SDK renews all of a client's sessions on one stream.
    const MOST: usize = 10_000;

    /// [`check`], remembering what passed.
    pub fn check(
        &mut self,
        id: &str,
        secret: &str,
        principal: Option<&str>,
    ) -> Result<(), tonic::Status> {
        let known = self.0.get(id);
        if known.is_some_and(|known| constant_time_eq(known.as_bytes(), secret.as_bytes())) {
            return Ok(());
        }
        check(id, secret, principal)?;
        if self.0.len() >= Self::MOST {
            self.0.clear();
        }
        self.0.insert(id.to_owned(), secret.to_owned());
        Ok(())
    }
}

/// Compares without stopping at the first difference, so a timing does not tell how
/// much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Longest label a client may give its session (`identity` in Open and Resume).
pub const MAX_LABEL_BYTES: usize = 128;

/// Checks a session's label: it is recorded with every grant, in etcd and the audit
/// trail, so it is short and printable (no control characters, which would forge
/// lines in a log).
pub fn check_label(label: &str) -> Result<(), ProxyError> {
    if label.len() > MAX_LABEL_BYTES {
        return Err(ProxyError::BadArgument(format!(
            "the session's identity label is {} bytes, over the limit of {MAX_LABEL_BYTES}",
            label.len()
        )));
    }
    if let Some(c) = label.chars().find(|c| c.is_control()) {
        return Err(ProxyError::BadArgument(format!(
            "the session's identity label {label:?} holds the control character {c:?}; \
             it must be printable"
        )));
    }
    Ok(())
}

/// The identity recorded with a session's grants: the authenticated identity when the
/// proxy checks grants (the client's own label after it in brackets), else the label.
pub fn labelled(principal: Option<&str>, label: String) -> String {
    match principal {
        Some(p) if label.is_empty() => p.to_owned(),
        Some(p) => format!("{p} ({label})"),
        None => label,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_proves_the_id_for_its_opener_only() {
        let (id, secret) = new_session(Some("alice"));
        assert_eq!(id.len(), ID_DIGITS);
        assert_eq!(secret.len(), 2 * SECRET_BYTES);
        check(&id, &secret, Some("alice")).unwrap();
        let e = check(&id, &secret, Some("mallory")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains(&id) && e.message().contains("mallory"),
            "{e}"
        );
        assert!(!e.message().contains(&secret), "{e}");
        assert!(check(&id, "", Some("alice")).is_err());
        assert!(check(&id, &secret[1..], Some("alice")).is_err());
        assert!(check(&id, &format!("{secret}{secret}0"), Some("alice")).is_err());
        let (other, _) = new_session(Some("alice"));
        assert!(check(&other, &secret, Some("alice")).is_err());
    }

    #[test]
    fn a_stream_remembers_what_it_proved_and_nothing_else() {
        let (id, secret) = new_session(Some("alice"));
        let mut proven = Proven::default();
        assert!(proven.check(&id, "wrong", Some("alice")).is_err());
        proven.check(&id, &secret, Some("alice")).unwrap();
        proven.check(&id, &secret, Some("alice")).unwrap();
        assert!(proven.check(&id, "wrong", Some("alice")).is_err());
        assert!(proven.check(&id, &secret[1..], Some("alice")).is_err());
        let (other, _) = new_session(Some("alice"));
        assert!(proven.check(&other, &secret, Some("alice")).is_err());
    }

    #[test]
    fn without_grants_the_secret_alone_proves_the_id() {
        let (id, secret) = new_session(None);
        check(&id, &secret, None).unwrap();
        // Opened without an identity, it is no identity's once grants are checked.
        assert!(check(&id, &secret, Some("alice")).is_err());
        assert!(
            check(&id, &secret, Some("")).is_ok(),
            "an empty identity is none"
        );
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any secret proves its id for its own principal only; any other secret,
            /// or any other principal, is refused.
            #[test]
            fn only_the_secret_and_its_principal_prove_the_id(
                secret in "\\PC{0,80}",
                other in "\\PC{0,80}",
                who in proptest::option::of("\\PC{1,20}"),
                whom in proptest::option::of("\\PC{1,20}"),
            ) {
                let id = derive(&secret, who.as_deref());
                let ok = check(&id, &secret, who.as_deref()).is_ok();
                prop_assert_eq!(ok, !secret.is_empty() && secret.len() <= 2 * SECRET_BYTES);
                if other != secret {
                    prop_assert!(check(&id, &other, who.as_deref()).is_err());
                }
                if whom != who {
                    prop_assert!(check(&id, &secret, whom.as_deref()).is_err());
                }
            }
        }
    }
}
