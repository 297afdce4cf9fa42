//! Prometheus text exposition format, and etcd's own request and proposal counters read
//! from it: the load test counts what etcd served from etcd's `/metrics`, not from what
//! the client believes it sent.

use std::collections::BTreeMap;

/// One line of a metrics page: a metric name, its labels and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses the text exposition format (skips # lines, handles labels with escaped quotes/commas, +Inf/NaN values, optional timestamps).
///
/// A line that does not parse is skipped rather than failing the page: a scrape in the
/// middle of a run should lose one odd series, not the whole measurement.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        rest = parse_labels(after_brace, &mut labels)?;
    }
    // Value, then an optional timestamp in milliseconds, which a counter delta ignores.
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Parses `a="x",b="y\"z"}` into `labels`, returning the text after the closing brace.
/// Walks character by character because commas and braces may sit inside quoted values.
fn parse_labels<'a>(mut s: &'a str, labels: &mut BTreeMap<String, String>) -> Option<&'a str> {
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Some(after);
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        if key.is_empty() || key.contains([',', '}', '"']) {
            return None;
        }
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let close = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.to_string(), value);
        s = s[close + 1..].trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return None;
        }
    }
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => v.parse().ok(),
    }
}

/// Sum of every sample named `name` whose labels include all of `filter` (label=value pairs).
///
/// Summing is how the per-code, per-type series of one gRPC method become one figure.
pub fn sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            filter
                .iter()
                .all(|(k, v)| s.labels.get(*k).is_some_and(|have| have == v))
        })
        .map(|s| s.value)
        .sum()
}

/// The buckets of one Prometheus histogram, summed over every series named
/// `<name>_bucket` whose labels include all of `filter` (so over several proxies):
/// `(upper bound, cumulative count)` by rising bound, `+Inf` last.
pub fn histogram(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> Vec<(f64, f64)> {
    let bucket = format!("{name}_bucket");
    let mut by_bound: Vec<(f64, f64)> = Vec::new();
    for s in samples.iter().filter(|s| s.name == bucket) {
        let matches = filter
            .iter()
            .all(|(k, v)| s.labels.get(*k).is_some_and(|have| have == v));
        let Some(le) = s.labels.get("le").and_then(|le| parse_value(le)) else {
            continue;
        };
        if matches {
            add_buckets(&mut by_bound, &[(le, s.value)]);
        }
    }
    by_bound
}

/// Adds `more`'s counts into `total` bound by bound (a bound `total` lacks is added),
/// keeping `total` in rising order of bound.
pub fn add_buckets(total: &mut Vec<(f64, f64)>, more: &[(f64, f64)]) {
    for &(le, count) in more {
        match total.iter_mut().find(|(b, _)| *b == le) {
            Some((_, c)) => *c += count,
            None => total.push((le, count)),
        }
    }
    total.sort_by(|a, b| a.0.total_cmp(&b.0));
}

/// The counts a histogram gained since `before` (bucket by bucket; a bound missing
/// from `before` counts from zero).
pub fn histogram_delta(after: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|(le, count)| {
            let was = before
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0.0, |(_, c)| *c);
            (*le, (count - was).max(0.0))
        })
        .collect()
}

/// The `q` quantile (0 to 1) of a histogram's observations, as Prometheus'
/// `histogram_quantile` estimates it: linear within the bucket it falls in, the highest
/// finite bound when it falls in `+Inf`; `None` with no observation.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut below = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(below.0);
            }
            let share = if count > below.1 {
                (rank - below.1) / (count - below.1)
            } else {
                1.0
            };
            return Some(below.0 + (le - below.0) * share);
        }
        below = (le, count);
    }
    Some(below.0)
}

/// A set of counters read before and after a phase, possibly from several processes (etcd members): `Counters` maps a key (String) to a summed value;
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Counters(pub BTreeMap<String, f64>);

