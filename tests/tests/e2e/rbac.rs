//! etcd access control: each lockcell user does its own work and nothing more, a proxy
//! that etcd turns away says why and stops, and `lockcell-cell auth-enable` changes
//! nothing the second time and puts back what drifted.

use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use etcd_client::{
    GetOptions, LeaseTimeToLiveOptions, Permission, PutOptions, Txn, TxnOp, WatchOptions,
};
use lockcell_cell::rbac::{self, Credentials, Refusal};
use lockcell_client::{Client, Condition, Wait};
use lockcell_tests::etcd;
use lockcell_tests::{bins, EtcdCluster, ProxyOptions, ProxyProcess};

use crate::cell::refuses;
use crate::support::short_session;

/// One key in each part of the key space, and one outside them all.
const SEEDED: [&str; 6] = [
    "/l/seed/!x",
    "/q/seed/!x/s1",
    "/k/seed",
    "/s/s1",
    "/sys/seed",
    "/elsewhere",
];

/// That etcd refused `what` for want of permission.
fn denied<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, etcd_client::Error>,
) -> anyhow::Result<()> {
    match result {
        Err(e) if rbac::refusal(&e) == Some(Refusal::PermissionDenied) => Ok(()),
        Err(e) => bail!("{what}: refused, but not for want of permission: {e}"),
        Ok(reply) => bail!("{what}: allowed ({reply:?}), but should be refused"),
    }
}

/// That etcd allowed `what`; its reply.
pub fn allowed<T>(what: &str, result: Result<T, etcd_client::Error>) -> anyhow::Result<T> {
    result.with_context(|| format!("{what}: refused, but should be allowed"))
}

/// Whether etcd lets `client` watch `key` (a refused watch is cancelled in its creation
/// reply).
async fn may_watch(
    client: &etcd_client::Client,
    key: &str,
    options: WatchOptions,
) -> anyhow::Result<bool> {
    let mut stream = client.watch_client().watch(key, Some(options)).await?;
    let created = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .context("no reply to a watch")??
        .context("the watch ended without a reply")?;
    Ok(created.created() && !created.canceled())
}

fn prefix() -> Option<GetOptions> {
    Some(GetOptions::new().with_prefix())
}

pub fn login(etcd: &EtcdCluster, user: &str) -> anyhow::Result<Credentials> {
    etcd.credentials(user)
        .with_context(|| format!("the test cluster has no user {user}"))
}

