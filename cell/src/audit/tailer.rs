//! The audit tailer: a read-only watch over the whole key space, with previous values,
//! turned into [`AuditEvent`]s and written to the store and the archive.
//!
//! What each change means is read off the key space ([`crate::keyspace`]):
//!
//! | change | event |
//! | --- | --- |
//! | holder key created (`/l/<lock>/!x`, `/l/<lock>/!s/<session>`) | granted (leader changed for an election) |
//! | holder key rewritten on another lease, same create revision | moved (the session moved to another proxy) |
//! | election holder key rewritten with a new value | leader changed (a proclaim) |
//! | holder key deleted in the same revision as the lock's release marker | released |
//! | holder key deleted without it | expired (session ended, proxy lease ran out) |
//! | waiter key created (`/q/…`) | waiting |
//! | small key written or deleted (`/k/…`) | key written / key deleted |
//! | `/sys/…` written or deleted | config changed |
//!
//! Release markers, session fences (`/s/…`) and waiter deletions (the waiter was
//! granted, or gave up) make no event of their own.
//!
//! The tailer starts from the lowest checkpoint of its sinks, so a restart neither loses
//! nor duplicates anything. When etcd has compacted past that point the revisions in
//! between cannot be read any more: the tailer says so, records a [`EventKind::Gap`]
//! event naming the range, counts it, and goes on from the compaction point.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Event, EventType, GetOptions, KeyValue, WatchOptions};
use tokio::sync::watch;

use super::archive::Archive;
use super::store::Store;
use super::{AuditError, AuditEvent, EventKind};
use crate::epoch::EpochRecord;
use crate::error::{with_timeout, CellError};
use crate::forced::ForceRelease;
use crate::keyspace::{self, KeyKind, LockName};
use crate::kv::Writer;
use crate::locklog::HolderRecord;
use crate::rbac;

