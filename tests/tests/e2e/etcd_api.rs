//! etcd's own v3 API on a proxy (`--etcd-listen`), driven by `etcdctl`, a client no one
//! here wrote.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_tests::ports::free_port;
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess};

/// `etcdctl ARGS` against `endpoint`, with `stdin` fed in: (exit code, stdout, stderr).
async fn etcdctl(
    endpoint: &str,
    args: &[&str],
    stdin: &str,
) -> anyhow::Result<(Option<i32>, String, String)> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new("etcdctl")
        .arg("--endpoints")
        .arg(endpoint)
        .arg("--command-timeout=10s")
        .args(args)
        .env("ETCDCTL_API", "3")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting etcdctl (the etcd-client package)")?;
    let mut input = child.stdin.take().context("etcdctl's stdin")?;
    input.write_all(stdin.as_bytes()).await?;
    drop(input);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .with_context(|| format!("etcdctl {args:?} did not finish in 30 s"))??;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// `who`'s login flags, then `args`.
fn with<'a>(who: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
    who.iter().chain(args).copied().collect()
}

/// Runs `etcdctl ARGS` and wants it to succeed; returns its output.
async fn ok(endpoint: &str, args: &[&str]) -> anyhow::Result<String> {
    let (code, out, err) = etcdctl(endpoint, args, "").await?;
    ensure!(
        code == Some(0),
        "etcdctl {args:?} exited {code:?}:\n{out}{err}"
    );
    Ok(out)
}

async fn proxy_with_etcd_api(etcd: &EtcdCluster) -> anyhow::Result<(ProxyProcess, String)> {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec!["--etcd-listen".into(), listen.clone()];
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    Ok((proxy, listen))
}

/// A proxy with its etcd API, letting at most `turns` client writes be in etcd at once.
async fn proxy_with_write_turns(
    etcd: &EtcdCluster,
    turns: u32,
) -> anyhow::Result<(ProxyProcess, String)> {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec![
        "--etcd-listen".into(),
        listen.clone(),
        "--etcd-writes-in-flight".into(),
        turns.to_string(),
    ];
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    Ok((proxy, listen))
}

/// A grants file at `path` giving each `(identity, token)` read and write on `prefix`,
/// with that bearer token.
fn token_grants(path: &std::path::Path, prefix: &str, who: &[(&str, &str)]) -> anyhow::Result<()> {
    use lockcell_tests::certs::token_sha256;
    let mut text = String::new();
    for (identity, _) in who {
        text += &format!(
            "[[grant]]\nidentity = \"{identity}\"\nread = [\"{prefix}\"]\nwrite = [\"{prefix}\"]\n\n"
        );
    }
    for (identity, token) in who {
        text += &format!(
            "[[token]]\nidentity = \"{identity}\"\nsha256 = \"{}\"\n\n",
            token_sha256(token)
        );
    }
    std::fs::write(path, text)?;
    Ok(())
}

/// A proxy with its etcd API and the grants file at `grants`, over plain HTTP/2.
pub(crate) async fn proxy_with_grants(
    etcd: &EtcdCluster,
    grants: &std::path::Path,
) -> anyhow::Result<(ProxyProcess, String)> {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec![
        "--etcd-listen".into(),
        listen.clone(),
        "--grants".into(),
        grants.display().to_string(),
        "--grants-without-tls".into(),
    ];
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    Ok((proxy, listen))
}

/// Three proxies with their etcd API on `etcd`, and a client of each (one endpoint).
async fn three_proxies(
    etcd: &EtcdCluster,
) -> anyhow::Result<[(ProxyProcess, String, etcd_client::Client); 3]> {
    let mut each = Vec::new();
    for _ in 0..3 {
        let (proxy, api) = proxy_with_etcd_api(etcd).await?;
        let client = etcd_client::Client::connect([api.as_str()], None).await?;
        each.push((proxy, api, client));
    }
    each.try_into()
        .map_err(|_| anyhow::anyhow!("three proxies"))
}

/// Keys through the etcd API are lockcell's small keys under `/k/`; lockcell's own keys
/// are out of every range; puts, gets, prefixes, deletes and a transaction behave as
/// etcd's; the RPCs that act on etcd's members are refused by name.
pub async fn etcdctl_reads_and_writes_small_keys_through_a_proxy() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;

    ensure!(ok(&api, &["put", "config/a", "one"]).await?.trim() == "OK");
    ok(&api, &["put", "config/b", "two"]).await?;
    let got = ok(&api, &["get", "config/a"]).await?;
    ensure!(got == "config/a\none\n", "get config/a printed {got:?}");
    let listed = ok(&api, &["get", "config/", "--prefix", "--keys-only"]).await?;
    let keys: Vec<&str> = listed.lines().filter(|l| !l.is_empty()).collect();
    ensure!(keys == ["config/a", "config/b"], "prefix listing {keys:?}");
    // The whole space is the small keys only: no /sys/epoch, no proxy records.
    let everything = ok(&api, &["get", "", "--prefix", "--keys-only"]).await?;
    let keys: Vec<&str> = everything.lines().filter(|l| !l.is_empty()).collect();
    ensure!(
        keys == ["config/a", "config/b"],
        "the whole key space showed {keys:?}"
    );
    let from = ok(&api, &["get", "config/b", "--from-key", "--keys-only"]).await?;
    ensure!(
        from.trim() == "config/b",
        "--from-key config/b showed {from:?}"
    );

    // In etcd the key is lockcell's small key.
    let mut bare = etcd.member_client(0).await?;
    let stored = bare.get("/k/config/a", None).await?;
    ensure!(
        stored.kvs().first().map(|kv| kv.value()) == Some(&b"one"[..]),
        "etcd holds no /k/config/a = one"
    );

    // A transaction: the compare holds, so the success branch runs.
    let script = "value(\"config/a\") = \"one\"\n\nput config/a uno\n\nput config/a nope\n\n";
    let (code, out, err) = etcdctl(&api, &["txn"], script).await?;
    ensure!(
        code == Some(0) && out.starts_with("SUCCESS"),
        "txn exited {code:?}:\n{out}{err}"
    );
    let got = ok(&api, &["get", "config/a", "--print-value-only"]).await?;
    ensure!(got.trim() == "uno", "after the txn config/a is {got:?}");
    // And a compare that fails takes the failure branch.
    let (code, out, _) = etcdctl(&api, &["txn"], script).await?;
    ensure!(
        code == Some(0) && out.starts_with("FAILURE"),
        "second txn: {out}"
    );
    let got = ok(&api, &["get", "config/a", "--print-value-only"]).await?;
    ensure!(
        got.trim() == "nope",
        "after the failed compare config/a is {got:?}"
    );

    let deleted = ok(&api, &["del", "config/", "--prefix"]).await?;
    ensure!(deleted.trim() == "2", "del --prefix printed {deleted:?}");
    ensure!(ok(&api, &["get", "config/a"]).await?.is_empty());
    // lockcell's own records are still there: the delete could not reach them.
    let epoch = bare.get(lockcell_cell::keyspace::epoch_key(), None).await?;
    ensure!(epoch.count() == 1, "the cell's epoch record is gone");

    let status = ok(&api, &["endpoint", "status"]).await?;
    ensure!(
        status.contains("lockcell-proxy"),
        "endpoint status: {status}"
    );
    let members = ok(&api, &["member", "list"]).await?;
    ensure!(
        members.contains(&api),
        "member list does not name {api}: {members}"
    );
    let (code, _, err) = etcdctl(&api, &["defrag"], "").await?;
    ensure!(
        code != Some(0) && err.contains("Defragment is not served"),
        "defrag exited {code:?}: {err}"
    );
    Ok(())
}

/// A lease is a session of the proxy: granted, kept alive and revoked without a lease in
/// etcd; a key put with it is on the proxy's own lease and goes when it is revoked, or
/// when it is not kept alive.
pub async fn etcdctl_leases_are_sessions_of_the_proxy() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    let mut bare = etcd.member_client(0).await?;
    let etcd_leases = bare.leases().await?.leases().len();

    let granted = ok(&api, &["lease", "grant", "30"]).await?;
    // "lease 6c63000000000000 granted with TTL(30s)"
    let id = granted
        .split_whitespace()
        .nth(1)
        .context("no lease ID in the grant")?
        .to_owned();
    ensure!(
        granted.contains("TTL(30s)") && id.starts_with("6c63"),
        "lease grant printed {granted:?}"
    );
    ok(&api, &["put", "--lease", &id, "members/m1", "up"]).await?;
    let ttl = ok(&api, &["lease", "timetolive", &id, "--keys"]).await?;
    ensure!(
        ttl.contains("granted with TTL(30s)") && ttl.contains("attached keys([members/m1])"),
        "timetolive printed {ttl:?}"
    );
    let list = ok(&api, &["lease", "list"]).await?;
    ensure!(list.contains(&id), "lease list does not show {id}: {list}");
    let kept = ok(&api, &["lease", "keep-alive", "--once", &id]).await?;
    ensure!(
        kept.contains("keepalived with TTL("),
        "keep-alive printed {kept:?}"
    );
    // etcd saw no lease of the client's: only the proxy's own.
    ensure!(
        bare.leases().await?.leases().len() == etcd_leases,
        "etcd holds a lease for the client's"
    );
    let stored = bare.get("/k/members/m1", None).await?;
    let on = stored
        .kvs()
        .first()
        .map(|kv| kv.lease())
        .unwrap_or_default();
    ensure!(on != 0, "the leased key is not on a lease in etcd");
    ensure!(
        format!("{on:x}") != id,
        "the key is on the client's lease in etcd"
    );

    ok(&api, &["lease", "revoke", &id]).await?;
    ensure!(
        ok(&api, &["get", "members/m1"]).await?.is_empty(),
        "the key outlived its revoked lease"
    );
    let ttl = ok(&api, &["lease", "timetolive", &id]).await?;
    ensure!(
        ttl.contains("already expired"),
        "timetolive of a revoked lease: {ttl:?}"
    );
    let (code, _, err) = etcdctl(&api, &["put", "--lease", &id, "members/m2", "up"], "").await?;
    ensure!(
        code != Some(0) && err.contains("requested lease not found"),
        "a put on a revoked lease exited {code:?}: {err}"
    );

    // Not kept alive, a lease expires and takes its key.
    let granted = ok(&api, &["lease", "grant", "2"]).await?;
    let short = granted
        .split_whitespace()
        .nth(1)
        .context("no lease ID")?
        .to_owned();
    ok(&api, &["put", "--lease", &short, "members/m3", "up"]).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut sample = tokio::time::interval(Duration::from_millis(200));
    loop {
        sample.tick().await;
        if bare.get("/k/members/m3", None).await?.count() == 0 {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "a 2 s lease's key was still there 20 s later"
        );
    }
    let kept = ok(&api, &["lease", "keep-alive", "--once", &short]).await;
    ensure!(kept.is_err(), "an expired lease was kept alive: {kept:?}");
    Ok(())
}

/// With prefix grants, an etcd client logs in with an identity of the grants file and
/// its bearer token as the password; its calls are checked against its grants, its
/// leases are its own, and the auth management RPCs are refused by name.
pub async fn etcdctl_logs_in_with_a_grants_token_and_is_held_to_its_grants() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let (svc, other) = (
        "svc-token-0123456789abcdef0123456789",
        "other-token-0123456789abcdef0123456789",
    );
    let grants = etcd.dir.join("etcd-api-grants.toml");
    token_grants(&grants, "config/", &[("svc", svc), ("other", other)])?;
    let (_proxy, listen) = proxy_with_grants(&etcd, &grants).await?;
    let api = listen.as_str();
    let as_svc = ["--user", "svc", "--password", svc];
    let as_other = ["--user", "other", "--password", other];
    let (code, _, err) = etcdctl(api, &["put", "config/a", "1"], "").await?;
    ensure!(
        code != Some(0) && err.contains("user name is empty"),
        "a put without a login exited {code:?}: {err}"
    );
    ok(api, &with(&as_svc, &["put", "config/a", "1"])).await?;
    let got = ok(
        api,
        &with(&as_svc, &["get", "config/a", "--print-value-only"]),
    )
    .await?;
    ensure!(got.trim() == "1", "svc read {got:?}");
    // A page of its prefix: a range that starts inside it and ends where it ends.
    let page = ok(
        api,
        &with(&as_svc, &["get", "config/a", "config0", "--keys-only"]),
    )
    .await?;
    ensure!(
        page.trim() == "config/a",
        "svc's page of config/ showed {page:?}"
    );
    let (code, _, err) = etcdctl(api, &with(&as_svc, &["put", "secret/b", "1"]), "").await?;
    ensure!(
        code != Some(0) && err.to_lowercase().contains("permission"),
        "a put outside svc's grants exited {code:?}: {err}"
    );
    let (code, _, err) = etcdctl(
        api,
        &["--user", "svc", "--password", "guess", "get", "config/a"],
        "",
    )
    .await?;
    ensure!(
        code != Some(0) && err.contains("authentication failed"),
        "a wrong password exited {code:?}: {err}"
    );
    // The other identity's token does not log in as svc.
    let (code, _, err) = etcdctl(
        api,
        &["--user", "svc", "--password", other, "get", "config/a"],
        "",
    )
    .await?;
    ensure!(
        code != Some(0) && err.contains("authentication failed"),
        "another identity's token logged in as svc: {code:?} {err}"
    );

    // A lease is its granter's: another identity's keepalive finds it unknown.
    let granted = ok(api, &with(&as_svc, &["lease", "grant", "30"])).await?;
    let id = granted
        .split_whitespace()
        .nth(1)
        .context("no lease ID in the grant")?;
    let kept = etcdctl(
        api,
        &with(&as_other, &["lease", "keep-alive", "--once", id]),
        "",
    )
    .await?;
    ensure!(
        kept.0 != Some(0),
        "another identity kept svc's lease alive: {kept:?}"
    );
    let (code, _, err) = etcdctl(
        api,
        &with(&as_other, &["put", "--lease", id, "config/stolen", "x"]),
        "",
    )
    .await?;
    ensure!(
        code != Some(0) && err.contains("requested lease not found"),
        "another identity put a key on svc's lease: {code:?} {err}"
    );
    ok(api, &with(&as_svc, &["lease", "keep-alive", "--once", id])).await?;

    let (code, _, err) = etcdctl(api, &with(&as_svc, &["user", "add", "bob:pw"]), "").await?;
    ensure!(
        code != Some(0) && err.contains("UserAdd is not served"),
        "user add exited {code:?}: {err}"
    );
    Ok(())
}

