//! CMD under a hold (a lock, a leadership, a membership): run in a process group of its
//! own, told its session's deadline, and stopped, all of it, before the hold can pass
//! to anyone else.
//!
//! Each confirmed renewal moves the session's deadline a validity ahead (the TTL, or
//! less when the proxy's leases bound it), and renewals come every third of it, so the
//! time left stays above two thirds of it while they are confirmed. Once the time left
//! falls below the stop grace (at most a third of the validity: a renewal is overdue),
//! lockctl sends SIGTERM to CMD's process group, and SIGKILL to whatever is left just
//! before the deadline (by a twentieth of the validity, at most 50 ms, so a timer that
//! fires late is still in time). The proxy lets the hold go only after the
//! client's deadline has passed, so the next holder starts after CMD's group is gone. A
//! session the proxy says has ended, or a hold found lost when the session moved, is
//! past its deadline at once: SIGKILL.
//!
//! Signals go to CMD's process group and to every other live descendant of lockctl:
//! lockctl is their child subreaper, so what CMD started stays its descendant even when
//! it leaves the group (`setsid`, `setpgid`: `timeout`, `set -m`) or its parent ends.
//! When CMD ends by itself, what it left running is stopped the same way (SIGTERM,
//! then SIGKILL after the grace or before the deadline, whichever comes first) before
//! the hold is given up.
//!
//! What lockctl cannot do: stop CMD while it is itself stopped (SIGSTOP, a debugger)
//! or after it is killed with SIGKILL (the OOM killer). The deadline file then stops
//! moving, so a script that checks it stops on its own.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockcell_client::{Session, SessionState};
use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::exit::exit_code;
use crate::signals::Signals;

/// lockctl's status when it had to stop CMD because the hold could no longer be trusted
/// (the session's time left fell below the stop grace, or its deadline passed).
pub(crate) const EX_HOLD_LOST: u8 = 90;

/// How often the deadline is looked at again (and its file rewritten when it moved).
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// How long lockctl waits for CMD's group to be gone after SIGKILL before it gives up
/// waiting (a process stuck in the kernel, say) and says so.
const KILLED_WITHIN: Duration = Duration::from_secs(5);
/// The most SIGKILL goes out ahead of the deadline (see [`Validity::kill_at`]).
const KILL_AHEAD: Duration = Duration::from_millis(50);

/// How CMD ended, and what lockctl had to do to it.
#[derive(Debug)]
pub(crate) struct Ended {
    pub(crate) status: ExitStatus,
    /// Whether lockctl stopped CMD because the hold could no longer be trusted.
    pub(crate) hold_lost: bool,
    /// The signal lockctl was sent and passed on, if any.
    pub(crate) signalled: Option<u8>,
}

impl Ended {
    /// lockctl's exit status: [`EX_HOLD_LOST`] when it had to stop CMD for the hold,
    /// 128+N when it was sent signal N, CMD's own status otherwise.
    pub(crate) fn code(&self) -> u8 {
        if self.hold_lost {
            EX_HOLD_LOST
        } else if let Some(signo) = self.signalled {
            128 + signo
        } else {
            exit_code(self.status)
        }
    }
}

/// CMD, running in its own process group.
pub(crate) struct Cmd {
    child: Child,
    group: Pid,
    deadline: DeadlineFile,
}

/// Starts CMD in a process group of its own, with `env`, `LOCKCELL_DEADLINE` and
/// `LOCKCELL_DEADLINE_FILE` in its environment.
pub(crate) fn spawn(
    program: &OsString,
    args: &[OsString],
    env: &[(&str, String)],
    session: &Session,
) -> anyhow::Result<Cmd> {
    become_subreaper();
    let deadline = DeadlineFile::new(session.deadline())?;
    let child = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("LOCKCELL_DEADLINE", unix_ms(session.deadline()).to_string())
        .env("LOCKCELL_DEADLINE_FILE", deadline.path())
        .process_group(0)
        .spawn()?;
    let pid = child.id().expect("a child just spawned has a pid");
    let group = Pid::from_raw(i32::try_from(pid).expect("pids fit in i32"));
    Ok(Cmd {
        child,
        group,
        deadline,
    })
}

