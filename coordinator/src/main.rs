//! `cumulus-coordinator`: parse the configuration, run until SIGTERM or ctrl-c.

use clap::Parser;

/// mimalloc instead of glibc's malloc: at 64 concurrent submits the leader spent ~20% of
/// its CPU in glibc's malloc and free (arena locking, consolidation); with mimalloc its
/// p50 fell from 8.0–8.5 to 6.8–7.1 ms (docs/perf-notes.md, "mimalloc").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    // Before any thread or file: everything this process creates is its user's alone
    // (`0700` dirs, `0600` files), whatever the umask it inherited. The data dir holds
    // job environments and token hashes, and sled and the WAL create files with the
    // umask's mode (`datadir`). The checkpoint roots it creates for ranks are given their
    // mode explicitly (`api`).
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let config = cumulus_coordinator::Config::parse();
    let mut runtime = if config.worker_threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(usize::from(config.worker_threads));
        b
    };
    runtime.enable_all().build()?.block_on(run(config))
}

async fn run(config: cumulus_coordinator::Config) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,openraft=warn,sled=warn".into()),
        )
        // Colour codes only on a terminal: logs redirected to a file stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    cumulus_coordinator::run(config, shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only ctrl-c stops the coordinator");
            let _ = ctrl_c.await;
            return;
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