/// `etcdctl watch` through the proxy: from a past revision (`--rev`), on a prefix, with
/// the previous values (`--prev-kv`); it sees client keys only, never lockcell's own.
pub async fn etcdctl_watches_from_a_revision_with_previous_values() -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt;
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    ok(&api, &["put", "config/w", "1"]).await?;
    let read = ok(&api, &["get", "config/w", "-w", "json"]).await?;
    let read: serde_json::Value = serde_json::from_str(&read)?;
    let first = read["kvs"][0]["mod_revision"]
        .as_i64()
        .context("no mod_revision in etcdctl's JSON")?;
    ok(&api, &["put", "config/w", "2"]).await?;

    let mut watch = tokio::process::Command::new("etcdctl")
        .args([
            "--endpoints",
            &api,
            "watch",
            "config/",
            "--prefix",
            "--prev-kv",
        ])
        .arg(format!("--rev={first}"))
        .env("ETCDCTL_API", "3")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = watch.stdout.take().context("watch's stdout")?;
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    // The history first; then a delete made while it watches.
    let mut deleted = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !seen.contains("DELETE") {
        if !deleted && seen.matches("PUT").count() >= 2 {
            ok(&api, &["del", "config/w"]).await?;
            deleted = true;
        }
        let n = tokio::time::timeout_at(deadline, stdout.read(&mut buf))
            .await
            .with_context(|| format!("the watch printed only {seen:?} in 20 s"))??;
        ensure!(n > 0, "the watch ended after {seen:?}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let lines: Vec<&str> = seen.lines().collect();
    // PUT config/w 1; PUT (previous config/w 1) config/w 2; DELETE (previous config/w 2).
    ensure!(
        lines.starts_with(&["PUT", "config/w", "1", "PUT", "config/w", "1", "config/w", "2"]),
        "the watch printed {lines:?}"
    );
    ensure!(
        lines.contains(&"DELETE") && !seen.contains("/k/") && !seen.contains("/s/"),
        "the watch printed {lines:?}"
    );
    Ok(())
}

/// Lease IDs are unique across the cell: two proxies hand out different IDs, and an ID a
/// client chooses is taken at one proxy at a time, free again once its lease is revoked.
pub async fn lease_ids_are_unique_across_the_proxies_of_a_cell() -> anyhow::Result<()> {
    use etcd_client::LeaseGrantOptions;
    let etcd = EtcdCluster::start(1).await?;
    let (_a, api_a) = proxy_with_etcd_api(&etcd).await?;
    let (_b, api_b) = proxy_with_etcd_api(&etcd).await?;
    let mut a = etcd_client::Client::connect([api_a.as_str()], None).await?;
    let mut b = etcd_client::Client::connect([api_b.as_str()], None).await?;

    let mut seen = std::collections::HashSet::new();
    for _ in 0..20 {
        for client in [&mut a, &mut b] {
            let id = client.lease_grant(10, None).await?.id();
            ensure!(id >> 48 == 0x6c63, "lease ID {id:x} lacks lockcell's mark");
            ensure!(seen.insert(id), "lease ID {id:x} was handed out twice");
        }
    }

    let chosen = 0x1234_5678;
    let with_id = || Some(LeaseGrantOptions::new().with_id(chosen));
    ensure!(a.lease_grant(10, with_id()).await?.id() == chosen);
    let again = b.lease_grant(10, with_id()).await;
    ensure!(
        matches!(&again, Err(e) if e.to_string().contains("lease already exists")),
        "a second proxy granted a taken lease ID: {again:?}"
    );
    let mine = a.lease_grant(10, with_id()).await;
    ensure!(
        matches!(&mine, Err(e) if e.to_string().contains("lease already exists")),
        "the same proxy granted a taken lease ID again: {mine:?}"
    );
    a.lease_revoke(chosen).await?;
    ensure!(
        b.lease_grant(10, with_id()).await?.id() == chosen,
        "a revoked lease's ID was not free again"
    );
    let ours = a
        .lease_grant(10, Some(LeaseGrantOptions::new().with_id(0x6c63 << 48 | 7)))
        .await;
    ensure!(
        ours.is_err(),
        "a client chose an ID in lockcell's range: {ours:?}"
    );
    Ok(())
}

/// `etcdctl lock` through the proxy: two holders at once never overlap, and each gets a
/// key of the lock's name on its own lease.
pub async fn two_etcdctl_locks_at_once_never_overlap() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    let log = etcd.dir.join("lock-holds.log");
    let hold = format!(
        "echo \"start $(date +%s.%N) $ETCD_LOCK_KEY\" >> '{log}'; sleep 1; echo \"end $(date +%s.%N)\" >> '{log}'",
        log = log.display()
    );
    let run = || {
        tokio::process::Command::new("etcdctl")
            .args([
                "--endpoints",
                &api,
                "lock",
                "jobs/nightly",
                "--",
                "sh",
                "-c",
                &hold,
            ])
            .env("ETCDCTL_API", "3")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .output()
    };
    let (a, b) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(run(), run())
    })
    .await
    .context("two etcdctl locks did not finish within 60 s")?;
    for out in [a?, b?] {
        ensure!(
            out.status.success(),
            "etcdctl lock failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = std::fs::read_to_string(&log)?;
    let mut holds = Vec::new();
    let mut open: Option<f64> = None;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (what, at) = (
            words.next(),
            words.next().and_then(|t| t.parse::<f64>().ok()),
        );
        match (what, at, open) {
            (Some("start"), Some(at), None) => open = Some(at),
            (Some("end"), Some(at), Some(from)) => {
                holds.push((from, at));
                open = None;
            }
            _ => anyhow::bail!("the holds overlapped or the log is garbled:\n{text}"),
        }
    }
    ensure!(
        holds.len() == 2,
        "expected two holds, the log says:\n{text}"
    );
    ensure!(
        holds[1].0 >= holds[0].1,
        "the second hold began before the first ended:\n{text}"
    );
    // Each hold's key is the lock's name and the holder's lease, in hex.
    ensure!(
        text.lines()
            .filter(|l| l.starts_with("start "))
            .all(|l| l.contains("jobs/nightly/6c63")),
        "a hold's key is not jobs/nightly/<lease>:\n{text}"
    );
    // The lock is free once both are done: nothing is left under its name.
    let left = ok(&api, &["get", "jobs/nightly/", "--prefix", "--keys-only"]).await?;
    ensure!(left.trim().is_empty(), "keys left under the lock: {left}");
    Ok(())
}

/// A Lock call whose caller gives up while waiting takes its own key out of line; a
/// second call on a key the lease already has, given up, leaves the first call's key.
pub async fn a_lock_wait_given_up_leaves_only_what_it_made() -> anyhow::Result<()> {
    use etcd_client::LockOptions;
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    let mut client = etcd_client::Client::connect([api.as_str()], None).await?;
    let holder = client.lease_grant(30, None).await?.id();
    let waiter = client.lease_grant(30, None).await?.id();
    let on = |lease| Some(LockOptions::new().with_lease(lease));
    let held = client
        .lock("m", on(holder))
        .await
        .context("the first lock")?
        .key()
        .to_vec();

    let keys = |client: etcd_client::Client| async move { line_keys(&client, "m/").await };
    // A wait given up: its key goes.
    let gave_up =
        tokio::time::timeout(Duration::from_millis(800), client.lock("m", on(waiter))).await;
    ensure!(
        gave_up.is_err(),
        "the second lease got a held lock: {gave_up:?}"
    );
    let only_held = vec![String::from_utf8_lossy(&held).into_owned()];
    eventually(
        "a given-up wait's key leaves the line",
        Duration::from_secs(10),
        || {
            let (client, only_held) = (client.clone(), only_held.clone());
            async move { Ok((keys(client).await? == only_held).then_some(())) }
        },
    )
    .await?;

    // The waiter waits for real; a second call of its lease, given up, leaves the first
    // call's key in line, and the first call gets the lock when the holder lets go.
    let mut first_client = client.clone();
    let first = tokio::spawn(async move { first_client.lock("m", on(waiter)).await });
    eventually(
        "the waiting call's key shows in line",
        Duration::from_secs(10),
        || {
            let client = client.clone();
            async move { Ok((keys(client).await?.len() >= 2).then_some(())) }
        },
    )
    .await?;
    let second =
        tokio::time::timeout(Duration::from_millis(800), client.lock("m", on(waiter))).await;
    ensure!(
        second.is_err(),
        "the second call got a held lock: {second:?}"
    );
    let line = keys(client.clone()).await?;
    ensure!(
        line.len() == 2,
        "the first call's key left the line: {line:?}"
    );
    client.unlock(held).await?;
    let got = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .context("the waiting call did not get the lock once it was free")???;
    // Its key is the one that waited in line, still there: had the given-up second
    // call taken it out, the first would have been refused ("the lock's key is gone").
    let got = String::from_utf8_lossy(got.key()).into_owned();
    ensure!(
        line.contains(&got),
        "the waiting call got {got:?}, not one of {line:?}"
    );
    ensure!(
        keys(client.clone()).await? == vec![got.clone()],
        "the lock's key {got} is not the one key under its name"
    );
    Ok(())
}

/// `etcdctl elect` and `elect --listen` through the proxy: an observer sees each leader
/// in turn, the second only once the first has resigned.
pub async fn etcdctl_elect_observers_see_every_leader_in_order() -> anyhow::Result<()> {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    use tokio::io::AsyncBufReadExt;
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    let etcdctl = |args: &[&str]| {
        let mut command = tokio::process::Command::new("etcdctl");
        command
            .args(["--endpoints", &api])
            .args(args)
            .env("ETCDCTL_API", "3")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true);
        command.spawn()
    };
    let mut listen = etcdctl(&["elect", "--listen", "ops/leader"])?;
    let mut seen = tokio::io::BufReader::new(listen.stdout.take().context("stdout")?).lines();
    // Lines come in pairs: the leader's key, then its value.
    let mut next_leader = async || -> anyhow::Result<String> {
        let next = async {
            seen.next_line().await?.context("the listener ended")?;
            seen.next_line().await?.context("the listener ended")
        };
        tokio::time::timeout(Duration::from_secs(20), next)
            .await
            .context("the listener saw no new leader within 20 s")?
    };
    let mut first = etcdctl(&["elect", "ops/leader", "leader-1"])?;
    ensure!(
        next_leader().await? == "leader-1",
        "the first leader seen is not leader-1"
    );
    let mut second = etcdctl(&["elect", "ops/leader", "leader-2"])?;
    // When leader-2 says it is elected (etcdctl prints its key then), timed as it comes.
    let mut said = tokio::io::BufReader::new(second.stdout.take().context("stdout")?).lines();
    let elected = tokio::spawn(async move {
        let line = said.next_line().await;
        (tokio::time::Instant::now(), line)
    });
    // leader-2 campaigns: its key is in line behind leader-1's.
    eventually("leader-2 campaigns", Duration::from_secs(10), || async {
        let line = ok(&api, &["get", "ops/leader/", "--prefix", "--keys-only"]).await?;
        Ok((line.lines().filter(|l| !l.is_empty()).count() >= 2).then_some(()))
    })
    .await?;
    // leader-1 resigns (etcdctl does, on SIGTERM): then, and only then, leader-2 leads.
    let resigned = tokio::time::Instant::now();
    let pid = first.id().context("leader-1's pid")? as i32;
    kill(Pid::from_raw(pid), Signal::SIGTERM)?;
    ensure!(
        next_leader().await? == "leader-2",
        "the second leader seen is not leader-2"
    );
    let _ = first.wait().await;
    let (at, line) = tokio::time::timeout(Duration::from_secs(5), elected)
        .await
        .context("leader-2 did not say it was elected")??;
    ensure!(
        line?.is_some_and(|key| key.starts_with("ops/leader/6c63")),
        "leader-2's campaign key is not ops/leader/<lease>"
    );
    ensure!(
        at >= resigned,
        "leader-2 was elected while leader-1 still led"
    );
    let _ = second.start_kill();
    Ok(())
}

/// Found by review: a leased put racing its lease's revoke answered "lease not found"
/// although it had written, and the key's old value was then gone. Now a refused put
/// has written nothing; a TTL of 1 s is raised to one a keepalive can answer; and a
/// request etcd itself refuses keeps etcd's code and text.
pub async fn a_leased_put_racing_its_revoke_is_all_or_nothing() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    let client = etcd_client::Client::connect([api.as_str()], None).await?;
    for round in 0..40 {
        let key = format!("race/{round}");
        let mut kv = client.kv_client();
        kv.put(key.as_str(), "precious", None).await?;
        let lease = client.lease_client().grant(10, None).await?.id();
        let (mut putter, mut revoker) = (client.kv_client(), client.lease_client());
        let leased = etcd_client::PutOptions::new().with_lease(lease);
        let (put, _) = tokio::join!(
            putter.put(key.as_str(), "leased", Some(leased)),
            revoker.revoke(lease)
        );
        if let Err(e) = put {
            ensure!(
                e.to_string().contains("requested lease not found"),
                "round {round}: the put failed otherwise: {e}"
            );
            let now = kv.get(key.as_str(), None).await?;
            let value = now.kvs().first().map(|kv| kv.value().to_vec());
            ensure!(
                value.as_deref() == Some(&b"precious"[..]),
                "round {round}: a put refused for its lease changed the key to {value:?}"
            );
        }
    }

    let mut leases = client.lease_client();
    let short = leases.grant(1, None).await?;
    ensure!(
        short.ttl() >= 2,
        "a 1 s lease was granted with TTL {}",
        short.ttl()
    );
    let (mut keeper, mut replies) = leases.keep_alive(short.id()).await?;
    keeper.keep_alive().await?;
    let reply = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .context("a short lease's keepalive was not answered within 5 s")??
        .context("the keepalive stream ended")?;
    ensure!(
        reply.ttl() >= 1,
        "a live short lease was answered TTL {}",
        reply.ttl()
    );

    // A transaction that writes one key twice: etcd refuses it, as INVALID_ARGUMENT.
    let twice = etcd_client::Txn::new().and_then([
        etcd_client::TxnOp::put("dup/a", "1", None),
        etcd_client::TxnOp::put("dup/a", "2", None),
    ]);
    match client.kv_client().txn(twice).await {
        Err(etcd_client::Error::GRpcStatus(status)) => ensure!(
            status.code() == tonic::Code::InvalidArgument
                && status.message().contains("duplicate key"),
            "a duplicate-key txn was refused as {:?}: {}",
            status.code(),
            status.message()
        ),
        other => anyhow::bail!("a duplicate-key txn was not refused: {other:?}"),
    }
    Ok(())
}

/// Two Lock calls of one lease at once, the one that made the key given up: its key
/// leaves the line, and the other call, which stood on that same key, is refused when
/// the lock frees, never granted a hold with no key behind it.
pub async fn a_lock_call_standing_on_a_withdrawn_key_is_refused() -> anyhow::Result<()> {
    use etcd_client::LockOptions;
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    let client = etcd_client::Client::connect([api.as_str()], None).await?;
    let holder = client.lease_client().grant(30, None).await?.id();
    let waiter = client.lease_client().grant(30, None).await?.id();
    let on = |lease| Some(LockOptions::new().with_lease(lease));
    let held = client
        .lock_client()
        .lock("n", on(holder))
        .await?
        .key()
        .to_vec();
    let in_line = |client: etcd_client::Client| async move {
        anyhow::Ok(line_keys(&client, "n/").await?.len())
    };
    // The first call makes the waiter's key; the second finds it there.
    let mut a_client = client.lock_client();
    // It gives up after 2 s, as a caller with a deadline does.
    let first = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(2), a_client.lock("n", on(waiter))).await
    });
    eventually(
        "the first call's key shows",
        Duration::from_secs(10),
        || {
            let client = client.clone();
            async move { Ok((in_line(client).await? == 2).then_some(())) }
        },
    )
    .await?;
    let mut b_client = client.lock_client();
    let second = tokio::spawn(async move { b_client.lock("n", on(waiter)).await });
    // The second call has placed itself once the proxy has answered a read after it;
    // then the first is given up, and its key leaves the line.
    client.kv_client().get("n/", None).await?;
    ensure!(
        first.await?.is_err(),
        "the first call got the lock while it was held"
    );
    eventually(
        "the given-up call's key leaves",
        Duration::from_secs(10),
        || {
            let client = client.clone();
            async move { Ok((in_line(client).await? == 1).then_some(())) }
        },
    )
    .await?;
    client.lock_client().unlock(held).await?;
    let outcome = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .context("the second call neither got the lock nor was refused within 10 s")??;
    ensure!(
        outcome.is_err(),
        "the second call was granted with its key gone: {:?}",
        outcome.map(|r| String::from_utf8_lossy(r.key()).into_owned())
    );
    ensure!(
        in_line(client.clone()).await? == 0,
        "keys left under the lock"
    );
    Ok(())
}

/// Renews `lease` once through `client` and returns the TTL answered (0: gone).
async fn renew_once(client: &etcd_client::Client, lease: i64) -> anyhow::Result<i64> {
    // The client sends the first renewal itself, and waits for its answer.
    let opened = tokio::time::timeout(
        Duration::from_secs(10),
        client.lease_client().keep_alive(lease),
    )
    .await
    .context("a keepalive was not answered within 10 s")?;
    let (mut keeper, mut replies) = opened?;
    keeper.keep_alive().await?;
    let reply = tokio::time::timeout(Duration::from_secs(10), replies.message())
        .await
        .context("a keepalive was not answered within 10 s")??
        .context("the keepalive stream ended")?;
    Ok(reply.ttl())
}

/// The create revision and client lease of `key` as `client` reads it, if it is there.
/// Lease `lease`'s time to live and its keys, sorted, as `client`'s proxy answers.
async fn lease_keys(
    client: &etcd_client::Client,
    lease: i64,
) -> anyhow::Result<(i64, Vec<String>)> {
    let listed = client
        .lease_client()
        .time_to_live(
            lease,
            Some(etcd_client::LeaseTimeToLiveOptions::new().with_keys()),
        )
        .await?;
    let mut keys: Vec<String> = listed
        .keys()
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    keys.sort();
    Ok((listed.ttl(), keys))
}

async fn key_state(client: &etcd_client::Client, key: &str) -> anyhow::Result<Option<(i64, i64)>> {
    let got = client.kv_client().get(key, None).await?;
    Ok(got
        .kvs()
        .first()
        .map(|kv| (kv.create_revision(), kv.lease())))
}