/// What lockctl has done to CMD for the hold's sake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ForHold {
    Nothing,
    /// SIGTERM: the time left fell below the grace.
    Termed,
    /// SIGKILL, and why.
    Killed(&'static str),
}

impl Cmd {
    /// Waits for CMD and everything it started to end, stopping them before the hold
    /// can pass on: SIGTERM once the time left is below `grace` (or a third of the
    /// validity, if that is less), SIGKILL just before the deadline; SIGKILL at once
    /// when the proxy ends the session or `still_held` says the hold itself is gone (a
    /// lock found lost when the session moved: another holder may have it already).
    /// A signal asking lockctl to stop is passed on as SIGTERM, a second as SIGKILL.
    /// `at_stake` says what the hold's loss may cost.
    pub(crate) async fn supervise(
        mut self,
        session: &Session,
        (grace, still_held): (Duration, &(dyn Fn() -> bool + Sync)),
        at_stake: &str,
        signals: &mut Signals,
    ) -> std::io::Result<Ended> {
        let mut for_hold = ForHold::Nothing;
        let mut signalled: Option<u8> = None;
        let mut validity = Validity::new(session.deadline());
        let status = loop {
            let deadline = session.deadline();
            self.deadline.update(deadline);
            let now = Instant::now();
            validity.observe(deadline, now);
            let grace = grace.min(validity.span / 3);
            let kill_at = validity.kill_at(deadline);
            let killed = match session.state() {
                SessionState::Expired => Some("the proxy ended the session"),
                SessionState::Valid if !still_held() => {
                    Some("the hold was found lost when the session moved")
                }
                _ if now >= kill_at => Some("the session's deadline came"),
                _ => None,
            };
            match (for_hold, killed) {
                (ForHold::Killed(_), _) => {}
                (_, Some(why)) => {
                    eprintln!("lockctl: {why} ({at_stake}); killing CMD and everything it started (SIGKILL)");
                    if let Some(reason) = session.expired_reason() {
                        eprintln!("lockctl: {reason}");
                    }
                    self.signal(Signal::SIGKILL);
                    for_hold = ForHold::Killed(why);
                }
                (ForHold::Nothing, None) if now + grace >= deadline => {
                    eprintln!(
                        "lockctl: no renewal of the session confirmed for a while: {} left before its deadline ({at_stake}); stopping CMD and everything it started (SIGTERM), SIGKILL at the deadline",
                        humantime::format_duration(round_ms(deadline.saturating_duration_since(now)))
                    );
                    self.signal(Signal::SIGTERM);
                    for_hold = ForHold::Termed;
                }
                (ForHold::Termed, None) if now + grace < deadline => {
                    eprintln!(
                        "lockctl: a renewal got through: {} left before the session's deadline again; CMD was sent SIGTERM already and is no longer being stopped for the hold",
                        humantime::format_duration(round_ms(deadline.saturating_duration_since(now)))
                    );
                    for_hold = ForHold::Nothing;
                }
                _ => {}
            }
            // Awake in time for the next step, and every LOOK_EVERY to follow renewals.
            let mut wake = now + LOOK_EVERY;
            if for_hold == ForHold::Nothing {
                wake = wake.min(deadline.checked_sub(grace).unwrap_or(now));
            }
            wake = wake.min(kill_at).max(now);
            tokio::select! {
                status = self.child.wait() => break status?,
                () = tokio::time::sleep_until(wake) => {}
                signo = signals.recv() => {
                    if signalled.is_some() {
                        eprintln!("lockctl: {} again; killing CMD and everything it started (SIGKILL)", signal_name(signo));
                        self.signal(Signal::SIGKILL);
                    } else {
                        eprintln!("lockctl: {}; stopping CMD and everything it started (SIGTERM)", signal_name(signo));
                        self.signal(Signal::SIGTERM);
                        signalled = Some(signo);
                    }
                }
            }
        };
        let grace = grace.min(validity.span / 3);
        self.stop_the_rest(
            session,
            (grace, &mut validity),
            for_hold,
            signalled.is_some(),
        )
        .await;
        match for_hold {
            ForHold::Killed(why) => eprintln!(
                "lockctl: CMD was killed ({why}; {}); exiting {EX_HOLD_LOST}",
                describe(status)
            ),
            ForHold::Termed => eprintln!(
                "lockctl: CMD ended after SIGTERM, before the session's deadline ({}); exiting {EX_HOLD_LOST}",
                describe(status)
            ),
            ForHold::Nothing => {}
        }
        Ok(Ended {
            status,
            hold_lost: for_hold != ForHold::Nothing,
            signalled,
        })
    }

