//! Tests of `cumulusctl local`: free ports, command lines, liveness and readiness
//! checks, `down` and its purge, a missing binary.

use super::*;

#[test]
fn ports_are_distinct_and_nonzero() {
    let ports = free_ports(6).expect("ports");
    let set: std::collections::HashSet<u16> = ports.iter().copied().collect();
    assert_eq!(set.len(), 6);
    assert!(ports.iter().all(|&p| p != 0));
}

#[test]
fn command_lines_follow_the_contract() {
    let dir = Path::new("/tmp/c");
    let f = plan(dir, 3, 2, 4, &[1001, 1002, 1003, 1004, 1005, 1006]);
    assert_eq!(
        coordinator_args(&f, &f.coordinators[1]),
        vec![
            "--node-id",
            "2",
            "--grpc-listen",
            "127.0.0.1:1003",
            "--http-listen",
            "127.0.0.1:1004",
            "--peer",
            "1=127.0.0.1:1001@127.0.0.1:1002",
            "--peer",
            "2=127.0.0.1:1003@127.0.0.1:1004",
            "--peer",
            "3=127.0.0.1:1005@127.0.0.1:1006",
            "--data-dir",
            "/tmp/c/coord-2",
            "--token-file",
            "/tmp/c/token",
            "--peer-token-file",
            "/tmp/c/peer-token",
            "--insecure",
        ]
    );
    let mut want = vec![
        "--worker-id",
        "worker-2",
        "--coordinators",
        "127.0.0.1:1001,127.0.0.1:1003,127.0.0.1:1005",
        "--token-file",
        "/tmp/c/token",
        "--data-dir",
        "/tmp/c/worker-2",
        "--slots",
        "4",
        "--listen",
        "127.0.0.1:0",
    ];
    let ranks = Ranks::Default.worker_flags(true).expect("as root");
    assert_eq!(ranks, ["--run-as", DEFAULT_RANK_UIDS]);
    want.extend(["--run-as", DEFAULT_RANK_UIDS, "--insecure"]);
    assert_eq!(worker_args(&f, &f.workers[1], &ranks), want);
    assert_eq!(f.coordinators[2].log, Path::new("/tmp/c/coord-3.log"));
    f.validate().expect("a plan is a valid cluster file");
    // With a TLS dir, each process gets its own certificate and the CA.
    let mut f = f;
    f.tls_dir = Some(dir.join("tls"));
    let args = worker_args(&f, &f.workers[1], &[]);
    assert_eq!(
        &args[args.len() - 6..],
        [
            "--tls-cert",
            "/tmp/c/tls/worker-2.pem",
            "--tls-key",
            "/tmp/c/tls/worker-2-key.pem",
            "--tls-ca",
            "/tmp/c/tls/ca.pem",
        ]
    );
    let args = coordinator_args(&f, &f.coordinators[0]);
    assert!(
        args.contains(&"/tmp/c/tls/coordinator-1.pem".to_string()),
        "{args:?}"
    );
}

#[test]
fn token_file_is_private_and_64_hex() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("token");
    fs::write(&p, "old").expect("write");
    fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).expect("chmod");
    let t = new_token();
    assert_eq!(t.len(), 64);
    write_token(&p, &t).expect("write");
    assert_eq!(
        fs::metadata(&p).expect("meta").permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(read_token_file(&p).expect("read"), t);
}

#[test]
fn liveness_checks_binary_name_and_data_dir_of_a_real_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("sleep.log");
    let marker = dir.path().join("data");
    fs::write(&marker, "").expect("marker");
    // `tail -f FILE` runs until signalled and has the path among its arguments.
    let tail = find_binary("tail", None).expect("tail in PATH");
    let mut child =
        spawn_detached(&tail, &["-f".into(), marker.display().to_string()], &log).expect("spawn");
    let pid = child.id();
    // `spawn` returns once exec has begun; the kernel sets the new argv a moment
    // later (an empty cmdline until then), so wait for it on a condition.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !is_ours(pid, "tail", &marker) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        is_ours(pid, "tail", &marker),
        "a live child with our argv; log: {}",
        log_tail(&log)
    );
    assert!(
        !is_ours(pid, "cumulus-worker", &marker),
        "wrong binary name"
    );
    assert!(
        !is_ours(pid, "tail", Path::new("/elsewhere")),
        "wrong data dir"
    );
    // Its own process group.
    assert_eq!(
        nix::unistd::getpgid(Some(Pid::from_raw(pid as i32)))
            .expect("pgid")
            .as_raw(),
        pid as i32
    );
    let p = Proc {
        name: "x".into(),
        binary: "tail",
        pid: Some(pid),
        data_dir: marker.clone(),
        log,
    };
    let out = stop_processes(std::slice::from_ref(&p), Duration::from_secs(5));
    let _ = child.wait();
    assert_eq!(out[0].1, StopOutcome::Terminated);
    assert!(!is_ours(pid, "tail", &marker));
}

