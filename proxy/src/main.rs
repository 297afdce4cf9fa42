//! The `lockcell-proxy` binary: parse the configuration, set up logs and metrics, run
//! until SIGTERM or SIGINT.
#![forbid(unsafe_code)]

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if let Some(reference) =
        lockcell_settings::reference_requested::<lockcell_proxy::config::ProxyConfig>()
    {
        print!("{reference}");
        return Ok(());
    }
    // tonic's TLS and reqwest's both use rustls; this process uses ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let loaded = match lockcell_proxy::settings::load(std::env::args_os().collect()) {
        Ok(loaded) => loaded,
        Err(e) => e.exit(),
    };
    if loaded.config.print_config {
        print!("{}", loaded.render());
    }
    let config = loaded.config;
    if let Err(e) = config.validate() {
        eprintln!("lockcell-proxy: {e}");
        std::process::exit(2);
    }
    if config.check_config {
        check(&config);
    }
    if config.print_config {
        return Ok(());
    }
    // After the checks above, so that --check-config prints its lines alone.
    lockcell_settings::logs::init(config.log_format, "info");
    let prometheus = lockcell_proxy::install_metrics()?;
    match lockcell_proxy::run(config, prometheus, shutdown_signal()).await {
        Ok(lockcell_proxy::Stopped::Asked) => Ok(()),
        Ok(lockcell_proxy::Stopped::Drained) => {
            let status = lockcell_proxy::admin::EXIT_DRAINED;
            eprintln!("lockcell-proxy: stopped by POST /drain (exit status {status})");
            std::process::exit(status);
        }
        Err(e) => {
            // One line that says why, causes included (no backtrace in the log).
            tracing::error!("stopped: {e:#}");
            eprintln!("lockcell-proxy: {e:#}");
            std::process::exit(1);
        }
    }
}

/// `--check-config`: checks what a start would read, says what it found, and exits 0
/// when a start would get past every file, 1 when not.
fn check(config: &lockcell_proxy::ProxyConfig) -> ! {
    let report = lockcell_proxy::check::check(config);
    for line in &report.checked {
        println!("{line}");
    }
    for e in &report.refused {
        eprintln!("lockcell-proxy: {e:#}");
    }
    if report.ok() {
        println!("lockcell-proxy: configuration OK");
        std::process::exit(0);
    }
    eprintln!(
        "lockcell-proxy: configuration refused ({} problem(s)): a start would fail; fix the file(s) and check again",
        report.refused.len()
    );
    std::process::exit(1);
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
}
