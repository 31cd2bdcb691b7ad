//! Softmax regression (multinomial logistic regression) and SGD with momentum.
//!
//! Parameters: a `classes × (features + 1)` row-major matrix of f64; row `c` holds the
//! weights of class `c` over the features, then its bias. Every sum runs on one thread in
//! one fixed order (features ascending, records in batch order), so results are
//! reproducible bit for bit.

use thiserror::Error;

/// Why a parameter vector could not be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ModelError {
    /// A byte buffer is not a whole number of f64 values, or not the expected count.
    #[error(
        "{what}: {found_bytes} bytes, expected {expected_bytes} ({expected_values} f64 values)"
    )]
    Size {
        /// Which buffer.
        what: String,
        /// Its size in bytes.
        found_bytes: usize,
        /// The expected size in bytes.
        expected_bytes: usize,
        /// The expected number of values.
        expected_values: usize,
    },
    /// Zero classes or zero features.
    #[error("a model needs at least one class and one feature (got {classes} × {features})")]
    Empty {
        /// Classes requested.
        classes: usize,
        /// Features requested.
        features: usize,
    },
}

/// Encodes values as consecutive f64 little-endian (8 bytes each).
pub fn f64s_to_le_bytes(values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 8);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Decodes exactly `expected_values` f64 little-endian values; `what` names the buffer in
/// the error.
pub fn f64s_from_le_bytes(
    bytes: &[u8],
    expected_values: usize,
    what: &str,
) -> Result<Vec<f64>, ModelError> {
    if bytes.len() != expected_values * 8 {
        return Err(ModelError::Size {
            what: what.to_string(),
            found_bytes: bytes.len(),
            expected_bytes: expected_values * 8,
            expected_values,
        });
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("chunks_exact yields 8 bytes")))
        .collect())
}

/// A softmax-regression model.
#[derive(Debug, Clone, PartialEq)]
pub struct SoftmaxModel {
    classes: usize,
    features: usize,
    weights: Vec<f64>,
}

impl SoftmaxModel {
    /// All-zero parameters.
    pub fn zeros(classes: usize, features: usize) -> Result<Self, ModelError> {
        if classes == 0 || features == 0 {
            return Err(ModelError::Empty { classes, features });
        }
        Ok(Self {
            classes,
            features,
            weights: vec![0.0; classes * (features + 1)],
        })
    }

    /// Given parameters (`classes × (features + 1)` values, row-major, bias last).
    pub fn from_weights(
        classes: usize,
        features: usize,
        weights: Vec<f64>,
    ) -> Result<Self, ModelError> {
        let mut m = Self::zeros(classes, features)?;
        if weights.len() != m.weights.len() {
            return Err(ModelError::Size {
                what: "weights".to_string(),
                found_bytes: weights.len() * 8,
                expected_bytes: m.weights.len() * 8,
                expected_values: m.weights.len(),
            });
        }
        m.weights = weights;
        Ok(m)
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// Number of features.
    pub fn features(&self) -> usize {
        self.features
    }

    /// Number of parameters: `classes × (features + 1)`.
    pub fn param_count(&self) -> usize {
        self.weights.len()
    }

    /// The parameters, row-major, bias last in each row.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The parameters, mutable (for the optimizer).
    pub fn weights_mut(&mut self) -> &mut [f64] {
        &mut self.weights
    }

    /// Writes the `classes` logits of one record (`features` values) into `out`.
    pub fn logits(&self, x: &[f64], out: &mut [f64]) {
        let stride = self.features + 1;
        for (c, o) in out.iter_mut().enumerate().take(self.classes) {
            let row = &self.weights[c * stride..(c + 1) * stride];
            let mut z = row[self.features];
            for (w, v) in row[..self.features].iter().zip(x) {
                z += w * v;
            }
            *o = z;
        }
    }

    /// The predicted class of one record (the largest logit; the lowest class on a tie).
    pub fn predict(&self, x: &[f64]) -> usize {
        let mut z = vec![0.0; self.classes];
        self.logits(x, &mut z);
        let mut best = 0;
        for c in 1..self.classes {
            if z[c] > z[best] {
                best = c;
            }
        }
        best
    }

    /// Cross-entropy loss and its gradient over a mini-batch.
    ///
    /// `x` holds records of `features` values row-major, `labels` one label per record
    /// (each `< classes`), `batch` the record indices of the batch in order. Writes the
    /// mean gradient over the batch into `grad` (`param_count()` values, overwritten) and
    /// returns the *sum* of the per-record losses (natural log).
    pub fn batch_gradient(
        &self,
        x: &[f64],
        labels: &[u32],
        batch: &[usize],
        grad: &mut [f64],
    ) -> f64 {
        let f = self.features;
        let stride = f + 1;
        grad.iter_mut().for_each(|g| *g = 0.0);
        let mut z = vec![0.0; self.classes];
        let mut loss_sum = 0.0;
        for &i in batch {
            let row = &x[i * f..(i + 1) * f];
            let y = labels[i] as usize;
            self.logits(row, &mut z);
            let max = z.iter().fold(f64::NEG_INFINITY, |m, v| m.max(*v));
            let shifted_y = z[y] - max;
            let mut sum = 0.0;
            for v in z.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            // z now holds exp(z_c − max); loss = log Σ exp(z − max) − (z_y − max).
            loss_sum += sum.ln() - shifted_y;
            for c in 0..self.classes {
                let p = z[c] / sum;
                let d = if c == y { p - 1.0 } else { p };
                let g = &mut grad[c * stride..(c + 1) * stride];
                for (gj, xj) in g[..f].iter_mut().zip(row) {
                    *gj += d * xj;
                }
                g[f] += d;
            }
        }
        let n = batch.len() as f64;
        grad.iter_mut().for_each(|g| *g /= n);
        loss_sum
    }

    /// Fraction of records predicted right (`x` row-major, one label per record);
    /// 0 for no records.
    pub fn accuracy(&self, x: &[f64], labels: &[u32]) -> f64 {
        if labels.is_empty() {
            return 0.0;
        }
        let f = self.features;
        let right = labels
            .iter()
            .enumerate()
            .filter(|(i, y)| self.predict(&x[i * f..(i + 1) * f]) == **y as usize)
            .count();
        right as f64 / labels.len() as f64
    }
}

/// SGD with (heavy-ball) momentum: `v ← μ·v + g; w ← w − η·v`.
#[derive(Debug, Clone, PartialEq)]
pub struct Momentum {
    /// Learning rate η.
    pub lr: f64,
    /// Momentum μ in `[0, 1)`.
    pub momentum: f64,
    velocity: Vec<f64>,
}

impl Momentum {
    /// A fresh optimizer for `params` parameters (zero velocity).
    pub fn new(lr: f64, momentum: f64, params: usize) -> Self {
        Self {
            lr,
            momentum,
            velocity: vec![0.0; params],
        }
    }

