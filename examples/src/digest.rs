//! The running record digest: evidence that every record of every epoch was consumed
//! exactly once, in the planned order, across any number of restarts.
//!
//! `d_0` is 32 zero bytes; for every record consumed, in consumption order,
//! `d_{k+1} = SHA-256(d_k || epoch (u32 LE, 0-based) || shard base name (UTF-8) || 0x00 ||
//! line index (u64 LE, 0-based))`.

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::data::Dataset;
use crate::rng::epoch_order;

/// Length of a digest in bytes.
pub const DIGEST_LEN: usize = 32;

/// A digest read back from text was not 64 hex characters.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("record digest {text:?} is not {} hexadecimal characters", DIGEST_LEN * 2)]
pub struct DigestParseError {
    /// The text that was given (cut to 80 characters).
    pub text: String,
}

/// A running record digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecordDigest([u8; DIGEST_LEN]);

impl RecordDigest {
    /// The start value: 32 zero bytes.
    pub fn zero() -> Self {
        Self([0; DIGEST_LEN])
    }

    /// Chains one consumed record into the digest.
    pub fn update(&mut self, epoch: u32, shard_name: &str, line: u64) {
        let mut h = Sha256::new();
        h.update(self.0);
        h.update(epoch.to_le_bytes());
        h.update(shard_name.as_bytes());
        h.update([0u8]);
        h.update(line.to_le_bytes());
        self.0 = h.finalize().into();
    }

    /// The digest bytes.
    pub fn bytes(&self) -> &[u8; DIGEST_LEN] {
        &self.0
    }

    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 64 hex characters (either case).
    pub fn from_hex(text: &str) -> Result<Self, DigestParseError> {
        let err = || DigestParseError {
            text: text.chars().take(80).collect(),
        };
        if text.len() != DIGEST_LEN * 2 {
            return Err(err());
        }
        let mut out = [0u8; DIGEST_LEN];
        hex::decode_to_slice(text, &mut out).map_err(|_| err())?;
        Ok(Self(out))
    }
}

/// The digest of a straight run over `data` for `epochs` epochs with the record order of
/// seed `seed`: what a training run with the same shards, epochs and seed must end with,
/// however many times it was interrupted and resumed.
pub fn expected_digest(data: &Dataset, epochs: u32, seed: u64) -> RecordDigest {
    let mut digest = RecordDigest::zero();
    let mut rng_state = seed;
    for epoch in 0..epochs {
        let (order, next) = epoch_order(rng_state, data.len());
        rng_state = next;
        for i in order {
            let (name, line) = data.record_name(i);
            digest.update(epoch, name, line);
        }
    }
    digest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_is_the_documented_sha256_chain() {
        let mut d = RecordDigest::zero();
        d.update(3, "shard-1.csv", 7);
        let mut bytes = vec![0u8; 32];
        bytes.extend_from_slice(&[3, 0, 0, 0]);
        bytes.extend_from_slice(b"shard-1.csv");
        bytes.push(0);
        bytes.extend_from_slice(&[7, 0, 0, 0, 0, 0, 0, 0]);
        let expected: [u8; 32] = Sha256::digest(&bytes).into();
        assert_eq!(d.bytes(), &expected);
    }

    #[test]
    fn order_matters() {
        let mut a = RecordDigest::zero();
        a.update(0, "s", 0);
        a.update(0, "s", 1);
        let mut b = RecordDigest::zero();
        b.update(0, "s", 1);
        b.update(0, "s", 0);
        assert_ne!(a, b);
    }

    #[test]
    fn hex_round_trip_and_errors() {
        let mut d = RecordDigest::zero();
        d.update(0, "x", 1);
        assert_eq!(RecordDigest::from_hex(&d.to_hex()), Ok(d));
        assert_eq!(RecordDigest::from_hex(&d.to_hex().to_uppercase()), Ok(d));
        assert!(RecordDigest::from_hex("abc").is_err());
        assert!(RecordDigest::from_hex(&"g".repeat(64)).is_err());
    }
}
