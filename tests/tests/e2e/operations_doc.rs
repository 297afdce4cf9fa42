//! docs/operations.md's commands, run as written against a real cell: every command
//! line of its `sh` blocks is run here, or named with the test that runs it.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_cell::audit::EventKind;
use lockcell_tests::audit::AuditProcess;
use lockcell_tests::etcd::{reserve_ports, ADMIN_PASSWORD, ROOT_PASSWORD};
use lockcell_tests::{bins, eventually, EtcdCluster, ProxyOptions, ProxyProcess};
use nix::sys::signal::Signal;

use crate::cell::restore;
use crate::faults::{exited, first_line, lockctl_command};

/// The guide's command lines this test runs, each exactly as the guide writes it (the
/// placeholders of [`PLACEHOLDERS`] aside).
const RUN: &[&str] = &[
    "LOCKCELL_ETCD_PASSWORD=... lockcell-cell --config cell.toml init",
    "lockctl who jobs/stuck",
    "lockcell-proxy --version",
    "lockcell-cell --config cell.toml status",
    "lockcell-cell --config cell.toml status --tailer https://cell-1:7431",
    "mkdir -p backup",
    "etcdctl --endpoints 10.0.1.5:2379 --user \"root:$LOCKCELL_ROOT_PASSWORD\" snapshot save backup/cell-a.db",
    "etcdctl --write-out table snapshot status backup/cell-a.db",
    "lockcell-cell --config cell.toml epoch > backup/cell-a.epoch",
    "lockcell-cell --config cell.toml force-release jobs/stuck --token \"$TOKEN\" --reason \"host-7 hung, ticket OPS-42\"",
    "lockctl audit billing/nightly --since 24h --audit https://cell-1:7431",
    "lockcell-cell --config cell.toml bump-epoch",
    "lockcell-cell shardmap set shardmap.toml --etcd 10.0.1.5:2379",
    "lockcell-cell shardmap show --etcd 10.0.1.5:2379",
    "lockcell-cell shardmap show --toml --etcd 10.0.9.5:2379 > shardmap.toml",
    "lockcell-cell shardmap set shardmap.toml --etcd 10.0.9.5:2379",
];

/// The guide's command lines run elsewhere, and where.
const ELSEWHERE: &[(&str, &str)] = &[
    (
        "lockcell-cell audit --etcd 10.0.1.5:2379 --data-dir /var/lib/lockcell-cell --etcd-user lockcell-tailer --listen 0.0.0.0:7431 --grants /etc/lockcell/grants.toml --tls-cert audit.crt --tls-key audit.key",
        "a server with TLS files: the audit tests start it with these flags (admin::, audit::, and lockcell-dev)",
    ),
    (
        "lockcell-cell audit rebuild --data-dir /var/lib/lockcell-cell [--store URL] [--archive s3://...]",
        "a synopsis: audit::the_trail_of_a_scripted_run_is_complete_in_order_and_rebuilt_from_the_archive runs it",
    ),
    (
        "lockcell-cell shardmap move billing/ --to b --etcd 10.0.1.5:2379 --wait 10m",
        "needs two cells: shardmap::two_cells_route_correctly_and_a_prefix_move_never_shows_two_holders",
    ),
    (
        "lockcell-proxy --config /etc/lockcell/proxy.toml --check-config",
        "reads the host's files: check_config::check_config_finds_a_bad_file_before_a_restart_does",
    ),
];

/// What the guide writes for a value of the reader's cell, and what stands for it here.
const PLACEHOLDERS: [&str; 3] = ["10.0.1.5:2379", "10.0.9.5:2379", "https://cell-1:7431"];

/// The command lines of the guide's `sh` blocks: comments left out, continued lines
/// joined.
fn commands(guide: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    let mut pending = String::new();
    for line in guide.lines() {
        let line = line.trim();
        if line.starts_with("```") {
            inside = line == "```sh";
            continue;
        }
        if !inside || line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => {
                pending.push_str(part.trim_end());
                pending.push(' ');
            }
            None => {
                pending.push_str(line);
                out.push(std::mem::take(&mut pending));
            }
        }
    }
    out
}

/// Runs guide lines in one folder with one environment, as a reader's shell would.
struct Shell<'a> {
    dir: &'a Path,
    endpoint: String,
    tailer: String,
    proxy: String,
    token: String,
}

