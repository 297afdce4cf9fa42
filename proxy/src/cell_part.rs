//! One cell's part of a proxy ([`CellPart`]): its connection to the cell's etcd, its
//! state ([`ProxyState`]) and the tasks that keep it (leases, the reaper, the feed,
//! the lock-log watches); and what every cell's part shares.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::ConnectOptions;
use lockcell_cell::locklog::LockLog;
use lockcell_cell::rbac;
use lockcell_cell::{epoch, keyspace};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::ProxyConfig;
use crate::state::ProxyState;
use crate::{
    access, barrier, cellguard, classes, events, feed, lease_keeper, leases, limits, members,
    memory, pause, reads, reaper, routes, space, sweep,
};

/// What every cell's cell part of one proxy shares.
pub(crate) struct Shared {
    pub(crate) proxy_id: String,
    pub(crate) classes: Arc<classes::ClassBook>,
    pub(crate) grants: Arc<access::AccessBook>,
    pub(crate) limits: Arc<limits::Limits>,
    pub(crate) memory: Arc<memory::Memory>,
    pub(crate) stop: watch::Receiver<bool>,
    pub(crate) drain: Arc<watch::Sender<bool>>,
}

/// One connection to a cell, with what the proxy read from it at the start.
pub(crate) struct Connection {
    pub(crate) etcd: etcd_client::Client,
    /// The same cell, one member at a time, for the lease renewals.
    pub(crate) members: Arc<members::Members>,
    pub(crate) epoch: epoch::Stored,
    pub(crate) revision: i64,
    /// The cell's copy of the shard map.
    pub(crate) map: Option<lockcell_cell::shardmap::StoredMap>,
}

/// The cells the proxy serves: every cell of the shard map in the cell it was started
/// on, that cell first; just that cell when it has no map (or a map of one cell).
pub(crate) async fn cells_to_serve(
    config: &ProxyConfig,
    home: &Connection,
) -> anyhow::Result<Vec<(Option<String>, Vec<String>, String)>> {
    let Some(map) = home.map.as_ref().filter(|m| m.map.cells.len() > 1) else {
        return Ok(vec![(None, config.etcd_endpoints.clone(), String::new())]);
    };
    let own = routes::own_cell(&map.map, &home.epoch.record.cluster_id).ok_or_else(|| {
        anyhow::anyhow!(
            "the cell at {} (cluster id {}) is not in its own copy of the shard map (version {}): set the map again with `lockcell-cell shardmap set`",
            config.etcd_endpoints.join(","),
            home.epoch.record.cluster_id,
            map.map.version
        )
    })?;
    let mut cells: Vec<_> = map
        .map
        .cells
        .iter()
        .map(|(name, spec)| {
            (
                Some(name.clone()),
                spec.endpoints.clone(),
                spec.cluster_id.clone(),
            )
        })
        .collect();
    cells.sort_by_key(|(name, _, _)| name.as_deref() != Some(own));
    tracing::info!(
        version = map.map.version,
        cells = map.map.cells.len(),
        "serving every cell of the shard map"
    );
    Ok(cells)
}

/// A proxy's part in one cell: its sessions' stays, leases, lock log and watches there.
pub(crate) struct CellPart {
    pub(crate) state: Arc<ProxyState>,
    pub(crate) tasks: tokio::task::JoinSet<()>,
    pub(crate) follow: Vec<tokio::task::JoinHandle<()>>,
}

impl CellPart {
    pub(crate) fn start(
        config: &ProxyConfig,
        shared: &Shared,
        name: Option<String>,
        connection: Connection,
        counts_sessions: bool,
    ) -> anyhow::Result<CellPart> {
        let etcd = connection.etcd.clone();
        let start_revision = connection.revision;
        let mut config = config.clone();
        if let Some(name) = &name {
            // Each cell's state is remembered apart.
            config.state_dir = config.state_dir.map(|dir| dir.join(name));
        }
        let state = new_state(config, shared, name, connection, counts_sessions)?;
        forget_lost_keys(&state);
        let tasks = keep(&state, shared, start_revision);
        let follow = follow(&state, &etcd, start_revision);
        Ok(CellPart {
            state,
            tasks,
            follow,
        })
    }

    /// How the ready line names the cell.
    pub(crate) fn label(&self) -> String {
        let record = &self.state.cell.record;
        format!(
            "{} (cluster id {}, epoch {})",
            self.state.cell_name.as_deref().unwrap_or("the cell"),
            record.cluster_id,
            record.epoch
        )
    }

