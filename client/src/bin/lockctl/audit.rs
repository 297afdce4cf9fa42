//! `lockctl audit`: who held a lock (or led an election, or wrote a key), when, with
//! which token, from the cell's audit tailer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use serde::Deserialize;

use crate::print_line;
use crate::target::TargetArgs;

pub(crate) const AUDIT_LONG: &str = "\
Print the audit history of lock, election or small key NAME: one line per event, oldest
first, from the audit tailer (`lockcell-cell audit`) of the cell, or of each cell.

Each cell has its own tailer. A name whose prefix moved between cells (`lockcell-cell
shardmap move`) has its history in each cell it was served by: give every cell's tailer
(--audit A,B or LOCKCELL_AUDIT=A,B) and the histories are merged by time, each line
naming its tailer (cell=HOST:PORT).

Each line is: time (UTC), event, fencing token, session, identity, proxy, zone. Events:
granted, released, expired (the holder's session ended or its proxy's lease ran out
without a release), moved (the holder's session moved to another proxy; same token),
leader_changed, waiting, key_written, key_deleted, force_released (an operator ended
the holder's session: the identity is the operator's).

The history is as of the tailer's checkpoint, printed last: events newer than it are not
in yet. Values (a small key's, a leader's) and lease ids are left out unless --values
asks for them. A tailer that checks prefix grants takes the same bearer token as the
proxies (--auth-token, LOCKCELL_AUTH_TOKEN) and, over https, the same --tls-ca.

Example:
  lockctl audit billing/nightly --since 24h --audit https://cell-1:7431";

/// Arguments of `lockctl audit`.
#[derive(Debug, clap::Args)]
pub(crate) struct AuditArgs {
    /// The lock, election or small key, e.g. billing/nightly.
    pub(crate) name: String,

    /// Only events of the last T (e.g. 1h, 7d).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) since: Option<Duration>,

    /// At most this many events.
    #[arg(long, default_value_t = 1000)]
    pub(crate) limit: usize,

    /// The audit tailer's HTTP address, or every cell's, separated by commas.
    #[arg(
        long,
        env = "LOCKCELL_AUDIT",
        default_value = "http://127.0.0.1:7431",
        value_delimiter = ','
    )]
    pub(crate) audit: Vec<String>,

    /// Print the events as JSON lines instead.
    #[arg(long)]
    pub(crate) json: bool,

    /// Show values and lease ids too (needs the read right on NAME).
    #[arg(long)]
    pub(crate) values: bool,
}

/// The fields of an audit event lockctl shows.
#[derive(Debug, Deserialize, serde::Serialize)]
struct Event {
    revision: i64,
    time_ms: i64,
    kind: String,
    name: String,
    #[serde(default)]
    token: String,
    #[serde(default)]
    session: String,
    #[serde(default)]
    identity: String,
    #[serde(default)]
    proxy: String,
    #[serde(default)]
    zone: String,
    #[serde(default)]
    detail: String,
    /// The tailer it came from, when several were asked.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    cell: String,
}

/// `lockctl audit`.
pub(crate) async fn audit(args: &AuditArgs, target: &TargetArgs) -> anyhow::Result<u8> {
    let mut events = Vec::new();
    let mut checkpoints = Vec::new();
    for tailer in &args.audit {
        let (mut got, checkpoint) = ask(args, target, tailer).await?;
        if args.audit.len() > 1 {
            let cell = reqwest::Url::parse(tailer)
                .ok()
                .and_then(|u| Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?)))
                .unwrap_or_else(|| tailer.clone());
            for event in &mut got {
                event.cell = cell.clone();
            }
        }
        events.extend(got);
        checkpoints.push((tailer, checkpoint));
    }
    // Each cell's events are in revision order; across cells, time orders them.
    if args.audit.len() > 1 {
        events.sort_by_key(|e| e.time_ms);
    }
    for event in &events {
        if args.json {
            print_line(&serde_json::to_string(event)?)?;
        } else {
            print_line(&text(event))?;
        }
    }
    if !args.json {
        for (tailer, checkpoint) in checkpoints {
            let shown = checkpoint.unwrap_or_else(|| "unknown".into());
            if args.audit.len() > 1 {
                eprintln!("{tailer}: audit trail complete up to revision {shown}");
            } else {
                eprintln!(
                    "{} events; audit trail complete up to revision {shown}",
                    events.len()
                );
            }
        }
        if args.audit.len() > 1 {
            eprintln!("{} events from {} tailers", events.len(), args.audit.len());
        }
    }
    Ok(0)
}

/// The events of NAME one tailer holds, and its checkpoint.
async fn ask(
    args: &AuditArgs,
    target: &TargetArgs,
    tailer: &str,
) -> anyhow::Result<(Vec<Event>, Option<String>)> {
    let mut url = reqwest::Url::parse(tailer)
        .with_context(|| format!("--audit {tailer:?} is not a URL (e.g. http://127.0.0.1:7431)"))?;
    url.set_path("/v1/audit");
    {
        let mut query = url.query_pairs_mut();
        query.append_pair("name", &args.name);
        query.append_pair("limit", &args.limit.to_string());
        if args.values {
            query.append_pair("values", "true");
        }
        if let Some(since) = args.since {
            let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
            let from = now.saturating_sub(since).as_millis();
            query.append_pair("since_ms", &from.to_string());
        }
    }
    let mut client = reqwest::Client::builder();
    if let Some(ca) = &target.tls_ca {
        let pem =
            std::fs::read(ca).with_context(|| format!("reading --tls-ca {}", ca.display()))?;
        client = client.tls_certs_only([reqwest::Certificate::from_pem(&pem)
            .with_context(|| format!("--tls-ca {} is not a PEM certificate", ca.display()))?]);
    }
    let mut request = client.build()?.get(url.clone());
    if let Some(token) = target.auth_token.as_ref().filter(|t| !t.is_empty()) {
        request = request.bearer_auth(token);
    }
    let reply = request
        .send()
        .await
        .with_context(|| format!("asking the audit tailer at {tailer}"))?;
    let status = reply.status();
    let checkpoint = reply
        .headers()
        .get("lockcell-audit-checkpoint")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = reply.text().await?;
    if !status.is_success() {
        anyhow::bail!(
            "the audit tailer at {tailer} answered {status}: {}",
            body.trim()
        );
    }
    let events: Vec<Event> =
        serde_json::from_str(&body).context("the audit tailer's answer is not a list of events")?;
    Ok((events, checkpoint))
}

fn text(e: &Event) -> String {
    let when = chrono::DateTime::from_timestamp_millis(e.time_ms)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
        .unwrap_or_else(|| e.time_ms.to_string());
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_owned()
        } else {
            s.to_owned()
        }
    };
    let mut line = format!(
        "{when} {:<14} token={} session={} identity={:?} proxy={} zone={}",
        e.kind,
        dash(&e.token),
        dash(&e.session),
        e.identity,
        dash(&e.proxy),
        dash(&e.zone),
    );
    if !e.detail.is_empty() {
        line.push_str(&format!(" value={:?}", e.detail));
    }
    if !e.cell.is_empty() {
        line.push_str(&format!(" cell={}", e.cell));
    }
    line
}
