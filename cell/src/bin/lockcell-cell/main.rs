//! `lockcell-cell`: the cell's own services and records.
//!
//! - `init`: writes a new cell's epoch record (once; proxies refuse a cell without one).
//! - `epoch`: shows it.
//! - `bump-epoch`: raises the epoch after a restore from backup.
//! - `audit [rebuild]`: the audit tailer, and the rebuild of its store from the archive.
//! - `auth-enable`: etcd's users and roles for lockcell, and authentication on.
//! - `shardmap show | set | move`: which cell serves which names, and moving names
//!   between cells.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use lockcell_cell::audit::archive::{Archive, ArchiveOptions};
use lockcell_cell::audit::store::Store;
use lockcell_cell::audit::tailer::{self, TailerOptions, TailerStats};
use lockcell_cell::epoch;
use lockcell_cell::presence;
use lockcell_cell::rbac::{self, Credentials, Passwords, Secret};

mod check;
mod http;
mod operate;
mod shardmap;

/// lockcell-cell: the authoritative side of a lockcell cell.
///
/// A cell is one etcd cluster. This binary sets its records up (`init`, `bump-epoch`),
/// turns etcd authentication on (`auth-enable`), keeps the shard map that routes names
/// to cells (`shardmap`) and runs its audit tailer (`audit`),
/// which turns every change in the cell into an audit event (granted, released,
/// expired, moved, leader changed, waiting, key written or deleted, config changed) and
/// keeps them in a store (SQLite by default, ClickHouse when configured) and an archive
/// (a local folder by default, S3 when configured).
#[derive(Debug, Parser)]
#[command(name = "lockcell-cell", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,

    /// A TOML file of settings, each named as its long flag (`etcd =
    /// ["http://10.0.1.5:2379"]`, `etcd-user = "lockcell-tailer"`); a table named as a
    /// command (`[audit]`) holds settings for that command only. A flag or an
    /// environment variable beats it.
    #[arg(long, env = "LOCKCELL_CELL_CONFIG", global = true)]
    config: Option<PathBuf>,

    /// Prints the configuration in force for the command, each setting with where it
    /// came from (flag, environment, file, default; passwords hidden), in the file's
    /// format, and exits without doing anything.
    #[arg(long, global = true)]
    print_config: bool,

    /// Checks the files the command would read (for `audit`: --grants,
    /// --admin-token-file, --tls-cert and --tls-key; for every command: the settings and
    /// the --etcd-tls-* files) and exits without doing anything or contacting etcd.
    /// Prints what was checked and `configuration OK` (exit 0), or each error, naming
    /// the file (exit 1; bad settings exit 2).
    #[arg(long, global = true)]
    check_config: bool,

    /// The log's format on stderr: `text` (coloured only on a terminal) or `json`
    /// (one object per line). The level comes from RUST_LOG (default info).
    #[arg(
        long,
        env = "LOCKCELL_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    log_format: lockcell_settings::logs::LogFormat,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Writes a new cell's epoch record (/sys/epoch: a new cluster id; the epoch is the
    /// Unix time in seconds, so a cell set up anew after losing its data starts above
    /// the old one). Does
    /// nothing to a cell that has one. Proxies do not serve a cell without it.
    Init(EtcdArgs),
    /// Shows the cell's epoch record.
    Epoch(EtcdArgs),
    /// Raises the cell's epoch (to the Unix time in seconds, or by one if that is not
    /// higher), and above every route epoch in the cell's copy of the shard map. Run it
    /// after restoring etcd from a backup and
    /// before any proxy serves the restored cell: the restored store's revisions go back
    /// to the backup's, and the epoch (the first part of every fencing token) keeps
    /// tokens rising. A running proxy sees the record change, grants nothing more,
    /// drains and exits.
    ///
    /// Refuses while proxies run on the cell (each keeps a presence record on its etcd
    /// lease; a record restored from the backup is told apart by watching its lease
    /// expire, which takes up to the proxies' lease TTL): on a live cell a bump makes
    /// every proxy drain at once, with nowhere for their clients to go, and every lock
    /// held in the cell is lost. --force raises it anyway.
    BumpEpoch(BumpEpochArgs),
    /// Runs the audit tailer until SIGTERM or SIGINT; `audit rebuild` first rebuilds
    /// the store from the archive.
    Audit(Box<AuditArgs>),
    /// Turns etcd authentication on for the cell, with one etcd user per kind of process.
    ///
    /// Creates the roles and users lockcell-proxy (reads every key; writes /l/, /q/, /k/
    /// and /s/), lockcell-tailer (reads every key, writes none) and lockcell-admin
    /// (reads every key; writes /sys/ and /k/: init, bump-epoch, the shard map, and
    /// the small keys a shard map move copies between cells), and root (which etcd
    /// needs), each user with only its own role; then enables authentication. Run
    /// again, it changes nothing, or puts back what drifted (a permission added or
    /// taken by hand, a password other than the one given).
    ///
    /// Once authentication is on this command logs in as root (LOCKCELL_ROOT_PASSWORD).
    /// Processes without credentials are turned away from then on: give proxies
    /// --etcd-user lockcell-proxy, the audit tailer lockcell-tailer, and init,
    /// bump-epoch and shardmap lockcell-admin, each with LOCKCELL_ETCD_PASSWORD.
    AuthEnable(AuthEnableArgs),
    /// The shard map: which cell (etcd cluster) serves which names; `show`, `set FILE`,
    /// `move PREFIX --to CELL`.
    ///
    /// Every cell of the map holds its own copy at /sys/shardmap, and its proxies grant
    /// and write only what that copy routes to that cell, unpaused. --etcd is one cell
    /// of the map, where the command starts: it reads that cell's copy, then the copy of
    /// every cell the copies (and, for `set`, the file) name, at the endpoints they give.
    /// The same --etcd-user, --etcd-password and --etcd-tls-* settings are used for
    /// every cell: give each cell's lockcell-admin user the same password, and sign
    /// every cell's certificates with the same CA.
    Shardmap(shardmap::ShardmapArgs),
    /// Shows how the cell stands: its epoch record and shard map, each etcd member
    /// (version, database size, leader), the etcd leases, each running proxy (zone,
    /// version, readiness, sessions, lease lower bound, from its presence record and
    /// its admin port) and, with --tailer, each audit tailer's lag. Exits 1 when
    /// something does not answer, is not ready or is behind.
    Status(operate::StatusArgs),
    /// Forces a stuck hold off: ends the session holding NAME with the token --token, on
    /// the proxy it is on, and waits until its keys are gone.
    ///
    /// First it writes who asked and why (--operator, --reason) to /sys/force-release,
    /// which the audit trail records as a `force_released` event. The holder is told its
    /// session expired (`lockctl lock` stops its command; the SDK reports every hold of
    /// the session lost), and its keys are deleted once the validity the proxy granted
    /// it has run out, so it is never still acting when the lock passes on; every other
    /// hold of the session goes with it. A token that is not the hold's now changes
    /// nothing. The proxies' admin ports must answer this host (their admin token with
    /// --admin-token-file).
    ForceRelease(operate::ForceReleaseArgs),
}

