//! Human-readable rendering of the proto messages (kubectl-like borderless tables).
//!
//! Every function is pure: it takes the message and "now" (Unix ms) and returns text,
//! so the output is unit-tested.

use comfy_table::{Table, presets};
use cumulus_api::{
    ClusterStatusResponse, Job, JobResponse, JobState, JobSummary, ListCheckpointsResponse,
    ListJobSummariesResponse, ListJobsResponse, RankPhase, RankStatus, RestartRecord,
};

/// Default restart budget of a job whose spec leaves it unset.
pub const DEFAULT_MAX_RESTARTS: u32 = 3;

/// A borderless table with the given upper-case header.
pub fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING);
    t.set_header(header.to_vec());
    t
}

/// Renders a table as text, each line without trailing spaces, ending in `\n`.
pub fn table_text(t: &Table) -> String {
    let mut out = String::new();
    for line in t.lines() {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Current wall-clock time, Unix epoch milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// "12s ago", "5m ago", "3h ago", "2d ago"; "-" for 0 (unknown).
pub fn age(then_ms: u64, now_ms: u64) -> String {
    if then_ms == 0 {
        return "-".into();
    }
    let s = now_ms.saturating_sub(then_ms) / 1000;
    match s {
        0..=119 => format!("{s}s ago"),
        120..=7199 => format!("{}m ago", s / 60),
        7200..=172_799 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86_400),
    }
}

/// Bytes in binary units with one decimal: "512 B", "1.5 KiB", "2.0 GiB".
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Adds a row whose cells are shown with every control character escaped
/// ([`cumulus_api::text::escape_control`]): names, commands, paths and failure causes come
/// from users and ranks, and a `\n` or an ESC sequence in one must not forge a row or
/// drive the terminal.
pub(crate) fn add_row(t: &mut Table, cells: Vec<String>) {
    t.add_row(
        cells
            .into_iter()
            .map(|c| cumulus_api::text::escape_control(&c).into_owned())
            .collect::<Vec<_>>(),
    );
}

/// A command line for display: arguments with spaces or quotes are single-quoted.
pub fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn budget(job: &Job) -> u32 {
    job.spec
        .as_ref()
        .and_then(|s| s.restart.as_ref())
        .and_then(|r| r.max_restarts)
        .unwrap_or(DEFAULT_MAX_RESTARTS)
}

pub(crate) fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

/// "code 1", "signal 9", or "-".
pub fn exit_text(r: &RankStatus) -> String {
    match (r.exit_code, r.signal) {
        (Some(c), _) => format!("code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        (None, None) => "-".into(),
    }
}

/// "120/360", "120", or "-".
pub fn step_text(r: &RankStatus) -> String {
    match (r.step, r.total_steps) {
        (0, 0) => "-".into(),
        (s, 0) => s.to_string(),
        (s, t) => format!("{s}/{t}"),
    }
}

/// `list`: one line per job.
pub fn jobs_table(resp: &ListJobsResponse, now_ms: u64) -> String {
    jobs_table_with(resp, now_ms, false)
}

/// `list -o wide`: [`jobs_table`] with the priority, the progress (the slowest rank's
/// step of the total), the rate, the running time and the workers of each job.
pub fn jobs_table_wide(resp: &ListJobsResponse, now_ms: u64) -> String {
    jobs_table_with(resp, now_ms, true)
}

fn jobs_table_with(resp: &ListJobsResponse, now_ms: u64, wide: bool) -> String {
    if resp.jobs.is_empty() {
        return "no jobs\n".into();
    }
    let mut header = vec![
        "ID",
        "NAME",
        "OWNER",
        "STATE",
        "WORLD",
        "RESTARTS",
        "CKPT STEP",
        "SUBMITTED",
    ];
    if wide {
        header.extend(["PRIORITY", "PROGRESS", "STEPS/S", "RAN", "WORKERS"]);
    }
    // Ranks flagged as stragglers (current attempts), when any job has one.
    let stragglers = wide
        && resp
            .jobs
            .iter()
            .any(|j| j.ranks.iter().any(|r| r.straggler));
    if stragglers {
        header.push("STRAGGLERS");
    }
    header.push("COMMAND");
    let mut t = table(&header);
    for j in &resp.jobs {
        let spec = j.spec.clone().unwrap_or_default();
        let mut cmd = shell_words(&spec.command);
        if cmd.len() > 60 {
            let cut = cmd
                .char_indices()
                .nth(57)
                .map(|(i, _)| i)
                .unwrap_or(cmd.len());
            cmd.truncate(cut);
            cmd.push_str("...");
        }
        let mut cells = vec![
            j.id.clone(),
            or_dash(&spec.name),
            or_dash(&j.owner),
            job_state_text(j),
            spec.world_size.to_string(),
            format!("{}/{}", j.restarts_used, budget(j)),
            j.committed_step.map_or("-".into(), |s| s.to_string()),
            age(j.submitted_at_ms, now_ms),
        ];
        if wide {
            let slowest = j
                .ranks
                .iter()
                .filter(|r| r.total_steps > 0 || r.step > 0)
                .min_by_key(|r| r.step);
            let mut workers: Vec<&str> = j
                .ranks
                .iter()
                .map(|r| r.worker_id.as_str())
                .filter(|w| !w.is_empty())
                .collect();
            workers.sort_unstable();
            workers.dedup();
            cells.extend([
                priority_text(&spec),
                slowest.map_or("-".into(), |r| step_of(r.step, r.total_steps)),
                slowest.map_or("-".into(), |r| rate_text(r.steps_per_s)),
                if j.running_ms > 0 {
                    duration_text(j.running_ms)
                } else {
                    "-".into()
                },
                or_dash(&workers.join(",")),
            ]);
        }
        if stragglers {
            let flagged: Vec<String> = j
                .ranks
                .iter()
                .filter(|r| r.straggler)
                .map(|r| r.rank.to_string())
                .collect();
            cells.push(or_dash(&flagged.join(",")));
        }
        cells.push(cmd);
        add_row(&mut t, cells);
    }
    table_text(&t)
}

/// `5`, or `0 (preemptible)`.
fn priority_text(spec: &cumulus_api::JobSpec) -> String {
    if spec.preemptible {
        format!("{} (preemptible)", spec.priority)
    } else {
        spec.priority.to_string()
    }
}

/// A job's state as shown: with a stop in flight, what it is doing (`running, pausing`,
/// `running, stopping for its time limit`, `running, being preempted`).
pub fn job_state_text(job: &cumulus_api::Job) -> String {
    let doing = match job.stop_action.as_str() {
        "" => return cumulus_api::text::escape_control(&job.state).into_owned(),
        "pause" => "pausing",
        "time_limit" => "stopping for its time limit",
        "preempt" => "being preempted",
        _ => "stopping",
    };
    format!("{}, {doing}", cumulus_api::text::escape_control(&job.state))
}

/// `status`: summary, ranks table, restarts table.
pub fn job_status(resp: &JobResponse, now_ms: u64) -> String {
    let Some(job) = &resp.job else {
        return "the coordinator returned no job\n".into();
    };
    let spec = job.spec.clone().unwrap_or_default();
    let mut out = String::new();
    let mut kv = Table::new();
    kv.load_style(presets::NOTHING);
    let mut row = |k: &str, v: String| {
        add_row(&mut kv, vec![format!("{k}:"), v]);
    };
    state_rows(&mut row, job, &spec);
    schedule_rows(&mut row, job, &spec);
    if !job.failure_cause.is_empty() {
        row("failure cause", job.failure_cause.clone());
    }
    row("submitted", age(job.submitted_at_ms, now_ms));
    if job.finished_at_ms != 0 {
        row("finished", age(job.finished_at_ms, now_ms));
    }
    inputs_rows(&mut row, &spec);
    row(
        "read",
        if resp.linearizable {
            "linearizable (leader read index)".into()
        } else {
            "local (may be stale)".into()
        },
    );
    out.push_str(&table_text(&kv));

    out.push('\n');
    out.push_str(&ranks_table(job, &spec));

    if !job.restarts.is_empty() {
        out.push('\n');
        out.push_str(&restarts_table(&job.restarts));
    }
    out
}

/// The first rows of `status`'s summary, through `row(key, value)`: what the job is and
/// how far it got (name, state, owner, why it waits, size, GPUs, restarts, committed
/// step, progress). Rows that would say nothing are left out.
fn state_rows(row: &mut dyn FnMut(&str, String), job: &Job, spec: &cumulus_api::JobSpec) {
    let restart = spec.restart.clone().unwrap_or_default();
    row(
        "job",
        if spec.name.is_empty() {
            job.id.clone()
        } else {
            format!("{} ({})", job.id, spec.name)
        },
    );
    row("state", job_state_text(job));
    if !job.owner.is_empty() {
        row("owner", job.owner.clone());
    }
    if !job.pending_reason.is_empty() {
        row("waiting", job.pending_reason.clone());
    }
    row(
        "world size",
        if spec.min_world_size > 0 && spec.min_world_size < spec.world_size {
            format!(
                "{} now, elastic {}:{} ({} shards, {} resizes)",
                job.world_size_now,
                spec.min_world_size,
                spec.world_size,
                job.shard_count,
                job.resizes.len()
            )
        } else {
            format!("{} ({} shards)", spec.world_size, job.shard_count)
        },
    );
    if spec.gpus_per_rank > 0 {
        row(
            "GPUs",
            match spec.gpu_memory_fraction {
                Some(f) => format!("{f} of one GPU per rank"),
                None => format!("{} per rank", spec.gpus_per_rank),
            },
        );
    }
    row(
        "restarts",
        format!(
            "{} used of {} (scope {}, backoff {}..{} ms)",
            job.restarts_used,
            budget(job),
            restart.scope.as_deref().unwrap_or("group"),
            restart
                .backoff_initial_ms
                .map_or("default".into(), |v| v.to_string()),
            restart
                .backoff_max_ms
                .map_or("default".into(), |v| v.to_string()),
        ),
    );
    row(
        "committed step",
        job.committed_step.map_or("none".into(), |s| s.to_string()),
    );
    if let Some(p) = progress_summary(job) {
        row("progress", p);
    }
}

/// The rows of `status`'s summary about how the job is scheduled and how long it ran,
/// through `row(key, value)`: running and paused time, stop grace, priority, the job it
/// resumed from, its time limit. Each only when set.
fn schedule_rows(row: &mut dyn FnMut(&str, String), job: &Job, spec: &cumulus_api::JobSpec) {
    if job.running_ms > 0 && spec.time_limit_ms == 0 {
        row("running time", duration_text(job.running_ms));
    }
    if job.paused_ms > 0 {
        row("paused time", duration_text(job.paused_ms));
    }
    if spec.stop_grace_ms > 0 {
        row("stop grace", duration_text(spec.stop_grace_ms));
    }
    if let Some(text) = hang_detection_text(spec) {
        row("hang detection", text);
    }
    if spec.priority != 0 || spec.preemptible {
        row("priority", priority_text(spec));
    }
    if let Some(text) = straggler_text(spec) {
        row("stragglers", text);
    }
    if !job.avoided_workers.is_empty() {
        row("avoided workers", job.avoided_workers.join(","));
    }
    if !spec.resume_from_job.is_empty() {
        row(
            "resumed from",
            format!(
                "{}@{}",
                spec.resume_from_job,
                spec.resume_from_step.map_or("?".into(), |s| s.to_string())
            ),
        );
    }
    if spec.time_limit_ms > 0 {
        let mut limit = format!(
            "{} (ran {})",
            duration_text(spec.time_limit_ms),
            duration_text(job.running_ms)
        );
        if spec.signal_before_ms > 0 {
            limit.push_str(&format!(
                "; ranks asked to stop {} before",
                duration_text(spec.signal_before_ms)
            ));
        }
        row("time limit", limit);
    }
}

/// The job's straggler rule in words, when it is not the default (warn below 0.7 of the
/// other ranks' median steps/s for 60 s): `restart below 0.5 of the others' median
/// steps/s for 30 s`, or `off`.
fn straggler_text(spec: &cumulus_api::JobSpec) -> Option<String> {
    use cumulus_api::limits::{DEFAULT_STRAGGLER_FRACTION_PERMILLE, DEFAULT_STRAGGLER_WINDOW_MS};
    let action = if spec.straggler_action.is_empty() {
        "warn"
    } else {
        spec.straggler_action.as_str()
    };
    let fraction = spec
        .straggler_fraction
        .unwrap_or(f64::from(DEFAULT_STRAGGLER_FRACTION_PERMILLE) / 1000.0);
    let window_ms = if spec.straggler_window_ms == 0 {
        DEFAULT_STRAGGLER_WINDOW_MS
    } else {
        spec.straggler_window_ms
    };
    let default = action == "warn"
        && (fraction * 1000.0).round() as u32 == DEFAULT_STRAGGLER_FRACTION_PERMILLE
        && window_ms == DEFAULT_STRAGGLER_WINDOW_MS;
    if default {
        return None;
    }
    if action == "off" {
        return Some("off".into());
    }
    Some(format!(
        "{action} below {fraction} of the other ranks' median steps/s for {}",
        duration_text(window_ms)
    ))
}

/// The job's hang detection in words: its progress timeout (counted from each
/// attempt's first report) and its startup timeout (from the process's start to that
/// report; the cluster's default when the job names none); `None` when both are off.
fn hang_detection_text(spec: &cumulus_api::JobSpec) -> Option<String> {
    let startup_ms = if spec.startup_timeout_ms > 0 {
        spec.startup_timeout_ms
    } else if spec.progress_timeout_ms > 0 {
        cumulus_api::limits::DEFAULT_STARTUP_TIMEOUT_MS
    } else {
        return None;
    };
    let progress = if spec.progress_timeout_ms > 0 {
        format!(
            "no progress for {} after the first report",
            duration_text(spec.progress_timeout_ms)
        )
    } else {
        "no progress timeout".to_string()
    };
    let default = if spec.startup_timeout_ms == 0 {
        ", the default"
    } else {
        ""
    };
    Some(format!(
        "{progress}; first report within {} of start (startup timeout{default})",
        duration_text(startup_ms)
    ))
}

/// The rows of `status`'s summary about what the job runs and where its files are,
/// through `row(key, value)`: its command, dataset, L2 checkpoints (with the commit
/// tier) and checkpoint directory (with how many steps are kept). Empty ones are left
/// out.
fn inputs_rows(row: &mut dyn FnMut(&str, String), spec: &cumulus_api::JobSpec) {
    row("command", shell_words(&spec.command));
    if !spec.dataset.is_empty() {
        row("dataset", spec.dataset.clone());
    }
    if !spec.ckpt_url.is_empty() {
        row(
            "checkpoints (L2)",
            format!(
                "{} (commit at {})",
                spec.ckpt_url,
                if spec.ckpt_commit_tier.is_empty() {
                    "l2"
                } else {
                    spec.ckpt_commit_tier.as_str()
                }
            ),
        );
    }
    if !spec.ckpt_dir.is_empty() {
        row(
            "checkpoints",
            format!(
                "{} (keep {})",
                spec.ckpt_dir,
                spec.ckpt_keep.map_or("default".into(), |k| k.to_string())
            ),
        );
    }
}

/// `status`'s ranks table: each rank's current attempt, worker, state, pid, exit and
/// step, with a GPUS column for a job with GPUs and a METRICS column when a rank
/// reported metrics.
fn ranks_table(job: &Job, spec: &cumulus_api::JobSpec) -> String {
    let gpus = spec.gpus_per_rank > 0;
    let metrics = job.ranks.iter().any(|r| !r.metrics.is_empty());
    let stragglers = job.ranks.iter().any(|r| r.straggler);
    let mut header = vec!["RANK", "ATTEMPT", "WORKER", "STATE", "PID", "EXIT", "STEP"];
    if gpus {
        header.push("GPUS");
    }
    if stragglers {
        header.push("STRAGGLER");
    }
    if metrics {
        header.push("METRICS");
    }
    let mut ranks = table(&header);
    for r in &job.ranks {
        let mut cells = vec![
            r.rank.to_string(),
            r.attempt.to_string(),
            or_dash(&r.worker_id),
            r.state.clone(),
            if r.pid == 0 {
                "-".into()
            } else {
                r.pid.to_string()
            },
            exit_text(r),
            step_text(r),
        ];
        if gpus {
            cells.push(or_dash(&r.gpus.join(",")));
        }
        if stragglers {
            cells.push(if r.straggler {
                "yes".into()
            } else {
                "-".into()
            });
        }
        if metrics {
            cells.push(or_dash(&metrics_text(&r.metrics)));
        }
        add_row(&mut ranks, cells);
    }
    table_text(&ranks)
}

/// A job's events in time order, from its record: submitted, each failure and the
/// restart it caused (with the delay and the step resumed from), the ranks' current
/// attempts starting and ending, and the job's end with its cause. Times are UTC,
/// `HH:MM:SS.mmm` of the leader's clock.
pub fn events_table(job: &Job) -> String {
    let mut events: Vec<(u64, String)> = Vec::new();
    let owner = if job.owner.is_empty() {
        String::new()
    } else {
        format!(" by {}", job.owner)
    };
    events.push((job.submitted_at_ms, format!("submitted{owner}")));
    for r in &job.restarts {
        events.push((r.failed_at_ms, format!("failure: {}", r.cause)));
        events.push((
            r.not_before_ms,
            format!(
                "restart #{} of ranks {} after {} ms{}",
                r.number,
                r.ranks
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                r.delay_ms,
                r.resume_step.map_or(", from scratch".into(), |s| format!(
                    ", resuming from step {s}"
                )) + &if r.in_process_ranks.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", in-process (ranks {} keep their processes)",
                        r.in_process_ranks
                            .iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(",")
                    )
                }
            ),
        ));
    }
    for r in &job.resizes {
        events.push((
            r.at_ms,
            format!(
                "resized from {} to {} ranks{}: {}",
                r.from_world_size,
                r.to_world_size,
                r.resume_step.map_or(", from scratch".into(), |s| format!(
                    ", resuming from step {s}"
                )),
                r.cause
            ),
        ));
    }
    for r in &job.ranks {
        if r.started_at_ms > 0 {
            events.push((
                r.started_at_ms,
                format!(
                    "rank {} attempt {} started on {} (pid {})",
                    r.rank, r.attempt, r.worker_id, r.pid
                ),
            ));
        }
        if r.exited_at_ms > 0 {
            events.push((
                r.exited_at_ms,
                format!(
                    "rank {} attempt {} {}{}",
                    r.rank,
                    r.attempt,
                    match (r.exit_code, r.signal) {
                        (Some(c), _) => format!("exited with code {c}"),
                        (None, Some(s)) => format!("was killed by signal {s}"),
                        (None, None) => "could not start".into(),
                    },
                    if r.exit_cause.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", r.exit_cause)
                    }
                ),
            ));
        }
    }
    for f in &job.stragglers {
        events.push((
            f.at_ms,
            format!(
                "rank {} attempt {} flagged a straggler on {}: {:.2} steps/s against the \
                 other ranks' median {:.2} ({})",
                f.rank,
                f.attempt,
                f.worker_id,
                f.steps_per_s,
                f.median_steps_per_s,
                match f.action.as_str() {
                    "restart" => "restarted, its worker avoided",
                    "exclude" => "its worker avoided from the job's next placement",
                    _ => "warned",
                }
            ),
        ));
    }
    if job.finished_at_ms > 0 {
        let cause = if job.failure_cause.is_empty() {
            String::new()
        } else {
            format!(": {}", job.failure_cause)
        };
        events.push((job.finished_at_ms, format!("{}{cause}", job.state)));
    } else if !job.pending_reason.is_empty() {
        events.push((u64::MAX, format!("pending: {}", job.pending_reason)));
    }
    events.sort_by_key(|(at, _)| *at);
    let mut t = table(&["TIME (UTC)", "EVENT"]);
    for (at, what) in events {
        let when = if at == u64::MAX {
            "now".to_string()
        } else {
            let ms = at % 86_400_000;
            format!(
                "{:02}:{:02}:{:02}.{:03}",
                ms / 3_600_000,
                ms / 60_000 % 60,
                ms / 1000 % 60,
                ms % 1000
            )
        };
        add_row(&mut t, vec![when, what]);
    }
    table_text(&t)
}

