//! The cell's own records: the epoch across a restore from backup.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_cell::rbac;
use lockcell_client::{Client, FencingToken, Wait};
use lockcell_tests::etcd::{self, reserve_ports};
use lockcell_tests::{bins, EtcdCluster, ProxyOptions, ProxyProcess};
use nix::sys::signal::Signal;

use crate::support::short_session;

pub use lockcell_tests::etcd::lockcell_cell;

fn etcdctl(args: &[&str]) -> anyhow::Result<()> {
    let program = bins::on_path("etcdctl").context("no etcdctl on PATH (install etcd-client)")?;
    let out = Command::new(program)
        .env("ETCDCTL_API", "3")
        .args(args)
        .output()?;
    ensure!(
        out.status.success(),
        "etcdctl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Saves a snapshot of the one-member cell at `endpoint` to `backup`.
pub fn snapshot(endpoint: &str, backup: &Path) -> anyhow::Result<()> {
    let root = format!("{}:{}", rbac::ROOT_USER, etcd::ROOT_PASSWORD);
    etcdctl(&[
        "--endpoints",
        endpoint,
        "--user",
        &root,
        "snapshot",
        "save",
        &backup.display().to_string(),
    ])
}

/// Stops the one-member cell `etcd` (started in `etcd_dir` on `ports`), replaces its
/// data by `backup` and starts it again on the same ports.
pub async fn restore(
    etcd: EtcdCluster,
    etcd_dir: &Path,
    ports: &[(u16, u16)],
    backup: &Path,
) -> anyhow::Result<EtcdCluster> {
    drop(etcd);
    let member = etcd_dir.join("etcd-a");
    std::fs::remove_dir_all(&member)?;
    let (client_port, peer_port) = ports[0];
    let peer = format!("http://127.0.0.1:{peer_port}");
    etcdctl(&[
        "snapshot",
        "restore",
        &backup.display().to_string(),
        "--name",
        "a",
        "--data-dir",
        &member.display().to_string(),
        "--initial-cluster",
        &format!("a={peer}"),
        "--initial-advertise-peer-urls",
        &peer,
        "--initial-cluster-token",
        &format!("lockcell-{client_port}"),
    ])?;
    EtcdCluster::start_on(etcd_dir, ports).await
}

/// Takes `lock` and lets it go again; the grant's token.
pub async fn grant(client: &Client, lock: &str) -> anyhow::Result<FencingToken> {
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let guard = session
        .acquire(lock, Wait::Timeout(Duration::from_secs(10)))
        .await?
        .with_context(|| format!("{lock} was not granted"))?;
    let token = guard.token();
    guard.release().await?;
    session.close().await?;
    Ok(token)
}

/// A proxy that is expected to refuse to start: its exit status must be a failure and
/// its log must say `why`.
pub async fn refuses(options: &ProxyOptions, dir: &Path, why: &str) -> anyhow::Result<()> {
    let mut proxy = ProxyProcess::spawn(options, dir)?;
    let status = proxy.process.wait_exit(Duration::from_secs(20)).await?;
    let log = proxy.process.log_tail(40);
    ensure!(
        !status.success(),
        "the proxy served a cell it should refuse:\n{log}"
    );
    ensure!(
        log.contains(why),
        "the proxy's refusal ({status}) does not say {why:?}:\n{log}"
    );
    Ok(())
}

pub async fn a_restore_from_backup_with_a_raised_epoch_keeps_tokens_rising() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ports = reserve_ports(1);
    let etcd_dir = dir.path().join("etcd");
    let etcd = EtcdCluster::start_on(&etcd_dir, &ports).await?;
    let endpoint = etcd.endpoints()[0].clone();
    let state_dir = dir.path().join("proxy-state");
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec!["--state-dir".into(), state_dir.display().to_string()];
    let mut proxy = ProxyProcess::start(&options, dir.path()).await?;
    let client = Client::connect(&proxy.url()).await?;

    let first = grant(&client, "restore/lock").await?;
    let set_up = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    ensure!(
        first.epoch <= set_up && first.epoch + 600 >= set_up,
        "a new cell's first token is {first}: its epoch is not the time it was set up"
    );
    let backup = dir.path().join("backup.db");
    snapshot(&endpoint, &backup)?;
    // Grants after the backup: the restored cell will not know them.
    let mut before = first;
    for _ in 0..5 {
        let token = grant(&client, "restore/lock").await?;
        ensure!(
            token > before,
            "tokens went backwards before any restore: {before} then {token}"
        );
        before = token;
    }

    // The restore: proxy stopped, etcd's data replaced by the backup.
    proxy.signal(Signal::SIGTERM)?;
    let stopped = proxy.process.wait_exit(Duration::from_secs(30)).await?;
    ensure!(
        stopped.success(),
        "the proxy did not stop cleanly: {stopped}"
    );
    drop(client);
    let etcd = restore(etcd, &etcd_dir, &ports, &backup).await?;
    let restored_at = etcd.revision().await?;
    ensure!(
        restored_at < before.revision,
        "the restored store is at revision {restored_at}, not below the last token {before}: the test restored nothing"
    );

    // Not raised yet: the proxy that remembers the cell refuses it.
    refuses(&options, dir.path(), "bump-epoch").await?;

    let raised = lockcell_cell(&["bump-epoch", "--etcd", &endpoint])?;
    ensure!(
        raised.contains(&format!("from {} to", first.epoch)),
        "bump-epoch said: {raised}"
    );
    let mut proxy = ProxyProcess::start(&options, dir.path()).await?;
    let client = Client::connect(&proxy.url()).await?;
    let after = grant(&client, "restore/lock").await?;
    ensure!(
        after > before && after.epoch > before.epoch,
        "after the restore and bump the token is {after}, not above {before} given before it"
    );

    // A bump under a running proxy: it sees the record change (or its next grant
    // fails), grants nothing more, drains and exits; started again it mints tokens of
    // the new epoch.
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    lockcell_cell(&["bump-epoch", "--force", "--etcd", &endpoint])?;
    let refused = session.acquire("restore/other", Wait::Try).await;
    let message = match refused {
        Ok(granted) => anyhow::bail!(
            "a proxy granted after the epoch was raised under it: {:?}",
            granted.map(|g| g.token())
        ),
        Err(e) => e.to_string(),
    };
    ensure!(
        message.contains("epoch record"),
        "the refusal does not name the epoch: {message}"
    );
    let status = proxy.process.wait_exit(Duration::from_secs(30)).await?;
    ensure!(
        !status.success(),
        "a proxy whose cell changed exited as if all was well"
    );
    drop(session);
    drop(client);
    let proxy = ProxyProcess::start(&options, dir.path()).await?;
    let client = Client::connect(&proxy.url()).await?;
    let third = grant(&client, "restore/lock").await?;
    ensure!(
        third.epoch > after.epoch && third > after,
        "after a second bump the token is {third}"
    );

    // Another cell (new data, new cluster id) behind the same address is refused too.
    drop(client);
    drop(proxy);
    drop(etcd);
    std::fs::remove_dir_all(&etcd_dir)?;
    let _fresh = EtcdCluster::start_on(&etcd_dir, &ports).await?;
    refuses(&options, dir.path(), "cluster id").await?;
    Ok(())
}
