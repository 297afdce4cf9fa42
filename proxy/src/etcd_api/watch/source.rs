//! A watch's source: the fan-out from the watch's next revision on, a catch-up when it
//! starts in the past, and joining again where it was when the fan-out drops it.

use std::ops::ControlFlow;

use super::*;

/// One watch's events, from the fan-out.
pub(super) struct Source {
    pub(super) state: Arc<ProxyState>,
    pub(super) topic: Topic,
    pub(super) select: Selection,
    pub(super) prev_kv: bool,
    /// The first revision not yet delivered.
    pub(super) next: i64,
    pub(super) synced: Arc<AtomicBool>,
    pub(super) phase: Phase,
    /// Responses' worth of events to deliver before anything else.
    pub(super) pending: std::collections::VecDeque<Arrival>,
}

pub(super) enum Phase {
    /// To join the fan-out, at `next`.
    Join,
    /// Joined in the past: etcd's history through the join position comes first.
    CatchingUp {
        sub: Subscription,
        through: i64,
        caught: mpsc::Receiver<CaughtUp>,
        read: JoinHandle<Result<(), CatchUpError>>,
    },
    Following(Subscription),
    Done,
}

impl Source {
    pub(super) fn into_stream(self) -> impl Stream<Item = Arrival> + Send {
        let counted = metrics::Counted::in_gauge(metrics::WATCHERS);
        futures_util::stream::unfold((self, counted), |(mut source, counted)| async move {
            let arrival = source.next().await?;
            Some((arrival, (source, counted)))
        })
    }

    pub(super) async fn next(&mut self) -> Option<Arrival> {
        loop {
            if let Some(arrival) = self.pending.pop_front() {
                return Some(arrival);
            }
            match &mut self.phase {
                Phase::Join => {
                    if let Some(arrival) = self.join().await {
                        return Some(arrival);
                    }
                }
                Phase::CatchingUp { caught, .. } => {
                    if let Some(CaughtUp {
                        reached,
                        mut events,
                    }) = caught.recv().await
                    {
                        self.next = reached + 1;
                        events.retain(|e| self.select.wants(e));
                        return Some(Arrival::Events {
                            revision: reached,
                            events,
                        });
                    }
                    if let ControlFlow::Break(arrival) = self.caught_up().await {
                        return arrival;
                    }
                }
                Phase::Following(sub) => match sub.batches.recv().await {
                    Some(batch) => {
                        if batch.revision < self.next {
                            continue;
                        }
                        let events: Vec<KeyEvent> = batch
                            .events
                            .iter()
                            .filter(|e| e.revision() >= self.next && self.select.wants(e))
                            .cloned()
                            .collect();
                        self.next = batch.revision + 1;
                        self.deliver(events, batch.revision);
                    }
                    // Cut off for a full backlog, or the proxy is loading its view of
                    // the cell again: everything before `next` was delivered, so the
                    // watch joins again from there, as an etcd watcher that fell
                    // behind catches up.
                    None => {
                        self.synced.store(false, Ordering::Release);
                        self.phase = Phase::Join;
                    }
                },
                Phase::Done => return None,
            }
        }
    }

    /// A catch-up's read ended: following the fan-out from where it reached, or why
    /// not. `Continue` when the catch-up starts again.
    async fn caught_up(&mut self) -> ControlFlow<Option<Arrival>> {
        let Phase::CatchingUp {
            sub, through, read, ..
        } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            unreachable!("called as a catch-up ends");
        };
        let result = read
            .await
            .unwrap_or_else(|e| Err(CatchUpError::Etcd(e.to_string())));
        match result {
            Ok(()) => {
                self.next = self.next.max(through + 1);
                self.synced.store(true, Ordering::Release);
                self.phase = Phase::Following(sub);
                ControlFlow::Break(Some(Arrival::Synced))
            }
            // Its client stopped reading: the stream is not polled, and the
            // catch-up starts again from `next` once it is.
            Err(CatchUpError::Slow) => {
                self.phase = Phase::Join;
                ControlFlow::Continue(())
            }
            Err(CatchUpError::ClientGone) => ControlFlow::Break(None),
            // etcd keeps the state at its compact revision but not the
            // deletes made at it: a watch can start one past it.
            Err(CatchUpError::Compacted(compacted)) => {
                ControlFlow::Break(Some(Arrival::Compacted(compacted + 1)))
            }
            Err(CatchUpError::Gap(gap)) => {
                ControlFlow::Break(Some(Arrival::Compacted(gap.got)))
            }
            Err(CatchUpError::Etcd(why)) => {
                ControlFlow::Break(Some(Arrival::Failed(Status::unavailable(format!(
                    "etcdserver: the watch could not read etcd's history from revision {}: {why}; watch again",
                    self.next
                )))))
            }
        }
    }

    /// Queues `events` (of the revisions through `through`) as responses of a bounded
    /// size.
    pub(super) fn deliver(&mut self, events: Vec<KeyEvent>, through: i64) {
        for (revision, events) in in_chunks(events, through, RESPONSE_BYTES) {
            self.pending.push_back(Arrival::Events { revision, events });
        }
    }

    /// Joins the fan-out at `next`; the events from before the join position come
    /// from the fan-out's history or from a catch-up on etcd's.
    pub(super) async fn join(&mut self) -> Option<Arrival> {
        let state = &self.state;
        let feed = &state.reads.feed;
        if !feed.live_within(state.config.etcd_timeout).await {
            return None;
        }
        let (sub, kept) = feed
            .fanout
            .subscribe_from(self.topic.clone(), feed.backlog(), self.next);
        if sub.end.get().is_some() {
            // Between two views of the cell: the next one is moments away.
            tokio::time::sleep(Duration::from_millis(50)).await;
            return None;
        }
        let joined = sub.joined_at;
        if self.next > joined {
            self.synced.store(true, Ordering::Release);
            self.phase = Phase::Following(sub);
            return Some(Arrival::Synced);
        }
        let catch_up =
            match Before::choose((&state.reads, &state.etcd), self.next, joined, kept).await {
                Before::Kept(mut events) => {
                    events.retain(|e| self.select.wants(e));
                    self.next = joined + 1;
                    self.synced.store(true, Ordering::Release);
                    self.phase = Phase::Following(sub);
                    self.deliver(events, joined);
                    self.pending.push_back(Arrival::Synced);
                    return self.pending.pop_front();
                }
                Before::Etcd(catch_up) => catch_up,
            };
        let (out, caught) = mpsc::channel(1);
        let (topic, start, prev_kv) = (self.topic.clone(), self.next, self.prev_kv);
        let read = tokio::spawn(async move { catch_up.run(&topic, start, prev_kv, out).await });
        self.phase = Phase::CatchingUp {
            sub,
            through: joined,
            caught,
            read,
        };
        None
    }
}
