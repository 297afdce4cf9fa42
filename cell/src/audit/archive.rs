//! The audit archive: compressed JSON-lines segments in object storage (S3 or a local
//! folder), kept one year or seven by event kind, as evidence that outlives the store.
//!
//! Every flush writes one segment per retention class for the same revision range,
//! empty or not, so each class's newest segment name says how far the archive reaches.
//! Segment paths are `<class>/<YYYY>/<MM>/<DD>/<first:020>-<through:020>.jsonl.gz`.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDate;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::prefix::PrefixStore;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};
use tokio::time::Instant;
use tokio_stream::StreamExt;

use super::{AuditError, AuditEvent, EventKind};

/// The kinds kept seven years unless configured otherwise: who held what, who led, and
/// what the cell was told, plus the record of what the trail missed.
pub const DEFAULT_KINDS_7Y: [EventKind; 7] = [
    EventKind::Granted,
    EventKind::Released,
    EventKind::Expired,
    EventKind::LeaderChanged,
    EventKind::ConfigChanged,
    EventKind::ForceReleased,
    EventKind::Gap,
];

const DAY_MS: i64 = 86_400_000;

/// A retention class: its segments live under its own folder and expire together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    OneYear,
    SevenYears,
}

impl Class {
    pub const ALL: [Class; 2] = [Class::OneYear, Class::SevenYears];

    /// The folder name: `1y` or `7y`.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::OneYear => "1y",
            Class::SevenYears => "7y",
        }
    }

    /// How many days a segment of the class is kept.
    pub fn keep_days(self) -> i64 {
        match self {
            Class::OneYear => 365,
            Class::SevenYears => 7 * 365,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How to reach the archive and what it keeps how long.
#[derive(Debug, Clone)]
pub struct ArchiveOptions {
    /// S3 endpoint for S3-compatible servers (MinIO, moto); `http://` ones are allowed.
    /// Unset: `AWS_ENDPOINT_URL`/`AWS_ENDPOINT`, else AWS itself.
    pub endpoint: Option<String>,
    /// Unset: `AWS_REGION`/`AWS_DEFAULT_REGION`, else `us-east-1`.
    pub region: Option<String>,
    /// Unset: `AWS_ACCESS_KEY_ID`, or the instance's or container's credentials.
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    /// Kinds whose events are kept seven years; every other kind is kept one year.
    pub kinds_7y: Vec<EventKind>,
}

impl Default for ArchiveOptions {
    fn default() -> Self {
        ArchiveOptions {
            endpoint: None,
            region: None,
            access_key_id: None,
            secret_access_key: None,
            kinds_7y: DEFAULT_KINDS_7Y.to_vec(),
        }
    }
}

/// Where a segment is and what it covers, read from its path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    path: Path,
    date: NaiveDate,
    first: i64,
    through: i64,
}

/// Events waiting for the next flush, and the revision range they cover.
#[derive(Debug)]
struct Pending {
    /// The first revision the segment covers: one past what every class held before.
    first: i64,
    /// The highest revision the tailer said the buffered batches cover.
    through: i64,
    /// The time of the segment's first event, which dates it (now, if it has none).
    first_time_ms: Option<i64>,
    /// When the segment began, for `flush_if_due`'s age.
    started: Instant,
    /// The buffered events by class (index [`Class::index`]).
    events: [Vec<AuditEvent>; 2],
}

/// The archive: buffers whole revisions and writes them as segments.
pub struct Archive {
    store: Arc<dyn ObjectStore>,
    /// Where it is, for messages and logs.
    shown: String,
    kinds_7y: HashSet<EventKind>,
    /// Per class, the highest revision its stored segments cover (its checkpoint).
    stored: [i64; 2],
    pending: Option<Pending>,
}

impl std::fmt::Debug for Archive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Archive")
            .field("location", &self.shown)
            .field("stored", &self.stored)
            .finish_non_exhaustive()
    }
}

