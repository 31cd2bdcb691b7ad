//! Scenario `write_path` (issue 3, measurement 1): the replicated write path of Cumulus
//! against etcd 3.4.
//!
//! What is compared: a 3-coordinator Cumulus cluster (no workers) receives `SubmitJob`
//! calls, and a 3-member etcd cluster receives `Put`s, both on 127.0.0.1 of this machine.
//! For 1, 16 and 64 concurrent clients, each client issues writes back-to-back (the next
//! one when the previous is acknowledged) for a fixed time after a warm-up; we report
//! throughput (acknowledged writes per second) and the p50/p99 latency of one write, and
//! the ratio of throughputs Cumulus/etcd (target ≥ 1.0 at every concurrency).
//!
//! Why it is fair:
//! - Same payload: one realistic `SubmitJobRequest` (a 4-rank trainer job: absolute
//!   command paths, dataset and checkpoint dirs, env entries, restart policy). Cumulus gets
//!   it as protobuf over gRPC; etcd gets a `Put` of key `/cumulus/jobs/<request id>` whose
//!   value is the same request as JSON (the JSON form is the larger of the two, so etcd
//!   carries at least as many bytes per write; its size is reported as a row). Every write
//!   has a unique request id of the same width on both systems. Cumulus does more per write
//!   than etcd: it validates the spec, lists the dataset directory and replicates the shard
//!   list inside the Raft entry.
//! - Same durability: a write is acknowledged by both only once its log entry is fsynced on
//!   a quorum (Cumulus: the Raft log store fdatasyncs every append before acknowledging;
//!   etcd: default settings, the WAL is fsynced on every member before it votes/commits).
//! - Same concurrency and the same client stack: tonic 0.14 for both (the etcd client is
//!   `etcd-client` 0.21 on tonic 0.14), one HTTP/2 connection per 16 clients for both
//!   systems (1, 1 and 4 connections at 1, 16 and 64 clients), clients sharing a
//!   connection the same way.
//! - Same target node: Cumulus's writes go to the Raft leader (followers refuse writes);
//!   etcd's writes go to the etcd leader as reported by its maintenance `Status` API, so
//!   neither pays a forwarding hop.
//! - Same starting point: for every concurrency a fresh Cumulus cluster and a fresh etcd
//!   cluster are started (empty state), both run on this machine at the same time, and the
//!   systems are measured alternately in [`ROUNDS`] rounds (Cumulus, etcd, Cumulus, …;
//!   each round a fifth of the measured time), so a change of background load on the
//!   shared host falls on both, not on whichever system ran in that stretch; the idle
//!   cluster costs only its Raft heartbeats. Throughput is all acknowledged writes of a
//!   system over the sum of its rounds' windows.
//!
//! etcd is looked up on `PATH` (then `/usr/bin/etcd`); its members are SIGKILLed by the
//! PIDs started here when the scenario ends, also on error (a guard with `Drop`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use cumulus_api::v1;
use cumulus_e2e::{Client, Cluster, ClusterOpts, bin_dir, free_port};

use crate::Ctx;
use crate::report::{Row, ms, percentile};

