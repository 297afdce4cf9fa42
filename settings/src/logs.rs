//! How every lockcell service writes its log: to stderr, as text (coloured only on a
//! terminal, never into a file or a journal) or as JSON lines for a log pipeline; the
//! level from `RUST_LOG` (`info` unless it says otherwise).

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// The format of the log lines (`--log-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event; colours only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields`, `span`).
    Json,
}

/// Starts logging to stderr in `format`, at the level `RUST_LOG` gives, else
/// `default_level`.
pub fn init(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().init(),
    }
}
