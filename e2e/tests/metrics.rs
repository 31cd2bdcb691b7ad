//! End-to-end test of `/metrics` and of the replicated progress history (issue #44):
//! every coordinator and agent serves the Prometheus text format behind a token, the
//! counters move with what the cluster does (a REST submit, a restart by its cause), and
//! a running job's progress history is served by every coordinator and outlives the
//! leader that recorded it. One cluster; every wait is on a condition.

use std::collections::HashMap;
use std::time::Duration;

use cumulus_api::{JobState, v1};
use cumulus_e2e::{Cluster, ClusterOpts, TOKEN, prepare_digits, trainer_spec, wait_for};

const LONG: Duration = Duration::from_secs(180);
/// The scrape token every coordinator and agent is given (`--metrics-token-file`).
const SCRAPE_TOKEN: &str = "e2e-scrape-token-0123456789abcdef";

/// `GET /metrics` on `addr` with `token`: the status and the body.
async fn scrape(cluster: &Cluster, addr: &str, token: Option<&str>) -> (u16, String) {
    let mut req = cluster.http_client().get(cluster.url(addr, "/metrics"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.expect("GET /metrics");
    let status = r.status().as_u16();
    (status, r.text().await.expect("body"))
}

/// The samples of a scrape, parsed by a Prometheus text-format parser: value by
/// `name{label=value,…}` (labels sorted by name).
fn parse(text: &str) -> HashMap<String, f64> {
    // The parser skips what it does not understand: every line must be a help, type or
    // sample line.
    for line in text.lines() {
        let info = prometheus_parse::LineInfo::parse(line);
        assert!(
            !matches!(info, prometheus_parse::LineInfo::Ignored),
            "not the Prometheus text format: {line:?}"
        );
    }
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the Prometheus text format");
    let mut out = HashMap::new();
    for s in scrape.samples {
        let mut labels: Vec<(String, String)> = s
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.sort();
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(h) => {
                // The count: the `+Inf` bucket.
                h.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            prometheus_parse::Value::Summary(_) => continue,
        };
        out.insert(format!("{}{{{}}}", s.metric, labels.join(",")), value);
    }
    out
}

/// The leader's index among the coordinators.
async fn leader_index(cluster: &Cluster) -> usize {
    let id = cluster.wait_leader(LONG).await;
    cluster.index_of(id).expect("the leader is a member")
}

/// `GET /v1/jobs/{id}/summary` from coordinator `i` with the cluster token.
async fn summary(cluster: &Cluster, i: usize, job: &str) -> Option<v1::JobSummary> {
    let url = cluster.url(
        &cluster.coordinators[i].http,
        &format!("/v1/jobs/{job}/summary"),
    );
    let r = cluster
        .http_client()
        .get(url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json().await.ok()
}

// One scenario read in order on one cluster (its start is most of the test's time).
#[allow(clippy::too_many_lines)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_with_the_cluster_and_the_progress_history_survives_a_leader_kill() {
    let secrets = tempfile::tempdir().expect("tempdir");
    let token_file = secrets.path().join("scrape-token");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&token_file)
            .and_then(|mut f| f.write_all(SCRAPE_TOKEN.as_bytes()))
            .expect("write the scrape token");
    }
    let flag = vec![
        "--metrics-token-file".to_string(),
        token_file.display().to_string(),
    ];
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 1,
        slots: 4,
        coordinator_args: flag.clone(),
        worker_args: flag,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let leader = leader_index(&cluster).await;
    let leader_http = cluster.coordinators[leader].http.clone();

    // Without the token, or with a wrong one: 401, on a coordinator and on an agent.
    let status = cluster.status().await.expect("status");
    let agent_http = status.workers[0].http_addr.clone();
    for addr in [&leader_http, &agent_http] {
        for token in [None, Some("not-the-token-0123456789")] {
            assert_eq!(
                scrape(&cluster, addr, token).await.0,
                401,
                "{addr} {token:?}"
            );
        }
    }
    // Prometheus's service discovery finds every coordinator and the agent.
    let groups: serde_json::Value = cluster
        .http_client()
        .get(cluster.url(&leader_http, "/metrics/targets"))
        .bearer_auth(SCRAPE_TOKEN)
        .send()
        .await
        .expect("GET /metrics/targets")
        .json()
        .await
        .expect("targets JSON");
    assert_eq!(
        groups[0]["labels"]["cumulus_role"], "coordinator",
        "{groups}"
    );
    assert_eq!(
        groups[0]["targets"].as_array().map(Vec::len),
        Some(3),
        "{groups}"
    );
    assert_eq!(
        groups[1]["targets"],
        serde_json::json!([agent_http]),
        "{groups}"
    );
    // An agent's scrape parses, with its families.
    let (code, text) = scrape(&cluster, &agent_http, Some(SCRAPE_TOKEN)).await;
    assert_eq!(code, 200, "{text}");
    let agent = parse(&text);
    assert!(agent.contains_key("cumulus_agent_live_ranks{}"), "{text}");
    assert!(
        agent.contains_key("cumulus_agent_heartbeats_total{result=ok}"),
        "{text}"
    );

    // A REST submit moves the request histogram; a rank that fails its first attempt
    // moves the restarts by cause.
    let before = parse(&scrape(&cluster, &leader_http, Some(SCRAPE_TOKEN)).await.1);
    let submits = "cumulus_http_request_duration_seconds{code=200,method=POST,route=/v1/jobs}";
    let restarts = "cumulus_restarts_total{cause=exit}";
    assert_eq!(before.get(restarts), Some(&0.0), "{before:?}");
    assert!(before.contains_key("cumulus_raft_term{}"), "{before:?}");
    assert_eq!(before.get("cumulus_raft_is_leader{}"), Some(&1.0));
    let flaky = v1::SubmitJobRequest {
        request_id: "metrics-flaky".into(),
        spec: Some(v1::JobSpec {
            name: "flaky".into(),
            world_size: 1,
            command: vec![
                "sh".into(),
                "-c".into(),
                r#"test "$CUMULUS_ATTEMPT" != 0"#.into(),
            ],
            fail_fast: Some(false),
            restart: Some(v1::RestartPolicy {
                max_restarts: Some(2),
                backoff_initial_ms: Some(100),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let r = cluster
        .http_client()
        .post(cluster.url(&leader_http, "/v1/jobs"))
        .bearer_auth(TOKEN)
        .json(&flaky)
        .send()
        .await
        .expect("POST /v1/jobs");
    assert_eq!(r.status(), 200);
    let flaky: v1::SubmitJobResponse = r.json().await.expect("submit JSON");
    let done = cluster.wait_finished(&flaky.job_id, LONG).await;
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    assert_eq!(done.restarts_used, 1, "{done:?}");
    let after = parse(&scrape(&cluster, &leader_http, Some(SCRAPE_TOKEN)).await.1);
    assert!(
        after.get(submits).copied().unwrap_or(0.0)
            >= before.get(submits).copied().unwrap_or(0.0) + 1.0,
        "{submits}: {after:?}"
    );
    assert_eq!(after.get(restarts), Some(&1.0), "{after:?}");
    assert!(
        after
            .get("cumulus_jobs{state=succeeded}")
            .is_some_and(|n| *n >= 1.0),
        "{after:?}"
    );
    assert!(
        after
            .get("cumulus_heartbeats_total{}")
            .is_some_and(|n| *n > 0.0)
    );
    // The waits read the job over gRPC, through the leader.
    let reads =
        "cumulus_grpc_request_duration_seconds{code=0,route=/cumulus.v1.ClientService/GetJob}";
    assert!(
        after.get(reads).is_some_and(|n| *n >= 1.0),
        "{reads}: {after:?}"
    );

    // A running trainer's history: sampled by the leader, served by a follower too.
    let root = cluster.dir.path().to_path_buf();
    let w = prepare_digits(&root, 2).expect("shards");
    let args = ["--epochs", "100000", "--step-sleep-ms", "10"];
    let spec = trainer_spec(&w, 1, &root.join("ckpt"), &root.join("out"), &args);
    let job = cluster
        .submit("metrics-trainer", spec)
        .await
        .expect("submit")
        .job_id;
    let follower = cluster.follower_of(cluster.coordinators[leader].id);
    let recorded = wait_for("two samples with metrics on a follower", LONG, || async {
        let s = summary(&cluster, follower, &job).await?;
        (s.history.len() >= 2 && s.history.iter().all(|p| !p.metrics.is_empty()))
            .then_some(s.history)
    })
    .await;

    // The leader dies: the new one serves the same samples and goes on adding to them.
    cluster.coordinators[leader].proc.kill9();
    let new_leader = leader_index(&cluster).await;
    assert_ne!(new_leader, leader);
    let newest = recorded.last().expect("samples").at_ms;
    let history = wait_for("a sample from the new leader", LONG, || async {
        let s = summary(&cluster, new_leader, &job).await?;
        s.history
            .last()
            .is_some_and(|p| p.at_ms > newest)
            .then_some(s.history)
    })
    .await;
    assert_eq!(
        &history[..recorded.len()],
        &recorded[..],
        "the samples survived"
    );
    assert!(history.last().is_some_and(|p| !p.metrics.is_empty()));

    let (code, text) = scrape(
        &cluster,
        &cluster.coordinators[new_leader].http,
        Some(SCRAPE_TOKEN),
    )
    .await;
    assert_eq!(code, 200);
    let metrics = parse(&text);
    assert!(
        metrics
            .get("cumulus_raft_leader_changes_total{}")
            .is_some_and(|n| *n >= 1.0),
        "{text}"
    );
    assert_eq!(
        metrics.get("cumulus_jobs{state=running}"),
        Some(&1.0),
        "{text}"
    );
    let mut c = cluster.leader_client().await.expect("client");
    c.cancel_job(v1::CancelJobRequest {
        job_id: job.clone(),
    })
    .await
    .expect("cancel");
}
