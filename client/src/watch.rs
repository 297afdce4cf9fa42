//! Watches on small keys: a [`Watcher`] follows a key or a prefix through the proxy's
//! fan-out and resumes across broken streams (a restarted proxy, a lost connection) so
//! the application sees every revision once, in order.
//!
//! The bookkeeping is `position::Position`, a pure data structure: what the application
//! has been given, and what a response adds to it. [`Watcher`] only moves bytes and
//! retries.

mod position;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use lockcell_proto::v1::watch_client::WatchClient;
use lockcell_proto::v1::{WatchRequest, WatchResponse};
use tokio::time::Instant;
use tonic::{Code, Status, Streaming};

use crate::client::{Client, UNARY_TIMEOUT};
use crate::error::{no_answer, Call, Error, ErrorKind};
use crate::kv::Entry;
use crate::stream::{Steps, Stream};

use self::position::Position;

/// Reconnection pace after a broken stream: quick at first (a restarted proxy is back
/// within a second), never slower than every two seconds.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// How long a (re)opened watch may take to say it is set up. The proxy answers at once
/// unless it cannot serve, so this only bounds a proxy that hangs.
const CREATED_TIMEOUT: Duration = UNARY_TIMEOUT;

/// What to watch and how.
///
/// ```
/// use std::time::Duration;
///
/// use lockcell_client::WatchOptions;
///
/// // Every key under `config/rates/`, with the value each change replaced, and a
/// // progress batch after a minute of quiet.
/// let opts = WatchOptions::prefix()
///     .with_prev_kv()
///     .with_progress(Duration::from_secs(60));
/// assert!(opts.prefix && opts.prev_kv);
/// assert_eq!(opts.start_revision, 0); // from now
/// assert_eq!(opts.reconnect_for, Duration::from_secs(30)); // the default
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchOptions {
    /// Watch every key starting with the given key rather than that one key.
    pub prefix: bool,
    /// Deliver every event from this revision on (0: from now). Pass the revision of a
    /// read + 1 to follow on from that read with nothing missed.
    pub start_revision: i64,
    /// Deliver each event's previous value as well ([`WatchEvent::prev`]).
    pub prev_kv: bool,
    /// Ask for an empty [`WatchBatch`] after this long without events, so a quiet watch
    /// still shows it is alive and up to date.
    pub progress_interval: Option<Duration>,
    /// Required to watch the empty prefix, i.e. every small key (a guard against doing
    /// so by accident).
    pub all_keys: bool,
    /// For how long after a stream breaks the watcher keeps trying to resume it before
    /// [`Watcher::next`] gives up with [`Error::Unavailable`].
    pub reconnect_for: Duration,
    /// The cell `start_revision` is a revision of (set by [`WatchOptions::after`];
    /// empty: whichever cell serves the key now).
    pub(crate) cell: String,
}

impl Default for WatchOptions {
    /// One key, from now, no previous values, no progress, resumed for up to 30 s.
    fn default() -> Self {
        WatchOptions {
            prefix: false,
            start_revision: 0,
            prev_kv: false,
            progress_interval: None,
            all_keys: false,
            reconnect_for: Duration::from_secs(30),
            cell: String::new(),
        }
    }
}

impl WatchOptions {
    /// Watch every key under the given prefix: `client.watch("config/",
    /// WatchOptions::prefix())`.
    ///
    /// ```
    /// use lockcell_client::WatchOptions;
    ///
    /// let opts = WatchOptions::prefix();
    /// assert!(opts.prefix);
    /// assert!(!WatchOptions::default().prefix); // one key
    /// ```
    pub fn prefix() -> Self {
        WatchOptions {
            prefix: true,
            ..WatchOptions::default()
        }
    }