/// Scenario name in every row.
const SCENARIO: &str = "write_path";
/// Concurrent clients measured, in order, unless `--write-clients` says otherwise.
pub(crate) const CONCURRENCY: [usize; 3] = [1, 16, 64];
/// Clients sharing one gRPC connection (both systems).
pub(crate) const CLIENTS_PER_CHANNEL: usize = 16;
/// Measured windows per system at each concurrency, alternating between the systems.
const ROUNDS: u64 = 5;
/// Warm-up before every round after the first (the first has the full warm-up): the
/// clients restart, the connections stay.
const ROUND_WARMUP: Duration = Duration::from_millis(200);
/// Upper bound on writes of one client in one measurement (bounds memory for latencies).
const MAX_WRITES_PER_CLIENT: u64 = 200_000;
/// Timeout of one write, and of each connection attempt.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a cluster may take to become ready.
const READY_DEADLINE: Duration = Duration::from_secs(60);
/// Pause after a failed write before the next (so a failing system is not spun on).
const ERROR_PAUSE: Duration = Duration::from_millis(20);
/// Shard files in the job's dataset directory (the trainer example uses 8).
const DATASET_SHARDS: usize = 8;
/// Width of every request id, so every payload has the same size.
const REQUEST_ID_LEN: usize = 24;
/// etcd key prefix of the writes.
const ETCD_KEY_PREFIX: &str = "/cumulus/jobs/";

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let measure = ctx.pick(Duration::from_secs(10), Duration::from_secs(1));
    let warmup = ctx.pick(Duration::from_secs(2), Duration::from_millis(300));
    let dir = ctx.work_dir.join("write_path");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    let etcd_bin = find_etcd()?;
    let template = Arc::new(Template::new(&dir)?);
    let mut rows = vec![Row::new(
        SCENARIO,
        "payload: SubmitJobRequest as JSON (etcd value)",
        template.json.len() as f64,
        "bytes",
        1,
    )];

    for &c in &ctx.write_clients {
        // Fresh clusters for every concurrency: each measurement starts from an empty state,
        // independent of how many writes the previous ones made.
        let cluster = Cluster::start(ClusterOpts {
            coordinators: 3,
            workers: 0,
            ..ClusterOpts::default()
        })
        .await
        .context("starting the 3-node Cumulus cluster")?;
        let etcd = EtcdCluster::start(&etcd_bin, &dir.join(format!("etcd-c{c}")))
            .context("starting the 3-member etcd cluster")?;
        let etcd_leader = etcd.wait_ready_and_find_leader().await?;
        let channels = c.div_ceil(CLIENTS_PER_CHANNEL);

        let mut cumulus_clients = Vec::with_capacity(channels);
        for _ in 0..channels {
            cumulus_clients.push(
                cluster
                    .leader_client()
                    .await
                    .context("connecting to the Cumulus leader")?,
            );
        }
        let mut etcd_clients = Vec::with_capacity(channels);
        for _ in 0..channels {
            etcd_clients.push(
                connect_etcd(std::slice::from_ref(&etcd_leader), &etcd.tls)
                    .await?
                    .kv_client(),
            );
        }
        let rounds = ctx.pick(ROUNDS, 1);
        // Client `task` of `system` shares its connection with 15 others.
        let target = |system: &str, task: usize| {
            let channel = task / CLIENTS_PER_CHANNEL;
            if system == "cumulus" {
                Target::Cumulus(cumulus_clients[channel].clone())
            } else {
                Target::Etcd(etcd_clients[channel].clone())
            }
        };
        let mut cumulus = Measurement::default();
        let mut etcd_run = Measurement::default();
        for round in 0..rounds {
            let warmup = if round == 0 { warmup } else { ROUND_WARMUP };
            let window = measure / rounds as u32;
            for (system, total) in [("cumulus", &mut cumulus), ("etcd", &mut etcd_run)] {
                total.add(
                    measure_system(
                        c,
                        round,
                        warmup,
                        window,
                        |task| target(system, task),
                        &template,
                        system,
                    )
                    .await?,
                );
            }
        }

        for (system, m) in [("cumulus", &cumulus), ("etcd", &etcd_run)] {
            let n = m.latencies_ms.len();
            rows.push(Row::new(
                SCENARIO,
                &format!("{system} throughput c={c}"),
                m.throughput(),
                "ops/s",
                n,
            ));
            rows.push(Row::new(
                SCENARIO,
                &format!("{system} write p50 c={c}"),
                percentile(&m.latencies_ms, 50.0),
                "ms",
                n,
            ));
            rows.push(Row::new(
                SCENARIO,
                &format!("{system} write p99 c={c}"),
                percentile(&m.latencies_ms, 99.0),
                "ms",
                n,
            ));
            if m.errors > 0 {
                rows.push(Row::new(
                    SCENARIO,
                    &format!("{system} failed writes c={c}"),
                    m.errors as f64,
                    "count",
                    n,
                ));
            }
        }
        let ratio = cumulus.throughput() / etcd_run.throughput();
        rows.push(Row::at_least(
            SCENARIO,
            &format!("cumulus/etcd throughput c={c}"),
            ratio,
            "ratio",
            cumulus.latencies_ms.len().min(etcd_run.latencies_ms.len()),
            1.0,
        ));
        drop(etcd);
        drop(cluster);
    }
    Ok(rows)
}

