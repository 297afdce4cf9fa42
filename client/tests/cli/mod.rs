//! Running `lockctl` as a user would, for the CLI tests.

use std::process::Stdio;

use tokio::process::Command;
use tokio::time::timeout;

use crate::fake::PATIENCE;

pub fn lockctl(proxy: &str, args: &[&str]) -> Command {
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
pub async fn run(proxy: &str, args: &[&str]) -> (i32, String, String) {
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

/// Checks that each command's `--help` mentions what it must.
pub async fn assert_help(proxy: &str, expected: &[(&str, &[&str])]) {
    for (command, needles) in expected {
        let (code, help, _) = run(proxy, &[command, "--help"]).await;
        assert_eq!(code, 0);
        for needle in *needles {
            assert!(
                help.contains(needle),
                "lockctl {command} --help lacks {needle}:\n{help}"
            );
        }
    }
}
