//! In-process restarts: a live rank process handed a newer attempt of its rank instead of
//! being stopped and replaced (docs/architecture.md, "Restart paths").
//!
//! The leader marks a group restart's surviving attempts `DesiredRank.in_process`. When
//! such an attempt arrives and this agent runs an older attempt of the same rank whose
//! rank listens (its runtime holds `GET /v1/restart` open, `cumulus.runtime.run`), the
//! agent *adopts* the process for the new attempt ([`Supervisor::adopt_in_process_locked`]):
//! the table entry moves to the new key with a new token (the old one is retired: every
//! other endpoint answers it 401, so the abandoned attempt can neither commit a part nor
//! report progress), then, off the lock ([`Supervisor::finish_adoption`]), the new
//! attempt's staging directory and resume part are prepared as for a start, the process's
//! output goes to the new attempt's log, the old attempt gets its exit record and the pid
//! record moves. The rank then receives its [`RestartOffer`] (its new contract variables)
//! from the long poll, under its old token, and acknowledges with `POST /v1/restart` under
//! the new one: the agent reports the new attempt started (same pid). Without that
//! acknowledgement within [`RESTART_ACK_TIMEOUT_MS`] (or when preparing fails) the agent
//! kills the process; its exit fails the attempt and the leader restarts the job in full.
//! A stopped process (`SIGSTOP`) is never kept: see [`process_stopped`].

use std::collections::BTreeMap;

use cumulus_api::rank_env;
use cumulus_api::rank_local::{RESTART_ACK_TIMEOUT_MS, RestartOffer};

use super::*;

/// What an entry knows of in-process restarts.
#[derive(Debug, Default)]
pub(super) struct RestartState {
    /// The rank has asked for restarts (`GET /v1/restart`) during this process's life.
    pub listening: bool,
    /// The offer of the attempt this entry was adopted for, once prepared.
    pub offer: Option<Arc<RestartOffer>>,
    /// The rank acknowledged the offer (`POST /v1/restart` under the new token).
    pub acked: bool,
    /// Tokens of the earlier attempts of this process: honoured by `GET /v1/restart`
    /// only.
    pub retired_tokens: Vec<String>,
}

/// A log handed to a rank's output loop, with a marker line for the log it replaces and
/// a channel to say when the old one is finished.
pub(super) type LogSwitch = (LogWriter, String, tokio::sync::oneshot::Sender<()>);

/// What `GET /v1/restart` answers.
#[derive(Debug)]
pub enum RestartPoll {
    /// The token names no live attempt, current or retired.
    Unknown,
    /// No restart came within the wait.
    Nothing,
    /// The process was handed this attempt.
    Offer(Arc<RestartOffer>),
}

/// What `POST /v1/restart` answers.
#[derive(Debug, PartialEq, Eq)]
pub enum RestartAck {
    /// The token names no live attempt.
    Unknown,
    /// The attempt was not handed to a live process (nothing to acknowledge).
    NotOffered,
    /// Acknowledged (again).
    Done,
}

/// Whether process `pid` is stopped (`SIGSTOP`, a tracer): it cannot leave its step nor
/// acknowledge a restart, and its sockets stay open, holding its peers in their
/// collectives. Such a rank is neither reported listening nor adopted: the restart
/// replaces it, and stopping its old attempt (SIGKILL after the grace) closes its
/// connections, so its peers' collectives fail at once.
pub(super) fn process_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The command name (field 2) may contain spaces and ')': the state follows the
        // last ')'.
        stat.rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state == 'T' || state == 't')
    })
}

