//! A session's move onto this proxy (Resume, docs/design.md §6): which of the keys a
//! client names are moved, which are only read, and, once etcd has answered, what the
//! stay records, what it reports lost and what an earlier stay here leaves to delete.
//!
//! [`Plan`] holds only these decisions; `handover::resume_named` does the I/O around
//! them (reading exclusive holders, choosing the lease, the move transactions).

use lockcell_cell::locklog::{Grant, Moved, Resume, NOT_ITS_OWN};
use lockcell_cell::{LockName, Mode};
use lockcell_proto::v1::{HeldKey, HeldKind, LostKey};

use crate::errors::ProxyError;

/// Most keys one Resume may name: far above what one session holds, low enough that a
/// resume is a bounded amount of etcd work.
pub const MAX_RESUME_KEYS: usize = 4096;

/// The keys a resume names, as grants, and the lease each is to be moved from.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Each named key, in the order named, with the lease it is on as far as the client
    /// knows, or [`NOT_ITS_OWN`] when nothing proves it the session's own.
    pub named: Vec<(Grant, i64)>,
    /// The same, each key once (etcd refuses one key twice in a transaction): what the
    /// move transactions carry, in this order.
    pub moving: Vec<(Grant, i64)>,
}

/// What a move that went through comes to.
#[derive(Debug, Default, PartialEq)]
pub struct Landed {
    /// The named keys that did not move, with why, in the order named.
    pub lost: Vec<LostKey>,
    /// Records the stay must forget: the keys lost.
    pub forget: Vec<Grant>,
    /// Ephemeral keys the move wrote: the stay's record of each, now naming that write
    /// (what its clean-up and next move compare), and the key as the client is told.
    pub rewritten: Vec<(Grant, HeldKey)>,
}

impl Plan {
    /// The plan for `keys` of session `session`, each on its own `lease_id` or else on
    /// `from_lease`. Refuses (naming the key and the rule) a key that is no lock name
    /// or small key, has no positive revision or an unknown kind, or too many keys.
    pub fn new(session: &str, keys: &[HeldKey], from_lease: i64) -> Result<Plan, ProxyError> {
        if keys.len() > MAX_RESUME_KEYS {
            return Err(ProxyError::BadArgument(format!(
                "a resume of session {session:?} names {} keys, over the limit of {MAX_RESUME_KEYS}",
                keys.len()
            )));
        }
        let named = keys
            .iter()
            .map(|key| {
                let from = if key.lease_id != 0 {
                    key.lease_id
                } else {
                    from_lease
                };
                // Not proven its own: an ephemeral key without the session's last
                // write of it (another session may have written it since), or a key
                // said to be on no lease (a persistent key, no session's).
                let unproven = key.kind == HeldKind::Ephemeral as i32 && key.mod_revision == 0;
                let from = if unproven || from == 0 {
                    NOT_ITS_OWN
                } else {
                    from
                };
                held_grant(session, key).map(|g| (g, from))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut moving: Vec<(Grant, i64)> = Vec::with_capacity(named.len());
        for (grant, from) in &named {
            if !moving.iter().any(|(g, _)| g.key == grant.key) {
                moving.push((grant.clone(), *from));
            }
        }
        Ok(Plan { named, moving })
    }

    /// What the stay holds while the move runs: the keys proven its own. A key that is
    /// not is never the stay's, not even meanwhile (a close would delete it under this
    /// stay's lease, which may be its real owner's).
    pub fn held(&self) -> Vec<Grant> {
        self.moving
            .iter()
            .filter(|(_, from)| *from != NOT_ITS_OWN)
            .map(|(g, _)| g.clone())
            .collect()
    }

    /// What became of `key`'s move, given the move's `outcomes` (in the order of
    /// [`Plan::moving`]); `None`: not named.
    fn outcome<'a>(&self, outcomes: &'a [Moved], key: &str) -> Option<&'a Moved> {
        let i = self.moving.iter().position(|(g, _)| g.key == key)?;
        outcomes.get(i)
    }

