//! SIGINT and SIGTERM as one stream: once installed they no longer kill lockctl
//! outright, so it can always give up what it holds and close its session first.

use anyhow::Context as _;
use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};

/// SIGINT and SIGTERM, as one stream of signal numbers.
pub(crate) struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn new() -> anyhow::Result<Signals> {
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
        })
    }

    /// The next signal received, as its number.
    pub(crate) async fn recv(&mut self) -> u8 {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::SIGINT as u8,
            _ = self.terminate.recv() => Signal::SIGTERM as u8,
        }
    }
}
