//! An in-memory fake proxy on `127.0.0.1:0`, implementing just enough of `lockcell.v1`
//! to drive the SDK and lockctl; the real proxy is tested end to end in the workspace's
//! `tests/` crate. Tests steer it through its fields and watch what it saw.
#![allow(dead_code)] // each test file uses part of it

mod election;
mod kv;

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockcell_proto::v1::election_server::ElectionServer;
use lockcell_proto::v1::kv_server::KvServer;
use lockcell_proto::v1::lock_server::{Lock, LockServer};
use lockcell_proto::v1::session_server::{Session as SessionApi, SessionServer};
use lockcell_proto::v1::watch_server::WatchServer;
use lockcell_proto::v1::{
    AcquireRequest, AcquireResponse, CheckSequencerRequest, CheckSequencerResponse, CloseRequest,
    CloseResponse, FencingToken, KeepAliveRequest, KeepAliveResponse, Leader, LockMode,
    OpenRequest, OpenResponse, ReleaseRequest, ReleaseResponse, ResumeRequest, ResumeResponse,
    SessionState as Wire,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

pub use kv::{Store, WatchFault};

/// Every wait in these tests is for a condition, bounded by this.
pub const PATIENCE: Duration = Duration::from_secs(10);

#[derive(Default)]
pub struct Fake {
    pub next_id: AtomicU64,
    /// `valid_for_ms` granted by Open, renewals and Acquire.
    pub valid_for_ms: AtomicU64,
    /// While set, renewals are swallowed without a reply.
    pub mute: AtomicBool,
    pub streams_opened: watch::Sender<usize>,
    /// Sessions the fake reports as EXPIRED.
    pub killed: Mutex<Vec<String>>,
    /// Renewals seen, per session.
    pub renewals: watch::Sender<HashMap<String, u64>>,
    pub closed: watch::Sender<Vec<String>>,
    pub released: watch::Sender<Vec<String>>,
    /// lock → (session, revision) of its exclusive holder
    pub locks: Mutex<HashMap<String, (String, i64)>>,
    /// lock → (session, revision) of each shared holder
    pub shared: Mutex<HashMap<String, Vec<(String, i64)>>>,
    /// The mode of every Release that released something, in order.
    pub release_modes: Mutex<Vec<LockMode>>,
    pub revision: AtomicU64,
    /// session → the identity it opened with
    pub identities: Mutex<HashMap<String, String>>,
    /// election → its leader
    pub leaders: watch::Sender<HashMap<String, Leader>>,
    /// Elections resigned, in order.
    pub resigned: watch::Sender<Vec<String>>,
    /// Set to end the Observe streams open now (then set back to `Not`).
    pub cut_observers: watch::Sender<Cut>,
    /// The small keys, with their history; watchers wake on every change.
    pub store: watch::Sender<Store>,
    /// Revisions before this one are compacted: a watch from them is refused.
    pub compacted: AtomicI64,
    /// How the coming Watch streams misbehave, one entry per stream.
    pub watch_plan: Mutex<VecDeque<WatchFault>>,
    /// The `start_revision` of every Watch call, in order.
    pub watch_starts: watch::Sender<Vec<i64>>,
}

/// How the test ends Observe streams.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cut {
    #[default]
    Not,
    /// With an UNAVAILABLE status.
    WithError,
    /// As if the proxy had nothing more to say.
    Cleanly,
}

impl Fake {
    /// Cuts the Observe streams open now, `how`, and waits until one of them has.
    pub async fn cut_observers_once(&self, how: Cut) {
        self.cut_observers.send_replace(how);
        let mut cut = self.cut_observers.subscribe();
        tokio::time::timeout(PATIENCE, cut.wait_for(|c| *c == Cut::Not))
            .await
            .expect("an observation was cut")
            .unwrap();
    }

    fn next_revision(&self) -> i64 {
        self.revision.fetch_add(1, Ordering::Relaxed) as i64 + 100
    }

    fn is_killed(&self, session: &str) -> bool {
        self.killed.lock().unwrap().iter().any(|k| k == session)
    }

