//! The fake proxy's small keys: `Kv` (get, put — ephemeral with a session — and delete)
//! and `Watch`, over one in-memory store with its full history. Tests script how watch
//! streams fail ([`WatchFault`]) and see where every watch started.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lockcell_proto::v1::condition::When;
use lockcell_proto::v1::kv_server::Kv;
use lockcell_proto::v1::watch_event::Kind;
use lockcell_proto::v1::watch_server::Watch;
use lockcell_proto::v1::{
    DeleteRequest, DeleteResponse, GetRequest, GetResponse, KeyValue, PutRequest, PutResponse,
    TxnRequest, TxnResponse, WatchEvent, WatchRequest, WatchResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use super::{Fake, FakeProxy};

/// The small keys and every change to them, one event per revision.
#[derive(Debug, Default)]
pub struct Store {
    pub revision: i64,
    pub keys: BTreeMap<String, KeyValue>,
    /// Every event, in revision order.
    pub log: Vec<WatchEvent>,
    /// Ephemeral key → the session that owns it.
    owners: HashMap<String, String>,
}

impl Store {
    fn put(&mut self, key: &str, value: &[u8], owner: Option<&str>) -> KeyValue {
        self.revision += 1;
        let prev = self.keys.get(key).cloned();
        let kv = KeyValue {
            key: key.to_owned(),
            value: value.to_vec(),
            create_revision: prev.as_ref().map_or(self.revision, |p| p.create_revision),
            mod_revision: self.revision,
            version: prev.as_ref().map_or(1, |p| p.version + 1),
            lease: i64::from(owner.is_some()),
        };
        match owner {
            Some(session) => self.owners.insert(key.to_owned(), session.to_owned()),
            None => self.owners.remove(key),
        };
        self.keys.insert(key.to_owned(), kv.clone());
        self.log.push(WatchEvent {
            kind: Kind::Put as i32,
            kv: Some(kv.clone()),
            prev_kv: prev,
        });
        kv
    }

    fn delete(&mut self, key: &str) -> bool {
        let Some(prev) = self.keys.remove(key) else {
            return false;
        };
        self.owners.remove(key);
        self.revision += 1;
        self.log.push(WatchEvent {
            kind: Kind::Delete as i32,
            kv: Some(KeyValue {
                key: key.to_owned(),
                mod_revision: self.revision,
                ..KeyValue::default()
            }),
            prev_kv: Some(prev),
        });
        true
    }
}

/// How the next Watch stream misbehaves (each stream takes the next one; none: it
/// behaves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchFault {
    /// Refuse the call with this code, as a proxy that cannot serve does.
    Refuse(Code),
    /// After this many responses with events, end the stream with `code`: UNAVAILABLE
    /// (the proxy stopping), RESOURCE_EXHAUSTED (a cut-off, with the revision to resume
    /// from in the metadata), or OK (the stream just ends).
    EndAfter { responses: usize, code: Code },
    /// Deliver from this many revisions before the start asked for: duplicates the
    /// watcher must drop.
    Replay(i64),
}

impl Fake {
    /// Writes `key` (never ephemeral) as a client of another proxy would; returns the
    /// write's revision.
    pub fn put(&self, key: &str, value: &str) -> i64 {
        let mut revision = 0;
        self.store.send_modify(|s| {
            revision = s.put(key, value.as_bytes(), None).mod_revision;
        });
        revision
    }

    /// Deletes `key`; returns the store's revision after.
    pub fn delete(&self, key: &str) -> i64 {
        let mut revision = 0;
        self.store.send_modify(|s| {
            s.delete(key);
            revision = s.revision;
        });
        revision
    }

    /// Deletes every ephemeral key of `session`, as the proxy does when it ends.
    pub fn drop_ephemeral(&self, session: &str) {
        self.store.send_if_modified(|s| {
            let owned: Vec<String> = s
                .owners
                .iter()
                .filter(|(_, owner)| *owner == session)
                .map(|(key, _)| key.clone())
                .collect();
            for key in &owned {
                s.delete(key);
            }
            !owned.is_empty()
        });
    }

    /// Expires `session` as the proxy would: its renewals and calls are refused from
    /// now on and its ephemeral keys are deleted.
    pub fn kill(&self, session: &str) {
        self.killed.lock().unwrap().push(session.to_owned());
        self.drop_ephemeral(session);
    }
}

fn matches(req: &WatchRequest, key: &str) -> bool {
    if req.prefix {
        key.starts_with(&req.key)
    } else {
        key == req.key
    }
}

fn revision_metadata(status: &mut Status, name: &'static str, revision: i64) {
    status
        .metadata_mut()
        .insert(name, revision.to_string().parse().unwrap());
}

fn response(created: bool, revision: i64, events: Vec<WatchEvent>) -> WatchResponse {
    WatchResponse {
        created,
        revision,
        events,
        cell: String::new(),
    }
}

