//! Per-column feature statistics of a CSV data set: written once by `cumulusctl dataset
//! split` beside the shards ([`FEATURE_STATS_FILE`]), read by every rank of the example
//! trainer, so that all ranks standardize each feature column the same way
//! (`(x - mean) / std`) whatever shards they got.
//!
//! The file is JSON: `{"format": "cumulus-feature-stats/1", "rows": N, "mean": [...],
//! "std": [...]}` with one entry per feature column (the label excluded); `std` is the
//! population standard deviation. It starts with a dot, so it is never taken for a shard
//! (a dataset's shards are its files whose names do not start with one).

use serde::{Deserialize, Serialize};

/// Name of the statistics file in a dataset directory.
pub const FEATURE_STATS_FILE: &str = ".feature-stats.json";
/// Value of [`FeatureStats::format`].
pub const FEATURE_STATS_FORMAT: &str = "cumulus-feature-stats/1";
/// Most feature columns a statistics file may describe.
pub const MAX_STATS_FEATURES: usize = 1 << 20;

/// Per-column statistics of a data set's features.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FeatureStats {
    /// Always [`FEATURE_STATS_FORMAT`].
    pub format: String,
    /// Rows the statistics were computed over (≥ 1).
    pub rows: u64,
    /// Mean of each feature column.
    pub mean: Vec<f64>,
    /// Population standard deviation of each feature column (≥ 0).
    pub std: Vec<f64>,
}

/// Running sums for [`FeatureStats`] (Welford's online algorithm: one pass, numerically
/// stable; Knuth, TAOCP vol. 2, 4.2.2).
#[derive(Clone, Debug, Default)]
pub struct StatsAccumulator {
    rows: u64,
    mean: Vec<f64>,
    m2: Vec<f64>,
}

impl StatsAccumulator {
    /// Adds one row's features.
    ///
    /// # Panics
    /// When `features` has another length than the rows before it (the caller's
    /// parser guarantees one width per file).
    pub fn add(&mut self, features: &[f64]) {
        if self.rows == 0 {
            self.mean = vec![0.0; features.len()];
            self.m2 = vec![0.0; features.len()];
        }
        assert_eq!(features.len(), self.mean.len(), "one width per data set");
        self.rows += 1;
        let n = self.rows as f64;
        for (i, x) in features.iter().enumerate() {
            let delta = x - self.mean[i];
            self.mean[i] += delta / n;
            self.m2[i] += delta * (x - self.mean[i]);
        }
    }

    /// The statistics of the rows added; `None` without any.
    pub fn finish(&self) -> Option<FeatureStats> {
        (self.rows > 0).then(|| FeatureStats {
            format: FEATURE_STATS_FORMAT.to_string(),
            rows: self.rows,
            mean: self.mean.clone(),
            std: self
                .m2
                .iter()
                .map(|m2| (m2 / self.rows as f64).max(0.0).sqrt())
                .collect(),
        })
    }
}

impl FeatureStats {
    /// Checks what was read back: the format, at least one row, one mean and one std per
    /// column (`features` of them when given), every value finite, every std ≥ 0.
    ///
    /// # Errors
    /// What is wrong, as a user reads it.
    pub fn validate(&self, features: Option<usize>) -> Result<(), String> {
        if self.format != FEATURE_STATS_FORMAT {
            return Err(format!(
                "format {:?} is not {FEATURE_STATS_FORMAT:?}",
                self.format
            ));
        }
        if self.rows == 0 {
            return Err("it was computed over no rows".into());
        }
        if self.mean.len() != self.std.len() || self.mean.len() > MAX_STATS_FEATURES {
            return Err(format!(
                "it has {} means and {} standard deviations",
                self.mean.len(),
                self.std.len()
            ));
        }
        if let Some(n) = features
            && n != self.mean.len()
        {
            return Err(format!(
                "it describes {} feature columns, the data has {n}",
                self.mean.len()
            ));
        }
        if let Some(i) = self.mean.iter().position(|m| !m.is_finite()) {
            return Err(format!("the mean of column {i} is not finite"));
        }
        if let Some(i) = self.std.iter().position(|s| !s.is_finite() || *s < 0.0) {
            return Err(format!(
                "the standard deviation of column {i} is not a finite number ≥ 0"
            ));
        }
        Ok(())
    }

    /// `(x - mean) / std` of column `column` (a column that never varies, std 0, gives
    /// `x - mean`).
    pub fn standardize(&self, column: usize, x: f64) -> f64 {
        let std = self.std[column];
        let centred = x - self.mean[column];
        if std > 0.0 { centred / std } else { centred }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_standardized_with_their_own_mean_and_deviation() {
        let mut acc = StatsAccumulator::default();
        for row in [[1.0, 10.0, 5.0], [3.0, 30.0, 5.0], [5.0, 50.0, 5.0]] {
            acc.add(&row);
        }
        let s = acc.finish().expect("rows");
        assert_eq!(s.rows, 3);
        assert_eq!(s.mean, vec![3.0, 30.0, 5.0]);
        let sd = (8.0f64 / 3.0).sqrt();
        assert!((s.std[0] - sd).abs() < 1e-12);
        assert!((s.std[1] - 10.0 * sd).abs() < 1e-9);
        assert_eq!(s.std[2], 0.0);
        assert!((s.standardize(0, 5.0) - 2.0 / sd).abs() < 1e-12);
        assert!((s.standardize(1, 50.0) - 2.0 / sd).abs() < 1e-12);
        assert_eq!(
            s.standardize(2, 5.0),
            0.0,
            "a constant column is only centred"
        );
        assert_eq!(s.validate(Some(3)), Ok(()));
        assert!(s.validate(Some(4)).is_err());
        assert!(StatsAccumulator::default().finish().is_none());
    }

    #[test]
    fn a_damaged_file_is_refused_with_the_reason() {
        let good = FeatureStats {
            format: FEATURE_STATS_FORMAT.into(),
            rows: 2,
            mean: vec![0.0, 1.0],
            std: vec![1.0, 2.0],
        };
        for (bad, why) in [
            (
                FeatureStats {
                    format: "x".into(),
                    ..good.clone()
                },
                "format",
            ),
            (
                FeatureStats {
                    rows: 0,
                    ..good.clone()
                },
                "no rows",
            ),
            (
                FeatureStats {
                    std: vec![1.0],
                    ..good.clone()
                },
                "2 means and 1",
            ),
            (
                FeatureStats {
                    mean: vec![f64::NAN, 1.0],
                    ..good.clone()
                },
                "mean of column 0",
            ),
            (
                FeatureStats {
                    std: vec![1.0, -1.0],
                    ..good.clone()
                },
                "column 1",
            ),
        ] {
            let e = bad.validate(None).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }
}
