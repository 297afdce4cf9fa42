//! lockctl's exit statuses: the sysexits.h codes it uses, what a failure maps to, and
//! how CMD's own status is passed on.

use std::process::ExitStatus;

use lockcell_client::Error;
use lockcell_proto::TokenParseError;

/// sysexits.h: the command was used incorrectly (a name the proxy refused, a malformed
/// token).
pub(crate) const EX_USAGE: u8 = 64;
/// sysexits.h: a service is unavailable (here: the proxy).
pub(crate) const EX_UNAVAILABLE: u8 = 69;
/// sysexits.h: permission denied (the proxy's prefix grants refused the call, or it could
/// not tell who lockctl is).
pub(crate) const EX_NOPERM: u8 = 77;
/// sysexits.h: temporary failure, try again later (here: the lock stayed held, or the
/// election stayed led by another session).
pub(crate) const EX_TEMPFAIL: u8 = 75;
/// What shells answer for a command that exists but cannot be run.
pub(crate) const EX_CANNOT_EXECUTE: u8 = 126;
/// What shells answer for a command that does not exist.
pub(crate) const EX_NOT_FOUND: u8 = 127;

/// lockctl's exit status when it fails before (or instead of) running CMD.
pub(crate) fn failure_code(error: &anyhow::Error) -> u8 {
    if let Some(error) = error.downcast_ref::<Error>() {
        return match error {
            Error::InvalidArgument(_) => EX_USAGE,
            Error::PermissionDenied(_) | Error::Unauthenticated(_) => EX_NOPERM,
            Error::Connect { .. } | Error::Unavailable(_) => EX_UNAVAILABLE,
            _ => 1,
        };
    }
    if error.downcast_ref::<TokenParseError>().is_some() {
        return EX_USAGE;
    }
    match error
        .downcast_ref::<std::io::Error>()
        .map(std::io::Error::kind)
    {
        Some(std::io::ErrorKind::NotFound) => EX_NOT_FOUND,
        Some(std::io::ErrorKind::PermissionDenied) => EX_CANNOT_EXECUTE,
        _ => 1,
    }
}

/// CMD's exit status as lockctl's: its exit code, or 128+N when signal N killed it (as
/// shells report it).
pub(crate) fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt as _;
    if let Some(code) = status.code() {
        return u8::try_from(code & 0xff).unwrap_or(1);
    }
    match status.signal() {
        Some(signo) => u8::try_from(128 + signo).unwrap_or(255),
        None => 1,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;

    use nix::sys::signal::Signal;

    use super::*;

    #[test]
    fn exit_status_maps_like_a_shell() {
        // Raw wait statuses: exit code in the high byte, terminating signal in the low.
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(255 << 8)), 255);
        assert_eq!(
            exit_code(ExitStatus::from_raw(Signal::SIGTERM as i32)),
            128 + 15
        );
        assert_eq!(
            exit_code(ExitStatus::from_raw(Signal::SIGKILL as i32)),
            128 + 9
        );
    }

    #[test]
    fn failures_map_to_sysexits() {
        let code = |e: anyhow::Error| failure_code(&e);
        assert_eq!(
            code(Error::InvalidArgument("bad name".into()).into()),
            EX_USAGE
        );
        assert_eq!(
            code(
                Error::Connect {
                    addr: "x".into(),
                    reason: "refused".into()
                }
                .into()
            ),
            EX_UNAVAILABLE
        );
        assert_eq!(
            code(Error::Unavailable("no lease".into()).into()),
            EX_UNAVAILABLE
        );
        assert_eq!(
            code(
                Error::SessionExpired {
                    session: "s".into()
                }
                .into()
            ),
            1
        );
        assert_eq!(code(Error::NotHolder("not the leader".into()).into()), 1);
        let malformed = "1:x".parse::<lockcell_client::FencingToken>().unwrap_err();
        assert_eq!(code(malformed.into()), EX_USAGE);
        let missing = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::NotFound))
            .context("cannot run x");
        assert_eq!(code(missing), EX_NOT_FOUND);
        let denied = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        assert_eq!(code(denied), EX_CANNOT_EXECUTE);
    }
}
