//! Test suites of etcd client libraries, run unmodified against an etcd endpoint.
//!
//! The suite of the Python client aetcd (PyPI, Apache-2.0) ships in its source
//! distribution; `make setup` installs aetcd with the suite's test dependencies into
//! `.lockcell-tools/venv` and unpacks the suite into `.lockcell-tools/aetcd-<version>`.
//! The suite reads its endpoint from `TEST_ETCD_HTTP_URL` and calls `etcdctl`, which must
//! be on PATH.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};

/// The aetcd release whose suite runs.
pub const AETCD_VERSION: &str = "1.0.0";

/// A test left out of a run, with the reason written beside it.
#[derive(Debug, Clone, Copy)]
pub struct Deselected {
    /// pytest's node id: `tests/integration/test_auth.py::test_auth`.
    pub test: &'static str,
    pub why: &'static str,
}

/// Tests that cannot pass against any endpoint but the default one, whatever it serves.
pub const NOT_AT_THIS_ENDPOINT: &[Deselected] = &[Deselected {
    test: "tests/integration/test_auth.py::test_auth",
    why: "its client connects to localhost:2379 whatever TEST_ETCD_HTTP_URL says",
}];

/// Tests that cannot pass through a lockcell proxy because they call an RPC it refuses
/// on purpose (docs/etcd-api.md): each acts on etcd's members or history, which the
/// cell's operators run, not its clients.
pub const REFUSED_BY_A_PROXY: &[Deselected] = &[
    Deselected {
        test: "tests/integration/test_kv.py::test_compact",
        why: "Compact is refused: the cell's operators compact etcd",
    },
    Deselected {
        test: "tests/integration/test_watch.py::test_watch_key_with_revision_compacted",
        why: "it compacts first, and Compact is refused",
    },
    Deselected {
        test: "tests/integration/test_maintenance.py::test_create_alarm_all_members",
        why: "Alarm is refused: alarms are raised on etcd's members",
    },
    Deselected {
        test: "tests/integration/test_maintenance.py::test_create_alarm_specific_member",
        why: "Alarm is refused: alarms are raised on etcd's members",
    },
    Deselected {
        test: "tests/integration/test_maintenance.py::test_list_alarms",
        why: "Alarm is refused: alarms are raised on etcd's members",
    },
    Deselected {
        test: "tests/integration/test_maintenance.py::test_disarm_alarm",
        why: "Alarm is refused: alarms are raised on etcd's members",
    },
    Deselected {
        test: "tests/integration/test_maintenance.py::test_status_member",
        why: "its fixture disarms alarms after it, and Alarm is refused",
    },
    Deselected {
        test: "tests/integration/test_maintenance.py::test_hash",
        why: "Hash is refused: it hashes one etcd member's store",
    },
    Deselected {
        test: "tests/integration/test_maintenance.py::test_snapshot",
        why: "Snapshot is refused: the cell is backed up from etcd itself",
    },
];

fn tools() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.lockcell-tools")
}

/// Where the suite was unpacked.
pub fn aetcd_dir() -> PathBuf {
    tools().join(format!("aetcd-{AETCD_VERSION}"))
}

fn python() -> PathBuf {
    tools().join("venv/bin/python")
}

/// True when the suite, its interpreter and `etcdctl` are here; its tests skip without.
pub fn available() -> bool {
    aetcd_dir().join("tests/integration").is_dir() && python().is_file() && etcdctl_available()
}

/// True when `etcdctl` (Debian's etcd-client package) runs here.
pub fn etcdctl_available() -> bool {
    std::process::Command::new("etcdctl")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// What one run of a suite counted, from pytest's summary line.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SuiteRun {
    pub passed: u32,
    pub failed: u32,
    pub errors: u32,
    pub skipped: u32,
    pub deselected: u32,
    /// pytest's report, for a failure's message.
    pub output: String,
}

impl SuiteRun {
    /// Reads the counts from pytest's last summary line
    /// (`1 failed, 90 passed, 2 skipped, 1 deselected in 60.62s`).
    pub fn parse(output: &str) -> anyhow::Result<SuiteRun> {
        let line = output
            .lines()
            .rev()
            .find(|l| l.contains(" in ") && (l.contains("passed") || l.contains("failed")))
            .context("pytest printed no summary line")?;
        let mut run = SuiteRun {
            output: output.to_owned(),
            ..SuiteRun::default()
        };
        let counts = line.trim_matches(|c| c == '=' || c == ' ');
        let counts = counts.split(" in ").next().unwrap_or_default();
        for part in counts.split(", ") {
            let mut words = part.split_whitespace();
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u32>() else { continue };
            match what {
                "passed" => run.passed = n,
                "failed" => run.failed = n,
                "error" | "errors" => run.errors = n,
                "skipped" => run.skipped = n,
                "deselected" => run.deselected = n,
                _ => {}
            }
        }
        Ok(run)
    }
}

/// Runs aetcd's suite against `endpoint` (`http://127.0.0.1:PORT`), leaving out
/// `deselect`, within `timeout`.
pub async fn run_aetcd(
    endpoint: &str,
    deselect: &[Deselected],
    timeout: Duration,
) -> anyhow::Result<SuiteRun> {
    let mut command = tokio::process::Command::new(python());
    command
        .current_dir(aetcd_dir())
        .env("TEST_ETCD_HTTP_URL", endpoint)
        .args(["-m", "pytest", "-o", "addopts=", "-q", "-rfE"])
        .args(["-p", "no:cacheprovider", "tests"])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for d in deselect {
        command.args(["--deselect", d.test]);
    }
    let run = tokio::time::timeout(timeout, command.output())
        .await
        .with_context(|| format!("aetcd's suite did not finish within {timeout:?}"))?
        .context("running aetcd's suite with pytest")?;
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    match SuiteRun::parse(&output) {
        Ok(counts) => Ok(counts),
        Err(e) => bail!("{e}; pytest exited with {}:\n{output}", run.status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytest_summaries_are_counted() {
        let run = SuiteRun::parse(
            "....F\nFAILED tests/x.py::y - boom\n1 failed, 90 passed, 2 skipped, 1 deselected in 60.62s\n",
        )
        .unwrap();
        assert_eq!(
            (
                run.passed,
                run.failed,
                run.errors,
                run.skipped,
                run.deselected
            ),
            (90, 1, 0, 2, 1)
        );
        let run = SuiteRun::parse("==== 91 passed, 2 skipped, 3 errors in 1.00s ====").unwrap();
        assert_eq!((run.passed, run.errors), (91, 3));
        assert!(SuiteRun::parse("ImportError: no module named aetcd").is_err());
    }
}
