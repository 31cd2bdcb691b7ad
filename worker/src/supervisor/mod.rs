//! The rank supervisor: the table of live rank attempts, their whole lifecycle (prepare,
//! spawn, log capture, stop escalation, exit record, exit report) and the rank-facing
//! operations (progress, checkpoint commit).
//!
//! Limits: at most [`MAX_LIVE_ATTEMPTS`] attempts live at once (more are refused with a
//! spawn error); at most [`MAX_FINISHED_REMEMBERED`] finished attempts are remembered in
//! memory (older ones are recognised by their `attempt-<a>.exit` file on disk); a rank's
//! output pipe is drained for at most [`DRAIN_TIMEOUT`] after its process exited; each
//! attempt's log buffers at most [`LOG_CHANNEL_CAPACITY`] chunks of at most
//! [`crate::logs::LINE_PIECE_MAX_BYTES`] (plus one pipe read) in memory; one thread per live attempt reads its output ([`logs::spawn_pump`]).
//!
//! Split along its seams: [`prepare`] (what an attempt needs before its process starts),
//! [`commit`] (a rank's checkpoint part committed and reported), [`reach`] (whether a
//! rank that could not reach this agent did so for the agent's reasons); this module
//! holds the table and the process lifecycle.
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumulus_api::{
    AttemptKey, DesiredRank, ObservedRank, RankExitedRequest, RankStartedRequest, StopAction,
};
use cumulus_ckpt::{CheckpointStore, CkptError, PartRecord};
use nix::sys::signal::Signal;
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::client::{ClientError, CoordinatorClient, RetryPolicy};
use crate::events::{EventReporter, RankEvent};
use crate::logs::{self, AttemptPaths, ExitRecord, LogWriter};
use crate::orphans::{self, PidRecord};
use crate::reconcile::{Action, ObservedAttempt, reconcile};
use crate::spawn::{SpawnError, SpawnedChild, Spawner, signal_group};

/// Most rank attempts alive on this agent at once.
pub const MAX_LIVE_ATTEMPTS: usize = 1024;
/// Most finished attempts remembered in memory (the exit files on disk remember the rest).
pub const MAX_FINISHED_REMEMBERED: usize = 4096;
/// Longest notice between telling a rank of its time limit and its SIGTERM: the longest
/// time limit (365 days), in milliseconds.
pub const MAX_STOP_NOTICE_MS: u64 = 365 * 86_400_000;
/// How long a rank's output pipe is still read after its process exited (a background process
/// that escaped the rank's process group may hold it open).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Chunks (whole lines, at most [`crate::logs::LINE_PIECE_MAX_BYTES`] each) buffered between a
/// rank's pipe readers and its log writer.
pub const LOG_CHANNEL_CAPACITY: usize = 32;
/// Chunks written between two flushes of the log.
const LOG_BATCH_CHUNKS: usize = 64;

/// Fixed settings of a supervisor.
#[derive(Debug, Clone)]
pub struct SupervisorSettings {
    /// This agent's worker id (sent in every report).
    pub worker_id: String,
    /// Root of logs, shard files and pid records.
    pub data_dir: PathBuf,
    /// `MASTER_ADDR` when the leader sends none.
    pub advertise_host: String,
    /// `CUMULUS_AGENT_URL`: the rank-local API, `http://127.0.0.1:<port>`.
    pub rank_api_url: String,
    /// `CUMULUS_AGENT_SOCKET`: the rank-local API's Unix socket, when ranks run as
    /// another user (the API then honours tokens only there).
    pub rank_api_socket: Option<PathBuf>,
    /// Time between SIGTERM and SIGKILL when stopping a rank.
    pub stop_grace: Duration,
    /// Cap of each attempt's log file, in bytes (plus one marker line).
    pub log_max_bytes: u64,
    /// Retries of `CommitCheckpointPart`.
    pub commit_retry: RetryPolicy,
    /// S3 client factory for jobs with an S3 checkpoint target (`ckpt_url`); `None` when
    /// the agent has no S3 settings (such jobs then fail to start with a clear message).
    pub s3: Option<cumulus_ckpt::S3Connector>,
    /// Local cache of dataset shards given as `s3://` URLs; `None` without S3 settings.
    pub dataset_cache: Option<Arc<cumulus_ckpt::DatasetCache>>,
    /// Where a rank's local shards and its job's checkpoint dir may lie (empty: anywhere).
    pub roots: cumulus_api::paths::JobRoots,
    /// The agent has GPUs: every rank gets `CUDA_VISIBLE_DEVICES` (empty without GPUs of
    /// its own) and a job's own value of it is dropped.
    pub has_gpus: bool,
    /// Who ranks run as and what of the agent's environment they inherit.
    pub identity: crate::identity::RankIdentity,
    /// The rank API's listeners, whose refusals make a rank's
    /// [`cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE`] the agent's fault ([`reach`]).
    pub rank_api_watch: RankApiWatch,
    /// The jobs' Python environments, built with uv ([`environment`]).
    pub envs: Arc<crate::envs::Environments>,
    /// The blob cache: jobs' packed workdirs fetched, attempts' artifacts uploaded
    /// ([`workdir`]).
    pub blobs: Arc<crate::blobs::BlobCache>,
    /// Most bytes of one attempt's artifacts (`--max-artifact-bytes`): past it they are
    /// not uploaded and the attempt's log says why.
    pub max_artifact_bytes: u64,
}

