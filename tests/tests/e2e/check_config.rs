//! `--check-config`: a file a running proxy refuses (keeping the last good one in force)
//! stops the next start; the check finds it first, naming the file and the line, the
//! way the start would. Nothing here contacts etcd (`--etcd 127.0.0.1:1`), so no etcd
//! runs.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_tests::bins;

/// Two classes under a `[default]` (as in deploy/config/classes.toml).
const CLASSES: &str = r#"[default]
ttl_min = "1s"
ttl_max = "120s"

[[class]]
name = "batch"
prefix = "batch/"
modes = ["exclusive"]
fenced = false
fair = true
lock_delay = "15s"

[[class]]
name = "leader"
prefix = "election/"
ttl_max = "30s"
modes = ["exclusive"]
"#;

/// Two grants (as in deploy/config/grants.toml).
const GRANTS: &str = r#"[[grant]]
identity = "billing"
lock = ["billing/"]
read = ["billing/", "config/"]
write = ["billing/"]

[[grant]]
identity = "dev"
lock = ["dev/"]
"#;

/// `text` with its last `header` line left unclosed (`[[grant]` for `[[grant]]`, a file
/// caught half-edited), and that line's number.
fn unclosed(text: &str, header: &str) -> (String, usize) {
    let mut lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .rposition(|l| *l == header)
        .expect("the header is in the text");
    lines[at] = &header[..header.len() - 1];
    (lines.join("\n") + "\n", at + 1)
}

/// Runs a workspace binary to its end (within 30 s).
async fn run(bin: &str, args: &[&str]) -> anyhow::Result<Output> {
    let mut command = tokio::process::Command::new(bins::workspace_bin(bin)?);
    command.args(args).kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(30), command.output())
        .await
        .with_context(|| format!("{bin} {} did not end within 30 s", args.join(" ")))?
        .with_context(|| format!("running {bin}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `lockcell-proxy --check-config` with the classes and grants files given.
async fn check_proxy(classes: &Path, grants: &Path) -> anyhow::Result<Output> {
    run(
        "lockcell-proxy",
        &[
            "--check-config",
            "--etcd",
            "127.0.0.1:1",
            "--zone",
            "a",
            "--classes",
            classes.to_str().context("path")?,
            "--grants",
            grants.to_str().context("path")?,
            "--grants-without-tls",
        ],
    )
    .await
}

/// Expects a check that failed (exit 1) saying `file:line:`; its stderr.
fn refused(out: &Output, file: &Path, line: usize, what: &str) -> anyhow::Result<String> {
    let stderr = text(&out.stderr);
    ensure!(
        out.status.code() == Some(1),
        "{what}: the check did not fail with exit status 1 ({}):\nstdout:\n{}\nstderr:\n{stderr}",
        out.status,
        text(&out.stdout)
    );
    let at = format!("{}:{line}:", file.display());
    ensure!(
        stderr.contains(&at) && stderr.contains("unclosed"),
        "{what}: the check's error does not name {at}:\n{stderr}"
    );
    ensure!(
        !text(&out.stdout).contains("configuration OK"),
        "{what}: the check said OK"
    );
    Ok(stderr)
}

pub async fn check_config_finds_a_bad_file_before_a_restart_does() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let classes = dir.path().join("classes.toml");
    let grants = dir.path().join("grants.toml");
    std::fs::write(&classes, CLASSES)?;
    std::fs::write(&grants, GRANTS)?;

    // Good files: one line for each, then OK.
    let out = check_proxy(&classes, &grants).await?;
    let stdout = text(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains("lockcell-proxy: configuration OK"),
        "good files were not passed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        text(&out.stderr)
    );
    for line in [
        format!("classes {}: 2 classes", classes.display()),
        format!("grants {}: 2 entries", grants.display()),
    ] {
        ensure!(stdout.contains(&line), "no {line:?} in:\n{stdout}");
    }

    // A grants file caught half-edited: refused, naming the file and the line...
    let (bad, line) = unclosed(GRANTS, "[[grant]]");
    std::fs::write(&grants, bad)?;
    let checked = refused(
        &check_proxy(&classes, &grants).await?,
        &grants,
        line,
        "a broken grants file",
    )?;
    // ...as the start it warns of says it (which fails before it would contact etcd).
    let start = run(
        "lockcell-proxy",
        &[
            "--etcd",
            "127.0.0.1:1",
            "--zone",
            "a",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--classes",
            classes.to_str().context("path")?,
            "--grants",
            grants.to_str().context("path")?,
            "--grants-without-tls",
        ],
    )
    .await?;
    let started = text(&start.stderr);
    let said = started
        .lines()
        .find(|l| l.starts_with("lockcell-proxy: "))
        .with_context(|| format!("the start said nothing of its own:\n{started}"))?;
    ensure!(
        start.status.code() == Some(1) && checked.lines().any(|l| l == said),
        "the start ({}) and the check disagree:\nstart:\n{started}\ncheck:\n{checked}",
        start.status
    );

    // A broken classes file, with the grants file good again.
    std::fs::write(&grants, GRANTS)?;
    let (bad, line) = unclosed(CLASSES, "[[class]]");
    std::fs::write(&classes, bad)?;
    refused(
        &check_proxy(&classes, &grants).await?,
        &classes,
        line,
        "a broken classes file",
    )?;

    // The audit tailer reads the same grants file.
    let audit = |file: &Path| {
        vec![
            "--check-config".to_owned(),
            "audit".to_owned(),
            "--etcd".to_owned(),
            "127.0.0.1:1".to_owned(),
            "--grants".to_owned(),
            file.display().to_string(),
            "--grants-without-tls".to_owned(),
            "--data-dir".to_owned(),
            dir.path().join("data").display().to_string(),
        ]
    };
    let args = audit(&grants);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("lockcell-cell", &args).await?;
    ensure!(
        out.status.success() && text(&out.stdout).contains("lockcell-cell: configuration OK"),
        "lockcell-cell passed no good grants file ({}):\n{}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    let (bad, line) = unclosed(GRANTS, "[[grant]]");
    let broken = dir.path().join("broken-grants.toml");
    std::fs::write(&broken, bad)?;
    let args = audit(&broken);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("lockcell-cell", &args).await?;
    let stderr = text(&out.stderr);
    let at = format!("the grants file {} line {line}", broken.display());
    ensure!(
        out.status.code() == Some(1) && stderr.contains(&at),
        "lockcell-cell did not refuse {at} ({}):\n{}{stderr}",
        out.status,
        text(&out.stdout)
    );
    ensure!(
        !dir.path().join("data").exists(),
        "the check wrote the audit data folder"
    );
    Ok(())
}
