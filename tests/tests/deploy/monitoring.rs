//! The alert rules and the dashboard: every query parses as PromQL and uses only
//! metrics lockcell exports, and every alert links a heading of docs/operations.md. The
//! rules pass `promtool check rules` and their unit tests, which hold a case that fires
//! every alert (`promtool test rules deploy/monitoring/alerts.test.yaml`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use anyhow::{ensure, Context, Result};
use promql_parser::parser::Expr;
use promql_parser::util::{walk_expr, ExprVisitor};
use serde_json::Value;

use crate::{on_path, read, root};

/// Every metric name the proxy and the audit tailer export.
fn known_metrics() -> Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    let quoted = |line: &str| line.split('"').nth(1).map(str::to_owned);
    for line in read("proxy/src/metrics.rs")?.lines() {
        if line.contains(": &str = \"lockcell_") {
            names.extend(quoted(line));
        }
    }
    let mut folders = vec![root().join("cell/src")];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder)? {
            let path = entry?.path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                for line in std::fs::read_to_string(&path)?.lines() {
                    for mac in ["gauge!(\"", "counter!(\"", "histogram!(\""] {
                        if let Some((_, rest)) = line.split_once(mac) {
                            names.extend(rest.split('"').next().map(str::to_owned));
                        }
                    }
                }
            }
        }
    }
    // Prometheus's own: 1 while a target answers its scrapes.
    names.insert("up".into());
    Ok(names)
}

struct Selectors(BTreeSet<String>);

impl ExprVisitor for Selectors {
    type Error = ();

    fn pre_visit(&mut self, expr: &Expr) -> Result<bool, ()> {
        let name = match expr {
            Expr::VectorSelector(vs) => vs.name.clone(),
            Expr::MatrixSelector(ms) => ms.vs.name.clone(),
            _ => None,
        };
        self.0.extend(name);
        Ok(true)
    }
}

/// Parses a PromQL query and returns the metric names it uses that nothing exports.
fn unknown_metrics(query: &str, known: &BTreeSet<String>) -> Result<Vec<String>> {
    let expr = promql_parser::parser::parse(query)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("parsing {query:?}"))?;
    let mut selectors = Selectors(BTreeSet::new());
    let _ = walk_expr(&mut selectors, &expr);
    let exported = |name: &str| {
        known.contains(name)
            || ["_bucket", "_sum", "_count"].iter().any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|base| known.contains(base))
            })
    };
    Ok(selectors.0.into_iter().filter(|n| !exported(n)).collect())
}

/// The anchors of a markdown file's headings, as GitHub makes them.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    let mut counts = BTreeMap::<String, usize>::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let title = line.trim_start_matches('#');
        if fenced || title.len() == line.len() || !title.starts_with(' ') {
            continue;
        }
        let title = title.trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let n = counts.entry(slug.clone()).or_default();
        anchors.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    anchors
}

