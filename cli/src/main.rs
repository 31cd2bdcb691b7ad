//! `cumulusctl` binary: parse, set up tracing, run, print `error: ...` with a hint.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use cumulusctl::app;
use cumulusctl::args::Cli;

/// Parses the command line; on an error, exits with clap's message, its usage line
/// computed without the environment: clap counts an option set by its environment
/// variable (`CUMULUS_LOCAL_DIR`, `CUMULUS_ADDR`, …) as given, and would show it in the
/// usage line as if it were required.
fn parse() -> Cli {
    let err = match Cli::command().try_get_matches() {
        Ok(matches) => match Cli::from_arg_matches(&matches) {
            Ok(cli) => return cli,
            Err(e) => e,
        },
        Err(e) => e,
    };
    let plain = Cli::command()
        .mut_args(|a| a.env(None::<&'static str>))
        .try_get_matches();
    match plain {
        // The same mistake, described without the environment's options.
        Err(e) if e.kind() == err.kind() => e.exit(),
        _ => err.exit(),
    }
}

fn main() -> ExitCode {
    let cli = parse();
    // The client's own diagnostics (retries during a failover) only when asked for: a
    // user's terminal shows results and errors, not tracing lines.
    let level = match cli.global.verbose {
        0 => "error",
        1 => "warn",
        2 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: logs redirected to a file stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(app::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`cumulusctl list -o json | head`): not an error of ours.
        Err(err)
            if err.chain().any(|c| {
                c.downcast_ref::<std::io::Error>().map(std::io::Error::kind)
                    == Some(std::io::ErrorKind::BrokenPipe)
                    || c.downcast_ref::<serde_json::Error>()
                        .and_then(serde_json::Error::io_error_kind)
                        == Some(std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        // `run`: the job's outcome as the exit code.
        Err(err) if err.downcast_ref::<cumulusctl::run::ExitWith>().is_some() => {
            let exit = err
                .downcast_ref::<cumulusctl::run::ExitWith>()
                .expect("checked above");
            if !exit.message.is_empty() {
                eprintln!("error: {}", exit.message);
            }
            ExitCode::from(exit.code)
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            if let Some(hint) = app::hint(&err) {
                eprintln!("hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}
