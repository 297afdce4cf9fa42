//! Run reports: one JSON file per (scenario, target) run, and the side-by-side Markdown
//! table that compares lockcell with bare etcd and etcd's grpc-proxy figure by figure.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// Everything one run measured, written as JSON so tables and plots can be rebuilt from
/// runs made at different times without running them again.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub scenario: String,
    pub target: String,
    /// The knobs the run used (sessions, rates, durations), so figures are never read
    /// apart from the load that produced them.
    pub params: serde_json::Map<String, serde_json::Value>,
    /// Figures by name, as listed in [`PREFERRED_ORDER`] and beyond.
    pub metrics: BTreeMap<String, f64>,
    /// plot series by name, each Vec<(x,y)>
    pub series: BTreeMap<String, Vec<(f64, f64)>>,
    /// Lines a person reads to judge a figure (each false expiry's timeline, say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evidence: Vec<String>,
}

impl Report {
    pub fn new(scenario: &str, target: &str) -> Self {
        Self {
            scenario: scenario.to_string(),
            target: target.to_string(),
            params: serde_json::Map::new(),
            metrics: BTreeMap::new(),
            series: BTreeMap::new(),
            evidence: Vec::new(),
        }
    }

    /// Records a parameter; a value serde cannot express in JSON is kept as its error
    /// text rather than losing the whole report.
    pub fn param(&mut self, key: &str, value: impl serde::Serialize) {
        let v = serde_json::to_value(value)
            .unwrap_or_else(|e| serde_json::Value::String(format!("unserializable: {e}")));
        self.params.insert(key.to_string(), v);
    }

    /// Records a figure. NaN and infinities are not recorded: JSON cannot carry them,
    /// and a figure that could not be measured shows as "—" in the table.
    pub fn metric(&mut self, key: &str, value: f64) {
        if value.is_finite() {
            self.metrics.insert(key.to_string(), value);
        }
    }

