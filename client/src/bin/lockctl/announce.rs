//! `lockctl announce`: be a member of a group while lockctl runs (or while CMD does),
//! and leave the moment it stops.

use crate::target::Target;
use std::ffi::OsString;
use std::time::Duration;

use lockcell_client::{Error, Session, SessionOptions};

use crate::exit::EX_TEMPFAIL;
use crate::signals::Signals;
use crate::supervise;

/// Status when the session was lost: the member may have left the group.
pub(crate) const SESSION_LOST: u8 = EX_TEMPFAIL;
/// How long lockctl waits for the proxy to confirm the close. An unreachable proxy must
/// not keep lockctl around: the session's TTL ends the membership anyway.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) const ANNOUNCE_LONG: &str = "\
Be member MEMBER of group GROUP, with VALUE, while lockctl runs.

Opens a session (renewed every third of --ttl), announces MEMBER in GROUP with VALUE
(an address, say: lockctl members prints it), and stays until Ctrl-C (SIGINT) or
SIGTERM. Then it closes the session, so the member leaves at once; if lockctl dies
instead, the member leaves when the session's TTL runs out.

With -- CMD ARGS..., runs CMD once announced (with LOCKCELL_GROUP, LOCKCELL_MEMBER and
LOCKCELL_MEMBER_VALUE in its environment) and stays as long as CMD runs: when CMD exits
(and what it left in its process group is stopped) the member leaves and lockctl exits
with CMD's status (128+N if CMD was killed by signal N). CMD runs in a process group of
its own and is stopped, all of it, before the membership can end behind its back, as for
lockctl lock (see lockctl lock --help): SIGTERM once the session's time left falls
below --stop-grace, SIGKILL at its deadline; LOCKCELL_DEADLINE and
LOCKCELL_DEADLINE_FILE give the deadline. SIGINT and SIGTERM sent to lockctl are passed
to the group as SIGTERM.

Without CMD, if the session falls past its deadline (the proxy is unreachable, for
instance), the proxy may have ended it and the member may already be gone: lockctl says
so and exits 75. Announce again to rejoin.

MEMBER is one name segment: not empty, no '/'. Announcing a member name that another
session announced takes it over.

Exit statuses: 0 stopped by SIGINT or SIGTERM (without CMD), CMD's status (with CMD),
90 lockctl had to stop CMD because the session's time left fell below the grace or its
deadline passed, 128+N (with CMD) lockctl was sent signal N and stopped CMD, 75 the
session was lost (without CMD), 64 the proxy refused the group or member name, 69 the proxy is
unreachable, 126/127 CMD could not be run, 1 anything else.

Example:
  lockctl announce web \"$(hostname)\" 10.0.0.7:8080
  lockctl --ttl 6s announce workers \"$(hostname)-$$\" idle -- ./worker";

/// Arguments of `lockctl announce`.
#[derive(Debug, clap::Args)]
pub(crate) struct AnnounceArgs {
    /// The group to join, e.g. web or svc/web.
    pub(crate) group: String,

    /// This member's name in the group (one segment, no '/'), e.g. the host name.
    pub(crate) member: String,

    /// The value others see for this member, e.g. its address.
    pub(crate) value: String,

    /// A command to run while announced, and its arguments (after `--`).
    #[arg(value_name = "CMD", last = true)]
    pub(crate) command: Vec<OsString>,
}

impl AnnounceArgs {
    /// The environment CMD runs with.
    fn env(&self) -> [(&'static str, &str); 3] {
        [
            ("LOCKCELL_GROUP", &self.group),
            ("LOCKCELL_MEMBER", &self.member),
            ("LOCKCELL_MEMBER_VALUE", &self.value),
        ]
    }
}

/// `lockctl announce`.
pub(crate) async fn announce(
    proxy: &Target,
    options: SessionOptions,
    args: &AnnounceArgs,
    grace: Duration,
    signals: &mut Signals,
) -> anyhow::Result<u8> {
    let session = tokio::select! {
        session = open_session(proxy, options) => session?,
        signo = signals.recv() => {
            eprintln!("lockctl: interrupted while connecting to {proxy}");
            return Ok(128 + signo);
        }
    };
    let announced = tokio::select! {
        announced = session.announce(&args.group, &args.member, args.value.as_bytes()) => announced,
        signo = signals.recv() => {
            eprintln!("lockctl: interrupted while announcing");
            close(session).await;
            return Ok(128 + signo);
        }
    };
    let written = match announced {
        Ok(written) => written,
        Err(error) => {
            close(session).await;
            return Err(error.into());
        }
    };
    eprintln!(
        "lockctl: announced {} in group {} (revision {})",
        args.member, args.group, written.revision
    );
    let code = match args.command.split_first() {
        None => stay(&session, args, signals).await,
        Some((program, program_args)) => {
            let env: Vec<(&str, String)> = args
                .env()
                .iter()
                .map(|(k, v)| (*k, (*v).to_owned()))
                .collect();
            let cmd = match supervise::spawn(program, program_args, &env, &session) {
                Ok(cmd) => cmd,
                Err(error) => {
                    close(session).await;
                    return Err(error.context(format!("cannot run {}", program.to_string_lossy())));
                }
            };
            let at_stake = format!("member {} may leave group {}", args.member, args.group);
            match cmd
                .supervise(&session, (grace, &|| true), &at_stake, signals)
                .await
            {
                Ok(ended) => ended.code(),
                Err(error) => {
                    close(session).await;
                    return Err(anyhow::Error::new(error).context("waiting for CMD"));
                }
            }
        }
    };
    close(session).await;
    Ok(code)
}

async fn open_session(proxy: &Target, options: SessionOptions) -> Result<Session, Error> {
    let client = proxy.connect().await?;
    client.open_session(options).await
}

/// Stays announced until a signal (0) or the session is lost.
async fn stay(session: &Session, args: &AnnounceArgs, signals: &mut Signals) -> u8 {
    tokio::select! {
        _ = signals.recv() => 0,
        () = session.jeopardy() => {
            lost(session, args);
            SESSION_LOST
        }
    }
}

/// Says that the session, and so maybe the membership, is lost.
fn lost(session: &Session, args: &AnnounceArgs) {
    eprintln!(
        "lockctl: session lost (past its deadline); member {} may have left group {}",
        args.member, args.group
    );
    if let Some(reason) = session.expired_reason() {
        eprintln!("lockctl: {reason}");
    }
}

/// Closes the session, so the member leaves now rather than when the TTL runs out.
/// Failures only get logged: the TTL ends the session anyway.
async fn close(session: Session) {
    match tokio::time::timeout(CLOSE_TIMEOUT, session.close()).await {
        Ok(Ok(_)) => tracing::debug!("session closed; the member has left"),
        Ok(Err(error @ Error::SessionExpired { .. })) => {
            tracing::info!(%error, "session already gone")
        }
        Ok(Err(error)) => {
            tracing::warn!(%error, "closing the session failed; the member leaves after the TTL")
        }
        Err(_) => tracing::warn!(
            timeout = ?CLOSE_TIMEOUT,
            "the proxy did not answer the close in time; the member leaves after the TTL"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmd_environment() {
        let args = AnnounceArgs {
            group: "web".into(),
            member: "host-a".into(),
            value: "10.0.0.7:80".into(),
            command: Vec::new(),
        };
        assert_eq!(
            args.env(),
            [
                ("LOCKCELL_GROUP", "web"),
                ("LOCKCELL_MEMBER", "host-a"),
                ("LOCKCELL_MEMBER_VALUE", "10.0.0.7:80"),
            ]
        );
    }
}
