//! One configuration story for every lockcell binary: a TOML file, environment
//! variables and flags, in that order of precedence (a flag beats its variable, which
//! beats the file, which beats the default).
//!
//! The file's settings are named as the long flags (`lease-ttl = "10s"`, `etcd =
//! ["http://10.0.1.5:2379"]`, `grants-without-tls = true`); values are what the flag
//! takes, as TOML strings, numbers, booleans or arrays. For a binary with subcommands,
//! a top-level setting applies to whichever command runs and has that flag (so one
//! `etcd = [...]` serves `init`, `audit` and `shardmap move` alike), and a table named
//! after a subcommand (`[audit]`, `[shardmap.move]`) holds settings for that command
//! only, which win over the top-level ones. A setting no command has is refused, naming
//! it; a file setting that a flag or a variable excludes gives way to it. The file's values are handed to clap as flags, so every rule a flag has (its
//! type, the settings it requires or excludes) holds for the file too.
//!
//! The binary's parser needs two root arguments: `config` (the file; `--config`, with
//! the binary's own environment variable, `global` when there are subcommands) and
//! `print_config`. [`Loaded::render`] is what `--print-config` prints: every setting in
//! force, in the file's format, each with where it came from, secrets hidden.
//! [`reference`] is the binary's part of `docs/configuration.md`.

pub mod logs;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command, FromArgMatches, Parser};

/// Flags that are not settings.
const NOT_SETTINGS: &[&str] = &[
    "help",
    "version",
    "config",
    "print-config",
    "check-config",
    "force",
];

/// The hidden argument that prints the binary's part of `docs/configuration.md`.
const REFERENCE_FLAG: &str = "--config-reference";

/// The configuration from `args` (the program name first), the environment and the
/// file `--config` names, or the error to print, which names the bad value (and the
/// file, when the value came from there).
pub fn load<T: Parser>(args: Vec<OsString>) -> Result<Loaded<T>, clap::Error> {
    let command = T::command();
    // What the flags and the environment give, before the file: rules between settings
    // (one requiring another) wait for the whole, on the final parse.
    let given = command
        .clone()
        .ignore_errors(true)
        .try_get_matches_from(&args)?;
    let running = Running::new(&command, &given);
    let path = running
        .matches
        .iter()
        .find_map(|m| m.try_get_one::<PathBuf>("config").ok().flatten().cloned());
    let Some(path) = path else {
        let matches = command.clone().try_get_matches_from(&args)?;
        return Loaded::new(matches, BTreeSet::new(), None, command);
    };
    let in_file = |message: String| {
        command
            .clone()
            .error(clap::error::ErrorKind::ValueValidation, message)
    };
    let text = std::fs::read_to_string(&path).map_err(|e| {
        in_file(format!(
            "cannot read the configuration file {}: {e}",
            path.display()
        ))
    })?;
    let table = parse(&path, &text).map_err(in_file)?;
    let mut found = Found::default();
    found
        .collect(&running, &table, &[], &path)
        .map_err(in_file)?;
    let positions = running.positions(&args).map_err(in_file)?;
    let mut all = args.clone();
    let mut from_file = BTreeSet::new();
    // The deepest command's settings first, so the earlier positions stay right.
    for (level, at) in positions.iter().enumerate().rev() {
        let mut inserted = Vec::new();
        for ((setting_level, key), (_, value)) in &found.settings {
            if *setting_level != level {
                continue;
            }
            let arg = running.arg(level, key).expect("found at this level");
            if running.given(arg) || running.excluded(level, arg) {
                continue;
            }
            inserted.extend(flag_args(arg, key, value, &path).map_err(in_file)?);
            from_file.insert((level, key.clone()));
        }
        all.splice(at..at, inserted);
    }
    let matches = command.clone().try_get_matches_from(all).map_err(|e| {
        use clap::error::ErrorKind::{DisplayHelp, DisplayVersion, MissingRequiredArgument};
        if matches!(e.kind(), DisplayHelp | DisplayVersion) {
            return e;
        }
        // A mistake in the arguments themselves is theirs, not the file's (but for a
        // setting they lack, which the file may be the one to give).
        if let Err(own) = command.clone().try_get_matches_from(&args) {
            if own.kind() != MissingRequiredArgument {
                return own;
            }
        }
        // clap's own message (without its usage and help lines and its "error: ").
        let message = e.to_string();
        let message = message.split("\n\n").next().unwrap_or_default().trim();
        in_file(format!(
            "with the configuration file {}: {}",
            path.display(),
            message.strip_prefix("error: ").unwrap_or(message)
        ))
    })?;
    Loaded::new(matches, from_file, Some(path), command)
}