    /// Once CMD has ended: stops what it left running (SIGTERM, unless it was sent one
    /// already, then SIGKILL after the grace or just before the deadline, whichever is
    /// first; SIGKILL at once if the hold is already gone) and waits until nothing of
    /// it is left.
    async fn stop_the_rest(
        &mut self,
        session: &Session,
        (grace, validity): (Duration, &mut Validity),
        for_hold: ForHold,
        signalled: bool,
    ) {
        reap();
        if self.nothing_left() {
            return;
        }
        let started = Instant::now();
        let mut killed_at = None;
        match for_hold {
            ForHold::Killed(_) => {
                self.signal(Signal::SIGKILL);
                killed_at = Some(started);
            }
            ForHold::Termed => {}
            ForHold::Nothing if signalled => {}
            ForHold::Nothing => {
                eprintln!("lockctl: CMD ended; stopping what it left running (SIGTERM)");
                self.signal(Signal::SIGTERM);
            }
        }
        loop {
            reap();
            if self.nothing_left() {
                return;
            }
            let now = Instant::now();
            let deadline = session.deadline();
            self.deadline.update(deadline);
            validity.observe(deadline, now);
            let gone =
                session.state() == SessionState::Expired || now >= validity.kill_at(deadline);
            match killed_at {
                None if gone || now >= started + grace => {
                    eprintln!("lockctl: what CMD started is still running; killing it (SIGKILL)");
                    self.signal(Signal::SIGKILL);
                    killed_at = Some(now);
                }
                Some(at) if now >= at + KILLED_WITHIN => {
                    eprintln!(
                        "lockctl: processes CMD started are still there {} after SIGKILL (stuck in the kernel?); giving up waiting for them",
                        humantime::format_duration(KILLED_WITHIN)
                    );
                    return;
                }
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `signal` to CMD's process group and to every other process lockctl
    /// started, also one that left the group (`setsid`, `setpgid`: `timeout`, `set -m`).
    fn signal(&self, signal: Signal) {
        match killpg(self.group, signal) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(errno) => eprintln!(
                "lockctl: cannot send {signal} to CMD's process group {}: {errno}",
                self.group
            ),
        }
        for pid in descendants() {
            match kill(pid, signal) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(errno) => eprintln!("lockctl: cannot send {signal} to process {pid}: {errno}"),
            }
        }
    }

    /// Whether nothing CMD started is left: no process in its group, and no other
    /// descendant of lockctl alive.
    fn nothing_left(&self) -> bool {
        matches!(killpg(self.group, None), Err(Errno::ESRCH)) && descendants().is_empty()
    }
}

/// How far each confirmed renewal moves the deadline (the validity a renewal gives:
/// the time left just after one). Renewals come every third of it.
struct Validity {
    span: Duration,
    last_deadline: Instant,
}

impl Validity {
    fn new(deadline: Instant) -> Validity {
        Validity {
            span: deadline.saturating_duration_since(Instant::now()),
            last_deadline: deadline,
        }
    }

    fn observe(&mut self, deadline: Instant, now: Instant) {
        if deadline > self.last_deadline {
            self.last_deadline = deadline;
            self.span = deadline.saturating_duration_since(now);
        }
    }

    /// When SIGKILL goes out: a little before the deadline (a twentieth of the
    /// validity, at most KILL_AHEAD), so a timer that fires late still fires in time.
    fn kill_at(&self, deadline: Instant) -> Instant {
        let ahead = KILL_AHEAD.min(self.span / 20);
        deadline.checked_sub(ahead).unwrap_or(deadline)
    }
}

/// Reaps every child of lockctl that has ended: once CMD is reaped, they are what CMD
/// left (lockctl is their subreaper).
fn reap() {
    while let Ok(status) = waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
        if status == WaitStatus::StillAlive {
            break;
        }
    }
}

