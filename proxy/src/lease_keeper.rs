//! Keeps each of the proxy's K etcd leases alive, and replaces a lease that is lost.
//!
//! One task per bucket: grant a lease, then renew it every renew interval over a
//! keepalive stream, recording `time sent + TTL` as the lease's lower bound. A reply that
//! does not arrive in time resets the stream, so a late reply can never be paired with a
//! later send time. Once the lower bound passes without a renewal, or etcd says the
//! lease is gone, the bucket's sessions expire and a new lease is granted.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tokio::time::{Instant, MissedTickBehavior};

use crate::members::Failure;
use crate::metrics as m;
use crate::pause::Pauses;
use crate::state::ProxyState;

/// Runs bucket `bucket` until shutdown.
pub async fn run(state: Arc<ProxyState>, bucket: usize) {
    let mut shutdown = state.shutdown.clone();
    loop {
        let lease = tokio::select! {
            lease = grant(&state, bucket) => lease,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        if bucket == 0 {
            tokio::spawn(announce(state.clone(), lease));
        }
        let reason = tokio::select! {
            reason = renew(&state, bucket, lease) => reason,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        lose(&state, bucket, lease, reason);
    }
}

/// Grants a lease for `bucket`, retrying until etcd answers.
async fn grant(state: &ProxyState, bucket: usize) -> i64 {
    let ttl = state.config.lease_ttl.as_secs() as i64;
    let mut pauses = Pauses::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let sent = (Instant::now(), state.leases.generation());
        let mut client = state.etcd.lease_client();
        let call = client.grant(ttl, None);
        let result = tokio::time::timeout(state.config.etcd_timeout, call).await;
        record("lease grant", &result, sent.0);
        match result {
            Ok(Ok(resp)) => {
                let granted = Duration::from_secs(resp.ttl().max(0) as u64);
                state.leases.install(bucket, resp.id(), sent, granted);
                tracing::info!(
                    bucket,
                    lease = resp.id(),
                    ttl_s = resp.ttl(),
                    "granted proxy lease"
                );
                return resp.id();
            }
            Ok(Err(e)) => tracing::warn!(bucket, error = %e, "lease grant failed; retrying"),
            Err(_) => tracing::warn!(bucket, "lease grant timed out; retrying"),
        }
        tokio::time::sleep(pauses.next_pause()).await;
    }
}

/// Writes the proxy's presence record on `lease` (its first bucket's), so that
/// `lockcell-cell` sees which proxies run on the cell; tries again until it is written,
/// or the lease is replaced or the proxy stops.
async fn announce(state: Arc<ProxyState>, lease: i64) {
    let mut pauses = Pauses::new(Duration::from_millis(100), Duration::from_secs(5));
    while state.leases.lease(0) == Some(lease) && !*state.shutdown.borrow() {
        match announce_on(&state, lease).await {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, lease, "writing the proxy's presence record failed; retrying")
            }
        }
        tokio::time::sleep(pauses.next_pause()).await;
    }
}

/// Writes the proxy's presence record once on `lease`: what it is, where it listens,
/// and the blocks of etcd API lease IDs it has taken so far.
pub(crate) async fn announce_on(
    state: &ProxyState,
    lease: i64,
) -> Result<(), lockcell_cell::CellError> {
    let blocks = state.etcd_lease_blocks.lock().await;
    let presence = lockcell_cell::presence::Presence {
        proxy_id: state.proxy_id.clone(),
        zone: state.config.zone.clone(),
        listen: state.config.listen.to_string(),
        admin: state.config.admin_listen.to_string(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        started_ms: started_ms(),
        etcd: state.config.etcd_advertised(),
        etcd_lease_blocks: blocks.clone(),
    };
    let mut kv = state.etcd.kv_client();
    let timeout = state.config.etcd_timeout;
    lockcell_cell::presence::announce(&mut kv, &presence, lease, timeout).await
}

/// When the proxy first held a lease, Unix milliseconds: when it started, for its
/// presence record.
fn started_ms() -> u64 {
    static STARTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *STARTED.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    })
}

/// Records a lease call's latency with the other etcd calls'.
fn record<T, E>(
    call: &'static str,
    result: &Result<Result<T, E>, tokio::time::error::Elapsed>,
    sent: Instant,
) {
    let outcome = match result {
        Ok(Ok(_)) => "ok",
        Ok(Err(_)) => "error",
        Err(_) => "timeout",
    };
    lockcell_cell::error::record_etcd_call(call, outcome, sent.elapsed());
}