#[tonic::async_trait]
impl Kv for FakeProxy {
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let req = request.into_inner();
        let store = self.0.store.borrow();
        let kvs = store
            .keys
            .values()
            .filter(|kv| {
                if req.prefix {
                    kv.key.starts_with(&req.key)
                } else {
                    kv.key == req.key
                }
            })
            .cloned()
            .collect();
        Ok(Response::new(GetResponse {
            kvs,
            revision: store.revision,
            more: false,
            cell: String::new(),
        }))
    }

    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        let req = request.into_inner();
        if req.key.is_empty() || req.key.contains("//") || req.key.ends_with('/') {
            return Err(Status::invalid_argument(format!(
                "key {:?} has an empty segment",
                req.key
            )));
        }
        let owner = (!req.session_id.is_empty()).then_some(req.session_id.as_str());
        if owner.is_some_and(|s| self.0.is_killed(s)) {
            return Err(Fake::expired(&req.session_id));
        }
        let mut reply = None;
        self.0.store.send_if_modified(|s| {
            let current = s.keys.get(&req.key).cloned();
            let holds = match req.condition.and_then(|c| c.when) {
                None => true,
                Some(When::Absent(_)) => current.is_none(),
                Some(When::ModRevision(r)) => current.as_ref().is_some_and(|c| c.mod_revision == r),
                Some(When::Version(v)) => current.as_ref().is_some_and(|c| c.version == v),
            };
            let (succeeded, current) = if holds {
                (true, Some(s.put(&req.key, &req.value, owner)))
            } else {
                (false, current)
            };
            reply = Some(PutResponse {
                succeeded,
                revision: s.revision,
                current,
            });
            succeeded
        });
        Ok(Response::new(reply.expect("answered")))
    }

    async fn delete(
        &self,
        request: Request<DeleteRequest>,
    ) -> Result<Response<DeleteResponse>, Status> {
        let key = request.into_inner().key;
        let mut reply = None;
        self.0.store.send_if_modified(|s| {
            let deleted = s.delete(&key);
            reply = Some(DeleteResponse {
                succeeded: true,
                deleted: i64::from(deleted),
                revision: s.revision,
            });
            deleted
        });
        Ok(Response::new(reply.expect("answered")))
    }

    async fn txn(&self, _: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        Err(Status::unimplemented("the fake proxy has no transactions"))
    }
}

#[tonic::async_trait]
impl Watch for FakeProxy {
    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<WatchResponse, Status>> + Send>>;

    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let req = request.into_inner();
        self.0
            .watch_starts
            .send_modify(|starts| starts.push(req.start_revision));
        let fault = self.0.watch_plan.lock().unwrap().pop_front();
        if let Some(WatchFault::Refuse(code)) = fault {
            return Err(Status::new(code, "refused by the test"));
        }
        let mut store = self.0.store.subscribe();
        let start = match req.start_revision {
            0 => store.borrow().revision + 1,
            r => r,
        };
        let compacted = self.0.compacted.load(Ordering::Relaxed);
        if start < compacted {
            let mut status =
                Status::out_of_range(format!("history before revision {compacted} is compacted"));
            revision_metadata(&mut status, "lockcell-compact-revision", compacted);
            return Err(status);
        }
        let (tx, rx) = mpsc::channel(16);
        let progress = (req.progress_interval_ms > 0)
            .then(|| Duration::from_millis(req.progress_interval_ms.into()));
        tokio::spawn(async move {
            if tx
                .send(Ok(response(true, start - 1, vec![])))
                .await
                .is_err()
            {
                return;
            }
            let mut next = match fault {
                Some(WatchFault::Replay(n)) => (start - n).max(1),
                _ => start,
            };
            let mut sent = 0;
            loop {
                let (due, at): (Vec<WatchEvent>, i64) = {
                    let s = store.borrow_and_update();
                    let due = s
                        .log
                        .iter()
                        .filter(|e| e.kv.as_ref().is_some_and(|kv| kv.mod_revision >= next))
                        .cloned()
                        .collect();
                    (due, s.revision)
                };
                for event in due {
                    let kv = event.kv.as_ref().expect("logged with its key");
                    let revision = kv.mod_revision;
                    if matches(&req, &kv.key) {
                        if tx
                            .send(Ok(response(false, revision, vec![event])))
                            .await
                            .is_err()
                        {
                            return;
                        }
                        sent += 1;
                    }
                    next = revision + 1;
                    if let Some(WatchFault::EndAfter { responses, code }) = fault {
                        if sent == responses {
                            if code == Code::Ok {
                                return;
                            }
                            let mut status = Status::new(code, "ended by the test");
                            revision_metadata(&mut status, "lockcell-resume-revision", next);
                            let _ = tx.send(Err(status)).await;
                            return;
                        }
                    }
                }
                next = next.max(at + 1);
                let quiet = async {
                    match progress {
                        Some(every) => tokio::time::sleep(every).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    changed = store.changed() => if changed.is_err() { return },
                    () = quiet => {
                        if tx.send(Ok(response(false, next - 1, vec![]))).await.is_err() {
                            return;
                        }
                    }
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
