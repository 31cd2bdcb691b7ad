//! Standalone training on the real digits data: 8 shards, a 20 % holdout, 4 ranks (rank
//! `r` gets shards `i mod 4 == r`), each rank its own model. Every rank must reach
//! holdout accuracy ≥ 0.90, consume every one of its records once per epoch, and end
//! with the digest the `digest` subcommand computes.

mod common;

use common::*;

#[test]
fn four_ranks_each_reach_90_percent_on_the_holdout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let split = split_digits(dir.path());
    let out = dir.path().join("out");
    let epochs = 20u32;
    let mut children = Vec::new();
    for rank in 0..4usize {
        let shards_file = rank_shards_file(dir.path(), &split.shards, rank, 4);
        // The shards file comes from the environment, as under Cumulus.
        let child = trainer()
            .args(["train", "--test-file"])
            .arg(&split.holdout)
            .arg("--out")
            .arg(&out)
            .args(["--epochs", &epochs.to_string(), "--log-every", "100"])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "4")
            .env("CUMULUS_ATTEMPT", "1")
            .env("CUMULUS_SHARDS_FILE", &shards_file)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn trainer");
        children.push((rank, shards_file, child));
    }
    let mut total_records = 0;
    for (rank, shards_file, child) in children {
        let o = child.wait_with_output().expect("wait trainer");
        let text = stdout(&o);
        assert!(o.status.success(), "rank {rank}: {}\n{text}", stderr(&o));
        let r = result_json(&out, rank as u32);
        let accuracy = r["accuracy"].as_f64().expect("accuracy is a number");
        assert!(accuracy >= 0.90, "rank {rank}: accuracy {accuracy}");
        assert_eq!(r["rank"], rank as u64);
        assert_eq!(r["attempt"], 1);
        assert_eq!(r["epochs"], epochs);
        assert_eq!(r["test_records"], 359);
        assert!(r["final_loss"].as_f64().is_some_and(|l| l > 0.0 && l < 0.5));
        // Ranks 0 and 1 hold 180 + 180 records, ranks 2 and 3 hold 180 + 179.
        let per_epoch = if rank < 2 { 360 } else { 359 };
        total_records += per_epoch;
        assert_eq!(r["records_consumed"], per_epoch * u64::from(epochs));
        assert_eq!(r["steps"], per_epoch.div_ceil(16) * u64::from(epochs));
        let digest = r["digest"].as_str().expect("digest is a string");
        assert_eq!(digest, digest_of(&shards_file, epochs, 1), "rank {rank}");
        assert!(
            text.contains(&format!(
                "RESULT rank={rank} accuracy={accuracy:.4} records={} digest={digest}",
                per_epoch * u64::from(epochs)
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("rank={rank} attempt=1 epoch=4 step=100/")),
            "{text}"
        );
        let weights = std::fs::metadata(out.join(format!("rank-{rank}/weights.bin")))
            .expect("weights.bin written");
        assert_eq!(weights.len(), 10 * 65 * 8);

        // `eval` reads the feature scale from result.json and agrees with the run.
        let e = run(trainer()
            .arg("eval")
            .arg("--weights")
            .arg(out.join(format!("rank-{rank}/weights.bin")))
            .arg("--test-file")
            .arg(&split.holdout));
        assert!(e.status.success(), "{}", stderr(&e));
        assert!(
            stdout(&e).contains(&format!("accuracy={accuracy:.4} records=359 classes=10")),
            "{}",
            stdout(&e)
        );
    }
    assert_eq!(total_records, 1797 - 359);
}

#[test]
fn the_seed_changes_the_order_and_the_digest_follows_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let split = split_digits(dir.path());
    let shards_file = rank_shards_file(dir.path(), &split.shards, 1, 4);
    let out = dir.path().join("out");
    let o = run(trainer()
        .args(["train", "--epochs", "2", "--seed", "99", "--shards-file"])
        .arg(&shards_file)
        .arg("--out")
        .arg(&out));
    assert!(o.status.success(), "{}", stderr(&o));
    let r = result_json(&out, 0);
    assert_eq!(r["accuracy"], serde_json::Value::Null);
    assert_eq!(
        r["digest"].as_str(),
        Some(digest_of(&shards_file, 2, 99).as_str())
    );
    assert_ne!(
        digest_of(&shards_file, 2, 99),
        digest_of(&shards_file, 2, 1)
    );
    assert!(stdout(&o).contains("accuracy=none"), "{}", stdout(&o));
}
