//! Faults: a proxy killed, etcd gone, a client's session past its deadline.

use std::process::Stdio;

use std::time::Duration;
use tokio::io::AsyncBufReadExt;

use anyhow::{ensure, Context};
use lockcell_client::{Client, Error, LockGuard, Session, SessionState, Wait};
use lockcell_proto::v1::{OpenRequest, SessionState as WireState};
use lockcell_tests::etcd::reserve_ports;
use lockcell_tests::{bins, eventually, EtcdCluster, ProxyOptions, ProxyProcess};
use nix::sys::signal::Signal;

use crate::locks::until_not_valid;
use crate::support::{cell, lease_count, raw, renew_once, short_session};

/// A session on proxy 0 holding `lock`, and a session on proxy 1 to wait for it.
async fn holder_and_waiter(
    proxies: &[ProxyProcess],
    lock: &str,
) -> anyhow::Result<(Session, LockGuard, Session)> {
    let a = Client::connect(&proxies[0].url()).await?;
    let b = Client::connect(&proxies[1].url()).await?;
    let holder = a
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let held = holder
        .acquire(lock, Wait::Try)
        .await?
        .context("free lock not granted")?;
    let waiter = b
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    Ok((holder, held, waiter))
}

pub async fn killed_proxy_locks_pass_on_after_lease_ttl() -> anyhow::Result<()> {
    let (etcd, mut proxies) = cell(&["a", "b"]).await?;
    let (holder, held, waiter) = holder_and_waiter(&proxies, "deploy/db").await?;
    ensure!(
        waiter.acquire("deploy/db", Wait::Try).await?.is_none(),
        "a held lock was granted twice"
    );
    ensure!(lease_count(&etcd).await? == 8);

    proxies[0].signal(Signal::SIGKILL)?;
    let taken = waiter
        .acquire("deploy/db", Wait::Timeout(Duration::from_secs(30)))
        .await?
        .context("the lock of a killed proxy's client never passed on")?;
    // The old holder must have stopped acting before the new grant could exist.
    ensure!(
        holder.state() != SessionState::Valid,
        "the killed proxy's client still believes it holds the lock after it passed on"
    );
    ensure!(taken.token() > held.token());
    // etcd dropped the dead proxy's K leases, and only those.
    eventually(
        "the dead proxy's leases are gone",
        Duration::from_secs(10),
        || async { Ok((lease_count(&etcd).await? == 4).then_some(())) },
    )
    .await?;
    proxies[0].process.kill();
    Ok(())
}

pub async fn etcd_away_acquire_unavailable_sessions_end_at_lower_bound() -> anyhow::Result<()> {
    let (mut etcd, proxies) = cell(&["a"]).await?;
    let proxy = &proxies[0];
    let client = Client::connect(&proxy.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(30)))
        .await?;
    let (mut raw_sessions, _) = raw(proxy).await?;
    let raw_session = raw_sessions
        .open(OpenRequest {
            ttl_ms: 30_000,
            identity: "raw".into(),
        })
        .await?
        .into_inner();

    etcd.members[0].process.kill();
    let started = tokio::time::Instant::now();
    match session.acquire("while-etcd-is-away", Wait::Try).await {
        Err(Error::Unavailable(message)) => ensure!(
            message.contains("etcd"),
            "Unavailable without saying why: {message}"
        ),
        other => anyhow::bail!("acquire with etcd gone gave {other:?}, not Unavailable"),
    }
    ensure!(
        started.elapsed() < Duration::from_secs(10),
        "acquire took {:?} to fail",
        started.elapsed()
    );

    // Sessions live on only until the proxy lease's lower bound (3 s lease TTL here),
    // although their own TTL is 30 s.
    until_not_valid(&session, Duration::from_secs(10)).await?;
    let reason = eventually(
        "the proxy expires the session at its lease's lower bound",
        Duration::from_secs(10),
        || {
            let mut raw_sessions = raw_sessions.clone();
            let id = raw_session.session_id.clone();
            let secret = raw_session.session_secret.clone();
            async move {
                let reply = renew_once(&mut raw_sessions, &id, &secret).await?;
                Ok((reply.state == WireState::Expired as i32).then_some(reply.reason))
            }
        },
    )
    .await?;
    ensure!(
        reason.contains("lease"),
        "expiry reason does not name the lease: {reason}"
    );
    Ok(())
}

