//! A real S3 server for the tests: `s3s-fs` started on a free port over a temp dir.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;

use crate::*;

/// How coordinators and workers reach a test S3 server.
#[derive(Clone, Debug)]
pub struct S3Access {
    /// Endpoint URL, `http://127.0.0.1:<port>`.
    pub endpoint: String,
    /// Access key id.
    pub access_key: String,
    /// Secret access key.
    pub secret_key: String,
    /// Retry deadline of transient failures, milliseconds.
    pub retry_deadline_ms: u64,
}

impl S3Access {
    /// `CUMULUS_S3_*` environment of a process.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CUMULUS_S3_ENDPOINT", self.endpoint.clone()),
            ("CUMULUS_S3_PATH_STYLE", "true".into()),
            ("CUMULUS_S3_ACCESS_KEY", self.access_key.clone()),
            ("CUMULUS_S3_SECRET_KEY", self.secret_key.clone()),
            (
                "CUMULUS_S3_RETRY_DEADLINE_MS",
                self.retry_deadline_ms.to_string(),
            ),
            ("CUMULUS_S3_PART_SIZE_MIB", "5".into()),
        ]
    }

    /// The same settings for an in-process [`cumulus_ckpt::S3Store`].
    pub fn settings(&self) -> cumulus_ckpt::S3Settings {
        cumulus_ckpt::S3Settings {
            endpoint_url: Some(self.endpoint.clone()),
            force_path_style: true,
            access_key_id: Some(self.access_key.clone()),
            secret_access_key: Some(self.secret_key.clone()),
            retry_deadline_ms: 5_000,
            ..cumulus_ckpt::S3Settings::default()
        }
    }

    /// The store of `url` (`s3://bucket/prefix`) as the tests' independent reader.
    pub async fn store(&self, url: &str) -> anyhow::Result<cumulus_ckpt::S3Store> {
        let settings = self.settings();
        let client = settings.client().await?;
        Ok(cumulus_ckpt::S3Store::new(
            client,
            settings,
            cumulus_ckpt::S3Location::parse(url)?,
        ))
    }
}

/// Path of the `s3s-fs` binary: `$CUMULUS_S3S_FS`, else `~/.cargo/bin/s3s-fs`, else PATH.
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

/// A real S3 server (`s3s-fs`) on a loopback port, serving a temp dir; it can be stopped
/// and restarted on the same port and data. Killed on drop.
pub struct S3Server {
    /// The process.
    pub proc: Proc,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Access for clients.
    pub access: S3Access,
    dir: tempfile::TempDir,
}

impl S3Server {
    /// Starts `s3s-fs` and waits until it accepts connections.
    pub async fn start() -> anyhow::Result<S3Server> {
        let dir = tempfile::Builder::new().prefix("cumulus-s3-").tempdir()?;
        std::fs::create_dir_all(dir.path().join("data"))?;
        let port = free_port();
        let mut server = S3Server {
            proc: Proc {
                name: "s3s-fs".into(),
                child: None,
                log: dir.path().join("s3s-fs.log"),
            },
            port,
            access: S3Access {
                endpoint: format!("http://127.0.0.1:{port}"),
                access_key: "cumulus-e2e-key".into(),
                secret_key: "cumulus-e2e-secret".into(),
                retry_deadline_ms: 120_000,
            },
            dir,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// (Re)starts the process on the same port and data dir.
    pub async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.proc.log)?;
        let child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", &self.access.access_key])
            .args(["--secret-key", &self.access.secret_key])
            .arg(self.dir.path().join("data"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning s3s-fs (cargo install s3s-fs@0.14.1 --locked --features binary)")?;
        self.proc.child = Some(child);
        let port = self.port;
        wait_for("s3s-fs to listen", Duration::from_secs(30), || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        Ok(())
    }

    /// Creates a bucket through the S3 API.
    pub async fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let client = self.access.settings().client().await?;
        client.create_bucket().bucket(bucket).send().await?;
        Ok(())
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(log) = std::fs::read_to_string(&self.proc.log)
        {
            eprintln!("----- s3s-fs log -----\n{log}");
        }
        self.proc.kill9();
    }
}
