//! The connection pool of one listener: which connections are open, which of them have
//! not yet been useful (pending), whose they are, and which to close when a new
//! connection needs room.
//!
//! Every open connection is in one of three classes:
//! - **pending**: accepted, no useful request answered yet. Pending connections draw
//!   from a small pool ([`Limits::max_pending_connections`]) with a share per source
//!   ([`Limits::max_pending_per_source`]: an IP address on TCP, a uid on a Unix socket);
//! - **graduated**: a response that was not a refusal (HTTP 401/403, gRPC
//!   `UNAUTHENTICATED`/`PERMISSION_DENIED`) was sent on it;
//! - **coordinator**: its verified TLS client certificate names a coordinator; counted
//!   against [`Limits::reserved_connections`] while there is room there, never against
//!   the pending pool, and never evicted.
//!
//! When a new connection finds its source's share, the pending pool or the general cap
//! full, the pool makes room by closing the connection that has been idle longest (no
//! request in flight) among those that compete with it: its source's pending ones, then
//! all pending ones, then (general cap) pending before graduated. Only when none of them
//! is idle is the new connection refused. So a flood of connections that never send a
//! request, or send one and then idle, cannot keep a new client out: each new connection
//! displaces the stalest idle one, and the client's own connection, newest of all and
//! soon busy with its request, is the last that would be displaced.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;

use crate::Limits;

/// Where a connection comes from: the unit of the per-source share of the pending pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// A TCP peer's IP address (port left out: one host, one share).
    Ip(IpAddr),
    /// A Unix socket peer's user id (`SO_PEERCRED`).
    Uid(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Pending,
    Graduated,
    Coordinator,
}

struct Entry {
    source: Source,
    class: Class,
    /// Counted against the reserved pool rather than the general cap.
    reserved: bool,
    activity: Arc<Activity>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    conns: HashMap<u64, Entry>,
    pending: usize,
    pending_by_source: HashMap<Source, usize>,
    /// Connections counted against [`Limits::max_connections`].
    general: usize,
    /// Connections counted against [`Limits::reserved_connections`].
    reserved: usize,
}

impl State {
    fn uncount(&mut self, e: &Entry) {
        if e.class == Class::Pending {
            self.pending -= 1;
            if let Some(n) = self.pending_by_source.get_mut(&e.source) {
                *n -= 1;
                if *n == 0 {
                    self.pending_by_source.remove(&e.source);
                }
            }
        }
        if e.reserved {
            self.reserved -= 1;
        } else {
            self.general -= 1;
        }
    }

    /// Closes the connection idle longest among those `eligible` admits; false when
    /// none of them is idle.
    fn evict(&mut self, eligible: impl Fn(&Entry) -> bool) -> bool {
        let victim = self
            .conns
            .iter()
            .filter(|(_, e)| eligible(e))
            .filter_map(|(id, e)| e.activity.idle_since().map(|t| (t, *id)))
            .min();
        let Some((_, id)) = victim else {
            return false;
        };
        let entry = self.conns.remove(&id).expect("victim is open");
        self.uncount(&entry);
        entry.activity.evict();
        true
    }
}

/// Why a connection was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Its source's share of the pending pool is taken by connections all busy.
    SourceShare,
    /// The pending pool is taken by connections all busy.
    Pending,
    /// The cap is reached and no connection is idle.
    Cap,
}

/// The connections of one listener; see the module doc.
pub(crate) struct Pool {
    limits: Limits,
    state: Mutex<State>,
    /// Connections refused for want of room (every [`Refused`], and a reserved one with
    /// no room after its handshake), ever.
    refused: AtomicU64,
    /// Failed `accept` calls of the listener, ever.
    accept_errors: AtomicU64,
    /// The listener's accept loop is running.
    serving: AtomicBool,
}

/// What a listener turned away since it was made: evidence that a client could not reach
/// it for the server's own reasons. Monotonic counters: a caller keeps one reading and
/// subtracts it from a later one ([`TurnedAway::since`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnedAway {
    /// Connections accepted and closed at once: the cap, the pending pool or the
    /// source's share was full of busy connections.
    pub refused: u64,
    /// `accept` calls that failed (descriptors exhausted, say).
    pub accept_errors: u64,
}

impl TurnedAway {
    /// What was turned away between `earlier` and `self`.
    pub fn since(self, earlier: TurnedAway) -> TurnedAway {
        TurnedAway {
            refused: self.refused.saturating_sub(earlier.refused),
            accept_errors: self.accept_errors.saturating_sub(earlier.accept_errors),
        }
    }