/// A loaded configuration and where each of its values came from.
pub struct Loaded<T> {
    pub config: T,
    matches: ArgMatches,
    /// The settings the file gave (and neither a flag nor a variable overrode), by the
    /// level of the running command that has them.
    from_file: BTreeSet<(usize, String)>,
    file: Option<PathBuf>,
    command: Command,
}

impl<T: FromArgMatches> Loaded<T> {
    fn new(
        matches: ArgMatches,
        from_file: BTreeSet<(usize, String)>,
        file: Option<PathBuf>,
        command: Command,
    ) -> Result<Loaded<T>, clap::Error> {
        Ok(Loaded {
            config: T::from_arg_matches(&matches)?,
            matches,
            from_file,
            file,
            command,
        })
    }
}

impl<T> Loaded<T> {
    /// Every setting in force, in the file's format, each with where it came from.
    pub fn render(&self) -> String {
        let running = Running::new(&self.command, &self.matches);
        let mut out = format!(
            "# {}: the configuration in force\n",
            self.command.get_name()
        );
        if let Some(file) = &self.file {
            out.push_str(&format!("# file: {}\n", file.display()));
        }
        for (level, command) in running.commands.iter().enumerate() {
            let args: Vec<&Arg> = settings(command).collect();
            if args.is_empty() {
                continue;
            }
            if level > 0 {
                out.push_str(&format!("\n[{}]\n", running.names[..level].join(".")));
            }
            for arg in args {
                let key = arg.get_long().unwrap_or_default();
                let Some(matches) = running.matches_of(arg) else {
                    continue;
                };
                let source = if self.from_file.contains(&(level, key.to_owned())) {
                    "file".to_owned()
                } else {
                    source(arg, matches.value_source(arg.get_id().as_str()))
                };
                let line = setting_line(arg, key, matches);
                out.push_str(&format!("{line:<60} # {source}\n"));
            }
        }
        out
    }
}

fn source(arg: &Arg, source: Option<ValueSource>) -> String {
    match source {
        Some(ValueSource::CommandLine) => "flag".to_owned(),
        Some(ValueSource::EnvVariable) => format!(
            "environment {}",
            arg.get_env()
                .map(|e| e.to_string_lossy())
                .unwrap_or_default()
        ),
        Some(ValueSource::DefaultValue) => "default".to_owned(),
        _ => "not set".to_owned(),
    }
}

