//! Many peers: a rank's connections to the other ranks of its job, made on
//! first use through a [`Rendezvous`].
//!
//! [`World::join`] listens, publishes this rank's [`Endpoint`] under
//! `<job>/rank/<r>`, and from then on:
//!
//! - [`World::peer`] returns the connection this rank dialed to another,
//!   dialing it on first use (the peer's endpoint is looked up, waiting
//!   until it is published). Dials to different ranks run side by side: a
//!   slow handshake holds up only the callers that want that rank. The
//!   pool keeps at most [`WorldOptions::max_connections`] dialed
//!   connections; the least recently used one that nobody holds goes first.
//! - [`World::accepted`] returns the connection a peer dialed to this rank
//!   (its notifications and sends arrive there), accepted by one thread.
//! - A rank whose key leaves the rendezvous (it left, or, with etcd, its
//!   lease expired because it died or hung) is gone: its connections are
//!   closed, which fails their operations with [`Error::ConnectionLost`]
//!   naming it, and [`World::peer`] fails with [`Error::PeerGone`] until it
//!   publishes again. A rank that restarts under the same rank number is
//!   dialed afresh on next use.
//!
//! Threads: one accepting and one watching the rendezvous per `World`
//! (none per connection here; each TCP connection has its transport's
//! sender and receiver threads, each verbs connection none).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::connection::{Connection, Interrupt, Listener};
use crate::domain::Domain;
use crate::endpoint::Endpoint;
use crate::error::{Error, Result};
use crate::options::ConnectOptions;
use crate::rendezvous::{Change, Rendezvous};

/// How a [`World`] behaves.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorldOptions {
    /// The job's name: keys go under `<job>/rank/<r>`.
    pub job: String,
    /// What every connection is set up with (its name is set per rank).
    pub connect: ConnectOptions,
    /// The most dialed connections kept (default 64).
    pub max_connections: usize,
    /// How long a first use waits for the peer to publish (default 60 s).
    pub lookup_timeout: Duration,
    /// Where to listen (default `127.0.0.1:0`; on several machines, an
    /// address the others reach).
    pub listen: String,
}

impl WorldOptions {
    /// Defaults for job `job`.
    pub fn new(job: impl Into<String>) -> Self {
        WorldOptions {
            job: job.into(),
            connect: ConnectOptions::default(),
            max_connections: 64,
            lookup_timeout: Duration::from_secs(60),
            listen: "127.0.0.1:0".into(),
        }
    }

    /// Sets what connections are set up with.
    #[must_use]
    pub fn connect(mut self, opts: ConnectOptions) -> Self {
        self.connect = opts;
        self
    }

    /// Sets the pool's bound (at least 1).
    #[must_use]
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Sets how long a first use waits for the peer to publish.
    #[must_use]
    pub fn lookup_timeout(mut self, t: Duration) -> Self {
        self.lookup_timeout = t;
        self
    }

    /// Sets where to listen.
    #[must_use]
    pub fn listen(mut self, addr: impl Into<String>) -> Self {
        self.listen = addr.into();
        self
    }
}

/// A dialed connection, or a dial in progress.
enum Dial {
    Dialing,
    Ready { conn: Arc<Connection>, used: u64 },
}

#[derive(Default)]
struct WorldState {
    out: HashMap<u32, Dial>,
    incoming: HashMap<u32, Arc<Connection>>,
    /// Ranks whose key left the rendezvous, and why.
    gone: HashMap<u32, String>,
    /// Ranks whose key was seen (a rank seen once and missing from a lookup
    /// made after that is gone, even where a polling watch missed its going).
    known: std::collections::HashSet<u32>,
    clock: u64,
}

struct WorldInner {
    rank: u32,
    size: u32,
    domain: Domain,
    opts: WorldOptions,
    rdv: Arc<dyn Rendezvous>,
    state: Mutex<WorldState>,
    changed: Condvar,
    stop: AtomicBool,
    /// Why the rendezvous's watch cannot see ranks leave, while it cannot.
    watch_failing: Mutex<Option<String>>,
}

/// A rank's view of its job (see the module docs).
pub struct World {
    inner: Arc<WorldInner>,
    interrupt: Interrupt,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World").field("job", &self.inner.opts.job).field("rank", &self.inner.rank).finish()
    }
}

fn key(job: &str, rank: u32) -> String {
    format!("{job}/rank/{rank}")
}

