//! Per-identity limits (the grants file's `[[limit]]`): one identity misbehaving in a
//! loop is refused at each of its limits, by name, while another identity on the same
//! proxy keeps its sessions and its grants. Real etcd, a real proxy checking grants
//! over bearer tokens, the SDK as each identity.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Client, ClientOptions, Condition, Error, Session, Wait, WatchOptions};
use lockcell_tests::certs::token_sha256;
use lockcell_tests::{eventually, EtcdCluster, ProxyOptions, ProxyProcess};

use crate::support::short_session;

const SESSIONS: usize = 12;
const KEYS: usize = 6;
const WATCHES: usize = 5;
const WAITING: usize = 3;
/// Room for three 64 KiB values and their names, not four.
const BYTES: usize = 200_000;

/// `noisy` has small limits; `quiet` has the defaults; `paced` may call 5 times a second.
fn grants_file() -> String {
    let mut file = format!(
        r#"
[[grant]]
identity = "*"
lock = [""]
read = [""]
write = [""]
watch = [""]

[[limit]]
identity = "noisy"
sessions = {SESSIONS}
keys = {KEYS}
bytes = {BYTES}
stored_bytes = {BYTES}
watches = {WATCHES}
waiting = {WAITING}

[[limit]]
identity = "paced"
requests_per_second = 5
"#
    );
    for who in ["noisy", "quiet", "paced"] {
        file.push_str(&format!(
            "\n[[token]]\nidentity = \"{who}\"\nsha256 = \"{}\"\n",
            token_sha256(&token_of(who))
        ));
    }
    file
}

fn token_of(who: &str) -> String {
    format!("{who}-token-0123456789abcdef0123456789")
}

async fn guarded_proxy() -> anyhow::Result<(EtcdCluster, ProxyProcess, tempfile::TempDir)> {
    guarded_proxy_with(&[]).await
}

async fn guarded_proxy_with(
    args: &[&str],
) -> anyhow::Result<(EtcdCluster, ProxyProcess, tempfile::TempDir)> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let grants = dir.path().join("grants.toml");
    std::fs::write(&grants, grants_file())?;
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec![
        "--grants".into(),
        grants.display().to_string(),
        "--grants-without-tls".into(),
    ];
    options
        .extra_args
        .extend(args.iter().map(|a| a.to_string()));
    let proxy = ProxyProcess::start(&options, dir.path()).await?;
    Ok((etcd, proxy, dir))
}

async fn client_as(proxy: &ProxyProcess, who: &str) -> anyhow::Result<Client> {
    Ok(Client::connect_with(ClientOptions::new([proxy.addr.clone()]).token(token_of(who))).await?)
}

/// `result` failed at a limit: RESOURCE_EXHAUSTED (as the SDK reports it) with a
/// message that contains each of `names`.
fn exhausted<T>(result: Result<T, Error>, what: &str, names: &[&str]) -> anyhow::Result<()> {
    let error = match result {
        Ok(_) => anyhow::bail!("{what} went through; it should have been refused at its limit"),
        Err(e) => e,
    };
    let message = match &error {
        Error::ResourceExhausted(message) => message.clone(),
        Error::Status {
            code: lockcell_client::StatusCode::ResourceExhausted,
            message,
        } => message.clone(),
        other => anyhow::bail!("{what} failed, but not as RESOURCE_EXHAUSTED: {other:?}"),
    };
    for name in names {
        ensure!(
            message.contains(name),
            "{what}: the refusal does not name {name:?}: {message}"
        );
    }
    Ok(())
}

