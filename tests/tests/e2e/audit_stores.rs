//! The audit sinks against real servers: the ClickHouse store on a private
//! clickhouse-server, the archive on a private S3-compatible server (moto).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context};
use lockcell_cell::audit::archive::{Archive, ArchiveOptions};
use lockcell_cell::audit::store::Store;
use lockcell_cell::audit::{AuditEvent, EventKind};
use lockcell_tests::clickhouse::ClickHouse;
use lockcell_tests::s3::{S3Server, BUCKET};

const DAY_MS: i64 = 86_400_000;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// An event of `kind` on `name` at (revision, seq) and `time_ms`.
fn event(kind: EventKind, revision: i64, seq: u32, time_ms: i64, name: &str) -> AuditEvent {
    AuditEvent {
        revision,
        seq,
        time_ms,
        kind,
        name: name.to_owned(),
        mode: "exclusive".into(),
        token: format!("3:{revision}"),
        session: "sess-1".into(),
        proxy: "proxy-a".into(),
        zone: "a".into(),
        identity: "e2e \"tester\"".into(),
        lease: 0x7a00 + revision,
        detail: "line one\nline two \\ 'quoted'".into(),
    }
}

fn revisions(events: &[AuditEvent]) -> Vec<(i64, u32)> {
    events.iter().map(|e| (e.revision, e.seq)).collect()
}

/// `text` percent-encoded for a URL query.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub async fn clickhouse_store_partitions_by_day_and_replays_without_duplicates(
) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("lockcell-clickhouse-")
        .tempdir()?;
    let server = ClickHouse::start(dir.path()).await?;
    let spec = format!("{}?database=lockcell_e2e&table=audit_events", server.url());
    let store = Store::open(&spec).await?;
    ensure!(
        matches!(store, Store::ClickHouse(_)),
        "{spec} opened {store:?}"
    );
    ensure!(
        store.describe().contains("database=lockcell_e2e"),
        "describe: {}",
        store.describe()
    );
    ensure!(
        store.checkpoint().await? == 0,
        "a new table has checkpoint 0"
    );

    let now = now_ms();
    let old = now - 200 * DAY_MS;
    let yesterday = now - DAY_MS;
    let odd = "it's a \\ lock";
    let all = vec![
        event(EventKind::Granted, 1, 0, old, "lock-a"),
        event(EventKind::Waiting, 1, 1, old, "lock-b"),
        event(EventKind::Released, 2, 0, old + 5, "lock-a"),
        event(EventKind::Granted, 4, 0, yesterday, odd),
        event(EventKind::KeyWritten, 5, 0, yesterday, "cfg/x"),
        event(EventKind::Granted, 6, 0, now, "lock-a"),
        event(EventKind::Expired, 7, 0, now, "lock-a"),
        event(EventKind::Gap, 8, 0, now, "/sys"),
    ];

    // One batch per day (a batch is filed under its first event's day; the tailer's
    // batches span a fraction of a second).
    store.write(&all[..3]).await?;
    store.write(&all[3..5]).await?;
    ensure!(store.checkpoint().await? == 5, "checkpoint after 1..=5");
    // The tailer restarts from revision 0 and sends everything again, and more.
    store.write(&all).await?;
    store.write(&all[3..]).await?;
    ensure!(
        store.checkpoint().await? == 8,
        "checkpoint after the replay"
    );
    let stored = store.all().await?;
    ensure!(
        stored == all,
        "stored once each, in order: {:?}",
        revisions(&stored)
    );

    let history = store.history("lock-a", None, 100).await?;
    ensure!(
        revisions(&history) == [(1, 0), (2, 0), (6, 0), (7, 0)],
        "history of lock-a: {:?}",
        revisions(&history)
    );
    let recent = store.history("lock-a", Some(yesterday), 1).await?;
    ensure!(
        revisions(&recent) == [(6, 0)],
        "history since yesterday, limit 1: {:?}",
        revisions(&recent)
    );
    let quoted = store.history(odd, None, 10).await?;
    ensure!(
        revisions(&quoted) == [(4, 0)] && quoted[0] == all[3],
        "a name with a quote and a backslash: {quoted:?}"
    );

    // One partition per UTC day: the old day, yesterday, today (fewer if the test
    // runs at midnight and yesterday and today meet; never fewer than two).
    let parts = server_query(
        &server,
        "SELECT DISTINCT partition FROM system.parts \
         WHERE database = 'lockcell_e2e' AND table = 'audit_events' AND active \
         ORDER BY partition FORMAT TSV",
    )
    .await?;
    let parts: Vec<&str> = parts.lines().collect();
    let old_day = day_of(old);
    ensure!(
        parts.len() >= 2 && parts[0] == old_day,
        "partitions {parts:?}, expected {old_day} first"
    );

    // Opening again finds the table as it is.
    let again = Store::open(&spec).await?;
    ensure!(
        again.checkpoint().await? == 8,
        "checkpoint seen on reopening"
    );

    // Keeping 90 days drops the 200-day-old partition and nothing else.
    let dropped = store.expire(90, now).await?;
    ensure!(
        dropped == 1,
        "expire dropped {dropped} partitions, expected 1"
    );
    let left = store.all().await?;
    ensure!(
        left == all[3..],
        "left after expire: {:?}",
        revisions(&left)
    );
    ensure!(
        store.expire(90, now).await? == 0,
        "a second expire drops nothing"
    );
    ensure!(store.checkpoint().await? == 8, "checkpoint after expire");

    store.clear().await?;
    ensure!(store.all().await?.is_empty(), "clear empties the table");
    ensure!(store.checkpoint().await? == 0, "checkpoint after clear");
    Ok(())
}

