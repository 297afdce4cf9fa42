//! What every part of a running proxy shares.

use std::sync::Arc;

use lockcell_cell::grants::Limit;
use lockcell_cell::locklog::{LockLog, ETCD_API_KEYS};
use tokio::sync::watch;

use lockcell_proto::FencingToken;

use crate::classes::ClassBook;
use crate::cleanup::CleanupQueue;
use crate::config::ProxyConfig;
use crate::errors::ProxyError;
use crate::events::LockEvents;
use crate::leases::LeaseBook;
use crate::mirror::WriteSize;
use crate::queues::Queues;
use crate::sessions::SessionTable;

/// The proxy's state, behind one `Arc`.
pub struct ProxyState {
    pub config: ProxyConfig,
    /// Written into every grant record so an investigator can tell which proxy granted.
    pub proxy_id: String,
    /// The cell's epoch record (the first part of every fencing token this proxy hands
    /// out) and the checks that stop the proxy when the cell changes under it.
    pub cell: Arc<crate::cellguard::CellGuard>,
    /// The cell's name in the shard map, when the proxy serves several cells.
    pub cell_name: Option<String>,
    /// Whether this engine counts session events (expiries, resumes, sessions open):
    /// with several cells a session has a stay in each, and only the first cell's
    /// engine counts it, so the metrics count sessions, not stays.
    pub counts_sessions: bool,
    /// The cell's copy of the shard map: which names this proxy grants and writes here.
    pub routes: Arc<crate::routes::Routes>,
    pub sessions: SessionTable,
    pub leases: LeaseBook,
    pub locklog: LockLog,
    /// Small keys under `/k/`.
    pub kv: lockcell_cell::kv::Kv,
    /// Small-key reads (read barrier and mirror) and the watch fan-out behind them.
    pub reads: crate::reads::Reads,
    /// Small-key writes let through that the mirror does not show yet
    /// (`--max-kv-total-bytes`).
    pub kv_budget: crate::kvbudget::KvBudget,
    /// etcd's database size against its quota: new keys and values stop short of it.
    pub space: Arc<crate::space::Space>,
    /// What the proxy's watch over the lock log tells waiters and observers.
    pub events: Arc<LockEvents>,
    /// Local wait queues of classes that are not fair.
    pub queues: Arc<Queues>,
    /// Acquires and campaigns under way, for their withdrawal.
    pub calls: crate::calls::Calls,
    /// The lock classes in force.
    pub classes: Arc<ClassBook>,
    /// The prefix grants in force (everything allowed without `--grants`).
    pub grants: Arc<crate::access::AccessBook>,
    /// What each identity has in hand on this proxy (shared by its cells' engines).
    pub limits: Arc<crate::limits::Limits>,
    /// The proxy's resident size against `--max-memory-bytes` (shared likewise).
    pub memory: Arc<crate::memory::Memory>,
    pub cleanup: CleanupQueue,
    /// One out-of-rhythm lease renewal at a time per bucket (resumes that need a later
    /// lower bound share it).
    pub renewing: Vec<tokio::sync::Mutex<()>>,
    /// The connection to etcd (cheap clones share it).
    pub etcd: etcd_client::Client,
    /// The cell's members one at a time, for the lease renewals.
    pub members: std::sync::Arc<crate::members::Members>,
    /// Turns true when the proxy starts shutting down; long-lived calls end on it.
    pub shutdown: watch::Receiver<bool>,
    /// Turns true when the proxy is asked to stop (SIGTERM, or the admin `/drain`): it
    /// asks its clients to move, waits for them, then shuts down.
    pub drain: Arc<watch::Sender<bool>>,
    /// When the drain began (its requests to move are spread from there).
    pub drain_started: std::sync::OnceLock<tokio::time::Instant>,
    /// Set by the etcd API when it serves: turns true once a drain's hand-off of its
    /// leases is written (see `etcd_api::handoff`), which the drain waits for.
    pub handed_off: std::sync::OnceLock<watch::Receiver<bool>>,
    /// The blocks of etcd API lease IDs this proxy has taken, which its presence record
    /// names (see `etcd_api::ids`). Held while the record is written, so the last
    /// record written names every block taken before it.
    pub etcd_lease_blocks: tokio::sync::Mutex<Vec<u64>>,
}

impl ProxyState {
    /// Sets `lockcell_sessions_open` from this engine's table, when it is the one that
    /// counts sessions.
    pub fn publish_sessions_open(&self) {
        if self.counts_sessions {
            metrics::gauge!(crate::metrics::SESSIONS_OPEN).set(self.sessions.len() as f64);
        }
    }

