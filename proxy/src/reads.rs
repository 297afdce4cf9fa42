//! Small-key reads: linearizable ones through the read barrier and the mirror,
//! serializable ones from the mirror alone, historical ones from etcd.
//!
//! When the mirror is not live (loading, or reloading after a compaction) or lags the
//! barrier by more than the etcd timeout, reads go to etcd directly: slower, never
//! staler.

use std::sync::Arc;
use std::time::Duration;

use lockcell_cell::keyspace::{self, LockName};
use lockcell_cell::kv::{Kv, Read};

use crate::barrier::Barrier;
use crate::errors::ProxyError;
use crate::feed::Feed;
use crate::metrics;
use crate::mirror::Topic;
use crate::routes::Routes;

/// The proxy's small-key reads.
pub struct Reads {
    pub feed: Arc<Feed>,
    pub barrier: Barrier,
    kv: Kv,
    timeout: Duration,
    /// The cell's copy of the shard map, which the feed keeps as of what it applied.
    routes: Arc<Routes>,
    /// For reading the copy after a read that bypassed the feed.
    etcd: etcd_client::KvClient,
    /// The revision etcd was last found to keep history from, and when that look began.
    history: tokio::sync::Mutex<Option<(i64, tokio::time::Instant)>>,
}

/// A key's or prefix's topic, with the key rules checked (errors say "key").
pub fn topic(key: &str, prefix: bool) -> Result<Topic, ProxyError> {
    let bad = |e: keyspace::NameError| {
        ProxyError::BadArgument(e.to_string().replacen("lock name", "key", 1))
    };
    let name = if prefix {
        let full = keyspace::kv_prefix(key).map_err(bad)?;
        keyspace::kv_name(full.as_bytes())
            .expect("kv_prefix starts at the small-key root")
            .to_owned()
    } else {
        LockName::parse(key).map_err(bad)?.as_str().to_owned()
    };
    Ok(Topic { name, prefix })
}

impl Reads {
    pub fn new(
        feed: Arc<Feed>,
        barrier: Barrier,
        kv: Kv,
        timeout: Duration,
        routes: Arc<Routes>,
        etcd: etcd_client::KvClient,
    ) -> Reads {
        Reads {
            feed,
            barrier,
            kv,
            timeout,
            routes,
            etcd,
            history: tokio::sync::Mutex::new(None),
        }
    }

    /// Whether etcd still keeps the cell's history from `revision` on, so a watch from
    /// `revision + 1` that the fan-out's own history can serve is one etcd would serve
    /// too (etcd refuses a watch from before its compaction, and so does the proxy).
    /// A serializable read at `revision` tells. Looks are made one at a time, and one
    /// that began after a caller asked answers it too when it was at or before the
    /// caller's revision: a compaction finished before the call is always seen, and a
    /// crowd of watchers resuming costs etcd a few reads. False when etcd cannot be
    /// asked: the caller then reads etcd's history itself, which says what is wrong.
    pub async fn history_kept_from(&self, revision: i64) -> bool {
        let revision = revision.max(1);
        let asked = tokio::time::Instant::now();
        let mut last = self.history.lock().await;
        if last.is_some_and(|(from, began)| from <= revision && began > asked) {
            return true;
        }
        let began = tokio::time::Instant::now();
        let options = etcd_client::GetOptions::new()
            .with_revision(revision)
            .with_serializable()
            .with_count_only();
        let mut etcd = self.etcd.clone();
        let look = etcd.get(keyspace::epoch_key(), Some(options));
        let kept = matches!(tokio::time::timeout(self.timeout, look).await, Ok(Ok(_)));
        if kept {
            *last = Some((revision, began));
        }
        kept
    }

    /// A revision no older than every write that finished before the call.
    pub async fn barrier(&self) -> Result<i64, ProxyError> {
        self.barrier
            .revision()
            .await
            .map_err(ProxyError::EtcdUnavailable)
    }