    /// An optimizer with a saved velocity.
    pub fn with_velocity(lr: f64, momentum: f64, velocity: Vec<f64>) -> Self {
        Self {
            lr,
            momentum,
            velocity,
        }
    }

    /// The velocity buffer (one value per parameter).
    pub fn velocity(&self) -> &[f64] {
        &self.velocity
    }

    /// Applies one update to `weights` with gradient `grad` (same length as the velocity).
    pub fn apply(&mut self, weights: &mut [f64], grad: &[f64]) {
        for ((w, v), g) in weights.iter_mut().zip(self.velocity.iter_mut()).zip(grad) {
            *v = self.momentum * *v + g;
            *w -= self.lr * *v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loss_of(m: &SoftmaxModel, x: &[f64], y: &[u32], batch: &[usize]) -> f64 {
        let mut g = vec![0.0; m.param_count()];
        m.batch_gradient(x, y, batch, &mut g)
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let weights: Vec<f64> = (0..12).map(|i| ((i * 7 % 5) as f64 - 2.0) * 0.1).collect();
        let m = SoftmaxModel::from_weights(3, 3, weights).unwrap();
        let x = [0.5, -1.0, 0.25, 1.5, 0.0, -0.5];
        let y = [2, 0];
        let batch = [0, 1];
        let mut g = vec![0.0; 12];
        m.batch_gradient(&x, &y, &batch, &mut g);
        let eps = 1e-6;
        for (k, gk) in g.iter().enumerate() {
            let mut plus = m.clone();
            plus.weights_mut()[k] += eps;
            let mut minus = m.clone();
            minus.weights_mut()[k] -= eps;
            let numeric = (loss_of(&plus, &x, &y, &batch) - loss_of(&minus, &x, &y, &batch))
                / (2.0 * eps)
                / 2.0;
            assert!((numeric - gk).abs() < 1e-6, "param {k}: {numeric} vs {gk}");
        }
    }

    #[test]
    fn zero_model_has_uniform_loss() {
        let m = SoftmaxModel::zeros(4, 2).unwrap();
        let loss = loss_of(&m, &[1.0, 2.0], &[3], &[0]);
        assert!((loss - 4f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn training_separates_two_classes() {
        let x = [0.0, 1.0, 1.0, 0.0, 0.1, 0.9, 0.9, 0.1];
        let y = [0, 1, 0, 1];
        let mut m = SoftmaxModel::zeros(2, 2).unwrap();
        let mut opt = Momentum::new(0.5, 0.9, m.param_count());
        let mut g = vec![0.0; m.param_count()];
        for _ in 0..50 {
            m.batch_gradient(&x, &y, &[0, 1, 2, 3], &mut g);
            opt.apply(m.weights_mut(), &g);
        }
        assert_eq!(m.accuracy(&x, &y), 1.0);
    }

    #[test]
    fn momentum_update_rule() {
        let mut w = vec![1.0, 2.0];
        let mut opt = Momentum::new(0.1, 0.5, 2);
        opt.apply(&mut w, &[1.0, -1.0]);
        assert_eq!(opt.velocity(), &[1.0, -1.0]);
        assert_eq!(w, vec![0.9, 2.1]);
        opt.apply(&mut w, &[1.0, 0.0]);
        assert_eq!(opt.velocity(), &[1.5, -0.5]);
        assert!((w[0] - 0.75).abs() < 1e-15 && (w[1] - 2.15).abs() < 1e-15);
    }

    #[test]
    fn byte_encoding_round_trip_and_size_errors() {
        let v = vec![1.5, -0.0, f64::MIN_POSITIVE, 1e300];
        let b = f64s_to_le_bytes(&v);
        assert_eq!(b.len(), 32);
        let back = f64s_from_le_bytes(&b, 4, "w").unwrap();
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(matches!(
            f64s_from_le_bytes(&b[..31], 4, "w"),
            Err(ModelError::Size {
                found_bytes: 31,
                ..
            })
        ));
        assert!(SoftmaxModel::from_weights(2, 2, vec![0.0; 5]).is_err());
        assert!(SoftmaxModel::zeros(0, 3).is_err());
    }
}
