//! One "stop acting" signal per hold (a [`LockGuard`](crate::LockGuard) or a
//! [`Leadership`](crate::Leadership)): [`Revoked`], what `revoked()` resolves with as soon
//! as the hold may no longer be acted on, and a cancellation token for worker tasks that
//! fires at the same moment, or when the hold is let go.

use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::holdings::Holding;
use crate::shared::SessionShared;
use crate::validity::SessionState;

/// Why a hold may no longer be acted on.
///
/// ```no_run
/// # async fn example(guard: lockcell_client::LockGuard) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::Revoked;
///
/// match guard.revoked().await {
///     // Stopped acting; wait for the session, then see whether the lock survived.
///     Revoked::Jeopardy => {
///         guard.session().valid().await?;
///         println!("back; still holding {}: {}", guard.lock(), guard.is_valid());
///     }
///     Revoked::Lost(reason) => eprintln!("lost {}: {reason}", guard.lock()),
///     _ => {}
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Revoked {
    /// The session is past its deadline (its proxy is out of reach, or a move is not
    /// settled): the lock may be given to someone else at any moment. Stop acting now.
    /// This may pass: [`Session::valid`](crate::Session::valid) resolves when the
    /// session is valid again with everything still held.
    #[error("the session is in jeopardy: stop acting until it is valid again")]
    Jeopardy,
    /// The hold is gone for good (the session expired, or a move found the lock gone);
    /// the text says why.
    #[error("the hold is lost: {0}")]
    Lost(String),
}

/// Resolves as soon as the hold `holding` of `session` may no longer be acted on.
pub(crate) async fn revoked(session: &SessionShared, holding: &Holding) -> Revoked {
    tokio::select! {
        biased;
        reason = holding.lost() => return Revoked::Lost(reason.to_string()),
        _ = session.expired() => {}
        _ = session.jeopardy() => {}
    }
    if let Some(reason) = session.expired_reason() {
        Revoked::Lost(reason)
    } else if holding.is_lost() {
        revoked_now(session, holding)
    } else {
        Revoked::Jeopardy
    }
}

/// [`revoked`] for a hold known to be revoked already.
fn revoked_now(session: &SessionShared, holding: &Holding) -> Revoked {
    match (session.expired_reason(), holding.lost_reason()) {
        (Some(reason), _) | (None, Some(reason)) => Revoked::Lost(reason),
        (None, None) => Revoked::Jeopardy,
    }
}

/// The session's deadline while the hold may be acted on; `None` once it may not.
pub(crate) fn valid_until(session: &SessionShared, holding: &Holding) -> Option<Instant> {
    (session.state() == SessionState::Valid && !holding.is_lost()).then(|| session.deadline())
}

/// A token cancelled as soon as the hold is revoked, or once `ended` is (the hold let go).
/// Cancelled at once if the hold is revoked already. Needs a tokio runtime.
pub(crate) fn cancellation(
    session: Arc<SessionShared>,
    holding: Arc<Holding>,
    ended: &CancellationToken,
) -> CancellationToken {
    let token = ended.child_token();
    if valid_until(&session, &holding).is_none() {
        token.cancel();
        return token;
    }
    let fired = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = revoked(&session, &holding) => fired.cancel(),
            // Let go, or cancelled by its user: nothing more to watch.
            _ = fired.cancelled() => {}
        }
    });
    token
}