pub async fn archive_on_s3_covers_every_revision_once_per_class() -> anyhow::Result<()> {
    let s3 = S3Server::start().await?;
    let options = ArchiveOptions {
        endpoint: Some(s3.endpoint()),
        region: Some(s3.region().into()),
        access_key_id: Some(s3.access_key_id().into()),
        secret_access_key: Some(s3.secret_access_key().into()),
        ..ArchiveOptions::default()
    };
    let spec = format!("s3://{BUCKET}/cell-e2e");
    let mut archive = Archive::open(&spec, options.clone()).await?;
    ensure!(
        archive.describe().contains(&spec),
        "describe: {}",
        archive.describe()
    );
    ensure!(
        archive.checkpoint().await? == 0,
        "a new archive has checkpoint 0"
    );

    let now = now_ms();
    let first = vec![
        event(EventKind::Granted, 3, 0, now, "lock-a"),
        event(EventKind::KeyWritten, 3, 1, now, "cfg/x"),
        event(EventKind::Released, 7, 0, now, "lock-a"),
    ];
    archive.write(&first, 10);
    archive.flush().await?;
    // Only 1y events up to 20: class 7y still gets a segment saying 11..=20 is covered.
    let second = vec![event(EventKind::KeyDeleted, 15, 0, now, "cfg/x")];
    archive.write(&second, 20);
    ensure!(
        archive.flush_if_due(1, Duration::from_secs(3600)).await?,
        "one event is enough for a flush at max_events 1"
    );
    ensure!(archive.checkpoint().await? == 20, "checkpoint after 20");
    let mut expected = first.clone();
    expected.extend(second.clone());
    let read = archive.read_all().await?;
    ensure!(read == expected, "read back: {:?}", revisions(&read));

    // A restarted tailer opens the archive again and replays from revision 0.
    let mut archive = Archive::open(&spec, options.clone()).await?;
    ensure!(archive.checkpoint().await? == 20, "checkpoint on reopening");
    let third = vec![
        event(EventKind::LeaderChanged, 21, 0, now, "election-1"),
        event(EventKind::Waiting, 22, 0, now, "lock-b"),
    ];
    archive.write(&first, 10);
    archive.write(&second, 20);
    archive.write(&third, 25);
    archive.flush().await?;
    expected.extend(third.clone());
    let read = archive.read_all().await?;
    ensure!(read == expected, "after the replay: {:?}", revisions(&read));

    // A segment dated 400 days ago: past class 1y's year, within class 7y's seven.
    let long_ago = now - 400 * DAY_MS;
    let old = vec![
        event(EventKind::Granted, 26, 0, long_ago, "lock-old"),
        event(EventKind::KeyWritten, 27, 0, long_ago, "cfg/old"),
    ];
    archive.write(&old, 27);
    archive.flush().await?;
    let latest = vec![event(EventKind::Released, 28, 0, now, "lock-old")];
    archive.write(&latest, 30);
    archive.flush().await?;
    let removed = archive.expire(now).await?;
    ensure!(
        removed == 1,
        "expire removed {removed} segments, expected 1"
    );
    expected.push(old[0].clone());
    expected.extend(latest);
    let read = archive.read_all().await?;
    ensure!(
        read == expected,
        "after expire only the 1y event of 400 days ago is gone: {:?}",
        revisions(&read)
    );
    ensure!(archive.checkpoint().await? == 30, "checkpoint after expire");
    ensure!(
        archive.expire(now).await? == 0,
        "a second expire removes nothing"
    );
    Ok(())
}

/// Runs `sql` on the server's HTTP interface and returns the answer.
async fn server_query(server: &ClickHouse, sql: &str) -> anyhow::Result<String> {
    lockcell_tests::proxy::http_get(&server.http_addr, &format!("/?query={}", encode(sql)))
        .await
        .with_context(|| format!("querying ClickHouse: {sql}"))
}

fn day_of(time_ms: i64) -> String {
    lockcell_cell::audit::day_of(time_ms)
}