    /// Deliver every event from `revision` on. (After [`after`](WatchOptions::after),
    /// the cell it named still holds: the revision is checked against it.)
    ///
    /// ```
    /// use lockcell_client::WatchOptions;
    ///
    /// // The rate loader applied everything up to revision 4521: go on from the next one.
    /// // (A bare revision is checked against no cell; `after` checks a `CellRevision`.)
    /// let opts = WatchOptions::prefix().from_revision(4522);
    /// assert_eq!(opts.start_revision, 4522);
    /// ```
    pub fn from_revision(self, revision: i64) -> Self {
        WatchOptions {
            start_revision: revision,
            ..self
        }
    }

    /// Deliver each event's previous value as well.
    ///
    /// ```
    /// use lockcell_client::WatchOptions;
    ///
    /// // Each event then carries the value it replaced (`WatchEvent::prev`).
    /// let opts = WatchOptions::prefix().with_prev_kv();
    /// assert!(opts.prev_kv);
    /// ```
    pub fn with_prev_kv(self) -> Self {
        WatchOptions {
            prev_kv: true,
            ..self
        }
    }

    /// Ask for a progress batch after `every` without events.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use lockcell_client::WatchOptions;
    ///
    /// // A quiet watch of the rates still says every 30 s that it is up to date.
    /// let opts = WatchOptions::prefix().with_progress(Duration::from_secs(30));
    /// assert_eq!(opts.progress_interval, Some(Duration::from_secs(30)));
    /// ```
    pub fn with_progress(self, every: Duration) -> Self {
        WatchOptions {
            progress_interval: Some(every),
            ..self
        }
    }

    /// Allow watching the empty prefix (every small key).
    ///
    /// ```
    /// use lockcell_client::WatchOptions;
    ///
    /// // A backup of every small key of the cell: `client.watch("", opts)`.
    /// let opts = WatchOptions::prefix().allow_all_keys();
    /// assert!(opts.prefix && opts.all_keys);
    /// ```
    pub fn allow_all_keys(self) -> Self {
        WatchOptions {
            all_keys: true,
            ..self
        }
    }

    /// Keep resuming a broken stream for up to `d`.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use lockcell_client::WatchOptions;
    ///
    /// // Report a cell out of reach after 5 s rather than 30 s.
    /// let opts = WatchOptions::prefix().reconnecting_for(Duration::from_secs(5));
    /// assert_eq!(opts.reconnect_for, Duration::from_secs(5));
    /// ```
    pub fn reconnecting_for(self, d: Duration) -> Self {
        WatchOptions {
            reconnect_for: d,
            ..self
        }
    }

    /// Deliver every event after `at` (a [`Snapshot`](crate::Snapshot)'s, or a
    /// [`Watcher::at`] saved earlier): from its revision + 1, in its cell. If another
    /// cell serves the key now (its prefix moved, or the cell was restored from a
    /// backup), the watch ends with [`Error::WatchMoved`] rather than read one cell's
    /// revision in another.
    ///
    /// ```
    /// # fn main() -> Result<(), String> {
    /// use lockcell_client::{CellRevision, WatchOptions};
    ///
    /// // Where the rate loader stood when it stopped: a `Watcher::at` it saved.
    /// let saved: CellRevision = "4521@6a1f/1796184997/0".parse()?;
    /// let opts = WatchOptions::prefix().after(&saved);
    /// assert_eq!(opts.start_revision, 4522);
    /// # Ok(()) }
    /// ```
    pub fn after(self, at: &crate::CellRevision) -> Self {
        WatchOptions {
            start_revision: at.revision.saturating_add(1),
            cell: at.cell.clone(),
            ..self
        }
    }
}

/// What happened to a key.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use std::collections::BTreeMap;
///
/// use lockcell_client::{EventKind, WatchOptions};
///
/// // A copy of the rates: read, then kept current with every change after the read.
/// let read = client.snapshot_prefix("config/rates/").await?;
/// let mut rates: BTreeMap<String, Vec<u8>> =
///     read.entries.into_iter().map(|e| (e.key, e.value)).collect();
/// let opts = WatchOptions::prefix().after(&read.at);
/// let mut watcher = client.watch("config/rates/", opts).await?;
/// while let Some(batch) = watcher.next().await {
///     for event in batch?.events {
///         match event.kind {
///             EventKind::Put => {
///                 rates.insert(event.entry.key, event.entry.value);
///             }
///             EventKind::Delete => {
///                 rates.remove(&event.entry.key);
///             }
///         }
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// Written (created or changed).
    Put,
    /// Deleted (explicitly, or an ephemeral key whose session ended).
    Delete,
}

