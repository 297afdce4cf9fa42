//! The audit process's HTTP server: `/healthz`, `/metrics` (Prometheus) and
//! `GET /v1/audit?name=NAME[&since_ms=T][&limit=N]`, the history of one lock, election or
//! small key as JSON (what `lockctl audit` shows).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use lockcell_cell::audit::store::Store;
use lockcell_cell::audit::tailer::TailerStats;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Most events one query returns.
const MAX_LIMIT: usize = 10_000;

#[derive(Clone)]
struct Audit {
    metrics: PrometheusHandle,
    store: Arc<Store>,
    stats: Arc<TailerStats>,
}

#[derive(Debug, Deserialize)]
struct HistoryQuery {
    name: String,
    since_ms: Option<i64>,
    limit: Option<usize>,
}

pub async fn serve(
    listener: TcpListener,
    metrics: PrometheusHandle,
    store: Arc<Store>,
    stats: Arc<TailerStats>,
    mut stop: watch::Receiver<bool>,
) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(render_metrics))
        .route("/v1/audit", get(history))
        .with_state(Audit {
            metrics,
            store,
            stats,
        });
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "the audit HTTP server failed");
    }
}

async fn render_metrics(State(audit): State<Audit>) -> String {
    audit.metrics.render()
}

async fn history(State(audit): State<Audit>, Query(q): Query<HistoryQuery>) -> Response {
    if q.name.is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            "name is empty: say which lock, election or key\n",
        )
            .into_response();
    }
    let limit = q.limit.unwrap_or(1000).clamp(1, MAX_LIMIT);
    match audit.store.history(&q.name, q.since_ms, limit).await {
        Ok(events) => {
            let checkpoint = audit
                .stats
                .checkpoint
                .load(std::sync::atomic::Ordering::Relaxed);
            (
                [("lockcell-audit-checkpoint", checkpoint.to_string())],
                Json(events),
            )
                .into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the audit store could not answer: {e}\n"),
        )
            .into_response(),
    }
}
