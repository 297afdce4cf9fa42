//! `lockctl`: runs a command while holding a lockcell lock, and stops it (SIGTERM) the
//! moment the lock can no longer be trusted to be held.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use lockcell_client::{Client, Error, LockGuard, Session, SessionOptions, Wait};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, SignalKind};

/// sysexits.h: the command was used incorrectly (here: a lock name the proxy refused).
const EX_USAGE: u8 = 64;
/// sysexits.h: a service is unavailable (here: the proxy).
const EX_UNAVAILABLE: u8 = 69;
/// sysexits.h: temporary failure, try again later (here: the lock stayed held).
const EX_TEMPFAIL: u8 = 75;
/// What shells answer for a command that exists but cannot be run.
const EX_CANNOT_EXECUTE: u8 = 126;
/// What shells answer for a command that does not exist.
const EX_NOT_FOUND: u8 = 127;

/// How long lockctl waits for the proxy to confirm release and close once CMD has
/// ended. An unreachable proxy must not keep lockctl around: the session's TTL frees
/// the lock anyway.
const FINISH_TIMEOUT: Duration = Duration::from_secs(5);

const ABOUT_LONG: &str = "\
Run commands while holding lockcell locks.

lockctl opens a session with a lockcell proxy, acquires a lock, runs a command while
the lock is held and releases it when the command ends.

Example:
  lockctl --proxy 10.0.0.7:7420 lock billing/nightly --timeout 30s -- ./nightly.sh --full";

const LOCK_LONG: &str = "\
Run CMD while holding lock NAME.

Waits until NAME is granted (or up to --timeout), then runs CMD with LOCKCELL_LOCK=NAME
and LOCKCELL_TOKEN=<fencing token, EPOCH:REVISION> in its environment. Pass the token to
every resource CMD changes, so a resource can refuse a holder that has been superseded.

If the session falls past its deadline while CMD runs (the proxy is unreachable, for
instance), the lock may pass to another holder: lockctl sends CMD SIGTERM and waits for
it. SIGINT and SIGTERM sent to lockctl are forwarded to CMD as SIGTERM. When CMD ends,
the lock is released and lockctl exits with CMD's exit status (128+N if CMD was killed by
signal N).

Other exit statuses: 64 the proxy refused the lock name, 69 the proxy is unreachable,
75 the lock was still held when --timeout ran out, 126/127 CMD could not be run,
1 anything else.

Example:
  lockctl lock billing/nightly --timeout 30s -- ./nightly.sh --full
  LOCKCELL_PROXY=10.0.0.7:7420 lockctl --ttl 6s lock deploy/api -- make deploy";

/// Command-line interface.
#[derive(Debug, Parser)]
#[command(
    name = "lockctl",
    version,
    about = "Run commands while holding lockcell locks",
    long_about = ABOUT_LONG
)]
struct Cli {
    /// Address of the lockcell proxy (host:port or http://host:port).
    #[arg(
        long,
        env = "LOCKCELL_PROXY",
        default_value = "127.0.0.1:7420",
        global = true
    )]
    proxy: String,

    /// Session TTL to request, e.g. 500ms, 12s. The session is renewed every third of
    /// it; a shorter TTL frees the lock sooner if lockctl dies, at the cost of renewals.
    #[arg(long, default_value = "12s", value_parser = humantime::parse_duration, global = true)]
    ttl: Duration,

    /// Identity recorded with the grant, for whoever investigates who held the lock
    /// (default: HOSTNAME/PID).
    #[arg(long, global = true)]
    identity: Option<String>,

    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run CMD while holding lock NAME.
    #[command(long_about = LOCK_LONG)]
    Lock(LockArgs),
}

#[derive(Debug, clap::Args)]
struct LockArgs {
    /// The lock to hold, e.g. billing/nightly.
    name: String,

    /// Give up if the lock is not granted within this long, e.g. 500ms, 30s, 2m
    /// (exit status 75). Without it, wait as long as it takes.
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,