/// `noisy` opens sessions, watches, waiting acquires and 64 KiB ephemeral keys in
/// loops, and is refused at each limit with a message naming it and the count;
/// nothing refused is written. Meanwhile `quiet` on the same proxy holds a lock on a
/// 3 s session that never expires, and is granted new locks throughout.
pub async fn one_identity_in_a_loop_is_refused_at_each_limit_and_another_keeps_going(
) -> anyhow::Result<()> {
    let (etcd, proxy, _dir) = guarded_proxy().await?;
    let quiet = client_as(&proxy, "quiet").await?;
    let quiet_session = quiet
        .open_session(short_session(Duration::from_secs(3)))
        .await?;
    let quiet_hold = quiet_session
        .acquire("quiet/held", Wait::Try)
        .await?
        .context("quiet's lock is free")?;
    let mut quiet_locks = 0;
    let quiet_grant = async |quiet_locks: &mut usize| -> anyhow::Result<()> {
        let name = format!("quiet/lock-{quiet_locks}");
        let guard = quiet_session
            .acquire(&name, Wait::Timeout(Duration::from_secs(5)))
            .await?
            .with_context(|| format!("quiet was not granted the free lock {name}"))?;
        guard.release().await?;
        *quiet_locks += 1;
        Ok(())
    };

    // Sessions, in a loop until refused.
    let noisy = client_as(&proxy, "noisy").await?;
    let mut sessions: Vec<Session> = Vec::new();
    let refused = loop {
        match noisy
            .open_session(short_session(Duration::from_secs(10)))
            .await
        {
            Ok(s) => sessions.push(s),
            Err(e) => break e,
        }
        ensure!(
            sessions.len() <= SESSIONS,
            "noisy opened more than {SESSIONS} sessions"
        );
    };
    ensure!(
        sessions.len() == SESSIONS,
        "noisy was refused after {} sessions, not at its limit of {SESSIONS}",
        sessions.len()
    );
    exhausted(
        Err::<(), _>(refused),
        "the session past the limit",
        &[
            "\"noisy\"",
            &format!("{SESSIONS} of its {SESSIONS} open sessions"),
            "`sessions`",
        ],
    )?;
    quiet_grant(&mut quiet_locks).await?;

    // Watches, in a loop until refused; the open ones keep working.
    let mut watchers = Vec::new();
    let refused = loop {
        match noisy.watch("noise/", WatchOptions::prefix()).await {
            Ok(w) => watchers.push(w),
            Err(e) => break e,
        }
        ensure!(
            watchers.len() <= WATCHES,
            "noisy opened more than {WATCHES} watches"
        );
    };
    ensure!(
        watchers.len() == WATCHES,
        "noisy was refused after {} watches",
        watchers.len()
    );
    exhausted(
        Err::<(), _>(refused),
        "the watch past the limit",
        &[
            "\"noisy\"",
            &format!("{WATCHES} of its {WATCHES} open watches"),
            "`watches`",
        ],
    )?;
    // An observer of an election is a watch too.
    exhausted(
        noisy.observe("noise/election").await,
        "an Observe past the watches limit",
        &["\"noisy\"", "open watches", "`watches`"],
    )?;
    drop(watchers.pop());
    let again = eventually(
        "a watch that ended gives its place back",
        Duration::from_secs(5),
        || async { Ok(noisy.watch("noise/", WatchOptions::prefix()).await.ok()) },
    )
    .await?;
    watchers.push(again);
    quiet_grant(&mut quiet_locks).await?;

    // Acquires flooding one held lock: WAITING wait, the next is refused at once.
    let _held = sessions[0]
        .acquire("noise/contended", Wait::Try)
        .await?
        .context("the contended lock is free at first")?;
    let mut waits = Vec::new();
    for s in &sessions[1..=WAITING] {
        let s = s.clone();
        waits.push(tokio::spawn(async move {
            s.acquire("noise/contended", Wait::Timeout(Duration::from_secs(30)))
                .await
                .map(|g| g.is_some())
        }));
    }
    let in_progress = async || -> anyhow::Result<f64> {
        let page = proxy.metrics().await?;
        Ok(page
            .lines()
            .find(|l| l.starts_with("lockcell_waiters "))
            .and_then(|l| l.split_once(' ')?.1.trim().parse().ok())
            .unwrap_or(0.0))
    };
    eventually(
        "the waiting acquires all wait",
        Duration::from_secs(10),
        || async { Ok((in_progress().await? >= WAITING as f64).then_some(())) },
    )
    .await?;
    let flood = sessions[WAITING + 1]
        .acquire("noise/contended", Wait::Timeout(Duration::from_secs(30)))
        .await;
    exhausted(
        flood,
        "the acquire past the limit",
        &[
            "\"noisy\"",
            &format!("{WAITING} of its {WAITING} acquires in progress"),
            "`waiting`",
        ],
    )?;
    quiet_grant(&mut quiet_locks).await?;
    for w in &waits {
        w.abort();
    }

    // 64 KiB ephemeral keys, one session, in a loop until refused at `bytes`; then
    // small ones until refused at `keys`. The keys held by then are the one lock above
    // and whatever waits left none behind.
    let writer = &sessions[SESSIONS - 1];
    let write_until_refused =
        async |prefix: &str, value: &[u8]| -> anyhow::Result<(usize, Error)> {
            let mut written = 0;
            loop {
                let key = format!("{prefix}{written}");
                match writer.put_ephemeral(&key, value, Condition::Always).await {
                    Ok(w) => {
                        ensure!(w.succeeded, "the put of {key} did not succeed");
                        written += 1;
                    }
                    Err(e) => return Ok((written, e)),
                }
                ensure!(written <= KEYS, "noisy wrote more than {KEYS} keys");
            }
        };
    let (big, refused) = write_until_refused("noise/big-", &[b'x'; 64 * 1024]).await?;
    ensure!(
        big == BYTES / (64 * 1024),
        "noisy wrote {big} keys of 64 KiB under its limit of {BYTES} bytes"
    );
    exhausted(
        Err::<(), _>(refused),
        "the 64 KiB key past the bytes limit",
        &["\"noisy\"", &format!("of its {BYTES} bytes"), "`bytes`"],
    )?;
    let (small, refused) = write_until_refused("noise/small-", b"v").await?;
    ensure!(
        big + small < KEYS,
        "noisy wrote {big} + {small} ephemeral keys beside its held lock: its limit is {KEYS} keys in all"
    );
    exhausted(
        Err::<(), _>(refused),
        "the ephemeral key past the keys limit",
        &["\"noisy\"", &format!("of its {KEYS} keys held"), "`keys`"],
    )?;
    // Rewriting a key it holds with a smaller value adds nothing: let through.
    writer
        .put_ephemeral("noise/big-0", b"small now", Condition::Always)
        .await?;
    let mut store = etcd.client().await?;
    for (prefix, written) in [("/k/noise/big-", big), ("/k/noise/small-", small)] {
        let stored = store
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_keys_only(),
                ),
            )
            .await?
            .kvs()
            .len();
        ensure!(
            stored == written,
            "etcd has {stored} keys under {prefix}; {written} were accepted"
        );
    }
    quiet_grant(&mut quiet_locks).await?;

    // quiet's session renewed throughout and its first lock is still valid.
    ensure!(
        quiet_hold.is_valid(),
        "quiet's lock lost its validity during the noise"
    );
    ensure!(
        quiet_locks == 4,
        "quiet was granted {quiet_locks} locks of 4"
    );
    let page = proxy.metrics().await?;
    for limit in ["sessions", "watches", "waiting", "keys", "bytes"] {
        let line = format!("lockcell_limit_refusals_total{{identity=\"noisy\",limit=\"{limit}\"}}");
        ensure!(
            page.lines().any(|l| l.starts_with(&line)),
            "no refusal counted as {line}"
        );
    }
    ensure!(
        proxy.metric("lockcell_sessions_expired_total").await? == 0.0,
        "a session expired while the proxy was being flooded"
    );
    Ok(())
}

/// An identity calling faster than its `requests_per_second` is refused, naming the
/// rate; once it slows down its calls go through again.
pub async fn calls_past_an_identitys_rate_are_refused_until_it_slows_down() -> anyhow::Result<()> {
    let (_etcd, proxy, _dir) = guarded_proxy().await?;
    let paced = client_as(&proxy, "paced").await?;
    let session = paced
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let mut refusal = None;
    for i in 0..50 {
        if let Err(e) = session
            .put_ephemeral(&format!("paced/k{i}"), b"v", Condition::Always)
            .await
        {
            refusal = Some(e);
            break;
        }
    }
    let refusal = refusal.context("50 calls in a burst all went through at 5 a second")?;
    exhausted(
        Err::<(), _>(refusal),
        "the call past the rate",
        &["\"paced\"", "5 calls a second", "`requests_per_second`"],
    )?;
    eventually(
        "calls go through once the identity slows down",
        Duration::from_secs(5),
        || async {
            Ok(session
                .put_ephemeral("paced/later", b"v", Condition::Always)
                .await
                .ok())
        },
    )
    .await?;
    Ok(())
}

