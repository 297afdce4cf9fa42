//! Per-identity limits (docs/operations.md, "Limits"): what one identity may have on
//! this proxy at once, and how fast it may call it, from the grants file's
//! `[[limit]]` entries ([`lockcell_cell::grants::Quota`]).
//!
//! Sessions and the keys they hold are counted by each cell's session table (they
//! live there); watches and acquires in progress are counted here, each by a
//! [`Taken`] that gives its place back when dropped; calls are paced by a token
//! bucket per identity. A proxy without `--grants` knows no identities and limits
//! no one this way.
//!
//! Every refusal is RESOURCE_EXHAUSTED naming the identity, the limit and the count
//! (`identity "batch" has 100 of its 100 open sessions on this proxy`), counted in
//! `lockcell_limit_refusals_total` by identity and limit, and writes nothing.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use governor::{DefaultDirectRateLimiter, Quota as RateQuota, RateLimiter};
use lockcell_cell::grants::Limit;

use crate::access::AccessRules;
use crate::errors::ProxyError;
use crate::metrics as m;

/// How often an identity at its `keys` or `bytes` limit has its sessions' records
/// looked through for keys deleted by other means than their session's end.
const LOOK_AGAIN: std::time::Duration = std::time::Duration::from_secs(1);

/// What every identity has in hand on this proxy, beyond its sessions and keys.
#[derive(Default)]
pub struct Limits {
    by_identity: DashMap<Arc<str>, Arc<Usage>>,
}

#[derive(Default)]
struct Usage {
    watches: AtomicU64,
    waiting: AtomicU64,
    /// The identity's bucket, and the rate it was built for (a reload may change it).
    bucket: Mutex<Option<(u64, Arc<DefaultDirectRateLimiter>)>>,
    /// When its sessions' records were last looked through before a refusal.
    looked: Mutex<Option<std::time::Instant>>,
}

impl Usage {
    fn count(&self, limit: Limit) -> &AtomicU64 {
        match limit {
            Limit::Watches => &self.watches,
            Limit::Waiting => &self.waiting,
            other => unreachable!("{other:?} is counted by the session table"),
        }
    }
}

/// A place taken under a limit (a watch open, an acquire in progress); given back
/// when dropped. A proxy that limits no one hands out empty ones.
#[must_use = "the place is given back when this is dropped"]
pub struct Taken {
    held: Option<(Arc<Usage>, Limit)>,
}

