//! etcd's Lock service (jetcd's and the Go and Rust clients' lock calls), as etcd itself
//! serves it: the recipe of Go's `concurrency.Mutex`, run in the proxy on the caller's
//! lease. The caller's key
//! `NAME/<lease in hex>` is created on the lease; the caller holds the lock once no key
//! under `NAME/` has an earlier create revision; the answer is that key, whose create
//! revision orders the holders (a fencing token, as etcd documents). Unlock deletes it,
//! and so does the lease's end: a holder whose lease ends loses the lock with it.
//!
//! Why the recipe and not lockcell's own locks: etcd's clients name the key in Unlock
//! and read the hold's order from its create revision, so the hold must be that key,
//! in the client's key space. Its safety is the lease's: the key lives on its session's
//! proxy lease, and goes only when the session ends, once no validity the proxy granted
//! to the lease is left (docs/design.md §4, the validity rule).

use std::time::Duration;

use etcd_client::proto::{PbCompare, PbRangeRequest, PbTxnOpRequest, PbTxnRequest, PbTxnRequestOp};
use etcd_client::proto::{PbCompareTarget, PbPutRequest, PbTargetUnion};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace::prefix_end;
use lockcell_cell::locklog::map_guard;
use lockcell_proto::etcd_lock::lock_server::Lock;
use lockcell_proto::etcd_lock::{
    LockRequest, LockResponse, ResponseHeader, UnlockRequest, UnlockResponse,
};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::keys::inner;
use super::lease::{session_of, LEASE_NOT_FOUND};
use super::EtcdApi;
use crate::access::Right;
use crate::sessions::Gone;
use lockcell_cell::grants::Limit;

/// How often a waiting Lock looks whether its lease still lives.
const LEASE_CHECK: Duration = Duration::from_millis(500);

#[tonic::async_trait]
impl Lock for EtcdApi {
    async fn lock(&self, request: Request<LockRequest>) -> Result<Response<LockResponse>, Status> {
        let caller = self.caller(&request)?;
        let name = self.may(caller.as_deref(), Right::Lock, &request.get_ref().name)?;
        let (lease, lock) = (request.get_ref().lease, "/v3lockpb.Lock/Lock");
        let here = || self.lock_here(caller.clone(), &name, request.get_ref());
        self.on_lease((lease, lock), &request, caller.as_deref(), |_| false, here)
            .await
    }

    async fn unlock(
        &self,
        request: Request<UnlockRequest>,
    ) -> Result<Response<UnlockResponse>, Status> {
        let caller = self.caller(&request)?;
        let key = request.into_inner().key;
        let name = key
            .iter()
            .rposition(|b| *b == b'/')
            .map(|slash| &key[..slash])
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "{:?} is not a lock's key (NAME/LEASE)",
                    String::from_utf8_lossy(&key)
                ))
            })?;
        self.may(caller.as_deref(), Right::Lock, name)?;
        self.paced_unless_shown(caller.as_deref(), &key)?;
        // Past the space line, an Unlock of a key that is not there would still write a
        // revision (the writer record): refused, as such a DeleteRange is.
        let feed = &self.state.reads.feed;
        self.state.space.admit_delete(
            &format!("unlocking {:?}", String::from_utf8_lossy(&key)),
            || {
                feed.is_live()
                    && feed.with_mirror(|m| {
                        std::str::from_utf8(&key).is_ok_and(|key| m.get(key).is_none())
                    })
            },
        )?;
        let map_revision = self.map_revision(&key, &[])?;
        let outcome = self
            .guarded(
                super::kv::deleted_with_record(&key).to_vec(),
                map_revision,
                &self.writer(caller, None),
            )
            .await
            .map_err(super::etcd_error)?;
        let revision = outcome.header.as_ref().map_or(0, |h| h.revision);
        Ok(Response::new(UnlockResponse {
            header: Some(self.lock_header(revision)),
        }))
    }
}