    /// Stops the cell part's work, waits until no client can still believe it holds a lock
    /// here, and revokes the proxy's leases in the cell. Returns why the cell was found
    /// changed, if it was.
    pub(crate) async fn stop(mut self) -> Option<String> {
        let state = self.state;
        for f in self.follow {
            f.abort();
        }
        self.tasks.shutdown().await;
        if let Some(until) = state.sessions.holders_valid_until() {
            let now = Instant::now();
            if until > now {
                tracing::info!(
                    wait_ms = (until - now).as_millis() as u64,
                    "waiting for the validity granted to lock holders to run out before revoking"
                );
                tokio::time::sleep_until(until.min(now + state.config.lease_ttl)).await;
            }
        }
        revoke_all(&state).await;
        if let Some(reason) = state.cell.changed() {
            return Some(reason.to_owned());
        }
        if let Err(e) = state.cell.remember() {
            tracing::warn!(error = %e, "could not remember the cell's revision");
        }
        None
    }
}

/// A cell part's state: its own copy of the config (`config`), on `connection`.
pub(crate) fn new_state(
    config: ProxyConfig,
    shared: &Shared,
    name: Option<String>,
    connection: Connection,
    counts_sessions: bool,
) -> anyhow::Result<Arc<ProxyState>> {
    let Connection {
        etcd,
        members,
        epoch,
        revision: start_revision,
        map,
    } = connection;
    let cell = Arc::new(
        cellguard::CellGuard::start(&epoch, start_revision, config.state_dir.as_deref())?
            .draining_with(shared.drain.clone()),
    );
    let events = Arc::new(events::LockEvents::new());
    let mut routes = routes::Routes::new(&epoch.record.cluster_id, epoch.record.epoch, map)
        .epoch_since(epoch.mod_revision);
    if name.is_some() {
        routes = routes.in_map();
    }
    let routes = Arc::new(routes);
    let timeout = config.etcd_timeout;
    Ok(Arc::new(ProxyState {
        proxy_id: shared.proxy_id.clone(),
        cell_name: name,
        counts_sessions,
        reads: reads(&config, &etcd, &routes),
        routes,
        cell,
        sessions: Default::default(),
        leases: leases::LeaseBook::new(
            config.leases as usize,
            config.validity_margin,
            config.clock_rate_bound.0,
            Instant::now(),
        ),
        locklog: LockLog::new(etcd.kv_client(), timeout).with_epoch_guard(epoch.mod_revision),
        kv: lockcell_cell::kv::Kv::new(etcd.kv_client(), timeout)
            .with_writer_key(lockcell_cell::keyspace::writer_key(&shared.proxy_id)),
        kv_budget: Default::default(),
        space: Arc::new(space::Space::new(
            config.etcd_quota_bytes,
            config.etcd_space_limit_percent,
        )),
        queues: events.queues().clone(),
        calls: Default::default(),
        events,
        classes: shared.classes.clone(),
        grants: shared.grants.clone(),
        limits: shared.limits.clone(),
        memory: shared.memory.clone(),
        cleanup: Default::default(),
        renewing: (0..config.leases).map(|_| Default::default()).collect(),
        etcd,
        members,
        shutdown: shared.stop.clone(),
        drain: shared.drain.clone(),
        drain_started: Default::default(),
        handed_off: Default::default(),
        etcd_lease_blocks: Default::default(),
        config,
    }))
}

/// The reads of a cell part: from its copy of the small keys (the feed), after a read
/// barrier, or from etcd.
fn reads(
    config: &ProxyConfig,
    etcd: &etcd_client::Client,
    routes: &Arc<routes::Routes>,
) -> reads::Reads {
    let feed = Arc::new(feed::Feed::new(
        config.watch_backlog,
        config.watch_history_bytes,
        routes.clone(),
    ));
    reads::Reads::new(
        feed,
        barrier::Barrier::start(etcd.kv_client(), config.etcd_timeout),
        lockcell_cell::kv::Kv::new(etcd.kv_client(), config.etcd_timeout),
        config.etcd_timeout,
        routes.clone(),
        etcd.kv_client(),
    )
}

/// An ephemeral key deleted by other means than its session's end (or written on no
/// lease) is no longer the session's: it forgets it, and the key no longer counts
/// against the session's identity.
fn forget_lost_keys(state: &Arc<ProxyState>) {
    let weak = Arc::downgrade(state);
    state.reads.feed.on_ephemeral_lost(Box::new(move |lost| {
        let Some(state) = weak.upgrade() else {
            return;
        };
        for key in lost {
            state.sessions.forget_lost(
                &format!("{}{}", lockcell_cell::keyspace::kv_root(), key.name),
                key.created,
                key.at,
            );
        }
    }));
}

