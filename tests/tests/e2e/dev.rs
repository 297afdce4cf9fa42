//! `make dev`: the local cell starts, its printed lockctl example works, so do the client
//! guide's connection example and every `lockctl` line of the guide after sourcing the
//! cell's `env` file (as the guide says), and Ctrl-C stops every process it started.

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
        .process_group(0)
        .kill_on_drop(true)
        .spawn()?;
    let _group = KillGroup(dev.id().context("pid")? as i32);
    let mut lines = tokio::io::BufReader::new(dev.stdout.take().context("stdout")?).lines();
    let (example, etcdctl_example) = tokio::time::timeout(Duration::from_secs(90), async {
        let mut etcdctl = None;
        while let Some(line) = lines.next_line().await? {
            if line.starts_with("etcdctl --endpoints") {
                etcdctl = Some(line);
            } else if line.contains("lockctl --proxy") {
                return anyhow::Ok((line, etcdctl));
            }
        }
        anyhow::bail!("lockcell-dev ended without printing a lockctl example")
    })
    .await
    .context("lockcell-dev did not come up within 90 s")??;
    let etcdctl_example =
        etcdctl_example.context("lockcell-dev printed no etcdctl example before lockctl's")?;

    let endpoints = std::fs::read_to_string(dir.path().join("endpoints"))?;
    for kind in ["etcd", "proxy", "admin", "etcd-api"] {
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

    // The printed etcdctl example, where etcdctl is installed: it writes the key
    // lockctl reads.
    if lockcell_tests::client_suites::etcdctl_available() {
        let output = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::process::Command::new("sh")
                .arg("-c")
                .arg(&etcdctl_example)
                .output(),
        )
        .await
        .context("the printed etcdctl example did not finish")??;
        ensure!(
            output.status.success() && String::from_utf8_lossy(&output.stdout).trim() == "OK",
            "the etcdctl example failed: {etcdctl_example}\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let env = dir.path().join("env");
        let read = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(format!(". '{}' && lockctl get hello-etcd", env.display()))
            .output()
            .await?;
        ensure!(
            String::from_utf8_lossy(&read.stdout).contains("world"),
            "lockctl does not read what the etcdctl example wrote: {}{}",
            String::from_utf8_lossy(&read.stdout),
            String::from_utf8_lossy(&read.stderr)
        );
    }

    // What a new reader does next: `. .lockcell-dev/env`, then the guide's lines.
    let env_file = dir.path().join("env");
    let env = std::fs::read_to_string(&env_file).context("the dev cell's env file")?;
    let (lines, sources_env) = crate::guide::lockctl_lines()?;
    ensure!(
        sources_env,
        "the client guide does not tell the reader to source .lockcell-dev/env"
    );
    ensure!(
        lines.len() >= 8,
        "the guide has only {} lockctl lines",
        lines.len()
    );
    for line in &lines {
        // Its own process group: a line that hangs is killed whole (sh and lockctl) when
        // the timeout drops it. Not `exec`: a line may be `lockctl ... || echo ...`.
        let mut command = tokio::process::Command::new("sh");
        command
            .arg("-c")
            .arg(format!(". '{}' && {line}", env_file.display()))
            .process_group(0)
            .kill_on_drop(true);
        let child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let _group = KillGroup(child.id().context("pid")? as i32);
        let run = child.wait_with_output();
        let out = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .with_context(|| format!("the guide's `{line}` did not end within 30 s"))??;
        ensure!(
            out.status.success(),
            "the guide's `{line}` failed against the dev cell ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    readme_example(&env_file).await?;

    // The guide's Rust connection example, with the values the env file gives.
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            // One shell word, quoted: the paths here have no quote of their own.
            .map(|v| v.trim_matches('\'').to_owned())
            .with_context(|| format!("{name} is not in the env file:\n{env}"))
    };
    let client = crate::guide::connect(
        &var("LOCKCELL_PROXY")?,
        &var("LOCKCELL_TLS_CA")?,
        &var("LOCKCELL_AUTH_TOKEN")?,
    )
    .await
    .map_err(|e| anyhow::anyhow!("the guide's connect example: {e}"))?;
    ensure!(
        client.get("hello").await?.map(|e| e.value) == Some(b"world".to_vec()),
        "the SDK does not read what the guide's lockctl put wrote"
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

/// Kills the dev cell's process group (lockcell-dev, its etcd members and proxies) when
/// the test ends early on a failed check, so none of them outlives it; after a clean
/// stop the group is gone and this does nothing.
struct KillGroup(i32);

impl Drop for KillGroup {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(Pid::from_raw(self.0), Signal::SIGKILL);
    }
}

/// The README's example block after `. .lockcell-dev/env`: a lock, an election, and a
/// watch of a prefix that prints a write made from another shell.
async fn readme_example(env_file: &std::path::Path) -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))?;
    let block = crate::guide::blocks(&readme, "```sh")
        .into_iter()
        .find(|b| b.starts_with(". .lockcell-dev/env"))
        .context("the README has no example that sources .lockcell-dev/env")?;
    let shell = |line: &str| {
        let mut command = tokio::process::Command::new("sh");
        command
            .arg("-c")
            .arg(format!(". '{}' && exec {line}", env_file.display()))
            .kill_on_drop(true);
        command
    };
    let mut watched = false;
    for line in block.lines().filter(|l| l.starts_with("lockctl ")) {
        let (line, other_shell) = match line.split_once('#') {
            Some((line, comment)) => (line.trim(), comment.split_once(": ").map(|(_, c)| c)),
            None => (line, None),
        };
        if !line.starts_with("lockctl watch ") {
            let out = tokio::time::timeout(Duration::from_secs(30), shell(line).output())
                .await
                .with_context(|| format!("the README's `{line}` did not end within 30 s"))??;
            ensure!(
                out.status.success() && !out.stdout.is_empty(),
                "the README's `{line}` failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            continue;
        }
        // The watch runs until stopped; the write the comment names must show in it.
        let write = other_shell.context("the README's watch line names no write")?;
        let key = write.split_whitespace().nth(2).context("the write's key")?;
        let mut watch = shell(line).stdout(Stdio::piped()).spawn()?;
        let mut out = tokio::io::BufReader::new(watch.stdout.take().context("stdout")?).lines();
        let seen = async {
            // Written until the watch prints it: the watch may start after a first write.
            let mut tries = 0;
            loop {
                let put = shell(write).output().await?;
                ensure!(put.status.success(), "the README's `{write}` failed");
                tries += 1;
                match tokio::time::timeout(Duration::from_secs(2), out.next_line()).await {
                    Ok(Ok(Some(line))) if line.contains(&format!("put {key} ")) => {
                        return anyhow::Ok(tries)
                    }
                    Ok(Ok(Some(_))) | Err(_) => continue,
                    Ok(Ok(None)) => anyhow::bail!("the README's watch ended"),
                    Ok(Err(e)) => return Err(e.into()),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(30), seen)
            .await
            .with_context(|| format!("the README's `{line}` printed no write within 30 s"))??;
        let _ = watch.kill().await;
        watched = true;
    }
    ensure!(watched, "the README's example watches no prefix");
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
