//! Python environments of jobs (`JobSpec.environment`), built on this worker with uv,
//! cached and shared between attempts and jobs.
//!
//! An environment is a virtual environment made by `uv venv --relocatable` on an
//! interpreter of this worker and filled by `uv pip install -r requirements` with the
//! job's index options. It is named by its key ([`spec::env_key`]): BLAKE3 over the
//! requirements, the index options, whether only wheels are installed, and the platform
//! (OS, architecture, and the resolved interpreter: implementation, version, machine,
//! real path). Layout under the agent's data dir:
//! ```text
//! envs/<key>/                         a ready environment ([`READY_MARKER`] inside)
//! envs/.build-<key12>-<rand>/         a build: requirements.txt and venv/, renamed to
//!                                     envs/<key> once complete, removed otherwise
//! envs/.trash-<rand>/                 an evicted environment, being removed
//! uv-cache/                           uv's cache (UV_CACHE_DIR)
//! ```
//!
//! **Once per worker.** [`Environments::setup`] builds an environment at most once at a
//! time (a single flight per key): an attempt asking for one being built waits for that
//! build and sees its output from then on. The build itself runs in a task of its own, so
//! an attempt stopped while it waits stops nothing. A failed build is not remembered: the
//! next attempt asking builds again.
//!
//! **Output.** Every line uv prints goes to the attempts waiting for the build, which
//! write it to their logs after [`SETUP_PREFIX`] (the `setup` stream of `cumulusctl
//! logs`); the last [`build::ERROR_TAIL_LINES`] lines (at most
//! [`build::ERROR_TAIL_BYTES`]) make the error of a failed build.
//!
//! **Bounded.** A build runs at most `--env-build-timeout-ms` (then its process group is
//! killed). Environments in use (an [`EnvLease`] alive: an attempt running in it, or
//! waiting to) are never removed; past `--env-cache-bytes` of environments and uv's cache
//! together (allocated blocks; a file uv hardlinks into an environment counts there, and
//! may count once per environment), or past [`MAX_ENVS`] environments, the least recently
//! used unused environments are removed, then uv's cache when no build runs. This is
//! checked when a build ends, when a lease ends and at start.
//!
//! **Hostile input.** The spec is checked first ([`spec::validate`]): package
//! requirements only (no options, no local paths), URLs or absolute normalized paths as
//! index locations, a version `3.X[.Y]`. Neither uv nor the interpreter ever downloads an
//! interpreter (`UV_PYTHON_DOWNLOADS=never`), uv reads no configuration file
//! (`--no-config`), and both see only [`run::PASSED_VARS`] of the agent's environment.
//! When ranks run as other users (`--run-as`), uv (which runs as the agent) installs
//! wheels only (`--only-binary :all:`, so no package's build code runs as the agent), the
//! interpreter must be runnable by every user, and a built environment is opened to them
//! (directories `0755`, files `0644`/`0755`) before it is put in place; `envs/` is then
//! `0711`.

mod build;
mod run;
pub mod spec;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use cumulus_api::EnvironmentSpec;
use tokio::sync::{broadcast, watch};

pub use build::Marker;
pub use spec::Interpreter;

use crate::spawn::Spawner;

/// Directory of the environments under the data dir.
pub const ENVS_DIR: &str = "envs";
/// uv's cache under the data dir.
pub const UV_CACHE_DIR: &str = "uv-cache";
/// The file that makes an environment directory a ready environment (written last).
pub const READY_MARKER: &str = ".cumulus-env.json";
/// Name prefix of a build's directory in `envs/`.
pub const BUILD_PREFIX: &str = ".build-";
/// Name prefix of an evicted environment's directory in `envs/`, being removed.
pub const TRASH_PREFIX: &str = ".trash-";
/// What starts each line an attempt's log gets from its environment's setup: the
/// `setup` stream of `cumulusctl logs` (a rank's own output is never prefixed by the
/// agent).
pub const SETUP_PREFIX: &str = "[setup] ";
/// Default of `--env-cache-bytes`: 20 GiB.
pub const DEFAULT_CACHE_BYTES: u64 = 20 * 1024 * 1024 * 1024;
/// Default of `--env-build-timeout-ms`: 30 minutes.
pub const DEFAULT_BUILD_TIMEOUT_MS: u64 = 30 * 60 * 1000;
/// Lines of a build's output buffered for each attempt waiting on it; one that falls
/// further behind is told how many it missed.
pub const OUTPUT_CHANNEL_LINES: usize = 256;
/// Most environments kept, whatever their size.
pub const MAX_ENVS: usize = 4_096;
/// How long an interpreter found for a version is used without looking again.
pub const INTERPRETER_TTL: Duration = Duration::from_secs(60);
/// Most interpreter lookups remembered (the table is emptied when full).
const MAX_INTERPRETERS_REMEMBERED: usize = 64;