    /// Nothing was turned away.
    pub fn is_none(self) -> bool {
        self.refused == 0 && self.accept_errors == 0
    }
}

/// Counts of a listener's connections, for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Connections open.
    pub open: usize,
    /// Of them, pending (no useful request answered yet).
    pub pending: usize,
    /// Of them, counted against the reserved pool.
    pub reserved: usize,
}

impl Pool {
    pub(crate) fn new(limits: Limits) -> Arc<Pool> {
        Arc::new(Pool {
            limits,
            state: Mutex::new(State::default()),
            refused: AtomicU64::new(0),
            accept_errors: AtomicU64::new(0),
            serving: AtomicBool::new(false),
        })
    }

    pub(crate) fn turned_away(&self) -> TurnedAway {
        TurnedAway {
            refused: self.refused.load(Ordering::Relaxed),
            accept_errors: self.accept_errors.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn note_accept_error(&self) {
        self.accept_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn serving(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// Marks the listener's accept loop as running until the returned guard drops.
    pub(crate) fn serve(self: &Arc<Self>) -> Serving {
        self.serving.store(true, Ordering::Relaxed);
        Serving(self.clone())
    }

    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves counts that are still consistent
        // (every update is a few integer steps); keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn counts(&self) -> Counts {
        let s = self.state();
        Counts {
            open: s.conns.len(),
            pending: s.pending,
            reserved: s.reserved,
        }
    }

    /// Admits a new connection from `source` as pending, making room as the module doc
    /// says. `may_reserve`: the connection may be a coordinator's (TLS with client
    /// certificates), so when the general cap is full it may wait for its handshake in
    /// the reserved pool ([`Slot::identify`] then keeps it there or closes it).
    pub(crate) fn admit(
        self: &Arc<Self>,
        source: Source,
        may_reserve: bool,
    ) -> Result<Slot, Refused> {
        let admitted = self.try_admit(source, may_reserve);
        if admitted.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        admitted
    }

    fn try_admit(self: &Arc<Self>, source: Source, may_reserve: bool) -> Result<Slot, Refused> {
        let l = self.limits;
        let mut s = self.state();
        let of_source = s.pending_by_source.get(&source).copied().unwrap_or(0);
        if of_source >= l.max_pending_per_source
            && !s.evict(|e| e.class == Class::Pending && e.source == source)
        {
            return Err(Refused::SourceShare);
        }
        if s.pending >= l.max_pending_connections && !s.evict(|e| e.class == Class::Pending) {
            return Err(Refused::Pending);
        }
        let mut reserved = false;
        if s.general >= l.max_connections
            && !s.evict(|e| !e.reserved && e.class == Class::Pending)
            && !s.evict(|e| !e.reserved && e.class == Class::Graduated)
        {
            if may_reserve && s.reserved < l.reserved_connections {
                reserved = true;
            } else {
                return Err(Refused::Cap);
            }
        }
        let id = s.next_id;
        s.next_id += 1;
        let activity = Arc::new(Activity {
            id,
            pool: Arc::downgrade(self),
            state: Mutex::new(ActState {
                in_flight: 0,
                last_change: Instant::now(),
                graduated: false,
                closed: false,
                polled: false,
            }),
            waker: AtomicWaker::new(),
        });
        s.pending += 1;
        *s.pending_by_source.entry(source).or_default() += 1;
        if reserved {
            s.reserved += 1;
        } else {
            s.general += 1;
        }
        s.conns.insert(
            id,
            Entry {
                source,
                class: Class::Pending,
                reserved,
                activity: activity.clone(),
            },
        );
        Ok(Slot {
            pool: self.clone(),
            activity,
        })
    }

    fn graduate(&self, id: u64) {
        let mut s = self.state();
        let State {
            conns,
            pending,
            pending_by_source,
            ..
        } = &mut *s;
        let Some(e) = conns.get_mut(&id) else {
            return;
        };
        if e.class == Class::Pending {
            e.class = Class::Graduated;
            *pending -= 1;
            if let Some(n) = pending_by_source.get_mut(&e.source) {
                *n -= 1;
                if *n == 0 {
                    pending_by_source.remove(&e.source);
                }
            }
        }
    }

    fn release(&self, id: u64) {
        let mut s = self.state();
        if let Some(e) = s.conns.remove(&id) {
            s.uncount(&e);
        }
    }
}

/// A connection's place in its listener's [`Pool`]: held by the connection's stream,
/// given back when it is dropped.
pub(crate) struct Slot {
    pool: Arc<Pool>,
    activity: Arc<Activity>,
}

impl Slot {
    pub(crate) fn activity(&self) -> &Arc<Activity> {
        &self.activity
    }

    /// Records what the connection's verified client certificate says: a coordinator's
    /// connection leaves the pending pool and moves to the reserved pool while it has
    /// room; any other connection admitted into the reserved pool (the general cap was
    /// full) moves to the general cap if it has room now. False: the connection has no
    /// room and must be closed.
    pub(crate) fn identify(&self, coordinator: bool) -> bool {
        let l = self.pool.limits;
        let mut s = self.pool.state();
        let id = self.activity.id;
        let Some(e) = s.conns.get(&id) else {
            return false; // evicted during the handshake
        };
        let (class, reserved, source) = (e.class, e.reserved, e.source);
        if coordinator {
            if class == Class::Pending {
                s.pending -= 1;
                if let Some(n) = s.pending_by_source.get_mut(&source) {
                    *n -= 1;
                    if *n == 0 {
                        s.pending_by_source.remove(&source);
                    }
                }
            }
            let to_reserved = !reserved && s.reserved < l.reserved_connections;
            if to_reserved {
                s.general -= 1;
                s.reserved += 1;
            }
            let e = s.conns.get_mut(&id).expect("present");
            e.class = Class::Coordinator;
            e.reserved |= to_reserved;
            drop(s);
            self.activity.mark_graduated();
            return true;
        }
        if reserved {
            if s.general >= l.max_connections {
                self.pool.refused.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            s.reserved -= 1;
            s.general += 1;
            s.conns.get_mut(&id).expect("present").reserved = false;
        }
        true
    }
}

/// The running accept loop of a listener ([`Pool::serve`]); its pool stops counting as
/// serving when this drops.
pub(crate) struct Serving(Arc<Pool>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.serving.store(false, Ordering::Relaxed);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.release(self.activity.id);
    }
}

struct ActState {
    /// Requests started and not yet answered in full (the response body not yet all
    /// handed to the connection).
    in_flight: usize,
    /// When `in_flight` last changed (or the connection was accepted).
    last_change: Instant,
    /// Whether a useful request has been answered (or a coordinator identified).
    graduated: bool,
    /// Evicted by its pool: the stream fails its reads.
    closed: bool,
    /// Whether the connection's stream has been read from yet. A connection is not
    /// evicted before: a client's request usually lies in the socket already when the
    /// server first reads, and is in flight from that read on, so a flood that arrives
    /// faster than the server runs its connections' tasks does not displace it.
    polled: bool,
}

/// What one connection is doing: its requests in flight and when it was last busy. The
/// connection's stream reads it to enforce the first-request and idle deadlines; the
/// [`crate::Track`] service updates it as requests start and end. Tonic puts it in
/// every request's extensions inside [`crate::ConnInfo`].
pub struct Activity {
    id: u64,
    pool: Weak<Pool>,
    state: Mutex<ActState>,
    /// The stream's reading task, woken when the connection goes idle (its deadline
    /// must be armed) or is evicted.
    pub(crate) waker: AtomicWaker,
}

impl std::fmt::Debug for Activity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        f.debug_struct("Activity")
            .field("id", &self.id)
            .field("in_flight", &s.in_flight)
            .field("graduated", &s.graduated)
            .finish()
    }
}

/// What the stream must do about a connection's deadlines now.
pub(crate) enum Due {
    /// Evicted by its pool: close.
    Evicted,
    /// A request is in flight: no deadline.
    Busy,
    /// Idle: close at this instant unless a request starts first.
    At(Instant),
}

impl Activity {
    fn state(&self) -> MutexGuard<'_, ActState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Since when the connection has been idle (`None`: a request is in flight, or it
    /// was evicted).
    fn idle_since(&self) -> Option<Instant> {
        let s = self.state();
        (s.in_flight == 0 && !s.closed && s.polled).then_some(s.last_change)
    }

