//! The audit tailer (`lockcell-cell audit`) as a real process.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lockcell_cell::audit::AuditEvent;

use crate::ports::free_port;
use crate::process::Managed;
use crate::proxy::http_get;
use crate::{bins, eventually};

/// A running `lockcell-cell audit`; dropping it kills the process.
pub struct AuditProcess {
    pub process: Managed,
    /// `127.0.0.1:PORT` of its HTTP server (/healthz, /metrics, /v1/audit).
    pub addr: String,
    pub data_dir: PathBuf,
}

impl AuditProcess {
    /// Starts `lockcell-cell audit ACTION` on `etcd` with `data_dir` and more `args`
    /// (`--store`, `--archive`, ...), and waits until it answers. It logs in as the test
    /// clusters' `lockcell-tailer`, which reads every key and writes none.
    pub async fn start(
        action: &str,
        etcd: &[String],
        data_dir: &Path,
        args: &[String],
        log: &Path,
    ) -> anyhow::Result<Self> {
        Self::start_as(
            action,
            etcd,
            (data_dir, log),
            args,
            crate::etcd::TAILER_PASSWORD,
        )
        .await
    }

    /// [`AuditProcess::start`] with `lockcell-tailer`'s `password` (the dev cell makes
    /// its own).
    pub async fn start_as(
        action: &str,
        etcd: &[String],
        (data_dir, log): (&Path, &Path),
        args: &[String],
        password: &str,
    ) -> anyhow::Result<Self> {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(bins::workspace_bin("lockcell-cell")?);
        cmd.arg("audit")
            .arg(action)
            .arg("--etcd")
            .arg(etcd.join(","))
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--listen")
            .arg(&addr)
            .arg("--etcd-user")
            .arg(lockcell_cell::rbac::TAILER_USER)
            .args(args)
            .env("LOCKCELL_ETCD_PASSWORD", password)
            .env("RUST_LOG", "info");
        let process = Managed::spawn("audit tailer", cmd, log)?;
        let tailer = AuditProcess {
            process,
            addr,
            data_dir: data_dir.to_path_buf(),
        };
        // Over TLS (the dev cell's) the tailer says it is ready in its log; over plain
        // HTTP it answers.
        let tls = args.iter().any(|a| a == "--tls-cert");
        let log = tailer.process.log.clone();
        eventually(
            "the audit tailer answers",
            Duration::from_secs(30),
            || async {
                if tls {
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    return Ok(text.contains("lockcell-cell audit ready").then_some(()));
                }
                Ok(http_get(&tailer.addr, "/healthz").await.ok().map(|_| ()))
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", tailer.process.log_tail(30)))?;
        Ok(tailer)
    }

    /// The audit history of one lock, election or key, values and leases included.
    pub async fn history(&self, name: &str) -> anyhow::Result<Vec<AuditEvent>> {
        let body = http_get(
            &self.addr,
            &format!("/v1/audit?name={name}&limit=10000&values=true"),
        )
        .await?;
        Ok(serde_json::from_str(&body)?)
    }

    /// Stops it with SIGTERM (it writes what it has and flushes its archive) and checks
    /// that it exited cleanly.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.process.signal(nix::sys::signal::Signal::SIGTERM)?;
        let status = self.process.wait_exit(Duration::from_secs(30)).await?;
        anyhow::ensure!(
            status.success(),
            "the audit tailer exited with {status}:\n{}",
            self.process.log_tail(30)
        );
        Ok(())
    }
}