/// The etcd binary: `etcd` on `PATH`, else `/usr/bin/etcd`.
fn find_etcd() -> anyhow::Result<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("etcd"))
                .find(|p| p.is_file())
        })
        .unwrap_or_default();
    let fallback = PathBuf::from("/usr/bin/etcd");
    match on_path {
        Some(p) => Ok(p),
        None if fallback.is_file() => Ok(fallback),
        None => bail!("etcd not found: apt-get install -y --no-install-recommends etcd-server"),
    }
}

/// The payload, built once: the request, and its JSON with a placeholder request id of
/// [`REQUEST_ID_LEN`] bytes at a known offset (patched per write, so the JSON is not
/// re-serialized on the client's hot path).
pub(crate) struct Template {
    /// The request (its `request_id` is replaced on every write).
    request: v1::SubmitJobRequest,
    /// JSON of `request`, with the placeholder id at `id_offset`.
    json: Vec<u8>,
    /// Byte offset of the request id inside `json`.
    id_offset: usize,
}

impl Template {
    /// Builds the job spec of a 4-rank trainer job whose dataset (8 small shard files) and
    /// checkpoint directory live under `dir`.
    pub(crate) fn new(dir: &Path) -> anyhow::Result<Template> {
        let dataset = dir.join("dataset");
        std::fs::create_dir_all(&dataset)
            .with_context(|| format!("creating {}", dataset.display()))?;
        for i in 0..DATASET_SHARDS {
            let p = dataset.join(format!("shard-{i:05}.csv"));
            std::fs::write(&p, "label,pixels\n")
                .with_context(|| format!("writing {}", p.display()))?;
        }
        let ckpt = dir.join("ckpt");
        let out = dir.join("out");
        let holdout = dir.join("holdout.csv");
        let path = |p: &Path| p.to_string_lossy().to_string();
        let spec = v1::JobSpec {
            name: "digits-softmax-bench".into(),
            world_size: 4,
            command: vec![
                path(&bin_dir().join("cumulus-trainer")),
                "train".into(),
                "--test-file".into(),
                path(&holdout),
                "--out".into(),
                path(&out),
                "--epochs".into(),
                "20".into(),
            ],
            env: [
                ("OMP_NUM_THREADS", "1"),
                ("PYTHONUNBUFFERED", "1"),
                ("NCCL_DEBUG", "WARN"),
                ("EXPERIMENT", "digits-softmax-lr0.1"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            dataset: path(&dataset),
            ckpt_dir: path(&ckpt),
            ckpt_keep: Some(3),
            restart: Some(v1::RestartPolicy {
                scope: Some("group".into()),
                max_restarts: Some(3),
                backoff_initial_ms: Some(500),
                backoff_max_ms: Some(30_000),
            }),
            progress_timeout_ms: 60_000,
            startup_timeout_ms: 0,
            fail_fast: None,
            working_dir: path(dir),
            ckpt_url: String::new(),
            ckpt_commit_tier: String::new(),
            gpus_per_rank: 0,
            gpu_memory_fraction: None,
            stop_grace_ms: 0,
            time_limit_ms: 0,
            signal_before_ms: 0,
            priority: 0,
            resume_from_job: String::new(),
            resume_from_step: None,
            preemptible: false,
            workdir: None,
            environment: None,
            warm_spares: 0,
            warm_imports: Vec::new(),
            min_world_size: 0,
            straggler_action: String::new(),
            straggler_fraction: None,
            straggler_window_ms: 0,
        };
        let placeholder = "#".repeat(REQUEST_ID_LEN);
        let request = v1::SubmitJobRequest {
            allow_pending: false,
            request_id: placeholder.clone(),
            spec: Some(spec),
        };
        let json = serde_json::to_vec(&request).context("serializing the payload")?;
        let needle = format!("\"{placeholder}\"");
        let id_offset = json
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .context("the placeholder request id is in the JSON")?
            + 1;
        Ok(Template {
            request,
            json,
            id_offset,
        })
    }

    /// The etcd value for `request_id` (exactly [`REQUEST_ID_LEN`] ASCII bytes).
    fn json_with_id(&self, request_id: &str) -> Vec<u8> {
        let mut v = self.json.clone();
        v[self.id_offset..self.id_offset + REQUEST_ID_LEN].copy_from_slice(request_id.as_bytes());
        v
    }
}

/// A unique request id of exactly [`REQUEST_ID_LEN`] bytes (`seq` < 10^10, `c` and `task`
/// < 1,000).
fn request_id(system: &str, c: usize, task: usize, seq: u64) -> String {
    let tag = if system == "cumulus" { 'c' } else { 'e' };
    let id = format!("wp{tag}-c{c:03}-t{task:03}-{seq:010}");
    debug_assert_eq!(id.len(), REQUEST_ID_LEN);
    id
}

/// One client's connection to the system under test.
pub(crate) enum Target {
    /// A Cumulus client of the leader.
    Cumulus(Client),
    /// An etcd KV client of the etcd leader.
    Etcd(etcd_client::KvClient),
}

impl Target {
    /// One write with request id `id`; Ok once acknowledged.
    async fn write(&mut self, template: &Template, id: &str) -> anyhow::Result<()> {
        match self {
            Target::Cumulus(client) => {
                let mut req = template.request.clone();
                req.request_id = id.to_string();
                let resp = client
                    .submit_job(req)
                    .await
                    .context("SubmitJob")?
                    .into_inner();
                if !resp.created {
                    bail!("request id {id} was not new");
                }
            }
            Target::Etcd(kv) => {
                let value = template.json_with_id(id);
                tokio::time::timeout(
                    WRITE_TIMEOUT,
                    kv.put(format!("{ETCD_KEY_PREFIX}{id}"), value, None),
                )
                .await
                .context("etcd Put timed out")?
                .context("etcd Put")?;
            }
        }
        Ok(())
    }
}

/// What one measurement of one system at one concurrency produced (or several rounds of
/// it, [`Measurement::add`]ed).
#[derive(Default)]
pub(crate) struct Measurement {
    /// Latency of every acknowledged write started in the measured window, in ms.
    pub(crate) latencies_ms: Vec<f64>,
    /// Failed writes started in the measured window.
    errors: u64,
    /// From the start of the measured window until the last client stopped (summed over
    /// rounds).
    elapsed: Duration,
}

impl Measurement {
    /// Acknowledged writes per second.
    fn throughput(&self) -> f64 {
        self.latencies_ms.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Adds another round of the same system and concurrency.
    fn add(&mut self, mut round: Measurement) {
        self.latencies_ms.append(&mut round.latencies_ms);
        self.errors += round.errors;
        self.elapsed += round.elapsed;
    }
}

/// Request ids of one round start at `round × ROUND_SEQ_STRIDE`, so every round's ids are
/// new (a client writes at most [`MAX_WRITES_PER_CLIENT`] per round).
const ROUND_SEQ_STRIDE: u64 = 100_000_000;

/// Runs `c` clients (client `i` on `make(i)`), each writing back-to-back for `warmup`
/// (not recorded) then for `measure` (recorded). `round` (< 100) keeps the request ids of
/// several measurements against one cluster apart.
pub(crate) async fn measure_system(
    c: usize,
    round: u64,
    warmup: Duration,
    measure: Duration,
    make: impl Fn(usize) -> Target,
    template: &Arc<Template>,
    system: &'static str,
) -> anyhow::Result<Measurement> {
    let start = Instant::now();
    let window_start = start + warmup;
    let window_end = window_start + measure;
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..c {
        let mut target = make(task);
        let template = Arc::clone(template);
        tasks.spawn(async move {
            let mut latencies_ms = Vec::new();
            let mut errors = 0u64;
            let mut last_error = None;
            let first_seq = round * ROUND_SEQ_STRIDE;
            let mut seq = first_seq;
            while seq - first_seq < MAX_WRITES_PER_CLIENT {
                let began = Instant::now();
                if began >= window_end {
                    break;
                }
                seq += 1;
                let id = request_id(system, c, task, seq);
                let result = target.write(&template, &id).await;
                let took = began.elapsed();
                let recorded = began >= window_start;
                match result {
                    Ok(()) if recorded => latencies_ms.push(ms(took)),
                    Ok(()) => {}
                    Err(e) => {
                        if recorded {
                            errors += 1;
                        }
                        last_error = Some(format!("{e:#}"));
                        tokio::time::sleep(ERROR_PAUSE).await;
                    }
                }
            }
            (latencies_ms, errors, last_error)
        });
    }
    let mut m = Measurement {
        latencies_ms: Vec::new(),
        errors: 0,
        elapsed: Duration::ZERO,
    };
    let mut last_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (mut lat, errors, err) = joined.context("a client task panicked")?;
        m.latencies_ms.append(&mut lat);
        m.errors += errors;
        last_error = last_error.or(err);
    }
    m.elapsed = Instant::now().saturating_duration_since(window_start);
    if m.latencies_ms.is_empty() {
        bail!(
            "{system} acknowledged no write with {c} clients (last error: {})",
            last_error.unwrap_or_else(|| "none".into())
        );
    }
    if let Some(e) = last_error {
        eprintln!(
            "   {system} c={c}: {} failed writes in the window; last error: {e}",
            m.errors
        );
    }
    Ok(m)
}

/// An etcd client of `endpoints` (`https://`, verified with `tls`) with the scenario's
/// timeouts.
async fn connect_etcd(
    endpoints: &[String],
    tls: &etcd_client::TlsOptions,
) -> anyhow::Result<etcd_client::Client> {
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(WRITE_TIMEOUT)
        .with_timeout(WRITE_TIMEOUT)
        .with_tls(tls.clone());
    etcd_client::Client::connect(endpoints, Some(opts))
        .await
        .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))
}