impl Counters {
    /// What each counter advanced by since `before`; a key missing from `before` counts
    /// from zero. A counter lower than before means its process restarted (a member
    /// killed in a zone failure and brought back), so, as Prometheus' `increase` does,
    /// the whole after-value is taken as the increase since the restart.
    pub fn delta(&self, before: &Counters) -> Counters {
        Counters(
            self.0
                .iter()
                .map(|(k, after)| {
                    let was = before.get(k);
                    let d = if *after >= was { after - was } else { *after };
                    (k.clone(), d)
                })
                .collect(),
        )
    }

    /// The counter's value, zero when absent: a counter etcd never touched is not
    /// exported until first used.
    pub fn get(&self, key: &str) -> f64 {
        self.0.get(key).copied().unwrap_or(0.0)
    }

    /// Adds another process's counters key by key, to total requests over members.
    pub fn add(&mut self, other: &Counters) {
        for (k, v) in &other.0 {
            *self.0.entry(k.clone()).or_insert(0.0) += v;
        }
    }
}

/// (key, metric name, gRPC service, gRPC method) of every gRPC request counter read.
/// The service is matched as well as the method so a method of the same name in another
/// service is never counted.
const GRPC_COUNTERS: &[(&str, &str, &str, &str)] = &[
    (
        "lease_keepalives",
        "grpc_server_msg_received_total",
        "etcdserverpb.Lease",
        "LeaseKeepAlive",
    ),
    (
        "lease_grants",
        "grpc_server_handled_total",
        "etcdserverpb.Lease",
        "LeaseGrant",
    ),
    (
        "lease_revokes",
        "grpc_server_handled_total",
        "etcdserverpb.Lease",
        "LeaseRevoke",
    ),
    (
        "txns",
        "grpc_server_handled_total",
        "etcdserverpb.KV",
        "Txn",
    ),
    (
        "ranges",
        "grpc_server_handled_total",
        "etcdserverpb.KV",
        "Range",
    ),
    (
        "puts",
        "grpc_server_handled_total",
        "etcdserverpb.KV",
        "Put",
    ),
    (
        "watch_streams",
        "grpc_server_started_total",
        "etcdserverpb.Watch",
        "Watch",
    ),
    // etcd's own lock service (the bare-etcd baseline of the contention scenario).
    (
        "locks",
        "grpc_server_handled_total",
        "v3lockpb.Lock",
        "Lock",
    ),
    (
        "unlocks",
        "grpc_server_handled_total",
        "v3lockpb.Lock",
        "Unlock",
    ),
];

/// etcd's watch figures, (key, metric name). The first two are gauges (what is open
/// now), to be read as they are, never as a delta; the third is a counter.
const WATCH_FIGURES: &[(&str, &str)] = &[
    // Open gRPC watch streams on the member (etcd 3.4: one per client `Watch` call).
    (
        "watch_streams_open",
        "etcd_debugging_mvcc_watch_stream_total",
    ),
    // Open watchers (key ranges watched) on the member, over all its streams.
    ("watchers_open", "etcd_debugging_mvcc_watcher_total"),
    // Events the member handed to its watch streams to send: one per event per watcher
    // it matched (two watchers of a prefix count a put under it twice).
    ("watch_events_sent", "etcd_debugging_mvcc_events_total"),
];

