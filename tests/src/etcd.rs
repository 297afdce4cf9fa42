//! A real etcd cluster of one or more members on loopback, from the `etcd` on PATH,
//! with authentication on and lockcell's users and roles unless asked otherwise.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use lockcell_cell::rbac::{self, Credentials, Passwords};

use crate::bins;
use crate::ports::free_port;
use crate::process::Managed;

/// How long a new cluster may take to elect a leader and answer.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Deadline of each call the harness makes to etcd.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Test clusters' password of etcd's root user (tests only).
pub const ROOT_PASSWORD: &str = "test-root-pw";
/// Test clusters' password of `lockcell-proxy`.
pub const PROXY_PASSWORD: &str = "test-proxy-pw";
/// Test clusters' password of `lockcell-tailer`.
pub const TAILER_PASSWORD: &str = "test-tailer-pw";
/// Test clusters' password of `lockcell-admin`.
pub const ADMIN_PASSWORD: &str = "test-admin-pw";

/// The passwords every test cluster's users have.
pub fn test_passwords() -> Passwords {
    Passwords {
        proxy: PROXY_PASSWORD.to_owned(),
        tailer: TAILER_PASSWORD.to_owned(),
        admin: ADMIN_PASSWORD.to_owned(),
        root: ROOT_PASSWORD.to_owned(),
    }
}

/// How to start a cluster.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Turn authentication on, with lockcell's roles and these users' passwords; `None`
    /// leaves it off (the load test's clusters, to compare with earlier runs).
    pub auth: Option<Passwords>,
    /// More etcd flags, such as `--auth-token-ttl 2`.
    pub extra_args: Vec<String>,
}

impl Default for EtcdOptions {
    /// Authentication on, with [`test_passwords`].
    fn default() -> Self {
        EtcdOptions {
            auth: Some(test_passwords()),
            extra_args: Vec::new(),
        }
    }
}

impl EtcdOptions {
    /// Authentication off: anyone may do anything.
    pub fn without_auth() -> Self {
        EtcdOptions {
            auth: None,
            extra_args: Vec::new(),
        }
    }
}

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
    /// The users' passwords when authentication is on.
    passwords: Option<Passwords>,
    /// Root's client (authentication on), made once: every log-in is a raft round.
    root: tokio::sync::OnceCell<etcd_client::Client>,
}

impl EtcdCluster {
    /// Starts `members` members (named a, b, c, ...) in a fresh temporary folder, with
    /// authentication on.
    pub async fn start(members: usize) -> anyhow::Result<Self> {
        Self::start_with(members, &EtcdOptions::default()).await
    }

    /// Like [`EtcdCluster::start`] with authentication off.
    pub async fn start_without_auth(members: usize) -> anyhow::Result<Self> {
        Self::start_with(members, &EtcdOptions::without_auth()).await
    }

    /// Starts `members` members in a fresh temporary folder, as `options` say.
    pub async fn start_with(members: usize, options: &EtcdOptions) -> anyhow::Result<Self> {
        let temp = tempfile::Builder::new()
            .prefix("lockcell-etcd-")
            .tempdir()?;
        let dir = temp.path().to_path_buf();
        let mut cluster = Self::start_in_with(&dir, members, options).await?;
        cluster._temp = Some(temp);
        Ok(cluster)
    }

    /// Starts `members` members with their data and logs under `dir`, with
    /// authentication on.
    pub async fn start_in(dir: &Path, members: usize) -> anyhow::Result<Self> {
        Self::start_in_with(dir, members, &EtcdOptions::default()).await
    }

    /// Starts `members` members with their data and logs under `dir`, as `options` say.
    pub async fn start_in_with(
        dir: &Path,
        members: usize,
        options: &EtcdOptions,
    ) -> anyhow::Result<Self> {
        Self::start_on_with(dir, &reserve_ports(members), options).await
    }

    /// Starts one member per `(client port, peer port)` pair, with data and logs under
    /// `dir`, with authentication on: for tests that point a proxy at an address before
    /// etcd is there.
    pub async fn start_on(dir: &Path, ports: &[(u16, u16)]) -> anyhow::Result<Self> {
        Self::start_on_with(dir, ports, &EtcdOptions::default()).await
    }

