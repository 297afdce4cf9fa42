//! The examples of docs/client-guide.md, run against a real cell. Every ```rust block of
//! the guide must appear here word for word and runs; every `lockctl` line of its ```sh
//! blocks runs against the dev cell, as the guide tells a reader to (`dev.rs`); so the
//! guide cannot show code that does not work.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{
    Client, ClientOptions, ClientTls, Condition, Error, FencingToken, MemberCache, Session,
    SessionEvent, SessionOptions, Wait, WatchOptions,
};
use lockcell_tests::{EtcdCluster, ProxyOptions, ProxyProcess};

// --- guide: connecting ---
/// `proxies`: own zone first, comma-separated; `ca_file`: the CA (PEM) that signed the
/// proxies' certificates; `token`: the bearer token the proxies' grants know.
pub async fn connect(
    proxies: &str,
    ca_file: &str,
    token: &str,
) -> Result<Client, Box<dyn std::error::Error>> {
    let tls = ClientTls {
        ca_pem: std::fs::read(ca_file)?,
        ..ClientTls::default()
    };
    let options = ClientOptions::new(proxies.split(',')).tls(tls).token(token);
    Ok(Client::connect_with(options).await?)
}
// --- end ---

// --- guide: sessions ---
pub async fn open_a_session(proxy: &str) -> Result<(), Error> {
    let client = Client::connect(proxy).await?;
    let session = client
        .open_session(SessionOptions {
            ttl: Duration::from_secs(10),
            identity: "billing-worker-7".to_owned(),
        })
        .await?;
    println!("session {} on proxy {}", session.id(), session.proxy_id());
    session.close().await?;
    Ok(())
}
// --- end ---

// --- guide: locks ---
pub async fn run_the_nightly_report(proxy: &str, store: &ReportStore) -> Result<bool, Error> {
    let client = Client::connect(proxy).await?;
    let session = client.open_session(SessionOptions::default()).await?;
    let wait = Wait::Timeout(Duration::from_secs(10));
    let Some(guard) = session.acquire("reports/nightly", wait).await? else {
        return Ok(false); // someone else runs it
    };
    // Work only while the session is valid, and hand the token to the resource.
    tokio::select! {
        written = store.write(guard.token(), "the nightly report") => {
            if let Err(refused) = written {
                eprintln!("the store refused a stale token: {refused}");
            }
        }
        revoked = guard.revoked() => eprintln!("stopping: {revoked}"),
    }
    guard.release().await?;
    session.close().await?;
    Ok(true)
}
// --- end ---

// --- guide: a lock in a loop ---
/// Writes one report per round; each round's guard is dropped at the end of the round,
/// and the next round's acquire waits for its release: every grant is a new one.
pub async fn report_in_rounds(
    session: &Session,
    rounds: usize,
    store: &ReportStore,
) -> Result<(), Error> {
    for round in 0..rounds {
        let wait = Wait::Timeout(Duration::from_secs(10));
        let Some(guard) = session.acquire("reports/rounds", wait).await? else {
            continue; // held elsewhere all along: try the next round
        };
        let again = session.acquire("reports/rounds", Wait::Try).await;
        assert!(matches!(again, Err(Error::AlreadyHeld(_)))); // not re-entrant
        if let Err(refused) = store.write(guard.token(), &format!("round {round}")).await {
            eprintln!("the store refused a stale token: {refused}");
        }
    }
    Ok(())
}
// --- end ---

// --- guide: fencing ---
/// A resource that keeps the highest fencing token it has seen and refuses writes that
/// carry an older one: a holder that lost its lock (paused, cut off) cannot overwrite
/// the work of the next holder.
#[derive(Default)]
pub struct ReportStore {
    highest: Mutex<Option<FencingToken>>,
    reports: Mutex<Vec<(FencingToken, String)>>,
}

impl ReportStore {
    pub async fn write(&self, token: FencingToken, report: &str) -> Result<(), String> {
        let mut highest = self.highest.lock().unwrap();
        if let Some(seen) = *highest {
            if token < seen {
                return Err(format!("token {token} is older than {seen}"));
            }
        }
        *highest = Some(token);
        self.reports
            .lock()
            .unwrap()
            .push((token, report.to_owned()));
        Ok(())
    }
}
// --- end ---

// --- guide: sequencer ---
pub async fn still_the_holder(client: &Client, token: FencingToken) -> Result<bool, Error> {
    let check = client.check_sequencer("reports/nightly", token).await?;
    Ok(check.current)
}
// --- end ---

