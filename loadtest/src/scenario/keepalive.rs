//! `keepalive`: N sessions renewed `renewals_per_ttl` times per TTL, one message per
//! session per renewal, for a duration. Measures the rate achieved, round trips, false
//! expiries, and what etcd itself had to do for it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use lockcell_loadtest::pacing;
use lockcell_loadtest::prom;
use lockcell_loadtest::report::Report;
use lockcell_loadtest::stats::{ms, Samples, TimeSeries};
use tokio::time::Instant;

use super::{open_fleet, Resources};
use crate::cluster::{Cell, CellOptions, Target};
use crate::fleet::{report_expiries, FleetSpec};
use crate::progress;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Client sessions.
    #[arg(long, default_value_t = 120_000)]
    pub sessions: usize,
    /// Session TTL.
    #[arg(long, default_value = "12s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// Renewals per TTL (3: every 4 s at TTL 12 s).
    #[arg(long, default_value_t = 3)]
    pub renewals_per_ttl: u32,
    /// How long to measure, once every session is open.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Client connections the sessions are spread over (each carries one keepalive
    /// stream with its sessions' renewals).
    #[arg(long, default_value_t = 3_000)]
    pub connections: usize,
}

pub async fn run(target: Target, cell: &CellOptions, args: &Args) -> anyhow::Result<Report> {
    measure(target, cell, args, None).await
}

/// The keepalive run, with `noise` (when given) misbehaving beside the fleet for the
/// whole measured window; its calls are counted in the report.
pub async fn measure(
    target: Target,
    cell: &CellOptions,
    args: &Args,
    noise: Option<&super::noisy_neighbour::NoiseArgs>,
) -> anyhow::Result<Report> {
    let spec = FleetSpec {
        sessions: args.sessions,
        ttl: args.ttl,
        renewals_per_ttl: args.renewals_per_ttl,
        connections: args.connections.clamp(1, args.sessions.max(1)),
    };
    spec.check()?;
    let cell = Cell::start(target, cell).await?;
    let mut report = Report::new("keepalive", target.name());
    report.param("sessions", spec.sessions);
    report.param("ttl_s", args.ttl.as_secs_f64());
    report.param("renewals_per_ttl", args.renewals_per_ttl);
    report.param("duration_s", args.duration.as_secs_f64());
    report.param("connections", spec.connections);
    let target_rate = spec.sessions as f64 / spec.period().as_secs_f64();
    report.param("target_keepalives_per_s", target_rate);

    let opened = Instant::now();
    let fleet = open_fleet(&cell, spec).await?;
    report.metric(
        "open_sessions_per_s",
        pacing::rate(spec.sessions as u64, opened.elapsed()),
    );

    // One renewal period of warm-up: every connection has started renewing by then.
    let start = Instant::now() + spec.period();
    fleet.measure(start, start + args.duration);
    tokio::time::sleep_until(start).await;
    let before = cell.etcd_counters().await?;
    let noisy = match noise {
        Some(n) => Some(super::noisy_neighbour::Noise::start(&cell, n).await?),
        None => None,
    };
    let mut resources = Resources::start(&cell);
    let bar = progress::timed(&format!("keepalive {}", target.name()), args.duration);
    let live = fleet.live.clone();
    let mut last = (0u64, Instant::now());
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    while Instant::now() < start + args.duration {
        tick.tick().await;
        resources.sample();
        let answered = live.answered.load(Ordering::Relaxed);
        let rate = pacing::rate(answered - last.0, last.1.elapsed());
        last = (answered, Instant::now());
        bar.set_position(start.elapsed().as_secs());
        bar.set_message(format!(
            "{rate:.0} keepalives/s now (target {target_rate:.0})"
        ));
    }
    let after = cell.etcd_counters().await?;
    resources.sample();
    if let Some(noisy) = noisy {
        noisy.finish(&mut report).await;
    }
    let workers = fleet.finish().await;
    bar.finish_and_clear();

    let mut latency = Samples::new();
    let mut send_lag = Samples::new();
    let mut series = TimeSeries::new();
    let (mut sent, mut answered, mut stream_errors) = (0, 0, 0);
    let (mut cut_off, mut not_sent) = (0, 0);
    for w in &workers {
        latency.merge(&w.latency);
        send_lag.merge(&w.send_lag);
        for (at, rtt) in &w.timeline {
            series.record(*at, *rtt);
        }
        sent += w.sent;
        answered += w.answered;
        stream_errors += w.stream_errors;
        cut_off += w.sessions_cut_off;
        not_sent += w.renewals_not_sent;
    }
    let delta = after.delta(&before);
    report.metric("keepalives_sent", sent as f64);
    report.metric("keepalives_answered", answered as f64);
    report.metric("keepalives_per_s", pacing::rate(answered, args.duration));
    report.metric(
        "keepalive_rate_vs_target",
        pacing::rate(answered, args.duration) / target_rate,
    );
    if let Some(p) = latency.percentile(50.0) {
        report.metric("keepalive_p50_ms", ms(p));
    }
    if let Some(p) = latency.percentile(99.0) {
        report.metric("keepalive_p99_ms", ms(p));
    }
    if let Some(p) = latency.max() {
        report.metric("keepalive_max_ms", ms(p));
    }
    report_expiries(&mut report, &workers, |_| true);
    // The load generator's own pacing: how late renewals left it.
    if let Some(p) = send_lag.percentile(99.0) {
        report.metric("renewal_send_lag_p99_ms", ms(p));
    }
    if let Some(p) = send_lag.max() {
        report.metric("renewal_send_lag_max_ms", ms(p));
    }
    report.metric("stream_errors", stream_errors as f64);
    report.metric("sessions_cut_off", cut_off as f64);
    report.metric("renewals_not_sent", not_sent as f64);
    report.metric("etcd_requests", prom::etcd_requests(&delta));
    report.metric(
        "etcd_requests_per_keepalive",
        prom::etcd_requests(&delta) / (answered.max(1) as f64),
    );
    report.metric("etcd_proposals", delta.get("proposals_committed"));
    report.metric("etcd_lease_keepalives", delta.get("lease_keepalives"));
    resources.finish(&mut report, spec.sessions);
    report
        .series
        .insert("keepalive_p99_ms_per_s".into(), series.p99_per_second());
    Ok(report)
}
