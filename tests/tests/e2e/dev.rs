//! `make dev`: the local cell starts, its printed lockctl example works, Ctrl-C stops
//! every process it started.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_tests::{bins, eventually};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::AsyncBufReadExt;

pub async fn make_dev_cell_runs_the_lockctl_example_and_stops_cleanly() -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("lockcell-dev-test-")
        .tempdir()?;
    let mut dev = tokio::process::Command::new(bins::workspace_bin("lockcell-dev")?)
        .arg("--dir")
        .arg(dir.path())
        .args(["--lease-ttl", "3s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = tokio::io::BufReader::new(dev.stdout.take().context("stdout")?).lines();
    let example = tokio::time::timeout(Duration::from_secs(90), async {
        while let Some(line) = lines.next_line().await? {
            if line.contains("lockctl --proxy") {
                return anyhow::Ok(line);
            }
        }
        anyhow::bail!("lockcell-dev ended without printing a lockctl example")
    })
    .await
    .context("lockcell-dev did not come up within 90 s")??;

    let endpoints = std::fs::read_to_string(dir.path().join("endpoints"))?;
    for kind in ["etcd", "proxy", "admin"] {
        for zone in ["a", "b", "c"] {
            ensure!(
                endpoints
                    .lines()
                    .any(|l| l.starts_with(&format!("{kind} {zone} 127.0.0.1:"))),
                "endpoints has no {kind} line for zone {zone}:\n{endpoints}"
            );
        }
    }

    // The printed example, pasted into a shell.
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&example)
            .output(),
    )
    .await
    .context("the printed example did not finish")??;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "the example failed: {example}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // LOCKCELL_TOKEN in the command's environment is the lock's fencing token,
    // EPOCH:REVISION (lockctl sets it for the command).
    let token = stdout
        .trim()
        .strip_prefix("holding demo with token ")
        .with_context(|| format!("the example printed {stdout:?}"))?;
    ensure!(
        token.parse::<lockcell_client::FencingToken>().is_ok(),
        "the example printed the token {token:?}, not EPOCH:REVISION"
    );

    kill(
        Pid::from_raw(dev.id().context("pid")? as i32),
        Signal::SIGINT,
    )?;
    let status = tokio::time::timeout(Duration::from_secs(30), dev.wait())
        .await
        .context("lockcell-dev did not stop on SIGINT")??;
    ensure!(status.success(), "lockcell-dev exited with {status:?}");
    // etcd members name the folder in their arguments, proxies name the etcd addresses.
    let mut markers = vec![dir.path().to_string_lossy().into_owned()];
    markers.extend(
        endpoints
            .lines()
            .filter_map(|l| l.strip_prefix("etcd "))
            .filter_map(|l| l.split(' ').nth(1))
            .map(str::to_owned),
    );
    eventually(
        "no process of the dev cell is left",
        Duration::from_secs(10),
        || {
            let left = processes_mentioning(&markers);
            async move { Ok(left.is_empty().then_some(())) }
        },
    )
    .await
    .with_context(|| format!("left running: {:?}", processes_mentioning(&markers)))?;
    Ok(())
}

/// Command lines of running processes that mention any of `markers`.
fn processes_mentioning(markers: &[String]) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .chars()
                .all(|c| c.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .filter(|cmd| markers.iter().any(|m| cmd.contains(m.as_str())))
        .collect()
}
