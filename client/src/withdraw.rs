//! An acquire or campaign whose future is dropped before its answer (a
//! `tokio::time::timeout`, a `select!` that took another branch) may have been granted
//! all the same: the proxy decided as the caller gave up, and its reply was thrown away.
//! Nothing would then let go of that grant until the session ends, and a long-lived
//! session would keep the lock from everyone.
//!
//! [`Withdraw`] is armed while such a call runs. Dropped armed, it sends the proxy the
//! call's withdrawal (the proto's `withdraw`, with the call's id): the proxy ends the
//! call's wait if it still waits, lets a grant attempt of it that already went to etcd
//! finish, and then releases whatever grant the call holds. (Asking again with the same
//! call id would not do: a call still in line could be granted after the second ask
//! was answered.) A proxy too old to know withdrawals takes it as a try with the call's
//! id, which returns the call's grant if it has one; that is then released here. Until
//! all that is done, the session's next acquire or campaign of the name waits, as after
//! a dropped guard.

use tracing::Instrument as _;

use crate::lock::{Mode, Wait};
use crate::session::Session;

/// What the call asked for.
pub(crate) enum Asked {
    Lock(Mode),
    /// An election, with the value campaigned with.
    Election(String),
}

/// Armed while an acquire or campaign is in flight; see the module's doc.
pub(crate) struct Withdraw {
    call: Option<(Session, String, Asked, String)>,
}

impl Withdraw {
    /// Armed for call `call_id` of `session` for `name`.
    pub(crate) fn arm(session: &Session, name: &str, asked: Asked, call_id: &str) -> Withdraw {
        Withdraw {
            call: Some((session.clone(), name.to_owned(), asked, call_id.to_owned())),
        }
    }

    /// The call answered: its caller has the outcome, nothing to withdraw.
    pub(crate) fn disarm(mut self) {
        self.call = None;
    }
}

impl Drop for Withdraw {
    fn drop(&mut self) {
        let Some((session, name, asked, call_id)) = self.call.take() else {
            return;
        };
        if session.shared().is_expired() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing to send from; a grant goes when the session does.
            return;
        };
        let releasing = session.shared().holdings.releasing(&name);
        let client = session.client().clone();
        let span = tracing::debug_span!("withdraw", session.id = %session.id(), name = %name);
        let task = async move {
            let _releasing = releasing;
            match withdraw(&session, &name, asked, &call_id).await {
                Ok(true) => tracing::info!("a call given up on had been granted; released"),
                Ok(false) => tracing::debug!("a call given up on held nothing"),
                Err(error) => {
                    tracing::warn!(%error, "a call given up on may hold a grant until its session ends")
                }
            }
        };
        client.spawn_background(&runtime, task.instrument(span));
    }
}

/// Asks again for call `call_id`, without waiting, and lets go of what it gets. True if
/// there was a grant.
async fn withdraw(
    session: &Session,
    name: &str,
    asked: Asked,
    call_id: &str,
) -> Result<bool, crate::Error> {
    match asked {
        Asked::Lock(mode) => {
            let (reply, _) =
                crate::lock::send_acquire(session, name, mode, call_id, Wait::Try, true).await?;
            match reply.token.filter(|_| reply.granted) {
                Some(token) => crate::lock::release(session, name, mode, token.into())
                    .await
                    .map(|_| true),
                None => Ok(false),
            }
        }
        Asked::Election(value) => {
            let (reply, _) =
                crate::election::send_campaign(session, name, &value, call_id, Wait::Try, true)
                    .await?;
            match reply.token.filter(|_| reply.elected) {
                Some(token) => crate::election::resign(session, name, token.into())
                    .await
                    .map(|_| true),
                None => Ok(false),
            }
        }
    }
}
