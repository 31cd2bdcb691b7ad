//! Data loading: the shards file, CSV shards and their validation.
//!
//! A shard is a CSV file (or a gzip-compressed one whose name ends in `.gz`) with no
//! header: every non-blank line is one record of numeric feature columns followed by an
//! integer class label (`0..`) in the last column. Fields may be surrounded by spaces; a
//! trailing `\r` is ignored; blank lines are skipped and are not records. Every record
//! has an id `(shard file name, line index)`: the shard's base name and the 0-based index
//! of the line in the (decompressed) file, counting skipped blank lines, so that an id
//! points at the exact line in the file. Error messages name lines 1-based, as editors do.
//!
//! All records are held in memory (`records × features × 8` bytes of features); the
//! limits below bound what one rank may load.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use thiserror::Error;

/// Longest accepted line of a shard, in bytes (excluding the line break).
pub const MAX_LINE_BYTES: usize = 1 << 20;
// Most shards one shards file may list (the job-wide shard limit of Cumulus), and the
// largest accepted shards file, in bytes: the contract's, as the Python runtime's.
pub use cumulus_api::limits::{MAX_SHARDS, MAX_SHARDS_FILE_BYTES};
/// Most feature columns a record may have.
pub const MAX_FEATURES: usize = 1_000_000;
/// Most classes a model may have (labels are `0..MAX_CLASSES`).
pub const MAX_CLASSES: u32 = 100_000;
/// Most feature values (records × features) one data set may hold in memory
/// (2 GiB of f64).
pub const MAX_VALUES: usize = 1 << 28;

/// Why data could not be loaded. Line numbers in messages are 1-based.
#[derive(Debug, Error)]
pub enum DataError {
    /// The shards file could not be read.
    #[error("cannot read shards file {path}: {source}")]
    ShardsFileRead {
        /// The shards file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The shards file lists no shard.
    #[error("shards file {path} lists no shard (it is empty or only has blank lines)")]
    ShardsFileEmpty {
        /// The shards file.
        path: PathBuf,
    },
    /// The shards file is larger than [`MAX_SHARDS_FILE_BYTES`] or lists more than
    /// [`MAX_SHARDS`] shards.
    #[error("shards file {path} is too large: {what}")]
    ShardsFileTooLarge {
        /// The shards file.
        path: PathBuf,
        /// Which limit was exceeded.
        what: String,
    },
    /// Two shards have the same base name, so record ids would not be unique.
    #[error(
        "shards {first} and {second} have the same file name {name:?}; record ids \
         (file name, line) must be unique"
    )]
    DuplicateShardName {
        /// The base name they share.
        name: String,
        /// The first shard with that name.
        first: PathBuf,
        /// The second shard with that name.
        second: PathBuf,
    },
    /// A shard path has no usable UTF-8 file name.
    #[error("shard path {path} has no UTF-8 file name")]
    BadShardName {
        /// The shard path.
        path: PathBuf,
    },
    /// A shard (or test file) could not be opened or read.
    #[error("cannot read {path}: {source}")]
    FileRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A line is not a valid record.
    #[error("{path}: line {line}: {reason}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A line has a different number of columns than the first record.
    #[error(
        "{path}: line {line}: {found} columns, but {first_path} line {first_line} has \
         {expected} (every record needs the same features plus a label)"
    )]
    ColumnCount {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// Columns found on that line.
        found: usize,
        /// Columns of the first record.
        expected: usize,
        /// File of the first record.
        first_path: PathBuf,
        /// 1-based line number of the first record.
        first_line: u64,
    },
    /// No record at all in the given files.
    #[error("no records in {what}")]
    NoRecords {
        /// What was read (e.g. the shards file).
        what: String,
    },
    /// More values than [`MAX_VALUES`].
    #[error("{path}: more than {limit} feature values in memory; the data set is too large")]
    TooLarge {
        /// The file being read when the limit was reached.
        path: PathBuf,
        /// The limit ([`MAX_VALUES`]).
        limit: usize,
    },
}

/// One shard that was loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// The path as listed in the shards file.
    pub path: PathBuf,
    /// Its base name (the first half of every record id).
    pub name: String,
    /// Records (non-blank lines) it holds.
    pub records: u64,
}

