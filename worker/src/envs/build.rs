//! One environment built: `uv venv --relocatable`, `uv pip install -r`, opened to the
//! ranks' users when they are others, measured, marked ready, flushed to disk and renamed
//! into place (see the [module layout](super)).

use std::collections::{HashSet, VecDeque};
use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio::time::Instant;

use super::run::{self, Context, Ended};
use super::spec::Resolved;
use super::{BUILD_PREFIX, EnvError, READY_MARKER};

/// Lines of output kept for the error of a failed build.
pub const ERROR_TAIL_LINES: usize = 12;
/// Most bytes of output in the error of a failed build (its end is kept): with what
/// failed, it fits the 1,024 bytes of a job's failure cause.
pub const ERROR_TAIL_BYTES: usize = 700;
/// Largest ready marker read back, in bytes.
pub const MAX_MARKER_BYTES: u64 = 64 * 1024;

/// The ready marker of an environment (`<env>/.cumulus-env.json`), written last: an
/// environment without a valid one is not used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// The environment's key (its directory's name).
    pub key: String,
    /// Disk use of the environment when built, in bytes.
    pub size_bytes: u64,
    /// The interpreter's real path.
    pub interpreter: String,
    /// The interpreter's version, `X.Y.Z`.
    pub python_version: String,
    /// When it was built, ms since the Unix epoch (the agent's clock).
    pub built_at_ms: u64,
}

/// The output of a build: every line to its subscribers, the last ones kept for its
/// error.
pub struct Output<'a> {
    lines: &'a broadcast::Sender<String>,
    tail: VecDeque<String>,
}

impl<'a> Output<'a> {
    /// Output sent on `lines`.
    pub fn new(lines: &'a broadcast::Sender<String>) -> Self {
        Self {
            lines,
            tail: VecDeque::with_capacity(ERROR_TAIL_LINES),
        }
    }

    /// Sends one line (nobody listening is fine) and keeps it for the error.
    pub fn emit(&mut self, line: String) {
        if self.tail.len() == ERROR_TAIL_LINES {
            self.tail.pop_front();
        }
        self.tail.push_back(line.clone());
        let _ = self.lines.send(line);
    }

    /// The last lines, at most [`ERROR_TAIL_BYTES`] (their end).
    fn tail_text(&self) -> String {
        let text = Vec::from(self.tail.clone()).join("\n");
        if text.len() <= ERROR_TAIL_BYTES {
            return text;
        }
        let mut from = text.len() - ERROR_TAIL_BYTES;
        while !text.is_char_boundary(from) {
            from += 1;
        }
        format!("…{}", &text[from..])
    }
}

/// Builds the environment `r` at `<envs>/<key>`; returns its disk use in bytes. The
/// build happens in `<envs>/.build-…`, removed whatever the outcome.
///
/// # Errors
/// [`EnvError::Build`] (uv failed: its last lines), [`EnvError::Timeout`],
/// [`EnvError::Unavailable`] (no uv), [`EnvError::Agent`] (this worker's disk).
pub async fn build(ctx: &Context<'_>, r: &Resolved, out: &mut Output<'_>) -> Result<u64, EnvError> {
    let deadline = Instant::now() + ctx.settings.build_timeout;
    let uv = ctx.uv()?.to_path_buf();
    let envs = ctx.settings.envs_dir();
    let work = envs.join(format!(
        "{BUILD_PREFIX}{}-{}",
        r.short_key(),
        hex::encode(rand::random::<[u8; 8]>())
    ));
    tokio::fs::create_dir(&work)
        .await
        .map_err(|e| EnvError::io(&work, "create", &e))?;
    let result = build_in(ctx, r, &uv, &work, deadline, out).await;
    if let Err(e) = tokio::fs::remove_dir_all(&work).await
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %work.display(), "cannot remove a build directory: {e}");
    }
    result
}

async fn build_in(
    ctx: &Context<'_>,
    r: &Resolved,
    uv: &Path,
    work: &Path,
    deadline: Instant,
    out: &mut Output<'_>,
) -> Result<u64, EnvError> {
    let venv = work.join("venv");
    let requirements = work.join("requirements.txt");
    tokio::fs::write(&requirements, r.requirements.as_bytes())
        .await
        .map_err(|e| EnvError::io(&requirements, "write", &e))?;
    let common = ["--no-config", "--no-progress", "--color", "never"];
    let mut args: Vec<OsString> = vec!["venv".into()];
    args.extend(common.iter().map(OsString::from));
    args.extend(["--relocatable".into(), "--python".into()]);
    args.push(r.interpreter.path.clone().into_os_string());
    args.push(venv.clone().into_os_string());
    step(ctx, "uv venv", uv, args, work, deadline, out).await?;
    if r.has_packages() {
        let mut args: Vec<OsString> = vec!["pip".into(), "install".into()];
        args.extend(common.iter().map(OsString::from));
        args.push("--python".into());
        args.push(venv.join("bin").join("python").into_os_string());
        args.push("-r".into());
        args.push(requirements.into_os_string());
        // Each value was checked to start with `http` or `/`: never taken for a flag.
        if !r.index_url.is_empty() {
            args.extend(["--index-url".into(), r.index_url.clone().into()]);
        }
        for link in &r.find_links {
            args.extend(["--find-links".into(), link.into()]);
        }
        if r.no_index {
            args.push("--no-index".into());
        }
        if r.wheels_only {
            args.extend(["--only-binary".into(), ":all:".into()]);
        }
        step(ctx, "uv pip install", uv, args, work, deadline, out).await?;
    }
    let marker = Marker {
        key: r.key.clone(),
        size_bytes: 0,
        interpreter: r.interpreter.path.to_string_lossy().into_owned(),
        python_version: r.interpreter.version.clone(),
        built_at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    };
    let open_to_others = ctx.settings.ranks_other_user;
    let envs = ctx.settings.envs_dir();
    let done = tokio::task::spawn_blocking(move || {
        put_in_place(&venv, &envs.join(&marker.key), marker, open_to_others)
    })
    .await
    .map_err(|e| EnvError::Agent(format!("the environment's last step failed: {e}")))??;
    Ok(done)
}

