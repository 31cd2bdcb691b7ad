//! OS-level check of invariant 2, "at most one live attempt of a rank; a stale attempt can
//! change nothing", from `/proc` samples taken during a nemesis run.
//!
//! The sampler reads every process's `/proc/PID/environ` and keeps the rank processes of
//! one cluster: those with `CUMULUS_JOB_ID`, `RANK` and `CUMULUS_ATTEMPT` (set by the agent)
//! and a `CUMULUS_SHARDS_FILE` under the cluster's directory (other clusters on the same
//! machine are ignored). From `/proc/PID/stat` it takes the state, the CPU time
//! (`utime + stime`, in clock ticks) and the start time (which tells a reused pid apart).
//!
//! The check, precisely. A process *progresses* over the interval between two consecutive
//! samples when it is in both (same pid and start time), is neither stopped (`T`, `t`) nor
//! dead (`Z`, `X`) in the later one, and its CPU time grew. Two processes of the same
//! (job, rank) with *different* attempts *overlap* from the first interval in which both
//! progress until one of them is gone, stopped or dead; the overlap's length runs from the
//! start of that first interval to the end of the last interval in which both progressed.
//! An overlap longer than the allowed limit is an anomaly.
//!
//! Why a limit and not zero: a stale attempt is stopped by its agent with SIGTERM and, after
//! the agent's stop grace time, SIGKILL; a worker cut off from the leader stops its ranks
//! only once its heartbeat timeout passes, about when the leader places replacements. In
//! that window the old process may still run (it can change nothing: its reports and
//! checkpoint parts carry a stale attempt number and are rejected). What the invariant
//! forbids is two attempts both making progress for longer than it takes to stop one:
//! the limit is the stop grace time plus a heartbeat timeout plus sampling slack.
//! A SIGSTOPped process (the hang-rank fault) makes no progress and never counts.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One rank process seen in one sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankProc {
    /// Process id.
    pub pid: u32,
    /// Start time after boot, in clock ticks (tells a reused pid apart).
    pub start_ticks: u64,
    /// `CUMULUS_JOB_ID`.
    pub job_id: String,
    /// `RANK`.
    pub rank: u32,
    /// `CUMULUS_ATTEMPT`.
    pub attempt: u32,
    /// The state letter of `/proc/PID/stat` (`R`, `S`, `D`, `T`, `t`, `Z`, …).
    pub state: char,
    /// `utime + stime`, in clock ticks.
    pub cpu_ticks: u64,
}

/// The rank processes seen at one instant.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// When the sample was taken, in milliseconds since the sampler started.
    pub at_ms: u64,
    /// The rank processes of the cluster.
    pub procs: Vec<RankProc>,
}

/// One overlap the check found too long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overlap {
    /// The job.
    pub job_id: String,
    /// The rank.
    pub rank: u32,
    /// The two attempts (lower first) and their pids.
    pub attempts: [(u32, u32); 2],
    /// Length of the joint progress, in milliseconds.
    pub length_ms: u64,
}

/// (job, rank, (attempt, pid, start) of the lower attempt, same of the higher).
type PairKey = (String, u32, (u32, u32, u64), (u32, u32, u64));

/// The incremental check: feed it samples in time order ([`OverlapCheck::observe`]).
#[derive(Debug)]
pub struct OverlapCheck {
    limit_ms: u64,
    previous: Option<Sample>,
    /// Open overlaps: pair → (start of the first joint interval, end of the last one).
    open: HashMap<PairKey, (u64, u64)>,
    /// Overlaps that ran past the limit (each reported once).
    pub anomalies: Vec<Overlap>,
    /// Longest overlap seen, anomalous or not, in milliseconds.
    pub longest_ms: u64,
    /// Overlaps seen (any length).
    pub overlaps: u64,
    /// Samples observed.
    pub samples: u64,
    /// Distinct rank processes seen (pid, start time).
    seen: std::collections::HashSet<(u32, u64)>,
}

fn identity(p: &RankProc) -> (u32, u64) {
    (p.pid, p.start_ticks)
}

fn runnable(p: &RankProc) -> bool {
    !matches!(p.state, 'T' | 't' | 'Z' | 'X' | 'x')
}

impl OverlapCheck {
    /// A check that reports overlaps longer than `limit_ms`.
    pub fn new(limit_ms: u64) -> Self {
        Self {
            limit_ms,
            previous: None,
            open: HashMap::new(),
            anomalies: Vec::new(),
            longest_ms: 0,
            overlaps: 0,
            samples: 0,
            seen: Default::default(),
        }
    }