/// The tasks that keep a cell part: its leases, the reaper, the cell's record and
/// shard map, the sweep of orphans, and the reading of etcd's space.
fn keep(state: &Arc<ProxyState>, shared: &Shared, start_revision: i64) -> tokio::task::JoinSet<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for bucket in 0..state.leases.len() {
        tasks.spawn(lease_keeper::run(state.clone(), bucket));
    }
    tasks.spawn(reaper::run(state.clone()));
    tasks.spawn({
        let state = state.clone();
        async move { state.cell.keep_remembering(Duration::from_secs(5)).await }
    });
    let etcd = &state.etcd;
    tasks.spawn(
        state
            .cell
            .clone()
            .watch_record(etcd.clone(), start_revision),
    );
    tasks.spawn(routes::follow(
        state.routes.clone(),
        etcd.clone(),
        state.config.etcd_timeout,
        shared.stop.clone(),
    ));
    tasks.spawn(sweep::run(state.clone(), shared.stop.clone()));
    tasks.spawn(space::keep_reading(
        state.space.clone(),
        etcd.clone(),
        state.config.etcd_timeout,
        shared.stop.clone(),
    ));
    tasks
}

/// The tasks that follow etcd for a cell part: the copy of the small keys (and its
/// fan-out's pacing), and the lock log's holders and lines.
fn follow(
    state: &Arc<ProxyState>,
    etcd: &etcd_client::Client,
    start_revision: i64,
) -> Vec<tokio::task::JoinHandle<()>> {
    let feed = state.reads.feed.clone();
    vec![
        // Prefix watchers' batches, handed over a few at a time.
        tokio::spawn(feed.fanout.clone().pace()),
        tokio::spawn(feed::run(
            feed,
            etcd.kv_client(),
            etcd.watch_client(),
            state.config.etcd_timeout,
        )),
        tokio::spawn(events::follow(
            following(state),
            keyspace::locks_root(),
            false,
            start_revision + 1,
        )),
        tokio::spawn(events::follow(
            following(state),
            keyspace::queues_root(),
            true,
            start_revision + 1,
        )),
    ]
}

/// How often the proxy pings an idle etcd connection: over etcd's default
/// `--grpc-keepalive-min-time` of 5 s, with room.
const ETCD_PING_INTERVAL: Duration = Duration::from_secs(10);

/// Connects to etcd, retrying until it answers or shutdown, and reads the epoch record
/// (retrying too while the cell has none: `lockcell-cell init` writes it, and while etcd
/// has authentication off but the proxy has a user: `lockcell-cell auth-enable` turns it
/// on). Gives up at once when etcd turns the proxy's user away: retrying will not change
/// its answer.
pub(crate) async fn connect(
    config: &ProxyConfig,
    endpoints: &[String],
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<Connection> {
    let credentials = config.etcd_user.as_ref().map(|user| {
        let password: String = config.etcd_password.clone().unwrap_or_default().into();
        rbac::Credentials::new(user, password)
    });
    let options = ConnectOptions::new()
        .with_connect_timeout(config.etcd_timeout)
        // HTTP/2 pings no more often than etcd allows: it answers pings sooner than its
        // --grpc-keepalive-min-time (5 s by default) with GOAWAY, which broke the
        // proxy's connections, and its cell watch, every 8 s.
        .with_keep_alive(ETCD_PING_INTERVAL, config.etcd_timeout)
        // A member that lost its leader refuses at once instead of serving a watch
        // that has gone quiet or a read it cannot make linearizable.
        .with_require_leader(true);
    // Logs in again whenever etcd has forgotten the token (it expires after
    // --auth-token-ttl without a call, and a restarted member knows none).
    let options = rbac::with_credentials(config.etcd_tls.apply(options)?, credentials.as_ref());
    let mut pauses = pause::Pauses::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        let attempt = connect_once(config, endpoints, &options);
        let pause = pauses.next_pause();
        match attempt.await {
            Ok(connected) => {
                if credentials.is_some() {
                    // Keeps etcd from forgetting the token while the proxy runs: a new
                    // watch (a restart, a client's catch-up) is refused in-band otherwise.
                    let (client, timeout) = (connected.etcd.clone(), config.etcd_timeout);
                    tokio::spawn(rbac::keep_token(client, timeout, stop.clone()));
                }
                return Ok(connected);
            }
            Err(e) if refused(&e) == Some(rbac::Refusal::AuthOff) => tracing::warn!(
                etcd = %endpoints.join(","),
                retry_in = ?pause,
                "etcd runs with authentication off, but --etcd-user is set: waiting for `lockcell-cell auth-enable`"
            ),
            Err(e) if refused(&e).is_some() => anyhow::bail!(refusal(config, endpoints, &e)),
            Err(e) => {
                tracing::warn!(
                    etcd = %endpoints.join(","),
                    error = %e,
                    retry_in = ?pause,
                    "cannot start on the cell yet; retrying"
                );
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => anyhow::bail!("stopped before etcd at {} answered", endpoints.join(",")),
        }
    }
}

/// One try to connect to the cell at `endpoints` and read what the proxy starts from:
/// the epoch record, the revision now, and the shard map.
async fn connect_once(
    config: &ProxyConfig,
    endpoints: &[String],
    options: &ConnectOptions,
) -> anyhow::Result<Connection> {
    let client = etcd_client::Client::connect(&endpoints, Some(options.clone())).await?;
    let record = epoch::read(&mut client.kv_client(), config.etcd_timeout)
        .await?
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the cell has no epoch record at {}: set a new cell up once with `lockcell-cell init --etcd {}`",
                keyspace::epoch_key(),
                endpoints.join(",")
            )
        })?;
    let mut kv = client.kv_client();
    let now = lockcell_cell::error::with_timeout(
        "read revision",
        config.etcd_timeout,
        kv.get(lockcell_cell::keyspace::epoch_key(), None),
    )
    .await?;
    let revision = now.header().map(|h| h.revision()).unwrap_or_default();
    let map = lockcell_cell::shardmap::read(&mut kv, config.etcd_timeout).await?;
    Ok(Connection {
        etcd: client,
        members: Arc::new(members::Members::new(
            endpoints,
            options.clone(),
            config.etcd_timeout,
        )),
        epoch: record,
        revision,
        map,
    })
}