/// The latest progress a rank reported (soft state).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// Steps done, as the rank last reported (its own count, not checked).
    pub step: u64,
    /// Steps planned (0 = unknown).
    pub total_steps: u64,
    /// Named metrics (≤ [`cumulus_api::limits::MAX_METRICS`] entries).
    pub metrics: BTreeMap<String, f64>,
}

/// Why a checkpoint commit was refused or failed.
#[derive(Debug, Error)]
pub enum CommitError {
    /// The token names no live attempt.
    #[error("unknown agent token")]
    UnknownToken,
    /// The attempt is being stopped: the leader no longer wants it.
    #[error("attempt {0} is no longer desired on this worker")]
    NotDesired(AttemptKey),
    /// The job has no checkpoint directory.
    #[error("checkpoints are disabled for job {0} (it has no ckpt_dir)")]
    Disabled(String),
    /// The attempt's staging directory is not prepared (yet).
    #[error("the checkpoint staging of {0} is not prepared")]
    NotReady(AttemptKey),
    /// The commit failed: locally (fsync, rename) or, with an S3 target, the upload.
    #[error("committing the part failed: {0}")]
    Store(#[from] CkptError),
    /// The leader rejected the part: the attempt is stale.
    #[error("the leader rejected the part: {0}")]
    Stale(String),
    /// The leader could not be reached or failed otherwise.
    #[error("the leader did not acknowledge the part: {0}")]
    Coordinator(ClientError),
}

/// A part committed locally whose report the leader has not acknowledged yet; a retried
/// commit of the same step re-reports it instead of committing again.
#[derive(Debug)]
struct UnackedPart {
    step: u64,
    part: PartRecord,
}

#[derive(Clone)]
struct CkptTarget {
    store: Arc<dyn CheckpointStore>,
    staging: PathBuf,
}

struct Entry {
    pid: Option<u32>,
    /// SIGTERM is sent (or about to be): `stop` is cancelled.
    stopping: bool,
    /// Cancelled to send SIGTERM to the attempt's group (SIGKILL follows after the grace).
    stop: CancellationToken,
    /// What the rank has been asked (the rank-local API's `GET /v1/control`): set when
    /// the leader asks the job to stop, or the attempt is no longer desired.
    control: Option<StopAction>,
    progress: Option<Progress>,
    ckpt_enabled: bool,
    ckpt: Option<CkptTarget>,
    commit_lock: Arc<tokio::sync::Mutex<Option<UnackedPart>>>,
    /// Dataset-cache pins of this attempt's S3 shards: none is evicted while it runs.
    shard_pins: Vec<cumulus_ckpt::ShardPin>,
    /// The uncaught exception the rank reported last (`POST /v1/exception`), in one line
    /// ([`cumulus_api::rank_local::ExceptionReport::summary`]): the cause of a non-zero
    /// exit that follows.
    exception: Option<String>,
    /// The attempt whose process this is: the key itself, unless an in-process restart
    /// handed the process this newer attempt ([`inprocess`]).
    origin: AttemptKey,
    /// This attempt's rank-local token.
    token: String,
    /// In-process restarts: whether the rank listens, the offer made to it.
    restart: inprocess::RestartState,
    /// Hands the process's output loop the log of a newer attempt (an in-process
    /// restart); set once the process runs.
    log_switch: Option<mpsc::Sender<inprocess::LogSwitch>>,
}

#[derive(Default)]
struct FinishedSet {
    order: VecDeque<AttemptKey>,
    set: HashSet<AttemptKey>,
}

impl FinishedSet {
    fn insert(&mut self, key: AttemptKey) {
        if self.set.insert(key.clone()) {
            self.order.push_back(key);
            while self.order.len() > MAX_FINISHED_REMEMBERED {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

#[derive(Default)]
struct Table {
    entries: HashMap<AttemptKey, Entry>,
    tokens: HashMap<String, AttemptKey>,
    finished: FinishedSet,
    /// Desired attempts that wait for an older attempt of the same rank to exit (as of
    /// the last [`Supervisor::apply_desired`]); reported with pid 0 like preparing ones.
    waiting: HashSet<AttemptKey>,
    /// Set by [`Supervisor::shutdown`]: nothing new starts.
    closed: bool,
    /// Tokens retired by in-process restarts → the attempt their process runs now
    /// (honoured by `GET /v1/restart` only; dropped with the process's entry).
    retired: HashMap<String, AttemptKey>,
}

struct Inner {
    settings: SupervisorSettings,
    table: Mutex<Table>,
    spawner: Spawner,
    client: Arc<CoordinatorClient>,
    events: EventReporter,
    tracker: TaskTracker,
    /// Warm spares by job ([`spares`]); its lock and `table`'s are never held together.
    spares: Mutex<spares::Pool>,
    /// Woken whenever an in-process restart's offer is made or fails.
    restart_notify: tokio::sync::Notify,
}

/// Runs the rank attempts of this agent. Cheap to clone.
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("settings", &self.inner.settings)
            .finish_non_exhaustive()
    }
}

fn random_token() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

/// `<data-dir>/jobs/<job>/rank-<r>.attempt-<a>.shards`.
pub fn shards_file(data_dir: &Path, key: &AttemptKey) -> PathBuf {
    data_dir
        .join("jobs")
        .join(&key.job_id)
        .join(format!("rank-{}.attempt-{}.shards", key.rank, key.attempt))
}

/// Where an attempt's data plan (an elastic job's, `CUMULUS_DATA_PLAN`) is written:
/// beside its shards file.
pub fn data_plan_file(data_dir: &Path, key: &AttemptKey) -> PathBuf {
    data_dir.join("jobs").join(&key.job_id).join(format!(
        "rank-{}.attempt-{}.plan.json",
        key.rank, key.attempt
    ))
}

impl Supervisor {
    /// A supervisor spawning through `spawner` and reporting through `client` / `events`.
    pub fn new(
        settings: SupervisorSettings,
        spawner: Spawner,
        client: Arc<CoordinatorClient>,
        events: EventReporter,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                settings,
                table: Mutex::new(Table::default()),
                spawner,
                client,
                events,
                tracker: TaskTracker::new(),
                spares: Mutex::new(spares::Pool::default()),
                restart_notify: tokio::sync::Notify::new(),
            }),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.inner.table.lock().expect("rank table lock poisoned")
    }

