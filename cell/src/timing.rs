//! What part of a call's time was spent waiting outside the process: on etcd, or for
//! the call's turn. The proxy measures its own time on a call as the call's whole time
//! less this (`lockcell_proxy_overhead_seconds`).
//!
//! The tally lives in a task-local scope that [`measured`] opens around a call. Every
//! etcd round trip made through [`crate::error::with_timeout`] adds to it, and so does
//! every wait wrapped in [`waiting`]. Outside a scope both are free and count nothing,
//! so code shared with the audit tailer and the admin tools needs no second path. Work
//! a call hands to a task of its own measures itself with [`measured`] there and
//! passes its figure back to [`add_outside`].

use std::cell::Cell;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

tokio::task_local! {
    static OUTSIDE: Cell<Duration>;
}

/// Runs `call` in a scope of its own and returns its output with the time it spent
/// waiting outside the process (etcd round trips and [`waiting`] spans) in that scope.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use lockcell_cell::timing::{measured, waiting};
///
/// let (answer, outside) = measured(async {
///     waiting(tokio::time::sleep(Duration::from_millis(20))).await;
///     42
/// })
/// .await;
/// assert_eq!(answer, 42);
/// assert!(outside >= Duration::from_millis(20));
/// # }
/// ```
pub async fn measured<F: Future>(call: F) -> (F::Output, Duration) {
    OUTSIDE
        .scope(Cell::new(Duration::ZERO), async {
            let output = call.await;
            (output, OUTSIDE.with(Cell::get))
        })
        .await
}

/// Awaits `wait` and counts the time it took as time spent outside the process, in the
/// scope of the [`measured`] call around it (if any). A wait dropped half-way (the
/// call withdrawn, a `select!` that took another branch) counts up to then.
pub async fn waiting<F: Future>(wait: F) -> F::Output {
    let _counted = Waited(Instant::now());
    wait.await
}

/// Counts the time since it was made as time outside when it is dropped, whether the
/// wait it covers ended or was given up.
struct Waited(Instant);

impl Drop for Waited {
    fn drop(&mut self) {
        add_outside(self.0.elapsed());
    }
}

/// Counts `took` as time the current call spent outside the process; nothing outside a
/// [`measured`] scope.
pub fn add_outside(took: Duration) {
    let _ = OUTSIDE.try_with(|outside| outside.set(outside.get() + took));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn waits_and_round_trips_add_up_and_nothing_else_does() {
        let ((), outside) = measured(async {
            waiting(tokio::time::sleep(Duration::from_millis(30))).await;
            add_outside(Duration::from_millis(5));
            // Time not wrapped in a wait is the process's own.
            tokio::time::sleep(Duration::from_millis(100)).await;
        })
        .await;
        assert!(outside >= Duration::from_millis(35), "{outside:?}");
        assert!(outside < Duration::from_millis(100), "{outside:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_given_up_half_way_counts_up_to_then() {
        let ((), outside) = measured(async {
            tokio::select! {
                () = waiting(tokio::time::sleep(Duration::from_secs(60))) => {}
                () = tokio::time::sleep(Duration::from_millis(400)) => {}
            }
        })
        .await;
        assert!(outside >= Duration::from_millis(400), "{outside:?}");
        assert!(outside < Duration::from_secs(60), "{outside:?}");
    }

    #[tokio::test]
    async fn an_etcd_round_trip_counts_as_time_outside() {
        let (answered, outside) = measured(crate::error::with_timeout(
            "test call",
            Duration::from_secs(5),
            async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok::<_, etcd_client::Error>(7)
            },
        ))
        .await;
        assert_eq!(answered.expect("answered"), 7);
        assert!(outside >= Duration::from_millis(20), "{outside:?}");
    }

    #[tokio::test]
    async fn outside_a_scope_nothing_is_counted_and_nothing_fails() {
        add_outside(Duration::from_secs(1));
        waiting(async {}).await;
        let ((), outside) = measured(async {}).await;
        assert_eq!(outside, Duration::ZERO);
    }

    #[tokio::test]
    async fn an_inner_scope_keeps_its_own_tally() {
        let (inner, outer) = measured(async {
            add_outside(Duration::from_millis(1));
            let ((), inner) = measured(async { add_outside(Duration::from_millis(7)) }).await;
            inner
        })
        .await;
        assert_eq!(inner, Duration::from_millis(7));
        assert_eq!(outer, Duration::from_millis(1));
    }
}
