//! A private S3-compatible server (moto) on loopback for the audit archive tests, with
//! one bucket made; killed when its handle drops.
//!
//! `make setup` installs moto into `.lockcell-tools/venv` in the workspace.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::ports::free_port;
use crate::process::Managed;

/// How long a new server may take to answer.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The bucket every server starts with.
pub const BUCKET: &str = "lockcell-audit";

/// moto's server script in the workspace's tool virtualenv.
pub fn moto_server() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.lockcell-tools/venv/bin/moto_server")
}

/// True when moto is installed; the S3 tests skip without it.
pub fn available() -> bool {
    moto_server().is_file()
}

/// A running moto server; dropping it kills it.
pub struct S3Server {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    pub process: Managed,
    /// Holds the log while the server runs.
    _temp: tempfile::TempDir,
}

impl S3Server {
    /// Starts moto on a free port, waits until it answers and creates [`BUCKET`].
    pub async fn start() -> anyhow::Result<S3Server> {
        let program = moto_server();
        if !program.is_file() {
            bail!(
                "{} is missing (run `make setup` to install moto)",
                program.display()
            );
        }
        let temp = tempfile::Builder::new().prefix("lockcell-s3-").tempdir()?;
        let port = free_port();
        let mut cmd = Command::new(&program);
        cmd.arg("-H")
            .arg("127.0.0.1")
            .arg("-p")
            .arg(port.to_string());
        let log = temp.path().join("moto.log");
        let mut server = S3Server {
            addr: format!("127.0.0.1:{port}"),
            process: Managed::spawn("moto_server", cmd, &log)?,
            _temp: temp,
        };
        server.wait_ready().await?;
        let created = http_request(&server.addr, "PUT", &format!("/{BUCKET}")).await?;
        if !created.starts_with("HTTP/1.1 200") && !created.starts_with("HTTP/1.0 200") {
            bail!(
                "creating bucket {BUCKET} on {}: {}",
                server.addr,
                created.lines().next().unwrap_or("")
            );
        }
        Ok(server)
    }

    /// The endpoint to give an S3 client: `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Credentials: moto takes any.
    pub fn access_key_id(&self) -> &'static str {
        "lockcell-test"
    }

    pub fn secret_access_key(&self) -> &'static str {
        "lockcell-test-secret"
    }

    pub fn region(&self) -> &'static str {
        "us-east-1"
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            if !self.process.is_running() {
                bail!("moto_server exited:\n{}", self.process.log_tail(30));
            }
            let listing = tokio::time::timeout(
                Duration::from_secs(2),
                crate::proxy::http_get(&self.addr, "/"),
            )
            .await;
            if let Ok(Ok(body)) = listing {
                if body.contains("ListAllMyBucketsResult") {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "moto_server did not answer on {} within {START_TIMEOUT:?}\n{}",
                    self.addr,
                    self.process.log_tail(30)
                );
            }
            tokio::time::sleep(crate::wait::POLL).await;
        }
    }
}

/// A bodiless HTTP/1.0 request; returns the whole answer (status line first).
async fn http_request(addr: &str, method: &str, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream
        .write_all(
            format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await?;
    Ok(answer)
}
