//! `lockctl`: runs a command while holding a lockcell lock or leading an election, and
//! stops it (SIGTERM) the moment that can no longer be trusted; also asks who leads an
//! election and whether a fencing token is still current; reads, writes and watches
//! small keys; and announces or follows the members of a group.
#![forbid(unsafe_code)]

mod announce;
mod audit;
mod check;
mod exit;
mod hold;
mod kv;
mod leader;
mod signals;
mod supervise;
mod target;
mod watch;
mod who;

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use lockcell_client::SessionOptions;

use crate::announce::{AnnounceArgs, ANNOUNCE_LONG};
use crate::check::{CheckArgs, CHECK_LONG};
use crate::exit::failure_code;
use crate::hold::{hold_and_run, ElectArgs, LockArgs, ELECT_LONG, LOCK_LONG};
use crate::kv::{DelArgs, GetArgs, PutArgs, KV_LONG};
use crate::leader::{LeaderArgs, LEADER_LONG, OBSERVE_LONG};
use crate::signals::Signals;
use crate::watch::{MembersArgs, WatchArgs, MEMBERS_LONG, WATCH_LONG};
use crate::who::{WhoArgs, WHO_LONG};

const ABOUT_LONG: &str = "\
Run commands while holding lockcell locks or leading lockcell elections.

lockctl opens a session with a lockcell proxy, acquires a lock (lockctl lock) or
campaigns until it leads an election (lockctl elect), runs a command while it holds
that, and gives it up when the command ends. lockctl leader and lockctl observe tell
who leads an election; lockctl check tells whether a fencing token is still current.
lockctl get, put, del and watch read, write and follow small keys (configuration);
lockctl announce makes this host a member of a group while it runs, and lockctl members
lists or follows a group's members.

Example:
  lockctl --proxy 10.0.0.7:7420 lock billing/nightly --timeout 30s -- ./nightly.sh --full
  lockctl elect db/primary 10.0.0.7:5432 -- ./serve-primary.sh
  lockctl announce web \"$(hostname)\" 10.0.0.7:8080 -- ./serve.sh";

