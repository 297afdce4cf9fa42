//! Progress bars for phases that take more than a few seconds.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar counting up to `len` things.
pub fn count(what: &str, len: u64) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// A bar for a timed phase, in seconds.
pub fn timed(what: &str, duration: Duration) -> ProgressBar {
    let bar = ProgressBar::new(duration.as_secs().max(1));
    bar.set_style(
        ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} s {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_owned());
    bar
}
