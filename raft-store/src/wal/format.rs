//! One record of a segment on disk: its encoding (a 16-byte header, then the entry as
//! JSON), reading one back, decoding it, and telling a torn write from damage. A child of
//! `wal`, so it shares the format's constants.

use super::*;

/// Whether the bad record at `offset` has the shape of a torn write (see the module
/// doc). A disk writes whole sectors or none, into a segment preallocated with zeros, and
/// a payload (JSON) holds no zero byte; so a torn record is its written part followed by
/// zeros from a sector boundary to the end of its span `[offset, offset + 16 + len)`:
/// - its header is all zeros (its first sector was not written), or
/// - its payload is a non-zero prefix and then zeros from a sector boundary on, or all
///   zeros with a sector boundary inside the header after which the header is zeros.
///
/// Anything else is damage: a flipped bit (no zeros), a length changed to cover the
/// zeros after the last record (its zeros start where the record really ends, not at a
/// sector boundary), a length past the segment.
fn looks_torn(bytes: &[u8], offset: u64) -> bool {
    let at = offset as usize;
    let Some(header) = bytes.get(at..at + HEADER_BYTES as usize) else {
        return false;
    };
    if header.iter().all(|b| *b == 0) {
        return true;
    }
    let len = u64::from(u32::from_le_bytes(
        header[0..4].try_into().expect("4 bytes"),
    ));
    let payload_from = offset + HEADER_BYTES;
    let end = payload_from + len;
    if len == 0 || len > MAX_PAYLOAD_BYTES || end > bytes.len() as u64 {
        return false;
    }
    let payload = &bytes[payload_from as usize..end as usize];
    // The payload's written prefix: every byte before its trailing zeros.
    let written = payload.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    if written == payload.len() {
        return false; // no unwritten part at all
    }
    if payload[..written].contains(&0) {
        return false; // zeros inside the written part: not JSON, damage
    }
    if written > 0 {
        return (payload_from + written as u64).is_multiple_of(SECTOR_BYTES);
    }
    // An all-zero payload: the unwritten part began at a sector boundary inside the
    // header (or right after it), with the header zero from there.
    (offset + 1..=payload_from)
        .filter(|b| b.is_multiple_of(SECTOR_BYTES))
        .any(|b| header[(b - offset) as usize..].iter().all(|x| *x == 0))
}

/// The offset and index of the first valid record at or after `from` in `bytes`: its CRC
/// checks and its index lies in `(after_index, after_index + SCAN_INDEX_WINDOW]`. Every
/// byte offset is tried, so a record written after a bad one is found wherever it lies.
fn valid_record_after(bytes: &[u8], from: u64, after_index: Option<u64>) -> Option<(u64, u64)> {
    let lowest = after_index.map_or(0, |i| i.saturating_add(1));
    let highest = lowest.saturating_add(SCAN_INDEX_WINDOW);
    let total = bytes.len() as u64;
    let mut at = from;
    while at + HEADER_BYTES <= total {
        let h = &bytes[at as usize..(at + HEADER_BYTES) as usize];
        let len = u64::from(u32::from_le_bytes(h[0..4].try_into().expect("4 bytes")));
        let index = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        let end = at + HEADER_BYTES + len;
        if len > 0 && end <= total && (lowest..=highest).contains(&index) {
            let crc = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(&index.to_le_bytes());
            hasher.update(&bytes[(at + HEADER_BYTES) as usize..end as usize]);
            if hasher.finalize() == crc {
                return Some((at, index));
            }
        }
        at += 1;
    }
    None
}

/// Decides what a bad record (or a zero header followed by non-zero bytes) at `offset`
/// of the newest segment is: `Ok(())` for a torn tail, [`WalError::Corrupt`] otherwise.
/// `last_index` is the index of the last good record before it.
pub(super) fn classify_bad_tail(
    file: &File,
    path: &Path,
    capacity_bytes: u64,
    offset: u64,
    last_index: Option<u64>,
    reason: &str,
) -> Result<(), WalError> {
    let mut bytes = vec![0u8; capacity_bytes as usize];
    file.read_exact_at(&mut bytes, 0).map_err(io_error(path))?;
    let corrupt = |why: String| WalError::Corrupt {
        path: path.display().to_string(),
        reason: why,
    };
    if !looks_torn(&bytes, offset) {
        return Err(corrupt(format!(
            "{reason}, and it is not a torn write (no unwritten sector in it): \
             the record was damaged after it was written"
        )));
    }
    if let Some((at, index)) = valid_record_after(&bytes, offset + 1, last_index) {
        return Err(corrupt(format!(
            "{reason}, but a valid record (index {index}) follows at offset {at}: \
             records after the bad one were written, so it was acknowledged"
        )));
    }
    Ok(())
}

/// A record's bytes: header and payload.
pub(super) fn encode_record(entry: &Entry) -> Result<Vec<u8>, WalError> {
    let index = entry.log_id.index;
    let payload = serde_json::to_vec(entry).map_err(|source| WalError::Encode { index, source })?;
    let len = u32::try_from(payload.len()).map_err(|_| WalError::Encode {
        index,
        source: serde::ser::Error::custom("an entry larger than 4 GiB"),
    })?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&index.to_le_bytes());
    crc.update(&payload);
    let mut out = Vec::with_capacity(HEADER_BYTES as usize + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// What reading a record at an offset found.
pub(super) enum Read {
    /// A valid record: its index, payload, and the offset after it.
    Record(u64, Vec<u8>, u64),
    /// A zero header or the end of the segment: no more records.
    End,
    /// A record that does not check.
    Bad(String),
}

pub(super) fn read_record(file: &File, capacity_bytes: u64, offset: u64) -> io::Result<Read> {
    if offset + HEADER_BYTES > capacity_bytes {
        return Ok(Read::End);
    }
    let mut header = [0u8; HEADER_BYTES as usize];
    file.read_exact_at(&mut header, offset)?;
    let len = u64::from(u32::from_le_bytes(
        header[0..4].try_into().expect("4 bytes"),
    ));
    let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
    let index = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    if len == 0 {
        return Ok(if header.iter().all(|b| *b == 0) {
            Read::End
        } else {
            Read::Bad(format!("a header at offset {offset} with length 0"))
        });
    }
    let end = offset + HEADER_BYTES + len;
    if len > MAX_PAYLOAD_BYTES || end > capacity_bytes {
        return Ok(Read::Bad(format!(
            "a record at offset {offset} of {len} bytes runs past the segment"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    file.read_exact_at(&mut payload, offset + HEADER_BYTES)?;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&index.to_le_bytes());
    hasher.update(&payload);
    if hasher.finalize() != crc {
        return Ok(Read::Bad(format!(
            "the record at offset {offset} (index {index}) fails its CRC"
        )));
    }
    Ok(Read::Record(index, payload, end))
}

pub(super) fn decode(path: &Path, index: u64, payload: &[u8]) -> Result<Entry, WalError> {
    let entry: Entry = serde_json::from_slice(payload).map_err(|e| WalError::Corrupt {
        path: path.display().to_string(),
        reason: format!("entry {index} does not decode: {e}"),
    })?;
    if entry.log_id.index != index {
        return Err(WalError::Corrupt {
            path: path.display().to_string(),
            reason: format!(
                "the record of index {index} holds entry {}",
                entry.log_id.index
            ),
        });
    }
    Ok(entry)
}
