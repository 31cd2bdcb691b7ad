//! An attempt's Python environment (`DesiredRank.environment`, see [`crate::envs`]): got
//! before its process starts, the setup's lines written to the attempt's log after
//! [`SETUP_PREFIX`] (the `setup` stream), the process started in it (`PATH` with the
//! environment's `bin` first, `VIRTUAL_ENV`), held until the process ends. A restarted
//! rank asks again and finds it cached.
//!
//! An environment that cannot be had fails the attempt as one no restart can fix
//! (`exec_failed`, the leader fails the job at once and spends no restart budget) with
//! the installer's message as its spawn error; the agent's own failure (its disk) is an
//! agent fault instead (a restart spends no budget either).

use std::ffi::OsString;
use std::path::Path;

use cumulus_api::{AttemptKey, DesiredRank};

use crate::envs::{EnvError, EnvLease, SETUP_PREFIX, SetupEvent};
use crate::logs::{ExitRecord, LogWriter};
use crate::spawn::SpawnRequest;

use super::Supervisor;

/// Most bytes of an environment's error in an attempt's spawn error (the coordinators
/// take at most 4,096): its first [`ERROR_HEAD_BYTES`] (what failed) and its end (uv's
/// last lines).
pub const MAX_ENV_ERROR_BYTES: usize = 3_072;
/// See [`MAX_ENV_ERROR_BYTES`].
const ERROR_HEAD_BYTES: usize = 512;

impl Supervisor {
    /// The environment `d` asks for (`None` when it asks for none), its setup's lines
    /// written to `log`; or the exit record of an attempt that cannot start without it.
    pub(super) async fn setup_environment(
        &self,
        key: &AttemptKey,
        d: &DesiredRank,
        log: &mut LogWriter,
    ) -> Result<Option<EnvLease>, ExitRecord> {
        let Some(spec) = &d.environment else {
            return Ok(None);
        };
        let mut setup = self.inner.settings.envs.setup(spec).await;
        loop {
            match setup.next().await {
                SetupEvent::Line(line) => {
                    let line = format!("{SETUP_PREFIX}{line}\n");
                    if let Err(e) = log.append(line.as_bytes()).await.and(log.flush().await) {
                        tracing::warn!(attempt = %key, "cannot write to log: {e}");
                    }
                }
                SetupEvent::Done(Ok(lease)) => {
                    tracing::info!(attempt = %key, env = lease.key(), "Python environment ready");
                    return Ok(Some(lease));
                }
                SetupEvent::Done(Err(e)) => {
                    tracing::warn!(attempt = %key, "no Python environment: {e}");
                    return Err(failure(&e));
                }
            }
        }
    }
}

/// The exit record of an attempt whose environment could not be had.
fn failure(e: &EnvError) -> ExitRecord {
    let message = bounded(&e.to_string());
    if e.is_agent_fault() {
        ExitRecord::agent_failed(message)
    } else {
        ExitRecord {
            exec_failed: true,
            ..ExitRecord::spawn_failed(message)
        }
    }
}

/// `message` cut to [`MAX_ENV_ERROR_BYTES`]: its head and its end around `…`.
fn bounded(message: &str) -> String {
    if message.len() <= MAX_ENV_ERROR_BYTES {
        return message.to_owned();
    }
    let head = &message[..message.floor_char_boundary(ERROR_HEAD_BYTES)];
    let mut from = message.len() - (MAX_ENV_ERROR_BYTES - ERROR_HEAD_BYTES - '…'.len_utf8());
    while !message.is_char_boundary(from) {
        from += 1;
    }
    format!("{head}…{}", &message[from..])
}

/// Starts the process in the environment at `env_dir`: `PATH` (the one it would get,
/// the job's own if it set one) with `<env_dir>/bin` first, and `VIRTUAL_ENV`.
pub(super) fn activate(request: &mut SpawnRequest, env_dir: &Path) {
    let path = request
        .env
        .iter()
        .rev()
        .find(|(name, _)| name == "PATH")
        .map(|(_, value)| value.clone());
    request
        .env
        .retain(|(name, _)| name != "PATH" && name != "VIRTUAL_ENV");
    let mut search: OsString = env_dir.join("bin").into_os_string();
    if let Some(path) = path.filter(|p| !p.is_empty()) {
        search.push(":");
        search.push(path);
    }
    request.env.push(("PATH".into(), search));
    request
        .env
        .push(("VIRTUAL_ENV".into(), env_dir.as_os_str().to_owned()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_comes_first_on_the_path() {
        let mut request = SpawnRequest {
            env: vec![
                ("PATH".into(), "/usr/bin".into()),
                ("A".into(), "1".into()),
                ("PATH".into(), "/job/bin".into()),
                ("VIRTUAL_ENV".into(), "/elsewhere".into()),
            ],
            ..Default::default()
        };
        activate(&mut request, Path::new("/data/envs/k"));
        assert_eq!(
            request.env,
            vec![
                ("A".into(), "1".into()),
                ("PATH".into(), "/data/envs/k/bin:/job/bin".into()),
                ("VIRTUAL_ENV".into(), "/data/envs/k".into()),
            ]
        );
        let mut bare = SpawnRequest::default();
        activate(&mut bare, Path::new("/e"));
        assert_eq!(bare.env[0], ("PATH".into(), "/e/bin".into()));
    }

    #[test]
    fn failures_cannot_run_unless_the_agent_is_at_fault() {
        let install = failure(&EnvError::Build("uv pip install failed".into()));
        assert!(install.exec_failed && !install.agent_fault);
        assert!(
            install
                .spawn_error
                .as_deref()
                .is_some_and(|m| m.contains("uv pip install failed"))
        );
        let disk = failure(&EnvError::Agent("no space".into()));
        assert!(disk.agent_fault && !disk.exec_failed);
        let long = format!("start {} end", "é".repeat(4_000));
        let cut = bounded(&long);
        assert!(cut.len() <= MAX_ENV_ERROR_BYTES, "{}", cut.len());
        assert!(cut.starts_with("start ") && cut.ends_with(" end") && cut.contains('…'));
    }
}
