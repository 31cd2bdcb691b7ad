//! Tests of the trainer: training, checkpoints, resume, progress and evaluation.

use super::rank::commit_checkpoint;
use super::*;
use crate::agent::AgentClient;
use crate::digest::expected_digest;

/// A small separable data set: 3 classes around 3 centres, 2 features.
fn toy(dir: &Path) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for s in 0..2 {
        let mut text = String::new();
        for i in 0..23 {
            let k = (i + s) % 3;
            let (cx, cy) = [(0.0, 8.0), (8.0, 0.0), (8.0, 8.0)][k];
            let jitter = ((i * 7 + s * 3) % 5) as f64 * 0.3;
            text.push_str(&format!("{},{},{k}\n", cx + jitter, cy - jitter));
        }
        let p = dir.join(format!("s{s}.csv"));
        std::fs::write(&p, text).unwrap();
        paths.push(p);
    }
    paths
}

/// Two classes told apart by a column of small values (0.0 or 1.0, plus jitter) next
/// to a column of large noise (up to 1,000): one global scale squashes the column that
/// matters, per-column standardization does not.
fn mixed_scales(dir: &Path) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for s in 0..2 {
        let mut text = String::new();
        for i in 0..60u64 {
            let k = (i + s) % 2;
            let jitter = ((i * 7 + s * 3) % 5) as f64 * 0.05;
            let noise = ((i * 7919 + s * 104_729) % 1000) as f64;
            text.push_str(&format!("{},{noise},{k}\n", k as f64 + jitter));
        }
        let p = dir.join(format!("m{s}.csv"));
        std::fs::write(&p, text).unwrap();
        paths.push(p);
    }
    paths
}

fn trained_accuracy(data: &TrainData) -> f64 {
    let mut t = Trainer::new(
        data,
        Hyper {
            epochs: 20,
            ..hyper()
        },
    )
    .unwrap();
    while t.train_step().is_some() {}
    t.model().accuracy(&data.x, &data.dataset.labels)
}

#[test]
fn per_column_standardization_learns_what_one_global_scale_squashes() {
    let dir = tempfile::tempdir().unwrap();
    let paths = mixed_scales(dir.path());
    let d = data::load_shards(&paths).unwrap();
    let scaled = TrainData::prepare(d.clone(), None, FeatureScale::Auto, None).unwrap();
    let (stats, from) = load_feature_stats(None, &paths, &d).unwrap();
    assert!(from.contains("other ranks may differ"), "{from}");
    let standardized = TrainData::prepare(d, None, FeatureScale::Standardize, Some(stats)).unwrap();
    let (a, b) = (trained_accuracy(&scaled), trained_accuracy(&standardized));
    assert!(b >= 0.95, "standardized: {b}");
    assert!(a < b - 0.2, "one global scale {a}, standardized {b}");
    assert_ne!(
        normalization_fingerprint(scaled.stats.as_ref()),
        normalization_fingerprint(standardized.stats.as_ref())
    );
}

#[test]
fn every_rank_reads_the_same_statistics_from_beside_the_shards() {
    let dir = tempfile::tempdir().unwrap();
    let paths = mixed_scales(dir.path());
    let all = data::load_shards(&paths).unwrap();
    let mut acc = StatsAccumulator::default();
    for row in all.values.chunks(all.features) {
        acc.add(row);
    }
    let whole = acc.finish().unwrap();
    std::fs::write(
        dir.path().join(FEATURE_STATS_FILE),
        serde_json::to_vec(&whole).unwrap(),
    )
    .unwrap();
    for rank in 0..2 {
        let own = data::load_shards(&paths[rank..=rank]).unwrap();
        let (stats, from) = load_feature_stats(None, &paths[rank..=rank], &own).unwrap();
        assert_eq!(stats, whole, "rank {rank}");
        assert!(from.ends_with(FEATURE_STATS_FILE), "{from}");
    }
    // A file for other columns is refused, naming it.
    let other = dir.path().join("other.json");
    let mut wrong = whole.clone();
    wrong.mean.push(0.0);
    wrong.std.push(1.0);
    std::fs::write(&other, serde_json::to_vec(&wrong).unwrap()).unwrap();
    let e = load_feature_stats(Some(&other), &paths, &all).unwrap_err();
    assert!(e.to_string().contains("other.json"), "{e}");
}

