//! Two cells behind one shard map: each call reaches the cell that serves its name, and
//! moving a prefix between cells under load never shows two holders of one lock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{
    Client, ClientOptions, Condition, Error, FencingToken, Session, SessionState, Wait,
    WatchOptions,
};
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::watch_client::WatchClient;
use lockcell_proto::v1::{GetRequest, WatchRequest};
use lockcell_tests::wait::eventually;
use lockcell_tests::{EtcdCluster, ProxyOptions, ProxyProcess};
use nix::sys::signal::Signal;
use tonic::transport::Channel;

use crate::cell::lockcell_cell;
use crate::support::short_session;

/// Runs `lockcell-cell shardmap ARGS --etcd ENDPOINT`.
fn shardmap_at(endpoint: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["shardmap"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--etcd", endpoint]);
    lockcell_cell(&all)
}

/// The lock the workers take in turn while its prefix moves.
const HOT: &str = "billing/hot";

/// The create revision and lease of `key` in `etcd`.
async fn holder(etcd: &EtcdCluster, key: &str) -> anyhow::Result<(i64, i64)> {
    let mut kv = etcd.client().await?.kv_client();
    let resp = kv.get(key, None).await?;
    let kv = resp
        .kvs()
        .first()
        .with_context(|| format!("no key {key}"))?;
    Ok((kv.create_revision(), kv.lease()))
}

/// Keys under `prefix` in `etcd` (as root).
async fn keys_under(etcd: &EtcdCluster, prefix: &str) -> anyhow::Result<Vec<String>> {
    let mut kv = etcd.client().await?.kv_client();
    let resp = kv
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await?;
    Ok(resp
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect())
}

/// Cells a and b (one etcd member each), and a shard map file routing `routes`
/// (prefix, cell) in a fresh folder.
async fn two_cells(
    routes: &[(&str, &str)],
) -> anyhow::Result<(
    tempfile::TempDir,
    EtcdCluster,
    EtcdCluster,
    std::path::PathBuf,
)> {
    let dir = tempfile::tempdir()?;
    let cell_a = EtcdCluster::start(1).await?;
    let cell_b = EtcdCluster::start(1).await?;
    let mut file = format!(
        "[cells.a]\nendpoints = [{:?}]\n[cells.b]\nendpoints = [{:?}]\n",
        cell_a.endpoints()[0],
        cell_b.endpoints()[0]
    );
    for (prefix, cell) in routes {
        file.push_str(&format!(
            "\n[[route]]\nprefix = {prefix:?}\ncell = {cell:?}\n"
        ));
    }
    let map = dir.path().join("shardmap.toml");
    std::fs::write(&map, file)?;
    Ok((dir, cell_a, cell_b, map))
}

/// Two cells behind a shard map routing `routes`, and one proxy started on cell a.
struct OnCellA {
    _dir: tempfile::TempDir,
    a: EtcdCluster,
    b: EtcdCluster,
    a_endpoint: String,
    proxy: ProxyProcess,
    client: Client,
}

async fn proxy_on_a(routes: &[(&str, &str)]) -> anyhow::Result<OnCellA> {
    let (dir, a, b, map) = two_cells(routes).await?;
    let a_endpoint = a.endpoints()[0].clone();
    shardmap_at(&a_endpoint, &["set", &map.display().to_string()])?;
    let proxy = ProxyProcess::start(&ProxyOptions::new("a", a.endpoints()), dir.path()).await?;
    let client = Client::connect(&proxy.url()).await?;
    Ok(OnCellA {
        _dir: dir,
        a,
        b,
        a_endpoint,
        proxy,
        client,
    })
}

async fn epoch_of(etcd: &EtcdCluster) -> anyhow::Result<u64> {
    let mut kv = etcd.client().await?.kv_client();
    let stored = lockcell_cell::epoch::read(&mut kv, Duration::from_secs(5))
        .await?
        .context("no epoch record")?;
    Ok(stored.record.epoch)
}

/// What the workers saw: every grant's token in grant order, and any moment two of them
/// held the lock at once.
#[derive(Default)]
struct Ledger {
    /// Set while a worker holds [`HOT`]; cleared before its release is sent.
    held: AtomicBool,
    overlaps: AtomicU64,
    tokens: Mutex<Vec<FencingToken>>,
    refused_while_moving: AtomicU64,
}

/// Takes [`HOT`] again and again until `stop`, each hold checked against the others.
async fn worker(
    session: Session,
    ledger: Arc<Ledger>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    while !stop.load(Ordering::Relaxed) {
        match session
            .acquire(HOT, Wait::Timeout(Duration::from_secs(2)))
            .await
        {
            Ok(Some(guard)) => {
                if ledger.held.swap(true, Ordering::SeqCst) {
                    ledger.overlaps.fetch_add(1, Ordering::SeqCst);
                }
                ledger.tokens.lock().unwrap().push(guard.token());
                tokio::task::yield_now().await;
                ledger.held.store(false, Ordering::SeqCst);
                guard.release().await?;
            }
            Ok(None) => {}
            // The prefix is paused in its old cell while the move runs.
            Err(Error::Unavailable(why)) => {
                ensure!(
                    why.contains("moving") || why.contains("shard map"),
                    "refused for another reason than the move: {why}"
                );
                ledger.refused_while_moving.fetch_add(1, Ordering::Relaxed);
                // Pacing of the retry loop (not a wait for a condition).
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e).context("a worker's acquire failed"),
        }
    }
    Ok(())
}

pub async fn two_cells_route_correctly_and_a_prefix_move_never_shows_two_holders(
) -> anyhow::Result<()> {
    let (dir, cell_a, cell_b, map) =
        two_cells(&[("orders/", "a"), ("billing/", "b"), ("inventory/", "b")]).await?;
    let a_endpoint = cell_a.endpoints()[0].clone();
    lockcell_cell(&[
        "shardmap",
        "set",
        &map.display().to_string(),
        "--etcd",
        &a_endpoint,
    ])?;
    let shown = lockcell_cell(&["shardmap", "show", "--etcd", &a_endpoint])?;
    ensure!(
        shown.contains("billing/") && shown.contains("orders/"),
        "`shardmap show` does not show the routes:\n{shown}"
    );

    // One proxy started on each cell: both serve both cells.
    let proxy_a =
        ProxyProcess::start(&ProxyOptions::new("a", cell_a.endpoints()), dir.path()).await?;
    let proxy_b =
        ProxyProcess::start(&ProxyOptions::new("b", cell_b.endpoints()), dir.path()).await?;
    let client_a = Client::connect(&proxy_a.url()).await?;
    let client_b = Client::connect(&proxy_b.url()).await?;
    let (epoch_a, epoch_b) = (epoch_of(&cell_a).await?, epoch_of(&cell_b).await?);

    // One session holds a lock in each cell; each holder key is in its own cell only.
    let session = client_b
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let order = session
        .acquire("orders/1", Wait::Timeout(Duration::from_secs(5)))
        .await?
        .context("orders/1 not granted")?;
    let bill = session
        .acquire("billing/1", Wait::Timeout(Duration::from_secs(5)))
        .await?
        .context("billing/1 not granted")?;
    ensure!(
        keys_under(&cell_a, "/l/orders/1/").await? != Vec::<String>::new()
            && keys_under(&cell_b, "/l/orders/1/").await?.is_empty(),
        "orders/1 is not held in cell a alone"
    );
    ensure!(
        keys_under(&cell_b, "/l/billing/1/").await? != Vec::<String>::new()
            && keys_under(&cell_a, "/l/billing/1/").await?.is_empty(),
        "billing/1 is not held in cell b alone"
    );
    // Cell a served every name before the map: tokens of names the map sends to b rise
    // above a's epoch.
    ensure!(
        order.token().epoch == epoch_a
            && bill.token().epoch >= epoch_b
            && bill.token().epoch > epoch_a,
        "tokens are not in their routes' epochs: {} (cell a at {epoch_a}), {} (cell b at {epoch_b})",
        order.token(),
        bill.token()
    );
    // Small keys too, and reads and watches of one cell's prefix.
    let mut watcher = client_a.watch("billing/", WatchOptions::prefix()).await?;
    client_a
        .put("billing/config", b"v1", Condition::Always)
        .await?;
    client_a
        .put("orders/config", b"o1", Condition::Always)
        .await?;
    ensure!(
        keys_under(&cell_b, "/k/billing/config").await?.len() == 1
            && keys_under(&cell_a, "/k/billing/config").await?.is_empty(),
        "billing/config is not in cell b alone"
    );
    let batch = tokio::time::timeout(Duration::from_secs(10), watcher.next())
        .await
        .context("the watch of billing/ saw nothing")?
        .context("the watch ended")??;
    ensure!(
        batch.events.iter().any(|e| e.entry.key == "billing/config"),
        "the watch of billing/ did not see billing/config: {batch:?}"
    );
    drop(watcher);
    // Names no cell serves, and prefixes that span both cells, are refused.
    let stray = session
        .acquire("misc/x", Wait::Timeout(Duration::from_secs(1)))
        .await;
    ensure!(
        matches!(&stray, Err(e) if e.to_string().contains("no cell serves")),
        "a lock no cell serves was not refused: {:?}",
        stray.map(|g| g.map(|g| g.token()))
    );
    let spanning = client_a.get_prefix("").await;
    ensure!(
        matches!(&spanning, Err(e) if e.to_string().contains("cells a, b")),
        "a read across both cells was not refused: {spanning:?}"
    );
    ensure!(bill.release().await?, "billing/1 was not released");

    // The move, under load: workers on both proxies take billing/hot in turn.
    let ledger = Arc::new(Ledger::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = tokio::task::JoinSet::new();
    for client in [&client_a, &client_a, &client_b, &client_b] {
        let s = client
            .open_session(short_session(Duration::from_secs(5)))
            .await?;
        workers.spawn(worker(s, ledger.clone(), stop.clone()));
    }
    let grants = |ledger: &Ledger| ledger.tokens.lock().unwrap().len();
    eventually(
        "the workers take billing/hot",
        Duration::from_secs(20),
        || {
            let n = grants(&ledger);
            async move { Ok((n >= 20).then_some(())) }
        },
    )
    .await?;
    let before = grants(&ledger);
    // A watch of billing/ in cell b: it must not go quiet when the names move to a.
    let mut moving_watch = client_a.watch("billing/", WatchOptions::prefix()).await?;
    // A holder in cell b that keeps its lock while the move starts: the move must wait
    // for it, granting nothing under billing/ anywhere meanwhile.
    let long = session
        .acquire("billing/long", Wait::Timeout(Duration::from_secs(5)))
        .await?
        .context("billing/long not granted")?;
    let moving = tokio::task::spawn_blocking(move || {
        lockcell_cell(&[
            "shardmap",
            "move",
            "billing/",
            "--to",
            "a",
            "--etcd",
            &a_endpoint,
            "--wait",
            "60s",
        ])
    });
    eventually(
        "the workers are refused while billing/ is paused",
        Duration::from_secs(30),
        || {
            // Or the move ended: then it did not wait for billing/long (checked next).
            let seen =
                ledger.refused_while_moving.load(Ordering::Relaxed) >= 10 || moving.is_finished();
            async move { Ok(seen.then_some(())) }
        },
    )
    .await?;
    let during = grants(&ledger);
    let copy_in_a = lockcell_cell::shardmap::read(
        &mut cell_a.client().await?.kv_client(),
        Duration::from_secs(5),
    )
    .await?
    .context("cell a has no shard map")?;
    ensure!(
        !moving.is_finished()
            && copy_in_a.map.route("billing/long").map(|r| r.cell.as_str()) == Some("b"),
        "the move switched billing/ to cell a while billing/long was held in b: {:?}",
        copy_in_a.map
    );
    let second = client_b
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let refused = second
        .acquire("billing/long", Wait::Timeout(Duration::from_secs(1)))
        .await;
    ensure!(
        matches!(&refused, Err(Error::Unavailable(why)) if why.contains("moving")),
        "an acquire under a paused prefix was not refused as moving: {:?}",
        refused.map(|g| g.map(|g| g.token()))
    );
    ensure!(long.release().await?, "billing/long was not released");
    let moved = moving.await??;
    let at_move = grants(&ledger);
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(Err(e)) = moving_watch.next().await {
                return e;
            }
        }
    })
    .await
    .context("a watch of billing/ went on in cell b after the names moved to a")?;
    ensure!(
        matches!(ended, Error::WatchMoved { .. }),
        "the watch of billing/ ended for another reason than the move: {ended}"
    );
    eventually(
        "the workers take billing/hot in its new cell",
        Duration::from_secs(30),
        || {
            let n = grants(&ledger);
            async move { Ok((n >= at_move + 20).then_some(())) }
        },
    )
    .await?;
    stop.store(true, Ordering::Relaxed);
    while let Some(done) = workers.join_next().await {
        done??;
    }

    ensure!(
        ledger.overlaps.load(Ordering::SeqCst) == 0,
        "two workers held billing/hot at once {} time(s) (move output:\n{moved})",
        ledger.overlaps.load(Ordering::SeqCst)
    );
    let tokens = ledger.tokens.lock().unwrap().clone();
    for pair in tokens.windows(2) {
        ensure!(
            pair[1] > pair[0],
            "tokens of billing/hot went backwards across the move: {} then {}",
            pair[0],
            pair[1]
        );
    }
    let last = tokens.last().context("no grants")?;
    ensure!(
        last.epoch > epoch_a.max(epoch_b),
        "the moved prefix's tokens are not in a raised epoch: {last} (cells at {epoch_a} and {epoch_b})"
    );
    // Now served by cell a: a holder key there, none left in b; the small key copied.
    let check = session
        .acquire("billing/check", Wait::Timeout(Duration::from_secs(5)))
        .await?
        .context("billing/check not granted after the move")?;
    // (Release markers, which hold nothing, stay in b on their proxy's lease.)
    let held_in_b: Vec<String> = keys_under(&cell_b, "/l/billing/")
        .await?
        .into_iter()
        .filter(|k| !k.ends_with("/!r"))
        .collect();
    ensure!(
        !keys_under(&cell_a, "/l/billing/check/").await?.is_empty() && held_in_b.is_empty(),
        "after the move billing/ locks are not in cell a alone (in b: {held_in_b:?})"
    );
    let config = client_b.get("billing/config").await?;
    ensure!(
        config.as_ref().map(|e| e.value.as_slice()) == Some(b"v1".as_slice()),
        "billing/config did not move with its prefix: {config:?}"
    );
    ensure!(
        keys_under(&cell_b, "/k/billing/").await?.is_empty(),
        "billing/config was left behind in cell b"
    );
    check.release().await?;
    order.release().await?;
    session.close().await?;

    // A session holding in both cells survives the loss of its proxy: it resumes on the
    // other, and its keys move in each cell, tokens unchanged.
    let client = Client::connect_with(ClientOptions::new([proxy_b.url(), proxy_a.url()])).await?;
    let both = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let b_proxy = both.proxy_id();
    let in_a = both
        .acquire("orders/2", Wait::Timeout(Duration::from_secs(5)))
        .await?
        .context("orders/2 not granted")?;
    let in_b = both
        .acquire("inventory/2", Wait::Timeout(Duration::from_secs(5)))
        .await?
        .context("inventory/2 not granted")?;
    let held_before = (
        holder(&cell_a, "/l/orders/2/!x").await?,
        holder(&cell_b, "/l/inventory/2/!x").await?,
    );
    let resumed_before = proxy_a.metric("lockcell_sessions_resumed_total").await?;
    proxy_b.signal(Signal::SIGKILL)?;
    eventually(
        "the session resumes on the other proxy",
        Duration::from_secs(15),
        || async {
            Ok((both.proxy_id() != b_proxy && both.state() == SessionState::Valid).then_some(()))
        },
    )
    .await?;
    // One session resumed, with a stay in each cell: counted once.
    let resumed_after = proxy_a.metric("lockcell_sessions_resumed_total").await?;
    ensure!(
        resumed_after - resumed_before == 1.0,
        "lockcell_sessions_resumed_total went from {resumed_before} to {resumed_after} for one session"
    );
    // Past the dead proxy's lease TTL its leases are gone in both cells, and what was on
    // them with them: the moved keys are not.
    eventually(
        "etcd drops the dead proxy's leases in both cells",
        Duration::from_secs(15),
        || async {
            let a = cell_a.client().await?.leases().await?.leases().len();
            let b = cell_b.client().await?.leases().await?.leases().len();
            Ok((a == 4 && b == 4).then_some(()))
        },
    )
    .await?;
    let held_after = (
        holder(&cell_a, "/l/orders/2/!x").await?,
        holder(&cell_b, "/l/inventory/2/!x").await?,
    );
    ensure!(
        held_after.0 .0 == held_before.0 .0 && held_after.1 .0 == held_before.1 .0 && held_after.0 .1 != held_before.0 .1 && held_after.1 .1 != held_before.1 .1,
        "the keys did not move to the new proxy's leases with their tokens kept: before {held_before:?}, after {held_after:?}"
    );
    for (lock, guard) in [("orders/2", &in_a), ("inventory/2", &in_b)] {
        let check = client.check_sequencer(lock, guard.token()).await?;
        ensure!(
            guard.is_valid() && check.current,
            "{lock}'s token {} is not current after the move ({check:?})",
            guard.token()
        );
    }
    ensure!(
        in_a.release().await? && in_b.release().await?,
        "not released after the move"
    );
    both.close().await?;
    eprintln!(
        "shardmap: {before} grants before the move, {} while it waited for billing/long ({} after), {} after it; {} acquires refused while the prefix moved",
        during - before,
        at_move - during,
        tokens.len() - at_move,
        ledger.refused_while_moving.load(Ordering::Relaxed)
    );
    Ok(())
}