    /// The command to run and its arguments (after `--`).
    #[arg(
        value_name = "CMD",
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<OsString>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    match run(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("lockctl: {error:#}");
            ExitCode::from(failure_code(&error))
        }
    }
}

/// Diagnostics on stderr (CMD owns stdout): warnings by default, `RUST_LOG` to change.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .init();
}

async fn run(cli: Cli) -> anyhow::Result<u8> {
    let Cmd::Lock(args) = cli.command;
    // Installed first: from here on SIGINT/SIGTERM no longer kill lockctl outright, so
    // it can always release and close before leaving.
    let mut signals = Signals::new()?;
    let mut options = SessionOptions {
        ttl: cli.ttl,
        ..SessionOptions::default()
    };
    if let Some(identity) = cli.identity {
        options.identity = identity;
    }
    let session = tokio::select! {
        session = open_session(&cli.proxy, options) => session?,
        signo = signals.recv() => {
            eprintln!("lockctl: interrupted while connecting to {}", cli.proxy);
            return Ok(128 + signo);
        }
    };
    let name = &args.name;

    let wait = args.timeout.map_or(Wait::Forever, Wait::Timeout);
    let acquired = tokio::select! {
        acquired = session.acquire(name, wait) => acquired,
        signo = signals.recv() => {
            eprintln!("lockctl: interrupted while waiting for lock {name}");
            finish(None, session).await;
            return Ok(128 + signo);
        }
    };
    let guard = match acquired {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            match args.timeout {
                Some(d) => eprintln!(
                    "lockctl: lock {name} still held after {}",
                    humantime::format_duration(d)
                ),
                None => eprintln!("lockctl: lock {name} was not granted"),
            }
            finish(None, session).await;
            return Ok(EX_TEMPFAIL);
        }
        Err(error) => {
            finish(None, session).await;
            return Err(error.into());
        }
    };
    if !guard.is_valid() {
        eprintln!(
            "lockctl: session past its deadline when lock {name} was granted; not starting CMD"
        );
        finish(Some(guard), session).await;
        return Ok(EX_TEMPFAIL);
    }
    eprintln!("lockctl: holding {name} with token {}", guard.token());

    let (program, program_args) = args.command.split_first().context("no CMD given")?;
    let spawned = Command::new(program)
        .args(program_args)
        .env("LOCKCELL_LOCK", name)
        .env("LOCKCELL_TOKEN", guard.token().to_string())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(error) => {
            finish(Some(guard), session).await;
            return Err(anyhow::Error::new(error)
                .context(format!("cannot run {}", program.to_string_lossy())));
        }
    };
    let status = supervise(&mut child, &session, name, &mut signals).await;
    finish(Some(guard), session).await;
    Ok(exit_code(status.context("waiting for CMD")?))
}

async fn open_session(proxy: &str, options: SessionOptions) -> Result<Session, Error> {
    let client = Client::connect(proxy).await?;
    client.open_session(options).await
}

/// Waits for CMD, stopping it when the session falls into jeopardy or lockctl is told
/// to stop.
async fn supervise(
    child: &mut Child,
    session: &Session,
    name: &str,
    signals: &mut Signals,
) -> std::io::Result<ExitStatus> {
    let jeopardy = session.jeopardy();
    tokio::pin!(jeopardy);
    let mut stopped_for_jeopardy = false;
    loop {
        tokio::select! {
            status = child.wait() => return status,
            () = &mut jeopardy, if !stopped_for_jeopardy => {
                stopped_for_jeopardy = true;
                eprintln!(
                    "lockctl: session past its deadline; stopping CMD \
                     (lock {name} may pass to another holder)"
                );
                if let Some(reason) = session.expired_reason() {
                    eprintln!("lockctl: {reason}");
                }
                terminate(child);
            }
            signo = signals.recv() => {
                tracing::info!(signal = signo, "forwarding SIGTERM to CMD");
                terminate(child);
            }
        }
    }
}

