//! Group commit of the leader's writes: every proposal (client submits and cancels, worker
//! reports, the control loop's plans) queues here, and one task turns what queued while
//! the previous batches were committing into one Raft entry ([`Command::Batch`]).
//!
//! Why: one entry per write costs an entry's encoding, log record and replication per
//! write; under openraft 0.9, whose core awaited each append's flush before the next
//! request, it bounded the write rate by the flush latency whatever the number of
//! clients (docs/perf-notes.md, "Group commit"). etcd batches proposals the same way
//! (one Raft `Ready` carries every proposal queued since the last one).
//!
//! The batcher never waits for more proposals to arrive: a lone proposal is committed at
//! once as the plain command (the same entry as without the batcher), so a single client
//! pays no extra latency. Batches form only while [`MAX_INFLIGHT_BATCHES`] are already
//! committing. Limits: [`MAX_QUEUED_PROPOSALS`] waiting (then `propose` waits),
//! [`MAX_BATCH_COMMANDS`] commands and [`MAX_BATCH_BYTES`] (estimated) per batch.

use std::sync::Arc;

use cumulus_raft_store::stage;
use cumulus_raft_store::state::{Command, MAX_BATCH_COMMANDS, Response};
use openraft::error::{ClientWriteError, RaftError};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use cumulus_raft_store::Raft;

use crate::error::{ApiError, leader_node};

/// Proposals waiting for a batch, at most; past it [`Proposer::propose`] waits.
pub const MAX_QUEUED_PROPOSALS: usize = 4_096;
/// Batches being committed at once. While this many are in flight, new proposals queue
/// and then go out together. 1 measured best on the write-path benchmark with openraft
/// 0.9 (1, 2 and 8 tried; docs/perf-notes.md, "Group commit"), whose core flushed each
/// entry on its own, so a second entry in flight only split what would have been one
/// larger batch.
pub const MAX_INFLIGHT_BATCHES: usize = 1;
/// Largest estimated encoded size of one batch, in bytes
/// ([`Command::approx_encoded_bytes`]); a proposal larger than this goes alone.
pub const MAX_BATCH_BYTES: usize = 1 << 20;
/// Largest encoded (serde_json) size of one proposed command, in bytes; a larger one is
/// refused before it reaches the log. Every entry must fit one replication request
/// ([`crate::network::MAX_APPEND_ENCODED_BYTES`], 64 MiB) on its own: an entry that does not
/// can never reach a follower, and the log behind it stops. etcd's default limit for a
/// request is 1.5 MiB; ours is set by the largest submit (a spec of up to
/// [`cumulus_raft_store::state::MAX_SHARDS`] shard paths).
pub const MAX_ENTRY_BYTES: usize = 16 << 20;
/// How many times its [`Command::approx_encoded_bytes`] a command's JSON can be at most:
/// a string's byte becomes at most 6 (`\u001f`), and the estimate counts each string's
/// quotes. Commands whose estimate is below [`MAX_ENTRY_BYTES`] / this are admitted
/// without encoding them.
const MAX_JSON_EXPANSION: usize = 8;

/// Counts the bytes written to it.
struct ByteCounter(usize);

impl std::io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Checks that `command` fits one Raft entry ([`MAX_ENTRY_BYTES`]). Only a command whose
/// estimate could exceed it is encoded (into a byte counter, nothing is kept).
///
/// # Errors
/// [`ApiError::InvalidArgument`] with the encoded size, the limit and, for a submit, its
/// number of shards.
pub fn check_entry_bytes(command: &Command) -> Result<(), ApiError> {
    if command.approx_encoded_bytes() <= MAX_ENTRY_BYTES / MAX_JSON_EXPANSION {
        return Ok(());
    }
    let mut counter = ByteCounter(0);
    serde_json::to_writer(&mut counter, command)
        .map_err(|e| ApiError::Internal(format!("cannot encode a command: {e}")))?;
    let bytes = counter.0;
    if bytes <= MAX_ENTRY_BYTES {
        return Ok(());
    }
    Err(ApiError::InvalidArgument(match command {
        Command::SubmitJob { shards, .. } => format!(
            "the job's spec and its {} shard paths encode to {bytes} bytes, more than the \
             {MAX_ENTRY_BYTES} bytes one Raft entry may carry: use fewer shard files or \
             shorter paths",
            shards.len()
        ),
        _ => format!(
            "the command encodes to {bytes} bytes, more than the {MAX_ENTRY_BYTES} bytes \
             one Raft entry may carry"
        ),
    }))
}