    /// What the move's `outcomes` come to for the named `keys` (as the client sent
    /// them), moved onto `lease`.
    pub fn landed(&self, keys: Vec<HeldKey>, outcomes: &[Moved], lease: i64) -> Landed {
        let mut landed = Landed::default();
        for (key, (grant, _)) in keys.into_iter().zip(&self.named) {
            if let Some(Err(reason)) = self.outcome(outcomes, &grant.key) {
                landed.forget.push(grant.clone());
                landed.lost.push(LostKey {
                    key: Some(key),
                    reason: reason.clone(),
                });
            }
        }
        for ((grant, _), moved) in self.moving.iter().zip(outcomes) {
            let Ok(written) = moved else { continue };
            if grant.written == 0 || *written == grant.written {
                continue;
            }
            let now = Grant {
                written: *written,
                ..grant.clone()
            };
            let told = HeldKey {
                kind: HeldKind::Ephemeral as i32,
                name: grant.lock.as_str().to_owned(),
                revision: grant.revision,
                lease_id: lease,
                mod_revision: *written,
            };
            landed.rewritten.push((now, told));
        }
        landed
    }

    /// What an earlier stay of the session here had that this move does not name, nor
    /// the session's fence `fence_key`: keys the client never heard of (a grant whose
    /// reply was lost, an attempt still unsettled). After a move whose outcome is
    /// unknown these alone are known to be where they were and no stay's any more, so
    /// they are deleted under the earlier stay's lease; a named key may have moved, and
    /// the client may still act on it.
    pub fn unnamed(&self, earlier: Vec<Grant>, fence_key: &str) -> Vec<Grant> {
        earlier
            .into_iter()
            .filter(|g| g.key != fence_key && !self.moving.iter().any(|(m, _)| m.key == g.key))
            .collect()
    }

    /// What an earlier stay of the session here had that did not move here (keys the
    /// client never heard of, such as a grant whose reply was lost): deleted under that
    /// stay's lease. Never a key that moved, nor the session's fence `fence_key`.
    pub fn left_behind(
        &self,
        earlier: Vec<Grant>,
        outcomes: &[Moved],
        fence_key: &str,
    ) -> Vec<Grant> {
        earlier
            .into_iter()
            .filter(|g| {
                !matches!(self.outcome(outcomes, &g.key), Some(Ok(_))) && g.key != fence_key
            })
            .collect()
    }
}

/// Why a resume of `session` that moved nothing was refused.
pub fn refusal(session: &str, refused: Resume) -> ProxyError {
    match refused {
        Resume::Ended { reason } => ProxyError::ExpiredSession {
            id: session.to_owned(),
            reason,
        },
        Resume::FenceMoved { revision, lease } => ProxyError::FencedOut {
            session: session.to_owned(),
            revision,
            lease,
        },
        Resume::TurnedAway(why) => ProxyError::Refused(format!(
            "etcd is too busy to resume session {session:?} now ({why}); resume later"
        )),
        Resume::Moved { .. } => unreachable!("a move is not a refusal"),
    }
}

/// A session id as proxies hand them out (hex digits), as a name for its fence key.
pub fn check_session_id(id: &str) -> Result<LockName, ProxyError> {
    let bad = || {
        ProxyError::BadArgument(format!(
            "session id {id:?} is not one a proxy hands out (1 to 64 hex digits)"
        ))
    };
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    LockName::parse(id).map_err(|_| bad())
}

