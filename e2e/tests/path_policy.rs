//! Paths and names a submitter may use, against a real cluster whose coordinators and
//! agents run with `--allowed-dataset-roots` and `--allowed-ckpt-roots`: a job path
//! outside the roots (as written, through `..`, or through a symlink) is refused at
//! submit with PERMISSION_DENIED or INVALID_ARGUMENT, nothing is listed or created
//! outside, the refusal reads the same whether the path exists or not, a job name with
//! control characters is refused, and a job inside the roots runs.

use std::path::Path;
use std::time::Duration;

use cumulus_api::v1;
use cumulus_e2e::{Cluster, ClusterOpts};
use tonic::Code;

const LONG: Duration = Duration::from_secs(120);

fn s(p: &Path) -> String {
    p.to_str().expect("utf-8").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submits_outside_the_allowed_roots_are_refused_and_touch_nothing() {
    let roots_dir = tempfile::tempdir().expect("tempdir");
    let base = std::fs::canonicalize(roots_dir.path()).expect("canonical");
    let (datasets, ckpt, elsewhere) = (
        base.join("datasets"),
        base.join("ckpt"),
        base.join("elsewhere"),
    );
    for d in [
        datasets.join("set"),
        ckpt.clone(),
        elsewhere.join("private"),
    ] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    std::fs::write(datasets.join("set/shard-0.csv"), "1,0\n").expect("write");
    std::fs::write(elsewhere.join("private/id_rsa"), "secret\n").expect("write");
    std::os::unix::fs::symlink(&elsewhere, datasets.join("escape")).expect("symlink");
    std::os::unix::fs::symlink(&elsewhere, ckpt.join("escape")).expect("symlink");
    let policy = vec![
        "--allowed-dataset-roots".to_string(),
        s(&datasets),
        "--allowed-ckpt-roots".to_string(),
        s(&ckpt),
    ];
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        coordinator_args: policy.clone(),
        worker_args: policy,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    let mut client = cluster.leader_client().await.expect("client");
    let spec = |dataset: String, ckpt_dir: String| v1::JobSpec {
        world_size: 1,
        command: vec!["true".into()],
        dataset,
        ckpt_dir,
        ..Default::default()
    };
    let submit = |n: usize, spec: v1::JobSpec| v1::SubmitJobRequest {
        allow_pending: false,
        request_id: format!("policy-{n}"),
        spec: Some(spec),
    };

    let refused = [
        (
            spec(s(&elsewhere.join("private")), String::new()),
            Code::PermissionDenied,
        ),
        (
            spec("/no/such/dataset/anywhere".into(), String::new()),
            Code::PermissionDenied,
        ),
        (
            spec(s(&datasets.join("escape/private")), String::new()),
            Code::PermissionDenied,
        ),
        (spec("/etc".into(), String::new()), Code::PermissionDenied),
        (
            spec(
                format!("{}/../elsewhere/private", s(&datasets)),
                String::new(),
            ),
            Code::InvalidArgument,
        ),
        (
            spec(String::new(), s(&elsewhere.join("job"))),
            Code::PermissionDenied,
        ),
        (
            spec(String::new(), s(&ckpt.join("escape/job"))),
            Code::PermissionDenied,
        ),
        (
            spec(String::new(), format!("{}/../elsewhere/job", s(&ckpt))),
            Code::InvalidArgument,
        ),
    ];
    let mut outside_messages = Vec::new();
    for (n, (spec, code)) in refused.into_iter().enumerate() {
        let path = if spec.dataset.is_empty() {
            spec.ckpt_dir.clone()
        } else {
            spec.dataset.clone()
        };
        let status = client
            .submit_job(submit(n, spec))
            .await
            .expect_err(&format!("case {n} refused"));
        assert_eq!(status.code(), code, "case {n}: {status:?}");
        if code == Code::PermissionDenied {
            assert!(
                status.message().contains("outside the allowed roots"),
                "{status:?}"
            );
            outside_messages.push(status.message().replace(&path, "PATH"));
        }
    }
    // An existing directory, a missing one and a symlink escape read the same (per kind),
    // so a refusal reveals nothing about the leader's host.
    let dataset_messages: Vec<_> = outside_messages
        .iter()
        .filter(|m| m.starts_with("dataset"))
        .collect();
    assert_eq!(dataset_messages.len(), 4);
    assert!(
        dataset_messages.windows(2).all(|w| w[0] == w[1]),
        "{dataset_messages:?}"
    );
    assert_eq!(
        std::fs::read_dir(&elsewhere).expect("ls").count(),
        1,
        "nothing created outside the roots"
    );

    let mut evil = spec(s(&datasets.join("set")), s(&ckpt.join("job")));
    evil.name = "x\u{1b}[2J\rjob-000001 succeeded".into();
    let status = client
        .submit_job(submit(100, evil))
        .await
        .expect_err("control characters in the name");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        !status.message().contains('\u{1b}'),
        "the refusal itself is escaped"
    );

    let job_id = client
        .submit_job(submit(
            101,
            spec(s(&datasets.join("set")), s(&ckpt.join("job"))),
        ))
        .await
        .expect("inside the roots")
        .into_inner()
        .job_id;
    let job = cluster.wait_finished(&job_id, LONG).await;
    assert_eq!(job.state, "succeeded", "{job:?}");
    assert!(
        ckpt.join("job").is_dir(),
        "the leader created the checkpoint root"
    );
}
