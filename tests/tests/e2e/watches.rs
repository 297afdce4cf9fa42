//! Watches on small keys: every event once, in revision order, across a proxy restart
//! and a resume; compaction reported with its revision; a slow watcher cut off while a
//! fast one keeps receiving; a thousand watchers that cost etcd nothing more.

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::watch_client::WatchClient;
use lockcell_proto::v1::watch_event::Kind;
use lockcell_proto::v1::{DeleteRequest, GetRequest, PutRequest, WatchRequest, WatchResponse};
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess, Relay};
use rand::Rng;
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

use crate::support::cell;

/// An event as the tests compare them: revision, key, put or delete.
type Seen = (i64, String, bool);

async fn channel(proxy: &ProxyProcess) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(proxy.url())?.connect().await?)
}

fn prefix_from(prefix: &str, start_revision: i64) -> WatchRequest {
    WatchRequest {
        key: prefix.to_owned(),
        prefix: true,
        start_revision,
        ..Default::default()
    }
}

/// Opens a watch and checks its first response says it is set up.
async fn open(
    channel: &Channel,
    request: WatchRequest,
) -> anyhow::Result<Streaming<WatchResponse>> {
    let mut stream = WatchClient::new(channel.clone())
        .watch(request)
        .await?
        .into_inner();
    let first = stream
        .message()
        .await?
        .context("watch ended before it was set up")?;
    ensure!(
        first.created,
        "the first response is not the created one: {first:?}"
    );
    Ok(stream)
}

fn seen_in(response: &WatchResponse) -> Vec<Seen> {
    response
        .events
        .iter()
        .map(|e| {
            let kv = e.kv.as_ref().expect("every event carries its key");
            (kv.mod_revision, kv.key.clone(), e.kind == Kind::Put as i32)
        })
        .collect()
}

/// Reads events until `count` of them arrived, the stream ends, or `within` passes.
async fn take(
    stream: &mut Streaming<WatchResponse>,
    count: usize,
    within: Duration,
) -> anyhow::Result<(Vec<Seen>, Option<Status>)> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while got.len() < count {
        match tokio::time::timeout_at(deadline, stream.message()).await {
            Err(_) => bail!("only {} of {count} events within {within:?}", got.len()),
            Ok(Ok(Some(r))) => got.extend(seen_in(&r)),
            Ok(Ok(None)) => bail!("the watch ended after {} events", got.len()),
            Ok(Err(status)) => return Ok((got, Some(status))),
        }
    }
    Ok((got, None))
}

/// Puts and deletes under `prefix` through `kv`, one at a time; returns every change as
/// etcd recorded it.
async fn write(
    mut kv: KvClient<Channel>,
    prefix: String,
    ops: usize,
    value_bytes: usize,
) -> anyhow::Result<Vec<Seen>> {
    let mut done = Vec::new();
    for i in 0..ops {
        let (key, delete) = {
            let mut rng = rand::rng();
            (
                format!("{prefix}{}", rng.random_range(0..8)),
                rng.random_bool(0.2),
            )
        };
        if delete {
            let reply = kv
                .delete(DeleteRequest {
                    key: key.clone(),
                    condition: None,
                })
                .await?
                .into_inner();
            if reply.deleted > 0 {
                done.push((reply.revision, key, false));
            }
        } else {
            let mut value = format!("{i}-").into_bytes();
            value.resize(value_bytes.max(value.len()), b'.');
            let reply = kv
                .put(PutRequest {
                    key: key.clone(),
                    value,
                    ..Default::default()
                })
                .await?
                .into_inner();
            done.push((reply.revision, key, true));
        }
    }
    Ok(done)
}

fn first_difference(got: &[Seen], want: &[Seen]) -> String {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(i) => format!("event {i}: got {:?}, want {:?}", got[i], want[i]),
        None => format!("got {} events, want {}", got.len(), want.len()),
    }
}

