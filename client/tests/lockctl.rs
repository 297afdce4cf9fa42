//! `lockctl` as a user runs it, against the fake proxy: the environment CMD gets, exit
//! statuses, stopping CMD when the session ends and on signals, elections, leader queries,
//! sequencer checks, and the help text.

mod cli;
mod fake;

use cli::{assert_help, lockctl, run};
use fake::{start, Cut, Running, PATIENCE};
use lockcell_client::{Client, Session, SessionOptions, Wait};
use lockcell_proto::v1::LockMode;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStderr};
use tokio::time::timeout;

/// Starts lockctl with a long-running CMD and waits until it says it holds the lock.
async fn start_holding(proxy: &Running, lock: &str) -> (Child, BufReader<ChildStderr>) {
    start_until(
        proxy,
        &["--ttl", "1s", "lock", lock, "--", "sleep", "30"],
        "holding",
    )
    .await
}

/// Starts lockctl and waits until its stderr says `needle`.
async fn start_until(
    proxy: &Running,
    args: &[&str],
    needle: &str,
) -> (Child, BufReader<ChildStderr>) {
    let mut child = lockctl(&proxy.addr, args).spawn().unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    timeout(PATIENCE, async {
        while !line.contains(needle) {
            line.clear();
            assert_ne!(
                stderr.read_line(&mut line).await.unwrap(),
                0,
                "lockctl ended early"
            );
        }
    })
    .await
    .unwrap_or_else(|_| panic!("lockctl did not say {needle:?}"));
    (child, stderr)
}

