//! A private ClickHouse server on loopback for the audit store tests: its own config
//! and data folder, free ports, killed when its handle drops. Never the system service.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::bins;
use crate::ports::free_port;
use crate::process::Managed;

/// How long a new server may take to answer `/ping`.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Where Debian's `clickhouse-server` package puts the server, which is not on a
/// non-root PATH.
const DEBIAN_SERVER: &str = "/usr/sbin/clickhouse-server";

/// The server program and the arguments before its own: `clickhouse-server`, or the
/// single `clickhouse` binary of newer releases as `clickhouse server`.
fn program() -> Option<(PathBuf, Vec<&'static str>)> {
    if let Some(server) = bins::on_path("clickhouse-server") {
        return Some((server, vec![]));
    }
    if Path::new(DEBIAN_SERVER).is_file() {
        return Some((PathBuf::from(DEBIAN_SERVER), vec![]));
    }
    bins::on_path("clickhouse").map(|one| (one, vec!["server"]))
}

/// True when a ClickHouse server binary is installed; the ClickHouse tests skip
/// without one (`make setup` installs Debian's `clickhouse-server`).
pub fn available() -> bool {
    program().is_some()
}

/// A running ClickHouse server; dropping it kills it.
pub struct ClickHouse {
    /// `127.0.0.1:PORT` of the HTTP interface.
    pub http_addr: String,
    pub process: Managed,
}

impl ClickHouse {
    /// Starts a server with its config, data and log under `dir`, and waits until it
    /// answers `/ping`.
    pub async fn start(dir: &Path) -> anyhow::Result<ClickHouse> {
        let (program, leading) =
            program().context("no clickhouse-server (install the clickhouse-server package)")?;
        let data = dir.join("clickhouse-data");
        std::fs::create_dir_all(&data)?;
        let http_port = free_port();
        let config = dir.join("clickhouse-config.xml");
        std::fs::write(&config, config_xml(&data, http_port, free_port()))
            .with_context(|| format!("writing {}", config.display()))?;
        let mut cmd = Command::new(&program);
        cmd.args(leading)
            .arg(format!("--config-file={}", config.display()))
            .current_dir(dir);
        let log = dir.join("clickhouse.log");
        let mut server = ClickHouse {
            http_addr: format!("127.0.0.1:{http_port}"),
            process: Managed::spawn("clickhouse-server", cmd, &log)?,
        };
        server.wait_ready().await?;
        Ok(server)
    }

    /// The HTTP interface's URL, e.g. `http://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.http_addr)
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            if !self.process.is_running() {
                bail!("clickhouse-server exited:\n{}", self.process.log_tail(30));
            }
            let ping = tokio::time::timeout(
                Duration::from_secs(2),
                crate::proxy::http_get(&self.http_addr, "/ping"),
            )
            .await;
            if let Ok(Ok(body)) = ping {
                if body.trim() == "Ok." {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "clickhouse-server did not answer /ping on {} within {START_TIMEOUT:?}\n{}",
                    self.http_addr,
                    self.process.log_tail(30)
                );
            }
            tokio::time::sleep(crate::wait::POLL).await;
        }
    }
}

/// A minimal server config: loopback only, UTC, the `default` user without password,
/// small caches, logs to the console (the process log). Works from 18.16 on.
fn config_xml(data: &Path, http_port: u16, tcp_port: u16) -> String {
    let data = data.display();
    format!(
        r#"<?xml version="1.0"?>
<yandex>
    <logger>
        <level>warning</level>
        <console>1</console>
    </logger>
    <listen_host>127.0.0.1</listen_host>
    <http_port>{http_port}</http_port>
    <tcp_port>{tcp_port}</tcp_port>
    <path>{data}/</path>
    <tmp_path>{data}/tmp/</tmp_path>
    <user_files_path>{data}/user_files/</user_files_path>
    <format_schema_path>{data}/format_schemas/</format_schema_path>
    <mark_cache_size>67108864</mark_cache_size>
    <uncompressed_cache_size>67108864</uncompressed_cache_size>
    <timezone>UTC</timezone>
    <mlock_executable>false</mlock_executable>
    <users>
        <default>
            <password></password>
            <networks><ip>127.0.0.1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </default>
    </users>
    <profiles><default></default></profiles>
    <quotas><default></default></quotas>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
</yandex>
"#
    )
}