/// `result` failed RESOURCE_EXHAUSTED through the etcd API, naming `noisy` and `what`.
fn refused_as<T: std::fmt::Debug>(
    result: Result<T, etcd_client::Error>,
    call: &str,
    what: &str,
) -> anyhow::Result<()> {
    match result {
        Err(etcd_client::Error::GRpcStatus(status))
            if status.code() == tonic::Code::ResourceExhausted
                && status.message().contains("\"noisy\"")
                && status.message().contains(what) =>
        {
            Ok(())
        }
        other => anyhow::bail!("{call} was not refused at its limit naming {what:?}: {other:?}"),
    }
}

/// The same limits through the etcd API: `noisy` logged in as itself grants leases
/// until refused, and opens watches on one stream until one is created cancelled with
/// the limit as its reason; the open watches still deliver, and `quiet` is not limited.
pub async fn etcd_clients_are_refused_at_their_identitys_limits() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let grants = etcd.dir.join("grants.toml");
    std::fs::write(&grants, grants_file())?;
    let (_proxy, listen) = crate::etcd_api::proxy_with_grants(&etcd, &grants).await?;
    let login = |who: &str| etcd_client::ConnectOptions::new().with_user(who, token_of(who));
    let noisy = etcd_client::Client::connect([listen.as_str()], Some(login("noisy"))).await?;
    let quiet = etcd_client::Client::connect([listen.as_str()], Some(login("quiet"))).await?;

    let mut granted = 0;
    let mut leases = Vec::new();
    let refused = loop {
        match noisy.lease_client().grant(10, None).await {
            Ok(lease) => {
                granted += 1;
                leases.push(lease.id());
            }
            Err(e) => break e,
        }
        ensure!(
            granted <= SESSIONS,
            "noisy was granted more than {SESSIONS} leases"
        );
    };
    ensure!(
        granted == SESSIONS,
        "noisy was refused after {granted} leases"
    );
    match &refused {
        etcd_client::Error::GRpcStatus(status) => {
            ensure!(
                status.code() == tonic::Code::ResourceExhausted
                    && status.message().contains("\"noisy\"")
                    && status
                        .message()
                        .contains(&format!("{SESSIONS} of its {SESSIONS} open sessions")),
                "the lease past the limit was refused as {status:?}"
            );
        }
        other => anyhow::bail!("the lease past the limit failed as {other:?}"),
    }
    quiet
        .lease_client()
        .grant(10, None)
        .await
        .context("quiet could not grant a lease beside noisy")?;

    // Bytes: 64 KiB values on a lease until refused at `bytes`; the lease's revoke
    // gives them back.
    let (lease, big_lease) = (leases[0], leases[1]);
    let mut big = 0;
    let refused = loop {
        let put = noisy
            .kv_client()
            .put(
                format!("noise/big{big}"),
                vec![b'x'; 64 * 1024],
                Some(etcd_client::PutOptions::new().with_lease(big_lease)),
            )
            .await;
        match put {
            Ok(_) => big += 1,
            Err(e) => break e,
        }
        ensure!(big <= KEYS, "noisy put more than {KEYS} keys");
    };
    ensure!(
        big == BYTES / (64 * 1024),
        "noisy put {big} leased keys of 64 KiB under its limit of {BYTES} bytes"
    );
    refused_as(
        Err::<(), _>(refused),
        "a leased put past the bytes limit",
        &format!("of its {BYTES} bytes"),
    )?;
    noisy.lease_client().revoke(big_lease).await?;

    // Keys: a Txn putting more leased keys than the limit is refused whole; then the
    // keys one by one up to it, and a Lock or a Campaign on the lease past it.
    let leased = || Some(etcd_client::PutOptions::new().with_lease(lease));
    let too_many: Vec<etcd_client::TxnOp> = (0..=KEYS)
        .map(|i| etcd_client::TxnOp::put(format!("noise/t{i}"), "v", leased()))
        .collect();
    let txn = noisy
        .kv_client()
        .txn(etcd_client::Txn::new().and_then(too_many))
        .await;
    refused_as(txn, "a Txn of leased puts past the keys limit", "keys held")?;
    let mut store = etcd.client().await?;
    let written = store
        .get(
            "/k/noise/t",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await?;
    ensure!(
        written.kvs().is_empty(),
        "a refused Txn wrote {} keys",
        written.kvs().len()
    );
    for i in 0..KEYS {
        noisy
            .kv_client()
            .put(format!("noise/k{i}"), "v", leased())
            .await?;
    }
    let lock = noisy
        .lock_client()
        .lock(
            "noise/lock",
            Some(etcd_client::LockOptions::new().with_lease(lease)),
        )
        .await;
    refused_as(lock, "a Lock past the keys limit", "keys held")?;
    let campaign = noisy
        .election_client()
        .campaign("noise/election", "v", lease)
        .await;
    refused_as(campaign, "a Campaign past the keys limit", "keys held")?;
    // Reads through the etcd API need only the etcd login.
    noisy
        .kv_client()
        .get("noise/k0", None)
        .await
        .context("a Range as noisy")?;

    let mut stream = noisy
        .watch_client()
        .watch(
            "noise/",
            Some(etcd_client::WatchOptions::new().with_prefix()),
        )
        .await?;
    let first = stream
        .message()
        .await?
        .context("the first watch's creation")?;
    ensure!(
        first.created() && !first.canceled(),
        "the first watch was not created: {first:?}"
    );
    let mut open = 1;
    let cancelled = loop {
        stream
            .watch(
                "noise/",
                Some(etcd_client::WatchOptions::new().with_prefix()),
            )
            .await?;
        let reply = stream.message().await?.context("a watch's creation")?;
        ensure!(
            reply.created(),
            "a create was answered without `created`: {reply:?}"
        );
        if reply.canceled() {
            break reply;
        }
        open += 1;
        ensure!(open <= WATCHES, "noisy opened more than {WATCHES} watches");
    };
    ensure!(open == WATCHES, "noisy was refused after {open} watches");
    ensure!(
        cancelled
            .cancel_reason()
            .contains(&format!("{WATCHES} of its {WATCHES} open watches")),
        "the watch past the limit was cancelled for {:?}",
        cancelled.cancel_reason()
    );
    quiet.kv_client().put("noise/k", "v", None).await?;
    let event = stream.message().await?.context("the open watches' event")?;
    ensure!(
        event
            .events()
            .iter()
            .any(|e| e.kv().is_some_and(|kv| kv.key() == b"noise/k")),
        "the open watches did not deliver the put: {event:?}"
    );
    Ok(())
}

