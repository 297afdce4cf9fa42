//! The safety checker of fault runs: every client process records what it believed and
//! did, and the checker looks for the one thing a lock service must never allow — two
//! clients acting as holder of one lock at once.
//!
//! Times are nanoseconds of the machine's monotonic clock (`CLOCK_MONOTONIC`), the same
//! for every process on the machine, so records of different clients compare.

use std::collections::{BTreeMap, HashMap};

use lockcell_proto::FencingToken;
use serde::{Deserialize, Serialize};

/// One line of a client's record (JSON lines).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// A grant arrived; the client believes it holds `lock` until `deadline_ns` (its
    /// session's deadline, which renewals may extend: see the acts).
    Grant {
        client: String,
        lock: String,
        token: String,
        at_ns: u64,
        deadline_ns: u64,
    },
    /// The client acted as holder (wrote to the fenced resource), believing its session
    /// valid until `deadline_ns`.
    Act {
        client: String,
        lock: String,
        token: String,
        at_ns: u64,
        deadline_ns: u64,
        /// Whether the fenced resource took the write.
        accepted: bool,
    },
    /// The client stopped believing it holds the lock (before sending a release, or on
    /// seeing its deadline pass).
    End {
        client: String,
        lock: String,
        token: String,
        at_ns: u64,
        why: String,
    },
    /// The client saw the service break a promise it can judge alone (a second grant of
    /// a lock its session held): a violation as it stands.
    Broken {
        client: String,
        lock: String,
        what: String,
        at_ns: u64,
    },
    /// A small-key write the service acknowledged: `key` holds `value` at `revision`.
    KvWrite {
        client: String,
        key: String,
        value: String,
        revision: i64,
        at_ns: u64,
        /// When the acknowledgement arrived (0: not recorded).
        #[serde(default)]
        acked_ns: u64,
        /// For an ephemeral key: its session's deadline as the acknowledgement left it
        /// (0: a persistent key). Until then the key is the session's and stays.
        #[serde(default)]
        deadline_ns: u64,
    },
    /// The client closes its session (recorded before the close is sent): its
    /// ephemeral keys go.
    Closed { client: String, at_ns: u64 },
    /// A linearizable read of every key under `prefix`, sent at `began_ns`: each key
    /// found with its mod revision and value.
    Read {
        client: String,
        prefix: String,
        began_ns: u64,
        entries: Vec<(String, i64, String)>,
        /// The cell the read's revisions are of (its position, `cluster/epoch/route
        /// epoch`; empty: not said).
        #[serde(default)]
        cell: String,
    },
    /// A watch of `prefix` (re)started: it delivers every change from revision `from` on
    /// (the first, or after an error that ended the previous one), in `cell` (as for
    /// `Read`).
    WatchFrom {
        client: String,
        prefix: String,
        from: i64,
        #[serde(default)]
        cell: String,
    },
    /// A batch the watch of `prefix` delivered: every change through revision
    /// `through`, as (revision, key, put) in delivery order.
    Watched {
        client: String,
        #[serde(default)]
        prefix: String,
        through: i64,
        events: Vec<(i64, String, bool)>,
    },
}

/// What a check found.
#[derive(Debug, Default)]
pub struct Verdict {
    pub grants: usize,
    pub acts: usize,
    /// Acts the fenced resource refused: a holder that decided to act before its
    /// deadline but whose write arrived after a newer holder's (a pause between the
    /// check and the write). Fencing at work, not a violation.
    pub refused: usize,
    /// Every broken rule, in words; empty when the run was safe.
    pub violations: Vec<String>,
}

/// One grant as the client believed it.
#[derive(Debug)]
struct Hold {
    client: String,
    token: FencingToken,
    start: u64,
    /// When the client stopped believing: its end record, or else the latest deadline
    /// it saw, whichever is earlier.
    end: u64,
}