/// One change of one key.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::WatchOptions;
///
/// // An audit log of the rates: each change with the value it replaced.
/// let opts = WatchOptions::prefix().with_prev_kv();
/// let mut watcher = client.watch("config/rates/", opts).await?;
/// while let Some(batch) = watcher.next().await {
///     for event in batch?.events {
///         let was = event.prev.map(|prev| prev.value);
///         let was = was.map(|value| String::from_utf8_lossy(&value).into_owned());
///         let now = String::from_utf8_lossy(&event.entry.value);
///         println!("{:?} {}: {was:?} -> {now:?}", event.kind, event.entry.key);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    /// Whether the key was written or deleted.
    pub kind: EventKind,
    /// The key after the event; for a delete, the key with an empty value and the
    /// delete's revision as `mod_revision`.
    pub entry: Entry,
    /// The key before the event, when [`WatchOptions::prev_kv`] was asked for and it
    /// existed.
    pub prev: Option<Entry>,
}

/// What one [`Watcher::next`] delivers.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use std::time::Duration;
///
/// use lockcell_client::WatchOptions;
///
/// let opts = WatchOptions::prefix().with_progress(Duration::from_secs(30));
/// let mut watcher = client.watch("config/rates/", opts).await?;
/// while let Some(batch) = watcher.next().await {
///     let batch = batch?;
///     if batch.events.is_empty() {
///         println!("no rate changed up to revision {}", batch.revision);
///     }
///     for event in &batch.events {
///         apply_rate(&event.entry.key, &event.entry.value);
///     }
/// }
/// # Ok(()) }
/// # fn apply_rate(_key: &str, _value: &[u8]) {}
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchBatch {
    /// Every event at or before this revision has now been delivered.
    pub revision: i64,
    /// The events, in revision order, every revision whole. Empty: a progress report
    /// (nothing happened to the watched keys up to `revision`).
    pub events: Vec<WatchEvent>,
}

/// A watch of a key or prefix, from [`Client::watch`]: a [`Stream`](tokio_stream::Stream)
/// of [`WatchBatch`]es, as every stream of the SDK is.
///
/// It remembers the last revision it delivered. When the stream breaks (the proxy
/// stops or loses etcd, the connection drops, the stream just ends), the next call to
/// [`next`](Watcher::next) watches again from that revision + 1, with backoff, for up to
/// [`WatchOptions::reconnect_for`]; events at or below what was already delivered are
/// dropped, so the application sees no gap and no duplicate.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::WatchOptions;
///
/// let mut flags = client.watch("config/flags/", WatchOptions::prefix()).await?;
/// while let Some(batch) = flags.next().await {
///     for event in batch?.events {
///         println!("{} changed at {}", event.entry.key, event.entry.mod_revision);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Watcher {
    steps: Steps<WatchState, Result<WatchBatch, Error>>,
    /// The watch as first asked for, for [`Watcher::key`].
    key: String,
    /// As of the last item: [`Watcher::at`].
    at: crate::CellRevision,
}