impl Shell<'_> {
    async fn run(&self, line: &str) -> anyhow::Result<Output> {
        ensure!(RUN.contains(&line), "{line:?} is not in RUN");
        let mut text = line.replace(
            "LOCKCELL_ETCD_PASSWORD=...",
            "LOCKCELL_ETCD_PASSWORD=\"$LOCKCELL_ETCD_PASSWORD\"",
        );
        for (placeholder, value) in
            PLACEHOLDERS
                .iter()
                .zip([&self.endpoint, &self.endpoint, &self.tailer])
        {
            text = text.replace(placeholder, value);
        }
        let path = format!(
            "{}:{}",
            bins::bin_dir()?.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = tokio::process::Command::new("sh")
            .args(["-c", &text])
            .current_dir(self.dir)
            .env("PATH", path)
            .env("ETCDCTL_API", "3")
            .env("LOCKCELL_ETCD_USER", lockcell_cell::rbac::ADMIN_USER)
            .env("LOCKCELL_ETCD_PASSWORD", ADMIN_PASSWORD)
            .env("LOCKCELL_ROOT_PASSWORD", ROOT_PASSWORD)
            .env("LOCKCELL_PROXY", &self.proxy)
            .env("TOKEN", &self.token)
            .kill_on_drop(true)
            .output();
        Ok(tokio::time::timeout(Duration::from_secs(90), out)
            .await
            .with_context(|| format!("{text} ran for 90 s"))??)
    }

    /// Runs `line`, which must succeed; its standard output.
    async fn ok(&self, line: &str) -> anyhow::Result<String> {
        let out = self.run(line).await?;
        ensure!(
            out.status.success(),
            "the guide's `{line}` failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

pub async fn the_operations_guides_commands_run_against_a_real_cell() -> anyhow::Result<()> {
    let guide = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md"),
    )?;
    let lines = commands(&guide);
    ensure!(
        lines.len() >= RUN.len()
            && commands("```sh\n# note\nfoo --a \\\n  --b\n```") == ["foo --a --b"],
        "the guide's sh blocks were not read: {lines:?}"
    );
    for line in &lines {
        ensure!(
            RUN.contains(&line.as_str()) || ELSEWHERE.iter().any(|(l, _)| l == line),
            "docs/operations.md has the command `{line}`, which no test runs: run it in \
             tests/tests/e2e/operations_doc.rs (RUN), or name the test that does (ELSEWHERE)"
        );
    }
    for line in RUN.iter().chain(ELSEWHERE.iter().map(|(l, _)| l)) {
        ensure!(
            lines.iter().any(|l| l == line),
            "`{line}` is no longer in docs/operations.md; take it out of operations_doc.rs"
        );
    }

    let dir = tempfile::tempdir()?;
    let etcd_dir = dir.path().join("etcd");
    let ports = reserve_ports(1);
    let etcd = EtcdCluster::start_on(&etcd_dir, &ports).await?;
    let endpoint = etcd.endpoints()[0].clone();
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.lease_ttl = Duration::from_secs(3);
    let mut proxy = ProxyProcess::start(&options, &etcd_dir).await?;
    let tailer = AuditProcess::start(
        "run",
        &etcd.endpoints(),
        &dir.path().join("audit"),
        &[],
        &dir.path().join("audit.log"),
    )
    .await?;
    let work = dir.path().join("ops");
    std::fs::create_dir_all(&work)?;
    std::fs::write(
        work.join("cell.toml"),
        format!("etcd = [\"http://{endpoint}\"]\netcd-user = \"lockcell-admin\"\n"),
    )?;
    let mut shell = Shell {
        dir: &work,
        endpoint: endpoint.clone(),
        tailer: format!("http://{}", tailer.addr),
        proxy: proxy.addr.clone(),
        token: String::new(),
    };

    // Setting a cell up: init on a cell that has its record writes nothing.
    let init = shell
        .ok("LOCKCELL_ETCD_PASSWORD=... lockcell-cell --config cell.toml init")
        .await?;
    ensure!(
        init.contains("already has its epoch record"),
        "init said: {init}"
    );

    // A holder that is stuck: alive and renewing, never letting go.
    let mut stuck = lockctl_command(
        &proxy.addr,
        ("4s", "1s"),
        "jobs/stuck",
        "echo holding; exec sleep 600",
        &work,
    )?
    .spawn()?;
    first_line(&mut stuck, "holding").await?;

    // Inspecting it.
    let who = shell.ok("lockctl who jobs/stuck").await?;
    let token = who
        .split_whitespace()
        .find_map(|w| w.strip_prefix("token="))
        .with_context(|| format!("lockctl who shows no token: {who}"))?
        .to_owned();
    ensure!(
        who.starts_with("held exclusive") && who.contains("proxy=") && who.contains("since "),
        "lockctl who said: {who}"
    );
    shell.token = token.clone();

    // Upgrading: which version runs where.
    let version = shell.ok("lockcell-proxy --version").await?;
    ensure!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    let status = shell
        .ok("lockcell-cell --config cell.toml status --tailer https://cell-1:7431")
        .await?;
    for want in [
        "cell: cluster ",
        "etcd members: 1",
        ", leader",
        "proxies: 1",
        &format!("version {}", env!("CARGO_PKG_VERSION")),
        "ready: leases",
        "revisions behind",
        "everything answers",
    ] {
        ensure!(
            status.contains(want),
            "status does not say {want:?}:\n{status}"
        );
    }
    shell.ok("lockcell-cell --config cell.toml status").await?;

    // Backups.
    shell.ok("mkdir -p backup").await?;
    shell
        .ok("etcdctl --endpoints 10.0.1.5:2379 --user \"root:$LOCKCELL_ROOT_PASSWORD\" snapshot save backup/cell-a.db")
        .await?;
    let table = shell
        .ok("etcdctl --write-out table snapshot status backup/cell-a.db")
        .await?;
    ensure!(
        table.contains("TOTAL KEYS"),
        "snapshot status said: {table}"
    );
    shell
        .ok("lockcell-cell --config cell.toml epoch > backup/cell-a.epoch")
        .await?;
    let epoch = std::fs::read_to_string(work.join("backup/cell-a.epoch"))?;
    ensure!(
        epoch.starts_with("cluster "),
        "the epoch file holds {epoch:?}"
    );

    // Force-releasing the stuck hold: its command stops, the lock is free, the trail
    // says who did it and why.
    let released = shell
        .ok("lockcell-cell --config cell.toml force-release jobs/stuck --token \"$TOKEN\" --reason \"host-7 hung, ticket OPS-42\"")
        .await?;
    ensure!(
        released.starts_with("released exclusive hold"),
        "{released}"
    );
    let (code, stderr) = exited(stuck).await?;
    ensure!(
        code != Some(0) && stderr.contains("ended by an operator: host-7 hung"),
        "lockctl lock exited {code:?} and did not say the session was ended: {stderr}"
    );
    let free = shell.run("lockctl who jobs/stuck").await?;
    ensure!(
        free.status.code() == Some(1) && String::from_utf8_lossy(&free.stdout).trim() == "free",
        "after the force-release lockctl who said {:?} ({})",
        String::from_utf8_lossy(&free.stdout),
        free.status
    );
    let trail = eventually(
        "the trail has the forced release and the hold's end",
        Duration::from_secs(20),
        || async {
            let events = tailer.history("jobs/stuck").await?;
            let forced = events.iter().any(|e| {
                e.kind == EventKind::ForceReleased
                    && e.token == token
                    && e.detail.contains("host-7 hung, ticket OPS-42")
                    && !e.identity.is_empty()
            });
            // The hold's end: its client closing the ended session (released), or the
            // validity running out (expired).
            let expired = events.iter().any(|e| {
                matches!(e.kind, EventKind::Expired | EventKind::Released) && e.token == token
            });
            Ok((forced && expired).then_some(events))
        },
    )
    .await;
    let trail = match trail {
        Ok(trail) => trail,
        Err(e) => anyhow::bail!("{e}: {:#?}", tailer.history("jobs/stuck").await?),
    };
    let ended = |e: &lockcell_cell::audit::AuditEvent| {
        matches!(e.kind, EventKind::Expired | EventKind::Released)
    };
    ensure!(
        trail
            .iter()
            .position(|e| e.kind == EventKind::ForceReleased)
            < trail.iter().position(ended),
        "the hold ended before the record of who forced it: {trail:?}"
    );
    shell
        .ok("lockctl audit billing/nightly --since 24h --audit https://cell-1:7431")
        .await?;
    // A token that is not the hold's changes nothing.
    let again = shell
        .run("lockcell-cell --config cell.toml force-release jobs/stuck --token \"$TOKEN\" --reason \"host-7 hung, ticket OPS-42\"")
        .await?;
    ensure!(
        !again.status.success()
            && String::from_utf8_lossy(&again.stderr).contains("has no exclusive hold with token"),
        "a second force-release of the same token was not refused: {}",
        String::from_utf8_lossy(&again.stderr)
    );

    // Restoring the backup: proxies stopped, the snapshot restored, the epoch raised.
    proxy.process.signal(Signal::SIGTERM)?;
    proxy.process.wait_exit(Duration::from_secs(60)).await?;
    tailer.stop().await?;
    let etcd = restore(etcd, &etcd_dir, &ports, &work.join("backup/cell-a.db")).await?;
    let bumped = shell
        .ok("lockcell-cell --config cell.toml bump-epoch")
        .await?;
    ensure!(bumped.starts_with("raised the epoch"), "{bumped}");

    // The shard map commands of "Adding a cell" and of a restore.
    std::fs::write(
        work.join("shardmap.toml"),
        format!("[cells.a]\nendpoints = [\"http://{endpoint}\"]\n\n[[route]]\nprefix = \"\"\ncell = \"a\"\n"),
    )?;
    shell
        .ok("lockcell-cell shardmap set shardmap.toml --etcd 10.0.1.5:2379")
        .await?;
    let shown = shell
        .ok("lockcell-cell shardmap show --etcd 10.0.1.5:2379")
        .await?;
    ensure!(shown.contains(&endpoint), "shardmap show said: {shown}");
    shell
        .ok("lockcell-cell shardmap show --toml --etcd 10.0.9.5:2379 > shardmap.toml")
        .await?;
    shell
        .ok("lockcell-cell shardmap set shardmap.toml --etcd 10.0.9.5:2379")
        .await?;
    drop(etcd);
    Ok(())
}