/// `key = value` as the file would say it.
fn setting_line(arg: &Arg, key: &str, matches: &ArgMatches) -> String {
    let values: Vec<String> = matches
        .get_raw(arg.get_id().as_str())
        .map(|raw| raw.map(|v| v.to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let values: Vec<String> = values.iter().map(|v| hide_credentials(v)).collect();
    if values.is_empty() {
        format!("# {key} =")
    } else if is_secret(key) {
        format!("{key} = \"(hidden)\"")
    } else if matches!(arg.get_action(), ArgAction::SetTrue) {
        format!("{key} = {}", values[0])
    } else if values.len() > 1 || arg.get_value_delimiter().is_some() {
        let quoted: Vec<String> = values.iter().map(|v| quote(v)).collect();
        format!("{key} = [{}]", quoted.join(", "))
    } else {
        format!("{key} = {}", quote(&values[0]))
    }
}

/// The command that runs: the root and the subcommands named, with their matches.
struct Running<'a> {
    commands: Vec<&'a Command>,
    names: Vec<String>,
    matches: Vec<&'a ArgMatches>,
}

impl<'a> Running<'a> {
    fn new(root: &'a Command, matches: &'a ArgMatches) -> Running<'a> {
        let mut running = Running {
            commands: vec![root],
            names: Vec::new(),
            matches: vec![matches],
        };
        let (mut command, mut matches) = (root, matches);
        while let Some((name, sub_matches)) = matches.subcommand() {
            let Some(sub) = command.find_subcommand(name) else {
                break;
            };
            running.commands.push(sub);
            running.names.push(name.to_owned());
            running.matches.push(sub_matches);
            (command, matches) = (sub, sub_matches);
        }
        running
    }

    /// The setting `key` of the command at `level`.
    fn arg(&self, level: usize, key: &str) -> Option<&'a Arg> {
        settings(self.commands[level]).find(|a| a.get_long() == Some(key))
    }

    /// The deepest running command that has the setting `key`, and its flag.
    fn find(&self, key: &str) -> Option<(usize, &'a Arg)> {
        (0..self.commands.len())
            .rev()
            .find_map(|level| self.arg(level, key).map(|arg| (level, arg)))
    }

    /// The deepest matches that know `arg` (a global's value is there).
    fn matches_of(&self, arg: &Arg) -> Option<&'a ArgMatches> {
        let id = arg.get_id().as_str();
        self.matches
            .iter()
            .rev()
            .find(|m| m.try_get_raw(id).is_ok())
            .copied()
    }

    /// Whether a flag or an environment variable gave `arg`.
    fn given(&self, arg: &Arg) -> bool {
        let id = arg.get_id().as_str();
        self.matches.iter().any(|m| {
            m.try_get_raw(id).is_ok()
                && matches!(
                    m.value_source(id),
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                )
        })
    }

    /// Whether a flag or a variable gave a setting `arg` (of the command at `level`)
    /// cannot go with: the flag wins over the file there too (`--try` over the file's
    /// `timeout`).
    fn excluded(&self, level: usize, arg: &Arg) -> bool {
        let command = self.commands[level];
        let conflicts = |a: &Arg, b: &Arg| {
            command
                .get_arg_conflicts_with(a)
                .iter()
                .any(|c| c.get_id() == b.get_id())
        };
        command.get_arguments().any(|other| {
            other.get_id() != arg.get_id()
                && (conflicts(arg, other) || conflicts(other, arg))
                && self.given(other)
        })
    }

    /// Where in `args` each running command's flags may go: just after the program name
    /// for the root, just after its name for a subcommand.
    fn positions(&self, args: &[OsString]) -> Result<Vec<usize>, String> {
        let mut positions = vec![1.min(args.len())];
        let mut inherited: Vec<&Arg> = Vec::new();
        let mut at = 1;
        for (level, name) in self.names.iter().enumerate() {
            let command = self.commands[level];
            inherited.extend(command.get_arguments().filter(|a| a.is_global_set()));
            let flags = |long: &str| {
                command
                    .get_arguments()
                    .chain(inherited.iter().copied())
                    .find(|a| {
                        a.get_long() == Some(long)
                            || a.get_all_aliases().is_some_and(|all| all.contains(&long))
                    })
            };
            let shorts = |short: char| {
                command
                    .get_arguments()
                    .chain(inherited.iter().copied())
                    .find(|a| a.get_short() == Some(short))
            };
            let mut found = None;
            while at < args.len() {
                let token = args[at].to_string_lossy();
                at += 1;
                if token == "--" {
                    break;
                }
                if let Some(long) = token.strip_prefix("--") {
                    if !long.contains('=') && flags(long).is_some_and(takes_value) {
                        at += 1;
                    }
                } else if let Some(cluster) = token.strip_prefix('-').filter(|c| !c.is_empty()) {
                    // -abc: the first short flag that takes a value takes the rest of
                    // the cluster, or the next token when it ends the cluster.
                    let mut chars = cluster.chars();
                    while let Some(short) = chars.next() {
                        if shorts(short).is_some_and(takes_value) {
                            if chars.as_str().is_empty() {
                                at += 1;
                            }
                            break;
                        }
                    }
                } else if command
                    .find_subcommand(token.as_ref())
                    .is_some_and(|sub| sub.get_name() == name)
                {
                    found = Some(at);
                    break;
                }
            }
            let Some(after) = found else {
                return Err(format!(
                    "cannot tell where the {name} command starts in the arguments, to add the configuration file's settings; name the command before its arguments"
                ));
            };
            positions.push(after);
        }
        Ok(positions)
    }
}

fn takes_value(arg: &Arg) -> bool {
    arg.get_action().takes_values()
}

/// The settings of the file, each at the running command that has it, with the depth of
/// the table that gave it (a deeper table wins).
#[derive(Default)]
struct Found {
    settings: BTreeMap<(usize, String), (usize, toml::Value)>,
}

