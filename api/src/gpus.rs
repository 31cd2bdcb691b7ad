//! GPUs in the contract: what a GPU UUID and a memory share may look like, and how a share
//! is spelled. The worker agent checks its inventory with these before it registers, the
//! coordinator and `apply` check a registration and a job spec with them again, and the
//! agent turns a rank's GPUs into `CUDA_VISIBLE_DEVICES` with [`cuda_visible_devices`].
//!
//! A share is kept in thousandths of a GPU ("permille", `1..=1000`), an integer, so that
//! the replicated state stays exact and comparable (the state machine holds no floats).

use crate::limits::MAX_GPU_UUID_BYTES;

/// Thousandths in one whole GPU.
pub const WHOLE_GPU_PERMILLE: u32 = 1000;

/// True for a GPU UUID the cluster accepts: 1..=[`MAX_GPU_UUID_BYTES`] bytes of
/// `[A-Za-z0-9._:-]` (NVML's are `GPU-` and a hyphenated UUID; MIG devices' `MIG-…`).
/// Such a UUID is safe in `CUDA_VISIBLE_DEVICES` (no comma) and on a terminal.
pub fn is_valid_uuid(uuid: &str) -> bool {
    !uuid.is_empty()
        && uuid.len() <= MAX_GPU_UUID_BYTES
        && uuid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// Why a memory fraction was refused.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("GPU memory fraction {0} must be a number with 0 < fraction <= 1 (steps of 0.001)")]
pub struct BadFraction(pub f64);

/// The share of a fraction `0 < fraction <= 1`, rounded to the nearest thousandth.
///
/// # Errors
/// [`BadFraction`] for a non-finite fraction, one outside `(0, 1]`, or one below 0.0005
/// (which would round to nothing).
pub fn fraction_to_permille(fraction: f64) -> Result<u32, BadFraction> {
    if !fraction.is_finite() || fraction <= 0.0 || fraction > 1.0 {
        return Err(BadFraction(fraction));
    }
    let permille = (fraction * f64::from(WHOLE_GPU_PERMILLE)).round();
    if permille < 1.0 {
        return Err(BadFraction(fraction));
    }
    // 1.0..=1000.0 after the checks above.
    Ok(permille as u32)
}

/// A share as the decimal fraction the rank sees in `CUMULUS_GPU_MEMORY_FRACTION`:
/// `500` → `"0.5"`, `1000` → `"1"`, `125` → `"0.125"`.
pub fn permille_to_fraction(permille: u32) -> String {
    let whole = permille / WHOLE_GPU_PERMILLE;
    let rest = permille % WHOLE_GPU_PERMILLE;
    if rest == 0 {
        return whole.to_string();
    }
    let digits = format!("{rest:03}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// `CUDA_VISIBLE_DEVICES` for a rank given `uuids` (comma-separated, in order; empty:
/// no GPU is visible).
pub fn cuda_visible_devices(uuids: &[String]) -> String {
    uuids.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_round_to_thousandths() {
        assert_eq!(fraction_to_permille(0.5), Ok(500));
        assert_eq!(fraction_to_permille(1.0), Ok(1000));
        assert_eq!(fraction_to_permille(0.0005), Ok(1));
        assert_eq!(fraction_to_permille(1.0 / 3.0), Ok(333));
        for bad in [0.0, -0.5, 1.0001, 0.0004, f64::NAN, f64::INFINITY] {
            assert!(fraction_to_permille(bad).is_err(), "{bad}");
        }
        assert_eq!(permille_to_fraction(500), "0.5");
        assert_eq!(permille_to_fraction(1000), "1");
        assert_eq!(permille_to_fraction(125), "0.125");
        assert_eq!(permille_to_fraction(5), "0.005");
        for p in 1..=1000 {
            let f: f64 = permille_to_fraction(p).parse().expect("a number");
            assert_eq!(fraction_to_permille(f), Ok(p));
        }
    }

    #[test]
    fn uuids() {
        assert!(is_valid_uuid("GPU-1b2c3d4e-0000-1111-2222-333344445555"));
        assert!(is_valid_uuid("MIG-GPU-1b2c/1/0".replace('/', ":").as_str()));
        for bad in [
            "",
            "GPU-0,GPU-1",
            "GPU 0",
            "GPU-\u{1b}[2J",
            &"x".repeat(129),
        ] {
            assert!(!is_valid_uuid(bad), "{bad:?}");
        }
    }
}