/// Why an environment cannot be had. Its text becomes the attempt's spawn error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EnvError {
    /// The spec itself is refused.
    #[error("invalid environment: {0}")]
    Invalid(String),
    /// This worker lacks what the spec needs (uv, the Python version asked for).
    #[error("{0}")]
    Unavailable(String),
    /// The interpreter cannot be run or answered nonsense.
    #[error("{0}")]
    Probe(String),
    /// uv failed: the step and its last lines.
    #[error("cannot build the Python environment: {0}")]
    Build(String),
    /// The build ran past `--env-build-timeout-ms`.
    #[error("cannot build the Python environment: {0}")]
    Timeout(String),
    /// This agent's own failure (its disk, a process it could not start for lack of a
    /// resource): not the job's.
    #[error("{0}")]
    Agent(String),
}

impl EnvError {
    fn io(path: &Path, what: &str, e: &io::Error) -> Self {
        EnvError::Agent(format!("cannot {what} {}: {e}", path.display()))
    }

    /// The agent's own failure: a restart (which spends no budget) may succeed. Every
    /// other error fails the same way at every restart.
    pub fn is_agent_fault(&self) -> bool {
        matches!(self, EnvError::Agent(_))
    }
}

/// Settings of the environments.
#[derive(Debug, Clone)]
pub struct EnvSettings {
    /// The agent's data dir (`envs/` and `uv-cache/` below it).
    pub data_dir: PathBuf,
    /// The uv binary (`None`: jobs with an environment fail with a clear error).
    pub uv: Option<PathBuf>,
    /// The worker's `python3`: the interpreter of a spec that names no version.
    pub python: Option<PathBuf>,
    /// `--env-cache-bytes`.
    pub max_bytes: u64,
    /// `--env-build-timeout-ms`.
    pub build_timeout: Duration,
    /// Ranks run as other users than the agent (`--run-as`).
    pub ranks_other_user: bool,
}

impl EnvSettings {
    /// `<data-dir>/envs`.
    pub fn envs_dir(&self) -> PathBuf {
        self.data_dir.join(ENVS_DIR)
    }

    /// `<data-dir>/uv-cache`.
    pub fn cache_dir(&self) -> PathBuf {
        self.data_dir.join(UV_CACHE_DIR)
    }
}

/// A ready environment. Held (through [`EnvLease`]s and finished flights) while in use.
#[derive(Debug)]
struct EnvPin {
    key: String,
    dir: PathBuf,
}

struct Record {
    pin: Arc<EnvPin>,
    size_bytes: u64,
    /// Logical time of its last use (larger = more recent).
    last_used: u64,
}

impl Record {
    fn in_use(&self) -> bool {
        Arc::strong_count(&self.pin) > 1
    }
}

type Outcome = Result<Arc<EnvPin>, EnvError>;

/// A build in progress: what a newcomer subscribes to.
struct Flight {
    id: u64,
    lines: broadcast::Sender<String>,
    done: watch::Receiver<Option<Outcome>>,
}

#[derive(Default)]
struct State {
    ready: HashMap<String, Record>,
    flights: HashMap<String, Flight>,
    clock: u64,
    /// Disk use of uv's cache not shared with an environment, as last measured.
    cache_bytes: u64,
}

impl State {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn total_bytes(&self) -> u64 {
        self.ready
            .values()
            .map(|r| r.size_bytes)
            .fold(self.cache_bytes, u64::saturating_add)
    }
}

/// The environments of this worker. Cheap to share (`Arc`).
pub struct Environments {
    settings: EnvSettings,
    spawner: Spawner,
    state: Mutex<State>,
    interpreters: Mutex<HashMap<String, (Interpreter, std::time::Instant)>>,
    builds_started: AtomicU64,
    next_flight: AtomicU64,
}

impl std::fmt::Debug for Environments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Environments")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// An environment an attempt uses: not removed while it lives.
#[derive(Debug)]
pub struct EnvLease {
    /// `None` only while dropped.
    pin: Option<Arc<EnvPin>>,
    envs: Weak<Environments>,
}

impl EnvLease {
    fn pin(&self) -> &EnvPin {
        self.pin
            .as_ref()
            .expect("a lease holds its pin until dropped")
    }

