//! Leader election: campaigning through a session, the [`Leadership`] that holds the
//! office, and asking or watching who leads.
//!
//! An election is an exclusive lock whose holder carries a value, so a leadership obeys
//! the same timing rule as a lock: it may be acted on only while its session is valid,
//! and its fencing token goes to every resource the leader changes.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use lockcell_proto::v1::election_client::ElectionClient;
use lockcell_proto::v1::{
    CampaignRequest, CampaignResponse, Leader, LeaderRequest, LeaderResponse, ProclaimRequest,
    ResignRequest,
};
use lockcell_proto::FencingToken;
use tonic::Streaming;
use tracing::Instrument as _;

use crate::client::{Client, UNARY_TIMEOUT};
use crate::error::{Call, Error, ErrorKind, StatusCode};
use crate::holdings::{Held, Holding};
use crate::lock::Wait;
use crate::revoked::Revoked;
use crate::session::{Sent, Session};
use crate::stream::{Steps, Stream};
use crate::validity::SessionState;
use crate::withdraw::{Asked, Withdraw};
use tokio_util::sync::CancellationToken;

impl Session {
    /// Waits until this session leads `election` with `value`, as `wait` says.
    /// `Ok(None)`: not elected (tried once, or the wait ran out with another leader).
    ///
    /// Like a lock, leadership may be acted on only while the session is valid: check
    /// [`Leadership::is_valid`] or race the work against [`Session::jeopardy`], and
    /// pass [`Leadership::token`] to every resource the leader changes.
    ///
    /// Cancel-safe: if this future is dropped before it answers (a timeout around it,
    /// a `select!`), the campaign is withdrawn in the background. A leadership the proxy
    /// granted as the caller gave up is resigned, and the session's next campaign of
    /// `election` waits for that.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use std::time::Duration;
    ///
    /// use lockcell_client::Wait;
    ///
    /// let wait = Wait::Timeout(Duration::from_secs(10));
    /// match session
    ///     .campaign("reports/leader", "10.0.3.7:8080", wait)
    ///     .await?
    /// {
    ///     Some(leadership) => {
    ///         tokio::select! {
    ///             _ = write_daily_reports(leadership.token()) => {}
    ///             revoked = leadership.revoked() => eprintln!("stopped leading: {revoked}"),
    ///         }
    ///         leadership.resign().await?;
    ///     }
    ///     None => println!("another instance writes the reports"),
    /// }
    /// # Ok(()) }
    /// # async fn write_daily_reports(_token: lockcell_client::FencingToken) {}
    /// ```
    pub async fn campaign(
        &self,
        election: &str,
        value: &str,
        wait: Wait,
    ) -> Result<Option<Leadership>, Error> {
        self.before_grant_of(election).await?;
        let call_id = crate::lock::call_id();
        // Dropped before the answer (a timeout, a `select!`), the call is withdrawn.
        let value = value.to_owned();
        let withdraw = Withdraw::arm(self, election, Asked::Election(value.clone()), &call_id);
        let asked = ask_campaign(self, election, &value, &call_id, wait).await;
        withdraw.disarm();
        let (reply, sent) = asked?;
        if !reply.elected {
            return Ok(None);
        }
        let token = reply
            .token
            .ok_or_else(|| {
                Error::Protocol(format!("election {election:?} won without a fencing token"))
            })?
            .into();
        tracing::debug!(session.id = %self.id(), election.name = election, %token, "elected");
        // The same rule as an Acquire: the grant counts from when the Campaign was sent.
        let held = Held::Exclusive {
            lock: election.to_owned(),
            token,
        };
        Ok(Some(Leadership {
            holding: self.accept_grant(&sent, Some(reply.valid_for_ms), held),
            session: self.clone(),
            election: election.to_owned(),
            token,
            resigned: false,
            ended: CancellationToken::new(),
        }))
    }
}

