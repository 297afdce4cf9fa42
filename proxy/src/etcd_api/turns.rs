//! Calls on one key that take turns: a per-key async lock whose entry goes once no call
//! holds or waits for it.

use std::hash::Hash;
use std::sync::Arc;

use dashmap::DashMap;
use tokio::sync::{Mutex, OwnedMutexGuard};

/// The turns of calls, by key.
pub struct Turns<K: Eq + Hash + Clone>(Arc<DashMap<K, Arc<Mutex<()>>>>);

impl<K: Eq + Hash + Clone> Default for Turns<K> {
    fn default() -> Self {
        Turns(Arc::default())
    }
}

impl<K: Eq + Hash + Clone> Turns<K> {
    /// Waits for `key`'s turn, held until the returned turn is dropped.
    pub async fn take(&self, key: K) -> Turn<K> {
        let lock = self.0.entry(key.clone()).or_default().clone();
        let held = lock.lock_owned().await;
        Turn {
            turns: self.0.clone(),
            key,
            held: Some(held),
        }
    }

    /// How many keys have a call holding or waiting for their turn.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// One call's turn on a key ([`Turns::take`]).
pub struct Turn<K: Eq + Hash + Clone> {
    turns: Arc<DashMap<K, Arc<Mutex<()>>>>,
    key: K,
    held: Option<OwnedMutexGuard<()>>,
}

impl<K: Eq + Hash + Clone> Drop for Turn<K> {
    fn drop(&mut self) {
        // The guard holds the lock's Arc: let go of it first, so that the entry goes
        // when no other call holds or waits for it.
        self.held.take();
        self.turns
            .remove_if(&self.key, |_, lock| Arc::strong_count(lock) <= 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn calls_on_one_key_take_turns_and_leave_no_entry() {
        let turns: Arc<Turns<u8>> = Arc::default();
        let first = turns.take(1).await;
        let other = turns.take(2).await;
        let waiting = tokio::spawn({
            let turns = turns.clone();
            async move { turns.take(1).await }
        });
        tokio::task::yield_now().await;
        assert!(
            !waiting.is_finished(),
            "a second call on a key waits its turn"
        );
        drop(other);
        assert_eq!(turns.len(), 1, "a key no call waits for has no entry");
        drop(first);
        let second = waiting.await.expect("the waiting call gets its turn");
        assert_eq!(
            turns.len(),
            1,
            "the key's entry stays while a call holds it"
        );
        drop(second);
        assert_eq!(turns.len(), 0, "no entry is left once every call is done");
    }
}
