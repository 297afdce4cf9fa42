//! A session through the front: opened, resumed and closed in every cell at once, one
//! stay per cell.

use super::*;

fn stay_of(state: &ProxyState, lease_id: i64, incarnation: u64, fence: i64) -> CellStay {
    CellStay {
        cell: state.cell_name.clone().unwrap_or_default(),
        lease_id,
        incarnation,
        epoch: state.epoch(),
        fence_revision: fence,
    }
}

#[tonic::async_trait]
impl SessionApi for Router {
    async fn open(&self, request: Request<OpenRequest>) -> Result<Response<OpenResponse>, Status> {
        if let Some(only) = self.single() {
            return SessionService {
                state: only.clone(),
            }
            .open(request)
            .await;
        }
        let principal = self.engines[0].grants.current().caller(&request)?;
        self.engines[0].pace(principal.as_deref())?;
        let req = request.into_inner();
        let (id, secret) = crate::credential::new_session(principal.as_deref());
        let id: std::sync::Arc<str> = id.into();
        let mut replies: Vec<OpenResponse> = Vec::new();
        for engine in self.engines.iter() {
            match session::open_stay(engine, principal.clone(), &req, id.clone()) {
                Ok(reply) => replies.push(reply),
                Err(e) => {
                    for opened in &self.engines[..replies.len()] {
                        let _ = session::close_stay(opened, &id, None).await;
                    }
                    return Err(e.into());
                }
            }
        }
        let cells = self
            .engines
            .iter()
            .zip(&replies)
            .map(|(engine, r)| stay_of(engine, r.lease_id, r.incarnation, 0))
            .collect();
        let valid_for_ms = replies.iter().map(|r| r.valid_for_ms).min().unwrap_or(0);
        let first = replies.swap_remove(0);
        metrics::counter!(crate::metrics::SESSIONS_OPENED).increment(1);
        tracing::debug!(session.id = %id, cells = self.engines.len(), "session opened in every cell");
        Ok(Response::new(OpenResponse {
            valid_for_ms,
            cells,
            session_secret: secret,
            ..first
        }))
    }

    async fn resume(
        &self,
        request: Request<ResumeRequest>,
    ) -> Result<Response<ResumeResponse>, Status> {
        if let Some(only) = self.single() {
            return SessionService {
                state: only.clone(),
            }
            .resume(request)
            .await;
        }
        let principal = self.engines[0].grants.current().caller(&request)?;
        let first = &self.engines[0];
        if first.sessions.peek(&request.get_ref().session_id).is_none() {
            first.admit_session(principal.as_deref())?;
        }
        let req = request.into_inner();
        let started = tokio::time::Instant::now();
        // Each key moves in the cell that serves its name.
        let (keys, mut lost) = self.keys_by_cell(&req.keys);
        let mut replies = Vec::new();
        for (i, (engine, keys)) in self.engines.iter().zip(keys).enumerate() {
            let names: Vec<&str> = keys.iter().map(|k| k.name.as_str()).collect();
            let engine = &self.caught_up(engine, &names, false).await;
            let sub = stay_request(&req, engine, i == 0, keys);
            match crate::handover::resume_stay(engine, sub, principal.clone()).await {
                Ok(reply) => replies.push(reply),
                Err(e) => {
                    crate::handover::record_resume(started, false);
                    return Err(self.refused_midway(e, replies.len(), engine));
                }
            }
        }
        let cells = self
            .engines
            .iter()
            .zip(&replies)
            .map(|(engine, r)| stay_of(engine, r.lease_id, r.incarnation, r.fence_revision))
            .collect();
        let valid_for_ms = replies.iter().map(|r| r.valid_for_ms).min().unwrap_or(0);
        let mut moved = Vec::new();
        for r in &mut replies {
            lost.append(&mut r.lost);
            moved.append(&mut r.moved);
        }
        let first = replies.swap_remove(0);
        crate::handover::record_resume(started, true);
        Ok(Response::new(ResumeResponse {
            valid_for_ms,
            lost,
            cells,
            moved,
            ..first
        }))
    }

    type KeepAliveStream = session::ReplyStream;