    /// The event reporter exits and starts are queued on.
    pub fn events(&self) -> &EventReporter {
        &self.inner.events
    }

    /// Reconciles the live attempts with the leader's `desired` set: starts what is missing
    /// (never an attempt that already ran here) and stops what is not desired.
    /// Returns the actions taken.
    pub fn apply_desired(&self, desired: &[DesiredRank]) -> Vec<Action> {
        let mut table = self.table();
        if table.closed {
            return Vec::new();
        }
        self.adopt_in_process_locked(&mut table, desired);
        let observed: Vec<ObservedAttempt> = table
            .entries
            .iter()
            .map(|(key, e)| ObservedAttempt {
                key: key.clone(),
                stopping: e.stopping,
            })
            .collect();
        let finished: HashSet<AttemptKey> = desired
            .iter()
            .map(AttemptKey::of)
            .filter(|k| {
                !table.entries.contains_key(k)
                    && (table.finished.set.contains(k) || self.exit_recorded(k))
            })
            .collect();
        let actions = reconcile(desired, &observed, &finished);
        let waiting: HashSet<AttemptKey> = desired
            .iter()
            .map(AttemptKey::of)
            .filter(|k| {
                !table.entries.contains_key(k)
                    && !finished.contains(k)
                    && table
                        .entries
                        .keys()
                        .any(|e| e.job_id == k.job_id && e.rank == k.rank)
            })
            .collect();
        table.waiting = waiting;
        for action in &actions {
            match action {
                Action::Stop(key) => {
                    if let Some(entry) = table.entries.get_mut(key) {
                        tracing::info!(attempt = %key, "stopping: no longer desired");
                        entry.control.get_or_insert(StopAction::Stop);
                        entry.stopping = true;
                        entry.stop.cancel();
                    }
                }
                Action::Start(d) => self.start_locked(&mut table, d),
            }
        }
        for d in desired.iter().filter(|d| !d.stop_action.is_empty()) {
            self.ask_to_stop_locked(&mut table, d);
        }
        let reported: HashSet<String> = table
            .entries
            .iter()
            .filter(|(_, e)| e.progress.is_some() && !e.stopping)
            .map(|(k, _)| k.job_id.clone())
            .collect();
        drop(table);
        self.maintain_spares(desired, &reported);
        actions
    }

    /// The time between SIGTERM and SIGKILL for `desired`: the job's own stop grace when
    /// it set one (room for a last checkpoint), else the agent's.
    fn stop_grace(&self, desired: &DesiredRank) -> Duration {
        if desired.stop_grace_ms > 0 {
            Duration::from_millis(desired.stop_grace_ms.min(3_600_000))
        } else {
            self.inner.settings.stop_grace
        }
    }