    /// The proxy's refusal for an expired session, in its words.
    fn expired(session: &str) -> Status {
        Status::failed_precondition(format!(
            "session {session:?} has expired: killed by the test"
        ))
    }
}

#[derive(Clone)]
struct FakeProxy(Arc<Fake>);

#[tonic::async_trait]
impl SessionApi for FakeProxy {
    async fn open(&self, request: Request<OpenRequest>) -> Result<Response<OpenResponse>, Status> {
        let n = self.0.next_id.fetch_add(1, Ordering::Relaxed);
        let session_id = format!("s{n}");
        self.0
            .identities
            .lock()
            .unwrap()
            .insert(session_id.clone(), request.get_ref().identity.clone());
        Ok(Response::new(OpenResponse {
            session_id: session_id.clone(),
            ttl_ms: request.get_ref().ttl_ms,
            valid_for_ms: self.0.valid_for_ms.load(Ordering::Relaxed),
            proxy_id: "fake".into(),
            lease_id: 1,
            incarnation: 1,
            epoch: 1,
            cells: Vec::new(),
            session_secret: format!("secret-of-{session_id}"),
        }))
    }

    /// Takes back a session it opened (the client reconnected): what it holds stays,
    /// unless the test killed it.
    async fn resume(
        &self,
        request: Request<ResumeRequest>,
    ) -> Result<Response<ResumeResponse>, Status> {
        let req = request.into_inner();
        if self.0.is_killed(&req.session_id) {
            return Err(Fake::expired(&req.session_id));
        }
        Ok(Response::new(ResumeResponse {
            ttl_ms: req.ttl_ms,
            valid_for_ms: self.0.valid_for_ms.load(Ordering::Relaxed),
            proxy_id: "fake".into(),
            lease_id: 1,
            lost: Vec::new(),
            incarnation: 1,
            fence_revision: 1,
            epoch: 1,
            cells: Vec::new(),
            moved: Vec::new(),
        }))
    }

    type KeepAliveStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<KeepAliveResponse, Status>> + Send>>;