pub async fn each_role_can_do_what_it_should_and_nothing_more() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    ensure!(etcd.auth(), "test clusters run with authentication on");
    let root = etcd.client().await?;
    for key in SEEDED {
        root.kv_client().put(key, "seed", None).await?;
    }
    let anonymous = etcd_client::Client::connect(etcd.endpoints(), None).await?;
    match anonymous.kv_client().get("/k/seed", None).await {
        Err(e) if rbac::refusal(&e) == Some(Refusal::NoUser) => {}
        other => bail!("a read without a user was not refused for it: {other:?}"),
    }

    // The tailer reads every key and writes none.
    let tailer = etcd.client_as(&login(&etcd, rbac::TAILER_USER)?).await?;
    let mut kv = tailer.kv_client();
    for root_prefix in ["/l/", "/q/", "/k/", "/s/", "/sys/"] {
        let got = allowed(
            &format!("the tailer's read of {root_prefix}"),
            kv.get(root_prefix, prefix()).await,
        )?;
        ensure!(
            !got.kvs().is_empty(),
            "the tailer read nothing under {root_prefix}"
        );
    }
    let every = GetOptions::new().with_all_keys();
    let all = allowed(
        "the tailer's read of every key",
        kv.get("", Some(every)).await,
    )?;
    ensure!(
        all.kvs().iter().any(|kv| kv.key() == b"/elsewhere"),
        "the tailer's read of every key missed a key outside lockcell's prefixes"
    );
    ensure!(
        may_watch(&tailer, "", WatchOptions::new().with_all_keys()).await?,
        "the tailer may not watch every key"
    );
    let before = etcd.revision().await?;
    for key in SEEDED.iter().chain(&["/sys/epoch"]) {
        denied(
            &format!("the tailer's put of {key}"),
            kv.put(*key, "x", None).await,
        )?;
    }
    denied("the tailer's delete", kv.delete("/k/seed", None).await)?;
    let txn = Txn::new().and_then([TxnOp::put("/k/seed", "x", None)]);
    denied("the tailer's transaction", kv.txn(txn).await)?;
    // etcd 3.4 grants a lease to anyone logged in; attaching a key to it is a write.
    if let Ok(lease) = tailer.lease_client().grant(30, None).await {
        let on_lease = Some(PutOptions::new().with_lease(lease.id()));
        denied(
            "the tailer's put on its own lease",
            kv.put("/l/tailer/!x", "x", on_lease).await,
        )?;
        let attached = root
            .lease_client()
            .time_to_live(lease.id(), Some(LeaseTimeToLiveOptions::new().with_keys()))
            .await?;
        ensure!(
            attached.keys().is_empty(),
            "the tailer attached keys to a lease: {:?}",
            attached.keys()
        );
    }
    let after = etcd.revision().await?;
    ensure!(
        after == before,
        "the tailer's refused writes moved the store from revision {before} to {after}"
    );

    // The proxy writes its four prefixes, reads (and watches) everything, writes
    // nothing else.
    let proxy = etcd.client_as(&login(&etcd, rbac::PROXY_USER)?).await?;
    let mut kv = proxy.kv_client();
    for key in ["/l/p/!x", "/q/p/!x/s1", "/k/p", "/s/p"] {
        allowed(
            &format!("the proxy's put of {key}"),
            kv.put(key, "p", None).await,
        )?;
    }
    let sys = allowed("the proxy's read of /sys/", kv.get("/sys/", prefix()).await)?;
    ensure!(
        sys.kvs().iter().any(|kv| kv.key() == b"/sys/epoch"),
        "the proxy's read of /sys/ has no epoch record"
    );
    ensure!(
        may_watch(&proxy, "", WatchOptions::new().with_all_keys()).await?,
        "the proxy may not watch every key (its cell watch needs to)"
    );
    let before = etcd.revision().await?;
    for key in ["/sys/epoch", "/sys/p", "/elsewhere", "/x"] {
        denied(
            &format!("the proxy's put of {key}"),
            kv.put(key, "x", None).await,
        )?;
    }
    denied(
        "the proxy's delete of /sys/seed",
        kv.delete("/sys/seed", None).await,
    )?;
    let half = Txn::new().and_then([
        TxnOp::put("/k/p", "half", None),
        TxnOp::put("/sys/p", "half", None),
    ]);
    denied(
        "a proxy transaction writing /k/ and /sys/",
        kv.txn(half).await,
    )?;
    let after = etcd.revision().await?;
    ensure!(
        after == before,
        "the proxy's refused writes moved the store from revision {before} to {after}"
    );
    // Revoking a lease deletes its keys: the proxy may for its own, not for a lease
    // holding a key outside its prefixes.
    let lease = allowed(
        "the proxy's lease",
        proxy.lease_client().grant(30, None).await,
    )?;
    let on_lease = Some(PutOptions::new().with_lease(lease.id()));
    allowed(
        "the proxy's put on its lease",
        kv.put("/l/p/!s/s1", "p", on_lease).await,
    )?;
    allowed(
        "the proxy's revoke of its lease",
        proxy.lease_client().revoke(lease.id()).await,
    )?;
    ensure!(
        root.kv_client()
            .get("/l/p/!s/s1", None)
            .await?
            .kvs()
            .is_empty(),
        "the key on the revoked lease is still there"
    );
    let foreign = root.lease_client().grant(30, None).await?.id();
    let on_foreign = Some(PutOptions::new().with_lease(foreign));
    root.kv_client().put("/sys/leased", "r", on_foreign).await?;
    denied(
        "the proxy's revoke of a lease holding a /sys/ key",
        proxy.lease_client().revoke(foreign).await,
    )?;
    ensure!(
        !root
            .kv_client()
            .get("/sys/leased", None)
            .await?
            .kvs()
            .is_empty(),
        "a refused revoke deleted the lease's key"
    );

    // The admin reads every key (a shard map move looks for the locks, waiters and
    // small keys of the names it moves) and writes /sys/ (the cell's records) and /k/
    // (the small keys a move copies and deletes), nothing else.
    let admin = etcd.client_as(&login(&etcd, rbac::ADMIN_USER)?).await?;
    let mut kv = admin.kv_client();
    for key in ["/sys/a", "/k/a"] {
        allowed(
            &format!("the admin's put of {key}"),
            kv.put(key, "a", None).await,
        )?;
        allowed(
            &format!("the admin's delete of {key}"),
            kv.delete(key, None).await,
        )?;
    }
    for root_prefix in ["/l/", "/q/", "/k/", "/s/", "/sys/"] {
        let got = allowed(
            &format!("the admin's read of {root_prefix}"),
            kv.get(root_prefix, prefix()).await,
        )?;
        ensure!(
            !got.kvs().is_empty(),
            "the admin read nothing under {root_prefix}"
        );
    }
    let before = etcd.revision().await?;
    for key in ["/l/a/!x", "/q/a/!x/s1", "/s/a", "/elsewhere"] {
        denied(
            &format!("the admin's put of {key}"),
            kv.put(key, "a", None).await,
        )?;
    }
    denied(
        "the admin's delete of /l/seed/!x",
        kv.delete("/l/seed/!x", None).await,
    )?;
    let half = Txn::new().and_then([
        TxnOp::put("/k/a", "half", None),
        TxnOp::put("/l/a/!x", "half", None),
    ]);
    denied(
        "an admin transaction writing /k/ and /l/",
        kv.txn(half).await,
    )?;
    let after = etcd.revision().await?;
    ensure!(
        after == before,
        "the admin's refused writes moved the store from revision {before} to {after}"
    );

    // A proxy etcd turns away says why and stops.
    let mut wrong = ProxyOptions::new("a", etcd.endpoints());
    wrong.etcd_auth = Some((rbac::PROXY_USER.to_owned(), "not-the-password".to_owned()));
    refuses(
        &wrong,
        &etcd.dir,
        "refused the user lockcell-proxy and its password",
    )
    .await?;
    let mut nobody = ProxyOptions::new("b", etcd.endpoints());
    nobody.etcd_auth = None;
    refuses(&nobody, &etcd.dir, "runs with authentication on").await?;

    // The whole flow as lockcell-proxy: a lock granted, a small key written.
    let server = ProxyProcess::start(&ProxyOptions::new("c", etcd.endpoints()), &etcd.dir).await?;
    let client = Client::connect(&server.url()).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let guard = session
        .acquire("rbac/flow", Wait::Timeout(Duration::from_secs(10)))
        .await?
        .context("a proxy logged in as lockcell-proxy did not grant a free lock")?;
    let holder = root.kv_client().get("/l/rbac/flow/!x", None).await?;
    ensure!(
        holder.kvs().first().is_some_and(|kv| kv.lease() != 0),
        "the grant left no holder key on a proxy lease: {:?}",
        holder.kvs()
    );
    let written = client.put("rbac/key", b"v", Condition::Always).await?;
    ensure!(
        written.succeeded,
        "a small-key write through the proxy failed"
    );
    let stored = root.kv_client().get("/k/rbac/key", None).await?;
    ensure!(
        stored.kvs().first().map(|kv| kv.value()) == Some(b"v".as_slice()),
        "the small key is not in etcd: {:?}",
        stored.kvs()
    );
    ensure!(guard.release().await?, "the release deleted nothing");
    session.close().await?;
    Ok(())
}