#[derive(Debug, Args)]
struct BumpEpochArgs {
    #[command(flatten)]
    etcd: EtcdArgs,

    /// Raise the epoch even though proxies run on the cell: each of them grants nothing
    /// more, drains and exits, and every lock held in the cell is lost to its holder
    /// (their sessions keep nothing when they resume). For a cell whose proxies kept
    /// running through a restore, or when a proxy cannot be stopped.
    #[arg(long)]
    force: bool,
}

/// How long `bump-epoch` watches presence records' leases before counting what is left
/// as running proxies (longer than any sensible proxy lease TTL).
const PRESENCE_PATIENCE: Duration = Duration::from_secs(60);

/// Where the cell's etcd is.
#[derive(Debug, Clone, Args)]
struct EtcdAddress {
    /// etcd client endpoints, comma-separated.
    #[arg(
        long = "etcd",
        env = "LOCKCELL_ETCD",
        value_delimiter = ',',
        default_value = "127.0.0.1:2379"
    )]
    etcd_endpoints: Vec<String>,

    /// Deadline of each call to etcd.
    #[arg(long, env = "LOCKCELL_ETCD_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    etcd_timeout: Duration,

    #[command(flatten)]
    tls: lockcell_cell::etcd_tls::EtcdTls,
}

/// Where the cell's etcd is, and who to log in as.
#[derive(Debug, Clone, Args)]
struct EtcdArgs {
    #[command(flatten)]
    address: EtcdAddress,

    /// etcd user, when etcd runs with authentication on (lockcell-admin for init,
    /// epoch, bump-epoch and shardmap; lockcell-tailer for audit).
    #[arg(long, env = "LOCKCELL_ETCD_USER")]
    etcd_user: Option<String>,

