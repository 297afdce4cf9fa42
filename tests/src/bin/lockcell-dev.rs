//! `lockcell-dev`: a local three-zone cell for development (what `make dev` runs).
//!
//! Starts one etcd member and one proxy per zone on loopback, with etcd authentication
//! on as in production (fresh random passwords each start, in `<dir>/etcd-users`, which
//! only its owner can read), the proxies serving TLS with certificates from a private CA
//! made at each start (`<dir>/tls/`) and checking prefix grants (`<dir>/grants.toml`:
//! the identity `dev`, known by a bearer token made at each start, may do everything),
//! writes `<dir>/endpoints` (`KIND ZONE ADDR` lines) and `<dir>/env` (the variables lockctl
//! needs, for a shell to source), prints a ready-to-paste `lockctl`
//! example, and on Ctrl-C or SIGTERM stops everything it started.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use lockcell_cell::rbac::{self, Passwords};
use lockcell_tests::audit::AuditProcess;
use lockcell_tests::certs::Authority;
use lockcell_tests::etcd::EtcdOptions;
use lockcell_tests::{bins, EtcdCluster, ProxyOptions, ProxyProcess};

/// Runs a local lockcell cell: etcd members and proxies, one per zone, on loopback.
///
/// Everything lives under --dir (data, logs and the `endpoints` file) and is stopped on
/// Ctrl-C or SIGTERM. Each start is a fresh cell: old etcd data in --dir is removed.
#[derive(Debug, Parser)]
#[command(name = "lockcell-dev", version, about, long_about)]
struct Args {
    /// Folder for etcd data, logs and the endpoints file.
    #[arg(long, default_value = ".lockcell-dev")]
    dir: PathBuf,
    /// How many zones (one etcd member and one proxy each), named a, b, c...
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=5))]
    zones: u8,
    /// TTL of each proxy's etcd leases (whole seconds).
    #[arg(long, default_value = "12s", value_parser = humantime_secs)]
    lease_ttl: Duration,
}

