//! Users and roles against a real cluster: an administrator (the cluster token) creates
//! users with `submit` and `read` roles; a job records who submitted it; a reader can
//! look but not submit or cancel; a submitter cannot cancel another user's job, read its
//! logs, create users or change the membership; the owner can cancel their own job; a
//! revoked token is refused; users survive a change of leader (they are replicated);
//! `cumulusctl token create/ls/revoke` and `whoami` work; `token create --out` onto an
//! existing file creates no user; `cumulusctl logs` refused with 403 stops at once with
//! the coordinator's message; the data dirs holding the tokens' hashes are private.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cumulus_api::{JobState, v1};
use cumulus_coordinator::auth::USER_CERT_SKEW_MS;
use cumulus_e2e::{Client, Cluster, ClusterOpts, wait_for};
use tonic::Code;

const LONG: Duration = Duration::from_secs(120);

async fn create_user(admin: &mut Client, name: &str, role: &str) -> String {
    admin
        .create_user(v1::CreateUserRequest {
            name: name.into(),
            role: role.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"))
        .into_inner()
        .token
}

fn sleeper() -> v1::JobSpec {
    v1::JobSpec {
        world_size: 1,
        command: vec!["sh".into(), "-c".into(), "exec sleep 600".into()],
        ..Default::default()
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected a refusal, got {v:?}"),
        Err(s) => s.code(),
    }
}

// One scenario, each role's rights checked in turn: read in order.
#[allow(clippy::too_many_lines)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_limit_what_each_user_may_do() {
    let mut cluster = Cluster::start(ClusterOpts {
        workers: 1,
        // 8 log streams a node: a user's share is 2, the administrators' reserve 1.
        coordinator_args: vec!["--max-log-streams".into(), "8".into()],
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    cluster.wait_leader(LONG).await;
    let mut admin = cluster.leader_client().await.expect("admin client");
    let alice = create_user(&mut admin, "alice", "submit").await;
    let bob = create_user(&mut admin, "bob", "submit").await;
    let reader = create_user(&mut admin, "reader", "read").await;
    assert!(alice.starts_with("cu.alice."), "{alice}");
    // The same name twice, a reserved or bad name, an unknown role: refused.
    for (name, role) in [
        ("alice", "read"),
        ("admin", "read"),
        ("Bad", "read"),
        ("carl", "root"),
    ] {
        let r = admin
            .create_user(v1::CreateUserRequest {
                name: name.into(),
                role: role.into(),
            })
            .await;
        assert!(r.is_err(), "{name} {role}");
    }

    // Alice submits: the job is hers.
    let mut as_alice = cluster.leader_client_as(&alice).await.expect("alice");
    let job = as_alice
        .submit_job(v1::SubmitJobRequest {
            allow_pending: false,
            request_id: "alice-1".into(),
            spec: Some(sleeper()),
        })
        .await
        .expect("alice submits")
        .into_inner()
        .job_id;
    let seen = cluster
        .wait_job(&job, "running", LONG, |j| {
            j.job_state() == Ok(JobState::Running)
        })
        .await;
    assert_eq!(seen.owner, "alice");

    // A reader reads, but neither submits nor cancels.
    let mut as_reader = cluster.leader_client_as(&reader).await.expect("reader");
    let listed = as_reader
        .list_jobs(v1::ListJobsRequest { linearizable: true })
        .await
        .expect("reader lists")
        .into_inner();
    assert!(listed.jobs.iter().any(|j| j.id == job));
    let r = as_reader
        .submit_job(v1::SubmitJobRequest {
            allow_pending: false,
            request_id: "reader-1".into(),
            spec: Some(sleeper()),
        })
        .await;
    assert_eq!(code(r), Code::PermissionDenied);
    let r = as_reader
        .cancel_job(v1::CancelJobRequest {
            job_id: job.clone(),
        })
        .await;
    assert_eq!(code(r), Code::PermissionDenied);

    // A reader may hold its share of a node's log streams, not more (it once held all
    // of them and the administrator got 503); the administrator still gets one.
    let leader = cluster.wait_leader(LONG).await;
    let http_addr = cluster
        .coordinators
        .iter()
        .find(|c| c.id == leader)
        .expect("the leader")
        .http
        .clone();
    let logs_url = cluster.url(&http_addr, &format!("/v1/jobs/{job}/logs?follow=true"));
    let http = cluster.http_client();
    let open_stream = |token: String| {
        let (http, url) = (http.clone(), logs_url.clone());
        async move {
            http.get(&url)
                .bearer_auth(token)
                .send()
                .await
                .expect("the log request is answered")
        }
    };
    let mut streams = Vec::new();
    for _ in 0..2 {
        let r = open_stream(reader.clone()).await;
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        streams.push(r);
    }
    let over = open_stream(reader.clone()).await;
    assert_eq!(over.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    let body = over.text().await.expect("body");
    assert!(body.contains("share"), "{body}");
    let admin_stream = open_stream(cumulus_e2e::TOKEN.to_string()).await;
    assert_eq!(admin_stream.status(), reqwest::StatusCode::OK);
    drop((streams, admin_stream));

    // Bob may not cancel Alice's job, create users or change the membership.
    let mut as_bob = cluster.leader_client_as(&bob).await.expect("bob");
    let refused = as_bob
        .cancel_job(v1::CancelJobRequest {
            job_id: job.clone(),
        })
        .await
        .expect_err("bob cancels alice's job");
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(refused.message().contains("belongs to alice"), "{refused}");
    let r = as_bob
        .create_user(v1::CreateUserRequest {
            name: "mallory".into(),
            role: "admin".into(),
        })
        .await;
    assert_eq!(code(r), Code::PermissionDenied);
    let r = as_bob
        .remove_member(v1::RemoveMemberRequest { node_id: 1 })
        .await;
    assert_eq!(code(r), Code::PermissionDenied);
    let me = as_bob
        .who_am_i(v1::WhoAmIRequest {})
        .await
        .expect("whoami")
        .into_inner();
    assert_eq!((me.name.as_str(), me.role.as_str()), ("bob", "submit"));

    // Logs over HTTPS: Bob may not read Alice's, the reader may.
    let http = cluster.http_client();
    let leader = cluster.wait_leader(LONG).await;
    let i = cluster.index_of(leader).expect("leader index");
    let url = cluster.url(
        &cluster.coordinators[i].http,
        &format!("/v1/jobs/{job}/logs?follow=false"),
    );
    for (token, want) in [(&bob, 403), (&reader, 200), (&alice, 200)] {
        let status = http
            .get(&url)
            .bearer_auth(token)
            .send()
            .await
            .expect("GET logs")
            .status();
        assert_eq!(status.as_u16(), want, "logs as {}", &token[..9]);
    }
    // `cumulusctl logs` takes the 403 as final: the coordinator's reason, no retries.
    let bob_file = cluster.dir.path().join("bob.token");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&bob_file)
            .and_then(|mut f| f.write_all(format!("{bob}\n").as_bytes()))
            .expect("bob's token file");
    }
    let out = ctl_with_token(&cluster, &bob_file, &["logs", &job]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("may not read the logs of") && stderr.contains("belongs to alice"),
        "{stderr}"
    );
    assert!(!stderr.contains("consecutive"), "retried: {stderr}");

    // Users are replicated: after the leader dies, the new leader knows them.
    cluster.coordinators[i].proc.kill9();
    let mut as_bob = wait_for("a new leader that knows bob", LONG, || async {
        let mut c = cluster.leader_client_as(&bob).await.ok()?;
        c.who_am_i(v1::WhoAmIRequest {}).await.ok()?;
        Some(c)
    })
    .await;
    let r = as_bob
        .cancel_job(v1::CancelJobRequest {
            job_id: job.clone(),
        })
        .await;
    assert_eq!(code(r), Code::PermissionDenied);

    // Alice cancels her own job.
    let mut as_alice = cluster.leader_client_as(&alice).await.expect("alice");
    as_alice
        .cancel_job(v1::CancelJobRequest {
            job_id: job.clone(),
        })
        .await
        .expect("alice cancels her job");
    cluster.wait_finished(&job, LONG).await;

    // Revoked: refused as unauthenticated, like any wrong token.
    let mut admin = cluster.leader_client().await.expect("admin");
    admin
        .revoke_user(v1::RevokeUserRequest {
            name: "alice".into(),
        })
        .await
        .expect("revoke");
    let r = as_alice.who_am_i(v1::WhoAmIRequest {}).await;
    assert_eq!(code(r), Code::Unauthenticated);

    // The CLI: create (token printed once), list, revoke.
    let out = cluster
        .cumulusctl(&["token", "create", "carol", "--role", "read"])
        .expect("cumulusctl token create");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("cu.carol."),
        "{stdout}"
    );
    let out = cluster.cumulusctl(&["token", "ls"]).expect("token ls");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for user in ["bob", "carol", "reader"] {
        assert!(stdout.contains(user), "{stdout}");
    }
    assert!(
        !stdout.contains("alice"),
        "revoked users are gone: {stdout}"
    );
    assert!(!stdout.contains("cu."), "ls never shows a token: {stdout}");
    let out = cluster.cumulusctl(&["whoami"]).expect("whoami");
    assert!(String::from_utf8_lossy(&out.stdout).contains("admin (role admin)"));

    // `--out` onto an existing file: refused before the user exists, the file untouched.
    let existing = cluster.dir.path().join("existing");
    std::fs::write(&existing, "keep\n").expect("write");
    let out = cluster
        .cumulusctl(&[
            "token",
            "create",
            "dave",
            "--role",
            "read",
            "--out",
            &existing.display().to_string(),
        ])
        .expect("cumulusctl token create --out");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no user was created"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&existing).expect("read"), "keep\n");
    let out = cluster.cumulusctl(&["token", "ls"]).expect("token ls");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("dave"),
        "dave was created"
    );
    // A new file: the user is created and the token written there, 0600.
    let fresh = cluster.dir.path().join("dave.token");
    let fresh_arg = fresh.display().to_string();
    let out = cluster
        .cumulusctl(&[
            "token", "create", "dave", "--role", "read", "--out", &fresh_arg,
        ])
        .expect("cumulusctl token create --out");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read_to_string(&fresh).expect("token file");
    assert!(written.starts_with("cu.dave."), "{written}");
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| {
        std::fs::symlink_metadata(p)
            .expect("stat")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(&fresh), 0o600);
    // Refused by the cluster (the name is taken): the file it had created is removed.
    let again = cluster.dir.path().join("dave-again.token");
    let out = cluster
        .cumulusctl(&[
            "token",
            "create",
            "dave",
            "--role",
            "read",
            "--out",
            &again.display().to_string(),
        ])
        .expect("cumulusctl token create --out");
    assert!(!out.status.success());
    assert!(!again.exists(), "the empty token file is left behind");

    // The data dirs hold the Raft log (token hashes, job environments) and the ranks'
    // logs: closed to other users, every entry of a coordinator's without group or other
    // permission.
    for c in &cluster.coordinators {
        assert_eq!(mode(&c.data_dir), 0o700, "{}", c.data_dir.display());
        let mut dirs = vec![c.data_dir.join("raft")];
        let mut files = 0;
        while let Some(dir) = dirs.pop() {
            assert_eq!(mode(&dir) & 0o077, 0, "{}", dir.display());
            for entry in std::fs::read_dir(&dir).expect("read_dir") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    dirs.push(path);
                } else {
                    assert_eq!(mode(&path) & 0o077, 0, "{}", path.display());
                    files += 1;
                }
            }
        }
        assert!(files > 0, "no file in {}", c.data_dir.display());
    }
    let worker_dir = cluster.dir.path().join("worker-1");
    assert_eq!(mode(&worker_dir), 0o700);
    assert_eq!(mode(&worker_dir.join("logs")), 0o700);
}