    /// That user's password (prefer the environment variable to the flag).
    #[arg(long, env = "LOCKCELL_ETCD_PASSWORD", hide_env_values = true)]
    etcd_password: Option<Secret>,
}

impl EtcdAddress {
    fn options(&self) -> anyhow::Result<etcd_client::ConnectOptions> {
        self.tls.apply(
            etcd_client::ConnectOptions::new()
                .with_connect_timeout(self.etcd_timeout)
                .with_timeout(self.etcd_timeout),
        )
    }

    fn endpoints(&self) -> String {
        self.etcd_endpoints.join(",")
    }
}

impl EtcdArgs {
    async fn connect(&self) -> anyhow::Result<etcd_client::Client> {
        self.connect_to(&self.address.etcd_endpoints).await
    }

    /// Connects to another cell's `endpoints` with the same user, TLS and deadlines.
    async fn connect_to(&self, endpoints: &[String]) -> anyhow::Result<etcd_client::Client> {
        let credentials = self.etcd_user.as_ref().map(|user| {
            Credentials::new(
                user,
                String::from(self.etcd_password.clone().unwrap_or_default()),
            )
        });
        let options = rbac::with_credentials(self.address.options()?, credentials.as_ref());
        etcd_client::Client::connect(endpoints, Some(options))
            .await
            .map_err(|e| login_error(e, self.etcd_user.as_deref(), &endpoints.join(",")))
    }
}

/// A failed connection to etcd at `at`, saying what to change when etcd turned the user
/// away.
fn login_error(e: etcd_client::Error, user: Option<&str>, at: &str) -> anyhow::Error {
    let user = user.unwrap_or("(none)");
    let hint = match rbac::refusal(&e) {
        Some(rbac::Refusal::BadCredentials) => format!(
            "etcd at {at} refused the user {user} and its password; check --etcd-user and --etcd-password (LOCKCELL_ETCD_USER, LOCKCELL_ETCD_PASSWORD)"
        ),
        Some(rbac::Refusal::AuthOff) => format!(
            "etcd at {at} runs with authentication off, and --etcd-user {user} was given; turn it on with `lockcell-cell auth-enable` or leave --etcd-user out"
        ),
        _ => format!("connecting to etcd at {at}"),
    };
    anyhow::Error::new(e).context(hint)
}

/// The passwords `auth-enable` gives lockcell's etcd users.
#[derive(Clone, Args)]
struct AuthEnableArgs {
    #[command(flatten)]
    etcd: EtcdAddress,

    /// Password of etcd's root user. Once authentication is on, this command logs in as
    /// root with it.
    #[arg(long, env = "LOCKCELL_ROOT_PASSWORD", hide_env_values = true)]
    root_password: Secret,

    /// Password of the lockcell-proxy user (proxies log in with it).
    #[arg(long, env = "LOCKCELL_PROXY_PASSWORD", hide_env_values = true)]
    proxy_password: Secret,

    /// Password of the lockcell-tailer user (the audit tailer logs in with it).
    #[arg(long, env = "LOCKCELL_TAILER_PASSWORD", hide_env_values = true)]
    tailer_password: Secret,

    /// Password of the lockcell-admin user (init, bump-epoch, the shard map).
    #[arg(long, env = "LOCKCELL_ADMIN_PASSWORD", hide_env_values = true)]
    admin_password: Secret,
}

/// Never prints the passwords.
impl std::fmt::Debug for AuthEnableArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthEnableArgs")
            .field("etcd", &self.etcd)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum AuditAction {
    /// Tail the cell into the store and the archive.
    Run,
    /// Empty the store, load it from the archive, then tail from there.
    Rebuild,
}

#[derive(Debug, Clone, Args)]
struct AuditArgs {
    /// `run` (the default) or `rebuild`.
    #[arg(value_enum, default_value = "run")]
    action: AuditAction,

    #[command(flatten)]
    etcd: EtcdArgs,

    /// The cell's data folder: the SQLite store and the local archive live here unless
    /// --store and --archive say otherwise.
    #[arg(long, env = "LOCKCELL_DATA_DIR", default_value = "lockcell-cell-data")]
    data_dir: PathBuf,

    /// The audit store: a SQLite file path (default DATA_DIR/audit.db), or a ClickHouse
    /// HTTP URL such as http://127.0.0.1:8123/?database=lockcell&table=audit_events.
    #[arg(long, env = "LOCKCELL_AUDIT_STORE")]
    store: Option<String>,