// --- guide: elections ---
pub async fn serve_as_primary(proxy: &str) -> Result<(), Error> {
    let client = Client::connect(proxy).await?;
    let session = client.open_session(SessionOptions::default()).await?;
    let wait = Wait::Timeout(Duration::from_secs(10));
    if let Some(leadership) = session
        .campaign("db/primary", "10.0.0.7:5432", wait)
        .await?
    {
        let leader = client.leader("db/primary").await?;
        println!("leading: {leader:?}, token {}", leadership.token());
        leadership.proclaim("10.0.0.7:5433").await?;
        leadership.resign().await?;
    }
    session.close().await?;
    Ok(())
}

pub async fn follow_the_primary(client: &Client) -> Result<Option<String>, Error> {
    let mut leaders = client.observe("db/primary").await?;
    // The current leader first (None: nobody leads), then every change.
    match leaders.next().await {
        Some(Ok(leader)) => Ok(leader.map(|l| l.value)),
        Some(Err(e)) => Err(e),
        None => Ok(None),
    }
}

pub async fn lead_the_reports(session: &Session, store: &ReportStore) -> Result<(), Error> {
    // Campaign, write as leader, let go, campaign again (others get their turn). The
    // work is dropped the moment the term is revoked; the token fences what it wrote.
    session
        .lead("reports/leader", "host-7", |term| async move {
            if let Err(refused) = store.write(term.token, "written by the leader").await {
                eprintln!("the store refused a stale token: {refused}");
            }
        })
        .await
}
// --- end ---

// --- guide: membership ---
pub async fn join_the_web_group(proxy: &str) -> Result<Vec<String>, Error> {
    let client = Client::connect(proxy).await?;
    let session = client.open_session(SessionOptions::default()).await?;
    // A member for as long as the session lives: it leaves when the session closes,
    // expires, or its process dies.
    session.announce("web", "host-7", b"10.0.0.7:8080").await?;
    let members = client.members("web").await?;
    let names = members.current().keys().cloned().collect();
    session.close().await?;
    Ok(names)
}

pub async fn web_backends(client: &Client) -> Result<MemberCache, Error> {
    // The group, kept current by a task of its own while a receiver lives, across
    // proxy restarts: `borrow()` it whenever, `changed().await` to wake on a change.
    Ok(client.members("web").await?.watch())
}
// --- end ---

// --- guide: watches ---
pub async fn follow_the_rates(proxy: &str) -> Result<(), Error> {
    let client = Client::connect(proxy).await?;
    let mut watcher = client
        .watch("config/rates/", WatchOptions::prefix())
        .await?;
    client
        .put("config/rates/eu", b"100", Condition::Always)
        .await?;
    // Every change in order, none missed or repeated, also across a restarted proxy.
    if let Some(batch) = watcher.next().await {
        for event in batch?.events {
            let value = String::from_utf8_lossy(&event.entry.value);
            println!("{:?} {} = {value}", event.kind, event.entry.key);
        }
    }
    Ok(())
}
// --- end ---

// --- guide: events ---
pub async fn log_session_events(proxy: &str) -> Result<(), Error> {
    let client = Client::connect(proxy).await?;
    let session = client.open_session(SessionOptions::default()).await?;
    let mut events = session.events();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            match event {
                SessionEvent::Jeopardy => eprintln!("stop acting: no word from a proxy in time"),
                SessionEvent::Safe => eprintln!("valid again; everything still held"),
                SessionEvent::Moved { proxy_id } => eprintln!("moved to {proxy_id}"),
                SessionEvent::Lost { held, reason } => eprintln!("lost {held:?}: {reason}"),
                SessionEvent::Expired { reason } => eprintln!("session over: {reason}"),
            }
        }
    });
    session.close().await?;
    Ok(())
}
// --- end ---

/// The ```rust blocks of the guide, trimmed.
fn rust_blocks(guide: &str) -> Vec<String> {
    blocks(guide, "```rust")
}

pub fn blocks(text: &str, fence: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in text.lines() {
        match &mut current {
            None if line.trim_start() == fence => current = Some(Vec::new()),
            Some(lines) if line.trim_start() == "```" => {
                out.push(lines.join("\n").trim().to_owned());
                current = None;
            }
            Some(lines) => lines.push(line),
            None => {}
        }
    }
    out
}

/// The guide's text.
pub fn guide() -> anyhow::Result<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/client-guide.md");
    std::fs::read_to_string(path).context("reading docs/client-guide.md")
}

/// The `lockctl` lines of the guide's ```sh blocks, and whether the guide tells the
/// reader to source the dev cell's `env` file first.
pub fn lockctl_lines() -> anyhow::Result<(Vec<String>, bool)> {
    let guide = guide()?;
    let mut sources_env = false;
    let mut lines = Vec::new();
    for block in blocks(&guide, "```sh") {
        for line in block.lines() {
            sources_env |= line.starts_with(". .lockcell-dev/env");
            if line.starts_with("lockctl ") {
                lines.push(line.to_owned());
            }
        }
    }
    Ok((lines, sources_env))
}

