//! `make chaos`: fault runs one after another for a duration, each a fresh cell with
//! every fault kind injected in a seeded order and the safety checker over every
//! client's record. Prints each run, the totals, and the seeds of failing runs (whose
//! files are kept); exits non-zero if any run broke a rule.

use std::time::Duration;

use clap::Parser;
use lockcell_tests::chaos::{self, RunOptions};
use tokio::time::Instant;

#[derive(Parser)]
#[command(
    about = "Randomized fault runs against real etcd and proxy processes, checked for double grants"
)]
struct Args {
    /// How long to keep starting runs.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Seed of the first run (the next runs take the following seeds); random when
    /// not given. `--runs 1 --seed N` replays run N.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop after this many runs.
    #[arg(long)]
    runs: Option<u64>,
    /// Inject only these fault kinds (comma-separated; default: every kind this machine
    /// can inject), to replay or study a few.
    #[arg(long, value_delimiter = ',', value_parser = fault_kind)]
    faults: Vec<&'static str>,
}

/// A fault kind by name, or an error listing them.
fn fault_kind(name: &str) -> Result<&'static str, String> {
    chaos::FAULTS
        .into_iter()
        .find(|f| *f == name)
        .ok_or_else(|| {
            format!(
                "no fault kind {name:?}; the kinds are {}",
                chaos::FAULTS.join(", ")
            )
        })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !lockcell_tests::etcd::available() {
        eprintln!("lockcell-chaos: skipped: no `etcd` on PATH (make setup installs it)");
        return Ok(());
    }
    let available = chaos::available_faults();
    for fault in chaos::FAULTS.iter().filter(|f| !available.contains(f)) {
        eprintln!("lockcell-chaos: fault kind {fault} skipped: no libfaketime (make setup installs the faketime package)");
    }
    let first = args.seed.unwrap_or_else(|| rand::random::<u32>() as u64);
    let started = Instant::now();
    let (mut runs, mut faults, mut grants, mut acts, mut refused, mut violations) =
        (0u64, 0usize, 0usize, 0usize, 0usize, 0usize);
    let mut kv = lockcell_tests::kvcheck::Checked::default();
    let mut failing = Vec::new();
    while started.elapsed() < args.duration && args.runs.is_none_or(|n| runs < n) {
        let seed = first + runs;
        let mut options = RunOptions::new(seed);
        if !args.faults.is_empty() {
            options.faults = args.faults.clone();
        }
        let (dir, report) = chaos::run_in_temp_dir(&options).await?;
        let v = &report.verdict;
        println!(
            "run {runs} seed {seed}: faults {:?}, {} grants, {} acts ({} refused by fencing), {} acknowledged writes, {} reads, {} watched events, {} reads and watches in the second cell, {} violations",
            report.faults,
            v.grants,
            v.acts,
            v.refused,
            report.kv.writes,
            report.kv.reads,
            report.kv.watched,
            report.kv.elsewhere,
            v.violations.len()
        );
        if let Some(skewed) = &report.skewed {
            println!("  clocks skewed: {skewed}");
        }
        for violation in &v.violations {
            println!("  {violation}");
        }
        runs += 1;
        faults += report.faults.len();
        grants += v.grants;
        acts += v.acts;
        refused += v.refused;
        kv.writes += report.kv.writes;
        kv.reads += report.kv.reads;
        kv.watched += report.kv.watched;
        kv.elsewhere += report.kv.elsewhere;
        violations += v.violations.len();
        if !v.violations.is_empty() {
            let kept = dir.keep();
            println!("  records and logs kept in {}", kept.display());
            failing.push(seed);
        }
    }
    println!(
        "lockcell-chaos: {runs} runs in {:.0?}, {faults} faults injected, {grants} grants, {acts} acts, {} acknowledged writes, {} reads and {} watched events checked ({} reads and watches in the second cell), {refused} acts refused by fencing, {violations} violations",
        started.elapsed(),
        kv.writes,
        kv.reads,
        kv.watched,
        kv.elsewhere
    );
    if !failing.is_empty() {
        println!("failing seeds: {failing:?} (replay: lockcell-chaos --runs 1 --seed SEED)");
        std::process::exit(1);
    }
    Ok(())
}
