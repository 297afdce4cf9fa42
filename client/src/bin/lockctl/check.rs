//! `lockctl check`: whether a fencing token is still a lock's current exclusive grant
//! (the sequencer check), for scripts guarding a resource that cannot keep tokens.

use crate::target::Target;
use lockcell_client::{FencingToken, Sequencer};

use crate::print_line;

/// `lockctl check`'s status for a token that is not the current grant.
pub(crate) const STALE: u8 = 1;

pub(crate) const CHECK_LONG: &str = "\
Check whether TOKEN is the current exclusive grant of lock NAME.

Prints \"current\" when TOKEN (EPOCH:REVISION, as LOCKCELL_TOKEN gives it) is the grant
that holds NAME exclusively now; otherwise \"stale (current holder: EPOCH:REVISION)\", or
\"stale (not held)\" when nobody holds NAME exclusively.

The answer is already old when it is printed: a resource that can remember the highest
token it has seen should compare tokens itself instead.

Exit statuses: 0 current, 1 stale, 64 TOKEN is malformed (or the proxy refused the lock
name), 69 the proxy is unreachable, 1 anything else.

Example:
  lockctl check billing/nightly \"$LOCKCELL_TOKEN\" && ./apply-change.sh";

/// Arguments of `lockctl check`.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckArgs {
    /// The lock, e.g. billing/nightly.
    pub(crate) name: String,

    /// The fencing token to check, EPOCH:REVISION (e.g. 1:4521).
    pub(crate) token: String,
}

/// `lockctl check`.
pub(crate) async fn check(proxy: &Target, args: &CheckArgs) -> anyhow::Result<u8> {
    // Parsed here rather than by clap, so a malformed token exits 64 like other usage
    // errors, with the parser's explanation.
    let token: FencingToken = args.token.parse()?;
    let client = proxy.connect().await?;
    let sequencer = client.check_sequencer(&args.name, token).await?;
    let (line, code) = verdict(&sequencer);
    print_line(&line)?;
    Ok(code)
}

/// What to print, and the exit status.
fn verdict(sequencer: &Sequencer) -> (String, u8) {
    match sequencer {
        Sequencer { current: true, .. } => ("current".to_owned(), 0),
        Sequencer {
            holder: Some(holder),
            ..
        } => (format!("stale (current holder: {holder})"), STALE),
        Sequencer { holder: None, .. } => ("stale (not held)".to_owned(), STALE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_and_exit_statuses() {
        let t = |revision| FencingToken { epoch: 1, revision };
        let seq = |current, holder| Sequencer { current, holder };
        assert_eq!(verdict(&seq(true, Some(t(7)))), ("current".into(), 0));
        assert_eq!(
            verdict(&seq(false, Some(t(9)))),
            ("stale (current holder: 1:9)".into(), STALE)
        );
        assert_eq!(
            verdict(&seq(false, None)),
            ("stale (not held)".into(), STALE)
        );
    }
}
