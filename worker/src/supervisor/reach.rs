//! Whether a rank that could not reach this agent did so for the agent's reasons (issue
//! 39 item 1).
//!
//! A rank that gets no answer from the rank-local API after its retries exits with
//! [`EXIT_AGENT_UNREACHABLE`]. The agent believes it only with evidence of its own: one
//! of its rank API listeners turned connections away (every slot busy with requests in
//! flight, its pending pool or the source's share full, or `accept` failing) during the
//! attempt, or is not serving when the rank exits. Then the exit is reported as the
//! agent's fault (`agent_fault`, with the evidence), and its restart spends none of the
//! job's budget (at most `MAX_AGENT_FAULT_RESTARTS` of them); otherwise the exit is the
//! rank's own failure, so a job cannot skip its budget by exiting with that code.
//!
//! The evidence is per listener, not per rank: every rank of this agent reaches it from
//! loopback (or, on the Unix socket, often as one uid), so a connection turned away
//! during the attempt is the best the agent can know of this rank's. Reading it costs two
//! atomic loads per listener.

use cumulus_api::rank_env::EXIT_AGENT_UNREACHABLE;
use cumulus_listen::{Counter, TurnedAway};

use crate::logs::ExitRecord;

/// The agent's rank API listeners, as the supervisor watches them (none: no evidence is
/// ever found, and every [`EXIT_AGENT_UNREACHABLE`] is the rank's failure).
#[derive(Clone, Default)]
pub struct RankApiWatch {
    listeners: Vec<(&'static str, Counter)>,
}

impl std::fmt::Debug for RankApiWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.listeners.iter().map(|(name, _)| name))
            .finish()
    }
}

/// One reading of every watched listener, taken when an attempt starts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reading(Vec<TurnedAway>);

/// What one listener did during an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    /// The listener's name ("rank API", "rank API socket").
    pub name: &'static str,
    /// What it turned away during the attempt.
    pub turned_away: TurnedAway,
    /// Whether it serves now.
    pub serving: bool,
}

