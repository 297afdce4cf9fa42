//! `status` (how the cell stands) and `force-release` (end a stuck holder's session).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use etcd_client::GetOptions;
use lockcell_cell::error::with_timeout;
use lockcell_cell::forced::ForceRelease;
use lockcell_cell::keyspace::{self, LockName, Mode};
use lockcell_cell::locklog::HolderRecord;
use lockcell_cell::presence::{self, Presence};
use lockcell_cell::{epoch, shardmap};

use crate::EtcdArgs;

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,

    /// An audit tailer of the cell to ask for its lag (its --listen address, e.g.
    /// https://cell-1:7431); several separated by commas.
    #[arg(long, env = "LOCKCELL_AUDIT", value_delimiter = ',')]
    pub tailer: Vec<String>,

    /// The CA certificate (PEM) that signed the tailers' TLS certificates.
    #[arg(long, env = "LOCKCELL_TLS_CA")]
    pub tailer_ca: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ForceReleaseArgs {
    /// The lock (or election) whose hold to force off.
    pub name: String,

    #[command(flatten)]
    pub etcd: EtcdArgs,

    /// The hold's fencing token, EPOCH:REVISION, as `lockctl who NAME` or the audit
    /// trail shows it: the command ends exactly that hold, never a later grant.
    #[arg(long)]
    pub token: String,

    /// Why, for the audit trail (and the holder, which is told its session was ended
    /// by an operator and why).
    #[arg(long)]
    pub reason: String,

    /// Who is forcing it, for the audit trail (default: USER@HOST).
    #[arg(long)]
    pub operator: Option<String>,

    /// The hold's mode.
    #[arg(long, value_enum, default_value = "exclusive")]
    pub mode: ModeArg,

    /// How long to wait for the holder's keys to go (its validity runs out first).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub wait: Duration,

    /// The admin token of the proxies (their --admin-token-file), when they have one;
    /// without it only a proxy on this host answers.
    #[arg(long, env = "LOCKCELL_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ModeArg {
    Exclusive,
    Shared,
}

/// Prints how the cell stands; fails (after printing everything) when something needs
/// a look: an etcd member or a proxy that does not answer or is not ready, a tailer
/// behind.
pub async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let etcd = &args.etcd;
    let timeout = etcd.address.etcd_timeout;
    let mut problems: Vec<String> = Vec::new();
    let (client, stored) = first_answering(etcd, &mut problems).await?;
    match stored {
        Some(stored) => println!(
            "cell: cluster {} epoch {} (written at revision {})",
            stored.record.cluster_id, stored.record.epoch, stored.mod_revision
        ),
        None => problems.push("the cell has no epoch record: run `lockcell-cell init`".into()),
    }
    match shardmap::read(&mut client.kv_client(), timeout).await? {
        Some(stored) => {
            let paused: Vec<&str> = stored
                .map
                .routes
                .iter()
                .filter(|r| r.paused)
                .map(|r| r.prefix.as_str())
                .collect();
            println!(
                "shard map: version {}, {} cells, {} routes{}",
                stored.map.version,
                stored.map.cells.len(),
                stored.map.routes.len(),
                if paused.is_empty() {
                    String::new()
                } else {
                    format!(", paused (a move under way): {paused:?}")
                }
            );
        }
        None => println!("shard map: none (the cell serves every name)"),
    }

    members(&client, etcd, &mut problems).await?;

    let leases = with_timeout("list leases", timeout, client.lease_client().leases()).await?;
    println!("etcd leases: {}", leases.leases().len());

    let recorded = presence::recorded(&mut client.kv_client(), timeout).await?;
    println!("proxies: {}", recorded.len());
    let http = http_client(args.tailer_ca.as_ref())?;
    for proxy in &recorded {
        let p = &proxy.presence;
        let up = since(p.started_ms);
        let ready = match admin_url(p) {
            Some(base) => match get(&http, &format!("{base}/readyz"), timeout).await {
                Ok((status, body)) => {
                    if status != 200 {
                        problems.push(format!("proxy {} is not ready", p.proxy_id));
                    }
                    format!(
                        "{}: {}",
                        if status == 200 { "ready" } else { "NOT READY" },
                        body.lines().collect::<Vec<_>>().join(", ")
                    )
                }
                Err(e) => {
                    problems.push(format!("proxy {}'s admin port does not answer", p.proxy_id));
                    format!("admin port does not answer: {e:#}")
                }
            },
            None => format!("admin port {} not reachable from here", p.admin),
        };
        println!(
            "  {} zone {} version {} at {} (admin {}), up {up}; {ready}",
            p.proxy_id, p.zone, p.version, p.listen, p.admin
        );
    }

    for tailer in &args.tailer {
        let base = tailer.trim_end_matches('/');
        match get(&http, &format!("{base}/metrics"), timeout).await {
            Ok((_, body)) => {
                let lag = metric(&body, "lockcell_audit_lag_revisions");
                let checkpoint = metric(&body, "lockcell_audit_checkpoint_revision");
                println!(
                    "audit tailer {base}: complete up to revision {}, {} revisions behind",
                    checkpoint.map_or("?".into(), |c| format!("{c:.0}")),
                    lag.map_or("?".into(), |l| format!("{l:.0}"))
                );
                if lag.is_some_and(|l| l > 1000.0) {
                    problems.push(format!("audit tailer {base} is behind"));
                }
            }
            Err(e) => {
                println!("audit tailer {base}: does not answer: {e:#}");
                problems.push(format!("audit tailer {base} does not answer"));
            }
        }
    }

    if problems.is_empty() {
        println!("everything answers");
        Ok(())
    } else {
        bail!("{}", problems.join("; "))
    }
}