/// A draining proxy hands its etcd clients' leases over: a client that goes on at
/// another proxy keeps its lease ID, its leased key (same create revision, still shown
/// on its lease) and its hold of a lock, past the first proxy's own etcd lease; and its
/// keys still go with the lease when it is revoked there.
pub async fn a_drained_proxys_leases_go_on_at_the_next_proxy() -> anyhow::Result<()> {
    use etcd_client::{LockOptions, PutOptions};
    let etcd = EtcdCluster::start(1).await?;
    let (mut a, api_a) = proxy_with_etcd_api(&etcd).await?;
    let (_b, api_b) = proxy_with_etcd_api(&etcd).await?;
    let on_a = etcd_client::Client::connect([api_a.as_str()], None).await?;
    let on_b = etcd_client::Client::connect([api_b.as_str()], None).await?;

    let lease = on_a.lease_client().grant(10, None).await?.id();
    let leased = PutOptions::new().with_lease(lease);
    on_a.kv_client().put("held/k", "v", Some(leased)).await?;
    let (created, _) = key_state(&on_a, "held/k")
        .await?
        .context("the leased key")?;
    let lock = on_a
        .lock_client()
        .lock("jobs/x", Some(LockOptions::new().with_lease(lease)))
        .await?;
    let lock_key = String::from_utf8(lock.key().to_vec())?;
    let idle = on_a.lease_client().grant(10, None).await?.id();

    a.process.signal(nix::sys::signal::Signal::SIGTERM)?;
    a.wait_for_log("handed over to the next proxy", Duration::from_secs(10))
        .await?;
    ensure!(
        renew_once(&on_b, lease).await? > 0,
        "the lease was not taken over at the next proxy"
    );
    ensure!(
        renew_once(&on_b, idle).await? > 0,
        "a lease with no keys was not taken over"
    );
    let status = a.process.wait_exit(Duration::from_secs(20)).await?;
    ensure!(status.success(), "the drained proxy exited {status}");
    let (_, keys) = lease_keys(&on_b, lease).await?;
    ensure!(
        keys == ["held/k", lock_key.as_str()],
        "the lease taken over lists {keys:?}"
    );

    // Past the first proxy's own etcd lease (3 s), renewed at the second.
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut renewals = tokio::time::interval(Duration::from_millis(500));
    while renewals.tick().await < until {
        ensure!(renew_once(&on_b, lease).await? > 0, "the lease lapsed at b");
    }
    ensure!(
        key_state(&on_b, "held/k").await? == Some((created, lease)),
        "the leased key is not as it was: {:?}",
        key_state(&on_b, "held/k").await?
    );
    // The lock is still this lease's: another lease waits for it.
    let other = on_b.lease_client().grant(10, None).await?.id();
    let waiting = tokio::time::timeout(
        Duration::from_secs(2),
        on_b.lock_client()
            .lock("jobs/x", Some(LockOptions::new().with_lease(other))),
    )
    .await;
    ensure!(
        waiting.is_err(),
        "another lease was granted the lock the handed-over lease holds: {waiting:?}"
    );

    on_b.lease_client().revoke(lease).await?;
    ensure!(
        key_state(&on_b, "held/k").await?.is_none(),
        "the key outlived its lease's revoke"
    );
    Ok(())
}

/// A client that knows one proxy keeps its lease across that proxy's restart: the
/// proxy hands the lease over as it drains, leaves its own etcd lease to run out
/// rather than revoking it, and takes the lease back when the client comes again.
pub async fn a_lease_outlives_a_restart_of_its_only_proxy() -> anyhow::Result<()> {
    use etcd_client::PutOptions;
    let etcd = EtcdCluster::start(1).await?;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec!["--etcd-listen".into(), listen.clone()];
    // Room for the restart within the proxy lease the keys wait on.
    options.lease_ttl = Duration::from_secs(8);
    let mut proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    let client = etcd_client::Client::connect([listen.as_str()], None).await?;

    let lease = client.lease_client().grant(20, None).await?.id();
    let leased = PutOptions::new().with_lease(lease);
    client.kv_client().put("held/k", "v", Some(leased)).await?;
    let before = key_state(&client, "held/k").await?;

    proxy.process.signal(nix::sys::signal::Signal::SIGTERM)?;
    let status = proxy.process.wait_exit(Duration::from_secs(20)).await?;
    ensure!(status.success(), "the proxy exited {status}");
    proxy.process.respawn()?;
    proxy.wait_ready(Duration::from_secs(20)).await?;

    let ttl = eventually("the lease is taken back", Duration::from_secs(10), || {
        let client = client.clone();
        async move {
            // Refused while the connection comes back.
            Ok(renew_once(&client, lease).await.ok())
        }
    })
    .await?;
    ensure!(ttl > 0, "the restarted proxy answered TTL {ttl}");
    ensure!(
        key_state(&client, "held/k").await? == before,
        "the leased key changed across the restart: {:?} then {:?}",
        before,
        key_state(&client, "held/k").await?
    );
    Ok(())
}

/// A key deleted, or written again without its lease, is no longer the lease's, as in
/// etcd: TimeToLive no longer lists it, and the lease's revoke leaves it alone. A client
/// that writes many keys on one lease and deletes each (a lock recipe under load) leaves
/// its lease holding only the key it has now.
pub async fn a_key_deleted_or_rewritten_leaves_its_lease() -> anyhow::Result<()> {
    use etcd_client::PutOptions;
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, listen) = proxy_with_etcd_api(&etcd).await?;
    let client = etcd_client::Client::connect([listen.as_str()], None).await?;
    let (lease, other) = (
        client.lease_client().grant(30, None).await?.id(),
        client.lease_client().grant(30, None).await?.id(),
    );
    let leased = |lease: i64| Some(PutOptions::new().with_lease(lease));
    let mut kv = client.kv_client();
    for i in 0..50 {
        let key = format!("acq/{i}");
        kv.put(key.as_str(), "held", leased(lease)).await?;
        kv.delete(key.as_str(), None).await?;
    }
    for key in ["k/kept", "k/plain", "k/other"] {
        kv.put(key, "v", leased(lease)).await?;
    }
    kv.put("k/plain", "mine now", None).await?;
    kv.put("k/other", "theirs now", leased(other)).await?;

    let want = vec!["k/kept".to_owned()];
    let keys = eventually(
        "the lease lists only the key it still holds",
        Duration::from_secs(10),
        || {
            let (client, want) = (client.clone(), want.clone());
            async move {
                let (_, keys) = lease_keys(&client, lease).await?;
                Ok((keys == want).then_some(keys))
            }
        },
    )
    .await;
    let keys = match keys {
        Ok(keys) => keys,
        Err(_) => {
            let (_, keys) = lease_keys(&client, lease).await?;
            anyhow::bail!("the lease lists {keys:?}, where etcd would list {want:?}");
        }
    };
    ensure!(keys == want);
    let (_, theirs) = lease_keys(&client, other).await?;
    ensure!(
        theirs == ["k/other"],
        "the other lease lists {theirs:?} after k/other was written with it"
    );

    client.lease_client().revoke(lease).await?;
    ensure!(
        key_state(&client, "k/kept").await?.is_none(),
        "the revoked lease's own key is still there"
    );
    for key in ["k/plain", "k/other"] {
        ensure!(
            key_state(&client, key).await?.is_some(),
            "{key}, written again without the revoked lease, went with it"
        );
    }
    Ok(())
}

/// etcd's Election service through a proxy, called by the Rust etcd-client crate: the
/// first campaign leads and the second waits; Leader and Observe show the leader's
/// key, value and lease; a proclamation changes the value, a stale leader key's is
/// refused as etcd refuses it; a resignation passes the lead to the next candidate.
pub async fn the_election_service_elects_one_leader_at_a_time() -> anyhow::Result<()> {
    use etcd_client::{ProclaimOptions, ResignOptions};
    let etcd = EtcdCluster::start(1).await?;
    let (_proxy, api) = proxy_with_etcd_api(&etcd).await?;
    let client = etcd_client::Client::connect([api.as_str()], None).await?;
    let first = client.lease_client().grant(30, None).await?.id();
    let second = client.lease_client().grant(30, None).await?.id();

    let mut elections = client.election_client();
    let leading = elections.campaign("jobs/leader", "one", first).await?;
    let leader = leading
        .leader()
        .context("a campaign answers its key")?
        .clone();
    ensure!(
        leader.key() == format!("jobs/leader/{first:x}").as_bytes() && leader.lease() == first,
        "the leader key is {:?} on lease {:x}",
        String::from_utf8_lossy(leader.key()),
        leader.lease()
    );
    let mut observed = client.election_client().observe("jobs/leader").await?;
    let seen = observed.message().await?.context("observe ends at once")?;
    let kv = seen.kv().context("an observed leader has its key")?;
    ensure!(
        kv.value() == b"one" && kv.lease() == first && kv.create_revision() == leader.rev(),
        "observe showed {kv:?}"
    );

    let mut waiting = client.election_client();
    let mut contender =
        tokio::spawn(async move { waiting.campaign("jobs/leader", "two", second).await });
    let early = tokio::time::timeout(Duration::from_millis(500), &mut contender).await;
    ensure!(
        early.is_err(),
        "a second campaign led beside the first: {early:?}"
    );

    elections
        .proclaim(
            "one again",
            Some(ProclaimOptions::new().with_leader(leader.clone())),
        )
        .await?;
    let now = elections.leader("jobs/leader").await?;
    ensure!(
        now.kv().map(|kv| kv.value()) == Some(&b"one again"[..]),
        "Leader shows {:?} after the proclamation",
        now.kv()
    );
    let seen = observed.message().await?.context("observe ended")?;
    ensure!(
        seen.kv().map(|kv| kv.value()) == Some(&b"one again"[..]),
        "observe missed the proclamation: {:?}",
        seen.kv()
    );

    elections
        .resign(Some(ResignOptions::new().with_leader(leader.clone())))
        .await?;
    let next = tokio::time::timeout(Duration::from_secs(10), contender)
        .await
        .context("the second campaign did not lead within 10 s of the resignation")???;
    let next = next.leader().context("a campaign answers its key")?.clone();
    ensure!(
        next.lease() == second,
        "the lead went to lease {:x}",
        next.lease()
    );
    let seen = observed.message().await?.context("observe ended")?;
    ensure!(
        seen.kv().map(|kv| (kv.value(), kv.lease())) == Some((&b"two"[..], second)),
        "observe did not show the next leader: {:?}",
        seen.kv()
    );
    let stale = elections
        .proclaim("usurp", Some(ProclaimOptions::new().with_leader(leader)))
        .await;
    ensure!(
        matches!(&stale, Err(e) if e.to_string().contains("election: not leader")),
        "a resigned leader's proclamation was not refused: {stale:?}"
    );
    client.lease_client().revoke(second).await?;
    let none = elections.leader("jobs/leader").await;
    ensure!(
        matches!(&none, Err(e) if e.to_string().contains("election: no leader")),
        "Leader of an empty election answered {none:?}"
    );
    Ok(())
}

/// A stream that asks for a leader (`etcdctl watch` does, as Go's
/// `clientv3.WithRequireLeader`) ends with etcd's "no leader" once the proxy is cut off
/// from etcd, as a member without a leader ends it.
pub async fn a_watch_that_requires_a_leader_ends_when_the_proxy_is_cut_off() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let link = lockcell_tests::relay::Relay::start(&etcd.endpoints()[0]).await?;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", vec![link.addr.clone()]);
    options.extra_args = vec!["--etcd-listen".into(), listen.clone()];
    let _proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    ok(&listen, &["put", "watched", "one"]).await?;

    let mut watch = tokio::process::Command::new("etcdctl")
        // From the start of the key's history, so no put can slip in before the watch.
        .args([
            "--endpoints",
            listen.as_str(),
            "watch",
            "watched",
            "--rev",
            "1",
        ])
        .env("ETCDCTL_API", "3")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting etcdctl watch")?;
    // The watch serves while etcd is reachable.
    ok(&listen, &["put", "watched", "two"]).await?;
    let early = tokio::time::timeout(Duration::from_secs(2), watch.wait()).await;
    ensure!(
        early.is_err(),
        "the watch ended while etcd was reachable: {early:?}"
    );

    link.cut(true);
    let out = tokio::time::timeout(Duration::from_secs(20), watch.wait_with_output())
        .await
        .context("the watch went on 20 s after the proxy was cut off from etcd")??;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        said.contains("two") && said.contains("no leader"),
        "the watch printed {said:?}"
    );
    link.cut(false);
    Ok(())
}

/// A leased write whose answer the client gave up on, but which landed (a lock key a
/// retry then stood on, as Go's `concurrency.Mutex` retries), is handed over with its
/// lease: it is still there past the first proxy's own etcd lease, so the lock it
/// stands for is not granted to anyone else while its lease lives.
pub async fn a_write_whose_answer_was_lost_is_handed_over_with_its_lease() -> anyhow::Result<()> {
    use etcd_client::proto::{PbCompare, PbCompareTarget, PbTargetUnion, PbTxnResponse};
    use etcd_client::proto::{PbPutRequest, PbTxnOpRequest, PbTxnRequest, PbTxnRequestOp};
    let etcd = EtcdCluster::start(1).await?;
    let (mut a, api_a) = proxy_with_etcd_api(&etcd).await?;
    let (_b, api_b) = proxy_with_etcd_api(&etcd).await?;
    let on_a = etcd_client::Client::connect([api_a.as_str()], None).await?;
    let on_b = etcd_client::Client::connect([api_b.as_str()], None).await?;
    let lease = on_a.lease_client().grant(60, None).await?.id();

    // The lock recipe's put, with a deadline the proxy is told of (`grpc-timeout`), so
    // the proxy gives up on it too: some land in etcd, unanswered.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{api_a}"))?
        .connect()
        .await?;
    let mut landed = None;
    for attempt in 0..400 {
        let key = format!("lost-answer/{attempt}/{lease:x}").into_bytes();
        let txn = PbTxnRequest {
            compare: vec![PbCompare {
                key: key.clone(),
                target: PbCompareTarget::Create as i32,
                target_union: Some(PbTargetUnion::CreateRevision(0)),
                ..PbCompare::default()
            }],
            success: vec![PbTxnRequestOp {
                request: Some(PbTxnOpRequest::RequestPut(PbPutRequest {
                    key: key.clone(),
                    lease,
                    ..PbPutRequest::default()
                })),
            }],
            failure: Vec::new(),
        };
        let mut request = tonic::Request::new(txn);
        request.set_timeout(Duration::from_micros(300 + 100 * (attempt % 40)));
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await?;
        let path = tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.KV/Txn");
        let codec = tonic_prost::ProstCodec::<PbTxnRequest, PbTxnResponse>::default();
        if grpc.unary(request, path, codec).await.is_ok() {
            continue;
        }
        let key = String::from_utf8(key)?;
        if key_state(&on_a, &key).await?.is_some() {
            landed = Some(key);
            break;
        }
    }
    let key = landed.context("no write landed unanswered in 400 tries")?;
    let (created, _) = key_state(&on_a, &key).await?.context("the key")?;

    a.process.signal(nix::sys::signal::Signal::SIGTERM)?;
    a.wait_for_log("handed over to the next proxy", Duration::from_secs(10))
        .await?;
    ensure!(
        renew_once(&on_b, lease).await? > 0,
        "the lease was not taken over"
    );
    a.process.wait_exit(Duration::from_secs(20)).await?;
    // Past the first proxy's own etcd lease (3 s).
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut renewals = tokio::time::interval(Duration::from_millis(500));
    while renewals.tick().await < until {
        ensure!(renew_once(&on_b, lease).await? > 0, "the lease lapsed at b");
    }
    let now = key_state(&on_b, &key).await?;
    ensure!(
        now.map(|(c, _)| c) == Some(created),
        "the unanswered write {key:?} did not go on with its lease: {now:?}"
    );
    Ok(())
}

