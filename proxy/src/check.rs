//! `lockcell-proxy --check-config`: reads every file a start would read, with the code a
//! start reads it with, and says what it found, without contacting etcd. Run it before
//! restarting a proxy: a file a running proxy refused (and keeps the last good version
//! of) would stop the restarted one from starting.
//!
//! Checked: the settings (flags, environment, `--config`), `--admin-token-file`,
//! `--classes`, `--grants`, the gRPC service's TLS (`--tls-cert`, `--tls-key`,
//! `--tls-client-ca`), etcd's TLS (`--etcd-tls-*`) and `--state-dir`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::ProxyConfig;
use crate::declared::Declared;

/// What a check found: a line for each file that passed, an error for each refused.
#[derive(Debug, Default)]
pub struct Report {
    /// `classes /etc/lockcell/classes.toml: 4 classes`.
    pub checked: Vec<String>,
    /// Each as a start would say it: the file, and the line when known.
    pub refused: Vec<anyhow::Error>,
}

impl Report {
    /// Whether a start would get past every file.
    pub fn ok(&self) -> bool {
        self.refused.is_empty()
    }

    fn note(&mut self, result: anyhow::Result<String>) {
        match result {
            Ok(line) => self.checked.push(line),
            Err(e) => self.refused.push(e),
        }
    }

    fn note_all(&mut self, results: Vec<anyhow::Result<String>>) {
        for result in results {
            self.note(result);
        }
    }
}

/// Checks everything `config` makes a start read (see the module's documentation).
pub fn check(config: &ProxyConfig) -> Report {
    let mut report = Report::default();
    report.note(settings(config));
    if let Some(file) = &config.admin_token_file {
        report.note(admin_token(file));
    }
    if let Some(file) = &config.classes {
        report.note(classes(config, file));
    }
    if let Some(file) = &config.grants {
        report.note(grants(file));
    }
    if let Some(files) = crate::listen::tls_files(config) {
        report.note_all(tls(files));
    }
    report.note_all(etcd_tls(&config.etcd_tls));
    if let Some(dir) = &config.state_dir {
        report.note_all(state_dir(dir));
    }
    report
}

fn settings(config: &ProxyConfig) -> anyhow::Result<String> {
    config.validate()?;
    Ok(match &config.config {
        Some(file) => format!("config {}: valid", file.display()),
        None => "settings (flags and environment, no --config): valid".to_owned(),
    })
}

fn admin_token(file: &Path) -> anyhow::Result<String> {
    lockcell_cell::access::read_admin_token(file)?;
    Ok(format!("admin-token-file {}: token read", file.display()))
}

/// As [`crate::run`] loads them: the same book, the same fallback.
fn classes(config: &ProxyConfig, file: &Path) -> anyhow::Result<String> {
    let book = crate::classes::ClassBook::load(
        Some(file.to_owned()),
        crate::classes::Classes::builtin(config.session_ttl_min, config.session_ttl_max),
    )?;
    let count = book.current().count();
    Ok(format!("classes {}: {count} classes", file.display()))
}

fn grants(file: &Path) -> anyhow::Result<String> {
    let book =
        crate::access::AccessBook::load(Some(file.to_owned()), crate::access::AccessRules::open())?;
    let count = book.current().count();
    Ok(format!(
        "grants {}: {count} entries ([[grant]] and [[token]])",
        file.display()
    ))
}

/// The gRPC service's TLS, built as a start builds it; then what each file holds.
fn tls(files: crate::tls::TlsFiles) -> Vec<anyhow::Result<String>> {
    if let Err(e) = crate::tls::ReloadingTls::load(files.clone()) {
        return vec![Err(e)];
    }
    let mut lines = vec![
        count_certificates(&files.cert).map(|n| format!("tls-cert {}: {n}", files.cert.display())),
        Ok(format!(
            "tls-key {}: goes with --tls-cert",
            files.key.display()
        )),
    ];
    if let Some(ca) = &files.client_ca {
        lines.push(count_certificates(ca).map(|n| format!("tls-client-ca {}: {n}", ca.display())));
    }
    lines
}

fn count_certificates(file: &Path) -> anyhow::Result<String> {
    let n = certificates(file)?.len();
    Ok(match n {
        1 => "1 certificate".to_owned(),
        n => format!("{n} certificates"),
    })
}

fn certificates(file: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("cannot read the certificates in {}: {e}", file.display()))
}

