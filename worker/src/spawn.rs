//! Spawning rank processes from one long-lived thread, and signalling their process groups.
//!
//! Every rank runs in its own session and process group (`setsid`, so its sid and pgid
//! are its pid: it cannot join another rank's group, which `setpgid` allows only within
//! one session), as the user of its [`RankCreds`] when it has them (supplementary groups
//! set, then the group, then the user, before `exec`), with exactly the environment of its
//! [`SpawnRequest`] (nothing of the agent's is inherited), with stdin from `/dev/null` and stdout and stderr both into one pipe read by the agent
//! (as `2>&1`, or Slurm's default of one output file: the two streams stay in the order the
//! rank wrote them, and one reader serves both). Each child also sets
//! `PR_SET_PDEATHSIG = SIGKILL` before `exec` (after the user change, which clears it), so
//! that it dies when the agent dies, even when the agent is killed with SIGKILL and cannot
//! clean up.
//!
//! The parent-death signal fires when the *thread* that forked the child exits, not when
//! the process exits. Tokio's blocking-pool threads exit after 10 s idle and its worker
//! threads may be torn down with a runtime, so children are never forked from them: every
//! fork happens on the dedicated `cumulus-spawner` thread started by [`Spawner::start`].
//! That thread lives until every handle of the [`Spawner`] is dropped; the agent holds its
//! handle until every rank has been stopped and reaped, so a live rank's forking thread
//! is alive for as long as the rank is. The child also checks, after arming the signal,
//! that its parent is still the agent (a parent that died during the fork would otherwise
//! never signal it).

use std::ffi::OsString;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

/// Spawn requests that may wait for the spawner thread at once; callers beyond it wait.
pub const SPAWN_QUEUE_CAPACITY: usize = 64;

use crate::identity::RankCreds;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct SpawnRequest {
    /// Program (`argv[0]`), looked up in `PATH` when it has no `/`.
    pub program: OsString,
    /// Arguments after `argv[0]`.
    pub args: Vec<OsString>,
    /// The whole environment (nothing of the agent's is inherited), applied in order, so a
    /// later entry wins over an earlier one.
    pub env: Vec<(OsString, OsString)>,
    /// Working directory; `None` = the agent's own.
    pub working_dir: Option<PathBuf>,
    /// The user and groups to run as; `None` = the agent's.
    pub creds: Option<RankCreds>,
    /// Stdin is a pipe whose write end comes back in [`SpawnedChild::input`] (a warm
    /// spare reads its assignment there); `false` = `/dev/null`.
    pub stdin_pipe: bool,
    /// Runs under `SCHED_IDLE` (a warm spare importing: it takes only CPU nobody else
    /// wants, until the agent sets it back with [`schedule_normally`]).
    pub idle_priority: bool,
}

/// A process the spawner started.
#[derive(Debug)]
pub struct SpawnedChild {
    /// The child (its `stdout`/`stderr` handles are `None`: see `output`).
    pub child: tokio::process::Child,
    /// Read end of the one pipe the child's stdout and stderr both write into (blocking,
    /// close-on-exec; the agent holds no write end, so it reads EOF once every process
    /// holding the write end has exited or closed it).
    pub output: io::PipeReader,
    /// Its pid, which is also its process group id.
    pub pid: u32,
    /// Write end of its stdin pipe, with [`SpawnRequest::stdin_pipe`] (close-on-exec).
    pub input: Option<io::PipeWriter>,
}

/// Why a process could not be started.
#[derive(Debug, Error)]
pub enum SpawnError {
    /// The OS refused to start it (program not found, not executable, bad working dir…).
    #[error(
        "cannot start {program:?}: {source}{}",
        .blocked.as_ref().map_or(String::new(), |why| format!(
            "; ranks run as another user (--run-as), who {why}: make it reachable by \
             that user (o+x on each directory, o+rx on the file), or run ranks as the \
             agent's own user (cumulus-worker without --run-as; cumulusctl local up \
             --allow-root)"
        ))
    )]
    Io {
        /// The program that was asked for.
        program: String,
        /// The OS error.
        #[source]
        source: io::Error,
        /// For a rank run as another user whose program could not be executed: what its
        /// user cannot reach by the mode bits ([`crate::identity::exec_blocker`]).
        blocked: Option<String>,
    },
    /// The spawner thread is gone (the agent is shutting down).
    #[error("the spawner thread has stopped")]
    Stopped,
}