impl Supervisor {
    /// Adopts, for each desired in-process attempt not yet here, the live process of an
    /// older attempt of its rank whose rank listens for restarts; an attempt without one
    /// is started the usual way by the reconciliation that follows.
    pub(super) fn adopt_in_process_locked(&self, table: &mut Table, desired: &[DesiredRank]) {
        for d in desired.iter().filter(|d| d.in_process) {
            let new_key = AttemptKey::of(d);
            if table.entries.contains_key(&new_key) || table.finished.set.contains(&new_key) {
                continue;
            }
            let old_key = table
                .entries
                .iter()
                .find(|(k, e)| {
                    k.job_id == d.job_id
                        && k.rank == d.rank
                        && k.attempt < d.attempt
                        && !e.stopping
                        && e.control.is_none()
                        && e.pid.is_some_and(|pid| !process_stopped(pid))
                        && e.restart.listening
                        && e.log_switch.is_some()
                })
                .map(|(k, _)| k.clone());
            if let Some(old_key) = old_key {
                self.adopt_locked(table, old_key, d);
            }
        }
    }

    fn adopt_locked(&self, table: &mut Table, old_key: AttemptKey, d: &DesiredRank) {
        let Some(mut entry) = table.entries.remove(&old_key) else {
            return;
        };
        let new_key = AttemptKey::of(d);
        let old_token = std::mem::replace(&mut entry.token, random_token());
        table.tokens.remove(&old_token);
        entry.restart.retired_tokens.push(old_token);
        for t in &entry.restart.retired_tokens {
            table.retired.insert(t.clone(), new_key.clone());
        }
        table.tokens.insert(entry.token.clone(), new_key.clone());
        let old_ckpt = entry.ckpt.take();
        entry.progress = None;
        entry.exception = None;
        entry.restart.offer = None;
        entry.restart.acked = false;
        entry.commit_lock = Arc::new(tokio::sync::Mutex::new(None));
        let pid = entry.pid.unwrap_or(0);
        let log_switch = entry.log_switch.clone();
        let token = entry.token.clone();
        table.finished.insert(old_key.clone());
        table.entries.insert(new_key.clone(), entry);
        tracing::info!(attempt = %new_key, from = %old_key, pid, "in-process restart: the live process takes the new attempt");
        let this = self.clone();
        let d = Arc::new(d.clone());
        self.inner.tracker.spawn(async move {
            this.finish_adoption(old_key, new_key, d, token, (pid, old_ckpt, log_switch))
                .await;
        });
    }