/// A prefix moves from cell a to b; a key of it is deleted (and another changed) in b;
/// the cell a is left holding their old copies, as a move whose last step (deleting the
/// copies from the source) was interrupted leaves them. Moving the prefix back to a
/// must not serve the deleted key again, nor the old value.
pub async fn a_key_deleted_after_a_move_does_not_come_back_when_its_prefix_moves_back(
) -> anyhow::Result<()> {
    let cells = proxy_on_a(&[("cfg/", "a"), ("other/", "b")]).await?;
    let (cell_a, cell_b, proxy, client) = (&cells.a, &cells.b, &cells.proxy, &cells.client);
    let shardmap = |args: &[&str]| shardmap_at(&cells.a_endpoint, args);
    for key in ["cfg/gone", "cfg/kept", "cfg/changed"] {
        client.put(key, b"v1", Condition::Always).await?;
    }

    let read = |key: &'static str| {
        let client = client.clone();
        async move { Ok::<_, anyhow::Error>(client.get(key).await?.map(|e| e.value)) }
    };
    let before = KvClient::new(Channel::from_shared(proxy.url())?.connect().await?)
        .get(GetRequest {
            key: "cfg/".into(),
            prefix: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut a = cell_a.client().await?;

    // A key deleted while cfg/ lived in b.
    shardmap(&["move", "cfg/", "--to", "b"])?;
    client.delete("cfg/gone", Condition::Always).await?;
    a.put("/k/cfg/gone", "v1", None).await?; // what an interrupted step 6 leaves in a
    shardmap(&["move", "cfg/", "--to", "a"])?;
    ensure!(
        read("cfg/gone").await?.is_none(),
        "a key deleted in b came back when cfg/ moved back to a"
    );
    ensure!(read("cfg/kept").await? == Some(b"v1".to_vec()));

    // A key changed while cfg/ lived in b.
    shardmap(&["move", "cfg/", "--to", "b"])?;
    client.put("cfg/changed", b"v2", Condition::Always).await?;
    a.put("/k/cfg/changed", "v1", None).await?;
    shardmap(&["move", "cfg/", "--to", "a"])?;
    ensure!(
        read("cfg/changed").await? == Some(b"v2".to_vec()),
        "cfg/changed does not read as last written in b"
    );
    ensure!(
        keys_under(cell_b, "/k/cfg/").await?.is_empty(),
        "cell b still holds keys of cfg/ after it moved away"
    );
    // A watch position taken in a before the round trip is not a's again: a's history
    // lacks what was written in b meanwhile.
    let mut raw_watch = WatchClient::new(Channel::from_shared(proxy.url())?.connect().await?);
    let refused = async {
        let mut stream = raw_watch
            .watch(WatchRequest {
                key: "cfg/".into(),
                prefix: true,
                start_revision: before.revision + 1,
                cell: before.cell.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => anyhow::bail!("the watch ended without an error"),
                Err(status) => return Ok::<_, anyhow::Error>(status),
            }
        }
    };
    let status = match refused.await {
        Ok(status) => status,
        Err(e) => match e.downcast::<tonic::Status>() {
            Ok(status) => status,
            Err(e) => return Err(e),
        },
    };
    ensure!(
        status.code() == tonic::Code::OutOfRange
            && status.metadata().get("lockcell-watch-cell").is_some(),
        "a watch from before cfg/ moved away and back resumed: {status:?}"
    );
    Ok(())
}

/// A watcher's position is a revision of one cell. Its proxy restarts while the
/// watched prefix moves to another cell, whose revisions are unrelated: resumed there
/// from the old cell's revision, it would skip what the new cell wrote below that
/// revision. The watch must end with [`Error::WatchMoved`] instead, and a membership
/// follower must read the group again and report the difference.
pub async fn a_watch_resumed_across_a_prefix_move_ends_rather_than_skip_events(
) -> anyhow::Result<()> {
    let (dir, cell_a, cell_b, map) = two_cells(&[("", "a"), ("other/", "b")]).await?;
    let a_endpoint = cell_a.endpoints()[0].clone();
    let shardmap = |args: &[&str]| shardmap_at(&a_endpoint, args);
    shardmap(&["set", &map.display().to_string()])?;
    let options = ProxyOptions::new("a", cell_a.endpoints());
    let mut proxy = ProxyProcess::start(&options, dir.path()).await?;
    let other =
        ProxyProcess::start(&ProxyOptions::new("b", cell_b.endpoints()), dir.path()).await?;
    let client = Client::connect(&proxy.url()).await?;
    // Cell a's revisions run ahead of cell b's.
    for i in 0..40 {
        client
            .put(&format!("busy/{i}"), b"v", Condition::Always)
            .await?;
    }
    let member = client
        .open_session(short_session(Duration::from_secs(30)))
        .await?;
    member.announce("web", "host-1", b"1").await?;
    client.put("billing/old", b"v", Condition::Always).await?;
    let mut watch = client
        .watch(
            "billing/",
            WatchOptions::prefix()
                .from_revision(1)
                .reconnecting_for(Duration::from_secs(30)),
        )
        .await?;
    let first = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await?
        .context("the watch ended")??;
    ensure!(
        first.events.iter().any(|e| e.entry.key == "billing/old"),
        "the watch from revision 1 did not deliver billing/old: {first:?}"
    );
    let position = watch.revision();
    let mut group = client.members("web").await?;
    ensure!(group.current().contains_key("host-1"));

    // The session that announced host-1 closes and the proxy stops. Meanwhile billing/
    // and members/ move to cell b, where billing/new is written and host-2 joins, and
    // cell b's revisions then pass the watcher's position.
    let listen = proxy.addr.clone();
    member.close().await?;
    proxy.process.kill();
    shardmap(&["move", "billing/", "--to", "b"]).context("moving billing/")?;
    shardmap(&["move", "members/", "--to", "b"]).context("moving members/")?;
    let writer = Client::connect(&other.url()).await?;
    let new = writer
        .put("billing/new", b"v", Condition::Always)
        .await?
        .revision;
    let joiner = writer
        .open_session(short_session(Duration::from_secs(30)))
        .await?;
    joiner.announce("web", "host-2", b"2").await?;
    let mut i = 0;
    while cell_b.revision().await? <= position + 1 {
        writer
            .put(&format!("other/{i}"), b"v", Condition::Always)
            .await?;
        i += 1;
    }
    ensure!(
        new <= position,
        "billing/new (revision {new} in cell b) is not below the watcher's position {position}"
    );
    let mut restarted = options.clone();
    restarted.listen = Some(listen);
    // A log of its own, so the wait for it to serve reads the new process's.
    restarted.zone = "a-again".into();
    let _proxy = ProxyProcess::start(&restarted, dir.path())
        .await
        .context("restarting the proxy")?;

    let resumed = tokio::time::timeout(Duration::from_secs(20), watch.next())
        .await
        .context("the watcher heard nothing within 20s of its proxy's restart")?;
    match resumed {
        Some(Err(Error::WatchMoved { cell, .. })) => {
            println!("the watch ended: cell {cell} serves billing/ now")
        }
        Some(Ok(batch)) if batch.events.iter().any(|e| e.entry.key == "billing/new") => {
            println!("the watch delivered billing/new")
        }
        other => anyhow::bail!(
            "the watcher resumed in the new cell from the old cell's revision {position}: {other:?}"
        ),
    }

    // The membership follower reads the group again: host-1 left, host-2 joined.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !group.current().contains_key("host-2") || group.current().contains_key("host-1") {
        let changes = tokio::time::timeout_at(deadline, group.changed())
            .await
            .context("the group did not show host-1 gone and host-2 in within 20s")??;
        println!("membership changes: {changes:?}");
    }
    Ok(())
}

