//! lockcell-proxy: the zone proxy. It holds client sessions in memory, answers their
//! keepalives itself, and attaches every key its clients create to one of K etcd leases
//! of its own (docs/design.md).
//!
//! Pure parts ([`sessions`], [`leases`], [`classes`], the arbiter queues behind
//! [`queues`]) hold the proxy's bookkeeping; the runtime parts ([`lease_keeper`],
//! [`reaper`], [`events`], [`acquire`], [`service`]) carry out what they decide
//! against etcd.
#![forbid(unsafe_code)]

pub mod access;
pub mod acquire;
pub mod admin;
pub mod barrier;
pub mod catchup;
pub mod cellguard;
pub mod check;
pub mod classes;
pub mod cleanup;
pub mod config;
pub mod core;
pub mod credential;
pub mod declared;
pub mod errors;
pub mod etcd_api;
pub mod events;
pub mod fanout;
pub mod feed;
pub mod front;
pub mod handover;
pub mod kvbudget;
pub mod lease_keeper;
pub mod leases;
pub mod limits;
pub mod members;
pub mod memory;
pub mod metrics;
pub mod mirror;
pub mod pause;
pub mod queues;
pub mod reads;
pub mod reaper;
pub mod routes;
pub mod service;
pub mod sessions;
pub mod settings;
pub mod space;
pub mod state;
pub mod sweep;
pub mod tls;
pub mod unsettled;
pub mod wire;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use etcd_client::ConnectOptions;
use lockcell_cell::locklog::LockLog;
use lockcell_cell::{epoch, keyspace};
use lockcell_proto::v1::election_server::ElectionServer;
use lockcell_proto::v1::kv_server::KvServer;
use lockcell_proto::v1::lock_server::LockServer;
use lockcell_proto::v1::session_server::SessionServer;
use lockcell_proto::v1::watch_server::WatchServer;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;

pub use config::ProxyConfig;
use state::ProxyState;

/// Installs the Prometheus recorder for this process and describes the metrics.
pub fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let buckets = [
        (metrics::ACQUIRE_SECONDS, metrics::ACQUIRE_BUCKETS),
        (metrics::ETCD_REQUEST_SECONDS, metrics::ETCD_BUCKETS),
        (metrics::RESUME_SECONDS, metrics::ETCD_BUCKETS),
        (metrics::HANDOVER_SECONDS, metrics::ETCD_BUCKETS),
        (metrics::VALIDITY_GRANTED, metrics::VALIDITY_BUCKETS),
    ];
    let handle = buckets
        .into_iter()
        .try_fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
            builder.set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)
        })?
        .install_recorder()
        .context("installing the metrics recorder")?;
    metrics::describe();
    Ok(handle)
}