/// One queued write and where its result goes.
struct Proposal {
    /// The command to commit.
    command: Command,
    /// Receives the command's own response (never a [`Response::Batch`]).
    reply: oneshot::Sender<Result<Response, ApiError>>,
}

/// The handle writers use; cheap to clone. The batching task ends when `shutdown` is
/// cancelled or every handle is dropped.
#[derive(Clone)]
pub struct Proposer {
    /// The queue of the batching task.
    queue: mpsc::Sender<Proposal>,
    /// Slots for batches being committed ([`MAX_INFLIGHT_BATCHES`]), shared with the
    /// batching task.
    inflight: Arc<Semaphore>,
    /// The Raft handle (for the direct path).
    raft: Raft,
}

impl Proposer {
    /// Starts the batching task for `raft` on the current tokio runtime.
    pub fn start(raft: Raft, shutdown: CancellationToken) -> Proposer {
        let (queue, rx) = mpsc::channel(MAX_QUEUED_PROPOSALS);
        let inflight = Arc::new(Semaphore::new(MAX_INFLIGHT_BATCHES));
        tokio::spawn(batch_loop(raft.clone(), rx, inflight.clone(), shutdown));
        Proposer {
            queue,
            inflight,
            raft,
        }
    }

    /// Commits `command` through Raft (alone or in a batch) and returns its response,
    /// which may be `Rejected`.
    ///
    /// # Errors
    /// `InvalidArgument` for a command larger than [`MAX_ENTRY_BYTES`]; `NotLeader` on a
    /// follower; `Unavailable` when Raft cannot commit now or the node is shutting down.
    pub async fn propose(&self, command: Command) -> Result<Response, ApiError> {
        check_entry_bytes(&command)?;
        // Direct path: with nothing queued and a batch slot free, this proposal would be a
        // batch of one anyway; committing it from the caller's task saves two task
        // switches (to the batching task and to its commit task) and one back. tokio's
        // semaphore hands a released slot to a waiting batch first, so this never
        // overtakes proposals the batching task already holds.
        if self.queue.capacity() == self.queue.max_capacity()
            && let Ok(permit) = self.inflight.clone().try_acquire_owned()
        {
            let result = write(&self.raft, command).await;
            drop(permit);
            return result;
        }
        let (reply, result) = oneshot::channel();
        let stopping = || ApiError::Unavailable("this coordinator is shutting down".into());
        self.queue
            .send(Proposal { command, reply })
            .await
            .map_err(|_| stopping())?;
        result.await.map_err(|_| stopping())?
    }
}

