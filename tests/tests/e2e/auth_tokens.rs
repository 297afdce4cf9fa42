//! etcd's login tokens: they expire when unused (`--auth-token-ttl`) and are forgotten
//! when etcd restarts, and lockcell's clients log in again without anyone noticing.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_cell::audit::EventKind;
use lockcell_cell::rbac;
use lockcell_client::{Client, Condition, Wait, WatchOptions};
use lockcell_tests::audit::AuditProcess;
use lockcell_tests::etcd::EtcdOptions;
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess};

use crate::rbac::{allowed, login};
use crate::support::short_session;

/// Long enough for etcd's 2-second tokens to expire, with room.
const IDLE: Duration = Duration::from_secs(5);

/// Values of `key` seen by `watcher` until one is `last`.
async fn values_until(
    watcher: &mut lockcell_client::Watcher,
    last: &[u8],
) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !seen.iter().any(|v: &Vec<u8>| v == last) {
            for event in watcher.next().await.context("the watch ended")??.events {
                seen.push(event.entry.value);
            }
        }
        anyhow::Ok(())
    })
    .await
    .with_context(|| format!("the watch did not deliver {last:?}; it saw {seen:?}"))??;
    Ok(seen)
}

/// With tokens that live 2 s: after idle times longer than that (no client calls; the
/// proxy's own are lease keepalives and [`rbac::keep_token`]'s reads), grants, writes,
/// open watches and watches from old revisions (which the proxy catches up with a new
/// etcd watch) work, and so they do, and the audit tailer's trail goes on, after etcd
/// restarts and forgets every token.
pub async fn a_proxy_and_the_audit_tailer_keep_working_after_etcd_forgets_their_tokens(
) -> anyhow::Result<()> {
    let options = EtcdOptions {
        // Tokens live 2 s unused. A restarted member replays the log since its last
        // snapshot, log-ins with it, so a snapshot every few entries makes it forget.
        extra_args: ["--auth-token-ttl", "2", "--snapshot-count", "10"]
            .map(String::from)
            .to_vec(),
        ..EtcdOptions::default()
    };
    let mut etcd = EtcdCluster::start_with(1, &options).await?;
    let mut proxy_options = ProxyOptions::new("a", etcd.endpoints());
    // The proxy's lease outlives an etcd restart.
    proxy_options.lease_ttl = Duration::from_secs(15);
    // No history of recent events: a watch from an old revision then opens a watch of
    // etcd's, which is what this test needs a forgotten token to meet.
    proxy_options.extra_args = vec!["--watch-history-bytes".into(), "0".into()];
    let proxy = ProxyProcess::start(&proxy_options, &etcd.dir).await?;
    let client = Client::connect(&proxy.url()).await?;
    let first = client.put("token/a", b"1", Condition::Always).await?;
    // From the revision after the first write: a watch "from now" starts where the
    // proxy's copy of the cell is, which may be just before a write acknowledged a
    // moment ago.
    let after_first = WatchOptions::prefix().from_revision(first.revision + 1);
    let mut live = client.watch("token/", after_first).await?;

    // A client of lockcell's that made no call for longer than the token lives logs in
    // again when etcd refuses the token.
    let admin = etcd.client_as(&login(&etcd, rbac::ADMIN_USER)?).await?;
    tokio::time::sleep(IDLE).await;
    allowed(
        "a read with a token etcd forgot",
        admin.kv_client().get("/sys/epoch", None).await,
    )?;
    let session = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let guard = session
        .acquire("token/lock", Wait::Try)
        .await?
        .context("a free lock was not granted once the proxy's token had expired")?;
    let second = client.put("token/a", b"2", Condition::Always).await?;
    ensure!(
        second.succeeded,
        "a small-key write failed once the token had expired"
    );
    let seen = values_until(&mut live, b"2").await?;
    ensure!(
        seen == [b"2".to_vec()],
        "the watch open across the idle time saw {seen:?}"
    );
    ensure!(guard.release().await?, "the release deleted nothing");

    // A watch from an old revision, opened after another idle time, is caught up from
    // etcd by a watch the proxy opens then.
    tokio::time::sleep(IDLE).await;
    let catch_ups = proxy.metric("lockcell_watch_catch_ups_total").await?;
    let from = WatchOptions::prefix().from_revision(first.revision);
    let mut old = client.watch("token/", from).await?;
    let seen = values_until(&mut old, b"2").await?;
    ensure!(
        seen == [b"1".to_vec(), b"2".to_vec()],
        "a watch from revision {} saw {seen:?}",
        first.revision
    );
    ensure!(
        proxy.metric("lockcell_watch_catch_ups_total").await? > catch_ups,
        "the proxy served the old watch without a watch of etcd: the test proves nothing"
    );

    // etcd restarted after an idle time: every watch of the proxy and of the audit
    // tailer starts again with a token etcd does not know. A waiter is still woken by
    // a release (the proxy learns of it through its watch of /l/), and the tailer
    // records what happens after the restart.
    let data = etcd.dir.join("cell-data");
    let log = etcd.dir.join("audit.log");
    let tailer = AuditProcess::start("run", &etcd.endpoints(), &data, &[], &log).await?;
    // Past the next snapshot, which the tailer's log-in is then before.
    for n in 0..20 {
        client
            .put("token/filler", n.to_string().as_bytes(), Condition::Always)
            .await?;
    }
    tokio::time::sleep(IDLE).await;
    etcd.members[0].process.kill();
    etcd.members[0].process.respawn()?;
    let holder = eventually(
        "a grant after etcd restarted",
        Duration::from_secs(30),
        || async {
            Ok(session
                .acquire("token/wait", Wait::Try)
                .await
                .ok()
                .flatten())
        },
    )
    .await?;
    let other = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let waiting = tokio::spawn(async move {
        other
            .acquire("token/wait", Wait::Timeout(Duration::from_secs(20)))
            .await
            .map(|g| g.map(|g| g.token()))
    });
    eventually(
        "the second session waits",
        Duration::from_secs(10),
        || async { Ok((proxy.metric("lockcell_waiters").await? >= 1.0).then_some(())) },
    )
    .await?;
    ensure!(
        holder.release().await?,
        "the holder's release deleted nothing"
    );
    let woken = waiting
        .await??
        .context("the waiter was not granted the lock after its holder released it")?
        .to_string();
    let mut after = client.watch("token/", WatchOptions::prefix()).await?;
    let third = client.put("token/a", b"3", Condition::Always).await?;
    ensure!(third.succeeded, "a write after the restart failed");
    values_until(&mut after, b"3").await?;
    eventually(
        "the audit trail has the grant made after etcd restarted",
        Duration::from_secs(20),
        || async {
            let history = tailer.history("token/wait").await?;
            Ok(history
                .iter()
                .any(|e| e.kind == EventKind::Granted && e.token == woken)
                .then_some(()))
        },
    )
    .await?;
    tailer.stop().await?;
    Ok(())
}