pub async fn events_arrive_once_in_order_across_a_proxy_restart_and_a_resume() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start(1).await?;
    // a keeps no history of recent events, so its watcher's resume reads etcd's.
    let mut without_history = ProxyOptions::new("a", etcd.endpoints());
    without_history.extra_args = vec!["--watch-history-bytes".into(), "0".into()];
    let mut proxies = [
        ProxyProcess::start(&without_history, &etcd.dir).await?,
        ProxyProcess::start(&ProxyOptions::new("b", etcd.endpoints()), &etcd.dir).await?,
    ];
    let (a, b) = (channel(&proxies[0]).await?, channel(&proxies[1]).await?);
    let start = etcd.revision().await? + 1;

    // Two watchers of everything the writer will do: one through b, one through a.
    let mut through_b = open(&b, prefix_from("w/", start)).await?;
    let mut through_a = open(&a, prefix_from("w/", start)).await?;
    let writer = tokio::spawn(write(KvClient::new(a.clone()), "w/".into(), 600, 16));

    // b dies mid-stream; its watcher goes on through a new proxy from its last revision.
    let (mut b_seen, _) = take(&mut through_b, 150, Duration::from_secs(30)).await?;
    proxies[1].process.kill();
    let b2 = ProxyProcess::start(&ProxyOptions::new("b", etcd.endpoints()), &etcd.dir).await?;
    // a's watcher stops reading after 50 events and resumes once the writer is done,
    // so its resume has to catch up on history.
    let (mut a_seen, _) = take(&mut through_a, 50, Duration::from_secs(30)).await?;
    drop(through_a);

    let want = writer.await??;
    let last = want.last().context("the writer wrote")?.0;
    let resume_b = b_seen.last().unwrap().0 + 1;
    let mut through_b2 = open(&channel(&b2).await?, prefix_from("w/", resume_b)).await?;
    let rest = want.iter().filter(|e| e.0 >= resume_b).count();
    b_seen.extend(
        take(&mut through_b2, rest, Duration::from_secs(30))
            .await?
            .0,
    );
    let resume_a = a_seen.last().unwrap().0 + 1;
    let mut again = open(&a, prefix_from("w/", resume_a)).await?;
    let rest = want.iter().filter(|e| e.0 >= resume_a).count();
    a_seen.extend(take(&mut again, rest, Duration::from_secs(30)).await?.0);

    ensure!(
        b_seen == want,
        "through b and its replacement: {}",
        first_difference(&b_seen, &want)
    );
    ensure!(
        a_seen == want,
        "through a with a resume: {}",
        first_difference(&a_seen, &want)
    );
    ensure!(
        proxies[0].metric("lockcell_watch_catch_ups_total").await? >= 1.0,
        "a's resume was served by a catch-up"
    );
    // Nothing more comes: a put after the last revision is the next event.
    KvClient::new(a.clone())
        .put(PutRequest {
            key: "w/after".into(),
            value: b"x".to_vec(),
            ..Default::default()
        })
        .await?;
    let (next, _) = take(&mut again, 1, Duration::from_secs(10)).await?;
    ensure!(next[0].0 > last && next[0].1 == "w/after", "then {next:?}");
    Ok(())
}