    /// The leader asks a live attempt to stop (`desired.stop_action`): the rank is told
    /// at once (its control action), and its group gets SIGTERM after the notice — a
    /// time limit's `stop_notice_ms` (the limit itself), otherwise the stop grace — and
    /// SIGKILL a stop grace later (docs/architecture.md, "Stopping a rank"). Asked once
    /// per attempt; an unknown action is taken for a plain stop.
    fn ask_to_stop_locked(&self, table: &mut Table, desired: &DesiredRank) {
        let key = AttemptKey::of(desired);
        let Some(entry) = table.entries.get_mut(&key) else {
            return;
        };
        if entry.control.is_some() || entry.stopping {
            return;
        }
        let action = desired
            .stop_action
            .parse::<StopAction>()
            .unwrap_or(StopAction::Stop);
        let notice = if action == StopAction::TimeLimit {
            Duration::from_millis(desired.stop_notice_ms.min(MAX_STOP_NOTICE_MS))
        } else {
            self.stop_grace(desired)
        };
        tracing::info!(attempt = %key, %action, notice_ms = notice.as_millis() as u64, "asking the rank to stop");
        entry.control = Some(action);
        let stop = entry.stop.clone();
        let this = self.clone();
        self.inner.tracker.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(notice) => {}
                _ = stop.cancelled() => return,
            }
            if let Some(entry) = this.table().entries.get_mut(&key) {
                tracing::info!(attempt = %key, %action, "still running after the stop notice: SIGTERM");
                entry.stopping = true;
                entry.stop.cancel();
            }
        });
    }

    /// What the rank holding `token` has been asked: `None` for an unknown token,
    /// `Some(None)` when it may go on.
    pub fn control(&self, token: &str) -> Option<Option<StopAction>> {
        let table = self.table();
        let key = table.tokens.get(token)?;
        Some(table.entries.get(key)?.control)
    }

    /// The attempt the process started for `origin` runs now: `origin` itself unless an
    /// in-process restart handed it a newer one ([`inprocess`]).
    fn current_key(&self, origin: &AttemptKey) -> AttemptKey {
        let table = self.table();
        if table.entries.contains_key(origin) {
            return origin.clone();
        }
        table
            .entries
            .iter()
            .find(|(_, e)| &e.origin == origin)
            .map_or_else(|| origin.clone(), |(k, _)| k.clone())
    }

    fn exit_recorded(&self, key: &AttemptKey) -> bool {
        AttemptPaths::new(&self.inner.settings.data_dir, key)
            .map(|p| p.exit.exists())
            .unwrap_or(false)
    }

    fn start_locked(&self, table: &mut Table, desired: &DesiredRank) {
        let key = AttemptKey::of(desired);
        if table.entries.len() >= MAX_LIVE_ATTEMPTS {
            tracing::error!(attempt = %key, "refusing to start: {MAX_LIVE_ATTEMPTS} attempts already live");
            table.finished.insert(key.clone());
            self.inner.events.push(RankEvent::Exited(RankExitedRequest {
                worker_id: self.inner.settings.worker_id.clone(),
                job_id: key.job_id.clone(),
                rank: key.rank,
                attempt: key.attempt,
                exit_code: None,
                signal: None,
                spawn_error: format!("the agent already runs {MAX_LIVE_ATTEMPTS} rank attempts"),
                agent_fault: true,
                agent_evidence: String::new(),
                exec_failed: false,
                cause: String::new(),
                step: 0,
                total_steps: 0,
                artifacts: None,
            }));
            return;
        }
        let token = random_token();
        let stop = CancellationToken::new();
        table.tokens.insert(token.clone(), key.clone());
        table.entries.insert(
            key.clone(),
            Entry {
                pid: None,
                stopping: false,
                stop: stop.clone(),
                control: None,
                progress: None,
                ckpt_enabled: !desired.ckpt_dir.is_empty() || !desired.ckpt_url.is_empty(),
                ckpt: None,
                commit_lock: Arc::new(tokio::sync::Mutex::new(None)),
                shard_pins: Vec::new(),
                exception: None,
                origin: key.clone(),
                token: token.clone(),
                restart: inprocess::RestartState::default(),
                log_switch: None,
            },
        );
        tracing::info!(attempt = %key, "starting rank attempt");
        let this = self.clone();
        let desired = Arc::new(desired.clone());
        self.inner
            .tracker
            .spawn(async move { this.run_attempt(key, desired, token, stop).await });
    }

    /// Every live process (stopping ones included), with its latest progress, and every
    /// attempt still being prepared or waiting for an older attempt of its rank to exit
    /// (pid 0), sorted by attempt: the observed set of a heartbeat.
    pub fn observed(&self) -> Vec<ObservedRank> {
        let table = self.table();
        let mut out: Vec<(&AttemptKey, ObservedRank)> = table
            .entries
            .iter()
            .filter_map(|(key, e)| {
                // An attempt still being prepared (no process yet) is reported with pid 0,
                // so that the leader does not take it for lost; one being stopped is not.
                let pid = match e.pid {
                    Some(pid) => pid,
                    None if !e.stopping => 0,
                    None => return None,
                };
                let reported = e.progress.is_some();
                let progress = e.progress.clone().unwrap_or_default();
                Some((
                    key,
                    ObservedRank {
                        job_id: key.job_id.clone(),
                        rank: key.rank,
                        attempt: key.attempt,
                        pid,
                        step: progress.step,
                        total_steps: progress.total_steps,
                        metrics: progress.metrics.into_iter().collect(),
                        reported,
                        in_process: e.restart.listening && !inprocess::process_stopped(pid),
                    },
                ))
            })
            .collect();
        out.extend(
            table
                .waiting
                .iter()
                .filter(|k| !table.entries.contains_key(*k))
                .map(|key| {
                    (
                        key,
                        ObservedRank {
                            job_id: key.job_id.clone(),
                            rank: key.rank,
                            attempt: key.attempt,
                            pid: 0,
                            step: 0,
                            total_steps: 0,
                            metrics: Default::default(),
                            reported: false,
                            in_process: false,
                        },
                    )
                }),
        );
        out.sort_by(|a, b| a.0.cmp(b.0));
        out.into_iter().map(|(_, o)| o).collect()
    }

    /// Attempts in the table (starting, running or stopping).
    pub fn live_count(&self) -> usize {
        self.table().entries.len()
    }

    /// Whether `key` is known to have finished on this agent (memory or exit file).
    pub fn is_finished(&self, key: &AttemptKey) -> bool {
        let in_memory = self.table().finished.set.contains(key);
        in_memory || self.exit_recorded(key)
    }

    /// Stops every live attempt (SIGTERM to its group, SIGKILL after the grace time).
    pub fn stop_all(&self) {
        self.stop_spares();
        let mut table = self.table();
        for (key, entry) in table.entries.iter_mut() {
            if !entry.stopping {
                tracing::info!(attempt = %key, "stopping");
                entry.control.get_or_insert(StopAction::Stop);
                entry.stopping = true;
                entry.stop.cancel();
            }
        }
    }

    /// Stops every attempt, refuses new ones, and waits until every attempt has exited,
    /// written its exit record and queued its exit report.
    pub async fn shutdown(&self) {
        self.table().closed = true;
        self.stop_all();
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
    }

    /// The attempt a rank-local token belongs to.
    pub fn attempt_for_token(&self, token: &str) -> Option<AttemptKey> {
        self.table().tokens.get(token).cloned()
    }

    /// The process id of a live attempt's rank (its process group and session id), once
    /// it has started.
    pub fn attempt_pid(&self, key: &AttemptKey) -> Option<u32> {
        self.table().entries.get(key).and_then(|e| e.pid)
    }

    /// Stores the progress a rank reported; `None` when the token is unknown, else what
    /// the rank has been asked ([`Supervisor::control`]).
    pub fn record_progress(&self, token: &str, progress: Progress) -> Option<Option<StopAction>> {
        let mut table = self.table();
        let key = table.tokens.get(token)?.clone();
        let entry = table.entries.get_mut(&key)?;
        entry.progress = Some(progress);
        Some(entry.control)
    }

    /// Keeps the uncaught exception the rank holding `token` reported (its runtime's
    /// exception hook, just before the process dies), replacing any earlier one: a
    /// non-zero exit of the attempt then reports it as its cause. `None` when the token
    /// is unknown.
    pub fn record_exception(
        &self,
        token: &str,
        report: &cumulus_api::rank_local::ExceptionReport,
    ) -> Option<()> {
        let mut table = self.table();
        let key = table.tokens.get(token)?.clone();
        let entry = table.entries.get_mut(&key)?;
        let summary = report.summary();
        tracing::info!(attempt = %key, exception = %summary, "the rank reported an uncaught exception");
        entry.exception = Some(summary);
        Some(())
    }

    /// The latest progress of a live attempt.
    pub fn progress(&self, key: &AttemptKey) -> Option<Progress> {
        self.table().entries.get(key)?.progress.clone()
    }

    /// Finalizes the attempts a previous agent on this data dir left behind (their pid
    /// records): kills what is left of their process groups, writes their exit records
    /// (SIGKILL, or a spawn error when they never got a pid), queues their exit reports and
    /// remembers them as finished so they are never started again.
    pub async fn recover_orphans(&self) {
        let data_dir = self.inner.settings.data_dir.clone();
        let records = match orphans::scan(&data_dir).await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("cannot read pid records in {}: {e}", data_dir.display());
                return;
            }
        };
        for (path, record) in records {
            let record = match record {
                Ok(r) => r,
                Err(why) => {
                    tracing::warn!("removing invalid pid record {}: {why}", path.display());
                    let _ = tokio::fs::remove_file(&path).await;
                    continue;
                }
            };
            self.recover_one(&record).await;
            if let Err(e) = tokio::fs::remove_file(&path).await {
                tracing::warn!("cannot remove pid record {}: {e}", path.display());
            }
        }
    }

    async fn recover_one(&self, record: &PidRecord) {
        let key = record.key();
        if let Some(pid) = record.pid {
            let now = orphans::process_start_ticks(pid);
            let ours = match (now, record.start_ticks) {
                // Same process: kill its group.
                (Some(t), Some(recorded)) => t == recorded,
                // Alive but unverifiable: leave it alone rather than risk a stranger.
                (Some(_), None) => false,
                // The leader is gone; a group id is never reused while members remain,
                // so members still in it are the rank's.
                (None, _) => true,
            };
            if ours {
                if let Err(e) = signal_group(pid, Signal::SIGKILL) {
                    tracing::warn!(attempt = %key, pid, "cannot kill orphaned group: {e}");
                } else {
                    tracing::warn!(attempt = %key, pid, "killed what was left of an orphaned rank attempt");
                }
            }
        }
        let Ok(paths) = AttemptPaths::new(&self.inner.settings.data_dir, &key) else {
            return;
        };
        let record_on_disk = match logs::read_exit_record(&paths.exit).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(attempt = %key, "replacing unreadable exit record: {e}");
                None
            }
        };
        let exit = match record_on_disk {
            Some(r) => r,
            None => {
                let exit = if record.pid.is_some() {
                    ExitRecord {
                        exit_code: None,
                        signal: Some(Signal::SIGKILL as i32),
                        spawn_error: None,
                        agent_fault: false,
                        agent_evidence: None,
                        exec_failed: false,
                        cause: None,
                    }
                } else {
                    ExitRecord::spawn_failed("the agent stopped before the process started")
                };
                let marker = "[cumulus: the agent restarted; this attempt was lost]\n";
                if let Err(e) = append_line(&paths.log, marker).await {
                    tracing::warn!(attempt = %key, "cannot append to log: {e}");
                }
                if let Err(e) = logs::write_exit_record(&paths.exit, &exit).await {
                    tracing::error!(attempt = %key, "cannot write exit record: {e}");
                }
                exit
            }
        };
        let _ = tokio::fs::remove_file(shards_file(&self.inner.settings.data_dir, &key)).await;
        let _ = tokio::fs::remove_file(data_plan_file(&self.inner.settings.data_dir, &key)).await;
        self.remove_attempt_dir(&key).await;
        self.table().finished.insert(key.clone());
        // An attempt lost across an agent restart: its progress was in the old agent's
        // memory (and its output dir is not trusted: no artifacts).
        self.push_exit(&key, &exit, Progress::default(), None);
    }

    /// Queues the exit report of `key`, with `last`, the progress it reported last, and
    /// the artifacts it left, uploaded.
    fn push_exit(
        &self,
        key: &AttemptKey,
        exit: &ExitRecord,
        last: Progress,
        artifacts: Option<cumulus_api::BlobRef>,
    ) {
        self.inner.events.push(RankEvent::Exited(RankExitedRequest {
            step: last.step,
            total_steps: last.total_steps,
            worker_id: self.inner.settings.worker_id.clone(),
            job_id: key.job_id.clone(),
            rank: key.rank,
            attempt: key.attempt,
            exit_code: exit.exit_code,
            signal: exit.signal,
            spawn_error: exit.spawn_error.clone().unwrap_or_default(),
            agent_fault: exit.agent_fault,
            agent_evidence: exit.agent_evidence.clone().unwrap_or_default(),
            exec_failed: exit.exec_failed,
            cause: exit.cause.clone().unwrap_or_default(),
            artifacts,
        }));
    }

    /// The whole life of one attempt, from preparation to the queued exit report.
    async fn run_attempt(
        self,
        key: AttemptKey,
        desired: Arc<DesiredRank>,
        token: String,
        stop: CancellationToken,
    ) {
        let data_dir = self.inner.settings.data_dir.clone();
        let paths = AttemptPaths::new(&data_dir, &key);
        let exit = match &paths {
            Ok(paths) => self.run_process(&key, &desired, &token, &stop, paths).await,
            Err(e) => ExitRecord::spawn_failed(format!("invalid desired rank: {e}")),
        };
        // `origin` is the attempt the process was started for (its directories, shards
        // file); `key` the one it runs now (an in-process restart may have handed it a
        // newer one): the exit is that attempt's.
        let origin = key;
        let key = self.current_key(&origin);
        let mut artifacts = None;
        if let Ok(paths) = &paths {
            let current = AttemptPaths::new(&data_dir, &key).unwrap_or_else(|_| paths.clone());
            // The process has ended: what it left is uploaded before its exit is
            // recorded and reported.
            artifacts = self.collect_artifacts(&origin, &current.log).await;
            self.remove_attempt_dir(&origin).await;
            if let Err(e) = logs::write_exit_record(&current.exit, &exit).await {
                tracing::error!(attempt = %key, "cannot write exit record: {e}");
            }
            for k in [&origin, &key] {
                if let Err(e) = orphans::remove(&data_dir, k).await {
                    tracing::warn!(attempt = %k, "cannot remove pid record: {e}");
                }
            }
            let _ = tokio::fs::remove_file(shards_file(&data_dir, &origin)).await;
            let _ = tokio::fs::remove_file(data_plan_file(&data_dir, &origin)).await;
        }
        let (ckpt, last) = {
            let mut table = self.table();
            let entry = table.entries.remove(&key);
            table.tokens.remove(&token);
            if let Some(e) = &entry {
                table.tokens.remove(&e.token);
                for t in &e.restart.retired_tokens {
                    table.retired.remove(t);
                }
            }
            table.finished.insert(key.clone());
            entry.map_or((None, None), |e| (e.ckpt, e.progress))
        };
        self.inner.restart_notify.notify_waiters();
        // The attempt never runs again: whatever it left uncommitted in staging is garbage.
        if let Some(ckpt) = ckpt {
            match tokio::fs::remove_dir_all(&ckpt.staging).await {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(
                    attempt = %key,
                    "cannot remove staging {}: {e}",
                    ckpt.staging.display()
                ),
            }
        }
        tracing::info!(
            attempt = %key,
            exit_code = ?exit.exit_code,
            signal = ?exit.signal,
            spawn_error = exit.spawn_error.as_deref().unwrap_or(""),
            "rank attempt finished"
        );
        self.push_exit(&key, &exit, last.unwrap_or_default(), artifacts);
    }

    /// The cause of an attempt's exit: for a non-zero exit code, or a signal the agent
    /// did not send (`stop` not cancelled), the exception the rank reported, else the
    /// last line of its output ([`logs::OutputTail::cause`]); `None` for a clean exit, a
    /// stop the agent asked for, or nothing to tell.
    fn exit_cause(
        &self,
        key: &AttemptKey,
        exit: &ExitRecord,
        stop: &CancellationToken,
        tail: &logs::OutputTail,
    ) -> Option<String> {
        let failed = match (exit.exit_code, exit.signal) {
            (Some(code), _) => code != 0,
            (None, Some(_)) => !stop.is_cancelled(),
            (None, None) => false,
        };
        if !failed {
            return None;
        }
        let reported = self
            .table()
            .entries
            .get(key)
            .and_then(|e| e.exception.clone());
        reported.or_else(|| tail.cause())
    }

    async fn run_process(
        &self,
        key: &AttemptKey,
        desired: &DesiredRank,
        token: &str,
        stop: &CancellationToken,
        paths: &AttemptPaths,
    ) -> ExitRecord {
        let settings = &self.inner.settings;
        let mut log = match LogWriter::create(&paths.log, settings.log_max_bytes).await {
            Ok(log) => log,
            Err(e) => {
                return ExitRecord::start_failed(
                    format!("cannot create log {}: {e}", paths.log.display()),
                    &e,
                );
            }
        };
        let mut pid_record = PidRecord {
            job_id: key.job_id.clone(),
            rank: key.rank,
            attempt: key.attempt,
            pid: None,
            start_ticks: None,
        };
        if let Err(e) = orphans::write(&settings.data_dir, &pid_record).await {
            let exit = ExitRecord::start_failed(format!("cannot write pid record: {e}"), &e);
            return fail_start(log, exit).await;
        }
        let env = tokio::select! {
            r = self.setup_environment(key, desired, &mut log) => r,
            _ = stop.cancelled() => Err(ExitRecord::spawn_failed(
                "stopped by the agent before the process started",
            )),
        };
        let env = match env {
            Ok(env) => env,
            Err(exit) => return fail_start(log, exit).await,
        };
        let request = tokio::select! {
            r = self.prepare(key, desired, token) => r,
            _ = stop.cancelled() => Err(PrepareError::Ended(key.clone())),
        };
        let request = match request {
            Ok(r) if !stop.is_cancelled() => r,
            Ok(_) => {
                return fail_start(
                    log,
                    ExitRecord::spawn_failed("stopped by the agent before the process started"),
                )
                .await;
            }
            Err(PrepareError::Ended(_)) => {
                return fail_start(
                    log,
                    ExitRecord::spawn_failed("stopped by the agent before the process started"),
                )
                .await;
            }
            Err(e) => return fail_start(log, ExitRecord::spawn_failed(e.to_string())).await,
        };
        let mut request = request;
        if let Some(env) = &env {
            environment::activate(&mut request, env.dir());
        }
        // What the rank API turned away before this attempt is not its evidence.
        let rank_api_before = settings.rank_api_watch.reading();
        let template = spares::Template::of(&request, desired);
        let warm = match &template {
            Some(t) => self.take_spare(&key.job_id, t, &request).await,
            None => None,
        };
        let started = match warm {
            Some((spawned, age)) => {
                tracing::info!(attempt = %key, pid = spawned.pid, age_ms = age.as_millis() as u64, "a warm spare takes the attempt");
                let line = format!(
                    "{}warm spare pid {} (started {:.1} s before, imports done: {}) runs this attempt\n",
                    crate::envs::SETUP_PREFIX,
                    spawned.pid,
                    age.as_secs_f64(),
                    if desired.warm_imports.is_empty() {
                        "none".to_string()
                    } else {
                        desired.warm_imports.join(",")
                    }
                );
                if let Err(e) = log.append(line.as_bytes()).await.and(log.flush().await) {
                    tracing::warn!(attempt = %key, "cannot write to log: {e}");
                }
                Ok(spawned)
            }
            None => self.inner.spawner.spawn(request).await,
        };
        if let Some(template) = template
            && started.is_ok()
        {
            self.want_spares(desired, template);
        }
        let spawned = match started {
            Ok(s) => s,
            Err(e) => {
                let exit = match &e {
                    SpawnError::Io { source, .. } => ExitRecord {
                        exec_failed: crate::logs::is_exec_error(source),
                        ..ExitRecord::start_failed(e.to_string(), source)
                    },
                    SpawnError::Stopped => ExitRecord::spawn_failed(e.to_string()),
                };
                return fail_start(log, exit).await;
            }
        };
        let pid = spawned.pid;
        let (log_switch, mut log_switches) = mpsc::channel::<inprocess::LogSwitch>(1);
        if let Some(entry) = self.table().entries.get_mut(key) {
            entry.pid = Some(pid);
            entry.log_switch = Some(log_switch);
        }
        pid_record.pid = Some(pid);
        pid_record.start_ticks = orphans::process_start_ticks(pid);
        if let Err(e) = orphans::write(&settings.data_dir, &pid_record).await {
            tracing::warn!(attempt = %key, "cannot update pid record: {e}");
        }
        tracing::info!(attempt = %key, pid, "rank attempt running");
        self.inner
            .events
            .push(RankEvent::Started(RankStartedRequest {
                worker_id: settings.worker_id.clone(),
                job_id: key.job_id.clone(),
                rank: key.rank,
                attempt: key.attempt,
                pid,
            }));
        let grace = self.stop_grace(desired);
        let mut tail = logs::OutputTail::default();
        let status = supervise(
            key,
            spawned,
            stop,
            grace,
            (&mut log, &mut log_switches),
            &mut tail,
        )
        .await;
        if let Err(e) = log.finish().await {
            tracing::warn!(attempt = %key, "cannot finish log: {e}");
        }
        let current = self.current_key(key);
        match status {
            Ok(status) => {
                let seen = settings.rank_api_watch.since(&rank_api_before);
                let mut exit = reach::judge(ExitRecord::from_status(status), &seen);
                exit.cause = self.exit_cause(&current, &exit, stop, &tail);
                log_unreachable(key, &exit);
                exit
            }
            Err(e) => ExitRecord::spawn_failed(format!("cannot wait for process {pid}: {e}")),
        }
    }
}

