//! `lockctl watch` and `lockctl members`: follow small keys, or a group's membership,
//! one line per change on stdout, until SIGINT or SIGTERM.

use crate::target::Target;
use lockcell_client::{Error, EventKind, MemberChange, Members, WatchEvent, WatchOptions, Watcher};

use crate::kv::value_field;
use crate::print_line;
use crate::signals::Signals;

/// Status when the revisions to watch from were compacted away (or are another cell's).
pub(crate) const COMPACTED: u8 = 4;

pub(crate) const WATCH_LONG: &str = "\
Print every change of a small key, or of every key under a prefix.

Prints one line per event, in revision order:
  REVISION put KEY VALUE
  REVISION delete KEY
VALUE is printed as text when it is UTF-8 without control characters, else as 0x and its
bytes in hex. With --prev, a line ends with \" (was VALUE)\" when the key had a value
before the event.

Without --from or --after the watch starts now. With --after POS (REVISION@CELL, as
lockctl get --position prints it) it prints every event after that read, in that read's
cell. With --from REV it prints every event from revision REV on, in whichever cell
serves the keys now (e.g. one past the revision lockctl get --revision KEY printed). The
watch goes on
across a restarted proxy or a broken connection with no event missed or repeated. If it
falls too far behind, the proxy cuts it off and lockctl resumes where it was (saying so on
stderr). --all watches every small key.

Runs until Ctrl-C (SIGINT) or SIGTERM.

Exit statuses: 0 stopped by SIGINT or SIGTERM, 4 the revisions to watch from were
compacted (the message names the oldest one still available: read the keys again and
watch from there) or are another cell's (the keys' prefix moved to another cell, or the
cell was restored, or --after names a revision from before the keys came to their cell:
read the keys again and watch from that read), 64 the proxy refused the key or revision,
69 the proxy could not be reached (for 30s, once watching), 1 anything else (e.g. a
prefix whose keys are in several cells, now or after a move of part of it).

Example:
  lockctl watch config/api/limit
  lockctl watch config/api/ --prefix --prev
  { read -r at; read -r limit; } < <(lockctl get --position config/api/limit)
  lockctl watch config/api/limit --after \"$at\"";

pub(crate) const MEMBERS_LONG: &str = "\
Print the members of group GROUP, or follow who joins and leaves.

Members announce themselves with lockctl announce (or the SDK's Session::announce) and
stay members while their session lives. Prints one line per member, in name order:
  MEMBER VALUE
With --watch, prints the members there are now as \"+\" lines, then one line per change,
in order, until Ctrl-C (SIGINT) or SIGTERM:
  + MEMBER VALUE     joined
  ~ MEMBER VALUE     announced a new value
  - MEMBER           left (closed, stopped, or its session expired)
Values are printed as by lockctl watch.

Exit statuses: 0 printed (or stopped by SIGINT or SIGTERM), 64 the proxy refused the
group name, 69 the proxy could not be reached, 1 anything else.

Example:
  lockctl members web
  lockctl members web --watch | while read -r op member addr; do reload \"$op\" \"$member\" \"$addr\"; done";

/// Arguments of `lockctl watch`.
#[derive(Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("what")
        .required(true)
        .multiple(true)
        .args(["key", "all"])
))]
pub(crate) struct WatchArgs {
    /// The key to watch, e.g. config/api/limit; with --prefix the start of the keys,
    /// e.g. config/api/.
    pub(crate) key: Option<String>,

    /// Watch every key under KEY (as `lockctl get KEY --prefix` reads them).
    #[arg(long, requires = "key")]
    pub(crate) prefix: bool,

    /// Print every event from revision REV on (default: from now).
    #[arg(long, value_name = "REV", value_parser = clap::value_parser!(i64).range(1..))]
    pub(crate) from: Option<i64>,

    /// Print every event after position POS (REVISION@CELL, from lockctl get
    /// --position); exit 4 if the keys are at another position now.
    #[arg(long, value_name = "POS", conflicts_with = "from", value_parser = position)]
    pub(crate) after: Option<lockcell_client::CellRevision>,

    /// Print each event's previous value too.
    #[arg(long)]
    pub(crate) prev: bool,

    /// Watch every small key (the empty prefix), instead of KEY.
    #[arg(long, conflicts_with = "key")]
    pub(crate) all: bool,
}

