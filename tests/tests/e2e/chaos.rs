//! A short fault run in `make test`: every fault kind once (a client paused past its
//! TTL, a proxy killed and restarted, a proxy cut off from etcd past its lease TTL, the
//! etcd leader killed), with the safety checker over every client's record.
//! `make chaos` runs many of these for a duration.

use anyhow::ensure;
use lockcell_tests::chaos::{self, RunOptions, FAULTS};

pub async fn a_fault_run_of_every_kind_breaks_no_rule() -> anyhow::Result<()> {
    let seed = std::env::var("LOCKCELL_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u16>) as u64;
    println!("fault run seed {seed} (replay: LOCKCELL_CHAOS_SEED={seed})");
    let dir = tempfile::Builder::new()
        .prefix("lockcell-chaos-")
        .tempdir()?;
    let report = chaos::run(dir.path(), &RunOptions::new(seed)).await?;
    let v = &report.verdict;
    println!(
        "faults {:?}: {} grants, {} acts ({} refused by the fenced resource), {} writes accepted, {} violations",
        report.faults, v.grants, v.acts, v.refused, report.accepted, v.violations.len()
    );
    ensure!(
        report.faults.len() == FAULTS.len(),
        "every fault kind was injected"
    );
    if !v.violations.is_empty() {
        let kept = dir.keep();
        anyhow::bail!(
            "seed {seed}: {} violations (records and logs kept in {}):\n{}",
            v.violations.len(),
            kept.display(),
            v.violations.join("\n")
        );
    }
    ensure!(
        v.grants >= 20,
        "the clients kept taking locks through the faults: {} grants",
        v.grants
    );
    Ok(())
}