/// Why the tailer stopped.
#[derive(Debug, thiserror::Error)]
pub enum TailerError {
    #[error(transparent)]
    Etcd(#[from] CellError),
    /// The store's revision is below what the trail already holds: etcd was restored
    /// from a backup. The restored history would reuse revisions the trail has for
    /// other events, so the tailer stops rather than mix the two.
    #[error("the cell is at revision {now}, below revision {through} the audit trail already holds: it was restored from a backup. Keep this trail as the record of the old history and start the tailer on a new store and archive for the restored cell")]
    Restored { now: i64, through: i64 },
    /// The trail was written from another history of the cell: etcd was restored from
    /// a backup since (and its epoch raised), and its revisions have since grown past
    /// the trail's checkpoint, so the store did not look restored by its revision.
    #[error("the audit trail holds revision {checkpoint}, but the cell's epoch record as of that revision was written at revision {written}, and the trail's last write of it is at revision {recorded}: the cell was restored from a backup since this trail was written. Keep this trail as the record of the old history and start the tailer on a new store and archive for the restored cell")]
    OtherHistory {
        checkpoint: i64,
        written: i64,
        recorded: i64,
    },
    #[error(transparent)]
    Sink(#[from] AuditError),
}

/// Largest watch message the tailer accepts: one revision can delete every key of a
/// proxy's lease, with previous values.
const MAX_WATCH_MESSAGE_BYTES: usize = 512 * 1024 * 1024;

/// Longest value kept in an event's `detail`, in bytes.
pub const DETAIL_BYTES: usize = 256;

/// How the tailer batches its writes.
#[derive(Debug, Clone)]
pub struct TailerOptions {
    /// Most events written to the store in one batch.
    pub batch_events: usize,
    /// Longest an event waits before its batch is written.
    pub batch_wait: Duration,
    /// An archive segment is written once it has this many events...
    pub segment_events: usize,
    /// ...or is this old.
    pub segment_age: Duration,
    /// Deadline of each call to etcd.
    pub etcd_timeout: Duration,
}

impl Default for TailerOptions {
    fn default() -> Self {
        TailerOptions {
            batch_events: 1000,
            batch_wait: Duration::from_millis(200),
            segment_events: 50_000,
            segment_age: Duration::from_secs(300),
            etcd_timeout: Duration::from_secs(5),
        }
    }
}

/// What the tailer has done, for `/metrics` and logs.
#[derive(Debug, Default)]
pub struct TailerStats {
    /// Highest revision every sink has.
    pub checkpoint: AtomicI64,
    /// The store's revision as last heard from etcd.
    pub head: AtomicI64,
    pub events: AtomicU64,
    /// Revisions etcd compacted away before the tailer read them.
    pub gap_revisions: AtomicU64,
    /// Writes a sink failed for a while (kept and tried again).
    pub write_failures: AtomicU64,
}

impl TailerStats {
    /// How many revisions the audit trail is behind the store.
    pub fn lag(&self) -> i64 {
        (self.head.load(Ordering::Relaxed) - self.checkpoint.load(Ordering::Relaxed)).max(0)
    }
}

/// Follows etcd into the store and the archive until `stop` turns true; then writes
/// what it has and flushes the archive.
pub async fn run(
    etcd: etcd_client::Client,
    store: &Store,
    archive: Option<&mut Archive>,
    options: &TailerOptions,
    stats: Arc<TailerStats>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), TailerError> {
    let store_at = store.checkpoint().await?;
    let archive_at = match archive.as_deref() {
        Some(a) => a.checkpoint().await?,
        None => store_at,
    };
    let mut next = store_at.min(archive_at) + 1;
    stats.checkpoint.store(next - 1, Ordering::Relaxed);
    let Some(epoch) = epoch_when_reachable(&etcd, next - 1, options.etcd_timeout, &mut stop).await
    else {
        return Ok(());
    };
    same_history(&etcd, store, next - 1, options.etcd_timeout).await?;
    let mut reading = Reading::new(epoch);
    tracing::info!(
        store = %store.describe(),
        archive = %archive.as_deref().map(|a| a.describe()).unwrap_or_else(|| "none".into()),
        from_revision = next,
        epoch = reading.epoch.epoch,
        "audit tailer started"
    );
    let mut sinks = Sinks {
        store,
        archive,
        options,
        stats: &stats,
    };
    let mut pending: Vec<AuditEvent> = Vec::new();
    let mut through = next - 1;
    loop {
        // Whole lease revocations arrive as one message.
        let mut watch = etcd
            .watch_client()
            .max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES);
        let opened = watch
            .watch(
                "",
                Some(
                    WatchOptions::new()
                        .with_all_keys()
                        .with_prev_key()
                        .with_start_revision(next)
                        .with_progress_notify(),
                ),
            )
            .await;
        let mut stream = match opened {
            Ok(opened) => opened,
            Err(e) => {
                tracing::warn!(error = %e, "the audit watch could not start; retrying");
                if wait_or_stop(&mut stop, Duration::from_secs(1)).await {
                    break;
                }
                continue;
            }
        };
        let mut due = tokio::time::Instant::now() + options.batch_wait;
        loop {
            let message = tokio::select! {
                m = stream.message() => m,
                _ = tokio::time::sleep_until(due) => {
                    sinks.write(&mut pending, through).await?;
                    due = tokio::time::Instant::now() + options.batch_wait;
                    continue;
                }
                _ = stop.wait_for(|s| *s) => break,
            };
            let resp = match message {
                Ok(Some(resp)) => resp,
                Ok(None) => {
                    tracing::warn!("the audit watch ended; starting it again");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the audit watch broke; starting it again");
                    break;
                }
            };
            if let Some(header) = resp.header() {
                stats.head.fetch_max(header.revision(), Ordering::Relaxed);
            }
            if resp.compact_revision() > 0 && resp.compact_revision() <= next {
                // Compacted up to where the tailer already is: nothing was lost.
                tracing::info!(
                    compacted = resp.compact_revision(),
                    next,
                    "the audit watch was compacted behind the tailer; starting it again"
                );
                break;
            }
            if resp.compact_revision() > 0 {
                let lost_to = resp.compact_revision() - 1;
                let lost = lost_to - next + 1;
                tracing::warn!(
                    from = next,
                    to = lost_to,
                    revisions = lost,
                    "etcd compacted revisions before the audit tailer read them; they are missing from the audit trail"
                );
                stats
                    .gap_revisions
                    .fetch_add(lost as u64, Ordering::Relaxed);
                pending.push(gap(next, lost_to));
                through = lost_to;
                next = resp.compact_revision();
                match epoch_when_reachable(&etcd, 0, options.etcd_timeout, &mut stop).await {
                    Some(epoch) => reading = Reading::new(epoch),
                    None => break,
                }
                break;
            }
            if resp.canceled() {
                tracing::warn!(
                    reason = resp.cancel_reason(),
                    "the audit watch was cancelled; starting it again"
                );
                // etcd turns a new watch away in-band, which the client's own log-in
                // again (on refused calls) never sees: an idle token expired, or the
                // member restarted and forgot it.
                if rbac::refusal_in(resp.cancel_reason()) == Some(rbac::Refusal::TokenExpired) {
                    if let Err(e) = etcd.refresh_token().await {
                        tracing::warn!(error = %e, "logging in to etcd again failed");
                    }
                }
                break;
            }
            if resp.created() {
                // The watch's acknowledgement: its header is the store's revision now,
                // not how far the watch has sent events; below where the trail is, the
                // store went back.
                let now = resp.header().map(|h| h.revision()).unwrap_or_default();
                if now > 0 && now < through {
                    // A member that lags answers low too: a linearizable read decides.
                    let read = with_timeout(
                        "read revision",
                        options.etcd_timeout,
                        etcd.kv_client().get(
                            keyspace::epoch_key(),
                            Some(GetOptions::new().with_count_only()),
                        ),
                    )
                    .await?;
                    let now = read.header().map(|h| h.revision()).unwrap_or_default();
                    if now < through {
                        return Err(TailerError::Restored { now, through });
                    }
                }
                continue;
            }
            if resp.events().is_empty() {
                // A progress notification (sent only once the watch has caught up):
                // nothing happened up to its revision.
                if let Some(header) = resp.header() {
                    through = through.max(header.revision());
                    next = next.max(through + 1);
                }
                continue;
            }
            let first = resp.events()[0]
                .kv()
                .map(KeyValue::mod_revision)
                .unwrap_or_default();
            if first <= through {
                // Events at or below a revision a progress notification already
                // covered (older etcd can send one ahead of events): start again from
                // what every sink holds, which they skip.
                tracing::warn!(first, through, "the audit watch sent events it had said were done; reading again from the checkpoint");
                pending.clear();
                through = stats.checkpoint.load(Ordering::Relaxed);
                next = through + 1;
                break;
            }
            for group in by_revision(resp.events()) {
                let revision = group[0]
                    .kv()
                    .map(KeyValue::mod_revision)
                    .unwrap_or_default();
                reading
                    .learn_epochs(&etcd, &group, options.etcd_timeout)
                    .await;
                pending.extend(reading.events(revision, &group, now_ms()));
                through = revision;
                next = revision + 1;
            }
            stats.head.fetch_max(through, Ordering::Relaxed);
            if pending.len() >= options.batch_events {
                sinks.write(&mut pending, through).await?;
                due = tokio::time::Instant::now() + options.batch_wait;
            }
        }
        if *stop.borrow() {
            break;
        }
        if wait_or_stop(&mut stop, Duration::from_millis(200)).await {
            break;
        }
    }
    sinks.write(&mut pending, through).await?;
    if let Some(archive) = sinks.archive {
        archive.flush().await?;
    }
    tracing::info!(checkpoint = through, "audit tailer stopped");
    Ok(())
}

/// Where events go: the store, the archive (if any), and the figures about them.
struct Sinks<'a> {
    store: &'a Store,
    archive: Option<&'a mut Archive>,
    options: &'a TailerOptions,
    stats: &'a TailerStats,
}

