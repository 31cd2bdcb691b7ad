//! `artifacts ls` and `artifacts get`: what a job's ranks left in `$CUMULUS_OUTPUT_DIR`,
//! read from the blob store (the job's owner or an administrator only: the cluster
//! checks), each archive checked as hostile input by [`cumulus_bundle`].

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use cumulus_api::Artifact;
use cumulus_bundle::{EntryKind, UnpackError, UnpackLimits};
use serde::Serialize;

use crate::args::{ArtifactsGetArgs, OutputFormat};
use crate::client::Client;
use crate::config::Conn;
use crate::output::{print_data, print_text};
use crate::render;
use crate::upload::download;

/// One file of `artifacts ls`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ArtifactFile {
    /// The rank that left it.
    pub rank: u32,
    /// Its attempt.
    pub attempt: u32,
    /// Path under the output directory.
    pub path: String,
    /// Size in bytes.
    pub size_bytes: u64,
}

/// The job's artifacts (only `rank`'s when given).
async fn artifacts_of(conn: &Conn, job_id: &str, rank: Option<u32>) -> Result<Vec<Artifact>> {
    let job = Client::new(conn)?
        .get_job(job_id, true)
        .await?
        .job
        .context("the coordinator returned no job")?;
    Ok(job
        .artifacts
        .into_iter()
        .filter(|a| rank.is_none_or(|r| a.rank == r))
        .collect())
}

/// `artifacts ls JOB [--rank N]`: every file of every rank's artifacts.
///
/// # Errors
/// No such job, the cluster refused a download, or an archive is refused.
pub async fn ls(conn: &Conn, job_id: &str, rank: Option<u32>, output: OutputFormat) -> Result<()> {
    let artifacts = artifacts_of(conn, job_id, rank).await?;
    let mut files = Vec::new();
    for a in &artifacts {
        let blob = a.blob.as_ref().context("an artifact without a blob")?;
        let archive = download(conn, blob).await?;
        let path = archive.path().to_path_buf();
        let entries = tokio::task::spawn_blocking(move || {
            cumulus_bundle::list(&path, &UnpackLimits::default())
        })
        .await
        .context("the listing task")?
        .with_context(|| format!("the artifacts of rank {} attempt {}", a.rank, a.attempt))?;
        files.extend(
            entries
                .into_iter()
                .filter(|e| e.kind == EntryKind::File)
                .map(|e| ArtifactFile {
                    rank: a.rank,
                    attempt: a.attempt,
                    path: e.path,
                    size_bytes: e.size,
                }),
        );
    }
    match output {
        OutputFormat::Json | OutputFormat::Yaml => print_data(output, &files),
        OutputFormat::Table | OutputFormat::Wide => {
            if artifacts.is_empty() {
                eprintln!("{}", none_left(job_id, rank));
                return Ok(());
            }
            print_text(&artifacts_table(&files))
        }
    }
}

/// Why there is nothing to list.
fn none_left(job_id: &str, rank: Option<u32>) -> String {
    match rank {
        Some(r) => format!(
            "rank {r} of {job_id} left no artifacts (what a rank writes under $CUMULUS_OUTPUT_DIR is kept when its attempt ends)"
        ),
        None => format!(
            "{job_id} has no artifacts (what a rank writes under $CUMULUS_OUTPUT_DIR is kept when its attempt ends)"
        ),
    }
}

/// The table of `artifacts ls`.
pub fn artifacts_table(files: &[ArtifactFile]) -> String {
    let mut t = render::table(&["RANK", "ATTEMPT", "SIZE", "PATH"]);
    for f in files {
        t.add_row(vec![
            f.rank.to_string(),
            f.attempt.to_string(),
            f.size_bytes.to_string(),
            cumulus_api::text::escape_control(&f.path).into_owned(),
        ]);
    }
    render::table_text(&t)
}

/// Where `artifacts get` writes: `--out`, or the file's name in the current directory.
///
/// # Errors
/// No `--out` and a path without a file name.
pub fn destination(args: &ArtifactsGetArgs) -> Result<PathBuf> {
    if let Some(out) = &args.out {
        return Ok(out.clone());
    }
    match Path::new(&args.path).file_name() {
        Some(name) => Ok(PathBuf::from(name)),
        None => bail!(
            "{} names no file: give a file's path as `artifacts ls` shows it, or --out",
            cumulus_api::text::escape_control(&args.path)
        ),
    }
}

/// `artifacts get JOB PATH [--rank N] [--out FILE] [--force]`.
///
/// # Errors
/// The destination exists (without `--force`), the rank left no artifacts or no such
/// file, the cluster refused, or the archive is refused.
pub async fn get(conn: &Conn, args: &ArtifactsGetArgs) -> Result<()> {
    let dest = destination(args)?;
    let to_stdout = dest == Path::new("-");
    if !to_stdout && !args.force && dest.symlink_metadata().is_ok() {
        bail!("{} exists: pass --force to replace it", dest.display());
    }
    let artifacts = artifacts_of(conn, &args.job, Some(args.rank)).await?;
    let Some(artifact) = artifacts.first() else {
        bail!("{}", none_left(&args.job, Some(args.rank)));
    };
    let blob = artifact
        .blob
        .as_ref()
        .context("an artifact without a blob")?;
    let archive = download(conn, blob).await?;
    let archive_path = archive.path().to_path_buf();
    let wanted = args.path.clone();
    let (force, job, rank) = (args.force, args.job.clone(), args.rank);
    let written = tokio::task::spawn_blocking(move || {
        extract_to(&archive_path, &wanted, &dest, force).map_err(|e| match e.downcast_ref() {
            Some(UnpackError::NotFound(_)) => anyhow::anyhow!(
                "the artifacts of rank {rank} have no file {} (see `cumulusctl artifacts ls {job} --rank {rank}`)",
                cumulus_api::text::escape_control(&wanted)
            ),
            _ => e,
        })
        .map(|n| (n, dest))
    })
    .await
    .context("the extraction task")??;
    if !to_stdout {
        eprintln!(
            "wrote {} ({} bytes; rank {} attempt {})",
            written.1.display(),
            written.0,
            artifact.rank,
            artifact.attempt
        );
    }
    Ok(())
}