/// Logs whose fault an exit with [`cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE`] is:
/// the agent's, with its evidence, or the rank's own; nothing for any other exit.
fn log_unreachable(key: &AttemptKey, exit: &ExitRecord) {
    if exit.exit_code != Some(cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE) {
        return;
    }
    match &exit.agent_evidence {
        Some(why) => tracing::warn!(
            attempt = %key,
            "the rank could not reach this agent, the agent's fault: {why}"
        ),
        None => tracing::info!(
            attempt = %key,
            "the rank says it could not reach this agent, but the rank API turned nothing \
             away during the attempt: the rank's own failure"
        ),
    }
}

/// Waits for the process while copying its output to the log (its last lines to `tail`)
/// and applying a stop request (SIGTERM to the group, SIGKILL after `grace`). A log
/// coming through `switches` (an in-process restart) replaces `log` from then on: the
/// old one gets the switch's marker line and is finished before the switch is
/// acknowledged. After the process exited, whatever is left of its group is killed and
/// the output pipe is drained for at most [`DRAIN_TIMEOUT`].
async fn supervise(
    key: &AttemptKey,
    spawned: SpawnedChild,
    stop: &CancellationToken,
    grace: Duration,
    (log, switches): (&mut LogWriter, &mut mpsc::Receiver<inprocess::LogSwitch>),
    tail: &mut logs::OutputTail,
) -> io::Result<ExitStatus> {
    let SpawnedChild {
        mut child,
        pid,
        output,
        ..
    } = spawned;
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(LOG_CHANNEL_CAPACITY);
    // The pump stops when `stop_pump` is dropped: on the drain timeout, or when this
    // function returns or its future is dropped.
    let started = logs::cancel_pipe().and_then(|(cancel_pump, stop_pump)| {
        logs::spawn_pump(
            format!("log-{}", key.rank),
            OwnedFd::from(output),
            tx.clone(),
            cancel_pump,
        )?;
        Ok(stop_pump)
    });
    let mut stop_pump = match started {
        Ok(stop_pump) => Some(stop_pump),
        Err(error) => {
            // Without its pump the rank would block on a full pipe: end it now, and report
            // why (the attempt fails and is restarted under the job's policy).
            let _ = signal_group(pid, Signal::SIGKILL);
            let _ = child.wait().await;
            return Err(io::Error::other(format!(
                "cannot start capturing the rank's output: {error}"
            )));
        }
    };
    drop(tx);

    let far = Instant::now() + Duration::from_secs(86400 * 365);
    let mut status: Option<io::Result<ExitStatus>> = None;
    let mut pipes_open = true;
    let mut term_sent = false;
    let mut kill_at: Option<Instant> = None;
    let mut drain_until: Option<Instant> = None;
    let mut log_ok = true;
    loop {
        if status.is_some() && !pipes_open {
            break;
        }
        tokio::select! {
            chunk = rx.recv(), if pipes_open => match chunk {
                Some(first) => {
                    let mut batch = vec![first];
                    while batch.len() < LOG_BATCH_CHUNKS {
                        match rx.try_recv() {
                            Ok(c) => batch.push(c),
                            Err(_) => break,
                        }
                    }
                    for c in &batch {
                        tail.push(c);
                    }
                    if log_ok {
                        let mut result = Ok(());
                        for c in &batch {
                            result = log.append(c).await;
                            if result.is_err() {
                                break;
                            }
                        }
                        if let Err(e) = result.and(log.flush().await) {
                            tracing::error!(attempt = %key, "cannot write log, dropping further output: {e}");
                            log_ok = false;
                        }
                    }
                }
                None => pipes_open = false,
            },
            Some((new_log, marker, done)) = switches.recv() => {
                let mut old = std::mem::replace(log, new_log);
                if log_ok {
                    let _ = old.append(marker.as_bytes()).await;
                }
                if let Err(e) = old.finish().await {
                    tracing::warn!(attempt = %key, "cannot finish log: {e}");
                }
                log_ok = true;
                let _ = done.send(());
            }
            s = child.wait(), if status.is_none() => {
                status = Some(s);
                // Helpers the rank left in its group end with it. (The group id stays
                // reserved while any member lives; once none does, killpg finds no group
                // unless the pid was reused within these microseconds by a new group
                // leader, which needs a full wrap of the pid space.)
                let _ = signal_group(pid, Signal::SIGKILL);
                drain_until = Some(Instant::now() + DRAIN_TIMEOUT);
            }
            _ = stop.cancelled(), if status.is_none() && !term_sent => {
                term_sent = true;
                if let Err(e) = signal_group(pid, Signal::SIGTERM) {
                    tracing::warn!(attempt = %key, pid, "SIGTERM failed: {e}");
                }
                kill_at = Some(Instant::now() + grace);
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or(far)), if status.is_none() && kill_at.is_some() => {
                tracing::warn!(attempt = %key, pid, "still running {} ms after SIGTERM: SIGKILL", grace.as_millis());
                kill_at = None;
                if let Err(e) = signal_group(pid, Signal::SIGKILL) {
                    tracing::warn!(attempt = %key, pid, "SIGKILL failed: {e}");
                }
            }
            _ = tokio::time::sleep_until(drain_until.unwrap_or(far)), if drain_until.is_some() => {
                tracing::warn!(attempt = %key, "output pipe still open {} s after exit: capture stopped", DRAIN_TIMEOUT.as_secs());
                drop(stop_pump.take());
                if log_ok {
                    let marker = format!(
                        "[cumulus: output still open {} s after the process exited; capture stopped]\n",
                        DRAIN_TIMEOUT.as_secs()
                    );
                    let _ = log.append(marker.as_bytes()).await;
                }
                break;
            }
        }
    }
    status.expect("the loop only ends once the process was waited for")
}

mod commit;
mod environment;
mod inprocess;
#[cfg(test)]
mod inprocess_tests;
mod prepare;
pub mod reach;
pub mod spares;
#[cfg(test)]
mod tests;
mod workdir;

pub use inprocess::{RestartAck, RestartPoll};
use prepare::*;
pub use reach::RankApiWatch;
