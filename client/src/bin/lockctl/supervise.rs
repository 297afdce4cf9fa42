//! CMD under a hold (a lock, a leadership, a membership): run in a process group of its
//! own, told its session's deadline, and stopped, all of it, before the hold can pass
//! to anyone else.
//!
//! Each confirmed renewal moves the session's deadline a validity ahead (the TTL, or
//! less when the proxy's leases bound it), and renewals come every third of it, so the
//! time left stays above two thirds of it while they are confirmed. Once the time left
//! falls below the stop grace (at most a third of the validity: a renewal is overdue),
//! lockctl sends SIGTERM to CMD's process group, and SIGKILL at the deadline to
//! whatever of the group is left. The proxy lets the hold go only after the
//! client's deadline has passed, so the next holder starts after CMD's group is gone. A
//! session the proxy says has ended, or a hold found lost when the session moved, is
//! past its deadline at once: SIGKILL.
//!
//! When CMD ends by itself, what it left running in its group is stopped the same way
//! (SIGTERM, then SIGKILL after the grace or at the deadline, whichever comes first)
//! before the hold is given up. lockctl is the group's child subreaper, so the group's
//! orphans are its children, and it reaps them.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockcell_client::{Session, SessionState};
use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
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

/// Why lockctl stopped CMD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The time left before the session's deadline fell below the stop grace: SIGTERM.
    Jeopardy,
    /// The deadline passed, the proxy ended the session, or the hold was lost, with the
    /// group still there: SIGKILL.
    Deadline,
    /// lockctl was sent this signal (SIGINT or SIGTERM) and passed SIGTERM on.
    Signal(u8),
}

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

impl Cmd {
    /// Waits for CMD and its process group to end, stopping them before the hold can
    /// pass on (SIGTERM once the time left is below `grace`, or a third of the
    /// validity if that is less; SIGKILL at the deadline),
    /// and when lockctl is sent SIGINT or SIGTERM. `at_stake` says what the hold's loss
    /// may cost.
    /// `still_held` says whether the hold itself is still this session's (a lock found
    /// gone when the session moved is lost at once, with the session valid): once it is
    /// not, the group gets SIGKILL at once, since another holder may have it already.
    pub(crate) async fn supervise(
        mut self,
        session: &Session,
        (grace, still_held): (Duration, &(dyn Fn() -> bool + Sync)),
        at_stake: &str,
        signals: &mut Signals,
    ) -> std::io::Result<Ended> {
        let mut stops: Vec<Stop> = Vec::new();
        // The validity a renewal gives (the time left just after one): renewals come
        // every third of it, so the time left stays above two thirds of it while they
        // are confirmed. The grace used is at most a third of it.
        let mut last_deadline = session.deadline();
        let mut validity = last_deadline.saturating_duration_since(Instant::now());
        let status = loop {
            let deadline = session.deadline();
            self.deadline.update(deadline);
            let expired = session.state() == SessionState::Expired;
            let lost = !still_held() && session.state() == SessionState::Valid;
            let now = Instant::now();
            if deadline > last_deadline {
                last_deadline = deadline;
                validity = deadline.saturating_duration_since(now);
            }
            let grace = grace.min(validity / 3);
            if (now >= deadline || expired || lost) && !stops.contains(&Stop::Deadline) {
                stops.push(Stop::Deadline);
                let why = if lost {
                    "the hold was lost (found gone when the session moved)"
                } else if expired {
                    "the proxy ended the session"
                } else {
                    "the session's deadline passed"
                };
                eprintln!("lockctl: {why} ({at_stake}); killing CMD's process group (SIGKILL)");
                if let Some(reason) = session.expired_reason() {
                    eprintln!("lockctl: {reason}");
                }
                self.signal(Signal::SIGKILL);
            } else if now + grace >= deadline && !stops.contains(&Stop::Jeopardy) {
                stops.push(Stop::Jeopardy);
                eprintln!(
                    "lockctl: no renewal of the session confirmed for a while: {} left before its deadline ({at_stake}); stopping CMD's process group (SIGTERM), SIGKILL at the deadline",
                    humantime::format_duration(round_ms(deadline.saturating_duration_since(now)))
                );
                self.signal(Signal::SIGTERM);
            }
            tokio::select! {
                status = self.child.wait() => break status?,
                () = tokio::time::sleep(LOOK_EVERY) => {}
                signo = signals.recv() => {
                    if stops.iter().any(|s| matches!(s, Stop::Signal(_))) {
                        eprintln!("lockctl: signal {signo} again; killing CMD's process group (SIGKILL)");
                        self.signal(Signal::SIGKILL);
                    } else {
                        eprintln!("lockctl: signal {signo}; stopping CMD's process group (SIGTERM)");
                        self.signal(Signal::SIGTERM);
                    }
                    stops.push(Stop::Signal(signo));
                }
            }
        };
        self.stop_the_rest(session, grace, &mut stops).await;
        let hold_lost = stops
            .iter()
            .any(|s| matches!(s, Stop::Jeopardy | Stop::Deadline));
        if hold_lost {
            let killed = stops.contains(&Stop::Deadline);
            eprintln!(
                "lockctl: CMD {} ({}); exiting {EX_HOLD_LOST}",
                if killed {
                    "was killed: the hold was lost, the session's deadline passed, or the proxy ended it"
                } else {
                    "ended after SIGTERM, within the stop grace"
                },
                describe(status)
            );
        }
        Ok(Ended {
            status,
            hold_lost,
            signalled: stops.iter().find_map(|s| match s {
                Stop::Signal(signo) => Some(*signo),
                _ => None,
            }),
        })
    }

