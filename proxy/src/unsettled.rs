//! Writes whose etcd answer may never come. Such a write may still be applied, so the
//! key it would create is recorded in the session as unsettled before it goes out
//! (see `Grant::unsettled_hold` and the others): whatever etcd did, the key ends up
//! owned by the session, read back now or looked for when the session ends.

use std::future::Future;

use lockcell_cell::locklog::Grant;
use lockcell_cell::CellError;

use crate::sessions::Session;
use crate::state::ProxyState;

/// Whether a failed etcd call may have been applied all the same: it went out and no
/// answer came back (a deadline, a broken connection). An answer, even a refusal, or a
/// request etcd turned away before proposing it, settles it.
pub fn unknown_outcome(e: &CellError) -> bool {
    matches!(e, CellError::Timeout { .. } | CellError::Etcd { .. }) && !e.turned_away()
}

/// Runs `write`, which may create `pending`'s key, with that key recorded in `session`
/// as unsettled while it is on its way. Answered, the record goes (the caller records
/// what came of it); not answered (`unknown` says so of its error), the key is read
/// back ([`settle_unknown`]). `None`: the session is gone, nothing was written.
pub async fn owned_write<T, E>(
    state: &ProxyState,
    session: &Session,
    pending: Grant,
    write: impl Future<Output = Result<T, E>>,
    unknown: impl Fn(&E) -> bool,
) -> Option<Result<T, E>> {
    if !state
        .sessions
        .record_grant(&session.id, session.incarnation, pending.clone(), None)
    {
        return None;
    }
    let outcome = write.await;
    match &outcome {
        Err(e) if unknown(e) => settle_unknown(state, session, pending).await,
        _ => state.sessions.forget(&session.id, &pending),
    }
    Some(outcome)
}

/// After a write whose outcome is unknown: reads whether it was applied. Found, the key
/// is recorded as the session's (a retried call gets a grant back; it goes when the
/// session ends); not found, or not readable now, the unsettled record stays, and the
/// session's end looks again.
pub async fn settle_unknown(state: &ProxyState, session: &Session, pending: Grant) {
    match state
        .locklog
        .settle(std::slice::from_ref(&pending), session.lease)
        .await
    {
        Ok(found) => {
            for key in found {
                if state
                    .sessions
                    .record_grant(&session.id, session.incarnation, key.clone(), None)
                {
                    state.sessions.forget(&session.id, &pending);
                } else {
                    state.cleanup.push(session.lease, vec![key]);
                }
            }
        }
        Err(e) => {
            tracing::warn!(session.id = %session.id, key = %pending.key, error = %e, "a write's outcome is unknown; the session's end looks for it again");
        }
    }
}
