//! `cumulusctl run`, `submit --upload` and `artifacts`, through the real binary against a
//! real cluster: `run -c CODE` prints the job's output and exits with its code; Ctrl-C
//! without a terminal leaves the job running and says how to follow it; an unchanged
//! directory uploads nothing the second time; the ranks run in the uploaded directory
//! (ignored files absent) and what they leave in `$CUMULUS_OUTPUT_DIR` comes back with
//! `artifacts ls` and `artifacts get`.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use cumulus_api::JobState;
use cumulus_e2e::{Cluster, ClusterOpts, bin, wait_for};
use tokio::io::{AsyncBufReadExt, BufReader};

const LONG: Duration = Duration::from_secs(180);

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `cumulusctl` with the cluster's addresses, CA and token, as [`Cluster::cumulusctl`]
/// runs it, as a process to drive (signals, streamed output).
fn cumulusctl(cluster: &Cluster, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin("cumulusctl"));
    match cluster.ca_file() {
        Some(ca) => cmd.arg("--tls-ca").arg(ca),
        None => cmd.arg("--insecure"),
    };
    cmd.arg("--addr")
        .arg(cluster.grpc_addrs())
        .arg("--http")
        .arg(cluster.http_addrs())
        .arg("--token-file")
        .arg(cluster.token_file())
        .args(args)
        .env("XDG_CACHE_HOME", cluster.client_cache_dir())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// The job id in `text` (`job-NNNNNN`), the first one.
fn job_id_in(text: &str) -> String {
    let at = text
        .find("job-")
        .unwrap_or_else(|| panic!("no job id in {text}"));
    text[at..at + 10].to_string()
}

async fn one_worker() -> Cluster {
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        slots: 2,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    cluster
}

// One scenario against one cluster: read in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_prints_the_output_and_exits_with_the_jobs_code() {
    let cluster = one_worker().await;

    // 1. Code in, its output and exit 0 out.
    let out = cluster
        .cumulusctl(&["run", "-c", "print(6*7)"])
        .expect("cumulusctl run");
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).lines().any(|l| l == "42"), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("submitted") && err.contains("succeeded"),
        "{err}"
    );
    let job = cluster.job(&job_id_in(&err)).await.expect("the job");
    assert_eq!(
        job.spec.expect("spec").command,
        ["python3", "-c", "print(6*7)"]
    );

    // 2. A failing rank's exit code is run's, with the cause.
    let out = cluster
        .cumulusctl(&[
            "run",
            "--max-restarts",
            "0",
            "-c",
            "import sys; print('bye'); sys.exit(3)",
        ])
        .expect("cumulusctl run");
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stdout(&out).lines().any(|l| l == "bye"), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("error: job job-") && err.contains(" failed"),
        "{err}"
    );

    // 3. Ctrl-C without a terminal: the job is left running, and the way to follow it
    // is printed.
    let mut child = cumulusctl(
        &cluster,
        &[
            "run",
            "-c",
            "import time; print('started', flush=True); time.sleep(600)",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn cumulusctl run");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    tokio::time::timeout(LONG, async {
        while let Some(line) = lines.next_line().await.expect("read stdout") {
            if line == "started" {
                return;
            }
        }
        panic!("cumulusctl run ended before the job started");
    })
    .await
    .expect("the job's first line within the deadline");
    let pid = nix::unistd::Pid::from_raw(child.id().expect("pid") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let out = tokio::time::timeout(LONG, child.wait_with_output())
        .await
        .expect("cumulusctl exits after Ctrl-C")
        .expect("wait");
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    let err = stderr(&out);
    let job_id = job_id_in(&err);
    assert!(
        err.contains(&format!("cumulusctl logs -f {job_id}")),
        "{err}"
    );
    let job = cluster.job(&job_id).await.expect("the job");
    assert_eq!(job.job_state(), Ok(JobState::Running), "left running");
    let out = cluster
        .cumulusctl(&["cancel", &job_id])
        .expect("cumulusctl cancel");
    assert!(out.status.success(), "{}", stderr(&out));
    cluster.wait_finished(&job_id, LONG).await;
}

/// A project directory: a script that reads a data file and looks for an ignored one.
fn project(dir: &Path) {
    std::fs::write(
        dir.join("main.py"),
        "import os\n\
         print('data:', open('data.txt').read().strip())\n\
         print('secret:', os.path.exists('secret.txt'))\n",
    )
    .expect("write");
    std::fs::write(dir.join("data.txt"), "hello from the upload\n").expect("write");
    std::fs::write(dir.join(".gitignore"), "secret.txt\n").expect("write");
    std::fs::write(dir.join("secret.txt"), "never sent\n").expect("write");
}