/// The rank a key or a connection name is for.
fn rank_of(job: &str, name: &[u8]) -> Option<u32> {
    std::str::from_utf8(name).ok()?.strip_prefix(job)?.strip_prefix("/rank/")?.parse().ok()
}

impl WorldInner {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank `r` left the rendezvous: close its connections.
    fn gone(&self, r: u32, reason: String) {
        let (out, incoming) = {
            let mut st = self.lock();
            st.gone.insert(r, reason.clone());
            let out = match st.out.remove(&r) {
                Some(Dial::Ready { conn, .. }) => Some(conn),
                Some(Dial::Dialing) => {
                    st.out.insert(r, Dial::Dialing);
                    None
                }
                None => None,
            };
            (out, st.incoming.remove(&r))
        };
        tracing::info!("rank {r}: {reason}");
        for c in out.iter().chain(incoming.iter()) {
            c.shut(&reason);
        }
        self.changed.notify_all();
    }

    fn back(&self, r: u32) {
        let mut st = self.lock();
        st.known.insert(r);
        if st.gone.remove(&r).is_some() {
            tracing::info!("rank {r} published again");
            self.changed.notify_all();
        }
    }
}

impl World {
    /// Joins job `opts.job` as `rank` of `size`: listens, publishes this
    /// rank's endpoint, and starts accepting and watching.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rank outside the job; what
    /// listening or publishing fails with.
    pub fn join(domain: &Domain, rank: u32, size: u32, rdv: Arc<dyn Rendezvous>, opts: WorldOptions) -> Result<World> {
        if rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} of a job of {size}")));
        }
        let listener = domain.listen(opts.listen.as_str())?;
        let endpoint = listener.endpoint()?;
        let interrupt = listener.interrupt_handle();
        let inner = Arc::new(WorldInner {
            rank,
            size,
            domain: domain.clone(),
            opts,
            rdv: Arc::clone(&rdv),
            state: Mutex::new(WorldState::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            watch_failing: Mutex::new(None),
        });
        let prefix = format!("{}/rank/", inner.opts.job);
        let watch = Arc::clone(&rdv).watch(&prefix)?;
        rdv.publish(&key(&inner.opts.job, rank), &endpoint.to_bytes())?;
        let accepting = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name("gpu-rdma-world-accept".into())
                .spawn(move || accept_loop(&inner, &listener))?
        };
        let watching = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new().name("gpu-rdma-world-watch".into()).spawn(move || {
                while !inner.stop.load(Ordering::Acquire) {
                    let failing = watch.failing();
                    let mut was = inner.watch_failing.lock().unwrap_or_else(|e| e.into_inner());
                    if *was != failing {
                        match &failing {
                            Some(why) => tracing::warn!(
                                "the rendezvous cannot be watched ({why}): ranks that leave go unnoticed until it can"
                            ),
                            None => tracing::info!("the rendezvous can be watched again"),
                        }
                        *was = failing;
                    }
                    drop(was);
                    match watch.next_timeout(Duration::from_millis(100)) {
                        Some(Change::Removed { key }) => {
                            // Only ranks of this job: what a store says of others is not kept.
                            let rank = rank_of(&inner.opts.job, key.as_bytes()).filter(|&r| r < inner.size);
                            if let Some(r) = rank.filter(|&r| r != inner.rank) {
                                inner.gone(r, format!("rank {r} left the rendezvous (it left, or its lease expired)"));
                            }
                        }
                        Some(Change::Put { key, .. }) => {
                            if let Some(r) = rank_of(&inner.opts.job, key.as_bytes()).filter(|&r| r < inner.size) {
                                inner.back(r);
                            }
                        }
                        None => {}
                    }
                }
            })?
        };
        Ok(World { inner, interrupt, threads: vec![accepting, watching] })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.inner.rank
    }

    /// How many ranks the job has.
    pub fn size(&self) -> u32 {
        self.inner.size
    }

    /// Why this rank cannot see other ranks leave right now (its
    /// rendezvous cannot be watched: listed, for a store without watches
    /// of its own), or `None` while it can. Said once in the log when it
    /// starts and when it ends; dialing still looks ranks up directly.
    pub fn watch_failing(&self) -> Option<String> {
        self.inner.watch_failing.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The connection this rank dialed to `rank`, dialed now if there is
    /// none (or the one there broke).
    ///
    /// # Errors
    /// [`Error::PeerGone`] when the rank left the rendezvous;
    /// [`Error::Timeout`] when it did not publish in time; what the
    /// handshake fails with.
    pub fn peer(&self, rank: u32) -> Result<Arc<Connection>> {
        let inner = &self.inner;
        self.check(rank)?;
        let until = Instant::now() + inner.opts.lookup_timeout + inner.opts.connect.handshake_timeout;
        let mut st = inner.lock();
        loop {
            if let Some(reason) = st.gone.get(&rank).cloned() {
                // Back already (a watch may report it later, or never)?
                drop(st);
                if inner.rdv.lookup(&key(&inner.opts.job, rank), Duration::ZERO).is_err() {
                    return Err(Error::PeerGone { name: key(&inner.opts.job, rank), reason });
                }
                inner.back(rank);
                st = inner.lock();
                continue;
            }
            st.clock += 1;
            let now = st.clock;
            match st.out.get_mut(&rank) {
                Some(Dial::Ready { conn, used }) if conn.broken().is_none() => {
                    *used = now;
                    return Ok(Arc::clone(conn));
                }
                Some(Dial::Dialing) => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout {
                            what: "another thread's dial to a rank",
                            after: inner.opts.lookup_timeout,
                        });
                    }
                    st = inner
                        .changed
                        .wait_timeout(st, left.min(Duration::from_millis(100)))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                // None, or broken: dial (a restarted peer has a new endpoint).
                _ => {
                    st.out.insert(rank, Dial::Dialing);
                    break;
                }
            }
        }
        drop(st);
        let dialed = self.dial(rank);
        let mut st = inner.lock();
        let out = match dialed {
            Ok(conn) => {
                let conn = Arc::new(conn);
                st.clock += 1;
                let used = st.clock;
                st.out.insert(rank, Dial::Ready { conn: Arc::clone(&conn), used });
                let evicted = evict(&mut st, inner.opts.max_connections);
                drop(st);
                drop(evicted);
                Ok(conn)
            }
            Err(e) => {
                st.out.remove(&rank);
                drop(st);
                Err(e)
            }
        };
        inner.changed.notify_all();
        out
    }

    fn check(&self, rank: u32) -> Result<()> {
        if rank >= self.inner.size || rank == self.inner.rank {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: not another rank of this job of {} (this is rank {})",
                self.inner.size, self.inner.rank
            )));
        }
        Ok(())
    }

    fn dial(&self, rank: u32) -> Result<Connection> {
        let inner = &self.inner;
        let name = key(&inner.opts.job, rank);
        let until = Instant::now() + inner.opts.lookup_timeout;
        // Looked up in slices, so a rank seen leaving meanwhile fails the
        // wait at once rather than at its end.
        let bytes = loop {
            let left = until.saturating_duration_since(Instant::now());
            // Whether the rank was seen before this lookup looks: a rank
            // the watch sees arrive while a slow lookup is out (a lookup
            // that looked before it published) has not left.
            let seen_before = inner.lock().known.contains(&rank);
            match inner.rdv.lookup(&name, left.min(Duration::from_millis(200))) {
                Ok(bytes) => break bytes,
                Err(Error::Timeout { .. }) if !left.is_zero() => {
                    let mut st = inner.lock();
                    if !st.gone.contains_key(&rank) && seen_before {
                        // Seen before the lookup and missing from it: it left.
                        st.gone.insert(
                            rank,
                            format!(
                                "rank {rank}'s endpoint is no longer in the rendezvous (it left, or its lease expired)"
                            ),
                        );
                    }
                    if let Some(reason) = st.gone.get(&rank) {
                        return Err(Error::PeerGone { name, reason: reason.clone() });
                    }
                }
                Err(Error::Timeout { .. }) => {
                    return Err(Error::Timeout {
                        what: "a rank to publish its endpoint",
                        after: inner.opts.lookup_timeout,
                    });
                }
                Err(e) => return Err(e),
            }
        };
        inner.lock().known.insert(rank);
        let opts = inner.opts.connect.clone().name(key(&inner.opts.job, inner.rank));
        // The peer says who it is in its handshake: a stale entry, or a
        // port reused by another rank, is not taken for this one. The entry
        // is read again (it may be mid-update) for up to a second.
        let mut bytes = bytes;
        let reread_until = Instant::now() + inner.opts.lookup_timeout.min(Duration::from_secs(1));
        loop {
            let endpoint = Endpoint::from_bytes(&bytes)?;
            let conn = inner.domain.connect(endpoint.addr, &opts)?;
            let found = conn.info().peer_name.clone();
            if rank_of(&inner.opts.job, &found) == Some(rank) {
                return Ok(conn);
            }
            drop(conn);
            let mismatch = Error::PeerMismatch {
                expected: name.clone(),
                found: String::from_utf8_lossy(&found).into_owned(),
                addr: endpoint.addr.to_string(),
            };
            tracing::warn!("{mismatch}");
            let again = loop {
                if Instant::now() >= reread_until {
                    return Err(mismatch);
                }
                std::thread::sleep(Duration::from_millis(100));
                match inner.rdv.lookup(&name, Duration::ZERO) {
                    Ok(b) if b != bytes => break b,
                    _ => {}
                }
            };
            bytes = again;
        }
    }

    /// The connection `rank` dialed to this rank, waiting up to `timeout`
    /// for it to arrive.
    ///
    /// # Errors
    /// [`Error::PeerGone`] when the rank left; [`Error::Timeout`].
    pub fn accepted(&self, rank: u32, timeout: Duration) -> Result<Arc<Connection>> {
        self.check(rank)?;
        let inner = &self.inner;
        let until = Instant::now() + timeout;
        let mut st = inner.lock();
        loop {
            if let Some(reason) = st.gone.get(&rank) {
                return Err(Error::PeerGone { name: key(&inner.opts.job, rank), reason: reason.clone() });
            }
            if let Some(c) = st.incoming.get(&rank).filter(|c| c.broken().is_none()) {
                return Ok(Arc::clone(c));
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: "a rank to connect to this one", after: timeout });
            }
            st = inner
                .changed
                .wait_timeout(st, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Dialed connections in the pool now.
    pub fn pooled(&self) -> usize {
        self.inner.lock().out.values().filter(|o| matches!(o, Dial::Ready { .. })).count()
    }
}

