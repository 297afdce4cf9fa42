//! [`Grant`]: a key a session has in etcd, and what guards its delete.

use etcd_client::{Compare, CompareOp};

use super::txn::decode;
use crate::keyspace::{LockName, Mode};

/// A key a session has in etcd: a holder key (a grant), a waiter key of a fair class,
/// or an ephemeral key, with its create revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The lock (or, for an ephemeral key, the key's name).
    pub lock: LockName,
    pub key: String,
    /// The key's create revision; 0 while unsettled (see `made_by`).
    pub revision: i64,
    /// For an ephemeral key: the mod revision of the session's own last write of it (or
    /// of the move that brought it to the session's lease), which its clean-up and its
    /// moves compare. Any session may write a small key, and a write keeps the key's
    /// create revision and (from a session on the same proxy lease) its lease, so only
    /// the mod revision tells that no one wrote the key since. 0 for holder and waiter
    /// keys: only a grant creates them, so their create revision is theirs alone.
    pub written: i64,
    /// Not a hold (a waiter key or an ephemeral key): deleting it releases nothing.
    pub waiter: bool,
    /// Set while the transaction that would create the key has an unknown outcome (sent,
    /// not answered in time): the call it belongs to, so that reading the key tells
    /// whether it is this call's. Such a key is still the session's to delete.
    pub made_by: Option<MadeBy>,
    /// The length of the key's value as the session wrote it, for its identity's
    /// `bytes` limit; 0 where the session never wrote it here (a fence, a waiter key,
    /// a key a resume brought along).
    pub value_bytes: u64,
}

/// The name the keys etcd's own API writes with a lease are reported under in their
/// session's records ([`Grant::etcd_api_key`]): their own keys are any bytes.
pub const ETCD_API_KEYS: &str = "etcd-api";

/// The call behind an unsettled key, and what the key, found, must show to be its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MadeBy {
    pub session: String,
    pub proof: Proof,
    /// Tells two attempts of one call apart, so that the record of one whose outcome
    /// is still unknown is never taken for (and forgotten with) another's.
    pub attempt: u64,
}

/// What a key found after an unknown outcome shows when it is the call's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// A holder key: its record names the session and this acquire's call id.
    Call(String),
    /// A waiter key: its value is this waiter id.
    Waiter(String),
    /// An ephemeral key: its value has this SHA-256. Nothing in etcd names a small
    /// key's writer, so a write of the same value by another session on the same
    /// lease reads the same.
    Value([u8; 32]),
}

impl MadeBy {
    fn new(session: &str, proof: Proof) -> MadeBy {
        MadeBy {
            session: session.to_owned(),
            proof,
            attempt: rand::random(),
        }
    }

    /// Whether `value`, found at `key`, is what this call wrote.
    pub(super) fn shown_by(&self, key: &str, value: &[u8]) -> bool {
        match &self.proof {
            Proof::Call(call) => {
                decode(key, value).is_ok_and(|r| r.session == self.session && r.call == *call)
            }
            Proof::Waiter(waiter) => value == waiter.as_bytes(),
            Proof::Value(digest) => value_digest(value) == *digest,
        }
    }
}

impl Grant {
    /// The fence of `session` (its id, which follows the name rules), created at
    /// `revision`: deleted with the session's keys where the session ends.
    pub fn fence(session: &LockName, revision: i64) -> Grant {
        Grant {
            lock: session.clone(),
            key: crate::keyspace::session_fence_key(session.as_str()),
            revision,
            waiter: true,
            written: 0,
            made_by: None,
            value_bytes: 0,
        }
    }

    /// An ephemeral key `name` created at `revision`, last written by the session (or
    /// moved to its lease) at `written`.
    pub fn ephemeral(name: &LockName, revision: i64, written: i64) -> Grant {
        Grant {
            lock: name.clone(),
            key: crate::keyspace::kv_key(name),
            revision,
            waiter: true,
            written,
            made_by: None,
            value_bytes: 0,
        }
    }
}

impl Grant {
    /// The release marker a clean release of `lock` wrote at `revision` on the holder's
    /// lease. Only its write is ever read (as a watch event; see the release in `txn::guarded_delete`), so
    /// its proxy deletes it afterwards, guarded by that revision: without that, each
    /// lock name ever released would leave a marker until its proxy's lease ends.
    pub fn release_marker(lock: &LockName, revision: i64) -> Grant {
        Grant {
            lock: lock.clone(),
            key: lock.released_key(),
            revision,
            waiter: true,
            written: revision,
            made_by: None,
            value_bytes: 0,
        }
    }