/// A client of the first of the cell's endpoints that answers, and the epoch record it
/// read; an endpoint that does not answer is a problem, not the end of the report.
async fn first_answering(
    etcd: &EtcdArgs,
    problems: &mut Vec<String>,
) -> anyhow::Result<(etcd_client::Client, Option<epoch::Stored>)> {
    let timeout = etcd.address.etcd_timeout;
    let mut failures = Vec::new();
    for endpoint in &etcd.address.etcd_endpoints {
        let read = async {
            let client = etcd.connect_to(std::slice::from_ref(endpoint)).await?;
            let stored = epoch::read(&mut client.kv_client(), timeout).await?;
            anyhow::Ok((client, stored))
        };
        match tokio::time::timeout(timeout, read).await {
            Ok(Ok(found)) => {
                if !failures.is_empty() {
                    problems.push(format!(
                        "etcd endpoint(s) {} do not answer",
                        failures.join(", ")
                    ));
                }
                return Ok(found);
            }
            Ok(Err(e)) => {
                eprintln!("lockcell-cell: etcd at {endpoint} does not answer: {e:#}");
                failures.push(endpoint.clone());
            }
            Err(_) => {
                eprintln!("lockcell-cell: etcd at {endpoint}: no answer in {timeout:?}");
                failures.push(endpoint.clone());
            }
        }
    }
    bail!(
        "no etcd endpoint of the cell answers ({})",
        failures.join(", ")
    )
}

/// One line per etcd member: its version, database size and whether it leads.
async fn members(
    client: &etcd_client::Client,
    etcd: &EtcdArgs,
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    let timeout = etcd.address.etcd_timeout;
    let list = with_timeout(
        "list etcd members",
        timeout,
        client.cluster_client().member_list(),
    )
    .await?;
    println!("etcd members: {}", list.members().len());
    for member in list.members() {
        let Some(url) = member.client_urls().first() else {
            println!(
                "  {} (id {:x}): not started yet",
                member.name(),
                member.id()
            );
            continue;
        };
        let status = async {
            let one = etcd.connect_to(std::slice::from_ref(url)).await?;
            anyhow::Ok(
                with_timeout("member status", timeout, one.maintenance_client().status()).await?,
            )
        };
        match tokio::time::timeout(timeout, status).await {
            Ok(Ok(s)) => println!(
                "  {} {url}: etcd {}, db {} (in use {}), raft index {}{}",
                member.name(),
                s.version(),
                bytes(s.db_size()),
                bytes(s.raft_used_db_size()),
                s.raft_index(),
                if s.leader() == member.id() {
                    ", leader"
                } else {
                    ""
                }
            ),
            Ok(Err(e)) => {
                println!("  {} {url}: does not answer: {e:#}", member.name());
                problems.push(format!("etcd member {} does not answer", member.name()));
            }
            Err(_) => {
                println!("  {} {url}: no answer in {timeout:?}", member.name());
                problems.push(format!("etcd member {} does not answer", member.name()));
            }
        }
    }
    Ok(())
}

