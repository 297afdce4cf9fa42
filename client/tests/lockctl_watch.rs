//! `lockctl watch`, `members` and `announce` as a user runs them, against the fake
//! proxy: the lines they print, resuming after a cut-off, compaction, joining and
//! leaving a group, CMD's status, a lost session, and the help text.

mod cli;
mod fake;

use cli::{assert_help, lockctl, run};
use fake::{start, Running, WatchFault, PATIENCE};
use lockcell_client::{Client, Session, SessionOptions};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdout};
use tokio::time::timeout;
use tonic::Code;

/// A running lockctl and its output.
struct Lockctl {
    child: Child,
    stdout: BufReader<ChildStdout>,
    stderr: BufReader<ChildStderr>,
}

/// Starts lockctl and waits until its stderr says `needle`.
async fn start_until(proxy: &Running, args: &[&str], needle: &str) -> Lockctl {
    let mut child = lockctl(&proxy.addr, args).spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
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
    Lockctl {
        child,
        stdout,
        stderr,
    }
}

impl Lockctl {
    async fn line(&mut self) -> String {
        let mut line = String::new();
        timeout(PATIENCE, self.stdout.read_line(&mut line))
            .await
            .expect("a line")
            .unwrap();
        line
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id().unwrap() as i32), signal).unwrap();
    }

    /// Waits for lockctl to end: (exit code, rest of stderr).
    async fn finish(mut self) -> (i32, String) {
        let mut rest = String::new();
        timeout(PATIENCE, self.stderr.read_to_string(&mut rest))
            .await
            .expect("stderr closed")
            .unwrap();
        let status = timeout(PATIENCE, self.child.wait())
            .await
            .expect("lockctl ended")
            .unwrap();
        (status.code().expect("exited"), rest)
    }
}

async fn session(proxy: &Running) -> Session {
    let client = Client::connect(&proxy.addr).await.unwrap();
    client
        .open_session(SessionOptions::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn watch_prints_one_line_per_event_until_sigint() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    let mut watch = start_until(
        &proxy,
        &["watch", "--prefix", "cfg/", "--prev"],
        "watching prefix \"cfg/\" after revision 0",
    )
    .await;
    fake.put("cfg/a", "1");
    fake.put("elsewhere", "x");
    fake.put("cfg/a", "two words");
    fake.delete("cfg/a");
    assert_eq!(watch.line().await, "1 put cfg/a 1\n");
    assert_eq!(watch.line().await, "3 put cfg/a two words (was 1)\n");
    assert_eq!(watch.line().await, "4 delete cfg/a (was two words)\n");
    watch.signal(Signal::SIGINT);
    let (code, stderr) = watch.finish().await;
    assert_eq!(code, 0, "{stderr}");
}

#[tokio::test]
async fn watch_resumes_after_a_cut_off_and_from_a_revision() {
    let proxy = start(5_000).await;
    let fake = &proxy.fake;
    for value in ["1", "2", "3"] {
        fake.put("k", value);
    }
    fake.watch_plan
        .lock()
        .unwrap()
        .push_back(WatchFault::EndAfter {
            responses: 1,
            code: Code::ResourceExhausted,
        });
    let mut watch = start_until(&proxy, &["watch", "k", "--from", "2"], "watching").await;
    assert_eq!(watch.line().await, "2 put k 2\n");
    assert_eq!(watch.line().await, "3 put k 3\n");
    watch.signal(Signal::SIGTERM);
    let (code, stderr) = watch.finish().await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("cut it off; resuming from revision 3"),
        "{stderr}"
    );
    assert_eq!(*fake.watch_starts.borrow(), [2, 3]);
}

#[tokio::test]
async fn watch_exits_4_naming_the_compact_revision() {
    let proxy = start(5_000).await;
    for value in ["1", "2", "3", "4", "5"] {
        proxy.fake.put("k", value);
    }
    proxy
        .fake
        .compacted
        .store(4, std::sync::atomic::Ordering::Relaxed);
    let (code, stdout, stderr) = run(&proxy.addr, &["watch", "k", "--from", "2"]).await;
    assert_eq!(code, 4, "{stderr}");
    assert_eq!(stdout, "");
    assert!(
        stderr.contains("from revision 2") && stderr.contains("before 4"),
        "{stderr}"
    );
}