    /// Once CMD has ended: stops what it left running in its process group (SIGTERM,
    /// then SIGKILL after `grace` or at the deadline, whichever is first) and waits
    /// until none of the group is left.
    async fn stop_the_rest(&mut self, session: &Session, grace: Duration, stops: &mut Vec<Stop>) {
        self.reap();
        if self.group_gone() {
            return;
        }
        if !stops
            .iter()
            .any(|s| matches!(s, Stop::Jeopardy | Stop::Signal(_)))
        {
            eprintln!(
                "lockctl: CMD ended; stopping what it left running in its process group (SIGTERM)"
            );
            self.signal(Signal::SIGTERM);
        }
        let term_sent = Instant::now();
        let mut killed_at = None;
        loop {
            self.reap();
            if self.group_gone() {
                return;
            }
            let now = Instant::now();
            let deadline = session.deadline();
            self.deadline.update(deadline);
            let expired = session.state() == SessionState::Expired;
            match killed_at {
                None if now >= deadline || expired || now >= term_sent + grace => {
                    if now >= deadline || expired {
                        stops.push(Stop::Deadline);
                    }
                    eprintln!("lockctl: CMD's process group is still there; killing it (SIGKILL)");
                    self.signal(Signal::SIGKILL);
                    killed_at = Some(now);
                }
                Some(at) if now >= at + KILLED_WITHIN => {
                    eprintln!(
                        "lockctl: processes of CMD's process group {} are still there {} after SIGKILL; giving up waiting for them",
                        self.group,
                        humantime::format_duration(KILLED_WITHIN)
                    );
                    return;
                }
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn signal(&self, signal: Signal) {
        match killpg(self.group, signal) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(errno) => eprintln!(
                "lockctl: cannot send {signal} to CMD's process group {}: {errno}",
                self.group
            ),
        }
    }

    /// Whether no process of CMD's group is left (zombies of lockctl's own reaped).
    fn group_gone(&self) -> bool {
        matches!(killpg(self.group, None), Err(Errno::ESRCH))
    }

    /// Reaps the group's processes that have ended and are lockctl's children (CMD's
    /// orphans, lockctl being their subreaper). Called only once CMD itself is reaped.
    fn reap(&self) {
        let any_of_group = Pid::from_raw(-self.group.as_raw());
        while let Ok(status) = waitpid(any_of_group, Some(WaitPidFlag::WNOHANG)) {
            if status == WaitStatus::StillAlive {
                break;
            }
        }
    }
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