/// A running job's progress: its slowest rank's step of the total, its rate and the
/// time left at that rate (the job is as far as its slowest rank); `None` without a
/// rank that reported a total.
pub fn progress_summary(job: &Job) -> Option<String> {
    let slowest = job
        .ranks
        .iter()
        .filter(|r| r.total_steps > 0 && r.phase() == Ok(RankPhase::Running))
        .min_by_key(|r| r.step)?;
    let mut text = format!(
        "{}/{} steps ({:.0}%)",
        slowest.step,
        slowest.total_steps,
        100.0 * slowest.step as f64 / slowest.total_steps as f64
    );
    if slowest.steps_per_s > 0.0 {
        text.push_str(&format!(", {:.1} steps/s", slowest.steps_per_s));
    }
    if slowest.eta_ms > 0 {
        text.push_str(&format!(", about {} left", duration_text(slowest.eta_ms)));
    }
    Some(text)
}

/// Metrics as `name=value` pairs sorted by name, four decimals (`loss=0.2314`; NaN and
/// the infinities as `nan`, `inf`, `-inf`); names and values come from ranks: control
/// characters are escaped.
pub fn metrics_text<'a>(metrics: impl IntoIterator<Item = (&'a String, &'a f64)>) -> String {
    let mut named: Vec<(&String, &f64)> = metrics.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    let text = named
        .iter()
        .map(|(k, v)| format!("{k}={}", cumulus_api::metric_json::display(**v, 4)))
        .collect::<Vec<_>>()
        .join(" ");
    cumulus_api::text::escape_control(&text).into_owned()
}