impl Sinks<'_> {
    /// Writes the pending events (whole revisions, covering up to `through`) to the
    /// store and the archive. A sink that is briefly away keeps them pending for the
    /// next try (both sinks skip what they already have); any other failure stops the
    /// tailer.
    async fn write(
        &mut self,
        pending: &mut Vec<AuditEvent>,
        through: i64,
    ) -> Result<(), AuditError> {
        match self.write_once(pending, through).await {
            Err(e) if e.is_retriable() => {
                self.stats.write_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, pending = pending.len(), "an audit sink is away; keeping the events to write them later");
                Ok(())
            }
            other => other,
        }
    }

    async fn write_once(
        &mut self,
        pending: &mut Vec<AuditEvent>,
        through: i64,
    ) -> Result<(), AuditError> {
        let (events, age) = (self.options.segment_events, self.options.segment_age);
        if through <= self.stats.checkpoint.load(Ordering::Relaxed) && pending.is_empty() {
            // Nothing new; a segment that has grown old is still written.
            if let Some(archive) = self.archive.as_deref_mut() {
                archive.flush_if_due(events, age).await?;
            }
            return Ok(());
        }
        self.store.write(pending).await?;
        if let Some(archive) = self.archive.as_deref_mut() {
            archive.write(pending, through);
            archive.flush_if_due(events, age).await?;
        }
        self.stats
            .events
            .fetch_add(pending.len() as u64, Ordering::Relaxed);
        self.stats.checkpoint.store(through, Ordering::Relaxed);
        pending.clear();
        Ok(())
    }
}

