//! A real S3 server for tests and benchmarks: `s3s-fs` (installed by `scripts/setup.sh`:
//! `cargo install s3s-fs@0.14.1 --locked --features binary`) on a free loopback port,
//! storing in a temp dir, with static credentials. It can be stopped and started again
//! on the same port and data (an S3 outage); it is killed on drop, and its log is printed
//! when the dropping thread panics.
//!
//! The one harness of the workspace: `cumulus-ckpt`'s S3 tests use it directly,
//! `cumulus-e2e` wraps it with the `CUMULUS_S3_*` settings of its processes, and the
//! benchmarks use `cumulus-e2e`'s.

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Access key id every test server accepts.
pub const ACCESS_KEY: &str = "cumulus-test-key";
/// Secret access key every test server accepts.
pub const SECRET_KEY: &str = "cumulus-test-secret";
/// How long a start waits for the server to accept connections.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a start checks whether the server accepts connections.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Path of the `s3s-fs` binary: `$CUMULUS_S3S_FS`, else `~/.cargo/bin/s3s-fs`, else the
/// one on `PATH`.
pub fn s3s_fs_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("CUMULUS_S3S_FS") {
        return path.into();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let cargo_bin = home.join(".cargo/bin/s3s-fs");
    if cargo_bin.exists() {
        return cargo_bin;
    }
    PathBuf::from("s3s-fs")
}

/// Errors starting the server.
#[derive(Debug)]
pub enum StartError {
    /// The temp dir, the log file or a free port could not be had.
    Setup(std::io::Error),
    /// The binary could not be started (not installed?).
    Spawn(std::io::Error),
    /// It did not accept connections within [`START_TIMEOUT`].
    NotListening {
        /// The port it was told to listen on.
        port: u16,
    },
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Setup(e) => write!(f, "preparing s3s-fs: {e}"),
            StartError::Spawn(e) => write!(
                f,
                "starting {}: {e} (install it: cargo install s3s-fs@0.14.1 --locked --features binary)",
                s3s_fs_binary().display()
            ),
            StartError::NotListening { port } => write!(
                f,
                "s3s-fs did not accept connections on 127.0.0.1:{port} within {START_TIMEOUT:?}"
            ),
        }
    }
}

impl std::error::Error for StartError {}

/// An `s3s-fs` process on `127.0.0.1:<port>` serving `<temp dir>/data`.
pub struct S3TestServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

impl S3TestServer {
    /// Starts a server on a free port and waits (polling a connect, at most
    /// [`START_TIMEOUT`]) until it accepts connections.
    pub fn start() -> Result<Self, StartError> {
        let dir = tempfile::Builder::new()
            .prefix("cumulus-s3-")
            .tempdir()
            .map_err(StartError::Setup)?;
        std::fs::create_dir_all(dir.path().join("data")).map_err(StartError::Setup)?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(StartError::Setup)?
            .port();
        let mut server = S3TestServer {
            child: None,
            port,
            dir,
        };
        server.restart()?;
        Ok(server)
    }

    /// (Re)starts the process on the same port and data, after [`S3TestServer::stop`];
    /// returns once it accepts connections.
    pub fn restart(&mut self) -> Result<(), StartError> {
        self.stop();
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(StartError::Setup)?;
        let err_log = log.try_clone().map_err(StartError::Setup)?;
        let child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(self.dir.path().join("data"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .spawn()
            .map_err(StartError::Spawn)?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() >= deadline {
                return Err(StartError::NotListening { port: self.port });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        Ok(())
    }

    /// Kills the process (SIGKILL) and reaps it; the port and data stay for a restart.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its endpoint URL, `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The directory its buckets are stored in (`<bucket>/<key>` files).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Its combined stdout and stderr.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("s3s-fs.log")
    }

    /// The temp dir holding its data and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for S3TestServer {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(log) = std::fs::read_to_string(self.log_path())
        {
            eprintln!("----- s3s-fs log -----\n{log}");
        }
        self.stop();
    }
}