/// `cumulusctl` with the token in `token_file` instead of the cluster's.
fn ctl_with_token(
    cluster: &Cluster,
    token_file: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    let mut cmd = std::process::Command::new(cumulus_e2e::bin("cumulusctl"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CUMULUS_") {
            cmd.env_remove(name);
        }
    }
    match cluster.ca_file() {
        Some(ca) => cmd.arg("--tls-ca").arg(ca),
        None => cmd.arg("--insecure"),
    };
    cmd.arg("--addr")
        .arg(cluster.grpc_addrs())
        .arg("--http")
        .arg(cluster.http_addrs())
        .arg("--token-file")
        .arg(token_file)
        .arg("--timeout")
        .arg("20")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run cumulusctl")
}

/// `cumulusctl` with a user's client certificate and no token (no token file, no
/// `CUMULUS_TOKEN*` from the test's environment).
fn ctl_with_cert(
    cluster: &Cluster,
    cert: &std::path::Path,
    key: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    let ca = cluster.ca_file().expect("a TLS cluster");
    let mut cmd = std::process::Command::new(cumulus_e2e::bin("cumulusctl"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CUMULUS_") {
            cmd.env_remove(name);
        }
    }
    cmd.arg("--tls-ca")
        .arg(ca)
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .arg("--addr")
        .arg(cluster.grpc_addrs())
        .arg("--http")
        .arg(cluster.http_addrs())
        .arg("--timeout")
        .arg("20")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run cumulusctl")
}

