//! Waiting for a condition with a deadline, instead of sleeping and hoping.

use std::future::Future;
use std::time::Duration;

use anyhow::bail;
use tokio::time::Instant;

/// How often [`eventually`] checks its condition.
pub const POLL: Duration = Duration::from_millis(50);

/// Polls `check` until it yields `Some`, failing with `what` after `within`. An error
/// from `check` is remembered and reported if the deadline passes.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + within;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if Instant::now() >= deadline {
            match last_error {
                Some(e) => bail!("{what}: not within {within:?}; last error: {e:#}"),
                None => bail!("{what}: not within {within:?}"),
            }
        }
        tokio::time::sleep(POLL).await;
    }
}
