//! The cluster commands: submit, status, list, cancel, logs, ckpt ls, cluster status.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Component, Path};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cumulus_api::blobs::{MAX_FIND_LINKS, MAX_REQUIREMENTS_BYTES};
use cumulus_api::{EnvironmentSpec, JobSpec, RestartPolicy, SubmitJobRequest};

use crate::args::{JobOpts, ListArgs, OutputFormat, SubmitArgs, TokenCreateArgs};
use crate::client::{Client, new_request_id};
use crate::config::Conn;
use crate::dataset::{absolute, canonical_lenient};
use crate::logs::{CursorState, LogLine, LogRequest, follow_logs};
use crate::output::{print_data, print_text};
use crate::render;

/// Poll interval of `submit --wait`.
pub const WAIT_POLL: Duration = Duration::from_secs(1);
pub use cumulus_api::limits::MAX_REQUEST_ID_BYTES;
/// Most `--env` entries.
pub const MAX_ENV: usize = cumulus_api::limits::MAX_ENV_ENTRIES;

/// Whether a job in wire state `state` is finished: nothing changes after it.
pub fn is_finished(state: &str) -> bool {
    state
        .parse::<cumulus_api::JobState>()
        .is_ok_and(cumulus_api::JobState::is_terminal)
}

/// Parses `--env KEY=VALUE` entries; keys must be non-empty, without `=` or NUL, unique.
pub fn parse_env(entries: &[String]) -> Result<HashMap<String, String>> {
    if entries.len() > MAX_ENV {
        bail!("at most {MAX_ENV} --env entries, got {}", entries.len());
    }
    let mut env = HashMap::new();
    for e in entries {
        let (k, v) = e
            .split_once('=')
            .with_context(|| format!("--env {e:?}: expected KEY=VALUE"))?;
        if k.is_empty() || k.contains('\0') || v.contains('\0') {
            bail!("--env {e:?}: the key must be non-empty and neither may contain NUL");
        }
        if env.insert(k.to_string(), v.to_string()).is_some() {
            bail!("--env {k} is given twice");
        }
    }
    Ok(env)
}

/// `p` as the absolute, normalized path the coordinator accepts: relative to the
/// current directory, without `.` components, repeated or trailing `/`; a path with `..`
/// is resolved on this machine ([`canonical_lenient`]), since the coordinator refuses `..`.
fn abs_string(p: &Option<std::path::PathBuf>, flag: &str) -> Result<String> {
    match p {
        None => Ok(String::new()),
        Some(p) => {
            let a = absolute(p)
                .with_context(|| format!("{flag} {}: cannot make it absolute", p.display()))?;
            let a: std::path::PathBuf = if a.components().any(|c| c == Component::ParentDir) {
                canonical_lenient(&a)
            } else {
                a.components().collect()
            };
            a.to_str()
                .map(str::to_string)
                .with_context(|| format!("{flag} {} is not valid UTF-8", a.display()))
        }
    }
}

/// Builds the request of `submit` (relative paths made absolute; request id kept or
/// generated once; the environment read and checked). `--upload` is not packed here:
/// [`submit`] sets `spec.workdir` once the directory is stored.
pub fn build_submit(args: &SubmitArgs) -> Result<SubmitJobRequest> {
    let mut req = build_request(args.world_size.max, &args.job, args.command.clone())?;
    if let Some(spec) = &mut req.spec {
        spec.min_world_size = args.world_size.min;
    }
    Ok(req)
}

/// Builds the request of a job of `world_size` ranks running `command` with `args`
/// (`submit`, `run`).
pub fn build_request(
    world_size: u32,
    args: &JobOpts,
    command: Vec<String>,
) -> Result<SubmitJobRequest> {
    let request_id = match &args.request_id {
        Some(id) if id.is_empty() || id.len() > MAX_REQUEST_ID_BYTES => {
            bail!("--request-id must be 1..={MAX_REQUEST_ID_BYTES} bytes")
        }
        Some(id) => id.clone(),
        None => new_request_id(),
    };
    if command.is_empty() {
        bail!("no command: put it after `--`, e.g. `submit --world-size 2 -- python train.py`");
    }
    let progress_timeout_ms = match args.progress_timeout_s {
        None => 0,
        Some(s) => s
            .checked_mul(1000)
            .context("--progress-timeout-s is too large")?,
    };
    if let (Some(a), Some(b)) = (args.backoff_initial_ms, args.backoff_max_ms)
        && a > b
    {
        bail!("--backoff-initial-ms {a} is larger than --backoff-max-ms {b}");
    }
    if let Some(name) = &args.name
        && !cumulus_api::text::is_printable(name)
    {
        bail!(
            "--name {} holds control or invisible characters",
            cumulus_api::text::escape_control(name)
        );
    }
    let spec = JobSpec {
        name: args.name.clone().unwrap_or_default(),
        world_size,
        command,
        env: parse_env(&args.env)?,
        dataset: match &args.dataset {
            // An S3 prefix goes as is; a directory is made absolute.
            Some(p) if p.to_str().is_some_and(|s| s.starts_with("s3://")) => {
                p.to_string_lossy().into_owned()
            }
            _ => abs_string(&args.dataset, "--dataset")?,
        },
        ckpt_dir: abs_string(&args.ckpt_dir, "--ckpt-dir")?,
        ckpt_keep: args.ckpt_keep,
        restart: Some(RestartPolicy {
            scope: args.restart_scope.map(|s| s.as_str().to_string()),
            max_restarts: args.max_restarts,
            backoff_initial_ms: args.backoff_initial_ms,
            backoff_max_ms: args.backoff_max_ms,
        }),
        progress_timeout_ms,
        startup_timeout_ms: args.startup_timeout_s.map_or(0, |s| s * 1000),
        working_dir: abs_string(&args.workdir, "--workdir")?,
        ckpt_url: args.ckpt_url.clone().unwrap_or_default(),
        ckpt_commit_tier: args
            .ckpt_commit_tier
            .map(|t| t.as_str().to_string())
            .unwrap_or_default(),
        gpus_per_rank: args.gpus_per_rank.unwrap_or(0),
        gpu_memory_fraction: args.gpu_memory_fraction,
        stop_grace_ms: args.stop_grace_s.map_or(0, |s| s * 1000),
        time_limit_ms: args.time_limit.unwrap_or(0),
        priority: args.priority.unwrap_or(0),
        signal_before_ms: args.signal_before.unwrap_or(0),
        resume_from_job: args
            .resume_from
            .as_ref()
            .map(|r| r.job.clone())
            .unwrap_or_default(),
        resume_from_step: args.resume_from.as_ref().and_then(|r| r.step),
        preemptible: args.preemptible,
        workdir: None,
        environment: build_environment(args)?,
        fail_fast: args.no_fail_fast.then_some(false),
        warm_spares: args.warm_spares.unwrap_or(0),
        warm_imports: args.warm_imports.clone(),
        straggler_action: args
            .straggler_action
            .map(|a| a.as_str().to_string())
            .unwrap_or_default(),
        straggler_fraction: args.straggler_fraction,
        straggler_window_ms: args.straggler_window_s.map_or(0, |s| s * 1000),
        min_world_size: 0,
    };
    cumulus_api::warm::check(spec.warm_spares, &spec.warm_imports, &spec.command)
        .map_err(|why| anyhow::anyhow!("{why} (--warm-spares, --warm-imports)"))?;
    Ok(SubmitJobRequest {
        allow_pending: args.allow_pending,
        request_id,
        spec: Some(spec),
    })
}

