//! A watch's pump: from the fan-out (after a catch-up, when it starts in the past) to
//! the client, with progress while quiet and the reason when it ends.

use super::*;

/// One watcher's delivery: catch-up, then the fan-out's queue.
pub(super) struct Pump {
    /// Its place among the watches its identity may have open.
    pub(super) _place: Taken,
    /// The cell whose revisions these are (in the created response).
    pub(super) cell: String,
    /// The cell's copy of the shard map, as of what the feed applied: once it moves
    /// the names, the watch ends before the batch that would deliver later revisions
    /// (the move's deletes of the copied keys among them).
    pub(super) routes: Arc<crate::routes::Routes>,
    /// The copies taken in when the position was last found unchanged.
    pub(super) checked_copy: std::sync::atomic::AtomicI64,
    pub(super) tx: mpsc::Sender<Sent>,
    pub(super) what: String,
    pub(super) topic: Topic,
    /// The first revision the watcher wants.
    pub(super) start: i64,
    pub(super) prev_kv: bool,
    pub(super) progress: Option<Duration>,
    pub(super) applied: watch::Receiver<i64>,
    pub(super) shutdown: watch::Receiver<bool>,
    pub(super) backlog: usize,
}

impl Pump {
    pub(super) async fn run(mut self, mut sub: Subscription, catch_up: Option<Before>) {
        let _counted = metrics::Counted::in_gauge(metrics::WATCHERS);
        self.deliver(&mut sub, catch_up).await;
    }

    async fn deliver(&mut self, sub: &mut Subscription, catch_up: Option<Before>) {
        let mut last = self.start - 1;
        let created = WatchResponse {
            cell: self.cell.clone(),
            ..response(true, last, Vec::new())
        };
        if !self.send(created).await {
            return;
        }
        let catch_up = match catch_up {
            Some(Before::Kept(events)) => {
                for (revision, events) in in_chunks(events, sub.joined_at, RESPONSE_BYTES) {
                    let events = events.iter().map(|e| self.event(e)).collect();
                    if !self.send(response(false, revision, events)).await {
                        return;
                    }
                }
                last = sub.joined_at;
                None
            }
            other => other,
        };
        if let Some(Before::Etcd(catch_up)) = catch_up {
            match self.catch_up_from_etcd(*catch_up).await {
                Some(through) => last = through,
                None => return,
            }
        }
        self.follow(sub, last).await;
    }

    /// Catches a watch from the past up from etcd's history: `Some(the revision it
    /// reached)`, or `None` when the watch ended (its client told why, if it is there).
    async fn catch_up_from_etcd(&self, catch_up: CatchUp) -> Option<i64> {
        let through = catch_up.through;
        let mut shutdown = self.shutdown.clone();
        let result = tokio::select! {
            result = self.catch_up(catch_up) => result,
            _ = self.tx.closed() => Err(CatchUpError::ClientGone),
            _ = async { let _ = shutdown.wait_for(|s| *s).await; } => {
                Err(CatchUpError::Etcd("this proxy is shutting down".into()))
            }
        };
        let status = match result {
            Ok(()) => return Some(through),
            Err(CatchUpError::ClientGone) => return None,
            Err(e) => self.caught_up_not(e),
        };
        let _ = self.tx.send(Err(status)).await;
        None
    }

    /// Why a catch-up from etcd failed, as the watcher hears it.
    fn caught_up_not(&self, e: CatchUpError) -> Status {
        let (what, start) = (&self.what, self.start);
        match e {
            CatchUpError::Compacted(compacted) => {
                // etcd keeps the state at its compact revision but not the deletes
                // made at it: a watch can start one past it at the earliest.
                let oldest = compacted + 1;
                ProxyError::Compacted {
                    message: format!(
                        "watch of {what} from revision {start}: history through revision {compacted} is compacted, so a watch can start at revision {oldest} at the earliest; read the keys again and watch from the read's revision + 1"
                    ),
                    oldest,
                }
            }
            CatchUpError::Gap(gap) => ProxyError::Compacted {
                message: format!(
                    "watch of {what} from revision {start}: {gap}; read the keys again and watch from the read's revision + 1"
                ),
                oldest: gap.got,
            },
            CatchUpError::Slow => ProxyError::StreamEnded(format!(
                "watch of {what} from revision {start}: the watcher took no events for {} s while catching up; resume from the revision after the last one received",
                crate::catchup::SLOW_READER.as_secs()
            )),
            CatchUpError::Etcd(why) => ProxyError::StreamEnded(format!(
                "watch of {what} could not catch up from revision {start}: {why}; resume from the revision after the last one received"
            )),
            CatchUpError::ClientGone => ProxyError::Cancelled("the watcher hung up".to_owned()),
        }
        .into()
    }

