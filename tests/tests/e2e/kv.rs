//! Small keys: conditional writes, reads through another proxy, ephemeral keys that go
//! with their session or their proxy, bad keys and values refused, multi-key
//! transactions raced through two proxies.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_proto::v1::condition::When;
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::txn_write::Op;
use lockcell_proto::v1::{
    Compare, Condition, DeleteRequest, GetRequest, OpenRequest, PutRequest, TxnRequest, TxnWrite,
};
use lockcell_tests::eventually;
use nix::sys::signal::Signal;
use tonic::transport::Channel;
use tonic::Code;

use crate::support::{cell, raw};

async fn kv(proxy: &lockcell_tests::ProxyProcess) -> anyhow::Result<KvClient<Channel>> {
    Ok(KvClient::new(
        Channel::from_shared(proxy.url())?.connect().await?,
    ))
}

/// Waits until `key` no longer exists.
async fn until_gone(
    reader: &KvClient<Channel>,
    key: &str,
    what: &str,
    within: Duration,
) -> anyhow::Result<()> {
    eventually(what, within, || {
        let mut reader = reader.clone();
        let key = key.to_owned();
        async move {
            let read = reader
                .get(GetRequest {
                    key,
                    ..Default::default()
                })
                .await?
                .into_inner();
            Ok(read.kvs.is_empty().then_some(()))
        }
    })
    .await
}

fn when(w: When) -> Option<Condition> {
    Some(Condition { when: Some(w) })
}

