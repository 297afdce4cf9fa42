//! One configuration story for the proxy: a TOML file, environment variables and flags,
//! in that order of precedence (a flag beats its variable, which beats the file, which
//! beats the default).
//!
//! The file's settings are named as the long flags (`lease-ttl = "10s"`, `etcd =
//! ["http://10.0.1.5:2379"]`, `grants-without-tls = true`); values are what the flag
//! takes, as TOML strings, numbers, booleans or arrays. A setting that is not a flag is
//! refused, naming it. `--print-config` shows every setting in force and where it came
//! from, in the file's format (passwords hidden), so it can be the start of a file.
//! `docs/configuration.md` is generated from the same flags ([`reference`]).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::Path;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches};

use crate::config::ProxyConfig;

/// Flags that are not settings.
const NOT_SETTINGS: &[&str] = &["help", "version", "config", "print-config"];

/// The configuration from `args` (the program name first), the environment and the
/// file `--config` names, or the error to print, which names the bad value (and the
/// file, when the value came from there).
pub fn load(args: Vec<OsString>) -> Result<Loaded, clap::Error> {
    let command = ProxyConfig::command();
    // What the flags and the environment give, before the file: rules between settings
    // (one requiring another) wait for the whole, on the final parse.
    let given = command
        .clone()
        .ignore_errors(true)
        .try_get_matches_from(&args)?;
    let Some(path) = given.get_one::<std::path::PathBuf>("config").cloned() else {
        let given = command.clone().try_get_matches_from(&args)?;
        return Ok(Loaded {
            config: ProxyConfig::from_arg_matches(&given)?,
            matches: given,
            from_file: BTreeSet::new(),
            file: None,
        });
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
    let (file_args, from_file) = file_args(&command, &given, &path, &text).map_err(in_file)?;
    let mut all = vec![args[0].clone()];
    all.extend(file_args);
    all.extend(args.into_iter().skip(1));
    let matches = command.clone().try_get_matches_from(all).map_err(|e| {
        use clap::error::ErrorKind::{DisplayHelp, DisplayVersion};
        if matches!(e.kind(), DisplayHelp | DisplayVersion) {
            return e;
        }
        // clap's own message (without its usage lines and its "error: ").
        let message = e.to_string();
        let message = message.split("\n\nUsage").next().unwrap_or_default().trim();
        in_file(format!(
            "with the configuration file {}: {}",
            path.display(),
            message.strip_prefix("error: ").unwrap_or(message)
        ))
    })?;
    Ok(Loaded {
        config: ProxyConfig::from_arg_matches(&matches)?,
        matches,
        from_file,
        file: Some(path),
    })
}

/// A loaded configuration and where each of its values came from.
pub struct Loaded {
    pub config: ProxyConfig,
    matches: ArgMatches,
    /// The settings the file gave (and neither a flag nor a variable overrode).
    from_file: BTreeSet<String>,
    file: Option<std::path::PathBuf>,
}

impl Loaded {
    /// Every setting in force, in the file's format, each with where it came from.
    pub fn render(&self) -> String {
        let command = ProxyConfig::command();
        let mut out = String::from("# lockcell-proxy: the configuration in force\n");
        if let Some(file) = &self.file {
            out.push_str(&format!("# file: {}\n", file.display()));
        }
        for arg in settings(&command) {
            let id = arg.get_id().as_str();
            let key = arg.get_long().unwrap_or(id);
            let source = if self.from_file.contains(key) {
                "file".to_owned()
            } else {
                match self.matches.value_source(id) {
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
            };
            let values: Vec<String> = self
                .matches
                .get_raw(id)
                .map(|raw| raw.map(|v| v.to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            let line = if values.is_empty() {
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
            };
            out.push_str(&format!("{line:<60} # {source}\n"));
        }
        out
    }
}

/// The flags of `command` that are settings.
fn settings(command: &Command) -> impl Iterator<Item = &clap::Arg> {
    command.get_arguments().filter(|a| {
        a.get_long()
            .is_some_and(|long| !NOT_SETTINGS.contains(&long))
    })
}

fn is_secret(key: &str) -> bool {
    key.contains("password") || key.contains("token")
}

fn quote(value: &str) -> String {
    toml::Value::String(value.to_owned()).to_string()
}

/// The file's settings as flags, but for those a flag or a variable gave (`given`);
/// and the names of the settings taken from the file.
fn file_args(
    command: &Command,
    given: &ArgMatches,
    path: &Path,
    text: &str,
) -> Result<(Vec<OsString>, BTreeSet<String>), String> {
    // The parser's message, and where; not its quote of the line, which may hold a
    // password.
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let line = e
            .span()
            .map(|span| text[..span.start.min(text.len())].lines().count().max(1));
        format!(
            "the configuration file {} is not TOML{}: {}",
            path.display(),
            line.map(|l| format!(" (line {l})")).unwrap_or_default(),
            e.message()
        )
    })?;
    let mut args = Vec::new();
    let mut taken = BTreeSet::new();
    for (key, value) in &table {
        let Some(arg) = settings(command).find(|a| a.get_long() == Some(key.as_str())) else {
            return Err(format!(
                "the configuration file {} has an unknown setting {key:?}: settings are named as the long flags of `lockcell-proxy --help` (for example lease-ttl)",
                path.display()
            ));
        };
        if matches!(
            given.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let flag = format!("--{key}");
        let bad = |what: &str| {
            format!(
                "the configuration file {} gives {key} {what}: it takes what --{key} takes",
                path.display()
            )
        };
        match (arg.get_action(), value) {
            (ArgAction::SetTrue, toml::Value::Boolean(on)) => {
                if *on {
                    args.push(flag.clone().into());
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
        taken.insert(key.clone());
    }
    Ok((args, taken))
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

/// `docs/configuration.md`'s part for the proxy: every setting with its flag, variable,
/// default and help.
pub fn reference() -> String {
    let command = ProxyConfig::command();
    let mut out = String::from(
        "## lockcell-proxy\n\n\
         Settings come from a TOML file (`--config FILE`, or `LOCKCELL_CONFIG`), environment \
         variables and flags; a flag beats its variable, which beats the file, which beats the \
         default. In the file a setting is named as its long flag: `lease-ttl = \"10s\"`, \
         `etcd = [\"http://10.0.1.5:2379\"]`, `grants-without-tls = true`. A setting the proxy \
         does not know is refused, naming it. `lockcell-proxy --print-config` prints the \
         configuration in force in the file's format, each setting with where it came from \
         (passwords hidden). Values are checked at start; an error names the setting (and \
         the file).\n\n\
         | setting (file key, `--flag`) | environment | default | what it does |\n\
         | --- | --- | --- | --- |\n",
    );
    for arg in settings(&command) {
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
        out.push_str(&format!("| `{key}` | {env} | {default} | {help} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        std::iter::once("lockcell-proxy")
            .chain(list.iter().copied())
            .map(OsString::from)
            .collect()
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        file
    }

    #[test]
    fn a_flag_beats_the_file_which_beats_the_default() {
        let f = file(
            "lease-ttl = \"12s\"\nzone = \"b\"\netcd = [\"http://e1:2379\", \"http://e2:2379\"]\nleases = 8\ngrants-without-tls = true\n",
        );
        let path = f.path().to_str().unwrap();
        let loaded = load(args(&["--config", path, "--zone", "c"])).unwrap();
        let c = &loaded.config;
        assert_eq!(c.lease_ttl, std::time::Duration::from_secs(12));
        assert_eq!(c.zone, "c", "the flag wins over the file");
        assert_eq!(c.etcd_endpoints, ["http://e1:2379", "http://e2:2379"]);
        assert_eq!(c.leases, 8);
        assert!(c.grants_without_tls);
        let shown = loaded.render();
        assert!(shown.contains("lease-ttl = \"12s\""), "{shown}");
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("zone = \"c\"") && l.ends_with("# flag")),
            "{shown}"
        );
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("leases = \"8\"") && l.ends_with("# file")),
            "{shown}"
        );
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("session-ttl =") && l.ends_with("# default")),
            "{shown}"
        );
    }

    #[test]
    fn a_bad_file_is_refused_naming_the_setting_and_the_file() {
        let unknown = file("lease-tll = \"3s\"\n");
        let e = load(args(&["--config", unknown.path().to_str().unwrap()]))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("lease-tll") && e.contains("unknown setting"),
            "{e}"
        );
        let bad_value = file("lease-ttl = \"soon\"\n");
        let e = load(args(&["--config", bad_value.path().to_str().unwrap()]))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("configuration file") && e.contains("lease-ttl") && e.contains("soon"),
            "{e}"
        );
        let not_toml = file("lease-ttl = \n");
        let e = load(args(&["--config", not_toml.path().to_str().unwrap()]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not TOML"), "{e}");
        let e = load(args(&["--config", "/nonexistent/lockcell.toml"]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("/nonexistent/lockcell.toml"), "{e}");
    }

    #[test]
    fn the_example_file_loads_and_validates() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/proxy.toml");
        let loaded = load(args(&["--config", path.to_str().unwrap()])).unwrap();
        loaded.config.validate().unwrap();
        assert_eq!(loaded.config.zone, "a");
        assert_eq!(loaded.config.etcd_endpoints.len(), 3);
    }

    #[test]
    fn passwords_never_show() {
        let f = file("etcd-password = \"--hunter2\"\netcd-user = \"lockcell-proxy\"\n");
        let loaded = load(args(&["--config", f.path().to_str().unwrap()])).unwrap();
        assert_eq!(
            loaded.config.etcd_password.as_ref().map(|p| p.expose()),
            Some("--hunter2"),
            "a value that starts with '-' is a value"
        );
        let shown = loaded.render();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("etcd-password = \"(hidden)\""), "{shown}");
        // Nor in the error about a broken file.
        let broken = file("etcd-password = \"hunter2\n");
        let e = load(args(&["--config", broken.path().to_str().unwrap()]))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("not TOML (line 1)") && !e.contains("hunter2"),
            "{e}"
        );
    }

    #[test]
    fn a_setting_that_requires_another_may_find_it_in_the_file() {
        let f = file("etcd-tls-cert = \"/etc/lockcell/client.pem\"\n");
        let loaded = load(args(&[
            "--config",
            f.path().to_str().unwrap(),
            "--etcd-tls-key",
            "/etc/lockcell/client.key",
        ]))
        .unwrap();
        assert!(loaded.config.etcd_tls.etcd_tls_cert.is_some());
        // And a missing one is named.
        let e = load(args(&["--config", f.path().to_str().unwrap()]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--etcd-tls-key"), "{e}");
    }

    #[test]
    fn the_configuration_reference_is_up_to_date() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
        let doc = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            doc.contains(&reference()),
            "{} is stale: run `make config-doc`",
            path.display()
        );
    }
}
