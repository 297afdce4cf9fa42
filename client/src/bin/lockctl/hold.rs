//! `lockctl lock` and `lockctl elect`: hold a lock or the leadership of an election
//! while CMD runs, and stop CMD's whole process group before the hold can pass on
//! ([`crate::supervise`]). Both commands take the one path in [`hold_and_run`].

use crate::target::Target;
use std::ffi::OsString;
use std::time::Duration;

use anyhow::Context as _;
use lockcell_client::{
    Error, FencingToken, Leadership, LockGuard, Mode, Session, SessionOptions, SessionState, Wait,
};

use crate::exit::EX_TEMPFAIL;
use crate::signals::Signals;
use crate::supervise;

/// How long lockctl waits for the proxy to confirm release (or resignation) and close
/// once CMD has ended. An unreachable proxy must not keep lockctl around: the session's
/// TTL frees what it held anyway.
const FINISH_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) const LOCK_LONG: &str = "\
Run CMD while holding lock NAME.

Waits until NAME is granted (or up to --timeout, or not at all with --try), then runs
CMD with LOCKCELL_LOCK=NAME and LOCKCELL_TOKEN=<fencing token, EPOCH:REVISION> in its
environment. Pass the token to every resource CMD changes, so a resource can refuse a
holder that has been superseded. With --shared, CMD runs alongside other shared holders
but never while an exclusive holder has the lock.

CMD runs in a process group of its own, and every signal lockctl sends goes to the
whole group and to everything else CMD started, even what left the group (setsid,
setpgid: timeout, set -m), since lockctl is its subreaper. The lock may pass to another
holder once the session's deadline has passed, so lockctl stops all of it before then:
each confirmed renewal moves the deadline a validity ahead (--ttl, or less when the
proxy's leases are shorter), every third of it; once the time left falls below
--stop-grace (default 3s, at most a third of the validity), CMD gets SIGTERM, and just
before the deadline SIGKILL if anything is left. The next holder is granted the lock
only after that. A session the proxy ends, or a lock found lost while the session is
valid (the session moved to another proxy, which could not take it along), means
SIGKILL at once. A command that needs longer to wind down must use the SDK and act on
the session's deadline itself. LOCKCELL_DEADLINE is the deadline when CMD started, in
Unix milliseconds; the file named by LOCKCELL_DEADLINE_FILE always holds the current
one (rewritten with every renewal): check it before each step that must not run
without the lock. SIGINT, SIGTERM, SIGHUP (the terminal closed), SIGQUIT, SIGUSR1,
SIGUSR2 and SIGALRM sent to lockctl are passed on as SIGTERM (a second one: SIGKILL);
SIGTSTP (Ctrl-Z), SIGTTIN and SIGTTOU are ignored. When CMD ends, whatever it left
running gets SIGTERM (SIGKILL after the grace), then the lock is released. CMD cannot
read the terminal (its group is not the terminal's foreground): give it input by
redirection. What lockctl cannot do is stop CMD while lockctl itself is stopped
(SIGSTOP, a debugger) or after it is killed (SIGKILL, the OOM killer): the lock then
passes when the session's TTL runs out while CMD runs on, and only the fencing token
(or a script that checks LOCKCELL_DEADLINE_FILE, which stops moving) protects what CMD
changes.

Exit statuses: CMD's own when it ended by itself (128+N if CMD was killed by signal N);
90 lockctl had to stop CMD because the session's time left fell below the grace or its
deadline passed (stderr says which, and how CMD ended); 128+N lockctl was sent signal N
and stopped CMD; 64 the proxy refused the lock name (or shared mode for it), 69 the
proxy is unreachable, 75 the lock was held when --try tried or still held when
--timeout ran out, 126/127 CMD could not be run, 1 anything else.

Example:
  lockctl lock billing/nightly --timeout 30s -- ./nightly.sh --full
  lockctl lock --shared --try schema/orders -- ./report.sh
  LOCKCELL_PROXY=10.0.0.7:7420 lockctl --ttl 6s lock deploy/api -- make deploy";

pub(crate) const ELECT_LONG: &str = "\
Run CMD while leading election NAME with VALUE.

Campaigns until this session leads NAME (or up to --timeout), then runs CMD with
LOCKCELL_ELECTION=NAME, LOCKCELL_TOKEN=<fencing token, EPOCH:REVISION> and
LOCKCELL_LEADER_VALUE=VALUE in its environment. Observers (lockctl leader, lockctl
observe) see VALUE as the leader's value. Pass the token to every resource CMD changes,
so a resource can refuse a leader that has been superseded.

CMD runs in a process group of its own and is stopped, all of it, before the
leadership can pass to another session, as for lockctl lock (see lockctl lock --help):
SIGTERM once the session's time left falls below --stop-grace, SIGKILL at its deadline;
LOCKCELL_DEADLINE and LOCKCELL_DEADLINE_FILE give the deadline. SIGINT and SIGTERM sent
to lockctl (and SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM) are passed on as SIGTERM;
SIGTSTP is ignored. When CMD ends, what it left in its group
is stopped, then lockctl resigns.

Exit statuses: CMD's own when it ended by itself (128+N if CMD was killed by signal N);
90 lockctl had to stop CMD because the session's time left fell below the grace or its
deadline passed; 128+N lockctl was sent signal N and stopped CMD; 64 the proxy refused
the election name, 69 the proxy is unreachable, 75 another session still led when
--timeout ran out, 126/127 CMD could not be run, 1 anything else.

Example:
  lockctl elect db/primary 10.0.0.7:5432 -- ./serve-primary.sh
  lockctl elect --timeout 1m jobs/scheduler \"$(hostname)\" -- ./scheduler";

/// Arguments of `lockctl lock`.
#[derive(Debug, clap::Args)]
pub(crate) struct LockArgs {
    /// The lock to hold, e.g. billing/nightly.
    pub(crate) name: String,

    /// Take the lock shared: CMD runs alongside other shared holders, never while an
    /// exclusive holder has the lock. The lock's class must allow shared holders.
    #[arg(long)]
    pub(crate) shared: bool,

    /// Try once: if the lock is held, exit at once with status 75 instead of waiting.
    #[arg(long = "try", conflicts_with = "timeout")]
    pub(crate) try_once: bool,

    /// Give up if the lock is not granted within this long, e.g. 500ms, 30s, 2m
    /// (exit status 75). Without it (and without --try), wait as long as it takes.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) timeout: Option<Duration>,

    #[command(flatten)]
    pub(crate) run: RunArgs,
}

/// The command `lock` and `elect` run, shared by both.
#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// The command to run and its arguments (after `--`).
    #[arg(
        value_name = "CMD",
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub(crate) command: Vec<OsString>,
}

impl LockArgs {
    pub(crate) fn want(&self) -> Want<'_> {
        let mode = if self.shared {
            Mode::Shared
        } else {
            Mode::Exclusive
        };
        Want::Lock {
            name: &self.name,
            mode,
        }
    }

    pub(crate) fn wait(&self) -> Wait {
        if self.try_once {
            Wait::Try
        } else {
            self.timeout.map_or(Wait::Forever, Wait::Timeout)
        }
    }
}