pub async fn conditional_writes_and_linearizable_reads_across_proxies() -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a", "b", "c"]).await?;
    let mut clients = Vec::new();
    for p in &proxies {
        clients.push(kv(p).await?);
    }
    // A write through one proxy is seen by a read through another issued after it.
    for i in 0..60u64 {
        let (w, r) = ((i * 7 + 1) % 3, (i * 5 + 2) % 3);
        let value = format!("v{i}").into_bytes();
        let put = PutRequest {
            key: "config/route".into(),
            value: value.clone(),
            ..Default::default()
        };
        let written = clients[w as usize].put(put).await?.into_inner();
        let read = clients[r as usize]
            .get(GetRequest {
                key: "config/route".into(),
                ..Default::default()
            })
            .await?
            .into_inner();
        ensure!(
            read.revision >= written.revision,
            "read at {} after a write at {}",
            read.revision,
            written.revision
        );
        ensure!(
            read.kvs.first().map(|kv| &kv.value) == Some(&value),
            "round {i}: read {:?}",
            read.kvs.first()
        );
    }
    let c = &mut clients[0];
    let first = c
        .put(PutRequest {
            key: "once".into(),
            value: b"1".to_vec(),
            condition: when(When::Absent(true)),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(first.succeeded);
    let again = c
        .put(PutRequest {
            key: "once".into(),
            value: b"2".to_vec(),
            condition: when(When::Absent(true)),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        !again.succeeded
            && again.current.as_ref().map(|kv| kv.value.as_slice()) == Some(b"1".as_slice()),
        "{again:?}"
    );
    let rev = first.current.context("current")?.mod_revision;
    let cas = c
        .put(PutRequest {
            key: "once".into(),
            value: b"3".to_vec(),
            condition: when(When::ModRevision(rev)),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        cas.succeeded,
        "a compare-and-swap at the current revision failed"
    );
    let stale = c
        .put(PutRequest {
            key: "once".into(),
            value: b"4".to_vec(),
            condition: when(When::ModRevision(rev)),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        !stale.succeeded,
        "a compare-and-swap at a stale revision succeeded"
    );
    let gone = c
        .delete(DeleteRequest {
            key: "once".into(),
            condition: when(When::Version(2)),
        })
        .await?
        .into_inner();
    ensure!(gone.succeeded && gone.deleted == 1, "{gone:?}");
    // A prefix read sees the keys under it and not a sibling with the same start.
    for key in ["svc/a/1", "svc/a/2", "svc/ab"] {
        c.put(PutRequest {
            key: key.into(),
            value: b"x".to_vec(),
            ..Default::default()
        })
        .await?;
    }
    let under = c
        .get(GetRequest {
            key: "svc/a/".into(),
            prefix: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    let names: Vec<&str> = under.kvs.iter().map(|kv| kv.key.as_str()).collect();
    ensure!(
        names == ["svc/a/1", "svc/a/2"],
        "prefix read gave {names:?}"
    );
    Ok(())
}

/// Opens a raw session with `ttl_ms` (never renewed) and writes `key` bound to it.
async fn put_ephemeral(
    proxy: &lockcell_tests::ProxyProcess,
    ttl_ms: u64,
    key: &str,
    value: &[u8],
) -> anyhow::Result<lockcell_proto::v1::PutResponse> {
    let (mut sessions, _) = raw(proxy).await?;
    let session = sessions
        .open(OpenRequest {
            ttl_ms,
            identity: "member".into(),
        })
        .await?
        .into_inner();
    let put = PutRequest {
        key: key.into(),
        value: value.to_vec(),
        session_id: session.session_id,
        session_secret: session.session_secret.clone(),
        ..Default::default()
    };
    Ok(kv(proxy).await?.put(put).await?.into_inner())
}

pub async fn ephemeral_keys_vanish_with_their_session_and_their_proxy() -> anyhow::Result<()> {
    let (_etcd, mut proxies) = cell(&["a", "b"]).await?;
    let reader = kv(&proxies[0]).await?;
    // A session that stops renewing: its key goes when it expires.
    let written = put_ephemeral(&proxies[0], 1_000, "members/svc/1", b"10.0.0.1").await?;
    ensure!(
        written.succeeded && written.current.as_ref().is_some_and(|kv| kv.lease != 0),
        "{written:?}"
    );
    until_gone(
        &reader,
        "members/svc/1",
        "the expired session's key is deleted",
        Duration::from_secs(10),
    )
    .await?;

    // A session on a proxy that dies: its key goes with the proxy's leases.
    let written = put_ephemeral(&proxies[1], 60_000, "members/svc/2", b"10.0.0.2").await?;
    ensure!(written.succeeded, "{written:?}");
    proxies[1].signal(Signal::SIGKILL)?;
    until_gone(
        &reader,
        "members/svc/2",
        "the dead proxy's session's key is deleted",
        Duration::from_secs(15),
    )
    .await?;
    proxies[1].process.kill();
    let read = reader
        .clone()
        .get(GetRequest {
            key: "members/".into(),
            prefix: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(read.kvs.is_empty(), "left over: {:?}", read.kvs);
    Ok(())
}

pub async fn bad_keys_and_values_are_refused_and_write_nothing() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let mut c = kv(&proxies[0]).await?;
    let before = etcd.revision().await?;
    let big = vec![0u8; 64 * 1024 + 1];
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("", b"x".to_vec(), "empty"),
        ("a/../b", b"x".to_vec(), "'..'"),
        ("a\u{1}b", b"x".to_vec(), "control character"),
        ("fine", big, "over the limit of 65536 bytes"),
    ];
    for (key, value, rule) in cases {
        let status = c
            .put(PutRequest {
                key: key.into(),
                value,
                ..Default::default()
            })
            .await
            .expect_err("a bad write was accepted");
        ensure!(
            status.code() == Code::InvalidArgument,
            "{key:?}: {status:?}"
        );
        ensure!(
            status.message().contains(rule) && status.message().contains("key"),
            "{key:?}: {:?} does not name the rule",
            status.message()
        );
    }
    let status = c
        .put(PutRequest {
            key: "x".into(),
            value: b"1".to_vec(),
            condition: when(When::ModRevision(-1)),
            ..Default::default()
        })
        .await
        .expect_err("a negative revision was accepted");
    ensure!(status.code() == Code::InvalidArgument, "{status:?}");
    let status = c
        .put(PutRequest {
            key: "x".into(),
            value: b"1".to_vec(),
            session_id: "no-such-session".into(),
            ..Default::default()
        })
        .await
        .expect_err("a session named without its secret was accepted");
    ensure!(
        status.code() == Code::PermissionDenied && status.message().contains("session_secret"),
        "{status:?}"
    );
    ensure!(
        etcd.revision().await? == before,
        "refused writes wrote to etcd"
    );
    Ok(())
}

pub async fn sdk_membership_keys_go_when_the_session_closes() -> anyhow::Result<()> {
    use lockcell_client::{Client, Condition};
    let (_etcd, proxies) = cell(&["a", "b"]).await?;
    let a = Client::connect(&proxies[0].url()).await?;
    let b = Client::connect(&proxies[1].url()).await?;
    let member = a
        .open_session(crate::support::short_session(Duration::from_secs(10)))
        .await?;
    let written = member
        .put_ephemeral("members/api/host-1", b"10.0.0.1:80", Condition::Absent)
        .await?;
    ensure!(written.succeeded);
    let seen = b.get_prefix("members/api/").await?;
    ensure!(
        seen.len() == 1 && seen[0].ephemeral && seen[0].value == b"10.0.0.1:80",
        "{seen:?}"
    );
    // Config keys are not ephemeral and survive.
    ensure!(
        b.put("config/api/limit", b"100", Condition::Always)
            .await?
            .succeeded
    );
    member.close().await?;
    ensure!(
        b.get_prefix("members/api/").await?.is_empty(),
        "a closed session's member key is still there"
    );
    let limit = b
        .get("config/api/limit")
        .await?
        .context("the config key is gone")?;
    ensure!(!limit.ephemeral && limit.value == b"100");
    ensure!(
        b.delete(
            "config/api/limit",
            Condition::ModRevision(limit.mod_revision)
        )
        .await?
    );
    Ok(())
}

pub async fn lockctl_get_put_del_with_compare_and_swap() -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a"]).await?;
    let lockctl = lockcell_tests::bins::workspace_bin("lockctl")?;
    let run = |args: Vec<String>| {
        let lockctl = lockctl.clone();
        let proxy = proxies[0].addr.clone();
        async move {
            let out = tokio::process::Command::new(lockctl)
                .arg("--proxy")
                .arg(proxy)
                .args(args)
                .output()
                .await?;
            anyhow::Ok((
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            ))
        }
    };
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    ensure!(
        run(args(&["get", "config/api/limit"])).await?.0 == Some(3),
        "get of a missing key did not exit 3"
    );
    ensure!(
        run(args(&["put", "--if-absent", "config/api/limit", "100"]))
            .await?
            .0
            == Some(0)
    );
    ensure!(
        run(args(&["put", "--if-absent", "config/api/limit", "999"]))
            .await?
            .0
            == Some(1),
        "--if-absent overwrote"
    );
    let (code, rev) = run(args(&["get", "--revision", "config/api/limit"])).await?;
    ensure!(
        code == Some(0) && rev.parse::<i64>().is_ok(),
        "revision {rev:?}"
    );
    ensure!(
        run(args(&[
            "put",
            "--if-revision",
            &rev,
            "config/api/limit",
            "200"
        ]))
        .await?
        .0 == Some(0)
    );
    ensure!(
        run(args(&[
            "put",
            "--if-revision",
            &rev,
            "config/api/limit",
            "300"
        ]))
        .await?
        .0 == Some(1),
        "a stale CAS won"
    );
    ensure!(run(args(&["get", "config/api/limit"])).await? == (Some(0), "200".to_owned()));
    ensure!(
        run(args(&["get", "--prefix", "config/"])).await?
            == (Some(0), "config/api/limit=200".to_owned())
    );
    ensure!(run(args(&["del", "config/api/limit"])).await?.0 == Some(0));
    ensure!(
        run(args(&["put", "config/../x", "1"])).await?.0 == Some(64),
        "a bad key did not exit 64"
    );
    Ok(())
}

/// A balance kept as a key's decimal value.
fn balance(entry: &lockcell_client::Entry) -> anyhow::Result<i64> {
    Ok(std::str::from_utf8(&entry.value)?.parse()?)
}

pub async fn a_raced_two_key_move_has_one_winner_and_is_never_half_done() -> anyhow::Result<()> {
    use lockcell_client::{Client, Condition, Entry, Txn};
    const ROUNDS: i64 = 10;
    const PER_PROXY: usize = 3;
    let (_etcd, proxies) = cell(&["a", "b"]).await?;
    let mut clients = Vec::new();
    for proxy in &proxies {
        for _ in 0..PER_PROXY {
            clients.push(Client::connect(&proxy.url()).await?);
        }
    }
    let opened = clients[0]
        .commit(
            Txn::new()
                .when("acct/a", Condition::Absent)
                .when("acct/b", Condition::Absent)
                .put("acct/a", ROUNDS.to_string().as_bytes())
                .put("acct/b", b"0"),
        )
        .await?;
    ensure!(opened.succeeded && opened.current.is_empty(), "{opened:?}");
    for round in 0..ROUNDS {
        // Every client reads both keys through its own proxy; nothing is being written,
        // so all of them must see the last round's move, whole.
        let mut reads = tokio::task::JoinSet::new();
        for client in &clients {
            let client = client.clone();
            reads.spawn(async move {
                let a = client.get("acct/a").await?.context("acct/a is gone")?;
                let b = client.get("acct/b").await?.context("acct/b is gone")?;
                anyhow::Ok((client, a, b))
            });
        }
        let mut racers = Vec::new();
        while let Some(read) = reads.join_next().await {
            let (client, a, b) = read??;
            ensure!(
                (balance(&a)?, balance(&b)?) == (ROUNDS - round, round),
                "round {round}: read a={a:?} b={b:?}"
            );
            ensure!(
                a.mod_revision == b.mod_revision,
                "round {round}: half a move: a={a:?} b={b:?}"
            );
            racers.push((client, a, b));
        }
        // Then all of them try the same move at once: one from a to b.
        let mut moves = tokio::task::JoinSet::new();
        for (client, a, b) in racers {
            moves.spawn(async move {
                let txn = Txn::new()
                    .when("acct/a", Condition::ModRevision(a.mod_revision))
                    .when("acct/b", Condition::ModRevision(b.mod_revision))
                    .put("acct/a", (balance(&a)? - 1).to_string().as_bytes())
                    .put("acct/b", (balance(&b)? + 1).to_string().as_bytes());
                anyhow::Ok(client.commit(txn).await?)
            });
        }
        let mut outcomes = Vec::new();
        while let Some(outcome) = moves.join_next().await {
            outcomes.push(outcome??);
        }
        let (won, lost): (Vec<_>, Vec<_>) = outcomes.into_iter().partition(|o| o.succeeded);
        ensure!(
            won.len() == 1 && won[0].current.is_empty(),
            "round {round}: winners {won:?}"
        );
        let at = won[0].revision;
        // A loser failed because the winner's move was in: it sees exactly that.
        let after = |key: &str, value: i64, e: &Entry| {
            e.key == key && balance(e).ok() == Some(value) && e.mod_revision == at
        };
        for loser in &lost {
            let c = &loser.current;
            ensure!(
                c.len() == 2
                    && after("acct/a", ROUNDS - round - 1, &c[0])
                    && after("acct/b", round + 1, &c[1])
                    && loser.revision >= at,
                "round {round}: the winner wrote at {at}, a loser saw {loser:?}"
            );
        }
    }
    // Through the other proxy: every unit moved, both keys written by the last move.
    let reader = &clients[PER_PROXY];
    let a = reader.get("acct/a").await?.context("acct/a is gone")?;
    let b = reader.get("acct/b").await?.context("acct/b is gone")?;
    ensure!(
        (balance(&a)?, balance(&b)?) == (0, ROUNDS)
            && a.mod_revision == b.mod_revision
            && b.version == ROUNDS + 1,
        "after {ROUNDS} rounds: a={a:?} b={b:?}"
    );
    // Deletes and a put in one go; a stale retry then sees that the keys are gone.
    let close = Txn::new()
        .when("acct/a", Condition::ModRevision(a.mod_revision))
        .when("acct/b", Condition::Version(b.version))
        .delete("acct/a")
        .delete("acct/b")
        .put("acct/closed", b"yes");
    let closed = clients[0].commit(close.clone()).await?;
    ensure!(closed.succeeded, "{closed:?}");
    let again = reader.commit(close).await?;
    ensure!(
        !again.succeeded && again.current.is_empty() && again.revision == closed.revision,
        "a stale retry: {again:?}"
    );
    ensure!(reader.get_prefix("acct/").await?.len() == 1);
    Ok(())
}

pub async fn bad_transactions_are_refused_by_name_and_write_nothing() -> anyhow::Result<()> {
    use lockcell_client::{Client, Condition, Error, Txn};
    let (etcd, proxies) = cell(&["a"]).await?;
    let mut c = kv(&proxies[0]).await?;
    let put = |key: &str, value: Vec<u8>| TxnWrite {
        key: key.into(),
        op: Some(Op::Put(value)),
    };
    let absent = |key: &str| Compare {
        key: key.into(),
        condition: when(When::Absent(true)),
    };
    let before = etcd.revision().await?;
    let many: Vec<TxnWrite> = (0..65).map(|i| put(&format!("k/{i}"), vec![])).collect();
    let cases: [(Vec<Compare>, Vec<TxnWrite>, &[&str]); 7] = [
        (
            vec![absent("dup/x")],
            vec![
                put("dup/x", b"1".to_vec()),
                put("fine", b"1".to_vec()),
                TxnWrite {
                    key: "dup/x".into(),
                    op: Some(Op::Delete(true)),
                },
            ],
            &["\"dup/x\"", "written twice"],
        ),
        (
            vec![],
            vec![
                put("fine", b"1".to_vec()),
                put("big", vec![0; 64 * 1024 + 1]),
            ],
            &["\"big\"", "over the limit of 65536 bytes"],
        ),
        (
            vec![],
            vec![put("fine", b"1".to_vec()), put("a/../b", b"1".to_vec())],
            &["writes[1]", "a/../b", "'..'"],
        ),
        (
            vec![absent("a\u{1}b")],
            vec![put("fine", b"1".to_vec())],
            &["compares[0]", "control character"],
        ),
        (vec![absent("fine")], vec![], &["no writes"]),
        (
            vec![
                absent("fine"),
                Compare {
                    key: "loose".into(),
                    condition: None,
                },
            ],
            vec![put("fine", b"1".to_vec())],
            &["compares[1]", "\"loose\"", "no condition"],
        ),
        (vec![], many, &["65 writes", "limit of 64"]),
    ];
    for (compares, writes, words) in cases {
        let status = c
            .txn(TxnRequest { compares, writes })
            .await
            .expect_err("a bad transaction was accepted");
        ensure!(status.code() == Code::InvalidArgument, "{status:?}");
        for word in words {
            ensure!(
                status.message().contains(word),
                "{:?} does not name {word:?}",
                status.message()
            );
        }
    }
    // Through the SDK: a condition of Always is refused with the key's name.
    let sdk = Client::connect(&proxies[0].url()).await?;
    let txn = Txn::new()
        .when("loose", Condition::Always)
        .put("fine", b"1");
    match sdk.commit(txn).await {
        Err(Error::InvalidArgument(m)) if m.contains("\"loose\"") => {}
        other => anyhow::bail!("a compare of nothing: {other:?}"),
    }
    ensure!(
        etcd.revision().await? == before,
        "refused transactions wrote to etcd"
    );
    Ok(())
}
