//! An environment request checked and resolved: the spec validated as hostile input, the
//! interpreter found and probed, and the environment's key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use cumulus_api::EnvironmentSpec;
use cumulus_api::blobs::{MAX_FIND_LINKS, MAX_REQUIREMENTS_BYTES, is_valid_python_version};

use super::EnvError;
use super::run::{self, Captured};

/// Longest `index_url` or `find_links` entry accepted, in bytes.
pub const MAX_LOCATION_BYTES: usize = 4_096;
/// Longest a lookup of an interpreter (`uv python find`, the interpreter's probe) may run.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most lines of a probe's output kept (the probe prints one).
const PROBE_MAX_LINES: usize = 16;
/// Version of the key's encoding: a change of what goes into a key bumps it, so that no
/// environment built under the old meaning is reused.
const KEY_VERSION: u32 = 1;

/// What the probe prints: implementation, version, machine, then the interpreter's real
/// path (last: it may hold spaces). `-I` keeps the caller's environment and site out.
const PROBE_SCRIPT: &str = "import os, platform, sys\n\
print(sys.implementation.name, '%d.%d.%d' % sys.version_info[:3], platform.machine(), \
os.path.realpath(sys.executable))";

/// The interpreter an environment is built on, as its probe reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpreter {
    /// `sys.implementation.name` (`cpython`, `pypy`).
    pub implementation: String,
    /// `X.Y.Z`.
    pub version: String,
    /// `platform.machine()` (`x86_64`, `aarch64`).
    pub machine: String,
    /// The real path of the interpreter's executable (symlinks resolved).
    pub path: PathBuf,
}

/// An environment request, checked, with its interpreter and key.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// [`env_key`] of the request.
    pub key: String,
    /// The interpreter it is built on.
    pub interpreter: Interpreter,
    /// The requirements text, as asked.
    pub requirements: String,
    /// uv's `--index-url` ("" = none).
    pub index_url: String,
    /// uv's `--find-links` entries.
    pub find_links: Vec<String>,
    /// uv's `--no-index`.
    pub no_index: bool,
    /// Install wheels only (`--only-binary :all:`): no package's build code runs.
    pub wheels_only: bool,
}

impl Resolved {
    /// The key's first 12 characters, for log lines.
    pub fn short_key(&self) -> &str {
        short(&self.key)
    }

    /// Whether the requirements name no package (empty, blank or comments only).
    pub fn has_packages(&self) -> bool {
        requirement_lines(&self.requirements).next().is_some()
    }
}

/// The first bytes of `s`, at most `max_bytes`, cut at a character boundary.
pub fn head(s: &str, max_bytes: usize) -> &str {
    &s[..s.floor_char_boundary(max_bytes)]
}

/// The first 12 characters of a key, for log lines.
pub fn short(key: &str) -> &str {
    key.get(..12).unwrap_or(key)
}

/// The requirement lines of a requirements text: `(line number, text)` without comments
/// and surrounding whitespace, blank ones skipped.
fn requirement_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().filter_map(|(i, line)| {
        // pip's comment rule: `#` at the start or after whitespace.
        let cut = line
            .char_indices()
            .find(|&(at, c)| c == '#' && (at == 0 || line[..at].ends_with(char::is_whitespace)))
            .map_or(line.len(), |(at, _)| at);
        let line = line[..cut].trim();
        (!line.is_empty()).then_some((i + 1, line))
    })
}

