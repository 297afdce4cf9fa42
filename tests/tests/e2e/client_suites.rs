//! etcd client libraries' own test suites, run unmodified. Against bare etcd first: the
//! baseline that says a later failure against the proxies is lockcell's, not the
//! suite's or this machine's.

use std::time::Duration;

use anyhow::ensure;
use lockcell_tests::client_suites::{self, NOT_AT_THIS_ENDPOINT};
use lockcell_tests::EtcdCluster;

/// The suite takes about a minute here; ten leave room for a loaded machine.
const SUITE_TIMEOUT: Duration = Duration::from_secs(600);

pub async fn aetcds_own_suite_passes_against_bare_etcd() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start_without_auth(1).await?;
    let endpoint = format!("http://{}", etcd.endpoints()[0]);
    let run = client_suites::run_aetcd(&endpoint, NOT_AT_THIS_ENDPOINT, SUITE_TIMEOUT).await?;
    ensure!(
        run.failed == 0 && run.errors == 0,
        "aetcd {}'s suite against bare etcd at {endpoint}: {} failed, {} errors:\n{}",
        client_suites::AETCD_VERSION,
        run.failed,
        run.errors,
        run.output
    );
    // The whole suite ran: a collection that found nothing would pass no test.
    ensure!(
        run.passed >= 85 && run.deselected == NOT_AT_THIS_ENDPOINT.len() as u32,
        "aetcd's suite ran {} tests ({} deselected), not the whole suite:\n{}",
        run.passed,
        run.deselected,
        run.output
    );
    Ok(())
}