/// The grant a held key names, checked like any lock name or small key.
fn held_grant(session: &str, key: &HeldKey) -> Result<Grant, ProxyError> {
    let bad = |what: &str| {
        ProxyError::BadArgument(format!(
            "held key {:?} of session {session:?}: {what}",
            key.name
        ))
    };
    if key.revision <= 0 {
        return Err(bad("its revision must be positive"));
    }
    let name = LockName::parse(&key.name).map_err(|e| bad(&e.to_string()))?;
    Ok(match HeldKind::try_from(key.kind) {
        Ok(HeldKind::Exclusive) => Grant::hold(&name, Mode::Exclusive, session, key.revision),
        Ok(HeldKind::Shared) => Grant::hold(&name, Mode::Shared, session, key.revision),
        Ok(HeldKind::Ephemeral) => {
            if key.mod_revision != 0 && key.mod_revision < key.revision {
                return Err(bad(&format!(
                    "its mod revision {} is before its create revision {}",
                    key.mod_revision, key.revision
                )));
            }
            Grant::ephemeral(&name, key.revision, key.mod_revision)
        }
        Err(_) => return Err(bad(&format!("unknown kind {}", key.kind))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(kind: HeldKind, name: &str, revision: i64) -> HeldKey {
        HeldKey {
            kind: kind as i32,
            name: name.to_owned(),
            revision,
            lease_id: 0,
            mod_revision: 0,
        }
    }

    fn member(name: &str, revision: i64, written: i64, lease: i64) -> HeldKey {
        HeldKey {
            mod_revision: written,
            lease_id: lease,
            ..held(HeldKind::Ephemeral, name, revision)
        }
    }

    #[test]
    fn held_keys_name_the_keys_the_session_has() {
        let lock = LockName::parse("jobs/a").unwrap();
        let g = held_grant("ab12", &held(HeldKind::Exclusive, "jobs/a", 7)).unwrap();
        assert_eq!(g, Grant::hold(&lock, Mode::Exclusive, "ab12", 7));
        let g = held_grant("ab12", &held(HeldKind::Shared, "jobs/a", 8)).unwrap();
        assert_eq!(g.key, lock.holder_key(Mode::Shared, "ab12"));
        let g = held_grant("ab12", &held(HeldKind::Ephemeral, "members/x/1", 9)).unwrap();
        assert_eq!(
            g.key,
            lockcell_cell::keyspace::kv_key(&LockName::parse("members/x/1").unwrap())
        );
    }

    #[test]
    fn bad_held_keys_and_ids_are_refused_by_name() {
        let e = held_grant("ab12", &held(HeldKind::Exclusive, "a//b", 7)).unwrap_err();
        assert!(e.to_string().contains("\"a//b\""), "{e}");
        let e = held_grant("ab12", &held(HeldKind::Exclusive, "a", 0)).unwrap_err();
        assert!(e.to_string().contains("revision must be positive"), "{e}");
        let e = held_grant(
            "ab12",
            &HeldKey {
                kind: 9,
                ..held(HeldKind::Exclusive, "a", 1)
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown kind 9"), "{e}");
        assert!(check_session_id("").is_err());
        assert!(check_session_id("../x").is_err());
        assert!(check_session_id("0123456789abcdef0123456789abcdef").is_ok());
        let many = vec![held(HeldKind::Exclusive, "a", 1); MAX_RESUME_KEYS + 1];
        let e = Plan::new("ab12", &many, 5).unwrap_err();
        assert!(e.to_string().contains("over the limit of 4096"), "{e}");
    }

    #[test]
    fn only_keys_proven_the_sessions_own_move_and_each_moves_once() {
        let keys = vec![
            held(HeldKind::Exclusive, "jobs/a", 7),
            held(HeldKind::Exclusive, "jobs/a", 7),
            member("members/x", 9, 12, 0),
            member("members/y", 10, 0, 0),
            HeldKey {
                lease_id: 0x77,
                ..held(HeldKind::Shared, "jobs/b", 11)
            },
        ];
        let plan = Plan::new("ab12", &keys, 0x55).unwrap();
        assert_eq!(plan.named.len(), 5);
        let from: Vec<i64> = plan.moving.iter().map(|(_, from)| *from).collect();
        assert_eq!(
            from,
            vec![0x55, 0x55, NOT_ITS_OWN, 0x77],
            "a key named twice moves once; an ephemeral key without its write is only read; \
             a key's own lease comes before the resume's"
        );
        let held: Vec<String> = plan.held().into_iter().map(|g| g.key).collect();
        assert!(!held.iter().any(|k| k.ends_with("members/y")), "{held:?}");
        assert_eq!(held.len(), 3);
        let unleased = Plan::new("ab12", &[held_key_on(0)], 0).unwrap();
        assert_eq!(
            unleased.moving[0].1, NOT_ITS_OWN,
            "a key on no lease is no session's"
        );
    }

    fn held_key_on(lease: i64) -> HeldKey {
        HeldKey {
            lease_id: lease,
            ..held(HeldKind::Exclusive, "jobs/c", 3)
        }
    }

    #[test]
    fn a_landed_move_reports_each_lost_key_and_renames_rewritten_ones() {
        let keys = vec![
            held(HeldKind::Exclusive, "jobs/a", 7),
            member("members/x", 9, 12, 0x55),
            held(HeldKind::Exclusive, "jobs/gone", 8),
            member("members/same", 4, 6, 0x55),
        ];
        let plan = Plan::new("ab12", &keys, 0x55).unwrap();
        let outcomes: Vec<Moved> = vec![Ok(0), Ok(30), Err("granted again".into()), Ok(6)];
        let landed = plan.landed(keys.clone(), &outcomes, 0x99);
        assert_eq!(landed.lost.len(), 1);
        assert_eq!(landed.lost[0].key.as_ref().unwrap().name, "jobs/gone");
        assert_eq!(landed.lost[0].reason, "granted again");
        assert_eq!(landed.forget, vec![plan.named[2].0.clone()]);
        assert_eq!(landed.rewritten.len(), 1, "only a key the move wrote anew");
        let (record, told) = &landed.rewritten[0];
        assert_eq!(record.written, 30);
        assert_eq!(
            (told.name.as_str(), told.lease_id, told.mod_revision),
            ("members/x", 0x99, 30)
        );
    }

    #[test]
    fn an_earlier_stay_leaves_behind_only_what_did_not_move_and_never_the_fence() {
        let keys = vec![held(HeldKind::Exclusive, "jobs/a", 7)];
        let plan = Plan::new("ab12", &keys, 0x55).unwrap();
        let moved = plan.named[0].0.clone();
        let lost_reply = Grant::hold(
            &LockName::parse("jobs/z").unwrap(),
            Mode::Exclusive,
            "ab12",
            40,
        );
        let fence = Grant::fence(&LockName::parse("ab12").unwrap(), 41);
        let behind = plan.left_behind(
            vec![moved, lost_reply.clone(), fence.clone()],
            &[Ok(0)],
            &fence.key,
        );
        assert_eq!(behind, vec![lost_reply]);
    }

    #[test]
    fn a_move_without_an_answer_leaves_behind_only_what_it_does_not_name() {
        let keys = vec![held(HeldKind::Exclusive, "jobs/a", 7)];
        let plan = Plan::new("ab12", &keys, 0x55).unwrap();
        // Named: it may have moved, and the client may act on it still.
        let named = plan.named[0].0.clone();
        let lost_reply = Grant::hold(
            &LockName::parse("jobs/z").unwrap(),
            Mode::Exclusive,
            "ab12",
            40,
        );
        let on_its_way = Grant::unsettled_hold(
            &LockName::parse("jobs/y").unwrap(),
            Mode::Exclusive,
            "ab12",
            "c9",
        );
        let fence = Grant::fence(&LockName::parse("ab12").unwrap(), 41);
        let behind = plan.unnamed(
            vec![named, lost_reply.clone(), on_its_way.clone(), fence.clone()],
            &fence.key,
        );
        assert_eq!(behind, vec![lost_reply, on_its_way]);
    }

    mod properties {
        use super::super::*;
        use super::{held, member};
        use proptest::prelude::*;

        proptest! {
            /// A session id passes only as 1 to 64 hex digits.
            #[test]
            fn a_session_id_passes_only_as_hex_digits(id in "\\PC{0,70}|[0-9a-fA-F]{0,70}") {
                let fine = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit());
                prop_assert_eq!(check_session_id(&id).is_ok(), fine, "{:?}", id);
            }

            /// Whatever keys a resume names and whatever became of each, a key is
            /// either the stay's (moved) or reported lost and forgotten, never both
            /// and never neither; and only keys proven the session's own are held.
            #[test]
            fn every_named_key_is_kept_or_reported_lost(
                names in proptest::collection::vec((0u8..6, 1i64..5, any::<bool>(), any::<bool>()), 0..12),
                fails in proptest::collection::vec(any::<bool>(), 12),
            ) {
                let keys: Vec<HeldKey> = names
                    .iter()
                    .map(|(n, rev, ephemeral, written)| {
                        if *ephemeral {
                            member(&format!("members/m{n}"), *rev, if *written { rev + 1 } else { 0 }, 0)
                        } else {
                            held(HeldKind::Exclusive, &format!("jobs/l{n}"), *rev)
                        }
                    })
                    .collect();
                let plan = Plan::new("ab12", &keys, 0x55).unwrap();
                let outcomes: Vec<Moved> = plan
                    .moving
                    .iter()
                    .zip(&fails)
                    .map(|((g, from), fail)| {
                        if *fail || *from == NOT_ITS_OWN { Err("lost".into()) } else { Ok(g.written) }
                    })
                    .collect();
                for (g, from) in &plan.moving {
                    prop_assert_eq!(plan.held().contains(g), *from != NOT_ITS_OWN);
                }
                let landed = plan.landed(keys.clone(), &outcomes, 0x99);
                for (i, (g, _)) in plan.named.iter().enumerate() {
                    let j = plan.moving.iter().position(|(m, _)| m.key == g.key).unwrap();
                    let lost = landed.lost.iter().any(|l| l.key.as_ref() == Some(&keys[i]));
                    prop_assert_eq!(lost, outcomes[j].is_err());
                    prop_assert_eq!(landed.forget.contains(g), outcomes[j].is_err());
                }
            }
        }
    }
}