    /// The archive: a folder (default DATA_DIR/archive), or s3://BUCKET/PREFIX.
    #[arg(long, env = "LOCKCELL_AUDIT_ARCHIVE")]
    archive: Option<String>,

    /// Keep no archive (the store then cannot be rebuilt).
    #[arg(long, conflicts_with = "archive")]
    no_archive: bool,

    /// S3 endpoint for S3-compatible servers (MinIO); default AWS_ENDPOINT_URL or AWS.
    #[arg(long, env = "LOCKCELL_S3_ENDPOINT")]
    s3_endpoint: Option<String>,

    /// S3 region; default AWS_REGION, else us-east-1.
    #[arg(long, env = "LOCKCELL_S3_REGION")]
    s3_region: Option<String>,

    /// S3 access key id; default AWS_ACCESS_KEY_ID, or the instance's credentials.
    #[arg(long, env = "LOCKCELL_S3_ACCESS_KEY_ID")]
    s3_access_key_id: Option<String>,

    /// S3 secret access key; default AWS_SECRET_ACCESS_KEY (prefer an environment
    /// variable to the flag).
    #[arg(long, env = "LOCKCELL_S3_SECRET_ACCESS_KEY", hide_env_values = true)]
    s3_secret_access_key: Option<String>,

    /// Days of events the store keeps (older days are dropped; ClickHouse by partition).
    #[arg(long, env = "LOCKCELL_AUDIT_KEEP_DAYS", default_value_t = 90)]
    keep_days: u32,

    /// An archive segment is written once it holds this many events...
    #[arg(long, env = "LOCKCELL_AUDIT_SEGMENT_EVENTS", default_value_t = 50_000)]
    segment_events: usize,

    /// ...or is this old.
    #[arg(long, env = "LOCKCELL_AUDIT_SEGMENT_AGE", default_value = "5m", value_parser = humantime::parse_duration)]
    segment_age: Duration,

    /// The HTTP address: /healthz (alive), /readyz (etcd answered within the last few
    /// seconds, and not draining), POST /drain (stop as on SIGTERM), /metrics
    /// (Prometheus) and /v1/audit (what `lockctl audit` asks).
    #[arg(long, env = "LOCKCELL_AUDIT_LISTEN", default_value = "127.0.0.1:7431")]
    listen: SocketAddr,

    /// The proxies' prefix grants file: /v1/audit then answers only a caller with a
    /// bearer token it lists, about names its grants let it read or lock (values and
    /// lease ids only with the read right, and only when asked for). Read again at every
    /// query. Without it, anyone who reaches the port reads every history (values only
    /// when asked for).
    #[arg(long, env = "LOCKCELL_GRANTS")]
    grants: Option<PathBuf>,

    /// Serve HTTPS with this certificate (PEM; with --tls-key).
    #[arg(long, env = "LOCKCELL_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "LOCKCELL_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,

    /// Let --grants take bearer tokens over plain HTTP (no --tls-cert): they would cross
    /// the network in clear. For a test bench only.
    #[arg(long, env = "LOCKCELL_GRANTS_WITHOUT_TLS")]
    grants_without_tls: bool,

    /// File holding the token POST /drain requires from every caller (at least 32
    /// characters); without it, POST /drain is taken from loopback only, which a
    /// service-mesh sidecar forwarding from 127.0.0.6 defeats.
    #[arg(long, env = "LOCKCELL_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,

    /// Exit with status 1 when the tailer cannot follow its cell for this long: etcd
    /// has not answered, or it answers but the trail has not moved while the store
    /// did. Its supervisor (systemd, Kubernetes) then starts it again, and /readyz and
    /// the exit status say something is wrong instead of a tailer that looks alive.
    #[arg(long, env = "LOCKCELL_AUDIT_GIVE_UP_AFTER", default_value = "60s", value_parser = humantime::parse_duration)]
    give_up_after: Duration,

    /// `audit rebuild` only: rebuild even though the archive has overlapping segments
    /// (two tailers wrote the same revisions) or missing ones (a gap between two
    /// segments of a class). Where two segments hold an event of the same revision and
    /// place, one of them is kept.
    #[arg(long)]
    force: bool,
}

