//! Which proxies are running on a cell: each proxy keeps a presence record at
//! `/s/!proxy/<proxy id>` on one of its etcd leases, so the record goes when the proxy's
//! leases go (a drain revokes them; a killed proxy's expire).
//!
//! A record alone does not prove a proxy runs: a store restored from a snapshot holds
//! the records of the proxies that ran when it was taken, on leases etcd restored with
//! their full TTL. [`running`] therefore watches each record's lease: one whose time to
//! live rises, or that outlives the time to live it had, was renewed (its proxy runs);
//! one that expires was a leftover.

use std::time::Duration;

use etcd_client::{GetOptions, LeaseTimeToLiveOptions, PutOptions};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::error::{with_timeout, CellError};
use crate::keyspace;

/// What a proxy says about itself in its presence record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Presence {
    pub proxy_id: String,
    pub zone: String,
    /// The client address it listens on.
    pub listen: String,
    /// Its admin address (`/readyz`, `/metrics`, `/drain`).
    pub admin: String,
    /// The lockcell version it runs.
    pub version: String,
    /// When it started, Unix milliseconds.
    pub started_ms: u64,
    /// Where its etcd API is reached (HOST:PORT), when it serves one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<String>,
    /// The blocks of etcd API lease IDs it hands out: the other proxies find a lease's
    /// proxy by its ID's block.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub etcd_lease_blocks: Vec<u64>,
}

/// Writes `presence` on `lease`.
pub async fn announce(
    kv: &mut etcd_client::KvClient,
    presence: &Presence,
    lease: i64,
    timeout: Duration,
) -> Result<(), CellError> {
    let key = keyspace::proxy_presence_key(&presence.proxy_id);
    let body = serde_json::to_vec(presence).expect("presence serializes");
    with_timeout(
        "write proxy presence",
        timeout,
        kv.put(key, body, Some(PutOptions::new().with_lease(lease))),
    )
    .await?;
    Ok(())
}

/// A presence record as read: what it says, and the lease it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub presence: Presence,
    pub lease: i64,
}

/// Every presence record in the cell, by proxy id. A record that does not parse (written
/// by hand, or by a newer version) is shown with its key as the proxy id.
pub async fn recorded(
    kv: &mut etcd_client::KvClient,
    timeout: Duration,
) -> Result<Vec<Recorded>, CellError> {
    let root = keyspace::proxy_presence_root();
    let resp = with_timeout(
        "read proxy presence",
        timeout,
        kv.get(root, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    Ok(resp
        .kvs()
        .iter()
        .map(|kv| {
            let key = String::from_utf8_lossy(kv.key());
            let presence = serde_json::from_slice(kv.value()).unwrap_or_else(|_| Presence {
                proxy_id: key.strip_prefix(root).unwrap_or(&key).to_owned(),
                zone: "?".into(),
                listen: "?".into(),
                admin: "?".into(),
                version: "?".into(),
                started_ms: 0,
                etcd: None,
                etcd_lease_blocks: Vec::new(),
            });
            Recorded {
                presence,
                lease: kv.lease(),
            }
        })
        .collect())
}

/// How often [`running`] looks at the leases again.
const LOOK_EVERY: Duration = Duration::from_millis(250);

/// How long past the time to live it first had a lease must still be there to count as
/// renewed: etcd's whole seconds, rounded either way.
const OUTLIVED: Duration = Duration::from_millis(1500);

/// The proxies running on the cell: those whose presence record's lease is renewed
/// while this watches it. Returns once every record is either seen renewed or gone, or
/// after `patience` (then the records left are counted as running: their leases
/// outlived the wait, so something renews them or their TTL is longer than `patience`).
/// A record not on a lease is counted as running: nothing would ever remove it.
pub async fn running(
    client: &etcd_client::Client,
    timeout: Duration,
    patience: Duration,
) -> Result<Vec<Presence>, CellError> {
    let mut pending: Vec<Watched> = recorded(&mut client.kv_client(), timeout)
        .await?
        .into_iter()
        .map(|record| Watched { record, seen: None })
        .collect();
    let mut live = Vec::new();
    let until = Instant::now() + patience;
    let mut leases = client.lease_client();
    loop {
        let mut still = Vec::with_capacity(pending.len());
        for mut watched in pending {
            let ttl = time_to_live(&mut leases, watched.record.lease, timeout).await?;
            if watched.renewed(ttl) {
                live.push(watched.record.presence);
            } else if ttl > 0 {
                watched.seen(ttl);
                still.push(watched);
            }
        }
        pending = still;
        if pending.is_empty() {
            break;
        }
        if Instant::now() >= until {
            live.extend(pending.into_iter().map(|w| w.record.presence));
            break;
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
    live.sort_by(|a, b| a.proxy_id.cmp(&b.proxy_id));
    Ok(live)
}

/// A presence record [`running`] watches: its lease's time to live when first seen and
/// when last seen.
struct Watched {
    record: Recorded,
    /// (first time to live, when first seen, last time to live)
    seen: Option<(i64, Instant, i64)>,
}

impl Watched {
    /// Whether the lease was renewed: a record on no lease (nothing removes it), a time
    /// to live that rose, or a lease that outlived the time to live it had when first
    /// seen (etcd reports whole seconds, so a short TTL renewed every second may never
    /// be seen to rise).
    fn renewed(&self, ttl: i64) -> bool {
        self.record.lease == 0
            || self.seen.is_some_and(|(first_ttl, first_seen, last)| {
                ttl > last
                    || (ttl > 0
                        && first_seen.elapsed()
                            > Duration::from_secs(first_ttl.max(0) as u64) + OUTLIVED)
            })
    }

    fn seen(&mut self, ttl: i64) {
        let (first_ttl, first_seen) = self
            .seen
            .map_or((ttl, Instant::now()), |(first, at, _)| (first, at));
        self.seen = Some((first_ttl, first_seen, ttl));
    }
}

/// The time to live of `lease` in seconds; -1 once it has expired, `i64::MAX` for no
/// lease.
async fn time_to_live(
    leases: &mut etcd_client::LeaseClient,
    lease: i64,
    timeout: Duration,
) -> Result<i64, CellError> {
    if lease == 0 {
        return Ok(i64::MAX);
    }
    let options = Some(LeaseTimeToLiveOptions::new());
    match with_timeout(
        "read proxy lease",
        timeout,
        leases.time_to_live(lease, options),
    )
    .await
    {
        Ok(resp) => Ok(resp.ttl()),
        // etcd says "requested lease not found" for a lease that expired.
        Err(CellError::Etcd { source, .. }) if source.to_string().contains("not found") => Ok(-1),
        Err(other) => Err(other),
    }
}