/// The Python environment of `--requirements`, `--pip`, `--python` and the index options
/// (`None` when none is given), checked against the contract's limits
/// ([`cumulus_api::blobs`]) before anything is sent.
///
/// # Errors
/// Index options without packages, an unreadable or oversized requirements file, a
/// package that is not one requirement, too many or malformed index options.
pub fn build_environment(args: &JobOpts) -> Result<Option<EnvironmentSpec>> {
    let packages = args.requirements.is_some() || !args.pip.is_empty() || args.python.is_some();
    let index = args.index_url.is_some() || !args.find_links.is_empty() || args.no_index;
    if !packages {
        if index {
            bail!(
                "--index-url, --find-links and --no-index say where the packages of --requirements or --pip come from: name packages too"
            );
        }
        return Ok(None);
    }
    let mut requirements = match &args.requirements {
        Some(path) => read_requirements(path)?,
        None => String::new(),
    };
    for pkg in &args.pip {
        let pkg = pkg.trim();
        if pkg.is_empty() || pkg.starts_with('-') || !cumulus_api::text::is_printable(pkg) {
            bail!(
                "--pip {}: give one requirement such as numpy or torch==2.3.1 (options and several lines go in a --requirements file)",
                cumulus_api::text::escape_control(pkg)
            );
        }
        if !requirements.is_empty() && !requirements.ends_with('\n') {
            requirements.push('\n');
        }
        requirements.push_str(pkg);
        requirements.push('\n');
    }
    if requirements.len() > MAX_REQUIREMENTS_BYTES {
        bail!(
            "the requirements hold {} bytes, more than the limit of {MAX_REQUIREMENTS_BYTES}",
            requirements.len()
        );
    }
    if args.find_links.len() > MAX_FIND_LINKS {
        bail!(
            "{} --find-links, more than the limit of {MAX_FIND_LINKS}",
            args.find_links.len()
        );
    }
    let index_url = match &args.index_url {
        Some(url) => index_option("--index-url", url)?,
        None => String::new(),
    };
    let mut find_links = Vec::with_capacity(args.find_links.len());
    for link in &args.find_links {
        let link = index_option("--find-links", link)?;
        find_links.push(if link.contains("://") {
            link
        } else {
            // A directory on the workers, named as on this machine (a shared file system).
            abs_string(&Some(link.into()), "--find-links")?
        });
    }
    Ok(Some(EnvironmentSpec {
        requirements,
        python: args.python.clone().unwrap_or_default(),
        index_url,
        find_links,
        no_index: args.no_index,
    }))
}

/// Reads a `--requirements` file: at most [`MAX_REQUIREMENTS_BYTES`] of UTF-8 text
/// without NUL.
fn read_requirements(path: &Path) -> Result<String> {
    use std::io::Read;
    let file =
        std::fs::File::open(path).with_context(|| format!("--requirements {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_REQUIREMENTS_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading --requirements {}", path.display()))?;
    if bytes.len() > MAX_REQUIREMENTS_BYTES {
        bail!(
            "--requirements {} is larger than the limit of {MAX_REQUIREMENTS_BYTES} bytes",
            path.display()
        );
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| anyhow::anyhow!("--requirements {} is not UTF-8 text", path.display()))?;
    if text.contains('\0') {
        bail!("--requirements {} holds a NUL byte", path.display());
    }
    Ok(text)
}

/// An `--index-url` or `--find-links` value: 1..=MAX_ARG_BYTES visible characters.
fn index_option(flag: &str, value: &str) -> Result<String> {
    let value = value.trim();
    if value.is_empty()
        || value.len() > cumulus_api::limits::MAX_ARG_BYTES
        || value.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        bail!(
            "{flag} {}: give a URL or a path of at most {} bytes, without spaces or control characters",
            cumulus_api::text::escape_control(value),
            cumulus_api::limits::MAX_ARG_BYTES
        );
    }
    Ok(value.to_string())
}