/// A handed-over lease is taken only by its owner: a lease granted to an identity is
/// not taken by an anonymous client at a proxy without grants, and stays for its owner.
pub async fn only_its_owner_takes_a_handed_over_lease() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let token = "alice-token-0123456789abcdef0123456789";
    let grants = etcd.dir.join("handoff-grants.toml");
    token_grants(&grants, "held/", &[("alice", token)])?;
    let (mut g, api_g) = proxy_with_grants(&etcd, &grants).await?;
    let (_h, api_h) = proxy_with_grants(&etcd, &grants).await?;
    let (_b, api_b) = proxy_with_etcd_api(&etcd).await?;
    let alice = || etcd_client::ConnectOptions::new().with_user("alice", token);
    let on_g = etcd_client::Client::connect([api_g.as_str()], Some(alice())).await?;
    let lease = on_g.lease_client().grant(30, None).await?.id();
    let leased = etcd_client::PutOptions::new().with_lease(lease);
    on_g.kv_client().put("held/k", "v", Some(leased)).await?;

    g.process.signal(nix::sys::signal::Signal::SIGTERM)?;
    g.wait_for_log("handed over to the next proxy", Duration::from_secs(10))
        .await?;
    let anonymous = etcd_client::Client::connect([api_b.as_str()], None).await?;
    let taken = renew_once(&anonymous, lease).await;
    ensure!(
        taken.is_err() || taken.as_ref().is_ok_and(|ttl| *ttl <= 0),
        "an anonymous client took alice's lease: {taken:?}"
    );
    let on_h = etcd_client::Client::connect([api_h.as_str()], Some(alice())).await?;
    ensure!(
        renew_once(&on_h, lease).await? > 0,
        "alice could not take her own lease over"
    );
    Ok(())
}

/// Go's clientv3 spreads its calls over all its endpoints: a lease granted at one proxy
/// is renewed, written with, locked with, read and revoked at any other, where the call
/// is forwarded to the proxy the lease lives at; its keys stay on that proxy's etcd
/// lease, and go when it is revoked anywhere. A lease handed over by a draining proxy
/// is found at the proxy that took it. `MemberList` names every proxy's etcd API.
pub async fn a_lease_is_served_at_every_proxy() -> anyhow::Result<()> {
    use etcd_client::{LeaseTimeToLiveOptions, LockOptions, PutOptions, Txn, TxnOp};
    let etcd = EtcdCluster::start(1).await?;
    let [(mut a, api_a, on_a), (_b, api_b, on_b), (_c, api_c, on_c)] = three_proxies(&etcd).await?;

    let lease = on_a.lease_client().grant(4, None).await?.id();
    let leased = || Some(PutOptions::new().with_lease(lease));
    ensure!(
        renew_once(&on_b, lease).await? > 0,
        "a lease granted at a was not renewed at b"
    );
    on_c.kv_client().put("svc/c", "up", leased()).await?;
    on_b.kv_client()
        .txn(Txn::new().and_then([TxnOp::put("svc/b", "up", leased())]))
        .await?;
    let lock = on_c
        .lock_client()
        .lock("jobs/y", Some(LockOptions::new().with_lease(lease)))
        .await?;
    let lock_key = String::from_utf8(lock.key().to_vec())?;
    let (ttl, keys) = lease_keys(&on_b, lease).await?;
    ensure!(
        ttl > 0 && keys == [lock_key.as_str(), "svc/b", "svc/c"],
        "the lease's time to live at b: {ttl}, keys {keys:?}"
    );
    // Every proxy lists it, once.
    for (at, client) in [("a", &on_a), ("b", &on_b), ("c", &on_c)] {
        let leases = client.lease_client().leases().await?;
        let listed = leases.leases().iter().filter(|l| l.id() == lease).count();
        ensure!(listed == 1, "the lease is listed {listed} times at {at}");
    }
    // Renewed only at b and c, for twice its TTL: it lives on, and so do its keys.
    let until = tokio::time::Instant::now() + Duration::from_secs(8);
    let mut turn = 0;
    let mut renewals = tokio::time::interval(Duration::from_millis(700));
    while renewals.tick().await < until {
        let at = if turn % 2 == 0 { &on_b } else { &on_c };
        ensure!(
            renew_once(at, lease).await? > 0,
            "the lease lapsed, renewed at b and c"
        );
        turn += 1;
    }
    ensure!(
        key_state(&on_a, "svc/c").await?.is_some(),
        "a key of the lease is gone"
    );
    // Another lease waits for the lock the lease holds, whichever proxy it asks.
    let other = on_b.lease_client().grant(10, None).await?.id();
    let waiting = tokio::time::timeout(
        Duration::from_secs(2),
        on_a.lock_client()
            .lock("jobs/y", Some(LockOptions::new().with_lease(other))),
    )
    .await;
    ensure!(
        waiting.is_err(),
        "another lease was granted the held lock: {waiting:?}"
    );

    on_c.lease_client().revoke(lease).await?;
    for key in ["svc/b", "svc/c", lock_key.as_str()] {
        ensure!(
            key_state(&on_a, key).await?.is_none(),
            "key {key} outlived its lease's revoke at c"
        );
    }
    let renewed = renew_once(&on_b, lease).await;
    ensure!(
        renewed
            .as_ref()
            .is_err_and(|e| e.to_string().contains("lease not found")),
        "a revoked lease was renewed at b: {renewed:?}"
    );
    ensure!(
        lease_keys(&on_c, lease).await?.0 == -1,
        "a revoked lease has a time to live at c"
    );

    // Every proxy's etcd API is a member.
    let members = on_c.cluster_client().member_list().await?;
    let mut urls: Vec<String> = members
        .members()
        .iter()
        .flat_map(|m| m.client_urls().iter().cloned())
        .collect();
    urls.sort();
    let mut want: Vec<String> = [&api_a, &api_b, &api_c]
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    want.sort();
    ensure!(urls == want, "MemberList at c answered {urls:?}");

    // A client given all three endpoints spreads its calls over them, as Go's does.
    let spread = etcd_client::Client::connect([&api_a, &api_b, &api_c], None).await?;
    let spread_lease = spread.lease_client().grant(10, None).await?.id();
    let on_spread = Some(PutOptions::new().with_lease(spread_lease));
    for n in 0..9 {
        let key = format!("spread/{n}");
        spread.kv_client().put(key, "up", on_spread.clone()).await?;
        ensure!(
            renew_once(&spread, spread_lease).await? > 0,
            "a lease of a client of three endpoints lapsed"
        );
    }
    let listed = spread
        .lease_client()
        .time_to_live(
            spread_lease,
            Some(LeaseTimeToLiveOptions::new().with_keys()),
        )
        .await?;
    ensure!(
        listed.keys().len() == 9,
        "the lease of a client of three endpoints lists {} keys",
        listed.keys().len()
    );

    // A lease handed over by a draining proxy is found where it went.
    let moving = on_a.lease_client().grant(10, None).await?.id();
    let on_moving = Some(PutOptions::new().with_lease(moving));
    on_a.kv_client()
        .put("svc/moving", "up", on_moving.clone())
        .await?;
    a.process.signal(nix::sys::signal::Signal::SIGTERM)?;
    a.wait_for_log("handed over to the next proxy", Duration::from_secs(10))
        .await?;
    ensure!(
        renew_once(&on_b, moving).await? > 0,
        "the handed-over lease was not taken over at b"
    );
    on_c.kv_client().put("svc/moved", "up", on_moving).await?;
    let listed = on_c
        .lease_client()
        .time_to_live(moving, Some(LeaseTimeToLiveOptions::new().with_keys()))
        .await?;
    ensure!(
        listed.keys().len() == 2,
        "the moved lease lists {} keys at c",
        listed.keys().len()
    );
    Ok(())
}

/// A forwarded call runs as its caller: another identity's call on a lease finds it
/// unknown through any proxy, and no client names a caller of its own choosing in
/// the forwarding metadata.
pub async fn a_forwarded_call_keeps_its_callers_identity() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let (alice, mallory) = (
        "alice-token-0123456789abcdef0123456789",
        "mallory-token-0123456789abcdef0123456789",
    );
    let grants = etcd.dir.join("forward-grants.toml");
    token_grants(&grants, "held/", &[("alice", alice), ("mallory", mallory)])?;
    let (_a, api_a) = proxy_with_grants(&etcd, &grants).await?;
    let (_b, api_b) = proxy_with_grants(&etcd, &grants).await?;
    let (_n, api_n) = proxy_with_etcd_api(&etcd).await?;
    let apis = [api_a, api_b];
    let login = |token: &str, api: &str| {
        let options = etcd_client::ConnectOptions::new()
            .with_user(if token == alice { "alice" } else { "mallory" }, token);
        let api = api.to_owned();
        async move { etcd_client::Client::connect([api], Some(options)).await }
    };
    let alice_a = login(alice, &apis[0]).await?;
    let alice_b = login(alice, &apis[1]).await?;
    let mallory_b = login(mallory, &apis[1]).await?;
    let lease = alice_a.lease_client().grant(10, None).await?.id();
    ensure!(
        renew_once(&alice_b, lease).await? > 0,
        "alice could not renew her lease at b"
    );
    let taken = renew_once(&mallory_b, lease).await;
    ensure!(
        taken
            .as_ref()
            .is_err_and(|e| e.to_string().contains("lease not found")),
        "mallory renewed alice's lease at b: {taken:?}"
    );
    let put = mallory_b
        .kv_client()
        .put(
            "held/m",
            "v",
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await;
    ensure!(
        put.as_ref()
            .is_err_and(|e| e.to_string().contains("requested lease not found")),
        "mallory put with alice's lease at b: {put:?}"
    );

    // Through a proxy that checks no grants, an anonymous caller is no one at a proxy
    // that does: it neither renews nor revokes alice's lease.
    let anonymous = etcd_client::Client::connect([api_n.as_str()], None).await?;
    let renewed = renew_once(&anonymous, lease).await;
    ensure!(
        renewed.is_err(),
        "an anonymous caller renewed alice's lease through a proxy without grants: {renewed:?}"
    );
    let revoked = anonymous.lease_client().revoke(lease).await;
    ensure!(
        revoked.is_err(),
        "an anonymous caller revoked alice's lease through a proxy without grants"
    );

    // A client that names a caller in the forwarding metadata itself is refused, by a
    // proxy with grants or without.
    for api in [&apis[0], &api_n] {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{api}"))?
            .connect()
            .await?;
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await?;
        let mut request =
            tonic::Request::new(etcd_client::proto::PbLeaseRevokeRequest { id: lease });
        let md = request.metadata_mut();
        md.insert("lockcell-forwarded-for", "616c696365".parse()?);
        md.insert("lockcell-forwarded-at", "0".parse()?);
        md.insert("lockcell-forwarded-mac", "00".parse()?);
        let forged: Result<tonic::Response<etcd_client::proto::PbLeaseRevokeResponse>, _> = grpc
            .unary(
                request,
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/etcdserverpb.Lease/LeaseRevoke",
                ),
                tonic_prost::ProstCodec::default(),
            )
            .await;
        ensure!(
            forged
                .as_ref()
                .is_err_and(|s| s.code() == tonic::Code::Unauthenticated),
            "a forged forwarded revoke at {api} was answered {forged:?}"
        );
    }
    ensure!(
        renew_once(&alice_a, lease).await? > 0,
        "alice's lease did not survive the forged revoke"
    );
    Ok(())
}

/// After a drain, calls on the drained proxy's leases race to other proxies: whichever
/// takes a lease over, the other finds it there (never "unknown"). A proxy that
/// remembered the drained proxy as a lease's home looks again once that proxy is gone.
/// A watch on the draining proxy ends UNAVAILABLE, so clients watch again elsewhere.
pub async fn calls_racing_a_take_over_find_the_lease() -> anyhow::Result<()> {
    use etcd_client::PutOptions;
    let etcd = EtcdCluster::start(1).await?;
    let [(mut x, _, on_x), (_y, _, on_y), (_z, _, on_z)] = three_proxies(&etcd).await?;
    let mut leases = Vec::new();
    for n in 0..8 {
        let lease = on_x.lease_client().grant(30, None).await?.id();
        let leased = Some(PutOptions::new().with_lease(lease));
        on_x.kv_client()
            .put(format!("race/{n}"), "v", leased)
            .await?;
        leases.push(lease);
    }
    // z learns that the first lease lives at x.
    ensure!(
        renew_once(&on_z, leases[0]).await? > 0,
        "z could not renew at x"
    );
    let mut events = on_x.watch_client().watch("race/", None).await?;

    x.process.signal(nix::sys::signal::Signal::SIGTERM)?;
    x.wait_for_log("handed over to the next proxy", Duration::from_secs(10))
        .await?;
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match events.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .context("the watch at the draining proxy did not end")?;
    ensure!(
        matches!(&ended, Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::Unavailable),
        "the watch at the draining proxy ended with {ended:?}"
    );
    for lease in leases.iter().skip(1) {
        let (at_y, at_z) = tokio::join!(renew_once(&on_y, *lease), renew_once(&on_z, *lease));
        ensure!(
            at_y.as_ref().is_ok_and(|t| *t > 0) && at_z.as_ref().is_ok_and(|t| *t > 0),
            "lease {lease:x} renewed at y and z at once: {at_y:?}, {at_z:?}"
        );
    }
    // The first lease goes to y; z, which found it at x, finds it at y once x is gone.
    ensure!(
        renew_once(&on_y, leases[0]).await? > 0,
        "y could not take the lease"
    );
    let status = x.process.wait_exit(Duration::from_secs(20)).await?;
    ensure!(status.success(), "the drained proxy exited {status}");
    let etcd_client = etcd.client().await?;
    eventually("x's presence record goes", Duration::from_secs(10), || {
        let mut kv = etcd_client.kv_client();
        async move {
            let got = kv
                .get(
                    "/s/!proxy/",
                    Some(etcd_client::GetOptions::new().with_prefix()),
                )
                .await?;
            Ok((got.kvs().len() == 2).then_some(()))
        }
    })
    .await?;
    ensure!(
        renew_once(&on_z, leases[0]).await? > 0,
        "z, which found the lease at x, did not find it at y"
    );
    Ok(())
}

/// A Lock call forwarded to the lease's proxy and given up half-way (the client's
/// deadline) takes its key out of line there, as a call made at that proxy does: the
/// holder's release then leaves the lock free, not granted to a caller who left. Two
/// forwarded calls of one lease at once stand in line as one key, and a repeated call
/// once the lease holds the lock answers at once with the same key.
pub async fn a_forwarded_lock_wait_given_up_leaves_nothing_in_line() -> anyhow::Result<()> {
    use etcd_client::LockOptions;
    let etcd = EtcdCluster::start(1).await?;
    let [(_a, _, on_a), (_b, _, on_b), (_c, _, on_c)] = three_proxies(&etcd).await?;
    let on = |lease: i64| Some(LockOptions::new().with_lease(lease));
    let holder = on_a.lease_client().grant(30, None).await?.id();
    let waiter = on_a.lease_client().grant(30, None).await?.id();
    let held = on_a.lock_client().lock("jobs/z", on(holder)).await?;
    let held = held.key().to_vec();
    let line = |client: etcd_client::Client| async move {
        anyhow::Ok(line_keys(&client, "jobs/z/").await?.len())
    };
    // Two calls of the waiter's lease at once, through b and c; both given up.
    let (mut lock_b, mut lock_c) = (on_b.lock_client(), on_c.lock_client());
    let (through_b, through_c) = tokio::join!(
        tokio::time::timeout(
            Duration::from_millis(1500),
            lock_b.lock("jobs/z", on(waiter))
        ),
        tokio::time::timeout(
            Duration::from_millis(1500),
            lock_c.lock("jobs/z", on(waiter))
        ),
    );
    ensure!(
        through_b.is_err() && through_c.is_err(),
        "a held lock was granted through b or c: {through_b:?} {through_c:?}"
    );
    eventually(
        "the given-up waits' key leaves the line",
        Duration::from_secs(10),
        || {
            let client = on_a.clone();
            async move { Ok((line(client).await? == 1).then_some(())) }
        },
    )
    .await?;
    on_a.lock_client().unlock(held).await?;
    ensure!(
        line(on_a.clone()).await? == 0,
        "the lock went to a caller who had given up"
    );
    // Taken through b; asked again through c, the same hold answers.
    let first = on_b.lock_client().lock("jobs/z", on(waiter)).await?;
    let again = tokio::time::timeout(
        Duration::from_secs(5),
        on_c.lock_client().lock("jobs/z", on(waiter)),
    )
    .await
    .context("a second call of the holding lease waited")??;
    ensure!(
        first.key() == again.key() && line(on_a.clone()).await? == 1,
        "a second call of the holding lease made another key"
    );
    Ok(())
}

/// One call of etcd's JSON gateway: its HTTP status and JSON body.
async fn gateway(
    http: &reqwest::Client,
    listen: &str,
    path: &str,
    token: Option<&str>,
    body: serde_json::Value,
) -> anyhow::Result<(u16, serde_json::Value)> {
    let mut request = http
        .post(format!("http://{listen}{path}"))
        .body(body.to_string());
    if let Some(token) = token {
        request = request.header("Authorization", token);
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("POST {path}"))?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let json = serde_json::from_str(&text).with_context(|| format!("{path} answered {text:?}"))?;
    Ok((status, json))
}