    async fn keep_alive(
        &self,
        request: Request<Streaming<KeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStream>, Status> {
        let caller = self.engines[0].grants.current().caller(&request)?;
        Ok(Response::new(session::keep_alive_stream(
            request.into_inner(),
            self.engines.clone(),
            caller,
        )))
    }

    async fn close(
        &self,
        request: Request<CloseRequest>,
    ) -> Result<Response<CloseResponse>, Status> {
        if let Some(only) = self.single() {
            return SessionService {
                state: only.clone(),
            }
            .close(request)
            .await;
        }
        self.engines[0].check_owner(
            &request,
            &request.get_ref().session_id,
            &request.get_ref().session_secret,
        )?;
        let req = request.into_inner();
        let mut released = 0;
        let mut failed = None;
        let mut unknown = 0;
        for (i, engine) in self.engines.iter().enumerate() {
            let stay = req
                .cells
                .iter()
                .find(|c| Some(&c.cell) == engine.cell_name.as_ref());
            let incarnation = match stay {
                Some(s) => Some(s.incarnation),
                None if req.incarnation == 0 => None,
                None if req.cells.is_empty() && i == 0 => Some(req.incarnation),
                // A stay the client does not know of: not its to close.
                None => continue,
            };
            match session::close_stay(engine, &req.session_id, incarnation).await {
                Ok(n) => released += n,
                Err(ProxyError::UnknownSession { .. }) => unknown += 1,
                Err(e) => failed = Some(e),
            }
        }
        if let Some(e) = failed {
            return Err(e.into());
        }
        if unknown == self.engines.len() {
            return Err(ProxyError::UnknownSession { id: req.session_id }.into());
        }
        Ok(Response::new(CloseResponse { released }))
    }
}

impl Router {
    /// A Resume's keys by the cell that serves each name, and those no cell of this
    /// proxy serves (lost).
    fn keys_by_cell(&self, held: &[HeldKey]) -> (Vec<Vec<HeldKey>>, Vec<LostKey>) {
        let mut keys: Vec<Vec<HeldKey>> = vec![Vec::new(); self.engines.len()];
        let mut lost = Vec::new();
        for key in held {
            let found = self
                .route(&key.name)
                .ok()
                .and_then(|e| self.engines.iter().position(|x| Arc::ptr_eq(x, e)));
            match found {
                Some(i) => keys[i].push(key.clone()),
                None => lost.push(LostKey {
                    key: Some(key.clone()),
                    reason: format!("no cell of this proxy serves {:?}", key.name),
                }),
            }
        }
        (keys, lost)
    }

    /// A Resume that stopped in the cell `engine` after `moved_in` cells moved the
    /// session here: the cell's refusal, said as UNAVAILABLE if any cell moved.
    fn refused_midway(&self, e: ProxyError, moved_in: usize, engine: &ProxyState) -> Status {
        let fenced = matches!(e, ProxyError::FencedOut { .. });
        let mut status: Status = e.into();
        if moved_in > 0 {
            // Earlier cells moved their keys here: the client must not go on
            // where it was as if nothing moved (its keys there may be on
            // this proxy's lease now). UNAVAILABLE says "outcome unknown":
            // it stops acting and resumes again, which each cell's fence
            // keeps in order. A fence's metadata stays on.
            let metadata = status.metadata().clone();
            status = Status::unavailable(format!(
                "the session moved here in {} of {} cells, then cell {:?} refused: {}; resume again",
                moved_in,
                self.engines.len(),
                engine.cell_name.as_deref().unwrap_or_default(),
                status.message()
            ));
            *status.metadata_mut() = metadata;
        }
        if let (true, Some(cell)) = (fenced, &engine.cell_name) {
            if let Ok(value) = cell.parse() {
                status.metadata_mut().insert(FENCE_CELL, value);
            }
        }
        status
    }
}

/// The part of a Resume for one cell (`first`: the cell this proxy started on): the
/// client's stay in it, or, from a proxy of one cell, the request's own lease and
/// fence in the cell of its epoch.
fn stay_request(
    req: &ResumeRequest,
    engine: &ProxyState,
    first: bool,
    keys: Vec<HeldKey>,
) -> ResumeRequest {
    let stay = req
        .cells
        .iter()
        .find(|c| Some(&c.cell) == engine.cell_name.as_ref());
    let (from, fence, epoch, keys) = match stay {
        // A key's own lease is the one it had in the first cell: in this cell
        // its keys are on the stay's lease.
        Some(s) => (
            s.lease_id,
            s.fence_revision,
            s.epoch,
            keys.into_iter()
                .map(|k| HeldKey { lease_id: 0, ..k })
                .collect(),
        ),
        // From a proxy of one cell: the cell of that epoch (or, unknown, the
        // cell this proxy started on).
        None if req.cells.is_empty()
            && (req.epoch == engine.epoch() || (req.epoch == 0 && first)) =>
        {
            (req.from_lease_id, req.fence_revision, req.epoch, keys)
        }
        None => (0, 0, 0, keys),
    };
    ResumeRequest {
        session_id: req.session_id.clone(),
        ttl_ms: req.ttl_ms,
        identity: req.identity.clone(),
        from_lease_id: from,
        keys,
        acting_for_ms: req.acting_for_ms,
        fence_revision: fence,
        epoch,
        cells: Vec::new(),
        session_secret: req.session_secret.clone(),
    }
}