/// Checks a spec as hostile input, before anything runs.
///
/// The requirements are at most [`MAX_REQUIREMENTS_BYTES`] of text without NUL bytes;
/// their lines name packages only: no options (`-r`, `-e`, `--index-url`, …; the index
/// options are fields of the spec) but `--hash` continuations, and no local paths or
/// `file:` URLs (the agent would read files of its own on the job's behalf). `python` is
/// "" or `3.X[.Y]`; `index_url` is "" or an `http(s)://` URL; each of at most
/// [`MAX_FIND_LINKS`] `find_links` is an `http(s)://` URL or an absolute, normalized path
/// of a directory on the worker.
///
/// # Errors
/// [`EnvError::Invalid`] naming the field (and line) at fault.
pub fn validate(spec: &EnvironmentSpec) -> Result<(), EnvError> {
    let invalid = |why: String| Err(EnvError::Invalid(why));
    if spec.requirements.len() > MAX_REQUIREMENTS_BYTES {
        return invalid(format!(
            "the requirements are {} bytes, more than {MAX_REQUIREMENTS_BYTES}",
            spec.requirements.len()
        ));
    }
    if spec.requirements.contains('\0') {
        return invalid("the requirements contain a NUL byte".into());
    }
    for (number, line) in requirement_lines(&spec.requirements) {
        let shown = cumulus_api::text::escape_control(head(line, 200));
        if line.starts_with('-') && !line.starts_with("--hash") {
            return invalid(format!(
                "requirements line {number} ({shown}) is an option: only package requirements \
                 are accepted (the index options are the environment's own fields)"
            ));
        }
        let local =
            line.starts_with(['.', '/', '~', '\\']) || line.to_ascii_lowercase().contains("file:");
        if local {
            return invalid(format!(
                "requirements line {number} ({shown}) names a local path: only packages from \
                 an index or find-links location are accepted"
            ));
        }
    }
    if !is_valid_python_version(&spec.python) {
        return invalid(format!(
            "python {:?} is not a version 3.X or 3.X.Y",
            cumulus_api::text::escape_control(&spec.python)
        ));
    }
    if !spec.index_url.is_empty() {
        check_location("index_url", &spec.index_url, false)?;
    }
    if spec.find_links.len() > MAX_FIND_LINKS {
        return invalid(format!(
            "{} find_links entries, more than {MAX_FIND_LINKS}",
            spec.find_links.len()
        ));
    }
    for link in &spec.find_links {
        check_location("find_links", link, true)?;
    }
    Ok(())
}

/// An index URL or find-links entry: an `http(s)://` URL, or (`path_ok`) an absolute,
/// normalized path; no whitespace or control characters.
fn check_location(field: &str, value: &str, path_ok: bool) -> Result<(), EnvError> {
    let shown = || cumulus_api::text::escape_control(head(value, 200));
    if value.is_empty() || value.len() > MAX_LOCATION_BYTES {
        return Err(EnvError::Invalid(format!(
            "{field} entry {:?} is empty or longer than {MAX_LOCATION_BYTES} bytes",
            shown()
        )));
    }
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(EnvError::Invalid(format!(
            "{field} {:?} contains whitespace or a control character",
            shown()
        )));
    }
    let lower = value.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Ok(());
    }
    if path_ok && value.starts_with('/') {
        let normalized = Path::new(value).components().all(|c| {
            matches!(
                c,
                std::path::Component::RootDir | std::path::Component::Normal(_)
            )
        });
        if normalized {
            return Ok(());
        }
        return Err(EnvError::Invalid(format!(
            "{field} {:?} is not a normalized path (no `.` or `..`)",
            shown()
        )));
    }
    Err(EnvError::Invalid(format!(
        "{field} {:?} is not an http(s) URL{}",
        shown(),
        if path_ok {
            " or an absolute path on the worker"
        } else {
            ""
        }
    )))
}

/// The key of an environment: BLAKE3 (64 hex digits) over a canonical JSON of what makes
/// one environment differ from another: the requirements, the index options, whether
/// only wheels are installed, the OS and architecture of the agent, and the interpreter
/// (implementation, version, machine, real path).
pub fn env_key(spec: &EnvironmentSpec, interpreter: &Interpreter, wheels_only: bool) -> String {
    // serde_json's maps are sorted by key: the encoding is canonical.
    let canonical = serde_json::json!({
        "v": KEY_VERSION,
        "requirements": spec.requirements,
        "index_url": spec.index_url,
        "find_links": spec.find_links,
        "no_index": spec.no_index,
        "wheels_only": wheels_only,
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "implementation": interpreter.implementation,
        "version": interpreter.version,
        "machine": interpreter.machine,
        "interpreter": interpreter.path.to_string_lossy(),
    });
    blake3::hash(canonical.to_string().as_bytes())
        .to_hex()
        .to_string()
}