/// `step/total (P%)`, `step` without a total, `-` before any report.
fn step_of(step: u64, total: u64) -> String {
    match (step, total) {
        (0, 0) => "-".into(),
        (s, 0) => s.to_string(),
        (s, t) => format!("{s}/{t} ({:.0}%)", 100.0 * s as f64 / t as f64),
    }
}

/// Rate with one decimal, `-` when unknown.
fn rate_text(steps_per_s: f64) -> String {
    if steps_per_s > 0.0 {
        format!("{steps_per_s:.1}")
    } else {
        "-".into()
    }
}

/// One job's summary: its figures, then its progress history (at most
/// [`SUMMARY_HISTORY_ROWS`] samples, evenly picked, the newest included).
pub fn summary_text(s: &JobSummary, now_ms: u64) -> String {
    let mut t = table(&["FIELD", "VALUE"]);
    let mut row = |k: &str, v: String| add_row(&mut t, vec![k.to_string(), v]);
    row("job", s.job_id.clone());
    if !s.name.is_empty() {
        row(
            "name",
            cumulus_api::text::escape_control(&s.name).into_owned(),
        );
    }
    row("state", s.state.clone());
    row("step", step_of(s.step, s.total_steps));
    row(
        "steps/s",
        match (s.steps_per_s > 0.0, s.job_state() == Ok(JobState::Running)) {
            (false, _) => "unknown".into(),
            (true, true) => format!("{:.1}", s.steps_per_s),
            (true, false) => format!("{:.1} (last seen while running)", s.steps_per_s),
        },
    );
    if s.eta_ms > 0 {
        row("time left", format!("about {}", duration_text(s.eta_ms)));
    }
    row("running time", duration_text(s.running_ms));
    if s.paused_ms > 0 {
        row("paused time", duration_text(s.paused_ms));
    }
    row("restarts", s.restarts_used.to_string());
    row(
        "committed step",
        s.committed_step.map_or("none".into(), |c| c.to_string()),
    );
    if !s.metrics.is_empty() {
        row("metrics", metrics_text(&s.metrics));
    }
    row("submitted", age(s.submitted_at_ms, now_ms));
    if s.finished_at_ms > 0 {
        row("finished", age(s.finished_at_ms, now_ms));
    }
    if !s.live {
        row(
            "note",
            "this leader has not seen the job's ranks report (a leader change, or its history was dropped): step from the job's record only".into(),
        );
    }
    let mut out = table_text(&t);
    if !s.history.is_empty() {
        out.push('\n');
        let mut h = table(&["TIME", "STEP", "STEPS/S", "METRICS"]);
        let n = s.history.len();
        let rows = n.min(SUMMARY_HISTORY_ROWS);
        let picked: Vec<usize> = (0..rows)
            .map(|i| {
                if rows == 1 {
                    n - 1
                } else {
                    i * (n - 1) / (rows - 1)
                }
            })
            .collect();
        for i in picked {
            let x = &s.history[i];
            add_row(
                &mut h,
                vec![
                    age(x.at_ms, now_ms),
                    step_of(x.step, x.total_steps),
                    rate_text(x.steps_per_s),
                    or_dash(&metrics_text(&x.metrics)),
                ],
            );
        }
        out.push_str(&table_text(&h));
    }
    out
}