/// The coordinator's warnings about an accepted submit, one `warning: ...` line each on
/// stderr (control characters escaped: the text comes from the server).
pub fn print_warnings(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {}", cumulus_api::text::escape_control(w));
    }
}

/// `submit`.
pub async fn submit(conn: &Conn, args: &SubmitArgs, output: OutputFormat) -> Result<()> {
    let mut req = build_submit(args)?;
    if let Some(dir) = &args.job.upload {
        let blob =
            crate::upload::upload_workdir(conn, dir, crate::upload::max_upload_bytes(&args.job))
                .await?;
        req.spec
            .as_mut()
            .context("a built request has a spec")?
            .workdir = Some(blob);
    }
    let client = Client::new(conn)?;
    let resp = client.submit_job(req.clone()).await?;
    print_warnings(&resp.warnings);
    match output {
        OutputFormat::Json | OutputFormat::Yaml if !args.wait => print_data(output, &resp)?,
        OutputFormat::Json | OutputFormat::Yaml => {}
        OutputFormat::Table | OutputFormat::Wide => {
            println!("{}", resp.job_id);
            if !resp.created {
                eprintln!(
                    "(request id {} had already created {}; no new job)",
                    req.request_id, resp.job_id
                );
            }
        }
    }
    if args.wait {
        return wait_for(
            &client,
            &resp.job_id,
            args.wait_timeout_s.map(Duration::from_secs),
            output,
        )
        .await;
    }
    Ok(())
}

/// What `submit --wait` shows while the job runs: on a terminal, a live line (indicatif)
/// with the slowest rank's step, the restarts and the pending reason; otherwise a line
/// on stderr whenever that text changes, at most every [`WAIT_LINE_EVERY`].
struct WaitProgress {
    job_id: String,
    bar: Option<indicatif::ProgressBar>,
    last_line: String,
    last_printed: Option<Instant>,
}

/// Least time between two progress lines of `submit --wait` when stderr is not a
/// terminal.
const WAIT_LINE_EVERY: Duration = Duration::from_secs(10);

impl WaitProgress {
    fn new(job_id: &str) -> Self {
        let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
            let bar = indicatif::ProgressBar::new_spinner();
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self {
            job_id: job_id.to_string(),
            bar,
            last_line: String::new(),
            last_printed: None,
        }
    }

    /// A line of its own (above the live line on a terminal).
    fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    fn update(&mut self, job: &cumulus_api::Job) {
        let text = progress_text(job);
        if let Some(bar) = &self.bar {
            bar.set_message(text);
            return;
        }
        let due = self
            .last_printed
            .is_none_or(|t| t.elapsed() >= WAIT_LINE_EVERY);
        if text != self.last_line && due && !text.is_empty() {
            eprintln!("{}: {text}", self.job_id);
            self.last_line = text;
            self.last_printed = Some(Instant::now());
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// One line on a job's progress: its state, the slowest rank's step of the total (the
/// job is as far as its slowest rank), the restarts used of the budget, and why it is
/// pending.
fn progress_text(job: &cumulus_api::Job) -> String {
    let mut parts = vec![job.state.clone()];
    let slowest = job
        .ranks
        .iter()
        .filter(|r| r.total_steps > 0)
        .min_by_key(|r| r.step);
    if let Some(r) = slowest {
        parts.push(format!(
            "step {}/{} ({:.0}%)",
            r.step,
            r.total_steps,
            100.0 * r.step as f64 / r.total_steps as f64
        ));
    }
    if job.restarts_used > 0 {
        parts.push(format!("{} restarts", job.restarts_used));
    }
    if !job.pending_reason.is_empty() {
        parts.push(job.pending_reason.clone());
    }
    cumulus_api::text::escape_control(&parts.join(", ")).into_owned()
}

/// Prints a finished job's status (`-o json|yaml`: the job) and says how it ended: `Ok`
/// only when it succeeded, else an error with its state and cause.
pub fn report_finished(
    job_id: &str,
    resp: &cumulus_api::JobResponse,
    output: OutputFormat,
) -> Result<()> {
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, resp)?,
        OutputFormat::Table | OutputFormat::Wide => {
            print_text(&render::job_status(resp, render::now_ms()))?
        }
    }
    let Some(job) = &resp.job else {
        bail!("the coordinator returned no job");
    };
    if job.job_state() == Ok(cumulus_api::JobState::Succeeded) {
        return Ok(());
    }
    let cause = if job.failure_cause.is_empty() {
        String::new()
    } else {
        format!(": {}", job.failure_cause)
    };
    bail!("job {job_id} {}{cause}", job.state)
}

/// Polls a job until it finishes; `Ok` only when it succeeded.
pub async fn wait_for(
    client: &Client,
    job_id: &str,
    timeout: Option<Duration>,
    output: OutputFormat,
) -> Result<()> {
    let start = Instant::now();
    let mut last_state = String::new();
    let mut progress = WaitProgress::new(job_id);
    loop {
        let resp = client.get_job(job_id, true).await?;
        let job = resp
            .job
            .clone()
            .context("the coordinator returned no job")?;
        if job.state != last_state {
            progress.println(&format!("{job_id}: {}", job.state));
            last_state = job.state.clone();
        }
        progress.update(&job);
        if is_finished(&job.state) {
            progress.finish();
            return report_finished(job_id, &resp, output);
        }
        if let Some(t) = timeout
            && start.elapsed() >= t
        {
            bail!(
                "gave up waiting for {job_id} after {} s (it is still {}; see `cumulusctl status {job_id}`)",
                t.as_secs(),
                job.state
            );
        }
        tokio::time::sleep(WAIT_POLL).await;
    }
}

/// `describe JOB`: the status and the job's events (`-o json`: the job as `status`).
///
/// # Errors
/// When no coordinator answers or the job does not exist.
pub async fn describe(conn: &Conn, job_id: &str, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.get_job(job_id, true).await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => {
            let now_ms = render::now_ms();
            let mut text = render::job_status(&resp, now_ms);
            if let Some(job) = &resp.job {
                text.push('\n');
                text.push_str(&render::events_table(job));
            }
            print_text(&text)
        }
    }
}