    /// Writes `<dir>/<scenario>-<target>.json` (creating dir); returns the path.
    ///
    /// Non-finite values, whether metrics or series points, are left out, since JSON
    /// would write them as `null` and the report could not be read back.
    pub fn write(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(format!("{}-{}.json", self.scenario, self.target));
        let mut clean = self.clone();
        clean.metrics.retain(|_, v| v.is_finite());
        for points in clean.series.values_mut() {
            points.retain(|(x, y)| x.is_finite() && y.is_finite());
        }
        let json = serde_json::to_string_pretty(&clean).context("serializing report")?;
        std::fs::write(&path, json + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    pub fn read(path: &Path) -> anyhow::Result<Report> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

/// The figures the issue asks for, in the order a reader wants them; any other figure
/// (cpu and rss per process kind, and so on) follows alphabetically.
pub const PREFERRED_ORDER: &[&str] = &[
    "keepalives_per_s",
    "keepalive_p50_ms",
    "keepalive_p99_ms",
    "keepalive_max_ms",
    "false_expiries",
    "etcd_requests_per_keepalive",
    "regrant_p50_s",
    "regrant_p99_s",
    "regrant_max_s",
    "etcd_proposals_during_storm",
    "membership_events_expected",
    "membership_events_delivered",
    "membership_all_seen_s",
    "membership_survivors_incomplete",
    "etcd_watch_streams",
    "etcd_watchers",
    "etcd_watch_events_sent",
    "acquire_p50_ms",
    "acquire_p99_ms",
    "sessions_open_before",
    "sessions_open_after",
    "sessions_expired",
    "locks_lost",
    "guards_not_valid_after",
    "tokens_changed",
    "ephemeral_keys_lost",
    "moves_seen",
    "jeopardy_events",
    "keepalive_p50_ms_before",
    "keepalive_p50_ms_during",
    "keepalive_p99_ms_before",
    "keepalive_p99_ms_during",
    "deadline_headroom_min_s_before",
    "deadline_headroom_min_s_during",
    "proxy_a_restart_s",
    "proxy_b_restart_s",
    "proxy_c_restart_s",
    "restarts_s",
    "proxy_rss_bytes_per_session",
];

/// Targets in column order; any other target follows alphabetically.
const TARGET_ORDER: &[&str] = &["lockcell", "lockcell-etcd-api", "etcd", "etcd-grpc-proxy"];

/// The target the ratio columns compare everything against.
const BASELINE: &str = "lockcell";

/// Sort key placing listed names first, in list order, then the rest alphabetically.
fn rank<'a>(order: &[&str], name: &'a str) -> (usize, &'a str) {
    let i = order.iter().position(|n| *n == name).unwrap_or(order.len());
    (i, name)
}

/// A Markdown table for one scenario: one row per metric (union over reports, in a fixed preferred order for the names listed above, then alphabetical), one column per target in the order lockcell, etcd, etcd-grpc-proxy (others after), then for each non-lockcell target a column "lockcell/<target>" holding the ratio (2 significant decimals, "—" when either side is missing or the denominator is 0). Numbers formatted readably (integers with thousands separators, small values with up to 3 significant decimals).
///
/// Reports of other scenarios are ignored, so the caller may pass every report it read;
/// of two reports for the same target the later wins. Ratio columns appear only when a
/// lockcell report is present: without one they could hold nothing but "—".
pub fn markdown_table(scenario: &str, reports: &[Report]) -> String {
    let mut by_target: BTreeMap<&str, &Report> = BTreeMap::new();
    for r in reports.iter().filter(|r| r.scenario == scenario) {
        by_target.insert(&r.target, r);
    }
    if by_target.is_empty() {
        return format!("_No reports for scenario `{scenario}`._\n");
    }
    let mut targets: Vec<&str> = by_target.keys().copied().collect();
    targets.sort_by_key(|t| rank(TARGET_ORDER, t));
    let mut metrics: Vec<&str> = by_target
        .values()
        .flat_map(|r| r.metrics.keys().map(String::as_str))
        .collect();
    metrics.sort_by_key(|m| rank(PREFERRED_ORDER, m));
    metrics.dedup();
    let others: Vec<&str> = if by_target.contains_key(BASELINE) {
        targets.iter().copied().filter(|t| *t != BASELINE).collect()
    } else {
        Vec::new()
    };

    let mut header = vec!["metric".to_string()];
    header.extend(targets.iter().map(|t| t.to_string()));
    header.extend(others.iter().map(|t| format!("{BASELINE}/{t}")));
    let mut out = row(&header);
    let mut rule = vec![":---".to_string()];
    rule.extend((1..header.len()).map(|_| "---:".to_string()));
    out.push_str(&row(&rule));

    for m in metrics {
        let value = |t: &str| by_target.get(t).and_then(|r| r.metrics.get(m)).copied();
        let mut cells = vec![m.to_string()];
        cells.extend(
            targets
                .iter()
                .map(|t| value(t).map_or_else(|| "—".to_string(), format_number)),
        );
        cells.extend(others.iter().map(|t| match (value(BASELINE), value(t)) {
            (Some(a), Some(b)) if b != 0.0 => format_ratio(a / b),
            _ => "—".to_string(),
        }));
        out.push_str(&row(&cells));
    }
    out
}

fn row(cells: &[String]) -> String {
    format!("| {} |\n", cells.join(" | "))
}

/// Integers with thousands separators; other values with 3 decimals at most from 1 up,
/// 3 significant digits below 1, and none from 1,000 up, where fractions are noise.
fn format_number(v: f64) -> String {
    if v == 0.0 {
        // Also catches -0.0, which would otherwise print as "-0".
        return "0".to_string();
    }
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return group(&format!("{v:.0}"));
    }
    let a = v.abs();
    let decimals = if a >= 1000.0 {
        0
    } else if a >= 1.0 {
        3
    } else {
        significant_decimals(a, 3)
    };
    trim_and_group(&format!("{v:.decimals$}"))
}

/// Ratios to two decimals, or two significant digits when below 0.1 so that a large
/// improvement does not print as "0.00".
fn format_ratio(r: f64) -> String {
    let decimals = if r.abs() >= 0.1 || r == 0.0 {
        2
    } else {
        significant_decimals(r.abs(), 2)
    };
    trim_and_group(&format!("{r:.decimals$}"))
}

/// Decimals needed to show `digits` significant digits of `0 < a < 1`.
fn significant_decimals(a: f64, digits: i32) -> usize {
    let leading_zeros = (-a.log10()).floor() as i32;
    (leading_zeros + digits).clamp(0, 12) as usize
}

/// Drops trailing fractional zeros, then groups the integer part by thousands.
fn trim_and_group(s: &str) -> String {
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    };
    if s == "-0" {
        return "0".to_string();
    }
    group(s)
}

