//! Many waiters on one lock across three proxies: each gets it once, tokens rise, fair
//! classes serve in arrival order, and a handover costs at most one grant transaction
//! per proxy.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Client, FencingToken, Session, Wait};
use lockcell_tests::{eventually, EtcdCluster, FencedResource, ProxyOptions, ProxyProcess};

use crate::support::{etcd_txns, short_session};

const WAITERS: usize = 200;
const ZONES: [&str; 3] = ["a", "b", "c"];

/// A fair class for `fair/` and the default class for the rest.
pub const CLASSES: &str = r#"
[default]
ttl_min = "500ms"
ttl_max = "120s"

[[class]]
name = "fair"
prefix = "fair/"
fair = true

[[class]]
name = "exclusive-only"
prefix = "x-only/"
modes = ["exclusive"]
ttl_min = "5s"
ttl_max = "60s"

[[class]]
name = "delayed"
prefix = "delayed/"
fenced = false
lock_delay = "4s"
"#;

/// A one-member etcd and three proxies reading `classes`.
pub async fn classed_cell(
    classes: &str,
) -> anyhow::Result<(EtcdCluster, Vec<ProxyProcess>, std::path::PathBuf)> {
    let etcd = EtcdCluster::start(1).await?;
    let file = etcd.dir.join("classes.toml");
    std::fs::write(&file, classes)?;
    let mut proxies = Vec::new();
    for zone in ZONES {
        let mut options = ProxyOptions::new(zone, etcd.endpoints());
        options.extra_args = vec!["--classes".into(), file.to_string_lossy().into_owned()];
        proxies.push(ProxyProcess::start(&options, &etcd.dir).await?);
    }
    Ok((etcd, proxies, file))
}

pub async fn two_hundred_waiters_each_get_it_once_at_one_grant_per_proxy() -> anyhow::Result<()> {
    waiters(false).await
}

pub async fn two_hundred_waiters_on_a_fair_class_go_in_arrival_order() -> anyhow::Result<()> {
    waiters(true).await
}

async fn waiters(fair: bool) -> anyhow::Result<()> {
    let (etcd, proxies, _) = classed_cell(CLASSES).await?;
    let lock = if fair { "fair/hot" } else { "hot" };
    let clients = connect_all(&proxies).await?;
    let holder_session = clients[0]
        .open_session(short_session(Duration::from_secs(20)))
        .await?;
    let holder = holder_session
        .acquire(lock, Wait::Try)
        .await?
        .context("free lock not granted")?;

    let resource = Arc::new(FencedResource::default());
    // (waiter, token) in grant order, appended while holding.
    let grants: Arc<Mutex<Vec<(usize, FencingToken)>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..WAITERS {
        let session = clients[w % 3]
            .open_session(short_session(Duration::from_secs(20)))
            .await?;
        let (resource, grants) = (resource.clone(), grants.clone());
        let task = tokio::spawn(hold_once(session, lock, w, resource, grants));
        tasks.push(task);
        if fair {
            // Arrival order is the order of the waiter keys in etcd.
            let queued = w + 1;
            eventually(
                "the waiter joins the line",
                Duration::from_secs(10),
                || async { Ok((queue_len(&etcd, lock).await? >= queued).then_some(())) },
            )
            .await?;
        }
    }
    eventually("every waiter waits", Duration::from_secs(30), || async {
        let mut waiting = 0.0;
        for p in &proxies {
            waiting += p.metric("lockcell_waiters").await?;
        }
        Ok((waiting >= WAITERS as f64).then_some(()))
    })
    .await?;

    let attempts_before = grant_attempts(&proxies).await?;
    let txns_before = etcd_txns(&etcd).await?;
    holder.release().await?;
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .context("a waiter never got the lock")???;
    }
    let attempts = grant_attempts(&proxies).await? - attempts_before;
    let txns = etcd_txns(&etcd).await? - txns_before;

    let grants = grants.lock().unwrap().clone();
    ensure!(
        grants.len() == WAITERS,
        "{} grants for {WAITERS} waiters",
        grants.len()
    );
    let mut who: Vec<usize> = grants.iter().map(|(w, _)| *w).collect();
    who.sort_unstable();
    who.dedup();
    ensure!(who.len() == WAITERS, "some waiter got the lock twice");
    for pair in grants.windows(2) {
        ensure!(
            pair[0].1 < pair[1].1,
            "tokens did not rise: {} then {}",
            pair[0].1,
            pair[1].1
        );
    }
    if fair {
        let order: Vec<usize> = grants.iter().map(|(w, _)| *w).collect();
        ensure!(
            order == (0..WAITERS).collect::<Vec<_>>(),
            "a fair class served out of arrival order: {order:?}"
        );
    }
    // Each handover: one release, and at most one grant attempt per proxy.
    let handovers = WAITERS as f64;
    ensure!(
        attempts <= 3.0 * handovers,
        "{attempts} grant attempts for {handovers} handovers across 3 proxies"
    );
    ensure!(
        txns <= 4.0 * handovers,
        "etcd counted {txns} transactions for {handovers} handovers (releases included)"
    );
    eprintln!(
        "{WAITERS} handovers: {attempts} grant attempts, {txns} etcd transactions (fair: {fair})"
    );
    Ok(())
}

async fn hold_once(
    session: Session,
    lock: &'static str,
    w: usize,
    resource: Arc<FencedResource>,
    grants: Arc<Mutex<Vec<(usize, FencingToken)>>>,
) -> anyhow::Result<()> {
    let guard = session
        .acquire(lock, Wait::Timeout(Duration::from_secs(100)))
        .await?
        .context("no grant within 100 s")?;
    grants.lock().unwrap().push((w, guard.token()));
    ensure!(
        resource.write(&w.to_string(), guard.token()),
        "the resource refused the current holder"
    );
    ensure!(guard.release().await?, "release did not delete the grant");
    session.close().await?;
    Ok(())
}

pub async fn connect_all(proxies: &[ProxyProcess]) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::new();
    for p in proxies {
        clients.push(Client::connect(&p.url()).await?);
    }
    Ok(clients)
}

async fn grant_attempts(proxies: &[ProxyProcess]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for p in proxies {
        total += p.metric("lockcell_grant_attempts_total").await?;
    }
    Ok(total)
}

async fn queue_len(etcd: &EtcdCluster, lock: &str) -> anyhow::Result<usize> {
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    let resp = etcd
        .client()
        .await?
        .get(format!("/q/{lock}/!"), Some(options))
        .await?;
    Ok(resp.count() as usize)
}
