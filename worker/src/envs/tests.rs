//! Tests of the environments with a real uv (python/.venv/bin/uv, installed by
//! scripts/setup.sh) and a wheel built here; uv never reaches an index (`--no-index
//! --find-links`) nor downloads an interpreter.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cumulus_api::EnvironmentSpec;

use super::*;

/// The Python package's virtualenv: its uv and its interpreter.
pub(crate) fn venv_bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../python/.venv/bin")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/setup.sh (it installs uv into python/.venv)",
        path.display()
    );
    path
}

/// Writes a pure-Python wheel `<name>-<version>-py3-none-any.whl` into `dir` whose
/// package holds `VALUE = <value>`.
pub(crate) fn write_wheel(dir: &Path, name: &str, version: &str, value: u32) {
    let script = r#"
import sys, zipfile
dir, name, ver, value = sys.argv[1:5]
info = f"{name}-{ver}.dist-info"
with zipfile.ZipFile(f"{dir}/{name}-{ver}-py3-none-any.whl", "w") as z:
    z.writestr(f"{name}/__init__.py", f"VALUE = {value}\n")
    z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
    z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: cumulus-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
"#;
    let status = std::process::Command::new(venv_bin("python"))
        .args(["-c", script])
        .arg(dir)
        .args([name, version, &value.to_string()])
        .status()
        .expect("python");
    assert!(status.success(), "writing the wheel failed");
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    wheels: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let wheels = root.join("wheels");
        std::fs::create_dir(&wheels).expect("mkdir");
        write_wheel(&wheels, "cumtestpkg", "1.0", 42);
        write_wheel(&wheels, "othertestpkg", "2.0", 7);
        Self {
            _dir: dir,
            root,
            wheels,
        }
    }

    fn settings(&self) -> EnvSettings {
        EnvSettings {
            data_dir: self.root.join("data"),
            uv: Some(venv_bin("uv")),
            python: Some(venv_bin("python")),
            max_bytes: DEFAULT_CACHE_BYTES,
            build_timeout: Duration::from_secs(120),
            ranks_other_user: false,
        }
    }

    fn open(&self, settings: EnvSettings) -> Arc<Environments> {
        let spawner = Spawner::start(tokio::runtime::Handle::current()).expect("spawner");
        Environments::open(settings, spawner).expect("open")
    }

    /// A spec for `requirements` from the test's wheels only.
    fn spec(&self, requirements: &str) -> EnvironmentSpec {
        EnvironmentSpec {
            requirements: requirements.into(),
            python: String::new(),
            index_url: String::new(),
            find_links: vec![self.wheels.display().to_string()],
            no_index: true,
        }
    }
}

/// Drives a setup to its end: its lines and its outcome.
async fn drive(mut setup: Setup) -> (Vec<String>, Result<EnvLease, EnvError>) {
    let mut lines = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let event = tokio::time::timeout_at(deadline, setup.next())
            .await
            .expect("the setup ended in time");
        match event {
            SetupEvent::Line(line) => lines.push(line),
            SetupEvent::Done(result) => return (lines, result),
        }
    }
}

/// What `import <module>; print(<module>.VALUE)` prints in the environment.
fn value_in(env: &Path, module: &str) -> String {
    let out = std::process::Command::new(env.join("bin/python"))
        .args(["-c", &format!("import {module}; print({module}.VALUE)")])
        .env_clear()
        .output()
        .expect("python of the environment");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test]