/// etcd's own request counters from one member's /metrics page, keyed: "lease_keepalives" (grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}), "lease_grants" (grpc_server_handled_total{grpc_method="LeaseGrant"}), "lease_revokes" (grpc_server_handled_total{grpc_method="LeaseRevoke"}), "txns" (grpc_server_handled_total{grpc_method="Txn"}), "ranges" (…{grpc_method="Range"}), "puts" (…"Put"), "watch_streams" (grpc_server_started_total{grpc_method="Watch"}), "proposals_committed" (etcd_server_proposals_committed_total), "proposals_applied" (etcd_server_proposals_applied_total), and the watch figures "watch_streams_open", "watchers_open" (gauges) and "watch_events_sent" (counter).
///
/// Per member, and the caller decides how to combine members. The gRPC counters count
/// requests a member received from clients; each client request reaches one member
/// (a follower forwards keepalives to the leader over the peer port, not gRPC), so
/// summing them over members with [`Counters::add`] gives the cluster's total. The
/// proposal counters are the raft log as seen by one member: every member of a healthy
/// cluster advances them together, so summing would multiply by the member count;
/// read them from one member.
pub fn etcd_counters(page: &str) -> Counters {
    let samples = parse(page);
    let mut c = BTreeMap::new();
    for (key, metric, service, method) in GRPC_COUNTERS {
        let v = sum(
            &samples,
            metric,
            &[("grpc_service", service), ("grpc_method", method)],
        );
        c.insert(key.to_string(), v);
    }
    c.insert(
        "proposals_committed".to_string(),
        sum(&samples, "etcd_server_proposals_committed_total", &[]),
    );
    c.insert(
        "proposals_applied".to_string(),
        sum(&samples, "etcd_server_proposals_applied_total", &[]),
    );
    for (key, metric) in WATCH_FIGURES {
        c.insert(key.to_string(), sum(&samples, metric, &[]));
    }
    Counters(c)
}

/// The keys summed by [`etcd_requests`]: every client request kind a lock service makes.
const REQUEST_KEYS: &[&str] = &[
    "lease_keepalives",
    "lease_grants",
    "lease_revokes",
    "txns",
    "ranges",
    "puts",
    "watch_streams",
    "locks",
    "unlocks",
];