/// Checks the records of every client of a run.
///
/// - no two clients' holds of one lock overlap (a hold lasts from the grant's arrival
///   until the client stopped believing, never past the latest deadline it saw);
/// - every act was decided before the deadline the client believed at the time;
/// - a lock's tokens rise with every grant, in the order the grants arrived;
/// - every grant is a new one: no token of a lock is handed out twice (a session's
///   second acquire once got its first grant back, and one release ended both);
/// - nothing a client saw the service break on its own ([`Record::Broken`]).
///
/// A grant whose reply arrived at or after the deadline it carried (a reply held up on
/// a slow link while the session ran out) was never a hold: the client knew at once it
/// could not act on it, so it takes no part in the order and overlap rules (an act on
/// it is still caught, as past its deadline).
pub fn check(records: &[Record]) -> Verdict {
    let mut verdict = Verdict::default();
    // (lock, client, token) -> hold under construction
    let mut holds: HashMap<(String, String, String), Hold> = HashMap::new();
    let mut ends: HashMap<(String, String, String), u64> = HashMap::new();
    // (lock, token) -> the client it was granted to
    let mut granted: HashMap<(String, String), String> = HashMap::new();
    let token_of = |t: &str, v: &mut Verdict| -> Option<FencingToken> {
        match t.parse() {
            Ok(t) => Some(t),
            Err(_) => {
                v.violations.push(format!("unreadable token {t:?}"));
                None
            }
        }
    };
    for record in records {
        match record {
            Record::Grant {
                client,
                lock,
                token,
                at_ns,
                deadline_ns,
            } => {
                verdict.grants += 1;
                let Some(t) = token_of(token, &mut verdict) else {
                    continue;
                };
                if let Some(first) = granted.insert((lock.clone(), token.clone()), client.clone()) {
                    verdict.violations.push(format!(
                        "{lock}: token {token} was granted twice (to {first}, then to {client})"
                    ));
                }
                holds
                    .entry((lock.clone(), client.clone(), token.clone()))
                    .and_modify(|h| h.end = h.end.max(*deadline_ns))
                    .or_insert(Hold {
                        client: client.clone(),
                        token: t,
                        start: *at_ns,
                        end: *deadline_ns,
                    });
            }
            Record::Act {
                client,
                lock,
                token,
                at_ns,
                deadline_ns,
                accepted,
            } => {
                verdict.acts += 1;
                if at_ns >= deadline_ns {
                    verdict.violations.push(format!(
                        "{client} acted on {lock} with token {token} at {at_ns} ns, past its deadline {deadline_ns} ns"
                    ));
                }
                if !accepted {
                    verdict.refused += 1;
                }
                match holds.get_mut(&(lock.clone(), client.clone(), token.clone())) {
                    Some(h) => h.end = h.end.max(*deadline_ns),
                    None => verdict.violations.push(format!(
                        "{client} acted on {lock} with token {token} without a grant"
                    )),
                }
            }
            Record::End {
                client,
                lock,
                token,
                at_ns,
                ..
            } => {
                ends.insert((lock.clone(), client.clone(), token.clone()), *at_ns);
            }
            Record::Broken {
                client,
                lock,
                what,
                at_ns,
            } => verdict
                .violations
                .push(format!("{client} on {lock} at {at_ns} ns: {what}")),
            // Checked against the store's history by the run (see `kvcheck`).
            Record::KvWrite { .. }
            | Record::Closed { .. }
            | Record::Read { .. }
            | Record::WatchFrom { .. }
            | Record::Watched { .. } => {}
        }
    }
    let mut by_lock: BTreeMap<String, Vec<Hold>> = BTreeMap::new();
    for (key, mut hold) in holds {
        if let Some(end) = ends.get(&key) {
            hold.end = hold.end.min(*end);
        }
        by_lock.entry(key.0).or_default().push(hold);
    }
    for (lock, mut holds) in by_lock {
        holds.retain(|h| h.end > h.start);
        holds.sort_by_key(|h| (h.start, h.token));
        for pair in holds.windows(2) {
            if pair[1].token <= pair[0].token {
                verdict.violations.push(format!(
                    "{lock}: token {} (to {}) arrived after token {} (to {})",
                    pair[1].token, pair[1].client, pair[0].token, pair[0].client
                ));
            }
        }
        let mut latest: Option<&Hold> = None;
        for hold in &holds {
            if let Some(prev) = latest {
                if hold.start < prev.end {
                    verdict.violations.push(format!(
                        "{lock}: {} held it with token {} until {} ns, {} held it with token {} from {} ns",
                        prev.client, prev.token, prev.end, hold.client, hold.token, hold.start
                    ));
                }
            }
            if latest.is_none_or(|p| hold.end > p.end) {
                latest = Some(hold);
            }
        }
    }
    verdict
}