/// Ends the session that holds NAME with the token given, on the proxy it is on, and
/// waits until its keys are gone.
pub async fn force_release(args: ForceReleaseArgs) -> anyhow::Result<()> {
    let lock = LockName::parse(&args.name)
        .with_context(|| format!("{:?} is not a lock name", args.name))?;
    let (token_epoch, revision) = parse_token(&args.token)?;
    let mode = match args.mode {
        ModeArg::Exclusive => Mode::Exclusive,
        ModeArg::Shared => Mode::Shared,
    };
    let etcd = &args.etcd;
    let timeout = etcd.address.etcd_timeout;
    let client = etcd.connect().await?;
    let mut kv = client.kv_client();
    let Some(stored) = epoch::read(&mut kv, timeout).await? else {
        bail!("the cell has no epoch record: nothing was ever granted in it");
    };
    if stored.record.epoch != token_epoch {
        bail!(
            "token {} is of epoch {token_epoch}, and the cell is at epoch {}: no hold of that epoch stands; nothing done",
            args.token,
            stored.record.epoch
        );
    }
    let held = holders(&mut kv, &lock, mode, timeout).await?;
    let Some((key, holder, lease)) = held
        .iter()
        .find(|(_, _, l)| l.0 == revision)
        .map(|(k, h, l)| (k.clone(), h.clone(), l.1))
    else {
        let now: Vec<String> = held
            .iter()
            .map(|(_, h, (rev, _))| {
                format!("{}:{rev} (identity {:?})", stored.record.epoch, h.identity)
            })
            .collect();
        bail!(
            "{} has no {} hold with token {}; nothing done. Its {} holds now: {}",
            lock.as_str(),
            mode_name(mode),
            args.token,
            mode_name(mode),
            if now.is_empty() {
                "none".into()
            } else {
                now.join(", ")
            }
        );
    };
    let operator = args.operator.clone().unwrap_or_else(default_operator);
    let record = ForceRelease {
        lock: lock.as_str().to_owned(),
        mode: mode_name(mode).to_owned(),
        token: args.token.clone(),
        session: holder.session.clone(),
        holder: holder.identity.clone(),
        proxy: holder.proxy.clone(),
        operator: operator.clone(),
        reason: args.reason.clone(),
        at_ms: chrono::Utc::now().timestamp_millis().max(0) as u64,
    };
    // Written first: whatever happens next, the trail says who tried and why.
    with_timeout(
        "write the force-release record",
        timeout,
        kv.put(
            keyspace::force_release_key(),
            serde_json::to_vec(&record).expect("record serializes"),
            None,
        ),
    )
    .await?;
    eprintln!(
        "lockcell-cell: forcing off {} hold {} of {:?}: session {} (identity {:?}, granted by proxy {}, on etcd lease {lease:x})",
        mode_name(mode),
        args.token,
        lock.as_str(),
        holder.session,
        holder.identity,
        holder.proxy
    );

    let token = match &args.admin_token_file {
        Some(file) => Some(lockcell_cell::access::read_admin_token(file)?),
        None => None,
    };
    let http = http_client(None)?;
    let deadline = tokio::time::Instant::now() + args.wait;
    let mut ended_on: Option<String> = None;
    let mut asked_at_lease = None;
    loop {
        // The key as it is now: gone (done), or still there (its session maybe moved
        // to another proxy since it was asked).
        let now = with_timeout("read the hold", timeout, kv.get(key.as_bytes(), None)).await?;
        let current = now
            .kvs()
            .first()
            .filter(|k| k.create_revision() == revision);
        let Some(current) = current else {
            match &ended_on {
                Some(proxy) => println!(
                    "released {} hold {} of {}: the session of {:?} was ended on proxy {proxy}; it has been told so, and its keys are gone",
                    mode_name(mode),
                    args.token,
                    lock.as_str(),
                    holder.identity,
                ),
                None => println!(
                    "the {} hold {} of {} ended by itself (released or expired) before its session was ended; nothing ended",
                    mode_name(mode),
                    args.token,
                    lock.as_str(),
                ),
            }
            return Ok(());
        };
        if asked_at_lease != Some(current.lease()) {
            asked_at_lease = Some(current.lease());
            let ended = end_session(
                &http,
                &mut kv,
                &holder.session,
                &record,
                token.as_deref(),
                timeout,
            )
            .await;
            match ended {
                Ok(proxy) => ended_on = Some(proxy),
                // The holder let go meanwhile (the proxies found no such hold): the
                // next look says so.
                Err(_)
                    if ended_on.is_none()
                        && !still_held(&mut kv, &key, revision, timeout).await? =>
                {
                    continue
                }
                Err(e) => return Err(e),
            }
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "the hold {} of {} still stands after {:?}: its session was ended on proxy {}, and its keys go when the validity it was granted runs out (the proxy's log says when); run the command again to wait longer",
                args.token,
                lock.as_str(),
                args.wait,
                ended_on.unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether the hold's key `key` is still the grant made at `revision`.
async fn still_held(
    kv: &mut etcd_client::KvClient,
    key: &str,
    revision: i64,
    timeout: Duration,
) -> anyhow::Result<bool> {
    let now = with_timeout("read the hold", timeout, kv.get(key.as_bytes(), None)).await?;
    Ok(now
        .kvs()
        .first()
        .is_some_and(|k| k.create_revision() == revision))
}

/// Asks every running proxy to end `session`; returns the id of the one that had it.
async fn end_session(
    http: &reqwest::Client,
    kv: &mut etcd_client::KvClient,
    session: &str,
    record: &ForceRelease,
    token: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<String> {
    let proxies = presence::recorded(kv, timeout).await?;
    let mut asked = Vec::new();
    for proxy in &proxies {
        let p = &proxy.presence;
        let Some(base) = admin_url(p) else {
            asked.push(format!(
                "{} (admin port {} not reachable from here)",
                p.proxy_id, p.admin
            ));
            continue;
        };
        let reason = format!(
            "{} (by {}, token {})",
            record.reason, record.operator, record.token
        );
        let url = reqwest::Url::parse_with_params(
            &format!("{base}/sessions/end"),
            [
                ("session", session),
                ("lock", record.lock.as_str()),
                ("token", record.token.as_str()),
                ("reason", reason.as_str()),
            ],
        )?;
        let mut call = http.post(url).timeout(timeout);
        if let Some(token) = token {
            call = call.bearer_auth(token);
        }
        match call.send().await {
            Ok(resp) if resp.status().is_success() => {
                let body = resp.text().await.unwrap_or_default();
                eprintln!(
                    "lockcell-cell: proxy {} ended the session: {}",
                    p.proxy_id,
                    body.trim()
                );
                if body.contains("\"fenced\":false") {
                    eprintln!("lockcell-cell: warning: proxy {} could not fence the session in etcd (its log says why): a resume on another proxy could keep it; this command follows it there while it waits", p.proxy_id);
                }
                return Ok(p.proxy_id.clone());
            }
            Ok(resp) if resp.status() == reqwest::StatusCode::NOT_FOUND => {
                asked.push(format!("{} (not there)", p.proxy_id));
            }
            Ok(resp) => {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                asked.push(format!("{} ({status}: {})", p.proxy_id, body.trim()));
            }
            Err(e) => asked.push(format!("{} (no answer: {e})", p.proxy_id)),
        }
    }
    bail!(
        "no running proxy ended session {session}; asked: {}. A session on no proxy goes with its proxy's etcd lease, and its keys with it",
        if asked.is_empty() { "none (no presence records)".into() } else { asked.join(", ") }
    )
}

/// The holder keys of `lock` in `mode`: key, record, (create revision, lease).
async fn holders(
    kv: &mut etcd_client::KvClient,
    lock: &LockName,
    mode: Mode,
    timeout: Duration,
) -> anyhow::Result<Vec<(String, HolderRecord, (i64, i64))>> {
    let (key, options) = match mode {
        Mode::Exclusive => (lock.exclusive_key(), None),
        Mode::Shared => (lock.shared_prefix(), Some(GetOptions::new().with_prefix())),
    };
    let resp = with_timeout("read holders", timeout, kv.get(key, options)).await?;
    Ok(resp
        .kvs()
        .iter()
        .map(|k| {
            (
                String::from_utf8_lossy(k.key()).into_owned(),
                serde_json::from_slice(k.value()).unwrap_or_default(),
                (k.create_revision(), k.lease()),
            )
        })
        .collect())
}

fn parse_token(token: &str) -> anyhow::Result<(u64, i64)> {
    let parsed = token
        .split_once(':')
        .and_then(|(e, r)| Some((e.parse().ok()?, r.parse().ok()?)));
    parsed.with_context(|| {
        format!("--token {token:?} is not a fencing token EPOCH:REVISION (e.g. 1796000000:5130)")
    })
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "exclusive",
        Mode::Shared => "shared",
    }
}

/// Who runs this command, for the audit trail: USER@HOST.
pub fn default_operator() -> String {
    let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    format!("{user}@{host}")
}

/// Where a proxy's admin port answers, when its record says: an address it listens on
/// for every interface names no host to call.
fn admin_url(p: &Presence) -> Option<String> {
    let admin: SocketAddr = p.admin.parse().ok()?;
    if admin.ip().is_unspecified() {
        let listen: SocketAddr = p.listen.parse().ok()?;
        if listen.ip().is_unspecified() {
            return None;
        }
        return Some(format!(
            "http://{}",
            SocketAddr::new(listen.ip(), admin.port())
        ));
    }
    Some(format!("http://{admin}"))
}

fn http_client(ca: Option<&PathBuf>) -> anyhow::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder();
    if let Some(ca) = ca {
        let pem = std::fs::read(ca)
            .with_context(|| format!("reading the CA certificate {}", ca.display()))?;
        builder = builder.add_root_certificate(
            reqwest::Certificate::from_pem(&pem)
                .with_context(|| format!("{} is not a PEM certificate", ca.display()))?,
        );
    }
    Ok(builder.build()?)
}

async fn get(
    http: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> anyhow::Result<(u16, String)> {
    let resp = http.get(url).timeout(timeout).send().await?;
    let status = resp.status().as_u16();
    Ok((status, resp.text().await?))
}

/// A sample's value from Prometheus text.
fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn since(started_ms: u64) -> String {
    let now = chrono::Utc::now().timestamp_millis().max(0) as u64;
    let secs = now.saturating_sub(started_ms) / 1000;
    humantime::format_duration(Duration::from_secs(secs)).to_string()
}

fn bytes(n: i64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.1} GB", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1} MB", n / 1e6)
    } else {
        format!("{:.0} kB", n / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_metrics_parse() {
        assert_eq!(parse_token("17:5").unwrap(), (17, 5));
        assert!(parse_token("17").is_err());
        assert!(parse_token("x:5").is_err());
        let body = "# HELP x\nlockcell_audit_lag_revisions 3\nlockcell_audit_lag_revisions_max 9\n";
        assert_eq!(metric(body, "lockcell_audit_lag_revisions"), Some(3.0));
        assert_eq!(metric(body, "missing"), None);
    }

    #[test]
    fn an_admin_port_on_every_interface_is_called_at_the_proxy_address() {
        let mut p = Presence {
            proxy_id: "a".into(),
            zone: "z".into(),
            listen: "10.0.0.7:7420".into(),
            admin: "0.0.0.0:7421".into(),
            version: "0".into(),
            started_ms: 0,
            etcd: None,
            etcd_lease_blocks: Vec::new(),
        };
        assert_eq!(admin_url(&p).as_deref(), Some("http://10.0.0.7:7421"));
        p.listen = "0.0.0.0:7420".into();
        assert_eq!(admin_url(&p), None);
        p.admin = "127.0.0.1:7421".into();
        assert_eq!(admin_url(&p).as_deref(), Some("http://127.0.0.1:7421"));
    }
}
