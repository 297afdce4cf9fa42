//! The Session service: open, keep alive and close sessions, all from memory.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lockcell_proto::v1::session_server::Session as SessionApi;
use lockcell_proto::v1::{
    CloseRequest, CloseResponse, KeepAliveRequest, KeepAliveResponse, OpenRequest, OpenResponse,
    ResumeRequest, ResumeResponse, SessionState,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::millis;
use crate::credential;
use crate::credential::{check_label, labelled};
use crate::errors::ProxyError;
use crate::metrics as m;
use crate::sessions::{Gone, Renewed, Session};
use crate::state::ProxyState;

/// Replies buffered per keepalive stream before the proxy stops reading that stream.
const KEEPALIVE_BUFFER: usize = 256;

pub struct SessionService {
    pub state: Arc<ProxyState>,
}

pub type ReplyStream = Pin<Box<dyn Stream<Item = Result<KeepAliveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl SessionApi for SessionService {
    #[tracing::instrument(skip_all, fields(session.id))]
    async fn open(&self, request: Request<OpenRequest>) -> Result<Response<OpenResponse>, Status> {
        let principal = self.state.grants.current().caller(&request)?;
        self.state.pace(principal.as_deref())?;
        let (id, secret) = credential::new_session(principal.as_deref());
        tracing::Span::current().record("session.id", &*id);
        let mut reply = open_stay(&self.state, principal, &request.into_inner(), id.into())?;
        reply.session_secret = secret;
        metrics::counter!(m::SESSIONS_OPENED).increment(1);
        Ok(Response::new(reply))
    }

    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id))]
    async fn resume(
        &self,
        request: Request<ResumeRequest>,
    ) -> Result<Response<ResumeResponse>, Status> {
        let principal = self.state.grants.current().caller(&request)?;
        // A session arriving here counts against its identity's sessions like a new
        // one (else closing and resuming would pass the limit).
        if self
            .state
            .sessions
            .peek(&request.get_ref().session_id)
            .is_none()
        {
            self.state.admit_session(principal.as_deref())?;
        }
        let reply = crate::handover::resume(&self.state, request.into_inner(), principal).await?;
        Ok(Response::new(reply))
    }

    type KeepAliveStream = ReplyStream;

    async fn keep_alive(
        &self,
        request: Request<Streaming<KeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStream>, Status> {
        let caller = self.state.grants.current().caller(&request)?;
        let states = [self.state.clone()];
        Ok(Response::new(keep_alive_stream(
            request.into_inner(),
            states.into(),
            caller,
        )))
    }

    #[tracing::instrument(skip_all, fields(session.id = %request.get_ref().session_id))]
    async fn close(
        &self,
        request: Request<CloseRequest>,
    ) -> Result<Response<CloseResponse>, Status> {
        self.state.check_owner(
            &request,
            &request.get_ref().session_id,
            &request.get_ref().session_secret,
        )?;
        let req = request.into_inner();
        let incarnation = (req.incarnation != 0).then_some(req.incarnation);
        let released = close_stay(&self.state, &req.session_id, incarnation).await?;
        Ok(Response::new(CloseResponse { released }))
    }
}

/// Opens session `id`'s stay in `state`'s cell: from memory, nothing written.
pub fn open_stay(
    state: &ProxyState,
    principal: Option<String>,
    req: &OpenRequest,
    id: Arc<str>,
) -> Result<OpenResponse, ProxyError> {
    if state.is_draining() {
        return Err(ProxyError::ShuttingDown);
    }
    check_label(&req.identity)?;
    state.admit_session(principal.as_deref())?;
    let ttl = state
        .config
        .session_ttl_for(Duration::from_millis(req.ttl_ms));
    let (bucket, lease) = state.leases.assign().ok_or(ProxyError::NoLease)?;
    let now = Instant::now();
    let valid_for = state.leases.valid_for(bucket, lease, ttl, now);
    let mut session = Session::arriving(
        id.clone(),
        labelled(principal.as_deref(), req.identity.clone()),
        ttl,
        (bucket, lease),
        Vec::new(),
        now,
        now + valid_for,
    );
    session.principal = principal.map(Into::into);
    let incarnation = session.incarnation;
    state.sessions.insert(session);
    state.publish_sessions_open();
    tracing::debug!(ttl_ms = millis(ttl), bucket, lease, "session opened");
    Ok(OpenResponse {
        session_id: id.to_string(),
        ttl_ms: millis(ttl),
        valid_for_ms: millis(valid_for),
        proxy_id: state.proxy_id.clone(),
        lease_id: lease,
        incarnation,
        epoch: state.epoch(),
        cells: Vec::new(),
        session_secret: String::new(),
    })
}

