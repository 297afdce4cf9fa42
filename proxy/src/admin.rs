//! The admin HTTP server: `/metrics` for Prometheus, `/healthz` (alive), `/readyz`
//! (etcd answers and every lease is held), and `POST /drain` (what SIGTERM does: ask
//! every client to move to another proxy, wait up to the drain timeout, then stop).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::metrics as m;
use crate::state::ProxyState;

#[derive(Clone)]
struct Admin {
    metrics: PrometheusHandle,
    /// Every cell's engine; the first is the cell the proxy started on.
    states: Arc<[Arc<ProxyState>]>,
}

impl Admin {
    fn first(&self) -> &ProxyState {
        &self.states[0]
    }
}

/// Serves the admin endpoints on `listener` until the proxy shuts down.
pub async fn serve(
    listener: TcpListener,
    metrics: PrometheusHandle,
    states: Arc<[Arc<ProxyState>]>,
) {
    let mut shutdown = states[0].shutdown.clone();
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/drain", post(drain))
        .with_state(Admin { metrics, states });
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "admin server failed");
    }
}

/// How the proxy's etcd leases stand, over every cell.
struct Leases {
    held: usize,
    total: usize,
    /// The least time any lease can still back a client's validity.
    remaining: Duration,
    /// Every lease held and renewed within the renew interval plus the etcd timeout.
    reachable: bool,
}

fn leases(states: &[Arc<ProxyState>]) -> Leases {
    let now = Instant::now();
    let mut held = 0;
    let mut total = 0;
    let mut remaining = None::<Duration>;
    let mut reachable = true;
    for state in states {
        let config = &state.config;
        // A lease renewed at most this long ago has at least this much left.
        let fresh = config
            .lease_ttl
            .saturating_sub(config.renew_interval() + config.etcd_timeout)
            .saturating_sub(config.validity_margin);
        for bucket in 0..state.leases.len() {
            total += 1;
            let left = match state.leases.lease(bucket) {
                Some(lease) => {
                    held += 1;
                    state.leases.left(bucket, lease, now)
                }
                None => Duration::ZERO,
            };
            reachable &= left > Duration::ZERO && left >= fresh;
            remaining = Some(remaining.map_or(left, |r| r.min(left)));
        }
    }
    Leases {
        held,
        total,
        remaining: remaining.unwrap_or_default(),
        reachable,
    }
}

async fn render_metrics(State(admin): State<Admin>) -> String {
    let leases = leases(&admin.states);
    metrics::gauge!(m::LEASE_REMAINING).set(leases.remaining.as_secs_f64());
    metrics::gauge!(m::ETCD_REACHABLE).set(if leases.reachable { 1.0 } else { 0.0 });
    admin.metrics.render()
}

/// Starts the drain that ends with the proxy stopping.
async fn drain(State(admin): State<Admin>) -> (StatusCode, String) {
    let state = admin.first();
    let started = state.start_drain();
    let body = format!(
        "{}; {} sessions here, drain timeout {:?}\n",
        if started {
            "draining"
        } else {
            "already draining"
        },
        state.sessions.len(),
        state.config.drain_timeout
    );
    (StatusCode::ACCEPTED, body)
}

/// Alive: the process answers (a liveness probe; readiness is `/readyz`).
async fn healthz() -> &'static str {
    "alive\n"
}

/// Ready while etcd answers and the proxy holds every one of its etcd leases (in every
/// cell), so it can grant, and is not draining (a draining proxy sends its clients
/// away). The body says how things stand.
async fn readyz(State(admin): State<Admin>) -> (StatusCode, String) {
    let leases = leases(&admin.states);
    let draining = admin.first().is_draining();
    let mut body = format!(
        "leases {}/{}\nlease lower bound {:.1}s\netcd {}\nsessions {}\n",
        leases.held,
        leases.total,
        leases.remaining.as_secs_f64(),
        if leases.reachable {
            "reachable"
        } else {
            "not renewing in time"
        },
        admin.first().sessions.len(),
    );
    if draining {
        body.push_str("draining\n");
    }
    if leases.reachable && leases.held == leases.total && !draining {
        (StatusCode::OK, body)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}