    /// Distinct rank processes seen so far.
    pub fn processes_seen(&self) -> u64 {
        self.seen.len() as u64
    }

    /// Takes the next sample (samples must come in time order).
    pub fn observe(&mut self, sample: Sample) {
        self.samples += 1;
        self.seen.extend(sample.procs.iter().map(identity));
        let Some(previous) = self.previous.take() else {
            self.previous = Some(sample);
            return;
        };
        let before: HashMap<(u32, u64), &RankProc> =
            previous.procs.iter().map(|p| (identity(p), p)).collect();
        // Processes that progressed over (previous, sample], by (job, rank).
        let mut progressing: BTreeMap<(String, u32), Vec<&RankProc>> = BTreeMap::new();
        // Processes alive and runnable now (an overlap stays open while both are).
        let mut runnable_now: std::collections::HashSet<(u32, u64)> = Default::default();
        for p in &sample.procs {
            if !runnable(p) {
                continue;
            }
            runnable_now.insert(identity(p));
            if before
                .get(&identity(p))
                .is_some_and(|b| p.cpu_ticks > b.cpu_ticks)
            {
                progressing
                    .entry((p.job_id.clone(), p.rank))
                    .or_default()
                    .push(p);
            }
        }
        // Close overlaps whose processes are gone, stopped or dead.
        self.open.retain(|(_, _, a, b), _| {
            runnable_now.contains(&(a.1, a.2)) && runnable_now.contains(&(b.1, b.2))
        });
        for ((job_id, rank), procs) in progressing {
            for (i, x) in procs.iter().enumerate() {
                for y in &procs[i + 1..] {
                    if x.attempt == y.attempt {
                        continue;
                    }
                    let (lo, hi) = if x.attempt < y.attempt {
                        (x, y)
                    } else {
                        (y, x)
                    };
                    let key: PairKey = (
                        job_id.clone(),
                        rank,
                        (lo.attempt, lo.pid, lo.start_ticks),
                        (hi.attempt, hi.pid, hi.start_ticks),
                    );
                    let entry = self.open.entry(key).or_insert_with(|| {
                        self.overlaps += 1;
                        (previous.at_ms, sample.at_ms)
                    });
                    let first_report = entry.1.saturating_sub(entry.0) <= self.limit_ms;
                    entry.1 = sample.at_ms;
                    let length_ms = entry.1.saturating_sub(entry.0);
                    self.longest_ms = self.longest_ms.max(length_ms);
                    if length_ms > self.limit_ms && first_report {
                        self.anomalies.push(Overlap {
                            job_id: job_id.clone(),
                            rank,
                            attempts: [(lo.attempt, lo.pid), (hi.attempt, hi.pid)],
                            length_ms,
                        });
                    }
                }
            }
        }
        self.previous = Some(sample);
    }
}

/// Parses `/proc/PID/stat`: (state, utime + stime, start time), in clock ticks. The command
/// name may hold spaces and parentheses: fields are counted after its last `)`.
pub fn parse_stat(stat: &str) -> Option<(char, u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); utime is field 14, stime 15, starttime 22.
    let state = fields.first()?.chars().next()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let start: u64 = fields.get(19)?.parse().ok()?;
    Some((state, utime + stime, start))
}

/// Reads one rank process of the cluster rooted at `root` from `/proc/PID`, `None` when
/// `pid` is not one (or is gone).
fn read_rank_proc(pid: u32, root: &Path) -> Option<RankProc> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let mut job_id = None;
    let mut rank = None;
    let mut attempt = None;
    let mut ours = false;
    for var in environ.split(|b| *b == 0) {
        let Ok(var) = std::str::from_utf8(var) else {
            continue;
        };
        let Some((key, value)) = var.split_once('=') else {
            continue;
        };
        match key {
            "CUMULUS_JOB_ID" => job_id = Some(value.to_string()),
            "RANK" => rank = value.parse().ok(),
            "CUMULUS_ATTEMPT" => attempt = value.parse().ok(),
            "CUMULUS_SHARDS_FILE" => ours = Path::new(value).starts_with(root),
            _ => {}
        }
    }
    if !ours {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (state, cpu_ticks, start_ticks) = parse_stat(&stat)?;
    Some(RankProc {
        pid,
        start_ticks,
        job_id: job_id?,
        rank: rank?,
        attempt: attempt?,
        state,
        cpu_ticks,
    })
}

/// One sample of every rank process of the cluster rooted at `root`.
pub fn sample(root: &Path, at_ms: u64) -> Sample {
    let mut procs = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            if let Some(p) = read_rank_proc(pid, root) {
                procs.push(p);
            }
        }
    }
    Sample { at_ms, procs }
}