/// etcd started with an 8 MiB space quota, the proxy told so: writes of 60 KiB values
/// are refused by the proxy, naming the quota, before etcd raises its NOSPACE alarm;
/// then new keys and acquires stay refused, while a held lock is still released, a
/// session that stopped renewing still expires with its ephemeral key deleted, and a
/// key is still deleted.
pub async fn a_cell_near_its_etcd_quota_refuses_new_keys_but_releases_and_expires(
) -> anyhow::Result<()> {
    use lockcell_proto::v1::kv_client::KvClient;
    use lockcell_proto::v1::session_client::SessionClient;
    use lockcell_proto::v1::{KeepAliveRequest, OpenRequest, PutRequest};

    const QUOTA: u64 = 8 * 1024 * 1024;
    let options = lockcell_tests::etcd::EtcdOptions {
        extra_args: vec!["--quota-backend-bytes".into(), QUOTA.to_string()],
        ..Default::default()
    };
    let etcd = EtcdCluster::start_with(1, &options).await?;
    let mut proxy_options = ProxyOptions::new("a", etcd.endpoints());
    let etcd_api = format!("127.0.0.1:{}", lockcell_tests::ports::free_port());
    proxy_options.extra_args = vec![
        "--etcd-quota-bytes".into(),
        QUOTA.to_string(),
        "--etcd-listen".into(),
        etcd_api.clone(),
    ];
    let proxy = ProxyProcess::start(&proxy_options, &etcd.dir).await?;
    let client = Client::connect_with(ClientOptions::new([proxy.addr.clone()])).await?;
    let holder = client
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let held = holder
        .acquire("space/held", Wait::Try)
        .await?
        .context("the lock is free")?;

    // A session renewed by hand, with an ephemeral key: its renewals stop later.
    let channel = tonic::transport::Channel::from_shared(proxy.url())?
        .connect()
        .await?;
    let opened = SessionClient::new(channel.clone())
        .open(OpenRequest {
            ttl_ms: 3_000,
            identity: "e2e-space".into(),
        })
        .await?
        .into_inner();
    KvClient::new(channel.clone())
        .put(PutRequest {
            key: "space/member".into(),
            value: b"here".to_vec(),
            session_id: opened.session_id.clone(),
            session_secret: opened.session_secret.clone(),
            ..Default::default()
        })
        .await?;
    let (beats, beat_rx) = tokio::sync::mpsc::channel(4);
    let mut renewals = SessionClient::new(channel.clone())
        .keep_alive(tokio_stream::wrappers::ReceiverStream::new(beat_rx))
        .await?
        .into_inner();
    let renewing = tokio::spawn({
        let (id, secret) = (opened.session_id.clone(), opened.session_secret.clone());
        async move {
            // A client's renewal cadence: every 500 ms, a sixth of the TTL.
            let mut cadence = tokio::time::interval(Duration::from_millis(500));
            for seq in 0.. {
                cadence.tick().await;
                let beat = KeepAliveRequest {
                    session_id: id.clone(),
                    seq,
                    session_secret: secret.clone(),
                };
                if beats.send(beat).await.is_err() || renewals.message().await.is_err() {
                    return;
                }
            }
        }
    });

    // Fill etcd through the proxy until it refuses with etcd near the line: between
    // two readings of etcd's size (every 2 s) it lets through half the room left, so
    // it takes a few readings.
    let value = vec![b'v'; 60 * 1024];
    let mut written = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let refusal = loop {
        let refusal = loop {
            match client
                .put(&format!("space/fill-{written}"), &value, Condition::Always)
                .await
            {
                Ok(_) => written += 1,
                Err(e) => break e,
            }
            ensure!(
                written as u64 * 60 * 1024 < 2 * QUOTA,
                "{written} values of 60 KiB went through an 8 MiB quota"
            );
        };
        let read = proxy.metric("lockcell_etcd_db_bytes").await?;
        if read > QUOTA as f64 * 0.85 {
            break refusal;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the proxy refused at {read} bytes of an 8 MiB quota, far below its 90% line"
        );
        eventually(
            "the proxy reads etcd's size again",
            Duration::from_secs(10),
            || async {
                let now = proxy.metric("lockcell_etcd_db_bytes").await?;
                Ok((now != read).then_some(()))
            },
        )
        .await?;
    };
    exhausted(
        Err::<(), _>(refusal),
        "the write past the space line",
        &["--etcd-quota-bytes", "8.0 MiB", "90%"],
    )?;
    let mut store = etcd.client().await?;
    let alarms = store
        .alarm(
            etcd_client::AlarmAction::Get,
            etcd_client::AlarmType::None,
            None,
        )
        .await?;
    ensure!(
        alarms.alarms().is_empty(),
        "etcd raised {} alarms: the proxy let writes reach etcd's quota",
        alarms.alarms().len()
    );
    // Up to the line with empty values under names shorter than the lock's, then an
    // acquire no longer fits either. (A new reading of etcd's size between the two
    // may free a little room: then fill again.)
    let lock = "space/a-lock-with-a-long-name";
    let mut small = 0;
    let refused = loop {
        while client
            .put(&format!("space/f{small}"), b"", Condition::Always)
            .await
            .is_ok()
        {
            small += 1;
            ensure!(
                small < 10_000,
                "{small} empty values went through past the line"
            );
        }
        match holder.acquire(lock, Wait::Try).await {
            Ok(Some(granted)) => {
                granted.release().await?;
            }
            other => break other,
        }
    };
    exhausted(
        refused,
        "an acquire past the space line",
        &[&format!("acquiring {lock:?}"), "--etcd-quota-bytes"],
    )?;

    // What frees room or ends things still goes through.
    held.release().await.context("a release near the quota")?;
    ensure!(
        store
            .get(
                lockcell_cell::LockName::parse("space/held")?.exclusive_key(),
                None
            )
            .await?
            .kvs()
            .is_empty(),
        "the released lock's key is still in etcd"
    );
    renewing.abort();
    eventually(
        "the session that stopped renewing expires and its key goes",
        Duration::from_secs(15),
        || async {
            let left = etcd.client().await?.get("/k/space/member", None).await?;
            Ok(left.kvs().is_empty().then_some(()))
        },
    )
    .await?;
    ensure!(
        client.delete("space/fill-0", Condition::Always).await?,
        "a delete near the quota did not delete"
    );
    // Deletes that find nothing would still write a revision: refused past the line.
    // (A new reading of etcd's size every 2 s may give room back between the refill
    // and the checks: then fill again and look again.)
    let mut etcd_client = etcd_client::Client::connect([etcd_api.as_str()], None).await?;
    let refused = |result: Result<(), etcd_client::Error>, what: &str| match result {
        Err(etcd_client::Error::GRpcStatus(status))
            if status.code() == tonic::Code::ResourceExhausted
                && status.message().contains("finds no key") =>
        {
            Ok(true)
        }
        Ok(()) => Ok(false),
        other => anyhow::bail!("{what}, past the line: {other:?}"),
    };
    let mut refill = 0;
    for tries in 1.. {
        ensure!(
            tries <= 20,
            "deletes that find nothing kept going through past the line"
        );
        while client
            .put(&format!("space/refill-{refill}"), b"", Condition::Always)
            .await
            .is_ok()
        {
            refill += 1;
        }
        let delete = client
            .delete("space/never-written", Condition::Always)
            .await;
        if delete.is_ok() {
            continue;
        }
        exhausted(
            delete,
            "a delete of a key that is not there, past the line",
            &[
                "\"space/never-written\"",
                "finds no key",
                "--etcd-quota-bytes",
            ],
        )?;
        let txn = client
            .commit(
                lockcell_client::Txn::new()
                    .delete("space/never-written")
                    .delete("space/nor-this"),
            )
            .await;
        if txn.is_ok() {
            continue;
        }
        exhausted(
            txn,
            "a transaction deleting only keys that are not there, past the line",
            &["a transaction of deletes only", "finds no key"],
        )?;
        let nothing = etcd_client::Txn::new().and_then([
            etcd_client::TxnOp::delete("space/never-written", None),
            etcd_client::TxnOp::delete(
                "space/none-",
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            ),
        ]);
        let txn = etcd_client.txn(nothing).await.map(|_| ());
        if !refused(txn, "an etcd API Txn deleting nothing")? {
            continue;
        }
        let unlock = etcd_client
            .lock_client()
            .unlock("space/lock/694d0a1b2c3d4e5f")
            .await
            .map(|_| ());
        if !refused(unlock, "an Unlock of a key not there")? {
            continue;
        }
        break;
    }
    let freed = client
        .commit(
            lockcell_client::Txn::new()
                .delete("space/never-written")
                .delete("space/fill-1"),
        )
        .await
        .context("a transaction that deletes a key, past the line")?;
    ensure!(
        freed.succeeded,
        "a transaction deleting a key failed its (no) conditions"
    );
    let read_only =
        etcd_client::Txn::new().and_then([etcd_client::TxnOp::get("space/fill-2", None)]);
    etcd_client
        .txn(read_only)
        .await
        .context("a Txn that only reads, past the line")?;
    let some = etcd_client::Txn::new().and_then([
        etcd_client::TxnOp::delete("space/never-written", None),
        etcd_client::TxnOp::delete("space/fill-2", None),
    ]);
    etcd_client
        .txn(some)
        .await
        .context("an etcd API Txn that deletes a key, past the line")?;
    // The line was etcd's own reading, not only the proxy's estimate of its writes.
    let read = proxy.metric("lockcell_etcd_db_bytes").await?;
    ensure!(
        read > QUOTA as f64 * 0.8,
        "the proxy read etcd's database as {read} bytes, near an 8 MiB quota"
    );
    Ok(())
}

