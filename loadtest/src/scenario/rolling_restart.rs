//! `rolling-restart`: N SDK sessions, each holding one exclusive lock and one ephemeral
//! key, spread over clients that know all three proxies (their own zone's first). The
//! proxies are restarted one at a time as an operator would: SIGTERM (the proxy drains
//! and its clients move their sessions elsewhere), wait for the exit, start it again on
//! the same address, wait for `/readyz`. Measures what the sessions lost (nothing,
//! ideally: no expiry, no lock, no token change, no key), how often they moved, how
//! long each restart took, and the proxies' keepalive round trips before and during the
//! restarts.
//!
//! lockcell only: bare etcd (and its grpc-proxy, a stateless relay) has no proxies that
//! hold sessions to restart. Through the proxies' etcd API the run holds etcd leases
//! instead ([`super::rolling_restart_etcd`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use lockcell_client::{Session, SessionState};
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::{ms, secs, Samples, TimeSeries};
use lockcell_tests::ProxyProcess;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::cluster::{Cell, CellOptions, Target};
use crate::holders::{self, Followers, Holder, Seen};
use crate::probe::{ProbeStats, Probes, PROBE_INTERVAL};
use crate::progress;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// SDK sessions, each holding one lock and one ephemeral key.
    #[arg(long, default_value_t = 3_000)]
    pub sessions: usize,
    /// SDK clients the sessions are spread over (each one connection and one keep-alive
    /// stream); client i lives in zone i mod 3 and prefers that zone's proxy.
    #[arg(long, default_value_t = 30)]
    pub clients: usize,
    /// Session TTL (and the proxies' lease TTL).
    #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// The proxies' --drain-timeout: how long a stopping proxy waits for its clients to
    /// move.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// How long to measure before the first restart.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub baseline: Duration,
    /// lockcell-etcd-api only: the etcd leases' TTL (whole seconds), renewed every third
    /// of it.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub etcd_lease_ttl: Duration,
}

/// The SDK's grace period: far longer than a move between serving proxies takes, so a
/// session expires only if the move itself failed.
const GRACE: Duration = Duration::from_secs(30);
/// How often the sessions' deadlines are sampled.
const HEADROOM_SAMPLE: Duration = Duration::from_millis(250);
/// Beyond the drain timeout, what a stopping proxy may still take before it exits: its
/// shutdown grace (5 s), the wait until no holder can act (up to a TTL), and slack.
const EXIT_SLACK: Duration = Duration::from_secs(15);

