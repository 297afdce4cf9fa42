//! Gathering a Txn's leases at one proxy: each lease at another proxy is handed over
//! and taken over here, so the Txn runs as one etcd transaction.

use super::*;

/// How often, and how many times, a Txn gathering its leases looks again for one that
/// was not where it was found.
const GATHER_LOOK: Duration = Duration::from_millis(20);
const GATHER_LOOKS: u32 = 5;
/// How many times a Txn gathers its leases before it gives up.
const GATHER_ROUNDS: u32 = 3;

impl EtcdApi {
    /// Brings the leases a Txn writes with here, so that it runs as one transaction
    /// where all of them are: each lease at another proxy is handed over by it, on
    /// this proxy's signed request, and taken over here as after a drain (its keys move
    /// onto this proxy's lease; its clients find it here). Returns, once every lease is
    /// here (or nowhere: the Txn finds it unknown), the guard that holds off handing
    /// any of them over again until the Txn is done; after a few rounds of leases
    /// moving away meanwhile, UNAVAILABLE, having written nothing.
    pub(in crate::etcd_api) async fn gather(
        &self,
        leases: &[i64],
        metadata: &MetadataMap,
        caller: Option<&str>,
        adding: (u64, u64),
    ) -> Result<Option<tokio::sync::RwLockReadGuard<'_, ()>>, Status> {
        if leases.is_empty() {
            return Ok(None);
        }
        // Looks leases up even for a forwarded call, which runs here.
        let lookup = MetadataMap::new();
        // Held from the first lease found away on: a Txn whose leases are all here (the
        // usual case, a lock or an election of one lease) never waits for a gather.
        let mut one_at_a_time = None;
        // One more look than rounds: the first that finds a lease away only takes the
        // turn, and the next looks again under it.
        for _ in 0..=GATHER_ROUNDS {
            let writes = self.writes.read().await;
            let mut away = Vec::new();
            for &id in leases {
                if let Some(peer) = self.route(id, &lookup, caller, false).await? {
                    away.push((id, peer));
                }
            }
            if away.is_empty() {
                return Ok(Some(writes));
            }
            drop(writes);
            if one_at_a_time.is_none() {
                one_at_a_time = Some(self.gathering.lock().await);
                continue;
            }
            // Leases brought here count against their identity's sessions here, as a
            // resumed session does: refused before any moves.
            self.admit_gathered(caller, &away, adding)?;
            for (id, peer) in away {
                // Runs to its end even if the client hangs up: a lease asked for and
                // not taken would wait on its record, its calls held, until withdrawn.
                let (api, metadata) = (self.clone(), metadata.clone());
                let caller = caller.map(str::to_owned);
                tokio::spawn(async move {
                    api.gather_one(id, peer, &metadata, caller.as_deref()).await
                })
                .await
                .map_err(|e| Status::internal(format!("gathering lease {id:x} failed: {e}")))??;
            }
        }
        Err(Status::unavailable(
            "etcdserver: the leases of this transaction kept moving between proxies while it gathered them; nothing was written, try again",
        ))
    }
}

impl EtcdApi {
    /// Refuses, before any lease moves, a gather that would take `caller`'s sessions
    /// here past its `sessions` limit (each lease brought is one), or its keys past
    /// `keys` or `bytes`: the keys the leases bring (as this proxy's copy of the small
    /// keys counts them) and `adding`, the keys and bytes the Txn's own leased puts may
    /// add. So a refused Txn moves nothing and writes nothing.
    fn admit_gathered(
        &self,
        caller: Option<&str>,
        away: &[(i64, Peer)],
        adding: (u64, u64),
    ) -> Result<(), ProxyError> {
        let Some(principal) = caller else {
            return Ok(());
        };
        let coming = away.len();
        let (keys, bytes) = self.state.reads.feed.with_mirror(|mirror| {
            away.iter().fold(adding, |(keys, bytes), (id, _)| {
                let (k, b) = mirror.client_lease_keys(*id);
                (keys + k, bytes + b)
            })
        });
        self.state
            .admit_sessions(Some(principal), coming as u64)
            .and_then(|()| self.state.admit_keys_of(principal, keys, bytes))
            .map_err(|refused| match refused {
                ProxyError::Exhausted(why) => ProxyError::Exhausted(format!(
                    "{why}; this Txn would bring {coming} of its leases here from other \
                     proxies (with {keys} keys of {bytes} bytes, its own puts included), to \
                     write with them in one transaction; nothing was moved or written"
                )),
                other => other,
            })
    }

    /// Brings lease `id` here from `peer`, where it was found: asks that proxy to hand
    /// it over and takes it over. A proxy that no longer has it (it moved on, or
    /// another proxy took it first) sends the look to where it is now, a few times;
    /// then the Txn fails UNAVAILABLE, having written nothing. A lease found nowhere is
    /// left for the Txn to find unknown.
    async fn gather_one(
        &self,
        id: i64,
        mut peer: Peer,
        metadata: &MetadataMap,
        caller: Option<&str>,
    ) -> Result<(), Status> {
        let mut look = tokio::time::interval(GATHER_LOOK);
        // How many times running the proxy still named has said it does not have it.
        let mut denied = 0;
        for _ in 0..GATHER_LOOKS {
            look.tick().await;
            let ask = PbLeaseTimeToLiveRequest { id, keys: false };
            let mut call = self.forwarded(metadata, ask, caller)?;
            call.metadata_mut()
                .insert(HAND_OVER, MetadataValue::from_static("1"));
            let handed = match peer
                .unary::<_, PbLeaseTimeToLiveResponse>(TIME_TO_LIVE, call)
                .await
            {
                Ok(there) => there.get_ref().ttl != -1,
                // Not handed over there: it is looked for again.
                Err(status) if status.code() == tonic::Code::Unavailable => {
                    if status.message().starts_with(UNREACHABLE) {
                        self.peers.forget_proxy(&peer.proxy);
                    }
                    false
                }
                Err(status) => return Err(status),
            };
            self.peers.forget(id);
            if handed {
                metrics::counter!(m::ETCD_API_LEASES_GATHERED).increment(1);
                if let crate::etcd_api::handoff::TakeOver::Taken(_) =
                    self.take_over(id, caller).await?
                {
                    return Ok(());
                }
            }
            match self.route(id, &MetadataMap::new(), caller, true).await? {
                // Denied twice by the proxy still named (its ID block's, once a
                // revoke deleted its fence): it is nowhere, and the Txn finds it
                // unknown.
                Some(now) if now.proxy == peer.proxy && !handed => {
                    denied += 1;
                    if denied == 2 {
                        return Ok(());
                    }
                }
                Some(now) => {
                    denied = 0;
                    peer = now;
                }
                // Here now, or nowhere (the Txn finds it unknown).
                None => return Ok(()),
            }
        }
        Err(Status::unavailable(format!(
            "etcdserver: lease {id:x} kept moving between proxies while a transaction writing with it gathered its leases; nothing was written, try again"
        )))
    }
}
