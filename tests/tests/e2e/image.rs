//! The container image (Containerfile, `deploy/image/image.sh`), built from this
//! build's binaries: its proxy serves a real cell from inside a container, its lockctl
//! takes a lock through that proxy, it runs as the manifests' user, and SIGTERM drains
//! the proxy and ends it with status 0 (what Kubernetes sends a pod that goes).

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_tests::image::{self, podman};
use lockcell_tests::ports::free_port;
use lockcell_tests::proxy::http_get;
use lockcell_tests::{eventually, EtcdCluster};

/// A container of the test's, removed with it.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "--force", "--time", "0", &self.0]);
    }
}

/// The output of a podman call that must succeed.
fn ok(args: &[&str]) -> anyhow::Result<String> {
    let out = podman(args)?;
    ensure!(
        out.status.success(),
        "podman {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

pub async fn the_images_proxy_serves_a_lock_and_drains_on_sigterm() -> anyhow::Result<()> {
    let flags = image::run_flags().map_err(anyhow::Error::msg)?;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let tag = image::build()?;
    let etcd = EtcdCluster::start(1).await?;
    let (port, admin) = (free_port(), free_port());
    let name = format!("lockcell-e2e-proxy-{port}");
    let (listen, admin_listen) = (format!("127.0.0.1:{port}"), format!("127.0.0.1:{admin}"));
    let password = format!(
        "LOCKCELL_ETCD_PASSWORD={}",
        lockcell_tests::etcd::PROXY_PASSWORD
    );
    let mut run = vec!["run", "--detach", "--name", &name, "--network", "host"];
    run.extend(&flags);
    let etcd_endpoints = etcd.endpoints().join(",");
    run.extend([
        "--env",
        &password,
        tag,
        "lockcell-proxy",
        "--listen",
        &listen,
        "--admin-listen",
        &admin_listen,
        "--etcd",
        &etcd_endpoints,
        "--etcd-user",
        lockcell_cell::rbac::PROXY_USER,
        "--zone",
        "a",
        "--lease-ttl",
        "3s",
        "--drain-timeout",
        "2s",
        "--state-dir",
        "/var/lib/lockcell-proxy",
    ]);
    ok(&run)?;
    let container = Container(name);
    eventually(
        "the image's proxy answers /readyz",
        Duration::from_secs(60),
        || {
            let admin = admin_listen.clone();
            async move { Ok(http_get(&admin, "/readyz").await.ok().map(|_| ())) }
        },
    )
    .await
    .with_context(|| format!("its log:\n{}", logs(&container.0)))?;

    // It runs as the manifests' user, not as root.
    let uid = ok(&["exec", &container.0, "id", "-u"])?;
    ensure!(uid == "10001", "the proxy runs as uid {uid}");

    // lockctl from the same image takes a lock through it and hands CMD the token.
    let proxy = format!("--proxy={listen}");
    let mut lock = vec!["run", "--rm", "--network", "host"];
    lock.extend(&flags);
    lock.extend([
        tag,
        "lockctl",
        &proxy,
        "lock",
        "image/test",
        "--timeout",
        "20s",
        "--",
        "sh",
        "-c",
        "echo \"token $LOCKCELL_TOKEN\"",
    ]);
    let said = ok(&lock)?;
    let token = said
        .lines()
        .find_map(|l| l.strip_prefix("token "))
        .with_context(|| format!("lockctl printed no token: {said}"))?;
    ensure!(
        token.split_once(':').is_some_and(|(e, r)| {
            e.parse::<u64>().is_ok() && r.parse::<u64>().is_ok_and(|r| r > 0)
        }),
        "lockctl's command got token {token:?}"
    );

    // SIGTERM, as Kubernetes sends: the proxy drains and exits 0.
    ok(&["kill", "--signal", "TERM", &container.0])?;
    let status = ok(&["wait", &container.0])?;
    let log = logs(&container.0);
    ensure!(
        status == "0",
        "the proxy exited {status} on SIGTERM; its log:\n{log}"
    );
    for line in [
        "SIGTERM: shutting down",
        "drained",
        "lockcell-proxy stopped",
    ] {
        ensure!(log.contains(line), "the proxy's log lacks {line:?}:\n{log}");
    }
    Ok(())
}

/// A container's log (stdout and stderr).
fn logs(name: &str) -> String {
    podman(&["logs", name])
        .map(|out| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
        .unwrap_or_else(|e| e.to_string())
}