/// A session of the test's own, through the SDK.
async fn session(proxy: &Running) -> Session {
    let client = Client::connect(&proxy.addr).await.unwrap();
    client
        .open_session(SessionOptions {
            identity: "test/1".into(),
            ..SessionOptions::default()
        })
        .await
        .unwrap()
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
async fn a_session_the_proxy_ended_gets_cmd_killed_at_once() {
    let proxy = start(1_000).await;
    let (child, stderr) = start_holding(&proxy, "jobs/x").await;
    let holder = proxy.fake.locks.lock().unwrap()["jobs/x"].0.clone();
    proxy.fake.killed.lock().unwrap().push(holder);
    let (code, rest) = finish(child, stderr).await;
    assert_eq!(code, 90, "{rest}");
    assert!(
        rest.contains(
            "lockctl: the proxy ended the session (lock jobs/x may pass to another \
             holder); killing CMD and everything it started (SIGKILL)"
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
async fn a_hangup_stops_cmd_and_ctrl_z_does_not_stop_lockctl() {
    let proxy = start(1_000).await;
    let (child, mut stderr) = start_holding(&proxy, "jobs/x").await;
    let pid = Pid::from_raw(child.id().unwrap() as i32);
    // Ctrl-Z: a stopped lockctl would renew nothing while CMD runs on; it says so and
    // goes on.
    kill(pid, Signal::SIGTSTP).unwrap();
    let mut line = String::new();
    timeout(PATIENCE, async {
        while !line.contains("ignoring SIGTSTP") {
            line.clear();
            assert_ne!(
                stderr.read_line(&mut line).await.unwrap(),
                0,
                "stderr closed"
            );
        }
    })
    .await
    .expect("lockctl did not say it ignores SIGTSTP");
    // The terminal closed: CMD is stopped and the lock released, as for SIGTERM.
    kill(pid, Signal::SIGHUP).unwrap();
    let (code, rest) = finish(child, stderr).await;
    assert_eq!(code, 128 + 1, "{rest}");
    assert!(rest.contains("lockctl: SIGHUP; stopping CMD"), "{rest}");
    assert_eq!(proxy.fake.released.borrow().as_slice(), ["jobs/x"]);
}

#[tokio::test]
async fn a_second_sigint_kills_a_command_that_ignores_the_first() {
    let proxy = start(5_000).await;
    let (child, mut stderr) = start_until(
        &proxy,
        &[
            "--ttl",
            "5s",
            "lock",
            "jobs/x",
            "--",
            "sh",
            "-c",
            "trap '' TERM; echo ignoring TERM >&2; sleep 30 & wait",
        ],
        // Not "holding": the first SIGINT must find the trap set.
        "ignoring TERM",
    )
    .await;
    let pid = Pid::from_raw(child.id().unwrap() as i32);
    kill(pid, Signal::SIGINT).unwrap();
    let mut line = String::new();
    timeout(PATIENCE, async {
        while !line.contains("SIGINT; stopping CMD") {
            line.clear();
            assert_ne!(
                stderr.read_line(&mut line).await.unwrap(),
                0,
                "stderr closed"
            );
        }
    })
    .await
    .expect("lockctl did not pass SIGINT on");
    // The command ignores SIGTERM; a second SIGINT kills it, and the lock is released.
    kill(pid, Signal::SIGINT).unwrap();
    let (code, rest) = finish(child, stderr).await;
    assert_eq!(code, 128 + 2, "{rest}");
    assert!(rest.contains("SIGINT again; killing CMD"), "{rest}");
    assert_eq!(proxy.fake.released.borrow().as_slice(), ["jobs/x"]);
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
    let expected: [(&str, &[&str]); 5] = [
        (
            "lock",
            &[
                "--timeout",
                "--try",
                "--shared",
                "LOCKCELL_TOKEN",
                "SIGTERM",
                "75",
                "Example",
            ],
        ),
        (
            "elect",
            &[
                "--timeout",
                "LOCKCELL_ELECTION",
                "LOCKCELL_TOKEN",
                "LOCKCELL_LEADER_VALUE",
                "SIGTERM",
                "75",
                "Example",
            ],
        ),
        (
            "leader",
            &["--json", "no leader", "3 nobody leads", "Example"],
        ),
        ("observe", &["--json", "Ctrl-C", "69", "Example"]),
        ("check", &["EPOCH:REVISION", "stale", "64", "Example"]),
    ];
    assert_help(proxy, &expected).await;
}

#[tokio::test]
async fn try_exits_75_at_once_when_the_lock_is_held() {
    let proxy = start(5_000).await;
    let other = session(&proxy).await;
    let _held = other.acquire("jobs/x", Wait::Try).await.unwrap().unwrap();
    let (code, _, stderr) = run(&proxy.addr, &["lock", "--try", "jobs/x", "--", "true"]).await;
    assert_eq!(code, 75, "{stderr}");
    assert!(stderr.contains("lockctl: lock jobs/x is held"), "{stderr}");
}

#[tokio::test]
async fn shared_runs_alongside_another_shared_holder_and_releases_shared() {
    let proxy = start(5_000).await;
    let other = session(&proxy).await;
    let _reader = other
        .acquire_shared("cfg", Wait::Try)
        .await
        .unwrap()
        .unwrap();
    let script = r#"echo "$LOCKCELL_LOCK $LOCKCELL_TOKEN""#;
    let (code, stdout, stderr) = run(
        &proxy.addr,
        &["lock", "--shared", "--try", "cfg", "--", "sh", "-c", script],
    )
    .await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "cfg 1:101\n");
    assert!(
        stderr.contains("holding cfg shared with token 1:101"),
        "{stderr}"
    );
    assert_eq!(
        proxy.fake.release_modes.lock().unwrap().as_slice(),
        [LockMode::Shared]
    );
}

#[tokio::test]
async fn elect_runs_cmd_as_leader_and_resigns_after() {
    let proxy = start(2_000).await;
    let script = r#"echo "$LOCKCELL_ELECTION $LOCKCELL_TOKEN $LOCKCELL_LEADER_VALUE"; exit 4"#;
    let (code, stdout, stderr) = run(
        &proxy.addr,
        &[
            "elect",
            "db/primary",
            "10.0.0.7:5432",
            "--",
            "sh",
            "-c",
            script,
        ],
    )
    .await;
    assert_eq!(code, 4, "{stderr}");
    assert_eq!(stdout, "db/primary 1:100 10.0.0.7:5432\n");
    assert!(
        stderr.contains("lockctl: leading db/primary as \"10.0.0.7:5432\" with token 1:100"),
        "{stderr}"
    );
    assert_eq!(proxy.fake.resigned.borrow().as_slice(), ["db/primary"]);
    assert_eq!(proxy.fake.closed.borrow().len(), 1);
}

#[tokio::test]
async fn elect_exits_75_when_another_session_still_leads() {
    let proxy = start(5_000).await;
    let other = session(&proxy).await;
    let _lead = other
        .campaign("db", "them", Wait::Try)
        .await
        .unwrap()
        .unwrap();
    let (code, _, stderr) = run(
        &proxy.addr,
        &["elect", "db", "us", "--timeout", "200ms", "--", "true"],
    )
    .await;
    assert_eq!(code, 75, "{stderr}");
    assert!(
        stderr.contains("lockctl: election db still led by another session after 200ms"),
        "{stderr}"
    );
}

#[tokio::test]
async fn elect_gets_cmd_killed_when_the_proxy_ends_the_session() {
    let proxy = start(1_000).await;
    let (child, stderr) = start_until(
        &proxy,
        &["--ttl", "1s", "elect", "db", "v", "--", "sleep", "30"],
        "leading",
    )
    .await;
    let leader = proxy.fake.leaders.borrow()["db"].session_id.clone();
    proxy.fake.killed.lock().unwrap().push(leader);
    let (code, rest) = finish(child, stderr).await;
    assert_eq!(code, 90, "{rest}");
    assert!(
        rest.contains(
            "lockctl: the proxy ended the session (leadership of db may pass to another \
             session); killing CMD and everything it started (SIGKILL)"
        ),
        "{rest}"
    );
}

#[tokio::test]
async fn leader_prints_the_leader_or_exits_3() {
    let proxy = start(5_000).await;
    let (code, stdout, stderr) = run(&proxy.addr, &["leader", "db"]).await;
    assert_eq!((code, stdout.as_str()), (3, "no leader\n"), "{stderr}");
    let (code, stdout, _) = run(&proxy.addr, &["leader", "--json", "db"]).await;
    assert_eq!(
        (code, stdout.as_str()),
        (3, "{\"election\":\"db\",\"leader\":null}\n")
    );

    let other = session(&proxy).await;
    let _lead = other
        .campaign("db", "10.0.0.7:5432", Wait::Try)
        .await
        .unwrap()
        .unwrap();
    let id = other.id();
    let (code, stdout, stderr) = run(&proxy.addr, &["leader", "db"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stdout,
        format!("value=10.0.0.7:5432 token=1:100 session={id} identity=test/1 proxy=fake\n")
    );
    let (code, stdout, _) = run(&proxy.addr, &["leader", "--json", "db"]).await;
    assert_eq!(code, 0);
    assert_eq!(
        stdout,
        format!(
            "{{\"election\":\"db\",\"leader\":{{\"value\":\"10.0.0.7:5432\",\"token\":\"1:100\",\
             \"session_id\":\"{id}\",\"identity\":\"test/1\",\"proxy_id\":\"fake\"}}}}\n"
        )
    );
}

#[tokio::test]
async fn check_tells_current_from_stale_tokens() {
    let proxy = start(5_000).await;
    let (code, stdout, _) = run(&proxy.addr, &["check", "jobs/x", "1:100"]).await;
    assert_eq!((code, stdout.as_str()), (1, "stale (not held)\n"));
    let other = session(&proxy).await;
    let _held = other.acquire("jobs/x", Wait::Try).await.unwrap().unwrap();
    let (code, stdout, _) = run(&proxy.addr, &["check", "jobs/x", "1:100"]).await;
    assert_eq!((code, stdout.as_str()), (0, "current\n"));
    let (code, stdout, _) = run(&proxy.addr, &["check", "jobs/x", "1:99"]).await;
    assert_eq!(
        (code, stdout.as_str()),
        (1, "stale (current holder: 1:100)\n")
    );
    let (code, stdout, stderr) = run(&proxy.addr, &["check", "jobs/x", "1-100"]).await;
    assert_eq!((code, stdout.as_str()), (64, ""));
    assert!(
        stderr.contains("\"1-100\" is not of the form EPOCH:REVISION"),
        "{stderr}"
    );
}

/// Reads the next line lockctl writes to stdout.
async fn read_line(stdout: &mut BufReader<tokio::process::ChildStdout>) -> String {
    let mut line = String::new();
    timeout(PATIENCE, stdout.read_line(&mut line))
        .await
        .expect("a line")
        .unwrap();
    line
}

#[tokio::test]
async fn observe_prints_every_change_until_ctrl_c() {
    let proxy = start(5_000).await;
    let mut child = lockctl(&proxy.addr, &["observe", "db"]).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    assert_eq!(read_line(&mut stdout).await, "no leader\n");

    let other = session(&proxy).await;
    let lead = other
        .campaign("db", "v1", Wait::Try)
        .await
        .unwrap()
        .unwrap();
    assert!(read_line(&mut stdout)
        .await
        .starts_with("value=v1 token=1:100 "));
    lead.proclaim("v2").await.unwrap();
    assert!(read_line(&mut stdout)
        .await
        .starts_with("value=v2 token=1:100 "));
    assert!(lead.resign().await.unwrap());
    assert_eq!(read_line(&mut stdout).await, "no leader\n");

    kill(Pid::from_raw(child.id().unwrap() as i32), Signal::SIGINT).unwrap();
    let status = timeout(PATIENCE, child.wait())
        .await
        .expect("ended")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn observe_goes_on_after_the_stream_breaks() {
    let proxy = start(5_000).await;
    let mut child = lockctl(&proxy.addr, &["observe", "--json", "db"])
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    assert_eq!(
        read_line(&mut stdout).await,
        "{\"election\":\"db\",\"leader\":null}\n"
    );
    proxy.fake.cut_observers_once(Cut::WithError).await;
    let client = Client::connect(&proxy.addr).await.unwrap();
    let session = client
        .open_session(SessionOptions {
            ttl: std::time::Duration::from_secs(5),
            identity: "a/1".into(),
        })
        .await
        .unwrap();
    let _lead = session
        .campaign("db", "after-the-break", Wait::Try)
        .await
        .unwrap()
        .expect("elected");
    let line = read_line(&mut stdout).await;
    assert!(line.contains("after-the-break"), "{line}");
    assert!(
        child.try_wait().unwrap().is_none(),
        "lockctl observe goes on"
    );
    child.kill().await.unwrap();
}