    fn evict(&self) {
        self.state().closed = true;
        self.waker.wake();
    }

    fn mark_graduated(&self) {
        self.state().graduated = true;
    }

    /// The connection's deadline: `first_request` after it was accepted or its last
    /// request ended while it is pending, `idle` after its last request ended once
    /// graduated.
    /// Called by the stream at each read, which marks the connection as read from.
    pub(crate) fn due(&self, first_request: Duration, idle: Duration) -> Due {
        let mut s = self.state();
        s.polled = true;
        if s.closed {
            Due::Evicted
        } else if s.in_flight > 0 {
            Due::Busy
        } else if s.graduated {
            Due::At(s.last_change + idle)
        } else {
            Due::At(s.last_change + first_request)
        }
    }

    /// A request started: the connection is busy until the returned guard drops.
    pub(crate) fn start(self: &Arc<Self>) -> InFlight {
        let mut s = self.state();
        s.in_flight += 1;
        s.last_change = Instant::now();
        InFlight(self.clone())
    }

    /// A useful request was answered: the connection leaves the pending pool.
    pub(crate) fn graduate(&self) {
        {
            let mut s = self.state();
            if s.graduated {
                return;
            }
            s.graduated = true;
        }
        if let Some(pool) = self.pool.upgrade() {
            pool.graduate(self.id);
        }
    }
}

/// One request in flight on a connection; dropped when its response has been handed to
/// the connection in full (or the request was abandoned).
pub(crate) struct InFlight(Arc<Activity>);

impl InFlight {
    pub(crate) fn activity(&self) -> &Arc<Activity> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let idle = {
            let mut s = self.0.state();
            s.in_flight -= 1;
            s.last_change = Instant::now();
            s.in_flight == 0
        };
        if idle {
            // The reading task arms the idle deadline when it next polls.
            self.0.waker.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_connections: 8,
            max_pending_connections: 4,
            max_pending_per_source: 2,
            reserved_connections: 2,
            ..Limits::connections(8)
        }
    }