/// The next `{"result": …}` line of a gateway stream that `wanted` accepts, within 10 s.
async fn next_line(
    stream: &mut reqwest::Response,
    pending: &mut String,
    wanted: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            let json: serde_json::Value = serde_json::from_str(line.trim())
                .with_context(|| format!("a stream line {line:?}"))?;
            ensure!(json.get("error").is_none(), "the stream ended in {json}");
            if wanted(&json["result"]) {
                return Ok(json["result"].clone());
            }
        }
        let chunk = tokio::time::timeout_at(deadline, stream.chunk())
            .await
            .with_context(|| format!("no wanted line in 10 s; read {pending:?}"))??
            .context("the stream ended")?;
        pending.push_str(std::str::from_utf8(&chunk)?);
    }
}

/// etcd's JSON gateway, as curl and Patroni call it over HTTP/1.1: a login, puts and
/// ranges in base64, a refusal by grants, a watch stream, a lease granted, renewed,
/// written with, listed and revoked, and a refused RPC, each answered as etcd's gateway
/// answers it.
pub async fn etcds_json_gateway_answers_http_clients() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let svc = "svc-token-0123456789abcdef0123456789";
    let grants = etcd.dir.join("etcd-api-grants.toml");
    std::fs::write(
        &grants,
        format!(
            "[[grant]]\nidentity = \"svc\"\nread = [\"config/\"]\nwrite = [\"config/\"]\nwatch = [\"config/\"]\n\n\
             [[token]]\nidentity = \"svc\"\nsha256 = \"{}\"\n",
            lockcell_tests::certs::token_sha256(svc)
        ),
    )?;
    let (_proxy, listen) = proxy_with_grants(&etcd, &grants).await?;
    let http = reqwest::Client::new();
    let call = |path: &'static str, token: Option<&'static str>, body: serde_json::Value| {
        gateway(&http, &listen, path, token, body)
    };
    let version: serde_json::Value = serde_json::from_str(
        &http
            .get(format!("http://{listen}/version"))
            .send()
            .await?
            .text()
            .await?,
    )?;
    ensure!(
        version["etcdcluster"].is_string(),
        "/version answered {version}"
    );

    let put_a = serde_json::json!({"key": "Y29uZmlnL2E=", "value": "MQ=="});
    let (status, body) = call("/v3/kv/put", None, put_a.clone()).await?;
    ensure!(
        status == 401
            && body["code"] == 16
            && body["error"]
                .as_str()
                .unwrap_or("")
                .contains("user name is empty"),
        "a put without a token answered {status} {body}"
    );
    let (status, body) = call(
        "/v3/auth/authenticate",
        None,
        serde_json::json!({"name": "svc", "password": svc}),
    )
    .await?;
    ensure!(
        status == 200 && body["token"] == svc,
        "the login answered {status} {body}"
    );
    let token = Some(svc);
    let (status, body) = call("/v3/kv/put", token, put_a).await?;
    ensure!(
        status == 200 && body["header"]["revision"].is_string(),
        "the put answered {status} {body}"
    );
    let (status, body) = call(
        "/v3/kv/range",
        token,
        serde_json::json!({"key": "Y29uZmlnL2E="}),
    )
    .await?;
    ensure!(
        status == 200
            && body["count"] == "1"
            && body["kvs"][0]["key"] == "Y29uZmlnL2E="
            && body["kvs"][0]["value"] == "MQ=="
            && body["kvs"][0]["version"] == "1",
        "the range answered {status} {body}"
    );
    let (status, body) = call(
        "/v3/kv/put",
        token,
        serde_json::json!({"key": "c2VjcmV0L2I=", "value": "MQ=="}),
    )
    .await?;
    ensure!(
        status == 403 && body["code"] == 7,
        "a put outside the grants answered {status} {body}"
    );
    let (status, body) = call("/v3/kv/put", token, serde_json::json!({"key": 1})).await?;
    ensure!(
        status == 400 && body["error"].as_str().unwrap_or("").contains("PutRequest"),
        "a put that is not a PutRequest answered {status} {body}"
    );

    // A watch: one line per answer, created first, then each event.
    let mut watch = http
        .post(format!("http://{listen}/v3/watch"))
        .header("Authorization", svc)
        .body(
            serde_json::json!({"create_request": {"key": "Y29uZmlnL3c=", "prev_kv": true}})
                .to_string(),
        )
        .send()
        .await?;
    ensure!(
        watch.status().as_u16() == 200,
        "the watch answered {}",
        watch.status()
    );
    let mut pending = String::new();
    let created = next_line(&mut watch, &mut pending, |r| r["created"] == true)
        .await
        .context("waiting for the watch to be created")?;
    ensure!(
        created.get("canceled").is_none(),
        "the watch was refused: {created}"
    );
    let (status, _) = call(
        "/v3/kv/put",
        token,
        serde_json::json!({"key": "Y29uZmlnL3c=", "value": "dXA="}),
    )
    .await?;
    ensure!(status == 200, "the watched put answered {status}");
    let event = next_line(&mut watch, &mut pending, |r| r["events"].is_array()).await?;
    ensure!(
        event["events"][0]["kv"]["key"] == "Y29uZmlnL3c="
            && event["events"][0]["kv"]["value"] == "dXA=",
        "the watch saw {event}"
    );
    drop(watch);
    // A watch outside the grants: created and cancelled at once with the reason, as etcd
    // answers a watch it refuses.
    let mut refused = http
        .post(format!("http://{listen}/v3/watch"))
        .header("Authorization", svc)
        .body(serde_json::json!({"create_request": {"key": "c2VjcmV0L2I="}}).to_string())
        .send()
        .await?;
    let mut pending = String::new();
    let cancelled = next_line(&mut refused, &mut pending, |r| r["created"] == true).await?;
    ensure!(
        cancelled["canceled"] == true
            && cancelled["cancel_reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
        "a watch outside the grants answered {cancelled}"
    );

    // A lease: granted, renewed, written with, listed with its keys, revoked.
    let (status, body) = call("/v3/lease/grant", token, serde_json::json!({"TTL": 10})).await?;
    let lease = body["ID"].as_str().unwrap_or_default().to_owned();
    ensure!(
        status == 200 && !lease.is_empty() && body["TTL"] == "10",
        "the grant answered {status} {body}"
    );
    let (status, body) = gateway(
        &http,
        &listen,
        "/v3/kv/put",
        token,
        serde_json::json!({"key": "Y29uZmlnL2w=", "value": "dXA=", "lease": lease}),
    )
    .await?;
    ensure!(status == 200, "the leased put answered {status} {body}");
    let (status, body) = gateway(
        &http,
        &listen,
        "/v3/lease/keepalive",
        token,
        serde_json::json!({"ID": lease}),
    )
    .await?;
    let ttl: i64 = body["result"]["TTL"].as_str().unwrap_or("0").parse()?;
    ensure!(
        status == 200 && ttl > 0,
        "the renewal answered {status} {body}"
    );
    let (status, body) = gateway(
        &http,
        &listen,
        "/v3/kv/lease/timetolive",
        token,
        serde_json::json!({"ID": lease, "keys": true}),
    )
    .await?;
    ensure!(
        status == 200
            && body["keys"] == serde_json::json!(["Y29uZmlnL2w="])
            && body["grantedTTL"] == "10",
        "the lease's time to live answered {status} {body}"
    );
    let (status, body) = gateway(
        &http,
        &listen,
        "/v3/lease/revoke",
        token,
        serde_json::json!({"ID": lease}),
    )
    .await?;
    ensure!(status == 200, "the revoke answered {status} {body}");
    let (_, body) = call(
        "/v3/kv/range",
        token,
        serde_json::json!({"key": "Y29uZmlnL2w="}),
    )
    .await?;
    ensure!(
        body.get("kvs").is_none(),
        "the revoked lease's key is still there: {body}"
    );
    // An unknown lease renews to TTL 0, as etcd answers (the field left out, as 0 is).
    let (status, body) = gateway(
        &http,
        &listen,
        "/v3/lease/keepalive",
        token,
        serde_json::json!({"ID": lease}),
    )
    .await?;
    ensure!(
        status == 200 && body["result"].get("TTL").is_none(),
        "a renewal of a revoked lease answered {status} {body}"
    );
    let (status, body) = call(
        "/v3/kv/put",
        token,
        serde_json::json!({"key": "Y29uZmlnL2w=", "lease": "12345"}),
    )
    .await?;
    ensure!(
        status == 404 && body["error"] == "etcdserver: requested lease not found",
        "a put with an unknown lease answered {status} {body}"
    );
    // A renewal that does not read is refused with the reason, not dropped.
    let (status, body) = call(
        "/v3/lease/keepalive",
        token,
        serde_json::json!({"ID": "not a number"}),
    )
    .await?;
    ensure!(
        status == 400 && body["error"].as_str().unwrap_or("").contains("\"ID\""),
        "a renewal that is not a LeaseKeepAliveRequest answered {status} {body}"
    );
    // `Bearer TOKEN` works as the raw token; a field etcd does not declare is left out.
    let (status, body) = call(
        "/v3/kv/range",
        Some("Bearer svc-token-0123456789abcdef0123456789"),
        serde_json::json!({"key": "Y29uZmlnL2E=", "from_a_newer_etcd": true}),
    )
    .await?;
    ensure!(
        status == 200 && body["count"] == "1",
        "a range with a Bearer token and an undeclared field answered {status} {body}"
    );
    let (status, body) = call("/v3/kv/nothing", token, serde_json::json!({})).await?;
    ensure!(
        status == 404,
        "a path etcd does not have answered {status} {body}"
    );
    let health = http.get(format!("http://{listen}/health")).send().await?;
    ensure!(
        health.status().as_u16() == 200,
        "/health answered {}",
        health.status()
    );
    let (status, body) = call("/v3/maintenance/defragment", token, serde_json::json!({})).await?;
    ensure!(
        status == 501 && body["error"].as_str().unwrap_or("").contains("Defragment"),
        "a defragment answered {status} {body}"
    );
    Ok(())
}

/// Through etcd's JSON gateway, whose streams half-close once the body is read: a
/// renewal at a proxy the lease does not live at is still answered (forwarded, and TTL
/// 0 for a lease that is nowhere), and a watch event of a leased put shows the client's
/// lease, as a range after the put's answer does.
pub async fn gateway_streams_answer_what_they_were_asked() -> anyhow::Result<()> {
    use etcd_client::PutOptions;
    let etcd = EtcdCluster::start(1).await?;
    let [(_a, api_a, on_a), (_b, api_b, _), _] = three_proxies(&etcd).await?;
    let http = reqwest::Client::new();
    let lease = on_a.lease_client().grant(10, None).await?.id();
    let renew_at_b = |id: i64| {
        gateway(
            &http,
            &api_b,
            "/v3/lease/keepalive",
            None,
            serde_json::json!({"ID": id.to_string()}),
        )
    };
    let (status, body) = renew_at_b(lease).await?;
    let ttl: i64 = body["result"]["TTL"].as_str().unwrap_or("0").parse()?;
    ensure!(
        status == 200 && ttl > 0,
        "a renewal at b of a's lease answered {status} {body}"
    );
    // The next ID of a's block: never granted.
    let (status, body) = renew_at_b(lease + 1).await?;
    ensure!(
        status == 200
            && body["result"]["ID"] == format!("{}", lease + 1).as_str()
            && body["result"].get("TTL").is_none(),
        "a renewal at b of an ID no one was granted answered {status} {body}"
    );

    for round in 0..5 {
        let mut watch = http
            .post(format!("http://{api_a}/v3/watch"))
            .body(serde_json::json!({"create_request": {"key": "bWVtYmVycy94"}}).to_string())
            .send()
            .await?;
        let mut pending = String::new();
        next_line(&mut watch, &mut pending, |r| r["created"] == true).await?;
        on_a.kv_client()
            .put(
                "members/x",
                format!("up {round}"),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await?;
        let event = next_line(&mut watch, &mut pending, |r| r["events"].is_array()).await?;
        ensure!(
            event["events"][0]["kv"]["lease"] == format!("{lease}").as_str(),
            "round {round}: the event of a put with lease {lease} showed {event}"
        );
    }
    Ok(())
}

/// The next answer on `stream` that `wanted` picks, within 10 s; the others are skipped.
async fn next_reply(
    stream: &mut etcd_client::WatchStream,
    wanted: impl Fn(&etcd_client::WatchResponse) -> bool,
) -> anyhow::Result<etcd_client::WatchResponse> {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let reply = stream.message().await?.context("the watch stream ended")?;
            if wanted(&reply) {
                return anyhow::Ok(reply);
            }
        }
    })
    .await
    .context("no such answer within 10 s")?
}

/// Puts `count` values of `bytes` bytes under `prefix/` (keys `0` to `keys - 1`, in
/// turn); returns the first put's revision.
async fn put_many(
    kv: &mut etcd_client::KvClient,
    prefix: &str,
    bytes: usize,
    count: usize,
    keys: usize,
) -> anyhow::Result<i64> {
    let value = "v".repeat(bytes);
    let mut first = None;
    for i in 0..count {
        let put = kv
            .put(format!("{prefix}/{}", i % keys), value.as_str(), None)
            .await?;
        first.get_or_insert(put.header().context("a put's header")?.revision());
    }
    first.context("nothing put")
}

fn keys_of(reply: &etcd_client::WatchResponse) -> Vec<(String, i64)> {
    reply
        .events()
        .iter()
        .filter_map(|e| e.kv())
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.mod_revision(),
            )
        })
        .collect()
}