/// Now, in nanoseconds of the machine's monotonic clock, as the harness reads it (the
/// harness never runs with a faked clock; a client that may reads it by the system
/// call).
pub fn now_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is there");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// A change to a holder or waiter key (`/l/`, `/q/`) as the run's watch on the store
/// delivered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreEvent {
    /// When the watch delivered it (the machine's monotonic clock): at or after the
    /// change was made, never before.
    pub at_ns: u64,
    /// The store revision of the change.
    pub revision: i64,
    pub key: String,
    /// The create revision of the key put, or of the key deleted.
    pub create_revision: i64,
    pub deleted: bool,
}

/// What a run's checks against the store's history are told besides the records.
#[derive(Debug, Clone, Copy)]
pub struct StoreBounds {
    /// The longest a lock may stay free (no holder key) while a waiter key stands in its
    /// line: what a waiter that can no longer be granted legitimately takes to leave
    /// (its session's or its proxy lease's expiry), with room for the watch's delay.
    pub free_while_waited_ns: u64,
    /// When the run stopped watching (every client gone by then).
    pub watched_until_ns: u64,
}

/// Checks the records against the store's history of holder and waiter keys:
///
/// - every guard the SDK reported valid (a grant, or an act, before the deadline the
///   client believed) matched a holder key in the store at that time: the lock's
///   exclusive holder key with the token's create revision had been put, and had not
///   yet been deleted (the delete's watch time is at or after the delete, so this never
///   blames a client that acted just before it);
/// - no lock stayed free (no holder key) for longer than
///   [`StoreBounds::free_while_waited_ns`] while a waiter key stood in its line: a
///   waiter key nobody owns blocks every waiter behind it.
pub fn check_store(records: &[Record], events: &[StoreEvent], bounds: StoreBounds) -> Vec<String> {
    let mut violations = Vec::new();
    // (key, create revision) -> when the watch saw it deleted, if it did
    let mut lives: HashMap<(&str, i64), Option<u64>> = HashMap::new();
    for e in events {
        if e.deleted {
            if let Some(end) = lives.get_mut(&(e.key.as_str(), e.create_revision)) {
                end.get_or_insert(e.at_ns);
            }
        } else {
            lives
                .entry((e.key.as_str(), e.create_revision))
                .or_insert(None);
        }
    }
    for record in records {
        let (what, client, lock, token, at_ns, deadline_ns) = match record {
            Record::Grant {
                client,
                lock,
                token,
                at_ns,
                deadline_ns,
            } => ("was granted", client, lock, token, at_ns, deadline_ns),
            Record::Act {
                client,
                lock,
                token,
                at_ns,
                deadline_ns,
                ..
            } => ("acted on", client, lock, token, at_ns, deadline_ns),
            _ => continue,
        };
        if at_ns >= deadline_ns {
            // Never a valid guard (an act on it is caught by `check`).
            continue;
        }
        let Ok(t) = token.parse::<FencingToken>() else {
            continue;
        };
        let key = format!("/l/{lock}/!x");
        match lives.get(&(key.as_str(), t.revision)) {
            None => violations.push(format!(
                "{client} {what} {lock} with token {token} at {at_ns} ns, but the store never had its holder key {key} of create revision {}",
                t.revision
            )),
            Some(Some(deleted)) if deleted <= at_ns => violations.push(format!(
                "{client} {what} {lock} with token {token} at {at_ns} ns, but its holder key {key} was deleted by {deleted} ns"
            )),
            Some(_) => {}
        }
    }
    violations.extend(free_while_waited(events, bounds));
    violations
}

/// The lock a holder or waiter key belongs to, and whether it is a holder key; `None`
/// for release markers and keys of neither kind.
fn key_role(key: &str) -> Option<(&str, bool)> {
    let (rest, holder) = if let Some(rest) = key.strip_prefix("/l/") {
        (rest, true)
    } else {
        (key.strip_prefix("/q/")?, false)
    };
    let (lock, tail) = rest.split_once("/!")?;
    (tail == "x" || tail.starts_with("s/") || tail.starts_with("x/")).then_some((lock, holder))
}