/// Closes session `id`'s stay in `state`'s cell (only the stay `incarnation` names,
/// when given) and releases what it holds there. Returns how many of its keys it
/// deleted (holds, ephemeral keys, its fence).
pub async fn close_stay(
    state: &ProxyState,
    id: &str,
    incarnation: Option<u64>,
) -> Result<u32, ProxyError> {
    match close_now(state, id, incarnation)? {
        Some(session) => release_closed(state, session).await,
        // A later stay of the session is here: the close was for an earlier one.
        None => Ok(0),
    }
}

/// The first half of [`close_stay`], at once: takes the stay out of the table (no call
/// finds it after this) and queues its unsettled keys. `None`: the session is here, but
/// as a later stay.
pub fn close_now(
    state: &ProxyState,
    id: &str,
    incarnation: Option<u64>,
) -> Result<Option<Session>, ProxyError> {
    let Some(session) = state
        .sessions
        .close(id, incarnation)
        .map_err(|gone| ProxyError::session(id, gone))?
    else {
        return Ok(None);
    };
    state.leases.unassign(session.bucket);
    state.publish_sessions_open();
    // Keys whose transaction had no answer may still be applied: looked for a while.
    let unsettled: Vec<_> = session
        .held
        .iter()
        .filter(|g| g.is_unsettled())
        .cloned()
        .collect();
    state.cleanup.push(session.lease, unsettled);
    Ok(Some(session))
}

/// The second half of [`close_stay`]: deletes what the closed stay `session` held.
pub async fn release_closed(state: &ProxyState, session: Session) -> Result<u32, ProxyError> {
    if session.held.is_empty() {
        return Ok(0);
    }
    match state
        .locklog
        .delete_guarded(&session.held, session.lease, true)
        .await
    {
        Ok(deleted) => {
            let released = deleted.markers.len();
            metrics::counter!(m::LOCKS_RELEASED).increment(released as u64);
            state.cleanup.push(session.lease, deleted.markers);
            Ok(deleted.keys as u32)
        }
        Err(source) => {
            let held = session.held.len();
            let id = session.id.clone();
            state.cleanup.push(session.lease, session.held);
            Err(ProxyError::StoreDuring {
                context: format!(
                    "session {id:?} is closed; its {held} key(s) (locks, places in line, ephemeral keys) will be deleted when etcd answers"
                ),
                source,
            })
        }
    }
}