/// A proxy past `--max-memory-bytes` takes no new sessions and no new watches, naming
/// the bound, while a session opened before keeps renewing and holding its lock. The
/// proxy's memory grows here as a real one's does: every proxy keeps a copy of every
/// small key, and 64 KiB values are written until it is past its bound.
pub async fn a_proxy_past_its_memory_bound_sheds_new_sessions_and_watches_only(
) -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let writer = ProxyProcess::start(&ProxyOptions::new("a", etcd.endpoints()), &etcd.dir).await?;
    let baseline = eventually(
        "the proxy reads its own size",
        Duration::from_secs(10),
        || async {
            let bytes = writer.metric("lockcell_proxy_resident_bytes").await?;
            Ok((bytes > 0.0).then_some(bytes as u64))
        },
    )
    .await?;
    let bound = baseline + 32 * 1024 * 1024;
    let mut options = ProxyOptions::new("b", etcd.endpoints());
    options.extra_args = vec!["--max-memory-bytes".into(), bound.to_string()];
    let bounded = ProxyProcess::start(&options, &etcd.dir).await?;
    let on_bounded = Client::connect_with(ClientOptions::new([bounded.addr.clone()])).await?;
    let kept = on_bounded
        .open_session(short_session(Duration::from_secs(3)))
        .await?;
    let hold = kept
        .acquire("memory/held", Wait::Try)
        .await?
        .context("the lock is free")?;

    let through_writer = Client::connect_with(ClientOptions::new([writer.addr.clone()])).await?;
    let value = vec![b'm'; 64 * 1024];
    let mut written = 0;
    let refused = loop {
        for _ in 0..16 {
            through_writer
                .put(&format!("memory/k{written}"), &value, Condition::Always)
                .await?;
            written += 1;
        }
        ensure!(
            written < 4096,
            "256 MiB of values written and the proxy still opens sessions (bound {bound} bytes)"
        );
        // Each reading comes every second: let it see the copies grow.
        let resident = bounded.metric("lockcell_proxy_resident_bytes").await?;
        if resident < bound as f64 {
            continue;
        }
        match on_bounded
            .open_session(short_session(Duration::from_secs(3)))
            .await
        {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    exhausted(
        Err::<(), _>(refused),
        "a session past the memory bound",
        &["--max-memory-bytes", "new sessions"],
    )?;
    exhausted(
        on_bounded.watch("memory/", WatchOptions::prefix()).await,
        "a watch past the memory bound",
        &["--max-memory-bytes", "new watches"],
    )?;
    // The session opened before renews through two of its TTLs (six renewals at
    // TTL / 3) past the bound and keeps its lock.
    let renewed = bounded.metric("lockcell_keepalives_received_total").await?;
    eventually(
        "six more renewals past the bound",
        Duration::from_secs(20),
        || async {
            let now = bounded.metric("lockcell_keepalives_received_total").await?;
            Ok((now >= renewed + 6.0).then_some(()))
        },
    )
    .await?;
    ensure!(
        hold.is_valid(),
        "the lock opened before the bound lost its validity"
    );
    ensure!(
        bounded.metric("lockcell_sessions_expired_total").await? == 0.0,
        "a session expired on the proxy past its memory bound"
    );
    hold.release()
        .await
        .context("a release past the memory bound")?;
    Ok(())
}

/// A client that vanishes without closing its connection (its host gone: nothing comes
/// back, not even a reset) does not keep its watches: the proxy pings the quiet
/// connection, closes it unanswered, and the watches' places under the identity's limit
/// are free again.
pub async fn a_vanished_clients_watches_give_their_places_back() -> anyhow::Result<()> {
    let (_etcd, proxy, _dir) = guarded_proxy_with(&["--client-ping-interval", "1s"]).await?;
    let link = lockcell_tests::relay::Relay::start(&proxy.addr).await?;
    // A raw channel: it never pings, so only the proxy can find the connection dead.
    let channel = tonic::transport::Channel::from_shared(link.url())?
        .connect()
        .await?;
    let mut watcher = lockcell_proto::v1::watch_client::WatchClient::new(channel);
    let mut watchers = Vec::new();
    for _ in 0..WATCHES {
        let mut request = tonic::Request::new(lockcell_proto::v1::WatchRequest {
            key: "noise/".into(),
            prefix: true,
            ..Default::default()
        });
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {}", token_of("noisy")).parse()?,
        );
        let mut stream = watcher.watch(request).await?.into_inner();
        stream
            .message()
            .await?
            .context("the watch's created reply")?;
        watchers.push(stream);
    }
    let noisy = client_as(&proxy, "noisy").await?;
    exhausted(
        noisy.watch("noise/", WatchOptions::prefix()).await,
        "a watch past the limit",
        &[
            "\"noisy\"",
            &format!("{WATCHES} of its {WATCHES} open watches"),
        ],
    )?;
    link.cut(true);
    let again = eventually(
        "the vanished client's watches closed by the proxy",
        Duration::from_secs(15),
        || async { Ok(noisy.watch("noise/", WatchOptions::prefix()).await.ok()) },
    )
    .await?;
    drop(again);
    drop(watchers);
    Ok(())
}

