//! The audit process's HTTP server: `/healthz` (alive), `/readyz` (etcd answered lately
//! and not draining), `POST /drain` (stop as on SIGTERM: write what it has, flush the
//! archive, exit; taken from this host only, as the port also serves every `lockctl
//! audit` user), `/metrics` (Prometheus) and
//! `GET /v1/audit?name=NAME[&since_ms=T][&limit=N]`, the history of one lock, election or
//! small key as JSON (what `lockctl audit` shows).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
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
    readiness: Arc<Readiness>,
    stop: Arc<watch::Sender<bool>>,
}

/// Whether etcd answered lately: a probe calls it every `interval` (the tailer's own
/// watch may sit quiet for minutes on a quiet cell, so its silence says nothing).
pub struct Readiness {
    started: Instant,
    /// Milliseconds after `started` of the last answer from etcd, plus one (0: never).
    answered: AtomicU64,
    /// How long after an answer etcd still counts as reachable: two probes and a
    /// deadline.
    window: Duration,
}

impl Readiness {
    pub fn new(interval: Duration, etcd_timeout: Duration) -> Readiness {
        Readiness {
            started: Instant::now(),
            answered: AtomicU64::new(0),
            window: interval * 2 + etcd_timeout,
        }
    }

    fn etcd_answered(&self) {
        let at = self.started.elapsed().as_millis() as u64 + 1;
        self.answered.store(at, Ordering::Relaxed);
    }

    /// How long ago etcd last answered, if ever.
    fn since_answer(&self) -> Option<Duration> {
        let at = self.answered.load(Ordering::Relaxed).checked_sub(1)?;
        Some(
            self.started
                .elapsed()
                .saturating_sub(Duration::from_millis(at)),
        )
    }
}

/// Calls etcd every `interval` (a count-only read of one key) until `stop`, for
/// `/readyz` and `lockcell_etcd_reachable`.
pub async fn probe(
    etcd: etcd_client::Client,
    readiness: Arc<Readiness>,
    interval: Duration,
    etcd_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut kv = etcd.kv_client();
    let options = etcd_client::GetOptions::new().with_count_only();
    loop {
        let answer =
            tokio::time::timeout(etcd_timeout, kv.get("/sys/epoch", Some(options.clone()))).await;
        let reachable = matches!(answer, Ok(Ok(_)));
        if reachable {
            readiness.etcd_answered();
        }
        metrics::gauge!("lockcell_etcd_reachable").set(if reachable { 1.0 } else { 0.0 });
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
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
    readiness: Arc<Readiness>,
    stop: Arc<watch::Sender<bool>>,
) {
    let mut stopped = stop.subscribe();
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/drain", post(drain))
        .route("/metrics", get(render_metrics))
        .route("/v1/audit", get(history))
        .with_state(Audit {
            metrics,
            store,
            stats,
            readiness,
            stop,
        });
    let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "the audit HTTP server failed");
    }
}

/// 200 when etcd answered within the window and the tailer is not stopping; else 503
/// with the reason.
async fn readyz(State(audit): State<Audit>) -> Response {
    if *audit.stop.borrow() {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: draining\n").into_response();
    }
    let lag = audit.stats.lag();
    let checkpoint = audit.stats.checkpoint.load(Ordering::Relaxed);
    match audit.readiness.since_answer() {
        Some(since) if since <= audit.readiness.window => (
            StatusCode::OK,
            format!(
                "ready: etcd answered {} ms ago; checkpoint revision {checkpoint}, {lag} revisions behind\n",
                since.as_millis()
            ),
        )
            .into_response(),
        Some(since) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: etcd has not answered for {} ms (more than {} ms)\n",
                since.as_millis(),
                audit.readiness.window.as_millis()
            ),
        )
            .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: etcd has not answered yet\n",
        )
            .into_response(),
    }
}

/// Stops the tailer as SIGTERM does: it writes what it has, flushes the archive and
/// exits. Only from this host (a preStop hook, an operator on the machine): the port
/// serves the audit history to every `lockctl audit` user, who may not stop it.
async fn drain(
    State(audit): State<Audit>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
) -> Response {
    if !peer.ip().is_loopback() {
        return (
            StatusCode::FORBIDDEN,
            format!("POST /drain is taken from this host only, not from {peer}\n"),
        )
            .into_response();
    }
    let _ = audit.stop.send(true);
    (
        StatusCode::ACCEPTED,
        "draining: writing what the tailer has, flushing the archive, then exiting\n",
    )
        .into_response()
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
