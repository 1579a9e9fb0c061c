//! The progress engine: one thread per domain, started on first use, that
//! wakes what awaits operations, so no thread is spent per operation or per
//! connection.
//!
//! - Verbs: it sleeps in poll(2) on the completion channel (and the peer's
//!   socket) of every connection an awaited operation is on; on an event it
//!   re-arms the queue, polls it empty, and the operation table wakes the
//!   waker of each operation that finished. Every few milliseconds it also
//!   polls each watched connection (an event taken by a thread blocked in
//!   a wait is then not missed, and a dead peer's grace runs out).
//! - TCP: the connection's receiver and sender threads complete operations
//!   and wake their wakers themselves; the engine is not involved.
//! - Timers: each awaited operation has one at its timeout, so every
//!   await is bounded; staged GPU operations are looked at on a short timer
//!   while their copies run.
//! - Tasks: completion callbacks run on the engine's thread.

use std::collections::{BTreeMap, VecDeque};
#[cfg(feature = "tokio")]
use std::future::Future as _;
#[cfg(feature = "verbs")]
use std::os::fd::RawFd;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::poll::Bell;

#[cfg(feature = "verbs")]
use super::verbs::VerbsConn;

/// How soon an operation the engine is not told about (a staged GPU
/// operation, whose copies complete on their own) is looked at again.
pub(crate) const LOOK_AGAIN: Duration = Duration::from_micros(200);

/// [`LOOK_AGAIN`] while a copy between the GPU and staging is in flight:
/// a small one ends within about 10 us on an H200.
pub(crate) const LOOK_AGAIN_COPYING: Duration = Duration::from_micros(20);

/// How often watched connections are polled without an event.
#[cfg(feature = "verbs")]
const SWEEP: Duration = Duration::from_millis(5);

/// Work the engine runs on its thread (a completion callback).
pub(crate) trait Task: Send + Sync {
    /// Runs the task; it re-queues itself (through its waker) if not done.
    fn run(self: Arc<Self>);
}

/// A timer's key, to cancel it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct TimerKey(Instant, u64);

impl TimerKey {
    /// When it fires.
    pub(crate) fn at(&self) -> Instant {
        self.0
    }
}

#[derive(Default)]
struct State {
    #[cfg(feature = "verbs")]
    watched: Vec<Watched>,
    timers: BTreeMap<TimerKey, Waker>,
    next_timer: u64,
    tasks: VecDeque<Arc<dyn Task>>,
    stop: bool,
}

#[cfg(feature = "verbs")]
struct Watched {
    conn: Weak<VerbsConn>,
    /// The completion channel's descriptor (owned by the connection; the
    /// engine only polls it while the connection lives).
    channel: RawFd,
    /// The peer's socket, until it has been seen readable once.
    socket: Option<RawFd>,
}

struct EngineShared {
    state: Mutex<State>,
    /// Rung to wake the thread.
    wake: Bell,
}

impl EngineShared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the thread, unless this is the thread: it looks at its tasks
    /// and timers again before it sleeps (see [`run`]), and ringing its own
    /// bell would cost it three system calls (the ring, a poll that returns
    /// at once, the drain).
    fn notify(&self) {
        if !ON_ENGINE.with(std::cell::Cell::get) {
            self.wake.ring();
        }
    }

    fn drain(&self) {
        self.wake.drain();
    }
}

/// A domain's progress engine (see the module documentation).
pub(crate) struct Engine {
    shared: Arc<EngineShared>,
    /// Set once the thread started (on first use).
    thread: std::sync::OnceLock<JoinHandle<()>>,
    /// Held while starting it; a failed start is tried again next time.
    starting: Mutex<()>,
}

/// A handle to queue tasks on an engine from anywhere (a waker).
#[derive(Clone)]
pub(crate) struct EngineHandle {
    shared: Weak<EngineShared>,
}

impl EngineHandle {
    /// Queues `task` to run on the engine's thread; dropped if the engine is gone.
    pub(crate) fn spawn(&self, task: Arc<dyn Task>) {
        if let Some(shared) = self.shared.upgrade() {
            shared.lock().tasks.push_back(task);
            shared.notify();
        }
    }
}

impl Engine {
    /// An engine; its thread starts on first use.
    ///
    /// # Errors
    /// [`std::io::Error`] from eventfd(2).
    pub(crate) fn new() -> std::io::Result<Self> {
        let wake = Bell::new()?;
        Ok(Engine {
            shared: Arc::new(EngineShared { state: Mutex::default(), wake }),
            thread: std::sync::OnceLock::new(),
            starting: Mutex::new(()),
        })
    }

