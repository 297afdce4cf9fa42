//! The audit process's HTTP server: `/healthz` (alive), `/readyz` (etcd answered lately
//! and not draining), `POST /drain` (stop as on SIGTERM: write what it has, flush the
//! archive, exit; taken from this host only, or only with the admin token when one is
//! set, as the port also serves every `lockctl audit` user), `/metrics` (Prometheus) and
//! `GET /v1/audit?name=NAME[&since_ms=T][&limit=N][&values=true]`, the history of one
//! lock, election or small key as JSON (what `lockctl audit` shows).
//!
//! With `--grants` (the proxies' file) the history answers only a caller with a bearer
//! token the file lists, and only about a name its grants let it read or lock. Values
//! (a small key's, a leader's) and lease ids are left out unless asked for with
//! `values=true`, which needs the read right.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use lockcell_cell::audit::store::Store;
use lockcell_cell::audit::tailer::TailerStats;
use lockcell_cell::audit::AuditEvent;
use lockcell_cell::grants::{Right, Rules};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Most events one query returns.
const MAX_LIMIT: usize = 10_000;

/// What the HTTP server answers from.
#[derive(Clone)]
pub struct Audit {
    pub metrics: PrometheusHandle,
    pub store: Arc<Store>,
    pub stats: Arc<TailerStats>,
    pub readiness: Arc<Readiness>,
    pub stop: Arc<watch::Sender<bool>>,
    pub access: Arc<Access>,
}

/// Who may ask what.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// The prefix grants file (read again at every query, so edits apply at once);
    /// without it every caller may read every history.
    pub grants: Option<PathBuf>,
    /// The file holding the token `POST /drain` requires; without it, loopback only.
    pub admin_token: Option<PathBuf>,
}

/// A refusal: its status and text.
type Refusal = (StatusCode, String);

impl Access {
    /// What the caller with `headers` may see of `name`'s history: `Ok(true)` its
    /// values too. Refuses a caller the grants do not know (401) or do not let read or
    /// lock `name` (403), and `values` to one without the read right.
    fn history_of(&self, headers: &HeaderMap, name: &str, values: bool) -> Result<bool, Refusal> {
        let Some(file) = &self.grants else {
            return Ok(values);
        };
        let rules = std::fs::read_to_string(file)
            .map_err(|e| e.to_string())
            .and_then(|text| Rules::parse(&text).map_err(|e| e.message))
            .map_err(|e| {
                // The caller may be anyone: the operator's log says which file and why.
                tracing::error!(file = %file.display(), "the grants file cannot be used: {e}");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the audit tailer cannot check grants right now (its log says why)\n"
                        .to_owned(),
                )
            })?;
        let token = authorization(headers)
            .and_then(lockcell_cell::access::bearer)
            .ok_or((
            StatusCode::UNAUTHORIZED,
            "the audit history needs a bearer token the grants list (Authorization: Bearer TOKEN)\n"
                .to_owned(),
        ))?;
        let identity = rules
            .identity_of_token(token)
            .map_err(|why| (StatusCode::UNAUTHORIZED, format!("{why}\n")))?;
        let read = rules.check(identity, Right::Read, name);
        if values {
            read.map_err(|why| (StatusCode::FORBIDDEN, format!("values: {why}\n")))?;
            return Ok(true);
        }
        match (read, rules.check(identity, Right::Lock, name)) {
            (Err(why), Err(_)) => Err((StatusCode::FORBIDDEN, format!("{why}\n"))),
            _ => Ok(false),
        }
    }
}

/// The `Authorization` header's value, if it is text.
fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()
}