/// What a [`Watcher`] keeps between batches.
#[derive(Debug)]
struct WatchState {
    /// Set once an error that ends the watch was handed out: the stream has ended.
    ended: bool,
    client: Client,
    /// The watch as first asked for; each reopening changes only `start_revision`.
    request: WatchRequest,
    reconnect_for: Duration,
    position: Position,
    /// `None` between a break and the reopening.
    stream: Option<Streaming<WatchResponse>>,
    /// Where the next reopening starts when not at `position` + 1: after a cut-off,
    /// where the proxy said; after a failed reopening, where that one was to start.
    resume_from: Option<i64>,
    /// Set once the watched revisions were compacted away: the watch cannot go on.
    compacted: Option<i64>,
    /// The cell whose revisions the position counts (from the created response; empty
    /// when the proxy does not say).
    cell: String,
    /// Set once another cell serves the watched names: the watch cannot go on.
    moved: Option<String>,
    backoff: ExponentialBackoff,
    /// Whether the current stream has delivered something since it was set up, which
    /// proves the path works: then a break is retried at once with a fresh backoff.
    proven: bool,
    /// When the watch last broke after delivering something: `reconnect_for` counts
    /// from there. A stream that is set up and breaks again before delivering anything
    /// (the proxy cannot serve its history) is one more failed attempt, not a fresh
    /// start.
    broken_since: Option<Instant>,
    /// Why the last stream or attempt broke, for the error that gives up.
    last_break: String,
}

impl Client {
    /// Watches `key` (or, with [`WatchOptions::prefix`], every key under it). Returns
    /// once the proxy has set the watch up; [`Watcher::revision`] then says after which
    /// revision events are delivered.
    ///
    /// A `start_revision` older than etcd keeps is [`Error::Compacted`], here or (when
    /// the proxy sets the watch up first) at the first [`Watcher::next`]: read the keys
    /// and watch from the read's revision + 1.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::{Error, EventKind, WatchOptions};
    ///
    /// let mut watcher = client.watch("config/api/", WatchOptions::prefix()).await?;
    /// while let Some(batch) = watcher.next().await {
    ///     let batch = match batch {
    ///         Ok(batch) => batch,
    ///         // Too slow for the proxy's buffers; the next call goes on with no gap.
    ///         Err(Error::WatchCutOff { .. }) => continue,
    ///         Err(error) => return Err(error),
    ///     };
    ///     for event in batch.events {
    ///         match event.kind {
    ///             EventKind::Put => println!("{} = {:?}", event.entry.key, event.entry.value),
    ///             EventKind::Delete => println!("{} deleted", event.entry.key),
    ///         }
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn watch(&self, key: &str, opts: WatchOptions) -> Result<Watcher, Error> {
        let request = WatchRequest {
            key: key.to_owned(),
            prefix: opts.prefix,
            start_revision: opts.start_revision,
            prev_kv: opts.prev_kv,
            progress_interval_ms: opts.progress_interval.map_or(0, |d| {
                u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
            }),
            all_keys: opts.all_keys,
            cell: opts.cell.clone(),
        };
        let (stream, created, cell) = match open(self, request.clone()).await {
            Ok(opened) => opened,
            Err(Broken::Transient(reason)) => {
                return Err(Error::Unavailable(format!(
                    "cannot watch {key:?}: {reason}"
                )))
            }
            Err(Broken::Fatal(error)) => return Err(error),
        };
        tracing::debug!(watch.key = key, watch.revision = created, watch.cell = %cell, "watch created");
        if opts.start_revision > 0 && !opts.cell.is_empty() && !cell.is_empty() && cell != opts.cell
        {
            return Err(Error::WatchMoved {
                key: key.to_owned(),
                cell,
            });
        }
        Ok(Watcher::new(WatchState {
            ended: false,
            client: self.clone(),
            position: Position::created(opts.start_revision, created),
            request,
            reconnect_for: opts.reconnect_for,
            stream: Some(stream),
            resume_from: None,
            compacted: None,
            cell: if cell.is_empty() { opts.cell } else { cell },
            moved: None,
            backoff: backoff(),
            proven: false,
            broken_since: None,
            last_break: String::new(),
        }))
    }
}

impl Watcher {
    fn new(state: WatchState) -> Watcher {
        Watcher {
            key: state.request.key.clone(),
            at: state.at(),
            steps: Steps::new(state, |mut state| {
                Box::pin(async move {
                    let item = state.item().await;
                    (state, item)
                })
            }),
        }
    }