/// A member joining and leaving in a loop (its ephemeral key written, then deleted
/// with Kv.Delete while its session lives on) is never refused at `keys`: a key deleted
/// by other means than its session's end stops counting. And an election leader's
/// Proclaim counts against `bytes`.
pub async fn deleted_keys_stop_counting_and_a_proclaim_counts_its_bytes() -> anyhow::Result<()> {
    let (_etcd, proxy, _dir) = guarded_proxy().await?;
    let noisy = client_as(&proxy, "noisy").await?;
    let session = noisy
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    for i in 0..3 * KEYS {
        let key = format!("noise/member-{i}");
        // The proxy learns of a delete from its copy of the keys, a moment after the
        // delete's answer: a join right after may still meet the limit, and goes
        // through once the copy shows the delete (without the fix, never).
        eventually(
            &format!("join {i}: {KEYS} keys, all but one deleted"),
            Duration::from_secs(10),
            || async {
                match session
                    .put_ephemeral(&key, b"here", Condition::Always)
                    .await
                {
                    Ok(_) => Ok(Some(())),
                    Err(Error::ResourceExhausted(why)) => Err(anyhow::anyhow!(why)),
                    Err(e) => Err(anyhow::Error::from(e)).map(|()| None),
                }
            },
        )
        .await?;
        ensure!(
            noisy.delete(&key, Condition::Always).await?,
            "{key} was not deleted"
        );
    }
    // Leader with a small value, beside three 64 KiB keys: just under `bytes`.
    let big = vec![b'x'; 64 * 1024];
    for i in 0..BYTES / (64 * 1024) {
        session
            .put_ephemeral(&format!("noise/big-{i}"), &big, Condition::Always)
            .await?;
    }
    let leader = session
        .campaign("noise/leader", "small", Wait::Try)
        .await?
        .context("noise/leader is free")?;
    let proclaimed = leader.proclaim(&"v".repeat(4000)).await;
    exhausted(
        proclaimed,
        "a Proclaim past the bytes limit",
        &["\"noisy\"", &format!("of its {BYTES} bytes"), "`bytes`"],
    )?;
    leader
        .proclaim("still small")
        .await
        .context("a Proclaim that adds nothing")?;
    Ok(())
}