/// The replies to a keepalive stream: each renewal is answered from memory by every
/// cell's stay of the session (`states`), as one reply: the shortest validity, and the
/// first stay that is gone, if any.
pub fn keep_alive_stream(
    mut input: Streaming<KeepAliveRequest>,
    states: Arc<[Arc<ProxyState>]>,
    caller: Option<String>,
) -> ReplyStream {
    let (tx, rx) = mpsc::channel(KEEPALIVE_BUFFER);
    // Owned by the stream: it ends when the client hangs up, the reply stream is
    // dropped, or the proxy shuts down.
    tokio::spawn(async move {
        let mut shutdown = states[0].shutdown.clone();
        // This stream's turn in a drain (see `handover::move_hint`).
        let turn = rand::random::<f64>();
        let mut proven = credential::Proven::default();
        let pace = crate::limits::StreamPace::new(states[0].config.max_keepalives_per_stream);
        loop {
            tokio::select! {
                () = pace.turn() => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            let req = tokio::select! {
                msg = input.message() => match msg {
                    Ok(Some(req)) => req,
                    Ok(None) | Err(_) => return,
                },
                _ = shutdown.wait_for(|stop| *stop) => return,
            };
            let proof = proven.check(&req.session_id, &req.session_secret, caller.as_deref());
            let reply = match &states[..] {
                _ if proof.is_err() => not_its_owner(req, proof),
                [only] => renew(only, req, caller.as_deref(), turn),
                [first, rest @ ..] => rest.iter().fold(
                    renew(first, req.clone(), caller.as_deref(), turn),
                    |reply, state| {
                        combine(reply, renew(state, req.clone(), caller.as_deref(), turn))
                    },
                ),
                [] => unreachable!("a proxy serves at least one cell"),
            };
            metrics::counter!(m::KEEPALIVES).increment(1);
            if reply.state == SessionState::Alive as i32 {
                metrics::histogram!(m::VALIDITY_GRANTED)
                    .record(Duration::from_millis(reply.valid_for_ms).as_secs_f64());
            }
            if tx.send(Ok(reply)).await.is_err() {
                return;
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// The reply to a renewal whose caller did not prove the session its own: the session
/// is not found, as far as this caller is concerned (another caller's session is
/// neither renewed nor described).
fn not_its_owner(req: KeepAliveRequest, proof: Result<(), Status>) -> KeepAliveResponse {
    KeepAliveResponse {
        session_id: req.session_id,
        seq: req.seq,
        state: SessionState::NotFound as i32,
        valid_for_ms: 0,
        reason: proof
            .err()
            .map(|e| e.message().to_owned())
            .unwrap_or_default(),
        move_elsewhere: false,
    }
}

/// One renewal's reply from two cells' stays of a session: a stay that expired says
/// the session expired; one that is not found, that it must resume.
fn combine(a: KeepAliveResponse, b: KeepAliveResponse) -> KeepAliveResponse {
    let (alive, expired) = (SessionState::Alive as i32, SessionState::Expired as i32);
    if a.state == expired || (a.state != alive && b.state != expired) {
        return a;
    }
    if b.state != alive {
        return b;
    }
    let move_elsewhere = a.move_elsewhere || b.move_elsewhere;
    KeepAliveResponse {
        valid_for_ms: a.valid_for_ms.min(b.valid_for_ms),
        reason: if a.move_elsewhere { a.reason } else { b.reason },
        move_elsewhere,
        ..a
    }
}

/// Answers one renewal from memory.
fn renew(
    state: &ProxyState,
    req: KeepAliveRequest,
    caller: Option<&str>,
    turn: f64,
) -> KeepAliveResponse {
    let now = Instant::now();
    let mut reply = KeepAliveResponse {
        session_id: String::new(),
        seq: req.seq,
        state: SessionState::Alive as i32,
        valid_for_ms: 0,
        reason: String::new(),
        move_elsewhere: false,
    };
    let mut hint = None;
    let validity = |r: Renewed| {
        let left = state.leases.left(r.bucket, r.lease, now);
        hint = crate::handover::move_hint(state, turn, left, now);
        left.min(state.leases.within(r.ttl))
    };
    match state.sessions.renew(&req.session_id, caller, now, validity) {
        Ok(valid_for) => {
            reply.valid_for_ms = millis(valid_for);
            if let Some(why) = hint {
                reply.move_elsewhere = true;
                reply.reason = why.to_owned();
            }
        }
        Err(gone) => {
            reply.state = match gone {
                Gone::Unknown | Gone::HandedOff => SessionState::NotFound,
                Gone::Expired(_) => SessionState::Expired,
            } as i32;
            reply.reason = ProxyError::session(&req.session_id, gone).to_string();
        }
    }
    reply.session_id = req.session_id;
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(state: SessionState, valid_for_ms: u64, move_elsewhere: bool) -> KeepAliveResponse {
        KeepAliveResponse {
            session_id: "s".into(),
            seq: 1,
            state: state as i32,
            valid_for_ms,
            reason: if move_elsewhere {
                "draining".into()
            } else {
                String::new()
            },
            move_elsewhere,
        }
    }

    #[test]
    fn a_renewal_over_several_cells_grants_the_least_and_an_expiry_wins() {
        let both = combine(
            reply(SessionState::Alive, 900, false),
            reply(SessionState::Alive, 400, true),
        );
        assert_eq!((both.valid_for_ms, both.move_elsewhere), (400, true));
        assert_eq!(both.reason, "draining");
        let gone = combine(
            reply(SessionState::NotFound, 0, false),
            reply(SessionState::Expired, 0, false),
        );
        assert_eq!(gone.state, SessionState::Expired as i32);
        let lost = combine(
            reply(SessionState::Alive, 900, false),
            reply(SessionState::NotFound, 0, false),
        );
        assert_eq!(lost.state, SessionState::NotFound as i32);
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// A label passes only if it is short and holds no control character.
            #[test]
            fn a_label_passes_only_when_short_and_printable(label in "\\PC{0,70}|.{0,70}|\\PC{120,140}") {
                let ok = check_label(&label).is_ok();
                let fine = label.len() <= crate::credential::MAX_LABEL_BYTES && !label.chars().any(char::is_control);
                prop_assert_eq!(ok, fine, "{:?}", label);
            }
        }
    }
}