fn hyper() -> Hyper {
    Hyper {
        epochs: 4,
        batch_size: 5,
        lr: 0.2,
        momentum: 0.9,
        seed: 11,
    }
}

fn bits(m: &SoftmaxModel) -> Vec<u64> {
    m.weights().iter().map(|w| w.to_bits()).collect()
}

/// A commit whose every try gets no answer (nothing listens) exits with the rank
/// contract's code for an unreachable agent; an answer that is an error does not.
#[test]
fn a_commit_the_agent_never_answers_exits_as_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let d = data::load_shards(&toy(dir.path())).unwrap();
    let data = TrainData::prepare(d, None, FeatureScale::Auto, None).unwrap();
    let t = Trainer::new(&data, hyper()).unwrap();
    let staging = dir.path().join("staging");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let agent = AgentClient::new(&format!("http://127.0.0.1:{port}"), "t", None).unwrap();
    let err = commit_checkpoint(&t, &staging, &agent, &mut Vec::new()).unwrap_err();
    assert!(matches!(err, TrainError::AgentUnreachable(_)), "{err}");
    assert_eq!(err.exit_code(), EXIT_AGENT_UNREACHABLE);
    assert_eq!(EXIT_AGENT_UNREACHABLE, 75);
    // A server that answers 500 every time: the rank's commit failed, not the agent's reach.
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().unwrap();
    std::thread::spawn(move || {
        use std::io::{BufRead, BufReader, Read as _};
        for conn in server.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let _ = conn.write_all(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
            );
        }
    });
    let agent = AgentClient::new(&format!("http://{addr}"), "t", None).unwrap();
    let err = commit_checkpoint(&t, &staging, &agent, &mut Vec::new()).unwrap_err();
    assert_eq!(err.exit_code(), EXIT_COMMIT_FAILED, "{err}");
}

#[test]
fn learns_the_toy_set_and_digest_matches_a_straight_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = data::load_shards(&toy(dir.path())).unwrap();
    let data = TrainData::prepare(d, None, FeatureScale::Auto, None).unwrap();
    assert_eq!(data.classes, 3);
    // The largest value is 8 + 4 × 0.3.
    assert!(
        (data.feature_scale - 1.0 / 9.2).abs() < 1e-12,
        "{}",
        data.feature_scale
    );
    let mut t = Trainer::new(&data, hyper()).unwrap();
    let mut steps = 0;
    while t.train_step().is_some() {
        steps += 1;
    }
    assert_eq!(
        steps,
        4 * 10,
        "46 records in batches of 5: 10 steps per epoch"
    );
    assert_eq!(t.total_steps(), 40);
    assert_eq!(t.records_consumed(), 4 * 46);
    assert_eq!(t.model().accuracy(&data.x, &data.dataset.labels), 1.0);
    assert_eq!(t.digest(), expected_digest(&data.dataset, 4, 11));
    assert_ne!(t.digest(), expected_digest(&data.dataset, 4, 12));
}

#[test]
fn resume_from_every_checkpoint_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let d = data::load_shards(&toy(dir.path())).unwrap();
    let data = TrainData::prepare(d, None, FeatureScale::Auto, None).unwrap();
    let mut straight = Trainer::new(&data, hyper()).unwrap();
    while straight.train_step().is_some() {}
    // Checkpoint at a mid-epoch step, at an epoch boundary and at the very end.
    for stop in [7u64, 10, 23, 40] {
        let mut first = Trainer::new(&data, hyper()).unwrap();
        while first.step() < stop {
            first.train_step().unwrap();
        }
        let ckpt = dir.path().join(format!("ckpt-{stop}"));
        std::fs::create_dir(&ckpt).unwrap();
        first.write_checkpoint(&ckpt).unwrap();
        let mut resumed = Trainer::resume(&data, hyper(), &ckpt, stop).unwrap();
        assert_eq!(resumed.state(), first.state());
        while resumed.train_step().is_some() {}
        assert_eq!(bits(resumed.model()), bits(straight.model()), "stop {stop}");
        assert_eq!(resumed.digest(), straight.digest());
        assert_eq!(resumed.last_epoch_loss(), straight.last_epoch_loss());
    }
}