    /// Starts the thread if it is not running; once it is, one atomic
    /// load and no lock (every timer and watch passes here).
    fn ensure_thread(&self) {
        if self.thread.get().is_some() {
            return;
        }
        let _starting = self.starting.lock().unwrap_or_else(|e| e.into_inner());
        if self.thread.get().is_none() {
            let shared = Arc::clone(&self.shared);
            let thread = std::thread::Builder::new().name("gpu-rdma-engine".into());
            match thread.spawn(move || {
                fine_timers();
                run(&shared)
            }) {
                Ok(h) => {
                    let _ = self.thread.set(h);
                }
                Err(e) => tracing::error!("starting the progress engine's thread failed: {e}"),
            }
        }
    }

    pub(crate) fn handle(&self) -> EngineHandle {
        self.ensure_thread();
        EngineHandle { shared: Arc::downgrade(&self.shared) }
    }

    /// Watches `conn`'s completion channel and socket (once per connection).
    #[cfg(feature = "verbs")]
    pub(crate) fn watch(&self, conn: &Arc<VerbsConn>) {
        if !conn.mark_watched() {
            return;
        }
        self.ensure_thread();
        let Some(channel) = conn.channel_fd() else { return };
        self.shared.lock().watched.push(Watched {
            conn: Arc::downgrade(conn),
            channel,
            socket: Some(conn.socket_fd()),
        });
        self.shared.notify();
        #[cfg(feature = "tokio")]
        tokio_watch(conn, channel);
    }

    /// Wakes `waker` at `at` (unless cancelled first).
    pub(crate) fn timer(&self, at: Instant, waker: Waker) -> TimerKey {
        self.ensure_thread();
        let mut st = self.shared.lock();
        st.next_timer += 1;
        let key = TimerKey(at, st.next_timer);
        let earliest = st.timers.keys().next().is_none_or(|k| *k > key);
        st.timers.insert(key, waker);
        drop(st);
        if earliest {
            self.shared.notify();
        }
        key
    }

