//! Keeps a proxy from serving a cell that changed under it.
//!
//! Fencing tokens are `EPOCH:REVISION`, and they only rise if every grant of an epoch is
//! made at a higher revision than every grant before it. A restore from backup takes the
//! store's revisions back; `lockcell-cell bump-epoch` then raises the epoch so tokens rise
//! again. Three checks hold a proxy to that:
//! - every grant transaction compares the epoch record it started with
//!   ([`LockLog::with_epoch_guard`](lockcell_cell::locklog::LockLog::with_epoch_guard)),
//!   so no token of the old epoch is minted after a bump;
//! - a fresh grant's revision must be above every revision the proxy saw before it
//!   sent the grant (etcd applies a write after everything it had committed), so a store
//!   restored under a running proxy without a bump is noticed at the first grant. The
//!   proxy raises what it has seen from its grants, its lock-log watches and its lease
//!   renewals, so it knows the cell's revision even when it grants little itself; a
//!   watch whose store answers below where the watch had got to is checked with a
//!   linearizable read;
//! - the proxy watches the epoch record: any change to it stops the proxy, so no read
//!   (a sequencer check, a leader) is answered with the old epoch either;
//! - with `--state-dir`, the proxy remembers the cell across restarts and refuses, at
//!   start, a cell whose cluster id changed, whose epoch went backwards, or whose revision
//!   is below the one it saw in the same epoch.
//!
//! A proxy that finds its cell changed stops granting, drains and exits with an error.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use etcd_client::{GetOptions, WatchOptions};
use tokio::sync::watch;

use lockcell_cell::epoch::{EpochRecord, Stored};
use lockcell_cell::CellError;
use serde::{Deserialize, Serialize};

/// What the proxy knows of its cell while it runs.
pub struct CellGuard {
    pub record: EpochRecord,
    /// Highest store revision the proxy has seen.
    seen: AtomicI64,
    /// Why the proxy stopped trusting the cell, once it did.
    changed: OnceLock<String>,
    remembered_at: Option<PathBuf>,
    /// Turned true to drain the proxy once the cell is found changed.
    drain: Option<Arc<watch::Sender<bool>>>,
}

/// The file a proxy keeps in `--state-dir`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remembered {
    pub cluster_id: String,
    pub epoch: u64,
    pub revision: i64,
}

const FILE: &str = "cell.json";

impl CellGuard {
    /// The guard of a proxy that starts on `stored` with the store at `revision`, after
    /// checking them against what `state_dir` remembers (and remembering them there).
    pub fn start(
        stored: &Stored,
        revision: i64,
        state_dir: Option<&Path>,
    ) -> anyhow::Result<CellGuard> {
        let remembered_at = state_dir.map(|dir| dir.join(FILE));
        if let Some(path) = &remembered_at {
            if let Some(before) = load(path)? {
                check(&before, &stored.record, revision).map_err(|reason| {
                    anyhow::anyhow!(
                        "refusing to serve: {reason} (remembered in {})",
                        path.display()
                    )
                })?;
            }
        }
        let guard = CellGuard {
            record: stored.record.clone(),
            seen: AtomicI64::new(revision),
            changed: OnceLock::new(),
            remembered_at,
            drain: None,
        };
        guard.remember()?;
        Ok(guard)
    }

    /// The highest store revision seen so far.
    pub fn seen(&self) -> i64 {
        self.seen.load(Ordering::Relaxed)
    }

    /// Notes a store revision from an etcd reply.
    pub fn saw(&self, revision: i64) {
        self.seen.fetch_max(revision, Ordering::Relaxed);
    }

    /// Checks a fresh grant made at `revision` by a transaction sent when the highest
    /// revision seen was `seen_before`.
    pub fn check_grant(&self, revision: i64, seen_before: i64) -> Result<(), CellError> {
        if revision > seen_before {
            self.saw(revision);
            return Ok(());
        }
        Err(CellError::CellChanged {
            reason: format!(
                "a grant was made at revision {revision}, not above revision {seen_before} seen before it: the store's revisions went backwards (restored from a backup without `lockcell-cell bump-epoch`?)"
            ),
        })
    }

    /// Drains the proxy (through `drain`) when the cell is found changed.
    pub fn draining_with(mut self, drain: Arc<watch::Sender<bool>>) -> Self {
        self.drain = Some(drain);
        self
    }

    /// Stops trusting the cell: no more grants, a drain, and an error exit.
    pub fn set_changed(&self, reason: &str) {
        if self.changed.set(reason.to_owned()).is_ok() {
            tracing::error!(%reason, "the cell changed under this proxy; granting nothing more, draining and stopping");
            if let Some(drain) = &self.drain {
                drain.send_if_modified(|d| !std::mem::replace(d, true));
            }
        }
    }