/// Sends CMD SIGTERM, unless it has already exited.
fn terminate(child: &Child) {
    let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) else {
        return;
    };
    if let Err(errno) = kill(Pid::from_raw(pid), Signal::SIGTERM) {
        tracing::debug!(%errno, pid, "could not signal CMD (already gone?)");
    }
}

/// Releases the lock (if any) and closes the session, within [`FINISH_TIMEOUT`].
/// Failures only get logged: the session's TTL ends whatever a failed call left behind.
async fn finish(guard: Option<LockGuard>, session: Session) {
    if tokio::time::timeout(FINISH_TIMEOUT, release_and_close(guard, session))
        .await
        .is_err()
    {
        tracing::warn!(
            timeout = ?FINISH_TIMEOUT,
            "the proxy did not answer release and close in time; the session expires after its TTL"
        );
    }
}

async fn release_and_close(guard: Option<LockGuard>, session: Session) {
    if let Some(guard) = guard {
        let lock = guard.lock().to_owned();
        match guard.release().await {
            Ok(released) => tracing::debug!(lock.name = %lock, released, "released"),
            Err(error @ Error::SessionExpired { .. }) => {
                tracing::info!(lock.name = %lock, %error, "not released")
            }
            Err(error) => {
                tracing::warn!(lock.name = %lock, %error, "release failed; the close frees it")
            }
        }
    }
    match session.close().await {
        Ok(released) => tracing::debug!(released, "session closed"),
        Err(error @ Error::SessionExpired { .. }) => tracing::info!(%error, "session already gone"),
        Err(error) => {
            tracing::warn!(%error, "closing the session failed; it expires after its TTL")
        }
    }
}

/// lockctl's exit status when it fails before CMD ran.
fn failure_code(error: &anyhow::Error) -> u8 {
    if let Some(error) = error.downcast_ref::<Error>() {
        return match error {
            Error::InvalidArgument(_) => EX_USAGE,
            Error::Connect { .. } | Error::Unavailable(_) => EX_UNAVAILABLE,
            _ => 1,
        };
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
fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt as _;
    if let Some(code) = status.code() {
        return u8::try_from(code & 0xff).unwrap_or(1);
    }
    match status.signal() {
        Some(signo) => u8::try_from(128 + signo).unwrap_or(255),
        None => 1,
    }
}

/// SIGINT and SIGTERM, as one stream of signal numbers.
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
        })
    }

    /// The next signal received, as its number.
    async fn recv(&mut self) -> u8 {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::SIGINT as u8,
            _ = self.terminate.recv() => Signal::SIGTERM as u8,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;

    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_the_lock_command() {
        let cli = Cli::try_parse_from([
            "lockctl",
            "--ttl",
            "500ms",
            "lock",
            "jobs/nightly",
            "--timeout",
            "2m",
            "--",
            "sh",
            "-c",
            "exit 3",
        ])
        .unwrap();
        assert_eq!(cli.ttl, Duration::from_millis(500));
        let Cmd::Lock(args) = cli.command;
        assert_eq!(args.name, "jobs/nightly");
        assert_eq!(args.timeout, Some(Duration::from_secs(120)));
        assert_eq!(args.command, ["sh", "-c", "exit 3"].map(OsString::from));

        let cli = Cli::try_parse_from(["lockctl", "lock", "x", "--", "true"]).unwrap();
        assert_eq!(cli.ttl, Duration::from_secs(12));
        let Cmd::Lock(args) = cli.command;
        assert_eq!(args.timeout, None);

        assert!(
            Cli::try_parse_from(["lockctl", "lock", "x"]).is_err(),
            "CMD is required"
        );
        assert!(
            Cli::try_parse_from(["lockctl", "--ttl", "soon", "lock", "x", "--", "true"]).is_err()
        );
    }

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
        let missing = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::NotFound))
            .context("cannot run x");
        assert_eq!(code(missing), EX_NOT_FOUND);
        let denied = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        assert_eq!(code(denied), EX_CANNOT_EXECUTE);
    }
}