pub async fn lockctl_stops_its_command_when_the_session_passes_its_deadline() -> anyhow::Result<()>
{
    let (_etcd, proxies) = cell(&["a"]).await?;
    let lockctl = bins::workspace_bin("lockctl")?;
    let mut child = tokio::process::Command::new(lockctl)
        .args([
            "--proxy",
            &proxies[0].addr,
            "--ttl",
            "2s",
            "lock",
            "batch/nightly",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "echo holding $LOCKCELL_LOCK $LOCKCELL_TOKEN; exec sleep 120",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .context("lockctl's command did not start within 20 s")??
        .context("lockctl's command printed nothing")?;
    let token = first.strip_prefix("holding batch/nightly ");
    ensure!(
        token.is_some_and(|t| t.parse::<lockcell_client::FencingToken>().is_ok()),
        "command saw {first:?}, not the lock and its token"
    );

    // The proxy dies: lockctl's session reaches its deadline and it must stop the command.
    proxies[0].signal(Signal::SIGKILL)?;
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .context("lockctl did not stop its command after the session's deadline")??;
    ensure!(
        status.code() == Some(90),
        "lockctl exited with {status:?}, not 90 (it had to stop its command)"
    );
    Ok(())
}

/// `lockctl --proxy PROXY --ttl TTL --stop-grace GRACE lock NAME -- sh -c SCRIPT`,
/// started with `dir` in `$DIR`, its output piped.
pub(crate) fn lockctl_lock(
    proxy: &str,
    (ttl, grace): (&str, &str),
    name: &str,
    script: &str,
    dir: &std::path::Path,
) -> anyhow::Result<tokio::process::Child> {
    Ok(lockctl_command(proxy, (ttl, grace), name, script, dir)?.spawn()?)
}

/// `lockctl lock NAME -- sh -c SCRIPT` through `proxy` (several, comma-separated), with
/// `$DIR` set for SCRIPT, its output piped, killed when dropped.
pub(crate) fn lockctl_command(
    proxy: &str,
    (ttl, grace): (&str, &str),
    name: &str,
    script: &str,
    dir: &std::path::Path,
) -> anyhow::Result<tokio::process::Command> {
    let mut command = tokio::process::Command::new(bins::workspace_bin("lockctl")?);
    command
        .args(["--proxy", proxy, "--ttl", ttl, "--stop-grace", grace])
        .args(["lock", name, "--", "sh", "-c", script])
        .env("DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    Ok(command)
}

/// Waits for `child`'s first line on stdout to be `want`.
pub(crate) async fn first_line(
    child: &mut tokio::process::Child,
    want: &str,
) -> anyhow::Result<()> {
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .context("lockctl's command did not start within 20 s")??;
    ensure!(
        first.as_deref() == Some(want),
        "command printed {first:?}, not {want:?}"
    );
    Ok(())
}

/// Waits up to 30 s for `child` to exit; its status and stderr.
pub(crate) async fn exited(child: tokio::process::Child) -> anyhow::Result<(Option<i32>, String)> {
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .context("lockctl did not exit within 30 s of its session's loss")??;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The pids listed in `file` that are still running (zombies count as gone).
pub(crate) fn running(file: &std::path::Path) -> anyhow::Result<Vec<i32>> {
    let text = std::fs::read_to_string(file)?;
    let mut alive = Vec::new();
    for pid in text.split_whitespace() {
        let pid: i32 = pid.parse()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the command's name in parentheses; Z is a zombie.
        let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
        if matches!(state, Some(Some(s)) if s != 'Z') {
            alive.push(pid);
        }
    }
    Ok(alive)
}

/// A cell of proxies in `zones`, and `lockctl lock NAME -- sh -c SCRIPT` holding NAME
/// through a link to the first proxy, cut once SCRIPT has printed "started".
struct CutOff {
    _etcd: EtcdCluster,
    proxies: Vec<ProxyProcess>,
    dir: tempfile::TempDir,
    _link: lockcell_tests::Relay,
    lockctl: tokio::process::Child,
}

async fn cut_off(
    zones: &[&str],
    (ttl, grace): (&str, &str),
    name: &str,
    script: &str,
) -> anyhow::Result<CutOff> {
    let (etcd, proxies) = cell(zones).await?;
    let dir = tempfile::tempdir()?;
    let link = lockcell_tests::Relay::start(&proxies[0].addr).await?;
    let mut lockctl = lockctl_lock(&link.addr, (ttl, grace), name, script, dir.path())?;
    first_line(&mut lockctl, "started").await?;
    link.cut(true);
    Ok(CutOff {
        _etcd: etcd,
        proxies,
        dir,
        _link: link,
        lockctl,
    })
}

/// A command that ignores SIGTERM (it and its child) holds a lock through lockctl, whose
/// link to its proxy is then cut. lockctl must kill the whole process group by the
/// session's deadline, so that when a second lockctl, on another proxy, is granted the
/// lock, nothing of the first command is running.
pub async fn lockctl_kills_a_command_that_ignores_sigterm_before_the_lock_passes(
) -> anyhow::Result<()> {
    let first = cut_off(
        &["a", "b"],
        ("3s", "1s"),
        "jobs/stubborn",
        r#"trap "" TERM; sleep 1000 & echo $! > "$DIR/pids"; echo $$ >> "$DIR/pids"; echo started; wait"#,
    )
    .await?;
    let second = lockctl_lock(
        &first.proxies[1].addr,
        ("3s", "1s"),
        "jobs/stubborn",
        r#"for p in $(cat "$DIR/pids"); do s=$(cut -d' ' -f3 "/proc/$p/stat" 2>/dev/null); if [ -n "$s" ] && [ "$s" != Z ]; then echo "running $p"; fi; done; echo granted"#,
        first.dir.path(),
    )?;
    let out = tokio::time::timeout(Duration::from_secs(40), second.wait_with_output())
        .await
        .context("the second lockctl was not granted the lock within 40 s")??;
    let said = String::from_utf8_lossy(&out.stdout);
    ensure!(
        said.contains("granted"),
        "the second lockctl's command did not run: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        !said.contains("running"),
        "the lock passed while the first command's process group still ran: {said}"
    );
    let (status, stderr) = exited(first.lockctl).await?;
    ensure!(
        status == Some(90) && stderr.contains("SIGKILL"),
        "the first lockctl exited {status:?}: {stderr}"
    );
    ensure!(running(&first.dir.path().join("pids"))?.is_empty());
    Ok(())
}

/// `sh -c 'step & step'`: lockctl stops every step when it stops the command, not only
/// the shell; also one that left the command's process group (`timeout` takes a group
/// of its own) and ignores SIGTERM.
pub async fn lockctl_stops_every_process_of_a_compound_command() -> anyhow::Result<()> {
    let run = cut_off(
        &["a"],
        ("3s", "1s"),
        "jobs/compound",
        // A background job, and (through `timeout`, which takes a process group of its
        // own) a shell that ignores SIGTERM with a child of its own.
        r#"sleep 1000 & echo $! > "$DIR/pids"
timeout 1000 sh -c 'trap "" TERM; sleep 1000 & echo $! >> "$DIR/pids"; echo $$ >> "$DIR/pids"; wait' &
echo $! >> "$DIR/pids"; echo $$ >> "$DIR/pids"
while [ "$(wc -l < "$DIR/pids")" -lt 5 ]; do sleep 0.05; done
echo started; sleep 1000"#,
    )
    .await?;
    let (status, stderr) = exited(run.lockctl).await?;
    ensure!(status == Some(90), "lockctl exited {status:?}: {stderr}");
    let left = running(&run.dir.path().join("pids"))?;
    ensure!(
        left.is_empty(),
        "processes of the stopped command still run: {left:?}\n{stderr}"
    );
    Ok(())
}

/// A command that winds down on SIGTERM within the stop grace gets SIGTERM before the
/// session's deadline (as `LOCKCELL_DEADLINE_FILE` says it) and ends before it; lockctl
/// sends no SIGKILL and says how CMD ended.
pub async fn lockctl_lets_a_command_wind_down_within_the_grace_before_the_deadline(
) -> anyhow::Result<()> {
    let run = cut_off(
        &["a"],
        ("6s", "2s"),
        "jobs/graceful",
        r#"trap 'cp "$LOCKCELL_DEADLINE_FILE" "$DIR/deadline"; sleep 0.3; date +%s%3N > "$DIR/stopped"; exit 0' TERM; [ -n "$LOCKCELL_DEADLINE" ] && echo started; while :; do sleep 0.1; done"#,
    )
    .await?;
    let dir = &run.dir;
    let (status, stderr) = exited(run.lockctl).await?;
    ensure!(status == Some(90), "lockctl exited {status:?}: {stderr}");
    ensure!(
        stderr.contains("CMD ended after SIGTERM, before the session's deadline")
            && !stderr.contains("(SIGKILL)"),
        "lockctl did not let the command end within the grace: {stderr}"
    );
    let read = |name: &str| -> anyhow::Result<u64> {
        let text = std::fs::read_to_string(dir.path().join(name))
            .with_context(|| format!("the command wrote no {name}"))?;
        Ok(text.trim().parse()?)
    };
    let (deadline, stopped) = (read("deadline")?, read("stopped")?);
    ensure!(
        stopped < deadline,
        "the command ended at {stopped}, after the session's deadline {deadline} (ms)"
    );
    ensure!(
        deadline - stopped <= 2_000,
        "SIGTERM came {} ms before the deadline, more than the grace",
        deadline - stopped
    );
    println!(
        "the command ended {} ms before the session's deadline",
        deadline - stopped
    );
    Ok(())
}

pub async fn proxy_started_before_etcd_says_so_and_serves_once_it_is_up() -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("lockcell-late-etcd-")
        .tempdir()?;
    let ports = reserve_ports(1);
    let options = ProxyOptions::new("a", vec![format!("127.0.0.1:{}", ports[0].0)]);
    let mut proxy = ProxyProcess::spawn(&options, dir.path())?;
    proxy
        .wait_for_log(
            "cannot start on the cell yet; retrying",
            Duration::from_secs(20),
        )
        .await?;
    let _etcd = EtcdCluster::start_on(dir.path(), &ports).await?;
    proxy.wait_ready(Duration::from_secs(30)).await?;
    let client = Client::connect(&proxy.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    ensure!(
        session.acquire("late/start", Wait::Try).await?.is_some(),
        "no grant once etcd was up"
    );
    Ok(())
}

pub async fn sigterm_waits_out_holders_validity_then_revokes_its_leases() -> anyhow::Result<()> {
    let (etcd, mut proxies) = cell(&["a", "b"]).await?;
    let (holder, held, waiter) = holder_and_waiter(&proxies, "rolling/restart").await?;

    proxies[0].signal(Signal::SIGTERM)?;
    let taken = waiter
        .acquire("rolling/restart", Wait::Timeout(Duration::from_secs(30)))
        .await?
        .context("the lock of a stopped proxy's client never passed on")?;
    ensure!(
        holder.state() != SessionState::Valid,
        "the stopped proxy revoked its leases while its client could still act as holder"
    );
    ensure!(taken.token() > held.token());
    let status = proxies[0]
        .process
        .wait_exit(Duration::from_secs(30))
        .await?;
    ensure!(
        status.success(),
        "the proxy exited with {status:?} on SIGTERM"
    );
    let log = std::fs::read_to_string(proxies[0].log_path())?;
    ensure!(
        log.contains("revoked proxy lease"),
        "the proxy did not revoke its leases:\n{log}"
    );
    ensure!(
        lease_count(&etcd).await? == 4,
        "the stopped proxy's leases are still in etcd"
    );
    Ok(())
}