/// Leadership of an election, won by [`Session::campaign`]. Keeps its session alive
/// (renewed) while it lives.
///
/// Dropping it without [`resign`](Leadership::resign) resigns in the background (when
/// a tokio runtime is around); resigning explicitly tells whether it worked.
///
/// ```no_run
/// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::Wait;
///
/// if let Some(leadership) = session
///     .campaign("reports/leader", "host-7", Wait::Try)
///     .await?
/// {
///     write_daily_reports(leadership.token()).await;
/// } // the leadership is dropped here: resigned in the background
/// # Ok(()) }
/// # async fn write_daily_reports(_token: lockcell_client::FencingToken) {}
/// ```
#[derive(Debug)]
#[must_use = "dropping a Leadership resigns it"]
pub struct Leadership {
    session: Session,
    /// Registered with the session, so a resume moves the leadership.
    holding: std::sync::Arc<Holding>,
    election: String,
    token: FencingToken,
    /// Set once resigned, so `Drop` does not resign again.
    resigned: bool,
    /// Cancelled when the hold is let go: ends the tokens of [`cancellation`](Self::cancellation).
    ended: CancellationToken,
}

impl Leadership {
    /// The election's name.
    ///
    /// ```no_run
    /// fn log_term(leadership: &lockcell_client::Leadership) {
    ///     let (election, token) = (leadership.election(), leadership.token());
    ///     eprintln!("leading {election} with token {token}");
    /// }
    /// ```
    pub fn election(&self) -> &str {
        &self.election
    }

