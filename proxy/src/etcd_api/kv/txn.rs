//! etcd's Txn through the proxy: checked, counted against the limits, sent as one etcd
//! transaction guarded by the shard map (and by the keys its lease compares read), and
//! answered as etcd would, with each leased put recorded in its session.

use super::*;

impl EtcdApi {
    /// Runs a checked and authorized Txn for `caller`.
    pub(in crate::etcd_api) async fn txn_as(
        &self,
        caller: Option<String>,
        req: PbTxnRequest,
    ) -> Result<PbTxnResponse, Status> {
        // A leased write holds off a hand-off until its keys are recorded.
        let writes = match txn_puts(&req).iter().any(|p| p.lease != 0) {
            true => Some(self.writes.read().await),
            false => None,
        };
        self.txn_holding(caller, &req, writes).await
    }

    /// Runs a checked and authorized Txn for `caller`, holding off hand-offs with
    /// `_writes` when it writes with a lease.
    pub(super) async fn txn_holding(
        &self,
        caller: Option<String>,
        req: &PbTxnRequest,
        _writes: Option<tokio::sync::RwLockReadGuard<'_, ()>>,
    ) -> Result<PbTxnResponse, Status> {
        let map_revision = self.map_revision(b"\0", b"\0")?;
        let leased = self.txn_sessions(req, caller.as_deref()).await?;
        let mut tries = 0;
        loop {
            tries += 1;
            let leases = self.leases_compared(req).await?;
            match self
                .txn_once(caller.clone(), req, &leased, &leases, map_revision)
                .await?
            {
                Some(reply) => return Ok(reply),
                None if tries < LEASE_COMPARE_TRIES => continue,
                None => {
                    return Err(Status::unavailable(format!(
                        "etcdserver: the keys a lease compare names were written {tries} times while the transaction was on its way; try again"
                    )))
                }
            }
        }
    }

    /// The client lease of every key a LEASE compare of `txn` names, as the proxy's
    /// copy of the small keys shows it after a read barrier: with the key's mod
    /// revision, which the transaction's guard then compares (0: no such key).
    pub(super) async fn leases_compared(
        &self,
        txn: &PbTxnRequest,
    ) -> Result<LeasesCompared, Status> {
        let mut keys = Vec::new();
        lease_compares(txn, &mut keys);
        if keys.is_empty() {
            return Ok(LeasesCompared::new());
        }
        let reads = &self.state.reads;
        let at = reads.barrier().await?;
        if !reads.feed.is_live()
            || !reads
                .feed
                .applied_through(at, self.state.config.etcd_timeout)
                .await
        {
            reads.feed.report_stall();
            return Err(Status::unavailable(
                "etcdserver: the proxy's copy of the keys is loading or behind, and a lease compare needs it; try again",
            ));
        }
        Ok(reads.feed.with_mirror(|mirror| {
            keys.into_iter()
                .map(|key| {
                    let now = std::str::from_utf8(&key)
                        .ok()
                        .and_then(|name| mirror.get(name))
                        .map_or((0, 0), |e| (e.client_lease, e.mod_revision));
                    (key, now)
                })
                .collect()
        }))
    }

