//! A real etcd cluster of one or more members on loopback, from the `etcd` on PATH.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::bins;
use crate::ports::free_port;
use crate::process::Managed;

/// How long a new cluster may take to elect a leader and answer.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// True when an `etcd` binary is on PATH; tests that need one skip without it.
pub fn available() -> bool {
    bins::on_path("etcd").is_some()
}

/// Free `(client, peer)` port pairs for `members` members.
pub fn reserve_ports(members: usize) -> Vec<(u16, u16)> {
    (0..members).map(|_| (free_port(), free_port())).collect()
}

/// One member of a cluster.
pub struct EtcdMember {
    /// The member's name and zone ("a", "b", ...).
    pub name: String,
    /// `127.0.0.1:PORT` for clients.
    pub client_addr: String,
    pub process: Managed,
}

/// A running cluster; dropping it kills every member.
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    /// Keeps a temporary data folder alive as long as the cluster.
    _temp: Option<tempfile::TempDir>,
    pub dir: PathBuf,
}

impl EtcdCluster {
    /// Starts `members` members (named a, b, c, ...) in a fresh temporary folder.
    pub async fn start(members: usize) -> anyhow::Result<Self> {
        let temp = tempfile::Builder::new()
            .prefix("lockcell-etcd-")
            .tempdir()?;
        let dir = temp.path().to_path_buf();
        let mut cluster = Self::start_in(&dir, members).await?;
        cluster._temp = Some(temp);
        Ok(cluster)
    }

    /// Starts `members` members with their data and logs under `dir`.
    pub async fn start_in(dir: &Path, members: usize) -> anyhow::Result<Self> {
        Self::start_on(dir, &reserve_ports(members)).await
    }

    /// Starts one member per `(client port, peer port)` pair, with data and logs under
    /// `dir`: for tests that point a proxy at an address before etcd is there.
    pub async fn start_on(dir: &Path, ports: &[(u16, u16)]) -> anyhow::Result<Self> {
        let etcd =
            bins::on_path("etcd").context("no etcd on PATH (install the etcd-server package)")?;
        let names: Vec<String> = (0..ports.len())
            .map(|i| ((b'a' + i as u8) as char).to_string())
            .collect();
        let initial: Vec<String> = names
            .iter()
            .zip(ports)
            .map(|(n, (_, peer))| format!("{n}=http://127.0.0.1:{peer}"))
            .collect();
        let token = format!("lockcell-{}", ports[0].0);
        let mut started = Vec::new();
        for (name, (client, peer)) in names.iter().zip(ports) {
            let data = dir.join(format!("etcd-{name}"));
            std::fs::create_dir_all(&data)?;
            let mut cmd = Command::new(&etcd);
            cmd.arg("--name")
                .arg(name)
                .arg("--data-dir")
                .arg(&data)
                .arg("--listen-client-urls")
                .arg(format!("http://127.0.0.1:{client}"))
                .arg("--advertise-client-urls")
                .arg(format!("http://127.0.0.1:{client}"))
                .arg("--listen-peer-urls")
                .arg(format!("http://127.0.0.1:{peer}"))
                .arg("--initial-advertise-peer-urls")
                .arg(format!("http://127.0.0.1:{peer}"))
                .arg("--initial-cluster")
                .arg(initial.join(","))
                .arg("--initial-cluster-token")
                .arg(&token)
                .arg("--initial-cluster-state")
                .arg("new")
                .arg("--logger")
                .arg("zap")
                .arg("--log-level")
                .arg("warn");
            let log = dir.join(format!("etcd-{name}.log"));
            started.push(EtcdMember {
                name: name.clone(),
                client_addr: format!("127.0.0.1:{client}"),
                process: Managed::spawn(format!("etcd {name}"), cmd, &log)?,
            });
        }
        let mut cluster = EtcdCluster {
            members: started,
            _temp: None,
            dir: dir.to_path_buf(),
        };
        cluster.wait_ready().await?;
        cluster.init_cell().await?;
        Ok(cluster)
    }

    /// Writes the cell's epoch record unless it is there (what `lockcell-cell init`
    /// does), as every cell needs before proxies serve it.
    pub async fn init_cell(&self) -> anyhow::Result<lockcell_cell::epoch::EpochRecord> {
        let mut kv = self.client().await?.kv_client();
        Ok(lockcell_cell::epoch::ensure(&mut kv, Duration::from_secs(5)).await?)
    }

    /// Client endpoints of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_addr.clone()).collect()
    }

    /// A client of the whole cluster, for tests that look at etcd directly.
    pub async fn client(&self) -> anyhow::Result<etcd_client::Client> {
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5));
        Ok(etcd_client::Client::connect(self.endpoints(), Some(options)).await?)
    }

    /// The cluster's current revision (a linearizable read).
    pub async fn revision(&self) -> anyhow::Result<i64> {
        let resp = self.client().await?.get("/", None).await?;
        Ok(resp.header().context("get has no header")?.revision())
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            for m in self.members.iter_mut() {
                if !m.process.is_running() {
                    bail!("etcd {} exited:\n{}", m.name, m.process.log_tail(20));
                }
            }
            let answer = tokio::time::timeout(Duration::from_secs(2), self.revision()).await;
            if let Ok(Ok(_)) = answer {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                let logs: Vec<String> = self
                    .members
                    .iter()
                    .map(|m| format!("--- etcd {} ---\n{}", m.name, m.process.log_tail(10)))
                    .collect();
                bail!(
                    "etcd cluster did not answer within {START_TIMEOUT:?}\n{}",
                    logs.join("\n")
                );
            }
            tokio::time::sleep(crate::wait::POLL).await;
        }
    }
}
