//! The admin HTTP server: `/metrics` for Prometheus and `/healthz`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
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

/// Healthy while the proxy holds at least one etcd lease, so it can grant.
async fn healthz(State(admin): State<Admin>) -> (StatusCode, String) {
    let leases = admin.state.leases.leases().len();
    let total = admin.state.leases.len();
    let body = format!(
        "leases {leases}/{total}\nsessions {}\n",
        admin.state.sessions.len()
    );
    if leases > 0 {
        (StatusCode::OK, body)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}
