//! lockcell-proxy: the zone proxy. It holds client sessions in memory, answers their
//! keepalives itself, and attaches every key its clients create to one of K etcd leases
//! of its own (docs/design.md).
//!
//! Pure parts ([`sessions`], [`leases`], [`classes`], the arbiter queues behind
//! [`queues`]) hold the proxy's bookkeeping; the runtime parts ([`lease_keeper`],
//! [`reaper`], [`events`], [`acquire`], [`service`]) carry out what they decide
//! against etcd. The proxy's decisions (a waiter's turns, a session's life and move)
//! are state machines in [`core`]. [`cell_part`] is the proxy's part in one cell,
//! [`front`] routes each call to the cell that serves its name, and [`etcd_api`]
//! serves etcd's own API over the same parts.
#![forbid(unsafe_code)]

pub mod access;
pub mod acquire;
pub mod admin;
pub mod barrier;
pub mod catchup;
pub mod cell_part;
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

use cell_part::{cells_to_serve, connect, wait_for_leases, CellPart, Shared};
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
