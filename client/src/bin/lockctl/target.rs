//! Which proxies lockctl talks to, and how it proves who it is to them.

use std::fmt;
use std::path::PathBuf;

use lockcell_client::{Client, ClientOptions, ConnectSettings, Error};

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
        if args.tls_cert.is_some() && args.tls_ca.is_none() {
            anyhow::bail!(
                "--tls-cert needs --tls-ca (the CA that signed the proxies' certificates)"
            );
        }
        let mut settings = ConnectSettings::new(addrs);
        settings.tls_ca = args.tls_ca.clone();
        settings.tls_identity = args.tls_cert.clone().zip(args.tls_key.clone());
        settings.tls_domain = args.tls_domain.clone();
        settings.auth_token = args.auth_token.clone();
        Ok(Target {
            addrs: addrs.to_owned(),
            options: settings.options()?,
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
