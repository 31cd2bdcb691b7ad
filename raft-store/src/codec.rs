//! The encoding of a coordinator's snapshots and of what it sends to its peers:
//! MessagePack (`rmp-serde`), structs as maps with their field names, so
//! `#[serde(default)]` and skipped fields behave as they do in JSON and a field added
//! later still reads old records.
//!
//! Why not JSON, which these bytes were until the write path was profiled on a 2-vCPU
//! VM: JSON scans every byte of every string for escapes, and a submit's entry is mostly
//! strings (paths, arguments, shard names). Encoding each replication request, decoding
//! it on each follower and encoding the state for a snapshot were a follower's largest
//! costs after the transport (docs/perf-notes.md, "MessagePack on the wire and in
//! snapshots").
//!
//! The write-ahead log keeps JSON (`wal.rs`): it tells a torn write from damage by the
//! zeros a torn record ends in, which needs a payload that holds no zero byte, and
//! MessagePack writes zeros (a 0, a length).
//!
//! JSON written by earlier versions is still read: every value encoded here is a map (a
//! struct, or an enum such as `Result` as `{variant: value}`), and a JSON object starts
//! with `{` (0x7b), which is never the first byte of a MessagePack map (0x80–0x8f, 0xde,
//! 0xdf). [`decode`] picks the format by that byte.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Why bytes could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value does not encode (a programming error: every type here encodes).
    #[error("cannot encode: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    /// MessagePack bytes that do not decode to the expected type.
    #[error("not a valid record: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    /// JSON (an earlier version's) that does not decode to the expected type.
    #[error("not a valid record (JSON): {0}")]
    Json(#[from] serde_json::Error),
    /// No bytes at all.
    #[error("no bytes")]
    Empty,
}

/// Encodes `value` as MessagePack, structs as maps.
///
/// # Errors
/// [`CodecError::Encode`] when a type's `Serialize` fails.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    Ok(rmp_serde::to_vec_named(value)?)
}

/// Decodes `bytes` written by [`encode`], or JSON written by an earlier version (the
/// first byte tells which).
///
/// # Errors
/// [`CodecError`] when the bytes are empty or do not decode to `T`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    match bytes.first() {
        None => Err(CodecError::Empty),
        Some(b'{') => Ok(serde_json::from_slice(bytes)?),
        Some(_) => Ok(rmp_serde::from_slice(bytes)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Command, JobSpec};

    fn submit() -> Command {
        Command::SubmitJob {
            owner: "alice".into(),
            request_id: "req-1".into(),
            spec: JobSpec {
                name: "päth \"quoted\" \n".into(),
                ..JobSpec::new(4, vec!["/usr/bin/python3".into(), "train.py".into()])
            },
            shards: vec!["/data/shard-0".into(), "/data/shard-1".into()],
            submitted_at_ms: 17,
        }
    }

    #[test]
    fn values_round_trip_and_json_from_earlier_versions_still_reads() {
        let cmd = submit();
        let packed = encode(&cmd).expect("encode");
        assert_ne!(packed.first(), Some(&b'{'));
        assert_eq!(decode::<Command>(&packed).expect("decode"), cmd);
        let json = serde_json::to_vec(&cmd).expect("json");
        assert_eq!(decode::<Command>(&json).expect("decode json"), cmd);
        let result: Result<u64, String> = Err("no".into());
        assert_eq!(
            decode::<Result<u64, String>>(&encode(&result).expect("encode")).expect("decode"),
            result
        );
    }

    #[test]
    fn members_without_a_raft_address_read_and_write_as_before() {
        use crate::CumulusNode;
        // A member stored before `raft_addr` existed (JSON and MessagePack, as
        // `to_vec_named` wrote it): read with an empty raft address, which means the
        // gRPC port.
        #[derive(serde::Serialize)]
        struct OldNode {
            grpc_addr: String,
            http_addr: String,
        }
        let old = OldNode {
            grpc_addr: "c1:7000".into(),
            http_addr: "c1:8000".into(),
        };
        for bytes in [
            encode(&old).expect("encode"),
            serde_json::to_vec(&old).expect("json"),
        ] {
            let n: CumulusNode = decode(&bytes).expect("an old member decodes");
            assert_eq!(n.raft_addr, "");
            assert_eq!(n.raft_target(), "c1:7000");
        }
        // Without a raft address a member is written exactly as before.
        let same = CumulusNode {
            grpc_addr: "c1:7000".into(),
            http_addr: "c1:8000".into(),
            raft_addr: String::new(),
        };
        assert_eq!(
            encode(&same).expect("encode"),
            encode(&old).expect("encode")
        );
        // With one, it round-trips and is where peers dial.
        let apart = CumulusNode {
            raft_addr: "c1:7100".into(),
            ..same
        };
        let back: CumulusNode = decode(&encode(&apart).expect("encode")).expect("decode");
        assert_eq!(back, apart);
        assert_eq!(back.raft_target(), "c1:7100");
    }

    #[test]
    fn damaged_bytes_are_refused_not_misread() {
        let packed = encode(&submit()).expect("encode");
        assert!(matches!(decode::<Command>(&[]), Err(CodecError::Empty)));
        assert!(decode::<Command>(&packed[..packed.len() / 2]).is_err());
        assert!(matches!(
            decode::<Command>(b"{\"SubmitJob\": 3}"),
            Err(CodecError::Json(_))
        ));
        let mut wrong = packed.clone();
        wrong[0] = 0xc1; // never used in MessagePack
        assert!(decode::<Command>(&wrong).is_err());
    }
}