/// Arguments of `lockctl elect`.
#[derive(Debug, clap::Args)]
pub(crate) struct ElectArgs {
    /// The election to campaign in, e.g. db/primary.
    pub(crate) name: String,

    /// The value to lead with, which observers see (e.g. this instance's address).
    pub(crate) value: String,

    /// Give up if this session does not lead within this long, e.g. 500ms, 30s, 2m
    /// (exit status 75). Without it, campaign as long as it takes.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) timeout: Option<Duration>,

    #[command(flatten)]
    pub(crate) run: RunArgs,
}

impl ElectArgs {
    pub(crate) fn want(&self) -> Want<'_> {
        Want::Leadership {
            election: &self.name,
            value: &self.value,
        }
    }

    pub(crate) fn wait(&self) -> Wait {
        self.timeout.map_or(Wait::Forever, Wait::Timeout)
    }
}

/// What lockctl is to hold while CMD runs; everything that differs between `lock` and
/// `elect` is here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want<'a> {
    Lock { name: &'a str, mode: Mode },
    Leadership { election: &'a str, value: &'a str },
}

impl Want<'_> {
    async fn obtain(self, session: &Session, wait: Wait) -> Result<Option<Held>, Error> {
        Ok(match self {
            Want::Lock {
                name,
                mode: Mode::Exclusive,
            } => session.acquire(name, wait).await?.map(Held::Lock),
            Want::Lock {
                name,
                mode: Mode::Shared,
            } => session.acquire_shared(name, wait).await?.map(Held::Lock),
            Want::Leadership { election, value } => session
                .campaign(election, value, wait)
                .await?
                .map(Held::Leadership),
        })
    }

    /// What is being waited for, in messages.
    fn what(self) -> String {
        match self {
            Want::Lock { name, .. } => format!("lock {name}"),
            Want::Leadership { election, .. } => format!("leadership of {election}"),
        }
    }

    /// Why lockctl gives up without running CMD after a wait that ended ungranted.
    fn not_granted(self, wait: Wait) -> String {
        let (subject, busy) = match self {
            Want::Lock {
                name,
                mode: Mode::Exclusive,
            } => (format!("lock {name}"), "held"),
            Want::Lock {
                name,
                mode: Mode::Shared,
            } => (format!("lock {name}"), "held exclusively"),
            Want::Leadership { election, .. } => {
                (format!("election {election}"), "led by another session")
            }
        };
        match wait {
            Wait::Try => format!("{subject} is {busy}"),
            Wait::Timeout(d) => format!(
                "{subject} still {busy} after {}",
                humantime::format_duration(d)
            ),
            Wait::Forever => format!("{} was not granted", self.what()),
        }
    }

    /// Announced on stderr once CMD is about to run.
    fn holding(self, token: FencingToken) -> String {
        match self {
            Want::Lock {
                name,
                mode: Mode::Exclusive,
            } => format!("holding {name} with token {token}"),
            Want::Lock {
                name,
                mode: Mode::Shared,
            } => format!("holding {name} shared with token {token}"),
            Want::Leadership { election, value } => {
                format!("leading {election} as {value:?} with token {token}")
            }
        }
    }

    /// What is at stake once the session is past its deadline.
    fn at_stake(self) -> String {
        match self {
            Want::Lock { name, .. } => format!("lock {name} may pass to another holder"),
            Want::Leadership { election, .. } => {
                format!("leadership of {election} may pass to another session")
            }
        }
    }

    /// The environment CMD runs with.
    fn env(self, token: FencingToken) -> Vec<(&'static str, String)> {
        let token = ("LOCKCELL_TOKEN", token.to_string());
        match self {
            Want::Lock { name, .. } => vec![("LOCKCELL_LOCK", name.to_owned()), token],
            Want::Leadership { election, value } => vec![
                ("LOCKCELL_ELECTION", election.to_owned()),
                token,
                ("LOCKCELL_LEADER_VALUE", value.to_owned()),
            ],
        }
    }
}