#[test]
fn resume_validation_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = data::load_shards(&toy(dir.path())).unwrap();
    let data = TrainData::prepare(d, None, FeatureScale::Auto, None).unwrap();
    let mut t = Trainer::new(&data, hyper()).unwrap();
    for _ in 0..7 {
        t.train_step();
    }
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    t.write_checkpoint(&ckpt).unwrap();
    let code = |r: Result<Trainer<'_>, TrainError>| r.map(|_| ()).unwrap_err().exit_code();

    assert_eq!(code(Trainer::resume(&data, hyper(), &ckpt, 8)), EXIT_RESUME);
    let mut other = hyper();
    other.batch_size = 6;
    assert_eq!(code(Trainer::resume(&data, other, &ckpt, 7)), EXIT_RESUME);

    let good_weights = std::fs::read(ckpt.join(WEIGHTS_FILE)).unwrap();
    std::fs::write(
        ckpt.join(WEIGHTS_FILE),
        &good_weights[..good_weights.len() - 8],
    )
    .unwrap();
    let err = Trainer::resume(&data, hyper(), &ckpt, 7)
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("weights.bin"), "{err}");
    assert_eq!(err.exit_code(), EXIT_RESUME);
    std::fs::write(ckpt.join(WEIGHTS_FILE), &good_weights).unwrap();

    // A state whose next record disagrees with the order is refused.
    let mut state: TrainState =
        serde_json::from_slice(&std::fs::read(ckpt.join(STATE_FILE)).unwrap()).unwrap();
    state.next_record_index = Some(state.next_record_index.unwrap() + 1000);
    std::fs::write(ckpt.join(STATE_FILE), serde_json::to_vec(&state).unwrap()).unwrap();
    let err = Trainer::resume(&data, hyper(), &ckpt, 7)
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(err, TrainError::Resume(ResumeError::NextRecord { .. })),
        "{err}"
    );

    std::fs::write(ckpt.join(STATE_FILE), b"{not json").unwrap();
    let err = Trainer::resume(&data, hyper(), &ckpt, 7)
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(err, TrainError::Resume(ResumeError::Json { .. })),
        "{err}"
    );

    std::fs::remove_file(ckpt.join(OPTIMIZER_FILE)).unwrap();
    assert_eq!(code(Trainer::resume(&data, hyper(), &ckpt, 7)), EXIT_RESUME);
}

#[test]
fn classes_and_scale_options() {
    let dir = tempfile::tempdir().unwrap();
    let d = data::load_shards(&toy(dir.path())).unwrap();
    assert!(TrainData::prepare(d.clone(), Some(2), FeatureScale::Auto, None).is_err());
    let p = TrainData::prepare(d.clone(), Some(5), FeatureScale::Fixed(0.5), None).unwrap();
    assert_eq!(p.classes, 5);
    assert_eq!(p.x[0], d.values[0] * 0.5);
    assert_eq!("auto".parse::<FeatureScale>(), Ok(FeatureScale::Auto));
    assert_eq!(
        "0.0625".parse::<FeatureScale>(),
        Ok(FeatureScale::Fixed(0.0625))
    );
    assert!("0".parse::<FeatureScale>().is_err());
    assert!("-1".parse::<FeatureScale>().is_err());
    let one = dir.path().join("one.csv");
    std::fs::write(&one, "1,2,0\n").unwrap();
    let single = data::load_csv(&one).unwrap();
    assert!(TrainData::prepare(single, None, FeatureScale::Auto, None).is_err());
}

#[test]
fn hyper_validation() {
    let mut h = hyper();
    assert!(h.validate().is_ok());
    h.momentum = 1.0;
    assert!(h.validate().is_err());
    let mut h = hyper();
    h.lr = f64::NAN;
    assert!(h.validate().is_err());
    let mut h = hyper();
    h.batch_size = 0;
    assert!(h.validate().is_err());
    let mut h = hyper();
    h.epochs = 0;
    assert!(h.validate().is_err());
}