    /// The leadership's fencing token: hand it to every resource the leader changes.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Wait;
    ///
    /// if let Some(leadership) = session
    ///     .campaign("reports/leader", "host-7", Wait::Try)
    ///     .await?
    /// {
    ///     // The report store refuses any token older than the highest it has seen.
    ///     if let Err(refused) = write_report(leadership.token(), "daily").await {
    ///         eprintln!("the store refused a stale token: {refused}");
    ///     }
    /// }
    /// # Ok(()) }
    /// # async fn write_report(_: lockcell_client::FencingToken, _: &str) -> Result<(), String> {
    /// #     Ok(())
    /// # }
    /// ```
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Whether the application may still act as leader: its session is before its
    /// deadline and not expired, and the leadership was not lost when the session moved.
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership, days: Vec<String>) {
    /// for day in days {
    ///     if !leadership.is_valid() {
    ///         break; // another instance may lead by now
    ///     }
    ///     write_daily_report(leadership.token(), &day).await;
    /// }
    /// # }
    /// # async fn write_daily_report(_token: lockcell_client::FencingToken, _day: &str) {}
    /// ```
    pub fn is_valid(&self) -> bool {
        self.session.state() == SessionState::Valid && !self.holding.is_lost()
    }

    /// Resolves, with the reason, once the leadership is lost for good: the session
    /// expired, or the leadership was found gone when the session moved to another
    /// proxy. (Jeopardy comes earlier and may pass: race work against
    /// [`Session::jeopardy`] too.)
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership) {
    /// let reason = leadership.lost().await;
    /// eprintln!("no longer leading {}: {reason}", leadership.election());
    /// # }
    /// ```
    pub async fn lost(&self) -> String {
        self.session.hold_lost(&self.holding).await
    }

    /// Resolves as soon as the leadership may no longer be acted on: the session fell into
    /// jeopardy ([`Revoked::Jeopardy`], which may pass: see [`Session::valid`]) or the
    /// leadership is gone for good ([`Revoked::Lost`], with why). At once if that is so now.
    /// Race the work done as leader against it.
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership, days: Vec<String>) {
    /// for day in days {
    ///     tokio::select! {
    ///         _ = write_daily_report(leadership.token(), &day) => {}
    ///         revoked = leadership.revoked() => {
    ///             eprintln!("stopped before the report of {day}: {revoked}");
    ///             break;
    ///         }
    ///     }
    /// }
    /// # }
    /// # async fn write_daily_report(_token: lockcell_client::FencingToken, _day: &str) {}
    /// ```
    pub async fn revoked(&self) -> Revoked {
        crate::revoked::revoked(self.session.shared(), &self.holding).await
    }

    /// Until when the leadership may be acted on, as far as the client knows now (the
    /// session's deadline; renewals push it on); `None` once it may not.
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership) {
    /// use std::time::Duration;
    ///
    /// use tokio::time::Instant;
    ///
    /// // Start compacting old reports only if it can end while this instance leads.
    /// let step = Duration::from_secs(5);
    /// match leadership.valid_until() {
    ///     Some(until) if until > Instant::now() + step => compact_reports(leadership.token()).await,
    ///     _ => eprintln!("not enough time left leading {}", leadership.election()),
    /// }
    /// # }
    /// # async fn compact_reports(_token: lockcell_client::FencingToken) {}
    /// ```
    pub fn valid_until(&self) -> Option<tokio::time::Instant> {
        crate::revoked::valid_until(self.session.shared(), &self.holding)
    }

    /// A token for worker tasks that act as leader: cancelled as soon as
    /// [`revoked`](Self::revoked) would resolve, or once the leadership is let go (or its
    /// handle dropped). It stays cancelled: after a jeopardy that passed, ask for a new
    /// one. Needs a tokio runtime.
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership) {
    /// let (stop, token) = (leadership.cancellation(), leadership.token());
    /// let compaction = tokio::spawn(async move {
    ///     tokio::select! {
    ///         _ = compact_reports(token) => {}
    ///         _ = stop.cancelled() => eprintln!("compaction stopped: no longer leading"),
    ///     }
    /// });
    /// let _ = compaction.await;
    /// # }
    /// # async fn compact_reports(_token: lockcell_client::FencingToken) {}
    /// ```
    pub fn cancellation(&self) -> CancellationToken {
        crate::revoked::cancellation(
            self.session.shared().clone(),
            self.holding.clone(),
            &self.ended,
        )
    }

    /// The session this leadership was won through.
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Revoked;
    ///
    /// if let Revoked::Jeopardy = leadership.revoked().await {
    ///     // Wait for the session, then see whether the leadership survived.
    ///     leadership.session().valid().await?;
    ///     let still = leadership.is_valid();
    ///     println!("still leading {}: {still}", leadership.election());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Changes the value observers see for this leader (an address that moved, say).
    /// [`Error::NotHolder`]: this leadership has ended, and so must the leading.
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Error;
    ///
    /// // The leader's reports API moved to another port: tell the observers.
    /// match leadership.proclaim("10.0.3.7:8443").await {
    ///     Ok(()) => {}
    ///     Err(Error::NotHolder(why)) => eprintln!("no longer leading: {why}"),
    ///     Err(error) => return Err(error),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn proclaim(&self, value: &str) -> Result<(), Error> {
        if self.session.shared().is_expired() {
            return Err(self.session.expired_error());
        }
        let mut request = tonic::Request::new(ProclaimRequest {
            session_id: self.session.id().to_owned(),
            session_secret: self.session.secret().to_owned(),
            election: self.election.clone(),
            token: Some(self.token.into()),
            value: value.to_owned(),
        });
        request.set_timeout(UNARY_TIMEOUT);
        let generation = self.session.client().proxies().generation();
        ElectionClient::new(self.session.client().channel())
            .proclaim(request)
            .await
            .map_err(|status| self.session.grant_call_failed(status, generation))?;
        Ok(())
    }

    /// Gives up leadership. `Ok(false)`: it had already ended (e.g. the session lost
    /// it); the proxy may also say so with [`Error::NotHolder`].
    ///
    /// ```no_run
    /// # async fn example(leadership: lockcell_client::Leadership) -> Result<(), lockcell_client::Error> {
    /// // Hand the reports over before a deploy restarts this instance.
    /// if !leadership.resign().await? {
    ///     eprintln!("the leadership had already ended");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn resign(mut self) -> Result<bool, Error> {
        self.resigned = true;
        let holdings = &self.session.shared().holdings;
        // A campaign of this election by another task of the session waits for this.
        let _resigning = holdings.releasing(&self.election);
        if self.session.shared().is_expired() {
            holdings.remove(&self.holding);
            return Err(self.session.expired_error());
        }
        // Named by a move of the session until answered, as a lock's release is.
        self.holding.let_go();
        let resigned = resign(&self.session, &self.election, self.token).await;
        holdings.remove(&self.holding);
        resigned
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.ended.cancel();
        let holdings = &self.session.shared().holdings;
        if self.resigned || self.session.shared().is_expired() || self.holding.is_lost() {
            holdings.remove(&self.holding);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nothing to send from; the leadership goes when the session does.
            holdings.remove(&self.holding);
            return;
        };
        // Counted before the hold is forgotten: the session's next campaign (or
        // acquire) of this name waits for the resignation.
        let resigning = holdings.releasing(&self.election);
        self.holding.let_go();
        let holding = self.holding.clone();
        let session = self.session.clone();
        let client = session.client().clone();
        let election = std::mem::take(&mut self.election);
        let token = self.token;
        // Owned by its own bound: the call answers or times out. It holds the session,
        // so the session is closed only after the resignation.
        let span =
            tracing::debug_span!("resign", session.id = %session.id(), election.name = %election);
        let task = async move {
            let _resigning = resigning;
            match resign(&session, &election, token).await {
                Ok(resigned) => tracing::debug!(resigned, "dropped leadership resigned"),
                Err(error) => tracing::warn!(%error, "dropped leadership not resigned"),
            }
            session.shared().holdings.remove(&holding);
        };
        client.spawn_background(&runtime, task.instrument(span));
    }
}