#[test]
fn readiness_needs_leader_and_every_worker_alive() {
    let mut s = ClusterStatusResponse {
        node_id: 1,
        ..Default::default()
    };
    let want = vec!["worker-1".to_string(), "worker-2".to_string()];
    assert_eq!(
        readiness(&s, &want),
        Err(NotReady::NoLeader {
            node_id: 1,
            term: 0
        })
    );
    s.leader_id = Some(2);
    s.workers.push(cumulus_api::WorkerInfo {
        worker_id: "worker-1".into(),
        state: "alive".into(),
        ..Default::default()
    });
    s.workers.push(cumulus_api::WorkerInfo {
        worker_id: "worker-2".into(),
        state: "expired".into(),
        ..Default::default()
    });
    assert_eq!(
        readiness(&s, &want),
        Err(NotReady::WorkersMissing(vec!["worker-2".into()]))
    );
    s.workers[1].state = "alive".into();
    readiness(&s, &want).expect("ready");
}

#[test]
fn down_without_cluster_file_and_purge_removes_only_ours() {
    let dir = tempfile::tempdir().expect("tempdir");
    assert!(matches!(
        down(dir.path(), false),
        Err(LocalError::NotFound(_))
    ));
    let f = plan(dir.path(), 1, 1, 2, &free_ports(2).expect("ports"));
    for p in processes(&f) {
        fs::create_dir_all(&p.data_dir).expect("mkdir");
        fs::write(&p.log, "log").expect("log");
    }
    write_token(&f.token_file, &new_token()).expect("token");
    let mut g = f.clone();
    g.coordinators[0].pid = Some(1); // init: alive but not ours, so left alone
    g.store(dir.path()).expect("store");
    fs::write(dir.path().join("mine.txt"), "user file").expect("write");
    let out = down(dir.path(), false).expect("down");
    assert!(out.iter().all(|(_, o)| *o == StopOutcome::NotRunning));
    assert_eq!(
        ClusterFile::load(dir.path())
            .expect("load")
            .expect("kept")
            .coordinators[0]
            .pid,
        None
    );
    down(dir.path(), true).expect("purge");
    let left: Vec<String> = fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["mine.txt".to_string()]);
}

#[test]
fn missing_binary_names_where_it_looked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = find_binary("cumulus-does-not-exist", Some(dir.path())).expect_err("absent");
    assert!(err.to_string().contains("--bin-dir"), "{err}");
    let err = find_binary("cumulus-does-not-exist", None).expect_err("absent");
    assert!(err.to_string().contains("PATH"), "{err}");
}

#[test]
fn ranks_run_as_other_users_by_default_only_as_root() {
    assert_eq!(
        Ranks::Default.worker_flags(true).expect("root"),
        ["--run-as", DEFAULT_RANK_UIDS]
    );
    assert_eq!(
        Ranks::RunAs("nobody".into())
            .worker_flags(true)
            .expect("root"),
        ["--run-as", "nobody"]
    );
    assert_eq!(
        Ranks::Root.worker_flags(true).expect("root"),
        ["--allow-root"]
    );
    assert!(
        Ranks::Default
            .worker_flags(false)
            .expect("not root")
            .is_empty()
    );
    for asked in [Ranks::Root, Ranks::RunAs("60000-60009".into())] {
        let err = asked.worker_flags(false).expect_err("needs root");
        assert!(
            err.to_string()
                .contains("need `cumulusctl local up` to run as root"),
            "{err}"
        );
    }
    assert!(ranks_text(&["--run-as".into(), "60000-60999".into()]).contains("ids 60000-60999"));
    assert!(ranks_text(&["--allow-root".into()]).starts_with("root"));
}

#[test]
fn a_local_dir_closed_to_others_is_refused_before_anything_starts() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    let closed = tmp.path().join("closed");
    let dir = closed.join("cluster");
    fs::create_dir_all(&dir).expect("mkdir");
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).expect("chmod");
    assert_eq!(
        closed_to_others(&dir).expect("inspect"),
        Some((closed.clone(), 0o700))
    );
    let err = check_other_user_ranks(&dir, DEFAULT_RANK_UIDS).expect_err("closed");
    let text = err.to_string();
    assert!(
        text.contains(&format!("{} is mode 0700", closed.display()))
            && text.contains("--local-dir")
            && text.contains("--allow-root"),
        "{text}"
    );
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o711)).expect("chmod");
    assert_eq!(closed_to_others(&dir).expect("inspect"), None);
}

#[test]
fn uid_ranges_must_lie_inside_the_user_namespace() {
    let full = "         0          0 4294967295\n";
    assert!(ids_mapped(full, 60000, 60999));
    // A rootless container: 65536 ids.
    let rootless = "0 1000 1\n1 100000 65536\n";
    assert!(ids_mapped(rootless, 60000, 60999));
    assert!(!ids_mapped(rootless, 60000, 70000));
    assert!(!ids_mapped("0 1000 1\n", 60000, 60999));
    assert!(!ids_mapped("", 1, 1));
}
