//! Jobs' progress histories: downsampled samples of each running job's progress (step,
//! rate, reported metrics) that the leader commits with [`Command::RecordProgress`], so
//! that a chart of a job survives a leader change and any coordinator can serve it.
//!
//! Bounds (all enforced by `apply`, whatever the leader sends):
//! - one job keeps at most [`MAX_HISTORY_SAMPLES`] samples: when full, every other
//!   sample is dropped (the oldest kept) and the job's interval doubles, so a run of any
//!   length fits, evenly spaced;
//! - a job's history keeps at most [`MAX_HISTORY_METRICS`] metric names, the first
//!   it sees (names of at most [`cumulus_api::limits::MAX_METRIC_NAME_BYTES`]);
//! - a sample is taken no sooner than the job's interval ([`HISTORY_INTERVAL_MS`] at
//!   first) after the previous one, and the leader proposes at most one
//!   `RecordProgress` per [`HISTORY_INTERVAL_MS`] carrying at most
//!   [`MAX_HISTORY_JOBS`] samples (besides a job's first sample, proposed within a
//!   second of its first report): the log grows by at most ~300 KB per 10 s, and far
//!   less for a handful of jobs;
//! - at most [`MAX_HISTORY_JOBS`] jobs have a history: past it, those of deleted or
//!   evicted jobs go first, then those of jobs not running, the least recently sampled
//!   first. At most ~45 MB in all (1,024 × 240 samples of 16 metrics), in practice a few
//!   KB per job.
//!
//! Values are kept as `f64` bits ([`f64::to_bits`]): the state is `Eq`, and a NaN or an
//! infinity a rank reported survives every encoding (JSON has neither).

use std::collections::BTreeSet;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::*;

/// Most samples one job's history keeps.
pub const MAX_HISTORY_SAMPLES: usize = 240;
/// Most metrics one sample keeps.
pub const MAX_HISTORY_METRICS: usize = 16;
/// Most jobs with a history, and most samples in one [`Command::RecordProgress`].
pub const MAX_HISTORY_JOBS: usize = 1_024;
/// Interval between a job's first samples, in milliseconds (it doubles each time the
/// samples fill); also the least time between two `RecordProgress` the leader proposes.
pub const HISTORY_INTERVAL_MS: u64 = 10_000;

/// One job's progress at one moment, as the leader proposes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressSampleIn {
    /// The job's id (`job-NNNNNN`).
    pub job_id: String,
    /// Leader time, in ms since the Unix epoch.
    pub at_ms: u64,
    /// Step of the slowest rank.
    pub step: u64,
    /// Total steps (0: unknown).
    pub total_steps: u64,
    /// Steps per second, as [`f64::to_bits`] (0.0: unknown).
    pub steps_per_s_bits: u64,
    /// Metrics of the lowest rank that reported any: `(name, f64 bits)`, at most
    /// [`MAX_HISTORY_METRICS`], sorted by name.
    pub metrics: Vec<(String, u64)>,
}

/// One kept sample of [`ProgressHistory`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressPoint {
    /// Leader time, in ms since the Unix epoch.
    pub at_ms: u64,
    /// Step of the slowest rank.
    pub step: u64,
    /// Total steps (0: unknown).
    pub total_steps: u64,
    /// Steps per second, as [`f64::to_bits`].
    pub steps_per_s_bits: u64,
    /// Values of [`ProgressHistory::metric_names`] in that order, as [`f64::to_bits`]
    /// (`None`, or past the end: not reported then).
    pub metrics: Vec<Option<u64>>,
}

impl ProgressPoint {
    /// Steps per second.
    pub fn steps_per_s(&self) -> f64 {
        f64::from_bits(self.steps_per_s_bits)
    }
}

/// A job's progress history (see the module doc for its bounds).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressHistory {
    /// Names of the sampled metrics (at most [`MAX_HISTORY_METRICS`]), in the order
    /// they first appeared; a name, once here, stays.
    pub metric_names: Vec<String>,
    /// Samples, oldest first (at most [`MAX_HISTORY_SAMPLES`]).
    pub points: Vec<ProgressPoint>,
    /// Least time between two samples, in milliseconds (doubles when the samples fill).
    pub interval_ms: u64,
}

impl ProgressHistory {
    /// Whether a sample taken at leader time `at_ms` is due: none yet, or the interval
    /// has passed since the newest one.
    pub fn due(&self, at_ms: u64) -> bool {
        self.points
            .last()
            .is_none_or(|p| at_ms >= p.at_ms.saturating_add(self.interval()))
    }