/// Campaigns in `election` with `value` as call `call_id`, waiting up to `wait`, on
/// whichever proxy the session lives on ([`Session::grant_moving`]).
pub(crate) async fn ask_campaign(
    session: &Session,
    election: &str,
    value: &str,
    call_id: &str,
    wait: Wait,
) -> Result<(CampaignResponse, Sent), Error> {
    send_campaign(session, election, value, call_id, wait, false).await
}

/// [`ask_campaign`], or with `withdraw` the withdrawal of call `call_id` (see the
/// proto's `CampaignRequest.withdraw`).
pub(crate) async fn send_campaign(
    session: &Session,
    election: &str,
    value: &str,
    call_id: &str,
    wait: Wait,
    withdraw: bool,
) -> Result<(CampaignResponse, Sent), Error> {
    let call = |wait: Wait, channel| {
        let mut request = tonic::Request::new(CampaignRequest {
            session_id: session.id().to_owned(),
            session_secret: session.secret().to_owned(),
            election: election.to_owned(),
            value: value.to_owned(),
            wait_timeout_ms: wait.wait_timeout_ms(),
            call_id: call_id.to_owned(),
            withdraw,
        });
        if let Some(timeout) = wait.call_timeout() {
            request.set_timeout(timeout);
        }
        async move { ElectionClient::new(channel).campaign(request).await }
    };
    session.grant_moving(election, wait, call).await
}

pub(crate) async fn resign(
    session: &Session,
    election: &str,
    token: FencingToken,
) -> Result<bool, Error> {
    let request = ResignRequest {
        session_id: session.id().to_owned(),
        session_secret: session.secret().to_owned(),
        election: election.to_owned(),
        token: Some(token.into()),
    };
    // Sent again when the session moved to another proxy meanwhile: the leadership moved
    // with it and must be resigned there.
    for again in 0..crate::lock::MOVES_FOLLOWED {
        let generation = session.client().proxies().generation();
        let mut sent = tonic::Request::new(request.clone());
        sent.set_timeout(UNARY_TIMEOUT);
        match ElectionClient::new(session.client().channel())
            .resign(sent)
            .await
        {
            Err(status) if session.left(&status, generation).await => continue,
            Err(status) => {
                return match session.grant_call_failed(status, generation) {
                    // Resigned before the move: nothing of it was left to move.
                    Error::NotHolder(_) if again > 0 => Ok(false),
                    error => Err(error),
                };
            }
            Ok(reply) => return Ok(reply.into_inner().resigned),
        }
    }
    Err(Error::Unavailable(format!(
        "the resignation of election {election:?} kept meeting proxies the session had left"
    )))
}

/// Who leads an election, as the proxy saw it when it answered.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// if let Some(leader) = client.leader("reports/leader").await? {
///     println!(
///         "{} leads at {} (session {}, token {})",
///         leader.identity, leader.value, leader.session_id, leader.token
///     );
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderInfo {
    /// The leader's session.
    pub session_id: String,
    /// The identity the leader's session gave when it opened.
    pub identity: String,
    /// The proxy the leader won (or last proclaimed) through. A session that moved
    /// since keeps its leadership and token on another proxy, and this field is not
    /// rewritten by the move: it is for logs, not for finding the leader.
    pub proxy_id: String,
    /// The value the leader campaigned with or last proclaimed.
    pub value: String,
    /// The leadership's fencing token.
    pub token: FencingToken,
}

