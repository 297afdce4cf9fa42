//! Taking and giving back locks the way each target's users do: lockcell's Acquire and
//! Release, or etcd's create-revision transaction recipe with a watch to wait.

use std::time::Duration;

use anyhow::{bail, Context};
use etcd_client::{
    Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchFilterType, WatchOptions,
};
use lockcell_proto::v1::lock_client::LockClient;
use lockcell_proto::v1::{AcquireRequest, FencingToken, ReleaseRequest};
use tonic::transport::Channel;

use crate::fleet::SessionKey;

/// A client's handle for lock calls, bound to one zone's endpoint.
#[derive(Clone)]
pub enum Locker {
    Lockcell(LockClient<Channel>),
    /// Boxed: the etcd client is large, and lockers are cloned into many tasks.
    Etcd(Box<etcd_client::Client>),
}

/// A grant: the revision that fences it.
#[derive(Debug, Clone, Copy)]
pub struct Grant {
    pub epoch: u64,
    pub revision: i64,
    /// The etcd recipe's two steps, when the grant came after a wait: when the waiter
    /// saw the holder's key deleted, and how long the granting transaction then took.
    pub stages: Option<Stages>,
}

/// Where a wait's time went, in the etcd recipe (lockcell's Acquire is one call).
#[derive(Debug, Clone, Copy)]
pub struct Stages {
    pub heard_free: tokio::time::Instant,
    pub write: Duration,
}

impl Locker {
    pub async fn connect_etcd(endpoint: &str) -> anyhow::Result<Locker> {
        let options =
            etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(10));
        Ok(Locker::Etcd(Box::new(
            etcd_client::Client::connect([endpoint], Some(options)).await?,
        )))
    }

    /// Acquires `lock` for `session`: once (`wait` zero) or waiting up to `wait`.
    /// `Ok(None)`: still held by someone else when the wait ran out.
    pub async fn acquire(
        &self,
        session: &SessionKey,
        lock: &str,
        wait: Duration,
    ) -> anyhow::Result<Option<Grant>> {
        match (self, session) {
            (Locker::Lockcell(client), SessionKey::Lockcell { id, secret }) => {
                let reply = client
                    .clone()
                    .acquire(AcquireRequest {
                        session_id: id.to_string(),
                        session_secret: secret.to_string(),
                        lock: lock.to_owned(),
                        wait_timeout_ms: Some(wait.as_millis() as u64),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                Ok(reply.token.filter(|_| reply.granted).map(|t| Grant {
                    epoch: t.epoch,
                    revision: t.revision,
                    stages: None,
                }))
            }
            (Locker::Etcd(client), SessionKey::Etcd(lease)) => {
                etcd_acquire(client, *lease, lock, wait).await
            }
            _ => bail!("session and locker speak different protocols"),
        }
    }

    pub async fn release(
        &self,
        session: &SessionKey,
        lock: &str,
        grant: Grant,
    ) -> anyhow::Result<()> {
        match (self, session) {
            (Locker::Lockcell(client), SessionKey::Lockcell { id, secret }) => {
                client
                    .clone()
                    .release(ReleaseRequest {
                        session_id: id.to_string(),
                        session_secret: secret.to_string(),
                        lock: lock.to_owned(),
                        token: Some(FencingToken {
                            epoch: grant.epoch,
                            revision: grant.revision,
                        }),
                        ..Default::default()
                    })
                    .await?;
                Ok(())
            }
            (Locker::Etcd(client), SessionKey::Etcd(_)) => {
                let key = etcd_key(lock);
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        key.as_bytes(),
                        CompareOp::Equal,
                        grant.revision,
                    )])
                    .and_then([TxnOp::delete(key.as_bytes(), None)]);
                client.kv_client().txn(txn).await?;
                Ok(())
            }
            _ => bail!("session and locker speak different protocols"),
        }
    }
}

fn etcd_key(lock: &str) -> String {
    format!("/loadtest/locks/{lock}")
}

/// The bare-etcd lock recipe: create the key on the client's lease if absent; else
/// watch it from the revision seen for its delete, and try again.
async fn etcd_acquire(
    client: &etcd_client::Client,
    lease: i64,
    lock: &str,
    wait: Duration,
) -> anyhow::Result<Option<Grant>> {
    let key = etcd_key(lock);
    let give_up = tokio::time::Instant::now() + wait;
    let mut heard_free = None;
    loop {
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.as_bytes(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                key.as_bytes(),
                lease.to_string(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let sent = tokio::time::Instant::now();
        let resp = client.kv_client().txn(txn).await?;
        let revision = resp.header().context("txn without header")?.revision();
        if resp.succeeded() {
            let stages = heard_free.map(|heard_free| Stages {
                heard_free,
                write: sent.elapsed(),
            });
            return Ok(Some(Grant {
                epoch: 0,
                revision,
                stages,
            }));
        }
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        let options = WatchOptions::new()
            .with_start_revision(revision + 1)
            .with_filters([WatchFilterType::NoPut]);
        let mut stream = client
            .watch_client()
            .watch(key.as_bytes(), Some(options))
            .await?;
        let deleted = async {
            while let Some(resp) = stream.message().await? {
                if resp
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    return anyhow::Ok(());
                }
            }
            bail!("watch on {key} ended")
        };
        match tokio::time::timeout(left, deleted).await {
            Ok(result) => {
                result?;
                heard_free = Some(tokio::time::Instant::now());
            }
            Err(_) => return Ok(None),
        }
    }
}
