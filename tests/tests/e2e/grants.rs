//! Prefix grants over mutual TLS and bearer tokens: what a grant allows goes through,
//! what it does not is refused naming the identity, the right and the name.

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_client::{Client, ClientOptions, ClientTls, Condition, Error, Wait, WatchOptions};
use lockcell_tests::certs::{token_sha256, Authority, Pems};
use lockcell_tests::{bins, eventually, EtcdCluster, ProxyOptions, ProxyProcess};

use crate::support::short_session;

/// The `dev` identity's bearer token (tokens under 32 characters are never taken).
const DEV_TOKEN: &str = "dev-token-0123456789abcdef0123456789";

fn grants_file(billing_locks: &str) -> String {
    format!(
        r#"
[[grant]]
identity = "billing"
lock = [{billing_locks}]
read = ["billing/", "config/"]
write = ["billing/"]
watch = ["config/"]

[[grant]]
identity = "dev"
lock = ["dev/"]

[[token]]
identity = "dev"
sha256 = "{}"
"#,
        token_sha256(DEV_TOKEN)
    )
}

async fn mtls_client(proxy: &ProxyProcess, ca: &Path, me: Option<&Pems>) -> Result<Client, Error> {
    let identity_pem = me.map(|p| {
        (
            std::fs::read(&p.cert).unwrap(),
            std::fs::read(&p.key).unwrap(),
        )
    });
    let options = ClientOptions::new([proxy.addr.clone()]).tls(ClientTls {
        ca_pem: std::fs::read(ca).unwrap(),
        identity_pem,
        domain: Some("localhost".into()),
    });
    Client::connect_with(options).await
}

fn denied(result: Result<impl std::fmt::Debug, Error>, what: &str) -> anyhow::Result<String> {
    match result {
        Err(Error::PermissionDenied(message)) => Ok(message),
        other => anyhow::bail!("{what} was not refused by the grants: {other:?}"),
    }
}