pub async fn the_client_guides_examples_run_against_a_real_cell() -> anyhow::Result<()> {
    let guide = guide()?;
    let here = include_str!("guide.rs");
    let rust = rust_blocks(&guide);
    ensure!(
        rust.len() >= 6,
        "the guide has only {} rust examples",
        rust.len()
    );
    ensure!(
        guide.contains("connect(") && here.contains("pub async fn connect("),
        "the guide shows how to connect with TLS and a token"
    );
    for block in &rust {
        ensure!(
            here.contains(block.as_str()),
            "this example of docs/client-guide.md is not the tested code of tests/tests/e2e/guide.rs:\n{block}"
        );
    }

    let etcd = EtcdCluster::start(1).await?;
    let proxy = ProxyProcess::start(&ProxyOptions::new("a", etcd.endpoints()), &etcd.dir).await?;
    let addr = proxy.url();
    open_a_session(&addr).await?;
    let store = ReportStore::default();
    ensure!(
        run_the_nightly_report(&addr, &store).await?,
        "the report lock was not taken"
    );
    let first = store.reports.lock().unwrap()[0].0;
    ensure!(
        run_the_nightly_report(&addr, &store).await?,
        "the report lock was not taken again"
    );
    let second = store.reports.lock().unwrap()[1].0;
    ensure!(second > first, "tokens did not rise: {first} then {second}");
    ensure!(
        store.write(first, "late").await.is_err(),
        "the store took a stale token"
    );
    let client = Client::connect(&addr).await?;
    ensure!(
        !still_the_holder(&client, second).await?,
        "a released grant is still current"
    );
    let looping = client.open_session(SessionOptions::default()).await?;
    let rounds = ReportStore::default();
    report_in_rounds(&looping, 20, &rounds).await?;
    let tokens: Vec<FencingToken> = rounds.reports.lock().unwrap().iter().map(|r| r.0).collect();
    ensure!(
        tokens.len() == 20 && tokens.windows(2).all(|w| w[0] < w[1]),
        "the rounds did not each get a new grant: {tokens:?}"
    );
    looping.close().await?;
    serve_as_primary(&addr).await?;
    ensure!(
        follow_the_primary(&client).await?.is_none(),
        "someone still leads after the resign"
    );
    ensure!(
        join_the_web_group(&addr).await? == ["host-7"],
        "the member did not show"
    );
    let member = client.open_session(SessionOptions::default()).await?;
    member.announce("web", "host-8", b"10.0.0.8:8080").await?;
    ensure!(
        web_backends(&client).await?.borrow().keys().eq(["host-8"]),
        "the member cache did not show the member"
    );
    member.close().await?;
    let leading = client.open_session(SessionOptions::default()).await?;
    let terms = ReportStore::default();
    let three_terms =
        lockcell_tests::eventually("three terms", Duration::from_secs(20), || async {
            Ok((terms.reports.lock().unwrap().len() >= 3).then_some(()))
        });
    tokio::select! {
        ended = lead_the_reports(&leading, &terms) => anyhow::bail!("the lead loop ended: {ended:?}"),
        _ = three_terms => {}
    }
    let tokens: Vec<FencingToken> = terms.reports.lock().unwrap().iter().map(|r| r.0).collect();
    ensure!(
        tokens.len() >= 3 && tokens.windows(2).all(|w| w[0] < w[1]),
        "each term of the lead loop had a new token: {tokens:?}"
    );
    leading.close().await?;
    tokio::time::timeout(Duration::from_secs(20), follow_the_rates(&addr))
        .await
        .context("the watch example saw nothing within 20 s")??;
    ensure!(
        client.get("config/rates/eu").await?.map(|e| e.value) == Some(b"100".to_vec()),
        "the watched write is not there"
    );
    log_session_events(&addr).await?;
    Ok(())
}

