//! The one backoff of the proxy's retry loops: pauses that double from a first to a
//! longest, by backon's exponential backoff.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// The pauses between the tries of one retry loop.
pub struct Pauses {
    builder: ExponentialBuilder,
    longest: Duration,
    backoff: ExponentialBackoff,
}

impl Pauses {
    /// From `first`, doubling up to `longest`, each with jitter (up to as long again):
    /// proxies retrying the same etcd at once spread out.
    pub fn new(first: Duration, longest: Duration) -> Pauses {
        Self::built(
            ExponentialBuilder::default()
                .with_min_delay(first)
                .with_max_delay(longest)
                .with_jitter()
                .without_max_times(),
            longest,
        )
    }

    /// The same without jitter, where the pause is a deadline's part (a lease's
    /// renewal must come before the lease can run out).
    pub fn steady(first: Duration, longest: Duration) -> Pauses {
        Self::built(
            ExponentialBuilder::default()
                .with_min_delay(first)
                .with_max_delay(longest)
                .without_max_times(),
            longest,
        )
    }

    fn built(builder: ExponentialBuilder, longest: Duration) -> Pauses {
        Pauses {
            backoff: builder.build(),
            builder,
            longest,
        }
    }

    /// The pause before the next try.
    pub fn next_pause(&mut self) -> Duration {
        self.backoff.next().unwrap_or(self.longest)
    }

    /// A try went through: the next failure pauses from the first again.
    pub fn reset(&mut self) {
        self.backoff = self.builder.build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn steady_pauses_double_up_to_the_longest_and_start_again_after_a_reset() {
        let mut p = Pauses::steady(100 * MS, 500 * MS);
        let taken: Vec<u128> = (0..5).map(|_| p.next_pause().as_millis()).collect();
        assert_eq!(taken, [100, 200, 400, 500, 500]);
        p.reset();
        assert_eq!(p.next_pause().as_millis(), 100);
    }

    #[test]
    fn jittered_pauses_stay_within_twice_their_steady_length() {
        let mut p = Pauses::new(100 * MS, 500 * MS);
        for steady in [100, 200, 400, 500, 500] {
            let pause = p.next_pause();
            let ms = pause.as_millis() as u32;
            assert!(ms >= steady && ms <= 2 * steady, "{pause:?}");
        }
    }
}
