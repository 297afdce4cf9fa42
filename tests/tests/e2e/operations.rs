//! Operating a cell: `lockctl lock` stops its command when a hold is lost for any
//! reason, and `bump-epoch` refuses a cell whose proxies run.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_cell::rbac;
use lockcell_client::{Client, ClientOptions, SessionOptions, Wait};
use lockcell_tests::certs::token_sha256;
use lockcell_tests::etcd::{reserve_ports, ADMIN_PASSWORD};
use lockcell_tests::{bins, eventually, EtcdCluster, ProxyOptions, ProxyProcess};
use nix::sys::signal::Signal;

use crate::faults::{exited, first_line, lockctl_command, lockctl_lock, running};
use crate::support::short_session;

const APP_TOKEN: &str = "app-token-0123456789abcdef0123456789";
const OPS_TOKEN: &str = "ops-token-0123456789abcdef0123456789";

/// A grants file: `app` may lock under `app_locks`, `ops` under `jobs/`.
fn grants(app_locks: &str) -> String {
    format!(
        r#"
[[grant]]
identity = "app"
lock = ["{app_locks}"]

[[grant]]
identity = "ops"
lock = ["jobs/"]

[[token]]
identity = "app"
sha256 = "{}"

[[token]]
identity = "ops"
sha256 = "{}"
"#,
        token_sha256(APP_TOKEN),
        token_sha256(OPS_TOKEN)
    )
}

/// The command lockctl runs: its pid in `$DIR/pids`, "started", then acting until
/// stopped.
const ACTING: &str = r#"echo $$ > "$DIR/pids"; echo started; while :; do sleep 0.2; done"#;

/// `lockcell-cell ARGS` as `lockcell-admin`, without blocking the test's runtime: its
/// exit status, stdout and stderr.
async fn lockcell_cell(args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let out = tokio::process::Command::new(bins::workspace_bin("lockcell-cell")?)
        .args(args)
        .env("LOCKCELL_ETCD_USER", rbac::ADMIN_USER)
        .env("LOCKCELL_ETCD_PASSWORD", ADMIN_PASSWORD)
        .output()
        .await?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The grant of the identity running `lockctl lock` is narrowed and its proxy drained:
/// the session resumes on the other proxy, which reports the lock lost (no grant). The
/// session itself stays valid, so nothing but the lost hold can stop the command, and
/// it must stop before the lock can go to `ops`, waiting on the other proxy.
pub async fn lockctl_stops_its_command_when_a_narrowed_grant_loses_the_hold() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("grants.toml");
    std::fs::write(&file, grants("jobs/"))?;
    let mut proxies = Vec::new();
    for zone in ["a", "b"] {
        let mut options = ProxyOptions::new(zone, etcd.endpoints());
        options.extra_args = vec![
            "--grants".into(),
            file.display().to_string(),
            "--grants-without-tls".into(),
        ];
        proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    }
    let both = format!("{},{}", proxies[0].addr, proxies[1].addr);
    let mut lockctl = lockctl_command(&both, ("10s", "2s"), "jobs/x", ACTING, dir.path())?;
    let mut lockctl = lockctl.env("LOCKCELL_AUTH_TOKEN", APP_TOKEN).spawn()?;
    first_line(&mut lockctl, "started").await?;

    // ops waits for the lock on the other proxy.
    let ops = Client::connect_with(ClientOptions::new([proxies[1].addr.clone()]).token(OPS_TOKEN))
        .await?;
    let ops = ops
        .open_session(SessionOptions {
            ttl: Duration::from_secs(10),
            identity: "ops".into(),
        })
        .await?;
    let pids = dir.path().join("pids");
    let waiting = tokio::spawn(async move {
        let granted = ops
            .acquire("jobs/x", Wait::Timeout(Duration::from_secs(60)))
            .await;
        // What of the first command runs at the moment the lock is granted.
        let still_running = running(&pids);
        (granted, still_running, ops)
    });

    // app loses jobs/ on both proxies, then its proxy drains.
    std::fs::write(&file, grants("app/"))?;
    for proxy in &proxies {
        proxy.signal(Signal::SIGHUP)?;
    }
    for proxy in &proxies {
        eventually(
            "the narrowed grants are in force",
            Duration::from_secs(10),
            || async {
                Ok((proxy.metric("lockcell_grants_reloads_total").await? >= 1.0).then_some(()))
            },
        )
        .await?;
    }
    proxies[0].signal(Signal::SIGTERM)?;

    let (status, stderr) = exited(lockctl).await?;
    ensure!(
        status == Some(90) && stderr.contains("lost") && stderr.contains("no grant"),
        "lockctl exited {status:?} after its hold was lost: {stderr}"
    );
    ensure!(
        running(&dir.path().join("pids"))?.is_empty(),
        "lockctl exited and left its command running"
    );
    let (granted, still_running, _ops) = tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .context("ops was not granted jobs/x within 60 s")??;
    let _guard = granted?.context("ops was not granted jobs/x")?;
    ensure!(
        still_running?.is_empty(),
        "ops was granted jobs/x while the first command still ran"
    );
    Ok(())
}

