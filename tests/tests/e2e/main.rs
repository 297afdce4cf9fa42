//! End-to-end tests: real etcd processes, real proxy processes, the SDK and lockctl.
//!
//! Run with `make test`. Without an `etcd` on PATH every test reports itself ignored
//! (skipped), never passed.

mod bad_input;
mod dev;
mod faults;
mod locks;
mod sessions;
mod support;

use libtest_mimic::{Arguments, Trial};

fn main() {
    let args = Arguments::from_args();
    let skip = !lockcell_tests::etcd::available();
    if skip {
        eprintln!("e2e: skipped: no `etcd` on PATH; install the etcd-server package (`make setup`) to run these tests");
    }
    let trials: Vec<Trial> = vec![
        support::trial(
            "sessions::thousand_sessions_use_k_leases_and_write_nothing",
            sessions::thousand_sessions_use_k_leases_and_write_nothing,
        ),
        support::trial(
            "locks::holder_that_stops_renewing_loses_its_lock",
            locks::holder_that_stops_renewing_loses_its_lock,
        ),
        support::trial(
            "locks::two_clients_hammering_one_lock_are_fenced",
            locks::two_clients_hammering_one_lock_are_fenced,
        ),
        support::trial(
            "locks::retried_acquire_and_release_are_idempotent",
            locks::retried_acquire_and_release_are_idempotent,
        ),
        support::trial(
            "faults::killed_proxy_locks_pass_on_after_lease_ttl",
            faults::killed_proxy_locks_pass_on_after_lease_ttl,
        ),
        support::trial(
            "faults::etcd_away_acquire_unavailable_sessions_end_at_lower_bound",
            faults::etcd_away_acquire_unavailable_sessions_end_at_lower_bound,
        ),
        support::trial(
            "faults::lockctl_stops_its_command_when_the_session_passes_its_deadline",
            faults::lockctl_stops_its_command_when_the_session_passes_its_deadline,
        ),
        support::trial(
            "bad_input::bad_lock_names_are_refused_with_the_rule",
            bad_input::bad_lock_names_are_refused_with_the_rule,
        ),
        support::trial(
            "bad_input::unknown_and_expired_sessions_are_told_apart",
            bad_input::unknown_and_expired_sessions_are_told_apart,
        ),
        support::trial(
            "dev::make_dev_cell_runs_the_lockctl_example_and_stops_cleanly",
            dev::make_dev_cell_runs_the_lockctl_example_and_stops_cleanly,
        ),
    ]
    .into_iter()
    .map(|t| t.with_ignored_flag(skip))
    .collect();
    libtest_mimic::run(&args, trials).exit();
}