pub async fn prefix_grants_refuse_what_they_should_and_allow_what_they_should() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let ca = Authority::new(&dir.path().join("certs"))?;
    let server = ca.server("proxy")?;
    let billing = ca.client("billing")?;
    let stranger = ca.client("stranger")?;
    let grants = dir.path().join("grants.toml");
    std::fs::write(&grants, grants_file(r#""billing/""#))?;

    // A proxy that requires client certificates.
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec![
        "--grants".into(),
        grants.display().to_string(),
        "--tls-cert".into(),
        server.cert.display().to_string(),
        "--tls-key".into(),
        server.key.display().to_string(),
        "--tls-client-ca".into(),
        ca.ca.display().to_string(),
    ];
    let proxy = ProxyProcess::start(&options, dir.path()).await?;

    let client = mtls_client(&proxy, &ca.ca, Some(&billing))
        .await
        .map_err(|e| anyhow::anyhow!("{e}\n{}", proxy.process.log_tail(20)))?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let guard = session
        .acquire("billing/nightly", Wait::Try)
        .await?
        .context("a granted prefix's free lock was not granted")?;
    guard.release().await?;
    let message = denied(
        session.acquire("payroll/nightly", Wait::Try).await,
        "a lock outside the grants",
    )?;
    ensure!(
        message.contains("\"billing\"")
            && message.contains("lock")
            && message.contains("payroll/nightly"),
        "the refusal does not name the identity, the right and the lock: {message}"
    );
    client.put("billing/rate", b"5", Condition::Always).await?;
    denied(
        client.put("config/flag", b"on", Condition::Always).await,
        "a write to a read-only prefix",
    )?;
    ensure!(
        client.get("config/flag").await?.is_none(),
        "a refused write left a key"
    );
    client.get("config/flag").await?;
    // An allowed watch runs (no events: nobody may write config/ here); a refused one
    // ends with the refusal.
    let mut watcher = client.watch("config/", WatchOptions::prefix()).await?;
    if let Ok(Some(Err(e))) = tokio::time::timeout(Duration::from_millis(500), watcher.next()).await
    {
        anyhow::bail!("a watch the grants allow ended: {e}");
    }
    let refused = async {
        let mut watcher = client.watch("billing/", WatchOptions::prefix()).await?;
        watcher.next().await.transpose().map(drop)
    };
    denied(refused.await, "a watch outside the watch grants")?;

    // Another identity, and no identity at all.
    let other = mtls_client(&proxy, &ca.ca, Some(&stranger)).await?;
    denied(
        other.get("billing/rate").await,
        "a read by an identity with no grant",
    )?;
    // Session ids are not secret (Leader shows them): another identity that knows one
    // cannot use it, nor renew or close it.
    let stranger_channel =
        tonic::transport::Channel::from_shared(format!("https://{}", proxy.addr))?
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(
                        &ca.ca,
                    )?))
                    .identity(tonic::transport::Identity::from_pem(
                        std::fs::read(&stranger.cert)?,
                        std::fs::read(&stranger.key)?,
                    ))
                    .domain_name("localhost"),
            )?
            .connect()
            .await?;
    let closed = lockcell_proto::v1::session_client::SessionClient::new(stranger_channel)
        .close(lockcell_proto::v1::CloseRequest {
            session_id: session.id().to_owned(),
            session_secret: session.secret().to_owned(),
            incarnation: 0,
            cells: Vec::new(),
        })
        .await;
    ensure!(
        matches!(&closed, Err(s) if s.code() == tonic::Code::PermissionDenied),
        "another identity closed billing's session: {closed:?}"
    );
    ensure!(
        session.state() == lockcell_client::SessionState::Valid,
        "billing's session ended after a stranger's close"
    );
    ensure!(
        mtls_client(&proxy, &ca.ca, None).await.is_err()
            || mtls_client(&proxy, &ca.ca, None)
                .await?
                .open_session(short_session(Duration::from_secs(5)))
                .await
                .is_err(),
        "a client without a certificate was served by a proxy that requires one"
    );

    // The file changes: the proxy follows it.
    std::fs::write(&grants, grants_file(r#""billing/", "payroll/""#))?;
    let newly_allowed = eventually(
        "the new grants are in force",
        Duration::from_secs(15),
        || async {
            Ok(session
                .acquire("payroll/nightly", Wait::Try)
                .await
                .ok()
                .flatten())
        },
    )
    .await?;
    newly_allowed.release().await?;
    // A bad file is refused and the last good one stays.
    std::fs::write(&grants, "[[grant]]\nidentity = \"billing\"\nlok = []\n")?;
    proxy_logs_refusal(&proxy).await?;
    ensure!(
        session.acquire("billing/other", Wait::Try).await?.is_some(),
        "a bad grants file changed what is allowed"
    );
    session.close().await?;

    // Tokens: a proxy over plain TLS (no client certificates) with the same grants.
    let mut options = ProxyOptions::new("b", etcd.endpoints());
    std::fs::write(&grants, grants_file(r#""billing/""#))?;
    options.extra_args = vec![
        "--grants".into(),
        grants.display().to_string(),
        "--grants-without-tls".into(),
    ];
    let plain = ProxyProcess::start(&options, dir.path()).await?;
    let dev =
        Client::connect_with(ClientOptions::new([plain.addr.clone()]).token(DEV_TOKEN)).await?;
    let session = dev
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    ensure!(
        session.acquire("dev/x", Wait::Try).await?.is_some(),
        "the token's grant was not honoured"
    );
    denied(
        session.acquire("billing/x", Wait::Try).await,
        "a lock outside the token's grants",
    )?;
    let anonymous = Client::connect(&plain.addr).await?;
    match anonymous
        .open_session(short_session(Duration::from_secs(5)))
        .await
    {
        Err(Error::Unauthenticated(_)) => {}
        other => anyhow::bail!("a caller without identity opened a session: {other:?}"),
    }
    let wrong =
        Client::connect_with(ClientOptions::new([plain.addr.clone()]).token("guess")).await?;
    ensure!(
        matches!(wrong.get("dev/x").await, Err(Error::Unauthenticated(_))),
        "a wrong token was taken"
    );

    // lockctl over mutual TLS: allowed and refused, with its exit status.
    let lockctl = |args: &[&str]| {
        std::process::Command::new(bins::workspace_bin("lockctl").expect("lockctl built"))
            .args(["--proxy", &proxy.addr, "--tls-ca"])
            .arg(&ca.ca)
            .arg("--tls-cert")
            .arg(&billing.cert)
            .arg("--tls-key")
            .arg(&billing.key)
            .args(["--tls-domain", "localhost"])
            .args(args)
            .output()
    };
    let read = lockctl(&["get", "billing/rate"])?;
    ensure!(
        read.status.success() && String::from_utf8_lossy(&read.stdout).contains('5'),
        "lockctl get over mTLS: {read:?}"
    );
    let refused = lockctl(&["put", "config/flag", "on"])?;
    ensure!(
        refused.status.code() == Some(77)
            && String::from_utf8_lossy(&refused.stderr).contains("may not write"),
        "lockctl put outside the grants: {refused:?}"
    );
    Ok(())
}

async fn proxy_logs_refusal(proxy: &ProxyProcess) -> anyhow::Result<()> {
    eventually(
        "the proxy refuses the bad grants file",
        Duration::from_secs(15),
        || async {
            let log = std::fs::read_to_string(proxy.log_path())?;
            Ok(log.contains("prefix grants file refused").then_some(()))
        },
    )
    .await
}

/// etcd serving only TLS and asking for client certificates: the proxy and
/// lockcell-cell reach it with --etcd-tls-*, and a connection without a certificate is
/// refused.
pub async fn a_proxy_reaches_etcd_over_mutual_tls() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ca = Authority::new(&dir.path().join("certs"))?;
    let server = ca.server("etcd")?;
    let proxy_cert = ca.client("lockcell-proxy")?;
    let (client_port, peer_port) = lockcell_tests::etcd::reserve_ports(1)[0];
    let endpoint = format!("127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let mut etcd_cmd = std::process::Command::new(bins::on_path("etcd").context("no etcd")?);
    etcd_cmd
        .args(["--name", "a", "--data-dir"])
        .arg(dir.path().join("etcd-a"))
        .args(["--listen-client-urls", &format!("https://{endpoint}")])
        .args(["--advertise-client-urls", &format!("https://{endpoint}")])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args(["--initial-cluster", &format!("a={peer}")])
        .arg("--cert-file")
        .arg(&server.cert)
        .arg("--key-file")
        .arg(&server.key)
        .arg("--trusted-ca-file")
        .arg(&ca.ca)
        .args(["--client-cert-auth", "--log-level", "warn"]);
    let _etcd = lockcell_tests::process::Managed::spawn(
        "etcd a (TLS)",
        etcd_cmd,
        &dir.path().join("etcd-a.log"),
    )?;
    let tls_args = |cert: bool| {
        let mut args = vec!["--etcd-tls-ca".to_owned(), ca.ca.display().to_string()];
        if cert {
            args.extend([
                "--etcd-tls-cert".to_owned(),
                proxy_cert.cert.display().to_string(),
                "--etcd-tls-key".to_owned(),
                proxy_cert.key.display().to_string(),
            ]);
        }
        args
    };
    let cell = |args: Vec<String>| {
        std::process::Command::new(bins::workspace_bin("lockcell-cell").expect("built"))
            .args(args)
            .output()
    };
    eventually(
        "lockcell-cell init over TLS",
        Duration::from_secs(30),
        || async {
            let mut args = vec!["init".to_owned(), "--etcd".to_owned(), endpoint.clone()];
            args.extend(tls_args(true));
            let out = cell(args)?;
            Ok(out.status.success().then_some(()))
        },
    )
    .await?;
    // Without a client certificate etcd turns the connection away.
    let mut args = vec!["epoch".to_owned(), "--etcd".to_owned(), endpoint.clone()];
    args.extend(tls_args(false));
    let refused = cell(args)?;
    ensure!(
        !refused.status.success(),
        "etcd with --client-cert-auth served a connection without a certificate"
    );

    let mut options = ProxyOptions::new("a", vec![endpoint.clone()]);
    options.etcd_auth = None;
    options.extra_args = tls_args(true);
    let proxy = ProxyProcess::start(&options, dir.path()).await?;
    let client = Client::connect(&proxy.addr).await?;
    let session = client
        .open_session(short_session(Duration::from_secs(5)))
        .await?;
    let guard = session
        .acquire("tls/lock", Wait::Try)
        .await?
        .context("a free lock was not granted through a proxy on TLS etcd")?;
    guard.release().await?;
    client.put("tls/key", b"v", Condition::Always).await?;
    ensure!(
        client.get("tls/key").await?.is_some(),
        "a small key written through TLS etcd did not read back"
    );
    Ok(())
}