#[tokio::main]
async fn main() {
    // The audit tailer's HTTPS and etcd's TLS both use rustls; this process uses ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Some(reference) = lockcell_settings::reference_requested::<Cli>() {
        print!("{reference}");
        return;
    }
    let loaded = match lockcell_settings::load::<Cli>(std::env::args_os().collect()) {
        Ok(loaded) => loaded,
        Err(e) => e.exit(),
    };
    if loaded.config.print_config {
        print!("{}", loaded.render());
        return;
    }
    if loaded.config.check_config {
        check::exit(&loaded.config);
    }
    lockcell_settings::logs::init(loaded.config.log_format, "info");
    if let Err(e) = run(loaded.config.command).await {
        eprintln!("lockcell-cell: {e:#}");
        if let Some(hint) = refusal_hint(&e) {
            eprintln!("lockcell-cell: {hint}");
        }
        std::process::exit(1);
    }
}

/// What to do when etcd turned a call away for its user.
fn refusal_hint(e: &anyhow::Error) -> Option<&'static str> {
    let etcd = e
        .chain()
        .find_map(|cause| cause.downcast_ref::<etcd_client::Error>())?;
    match rbac::refusal(etcd)? {
        rbac::Refusal::NoUser => Some(
            "etcd runs with authentication on: log in with --etcd-user (lockcell-admin for init, epoch, bump-epoch and shardmap; lockcell-tailer for audit) and LOCKCELL_ETCD_PASSWORD",
        ),
        rbac::Refusal::PermissionDenied => Some(
            "this etcd user may not do that: init, epoch, bump-epoch and shardmap run as lockcell-admin, audit as lockcell-tailer (`lockcell-cell auth-enable` sets their roles up)",
        ),
        _ => None,
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Init(etcd) => {
            let client = etcd.connect().await?;
            let timeout = etcd.address.etcd_timeout;
            let before = epoch::read(&mut client.kv_client(), timeout).await?;
            let record = epoch::ensure(&mut client.kv_client(), timeout).await?;
            match before {
                Some(_) => println!(
                    "the cell already has its epoch record: cluster {} epoch {}; nothing written",
                    record.cluster_id, record.epoch
                ),
                None => println!(
                    "initialised the cell: cluster {} epoch {}",
                    record.cluster_id, record.epoch
                ),
            }
        }
        Command::Epoch(etcd) => {
            let client = etcd.connect().await?;
            match epoch::read(&mut client.kv_client(), etcd.address.etcd_timeout).await? {
                Some(stored) => println!(
                    "cluster {} epoch {} (written at revision {})",
                    stored.record.cluster_id, stored.record.epoch, stored.mod_revision
                ),
                None => anyhow::bail!(
                    "the cell at {} has no epoch record; set it up with `lockcell-cell init`",
                    etcd.address.endpoints()
                ),
            }
        }
        Command::BumpEpoch(BumpEpochArgs { etcd, force }) => {
            let client = etcd.connect().await?;
            let quiet_since = running_proxies(&client, &etcd, force).await?;
            let (before, after) = epoch::bump(
                &mut client.kv_client(),
                etcd.address.etcd_timeout,
                quiet_since,
            )
            .await?;
            println!(
                "raised the epoch of cluster {} from {} to {} (at revision {}); tokens granted from now on start with {}:",
                after.record.cluster_id,
                before.epoch,
                after.record.epoch,
                after.mod_revision,
                after.record.epoch
            );
        }
        Command::Audit(args) => audit(*args).await?,
        Command::AuthEnable(args) => auth_enable(args).await?,
        Command::Shardmap(args) => shardmap::run(args).await?,
        Command::Status(args) => operate::status(args).await?,
        Command::ForceRelease(args) => operate::force_release(args).await?,
    }
    Ok(())
}

