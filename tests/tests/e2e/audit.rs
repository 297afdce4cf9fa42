//! The audit trail of a scripted run: every grant, release, expiry and leader change in
//! order, through a tailer restart without duplicates, and rebuilt from the archive.

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_cell::audit::store::Store;
use lockcell_cell::audit::{AuditEvent, EventKind};
use lockcell_client::{Client, Condition, Wait};
use lockcell_tests::audit::AuditProcess;
use lockcell_tests::clickhouse::ClickHouse;
use lockcell_tests::s3::S3Server;
use lockcell_tests::{eventually, EtcdCluster, ProxyProcess};

use crate::support::{cell, short_session, silent_holder};

/// One line per event as a test states it: kind, name, token (or "").
type Line = (EventKind, String, String);

fn lines(events: &[AuditEvent]) -> Vec<Line> {
    events
        .iter()
        .map(|e| (e.kind, e.name.clone(), e.token.clone()))
        .collect()
}

fn line(kind: EventKind, name: &str, token: impl ToString) -> Line {
    (kind, name.to_owned(), token.to_string())
}

/// Grants, releases, an expiry, leader changes and small-key writes through `proxy`;
/// what the audit trail must show for each name, in order.
async fn script(proxy: &ProxyProcess) -> anyhow::Result<Vec<(String, Vec<Line>)>> {
    let client = Client::connect(&proxy.url()).await?;
    let lock = "audit/lock";
    let mut on_lock = Vec::new();

    // A grant and a clean release.
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let guard = session
        .acquire(lock, Wait::Try)
        .await?
        .context("free lock not granted")?;
    let first = guard.token();
    guard.release().await?;
    on_lock.push(line(EventKind::Granted, lock, first));
    on_lock.push(line(EventKind::Released, lock, first));

    // A holder that stops renewing: its grant expires.
    let (_, _, silent_token) = silent_holder(proxy, lock).await?;
    on_lock.push(line(EventKind::Granted, lock, silent_token));
    on_lock.push(line(EventKind::Expired, lock, silent_token));
    let guard = session
        .acquire(lock, Wait::Timeout(Duration::from_secs(20)))
        .await?
        .context("the lock of an expired holder never passed on")?;
    let third = guard.token();
    guard.release().await?;
    on_lock.push(line(EventKind::Granted, lock, third));
    on_lock.push(line(EventKind::Released, lock, third));

    // An election: a leader, its proclaim, its resignation, the next leader.
    let election = "audit/leader";
    let leader = session
        .campaign(election, "one", Wait::Try)
        .await?
        .context("no leader of an empty election")?;
    let one = leader.token();
    leader.proclaim("one again").await?;
    leader.resign().await?;
    let other = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let next = other
        .campaign(election, "two", Wait::Try)
        .await?
        .context("no next leader")?;
    let two = next.token();
    let on_election = vec![
        line(EventKind::LeaderChanged, election, one),
        line(EventKind::LeaderChanged, election, one),
        line(EventKind::Released, election, one),
        line(EventKind::LeaderChanged, election, two),
    ];

    // A small key written twice and deleted.
    let key = "audit/config";
    client.put(key, b"v1", Condition::Always).await?;
    client.put(key, b"v2", Condition::Always).await?;
    client.delete(key, Condition::Always).await?;
    let on_key = vec![
        line(EventKind::KeyWritten, key, ""),
        line(EventKind::KeyWritten, key, ""),
        line(EventKind::KeyDeleted, key, ""),
    ];
    next.resign().await?;
    other.close().await?;
    session.close().await?;
    let mut on_election = on_election;
    on_election.push(line(EventKind::Released, election, two));
    Ok(vec![
        (lock.to_owned(), on_lock),
        (election.to_owned(), on_election),
        (key.to_owned(), on_key),
    ])
}

/// Waits until the tailer's history of every name is what the script says, in order.
async fn trail_is(tailer: &AuditProcess, expected: &[(String, Vec<Line>)]) -> anyhow::Result<()> {
    for (name, want) in expected {
        let got = eventually(
            &format!("the audit trail of {name} is complete"),
            Duration::from_secs(30),
            || async {
                let got = lines(&tailer.history(name).await?);
                Ok((got.len() >= want.len()).then_some(got))
            },
        )
        .await?;
        ensure!(
            &got == want,
            "the audit trail of {name} is not the run's, in order:\n got  {got:?}\n want {want:?}"
        );
    }
    Ok(())
}

