//! A short fault run in `make test`: every fault kind once (see
//! `lockcell_tests::chaos`), with the safety checker over every client's record; and a
//! run that pauses a client holding a lock.
//! `make chaos` runs many of these for a duration.

use std::time::Duration;

use anyhow::{ensure, Context};
use lockcell_tests::chaos::{self, RunOptions, Skewed, CLOCK_RATE_BOUND};
use lockcell_tests::checker::{regranted_after, Record};

/// What a dead holder's lock may take beyond the session TTL to reach a waiter: the
/// proxy's reaper, the guarded delete, the waiter's grant.
const REGRANT_MARGIN: Duration = Duration::from_secs(2);

pub async fn a_fault_run_of_every_kind_breaks_no_rule() -> anyhow::Result<()> {
    let seed = std::env::var("LOCKCELL_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u16>) as u64;
    println!("fault run seed {seed} (replay: LOCKCELL_CHAOS_SEED={seed})");
    if chaos::available_faults().len() < chaos::FAULTS.len() {
        println!("fault kind skew-clock skipped: no libfaketime (`make setup` installs faketime)");
    }
    let (dir, report) = chaos::run_in_temp_dir(&RunOptions::new(seed)).await?;
    let v = &report.verdict;
    println!(
        "faults {:?}: {} grants, {} acts ({} refused by the fenced resource), {} writes accepted, {} acknowledged small-key writes, {} reads and {} watched events checked ({} reads and watches in the second cell), {} violations",
        report.faults, v.grants, v.acts, v.refused, report.accepted, report.kv.writes, report.kv.reads, report.kv.watched, report.kv.elsewhere, v.violations.len()
    );
    ensure!(
        report.faults.len() == chaos::available_faults().len(),
        "every fault kind was injected"
    );
    if let Some(skewed) = &report.skewed {
        println!("clocks skewed: {skewed}");
    }
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
    ensure!(
        report.kv.writes >= 20 && report.kv.reads >= 20 && report.kv.watched >= 20,
        "the clients kept writing, reading and watching through the faults: {:?}",
        report.kv
    );
    ensure!(
        report.kv.elsewhere > 0,
        "some reads and watches were made in the second cell while the small keys' prefix was there: {:?}",
        report.kv
    );
    Ok(())
}

/// A client paused (SIGSTOP) while it holds a lock, for three times its TTL: another
/// client is granted the lock meanwhile, and the record of the paused client shows that
/// after SIGCONT it never acted past the deadline it had when it was paused.
pub async fn a_paused_client_loses_its_lock_and_does_not_act_after_its_deadline(
) -> anyhow::Result<()> {
    let seed = rand::random::<u16>() as u64;
    println!("seed {seed}");
    let mut options = RunOptions::new(seed);
    options.faults = vec!["pause-client"];
    let (_dir, report) = chaos::run_in_temp_dir(&options).await?;
    let paused = report
        .paused
        .clone()
        .context("no client was holding a lock when the pause came")?;
    let v = &report.verdict;
    ensure!(
        v.violations.is_empty(),
        "violations:\n{}",
        v.violations.join("\n")
    );
    // The paused hold's grant, and a later grant of the same lock to someone else.
    let granted_at = |client: &str, token: &str| {
        report.records.iter().find_map(|r| match r {
            Record::Grant {
                client: c,
                lock,
                token: t,
                at_ns,
                ..
            } if c == client && t == token && *lock == paused.lock => Some(*at_ns),
            _ => None,
        })
    };
    let paused_grant =
        granted_at(&paused.client, &paused.token).context("the paused hold has no grant record")?;
    let passed_on = report.records.iter().any(|r| {
        matches!(r, Record::Grant { client, lock, at_ns, .. }
            if *client != paused.client && *lock == paused.lock && *at_ns > paused_grant)
    });
    ensure!(
        passed_on,
        "{}'s lock {} (token {}) never passed to another client while it was paused",
        paused.client,
        paused.lock,
        paused.token
    );
    // A dead holder's lock goes to a waiter within a TTL of the end of its belief
    // (the proxy expires the session at most a TTL after the client's deadline), plus
    // a margin for the expiry, the delete and the waiter's grant on this busy machine.
    let gap = regranted_after(&report.records, &paused.client, &paused.lock, &paused.token)
        .context("nobody was granted the paused client's lock")?;
    let bound = options.ttl + REGRANT_MARGIN;
    ensure!(
        Duration::from_nanos(gap) <= bound,
        "the paused client's lock passed on {:?} after its deadline, over TTL + margin ({bound:?})",
        Duration::from_nanos(gap)
    );
    // What the paused client did after the pause with its old grant: at most acts
    // decided before its deadline (the checker's rule), and an end of belief.
    let late_acts = report
        .records
        .iter()
        .filter(|r| {
            matches!(r, Record::Act { client, token, at_ns, deadline_ns, .. }
                if *client == paused.client && *token == paused.token && at_ns >= deadline_ns)
        })
        .count();
    ensure!(late_acts == 0, "{late_acts} acts past the deadline");
    println!(
        "{} paused holding {} (token {}); passed on {:?} after its deadline; {} grants, {} acts checked",
        paused.client, paused.lock, paused.token, Duration::from_nanos(gap), v.grants, v.acts
    );
    Ok(())
}

/// The clock-rate bound at work (see `chaos::skewed_holder_run`): a holder whose clocks
/// run slow, or a proxy whose clocks run fast, by four fifths of the bound: the holder
/// stops believing before its proxy lets the lock go, and the checker finds nothing.
/// Off by a fifth (or a quarter), the holder acts on after the lock passed, and the
/// checker sees both what the clients recorded (two holders at once) and what the store
/// had (an act after its holder key was deleted). So a clock fault beyond the bound is
/// one the checker would see.
pub async fn a_clock_within_the_bound_breaks_nothing_and_beyond_it_is_caught() -> anyhow::Result<()>
{
    let off = 0.8 * CLOCK_RATE_BOUND;
    for within in [Skewed::Holder(1.0 - off), Skewed::Proxy(1.0 + off)] {
        let dir = tempfile::tempdir()?;
        let v = chaos::skewed_holder_run(dir.path(), within).await?;
        ensure!(
            v.violations.is_empty(),
            "clocks {within:?}, within the bound: violations:\n{}",
            v.violations.join("\n")
        );
        ensure!(v.acts > 0, "clocks {within:?}: the holder acted");
    }
    for beyond in [Skewed::Holder(0.8), Skewed::Proxy(1.25)] {
        let dir = tempfile::tempdir()?;
        let v = chaos::skewed_holder_run(dir.path(), beyond).await?;
        println!("clocks {beyond:?}: {} violations", v.violations.len());
        ensure!(
            v.violations.iter().any(|w| w.contains("held it")),
            "clocks {beyond:?}, beyond the bound: the checker saw no two holders at once: {:?}",
            v.violations
        );
        ensure!(
            v.violations.iter().any(|w| w.contains("was deleted by")),
            "clocks {beyond:?}, beyond the bound: the checker saw no act after the holder key went: {:?}",
            v.violations
        );
    }
    Ok(())
}