/// How many times `proxy`'s log says `text`.
fn times_logged(proxy: &ProxyProcess, text: &str) -> usize {
    std::fs::read_to_string(proxy.log_path())
        .map(|log| log.matches(text).count())
        .unwrap_or(0)
}

/// A proxy whose own view of the shard map lags (its map followers backing off after
/// failures) must not answer a linearizable read from the cell a prefix left: a write
/// acknowledged in the new cell before the read began is seen, or the read is refused.
pub async fn a_linearizable_read_during_a_move_never_answers_from_the_cell_left(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cell_a, cell_b) = (EtcdCluster::start(1).await?, EtcdCluster::start(1).await?);
    // The proxy reaches both cells only through relays the test can make refuse.
    let (link_a, link_b) = (
        lockcell_tests::Relay::start(&cell_a.endpoints()[0]).await?,
        lockcell_tests::Relay::start(&cell_b.endpoints()[0]).await?,
    );
    let map = dir.path().join("shardmap.toml");
    std::fs::write(
        &map,
        format!(
            "[cells.a]\nendpoints = [{:?}]\n[cells.b]\nendpoints = [{:?}]\n\n\
             [[route]]\nprefix = \"\"\ncell = \"a\"\n\n[[route]]\nprefix = \"other/\"\ncell = \"b\"\n",
            link_a.addr, link_b.addr
        ),
    )?;
    let a_endpoint = cell_a.endpoints()[0].clone();
    let shardmap = |args: &[&str]| shardmap_at(&a_endpoint, args);
    shardmap(&["set", &map.display().to_string()])?;
    let proxy = ProxyProcess::start(
        &ProxyOptions::new("a", vec![link_a.addr.clone()]),
        dir.path(),
    )
    .await?;
    let client = Client::connect(&proxy.url()).await?;
    client.put("billing/x", b"old", Condition::Always).await?;

    // Both cells unreachable until each of the proxy's map followers has failed six
    // times: each waits 5 s before its next try from then on.
    const FOLLOW_FAILED: &str = "following the cell's shard map failed";
    let before = times_logged(&proxy, FOLLOW_FAILED);
    link_a.refuse(true);
    link_b.refuse(true);
    eventually(
        "the proxy's map followers back off to their longest pause",
        Duration::from_secs(30),
        || async { Ok((times_logged(&proxy, FOLLOW_FAILED) >= before + 12).then_some(())) },
    )
    .await?;
    link_a.refuse(false);
    link_b.refuse(false);
    // Reads work again: the proxy follows both cells' logs once more.
    eventually(
        "a read through the proxy works again",
        Duration::from_secs(15),
        || async { Ok(client.get("billing/x").await.ok().flatten().map(|_| ())) },
    )
    .await?;

    // billing/ moves to b, where it is written at once; then a read through the proxy.
    let moving = std::time::Instant::now();
    shardmap(&["move", "billing/", "--to", "b"]).context("moving billing/")?;
    cell_b
        .client()
        .await?
        .put("/k/billing/x", "new", None)
        .await?;
    let written = moving.elapsed();
    let mut fresh = 0;
    let mut refused = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while fresh < 3 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no fresh read of billing/x within 10s of the move ({refused} refused)"
        );
        match client.get("billing/x").await {
            Ok(entry) => {
                let value = entry.map(|e| e.value);
                ensure!(
                    value.as_deref() == Some(&b"new"[..]),
                    "a linearizable read after the move returned {:?}, not the value written in cell b ({written:?} after the move began)",
                    value.map(|v| String::from_utf8_lossy(&v).into_owned())
                );
                fresh += 1;
            }
            Err(e) => {
                refused += 1;
                println!("read refused: {e}");
            }
        }
    }
    println!("moved and written in {written:?}; {fresh} fresh reads, {refused} refused");
    Ok(())
}