impl Archive {
    /// Opens the archive `spec` names: `s3://bucket/prefix` is S3 (path-style requests,
    /// credentials from `options` or the usual `AWS_*` variables), anything else a local
    /// folder, created if missing. Reads each class's checkpoint.
    pub async fn open(spec: &str, options: ArchiveOptions) -> Result<Archive, AuditError> {
        let bad = |reason: String| AuditError::BadSpec {
            spec: spec.to_owned(),
            reason,
        };
        let (store, shown): (Arc<dyn ObjectStore>, String) =
            if let Some(rest) = spec.strip_prefix("s3://") {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                let prefix = prefix.trim_matches('/');
                if bucket.is_empty() {
                    return Err(bad("no bucket: write s3://BUCKET/PREFIX".into()));
                }
                let mut builder = AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .with_retry(RetryConfig {
                        backoff: BackoffConfig::default(),
                        max_retries: 3,
                        retry_timeout: Duration::from_secs(30),
                    });
                let mut shown = format!("s3://{bucket}/{prefix}");
                if let Some(endpoint) = &options.endpoint {
                    builder = builder
                        .with_endpoint(endpoint)
                        .with_config(AmazonS3ConfigKey::S3Endpoint, endpoint)
                        .with_allow_http(endpoint.starts_with("http://"));
                    shown = format!("{shown} at {endpoint}");
                }
                if let Some(region) = &options.region {
                    builder = builder.with_region(region);
                }
                if let Some(key) = &options.access_key_id {
                    builder = builder.with_access_key_id(key);
                }
                if let Some(secret) = &options.secret_access_key {
                    builder = builder.with_secret_access_key(secret);
                }
                let s3 = builder.build().map_err(|e| bad(e.to_string()))?;
                let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
                    Arc::new(s3)
                } else {
                    Arc::new(PrefixStore::new(s3, prefix))
                };
                (store, shown)
            } else {
                if spec.is_empty() {
                    return Err(bad("empty; give s3://BUCKET/PREFIX or a folder".into()));
                }
                std::fs::create_dir_all(spec).map_err(|source| AuditError::Io {
                    path: spec.to_owned(),
                    op: "creating the archive folder",
                    source,
                })?;
                let local = LocalFileSystem::new_with_prefix(FsPath::new(spec))
                    .map_err(|e| bad(e.to_string()))?;
                (Arc::new(local), spec.to_owned())
            };
        let mut archive = Archive {
            store,
            shown,
            kinds_7y: options.kinds_7y.into_iter().collect(),
            stored: [0; 2],
            pending: None,
        };
        for class in Class::ALL {
            archive.stored[class.index()] = archive.class_checkpoint(class).await?;
        }
        Ok(archive)
    }

    /// Where the archive is, for logs (no credentials).
    pub fn describe(&self) -> String {
        self.shown.clone()
    }

    /// The class `kind`'s events are kept in.
    pub fn class_of(&self, kind: EventKind) -> Class {
        class_of(&self.kinds_7y, kind)
    }

    /// The highest revision every class covers, from the stored segments' names (0 when
    /// a class has none): the tailer resumes after it, and each class skips what it has.
    pub async fn checkpoint(&self) -> Result<i64, AuditError> {
        let mut lowest = i64::MAX;
        for class in Class::ALL {
            lowest = lowest.min(self.class_checkpoint(class).await?);
        }
        Ok(lowest)
    }

    /// Buffers a batch: `events` sorted by (revision, seq), whole revisions, covering
    /// up to `through`. Events a class already holds (stored or buffered) are skipped.
    pub fn write(&mut self, events: &[AuditEvent], through: i64) {
        let through = events.last().map_or(through, |e| through.max(e.revision));
        let lowest = self.stored.iter().copied().min().unwrap_or(0);
        let covered = self.pending.as_ref().map_or(lowest, |p| p.through);
        if through <= covered {
            // Every class already holds or buffers all of it.
            return;
        }
        // A class skips what its stored segments or the buffer already cover.
        let floors = Class::ALL.map(|c| covered.max(self.stored[c.index()]));
        let pending = self.pending.get_or_insert_with(|| Pending {
            first: lowest + 1,
            through: lowest,
            first_time_ms: None,
            started: Instant::now(),
            events: [Vec::new(), Vec::new()],
        });
        pending.through = through;
        for event in events {
            let class = class_of(&self.kinds_7y, event.kind);
            if event.revision > floors[class.index()] {
                pending.first_time_ms.get_or_insert(event.time_ms);
                pending.events[class.index()].push(event.clone());
            }
        }
    }

    /// Flushes when the buffer holds `max_events` events or is `max_age` old; returns
    /// whether it flushed.
    pub async fn flush_if_due(
        &mut self,
        max_events: usize,
        max_age: Duration,
    ) -> Result<bool, AuditError> {
        let due = match &self.pending {
            None => false,
            Some(p) => {
                p.events.iter().map(Vec::len).sum::<usize>() >= max_events
                    || p.started.elapsed() >= max_age
            }
        };
        if due {
            self.flush().await?;
        }
        Ok(due)
    }

    /// Writes the buffer as one segment per class for its revision range, empty
    /// segments included, skipping a class that already covers the range. On an error
    /// the buffer stays, less the classes already written, and the next flush writes
    /// the rest.
    pub async fn flush(&mut self) -> Result<(), AuditError> {
        let Some(mut pending) = self.pending.take() else {
            return Ok(());
        };
        let written = self.write_segments(&mut pending).await;
        if written.is_err() {
            self.pending = Some(pending);
        }
        written
    }

    async fn write_segments(&mut self, pending: &mut Pending) -> Result<(), AuditError> {
        let time_ms = pending
            .first_time_ms
            .unwrap_or_else(|| chrono::Utc::now().timestamp_millis());
        let date = chrono::DateTime::from_timestamp_millis(time_ms)
            .unwrap_or_default()
            .date_naive();
        for class in Class::ALL {
            let i = class.index();
            if self.stored[i] >= pending.through {
                continue;
            }
            let path = segment_path(class, date, pending.first, pending.through);
            let body = encode(&pending.events[i]).map_err(|source| AuditError::Io {
                path: format!("{} {path}", self.shown),
                op: "compressing a segment",
                source,
            })?;
            self.store
                .put(&path, PutPayload::from(body))
                .await
                .map_err(|source| self.failed("writing a segment", source))?;
            tracing::debug!(archive = %self.shown, segment = %path, events = pending.events[i].len(), "audit segment written");
            self.stored[i] = pending.through;
            pending.events[i].clear();
        }
        Ok(())
    }

    /// Every archived event in (revision, seq) order, each once (segments written
    /// again after a crash between two classes' writes overlap).
    pub async fn read_all(&self) -> Result<Vec<AuditEvent>, AuditError> {
        Ok(self.read_all_checked().await?.0)
    }

    /// [`Archive::read_all`], and what is wrong with the segments: an event (revision
    /// and place) held by two segments (two tailers wrote the same revisions; of each
    /// such event one is kept), or revisions between two segments of a class that no
    /// segment covers. A tailer writes neither: a class's segments follow one another,
    /// and where one overlaps the one before (a flush that failed half-way and was
    /// tried again) it skips the events that one holds.
    pub async fn read_all_checked(&self) -> Result<(Vec<AuditEvent>, Vec<String>), AuditError> {
        let mut events = Vec::new();
        let mut problems = Vec::new();
        let mut holder: std::collections::HashMap<(i64, u32), (Path, AuditEvent)> =
            std::collections::HashMap::new();
        for class in Class::ALL {
            let mut segments = Vec::new();
            let mut listing = self.store.list(Some(&Path::from(class.as_str())));
            while let Some(meta) = listing.next().await {
                let meta = meta.map_err(|source| self.failed("listing segments", source))?;
                segments.extend(parse_segment(&meta.location));
            }
            segments.sort_by_key(|s| (s.first, s.through));
            let mut reached: Option<(i64, &Path)> = None;
            for segment in &segments {
                if let Some((through, before)) = reached {
                    if segment.first > through + 1 {
                        problems.push(format!(
                            "revisions {} to {} are in no segment of class {} (between {before} and {})",
                            through + 1,
                            segment.first - 1,
                            class.as_str(),
                            segment.path
                        ));
                    }
                }
                if reached.is_none_or(|(through, _)| segment.through > through) {
                    reached = Some((segment.through, &segment.path));
                }
                for event in self.read_segment(&segment.path).await? {
                    let at = (event.revision, event.seq);
                    if let Some((other, first)) = holder.get(&at) {
                        problems.push(format!(
                            "revision {} place {} is in both {other} and {}{}",
                            at.0,
                            at.1,
                            segment.path,
                            if *first == event {
                                " (the same event)"
                            } else {
                                " (two different events)"
                            }
                        ));
                        continue;
                    }
                    holder.insert(at, (segment.path.clone(), event.clone()));
                    events.push(event);
                }
            }
        }
        events.sort_by_key(|e| (e.revision, e.seq));
        Ok((events, problems))
    }

    /// Deletes the segments dated more than 365 days (class `1y`) or 7 × 365 days
    /// (class `7y`) before the UTC day of `now_ms`, except each class's newest (its
    /// checkpoint), and returns how many SEGMENTS went.
    pub async fn expire(&self, now_ms: i64) -> Result<u64, AuditError> {
        let today = now_ms.div_euclid(DAY_MS);
        let mut removed = 0;
        for class in Class::ALL {
            let checkpoint = self.class_checkpoint(class).await?;
            let cutoff = day_number(today - class.keep_days());
            for (date, folder) in self.day_folders(class).await? {
                if date >= cutoff {
                    continue;
                }
                for segment in self.segments_in(&folder).await? {
                    if segment.through >= checkpoint {
                        continue;
                    }
                    self.store
                        .delete(&segment.path)
                        .await
                        .map_err(|source| self.failed("deleting an old segment", source))?;
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// The highest `through` among `class`'s segments, 0 when it has none. Only the two
    /// newest day folders are read: a segment is dated by its first event's time, which
    /// may lag the one before by a little across midnight, not by days.
    async fn class_checkpoint(&self, class: Class) -> Result<i64, AuditError> {
        let days = self.day_folders(class).await?;
        let mut highest = 0;
        for (_, folder) in days.iter().rev().take(2) {
            for segment in self.segments_in(folder).await? {
                highest = highest.max(segment.through);
            }
        }
        Ok(highest)
    }

    /// `class`'s `YYYY/MM/DD` folders, oldest first.
    async fn day_folders(&self, class: Class) -> Result<Vec<(NaiveDate, Path)>, AuditError> {
        let mut days = Vec::new();
        for year in self.subfolders(&Path::from(class.as_str())).await? {
            for month in self.subfolders(&year).await? {
                for day in self.subfolders(&month).await? {
                    let parts: Vec<_> = day.parts().collect();
                    let text = match parts.as_slice() {
                        [.., y, m, d] => format!("{}-{}-{}", y.as_ref(), m.as_ref(), d.as_ref()),
                        _ => continue,
                    };
                    if let Ok(date) = NaiveDate::parse_from_str(&text, "%Y-%m-%d") {
                        days.push((date, day));
                    }
                }
            }
        }
        days.sort();
        Ok(days)
    }

    async fn subfolders(&self, folder: &Path) -> Result<Vec<Path>, AuditError> {
        let listing = self
            .store
            .list_with_delimiter(Some(folder))
            .await
            .map_err(|source| self.failed("listing folders", source))?;
        Ok(listing.common_prefixes)
    }

    /// The segments directly in a day folder (other objects are ignored).
    async fn segments_in(&self, folder: &Path) -> Result<Vec<Segment>, AuditError> {
        let listing = self
            .store
            .list_with_delimiter(Some(folder))
            .await
            .map_err(|source| self.failed("listing segments", source))?;
        Ok(listing
            .objects
            .iter()
            .filter_map(|meta| parse_segment(&meta.location))
            .collect())
    }

    async fn read_segment(&self, path: &Path) -> Result<Vec<AuditEvent>, AuditError> {
        let bytes = self
            .store
            .get(path)
            .await
            .map_err(|source| self.failed("reading a segment", source))?
            .bytes()
            .await
            .map_err(|source| self.failed("reading a segment", source))?;
        let bad = |reason: String| AuditError::BadSegment {
            location: self.shown.clone(),
            path: path.to_string(),
            reason,
        };
        let mut text = String::new();
        GzDecoder::new(&bytes[..])
            .read_to_string(&mut text)
            .map_err(|e| bad(format!("not gzip text: {e}")))?;
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.is_empty())
            .map(|(i, line)| {
                serde_json::from_str(line).map_err(|e| bad(format!("line {}: {e}", i + 1)))
            })
            .collect()
    }

    fn failed(&self, op: &'static str, source: object_store::Error) -> AuditError {
        AuditError::ObjectStore {
            location: self.shown.clone(),
            op,
            source,
        }
    }
}

fn class_of(kinds_7y: &HashSet<EventKind>, kind: EventKind) -> Class {
    if kinds_7y.contains(&kind) {
        Class::SevenYears
    } else {
        Class::OneYear
    }
}

/// `<class>/<YYYY>/<MM>/<DD>/<first:020>-<through:020>.jsonl.gz`.
fn segment_path(class: Class, date: NaiveDate, first: i64, through: i64) -> Path {
    Path::from(format!(
        "{}/{}/{first:020}-{through:020}.jsonl.gz",
        class.as_str(),
        date.format("%Y/%m/%d")
    ))
}

/// The segment a path names, or `None` for anything else.
fn parse_segment(path: &Path) -> Option<Segment> {
    let parts: Vec<_> = path.parts().collect();
    let [.., y, m, d, name] = parts.as_slice() else {
        return None;
    };
    let date = NaiveDate::parse_from_str(
        &format!("{}-{}-{}", y.as_ref(), m.as_ref(), d.as_ref()),
        "%Y-%m-%d",
    )
    .ok()?;
    let (first, through) = name.as_ref().strip_suffix(".jsonl.gz")?.split_once('-')?;
    Some(Segment {
        path: path.clone(),
        date,
        first: first.parse().ok()?,
        through: through.parse().ok()?,
    })
}

/// Events as gzip-compressed JSON lines (an empty segment is an empty gzip stream).
fn encode(events: &[AuditEvent]) -> std::io::Result<Vec<u8>> {
    let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
    for event in events {
        serde_json::to_writer(&mut gz, event)?;
        gz.write_all(b"\n")?;
    }
    gz.finish()
}

/// The date of a day number (days since the Unix epoch).
fn day_number(days: i64) -> NaiveDate {
    chrono::DateTime::from_timestamp_millis(days * DAY_MS)
        .unwrap_or_default()
        .date_naive()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::store::tests::event;

    const DAY: i64 = DAY_MS;

    fn of_kind(kind: EventKind, mut e: AuditEvent) -> AuditEvent {
        e.kind = kind;
        e
    }

    /// A lock event (class 7y) and a key event (class 1y).
    fn grant(rev: i64, time_ms: i64) -> AuditEvent {
        event(rev, 0, time_ms, "lock")
    }
    fn key(rev: i64, time_ms: i64) -> AuditEvent {
        of_kind(EventKind::KeyWritten, event(rev, 0, time_ms, "key"))
    }
    /// The same event as the second of its revision.
    fn second(mut e: AuditEvent) -> AuditEvent {
        e.seq = 1;
        e
    }

    async fn open(dir: &FsPath) -> Archive {
        Archive::open(dir.to_str().unwrap(), ArchiveOptions::default())
            .await
            .unwrap()
    }

    /// Every segment file under the archive folder, as `class/YYYY/MM/DD/name`.
    fn files(dir: &FsPath) -> Vec<String> {
        fn walk(root: &FsPath, dir: &FsPath, out: &mut Vec<String>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(root, &path, out);
                } else {
                    out.push(path.strip_prefix(root).unwrap().display().to_string());
                }
            }
        }
        let mut out = Vec::new();
        walk(dir, dir, &mut out);
        out.sort();
        out
    }

    fn name(first: i64, through: i64) -> String {
        format!("{first:020}-{through:020}.jsonl.gz")
    }

    #[tokio::test]
    async fn each_flush_writes_one_segment_per_class_even_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut archive = open(dir.path()).await;
        assert_eq!(archive.checkpoint().await.unwrap(), 0);
        let day = 20_000 * DAY; // 2024-10-04
        let first = [grant(3, day + 1), second(key(3, day + 1)), key(7, day + 2)];
        archive.write(&first, 9);
        archive.flush().await.unwrap();
        // Only lock events this time: class 1y gets an empty segment for 10..=20.
        archive.write(&[grant(15, day + DAY)], 20);
        archive.flush().await.unwrap();
        assert_eq!(
            files(dir.path()),
            [
                format!("1y/2024/10/04/{}", name(1, 9)),
                format!("1y/2024/10/05/{}", name(10, 20)),
                format!("7y/2024/10/04/{}", name(1, 9)),
                format!("7y/2024/10/05/{}", name(10, 20)),
            ]
        );
        let empty = archive
            .read_segment(&segment_path(Class::OneYear, day_number(20_001), 10, 20))
            .await
            .unwrap();
        assert!(empty.is_empty());
        assert_eq!(archive.checkpoint().await.unwrap(), 20);
        let mut all = first.to_vec();
        all.push(grant(15, day + DAY));
        assert_eq!(archive.read_all().await.unwrap(), all);

        // A replay of covered revisions buffers nothing.
        archive.write(&first, 9);
        assert!(!archive.flush_if_due(0, Duration::ZERO).await.unwrap());
        assert_eq!(files(dir.path()).len(), 4);
    }

    #[tokio::test]
    async fn a_flush_is_due_by_count_or_age_and_may_cover_no_events() {
        let dir = tempfile::tempdir().unwrap();
        let mut archive = open(dir.path()).await;
        let hour = Duration::from_secs(3600);
        assert!(!archive.flush_if_due(1, Duration::ZERO).await.unwrap());
        archive.write(&[key(2, DAY), key(4, DAY)], 5);
        assert!(!archive.flush_if_due(3, hour).await.unwrap());
        assert!(archive.flush_if_due(2, hour).await.unwrap());
        // Only `through` moves: still covered, by two empty segments.
        archive.write(&[], 8);
        assert!(archive.flush_if_due(1_000, Duration::ZERO).await.unwrap());
        assert_eq!(archive.checkpoint().await.unwrap(), 8);
        assert_eq!(files(dir.path()).len(), 4);
    }

    #[tokio::test]
    async fn a_crash_between_class_writes_is_replayed_without_loss_or_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let day = 20_000 * DAY;
        let before = [grant(2, day), key(3, day)];
        let lost = [
            grant(12, day + 5),
            key(13, day + 6),
            second(key(14, day + 6)),
        ];
        let after = [grant(21, day + 9), key(22, day + 9)];
        {
            let mut archive = open(dir.path()).await;
            archive.write(&before, 10);
            archive.flush().await.unwrap();
            // The crash: of the flush covering 11..=20, only class 7y's object landed.
            archive.write(&lost, 20);
            let pending = archive.pending.take().unwrap();
            let date = day_number(20_000);
            let body = encode(&pending.events[Class::SevenYears.index()]).unwrap();
            let path = segment_path(Class::SevenYears, date, 11, 20);
            archive.store.put(&path, body.into()).await.unwrap();
        }
        let mut archive = open(dir.path()).await;
        assert_eq!(archive.stored, [10, 20]);
        assert_eq!(archive.checkpoint().await.unwrap(), 10);
        // The tailer restarts after 10 and sends 11..=20 again, then more.
        archive.write(&lost, 20);
        archive.write(&after, 25);
        archive.flush().await.unwrap();
        assert_eq!(archive.checkpoint().await.unwrap(), 25);

        let mut expected = before.to_vec();
        expected.extend(lost);
        expected.extend(after);
        assert_eq!(archive.read_all().await.unwrap(), expected);
        // No event was stored twice, even before read_all's dedup.
        let mut stored = 0;
        for file in files(dir.path()) {
            stored += archive.read_segment(&Path::from(file)).await.unwrap().len();
        }
        assert_eq!(stored, expected.len());
    }

    #[tokio::test]
    async fn expire_deletes_by_class_age_but_keeps_each_newest() {
        let dir = tempfile::tempdir().unwrap();
        let mut archive = open(dir.path()).await;
        let today = 20_000;
        for (through, days_ago) in [(10, 3_000), (20, 400), (30, 0)] {
            let t = (today - days_ago) * DAY;
            archive.write(&[grant(through - 1, t), key(through, t)], through);
            archive.flush().await.unwrap();
        }
        // 1y: 3000 and 400 days old go; 7y: only the one 3000 days old goes.
        assert_eq!(archive.expire(today * DAY + 1).await.unwrap(), 3);
        let left = files(dir.path());
        assert_eq!(left.len(), 3, "{left:?}");
        assert!(left
            .iter()
            .any(|f| f.starts_with("7y/") && f.ends_with(&name(11, 20))));
        assert_eq!(archive.checkpoint().await.unwrap(), 30);

        // Ten years on, each class keeps its newest segment: the checkpoint stands.
        assert_eq!(archive.expire((today + 3_650) * DAY).await.unwrap(), 1);
        assert_eq!(files(dir.path()).len(), 2);
        assert_eq!(archive.checkpoint().await.unwrap(), 30);
    }

    #[tokio::test]
    async fn kinds_go_to_the_configured_class_and_bad_specs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let options = ArchiveOptions {
            kinds_7y: vec![EventKind::KeyWritten],
            ..ArchiveOptions::default()
        };
        let archive = Archive::open(dir.path().to_str().unwrap(), options)
            .await
            .unwrap();
        assert_eq!(archive.class_of(EventKind::KeyWritten), Class::SevenYears);
        assert_eq!(archive.class_of(EventKind::Granted), Class::OneYear);
        let err = Archive::open("s3:///prefix", ArchiveOptions::default())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("no bucket"), "{err}");
    }

    #[test]
    fn segment_names_round_trip() {
        let path = segment_path(Class::SevenYears, day_number(20_000), 11, 20);
        assert_eq!(path.as_ref(), format!("7y/2024/10/04/{}", name(11, 20)));
        let segment = parse_segment(&path).unwrap();
        assert_eq!((segment.first, segment.through), (11, 20));
        assert_eq!(segment.date, day_number(20_000));
        assert!(parse_segment(&Path::from("7y/2024/10/04/README")).is_none());
    }
}
