//! The admin HTTP server: `/metrics` for Prometheus, `/healthz`, and `POST /drain`
//! (what SIGTERM does: ask every client to move to another proxy, wait up to the drain
//! timeout, then stop).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

use crate::state::ProxyState;

#[derive(Clone)]
struct Admin {
    metrics: PrometheusHandle,
    state: Arc<ProxyState>,
}

/// Serves the admin endpoints on `listener` until the proxy shuts down.
pub async fn serve(listener: TcpListener, metrics: PrometheusHandle, state: Arc<ProxyState>) {
    let mut shutdown = state.shutdown.clone();
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/drain", post(drain))
        .with_state(Admin { metrics, state });
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "admin server failed");
    }
}

async fn render_metrics(State(admin): State<Admin>) -> String {
    admin.metrics.render()
}

/// Starts the drain that ends with the proxy stopping.
async fn drain(State(admin): State<Admin>) -> (StatusCode, String) {
    let started = admin.state.start_drain();
    let body = format!(
        "{}; {} sessions here, drain timeout {:?}\n",
        if started {
            "draining"
        } else {
            "already draining"
        },
        admin.state.sessions.len(),
        admin.state.config.drain_timeout
    );
    (StatusCode::ACCEPTED, body)
}

/// Healthy while the proxy holds at least one etcd lease, so it can grant, and is not
/// draining (a draining proxy sends new clients away).
async fn healthz(State(admin): State<Admin>) -> (StatusCode, String) {
    let leases = admin.state.leases.leases().len();
    let total = admin.state.leases.len();
    let draining = admin.state.is_draining();
    let body = format!(
        "leases {leases}/{total}\nsessions {}\n{}",
        admin.state.sessions.len(),
        if draining { "draining\n" } else { "" }
    );
    if leases > 0 && !draining {
        (StatusCode::OK, body)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}