/// etcd's TLS: read as a start reads it ([`EtcdTls::apply`](lockcell_cell::etcd_tls::EtcdTls::apply)),
/// then parsed as the etcd client does when it connects. A start does that only when it
/// connects, and retries a connection that fails, so there a bad file shows only as a
/// proxy that never gets ready.
fn etcd_tls(tls: &lockcell_cell::etcd_tls::EtcdTls) -> Vec<anyhow::Result<String>> {
    if let Err(e) = tls.apply(etcd_client::ConnectOptions::new()) {
        return vec![Err(e)];
    }
    let Some(ca) = &tls.etcd_tls_ca else {
        return Vec::new();
    };
    let mut roots = rustls::RootCertStore::empty();
    let ca_line = certificates(ca).and_then(|certs| {
        let (added, _) = roots.add_parsable_certificates(certs);
        anyhow::ensure!(
            added > 0,
            "the etcd CA certificate (--etcd-tls-ca) {} holds no usable certificate: no etcd member's certificate could be checked",
            ca.display()
        );
        Ok(format!("etcd-tls-ca {}: {added} CA certificate(s)", ca.display()))
    });
    let mut lines = vec![ca_line];
    if let (Some(cert), Some(key)) = (&tls.etcd_tls_cert, &tls.etcd_tls_key) {
        let identity = certificates(cert).and_then(|certs| {
            anyhow::ensure!(
                !certs.is_empty(),
                "the etcd client certificate (--etcd-tls-cert) {} holds no certificate",
                cert.display()
            );
            let private = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                anyhow::anyhow!(
                    "cannot read the etcd client key (--etcd-tls-key) {}: {e}",
                    key.display()
                )
            })?;
            let provider = rustls::crypto::CryptoProvider::get_default()
                .cloned()
                .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots.clone())
                .with_client_auth_cert(certs, private)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "the etcd client key {} does not go with the certificate {}: {e}",
                        key.display(),
                        cert.display()
                    )
                })?;
            Ok(())
        });
        match identity {
            Ok(()) => lines.extend([
                Ok(format!("etcd-tls-cert {}: loaded", cert.display())),
                Ok(format!(
                    "etcd-tls-key {}: goes with --etcd-tls-cert",
                    key.display()
                )),
            ]),
            Err(e) => lines.push(Err(e)),
        }
    }
    lines
}

/// The folder a start writes `cell.json` to (creating it if need be), and what it
/// remembers there: a file a start could not read stops it. A proxy that serves
/// several cells keeps one folder per cell in it; those are checked too.
fn state_dir(dir: &Path) -> Vec<anyhow::Result<String>> {
    if !dir.exists() {
        let parent = dir.ancestors().skip(1).find(|a| a.exists());
        return vec![match parent {
            Some(parent) => writable(parent).map(|()| {
                format!(
                    "state-dir {}: absent; a start creates it (in {}, writable)",
                    dir.display(),
                    parent.display()
                )
            }),
            None => Err(anyhow::anyhow!(
                "state-dir {}: no folder of its path exists",
                dir.display()
            )),
        }];
    }
    let mut dirs = vec![dir.to_owned()];
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut cells: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join(CELL_FILE).is_file())
            .collect();
        cells.sort();
        dirs.extend(cells);
    }
    dirs.iter().map(|d| remembered(d)).collect()
}

/// The file [`crate::cellguard::CellGuard`] keeps in the state folder.
const CELL_FILE: &str = "cell.json";

fn remembered(dir: &Path) -> anyhow::Result<String> {
    anyhow::ensure!(dir.is_dir(), "state-dir {} is not a folder", dir.display());
    writable(dir)?;
    let path = dir.join(CELL_FILE);
    let body = match std::fs::read(&path) {
        Ok(body) => body,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(format!(
                "state-dir {}: writable, remembers no cell yet",
                dir.display()
            ))
        }
        Err(e) => anyhow::bail!("cannot read {}: {e}", path.display()),
    };
    let cell: crate::cellguard::Remembered = serde_json::from_slice(&body).map_err(|e| {
        anyhow::anyhow!(
            "{} is not readable: {e}; move it away to start afresh",
            path.display()
        )
    })?;
    Ok(format!(
        "state-dir {}: writable, remembers cluster {} epoch {} revision {}",
        dir.display(),
        cell.cluster_id,
        cell.epoch,
        cell.revision
    ))
}