/// A background thread sampling `/proc` every `every` into an [`OverlapCheck`] until
/// [`Sampler::finish`] (or until dropped: a run that ends early stops its sampler).
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<OverlapCheck>>,
}

impl Sampler {
    /// Starts sampling the rank processes of the cluster rooted at `root`.
    pub fn start(root: PathBuf, every: Duration, limit_ms: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let mut check = OverlapCheck::new(limit_ms);
            while !flag.load(Ordering::Relaxed) {
                let at_ms = started.elapsed().as_millis() as u64;
                check.observe(sample(&root, at_ms));
                std::thread::sleep(every);
            }
            check
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling and returns the check.
    pub fn finish(mut self) -> OverlapCheck {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .expect("the sampler thread is joined only here")
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32, attempt: u32, state: char, cpu: u64) -> RankProc {
        RankProc {
            pid,
            start_ticks: u64::from(pid) * 10,
            job_id: "job-000001".into(),
            rank: 0,
            attempt,
            state,
            cpu_ticks: cpu,
        }
    }

    /// Runs the check over `(at_ms, procs)` samples.
    fn run(limit_ms: u64, samples: Vec<(u64, Vec<RankProc>)>) -> OverlapCheck {
        let mut check = OverlapCheck::new(limit_ms);
        for (at_ms, procs) in samples {
            check.observe(Sample { at_ms, procs });
        }
        check
    }

    #[test]
    fn sequential_attempts_never_overlap() {
        let check = run(
            500,
            vec![
                (0, vec![p(10, 0, 'R', 1)]),
                (100, vec![p(10, 0, 'R', 5)]),
                (200, vec![p(11, 1, 'R', 1)]),
                (300, vec![p(11, 1, 'R', 4)]),
                (400, vec![p(11, 1, 'R', 9)]),
            ],
        );
        assert!(check.anomalies.is_empty());
        assert_eq!(check.overlaps, 0);
        assert_eq!(check.longest_ms, 0);
        assert_eq!(check.processes_seen(), 2);
    }

    #[test]
    fn a_short_overlap_of_a_stale_attempt_being_stopped_is_allowed_and_measured() {
        let check = run(
            500,
            vec![
                (0, vec![p(10, 0, 'R', 1), p(11, 1, 'R', 1)]),
                (100, vec![p(10, 0, 'R', 3), p(11, 1, 'R', 2)]),
                (200, vec![p(10, 0, 'R', 4), p(11, 1, 'R', 3)]),
                (300, vec![p(11, 1, 'R', 5)]),
            ],
        );
        assert!(check.anomalies.is_empty());
        assert_eq!(check.overlaps, 1);
        assert_eq!(check.longest_ms, 200);
    }

    #[test]
    fn two_attempts_progressing_past_the_limit_are_an_anomaly_reported_once() {
        let mut samples = Vec::new();
        for i in 0..20u64 {
            samples.push((i * 100, vec![p(10, 0, 'R', i), p(11, 2, 'S', i * 2)]));
        }
        let check = run(500, samples);
        assert_eq!(check.anomalies.len(), 1, "{:?}", check.anomalies);
        let a = &check.anomalies[0];
        assert_eq!(a.attempts, [(0, 10), (2, 11)]);
        assert!(a.length_ms > 500 && a.length_ms <= 600, "{a:?}");
        assert_eq!(check.longest_ms, 1900);
    }

    #[test]
    fn a_stopped_stale_attempt_makes_no_progress() {
        // The hang-rank fault: attempt 0 is SIGSTOPped, attempt 1 runs beside it.
        let mut samples = Vec::new();
        for i in 0..20u64 {
            samples.push((i * 100, vec![p(10, 0, 'T', 7), p(11, 1, 'R', i)]));
        }
        let check = run(500, samples);
        assert!(check.anomalies.is_empty());
        assert_eq!(check.overlaps, 0);
    }

    #[test]
    fn an_idle_stale_attempt_is_not_progress_but_cpu_after_idle_ticks_continues_the_overlap() {
        // No CPU for the old attempt: no overlap.
        let mut samples = Vec::new();
        for i in 0..10u64 {
            samples.push((i * 100, vec![p(10, 0, 'S', 3), p(11, 1, 'R', i)]));
        }
        assert_eq!(run(500, samples).overlaps, 0);
        // Joint progress with idle samples in between (CPU ticks are 10 ms coarse): the
        // overlap stays open while both stay alive and runnable.
        let check = run(
            500,
            vec![
                (0, vec![p(10, 0, 'S', 0), p(11, 1, 'S', 0)]),
                (100, vec![p(10, 0, 'S', 1), p(11, 1, 'S', 1)]),
                (200, vec![p(10, 0, 'S', 1), p(11, 1, 'S', 2)]),
                (300, vec![p(10, 0, 'S', 1), p(11, 1, 'S', 3)]),
                (400, vec![p(10, 0, 'S', 1), p(11, 1, 'S', 4)]),
                (500, vec![p(10, 0, 'S', 1), p(11, 1, 'S', 5)]),
                (700, vec![p(10, 0, 'S', 2), p(11, 1, 'S', 6)]),
            ],
        );
        assert_eq!(check.overlaps, 1);
        assert_eq!(check.anomalies.len(), 1);
        assert_eq!(check.anomalies[0].length_ms, 700);
    }

    #[test]
    fn a_stop_or_exit_closes_the_overlap() {
        let check = run(
            500,
            vec![
                (0, vec![p(10, 0, 'R', 0), p(11, 1, 'R', 0)]),
                (400, vec![p(10, 0, 'R', 1), p(11, 1, 'R', 1)]),
                (500, vec![p(10, 0, 'T', 1), p(11, 1, 'R', 2)]),
                // Continued and progressing again: a new overlap starts at 500.
                (800, vec![p(10, 0, 'R', 2), p(11, 1, 'R', 3)]),
                (900, vec![p(10, 0, 'Z', 2), p(11, 1, 'R', 4)]),
            ],
        );
        assert!(check.anomalies.is_empty(), "{:?}", check.anomalies);
        assert_eq!(check.overlaps, 2);
        assert_eq!(check.longest_ms, 400);
    }

    #[test]
    fn same_attempt_processes_and_other_ranks_or_jobs_are_not_overlaps() {
        let mut other_rank = p(12, 1, 'R', 0);
        other_rank.rank = 1;
        let mut other_job = p(13, 1, 'R', 0);
        other_job.job_id = "job-000002".into();
        let mut samples = Vec::new();
        for i in 0..20u64 {
            let mut r = other_rank.clone();
            r.cpu_ticks = i;
            let mut j = other_job.clone();
            j.cpu_ticks = i;
            // pid 10 and its child pid 14 share attempt 0.
            samples.push((i * 100, vec![p(10, 0, 'R', i), p(14, 0, 'R', i), r, j]));
        }
        let check = run(500, samples);
        assert_eq!(check.overlaps, 0);
    }

    #[test]
    fn a_reused_pid_is_a_new_process() {
        let mut reused = p(10, 1, 'R', 50);
        reused.start_ticks = 999;
        let check = run(
            500,
            vec![
                (0, vec![p(10, 0, 'R', 40), p(11, 1, 'R', 0)]),
                // pid 10 now belongs to another process: no interval of progress for it.
                (100, vec![reused.clone(), p(11, 1, 'R', 1)]),
            ],
        );
        assert_eq!(check.overlaps, 0);
    }

    #[test]
    fn stat_parsing_handles_odd_command_names() {
        let stat = "4242 (tr (ai) ner) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    17 5 0 0 20 0 3 0 123456 1000 200 18446744073709551615";
        assert_eq!(parse_stat(stat), Some(('S', 22, 123456)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) R 1 2"), None);
    }

    #[test]
    fn the_sampler_sees_a_rank_like_process_of_its_cluster_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let shards = dir.path().join("worker-0/shards");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("CUMULUS_JOB_ID", "job-000042")
            .env("RANK", "3")
            .env("CUMULUS_ATTEMPT", "7")
            .env("CUMULUS_SHARDS_FILE", &shards)
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        // Until exec, /proc/PID/environ is the parent's: wait (bounded) for the child's.
        let deadline = Instant::now() + Duration::from_secs(10);
        let seen = loop {
            let seen = sample(dir.path(), 0);
            if seen.procs.iter().any(|p| p.pid == pid) || Instant::now() > deadline {
                break seen;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let other = tempfile::tempdir().expect("tempdir");
        let unseen = sample(other.path(), 0);
        let _ = child.kill();
        let _ = child.wait();
        let mine: Vec<&RankProc> = seen.procs.iter().filter(|p| p.pid == pid).collect();
        assert_eq!(mine.len(), 1, "{:?}", seen.procs);
        assert_eq!(mine[0].job_id, "job-000042");
        assert_eq!((mine[0].rank, mine[0].attempt), (3, 7));
        assert!(unseen.procs.iter().all(|p| p.pid != pid));
    }
}
