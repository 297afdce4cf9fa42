//! `lockctl get`, `put`, `del`: small keys (configuration) from scripts.

use crate::target::Target;
use std::borrow::Cow;
use std::fmt::Write as _;

use lockcell_client::Condition;

use crate::print_line;

/// Status of a conditional put or delete whose condition did not hold.
pub(crate) const CONDITION_FAILED: u8 = 1;
/// Status of `get` for a key that does not exist.
pub(crate) const MISSING: u8 = 3;

pub(crate) const KV_LONG: &str = "\
Small keys (configuration, routing tables) kept by lockcell under its key space.

get KEY prints the value (exit 3 if there is no such key); get --prefix P prints
KEY=VALUE lines for every key under P. A value that is not UTF-8 text is printed as 0x
and its bytes in hex. put KEY VALUE writes it; with --if-absent only
when the key does not exist, with --if-revision R only when its last write was at
revision R (compare-and-swap); a condition that does not hold writes nothing and exits 1
printing the current revision. del KEY deletes (also with --if-revision).

With --position, get first prints the read's position on a line of its own,
REVISION@CELL (the revision the read reflects, and the cell it is a revision of), then
the value or lines as usual (also when the key does not exist): lockctl watch --after
that position follows on from the read with nothing missed, and exits 4 rather than
read another cell's revisions if the keys' prefix moved to another cell meanwhile.

Exit statuses: 0 done, 1 the condition did not hold, 3 no such key (get), 64 a bad key
or value, 69 the proxy is unreachable or could not finish the call (etcd away; or the
key's prefix is moving between cells, which the message says: nothing was written, try
again shortly), 1 anything else (e.g. a prefix whose keys are in several cells).

Example:
  rev=$(lockctl get --revision config/api/limit) && lockctl put --if-revision \"$rev\" config/api/limit 200
  { read -r at; read -r limit; } < <(lockctl get --position config/api/limit)
  lockctl watch config/api/limit --after \"$at\"";

/// Arguments of `lockctl get`.
#[derive(Debug, clap::Args)]
pub(crate) struct GetArgs {
    /// The key, or with --prefix the start of the keys (e.g. config/api/).
    pub(crate) key: String,
    /// Every key under KEY, as KEY=VALUE lines.
    #[arg(long)]
    pub(crate) prefix: bool,
    /// Print the key's last-write revision instead of its value (for --if-revision).
    #[arg(long, conflicts_with = "prefix")]
    pub(crate) revision: bool,
    /// First print the read's position, REVISION@CELL, for lockctl watch --after.
    #[arg(long, conflicts_with = "revision")]
    pub(crate) position: bool,
}

/// Arguments of `lockctl put`.
#[derive(Debug, clap::Args)]
pub(crate) struct PutArgs {
    pub(crate) key: String,
    pub(crate) value: String,
    /// Write only if the key does not exist.
    #[arg(long, conflicts_with = "if_revision")]
    pub(crate) if_absent: bool,
    /// Write only if the key's last write was at this revision.
    #[arg(long, value_name = "REVISION")]
    pub(crate) if_revision: Option<i64>,
}

/// Arguments of `lockctl del`.
#[derive(Debug, clap::Args)]
pub(crate) struct DelArgs {
    pub(crate) key: String,
    /// Delete only if the key's last write was at this revision.
    #[arg(long, value_name = "REVISION")]
    pub(crate) if_revision: Option<i64>,
}

pub(crate) async fn get(proxy: &Target, args: &GetArgs) -> anyhow::Result<u8> {
    let client = proxy.connect().await?;
    let snapshot = if args.prefix {
        client.snapshot_prefix(&args.key).await?
    } else {
        client.snapshot(&args.key).await?
    };
    if args.position {
        print_line(&snapshot.at.to_string())?;
    }
    if args.prefix {
        for entry in snapshot.entries {
            print_line(&format!("{}={}", entry.key, value_text(&entry.value)))?;
        }
        return Ok(0);
    }
    match snapshot.entries.first() {
        Some(entry) if args.revision => print_line(&entry.mod_revision.to_string()).map(|()| 0),
        Some(entry) => print_line(&value_text(&entry.value)).map(|()| 0),
        None => {
            eprintln!("lockctl: no key {:?}", args.key);
            Ok(MISSING)
        }
    }
}

/// A value as lockctl prints it: as text when it is UTF-8, else as `0x` and its bytes in
/// hex (so binary values survive a terminal and a script).
pub(crate) fn value_text(value: &[u8]) -> Cow<'_, str> {
    match std::str::from_utf8(value) {
        Ok(text) => Cow::Borrowed(text),
        Err(_) => Cow::Owned(hex(value)),
    }
}

/// A value as a field of a one-line record (lockctl watch, lockctl members): as
/// [`value_text`], but in hex also when the text has a control character, so that a
/// record is always exactly one line.
pub(crate) fn value_field(value: &[u8]) -> Cow<'_, str> {
    match value_text(value) {
        Cow::Borrowed(text) if text.chars().any(char::is_control) => Cow::Owned(hex(value)),
        shown => shown,
    }
}

fn hex(value: &[u8]) -> String {
    let mut out = String::with_capacity(2 + 2 * value.len());
    out.push_str("0x");
    for byte in value {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

pub(crate) async fn put(proxy: &Target, args: &PutArgs) -> anyhow::Result<u8> {
    let condition = match (args.if_absent, args.if_revision) {
        (true, _) => Condition::Absent,
        (false, Some(r)) => Condition::ModRevision(r),
        (false, None) => Condition::Always,
    };
    let client = proxy.connect().await?;
    let written = client
        .put(&args.key, args.value.as_bytes(), condition)
        .await?;
    if written.succeeded {
        return Ok(0);
    }
    match written.current {
        Some(current) => eprintln!(
            "lockctl: {:?} was last written at revision {}; not written",
            args.key, current.mod_revision
        ),
        None => eprintln!("lockctl: {:?} does not exist; not written", args.key),
    }
    Ok(CONDITION_FAILED)
}

pub(crate) async fn del(proxy: &Target, args: &DelArgs) -> anyhow::Result<u8> {
    let condition = args
        .if_revision
        .map_or(Condition::Always, Condition::ModRevision);
    let client = proxy.connect().await?;
    if client.delete(&args.key, condition).await? {
        return Ok(0);
    }
    eprintln!(
        "lockctl: {:?} not deleted (no such key, or not at that revision)",
        args.key
    );
    Ok(CONDITION_FAILED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_print_as_text_or_hex() {
        assert_eq!(value_text(b"10.0.0.7:5432"), "10.0.0.7:5432");
        assert_eq!(value_text("héllo wörld".as_bytes()), "héllo wörld");
        assert_eq!(value_text(b"two\nlines"), "two\nlines");
        assert_eq!(value_text(&[0xff, 0x00, 0x1a]), "0xff001a");
        assert_eq!(value_text(b""), "");
        // One record, one line: control characters make a field hex.
        assert_eq!(value_field(b"a b"), "a b");
        assert_eq!(value_field(b"two\nlines"), "0x74776f0a6c696e6573");
        assert_eq!(value_field(&[0xff]), "0xff");
    }
}