/// An etcd client renewing leases this proxy does not have makes it look for them at
/// the other proxies, which reads etcd: each lookup is paced as a call of the caller's,
/// so `paced` (5 calls a second) renewing at full speed is refused, naming its rate,
/// while the first renewals are answered as etcd answers an unknown lease (TTL 0).
pub async fn keepalives_of_leases_not_here_are_paced() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let grants = etcd.dir.join("grants.toml");
    std::fs::write(&grants, grants_file())?;
    let (_proxy, listen) = crate::etcd_api::proxy_with_grants(&etcd, &grants).await?;
    let login = etcd_client::ConnectOptions::new().with_user("paced", token_of("paced"));
    let paced = etcd_client::Client::connect([listen.as_str()], Some(login)).await?;
    // Each keep_alive opens a stream and sends one renewal: etcd-client reports a lease
    // answered TTL 0 as not found.
    let mut answered = 0;
    let refused = loop {
        ensure!(
            answered < 50,
            "{answered} renewals of a lease that is nowhere were answered, none refused"
        );
        match paced.lease_client().keep_alive(0x7a11_0001).await {
            Err(etcd_client::Error::LeaseKeepAliveError(e)) if e.contains("not found") => {
                answered += 1
            }
            Err(etcd_client::Error::GRpcStatus(status)) => break status,
            other => anyhow::bail!("a renewal of a lease that is nowhere: {other:?}"),
        }
    };
    ensure!(answered >= 1, "not even the first renewal was answered");
    ensure!(
        refused.code() == tonic::Code::ResourceExhausted
            && refused.message().contains("\"paced\"")
            && refused.message().contains("5 calls a second"),
        "the renewals past the rate ended as {refused:?}"
    );
    Ok(())
}

/// Persistent keys (written on no session) count against the identity that wrote them
/// last, across the cell: `noisy` writes 64 KiB keys through one proxy until refused at
/// `stored_bytes`; another proxy, through either API, refuses it too, and so does the
/// first once restarted (it counts from the keys' owner records, not from memory).
/// `quiet` keeps writing; a key `noisy` deletes, or `quiet` writes over, stops counting.
pub async fn persistent_keys_count_against_their_writer_across_the_cell() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let grants = dir.path().join("grants.toml");
    std::fs::write(&grants, grants_file())?;
    let options = |zone: &str| {
        let mut options = ProxyOptions::new(zone, etcd.endpoints());
        options.extra_args = vec![
            "--grants".into(),
            grants.display().to_string(),
            "--grants-without-tls".into(),
        ];
        options
    };
    let mut a = ProxyProcess::start(&options("a"), dir.path()).await?;
    let noisy = client_as(&a, "noisy").await?;
    let quiet = client_as(&a, "quiet").await?;
    let big = vec![b'x'; 64 * 1024];
    let fits = BYTES / (64 * 1024 + 200);
    for i in 0..fits {
        noisy
            .put(&format!("noise/cfg-{i}"), &big, Condition::Always)
            .await
            .with_context(|| format!("persistent key {i} of {fits}"))?;
    }
    let names = [
        "\"noisy\"",
        "`stored_bytes`",
        &format!("of its {BYTES} bytes"),
    ];
    exhausted(
        noisy.put("noise/cfg-over", &big, Condition::Always).await,
        "a persistent key past stored_bytes",
        &names,
    )?;
    ensure!(
        noisy.get("noise/cfg-over").await?.is_none(),
        "a refused write wrote its key"
    );
    quiet
        .put("quiet/cfg", &big, Condition::Always)
        .await
        .context("another identity's persistent key")?;

    // Another proxy counts from its own copy of the keys, through the etcd API too.
    // (A linearizable read through it first: its copy then shows noisy's writes, which
    // a write racing them on another proxy may not see yet.)
    let (b, b_etcd_api) = crate::etcd_api::proxy_with_grants(&etcd, &grants).await?;
    ensure!(
        client_as(&b, "quiet")
            .await?
            .get("noise/cfg-0")
            .await?
            .is_some(),
        "the second proxy reads noisy's key"
    );
    let login = etcd_client::ConnectOptions::new().with_user("noisy", token_of("noisy"));
    let mut etcd_noisy = etcd_client::Client::connect([b_etcd_api.as_str()], Some(login)).await?;
    refused_as(
        etcd_noisy.put("noise/cfg-b", big.clone(), None).await,
        "etcd API Put",
        "stored_bytes",
    )?;
    exhausted(
        client_as(&b, "noisy")
            .await?
            .put("noise/cfg-b", &big, Condition::Always)
            .await,
        "a persistent key past stored_bytes through the second proxy",
        &names,
    )?;
    ensure!(
        etcd_noisy.get("noise/cfg-b", None).await?.kvs().is_empty(),
        "the refused etcd API put wrote its key"
    );

    // A proxy started again counts the same, from the owner records.
    drop(a);
    a = ProxyProcess::start(&options("a"), dir.path()).await?;
    let noisy = client_as(&a, "noisy").await?;
    let quiet = client_as(&a, "quiet").await?;
    exhausted(
        noisy.put("noise/cfg-over", &big, Condition::Always).await,
        "a persistent key past stored_bytes, after a restart",
        &names,
    )?;

    // A key deleted, and one another identity wrote over, count for nobody / the other.
    ensure!(
        noisy.delete("noise/cfg-0", Condition::Always).await?,
        "noise/cfg-0 deleted"
    );
    quiet
        .put("noise/cfg-1", b"quiet's now", Condition::Always)
        .await?;
    for key in ["noise/cfg-again-0", "noise/cfg-again-1"] {
        eventually(
            &format!("{key} fits once two of noisy's keys are no longer its"),
            Duration::from_secs(10),
            || async {
                match noisy.put(key, &big, Condition::Always).await {
                    Ok(_) => Ok(Some(())),
                    Err(e) => Err(anyhow::Error::from(e)),
                }
            },
        )
        .await?;
    }
    exhausted(
        noisy.put("noise/cfg-over", &big, Condition::Always).await,
        "a persistent key past stored_bytes, again",
        &names,
    )?;
    // An etcd API delete frees the identity's share too.
    etcd_noisy.delete("noise/cfg-2", None).await?;
    eventually(
        "a key fits once the etcd API deleted one",
        Duration::from_secs(10),
        || async {
            match noisy.put("noise/cfg-last", &big, Condition::Always).await {
                Ok(_) => Ok(Some(())),
                Err(e) => Err(anyhow::Error::from(e)),
            }
        },
    )
    .await?;
    Ok(())
}

