//! Where a client finds its proxies and credentials by name, as `lockctl`'s flags and
//! the `LOCKCELL_*` environment variables give them: [`Client::from_env`] connects as
//! `lockctl` would.

use std::path::PathBuf;

use crate::client::{Client, ClientOptions};
use crate::error::Error;
use crate::proxies::ClientTls;

/// The proxies and credentials of a client, by file path. Its `Debug` output never
/// shows the token.
///
/// ```no_run
/// # async fn example() -> Result<(), lockcell_client::Error> {
/// use lockcell_client::{Client, ConnectSettings};
///
/// // From the billing service's own configuration file.
/// let mut settings = ConnectSettings::new("proxy.zone-a:7420,proxy.zone-b:7420");
/// settings.tls_ca = Some("/etc/billing/lockcell/ca.pem".into());
/// settings.tls_identity = Some((
///     "/etc/billing/lockcell/client.pem".into(),
///     "/etc/billing/lockcell/client.key".into(),
/// ));
/// let client = Client::connect_with(settings.options()?).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct ConnectSettings {
    /// Proxy addresses, comma-separated, own zone first (`LOCKCELL_PROXY`).
    pub proxies: String,
    /// The CA (PEM) that signed the proxies' certificates: talk TLS (`LOCKCELL_TLS_CA`).
    pub tls_ca: Option<PathBuf>,
    /// A client certificate and its key (PEM), for proxies that require mutual TLS
    /// (`LOCKCELL_CLIENT_TLS_CERT`, `LOCKCELL_CLIENT_TLS_KEY`).
    pub tls_identity: Option<(PathBuf, PathBuf)>,
    /// The name the proxies' certificates are checked against (`LOCKCELL_TLS_DOMAIN`).
    pub tls_domain: Option<String>,
    /// A bearer token for proxies that check prefix grants (`LOCKCELL_AUTH_TOKEN`).
    pub auth_token: Option<String>,
}

impl std::fmt::Debug for ConnectSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectSettings")
            .field("proxies", &self.proxies)
            .field("tls_ca", &self.tls_ca)
            .field("tls_identity", &self.tls_identity)
            .field("tls_domain", &self.tls_domain)
            .field("auth_token", &self.auth_token.as_ref().map(|_| "***"))
            .finish()
    }
}

/// The proxy `lockctl` talks to when none is named.
///
/// ```
/// use lockcell_client::{ConnectSettings, DEFAULT_PROXY};
///
/// // A cell on this machine, as `lockctl` reaches it with no flags.
/// let settings = ConnectSettings::new(DEFAULT_PROXY);
/// assert_eq!(settings.proxies, "127.0.0.1:7420");
/// ```
pub const DEFAULT_PROXY: &str = "127.0.0.1:7420";

impl ConnectSettings {
    /// `proxies` (comma-separated, own zone first), with no TLS and no token.
    ///
    /// ```
    /// # fn main() -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::ConnectSettings;
    ///
    /// let mut settings = ConnectSettings::new("10.0.1.7:7420,10.0.2.7:7420");
    /// settings.auth_token = Some("billing-7f3a9c".to_owned());
    /// let options = settings.options()?;
    /// assert_eq!(options.proxies, ["10.0.1.7:7420", "10.0.2.7:7420"]);
    /// assert_eq!(options.token.as_deref(), Some("billing-7f3a9c"));
    /// # Ok(()) }
    /// ```
    pub fn new(proxies: &str) -> ConnectSettings {
        ConnectSettings {
            proxies: proxies.to_owned(),
            ..ConnectSettings::default()
        }
    }

    /// What the `LOCKCELL_*` variables say, as `lockctl` reads them: `LOCKCELL_PROXY`
    /// ([`DEFAULT_PROXY`] when unset), `LOCKCELL_TLS_CA`, `LOCKCELL_CLIENT_TLS_CERT` with
    /// `LOCKCELL_CLIENT_TLS_KEY`, `LOCKCELL_TLS_DOMAIN` and `LOCKCELL_AUTH_TOKEN`. A
    /// variable set empty counts as unset.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::{Client, ConnectSettings};
    ///
    /// let settings = ConnectSettings::from_env();
    /// eprintln!("lockcell: {settings:?}"); // the token shows as ***
    /// let client = Client::connect_with(settings.options()?).await?;
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> ConnectSettings {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        ConnectSettings {
            proxies: var("LOCKCELL_PROXY").unwrap_or_else(|| DEFAULT_PROXY.to_owned()),
            tls_ca: var("LOCKCELL_TLS_CA").map(PathBuf::from),
            tls_identity: var("LOCKCELL_CLIENT_TLS_CERT")
                .zip(var("LOCKCELL_CLIENT_TLS_KEY"))
                .map(|(cert, key)| (cert.into(), key.into())),
            tls_domain: var("LOCKCELL_TLS_DOMAIN"),
            auth_token: var("LOCKCELL_AUTH_TOKEN"),
        }
    }