/// Most history rows `summary JOB` prints.
pub const SUMMARY_HISTORY_ROWS: usize = 12;

/// The newest jobs' summaries, one row each.
pub fn summaries_table(resp: &ListJobSummariesResponse, now_ms: u64) -> String {
    let mut t = table(&[
        "JOB",
        "NAME",
        "STATE",
        "STEP",
        "STEPS/S",
        "LEFT",
        "RAN",
        "PAUSED",
        "RESTARTS",
        "SUBMITTED",
        "METRICS",
    ]);
    for s in &resp.summaries {
        add_row(
            &mut t,
            vec![
                s.job_id.clone(),
                or_dash(&cumulus_api::text::escape_control(&s.name)),
                s.state.clone(),
                step_of(s.step, s.total_steps),
                rate_text(s.steps_per_s),
                if s.eta_ms > 0 {
                    duration_text(s.eta_ms)
                } else {
                    "-".into()
                },
                duration_text(s.running_ms),
                if s.paused_ms > 0 {
                    duration_text(s.paused_ms)
                } else {
                    "-".into()
                },
                s.restarts_used.to_string(),
                age(s.submitted_at_ms, now_ms),
                or_dash(&metrics_text(&s.metrics)),
            ],
        );
    }
    table_text(&t)
}

/// `950 ms`, `42s`, `7m 05s`, `3h 12m`.
pub fn duration_text(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms} ms"),
        1..=119 => format!("{s}s"),
        120..=7199 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, s / 60 % 60),
    }
}