/// The number N of `uploaded N bytes` in `err`.
fn uploaded_bytes(err: &str) -> u64 {
    let at = err
        .find("uploaded ")
        .unwrap_or_else(|| panic!("no upload line in {err}"));
    err[at + "uploaded ".len()..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {err}"))
}

// One scenario against one cluster: read in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_directory_uploads_nothing_the_second_time() {
    let cluster = one_worker().await;
    let dir = tempfile::tempdir().expect("tempdir");
    project(dir.path());
    let upload = dir.path().to_str().expect("utf8");

    let submit = |cluster: &Cluster| {
        cluster
            .cumulusctl(&[
                "submit",
                "--world-size",
                "1",
                "--upload",
                upload,
                "--",
                "python3",
                "main.py",
            ])
            .expect("cumulusctl submit --upload")
    };
    let first = submit(&cluster);
    assert!(first.status.success(), "{}", stderr(&first));
    let err = stderr(&first);
    assert!(!err.contains("unchanged"), "{err}");
    assert!(uploaded_bytes(&err) > 0, "{err}");
    let second = submit(&cluster);
    assert!(second.status.success(), "{}", stderr(&second));
    let err = stderr(&second);
    assert!(err.contains("workdir unchanged: uploaded 0 bytes"), "{err}");
    // Both jobs name the same blob, and no path on the workers.
    let mut blobs = Vec::new();
    for out in [&first, &second] {
        let job_id = stdout(out).trim().to_string();
        let spec = cluster.job(&job_id).await.expect("job").spec.expect("spec");
        assert_eq!(spec.working_dir, "");
        blobs.push(spec.workdir.expect("the uploaded workdir"));
    }
    assert_eq!(blobs[0], blobs[1]);
    assert_eq!(blobs[0].size_bytes, uploaded_bytes(&stderr(&first)));

    // A directory past the size limit is refused before anything is sent, naming the
    // largest file.
    std::fs::write(dir.path().join("weights.bin"), vec![7u8; 2 << 20]).expect("write");
    let out = cluster
        .cumulusctl(&[
            "submit",
            "--world-size",
            "1",
            "--upload",
            upload,
            "--max-upload-mib",
            "1",
            "--",
            "true",
        ])
        .expect("cumulusctl submit");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("weights.bin") && err.contains("2.0 MiB") && err.contains("1.0 MiB"),
        "{err}"
    );
    assert!(!err.contains("uploaded"), "{err}");
}

// One scenario against one cluster: read in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_run_in_the_uploaded_directory_and_their_artifacts_come_back() {
    let cluster = one_worker().await;
    let dir = tempfile::tempdir().expect("tempdir");
    project(dir.path());
    let upload = dir.path().to_str().expect("utf8");

    // 1. The ranks run in a copy of the directory, without its ignored files.
    let out = cluster
        .cumulusctl(&["run", "--upload", upload, "--", "python3", "main.py"])
        .expect("cumulusctl run --upload");
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(
        text.lines().any(|l| l == "data: hello from the upload"),
        "{text}"
    );
    assert!(text.lines().any(|l| l == "secret: False"), "{text}");

    // 2. What a rank leaves in $CUMULUS_OUTPUT_DIR: listed and downloaded.
    let code = "import os\n\
                out = os.environ['CUMULUS_OUTPUT_DIR']\n\
                os.makedirs(os.path.join(out, 'models'))\n\
                open(os.path.join(out, 'models', 'final.txt'), 'w').write('weights 42')\n\
                print('saved')";
    let out = cluster
        .cumulusctl(&["run", "-c", code])
        .expect("cumulusctl run");
    assert!(out.status.success(), "{}", stderr(&out));
    let job_id = job_id_in(&stderr(&out));
    let job = wait_for("the artifacts recorded", LONG, || async {
        cluster
            .job(&job_id)
            .await
            .filter(|j| !j.artifacts.is_empty())
    })
    .await;
    assert_eq!(job.artifacts[0].rank, 0);

    let out = cluster
        .cumulusctl(&["artifacts", "ls", &job_id])
        .expect("artifacts ls");
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(
        table
            .lines()
            .any(|l| l.contains("models/final.txt") && l.contains("10")),
        "{table}"
    );
    let out = cluster
        .cumulusctl(&["-o", "json", "artifacts", "ls", &job_id, "--rank", "0"])
        .expect("artifacts ls -o json");
    let files: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert_eq!(files[0]["path"], "models/final.txt");
    assert_eq!(files[0]["size_bytes"], 10);

    let dest = dir.path().join("final.txt");
    let dest_s = dest.to_str().expect("utf8");
    let get = |force: bool| {
        let mut args = vec![
            "artifacts",
            "get",
            &job_id,
            "models/final.txt",
            "--out",
            dest_s,
        ];
        if force {
            args.push("--force");
        }
        cluster.cumulusctl(&args).expect("artifacts get")
    };
    let out = get(false);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&dest).expect("read"), "weights 42");
    let out = get(false);
    assert!(!out.status.success(), "an existing file is kept");
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    assert!(get(true).status.success());

    let out = cluster
        .cumulusctl(&["artifacts", "get", &job_id, "nope.txt", "--out", "-"])
        .expect("artifacts get");
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no file nope.txt"),
        "{}",
        stderr(&out)
    );
}