    /// The options these settings make: the files read, each error naming the file and
    /// what it was for.
    ///
    /// ```
    /// # fn main() -> Result<(), lockcell_client::Error> {
    /// use std::time::Duration;
    ///
    /// use lockcell_client::ConnectSettings;
    ///
    /// // Adjusted before connecting: a longer grace period for this service.
    /// let options = ConnectSettings::new("10.0.1.7:7420, 10.0.2.7:7420")
    ///     .options()?
    ///     .grace(Duration::from_secs(60));
    /// assert_eq!(options.proxies, ["10.0.1.7:7420", "10.0.2.7:7420"]);
    ///
    /// let mut settings = ConnectSettings::new("10.0.1.7:7420");
    /// settings.tls_ca = Some("/etc/billing/lockcell/missing-ca.pem".into());
    /// let error = settings.options().unwrap_err().to_string();
    /// assert!(error.contains("/etc/billing/lockcell/missing-ca.pem"));
    /// # Ok(()) }
    /// ```
    pub fn options(&self) -> Result<ClientOptions, Error> {
        let proxies = self
            .proxies
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty());
        let mut options = ClientOptions::new(proxies);
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path).map_err(|e| {
                Error::InvalidArgument(format!("cannot read {what} {}: {e}", path.display()))
            })
        };
        match (&self.tls_ca, &self.tls_identity) {
            (Some(ca), identity) => {
                let identity_pem = match identity {
                    Some((cert, key)) => Some((
                        read(cert, "the client certificate (LOCKCELL_CLIENT_TLS_CERT, --tls-cert)")?,
                        read(key, "the client key (LOCKCELL_CLIENT_TLS_KEY, --tls-key)")?,
                    )),
                    None => None,
                };
                options = options.tls(ClientTls {
                    ca_pem: read(ca, "the CA certificate (LOCKCELL_TLS_CA, --tls-ca)")?,
                    identity_pem,
                    domain: self.tls_domain.clone(),
                });
            }
            (None, Some(_)) => {
                return Err(Error::InvalidArgument(
                    "a client certificate needs the CA that signed the proxies' certificates (LOCKCELL_TLS_CA, --tls-ca)".into(),
                ))
            }
            (None, None) => {}
        }
        if let Some(token) = self.auth_token.as_ref().filter(|t| !t.is_empty()) {
            options = options.token(token.clone());
        }
        Ok(options)
    }
}

impl Client {
    /// Connects as `lockctl` would with no flags: to the proxies and with the
    /// credentials the `LOCKCELL_*` variables name ([`ConnectSettings::from_env`]), so
    /// a program and the `lockctl` beside it share one configuration (the dev cell's
    /// `.lockcell-dev/env` sets them).
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), lockcell_client::Error> {
    /// // After `. .lockcell-dev/env`, the dev cell; in production, what the unit sets.
    /// let client = lockcell_client::Client::from_env().await?;
    /// # Ok(()) }
    /// ```
    pub async fn from_env() -> Result<Client, Error> {
        Client::connect_with(ConnectSettings::from_env().options()?).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_become_options_and_name_what_is_wrong() {
        let options = ConnectSettings::new(" a:1, b:2,,")
            .options()
            .expect("options");
        assert_eq!(options.proxies, ["a:1", "b:2"]);
        assert!(options.tls.is_none() && options.token.is_none());

        let mut settings = ConnectSettings::new("a:1");
        settings.auth_token = Some(String::new());
        assert!(
            settings.options().expect("options").token.is_none(),
            "empty is unset"
        );
        settings.auth_token = Some("t0ken".into());
        assert_eq!(
            settings.options().expect("options").token.as_deref(),
            Some("t0ken")
        );
        assert!(
            !format!("{settings:?}").contains("t0ken"),
            "Debug hides the token"
        );

        settings.tls_ca = Some("/nonexistent/ca.pem".into());
        let e = settings.options().expect_err("a CA that is not there");
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("/nonexistent/ca.pem") && m.contains("LOCKCELL_TLS_CA")),
            "{e:?}"
        );
        settings.tls_ca = None;
        settings.tls_identity = Some(("c.pem".into(), "k.pem".into()));
        let e = settings
            .options()
            .expect_err("a client certificate without a CA");
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("CA")),
            "{e:?}"
        );

        let dir = tempfile::tempdir().expect("a folder");
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, b"PEM").expect("the CA file");
        settings.tls_ca = Some(ca);
        settings.tls_identity = None;
        settings.tls_domain = Some("proxy.example".into());
        let tls = settings.options().expect("options").tls.expect("TLS");
        assert_eq!(
            (tls.ca_pem.as_slice(), tls.domain.as_deref()),
            (&b"PEM"[..], Some("proxy.example"))
        );
    }
}
