//! Result rows, percentiles, the printed table and the JSON file.

use std::time::Duration;

use serde::Serialize;

/// One measured figure.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Scenario name, e.g. "failover".
    pub scenario: String,
    /// What was measured, e.g. "kill -> first acked write p99".
    pub metric: String,
    /// The value, in `unit`.
    pub value: f64,
    /// Unit of `value` ("ms", "ops/s", "MB", "ratio", "count").
    pub unit: String,
    /// The target as text, e.g. "< 1000", when the issue states one.
    pub target: Option<String>,
    /// Whether the target was met (None without a target).
    pub met: Option<bool>,
    /// Sample count behind the value.
    pub samples: usize,
}

impl Row {
    /// A row without a target.
    pub fn new(scenario: &str, metric: &str, value: f64, unit: &str, samples: usize) -> Row {
        Row {
            scenario: scenario.into(),
            metric: metric.into(),
            value,
            unit: unit.into(),
            target: None,
            met: None,
            samples,
        }
    }

    /// A row that must stay below `max`.
    pub fn below(
        scenario: &str,
        metric: &str,
        value: f64,
        unit: &str,
        samples: usize,
        max: f64,
    ) -> Row {
        Row {
            target: Some(format!("< {max}")),
            met: Some(value < max),
            ..Row::new(scenario, metric, value, unit, samples)
        }
    }

    /// A row that must reach at least `min`.
    pub fn at_least(
        scenario: &str,
        metric: &str,
        value: f64,
        unit: &str,
        samples: usize,
        min: f64,
    ) -> Row {
        Row {
            target: Some(format!(">= {min}")),
            met: Some(value >= min),
            ..Row::new(scenario, metric, value, unit, samples)
        }
    }
}

/// Percentile `p` (0..=100) of `samples` by nearest rank; 0 for no samples.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Milliseconds of a duration as f64.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

/// Prints the rows as a table.
pub fn print_table(rows: &[Row]) {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::NOTHING);
    t.set_header(["scenario", "metric", "value", "unit", "n", "target", "met"]);
    for r in rows {
        t.add_row([
            r.scenario.clone(),
            r.metric.clone(),
            format!("{:.3}", r.value),
            r.unit.clone(),
            r.samples.to_string(),
            r.target.clone().unwrap_or_default(),
            match r.met {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => String::new(),
            },
        ]);
    }
    println!("{t}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