/// Every time a lock stayed free longer than the bound while a waiter key stood in its
/// line (see [`check_store`]).
fn free_while_waited(events: &[StoreEvent], bounds: StoreBounds) -> Vec<String> {
    #[derive(Default)]
    struct Line<'a> {
        holders: std::collections::BTreeSet<&'a str>,
        waiters: std::collections::BTreeSet<&'a str>,
        /// Since when it has been free with someone in line, and who stood first then.
        stuck_since: Option<(u64, &'a str)>,
    }
    let mut violations = Vec::new();
    let mut lines: BTreeMap<&str, Line> = BTreeMap::new();
    let mut report = |lock: &str, (since, waiter): (u64, &str), until: u64| {
        if until.saturating_sub(since) > bounds.free_while_waited_ns {
            violations.push(format!(
                "{lock} was free for {} ms from {since} ns while waiter key {waiter} stood in its line",
                (until - since) / 1_000_000,
            ));
        }
    };
    // The events of one revision (one transaction) are applied together.
    for batch in events.chunk_by(|a, b| a.revision == b.revision) {
        let mut touched = Vec::new();
        for e in batch {
            let Some((lock, holder)) = key_role(&e.key) else {
                continue;
            };
            let line = lines.entry(lock).or_default();
            let keys = if holder {
                &mut line.holders
            } else {
                &mut line.waiters
            };
            if e.deleted {
                keys.remove(e.key.as_str());
            } else {
                keys.insert(e.key.as_str());
            }
            touched.push(lock);
        }
        let at = batch[0].at_ns;
        for lock in touched {
            let line = lines.get_mut(lock).expect("touched above");
            match (line.stuck_since, line.waiters.first()) {
                (None, Some(waiter)) if line.holders.is_empty() => {
                    line.stuck_since = Some((at, waiter))
                }
                (Some(stuck), first) if first.is_none() || !line.holders.is_empty() => {
                    line.stuck_since = None;
                    report(lock, stuck, at);
                }
                _ => {}
            }
        }
    }
    for (lock, line) in &lines {
        if let Some(stuck) = line.stuck_since {
            report(lock, stuck, bounds.watched_until_ns);
        }
    }
    violations
}

/// How long after `client`'s hold of `lock` with `token` ended (its end of belief, or
/// the latest deadline it saw) another client was granted the lock; `None` if nobody was.
pub fn regranted_after(records: &[Record], client: &str, lock: &str, token: &str) -> Option<u64> {
    let mine = |c: &str, l: &str, t: &str| c == client && l == lock && t == token;
    let mut start = None;
    let mut end = 0;
    let mut ended = None;
    for record in records {
        match record {
            Record::Grant {
                client: c,
                lock: l,
                token: t,
                at_ns,
                deadline_ns,
            } if mine(c, l, t) => {
                start = Some(*at_ns);
                end = end.max(*deadline_ns);
            }
            Record::Act {
                client: c,
                lock: l,
                token: t,
                deadline_ns,
                ..
            } if mine(c, l, t) => {
                end = end.max(*deadline_ns);
            }
            Record::End {
                client: c,
                lock: l,
                token: t,
                at_ns,
                ..
            } if mine(c, l, t) => {
                ended = Some(*at_ns);
            }
            _ => {}
        }
    }
    let start = start?;
    let end = ended.map_or(end, |e| e.min(end));
    records
        .iter()
        .filter_map(|r| match r {
            Record::Grant {
                client: c,
                lock: l,
                at_ns,
                ..
            } if c != client && l == lock && *at_ns > start => Some(*at_ns),
            _ => None,
        })
        .min()
        .map(|next| next.saturating_sub(end))
}

