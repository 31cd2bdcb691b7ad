//! `run`: submit a job, stream its output as `logs -f` does, wait for it and exit with
//! its outcome, like `docker run`: 0 when it succeeded, else the failing rank's exit
//! code (1 when there is none: killed by a signal, cancelled, timed out), with the
//! failure's cause on stderr.
//!
//! Ctrl-C stops following. On a terminal it asks whether to cancel the job (`y` cancels
//! it and waits until it has stopped); otherwise, or on any other answer, the job is left
//! running and the way to follow it is printed. Either way the exit code is 130.
//!
//! Output: with one rank its lines as they are; with several, `[rank R] line`. A new
//! attempt of a rank (a restart) is announced on stderr. On a terminal, control
//! characters are shown as escapes (as `logs` does); `-o json` prints JSON lines.

use std::collections::HashMap;
use std::io::Write;

use anyhow::{Context, Result};
use cumulus_api::{Job, JobState};

use crate::args::{OutputFormat, RunArgs};
use crate::client::Client;
use crate::config::Conn;
use crate::jobs::{WAIT_POLL, build_request, is_finished};
use crate::logs::{CursorState, LogLine, LogRequest, escape_for_terminal, follow_logs};
use crate::upload::{max_upload_bytes, upload_workdir};

/// Exit code after Ctrl-C (128 + SIGINT, as shells report it).
pub const EXIT_INTERRUPTED: u8 = 130;

/// An outcome that ends `cumulusctl` with `code`; `message`, when not empty, is printed
/// as the error (`main` reads it).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ExitWith {
    /// The process's exit code.
    pub code: u8,
    /// What to print on stderr ("" = nothing more).
    pub message: String,
}

/// The command `run` submits: `python3 -c CODE`, or the command given.
pub fn run_command(args: &RunArgs) -> Vec<String> {
    match &args.code {
        Some(code) => vec!["python3".into(), "-c".into(), code.clone()],
        None => args.command.clone(),
    }
}

/// `run`.
///
/// # Errors
/// A request refused before or at submit; otherwise [`ExitWith`] carrying the job's
/// outcome.
pub async fn run(conn: &Conn, args: &RunArgs, output: OutputFormat) -> Result<()> {
    let mut req = build_request(args.world_size, &args.job, run_command(args))?;
    if let Some(dir) = &args.job.upload {
        let blob = upload_workdir(conn, dir, max_upload_bytes(&args.job)).await?;
        req.spec
            .as_mut()
            .context("a built request has a spec")?
            .workdir = Some(blob);
    }
    let client = Client::new(conn)?;
    let resp = client.submit_job(req).await?;
    crate::jobs::print_warnings(&resp.warnings);
    let job_id = resp.job_id;
    eprintln!("{job_id} submitted; its output follows (Ctrl-C to cancel it or leave it running)");
    let followed = {
        let follow = stream_logs(conn, &job_id, args.world_size > 1, output);
        tokio::pin!(follow);
        tokio::select! {
            r = &mut follow => Some(r),
            _ = tokio::signal::ctrl_c() => None,
        }
    };
    match followed {
        None => return interrupted(&client, &job_id).await,
        Some(Err(e)) => {
            eprintln!("warning: following the output failed ({e:#}); waiting for {job_id} to end");
        }
        Some(Ok(())) => {}
    }
    let job = tokio::select! {
        j = wait_finished(&client, &job_id) => j?,
        _ = tokio::signal::ctrl_c() => return interrupted(&client, &job_id).await,
    };
    outcome(&job)
}

/// Follows the job's logs until it ends and its logs are drained, printing each line.
async fn stream_logs(conn: &Conn, job_id: &str, prefix: bool, output: OutputFormat) -> Result<()> {
    let req = LogRequest {
        job_id: job_id.to_string(),
        rank: None,
        follow: true,
        since_ms: None,
    };
    let escape = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut attempts: HashMap<u32, u32> = HashMap::new();
    let mut out = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let mut state = CursorState::default();
    let result = follow_logs(conn, &req, &mut state, |l: &LogLine| {
        if write_err.is_some() {
            return;
        }
        let seen = attempts.insert(l.rank, l.attempt);
        if l.attempt > 0 && seen != Some(l.attempt) {
            eprintln!("--- rank {} attempt {} ---", l.rank, l.attempt);
        }
        if let Err(e) = write_line(&mut out, l, prefix, escape, output) {
            write_err = Some(e);
        }
    })
    .await;
    if let Some(e) = write_err
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        return Err(e).context("writing to stdout");
    }
    Ok(result?)
}