/// What lockctl holds while CMD runs.
enum Held {
    Lock(LockGuard),
    Leadership(Leadership),
}

impl Held {
    fn token(&self) -> FencingToken {
        match self {
            Held::Lock(guard) => guard.token(),
            Held::Leadership(leadership) => leadership.token(),
        }
    }

    fn is_valid(&self) -> bool {
        match self {
            Held::Lock(guard) => guard.is_valid(),
            Held::Leadership(leadership) => leadership.is_valid(),
        }
    }

    /// Releases the lock or resigns. Failures only get logged: closing the session
    /// next frees whatever is left.
    async fn give_up(self) {
        let (what, outcome) = match self {
            Held::Lock(guard) => (format!("lock {}", guard.lock()), guard.release().await),
            Held::Leadership(leadership) => (
                format!("leadership of {}", leadership.election()),
                leadership.resign().await,
            ),
        };
        match outcome {
            Ok(done) => tracing::debug!(what = %what, done, "given up"),
            Err(error @ (Error::SessionExpired { .. } | Error::NotHolder(_))) => {
                tracing::info!(what = %what, %error, "already lost")
            }
            Err(error) => {
                tracing::warn!(what = %what, %error, "giving up failed; the close frees it")
            }
        }
    }
}

/// Opens a session, obtains `want` (waiting as `wait` says), runs `command` while
/// holding it (stopped once the time left before the session's deadline is below
/// `grace`: see [`crate::supervise`]), then gives it up and closes the session. Returns
/// lockctl's exit status.
pub(crate) async fn hold_and_run(
    proxy: &Target,
    options: SessionOptions,
    want: Want<'_>,
    wait: Wait,
    (command, grace): (&[OsString], Duration),
    signals: &mut Signals,
) -> anyhow::Result<u8> {
    let (program, program_args) = command.split_first().context("no CMD given")?;
    let session = tokio::select! {
        session = open_session(proxy, options) => session?,
        signo = signals.recv() => {
            eprintln!("lockctl: interrupted while connecting to {proxy}");
            return Ok(128 + signo);
        }
    };
    let obtained = tokio::select! {
        obtained = want.obtain(&session, wait) => obtained,
        signo = signals.recv() => {
            eprintln!("lockctl: interrupted while waiting for {}", want.what());
            finish(None, session).await;
            return Ok(128 + signo);
        }
    };
    let held = match obtained {
        Ok(Some(held)) => held,
        Ok(None) => {
            eprintln!("lockctl: {}", want.not_granted(wait));
            finish(None, session).await;
            return Ok(EX_TEMPFAIL);
        }
        Err(error) => {
            finish(None, session).await;
            return Err(error.into());
        }
    };
    if !held.is_valid() {
        eprintln!(
            "lockctl: session past its deadline when {} was granted; not starting CMD",
            want.what()
        );
        finish(Some(held), session).await;
        return Ok(EX_TEMPFAIL);
    }
    let token = held.token();
    eprintln!("lockctl: {}", want.holding(token));

    let cmd = match supervise::spawn(program, program_args, &want.env(token), &session) {
        Ok(cmd) => cmd,
        Err(error) => {
            finish(Some(held), session).await;
            return Err(error.context(format!("cannot run {}", program.to_string_lossy())));
        }
    };
    let still_held = || held.is_valid() || session.state() != SessionState::Valid;
    let ended = cmd
        .supervise(&session, (grace, &still_held), &want.at_stake(), signals)
        .await;
    finish(Some(held), session).await;
    Ok(ended.context("waiting for CMD")?.code())
}