    /// The key or prefix watched.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let watcher = client.watch("config/api/", lockcell_client::WatchOptions::prefix()).await?;
    /// assert_eq!(watcher.key(), "config/api/");
    /// # Ok(()) }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Every event at or before this revision has been delivered (at first: the
    /// revision after which the watch delivers events).
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let mut watcher = client.watch("config/api/", lockcell_client::WatchOptions::prefix()).await?;
    /// let before = watcher.revision();
    /// if let Some(batch) = watcher.next().await {
    ///     assert!(batch?.revision > before);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn revision(&self) -> i64 {
        self.at.revision
    }

    /// [`revision`](Watcher::revision) and the cell it is of: where a later watch goes
    /// on from ([`WatchOptions::after`]) with nothing missed and nothing twice.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::WatchOptions;
    ///
    /// let watcher = client.watch("config/api/", WatchOptions::prefix()).await?;
    /// let saved = watcher.at();
    /// drop(watcher);
    /// // Later, perhaps in another process: nothing missed, nothing twice.
    /// let again = client.watch("config/api/", WatchOptions::prefix().after(&saved)).await?;
    /// # Ok(()) }
    /// ```
    pub fn at(&self) -> crate::CellRevision {
        self.at.clone()
    }

    /// The next batch of events, or a progress report (empty `events`); `None` after an
    /// error that ends the watch.
    ///
    /// Errors: [`Error::WatchCutOff`] once when the proxy cut this watcher off for
    /// falling behind (the next call goes on from where it says); [`Error::Unavailable`]
    /// when a broken stream could not be resumed within [`WatchOptions::reconnect_for`]
    /// (a later call tries again from the same place). An error that going on would not
    /// cure ([`ErrorKind::Fatal`](crate::ErrorKind::Fatal)) ends the watch (the next
    /// call returns `None`): [`Error::Compacted`], when the revisions to resume from are
    /// gone, and [`Error::WatchMoved`], when another cell serves the watched names now
    /// (read again and watch from the read), or a refusal such as
    /// [`Error::PermissionDenied`] when the proxy's grants changed.
    ///
    /// Cancel-safe: a call dropped before it returns (in a `select!`, say) loses no
    /// event; the next call goes on from the same place.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let mut watcher = client.watch("config/api/limit", Default::default()).await?;
    /// while let Some(batch) = watcher.next().await {
    ///     let batch = batch?;
    ///     println!("{} events up to revision {}", batch.events.len(), batch.revision);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn next(&mut self) -> Option<Result<WatchBatch, Error>> {
        crate::stream::next(self).await
    }
}

impl Stream for Watcher {
    type Item = Result<WatchBatch, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = std::task::ready!(self.steps.poll_step(cx));
        if let Some(state) = self.steps.idle() {
            self.at = state.at();
        }
        Poll::Ready(item)
    }
}

impl WatchState {
    fn at(&self) -> crate::CellRevision {
        crate::CellRevision {
            revision: self.position.revision,
            cell: self.cell.clone(),
        }
    }

    /// The next item of the stream: the next batch or error, `None` once an error
    /// that ends the watch was handed out.
    async fn item(&mut self) -> Option<Result<WatchBatch, Error>> {
        if self.ended {
            return None;
        }
        let item = self.batch().await;
        // Compacted, moved, or refused (grants, a bad key): going on would not cure it.
        self.ended = matches!(&item, Err(error) if error.kind() == ErrorKind::Fatal);
        Some(item)
    }