/// Finds the interpreter a spec asks for: the worker's `python3` for "", else
/// `uv python find --system X` (installed interpreters only: downloads are off); then
/// probes it for its implementation, version, machine and real path, and checks the
/// version is the one asked for.
///
/// # Errors
/// [`EnvError::Unavailable`] when no such interpreter is on this worker (or no uv to look
/// for one), [`EnvError::Probe`] when it cannot be run or answers nonsense.
pub async fn find_interpreter(
    ctx: &run::Context<'_>,
    python: &str,
) -> Result<Interpreter, EnvError> {
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let candidate = if python.is_empty() {
        ctx.settings.python.clone().ok_or_else(|| {
            EnvError::Unavailable(
                "this worker has no python3 on its PATH: ask for a Python version".into(),
            )
        })?
    } else {
        let uv = ctx.uv()?;
        let args = [
            "python",
            "find",
            "--no-config",
            "--no-progress",
            "--color",
            "never",
            "--system",
            python,
        ];
        let found = run::capture(ctx, uv, &args, deadline, PROBE_MAX_LINES).await?;
        if !found.success() {
            return Err(EnvError::Unavailable(format!(
                "Python {python} is not installed on this worker ({})",
                found.last_lines(4)
            )));
        }
        let path = found.lines.last().map(String::as_str).unwrap_or("").trim();
        if !path.starts_with('/') {
            return Err(EnvError::Probe(format!(
                "uv python find {python} printed {:?}, not a path",
                cumulus_api::text::escape_control(path)
            )));
        }
        PathBuf::from(path)
    };
    let probe = run::capture(
        ctx,
        candidate.as_os_str(),
        &["-I", "-c", PROBE_SCRIPT],
        deadline,
        PROBE_MAX_LINES,
    )
    .await?;
    let interpreter = parse_probe(&candidate, &probe)?;
    if !python.is_empty()
        && interpreter.version != python
        && !interpreter.version.starts_with(&format!("{python}."))
    {
        return Err(EnvError::Unavailable(format!(
            "Python {python} was asked for, but the interpreter found ({}) is {}",
            interpreter.path.display(),
            interpreter.version
        )));
    }
    Ok(interpreter)
}

/// Reads the probe's one line (see [`PROBE_SCRIPT`]).
fn parse_probe(candidate: &Path, probe: &Captured) -> Result<Interpreter, EnvError> {
    let fail =
        |why: String| EnvError::Probe(format!("the interpreter {} {why}", candidate.display()));
    if !probe.success() {
        return Err(fail(format!(
            "cannot be run ({}): {}",
            probe.status_text(),
            probe.last_lines(4)
        )));
    }
    let line = probe.lines.last().map(String::as_str).unwrap_or("");
    let mut parts = line.splitn(4, ' ');
    let mut word = || {
        parts
            .next()
            .filter(|w| {
                !w.is_empty()
                    && w.len() <= 64
                    && w.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            })
            .map(str::to_owned)
    };
    let (Some(implementation), Some(version), Some(machine)) = (word(), word(), word()) else {
        return Err(fail(format!(
            "answered {:?} to the probe",
            cumulus_api::text::escape_control(line)
        )));
    };
    let path = parts.next().unwrap_or("");
    if !path.starts_with('/') {
        return Err(fail(format!(
            "reported its path as {:?}",
            cumulus_api::text::escape_control(path)
        )));
    }
    Ok(Interpreter {
        implementation,
        version,
        machine,
        path: PathBuf::from(path),
    })
}