/// Three etcd members on 127.0.0.1 with TLS for clients and peers (as Cumulus has: one CA,
/// server certificates, mutual TLS between members), killed (SIGKILL) and reaped on drop,
/// their data removed.
struct EtcdCluster {
    /// The member processes started here.
    children: Vec<Child>,
    /// Client URL of every member, e.g. `https://127.0.0.1:12345`.
    client_urls: Vec<String>,
    /// Client TLS: the CA of the members' certificates.
    tls: etcd_client::TlsOptions,
    /// Log file of every member.
    logs: Vec<PathBuf>,
    /// Directory holding every member's data dir and log (removed on drop).
    dir: PathBuf,
}

impl EtcdCluster {
    /// Starts three members with data dirs and logs under `dir` (default durability: the WAL
    /// is fsynced), as a new cluster.
    fn start(etcd: &Path, dir: &Path) -> anyhow::Result<EtcdCluster> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let tls_dir = dir.join("tls");
        let ca = cumulus_tls::generate::ClusterCa::generate("etcd bench")?;
        ca.write(&tls_dir)?;
        // A member's certificate (a user's may only connect, never serve).
        let pair = ca
            .issue(&cumulus_tls::Identity::Worker("etcd".into()), &[])?
            .write(&tls_dir, "etcd")?;
        let ca_file = tls_dir.join(cumulus_tls::generate::CA_FILE);
        let tls_flags = [
            ("--cert-file", &pair.cert),
            ("--key-file", &pair.key),
            ("--peer-cert-file", &pair.cert),
            ("--peer-key-file", &pair.key),
            ("--peer-trusted-ca-file", &ca_file),
        ];
        let members: Vec<(String, String, String)> = (1..=3)
            .map(|i| {
                (
                    format!("etcd-{i}"),
                    format!("https://127.0.0.1:{}", free_port()),
                    format!("https://127.0.0.1:{}", free_port()),
                )
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|(name, _, peer)| format!("{name}={peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            children: Vec::new(),
            client_urls: Vec::new(),
            tls: etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(ca.cert_pem())),
            logs: Vec::new(),
            dir: dir.to_path_buf(),
        };
        for (name, client_url, peer_url) in &members {
            let log_path = dir.join(format!("{name}.log"));
            let log = File::create(&log_path)
                .with_context(|| format!("creating {}", log_path.display()))?;
            let child = Command::new(etcd)
                .arg("--name")
                .arg(name)
                .arg("--data-dir")
                .arg(dir.join(name))
                .arg("--listen-client-urls")
                .arg(client_url)
                .arg("--advertise-client-urls")
                .arg(client_url)
                .arg("--listen-peer-urls")
                .arg(peer_url)
                .arg("--initial-advertise-peer-urls")
                .arg(peer_url)
                .arg("--initial-cluster")
                .arg(&initial_cluster)
                .arg("--initial-cluster-token")
                .arg("cumulus-bench-write-path")
                .arg("--initial-cluster-state")
                .arg("new")
                .arg("--logger")
                .arg("zap")
                .arg("--log-outputs")
                .arg("stderr")
                .args(
                    tls_flags
                        .iter()
                        .flat_map(|(flag, path)| [std::ffi::OsStr::new(flag), path.as_os_str()]),
                )
                .arg("--peer-client-cert-auth")
                .stdin(Stdio::null())
                .stdout(log.try_clone().context("cloning the etcd log handle")?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("spawning {}", etcd.display()))?;
            cluster.children.push(child);
            cluster.client_urls.push(client_url.clone());
            cluster.logs.push(log_path);
        }
        Ok(cluster)
    }

