//! The proxy's one typed configuration, from flags, `LOCKCELL_*` environment variables
//! or a TOML file (see [`crate::settings`]).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

/// lockcell-proxy: the zone proxy of a lockcell cell.
///
/// Holds client sessions in memory and answers their keepalives itself; attaches every
/// key its clients create to one of a few etcd leases of its own, so etcd sees K leases
/// per proxy instead of one per client. Grants exclusive locks with fencing tokens.
///
/// Example: lockcell-proxy --etcd 127.0.0.1:2379 --zone a --listen 127.0.0.1:7420
#[derive(Debug, Clone, Parser)]
#[command(name = "lockcell-proxy", version, about, long_about)]
pub struct ProxyConfig {
    /// Address the lockcell.v1 gRPC service listens on.
    #[arg(long, env = "LOCKCELL_LISTEN", default_value = "127.0.0.1:7420")]
    pub listen: SocketAddr,

    /// Address of the admin HTTP server (/metrics for Prometheus, /healthz, /readyz,
    /// POST /drain). POST /drain stops the proxy, so it answers only callers on this
    /// host's loopback, or only callers with --admin-token-file's token when that is set.
    #[arg(long, env = "LOCKCELL_ADMIN_LISTEN", default_value = "127.0.0.1:7421")]
    pub admin_listen: SocketAddr,

    /// Address etcd's own v3 gRPC API listens on, off when unset: etcd clients in any
    /// language (etcdctl, Go's clientv3, jetcd, Python's etcd3, the npm etcd3) use the
    /// cell through this proxy, their leases held here as sessions and their keys as
    /// lockcell's small keys (docs/etcd-api.md says what is served). With --tls-cert,
    /// it serves TLS as the lockcell API does.
    #[arg(long, env = "LOCKCELL_ETCD_LISTEN")]
    pub etcd_listen: Option<SocketAddr>,

    /// Address (HOST:PORT) the other proxies and etcd clients reach this proxy's etcd
    /// API at: in `MemberList`, and where the other proxies forward calls on this
    /// proxy's leases. Defaults to --etcd-listen; set it when that binds every
    /// interface (0.0.0.0) or sits behind a NAT. With --tls-cert, its host must be a
    /// name in the certificate.
    #[arg(long, env = "LOCKCELL_ETCD_ADVERTISE", requires = "etcd_listen")]
    pub etcd_advertise: Option<String>,

    /// CA certificate (PEM) that signed the other proxies' --tls-cert: with TLS, this
    /// proxy forwards calls on leases held at another proxy only to a proxy whose
    /// certificate it signed. Unset, those calls are refused with UNAVAILABLE (and
    /// clients with one endpoint per proxy are unaffected). With --tls-client-ca, the
    /// proxy presents its own --tls-cert as client certificate when it forwards.
    #[arg(long, env = "LOCKCELL_ETCD_PEER_CA", requires = "tls_cert")]
    pub etcd_peer_ca: Option<std::path::PathBuf>,

    /// File holding the token POST /drain requires (`Authorization: Bearer TOKEN`) from
    /// every caller, loopback included: set it where a loopback address proves nothing
    /// (a service-mesh sidecar forwards from 127.0.0.6). At least 32 characters; read
    /// again on every call, so replacing the file rotates it.
    #[arg(long, env = "LOCKCELL_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<std::path::PathBuf>,