    /// Cancels a timer (a no-op once it fired).
    pub(crate) fn cancel(&self, key: TimerKey) {
        self.shared.lock().timers.remove(&key);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.notify();
        if let Some(h) = self.thread.take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// In a tokio runtime: a task on it waits for the completion channel
/// through the runtime's reactor (`AsyncFd`), so the operations it
/// finishes wake their futures without a hop through the engine's thread.
/// The engine keeps watching the connection too (its peer socket, its
/// sweeps); both may take an event, and either polls. The task lets go
/// when the connection closes.
#[cfg(all(feature = "tokio", feature = "verbs"))]
fn tokio_watch(conn: &Arc<VerbsConn>, channel: RawFd) {
    use std::task::Poll;
    use tokio::io::Interest;
    use tokio::io::unix::AsyncFd;

    /// The connection's completion channel, with the connection that owns
    /// it: open for as long as this value lives.
    struct Channel(Arc<VerbsConn>, RawFd);
    impl AsRawFd for Channel {
        fn as_raw_fd(&self) -> RawFd {
            self.1
        }
    }

    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    // Registered here, in the runtime's context. A runtime built without
    // IO (no `enable_io`) makes tokio panic: then the engine's thread
    // alone wakes this connection's futures.
    let channel = Channel(Arc::clone(conn), channel);
    let registered = {
        let _in = runtime.enter();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: the descriptor is the completion channel of the
            // connection `Channel` holds an `Arc` of: it stays open, the same
            // description, until the `AsyncFd` (which owns the `Channel`) is
            // dropped, deregistering it first; `as_raw_fd` always returns it.
            unsafe { AsyncFd::register_with_interest(channel, Interest::READABLE) }
        }))
    };
    let fd = match registered {
        Ok(Ok(fd)) => fd,
        Ok(Err(e)) => {
            tracing::debug!("the completion channel stays with the engine's thread: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!("this tokio runtime has no IO driver (enable_io): the engine's thread wakes its futures");
            return;
        }
    };
    let closing = conn.closing();
    runtime.spawn(async move {
        loop {
            let notified = closing.notified();
            let mut notified = std::pin::pin!(notified);
            let go_on = std::future::poll_fn(|cx| {
                if notified.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(false);
                }
                match fd.poll_read_ready(cx) {
                    Poll::Ready(Ok(mut ready)) => {
                        ready.clear_ready();
                        Poll::Ready(true)
                    }
                    Poll::Ready(Err(_)) => Poll::Ready(false),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            if !go_on {
                break;
            }
            fd.get_ref().0.engine_progress(true, false);
        }
        // Deregisters, then lets go of the connection.
        drop(fd);
    });
}

/// What an awaited operation keeps between two looks: its deadline and
/// the engine's timer that wakes its waiter then, or sooner to look again.
/// The one place where awaited operations (single operations, lists,
/// receive rings, notification waits) arm and cancel the engine's timers:
/// the same deadline rule for each. Empty (one word, no allocation) until
/// the first look that does not finish.
#[derive(Default)]
pub(crate) struct AwaitClock(Option<Box<Awaiting>>);

/// Why a look at an awaited operation did not finish it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotYet {
    /// Its waker is registered where a completion will wake it: the timer
    /// only bounds the wait.
    Told,
    /// Nothing will wake it (a copy in flight, a turn at the gate, a ring
    /// written by the peer): look again after this long.
    LookAgain(Duration),
}

impl AwaitClock {
    /// A look did not finish the operation, for `why`. With `bounded`,
    /// [`Error::Timeout`](crate::Error::Timeout) naming `what` once
    /// `timeout` passed since the first such look (or the last
    /// [`restart`](Self::restart)): the clock stops and the operation stays
    /// in flight, to be awaited again. Else `waker` is woken by the
    /// engine's timer at the deadline, or sooner to look again; unbounded
    /// and told, by nothing but the completion.
    pub(crate) fn not_yet(
        &mut self,
        engine: &Engine,
        waker: &Waker,
        why: NotYet,
        bounded: Option<Duration>,
        what: &'static str,
    ) -> crate::error::Result<()> {
        let now = Instant::now();
        let aw = self.0.get_or_insert_with(|| Awaiting::new(now + bounded.unwrap_or_default()));
        if let Some(timeout) = bounded {
            if now >= aw.deadline {
                self.stop(engine);
                return Err(crate::error::Error::Timeout { what, after: timeout });
            }
        }
        let at = match (why, bounded) {
            (NotYet::Told, Some(_)) => Some(aw.deadline),
            (NotYet::Told, None) => None,
            (NotYet::LookAgain(d), Some(_)) => Some(aw.deadline.min(now + d)),
            (NotYet::LookAgain(d), None) => Some(now + d),
        };
        if let Some(at) = at {
            aw.arm(engine, at, waker);
        }
        Ok(())
    }

    /// The operation finished, or is no longer awaited: the timer is
    /// cancelled and the deadline forgotten.
    #[inline]
    pub(crate) fn stop(&mut self, engine: &Engine) {
        if let Some(aw) = self.0.take() {
            aw.disarm(engine);
        }
    }

    /// The operation made progress: its deadline starts again at the next
    /// look that does not finish it.
    pub(crate) fn restart(&mut self, engine: &Engine) {
        self.stop(engine);
    }

    /// How long since the first look that did not finish the operation
    /// (or the last [`restart`](Self::restart)); zero before one.
    pub(crate) fn idle(&self) -> Duration {
        self.0.as_ref().map_or(Duration::ZERO, |aw| aw.since.elapsed())
    }
}

/// An [`AwaitClock`]'s deadline and timer.
struct Awaiting {
    since: Instant,
    deadline: Instant,
    timer: Option<(TimerKey, Waker)>,
}

impl Awaiting {
    fn new(deadline: Instant) -> Box<Self> {
        Box::new(Awaiting { since: Instant::now(), deadline, timer: None })
    }

    /// Has `waker` woken at `at` (replacing the timer if it is for
    /// another time or waker).
    fn arm(&mut self, engine: &Engine, at: Instant, waker: &Waker) {
        if let Some((key, w)) = &self.timer {
            if key.at() == at && w.will_wake(waker) {
                return;
            }
        }
        if let Some((key, _)) = self.timer.take() {
            engine.cancel(key);
        }
        self.timer = Some((engine.timer(at, waker.clone()), waker.clone()));
    }

    /// Cancels the timer.
    fn disarm(self, engine: &Engine) {
        if let Some((key, _)) = self.timer {
            engine.cancel(key);
        }
    }
}

/// Timers on this thread fire within a microsecond of when they are due.
/// Linux lets a sleep run up to the thread's timer slack late (50 us by
/// default), which would turn the engine's 20 us look at a copy in flight
/// into 70; the engine's thread is the library's own, so its slack is
/// the library's to set.
fn fine_timers() {
    // SAFETY: PR_SET_TIMERSLACK takes a value in nanoseconds and changes
    // only the calling thread's timer slack; no memory is passed.
    let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
    if rc != 0 {
        tracing::debug!("the engine's timer slack stays the default: {}", std::io::Error::last_os_error());
    }
}

thread_local! {
    /// Set on an engine's thread (see [`EngineShared::notify`]).
    static ON_ENGINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this is an engine's thread, which serves every connection of
/// its domain: work that takes long per connection is left to that
/// connection's own threads.
pub(crate) fn on_engine() -> bool {
    ON_ENGINE.with(std::cell::Cell::get)
}

/// The engine's thread.
fn run(shared: &EngineShared) {
    ON_ENGINE.with(|on| on.set(true));
    let mut last_sweep = Instant::now();
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        let (tasks, mut fds, timeout) = {
            let mut st = shared.lock();
            if st.stop {
                return;
            }
            while let Some(entry) = st.timers.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            let tasks: Vec<_> = st.tasks.drain(..).collect();
            #[cfg_attr(not(feature = "verbs"), allow(unused_mut))]
            let mut fds = vec![libc::pollfd { fd: shared.wake.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 }];
            #[cfg(feature = "verbs")]
            {
                st.watched.retain(|w| w.conn.strong_count() > 0);
                for w in &st.watched {
                    fds.push(libc::pollfd { fd: w.channel, events: libc::POLLIN, revents: 0 });
                    fds.push(libc::pollfd { fd: w.socket.unwrap_or(-1), events: libc::POLLIN, revents: 0 });
                }
            }
            let mut timeout =
                st.timers.keys().next().map_or(Duration::from_secs(1), |k| k.0.saturating_duration_since(now));
            #[cfg(feature = "verbs")]
            if !st.watched.is_empty() {
                timeout = timeout.min(SWEEP);
            }
            if !st.tasks.is_empty() {
                timeout = Duration::ZERO;
            }
            (tasks, fds, timeout)
        };
        // Wakers and tasks may queue timers or more tasks (without ringing
        // the bell: this is the engine's thread): look again before sleeping.
        let ran = !due.is_empty() || !tasks.is_empty();
        for w in due {
            w.wake();
        }
        for t in tasks {
            t.run();
        }
        if ran {
            continue;
        }
        if crate::poll::wait_fds(&mut fds, timeout.min(Duration::from_secs(1))).is_err() {
            continue;
        }
        if fds[0].revents != 0 {
            shared.drain();
        }
        #[cfg(feature = "verbs")]
        {
            let sweep = last_sweep.elapsed() >= SWEEP;
            if sweep {
                last_sweep = Instant::now();
            }
            let ready: Vec<(Arc<VerbsConn>, bool, bool)> = {
                let mut st = shared.lock();
                let mut out = Vec::new();
                for (i, w) in st.watched.iter_mut().enumerate() {
                    // The list may have grown since the poll set was built.
                    let (chan, sock) = match (fds.get(1 + 2 * i), fds.get(2 + 2 * i)) {
                        (Some(c), Some(s)) if c.fd == w.channel => (c.revents != 0, s.revents != 0),
                        _ => (false, false),
                    };
                    if sock {
                        w.socket = None;
                    }
                    if chan || sock || sweep {
                        if let Some(conn) = w.conn.upgrade() {
                            out.push((conn, chan, sock));
                        }
                    }
                }
                out
            };
            for (conn, chan, sock) in ready {
                conn.engine_progress(chan, sock);
            }
        }
        #[cfg(not(feature = "verbs"))]
        let _ = &mut last_sweep;
        fds.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slack of every engine thread in this process (tests run in
    /// parallel: others may be running), by their names.
    fn engine_slacks() -> Vec<u64> {
        let mut out = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim_end() == "gpu-rdma-engine" {
                // Per thread, though listed only as /proc/PID/timerslack_ns.
                let tid = task.file_name().to_string_lossy().into_owned();
                if let Ok(v) = std::fs::read_to_string(format!("/proc/{tid}/timerslack_ns")) {
                    out.extend(v.trim().parse::<u64>());
                }
            }
        }
        out
    }

    #[test]
    fn the_engine_thread_sleeps_with_a_microsecond_of_timer_slack() {
        let engine = Engine::new().unwrap();
        let _ = engine.handle(); // starts the thread
        let mut seen = Vec::new();
        for _ in 0..200 {
            seen = engine_slacks();
            // Its first act is to set the slack: until then it may show the default.
            if !seen.is_empty() && seen.iter().all(|&ns| ns == 1_000) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!seen.is_empty(), "no engine thread found in /proc/self/task");
        assert!(seen.iter().all(|&ns| ns == 1_000), "engine threads' timer slack (ns): {seen:?}");
    }
}