/// Total etcd requests in a Counters delta: lease_keepalives + lease_grants + lease_revokes + txns + ranges + puts + watch_streams + locks + unlocks.
///
/// The figure behind `etcd_requests_per_keepalive`: how much etcd work one client
/// keepalive costs through each target.
pub fn etcd_requests(c: &Counters) -> f64 {
    REQUEST_KEYS.iter().map(|k| c.get(k)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-written in the shape of etcd 3.4's /metrics page.
    const ETCD_PAGE: &str = r#"# HELP etcd_server_has_leader Whether or not a leader exists. 1 is existence, 0 is not.
# TYPE etcd_server_has_leader gauge
etcd_server_has_leader 1
# HELP etcd_server_proposals_applied_total The total number of consensus proposals applied.
# TYPE etcd_server_proposals_applied_total gauge
etcd_server_proposals_applied_total 104523
# HELP etcd_server_proposals_committed_total The total number of consensus proposals committed.
# TYPE etcd_server_proposals_committed_total gauge
etcd_server_proposals_committed_total 104525
# HELP etcd_debugging_mvcc_events_total Total number of events sent by this member.
# TYPE etcd_debugging_mvcc_events_total counter
etcd_debugging_mvcc_events_total 1600
# HELP etcd_debugging_mvcc_watch_stream_total Total number of watch streams.
# TYPE etcd_debugging_mvcc_watch_stream_total gauge
etcd_debugging_mvcc_watch_stream_total 80
# HELP etcd_debugging_mvcc_watcher_total Total number of watchers.
# TYPE etcd_debugging_mvcc_watcher_total gauge
etcd_debugging_mvcc_watcher_total 81
# HELP grpc_server_handled_total Total number of RPCs completed on the server, regardless of success or failure.
# TYPE grpc_server_handled_total counter
grpc_server_handled_total{grpc_code="OK",grpc_method="LeaseGrant",grpc_service="etcdserverpb.Lease",grpc_type="unary"} 2000
grpc_server_handled_total{grpc_code="Unavailable",grpc_method="LeaseGrant",grpc_service="etcdserverpb.Lease",grpc_type="unary"} 3
grpc_server_handled_total{grpc_code="OK",grpc_method="LeaseRevoke",grpc_service="etcdserverpb.Lease",grpc_type="unary"} 10
grpc_server_handled_total{grpc_code="OK",grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 5000
grpc_server_handled_total{grpc_code="FailedPrecondition",grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 7
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 40
grpc_server_handled_total{grpc_code="OK",grpc_method="Put",grpc_service="etcdserverpb.KV",grpc_type="unary"} 1
grpc_server_handled_total{grpc_code="OK",grpc_method="Status",grpc_service="etcdserverpb.Maintenance",grpc_type="unary"} 12
grpc_server_handled_total{grpc_code="Canceled",grpc_method="Watch",grpc_service="etcdserverpb.Watch",grpc_type="bidi_stream"} 2
# HELP grpc_server_msg_received_total Total number of RPC stream messages received on the server.
# TYPE grpc_server_msg_received_total counter
grpc_server_msg_received_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 123456
grpc_server_msg_received_total{grpc_method="Watch",grpc_service="etcdserverpb.Watch",grpc_type="bidi_stream"} 30
grpc_server_msg_received_total{grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 5007
# HELP grpc_server_started_total Total number of RPCs started on the server.
# TYPE grpc_server_started_total counter
grpc_server_started_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 50
grpc_server_started_total{grpc_method="Watch",grpc_service="etcdserverpb.Watch",grpc_type="bidi_stream"} 4
# HELP etcd_disk_wal_fsync_duration_seconds The latency distributions of fsync called by wal.
# TYPE etcd_disk_wal_fsync_duration_seconds histogram
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.001"} 100
etcd_disk_wal_fsync_duration_seconds_bucket{le="+Inf"} 104530
etcd_disk_wal_fsync_duration_seconds_sum 52.1
etcd_disk_wal_fsync_duration_seconds_count 104530
"#;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_plain_labelled_and_special_values() {
        let text = "# HELP x y\n\
                    up 1\n\
                    weird{a=\"x,y\",b=\"say \\\"hi\\\"}\",c=\"back\\\\slash\\nnl\"} 2.5 1700000000000\n\
                    inf_metric{le=\"+Inf\"} +Inf\n\
                    nan_metric NaN\n\
                    neg -Inf\n\
                    trailing_comma{a=\"1\",} 3\n\
                    sci 1.5e3\n\
                    broken{a=\"unterminated} 1\n\
                    novalue\n";
        let s = parse(text);
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "up",
                "weird",
                "inf_metric",
                "nan_metric",
                "neg",
                "trailing_comma",
                "sci"
            ]
        );
        assert_eq!(s[0].value, 1.0);
        assert!(s[0].labels.is_empty());
        assert_eq!(
            s[1].labels,
            labels(&[("a", "x,y"), ("b", "say \"hi\"}"), ("c", "back\\slash\nnl")])
        );
        assert_eq!(s[1].value, 2.5);
        assert_eq!(s[2].value, f64::INFINITY);
        assert_eq!(s[2].labels, labels(&[("le", "+Inf")]));
        assert!(s[3].value.is_nan());
        assert_eq!(s[4].value, f64::NEG_INFINITY);
        assert_eq!(s[5].labels, labels(&[("a", "1")]));
        assert_eq!(s[6].value, 1500.0);
    }

    #[test]
    fn sum_filters_on_all_labels() {
        let s = parse(ETCD_PAGE);
        assert_eq!(
            sum(&s, "grpc_server_handled_total", &[("grpc_method", "Txn")]),
            5007.0
        );
        assert_eq!(
            sum(
                &s,
                "grpc_server_handled_total",
                &[("grpc_method", "Txn"), ("grpc_code", "OK")]
            ),
            5000.0
        );
        assert_eq!(sum(&s, "grpc_server_handled_total", &[("nope", "x")]), 0.0);
        assert_eq!(sum(&s, "absent", &[]), 0.0);
    }

    #[test]
    fn reads_etcd_counters() {
        let c = etcd_counters(ETCD_PAGE);
        assert_eq!(c.get("lease_keepalives"), 123456.0);
        assert_eq!(c.get("lease_grants"), 2003.0);
        assert_eq!(c.get("lease_revokes"), 10.0);
        assert_eq!(c.get("txns"), 5007.0);
        assert_eq!(c.get("ranges"), 40.0);
        assert_eq!(c.get("puts"), 1.0);
        assert_eq!(c.get("watch_streams"), 4.0);
        assert_eq!(c.get("proposals_committed"), 104525.0);
        assert_eq!(c.get("proposals_applied"), 104523.0);
        assert_eq!(c.get("watch_streams_open"), 80.0);
        assert_eq!(c.get("watchers_open"), 81.0);
        assert_eq!(c.get("watch_events_sent"), 1600.0);
        assert_eq!(
            etcd_requests(&c),
            123456.0 + 2003.0 + 10.0 + 5007.0 + 40.0 + 1.0 + 4.0
        );
    }

    #[test]
    fn delta_and_add_over_members() {
        let before = etcd_counters(ETCD_PAGE);
        let after_page = ETCD_PAGE
            .replace("} 123456", "} 124456")
            .replace(
                "etcd_server_proposals_committed_total 104525",
                "etcd_server_proposals_committed_total 104600",
            )
            .replace("grpc_type=\"unary\"} 5000", "grpc_type=\"unary\"} 5100");
        let after = etcd_counters(&after_page);
        let d = after.delta(&before);
        assert_eq!(d.get("lease_keepalives"), 1000.0);
        assert_eq!(d.get("txns"), 100.0);
        assert_eq!(d.get("proposals_committed"), 75.0);
        assert_eq!(d.get("ranges"), 0.0);
        assert_eq!(etcd_requests(&d), 1100.0);

        let mut total = Counters::default();
        total.add(&d);
        total.add(&d);
        assert_eq!(total.get("lease_keepalives"), 2000.0);
        assert_eq!(etcd_requests(&total), 2200.0);
    }

    #[test]
    fn delta_handles_missing_keys_and_restarts() {
        let before = Counters(BTreeMap::from([
            ("a".to_string(), 10.0),
            ("b".to_string(), 500.0),
        ]));
        let after = Counters(BTreeMap::from([
            ("a".to_string(), 15.0),
            ("b".to_string(), 20.0),
            ("c".to_string(), 3.0),
        ]));
        let d = after.delta(&before);
        assert_eq!(d.get("a"), 5.0);
        assert_eq!(d.get("b"), 20.0, "a reset counter counts from zero");
        assert_eq!(d.get("c"), 3.0);
        assert_eq!(d.get("missing"), 0.0);
    }

    #[test]
    fn a_histogram_over_two_proxies_gives_the_quantiles_prometheus_would() {
        let page = |fast: u32, slow: u32| {
            format!(
                "x_bucket{{call=\"acquire\",le=\"0.0001\"}} {fast}\n\
                 x_bucket{{call=\"acquire\",le=\"0.001\"}} {}\n\
                 x_bucket{{call=\"acquire\",le=\"+Inf\"}} {}\n\
                 x_bucket{{call=\"release\",le=\"+Inf\"}} 1000\n",
                fast + slow,
                fast + slow
            )
        };
        let mut samples = parse(&page(40, 0));
        samples.extend(parse(&page(40, 20)));
        let before = histogram(&parse(&page(30, 0)), "x", &[("call", "acquire")]);
        let after = histogram(&samples, "x", &[("call", "acquire")]);
        assert_eq!(
            after,
            vec![(0.0001, 80.0), (0.001, 100.0), (f64::INFINITY, 100.0)]
        );
        let gained = histogram_delta(&after, &before);
        assert_eq!(gained[0], (0.0001, 50.0));
        assert_eq!(gained[2], (f64::INFINITY, 70.0));
        // 50 of the 70 new ones took under 100 µs: the median is inside that bucket.
        let p50 = quantile(&gained, 0.5).unwrap();
        assert!((p50 - 0.00007).abs() < 1e-9, "{p50}");
        // The 99th falls in the 100 µs to 1 ms bucket.
        let p99 = quantile(&gained, 0.99).unwrap();
        assert!(p99 > 0.0001 && p99 < 0.001, "{p99}");
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[(f64::INFINITY, 0.0)], 0.5), None);
        // Past the last finite bound the estimate is that bound.
        assert_eq!(
            quantile(&[(0.5, 0.0), (f64::INFINITY, 3.0)], 0.5),
            Some(0.5)
        );
    }
}