    /// The environment's directory (`VIRTUAL_ENV`).
    pub fn dir(&self) -> &Path {
        &self.pin().dir
    }

    /// The environment's key.
    pub fn key(&self) -> &str {
        &self.pin().key
    }
}

impl Drop for EnvLease {
    fn drop(&mut self) {
        let Some(pin) = self.pin.take() else {
            return;
        };
        let key = pin.key.clone();
        // Released before the eviction below looks at who holds it.
        drop(pin);
        let Some(envs) = self.envs.upgrade() else {
            return;
        };
        let over = {
            let mut state = envs.lock();
            let now = state.tick();
            if let Some(r) = state.ready.get_mut(&key) {
                r.last_used = now;
            }
            state.total_bytes() > envs.settings.max_bytes
        };
        if over {
            envs.evict();
        }
    }
}

/// One step of an attempt's environment setup ([`Setup::next`]).
#[derive(Debug)]
pub enum SetupEvent {
    /// A line for the attempt's log (without [`SETUP_PREFIX`]).
    Line(String),
    /// The end: the environment, or why there is none.
    Done(Result<EnvLease, EnvError>),
}

/// An attempt's wait for its environment: lines for its log, then the outcome.
pub struct Setup {
    envs: Arc<Environments>,
    short_key: String,
    pending: VecDeque<String>,
    stage: Stage,
    started: std::time::Instant,
    /// Another attempt's build is awaited.
    joined: bool,
}

enum Stage {
    Finished(Option<Result<EnvLease, EnvError>>),
    Building {
        lines: Option<broadcast::Receiver<String>>,
        done: watch::Receiver<Option<Outcome>>,
    },
}

impl Setup {
    fn finished(
        envs: &Arc<Environments>,
        lines: Vec<String>,
        result: Result<EnvLease, EnvError>,
    ) -> Self {
        Self {
            envs: envs.clone(),
            short_key: String::new(),
            pending: lines.into(),
            stage: Stage::Finished(Some(result)),
            started: std::time::Instant::now(),
            joined: false,
        }
    }

    /// The next line for the log, or the outcome (after which there is nothing more).
    pub async fn next(&mut self) -> SetupEvent {
        loop {
            if let Some(line) = self.pending.pop_front() {
                return SetupEvent::Line(line);
            }
            let done = match &mut self.stage {
                Stage::Finished(result) => {
                    return SetupEvent::Done(result.take().unwrap_or_else(|| {
                        Err(EnvError::Agent(
                            "the environment's setup already ended".into(),
                        ))
                    }));
                }
                Stage::Building { lines, done } => {
                    if let Some(rx) = lines {
                        match rx.recv().await {
                            Ok(line) => return SetupEvent::Line(line),
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                return SetupEvent::Line(format!("({n} lines of output skipped)"));
                            }
                            Err(broadcast::error::RecvError::Closed) => {
                                *lines = None;
                                continue;
                            }
                        }
                    }
                    match done.wait_for(Option::is_some).await {
                        Ok(outcome) => (*outcome).clone().unwrap_or_else(|| {
                            Err(EnvError::Agent("the build ended without an outcome".into()))
                        }),
                        Err(_) => Err(EnvError::Agent(
                            "the environment's build ended unexpectedly".into(),
                        )),
                    }
                }
            };
            let secs = self.started.elapsed().as_secs_f64();
            let whose = if self.joined {
                " (built for another attempt)"
            } else {
                ""
            };
            let line = match &done {
                Ok(_) => format!(
                    "environment {} ready after {secs:.1} s{whose}",
                    self.short_key
                ),
                Err(_) => format!(
                    "environment {} failed after {secs:.1} s{whose}",
                    self.short_key
                ),
            };
            self.pending.push_back(line);
            let result = done.map(|pin| self.envs.lease(pin));
            self.stage = Stage::Finished(Some(result));
        }
    }
}

/// Removes the flight `id` of `key` when dropped, if it is still there (a build task
/// that panicked leaves no flight behind for newcomers to wait on forever).
struct FlightGuard<'a> {
    envs: &'a Environments,
    key: &'a str,
    id: u64,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.envs.lock();
        if state.flights.get(self.key).is_some_and(|f| f.id == self.id) {
            state.flights.remove(self.key);
        }
    }
}

