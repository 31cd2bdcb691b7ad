//! Running uv and interpreters for the environments: through the agent's [`Spawner`] (a
//! session of their own, killed with the agent, nothing of the agent's environment but
//! [`PASSED_VARS`]), their output (stdout and stderr share one pipe) read line by line,
//! killed with their whole group at a deadline.

use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{EnvError, EnvSettings};
use crate::spawn::{SpawnError, SpawnRequest, SpawnedChild, Spawner, signal_group};

/// Longest line of output kept, in bytes; a longer one is cut (with `…`).
pub const MAX_OUTPUT_LINE_BYTES: usize = 4_096;
/// Chunks of output buffered between the pipe's reader thread and the caller.
const OUTPUT_CHUNKS: usize = 32;

/// Variables of the agent's environment uv and the interpreters see: the search path,
/// home (uv's own interpreters live there), locale, temporary directory, proxies and CA
/// bundles. uv's configuration variables are not among them: the agent sets what it
/// means ([`Context::env`]).
pub const PASSED_VARS: &[&str] = &[
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
];

/// What a run needs of the environments' settings.
pub struct Context<'a> {
    /// The settings.
    pub settings: &'a EnvSettings,
    /// Starts the processes.
    pub spawner: &'a Spawner,
}

impl Context<'_> {
    /// The uv binary.
    ///
    /// # Errors
    /// [`EnvError::Unavailable`] when the agent found none.
    pub fn uv(&self) -> Result<&Path, EnvError> {
        self.settings.uv.as_deref().ok_or_else(|| {
            EnvError::Unavailable(
                "this worker has no uv to build Python environments with: install it (pip \
                 install uv) and give the agent --uv PATH"
                    .into(),
            )
        })
    }

    /// The environment of every process: [`PASSED_VARS`] of the agent's, uv's cache under
    /// the data dir, no interpreter downloads, no colours.
    fn env(&self) -> Vec<(OsString, OsString)> {
        let mut env: Vec<(OsString, OsString)> = PASSED_VARS
            .iter()
            .filter_map(|name| std::env::var_os(name).map(|v| (OsString::from(name), v)))
            .collect();
        env.push(("UV_CACHE_DIR".into(), self.settings.cache_dir().into()));
        env.push(("UV_PYTHON_DOWNLOADS".into(), "never".into()));
        env.push(("NO_COLOR".into(), "1".into()));
        env
    }
}

/// The output and exit of a short run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Captured {
    /// The last lines of output (at most the number asked for).
    pub lines: Vec<String>,
    /// The exit code; `None` when killed by a signal.
    pub status: Option<i32>,
}

impl Captured {
    /// Exited with code 0.
    pub fn success(&self) -> bool {
        self.status == Some(0)
    }

    /// `exit code N` or `killed by a signal`.
    pub fn status_text(&self) -> String {
        status_text(self.status)
    }

    /// The last `n` lines, joined by `; `.
    pub fn last_lines(&self, n: usize) -> String {
        let from = self.lines.len().saturating_sub(n);
        self.lines[from..].join("; ")
    }
}

/// `exit code N` or `killed by a signal`.
pub fn status_text(status: Option<i32>) -> String {
    match status {
        Some(code) => format!("exit code {code}"),
        None => "killed by a signal".into(),
    }
}

/// How a run ended.
#[derive(Debug)]
pub enum Ended {
    /// The process exited (its code; `None`: killed by a signal).
    Exited(Option<i32>),
    /// The deadline passed: its group was killed.
    TimedOut,
}

/// Runs `program args` and keeps the last `max_lines` lines of its output.
///
/// # Errors
/// [`EnvError::Unavailable`] when the program cannot be started, [`EnvError::Probe`]
/// when it runs past `deadline`.
pub async fn capture(
    ctx: &Context<'_>,
    program: impl AsRef<OsStr>,
    args: &[&str],
    deadline: Instant,
    max_lines: usize,
) -> Result<Captured, EnvError> {
    let program = program.as_ref();
    let mut lines = std::collections::VecDeque::new();
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    let ended = stream(ctx, program, args, None, deadline, &mut |line| {
        if lines.len() == max_lines {
            lines.pop_front();
        }
        lines.push_back(line);
    })
    .await?;
    match ended {
        Ended::Exited(status) => Ok(Captured {
            lines: lines.into(),
            status,
        }),
        Ended::TimedOut => Err(EnvError::Probe(format!(
            "{} did not answer within {} s",
            Path::new(program).display(),
            super::spec::PROBE_TIMEOUT.as_secs()
        ))),
    }
}

