//! The proxy's configuration: a TOML file, environment variables and flags, in that
//! order of precedence, as for every lockcell binary (see `lockcell_settings`).

use std::ffi::OsString;

use crate::config::ProxyConfig;

pub use lockcell_settings::Loaded;

/// The configuration from `args` (the program name first), the environment and the
/// file `--config` names, or the error to print, which names the bad value (and the
/// file, when the value came from there).
pub fn load(args: Vec<OsString>) -> Result<Loaded<ProxyConfig>, clap::Error> {
    lockcell_settings::load(args)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::CommandFactory;

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
        // How the sources show is the settings crate's to test; one line here.
        let shown = loaded.render();
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with("leases = 8 ") && l.ends_with("# file")),
            "{shown}"
        );
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
        lockcell_settings::check_reference(&path, &ProxyConfig::command()).unwrap();
    }
}
