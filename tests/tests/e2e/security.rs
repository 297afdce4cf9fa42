//! Attacks across the identity boundary, tried as another identity of the fleet would:
//! real etcd, real proxies checking prefix grants, callers identified by bearer tokens.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Client, ClientOptions, Wait};
use lockcell_proto::v1::election_client::ElectionClient;
use lockcell_proto::v1::lock_client::LockClient;
use lockcell_proto::v1::session_client::SessionClient;
use lockcell_proto::v1::{
    AcquireRequest, HeldKey, HeldKind, KeepAliveRequest, LeaderRequest, OpenRequest,
    ReleaseRequest, ResumeRequest, SessionState,
};
use lockcell_tests::certs::token_sha256;
use lockcell_tests::{EtcdCluster, ProxyOptions, ProxyProcess};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::Code;

use crate::support::short_session;

/// alice and mallory may lock and read under `jobs/`; eve may only lock under `eve/`;
/// `writer` may write but not read under `cfg/`.
fn grants_file() -> String {
    let mut file = String::from(
        r#"
[[grant]]
identity = "alice"
lock = ["jobs/"]
read = ["jobs/", "cfg/"]
write = ["cfg/"]

[[grant]]
identity = "mallory"
lock = ["jobs/"]
read = ["jobs/"]

[[grant]]
identity = "eve"
lock = ["eve/"]

[[grant]]
identity = "writer"
write = ["cfg/"]
"#,
    );
    for who in ["alice", "mallory", "eve", "writer"] {
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

/// A cell of `names` proxies that check the grants above over bearer tokens.
async fn guarded_cell(
    names: &[&str],
) -> anyhow::Result<(EtcdCluster, Vec<ProxyProcess>, tempfile::TempDir)> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let grants = dir.path().join("grants.toml");
    std::fs::write(&grants, grants_file())?;
    let mut proxies = Vec::new();
    for name in names {
        let mut options = ProxyOptions::new(name, etcd.endpoints());
        options.extra_args = vec![
            "--grants".into(),
            grants.display().to_string(),
            "--grants-without-tls".into(),
        ];
        proxies.push(ProxyProcess::start(&options, dir.path()).await?);
    }
    Ok((etcd, proxies, dir))
}

/// Sends one identity's bearer token with every call.
#[derive(Clone)]
struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

type Wire = InterceptedService<Channel, Bearer>;

/// Raw protocol clients of `proxy` calling as `who`.
struct Raw {
    sessions: SessionClient<Wire>,
    locks: LockClient<Wire>,
    elections: ElectionClient<Wire>,
}

async fn raw_as(proxy: &ProxyProcess, who: &str) -> anyhow::Result<Raw> {
    let channel = Channel::from_shared(proxy.url())?.connect().await?;
    let bearer = Bearer(format!("Bearer {}", token_of(who)).parse()?);
    Ok(Raw {
        sessions: SessionClient::with_interceptor(channel.clone(), bearer.clone()),
        locks: LockClient::with_interceptor(channel.clone(), bearer.clone()),
        elections: ElectionClient::with_interceptor(channel, bearer),
    })
}

async fn sdk_as(proxies: &[&ProxyProcess], who: &str) -> anyhow::Result<Client> {
    let addrs = proxies.iter().map(|p| p.addr.clone());
    Ok(Client::connect_with(ClientOptions::new(addrs).token(token_of(who))).await?)
}

fn refused<T: std::fmt::Debug>(
    result: Result<T, tonic::Status>,
    what: &str,
) -> anyhow::Result<tonic::Status> {
    match result {
        Err(status) if status.code() == Code::PermissionDenied => Ok(status),
        other => anyhow::bail!("{what} was not refused as PERMISSION_DENIED: {other:?}"),
    }
}

/// mallory reads alice's session id from Leader, then tries everything the id alone
/// once allowed, on a proxy that never saw alice's session: resume it (with no secret,
/// with her own, with alice's real secret), release alice's lock with it, renew it.
/// eve, with no right under `jobs/`, resumes alice's second session on a third proxy.
/// None of it works; alice keeps her lock, her guard stays valid, and her own resume
/// where eve tried hers goes through.
pub async fn another_identity_cannot_take_over_a_session_by_its_public_id() -> anyhow::Result<()> {
    let (etcd, proxies, _dir) = guarded_cell(&["a", "b", "c"]).await?;
    let mut store = etcd.client().await?;
    let alice = sdk_as(&[&proxies[0]], "alice").await?;
    let session = alice
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let guard = session
        .acquire("jobs/nightly", Wait::Try)
        .await?
        .context("alice did not get the free lock")?;
    let idle = alice
        .open_session(short_session(Duration::from_secs(10)))
        .await?;

    // The id is public: mallory, who may read jobs/, sees it.
    let mut mallory = raw_as(&proxies[1], "mallory").await?;
    let leader = mallory
        .elections
        .leader(LeaderRequest {
            election: "jobs/nightly".into(),
        })
        .await?
        .into_inner()
        .leader
        .context("Leader shows no holder of alice's lock")?;
    ensure!(
        leader.session_id == session.id(),
        "Leader shows {:?}, not alice's session",
        leader.session_id
    );
    let shown = format!("{leader:?}");
    ensure!(
        !shown.contains(session.secret()),
        "Leader shows alice's secret"
    );
    let own = mallory
        .sessions
        .open(OpenRequest {
            ttl_ms: 10_000,
            identity: "mallory".into(),
        })
        .await?
        .into_inner();
    let token = guard.token();
    let alices_key = store.get("/l/jobs/nightly/!x", None).await?;
    let alices_lease = alices_key.kvs().first().context("no holder key")?.lease();
    let resume = |secret: &str| ResumeRequest {
        session_id: session.id().to_owned(),
        session_secret: secret.to_owned(),
        ttl_ms: 10_000,
        identity: "mallory".into(),
        from_lease_id: alices_lease,
        keys: vec![HeldKey {
            kind: HeldKind::Exclusive as i32,
            name: "jobs/nightly".into(),
            revision: token.revision,
            lease_id: alices_lease,
            mod_revision: 0,
        }],
        ..Default::default()
    };
    for (secret, what) in [
        ("", "a resume of alice's session with no secret"),
        (
            own.session_secret.as_str(),
            "a resume of alice's session with mallory's own secret",
        ),
        (
            session.secret(),
            "a resume of alice's session with alice's secret, by mallory",
        ),
    ] {
        let status = refused(mallory.sessions.resume(resume(secret)).await, what)?;
        ensure!(
            status.message().contains(session.id()),
            "the refusal does not name the session: {status:?}"
        );
        ensure!(
            !status.message().contains(&format!("{alices_lease:x}"))
                && !status.message().contains(&alices_lease.to_string()),
            "the refusal shows alice's lease: {status:?}"
        );
    }
    refused(
        mallory
            .locks
            .release(ReleaseRequest {
                session_id: session.id().to_owned(),
                session_secret: own.session_secret.clone(),
                lock: "jobs/nightly".into(),
                token: Some(token.into()),
                mode: 0,
            })
            .await,
        "a release of alice's lock in alice's session, by mallory",
    )?;
    let renewed = mallory
        .sessions
        .keep_alive(tokio_stream::iter([KeepAliveRequest {
            session_id: session.id().to_owned(),
            seq: 1,
            session_secret: own.session_secret.clone(),
        }]))
        .await?
        .into_inner()
        .message()
        .await?
        .context("no keepalive reply")?;
    ensure!(
        renewed.state == SessionState::NotFound as i32 && renewed.valid_for_ms == 0,
        "mallory renewed alice's session: {renewed:?}"
    );
    let taken = mallory
        .locks
        .acquire(AcquireRequest {
            session_id: own.session_id.clone(),
            session_secret: own.session_secret.clone(),
            lock: "jobs/nightly".into(),
            wait_timeout_ms: Some(0),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(!taken.granted, "mallory was granted alice's lock");

    // eve, on a third proxy, tries alice's other session (no keys to move).
    let mut eve = raw_as(&proxies[2], "eve").await?;
    let bare = |secret: &str| ResumeRequest {
        session_id: idle.id().to_owned(),
        session_secret: secret.to_owned(),
        ttl_ms: 10_000,
        identity: "eve".into(),
        ..Default::default()
    };
    refused(
        eve.sessions.resume(bare(idle.secret())).await,
        "a resume of alice's idle session by eve",
    )?;
    // alice's own resume there goes through: eve left nothing in the way.
    let mut alice_raw = raw_as(&proxies[2], "alice").await?;
    alice_raw
        .sessions
        .resume(bare(idle.secret()))
        .await
        .context("alice could not resume her own session where eve had tried")?;

    // Through all of it alice held her lock, and her hold in etcd never changed.
    ensure!(guard.is_valid(), "alice's guard is no longer valid");
    let now = store.get("/l/jobs/nightly/!x", None).await?;
    let kv = now.kvs().first().context("alice's holder key is gone")?;
    ensure!(
        kv.create_revision() == token.revision && kv.lease() == alices_lease,
        "alice's holder key moved or changed"
    );
    ensure!(
        guard.release().await?,
        "alice could not release her own lock"
    );
    Ok(())
}

/// `writer` may write under `cfg/` but not read it: a conditional write that fails
/// must not show it the value it may not read (nor the lease an ephemeral key is on),
/// only the revisions it needs to try again.
pub async fn a_write_only_identity_never_reads_a_value_through_a_failed_write() -> anyhow::Result<()>
{
    use lockcell_client::{Condition, Error};
    let (_etcd, proxies, _dir) = guarded_cell(&["a"]).await?;
    let alice = sdk_as(&[&proxies[0]], "alice").await?;
    let stored = alice
        .put("cfg/db-password", b"hunter2", Condition::Absent)
        .await?;
    ensure!(stored.succeeded, "alice could not write the password");
    let writer = sdk_as(&[&proxies[0]], "writer").await?;
    ensure!(
        matches!(
            writer.get("cfg/db-password").await,
            Err(Error::PermissionDenied(_))
        ),
        "writer read the password with Get"
    );
    let tried = writer
        .put("cfg/db-password", b"guess", Condition::Absent)
        .await?;
    ensure!(
        !tried.succeeded,
        "a write on a present key under Absent succeeded"
    );
    let current = tried
        .current
        .clone()
        .context("a failed write did not name the key's revision")?;
    ensure!(
        current.value.is_empty() && !format!("{tried:?}").contains("hunter2"),
        "a failed write showed writer the value: {tried:?}"
    );
    ensure!(
        current.mod_revision == stored.revision,
        "the failed write does not give the key's revision: {current:?}"
    );
    // alice, who may read it, still sees it in the same reply.
    let seen = alice
        .put("cfg/db-password", b"guess", Condition::Absent)
        .await?;
    ensure!(
        seen.current.map(|c| c.value) == Some(b"hunter2".to_vec()),
        "a reader no longer sees the value a failed write found"
    );
    Ok(())
}

/// This host's address on its network, if it has one besides loopback: what a caller
/// from another host looks like to a server here.
fn network_address() -> Option<std::net::IpAddr> {
    // A UDP "connect" sends nothing; it only picks the route's source address.
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("192.0.2.254:9").ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// POST /drain stops a proxy: from another host it is refused (the proxy serves on),
/// with an admin token it needs the token from everyone, loopback included, and a
/// proxy it stopped exits with status 3, never 0, so a supervisor restarts it and the
/// stop shows. A token too short to be safe keeps the proxy from starting.
pub async fn the_admin_drain_answers_only_a_trusted_caller() -> anyhow::Result<()> {
    use lockcell_tests::proxy::http_call_with;
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;

    // Without a token: loopback only.
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.admin_on_every_address = true;
    let mut open = ProxyProcess::start(&options, dir.path()).await?;
    let port = open
        .admin_addr
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned();
    match network_address() {
        Some(ip) => {
            let from_afar = format!("{ip}:{port}");
            let (status, _, body) = http_call_with(&from_afar, "POST", "/drain", &[]).await?;
            ensure!(
                status == 403 && body.contains("loopback"),
                "POST /drain from {ip} was not refused: {status} {body}"
            );
            let (status, _, body) = http_call_with(&from_afar, "GET", "/readyz", &[]).await?;
            ensure!(
                status == 200,
                "the proxy is not ready after a refused drain: {status} {body}"
            );
        }
        None => eprintln!(
            "security: this host has no address besides loopback; the remote drain case is not tried"
        ),
    }
    let (status, _, body) = http_call_with(&open.admin_addr, "POST", "/drain", &[]).await?;
    ensure!(status == 202, "POST /drain on loopback: {status} {body}");
    let exit = open.process.wait_exit(Duration::from_secs(30)).await?;
    ensure!(
        exit.code() == Some(3),
        "a proxy stopped by POST /drain exited with {exit}, not status 3"
    );

    // With a token: required from everyone.
    let token = "drain-0123456789abcdef0123456789abcdef";
    let file = dir.path().join("admin-token");
    std::fs::write(&file, format!("{token}\n"))?;
    let mut options = ProxyOptions::new("b", etcd.endpoints());
    options.extra_args = vec!["--admin-token-file".into(), file.display().to_string()];
    let mut guarded = ProxyProcess::start(&options, dir.path()).await?;
    for (headers, what) in [
        (vec![], "no token"),
        (
            vec![("Authorization", "Bearer drain-guess")],
            "a wrong token",
        ),
    ] {
        let (status, _, body) =
            http_call_with(&guarded.admin_addr, "POST", "/drain", &headers).await?;
        ensure!(
            status == 401 && body.contains("admin token"),
            "POST /drain from loopback with {what} was not refused: {status} {body}"
        );
    }
    let client = Client::connect(&guarded.url()).await?;
    client
        .open_session(short_session(Duration::from_secs(5)))
        .await
        .context("the proxy stopped serving after refused drains")?;
    drop(client);
    let bearer = format!("Bearer {token}");
    let (status, _, body) = http_call_with(
        &guarded.admin_addr,
        "POST",
        "/drain",
        &[("Authorization", &bearer)],
    )
    .await?;
    ensure!(status == 202, "POST /drain with the token: {status} {body}");
    let exit = guarded.process.wait_exit(Duration::from_secs(30)).await?;
    ensure!(exit.code() == Some(3), "exited with {exit}, not status 3");

    // A short token is refused at start, by name.
    std::fs::write(&file, "short\n")?;
    let mut options = ProxyOptions::new("c", etcd.endpoints());
    options.extra_args = vec!["--admin-token-file".into(), file.display().to_string()];
    let mut refused = ProxyProcess::spawn(&options, dir.path())?;
    let exit = refused.process.wait_exit(Duration::from_secs(30)).await?;
    let log = std::fs::read_to_string(refused.log_path())?;
    ensure!(
        !exit.success() && log.contains("at least 32"),
        "a 5-character admin token was taken: {exit}\n{log}"
    );
    Ok(())
}

/// What one client sends is bounded: a session's label (recorded with every grant, in
/// etcd and the audit trail) is short and printable, a request is decoded only up to
/// what the service's own limits need, and one connection holds a bounded number of
/// calls open at once (more wait their turn).
pub async fn one_client_cannot_send_without_bounds() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec!["--max-streams-per-connection".into(), "4".into()];
    let proxy = ProxyProcess::start(&options, dir.path()).await?;
    let channel = Channel::from_shared(proxy.url())?.connect().await?;
    let mut sessions = SessionClient::new(channel.clone());
    let open = |identity: String| OpenRequest {
        ttl_ms: 5_000,
        identity,
    };
    for (label, code, says) in [
        ("x".repeat(4_000_000), Code::OutOfRange, "too large"),
        ("x".repeat(1_400_000), Code::InvalidArgument, "limit of 128"),
        ("x".repeat(129), Code::InvalidArgument, "limit of 128"),
        (
            "job\nforged log line".to_owned(),
            Code::InvalidArgument,
            "control character",
        ),
    ] {
        let status = sessions
            .open(open(label.clone()))
            .await
            .expect_err("an oversized or unprintable label was taken");
        ensure!(
            status.code() == code && status.message().contains(says),
            "a {}-byte label: {status:?}",
            label.len()
        );
    }
    sessions
        .open(open("x".repeat(128)))
        .await
        .context("a 128-byte label was refused")?;
    let mut kv = lockcell_proto::v1::kv_client::KvClient::new(channel.clone());
    let status = kv
        .put(lockcell_proto::v1::PutRequest {
            key: "big".into(),
            value: vec![b'v'; 3 << 20],
            ..Default::default()
        })
        .await
        .expect_err("a 3 MiB put was decoded");
    ensure!(status.code() == Code::OutOfRange, "{status:?}");
    let mut store = etcd.client().await?;
    ensure!(
        store.get("/k/big", None).await?.kvs().is_empty(),
        "the oversized put wrote"
    );

    // Four calls open on one connection: a fifth waits until one ends.
    let mut senders = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..4 {
        let (tx, rx) = tokio::sync::mpsc::channel::<KeepAliveRequest>(1);
        let stream = sessions
            .keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?;
        senders.push(tx);
        streams.push(stream);
    }
    let mut fifth = tokio::spawn({
        let mut sessions = sessions.clone();
        async move { sessions.open(open("fifth".into())).await }
    });
    ensure!(
        tokio::time::timeout(Duration::from_secs(1), &mut fifth)
            .await
            .is_err(),
        "a fifth call on the connection ran while four were open"
    );
    senders.pop();
    streams.pop();
    tokio::time::timeout(Duration::from_secs(10), fifth)
        .await
        .context("the fifth call did not run once a call ended")???;
    Ok(())
}

/// The small keys under `fill/` in etcd, and the bytes of their values.
async fn filled(store: &mut etcd_client::Client) -> anyhow::Result<(Vec<String>, usize)> {
    let listed = store
        .get(
            "/k/fill/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await?;
    let names = listed
        .kvs()
        .iter()
        .map(|kv| kv.key_str().map(|k| k.trim_start_matches("/k/").to_owned()))
        .collect::<Result<_, _>>()?;
    Ok((names, listed.kvs().iter().map(|kv| kv.value().len()).sum()))
}

/// Every proxy keeps a copy of every small key, so one writer could grow every proxy
/// of the cell: the bound on what small keys hold is the cell's. Writes racing through
/// two proxies at once pass it by at most one write per proxy; writes through one proxy
/// then fill it, a proxy that was never called refuses too, naming the limit, and a
/// delete makes room again.
pub async fn one_writer_cannot_grow_every_proxy_past_the_cells_bound() -> anyhow::Result<()> {
    use lockcell_client::{Condition, Error};
    const LIMIT: usize = 1 << 20;
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let mut proxies = Vec::new();
    for zone in ["a", "b"] {
        let mut options = ProxyOptions::new(zone, etcd.endpoints());
        options.extra_args = vec!["--max-kv-total-bytes".into(), LIMIT.to_string()];
        proxies.push(ProxyProcess::start(&options, dir.path()).await?);
    }
    let writer = Client::connect(&proxies[0].url()).await?;
    let other = Client::connect(&proxies[1].url()).await?;
    let value = vec![b'v'; 60 * 1024];
    let mut store = etcd.client().await?;

    // 48 writes at once, half through each proxy: one per proxy may be in flight
    // unseen by the other, so the cell passes the bound by two writes at most.
    let mut racing = tokio::task::JoinSet::new();
    for i in 0..48 {
        let client = if i % 2 == 0 {
            writer.clone()
        } else {
            other.clone()
        };
        let value = value.clone();
        racing.spawn(async move {
            client
                .put(&format!("fill/race-{i}"), &value, Condition::Always)
                .await
        });
    }
    let mut refused = Vec::new();
    while let Some(done) = racing.join_next().await {
        if let Err(e) = done? {
            refused.push(e);
        }
    }
    ensure!(
        !refused.is_empty(),
        "48 racing writes of 60 KiB all passed a 1 MiB bound"
    );
    ensure!(
        refused
            .iter()
            .all(|e| matches!(e, Error::ResourceExhausted(_) | Error::Unavailable(_))),
        "racing writes were refused otherwise: {refused:?}"
    );
    let (_, after_race) = filled(&mut store).await?;
    ensure!(
        after_race <= LIMIT + 2 * value.len(),
        "racing writes took the small keys to {after_race} bytes under a {LIMIT}-byte bound"
    );

    // Sequential writes through one proxy: refused by name at the bound.
    let mut written = 0;
    let refusal = loop {
        match writer
            .put(&format!("fill/{written}"), &value, Condition::Always)
            .await
        {
            Ok(_) => written += 1,
            Err(e) => break e,
        }
        ensure!(
            written * value.len() <= 2 * LIMIT,
            "{written} writes of {} bytes were taken under a {LIMIT}-byte bound",
            value.len()
        );
    };
    ensure!(
        matches!(&refusal, Error::ResourceExhausted(m) if m.contains("--max-kv-total-bytes")),
        "the write past the bound was not refused by name: {refusal:?}"
    );
    let (_, total) = filled(&mut store).await?;
    ensure!(
        total <= LIMIT + 2 * value.len(),
        "etcd holds {total} bytes of small keys past the bound"
    );

    // A proxy nobody wrote through lately refuses as well.
    lockcell_tests::eventually(
        "the other proxy refuses past the bound",
        Duration::from_secs(10),
        || async {
            match other.put("fill/other", &value, Condition::Always).await {
                Err(Error::ResourceExhausted(_)) => Ok(Some(())),
                Ok(_) => anyhow::bail!("the other proxy took a write past the bound"),
                Err(_) => Ok(None),
            }
        },
    )
    .await?;
    // A transaction that frees more than it writes goes through.
    let (names, _) = filled(&mut store).await?;
    ensure!(names.len() >= 3, "only {} keys were written", names.len());
    let swapped = writer
        .commit(
            lockcell_client::Txn::new()
                .delete(&names[0])
                .put("fill/swapped", &value[..value.len() - 1024]),
        )
        .await;
    ensure!(
        matches!(&swapped, Ok(c) if c.succeeded),
        "a transaction that deletes a key and writes less was refused: {swapped:?}"
    );
    // Room made, a write goes through.
    for key in &names[1..3] {
        writer.delete(key, Condition::Always).await?;
    }
    lockcell_tests::eventually(
        "a write fits once keys are deleted",
        Duration::from_secs(10),
        || async {
            Ok(other
                .put("fill/after", &value, Condition::Always)
                .await
                .ok()
                .map(|_| ()))
        },
    )
    .await?;
    Ok(())
}

/// The audit tailer's history, asked as each identity: nobody without a token the
/// grants list, nobody about a name its grants do not let it read or lock; values and
/// lease ids only when asked for, and only with the read right.
pub async fn the_audit_history_answers_only_who_may_read_it() -> anyhow::Result<()> {
    use lockcell_client::Condition;
    use lockcell_tests::audit::AuditProcess;
    use lockcell_tests::proxy::http_call_with;
    let (etcd, proxies, dir) = guarded_cell(&["a"]).await?;
    let tailer = AuditProcess::start(
        "run",
        &etcd.endpoints(),
        &dir.path().join("audit"),
        &[
            "--grants".into(),
            dir.path().join("grants.toml").display().to_string(),
            "--grants-without-tls".into(),
        ],
        &dir.path().join("audit.log"),
    )
    .await?;
    let alice = sdk_as(&[&proxies[0]], "alice").await?;
    alice
        .put("cfg/db-password", b"hunter2", Condition::Always)
        .await?;
    let session = alice
        .open_session(short_session(Duration::from_secs(10)))
        .await?;
    let _guard = session
        .acquire("jobs/nightly", Wait::Try)
        .await?
        .context("alice did not get the free lock")?;
    let ask = |who: Option<&str>, name: &str, values: bool| {
        let addr = tailer.addr.clone();
        let path = format!(
            "/v1/audit?name={name}{}",
            if values { "&values=true" } else { "" }
        );
        let bearer = who.map(|w| format!("Bearer {}", token_of(w)));
        async move {
            let headers: Vec<(&str, &str)> = bearer
                .as_deref()
                .map(|b| vec![("Authorization", b)])
                .unwrap_or_default();
            http_call_with(&addr, "GET", &path, &headers).await
        }
    };
    // Wait until the trail has both.
    lockcell_tests::eventually(
        "the trail has the write and the grant",
        Duration::from_secs(20),
        || async {
            let (_, _, key) = ask(Some("alice"), "cfg/db-password", true).await?;
            let (_, _, lock) = ask(Some("alice"), "jobs/nightly", false).await?;
            Ok((key.contains("hunter2") && lock.contains("granted")).then_some(()))
        },
    )
    .await?;

    for (who, name, values, status) in [
        (None, "cfg/db-password", false, 401),
        (Some("eve"), "jobs/nightly", false, 403),
        (Some("mallory"), "cfg/db-password", false, 403),
        (Some("writer"), "cfg/db-password", true, 403),
    ] {
        let (got, _, body) = ask(who, name, values).await?;
        ensure!(
            got == status && !body.contains("hunter2") && !body.contains(session.id()),
            "{who:?} asking for {name} (values {values}): {got} {body}"
        );
    }
    // mallory may read jobs/: the history, without lease ids unless asked for.
    let (got, _, body) = ask(Some("mallory"), "jobs/nightly", false).await?;
    let events: Vec<lockcell_cell::audit::AuditEvent> = serde_json::from_str(&body)?;
    ensure!(
        got == 200 && !events.is_empty() && events.iter().all(|e| e.lease == 0),
        "mallory's history of jobs/nightly: {got} {body}"
    );
    // alice may read cfg/: no value unless asked for.
    let (got, _, body) = ask(Some("alice"), "cfg/db-password", false).await?;
    ensure!(
        got == 200 && !body.contains("hunter2"),
        "a history not asked for values shows one: {got} {body}"
    );
    // A token too short to be safe is not taken, even if the file lists it.
    let (got, _, _) = http_call_with(
        &tailer.addr,
        "GET",
        "/v1/audit?name=cfg/db-password",
        &[("Authorization", "Bearer short")],
    )
    .await?;
    ensure!(got == 401, "a short token was taken: {got}");
    tailer.stop().await?;

    // Over HTTPS, as deployed: lockctl audit with the CA and a token, while another
    // client sits on an unfinished handshake (it holds up no one).
    let ca = lockcell_tests::certs::Authority::new(&dir.path().join("certs"))?;
    let server = ca.server("audit")?;
    let addr = format!("127.0.0.1:{}", lockcell_tests::ports::free_port());
    let mut cmd = std::process::Command::new(lockcell_tests::bins::workspace_bin("lockcell-cell")?);
    cmd.args(["audit", "run", "--etcd", &etcd.endpoints().join(",")])
        .arg("--data-dir")
        .arg(dir.path().join("audit"))
        .args([
            "--listen",
            &addr,
            "--etcd-user",
            lockcell_cell::rbac::TAILER_USER,
        ])
        .arg("--grants")
        .arg(dir.path().join("grants.toml"))
        .arg("--tls-cert")
        .arg(&server.cert)
        .arg("--tls-key")
        .arg(&server.key)
        .env(
            "LOCKCELL_ETCD_PASSWORD",
            lockcell_tests::etcd::TAILER_PASSWORD,
        );
    let _https = lockcell_tests::process::Managed::spawn(
        "audit tailer (https)",
        cmd,
        &dir.path().join("audit-https.log"),
    )?;
    let _stalled = lockcell_tests::eventually(
        "the https tailer listens",
        Duration::from_secs(20),
        || async { Ok(tokio::net::TcpStream::connect(&addr).await.ok()) },
    )
    .await?;
    let shown = lockcell_tests::eventually(
        "lockctl audit over https shows the trail",
        Duration::from_secs(20),
        || async {
            let out = tokio::process::Command::new(lockcell_tests::bins::workspace_bin("lockctl")?)
                .args([
                    "audit",
                    "jobs/nightly",
                    "--audit",
                    &format!("https://{addr}"),
                ])
                .arg("--tls-ca")
                .arg(&ca.ca)
                .env("LOCKCELL_AUTH_TOKEN", token_of("mallory"))
                .output()
                .await?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            anyhow::ensure!(
                out.status.success(),
                "lockctl audit: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(stdout.contains("granted").then_some(stdout))
        },
    )
    .await?;
    ensure!(
        !shown.contains("hunter2"),
        "lockctl audit over https showed a value: {shown}"
    );
    Ok(())
}

/// A renewed serving certificate takes effect without a restart: once the files
/// change, new connections get the new certificate (a client that trusts only the new
/// CA connects, one that trusts only the old one no longer does), and the proxy that
/// read them never stopped.
pub async fn a_renewed_certificate_applies_without_a_restart() -> anyhow::Result<()> {
    use lockcell_client::{ClientTls, Condition};
    use lockcell_tests::certs::Authority;
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let old_ca = Authority::new(&dir.path().join("old"))?;
    let new_ca = Authority::new(&dir.path().join("new"))?;
    let (cert, key) = (
        dir.path().join("proxy.pem"),
        dir.path().join("proxy-key.pem"),
    );
    let install = |pems: &lockcell_tests::certs::Pems| -> anyhow::Result<()> {
        // As a Secret update does: new files renamed into place.
        for (from, to) in [(&pems.key, &key), (&pems.cert, &cert)] {
            let staged = to.with_extension("new");
            std::fs::copy(from, &staged)?;
            std::fs::rename(&staged, to)?;
        }
        Ok(())
    };
    install(&old_ca.server("proxy")?)?;
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec![
        "--tls-cert".into(),
        cert.display().to_string(),
        "--tls-key".into(),
        key.display().to_string(),
    ];
    let mut proxy = ProxyProcess::start(&options, dir.path()).await?;
    let trusting = |ca: &Authority| {
        let options = ClientOptions::new([proxy.addr.clone()]).tls(ClientTls {
            ca_pem: std::fs::read(&ca.ca).expect("CA file"),
            identity_pem: None,
            domain: Some("localhost".into()),
        });
        async move {
            let client = Client::connect_with(options).await?;
            client.put("tls/probe", b"1", Condition::Always).await
        }
    };
    trusting(&old_ca)
        .await
        .context("a client trusting the first CA could not call")?;

    install(&new_ca.server("proxy")?)?;
    lockcell_tests::eventually(
        "new connections get the renewed certificate",
        Duration::from_secs(15),
        || async { Ok(trusting(&new_ca).await.ok().map(|_| ())) },
    )
    .await?;
    ensure!(
        trusting(&old_ca).await.is_err(),
        "a new connection still got the old certificate"
    );
    ensure!(
        proxy.process.is_running(),
        "the proxy stopped to take the new certificate"
    );
    let reloads = proxy.metric("lockcell_tls_reloads_total").await?;
    ensure!(reloads >= 1.0, "lockcell_tls_reloads_total is {reloads}");
    Ok(())
}
