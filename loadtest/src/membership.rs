//! Membership bookkeeping for the zone-failure storm: which process of which service
//! each session plays, whose departures each survivor must see, and when departures
//! arrived. Plain data with no I/O; the load generator's watches feed it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Most processes one service may have: a group's members fit one `u64` mask.
pub const MAX_GROUP: usize = 64;

/// Where lockcell keeps its small keys in etcd (`cell::keyspace`'s `/k/`): bare etcd's
/// membership keys go to the same place, so both targets store the same keys.
pub const ETCD_KV_ROOT: &str = "/k/";

/// The small key process `process` of service `service` announces itself with.
pub fn member_key(service: usize, process: usize) -> String {
    format!("{}{process}", group_prefix(service))
}

/// The prefix every member of service `service` is announced under (with its trailing
/// `/`, so `svc-1/` never matches `svc-10/...`).
pub fn group_prefix(service: usize) -> String {
    format!("members/svc-{service}/")
}

/// A small key as bare etcd stores it.
pub fn etcd_key(small_key: &str) -> String {
    format!("{ETCD_KV_ROOT}{small_key}")
}

/// The process number a member key ends with, whichever root it carries
/// (`members/svc-3/17` and `/k/members/svc-3/17` both give 17).
pub fn process_of(key: &[u8]) -> Option<usize> {
    let last = key.rsplit(|b| *b == b'/').next()?;
    std::str::from_utf8(last).ok()?.parse().ok()
}

/// Deals the fleet's members into services of `per_group` processes: `groups[s][p]` is
/// the fleet index of process `p` of service `s`.
///
/// Members are taken from the zones in turn (a, b, c, a, b, c, …), so with zones of
/// equal size every service has the same share of every zone and a zone's death takes
/// that share of every group. Uneven zones leave the last services lopsided, never a
/// member out.
pub fn deal(by_zone: &[Vec<usize>], per_group: usize) -> Vec<Vec<usize>> {
    assert!(
        (1..=MAX_GROUP).contains(&per_group),
        "a group has 1 to {MAX_GROUP} processes, not {per_group}"
    );
    let longest = by_zone.iter().map(Vec::len).max().unwrap_or(0);
    let order: Vec<usize> = (0..longest)
        .flat_map(|k| by_zone.iter().filter_map(move |zone| zone.get(k).copied()))
        .collect();
    order.chunks(per_group).map(<[usize]>::to_vec).collect()
}

/// The mask of the processes of `group` for which `departs` holds.
pub fn mask(group: &[usize], departs: impl Fn(usize) -> bool) -> u64 {
    group
        .iter()
        .enumerate()
        .filter(|(_, member)| departs(**member))
        .fold(0, |m, (p, _)| m | (1 << p))
}

/// What one survivor has seen of its group's departures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Departures {
    /// The processes of the group that leave (their zone died).
    departing: u64,
    /// The departing processes whose delete this survivor has seen.
    seen: u64,
}

/// What a delete event meant to the survivor that received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// A departing member's first delete; `last` when it was the last one missing.
    Departure { last: bool },
    /// A departing member's delete seen before (a duplicate delivery).
    Again,
    /// A member that was not departing: a survivor the target let go.
    Survivor,
    /// A key that names no process of a group.
    Stranger,
}

impl Departures {
    pub fn new(departing: u64) -> Self {
        Departures { departing, seen: 0 }
    }

    /// Every departure has been seen (at once, when nothing departs).
    pub fn is_complete(&self) -> bool {
        self.seen == self.departing
    }

    /// Records the delete of process `process`'s key.
    pub fn deleted(&mut self, process: usize) -> Deleted {
        if process >= MAX_GROUP {
            return Deleted::Stranger;
        }
        let bit = 1u64 << process;
        if self.departing & bit == 0 {
            Deleted::Survivor
        } else if self.seen & bit != 0 {
            Deleted::Again
        } else {
            self.seen |= bit;
            Deleted::Departure {
                last: self.is_complete(),
            }
        }
    }
}

/// Departures seen over time since the kill, counted in fixed buckets of atomics so tens
/// of thousands of watch tasks can record millions of arrivals without a lock and
/// without keeping one sample each.
#[derive(Debug)]
pub struct Arrivals {
    bucket: Duration,
    counts: Vec<AtomicU64>,
}