impl EtcdApi {
    /// A Lock run here: its lease is here (or nowhere).
    async fn lock_here(
        &self,
        caller: Option<String>,
        name: &str,
        req: &LockRequest,
    ) -> Result<Response<LockResponse>, Status> {
        if req.lease == 0 {
            return Err(Status::invalid_argument(format!(
                "a lock on {name:?} needs a lease: grant one and name it"
            )));
        }
        let in_progress = self.admit_wait(caller.as_deref(), &req.name, req.lease, 0)?;
        let lease = req.lease;
        let mut key = req.name.clone();
        key.push(b'/');
        key.extend_from_slice(format!("{:x}", req.lease).as_bytes());
        // The wait runs on its own, so that a caller who hangs up does not leave its
        // key in line: the wait takes it out (etcd's server does the same), but only a
        // key this call made: one the lease had already is an earlier call's hold.
        let (done, answer) = oneshot::channel();
        let api = self.clone();
        tokio::spawn(async move {
            let _in_progress = in_progress;
            let placed = match api.place(caller, &key, lease, b"").await {
                Ok(placed) => placed,
                Err(refused) => {
                    let _ = done.send(Err(refused));
                    return;
                }
            };
            api.wait_turn(&key, &placed, lease, done, |revision| {
                (key.clone(), revision)
            })
            .await;
        });
        // The task's etcd calls and its wait count as time outside the proxy.
        let (key, revision) = lockcell_cell::timing::waiting(answer)
            .await
            .map_err(|_| Status::unavailable("the lock's wait ended with the proxy"))??;
        Ok(Response::new(LockResponse {
            header: Some(self.lock_header(revision)),
            key,
        }))
    }

    /// Checks that `caller` (when the proxy checks grants) has `right` on the lock or
    /// election `name`; returns the name as text.
    pub(super) fn may(
        &self,
        caller: Option<&str>,
        right: Right,
        name: &[u8],
    ) -> Result<String, Status> {
        let name = lock_name(name)?;
        if let Some(identity) = caller {
            self.state.grants.current().check(identity, right, &name)?;
        }
        Ok(name)
    }

    fn lock_header(&self, revision: i64) -> ResponseHeader {
        let h = self.header(revision);
        ResponseHeader {
            cluster_id: h.cluster_id,
            member_id: h.member_id,
            revision: h.revision,
            raft_term: h.raft_term,
        }
    }

    /// Puts the caller's key in line, with `value`: created on the lease unless the
    /// lease has it. Calls placing one key take turns: a call that reads the key
    /// another call of the lease is creating would not yet see it as the lease's.
    /// An Unlock or Resign of a key this proxy's copy shows is never refused; one of a
    /// key it does not show (gone already, or never there) still writes to etcd, and
    /// takes a turn under the caller's call rate.
    pub(super) fn paced_unless_shown(
        &self,
        caller: Option<&str>,
        key: &[u8],
    ) -> Result<(), Status> {
        let shown = std::str::from_utf8(key)
            .is_ok_and(|k| self.state.reads.feed.with_mirror(|m| m.get(k).is_some()));
        if !shown {
            self.state.pace(caller)?;
        }
        Ok(())
    }

    /// What a Lock or Campaign call takes before it places its key: a turn under its
    /// identity's call rate, a place among its acquires in progress (held while it
    /// waits), and room for one more key: its identity's keys, etcd's space.
    pub(super) fn admit_wait(
        &self,
        caller: Option<&str>,
        name: &[u8],
        lease: i64,
        value_bytes: usize,
    ) -> Result<crate::limits::Taken, Status> {
        let state = &self.state;
        state.pace(caller)?;
        let in_progress = state.take(caller, Limit::Waiting)?;
        state.admit_keys(
            &session_of(lease),
            1,
            (name.len() + value_bytes + 16) as u64,
        )?;
        state.space.admit(
            &format!("placing a key under {:?}", String::from_utf8_lossy(name)),
            (name.len() + value_bytes + 16) as u64,
        )?;
        Ok(in_progress)
    }

    pub(super) async fn place(
        &self,
        caller: Option<String>,
        key: &[u8],
        lease: i64,
        value: &[u8],
    ) -> Result<Placed, Status> {
        let _turn = self.placing.take(key.to_vec()).await;
        self.place_now(caller, key, lease, value).await
    }