    /// etcd client endpoints of the cell, comma-separated. When the cell holds a shard
    /// map of several cells, the proxy serves every cell of it (connecting to the
    /// endpoints the map gives, with the same etcd user, password and TLS settings) and
    /// routes each call to the cell that serves its name; restart it to serve a cell
    /// added to the map later.
    #[arg(
        long = "etcd",
        env = "LOCKCELL_ETCD",
        value_delimiter = ',',
        default_value = "127.0.0.1:2379"
    )]
    pub etcd_endpoints: Vec<String>,

    /// The zone this proxy serves (a label in logs and in every grant record).
    #[arg(long, env = "LOCKCELL_ZONE", default_value = "local")]
    pub zone: String,

    /// This proxy's name in grant records; defaults to ZONE-<random>.
    #[arg(long, env = "LOCKCELL_PROXY_ID")]
    pub proxy_id: Option<String>,

    /// How many etcd leases the proxy spreads its sessions over (K). Losing the proxy
    /// costs etcd K revocations, whatever the number of sessions.
    #[arg(long, env = "LOCKCELL_LEASES", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub leases: u16,

    /// TTL of the proxy's etcd leases: how long the keys of a dead proxy's clients
    /// outlive it. etcd counts whole seconds.
    #[arg(long, env = "LOCKCELL_LEASE_TTL", default_value = "12s", value_parser = whole_seconds)]
    pub lease_ttl: Duration,

    /// How often the proxy renews its leases; defaults to a quarter of --lease-ttl.
    #[arg(long, env = "LOCKCELL_LEASE_RENEW_INTERVAL", value_parser = humantime::parse_duration)]
    pub lease_renew_interval: Option<Duration>,

    /// Session TTL given to clients that ask for none.
    #[arg(long, env = "LOCKCELL_SESSION_TTL", default_value = "12s", value_parser = humantime::parse_duration)]
    pub session_ttl: Duration,

    /// Shortest session TTL a client may ask for (shorter requests are raised to it).
    #[arg(long, env = "LOCKCELL_SESSION_TTL_MIN", default_value = "1s", value_parser = humantime::parse_duration)]
    pub session_ttl_min: Duration,

    /// Longest session TTL a client may ask for (longer requests are cut to it).
    #[arg(long, env = "LOCKCELL_SESSION_TTL_MAX", default_value = "120s", value_parser = humantime::parse_duration)]
    pub session_ttl_max: Duration,

    /// Safety margin taken off every validity the proxy grants that its etcd lease
    /// backs, for the time a lease renewal spends on the way and in etcd.
    #[arg(long, env = "LOCKCELL_VALIDITY_MARGIN", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub validity_margin: Duration,

    /// How much faster or slower than this machine's clock the clocks of etcd's members
    /// and of clients may run, as a percentage (`1%`) or a fraction (`0.01`). Every span
    /// the proxy tells a client it may act for, and its own count of etcd's lease TTL,
    /// is shortened by it, so a client whose clock runs that much slow still stops
    /// before its session ends here, and this proxy before etcd can revoke its lease.
    /// NTP slewing stays well within 1 %; a clock that runs further off breaks the
    /// locks' promise. Below 50 %.
    #[arg(long, env = "LOCKCELL_CLOCK_RATE_BOUND", default_value = "1%")]
    pub clock_rate_bound: Rate,

    /// Deadline of each call to etcd; a store that does not answer in time is reported
    /// to clients as Unavailable.
    #[arg(long, env = "LOCKCELL_ETCD_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub etcd_timeout: Duration,

    /// Most client writes through the etcd API this proxy has in etcd at once; more
    /// wait their turn here, within their deadline. etcd answers the proxy's own lease
    /// renewals only once it has applied what it committed, so a burst of client writes
    /// queued inside etcd (every waiter of a dead zone's locks writing at once) would
    /// delay those renewals, and a lease renewed too late ends every session on it.
    #[arg(long, env = "LOCKCELL_ETCD_WRITES_IN_FLIGHT", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub etcd_writes_in_flight: u32,

    /// Largest value a small key (Kv Put) may hold, in bytes.
    #[arg(long, env = "LOCKCELL_MAX_VALUE_BYTES", default_value_t = 64 * 1024)]
    pub max_value_bytes: usize,

    /// Most bytes all small keys of the cell may hold together: names and values, and
    /// 128 bytes a key for what keeping it costs. Every proxy keeps a copy of every small
    /// key, so this bounds that copy on every proxy (keep it well below the proxy's
    /// memory limit) and the cell's share of etcd's space quota. A write that would pass
    /// it is refused (RESOURCE_EXHAUSTED) on whichever proxy it reaches; set the same
    /// value on every proxy of the cell.
    #[arg(long, env = "LOCKCELL_MAX_KV_TOTAL_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub max_kv_total_bytes: usize,

    /// etcd's space quota, in bytes: what its members run with as
    /// `--quota-backend-bytes` (etcd's default is 2 GiB). At its quota etcd refuses every
    /// write with a put in it, releases and clean-ups included; see
    /// --etcd-space-limit-percent.
    #[arg(long, env = "LOCKCELL_ETCD_QUOTA_BYTES", default_value_t = 2 * 1024 * 1024 * 1024)]
    pub etcd_quota_bytes: u64,

    /// From this share of --etcd-quota-bytes on (etcd's database size, read every 2 s),
    /// the proxy refuses new keys and values (RESOURCE_EXHAUSTED), keeping the rest of the
    /// quota for releases, deletes, session clean-ups and lease renewals.
    #[arg(long, env = "LOCKCELL_ETCD_SPACE_LIMIT_PERCENT", default_value_t = 90,
          value_parser = clap::value_parser!(u8).range(1..=100))]
    pub etcd_space_limit_percent: u8,

    /// Most calls one client connection may have open at once (HTTP/2 streams: each
    /// waiting acquire, watch and keep-alive stream is one). A client's further calls
    /// wait for one to end; one connection cannot hold unbounded proxy memory.
    #[arg(
        long,
        env = "LOCKCELL_MAX_STREAMS_PER_CONNECTION",
        default_value_t = 1000
    )]
    pub max_streams_per_connection: u32,

    /// How long a client connection may be quiet before the proxy pings it; one that
    /// does not answer within as long again is closed, with its calls. A client that
    /// vanished without closing its connection (a host gone, a partition) would
    /// otherwise keep its watches and waiting acquires, and the places they take under
    /// its identity's limits, for as long as the proxy runs.
    #[arg(long, env = "LOCKCELL_CLIENT_PING_INTERVAL", default_value = "30s",
          value_parser = humantime::parse_duration)]
    pub client_ping_interval: Duration,

    /// Past this resident size, in bytes, the proxy takes no new sessions and no new
    /// watches (RESOURCE_EXHAUSTED: use another proxy), while existing sessions keep
    /// renewing, resuming and releasing. 0: no bound. Set it below the memory limit
    /// the proxy runs under (the DaemonSet's 1 GiB: 900 MiB).
    #[arg(long, env = "LOCKCELL_MAX_MEMORY_BYTES", default_value_t = 0)]
    pub max_memory_bytes: u64,

    /// Most keepalive messages a second one keepalive stream is read at (lockcell's
    /// Session.KeepAlive and etcd's LeaseKeepAlive), with a burst of as many: a stream
    /// sent faster is read more slowly, never refused. One client renewing all its
    /// sessions on one stream sends up to 1.5 a second per session at a 2 s TTL: the
    /// default serves some 13,000 sessions per stream. 0: no pace.
    #[arg(
        long,
        env = "LOCKCELL_MAX_KEEPALIVES_PER_STREAM",
        default_value_t = 20_000
    )]
    pub max_keepalives_per_stream: u32,

    /// Lock classes file (TOML; see deploy/config/classes.toml). Reloaded on SIGHUP and
    /// when it changes; a bad file is refused and the last good one stays in force.
    /// Without it every lock has one built-in class: both modes, fenced, not fair.
    #[arg(long, env = "LOCKCELL_CLASSES")]
    pub classes: Option<std::path::PathBuf>,

    /// Prefix grants file (TOML; see deploy/config/grants.toml): which identities may
    /// lock, read, write and watch which name prefixes. Reloaded like --classes.
    /// Without it every caller may do everything.
    #[arg(long, env = "LOCKCELL_GRANTS")]
    pub grants: Option<std::path::PathBuf>,

    /// TLS certificate (PEM) the gRPC service presents; with --tls-key, clients must
    /// connect with TLS.
    #[arg(long, env = "LOCKCELL_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "LOCKCELL_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// CA certificate (PEM) client certificates must be signed by: with it, every
    /// client presents a certificate (mutual TLS), and its subject common name is the
    /// identity --grants knows it by.
    #[arg(long, env = "LOCKCELL_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,

    /// Let --grants take bearer tokens over plain HTTP/2 (no --tls-cert): they would
    /// cross the network in clear. For a test bench only.
    #[arg(long, env = "LOCKCELL_GRANTS_WITHOUT_TLS")]
    pub grants_without_tls: bool,

    /// How many batches of events a watcher may fall behind before it is cut off (told
    /// the revision to resume from), so one slow watcher never slows the others.
    #[arg(long, env = "LOCKCELL_WATCH_BACKLOG", default_value_t = 1024)]
    pub watch_backlog: usize,

    /// How many bytes of the cell's latest events (keys, values and previous values, and
    /// 128 bytes an event) the proxy keeps, so a watch from a recent revision (a client
    /// resuming, or watching from the revision after a read) starts from them instead
    /// of reading etcd's history. 0 keeps none: every watch from a past revision then
    /// reads etcd's.
    #[arg(long, env = "LOCKCELL_WATCH_HISTORY_BYTES", default_value_t = crate::fanout::HISTORY_BYTES)]
    pub watch_history_bytes: usize,

    /// How long a stopping proxy (SIGTERM, or POST /drain on the admin address) waits
    /// for its clients to resume their sessions on other proxies before it shuts down.
    /// Sessions still here then are ended as before: the proxy waits until no holder can
    /// still act, then revokes its leases. Each client is told to move at a turn of
    /// its own, drawn at random over the first 60 % of this time, so that a fleet's
    /// resumes reach etcd as a stream: a drain of even one idle client may take up to
    /// 18 s with the default (lower it where few clients connect).
    #[arg(long, env = "LOCKCELL_DRAIN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// A folder where the proxy remembers the cell it served (cluster id, epoch, highest
    /// revision seen), so that after a restart it refuses a cell whose epoch went
    /// backwards, whose cluster id changed, or whose revisions went backwards within one
    /// epoch (a restore from backup without `lockcell-cell bump-epoch`). Without it the
    /// proxy checks only while it runs.
    #[arg(long, env = "LOCKCELL_STATE_DIR")]
    pub state_dir: Option<std::path::PathBuf>,

    /// How long a shutdown waits for clients to disconnect before it cuts them off.
    #[arg(long, env = "LOCKCELL_SHUTDOWN_GRACE", default_value = "5s", value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,

    /// etcd user to log in as when etcd runs with authentication on (`lockcell-cell
    /// auth-enable` creates lockcell-proxy for proxies).
    #[arg(long, env = "LOCKCELL_ETCD_USER")]
    pub etcd_user: Option<String>,

    /// That user's password (prefer the environment variable to the flag).
    #[arg(long, env = "LOCKCELL_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<lockcell_cell::rbac::Secret>,

    #[command(flatten)]
    pub etcd_tls: lockcell_cell::etcd_tls::EtcdTls,

    /// A TOML file of settings, each named as its long flag (`lease-ttl = "10s"`,
    /// `etcd = ["http://10.0.1.5:2379"]`); a flag or an environment variable beats it.
    #[arg(long, env = "LOCKCELL_CONFIG")]
    pub config: Option<std::path::PathBuf>,

    /// Prints the configuration in force, each setting with where it came from (flag,
    /// environment, file, default; passwords hidden), in the file's format, and exits.
    #[arg(long)]
    pub print_config: bool,

    /// Checks everything a start would read, with the code a start reads it with, and
    /// exits without starting or contacting etcd: the settings, --classes, --grants,
    /// the TLS files (--tls-*, --etcd-tls-*), --admin-token-file and --state-dir. Prints
    /// a line for each file and `configuration OK` (exit 0), or each error, naming the
    /// file and line (exit 1; bad settings exit 2). Run it before every restart.
    #[arg(long)]
    pub check_config: bool,

    /// The log's format on stderr: `text` (coloured only on a terminal) or `json`
    /// (one object per line). The level comes from RUST_LOG (default info; for
    /// example RUST_LOG=lockcell_proxy=debug,info).
    #[arg(long, env = "LOCKCELL_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: lockcell_settings::logs::LogFormat,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--clock-rate-bound ({rate}) must be at least 0 % and below 50 %")]
    Rate { rate: Rate },
    #[error("--session-ttl-min ({min:?}) is above --session-ttl-max ({max:?})")]
    TtlBounds { min: Duration, max: Duration },
    #[error("--session-ttl ({ttl:?}) is outside --session-ttl-min..--session-ttl-max ({min:?}..{max:?})")]
    DefaultTtl {
        ttl: Duration,
        min: Duration,
        max: Duration,
    },
    #[error("--lease-renew-interval ({interval:?}) must be below half of --lease-ttl ({ttl:?}), or the lease could lapse between renewals")]
    RenewInterval { interval: Duration, ttl: Duration },
    #[error("--validity-margin ({margin:?}) must be below half of --lease-ttl ({ttl:?}), or no client could ever be valid")]
    Margin { margin: Duration, ttl: Duration },
    #[error("--etcd needs at least one endpoint")]
    NoEndpoints,
    #[error("--client-ping-interval {0:?} is under a second: clients would spend their time answering pings")]
    ClientPing(Duration),
    #[error("--grants without --tls-cert and --tls-key would take bearer tokens in clear; serve TLS, or pass --grants-without-tls on a test bench")]
    GrantsWithoutTls,
}