/// One line of `run`'s output.
fn write_line(
    out: &mut dyn Write,
    l: &LogLine,
    prefix: bool,
    escape: bool,
    output: OutputFormat,
) -> std::io::Result<()> {
    match output {
        OutputFormat::Json | OutputFormat::Yaml => {
            let json = serde_json::to_string(l).map_err(std::io::Error::other)?;
            if escape {
                writeln!(out, "{}", crate::logs::escape_json_for_terminal(&json))?;
            } else {
                writeln!(out, "{json}")?;
            }
        }
        OutputFormat::Table | OutputFormat::Wide => {
            let line = if escape {
                escape_for_terminal(&l.line)
            } else {
                std::borrow::Cow::Borrowed(l.line.as_str())
            };
            if prefix {
                writeln!(out, "[rank {}] {line}", l.rank)?;
            } else {
                writeln!(out, "{line}")?;
            }
        }
    }
    out.flush()
}

/// Polls the job until it has finished.
async fn wait_finished(client: &Client, job_id: &str) -> Result<Job> {
    loop {
        let job = client
            .get_job(job_id, true)
            .await?
            .job
            .context("the coordinator returned no job")?;
        if is_finished(&job.state) {
            return Ok(job);
        }
        tokio::time::sleep(WAIT_POLL).await;
    }
}

/// `Ok` when the job succeeded; otherwise [`ExitWith`] with the failing rank's exit
/// code and the cause.
pub fn outcome(job: &Job) -> Result<()> {
    if job.job_state() == Ok(JobState::Succeeded) {
        eprintln!("{} succeeded", job.id);
        return Ok(());
    }
    let cause = if job.failure_cause.is_empty() {
        String::new()
    } else {
        format!(
            ": {}",
            cumulus_api::text::escape_control(&job.failure_cause)
        )
    };
    Err(ExitWith {
        code: failing_exit_code(job),
        message: format!("job {} {}{cause}", job.id, job.state),
    }
    .into())
}

/// The exit code of the first rank that exited with one other than 0, else 1.
pub fn failing_exit_code(job: &Job) -> u8 {
    job.ranks
        .iter()
        .filter_map(|r| r.exit_code)
        .find(|c| *c != 0)
        .and_then(|c| u8::try_from(c).ok())
        .filter(|c| *c != 0)
        .unwrap_or(1)
}

/// After Ctrl-C: on a terminal, ask whether to cancel; cancel and wait, or leave the job
/// running and say how to follow it. Always [`ExitWith`] [`EXIT_INTERRUPTED`].
async fn interrupted(client: &Client, job_id: &str) -> Result<()> {
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stdin())
        && std::io::IsTerminal::is_terminal(&std::io::stderr());
    if interactive && ask(&format!("\ncancel job {job_id}? [y/N] ")).await {
        client.cancel_job(job_id).await?;
        eprintln!("cancelling {job_id}; waiting for its ranks to stop…");
        let job = wait_finished(client, job_id).await?;
        return Err(ExitWith {
            code: EXIT_INTERRUPTED,
            message: format!("job {job_id} {}", job.state),
        }
        .into());
    }
    eprintln!(
        "\n{job_id} is still running: follow it with `cumulusctl logs -f {job_id}` (or `cumulusctl cancel {job_id}`)"
    );
    Err(ExitWith {
        code: EXIT_INTERRUPTED,
        message: String::new(),
    }
    .into())
}

/// Prints `question` on stderr and reads a line from stdin: whether it says yes. A second
/// Ctrl-C or the end of input is a no. The read runs on a thread of its own, left behind
/// if it never returns (the process exits without waiting for it).
async fn ask(question: &str) -> bool {
    eprint!("{question}");
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let answer = std::io::stdin().read_line(&mut line).map(|_| line);
        let _ = tx.send(answer);
    });
    let answer = tokio::select! {
        a = rx => a.ok().and_then(Result::ok).unwrap_or_default(),
        _ = tokio::signal::ctrl_c() => String::new(),
    };
    is_yes(&answer)
}

