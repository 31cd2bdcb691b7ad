//! `summary` (a job's progress figures and history, or the newest jobs' in a table) and
//! `watch` (live per-rank progress bars until the job ends).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use cumulus_api::{Job, ListJobSummariesRequest};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::args::{OutputFormat, SummaryArgs};
use crate::client::Client;
use crate::config::Conn;
use crate::jobs::{WAIT_POLL, is_finished, report_finished};
use crate::output::{print_data, print_text};
use crate::render;

/// `summary [JOB]`.
///
/// # Errors
/// When no coordinator answers, or the job does not exist.
pub async fn summary(conn: &Conn, args: &SummaryArgs, output: OutputFormat) -> Result<()> {
    let client = Client::new(conn)?;
    let now_ms = render::now_ms();
    match &args.job {
        Some(job_id) => {
            let s = client.get_job_summary(job_id).await?;
            match output {
                OutputFormat::Json | OutputFormat::Yaml => print_data(output, &s),
                OutputFormat::Table | OutputFormat::Wide => {
                    print_text(&render::summary_text(&s, now_ms))
                }
            }
        }
        None => {
            let resp = client
                .list_job_summaries(ListJobSummariesRequest {
                    state: args.state.map(|s| s.to_string()).unwrap_or_default(),
                    limit: args.limit,
                })
                .await?;
            match output {
                OutputFormat::Json | OutputFormat::Yaml => print_data(output, &resp),
                OutputFormat::Table | OutputFormat::Wide => {
                    print_text(&render::summaries_table(&resp, now_ms))
                }
            }
        }
    }
}

/// Most ranks `watch` draws a bar for; the others are summed up in one line.
pub const MAX_RANK_BARS: usize = 16;

/// Least time between two lines of `watch` when stderr is not a terminal.
const PLAIN_LINE_EVERY: Duration = Duration::from_secs(5);

/// The live display: a header line and one bar per rank (at most [`MAX_RANK_BARS`]) on
/// a terminal; otherwise a line on stderr when the text changes, at most every
/// [`PLAIN_LINE_EVERY`].
struct Display {
    job_id: String,
    multi: Option<MultiProgress>,
    header: Option<ProgressBar>,
    ranks: BTreeMap<u32, ProgressBar>,
    rest: Option<ProgressBar>,
    last_line: String,
    last_printed: Option<Instant>,
}

