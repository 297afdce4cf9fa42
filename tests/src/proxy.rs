//! A real `lockcell-proxy` process on loopback.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::bail;
use nix::sys::signal::Signal;

use crate::bins;
use crate::ports::free_port;
use crate::process::Managed;
use crate::wait::eventually;

/// How long a proxy may take to reach etcd, get its leases and start serving.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The line a proxy logs once it serves.
const READY_LINE: &str = "lockcell-proxy ready";

/// How to start a proxy. Times are short by default so tests stay quick.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    pub zone: String,
    pub etcd: Vec<String>,
    pub leases: u16,
    /// Whole seconds (etcd's unit).
    pub lease_ttl: Duration,
    pub session_ttl_min: Duration,
    /// The gRPC address to listen on (`127.0.0.1:PORT`); a free port when unset. A
    /// restarted proxy takes its predecessor's address, so clients reconnect to it.
    pub listen: Option<String>,
    /// How long a stopping proxy waits for its clients to move (short in tests).
    pub drain_timeout: Duration,
    /// More `--flag value` arguments.
    pub extra_args: Vec<String>,
    /// Serve the admin endpoints on every address of the host, not only loopback
    /// (`admin_addr` stays the loopback one).
    pub admin_on_every_address: bool,
    /// The etcd user and password the proxy logs in with: the test clusters'
    /// `lockcell-proxy` by default; `None` for a cluster with authentication off.
    pub etcd_auth: Option<(String, String)>,
    /// More environment variables (libfaketime's, say).
    pub env: Vec<(String, String)>,
}

impl ProxyOptions {
    /// Options for a proxy of zone `zone` on the etcd endpoints `etcd`, logging in as
    /// the test clusters' `lockcell-proxy`.
    pub fn new(zone: &str, etcd: Vec<String>) -> Self {
        ProxyOptions {
            zone: zone.to_owned(),
            etcd,
            leases: 4,
            lease_ttl: Duration::from_secs(3),
            session_ttl_min: Duration::from_millis(500),
            listen: None,
            drain_timeout: Duration::from_secs(3),
            extra_args: Vec::new(),
            admin_on_every_address: false,
            etcd_auth: Some((
                lockcell_cell::rbac::PROXY_USER.to_owned(),
                crate::etcd::PROXY_PASSWORD.to_owned(),
            )),
            env: Vec::new(),
        }
    }
}

/// A running proxy; dropping it kills the process.
pub struct ProxyProcess {
    pub zone: String,
    /// `127.0.0.1:PORT` of the gRPC service.
    pub addr: String,
    /// `127.0.0.1:PORT` of the admin server (/metrics, /healthz, /readyz, /drain).
    pub admin_addr: String,
    pub process: Managed,
}

impl ProxyProcess {
    /// Starts a proxy with its log in `log_dir`, and waits until it serves.
    pub async fn start(options: &ProxyOptions, log_dir: &Path) -> anyhow::Result<Self> {
        let mut proxy = Self::spawn(options, log_dir)?;
        proxy.wait_ready(START_TIMEOUT).await?;
        Ok(proxy)
    }

