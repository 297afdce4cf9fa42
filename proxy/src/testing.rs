//! A proxy's state over the in-memory store (`lockcell_cell::locklog::memory`), for
//! tests of the runtime (waits, grants, clean-ups) that run without etcd and with
//! paused time. Its etcd client points nowhere: a path that reaches etcd other than
//! through the lock log fails, as with etcd gone. The rig is the feed: a test tells
//! waiters of releases itself, or leaves them to look again on their own.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use etcd_client::ConnectOptions;
use lockcell_cell::epoch::{EpochRecord, Stored};
use lockcell_cell::keyspace;
use lockcell_cell::locklog::memory::MemoryStore;
use lockcell_cell::locklog::{LockLog, LockStore};
use lockcell_proto::v1::OpenRequest;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::access::{AccessBook, AccessRules};
use crate::cell_part::{new_state, Connection, Shared};
use crate::classes::{ClassBook, Classes};
use crate::config::ProxyConfig;
use crate::state::ProxyState;

/// The proxy's one etcd lease, in the store.
pub(crate) const LEASE: i64 = 0x1ea5e;

pub(crate) struct Rig {
    pub(crate) store: Arc<MemoryStore>,
    pub(crate) state: Arc<ProxyState>,
    /// The revision the rig told the proxy's watch of the lock log of.
    fed: std::sync::Mutex<i64>,
    _stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

/// A proxy started with `flags`, its lock classes `classes` (a classes file), over a
/// fresh store that holds the cell's epoch record and the proxy's lease.
pub(crate) async fn rig(flags: &[&str], classes: &str) -> Rig {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let classes_file = dir.path().join("classes.toml");
    std::fs::write(&classes_file, classes).expect("the classes file");
    let mut argv = vec!["lockcell-proxy", "--etcd", "127.0.0.1:9"];
    if !flags.contains(&"--leases") {
        argv.extend(["--leases", "1"]);
    }
    argv.extend_from_slice(flags);
    let config = ProxyConfig::try_parse_from(argv).expect("the flags parse");

    let store = Arc::new(MemoryStore::new());
    for bucket in 0..config.leases {
        store.grant_lease(LEASE + bucket as i64);
    }
    let record = EpochRecord {
        cluster_id: "0123456789abcdef".into(),
        epoch: 1,
    };
    let body = serde_json::to_vec(&record).expect("the record");
    store
        .put(keyspace::epoch_key().into(), body, None)
        .await
        .expect("the epoch record");
    let epoch_revision = store.revision();

    let (stop_tx, stop) = watch::channel(false);
    let builtin = Classes::builtin(config.session_ttl_min, config.session_ttl_max);
    let shared = Shared {
        proxy_id: "test-proxy".into(),
        classes: Arc::new(ClassBook::load(Some(classes_file), builtin).expect("the classes")),
        grants: Arc::new(AccessBook::load(None, AccessRules::open()).expect("open access")),
        limits: Default::default(),
        memory: Arc::new(crate::memory::Memory::new(config.max_memory_bytes)),
        stop,
        drain: Arc::new(watch::channel(false).0),
    };
    let etcd = etcd_client::Client::connect(["127.0.0.1:9"], None)
        .await
        .expect("a client that connects when first used");
    let members = Arc::new(crate::members::Members::new(
        &config.etcd_endpoints,
        ConnectOptions::new(),
        Duration::from_secs(1),
    ));
    let connection = Connection {
        etcd,
        members,
        epoch: Stored {
            record,
            mod_revision: epoch_revision,
        },
        revision: epoch_revision,
        map: None,
    };
    let mut state = new_state(config, &shared, None, connection, true).expect("a state");
    let parts = Arc::get_mut(&mut state).expect("no one else has the state yet");
    parts.locklog =
        LockLog::over(store.clone(), parts.config.etcd_timeout).with_epoch_guard(epoch_revision);
    let now = Instant::now();
    let generation = parts.leases.generation();
    for bucket in 0..usize::from(parts.config.leases) {
        let lease = LEASE + bucket as i64;
        parts
            .leases
            .install(bucket, lease, (now, generation), parts.config.lease_ttl);
    }
    Rig {
        fed: std::sync::Mutex::new(store.revision()),
        store,
        state,
        _stop: stop_tx,
        _dir: dir,
    }
}

impl Rig {
    /// Tells the proxy what changes in the store every few milliseconds from now on, as
    /// its watch of the lock log would, until the test ends.
    pub(crate) fn follow(&self) {
        let (store, state) = (self.store.clone(), self.state.clone());
        let mut fed = *self.fed.lock().expect("fed");
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                tick.tick().await;
                state.events.apply(&store.events_after(fed));
                fed = store.revision();
            }
        });
    }

    /// Tells the proxy what changed in the store since last told, as its watch of the
    /// lock log would.
    pub(crate) fn feed(&self) {
        let mut fed = self.fed.lock().expect("fed");
        self.state.events.apply(&self.store.events_after(*fed));
        *fed = self.store.revision();
    }

    /// Opens a session of `ttl`; returns its id.
    pub(crate) fn open(&self, ttl: Duration) -> String {
        self.open_with_secret(ttl).0
    }

    /// Opens a session of `ttl`; returns its id and secret.
    pub(crate) fn open_with_secret(&self, ttl: Duration) -> (String, String) {
        let (id, secret) = crate::credential::new_session(None);
        let request = OpenRequest {
            ttl_ms: ttl.as_millis() as u64,
            identity: "test".into(),
        };
        crate::service::session::open_stay(&self.state, None, &request, id.as_str().into())
            .expect("a session opens");
        (id, secret)
    }
}
