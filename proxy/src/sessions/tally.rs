//! What each identity's sessions hold, counted as they open, hold, forget and end:
//! for the per-identity limits.

use super::*;

impl SessionTable {
    /// What the sessions `principal` opened have here: how many, and how many keys.
    pub fn usage(&self, principal: &str) -> Tally {
        self.tally.get(principal).map(|t| *t).unwrap_or_default()
    }

    /// Counts `s` in (`sign` 1) or out (-1) of its principal's tally.
    pub(super) fn count(&self, s: &Session, sign: i64) {
        self.count_keys(s.principal.as_ref(), Tally::of(sign, &s.held, sign));
        self.index(&s.id, &s.held, sign);
    }

    /// Adds (`sign` 1) or takes out (-1) session `id`'s records in `held` to or from
    /// the index of ephemeral keys.
    pub(super) fn index(&self, id: &SessionId, held: &[Grant], sign: i64) {
        for g in held.iter().filter(|g| tracked(g)) {
            if sign > 0 {
                self.ephemeral
                    .entry(g.key.clone())
                    .or_default()
                    .push(id.clone());
                continue;
            }
            let Some(mut ids) = self.ephemeral.get_mut(&g.key) else {
                continue;
            };
            if let Some(i) = ids.iter().position(|x| x == id) {
                ids.swap_remove(i);
            }
            let empty = ids.is_empty();
            drop(ids);
            if empty {
                self.ephemeral.remove_if(&g.key, |_, ids| ids.is_empty());
            }
        }
    }

    /// Forgets the records of lockcell's ephemeral key `key`, created at `created`,
    /// written before revision `at`, which deleted it (or wrote it on no lease): the key
    /// is no longer their sessions', and no longer counts against their identities.
    pub fn forget_lost(&self, key: &str, created: i64, at: i64) {
        let ids: Vec<SessionId> = self
            .ephemeral
            .get(key)
            .map(|ids| ids.clone())
            .unwrap_or_default();
        for id in ids {
            self.forget_where(&id, |g| {
                tracked(g) && g.key == key && g.revision == created && g.written < at
            });
        }
    }

    pub(super) fn count_keys(&self, principal: Option<&Arc<str>>, change: Tally) {
        let Some(principal) = principal else {
            return;
        };
        if change == Tally::default() {
            return;
        }
        let mut tally = self.tally.entry(principal.clone()).or_default();
        tally.add(change);
        if *tally == Tally::default() {
            drop(tally);
            self.tally
                .remove_if(principal, |_, t| *t == Tally::default());
        }
    }
}

/// One identity's live sessions, the keys they hold, and what those keys take
/// ([`Grant::bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub sessions: i64,
    pub keys: i64,
    pub bytes: i64,
}

impl Tally {
    /// What `held` counts for: `sessions` sessions (1, 0 or -1) and, `sign` 1 or -1,
    /// its keys and their bytes.
    pub(super) fn of(sessions: i64, held: &[Grant], sign: i64) -> Tally {
        Tally {
            sessions,
            keys: sign * held.len() as i64,
            bytes: sign * held.iter().map(|g| g.bytes() as i64).sum::<i64>(),
        }
    }

    pub(super) fn add(&mut self, other: Tally) {
        self.sessions += other.sessions;
        self.keys += other.keys;
        self.bytes += other.bytes;
    }
}
