//! The signals that ask lockctl to stop, as one stream: once installed they no longer
//! kill lockctl outright, so it can always stop CMD, give up what it holds and close
//! its session first.
//!
//! Every command takes SIGINT and SIGTERM. The commands that run CMD under a hold
//! (lock, elect, announce) take every other signal whose default would end or stop
//! lockctl and leave CMD running without anyone to stop it: SIGHUP (the terminal or
//! the SSH session closed), SIGQUIT, SIGUSR1, SIGUSR2 and SIGALRM ask it to stop as
//! SIGTERM does; SIGTSTP (Ctrl-Z), SIGTTIN and SIGTTOU are ignored, since a stopped
//! lockctl renews nothing while CMD, in a group of its own, goes on.

use anyhow::Context as _;
use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};

/// The signals asking lockctl to stop, as one stream of signal numbers.
pub(crate) struct Signals {
    /// Signals that ask lockctl to stop.
    stop: Vec<(Signal, tokio::signal::unix::Signal)>,
    /// Signals caught only so that they do not stop lockctl.
    ignored: Vec<(Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    /// SIGINT and SIGTERM.
    pub(crate) fn new() -> anyhow::Result<Signals> {
        Ok(Signals {
            stop: catch(&[Signal::SIGINT, Signal::SIGTERM])?,
            ignored: Vec::new(),
        })
    }

    /// For a command that runs CMD under a hold: every signal that would end or stop
    /// lockctl by default (see the module's comment).
    pub(crate) fn holding() -> anyhow::Result<Signals> {
        Ok(Signals {
            stop: catch(&[
                Signal::SIGINT,
                Signal::SIGTERM,
                Signal::SIGHUP,
                Signal::SIGQUIT,
                Signal::SIGUSR1,
                Signal::SIGUSR2,
                Signal::SIGALRM,
            ])?,
            ignored: catch(&[Signal::SIGTSTP, Signal::SIGTTIN, Signal::SIGTTOU])?,
        })
    }

    /// The next signal asking lockctl to stop, as its number.
    pub(crate) async fn recv(&mut self) -> u8 {
        loop {
            let stop = first_of(&mut self.stop);
            let ignored = first_of(&mut self.ignored);
            tokio::select! {
                signo = stop => return signo as u8,
                signo = ignored => {
                    let name = Signal::try_from(signo).map_or("a stop signal", |s| s.as_str());
                    eprintln!("lockctl: ignoring {name}: a stopped lockctl would renew nothing while CMD runs on");
                }
            }
        }
    }
}

fn catch(signals: &[Signal]) -> anyhow::Result<Vec<(Signal, tokio::signal::unix::Signal)>> {
    signals
        .iter()
        .map(|&s| {
            let stream = signal(SignalKind::from_raw(s as i32))
                .with_context(|| format!("cannot handle {s}"))?;
            Ok((s, stream))
        })
        .collect()
}

/// The first of `streams` to deliver, as its signal number (never, for none).
async fn first_of(streams: &mut [(Signal, tokio::signal::unix::Signal)]) -> i32 {
    if streams.is_empty() {
        return std::future::pending().await;
    }
    std::future::poll_fn(|cx| {
        for (signal, stream) in streams.iter_mut() {
            if stream.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(*signal as i32);
            }
        }
        std::task::Poll::Pending
    })
    .await
}