    async fn place_now(
        &self,
        caller: Option<String>,
        key: &[u8],
        lease: i64,
        value: &[u8],
    ) -> Result<Placed, Status> {
        let txn = PbTxnRequest {
            compare: vec![PbCompare {
                result: CompareOp::Equal as i32,
                target: PbCompareTarget::Create as i32,
                key: key.to_vec(),
                target_union: Some(PbTargetUnion::CreateRevision(0)),
                range_end: Vec::new(),
            }],
            success: vec![PbTxnRequestOp {
                request: Some(PbTxnOpRequest::RequestPut(PbPutRequest {
                    key: key.to_vec(),
                    lease,
                    value: value.to_vec(),
                    ..PbPutRequest::default()
                })),
            }],
            failure: vec![PbTxnRequestOp {
                request: Some(PbTxnOpRequest::RequestRange(PbRangeRequest {
                    key: key.to_vec(),
                    ..PbRangeRequest::default()
                })),
            }],
        };
        let reply = self.txn_as(caller, txn).await?;
        if reply.succeeded {
            let revision = reply.header.as_ref().map_or(0, |h| h.revision);
            return Ok(Placed {
                revision,
                created: true,
                value: value.to_vec(),
            });
        }
        let existing = reply.responses.iter().find_map(|r| match &r.response {
            Some(etcd_client::proto::PbTxnOpResponse::ResponseRange(range)) => {
                range.kvs.first().cloned()
            }
            _ => None,
        });
        match existing {
            Some(kv) if kv.lease == lease => Ok(Placed {
                revision: kv.create_revision,
                created: false,
                value: kv.value,
            }),
            Some(_) => Err(Status::failed_precondition(format!(
                "the lock's key {:?} is there on another lease (a plain put wrote it?)",
                String::from_utf8_lossy(key)
            ))),
            None => Err(Status::unavailable(
                "the lock's key vanished as it was read; try again",
            )),
        }
    }

    /// The wait of a Lock or Campaign whose key is placed: until the key is first or
    /// the caller hangs up. The caller hears the outcome through `done`, `granted`
    /// making its answer from the revision the key was found first at. A key this call
    /// made is taken out again unless the caller heard it was first.
    pub(super) async fn wait_turn<T>(
        &self,
        key: &[u8],
        placed: &Placed,
        lease: i64,
        mut done: oneshot::Sender<Result<T, Status>>,
        granted: impl FnOnce(i64) -> T,
    ) {
        let outcome = tokio::select! {
            outcome = self.wait_first(key, placed.revision, lease) => outcome,
            _ = done.closed() => Err(Status::cancelled("the caller hung up")),
        };
        let answered = match outcome {
            Ok(revision) => done.send(Ok(granted(revision))).is_ok(),
            Err(refused) => {
                let _ = done.send(Err(refused));
                false
            }
        };
        if !answered && placed.created {
            self.withdraw(key, placed.revision).await;
        }
    }

    /// Waits until no key under the lock's name has an earlier create revision than
    /// `mine`, each in turn, the nearest first, while the caller's own key is still
    /// there (as etcd's recipe checks: a key deleted by hand, or with its lease, holds
    /// nothing). Returns the revision it was found first at.
    async fn wait_first(&self, key: &[u8], mine: i64, lease: i64) -> Result<i64, Status> {
        let slash = key.iter().rposition(|b| *b == b'/').unwrap_or(0);
        let prefix = &key[..=slash];
        loop {
            let line = self.line(key, prefix, mine).await?;
            if line.mine != Some(mine) {
                return Err(Status::not_found(format!(
                    "{LEASE_NOT_FOUND}: the lock's key {:?} is gone (deleted, or its lease ended)",
                    String::from_utf8_lossy(key)
                )));
            }
            let Some(ahead) = line.ahead else {
                return Ok(line.revision);
            };
            self.wait_gone(&ahead, line.revision, lease).await?;
        }
    }

    /// The line as one read sees it: the caller's key's create revision, and the key
    /// just ahead of `mine` under `prefix` (client keys), if any.
    async fn line(&self, key: &[u8], prefix: &[u8], mine: i64) -> Result<Line, Status> {
        let state = &self.state;
        let ahead = GetOptions::new()
            .with_range(inner(&prefix_end(prefix)))
            .with_max_create_revision(mine - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1)
            .with_keys_only();
        let txn = Txn::new().and_then([
            TxnOp::get(inner(key), Some(GetOptions::new().with_keys_only())),
            TxnOp::get(inner(prefix), Some(ahead)),
        ]);
        let read = with_timeout(
            "api lock wait",
            state.config.etcd_timeout,
            state.etcd.kv_client().txn(txn),
        )
        .await
        .map_err(super::etcd_error)?;
        let revision = read.header().map_or(0, |h| h.revision());
        let first = |i: usize| match read.op_responses().get(i) {
            Some(TxnOpResponse::Get(get)) => get.kvs().first().cloned(),
            _ => None,
        };
        Ok(Line {
            mine: first(0).map(|kv| kv.create_revision()),
            ahead: first(1).map(|kv| kv.key().to_vec()),
            revision,
        })
    }