    /// One key or a prefix, as of now (or as of `revision` when it is not 0), with the
    /// read's position: the cell its revision is of (see [`Routes::position`]).
    ///
    /// A read at a revision names the cell that revision came from (`cell`; empty: the
    /// caller does not say): when the names' position is another now (their prefix
    /// moved, or the cell was restored), revisions of the two are unrelated and the
    /// read is refused with OUT_OF_RANGE.
    pub async fn get(
        &self,
        key: &str,
        prefix: bool,
        limit: i64,
        (revision, cell): (i64, &str),
        serializable: bool,
    ) -> Result<(Read, String), ProxyError> {
        let topic = topic(key, prefix)?;
        if revision > 0 {
            // Checked before (a revision of another cell means nothing here, in the
            // future or not) and after the read (a move that began meanwhile is seen).
            self.same_cell(key, (revision, cell), &topic)?;
            let now = self.barrier().await?;
            if revision > now {
                return Err(ProxyError::BadArgument(format!(
                    "read of {key:?} at revision {revision}: that revision is in the future (the store is at {now})"
                )));
            }
            let mut read = self.direct(key, prefix, limit, revision, false).await?;
            let position = self.same_cell(key, (revision, cell), &topic)?;
            // etcd answers with the store's revision now; the answer reflects the one
            // asked for.
            read.revision = revision;
            return Ok((read, position));
        }
        if serializable {
            let position = self.routes.position(&topic.name, prefix);
            if self.feed.is_live() {
                return Ok((self.mirror_read(&topic, limit, "mirror"), position));
            }
            let read = self.direct(key, prefix, limit, 0, true).await?;
            return Ok((read, position));
        }
        if self.feed.is_live() {
            let at = self.barrier().await?;
            if self.feed.applied_through(at, self.timeout).await {
                // The feed keeps the cell's map copy as of what it applied: this check
                // sees every move that began before the read did.
                let position = self.routes.read_here(&topic.name, prefix)?;
                return Ok((self.mirror_read(&topic, limit, "barrier"), position));
            }
            self.feed.report_stall();
        }
        let read = self.direct(key, prefix, limit, 0, false).await?;
        // A copy read after the data: as new as the data at least.
        self.routes
            .refresh(&mut self.etcd.clone(), self.timeout)
            .await
            .map_err(ProxyError::from)?;
        let position = self.routes.read_here(&topic.name, prefix)?;
        Ok((read, position))
    }

    /// The names' position now, unless the caller's `cell` (when it names one) is
    /// another, or `revision` is from before it began: then `revision` is another
    /// position's.
    fn same_cell(
        &self,
        key: &str,
        (revision, cell): (i64, &str),
        topic: &Topic,
    ) -> Result<String, ProxyError> {
        let place = self.routes.place(&topic.name, topic.prefix);
        if !cell.is_empty() {
            crate::routes::check_position_syntax(cell)?;
            let what = || format!("read of {key:?} at revision {revision}");
            if cell != place.position {
                return Err(ProxyError::OtherCell {
                    what: what(),
                    was: cell.to_owned(),
                    now: place.position,
                });
            }
            if revision < place.since {
                return Err(ProxyError::BeforePosition {
                    what: what(),
                    revision,
                    since: place.since,
                    now: place.position,
                });
            }
        }
        Ok(place.position)
    }

    fn mirror_read(&self, topic: &Topic, limit: i64, path: &'static str) -> Read {
        ::metrics::counter!(metrics::KV_READS, "path" => path).increment(1);
        self.feed.with_mirror(|m| {
            let (entries, more) = m.read(topic, limit);
            Read {
                entries,
                revision: m.revision(),
                more,
            }
        })
    }

    async fn direct(
        &self,
        key: &str,
        prefix: bool,
        limit: i64,
        revision: i64,
        serializable: bool,
    ) -> Result<Read, ProxyError> {
        ::metrics::counter!(metrics::KV_READS, "path" => "etcd").increment(1);
        self.kv
            .get(key, prefix, limit, revision, serializable)
            .await
            .map_err(|e| match e {
                e if e.to_string().contains("compacted") => ProxyError::OutOfRange(format!(
                    "read of {key:?} at revision {revision}: that revision is compacted (etcd keeps history only since its last compaction)"
                )),
                e => ProxyError::from(e),
            })
    }
}