    /// A reply from the store said a revision below `expected`, which the proxy had
    /// already seen: unless a linearizable read says otherwise (the reply came from a
    /// member that lags), the store went back.
    pub async fn check_not_behind(
        &self,
        etcd: &etcd_client::Client,
        expected: i64,
        timeout: Duration,
    ) {
        let mut kv = etcd.kv_client();
        let read = kv.get(
            lockcell_cell::keyspace::epoch_key(),
            Some(GetOptions::new().with_count_only()),
        );
        let revision = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(resp)) => resp.header().map(|h| h.revision()).unwrap_or_default(),
            // Unknown: a later grant's own check decides.
            _ => return,
        };
        if revision > 0 && revision < expected {
            self.set_changed(&format!(
                "the store is at revision {revision}, below revision {expected} this proxy had seen: it was restored from a backup"
            ));
        }
    }

    /// Watches the epoch record from after `from`: any change stops the proxy.
    pub async fn watch_record(self: Arc<Self>, etcd: etcd_client::Client, from: i64) {
        let key = lockcell_cell::keyspace::epoch_key();
        loop {
            let mut client = etcd.watch_client();
            let options = WatchOptions::new().with_start_revision(from + 1);
            let mut stream = match client.watch(key, Some(options)).await {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "the epoch record watch could not start; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            let _counted = crate::metrics::Counted::in_gauge(crate::metrics::ETCD_WATCHES);
            while let Ok(Some(resp)) = stream.message().await {
                if let Some(event) = resp.events().first() {
                    let at = event.kv().map(|kv| kv.mod_revision()).unwrap_or_default();
                    self.set_changed(&format!(
                        "the epoch record {key} was rewritten at revision {at}: the cell's epoch was raised (a restore from backup); restart the proxy to serve the new epoch"
                    ));
                    return;
                }
                if resp.compact_revision() > 0 || resp.canceled() {
                    break;
                }
            }
            if self.changed().is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Why the proxy stopped trusting its cell, if it did.
    pub fn changed(&self) -> Option<&str> {
        self.changed.get().map(String::as_str)
    }

    /// Writes what the proxy knows to `--state-dir` (whole, then renamed into place).
    pub fn remember(&self) -> anyhow::Result<()> {
        let Some(path) = &self.remembered_at else {
            return Ok(());
        };
        let now = Remembered {
            cluster_id: self.record.cluster_id.clone(),
            epoch: self.record.epoch,
            revision: self.seen(),
        };
        let tmp = path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&tmp, serde_json::to_vec_pretty(&now).expect("serializes"))?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
    }

    /// Remembers the highest revision every `every` until the proxy stops.
    pub async fn keep_remembering(&self, every: Duration) {
        if self.remembered_at.is_none() {
            return;
        }
        let mut last = self.seen();
        loop {
            tokio::time::sleep(every).await;
            if self.changed().is_some() {
                return;
            }
            let seen = self.seen();
            if seen != last {
                if let Err(e) = self.remember() {
                    tracing::warn!(error = %e, "could not remember the cell's revision");
                }
                last = seen;
            }
        }
    }
}

fn load(path: &Path) -> anyhow::Result<Option<Remembered>> {
    match std::fs::read(path) {
        Ok(body) => serde_json::from_slice(&body).map(Some).map_err(|e| {
            anyhow::anyhow!(
                "{} is not readable: {e}; move it away to start afresh",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
    }
}

/// Whether a proxy that remembers `before` may serve a cell with `now` at `revision`.
pub fn check(before: &Remembered, now: &EpochRecord, revision: i64) -> Result<(), String> {
    if now.cluster_id != before.cluster_id {
        return Err(format!(
            "the cell's cluster id is {:?}, but this proxy served cluster {:?}: etcd is another cell, or this cell's data was lost and created anew",
            now.cluster_id, before.cluster_id
        ));
    }
    if now.epoch < before.epoch {
        return Err(format!(
            "the cell's epoch went backwards, from {} to {}",
            before.epoch, now.epoch
        ));
    }
    if now.epoch == before.epoch && revision < before.revision {
        return Err(format!(
            "the store is at revision {revision}, below revision {} this proxy saw in epoch {}: the cell was restored from a backup and its epoch not raised; run `lockcell-cell bump-epoch` before serving it, or tokens would go backwards",
            before.revision, now.epoch
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(cluster: &str, epoch: u64) -> EpochRecord {
        EpochRecord {
            cluster_id: cluster.to_owned(),
            epoch,
        }
    }

    #[test]
    fn a_remembered_cell_is_served_only_if_it_did_not_go_back() {
        let before = Remembered {
            cluster_id: "c1".into(),
            epoch: 2,
            revision: 500,
        };
        assert!(check(&before, &record("c1", 2), 500).is_ok());
        assert!(
            check(&before, &record("c1", 3), 10).is_ok(),
            "a raised epoch may start low"
        );
        let restored = check(&before, &record("c1", 2), 120).unwrap_err();
        assert!(
            restored.contains("bump-epoch") && restored.contains("120"),
            "{restored}"
        );
        assert!(check(&before, &record("c1", 1), 900)
            .unwrap_err()
            .contains("backwards"));
        assert!(check(&before, &record("c2", 2), 900)
            .unwrap_err()
            .contains("cluster id"));
    }

    #[test]
    fn a_grant_must_come_after_everything_seen_before_it() {
        let stored = Stored {
            record: record("c1", 1),
            mod_revision: 1,
        };
        let guard = CellGuard::start(&stored, 100, None).unwrap();
        assert!(guard.check_grant(101, guard.seen()).is_ok());
        assert_eq!(guard.seen(), 101);
        let err = guard.check_grant(50, guard.seen()).unwrap_err();
        assert!(err.to_string().contains("went backwards"), "{err}");
    }

    #[test]
    fn the_state_folder_refuses_a_restored_cell_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let stored = Stored {
            record: record("c1", 1),
            mod_revision: 1,
        };
        let guard = CellGuard::start(&stored, 100, Some(dir.path())).unwrap();
        guard.saw(400);
        guard.remember().unwrap();
        drop(guard);
        let err = CellGuard::start(&stored, 90, Some(dir.path()))
            .err()
            .unwrap();
        assert!(err.to_string().contains("bump-epoch"), "{err}");
        let bumped = Stored {
            record: record("c1", 2),
            mod_revision: 91,
        };
        assert!(CellGuard::start(&bumped, 91, Some(dir.path())).is_ok());
    }
}