impl Environments {
    /// Opens the environments of `settings.data_dir`: creates `envs/` and `uv-cache/`,
    /// removes what interrupted builds and evictions left, forgets (and removes)
    /// environments without a valid ready marker, measures uv's cache, evicts past the
    /// bound.
    ///
    /// Blocks on the file system: call it at start.
    ///
    /// # Errors
    /// The directories cannot be created or read.
    pub fn open(settings: EnvSettings, spawner: Spawner) -> io::Result<Arc<Self>> {
        let (ready, cache_bytes) = scan(&settings)?;
        let clock = ready.len() as u64;
        let this = Arc::new(Self {
            settings,
            spawner,
            state: Mutex::new(State {
                ready,
                flights: HashMap::new(),
                clock,
                cache_bytes,
            }),
            interpreters: Mutex::new(HashMap::new()),
            builds_started: AtomicU64::new(0),
            next_flight: AtomicU64::new(0),
        });
        this.evict();
        Ok(this)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ctx(&self) -> run::Context<'_> {
        run::Context {
            settings: &self.settings,
            spawner: &self.spawner,
        }
    }

    /// The settings.
    pub fn settings(&self) -> &EnvSettings {
        &self.settings
    }

    /// Builds started since the agent started.
    pub fn builds_started(&self) -> u64 {
        self.builds_started.load(Ordering::Relaxed)
    }