    async fn keep_alive(
        &self,
        request: Request<Streaming<KeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStream>, Status> {
        self.0.streams_opened.send_modify(|n| *n += 1);
        let mut input = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let fake = self.0.clone();
        tokio::spawn(async move {
            while let Ok(Some(req)) = input.message().await {
                fake.renewals
                    .send_modify(|m| *m.entry(req.session_id.clone()).or_default() += 1);
                if fake.mute.load(Ordering::Relaxed) {
                    continue;
                }
                let killed = fake.killed.lock().unwrap().contains(&req.session_id);
                let reply = KeepAliveResponse {
                    state: if killed { Wire::Expired } else { Wire::Alive } as i32,
                    valid_for_ms: if killed {
                        0
                    } else {
                        fake.valid_for_ms.load(Ordering::Relaxed)
                    },
                    reason: if killed {
                        format!(
                            "session {:?} has expired: killed by the test",
                            req.session_id
                        )
                    } else {
                        String::new()
                    },
                    session_id: req.session_id,
                    seq: req.seq,
                    move_elsewhere: false,
                };
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn close(
        &self,
        request: Request<CloseRequest>,
    ) -> Result<Response<CloseResponse>, Status> {
        let id = request.into_inner().session_id;
        let released = {
            let mut locks = self.0.locks.lock().unwrap();
            let before = locks.len();
            locks.retain(|_, (holder, _)| *holder != id);
            let mut released = before - locks.len();
            for holders in self.0.shared.lock().unwrap().values_mut() {
                let before = holders.len();
                holders.retain(|(holder, _)| *holder != id);
                released += before - holders.len();
            }
            released as u32
        };
        self.0.leaders.send_if_modified(|leaders| {
            let before = leaders.len();
            leaders.retain(|_, leader| leader.session_id != id);
            leaders.len() != before
        });
        self.0.drop_ephemeral(&id);
        self.0.closed.send_modify(|c| c.push(id));
        Ok(Response::new(CloseResponse { released }))
    }
}

#[tonic::async_trait]
impl Lock for FakeProxy {
    async fn acquire(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        let req = request.into_inner();
        if req.lock.is_empty() || req.lock.contains(' ') {
            return Err(Status::invalid_argument(format!(
                "lock name {:?} is not allowed",
                req.lock
            )));
        }
        if self.0.is_killed(&req.session_id) {
            return Err(Fake::expired(&req.session_id));
        }
        let shared_mode = req.mode == LockMode::Shared as i32;
        let mut locks = self.0.locks.lock().unwrap();
        let mut shared = self.0.shared.lock().unwrap();
        let others = |holders: &[(String, i64)]| holders.iter().any(|(h, _)| *h != req.session_id);
        let busy = locks
            .get(&req.lock)
            .is_some_and(|(holder, _)| *holder != req.session_id)
            || (!shared_mode && shared.get(&req.lock).is_some_and(|h| others(h)));
        if busy {
            return Ok(Response::new(AcquireResponse {
                granted: false,
                token: None,
                valid_for_ms: 0,
            }));
        }
        let revision = if shared_mode {
            let holders = shared.entry(req.lock).or_default();
            let existing = holders
                .iter()
                .find(|(h, _)| *h == req.session_id)
                .map(|(_, revision)| *revision);
            match existing {
                Some(revision) => revision,
                None => {
                    let revision = self.0.next_revision();
                    holders.push((req.session_id, revision));
                    revision
                }
            }
        } else {
            let revision = self.0.next_revision();
            locks.insert(req.lock, (req.session_id, revision));
            revision
        };
        Ok(Response::new(AcquireResponse {
            granted: true,
            token: Some(FencingToken { epoch: 1, revision }),
            valid_for_ms: self.0.valid_for_ms.load(Ordering::Relaxed),
        }))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let req = request.into_inner();
        let revision = req.token.map(|t| t.revision);
        let mode = LockMode::try_from(req.mode).unwrap_or(LockMode::Exclusive);
        let released = if mode == LockMode::Shared {
            let mut shared = self.0.shared.lock().unwrap();
            let holders = shared.entry(req.lock.clone()).or_default();
            let before = holders.len();
            holders.retain(|(holder, rev)| !(*holder == req.session_id && Some(*rev) == revision));
            holders.len() != before
        } else {
            let mut locks = self.0.locks.lock().unwrap();
            let held = locks
                .get(&req.lock)
                .is_some_and(|(holder, rev)| *holder == req.session_id && Some(*rev) == revision);
            if held {
                locks.remove(&req.lock);
            }
            held
        };
        if released {
            self.0.release_modes.lock().unwrap().push(mode);
            self.0.released.send_modify(|r| r.push(req.lock));
        }
        Ok(Response::new(ReleaseResponse { released }))
    }

    async fn check_sequencer(
        &self,
        request: Request<CheckSequencerRequest>,
    ) -> Result<Response<CheckSequencerResponse>, Status> {
        let req = request.into_inner();
        let holder = self
            .0
            .locks
            .lock()
            .unwrap()
            .get(&req.lock)
            .map(|(_, revision)| FencingToken {
                epoch: 1,
                revision: *revision,
            });
        Ok(Response::new(CheckSequencerResponse {
            current: holder.is_some() && holder == req.token,
            holder,
        }))
    }

    async fn describe(
        &self,
        _request: Request<lockcell_proto::v1::DescribeRequest>,
    ) -> Result<Response<lockcell_proto::v1::DescribeResponse>, Status> {
        Err(Status::unimplemented(
            "the fake proxy does not describe locks",
        ))
    }
}

/// A running fake; the server task stops when this is dropped.
pub struct Running {
    pub fake: Arc<Fake>,
    pub addr: String,
    pub server: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub async fn start(valid_for_ms: u64) -> Running {
    let fake = Arc::new(Fake::default());
    fake.valid_for_ms.store(valid_for_ms, Ordering::Relaxed);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let proxy = FakeProxy(fake.clone());
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(SessionServer::new(proxy.clone()))
            .add_service(LockServer::new(proxy.clone()))
            .add_service(ElectionServer::new(proxy.clone()))
            .add_service(KvServer::new(proxy.clone()))
            .add_service(WatchServer::new(proxy))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    Running { fake, addr, server }
}