async fn builds_once_then_reuses_and_survives_a_restart() {
    let fx = Fixture::new();
    let envs = fx.open(fx.settings());
    let (lines, result) = drive(envs.setup(&fx.spec("cumtestpkg\n")).await).await;
    let lease = result.unwrap_or_else(|e| panic!("{e}; output: {lines:#?}"));
    assert!(lines[0].starts_with("building environment"), "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.contains("+ cumtestpkg==1.0")),
        "uv's output: {lines:#?}"
    );
    assert!(
        lines.last().is_some_and(|l| l.contains("ready after")),
        "{lines:#?}"
    );
    assert_eq!(envs.builds_started(), 1);
    assert_eq!(value_in(lease.dir(), "cumtestpkg"), "42");
    assert_eq!(lease.dir(), fx.root.join("data/envs").join(lease.key()));
    assert!(lease.dir().join(READY_MARKER).is_file());
    let key = lease.key().to_owned();

    // Asked again (a rank restart, another job): the same environment, no build.
    let (lines, again) = drive(envs.setup(&fx.spec("cumtestpkg\n")).await).await;
    let again = again.expect("cached");
    assert_eq!(again.key(), key);
    assert_eq!(envs.builds_started(), 1, "{lines:#?}");
    assert!(lines.iter().any(|l| l.contains("(cached)")), "{lines:#?}");
    // Other requirements: another environment.
    let (_, other) = drive(envs.setup(&fx.spec("othertestpkg")).await).await;
    let other = other.expect("other");
    assert_ne!(other.key(), key);
    assert_eq!(value_in(other.dir(), "othertestpkg"), "7");
    assert_eq!(envs.builds_started(), 2);
    drop((lease, again, other));

    // An agent restarted on the data dir finds both; what a build left is removed.
    let leftover = fx.root.join("data/envs").join(format!("{BUILD_PREFIX}x-y"));
    std::fs::create_dir_all(leftover.join("venv")).expect("mkdir");
    let unready = fx.root.join("data/envs").join("a".repeat(64));
    std::fs::create_dir_all(&unready).expect("mkdir");
    drop(envs);
    let envs = fx.open(fx.settings());
    assert_eq!(envs.ready_keys().len(), 2);
    assert!(envs.ready_keys().contains(&key));
    assert!(!leftover.exists() && !unready.exists());
    let (_, after) = drive(envs.setup(&fx.spec("cumtestpkg\n")).await).await;
    assert_eq!(after.expect("cached after restart").key(), key);
    assert_eq!(envs.builds_started(), 0);
}

#[tokio::test]
async fn concurrent_requests_share_one_build() {
    let fx = Fixture::new();
    let envs = fx.open(fx.settings());
    // The interpreter is looked up once first, so that the second request joins the
    // first one's build at once (this runtime runs one task at a time: the build has not
    // started when the second request is made).
    let warm = envs.setup(&fx.spec("")).await;
    drive(warm).await.1.expect("bare environment");
    let first = envs.setup(&fx.spec("cumtestpkg")).await;
    let second = envs.setup(&fx.spec("cumtestpkg")).await;
    let ((lines_a, a), (lines_b, b)) = tokio::join!(drive(first), drive(second));
    let (a, b) = (a.expect("first"), b.expect("second"));
    assert_eq!(
        envs.builds_started(),
        2,
        "one for the bare environment, one for both"
    );
    assert_eq!(a.dir(), b.dir());
    assert!(
        lines_a[0].starts_with("building environment"),
        "{lines_a:#?}"
    );
    assert!(
        lines_b[0].starts_with("waiting for environment"),
        "{lines_b:#?}"
    );
    assert!(
        lines_b
            .last()
            .is_some_and(|l| l.contains("built for another attempt")),
        "{lines_b:#?}"
    );
    assert_eq!(value_in(b.dir(), "cumtestpkg"), "42");
}

#[tokio::test]
async fn a_requirement_that_does_not_exist_fails_with_uvs_message() {
    let fx = Fixture::new();
    let envs = fx.open(fx.settings());
    let (lines, result) = drive(envs.setup(&fx.spec("doesnotexist==1.0")).await).await;
    let e = result.expect_err("no such package");
    let text = e.to_string();
    assert!(matches!(e, EnvError::Build(_)), "{e:?}");
    assert!(!e.is_agent_fault());
    assert!(text.contains("uv pip install failed"), "{text}");
    assert!(
        text.contains("doesnotexist"),
        "uv's message is in the error: {text}"
    );
    assert!(
        lines.iter().any(|l| l.contains("doesnotexist")),
        "{lines:#?}"
    );
    assert!(
        lines.last().is_some_and(|l| l.contains("failed after")),
        "{lines:#?}"
    );
    // Nothing of the failed build is left or remembered; a later request builds again.
    assert!(envs.ready_keys().is_empty());
    let left: Vec<_> = std::fs::read_dir(fx.root.join("data/envs"))
        .expect("envs")
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let (_, again) = drive(envs.setup(&fx.spec("doesnotexist==1.0")).await).await;
    assert!(again.is_err());
    assert_eq!(envs.builds_started(), 2);
}

#[tokio::test]
async fn refused_specs_and_missing_tools_fail_before_any_build() {
    let fx = Fixture::new();
    let envs = fx.open(fx.settings());
    let (_, bad) = drive(envs.setup(&fx.spec("-r /etc/passwd")).await).await;
    assert!(matches!(bad, Err(EnvError::Invalid(_))), "{bad:?}");
    let mut old = fx.spec("cumtestpkg");
    old.python = "3.99".into();
    let (_, missing) = drive(envs.setup(&old).await).await;
    let e = missing.expect_err("no Python 3.99");
    assert!(
        e.to_string().contains("Python 3.99 is not installed"),
        "{e}"
    );
    let no_uv = fx.open(EnvSettings {
        uv: None,
        ..fx.settings()
    });
    let (_, e) = drive(no_uv.setup(&fx.spec("cumtestpkg")).await).await;
    assert!(e.expect_err("no uv").to_string().contains("--uv"));
    assert_eq!(
        envs.builds_started() + no_uv.builds_started(),
        1,
        "only the no-uv one tried"
    );
}