    /// Keys of the ready environments, sorted.
    pub fn ready_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.lock().ready.keys().cloned().collect();
        keys.sort();
        keys
    }

    fn lease(self: &Arc<Self>, pin: Arc<EnvPin>) -> EnvLease {
        EnvLease {
            pin: Some(pin),
            envs: Arc::downgrade(self),
        }
    }

    /// Starts getting the environment `spec` asks for: cached, being built (then waited
    /// for), or built now. Drive the returned [`Setup`] to its end.
    pub async fn setup(self: &Arc<Self>, spec: &EnvironmentSpec) -> Setup {
        match self.resolve(spec).await {
            Ok(resolved) => self.join(resolved),
            Err(e) => Setup::finished(self, Vec::new(), Err(e)),
        }
    }

    async fn resolve(&self, spec: &EnvironmentSpec) -> Result<spec::Resolved, EnvError> {
        spec::validate(spec)?;
        let interpreter = self.interpreter(&spec.python).await?;
        let wheels_only = self.settings.ranks_other_user;
        if self.settings.ranks_other_user {
            spec::check_runnable_by_others(&interpreter.path)?;
        }
        Ok(spec::Resolved {
            key: spec::env_key(spec, &interpreter, wheels_only),
            interpreter,
            requirements: spec.requirements.clone(),
            index_url: spec.index_url.clone(),
            find_links: spec.find_links.clone(),
            no_index: spec.no_index,
            wheels_only,
        })
    }

    /// The interpreter for `python` ("" or `3.X[.Y]`), looked up at most once per
    /// [`INTERPRETER_TTL`].
    async fn interpreter(&self, python: &str) -> Result<Interpreter, EnvError> {
        {
            let known = self
                .interpreters
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some((interpreter, at)) = known.get(python)
                && at.elapsed() < INTERPRETER_TTL
            {
                return Ok(interpreter.clone());
            }
        }
        let interpreter = spec::find_interpreter(&self.ctx(), python).await?;
        let mut known = self
            .interpreters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if known.len() >= MAX_INTERPRETERS_REMEMBERED {
            known.clear();
        }
        known.insert(
            python.to_owned(),
            (interpreter.clone(), std::time::Instant::now()),
        );
        Ok(interpreter)
    }

    /// The ready environment, the flight building it, or a new flight.
    fn join(self: &Arc<Self>, r: spec::Resolved) -> Setup {
        let short_key = r.short_key().to_owned();
        let mut state = self.lock();
        let now = state.tick();
        if let Some(record) = state.ready.get_mut(&r.key) {
            record.last_used = now;
            let lease = self.lease(record.pin.clone());
            drop(state);
            touch_marker(lease.dir());
            return Setup::finished(
                self,
                vec![format!(
                    "environment {short_key} (cached): {}",
                    lease.dir().display()
                )],
                Ok(lease),
            );
        }
        let setup = |lines, done, joined, first: String| Setup {
            envs: self.clone(),
            short_key: short_key.clone(),
            pending: VecDeque::from([first]),
            stage: Stage::Building {
                lines: Some(lines),
                done,
            },
            started: std::time::Instant::now(),
            joined,
        };
        if let Some(flight) = state.flights.get(&r.key) {
            tracing::info!(key = %r.key, "waiting for the Python environment another attempt builds");
            return setup(
                flight.lines.subscribe(),
                flight.done.clone(),
                true,
                format!("waiting for environment {short_key}: another attempt is building it"),
            );
        }
        let (lines_tx, lines_rx) = broadcast::channel(OUTPUT_CHANNEL_LINES);
        let (done_tx, done_rx) = watch::channel(None);
        let id = self.next_flight.fetch_add(1, Ordering::Relaxed);
        state.flights.insert(
            r.key.clone(),
            Flight {
                id,
                lines: lines_tx.clone(),
                done: done_rx.clone(),
            },
        );
        drop(state);
        self.builds_started.fetch_add(1, Ordering::Relaxed);
        let first = format!(
            "building environment {short_key} with uv on {} {} ({})",
            r.interpreter.implementation,
            r.interpreter.version,
            r.interpreter.path.display()
        );
        let this = self.clone();
        tokio::spawn(async move { this.fly(r, id, lines_tx, done_tx).await });
        setup(lines_rx, done_rx, false, first)
    }

    /// The build of one flight, then its outcome for everyone waiting.
    async fn fly(
        self: Arc<Self>,
        r: spec::Resolved,
        id: u64,
        lines: broadcast::Sender<String>,
        done: watch::Sender<Option<Outcome>>,
    ) {
        let _guard = FlightGuard {
            envs: &self,
            key: &r.key,
            id,
        };
        tracing::info!(key = %r.key, interpreter = %r.interpreter.path.display(), "building a Python environment");
        let started = std::time::Instant::now();
        let mut out = build::Output::new(&lines);
        let result = build::build(&self.ctx(), &r, &mut out).await;
        drop(out);
        match &result {
            Ok(size_bytes) => tracing::info!(
                key = %r.key,
                size_bytes,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "Python environment built"
            ),
            Err(e) => tracing::warn!(key = %r.key, "Python environment build failed: {e}"),
        }
        {
            let mut state = self.lock();
            state.flights.remove(&r.key);
            let outcome = result.map(|size_bytes| {
                let pin = Arc::new(EnvPin {
                    key: r.key.clone(),
                    dir: self.settings.envs_dir().join(&r.key),
                });
                let last_used = state.tick();
                state.ready.insert(
                    r.key.clone(),
                    Record {
                        pin: pin.clone(),
                        size_bytes,
                        last_used,
                    },
                );
                pin
            });
            done.send_replace(Some(outcome));
            // The outcome stays with the waiters' receivers only: an environment nobody
            // holds is unused at once.
            drop(done);
        }
        drop(lines);
        let cache = self.settings.cache_dir();
        match tokio::task::spawn_blocking(move || build::tree_disk_use(&cache, true)).await {
            Ok(Ok(bytes)) => self.lock().cache_bytes = bytes,
            Ok(Err(e)) => tracing::warn!("cannot measure uv's cache: {e}"),
            Err(e) => tracing::warn!("cannot measure uv's cache: {e}"),
        }
        self.evict();
    }

    /// Removes the least recently used unused environments while past the bounds, then
    /// uv's cache if still past and no build runs. The directories are renamed away at
    /// once (under the lock: nothing can lease them after) and removed on the blocking
    /// pool.
    fn evict(&self) {
        let mut trash = Vec::new();
        {
            let mut state = self.lock();
            let max = self.settings.max_bytes;
            let mut doomed = Vec::new();
            while state.total_bytes() > max || state.ready.len() > MAX_ENVS {
                let victim = state
                    .ready
                    .iter()
                    .filter(|(_, r)| !r.in_use())
                    .min_by_key(|(_, r)| r.last_used)
                    .map(|(k, _)| k.clone());
                let Some(key) = victim else { break };
                if let Some(record) = state.ready.remove(&key) {
                    tracing::info!(
                        key,
                        size_bytes = record.size_bytes,
                        "evicting an unused Python environment"
                    );
                    doomed.push(record.pin.dir.clone());
                }
            }
            if state.total_bytes() > max && state.flights.is_empty() && state.cache_bytes > 0 {
                tracing::info!(size_bytes = state.cache_bytes, "emptying uv's cache");
                doomed.push(self.settings.cache_dir());
                state.cache_bytes = 0;
            }
            for dir in doomed {
                match self.to_trash(&dir) {
                    Ok(t) => trash.push(t),
                    Err(e) => tracing::warn!(dir = %dir.display(), "cannot remove: {e}"),
                }
            }
        }
        if trash.is_empty() {
            return;
        }
        let remove = move || {
            for dir in trash {
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(dir = %dir.display(), "cannot remove: {e}");
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }

    /// Renames `dir` to a fresh `envs/.trash-<rand>`.
    fn to_trash(&self, dir: &Path) -> io::Result<PathBuf> {
        let trash = self.settings.envs_dir().join(format!(
            "{TRASH_PREFIX}{}",
            hex::encode(rand::random::<[u8; 8]>())
        ));
        std::fs::rename(dir, &trash)?;
        Ok(trash)
    }
}

/// Sets the modification time of an environment's ready marker to now (best effort, on
/// the blocking pool): the order of use an agent restarted on the data dir starts from.
fn touch_marker(dir: &Path) {
    let marker = dir.join(READY_MARKER);
    let touch = move || {
        let file = std::fs::OpenOptions::new().write(true).open(&marker)?;
        file.set_modified(std::time::SystemTime::now())
    };
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        drop(runtime.spawn_blocking(move || {
            if let Err(e) = touch() {
                tracing::debug!("cannot touch an environment's marker: {e}");
            }
        }));
    }
}