/// lockctl's live descendants (zombies aside): CMD and all it started, wherever their
/// process groups are, since orphans among them become lockctl's children. Empty
/// where /proc cannot say.
fn descendants() -> Vec<Pid> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // (pid, parent) of every live process.
    let mut parents: Vec<(i32, i32)> = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let mut fields = rest.split(' ');
        let (Some(state), Some(ppid)) = (fields.next(), fields.next()) else {
            continue;
        };
        if state == "Z" || state == "X" {
            continue;
        }
        if let Ok(ppid) = ppid.parse() {
            parents.push((pid, ppid));
        }
    }
    let mut found = vec![me];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    found.into_iter().skip(1).map(Pid::from_raw).collect()
}

fn signal_name(signo: u8) -> &'static str {
    Signal::try_from(i32::from(signo)).map_or("a signal", |s| s.as_str())
}

/// Makes lockctl the child subreaper of its descendants: an orphan of CMD's group
/// becomes lockctl's child, which it reaps, rather than init's.
fn become_subreaper() {
    if let Err(errno) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::debug!(%errno, "cannot become a child subreaper");
    }
}

/// `LOCKCELL_DEADLINE_FILE`: the session's deadline in Unix milliseconds, rewritten
/// (by rename, so a reader never sees half a number) whenever it moves, in a folder
/// only lockctl's user can write; removed with it.
struct DeadlineFile {
    dir: tempfile::TempDir,
    written: Option<u128>,
}

impl DeadlineFile {
    fn new(deadline: Instant) -> anyhow::Result<DeadlineFile> {
        let dir = tempfile::Builder::new().prefix("lockctl-").tempdir()?;
        let mut file = DeadlineFile { dir, written: None };
        file.write(deadline)?;
        Ok(file)
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("deadline")
    }

    fn update(&mut self, deadline: Instant) {
        if let Err(error) = self.write(deadline) {
            tracing::warn!(%error, "cannot rewrite the deadline file");
        }
    }

    fn write(&mut self, deadline: Instant) -> std::io::Result<()> {
        let ms = unix_ms(deadline);
        if self.written == Some(ms) {
            return Ok(());
        }
        let next = self.dir.path().join("deadline.next");
        std::fs::write(&next, format!("{ms}\n"))?;
        std::fs::rename(&next, self.path())?;
        self.written = Some(ms);
        Ok(())
    }
}

/// `at` as milliseconds since the Unix epoch (by the wall clock now).
fn unix_ms(at: Instant) -> u128 {
    let now = Instant::now();
    let wall = SystemTime::now();
    let wall_at = if at >= now {
        wall + (at - now)
    } else {
        wall - (now - at)
    };
    wall_at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

/// CMD's end, for messages.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signo)) => match Signal::try_from(signo) {
            Ok(signal) => format!("killed by {signal}"),
            Err(_) => format!("killed by signal {signo}"),
        },
        _ => status.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;

    use super::*;

    #[test]
    fn a_lost_hold_outranks_a_signal_and_cmds_status() {
        let ended = |raw, hold_lost, signalled| Ended {
            status: ExitStatus::from_raw(raw),
            hold_lost,
            signalled,
        };
        assert_eq!(ended(3 << 8, false, None).code(), 3);
        assert_eq!(ended(15, false, None).code(), 128 + 15);
        assert_eq!(ended(0, false, Some(2)).code(), 128 + 2);
        assert_eq!(ended(0, true, Some(2)).code(), EX_HOLD_LOST);
        assert_eq!(ended(9, true, None).code(), EX_HOLD_LOST);
    }

    #[test]
    fn deadlines_are_unix_milliseconds() {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis();
        let later = unix_ms(Instant::now() + Duration::from_secs(10));
        assert!(
            (now_ms + 9_900..=now_ms + 10_100).contains(&later),
            "{later} vs {now_ms}"
        );
        let earlier = unix_ms(Instant::now() - Duration::from_secs(1));
        assert!(earlier < now_ms);
    }

    #[test]
    fn the_deadline_file_is_replaced_whole() {
        let at = Instant::now() + Duration::from_secs(5);
        let mut file = DeadlineFile::new(at).unwrap();
        let first: u128 = std::fs::read_to_string(file.path())
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        file.update(at + Duration::from_secs(3));
        let second: u128 = std::fs::read_to_string(file.path())
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(second >= first + 2_900, "{first} then {second}");
        let path = file.path();
        drop(file);
        assert!(!path.exists(), "removed with lockctl");
    }
}