#[tokio::test]
async fn a_build_past_its_time_limit_is_stopped() {
    let fx = Fixture::new();
    let envs = fx.open(EnvSettings {
        build_timeout: Duration::from_millis(1),
        ..fx.settings()
    });
    let (_, result) = drive(envs.setup(&fx.spec("cumtestpkg")).await).await;
    let e = result.expect_err("timed out");
    assert!(matches!(e, EnvError::Timeout(_)), "{e:?}");
    assert!(e.to_string().contains("--env-build-timeout-ms"), "{e}");
    assert!(envs.ready_keys().is_empty());
}

#[tokio::test]
async fn unused_environments_are_evicted_least_recently_used_first() {
    let fx = Fixture::new();
    // Any environment is over this bound: only the ones in use stay.
    let envs = fx.open(EnvSettings {
        max_bytes: 1,
        ..fx.settings()
    });
    let (_, a) = drive(envs.setup(&fx.spec("cumtestpkg")).await).await;
    let a = a.expect("a");
    let (_, b) = drive(envs.setup(&fx.spec("othertestpkg")).await).await;
    let b = b.expect("b");
    let (a_dir, b_dir) = (a.dir().to_path_buf(), b.dir().to_path_buf());
    assert!(
        a_dir.exists() && b_dir.exists(),
        "in use: kept past the bound"
    );
    assert_eq!(envs.ready_keys().len(), 2);
    drop(a);
    assert!(!a_dir.exists(), "unused past the bound: evicted");
    assert!(b_dir.exists());
    assert_eq!(value_in(&b_dir, "othertestpkg"), "7");
    drop(b);
    assert!(!b_dir.exists());
    assert!(envs.ready_keys().is_empty());

    // Past the bound by a little, the least recently used unused one goes first.
    let roomy = fx.open(fx.settings());
    let (_, c) = drive(roomy.setup(&fx.spec("cumtestpkg")).await).await;
    let c = c.expect("c");
    let (_, d) = drive(roomy.setup(&fx.spec("othertestpkg")).await).await;
    let d = d.expect("d");
    let (c_dir, d_dir) = (c.dir().to_path_buf(), d.dir().to_path_buf());
    drop(d);
    drop(c);
    {
        let mut state = roomy.lock();
        let envs_bytes: u64 = state.ready.values().map(|r| r.size_bytes).sum();
        assert!(envs_bytes > 0);
        // uv's cache (as measured) takes the rest of the bound, and one byte more.
        state.cache_bytes = DEFAULT_CACHE_BYTES - envs_bytes + 1;
    }
    roomy.evict();
    assert!(!d_dir.exists(), "used longest ago: evicted");
    assert!(c_dir.exists(), "used last, and the rest fits: kept");
    assert_eq!(value_in(&c_dir, "cumtestpkg"), "42");
}

#[tokio::test]
async fn environments_for_other_users_are_wheels_only_and_open_to_them() {
    let fx = Fixture::new();
    let settings = EnvSettings {
        ranks_other_user: true,
        ..fx.settings()
    };
    let envs = fx.open(settings);
    assert_eq!(
        std::fs::metadata(fx.root.join("data/envs"))
            .expect("envs")
            .permissions()
            .mode()
            & 0o777,
        0o711
    );
    let interpreter = envs.interpreter("").await.expect("interpreter");
    let (_, result) = drive(envs.setup(&fx.spec("cumtestpkg")).await).await;
    match spec::check_runnable_by_others(&interpreter.path) {
        Ok(()) => {
            let lease = result.expect("built");
            for path in [lease.dir().to_path_buf(), lease.dir().join("bin")] {
                let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
                assert_eq!(mode & 0o777, 0o755, "{}", path.display());
            }
            assert_eq!(value_in(lease.dir(), "cumtestpkg"), "42");
        }
        Err(closed) => {
            // This machine's interpreter lies in a directory other users cannot enter:
            // the request is refused with that reason.
            let e = result.expect_err("refused");
            assert_eq!(e.to_string(), closed.to_string());
        }
    }
}
