//! Declared configuration: files kept in Git and loaded by the
//! proxy — lock classes, prefix grants — and the [`Book`] that keeps the last good file
//! of each in force across reloads.
//!
//! A file is reloaded on SIGHUP and when it changes; a bad file is refused (logged,
//! counted) and the last good one stays in force. At start a bad file stops the proxy,
//! since there is no last good one yet.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

/// What a declared file holds once parsed.
pub trait Declared: Sized + Send + Sync + 'static {
    /// What the file declares, in logs ("lock classes").
    const WHAT: &'static str;
    /// Counters of reloads put in force and of files refused.
    const RELOADS: &'static str;
    const RELOAD_FAILURES: &'static str;

    /// Parses and validates the file; `file` is only used in error messages.
    fn parse(text: &str, file: &Path) -> Result<Self, FileError>;

    /// How many entries it declares (for logs).
    fn count(&self) -> usize;
}

/// Why a declared file was refused. Names the file, the line (when known) and the
/// field: "deploy/config/classes.toml:12: class batch: ttl_min (10s) is above ttl_max (5s)".
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", location(.file, .line))]
pub struct FileError {
    pub file: PathBuf,
    /// 1-based; None when the error is not about one place (e.g. an unreadable file).
    pub line: Option<usize>,
    pub message: String,
}

fn location(file: &Path, line: &Option<usize>) -> String {
    match line {
        Some(line) => format!("{}:{line}", file.display()),
        None => file.display().to_string(),
    }
}

/// The declarations in force, reloaded on SIGHUP and when the file changes; a bad file
/// is refused (logged with tracing::error!, counted) and the last good one stays.
pub struct Book<T> {
    /// None: the proxy runs on its built-in declarations and there is nothing to reload.
    path: Option<PathBuf>,
    /// Swapped whole, so a request that took one `Arc` sees one consistent file.
    current: RwLock<Arc<T>>,
    /// The file in force. Held for a whole reload, so a SIGHUP and a file change
    /// racing cannot install the older of two files last.
    in_force: Mutex<InForce>,
}

struct InForce {
    /// The text of the file in force: a reload of identical text is not a change.
    text: String,
    /// The file's stamp taken just before that text was read, so `follow` notices a
    /// change made between `load` and its start.
    stamp: Stamp,
}

impl<T: Declared> Book<T> {
    /// Loads `path` (error if it is missing or bad: the proxy refuses to start with a
    /// bad file, since it has no last good one), or uses `fallback` when `path` is None.
    pub fn load(path: Option<PathBuf>, fallback: T) -> Result<Book<T>, FileError> {
        let Some(path) = path else {
            return Ok(Book {
                path: None,
                current: RwLock::new(Arc::new(fallback)),
                in_force: Mutex::new(InForce {
                    text: String::new(),
                    stamp: Stamp::default(),
                }),
            });
        };
        let stamp = Stamp::of(&path);
        let text = read::<T>(&path)?;
        let declared = T::parse(&text, &path)?;
        tracing::info!(
            file = %path.display(),
            count = declared.count(),
            "{} loaded",
            T::WHAT
        );
        Ok(Book {
            path: Some(path),
            current: RwLock::new(Arc::new(declared)),
            in_force: Mutex::new(InForce { text, stamp }),
        })
    }

    /// The declarations in force; cheap (an `Arc` clone), so call it once per request.
    pub fn current(&self) -> Arc<T> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Reads the file again; Ok(true) if new declarations are in force, Ok(false) if
    /// the content is unchanged (or there is no file), Err if refused.
    pub fn reload(&self) -> Result<bool, FileError> {
        let Some(path) = &self.path else {
            return Ok(false);
        };
        // The guard only orders reloads; the data it guards stays consistent even if
        // a holder panicked, so a poisoned lock is still usable.
        let mut in_force = self.in_force.lock().unwrap_or_else(PoisonError::into_inner);
        let stamp = Stamp::of(path);
        let text = match read::<T>(path) {
            Ok(text) if text == in_force.text => {
                in_force.stamp = stamp;
                return Ok(false);
            }
            Ok(text) => text,
            Err(e) => return Err(refused::<T>(e)),
        };
        let declared = T::parse(&text, path).map_err(refused::<T>)?;
        let count = declared.count();
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(declared);
        *in_force = InForce { text, stamp };
        metrics::counter!(T::RELOADS).increment(1);
        tracing::info!(file = %path.display(), count, "{} reloaded", T::WHAT);
        Ok(true)
    }

    /// Runs until `shutdown` turns true (or its sender goes): reloads on SIGHUP and
    /// when the file's modification time or length changes (checked every `poll`). A
    /// change is applied once the file has looked the same for one more poll, so a
    /// file caught half-written is not read.
    pub async fn follow(self: Arc<Self>, poll: Duration, mut shutdown: watch::Receiver<bool>) {
        let Some(path) = self.path.clone() else {
            let _ = shutdown.wait_for(|s| *s).await;
            return;
        };
        let mut hangup = hangup_signal(T::WHAT);
        let mut seen = self
            .in_force
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stamp
            .clone();
        let mut last = seen.clone();
        // tokio's interval panics on a zero period.
        let poll = poll.max(Duration::from_millis(1));
        let mut tick = tokio::time::interval_at(Instant::now() + poll, poll);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                Some(()) = next_hangup(&mut hangup) => {
                    tracing::info!(file = %path.display(), "SIGHUP: reloading {}", T::WHAT);
                    seen = Stamp::of(&path);
                    last = seen.clone();
                    // A refusal is logged and counted by reload itself.
                    let _ = self.reload();
                }
                _ = tick.tick() => {
                    // A stat of a small local file: cheaper than a hop to the
                    // blocking pool, like the read that may follow.
                    let now = Stamp::of(&path);
                    if now != seen && now == last {
                        seen = now.clone();
                        let _ = self.reload();
                    }
                    last = now;
                }
            }
        }
    }
}

fn refused<T: Declared>(e: FileError) -> FileError {
    metrics::counter!(T::RELOAD_FAILURES).increment(1);
    tracing::error!(
        file = %e.file.display(),
        error = %e,
        "{} file refused; the last good one stays in force",
        T::WHAT
    );
    e
}

fn read<T: Declared>(path: &Path) -> Result<String, FileError> {
    std::fs::read_to_string(path).map_err(|e| FileError {
        file: path.to_owned(),
        line: None,
        message: format!("cannot read the {} file: {e}", T::WHAT),
    })
}

/// What `follow` compares between polls: modification time and length, and the inode,
/// so a file replaced by rename is noticed even with the same time and length. `None`
/// while the file is missing.
#[derive(Debug, Clone, Default, PartialEq)]
struct Stamp(Option<(Option<SystemTime>, u64, u64)>);

impl Stamp {
    fn of(path: &Path) -> Stamp {
        Stamp(
            std::fs::metadata(path)
                .ok()
                .map(|m| (m.modified().ok(), m.len(), m.ino())),
        )
    }
}

fn hangup_signal(what: &str) -> Option<Signal> {
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; {what} reload only when their file changes");
            None
        }
    }
}

/// The next SIGHUP, or never when there is no signal to listen to.
async fn next_hangup(hangup: &mut Option<Signal>) -> Option<()> {
    match hangup {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}