    /// The next batch of events, or a progress report, or the error that stopped it
    /// ([`Watcher::next`] says which). Cancel-safe.
    async fn batch(&mut self) -> Result<WatchBatch, Error> {
        if let Some(compact_revision) = self.compacted {
            return Err(Error::Compacted {
                key: self.request.key.clone(),
                compact_revision,
            });
        }
        if let Some(cell) = &self.moved {
            return Err(Error::WatchMoved {
                key: self.request.key.clone(),
                cell: cell.clone(),
            });
        }
        loop {
            let Some(stream) = self.stream.as_mut() else {
                self.reopen().await?;
                continue;
            };
            let broken = match stream.message().await {
                Ok(Some(response)) => {
                    if !self.proven {
                        self.proven = true;
                        self.backoff = backoff();
                        self.broken_since = None;
                    }
                    match self.position.accept(response) {
                        Ok(Some(batch)) => return Ok(batch),
                        Ok(None) => continue,
                        Err(error) => Broken::Fatal(error),
                    }
                }
                Ok(None) => Broken::Transient("the proxy ended the stream".to_owned()),
                Err(status) => classify(status, &self.request.key),
            };
            self.stream = None;
            self.broken_since.get_or_insert_with(Instant::now);
            match broken {
                Broken::Transient(reason) => {
                    tracing::debug!(watch.key = %self.request.key, %reason, "watch broke; resuming");
                    self.last_break = reason;
                }
                Broken::Fatal(error) => return Err(self.noted(error)),
            }
        }
    }

    /// Watches again from where the last stream left off, retrying transient failures
    /// with backoff for up to `reconnect_for` (always at least once).
    async fn reopen(&mut self) -> Result<(), Error> {
        // Left in place until the watch is set up, in case this call is dropped.
        let from = self.resume_from.unwrap_or(self.position.revision + 1);
        let give_up_at = *self.broken_since.get_or_insert_with(Instant::now) + self.reconnect_for;
        let mut delay = if self.proven {
            Duration::ZERO
        } else {
            self.next_delay()
        };
        let first = self.proven;
        self.proven = false;
        if !first && Instant::now() + delay > give_up_at {
            let reason = std::mem::take(&mut self.last_break);
            return Err(self.give_up(from, reason));
        }
        loop {
            tokio::time::sleep(delay).await;
            let request = WatchRequest {
                start_revision: from,
                cell: self.cell.clone(),
                ..self.request.clone()
            };
            let reason = match open(&self.client, request).await {
                // A proxy that does not check the cell: the client does.
                Ok((_, _, cell))
                    if !cell.is_empty() && !self.cell.is_empty() && cell != self.cell =>
                {
                    self.resume_from = Some(from);
                    let error = Error::WatchMoved {
                        key: self.request.key.clone(),
                        cell,
                    };
                    return Err(self.noted(error));
                }
                Ok((stream, created, _)) => {
                    self.resume_from = None;
                    self.position.resumed(from, created);
                    self.stream = Some(stream);
                    tracing::debug!(watch.key = %self.request.key, watch.from = from, "watch resumed");
                    return Ok(());
                }
                Err(Broken::Transient(reason)) => reason,
                Err(Broken::Fatal(error)) => {
                    self.resume_from = Some(from);
                    return Err(self.noted(error));
                }
            };
            delay = self.next_delay();
            if Instant::now() + delay > give_up_at {
                return Err(self.give_up(from, reason));
            }
        }
    }

    /// The error for a watch that could not be resumed within `reconnect_for`.
    fn give_up(&mut self, from: i64, reason: String) -> Error {
        self.resume_from = Some(from);
        // A later call starts over: quickly, and with a whole `reconnect_for`.
        self.backoff = backoff();
        self.broken_since = None;
        Error::Unavailable(format!(
            "the watch on {:?} broke and could not be resumed from revision {from} \
             within {}: {reason}",
            self.request.key,
            humantime::format_duration(self.reconnect_for)
        ))
    }

    fn next_delay(&mut self) -> Duration {
        self.backoff.next().unwrap_or(RECONNECT_MAX)
    }

    /// Remembers what an error that ends a stream means for the next call.
    fn noted(&mut self, error: Error) -> Error {
        match error {
            Error::WatchCutOff { resume_from, .. } => self.resume_from = Some(resume_from),
            Error::Compacted {
                compact_revision, ..
            } => self.compacted = Some(compact_revision),
            Error::WatchMoved { ref cell, .. } => self.moved = Some(cell.clone()),
            _ => {}
        }
        error
    }
}

/// Why a stream (or an attempt to open one) stopped.
enum Broken {
    /// Worth resuming from where it stopped: the proxy is stopping or lost etcd, the
    /// connection broke, the stream ended.
    Transient(String),
    /// To report: the proxy said something definite.
    Fatal(Error),
}