/// Whether this process may create files in `dir`: by creating one, and removing it.
fn writable(dir: &Path) -> anyhow::Result<()> {
    let probe = dir.join(format!(".lockcell-check-config.{}.tmp", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| anyhow::anyhow!("state-dir: cannot write in {}: {e}", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn config(args: &[&str]) -> ProxyConfig {
        let mut argv = vec!["lockcell-proxy", "--check-config"];
        argv.extend_from_slice(args);
        ProxyConfig::try_parse_from(argv).expect("parses")
    }

    fn errors(report: &Report) -> String {
        report
            .refused
            .iter()
            .map(|e| format!("{e:#}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_example_files_pass() {
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config");
        let classes = deploy.join("classes.toml");
        let grants = deploy.join("grants.toml");
        let c = config(&[
            "--classes",
            classes.to_str().unwrap(),
            "--grants",
            grants.to_str().unwrap(),
            "--grants-without-tls",
        ]);
        assert!(c.check_config);
        let report = check(&c);
        assert!(report.ok(), "{}", errors(&report));
        let lines = report.checked.join("\n");
        assert!(lines.contains("classes.toml: 4 classes"), "{lines}");
        assert!(lines.contains("grants.toml: "), "{lines}");
    }

    #[test]
    fn a_bad_file_is_refused_naming_its_line_and_the_others_still_checked() {
        let dir = tempfile::tempdir().unwrap();
        let grants = dir.path().join("grants.toml");
        std::fs::write(
            &grants,
            "[[grant]]\nidentity = \"a\"\nlock = [\"a/\"]\n\n[[grant]\nidentity = \"b\"\n",
        )
        .unwrap();
        let classes = dir.path().join("classes.toml");
        std::fs::write(&classes, "[[class]]\nname = \"a\"\nprefix = \"a/\"\n").unwrap();
        let c = config(&[
            "--classes",
            classes.to_str().unwrap(),
            "--grants",
            grants.to_str().unwrap(),
            "--grants-without-tls",
        ]);
        let report = check(&c);
        assert!(!report.ok());
        let refused = errors(&report);
        assert!(
            refused.contains(&format!("{}:5:", grants.display())),
            "{refused}"
        );
        assert!(
            report.checked.iter().any(|l| l.contains("1 classes")),
            "{:?}",
            report.checked
        );
    }

    #[test]
    fn missing_and_bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "short\n").unwrap();
        let cert = dir.path().join("cert.pem");
        std::fs::write(&cert, "not a certificate\n").unwrap();
        let key = dir.path().join("key.pem");
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::fs::write(state.join("cell.json"), "{").unwrap();
        let c = config(&[
            "--admin-token-file",
            token.to_str().unwrap(),
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--etcd-tls-ca",
            dir.path().join("absent-ca.pem").to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ]);
        let report = check(&c);
        let refused = errors(&report);
        assert_eq!(report.refused.len(), 4, "{refused}");
        for named in ["token", "cert.pem", "absent-ca.pem", "cell.json"] {
            assert!(refused.contains(named), "{named}: {refused}");
        }
    }

    #[test]
    fn tls_files_that_go_together_pass() {
        // As main does: this process uses ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert, ca.cert.pem()).unwrap();
        std::fs::write(&key, ca.signing_key.serialize_pem()).unwrap();
        let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let other_key = dir.path().join("other-key.pem");
        std::fs::write(&other_key, other.signing_key.serialize_pem()).unwrap();
        let state = dir.path().join("state/sub");
        let (cert, key, other_key) = (
            cert.to_str().unwrap(),
            key.to_str().unwrap(),
            other_key.to_str().unwrap(),
        );
        let good = check(&config(&[
            "--tls-cert",
            cert,
            "--tls-key",
            key,
            "--tls-client-ca",
            cert,
            "--etcd-tls-ca",
            cert,
            "--etcd-tls-cert",
            cert,
            "--etcd-tls-key",
            key,
            "--state-dir",
            state.to_str().unwrap(),
        ]));
        assert!(good.ok(), "{}", errors(&good));
        assert_eq!(good.checked.len(), 8, "{:#?}", good.checked);
        let bad = check(&config(&[
            "--tls-cert",
            cert,
            "--tls-key",
            other_key,
            "--etcd-tls-ca",
            cert,
            "--etcd-tls-cert",
            cert,
            "--etcd-tls-key",
            other_key,
        ]));
        let refused = errors(&bad);
        assert!(refused.contains("does not go with"), "{refused}");
        assert!(refused.contains("etcd client key"), "{refused}");
    }
}
