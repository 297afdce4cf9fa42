//! Bad input gets the error that names the rule, and writes nothing.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_proto::v1::{
    AcquireRequest, CloseRequest, KeepAliveRequest, OpenRequest, OpenResponse, ReleaseRequest,
    SessionState,
};
use lockcell_tests::eventually;
use tonic::Code;

use crate::support::{cell, raw};

pub async fn bad_lock_names_are_refused_with_the_rule() -> anyhow::Result<()> {
    let (etcd, proxies) = cell(&["a"]).await?;
    let (mut sessions, mut locks) = raw(&proxies[0]).await?;
    let session = sessions
        .open(OpenRequest {
            ttl_ms: 10_000,
            identity: "bad input".into(),
        })
        .await?
        .into_inner();
    let long = "n".repeat(513);
    let cases: [(&str, &str); 8] = [
        ("", "empty"),
        (&long, "over the limit of 512 bytes"),
        ("a/../b", "'..'"),
        ("..", "'..'"),
        ("a//b", "empty segment"),
        ("/etc/passwd", "empty segment"),
        ("a\u{7}b", "control character"),
        ("a/!x", "reserved"),
    ];
    let before = etcd.revision().await?;
    for (name, rule) in cases {
        let status = locks
            .acquire(AcquireRequest {
                session_id: session.session_id.clone(),
                session_secret: session.session_secret.clone(),
                lock: name.to_owned(),
                wait_timeout_ms: Some(0),
                ..Default::default()
            })
            .await
            .expect_err("a bad name was accepted");
        ensure!(
            status.code() == Code::InvalidArgument,
            "{name:?}: {:?}, not InvalidArgument",
            status.code()
        );
        ensure!(
            status.message().contains(rule),
            "{name:?}: message {:?} does not name the rule ({rule})",
            status.message()
        );
    }
    let status = locks
        .release(ReleaseRequest {
            session_id: session.session_id.clone(),
            session_secret: session.session_secret.clone(),
            lock: "fine".into(),
            token: None,
            ..Default::default()
        })
        .await
        .expect_err("a release without a token was accepted");
    ensure!(
        status.code() == Code::InvalidArgument && status.message().contains("token"),
        "{status:?}"
    );
    ensure!(
        etcd.revision().await? == before,
        "refused calls wrote to etcd"
    );
    Ok(())
}

pub async fn unknown_and_expired_sessions_are_told_apart() -> anyhow::Result<()> {
    let (_etcd, proxies) = cell(&["a"]).await?;
    let (mut sessions, mut locks) = raw(&proxies[0]).await?;
    // One call, asked again until the session is gone (a new call of a session that
    // holds the lock would be refused as a second hold).
    let acquire = |session: &OpenResponse| AcquireRequest {
        session_id: session.session_id.clone(),
        session_secret: session.session_secret.clone(),
        lock: "x".into(),
        wait_timeout_ms: Some(0),
        call_id: "poll".into(),
        ..Default::default()
    };
    // Unknown: its credential holds, but the proxy has no such session (closed).
    let closed = sessions
        .open(OpenRequest {
            ttl_ms: 5_000,
            identity: "closed".into(),
        })
        .await?
        .into_inner();
    sessions
        .close(CloseRequest {
            session_id: closed.session_id.clone(),
            session_secret: closed.session_secret.clone(),
            ..Default::default()
        })
        .await?;
    let status = locks
        .acquire(acquire(&closed))
        .await
        .expect_err("unknown session accepted");
    ensure!(
        status.code() == Code::NotFound,
        "unknown session: {status:?}"
    );
    ensure!(status.message().contains("not known"), "{status:?}");

    let short = sessions
        .open(OpenRequest {
            ttl_ms: 500,
            identity: "short".into(),
        })
        .await?
        .into_inner();
    ensure!(
        short.ttl_ms == 500,
        "the proxy granted ttl {} for 500 ms",
        short.ttl_ms
    );
    let status = eventually(
        "the unrenewed session expires",
        Duration::from_secs(10),
        || {
            let mut locks = locks.clone();
            let request = acquire(&short);
            async move {
                match locks.acquire(request).await {
                    Ok(_) => Ok(None),
                    Err(status) => Ok(Some(status)),
                }
            }
        },
    )
    .await?;
    ensure!(
        status.code() == Code::FailedPrecondition,
        "expired session: {status:?}"
    );
    ensure!(status.message().contains("expired"), "{status:?}");

    let replies = sessions
        .keep_alive(tokio_stream::iter([
            KeepAliveRequest {
                session_id: short.session_id.clone(),
                session_secret: short.session_secret.clone(),
                seq: 7,
            },
            KeepAliveRequest {
                session_id: closed.session_id.clone(),
                session_secret: closed.session_secret.clone(),
                seq: 8,
            },
        ]))
        .await?
        .into_inner();
    let mut replies = replies;
    let expired = replies.message().await?.context("no reply")?;
    let unknown = replies.message().await?.context("no second reply")?;
    ensure!(
        expired.seq == 7 && expired.state == SessionState::Expired as i32,
        "{expired:?}"
    );
    ensure!(
        unknown.seq == 8 && unknown.state == SessionState::NotFound as i32,
        "{unknown:?}"
    );
    Ok(())
}