/// No answer at all (the SDK's one rule, [`no_answer`]) is transient. Of the proxy's own
/// answers, UNAVAILABLE is its word for "resume elsewhere or later", and UNKNOWN,
/// INTERNAL, CANCELLED, DEADLINE_EXCEEDED and ABORTED are what a proxy stopping (or a
/// connection breaking under tonic's feet) answers with; a watch resumes from its
/// position after them. Every other code is the proxy's refusal.
fn classify(status: Status, key: &str) -> Broken {
    let transient = no_answer(&status)
        || matches!(
            status.code(),
            Code::Unavailable
                | Code::Unknown
                | Code::Internal
                | Code::Cancelled
                | Code::DeadlineExceeded
                | Code::Aborted
        );
    if transient {
        return Broken::Transient(Error::from_status(status, Call::Watch(key)).into_reason());
    }
    Broken::Fatal(Error::from_status(status, Call::Watch(key)))
}

/// Opens a watch and waits for its `created` response; returns the stream and that
/// response's revision and cell.
async fn open(
    client: &Client,
    request: WatchRequest,
) -> Result<(Streaming<WatchResponse>, i64, String), Broken> {
    let key = request.key.clone();
    let opening = async {
        let mut stream = WatchClient::new(client.channel())
            .watch(request)
            .await
            .map_err(|status| classify(status, &key))?
            .into_inner();
        match stream.message().await {
            Ok(Some(first)) if first.created => Ok((stream, first.revision, first.cell)),
            Ok(Some(_)) => Err(Broken::Fatal(Error::Protocol(format!(
                "the watch on {key:?} did not start with a created response"
            )))),
            Ok(None) => Err(Broken::Transient(
                "the proxy ended the stream before setting the watch up".to_owned(),
            )),
            Err(status) => Err(classify(status, &key)),
        }
    };
    match tokio::time::timeout(CREATED_TIMEOUT, opening).await {
        Ok(opened) => opened,
        Err(_) => Err(Broken::Transient(format!(
            "the proxy did not set the watch up within {}",
            humantime::format_duration(CREATED_TIMEOUT)
        ))),
    }
}

pub(crate) fn backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(RECONNECT_MIN)
        .with_max_delay(RECONNECT_MAX)
        .with_jitter()
        .without_max_times()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_failures_are_resumed_and_the_proxys_answers_reported() {
        for status in [
            Status::unavailable("stopping"),
            Status::unknown("transport error"),
            Status::internal("h2 protocol error"),
            Status::cancelled("reset"),
        ] {
            assert!(
                matches!(classify(status, "k"), Broken::Transient(_)),
                "resumed"
            );
        }
        assert!(matches!(
            classify(Status::invalid_argument("bad key"), "k"),
            Broken::Fatal(Error::InvalidArgument(_))
        ));
        let mut compacted = Status::out_of_range("compacted");
        compacted
            .metadata_mut()
            .insert("lockcell-compact-revision", "7".parse().unwrap());
        assert!(matches!(
            classify(compacted, "k"),
            Broken::Fatal(Error::Compacted {
                compact_revision: 7,
                ..
            })
        ));
    }

    #[test]
    fn options_read_as_built() {
        let opts = WatchOptions::prefix()
            .from_revision(42)
            .with_prev_kv()
            .with_progress(Duration::from_secs(5))
            .reconnecting_for(Duration::from_secs(3));
        assert_eq!(
            opts,
            WatchOptions {
                prefix: true,
                start_revision: 42,
                prev_kv: true,
                progress_interval: Some(Duration::from_secs(5)),
                all_keys: false,
                reconnect_for: Duration::from_secs(3),
                cell: String::new(),
            }
        );
        assert!(WatchOptions::prefix().allow_all_keys().all_keys);
        assert_eq!(
            WatchOptions::default().reconnect_for,
            Duration::from_secs(30)
        );
    }
}