/// Command-line interface.
#[derive(Debug, Parser)]
#[command(
    name = "lockctl",
    version,
    about = "Run commands while holding lockcell locks or leading lockcell elections",
    long_about = ABOUT_LONG
)]
struct Cli {
    /// Address of the lockcell proxy (host:port or http://host:port), or several separated
    /// by commas, own zone first: the session moves to the next (locks and tokens
    /// unchanged) when its proxy dies, stops answering or drains.
    #[arg(
        long,
        env = "LOCKCELL_PROXY",
        default_value = lockcell_client::DEFAULT_PROXY,
        global = true
    )]
    proxy: String,

    /// Session TTL to request (lock, elect, announce), e.g. 500ms, 12s. The session is renewed
    /// every third of it; a shorter TTL frees the lock, leadership or membership sooner
    /// if lockctl dies, at the cost of renewals.
    #[arg(long, default_value = "12s", value_parser = humantime::parse_duration, global = true)]
    ttl: Duration,

    /// How long before the session's deadline CMD gets SIGTERM once renewals stop being
    /// confirmed (lock, elect, announce with CMD); SIGKILL follows at the deadline. At
    /// most a third of the validity a renewal gives (--ttl, or less when the proxy's
    /// leases are shorter): renewals come every third of it. 0 means SIGKILL at the
    /// deadline with no SIGTERM before.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration, global = true)]
    stop_grace: Duration,

    /// Identity recorded with the session (lock, elect, announce), for whoever investigates who
    /// held the lock or led (default: HOSTNAME/PID).
    #[arg(long, global = true)]
    identity: Option<String>,

    #[command(flatten)]
    target: target::TargetArgs,

    /// A TOML file of settings, each named as its long flag (`proxy =
    /// "10.0.0.7:7420,10.0.1.7:7420"`, `tls-ca = "/etc/lockcell/ca.pem"`); a table named
    /// as a command (`[lock]`) holds settings for that command only. A flag or an
    /// environment variable beats it.
    #[arg(long, env = "LOCKCTL_CONFIG", global = true)]
    config: Option<std::path::PathBuf>,

    /// Prints the configuration in force for the command, each setting with where it
    /// came from (flag, environment, file, default; tokens hidden), in the file's
    /// format, and exits without doing anything.
    #[arg(long, global = true)]
    print_config: bool,

    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run CMD while holding lock NAME.
    #[command(long_about = LOCK_LONG)]
    Lock(LockArgs),
    /// Run CMD while leading election NAME with VALUE.
    #[command(long_about = ELECT_LONG)]
    Elect(ElectArgs),
    /// Print who leads election NAME.
    #[command(long_about = LEADER_LONG)]
    Leader(LeaderArgs),
    /// Print who leads election NAME, then every change.
    #[command(long_about = OBSERVE_LONG)]
    Observe(LeaderArgs),
    /// Check whether TOKEN is the current exclusive grant of lock NAME.
    #[command(long_about = CHECK_LONG)]
    Check(CheckArgs),
    /// Print who holds lock NAME, since when, and who waits for it.
    #[command(long_about = WHO_LONG)]
    Who(WhoArgs),
    /// Print a small key's value (or every key under a prefix).
    #[command(long_about = KV_LONG)]
    Get(GetArgs),
    /// Write a small key, optionally only if absent or at a revision.
    #[command(long_about = KV_LONG)]
    Put(PutArgs),
    /// Delete a small key, optionally only at a revision.
    #[command(long_about = KV_LONG)]
    Del(DelArgs),
    /// Print every change of a small key (or of every key under a prefix).
    #[command(long_about = WATCH_LONG)]
    Watch(WatchArgs),
    /// Print the members of a group, or follow who joins and leaves.
    #[command(long_about = MEMBERS_LONG)]
    Members(MembersArgs),
    /// Be a member of a group while lockctl (or CMD) runs.
    #[command(long_about = ANNOUNCE_LONG)]
    Announce(AnnounceArgs),
    /// Print who held lock NAME (or led, or wrote key NAME), when, with which token.
    #[command(long_about = audit::AUDIT_LONG)]
    Audit(audit::AuditArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    if let Some(reference) = lockcell_settings::reference_requested::<Cli>() {
        print!("{reference}");
        return ExitCode::SUCCESS;
    }
    let loaded = match lockcell_settings::load::<Cli>(std::env::args_os().collect()) {
        Ok(loaded) => loaded,
        Err(e) => e.exit(),
    };
    if loaded.config.print_config {
        print!("{}", loaded.render());
        return ExitCode::SUCCESS;
    }
    init_tracing();
    match run(loaded.config).await {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("lockctl: {error:#}");
            ExitCode::from(failure_code(&error))
        }
    }
}

/// Diagnostics on stderr (stdout belongs to CMD, or to the answer): warnings by
/// default, `RUST_LOG` to change.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    use std::io::IsTerminal as _;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .init();
}

async fn run(cli: Cli) -> anyhow::Result<u8> {
    let Cli {
        proxy,
        ttl,
        stop_grace,
        identity,
        target,
        command,
        ..
    } = cli;
    let proxy = target::Target::new(&proxy, &target)?;
    let mut options = SessionOptions {
        ttl,
        ..SessionOptions::default()
    };
    if let Some(identity) = identity {
        options.identity = identity;
    }
    let grace = stop_grace;
    match command {
        Cmd::Lock(args) => {
            // Installed first: from here on SIGINT/SIGTERM no longer kill lockctl
            // outright, so it can always release and close before leaving.
            let mut signals = Signals::holding()?;
            let (want, wait) = (args.want(), args.wait());
            let run = (args.run.command.as_slice(), grace);
            hold_and_run(&proxy, options, want, wait, run, &mut signals).await
        }
        Cmd::Elect(args) => {
            let mut signals = Signals::holding()?;
            let (want, wait) = (args.want(), args.wait());
            let run = (args.run.command.as_slice(), grace);
            hold_and_run(&proxy, options, want, wait, run, &mut signals).await
        }
        Cmd::Leader(args) => leader::leader(&proxy, &args).await,
        Cmd::Observe(args) => {
            let mut signals = Signals::new()?;
            leader::observe(&proxy, &args, &mut signals).await
        }
        Cmd::Check(args) => check::check(&proxy, &args).await,
        Cmd::Who(args) => who::who(&proxy, &args).await,
        Cmd::Audit(args) => audit::audit(&args, &target).await,
        Cmd::Get(args) => kv::get(&proxy, &args).await,
        Cmd::Put(args) => kv::put(&proxy, &args).await,
        Cmd::Del(args) => kv::del(&proxy, &args).await,
        Cmd::Watch(args) => {
            let mut signals = Signals::new()?;
            watch::watch(&proxy, &args, &mut signals).await
        }
        Cmd::Members(args) => {
            let mut signals = Signals::new()?;
            watch::members(&proxy, &args, &mut signals).await
        }
        Cmd::Announce(args) => {
            // Installed first, as for lock: the session is always closed before leaving.
            let mut signals = Signals::holding()?;
            announce::announce(&proxy, options, &args, grace, &mut signals).await
        }
    }
}

