//! `lockctl who`: who holds a lock, since when, and who waits for it.

use std::time::SystemTime;

use lockcell_client::{LockState, Mode};

use crate::print_line;
use crate::target::Target;

/// `lockctl who`'s status for a lock nobody holds.
pub(crate) const FREE: u8 = 1;

pub(crate) const WHO_LONG: &str = "\
Print who holds lock NAME, since when, and who waits for it.

One line per hold: its mode, its fencing token, the holder's identity and session, the
proxy that granted it (and its zone), and when (with how long ago). Then one line per
waiter in line, first first; only a fair class keeps its waiters in line in the store,
so a class that is not fair shows none. An election's holder is its leader, with its
value. \"free\" when nobody holds NAME.

For a lock that is not released: the holder's identity says which process to look at;
`lockcell-cell force-release NAME --token TOKEN --reason WHY` ends a stuck holder's
session as an operator (docs/operations.md, \"Inspecting and force-releasing a lock\").

Exit statuses: 0 held, 1 free, 64 NAME is not a lock name, 69 the proxy is
unreachable, 77 the proxy's grants give you neither the lock nor the read right on
NAME.

Example:
  lockctl who billing/nightly";

/// Arguments of `lockctl who`.
#[derive(Debug, clap::Args)]
pub(crate) struct WhoArgs {
    /// The lock or election, e.g. billing/nightly.
    pub(crate) name: String,
}

/// `lockctl who`.
pub(crate) async fn who(proxy: &Target, args: &WhoArgs) -> anyhow::Result<u8> {
    let client = proxy.connect().await?;
    let state = client.describe(&args.name).await?;
    for line in lines(&state, SystemTime::now()) {
        print_line(&line)?;
    }
    Ok(if state.holders.is_empty() { FREE } else { 0 })
}

fn lines(state: &LockState, now: SystemTime) -> Vec<String> {
    let mut out = Vec::new();
    if state.holders.is_empty() {
        out.push("free".to_owned());
    }
    for h in &state.holders {
        let ago = now
            .duration_since(h.acquired_at)
            .map(|d| std::time::Duration::from_secs(d.as_secs()))
            .unwrap_or_default();
        let mut line = format!(
            "held {} token={} identity={:?} session={} proxy={} zone={} since {} ({} ago)",
            mode(h.mode),
            h.token,
            h.identity,
            h.session_id,
            h.proxy_id,
            h.zone,
            humantime::format_rfc3339_millis(h.acquired_at),
            humantime::format_duration(ago)
        );
        if let Some(value) = &h.value {
            line.push_str(&format!(" leader value={value:?}"));
        }
        out.push(line);
    }
    for (place, w) in state.waiters.iter().enumerate() {
        out.push(format!(
            "waiting #{} {} session={} (in line since revision {})",
            place + 1,
            mode(w.mode),
            w.session_id,
            w.revision
        ));
    }
    out
}

fn mode(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "exclusive",
        Mode::Shared => "shared",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockcell_client::{FencingToken, LockHolder, LockWaiter};
    use std::time::Duration;

    #[test]
    fn holders_and_waiters_print_one_line_each() {
        let at = std::time::UNIX_EPOCH + Duration::from_secs(1_796_000_000);
        let state = LockState {
            holders: vec![LockHolder {
                mode: Mode::Exclusive,
                token: FencingToken {
                    epoch: 7,
                    revision: 42,
                },
                session_id: "s1".into(),
                identity: "host-7/4412".into(),
                proxy_id: "a-1".into(),
                zone: "a".into(),
                acquired_at: at,
                value: None,
            }],
            waiters: vec![LockWaiter {
                mode: Mode::Exclusive,
                session_id: "s2".into(),
                revision: 50,
            }],
            revision: 51,
        };
        let shown = lines(&state, at + Duration::from_secs(90));
        assert_eq!(
            shown,
            [
                "held exclusive token=7:42 identity=\"host-7/4412\" session=s1 proxy=a-1 zone=a since 2026-11-30T00:53:20.000Z (1m 30s ago)",
                "waiting #1 exclusive session=s2 (in line since revision 50)",
            ]
        );
        let free = LockState {
            holders: vec![],
            waiters: vec![],
            revision: 3,
        };
        assert_eq!(lines(&free, at), ["free"]);
    }
}