impl Taken {
    /// A place no limit counts.
    pub fn none() -> Taken {
        Taken { held: None }
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some((usage, limit)) = self.held.take() {
            usage.count(limit).fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Limits {
    fn usage(&self, identity: &str) -> Arc<Usage> {
        if let Some(u) = self.by_identity.get(identity) {
            return u.clone();
        }
        self.by_identity.entry(identity.into()).or_default().clone()
    }

    /// Whether the records of `identity`'s sessions may be looked through again at
    /// `now` before refusing it (see `ProxyState::forget_gone_keys`): once a second.
    pub fn may_look_again(&self, identity: &str, now: std::time::Instant) -> bool {
        let usage = self.usage(identity);
        let mut looked = usage.looked.lock().expect("looked");
        if looked.is_some_and(|at| now.duration_since(at) < LOOK_AGAIN) {
            return false;
        }
        *looked = Some(now);
        true
    }

    /// Takes one place of `identity` under `limit` (watches or acquires in progress),
    /// or refuses when its quota is full.
    pub fn take(
        &self,
        grants: &AccessRules,
        identity: Option<&str>,
        limit: Limit,
    ) -> Result<Taken, ProxyError> {
        let Some(identity) = identity else {
            return Ok(Taken::none());
        };
        let max = grants.quota(identity).of(limit);
        let usage = self.usage(identity);
        let count = usage.count(limit);
        let mut now = count.load(Ordering::Acquire);
        loop {
            if now >= max {
                return Err(refusal(grants, identity, limit, now, max));
            }
            match count.compare_exchange_weak(now, now + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(actual) => now = actual,
            }
        }
        Ok(Taken {
            held: Some((usage, limit)),
        })
    }

    /// Lets one call of `identity` through, or refuses it when the identity calls
    /// faster than its `requests_per_second` (a burst of one second's worth passes).
    pub fn pace(&self, grants: &AccessRules, identity: Option<&str>) -> Result<(), ProxyError> {
        let Some(identity) = identity else {
            return Ok(());
        };
        let rate = grants.quota(identity).requests_per_second;
        let usage = self.usage(identity);
        let bucket = {
            let mut slot = usage.bucket.lock().expect("rate bucket");
            match &*slot {
                Some((built_for, bucket)) if *built_for == rate => bucket.clone(),
                _ => {
                    let per_second = NonZeroU32::new(rate.min(u32::MAX as u64) as u32)
                        .unwrap_or(NonZeroU32::MIN);
                    let bucket = Arc::new(RateLimiter::direct(RateQuota::per_second(per_second)));
                    *slot = Some((rate, bucket.clone()));
                    bucket
                }
            }
        };
        bucket.check().map_err(|_| {
            refused(grants, identity, Limit::Rate);
            ProxyError::Exhausted(format!(
                "identity {identity:?} calls this proxy faster than its {rate} calls a second \
                 (limit `requests_per_second` in the grants file): slow down and try again"
            ))
        })
    }
}

/// Paces one keepalive stream to `--max-keepalives-per-stream` messages a second (a
/// burst of as many pass at once): a stream sent faster is read more slowly, never
/// refused, so its renewals still arrive, later. A client renewing many sessions on
/// one stream stays far below it (120,000 sessions over 3,000 connections renew 10
/// times a second per stream at a 12 s TTL).
pub struct StreamPace(Option<DefaultDirectRateLimiter>);

impl StreamPace {
    /// `per_second` 0: no pace.
    pub fn new(per_second: u32) -> StreamPace {
        StreamPace(
            NonZeroU32::new(per_second).map(|n| RateLimiter::direct(RateQuota::per_second(n))),
        )
    }

    /// Waits until the stream may have its next message read.
    pub async fn turn(&self) {
        if let Some(limiter) = &self.0 {
            limiter.until_ready().await;
        }
    }
}

/// Refuses a call of `identity` that would pass `limit`, which it has `now` of `max`.
pub fn refusal(
    grants: &AccessRules,
    identity: &str,
    limit: Limit,
    now: u64,
    max: u64,
) -> ProxyError {
    refused(grants, identity, limit);
    ProxyError::Exhausted(format!(
        "identity {identity:?} has {now} of its {max} {limit} on this proxy (limit `{}` in \
         the grants file): end some, or raise the limit",
        limit.field()
    ))
}

/// The refusal of a write of `adding` bytes by `identity`, whose keys here take `held`
/// of its `max` bytes.
pub fn refusal_of_bytes(
    grants: &AccessRules,
    identity: &str,
    held: u64,
    adding: u64,
    max: u64,
) -> ProxyError {
    refused(grants, identity, Limit::Bytes);
    ProxyError::Exhausted(format!(
        "identity {identity:?} has keys of {held} of its {max} bytes on this proxy, and this \
         write would add {adding} (limit `bytes` in the grants file): delete some, write \
         smaller values, or raise the limit"
    ))
}

/// The refusal of a write that would add `adding` bytes to the persistent keys of
/// `identity`, which take `held` of its `max` bytes in the cell (`pending` more being
/// written through this proxy).
pub fn refusal_of_stored(
    grants: &AccessRules,
    identity: &str,
    held: u64,
    pending: u64,
    adding: u64,
    max: u64,
) -> ProxyError {
    refused(grants, identity, Limit::Stored);
    let pending = if pending > 0 {
        format!(" ({pending} more being written through this proxy)")
    } else {
        String::new()
    };
    ProxyError::Exhausted(format!(
        "identity {identity:?} has persistent keys of {held} of its {max} bytes in the cell{pending}, \
         and this write would add {adding} (limit `stored_bytes` in the grants file; each key \
         counts its name, its value and 128 bytes): delete keys no longer needed, or raise \
         the limit"
    ))
}

/// Counts a refusal, labelled with the identity when the grants file names it.
fn refused(grants: &AccessRules, identity: &str, limit: Limit) {
    let label = if grants.names(identity) {
        identity.to_owned()
    } else {
        "*".to_owned()
    };
    metrics::counter!(m::LIMIT_REFUSALS, "identity" => label, "limit" => limit.field())
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::declared::Declared;

    fn grants(text: &str) -> AccessRules {
        AccessRules::parse(text, std::path::Path::new("grants.toml")).unwrap()
    }

    const FILE: &str = "[[grant]]\nidentity = \"*\"\nlock = [\"\"]\n\
                        [[limit]]\nidentity = \"batch\"\nwatches = 2\nrequests_per_second = 3\n";

    #[test]
    fn a_place_is_refused_at_the_limit_and_given_back_when_dropped() {
        let grants = grants(FILE);
        let limits = Limits::default();
        let first = limits.take(&grants, Some("batch"), Limit::Watches).unwrap();
        let _second = limits.take(&grants, Some("batch"), Limit::Watches).unwrap();
        let refused = limits
            .take(&grants, Some("batch"), Limit::Watches)
            .err()
            .expect("the third watch passes the limit");
        let text = refused.to_string();
        assert!(
            text.contains("\"batch\" has 2 of its 2 open watches"),
            "{text}"
        );
        assert!(text.contains("`watches`"), "{text}");
        // Another identity is not counted with it.
        let _other = limits.take(&grants, Some("web"), Limit::Watches).unwrap();
        drop(first);
        let _again = limits
            .take(&grants, Some("batch"), Limit::Watches)
            .expect("a watch that ended gives its place back");
    }

    #[test]
    fn a_keepalive_stream_past_its_pace_waits_for_its_turn() {
        use futures_util::FutureExt;
        let pace = StreamPace::new(10);
        for i in 0..10 {
            assert!(
                pace.turn().now_or_never().is_some(),
                "message {i} of the burst waits"
            );
        }
        assert!(
            pace.turn().now_or_never().is_none(),
            "the message past the burst is read only later"
        );
        let unpaced = StreamPace::new(0);
        for _ in 0..10_000 {
            assert!(unpaced.turn().now_or_never().is_some());
        }
    }

    #[test]
    fn calls_past_the_rate_are_refused_and_unidentified_callers_are_not_limited() {
        let grants = grants(FILE);
        let limits = Limits::default();
        let passed = (0..10)
            .filter(|_| limits.pace(&grants, Some("batch")).is_ok())
            .count();
        assert!(
            (3..10).contains(&passed),
            "a burst of about one second's worth passes, then calls are refused: {passed}"
        );
        let refused = limits.pace(&grants, Some("batch")).unwrap_err().to_string();
        assert!(refused.contains("3 calls a second"), "{refused}");
        for _ in 0..100 {
            limits.pace(&grants, None).unwrap();
            std::mem::forget(limits.take(&grants, None, Limit::Waiting).unwrap());
        }
    }
}