/// Turns the wire's leader (absent: nobody leads) into a [`LeaderInfo`].
fn leader_info(election: &str, leader: Option<Leader>) -> Result<Option<LeaderInfo>, Error> {
    let Some(leader) = leader else {
        return Ok(None);
    };
    let token = leader.token.ok_or_else(|| {
        Error::Protocol(format!(
            "the leader of election {election:?} came without a fencing token"
        ))
    })?;
    Ok(Some(LeaderInfo {
        session_id: leader.session_id,
        identity: leader.identity,
        proxy_id: leader.proxy_id,
        value: leader.value,
        token: token.into(),
    }))
}

impl Client {
    /// Who leads `election` now (`None`: nobody). No session needed.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// // Send the report request to whichever instance leads now.
    /// match client.leader("reports/leader").await? {
    ///     Some(leader) => request_report(&leader.value, leader.token).await,
    ///     None => eprintln!("no instance leads the reports right now; try again shortly"),
    /// }
    /// # Ok(()) }
    /// # async fn request_report(_addr: &str, _token: lockcell_client::FencingToken) {}
    /// ```
    pub async fn leader(&self, election: &str) -> Result<Option<LeaderInfo>, Error> {
        let mut request = tonic::Request::new(LeaderRequest {
            election: election.to_owned(),
        });
        request.set_timeout(UNARY_TIMEOUT);
        let reply = ElectionClient::new(self.channel())
            .leader(request)
            .await
            .map_err(|status| Error::from_status(status, Call::Unbound))?
            .into_inner();
        leader_info(election, reply.leader)
    }

    /// Watches `election`: the current leader, then every change of leader or value,
    /// in order (`None`: nobody leads). No session needed.
    ///
    /// An observer learns of a change after it happened: to act *as* leader, campaign;
    /// to act *on* a leader, pass its token along.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let mut leaders = client.observe("reports").await?;
    /// while let Some(leader) = leaders.next().await {
    ///     match leader? {
    ///         Some(leader) => println!("{} leads with token {}", leader.identity, leader.token),
    ///         None => println!("nobody leads"),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn observe(&self, election: &str) -> Result<LeaderStream, Error> {
        let observing = Observing {
            client: self.clone(),
            election: election.to_owned(),
            stream: Some(self.observe_stream(election).await?),
            last: None,
            done: false,
        };
        Ok(LeaderStream {
            steps: Steps::new(observing, |mut observing| {
                Box::pin(async move {
                    let leader = observing.next().await;
                    (observing, leader)
                })
            }),
        })
    }

    /// Opens an Observe stream. The stream has no deadline (it lasts), so its opening
    /// gets one of its own: a frozen proxy never answers it.
    async fn observe_stream(&self, election: &str) -> Result<Streaming<LeaderResponse>, Error> {
        let mut observer = ElectionClient::new(self.channel());
        let opening = observer.observe(LeaderRequest {
            election: election.to_owned(),
        });
        let opened = tokio::time::timeout(UNARY_TIMEOUT, opening)
            .await
            .map_err(|_| {
                Error::Unavailable(format!(
                    "no answer from the proxy: it did not start observing {election:?} within {}",
                    humantime::format_duration(UNARY_TIMEOUT)
                ))
            })?;
        Ok(opened
            .map_err(|status| Error::from_status(status, Call::Unbound))?
            .into_inner())
    }
}

/// How long a broken [`LeaderStream`] tries to observe again before it reports the proxy
/// unreachable (the next call tries again).
const REOBSERVE_FOR: Duration = Duration::from_secs(30);

/// The leaders of one election, as [`Client::observe`] reports them: a
/// [`Stream`](tokio_stream::Stream), as every stream of the SDK is.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// let mut leaders = client.observe("reports").await?;
/// if let Some(Ok(Some(leader))) = leaders.next().await {
///     println!("reports are written by {}", leader.identity);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct LeaderStream {
    steps: Steps<Observing, Result<Option<LeaderInfo>, Error>>,
}

/// What a [`LeaderStream`] keeps between leaders.
#[derive(Debug)]
struct Observing {
    client: Client,
    election: String,
    /// `None` while broken: the next call observes again.
    stream: Option<Streaming<LeaderResponse>>,
    /// The last leader handed out: a stream observed again starts with the leader of
    /// that moment, which is not repeated if it is the same.
    last: Option<Option<LeaderInfo>>,
    /// Set after an error that observing again would not cure.
    done: bool,
}