/// `status JOB`.
pub async fn status(conn: &Conn, job_id: &str, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.get_job(job_id, true).await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => {
            print_text(&render::job_status(&resp, render::now_ms()))
        }
    }
}

/// `list`.
pub async fn list(conn: &Conn, filters: &ListArgs, output: OutputFormat) -> Result<()> {
    let mut resp = Client::new(conn)?.list_jobs(true).await?;
    resp.jobs.retain(|j| {
        (filters.state.is_empty() || j.job_state().is_ok_and(|s| filters.state.contains(&s)))
            && filters.name.as_ref().is_none_or(|n| {
                j.spec
                    .as_ref()
                    .is_some_and(|spec| spec.name.contains(n.as_str()))
            })
    });
    // Ids sort by submission (job-NNNNNN): the newest are last.
    resp.jobs.sort_by(|a, b| a.id.cmp(&b.id));
    if let Some(limit) = filters.limit {
        let drop = resp.jobs.len().saturating_sub(limit as usize);
        resp.jobs.drain(..drop);
    }
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table => print_text(&render::jobs_table(&resp, render::now_ms())),
        OutputFormat::Wide => print_text(&render::jobs_table_wide(&resp, render::now_ms())),
    }
}

/// `cancel JOB`.
pub async fn cancel(conn: &Conn, job_id: &str, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.cancel_job(job_id).await?;
    print_job_state(job_id, &resp, output)
}

/// `pause JOB`.
pub async fn pause(conn: &Conn, job_id: &str, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.pause_job(job_id).await?;
    print_job_state(job_id, &resp, output)
}

/// `resume JOB`.
pub async fn resume(conn: &Conn, job_id: &str, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.resume_job(job_id).await?;
    print_job_state(job_id, &resp, output)
}

/// `delete JOB [--checkpoints]`.
pub async fn delete(
    conn: &Conn,
    args: &crate::args::DeleteArgs,
    output: OutputFormat,
) -> Result<()> {
    let resp = Client::new(conn)?
        .delete_job(&args.job, args.checkpoints)
        .await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => {
            let what = match (args.checkpoints, resp.checkpoints_deleted) {
                (false, _) => "deleted",
                (true, true) => "deleted with its checkpoints",
                (true, false) => "deleted (it had no checkpoints)",
            };
            println!("{}: {what}", args.job);
            Ok(())
        }
    }
}

/// `purge --older-than D [--state S] [--checkpoints]`.
pub async fn purge(conn: &Conn, args: &crate::args::PurgeArgs, output: OutputFormat) -> Result<()> {
    if let Some(state) = args.state
        && !state.is_terminal()
    {
        anyhow::bail!("only finished jobs are purged: --state {state} is not a finished state");
    }
    let resp = Client::new(conn)?
        .purge_jobs(cumulus_api::PurgeJobsRequest {
            state: args.state.map(|s| s.to_string()).unwrap_or_default(),
            older_than_ms: args.older_than,
            checkpoints: args.checkpoints,
        })
        .await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => {
            for id in &resp.job_ids {
                println!("{id}: deleted");
            }
            println!("{} job(s) deleted", resp.job_ids.len());
            Ok(())
        }
    }
}

/// `JOB: state` (with a stop in flight: `running, pausing`), or the JSON answer.
fn print_job_state(
    job_id: &str,
    resp: &cumulus_api::JobResponse,
    output: OutputFormat,
) -> Result<()> {
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => {
            let state = resp
                .job
                .as_ref()
                .map_or_else(|| "unknown".to_string(), render::job_state_text);
            println!("{job_id}: {state}");
            Ok(())
        }
    }
}

/// `ckpt ls JOB`.
pub async fn ckpt_ls(conn: &Conn, job_id: &str, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.list_checkpoints(job_id).await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => print_text(&render::checkpoints_table(&resp)),
    }
}

/// The cluster status, from the leader when the first answer names one: only the
/// leader knows the workers' heartbeats, resources and GPU readings. Falls back to the
/// first answer when the leader does not answer at once (one try).
async fn leader_cluster_status(conn: &Conn) -> Result<cumulus_api::ClusterStatusResponse> {
    let first = Client::new(conn)?.cluster_status().await?;
    let Some(leader) = first.leader_id.filter(|l| *l != first.node_id) else {
        return Ok(first);
    };
    let Some(addr) = first
        .members
        .iter()
        .find(|m| m.node_id == leader)
        .map(|m| m.grpc_addr.clone())
    else {
        return Ok(first);
    };
    let at_leader = Conn {
        grpc: vec![addr],
        ..conn.clone()
    };
    // One quick try: the named leader may be the one that just died (a follower learns
    // of an election only after it), and the first answer is good enough then.
    let quick = crate::client::RetryPolicy::single_pass(1);
    match Client::with_policy(&at_leader, quick)?
        .cluster_status()
        .await
    {
        Ok(resp) if resp.leader_id == Some(resp.node_id) => Ok(resp),
        _ => Ok(first),
    }
}