/// Runs a proxy until `shutdown` resolves (or the admin `/drain` is called), then
/// drains and stops: asks its clients to resume their sessions on other proxies and
/// waits up to the drain timeout while they do; then stops accepting and granting, ends
/// client streams, waits up to the shutdown grace for clients to go, waits until no
/// client can still believe it holds a lock (the latest validity granted to a holder
/// has run out), and then revokes its (by then usually empty) leases, so what stayed
/// goes sooner than the lease TTL and never while a holder may still act.
pub async fn run(
    config: ProxyConfig,
    prometheus: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Stopped> {
    config.validate()?;
    if let Some(file) = &config.admin_token_file {
        lockcell_cell::access::read_admin_token(file)?;
    }
    let proxy_id = config
        .proxy_id
        .clone()
        .unwrap_or_else(|| format!("{}-{:08x}", config.zone, rand::random::<u32>()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let drain = Arc::new(watch::Sender::new(false));
    let stopping = tokio::spawn({
        let drain = drain.clone();
        async move {
            shutdown.await;
            drain.send_replace(true);
        }
    });

    let shared = Shared {
        proxy_id: proxy_id.clone(),
        classes: Arc::new(classes::ClassBook::load(
            config.classes.clone(),
            classes::Classes::builtin(config.session_ttl_min, config.session_ttl_max),
        )?),
        grants: Arc::new(access::AccessBook::load(
            config.grants.clone(),
            access::AccessRules::open(),
        )?),
        limits: Default::default(),
        memory: Arc::new(memory::Memory::new(config.max_memory_bytes)),
        stop: stop_rx.clone(),
        drain: drain.clone(),
    };
    tokio::spawn(memory::keep_reading(shared.memory.clone(), stop_rx.clone()));
    let tls = tls_files(&config)
        .map(tls::ReloadingTls::load)
        .transpose()?
        .map(Arc::new);
    let home = connect(&config, &config.etcd_endpoints, drain.subscribe()).await?;
    let cells = cells_to_serve(&config, &home).await?;
    let grpc = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding the gRPC address {}", config.listen))?;
    let admin = TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("binding the admin address {}", config.admin_listen))?;
    let etcd_api = match config.etcd_listen {
        Some(_) if cells.len() > 1 => anyhow::bail!(
            "--etcd-listen: the etcd API serves a proxy of one cell, and this proxy serves {} (the shard map has several cells)",
            cells.len()
        ),
        Some(addr) => {
            if addr.ip().is_unspecified() && config.etcd_advertise.is_none() {
                tracing::warn!(
                    %addr,
                    "--etcd-listen binds every interface and no --etcd-advertise is set: the other proxies cannot forward calls on this proxy's leases here, and MemberList names an address clients cannot reach"
                );
            }
            Some(
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the etcd API address {addr}"))?,
            )
        }
        None => None,
    };

    let mut engines = Vec::new();
    let mut home = Some(home);
    for (i, (name, endpoints, cluster_id)) in cells.into_iter().enumerate() {
        // The first cell is the one the proxy started on.
        let connection = match home.take().filter(|_| i == 0) {
            Some(home) => home,
            None => connect(&config, &endpoints, drain.subscribe()).await?,
        };
        let found = &connection.epoch.record.cluster_id;
        if !cluster_id.is_empty() && *found != cluster_id {
            anyhow::bail!(
                "cell {:?} at {} has cluster id {found}, but the shard map says {cluster_id}: the map points at another cluster",
                name.as_deref().unwrap_or_default(),
                endpoints.join(",")
            );
        }
        // A session has a stay in every cell: the first cell's cell part counts it.
        let counts_sessions = engines.is_empty();
        engines.push(CellPart::start(
            &config,
            &shared,
            name,
            connection,
            counts_sessions,
        )?);
    }
    // Asked to stop: drain every cell's sessions, then stop serving.
    let draining = tokio::spawn({
        let states: Vec<_> = engines.iter().map(|e| e.state.clone()).collect();
        let drain = drain.clone();
        async move {
            let _ = drain.subscribe().wait_for(|d| *d).await;
            ::metrics::gauge!(metrics::DRAINING).set(1.0);
            let mut drains = tokio::task::JoinSet::new();
            for state in states {
                drains.spawn(async move { handover::drain(&state).await });
            }
            drains.join_all().await;
            let _ = stop_tx.send(true);
        }
    });
    let first = engines[0].state.clone();
    let mut tasks = tokio::task::JoinSet::new();
    let states: Arc<[Arc<ProxyState>]> = engines.iter().map(|e| e.state.clone()).collect();
    let drained = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tasks.spawn(admin::serve(admin, prometheus, states, drained.clone()));
    tasks.spawn(
        shared
            .classes
            .clone()
            .follow(Duration::from_secs(1), stop_rx.clone()),
    );
    tasks.spawn(
        shared
            .grants
            .clone()
            .follow(Duration::from_secs(1), stop_rx.clone()),
    );

    // Serve only once every bucket of every cell has a lease, so the first client finds
    // one.
    for engine in &engines {
        wait_for_leases(&engine.state).await;
    }
    tracing::info!(
        proxy.id = %proxy_id,
        zone = %first.config.zone,
        grpc = %first.config.listen,
        etcd_api = ?first.config.etcd_listen,
        admin = %first.config.admin_listen,
        cells = %engines.iter().map(CellPart::label).collect::<Vec<_>>().join(", "),
        leases = first.leases.len(),
        "lockcell-proxy ready"
    );

    let router = Arc::new(front::Router::new(
        engines.iter().map(|e| e.state.clone()).collect(),
    ));
    // Not one of `tasks`, which are aborted once the lockcell API has stopped: the etcd
    // API's streams end with their reason (UNAVAILABLE, "shutting down") only if its
    // server finishes its own graceful stop.
    let etcd_served = etcd_api.map(|listener| {
        let api = etcd_api::EtcdApi::new(first.clone());
        let (tls, stop) = (tls.clone(), stop_rx.clone());
        tokio::spawn(async move {
            if let Err(error) = api.serve(listener, tls, stop).await {
                tracing::error!(%error, "the etcd API stopped");
            }
        })
    });
    let mut stop = stop_rx.clone();
    let sizes = MessageSizes::for_config(&first.config);
    let router = client_server(&first.config)
        .add_service(
            SessionServer::from_arc(router.clone()).max_decoding_message_size(sizes.session),
        )
        .add_service(LockServer::from_arc(router.clone()).max_decoding_message_size(sizes.small))
        .add_service(
            ElectionServer::from_arc(router.clone()).max_decoding_message_size(sizes.small),
        )
        .add_service(KvServer::from_arc(router.clone()).max_decoding_message_size(sizes.kv))
        .add_service(WatchServer::from_arc(router.clone()).max_decoding_message_size(sizes.small));
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let server: std::pin::Pin<
        Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>,
    > = match tls {
        Some(tls) => {
            tasks.spawn(tls.clone().watch());
            Box::pin(router.serve_with_incoming_shutdown(tls::incoming(grpc, tls), stopped))
        }
        None => Box::pin(router.serve_with_incoming_shutdown(incoming(grpc), stopped)),
    };
    let mut stop = stop_rx.clone();
    let grace = first.config.shutdown_grace;
    let stopped_at = std::sync::OnceLock::new();
    let graceful = tokio::select! {
        result = server => {
            result.context("gRPC server failed")?;
            true
        }
        _ = async {
            let _ = stop.wait_for(|s| *s).await;
            let _ = stopped_at.set(tokio::time::Instant::now());
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!("clients did not disconnect within the shutdown grace; closing");
            false
        }
    };
    if let Some(mut etcd_served) = etcd_served {
        // What is left of the grace, counted from the stop.
        let until = *stopped_at.get_or_init(tokio::time::Instant::now) + grace;
        if !graceful
            || tokio::time::timeout_at(until, &mut etcd_served)
                .await
                .is_err()
        {
            etcd_served.abort();
        }
    }
    tasks.shutdown().await;
    stopping.abort();
    draining.abort();
    let mut changed = Vec::new();
    for engine in engines {
        if let Some(reason) = engine.stop().await {
            changed.push(reason);
        }
    }
    if !changed.is_empty() {
        anyhow::bail!("the cell changed under this proxy: {}", changed.join("; "));
    }
    tracing::info!("lockcell-proxy stopped");
    Ok(if drained.load(std::sync::atomic::Ordering::SeqCst) {
        Stopped::Drained
    } else {
        Stopped::Asked
    })
}

/// The largest request each service decodes: what its own limits allow, with room for
/// the encoding, and not a byte more (a bigger one is refused before it is read whole).
struct MessageSizes {
    /// Resume names up to [`handover::MAX_RESUME_KEYS`] keys.
    session: usize,
    /// Transactions of up to `MAX_TXN_BYTES` of values, and Puts of one value.
    kv: usize,
    /// Locks, elections (a value of one small key at most) and watches.
    small: usize,
}

impl MessageSizes {
    /// Room for a key's name, kind, revision and lease, encoded.
    const PER_KEY: usize = lockcell_cell::keyspace::MAX_NAME_BYTES + 64;
    /// Room for the fields of any request besides its keys and values.
    const FIELDS: usize = 16 * 1024;

    fn for_config(config: &ProxyConfig) -> Self {
        let value = config.max_value_bytes + Self::PER_KEY + Self::FIELDS;
        MessageSizes {
            session: handover::MAX_RESUME_KEYS * Self::PER_KEY + Self::FIELDS,
            kv: value.max(
                service::kv::MAX_TXN_BYTES
                    + service::kv::MAX_TXN_OPS * Self::PER_KEY
                    + Self::FIELDS,
            ),
            small: value,
        }
    }
}

/// How a proxy that stopped cleanly was asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// By its shutdown signal (SIGTERM, SIGINT).
    Asked,
    /// By `POST /drain` on the admin address: the process exits with
    /// [`admin::EXIT_DRAINED`].
    Drained,
}

/// What every cell's cell part of one proxy shares.
struct Shared {
    proxy_id: String,
    classes: Arc<classes::ClassBook>,
    grants: Arc<access::AccessBook>,
    limits: Arc<limits::Limits>,
    memory: Arc<memory::Memory>,
    stop: watch::Receiver<bool>,
    drain: Arc<watch::Sender<bool>>,
}

/// One connection to a cell, with what the proxy read from it at the start.
struct Connection {
    etcd: etcd_client::Client,
    /// The same cell, one member at a time, for the lease renewals.
    members: Arc<members::Members>,
    epoch: epoch::Stored,
    revision: i64,
    /// The cell's copy of the shard map.
    map: Option<lockcell_cell::shardmap::StoredMap>,
}

/// The cells the proxy serves: every cell of the shard map in the cell it was started
/// on, that cell first; just that cell when it has no map (or a map of one cell).
/// The bounds every client connection has, on either API: at most
/// `--max-streams-per-connection` calls open at once (each call is one HTTP/2 stream,
/// so this is also the bound on its calls in flight), and pings while it is quiet
/// (`--client-ping-interval`), so a vanished client's connection does not stay open.
pub(crate) fn client_server(config: &ProxyConfig) -> tonic::transport::Server {
    let every = config.client_ping_interval;
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(config.max_streams_per_connection))
        .http2_keepalive_interval(Some(every))
        .http2_keepalive_timeout(Some(every))
        .tcp_keepalive(Some(every))
}

