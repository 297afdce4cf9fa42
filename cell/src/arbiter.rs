//! The arbiter's wait queue: a proxy's local waiters per lock, first come first
//! served, for classes that are not fair.
//!
//! Only the head of a lock's queue tries for a grant when the lock is released, so a
//! release costs at most one grant transaction per proxy however many of its clients
//! wait. The queue is advisory: it lives in one proxy's memory, orders only that
//! proxy's waiters, and is rebuilt by retries after a restart. Plain data; the proxy
//! wakes the waiters it names.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use crate::keyspace::Mode;

/// One waiter in a queue: its id and the mode it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    pub id: u64,
    pub mode: Mode,
}

/// Local wait queues, one per lock with waiters.
#[derive(Debug)]
pub struct Arbiter<L> {
    queues: HashMap<L, VecDeque<Waiter>>,
}

impl<L> Default for Arbiter<L> {
    fn default() -> Self {
        Arbiter {
            queues: HashMap::new(),
        }
    }
}

impl<L: Eq + Hash + Clone> Arbiter<L> {
    /// Puts a waiter at the back of `lock`'s queue. Returns whether it may try now
    /// (see [`Arbiter::may_try`]).
    pub fn join(&mut self, lock: &L, waiter: Waiter) -> bool {
        self.queues
            .entry(lock.clone())
            .or_default()
            .push_back(waiter);
        self.may_try(lock, waiter.id)
    }

    /// Whether waiter `id` may try for a grant: it is at the head, or it waits for a
    /// shared hold and so does every waiter ahead of it (shared holds do not exclude
    /// each other).
    pub fn may_try(&self, lock: &L, id: u64) -> bool {
        let Some(queue) = self.queues.get(lock) else {
            return false;
        };
        for (i, w) in queue.iter().enumerate() {
            if w.id == id {
                return i == 0 || w.mode == Mode::Shared;
            }
            if w.mode == Mode::Exclusive {
                return false;
            }
        }
        false
    }

    /// The waiters that should try when `lock` is released: the head, and the shared
    /// waiters right behind a shared head.
    pub fn on_release(&self, lock: &L) -> Vec<u64> {
        let Some(queue) = self.queues.get(lock) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, w) in queue.iter().enumerate() {
            if i > 0 && (w.mode == Mode::Exclusive || out.is_empty()) {
                break;
            }
            out.push(w.id);
            if w.mode == Mode::Exclusive {
                break;
            }
        }
        out
    }

    /// Takes waiter `id` out of `lock`'s queue (granted, gave up, or gone). Returns the
    /// waiters that may try now because it left: when the head leaves without a grant
    /// the lock may be free, so the new head (and the shared run behind it) should try.
    pub fn leave(&mut self, lock: &L, id: u64, granted: bool) -> Vec<u64> {
        let Some(queue) = self.queues.get_mut(lock) else {
            return Vec::new();
        };
        let was_head = queue.front().is_some_and(|w| w.id == id);
        queue.retain(|w| w.id != id);
        if queue.is_empty() {
            self.queues.remove(lock);
            return Vec::new();
        }
        if was_head && !granted {
            self.on_release(lock)
        } else if was_head && granted {
            // A shared grant lets the shared waiters right behind it in at once.
            self.on_release(lock)
                .into_iter()
                .filter(|id| {
                    self.queues[lock]
                        .iter()
                        .any(|w| w.id == *id && w.mode == Mode::Shared)
                })
                .collect()
        } else {
            Vec::new()
        }
    }

    /// Waiters queued for `lock`.
    pub fn len(&self, lock: &L) -> usize {
        self.queues.get(lock).map_or(0, VecDeque::len)
    }

    /// Locks with local waiters.
    pub fn locks(&self) -> usize {
        self.queues.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x(id: u64) -> Waiter {
        Waiter {
            id,
            mode: Mode::Exclusive,
        }
    }
    fn s(id: u64) -> Waiter {
        Waiter {
            id,
            mode: Mode::Shared,
        }
    }

    #[test]
    fn only_the_head_tries_and_order_is_arrival() {
        let mut a = Arbiter::default();
        assert!(a.join(&"l", x(1)));
        assert!(!a.join(&"l", x(2)));
        assert!(!a.join(&"l", x(3)));
        assert_eq!(a.on_release(&"l"), vec![1]);
        // The head is granted: nobody else tries until the next release.
        assert_eq!(a.leave(&"l", 1, true), Vec::<u64>::new());
        assert_eq!(a.on_release(&"l"), vec![2]);
        assert_eq!(a.leave(&"l", 2, true), Vec::<u64>::new());
        assert_eq!(a.on_release(&"l"), vec![3]);
        a.leave(&"l", 3, true);
        assert_eq!(a.locks(), 0, "an empty queue is forgotten");
    }

    #[test]
    fn a_head_that_gives_up_lets_the_next_try_at_once() {
        let mut a = Arbiter::default();
        a.join(&"l", x(1));
        a.join(&"l", x(2));
        assert_eq!(a.leave(&"l", 1, false), vec![2]);
        // A waiter behind the head leaving changes nothing.
        a.join(&"l", x(3));
        assert_eq!(a.leave(&"l", 3, false), Vec::<u64>::new());
        assert_eq!(a.len(&"l"), 1);
    }

    #[test]
    fn shared_waiters_behind_a_shared_head_go_together() {
        let mut a = Arbiter::default();
        assert!(a.join(&"l", s(1)));
        assert!(a.join(&"l", s(2)), "shared behind shared may try");
        assert!(!a.join(&"l", x(3)));
        assert!(!a.join(&"l", s(4)), "shared behind an exclusive waits");
        assert_eq!(a.on_release(&"l"), vec![1, 2]);
        assert_eq!(a.leave(&"l", 1, true), vec![2]);
        a.leave(&"l", 2, true);
        assert_eq!(a.on_release(&"l"), vec![3]);
        assert!(!a.may_try(&"l", 4));
        a.leave(&"l", 3, true);
        assert!(a.may_try(&"l", 4));
    }

    #[test]
    fn queues_are_per_lock() {
        let mut a = Arbiter::default();
        assert!(a.join(&"a", x(1)));
        assert!(a.join(&"b", x(2)));
        assert_eq!(a.on_release(&"a"), vec![1]);
        assert!(a.on_release(&"c").is_empty());
    }
}