fn humantime_secs(s: &str) -> Result<Duration, String> {
    let secs = s.strip_suffix('s').unwrap_or(s);
    secs.parse::<u64>()
        .ok()
        .filter(|n| *n > 0)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{s:?} is not a whole number of seconds, e.g. 12s"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args.dir.canonicalize()?;
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("etcd-") && path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        }
    }
    let endpoints_file = dir.join("endpoints");
    let _ = std::fs::remove_file(&endpoints_file);

    let zones = args.zones as usize;
    eprintln!(
        "lockcell-dev: starting {zones} etcd members in {}",
        dir.display()
    );
    let passwords = Passwords {
        proxy: random_password(),
        tailer: random_password(),
        admin: random_password(),
        root: random_password(),
    };
    let users_file = dir.join("etcd-users");
    write_users(&users_file, &passwords)?;
    let tailer_password = passwords.tailer.clone();
    let etcd_options = EtcdOptions {
        auth: Some(passwords),
        ..EtcdOptions::default()
    };
    let mut etcd = EtcdCluster::start_in_with(&dir, zones, &etcd_options).await?;
    let ca = Authority::new(&dir.join("tls"))?;
    let server = ca.server("proxy")?;
    let token = random_password();
    let grants = dir.join("grants.toml");
    std::fs::write(&grants, dev_grants(&token))?;
    let mut proxies = Vec::new();
    let mut etcd_apis = Vec::new();
    for member in &etcd.members {
        let mut options = ProxyOptions::new(&member.name, etcd.endpoints());
        options.etcd_auth = etcd.proxy_auth();
        let etcd_api = format!("127.0.0.1:{}", lockcell_tests::ports::free_port());
        options.extra_args = vec![
            "--tls-cert".into(),
            server.cert.display().to_string(),
            "--tls-key".into(),
            server.key.display().to_string(),
            "--grants".into(),
            grants.display().to_string(),
            "--etcd-listen".into(),
            etcd_api.clone(),
            // The proxies forward calls on each other's leases, over TLS.
            "--etcd-peer-ca".into(),
            ca.ca.display().to_string(),
        ];
        etcd_apis.push(etcd_api);
        options.lease_ttl = args.lease_ttl;
        options.session_ttl_min = Duration::from_secs(1);
        proxies.push(ProxyProcess::start(&options, &dir).await?);
    }

    // The audit tailer, serving `lockctl audit` over TLS to the dev identity.
    let tailer_args: Vec<String> = vec![
        "--grants".into(),
        grants.display().to_string(),
        "--tls-cert".into(),
        server.cert.display().to_string(),
        "--tls-key".into(),
        server.key.display().to_string(),
    ];
    let mut tailer = AuditProcess::start_as(
        "run",
        &etcd.endpoints(),
        (&dir.join("audit"), &dir.join("audit.log")),
        &tailer_args,
        &tailer_password,
    )
    .await?;
    let audit_url = format!("https://{}", tailer.addr);

    let mut listing = String::new();
    for ((member, proxy), etcd_api) in etcd.members.iter().zip(&proxies).zip(&etcd_apis) {
        writeln!(listing, "etcd {} {}", member.name, member.client_addr)?;
        writeln!(listing, "proxy {} {}", proxy.zone, proxy.addr)?;
        writeln!(listing, "admin {} {}", proxy.zone, proxy.admin_addr)?;
        writeln!(listing, "etcd-api {} {}", proxy.zone, etcd_api)?;
    }
    std::fs::write(&endpoints_file, &listing)?;

    let lockctl = bins::bin_dir()?.join("lockctl");
    // What a shell needs for lockctl and the client guide's examples.
    let env_file = dir.join("env");
    let ca_file = std::path::absolute(&ca.ca)?;
    let bin_dir = std::path::absolute(bins::bin_dir()?)?;
    let all_proxies: Vec<&str> = proxies.iter().map(|p| p.addr.as_str()).collect();
    write_private(
        &env_file,
        &format!(
            "# The lockcell dev cell, for a shell: `. {env}`\n\
             export LOCKCELL_PROXY={all}\n\
             export LOCKCELL_TLS_CA={ca}\n\
             export LOCKCELL_AUTH_TOKEN={token}\n\
             export LOCKCELL_AUDIT={audit}\n\
             export PATH={bin}:\"$PATH\"\n",
            env = env_file.display(),
            all = shell_quote(&all_proxies.join(",")),
            ca = shell_quote(&ca_file.display().to_string()),
            audit = shell_quote(&audit_url),
            bin = shell_quote(&bin_dir.display().to_string()),
        ),
    )?;
    println!(
        "lockcell dev cell is up: {zones} etcd members, {zones} proxies (logs in {})",
        dir.display()
    );
    for proxy in &proxies {
        println!(
            "  zone {}: proxy {}  metrics http://{}/metrics",
            proxy.zone, proxy.addr, proxy.admin_addr
        );
    }
    println!(
        "  audit tailer: {audit_url} (`lockctl audit NAME` asks it; data in {})",
        dir.join("audit").display()
    );
    println!("Endpoints are listed in {}.", endpoints_file.display());
    println!(
        "etcd runs with authentication on; its users and passwords (root for etcdctl --user) are in {}.",
        users_file.display()
    );
    println!(
        "The proxies serve TLS (CA: {}) and check the prefix grants in {}; the identity dev may do everything, with the token below.",
        ca.ca.display(),
        grants.display()
    );
    println!(
        "In another terminal, `. {}` sets LOCKCELL_PROXY (the three proxies), LOCKCELL_TLS_CA, LOCKCELL_AUTH_TOKEN and LOCKCELL_AUDIT and puts lockctl on PATH: every lockctl line of docs/client-guide.md then runs as written.",
        env_file.display()
    );
    println!(
        "The proxies also speak etcd's v3 API (docs/etcd-api.md); with etcdctl (the etcd-client package), log in as dev with the token:"
    );
    println!(
        "etcdctl --endpoints https://{} --cacert {} --user dev --password {token} put hello-etcd world",
        etcd_apis[0],
        ca.ca.display(),
    );
    println!("Or try, in another terminal:");
    println!(
        "LOCKCELL_TLS_CA={} LOCKCELL_AUTH_TOKEN={token} {} --proxy {} lock demo -- sh -c 'echo \"holding $LOCKCELL_LOCK with token $LOCKCELL_TOKEN\"; sleep 1'",
        ca.ca.display(),
        lockctl.display(),
        proxies[0].addr
    );
    println!("Ctrl-C stops everything.");

    wait_for_stop(&mut proxies, &mut etcd).await;
    eprintln!("lockcell-dev: stopping");
    // A proxy waits out the validity it granted to lock holders (at most its lease
    // TTL) before it revokes its leases and exits.
    // All are told at once, so their waits overlap.
    for proxy in &proxies {
        let _ = proxy.signal(nix::sys::signal::Signal::SIGTERM);
    }
    let _ = tailer.process.signal(nix::sys::signal::Signal::SIGTERM);
    for proxy in proxies.iter_mut() {
        proxy.process.stop(args.lease_ttl + Duration::from_secs(5));
    }
    tailer.process.stop(Duration::from_secs(10));
    for member in etcd.members.iter_mut() {
        member.process.stop(Duration::from_secs(10));
    }
    let _ = std::fs::remove_file(&endpoints_file);
    let _ = std::fs::remove_file(&users_file);
    let _ = std::fs::remove_file(&env_file);
    eprintln!("lockcell-dev: stopped");
    Ok(())
}