    /// Starts a proxy process without waiting for it to serve.
    pub fn spawn(options: &ProxyOptions, log_dir: &Path) -> anyhow::Result<Self> {
        let bin = bins::workspace_bin("lockcell-proxy")?;
        let admin_port = free_port();
        let addr = options
            .listen
            .clone()
            .unwrap_or_else(|| format!("127.0.0.1:{}", free_port()));
        let port = addr.rsplit(':').next().unwrap_or_default().to_owned();
        let admin_addr = format!("127.0.0.1:{admin_port}");
        let log = log_dir.join(format!("proxy-{}-{port}.log", options.zone));
        let mut cmd = Command::new(bin);
        cmd.arg("--listen")
            .arg(&addr)
            .arg("--admin-listen")
            .arg(if options.admin_on_every_address {
                format!("0.0.0.0:{admin_port}")
            } else {
                admin_addr.clone()
            })
            .arg("--etcd")
            .arg(options.etcd.join(","))
            .arg("--zone")
            .arg(&options.zone)
            .arg("--proxy-id")
            .arg(format!("{}-{port}", options.zone))
            .arg("--leases")
            .arg(options.leases.to_string())
            .arg("--lease-ttl")
            .arg(format!("{}s", options.lease_ttl.as_secs()))
            .arg("--session-ttl-min")
            .arg(format!("{}ms", options.session_ttl_min.as_millis()))
            .arg("--drain-timeout")
            .arg(format!("{}ms", options.drain_timeout.as_millis()))
            .args(&options.extra_args)
            // LOCKCELL_TEST_PROXY_LOG: more of the proxies' log, to look into a failure.
            .env(
                "RUST_LOG",
                std::env::var("LOCKCELL_TEST_PROXY_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env_remove("LOCKCELL_ETCD_USER")
            .env_remove("LOCKCELL_ETCD_PASSWORD")
            .envs(options.env.iter().map(|(k, v)| (k, v)));
        if let Some((user, password)) = &options.etcd_auth {
            // The password in the environment, where other users' `ps` does not show it.
            cmd.arg("--etcd-user")
                .arg(user)
                .env("LOCKCELL_ETCD_PASSWORD", password);
        }
        let process = Managed::spawn(format!("proxy {}", options.zone), cmd, &log)?;
        Ok(ProxyProcess {
            zone: options.zone.clone(),
            addr,
            admin_addr,
            process,
        })
    }

    /// Waits until the proxy logs that it serves; fails if it exits first.
    pub async fn wait_ready(&mut self, within: Duration) -> anyhow::Result<()> {
        self.wait_for_log(READY_LINE, within).await
    }

    /// Waits until the proxy's log contains `text`; fails if the proxy exits first.
    pub async fn wait_for_log(&mut self, text: &str, within: Duration) -> anyhow::Result<()> {
        let what = format!("proxy {} logs {text:?}", self.zone);
        eventually(&what, within, || {
            let running = self.process.is_running();
            let log = self.process.log.clone();
            let tail = self.process.log_tail(20);
            async move {
                let seen = std::fs::read_to_string(&log)?.contains(text);
                if !seen && !running {
                    bail!("proxy exited:\n{tail}");
                }
                Ok(seen.then_some(()))
            }
        })
        .await
    }

    /// The address as a URL for the SDK.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log_path(&self) -> PathBuf {
        self.process.log.clone()
    }

    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        self.process.signal(signal)
    }

    /// Reads the admin `/metrics` page.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        http_get(&self.admin_addr, "/metrics").await
    }

    /// The value of one metric without labels from `/metrics` (0 when absent).
    pub async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let page = self.metrics().await?;
        Ok(page
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (key, value) = l.split_once(' ')?;
                (key == name).then(|| value.trim().parse().ok()).flatten()
            })
            .unwrap_or(0.0))
    }
}

/// A plain HTTP/1.0 GET on loopback, enough for the admin pages; an error unless 200.
pub async fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    let (status, head, body) = http_call(addr, "GET", path).await?;
    if status != 200 {
        bail!("GET {path} on {addr}: {head}");
    }
    Ok(body)
}

/// A plain HTTP/1.0 request on loopback: the status code, the status line and the body.
pub async fn http_call(
    addr: &str,
    method: &str,
    path: &str,
) -> anyhow::Result<(u16, String, String)> {
    http_call_with(addr, method, path, &[]).await
}

/// [`http_call`] with more request headers.
pub async fn http_call_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    stream
        .write_all(
            format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{extra}Content-Length: 0\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let line = head.lines().next().unwrap_or("").to_owned();
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("{method} {path} on {addr}: no status in {line:?}"))?;
    Ok((status, line, body.to_owned()))
}