/// What [`Environments::open`] finds: the ready environments (in the order of their
/// markers' modification times) and the unshared disk use of uv's cache.
fn scan(settings: &EnvSettings) -> io::Result<(HashMap<String, Record>, u64)> {
    let envs = settings.envs_dir();
    let mode = if settings.ranks_other_user {
        0o711
    } else {
        0o700
    };
    std::fs::create_dir_all(&envs)?;
    std::fs::set_permissions(&envs, std::fs::Permissions::from_mode(mode))?;
    let cache = settings.cache_dir();
    std::fs::create_dir_all(&cache)?;
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700))?;
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&envs)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(BUILD_PREFIX) || name.starts_with(TRASH_PREFIX) {
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(dir = %path.display(), "cannot remove what a build or eviction left: {e}");
            }
            continue;
        }
        if !cumulus_api::blobs::is_valid_digest(&name) || !entry.file_type()?.is_dir() {
            tracing::warn!(path = %path.display(), "not an environment; left alone");
            continue;
        }
        match build::read_marker(&path, &name) {
            Ok(marker) => {
                let used = std::fs::metadata(path.join(READY_MARKER))
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                found.push((used, name, marker.size_bytes, path));
            }
            Err(why) => {
                tracing::warn!(dir = %path.display(), "removing an environment that is not ready: {why}");
                if let Err(e) = std::fs::remove_dir_all(&path) {
                    tracing::warn!(dir = %path.display(), "cannot remove: {e}");
                }
            }
        }
    }
    found.sort();
    let ready = found
        .into_iter()
        .enumerate()
        .map(|(i, (_, key, size_bytes, dir))| {
            let pin = Arc::new(EnvPin {
                key: key.clone(),
                dir,
            });
            let record = Record {
                pin,
                size_bytes,
                last_used: i as u64 + 1,
            };
            (key, record)
        })
        .collect();
    let cache_bytes = build::tree_disk_use(&cache, true)?;
    Ok((ready, cache_bytes))
}

/// Finds uv: `flag` when given (it must be an executable file), else `uv` on `path_var`
/// (the agent's `PATH`), else `uv` beside the `python3` found there (in its directory,
/// then in that of its real path).
///
/// # Errors
/// `flag` names no executable file.
pub fn locate_uv(flag: Option<&Path>, path_var: Option<&OsStr>) -> Result<Option<PathBuf>, String> {
    if let Some(path) = flag {
        return if is_executable(path) {
            Ok(Some(
                std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
            ))
        } else {
            Err(format!("--uv {} is not an executable file", path.display()))
        };
    }
    if let Some(uv) = find_on_path("uv", path_var) {
        return Ok(Some(uv));
    }
    let Some(python) = find_on_path("python3", path_var) else {
        return Ok(None);
    };
    let mut dirs = vec![python.parent().map(Path::to_path_buf)];
    dirs.push(
        std::fs::canonicalize(&python)
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf)),
    );
    Ok(dirs
        .into_iter()
        .flatten()
        .map(|dir| dir.join("uv"))
        .find(|uv| is_executable(uv)))
}

/// The `python3` on `path_var` (the agent's `PATH`).
pub fn locate_python3(path_var: Option<&OsStr>) -> Option<PathBuf> {
    find_on_path("python3", path_var)
}

fn find_on_path(name: &str, path_var: Option<&OsStr>) -> Option<PathBuf> {
    std::env::split_paths(path_var?)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
