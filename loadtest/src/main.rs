//! `lockcell-loadtest`: runs a scenario against each target in turn on this machine and
//! prints the figures side by side, with the ratio lockcell/other for each.
#![forbid(unsafe_code)]

mod cluster;
mod etcdpb;
mod fleet;
mod holders;
mod locks;
mod members;
mod probe;
mod progress;
mod scenario;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use lockcell_loadtest::plot::{self, Line};
use lockcell_loadtest::report::{markdown_table, Report};

use cluster::{CellOptions, Target};

/// Load test for lockcell, side by side with bare etcd and etcd's grpc-proxy.
///
/// Each scenario starts what it measures (a three-member etcd cluster on loopback and
/// the target's proxies), drives it, stops it, and moves to the next target. Reports
/// go to --out as <scenario>-<target>.json, the side-by-side table to <scenario>.md
/// and plots to <scenario>-*.svg.
///
/// Examples:
///   lockcell-loadtest bench                 # every scenario, small (make bench)
///   lockcell-loadtest bench --full          # the seed's sizes (make bench-full)
///   lockcell-loadtest --targets lockcell,etcd keepalive --sessions 30000 --duration 30s
#[derive(Debug, Parser)]
#[command(
    name = "lockcell-loadtest",
    version,
    about,
    long_about,
    verbatim_doc_comment
)]
struct Cli {
    /// Targets to drive, in this order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lockcell,lockcell-etcd-api,etcd,etcd-grpc-proxy"
    )]
    targets: Vec<Target>,
    /// Where reports, tables and plots go.
    #[arg(long, default_value = "target/loadtest")]
    out: PathBuf,
    /// Use this running etcd cluster (one client endpoint per zone, comma-separated)
    /// instead of starting one.
    #[arg(long, value_delimiter = ',')]
    endpoints: Option<Vec<String>>,
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Debug, Subcommand)]
enum Scenario {
    /// N sessions kept alive at TTL/renewals-per-TTL for a duration.
    Keepalive(scenario::keepalive::Args),
    /// The seed's fleet; zone a dies; survivors wait on its locks and see its members leave.
    ZoneFailure(scenario::zone_failure::Args),
    /// Uncontended acquire and release from C concurrent clients.
    Acquire(scenario::acquire::Args),
    /// W waiters on L locks across zones: handover latency and etcd cost per handover.
    Contention(scenario::contention::Args),
    /// Linearizable reads of configuration keys by C concurrent clients: lockcell's read
    /// barrier against etcd's linearizable range requests.
    Reads(scenario::reads::Args),
    /// lockcell only: N SDK sessions holding locks and keys while the proxies restart one
    /// at a time (drain, exit, start, healthy); what the sessions kept, and keepalive
    /// round trips before and during the restarts.
    RollingRestart(scenario::rolling_restart::Args),
    /// The keepalive fleet alone, then with one client opening sessions and writing
    /// 64 KiB keys on them at full speed beside it (limited on lockcell, not on etcd):
    /// the fleet's keepalive round trips and false expiries side by side.
    NoisyNeighbour(scenario::noisy_neighbour::Args),
    /// Every scenario against every target: small sizes (a few minutes), or --full.
    Bench {
        /// The seed's sizes: 120,000 sessions for 60 s, zone failure at scale 1.0.
        #[arg(long)]
        full: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let Cli {
        targets,
        out,
        endpoints,
        scenario,
    } = Cli::parse();
    raise_fd_limit();
    let cell = CellOptions {
        endpoints,
        lease_ttl: Duration::from_secs(12),
        drain_timeout: None,
        guarded: false,
    };
    let plan: Vec<Scenario> = match scenario {
        Scenario::Bench { full } => bench_plan(full),
        one => vec![one],
    };
    // On Ctrl-C or SIGTERM the run is dropped, and with it every process it started.
    tokio::select! {
        result = run(&targets, &out, &cell, &plan) => result,
        _ = interrupted() => anyhow::bail!("interrupted; everything this run started is stopped"),
    }
}

async fn interrupted() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn run(
    targets: &[Target],
    out: &Path,
    cell: &CellOptions,
    plan: &[Scenario],
) -> anyhow::Result<()> {
    let mut tables = Vec::new();
    let mut failed = Vec::new();
    for scenario in plan {
        let mut reports = Vec::new();
        for &target in targets {
            eprintln!(
                "lockcell-loadtest: {} against {}",
                name(scenario),
                target.name()
            );
            let report = match scenario {
                Scenario::Keepalive(args) => scenario::keepalive::run(target, cell, args).await,
                Scenario::ZoneFailure(args) => {
                    scenario::zone_failure::run(target, cell, args).await
                }
                Scenario::Acquire(args) => scenario::acquire::run(target, cell, args).await,
                Scenario::Contention(args) => scenario::contention::run(target, cell, args).await,
                Scenario::Reads(args) => scenario::reads::run(target, cell, args).await,
                Scenario::RollingRestart(args) => {
                    scenario::rolling_restart::run(target, cell, args).await
                }
                Scenario::NoisyNeighbour(args) => {
                    scenario::noisy_neighbour::run(target, cell, args).await
                }
                Scenario::Bench { .. } => unreachable!("bench expands into scenarios"),
            }
            .with_context(|| format!("{} against {}", name(scenario), target.name()));
            // A target that fails a scenario (bare etcd timing out under the seed's
            // sizes, say) is reported as failed, and the run goes on with the others.
            let mut report = match report {
                Ok(report) => report,
                Err(error) => {
                    eprintln!("lockcell-loadtest: {error:#}");
                    failed.push(format!("{error:#}"));
                    let mut report = Report::new(&name(scenario), target.name());
                    report.param("failed", format!("{error:#}"));
                    report
                }
            };
            report.scenario = name(scenario);
            let path = report.write(out)?;
            eprintln!("lockcell-loadtest: wrote {}", path.display());
            for line in report.evidence.iter().take(5) {
                eprintln!("lockcell-loadtest:   {line}");
            }
            if report.evidence.len() > 5 {
                eprintln!(
                    "lockcell-loadtest:   (and {} more lines of evidence in that file)",
                    report.evidence.len() - 5
                );
            }
            reports.push(report);
        }
        // A target the scenario does not apply to, or that failed it, says why under
        // the table rather than as a column of dashes.
        let (skipped, measured): (Vec<Report>, Vec<Report>) = reports
            .into_iter()
            .partition(|r| r.params.contains_key("skipped") || r.params.contains_key("failed"));
        let mut table = markdown_table(&name(scenario), &measured);
        for r in &skipped {
            let (what, why) = match r.params.get("failed") {
                Some(why) => ("failed", why),
                None => ("not measured", &r.params["skipped"]),
            };
            let why = why.as_str().unwrap_or_default();
            table.push_str(&format!("\n_{} {what}: {why}._\n", r.target));
        }
        std::fs::write(out.join(format!("{}.md", name(scenario))), &table)?;
        plots(out, &name(scenario), &measured)?;
        let table = format!("### {}\n\n{table}", name(scenario));
        println!("{table}");
        tables.push(table);
    }
    if plan.len() > 1 {
        std::fs::write(out.join("summary.md"), tables.join("\n"))?;
    }
    if !failed.is_empty() {
        anyhow::bail!(
            "{} of the runs failed (their tables say so):\n{}",
            failed.len(),
            failed.join("\n")
        );
    }
    Ok(())
}

/// The scenario's name in reports and files; runs of one scenario at other sizes than
/// the seed's carry the size, so a bench plan's runs never overwrite each other.
fn name(scenario: &Scenario) -> String {
    match scenario {
        Scenario::Keepalive(a) if a.ttl == Duration::from_secs(12) => "keepalive".into(),
        Scenario::Keepalive(a) => format!("keepalive-ttl{}", humantime::format_duration(a.ttl)),
        Scenario::ZoneFailure(a) if a.scale == 1.0 => "zone-failure".into(),
        Scenario::ZoneFailure(a) => format!("zone-failure-scale{}", a.scale),
        Scenario::Acquire(a) if a.clients == 16 => "acquire".into(),
        Scenario::Acquire(a) => format!("acquire-c{}", a.clients),
        Scenario::Contention(_) => "contention".into(),
        Scenario::Reads(a) if a.clients == 64 => "reads".into(),
        Scenario::Reads(a) => format!("reads-c{}", a.clients),
        Scenario::RollingRestart(_) => "rolling-restart".into(),
        Scenario::NoisyNeighbour(_) => "noisy-neighbour".into(),
        Scenario::Bench { .. } => "bench".into(),
    }
}

/// The scenarios `bench` runs: small enough for a few minutes here, or the seed's sizes.
fn bench_plan(full: bool) -> Vec<Scenario> {
    use scenario::{acquire, contention, keepalive, reads, zone_failure};
    if full {
        return vec![
            Scenario::Keepalive(keepalive::Args {
                sessions: 120_000,
                ttl: Duration::from_secs(12),
                renewals_per_ttl: 3,
                duration: Duration::from_secs(60),
                connections: 3_000,
            }),
            // Short sessions, renewed every second: each renewed from its own open.
            Scenario::Keepalive(keepalive::Args {
                sessions: 40_000,
                ttl: Duration::from_secs(4),
                renewals_per_ttl: 4,
                duration: Duration::from_secs(30),
                connections: 1_000,
            }),
            Scenario::ZoneFailure(zone_failure::Args {
                scale: 1.0,
                ttl: Duration::from_secs(12),
                connections: 3_000,
                no_membership: false,
            }),
            Scenario::ZoneFailure(zone_failure::Args {
                scale: 0.2,
                ttl: Duration::from_secs(12),
                connections: 1_000,
                no_membership: false,
            }),
            Scenario::Acquire(acquire::Args {
                clients: 16,
                duration: Duration::from_secs(30),
            }),
            Scenario::Acquire(acquire::Args {
                clients: 2,
                duration: Duration::from_secs(20),
            }),
            Scenario::Contention(contention::Args {
                waiters: 600,
                locks: 6,
                settle: Duration::from_secs(3),
            }),
            Scenario::Reads(reads::Args {
                clients: 64,
                keys: 1_000,
                duration: Duration::from_secs(20),
            }),
        ];
    }
    vec![
        Scenario::Keepalive(keepalive::Args {
            sessions: 6_000,
            ttl: Duration::from_secs(12),
            renewals_per_ttl: 3,
            duration: Duration::from_secs(15),
            connections: 300,
        }),
        // Short sessions, renewed every second: each renewed from its own open.
        Scenario::Keepalive(keepalive::Args {
            sessions: 6_000,
            ttl: Duration::from_secs(4),
            renewals_per_ttl: 4,
            duration: Duration::from_secs(15),
            connections: 300,
        }),
        Scenario::ZoneFailure(zone_failure::Args {
            scale: 0.02,
            ttl: Duration::from_secs(6),
            connections: 150,
            no_membership: false,
        }),
        Scenario::Acquire(acquire::Args {
            clients: 8,
            duration: Duration::from_secs(8),
        }),
        Scenario::Contention(contention::Args {
            waiters: 120,
            locks: 4,
            settle: Duration::from_secs(2),
        }),
        Scenario::Reads(reads::Args {
            clients: 32,
            keys: 200,
            duration: Duration::from_secs(8),
        }),
    ]
}

/// One SVG per plotted series, one line per target.
fn plots(out: &Path, scenario: &str, reports: &[Report]) -> anyhow::Result<()> {
    // (file, title, x axis, y axis, series)
    let wanted: Vec<(String, &str, &str, &str, &str)> = if scenario.starts_with("keepalive") {
        vec![(
            format!("{scenario}-latency.svg"),
            "keepalive round trip, p99 per second",
            "seconds",
            "ms",
            "keepalive_p99_ms_per_s",
        )]
    } else if scenario == "rolling-restart" {
        vec![(
            "rolling-restart-latency.svg".to_owned(),
            "keepalive round trip (probes), p99 per second",
            "seconds since the baseline started",
            "ms",
            "keepalive_p99_ms_per_s",
        )]
    } else if scenario.starts_with("zone-failure") {
        vec![
            (
                format!("{scenario}-regrants.svg"),
                "locks of the dead zone re-granted since the kill",
                "seconds since kill",
                "locks",
                "regranted_since_kill",
            ),
            (
                format!("{scenario}-departures.svg"),
                "departures of the dead zone seen by survivors since the kill",
                "seconds since kill",
                "delete events",
                "departures_seen_since_kill",
            ),
        ]
    } else {
        Vec::new()
    };
    for (file, title, x, y, series) in wanted {
        let lines: Vec<Line> = reports
            .iter()
            .filter_map(|r| {
                r.series.get(series).map(|points| Line {
                    label: r.target.clone(),
                    points: points.clone(),
                })
            })
            .collect();
        if !lines.is_empty() {
            plot::line_plot(&out.join(&file), title, x, y, &lines)?;
        }
    }
    Ok(())
}

/// Lets the load generator hold as many connections as the hard limit allows.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}