    /// One try of a Txn: `None` when a key a lease compare names changed since the
    /// proxy read its lease (nothing was written).
    pub(super) async fn txn_once(
        &self,
        caller: Option<String>,
        req: &PbTxnRequest,
        leased: &Sessions,
        leases: &LeasesCompared,
        map_revision: i64,
    ) -> Result<Option<PbTxnResponse>, Status> {
        // A Txn that writes nothing records no writer: it then writes no revision, as in
        // etcd, and costs etcd's space nothing (also past the space line). Past the
        // line, one that only deletes, in ranges where no key exists, would still write
        // one (its writer record): refused, as such a DeleteRange is.
        let writer = self.writer(caller.clone(), None);
        // Every put of either branch counts against the cell's small-key bound: which
        // branch runs is etcd's to decide.
        let puts = txn_puts(req);
        self.txn_space(req, &puts)?;
        let client_txn = inward_txn(req, leased, leases, &writer)?;
        let keys: Vec<String> = puts
            .iter()
            .map(|p| String::from_utf8_lossy(&p.key).into_owned())
            .collect();
        let sizes: Vec<WriteSize> = keys
            .iter()
            .zip(&puts)
            .map(|(k, p)| WriteSize::put(k.as_str(), p.value.len(), p.lease == 0))
            .collect();
        let state = &self.state;
        self.admit_txn_keys(&puts, leased)?;
        let admitted = state.admit_writes(caller.as_deref(), &sizes).await?;
        let pending = self.record_pending(&puts, leased)?;
        // Each key a lease compare read is still as read: its client lease is.
        let pins: Vec<Compare> = leases
            .iter()
            .map(|(key, (_, modified))| {
                Compare::mod_revision(inner(key), CompareOp::Equal, *modified)
            })
            .collect();
        let owners: Vec<&Session> = pending.iter().map(|(session, _)| session).collect();
        let sent = self
            .guarded_by(
                &owners,
                vec![TxnOp::txn(client_txn)],
                map_revision,
                pins,
                txn_writes(req).then_some(&writer),
            )
            .await;
        for (session, grant) in pending {
            match &sent {
                Err(e) if crate::unsettled::unknown_outcome(e) => {
                    crate::unsettled::settle_unknown(state.owners(), &session, grant).await
                }
                _ => state.sessions.forget(&session.id, &grant),
            }
        }
        let Some(outcome) = sent.map_err(crate::etcd_api::etcd_error)? else {
            admitted.landed(None);
            return Ok(None);
        };
        let revision = outcome.header.as_ref().map_or(0, |h| h.revision);
        admitted.landed(Some(revision));
        let mut reply = outcome
            .responses
            .into_iter()
            .find_map(|op| match op.response {
                Some(PbTxnOpResponse::ResponseTxn(t)) => Some(t),
                _ => None,
            })
            .unwrap_or_default();
        self.settle_txn(req, &mut reply, leased, revision)?;
        // Only a range's leased keys take their client lease from the copy: a Txn
        // with none (a lock recipe's put) is answered without waiting for it.
        if ranges_leased_keys(&reply) {
            self.caught_up(revision).await;
        }
        self.outward_txn(&mut reply);
        reply.header = Some(self.header(revision));
        Ok(Some(reply))
    }

    /// Past the cell's space line, a Txn of deletes only that finds no key would still
    /// write one revision (its writer record): refused, as such a DeleteRange is.
    fn txn_space(&self, req: &PbTxnRequest, puts: &[&PbPutRequest]) -> Result<(), Status> {
        let feed = &self.state.reads.feed;
        self.state
            .space
            .admit_delete("a transaction of deletes only", || {
                let deletes = txn_deletes(req);
                feed.is_live()
                    && puts.is_empty()
                    && !deletes.is_empty()
                    && feed.with_mirror(|m| {
                        deletes.iter().all(|d| finds_none(m, &d.key, &d.range_end))
                    })
            })?;
        Ok(())
    }

    /// Counts a Txn's leased puts against their identities' keys and bytes: keys new to
    /// their leases, bytes past what the leases' records count, those of both branches
    /// (which branch runs is etcd's to decide); a key put in both counts once, at its
    /// most.
    fn admit_txn_keys(&self, puts: &[&PbPutRequest], leased: &Sessions) -> Result<(), Status> {
        let mut adds: std::collections::HashMap<(&str, String), (u64, u64)> = Default::default();
        for p in puts {
            let Some(session) = leased.get(&p.lease) else {
                continue;
            };
            let Ok(key) = leased_key(&p.key) else {
                continue;
            };
            let (keys, bytes) = session.adds(&key, (key.len() + p.value.len()) as u64);
            let most = adds.entry((session.id.as_ref(), key)).or_default();
            *most = (most.0.max(keys), most.1.max(bytes));
        }
        let mut by_session: std::collections::HashMap<&str, (u64, u64)> = Default::default();
        for ((id, _), (keys, bytes)) in adds {
            let sum = by_session.entry(id).or_default();
            *sum = (sum.0 + keys, sum.1 + bytes);
        }
        for (id, (keys, bytes)) in by_session {
            self.state.admit_keys(id, keys, bytes)?;
        }
        Ok(())
    }

    /// Records each leased put of a Txn as unsettled in its session before it is sent:
    /// it is the session's even if no answer comes, as a put on its own is.
    fn record_pending(
        &self,
        puts: &[&PbPutRequest],
        leased: &Sessions,
    ) -> Result<Vec<(Session, Grant)>, Status> {
        let pending: Vec<(Session, Grant)> = puts
            .iter()
            .filter_map(|p| {
                let session = leased.get(&p.lease)?;
                let key = leased_key(&p.key).ok()?;
                let grant = Grant::unsettled_etcd_api_key(key, &session.id, &p.value);
                Some((session.clone(), grant))
            })
            .collect();
        for (session, grant) in &pending {
            if !self.state.sessions.record_grant(
                &session.id,
                session.incarnation,
                grant.clone(),
                None,
            ) {
                return Err(Status::not_found(LEASE_NOT_FOUND));
            }
        }
        Ok(pending)
    }

