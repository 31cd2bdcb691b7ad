//! Bad input makes the trainer exit non-zero with an error that names what is wrong
//! (file and line for a malformed record), before training starts.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write test file");
    p
}

fn shards_file(dir: &Path, shards: &[&Path]) -> PathBuf {
    let text: String = shards
        .iter()
        .map(|p| format!("{}\n", p.display()))
        .collect();
    write(dir, "shards.txt", &text)
}

/// Runs `train` on `shards_file`; returns (exit code, stderr).
fn train(dir: &Path, shards_file: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let o = run(trainer()
        .arg("train")
        .arg("--shards-file")
        .arg(shards_file)
        .arg("--out")
        .arg(dir.join("out"))
        .args(["--epochs", "1"])
        .args(extra));
    (o.status.code(), stderr(&o))
}

#[test]
fn missing_and_empty_shards_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, err) = train(dir.path(), &dir.path().join("absent.txt"), &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot read shards file") && err.contains("absent.txt"),
        "{err}"
    );

    let empty = write(dir.path(), "empty.txt", "\n  \n");
    let (code, err) = train(dir.path(), &empty, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("lists no shard"), "{err}");

    // Neither --shards-file nor CUMULUS_SHARDS_FILE.
    let o = run(trainer()
        .arg("train")
        .arg("--out")
        .arg(dir.path().join("out")));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("CUMULUS_SHARDS_FILE"), "{}", stderr(&o));
}

#[test]
fn missing_shard_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = write(dir.path(), "a.csv", "1,2,0\n3,4,1\n");
    let missing = dir.path().join("b.csv");
    let f = shards_file(dir.path(), &[&good, &missing]);
    let (code, err) = train(dir.path(), &f, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot read") && err.contains("b.csv"),
        "{err}"
    );
}

#[test]
fn malformed_records_name_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = write(dir.path(), "good.csv", "1,2,0\n3,4,1\n");
    let cases = [
        (
            "text.csv",
            "1,2,0\n1,two,1\n",
            "line 2",
            "\"two\" is not a number",
        ),
        ("cols.csv", "1,2,0\n\n1,2,3,1\n", "line 3", "4 columns"),
        ("neg.csv", "1,2,-1\n", "line 1", "negative"),
        ("frac.csv", "1,2,0\n1,2,1.5\n", "line 2", "not an integer"),
        ("nolabel.csv", "1,2,\n", "line 1", "not a number"),
    ];
    for (name, text, line, what) in cases {
        let bad = write(dir.path(), name, text);
        let f = shards_file(dir.path(), &[&good, &bad]);
        let (code, err) = train(dir.path(), &f, &[]);
        assert_eq!(code, Some(1), "{name}: {err}");
        assert!(
            err.contains(name) && err.contains(line) && err.contains(what),
            "{name}: {err}"
        );
        assert!(!dir.path().join("out/rank-0/result.json").exists());
    }
    // A column count differing from the first shard's names both places.
    let narrow = write(dir.path(), "narrow.csv", "5,1\n");
    let f = shards_file(dir.path(), &[&good, &narrow]);
    let (code, err) = train(dir.path(), &f, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("narrow.csv: line 1: 2 columns") && err.contains("good.csv line 1 has 3"),
        "{err}"
    );
}

#[test]
fn bad_test_file_and_arguments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = write(dir.path(), "good.csv", "1,2,0\n3,4,1\n");
    let f = shards_file(dir.path(), &[&good]);
    let test = write(dir.path(), "test.csv", "1,2,0\n1,2,7\n");
    let (code, err) = train(
        dir.path(),
        &f,
        &["--test-file", test.to_str().expect("utf-8")],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("test.csv line 2: label 7"), "{err}");
    let test = write(dir.path(), "test3.csv", "1,2,3,0\n");
    let (code, err) = train(
        dir.path(),
        &f,
        &["--test-file", test.to_str().expect("utf-8")],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("3 features, the training data 2"), "{err}");

    let (code, err) = train(dir.path(), &f, &["--classes", "1"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--classes 1 is too small"), "{err}");
    let (code, err) = train(dir.path(), &f, &["--momentum", "1.5"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--momentum"), "{err}");
    let (code, err) = train(dir.path(), &f, &["--feature-scale=-2"]);
    assert_eq!(code, Some(2), "clap usage error: {err}");
    assert!(err.contains("feature scale"), "{err}");

    // CUMULUS_CKPT_STAGING without an agent cannot commit anything.
    let o = run(trainer()
        .arg("train")
        .arg("--shards-file")
        .arg(&f)
        .arg("--out")
        .arg(dir.path().join("out"))
        .env("CUMULUS_CKPT_STAGING", dir.path().join("staging")));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("CUMULUS_AGENT_URL"), "{}", stderr(&o));

    // It still trains with good input (the cases above failed for their own reason).
    let (code, err) = train(dir.path(), &f, &[]);
    assert_eq!(code, Some(0), "{err}");
}