/// Every event in order, unique by (revision, seq), and the run's events complete; then
/// a restart with more events has no duplicates; then a rebuild from the archive gives
/// the same store.
async fn trail_survives_restart_and_rebuild(
    etcd: &EtcdCluster,
    proxy: &ProxyProcess,
    dir: &Path,
    sinks: &[String],
    store_spec: &str,
) -> anyhow::Result<()> {
    let endpoints = etcd.endpoints();
    let data = dir.join("cell-data");
    let log = dir.join("audit.log");
    let tailer = AuditProcess::start("run", &endpoints, &data, sinks, &log).await?;
    let mut expected = script(proxy).await?;
    trail_is(&tailer, &expected).await?;

    // Stopped, more happens, started again: the new events once, the old ones once.
    tailer.stop().await?;
    let client = Client::connect(&proxy.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let guard = session
        .acquire("audit/lock", Wait::Try)
        .await?
        .context("free lock not granted")?;
    let token = guard.token();
    guard.release().await?;
    session.close().await?;
    expected[0]
        .1
        .push(line(EventKind::Granted, "audit/lock", token));
    expected[0]
        .1
        .push(line(EventKind::Released, "audit/lock", token));
    let tailer = AuditProcess::start("run", &endpoints, &data, sinks, &log).await?;
    trail_is(&tailer, &expected).await?;
    lockctl_audit_shows(&tailer, &expected[0].1).await?;
    tailer.stop().await?;

    let store = Store::open(store_spec).await?;
    let before = store.all().await?;
    ensure!(
        before
            .windows(2)
            .all(|w| (w[0].revision, w[0].seq) < (w[1].revision, w[1].seq)),
        "the store's events are not in strict (revision, seq) order"
    );
    let kinds: Vec<EventKind> = before.iter().map(|e| e.kind).collect();
    ensure!(
        kinds.contains(&EventKind::ConfigChanged),
        "the epoch record's creation is not in the trail: {kinds:?}"
    );

    // The store lost: rebuilt from the archive, it is the same, event for event.
    store.clear().await?;
    ensure!(store.all().await?.is_empty(), "the store did not clear");
    let rebuilt = AuditProcess::start("rebuild", &endpoints, &data, sinks, &log).await?;
    trail_is(&rebuilt, &expected).await?;
    rebuilt.stop().await?;
    let after = store.all().await?;
    ensure!(
        after == before,
        "the store rebuilt from the archive differs: {} events before, {} after",
        before.len(),
        after.len()
    );

    // Revisions etcd compacted before the tailer read them: said, counted, recorded.
    let client = Client::connect(&proxy.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let lost = session
        .acquire("audit/lost", Wait::Try)
        .await?
        .context("free lock not granted")?;
    lost.release().await?;
    session.close().await?;
    let now = etcd.revision().await?;
    etcd.client()
        .await?
        .compact(
            now,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await?;
    let tailer = AuditProcess::start("run", &endpoints, &data, sinks, &log).await?;
    let gaps = eventually(
        "the tailer records the gap",
        Duration::from_secs(30),
        || async {
            let gaps: Vec<AuditEvent> = store
                .all()
                .await?
                .into_iter()
                .filter(|e| e.kind == EventKind::Gap)
                .collect();
            Ok((!gaps.is_empty()).then_some(gaps))
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}; tailer log:\n{}", tailer.process.log_tail(8)))?;
    ensure!(
        gaps.len() == 1 && gaps[0].revision == now - 1,
        "the gap is not the compacted range ending at {}: {gaps:?}",
        now - 1
    );
    ensure!(
        tailer.history("audit/lost").await?.is_empty(),
        "events etcd had compacted away appeared in the trail"
    );
    eventually(
        "the gap is counted in /metrics",
        Duration::from_secs(10),
        || async {
            let metrics = lockcell_tests::proxy::http_get(&tailer.addr, "/metrics").await?;
            let counted = metrics
                .lines()
                .find_map(|l| l.strip_prefix("lockcell_audit_gap_revisions_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0);
            Ok((counted >= 1.0).then_some(()))
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}; tailer log:\n{}", tailer.process.log_tail(20)))?;
    tailer.stop().await?;
    ensure!(
        std::fs::read_to_string(&log)?
            .contains("compacted revisions before the audit tailer read them"),
        "the tailer's log does not say revisions were lost"
    );
    Ok(())
}

/// `lockctl audit NAME` prints one line per event of the trail, with its token.
async fn lockctl_audit_shows(tailer: &AuditProcess, want: &[Line]) -> anyhow::Result<()> {
    let (_, name, _) = &want[0];
    let out = tokio::process::Command::new(lockcell_tests::bins::workspace_bin("lockctl")?)
        .args(["audit", name, "--since", "1h", "--audit"])
        .arg(format!("http://{}", tailer.addr))
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "lockctl audit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: Vec<&str> = stdout.lines().collect();
    ensure!(
        shown.len() == want.len(),
        "lockctl audit printed {} lines for {} events:\n{stdout}",
        shown.len(),
        want.len()
    );
    for (line, (kind, _, token)) in shown.iter().zip(want) {
        ensure!(
            line.contains(kind.as_str()) && line.contains(&format!("token={token}")),
            "lockctl audit line {line:?} is not {kind} with token {token}"
        );
    }
    Ok(())
}

pub async fn the_trail_of_a_scripted_run_is_complete_in_order_and_rebuilt_from_the_archive(
) -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let dir = tempfile::tempdir()?;
    // The defaults: SQLite and the archive in the data folder.
    let store = dir.path().join("cell-data").join("audit.db");
    trail_survives_restart_and_rebuild(
        &etcd,
        &proxies[0],
        dir.path(),
        &[],
        &store.display().to_string(),
    )
    .await
}

pub async fn with_clickhouse_and_s3_the_trail_is_complete_and_rebuilt() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let dir = tempfile::tempdir()?;
    let clickhouse = ClickHouse::start(dir.path()).await?;
    let s3 = S3Server::start().await?;
    let store = format!("{}?database=lockcell&table=audit_events", clickhouse.url());
    let sinks = vec![
        "--store".to_owned(),
        store.clone(),
        "--archive".to_owned(),
        format!("s3://{}/audit", lockcell_tests::s3::BUCKET),
        "--s3-endpoint".to_owned(),
        s3.endpoint(),
        "--s3-region".to_owned(),
        s3.region().to_owned(),
        "--s3-access-key-id".to_owned(),
        s3.access_key_id().to_owned(),
        "--s3-secret-access-key".to_owned(),
        s3.secret_access_key().to_owned(),
    ];
    trail_survives_restart_and_rebuild(&etcd, &proxies[0], dir.path(), &sinks, &store).await
}