/// The id of one record: which shard, which line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordId {
    /// Index of the shard in [`Dataset::shards`].
    pub shard: u32,
    /// 0-based line index in that shard's (decompressed) file.
    pub line: u64,
}

/// Records loaded from one or more CSV files, in file order then line order.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// The files, in the order they were given.
    pub shards: Vec<ShardInfo>,
    /// Feature columns per record (columns − 1).
    pub features: usize,
    /// Raw feature values, `len() × features`, row-major.
    pub values: Vec<f64>,
    /// Class label of every record, `len()` entries.
    pub labels: Vec<u32>,
    /// Id of every record, `len()` entries.
    pub ids: Vec<RecordId>,
    /// SHA-256 fingerprint of the content: for every shard its name, a 0 byte, its record
    /// count (u64 LE), then every record's line index (u64 LE) and parsed values (f64 LE
    /// bits) and label (u32 LE). A resume checks it so that it never continues on
    /// different data.
    pub fingerprint: [u8; 32],
}

impl Dataset {
    /// Number of records.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there is no record.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The raw features of record `i` (`features` values).
    pub fn row(&self, i: usize) -> &[f64] {
        &self.values[i * self.features..(i + 1) * self.features]
    }

    /// The largest label (`None` when empty).
    pub fn max_label(&self) -> Option<u32> {
        self.labels.iter().copied().max()
    }

    /// The largest absolute feature value (0 when empty).
    pub fn max_abs_feature(&self) -> f64 {
        self.values.iter().fold(0.0_f64, |m, v| m.max(v.abs()))
    }

    /// The shard name and line index of record `i`.
    pub fn record_name(&self, i: usize) -> (&str, u64) {
        let id = self.ids[i];
        (&self.shards[id.shard as usize].name, id.line)
    }

    /// The fingerprint as lower-case hex (64 characters).
    pub fn fingerprint_hex(&self) -> String {
        hex::encode(self.fingerprint)
    }
}

/// Reads a shards file: one shard path per line, in order; blank lines are skipped and
/// surrounding whitespace trimmed. Relative paths are used as given (relative to the
/// working directory of the process).
pub fn read_shards_file(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    let read_err = |source| DataError::ShardsFileRead {
        path: path.to_path_buf(),
        source,
    };
    let size_bytes = std::fs::metadata(path).map_err(read_err)?.len();
    if size_bytes > MAX_SHARDS_FILE_BYTES {
        return Err(DataError::ShardsFileTooLarge {
            path: path.to_path_buf(),
            what: format!("{size_bytes} bytes, limit {MAX_SHARDS_FILE_BYTES}"),
        });
    }
    let text = std::fs::read_to_string(path).map_err(read_err)?;
    let shards: Vec<PathBuf> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(PathBuf::from)
        .collect();
    if shards.is_empty() {
        return Err(DataError::ShardsFileEmpty {
            path: path.to_path_buf(),
        });
    }
    if shards.len() > MAX_SHARDS {
        return Err(DataError::ShardsFileTooLarge {
            path: path.to_path_buf(),
            what: format!("{} shards, limit {MAX_SHARDS}", shards.len()),
        });
    }
    Ok(shards)
}

/// Opens a file for line reading, decompressing it when its name ends in `.gz`.
fn open_lines(path: &Path) -> Result<Box<dyn BufRead>, DataError> {
    let file = File::open(path).map_err(|source| DataError::FileRead {
        path: path.to_path_buf(),
        source,
    })?;
    let gz = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gz"));
    Ok(if gz {
        Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(file)))
    } else {
        Box::new(BufReader::new(file))
    })
}