impl Display {
    fn new(job_id: &str) -> Self {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let multi = tty.then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()));
        let header = multi.as_ref().map(|m| {
            let bar = m.add(ProgressBar::new_spinner());
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self {
            job_id: job_id.to_string(),
            multi,
            header,
            ranks: BTreeMap::new(),
            rest: None,
            last_line: String::new(),
            last_printed: None,
        }
    }

    fn rank_style() -> ProgressStyle {
        ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ")
    }

    fn update(&mut self, job: &Job) {
        let head = header_text(job);
        let Some(multi) = &self.multi else {
            let line = format!("{}: {head}; {}", self.job_id, ranks_line(job));
            let due = self
                .last_printed
                .is_none_or(|t| t.elapsed() >= PLAIN_LINE_EVERY);
            if line != self.last_line && due {
                eprintln!("{line}");
                self.last_line = line;
                self.last_printed = Some(Instant::now());
            }
            return;
        };
        if let Some(h) = &self.header {
            h.set_message(format!("{} {head}", self.job_id));
        }
        for r in job.ranks.iter().take(MAX_RANK_BARS) {
            let bar = self.ranks.entry(r.rank).or_insert_with(|| {
                let bar = multi.add(ProgressBar::new(0));
                bar.set_style(Self::rank_style());
                bar.set_prefix(format!("rank {}", r.rank));
                bar
            });
            bar.set_length(r.total_steps.max(r.step));
            bar.set_position(r.step);
            bar.set_message(rank_text(r));
        }
        if job.ranks.len() > MAX_RANK_BARS {
            let rest = self.rest.get_or_insert_with(|| {
                let bar = multi.add(ProgressBar::new_spinner());
                bar.set_style(
                    ProgressStyle::with_template("{msg}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                bar
            });
            rest.set_message(rest_text(job));
        }
    }

    fn finish(&self) {
        for bar in self.ranks.values().chain(&self.rest).chain(&self.header) {
            bar.finish_and_clear();
        }
        if let Some(m) = &self.multi {
            let _ = m.clear();
        }
    }
}

/// `running, 2 restarts`, with the pending reason or the stop in flight.
fn header_text(job: &Job) -> String {
    let mut parts = vec![if job.stop_action.is_empty() {
        job.state.clone()
    } else {
        format!("{}, stopping ({})", job.state, job.stop_action)
    }];
    if job.restarts_used > 0 {
        parts.push(format!("{} restarts", job.restarts_used));
    }
    if let Some(c) = job.committed_step {
        parts.push(format!("committed step {c}"));
    }
    if !job.pending_reason.is_empty() {
        parts.push(job.pending_reason.clone());
    }
    cumulus_api::text::escape_control(&parts.join(", ")).into_owned()
}

/// `attempt 1, running, 48.2 steps/s, 7s left, loss=0.2314`.
fn rank_text(r: &cumulus_api::RankStatus) -> String {
    let mut parts = Vec::new();
    if r.attempt > 0 {
        parts.push(format!("attempt {}", r.attempt));
    }
    parts.push(r.state.clone());
    if r.steps_per_s > 0.0 {
        parts.push(format!("{:.1} steps/s", r.steps_per_s));
    }
    if r.eta_ms > 0 {
        parts.push(format!("{} left", render::duration_text(r.eta_ms)));
    }
    let metrics = render::metrics_text(&r.metrics);
    if !metrics.is_empty() {
        parts.push(metrics);
    }
    cumulus_api::text::escape_control(&parts.join(", ")).into_owned()
}

/// The ranks past the bars: how many, and the slowest of them.
fn rest_text(job: &Job) -> String {
    let rest = &job.ranks[MAX_RANK_BARS.min(job.ranks.len())..];
    match rest.iter().min_by_key(|r| r.step) {
        Some(slowest) => format!(
            "   and {} more ranks; the slowest, rank {}, at step {}",
            rest.len(),
            slowest.rank,
            slowest.step
        ),
        None => String::new(),
    }
}

/// Every rank's step in one line (the plain display).
fn ranks_line(job: &Job) -> String {
    let mut steps: Vec<String> = job
        .ranks
        .iter()
        .take(MAX_RANK_BARS)
        .map(|r| {
            if r.total_steps > 0 {
                format!("rank {} {}/{}", r.rank, r.step, r.total_steps)
            } else {
                format!("rank {} {}", r.rank, r.state)
            }
        })
        .collect();
    if job.ranks.len() > MAX_RANK_BARS {
        steps.push(rest_text(job).trim().to_string());
    }
    steps.join(", ")
}

/// `watch JOB`: follows the job until it ends, then prints its status (`-o json`: the
/// job); `Ok` only when it succeeded.
///
/// # Errors
/// When no coordinator answers, the job does not exist, or it did not succeed.
pub async fn watch(conn: &Conn, job_id: &str, output: OutputFormat) -> Result<()> {
    let client = Client::new(conn)?;
    let mut display = Display::new(job_id);
    loop {
        let resp = match client.get_job(job_id, true).await {
            Ok(resp) => resp,
            Err(e) => {
                display.finish();
                return Err(e.into());
            }
        };
        let job = resp
            .job
            .clone()
            .context("the coordinator returned no job")?;
        display.update(&job);
        if is_finished(&job.state) {
            display.finish();
            return report_finished(job_id, &resp, output);
        }
        tokio::time::sleep(WAIT_POLL).await;
    }
}