/// Refuses (unless `force`) a cell with running proxies, naming them; says what it
/// waits for while presence records restored from a backup expire. Returns the
/// revision it began looking at (none with `force`): the bump refuses a presence
/// record written after it, a proxy that started meanwhile.
async fn running_proxies(
    client: &etcd_client::Client,
    etcd: &EtcdArgs,
    force: bool,
) -> anyhow::Result<Option<i64>> {
    let timeout = etcd.address.etcd_timeout;
    let looked = lockcell_cell::error::with_timeout(
        "read the store's revision",
        timeout,
        client.kv_client().get(
            lockcell_cell::keyspace::proxy_presence_root(),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        ),
    )
    .await?
    .header()
    .map(|h| h.revision())
    .unwrap_or_default();
    let quiet_since = (!force).then_some(looked);
    let recorded = presence::recorded(&mut client.kv_client(), timeout).await?;
    if recorded.is_empty() {
        return Ok(quiet_since);
    }
    eprintln!(
        "lockcell-cell: {} proxy presence record(s) in the cell; watching their etcd leases (up to their TTL) to tell running proxies from records restored from a backup",
        recorded.len()
    );
    let running = presence::running(client, timeout, PRESENCE_PATIENCE).await?;
    if running.is_empty() {
        eprintln!("lockcell-cell: none of them is renewed: no proxy runs on the cell");
        return Ok(quiet_since);
    }
    let names: Vec<String> = running
        .iter()
        .map(|p| {
            format!(
                "{} (zone {}, at {}, admin {})",
                p.proxy_id, p.zone, p.listen, p.admin
            )
        })
        .collect();
    if force {
        eprintln!(
            "lockcell-cell: --force: raising the epoch under {} running proxies: {}; each drains and exits, and every lock held in the cell is lost",
            running.len(),
            names.join(", ")
        );
        return Ok(None);
    }
    anyhow::bail!(
        "{} proxies run on the cell at {}: {}. Raising the epoch now makes every one of them grant nothing more, drain and exit at once, with no proxy left for their clients to move to, and every lock held in the cell is lost to its holder. \
         After a restore, stop the proxies first (docs/operations.md, \"Restore from backup\"); to raise it under running proxies anyway, pass --force",
        running.len(),
        etcd.address.endpoints(),
        names.join(", ")
    )
}

async fn auth_enable(args: AuthEnableArgs) -> anyhow::Result<()> {
    let passwords = Passwords {
        proxy: args.proxy_password.into(),
        tailer: args.tailer_password.into(),
        admin: args.admin_password.into(),
        root: args.root_password.into(),
    };
    let etcd = &args.etcd;
    let client = rbac::connect_for_setup(&etcd.etcd_endpoints, &passwords.root, etcd.options()?)
        .await
        .with_context(|| format!("connecting to etcd at {}", etcd.endpoints()))?;
    let changes = rbac::enable(&client, &passwords, etcd.etcd_timeout).await?;
    if changes.is_empty() {
        println!(
            "etcd at {} already has lockcell's roles and users and authentication on; nothing changed",
            etcd.endpoints()
        );
    }
    for change in &changes {
        println!("{change}");
    }
    Ok(())
}

/// How often the audit process checks that etcd answers (for `/readyz`).
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