/// An etcd API Txn writing with leases of two proxies brings them to one; a lease
/// brought counts against its identity's sessions there, as a new one does: `noisy`,
/// at its limit on both proxies, is refused naming it, and nothing is written.
pub async fn a_txn_gathering_leases_is_refused_at_the_sessions_limit() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let grants = etcd.dir.join("grants.toml");
    std::fs::write(&grants, grants_file())?;
    let login = || etcd_client::ConnectOptions::new().with_user("noisy", token_of("noisy"));
    let mut leases = Vec::new();
    let mut proxies = Vec::new();
    for _ in 0..2 {
        let (proxy, listen) = crate::etcd_api::proxy_with_grants(&etcd, &grants).await?;
        let client = etcd_client::Client::connect([listen.as_str()], Some(login())).await?;
        let mut mine = Vec::new();
        for _ in 0..SESSIONS {
            mine.push(client.lease_client().grant(30, None).await?.id());
        }
        refused_as(
            client.lease_client().grant(30, None).await,
            "a lease past the limit",
            "open sessions",
        )?;
        leases.push(mine[0]);
        proxies.push((proxy, client));
    }
    let mut client = proxies[0].1.clone();
    let txn = etcd_client::Txn::new().and_then([
        etcd_client::TxnOp::put(
            "noise/gathered-0",
            "a",
            Some(etcd_client::PutOptions::new().with_lease(leases[0])),
        ),
        etcd_client::TxnOp::put(
            "noise/gathered-1",
            "b",
            Some(etcd_client::PutOptions::new().with_lease(leases[1])),
        ),
    ]);
    let result = client.txn(txn).await;
    match &result {
        Err(etcd_client::Error::GRpcStatus(status))
            if status.code() == tonic::Code::ResourceExhausted
                && status.message().contains("\"noisy\"")
                && status.message().contains("open sessions")
                && status.message().contains("would bring 1 of its leases") => {}
        other => anyhow::bail!("a Txn gathering a lease past the limit: {other:?}"),
    }
    for key in ["noise/gathered-0", "noise/gathered-1"] {
        ensure!(
            client.get(key, None).await?.kvs().is_empty(),
            "the refused Txn wrote {key}"
        );
    }
    // Each lease still renews where it was.
    for (i, (_, client)) in proxies.iter().enumerate() {
        let (mut keeper, mut renewals) = client.lease_client().keep_alive(leases[i]).await?;
        keeper.keep_alive().await?;
        let renewed = renewals.message().await?.context("a keepalive reply")?;
        ensure!(renewed.ttl() > 0, "lease {i} did not renew: {renewed:?}");
    }
    Ok(())
}

/// A gather is refused at `keys` before it moves anything: `noisy` has 4 keys on a
/// lease at each proxy (its limit is 6 a proxy), and a Txn writing with both would
/// bring one lease's keys to the other's proxy. It is refused naming the limit, and
/// neither lease nor key moved: every key keeps its revision.
pub async fn a_txn_gathering_leases_is_refused_at_the_keys_limit_before_moving(
) -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let grants = etcd.dir.join("grants.toml");
    std::fs::write(&grants, grants_file())?;
    let login = || etcd_client::ConnectOptions::new().with_user("noisy", token_of("noisy"));
    let mut leases = Vec::new();
    let mut proxies = Vec::new();
    for p in 0..2 {
        let (proxy, listen) = crate::etcd_api::proxy_with_grants(&etcd, &grants).await?;
        let mut client = etcd_client::Client::connect([listen.as_str()], Some(login())).await?;
        let lease = client.lease_client().grant(30, None).await?.id();
        for k in 0..4 {
            let options = etcd_client::PutOptions::new().with_lease(lease);
            client
                .put(format!("noise/p{p}-{k}"), "v", Some(options))
                .await?;
        }
        leases.push(lease);
        proxies.push((proxy, client));
    }
    let mut client = proxies[0].1.clone();
    let before = client
        .get("noise/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await?;
    ensure!(before.kvs().len() == 8, "eight keys: {:?}", before.kvs());
    let txn = etcd_client::Txn::new().and_then([
        etcd_client::TxnOp::put(
            "noise/gathered-0",
            "a",
            Some(etcd_client::PutOptions::new().with_lease(leases[0])),
        ),
        etcd_client::TxnOp::put(
            "noise/gathered-1",
            "b",
            Some(etcd_client::PutOptions::new().with_lease(leases[1])),
        ),
    ]);
    match client.txn(txn).await {
        Err(etcd_client::Error::GRpcStatus(status))
            if status.code() == tonic::Code::ResourceExhausted
                && status.message().contains("\"noisy\"")
                && status.message().contains("keys held")
                && status.message().contains("nothing was moved") => {}
        other => anyhow::bail!("a Txn gathering keys past the limit: {other:?}"),
    }
    let after = client
        .get("noise/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await?;
    let revisions = |r: &etcd_client::GetResponse| -> Vec<(String, i64)> {
        r.kvs()
            .iter()
            .map(|kv| {
                (
                    kv.key_str().unwrap_or_default().to_owned(),
                    kv.mod_revision(),
                )
            })
            .collect()
    };
    ensure!(
        revisions(&before) == revisions(&after),
        "the refused Txn moved keys: {:?} then {:?}",
        revisions(&before),
        revisions(&after)
    );
    for (proxy, _) in &proxies {
        let moved = proxy
            .metric("lockcell_etcd_api_leases_gathered_total")
            .await
            .unwrap_or(0.0);
        ensure!(
            moved == 0.0,
            "a proxy gathered {moved} leases for a refused Txn"
        );
    }
    Ok(())
}
