//! Sending code, not paths, against a real cluster (one coordinator, two workers of one
//! slot each, TLS): a directory packed with `cumulus_bundle::pack` (its `.gitignore`d
//! file left out) and uploaded with `PutBlob` becomes the working directory of both ranks
//! of a job, each on its own worker; what each rank writes into `$CUMULUS_OUTPUT_DIR` is
//! listed in `job.artifacts` and `GetBlob` returns archives holding it; the attempts'
//! directories are gone afterwards. A cached workdir corrupted on a worker is detected
//! and fetched again, and a rank exiting `EXIT_CANNOT_RUN` (78) fails its job at once,
//! spending no restart. With `--run-as` (as root), the ranks' user owns its working and
//! output directories, and its output still comes back.

use std::path::Path;
use std::time::Duration;

use cumulus_api::JobState;
use cumulus_api::v1;
use cumulus_e2e::blobs::{get_blob, put_blob};
use cumulus_e2e::{Client, Cluster, ClusterOpts, wait_for};

const LONG: Duration = Duration::from_secs(120);

/// The script both ranks run from their working directory: checks what was sent (and
/// what was not), writes a file into the output dir, and with `cannot` exits 78.
const SCRIPT: &str = r#"#!/bin/sh
set -eu
test -f data/input.txt || { echo "data/input.txt is missing in $(pwd)"; exit 3; }
if [ -e secret.env ]; then echo "the ignored file was sent"; exit 4; fi
if [ "${1:-}" = cannot ]; then echo "this rank cannot run here"; exit 78; fi
mkdir -p "$CUMULUS_OUTPUT_DIR/ranks"
{ cat data/input.txt; echo "rank $RANK of $WORLD_SIZE"; } > "$CUMULUS_OUTPUT_DIR/ranks/rank-$RANK.txt"
echo "rank $RANK ran in $(pwd)"
"#;

/// The directory a user would upload: a script, a data file, an ignored secret.
fn project(dir: &Path) {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(dir.join("run.sh"), SCRIPT).unwrap();
    std::fs::write(dir.join("data/input.txt"), "the input\n").unwrap();
    std::fs::write(dir.join("secret.env"), "TOKEN=do-not-send\n").unwrap();
    std::fs::write(dir.join(".gitignore"), "secret.env\n").unwrap();
}

async fn put(c: &mut Client, digest: &str, data: &[u8]) -> v1::PutBlobResponse {
    put_blob(c, digest, data).await.expect("put the workdir")
}

async fn get(c: &mut Client, digest: &str) -> Vec<u8> {
    get_blob(c, digest).await.expect("get an artifact")
}