/// Runs `lockcell-cell auth-enable` with the test passwords (root's: `root_password`);
/// its stdout, or its stderr as the error.
fn auth_enable(endpoint: &str, root_password: &str) -> anyhow::Result<String> {
    let out = Command::new(bins::workspace_bin("lockcell-cell")?)
        .args(["auth-enable", "--etcd", endpoint])
        .env("LOCKCELL_ROOT_PASSWORD", root_password)
        .env("LOCKCELL_PROXY_PASSWORD", etcd::PROXY_PASSWORD)
        .env("LOCKCELL_TAILER_PASSWORD", etcd::TAILER_PASSWORD)
        .env("LOCKCELL_ADMIN_PASSWORD", etcd::ADMIN_PASSWORD)
        .output()?;
    ensure!(
        out.status.success(),
        "lockcell-cell auth-enable failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub async fn auth_enable_changes_nothing_the_second_time_and_puts_back_drift() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start_without_auth(1).await?;
    let endpoint = etcd.endpoints()[0].clone();
    let first = auth_enable(&endpoint, etcd::ROOT_PASSWORD)?;
    for change in [
        "added the role lockcell-proxy",
        "granted lockcell-proxy readwrite on the prefix /s/",
        "granted lockcell-tailer read on every key",
        "granted lockcell-admin read on every key",
        "granted lockcell-admin readwrite on the prefix /sys/",
        "granted lockcell-admin readwrite on the prefix /k/",
        "added the user root",
        "gave lockcell-admin the role lockcell-admin",
        "turned etcd authentication on",
    ] {
        ensure!(
            first.contains(change),
            "the first run did not say {change:?}:\n{first}"
        );
    }
    let anonymous = etcd_client::Client::connect([&endpoint], None).await?;
    match anonymous.kv_client().get("/sys/epoch", None).await {
        Err(e) if rbac::refusal(&e) == Some(Refusal::NoUser) => {}
        other => bail!("after auth-enable a read without a user was not refused for it: {other:?}"),
    }
    let second = auth_enable(&endpoint, etcd::ROOT_PASSWORD)?;
    ensure!(
        second.contains("nothing changed") && second.lines().count() == 1,
        "the second run changed something:\n{second}"
    );

    // Drift by hand: the proxy may write /sys/, the tailer lost its role, the admin's
    // password changed.
    let root = Credentials::new(rbac::ROOT_USER, etcd::ROOT_PASSWORD);
    let options = rbac::connect_options(Some(&root));
    let as_root = etcd_client::Client::connect([&endpoint], Some(options)).await?;
    let mut auth = as_root.auth_client();
    let sys = Permission::read_write("/sys/").with_prefix();
    auth.role_grant_permission(rbac::PROXY_USER, sys).await?;
    auth.user_revoke_role(rbac::TAILER_USER, rbac::TAILER_USER)
        .await?;
    auth.user_change_password(rbac::ADMIN_USER, "changed by hand")
        .await?;
    let third = auth_enable(&endpoint, etcd::ROOT_PASSWORD)?;
    for change in [
        "revoked readwrite on the prefix /sys/ from lockcell-proxy",
        "gave lockcell-tailer the role lockcell-tailer",
        "set the password of lockcell-admin",
    ] {
        ensure!(
            third.contains(change),
            "the third run did not say {change:?}:\n{third}"
        );
    }
    ensure!(
        third.lines().count() == 3,
        "the third run changed more than the drift:\n{third}"
    );
    let proxy = Credentials::new(rbac::PROXY_USER, etcd::PROXY_PASSWORD);
    let proxy =
        etcd_client::Client::connect([&endpoint], Some(rbac::connect_options(Some(&proxy))))
            .await?;
    denied(
        "the proxy's put of /sys/x after the drift was put back",
        proxy.kv_client().put("/sys/x", "x", None).await,
    )?;
    let admin = Credentials::new(rbac::ADMIN_USER, etcd::ADMIN_PASSWORD);
    let admin =
        etcd_client::Client::connect([&endpoint], Some(rbac::connect_options(Some(&admin))))
            .await
            .context("the admin's password was not put back")?;
    allowed(
        "the admin's read of the epoch record",
        admin.kv_client().get("/sys/epoch", None).await,
    )?;
    let fourth = auth_enable(&endpoint, etcd::ROOT_PASSWORD)?;
    ensure!(
        fourth.contains("nothing changed"),
        "the run after the repair changed something:\n{fourth}"
    );
    let refused = auth_enable(&endpoint, "not-root's-password")
        .err()
        .context("auth-enable with a wrong root password succeeded")?;
    ensure!(
        refused.to_string().contains("log in as root"),
        "a wrong root password is not named: {refused:#}"
    );
    Ok(())
}