    /// The off-lock part of an adoption: prepares the new attempt, switches the log,
    /// records the old attempt's end, offers the new attempt to the rank and arms the
    /// acknowledgement timer.
    async fn finish_adoption(
        self,
        old_key: AttemptKey,
        new_key: AttemptKey,
        d: Arc<DesiredRank>,
        token: String,
        (pid, old_ckpt, log_switch): (u32, Option<CkptTarget>, Option<mpsc::Sender<LogSwitch>>),
    ) {
        let settings = &self.inner.settings;
        let data_dir = settings.data_dir.clone();
        // The process's output goes to the new attempt's log from here on.
        if let (Ok(new_paths), Some(switch)) = (AttemptPaths::new(&data_dir, &new_key), log_switch)
        {
            match LogWriter::create(&new_paths.log, settings.log_max_bytes).await {
                Ok(log) => {
                    let marker = format!(
                        "[cumulus: this process continues as attempt {} (in-process restart)]\n",
                        new_key.attempt
                    );
                    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
                    if switch.send((log, marker, done_tx)).await.is_ok() {
                        let _ = done_rx.await;
                    }
                }
                Err(e) => tracing::warn!(attempt = %new_key, "cannot create log: {e}"),
            }
        }
        if let Ok(old_paths) = AttemptPaths::new(&data_dir, &old_key) {
            let exit = ExitRecord {
                exit_code: None,
                signal: None,
                spawn_error: None,
                agent_fault: false,
                agent_evidence: None,
                exec_failed: false,
                cause: Some(format!(
                    "continued in its process as attempt {} (in-process restart)",
                    new_key.attempt
                )),
            };
            if let Err(e) = logs::write_exit_record(&old_paths.exit, &exit).await {
                tracing::warn!(attempt = %old_key, "cannot write exit record: {e}");
            }
        }
        let record = PidRecord {
            job_id: new_key.job_id.clone(),
            rank: new_key.rank,
            attempt: new_key.attempt,
            pid: Some(pid),
            start_ticks: orphans::process_start_ticks(pid),
        };
        if let Err(e) = orphans::write(&data_dir, &record).await {
            tracing::warn!(attempt = %new_key, "cannot write pid record: {e}");
        }
        let _ = orphans::remove(&data_dir, &old_key).await;
        if let Some(old) = old_ckpt {
            let _ = tokio::fs::remove_dir_all(&old.staging).await;
        }
        let prepared = self.prepare_in_place(&new_key, &d, &token).await;
        let offer = match prepared {
            Ok((env, ckpt)) => {
                let offer = Arc::new(RestartOffer {
                    attempt: new_key.attempt,
                    env,
                    hold_ms: d.hold_ms,
                    ack_timeout_ms: RESTART_ACK_TIMEOUT_MS,
                });
                let mut table = self.table();
                let Some(entry) = table.entries.get_mut(&new_key) else {
                    return; // ended meanwhile
                };
                entry.ckpt = ckpt;
                entry.restart.offer = Some(offer.clone());
                offer
            }
            Err(e) => {
                self.fail_in_process(&new_key, &format!("in-process restart failed: {e}"));
                return;
            }
        };
        self.inner.restart_notify.notify_waiters();
        tracing::info!(attempt = %new_key, hold_ms = offer.hold_ms, "in-process restart offered to the rank");
        let this = self.clone();
        self.inner.tracker.spawn(async move {
            tokio::time::sleep(Duration::from_millis(
                RESTART_ACK_TIMEOUT_MS + offer.hold_ms,
            ))
            .await;
            let acked = this
                .table()
                .entries
                .get(&new_key)
                .is_none_or(|e| e.restart.acked);
            if !acked {
                this.fail_in_process(
                    &new_key,
                    &format!(
                        "in-process restart: the rank did not leave its step and tear down its \
                         process group within {} ms",
                        RESTART_ACK_TIMEOUT_MS
                    ),
                );
            }
        });
    }

    /// Ends the process of `key` for a failed in-process restart: `why` becomes the
    /// cause of its exit, which fails the attempt (the leader then restarts in full).
    fn fail_in_process(&self, key: &AttemptKey, why: &str) {
        let pid = {
            let mut table = self.table();
            let Some(entry) = table.entries.get_mut(key) else {
                return;
            };
            entry.exception = Some(why.to_string());
            entry.pid
        };
        tracing::warn!(attempt = %key, "{why}: killing the process");
        if let Some(pid) = pid
            && let Err(e) = signal_group(pid, Signal::SIGKILL)
        {
            tracing::warn!(attempt = %key, pid, "SIGKILL failed: {e}");
        }
        self.inner.restart_notify.notify_waiters();
    }