    /// Delivers the fan-out's batches from `last` on, and progress when quiet, until
    /// the watch ends.
    async fn follow(&mut self, sub: &mut Subscription, mut last: i64) {
        let mut shutdown = self.shutdown.clone();
        loop {
            let quiet = async {
                match self.progress {
                    Some(every) => tokio::time::sleep(every).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                queued = sub.batches.recv() => {
                    if !self.forward(queued, sub.end.get().copied(), &mut last).await {
                        return;
                    }
                }
                _ = quiet => {
                    // Everything delivered up to `applied` is in the queue already.
                    // Read before draining: a batch this watcher was cut off at was
                    // dropped before `applied` reached it, so the drain then finds the
                    // queue closed and no progress past it is claimed.
                    let applied = *self.applied.borrow();
                    loop {
                        let queued = match sub.batches.try_recv() {
                            Ok(batch) => Some(batch),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => None,
                        };
                        if !self.forward(queued, sub.end.get().copied(), &mut last).await {
                            return;
                        }
                    }
                    last = last.max(applied);
                    if !self.send(response(false, last, Vec::new())).await {
                        return;
                    }
                }
                _ = self.tx.closed() => return,
                _ = async { let _ = shutdown.wait_for(|s| *s).await; } => {
                    let status = ProxyError::StreamEnded(format!(
                        "this proxy is shutting down; resume the watch of {} from revision {} on another proxy",
                        self.what, last + 1
                    ));
                    let _ = self.tx.send(Err(status.into())).await;
                    return;
                }
            }
        }
    }

    /// Sends a queued batch on, or (`None`: the queue closed) the reason deliveries
    /// ended. False when the stream is over.
    async fn forward(&self, queued: Option<Arc<Batch>>, end: Option<End>, last: &mut i64) -> bool {
        let Some(batch) = queued else {
            let _ = self.tx.send(Err(self.ended(end, *last))).await;
            return false;
        };
        match self.batch(&batch, *last) {
            Some(response) => {
                if let Some(now) = self.moved_away() {
                    let _ = self.tx.send(Err(moved(&self.what, &self.cell, &now))).await;
                    return false;
                }
                *last = batch.revision;
                self.send(response).await
            }
            None => true,
        }
    }

    /// The names' position now, if it is no longer the watch's (looked at only when the
    /// cell's copy of the shard map changed since the last look).
    fn moved_away(&self) -> Option<String> {
        let copy = self.routes.copy_changes();
        if copy == self.checked_copy.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let now = self.routes.position(&self.topic.name, self.topic.prefix);
        if now != self.cell {
            return Some(now);
        }
        self.checked_copy
            .store(copy, std::sync::atomic::Ordering::Relaxed);
        None
    }

    /// The response for a fan-out batch: its events from the watcher's start on.
    fn batch(&self, batch: &Batch, last: i64) -> Option<WatchResponse> {
        if batch.revision <= last {
            return None;
        }
        let events: Vec<WatchEvent> = batch
            .events
            .iter()
            .filter(|e| e.revision() >= self.start && e.revision() > last)
            .map(|e| self.event(e))
            .collect();
        (!events.is_empty()).then(|| response(false, batch.revision, events))
    }

    fn event(&self, e: &KeyEvent) -> WatchEvent {
        WatchEvent {
            kind: match e.kind {
                EventKind::Put => Kind::Put,
                EventKind::Delete => Kind::Delete,
            } as i32,
            kv: Some(wire(e.entry.clone())),
            prev_kv: if self.prev_kv {
                e.prev.clone().map(wire)
            } else {
                None
            },
        }
    }

    async fn send(&self, response: WatchResponse) -> bool {
        if !response.events.is_empty() {
            ::metrics::counter!(metrics::WATCH_EVENTS_SENT).increment(response.events.len() as u64);
        }
        self.tx.send(Ok(response)).await.is_ok()
    }

    fn ended(&self, end: Option<End>, last: i64) -> Status {
        match end {
            Some(End::CutOff { resume }) => {
                // A watcher that asked to start past the join position was queued
                // batches from before its start; it never resumes before it.
                let resume = resume.max(self.start);
                ProxyError::CutOff {
                    message: format!(
                        "watch of {} cut off: the watcher fell more than {} batches of events behind; resume from revision {resume}",
                        self.what, self.backlog
                    ),
                    resume,
                }
            }
            Some(End::FeedLost) | None => ProxyError::StreamEnded(format!(
                "watch of {} ended: the proxy lost its view of the cell and is reloading it; resume from revision {}",
                self.what,
                last + 1
            )),
        }
        .into()
    }

    /// Sends the watcher's events from its start through the catch-up's end.
    async fn catch_up(&self, catch_up: CatchUp) -> Result<(), CatchUpError> {
        let (out, mut caught) = mpsc::channel(1);
        let read = catch_up.run(&self.topic, self.start, self.prev_kv, out);
        // Owns `caught`: a relay that stops closes the channel, which ends the read.
        let relay = async move {
            while let Some(CaughtUp { reached, events }) = caught.recv().await {
                let events = events.iter().map(|e| self.event(e)).collect();
                if !self.send(response(false, reached, events)).await {
                    return;
                }
            }
        };
        tokio::join!(read, relay).0
    }
}