    #[test]
    fn a_source_gets_only_its_share_of_the_pending_pool() {
        let pool = Pool::new(limits());
        let a = Source::Uid(1000);
        let b = Source::Uid(1001);
        // Two busy pending connections of uid 1000 fill its share: a third is refused,
        // uid 1001 still gets in.
        let a1 = pool.admit(a, false).expect("a1");
        let a2 = pool.admit(a, false).expect("a2");
        let _busy = [a1.activity().start(), a2.activity().start()];
        assert_eq!(pool.admit(a, false).err(), Some(Refused::SourceShare));
        let b1 = pool.admit(b, false).expect("another uid is not refused");
        assert_eq!(pool.counts().pending, 3);
        // An idle one of uid 1000 (read from: not fresh) is displaced by the next of uid
        // 1000, never uid 1001's.
        for s in [&a1, &a2, &b1] {
            let _ = s.activity().due(Duration::ZERO, Duration::ZERO);
        }
        drop(_busy);
        let a3 = pool.admit(a, false).expect("displaces an idle one");
        let evicted = [&a1, &a2]
            .iter()
            .filter(|s| {
                matches!(
                    s.activity().due(Duration::ZERO, Duration::ZERO),
                    Due::Evicted
                )
            })
            .count();
        assert_eq!(evicted, 1);
        assert!(!matches!(
            b1.activity().due(Duration::ZERO, Duration::ZERO),
            Due::Evicted
        ));
        assert_eq!(pool.counts().pending, 3);
        drop(a3);
        assert_eq!(pool.counts().pending, 2);
    }

    #[test]
    fn graduated_connections_leave_the_pending_pool_and_refusals_count_nothing() {
        let pool = Pool::new(limits());
        let ip = Source::Ip("127.0.0.1".parse().expect("ip"));
        let s = pool.admit(ip, false).expect("admit");
        s.activity().graduate();
        assert_eq!(
            pool.counts(),
            Counts {
                open: 1,
                pending: 0,
                reserved: 0
            }
        );
        drop(s);
        assert_eq!(pool.counts(), Counts::default());
    }

    #[test]
    fn coordinators_get_the_reserved_pool_when_the_cap_is_busy() {
        let pool = Pool::new(limits());
        // The general cap full of busy graduated connections from many sources.
        let mut held = Vec::new();
        for i in 0..8 {
            let s = pool.admit(Source::Uid(i), true).expect("admit");
            s.activity().graduate();
            let busy = s.activity().start();
            held.push((s, busy));
        }
        assert_eq!(pool.admit(Source::Uid(50), false).err(), Some(Refused::Cap));
        assert_eq!(pool.turned_away().refused, 1);
        // A TLS connection waits for its handshake in the reserved pool: a coordinator
        // stays, anyone else is closed.
        let coordinator = pool.admit(Source::Uid(60), true).expect("reserve");
        assert!(coordinator.identify(true));
        let stranger = pool.admit(Source::Uid(61), true).expect("reserve");
        assert!(!stranger.identify(false));
        assert_eq!(pool.turned_away().refused, 2, "no room after the handshake");
        assert_eq!(pool.counts().reserved, 2);
        drop(stranger);
        assert_eq!(
            pool.counts(),
            Counts {
                open: 9,
                pending: 0,
                reserved: 1
            }
        );
    }
}
