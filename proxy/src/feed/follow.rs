//! Keeping the copy current: loading the small keys from etcd, then following etcd's
//! watch from the revision loaded, loading again when the watch cannot go on.

use super::*;

/// Loads the mirror and follows the cell for as long as the proxy runs. When the watch
/// cannot resume where it broke (the log was compacted meanwhile), every watcher is told
/// and the mirror is loaded again.
pub async fn run(feed: Arc<Feed>, kv: KvClient, watch: WatchClient, timeout: Duration) {
    let mut watch = watch.max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES);
    let mut kv = kv.max_decoding_message_size(MAX_WATCH_MESSAGE_BYTES);
    let pause = Duration::from_millis(300);
    loop {
        let loaded = match load(&mut kv, timeout).await {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::warn!(error = %e, "could not load the small keys; retrying");
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        tracing::info!(
            keys = loaded.0.len(),
            revision = loaded.0.revision(),
            "small keys loaded; following the cell"
        );
        feed.load(loaded);
        follow(&feed, &mut watch, &mut kv, timeout, pause).await;
        feed.live.send_replace(false);
        feed.fanout.end_all(End::FeedLost);
        ::metrics::counter!(metrics::FEED_RELOADS).increment(1);
    }
}

/// Follows the cell from the mirror's revision until the proxy can no longer trust
/// what it saw: a compaction passed it, etcd skipped revisions, the store's revision
/// went back (a restore from backup), the watch stalled, or kept failing.
pub(super) async fn follow(
    feed: &Feed,
    client: &mut WatchClient,
    kv: &mut KvClient,
    timeout: Duration,
    pause: Duration,
) {
    let mut failures = 0;
    loop {
        // From the revision applied last, not the one after: etcd accepts a watch that
        // starts exactly at its compact revision, but has dropped the deletes made at
        // that revision. Starting one revision early makes a compaction at the first
        // revision the proxy still needs a refused watch (a reload), and the events
        // delivered again at `applied` are skipped by `Feed::apply`.
        let from = feed.applied();
        if failures > 0 && must_reload(kv, timeout, from, failures).await {
            return;
        }
        failures += 1;
        let options = WatchOptions::new()
            .with_all_keys()
            .with_start_revision(from);
        let mut stream = match client.watch(vec![0u8], Some(options)).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, from, "the cell watch could not start; retrying");
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        // Counted until the pause after it ends is over, as the stream is held.
        let _counted = crate::metrics::Counted::in_gauge(crate::metrics::ETCD_WATCHES);
        if !apply_stream(feed, &mut stream, from, &mut failures).await {
            return;
        }
        tokio::time::sleep(pause).await;
    }
}