async fn cells_to_serve(
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
struct CellPart {
    state: Arc<ProxyState>,
    tasks: tokio::task::JoinSet<()>,
    follow: Vec<tokio::task::JoinHandle<()>>,
}

impl CellPart {
    fn start(
        config: &ProxyConfig,
        shared: &Shared,
        name: Option<String>,
        connection: Connection,
        counts_sessions: bool,
    ) -> anyhow::Result<CellPart> {
        let Connection {
            etcd,
            members,
            epoch,
            revision: start_revision,
            map,
            ..
        } = connection;
        let mut config = config.clone();
        if let Some(name) = &name {
            // Each cell's state is remembered apart.
            config.state_dir = config.state_dir.map(|dir| dir.join(name));
        }
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
        let feed = Arc::new(feed::Feed::new(
            config.watch_backlog,
            config.watch_history_bytes,
            routes.clone(),
        ));
        let reads = reads::Reads::new(
            feed.clone(),
            barrier::Barrier::start(etcd.kv_client(), config.etcd_timeout),
            lockcell_cell::kv::Kv::new(etcd.kv_client(), config.etcd_timeout),
            config.etcd_timeout,
            routes.clone(),
            etcd.kv_client(),
        );
        let state = Arc::new(ProxyState {
            proxy_id: shared.proxy_id.clone(),
            cell_name: name,
            counts_sessions,
            routes,
            cell,
            sessions: Default::default(),
            leases: leases::LeaseBook::new(
                config.leases as usize,
                config.validity_margin,
                config.clock_rate_bound.0,
                Instant::now(),
            ),
            locklog: LockLog::new(etcd.kv_client(), config.etcd_timeout)
                .with_epoch_guard(epoch.mod_revision),
            kv: lockcell_cell::kv::Kv::new(etcd.kv_client(), config.etcd_timeout)
                .with_writer_key(lockcell_cell::keyspace::writer_key(&shared.proxy_id)),
            reads,
            kv_budget: Default::default(),
            space: Arc::new(space::Space::new(
                config.etcd_quota_bytes,
                config.etcd_space_limit_percent,
            )),
            queues: events.queues().clone(),
            events,
            classes: shared.classes.clone(),
            grants: shared.grants.clone(),
            limits: shared.limits.clone(),
            memory: shared.memory.clone(),
            cleanup: Default::default(),
            renewing: (0..config.leases).map(|_| Default::default()).collect(),
            etcd: etcd.clone(),
            members,
            shutdown: shared.stop.clone(),
            drain: shared.drain.clone(),
            drain_started: Default::default(),
            handed_off: Default::default(),
            etcd_lease_blocks: Default::default(),
            config,
        });
        // An ephemeral key deleted by other means than its session's end (or written on
        // no lease) is no longer the session's: it forgets it, and the key no longer
        // counts against the session's identity.
        let weak = Arc::downgrade(&state);
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
        let mut tasks = tokio::task::JoinSet::new();
        for bucket in 0..state.leases.len() {
            tasks.spawn(lease_keeper::run(state.clone(), bucket));
        }
        tasks.spawn(reaper::run(state.clone()));
        tasks.spawn({
            let state = state.clone();
            async move { state.cell.keep_remembering(Duration::from_secs(5)).await }
        });
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
            state.etcd.clone(),
            state.config.etcd_timeout,
            shared.stop.clone(),
        ));
        let follow = vec![
            // Prefix watchers' batches, handed over a few at a time.
            tokio::spawn(feed.fanout.clone().pace()),
            tokio::spawn(feed::run(
                feed,
                etcd.kv_client(),
                etcd.watch_client(),
                state.config.etcd_timeout,
            )),
            tokio::spawn(events::follow(
                following(&state),
                keyspace::locks_root(),
                false,
                start_revision + 1,
            )),
            tokio::spawn(events::follow(
                following(&state),
                keyspace::queues_root(),
                true,
                start_revision + 1,
            )),
        ];
        Ok(CellPart {
            state,
            tasks,
            follow,
        })
    }

    /// How the ready line names the cell.
    fn label(&self) -> String {
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
    async fn stop(mut self) -> Option<String> {
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

/// The gRPC service's TLS, when --tls-cert and --tls-key are given (and mutual TLS with
/// --tls-client-ca).
/// The TLS files of the gRPC service, when it serves TLS.
pub(crate) fn tls_files(config: &ProxyConfig) -> Option<tls::TlsFiles> {
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
        return None;
    };
    Some(tls::TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: config.tls_client_ca.clone(),
    })
}

