//! A child process that is killed when its handle drops, with its output in a log file.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A running child process owned by a test.
pub struct Managed {
    /// What it is, for messages ("etcd a", "proxy b").
    pub name: String,
    pub log: PathBuf,
    child: Option<Child>,
    /// How it was started, to start it again.
    program: OsString,
    args: Vec<OsString>,
    envs: Vec<(OsString, Option<OsString>)>,
}

impl Managed {
    /// Starts `command` with stdout and stderr appended to `log`.
    pub fn spawn(
        name: impl Into<String>,
        mut command: Command,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let name = name.into();
        let program = command.get_program().to_owned();
        let args = command.get_args().map(ToOwned::to_owned).collect();
        let envs = command
            .get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)))
            .collect();
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening log {}", log.display()))?;
        let err = out.try_clone()?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name} ({command:?})"))?;
        Ok(Managed {
            name,
            log: log.to_path_buf(),
            child: Some(child),
            program,
            args,
            envs,
        })
    }

    /// Starts the process again as it was first started (killing it first if it still
    /// runs), its output appended to the same log: a member or client coming back.
    pub fn respawn(&mut self) -> anyhow::Result<()> {
        self.kill();
        let mut command = Command::new(&self.program);
        command.args(&self.args);
        for (key, value) in &self.envs {
            match value {
                Some(value) => command.env(key, value),
                None => command.env_remove(key),
            };
        }
        let again = Managed::spawn(self.name.clone(), command, &self.log)?;
        *self = again;
        Ok(())
    }

    /// Starts the process again as [`Managed::respawn`] does, with `env` added to its
    /// environment from now on.
    pub fn respawn_with_env(&mut self, env: &[(String, String)]) -> anyhow::Result<()> {
        for (key, value) in env {
            self.envs.retain(|(k, _)| k != key.as_str());
            self.envs.push((key.into(), Some(value.into())));
        }
        self.respawn()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (SIGKILL, SIGTERM, SIGSTOP, ...).
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let pid = self
            .pid()
            .with_context(|| format!("{} is not running", self.name))?;
        kill(Pid::from_raw(pid as i32), signal)
            .with_context(|| format!("sending {signal} to {}", self.name))
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Waits up to `within` for the process to exit by itself and returns its status.
    pub async fn wait_exit(
        &mut self,
        within: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let name = self.name.clone();
        let child = self
            .child
            .as_mut()
            .with_context(|| format!("{name} was already reaped"))?;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!("{name} did not exit within {within:?}");
            }
            tokio::time::sleep(crate::wait::POLL).await;
        }
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits up to `grace` for the exit, then kills. Returns whether it
    /// exited by itself.
    pub fn stop(&mut self, grace: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        // A thread waits for the exit; this one waits for its word, up to `grace`.
        let (exited_tx, exited) = std::sync::mpsc::channel();
        let reaper = std::thread::spawn(move || {
            let _ = child.wait();
            let _ = exited_tx.send(());
        });
        let by_itself = exited.recv_timeout(grace).is_ok();
        if !by_itself {
            let _ = kill(pid, Signal::SIGKILL);
        }
        let _ = reaper.join();
        by_itself
    }

    /// The last lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of a file ("" when unreadable).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