/// The restart records of a job, then, for each restart whose leader said why it took
/// its path, a line `#N PATH: why`.
pub fn restarts_table(restarts: &[RestartRecord]) -> String {
    let mut t = table(&[
        "RESTART",
        "CAUSE",
        "RANKS",
        "DELAY MS",
        "RESUME STEP",
        "PATH",
    ]);
    for r in restarts {
        add_row(
            &mut t,
            vec![
                format!("#{}", r.number),
                r.cause.clone(),
                r.ranks
                    .iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                r.delay_ms.to_string(),
                r.resume_step.map_or("scratch".into(), |s| s.to_string()),
                restart_path(r).to_string(),
            ],
        );
    }
    let mut out = table_text(&t);
    for r in restarts.iter().filter(|r| !r.path_reason.is_empty()) {
        out.push_str(&format!(
            "#{} {}: {}\n",
            r.number,
            restart_path(r),
            r.path_reason
        ));
    }
    out
}

/// How a restart was carried out: `in_process` or `full` (also for a record without a
/// path, from a leader that predates in-process restarts).
fn restart_path(r: &RestartRecord) -> &str {
    if r.path.is_empty() { "full" } else { &r.path }
}

/// `ckpt ls`.
pub fn checkpoints_table(resp: &ListCheckpointsResponse) -> String {
    if resp.checkpoints.is_empty() {
        return "no checkpoints\n".into();
    }
    let mut t = table(&["STEP", "VERIFIED", "SIZE", "LATEST", "TIERS", "PATH"]);
    for c in &resp.checkpoints {
        add_row(
            &mut t,
            vec![
                c.step.to_string(),
                if c.verified {
                    "yes".into()
                } else {
                    "NO".into()
                },
                bytes(c.bytes),
                if c.latest { "*".into() } else { String::new() },
                if c.tiers.is_empty() {
                    "-".into()
                } else {
                    c.tiers.join("+")
                },
                c.path.clone(),
            ],
        );
    }
    table_text(&t)
}

