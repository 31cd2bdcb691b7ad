//! Warm spares: idle interpreters kept for a job (`DesiredRank.warm_spares`), each
//! started the way the job's next rank would be — the same program (a Python
//! interpreter), user and groups, session and parent-death signal (the spawner), the
//! rank's environment without the contract variables (its uv environment's `PATH` and
//! `VIRTUAL_ENV` included), the job's working directory — with the job's `warm_imports`
//! done ([`BOOTSTRAP`]), blocked on its stdin. A new attempt of the job on this agent
//! takes one instead of starting a process: once [`Supervisor::prepare`] has built the
//! attempt's [`SpawnRequest`], the agent writes that request's arguments, environment
//! and working directory to the spare's stdin, and the spare sets them (`os.environ`,
//! `sys.argv`, `os.chdir`, `sys.path[0]` as `python SCRIPT` would) and runs the script
//! as `__main__` with `runpy`. From there the spare is the attempt's process: its pid
//! (also its process group and session) is the attempt's, its output pipe is the one
//! the attempt's log captures (anything the imports printed comes first), and its exit,
//! signals and stop escalation are an ordinary rank's.
//!
//! A spare is used only when everything but the contract variables of the new request
//! equals what it was started with ([`Template`]); otherwise the attempt starts a new
//! process as always. Until then a spare runs under `SCHED_IDLE` when the agent runs as
//! root (which can set it back when a rank takes it): its imports take only CPU the
//! ranks leave. Spares hold no slot and no GPU: they are started with
//! `CUDA_VISIBLE_DEVICES` empty, and one whose imports initialized CUDA exits (70)
//! before it could be used. Spares of a job start once a rank of it on this agent has
//! reported progress (not while its ranks start), are stopped (SIGKILL: nothing runs in
//! them) when the job has no desired rank here any more, when the agent stops, or when
//! the machine runs short of memory ([`MIN_AVAILABLE_PERCENT`]); a spare that dies on
//! its own stops the job's spares on this agent (the reason in the agent's log).
//!
//! Limits: at most `MAX_WARM_SPARES` per job (the spec's bound), [`MAX_SPARES`] per
//! agent.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cumulus_api::{DesiredRank, WarmSpare, rank_env};
use nix::sys::signal::Signal;

use crate::envs::{EnvLease, SetupEvent};
use crate::identity::RankCreds;
use crate::spawn::{SpawnRequest, SpawnedChild, signal_group};

use super::Supervisor;

/// A spare's first code: imports, then wait for an assignment and become the rank.
pub const BOOTSTRAP: &str = include_str!("spare_bootstrap.py");
/// First field of an assignment: the format's version.
const ASSIGNMENT_MAGIC: &[u8] = b"cumulus-spare-1";
/// Most spares one agent keeps, over every job.
pub const MAX_SPARES: usize = 256;
/// Below this share of the machine's memory available (`MemAvailable` of
/// `/proc/meminfo`), the agent stops its spares and starts none.
pub const MIN_AVAILABLE_PERCENT: u64 = 10;

/// What a spare was started with: everything of a rank's [`SpawnRequest`] but the
/// contract variables, which differ per attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Template {
    program: OsString,
    env: Vec<(OsString, OsString)>,
    working_dir: Option<PathBuf>,
    creds: Option<RankCreds>,
    imports: Vec<String>,
    /// The directory a fresh `python SCRIPT` puts first on `sys.path`, when known before
    /// the assignment (an absolute script, or one relative to a fixed working dir).
    script_dir: Option<PathBuf>,
}