/// etcd API watches join the proxy's fan-out: hundreds of them cost etcd no watcher; a
/// watch from a recent revision starts from the proxy's history of recent events; ranges,
/// filters, several watches on one stream, cancels, progress requests and a compacted
/// start behave as etcd's.
pub async fn etcd_api_watches_are_fanned_out_by_the_proxy() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let (proxy, listen) = proxy_with_etcd_api(&etcd).await?;
    let client = etcd_client::Client::connect([listen.as_str()], None).await?;
    let mut kv = client.kv_client();
    let etcd_watchers = || async {
        let page = lockcell_tests::proxy::http_get(&etcd.endpoints()[0], "/metrics").await?;
        page.lines()
            .find(|l| l.starts_with("etcd_debugging_mvcc_watcher_total "))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .context("etcd's watcher gauge")
    };
    let before = etcd_watchers().await?;

    // 300 watch streams, each with one watch of a prefix, from now.
    let mut streams = Vec::new();
    for i in 0..300 {
        let options = etcd_client::WatchOptions::new().with_prefix();
        let mut stream = client
            .watch_client()
            .watch(format!("fan/{}/", i % 3), Some(options))
            .await?;
        next_reply(&mut stream, |r| r.created())
            .await
            .context("a fan-out watch created")?;
        streams.push(stream);
    }
    let during = etcd_watchers().await?;
    ensure!(
        during <= before + 1.0,
        "300 etcd API watches cost etcd {} watchers",
        during - before
    );
    let put = kv.put("fan/1/x", "one", None).await?;
    let revision = put.header().context("header")?.revision();
    for (i, stream) in streams.iter_mut().enumerate().filter(|(i, _)| i % 3 == 1) {
        let reply = next_reply(stream, |r| !r.events().is_empty()).await?;
        ensure!(
            keys_of(&reply) == [("fan/1/x".to_owned(), revision)],
            "stream {i} got {:?}",
            keys_of(&reply)
        );
    }
    drop(streams);

    // A range that is not a prefix, a "from key" range and a filter, on one stream.
    // (A watch of "sync" tells when the proxy has seen the writes before it.)
    let mut sync = client.watch_client().watch("sync", None).await?;
    next_reply(&mut sync, |r| r.created())
        .await
        .context("the sync watch created")?;
    let first = kv
        .put("r/a", "1", None)
        .await?
        .header()
        .context("h")?
        .revision();
    kv.put("r/b", "2", None).await?;
    kv.put("r/c", "3", None).await?;
    kv.delete("r/b", None).await?;
    kv.put("sync", "", None).await?;
    next_reply(&mut sync, |r| !r.events().is_empty())
        .await
        .context("the sync put seen")?;
    let catch_ups = proxy.metric("lockcell_watch_catch_ups_total").await?;
    let mut stream = client
        .watch_client()
        .watch(
            "r/a",
            Some(
                etcd_client::WatchOptions::new()
                    .with_range("r/c")
                    .with_start_revision(first)
                    .with_prev_key(),
            ),
        )
        .await?;
    let created = next_reply(&mut stream, |r| r.created())
        .await
        .context("the range watch created")?;
    let range_id = created.watch_id();
    let events = next_reply(&mut stream, |r| r.watch_id() == range_id)
        .await
        .context("the range watch's events")?;
    let seen: Vec<(String, etcd_client::EventType, Option<Vec<u8>>)> = events
        .events()
        .iter()
        .map(|e| {
            let kv = e.kv().expect("kv");
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                e.event_type(),
                e.prev_kv().map(|p| p.value().to_vec()),
            )
        })
        .collect();
    use etcd_client::EventType::{Delete, Put};
    ensure!(
        seen == [
            ("r/a".to_owned(), Put, None),
            ("r/b".to_owned(), Put, None),
            ("r/b".to_owned(), Delete, Some(b"2".to_vec())),
        ],
        "the range [r/a, r/c) from revision {first} saw {seen:?}"
    );
    ensure!(
        proxy.metric("lockcell_watch_history_starts_total").await? >= 1.0
            && proxy.metric("lockcell_watch_catch_ups_total").await? == catch_ups,
        "the watch from a recent revision read etcd's history, not the proxy's: {} history starts, {} catch-ups (was {catch_ups})",
        proxy.metric("lockcell_watch_history_starts_total").await?,
        proxy.metric("lockcell_watch_catch_ups_total").await?
    );
    stream
        .watch(
            "r/b",
            Some(
                etcd_client::WatchOptions::new()
                    .with_from_key()
                    .with_filters([etcd_client::WatchFilterType::NoPut]),
            ),
        )
        .await?;
    let from_key = next_reply(&mut stream, |r| r.created())
        .await
        .context("the from-key watch created")?
        .watch_id();
    ensure!(
        from_key != range_id,
        "two watches of one stream share ID {range_id}"
    );
    kv.put("r/z", "put", None).await?;
    let deleted = kv
        .delete("r/z", None)
        .await?
        .header()
        .context("h")?
        .revision();
    let reply = next_reply(&mut stream, |r| r.watch_id() == from_key)
        .await
        .context("the from-key watch's delete")?;
    ensure!(
        keys_of(&reply) == [("r/z".to_owned(), deleted)]
            && reply.events()[0].event_type() == Delete,
        "the from-key watch without puts got {:?}",
        keys_of(&reply)
    );

    // A progress request is answered for the whole stream, past the last event.
    stream.request_progress().await?;
    let progress = next_reply(&mut stream, |r| r.watch_id() == -1)
        .await
        .context("a progress answer")?;
    ensure!(
        progress.header().context("h")?.revision() >= deleted && progress.events().is_empty(),
        "progress answered {progress:?}"
    );
    // A cancel is answered, and nothing more comes for the cancelled watch.
    stream.cancel(range_id).await?;
    next_reply(&mut stream, |r| r.watch_id() == range_id && r.canceled())
        .await
        .context("the cancel answered")?;
    kv.put("r/a", "after", None).await?;
    kv.delete("r/q", None).await?;
    kv.put("r/zz", "x", None).await?;
    let last = kv
        .delete("r/zz", None)
        .await?
        .header()
        .context("h")?
        .revision();
    let reply = next_reply(&mut stream, |r| !r.events().is_empty())
        .await
        .context("the event after the cancel")?;
    ensure!(
        reply.watch_id() == from_key && keys_of(&reply) == [("r/zz".to_owned(), last)],
        "after the cancel: {reply:?}"
    );

    // A watch from the past and, at once, a progress request: answered once it has
    // caught up, with nothing more written.
    stream
        .watch(
            "r/",
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(first),
            ),
        )
        .await?;
    stream.request_progress().await?;
    let progress = next_reply(&mut stream, |r| r.watch_id() == -1)
        .await
        .context("progress after a watch from the past")?;
    ensure!(
        progress.header().context("h")?.revision() >= last,
        "progress answered {progress:?}"
    );
    // A watch ID in use is refused under no ID, as etcd does; the watch using it goes on.
    stream
        .watch(
            "r/",
            Some(etcd_client::WatchOptions::new().with_watch_id(from_key)),
        )
        .await?;
    let duplicate = next_reply(&mut stream, |r| r.created())
        .await
        .context("a duplicate watch ID")?;
    ensure!(
        duplicate.canceled() && duplicate.watch_id() == -1,
        "a duplicate watch ID was answered {duplicate:?}"
    );

    // A start etcd has compacted is answered with the oldest revision it can serve.
    let compact_at = kv
        .put("c/x", "1", None)
        .await?
        .header()
        .context("h")?
        .revision();
    kv.put("c/x", "2", None).await?;
    etcd.client().await?.compact(compact_at, None).await?;
    let mut old = client
        .watch_client()
        .watch(
            "c/x",
            Some(etcd_client::WatchOptions::new().with_start_revision(first)),
        )
        .await?;
    let refused = next_reply(&mut old, |r| r.canceled())
        .await
        .context("the compacted start refused")?;
    ensure!(
        refused.compact_revision() == compact_at + 1,
        "a watch from compacted revision {first} answered {refused:?}"
    );

    // Many big events from the past come a bounded response at a time, whole
    // revisions each, so a client with gRPC's usual 4 MiB limit can take them.
    let big_from = put_many(&mut kv, "big", 50_000, 60, 60).await?;
    let mut big = client
        .watch_client()
        .watch(
            "big/",
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_prev_key()
                    .with_start_revision(big_from),
            ),
        )
        .await?;
    let (mut seen, mut responses) = (0, 0);
    while seen < 60 {
        let reply = next_reply(&mut big, |r| !r.events().is_empty())
            .await
            .context("the big events")?;
        let bytes: usize = reply
            .events()
            .iter()
            .filter_map(|e| e.kv())
            .map(|kv| kv.value().len())
            .sum();
        ensure!(
            bytes <= 1_200_000,
            "one response carried {bytes} bytes of values"
        );
        seen += reply.events().len();
        responses += 1;
    }
    ensure!(
        seen == 60 && responses >= 3,
        "{seen} events in {responses} responses"
    );
    Ok(())
}

/// A progress answer never runs ahead of the events of the watches of its stream: with
/// a hundred watches on one stream, a writer, and progress asked for all along, no event
/// arrives after a progress answer at or past its revision.
pub async fn etcd_api_progress_never_runs_ahead_of_events() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    // The watches on one proxy, the writer on another, as in a fleet.
    let [(_a, _, client), (_b, _, writer_client), _] = three_proxies(&etcd).await?;
    let mut stream = client
        .watch_client()
        .watch("pg/", Some(etcd_client::WatchOptions::new().with_prefix()))
        .await?;
    next_reply(&mut stream, |r| r.created()).await?;
    for _ in 1..100 {
        stream
            .watch("pg/", Some(etcd_client::WatchOptions::new().with_prefix()))
            .await?;
        next_reply(&mut stream, |r| r.created()).await?;
    }
    let (mut sender, mut replies) = stream.split();
    let mut kv = writer_client.kv_client();
    let mut writer = tokio::spawn(async move {
        let mut last = 0;
        for i in 0..400 {
            let put = kv.put(format!("pg/{}", i % 7), i.to_string(), None).await?;
            last = put.header().context("header")?.revision();
        }
        anyhow::Ok(last)
    });
    let asker = tokio::spawn(async move {
        // A client asking for progress a hundred times a second.
        let mut asking = tokio::time::interval(Duration::from_millis(10));
        for _ in 0..3000 {
            asking.tick().await;
            if sender.request_progress().await.is_err() {
                break;
            }
        }
    });
    let (mut promised, mut progresses, mut events) = (0, 0, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last_written = None;
    loop {
        let reply = tokio::time::timeout_at(deadline, replies.message())
            .await
            .context("the watch stream went quiet")??
            .context("the watch stream ended")?;
        if reply.watch_id() == -1 {
            promised = promised.max(reply.header().context("h")?.revision());
            progresses += 1;
        }
        for event in reply.events() {
            let revision = event.kv().context("kv")?.mod_revision();
            ensure!(
                revision > promised,
                "an event at revision {revision} came after a progress answer at {promised}"
            );
            events += 1;
        }
        if last_written.is_none() && writer.is_finished() {
            last_written = Some((&mut writer).await??);
        }
        if last_written.is_some_and(|last| promised >= last) {
            break;
        }
    }
    asker.abort();
    ensure!(
        events == 400 * 100 && progresses > 1,
        "{events} events (want 40,000) and {progresses} progress answers"
    );
    Ok(())
}

/// A watch cancelled half-way through its catch-up from etcd's history leaves nothing
/// behind: its ID, taken again at once for a watch from now, gets only that watch's
/// events, and the proxy's catch-up ends.
pub async fn a_watch_cancelled_during_its_catch_up_leaves_nothing_behind() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    // No history of recent events: a watch from the past catches up from etcd.
    options.extra_args = [
        "--etcd-listen",
        listen.as_str(),
        "--watch-history-bytes",
        "0",
    ]
    .map(String::from)
    .to_vec();
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    let client = etcd_client::Client::connect([listen.as_str()], None).await?;
    let mut kv = client.kv_client();
    let first = put_many(&mut kv, "cc", 20_000, 300, 10).await?;
    // The proxy's own etcd watches (of the cell, its events, its guard, its routes).
    let own = proxy.metric("lockcell_etcd_watches").await?;
    let mut stream = client
        .watch_client()
        .watch(
            "cc/",
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_watch_id(7)
                    .with_start_revision(first),
            ),
        )
        .await?;
    next_reply(&mut stream, |r| r.created() && r.watch_id() == 7)
        .await
        .context("the watch from the past created")?;
    // Its first response of about 6 MB of history: the catch-up is under way.
    let part = next_reply(&mut stream, |r| r.watch_id() == 7 && !r.events().is_empty())
        .await
        .context("the catch-up's first events")?;
    ensure!(
        part.events().len() < 300,
        "the whole history came at once: nothing left to cancel"
    );
    stream.cancel(7).await?;
    stream
        .watch(
            "cc/",
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_watch_id(7),
            ),
        )
        .await?;
    // Events of the old watch sent before the cancel was read may come first; after
    // the cancel's answer and the new watch's creation, only the new put may.
    next_reply(&mut stream, |r| r.watch_id() == 7 && r.canceled())
        .await
        .context("the cancel answered")?;
    next_reply(&mut stream, |r| r.created() && r.watch_id() == 7)
        .await
        .context("the new watch under the same ID created")?;
    let after = kv
        .put("cc/new", "x", None)
        .await?
        .header()
        .context("h")?
        .revision();
    let reply = next_reply(&mut stream, |r| !r.events().is_empty())
        .await
        .context("the new watch's event")?;
    let seen: Vec<(String, i64)> = keys_of(&reply);
    ensure!(
        seen == [("cc/new".to_owned(), after)],
        "after the cancel, watch 7 got {seen:?}"
    );
    // Only the proxy's own etcd watches are left.
    eventually(
        "the cancelled catch-up's etcd watch ends",
        Duration::from_secs(20),
        || async {
            let open = proxy.metric("lockcell_etcd_watches").await?;
            anyhow::Ok((open <= own).then_some(()))
        },
    )
    .await?;
    ensure!(
        proxy.metric("lockcell_watch_catch_ups_total").await? >= 1.0,
        "the watch from the past was not caught up from etcd: the test proves nothing"
    );
    Ok(())
}

/// The client lease a key was written with shows wherever etcd shows a lease, whichever
/// proxy wrote the key and whichever proxy answers: ranges of now and of the past, Txn
/// ranges, previous values, watch events (from the fan-out and from a catch-up); and a
/// Txn's compare on a key's lease compares that client lease, never the proxy's. The
/// key's record goes with the key: deleted, or revoked with its lease.
pub async fn a_keys_client_lease_shows_at_every_proxy_and_in_lease_compares() -> anyhow::Result<()>
{
    use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
    let etcd = EtcdCluster::start(1).await?;
    let (_a, api_a) = proxy_with_etcd_api(&etcd).await?;
    // b keeps no history of events: a watch from the past catches up on etcd's.
    let api_b = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec![
        "--etcd-listen".into(),
        api_b.clone(),
        "--watch-history-bytes".into(),
        "0".into(),
    ];
    let _b = ProxyProcess::start(&options, &etcd.dir).await?;
    let on_a = etcd_client::Client::connect([api_a.as_str()], None).await?;
    let on_b = etcd_client::Client::connect([api_b.as_str()], None).await?;
    let mut raw = etcd.client().await?;

    let lease = on_a.lease_client().grant(30, None).await?.id();
    let leased = || Some(PutOptions::new().with_lease(lease));
    let put = on_a.kv_client().put("cfg/x", "1", leased()).await?;
    let written = put.header().context("a header")?.revision();
    on_a.kv_client().put("cfg/plain", "p", None).await?;

    // Reads at b, of now and of the past.
    let lease_at = |got: &etcd_client::GetResponse| got.kvs().first().map(|kv| kv.lease());
    let now = on_b.kv_client().get("cfg/x", None).await?;
    ensure!(
        lease_at(&now) == Some(lease),
        "a range at b shows {:?}",
        now.kvs()
    );
    let past = on_b
        .kv_client()
        .get("cfg/x", Some(GetOptions::new().with_revision(written)))
        .await?;
    ensure!(
        lease_at(&past) == Some(lease),
        "a past range at b shows {:?}",
        past.kvs()
    );
    let plain = on_b.kv_client().get("cfg/plain", None).await?;
    ensure!(
        lease_at(&plain) == Some(0),
        "a key on no lease shows {:?}",
        plain.kvs()
    );

    // Lease compares at b, and a Txn range.
    let compare = |op, wanted| Compare::lease("cfg/x", op, wanted);
    for (what, compares, holds) in [
        ("lease = L", vec![compare(CompareOp::Equal, lease)], true),
        (
            "lease != L",
            vec![compare(CompareOp::NotEqual, lease)],
            false,
        ),
        ("lease > 0", vec![compare(CompareOp::Greater, 0)], true),
        ("lease = 0", vec![compare(CompareOp::Equal, 0)], false),
        (
            "plain: lease = 0",
            vec![Compare::lease("cfg/plain", CompareOp::Equal, 0)],
            true,
        ),
        (
            "absent: lease = L",
            vec![Compare::lease("cfg/none", CompareOp::Equal, lease)],
            false,
        ),
        (
            "absent: lease = 0, and lease = L",
            vec![
                Compare::lease("cfg/none", CompareOp::Equal, 0),
                compare(CompareOp::Equal, lease),
            ],
            true,
        ),
    ] {
        let done = on_b
            .kv_client()
            .txn(
                Txn::new()
                    .when(compares)
                    .and_then([TxnOp::get("cfg/x", None)])
                    .or_else([TxnOp::get("cfg/plain", None)]),
            )
            .await?;
        ensure!(
            done.succeeded() == holds,
            "{what}: succeeded {}",
            done.succeeded()
        );
        if holds {
            let read = done.op_responses().into_iter().find_map(|op| match op {
                etcd_client::TxnOpResponse::Get(got) => got.kvs().first().map(|kv| kv.lease()),
                _ => None,
            });
            ensure!(read == Some(lease), "{what}: the Txn range shows {read:?}");
        }
    }
    let ranged = on_b
        .kv_client()
        .txn(Txn::new().when([Compare::lease("cfg/", CompareOp::Equal, lease).with_range("cfg0")]))
        .await;
    match ranged {
        Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::InvalidArgument => {}
        other => anyhow::bail!("a lease compare over a range: {other:?}"),
    }

    // Written again at b with no lease: the put's previous value and the watch events
    // (the fan-out's at a, a catch-up's at b) show each write's own lease.
    let again = on_b
        .kv_client()
        .put("cfg/x", "2", Some(PutOptions::new().with_prev_key()))
        .await?;
    let prev = again.prev_key().map(|kv| kv.lease());
    ensure!(
        prev == Some(lease),
        "the put's previous value shows lease {prev:?}"
    );
    for (at, client) in [("a", &on_a), ("b", &on_b)] {
        let options = WatchOptions::new()
            .with_start_revision(written)
            .with_prev_key();
        let mut stream = client.watch_client().watch("cfg/x", Some(options)).await?;
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let reply = next_reply(&mut stream, |r| !r.events().is_empty()).await?;
            for event in reply.events() {
                let kv = event.kv().context("an event's key")?;
                seen.push((kv.lease(), event.prev_kv().map(|p| p.lease())));
            }
        }
        ensure!(
            seen == [(lease, None), (0, Some(lease))],
            "the watch at {at} saw (lease, previous lease) {seen:?}"
        );
    }
    let compared = on_b
        .kv_client()
        .txn(Txn::new().when([compare(CompareOp::Equal, 0)]))
        .await?;
    ensure!(
        compared.succeeded(),
        "a key written again with no lease still compares as leased"
    );

    // A record goes with its key: deleted, or revoked with the lease.
    let record = |key: &str| format!("/s/!etcd-leased/{key}");
    on_a.kv_client().put("cfg/x", "3", leased()).await?;
    on_a.kv_client().put("cfg/y", "3", leased()).await?;
    ensure!(
        raw.get(record("cfg/x"), None).await?.count() == 1,
        "a leased put left no record"
    );
    let deleted = on_b
        .kv_client()
        .delete(
            "cfg/x",
            Some(etcd_client::DeleteOptions::new().with_prev_key()),
        )
        .await?;
    let prev: Vec<i64> = deleted.prev_kvs().iter().map(|kv| kv.lease()).collect();
    ensure!(
        prev == [lease],
        "the delete's previous values show leases {prev:?}"
    );
    ensure!(
        raw.get(record("cfg/x"), None).await?.count() == 0,
        "a deleted key's record is still there"
    );
    on_b.lease_client().revoke(lease).await?;
    ensure!(
        raw.get(record("cfg/y"), None).await?.count() == 0
            && raw.get("/k/cfg/y", None).await?.count() == 0,
        "a revoked lease's key or its record is still there"
    );

    // The Lock and Election services' keys take their records along: an unlock, a
    // lock wait given up, a resignation.
    let records_under = |prefix: &str| {
        let (mut raw, key) = (raw.clone(), record(prefix));
        async move {
            let options = etcd_client::GetOptions::new()
                .with_prefix()
                .with_keys_only();
            anyhow::Ok(raw.get(key, Some(options)).await?.count())
        }
    };
    let holder = on_a.lease_client().grant(30, None).await?.id();
    let waiter = on_b.lease_client().grant(30, None).await?.id();
    let on = |lease| Some(etcd_client::LockOptions::new().with_lease(lease));
    let held = on_a
        .lock_client()
        .lock("m", on(holder))
        .await?
        .key()
        .to_vec();
    let mut waiting = on_b.lock_client();
    let gave_up = tokio::time::timeout(Duration::from_millis(800), waiting.lock("m", on(waiter)));
    ensure!(gave_up.await.is_err(), "a held lock was granted");
    eventually(
        "a given-up lock wait's record goes",
        Duration::from_secs(10),
        || async { Ok((records_under("m/").await? == 1).then_some(())) },
    )
    .await?;
    on_a.lock_client().unlock(held).await?;
    ensure!(
        records_under("m/").await? == 0,
        "an unlocked key's record is still there"
    );
    let mut elections = on_b.election_client();
    let won = elections.campaign("e", "v", holder).await?;
    let leader = won.leader().context("a leader key")?.clone();
    ensure!(
        records_under("e/").await? == 1,
        "a candidate's key has no record"
    );
    elections
        .resign(Some(etcd_client::ResignOptions::new().with_leader(leader)))
        .await?;
    ensure!(
        records_under("e/").await? == 0,
        "a resigned leader's record is still there"
    );
    Ok(())
}