/// Runs `program args` (in `cwd`, else the agent's) and hands each line of its output to
/// `on_line` as it comes; at `deadline` the process's group is killed.
///
/// # Errors
/// [`EnvError::Unavailable`] when it cannot be executed, [`EnvError::Agent`] for a
/// resource of the agent's own (no pipe, no thread).
pub async fn stream(
    ctx: &Context<'_>,
    program: &OsStr,
    args: Vec<OsString>,
    cwd: Option<PathBuf>,
    deadline: Instant,
    on_line: &mut (dyn FnMut(String) + Send),
) -> Result<Ended, EnvError> {
    let request = SpawnRequest {
        program: program.to_owned(),
        args,
        env: ctx.env(),
        working_dir: cwd,
        creds: None,
        stdin_pipe: false,
        idle_priority: false,
    };
    let shown = Path::new(program).display().to_string();
    let SpawnedChild {
        mut child,
        pid,
        output,
        ..
    } = ctx.spawner.spawn(request).await.map_err(|e| match e {
        SpawnError::Io { source, .. } if crate::logs::is_agent_resource_error(&source) => {
            EnvError::Agent(format!("cannot start {shown}: {source}"))
        }
        e => EnvError::Unavailable(format!("cannot run {shown}: {e}")),
    })?;
    // Until the process is waited for, nothing of its group outlives this function.
    let mut group = KillGroupOnDrop(Some(pid));
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(OUTPUT_CHUNKS);
    let (cancel_read, _cancel_write) = crate::logs::cancel_pipe()
        .map_err(|e| EnvError::Agent(format!("cannot read the output of {shown}: {e}")))?;
    crate::logs::spawn_pump(format!("env-{pid}"), OwnedFd::from(output), tx, cancel_read)
        .map_err(|e| EnvError::Agent(format!("cannot read the output of {shown}: {e}")))?;
    let far = Instant::now() + std::time::Duration::from_secs(86_400 * 365);
    let mut status = None;
    let mut drain_until: Option<Instant> = None;
    loop {
        tokio::select! {
            chunk = rx.recv() => match chunk {
                Some(chunk) => split_lines(&chunk, on_line),
                None if status.is_some() => break,
                // The pipe closed (every writer gone): only the exit is left to wait for.
                None => {
                    let s = tokio::select! {
                        s = child.wait() => s,
                        _ = tokio::time::sleep_until(deadline) => return Ok(Ended::TimedOut),
                    };
                    status = Some(s);
                    group.0 = None;
                    break;
                }
            },
            s = child.wait(), if status.is_none() => {
                status = Some(s);
                // What it left in its group ends with it; the pipe then closes. (Right
                // after the wait, as the supervisor does: the pid cannot be reused yet.)
                let _ = signal_group(pid, Signal::SIGKILL);
                group.0 = None;
                drain_until = Some(Instant::now() + crate::supervisor::DRAIN_TIMEOUT);
            }
            _ = tokio::time::sleep_until(deadline), if status.is_none() => {
                return Ok(Ended::TimedOut);
            }
            _ = tokio::time::sleep_until(drain_until.unwrap_or(far)), if drain_until.is_some() => break,
        }
    }
    let status = status
        .expect("the loop ends only once the process was waited for")
        .map_err(|e| EnvError::Agent(format!("cannot wait for {shown}: {e}")))?;
    Ok(Ended::Exited(status.code()))
}

/// SIGKILLs the process group it names when dropped; `None` once the process was waited
/// for (its pid may then be reused).
struct KillGroupOnDrop(Option<u32>);

impl Drop for KillGroupOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            let _ = signal_group(pid, Signal::SIGKILL);
        }
    }
}

/// Hands the lines of a chunk (whole lines, see [`crate::logs::pump_lines`]) to
/// `on_line`: without `\r` at the end, cut at [`MAX_OUTPUT_LINE_BYTES`].
fn split_lines(chunk: &[u8], on_line: &mut (dyn FnMut(String) + Send)) {
    let chunk = chunk.strip_suffix(b"\n").unwrap_or(chunk);
    for line in chunk.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let mut text = String::from_utf8_lossy(line).into_owned();
        if text.len() > MAX_OUTPUT_LINE_BYTES {
            text.truncate(text.floor_char_boundary(MAX_OUTPUT_LINE_BYTES));
            text.push('…');
        }
        on_line(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_trimmed_and_bounded() {
        let mut got = Vec::new();
        let long = "x".repeat(MAX_OUTPUT_LINE_BYTES + 10);
        split_lines(format!("a\r\n\nb\n{long}\n").as_bytes(), &mut |l| {
            got.push(l)
        });
        assert_eq!(got.len(), 4);
        assert_eq!(
            (got[0].as_str(), got[1].as_str(), got[2].as_str()),
            ("a", "", "b")
        );
        assert_eq!(got[3].len(), MAX_OUTPUT_LINE_BYTES + '…'.len_utf8());
    }
}