/// A member's role as `cluster status` shows it: an unreachable one with the role it had
/// and how long the leader has not heard from it (`unreachable (was follower, 12.4 s)`).
fn member_role_text(mem: &cumulus_api::v1::Member) -> String {
    if mem.role != cumulus_api::MemberRole::Unreachable.as_str() {
        return mem.role.clone();
    }
    let mut detail = Vec::new();
    if !mem.last_role.is_empty() {
        detail.push(format!("was {}", mem.last_role));
    }
    if let Some(ms) = mem.last_ack_age_ms {
        detail.push(format!("no answer for {:.1} s", ms as f64 / 1000.0));
    }
    if detail.is_empty() {
        mem.role.clone()
    } else {
        format!("{} ({})", mem.role, detail.join(", "))
    }
}

/// `cluster status`: Raft view, members, workers.
pub fn cluster_status(resp: &ClusterStatusResponse) -> String {
    let mut out = String::new();
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    if resp.insecure {
        out.push_str(
            "WARNING: this cluster runs with --insecure: tokens and job data cross the network in plaintext\n",
        );
    }
    out.push_str(&format!(
        "answered by node {}; leader: {}; term {}; commit index {}; last applied {}; snapshot {}; purged {}\n\n",
        resp.node_id,
        resp.leader_id
            .map_or("none (election in progress?)".to_string(), |l| format!(
                "node {l}"
            )),
        resp.term,
        opt(resp.commit_index),
        opt(resp.last_applied_index),
        opt(resp.snapshot_index),
        opt(resp.purged_index),
    ));
    // A RAFT column only where some member's Raft service has a port of its own
    // (`--raft-listen`); "-" for a member whose Raft shares its gRPC port.
    let raft_apart = resp.members.iter().any(|m| !m.raft_addr.is_empty());
    let mut m = if raft_apart {
        table(&["NODE", "GRPC", "HTTP", "RAFT", "ROLE", "VOTER"])
    } else {
        table(&["NODE", "GRPC", "HTTP", "ROLE", "VOTER"])
    };
    for mem in &resp.members {
        let mut row = vec![
            mem.node_id.to_string(),
            mem.grpc_addr.clone(),
            mem.http_addr.clone(),
        ];
        if raft_apart {
            row.push(if mem.raft_addr.is_empty() {
                "-".into()
            } else {
                mem.raft_addr.clone()
            });
        }
        row.push(member_role_text(mem));
        row.push(if mem.voter { "yes".into() } else { "no".into() });
        add_row(&mut m, row);
    }
    out.push_str(&table_text(&m));
    out.push('\n');
    out.push_str(&workers_text(resp));
    out
}