/// Reads a client's JSON-lines record; a torn last line (the client was killed while
/// writing it) is skipped.
pub fn read_records(text: &str) -> Vec<Record> {
    text.lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(client: &str, token: &str, at: u64, deadline: u64) -> Record {
        Record::Grant {
            client: client.into(),
            lock: "l".into(),
            token: token.into(),
            at_ns: at,
            deadline_ns: deadline,
        }
    }

    fn act(client: &str, token: &str, at: u64, deadline: u64, accepted: bool) -> Record {
        Record::Act {
            client: client.into(),
            lock: "l".into(),
            token: token.into(),
            at_ns: at,
            deadline_ns: deadline,
            accepted,
        }
    }

    fn end(client: &str, token: &str, at: u64) -> Record {
        Record::End {
            client: client.into(),
            lock: "l".into(),
            token: token.into(),
            at_ns: at,
            why: "released".into(),
        }
    }

    #[test]
    fn regrant_time_counts_from_the_end_of_belief() {
        let records = [
            grant("a", "1:5", 100, 1_000),
            act("a", "1:5", 150, 1_200, true),
            grant("b", "1:9", 1_700, 3_000),
            end("b", "1:9", 1_800),
            grant("c", "1:12", 1_900, 3_000),
        ];
        // a's belief ran to 1,200 (its latest deadline); b got it at 1,700.
        assert_eq!(regranted_after(&records, "a", "l", "1:5"), Some(500));
        // b released at 1,800 (before its deadline); c got it at 1,900.
        assert_eq!(regranted_after(&records, "b", "l", "1:9"), Some(100));
        assert_eq!(regranted_after(&records, "c", "l", "1:12"), None);
        assert_eq!(
            regranted_after(&records, "a", "l", "1:6"),
            None,
            "no such hold"
        );
    }

    #[test]
    fn a_clean_handover_passes() {
        let v = check(&[
            grant("a", "1:5", 100, 1_000),
            act("a", "1:5", 150, 1_000, true),
            end("a", "1:5", 200),
            grant("b", "1:9", 300, 2_000),
            act("b", "1:9", 350, 2_000, true),
        ]);
        assert_eq!((v.grants, v.acts), (2, 2));
        assert!(v.violations.is_empty(), "{:?}", v.violations);
    }

    #[test]
    fn overlapping_belief_is_caught_even_without_acts() {
        // a never released and its deadline ran to 1,000; b was granted at 500.
        let v = check(&[grant("a", "1:5", 100, 1_000), grant("b", "1:9", 500, 2_000)]);
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(v.violations[0].contains("held it"));
    }

    #[test]
    fn a_paused_holder_past_its_deadline_is_fine_if_it_did_not_act() {
        let v = check(&[
            grant("a", "1:5", 100, 1_000),
            grant("b", "1:9", 1_500, 3_000),
            end("a", "1:5", 2_000),
        ]);
        assert!(v.violations.is_empty(), "{:?}", v.violations);
        let v = check(&[
            grant("a", "1:5", 100, 1_000),
            grant("b", "1:9", 1_500, 3_000),
            act("a", "1:5", 2_000, 1_000, false),
        ]);
        assert_eq!(v.violations.len(), 1, "acted late: {:?}", v.violations);
        assert_eq!(v.refused, 1, "and the fenced resource refused it");
    }

    #[test]
    fn falling_tokens_and_acts_without_grants_are_caught() {
        let v = check(&[
            grant("a", "1:9", 100, 200),
            grant("b", "1:5", 300, 400),
            act("c", "1:7", 350, 400, true),
        ]);
        assert_eq!(v.violations.len(), 2, "{:?}", v.violations);
    }

    #[test]
    fn a_grant_that_arrived_past_its_deadline_is_no_hold() {
        // 1:5's reply was held up until after its deadline, and after 1:9 came and went.
        let v = check(&[
            grant("b", "1:9", 100, 300),
            end("b", "1:9", 200),
            grant("a", "1:5", 400, 350),
            end("a", "1:5", 401),
        ]);
        assert!(v.violations.is_empty(), "{:?}", v.violations);
        // But an act on it is caught.
        let v = check(&[
            grant("b", "1:9", 100, 300),
            grant("a", "1:5", 400, 350),
            act("a", "1:5", 402, 350, false),
        ]);
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(
            v.violations[0].contains("past its deadline"),
            "{:?}",
            v.violations
        );
        // A late grant with a deadline still ahead is a hold, and its token must rise.
        let v = check(&[grant("b", "1:9", 100, 300), grant("a", "1:5", 400, 900)]);
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
    }

    #[test]
    fn a_token_granted_twice_and_a_broken_promise_are_violations() {
        // A session's re-acquire handed its old grant back: one token, two grants, even
        // to one client and with no overlap.
        let v = check(&[
            grant("a", "1:5", 100, 900),
            end("a", "1:5", 150),
            grant("a", "1:5", 160, 900),
            end("a", "1:5", 170),
        ]);
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(
            v.violations[0].contains("granted twice"),
            "{:?}",
            v.violations
        );
        let v = check(&[Record::Broken {
            client: "a".into(),
            lock: "l".into(),
            what: "a second acquire of a held lock was granted".into(),
            at_ns: 5,
        }]);
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
    }

    fn put(at: u64, revision: i64, key: &str, create: i64) -> StoreEvent {
        StoreEvent {
            at_ns: at,
            revision,
            key: key.into(),
            create_revision: create,
            deleted: false,
        }
    }

    fn delete(at: u64, revision: i64, key: &str, create: i64) -> StoreEvent {
        StoreEvent {
            deleted: true,
            ..put(at, revision, key, create)
        }
    }

    const BOUNDS: StoreBounds = StoreBounds {
        free_while_waited_ns: 1_000,
        watched_until_ns: 10_000,
    };

    #[test]
    fn a_valid_guard_must_match_a_holder_key_living_at_that_time() {
        let events = [
            put(100, 5, "/l/l/!x", 5),
            delete(500, 6, "/l/l/!x", 5),
            put(600, 9, "/l/l/!x", 9),
        ];
        // Granted and acted while the key lived; a late act past its deadline is not
        // this rule's (check flags it).
        let fine = [
            grant("a", "1:5", 150, 900),
            act("a", "1:5", 400, 900, true),
            act("a", "1:5", 950, 900, false),
            grant("b", "1:9", 650, 2_000),
        ];
        assert!(check_store(&fine, &events, BOUNDS).is_empty());
        // Acted after its key was deleted, believing itself valid.
        let late = [act("a", "1:5", 520, 900, true)];
        let v = check_store(&late, &events, BOUNDS);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("was deleted by 500 ns"), "{v:?}");
        // A token whose holder key the store never had.
        let v = check_store(&[grant("c", "1:7", 650, 900)], &events, BOUNDS);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("never had"), "{v:?}");
    }

    #[test]
    fn a_lock_left_free_while_a_waiter_stands_in_line_is_caught() {
        // Handed over in one transaction (waiter key deleted, holder put): never free.
        let handover = [
            put(100, 5, "/l/l/!x", 5),
            put(150, 6, "/q/l/!x/w1", 6),
            delete(200, 7, "/l/l/!x", 5),
            delete(210, 8, "/q/l/!x/w1", 6),
            put(210, 8, "/l/l/!x", 8),
        ];
        assert!(check_store(&[], &handover, BOUNDS).is_empty());
        // Free from 200 with w1 in line until 1,500: longer than the bound.
        let mut orphan = handover[..3].to_vec();
        orphan.push(delete(1_500, 8, "/q/l/!x/w1", 6));
        let v = check_store(&[], &orphan, BOUNDS);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("/q/l/!x/w1"), "{v:?}");
        // Still free with w1 in line when the watch ended.
        let v = check_store(&[], &handover[..3], BOUNDS);
        assert_eq!(v.len(), 1, "{v:?}");
        // Release markers are neither holders nor waiters.
        let marker = [
            put(100, 5, "/q/l/!x/w1", 5),
            put(100, 5, "/l/l/!r", 5),
            delete(300, 6, "/q/l/!x/w1", 5),
        ];
        assert!(check_store(&[], &marker, BOUNDS).is_empty());
    }

    #[test]
    fn records_round_trip_and_a_torn_line_is_skipped() {
        let r = grant("a", "1:5", 1, 2);
        let text = format!(
            "{}\n{{\"kind\":\"act\",\"cli",
            serde_json::to_string(&r).unwrap()
        );
        assert_eq!(read_records(&text), vec![r]);
    }
}
