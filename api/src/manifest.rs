//! A committed checkpoint step's `MANIFEST.json`, as the leader writes it (`cumulus_ckpt`)
//! and a rank reads it back (the Python runtime's resume state): its file name, format
//! versions, size limit and fields. `cumulus_ckpt::Manifest` is the writer; its tests check
//! its serde output against [`MANIFEST`].

use crate::shape::{Field, FieldType, Shape};

/// File name of a step's manifest, inside `step-N/`.
pub const MANIFEST_FILE: &str = "MANIFEST.json";
/// File name of the pointer to the newest committed step, inside the job directory.
pub const LATEST_FILE: &str = "LATEST";
/// The manifest format written now. Format 2 records each file's `digest` as
/// `<algorithm>:<hex>`; format 1 (still read) recorded a bare hex `sha256`.
pub const MANIFEST_FORMAT_VERSION: u32 = 2;
/// The oldest manifest format still read and verified.
pub const MIN_MANIFEST_FORMAT_VERSION: u32 = 1;
/// Largest `MANIFEST.json` written or read back, in bytes (16 MiB).
pub const MAX_MANIFEST_BYTES: u64 = 16 * 1024 * 1024;

/// One file of a part (format 2; [`crate::FileEntry`]).
pub const MANIFEST_FILE_ENTRY: Shape = Shape {
    name: "ManifestFileEntry",
    doc: "One file of a checkpoint part in ``MANIFEST.json`` (format 2).",
    fields: &[
        Field::required(
            "path",
            FieldType::Str,
            "Path relative to the part directory, ``/``-separated.",
        ),
        Field::required("size_bytes", FieldType::Int, "File size in bytes."),
        Field::required(
            "digest",
            FieldType::Str,
            "Digest of the content, ``<algorithm>:<hex>``.",
        ),
    ],
};

/// One rank's committed part of a step.
pub const MANIFEST_PART: Shape = Shape {
    name: "ManifestPart",
    doc: "One rank's committed part of a step in ``MANIFEST.json``.",
    fields: &[
        Field::required("rank", FieldType::Int, "The rank (0-based)."),
        Field::required(
            "attempt",
            FieldType::Int,
            "The attempt of the rank that committed it.",
        ),
        Field::required(
            "dir",
            FieldType::Str,
            "Part directory relative to the job directory, ``step-N/rank-R/attempt-A``.",
        ),
        Field::required(
            "files",
            FieldType::List(&MANIFEST_FILE_ENTRY),
            "Every regular file of the part, sorted by path.",
        ),
        Field::required(
            "state",
            FieldType::Object,
            "The rank's resume state (a JSON object).",
        ),
    ],
};

/// The manifest of a committed step, `step-N/MANIFEST.json`.
pub const MANIFEST: Shape = Shape {
    name: "Manifest",
    doc: "The manifest of a committed step, ``step-N/MANIFEST.json``.",
    fields: &[
        Field::required(
            "format_version",
            FieldType::Int,
            "The manifest format (``MANIFEST_FORMAT_VERSION`` when written now).",
        ),
        Field::required("job_id", FieldType::Str, "The job the step belongs to."),
        Field::required(
            "step",
            FieldType::Int,
            "The training step of the checkpoint.",
        ),
        Field::required("world_size", FieldType::Int, "Number of ranks of the job."),
        Field::required(
            "committed_at_ms",
            FieldType::Int,
            "When the leader committed the step, ms since the Unix epoch.",
        ),
        Field::required(
            "parts",
            FieldType::List(&MANIFEST_PART),
            "Exactly one part per rank, sorted by rank.",
        ),
    ],
};