/// `cluster status`.
pub async fn cluster_status(conn: &Conn, output: OutputFormat) -> Result<()> {
    let resp = leader_cluster_status(conn).await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => print_text(&render::cluster_status(&resp)),
    }
}

/// `token create`: creates the user and prints (or writes) their token.
///
/// With `--out` the file is created (exclusively, mode `0600`) before the user: an
/// existing file or an unwritable path refuses the command with no user created, and a
/// refusal by the cluster removes the empty file again. Only a failure to write the token
/// into the created file leaves a user behind: the error then shows the token.
///
/// # Errors
/// Refused by the cluster (not an administrator, a bad or taken name), or the file
/// cannot be created or written.
pub async fn token_create(conn: &Conn, args: &TokenCreateArgs, output: OutputFormat) -> Result<()> {
    let mut file = match &args.out {
        Some(path) => Some(TokenFile::create(path)?),
        None => None,
    };
    let created = match Client::new(conn) {
        Ok(client) => {
            client
                .create_user(cumulus_api::CreateUserRequest {
                    name: args.name.clone(),
                    role: args.role.to_string(),
                })
                .await
        }
        Err(e) => Err(e),
    };
    let resp = match created {
        Ok(resp) => resp,
        Err(e) => {
            if let Some(file) = file.take() {
                file.remove();
            }
            return Err(e.into());
        }
    };
    if let Some(file) = file {
        let path = file.path.clone();
        file.write_token(&resp.token).map_err(|e| {
            anyhow::anyhow!(
                "user {} (role {}) was created, but its token could not be written to {}:                  {e:#}. Its token, shown once:\n{}",
                resp.name,
                resp.role,
                path.display(),
                resp.token
            )
        })?;
        return print_text(&format!(
            "user {} (role {}) created; token written to {}\n",
            resp.name,
            resp.role,
            path.display()
        ));
    }
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => print_text(&format!(
            "user {} (role {}) created. Its token, shown once:\n{}\n",
            resp.name, resp.role, resp.token
        )),
    }
}

/// The `--out` file of `token create`, created empty before the user exists.
struct TokenFile {
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl TokenFile {
    /// Creates `path` exclusively (never an existing file, nor through a symbolic link)
    /// with mode `0600`.
    fn create(path: &Path) -> Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .with_context(|| {
                format!(
                    "creating the token file {} (no user was created)",
                    path.display()
                )
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Writes `token` and a newline, and syncs the file; on failure the file is removed.
    fn write_token(mut self, token: &str) -> Result<()> {
        let written = self
            .file
            .write_all(format!("{token}\n").as_bytes())
            .and_then(|()| self.file.sync_all());
        if let Err(e) = written {
            self.remove();
            return Err(e).context("writing the token file");
        }
        Ok(())
    }

    /// Removes the file this command created (best effort: it holds nothing yet).
    fn remove(self) {
        drop(self.file);
        if let Err(e) = std::fs::remove_file(&self.path) {
            eprintln!(
                "warning: cannot remove the empty token file {}: {e}",
                self.path.display()
            );
        }
    }
}

/// `token ls`.
///
/// # Errors
/// Refused by the cluster (not an administrator) or no coordinator answers.
pub async fn token_ls(conn: &Conn, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.list_users().await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => {
            print_text(&render::users_table(&resp, render::now_ms()))
        }
    }
}

/// `token revoke NAME`.
///
/// # Errors
/// Refused by the cluster (not an administrator, no such user).
pub async fn token_revoke(conn: &Conn, name: &str, output: OutputFormat) -> Result<()> {
    Client::new(conn)?.revoke_user(name).await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => {
            print_data(output, &serde_json::json!({ "revoked": name }))
        }
        OutputFormat::Table | OutputFormat::Wide => print_text(&format!(
            "user {} revoked\n",
            cumulus_api::text::escape_control(name)
        )),
    }
}

/// `whoami`.
///
/// # Errors
/// When no coordinator answers or the token is refused.
pub async fn whoami(conn: &Conn, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.who_am_i().await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
        OutputFormat::Table | OutputFormat::Wide => {
            print_text(&format!("{} (role {})\n", resp.name, resp.role))
        }
    }
}

/// `workers`: the workers and their GPUs (`-o json`: the list of workers).
///
/// # Errors
/// When no coordinator answers.
pub async fn workers(conn: &Conn, output: OutputFormat) -> Result<()> {
    let resp = leader_cluster_status(conn).await?;
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp.workers),
        OutputFormat::Table | OutputFormat::Wide => print_text(&render::workers_text(&resp)),
    }
}

/// A new member's addresses, as `cluster add-learner` takes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberAddr {
    /// Its gRPC address (clients and workers).
    pub grpc: String,
    /// Its HTTP address.
    pub http: String,
    /// Its Raft address (`--raft-listen`); empty when Raft shares the gRPC port.
    pub raft: String,
}

/// Splits `GRPC_HOST:PORT@HTTP_HOST:PORT[@RAFT_HOST:PORT]` into its addresses (the
/// third for a coordinator started with `--raft-listen`).
///
/// # Errors
/// When the gRPC or HTTP address is missing, or any address has no port.
pub fn parse_member_addr(addr: &str) -> Result<MemberAddr> {
    let usage = || {
        format!(
            "{addr:?} must look like GRPC_HOST:PORT@HTTP_HOST:PORT, or \
             GRPC_HOST:PORT@HTTP_HOST:PORT@RAFT_HOST:PORT for a coordinator started with \
             --raft-listen"
        )
    };
    let parts: Vec<&str> = addr.split('@').collect();
    let (grpc, http, raft) = match parts[..] {
        [grpc, http] => (grpc, http, None),
        [grpc, http, raft] => (grpc, http, Some(raft)),
        _ => bail!(usage()),
    };
    for a in [Some(grpc), Some(http), raft].into_iter().flatten() {
        let ok = a
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            bail!(usage());
        }
    }
    Ok(MemberAddr {
        grpc: grpc.to_string(),
        http: http.to_string(),
        raft: raft.unwrap_or_default().to_string(),
    })
}