/// `lockctl` with `--proxy proxy` and `args`: its exit status, stdout and stderr.
async fn lockctl_at(proxy: &str, args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let out = tokio::process::Command::new(lockcell_tests::bins::workspace_bin("lockctl")?)
        .arg("--proxy")
        .arg(proxy)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// A read's position names its cell, and everything that goes on from it checks the
/// cell: a key is read (`lockctl get --position`, the SDK's snapshot), its prefix moves
/// to another cell and is written there, and then a watch after that read (`lockctl
/// watch --after`, `WatchOptions::after`) and a read at its revision (`GetRequest.cell`)
/// are refused rather than read the new cell's history from the old cell's revision.
/// From a read made after the move, the watch follows on.
pub async fn a_reads_position_carried_across_a_move_is_refused_not_read_in_the_other_cell(
) -> anyhow::Result<()> {
    let cells = proxy_on_a(&[("", "a"), ("other/", "b")]).await?;
    let (proxy, client) = (&cells.proxy, &cells.client);
    let shardmap = |args: &[&str]| shardmap_at(&cells.a_endpoint, args);
    // Cell a's revisions run ahead of cell b's.
    for i in 0..20 {
        client
            .put(&format!("busy/{i}"), b"v", Condition::Always)
            .await?;
    }
    client.put("cfg/x", b"1", Condition::Always).await?;

    let (status, out, err) = lockctl_at(&proxy.addr, &["get", "--position", "cfg/x"]).await?;
    ensure!(status == Some(0), "lockctl get --position failed: {err}");
    let mut lines = out.lines();
    let position = lines.next().context("no position line")?.to_owned();
    ensure!(
        lines.next() == Some("1"),
        "lockctl get --position did not print the value after the position:\n{out}"
    );
    let at: lockcell_client::CellRevision = position.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(
        !at.cell.is_empty(),
        "the position names no cell: {position}"
    );
    let snapshot = client.snapshot("cfg/x").await?;
    ensure!(snapshot.at.cell == at.cell, "{:?} vs {at:?}", snapshot.at);
    let mut kv = lockcell_proto::v1::kv_client::KvClient::connect(proxy.url()).await?;
    let at_revision = |cell: String| GetRequest {
        key: "cfg/x".into(),
        revision: at.revision,
        cell,
        ..Default::default()
    };
    let before = kv.get(at_revision(at.cell.clone())).await?.into_inner();
    ensure!(
        before.kvs.first().map(|k| k.value.as_slice()) == Some(b"1".as_slice()),
        "a read at the position's revision in its own cell: {before:?}"
    );
    ensure!(
        before.revision == at.revision,
        "a read at revision {} says it reflects revision {}",
        at.revision,
        before.revision
    );

    shardmap(&["move", "cfg/", "--to", "b"]).context("moving cfg/")?;
    client.put("cfg/x", b"2", Condition::Always).await?;

    let refused = kv
        .get(at_revision(at.cell.clone()))
        .await
        .err()
        .context("a read at a revision of the cell cfg/ left was answered")?;
    ensure!(
        refused.code() == tonic::Code::OutOfRange
            && refused.metadata().get("lockcell-watch-cell").is_some(),
        "a read at a revision of the cell cfg/ left: {refused:?}"
    );
    println!("read at {position} refused: {}", refused.message());
    match client
        .watch("cfg/x", WatchOptions::default().after(&snapshot.at))
        .await
    {
        Err(Error::WatchMoved { cell, .. }) => ensure!(cell != at.cell),
        other => anyhow::bail!("a watch after a read in the cell cfg/ left: {other:?}"),
    }
    let (status, _, err) =
        lockctl_at(&proxy.addr, &["watch", "cfg/x", "--after", &position]).await?;
    ensure!(
        status == Some(4) && err.contains("at another position now"),
        "lockctl watch --after a position in the cell cfg/ left: status {status:?}, {err}"
    );

    // From a read in the cell that serves cfg/ now, the watch follows on.
    let now = client.snapshot("cfg/x").await?;
    ensure!(
        now.at.cell != at.cell,
        "the position did not change: {now:?}"
    );
    // The new position with a revision from before cfg/ came to cell b: the copy the
    // move made and what came before it are not cfg/'s history there.
    let before_it = lockcell_client::CellRevision {
        revision: 1,
        cell: now.at.cell.clone(),
    };
    match client
        .watch("cfg/x", WatchOptions::default().after(&before_it))
        .await
    {
        Err(Error::WatchMoved { .. }) => {}
        other => anyhow::bail!("a watch from before the position began: {other:?}"),
    }
    let early = kv
        .get(GetRequest {
            key: "cfg/x".into(),
            revision: 1,
            cell: now.at.cell.clone(),
            ..Default::default()
        })
        .await
        .err()
        .context("a read at a revision from before the position began was answered")?;
    ensure!(early.code() == tonic::Code::OutOfRange, "{early:?}");
    let malformed = kv
        .get(GetRequest {
            key: "cfg/x".into(),
            revision: now.at.revision,
            cell: "bogus".into(),
            ..Default::default()
        })
        .await
        .err()
        .context("a malformed cell was taken")?;
    ensure!(
        malformed.code() == tonic::Code::InvalidArgument,
        "{malformed:?}"
    );
    ensure!(now.entries.first().map(|e| e.value.as_slice()) == Some(b"2".as_slice()));
    let mut watch = client
        .watch("cfg/x", WatchOptions::default().after(&now.at))
        .await?;
    client.put("cfg/x", b"3", Condition::Always).await?;
    let batch = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await?
        .context("the watch ended")??;
    ensure!(
        batch.events.len() == 1 && batch.events[0].entry.value == b"3",
        "the watch after the new read: {batch:?}"
    );
    Ok(())
}

/// A prefix moved between cells, in the audit trail: each cell's tailer records its part
/// (the copy in the new cell, the clean-up in the old one) as the move's, and `lockctl
/// audit` given both tailers shows the key's whole history in time order.
pub async fn a_moved_keys_history_spans_both_cells_trails_with_the_move_marked(
) -> anyhow::Result<()> {
    let cells = proxy_on_a(&[("cfg/", "a"), ("other/", "b")]).await?;
    let dir = tempfile::tempdir()?;
    let tailer = |etcd: &EtcdCluster, name: &str| {
        let (endpoints, data, log) = (
            etcd.endpoints(),
            dir.path().join(name),
            dir.path().join(format!("{name}.log")),
        );
        async move {
            lockcell_tests::audit::AuditProcess::start("run", &endpoints, &data, &[], &log).await
        }
    };
    let in_a = tailer(&cells.a, "a").await?;
    let in_b = tailer(&cells.b, "b").await?;
    cells
        .client
        .put("cfg/moved", b"v1", Condition::Always)
        .await?;
    shardmap_at(&cells.a_endpoint, &["move", "cfg/", "--to", "b"])?;

    let mover = |e: &lockcell_cell::audit::AuditEvent| {
        e.identity.starts_with("lockcell-cell shardmap move")
    };
    let copied = eventually(
        "cell b's trail has the move's copy",
        Duration::from_secs(20),
        || async {
            let events = in_b.history("cfg/moved").await?;
            Ok(events
                .into_iter()
                .find(|e| e.kind == lockcell_cell::audit::EventKind::KeyWritten))
        },
    )
    .await?;
    ensure!(
        mover(&copied) && copied.detail.contains("the copy"),
        "cell b's key_written does not say it is the move's copy: {copied:?}"
    );
    let cleaned = eventually(
        "cell a's trail has the move's clean-up",
        Duration::from_secs(20),
        || async {
            let events = in_a.history("cfg/moved").await?;
            Ok(events
                .into_iter()
                .find(|e| e.kind == lockcell_cell::audit::EventKind::KeyDeleted))
        },
    )
    .await?;
    ensure!(
        mover(&cleaned) && cleaned.detail.contains("lives on"),
        "cell a's key_deleted does not say it is the move's clean-up: {cleaned:?}"
    );

    let tailers = format!("http://{},http://{}", in_a.addr, in_b.addr);
    let out = std::process::Command::new(lockcell_tests::bins::workspace_bin("lockctl")?)
        .args(["audit", "cfg/moved", "--audit", &tailers])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let kinds: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            let kind = l.split_whitespace().nth(1)?;
            let cell = l.rsplit_once("cell=")?.1;
            Some((kind, cell))
        })
        .collect();
    let (a, b) = (in_a.addr.as_str(), in_b.addr.as_str());
    ensure!(
        out.status.success()
            && kinds == [("key_written", a), ("key_written", b), ("key_deleted", a)],
        "lockctl audit over both tailers printed ({}):\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
