//! Expires sessions whose client stopped renewing, and retries pending clean-ups.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};

use crate::metrics as m;
use crate::state::ProxyState;

/// How often the reaper looks for due sessions: the precision of expiry.
pub const TICK: Duration = Duration::from_millis(100);

pub async fn run(state: Arc<ProxyState>) {
    let mut shutdown = state.shutdown.clone();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
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
        state.sessions.prune_tombstones(now);
        state.events.prune(state.classes.current().max_lock_delay());
        state.publish_sessions_open();
        if !state.cleanup.is_empty() {
            state.cleanup.run(&state).await;
        }
    }
}