async fn wait_or_stop(stop: &mut watch::Receiver<bool>, pause: Duration) -> bool {
    let stopped = tokio::select! {
        _ = tokio::time::sleep(pause) => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    stopped || *stop.borrow()
}

/// The events of one watch reply, cut into whole revisions in order.
fn by_revision(events: &[Event]) -> Vec<Vec<&Event>> {
    let mut groups: Vec<Vec<&Event>> = Vec::new();
    for event in events {
        let revision = event.kv().map(KeyValue::mod_revision).unwrap_or_default();
        match groups.last_mut() {
            Some(group)
                if group[0]
                    .kv()
                    .map(KeyValue::mod_revision)
                    .unwrap_or_default()
                    == revision =>
            {
                group.push(event)
            }
            _ => groups.push(vec![event]),
        }
    }
    groups
}

fn gap(from: i64, to: i64) -> AuditEvent {
    AuditEvent {
        revision: to,
        detail: format!("revisions {from}..={to} were compacted before the tailer read them"),
        ..AuditEvent::new(EventKind::Gap, String::new(), now_ms())
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// What reading the log needs to remember: the epoch tokens are minted in, and which
/// proxy each etcd lease belongs to.
struct Reading {
    epoch: EpochRecord,
    /// The epoch from each revision on where the epoch record was written (the epoch a
    /// grant's token carries is the record's at the grant's revision).
    epochs: BTreeMap<i64, u64>,
    /// The proxy each lease is a lease of, as grants, session moves and presence
    /// records show it: a moved or expired hold names the proxy its session was on.
    proxies: HashMap<i64, String>,
}

/// Most leases [`Reading::proxies`] remembers (proxies keep a handful each; leases of
/// proxies long gone are forgotten all at once past it).
const MAX_LEASES_REMEMBERED: usize = 100_000;

/// The epoch record as of `revision` (0: now), asking until etcd answers; `None` when
/// the tailer was stopped first.
/// Checks that the trail (up to `checkpoint`) and the cell share their history: the
/// epoch record as etcd has it at the checkpoint must have been written at the last
/// epoch write the trail recorded. After a restore and `bump-epoch`, the bump's write
/// is at a revision the old trail holds other events for. Passes when it cannot tell:
/// a fresh trail, a checkpoint etcd has compacted (or not reached: the watch then finds
/// the store went back), a trail that began after the record was last written.
async fn same_history(
    etcd: &etcd_client::Client,
    store: &Store,
    checkpoint: i64,
    timeout: Duration,
) -> Result<(), TailerError> {
    if checkpoint <= 0 {
        return Ok(());
    }
    let key = keyspace::epoch_key();
    let options = GetOptions::new().with_revision(checkpoint);
    let Ok(resp) = with_timeout(
        "read epoch record",
        timeout,
        etcd.kv_client().get(key, Some(options)),
    )
    .await
    else {
        return Ok(());
    };
    let Some(written) = resp.kvs().first().map(KeyValue::mod_revision) else {
        return Ok(());
    };
    let trail = store.history(key, None, 100_000).await?;
    let Some(last) = trail.iter().rev().find(|e| e.revision <= checkpoint) else {
        return Ok(());
    };
    if last.revision == written {
        return Ok(());
    }
    Err(TailerError::OtherHistory {
        checkpoint,
        written,
        recorded: last.revision,
    })
}

async fn epoch_when_reachable(
    etcd: &etcd_client::Client,
    revision: i64,
    timeout: Duration,
    stop: &mut watch::Receiver<bool>,
) -> Option<(EpochRecord, i64)> {
    loop {
        match Reading::epoch_at(etcd, revision, timeout).await {
            Ok(epoch) => return Some(epoch),
            Err(e) => tracing::warn!(error = %e, "etcd is unreachable; retrying"),
        }
        if wait_or_stop(stop, Duration::from_secs(1)).await {
            return None;
        }
    }
}

impl Reading {
    fn new((epoch, written): (EpochRecord, i64)) -> Reading {
        Reading {
            epochs: BTreeMap::from([(written, epoch.epoch)]),
            epoch,
            proxies: HashMap::new(),
        }
    }

    /// The epoch of a grant made at `revision`.
    fn epoch_of(&self, revision: i64) -> u64 {
        self.epochs
            .range(..=revision)
            .next_back()
            .or_else(|| self.epochs.iter().next())
            .map_or(self.epoch.epoch, |(_, epoch)| *epoch)
    }

    /// Reads the epoch of every grant in `changes` made before the earliest epoch
    /// record this reading knows (a hold granted before the tailer's start, and in an
    /// earlier epoch, that expires or moves now).
    async fn learn_epochs(
        &mut self,
        etcd: &etcd_client::Client,
        changes: &[&Event],
        timeout: Duration,
    ) {
        let first = self.epochs.keys().next().copied().unwrap_or_default();
        let older: Vec<i64> = changes
            .iter()
            .filter_map(|e| e.kv())
            .filter(|kv| {
                matches!(
                    keyspace::parse_key(kv.key()),
                    Some((_, KeyKind::Exclusive | KeyKind::Shared))
                )
            })
            .map(KeyValue::create_revision)
            .filter(|created| *created > 0 && *created < first)
            .collect();
        for created in older {
            if self.epochs.range(..=created).next_back().is_some() {
                continue;
            }
            // A read that fails (compacted) leaves the earliest epoch known in force.
            if let Ok((record, written)) = Reading::epoch_at(etcd, created, timeout).await {
                if written <= created {
                    self.epochs.insert(written, record.epoch);
                }
            }
        }
    }

    /// Which proxy `lease` is a lease of, if this reading saw it.
    fn proxy_of(&self, lease: i64) -> Option<&str> {
        self.proxies.get(&lease).map(String::as_str)
    }

    fn learn_proxy(&mut self, lease: i64, proxy: &str) {
        if lease == 0 || proxy.is_empty() {
            return;
        }
        if self.proxies.len() >= MAX_LEASES_REMEMBERED {
            self.proxies.clear();
        }
        self.proxies.insert(lease, proxy.to_owned());
    }

    /// Learns lease owners from one revision's puts: a session fence (its value is the
    /// proxy the session moved to), a presence record, a grant.
    fn learn_proxies(&mut self, changes: &[&Event]) {
        for change in changes {
            let Some(kv) = change.kv() else { continue };
            if change.event_type() != EventType::Put || kv.lease() == 0 {
                continue;
            }
            let key = kv.key();
            if key.starts_with(keyspace::proxy_presence_root().as_bytes()) {
                let id = &key[keyspace::proxy_presence_root().len()..];
                self.learn_proxy(kv.lease(), &String::from_utf8_lossy(id));
            } else if keyspace::value_names_proxy(key) {
                self.learn_proxy(kv.lease(), &String::from_utf8_lossy(kv.value()));
            } else if kv.create_revision() == kv.mod_revision()
                && matches!(
                    keyspace::parse_key(key),
                    Some((_, KeyKind::Exclusive | KeyKind::Shared))
                )
            {
                if let Ok(record) = serde_json::from_slice::<HolderRecord>(kv.value()) {
                    self.learn_proxy(kv.lease(), &record.proxy);
                }
            }
        }
    }

    /// The epoch record as of `revision` (0: now), or now when etcd has compacted that
    /// revision away; a cell without one is in epoch 0. With it, the revision it was
    /// written at (0 for none).
    async fn epoch_at(
        etcd: &etcd_client::Client,
        revision: i64,
        timeout: Duration,
    ) -> Result<(EpochRecord, i64), TailerError> {
        let key = keyspace::epoch_key();
        let mut kv = etcd.kv_client();
        let options = (revision > 0).then(|| GetOptions::new().with_revision(revision));
        let resp = match with_timeout("read epoch record", timeout, kv.get(key, options)).await {
            Ok(resp) => resp,
            // Compacted away: the record as it is now.
            Err(_) if revision > 0 => {
                with_timeout("read epoch record", timeout, kv.get(key, None)).await?
            }
            Err(e) => return Err(e.into()),
        };
        Ok(resp
            .kvs()
            .first()
            .and_then(|kv| Some((serde_json::from_slice(kv.value()).ok()?, kv.mod_revision())))
            .unwrap_or((
                EpochRecord {
                    cluster_id: String::new(),
                    epoch: 0,
                },
                0,
            )))
    }

    /// The audit events of one revision's changes, in order.
    fn events(&mut self, revision: i64, changes: &[&Event], now_ms: i64) -> Vec<AuditEvent> {
        self.learn_proxies(changes);
        // A delete of a holder key is a release only when the same revision wrote the
        // lock's release marker.
        let released: HashSet<LockName> = changes
            .iter()
            .filter(|e| e.event_type() == EventType::Put)
            .filter_map(|e| keyspace::parse_key(e.kv()?.key()))
            .filter(|(_, kind)| *kind == KeyKind::Released)
            .map(|(lock, _)| lock)
            .collect();
        // Who made this revision's small-key writes, when its transaction said.
        let writer: Option<Writer> = changes
            .iter()
            .filter(|e| e.event_type() == EventType::Put)
            .filter_map(|e| e.kv())
            .find(|kv| {
                kv.key().starts_with(keyspace::writer_root().as_bytes())
                    || kv.key() == keyspace::admin_writer_key().as_bytes()
            })
            .and_then(|kv| serde_json::from_slice(kv.value()).ok());
        let mut out = Vec::new();
        for change in changes {
            let Some(kv) = change.kv() else { continue };
            let event = self.event(change, kv, &released, now_ms);
            let event = event.map(|mut event| {
                if matches!(event.kind, EventKind::KeyWritten | EventKind::KeyDeleted) {
                    self.sign(&mut event, writer.as_ref());
                }
                event
            });
            if let Some(mut event) = event {
                event.revision = revision;
                event.seq = out.len() as u32;
                out.push(event);
            }
        }
        out
    }

    /// Says who made a small-key event: the revision's writer, else (an ephemeral key
    /// that went with its session) the proxy whose lease it was on.
    fn sign(&self, event: &mut AuditEvent, writer: Option<&Writer>) {
        match writer {
            Some(w) => {
                if w.at_ms > 0 {
                    event.time_ms = w.at_ms as i64;
                }
                event.identity = w.identity.clone();
                event.session = w.session.clone();
                event.proxy = w.proxy.clone();
                if !w.detail.is_empty() {
                    event.detail = if event.detail.is_empty() {
                        w.detail.clone()
                    } else {
                        format!("{} ({})", event.detail, w.detail)
                    };
                }
            }
            None => {
                if let Some(proxy) = self.proxy_of(event.lease) {
                    event.proxy = proxy.to_owned();
                }
            }
        }
    }

    fn event(
        &mut self,
        change: &Event,
        kv: &KeyValue,
        released: &HashSet<LockName>,
        now_ms: i64,
    ) -> Option<AuditEvent> {
        let put = change.event_type() == EventType::Put;
        let prev = change.prev_kv();
        let blank = |kind: EventKind, name: String| AuditEvent {
            lease: kv.lease(),
            ..AuditEvent::new(kind, name, now_ms)
        };
        let key = kv.key();
        if let Some(name) = keyspace::kv_name(key) {
            let mut event = blank(
                if put {
                    EventKind::KeyWritten
                } else {
                    EventKind::KeyDeleted
                },
                name.to_owned(),
            );
            if put {
                event.detail = cut(kv.value());
            } else if let Some(prev) = prev {
                event.lease = prev.lease();
            }
            return Some(event);
        }
        if put && key == keyspace::force_release_key().as_bytes() {
            if let Ok(forced) = serde_json::from_slice::<ForceRelease>(kv.value()) {
                let mut event = blank(EventKind::ForceReleased, forced.lock);
                event.mode = forced.mode;
                event.token = forced.token;
                event.session = forced.session;
                event.proxy = forced.proxy;
                event.identity = forced.operator;
                event.detail =
                    cut(format!("{} (held by {:?})", forced.reason, forced.holder).as_bytes());
                return Some(event);
            }
        }
        if key == keyspace::admin_writer_key().as_bytes() {
            return None;
        }
        if key.starts_with(b"/sys/") {
            let name = String::from_utf8_lossy(key).into_owned();
            let mut event = blank(EventKind::ConfigChanged, name);
            if put {
                event.detail = cut(kv.value());
                if key == keyspace::epoch_key().as_bytes() {
                    if let Ok(record) = serde_json::from_slice::<EpochRecord>(kv.value()) {
                        self.epochs.insert(kv.mod_revision(), record.epoch);
                        self.epoch = record;
                    }
                }
            } else {
                event.detail = "deleted".to_owned();
            }
            return Some(event);
        }
        let (lock, kind) = keyspace::parse_key(key)?;
        let name = lock.as_str().to_owned();
        match kind {
            KeyKind::Released => None,
            KeyKind::Waiter => {
                if !put || kv.create_revision() != kv.mod_revision() {
                    return None;
                }
                let waiter = String::from_utf8_lossy(kv.value()).into_owned();
                let mut event = blank(EventKind::Waiting, name);
                event.mode = waiter_mode(key).to_owned();
                event.session = waiter.split('-').next().unwrap_or_default().to_owned();
                event.detail = waiter;
                Some(event)
            }
            KeyKind::Exclusive | KeyKind::Shared => {
                let mode = if kind == KeyKind::Exclusive {
                    "exclusive"
                } else {
                    "shared"
                };
                // The holder as it is now (a put) or as it was (a delete).
                let holder = if put { Some(kv) } else { prev };
                let record: Option<HolderRecord> =
                    holder.and_then(|h| serde_json::from_slice(h.value()).ok());
                let record = record.unwrap_or_default();
                let kind = if !put {
                    if released.contains(&lock) {
                        EventKind::Released
                    } else {
                        EventKind::Expired
                    }
                } else if kv.create_revision() == kv.mod_revision() {
                    if record.election {
                        EventKind::LeaderChanged
                    } else {
                        EventKind::Granted
                    }
                } else {
                    let before: Option<HolderRecord> =
                        prev.and_then(|p| serde_json::from_slice(p.value()).ok());
                    match prev {
                        Some(p) if p.lease() != kv.lease() => EventKind::Moved,
                        _ if record.election && before.is_some_and(|b| b.value != record.value) => {
                            EventKind::LeaderChanged
                        }
                        // A retried shared acquire rewriting its own key: nothing new.
                        _ => return None,
                    }
                };
                let mut event = blank(kind, name);
                if matches!(kind, EventKind::Granted | EventKind::LeaderChanged)
                    && record.acquired_at_ms > 0
                    && kv.create_revision() == kv.mod_revision()
                {
                    event.time_ms = record.acquired_at_ms as i64;
                }
                let created = holder.map(KeyValue::create_revision).unwrap_or_default();
                event.mode = mode.to_owned();
                event.token = format!("{}:{created}", self.epoch_of(created));
                event.lease = holder.map(KeyValue::lease).unwrap_or_default();
                event.detail = record.value.clone();
                event.session = record.session;
                // A grant names the proxy that made it; a move, a release or an expiry
                // the proxy the session was on (its lease's), when the trail knows it.
                event.proxy = match kind {
                    EventKind::Granted | EventKind::LeaderChanged => record.proxy,
                    _ => self
                        .proxy_of(event.lease)
                        .map(str::to_owned)
                        .unwrap_or(record.proxy),
                };
                event.zone = record.zone;
                event.identity = record.identity;
                Some(event)
            }
        }
    }
}

fn waiter_mode(key: &[u8]) -> &'static str {
    let key = String::from_utf8_lossy(key);
    if key.contains("/!s/") {
        "shared"
    } else {
        "exclusive"
    }
}

/// A value for `detail`: text, cut to [`DETAIL_BYTES`] on a character boundary.
fn cut(value: &[u8]) -> String {
    let text = String::from_utf8_lossy(value);
    if text.len() <= DETAIL_BYTES {
        return text.into_owned();
    }
    let mut end = DETAIL_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