struct SpawnJob {
    request: SpawnRequest,
    reply: oneshot::Sender<Result<SpawnedChild, SpawnError>>,
}

/// Handle to the dedicated spawner thread. Cheap to clone; the thread stops when the last
/// handle is dropped.
#[derive(Debug, Clone)]
pub struct Spawner {
    tx: mpsc::Sender<SpawnJob>,
}

impl Spawner {
    /// Starts the `cumulus-spawner` thread. Children it spawns are registered with the
    /// runtime of `runtime` (their exit status is awaited there; their output pipe is read
    /// by the supervisor's pump thread, outside the runtime).
    pub fn start(runtime: tokio::runtime::Handle) -> io::Result<Spawner> {
        let (tx, mut rx) = mpsc::channel::<SpawnJob>(SPAWN_QUEUE_CAPACITY);
        std::thread::Builder::new()
            .name("cumulus-spawner".into())
            .spawn(move || {
                while let Some(job) = rx.blocking_recv() {
                    let result = {
                        // Pipes and the SIGCHLD watcher register with this runtime.
                        let _guard = runtime.enter();
                        spawn_here(&job.request)
                    };
                    // The requester may have given up; the child is then dropped, and a
                    // dropped tokio Child is still reaped by tokio's orphan queue. Kill its
                    // group first so that nothing nobody watches keeps running.
                    if let Err(Ok(orphan)) = job.reply.send(result) {
                        let _ = signal_group(orphan.pid, Signal::SIGKILL);
                    }
                }
            })?;
        Ok(Spawner { tx })
    }

    /// Spawns a process on the spawner thread (see the module documentation).
    pub async fn spawn(&self, request: SpawnRequest) -> Result<SpawnedChild, SpawnError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(SpawnJob { request, reply })
            .await
            .map_err(|_| SpawnError::Stopped)?;
        rx.await.map_err(|_| SpawnError::Stopped)?
    }
}

