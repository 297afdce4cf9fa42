//! Who may stop a lockcell process over its HTTP port (`POST /drain` on a proxy's
//! admin address and on the audit tailer), and the bearer tokens both take.
//!
//! With an admin token file, only its token, from anywhere (loopback included: behind
//! a service-mesh sidecar every caller arrives from a loopback address); without one,
//! only callers on the host's loopback.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context as _;
use sha2::{Digest, Sha256};

use crate::grants::MIN_TOKEN_LEN;

/// The token of an `Authorization: Bearer TOKEN` header value (the scheme in any case).
pub fn bearer(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// Compares two secrets by their digests, so the time taken tells nothing about how
/// much of a guess was right.
pub fn same_secret(a: &str, b: &str) -> bool {
    Sha256::digest(a.as_bytes()) == Sha256::digest(b.as_bytes())
}

/// The admin token in `path`: its first line, trimmed, at least [`MIN_TOKEN_LEN`]
/// characters. Read at every check, so replacing the file rotates it.
pub fn read_admin_token(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the admin token file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_owned();
    anyhow::ensure!(
        token.len() >= MIN_TOKEN_LEN,
        "the admin token in {} has {} characters; it needs at least {MIN_TOKEN_LEN}",
        path.display(),
        token.len()
    );
    Ok(token)
}

/// Whether `POST /drain` from `peer`, with the `Authorization` header `authorization`,
/// may stop the process; else the HTTP status and text to refuse it with. The text
/// never names the token file (the caller may be anyone): the log does.
pub fn check_drain(
    token_file: Option<&Path>,
    peer: SocketAddr,
    authorization: Option<&str>,
) -> Result<(), (u16, String)> {
    check_admin("POST /drain", token_file, peer, authorization)
}

/// Whether the admin call `what` (e.g. `POST /drain`) from `peer` may go ahead: a
/// caller with the admin token when `token_file` is set, else one on this host's
/// loopback; else the HTTP status and text to refuse it with.
pub fn check_admin(
    what: &str,
    token_file: Option<&Path>,
    peer: SocketAddr,
    authorization: Option<&str>,
) -> Result<(), (u16, String)> {
    let Some(file) = token_file else {
        return if is_loopback(peer) {
            Ok(())
        } else {
            Err((
                403,
                format!(
                    "{what} answers only callers on this host's loopback, not {}; set \
                     --admin-token-file to call it from elsewhere\n",
                    peer.ip()
                ),
            ))
        };
    };
    let token = read_admin_token(file).map_err(|e| {
        tracing::error!("{what} cannot check the admin token: {e:#}");
        (
            503,
            format!("{what} cannot check the admin token right now (the log says why)\n"),
        )
    })?;
    match authorization.and_then(bearer) {
        Some(offered) if same_secret(offered, &token) => Ok(()),
        _ => Err((
            401,
            format!("{what} needs the admin token: Authorization: Bearer TOKEN\n"),
        )),
    }
}

fn is_loopback(peer: SocketAddr) -> bool {
    match peer.ip() {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        std::net::IpAddr::V6(ip) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_is_taken_from_loopback_or_with_the_token_only() {
        let here: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:9".parse().unwrap();
        let afar: SocketAddr = "192.0.2.7:9".parse().unwrap();
        assert!(check_drain(None, here, None).is_ok());
        assert!(check_drain(None, mapped, None).is_ok());
        assert_eq!(check_drain(None, afar, None).unwrap_err().0, 403);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        let token = "t".repeat(MIN_TOKEN_LEN);
        std::fs::write(&file, format!("{token}\n")).unwrap();
        let with = format!("Bearer {token}");
        assert!(check_drain(Some(&file), afar, Some(&with)).is_ok());
        assert_eq!(check_drain(Some(&file), here, None).unwrap_err().0, 401);
        assert_eq!(
            check_drain(Some(&file), here, Some("Bearer t"))
                .unwrap_err()
                .0,
            401
        );
        std::fs::write(&file, "short\n").unwrap();
        let refused = check_drain(Some(&file), here, Some("Bearer short")).unwrap_err();
        assert_eq!(refused.0, 503);
        assert!(
            !refused.1.contains(&file.display().to_string()),
            "{}",
            refused.1
        );
    }

    #[test]
    fn bearer_takes_the_scheme_in_any_case() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer"), None);
    }
}