/// The workers (slots, heartbeat, CPU, memory) and their GPUs, as `cumulusctl workers`
/// prints them.
pub fn workers_text(resp: &ClusterStatusResponse) -> String {
    let mut out = String::new();
    if resp.workers.is_empty() {
        out.push_str("no workers registered\n");
        return out;
    }
    let mut w = table(&[
        "WORKER",
        "HOST",
        "SLOTS",
        "STATE",
        "HEARTBEAT",
        "CPU",
        "MEMORY",
    ]);
    // Heartbeats and resources are the leader's soft state: a follower does not know them.
    let from_leader = resp.leader_id == Some(resp.node_id);
    for wk in &resp.workers {
        let (heartbeat, cpu, memory) = if !from_leader {
            ("unknown".into(), "unknown".into(), "unknown".into())
        } else {
            (
                if wk.last_heartbeat_age_ms == 0 {
                    "-".into()
                } else {
                    format!("{} ms ago", wk.last_heartbeat_age_ms)
                },
                format!("{:.0}%", wk.cpu_percent),
                format!(
                    "{} / {}",
                    bytes(wk.memory_used_bytes),
                    bytes(wk.memory_total_bytes)
                ),
            )
        };
        add_row(
            &mut w,
            vec![
                wk.worker_id.clone(),
                wk.host.clone(),
                format!("{}/{}", wk.slots_used, wk.slots),
                wk.state.clone(),
                heartbeat,
                cpu,
                memory,
            ],
        );
    }
    out.push_str(&table_text(&w));
    if !from_leader {
        out.push_str(&format!(
            "(answered by node {}, not the leader: heartbeats, CPU, memory and GPU readings are known to the leader only)\n",
            resp.node_id
        ));
    }
    let gpus = gpus_table(resp);
    if !gpus.is_empty() {
        out.push('\n');
        out.push_str(&gpus);
    }
    let spares = spares_table(resp);
    if !spares.is_empty() {
        out.push('\n');
        out.push_str(&spares);
    }
    out
}