    /// The keys (no values) under `root` in etcd, as `what` names the read in errors.
    pub async fn keys_under(
        &self,
        what: &'static str,
        root: &str,
    ) -> Result<Vec<etcd_client::KeyValue>, lockcell_cell::CellError> {
        let options = etcd_client::GetOptions::new()
            .with_prefix()
            .with_keys_only();
        let got = lockcell_cell::error::with_timeout(
            what,
            self.config.etcd_timeout,
            self.etcd.kv_client().get(root, Some(options)),
        )
        .await?;
        Ok(got.kvs().to_vec())
    }

    /// The handles settling a write takes (see [`crate::unsettled`]).
    pub fn owners(&self) -> crate::unsettled::Owners<'_> {
        crate::unsettled::Owners {
            sessions: &self.sessions,
            locklog: &self.locklog,
            cleanup: &self.cleanup,
        }
    }

    pub fn is_draining(&self) -> bool {
        *self.drain.borrow()
    }

    /// Starts draining (once); returns whether this call started it.
    pub fn start_drain(&self) -> bool {
        self.drain
            .send_if_modified(|draining| !std::mem::replace(draining, true))
    }

    /// Stops trusting the cell: no more grants, and a drain that ends in an error exit.
    pub fn cell_changed(&self, reason: &str) {
        self.cell.set_changed(reason);
    }

    /// Refuses a caller that cannot prove session `id` is its own: `secret` must be the
    /// session's secret, and the caller (when the proxy checks grants) the identity
    /// that opened it ([`crate::credential`]). Session ids are not secret (Leader shows
    /// them), so the id alone proves nothing, on this proxy or any other.
    pub fn check_owner<T>(
        &self,
        request: &tonic::Request<T>,
        id: &str,
        secret: &str,
    ) -> Result<(), tonic::Status> {
        let caller = self.grants.current().caller(request)?;
        crate::credential::check(id, secret, caller.as_deref())
    }

    /// What a call on session `id` about `name` needs: the caller has `right` on
    /// `name` and owns the session (as [`Self::check_owner`]). Identifies the caller
    /// once.
    pub fn authorize_session<T>(
        &self,
        request: &tonic::Request<T>,
        right: crate::access::Right,
        name: &str,
        id: &str,
        secret: &str,
    ) -> Result<(), tonic::Status> {
        let grants = self.grants.current();
        let caller = grants.caller(request)?;
        if let Some(caller) = &caller {
            grants.check(caller, right, name)?;
        }
        crate::credential::check(id, secret, caller.as_deref())
    }

    /// Refuses a new session of `principal` when the sessions it opened here are at
    /// its limit (`sessions` in the grants file's `[[limit]]`).
    pub fn admit_session(&self, principal: Option<&str>) -> Result<(), ProxyError> {
        self.admit_sessions(principal, 1)
    }

    /// Refuses `coming` more sessions of `principal` (new, or brought here) when they
    /// would take the sessions it has here past its limit.
    pub fn admit_sessions(&self, principal: Option<&str>, coming: u64) -> Result<(), ProxyError> {
        self.memory.admit("sessions")?;
        let Some(principal) = principal else {
            return Ok(());
        };
        let grants = self.grants.current();
        let max = grants.quota(principal).sessions;
        let now = self.sessions.usage(principal).sessions.max(0) as u64;
        if now + coming > max {
            return Err(crate::limits::refusal(
                &grants,
                principal,
                Limit::Sessions,
                now,
                max,
            ));
        }
        Ok(())
    }

    /// Refuses a write that would give session `id` `new` more keys taking `bytes`
    /// more (a key's name and value, less what the session's record of it counts
    /// already) when its identity's sessions here would pass their `keys` or `bytes`
    /// limit. Acquires in progress may pass them by one key each.
    pub fn admit_keys(&self, id: &str, new: u64, bytes: u64) -> Result<(), ProxyError> {
        match self.sessions.principal(id) {
            Some(principal) => self.admit_keys_of(&principal, new, bytes),
            None => Ok(()),
        }
    }

    /// [`Self::admit_keys`], for keys coming to sessions of `principal` here.
    pub fn admit_keys_of(&self, principal: &str, new: u64, bytes: u64) -> Result<(), ProxyError> {
        let grants = self.grants.current();
        let quota = grants.quota(principal);
        let mut usage = self.sessions.usage(principal);
        let over = |usage: crate::sessions::Tally| {
            (new > 0 && usage.keys.max(0) as u64 + new > quota.keys)
                || (bytes > 0 && usage.bytes.max(0) as u64 + bytes > quota.bytes)
        };
        // Before refusing, drop the records of keys deleted meanwhile by other means
        // than the session's end (at most once a second per identity: a caller looping
        // at its limit does not make the proxy look through every session each time).
        if over(usage)
            && self
                .limits
                .may_look_again(principal, std::time::Instant::now())
        {
            self.forget_gone_keys(Some(principal));
            usage = self.sessions.usage(principal);
        }
        let keys = usage.keys.max(0) as u64;
        if new > 0 && keys + new > quota.keys {
            return Err(crate::limits::refusal(
                &grants,
                principal,
                Limit::Keys,
                keys,
                quota.keys,
            ));
        }
        let held = usage.bytes.max(0) as u64;
        if bytes > 0 && held + bytes > quota.bytes {
            return Err(crate::limits::refusal_of_bytes(
                &grants,
                principal,
                held,
                bytes,
                quota.bytes,
            ));
        }
        Ok(())
    }

    /// Forgets the records of lockcell's ephemeral keys that are no longer their
    /// sessions' (of `principal`'s sessions only, when given): deleted (Kv.Delete, a
    /// Txn, an etcd DeleteRange, by anyone), created again, or written on no lease, as
    /// this proxy's copy of the small keys shows once it has applied the session's
    /// write. Such a record would count against the identity's `keys` and `bytes` until
    /// the session ends. A key another session of the same proxy lease wrote since keeps
    /// the record (the writer has its own; the guarded delete at the end finds nothing).
    /// Returns how many records it forgot.
    pub fn forget_gone_keys(&self, principal: Option<&str>) -> usize {
        // A copy being loaded again says nothing of what is gone.
        if !self.reads.feed.is_live() {
            return 0;
        }
        self.reads.feed.with_mirror(|mirror| {
            self.sessions.forget_gone(principal, |g| {
                if g.written == 0 || g.is_unsettled() || g.lock.as_str() == ETCD_API_KEYS {
                    return false;
                }
                if mirror.revision() < g.written {
                    return false;
                }
                match mirror.get(g.lock.as_str()) {
                    None => true,
                    Some(now) => now.create_revision != g.revision || now.lease == 0,
                }
            })
        })
    }

    /// Takes a place of `principal` under `limit` (a watch, an acquire in progress).
    pub fn take(
        &self,
        principal: Option<&str>,
        limit: Limit,
    ) -> Result<crate::limits::Taken, ProxyError> {
        if limit == Limit::Watches {
            self.memory.admit("watches")?;
        }
        self.limits.take(&self.grants.current(), principal, limit)
    }

    /// Lets one call of `principal` through, unless it calls faster than its
    /// `requests_per_second`.
    pub fn pace(&self, principal: Option<&str>) -> Result<(), ProxyError> {
        self.limits.pace(&self.grants.current(), principal)
    }

    /// Lets small-key `writes` by `identity` through: those that add keys or values
    /// only while etcd's database is below the space line ([`crate::space`]), all
    /// within `--max-kv-total-bytes`, and the identity's persistent keys within its
    /// `stored_bytes` ([`crate::kvbudget`]).
    pub async fn admit_writes<'a>(
        &'a self,
        identity: Option<&str>,
        writes: &[WriteSize<'_>],
    ) -> Result<crate::kvbudget::Admitted<'a>, ProxyError> {
        let grants = self.grants.current();
        let writer = identity.map(|identity| crate::kvbudget::Writer {
            grants: &grants,
            identity,
        });
        let admitted = self
            .kv_budget
            .admit(
                &self.reads.feed,
                self.config.max_kv_total_bytes,
                writer,
                writes,
            )
            .await?;
        // Last: a write refused by another bound takes no room below the line.
        let adds: usize = writes
            .iter()
            .filter_map(|w| w.value.map(|v| w.name.len() + v))
            .sum();
        if adds == 0 {
            return Ok(admitted);
        }
        let names: Vec<&str> = writes.iter().map(|w| w.name).collect();
        let room = self
            .space
            .reserve(&format!("writing {names:?}"), adds as u64)?;
        Ok(admitted.with_room(room))
    }

    /// The epoch the proxy mints tokens in.
    pub fn epoch(&self) -> u64 {
        self.cell.record.epoch
    }

    /// Whose revisions a read or watch of `name` (with `prefix`, of every name under
    /// it) speaks of: see [`crate::routes::Routes::position`].
    pub fn position_id(&self, name: &str, prefix: bool) -> String {
        self.routes.position(name, prefix)
    }

    /// The fencing token of `name`'s holder granted at `revision` (in the epoch of
    /// `name`'s route, see [`crate::routes`]).
    pub fn token(&self, name: &str, revision: i64) -> FencingToken {
        FencingToken {
            epoch: self.routes.token_epoch(name),
            revision,
        }
    }
}