/// An event as shown without its values: a small key's or leader's value and the lease
/// are left out (a gap's range and a forced release's reason are no values).
fn without_values(mut event: AuditEvent) -> AuditEvent {
    use lockcell_cell::audit::EventKind;
    event.lease = 0;
    if !matches!(event.kind, EventKind::Gap | EventKind::ForceReleased) {
        event.detail.clear();
    }
    event
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
    pub fn since_answer(&self) -> Option<Duration> {
        let at = self.answered.load(Ordering::Relaxed).checked_sub(1)?;
        Some(
            self.started
                .elapsed()
                .saturating_sub(Duration::from_millis(at)),
        )
    }
}

/// Calls etcd every `interval` (a count-only read of one key) until `stop`, for
/// `/readyz` and `lockcell_etcd_reachable`; each answer's revision is the store's head
/// for the lag (`lockcell_audit_lag_revisions`), so a watch that stalls while etcd
/// answers shows as a growing lag.
pub async fn probe(
    etcd: etcd_client::Client,
    (readiness, stats): (
        Arc<Readiness>,
        Arc<lockcell_cell::audit::tailer::TailerStats>,
    ),
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
        if let Ok(Ok(resp)) = &answer {
            readiness.etcd_answered();
            if let Some(header) = resp.header() {
                stats
                    .head
                    .fetch_max(header.revision(), std::sync::atomic::Ordering::Relaxed);
            }
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
    /// Values and lease ids too (needs the read right on the name).
    #[serde(default)]
    values: bool,
}

/// The address a request came from, over plain TCP or TLS.
#[derive(Debug, Clone, Copy)]
pub struct Peer(SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TcpListener>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, TcpListener>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

/// Serves `audit` on `listener` (plain TCP, or [`TlsListener`]) until its `stop`.
pub async fn serve<L>(listener: L, audit: Audit)
where
    L: axum::serve::Listener<Addr = SocketAddr>,
    Peer: for<'a> axum::extract::connect_info::Connected<axum::serve::IncomingStream<'a, L>>,
{
    let mut stopped = audit.stop.subscribe();
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/drain", post(drain))
        .route("/metrics", get(render_metrics))
        .route("/v1/audit", get(history))
        .with_state(audit);
    let app = app.into_make_service_with_connect_info::<Peer>();
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
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
) -> Response {
    let token_file = audit.access.admin_token.as_deref();
    if let Err((status, why)) =
        lockcell_cell::access::check_drain(token_file, peer, authorization(&headers))
    {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN);
        return (status, why).into_response();
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

async fn history(
    State(audit): State<Audit>,
    headers: HeaderMap,
    Query(q): Query<HistoryQuery>,
) -> Response {
    if q.name.is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            "name is empty: say which lock, election or key\n",
        )
            .into_response();
    }
    let values = match audit.access.history_of(&headers, &q.name, q.values) {
        Ok(values) => values,
        Err(refused) => return refused.into_response(),
    };
    let limit = q.limit.unwrap_or(1000).clamp(1, MAX_LIMIT);
    match audit.store.history(&q.name, q.since_ms, limit).await {
        Ok(events) => {
            let events: Vec<AuditEvent> = if values {
                events
            } else {
                events.into_iter().map(without_values).collect()
            };
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

/// A TCP listener that speaks TLS (`--tls-cert`, `--tls-key`): each connection's
/// handshake runs on its own (within [`HANDSHAKE_TIMEOUT`]), and a connection is handed
/// on once it is done, so a client that stalls its handshake holds up no one else.
pub struct TlsListener {
    local: SocketAddr,
    handshaken: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        SocketAddr,
    )>,
}

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

impl TlsListener {
    pub fn new(
        tcp: TcpListener,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> anyhow::Result<Self> {
        let config = Arc::new(lockcell_cell::tls::server_config(cert, key, None, &[])?);
        let local = tcp.local_addr()?;
        let handshaken = lockcell_cell::tls::accept(tcp, move || config.clone(), HANDSHAKE_TIMEOUT);
        Ok(TlsListener { local, handshaken })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.handshaken.recv().await {
            Some(handshaken) => handshaken,
            // The accepting task ends only with the channel; never here while serving.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
