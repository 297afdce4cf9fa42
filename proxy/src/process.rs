//! The proxy process: it starts its part in each cell, serves the lockcell API through
//! the front (and etcd's API, with `--etcd-listen`), and drains and stops when asked.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lockcell_proto::v1::election_server::ElectionServer;
use lockcell_proto::v1::kv_server::KvServer;
use lockcell_proto::v1::lock_server::LockServer;
use lockcell_proto::v1::session_server::SessionServer;
use lockcell_proto::v1::watch_server::WatchServer;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::cell_part::{cells_to_serve, connect, wait_for_leases, CellPart, Connection, Shared};
use crate::config::ProxyConfig;
use crate::listen::{client_server, incoming, tls_files};
use crate::state::ProxyState;
use crate::{access, admin, classes, etcd_api, front, handover, memory, metrics, service, tls};

/// Installs the Prometheus recorder for this process and describes the metrics.
pub fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let buckets = [
        (metrics::ACQUIRE_SECONDS, metrics::ACQUIRE_BUCKETS),
        (metrics::ETCD_REQUEST_SECONDS, metrics::ETCD_BUCKETS),
        (metrics::RESUME_SECONDS, metrics::ETCD_BUCKETS),
        (metrics::HANDOVER_SECONDS, metrics::ETCD_BUCKETS),
        (metrics::VALIDITY_GRANTED, metrics::VALIDITY_BUCKETS),
        (metrics::OVERHEAD_SECONDS, metrics::OVERHEAD_BUCKETS),
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
    let shared = shared(&config, proxy_id.clone(), stop_rx.clone(), drain.clone())?;
    tokio::spawn(memory::keep_reading(shared.memory.clone(), stop_rx.clone()));
    let tls = tls_files(&config)
        .map(tls::ReloadingTls::load)
        .transpose()?
        .map(Arc::new);
    let home = connect(&config, &config.etcd_endpoints, drain.subscribe()).await?;
    let cells = cells_to_serve(&config, &home).await?;
    let grpc = bind(config.listen, "the gRPC address").await?;
    let admin = bind(config.admin_listen, "the admin address").await?;
    let etcd_api = bind_etcd_api(&config, cells.len()).await?;
    let engines = start_cells(&config, &shared, home, cells, &drain).await?;
    let draining = drain_when_asked(&engines, &drain, stop_tx);
    let first = engines[0].state.clone();
    let mut tasks = tokio::task::JoinSet::new();
    let drained = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tasks.spawn(admin::serve(
        admin,
        prometheus,
        states(&engines),
        drained.clone(),
    ));
    let every = Duration::from_secs(1);
    tasks.spawn(shared.classes.clone().follow(every, stop_rx.clone()));
    tasks.spawn(shared.grants.clone().follow(every, stop_rx.clone()));
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
    // Not one of `tasks`, which are aborted once the lockcell API has stopped: the etcd
    // API's streams end with their reason (UNAVAILABLE, "shutting down") only if its
    // server finishes its own graceful stop.
    let etcd_served = etcd_api.map(|listener| serve_etcd_api(listener, &first, &tls, &stop_rx));
    let server = client_api(&engines, grpc, tls, stop_rx.clone(), &mut tasks);
    serve_until_stopped(server, etcd_served, stop_rx, first.config.shutdown_grace).await?;
    tasks.shutdown().await;
    stopping.abort();
    draining.abort();
    stop_cells(engines).await?;
    tracing::info!("lockcell-proxy stopped");
    Ok(if drained.load(std::sync::atomic::Ordering::SeqCst) {
        Stopped::Drained
    } else {
        Stopped::Asked
    })
}

/// What the proxy's cell parts share: its id, the class and grants files, the limits'
/// counts, its memory bound, and its stop and drain signals.
fn shared(
    config: &ProxyConfig,
    proxy_id: String,
    stop: watch::Receiver<bool>,
    drain: Arc<watch::Sender<bool>>,
) -> anyhow::Result<Shared> {
    Ok(Shared {
        proxy_id,
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
        stop,
        drain,
    })
}

async fn bind(addr: std::net::SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {what} {addr}"))
}

/// The etcd API's listener, with `--etcd-listen`: only on a proxy of one cell.
async fn bind_etcd_api(config: &ProxyConfig, cells: usize) -> anyhow::Result<Option<TcpListener>> {
    let Some(addr) = config.etcd_listen else {
        return Ok(None);
    };
    if cells > 1 {
        anyhow::bail!(
            "--etcd-listen: the etcd API serves a proxy of one cell, and this proxy serves {cells} (the shard map has several cells)"
        );
    }
    if addr.ip().is_unspecified() && config.etcd_advertise.is_none() {
        tracing::warn!(
            %addr,
            "--etcd-listen binds every interface and no --etcd-advertise is set: the other proxies cannot forward calls on this proxy's leases here, and MemberList names an address clients cannot reach"
        );
    }
    Ok(Some(bind(addr, "the etcd API address").await?))
}

