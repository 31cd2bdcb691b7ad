//! The storage faults: a bit flipped in a stopped follower's raft log
//! ([`corrupt_and_rebuild`]) or in its sled database or generation file
//! ([`corrupt_sled`]), and the rebuild of a damaged coordinator as an operator would do
//! it ([`rebuild_coordinator`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use cumulus_api::v1;
use rand::RngExt;
use rand::rngs::StdRng;

use super::{HARNESS_CALL, LONG, Report, SLED_RESTART_DEADLINE};
use crate::Cluster;
use crate::history::Anomaly;

/// Records an anomaly of the cluster (not of one job).
fn cluster_anomaly(anomalies: &mut Vec<Anomaly>, what: String) {
    anomalies.push(Anomaly {
        job_id: "-".into(),
        what,
    });
}

/// Flips one random bit of `file` among its bytes up to its last non-zero one (where
/// what was written ends; a preallocated zero tail is never read) and syncs it. Returns
/// the offset and the bit's mask; `None` (nothing flipped) when every byte is zero.
fn flip_a_bit(file: &Path, rng: &mut StdRng) -> anyhow::Result<Option<(u64, u8)>> {
    use std::os::unix::fs::FileExt;
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let Some(last) = bytes.iter().rposition(|b| *b != 0) else {
        return Ok(None);
    };
    let at = rng.random_range(0..=last);
    let mask = 1u8 << rng.random_range(0..8u32);
    let f = std::fs::OpenOptions::new().write(true).open(file)?;
    f.write_all_at(&[bytes[at] ^ mask], at as u64)?;
    f.sync_all()?;
    Ok(Some((at as u64, mask)))
}

/// The exit status of coordinator `i` when it has exited (it is then reaped and
/// forgotten: [`repair`](super::faults::repair) would start it again), `None` while it runs.
fn reap_coordinator(
    cluster: &mut Cluster,
    i: usize,
) -> anyhow::Result<Option<std::process::ExitStatus>> {
    let Some(child) = cluster.coordinators[i].proc.child.as_mut() else {
        anyhow::bail!("coordinator {} is not running", cluster.coordinators[i].id);
    };
    let status = child.try_wait()?;
    if status.is_some() {
        cluster.coordinators[i].proc.child = None;
    }
    Ok(status)
}

/// Length of a log file (where what a process writes next starts).
fn log_len(log: &Path) -> u64 {
    std::fs::metadata(log).map_or(0, |m| m.len())
}

/// What a process wrote to `log` after byte `from`.
fn log_since(log: &Path, from: u64) -> String {
    let bytes = std::fs::read(log).unwrap_or_default();
    String::from_utf8_lossy(bytes.get(from as usize..).unwrap_or_default()).into_owned()
}