/// Runs one uv command; its failure is an error with its last lines.
async fn step(
    ctx: &Context<'_>,
    what: &str,
    uv: &Path,
    args: Vec<OsString>,
    cwd: &Path,
    deadline: Instant,
    out: &mut Output<'_>,
) -> Result<(), EnvError> {
    let ended = run::stream(
        ctx,
        uv.as_os_str(),
        args,
        Some(cwd.to_path_buf()),
        deadline,
        &mut |line| out.emit(line),
    )
    .await?;
    match ended {
        Ended::Exited(Some(0)) => Ok(()),
        Ended::Exited(status) => Err(EnvError::Build(format!(
            "{what} failed ({}):\n{}",
            run::status_text(status),
            out.tail_text()
        ))),
        Ended::TimedOut => Err(EnvError::Timeout(format!(
            "{what} ran past the build time limit of {} s (--env-build-timeout-ms) and was \
             stopped; its last lines:\n{}",
            ctx.settings.build_timeout.as_secs(),
            out.tail_text()
        ))),
    }
}

/// Opens the built tree to other users (when ranks run as others), measures it, writes
/// its marker, flushes the file system and renames it to `dest`; returns its size.
fn put_in_place(
    venv: &Path,
    dest: &Path,
    mut marker: Marker,
    open_to_others: bool,
) -> Result<u64, EnvError> {
    if open_to_others {
        open_tree(venv).map_err(|e| EnvError::io(venv, "open to the ranks' users", &e))?;
    }
    marker.size_bytes = disk_use(venv).map_err(|e| EnvError::io(venv, "measure", &e))?;
    let marker_path = venv.join(READY_MARKER);
    let json = serde_json::to_vec(&marker).map_err(|e| EnvError::Agent(e.to_string()))?;
    std::fs::write(&marker_path, json).map_err(|e| EnvError::io(&marker_path, "write", &e))?;
    if open_to_others {
        std::fs::set_permissions(&marker_path, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| EnvError::io(&marker_path, "open", &e))?;
    }
    // Every file of the tree on disk before the rename makes it an environment.
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let dir = std::fs::File::open(parent).map_err(|e| EnvError::io(parent, "open", &e))?;
    nix::unistd::syncfs(&dir).map_err(|e| EnvError::io(parent, "sync", &io::Error::from(e)))?;
    if dest.exists() {
        // Not ready (no single flight would build it again otherwise): a leftover.
        std::fs::remove_dir_all(dest).map_err(|e| EnvError::io(dest, "remove", &e))?;
    }
    std::fs::rename(venv, dest).map_err(|e| EnvError::io(dest, "rename into", &e))?;
    dir.sync_all()
        .map_err(|e| EnvError::io(parent, "sync", &e))?;
    Ok(marker.size_bytes)
}

/// Directories `0755`, files `0755` when their owner may execute them else `0644`;
/// symbolic links left alone.
fn open_tree(root: &Path) -> io::Result<()> {
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                let mode = entry.metadata()?.mode();
                let want = if mode & 0o100 != 0 { 0o755 } else { 0o644 };
                if mode & 0o7777 != want {
                    std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(want))?;
                }
            }
        }
    }
    Ok(())
}

/// Disk use of a tree in bytes (allocated blocks), each inode once; symbolic links are
/// not followed. `only_unshared` counts only files with one link: those a hardlink
/// elsewhere (uv's cache links installed files into environments) does not also hold.
pub fn tree_disk_use(root: &Path, only_unshared: bool) -> io::Result<u64> {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut stack: Vec<PathBuf> = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let meta = match std::fs::symlink_metadata(entry.path()) {
                Ok(m) => m,
                // Removed while walking (uv's cache changes under a build).
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if meta.is_dir() {
                stack.push(entry.path());
            }
            if only_unshared && meta.is_file() && meta.nlink() > 1 {
                continue;
            }
            if seen.insert((meta.dev(), meta.ino())) {
                total = total.saturating_add(meta.blocks().saturating_mul(512));
            }
        }
    }
    Ok(total)
}

fn disk_use(root: &Path) -> io::Result<u64> {
    tree_disk_use(root, false)
}

/// Reads and checks the ready marker of the environment directory `dir` named `key`.
///
/// # Errors
/// What is wrong with it, in words.
pub fn read_marker(dir: &Path, key: &str) -> Result<Marker, String> {
    use std::io::Read;
    let path = dir.join(READY_MARKER);
    let file = std::fs::File::open(&path).map_err(|e| format!("no ready marker: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_MARKER_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read the ready marker: {e}"))?;
    if bytes.len() as u64 > MAX_MARKER_BYTES {
        return Err(format!("ready marker larger than {MAX_MARKER_BYTES} bytes"));
    }
    let marker: Marker =
        serde_json::from_slice(&bytes).map_err(|e| format!("invalid ready marker: {e}"))?;
    if marker.key != key {
        return Err(format!(
            "the ready marker names another key {:?}",
            marker.key
        ));
    }
    Ok(marker)
}
