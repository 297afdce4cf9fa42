//! TLS between lockcell's processes and etcd: the CA that signed etcd's certificates
//! and, for an etcd that runs with `--client-cert-auth`, the process's own certificate.
//! The same flags on `lockcell-proxy` and `lockcell-cell`.

use std::path::{Path, PathBuf};

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};

/// `--etcd-tls-*`: how to reach etcd over TLS. Without `--etcd-tls-ca`, plain HTTP/2.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EtcdTls {
    /// CA certificate (PEM) that signed etcd's server certificates: talk to etcd over
    /// TLS (the --etcd endpoints then mean https://).
    #[arg(long, env = "LOCKCELL_ETCD_TLS_CA")]
    pub etcd_tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for an etcd that runs with --client-cert-auth.
    #[arg(long, env = "LOCKCELL_ETCD_TLS_CERT", requires = "etcd_tls_key")]
    pub etcd_tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --etcd-tls-cert.
    #[arg(long, env = "LOCKCELL_ETCD_TLS_KEY", requires = "etcd_tls_cert")]
    pub etcd_tls_key: Option<PathBuf>,

    /// The name etcd's certificates are checked against (default: each endpoint's
    /// host).
    #[arg(long, env = "LOCKCELL_ETCD_TLS_DOMAIN")]
    pub etcd_tls_domain: Option<String>,
}

impl EtcdTls {
    /// `options` with TLS to etcd when --etcd-tls-ca is set; an error names the file it
    /// could not read.
    pub fn apply(&self, options: ConnectOptions) -> anyhow::Result<ConnectOptions> {
        let Some(ca) = &self.etcd_tls_ca else {
            anyhow::ensure!(
                self.etcd_tls_cert.is_none(),
                "--etcd-tls-cert needs --etcd-tls-ca (the CA that signed etcd's certificates)"
            );
            return Ok(options);
        };
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read(
            ca,
            "the etcd CA certificate (--etcd-tls-ca)",
        )?));
        if let (Some(cert), Some(key)) = (&self.etcd_tls_cert, &self.etcd_tls_key) {
            tls = tls.identity(Identity::from_pem(
                read(cert, "the etcd client certificate (--etcd-tls-cert)")?,
                read(key, "the etcd client key (--etcd-tls-key)")?,
            ));
        }
        if let Some(domain) = &self.etcd_tls_domain {
            tls = tls.domain_name(domain.clone());
        }
        Ok(options.with_tls(tls))
    }
}

fn read(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| anyhow::anyhow!("cannot read {what} {}: {e}", path.display()))
}