/// Drops the least recently used dialed connections nobody else holds
/// until at most `max` remain; returns them to be dropped unlocked.
fn evict(st: &mut WorldState, max: usize) -> Vec<Arc<Connection>> {
    let mut out = Vec::new();
    while st.out.len() > max {
        let victim = st
            .out
            .iter()
            .filter_map(|(r, o)| match o {
                Dial::Ready { conn, used } if Arc::strong_count(conn) == 1 => Some((*used, *r)),
                _ => None,
            })
            .min();
        let Some((_, r)) = victim else { break };
        if let Some(Dial::Ready { conn, .. }) = st.out.remove(&r) {
            out.push(conn);
        }
    }
    out
}

fn accept_loop(inner: &Arc<WorldInner>, listener: &Listener) {
    let opts = inner.opts.connect.clone().name(key(&inner.opts.job, inner.rank));
    // With a shared secret every accepted peer proved it holds it: a rank
    // that restarted may take its place at once.
    let authenticated = opts.secret.is_some();
    while !inner.stop.load(Ordering::Acquire) {
        match listener.accept(&opts) {
            Ok(conn) => {
                let Some(r) = rank_of(&inner.opts.job, &conn.info().peer_name).filter(|&r| r < inner.size) else {
                    tracing::warn!(
                        "a connection from {:?} that names no rank of this job: closed",
                        conn.info().peer_addr
                    );
                    continue;
                };
                let mut st = inner.lock();
                if !authenticated && st.incoming.get(&r).is_some_and(|old| old.broken().is_none()) {
                    // Anyone can claim a rank: without a secret, a claim does
                    // not displace the rank's live connection.
                    drop(st);
                    tracing::warn!(
                        "a second connection claiming rank {r} (from {:?}) while rank {r}'s connection is live: \
                         refused (set a shared secret to let a restarted rank take over at once)",
                        conn.info().peer_addr
                    );
                    continue;
                }
                let old = st.incoming.insert(r, Arc::new(conn));
                drop(st);
                drop(old);
                inner.changed.notify_all();
            }
            Err(Error::Interrupted { .. }) => return,
            Err(e) => tracing::debug!("accepting a rank's connection: {e}"),
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        self.interrupt.interrupt();
        let _ = self.inner.rdv.remove(&key(&self.inner.opts.job, self.inner.rank));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let mut st = self.inner.lock();
        st.out.clear();
        st.incoming.clear();
    }
}
