//! Reliable, bounded reporting of rank lifecycle events (RankStarted, RankExited).
//!
//! An event is sent at once when it is pushed; one that fails is retried at most once per
//! retry interval (the heartbeat interval) until the coordinator acknowledges it.
//! FAILED_PRECONDITION (the attempt is stale, or the job or rank unknown) counts as an
//! acknowledgement: the leader has nothing more to learn from it; INVALID_ARGUMENT drops
//! the event (retrying the same bytes cannot help). Limits: at most
//! [`MAX_PENDING_EVENTS`] events wait (the oldest is dropped, with an error log, to make
//! room), and an event still unacknowledged [`EVENT_MAX_AGE`] after it was pushed is
//! dropped with an error log. Events of one attempt are sent in the order they were pushed.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cumulus_api::{RankExitedRequest, RankStartedRequest};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::client::{ClientError, CoordinatorClient, RetryPolicy};
use cumulus_api::AttemptKey;

/// Most events waiting for an acknowledgement.
pub const MAX_PENDING_EVENTS: usize = 1024;
/// An event unacknowledged for this long is dropped.
pub const EVENT_MAX_AGE: Duration = Duration::from_secs(600);

/// A lifecycle event of one rank attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum RankEvent {
    /// The process started.
    Started(RankStartedRequest),
    /// The process exited, or could not be started.
    Exited(RankExitedRequest),
}

impl RankEvent {
    /// The attempt the event is about.
    pub fn key(&self) -> AttemptKey {
        match self {
            RankEvent::Started(r) => AttemptKey::new(r.job_id.clone(), r.rank, r.attempt),
            RankEvent::Exited(r) => AttemptKey::new(r.job_id.clone(), r.rank, r.attempt),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            RankEvent::Started(_) => "RankStarted",
            RankEvent::Exited(_) => "RankExited",
        }
    }
}

#[derive(Debug)]
struct Pending {
    id: u64,
    event: RankEvent,
    pushed_at: Instant,
    next_try: Instant,
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<Pending>,
    next_id: u64,
}

/// The first pending event of every attempt, in queue order: the only ones that may be
/// sent now (events of one attempt go out in the order they were pushed).
fn heads(items: &VecDeque<Pending>) -> impl Iterator<Item = &Pending> {
    let mut seen: HashSet<AttemptKey> = HashSet::new();
    items.iter().filter(move |p| seen.insert(p.event.key()))
}

/// The queue of unacknowledged events and its sender. Cheap to clone.
#[derive(Debug, Clone)]
pub struct EventReporter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    queue: Mutex<Queue>,
    notify: Notify,
    client: Arc<CoordinatorClient>,
    retry_interval: Duration,
}

/// What happened to one send.
enum Outcome {
    Done,
    Retry,
}

