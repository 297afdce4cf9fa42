//! Offline checks of the deployment files under `deploy/`: the Kubernetes manifests
//! against the Kubernetes schemas and against each other, the systemd units, and the
//! monitoring files against the code (every metric an alert or a dashboard panel uses
//! exists, every alert's runbook link names a heading of `docs/operations.md`).
//!
//! Run with `make test` (or `cargo test -p lockcell-tests --test deploy`). A check whose
//! tool is missing reports itself ignored (skipped), never passed: kubernetes-validate
//! (`make setup` installs it into `.lockcell-tools/venv`), systemd-analyze, promtool
//! (`make setup` installs Debian's prometheus package, which has it; it runs the alert
//! rules' unit tests, deploy/monitoring/alerts.test.yaml), and the workspace's binaries
//! (`cargo build --workspace --bins`), whose `--help` the flags in the files are
//! checked against.

mod flags;
mod kubernetes;
mod monitoring;
mod systemd;

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use libtest_mimic::{Arguments, Trial};

/// Each check by its path, which is also its name.
macro_rules! check {
    ($module:ident :: $test:ident) => {
        check(
            concat!(stringify!($module), "::", stringify!($test)),
            $module::$test,
        )
    };
}

/// A check that needs a tool, by its path, with the tool or why it is missing.
macro_rules! needs {
    ($module:ident :: $test:ident, $tool:expr) => {
        needs(
            concat!(stringify!($module), "::", stringify!($test)),
            $tool,
            $module::$test,
        )
    };
}

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        check!(kubernetes::configmaps_hold_the_example_config_files),
        check!(kubernetes::every_zone_runs_the_same_proxy_daemonset),
        check!(kubernetes::proxy_pods_and_units_outlast_their_drain),
        check!(kubernetes::probes_and_the_drain_hook_use_the_servers_paths),
        check!(kubernetes::no_max_unavailable_budget_covers_a_daemonset),
        check!(kubernetes::the_kustomization_applies_every_manifest_and_names_the_image),
        needs!(
            kubernetes::manifests_pass_the_schema_validator,
            kubernetes::kubernetes_validate()
        ),
        needs!(
            flags::flags_and_variables_are_the_binaries_own,
            flags::built_binaries()
        ),
        needs!(
            systemd::units_pass_systemd_analyze,
            on_path("systemd-analyze").ok_or_else(|| "no systemd-analyze on PATH".to_string())
        ),
        check!(monitoring::alert_rules_use_real_metrics_and_link_existing_runbooks),
        check!(monitoring::dashboard_parses_and_uses_real_metrics),
        check!(monitoring::every_alert_has_a_unit_test_that_fires_it),
        needs!(
            monitoring::alert_rules_pass_promtool,
            monitoring::promtool()
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn check(name: &str, f: fn() -> Result<()>) -> Trial {
    Trial::test(name, move || f().map_err(|e| format!("{e:#}").into()))
}

/// A check that needs a tool: ignored, with a line saying why, when it is missing.
fn needs<T: Send + 'static>(name: &str, tool: Result<T, String>, f: fn(T) -> Result<()>) -> Trial {
    match tool {
        Ok(tool) => Trial::test(name, move || f(tool).map_err(|e| format!("{e:#}").into())),
        Err(why) => {
            // Straight to stderr: libtest-mimic does not capture it, so it is seen.
            let _ = writeln!(std::io::stderr(), "deploy: skipped {name}: {why}");
            Trial::test(name, || Ok(())).with_ignored_flag(true)
        }
    }
}

pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace")
        .to_path_buf()
}

pub(crate) fn read(relative: &str) -> Result<String> {
    std::fs::read_to_string(root().join(relative)).with_context(|| format!("reading {relative}"))
}

pub(crate) fn files(folder: &str, extension: &str) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in
        std::fs::read_dir(root().join(folder)).with_context(|| format!("listing {folder}"))?
    {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == extension) {
            found.push(path);
        }
    }
    found.sort();
    ensure!(!found.is_empty(), "no *.{extension} in {folder}");
    Ok(found)
}

pub(crate) fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}