/// A position for --after: REVISION@CELL, the cell required (a bare revision is what
/// --from takes).
fn position(text: &str) -> Result<lockcell_client::CellRevision, String> {
    let at: lockcell_client::CellRevision = text.parse()?;
    if at.cell.is_empty() {
        return Err(format!(
            "{text:?} has no cell: --after takes REVISION@CELL as lockctl get --position prints it (a bare revision: --from REVISION+1)"
        ));
    }
    Ok(at)
}

impl WatchArgs {
    /// The key or prefix to watch, and how.
    pub(crate) fn target(&self) -> (&str, WatchOptions) {
        let (key, mut opts) = match &self.key {
            Some(key) if self.prefix => (key.as_str(), WatchOptions::prefix()),
            Some(key) => (key.as_str(), WatchOptions::default()),
            None => ("", WatchOptions::prefix()),
        };
        if self.all {
            opts = opts.allow_all_keys();
        }
        if let Some(from) = self.from {
            opts = opts.from_revision(from);
        }
        if let Some(after) = &self.after {
            opts = opts.after(after);
        }
        if self.prev {
            opts = opts.with_prev_kv();
        }
        (key, opts)
    }

    /// What is watched, in messages.
    fn what(&self) -> String {
        match &self.key {
            Some(prefix) if self.prefix => format!("prefix {prefix:?}"),
            Some(key) => format!("key {key:?}"),
            None => "every small key".to_owned(),
        }
    }
}

/// Arguments of `lockctl members`.
#[derive(Debug, clap::Args)]
pub(crate) struct MembersArgs {
    /// The group, e.g. web or svc/web.
    pub(crate) group: String,

    /// Follow the changes: who joins, leaves or announces a new value.
    #[arg(long)]
    pub(crate) watch: bool,
}

/// `lockctl watch`.
pub(crate) async fn watch(
    proxy: &Target,
    args: &WatchArgs,
    signals: &mut Signals,
) -> anyhow::Result<u8> {
    let (key, opts) = args.target();
    let from = opts.start_revision;
    let opening = async {
        let client = proxy.connect().await?;
        client.watch(key, opts).await
    };
    let opened = tokio::select! {
        opened = opening => opened,
        _ = signals.recv() => return Ok(0),
    };
    let mut watcher = match opened {
        Ok(watcher) => watcher,
        Err(error) => return stopped(args, from, error),
    };
    eprintln!(
        "lockctl: watching {} after revision {}",
        args.what(),
        watcher.revision()
    );
    loop {
        let next = tokio::select! {
            // A watch ends with an error first, which stops lockctl.
            next = watcher.next() => next.unwrap_or_else(|| {
                Err(Error::Protocol("the watch ended without saying why".to_owned()))
            }),
            _ = signals.recv() => return Ok(0),
        };
        match next {
            Ok(batch) => {
                for event in &batch.events {
                    print_line(&event_line(event, args.prev))?;
                }
            }
            Err(Error::WatchCutOff { resume_from, .. }) => eprintln!(
                "lockctl: the watch fell too far behind and the proxy cut it off; \
                 resuming from revision {resume_from}"
            ),
            Err(error) => return stopped(args, watcher_from(&watcher), error),
        }
    }
}

/// Where a watcher that stops now was watching from.
fn watcher_from(watcher: &Watcher) -> i64 {
    watcher.revision() + 1
}

/// lockctl's answer to an error that ends the watch.
fn stopped(args: &WatchArgs, from: i64, error: Error) -> anyhow::Result<u8> {
    match error {
        Error::Compacted {
            compact_revision, ..
        } => {
            eprintln!(
                "lockctl: cannot watch {} from revision {from}: etcd compacted the revisions \
                 before {compact_revision}; read the keys again and watch from the read's \
                 revision + 1 (--from {compact_revision} or later skips what was lost)",
                args.what()
            );
            Ok(COMPACTED)
        }
        Error::WatchMoved { cell, .. } => {
            eprintln!(
                "lockctl: cannot watch {} from revision {from}: the keys are at another \
                 position now ({cell:?} as the proxy sees it: their prefix moved to another \
                 cell, or the cell was restored), or the revision is from before they came \
                 to this cell, and revisions of two positions are unrelated; read the keys \
                 again (lockctl get --position) and watch --after that",
                args.what()
            );
            Ok(COMPACTED)
        }
        error => Err(error.into()),
    }
}