/// With ranks running as other users: refuses an interpreter they could not run (its
/// file or a directory above it closed to other users), naming what is closed.
///
/// # Errors
/// [`EnvError::Unavailable`].
pub fn check_runnable_by_others(interpreter: &Path) -> Result<(), EnvError> {
    use std::os::unix::fs::PermissionsExt;
    let mut at = Some(interpreter);
    while let Some(path) = at {
        let mode = std::fs::metadata(path)
            .map_err(|e| EnvError::Unavailable(format!("cannot inspect {}: {e}", path.display())))?
            .permissions()
            .mode();
        if mode & 0o001 == 0 {
            return Err(EnvError::Unavailable(format!(
                "the interpreter {} cannot be run by the ranks' users: {} is mode {:04o} \
                 (others may not {}); install Python where every user can run it",
                interpreter.display(),
                path.display(),
                mode & 0o7777,
                if path == interpreter {
                    "execute it"
                } else {
                    "enter it"
                }
            )));
        }
        at = path.parent();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(requirements: &str) -> EnvironmentSpec {
        EnvironmentSpec {
            requirements: requirements.into(),
            ..Default::default()
        }
    }

    #[test]
    fn requirements_name_packages_only() {
        for ok in [
            "",
            "# only a comment\n\n",
            "numpy==1.26\ntorch>=2 # pinned later\n",
            "pkg==1.0 \\\n    --hash=sha256:00\n",
            "pkg @ https://example.com/pkg-1.0-py3-none-any.whl",
        ] {
            validate(&spec(ok)).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        for (bad, says) in [
            ("-r /etc/shadow", "line 1"),
            ("numpy\n--index-url http://evil", "line 2"),
            ("-e .", "option"),
            ("./local/pkg", "local path"),
            ("/abs/pkg.whl", "local path"),
            ("pkg @ file:///etc/passwd", "local path"),
            ("pkg @ FILE:///etc/passwd", "local path"),
            ("a\0b", "NUL"),
        ] {
            let e = validate(&spec(bad)).expect_err(bad).to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        let big = "a\n".repeat(MAX_REQUIREMENTS_BYTES / 2 + 1);
        assert!(validate(&spec(&big)).is_err());
        // A `#` inside a requirement is not a comment.
        assert_eq!(
            requirement_lines("pkg @ https://x/#egg=pkg\n  # c\n").collect::<Vec<_>>(),
            vec![(1, "pkg @ https://x/#egg=pkg")]
        );
    }

    #[test]
    fn index_options_are_urls_or_normalized_paths() {
        let with = |index_url: &str, find_links: &[&str]| EnvironmentSpec {
            index_url: index_url.into(),
            find_links: find_links.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        validate(&with(
            "https://pypi.org/simple",
            &["/srv/wheels", "http://h/w/"],
        ))
        .expect("ok");
        for bad in [
            with("/srv/index", &[]),
            with("file:///srv", &[]),
            with("", &["wheels"]),
            with("", &["/srv/../etc"]),
            with("", &["/srv/ wheels"]),
            with("", &["--no-index"]),
            with("", &[""]),
            with("", &vec!["/w"; MAX_FIND_LINKS + 1]),
        ] {
            assert!(validate(&bad).is_err(), "{bad:?}");
        }
        let python = |p: &str| EnvironmentSpec {
            python: p.into(),
            ..Default::default()
        };
        validate(&python("3.11")).expect("3.11");
        assert!(validate(&python("python3")).is_err());
    }

    #[test]
    fn the_key_covers_what_makes_environments_differ() {
        let interp = Interpreter {
            implementation: "cpython".into(),
            version: "3.11.7".into(),
            machine: "x86_64".into(),
            path: "/usr/bin/python3.11".into(),
        };
        let base = spec("numpy");
        let key = env_key(&base, &interp, false);
        assert_eq!(key.len(), 64);
        assert_eq!(key, env_key(&base, &interp, false), "deterministic");
        let other_version = Interpreter {
            version: "3.11.8".into(),
            ..interp.clone()
        };
        let mut no_index = base.clone();
        no_index.no_index = true;
        let mut links = base.clone();
        links.find_links = vec!["/w".into()];
        let mut index = base.clone();
        index.index_url = "https://i/simple".into();
        for (what, other) in [
            ("requirements", env_key(&spec("numpy\n"), &interp, false)),
            ("version", env_key(&base, &other_version, false)),
            ("no_index", env_key(&no_index, &interp, false)),
            ("find_links", env_key(&links, &interp, false)),
            ("index_url", env_key(&index, &interp, false)),
            ("wheels_only", env_key(&base, &interp, true)),
        ] {
            assert_ne!(key, other, "{what} changes the key");
        }
        // The version asked for is not part of the key: only what it resolved to.
        let mut asked = base.clone();
        asked.python = "3.11".into();
        assert_eq!(key, env_key(&asked, &interp, false));
    }

    #[test]
    fn probe_answers_are_checked() {
        let captured = |line: &str| Captured {
            lines: vec![line.to_string()],
            status: Some(0),
        };
        let ok = parse_probe(
            Path::new("/x"),
            &captured("cpython 3.11.7 x86_64 /opt/my python/bin/python3.11"),
        )
        .expect("ok");
        assert_eq!(ok.path, Path::new("/opt/my python/bin/python3.11"));
        assert_eq!(ok.version, "3.11.7");
        for bad in [
            "",
            "cpython 3.11.7",
            "cpython 3.11.7 x86_64 relative",
            "c;x 3 x /p",
        ] {
            assert!(
                parse_probe(Path::new("/x"), &captured(bad)).is_err(),
                "{bad}"
            );
        }
        let failed = Captured {
            lines: vec!["boom".into()],
            status: Some(1),
        };
        let e = parse_probe(Path::new("/x"), &failed).expect_err("failed");
        assert!(e.to_string().contains("boom"), "{e}");
    }

    #[test]
    fn an_interpreter_closed_to_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let closed = dir.path().join("closed");
        std::fs::create_dir(&closed).expect("mkdir");
        let python = closed.join("python");
        std::fs::write(&python, b"").expect("write");
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let e = check_runnable_by_others(&python).expect_err("closed dir");
        assert!(e.to_string().contains("closed is mode 0700"), "{e}");
    }
}
