//! A real S3 server for the tests: `s3s-fs` started on a free port over a temp dir.

use anyhow::Context;
use cumulus_s3_test::S3TestServer;

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

/// A real S3 server ([`cumulus_s3_test::S3TestServer`], `s3s-fs` on a loopback port over
/// a temp dir) with the access its clients need; it can be stopped and restarted on the
/// same port and data. Killed on drop.
pub struct S3Server {
    /// The server process.
    pub server: S3TestServer,
    /// Access for clients.
    pub access: S3Access,
}

impl S3Server {
    /// Starts `s3s-fs` and waits until it accepts connections.
    pub async fn start() -> anyhow::Result<S3Server> {
        let server = tokio::task::spawn_blocking(S3TestServer::start)
            .await
            .context("joining the s3s-fs start")??;
        let access = S3Access {
            endpoint: server.endpoint(),
            access_key: cumulus_s3_test::ACCESS_KEY.into(),
            secret_key: cumulus_s3_test::SECRET_KEY.into(),
            retry_deadline_ms: 120_000,
        };
        Ok(S3Server { server, access })
    }

    /// Kills the process (an S3 outage); [`S3Server::restart`] brings it back.
    pub fn stop(&mut self) {
        self.server.stop();
    }

    /// Restarts the process on the same port and data; returns once it accepts
    /// connections.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        Ok(self.server.restart()?)
    }

    /// Creates a bucket through the S3 API.
    pub async fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let client = self.access.settings().client().await?;
        client.create_bucket().bucket(bucket).send().await?;
        Ok(())
    }
}