/// One event as a line: `REVISION put KEY VALUE` or `REVISION delete KEY`, with
/// ` (was VALUE)` when `prev` and there was a previous value.
fn event_line(event: &WatchEvent, prev: bool) -> String {
    let entry = &event.entry;
    let mut line = match event.kind {
        EventKind::Put => format!(
            "{} put {} {}",
            entry.mod_revision,
            entry.key,
            value_field(&entry.value)
        ),
        EventKind::Delete => format!("{} delete {}", entry.mod_revision, entry.key),
    };
    if let (true, Some(was)) = (prev, &event.prev) {
        line.push_str(&format!(" (was {})", value_field(&was.value)));
    }
    line
}

/// `lockctl members`.
pub(crate) async fn members(
    proxy: &Target,
    args: &MembersArgs,
    signals: &mut Signals,
) -> anyhow::Result<u8> {
    let opening = async {
        let client = proxy.connect().await?;
        client.members(&args.group).await
    };
    let mut members: Members = tokio::select! {
        members = opening => members?,
        _ = signals.recv() => return Ok(0),
    };
    if !args.watch {
        for (member, value) in members.current() {
            print_line(&format!("{member} {}", value_field(value)))?;
        }
        return Ok(0);
    }
    for (member, value) in members.current() {
        print_line(&change_line(&MemberChange::Joined {
            member: member.clone(),
            value: value.clone(),
        }))?;
    }
    eprintln!(
        "lockctl: following group {} ({} members at revision {})",
        args.group,
        members.current().len(),
        members.revision()
    );
    loop {
        let changes = tokio::select! {
            changes = members.changed() => changes?,
            _ = signals.recv() => return Ok(0),
        };
        for change in &changes {
            print_line(&change_line(change))?;
        }
    }
}

/// One change of membership as a line: `+ MEMBER VALUE`, `~ MEMBER VALUE`, `- MEMBER`.
fn change_line(change: &MemberChange) -> String {
    match change {
        MemberChange::Joined { member, value } => format!("+ {member} {}", value_field(value)),
        MemberChange::Updated { member, value } => format!("~ {member} {}", value_field(value)),
        MemberChange::Left { member } => format!("- {member}"),
    }
}

#[cfg(test)]
mod tests {
    use lockcell_client::Entry;

    use super::*;

    fn event(kind: EventKind, value: &[u8], prev: Option<&[u8]>) -> WatchEvent {
        let entry = |value: &[u8], revision| Entry {
            key: "config/api/limit".into(),
            value: value.to_vec(),
            create_revision: 3,
            mod_revision: revision,
            version: 1,
            ephemeral: false,
        };
        WatchEvent {
            kind,
            entry: entry(value, 105),
            prev: prev.map(|p| entry(p, 99)),
        }
    }

    #[test]
    fn event_lines() {
        let put = event(EventKind::Put, b"200", Some(b"100"));
        assert_eq!(event_line(&put, false), "105 put config/api/limit 200");
        assert_eq!(
            event_line(&put, true),
            "105 put config/api/limit 200 (was 100)"
        );
        let created = event(EventKind::Put, b"a b", None);
        assert_eq!(event_line(&created, true), "105 put config/api/limit a b");
        let binary = event(EventKind::Put, &[0xff, 0xfe], None);
        assert_eq!(
            event_line(&binary, false),
            "105 put config/api/limit 0xfffe"
        );
        let deleted = event(EventKind::Delete, b"", Some(b"200"));
        assert_eq!(event_line(&deleted, false), "105 delete config/api/limit");
        assert_eq!(
            event_line(&deleted, true),
            "105 delete config/api/limit (was 200)"
        );
    }

    #[test]
    fn change_lines() {
        let value = b"10.0.0.7:80".to_vec();
        assert_eq!(
            change_line(&MemberChange::Joined {
                member: "a".into(),
                value: value.clone()
            }),
            "+ a 10.0.0.7:80"
        );
        assert_eq!(
            change_line(&MemberChange::Updated {
                member: "a".into(),
                value
            }),
            "~ a 10.0.0.7:80"
        );
        assert_eq!(
            change_line(&MemberChange::Left { member: "a".into() }),
            "- a"
        );
    }
}
