//! etcd client libraries' own test suites, run unmodified. Against bare etcd first: the
//! baseline that says a later failure against the proxies is lockcell's, not the
//! suite's or this machine's.

use std::time::Duration;

use anyhow::ensure;
use lockcell_tests::client_suites::{self, Deselected, NOT_AT_THIS_ENDPOINT, REFUSED_BY_A_PROXY};
use lockcell_tests::ports::free_port;
use lockcell_tests::{EtcdCluster, ProxyOptions, ProxyProcess};

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

/// The same suite, unmodified, against a proxy's etcd API: every test passes but those
/// that call an RPC the proxy refuses on purpose, each deselected with its reason.
pub async fn aetcds_own_suite_passes_against_a_proxy() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut options = ProxyOptions::new("a", etcd.endpoints());
    options.extra_args = vec!["--etcd-listen".into(), listen.clone()];
    let _proxy = ProxyProcess::start(&options, &etcd.dir).await?;
    let endpoint = format!("http://{listen}");
    let deselect: Vec<Deselected> = NOT_AT_THIS_ENDPOINT
        .iter()
        .chain(REFUSED_BY_A_PROXY)
        .copied()
        .collect();
    let run = client_suites::run_aetcd(&endpoint, &deselect, SUITE_TIMEOUT).await?;
    ensure!(
        run.failed == 0 && run.errors == 0,
        "aetcd {}'s suite against a proxy at {endpoint}: {} failed, {} errors:\n{}",
        client_suites::AETCD_VERSION,
        run.failed,
        run.errors,
        run.output
    );
    ensure!(
        run.passed >= 80 && run.deselected == deselect.len() as u32,
        "aetcd's suite ran {} tests ({} deselected), not the whole suite:\n{}",
        run.passed,
        run.deselected,
        run.output
    );
    Ok(())
}
