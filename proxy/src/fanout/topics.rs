//! The fan-out's watchers by topic: a name, or a prefix.

use super::*;

#[derive(Default)]
pub(super) struct Topics {
    /// False until the first [`Fanout::open`] and after [`Fanout::end_all`]: the events
    /// since the last publish may never come, so nobody may join.
    pub(super) open: bool,
    /// The last revision published.
    pub(super) revision: i64,
    pub(super) exact: HashMap<String, Vec<Watcher>>,
    pub(super) prefixes: HashMap<String, Vec<Watcher>>,
    pub(super) next_id: u64,
    pub(super) watchers: usize,
    pub(super) history: History,
    /// Prefix batches published but not yet handed to their watchers, in order.
    pub(super) lane: VecDeque<Queued>,
}

pub(super) struct Watcher {
    pub(super) id: u64,
    /// The revision published when it joined: batches through it came from the
    /// history or etcd.
    pub(super) joined_at: i64,
    pub(super) tx: mpsc::Sender<Arc<Batch>>,
    pub(super) end: Arc<OnceLock<End>>,
}

/// One step of the paced lane.
pub(super) enum Queued {
    /// A prefix topic's batch.
    Batch(String, Arc<Batch>),
    /// Every batch of the revisions through this one has been handed over.
    Through(i64),
}

impl Topics {
    pub(super) fn of(&mut self, prefix: bool) -> &mut HashMap<String, Vec<Watcher>> {
        if prefix {
            &mut self.prefixes
        } else {
            &mut self.exact
        }
    }

    /// Hands `batch` to every watcher of a topic that joined before its revision; cuts
    /// off those whose backlog is full.
    pub(super) fn hand(
        &mut self,
        prefix: bool,
        name: &str,
        batch: &Arc<Batch>,
        done: &mut Published,
    ) {
        let Some(watchers) = self.of(prefix).get_mut(name) else {
            return;
        };
        let mut gone = 0;
        watchers.retain(|w| {
            if w.joined_at >= batch.revision {
                return true;
            }
            match w.tx.try_send(batch.clone()) {
                Ok(()) => {
                    done.delivered += 1;
                    true
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    let _ = w.end.set(End::CutOff {
                        resume: batch.first_revision(),
                    });
                    done.cut_off += 1;
                    gone += 1;
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    gone += 1;
                    false
                }
            }
        });
        if watchers.is_empty() {
            self.of(prefix).remove(name);
        }
        self.watchers -= gone;
    }
}