    /// The new attempt's contract variables for a live process, and its checkpoint
    /// target: its staging directory and resume part prepared as [`Supervisor::prepare`]
    /// does (the shards file, working and output directories stay the process's own).
    async fn prepare_in_place(
        &self,
        key: &AttemptKey,
        d: &DesiredRank,
        token: &str,
    ) -> Result<(BTreeMap<String, String>, Option<CkptTarget>), PrepareError> {
        let settings = &self.inner.settings;
        let creds = settings.identity.run_as.creds(
            &key.job_id,
            (!d.resume_job_id.is_empty()).then_some(d.resume_job_id.as_str()),
        );
        let master_addr = if d.master_addr.is_empty() {
            settings.advertise_host.clone()
        } else {
            d.master_addr.clone()
        };
        let mut env: BTreeMap<String, String> = [
            (rank_env::RANK, d.rank.to_string()),
            (rank_env::WORLD_SIZE, d.world_size.to_string()),
            (rank_env::LOCAL_RANK, d.local_rank.to_string()),
            (rank_env::LOCAL_WORLD_SIZE, d.local_world_size.to_string()),
            (rank_env::MASTER_ADDR, master_addr),
            (rank_env::MASTER_PORT, d.master_port.to_string()),
            (rank_env::JOB_ID, d.job_id.clone()),
            (rank_env::ATTEMPT, d.attempt.to_string()),
            (rank_env::AGENT_TOKEN, token.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mut ckpt = None;
        if !d.ckpt_dir.is_empty() || !d.ckpt_url.is_empty() {
            let store = self.job_store(d, creds.as_ref()).await?;
            let staging = store
                .prepare_staging(&key.job_id, key.rank, key.attempt)
                .await
                .map_err(|source| PrepareError::Checkpoint {
                    what: "cannot prepare checkpoint staging",
                    source,
                })?;
            env.insert(rank_env::CKPT_STAGING.into(), path_text(&staging)?);
            if let Some(step) = d.resume_step {
                let from_job = if d.resume_job_id.is_empty() {
                    key.job_id.as_str()
                } else {
                    d.resume_job_id.as_str()
                };
                let dir = verify_resume(&*store, from_job, key.rank, step, &d.resume_dir).await?;
                env.insert(rank_env::RESUME_STEP.into(), step.to_string());
                env.insert(rank_env::RESUME_DIR.into(), path_text(&dir)?);
            }
            ckpt = Some(CkptTarget { store, staging });
        } else if d.resume_step.is_some() {
            return Err(PrepareError::Invalid(
                "resume_step is set but the job has no checkpoint target".into(),
            ));
        }
        Ok((env, ckpt))
    }

    /// `GET /v1/restart`: waits up to `wait` for the process holding `token` (its
    /// current one, or one an in-process restart retired) to be handed a newer attempt,
    /// and returns its offer. A current token marks the rank as listening.
    pub async fn restart_poll(&self, token: &str, wait: Duration) -> RestartPoll {
        let deadline = Instant::now() + wait;
        loop {
            let notified = self.inner.restart_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut table = self.table();
                let (key, current) = match table.tokens.get(token) {
                    Some(k) => (k.clone(), true),
                    None => match table.retired.get(token) {
                        Some(k) => (k.clone(), false),
                        None => return RestartPoll::Unknown,
                    },
                };
                let Some(entry) = table.entries.get_mut(&key) else {
                    return RestartPoll::Unknown;
                };
                if current {
                    entry.restart.listening = true;
                } else if let Some(offer) = &entry.restart.offer {
                    return RestartPoll::Offer(offer.clone());
                }
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(deadline) => return RestartPoll::Nothing,
            }
        }
    }

    /// `POST /v1/restart`: the rank holding `token` took its offer (left its step, tore
    /// its process group down): the new attempt is reported started, with the process's
    /// pid.
    pub fn restart_ack(&self, token: &str) -> RestartAck {
        let (key, pid) = {
            let mut table = self.table();
            let Some(key) = table.tokens.get(token).cloned() else {
                return RestartAck::Unknown;
            };
            let Some(entry) = table.entries.get_mut(&key) else {
                return RestartAck::Unknown;
            };
            if entry.restart.offer.is_none() {
                return RestartAck::NotOffered;
            }
            if entry.restart.acked {
                return RestartAck::Done;
            }
            entry.restart.acked = true;
            (key, entry.pid.unwrap_or(0))
        };
        tracing::info!(attempt = %key, pid, "in-process restart taken by the rank");
        self.inner
            .events
            .push(RankEvent::Started(RankStartedRequest {
                worker_id: self.inner.settings.worker_id.clone(),
                job_id: key.job_id.clone(),
                rank: key.rank,
                attempt: key.attempt,
                pid,
            }));
        RestartAck::Done
    }

    /// The attempt a token retired by an in-process restart now belongs to.
    pub fn attempt_for_retired_token(&self, token: &str) -> Option<AttemptKey> {
        self.table().retired.get(token).cloned()
    }
}

fn path_text(path: &Path) -> Result<String, PrepareError> {
    path.to_str()
        .map(str::to_owned)
        .ok_or_else(|| PrepareError::Invalid(format!("path {} is not UTF-8", path.display())))
}