impl LeaderStream {
    /// The next leader (`Some(Ok(None))`: nobody leads now), the current one first.
    ///
    /// A stream that breaks, or that the proxy ends, is observed again (on the proxy the
    /// client uses then) and goes on with the leader of that moment: changes in between
    /// fold into it, and the same leader is not reported twice (a leader whose session
    /// only moved to another proxy is the same leader). If no proxy answers for 30 s,
    /// [`Error::Unavailable`]; a later call tries again. An error that observing again
    /// would not cure (a refusal) is handed out once, then `None`.
    ///
    /// Cancel-safe: a call dropped before it returns loses nothing.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let mut leaders = client.observe("reports").await?;
    /// while let Some(leader) = leaders.next().await {
    ///     let token = leader?.map(|leader| leader.token);
    ///     println!("accept writes fenced by {token:?}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn next(&mut self) -> Option<Result<Option<LeaderInfo>, Error>> {
        crate::stream::next(self).await
    }
}

impl Stream for LeaderStream {
    type Item = Result<Option<LeaderInfo>, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.steps.poll_step(cx)
    }
}

impl Observing {
    /// The next item of [`LeaderStream::next`].
    async fn next(&mut self) -> Option<Result<Option<LeaderInfo>, Error>> {
        if self.done {
            return None;
        }
        let mut broken_since: Option<tokio::time::Instant> = None;
        // The pace of a broken watch's retries.
        let mut pauses = crate::watch::backoff();
        loop {
            let failed = match self.stream.as_mut() {
                None => match self.client.observe_stream(&self.election).await {
                    Ok(stream) => {
                        self.stream = Some(stream);
                        continue;
                    }
                    Err(error) => error,
                },
                Some(stream) => match stream.message().await {
                    Ok(Some(reply)) => match leader_info(&self.election, reply.leader) {
                        Ok(leader) if self.last.as_ref().is_some_and(|l| same(l, &leader)) => {
                            continue
                        }
                        Ok(leader) => {
                            self.last = Some(leader.clone());
                            return Some(Ok(leader));
                        }
                        Err(error) => error,
                    },
                    Ok(None) => Error::Unavailable(format!(
                        "the proxy stopped reporting the leaders of election {:?}",
                        self.election
                    )),
                    Err(status) => Error::from_status(status, Call::Unbound),
                },
            };
            self.stream = None;
            // OUT_OF_RANGE: the election's name moved to another cell; observed again,
            // its new cell answers.
            let moved = matches!(
                &failed,
                Error::Status {
                    code: StatusCode::OutOfRange,
                    ..
                }
            );
            if failed.kind() != ErrorKind::Retry && !moved {
                self.done = true;
                return Some(Err(failed));
            }
            let since = *broken_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= REOBSERVE_FOR {
                return Some(Err(failed));
            }
            tracing::debug!(election.name = %self.election, error = %failed, "observing again");
            tokio::time::sleep(pauses.next().unwrap_or(REOBSERVE_FOR)).await;
        }
    }
}

/// Whether two reports name the same leader: the same grant with the same value (where
/// its session lives does not matter).
fn same(a: &Option<LeaderInfo>, b: &Option<LeaderInfo>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            a.token == b.token && a.session_id == b.session_id && a.value == b.value
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_leaders_become_leader_info() {
        assert_eq!(leader_info("e", None).unwrap(), None);
        let wire = Leader {
            session_id: "s1".into(),
            identity: "host/7".into(),
            proxy_id: "zone-a".into(),
            value: "10.0.0.7:5432".into(),
            token: Some(lockcell_proto::v1::FencingToken {
                epoch: 1,
                revision: 4521,
            }),
        };
        assert_eq!(
            leader_info("e", Some(wire.clone())).unwrap(),
            Some(LeaderInfo {
                session_id: "s1".into(),
                identity: "host/7".into(),
                proxy_id: "zone-a".into(),
                value: "10.0.0.7:5432".into(),
                token: FencingToken {
                    epoch: 1,
                    revision: 4521
                },
            })
        );
        let tokenless = Leader {
            token: None,
            ..wire
        };
        let err = leader_info("e", Some(tokenless)).unwrap_err();
        assert!(
            matches!(err, Error::Protocol(ref m) if m.contains("\"e\"")),
            "{err:?}"
        );
    }
}
