//! Writes whose etcd answer may never come. Such a write may still be applied, so the
//! key it would create is recorded in the session as unsettled before it goes out
//! (see `Grant::unsettled_hold` and the others): whatever etcd did, the key ends up
//! owned by the session, read back now or looked for when the session ends.

use std::future::Future;

use lockcell_cell::locklog::{Grant, LockLog};
use lockcell_cell::CellError;

use crate::cleanup::CleanupQueue;
use crate::sessions::{Session, SessionTable};

/// What settling a write takes: the sessions that own keys, the lock log to read a key
/// back, and the clean-ups that take a key no session owns any more.
#[derive(Clone, Copy)]
pub struct Owners<'a> {
    pub sessions: &'a SessionTable,
    pub locklog: &'a LockLog,
    pub cleanup: &'a CleanupQueue,
}

/// Whether a failed etcd call may have been applied all the same: it went out and no
/// answer came back (a deadline, a broken connection). An answer, even a refusal, or a
/// request etcd turned away before proposing it, settles it.
pub fn unknown_outcome(e: &CellError) -> bool {
    matches!(e, CellError::Timeout { .. } | CellError::Etcd { .. }) && !e.turned_away()
}

/// Runs `write`, which may create `pending`'s key, with that key recorded in `session`
/// as unsettled while it is on its way. Answered, the record goes (the caller records
/// what came of it); not answered (`unknown` says so of its error), the key is read
/// back ([`settle_unknown`]). `None`: the session is gone, nothing was written.
pub async fn owned_write<T, E>(
    owners: Owners<'_>,
    session: &Session,
    pending: Grant,
    write: impl Future<Output = Result<T, E>>,
    unknown: impl Fn(&E) -> bool,
) -> Option<Result<T, E>> {
    if !owners
        .sessions
        .record_grant(&session.id, session.incarnation, pending.clone(), None)
    {
        return None;
    }
    let outcome = write.await;
    match &outcome {
        Err(e) if unknown(e) => settle_unknown(owners, session, pending).await,
        _ => owners.sessions.forget(&session.id, &pending),
    }
    Some(outcome)
}

/// After a write whose outcome is unknown: reads whether it was applied. Found, the key
/// is recorded as the session's (a retried call gets a grant back; it goes when the
/// session ends); not found, or not readable now, the unsettled record stays, and the
/// session's end looks again.
pub async fn settle_unknown(owners: Owners<'_>, session: &Session, pending: Grant) {
    match owners
        .locklog
        .settle(std::slice::from_ref(&pending), session.lease)
        .await
    {
        Ok(found) => {
            for key in found {
                if owners
                    .sessions
                    .record_grant(&session.id, session.incarnation, key.clone(), None)
                {
                    owners.sessions.forget(&session.id, &pending);
                } else {
                    owners.cleanup.push(session.lease, vec![key]);
                }
            }
        }
        Err(e) => {
            tracing::warn!(session.id = %session.id, key = %pending.key, error = %e, "a write's outcome is unknown; the session's end looks for it again");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use lockcell_cell::keyspace::{LockName, Mode};
    use lockcell_cell::locklog::memory::MemoryStore;
    use lockcell_cell::locklog::{Acquired, HolderRecord};
    use tokio::time::Instant;

    use super::*;

    const LEASE: i64 = 0x1ea5e;

    struct Held {
        store: Arc<MemoryStore>,
        sessions: SessionTable,
        locklog: LockLog,
        cleanup: CleanupQueue,
        session: Session,
    }

    impl Held {
        fn new() -> Self {
            let store = Arc::new(MemoryStore::new());
            store.grant_lease(LEASE);
            let now = Instant::now();
            let session = Session::arriving(
                "s".into(),
                "test".into(),
                Duration::from_secs(9),
                (0, LEASE),
                Vec::new(),
                now,
                now,
            );
            let sessions = SessionTable::default();
            sessions.insert(session.clone());
            Held {
                locklog: LockLog::over(store.clone(), Duration::from_secs(1)),
                store,
                sessions,
                cleanup: CleanupQueue::default(),
                session,
            }
        }

        fn owners(&self) -> Owners<'_> {
            Owners {
                sessions: &self.sessions,
                locklog: &self.locklog,
                cleanup: &self.cleanup,
            }
        }

        /// The session's call `c1` asks for `lock`, as an acquire does.
        async fn acquire(&self, lock: &LockName) -> Option<Result<Acquired, CellError>> {
            let record = record();
            let pending = Grant::unsettled_hold(lock, Mode::Exclusive, "s", "c1");
            let write = self
                .locklog
                .acquire(lock, Mode::Exclusive, LEASE, &record, None, 0);
            owned_write(
                self.owners(),
                &self.session,
                pending,
                write,
                unknown_outcome,
            )
            .await
        }

        fn held(&self) -> Vec<Grant> {
            self.sessions.peek("s").expect("the session").held
        }
    }

    fn record() -> HolderRecord {
        HolderRecord {
            session: "s".into(),
            call: "c1".into(),
            ..HolderRecord::default()
        }
    }

    #[tokio::test]
    async fn a_grant_whose_answer_was_lost_is_read_back_as_the_sessions() {
        let held = Held::new();
        let lock = LockName::parse("jobs/x").unwrap();
        held.store.lose_answers(1);
        let outcome = held.acquire(&lock).await.expect("the session is there");
        assert!(outcome.is_err());
        let key = held.store.key(&lock.exclusive_key()).expect("it landed");
        let grants = held.held();
        assert_eq!(grants.len(), 1, "{grants:?}");
        assert!(!grants[0].is_unsettled());
        assert_eq!(grants[0].revision, key.create_revision);
    }

    #[tokio::test]
    async fn a_lost_answer_that_cannot_be_read_back_stays_the_sessions_unsettled() {
        let held = Held::new();
        let lock = LockName::parse("jobs/x").unwrap();
        held.store.lose_answers(1);
        // The read back fails too: etcd went away right after applying the write.
        let write = async {
            let answer = held
                .locklog
                .acquire(&lock, Mode::Exclusive, LEASE, &record(), None, 0)
                .await;
            held.store.set_down(true);
            answer
        };
        let pending = Grant::unsettled_hold(&lock, Mode::Exclusive, "s", "c1");
        let outcome = owned_write(
            held.owners(),
            &held.session,
            pending,
            write,
            unknown_outcome,
        )
        .await
        .expect("the session is there");
        assert!(outcome.is_err());
        let grants = held.held();
        assert!(
            grants.len() == 1 && grants[0].is_unsettled(),
            "the key is no one's: {grants:?}"
        );
    }

    #[tokio::test]
    async fn a_key_found_after_its_session_ended_is_cleaned_up() {
        let held = Held::new();
        let lock = LockName::parse("jobs/x").unwrap();
        held.store.lose_answers(1);
        let pending = Grant::unsettled_hold(&lock, Mode::Exclusive, "s", "c1");
        assert!(held
            .locklog
            .acquire(&lock, Mode::Exclusive, LEASE, &record(), None, 0)
            .await
            .is_err());
        held.sessions.end("s", "closed".into());
        held.sessions
            .take_expired(Instant::now() + Duration::from_secs(60));
        settle_unknown(held.owners(), &held.session, pending).await;
        assert_eq!(
            held.cleanup.len(),
            1,
            "the key found is queued for deletion"
        );
    }
}
