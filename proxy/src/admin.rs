//! The admin HTTP server: `/metrics` for Prometheus, `/healthz` (alive), `/readyz`
//! (etcd answers and every lease is held), and `POST /drain` (what SIGTERM does: ask
//! every client to move to another proxy, wait up to the drain timeout, then stop).
//!
//! `POST /sessions/end?session=ID&lock=NAME&token=EPOCH:REV&reason=TEXT` ends one
//! client session for an operator (`lockcell-cell force-release`), if it still holds
//! that hold: the session is renewed no more, its fence in etcd refuses every resume,
//! its client is told it expired and why, and its keys go once the validity granted to
//! it has run out.
//!
//! `POST /drain` stops the proxy, so it answers only a caller it can trust: one with
//! the admin token, when `--admin-token-file` is set, or else one on this host's
//! loopback; so does `POST /sessions/end`. A proxy stopped by it exits with [`EXIT_DRAINED`], not 0: a supervisor
//! that restarts on failure starts it again, and a drain no operator asked for shows.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::metrics as m;
use crate::sessions::Session;
use crate::state::ProxyState;

/// The exit status of a proxy stopped by `POST /drain` (SIGTERM's drain exits 0).
pub const EXIT_DRAINED: i32 = 3;

#[derive(Clone)]
struct Admin {
    metrics: PrometheusHandle,
    /// Every cell's engine; the first is the cell the proxy started on.
    states: Arc<[Arc<ProxyState>]>,
    /// The file holding the token `POST /drain` requires, if any.
    token_file: Option<PathBuf>,
    /// Set when `POST /drain` started the drain.
    drained: Arc<AtomicBool>,
}

impl Admin {
    fn first(&self) -> &ProxyState {
        &self.states[0]
    }
}

/// Serves the admin endpoints on `listener` until the proxy shuts down.
/// `drained` is set when `POST /drain` starts the drain.
pub async fn serve(
    listener: TcpListener,
    metrics: PrometheusHandle,
    states: Arc<[Arc<ProxyState>]>,
    drained: Arc<AtomicBool>,
) {
    let mut shutdown = states[0].shutdown.clone();
    let token_file = states[0].config.admin_token_file.clone();
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/drain", post(drain))
        .route("/sessions/end", post(end_session))
        .with_state(Admin {
            metrics,
            states,
            token_file,
            drained,
        });
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
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
    let kv_bytes: usize = admin
        .states
        .iter()
        .map(|s| s.reads.feed.with_mirror(|m| m.bytes()))
        .sum();
    metrics::gauge!(m::KV_BYTES).set(kv_bytes as f64);
    admin.metrics.render()
}

/// Whether the admin call `what` from `peer` may go ahead (the admin token, or
/// loopback); else the answer that refuses it.
fn trusted(
    admin: &Admin,
    what: &str,
    peer: SocketAddr,
    headers: &HeaderMap,
) -> Result<(), (StatusCode, String)> {
    let authorization = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    lockcell_cell::access::check_admin(what, admin.token_file.as_deref(), peer, authorization)
        .map_err(|(status, why)| {
            tracing::warn!(%peer, "{what} refused: {}", why.trim_end());
            (
                StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN),
                why,
            )
        })
}

/// Starts the drain that ends with the proxy stopping, for a caller it trusts.
async fn drain(
    State(admin): State<Admin>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> (StatusCode, String) {
    if let Err(refused) = trusted(&admin, "POST /drain", peer, &headers) {
        return refused;
    }
    let state = admin.first();
    admin.drained.store(true, Ordering::SeqCst);
    let started = state.start_drain();
    if started {
        tracing::warn!(%peer, "POST /drain: draining, then stopping");
    }
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

#[derive(serde::Deserialize)]
struct EndSession {
    session: String,
    /// The hold the caller looked at: the session is ended only while it still holds
    /// `lock` with `token` (`EPOCH:REVISION`).
    lock: String,
    token: String,
    #[serde(default)]
    reason: String,
}

/// Ends a client session for an operator, in whichever cell it is, if it still holds
/// the hold named: 200 with what it held and when its keys go (JSON), 409 when it does
/// not hold that, 404 when the session is not on this proxy.
async fn end_session(
    State(admin): State<Admin>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Query(ask): Query<EndSession>,
) -> (StatusCode, String) {
    if let Err(refused) = trusted(&admin, "POST /sessions/end", peer, &headers) {
        return refused;
    }
    let Ok(token) = ask.token.parse::<lockcell_proto::FencingToken>() else {
        return (
            StatusCode::BAD_REQUEST,
            format!("token {:?} is not EPOCH:REVISION\n", ask.token),
        );
    };
    let reason = if ask.reason.is_empty() {
        "ended by an operator".to_owned()
    } else {
        format!("ended by an operator: {}", ask.reason)
    };
    for state in admin.states.iter() {
        let Some(session) = state.sessions.peek(&ask.session) else {
            continue;
        };
        let holds = state.routes.token_epoch(&ask.lock) == token.epoch
            && session
                .held
                .iter()
                .any(|g| !g.waiter && g.lock.as_str() == ask.lock && g.revision == token.revision);
        if !holds {
            return (
                StatusCode::CONFLICT,
                format!(
                    "session {} does not hold {:?} with token {token} here; nothing ended\n",
                    ask.session, ask.lock
                ),
            );
        }
        let Some(session) = state.sessions.end(&ask.session, reason.as_str().into()) else {
            continue;
        };
        let at = session.expires_at();
        let fenced = fence_ended(state, &session, &reason).await;
        let held: Vec<&str> = session
            .held
            .iter()
            .filter(|g| !g.waiter)
            .map(|g| g.lock.as_str())
            .collect();
        tracing::warn!(
            %peer,
            session.id = %ask.session,
            identity = %session.identity,
            ?held,
            fenced,
            reason = session.life.ended().map(|r| &**r).unwrap_or_default(),
            "session ended by an operator"
        );
        let body = serde_json::json!({
            "proxy_id": state.proxy_id,
            "session": ask.session,
            "identity": session.identity,
            "held": held,
            "fenced": fenced,
            "keys_go_in_ms": at.saturating_duration_since(Instant::now()).as_millis() as u64,
        });
        return (StatusCode::OK, format!("{body}\n"));
    }
    (
        StatusCode::NOT_FOUND,
        format!("session {} is not open on this proxy\n", ask.session),
    )
}

/// Fences a session an operator ended in etcd too, so a resume on any proxy, this one
/// included, is refused: false when it could not be.
async fn fence_ended(state: &ProxyState, session: &Session, reason: &str) -> bool {
    match lockcell_cell::LockName::parse(&session.id) {
        Ok(name) => match state.locklog.end_fence(&name, session.lease, reason).await {
            Ok(created) => {
                if let Some(revision) = created {
                    let fence = lockcell_cell::locklog::Grant::fence(&name, revision);
                    state
                        .sessions
                        .record_grant(&session.id, session.incarnation, fence, None);
                }
                true
            }
            Err(e) => {
                tracing::error!(session.id = %session.id, error = %e, "could not fence the ended session in etcd; a resume elsewhere could keep it");
                false
            }
        },
        Err(_) => false,
    }
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
