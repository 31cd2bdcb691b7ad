//! In-process restarts with a real process (no coordinator, no HTTP: the supervisor's
//! own entry points): a live attempt adopted for its rank's next attempt keeps its pid,
//! its old token is retired, and its output moves to the new attempt's log.

use std::time::{Duration, Instant};

use super::tests::{Options, desired, harness, log_text, poll_until};
use super::*;

#[tokio::test]
async fn a_listening_process_is_handed_the_next_attempt() {
    let h = harness(Options::default());
    let ckpt = h.root.join("ckpt");
    // Prints its attempt's log lines until killed.
    let script = "i=0; while true; do echo line $i; i=$((i+1)); sleep 0.05; done";
    let mut d0 = desired("job-000001", 0, 0, script);
    d0.ckpt_dir = ckpt.display().to_string();
    h.sup.apply_desired(std::slice::from_ref(&d0));
    let k0 = AttemptKey::of(&d0);
    poll_until("attempt 0 running", || h.sup.attempt_pid(&k0).is_some()).await;
    let pid = h.sup.attempt_pid(&k0).expect("pid");
    let old_token = h.sup.table().entries[&k0].token.clone();

    // Not listening yet: an in-process attempt is started the usual way (the old one
    // stopped first), so try it on a copy of the desired set only once it listens.
    let poll = h
        .sup
        .restart_poll(&old_token, Duration::from_millis(1))
        .await;
    assert!(matches!(poll, RestartPoll::Nothing), "{poll:?}");
    assert!(
        h.sup
            .observed()
            .iter()
            .any(|o| o.attempt == 0 && o.in_process)
    );

    let mut d1 = desired("job-000001", 0, 1, script);
    d1.ckpt_dir = d0.ckpt_dir.clone();
    d1.master_port = 29777;
    d1.in_process = true;
    d1.hold_ms = 300;
    let actions = h.sup.apply_desired(std::slice::from_ref(&d1));
    assert!(
        actions.is_empty(),
        "adopted, nothing started or stopped: {actions:?}"
    );
    let k1 = AttemptKey::of(&d1);
    assert_eq!(h.sup.attempt_pid(&k1), Some(pid));
    assert_eq!(h.sup.attempt_pid(&k0), None);
    // The abandoned attempt's token is refused everywhere but the restart poll.
    assert!(h.sup.attempt_for_token(&old_token).is_none());
    assert!(h.sup.control(&old_token).is_none());
    let start = Instant::now();
    let offer = match h
        .sup
        .restart_poll(&old_token, Duration::from_secs(20))
        .await
    {
        RestartPoll::Offer(offer) => offer,
        other => panic!("{other:?}"),
    };
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(offer.attempt, 1);
    assert_eq!(offer.hold_ms, 300);
    assert_eq!(offer.env["CUMULUS_ATTEMPT"], "1");
    assert_eq!(offer.env["MASTER_PORT"], "29777");
    let new_token = offer.env["CUMULUS_AGENT_TOKEN"].clone();
    assert_ne!(new_token, old_token);
    assert!(offer.env["CUMULUS_CKPT_STAGING"].ends_with("rank-0.attempt-1"));
    assert!(std::path::Path::new(&offer.env["CUMULUS_CKPT_STAGING"]).is_dir());
    assert_eq!(h.sup.attempt_for_token(&new_token), Some(k1.clone()));
    // The old attempt ended (its exit record says how); the process writes to the new log.
    poll_until("attempt 0's exit record", || h.sup.is_finished(&k0)).await;
    poll_until("output in attempt 1's log", || {
        log_text(&h.sup, &k1).contains("line")
    })
    .await;
    assert!(log_text(&h.sup, &k0).contains("continues as attempt 1"));
    // The acknowledgement reports the attempt started, with the same pid.
    assert_eq!(h.sup.restart_ack(&old_token), RestartAck::Unknown);
    assert_eq!(h.sup.restart_ack(&new_token), RestartAck::Done);
    let started: Vec<(u32, u32)> = h
        .sup
        .events()
        .pending()
        .into_iter()
        .filter_map(|e| match e {
            RankEvent::Started(r) => Some((r.attempt, r.pid)),
            RankEvent::Exited(_) => None,
        })
        .collect();
    assert_eq!(started, vec![(0, pid), (1, pid)]);

    // Its end is attempt 1's exit.
    h.sup.apply_desired(&[]);
    poll_until("attempt 1 finished", || {
        h.sup.is_finished(&k1) && h.sup.live_count() == 0
    })
    .await;
    let exits: Vec<u32> = h
        .sup
        .events()
        .pending()
        .into_iter()
        .filter_map(|e| match e {
            RankEvent::Exited(r) => Some(r.attempt),
            RankEvent::Started(_) => None,
        })
        .collect();
    assert_eq!(exits, vec![1]);
    assert!(matches!(
        h.sup
            .restart_poll(&old_token, Duration::from_millis(1))
            .await,
        RestartPoll::Unknown
    ));
}

#[tokio::test]
async fn a_stopped_process_is_neither_reported_listening_nor_adopted() {
    let h = harness(Options::default());
    let script = "while true; do sleep 0.05; done";
    let d0 = desired("job-000001", 0, 0, script);
    h.sup.apply_desired(std::slice::from_ref(&d0));
    let k0 = AttemptKey::of(&d0);
    poll_until("attempt 0 running", || h.sup.attempt_pid(&k0).is_some()).await;
    let pid = h.sup.attempt_pid(&k0).expect("pid");
    let token = h.sup.table().entries[&k0].token.clone();
    let poll = h.sup.restart_poll(&token, Duration::from_millis(1)).await;
    assert!(matches!(poll, RestartPoll::Nothing), "{poll:?}");
    let listening = |sup: &Supervisor| {
        sup.observed()
            .iter()
            .any(|o| o.attempt == 0 && o.in_process)
    };
    assert!(listening(&h.sup));

    // SIGSTOPped (a hung host, a debugger): it could neither leave its step nor
    // acknowledge, and its open sockets would hold its peers in their collectives.
    signal_group(pid, Signal::SIGSTOP).expect("SIGSTOP");
    poll_until("the process stopped", || inprocess::process_stopped(pid)).await;
    assert!(!listening(&h.sup));
    let mut d1 = desired("job-000001", 0, 1, script);
    d1.in_process = true;
    let k1 = AttemptKey::of(&d1);
    // Not adopted: attempt 0 is stopped as no longer desired (the SIGKILL after the
    // grace reaches a stopped process), and attempt 1 starts once it is gone.
    let actions = h.sup.apply_desired(std::slice::from_ref(&d1));
    assert_eq!(actions, vec![Action::Stop(k0.clone())]);
    assert_eq!(h.sup.attempt_pid(&k1), None);
    poll_until("attempt 0 gone", || {
        h.sup.is_finished(&k0) && h.sup.live_count() == 0
    })
    .await;
    let actions = h.sup.apply_desired(std::slice::from_ref(&d1));
    assert!(
        matches!(&actions[..], [Action::Start(d)] if d.attempt == 1),
        "{actions:?}"
    );
}
