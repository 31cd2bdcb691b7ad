//! The nemesis suite's short CI schedule: one seeded run of the random workload under
//! random faults, then every history check. The seed is printed; set
//! `CUMULUS_NEMESIS_SEED` to reproduce a run (the default seed is fixed so CI is
//! reproducible; the long schedule, `cumulus-nemesis --runs N --minutes M`, draws seeds).

use cumulus_e2e::nemesis::{RunOpts, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_nemesis_schedule_keeps_every_invariant() {
    let seed = std::env::var("CUMULUS_NEMESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_121);
    let fault_ms = std::env::var("CUMULUS_NEMESIS_FAULT_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40_000);
    // A bound on the whole run: a harness stuck on an unforeseen state fails here, with
    // the seed, rather than holding the test suite (dropping the run stops its cluster).
    let report = tokio::time::timeout(
        std::time::Duration::from_secs(20 * 60),
        run(&RunOpts {
            seed,
            fault_ms,
            clients: 3,
            epochs: 2,
            hang_first: true,
            only: None,
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("seed {seed}: the nemesis run did not end within 20 minutes"))
    .expect("the nemesis run completes");
    eprintln!(
        "nemesis report: {}",
        serde_json::to_string(&report).expect("json")
    );
    assert!(report.acked_submits > 0, "{report:?}");
    assert!(report.reads > 0, "{report:?}");
    assert_eq!(
        report.hang_detect_ms.len() as u64,
        report.faults.get("hang-rank").copied().unwrap_or(0),
        "{report:?}"
    );
    assert!(
        !report.hang_detect_ms.is_empty(),
        "the hang-rank fault ran: {report:?}"
    );
    assert!(report.proc_samples > 0, "{report:?}");
    assert!(report.rank_processes_seen > 0, "{report:?}");
    assert!(
        report.anomalies.is_empty(),
        "seed {seed}: {} anomalies: {:#?}",
        report.anomalies.len(),
        report.anomalies
    );
}
