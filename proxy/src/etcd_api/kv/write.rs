//! How the etcd API's writes reach etcd: guarded by the shard map copy, with the
//! proxy's writer record, one of at most `--etcd-writes-in-flight` at once.

use super::*;

impl EtcdApi {
    /// The shard map revision a write over a client range is made under: a single key's
    /// route, or, for a range, a cell without a shard map (a range cannot be checked
    /// against routes).
    pub(in crate::etcd_api) fn map_revision(
        &self,
        key: &[u8],
        range_end: &[u8],
    ) -> Result<i64, Status> {
        let routes = &self.state.routes;
        if range_end.is_empty() {
            return Ok(routes.serve_all([String::from_utf8_lossy(key).as_ref()])?);
        }
        match routes.copy() {
            None => Ok(routes.serve_all(std::iter::empty())?),
            Some(_) => Err(Status::failed_precondition(
                "a range write or a Txn through the etcd API needs a cell without a shard map; this cell has one",
            )),
        }
    }

    /// Who writes, for the audit trail.
    pub(in crate::etcd_api) fn writer(
        &self,
        caller: Option<String>,
        session: Option<&Session>,
    ) -> Writer {
        Writer {
            identity: session
                .map(|s| s.identity.clone())
                .or(caller)
                .unwrap_or_default(),
            session: session.map(|s| s.id.to_string()).unwrap_or_default(),
            proxy: self.state.proxy_id.clone(),
            ..Writer::default()
        }
    }

    /// Runs `ops` in one transaction guarded by the shard map copy at `map_revision`,
    /// with the proxy's writer record. A guard that fails is the map's change, never the
    /// client's: it is an error, not a reply.
    pub(in crate::etcd_api) async fn guarded(
        &self,
        ops: Vec<TxnOp>,
        map_revision: i64,
        writer: &Writer,
    ) -> Result<etcd_client::proto::PbTxnResponse, lockcell_cell::CellError> {
        self.guarded_for(&[], ops, map_revision, writer).await
    }

    /// [`guarded`](EtcdApi::guarded), for a write that puts keys on the leases of
    /// `owners`: sent only if each is still open when its turn comes.
    pub(super) async fn guarded_for(
        &self,
        owners: &[&Session],
        ops: Vec<TxnOp>,
        map_revision: i64,
        writer: &Writer,
    ) -> Result<etcd_client::proto::PbTxnResponse, lockcell_cell::CellError> {
        let done = self
            .guarded_by(owners, ops, map_revision, Vec::new(), Some(writer))
            .await?;
        // With no pins, only the map guard fails, and `guarded_by` says so.
        done.ok_or(lockcell_cell::CellError::MapChanged { now: map_revision })
    }

    /// [`guarded`](EtcdApi::guarded), with `pins` besides the map guard: `None` when one
    /// of them failed (and the map did not), so nothing was written.
    pub(super) async fn guarded_by(
        &self,
        owners: &[&Session],
        ops: Vec<TxnOp>,
        map_revision: i64,
        pins: Vec<Compare>,
        writer: Option<&Writer>,
    ) -> Result<Option<etcd_client::proto::PbTxnResponse>, lockcell_cell::CellError> {
        let mut then = ops;
        if let Some(writer) = writer {
            then.push(writer.op(&keyspace::writer_key(&self.state.proxy_id)));
        }
        let mut when = vec![map_guard(map_revision)];
        when.extend(pins);
        let txn = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([TxnOp::get(keyspace::shardmap_key(), None)]);
        let state = &self.state;
        let deadline = crate::etcd_api::write_timeout(state.config.etcd_timeout);
        let (_turn, waited) = self.turn_in_etcd("api write", deadline).await?;
        let _sending = match owners.is_empty() {
            true => None,
            false => Some(self.sending.read().await),
        };
        // A lease revoked while the write waited has had its keys deleted and its
        // revoke answered: as in etcd, a put on it now is refused, and nothing is sent.
        if let Some(gone) = owners
            .iter()
            .find(|s| !state.sessions.is_open(&s.id, s.incarnation))
        {
            tracing::debug!(session.id = %gone.id, "a leased write's lease ended while it waited for its turn");
            return Err(lockcell_cell::CellError::Etcd {
                op: "api write",
                source: etcd_client::Error::GRpcStatus(Status::not_found(LEASE_NOT_FOUND)),
            });
        }
        // Out of time in etcd: said as the whole deadline, the wait for the turn in it.
        let resp = with_timeout(
            "api write",
            deadline.saturating_sub(waited),
            state.etcd.kv_client().txn(txn),
        )
        .await
        .map_err(|e| match e {
            lockcell_cell::CellError::Timeout { op, .. } => lockcell_cell::CellError::Timeout {
                op,
                after: deadline,
            },
            other => other,
        })?;
        if !resp.succeeded() {
            check_map(resp.op_responses().as_slice(), map_revision)?;
            return Ok(None);
        }
        Ok(Some(resp.0))
    }

    /// Waits, up to `deadline`, for a turn to have a client write (`op`) in etcd: no
    /// more than `--etcd-writes-in-flight` at once, so a burst of them cannot queue in
    /// etcd ahead of the proxy's own lease renewals. Returns the turn (hold it while the
    /// write is in etcd) and how long it took.
    pub(in crate::etcd_api) async fn turn_in_etcd(
        &self,
        op: &'static str,
        deadline: std::time::Duration,
    ) -> Result<(tokio::sync::SemaphorePermit<'_>, std::time::Duration), lockcell_cell::CellError>
    {
        if let Ok(turn) = self.in_etcd.try_acquire() {
            return Ok((turn, std::time::Duration::ZERO));
        }
        ::metrics::counter!(crate::metrics::ETCD_API_WRITES_QUEUED).increment(1);
        let _waiting = crate::metrics::Counted::in_gauge(crate::metrics::ETCD_API_WRITES_WAITING);
        let started = tokio::time::Instant::now();
        let turn = tokio::time::timeout(deadline, self.in_etcd.acquire());
        match lockcell_cell::timing::waiting(turn).await {
            Ok(turn) => Ok((
                turn.expect("the write turns are never closed"),
                started.elapsed(),
            )),
            Err(_) => Err(lockcell_cell::CellError::Queued {
                op,
                waited: deadline,
            }),
        }
    }

    /// Waits (a moment at most) until the proxy's copy of the small keys has applied
    /// `revision`, so the client leases it knows cover what etcd answered at it.
    pub(in crate::etcd_api) async fn caught_up(&self, revision: i64) {
        let feed = &self.state.reads.feed;
        if feed.is_live() {
            feed.applied_through(revision, self.state.config.etcd_timeout)
                .await;
        }
    }
}