    /// Waits until a `Put` through all members succeeds and one member reports itself
    /// leader; returns that leader's client URL.
    async fn wait_ready_and_find_leader(&self) -> anyhow::Result<String> {
        let start = Instant::now();
        let mut last_error = String::from("not tried yet");
        while start.elapsed() < READY_DEADLINE {
            match self.try_find_leader().await {
                Ok(url) => return Ok(url),
                Err(e) => last_error = format!("{e:#}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let tails: Vec<String> = self
            .logs
            .iter()
            .map(|p| {
                let text = std::fs::read_to_string(p).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                format!(
                    "--- {} ---\n{}",
                    p.display(),
                    lines[lines.len().saturating_sub(10)..].join("\n")
                )
            })
            .collect();
        bail!(
            "etcd not ready after {READY_DEADLINE:?}: {last_error}\n{}",
            tails.join("\n")
        )
    }

    /// One readiness check: a `Put`, then each member's `Status` until the leader is found.
    async fn try_find_leader(&self) -> anyhow::Result<String> {
        let mut all = connect_etcd(&self.client_urls, &self.tls).await?;
        tokio::time::timeout(WRITE_TIMEOUT, all.put("/cumulus/bench/ready", "1", None))
            .await
            .context("readiness Put timed out")?
            .context("readiness Put")?;
        for url in &self.client_urls {
            let mut one = connect_etcd(std::slice::from_ref(url), &self.tls).await?;
            let status = tokio::time::timeout(WRITE_TIMEOUT, one.status())
                .await
                .context("Status timed out")?
                .with_context(|| format!("Status of {url}"))?;
            let me = status
                .header()
                .map(|h| h.member_id())
                .context("Status without a header")?;
            if status.leader() != 0 && status.leader() == me {
                return Ok(url.clone());
            }
        }
        bail!("no etcd member reports itself leader yet")
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            // `Child::kill` sends SIGKILL to this child's PID; then reap it.
            let _ = child.kill();
            let _ = child.wait();
        }
        // Each member preallocates 64 MiB of WAL: do not keep them past the measurement.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
