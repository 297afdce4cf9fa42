//! `lockctl leader` and `lockctl observe`: who leads an election, once or as it
//! changes, one line per answer on stdout (text or JSON).

use crate::target::Target;
use std::fmt::Write as _;

use lockcell_client::LeaderInfo;

use crate::exit::EX_UNAVAILABLE;
use crate::print_line;
use crate::signals::Signals;

/// `lockctl leader`'s status when nobody leads.
pub(crate) const NO_LEADER: u8 = 3;

pub(crate) const LEADER_LONG: &str = "\
Print who leads election NAME.

Prints one line: the leader's value, fencing token, session, identity and proxy, as
  value=VALUE token=EPOCH:REVISION session=ID identity=IDENTITY proxy=PROXY
(a value with spaces, quotes or '=' is printed quoted), or \"no leader\". With --json,
one JSON object: {\"election\":…,\"leader\":{\"value\":…,\"token\":\"EPOCH:REVISION\",
\"session_id\":…,\"identity\":…,\"proxy_id\":…}}, with \"leader\":null when nobody leads.

The answer is already old when it is printed: to act as leader, use lockctl elect.

Exit statuses: 0 there is a leader, 3 nobody leads, 64 the proxy refused the election
name, 69 the proxy is unreachable, 1 anything else.

Example:
  lockctl leader db/primary
  lockctl leader --json db/primary | jq -r .leader.value";

pub(crate) const OBSERVE_LONG: &str = "\
Print who leads election NAME, then every change.

Prints the current leader, then one line each time the leader or its value changes, in
order, in the format of lockctl leader (\"no leader\" when nobody leads; with --json, one
JSON object per line). Runs until Ctrl-C (SIGINT) or SIGTERM. A stream that breaks (a
proxy restarting or dying) is observed again through the next proxy, going on with the
leader of that moment; the same leader is not printed twice.

Exit statuses: 0 stopped by SIGINT or SIGTERM, 69 no proxy could be reached for 30 s, 64
the proxy refused the election name, 1 anything else.

Example:
  lockctl observe db/primary
  lockctl observe --json db/primary | while read -r line; do reconfigure \"$line\"; done";

/// Arguments of `lockctl leader` and `lockctl observe`.
#[derive(Debug, clap::Args)]
pub(crate) struct LeaderArgs {
    /// The election, e.g. db/primary.
    pub(crate) name: String,

    /// Print JSON objects (one per line) instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `lockctl leader`.
pub(crate) async fn leader(proxy: &Target, args: &LeaderArgs) -> anyhow::Result<u8> {
    let client = proxy.connect().await?;
    let leader = client.leader(&args.name).await?;
    print_line(&leader_line(&args.name, leader.as_ref(), args.json))?;
    Ok(if leader.is_some() { 0 } else { NO_LEADER })
}

/// `lockctl observe`.
pub(crate) async fn observe(
    proxy: &Target,
    args: &LeaderArgs,
    signals: &mut Signals,
) -> anyhow::Result<u8> {
    let name = &args.name;
    let opening = async {
        let client = proxy.connect().await?;
        client.observe(name).await
    };
    let mut leaders = tokio::select! {
        leaders = opening => leaders?,
        _ = signals.recv() => return Ok(0),
    };
    loop {
        let next = tokio::select! {
            next = leaders.next() => next,
            _ = signals.recv() => return Ok(0),
        };
        match next {
            Some(Ok(leader)) => print_line(&leader_line(name, leader.as_ref(), args.json))?,
            Some(Err(error)) => {
                eprintln!("lockctl: observing election {name} stopped: {error}");
                return Ok(EX_UNAVAILABLE);
            }
            None => {
                eprintln!("lockctl: observing election {name} stopped");
                return Ok(EX_UNAVAILABLE);
            }
        }
    }
}

/// One answer about `election`, as text or as a JSON object.
fn leader_line(election: &str, leader: Option<&LeaderInfo>, json: bool) -> String {
    match (leader, json) {
        (None, false) => "no leader".to_owned(),
        (Some(l), false) => format!(
            "value={} token={} session={} identity={} proxy={}",
            text(&l.value),
            l.token,
            text(&l.session_id),
            text(&l.identity),
            text(&l.proxy_id)
        ),
        (None, true) => format!("{{\"election\":{},\"leader\":null}}", json_str(election)),
        (Some(l), true) => format!(
            "{{\"election\":{},\"leader\":{{\"value\":{},\"token\":{},\"session_id\":{},\
             \"identity\":{},\"proxy_id\":{}}}}}",
            json_str(election),
            json_str(&l.value),
            json_str(&l.token.to_string()),
            json_str(&l.session_id),
            json_str(&l.identity),
            json_str(&l.proxy_id)
        ),
    }
}

/// A field of a text line: as is, or quoted (Rust string syntax) when it is empty or
/// could be mistaken for more than one field.
fn text(value: &str) -> String {
    let plain = !value.is_empty()
        && !value
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '=' || c == '\\');
    if plain {
        value.to_owned()
    } else {
        format!("{value:?}")
    }
}

/// A JSON string literal.
fn json_str(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use lockcell_client::FencingToken;

    use super::*;

    fn info(value: &str) -> LeaderInfo {
        LeaderInfo {
            session_id: "s7".into(),
            identity: "host-a/4242".into(),
            proxy_id: "zone-a".into(),
            value: value.into(),
            token: FencingToken {
                epoch: 1,
                revision: 4521,
            },
        }
    }

    #[test]
    fn text_lines() {
        assert_eq!(leader_line("db", None, false), "no leader");
        assert_eq!(
            leader_line("db", Some(&info("10.0.0.7:5432")), false),
            "value=10.0.0.7:5432 token=1:4521 session=s7 identity=host-a/4242 proxy=zone-a"
        );
        // A value that could read as more fields is quoted.
        assert_eq!(
            leader_line("db", Some(&info("a b=\"c\"")), false),
            r#"value="a b=\"c\"" token=1:4521 session=s7 identity=host-a/4242 proxy=zone-a"#
        );
        assert_eq!(text(""), "\"\"");
        assert_eq!(text("x\ny"), "\"x\\ny\"");
    }

    #[test]
    fn json_lines() {
        assert_eq!(
            leader_line("db/primary", None, true),
            r#"{"election":"db/primary","leader":null}"#
        );
        assert_eq!(
            leader_line("db", Some(&info("10.0.0.7:5432")), true),
            r#"{"election":"db","leader":{"value":"10.0.0.7:5432","token":"1:4521","session_id":"s7","identity":"host-a/4242","proxy_id":"zone-a"}}"#
        );
        assert_eq!(json_str("a\"b\\c\nd\u{1}é"), r#""a\"b\\c\nd\u0001é""#);
    }
}