impl ProxyConfig {
    /// Where the etcd API is reached: --etcd-advertise, else --etcd-listen.
    pub fn etcd_advertised(&self) -> Option<String> {
        self.etcd_advertise
            .clone()
            .or_else(|| self.etcd_listen.map(|a| a.to_string()))
    }

    /// Checks the values against each other; every error names the flag to change.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.grants.is_some() && self.tls_cert.is_none() && !self.grants_without_tls {
            return Err(ConfigError::GrantsWithoutTls);
        }
        let (min, max) = (self.session_ttl_min, self.session_ttl_max);
        if min > max {
            return Err(ConfigError::TtlBounds { min, max });
        }
        if self.session_ttl < min || self.session_ttl > max {
            return Err(ConfigError::DefaultTtl {
                ttl: self.session_ttl,
                min,
                max,
            });
        }
        let interval = self.renew_interval();
        if interval * 2 >= self.lease_ttl {
            return Err(ConfigError::RenewInterval {
                interval,
                ttl: self.lease_ttl,
            });
        }
        if !(0.0..0.5).contains(&self.clock_rate_bound.0) {
            return Err(ConfigError::Rate {
                rate: self.clock_rate_bound,
            });
        }
        if self.validity_margin * 2 >= self.lease_ttl {
            return Err(ConfigError::Margin {
                margin: self.validity_margin,
                ttl: self.lease_ttl,
            });
        }
        if self.etcd_endpoints.iter().all(|e| e.trim().is_empty()) {
            return Err(ConfigError::NoEndpoints);
        }
        if self.client_ping_interval < Duration::from_secs(1) {
            return Err(ConfigError::ClientPing(self.client_ping_interval));
        }
        Ok(())
    }

    /// The lease renewal period actually used.
    pub fn renew_interval(&self) -> Duration {
        self.lease_renew_interval.unwrap_or(self.lease_ttl / 4)
    }

    /// The TTL a session gets when it asks for `requested` (zero: the default).
    pub fn session_ttl_for(&self, requested: Duration) -> Duration {
        if requested.is_zero() {
            return self.session_ttl;
        }
        requested.clamp(self.session_ttl_min, self.session_ttl_max)
    }
}