impl Template {
    /// The template of `request`, an attempt of `desired` (`None` when its job keeps no
    /// spares or its command is not one a spare can run).
    pub(super) fn of(request: &SpawnRequest, desired: &DesiredRank) -> Option<Template> {
        if desired.warm_spares == 0 {
            return None;
        }
        let entry = cumulus_api::warm::python_entry(&desired.command)?;
        let is_contract = |name: &OsString| {
            rank_env::CONTRACT_VARS
                .iter()
                .chain(rank_env::GPU_VARS)
                .any(|v| name.as_bytes() == v.as_bytes())
        };
        // A packed workdir is unpacked afresh per attempt: only the job's fixed
        // working_dir is known before the assignment.
        let working_dir = (!desired.working_dir.is_empty() && desired.workdir.is_none())
            .then(|| PathBuf::from(&desired.working_dir));
        let script_dir = match entry {
            cumulus_api::warm::PythonEntry::Script(script) => {
                let script = Path::new(script);
                let full = if script.is_absolute() {
                    Some(script.to_path_buf())
                } else {
                    working_dir.as_ref().map(|d| d.join(script))
                };
                full.and_then(|f| std::fs::canonicalize(f).ok())
                    .and_then(|f| f.parent().map(Path::to_path_buf))
            }
            cumulus_api::warm::PythonEntry::Module(_) => working_dir.clone(),
        };
        Some(Template {
            program: request.program.clone(),
            env: request
                .env
                .iter()
                .filter(|(name, _)| !is_contract(name))
                .cloned()
                .collect(),
            working_dir: if desired.workdir.is_some() {
                None
            } else {
                request.working_dir.clone()
            },
            creds: request.creds.clone(),
            imports: desired.warm_imports.clone(),
            script_dir,
        })
    }

    /// The request that starts a spare of this template.
    fn spare_request(&self) -> SpawnRequest {
        let mut env = self.env.clone();
        env.push((rank_env::CUDA_VISIBLE_DEVICES.into(), OsString::new()));
        SpawnRequest {
            program: self.program.clone(),
            args: vec![
                "-c".into(),
                BOOTSTRAP.into(),
                self.imports.join(",").into(),
                self.script_dir
                    .as_ref()
                    .map_or_else(OsString::new, |d| d.clone().into_os_string()),
            ],
            env,
            working_dir: self.working_dir.clone(),
            creds: self.creds.clone(),
            stdin_pipe: true,
            idle_priority: idles_spares(),
        }
    }
}

/// One idle spare.
struct Spare {
    spawned: SpawnedChild,
    template: Arc<Template>,
    started: std::time::Instant,
    /// Its job's Python environment, held while it lives.
    _lease: Option<EnvLease>,
}

impl Spare {
    /// Ends an idle spare: SIGKILL to its group (its child is reaped by tokio).
    fn kill(self) {
        let _ = signal_group(self.spawned.pid, Signal::SIGKILL);
    }
}

#[derive(Default)]
struct JobSpares {
    wanted: u32,
    template: Option<Arc<Template>>,
    idle: Vec<Spare>,
    /// Spares being started.
    starting: u32,
    /// A spare of the job died on its own: none is started again for it here.
    failed: bool,
}

/// The agent's spares, by job.
#[derive(Default)]
pub(super) struct Pool {
    jobs: HashMap<String, JobSpares>,
    /// The last maintenance found memory short (logged once per episode).
    short_of_memory: bool,
    /// Jobs whose spares stay while none of their ranks is desired here (a restart in
    /// its backoff): the leader's `HeartbeatResponse.spare_jobs`.
    keep: HashSet<String>,
}

impl Pool {
    fn count(&self) -> usize {
        self.jobs
            .values()
            .map(|j| j.idle.len() + j.starting as usize)
            .sum()
    }
}

/// Whether spares wait under `SCHED_IDLE`: only when the agent can set them back (root,
/// `CAP_SYS_NICE`).
fn idles_spares() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Whether the machine's available memory is below [`MIN_AVAILABLE_PERCENT`] of its
/// total (`/proc/meminfo`; unreadable: not short).
pub fn memory_short() -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return false;
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse::<u64>().ok())
    };
    match (field("MemTotal:"), field("MemAvailable:")) {
        (Some(total), Some(available)) => available * 100 < total * MIN_AVAILABLE_PERCENT,
        _ => false,
    }
}

