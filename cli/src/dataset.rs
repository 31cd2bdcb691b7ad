//! `dataset split`: a CSV (or .csv.gz) of numeric columns with the integer label last,
//! validated row by row, split deterministically into a holdout file and `N` shard files
//! (`shard-00000.csv` …) filled round-robin.
//!
//! Row `i` (0-based, data rows only) is held out when `floor((i+1)·f) > floor(i·f)`: the
//! holdout gets `floor(rows·f)` rows spread evenly over the file (for f = 0.2, every
//! fifth row). The `j`-th remaining row goes to shard `j mod N`.
//!
//! The shards' per-column feature statistics (mean and population standard deviation,
//! the holdout's rows excluded) go to `.feature-stats.json` beside them
//! ([`cumulus_api::feature_stats`]): the example trainer standardizes every feature
//! column with them, the same way on every rank.
//!
//! Nothing is published unless the whole input is valid: rows are written to hidden
//! `.shard-NNNNN.csv.partial` files (and `<holdout>.partial`), renamed into place at the
//! end, and removed on any error.

use cumulus_api::feature_stats::{FEATURE_STATS_FILE, FeatureStats, StatsAccumulator};
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

/// Most shards one split writes: the most one job may have (the contract's limit).
pub const MAX_SHARDS: u32 = cumulus_api::limits::MAX_SHARDS as u32;
/// Longest input line accepted, bytes.
pub const MAX_LINE_BYTES: usize = 1024 * 1024;
/// Rows buffered in memory for all shards together before they are appended to disk, bytes.
pub const SHARD_BUFFER_BYTES: usize = 8 * 1024 * 1024;
/// Default holdout fraction when `--holdout-out` is given without `--holdout-fraction`.
pub const DEFAULT_HOLDOUT_FRACTION: f64 = 0.2;

/// Errors of a split; each names the file (and line) that was wrong.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    /// I/O on a named path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A row is malformed.
    #[error("{path}:{line}: {reason}")]
    BadRow {
        /// The input file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What was wrong.
        reason: RowError,
    },
    /// The input has no data rows.
    #[error("{0}: no rows")]
    Empty(PathBuf),
    /// The output directory is not empty and `--force` was not given.
    #[error("{path} is not empty ({entries} entries); pass --force to replace its shard files")]
    OutNotEmpty {
        /// The directory.
        path: PathBuf,
        /// Entries found.
        entries: usize,
    },
    /// The holdout file exists and `--force` was not given.
    #[error("{0} exists; pass --force to overwrite it")]
    HoldoutExists(PathBuf),
    /// Inconsistent options.
    #[error("{0}")]
    Options(String),
}

/// What to split and where.
#[derive(Debug, Clone)]
pub struct SplitOptions {
    /// Input CSV, optionally gzip-compressed (detected by its magic bytes).
    pub input: PathBuf,
    /// Number of shard files, 1..=[`MAX_SHARDS`].
    pub shards: u32,
    /// Output directory (created if absent).
    pub out: PathBuf,
    /// Fraction of rows held out, 0 ≤ f < 1.
    pub holdout_fraction: f64,
    /// Holdout file, required when `holdout_fraction > 0`, outside `out`.
    pub holdout_out: Option<PathBuf>,
    /// Replace `shard-*.csv` files in a non-empty `out` and an existing holdout file.
    pub force: bool,
}

/// What a split wrote.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitReport {
    /// The input file.
    pub input: PathBuf,
    /// Data rows read.
    pub rows: u64,
    /// Columns per row (features + label).
    pub columns: usize,
    /// Distinct labels seen, ascending.
    pub labels: Vec<u64>,
    /// Rows written to the holdout file.
    pub holdout_rows: u64,
    /// The holdout file, when one was written.
    pub holdout_file: Option<PathBuf>,
    /// The shard directory.
    pub out_dir: PathBuf,
    /// Rows per shard, by shard index.
    pub shard_rows: Vec<u64>,
    /// Files in `out_dir` that are not shards of this split (they would be read as shards).
    pub other_files: Vec<String>,
}

/// Whether data row `i` (0-based) goes to the holdout for fraction `f`.
pub fn is_held_out(i: u64, f: f64) -> bool {
    ((i + 1) as f64 * f).floor() > (i as f64 * f).floor()
}