/// `y` or `yes`, any case, surrounding blanks ignored.
pub fn is_yes(answer: &str) -> bool {
    matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{Cli, Command};
    use clap::Parser;

    fn run_args(argv: &[&str]) -> Result<RunArgs, clap::Error> {
        let argv = ["cumulusctl", "run"].iter().chain(argv);
        match Cli::try_parse_from(argv)?.command {
            Command::Run(a) => Ok(a),
            _ => panic!("not run"),
        }
    }

    #[test]
    fn run_takes_code_or_a_command_and_one_rank_by_default() {
        let a = run_args(&["-c", "print(6*7)"]).expect("valid");
        assert_eq!(a.world_size, 1);
        assert_eq!(run_command(&a), vec!["python3", "-c", "print(6*7)"]);
        let a = run_args(&["--world-size", "2", "--", "python", "train.py", "-v"]).expect("valid");
        assert_eq!(a.world_size, 2);
        assert_eq!(run_command(&a), vec!["python", "train.py", "-v"]);
        assert!(run_args(&[]).is_err(), "neither code nor command");
        let err = run_args(&["-c", "1", "--", "python"]).expect_err("both");
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        let a =
            run_args(&["--upload", ".", "--pip", "numpy", "-c", "import numpy"]).expect("valid");
        assert_eq!(a.job.upload.as_deref(), Some(std::path::Path::new(".")));
        assert_eq!(a.job.pip, vec!["numpy"]);
    }

    fn job(state: &str, codes: &[Option<i32>]) -> Job {
        Job {
            id: "job-000007".into(),
            state: state.into(),
            failure_cause: if state == "failed" {
                "rank 1 attempt 0 exited with code 3".into()
            } else {
                String::new()
            },
            ranks: codes
                .iter()
                .enumerate()
                .map(|(i, c)| cumulus_api::RankStatus {
                    rank: i as u32,
                    exit_code: *c,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_exit_code_is_the_failing_ranks() {
        assert!(outcome(&job("succeeded", &[Some(0)])).is_ok());
        let err = outcome(&job("failed", &[Some(0), Some(3)])).expect_err("failed");
        let exit = err.downcast_ref::<ExitWith>().expect("ExitWith");
        assert_eq!(exit.code, 3);
        assert!(
            exit.message
                .contains("job-000007 failed: rank 1 attempt 0 exited with code 3"),
            "{}",
            exit.message
        );
        let err = outcome(&job("failed", &[None, None])).expect_err("killed");
        assert_eq!(err.downcast_ref::<ExitWith>().expect("ExitWith").code, 1);
        let err = outcome(&job("cancelled", &[Some(0)])).expect_err("cancelled");
        assert_eq!(err.downcast_ref::<ExitWith>().expect("ExitWith").code, 1);
        assert_eq!(failing_exit_code(&job("failed", &[Some(-1)])), 1);
    }

    #[test]
    fn only_y_or_yes_cancels() {
        for yes in ["y", "Y\n", " yes ", "YES"] {
            assert!(is_yes(yes), "{yes:?}");
        }
        for no in ["", "\n", "n", "no", "yy", "sure"] {
            assert!(!is_yes(no), "{no:?}");
        }
    }

    #[test]
    fn lines_are_bare_for_one_rank_prefixed_for_several_and_escaped_on_a_terminal() {
        let l = LogLine {
            rank: 2,
            attempt: 0,
            offset: 0,
            line: "42\u{1b}[2J".into(),
        };
        let mut out = Vec::new();
        write_line(&mut out, &l, false, false, OutputFormat::Table).expect("write");
        write_line(&mut out, &l, true, true, OutputFormat::Table).expect("write");
        write_line(&mut out, &l, false, false, OutputFormat::Json).expect("write");
        let text = String::from_utf8(out).expect("utf8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "42\u{1b}[2J");
        assert_eq!(lines[1], "[rank 2] 42\\x1b[2J");
        let v: serde_json::Value = serde_json::from_str(lines[2]).expect("json");
        assert_eq!(v["rank"], 2);
    }
}