fn print_membership(resp: &cumulus_api::ClusterStatusResponse, output: OutputFormat) -> Result<()> {
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, resp),
        OutputFormat::Table | OutputFormat::Wide => print_text(&render::cluster_status(resp)),
    }
}

/// `cluster add-learner ID GRPC@HTTP[@RAFT]`.
pub async fn add_learner(conn: &Conn, id: u64, addr: &str, output: OutputFormat) -> Result<()> {
    let addr = parse_member_addr(addr)?;
    let resp = Client::new(conn)?
        .add_learner(cumulus_api::AddLearnerRequest {
            node_id: id,
            grpc_addr: addr.grpc,
            http_addr: addr.http,
            raft_addr: addr.raft,
        })
        .await?;
    print_membership(&resp, output)
}

/// `cluster promote ID`.
pub async fn promote(conn: &Conn, id: u64, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.promote_member(id).await?;
    print_membership(&resp, output)
}

/// `cluster remove ID`.
pub async fn remove(conn: &Conn, id: u64, output: OutputFormat) -> Result<()> {
    let resp = Client::new(conn)?.remove_member(id).await?;
    print_membership(&resp, output)
}

/// `logs JOB [-f] [--rank R]`: prints `[rank R a A] line` (or one JSON object per line).
/// On a terminal, unless `raw`, a line's control and bidirectional characters are shown
/// as escapes ([`crate::logs::escape_for_terminal`]; in JSON, as JSON escapes of the same
/// value): a rank's output cannot clear the screen, set the window title or reorder what
/// the reader sees. Into a pipe or a file the lines go as they came, as with `raw`.
pub async fn logs(
    conn: &Conn,
    job_id: &str,
    (rank, tail, since_ms): (Option<u32>, Option<u32>, Option<u64>),
    (follow, raw): (bool, bool),
    output: OutputFormat,
) -> Result<()> {
    let mut req = LogRequest {
        job_id: job_id.to_string(),
        rank,
        follow,
        since_ms,
    };
    let mut state = CursorState::default();
    // With --tail: read what there is so far, keep the last N lines of each rank, print
    // them, then (with -f) follow on from the same cursor.
    let mut backlog: Vec<LogLine> = Vec::new();
    if let Some(n) = tail {
        req.follow = false;
        let mut last: std::collections::BTreeMap<u32, std::collections::VecDeque<LogLine>> =
            std::collections::BTreeMap::new();
        follow_logs(conn, &req, &mut state, |l| {
            let lines = last.entry(l.rank).or_default();
            if lines.len() == n as usize {
                lines.pop_front();
            }
            lines.push_back(l.clone());
        })
        .await?;
        backlog = last.into_values().flatten().collect();
        req.follow = follow;
    }
    let escape = !raw && std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut out = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let mut print = |l: &LogLine| {
        if write_err.is_some() {
            return;
        }
        let r = match output {
            OutputFormat::Table | OutputFormat::Wide if escape => {
                writeln!(out, "{}", l.human_escaped())
            }
            OutputFormat::Table | OutputFormat::Wide => writeln!(out, "{}", l.human()),
            OutputFormat::Json | OutputFormat::Yaml => serde_json::to_string(l)
                .map_err(std::io::Error::other)
                .and_then(|s| {
                    if escape {
                        writeln!(out, "{}", crate::logs::escape_json_for_terminal(&s))
                    } else {
                        writeln!(out, "{s}")
                    }
                }),
        };
        if let Err(e) = r.and_then(|_| out.flush()) {
            write_err = Some(e);
        }
    };
    backlog.iter().for_each(&mut print);
    let result = if tail.is_some() && !follow {
        Ok(())
    } else {
        follow_logs(conn, &req, &mut state, &mut print).await
    };
    if let Some(e) = write_err {
        // A closed pipe (`| head`) is a normal way to stop reading.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(e).context("writing to stdout");
    }
    result?;
    Ok(())
}