/// A client certificate issued by the cluster CA for a user (`certs issue user NAME`)
/// authenticates as that user, with the role the cluster gave them, over gRPC and HTTPS
/// (logs), with no token; it cannot act beyond that role; revoking the user revokes the
/// certificate, also once the name is given to a user again (a certificate issued before
/// the new user's creation is refused as an unknown user's; a new one works); a
/// worker's certificate is not a user's.
// One scenario (issue, use, revoke, reuse the name): read in order.
#[allow(clippy::too_many_lines)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_name_users() {
    let cluster = Cluster::start(ClusterOpts {
        workers: 1,
        ..ClusterOpts::default()
    })
    .await
    .expect("cluster");
    let mut admin = cluster.leader_client().await.expect("admin client");
    create_user(&mut admin, "dave", "submit").await;
    let admin_job = admin
        .submit_job(v1::SubmitJobRequest {
            allow_pending: false,
            request_id: "admins".into(),
            spec: Some(sleeper()),
        })
        .await
        .expect("admin submit")
        .into_inner()
        .job_id;

    let tls_dir = cluster
        .ca_file()
        .expect("a TLS cluster")
        .parent()
        .expect("the CA's dir")
        .to_path_buf();
    let out = cluster
        .cumulusctl(&[
            "certs",
            "issue",
            "user",
            "dave",
            "--dir",
            &tls_dir.display().to_string(),
        ])
        .expect("certs issue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cert = tls_dir.join("user-dave.pem");
    let key = tls_dir.join("user-dave-key.pem");

    let out = ctl_with_cert(&cluster, &cert, &key, &["whoami"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("dave (role submit)"),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // An administrator's token in the environment does not replace the certificate.
    let ca = cluster.ca_file().expect("a TLS cluster");
    let out = std::process::Command::new(cumulus_e2e::bin("cumulusctl"))
        .env("CUMULUS_TOKEN_FILE", cluster.token_file())
        .env("CUMULUS_TLS_CA", &ca)
        .env("CUMULUS_TLS_CERT", &cert)
        .env("CUMULUS_TLS_KEY", &key)
        .env("CUMULUS_ADDR", cluster.grpc_addrs())
        .arg("whoami")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run cumulusctl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("dave (role submit)"),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl_with_cert(
        &cluster,
        &cert,
        &key,
        &[
            "submit",
            "-o",
            "json",
            "--world-size",
            "1",
            "--name",
            "daves",
            "--",
            "sh",
            "-c",
            "echo hello-from-dave; exec sleep 600",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let submitted: serde_json::Value = serde_json::from_slice(&out.stdout).expect("submit -o json");
    let job_id = submitted["job_id"]
        .as_str()
        .or_else(|| submitted["id"].as_str())
        .unwrap_or_else(|| panic!("no job id in {submitted}"))
        .to_string();
    let job = cluster.job(&job_id).await.expect("dave's job");
    assert_eq!(job.owner, "dave");
    // Its logs over HTTPS, with the certificate alone.
    wait_for("dave's job's output through the certificate", LONG, || {
        let out = ctl_with_cert(&cluster, &cert, &key, &["logs", &job_id]);
        let seen = String::from_utf8_lossy(&out.stdout).contains("hello-from-dave");
        async move { seen.then_some(()) }
    })
    .await;
    // Not beyond the role: another user's job.
    let out = ctl_with_cert(&cluster, &cert, &key, &["cancel", &admin_job]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("user dave may not cancel"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl_with_cert(&cluster, &cert, &key, &["cancel", &job_id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A certificate issued for this dave as early as the rule allows (USER_CERT_SKEW_MS
    // before their creation, to the second above) also authenticates as them.
    let created = |users: v1::ListUsersResponse| {
        users
            .users
            .iter()
            .find(|u| u.name == "dave")
            .map(|u| u.created_at_ms)
            .expect("dave is listed")
    };
    let first_created_ms = created(
        admin
            .list_users(v1::ListUsersRequest {})
            .await
            .expect("list users")
            .into_inner(),
    );
    let early_ms = (first_created_ms - USER_CERT_SKEW_MS).div_ceil(1000) * 1000;
    let ca = cumulus_tls::generate::ClusterCa::load(
        &tls_dir.join(cumulus_tls::generate::CA_FILE),
        &tls_dir.join(cumulus_tls::generate::CA_KEY_FILE),
    )
    .expect("the cluster CA");
    let early = ca
        .issue_valid_from(
            &cumulus_tls::Identity::User("dave".into()),
            &[],
            UNIX_EPOCH + Duration::from_millis(early_ms),
        )
        .expect("issue")
        .write(&tls_dir, "user-dave-early")
        .expect("write");
    let out = ctl_with_cert(&cluster, &early.cert, &early.key, &["whoami"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("dave (role submit)"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Revoking the user revokes the certificate.
    admin
        .revoke_user(v1::RevokeUserRequest {
            name: "dave".into(),
        })
        .await
        .expect("revoke");
    let out = ctl_with_cert(&cluster, &cert, &key, &["whoami"]);
    assert!(!out.status.success());
    let unknown_user = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        unknown_user.contains("token") || unknown_user.contains("authenticat"),
        "{unknown_user}"
    );

    // The name given again (another person, another role): the certificate issued for
    // the earlier dave, now more than USER_CERT_SKEW_MS before the new dave's creation,
    // is refused as an unknown user's; one issued after the creation names the new dave.
    wait_for(
        "the clock to pass the first dave's creation by a second",
        LONG,
        || {
            let now_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("after 1970")
                .as_millis();
            async move { (now_ms > u128::from(first_created_ms) + 1000).then_some(()) }
        },
    )
    .await;
    create_user(&mut admin, "dave", "read").await;
    let second_created_ms = created(
        admin
            .list_users(v1::ListUsersRequest {})
            .await
            .expect("list users")
            .into_inner(),
    );
    assert!(early_ms < second_created_ms - USER_CERT_SKEW_MS);
    let out = ctl_with_cert(&cluster, &early.cert, &early.key, &["whoami"]);
    assert!(!out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr), unknown_user);
    let out = cluster
        .cumulusctl(&[
            "certs",
            "issue",
            "user",
            "dave",
            "--dir",
            &tls_dir.display().to_string(),
        ])
        .expect("certs issue");
    assert!(out.status.success());
    let out = ctl_with_cert(&cluster, &cert, &key, &["whoami"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("dave (role read)"),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Over HTTPS (the logs) alike: the earlier dave's job's output, to the new dave only.
    let out = ctl_with_cert(&cluster, &early.cert, &early.key, &["logs", &job_id]);
    assert!(
        !out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("hello-from-dave"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl_with_cert(&cluster, &cert, &key, &["logs", &job_id]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("hello-from-dave"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A worker's certificate does not name a user.
    let out = cluster
        .cumulusctl(&[
            "certs",
            "issue",
            "worker",
            "w-9",
            "--dir",
            &tls_dir.display().to_string(),
        ])
        .expect("certs issue worker");
    assert!(out.status.success());
    let out = ctl_with_cert(
        &cluster,
        &tls_dir.join("w-9.pem"),
        &tls_dir.join("w-9-key.pem"),
        &["whoami"],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not of a user"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