async fn audit(args: AuditArgs) -> anyhow::Result<()> {
    if args.grants.is_some() && args.tls_cert.is_none() && !args.grants_without_tls {
        anyhow::bail!(
            "--grants without --tls-cert and --tls-key would take bearer tokens in clear; \
             serve TLS, or pass --grants-without-tls on a test bench"
        );
    }
    if let Some(file) = &args.admin_token_file {
        lockcell_cell::access::read_admin_token(file)?;
    }
    if let Some(file) = &args.grants {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading the grants file {}", file.display()))?;
        lockcell_cell::grants::Rules::parse(&text).map_err(|e| {
            anyhow::anyhow!(
                "the grants file {}{}: {}",
                file.display(),
                e.line.map(|l| format!(" line {l}")).unwrap_or_default(),
                e.message
            )
        })?;
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating the data folder {}", args.data_dir.display()))?;
    let _only_tailer = lock_data_dir(&args.data_dir)?;
    let store_spec = args
        .store
        .clone()
        .unwrap_or_else(|| args.data_dir.join("audit.db").display().to_string());
    let store = Store::open(&store_spec).await?;
    let archive_spec = (!args.no_archive).then(|| {
        args.archive
            .clone()
            .unwrap_or_else(|| args.data_dir.join("archive").display().to_string())
    });
    let archive_options = ArchiveOptions {
        endpoint: args.s3_endpoint.clone(),
        region: args.s3_region.clone(),
        access_key_id: args.s3_access_key_id.clone(),
        secret_access_key: args.s3_secret_access_key.clone(),
        ..ArchiveOptions::default()
    };
    let mut archive = match &archive_spec {
        Some(spec) => Some(Archive::open(spec, archive_options.clone()).await?),
        None => None,
    };
    // The retention sweep's own handle (the tailer writes through the other).
    let expiring = match &archive_spec {
        Some(spec) => Some(Archive::open(spec, archive_options).await?),
        None => None,
    };
    if args.action == AuditAction::Rebuild {
        let Some(archive) = &archive else {
            anyhow::bail!(
                "`audit rebuild` needs the archive; --no-archive leaves nothing to rebuild from"
            );
        };
        rebuild(&store, archive, args.force).await?;
    }

    // etcd latency as a histogram, with the proxies' buckets: one query for both.
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(
                lockcell_cell::error::ETCD_REQUEST_SECONDS.to_owned(),
            ),
            lockcell_cell::error::ETCD_BUCKETS,
        )?
        .install_recorder()
        .context("installing the metrics recorder")?;
    let stats = Arc::new(TailerStats::default());
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let etcd_timeout = args.etcd.address.etcd_timeout;
    let readiness = Arc::new(http::Readiness::new(PROBE_INTERVAL, etcd_timeout));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the audit HTTP address {}", args.listen))?;
    let store = Arc::new(store);
    let served = http::Audit {
        metrics: prometheus,
        store: store.clone(),
        stats: stats.clone(),
        readiness: readiness.clone(),
        stop: stop_tx.clone(),
        access: Arc::new(http::Access {
            grants: args.grants.clone(),
            admin_token: args.admin_token_file.clone(),
        }),
    };
    let server = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => tokio::spawn(http::serve(
            http::TlsListener::new(listener, cert, key)?,
            served,
        )),
        _ => tokio::spawn(http::serve(listener, served)),
    };
    let housekeeping = tokio::spawn(housekeeping(
        store.clone(),
        expiring,
        args.keep_days,
        stats.clone(),
    ));
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let etcd = args.etcd.connect().await?;
    tokio::spawn(http::probe(
        etcd.clone(),
        (readiness.clone(), stats.clone()),
        PROBE_INTERVAL,
        etcd_timeout,
        stop.clone(),
    ));
    let options = TailerOptions {
        segment_events: args.segment_events,
        segment_age: args.segment_age,
        etcd_timeout: args.etcd.address.etcd_timeout,
        ..TailerOptions::default()
    };
    tracing::info!(listen = %args.listen, "lockcell-cell audit ready");
    let result = tokio::select! {
        result = tailer::run(etcd, &store, archive.as_mut(), &options, stats.clone(), stop) => {
            result.map_err(Into::into)
        }
        stuck = watchdog(&readiness, &stats, args.give_up_after) => Err(stuck),
    };
    housekeeping.abort();
    server.abort();
    result
}

/// Holds `DATA_DIR/audit.lock` for as long as it lives: one tailer per data folder. A
/// second one would write the same revisions into the same store and archive.
fn lock_data_dir(dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    let path = dir.join("audit.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "another audit tailer runs on the data folder {} (it holds {}): one tailer per data folder; stop that one first, or give this one its own --data-dir",
            dir.display(),
            path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}

/// Returns (an error saying why) once the tailer has not followed its cell for
/// `give_up`: etcd unanswered that long, or the store moving while the trail does not.
async fn watchdog(
    readiness: &http::Readiness,
    stats: &TailerStats,
    give_up: Duration,
) -> anyhow::Error {
    let started = tokio::time::Instant::now();
    let mut trail = (stats.checkpoint.load(Ordering::Relaxed), started);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = tokio::time::Instant::now();
        let unanswered = readiness
            .since_answer()
            .unwrap_or_else(|| now.duration_since(started));
        if unanswered >= give_up {
            return anyhow::anyhow!(
                "etcd has not answered for {}; the audit tailer exits so that its supervisor starts it again (--give-up-after)",
                humantime::format_duration(give_up)
            );
        }
        let checkpoint = stats.checkpoint.load(Ordering::Relaxed);
        if checkpoint != trail.0 || stats.lag() == 0 {
            trail = (checkpoint, now);
        } else if now.duration_since(trail.1) >= give_up {
            return anyhow::anyhow!(
                "the audit trail has stayed at revision {checkpoint} for {} while etcd is at revision {}: the tailer's watch does not follow the cell; exiting so that its supervisor starts it again (--give-up-after)",
                humantime::format_duration(give_up),
                stats.head.load(Ordering::Relaxed)
            );
        }
    }
}