pub async fn run(
    target: Target,
    cell_options: &CellOptions,
    args: &Args,
) -> anyhow::Result<Report> {
    let mut report = Report::new("rolling-restart", target.name());
    let skipped = match target {
        Target::Lockcell => None,
        Target::Etcd => Some("bare etcd has no proxies to restart: clients talk to the members"),
        Target::EtcdGrpcProxy => Some(
            "etcd's grpc-proxy holds no sessions (the leases live in etcd), so none move when it restarts",
        ),
        Target::LockcellEtcdApi => {
            return super::rolling_restart_etcd::run(target, cell_options, args, report).await
        }
    };
    if let Some(why) = skipped {
        report.param("skipped", why);
        return Ok(report);
    }
    let mut cell_options = cell_options.clone();
    cell_options.lease_ttl = args.ttl;
    cell_options.drain_timeout = Some(args.drain_timeout);
    let mut cell = Cell::start(target, &cell_options).await?;
    let addrs: Vec<String> = cell.zones.iter().map(|z| z.endpoint.clone()).collect();
    let clients = args.clients.clamp(1, args.sessions.max(1));
    report.param("sessions", args.sessions);
    report.param("clients", clients);
    report.param("ttl_s", args.ttl.as_secs_f64());
    report.param("drain_timeout_s", args.drain_timeout.as_secs_f64());
    report.param("baseline_s", args.baseline.as_secs_f64());
    report.param("grace_s", GRACE.as_secs_f64());
    report.param("probe_interval_ms", ms(PROBE_INTERVAL));

    let holders = holders::hold(&addrs, clients, args.sessions, args.ttl, GRACE).await?;
    let sessions_before = holders.len();
    let probes = Probes::start(&addrs, args.ttl)?;
    let (phase_tx, phase) = watch::channel(Phase::Baseline);
    let sampler = tokio::spawn(sample_headroom(
        holders.iter().map(|h| h.session.clone()).collect(),
        phase,
    ));
    let followers = Followers::start(holders);

    let baseline_from = Instant::now();
    let bar = progress::timed("before the restarts", args.baseline);
    while baseline_from.elapsed() < args.baseline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        bar.set_position(baseline_from.elapsed().as_secs());
    }
    bar.finish_and_clear();

    let etcd_before = cell.etcd_counters().await?;
    let restarts_from = Instant::now();
    phase_tx.send_replace(Phase::Restarts);
    let mut counted = restart_all(&mut cell, args, Some(&followers), &mut report).await?;
    let restarts_to = Instant::now();
    phase_tx.send_replace(Phase::Done);
    let etcd_after = cell.etcd_counters().await?;

    // One TTL more, so every session has renewed where it ended up (or fallen into
    // jeopardy) before it is judged.
    tokio::time::sleep(args.ttl).await;
    let followed = followers.finish().await?;
    let probed = probes.finish().await;
    let headroom = sampler.await?;
    for zone in 0..cell.zones.len() {
        let proxy = cell
            .proxy(zone)
            .context("a lockcell zone without a proxy")?;
        counted.add(&ProxyCounters::read(proxy).await?);
        counted.sessions_open += proxy.metric("lockcell_sessions_open").await?;
    }
    let checked = holders::read_back(&followed).await;

    // What the sessions kept, as they and a read-back see it.
    let count = |f: &dyn Fn(&Holder) -> bool| followed.iter().filter(|(h, _)| f(h)).count() as f64;
    let total = |f: fn(&Seen) -> u64| followed.iter().map(|(_, s)| f(s)).sum::<u64>() as f64;
    let expired = count(&|h| h.session.state() == SessionState::Expired);
    report.metric("sessions_open_before", sessions_before as f64);
    report.metric("sessions_open_after", sessions_before as f64 - expired);
    report.metric("sessions_expired", expired);
    report.metric(
        "sessions_in_jeopardy_after",
        count(&|h| h.session.state() == SessionState::Jeopardy),
    );
    report.metric("locks_lost", count(&|h| h.lock_lost()));
    report.metric("guards_not_valid_after", count(&|h| !h.guard.is_valid()));
    report.metric("tokens_changed", checked.tokens_changed as f64);
    report.metric("ephemeral_keys_lost", checked.keys_lost as f64);
    report.metric("read_back_errors", checked.errors as f64);
    report.metric("moves_seen", total(|s| s.moves));
    report.metric("jeopardy_events", total(|s| s.jeopardies));
    report.metric("hold_lost_events", total(|s| s.holds_lost));
    report.metric(
        "sessions_off_home_proxy_after",
        count(&|h| h.session.proxy_id() != h.home_proxy),
    );
    // What the proxies counted, summed over every process that ran.
    report.metric("proxy_sessions_resumed", counted.sessions_resumed);
    report.metric("proxy_keys_moved", counted.keys_moved);
    report.metric("proxy_keys_lost_on_resume", counted.keys_lost);
    report.metric("proxy_sessions_open_after", counted.sessions_open);

    keepalive_figures(
        &mut report,
        &probed,
        baseline_from,
        restarts_from,
        restarts_to,
    );
    if let Some(d) = headroom.before {
        report.metric("deadline_headroom_min_s_before", secs(d));
    }
    if let Some(d) = headroom.during {
        report.metric("deadline_headroom_min_s_during", secs(d));
    }
    let delta = etcd_after.delta(&etcd_before);
    report.metric(
        "etcd_proposals_during_restarts",
        delta.get("proposals_committed"),
    );
    report.metric("etcd_txns_during_restarts", delta.get("txns"));
    report.metric("restarts_s", secs(restarts_to - restarts_from));

    holders::close_all(followed).await;
    Ok(report)
}