/// How many keys etcd holds under `prefix`.
/// The keys under `prefix` (a lock's line: the Lock service's keys are `name/lease`),
/// as `client` reads them.
async fn line_keys(client: &etcd_client::Client, prefix: &str) -> anyhow::Result<Vec<String>> {
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_keys_only();
    let got = client.kv_client().get(prefix, Some(options)).await?;
    Ok(got
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect())
}

async fn keys_under(etcd: &etcd_client::Client, prefix: &str) -> anyhow::Result<i64> {
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    Ok(etcd.kv_client().get(prefix, Some(options)).await?.count())
}

/// A client lease record is on no lease: when a dead proxy's lease ends, etcd deletes
/// the leased key alone, and a surviving proxy sweeps the record soon after.
pub async fn a_dead_proxys_lease_records_are_swept() -> anyhow::Result<()> {
    use etcd_client::PutOptions;
    let etcd = EtcdCluster::start(1).await?;
    let (a, api_a) = proxy_with_etcd_api(&etcd).await?;
    let (_b, _api_b) = proxy_with_etcd_api(&etcd).await?;
    let on_a = etcd_client::Client::connect([api_a.as_str()], None).await?;
    let raw = etcd.client().await?;
    let lease = on_a.lease_client().grant(30, None).await?.id();
    for i in 0..10 {
        let leased = Some(PutOptions::new().with_lease(lease));
        on_a.kv_client()
            .put(format!("gone/{i}"), "v", leased)
            .await?;
    }
    let records = "/s/!etcd-leased/gone/";
    ensure!(
        keys_under(&raw, records).await? == 10,
        "the leased puts wrote no records"
    );
    a.process.signal(nix::sys::signal::Signal::SIGKILL)?;
    let gone = |prefix: &'static str| {
        let raw = raw.clone();
        move || {
            let raw = raw.clone();
            async move { Ok((keys_under(&raw, prefix).await? == 0).then_some(())) }
        }
    };
    eventually(
        "the dead proxy's leased keys go with its etcd lease",
        Duration::from_secs(30),
        gone("/k/gone/"),
    )
    .await?;
    eventually(
        "the survivor sweeps their records",
        Duration::from_secs(30),
        gone(records),
    )
    .await?;
    Ok(())
}

/// A Txn writing with leases that live at two proxies, sent to a third, runs as one
/// transaction: the proxy it reached asks for each lease and takes it over, and each
/// key still goes with its own lease, which every proxy goes on serving.
pub async fn a_txn_writing_with_leases_of_two_proxies_runs_as_one() -> anyhow::Result<()> {
    use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
    let etcd = EtcdCluster::start(1).await?;
    let [(_a, _, on_a), (_b, _, on_b), (_c, _, on_c)] = three_proxies(&etcd).await?;
    let first = on_a.lease_client().grant(10, None).await?.id();
    let second = on_b.lease_client().grant(10, None).await?.id();
    let leased = |lease: i64| Some(PutOptions::new().with_lease(lease));
    on_b.kv_client()
        .put("svc/before", "up", leased(second))
        .await?;
    let created = key_state(&on_a, "svc/before")
        .await?
        .map(|(created, _)| created);

    let done = on_c
        .kv_client()
        .txn(
            Txn::new()
                .when([Compare::version("svc/one", CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put("svc/one", "1", leased(first)),
                    TxnOp::put("svc/two", "2", leased(second)),
                ]),
        )
        .await?;
    ensure!(done.succeeded(), "the Txn's compare failed on a new key");
    for (at, client) in [("a", &on_a), ("b", &on_b), ("c", &on_c)] {
        for (key, lease) in [
            ("svc/one", first),
            ("svc/two", second),
            ("svc/before", second),
        ] {
            let shown = key_state(client, key).await?.map(|(_, lease)| lease);
            ensure!(
                shown == Some(lease),
                "{key} at {at} shows lease {shown:?}, written with {lease:x}"
            );
        }
    }
    let moved = key_state(&on_a, "svc/before")
        .await?
        .map(|(created, _)| created);
    ensure!(
        moved == created,
        "svc/before was created anew when its lease moved: {created:?}, now {moved:?}"
    );
    // Both leases are renewed wherever the client asks, and know their keys.
    for (lease, client) in [(first, &on_b), (second, &on_a), (second, &on_b)] {
        ensure!(
            renew_once(client, lease).await? > 0,
            "lease {lease:x} was not renewed after the Txn"
        );
    }
    let (_, keys) = lease_keys(&on_a, second).await?;
    ensure!(
        keys == ["svc/before", "svc/two"],
        "the second lease's keys after the Txn: {keys:?}"
    );

    // Txns racing to gather the same two leases at two proxies, while a client renews
    // both at the third: every Txn is written, no renewal is answered TTL 0, and a
    // proxy that knew a lease somewhere it no longer lives finds it.
    let mut streams = Vec::new();
    for lease in [first, second] {
        streams.push(on_c.lease_client().keep_alive(lease).await?);
    }
    let renewing = async {
        let mut every = tokio::time::interval(Duration::from_millis(50));
        let mut answered = 0;
        for _ in 0..20 {
            every.tick().await;
            for (keeper, replies) in &mut streams {
                keeper.keep_alive().await?;
                let reply = tokio::time::timeout(Duration::from_secs(5), replies.message())
                    .await
                    .context("a renewal was not answered within 5 s while Txns gathered")??
                    .context("a keepalive stream ended while Txns gathered")?;
                ensure!(
                    reply.ttl() > 0,
                    "lease {:x} was answered TTL {} while Txns gathered it",
                    reply.id(),
                    reply.ttl()
                );
                answered += 1;
            }
        }
        anyhow::Ok(answered)
    };
    let racing = async {
        for round in 0..5 {
            let txn = |at: &str| {
                Txn::new().and_then([
                    TxnOp::put(format!("race/{round}/{at}/1"), "1", leased(first)),
                    TxnOp::put(format!("race/{round}/{at}/2"), "2", leased(second)),
                ])
            };
            let (mut kv_a, mut kv_b) = (on_a.kv_client(), on_b.kv_client());
            let (at_a, at_b) = tokio::join!(kv_a.txn(txn("a")), kv_b.txn(txn("b")));
            at_a.context("a racing Txn at a")?;
            at_b.context("a racing Txn at b")?;
        }
        anyhow::Ok(())
    };
    let (answered, raced) = tokio::join!(renewing, racing);
    raced?;
    ensure!(answered? > 0, "no renewal was answered while Txns raced");
    let raced = on_c
        .kv_client()
        .get("race/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await?;
    ensure!(
        raced.kvs().len() == 20,
        "{} of the racing Txns' 20 keys were written",
        raced.kvs().len()
    );

    // A client that hangs up while its Txn gathers: the Txn wrote all or nothing, and
    // both leases are renewed at once wherever the client asks next.
    for wait_ms in [0, 2, 5, 10, 20] {
        let key = |n: u8| format!("gone/{wait_ms}/{n}");
        let txn = Txn::new().and_then([
            TxnOp::put(key(1), "1", leased(first)),
            TxnOp::put(key(2), "2", leased(second)),
        ]);
        let mut kv = on_a.kv_client();
        let _ = tokio::time::timeout(Duration::from_millis(wait_ms), kv.txn(txn)).await;
        for (lease, client) in [(first, &on_a), (second, &on_b), (first, &on_c)] {
            let renewed = tokio::time::timeout(Duration::from_secs(2), renew_once(client, lease))
                .await
                .context("a renewal waited over 2 s after a client hung up mid-gather")??;
            ensure!(
                renewed > 0,
                "lease {lease:x} renewed TTL {renewed} after a client hung up mid-gather"
            );
        }
        let (one, two) = (
            key_state(&on_c, &key(1)).await?,
            key_state(&on_c, &key(2)).await?,
        );
        ensure!(
            one.is_some() == two.is_some(),
            "a Txn cut off after {wait_ms} ms wrote one key of two: {one:?} {two:?}"
        );
    }

    // Each key goes with its own lease.
    on_a.lease_client().revoke(second).await?;
    for key in ["svc/two", "svc/before"] {
        ensure!(
            key_state(&on_c, key).await?.is_none(),
            "{key} outlived the revoke of its lease"
        );
    }
    ensure!(
        key_state(&on_c, "svc/one").await?.is_some(),
        "svc/one went with the other lease's revoke"
    );
    on_b.lease_client().revoke(first).await?;
    ensure!(
        key_state(&on_c, "svc/one").await?.is_none(),
        "svc/one outlived the revoke of its lease"
    );
    Ok(())
}

/// A proxy has at most `--etcd-writes-in-flight` client writes in etcd at once; the
/// rest wait their turn (in the order they came) and land, whatever each one's
/// outcome: puts with and without a lease, deletes, and Txns whose compare fails.
pub async fn writes_past_the_proxys_bound_wait_their_turn_and_land() -> anyhow::Result<()> {
    use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
    let etcd = EtcdCluster::start(1).await?;
    let (proxy, listen) = proxy_with_write_turns(&etcd, 2).await?;
    let client = etcd_client::Client::connect([listen.as_str()], None).await?;
    let lease = client.lease_client().grant(30, None).await?.id();

    const WRITES: usize = 200;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..WRITES {
        let mut kv = client.kv_client();
        calls.spawn(async move {
            let key = format!("burst/{i:03}");
            match i % 4 {
                0 => {
                    kv.put(key, "leased", Some(PutOptions::new().with_lease(lease)))
                        .await?;
                }
                1 => {
                    kv.put(key, "plain", None).await?;
                }
                2 => {
                    kv.put(key.as_str(), "gone", None).await?;
                    kv.delete(key, None).await?;
                }
                _ => {
                    // Put only if absent: the compare holds, then fails.
                    for _ in 0..2 {
                        let txn = Txn::new()
                            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                            .and_then([TxnOp::put(key.as_str(), "once", None)]);
                        kv.txn(txn).await?;
                    }
                }
            }
            anyhow::Ok(())
        });
    }
    let finished = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(call) = calls.join_next().await {
            call??;
        }
        anyhow::Ok(())
    })
    .await;
    finished.context("the burst of writes did not finish within 60 s")??;

    let queued = proxy
        .metric("lockcell_etcd_api_writes_queued_total")
        .await?;
    ensure!(
        queued > 0.0,
        "{WRITES} writes at once with two turns, yet none waited for a turn"
    );
    ensure!(
        proxy.metric("lockcell_etcd_api_writes_waiting").await? == 0.0,
        "writes still count as waiting once every one has been answered"
    );
    let got = client
        .kv_client()
        .get("burst/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await?;
    let mut have: Vec<String> = got
        .kvs()
        .iter()
        .map(|kv| {
            format!(
                "{}={}",
                kv.key_str().unwrap_or("?"),
                kv.value_str().unwrap_or("?")
            )
        })
        .collect();
    have.sort();
    let mut want: Vec<String> = (0..WRITES)
        .filter_map(|i| match i % 4 {
            0 => Some(format!("burst/{i:03}=leased")),
            1 => Some(format!("burst/{i:03}=plain")),
            2 => None,
            _ => Some(format!("burst/{i:03}=once")),
        })
        .collect();
    want.sort();
    ensure!(
        have == want,
        "after the burst the keys are {have:?}, not {want:?}"
    );
    // Every turn came back: the next writes go through at once.
    for i in 0..10 {
        tokio::time::timeout(
            Duration::from_secs(5),
            client.kv_client().put(format!("after/{i}"), "v", None),
        )
        .await
        .context("a write after the burst did not get its turn")??;
    }
    Ok(())
}

/// A leased put still waiting for its turn when its lease is revoked is refused as
/// etcd refuses a put on a revoked lease, and writes nothing: once the revoke has
/// answered, the lease's key never appears.
pub async fn a_leased_put_queued_past_its_revoke_is_refused() -> anyhow::Result<()> {
    use etcd_client::PutOptions;
    let etcd = EtcdCluster::start(1).await?;
    let (proxy, listen) = proxy_with_write_turns(&etcd, 1).await?;
    let client = etcd_client::Client::connect([listen.as_str()], None).await?;
    let lease = client.lease_client().grant(30, None).await?.id();

    // A queue of plain writes ahead of it, one in etcd at a time.
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..600 {
        let mut kv = client.kv_client();
        flood.spawn(async move { kv.put(format!("flood/{i}"), "x", None).await });
    }
    eventually(
        "the proxy queues the flood",
        Duration::from_secs(20),
        || async {
            let waiting = proxy.metric("lockcell_etcd_api_writes_waiting").await?;
            Ok((waiting >= 200.0).then_some(()))
        },
    )
    .await?;
    let queued_before = proxy
        .metric("lockcell_etcd_api_writes_queued_total")
        .await?;
    let mut kv = client.kv_client();
    let put = tokio::spawn(async move {
        kv.put(
            "queued/leased",
            "v",
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
    });
    // Most likely behind some 200 writes when the revoke comes. (A revoke that
    // overtakes it on the way must see it refused too.)
    eventually(
        "the leased put joins the queue",
        Duration::from_secs(10),
        || async {
            let queued = proxy
                .metric("lockcell_etcd_api_writes_queued_total")
                .await?;
            Ok((queued > queued_before || put.is_finished()).then_some(()))
        },
    )
    .await?;
    client.lease_client().revoke(lease).await?;
    let answer = put.await?;
    match answer {
        Err(etcd_client::Error::GRpcStatus(status))
            if status.code() == tonic::Code::NotFound
                && status.message() == "etcdserver: requested lease not found" => {}
        other => anyhow::bail!(
            "a put queued behind 200 writes when its lease was revoked was answered {other:?}, \
             not etcd's \"requested lease not found\""
        ),
    }
    while let Some(done) = flood.join_next().await {
        done??;
    }
    ensure!(
        key_state(&client, "queued/leased").await?.is_none(),
        "the refused put's key is in the store"
    );
    Ok(())
}

/// A catch-up from etcd's history reads it in fragments of etcd's request size, so its
/// memory stays bounded, and still delivers every revision whole: transactions of 16
/// keys of 60 KiB each (about 2 MB a revision with previous values, more than one
/// fragment) reach a watcher from the past with each revision's 16 events in one
/// response, in order, with their previous values.
pub async fn a_catch_up_in_fragments_delivers_each_revision_whole() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = [
        "--etcd-listen",
        listen.as_str(),
        "--watch-history-bytes",
        "0",
    ]
    .map(String::from)
    .to_vec();
    let proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    let client = etcd_client::Client::connect([listen.as_str()], None).await?;
    let mut kv = client.kv_client();
    let value = |round: usize| format!("{round}").repeat(60 * 1024);
    let put_all = |round: usize| {
        etcd_client::Txn::new().and_then(
            (0..16)
                .map(|k| etcd_client::TxnOp::put(format!("frag/{k:02}"), value(round), None))
                .collect::<Vec<_>>(),
        )
    };
    let mut revisions = Vec::new();
    for round in 0..6 {
        let done = kv.txn(put_all(round)).await?;
        revisions.push(done.header().context("a header")?.revision());
    }
    let mut stream = client
        .watch_client()
        .watch(
            "frag/",
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_prev_key()
                    .with_start_revision(revisions[0]),
            ),
        )
        .await?;
    next_reply(&mut stream, |r| r.created())
        .await
        .context("the watch from the past created")?;
    let mut seen: Vec<i64> = Vec::new();
    while seen.len() < revisions.len() {
        let reply = next_reply(&mut stream, |r| !r.events().is_empty())
            .await
            .with_context(|| format!("revisions after {seen:?}"))?;
        let mut by_revision: std::collections::BTreeMap<i64, Vec<&etcd_client::Event>> =
            Default::default();
        for e in reply.events() {
            let kv = e.kv().context("an event's key")?;
            by_revision.entry(kv.mod_revision()).or_default().push(e);
        }
        for (revision, events) in by_revision {
            let round = revisions
                .iter()
                .position(|r| *r == revision)
                .with_context(|| format!("an event at revision {revision}, written by no round"))?;
            ensure!(
                events.len() == 16,
                "revision {revision} came in pieces: {} of its 16 events in one response",
                events.len()
            );
            ensure!(
                !seen.contains(&revision) && seen.last().is_none_or(|last| *last < revision),
                "revision {revision} again or out of order after {seen:?}"
            );
            for e in events {
                let kv = e.kv().context("key")?;
                ensure!(
                    kv.value() == value(round).as_bytes(),
                    "round {round}'s value"
                );
                if round > 0 {
                    let prev = e.prev_kv().context("a previous value asked for")?;
                    ensure!(
                        prev.value() == value(round - 1).as_bytes(),
                        "round {round}'s previous value"
                    );
                }
            }
            seen.push(revision);
        }
    }
    ensure!(
        proxy.metric("lockcell_watch_catch_ups_total").await? >= 1.0,
        "the watch from the past was not caught up from etcd: the test proves nothing"
    );
    Ok(())
}

