//! Which proxies lockctl talks to, and how it proves who it is to them.

use std::fmt;
use std::path::PathBuf;

use anyhow::Context;
use lockcell_client::{Client, ClientOptions, ClientTls, Error};

/// The `--proxy` list with the TLS and token options that go with it.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TargetArgs {
    /// CA certificate (PEM) that signed the proxies' certificates: talk TLS to them.
    #[arg(long, env = "LOCKCELL_TLS_CA", global = true)]
    pub(crate) tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for proxies that require one (mutual TLS); its subject
    /// common name is the identity the proxies' prefix grants know.
    #[arg(
        long,
        env = "LOCKCELL_CLIENT_TLS_CERT",
        global = true,
        requires = "tls_key"
    )]
    pub(crate) tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --tls-cert.
    #[arg(
        long,
        env = "LOCKCELL_CLIENT_TLS_KEY",
        global = true,
        requires = "tls_cert"
    )]
    pub(crate) tls_key: Option<PathBuf>,

    /// The name the proxies' certificates are checked against (default: each proxy
    /// address's host).
    #[arg(long, env = "LOCKCELL_TLS_DOMAIN", global = true)]
    pub(crate) tls_domain: Option<String>,

    /// A bearer token for proxies that check prefix grants without certificates (the
    /// dev cell prints one). Prefer the environment variable to the flag.
    #[arg(
        long = "auth-token",
        env = "LOCKCELL_AUTH_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub(crate) auth_token: Option<String>,
}

/// Where lockctl connects, ready to connect.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    addrs: String,
    options: ClientOptions,
}

impl Target {
    pub(crate) fn new(addrs: &str, args: &TargetArgs) -> anyhow::Result<Target> {
        let list = addrs.split(',').map(str::trim).filter(|a| !a.is_empty());
        let mut options = ClientOptions::new(list);
        if let Some(ca) = &args.tls_ca {
            let read = |path: &PathBuf, what: &str| {
                std::fs::read(path).with_context(|| format!("reading {what} {}", path.display()))
            };
            let identity_pem = match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => Some((
                    read(cert, "the client certificate (--tls-cert)")?,
                    read(key, "the client key (--tls-key)")?,
                )),
                _ => None,
            };
            options = options.tls(ClientTls {
                ca_pem: read(ca, "the CA certificate (--tls-ca)")?,
                identity_pem,
                domain: args.tls_domain.clone(),
            });
        } else if args.tls_cert.is_some() {
            anyhow::bail!(
                "--tls-cert needs --tls-ca (the CA that signed the proxies' certificates)"
            );
        }
        // An empty LOCKCELL_AUTH_TOKEN= is no token, not an empty one.
        if let Some(token) = args.auth_token.as_ref().filter(|t| !t.is_empty()) {
            options = options.token(token.clone());
        }
        Ok(Target {
            addrs: addrs.to_owned(),
            options,
        })
    }

    pub(crate) async fn connect(&self) -> Result<Client, Error> {
        Client::connect_with(self.options.clone()).await
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.addrs)
    }
}