/// The bytes a spare reads as its assignment: `request`'s working directory (`cwd`
/// when it names none), arguments and environment.
fn assignment(request: &SpawnRequest, cwd: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    let mut field = |bytes: &[u8]| {
        out.extend_from_slice(bytes);
        out.push(0);
    };
    field(ASSIGNMENT_MAGIC);
    field(
        request
            .working_dir
            .as_deref()
            .unwrap_or(cwd)
            .as_os_str()
            .as_bytes(),
    );
    field(request.args.len().to_string().as_bytes());
    for a in &request.args {
        field(a.as_bytes());
    }
    field(request.env.len().to_string().as_bytes());
    for (name, value) in &request.env {
        let mut item = name.as_bytes().to_vec();
        item.push(b'=');
        item.extend_from_slice(value.as_bytes());
        field(&item);
    }
    out
}

impl Supervisor {
    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.inner.spares.lock().expect("spare pool lock poisoned")
    }

    /// A spare of `template`'s job that takes the attempt `request` describes: its
    /// assignment written, it is the attempt's process from here. `None` when the job
    /// has no idle spare of this template (or the one found could not be assigned):
    /// the attempt then starts a process as always.
    pub(super) async fn take_spare(
        &self,
        job_id: &str,
        template: &Template,
        request: &SpawnRequest,
    ) -> Option<(SpawnedChild, std::time::Duration)> {
        let mut spare = {
            let mut pool = self.pool();
            let job = pool.jobs.get_mut(job_id)?;
            let mut found = None;
            while let Some(mut s) = job.idle.pop() {
                let alive = matches!(s.spawned.child.try_wait(), Ok(None));
                if alive && *s.template == *template {
                    found = Some(s);
                    break;
                }
                if !alive {
                    job.failed = true;
                }
                s.kill();
            }
            found?
        };
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        let bytes = assignment(request, &cwd);
        let Some(input) = spare.spawned.input.take() else {
            spare.kill();
            return None;
        };
        if idles_spares()
            && let Err(e) = crate::spawn::schedule_normally(spare.spawned.pid)
        {
            tracing::warn!(
                job = job_id,
                pid = spare.spawned.pid,
                "cannot set a warm spare's scheduling back: {e}"
            );
            spare.kill();
            return None;
        }
        // A pipe write blocks once the spare's pipe buffer is full (it reads only after its
        // imports): off the runtime thread.
        let written = tokio::task::spawn_blocking(move || {
            let mut input = input;
            input.write_all(&bytes)
            // `input` dropped here: the spare reads EOF after its assignment.
        })
        .await;
        match written {
            Ok(Ok(())) => {
                let age = spare.started.elapsed();
                Some((spare.spawned, age))
            }
            Ok(Err(e)) => {
                tracing::warn!(
                    job = job_id,
                    pid = spare.spawned.pid,
                    "cannot assign a warm spare: {e}"
                );
                spare.kill();
                None
            }
            Err(e) => {
                tracing::warn!(job = job_id, "cannot assign a warm spare: {e}");
                spare.kill();
                None
            }
        }
    }

    /// Records that an attempt of `desired`'s job started from `template` here: the job
    /// wants `desired.warm_spares` spares of it on this agent.
    pub(super) fn want_spares(&self, desired: &DesiredRank, template: Template) {
        let mut pool = self.pool();
        let job = pool.jobs.entry(desired.job_id.clone()).or_default();
        job.wanted = desired
            .warm_spares
            .min(cumulus_api::limits::MAX_WARM_SPARES);
        if job.template.as_deref() != Some(&template) {
            // Spares of an older template can no longer be used.
            for s in job.idle.drain(..) {
                s.kill();
            }
            job.template = Some(Arc::new(template));
        }
    }

    /// Takes the leader's list of the jobs whose spares this agent keeps while none of
    /// their ranks is desired here (`HeartbeatResponse.spare_jobs`), before its desired
    /// set is applied.
    pub fn keep_spares_of(&self, jobs: &[String]) {
        self.pool().keep = jobs.iter().take(MAX_SPARES).cloned().collect();
    }

    /// The spares this agent keeps, for its heartbeat.
    pub fn warm_spares(&self) -> Vec<WarmSpare> {
        let pool = self.pool();
        let mut out: Vec<WarmSpare> = pool
            .jobs
            .iter()
            .flat_map(|(job_id, j)| {
                j.idle.iter().map(move |s| WarmSpare {
                    job_id: job_id.clone(),
                    pid: s.spawned.pid,
                    age_ms: s.started.elapsed().as_millis() as u64,
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.job_id, a.pid).cmp(&(&b.job_id, b.pid)));
        out
    }

    /// Stops every spare and forgets every job's (the agent is stopping, or fenced).
    pub(super) fn stop_spares(&self) {
        let mut pool = self.pool();
        for (_, job) in pool.jobs.drain() {
            for s in job.idle {
                s.kill();
            }
        }
    }

    /// Keeps the spares in line with `desired` (the agent's whole desired set): the
    /// spares of jobs with no desired rank here are stopped; dead spares are noticed;
    /// with memory short every spare is stopped; otherwise jobs with a reported attempt
    /// here get their missing spares started. `reported` holds the jobs with a live
    /// attempt that has made a progress report.
    pub(super) fn maintain_spares(&self, desired: &[DesiredRank], reported: &HashSet<String>) {
        let live_jobs: HashSet<&str> = desired.iter().map(|d| d.job_id.as_str()).collect();
        let short = memory_short();
        let mut to_start: Vec<(
            String,
            Arc<Template>,
            Option<cumulus_api::v1::EnvironmentSpec>,
        )> = Vec::new();
        // Never the table's lock inside the pool's.
        let closed = self.table().closed;
        {
            let mut pool = self.pool();
            let pool = &mut *pool;
            let kept = &pool.keep;
            pool.jobs.retain(|job_id, job| {
                let keep = (live_jobs.contains(job_id.as_str()) || kept.contains(job_id)) && !closed;
                if !keep {
                    if !job.idle.is_empty() {
                        tracing::info!(job = %job_id, spares = job.idle.len(), "the job has no rank here any more: stopping its warm spares");
                    }
                    for s in job.idle.drain(..) {
                        s.kill();
                    }
                }
                keep
            });
            for (job_id, job) in pool.jobs.iter_mut() {
                let mut kept = Vec::with_capacity(job.idle.len());
                for mut s in job.idle.drain(..) {
                    match s.spawned.child.try_wait() {
                        Ok(None) => kept.push(s),
                        Ok(Some(status)) => {
                            tracing::warn!(
                                job = %job_id,
                                pid = s.spawned.pid,
                                %status,
                                "a warm spare exited before it had a rank (its imports failed, \
                                 or touched CUDA: exit 70); no more spares for this job here"
                            );
                            job.failed = true;
                        }
                        Err(e) => {
                            tracing::warn!(job = %job_id, "cannot check a warm spare: {e}");
                            s.kill();
                        }
                    }
                }
                job.idle = kept;
            }
            if short {
                if !pool.short_of_memory && pool.count() > 0 {
                    tracing::warn!(
                        "available memory below {MIN_AVAILABLE_PERCENT}% of the total: stopping every warm spare"
                    );
                }
                pool.short_of_memory = true;
                for job in pool.jobs.values_mut() {
                    for s in job.idle.drain(..) {
                        s.kill();
                    }
                }
                return;
            }
            pool.short_of_memory = false;
            let mut room = MAX_SPARES.saturating_sub(pool.count());
            for (job_id, job) in pool.jobs.iter_mut() {
                let Some(template) = &job.template else {
                    continue;
                };
                if job.failed || !reported.contains(job_id) {
                    continue;
                }
                let have = job.idle.len() as u32 + job.starting;
                let need = (job.wanted.saturating_sub(have) as usize).min(room);
                room -= need;
                for _ in 0..need {
                    job.starting += 1;
                    let environment = desired
                        .iter()
                        .find(|d| &d.job_id == job_id)
                        .and_then(|d| d.environment.clone());
                    to_start.push((job_id.clone(), template.clone(), environment));
                }
            }
        }
        for (job_id, template, environment) in to_start {
            let this = self.clone();
            self.inner.tracker.spawn(async move {
                this.start_spare(job_id, template, environment).await;
            });
        }
    }

    /// Starts one spare of `template` for `job_id` and adds it to the pool (or ends it,
    /// when the job no longer wants it).
    async fn start_spare(
        &self,
        job_id: String,
        template: Arc<Template>,
        environment: Option<cumulus_api::v1::EnvironmentSpec>,
    ) {
        let mut lease = None;
        if let Some(spec) = &environment {
            let mut setup = self.inner.settings.envs.setup(spec).await;
            loop {
                match setup.next().await {
                    SetupEvent::Line(_) => {}
                    SetupEvent::Done(Ok(l)) => {
                        lease = Some(l);
                        break;
                    }
                    SetupEvent::Done(Err(e)) => {
                        tracing::warn!(job = %job_id, "no warm spare: its environment failed: {e}");
                        break;
                    }
                }
            }
            if lease.is_none() {
                self.spare_started(&job_id, None);
                return;
            }
        }
        let spawned = match self.inner.spawner.spawn(template.spare_request()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(job = %job_id, "cannot start a warm spare: {e}");
                self.spare_started(&job_id, None);
                return;
            }
        };
        tracing::info!(job = %job_id, pid = spawned.pid, imports = %template.imports.join(","), "warm spare started");
        self.spare_started(
            &job_id,
            Some(Spare {
                spawned,
                template,
                started: std::time::Instant::now(),
                _lease: lease,
            }),
        );
    }

    /// A spare start of `job_id` ended: `spare` joins the pool if its job still wants it
    /// with that template; otherwise it is stopped.
    fn spare_started(&self, job_id: &str, spare: Option<Spare>) {
        let mut pool = self.pool();
        let short = pool.short_of_memory;
        let Some(job) = pool.jobs.get_mut(job_id) else {
            if let Some(s) = spare {
                s.kill();
            }
            return;
        };
        job.starting = job.starting.saturating_sub(1);
        let Some(spare) = spare else {
            job.failed = true;
            return;
        };
        let current = job.template.as_deref() == Some(&*spare.template);
        if current && (job.idle.len() as u32) < job.wanted && !short {
            job.idle.push(spare);
        } else {
            spare.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assignment_is_nul_terminated_fields() {
        let request = SpawnRequest {
            program: "python3".into(),
            args: vec!["train.py".into(), "--x".into()],
            env: vec![("A".into(), "1=2".into()), ("RANK".into(), "0".into())],
            working_dir: None,
            ..Default::default()
        };
        let bytes = assignment(&request, Path::new("/w"));
        assert_eq!(
            bytes,
            b"cumulus-spare-1\0/w\x002\0train.py\0--x\x002\0A=1=2\0RANK=0\0".to_vec()
        );
    }

    #[test]
    fn a_template_drops_the_contract_and_needs_python() {
        let desired = DesiredRank {
            job_id: "job-000001".into(),
            command: vec!["python3".into(), "/t/train.py".into()],
            warm_spares: 1,
            ..Default::default()
        };
        let request = SpawnRequest {
            program: "python3".into(),
            args: vec!["/t/train.py".into()],
            env: vec![
                ("PATH".into(), "/bin".into()),
                ("RANK".into(), "1".into()),
                ("CUDA_VISIBLE_DEVICES".into(), "GPU-1".into()),
                ("CUMULUS_AGENT_TOKEN".into(), "secret".into()),
            ],
            ..Default::default()
        };
        let t = Template::of(&request, &desired).expect("template");
        assert_eq!(t.env, vec![("PATH".into(), "/bin".into())]);
        let spare = t.spare_request();
        assert!(spare.stdin_pipe);
        assert_eq!(spare.args[0], "-c");
        assert!(
            spare
                .env
                .contains(&("CUDA_VISIBLE_DEVICES".into(), "".into()))
        );
        // Another attempt of the same rank: the same template.
        let mut next = request.clone();
        next.env[1].1 = "0".into();
        assert_eq!(Template::of(&next, &desired), Some(t));
        let off = DesiredRank {
            warm_spares: 0,
            ..desired.clone()
        };
        assert_eq!(Template::of(&request, &off), None);
        let shell = DesiredRank {
            command: vec!["sh".into(), "x".into()],
            ..desired
        };
        assert_eq!(Template::of(&request, &shell), None);
    }
}