/// Copies the file `wanted` of the archive to `dest` (`-`: stdout) through a temporary
/// file beside it, so a failure leaves nothing half-written; replaces `dest` only with
/// `force`.
fn extract_to(archive: &Path, wanted: &str, dest: &Path, force: bool) -> Result<u64> {
    let limits = UnpackLimits::default();
    if dest == Path::new("-") {
        let mut out = std::io::stdout().lock();
        let n = cumulus_bundle::extract_file(archive, wanted, &mut out, &limits)?;
        out.flush().context("writing to stdout")?;
        return Ok(n);
    }
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut temp = tempfile::Builder::new()
        .prefix(".cumulus-artifact-")
        .tempfile_in(dir)
        .with_context(|| format!("a temporary file in {}", dir.display()))?;
    let n = cumulus_bundle::extract_file(archive, wanted, temp.as_file_mut(), &limits)?;
    temp.as_file()
        .sync_all()
        .with_context(|| format!("syncing {}", temp.path().display()))?;
    let persisted = if force {
        temp.persist(dest)
    } else {
        temp.persist_noclobber(dest)
    };
    persisted.map_err(|e| {
        if e.error.kind() == std::io::ErrorKind::AlreadyExists {
            anyhow::anyhow!("{} exists: pass --force to replace it", dest.display())
        } else {
            anyhow::Error::new(e.error).context(format!("writing {}", dest.display()))
        }
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{ArtifactsCommand, Cli, Command};
    use clap::Parser;

    fn get_args(argv: &[&str]) -> ArtifactsGetArgs {
        let argv = ["cumulusctl", "artifacts", "get"].iter().chain(argv);
        match Cli::try_parse_from(argv).expect("parse").command {
            Command::Artifacts(ArtifactsCommand::Get(a)) => a,
            _ => panic!("not artifacts get"),
        }
    }

    #[test]
    fn get_defaults_to_rank_0_and_the_files_name_here() {
        let a = get_args(&["job-000001", "models/final.pt"]);
        assert_eq!((a.rank, a.force), (0, false));
        assert_eq!(destination(&a).expect("dest"), PathBuf::from("final.pt"));
        let a = get_args(&["job-000001", "x", "--rank", "3", "--out", "-", "--force"]);
        assert_eq!((a.rank, a.force), (3, true));
        assert_eq!(destination(&a).expect("dest"), PathBuf::from("-"));
        let a = get_args(&["job-000001", ".."]);
        assert!(destination(&a).is_err(), "no file name");
    }

    /// An archive of `files` made by packing a real directory.
    fn packed(files: &[(&str, &[u8])]) -> (tempfile::TempDir, cumulus_bundle::Packed) {
        let dir = tempfile::tempdir().expect("tempdir");
        for (path, bytes) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, bytes).expect("write");
        }
        let packed = cumulus_bundle::pack(
            dir.path(),
            &cumulus_bundle::PackOptions {
                respect_ignore_files: false,
                ..Default::default()
            },
        )
        .expect("pack");
        (dir, packed)
    }

    #[test]
    fn extraction_refuses_to_overwrite_without_force_and_leaves_no_partial_file() {
        let (_src, archive) = packed(&[("models/final.pt", b"weights"), ("log.txt", b"log")]);
        let out = tempfile::tempdir().expect("tempdir");
        let dest = out.path().join("final.pt");
        let n = extract_to(archive.path(), "models/final.pt", &dest, false).expect("extract");
        assert_eq!(
            (n, std::fs::read(&dest).expect("read")),
            (7, b"weights".to_vec())
        );
        let err = extract_to(archive.path(), "log.txt", &dest, false).expect_err("exists");
        assert!(err.to_string().contains("--force"), "{err}");
        assert_eq!(std::fs::read(&dest).expect("read"), b"weights", "kept");
        extract_to(archive.path(), "log.txt", &dest, true).expect("forced");
        assert_eq!(std::fs::read(&dest).expect("read"), b"log");
        let err = extract_to(archive.path(), "nope", &out.path().join("nope"), false)
            .expect_err("no such file");
        assert!(
            matches!(err.downcast_ref(), Some(UnpackError::NotFound(_))),
            "{err}"
        );
        let left: Vec<_> = std::fs::read_dir(out.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(
            left,
            vec![std::ffi::OsString::from("final.pt")],
            "no temp files"
        );
    }

    #[test]
    fn the_table_escapes_paths() {
        let text = artifacts_table(&[ArtifactFile {
            rank: 1,
            attempt: 2,
            path: "a\u{1b}[2Jb".into(),
            size_bytes: 3,
        }]);
        assert!(
            text.contains("a\\u{1b}[2Jb") && text.contains("RANK"),
            "{text}"
        );
    }
}
