//! A leader loop with requeue, as Apache Curator's `LeaderSelector`: campaign, work as
//! leader, let go, campaign again, with the stop-acting rule kept for the application.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error::{Error, ErrorKind};
use crate::lock::Wait;
use crate::session::Session;
use crate::FencingToken;

/// One term of leadership, handed to the work of [`Session::lead`].
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
/// session
///     .lead("reports/leader", "host-7", |term| async move {
///         // A task the work spawns is not dropped with it: it stops on `revoked`.
///         let (stop, token) = (term.revoked.clone(), term.token);
///         let compaction = tokio::spawn(async move {
///             tokio::select! {
///                 _ = compact_old_reports(token) => {}
///                 _ = stop.cancelled() => {}
///             }
///         });
///         let _ = compaction.await;
///     })
///     .await
/// # }
/// # async fn compact_old_reports(_token: lockcell_client::FencingToken) {}
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Term {
    /// The term's fencing token: pass it to every resource the leader changes.
    pub token: FencingToken,
    /// Cancelled as soon as the leader may no longer act (jeopardy, or the leadership
    /// lost); the work is also dropped then. Hand it to tasks the work spawns.
    pub revoked: CancellationToken,
}

/// How long [`Session::lead`] waits before campaigning again after the proxy could not
/// be reached.
const CAMPAIGN_RETRY: Duration = Duration::from_secs(1);

impl Session {
    /// Leads `election` with `value` for as long as the session lives: campaigns,
    /// waiting as long as it takes; once elected, runs `work` for the term; when `work`
    /// returns, resigns and campaigns again (another candidate may win: requeue). If
    /// the term is revoked first (the session fell into jeopardy, or the leadership was
    /// lost), `work` is dropped at once, which stops it where it awaits, and the loop
    /// campaigns again once the session is valid. Stopping the loop is dropping its
    /// future (the campaign is then withdrawn, a term resigned).
    ///
    /// Returns only with an error that campaigning again would not cure: the session
    /// expired ([`Error::SessionExpired`]: open a new one), or a refusal (a bad name,
    /// the grants). A proxy out of reach only delays the next campaign.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// session
    ///     .lead("reports/leader", "host-7", |term| async move {
    ///         println!("leading with token {}", term.token); // ... the leader's work
    ///     })
    ///     .await
    /// # }
    /// ```
    pub async fn lead<F, W>(&self, election: &str, value: &str, mut work: F) -> Result<(), Error>
    where
        F: FnMut(Term) -> W,
        W: Future<Output = ()>,
    {
        loop {
            let leadership = match self.campaign(election, value, Wait::Forever).await {
                Ok(Some(leadership)) => leadership,
                // Not elected although waiting as long as it takes: the proxy ended the
                // wait (a limit of its own); campaign again, not at once.
                Ok(None) => {
                    tokio::time::sleep(CAMPAIGN_RETRY).await;
                    continue;
                }
                Err(error) if error.kind() == ErrorKind::Retry => {
                    tracing::warn!(election.name = election, %error, "campaigning again soon");
                    tokio::time::sleep(CAMPAIGN_RETRY).await;
                    continue;
                }
                Err(error) => return Err(error),
            };
            let term = Term {
                token: leadership.token(),
                revoked: leadership.cancellation(),
            };
            let revoked = term.revoked.clone();
            tracing::info!(election.name = election, token = %term.token, "term begins");
            tokio::select! {
                _ = work(term) => {}
                _ = revoked.cancelled() => {
                    tracing::warn!(election.name = election, "term revoked; its work stopped");
                }
            }
            if let Err(error) = leadership.resign().await {
                tracing::debug!(election.name = election, %error, "resigning at the end of a term");
            }
            self.valid().await?;
        }
    }
}