/// Takes queued proposals in order and commits them in batches, at most
/// [`MAX_INFLIGHT_BATCHES`] at a time.
async fn batch_loop(
    raft: Raft,
    mut rx: mpsc::Receiver<Proposal>,
    inflight: Arc<Semaphore>,
    shutdown: CancellationToken,
) {
    // A proposal taken from the queue that did not fit the previous batch.
    let mut carried: Option<Proposal> = None;
    loop {
        // The first proposal, then a slot: an idle loop holds no slot, so the direct path
        // of `propose` can take it.
        let first = match carried.take() {
            Some(p) => p,
            None => tokio::select! {
                _ = shutdown.cancelled() => return,
                p = rx.recv() => match p {
                    Some(p) => p,
                    None => return,
                },
            },
        };
        let permit = tokio::select! {
            _ = shutdown.cancelled() => return,
            p = inflight.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let mut bytes = first.command.approx_encoded_bytes();
        // A proposal that is a batch already (the leader's planned commands, a purge)
        // goes alone: `apply` refuses a batch inside a batch, which would fail every
        // proposal it was coalesced with.
        let is_batch = |c: &Command| matches!(c, Command::Batch { .. });
        let alone = is_batch(&first.command);
        let mut batch = vec![first];
        while !alone && batch.len() < MAX_BATCH_COMMANDS && bytes < MAX_BATCH_BYTES {
            let Ok(next) = rx.try_recv() else { break };
            let size = next.command.approx_encoded_bytes();
            if is_batch(&next.command) || bytes + size > MAX_BATCH_BYTES {
                carried = Some(next);
                break;
            }
            bytes += size;
            batch.push(next);
        }
        let raft = raft.clone();
        tokio::spawn(async move {
            commit(&raft, batch).await;
            drop(permit);
        });
    }
}

/// Commits one batch and answers every proposal in it.
async fn commit(raft: &Raft, mut batch: Vec<Proposal>) {
    if batch.len() == 1 {
        let p = batch.pop().expect("one proposal");
        let result = write(raft, p.command).await;
        // The proposer may have given up waiting (its request was cancelled): nothing to do.
        let _ = p.reply.send(result);
        return;
    }
    let (commands, replies): (Vec<Command>, Vec<_>) =
        batch.into_iter().map(|p| (p.command, p.reply)).unzip();
    let n = commands.len();
    match write(raft, Command::Batch { commands }).await {
        Ok(Response::Batch { responses }) if responses.len() == n => {
            for (reply, response) in replies.into_iter().zip(responses) {
                let _ = reply.send(Ok(response));
            }
        }
        Ok(Response::Rejected { reason }) => {
            tracing::error!(%reason, "a batch of proposals was rejected whole");
            for reply in replies {
                let _ = reply.send(Err(ApiError::Internal(format!(
                    "the batch holding this write was rejected: {reason}"
                ))));
            }
        }
        Ok(other) => {
            tracing::error!(response = ?other, commands = n, "unexpected response to a batch");
            for reply in replies {
                let _ = reply.send(Err(ApiError::Internal(
                    "the batch holding this write got an unexpected response".into(),
                )));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

/// One `client_write`, its errors mapped to [`ApiError`].
async fn write(raft: &Raft, command: Command) -> Result<Response, ApiError> {
    let start_ns = stage::now_ns();
    match raft.client_write(command).await {
        Ok(resp) => {
            tracing::trace!(
                target: stage::TARGET,
                stage = "client_write",
                index = resp.log_id.index,
                start_ns,
                end_ns = stage::now_ns(),
            );
            Ok(resp.data)
        }
        Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
            Err(ApiError::NotLeader {
                leader: f.leader_node.clone().or_else(|| leader_node(raft)),
            })
        }
        Err(e) => Err(ApiError::Unavailable(format!("raft could not commit: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use cumulus_raft_store::state::JobSpec;

    use super::*;

    fn submit(shards: Vec<String>) -> Command {
        Command::SubmitJob {
            owner: String::new(),
            request_id: "r".into(),
            spec: JobSpec {
                dataset: "/data".into(),
                ..JobSpec::new(1, vec!["true".into()])
            },
            shards,
            submitted_at_ms: 1,
        }
    }

    fn json_bytes(command: &Command) -> usize {
        serde_json::to_vec(command).expect("encode").len()
    }

    #[test]
    fn a_command_that_fits_one_entry_is_admitted() {
        assert!(check_entry_bytes(&submit(vec!["/data/a".into()])).is_ok());
        // Encoded exactly (its estimate is past the shortcut), and just under the limit.
        let big = submit(vec!["s".repeat(MAX_ENTRY_BYTES - 1_000)]);
        assert!(json_bytes(&big) <= MAX_ENTRY_BYTES);
        assert!(check_entry_bytes(&big).is_ok());
    }

    #[test]
    fn a_larger_command_is_refused_with_its_size_and_shard_count() {
        let shards: Vec<String> = (0..20)
            .map(|i| format!("{i}{}", "s".repeat(1 << 20)))
            .collect();
        let err = check_entry_bytes(&submit(shards)).expect_err("too large");
        let ApiError::InvalidArgument(msg) = err else {
            panic!("{err:?}");
        };
        assert!(msg.contains("20 shard paths"), "{msg}");
        assert!(msg.contains(&MAX_ENTRY_BYTES.to_string()), "{msg}");
    }

    #[test]
    fn escaping_that_multiplies_a_small_estimate_is_counted() {
        // 3 MiB of control characters: each is encoded as `\u0001`, six bytes.
        let shards = vec!["\u{1}".repeat(3 << 20)];
        let command = submit(shards);
        assert!(command.approx_encoded_bytes() < MAX_ENTRY_BYTES);
        assert!(json_bytes(&command) > MAX_ENTRY_BYTES);
        assert!(check_entry_bytes(&command).is_err());
    }
}