impl Found {
    /// The settings of `table`, the file's table for the command at `path` (below the
    /// root).
    fn collect(
        &mut self,
        running: &Running,
        table: &toml::Table,
        path: &[String],
        file: &Path,
    ) -> Result<(), String> {
        let applies = running.names.starts_with(path);
        let here = command_at(running.commands[0], path);
        for (key, value) in table {
            if let (toml::Value::Table(inner), Some(_)) = (value, here.find_subcommand(key)) {
                let mut deeper = path.to_vec();
                deeper.push(key.clone());
                self.collect(running, inner, &deeper, file)?;
                continue;
            }
            let at = if applies { running.find(key) } else { None };
            match at {
                Some((level, _)) => {
                    let slot = self
                        .settings
                        .entry((level, key.clone()))
                        .or_insert((path.len(), value.clone()));
                    if slot.0 < path.len() {
                        *slot = (path.len(), value.clone());
                    }
                }
                None if known(here, key) || known_above(running.commands[0], path, key) => {}
                None => {
                    let table = if path.is_empty() {
                        String::new()
                    } else {
                        format!(" in [{}]", path.join("."))
                    };
                    let mut name = running.commands[0].get_name().to_owned();
                    for part in path {
                        name.push(' ');
                        name.push_str(part);
                    }
                    return Err(format!(
                        "the configuration file {} has an unknown setting {key:?}{table}: settings are named as the long flags of `{name} --help`, and a table as a command",
                        file.display()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The command at `path` below `root`.
fn command_at<'a>(root: &'a Command, path: &[String]) -> &'a Command {
    path.iter().fold(root, |command, name| {
        command
            .find_subcommand(name)
            .expect("a table of the file names a command")
    })
}

/// Whether `command` or one of its subcommands has the setting `key`.
fn known(command: &Command, key: &str) -> bool {
    settings(command).any(|a| a.get_long() == Some(key))
        || command.get_subcommands().any(|sub| known(sub, key))
}

/// Whether a command above `path` gives its subcommands the setting `key` (a global).
fn known_above(root: &Command, path: &[String], key: &str) -> bool {
    (0..path.len()).any(|depth| {
        settings(command_at(root, &path[..depth]))
            .any(|a| a.is_global_set() && a.get_long() == Some(key))
    })
}

/// The flags of `command` that are settings.
fn settings(command: &Command) -> impl Iterator<Item = &Arg> {
    command.get_arguments().filter(|a| {
        a.get_long()
            .is_some_and(|long| !NOT_SETTINGS.contains(&long))
    })
}

fn is_secret(key: &str) -> bool {
    ["password", "token", "secret"]
        .iter()
        .any(|word| key.contains(word))
}

/// `value` with the password of a URL's user (`http://bob:PASSWORD@host`) and the
/// values of its query parameters named as secrets (`?password=...`) hidden: a store's
/// URL may carry them.
fn hide_credentials(value: &str) -> String {
    let Some(scheme) = value.find("://") else {
        return value.to_owned();
    };
    let start = scheme + 3;
    let end = value[start..]
        .find(['/', '?', '#'])
        .map_or(value.len(), |i| start + i);
    let authority = &value[start..end];
    let authority = match authority.rsplit_once('@') {
        Some((user, host)) => match user.split_once(':') {
            Some((name, _)) => format!("{name}:(hidden)@{host}"),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    let rest = &value[end..];
    let rest = match rest.split_once('?') {
        Some((path, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, format!("#{f}")),
                None => (query, String::new()),
            };
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if is_secret(&k.to_ascii_lowercase()) => format!("{k}=(hidden)"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}{fragment}", query.join("&"))
        }
        None => rest.to_owned(),
    };
    format!("{}{authority}{rest}", &value[..start])
}

/// `value` as the file would say it: a whole number bare (`leases = 4`), anything else
/// as a TOML string. The file's values are handed to the flags as text either way.
fn quote(value: &str) -> String {
    match value.parse::<i64>() {
        Ok(number) if number.to_string() == value => value.to_owned(),
        _ => toml::Value::String(value.to_owned()).to_string(),
    }
}

/// The file as a table: the parser's message, and where, but not its quote of the
/// line, which may hold a password.
fn parse(path: &Path, text: &str) -> Result<toml::Table, String> {
    text.parse().map_err(|e: toml::de::Error| {
        let line = e
            .span()
            .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
        format!(
            "the configuration file {} is not TOML{}: {}",
            path.display(),
            line.map(|l| format!(" (line {l})")).unwrap_or_default(),
            e.message()
        )
    })
}

/// The file's `key = value` as the flags that say the same.
fn flag_args(
    arg: &Arg,
    key: &str,
    value: &toml::Value,
    path: &Path,
) -> Result<Vec<OsString>, String> {
    let flag = format!("--{key}");
    let bad = |what: &str| {
        format!(
            "the configuration file {} gives {key} {what}: it takes what --{key} takes",
            path.display()
        )
    };
    let mut args = Vec::new();
    match (arg.get_action(), value) {
        (ArgAction::SetTrue, toml::Value::Boolean(on)) => {
            if *on {
                args.push(flag.into());
            }
        }
        (ArgAction::SetTrue, _) => return Err(bad("a value that is not true or false")),
        (_, toml::Value::Array(items)) => {
            let items: Vec<String> = items
                .iter()
                .map(scalar)
                .collect::<Option<_>>()
                .ok_or_else(|| bad("an array of something else than strings or numbers"))?;
            if items.is_empty() {
                return Err(bad("an empty array"));
            }
            // One argument each, so a value that starts with '-' stays a value.
            for item in items {
                args.push(format!("{flag}={item}").into());
            }
        }
        (_, value) => {
            let value = scalar(value).ok_or_else(|| bad("a table"))?;
            args.push(format!("{flag}={value}").into());
        }
    }
    Ok(args)
}

/// A TOML string, number or boolean as a flag's value.
fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The binary's part of `docs/configuration.md` when it was run with nothing but
/// `--config-reference` (how `make config-doc` asks each binary), else `None`.
pub fn reference_requested<T: Parser>() -> Option<String> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    (args == [REFERENCE_FLAG]).then(|| reference(&T::command()))
}

/// The binary's part of `docs/configuration.md`: how its settings are given, then every
/// setting of the binary and of each of its commands, with its flag, variable, default
/// and help.
pub fn reference(root: &Command) -> String {
    let name = root.get_name();
    let config_env = root
        .get_arguments()
        .find(|a| a.get_id() == "config")
        .and_then(Arg::get_env)
        .map(|e| format!(", or `{}`", e.to_string_lossy()))
        .unwrap_or_default();
    let commands = if root.has_subcommands() {
        format!(
            " A top-level setting applies to whichever command runs and has that flag; a \
             table named as a command (`[{}]`) holds settings for that command only, which \
             win over the top-level ones.",
            root.get_subcommands()
                .next()
                .map(Command::get_name)
                .unwrap_or_default()
        )
    } else {
        String::new()
    };
    let mut out = format!(
        "## {name}\n\n\
         Settings come from a TOML file (`--config FILE`{config_env}), environment variables \
         and flags; a flag beats its variable, which beats the file, which beats the default. \
         In the file a setting is named as its long flag (`key = \"value\"`, a list as an \
         array, a switch as `true`).{commands} A setting {name} does not know is refused, \
         naming it. `{name} --print-config` prints the configuration in force in the file's \
         format, each setting with where it came from (passwords and tokens hidden). Values \
         are checked when the command that takes them runs; an error names the setting \
         (and the file).\n\n"
    );
    table(&mut out, root, &[]);
    out
}

/// The settings table of `command` (at `path`), then of each of its subcommands.
fn table(out: &mut String, command: &Command, path: &[&str]) {
    let args: Vec<&Arg> = settings(command).collect();
    if !args.is_empty() {
        if !path.is_empty() {
            out.push_str(&format!(
                "### `{}` (file table `[{}]`)\n\n",
                path.join(" "),
                path.join(".")
            ));
        }
        out.push_str(
            "| setting (file key, `--flag`) | environment | default | what it does |\n\
             | --- | --- | --- | --- |\n",
        );
        for arg in args {
            out.push_str(&row(arg));
        }
        out.push('\n');
    }
    for sub in command.get_subcommands() {
        if sub.get_name() == "help" {
            continue;
        }
        let mut deeper = path.to_vec();
        deeper.push(sub.get_name());
        table(out, sub, &deeper);
    }
}

fn row(arg: &Arg) -> String {
    let key = arg.get_long().unwrap_or_default();
    let env = arg
        .get_env()
        .map(|e| format!("`{}`", e.to_string_lossy()))
        .unwrap_or_default();
    let default: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    let default = if default.is_empty() {
        match arg.get_action() {
            ArgAction::SetTrue => "`false`".to_owned(),
            _ => "none".to_owned(),
        }
    } else {
        format!("`{}`", default.join(","))
    };
    let help = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|");
    let global = if arg.is_global_set() {
        " (every command)"
    } else {
        ""
    };
    format!("| `{key}`{global} | {env} | {default} | {help} |\n")
}

/// Fails, naming the command that rewrites it, when `doc` lacks `binary`'s part as
/// [`reference`] writes it now.
pub fn check_reference(doc: &Path, root: &Command) -> Result<(), String> {
    let text = std::fs::read_to_string(doc).unwrap_or_default();
    if text.contains(&reference(root)) {
        Ok(())
    } else {
        Err(format!(
            "{} is stale for {}: run `make config-doc`",
            doc.display(),
            root.get_name()
        ))
    }
}

#[cfg(test)]
mod tests;