    pub fn hold(lock: &LockName, mode: Mode, session: &str, revision: i64) -> Grant {
        Grant {
            lock: lock.clone(),
            key: lock.holder_key(mode, session),
            revision,
            waiter: false,
            written: 0,
            made_by: None,
            value_bytes: 0,
        }
    }

    pub fn waiting(lock: &LockName, mode: Mode, waiter: &str, revision: i64) -> Grant {
        Grant {
            lock: lock.clone(),
            key: lock.waiter_key(mode, waiter),
            revision,
            waiter: true,
            written: 0,
            made_by: None,
            value_bytes: 0,
        }
    }

    /// The hold call `call` of `session` asks for, before etcd has answered: recorded
    /// in the session first, so that a grant whose answer never arrives is still the
    /// session's (deleted when it ends, after a read shows it is this call's).
    pub fn unsettled_hold(lock: &LockName, mode: Mode, session: &str, call: &str) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Call(call.to_owned()))),
            ..Grant::hold(lock, mode, session, 0)
        }
    }

    /// The waiter key `waiter` of `session` before etcd has answered its enqueue.
    pub fn unsettled_waiter(lock: &LockName, mode: Mode, session: &str, waiter: &str) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Waiter(waiter.to_owned()))),
            ..Grant::waiting(lock, mode, waiter, 0)
        }
    }

    /// A key written with a lease through etcd's own API: its etcd key `key` (under
    /// `/k/`, or a record of the session's), which need not follow the lock-name rules.
    /// Only the key and its revisions guard and delete it; its `lock` is
    /// [`ETCD_API_KEYS`], the name such keys are reported under.
    pub fn etcd_api_key(key: String, revision: i64, written: i64) -> Grant {
        Grant {
            lock: LockName::parse(ETCD_API_KEYS).expect("a valid name"),
            key,
            revision,
            waiter: true,
            written,
            made_by: None,
            value_bytes: 0,
        }
    }

    /// The key `key` that `session` writes `value` to through etcd's own API, before
    /// etcd has answered the write (see [`Grant::etcd_api_key`]).
    pub fn unsettled_etcd_api_key(key: String, session: &str, value: &[u8]) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Value(value_digest(value)))),
            value_bytes: value.len() as u64,
            ..Grant::etcd_api_key(key, 0, 0)
        }
    }

    /// The ephemeral key `name` that `session` writes `value` to, before etcd has
    /// answered the write.
    pub fn unsettled_ephemeral(name: &LockName, session: &str, value: &[u8]) -> Grant {
        Grant {
            made_by: Some(MadeBy::new(session, Proof::Value(value_digest(value)))),
            value_bytes: value.len() as u64,
            ..Grant::ephemeral(name, 0, 0)
        }
    }

    /// The client lease record of a key written through etcd's own API (see
    /// `keyspace::etcd_leased_root`), which goes wherever the key goes.
    pub(super) fn lease_record(&self) -> Option<Vec<u8>> {
        if self.lock.as_str() != ETCD_API_KEYS {
            return None;
        }
        crate::keyspace::etcd_leased_key(self.key.as_bytes())
    }

    /// This record, of a key whose value is `value_bytes` long.
    pub fn with_value_bytes(self, value_bytes: usize) -> Grant {
        Grant {
            value_bytes: value_bytes as u64,
            ..self
        }
    }

    /// What the key takes in etcd, as far as its session knows: its name and value.
    pub fn bytes(&self) -> u64 {
        self.key.len() as u64 + self.value_bytes
    }

    /// Whether the key's outcome is still unknown.
    pub fn is_unsettled(&self) -> bool {
        self.made_by.is_some()
    }

    /// Whether the key is guarded by the session's last write of it (an ephemeral key)
    /// rather than by its create revision alone.
    pub fn written_guard(&self) -> bool {
        self.written != 0 || matches!(&self.made_by, Some(m) if matches!(m.proof, Proof::Value(_)))
    }

    /// The compares that hold while the key is still this record's on `lease`: for an
    /// ephemeral key, no one has written it since the session did; for any other, it is
    /// the same grant (create revision).
    pub(super) fn unchanged(&self, lease: i64) -> [Compare; 2] {
        let key = self.key.as_bytes();
        let revision = if self.written != 0 {
            Compare::mod_revision(key, CompareOp::Equal, self.written)
        } else {
            Compare::create_revision(key, CompareOp::Equal, self.revision)
        };
        [revision, Compare::lease(key, CompareOp::Equal, lease)]
    }
}

/// How an unsettled ephemeral write knows its value again (see [`Proof::Value`]).
fn value_digest(value: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(value).into()
}