/// Starts the proxy's part in each cell it serves, the first on the connection it
/// started with (`home`), checking each cell is the cluster the shard map names.
async fn start_cells(
    config: &ProxyConfig,
    shared: &Shared,
    home: Connection,
    cells: Vec<(Option<String>, Vec<String>, String)>,
    drain: &watch::Sender<bool>,
) -> anyhow::Result<Vec<CellPart>> {
    let mut engines = Vec::new();
    let mut home = Some(home);
    for (i, (name, endpoints, cluster_id)) in cells.into_iter().enumerate() {
        // The first cell is the one the proxy started on.
        let connection = match home.take().filter(|_| i == 0) {
            Some(home) => home,
            None => connect(config, &endpoints, drain.subscribe()).await?,
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
            config,
            shared,
            name,
            connection,
            counts_sessions,
        )?);
    }
    Ok(engines)
}

fn states(engines: &[CellPart]) -> Arc<[Arc<ProxyState>]> {
    engines.iter().map(|e| e.state.clone()).collect()
}

/// Once asked to stop: drains every cell's sessions, then stops serving.
fn drain_when_asked(
    engines: &[CellPart],
    drain: &watch::Sender<bool>,
    stop: watch::Sender<bool>,
) -> tokio::task::JoinHandle<()> {
    let states: Vec<_> = engines.iter().map(|e| e.state.clone()).collect();
    let mut asked = drain.subscribe();
    tokio::spawn(async move {
        let _ = asked.wait_for(|d| *d).await;
        ::metrics::gauge!(metrics::DRAINING).set(1.0);
        let mut drains = tokio::task::JoinSet::new();
        for state in states {
            drains.spawn(async move { handover::drain(&state).await });
        }
        drains.join_all().await;
        let _ = stop.send(true);
    })
}

/// Serves etcd's API on `listener` until the proxy stops.
fn serve_etcd_api(
    listener: TcpListener,
    first: &Arc<ProxyState>,
    tls: &Option<Arc<tls::ReloadingTls>>,
    stop: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let api = etcd_api::EtcdApi::new(first.clone());
    let (tls, stop) = (tls.clone(), stop.clone());
    tokio::spawn(async move {
        if let Err(error) = api.serve(listener, tls, stop).await {
            tracing::error!(%error, "the etcd API stopped");
        }
    })
}

type Serving = std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// lockcell's own API on `grpc`, through the front, until the proxy stops.
fn client_api(
    engines: &[CellPart],
    grpc: TcpListener,
    tls: Option<Arc<tls::ReloadingTls>>,
    mut stop: watch::Receiver<bool>,
    tasks: &mut tokio::task::JoinSet<()>,
) -> Serving {
    let config = &engines[0].state.config;
    let front = Arc::new(front::Router::new(
        engines.iter().map(|e| e.state.clone()).collect(),
    ));
    let sizes = MessageSizes::for_config(config);
    let router = client_server(config, crate::overhead::Api::Lockcell)
        .add_service(
            SessionServer::from_arc(front.clone()).max_decoding_message_size(sizes.session),
        )
        .add_service(LockServer::from_arc(front.clone()).max_decoding_message_size(sizes.small))
        .add_service(ElectionServer::from_arc(front.clone()).max_decoding_message_size(sizes.small))
        .add_service(KvServer::from_arc(front.clone()).max_decoding_message_size(sizes.kv))
        .add_service(WatchServer::from_arc(front).max_decoding_message_size(sizes.small));
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    match tls {
        Some(tls) => {
            tasks.spawn(tls.clone().watch());
            Box::pin(router.serve_with_incoming_shutdown(tls::incoming(grpc, tls), stopped))
        }
        None => Box::pin(router.serve_with_incoming_shutdown(incoming(grpc), stopped)),
    }
}

/// Runs the client API until it stops gracefully or, once the proxy stops, the
/// shutdown grace runs out; then the etcd API, in what is left of the grace.
async fn serve_until_stopped(
    server: Serving,
    etcd_served: Option<tokio::task::JoinHandle<()>>,
    mut stop: watch::Receiver<bool>,
    grace: Duration,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// Stops every cell part; an error if a cell changed under the proxy meanwhile.
async fn stop_cells(engines: Vec<CellPart>) -> anyhow::Result<()> {
    let mut changed = Vec::new();
    for engine in engines {
        if let Some(reason) = engine.stop().await {
            changed.push(reason);
        }
    }
    if !changed.is_empty() {
        anyhow::bail!("the cell changed under this proxy: {}", changed.join("; "));
    }
    Ok(())
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
