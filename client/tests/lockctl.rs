//! `lockctl` as a user runs it, against the fake proxy: the environment CMD gets, exit
//! statuses, stopping CMD on jeopardy and on signals, and the help text.

mod fake;

use std::process::Stdio;

use fake::{start, Running, PATIENCE};
use lockcell_client::{Client, SessionOptions, Wait};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStderr, Command};
use tokio::time::timeout;

fn lockctl(proxy: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockctl"));
    cmd.arg("--proxy")
        .arg(proxy)
        .args(args)
        .env_remove("LOCKCELL_PROXY")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Runs lockctl to the end: (exit code, stdout, stderr).
async fn run(proxy: &str, args: &[&str]) -> (i32, String, String) {
    let out = timeout(PATIENCE, lockctl(proxy, args).output())
        .await
        .expect("lockctl ended")
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (
        out.status.code().expect("exited"),
        text(out.stdout),
        text(out.stderr),
    )
}

/// Starts lockctl with a long-running CMD and waits until it says it holds the lock.
async fn start_holding(proxy: &Running, lock: &str) -> (Child, BufReader<ChildStderr>) {
    let mut child = lockctl(
        &proxy.addr,
        &["--ttl", "1s", "lock", lock, "--", "sleep", "30"],
    )
    .spawn()
    .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    timeout(PATIENCE, async {
        while !line.contains("holding") {
            line.clear();
            assert_ne!(
                stderr.read_line(&mut line).await.unwrap(),
                0,
                "lockctl ended early"
            );
        }
    })
    .await
    .expect("lockctl holds the lock");
    (child, stderr)
}

/// Waits for lockctl to end: (exit code, rest of stderr).
async fn finish(mut child: Child, mut stderr: BufReader<ChildStderr>) -> (i32, String) {
    let mut rest = String::new();
    timeout(PATIENCE, stderr.read_to_string(&mut rest))
        .await
        .expect("stderr closed")
        .unwrap();
    let status = timeout(PATIENCE, child.wait())
        .await
        .expect("lockctl ended")
        .unwrap();
    (status.code().expect("exited"), rest)
}

#[tokio::test]
async fn cmd_runs_with_the_lock_in_its_environment_and_its_status_is_returned() {
    let proxy = start(2_000).await;
    let script = r#"echo "$LOCKCELL_LOCK $LOCKCELL_TOKEN"; exit 3"#;
    let (code, stdout, stderr) =
        run(&proxy.addr, &["lock", "jobs/x", "--", "sh", "-c", script]).await;
    assert_eq!(code, 3, "{stderr}");
    assert_eq!(stdout, "jobs/x 1:100\n");
    assert!(
        stderr.contains("lockctl: holding jobs/x with token 1:100"),
        "{stderr}"
    );
    assert_eq!(proxy.fake.released.borrow().as_slice(), ["jobs/x"]);
    assert_eq!(proxy.fake.closed.borrow().len(), 1);
}

#[tokio::test]
async fn a_refused_lock_name_exits_64_with_the_proxys_message() {
    let proxy = start(2_000).await;
    let (code, _, stderr) = run(&proxy.addr, &["lock", "bad name", "--", "true"]).await;
    assert_eq!(code, 64, "{stderr}");
    assert!(
        stderr.contains(r#"lock name "bad name" is not allowed"#),
        "{stderr}"
    );
}

#[tokio::test]
async fn an_unreachable_proxy_exits_69_naming_it() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let (code, _, stderr) = run(&addr, &["lock", "jobs/x", "--", "true"]).await;
    assert_eq!(code, 69, "{stderr}");
    assert!(stderr.contains(&addr), "{stderr}");
}

#[tokio::test]
async fn a_lock_still_held_after_the_timeout_exits_75() {
    let proxy = start(5_000).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let other = client
        .open_session(SessionOptions::default())
        .await
        .unwrap();
    let _held = other
        .acquire("jobs/x", Wait::Try)
        .await
        .unwrap()
        .expect("granted");
    let (code, _, stderr) = run(
        &proxy.addr,
        &["lock", "jobs/x", "--timeout", "200ms", "--", "true"],
    )
    .await;
    assert_eq!(code, 75, "{stderr}");
    assert!(
        stderr.contains("lockctl: lock jobs/x still held after 200ms"),
        "{stderr}"
    );
}

#[tokio::test]
async fn jeopardy_stops_cmd_with_sigterm() {
    let proxy = start(1_000).await;
    let (child, stderr) = start_holding(&proxy, "jobs/x").await;
    let holder = proxy.fake.locks.lock().unwrap()["jobs/x"].0.clone();
    proxy.fake.killed.lock().unwrap().push(holder);
    let (code, rest) = finish(child, stderr).await;
    assert_eq!(code, 128 + 15, "{rest}");
    assert!(
        rest.contains(
            "lockctl: session past its deadline; stopping CMD \
             (lock jobs/x may pass to another holder)"
        ),
        "{rest}"
    );
}

#[tokio::test]
async fn sigterm_is_forwarded_and_the_lock_released() {
    let proxy = start(1_000).await;
    let (child, stderr) = start_holding(&proxy, "jobs/x").await;
    let pid = Pid::from_raw(child.id().unwrap() as i32);
    kill(pid, Signal::SIGTERM).unwrap();
    let (code, rest) = finish(child, stderr).await;
    assert_eq!(code, 128 + 15, "{rest}");
    assert_eq!(proxy.fake.released.borrow().as_slice(), ["jobs/x"]);
    assert_eq!(proxy.fake.closed.borrow().len(), 1);
}

#[tokio::test]
async fn help_explains_every_flag() {
    let proxy = "127.0.0.1:1";
    let (code, top, _) = run(proxy, &["--help"]).await;
    assert_eq!(code, 0);
    for needle in [
        "--proxy",
        "LOCKCELL_PROXY",
        "--ttl",
        "--identity",
        "Example",
    ] {
        assert!(
            top.contains(needle),
            "lockctl --help lacks {needle}:\n{top}"
        );
    }
    let (code, lock, _) = run(proxy, &["lock", "--help"]).await;
    assert_eq!(code, 0);
    for needle in ["--timeout", "LOCKCELL_TOKEN", "SIGTERM", "75", "Example"] {
        assert!(
            lock.contains(needle),
            "lockctl lock --help lacks {needle}:\n{lock}"
        );
    }
}