impl EventReporter {
    /// A reporter sending through `client`, retrying a failed event at most once per
    /// `retry_interval`.
    pub fn new(client: Arc<CoordinatorClient>, retry_interval: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                queue: Mutex::new(Queue::default()),
                notify: Notify::new(),
                client,
                retry_interval,
            }),
        }
    }

    /// Queues `event` and wakes the sender.
    pub fn push(&self, event: RankEvent) {
        let now = Instant::now();
        {
            let mut q = self.inner.queue.lock().expect("event queue lock poisoned");
            if q.items.len() >= MAX_PENDING_EVENTS
                && let Some(dropped) = q.items.pop_front()
            {
                tracing::error!(
                    attempt = %dropped.event.key(),
                    event = dropped.event.name(),
                    "event queue full ({MAX_PENDING_EVENTS}): dropping the oldest unacknowledged event"
                );
            }
            let id = q.next_id;
            q.next_id += 1;
            q.items.push_back(Pending {
                id,
                event,
                pushed_at: now,
                next_try: now,
            });
        }
        self.inner.notify.notify_one();
    }

    /// A snapshot of the events still waiting for an acknowledgement, oldest first.
    pub fn pending(&self) -> Vec<RankEvent> {
        let q = self.inner.queue.lock().expect("event queue lock poisoned");
        q.items.iter().map(|p| p.event.clone()).collect()
    }

    /// Sends events until `cancel` is cancelled.
    pub async fn run(self, cancel: CancellationToken) {
        loop {
            let wake_at = self
                .send_due(RetryPolicy::one_round(
                    self.inner.client.coordinator_count(),
                ))
                .await;
            let sleep = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.inner.notify.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// Tries every pending event once, ignoring retry times, for at most `timeout`
    /// (best effort, at shutdown). Returns the number of events still unacknowledged.
    pub async fn flush(&self, timeout: Duration) -> usize {
        {
            let mut q = self.inner.queue.lock().expect("event queue lock poisoned");
            let now = Instant::now();
            for p in q.items.iter_mut() {
                p.next_try = now;
            }
        }
        let policy = RetryPolicy::one_round(self.inner.client.coordinator_count());
        let passes = async {
            // Each pass sends the first due event of every attempt; later events of an
            // attempt become due in the next pass. Stop when nothing is due any more.
            loop {
                self.send_due(policy).await;
                let q = self.inner.queue.lock().expect("event queue lock poisoned");
                let now = Instant::now();
                if !heads(&q.items).any(|p| p.next_try <= now) {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, passes).await;
        self.inner
            .queue
            .lock()
            .expect("event queue lock poisoned")
            .items
            .len()
    }

    /// One pass over the queue: drops expired events, sends every due one whose attempt has
    /// no earlier event still pending, and returns when the next retry is due.
    async fn send_due(&self, policy: RetryPolicy) -> Option<Instant> {
        let due: Vec<(u64, RankEvent)> = {
            let mut q = self.inner.queue.lock().expect("event queue lock poisoned");
            let now = Instant::now();
            q.items.retain(|p| {
                let expired = now.duration_since(p.pushed_at) >= EVENT_MAX_AGE;
                if expired {
                    tracing::error!(
                        attempt = %p.event.key(),
                        event = p.event.name(),
                        "dropping an event unacknowledged for {} s",
                        EVENT_MAX_AGE.as_secs()
                    );
                }
                !expired
            });
            heads(&q.items)
                .filter(|p| p.next_try <= now)
                .map(|p| (p.id, p.event.clone()))
                .collect()
        };
        for (id, event) in due {
            match self.send(&event, policy).await {
                Outcome::Done => {
                    let mut q = self.inner.queue.lock().expect("event queue lock poisoned");
                    q.items.retain(|p| p.id != id);
                }
                Outcome::Retry => {
                    let mut q = self.inner.queue.lock().expect("event queue lock poisoned");
                    let next = Instant::now() + self.inner.retry_interval;
                    if let Some(p) = q.items.iter_mut().find(|p| p.id == id) {
                        p.next_try = next;
                    }
                }
            }
        }
        let q = self.inner.queue.lock().expect("event queue lock poisoned");
        // Only the first event of an attempt can be sent; the later ones wait for it (and
        // expire no earlier than it does, having been pushed later).
        heads(&q.items)
            .map(|p| p.next_try.min(p.pushed_at + EVENT_MAX_AGE))
            .min()
    }

    async fn send(&self, event: &RankEvent, policy: RetryPolicy) -> Outcome {
        let client = &self.inner.client;
        let result: Result<(), ClientError> = match event {
            RankEvent::Started(req) => client
                .call("RankStarted", policy, req, |mut c, r| async move {
                    c.rank_started(r).await
                })
                .await
                .map(|_| ()),
            RankEvent::Exited(req) => client
                .call("RankExited", policy, req, |mut c, r| async move {
                    c.rank_exited(r).await
                })
                .await
                .map(|_| ()),
        };
        match result {
            Ok(()) => Outcome::Done,
            Err(e) if e.is_stale() => {
                tracing::info!(attempt = %event.key(), event = event.name(), "coordinator: stale attempt ({e})");
                Outcome::Done
            }
            Err(e) if e.code() == Some(Code::InvalidArgument) => {
                tracing::error!(attempt = %event.key(), event = event.name(), "dropping a rejected event: {e}");
                Outcome::Done
            }
            Err(ClientError::Cancelled { .. }) => Outcome::Retry,
            Err(e) => {
                tracing::warn!(attempt = %event.key(), event = event.name(), "not acknowledged, will retry: {e}");
                Outcome::Retry
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(job: &str, rank: u32) -> RankEvent {
        RankEvent::Exited(RankExitedRequest {
            worker_id: "w".into(),
            job_id: job.into(),
            rank,
            attempt: 0,
            exit_code: Some(0),
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn queue_is_bounded_and_keeps_the_newest() {
        let client = Arc::new(
            CoordinatorClient::new(&["127.0.0.1:1".into()], "t", CancellationToken::new())
                .expect("client"),
        );
        let reporter = EventReporter::new(client, Duration::from_secs(1));
        for i in 0..(MAX_PENDING_EVENTS as u32 + 5) {
            reporter.push(exited("job-1", i));
        }
        let pending = reporter.pending();
        assert_eq!(pending.len(), MAX_PENDING_EVENTS);
        assert_eq!(pending[0].key().rank, 5);
        assert_eq!(
            pending.last().map(|e| e.key().rank),
            Some(MAX_PENDING_EVENTS as u32 + 4)
        );
    }

    #[tokio::test]
    async fn later_events_of_an_attempt_wait_for_the_earlier_ones() {
        let client = Arc::new(
            CoordinatorClient::new(&["127.0.0.1:1".into()], "t", CancellationToken::new())
                .expect("client"),
        );
        let reporter = EventReporter::new(client, Duration::from_secs(300));
        reporter.push(RankEvent::Started(RankStartedRequest {
            job_id: "job-1".into(),
            pid: 42,
            ..Default::default()
        }));
        reporter.push(exited("job-1", 0));
        reporter.push(exited("job-2", 0));
        // The Started of job-1 and the Exited of job-2 fail; job-1's Exited is never tried
        // before its Started, and the next wake-up is the retry time, not "now".
        let next = reporter
            .send_due(RetryPolicy::one_round(1))
            .await
            .expect("a retry is scheduled");
        assert!(next > Instant::now() + Duration::from_secs(250));
        let q = reporter.inner.queue.lock().expect("lock");
        let tried: Vec<bool> = q.items.iter().map(|p| p.next_try > p.pushed_at).collect();
        assert_eq!(tried, [true, false, true]);
    }

    #[tokio::test]
    async fn unacknowledged_events_stay_queued_for_retry() {
        let client = Arc::new(
            CoordinatorClient::new(&["127.0.0.1:1".into()], "t", CancellationToken::new())
                .expect("client"),
        );
        let reporter = EventReporter::new(client, Duration::from_secs(300));
        reporter.push(exited("job-1", 0));
        reporter.push(exited("job-1", 1));
        // Nothing listens on port 1: both fail and stay, with the next try 300 s away.
        let left = reporter.flush(Duration::from_secs(30)).await;
        assert_eq!(left, 2);
        let next = reporter
            .send_due(RetryPolicy::one_round(1))
            .await
            .expect("a retry is scheduled");
        assert!(next > Instant::now() + Duration::from_secs(250));
        assert_eq!(reporter.pending().len(), 2);
    }
}