/// Parses a label: a non-negative integer below [`MAX_CLASSES`]. An integral float
/// spelling such as `3.0` is accepted; `-1`, `2.5`, `x` are not.
///
/// # Errors
/// [`LabelError`] saying which rule the field breaks.
pub fn parse_label(field: &str) -> Result<u32, LabelError> {
    if let Ok(v) = field.parse::<u64>() {
        return if v < u64::from(MAX_CLASSES) {
            Ok(v as u32)
        } else {
            Err(LabelError::TooLarge(field.to_owned()))
        };
    }
    let bad = |make: fn(String) -> LabelError| Err(make(field.to_owned()));
    match field.parse::<f64>() {
        Ok(v) if !v.is_finite() => bad(LabelError::NotFinite),
        Ok(v) if v < 0.0 => bad(LabelError::Negative),
        Ok(v) if v.fract() != 0.0 => bad(LabelError::NotInteger),
        Ok(v) if v < f64::from(MAX_CLASSES) => Ok(v as u32),
        Ok(_) => bad(LabelError::TooLarge),
        Err(_) => bad(LabelError::NotNumber),
    }
}

/// Why a label field was refused; each holds the field as read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    /// At or above [`MAX_CLASSES`].
    #[error("label {0:?} is too large (limit {max})", max = MAX_CLASSES - 1)]
    TooLarge(String),
    /// NaN or infinite.
    #[error("label {0:?} is not a finite number")]
    NotFinite(String),
    /// Below zero.
    #[error("label {0:?} is negative")]
    Negative(String),
    /// Has a fractional part.
    #[error("label {0:?} is not an integer")]
    NotInteger(String),
    /// Does not parse as a number.
    #[error("label {0:?} is not a number")]
    NotNumber(String),
}

/// Where the column count was fixed: (file, 1-based line, columns).
type FirstRecord = (PathBuf, u64, usize);

/// Loads shards in the order given. Fails on a missing or unreadable shard, a malformed
/// line, a column count differing from the first record, a bad label, duplicate base
/// names, or no records at all.
pub fn load_shards(paths: &[PathBuf]) -> Result<Dataset, DataError> {
    let mut names: HashMap<String, PathBuf> = HashMap::new();
    let mut shards = Vec::with_capacity(paths.len());
    for path in paths {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| DataError::BadShardName { path: path.clone() })?
            .to_string();
        if let Some(first) = names.insert(name.clone(), path.clone()) {
            return Err(DataError::DuplicateShardName {
                name,
                first,
                second: path.clone(),
            });
        }
        shards.push(ShardInfo {
            path: path.clone(),
            name,
            records: 0,
        });
    }
    let mut data = Dataset {
        shards,
        features: 0,
        values: Vec::new(),
        labels: Vec::new(),
        ids: Vec::new(),
        fingerprint: [0; 32],
    };
    let mut hasher = Sha256::new();
    let mut first: Option<FirstRecord> = None;
    for index in 0..data.shards.len() {
        let path = data.shards[index].path.clone();
        let mut shard_hasher = Sha256::new();
        let records = load_one(
            &path,
            index as u32,
            &mut data,
            &mut first,
            &mut shard_hasher,
        )?;
        data.shards[index].records = records;
        hasher.update(data.shards[index].name.as_bytes());
        hasher.update([0u8]);
        hasher.update(records.to_le_bytes());
        hasher.update(shard_hasher.finalize());
    }
    if data.is_empty() {
        let what = if paths.len() == 1 {
            paths[0].display().to_string()
        } else {
            format!("any of the {} shards", paths.len())
        };
        return Err(DataError::NoRecords { what });
    }
    data.fingerprint = hasher.finalize().into();
    Ok(data)
}

/// Loads one CSV file (e.g. a holdout test file) as a data set of one shard.
pub fn load_csv(path: &Path) -> Result<Dataset, DataError> {
    load_shards(&[path.to_path_buf()])
}