/// A lease that Txns move to another proxy and back, again and again, goes on with its
/// keys (each keeps its create revision and its lease) and is renewed at both proxies
/// after every move; the proxy it returns to takes it in every time.
pub async fn a_lease_moved_away_and_back_keeps_its_keys() -> anyhow::Result<()> {
    use etcd_client::{PutOptions, Txn, TxnOp};
    let etcd = EtcdCluster::start(1).await?;
    let (_a, api_a) = proxy_with_etcd_api(&etcd).await?;
    let (_b, api_b) = proxy_with_etcd_api(&etcd).await?;
    let on_a = etcd_client::Client::connect([api_a.as_str()], None).await?;
    let on_b = etcd_client::Client::connect([api_b.as_str()], None).await?;
    let leased = |lease: i64| Some(PutOptions::new().with_lease(lease));
    // A Txn runs where its lowest lease lives: the moving lease is granted after a
    // lease of its own proxy, and above every lease of the other one.
    let own_a = on_a.lease_client().grant(30, None).await?.id();
    let own_b = on_b.lease_client().grant(30, None).await?.id();
    let (home, away) = if own_a > own_b {
        ((&on_a, own_a, "a"), (&on_b, own_b, "b"))
    } else {
        ((&on_b, own_b, "b"), (&on_a, own_a, "a"))
    };
    let moving = home.0.lease_client().grant(30, None).await?.id();
    home.0
        .kv_client()
        .put("bounce/k", "v", leased(moving))
        .await?;
    let raw = etcd.client().await?;
    let raw_lease = || {
        let mut raw = raw.kv_client();
        async move {
            let got = raw.get("/k/bounce/k", None).await?;
            anyhow::Ok(got.kvs().first().map(|kv| kv.lease()))
        }
    };
    let mut on = raw_lease().await?;
    let first = key_state(&on_a, "bounce/k").await?;
    ensure!(
        first.map(|(_, lease)| lease) == Some(moving),
        "bounce/k was written as {first:?}"
    );

    for round in 0..6 {
        let (client, own, at) = if round % 2 == 0 { away } else { home };
        let done = client
            .kv_client()
            .txn(Txn::new().and_then([
                TxnOp::put(format!("bounce/{round}/moving"), "m", leased(moving)),
                TxnOp::put(format!("bounce/{round}/own"), "o", leased(own)),
            ]))
            .await
            .with_context(|| format!("round {round}: the Txn at {at}"))?;
        ensure!(done.succeeded(), "round {round}: the Txn at {at} failed");
        let now = key_state(&on_a, "bounce/k").await?;
        ensure!(
            now == first,
            "round {round}: bounce/k was {first:?} and is {now:?} after the lease moved to {at}"
        );
        // It moved: its key is on an etcd lease of the proxy it is at now.
        let then = std::mem::replace(&mut on, raw_lease().await?);
        ensure!(
            on.is_some() && on != then,
            "round {round}: bounce/k stayed on etcd lease {then:?} (now {on:?})"
        );
        for (name, client) in [("a", &on_a), ("b", &on_b)] {
            ensure!(
                renew_once(client, moving).await? > 0,
                "round {round}: the lease was not renewed at {name} after it moved to {at}"
            );
        }
    }
    let (_, keys) = lease_keys(&on_b, moving).await?;
    ensure!(
        keys.len() == 7 && keys.contains(&"bounce/k".to_string()),
        "the moving lease's keys are {keys:?}"
    );
    Ok(())
}

/// What one client of a racing lease saw: the puts acknowledged, and every refusal.
#[derive(Default)]
struct Raced {
    acknowledged: Vec<String>,
    refused: Vec<String>,
}

/// A lease that Txns keep moving between two proxies, with puts, renewals and, at the
/// end, a revoke racing the moves at both proxies: every put acknowledged stays with
/// the lease, no renewal of the live lease answers TTL 0, no call on it hears NOT_FOUND,
/// and a revoke that answers leaves none of the lease's keys, and not its session
/// fence, behind.
pub async fn calls_racing_moves_of_a_lease_lose_nothing() -> anyhow::Result<()> {
    use etcd_client::{Client, PutOptions, Txn, TxnOp};
    let etcd = EtcdCluster::start(1).await?;
    let (_a, api_a) = proxy_with_etcd_api(&etcd).await?;
    let (_b, api_b) = proxy_with_etcd_api(&etcd).await?;
    let on_a = Client::connect([api_a.as_str()], None).await?;
    let on_b = Client::connect([api_b.as_str()], None).await?;
    let raw = etcd.client().await?;
    let leased = |lease: i64| Some(PutOptions::new().with_lease(lease));
    // A Txn runs where its lowest lease lives: each moving lease is granted above both
    // proxies' own leases, so a Txn at either proxy pulls it there.
    let own_a = on_a.lease_client().grant(60, None).await?.id();
    let own_b = on_b.lease_client().grant(60, None).await?.id();
    let clients = [(&on_a, own_a, "a"), (&on_b, own_b, "b")];
    let refusal = |e: etcd_client::Error| match e {
        etcd_client::Error::GRpcStatus(s) => (s.code(), s.message().to_owned()),
        other => (tonic::Code::Unknown, other.to_string()),
    };

    let home = if own_a > own_b { &on_a } else { &on_b };
    for round in 0..6 {
        let moving = home.lease_client().grant(60, None).await?.id();
        let mover = async {
            let mut seen = Raced::default();
            for n in 0..8 {
                let (client, own, at) = clients[n % 2];
                let txn = Txn::new().and_then([
                    TxnOp::put(format!("race/{round}/m/txn{n}"), "t", leased(moving)),
                    TxnOp::put(format!("race/{round}/own/{n}"), "o", leased(own)),
                ]);
                match client.kv_client().txn(txn).await {
                    Ok(_) => seen.acknowledged.push(format!("race/{round}/m/txn{n}")),
                    Err(e) => seen
                        .refused
                        .push(format!("a Txn at {at}: {:?}", refusal(e))),
                }
            }
            seen
        };
        let putter = async {
            let mut seen = Raced::default();
            for n in 0..16 {
                let (client, _, at) = clients[(n / 2) % 2];
                let key = format!("race/{round}/m/put{n}");
                match client
                    .kv_client()
                    .put(key.as_str(), "p", leased(moving))
                    .await
                {
                    Ok(_) => seen.acknowledged.push(key),
                    Err(e) => seen
                        .refused
                        .push(format!("a put at {at}: {:?}", refusal(e))),
                }
            }
            seen
        };
        let renewer = async {
            let mut seen = Raced::default();
            for n in 0..8 {
                let (client, _, at) = clients[(n + 1) % 2];
                match renew_once(client, moving).await {
                    Ok(ttl) if ttl > 0 => {}
                    other => seen.refused.push(format!("a renewal at {at}: {other:?}")),
                }
            }
            seen
        };
        let (moved, put, renewed) = tokio::join!(mover, putter, renewer);
        // A Txn may give up on a lease that keeps moving (UNAVAILABLE, nothing
        // written); nothing else is refused.
        let wrong: Vec<&String> = moved
            .refused
            .iter()
            .filter(|r| !r.contains("Unavailable"))
            .chain(put.refused.iter().chain(&renewed.refused))
            .collect();
        ensure!(wrong.is_empty(), "round {round}: refused: {wrong:?}");
        let prefix = format!("/k/race/{round}/m/");
        for key in moved.acknowledged.iter().chain(&put.acknowledged) {
            let got = raw.kv_client().get(format!("/k/{key}"), None).await?;
            ensure!(
                got.kvs().len() == 1,
                "round {round}: {key} was acknowledged and is gone, its lease alive"
            );
        }
        let (_, keys) = lease_keys(&on_b, moving).await?;
        for key in moved.acknowledged.iter().chain(&put.acknowledged) {
            ensure!(
                keys.contains(key),
                "round {round}: {key} is not among the lease's keys {keys:?}"
            );
        }

        // A revoke racing one more move: once it answers, the lease has nothing left.
        let (client, own, _) = clients[round % 2];
        let (mut puller, mut revoker) = (
            client.kv_client(),
            clients[(round + 1) % 2].0.lease_client(),
        );
        let (pulled, revoked) = tokio::join!(
            puller.txn(Txn::new().and_then([
                TxnOp::put(format!("race/{round}/m/last"), "l", leased(moving)),
                TxnOp::put(format!("race/{round}/own/last"), "o", leased(own)),
            ])),
            revoker.revoke(moving)
        );
        revoked.with_context(|| format!("round {round}: the revoke (the Txn: {pulled:?})"))?;
        let left = raw
            .kv_client()
            .get(
                prefix.as_str(),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await?;
        let left: Vec<String> = left
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect();
        ensure!(
            left.is_empty(),
            "round {round}: the revoke answered and left {left:?} (the Txn: {pulled:?})"
        );
        let fence = raw
            .kv_client()
            .get(format!("/s/{moving:016x}"), None)
            .await?;
        ensure!(
            fence.kvs().is_empty(),
            "round {round}: the revoke answered and left the lease's session fence"
        );
    }
    Ok(())
}

/// Lock calls whose callers give up while Txns move the caller's lease between
/// proxies leave nothing in line: the line ends up holding only its holder's key, the
/// lease keeps the keys it was given, and the next caller takes the lock as soon as
/// the holder unlocks.
pub async fn lock_calls_given_up_while_their_lease_moves_leave_nothing_in_line(
) -> anyhow::Result<()> {
    use etcd_client::{Client, LockOptions, PutOptions, Txn, TxnOp};
    let etcd = EtcdCluster::start(1).await?;
    let (_a, api_a) = proxy_with_etcd_api(&etcd).await?;
    let (_b, api_b) = proxy_with_etcd_api(&etcd).await?;
    let on_a = Client::connect([api_a.as_str()], None).await?;
    let on_b = Client::connect([api_b.as_str()], None).await?;
    let leased = |lease: i64| Some(PutOptions::new().with_lease(lease));
    let on = |lease: i64| Some(LockOptions::new().with_lease(lease));
    // As in the racing test: each moving lease is granted above both proxies' own
    // leases, so a Txn at either proxy pulls it there.
    let own_a = on_a.lease_client().grant(60, None).await?.id();
    let own_b = on_b.lease_client().grant(60, None).await?.id();
    let clients = [(&on_a, own_a), (&on_b, own_b)];
    let home = if own_a > own_b { &on_a } else { &on_b };
    let holder = on_a.lease_client().grant(60, None).await?.id();
    let held = on_a.lock_client().lock("moving-line", on(holder)).await?;
    let held = held.key().to_vec();
    let line = |client: Client| async move { line_keys(&client, "moving-line/").await };

    let mut movers = Vec::new();
    for round in 0..8usize {
        let moving = home.lease_client().grant(60, None).await?.id();
        home.kv_client()
            .put(format!("moving-own/{round}"), "k", leased(moving))
            .await?;
        let mover = async {
            for n in 0..4 {
                let (client, own) = clients[(n + round) % 2];
                let _ = client
                    .kv_client()
                    .txn(Txn::new().and_then([
                        TxnOp::put(format!("moving/{round}/{n}"), "m", leased(moving)),
                        TxnOp::put(format!("moving-by/{round}/{n}"), "o", leased(own)),
                    ]))
                    .await;
            }
        };
        // Given up at a different moment each round: before, while or after the
        // lease moves.
        let mut locks = clients[(round + 1) % 2].0.lock_client();
        let given_up = tokio::time::timeout(
            Duration::from_millis(20 + 40 * round as u64),
            locks.lock("moving-line", on(moving)),
        );
        let ((), outcome) = tokio::join!(mover, given_up);
        ensure!(
            !matches!(outcome, Ok(Ok(_))),
            "round {round}: a held lock was granted: {outcome:?}"
        );
        movers.push(moving);
    }
    let holder_only = vec![String::from_utf8_lossy(&held).into_owned()];
    eventually(
        "the given-up calls' keys leave the line",
        Duration::from_secs(10),
        || {
            let (client, want) = (on_a.clone(), holder_only.clone());
            async move { Ok((line(client).await? == want).then_some(())) }
        },
    )
    .await?;
    for (round, moving) in movers.iter().enumerate() {
        let (_, keys) = lease_keys(&on_b, *moving).await?;
        ensure!(
            keys.contains(&format!("moving-own/{round}")),
            "round {round}: the lease lost the key it was given: {keys:?}"
        );
    }
    on_a.lock_client().unlock(held).await?;
    let next = on_b.lease_client().grant(60, None).await?.id();
    tokio::time::timeout(
        Duration::from_secs(5),
        on_b.lock_client().lock("moving-line", on(next)),
    )
    .await
    .context("the next caller waited on a lock no one holds")??;
    Ok(())
}