pub async fn compaction_and_bad_watches_are_reported_by_name() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let a = channel(&proxies[0]).await?;
    let writes = write(KvClient::new(a.clone()), "c/".into(), 20, 8).await?;
    let old = writes[2].0;
    let compact_at = writes.last().unwrap().0;
    etcd.client().await?.compact(compact_at, None).await?;

    // The proxy's own view of the cell may be reloading after the compaction (a
    // watch then ends UNAVAILABLE, to be resumed, as a client does): watch again until
    // the answer is about the compaction, within a deadline.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        let mut stream = WatchClient::new(a.clone())
            .watch(prefix_from("c/", old))
            .await?
            .into_inner();
        let status = loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => bail!("the watch from a compacted revision ended without an error"),
                Err(status) => break status,
            }
        };
        if status.code() != Code::Unavailable || tokio::time::Instant::now() > deadline {
            break status;
        }
        // A client's pause before it resumes.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    ensure!(status.code() == Code::OutOfRange, "compaction: {status:?}");
    let reported = status
        .metadata()
        .get("lockcell-compact-revision")
        .context("the compact revision is in the metadata")?
        .to_str()?
        .parse::<i64>()?;
    // The oldest start that works: etcd keeps the state at its compact revision, not
    // the deletes made at it.
    ensure!(
        reported == compact_at + 1,
        "compact revision {reported}, want {}",
        compact_at + 1
    );
    ensure!(
        status.message().contains(&compact_at.to_string()),
        "{status:?}"
    );

    // A read at a compacted revision says so too.
    let read = KvClient::new(a.clone())
        .get(GetRequest {
            key: "c/".into(),
            prefix: true,
            revision: old,
            ..Default::default()
        })
        .await
        .expect_err("compacted read");
    ensure!(read.code() == Code::OutOfRange, "{read:?}");

    let now = etcd.revision().await?;
    let bad: Vec<(WatchRequest, &str)> = vec![
        (prefix_from("", 0), "all_keys"),
        (prefix_from("/", 0), "all_keys"),
        (prefix_from("c/", now + 100), "in the future"),
        (prefix_from("c/", -1), "negative"),
        (prefix_from("a//b", 0), "empty segment"),
        (
            WatchRequest {
                key: "../x".into(),
                ..Default::default()
            },
            "..",
        ),
    ];
    for (request, says) in bad {
        let what = format!("{request:?}");
        let status = match WatchClient::new(a.clone()).watch(request).await {
            Ok(_) => bail!("{what} was accepted"),
            Err(status) => status,
        };
        ensure!(
            status.code() == Code::InvalidArgument && status.message().contains(says),
            "{what}: {status:?} (want InvalidArgument saying {says:?})"
        );
    }
    let future_read = KvClient::new(a.clone())
        .get(GetRequest {
            key: "c/1".into(),
            revision: now + 100,
            ..Default::default()
        })
        .await
        .expect_err("a read in the future");
    ensure!(
        future_read.code() == Code::InvalidArgument && future_read.message().contains("future"),
        "{future_read:?}"
    );
    ensure!(
        etcd.revision().await? == now,
        "bad watches and reads wrote nothing"
    );
    // With the flag, the whole space may be watched.
    open(
        &a,
        WatchRequest {
            all_keys: true,
            ..prefix_from("", 0)
        },
    )
    .await?;
    Ok(())
}

pub async fn a_slow_watcher_is_cut_off_while_a_fast_one_keeps_receiving() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec!["--watch-backlog".into(), "16".into()];
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    // Each watcher on a connection of its own, as two client processes would be.
    let (fast_channel, slow_channel) = (channel(&proxy).await?, channel(&proxy).await?);
    let mut slow = open(&slow_channel, prefix_from("s/", 0)).await?;
    let mut fast = open(&fast_channel, prefix_from("s/", 0)).await?;
    // The fast watcher reads as events come; the slow one reads nothing for now.
    let fast_reader = tokio::spawn(async move {
        let mut seen = Vec::new();
        loop {
            match tokio::time::timeout(Duration::from_secs(5), fast.message()).await {
                Ok(Ok(Some(r))) => seen.extend(seen_in(&r)),
                Ok(Ok(None)) => return Ok(seen),
                Ok(Err(status)) => return Err(status),
                Err(_) => return Ok(seen),
            }
        }
    });

    let kv = KvClient::new(channel(&proxy).await?);
    let writers: Vec<_> = (0..4)
        .map(|w| tokio::spawn(write(kv.clone(), format!("s/{w}/"), 500, 2048)))
        .collect();
    let mut want = Vec::new();
    for w in writers {
        want.extend(w.await??);
    }
    want.sort();
    let fast_seen = fast_reader
        .await?
        .map_err(|status| anyhow::anyhow!("the fast watcher was cut off: {status:?}"))?;
    ensure!(
        fast_seen == want,
        "fast watcher: {}",
        first_difference(&fast_seen, &want)
    );
    ensure!(
        proxy.metric("lockcell_watchers_cut_off_total").await? >= 1.0,
        "the slow watcher was cut off"
    );

    // The slow watcher gets what was queued for it, then the cut-off with the revision
    // to resume from; resuming there leaves no gap and no duplicate.
    let (mut slow_seen, ended) = take(&mut slow, want.len(), Duration::from_secs(60)).await?;
    let status = ended.context("the slow watcher got every event without reading")?;
    ensure!(status.code() == Code::ResourceExhausted, "{status:?}");
    ensure!(
        status.message().contains("resume from revision"),
        "{status:?}"
    );
    let resume = status
        .metadata()
        .get("lockcell-resume-revision")
        .context("the resume revision is in the metadata")?
        .to_str()?
        .parse::<i64>()?;
    let delivered = slow_seen.len();
    ensure!(
        want.get(delivered).map(|e| e.0) == Some(resume),
        "resume at {resume} after {delivered} events, want the next one: {:?}",
        want.get(delivered)
    );
    let mut resumed = open(&slow_channel, prefix_from("s/", resume)).await?;
    slow_seen.extend(
        take(
            &mut resumed,
            want.len() - delivered,
            Duration::from_secs(60),
        )
        .await?
        .0,
    );
    ensure!(
        slow_seen == want,
        "slow watcher with its resume: {}",
        first_difference(&slow_seen, &want)
    );
    println!(
        "slow watcher cut off after {delivered} of {} events; resumed from revision {resume}",
        want.len()
    );
    Ok(())
}