/// A password for one start of the dev cell.
/// The dev cell's grants: the identity `dev`, known by `token`, may do everything.
fn dev_grants(token: &str) -> String {
    let hash = lockcell_tests::certs::token_sha256(token);
    format!(
        "# The dev cell's prefix grants (see deploy/config/grants.toml), made at each start.\n\
         [[grant]]\nidentity = \"dev\"\nlock = [\"\"]\nread = [\"\"]\nwrite = [\"\"]\nwatch = [\"\"]\n\n\
         [[token]]\nidentity = \"dev\"\nsha256 = \"{hash}\"\n"
    )
}

fn random_password() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// `value` as one shell word, whatever it holds (a checkout path with spaces).
fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "'\\''"))
}

/// A new file at `path` (replacing any), readable by its owner only.
fn create_private(path: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let _ = std::fs::remove_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))
}

/// Writes `text` to `path`, readable by its owner only (it holds the token).
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    create_private(path)?
        .write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes `USER PASSWORD` lines to `path`, readable by its owner only.
fn write_users(path: &Path, passwords: &Passwords) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut file = create_private(path)?;
    for user in [
        rbac::ROOT_USER,
        rbac::PROXY_USER,
        rbac::TAILER_USER,
        rbac::ADMIN_USER,
    ] {
        if let Some(c) = passwords.credentials(user) {
            writeln!(file, "{} {}", c.user, c.password)?;
        }
    }
    Ok(())
}

/// Waits for Ctrl-C or SIGTERM, reporting any process that dies meanwhile.
async fn wait_for_stop(proxies: &mut [ProxyProcess], etcd: &mut EtcdCluster) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut reported = std::collections::HashSet::new();
    let mut check = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return,
            _ = term.recv() => return,
            _ = check.tick() => {}
        }
        let processes = proxies
            .iter_mut()
            .map(|p| &mut p.process)
            .chain(etcd.members.iter_mut().map(|m| &mut m.process));
        for process in processes {
            if !process.is_running() && reported.insert(process.name.clone()) {
                eprintln!(
                    "lockcell-dev: {} exited; its log: {}",
                    process.name,
                    process.log.display()
                );
            }
        }
    }
}