    /// Waits until etcd key `ahead` is deleted after `revision`, while lease `lease`
    /// lives.
    async fn wait_gone(&self, ahead: &[u8], revision: i64, lease: i64) -> Result<(), Status> {
        let state = &self.state;
        let options = WatchOptions::new().with_start_revision(revision + 1);
        let (_watcher, mut events) = state
            .etcd
            .watch_client()
            .watch(ahead.to_vec(), Some(options))
            .await
            .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?
            .split();
        let mut check = tokio::time::interval(LEASE_CHECK);
        loop {
            tokio::select! {
                told = events.message() => {
                    let told = told
                        .map_err(|e| Status::unavailable(format!("etcd's watch failed: {e}")))?
                        .ok_or_else(|| Status::unavailable("etcd ended the lock's watch"))?;
                    if told.events().iter().any(|e| e.event_type() == EventType::Delete) {
                        return Ok(());
                    }
                    if told.canceled() {
                        return Err(Status::unavailable(format!(
                            "etcd cancelled the lock's watch: {}",
                            told.cancel_reason()
                        )));
                    }
                }
                _ = check.tick() => {
                    match state.sessions.get(&session_of(lease), Instant::now()) {
                        Ok(s) if s.life.is_handed_off() => return Err(super::refused_handed_off()),
                        Ok(_) => {}
                        // Taken over by another proxy (an ended lease leaves a
                        // tombstone): the lease lives on there.
                        Err(Gone::Unknown) => {
                            return Err(Status::unavailable(format!(
                                "etcdserver: lease {lease:x} moved to another proxy while this call waited here; call again (the wait's place in line was given up)"
                            )))
                        }
                        Err(_) => return Err(Status::not_found(LEASE_NOT_FOUND)),
                    }
                }
            }
        }
    }

    /// Takes a wait's key out of line (a caller who hung up, a wait that failed): the
    /// key this call created at `created`, unless someone wrote it since.
    async fn withdraw(&self, key: &[u8], created: i64) {
        let state = &self.state;
        let Ok(map_revision) = self.map_revision(key, &[]) else {
            return;
        };
        let txn = Txn::new()
            .when([
                map_guard(map_revision),
                Compare::create_revision(inner(key), CompareOp::Equal, created),
            ])
            .and_then(super::kv::deleted_with_record(key));
        let timeout = state.config.etcd_timeout;
        let withdrawn = match self.turn_in_etcd("withdraw a lock wait", timeout).await {
            Ok((_turn, waited)) => {
                with_timeout(
                    "withdraw a lock wait",
                    timeout.saturating_sub(waited),
                    state.etcd.kv_client().txn(txn),
                )
                .await
            }
            Err(queued) => Err(queued),
        };
        if let Err(error) = withdrawn {
            tracing::warn!(%error, key = %String::from_utf8_lossy(key), "could not take a cancelled lock wait's key out of line; it goes with its lease");
        }
    }
}

/// What one read of a lock's line found.
struct Line {
    mine: Option<i64>,
    ahead: Option<Vec<u8>>,
    revision: i64,
}

/// Where a Lock call's key stands in line.
pub(super) struct Placed {
    /// The key's create revision: its place.
    pub revision: i64,
    /// Whether this call created it (else the lease had it from an earlier call).
    pub created: bool,
    /// The key's value.
    pub value: Vec<u8>,
}

/// A lock's name as text, for the grants.
fn lock_name(name: &[u8]) -> Result<String, Status> {
    if name.is_empty() {
        return Err(Status::invalid_argument("a lock needs a name"));
    }
    String::from_utf8(name.to_vec()).map_err(|_| {
        Status::invalid_argument(format!(
            "lock name {:?} is not UTF-8",
            String::from_utf8_lossy(name)
        ))
    })
}