/// The warm spares the workers keep, one row each ("" when none): the job it waits
/// for, its pid (which a rank attempt that takes it keeps) and its age, from the
/// workers' last heartbeats (known on the leader).
pub fn spares_table(resp: &ClusterStatusResponse) -> String {
    if resp.workers.iter().all(|w| w.warm_spares.is_empty()) {
        return String::new();
    }
    let mut t = table(&["WORKER", "WARM SPARE PID", "JOB", "AGE"]);
    for wk in &resp.workers {
        for s in &wk.warm_spares {
            add_row(
                &mut t,
                vec![
                    wk.worker_id.clone(),
                    s.pid.to_string(),
                    s.job_id.clone(),
                    format!("{:.1} s", s.age_ms as f64 / 1000.0),
                ],
            );
        }
    }
    table_text(&t)
}

/// The workers' GPUs, one row each ("" when no worker has one): what was registered,
/// the share given to ranks, and the last heartbeat's reading (known on the leader).
pub fn gpus_table(resp: &ClusterStatusResponse) -> String {
    if resp.workers.iter().all(|w| w.gpus.is_empty()) {
        return String::new();
    }
    let mut t = table(&[
        "WORKER",
        "GPU",
        "UUID",
        "NAME",
        "MEMORY",
        "UTIL",
        "ALLOCATED",
        "HEALTH",
    ]);
    for wk in &resp.workers {
        for g in &wk.gpus {
            let device = g.device.clone().unwrap_or_default();
            let (memory, util, health) = match &g.status {
                Some(s) => (
                    format!(
                        "{} / {}",
                        bytes(s.memory_used_bytes),
                        bytes(device.memory_total_bytes)
                    ),
                    format!("{}%", s.utilization_percent),
                    if s.healthy {
                        "healthy".to_string()
                    } else {
                        format!("UNHEALTHY: {}", s.error)
                    },
                ),
                None => (
                    format!("- / {}", bytes(device.memory_total_bytes)),
                    "-".into(),
                    "unknown (ask the leader)".into(),
                ),
            };
            add_row(
                &mut t,
                vec![
                    wk.worker_id.clone(),
                    device.index.to_string(),
                    device.uuid.clone(),
                    device.name.clone(),
                    memory,
                    util,
                    format!("{:.2}", g.allocated),
                    health,
                ],
            );
        }
    }
    table_text(&t)
}

/// `token ls`: one row per user.
pub fn users_table(resp: &cumulus_api::ListUsersResponse, now_ms: u64) -> String {
    if resp.users.is_empty() {
        return "no users (the cluster token is the only credential)\n".into();
    }
    let mut t = table(&["USER", "ROLE", "CREATED BY", "CREATED"]);
    for u in &resp.users {
        add_row(
            &mut t,
            vec![
                u.name.clone(),
                u.role.clone(),
                u.created_by.clone(),
                age(u.created_at_ms, now_ms),
            ],
        );
    }
    table_text(&t)
}

#[cfg(test)]
mod tests;