/// Empties the store and loads every archived event into it, a few revisions at a time.
/// Refuses an archive with overlapping or missing segments unless `force`.
async fn rebuild(store: &Store, archive: &Archive, force: bool) -> anyhow::Result<()> {
    let (events, problems) = archive.read_all_checked().await?;
    if !problems.is_empty() {
        let mut listed = problems[..problems.len().min(5)].join("; ");
        if problems.len() > 5 {
            listed.push_str(&format!("; and {} more", problems.len() - 5));
        }
        if !force {
            anyhow::bail!(
                "the archive {} is not one unbroken run of segments: {listed}. Overlapping segments mean two tailers wrote the same revisions (their events may differ, and a rebuild keeps only one of each); missing ones, revisions no segment holds. Nothing was rebuilt: look at the segments named, or pass --force to rebuild anyway",
                archive.describe()
            );
        }
        tracing::warn!(archive = %archive.describe(), problems = %listed, "--force: rebuilding from an archive with overlapping or missing segments");
    }
    store.clear().await?;
    let mut start = 0;
    while start < events.len() {
        // Whole revisions per write.
        let mut end = (start + 10_000).min(events.len());
        while end < events.len() && events[end].revision == events[end - 1].revision {
            end += 1;
        }
        store.write(&events[start..end]).await?;
        start = end;
    }
    tracing::info!(
        events = events.len(),
        through = events.last().map(|e| e.revision).unwrap_or_default(),
        store = %store.describe(),
        archive = %archive.describe(),
        "rebuilt the audit store from the archive; the tailer goes on from there"
    );
    Ok(())
}

/// Drops what the retention rules no longer keep (hourly), and publishes the tailer's
/// figures as metrics (every second).
async fn housekeeping(
    store: Arc<Store>,
    archive: Option<Archive>,
    keep_days: u32,
    stats: Arc<TailerStats>,
) {
    let mut last_expiry: Option<tokio::time::Instant> = None;
    loop {
        if last_expiry.is_none_or(|t| t.elapsed() >= Duration::from_secs(3600)) {
            last_expiry = Some(tokio::time::Instant::now());
            let now = now_ms();
            match store.expire(keep_days, now).await {
                Ok(n) => tracing::info!(removed = n, keep_days, "audit store retention"),
                Err(e) => tracing::warn!(error = %e, "audit store retention failed"),
            }
            if let Some(archive) = &archive {
                match archive.expire(now).await {
                    Ok(n) => tracing::info!(segments = n, "audit archive retention"),
                    Err(e) => tracing::warn!(error = %e, "audit archive retention failed"),
                }
            }
        }
        metrics::gauge!("lockcell_audit_lag_revisions").set(stats.lag() as f64);
        metrics::gauge!("lockcell_audit_checkpoint_revision")
            .set(stats.checkpoint.load(Ordering::Relaxed) as f64);
        metrics::counter!("lockcell_audit_events_total")
            .absolute(stats.events.load(Ordering::Relaxed));
        metrics::counter!("lockcell_audit_gap_revisions_total")
            .absolute(stats.gap_revisions.load(Ordering::Relaxed));
        metrics::counter!("lockcell_audit_write_failures_total")
            .absolute(stats.write_failures.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::Path;

    use clap::CommandFactory;

    use super::*;

    fn config_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config")
    }

    #[test]
    fn the_configuration_reference_is_up_to_date() {
        let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
        lockcell_settings::check_reference(&doc, &Cli::command()).unwrap();
    }

    fn load(args: &[&str]) -> Cli {
        let file = config_dir().join("cell.toml");
        let args = ["lockcell-cell", "--config", file.to_str().unwrap()]
            .iter()
            .chain(args)
            .map(OsString::from)
            .collect();
        lockcell_settings::load::<Cli>(args).unwrap().config
    }

    #[test]
    fn the_example_file_configures_the_tailer_and_the_admin_commands() {
        let Command::Audit(audit) = load(&["audit"]).command else {
            panic!("audit")
        };
        assert_eq!(audit.etcd.address.etcd_endpoints.len(), 3);
        assert_eq!(audit.etcd.etcd_user.as_deref(), Some("lockcell-tailer"));
        assert_eq!(audit.listen.port(), 7431);
        assert_eq!(audit.keep_days, 90);
        // The same file serves init, as lockcell-admin.
        let Command::Init(init) = load(&["init"]).command else {
            panic!("init")
        };
        assert_eq!(init.address.etcd_endpoints.len(), 3);
        assert_eq!(init.etcd_user.as_deref(), Some("lockcell-admin"));
        // A flag still wins.
        let Command::Init(init) = load(&["init", "--etcd-user", "root"]).command else {
            panic!("init")
        };
        assert_eq!(init.etcd_user.as_deref(), Some("root"));
    }
}