/// How soon a renewal that failed is first tried again (on a new stream, which may
/// reach another etcd member); the pause doubles with each failure in a row, up to the
/// renew interval.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Renews `lease` until it is lost; returns why.
///
/// Each attempt gets at most one renew interval (less than `--etcd-timeout` with the
/// defaults): a member that stopped answering (a dead host, a frozen process) holds
/// a stream until the attempt gives up, and an attempt that waited the whole etcd
/// timeout could outlast the lease. A failed attempt is tried again soon on a new
/// stream, which etcd's client may open on another member.
async fn renew(state: &ProxyState, bucket: usize, lease: i64) -> &'static str {
    let mut tick = tokio::time::interval(state.config.renew_interval());
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let attempt = state.config.etcd_timeout.min(state.config.renew_interval());
    // The stream, and the member it is open on.
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut member = 0;
    // Steady: a retry must come before the lease's bound, not a jitter's length later.
    let mut pauses = Pauses::steady(RETRY_PAUSE, state.config.renew_interval());
    loop {
        tick.tick().await;
        if state.leases.past_bound(bucket, Instant::now()) {
            return "the proxy could not renew its etcd lease before the lease's lower bound";
        }
        let (keeper, replies) = match stream.as_mut() {
            Some(pair) => pair,
            None => {
                let (at, client) = state.members.lease_client().await;
                member = at;
                let mut client = match client {
                    Ok(client) => client,
                    Err(how) => {
                        state.members.failed(member, how).await;
                        retry_soon(&mut tick, &mut pauses);
                        continue;
                    }
                };
                let call = client.keep_alive(lease);
                match tokio::time::timeout(attempt, call).await {
                    Ok(Ok(pair)) => stream.insert(pair),
                    Ok(Err(e)) => {
                        tracing::warn!(bucket, lease, error = %e, "lease keepalive stream failed to open");
                        state.members.failed(member, Failure::Answered).await;
                        retry_soon(&mut tick, &mut pauses);
                        continue;
                    }
                    Err(_) => {
                        tracing::warn!(bucket, lease, "lease keepalive stream timed out opening");
                        state.members.failed(member, Failure::Silent).await;
                        retry_soon(&mut tick, &mut pauses);
                        continue;
                    }
                }
            }
        };
        let sent = (Instant::now(), state.leases.generation());
        metrics::counter!(m::LEASE_RENEWALS).increment(1);
        let exchange = async {
            keeper.keep_alive().await?;
            replies.message().await
        };
        let result = tokio::time::timeout(attempt, exchange).await;
        record("lease keepalive", &result, sent.0);
        match result {
            Ok(Ok(Some(reply))) if reply.id() == lease && reply.ttl() > 0 => {
                let ttl = Duration::from_secs(reply.ttl() as u64);
                state.leases.renewed(bucket, lease, sent, ttl);
                state.members.answered(member);
                pauses.reset();
                if let Some(header) = reply.header() {
                    state.cell.saw(header.revision());
                }
            }
            Ok(Ok(Some(reply))) if reply.ttl() <= 0 => {
                return "etcd reports the proxy lease expired or revoked";
            }
            other => {
                let (what, how) = match other {
                    Ok(Err(e)) => (e.to_string(), Failure::Answered),
                    Ok(Ok(_)) => ("stream ended".to_owned(), Failure::Answered),
                    Err(_) => ("no reply in time".to_owned(), Failure::Silent),
                };
                tracing::warn!(bucket, lease, error = %what, "lease renewal failed; reopening the stream");
                stream = None;
                state.members.failed(member, how).await;
                retry_soon(&mut tick, &mut pauses);
            }
        }
    }
}

/// After a failed renewal: the next try after the next of `pauses` (sooner than the
/// next renewal).
fn retry_soon(tick: &mut tokio::time::Interval, pauses: &mut Pauses) {
    tick.reset_after(pauses.next_pause());
}

/// Renews `bucket`'s `lease` once, now, outside the keeper's rhythm (a resume needs a
/// later lower bound than the lease has). Returns whether it renewed.
pub async fn renew_now(state: &ProxyState, bucket: usize, lease: i64) -> bool {
    // Through the member the keeper renews through: not a member that stopped answering.
    let (member, client) = state.members.lease_client().await;
    let mut client = match client {
        Ok(client) => client,
        Err(how) => {
            state.members.failed(member, how).await;
            return false;
        }
    };
    let exchange = async {
        let (mut keeper, mut replies) = client.keep_alive(lease).await?;
        let sent = (Instant::now(), state.leases.generation());
        keeper.keep_alive().await?;
        Ok::<_, etcd_client::Error>((sent, replies.message().await?))
    };
    match tokio::time::timeout(state.config.etcd_timeout, exchange).await {
        Ok(Ok((sent, Some(reply)))) if reply.id() == lease && reply.ttl() > 0 => {
            metrics::counter!(m::LEASE_RENEWALS).increment(1);
            let ttl = Duration::from_secs(reply.ttl() as u64);
            state.leases.renewed(bucket, lease, sent, ttl);
            state.members.answered(member);
            true
        }
        Ok(Ok((_, Some(_)))) => false,
        Ok(_) => {
            state.members.failed(member, Failure::Answered).await;
            false
        }
        Err(_) => {
            state.members.failed(member, Failure::Silent).await;
            false
        }
    }
}

/// Gives up `lease`: its sessions expire, and etcd is asked to revoke it so their keys
/// go now rather than at the lease's TTL.
fn lose(state: &Arc<ProxyState>, bucket: usize, lease: i64, reason: &'static str) {
    if !state.leases.clear(bucket, lease) {
        return;
    }
    let sessions = state
        .sessions
        .take_on_lease(lease, reason.into(), Instant::now());
    tracing::warn!(
        bucket,
        lease,
        sessions = sessions.len(),
        reason,
        "proxy lease lost"
    );
    metrics::counter!(m::LEASES_LOST).increment(1);
    if state.counts_sessions {
        metrics::counter!(m::SESSIONS_EXPIRED).increment(sessions.len() as u64);
    }
    for s in &sessions {
        state.leases.unassign(s.bucket);
    }
    let state = state.clone();
    // Bounded by the etcd timeout: this task ends on its own.
    tokio::spawn(async move {
        let mut client = state.etcd.lease_client();
        let call = client.revoke(lease);
        if let Ok(Ok(_)) = tokio::time::timeout(state.config.etcd_timeout, call).await {
            tracing::info!(lease, "revoked lost proxy lease");
        }
    });
}