/// Reads the records of one shard into `data`; returns how many it held.
fn load_one(
    path: &Path,
    shard: u32,
    data: &mut Dataset,
    first: &mut Option<FirstRecord>,
    hasher: &mut Sha256,
) -> Result<u64, DataError> {
    let mut reader = open_lines(path)?;
    let mut buf: Vec<u8> = Vec::new();
    let mut line_index: u64 = 0;
    let mut records: u64 = 0;
    let malformed = |line_index: u64, reason: String| DataError::Malformed {
        path: path.to_path_buf(),
        line: line_index + 1,
        reason,
    };
    loop {
        buf.clear();
        let n = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|source| DataError::FileRead {
                path: path.to_path_buf(),
                source,
            })?;
        if n == 0 {
            break;
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
        } else if buf.len() > MAX_LINE_BYTES {
            return Err(malformed(
                line_index,
                format!("line longer than {MAX_LINE_BYTES} bytes"),
            ));
        }
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        let text = std::str::from_utf8(&buf)
            .map_err(|_| malformed(line_index, "not valid UTF-8 text".to_string()))?;
        if text.trim().is_empty() {
            line_index += 1;
            continue;
        }
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        let columns = fields.len();
        match first {
            None => {
                if columns < 2 {
                    return Err(malformed(
                        line_index,
                        format!(
                            "{columns} column(s); a record needs at least one feature and a label"
                        ),
                    ));
                }
                if columns - 1 > MAX_FEATURES {
                    return Err(malformed(
                        line_index,
                        format!("{} features, limit {MAX_FEATURES}", columns - 1),
                    ));
                }
                *first = Some((path.to_path_buf(), line_index + 1, columns));
                data.features = columns - 1;
            }
            Some((first_path, first_line, expected)) => {
                if columns != *expected {
                    return Err(DataError::ColumnCount {
                        path: path.to_path_buf(),
                        line: line_index + 1,
                        found: columns,
                        expected: *expected,
                        first_path: first_path.clone(),
                        first_line: *first_line,
                    });
                }
            }
        }
        if data.values.len() + data.features > MAX_VALUES {
            return Err(DataError::TooLarge {
                path: path.to_path_buf(),
                limit: MAX_VALUES,
            });
        }
        hasher.update(line_index.to_le_bytes());
        for (col, field) in fields[..columns - 1].iter().enumerate() {
            if field.is_empty() {
                return Err(malformed(
                    line_index,
                    format!("column {} is empty", col + 1),
                ));
            }
            let v: f64 = field.parse().map_err(|_| {
                malformed(
                    line_index,
                    format!("column {}: {field:?} is not a number", col + 1),
                )
            })?;
            if !v.is_finite() {
                return Err(malformed(
                    line_index,
                    format!("column {}: {field:?} is not a finite number", col + 1),
                ));
            }
            hasher.update(v.to_bits().to_le_bytes());
            data.values.push(v);
        }
        let label = parse_label(fields[columns - 1])
            .map_err(|e| malformed(line_index, format!("column {columns}: {e}")))?;
        hasher.update(label.to_le_bytes());
        data.labels.push(label);
        data.ids.push(RecordId {
            shard,
            line: line_index,
        });
        records += 1;
        line_index += 1;
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write test file");
        p
    }

    #[test]
    fn loads_records_ids_and_skips_blank_lines() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "a.csv", "1,2,0\n\n 3 , 4 , 1\r\n");
        let b = write(dir.path(), "b.csv", "5,6,2");
        let d = load_shards(&[a, b]).unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(d.features, 2);
        assert_eq!(d.values, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(d.labels, vec![0, 1, 2]);
        assert_eq!(d.record_name(0), ("a.csv", 0));
        assert_eq!(d.record_name(1), ("a.csv", 2));
        assert_eq!(d.record_name(2), ("b.csv", 0));
        assert_eq!(d.shards[0].records, 2);
        assert_eq!(d.max_label(), Some(2));
        assert_eq!(d.max_abs_feature(), 6.0);
    }

    #[test]
    fn reads_gzip_shards_like_plain_ones() {
        let dir = tempfile::tempdir().unwrap();
        let plain = write(dir.path(), "p.csv", "1,2,0\n3,4,1\n");
        let gz = dir.path().join("g.csv.gz");
        let mut enc =
            flate2::write::GzEncoder::new(File::create(&gz).unwrap(), flate2::Compression::fast());
        enc.write_all(b"1,2,0\n3,4,1\n").unwrap();
        enc.finish().unwrap();
        let a = load_csv(&plain).unwrap();
        let b = load_csv(&gz).unwrap();
        assert_eq!(a.values, b.values);
        assert_eq!(a.labels, b.labels);
    }

    #[test]
    fn fingerprint_changes_with_content() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "a.csv", "1,2,0\n");
        let fa = load_csv(&a).unwrap().fingerprint;
        write(dir.path(), "a.csv", "1,2.5,0\n");
        let fb = load_csv(&a).unwrap().fingerprint;
        assert_ne!(fa, fb);
        write(dir.path(), "a.csv", "1,2,0\n");
        assert_eq!(load_csv(&a).unwrap().fingerprint, fa);
    }

    #[test]
    fn malformed_inputs_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            ("x.csv", "1,2,0\n1,abc,0\n", "line 2", "not a number"),
            ("y.csv", "1,2,0\n1,2,3,0\n", "line 2", "4 columns"),
            ("z.csv", "1,2,0\n1,2,-1\n", "line 2", "negative"),
            ("w.csv", "1,2,0.5\n", "line 1", "not an integer"),
            ("v.csv", "1,,0\n", "line 1", "empty"),
            ("u.csv", "7\n", "line 1", "at least one feature"),
            ("t.csv", "1,inf,0\n", "line 1", "finite"),
        ];
        for (name, text, line, what) in cases {
            let p = write(dir.path(), name, text);
            let err = load_csv(&p).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
            assert!(err.contains(line), "{err}");
            assert!(err.contains(what), "{err}");
        }
    }

    #[test]
    fn column_count_must_match_across_shards() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(dir.path(), "a.csv", "1,2,0\n");
        let b = write(dir.path(), "b.csv", "1,0\n");
        let err = load_shards(&[a, b]).unwrap_err();
        assert!(matches!(
            err,
            DataError::ColumnCount {
                found: 2,
                expected: 3,
                ..
            }
        ));
    }

    #[test]
    fn missing_empty_and_duplicate_shards_fail() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.csv");
        assert!(matches!(
            load_csv(&missing),
            Err(DataError::FileRead { .. })
        ));
        let empty = write(dir.path(), "e.csv", "\n\n");
        assert!(matches!(load_csv(&empty), Err(DataError::NoRecords { .. })));
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let a = write(dir.path(), "a.csv", "1,0\n");
        let a2 = write(&sub, "a.csv", "1,0\n");
        assert!(matches!(
            load_shards(&[a, a2]),
            Err(DataError::DuplicateShardName { .. })
        ));
    }

    #[test]
    fn shards_file_parsing() {
        let dir = tempfile::tempdir().unwrap();
        let f = write(dir.path(), "shards", "  /d/a.csv \n\n/d/b.csv\n");
        assert_eq!(
            read_shards_file(&f).unwrap(),
            vec![PathBuf::from("/d/a.csv"), PathBuf::from("/d/b.csv")]
        );
        let e = write(dir.path(), "empty", " \n");
        assert!(matches!(
            read_shards_file(&e),
            Err(DataError::ShardsFileEmpty { .. })
        ));
        assert!(matches!(
            read_shards_file(&dir.path().join("none")),
            Err(DataError::ShardsFileRead { .. })
        ));
    }

    #[test]
    fn label_parsing() {
        assert_eq!(parse_label("3"), Ok(3));
        assert_eq!(parse_label("3.0"), Ok(3));
        assert_eq!(parse_label("-2"), Err(LabelError::Negative("-2".into())));
        assert_eq!(
            parse_label("2.5"),
            Err(LabelError::NotInteger("2.5".into()))
        );
        assert_eq!(parse_label("cat"), Err(LabelError::NotNumber("cat".into())));
        assert_eq!(
            parse_label("100000"),
            Err(LabelError::TooLarge("100000".into()))
        );
        assert_eq!(parse_label("NaN"), Err(LabelError::NotFinite("NaN".into())));
        assert!(
            parse_label("100000")
                .unwrap_err()
                .to_string()
                .contains("too large")
        );
    }

    #[test]
    fn overlong_line_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let mut text = "1,".repeat(MAX_LINE_BYTES / 2 + 1);
        text.push_str("0\n");
        let p = write(dir.path(), "long.csv", &text);
        let err = load_csv(&p).unwrap_err().to_string();
        assert!(err.contains("longer than"), "{err}");
    }
}