impl RankApiWatch {
    /// Watches `listeners`, each with its name for the evidence's text.
    pub fn new(listeners: Vec<(&'static str, Counter)>) -> RankApiWatch {
        RankApiWatch { listeners }
    }

    /// What the listeners turned away so far.
    pub fn reading(&self) -> Reading {
        Reading(
            self.listeners
                .iter()
                .map(|(_, c)| c.turned_away())
                .collect(),
        )
    }

    /// What each listener did since `start`.
    pub fn since(&self, start: &Reading) -> Vec<Seen> {
        self.listeners
            .iter()
            .enumerate()
            .map(|(i, (name, c))| Seen {
                name,
                turned_away: c
                    .turned_away()
                    .since(start.0.get(i).copied().unwrap_or_default()),
                serving: c.serving(),
            })
            .collect()
    }
}

/// The agent's evidence that it could not be reached, from what its listeners did during
/// the attempt; `None` when they turned nothing away and all serve.
pub fn evidence(seen: &[Seen]) -> Option<String> {
    let mut parts = Vec::new();
    for s in seen {
        let TurnedAway {
            refused,
            accept_errors,
        } = s.turned_away;
        if refused > 0 {
            parts.push(format!(
                "{refused} connection{} turned away at capacity during the attempt ({})",
                if refused == 1 { "" } else { "s" },
                s.name
            ));
        }
        if accept_errors > 0 {
            parts.push(format!(
                "{accept_errors} failed accept{} during the attempt ({})",
                if accept_errors == 1 { "" } else { "s" },
                s.name
            ));
        }
        if !s.serving {
            parts.push(format!("the {} is not serving", s.name));
        }
    }
    (!parts.is_empty()).then(|| {
        format!(
            "could not reach this agent's rank API: {}",
            parts.join("; ")
        )
    })
}

/// `exit` with the agent's verdict on an [`EXIT_AGENT_UNREACHABLE`] exit: its fault, with
/// the evidence, when [`evidence`] finds some in `seen`; unchanged otherwise (and for
/// every other exit).
pub fn judge(mut exit: ExitRecord, seen: &[Seen]) -> ExitRecord {
    if exit.exit_code != Some(EXIT_AGENT_UNREACHABLE) || exit.spawn_error.is_some() {
        return exit;
    }
    if let Some(why) = evidence(seen) {
        exit.agent_fault = true;
        exit.agent_evidence = Some(why);
    }
    exit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(code: i32) -> ExitRecord {
        ExitRecord {
            exit_code: Some(code),
            signal: None,
            spawn_error: None,
            agent_fault: false,
            agent_evidence: None,
            exec_failed: false,
            cause: None,
        }
    }

    fn seen(refused: u64, accept_errors: u64, serving: bool) -> Seen {
        Seen {
            name: "rank API",
            turned_away: TurnedAway {
                refused,
                accept_errors,
            },
            serving,
        }
    }

    #[test]
    fn an_unreachable_exit_is_the_agents_fault_only_with_its_evidence() {
        let code = EXIT_AGENT_UNREACHABLE;
        // No evidence: the rank's own failure, whatever it claims.
        assert_eq!(judge(exited(code), &[seen(0, 0, true)]), exited(code));
        assert_eq!(judge(exited(code), &[]), exited(code));
        // Connections turned away at capacity.
        let judged = judge(exited(code), &[seen(0, 0, true), seen(12, 0, true)]);
        assert!(judged.agent_fault);
        assert_eq!(
            judged.agent_evidence.as_deref(),
            Some(
                "could not reach this agent's rank API: 12 connections turned away at \
                 capacity during the attempt (rank API)"
            )
        );
        // Failed accepts, or a listener that no longer serves.
        let judged = judge(exited(code), &[seen(0, 1, true)]);
        assert!(judged.agent_fault);
        assert!(
            judged
                .agent_evidence
                .as_deref()
                .is_some_and(|e| e.contains("1 failed accept during")),
            "{judged:?}"
        );
        let judged = judge(exited(code), &[seen(0, 0, false)]);
        assert!(
            judged.agent_fault
                && judged
                    .agent_evidence
                    .as_deref()
                    .is_some_and(|e| e.contains("rank API is not serving")),
            "{judged:?}"
        );
    }

    #[test]
    fn other_exits_are_never_judged() {
        let busy = [seen(5, 5, false)];
        for exit in [
            exited(0),
            exited(1),
            exited(4),
            ExitRecord {
                exit_code: None,
                signal: Some(9),
                ..exited(0)
            },
            ExitRecord::spawn_failed("cannot start"),
        ] {
            assert_eq!(judge(exit.clone(), &busy), exit);
        }
    }

    #[tokio::test]
    async fn the_watch_sees_whether_a_listener_serves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let listener = tokio::net::UnixListener::bind(dir.path().join("api.sock")).expect("bind");
        let counter = Counter::unix(cumulus_listen::Limits::connections(16));
        let watch = RankApiWatch::new(vec![("rank API socket", counter.clone())]);
        let start = watch.reading();
        // Not serving yet: evidence by itself.
        assert_eq!(
            watch.since(&start),
            vec![seen_of("rank API socket", 0, false)]
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(cumulus_listen::serve_unix_http_counted(
            listener,
            "rank API socket",
            counter.clone(),
            axum::Router::new(),
            stop.clone(),
        ));
        while !counter.serving() {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            watch.since(&start),
            vec![seen_of("rank API socket", 0, true)]
        );
        assert_eq!(evidence(&watch.since(&start)), None);
        stop.cancel();
        server.await.expect("join").expect("serve");
        assert_eq!(
            watch.since(&start),
            vec![seen_of("rank API socket", 0, false)]
        );
        assert_eq!(RankApiWatch::default().since(&start), Vec::new());
    }

    fn seen_of(name: &'static str, refused: u64, serving: bool) -> Seen {
        Seen {
            name,
            turned_away: TurnedAway {
                refused,
                accept_errors: 0,
            },
            serving,
        }
    }
}
