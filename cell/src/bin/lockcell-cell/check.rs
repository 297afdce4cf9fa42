//! `lockcell-cell --check-config COMMAND`: reads the files the command would read, as it
//! reads them, without contacting etcd, and says what it found.

use std::path::Path;

use anyhow::Context;

use crate::{AuditArgs, Cli, Command, EtcdAddress};

/// Checks the files `cli`'s command would read, prints a line for each (stdout) and each
/// error (stderr), and exits: 0 when the command would get past every file, else 1.
pub fn exit(cli: &Cli) -> ! {
    let (checked, refused) = check(cli);
    for line in &checked {
        println!("{line}");
    }
    for e in &refused {
        eprintln!("lockcell-cell: {e:#}");
    }
    if refused.is_empty() {
        println!("lockcell-cell: configuration OK");
        std::process::exit(0);
    }
    eprintln!(
        "lockcell-cell: configuration refused ({} problem(s)): the command would fail; fix the file(s) and check again",
        refused.len()
    );
    std::process::exit(1);
}

/// The lines of what passed, and the errors of what did not.
fn check(cli: &Cli) -> (Vec<String>, Vec<anyhow::Error>) {
    let mut results = vec![Ok(match &cli.config {
        Some(file) => format!(
            "config {}: valid for `{}`",
            file.display(),
            name(&cli.command)
        ),
        None => format!(
            "settings of `{}` (flags and environment, no --config): valid",
            name(&cli.command)
        ),
    })];
    match &cli.command {
        Command::Init(etcd) | Command::Epoch(etcd) => results.push(etcd_tls(&etcd.address)),
        Command::BumpEpoch(args) => results.push(etcd_tls(&args.etcd.address)),
        Command::AuthEnable(args) => results.push(etcd_tls(&args.etcd)),
        Command::Audit(args) => {
            results.push(etcd_tls(&args.etcd.address));
            results.extend(audit(args));
        }
        Command::Status(args) => results.push(etcd_tls(&args.etcd.address)),
        Command::ForceRelease(args) => results.push(etcd_tls(&args.etcd.address)),
        // Its etcd settings are the shard map command's own.
        Command::Shardmap(_) => {}
    }
    let mut checked = Vec::new();
    let mut refused = Vec::new();
    for result in results {
        match result {
            Ok(line) if line.is_empty() => {}
            Ok(line) => checked.push(line),
            Err(e) => refused.push(e),
        }
    }
    (checked, refused)
}

fn name(command: &Command) -> &'static str {
    match command {
        Command::Init(_) => "init",
        Command::Epoch(_) => "epoch",
        Command::BumpEpoch(_) => "bump-epoch",
        Command::Audit(_) => "audit",
        Command::AuthEnable(_) => "auth-enable",
        Command::Shardmap(_) => "shardmap",
        Command::Status(_) => "status",
        Command::ForceRelease(_) => "force-release",
    }
}

/// The --etcd-tls-* files, read as a connection reads them (nothing to say without).
fn etcd_tls(address: &EtcdAddress) -> anyhow::Result<String> {
    address.options()?;
    let tls = &address.tls;
    Ok(
        match (&tls.etcd_tls_ca, &tls.etcd_tls_cert, &tls.etcd_tls_key) {
            (Some(ca), Some(cert), Some(key)) => format!(
                "etcd-tls-ca {}, etcd-tls-cert {}, etcd-tls-key {}: read",
                ca.display(),
                cert.display(),
                key.display()
            ),
            (Some(ca), _, _) => format!("etcd-tls-ca {}: read", ca.display()),
            _ => String::new(),
        },
    )
}

/// What `audit` reads before it opens its store: the rule between --grants and TLS,
/// --admin-token-file, --grants, and --tls-cert with --tls-key (as its HTTPS listener
/// loads them).
fn audit(args: &AuditArgs) -> Vec<anyhow::Result<String>> {
    let mut results = Vec::new();
    if args.grants.is_some() && args.tls_cert.is_none() && !args.grants_without_tls {
        results.push(Err(anyhow::anyhow!(
            "--grants without --tls-cert and --tls-key would take bearer tokens in clear; \
             serve TLS, or pass --grants-without-tls on a test bench"
        )));
    }
    if let Some(file) = &args.admin_token_file {
        results.push(
            lockcell_cell::access::read_admin_token(file)
                .map(|_| format!("admin-token-file {}: token read", file.display())),
        );
    }
    if let Some(file) = &args.grants {
        results.push(grants(file));
    }
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        results.push(
            lockcell_cell::tls::server_config(cert, key, None, &[]).map(|_| {
                format!(
                    "tls-cert {}, tls-key {}: the HTTPS certificate and its key go together",
                    cert.display(),
                    key.display()
                )
            }),
        );
    }
    results
}

/// As `audit` reads it at start (and again at every query).
fn grants(file: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the grants file {}", file.display()))?;
    let rules = lockcell_cell::grants::Rules::parse(&text).map_err(|e| {
        anyhow::anyhow!(
            "the grants file {}{}: {}",
            file.display(),
            e.line.map(|l| format!(" line {l}")).unwrap_or_default(),
            e.message
        )
    })?;
    Ok(format!(
        "grants {}: {} entries ([[grant]] and [[token]])",
        file.display(),
        rules.count()
    ))
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use super::*;

    fn cli(args: &[&str]) -> Cli {
        let args = ["lockcell-cell", "--check-config"]
            .iter()
            .chain(args)
            .map(OsString::from)
            .collect();
        lockcell_settings::load::<Cli>(args).unwrap().config
    }

    #[test]
    fn audit_files_are_checked_and_a_bad_one_named_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.toml");
        std::fs::write(&good, "[[grant]]\nidentity = \"a\"\nlock = [\"a/\"]\n").unwrap();
        let (checked, refused) = check(&cli(&[
            "audit",
            "--grants",
            good.to_str().unwrap(),
            "--grants-without-tls",
        ]));
        assert!(refused.is_empty(), "{refused:?}");
        assert!(
            checked.iter().any(|l| l.contains("good.toml: 1 entries")),
            "{checked:?}"
        );

        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[[grant]]\nidentity = \"a\"\n\n[[grant]\n").unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "short").unwrap();
        let (_, refused) = check(&cli(&[
            "audit",
            "--grants",
            bad.to_str().unwrap(),
            "--admin-token-file",
            token.to_str().unwrap(),
        ]));
        let refused: Vec<String> = refused.iter().map(|e| format!("{e:#}")).collect();
        assert_eq!(refused.len(), 3, "{refused:?}");
        assert!(refused[0].contains("--grants-without-tls"), "{refused:?}");
        assert!(refused[1].contains("token"), "{refused:?}");
        assert!(refused[2].contains("bad.toml line 4"), "{refused:?}");
    }

    #[test]
    fn an_unreadable_etcd_ca_is_named_for_every_command() {
        let (_, refused) = check(&cli(&["init", "--etcd-tls-ca", "/nonexistent/ca.pem"]));
        assert_eq!(refused.len(), 1);
        assert!(refused[0].to_string().contains("/nonexistent/ca.pem"));
    }
}