/// The guide's three programs (the run-once job, the lead loop, the live member list)
/// run at once through two proxies, preferring the first, which is SIGKILLed under them:
/// the job waiting for its lock still runs once with a fresh token, the lead loop goes
/// on term after term with rising tokens, and the member list keeps a member whose
/// proxy died, sees a member join and one leave afterwards.
pub async fn the_guides_programs_go_on_through_a_proxy_kill() -> anyhow::Result<()> {
    use nix::sys::signal::Signal;
    use std::sync::Arc;

    let (_etcd, proxies) = crate::support::cell(&["a", "b"]).await?;
    let (a, b) = (proxies[0].addr.clone(), proxies[1].addr.clone());
    let both = format!("{a},{b}");
    let on_b = Client::connect(&b).await?;

    // The job waits behind a holder on the proxy that lives.
    let holder = on_b.open_session(SessionOptions::default()).await?;
    let held = holder
        .acquire("reports/nightly", Wait::Forever)
        .await?
        .context("the holder's acquire")?;
    let reports = Arc::new(ReportStore::default());
    let job = tokio::spawn({
        let (both, reports) = (both.clone(), reports.clone());
        async move { run_the_nightly_report(&both, &reports).await }
    });
    lockcell_tests::eventually("the job waiting on a", Duration::from_secs(10), || async {
        Ok((proxies[0].metric("lockcell_waiters").await? >= 1.0).then_some(()))
    })
    .await?;

    // The lead loop, on a.
    let leading = Client::connect(&both).await?;
    let leader = leading.open_session(SessionOptions::default()).await?;
    let terms = Arc::new(ReportStore::default());
    let lead = tokio::spawn({
        let terms = terms.clone();
        async move { lead_the_reports(&leader, &terms).await }
    });
    let terms_past = |n: usize| {
        let terms = terms.clone();
        move || {
            let terms = terms.clone();
            async move { Ok((terms.reports.lock().unwrap().len() >= n).then_some(())) }
        }
    };
    lockcell_tests::eventually("two terms", Duration::from_secs(20), terms_past(2)).await?;

    // The member list, through a, with a member whose session is on a.
    let watching = Client::connect(&both).await?;
    let web = web_backends(&watching).await?;
    let members = Client::connect(&both).await?;
    let seven = members.open_session(SessionOptions::default()).await?;
    seven.announce("web", "host-7", "10.0.0.7:8080").await?;
    let shows = |web: &MemberCache, want: &'static [&'static str]| {
        let mut web = web.clone();
        async move {
            let wanted = |group: &Arc<std::collections::BTreeMap<String, Vec<u8>>>| {
                group.keys().map(String::as_str).eq(want.iter().copied())
            };
            tokio::time::timeout(Duration::from_secs(30), web.wait_for(wanted))
                .await
                .with_context(|| format!("the member list never showed {want:?}"))?
                .context("the member cache stopped")?;
            anyhow::Ok(())
        }
    };
    shows(&web, &["host-7"]).await?;
    let mut seven_events = seven.events();

    proxies[0].signal(Signal::SIGKILL)?;
    let terms_before = terms.reports.lock().unwrap().len();
    let held_token = held.token();
    held.release().await?;
    let ran = tokio::time::timeout(Duration::from_secs(30), job)
        .await
        .context("the job did not end within 30 s of the kill")???;
    ensure!(ran, "the job did not get its lock after the kill");
    let (job_token, _) = reports.reports.lock().unwrap()[0].clone();
    ensure!(
        job_token > held_token,
        "the job wrote with token {job_token}, not newer than the holder's {held_token}"
    );
    ensure!(
        !still_the_holder(&on_b, job_token).await?,
        "the job's grant is still current after it ended"
    );

    lockcell_tests::eventually(
        "three terms after the kill",
        Duration::from_secs(30),
        terms_past(terms_before + 3),
    )
    .await?;
    ensure!(!lead.is_finished(), "the lead loop ended: {:?}", lead.await);
    lead.abort();
    let tokens: Vec<FencingToken> = terms.reports.lock().unwrap().iter().map(|r| r.0).collect();
    ensure!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "a term of the lead loop reused or went back on a token: {tokens:?}"
    );
    println!(
        "through the kill: the job wrote with {job_token}; the lead loop ran {} terms, {terms_before} before the kill",
        tokens.len()
    );

    // host-7's session moved with its member key (a key a move cannot take along is
    // reported lost); others come and go as before.
    let moved = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(event) = seven_events.next().await {
            match event {
                SessionEvent::Moved { .. } => return Ok(()),
                SessionEvent::Lost { held, reason } => {
                    anyhow::bail!("host-7 lost {held:?} in the move: {reason}")
                }
                _ => {}
            }
        }
        anyhow::bail!("host-7's session ended")
    });
    moved
        .await
        .context("host-7's session did not move within 20 s")??;
    let eight = on_b.open_session(SessionOptions::default()).await?;
    eight.announce("web", "host-8", "10.0.0.8:8080").await?;
    shows(&web, &["host-7", "host-8"]).await?;
    seven.close().await?;
    shows(&web, &["host-8"]).await?;
    ensure!(
        eight.leave("web", "host-8").await?,
        "host-8 could not leave the group"
    );
    shows(&web, &[]).await?;
    ensure!(!eight.leave("web", "host-8").await?, "host-8 left twice");
    Ok(())
}