    fn interval(&self) -> u64 {
        self.interval_ms.max(HISTORY_INTERVAL_MS)
    }

    /// The metrics of `point` by name.
    pub fn metrics_of<'a>(
        &'a self,
        point: &'a ProgressPoint,
    ) -> impl Iterator<Item = (&'a str, f64)> + 'a {
        self.metric_names
            .iter()
            .zip(&point.metrics)
            .filter_map(|(name, v)| v.map(|bits| (name.as_str(), f64::from_bits(bits))))
    }

    /// Adds `sample` when due (else nothing); thins the samples first when full.
    fn record(&mut self, sample: &ProgressSampleIn) -> bool {
        if !self.due(sample.at_ms) {
            return false;
        }
        for (name, _) in &sample.metrics {
            if self.metric_names.len() < MAX_HISTORY_METRICS && !self.metric_names.contains(name) {
                self.metric_names.push(name.clone());
            }
        }
        let metrics = self
            .metric_names
            .iter()
            .map(|n| {
                sample
                    .metrics
                    .iter()
                    .find(|(m, _)| m == n)
                    .map(|(_, bits)| *bits)
            })
            .collect();
        if self.points.len() >= MAX_HISTORY_SAMPLES {
            // Every other sample, the oldest first: half as many, twice as far apart.
            self.points = self.points.iter().step_by(2).cloned().collect();
            self.interval_ms = self.interval().saturating_mul(2);
        }
        self.interval_ms = self.interval();
        self.points.push(ProgressPoint {
            at_ms: sample.at_ms,
            step: sample.step,
            total_steps: sample.total_steps,
            steps_per_s_bits: sample.steps_per_s_bits,
            metrics,
        });
        true
    }
}

/// Why a `RecordProgress` is refused whole (`None`: acceptable).
pub(super) fn check_samples(samples: &[ProgressSampleIn]) -> Option<String> {
    if samples.len() > MAX_HISTORY_JOBS {
        return Some(format!(
            "{} progress samples in one command is above the limit of {MAX_HISTORY_JOBS}",
            samples.len()
        ));
    }
    for s in samples {
        if s.metrics.len() > MAX_HISTORY_METRICS {
            return Some(format!(
                "a progress sample of {} has {} metrics, above the limit of {MAX_HISTORY_METRICS}",
                s.job_id,
                s.metrics.len()
            ));
        }
        if let Some((n, _)) = s
            .metrics
            .iter()
            .find(|(n, _)| n.is_empty() || n.len() > cumulus_api::limits::MAX_METRIC_NAME_BYTES)
        {
            return Some(format!(
                "a progress sample of {} names a metric of {} bytes (1..={} allowed)",
                s.job_id,
                n.len(),
                cumulus_api::limits::MAX_METRIC_NAME_BYTES
            ));
        }
    }
    None
}

impl ClusterState {
    /// `RecordProgress`: adds each sample that is due to its job's history (a sample of
    /// a job that is not running, or not due, is skipped), then keeps at most
    /// [`MAX_HISTORY_JOBS`] histories. A command breaking a bound is refused whole.
    pub(super) fn record_progress(
        &mut self,
        samples: &[ProgressSampleIn],
        _dirty: &mut BTreeSet<DirtyKey>,
    ) -> Response {
        if let Some(reason) = check_samples(samples) {
            return reject(reason);
        }
        for s in samples {
            let running = self
                .jobs
                .get(&s.job_id)
                .is_some_and(|j| j.state == JobState::Running);
            if !running {
                continue;
            }
            let history = self.histories.entry(s.job_id.clone()).or_default();
            if history.due(s.at_ms) {
                Arc::make_mut(history).record(s);
            }
        }
        self.bound_histories();
        Response::Ok
    }