/// File name of shard `index`: `shard-00000.csv`.
pub fn shard_name(index: u32) -> String {
    format!("shard-{index:05}.csv")
}

/// One validated row.
#[derive(Debug, Clone, PartialEq)]
pub struct RowInfo {
    /// Number of columns.
    pub columns: usize,
    /// The label (last column).
    pub label: u64,
    /// The feature values (every column but the last).
    pub features: Vec<f64>,
}

/// Validates one line (without its `\n`/`\r\n`): ≥ 2 comma-separated columns, every
/// feature a finite number, the last an integer label ≥ 0.
///
/// # Errors
/// [`RowError`] saying which rule the line breaks (columns are 1-based).
pub fn parse_row(line: &str) -> Result<RowInfo, RowError> {
    if line.trim().is_empty() {
        return Err(RowError::Empty);
    }
    let fields: Vec<&str> = line.split(',').collect();
    if fields.len() < 2 {
        return Err(RowError::TooFewColumns(fields.len()));
    }
    let (label, features) = fields.split_last().expect("at least two fields");
    let mut values = Vec::with_capacity(features.len());
    for (i, f) in features.iter().enumerate() {
        let bad = |make: fn(usize, String) -> RowError| make(i + 1, (*f).to_owned());
        let v: f64 = f.trim().parse().map_err(|_| bad(RowError::NotNumber))?;
        if !v.is_finite() {
            return Err(bad(RowError::NotFinite));
        }
        values.push(v);
    }
    let l = label.trim();
    if l.is_empty() || !l.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RowError::BadLabel(fields.len(), (*label).to_owned()));
    }
    let label = l
        .parse::<u64>()
        .map_err(|_| RowError::LabelTooLarge(l.to_owned()))?;
    Ok(RowInfo {
        columns: fields.len(),
        label,
        features: values,
    })
}

/// Why a row of the input was refused; columns are 1-based, fields as read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    /// Longer than [`MAX_LINE_BYTES`].
    #[error("line longer than {MAX_LINE_BYTES} bytes")]
    TooLong,
    /// Not UTF-8.
    #[error("not UTF-8")]
    NotUtf8,
    /// Blank.
    #[error("empty line")]
    Empty,
    /// Fewer than two columns (the count).
    #[error("{0} column(s); need at least one feature and the label")]
    TooFewColumns(usize),
    /// Another column count than the first line's.
    #[error("{found} columns, but line 1 has {first}")]
    ColumnCount {
        /// Columns on this line.
        found: usize,
        /// Columns on line 1.
        first: usize,
    },
    /// A feature that is not a number.
    #[error("column {0}: {1:?} is not a number")]
    NotNumber(usize, String),
    /// A feature that is NaN or infinite.
    #[error("column {0}: {1:?} is not finite")]
    NotFinite(usize, String),
    /// A label that is not an integer ≥ 0.
    #[error("label (column {0}) {1:?} is not an integer ≥ 0")]
    BadLabel(usize, String),
    /// A label above `u64::MAX`.
    #[error("label {0:?} is too large")]
    LabelTooLarge(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SplitError + '_ {
    move |source| SplitError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Opens the input, transparently decompressing gzip.
fn open_input(path: &Path) -> Result<Box<dyn BufRead>, SplitError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut magic = [0u8; 2];
    let n = read_up_to(&mut f, &mut magic).map_err(io_err(path))?;
    let f = File::open(path).map_err(io_err(path))?;
    if n == 2 && magic == [0x1f, 0x8b] {
        Ok(Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(
            f,
        ))))
    } else {
        Ok(Box::new(BufReader::new(f)))
    }
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Makes `p` absolute against the current directory (without requiring it to exist).
pub fn absolute(p: &Path) -> std::io::Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Ok(std::env::current_dir()?.join(p))
    }
}

/// Canonical form of `p`, or of its nearest existing ancestor joined with the rest.
pub fn canonical_lenient(p: &Path) -> PathBuf {
    let abs = absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(c) = existing.canonicalize() {
            let mut out = c;
            for part in rest.iter().rev() {
                out.push(part);
            }
            return out;
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return abs,
        }
    }
}