fn spawn_here(request: &SpawnRequest) -> Result<SpawnedChild, SpawnError> {
    let mut cmd = std::process::Command::new(&request.program);
    cmd.args(&request.args);
    cmd.env_clear();
    for (key, value) in &request.env {
        cmd.env(key, value);
    }
    if let Some(dir) = &request.working_dir {
        cmd.current_dir(dir);
    }
    let io_err = |source: io::Error| SpawnError::Io {
        program: request.program.to_string_lossy().into_owned(),
        source,
        blocked: None,
    };
    let (output, output_writer) = io::pipe().map_err(io_err)?;
    let stderr_writer = output_writer.try_clone().map_err(io_err)?;
    let mut input = None;
    if request.stdin_pipe {
        let (reader, writer) = io::pipe().map_err(io_err)?;
        cmd.stdin(Stdio::from(reader));
        input = Some(writer);
    } else {
        cmd.stdin(Stdio::null());
    }
    cmd.stdout(Stdio::from(output_writer))
        .stderr(Stdio::from(stderr_writer));
    let agent_pid = nix::unistd::getpid();
    // Built before the fork: the child must not allocate.
    let creds = request.creds.as_ref().map(|c| {
        (
            nix::unistd::Uid::from_raw(c.uid),
            nix::unistd::Gid::from_raw(c.gid),
            c.groups
                .iter()
                .map(|g| nix::unistd::Gid::from_raw(*g))
                .collect::<Vec<_>>(),
        )
    });
    let errno = |e: nix::Error| io::Error::from_raw_os_error(e as i32);
    let idle = request.idle_priority;
    // SAFETY: the closure runs in the forked child before exec and only calls
    // async-signal-safe functions (setsid, setgroups, setgid, setuid, prctl, getppid,
    // sched_setscheduler)
    // without allocating: the io::Error values are built from raw OS error numbers and
    // the id lists were built before the fork.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(errno)?;
            if let Some((uid, gid, groups)) = &creds {
                nix::unistd::setgroups(groups).map_err(errno)?;
                nix::unistd::setgid(*gid).map_err(errno)?;
                nix::unistd::setuid(*uid).map_err(errno)?;
            }
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)
                .map_err(|errno| io::Error::from_raw_os_error(errno as i32))?;
            if nix::unistd::getppid() != agent_pid {
                // The agent died between fork and prctl: its death signal is lost.
                return Err(io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            if idle {
                let param = nix::libc::sched_param { sched_priority: 0 };
                if nix::libc::sched_setscheduler(0, nix::libc::SCHED_IDLE, &param) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .map_err(|source| SpawnError::Io {
            program: request.program.to_string_lossy().into_owned(),
            blocked: exec_blocker(request, &source),
            source,
        })?;
    let pid = child.id().ok_or_else(|| SpawnError::Io {
        program: request.program.to_string_lossy().into_owned(),
        source: io::Error::other("the child exited before its pid could be read"),
        blocked: None,
    })?;
    // The child's end of its stdin pipe was closed here with the temporary command (the
    // child holds its own copy), so the child reads EOF once `input` is dropped.
    Ok(SpawnedChild {
        child,
        pid,
        output,
        input,
    })
}

/// For a rank of another user whose program the OS refused to execute (`e`, see
/// [`crate::logs::is_exec_error`]): what that user cannot reach by the mode bits.
fn exec_blocker(request: &SpawnRequest, e: &io::Error) -> Option<String> {
    let creds = request.creds.as_ref()?;
    if !crate::logs::is_exec_error(e) {
        return None;
    }
    let path_var = request
        .env
        .iter()
        .rev()
        .find(|(name, _)| name == "PATH")
        .map(|(_, value)| value.as_os_str());
    crate::identity::exec_blocker(
        std::path::Path::new(&request.program),
        path_var,
        request.working_dir.as_deref(),
        creds,
    )
}

/// Sets every thread of every process in the process group `pgid` (a spare and what it
/// started, e.g. a `pyenv` shim's helpers) back to the normal policy (`SCHED_OTHER`, nice
/// values unchanged) after [`SpawnRequest::idle_priority`]: needs `CAP_SYS_NICE` (the
/// agent as root) for processes of another user, or ones whose `RLIMIT_NICE` forbids it.
/// Two passes over `/proc` (a thread or process started during the first is set in the
/// second); one that ended meanwhile is skipped.
///
/// # Errors
/// The first thread the OS refused to change, or `/proc` unreadable.
pub fn schedule_normally(pgid: u32) -> io::Result<()> {
    let param = nix::libc::sched_param { sched_priority: 0 };
    for _ in 0..2 {
        for process in std::fs::read_dir("/proc")? {
            let name = process?.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // Fields after the command's closing parenthesis: state, ppid, pgrp, ...
            let pgrp = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.split_whitespace().nth(2))
                .and_then(|g| g.parse::<u32>().ok());
            if pgrp != Some(pgid) {
                continue;
            }
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for task in tasks {
                let Some(tid) = task?
                    .file_name()
                    .to_str()
                    .and_then(|s| s.parse::<nix::libc::pid_t>().ok())
                else {
                    continue;
                };
                // SAFETY: a plain system call on a thread id with a valid parameter struct.
                #[allow(unsafe_code)]
                let rc =
                    unsafe { nix::libc::sched_setscheduler(tid, nix::libc::SCHED_OTHER, &param) };
                if rc != 0 {
                    let e = io::Error::last_os_error();
                    if e.raw_os_error() != Some(nix::libc::ESRCH) {
                        return Err(e);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Sends `signal` to the process group whose id is `pgid` (a rank's pid). A group that no
/// longer exists (`ESRCH`) is not an error.
pub fn signal_group(pgid: u32, signal: Signal) -> Result<(), nix::Error> {
    let pgid = i32::try_from(pgid).map_err(|_| nix::Error::EINVAL)?;
    if pgid <= 1 {
        // killpg(0) or killpg(1) would hit the agent's own group or init's: never.
        return Err(nix::Error::EINVAL);
    }
    match killpg(Pid::from_raw(pgid), signal) {
        Ok(()) | Err(nix::Error::ESRCH) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::time::{Duration, Instant};

    fn sh(script: &str) -> SpawnRequest {
        SpawnRequest {
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())],
            ..Default::default()
        }
    }

    async fn poll_until(what: &str, deadline: Duration, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn alive(pid: u32) -> bool {
        // A zombie still answers kill(0); read its state from /proc instead.
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => {
                let state = stat
                    .rsplit_once(") ")
                    .and_then(|(_, rest)| rest.chars().next());
                !matches!(state, Some('Z') | Some('X') | None)
            }
            Err(_) => false,
        }
    }

    #[tokio::test]
    async fn child_runs_in_own_session_with_only_its_env() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spawner = Spawner::start(tokio::runtime::Handle::current()).expect("spawner");
        let out = dir.path().join("out");
        let mut req = sh(&format!(
            "echo \"$$ $(cut -d' ' -f5 /proc/$$/stat) $(cut -d' ' -f6 /proc/$$/stat)\" > {o}; \
             echo \"A=$A HOME_SET=${{HOME:+yes}} LEAK=${{CUMULUS_TOKEN:-none}}\" >> {o}; pwd >> {o}",
            o = out.display()
        ));
        req.env = vec![
            ("PATH".into(), std::env::var_os("PATH").unwrap_or_default()),
            ("A".into(), "1".into()),
            ("A".into(), "2".into()),
        ];
        req.working_dir = Some(dir.path().to_path_buf());
        let mut spawned = spawner.spawn(req).await.expect("spawn");
        let status = spawned.child.wait().await.expect("wait");
        assert!(status.success(), "{status:?}");
        let text = std::fs::read_to_string(&out).expect("output");
        let mut lines = text.lines();
        let ids: Vec<&str> = lines.next().expect("ids").split_whitespace().collect();
        assert_eq!(ids[0], spawned.pid.to_string());
        assert_eq!(ids[1], spawned.pid.to_string(), "pgid must equal pid");
        assert_eq!(ids[2], spawned.pid.to_string(), "sid must equal pid");
        // HOME is in the test's environment, not in the request's: not inherited.
        assert_eq!(lines.next(), Some("A=2 HOME_SET= LEAK=none"));
        let cwd = std::fs::canonicalize(dir.path()).expect("canon");
        assert_eq!(lines.next(), Some(cwd.to_str().expect("utf8")));
    }

    #[tokio::test]
    async fn missing_program_is_a_spawn_error() {
        let spawner = Spawner::start(tokio::runtime::Handle::current()).expect("spawner");
        let err = spawner
            .spawn(SpawnRequest {
                program: "/nonexistent/cumulus-no-such-program".into(),
                ..Default::default()
            })
            .await
            .expect_err("must fail");
        assert!(matches!(err, SpawnError::Io { .. }), "{err}");
    }

    #[tokio::test]
    async fn signal_group_reaches_grandchildren() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spawner = Spawner::start(tokio::runtime::Handle::current()).expect("spawner");
        let pidfile = dir.path().join("grandchild");
        let mut spawned = spawner
            .spawn(sh(&format!(
                "sleep 1000 & echo $! > {p}.tmp; mv {p}.tmp {p}; wait",
                p = pidfile.display()
            )))
            .await
            .expect("spawn");
        poll_until("grandchild pid", Duration::from_secs(10), || {
            pidfile.exists()
        })
        .await;
        let grandchild: u32 = std::fs::read_to_string(&pidfile)
            .expect("read")
            .trim()
            .parse()
            .expect("pid");
        assert!(alive(grandchild));
        signal_group(spawned.pid, Signal::SIGKILL).expect("killpg");
        let status = spawned.child.wait().await.expect("wait");
        assert_eq!(status.signal(), Some(9));
        poll_until("grandchild death", Duration::from_secs(10), || {
            !alive(grandchild)
        })
        .await;
        // Refuses the dangerous groups.
        assert!(signal_group(0, Signal::SIGTERM).is_err());
        assert!(signal_group(1, Signal::SIGTERM).is_err());
    }

    /// The fork happens on the spawner thread, so a requester thread that exits does not
    /// trigger the child's parent-death signal. (Were the child forked on the requesting
    /// thread, it would be SIGKILLed when that thread exits, and this test would see
    /// signal 9 instead of a clean exit.)
    #[test]
    fn child_survives_the_exit_of_the_requesting_thread() {
        let dir = tempfile::tempdir().expect("tempdir");
        let go = dir.path().join("go");
        let done = dir.path().join("done");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let spawner = Spawner::start(runtime.handle().clone()).expect("spawner");
        let script = format!(
            "while [ ! -e {go} ]; do sleep 0.01; done; echo ok > {done}",
            go = go.display(),
            done = done.display()
        );
        let handle = runtime.handle().clone();
        let requester_spawner = spawner.clone();
        let requester = std::thread::spawn(move || {
            handle
                .block_on(async move { requester_spawner.spawn(sh(&script)).await.expect("spawn") })
        });
        let mut spawned = requester.join().expect("requester thread");
        std::fs::write(&go, b"").expect("go");
        let status = runtime
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(30), spawned.child.wait()).await
            })
            .expect("child finished in time")
            .expect("wait");
        assert_eq!(status.code(), Some(0), "{status:?}");
        assert!(done.exists());
        drop(spawner);
    }

    /// The other side of the same coin: the spawner thread is the children's parent
    /// thread, so once every handle is dropped (the thread ends) its children die.
    #[test]
    fn children_die_with_the_spawner_thread() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let spawner = Spawner::start(runtime.handle().clone()).expect("spawner");
        let mut spawned = runtime
            .block_on(spawner.spawn(sh("exec sleep 1000")))
            .expect("spawn");
        drop(spawner);
        let status = runtime
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(30), spawned.child.wait()).await
            })
            .expect("child killed in time")
            .expect("wait");
        assert_eq!(status.signal(), Some(9));
    }

    /// Helper process for `children_die_when_the_agent_is_sigkilled`: spawns a child through
    /// the spawner (the child dumps its environment to `$CUMULUS_TEST_PDEATH_FILE.env`),
    /// writes the child's pid to `$CUMULUS_TEST_PDEATH_FILE`, then waits forever. Run alone
    /// (without that variable) it does nothing.
    #[test]
    #[ignore = "helper process started by children_die_when_the_agent_is_sigkilled"]
    fn pdeathsig_helper_process() {
        let Some(file) = std::env::var_os("CUMULUS_TEST_PDEATH_FILE") else {
            eprintln!("helper of children_die_when_the_agent_is_sigkilled: nothing to do alone");
            return;
        };
        let file = PathBuf::from(file);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let spawner = Spawner::start(tokio::runtime::Handle::current()).expect("spawner");
            let mut request =
                sh("env > \"$DUMP.tmp\"; mv \"$DUMP.tmp\" \"$DUMP\"; exec sleep 1000");
            request
                .env
                .push(("DUMP".into(), file.with_extension("env").into()));
            let spawned = spawner.spawn(request).await.expect("spawn");
            let tmp = file.with_extension("tmp");
            std::fs::write(&tmp, spawned.pid.to_string()).expect("write pid");
            std::fs::rename(&tmp, &file).expect("rename pid");
            std::future::pending::<()>().await;
        });
    }

    /// Runs this test binary again as a stand-in agent that spawns a rank through the
    /// spawner, SIGKILLs it, and checks that the rank dies too (PR_SET_PDEATHSIG). Also
    /// checks that the stand-in's own `CUMULUS_*` variables (here a fake cluster token)
    /// never reach the rank.
    #[tokio::test]
    async fn children_die_when_the_agent_is_sigkilled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pidfile = dir.path().join("rank.pid");
        let envfile = dir.path().join("rank.env");
        let exe = std::env::current_exe().expect("current exe");
        let mut agent = tokio::process::Command::new(exe)
            .args([
                "--exact",
                "spawn::tests::pdeathsig_helper_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("CUMULUS_TEST_PDEATH_FILE", &pidfile)
            .env("CUMULUS_TOKEN", "cluster-secret-must-not-leak")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start helper");
        poll_until("rank pid and env", Duration::from_secs(30), || {
            pidfile.exists() && envfile.exists()
        })
        .await;
        let rank: u32 = std::fs::read_to_string(&pidfile)
            .expect("read")
            .trim()
            .parse()
            .expect("pid");
        let env = std::fs::read_to_string(&envfile).expect("env");
        assert!(env.lines().any(|l| l.starts_with("DUMP=")), "{env}");
        assert!(
            !env.lines().any(|l| l.starts_with("CUMULUS_")),
            "inherited CUMULUS_* variables leaked: {env}"
        );
        assert!(alive(rank), "rank {rank} must run before the agent dies");
        agent.start_kill().expect("SIGKILL the agent");
        let status = agent.wait().await.expect("wait agent");
        assert_eq!(status.signal(), Some(9));
        // The rank was reparented (to init or a subreaper) and killed by its death signal.
        poll_until("rank death", Duration::from_secs(10), || !alive(rank)).await;
    }
}