    /// Drops histories past [`MAX_HISTORY_JOBS`]: of unknown jobs first, then of jobs
    /// not running, the least recently sampled first (ties by job id).
    fn bound_histories(&mut self) {
        let excess = self.histories.len().saturating_sub(MAX_HISTORY_JOBS);
        if excess == 0 {
            return;
        }
        let mut victims: Vec<(u8, u64, String)> = self
            .histories
            .iter()
            .filter_map(|(id, h)| {
                let class = match self.jobs.get(id) {
                    None => 0,
                    Some(j) if j.state != JobState::Running => 1,
                    Some(_) => return None,
                };
                Some((class, h.points.last().map_or(0, |p| p.at_ms), id.clone()))
            })
            .collect();
        victims.sort();
        for (_, _, id) in victims.into_iter().take(excess) {
            self.histories.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{apply, cluster_with_job};
    use super::*;

    fn sample(job_id: &str, at_ms: u64, step: u64) -> ProgressSampleIn {
        ProgressSampleIn {
            job_id: job_id.into(),
            at_ms,
            step,
            total_steps: 1_000_000,
            steps_per_s_bits: 2.0f64.to_bits(),
            metrics: vec![("loss".into(), (1.0 / (step + 1) as f64).to_bits())],
        }
    }

    fn record(s: &mut ClusterState, samples: Vec<ProgressSampleIn>) -> Response {
        apply(s, Command::RecordProgress { samples })
    }

    #[test]
    fn a_history_stays_bounded_and_thins_out_evenly_over_any_run_length() {
        let (mut s, job) = cluster_with_job(2);
        // A sample offered every second for 2.8 hours: taken every interval only.
        for i in 0..10_000u64 {
            assert_eq!(
                record(&mut s, vec![sample(&job, i * 1000, i)]),
                Response::Ok
            );
            assert!(s.histories[&job].points.len() <= MAX_HISTORY_SAMPLES);
        }
        let h = &s.histories[&job];
        let first = h.points.first().expect("points");
        let last = h.points.last().expect("points");
        assert_eq!(first.step, 0, "the first sample is kept");
        assert!(last.step >= 9_999 - h.interval_ms / 1000, "{}", last.step);
        assert!(h.points.len() >= MAX_HISTORY_SAMPLES / 2);
        let gaps: Vec<u64> = h
            .points
            .windows(2)
            .map(|w| w[1].at_ms - w[0].at_ms)
            .collect();
        assert!(gaps.iter().all(|g| *g <= h.interval_ms), "{gaps:?}");
        assert_eq!(h.metric_names, vec!["loss".to_string()]);
        let values: Vec<(&str, f64)> = h.metrics_of(last).collect();
        assert_eq!(values, vec![("loss", 1.0 / (last.step + 1) as f64)]);
        // The history survives an encoding round trip (snapshots, followers).
        let bytes = crate::codec::encode(&s).expect("encode");
        let back: ClusterState = crate::codec::decode(&bytes).expect("decode");
        assert_eq!(back.histories, s.histories);
    }

    #[test]
    fn samples_of_jobs_not_running_or_not_due_change_nothing_and_bounds_are_enforced() {
        let (mut s, job) = cluster_with_job(1);
        assert_eq!(
            record(&mut s, vec![sample("job-999999", 0, 1)]),
            Response::Ok
        );
        assert!(s.histories.is_empty());
        assert_eq!(record(&mut s, vec![sample(&job, 50_000, 1)]), Response::Ok);
        assert_eq!(record(&mut s, vec![sample(&job, 55_000, 2)]), Response::Ok);
        assert_eq!(s.histories[&job].points.len(), 1, "not due yet");
        let mut wide = sample(&job, 90_000, 3);
        wide.metrics = (0..=MAX_HISTORY_METRICS)
            .map(|i| (format!("m{i:02}"), 0))
            .collect();
        assert!(matches!(
            record(&mut s, vec![wide]),
            Response::Rejected { .. }
        ));
        let many = (0..=MAX_HISTORY_JOBS)
            .map(|i| sample(&job, 90_000 + i as u64, 3))
            .collect();
        assert!(matches!(record(&mut s, many), Response::Rejected { .. }));
        assert_eq!(s.histories[&job].points.len(), 1);
        // A metric that appears later is kept from then on.
        let mut more = sample(&job, 60_000, 2);
        more.metrics
            .insert(0, ("accuracy".into(), 0.5f64.to_bits()));
        assert_eq!(record(&mut s, vec![more]), Response::Ok);
        let h = &s.histories[&job];
        assert_eq!(
            h.metric_names,
            vec!["loss".to_string(), "accuracy".to_string()]
        );
        let names = |i: usize| -> Vec<String> {
            h.metrics_of(&h.points[i])
                .map(|(n, _)| n.to_string())
                .collect()
        };
        assert_eq!(names(0), vec!["loss"]);
        assert_eq!(names(1), vec!["loss", "accuracy"]);
        // A deleted job's history goes with it.
        assert_eq!(
            apply(
                &mut s,
                Command::CancelJob {
                    job_id: job.clone(),
                    at_ms: 100_000
                }
            ),
            Response::Ok
        );
        assert!(s.histories.contains_key(&job), "kept after the job ends");
        assert_eq!(
            apply(
                &mut s,
                Command::DeleteJob {
                    job_id: job.clone()
                }
            ),
            Response::Ok
        );
        assert!(!s.histories.contains_key(&job));
    }
}