/// Prepares `out`: creates it, or checks it is empty, or (with force) removes its
/// `shard-*.csv` and leftover `.partial` files. Returns the other file names left there.
fn prepare_out(out: &Path, force: bool) -> Result<Vec<String>, SplitError> {
    fs::create_dir_all(out).map_err(io_err(out))?;
    let mut entries = Vec::new();
    for e in fs::read_dir(out).map_err(io_err(out))? {
        let e = e.map_err(io_err(out))?;
        entries.push(e.file_name().to_string_lossy().into_owned());
    }
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    if !force {
        return Err(SplitError::OutNotEmpty {
            path: out.to_path_buf(),
            entries: entries.len(),
        });
    }
    let mut others = Vec::new();
    for name in entries {
        let path = out.join(&name);
        let ours = (name.starts_with("shard-") && name.ends_with(".csv"))
            || (name.starts_with(".shard-") && name.ends_with(".csv.partial"))
            || name == FEATURE_STATS_FILE;
        if ours
            && path
                .symlink_metadata()
                .map(|m| m.is_file())
                .unwrap_or(false)
        {
            fs::remove_file(&path).map_err(io_err(&path))?;
        } else {
            others.push(name);
        }
    }
    others.sort();
    Ok(others)
}

/// Writes the shards' feature statistics to `<out>/.feature-stats.json` (temp file,
/// fsync, rename), for every rank of a job to standardize its features the same way.
fn write_stats(out: &Path, stats: &FeatureStats) -> Result<(), SplitError> {
    let path = out.join(FEATURE_STATS_FILE);
    let tmp = out.join(format!("{FEATURE_STATS_FILE}.partial"));
    let bytes = serde_json::to_vec_pretty(stats).map_err(|e| SplitError::Io {
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    {
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    fs::rename(&tmp, &path).map_err(io_err(&path))
}

/// Per-shard row buffers appended to `.partial` files when they grow past the limit.
struct ShardWriter {
    dir: PathBuf,
    buffers: Vec<Vec<u8>>,
    buffered: usize,
    rows: Vec<u64>,
}

impl ShardWriter {
    fn partial(&self, i: usize) -> PathBuf {
        self.dir.join(format!(".{}.partial", shard_name(i as u32)))
    }

    fn push(&mut self, shard: usize, line: &str) -> Result<(), SplitError> {
        self.buffers[shard].extend_from_slice(line.as_bytes());
        self.buffers[shard].push(b'\n');
        self.buffered += line.len() + 1;
        self.rows[shard] += 1;
        if self.buffered >= SHARD_BUFFER_BYTES {
            self.flush(false)?;
        }
        Ok(())
    }

    /// Appends every non-empty buffer; `all` also creates the files of empty shards.
    fn flush(&mut self, all: bool) -> Result<(), SplitError> {
        for i in 0..self.buffers.len() {
            if self.buffers[i].is_empty() && !all {
                continue;
            }
            let path = self.partial(i);
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(io_err(&path))?;
            f.write_all(&self.buffers[i]).map_err(io_err(&path))?;
            self.buffers[i].clear();
        }
        self.buffered = 0;
        Ok(())
    }

    fn remove_partials(&self) {
        for i in 0..self.buffers.len() {
            let _ = fs::remove_file(self.partial(i));
        }
    }

    fn publish(&self) -> Result<(), SplitError> {
        for i in 0..self.buffers.len() {
            let from = self.partial(i);
            let to = self.dir.join(shard_name(i as u32));
            fs::rename(&from, &to).map_err(io_err(&to))?;
        }
        Ok(())
    }
}

/// Validates the options, then splits. See the module docs for the rules.
pub fn split(opts: &SplitOptions) -> Result<SplitReport, SplitError> {
    let (out, holdout) = check_options(opts)?;
    let mut reader = open_input(&opts.input)?;
    let other_files = prepare_out(&out, opts.force)?;

    let n = opts.shards as usize;
    let mut shards = ShardWriter {
        dir: out.clone(),
        buffers: vec![Vec::new(); n],
        buffered: 0,
        rows: vec![0; n],
    };
    let holdout_partial = holdout.as_ref().map(|h| {
        let mut name = h.file_name().map(|s| s.to_os_string()).unwrap_or_default();
        name.push(".partial");
        h.with_file_name(name)
    });
    let result = write_partials(
        opts,
        &mut *reader,
        &out,
        &mut shards,
        holdout_partial.as_deref(),
    )
    .map(|counts| SplitReport {
        input: opts.input.clone(),
        rows: counts.rows,
        columns: counts.columns,
        labels: counts.labels.into_iter().collect(),
        holdout_rows: counts.held,
        holdout_file: holdout.clone(),
        out_dir: out.clone(),
        shard_rows: shards.rows.clone(),
        other_files,
    });
    match result {
        Ok(report) => {
            shards.publish()?;
            if let (Some(from), Some(to)) = (&holdout_partial, &holdout) {
                fs::rename(from, to).map_err(io_err(to))?;
            }
            Ok(report)
        }
        Err(e) => {
            shards.remove_partials();
            let _ = fs::remove_file(out.join(FEATURE_STATS_FILE));
            if let Some(p) = &holdout_partial {
                let _ = fs::remove_file(p);
            }
            Err(e)
        }
    }
}

/// Checks `opts` against each other and the file system: the shard count, the holdout
/// fraction, the holdout file given exactly when the fraction is positive, outside the
/// output directory, and new unless `--force` (its parent directory is created).
/// Returns the output directory and the holdout file, both absolute.
///
/// # Errors
/// [`SplitError::Options`] for inconsistent options, [`SplitError::HoldoutExists`],
/// [`SplitError::Io`] when a path cannot be resolved or the holdout's parent created.
fn check_options(opts: &SplitOptions) -> Result<(PathBuf, Option<PathBuf>), SplitError> {
    if opts.shards == 0 || opts.shards > MAX_SHARDS {
        return Err(SplitError::Options(format!(
            "--shards must be 1..={MAX_SHARDS}, got {}",
            opts.shards
        )));
    }
    let f = opts.holdout_fraction;
    if !f.is_finite() || !(0.0..1.0).contains(&f) {
        return Err(SplitError::Options(format!(
            "--holdout-fraction must be in [0, 1), got {f}"
        )));
    }
    let holdout = match (&opts.holdout_out, f > 0.0) {
        (Some(p), true) => Some(absolute(p).map_err(io_err(p))?),
        (None, false) => None,
        (None, true) => {
            return Err(SplitError::Options(
                "--holdout-fraction > 0 needs --holdout-out FILE".into(),
            ));
        }
        (Some(_), false) => {
            return Err(SplitError::Options(
                "--holdout-out given with --holdout-fraction 0: nothing would be held out".into(),
            ));
        }
    };
    let out = absolute(&opts.out).map_err(io_err(&opts.out))?;
    if let Some(h) = &holdout {
        let hc = canonical_lenient(h);
        let oc = canonical_lenient(&out);
        if hc.starts_with(&oc) {
            return Err(SplitError::Options(format!(
                "the holdout file {} must not be inside --out {} (it would be read as a shard)",
                h.display(),
                out.display()
            )));
        }
        if h.exists() && !opts.force {
            return Err(SplitError::HoldoutExists(h.clone()));
        }
        if let Some(parent) = h.parent() {
            fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
    }
    Ok((out, holdout))
}

/// What the rows of a split's input held.
struct RowCounts {
    /// Data rows read.
    rows: u64,
    /// Columns per row (features + label).
    columns: usize,
    /// Distinct labels seen.
    labels: std::collections::BTreeSet<u64>,
    /// Rows written to the holdout.
    held: u64,
}

/// Writes every row of `reader` to the partial files: the held-out ones to
/// `holdout_partial` (when the fraction is positive), the others round-robin to
/// `shards`, flushed; then the shards' feature statistics into `out`, and the holdout
/// synced. Nothing is published: the caller renames or removes what was written.
///
/// # Errors
/// [`SplitError::BadRow`] for the first invalid row, [`SplitError::Empty`] for an input
/// without rows, [`SplitError::Io`] naming the file that could not be read or written.
fn write_partials(
    opts: &SplitOptions,
    reader: &mut dyn BufRead,
    out: &Path,
    shards: &mut ShardWriter,
    holdout_partial: Option<&Path>,
) -> Result<RowCounts, SplitError> {
    let mut hold_writer = match holdout_partial {
        Some(p) => Some(BufWriter::new(File::create(p).map_err(io_err(p))?)),
        None => None,
    };
    // The shards' per-column statistics (not the holdout's: it is for testing).
    let mut stats = StatsAccumulator::default();
    let counts = split_rows(
        opts,
        reader,
        shards,
        hold_writer.as_mut().zip(holdout_partial),
        &mut stats,
    )?;
    if counts.rows == 0 {
        return Err(SplitError::Empty(opts.input.clone()));
    }
    shards.flush(true)?;
    if let Some(stats) = stats.finish() {
        write_stats(out, &stats)?;
    }
    if let (Some(w), Some(p)) = (hold_writer, holdout_partial) {
        let file = w.into_inner().map_err(|e| SplitError::Io {
            path: p.to_path_buf(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io_err(p))?;
    }
    Ok(counts)
}

/// Reads, validates and distributes the rows of `reader` one line at a time: each held
/// out (by `opts.holdout_fraction`) goes to `holdout` (its writer and path), every
/// other one to the next shard of `shards` round-robin, its features into `stats`.
///
/// # Errors
/// [`SplitError::BadRow`] for a line too long, not UTF-8, malformed or with another
/// column count than the first; [`SplitError::Io`] when reading or writing fails.
fn split_rows(
    opts: &SplitOptions,
    reader: &mut dyn BufRead,
    shards: &mut ShardWriter,
    mut holdout: Option<(&mut BufWriter<File>, &Path)>,
    stats: &mut StatsAccumulator,
) -> Result<RowCounts, SplitError> {
    let f = opts.holdout_fraction;
    let n = opts.shards as usize;
    let mut counts = RowCounts {
        rows: 0,
        columns: 0,
        labels: std::collections::BTreeSet::new(),
        held: 0,
    };
    let mut kept = 0u64;
    let mut buf = Vec::new();
    let mut line_no = 0u64;
    loop {
        buf.clear();
        let read = (&mut *reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(io_err(&opts.input))?;
        if read == 0 {
            break;
        }
        line_no += 1;
        let bad = |reason: RowError| SplitError::BadRow {
            path: opts.input.clone(),
            line: line_no,
            reason,
        };
        if buf.len() > MAX_LINE_BYTES && buf.last() != Some(&b'\n') {
            return Err(bad(RowError::TooLong));
        }
        let text = std::str::from_utf8(&buf).map_err(|_| bad(RowError::NotUtf8))?;
        let text = text.strip_suffix('\n').unwrap_or(text);
        let text = text.strip_suffix('\r').unwrap_or(text);
        let info = parse_row(text).map_err(bad)?;
        if counts.rows == 0 {
            counts.columns = info.columns;
        } else if info.columns != counts.columns {
            return Err(bad(RowError::ColumnCount {
                found: info.columns,
                first: counts.columns,
            }));
        }
        counts.labels.insert(info.label);
        if is_held_out(counts.rows, f) {
            let (w, p) = holdout
                .as_mut()
                .expect("a positive fraction always has a holdout writer");
            w.write_all(text.as_bytes()).map_err(io_err(p))?;
            w.write_all(b"\n").map_err(io_err(p))?;
            counts.held += 1;
        } else {
            shards.push((kept % n as u64) as usize, text)?;
            stats.add(&info.features);
            kept += 1;
        }
        counts.rows += 1;
    }
    Ok(counts)
}

/// Human summary of a split.
pub fn report_text(r: &SplitReport) -> String {
    let min = r.shard_rows.iter().min().copied().unwrap_or(0);
    let max = r.shard_rows.iter().max().copied().unwrap_or(0);
    let mut s = format!(
        "read {} rows of {} columns ({} distinct labels) from {}\n",
        r.rows,
        r.columns,
        r.labels.len(),
        r.input.display()
    );
    if let Some(h) = &r.holdout_file {
        s.push_str(&format!(
            "holdout: {} rows -> {}\n",
            r.holdout_rows,
            h.display()
        ));
    }
    s.push_str(&format!(
        "shards:  {} rows -> {} files {}/shard-00000.csv .. {} ({}..{} rows each)\n",
        r.rows - r.holdout_rows,
        r.shard_rows.len(),
        r.out_dir.display(),
        shard_name(r.shard_rows.len().saturating_sub(1) as u32),
        min,
        max
    ));
    if min == 0 {
        s.push_str("warning: some shards are empty (more shards than rows)\n");
    }
    if !r.other_files.is_empty() {
        s.push_str(&format!(
            "warning: {} other file(s) in {} will also be read as shards: {}\n",
            r.other_files.len(),
            r.out_dir.display(),
            r.other_files.join(", ")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bundled digits data (1797 rows, 64 features + label).
    pub(crate) fn digits() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits/digits.csv.gz")
    }

    fn read_lines(p: &Path) -> Vec<String> {
        let mut s = String::new();
        open_input(p)
            .expect("open")
            .read_to_string(&mut s)
            .expect("read");
        s.lines().map(str::to_string).collect()
    }

    fn opts(out: &Path, holdout: Option<PathBuf>, f: f64) -> SplitOptions {
        SplitOptions {
            input: digits(),
            shards: 8,
            out: out.to_path_buf(),
            holdout_fraction: f,
            holdout_out: holdout,
            force: false,
        }
    }

    #[test]
    fn digits_split_into_8_shards_and_20_percent_holdout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("shards");
        let hold = dir.path().join("holdout.csv");
        let r = split(&opts(&out, Some(hold.clone()), 0.2)).expect("split");
        assert_eq!(r.rows, 1797);
        assert_eq!(r.columns, 65);
        assert_eq!(r.labels, (0..10).collect::<Vec<u64>>());
        assert_eq!(r.holdout_rows, 359, "floor(1797 * 0.2)");
        assert_eq!(r.shard_rows, vec![180, 180, 180, 180, 180, 180, 179, 179]);

        let all = read_lines(&digits());
        let held = read_lines(&hold);
        assert_eq!(held.len(), 359);
        for (k, line) in held.iter().enumerate() {
            assert_eq!(line, &all[5 * k + 4], "every fifth row is held out");
        }
        let kept: Vec<&String> = all
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 5 != 4)
            .map(|(_, l)| l)
            .collect();
        let mut names: Vec<String> = fs::read_dir(&out)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut expected: Vec<String> = (0..8).map(shard_name).collect();
        expected.insert(0, FEATURE_STATS_FILE.to_string());
        assert_eq!(
            names, expected,
            "the shards and their statistics, no partial files"
        );
        // The statistics are those of the shards' rows (the holdout's excluded).
        let stats: FeatureStats =
            serde_json::from_slice(&fs::read(out.join(FEATURE_STATS_FILE)).expect("stats"))
                .expect("stats JSON");
        assert_eq!(stats.validate(Some(64)), Ok(()));
        assert_eq!(stats.rows, kept.len() as u64);
        let column_0: Vec<f64> = kept
            .iter()
            .map(|l| {
                l.split(',')
                    .next()
                    .expect("a column")
                    .parse()
                    .expect("a number")
            })
            .collect();
        let mean = column_0.iter().sum::<f64>() / column_0.len() as f64;
        assert!(
            (stats.mean[0] - mean).abs() < 1e-12,
            "{} vs {mean}",
            stats.mean[0]
        );
        for s in 0..8 {
            let lines = read_lines(&out.join(shard_name(s)));
            let expect: Vec<&String> = kept.iter().skip(s as usize).step_by(8).copied().collect();
            assert_eq!(
                lines.iter().collect::<Vec<_>>(),
                expect,
                "shard {s} is round-robin"
            );
        }
        let text = report_text(&r);
        assert!(
            text.contains("1797 rows") && text.contains("359 rows") && text.contains("179..180"),
            "{text}"
        );
    }

    #[test]
    fn split_is_deterministic_and_refuses_non_empty_out_without_force() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        split(&opts(&a, None, 0.0)).expect("split a");
        split(&opts(&b, None, 0.0)).expect("split b");
        for s in 0..8 {
            assert_eq!(
                fs::read(a.join(shard_name(s))).expect("a"),
                fs::read(b.join(shard_name(s))).expect("b")
            );
        }
        let err = split(&opts(&a, None, 0.0)).expect_err("non-empty");
        assert!(
            matches!(err, SplitError::OutNotEmpty { entries: 9, .. }),
            "{err}"
        );

        // --force with fewer shards: stale shards are removed, other files are reported.
        fs::write(a.join("README"), "x").expect("write");
        let mut o = opts(&a, None, 0.0);
        o.force = true;
        o.shards = 3;
        let r = split(&o).expect("forced");
        assert_eq!(r.other_files, vec!["README".to_string()]);
        assert!(!a.join(shard_name(3)).exists());
        assert_eq!(r.shard_rows.iter().sum::<u64>(), 1797);
    }

    #[test]
    fn bad_rows_are_named_by_line_and_nothing_is_published() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases = [
            ("1,2,3\n4,5\n", 2, "2 columns, but line 1 has 3"),
            ("1,2,3\n4,x,5\n", 2, "\"x\" is not a number"),
            ("1,2,3\n4,5,-1\n", 2, "not an integer"),
            ("1,2,3\n4,5,2.5\n", 2, "not an integer"),
            ("1,2,3\n\n", 2, "empty line"),
            ("1,2,3\r\n4,inf,1\r\n", 2, "not finite"),
            ("7\n", 1, "need at least one feature"),
        ];
        for (i, (content, line, needle)) in cases.iter().enumerate() {
            let input = dir.path().join(format!("in-{i}.csv"));
            fs::write(&input, content).expect("write");
            let out = dir.path().join(format!("out-{i}"));
            let hold = dir.path().join(format!("hold-{i}.csv"));
            let o = SplitOptions {
                input: input.clone(),
                shards: 2,
                out: out.clone(),
                holdout_fraction: 0.5,
                holdout_out: Some(hold.clone()),
                force: false,
            };
            let err = split(&o).expect_err(content);
            match &err {
                SplitError::BadRow {
                    line: l, reason, ..
                } => {
                    assert_eq!(l, line, "{err}");
                    assert!(
                        reason.to_string().contains(needle),
                        "{err} should contain {needle}"
                    );
                }
                other => panic!("case {i}: unexpected {other}"),
            }
            assert!(
                err.to_string().contains(&format!("in-{i}.csv:{line}")),
                "{err}"
            );
            assert_eq!(
                fs::read_dir(&out).expect("ls").count(),
                0,
                "no shard published for case {i}"
            );
            assert!(!hold.exists() && !dir.path().join(format!("hold-{i}.csv.partial")).exists());
        }
        let empty = dir.path().join("empty.csv");
        fs::write(&empty, "").expect("write");
        let o = SplitOptions {
            input: empty,
            shards: 1,
            out: dir.path().join("e"),
            holdout_fraction: 0.0,
            holdout_out: None,
            force: false,
        };
        assert!(matches!(split(&o), Err(SplitError::Empty(_))));
    }

    #[test]
    fn options_are_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("o");
        assert!(
            matches!(split(&opts(&out, None, 0.2)), Err(SplitError::Options(_))),
            "fraction without file"
        );
        assert!(matches!(
            split(&opts(&out, Some(dir.path().join("h")), 0.0)),
            Err(SplitError::Options(_))
        ));
        assert!(matches!(
            split(&opts(&out, Some(dir.path().join("h")), 1.0)),
            Err(SplitError::Options(_))
        ));
        assert!(
            matches!(
                split(&opts(&out, Some(out.join("h.csv")), 0.2)),
                Err(SplitError::Options(_))
            ),
            "holdout inside out"
        );
        let mut o = opts(&out, None, 0.0);
        o.shards = 0;
        assert!(matches!(split(&o), Err(SplitError::Options(_))));
        let h = dir.path().join("exists.csv");
        fs::write(&h, "x").expect("write");
        assert!(matches!(
            split(&opts(&out, Some(h), 0.2)),
            Err(SplitError::HoldoutExists(_))
        ));
    }

    #[test]
    fn more_shards_than_rows_and_uncompressed_input() {
        let dir = tempfile::tempdir().expect("tempdir");
        let input = dir.path().join("small.csv");
        fs::write(&input, "0.5,1\n1.5,0\n2.5,1").expect("write");
        let o = SplitOptions {
            input,
            shards: 5,
            out: dir.path().join("o"),
            holdout_fraction: 0.0,
            holdout_out: None,
            force: false,
        };
        let r = split(&o).expect("split");
        assert_eq!(r.shard_rows, vec![1, 1, 1, 0, 0]);
        assert_eq!(
            fs::read_to_string(dir.path().join("o").join(shard_name(2))).expect("read"),
            "2.5,1\n"
        );
        assert_eq!(
            fs::read(dir.path().join("o").join(shard_name(4)))
                .expect("read")
                .len(),
            0
        );
        assert!(report_text(&r).contains("some shards are empty"));
    }

    #[test]
    fn holdout_rule() {
        let held: Vec<u64> = (0..20).filter(|&i| is_held_out(i, 0.25)).collect();
        assert_eq!(held, vec![3, 7, 11, 15, 19]);
        assert!((0..1000).all(|i| !is_held_out(i, 0.0)));
        assert_eq!((0..1797).filter(|&i| is_held_out(i, 0.2)).count(), 359);
    }
}
