//! [`Browser`]: a headless Chromium (Debian's `chromium`) driven over the W3C WebDriver
//! protocol by its `chromedriver` (Debian's `chromium-driver`), both installed by
//! `scripts/setup.sh`. The protocol's few calls the dashboard tests need are made with
//! reqwest: open a session, load a URL, run a script, find and click an element, type,
//! take a screenshot. The driver runs in a process group of its own, killed (SIGKILL)
//! with the Chromium it started when the browser is dropped.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::{free_port, workspace_root};

/// The key of an element reference in WebDriver answers.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A headless Chromium session.
pub struct Browser {
    driver: Child,
    http: reqwest::Client,
    /// `http://127.0.0.1:PORT/session/ID`.
    session: String,
    _profile: tempfile::TempDir,
}

/// `$CUMULUS_CHROMIUM` or `/usr/bin/chromium`; `$CUMULUS_CHROMEDRIVER` or
/// `/usr/bin/chromedriver`.
fn binaries() -> anyhow::Result<(PathBuf, PathBuf)> {
    let pick = |var: &str, default: &str| {
        std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from)
    };
    let chromium = pick("CUMULUS_CHROMIUM", "/usr/bin/chromium");
    let driver = pick("CUMULUS_CHROMEDRIVER", "/usr/bin/chromedriver");
    for p in [&chromium, &driver] {
        if !p.exists() {
            bail!(
                "{} is missing: run scripts/setup.sh (Debian's chromium and chromium-driver)",
                p.display()
            );
        }
    }
    Ok((chromium, driver))
}

impl Browser {
    /// Starts chromedriver on a free loopback port and opens a headless session that
    /// accepts the test cluster's certificates (made by its own CA).
    ///
    /// # Errors
    /// Chromium or its driver is missing or does not start within a minute.
    pub async fn start() -> anyhow::Result<Browser> {
        let (chromium, driver_bin) = binaries()?;
        let port = free_port();
        let log = workspace_root().join("target/dashboard/chromedriver.log");
        std::fs::create_dir_all(log.parent().context("a parent")?)?;
        let driver = Command::new(&driver_bin)
            // Its own process group: Chromium, its child, is killed with it.
            .process_group(0)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", driver_bin.display()))?;
        let profile = tempfile::Builder::new()
            .prefix("cumulus-chromium-")
            .tempdir()?;
        let mut browser = Browser {
            driver,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()?,
            session: String::new(),
            _profile: profile,
        };
        let base = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            let ready = browser
                .http
                .get(format!("{base}/status"))
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success());
            if ready.is_some() {
                break;
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("chromedriver did not answer on port {port} within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "acceptInsecureCerts": true,
            "goog:chromeOptions": {
                "binary": chromium.display().to_string(),
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--disable-extensions",
                    "--disable-background-networking",
                    "--no-first-run",
                    "--window-size=1280,1100",
                    format!("--user-data-dir={}", browser._profile.path().display()),
                ],
            },
        }}});
        let answer = browser
            .call(
                reqwest::Method::POST,
                &format!("{base}/session"),
                Some(caps),
            )
            .await?;
        let id = answer["sessionId"]
            .as_str()
            .context("no sessionId in the new session's answer")?;
        browser.session = format!("{base}/session/{id}");
        Ok(browser)
    }

    async fn call(
        &self,
        method: reqwest::Method,
        url: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut req = self.http.request(method.clone(), url);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("{method} {url}"))?;
        let status = resp.status();
        let v: Value = resp
            .json()
            .await
            .with_context(|| format!("{method} {url}: not JSON"))?;
        if !status.is_success() {
            bail!("{method} {url}: {status}: {}", v["value"]);
        }
        Ok(v["value"].clone())
    }

    async fn session_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        self.call(method, &format!("{}{path}", self.session), body)
            .await
    }

    /// Loads `url` (returns once the page's load event fired).
    ///
    /// # Errors
    /// The driver refuses.
    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.session_call(reqwest::Method::POST, "/url", Some(json!({"url": url})))
            .await
            .map(|_| ())
    }

    /// Runs `script` (a function body: `return ...`) with `args` in the page; its value.
    ///
    /// # Errors
    /// The script throws, or the driver refuses.
    pub async fn js(&self, script: &str, args: Vec<Value>) -> anyhow::Result<Value> {
        self.session_call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
        .await
    }

    /// Polls `script` every 100 ms until it returns something other than `null`/`false`;
    /// that value. After `deadline`, saves a screenshot (`target/dashboard/timeout.png`)
    /// and panics naming `what`, the script's last answer and the page's text.
    pub async fn wait_js(&self, what: &str, deadline: Duration, script: &str) -> Value {
        let start = Instant::now();
        loop {
            let last = match self.js(script, Vec::new()).await {
                Ok(Value::Null | Value::Bool(false)) => "null or false".to_string(),
                Err(e) => format!("{e:#}"),
                Ok(v) => return v,
            };
            if start.elapsed() >= deadline {
                let _ = self.screenshot("timeout").await;
                let text = self
                    .js("return document.body.innerText.slice(0, 3000);", Vec::new())
                    .await
                    .unwrap_or_default();
                panic!(
                    "timed out after {deadline:?} waiting for {what}; the script's last \
                     answer: {last}; the page:\n{}",
                    text.as_str().unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn element(&self, css: &str) -> anyhow::Result<String> {
        let v = self
            .session_call(
                reqwest::Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await?;
        Ok(v[ELEMENT_KEY]
            .as_str()
            .with_context(|| format!("no element reference for {css}"))?
            .to_string())
    }

    /// Clicks the element `css` selects, as a user would.
    ///
    /// # Errors
    /// No such element, or it cannot be clicked.
    pub async fn click(&self, css: &str) -> anyhow::Result<()> {
        let e = self.element(css).await?;
        self.session_call(
            reqwest::Method::POST,
            &format!("/element/{e}/click"),
            Some(json!({})),
        )
        .await
        .map(|_| ())
    }

    /// Types `text` into the element `css` selects.
    ///
    /// # Errors
    /// No such element, or it takes no input.
    pub async fn type_into(&self, css: &str, text: &str) -> anyhow::Result<()> {
        let e = self.element(css).await?;
        self.session_call(
            reqwest::Method::POST,
            &format!("/element/{e}/value"),
            Some(json!({"text": text})),
        )
        .await
        .map(|_| ())
    }

    /// Saves a PNG of the page as `target/dashboard/NAME.png`; its path.
    ///
    /// # Errors
    /// The driver refuses, or the file cannot be written.
    pub async fn screenshot(&self, name: &str) -> anyhow::Result<PathBuf> {
        let v = self
            .session_call(reqwest::Method::GET, "/screenshot", None)
            .await?;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().context("a base64 screenshot")?)?;
        let path = workspace_root().join(format!("target/dashboard/{name}.png"));
        std::fs::create_dir_all(path.parent().context("a parent")?)?;
        std::fs::write(&path, png)?;
        Ok(path)
    }

    /// Ends the session (Chromium quits), then the driver.
    pub async fn close(mut self) {
        let _ = self.session_call(reqwest::Method::DELETE, "", None).await;
        self.kill_driver();
    }

    /// SIGKILLs the driver's process group (the driver and the Chromium it started).
    fn kill_driver(&mut self) {
        if let Ok(pid) = i32::try_from(self.driver.id()) {
            let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
        }
        let _ = self.driver.wait();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if self.driver.try_wait().ok().flatten().is_none() {
            self.kill_driver();
        }
    }
}