/// Inserts thousands separators into the integer part of a formatted number.
fn group(s: &str) -> String {
    let (sign, rest) = s.strip_prefix('-').map_or(("", s), |r| ("-", r));
    let (int, frac) = rest
        .split_once('.')
        .map_or((rest, None), |(i, f)| (i, Some(f)));
    let mut grouped = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    match frac {
        Some(f) => format!("{sign}{grouped}.{f}"),
        None => format!("{sign}{grouped}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(target: &str, metrics: &[(&str, f64)]) -> Report {
        let mut r = Report::new("keepalive", target);
        for (k, v) in metrics {
            r.metric(k, *v);
        }
        r
    }

    #[test]
    fn table_layout_order_and_ratios() {
        let reports = vec![
            report("etcd-grpc-proxy", &[("keepalives_per_s", 5000.0)]),
            report(
                "etcd",
                &[
                    ("keepalives_per_s", 20000.0),
                    ("keepalive_p99_ms", 4.0),
                    ("cpu_seconds_etcd", 12.5),
                ],
            ),
            report(
                "lockcell",
                &[
                    ("keepalive_p99_ms", 2.0),
                    ("keepalives_per_s", 10000.0),
                    ("false_expiries", 0.0),
                    ("alpha_extra", 1.0),
                ],
            ),
            Report::new("acquire", "lockcell"),
        ];
        let table = markdown_table("keepalive", &reports);
        let expected = "\
| metric | lockcell | etcd | etcd-grpc-proxy | lockcell/etcd | lockcell/etcd-grpc-proxy |
| :--- | ---: | ---: | ---: | ---: | ---: |
| keepalives_per_s | 10,000 | 20,000 | 5,000 | 0.5 | 2 |
| keepalive_p99_ms | 2 | 4 | — | 0.5 | — |
| false_expiries | 0 | — | — | — | — |
| alpha_extra | 1 | — | — | — | — |
| cpu_seconds_etcd | — | 12.5 | — | — | — |
";
        assert_eq!(table, expected);
    }

    #[test]
    fn zero_denominator_and_unknown_targets() {
        let reports = vec![
            report("zeta", &[("false_expiries", 3.0)]),
            report("alpha", &[("false_expiries", 1.0)]),
            report("etcd", &[("false_expiries", 0.0)]),
            report("lockcell", &[("false_expiries", 0.0)]),
        ];
        let table = markdown_table("keepalive", &reports);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            "| metric | lockcell | etcd | alpha | zeta | lockcell/etcd | lockcell/alpha | lockcell/zeta |"
        );
        assert_eq!(lines[2], "| false_expiries | 0 | 0 | 1 | 3 | — | 0 | 0 |");
    }

    #[test]
    fn without_lockcell_there_are_no_ratio_columns() {
        let table = markdown_table("keepalive", &[report("etcd", &[("x", 1.0)])]);
        assert_eq!(table.lines().next(), Some("| metric | etcd |"));
        assert!(markdown_table("zone-failure", &[]).contains("No reports"));
    }

    #[test]
    fn later_report_for_a_target_wins() {
        let reports = vec![report("etcd", &[("x", 1.0)]), report("etcd", &[("x", 2.0)])];
        assert!(markdown_table("keepalive", &reports).contains("| x | 2 |"));
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(format_number(0.0), "0");
        assert_eq!(format_number(-0.0), "0");
        assert_eq!(format_number(1234567.0), "1,234,567");
        assert_eq!(format_number(-1234.0), "-1,234");
        assert_eq!(format_number(999.0), "999");
        assert_eq!(format_number(12345.678), "12,346");
        assert_eq!(format_number(123.4567), "123.457");
        assert_eq!(format_number(2.5), "2.5");
        assert_eq!(format_number(999.9999), "1,000");
        assert_eq!(format_number(0.012345), "0.0123");
        assert_eq!(format_number(0.5), "0.5");
        assert_eq!(format_number(-0.0001234), "-0.000123");
    }

    #[test]
    fn ratios_read_well() {
        assert_eq!(format_ratio(0.5), "0.5");
        assert_eq!(format_ratio(1.0 / 3.0), "0.33");
        assert_eq!(format_ratio(2.0 / 3.0), "0.67");
        assert_eq!(format_ratio(1234.567), "1,234.57");
        assert_eq!(format_ratio(0.001234), "0.0012");
        assert_eq!(format_ratio(0.0), "0");
    }

    #[test]
    fn write_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Report::new("zone-failure", "etcd");
        r.param("sessions", 10_000);
        r.param("ttl", "10s");
        r.metric("regrant_p99_s", 1.25);
        r.metric("broken", f64::NAN);
        r.series.insert(
            "regranted".to_string(),
            vec![(0.0, 0.0), (1.0, f64::INFINITY), (2.0, 3.0)],
        );
        let path = r.write(&dir.path().join("nested")).unwrap();
        assert_eq!(path, dir.path().join("nested/zone-failure-etcd.json"));
        let back = Report::read(&path).unwrap();
        assert_eq!(back.scenario, "zone-failure");
        assert_eq!(back.target, "etcd");
        assert_eq!(back.params["sessions"], serde_json::json!(10_000));
        assert_eq!(back.params["ttl"], serde_json::json!("10s"));
        assert_eq!(
            back.metrics,
            BTreeMap::from([("regrant_p99_s".to_string(), 1.25)])
        );
        assert_eq!(back.series["regranted"], vec![(0.0, 0.0), (2.0, 3.0)]);
    }
}