    /// Starts one member per `(client port, peer port)` pair, as `options` say. Once the
    /// cluster answers it gets lockcell's roles and users and authentication (when
    /// asked; data restored from a cell that had it keeps it), then the epoch record.
    pub async fn start_on_with(
        dir: &Path,
        ports: &[(u16, u16)],
        options: &EtcdOptions,
    ) -> anyhow::Result<Self> {
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
                .arg("warn")
                .args(&options.extra_args);
            if options.auth.is_some() {
                // The cheapest password hashing: every log-in checks one.
                cmd.arg("--bcrypt-cost").arg("4");
            }
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
            passwords: None,
            root: Default::default(),
        };
        cluster.wait_ready().await?;
        if let Some(passwords) = &options.auth {
            let setup =
                rbac::connect_for_setup(&cluster.endpoints(), &passwords.root, plain()).await?;
            rbac::enable(&setup, passwords, CALL_TIMEOUT)
                .await
                .context("turning etcd authentication on")?;
            cluster.passwords = Some(passwords.clone());
        }
        cluster.init_cell().await?;
        Ok(cluster)
    }

    /// Writes the cell's epoch record unless it is there (what `lockcell-cell init`
    /// does, as `lockcell-admin`), as every cell needs before proxies serve it.
    pub async fn init_cell(&self) -> anyhow::Result<lockcell_cell::epoch::EpochRecord> {
        let client = match self.credentials(rbac::ADMIN_USER) {
            Some(admin) => self.client_as(&admin).await?,
            None => self.client().await?,
        };
        let mut kv = client.kv_client();
        Ok(lockcell_cell::epoch::ensure(&mut kv, CALL_TIMEOUT).await?)
    }

    /// Whether the cluster runs with authentication on.
    pub fn auth(&self) -> bool {
        self.passwords.is_some()
    }

    /// The credentials of one of lockcell's users (`rbac::PROXY_USER`, ...); `None`
    /// when authentication is off.
    pub fn credentials(&self, user: &str) -> Option<Credentials> {
        self.passwords.as_ref()?.credentials(user)
    }

    /// The proxy user's name and password, as [`crate::ProxyOptions::etcd_auth`] takes
    /// them; `None` when authentication is off.
    pub fn proxy_auth(&self) -> Option<(String, String)> {
        self.credentials(rbac::PROXY_USER)
            .map(|c| (c.user, c.password))
    }

    /// Client endpoints of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_addr.clone()).collect()
    }

    /// A client of the whole cluster, for tests that look at etcd directly: root's when
    /// authentication is on.
    pub async fn client(&self) -> anyhow::Result<etcd_client::Client> {
        let Some(root) = self.credentials(rbac::ROOT_USER) else {
            return Ok(etcd_client::Client::connect(self.endpoints(), Some(plain())).await?);
        };
        let client = self.root.get_or_try_init(|| self.client_as(&root)).await?;
        Ok(client.clone())
    }

    /// A client of the whole cluster logged in as `credentials`.
    pub async fn client_as(
        &self,
        credentials: &Credentials,
    ) -> anyhow::Result<etcd_client::Client> {
        let options = rbac::with_credentials(plain(), Some(credentials));
        etcd_client::Client::connect(self.endpoints(), Some(options))
            .await
            .with_context(|| format!("logging in to etcd as {}", credentials.user))
    }

    /// A client of member `index` alone (root's when authentication is on).
    pub async fn member_client(&self, index: usize) -> anyhow::Result<etcd_client::Client> {
        let root = self.credentials(rbac::ROOT_USER);
        let options = rbac::with_credentials(plain(), root.as_ref());
        let endpoint = [self.members[index].client_addr.clone()];
        Ok(etcd_client::Client::connect(endpoint, Some(options)).await?)
    }

    /// The cluster's current revision (a linearizable read).
    pub async fn revision(&self) -> anyhow::Result<i64> {
        let resp = self.client().await?.get("/", None).await?;
        Ok(resp.header().context("get has no header")?.revision())
    }

    /// Whether the cluster answers a linearizable read. A cluster with authentication on
    /// already (restored from a backup of one) answers a read without a user by refusing
    /// it, after the read's wait for the leader.
    async fn answers(&self) -> anyhow::Result<()> {
        let client = etcd_client::Client::connect(self.endpoints(), Some(plain())).await?;
        let count = etcd_client::GetOptions::new().with_count_only();
        match client.kv_client().get("/", Some(count)).await {
            Ok(_) => Ok(()),
            Err(e) if rbac::refusal(&e) == Some(rbac::Refusal::NoUser) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            for m in self.members.iter_mut() {
                if !m.process.is_running() {
                    bail!("etcd {} exited:\n{}", m.name, m.process.log_tail(20));
                }
            }
            let answer = tokio::time::timeout(Duration::from_secs(2), self.answers()).await;
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

/// Connect options without a user, with the harness's deadlines.
fn plain() -> etcd_client::ConnectOptions {
    etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(CALL_TIMEOUT)
}

/// Runs `lockcell-cell ARGS` to completion, logged in to etcd as `lockcell-admin`; its
/// stdout, or its stderr as the error.
pub fn lockcell_cell(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(bins::workspace_bin("lockcell-cell")?)
        .args(args)
        .env("LOCKCELL_ETCD_USER", rbac::ADMIN_USER)
        .env("LOCKCELL_ETCD_PASSWORD", ADMIN_PASSWORD)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "lockcell-cell {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
