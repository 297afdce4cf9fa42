//! Expires sessions whose client stopped renewing, and retries pending clean-ups.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};

use crate::metrics as m;
use crate::state::ProxyState;

/// How often the reaper looks for due sessions: the precision of expiry.
pub const TICK: Duration = Duration::from_millis(100);
/// How often it forgets the records of ephemeral keys deleted by other means than
/// their session's end ([`ProxyState::forget_gone_keys`]).
pub const GONE_KEYS_EVERY: Duration = Duration::from_secs(5);

pub async fn run(state: Arc<ProxyState>) {
    let mut shutdown = state.shutdown.clone();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut gone_keys_at = Instant::now() + GONE_KEYS_EVERY;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        let now = Instant::now();
        for session in state.sessions.take_expired(now) {
            tracing::info!(session.id = %session.id, locks = session.held.len(), "session expired");
            if state.counts_sessions {
                metrics::counter!(m::SESSIONS_EXPIRED).increment(1);
            }
            state.leases.unassign(session.bucket);
            state.cleanup.push(session.lease, session.held);
        }
        if now >= gone_keys_at {
            gone_keys_at = now + GONE_KEYS_EVERY;
            let forgot = state.forget_gone_keys(None);
            if forgot > 0 {
                tracing::debug!(forgot, "forgot the records of keys deleted by other means");
            }
        }
        state.sessions.prune_tombstones(now);
        state.calls.prune();
        state.events.prune(state.classes.current().max_lock_delay());
        state.publish_sessions_open();
        if !state.cleanup.is_empty() {
            state
                .cleanup
                .run(&state.leases, &state.locklog, &state.sessions)
                .await;
        }
    }
}