/// Restarts the proxies one at a time, recording each restart's durations. Returns the
/// proxies' own counters read just before each SIGTERM (a restart resets them).
pub(super) async fn restart_all(
    cell: &mut Cell,
    args: &Args,
    followers: Option<&Followers>,
    report: &mut Report,
) -> anyhow::Result<ProxyCounters> {
    let mut counted = ProxyCounters::default();
    let mut killed = 0;
    let exit_within = args.drain_timeout + args.ttl + EXIT_SLACK;
    let bar = progress::count("restarting proxies", cell.zones.len() as u64);
    for zone in 0..cell.zones.len() {
        let name = (b'a' + zone as u8) as char;
        let proxy = cell
            .proxy(zone)
            .context("a lockcell zone without a proxy")?;
        let at_sigterm = proxy.metric("lockcell_sessions_open").await?;
        counted.add(&ProxyCounters::read(proxy).await?);
        let moves = followers.map_or(0, |f| f.moves.load(Ordering::Relaxed));
        bar.set_message(format!(
            "proxy {name}: draining {at_sigterm} sessions; moves seen so far {moves}"
        ));
        let restart = cell.restart_proxy(zone, exit_within).await?;
        report.metric(&format!("proxy_{name}_sessions_at_sigterm"), at_sigterm);
        report.metric(&format!("proxy_{name}_exit_s"), secs(restart.exited));
        report.metric(&format!("proxy_{name}_restart_s"), secs(restart.healthy));
        killed += u32::from(restart.killed);
        bar.inc(1);
    }
    bar.finish_and_clear();
    report.metric("proxies_killed_after_deadline", f64::from(killed));
    Ok(counted)
}

/// The probes' keepalive round trips before the restarts and during them (by when each
/// renewal was sent), and p99 per second from the baseline's start for the plot.
fn keepalive_figures(
    report: &mut Report,
    probed: &ProbeStats,
    baseline_from: Instant,
    restarts_from: Instant,
    restarts_to: Instant,
) {
    let (mut before, mut during) = (Samples::new(), Samples::new());
    let mut series = TimeSeries::new();
    for &(sent, rtt) in &probed.round_trips {
        if (baseline_from..restarts_from).contains(&sent) {
            before.record(rtt);
        } else if (restarts_from..restarts_to).contains(&sent) {
            during.record(rtt);
        }
        if sent >= baseline_from {
            series.record(sent - baseline_from, rtt);
        }
    }
    for (phase, samples) in [("before", &mut before), ("during", &mut during)] {
        for (p, name) in [(50.0, "p50"), (99.0, "p99")] {
            if let Some(d) = samples.percentile(p) {
                report.metric(&format!("keepalive_{name}_ms_{phase}"), ms(d));
            }
        }
        if let Some(d) = samples.max() {
            report.metric(&format!("keepalive_max_ms_{phase}"), ms(d));
        }
    }
    report.metric("probe_renewals_unanswered", probed.unanswered as f64);
    report
        .series
        .insert("keepalive_p99_ms_per_s".into(), series.p99_per_second());
}

/// Which part of the run the deadlines are sampled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Baseline,
    Restarts,
    Done,
}

/// The least time any live session had left before its deadline, per phase: how close
/// the sessions came to jeopardy.
#[derive(Debug, Default)]
struct Headroom {
    before: Option<Duration>,
    during: Option<Duration>,
}

async fn sample_headroom(sessions: Vec<Session>, phase: watch::Receiver<Phase>) -> Headroom {
    let mut headroom = Headroom::default();
    let mut tick = tokio::time::interval(HEADROOM_SAMPLE);
    loop {
        tick.tick().await;
        let now = Instant::now();
        let slot = match *phase.borrow() {
            Phase::Baseline => &mut headroom.before,
            Phase::Restarts => &mut headroom.during,
            Phase::Done => break,
        };
        let least = sessions
            .iter()
            .filter(|s| s.state() != SessionState::Expired)
            .map(|s| s.deadline().saturating_duration_since(now))
            .min();
        if let Some(least) = least {
            *slot = Some(slot.map_or(least, |d| d.min(least)));
        }
    }
    headroom
}

/// The proxies' own count of what moved, summed over the processes that ran.
#[derive(Debug, Default)]
pub(super) struct ProxyCounters {
    pub sessions_resumed: f64,
    pub keys_moved: f64,
    pub keys_lost: f64,
    pub sessions_open: f64,
}

impl ProxyCounters {
    pub(super) async fn read(proxy: &ProxyProcess) -> anyhow::Result<ProxyCounters> {
        Ok(ProxyCounters {
            sessions_resumed: proxy.metric("lockcell_sessions_resumed_total").await?,
            keys_moved: proxy.metric("lockcell_keys_moved_total").await?,
            keys_lost: proxy.metric("lockcell_keys_lost_on_resume_total").await?,
            sessions_open: 0.0,
        })
    }

    pub(super) fn add(&mut self, other: &ProxyCounters) {
        self.sessions_resumed += other.sessions_resumed;
        self.keys_moved += other.keys_moved;
        self.keys_lost += other.keys_lost;
        self.sessions_open += other.sessions_open;
    }
}
