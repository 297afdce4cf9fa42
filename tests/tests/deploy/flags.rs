//! Every flag and `LOCKCELL_*` variable the deployment files give lockcell's binaries
//! (and etcd) is one their `--help` shows.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};

use crate::kubernetes::{command_line, containers, manifests};
use crate::systemd::exec_start;
use crate::{files, on_path};

/// The folder the workspace's binaries were built into (the test runs from its deps/).
pub(crate) fn built_binaries() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("no target folder")?;
    for bin in ["lockcell-proxy", "lockcell-cell", "lockctl"] {
        if !dir.join(bin).is_file() {
            return Err(format!(
                "{bin} is not built in {} (cargo build --workspace --bins)",
                dir.display()
            ));
        }
    }
    Ok(dir.to_path_buf())
}

/// Every `--flag` and `LOCKCELL_*` name a program's help (and its subcommand's) shows.
fn help_words(program: &Path, sub: Option<&str>) -> Result<BTreeSet<String>> {
    let mut text = String::new();
    let mut calls = vec![vec!["--help"]];
    if let Some(sub) = sub {
        calls.push(vec![sub, "--help"]);
    }
    for call in calls {
        let out = Command::new(program)
            .args(&call)
            .output()
            .with_context(|| format!("{}", program.display()))?;
        text.push_str(&String::from_utf8_lossy(&out.stdout));
        text.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    let words = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|w| w.starts_with("--") || w.starts_with("LOCKCELL_"))
        .map(str::to_owned)
        .collect();
    Ok(words)
}

/// Checks a command line's flags, and `variables`, against the program's help.
fn check_words(
    bins: &Path,
    line: &[String],
    variables: &[String],
    helps: &mut BTreeMap<String, BTreeSet<String>>,
) -> Result<Option<String>> {
    let program = Path::new(&line[0])
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let path = match program.as_str() {
        "lockcell-proxy" | "lockcell-cell" | "lockctl" => bins.join(&program),
        "etcd" => match on_path("etcd") {
            Some(etcd) => etcd,
            None => return Ok(Some("no etcd on PATH: its flags are not checked".into())),
        },
        _ => return Ok(None),
    };
    let sub = line
        .get(1)
        .filter(|w| !w.starts_with('-'))
        .map(String::as_str);
    let key = match sub {
        Some(sub) => format!("{program} {sub}"),
        None => program.clone(),
    };
    if !helps.contains_key(&key) {
        helps.insert(key.clone(), help_words(&path, sub)?);
    }
    let known = &helps[&key];
    let flags = line
        .iter()
        .take_while(|w| *w != "--")
        .filter(|w| w.starts_with("--"));
    for word in flags.chain(variables.iter().filter(|v| v.starts_with("LOCKCELL_"))) {
        let name = word.split('=').next().unwrap_or_default();
        ensure!(
            known.contains(name),
            "`{key}` has no {name} (see its --help)"
        );
    }
    Ok(None)
}

pub(crate) fn flags_and_variables_are_the_binaries_own(bins: PathBuf) -> Result<()> {
    let mut helps = BTreeMap::new();
    let mut notes = BTreeSet::new();
    for doc in manifests()? {
        let Some(pod) = doc.pod() else { continue };
        for container in containers(pod) {
            let line = command_line(container);
            let env: Vec<String> = container["env"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| e["name"].as_str().map(str::to_owned))
                .collect();
            if line.is_empty() {
                continue;
            }
            let note = check_words(&bins, &line, &env, &mut helps).with_context(|| doc.name())?;
            notes.extend(note);
        }
    }
    for unit in files("deploy/systemd", "service")? {
        let line = exec_start(&std::fs::read_to_string(&unit)?);
        let example = unit.with_extension("env.example");
        let variables: Vec<String> = std::fs::read_to_string(&example)
            .with_context(|| format!("reading {}", example.display()))?
            .lines()
            .filter_map(|l| Some(l.trim_start_matches('#').split_once('=')?.0.to_owned()))
            .collect();
        check_words(&bins, &line, &variables, &mut helps)
            .with_context(|| unit.display().to_string())?;
    }
    for note in notes {
        let _ = writeln!(std::io::stderr(), "deploy: {note}");
    }
    Ok(())
}