/// `bump-epoch --force` under a running proxy: the proxy drains, the session resumes
/// on a proxy started in the new epoch, which reports the lock lost. lockctl stops its
/// command at once, and a second `lockctl lock` granted the lock finds nothing of it.
pub async fn lockctl_stops_its_command_when_an_epoch_bump_loses_the_hold() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let a = ProxyProcess::start(&ProxyOptions::new("a", etcd.endpoints()), &etcd.dir).await?;
    let later = format!("127.0.0.1:{}", reserve_ports(1)[0].0);
    let both = format!("{},{later}", a.addr);
    let mut lockctl = lockctl_lock(&both, ("10s", "2s"), "jobs/y", ACTING, dir.path())?;
    first_line(&mut lockctl, "started").await?;

    let endpoint = etcd.endpoints()[0].clone();
    let (status, _, stderr) =
        lockcell_cell(&["bump-epoch", "--force", "--etcd", &endpoint]).await?;
    ensure!(status == Some(0), "bump-epoch --force: {stderr}");
    let mut options = ProxyOptions::new("c", etcd.endpoints());
    options.listen = Some(later.clone());
    let _c = ProxyProcess::start(&options, &etcd.dir).await?;

    let (status, stderr) = exited(lockctl).await?;
    ensure!(
        status == Some(90) && stderr.contains("lost") && stderr.contains("epoch"),
        "lockctl exited {status:?} after its hold was lost to an epoch bump: {stderr}"
    );
    let second = lockctl_lock(
        &later,
        ("10s", "2s"),
        "jobs/y",
        r#"for p in $(cat "$DIR/pids"); do s=$(cut -d' ' -f3 "/proc/$p/stat" 2>/dev/null); if [ -n "$s" ] && [ "$s" != Z ]; then echo "running $p"; fi; done; echo granted"#,
        dir.path(),
    )?;
    let out = tokio::time::timeout(Duration::from_secs(40), second.wait_with_output())
        .await
        .context("the second lockctl was not granted jobs/y within 40 s")??;
    let said = String::from_utf8_lossy(&out.stdout);
    ensure!(
        said.contains("granted") && !said.contains("running"),
        "the second holder's command said: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// `bump-epoch` on a cell whose proxies run is refused, naming them, and changes
/// nothing; a presence record left by a killed proxy holds it up only until that
/// proxy's lease expires.
pub async fn bump_epoch_refuses_a_cell_with_running_proxies() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let endpoint = etcd.endpoints()[0].clone();
    let mut a = ProxyProcess::start(&ProxyOptions::new("a", etcd.endpoints()), &etcd.dir).await?;
    let b = ProxyProcess::start(&ProxyOptions::new("b", etcd.endpoints()), &etcd.dir).await?;
    let client = Client::connect(&a.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let held = session
        .acquire("ops/held", Wait::Try)
        .await?
        .context("a free lock was not granted")?;
    let (_, before, _) = lockcell_cell(&["epoch", "--etcd", &endpoint]).await?;

    let (status, _, stderr) = lockcell_cell(&["bump-epoch", "--etcd", &endpoint]).await?;
    ensure!(
        status == Some(1)
            && stderr.contains("zone a")
            && stderr.contains("zone b")
            && stderr.contains(&a.addr)
            && stderr.contains("--force"),
        "bump-epoch on a live cell exited {status:?}: {stderr}"
    );
    let (_, after, _) = lockcell_cell(&["epoch", "--etcd", &endpoint]).await?;
    ensure!(
        after == before,
        "a refused bump-epoch changed the epoch: {before} then {after}"
    );
    ensure!(held.is_valid(), "the lock was lost to a refused bump-epoch");
    let _other = session
        .acquire("ops/other", Wait::Try)
        .await?
        .context("the proxy stopped granting after a refused bump-epoch")?;

    // b killed (its record stays until its lease expires), a stopped (it drains and
    // revokes its leases): the bump waits for b's lease, then goes ahead.
    drop(held);
    drop(session);
    drop(client);
    a.signal(Signal::SIGTERM)?;
    a.process.wait_exit(Duration::from_secs(30)).await?;
    b.signal(Signal::SIGKILL)?;
    let (status, stdout, stderr) = lockcell_cell(&["bump-epoch", "--etcd", &endpoint]).await?;
    ensure!(
        status == Some(0)
            && stdout.contains("raised the epoch")
            && stderr.contains("no proxy runs"),
        "bump-epoch once the proxies were gone exited {status:?}: {stdout}{stderr}"
    );
    Ok(())
}