impl Arrivals {
    /// Buckets of `bucket` covering `span`; later arrivals count in the last bucket.
    pub fn new(bucket: Duration, span: Duration) -> Self {
        assert!(!bucket.is_zero(), "arrival buckets need a width");
        let n = (span.as_nanos() / bucket.as_nanos()).max(1) as usize + 1;
        Arrivals {
            bucket,
            counts: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Records one arrival `since_kill` after the kill.
    pub fn record(&self, since_kill: Duration) {
        let i = (since_kill.as_nanos() / self.bucket.as_nanos()) as usize;
        self.counts[i.min(self.counts.len() - 1)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// The cumulative series (seconds since the kill, arrivals by then): (0, 0), then
    /// one point at the end of every bucket that had arrivals.
    pub fn cumulative(&self) -> Vec<(f64, f64)> {
        let mut out = vec![(0.0, 0.0)];
        let mut n = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            let k = c.load(Ordering::Relaxed);
            if k > 0 {
                n += k;
                out.push(((self.bucket * (i as u32 + 1)).as_secs_f64(), n as f64));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_their_process() {
        assert_eq!(member_key(3, 17), "members/svc-3/17");
        assert_eq!(group_prefix(1), "members/svc-1/");
        assert_eq!(etcd_key(&member_key(0, 5)), "/k/members/svc-0/5");
        assert_eq!(process_of(b"members/svc-3/17"), Some(17));
        assert_eq!(process_of(b"/k/members/svc-3/17"), Some(17));
        assert_eq!(process_of(b"members/svc-3/"), None);
        assert_eq!(process_of(b"members/svc-3/x"), None);
    }

    #[test]
    fn equal_zones_give_every_group_a_third_of_each() {
        let by_zone: Vec<Vec<usize>> = (0..3)
            .map(|z| (0..12).map(|k| z * 100 + k).collect())
            .collect();
        let groups = deal(&by_zone, 6);
        assert_eq!(groups.len(), 6);
        for g in &groups {
            assert_eq!(g.len(), 6);
            for (p, member) in g.iter().enumerate() {
                assert_eq!(member / 100, p % 3, "process {p} lives in zone {}", p % 3);
            }
            assert_eq!(mask(g, |m| m / 100 == 0), 0b001001);
        }
        let mut all: Vec<usize> = groups.concat();
        all.sort_unstable();
        let mut want = by_zone.concat();
        want.sort_unstable();
        assert_eq!(all, want, "every member in exactly one group");
    }

    #[test]
    fn uneven_zones_leave_nobody_out() {
        let by_zone = vec![vec![0, 1, 2, 3], vec![10], vec![20, 21]];
        let groups = deal(&by_zone, 3);
        assert_eq!(groups, vec![vec![0, 10, 20], vec![1, 21, 2], vec![3]]);
    }

    #[test]
    fn a_survivor_tallies_departures() {
        let mut d = Departures::new(0b1010);
        assert!(!d.is_complete());
        assert_eq!(d.deleted(0), Deleted::Survivor);
        assert_eq!(d.deleted(1), Deleted::Departure { last: false });
        assert_eq!(d.deleted(1), Deleted::Again);
        assert_eq!(d.deleted(3), Deleted::Departure { last: true });
        assert!(d.is_complete());
        assert_eq!(d.deleted(64), Deleted::Stranger);
        assert!(Departures::new(0).is_complete());
    }

    #[test]
    fn arrivals_accumulate_by_bucket() {
        let a = Arrivals::new(Duration::from_millis(100), Duration::from_secs(1));
        a.record(Duration::from_millis(50));
        a.record(Duration::from_millis(99));
        a.record(Duration::from_millis(250));
        a.record(Duration::from_secs(60));
        assert_eq!(a.total(), 4);
        let series = a.cumulative();
        assert_eq!(series[0], (0.0, 0.0));
        assert_eq!(series[1], (0.1, 2.0));
        assert_eq!(series[2].1, 3.0);
        assert!((series[2].0 - 0.3).abs() < 1e-9);
        assert_eq!(
            series.last().unwrap().1,
            4.0,
            "late arrivals land in the last bucket"
        );
    }
}