#[tokio::test]
async fn members_lists_and_follows_the_group() {
    let proxy = start(5_000).await;
    let a = session(&proxy).await;
    let b = session(&proxy).await;
    a.announce("web", "a", b"10.0.0.1:80").await.unwrap();
    b.announce("web", "b", &[0xff, 0x00]).await.unwrap();
    let (code, stdout, stderr) = run(&proxy.addr, &["members", "web"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "a 10.0.0.1:80\nb 0xff00\n");

    let mut follow = start_until(
        &proxy,
        &["members", "web", "--watch"],
        "following group web",
    )
    .await;
    assert_eq!(follow.line().await, "+ a 10.0.0.1:80\n");
    assert_eq!(follow.line().await, "+ b 0xff00\n");
    b.announce("web", "b", b"10.0.0.2:80").await.unwrap();
    assert_eq!(follow.line().await, "~ b 10.0.0.2:80\n");
    b.close().await.unwrap();
    assert_eq!(follow.line().await, "- b\n");
    let c = session(&proxy).await;
    c.announce("web", "c", b"10.0.0.3:80").await.unwrap();
    assert_eq!(follow.line().await, "+ c 10.0.0.3:80\n");
    follow.signal(Signal::SIGINT);
    let (code, stderr) = follow.finish().await;
    assert_eq!(code, 0, "{stderr}");
}

/// The members of `group` as the fake holds them.
fn members_of(proxy: &Running, group: &str) -> Vec<String> {
    let prefix = format!("members/{group}/");
    proxy
        .fake
        .store
        .borrow()
        .keys
        .keys()
        .filter_map(|k| k.strip_prefix(&prefix).map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn announce_stays_a_member_until_sigterm_and_leaves_at_once() {
    let proxy = start(5_000).await;
    let announce = start_until(
        &proxy,
        &["announce", "web", "host-a", "10.0.0.7:8080"],
        "announced host-a in group web",
    )
    .await;
    assert_eq!(members_of(&proxy, "web"), ["host-a"]);
    let key = proxy.fake.store.borrow().keys["members/web/host-a"].clone();
    assert_eq!(
        (key.value.as_slice(), key.lease != 0),
        (&b"10.0.0.7:8080"[..], true)
    );
    announce.signal(Signal::SIGTERM);
    let (code, stderr) = announce.finish().await;
    assert_eq!(code, 0, "{stderr}");
    assert!(members_of(&proxy, "web").is_empty(), "left at once");
    assert_eq!(proxy.fake.closed.borrow().len(), 1);
}

#[tokio::test]
async fn announce_runs_cmd_while_a_member_and_passes_on_its_status() {
    let proxy = start(5_000).await;
    let script = r#"echo "$LOCKCELL_GROUP $LOCKCELL_MEMBER $LOCKCELL_MEMBER_VALUE"; exit 3"#;
    let (code, stdout, stderr) = run(
        &proxy.addr,
        &["announce", "web", "a", "v1", "--", "sh", "-c", script],
    )
    .await;
    assert_eq!(code, 3, "{stderr}");
    assert_eq!(stdout, "web a v1\n");
    assert!(members_of(&proxy, "web").is_empty(), "left when CMD ended");
    assert_eq!(proxy.fake.closed.borrow().len(), 1);
}

#[tokio::test]
async fn announce_refuses_a_member_name_with_a_slash() {
    let proxy = start(5_000).await;
    let (code, _, stderr) = run(&proxy.addr, &["announce", "web", "a/b", "v"]).await;
    assert_eq!(code, 64, "{stderr}");
    assert!(stderr.contains("contains '/'"), "{stderr}");
}

#[tokio::test]
async fn announce_kills_cmd_and_exits_90_when_the_session_is_lost() {
    let proxy = start(600).await;
    let announce = start_until(
        &proxy,
        &[
            "--ttl", "600ms", "announce", "web", "a", "v", "--", "sleep", "30",
        ],
        "announced",
    )
    .await;
    // lockctl's session is the fake's first.
    proxy.fake.kill("s0");
    let (code, stderr) = announce.finish().await;
    assert_eq!(code, 90, "{stderr}");
    assert!(
        stderr.contains("the proxy ended the session (member a may leave group web)")
            && stderr.contains("(SIGKILL)"),
        "{stderr}"
    );
    assert!(stderr.contains("killed by the test"), "{stderr}");
}

#[tokio::test]
async fn help_explains_the_membership_and_watch_commands() {
    let proxy = "127.0.0.1:1";
    let (code, top, _) = run(proxy, &["--help"]).await;
    assert_eq!(code, 0);
    for needle in ["watch", "members", "announce"] {
        assert!(
            top.contains(needle),
            "lockctl --help lacks {needle}:\n{top}"
        );
    }
    let expected: [(&str, &[&str]); 3] = [
        (
            "watch",
            &[
                "--prefix",
                "--from",
                "--prev",
                "--all",
                "REVISION put KEY VALUE",
                "REVISION delete KEY",
                "hex",
                "compacted",
                "Example",
            ],
        ),
        (
            "members",
            &[
                "--watch",
                "+ MEMBER VALUE",
                "~ MEMBER VALUE",
                "- MEMBER",
                "Example",
            ],
        ),
        (
            "announce",
            &[
                "--ttl",
                "CMD",
                "LOCKCELL_MEMBER",
                "SIGTERM",
                "75",
                "Example",
            ],
        ),
    ];
    assert_help(proxy, &expected).await;
}
