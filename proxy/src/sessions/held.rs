//! What each session holds: the records of its keys, settled or not, and what
//! forgets them.

use super::*;

impl SessionTable {
    /// Records a key `id` now has in the log; for a hold, the client may act on it until
    /// `valid_until`. An ephemeral key's record replaces an earlier write's (and is
    /// dropped if a later write's is there). `incarnation` is the stay the key was granted in (on its lease).
    /// False when the session is gone, or here as another stay (it resumed here since,
    /// perhaps on another lease): the caller must then undo the grant itself.
    pub fn record_grant(
        &self,
        id: &str,
        incarnation: u64,
        grant: Grant,
        valid_until: Option<Instant>,
    ) -> bool {
        let Some(mut s) = self.live.get_mut(id) else {
            return false;
        };
        if s.incarnation != incarnation {
            return false;
        }
        let before = Tally::of(0, &s.held, -1);
        let id = s.id.clone();
        self.index(&id, &s.held, -1);
        if grant.written != 0 {
            // An ephemeral key: the session's last write of it is what guards it. Two
            // writes of one key may be answered out of order; the later one stands.
            let later = s
                .held
                .iter()
                .any(|g| g.key == grant.key && g.written > grant.written);
            if !later {
                s.held
                    .retain(|g| !(g.key == grant.key && g.written != 0 && !g.is_unsettled()));
                s.held.push(grant);
            }
        } else if !s.held.contains(&grant) {
            s.held.push(grant);
        }
        if let Some(until) = valid_until {
            s.life.granted(until);
        }
        let mut change = Tally::of(0, &s.held, 1);
        change.add(before);
        self.index(&id, &s.held, 1);
        let principal = s.principal.clone();
        drop(s);
        self.count_keys(principal.as_ref(), change);
        true
    }

    /// The latest validity granted to any session that holds a lock: until then some
    /// client may still act as a holder.
    pub fn holders_valid_until(&self) -> Option<Instant> {
        self.live
            .iter()
            .filter(|s| s.held.iter().any(|g| !g.waiter))
            .map(|s| s.life.valid_until())
            .max()
    }

    /// Records that `id`'s hold `key` at `revision` now has a value `value_bytes` long
    /// (an election leader's Proclaim), for its identity's `bytes`.
    pub fn set_value_bytes(&self, id: &str, key: &str, revision: i64, value_bytes: usize) {
        let Some(mut s) = self.live.get_mut(id) else {
            return;
        };
        let mut change = Tally::of(0, &s.held, -1);
        for g in s.held.iter_mut() {
            if g.key == key && g.revision == revision {
                g.value_bytes = value_bytes as u64;
            }
        }
        change.add(Tally::of(0, &s.held, 1));
        let principal = s.principal.clone();
        drop(s);
        self.count_keys(principal.as_ref(), change);
    }

    /// Whether `id` holds the grant `key` at `revision`.
    pub fn holds(&self, id: &str, key: &str, revision: i64) -> bool {
        self.live.get(id).is_some_and(|s| {
            s.held
                .iter()
                .any(|g| g.key == key && g.revision == revision)
        })
    }

    /// Forgets a key after it left the log (released, or a waiter key dequeued).
    pub fn forget_grant(&self, id: &str, key: &str, revision: i64) {
        self.forget_where(id, |g| g.key == key && g.revision == revision);
    }

    /// Forgets the records of `id` that `drop` picks.
    pub(super) fn forget_where(&self, id: &str, drop: impl Fn(&Grant) -> bool) {
        let Some(mut s) = self.live.get_mut(id) else {
            return;
        };
        let mut change = Tally::of(0, &s.held, -1);
        let id = s.id.clone();
        self.index(&id, &s.held, -1);
        s.held.retain(|g| !drop(g));
        change.add(Tally::of(0, &s.held, 1));
        self.index(&id, &s.held, 1);
        let principal = s.principal.clone();
        std::mem::drop(s);
        self.count_keys(principal.as_ref(), change);
    }

    /// Forgets, in the sessions `principal` opened (every session for `None`), the
    /// records that `gone` picks: keys no longer the session's (see
    /// [`crate::state::ProxyState::forget_gone_keys`]). Returns how many it forgot.
    pub fn forget_gone(&self, principal: Option<&str>, gone: impl Fn(&Grant) -> bool) -> usize {
        let ids: Vec<SessionId> = self
            .live
            .iter()
            .filter(|s| principal.is_none_or(|p| s.principal.as_deref() == Some(p)))
            .filter(|s| s.held.iter().any(&gone))
            .map(|s| s.key().clone())
            .collect();
        let mut forgot = 0;
        for id in ids {
            let before = self.live.get(&id).map_or(0, |s| s.held.len());
            self.forget_where(&id, &gone);
            forgot += before - self.live.get(&id).map_or(before, |s| s.held.len());
        }
        forgot
    }

    /// Forgets the records of `id`'s writes of `key` (created at `created`) made before
    /// revision `at`, which took the key from the session (an etcd API lease's key
    /// deleted or written without it). A write of the key at `at` or later is the
    /// session's again and stays, whatever order the two are learnt in.
    pub fn forget_detached(&self, id: &str, key: &str, created: i64, at: i64) {
        self.forget_where(id, |g| {
            g.key == key && g.revision == created && g.written != 0 && g.written < at
        });
    }

    /// Whether `id` has a record of `key` other than `except` (another attempt's, or a
    /// settled one).
    pub fn has_other_record(&self, id: &str, key: &str, except: &Grant) -> bool {
        self.live
            .get(id)
            .is_some_and(|s| s.held.iter().any(|g| g.key == key && g != except))
    }

    /// Forgets exactly `grant` (an unsettled record once its outcome is known).
    pub fn forget(&self, id: &str, grant: &Grant) {
        self.forget_where(id, |g| g == grant);
    }
}