/// Writes one line of an answer to stdout at once (an observer acts on each line as it
/// comes). A closed stdout is an error, not a panic.
pub(crate) fn print_line(line: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")
        .and_then(|()| stdout.flush())
        .context("writing to stdout")
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use clap::CommandFactory as _;
    use lockcell_client::{Mode, Wait};

    use super::*;
    use crate::hold::Want;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("lockctl").chain(args.iter().copied()))
    }

    #[test]
    fn parses_the_lock_command() {
        let cli = parse(&[
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
        let Cmd::Lock(args) = cli.command else {
            panic!("lock")
        };
        assert_eq!(args.name, "jobs/nightly");
        assert_eq!(args.wait(), Wait::Timeout(Duration::from_secs(120)));
        assert_eq!(
            args.want(),
            Want::Lock {
                name: "jobs/nightly",
                mode: Mode::Exclusive
            }
        );
        assert_eq!(args.run.command, ["sh", "-c", "exit 3"].map(OsString::from));

        let cli = parse(&["lock", "x", "--", "true"]).unwrap();
        assert_eq!(cli.ttl, Duration::from_secs(12));
        let Cmd::Lock(args) = cli.command else {
            panic!("lock")
        };
        assert_eq!(args.wait(), Wait::Forever);

        let cli = parse(&["lock", "--shared", "--try", "x", "--", "true"]).unwrap();
        let Cmd::Lock(args) = cli.command else {
            panic!("lock")
        };
        assert_eq!(args.wait(), Wait::Try);
        assert_eq!(
            args.want(),
            Want::Lock {
                name: "x",
                mode: Mode::Shared
            }
        );

        assert!(parse(&["lock", "x"]).is_err(), "CMD is required");
        assert!(parse(&["--ttl", "soon", "lock", "x", "--", "true"]).is_err());
        assert!(
            parse(&["lock", "--try", "--timeout", "1s", "x", "--", "true"]).is_err(),
            "--try and --timeout contradict each other"
        );
    }

    #[test]
    fn parses_the_elect_command() {
        let cli = parse(&[
            "elect",
            "db/primary",
            "10.0.0.7:5432",
            "--timeout",
            "30s",
            "--",
            "serve",
            "--primary",
        ])
        .unwrap();
        let Cmd::Elect(args) = cli.command else {
            panic!("elect")
        };
        assert_eq!(
            args.want(),
            Want::Leadership {
                election: "db/primary",
                value: "10.0.0.7:5432"
            }
        );
        assert_eq!(args.wait(), Wait::Timeout(Duration::from_secs(30)));
        assert_eq!(args.run.command, ["serve", "--primary"].map(OsString::from));
        assert!(
            parse(&["elect", "db/primary", "--", "true"]).is_err(),
            "VALUE"
        );
    }

    #[test]
    fn the_configuration_reference_is_up_to_date() {
        let doc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
        lockcell_settings::check_reference(&doc, &Cli::command()).unwrap();
    }

    #[test]
    fn a_configuration_file_gives_the_proxies_and_a_commands_own_settings() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            file.path(),
            "proxy = \"10.0.0.7:7420,10.0.1.7:7420\"\ntls-ca = \"/etc/lockcell/ca.pem\"\n\n[lock]\ntimeout = \"30s\"\n",
        )
        .unwrap();
        let load = |args: &[&str]| {
            let all = ["lockctl", "--config", file.path().to_str().unwrap()]
                .iter()
                .chain(args)
                .map(OsString::from)
                .collect();
            lockcell_settings::load::<Cli>(all).map(|loaded| loaded.config)
        };
        let cli = load(&["lock", "jobs/x", "--", "true"]).unwrap();
        assert_eq!(cli.proxy, "10.0.0.7:7420,10.0.1.7:7420");
        assert!(cli.target.tls_ca.is_some());
        let Cmd::Lock(args) = cli.command else {
            panic!("lock")
        };
        assert_eq!(args.wait(), Wait::Timeout(Duration::from_secs(30)));
        // --try excludes --timeout: the flag wins over the file's timeout.
        let Cmd::Lock(args) = load(&["lock", "jobs/x", "--try", "--", "true"])
            .unwrap()
            .command
        else {
            panic!("lock")
        };
        assert_eq!(args.wait(), Wait::Try);
        // Another command ignores [lock].
        let cli = load(&["leader", "db"]).unwrap();
        assert_eq!(cli.proxy, "10.0.0.7:7420,10.0.1.7:7420");
    }

    #[test]
    fn parses_the_query_commands() {
        let Cmd::Leader(args) = parse(&["leader", "db", "--json"]).unwrap().command else {
            panic!("leader")
        };
        assert_eq!((args.name.as_str(), args.json), ("db", true));
        let Cmd::Observe(args) = parse(&["observe", "db"]).unwrap().command else {
            panic!("observe")
        };
        assert_eq!((args.name.as_str(), args.json), ("db", false));
        let cli = parse(&["check", "jobs/x", "1:4521"]).unwrap();
        assert_eq!(
            cli.target.auth_token, None,
            "the fencing token to check is not the bearer token"
        );
        let Cmd::Check(args) = cli.command else {
            panic!("check")
        };
        assert_eq!(
            (args.name.as_str(), args.token.as_str()),
            ("jobs/x", "1:4521")
        );
        // A malformed token is lockctl's to report (status 64), not clap's (status 2).
        assert!(parse(&["check", "jobs/x", "nonsense"]).is_ok());
    }

    #[test]
    fn parses_the_watch_command() {
        let watch = |args: &[&str]| match parse(args).map(|cli| cli.command) {
            Ok(Cmd::Watch(args)) => Ok(args),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        let args = watch(&["watch", "config/a"]).unwrap();
        let (key, opts) = args.target();
        assert_eq!(
            (key, opts.prefix, opts.start_revision),
            ("config/a", false, 0)
        );
        let args = watch(&["watch", "config/", "--prefix", "--from", "42", "--prev"]).unwrap();
        let (key, opts) = args.target();
        assert_eq!(
            (
                key,
                opts.prefix,
                opts.start_revision,
                opts.prev_kv,
                opts.all_keys
            ),
            ("config/", true, 42, true, false)
        );
        let args = watch(&["watch", "--all"]).unwrap();
        let (key, opts) = args.target();
        assert_eq!((key, opts.prefix, opts.all_keys), ("", true, true));
        // The order of the switch and the prefix does not matter (as for get).
        let args = watch(&["watch", "--prefix", "config/"]).unwrap();
        assert_eq!((args.target().0, args.target().1.prefix), ("config/", true));
        assert!(watch(&["watch"]).is_err(), "KEY or --all");
        assert!(watch(&["watch", "--prefix"]).is_err(), "--prefix needs KEY");
        assert!(watch(&["watch", "a", "--all"]).is_err());
        assert!(
            watch(&["watch", "a", "--from", "0"]).is_err(),
            "revisions start at 1"
        );
    }

    #[test]
    fn parses_the_membership_commands() {
        let Cmd::Members(args) = parse(&["members", "web", "--watch"]).unwrap().command else {
            panic!("members")
        };
        assert_eq!((args.group.as_str(), args.watch), ("web", true));
        let cli = parse(&["--ttl", "3s", "announce", "web", "host-a", "10.0.0.7:80"]).unwrap();
        assert_eq!(cli.ttl, Duration::from_secs(3));
        let Cmd::Announce(args) = cli.command else {
            panic!("announce")
        };
        assert_eq!(
            (
                args.group.as_str(),
                args.member.as_str(),
                args.value.as_str()
            ),
            ("web", "host-a", "10.0.0.7:80")
        );
        assert!(args.command.is_empty());
        let cli = parse(&[
            "announce", "web", "a", "v", "--ttl", "2s", "--", "serve", "-p", "80",
        ])
        .unwrap();
        assert_eq!(cli.ttl, Duration::from_secs(2));
        let Cmd::Announce(args) = cli.command else {
            panic!("announce")
        };
        assert_eq!(args.command, ["serve", "-p", "80"].map(OsString::from));
        assert!(parse(&["announce", "web", "a"]).is_err(), "VALUE");
        assert!(
            parse(&["announce", "web", "a", "v", "serve"]).is_err(),
            "CMD only after --"
        );
    }
}
