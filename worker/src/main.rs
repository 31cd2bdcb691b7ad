//! `cumulus-worker`: the Cumulus worker agent (see the library documentation).

use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = cumulus_worker::Config::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: logs redirected to a file stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    cumulus_worker::run(config, shutdown_signal()).await
}

/// Completes on SIGTERM or SIGINT (ctrl-c).
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                r = tokio::signal::ctrl_c() => match r {
                    Ok(()) => tracing::info!("SIGINT received"),
                    Err(e) => tracing::error!("cannot listen for SIGINT: {e}"),
                },
            }
        }
        Err(e) => {
            tracing::error!("cannot listen for SIGTERM: {e}; only SIGINT stops the agent");
            if let Err(e) = tokio::signal::ctrl_c().await {
                tracing::error!("cannot listen for SIGINT either: {e}");
                std::future::pending::<()>().await;
            }
        }
    }
}