/// Why etcd turned the proxy's user away (`e`), and what to do about it.
fn refusal(config: &ProxyConfig, endpoints: &[String], e: &anyhow::Error) -> String {
    let user = config.etcd_user.as_deref().unwrap_or("(none)");
    let at = endpoints.join(",");
    match refused(e) {
        Some(rbac::Refusal::BadCredentials) => format!("etcd at {at} refused the user {user} and its password: check --etcd-user and --etcd-password (LOCKCELL_ETCD_USER, LOCKCELL_ETCD_PASSWORD)"),
        Some(rbac::Refusal::NoUser) => format!("etcd at {at} runs with authentication on: give the proxy its etcd user with --etcd-user lockcell-proxy and --etcd-password (LOCKCELL_ETCD_USER, LOCKCELL_ETCD_PASSWORD)"),
        _ => format!("etcd at {at} does not let the user {user} read the epoch record ({e:#}): the proxy's user needs the lockcell-proxy role (`lockcell-cell auth-enable` sets it up)"),
    }
}

/// How etcd turned the proxy's user away, if that is why connecting failed.
fn refused(e: &anyhow::Error) -> Option<rbac::Refusal> {
    let etcd = e
        .chain()
        .find_map(|cause| cause.downcast_ref::<etcd_client::Error>())?;
    rbac::refusal(etcd).filter(|r| *r != rbac::Refusal::TokenExpired)
}

pub(crate) async fn wait_for_leases(state: &ProxyState) {
    let mut stop = state.shutdown.clone();
    while state.leases.leases().len() < state.leases.len() && !*stop.borrow() {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Revokes every lease the proxy holds, so its clients' keys go now; but not a lease
/// that sessions handed off to the next proxy still wait on (it runs out unrenewed,
/// within the lease TTL, unless their clients reach another proxy first).
pub(crate) async fn revoke_all(state: &ProxyState) {
    let waiting = state.sessions.handed_off_leases();
    for lease in state.leases.leases() {
        if waiting.contains(&lease) {
            tracing::info!(
                lease,
                "leaving proxy lease to run out: sessions handed off wait on it"
            );
            continue;
        }
        let mut client = state.etcd.lease_client();
        let call = client.revoke(lease);
        match tokio::time::timeout(state.config.etcd_timeout, call).await {
            Ok(Ok(_)) => tracing::info!(lease, "revoked proxy lease"),
            Ok(Err(e)) => {
                tracing::warn!(lease, error = %e, "could not revoke proxy lease; etcd will expire it")
            }
            Err(_) => tracing::warn!(lease, "revoking proxy lease timed out; etcd will expire it"),
        }
    }
}

/// What the lock-log watches read with ([`events::follow`]).
fn following(state: &ProxyState) -> events::Following {
    events::Following {
        events: state.events.clone(),
        etcd: state.etcd.clone(),
        cell: state.cell.clone(),
        timeout: state.config.etcd_timeout,
    }
}