/// Whether the cell watch, failed `failures` times in a row, must give way to a
/// reload: it keeps failing, or the store's revision went back past `from`.
async fn must_reload(kv: &mut KvClient, timeout: Duration, from: i64, failures: u32) -> bool {
    if failures >= RESTARTS_BEFORE_RELOAD {
        tracing::warn!(from, failures, "the cell watch keeps failing; reloading");
        return true;
    }
    match store_revision(kv, timeout).await {
        Ok(now) if now < from => {
            tracing::warn!(
                applied = from,
                store = now,
                "the store's revision went back (restored from a backup?); reloading"
            );
            return true;
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the store's revision"),
    }
    false
}

/// Applies what the cell watch `stream` (from `from`) delivers until it ends: true to
/// start it again, false to reload. A message applied resets `failures`.
async fn apply_stream(
    feed: &Feed,
    stream: &mut etcd_client::WatchStream,
    from: i64,
    failures: &mut u32,
) -> bool {
    loop {
        let message = tokio::select! {
            message = stream.message() => message,
            _ = feed.stalled.notified() => {
                tracing::warn!(
                    applied = feed.applied(),
                    "reads waited in vain for the cell watch; reloading"
                );
                return false;
            }
        };
        match message {
            Ok(Some(resp)) if resp.compact_revision() > 0 => {
                tracing::warn!(
                    from,
                    compacted = resp.compact_revision(),
                    "the cell's log was compacted past the proxy's position; reloading"
                );
                return false;
            }
            Ok(Some(resp)) if resp.canceled() => {
                tracing::warn!(
                    reason = resp.cancel_reason(),
                    "the cell watch was cancelled; restarting"
                );
                return true;
            }
            Ok(Some(resp)) => match feed.apply(resp.events()) {
                Ok(()) => *failures = 0,
                Err(gap) => {
                    tracing::warn!(%gap, "reloading");
                    ::metrics::counter!(metrics::FEED_GAPS).increment(1);
                    return false;
                }
            },
            Ok(None) => return true,
            Err(e) => {
                tracing::warn!(error = %e, "the cell watch broke; restarting");
                return true;
            }
        }
    }
}

/// The store's revision now (a linearizable read).
pub(super) async fn store_revision(kv: &mut KvClient, timeout: Duration) -> Result<i64, CellError> {
    let resp = with_timeout(
        "read revision",
        timeout,
        kv.get(
            keyspace::epoch_key(),
            Some(GetOptions::new().with_count_only()),
        ),
    )
    .await?;
    header_revision(resp.header(), "read revision")
}

/// Reads every small key at one revision, a page at a time, and the cell's shard map
/// copy at that revision.
pub(super) async fn load(
    kv: &mut KvClient,
    timeout: Duration,
) -> Result<(Mirror, Option<etcd_client::KeyValue>), CellError> {
    let mut entries = Vec::new();
    let root = keyspace::kv_root().as_bytes();
    let revision = load_range(kv, root, 0, timeout, |kv| {
        match keyspace::kv_name(kv.key()) {
            Some(name) => entries.push(entry(name, kv)),
            None => {
                // Written before keys had to be text, or around lockcell: reads and
                // watches of now do not show it.
                tracing::warn!(
                    key = %String::from_utf8_lossy(kv.key()),
                    "a small key that is not UTF-8 text is left out of the proxy's copy; rename or delete it"
                );
            }
        }
    })
    .await?;
    // Each key's client lease, from its record when the record is about the key's
    // last write.
    let mut records: std::collections::HashMap<String, (i64, i64)> =
        std::collections::HashMap::new();
    let root = keyspace::etcd_leased_root().as_bytes();
    load_range(kv, root, revision, timeout, |kv| {
        if let Some(name) = keyspace::etcd_leased_name(kv.key()) {
            records.insert(
                name.to_owned(),
                (record_lease(kv.value()), kv.mod_revision()),
            );
        }
    })
    .await?;
    for entry in &mut entries {
        if let Some((lease, written)) = records.get(&entry.name) {
            if entry.lease != 0 && *written == entry.mod_revision {
                entry.client_lease = *lease;
            }
        }
    }
    let map = with_timeout(
        "load shard map copy",
        timeout,
        kv.get(
            keyspace::shardmap_key(),
            Some(GetOptions::new().with_revision(revision)),
        ),
    )
    .await?;
    let map = map.kvs().first().cloned();
    let records = records
        .into_iter()
        .map(|(name, (_, written))| (name, written));
    let mut owners = Vec::new();
    let root = keyspace::owner_root().as_bytes();
    load_range(kv, root, revision, timeout, |kv| {
        if let Some(name) = keyspace::owner_name(kv.key()) {
            let identity = String::from_utf8_lossy(kv.value()).into_owned();
            owners.push((name.to_owned(), (identity, kv.mod_revision())));
        }
    })
    .await?;
    let mirror = Mirror::new(entries, revision)
        .with_records(records)
        .with_owners(owners);
    Ok((mirror, map))
}

/// Reads every key under `root` at `revision` (0: now) in pages, handing each to `take`;
/// returns the revision read at.
pub(super) async fn load_range(
    kv: &mut KvClient,
    root: &[u8],
    mut revision: i64,
    timeout: Duration,
    mut take: impl FnMut(&etcd_client::KeyValue),
) -> Result<i64, CellError> {
    let end = prefix_end(root);
    let mut start = root.to_vec();
    loop {
        let options = GetOptions::new()
            .with_range(end.clone())
            .with_limit(LOAD_PAGE)
            .with_revision(revision)
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        let resp = with_timeout(
            "load small keys",
            timeout,
            kv.get(start.clone(), Some(options)),
        )
        .await?;
        if revision == 0 {
            revision = header_revision(resp.header(), "load small keys")?;
        }
        resp.kvs().iter().for_each(&mut take);
        match (resp.more(), resp.kvs().last()) {
            (true, Some(last)) => {
                start = last.key().to_vec();
                start.push(0);
            }
            _ => return Ok(revision),
        }
    }
}