/// Whether `p` names an existing directory (for friendlier submit warnings).
pub fn warn_missing_dir(flag: &str, p: &Option<std::path::PathBuf>) {
    if let Some(p) = p
        && !Path::new(p).is_dir()
    {
        eprintln!(
            "warning: {flag} {} is not a directory on this machine: the leader checks it at \
             submit (it lists a dataset and creates a checkpoint dir), so it must exist on the \
             coordinators' hosts, and on the workers",
            p.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{Cli, Command};
    use clap::Parser;

    fn submit_args(extra: &[&str]) -> SubmitArgs {
        let mut argv = vec!["cumulusctl", "submit", "--world-size", "2"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).expect("parse").command {
            Command::Submit(s) => s,
            _ => panic!("not submit"),
        }
    }

    #[test]
    fn member_addresses_take_an_optional_raft_address() {
        let a = parse_member_addr("c4:7000@c4:8000").expect("two addresses");
        assert_eq!(
            (a.grpc.as_str(), a.http.as_str(), a.raft.as_str()),
            ("c4:7000", "c4:8000", "")
        );
        let a = parse_member_addr("c4:7000@c4:8000@c4:7100").expect("three addresses");
        assert_eq!(a.raft, "c4:7100");
        for bad in [
            "c4:7000",
            "c4:7000@c4:8000@",
            "c4:7000@c4:8000@c4",
            "a:1@b:2@c:3@d:4",
            "c4:7000@:8000",
        ] {
            let err = parse_member_addr(bad).expect_err(bad).to_string();
            assert!(err.contains("RAFT_HOST:PORT"), "{bad}: {err}");
        }
    }

    #[test]
    fn submit_paths_are_normalized_and_names_printable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::create_dir_all(base.join("a/b")).expect("mkdir");
        let dotted = format!("{}/a/b/../new/", base.display());
        let a = submit_args(&["--ckpt-dir", &dotted, "--", "python", "t.py"]);
        let spec = build_submit(&a).expect("build").spec.expect("spec");
        assert_eq!(spec.ckpt_dir, base.join("a/new").to_str().expect("utf8"));
        cumulus_api::paths::check_job_path(
            cumulus_api::paths::PathKind::Checkpoint,
            &spec.ckpt_dir,
        )
        .expect("what the coordinator accepts");
        let a = submit_args(&["--name", "x\u{1b}[2J", "--", "python", "t.py"]);
        let err = build_submit(&a).expect_err("control character in the name");
        assert!(err.to_string().contains("\\u{1b}[2J"), "{err}");
    }

    #[test]
    fn submit_request_has_absolute_paths_policy_and_env() {
        let a = submit_args(&[
            "--dataset",
            "data/shards",
            "--ckpt-dir",
            "/abs/ckpt",
            "--workdir",
            ".",
            "--max-restarts",
            "5",
            "--restart-scope",
            "group",
            "--backoff-initial-ms",
            "1000",
            "--progress-timeout-s",
            "30",
            "--env",
            "A=1=2",
            "--name",
            "n",
            "--",
            "python",
            "t.py",
        ]);
        let req = build_submit(&a).expect("build");
        let spec = req.spec.expect("spec");
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(
            spec.dataset,
            cwd.join("data/shards").to_str().expect("utf8")
        );
        assert_eq!(spec.ckpt_dir, "/abs/ckpt");
        assert_eq!(spec.working_dir, cwd.to_str().expect("utf8"), "normalized");
        assert_eq!(spec.env.get("A").map(String::as_str), Some("1=2"));
        assert_eq!(spec.progress_timeout_ms, 30_000);
        let r = spec.restart.expect("restart");
        assert_eq!(r.scope.as_deref(), Some("group"));
        assert_eq!(r.max_restarts, Some(5));
        assert_eq!(r.backoff_initial_ms, Some(1000));
        assert_eq!(r.backoff_max_ms, None);
        assert_eq!(spec.command, vec!["python", "t.py"]);
        assert_eq!(req.request_id.len(), 32);
    }

    #[test]
    fn startup_timeout_is_sent_in_ms_and_bounded() {
        let a = submit_args(&["--startup-timeout-s", "90", "--", "true"]);
        let spec = build_submit(&a).expect("build").spec.expect("spec");
        assert_eq!(spec.startup_timeout_ms, 90_000);
        let spec = build_submit(&submit_args(&["--", "true"]))
            .expect("build")
            .spec
            .expect("spec");
        assert_eq!(spec.startup_timeout_ms, 0, "absent: the cluster's default");
        for bad in ["0", "604801"] {
            let argv = [
                "cumulusctl",
                "submit",
                "--startup-timeout-s",
                bad,
                "--",
                "true",
            ];
            let err = Cli::try_parse_from(argv).expect_err(bad).to_string();
            assert!(err.contains("--startup-timeout-s"), "{err}");
        }
    }

    #[test]
    fn request_id_is_kept_or_generated_once_per_build() {
        let a = submit_args(&["--request-id", "my-key", "--", "true"]);
        assert_eq!(build_submit(&a).expect("build").request_id, "my-key");
        let b = submit_args(&["--", "true"]);
        assert_ne!(
            build_submit(&b).expect("b1").request_id,
            build_submit(&b).expect("b2").request_id
        );
        let long = "x".repeat(129);
        let c = submit_args(&["--request-id", &long, "--", "true"]);
        assert!(build_submit(&c).is_err());
    }

    #[test]
    fn bad_env_and_backoff_are_rejected() {
        assert!(build_submit(&submit_args(&["--env", "NOEQUALS", "--", "true"])).is_err());
        assert!(build_submit(&submit_args(&["--env", "=v", "--", "true"])).is_err());
        assert!(
            build_submit(&submit_args(&[
                "--env", "A=1", "--env", "A=2", "--", "true"
            ]))
            .is_err()
        );
        assert!(
            build_submit(&submit_args(&[
                "--backoff-initial-ms",
                "10",
                "--backoff-max-ms",
                "5",
                "--",
                "true"
            ]))
            .is_err()
        );
        assert!(
            build_submit(&submit_args(&[
                "--progress-timeout-s",
                &u64::MAX.to_string(),
                "--",
                "true"
            ]))
            .is_err()
        );
    }

    fn env_of(extra: &[&str]) -> Result<Option<EnvironmentSpec>> {
        let mut argv = extra.to_vec();
        argv.extend_from_slice(&["--", "python", "t.py"]);
        build_submit(&submit_args(&argv)).map(|r| r.spec.expect("spec").environment)
    }

    #[test]
    fn environment_flags_make_one_checked_environment() {
        assert_eq!(env_of(&[]).expect("none"), None);
        let e = env_of(&[
            "--pip",
            "numpy",
            "--pip",
            " torch==2.3.1 ",
            "--python",
            "3.11",
        ])
        .expect("valid")
        .expect("an environment");
        assert_eq!(e.requirements, "numpy\ntorch==2.3.1\n");
        assert_eq!(e.python, "3.11");
        assert!(e.index_url.is_empty() && e.find_links.is_empty() && !e.no_index);

        let dir = tempfile::tempdir().expect("tempdir");
        let req = dir.path().join("requirements.txt");
        std::fs::write(&req, "pandas>=2\n# a comment\nrequests").expect("write");
        let wheels = dir.path().join("wheels");
        let e = env_of(&[
            "--requirements",
            req.to_str().expect("utf8"),
            "--pip",
            "tqdm",
            "--no-index",
            "--find-links",
            wheels.to_str().expect("utf8"),
            "--find-links",
            "https://example.org/wheels/",
        ])
        .expect("valid")
        .expect("an environment");
        assert_eq!(e.requirements, "pandas>=2\n# a comment\nrequests\ntqdm\n");
        assert_eq!(
            e.find_links,
            vec![
                wheels.to_str().expect("utf8"),
                "https://example.org/wheels/"
            ]
        );
        assert!(e.no_index);
        assert_eq!(e.python, "", "the worker's python3");

        // A bare environment of another Python; relative find-links made absolute.
        let e = env_of(&["--python", "3.12.1", "--pip", "x", "--find-links", "w"])
            .expect("valid")
            .expect("an environment");
        assert_eq!(
            (e.python.as_str(), e.requirements.as_str()),
            ("3.12.1", "x\n")
        );
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(e.find_links, vec![cwd.join("w").to_str().expect("utf8")]);
    }

    #[test]
    fn environment_flags_are_refused_before_sending() {
        let parse = |argv: &[&str]| {
            let mut full = vec!["cumulusctl", "submit", "--world-size", "1"];
            full.extend_from_slice(argv);
            full.extend_from_slice(&["--", "true"]);
            Cli::try_parse_from(full).map(|_| ())
        };
        for bad in [
            ["--python", "3"],
            ["--python", "2.7"],
            ["--python", "python3.11"],
        ] {
            assert!(parse(&bad).is_err(), "{bad:?}");
        }
        assert!(
            parse(&["--no-index", "--index-url", "https://x"]).is_err(),
            "conflict"
        );
        assert!(
            parse(&["--upload", ".", "--workdir", "/w"]).is_err(),
            "conflict"
        );
        assert!(
            parse(&["--max-upload-mib", "10"]).is_err(),
            "requires --upload"
        );
        assert!(
            parse(&["--upload", ".", "--max-upload-mib", "2049"]).is_err(),
            "over 2 GiB"
        );
        assert!(parse(&["--upload", ".", "--max-upload-mib", "2048"]).is_ok());

        let err = env_of(&["--index-url", "https://pypi.example/simple"]).expect_err("no packages");
        assert!(err.to_string().contains("name packages too"), "{err}");
        let err = env_of(&["--pip=-e", "--pip", "x"]).expect_err("an option");
        assert!(err.to_string().contains("--requirements file"), "{err}");
        let err = env_of(&["--pip", "a\nb"]).expect_err("two lines");
        assert!(err.to_string().contains("one requirement"), "{err}");
        let err = env_of(&["--pip", "x", "--index-url", "https://a b"]).expect_err("space");
        assert!(err.to_string().contains("--index-url"), "{err}");
        let many: Vec<String> = (0..=MAX_FIND_LINKS)
            .map(|i| format!("https://h/{i}"))
            .collect();
        let mut argv = vec!["--pip", "x"];
        for l in &many {
            argv.extend_from_slice(&["--find-links", l]);
        }
        let err = env_of(&argv).expect_err("too many");
        assert!(err.to_string().contains("limit of 16"), "{err}");

        let dir = tempfile::tempdir().expect("tempdir");
        let big = dir.path().join("big.txt");
        std::fs::write(&big, "x\n".repeat(MAX_REQUIREMENTS_BYTES)).expect("write");
        let err = env_of(&["--requirements", big.to_str().expect("utf8")]).expect_err("big");
        assert!(err.to_string().contains("larger than the limit"), "{err}");
        let binary = dir.path().join("bin.txt");
        std::fs::write(&binary, b"\xff\xfe").expect("write");
        let err = env_of(&["--requirements", binary.to_str().expect("utf8")]).expect_err("binary");
        assert!(err.to_string().contains("not UTF-8"), "{err}");
        let err = env_of(&["--requirements", "/nonexistent/req.txt"]).expect_err("missing");
        assert!(err.to_string().contains("/nonexistent/req.txt"), "{err}");
        // A requirements file filled up to the limit by --pip.
        let near = dir.path().join("near.txt");
        std::fs::write(&near, "x".repeat(MAX_REQUIREMENTS_BYTES - 2)).expect("write");
        let err = env_of(&["--requirements", near.to_str().expect("utf8"), "--pip", "y"])
            .expect_err("over with --pip");
        assert!(err.to_string().contains("more than the limit"), "{err}");
    }

    #[test]
    fn upload_sets_no_workdir_path_and_keeps_its_size_limit() {
        let a = submit_args(&["--upload", ".", "--max-upload-mib", "3", "--", "true"]);
        let spec = build_submit(&a).expect("build").spec.expect("spec");
        assert_eq!(
            spec.working_dir, "",
            "the blob, set after upload, is the workdir"
        );
        assert_eq!(spec.workdir, None);
        assert_eq!(crate::upload::max_upload_bytes(&a.job), 3 * 1024 * 1024);
        let a = submit_args(&["--", "true"]);
        assert_eq!(
            crate::upload::max_upload_bytes(&a.job),
            cumulus_api::blobs::DEFAULT_MAX_WORKDIR_BYTES
        );
    }

    #[test]
    fn finished_states() {
        assert!(is_finished("succeeded") && is_finished("failed") && is_finished("cancelled"));
        assert!(!is_finished("running") && !is_finished("pending"));
    }
}