/// A gauge of etcd's own metrics, summed over members.
async fn etcd_gauge(etcd: &EtcdCluster, name: &str) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for endpoint in etcd.endpoints() {
        let page = lockcell_tests::proxy::http_get(&endpoint, "/metrics").await?;
        let value = page
            .lines()
            .find(|l| l.split(' ').next() == Some(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .with_context(|| format!("etcd at {endpoint} has no metric {name}"))?;
        total += value;
    }
    Ok(total)
}

pub async fn a_thousand_watchers_over_three_proxies_cost_etcd_at_most_three_watchers(
) -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a", "b", "c"]).await?;
    let before = etcd_gauge(&etcd, "etcd_debugging_mvcc_watcher_total").await?;
    // Ten connections to each proxy, taken in turn: proxy i % 3 serves watcher i.
    let mut channels = Vec::new();
    for _ in 0..10 {
        for p in &proxies {
            channels.push(channel(p).await?);
        }
    }
    let mut streams = Vec::new();
    for i in 0..1000 {
        streams.push(open(&channels[i % channels.len()], prefix_from("m/", 0)).await?);
    }
    let after = etcd_gauge(&etcd, "etcd_debugging_mvcc_watcher_total").await?;
    println!("etcd watchers: {before} before, {after} with 1,000 lockcell watchers on 3 proxies");
    ensure!(
        after - before <= 3.0,
        "1,000 watchers cost etcd {} watchers",
        after - before
    );
    for p in &proxies {
        let local = p.metric("lockcell_watchers").await?;
        ensure!(
            (333.0..=334.0).contains(&local),
            "proxy {} serves {local} watchers",
            p.zone
        );
    }
    let reply = KvClient::new(channels[0].clone())
        .put(PutRequest {
            key: "m/announce".into(),
            value: b"here".to_vec(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut readers = tokio::task::JoinSet::new();
    for mut stream in streams {
        readers.spawn(async move { take(&mut stream, 1, Duration::from_secs(30)).await });
    }
    let mut told = 0;
    while let Some(done) = readers.join_next().await {
        let (got, _) = done??;
        ensure!(
            got == [(reply.revision, "m/announce".into(), true)],
            "{got:?}"
        );
        told += 1;
    }
    ensure!(told == 1000);
    eventually(
        "etcd still has no more watchers",
        Duration::from_secs(5),
        || async {
            let now = etcd_gauge(&etcd, "etcd_debugging_mvcc_watcher_total").await?;
            Ok((now - before <= 3.0).then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// Deletes `deleted` and puts `put` (small-key names) in one etcd transaction, straight
/// in etcd; returns its revision.
async fn delete_and_put(etcd: &EtcdCluster, deleted: &str, put: &str) -> anyhow::Result<i64> {
    use etcd_client::{Txn, TxnOp};
    let txn = Txn::new().and_then([
        TxnOp::delete(format!("/k/{deleted}"), None),
        TxnOp::put(format!("/k/{put}"), "v", None),
    ]);
    let reply = etcd.client().await?.txn(txn).await?;
    Ok(reply.header().context("txn reply header")?.revision())
}

/// What a watch from before a compaction must give for a key deleted at the compact
/// revision: the delete, or OUT_OF_RANGE (read again). Reads the SDK watcher until one
/// of them comes, or a put of `then` arrives without the delete before it.
async fn delete_or_compacted(
    watch: &mut lockcell_client::Watcher,
    deleted: &str,
    then: &str,
    within: Duration,
) -> anyhow::Result<&'static str> {
    use lockcell_client::{Error, EventKind};
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let batch = match tokio::time::timeout_at(deadline, watch.next()).await {
            Err(_) => bail!(
                "the watcher got neither the delete of {deleted} nor an error within {within:?}"
            ),
            Ok(Some(Err(Error::Compacted { .. }))) => return Ok("compacted"),
            Ok(Some(Err(e))) => bail!("the watcher failed otherwise: {e}"),
            Ok(Some(Ok(batch))) => batch,
            Ok(None) => bail!("the watch ended without an error"),
        };
        for event in &batch.events {
            if event.entry.key == deleted && event.kind == EventKind::Delete {
                return Ok("deleted");
            }
            if event.entry.key == then {
                bail!("the watcher got the put of {then} but never the delete of {deleted} made in the same revision");
            }
        }
    }
}

/// The proxy's watch over the cell breaks one revision behind; at that revision a
/// transaction deleted a key and put another; etcd is compacted at exactly that
/// revision (which etcd accepts a watch from, but without its deletes). The proxy must
/// not keep the deleted key: a linearizable read says it is gone, and a watcher gets
/// the delete or OUT_OF_RANGE.
pub async fn a_key_deleted_at_the_compact_revision_where_the_proxy_resumes_stays_deleted(
) -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let link = Relay::start(&etcd.endpoints()[0]).await?;
    let proxy =
        ProxyProcess::start(&ProxyOptions::new("a", vec![link.addr.clone()]), &etcd.dir).await?;
    let client = lockcell_client::Client::connect(&proxy.url()).await?;
    client
        .put("cfg/x", b"1", lockcell_client::Condition::Always)
        .await?;
    let mut watch = client
        .watch(
            "cfg/",
            lockcell_client::WatchOptions::prefix().reconnecting_for(Duration::from_secs(20)),
        )
        .await?;
    // A linearizable read: the proxy has applied every revision so far.
    ensure!(
        client.get("cfg/x").await?.is_some(),
        "cfg/x was not written"
    );
    let before = etcd.revision().await?;
    link.cut(true);
    let at = delete_and_put(&etcd, "cfg/x", "cfg/z").await?;
    ensure!(
        at == before + 1,
        "something else wrote to the cell meanwhile (revision {before}, then {at})"
    );
    etcd.client().await?.compact(at, None).await?;
    link.reset();
    link.cut(false);
    eventually(
        "a linearizable read through the proxy finds cfg/x deleted",
        Duration::from_secs(15),
        || async { Ok(client.get("cfg/x").await?.is_none().then_some(())) },
    )
    .await?;
    let seen = delete_or_compacted(&mut watch, "cfg/x", "cfg/z", Duration::from_secs(20)).await?;
    println!("the watcher got: {seen}");
    Ok(())
}

/// A watch from exactly the compact revision: etcd has dropped the deletes made at it,
/// so the proxy must not serve it as whole. A revision that held a delete and a put
/// gives the delete or OUT_OF_RANGE; one that held only a delete ends the watch with
/// OUT_OF_RANGE (or the delete) well within the SDK's reconnect limit, rather than
/// reopening forever.
pub async fn a_watch_from_exactly_the_compact_revision_misses_no_delete() -> anyhow::Result<()> {
    use lockcell_client::{Condition, WatchOptions};
    let etcd = EtcdCluster::start(1).await?;
    let proxy = ProxyProcess::start(&ProxyOptions::new("a", etcd.endpoints()), &etcd.dir).await?;
    let client = lockcell_client::Client::connect(&proxy.url()).await?;

    client.put("c/x", b"1", Condition::Always).await?;
    let mixed = delete_and_put(&etcd, "c/x", "c/z").await?;
    // A revision with only a delete in it.
    client.put("d/y", b"1", Condition::Always).await?;
    let lone = etcd
        .client()
        .await?
        .delete("/k/d/y", None)
        .await?
        .header()
        .context("delete reply header")?
        .revision();
    client.put("d/w", b"1", Condition::Always).await?;
    etcd.client().await?.compact(mixed, None).await?;

    let mut watch = client
        .watch("c/", WatchOptions::prefix().from_revision(mixed))
        .await?;
    let seen = delete_or_compacted(&mut watch, "c/x", "c/z", Duration::from_secs(10)).await?;
    println!("a watch from the compact revision {mixed}: {seen}");

    etcd.client().await?.compact(lone, None).await?;
    let limit = Duration::from_secs(4);
    let started = tokio::time::Instant::now();
    let mut watch = client
        .watch(
            "d/",
            WatchOptions::prefix()
                .from_revision(lone)
                .reconnecting_for(limit),
        )
        .await?;
    let seen = delete_or_compacted(&mut watch, "d/y", "d/w", limit * 3).await;
    let took = started.elapsed();
    let seen = seen?;
    println!("a watch from the delete-only compact revision {lone}: {seen} after {took:?}");
    // And a call after a final error says the watch has ended, at once.
    if seen == "compacted" {
        let again = tokio::time::timeout(Duration::from_secs(2), watch.next()).await?;
        ensure!(again.is_none(), "a compacted watch went on: {again:?}");
    }
    Ok(())
}

/// A watcher whose link to its proxy is black-holed for a while, as writes go on, and
/// whose connection is then closed (as when a long partition ends): it resumes and has
/// every event, in order, none twice.
pub async fn a_watcher_cut_off_from_its_proxy_for_a_while_misses_nothing() -> anyhow::Result<()> {
    use lockcell_client::{Client, ClientOptions, Condition, WatchOptions};
    let (_etcd, proxies) = cell(&["a", "b"]).await?;
    let link = Relay::start(&proxies[0].addr).await?;
    let watcher = Client::connect_with(ClientOptions::new([link.url(), proxies[1].url()])).await?;
    let writer = Client::connect(&proxies[1].url()).await?;
    let mut watch = watcher
        .watch(
            "cut/",
            WatchOptions::prefix().reconnecting_for(Duration::from_secs(30)),
        )
        .await?;
    let mut want = Vec::new();
    for i in 0..5 {
        want.push(
            writer
                .put(&format!("cut/{i}"), b"v", Condition::Always)
                .await?
                .revision,
        );
    }
    let mut got = Vec::new();
    while got.len() < 5 {
        let batch = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .with_context(|| format!("no event within 10 s before the cut ({got:?})"))?
            .context("the watch ended")??;
        got.extend(batch.events.iter().map(|e| e.entry.mod_revision));
    }
    link.cut(true);
    let cut_at = tokio::time::Instant::now();
    let mut i = 5;
    while cut_at.elapsed() < Duration::from_secs(6) {
        want.push(
            writer
                .put(&format!("cut/{}", i % 7), b"v", Condition::Always)
                .await?
                .revision,
        );
        i += 1;
    }
    link.heal();
    while got.len() < want.len() {
        let next = tokio::time::timeout(Duration::from_secs(30), watch.next()).await;
        let next = next.with_context(|| {
            format!(
                "no event within 30 s after the heal: {}",
                first_difference_revs(&got, &want)
            )
        })?;
        let batch = match next.context("the watch ended")? {
            Ok(batch) => batch,
            Err(e) => {
                println!("watch error: {e}");
                continue;
            }
        };
        got.extend(batch.events.iter().map(|e| e.entry.mod_revision));
        if got.last() > want.last() {
            break;
        }
    }
    ensure!(got == want, "{}", first_difference_revs(&got, &want));
    Ok(())
}

fn first_difference_revs(got: &[i64], want: &[i64]) -> String {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(i) => format!(
            "event {i}: got revision {}, want {} (got {} events, want {})",
            got[i],
            want[i],
            got.len(),
            want.len()
        ),
        None => format!("got {} events, want {}", got.len(), want.len()),
    }
}