pub(crate) fn alert_rules_use_real_metrics_and_link_existing_runbooks() -> Result<()> {
    let rules: Value = serde_yaml::from_str(&read("deploy/monitoring/alerts.yaml")?)?;
    let known = known_metrics()?;
    let headings = anchors(&read("docs/operations.md")?);
    let mut problems = Vec::new();
    let mut count = 0;
    for group in rules["groups"].as_array().context("no groups")? {
        for rule in group["rules"].as_array().context("a group without rules")? {
            count += 1;
            let alert = rule["alert"]
                .as_str()
                .context("a rule without an alert name")?;
            let expr = rule["expr"]
                .as_str()
                .with_context(|| format!("{alert}: no expr"))?;
            match unknown_metrics(expr, &known) {
                Ok(unknown) if unknown.is_empty() => {}
                Ok(unknown) => {
                    problems.push(format!("{alert}: no such metric: {}", unknown.join(", ")))
                }
                Err(e) => problems.push(format!("{alert}: {e:#}")),
            }
            let link = rule["annotations"]["runbook_url"]
                .as_str()
                .unwrap_or_default();
            match link.strip_prefix("docs/operations.md#") {
                Some(anchor) if headings.contains(anchor) => {}
                Some(anchor) => problems.push(format!(
                    "{alert}: docs/operations.md has no heading with the anchor #{anchor}"
                )),
                None => problems.push(format!(
                    "{alert}: runbook_url {link:?} is not docs/operations.md#..."
                )),
            }
        }
    }
    ensure!(count > 0, "no alert rules");
    ensure!(
        problems.is_empty(),
        "deploy/monitoring/alerts.yaml:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

/// The alert names of deploy/monitoring/alerts.yaml.
fn alert_names() -> Result<BTreeSet<String>> {
    let rules: Value = serde_yaml::from_str(&read("deploy/monitoring/alerts.yaml")?)?;
    let mut names = BTreeSet::new();
    for group in rules["groups"].as_array().context("no groups")? {
        for rule in group["rules"].as_array().context("a group without rules")? {
            let alert = rule["alert"]
                .as_str()
                .context("a rule without an alert name")?;
            names.insert(alert.to_owned());
        }
    }
    ensure!(!names.is_empty(), "no alert rules");
    Ok(names)
}

/// Every alert has a case in alerts.test.yaml that expects it to fire (promtool runs
/// them, below); the file tests alerts.yaml.
pub(crate) fn every_alert_has_a_unit_test_that_fires_it() -> Result<()> {
    let tests: Value = serde_yaml::from_str(&read("deploy/monitoring/alerts.test.yaml")?)
        .context("deploy/monitoring/alerts.test.yaml is not YAML")?;
    let files = tests["rule_files"]
        .as_array()
        .context("alerts.test.yaml: no rule_files")?;
    ensure!(
        files.iter().any(|f| f.as_str() == Some("alerts.yaml")),
        "alerts.test.yaml: rule_files does not name alerts.yaml"
    );
    let mut fired = BTreeSet::new();
    for test in tests["tests"]
        .as_array()
        .context("alerts.test.yaml: no tests")?
    {
        for case in test["alert_rule_test"].as_array().into_iter().flatten() {
            let expects_alerts = case["exp_alerts"]
                .as_array()
                .is_some_and(|alerts| !alerts.is_empty());
            if let (true, Some(name)) = (expects_alerts, case["alertname"].as_str()) {
                fired.insert(name.to_owned());
            }
        }
    }
    let alerts = alert_names()?;
    let untested: Vec<&String> = alerts.difference(&fired).collect();
    ensure!(
        untested.is_empty(),
        "deploy/monitoring/alerts.test.yaml has no case that expects these alerts to fire: {untested:?}"
    );
    let unknown: Vec<&String> = fired.difference(&alerts).collect();
    ensure!(
        unknown.is_empty(),
        "deploy/monitoring/alerts.test.yaml expects alerts that alerts.yaml does not have: {unknown:?}"
    );
    Ok(())
}

pub(crate) fn promtool() -> Result<PathBuf, String> {
    on_path("promtool").ok_or_else(|| {
        "promtool is not on PATH (`make setup` installs it: the Debian package prometheus)"
            .to_string()
    })
}

/// `promtool check rules` on the rules, then their unit tests: each alert fed the
/// series of its runbook's situation fires when it must (the lease alerts before the
/// lease can lapse) and stays quiet in normal operation.
pub(crate) fn alert_rules_pass_promtool(promtool: PathBuf) -> Result<()> {
    for args in [
        ["check", "rules", "deploy/monitoring/alerts.yaml"],
        ["test", "rules", "deploy/monitoring/alerts.test.yaml"],
    ] {
        let out = Command::new(&promtool)
            .current_dir(root())
            .args(args)
            .output()
            .context("running promtool")?;
        ensure!(
            out.status.success(),
            "promtool {} {}:\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

pub(crate) fn dashboard_parses_and_uses_real_metrics() -> Result<()> {
    let board: Value = serde_json::from_str(&read("deploy/monitoring/dashboard.json")?)
        .context("deploy/monitoring/dashboard.json is not JSON")?;
    let known = known_metrics()?;
    let mut panels: Vec<&Value> = board["panels"]
        .as_array()
        .context("no panels")?
        .iter()
        .collect();
    let mut problems = Vec::new();
    let mut queries = 0;
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            let Some(expr) = target["expr"].as_str() else {
                continue;
            };
            queries += 1;
            // Grafana's own variables, as Prometheus would see them.
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$__interval", "30s");
            let title = panel["title"].as_str().unwrap_or("?");
            match unknown_metrics(&expr, &known) {
                Ok(unknown) if unknown.is_empty() => {}
                Ok(unknown) => {
                    problems.push(format!("{title}: no such metric: {}", unknown.join(", ")))
                }
                Err(e) => problems.push(format!("{title}: {e:#}")),
            }
        }
    }
    ensure!(queries > 0, "the dashboard has no queries");
    ensure!(
        problems.is_empty(),
        "deploy/monitoring/dashboard.json:\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}