async fn open_session(proxy: &Target, options: SessionOptions) -> Result<Session, Error> {
    let client = proxy.connect().await?;
    client.open_session(options).await
}

/// Gives up what is held (if anything) and closes the session, within
/// [`FINISH_TIMEOUT`]. Failures only get logged: the session's TTL ends whatever a
/// failed call left behind.
async fn finish(held: Option<Held>, session: Session) {
    if tokio::time::timeout(FINISH_TIMEOUT, give_up_and_close(held, session))
        .await
        .is_err()
    {
        tracing::warn!(
            timeout = ?FINISH_TIMEOUT,
            "the proxy did not answer release and close in time; the session expires after its TTL"
        );
    }
}

async fn give_up_and_close(held: Option<Held>, session: Session) {
    if let Some(held) = held {
        held.give_up().await;
    }
    match session.close().await {
        Ok(released) => tracing::debug!(released, "session closed"),
        Err(error @ Error::SessionExpired { .. }) => tracing::info!(%error, "session already gone"),
        Err(error) => {
            tracing::warn!(%error, "closing the session failed; it expires after its TTL")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: FencingToken = FencingToken {
        epoch: 1,
        revision: 100,
    };
    const LOCK: Want<'static> = Want::Lock {
        name: "jobs/x",
        mode: Mode::Exclusive,
    };
    const SHARED: Want<'static> = Want::Lock {
        name: "jobs/x",
        mode: Mode::Shared,
    };
    const ELECTION: Want<'static> = Want::Leadership {
        election: "db/primary",
        value: "10.0.0.7:5432",
    };

    #[test]
    fn cmd_environment() {
        assert_eq!(
            LOCK.env(T),
            [
                ("LOCKCELL_LOCK", "jobs/x".to_owned()),
                ("LOCKCELL_TOKEN", "1:100".to_owned())
            ]
        );
        assert_eq!(SHARED.env(T), LOCK.env(T));
        assert_eq!(
            ELECTION.env(T),
            [
                ("LOCKCELL_ELECTION", "db/primary".to_owned()),
                ("LOCKCELL_TOKEN", "1:100".to_owned()),
                ("LOCKCELL_LEADER_VALUE", "10.0.0.7:5432".to_owned()),
            ]
        );
    }

    #[test]
    fn messages_name_what_is_held() {
        assert_eq!(LOCK.holding(T), "holding jobs/x with token 1:100");
        assert_eq!(SHARED.holding(T), "holding jobs/x shared with token 1:100");
        assert_eq!(
            ELECTION.holding(T),
            "leading db/primary as \"10.0.0.7:5432\" with token 1:100"
        );
        assert_eq!(LOCK.at_stake(), "lock jobs/x may pass to another holder");
        assert_eq!(
            ELECTION.at_stake(),
            "leadership of db/primary may pass to another session"
        );
    }

    #[test]
    fn not_granted_says_how_long_was_waited() {
        let ms = Duration::from_millis;
        assert_eq!(
            LOCK.not_granted(Wait::Timeout(ms(200))),
            "lock jobs/x still held after 200ms"
        );
        assert_eq!(LOCK.not_granted(Wait::Try), "lock jobs/x is held");
        assert_eq!(
            SHARED.not_granted(Wait::Try),
            "lock jobs/x is held exclusively"
        );
        assert_eq!(
            LOCK.not_granted(Wait::Forever),
            "lock jobs/x was not granted"
        );
        assert_eq!(
            ELECTION.not_granted(Wait::Timeout(ms(1500))),
            "election db/primary still led by another session after 1s 500ms"
        );
    }
}