/// Stops follower `i`, flips one bit among the records of its raft log's newest segment
/// that holds any, and restarts it: it must refuse to start (an anomaly if it runs).
/// Then rebuilds it as an operator would ([`rebuild_coordinator`]).
pub(super) async fn corrupt_and_rebuild(
    cluster: &mut Cluster,
    i: usize,
    rng: &mut StdRng,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    cluster.coordinators[i].proc.kill9();
    let wal = cluster.coordinators[i].data_dir.join("raft").join("wal");
    let mut segments: Vec<PathBuf> = std::fs::read_dir(&wal)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    segments.sort();
    let mut flipped = false;
    for seg in segments.iter().rev() {
        if flip_a_bit(seg, rng)?.is_some() {
            flipped = true;
            break;
        }
    }
    if !flipped {
        return Ok(()); // nothing written yet: an ordinary restart
    }
    let id = cluster.coordinators[i].id;
    cluster.spawn_coordinator(i)?;
    let give_up = Instant::now() + LONG;
    let exited = loop {
        if let Some(status) = reap_coordinator(cluster, i)? {
            break Some(status);
        }
        if Instant::now() > give_up {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if exited.is_none_or(|s| s.success()) {
        cluster_anomaly(
            anomalies,
            format!(
                "coordinator {id} started (or did not exit within {LONG:?}) with a flipped bit in its raft log"
            ),
        );
        return Ok(());
    }
    rebuild_coordinator(cluster, i, anomalies).await
}

/// Rebuilds coordinator `i`, down with a damaged data dir, as an operator would:
/// `cluster remove`, a restart with `--rejoin-empty` (which moves the data dir aside),
/// `cluster add-learner`, `cluster promote`. A step that fails is an anomaly.
async fn rebuild_coordinator(
    cluster: &mut Cluster,
    i: usize,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    /// Runs cumulusctl; its stderr is the error when it fails.
    fn ctl(cluster: &Cluster, args: &[&str]) -> anyhow::Result<()> {
        let out = cluster.cumulusctl(args)?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
    let id = cluster.coordinators[i].id;
    if let Err(e) = ctl(cluster, &["cluster", "remove", &id.to_string()]) {
        cluster_anomaly(
            anomalies,
            format!("cannot remove damaged coordinator {id}: {e}"),
        );
        return Ok(());
    }
    // `--rejoin-empty` checks the membership with every other coordinator: it gets all
    // of them as peers, even on a node that joined before (a second corruption).
    cluster.coordinators[i].extra_args = vec!["--rejoin-empty".into()];
    cluster.coordinators[i].join = false;
    // `--rejoin-empty` asks the others whether it is still a voter; one that has not
    // applied the removal yet says so, and the node exits: start it again (bounded).
    let mut attempts = 0;
    loop {
        attempts += 1;
        cluster.spawn_coordinator(i)?;
        let settled = Instant::now() + Duration::from_secs(5);
        let mut exited = false;
        while Instant::now() < settled {
            if reap_coordinator(cluster, i)?.is_some() {
                exited = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !exited {
            break;
        }
        if attempts >= 10 {
            cluster_anomaly(
                anomalies,
                format!(
                    "coordinator {id} started with --rejoin-empty exited {attempts} times after its removal"
                ),
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // From now on it is a member that joined: a later restart must never bootstrap.
    cluster.coordinators[i].extra_args.clear();
    cluster.coordinators[i].join = true;
    let addr = cluster.member_addr(i);
    let id_text = id.to_string();
    for step in [
        vec!["cluster", "add-learner", id_text.as_str(), addr.as_str()],
        vec!["cluster", "promote", id_text.as_str()],
    ] {
        if let Err(e) = ctl(cluster, &step) {
            cluster_anomaly(
                anomalies,
                format!("cannot rebuild coordinator {id} ({step:?}): {e}"),
            );
            return Ok(());
        }
    }
    Ok(())
}

/// The generation file of the raft metadata, beside sled's files
/// (`cumulus_raft_store::record::GENERATION_FILE`).
const GENERATION_FILE: &str = "meta.generation";

/// The file of a stopped coordinator's raft directory to damage: sled's log (`db`) half
/// the time, the generation file a quarter, otherwise one of sled's other files (`conf`,
/// its snapshots `snap.*`, `blobs/*`), each as likely; `db` when the one chosen does not
/// exist. `None` when there is no sled database yet.
fn pick_sled_file(raft: &Path, rng: &mut StdRng) -> anyhow::Result<Option<PathBuf>> {
    let mut others = Vec::new();
    for e in std::fs::read_dir(raft)? {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "blobs" && path.is_dir() {
            for b in std::fs::read_dir(&path)? {
                let b = b?.path();
                if b.is_file() {
                    others.push(b);
                }
            }
        } else if path.is_file() && name != "db" && name != GENERATION_FILE {
            others.push(path);
        }
    }
    others.sort();
    let db = raft.join("db");
    let pick = match rng.random_range(0..4u32) {
        0 | 1 => db.clone(),
        2 => raft.join(GENERATION_FILE),
        _ if !others.is_empty() => others[rng.random_range(0..others.len())].clone(),
        _ => db.clone(),
    };
    Ok([pick, db].into_iter().find(|p| p.is_file()))
}

/// Whether a refusal's message says what is damaged (sled's database, one of its
/// records, or the generation file).
fn names_the_damage(message: &str) -> bool {
    ["sled", "generation file", "corrupt", "damaged"]
        .iter()
        .any(|w| message.contains(w))
}

/// The line of a coordinator's log that says why it exited (`Error: ...`, as its `main`
/// prints it), else its last line; at most 400 characters.
fn exit_message(log: &str) -> String {
    let line = log
        .lines()
        .find(|l| l.starts_with("Error:"))
        .or_else(|| log.lines().rev().find(|l| !l.trim().is_empty()))
        .unwrap_or("");
    line.chars().take(400).collect()
}

/// `fut`, bounded by [`HARNESS_CALL`]; `None` when it did not answer in time.
async fn bounded<T>(fut: impl std::future::Future<Output = Option<T>>) -> Option<T> {
    tokio::time::timeout(HARNESS_CALL, fut).await.ok().flatten()
}

/// The `corrupt-follower-sled` fault: stops follower `i`, flips one random bit of its
/// sled database or of its generation file ([`pick_sled_file`]), and restarts it.
/// Either it refuses to start, exiting non-zero with a message naming the damage, and is
/// rebuilt ([`rebuild_coordinator`]); or the bit lay in bytes nobody reads (sled's free
/// space, old pages) and it becomes a caught-up member again within
/// [`SLED_RESTART_DEADLINE`], holding every job the leader listed before the kill.
/// Anomalies: it exits 0, panics, or exits without naming the damage; it restarts at a
/// term below the one it had, or leads at a term below the cluster's; it misses a job;
/// it neither exits nor catches up in time (then it is stopped and rebuilt).
pub(super) async fn corrupt_sled(
    cluster: &mut Cluster,
    i: usize,
    rng: &mut StdRng,
    report: &mut Report,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<()> {
    let id = cluster.coordinators[i].id;
    let anomalies_before = anomalies.len();
    let before = before_the_kill(cluster, i).await;

    cluster.coordinators[i].proc.kill9();
    let data_dir = cluster.coordinators[i].data_dir.clone();
    let raft = data_dir.join("raft");
    let Some(file) = pick_sled_file(&raft, rng)? else {
        return Ok(()); // no sled database yet: an ordinary restart
    };
    let Some((at, mask)) = flip_a_bit(&file, rng)? else {
        return Ok(());
    };
    let place = format!(
        "coordinator {id}: bit {mask:#04x} of byte {at} of {}",
        file.strip_prefix(&data_dir).unwrap_or(&file).display()
    );
    eprintln!("nemesis: corrupt-follower-sled: flipped {place}");
    let log = cluster.coordinators[i].proc.log.clone();
    let from = log_len(&log);
    cluster.spawn_coordinator(i)?;
    let started = Instant::now();
    let restart = watch_the_restart(cluster, i, started, &place, &before, anomalies).await?;
    let outcome = if let Some(status) = restart.exited {
        let said = log_since(&log, from);
        let message = exit_message(&said);
        if status.success() {
            cluster_anomaly(
                anomalies,
                format!("{place}: it exited 0 after its restart: {message}"),
            );
        } else if said.contains("panicked") {
            cluster_anomaly(
                anomalies,
                format!("{place}: it panicked instead of refusing to start: {message}"),
            );
        } else if !names_the_damage(&message) {
            cluster_anomaly(
                anomalies,
                format!("{place}: it exited ({status}) without naming the damage: {message}"),
            );
        }
        rebuild_coordinator(cluster, i, anomalies).await?;
        // A node that answered first stopped later on (fail-stop on damage it read).
        let when = if restart.answered {
            " after it answered"
        } else {
            ""
        };
        format!("refused ({status}){when}: {message}")
    } else if restart.healthy {
        holds_every_job_listed(cluster, i, &place, &before, anomalies).await;
        format!(
            "started, a caught-up voter again after {} ms",
            started.elapsed().as_millis()
        )
    } else {
        cluster_anomaly(
            anomalies,
            format!(
                "{place}: it neither refused to start nor caught up (index {}) within {SLED_RESTART_DEADLINE:?}",
                before.caught_up_at
            ),
        );
        cluster.coordinators[i].proc.kill9();
        rebuild_coordinator(cluster, i, anomalies).await?;
        "neither refused nor caught up".to_string()
    };
    let kind = if anomalies.len() > anomalies_before {
        "anomaly"
    } else if restart.exited.is_some() {
        "refused"
    } else {
        "started"
    };
    eprintln!("nemesis: corrupt-follower-sled: {place}: {kind}: {outcome}");
    *report.sled_outcomes.entry(kind.into()).or_default() += 1;
    report
        .sled_flips
        .push(format!("{place}: {kind}: {outcome}"));
    Ok(())
}

/// What [`corrupt_sled`] learns before it kills the follower.
struct BeforeKill {
    /// The node's own term (restarting below it means it lost its vote).
    own_term: Option<u64>,
    /// Every job the leader lists.
    listed: Option<Vec<String>>,
    /// The leader's term.
    cluster_term: u64,
    /// The leader's commit index: the restarted node holds every listed job once it has
    /// applied that far.
    caught_up_at: u64,
}

/// Before the kill: the node's own term, every job the leader lists, and then the
/// leader's term and commit index.
async fn before_the_kill(cluster: &Cluster, i: usize) -> BeforeKill {
    let own_term = bounded(cluster.status_of(i)).await.map(|s| s.term);
    let listed: Option<Vec<String>> = bounded(async {
        let mut c = cluster.leader_client().await.ok()?;
        let r = c
            .list_jobs(v1::ListJobsRequest { linearizable: true })
            .await
            .ok()?;
        Some(r.into_inner().jobs.into_iter().map(|j| j.id).collect())
    })
    .await;
    let leader_status = bounded(async {
        let leader = cluster.status().await?.leader_id?;
        cluster.status_of(cluster.index_of(leader)?).await
    })
    .await;
    let cluster_term = leader_status.as_ref().map_or(0, |s| s.term);
    let caught_up_at = leader_status
        .as_ref()
        .and_then(|s| s.commit_index)
        .unwrap_or(0);
    BeforeKill {
        own_term,
        listed,
        cluster_term,
        caught_up_at,
    }
}

/// How the restarted follower behaved within [`SLED_RESTART_DEADLINE`].
struct Restart {
    /// It answered a status request at least once.
    answered: bool,
    /// It exited (and was reaped), with this status.
    exited: Option<std::process::ExitStatus>,
    /// It became a caught-up voter under a leader.
    healthy: bool,
}

/// Watches follower `i`, restarted at `started`, until it exits, becomes a caught-up
/// voter, or [`SLED_RESTART_DEADLINE`] passes; a term below its own before the kill, or leading at
/// a term below the cluster's, is an anomaly (once each).
async fn watch_the_restart(
    cluster: &mut Cluster,
    i: usize,
    started: Instant,
    place: &str,
    before: &BeforeKill,
    anomalies: &mut Vec<Anomaly>,
) -> anyhow::Result<Restart> {
    let id = cluster.coordinators[i].id;
    let cluster_term = before.cluster_term;
    let mut answered = false;
    let mut lower_term_seen = false;
    let mut led_stale = false;
    let mut exited = None;
    let mut healthy = false;
    while started.elapsed() < SLED_RESTART_DEADLINE {
        if let Some(status) = reap_coordinator(cluster, i)? {
            exited = Some(status);
            break;
        }
        if let Some(s) = bounded(cluster.status_of(i)).await {
            answered = true;
            if let Some(before) = before.own_term
                && s.term < before
                && !lower_term_seen
            {
                lower_term_seen = true;
                cluster_anomaly(
                    anomalies,
                    format!(
                        "{place}: it restarted at term {} below its term {before} before the kill (a lost vote)",
                        s.term
                    ),
                );
            }
            if s.leader_id == Some(id) && s.term < cluster_term && !led_stale {
                led_stale = true;
                cluster_anomaly(
                    anomalies,
                    format!(
                        "{place}: it serves as leader at term {} below the cluster's term {cluster_term}",
                        s.term
                    ),
                );
            }
            let member = s.members.iter().any(|m| m.node_id == id && m.voter);
            if s.leader_id.is_some()
                && member
                && s.last_applied_index.unwrap_or(0) >= before.caught_up_at
            {
                healthy = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Restart {
        answered,
        exited,
        healthy,
    })
}

/// Every job the leader listed before the kill, in caught-up follower `i`'s own state;
/// a job missing, or no answer, is an anomaly.
async fn holds_every_job_listed(
    cluster: &Cluster,
    i: usize,
    place: &str,
    before: &BeforeKill,
    anomalies: &mut Vec<Anomaly>,
) {
    let Some(listed) = &before.listed else {
        return;
    };
    let local: Option<Vec<String>> = bounded(async {
        let mut c = cluster.client_of(i).await.ok()?;
        let r = c
            .list_jobs(v1::ListJobsRequest {
                linearizable: false,
            })
            .await
            .ok()?;
        Some(r.into_inner().jobs.into_iter().map(|j| j.id).collect())
    })
    .await;
    match local {
        Some(local) => {
            let missing: Vec<&String> = listed.iter().filter(|j| !local.contains(j)).collect();
            if !missing.is_empty() {
                cluster_anomaly(
                    anomalies,
                    format!(
                        "{place}: caught up to index {} but misses {} jobs: {missing:?}",
                        before.caught_up_at,
                        missing.len()
                    ),
                );
            }
        }
        None => cluster_anomaly(
            anomalies,
            format!("{place}: caught up but does not list its jobs"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn a_flipped_bit_lies_before_the_zero_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        let before = [0u8, 7, 0, 9, 0, 0, 0];
        for seed in 0..50 {
            std::fs::write(&file, before).expect("write");
            let mut rng = StdRng::seed_from_u64(seed);
            let (at, mask) = flip_a_bit(&file, &mut rng).expect("flip").expect("flipped");
            let after = std::fs::read(&file).expect("read");
            assert!(at <= 3, "offset {at}");
            assert_eq!(mask.count_ones(), 1);
            let changed: Vec<usize> = (0..before.len())
                .filter(|&k| before[k] != after[k])
                .collect();
            assert_eq!(changed, vec![at as usize]);
            assert_eq!(before[at as usize] ^ after[at as usize], mask);
        }
        std::fs::write(&file, [0u8; 16]).expect("write");
        let mut rng = StdRng::seed_from_u64(1);
        assert!(flip_a_bit(&file, &mut rng).expect("read").is_none());
    }

    #[test]
    fn the_sled_file_to_damage_is_never_the_raft_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let raft = dir.path();
        let mut rng = StdRng::seed_from_u64(7);
        assert!(pick_sled_file(raft, &mut rng).expect("pick").is_none());
        std::fs::create_dir_all(raft.join("blobs")).expect("mkdir");
        std::fs::create_dir_all(raft.join("wal")).expect("mkdir");
        for f in [
            "db",
            "conf",
            GENERATION_FILE,
            "snap.00000000000001B1",
            "blobs/1",
            "wal/0.wal",
        ] {
            std::fs::write(raft.join(f), b"x").expect("write");
        }
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..400 {
            let p = pick_sled_file(raft, &mut rng)
                .expect("pick")
                .expect("a file");
            seen.insert(p.strip_prefix(raft).expect("inside").display().to_string());
        }
        let want: std::collections::BTreeSet<String> = [
            "db",
            "conf",
            GENERATION_FILE,
            "snap.00000000000001B1",
            "blobs/1",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn a_refusal_must_name_the_damage() {
        let log = "2026-11-28T19:31:02Z  INFO starting\n\
                   Error: the sled database at /d/raft is damaged: Read corrupted data; \
                   refusing to start.\n\nCaused by:\n    Read corrupted data\n";
        let message = exit_message(log);
        assert!(message.starts_with("Error: the sled database"), "{message}");
        assert!(names_the_damage(&message));
        assert!(names_the_damage(
            "Error: cannot use the raft metadata's generation file: /d/raft/meta.generation"
        ));
        assert!(!names_the_damage(
            "Error: address already in use (os error 98)"
        ));
        assert_eq!(exit_message("a\nlast line\n\n"), "last line");
    }
}