fn whole_seconds(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d.subsec_nanos() != 0 || d.as_secs() == 0 {
        return Err(format!(
            "{s:?}: etcd lease TTLs are whole seconds, at least 1s"
        ));
    }
    Ok(d)
}

/// A clock-rate bound: a fraction, written as a percentage (`1%`) or a plain fraction
/// (`0.01`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate(pub f64);

impl std::str::FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Rate, String> {
        let s = s.trim();
        let (number, scale) = match s.strip_suffix('%') {
            Some(percent) => (percent.trim(), 100.0),
            None => (s, 1.0),
        };
        let value: f64 = number
            .parse()
            .map_err(|_| format!("{s:?} is not a percentage (1%) or a fraction (0.01)"))?;
        if !value.is_finite() {
            return Err(format!("{s:?} is not a finite number"));
        }
        Ok(Rate(value / scale))
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}%", self.0 * 100.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> ProxyConfig {
        let mut argv = vec!["lockcell-proxy"];
        argv.extend_from_slice(args);
        ProxyConfig::try_parse_from(argv).expect("parses")
    }

    #[test]
    fn defaults_are_valid() {
        let c = parse(&[]);
        c.validate().unwrap();
        assert_eq!(c.leases, 4);
        assert_eq!(c.renew_interval(), Duration::from_secs(3));
    }

    #[test]
    fn clamps_requested_ttls() {
        let c = parse(&["--session-ttl-min", "2s", "--session-ttl-max", "30s"]);
        assert_eq!(c.session_ttl_for(Duration::ZERO), Duration::from_secs(12));
        assert_eq!(
            c.session_ttl_for(Duration::from_millis(10)),
            Duration::from_secs(2)
        );
        assert_eq!(
            c.session_ttl_for(Duration::from_secs(99)),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn refuses_inconsistent_values_naming_the_flag() {
        let c = parse(&["--lease-ttl", "2s", "--lease-renew-interval", "1s"]);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--lease-renew-interval"));
        let c = parse(&[
            "--session-ttl-min",
            "10s",
            "--session-ttl-max",
            "5s",
            "--session-ttl",
            "7s",
        ]);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--session-ttl-min"));
        assert!(ProxyConfig::try_parse_from(["p", "--lease-ttl", "1500ms"]).is_err());
    }

    #[test]
    fn the_clock_rate_bound_is_a_percentage_or_a_fraction_below_half() {
        assert_eq!(parse(&[]).clock_rate_bound, Rate(0.01));
        assert_eq!(
            parse(&["--clock-rate-bound", "2.5%"]).clock_rate_bound,
            Rate(0.025)
        );
        assert_eq!(
            parse(&["--clock-rate-bound", "0.002"]).clock_rate_bound,
            Rate(0.002)
        );
        assert_eq!(
            parse(&["--clock-rate-bound", "1%"])
                .clock_rate_bound
                .to_string(),
            "1%"
        );
        let err = ProxyConfig::try_parse_from(["p", "--clock-rate-bound", "fast"]).unwrap_err();
        assert!(err.to_string().contains("percentage"), "{err}");
        for bad in ["50%", "-1%", "0.7"] {
            let flag = format!("--clock-rate-bound={bad}");
            let c = parse(&[flag.as_str()]);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("--clock-rate-bound"), "{bad}: {err}");
        }
    }
}