fn spec(workdir: &v1::BlobRef, args: &[&str]) -> v1::JobSpec {
    v1::JobSpec {
        world_size: 2,
        command: ["sh", "run.sh"]
            .iter()
            .chain(args)
            .map(|s| s.to_string())
            .collect(),
        workdir: Some(workdir.clone()),
        restart: Some(v1::RestartPolicy {
            max_restarts: Some(3),
            backoff_initial_ms: Some(100),
            backoff_max_ms: Some(100),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploaded_workdir_runs_on_two_workers_and_their_outputs_come_back() {
    let cluster = Cluster::start(ClusterOpts {
        coordinators: 1,
        workers: 2,
        slots: 1,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let mut client = cluster.leader_client().await.expect("client");

    let src = tempfile::tempdir().unwrap();
    project(src.path());
    let packed =
        cumulus_bundle::pack(src.path(), &cumulus_bundle::PackOptions::default()).expect("pack");
    assert_eq!(packed.files, 3, "run.sh, data/input.txt, .gitignore");
    let bytes = std::fs::read(packed.path()).unwrap();
    let stored = put(&mut client, &packed.digest, &bytes).await;
    assert_eq!(stored.size_bytes, packed.size_bytes);
    let workdir = v1::BlobRef {
        digest: packed.digest.clone(),
        size_bytes: packed.size_bytes,
    };

    let job = cluster
        .submit("workdir-1", spec(&workdir, &[]))
        .await
        .expect("submit")
        .job_id;
    let done = cluster.wait_finished(&job, LONG).await;
    if done.job_state() != Ok(JobState::Succeeded) {
        cluster.dump_logs();
    }
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    let workers: std::collections::BTreeSet<&str> =
        done.ranks.iter().map(|r| r.worker_id.as_str()).collect();
    assert_eq!(workers.len(), 2, "one rank per worker: {:?}", done.ranks);
    assert_eq!(
        done.spec.as_ref().and_then(|s| s.workdir.as_ref()),
        Some(&workdir)
    );

    // Each rank's artifacts: an archive holding what it wrote.
    let ranks: Vec<(u32, u32)> = done.artifacts.iter().map(|a| (a.rank, a.attempt)).collect();
    assert_eq!(ranks, [(0, 0), (1, 0)], "{:?}", done.artifacts);
    let scratch = tempfile::tempdir().unwrap();
    for a in &done.artifacts {
        let blob = a.blob.as_ref().expect("a blob");
        let archive = get(&mut client, &blob.digest).await;
        assert_eq!(archive.len() as u64, blob.size_bytes);
        assert_eq!(blake3::hash(&archive).to_hex().as_str(), blob.digest);
        let path = scratch.path().join(format!("rank-{}.tar.gz", a.rank));
        std::fs::write(&path, &archive).unwrap();
        let out = scratch.path().join(format!("rank-{}", a.rank));
        cumulus_bundle::unpack(&path, &out, &cumulus_bundle::UnpackLimits::default())
            .expect("unpack the artifacts");
        let text = std::fs::read_to_string(out.join(format!("ranks/rank-{}.txt", a.rank)))
            .expect("the rank's file");
        assert_eq!(text, format!("the input\nrank {} of 2\n", a.rank));
    }

    // The attempts' directories went with them; each worker cached the workdir once.
    let data_dirs: Vec<_> = cluster
        .workers
        .iter()
        .map(|w| cluster.dir.path().join(&w.name))
        .collect();
    for d in &data_dirs {
        let attempts = d.join("attempts").join(&job);
        assert!(!attempts.exists(), "{} is left", attempts.display());
        assert!(d.join("blob-cache").join(&packed.digest).is_file());
    }

    // A cached copy corrupted on disk is detected before use and fetched again; the
    // ranks then exit 78 ("cannot run here"): the job fails at once, no restart spent.
    let cached = data_dirs[0].join("blob-cache").join(&packed.digest);
    let mut corrupt = std::fs::read(&cached).unwrap();
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0xff;
    std::fs::write(&cached, &corrupt).unwrap();
    let job = cluster
        .submit("workdir-2", spec(&workdir, &["cannot"]))
        .await
        .expect("submit")
        .job_id;
    let failed = cluster.wait_finished(&job, LONG).await;
    assert_eq!(failed.job_state(), Ok(JobState::Failed), "{failed:?}");
    assert_eq!(failed.restarts_used, 0, "{failed:?}");
    assert!(
        failed.failure_cause.contains("exited with code 78")
            && failed.failure_cause.contains("no restart"),
        "{}",
        failed.failure_cause
    );
    wait_for(
        "the corrupted cached workdir to be replaced",
        LONG,
        || async { std::fs::read(&cached).ok().filter(|b| *b == bytes) },
    )
    .await;
}

/// With `--run-as`, the working directory and the output directory are the job's
/// user's: the rank runs in its tree, writes its output, and the agent (root) takes the
/// output back before it packs and uploads it. Needs root; as another user the test
/// says so and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_run_as_the_ranks_own_their_workdir_and_their_output_is_uploaded() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("not root: --run-as needs root; the run-as workdir test is skipped");
        return;
    }
    let cluster = Cluster::start(ClusterOpts {
        coordinators: 1,
        workers: 1,
        worker_args: vec!["--run-as".into(), "62000-62999".into()],
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let mut client = cluster.leader_client().await.expect("client");
    let src = tempfile::tempdir().unwrap();
    project(src.path());
    // The ranks' user owns its tree and its output dir, and runs as nobody else.
    std::fs::write(
        src.path().join("owner.sh"),
        r#"set -eu
me=$(id -u)
[ "$me" -ge 62000 ] || { echo "running as $me"; exit 5; }
[ "$(stat -c %u .)" = "$me" ] && [ "$(stat -c %u data/input.txt)" = "$me" ] || { echo "the tree is not mine"; exit 6; }
[ "$(stat -c %u "$CUMULUS_OUTPUT_DIR")" = "$me" ] || { echo "the output dir is not mine"; exit 7; }
exec sh run.sh
"#,
    )
    .unwrap();
    let packed =
        cumulus_bundle::pack(src.path(), &cumulus_bundle::PackOptions::default()).expect("pack");
    let bytes = std::fs::read(packed.path()).unwrap();
    put(&mut client, &packed.digest, &bytes).await;
    let job = cluster
        .submit(
            "run-as-1",
            v1::JobSpec {
                world_size: 1,
                command: vec!["sh".into(), "owner.sh".into()],
                workdir: Some(v1::BlobRef {
                    digest: packed.digest.clone(),
                    size_bytes: packed.size_bytes,
                }),
                ..Default::default()
            },
        )
        .await
        .expect("submit")
        .job_id;
    let done = cluster.wait_finished(&job, LONG).await;
    if done.job_state() != Ok(JobState::Succeeded) {
        cluster.dump_logs();
    }
    assert_eq!(done.job_state(), Ok(JobState::Succeeded), "{done:?}");
    assert_eq!(done.artifacts.len(), 1, "{done:?}");
    let blob = done.artifacts[0].blob.as_ref().expect("a blob");
    let archive = get(&mut client, &blob.digest).await;
    let scratch = tempfile::tempdir().unwrap();
    let path = scratch.path().join("a.tar.gz");
    std::fs::write(&path, &archive).unwrap();
    let mut file = Vec::new();
    cumulus_bundle::extract_file(
        &path,
        "ranks/rank-0.txt",
        &mut file,
        &cumulus_bundle::UnpackLimits::default(),
    )
    .expect("the rank's file");
    assert_eq!(file, b"the input\nrank 0 of 1\n");
}