/// How often the proxy pings an idle etcd connection: over etcd's default
/// `--grpc-keepalive-min-time` of 5 s, with room.
const ETCD_PING_INTERVAL: Duration = Duration::from_secs(10);

/// Client connections with Nagle's algorithm off: replies are small and go out at once
/// (with it on, a reply can wait for the client's delayed ACK, some 40 ms).
pub(crate) fn incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)))
}

/// Connects to etcd, retrying until it answers or shutdown, and reads the epoch record
/// (retrying too while the cell has none: `lockcell-cell init` writes it, and while etcd
/// has authentication off but the proxy has a user: `lockcell-cell auth-enable` turns it
/// on). Gives up at once when etcd turns the proxy's user away: retrying will not change
/// its answer.
async fn connect(
    config: &ProxyConfig,
    endpoints: &[String],
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<Connection> {
    use lockcell_cell::rbac;

    /// How etcd turned the proxy's user away, if that is why connecting failed.
    fn refused(e: &anyhow::Error) -> Option<rbac::Refusal> {
        let etcd = e
            .chain()
            .find_map(|cause| cause.downcast_ref::<etcd_client::Error>())?;
        rbac::refusal(etcd).filter(|r| *r != rbac::Refusal::TokenExpired)
    }

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
        let attempt = async {
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
            anyhow::Ok(Connection {
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
        };
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
            Err(e) if refused(&e).is_some() => {
                let user = config.etcd_user.as_deref().unwrap_or("(none)");
                let at = endpoints.join(",");
                anyhow::bail!(match refused(&e) {
                    Some(rbac::Refusal::BadCredentials) => format!("etcd at {at} refused the user {user} and its password: check --etcd-user and --etcd-password (LOCKCELL_ETCD_USER, LOCKCELL_ETCD_PASSWORD)"),
                    Some(rbac::Refusal::NoUser) => format!("etcd at {at} runs with authentication on: give the proxy its etcd user with --etcd-user lockcell-proxy and --etcd-password (LOCKCELL_ETCD_USER, LOCKCELL_ETCD_PASSWORD)"),
                    _ => format!("etcd at {at} does not let the user {user} read the epoch record ({e:#}): the proxy's user needs the lockcell-proxy role (`lockcell-cell auth-enable` sets it up)"),
                })
            }
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

async fn wait_for_leases(state: &ProxyState) {
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
async fn revoke_all(state: &ProxyState) {
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