    /// Checks every compare (read) and operation of a Txn, nested ones too.
    pub(super) fn authorize_txn<T>(
        &self,
        request: &Request<T>,
        txn: &PbTxnRequest,
    ) -> Result<(), Status> {
        for c in &txn.compare {
            self.authorize_range(request, Right::Read, &c.key, &c.range_end)?;
        }
        for op in txn.success.iter().chain(&txn.failure) {
            match &op.request {
                Some(PbTxnOpRequest::RequestRange(r)) => {
                    self.authorize_range(request, Right::Read, &r.key, &r.range_end)?
                }
                Some(PbTxnOpRequest::RequestPut(p)) => {
                    self.authorize_range(request, Right::Write, &p.key, &[])?
                }
                Some(PbTxnOpRequest::RequestDeleteRange(d)) => {
                    self.authorize_range(request, Right::Write, &d.key, &d.range_end)?
                }
                Some(PbTxnOpRequest::RequestTxn(t)) => self.authorize_txn(request, t)?,
                None => {}
            }
        }
        Ok(())
    }

    /// The session of every lease a Txn's puts name, each the caller's own.
    pub(super) async fn txn_sessions(
        &self,
        txn: &PbTxnRequest,
        caller: Option<&str>,
    ) -> Result<Sessions, Status> {
        let mut sessions = Sessions::new();
        for lease in txn_puts(txn).iter().map(|p| p.lease).filter(|l| *l != 0) {
            if sessions.contains_key(&lease) {
                continue;
            }
            sessions.insert(lease, self.lease_session(lease, caller).await?);
        }
        Ok(sessions)
    }

    /// After a Txn: answers each write of the branch that ran as etcd would (each went
    /// with its client lease record, [`record_op`]), the client's keys and leases in
    /// the previous values; records each leased put in its session; takes out the
    /// previous values the client did not ask for.
    pub(super) fn settle_txn(
        &self,
        req: &PbTxnRequest,
        reply: &mut PbTxnResponse,
        leased: &Sessions,
        revision: i64,
    ) -> Result<(), Status> {
        let ran = if reply.succeeded {
            &req.success
        } else {
            &req.failure
        };
        for (op, response) in ran.iter().zip(reply.responses.iter_mut()) {
            let writes = matches!(
                op.request,
                Some(PbTxnOpRequest::RequestPut(_) | PbTxnOpRequest::RequestDeleteRange(_))
            );
            if writes {
                if let Some(PbTxnOpResponse::ResponseTxn(pair)) = response.response.take() {
                    let mut pair = pair.responses.into_iter();
                    let (write, record) = (pair.next(), pair.next());
                    let before = records_before(record.as_ref());
                    response.response = write.and_then(|w| w.response);
                    match response.response.as_mut() {
                        Some(PbTxnOpResponse::ResponsePut(r)) => {
                            if let Some(kv) = r.prev_kv.as_mut() {
                                outward_prev(kv, &before);
                            }
                        }
                        Some(PbTxnOpResponse::ResponseDeleteRange(d)) => {
                            for kv in &mut d.prev_kvs {
                                outward_prev(kv, &before);
                            }
                        }
                        _ => {}
                    }
                }
            }
            match (&op.request, response.response.as_mut()) {
                (Some(PbTxnOpRequest::RequestPut(p)), Some(PbTxnOpResponse::ResponsePut(r))) => {
                    if let Some(session) = leased.get(&p.lease) {
                        let created = r.prev_kv.as_ref().map_or(revision, |kv| kv.create_revision);
                        let key = leased_key(&p.key)?;
                        self.record_leased(session, key, created, revision, p.value.len());
                    }
                    if !p.prev_kv {
                        r.prev_kv = None;
                    }
                }
                (Some(PbTxnOpRequest::RequestTxn(t)), Some(PbTxnOpResponse::ResponseTxn(r))) => {
                    self.settle_txn(t, r, leased, revision)?
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub(super) fn outward_txn(&self, reply: &mut PbTxnResponse) {
        let revision = reply.header.as_ref().map_or(0, |h| h.revision);
        reply.header = Some(self.header(revision));
        for op in &mut reply.responses {
            self.outward_op(op);
        }
    }

    pub(super) fn outward_op(&self, op: &mut PbResponseOp) {
        match op.response.as_mut() {
            Some(PbTxnOpResponse::ResponseRange(r)) => self.outward_range(r),
            // Their previous values are the client's already (`settle_txn`).
            Some(PbTxnOpResponse::ResponsePut(p)) => {
                let revision = p.header.as_ref().map_or(0, |h| h.revision);
                p.header = Some(self.header(revision));
            }
            Some(PbTxnOpResponse::ResponseDeleteRange(d)) => {
                let revision = d.header.as_ref().map_or(0, |h| h.revision);
                d.header = Some(self.header(revision));
            }
            Some(PbTxnOpResponse::ResponseTxn(t)) => self.outward_txn(t),
            None => {}
        }
    }
}
