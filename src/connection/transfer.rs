//! The transfer engine: one handle for a list of pieces between one local
//! buffer and one remote range, of any length. The list is planned whole
//! ([`plan`](crate::protocol::list::plan): checked, coalesced, split), then
//! posted in chains of requests with only the last of each signaled, as
//! many chains in flight as the send queue holds, more posted whenever the
//! handle is waited on or polled.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::{ConnShared, Connection};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalParts, LocalSlice, RemoteSlice};
use crate::ops::{OpId, WaitError};
use crate::protocol::list::{self, Cursor, ListPlan, Piece};
use crate::protocol::notify::{self, NotifyStatus};
use crate::protocol::order::Place;
use crate::transport::engine::{Awaiting, LOOK_AGAIN};
use crate::transport::{Posted, RemoteOp, WorkItem};
use crate::{HostMemory, Region};

/// What a transfer list does with its pieces (a striped transfer too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    Write,
    Read,
}

/// What a finished transfer moved ([`Transfer::wait`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Transferred {
    /// Bytes moved.
    pub bytes: u64,
    /// Requests on the wire, after adjacent pieces were merged and long
    /// ones split.
    pub requests: usize,
    /// Posts (chains of requests, one signaled completion each).
    pub posts: usize,
}

/// A transfer list's state, behind its handle ([`Transfer`]) and driven by
/// whoever gets to it: a waiter, a poll, or the domain's engine.
struct List<B: Send + 'static> {
    shared: Arc<ConnShared>,
    buf: Option<B>,
    local: LocalParts,
    remote: RemoteSlice,
    direction: Direction,
    /// The checked, merged pieces, split into requests as they are posted.
    plan: ListPlan,
    /// The next request to post.
    next: Cursor,
    /// Requests per post.
    chain: usize,
    /// Posted chains (and the notification), oldest first.
    in_flight: VecDeque<OpId>,
    /// Reused for each post.
    items: Vec<WorkItem>,
    /// The first error, until handed out.
    error: Option<Error>,
    /// An error was seen: nothing more is posted.
    failed: bool,
    /// The error was handed out.
    reported: bool,
    done: Transferred,
    bytes: u64,
    /// Runs once everything succeeded (a GPU read's flush).
    after: Option<Box<dyn FnOnce() -> Result<()> + Send>>,
    /// The notification to send after the last piece.
    note: Option<NoteOut>,
    /// While awaited as a future: its deadline and timer.
    awaiting: Option<Box<Awaiting>>,
    /// Wakes the engine's task for this list (registered on the oldest post
    /// in flight, or on a short timer while staged copies run).
    driver: Option<Waker>,
    /// A future awaiting the list, woken when the engine moved it.
    awaiter: Option<Waker>,
    /// Staged GPU memory: the pieces go through the staging pipeline.
    #[cfg(feature = "cuda")]
    staged: Option<StagedPieces>,
    /// Its place at the connection's gate, until its last request (the
    /// notification's, if any) is handed to the transport: what was posted
    /// before it takes effect first, what is posted after it waits.
    turn: Option<Place>,
    /// GPU memory on a direct path: whether the fences of the work
    /// producing (or still reading) it are done; nothing is posted before.
    /// Looked at, never waited on.
    #[cfg(feature = "cuda")]
    ready: Option<crate::protocol::order::DataReady>,
}

/// The pieces of a list on staged GPU memory in progress: one staging
/// pipeline per piece (copies overlapping the network), a few at a time.
#[cfg(feature = "cuda")]
struct StagedPieces {
    device: crate::cuda::CudaDevice,
    active: Vec<crate::protocol::staged::ListPiece>,
    /// Pipelines at once.
    width: usize,
    /// When a piece last started or finished.
    progress: Instant,
    /// The fences every piece's copies wait for, on the GPU.
    fences: Vec<Arc<crate::cuda::CudaEvent>>,
}

/// A notification on its way out.
struct NoteOut {
    tag: u32,
    /// The encoded message (once the list is planned: it names the ranges
    /// the list writes).
    msg: Vec<u8>,
    /// Its payload, until encoded.
    payload: Vec<u8>,
    /// Posted (or given up on): nothing more to send.
    sent: bool,
    /// Its request, while in flight.
    id: Option<OpId>,
    /// The registered buffer its record is written from.
    region: Option<Region<HostMemory>>,
    /// Since when it waits for room in the peer's ring.
    ring_wait: Option<Instant>,
    /// The length of a payload past the limit: the list is refused.
    too_long: Option<usize>,
}

/// Notification buffers kept per connection for reuse.
const NOTE_POOL: usize = 16;

/// A transfer list in flight: see [`Connection::write_list`].
///
/// The domain's engine keeps it going: as posts complete, more of the list
/// is posted, with nobody waiting (and the notification after the last
/// piece). Waiting on it, polling it or awaiting it (it is a future) moves
/// it along too. Dropping it before it is done is safe: nothing more is
/// posted, and the buffer stays with the connection until the device is
/// done with everything that was.
#[must_use = "a transfer list's outcome and buffer come back through its Transfer"]
pub struct Transfer<B: Send + 'static> {
    list: Arc<Mutex<List<B>>>,
    driver: Arc<Driver<B>>,
}

/// The engine's task for one list: holds it weakly, so dropping the
/// handle drops the list (and the task finds nothing to do).
///
/// A wake that finds the list held by a waiter is not lost: it is left
/// in `asked`, and whoever holds the list catches up when letting go
/// ([`HeldBuffers`]'s drop), or the task itself when the list is free. A catch-up
/// drives once: asked again meanwhile, it hands the next turn to the
/// engine rather than driving on (on a device that finishes requests as
/// fast as they are posted, such as soft-RoCE, driving on could post and
/// reap the whole list in the thread of a caller who only polled).
struct Driver<B: Send + 'static> {
    list: std::sync::Weak<Mutex<List<B>>>,
    engine: crate::transport::engine::EngineHandle,
    asked: std::sync::atomic::AtomicBool,
}

impl<B: Send + 'static> Driver<B> {
    /// Drives the list once if a drive was asked for and it is free (if
    /// it is held, its holder catches up when letting go); asked again
    /// meanwhile, leaves the next drive to the engine.
    fn catch_up(self: &Arc<Self>) {
        use std::sync::atomic::Ordering::SeqCst;
        use std::task::Wake;
        // Every release of a held list passes here: most were asked nothing.
        if !self.asked.load(SeqCst) {
            return;
        }
        let Some(list) = self.list.upgrade() else { return };
        let Ok(mut l) = list.try_lock() else { return };
        self.asked.store(false, SeqCst);
        l.drive();
        drop(l);
        if self.asked.load(SeqCst) {
            Arc::clone(self).wake();
        }
    }
}

impl<B: Send + 'static> std::task::Wake for Driver<B> {
    fn wake(self: Arc<Self>) {
        let engine = self.engine.clone();
        engine.spawn(self);
    }
}

impl<B: Send + 'static> crate::transport::engine::Task for Driver<B> {
    fn run(self: Arc<Self>) {
        self.asked.store(true, std::sync::atomic::Ordering::SeqCst);
        self.catch_up();
    }
}

/// The list, locked by a handle; on release, drives the engine asked for
/// meanwhile.
struct HeldBuffers<'a, B: Send + 'static> {
    guard: Option<MutexGuard<'a, List<B>>>,
    task: &'a Arc<Driver<B>>,
}

impl<B: Send + 'static> std::ops::Deref for HeldBuffers<'_, B> {
    type Target = List<B>;
    fn deref(&self) -> &List<B> {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<B: Send + 'static> std::ops::DerefMut for HeldBuffers<'_, B> {
    fn deref_mut(&mut self) -> &mut List<B> {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<B: Send + 'static> Drop for HeldBuffers<'_, B> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.task.catch_up();
    }
}

impl<B: Send + 'static> Transfer<B> {
    fn new(list: List<B>) -> Self {
        let engine = list.shared.domain.engine().handle();
        let list = Arc::new(Mutex::new(list));
        let driver = Arc::new(Driver { list: Arc::downgrade(&list), engine, asked: Default::default() });
        let t = Transfer { list, driver: Arc::clone(&driver) };
        {
            let mut l = t.lock();
            let driver = Waker::from(driver);
            if let Some(turn) = l.turn {
                // Woken when the operations in front of it are out.
                l.shared.gate.set_waker(turn, &driver);
            }
            l.driver = Some(driver);
            l.arm();
        }
        t
    }

    fn lock(&self) -> HeldBuffers<'_, B> {
        HeldBuffers { guard: Some(self.list.lock().unwrap_or_else(|e| e.into_inner())), task: &self.driver }
    }

    /// Runs `f` on the list, then leaves the engine armed.
    fn with<T>(&self, f: impl FnOnce(&mut List<B>) -> T) -> T {
        let mut l = self.lock();
        let out = f(&mut l);
        l.arm();
        out
    }

    /// Waits until all of the list has landed (or failed). Bounded by the
    /// connection's operation timeout without progress: each wait for the
    /// oldest post in flight is.
    ///
    /// # Errors
    /// The first error: [`Error::OutOfBounds`] (nothing was posted),
    /// an operation's [`Error::Completion`], [`Error::ConnectionLost`]; once
    /// an error is seen nothing more is posted, and the wait returns only
    /// when what was posted is done. [`Error::Timeout`] when no post
    /// finished within the operation timeout: still in flight, and may be
    /// waited on again.
    pub fn wait(&mut self) -> Result<Transferred> {
        self.with(List::wait)
    }

    /// Waits up to `timeout` in all.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Transferred> {
        self.with(|l| l.wait_timeout(timeout))
    }

    /// Posts what fits, then waits for one post in flight: `Some` once all
    /// of it is done. For a caller that keeps several lists going on one
    /// thread.
    pub(crate) fn wait_step(&mut self, total: Option<Duration>) -> Result<Option<Transferred>> {
        self.with(|l| l.wait_step(total))
    }

    /// Posts what fits and takes what finished, without blocking: `Some`
    /// once all of the list is done.
    ///
    /// # Errors
    /// As [`wait`](Self::wait), without the timeout.
    pub fn poll(&mut self) -> Result<Option<Transferred>> {
        self.with(List::poll)
    }

    /// Whether all of it is done (as far as the last look saw).
    pub fn is_done(&self) -> bool {
        self.lock().settled()
    }

    /// Bytes the list moves (after checking; 0 if it was refused).
    pub fn len(&self) -> u64 {
        self.lock().bytes
    }

    /// Whether the list moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.lock().bytes == 0
    }

    /// Waits, then returns what moved and the buffer, which comes back on
    /// error too.
    ///
    /// # Errors
    /// [`Failed`], with the error and the buffer (`None` only when a
    /// timeout left the list in flight: the buffer then stays with the
    /// connection until the device is done). It converts into [`Error`],
    /// so `?` works in a function returning [`crate::Result`].
    pub fn finish(self) -> std::result::Result<(Transferred, B), Failed<B>> {
        self.with(List::finish)
    }
}

/// What a wait on a transfer is for, in its timeout error.
const WHAT: &str = "a transfer list to complete";

impl Connection {
    /// Writes a list of pieces of `local` into `remote`: piece `p` moves
    /// `p.len` bytes from offset `p.local` of `local` to offset `p.remote`
    /// of `remote`. Any number of pieces: adjacent ones (contiguous on both
    /// sides) are merged, ones longer than a message are split, and the
    /// list is posted as fast as the send queue takes it. One handle for
    /// all of it; the buffer comes back when all of it is done.
    ///
    /// The whole list is checked before anything is posted: a piece
    /// outside either range fails the transfer with
    /// [`Error::OutOfBounds`] and moves nothing.
    pub fn write_list<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        remote: &RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
    ) -> Transfer<B> {
        Transfer::new(List::start(self, local.into(), *remote, pieces, Direction::Write, None))
    }

    /// [`write_list`](Self::write_list), then a notification for the
    /// peer's [`Inbox`](crate::Inbox): `tag` and `payload` (at most
    /// [`MAX_NOTIFY_PAYLOAD`](crate::MAX_NOTIFY_PAYLOAD) bytes), posted
    /// after the last piece, so the peer sees it only once every piece has
    /// landed. If the list fails, the peer's wait for `tag` fails too
    /// ([`Error::PeerTransferFailed`], or the connection lost): at once, not
    /// at its timeout. An empty list sends just the notification.
    ///
    /// A longer payload fails the list before anything is posted
    /// ([`Error::NotifyPayloadTooLarge`]).
    pub fn write_list_notify<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        remote: &RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
        tag: u32,
        payload: &[u8],
    ) -> Transfer<B> {
        let too_long = (payload.len() > notify::MAX_NOTIFY_PAYLOAD).then_some(payload.len());
        let payload = if too_long.is_some() { Vec::new() } else { payload.to_vec() };
        let note =
            NoteOut { tag, msg: Vec::new(), payload, sent: false, id: None, region: None, ring_wait: None, too_long };
        Transfer::new(List::start(self, local.into(), *remote, pieces, Direction::Write, Some(note)))
    }

    /// Reads a list of pieces of `remote` into `local`: as
    /// [`write_list`](Self::write_list), the other way.
    pub fn read_list<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        remote: &RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
    ) -> Transfer<B> {
        Transfer::new(List::start(self, local.into(), *remote, pieces, Direction::Read, None))
    }
}

impl<B: LocalBuffer> List<B> {
    fn start(
        conn: &Connection,
        local: LocalSlice<B>,
        remote: RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
        direction: Direction,
        note: Option<NoteOut>,
    ) -> Self {
        let shared = &conn.shared;
        let info = &shared.info;
        let depth = info.send_queue_depth.max(1) as usize;
        let mut t = List {
            shared: Arc::clone(shared),
            buf: None,
            local: LocalParts { addr: 0, len: 0, lkey: 0, domain: 0, path: None },
            remote,
            direction,
            plan: ListPlan::default(),
            next: Cursor::default(),
            // Several chains fit the queue at once, so one completes while
            // the next are on the wire.
            chain: (depth / 4).clamp(1, 64),
            in_flight: VecDeque::new(),
            items: Vec::new(),
            error: None,
            failed: false,
            reported: false,
            done: Transferred::default(),
            bytes: 0,
            after: None,
            note,
            awaiting: None,
            driver: None,
            awaiter: None,
            #[cfg(feature = "cuda")]
            staged: None,
            turn: None,
            #[cfg(feature = "cuda")]
            ready: None,
        };
        if let Some(len) = t.note.as_ref().and_then(|n| n.too_long) {
            // A caller's bug: nothing moves (the peer hears of the failure).
            t.buf = Some(local.into_inner());
            t.fail(Error::NotifyPayloadTooLarge { len: len as u64, max: notify::MAX_NOTIFY_PAYLOAD as u64 });
            return t;
        }
        let parts = match local.resolve() {
            Ok(p) => p,
            Err(e) => {
                t.buf = Some(local.into_inner());
                t.fail(e);
                return t;
            }
        };
        t.local = parts;
        // One request per planned piece: at most a message, and what one
        // scatter entry holds.
        let max_piece = info.max_message_size.min(u64::from(u32::MAX));
        match list::plan(pieces, parts.len as u64, remote.len(), max_piece) {
            Ok(plan) => {
                t.bytes = plan.bytes;
                if let Some(note) = t.note.as_mut() {
                    // The notification names what the list writes, for the
                    // peer to make visible before it hands the note out.
                    let base = remote.addr();
                    let cover = notify::Cover::of(remote.rkey(), plan.remote_ranges().map(|(o, l)| (base + o, l)));
                    notify::encode(NotifyStatus::Done, &cover, &note.payload, &mut note.msg);
                    note.payload = Vec::new();
                }
                t.plan = plan;
            }
            Err(e) => t.fail(e),
        }
        #[cfg(feature = "cuda")]
        if !t.failed {
            if let Err(e) = t.prepare_gpu(&local, parts) {
                t.fail(e);
            }
        }
        t.buf = Some(local.into_inner());
        t.items.reserve(t.chain.min(t.plan.requests()));
        if !t.failed {
            t.turn = Some(t.shared.gate.hold(None));
        }
        t.pump();
        t
    }

    /// GPU memory: only a direct path (the NIC reaches the memory) is
    /// listed; the producer's fence is waited for before anything is
    /// posted, and a read flushes before it reports success.
    #[cfg(feature = "cuda")]
    fn prepare_gpu(&mut self, local: &LocalSlice<B>, parts: LocalParts) -> Result<()> {
        use crate::protocol::{Route, route};
        if parts.path.is_none() {
            return Ok(());
        }
        let Some(cuda) = local.buffer().cuda() else {
            return Err(Error::InvalidArgument("GPU path without a GPU buffer".into()));
        };
        // The producers' fences (outgoing) or the consumers' (incoming), once
        // for the whole list, before any byte moves: on the GPU before each
        // staged piece's copies, looked at before a direct post.
        if route(&parts, self.shared.transport.is_tcp()) == Route::Staged {
            let width = self.shared.staging.1.max(1);
            // Its pieces take effect in the list's turn (taken once planned).
            self.staged = Some(StagedPieces {
                device: cuda.device().clone(),
                active: Vec::new(),
                width,
                progress: Instant::now(),
                fences: cuda.fences(),
            });
            return Ok(());
        }
        self.ready = super::fences_pending(cuda);
        if self.direction == Direction::Read {
            let device = cuda.device().clone();
            self.after = Some(Box::new(move || device.flush_remote_writes()));
        }
        Ok(())
    }
}

impl<B: Send + 'static> List<B> {
    /// Posts what the send queue takes now, without waiting: at most a
    /// queue's worth, so a poll stays short even where the device finishes
    /// requests as fast as they are posted.
    fn pump(&mut self) {
        #[cfg(feature = "cuda")]
        if self.staged.is_some() {
            self.pump_staged();
            return;
        }
        let depth = self.shared.info.send_queue_depth.max(1) as usize;
        for _ in 0..depth.div_ceil(self.chain) {
            if !self.post_chain(Deadline::immediate("room in the send queue")) {
                break;
            }
        }
        if !self.failed && self.plan.done(&self.next) {
            self.post_note(Deadline::immediate("room in the send queue"));
        }
        self.release_turn_if_done();
    }

    /// Whether the list's requests may go to the transport now: everything
    /// posted before it on the connection has handed over its last request,
    /// and the GPU work its data waits for is done (looked at, not waited
    /// on: while it runs, the list is looked at again later).
    fn my_turn(&mut self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(ready) = self.ready.as_mut() {
            match ready() {
                Ok(false) => return false,
                Ok(true) => self.ready = None,
                Err(e) => {
                    self.ready = None;
                    self.fail(e);
                    return false;
                }
            }
        }
        self.turn.is_none_or(|t| self.shared.gate.is_first(t))
    }

    /// Lets the operations posted after the list go, once it handed over
    /// its last request (or never will).
    fn release_turn_if_done(&mut self) {
        let note_out = self.note.as_ref().is_none_or(|n| n.sent);
        #[cfg(feature = "cuda")]
        let pieces_out = self.staged.as_ref().is_none_or(|st| st.active.iter().all(|p| p.all_posted()));
        #[cfg(not(feature = "cuda"))]
        let pieces_out = true;
        if self.failed || (self.plan.done(&self.next) && pieces_out && note_out) {
            self.release_turn();
        }
    }

    fn release_turn(&mut self) {
        if let Some(t) = self.turn.take() {
            self.shared.gate.release(t, Some(&self.shared.transport));
        }
    }

    /// Staged GPU memory: moves the pipelines along, takes the finished
    /// ones, starts more; the notification once every piece is done.
    #[cfg(feature = "cuda")]
    fn pump_staged(&mut self) {
        use crate::protocol::staged::{Gather, GatherPiece, ListPiece, Pipeline};
        let Some(mut st) = self.staged.take() else { return };
        // Pieces start in the list's turn at the connection's gate.
        let turn = self.my_turn();
        let shared = Arc::clone(&self.shared);
        let t = &shared.transport;
        let mut error = None;
        let mut i = 0;
        while i < st.active.len() {
            let p = &mut st.active[i];
            if let Err(e) = p.advance(t) {
                // A CUDA failure: what is on the network stays with the connection.
                p.abandon(t, None);
                st.active.swap_remove(i);
                error.get_or_insert(e);
                continue;
            }
            if p.finished() {
                if let Err(e) = p.outcome() {
                    error.get_or_insert(e);
                }
                st.active.swap_remove(i);
                st.progress = Instant::now();
                continue;
            }
            i += 1;
        }
        let (chunk, depth) = self.shared.staging;
        // Small pieces go in groups: one slot, one copy event and one post
        // (a chain) per group, rather than a pipeline each.
        let small = (chunk / 4).max(4096) as u64;
        let max_group = (self.shared.info.send_queue_depth as usize).clamp(1, 64);
        while turn && error.is_none() && !self.failed && st.active.len() < st.width {
            let mut peek = self.next;
            let Some(p) = self.plan.next(&mut peek) else { break };
            if let (true, Some(turn)) = (p.len <= small && max_group > 1, self.turn) {
                let mut group = Vec::new();
                let mut total = 0u64;
                loop {
                    let mut peek = self.next;
                    match self.plan.next(&mut peek) {
                        Some(q) if q.len <= small && total + q.len <= chunk as u64 && group.len() < max_group => {
                            total += q.len;
                            group.push(GatherPiece {
                                gpu: self.local.addr + q.local,
                                len: q.len as usize,
                                remote: self.remote.sub(q.remote, q.len),
                            });
                            self.next = peek;
                        }
                        _ => break,
                    }
                }
                let write = self.direction == Direction::Write;
                let home = self.shared.domain.staging();
                let timeout = self.shared.op_timeout;
                let count = group.len();
                let made = Gather::new(
                    write,
                    home,
                    &st.device,
                    group,
                    chunk,
                    st.fences.clone(),
                    &self.shared.gate,
                    turn,
                    timeout,
                );
                match made {
                    Ok(g) => {
                        let mut piece = ListPiece::Many(g);
                        match piece.advance(t) {
                            Ok(()) => st.active.push(piece),
                            Err(e) => {
                                piece.abandon(t, None);
                                error = Some(e);
                            }
                        }
                    }
                    Err(e) => error = Some(e),
                }
                self.done.posts += 1;
                self.done.requests += count;
                st.progress = Instant::now();
                continue;
            }
            self.next = peek;
            let parts = LocalParts { addr: self.local.addr + p.local, len: p.len as usize, ..self.local };
            let remote = self.remote.sub(p.remote, p.len);
            let op = match self.direction {
                Direction::Write => RemoteOp::Write(remote),
                Direction::Read => RemoteOp::Read(remote),
            };
            let home = self.shared.domain.staging();
            let made = Pipeline::new(Some(op), home, &st.device, parts, chunk, depth, self.shared.op_timeout);
            match made.map(|mut p| {
                p.after(st.fences.clone());
                match self.turn {
                    Some(turn) => p.in_turn_of(&self.shared.gate, turn),
                    None => p,
                }
            }) {
                Ok(mut pipeline) => {
                    let started = pipeline.advance(t);
                    match started {
                        Ok(()) => st.active.push(ListPiece::One(pipeline)),
                        Err(e) => {
                            pipeline.abandon(t, None);
                            error = Some(e);
                        }
                    }
                }
                Err(e) => error = Some(e),
            }
            self.done.posts += 1;
            self.done.requests += 1;
            st.progress = Instant::now();
        }
        let idle = st.active.is_empty();
        self.staged = Some(st);
        if let Some(e) = error {
            self.fail(e);
        }
        // After every piece has landed: the pipelines post their writes over
        // time, so the notification waits for all of them to finish.
        if !self.failed && self.plan.done(&self.next) && idle {
            self.post_note(Deadline::immediate("room in the send queue"));
        }
        self.release_turn_if_done();
    }

    /// Staged pieces still in progress.
    fn staged_active(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.staged.as_ref().map_or(0, |s| s.active.len());
        #[cfg(not(feature = "cuda"))]
        0
    }

    /// Waits a moment for staged pieces: on a network step of one of them,
    /// else briefly (a copy finishes by itself:
    /// [`look_again`](super::pending::look_again)). [`Error::Timeout`] after the
    /// operation timeout without a piece starting or finishing.
    #[cfg(feature = "cuda")]
    fn nap_staged(&mut self) -> Result<()> {
        let Some(st) = self.staged.as_ref() else { return Ok(()) };
        if st.progress.elapsed() > self.shared.op_timeout {
            return Err(Error::Timeout { what: WHAT, after: self.shared.op_timeout });
        }
        let copying = st.active.iter().any(crate::protocol::staged::ListPiece::copying);
        if copying && st.progress.elapsed() < self.shared.spin {
            // Within the spin window after a piece last started or finished:
            // the caller looks at the copies and the network again at once.
            super::pending::look_again(true);
            return Ok(());
        }
        match st.active.iter().find_map(crate::protocol::staged::ListPiece::waiting_on) {
            Some(id) => {
                let slice = super::pending::staged_slice(copying);
                match self.shared.transport.wait(id, &mut Deadline::lazy(slice, WHAT)) {
                    Ok(()) | Err(Error::Timeout { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            None => {
                super::pending::look_again(false);
                Ok(())
            }
        }
    }

    /// Posts the notification, up to `due`. Whether it is out (or there
    /// is none to send).
    fn post_note(&mut self, due: Deadline) -> bool {
        if !self.my_turn() {
            return false;
        }
        let immediate = due.is_immediate();
        let Some(note) = self.note.as_mut().filter(|n| !n.sent) else {
            return true;
        };
        match Self::send_note(&self.shared, note, due) {
            Posted::Ok(id) => {
                note.sent = true;
                note.id = Some(id);
                self.in_flight.push_back(id);
                true
            }
            // The peer has not taken enough of its notes yet: wait for room
            // for up to the operation timeout, looked at again later.
            Posted::Refused(e) if super::notes::ring_full(&e) => {
                let since = *note.ring_wait.get_or_insert_with(Instant::now);
                let timeout = self.shared.op_timeout;
                if since.elapsed() >= timeout {
                    self.fail(Error::Timeout { what: super::notes::RING_ROOM, after: timeout });
                }
                false
            }
            Posted::Refused(e) if immediate && matches!(*e, Error::QueueFull { .. }) => false,
            Posted::Refused(e) => {
                self.fail(*e);
                false
            }
            Posted::Stuck(id, e) => {
                note.sent = true;
                note.id = Some(id);
                self.in_flight.push_back(id);
                self.fail(*e);
                false
            }
        }
    }

    /// Writes `note`'s message into the peer's notification ring, from a
    /// registered buffer of the connection's pool (kept in `note` until it
    /// completes), once the ring has room.
    fn send_note(shared: &ConnShared, note: &mut NoteOut, due: Deadline) -> Posted {
        let region = match note.region.take() {
            Some(r) => Ok(r),
            None => {
                let pooled = shared.note_pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
                pooled.map_or_else(|| shared.domain.alloc(super::notes::OUT_BUFFER), Ok)
            }
        };
        let mut region = match region {
            Ok(r) => r,
            Err(e) => return Posted::refused(e),
        };
        let posted = shared.notes.post(&shared.transport, note.tag, &note.msg, &mut region, due);
        note.region = Some(region);
        posted
    }

    /// Posts the next chain, waiting for room up to `due`. Whether one was
    /// posted (a full queue, with `due` immediate, is not an error).
    fn post_chain(&mut self, due: Deadline) -> bool {
        if self.failed || self.plan.done(&self.next) || !self.my_turn() {
            return false;
        }
        // Taken for good only once posted.
        let mut next = self.next;
        self.items.clear();
        while self.items.len() < self.chain {
            let Some(p) = self.plan.next(&mut next) else { break };
            let local = LocalParts { addr: self.local.addr + p.local, len: p.len as usize, ..self.local };
            let remote = self.remote.sub(p.remote, p.len);
            let op = match self.direction {
                Direction::Write => RemoteOp::Write(remote),
                Direction::Read => RemoteOp::Read(remote),
            };
            self.items.push(WorkItem { local: Some(local), op });
        }
        let immediate = due.is_immediate();
        match self.shared.transport.post_send(&self.items, due) {
            Posted::Ok(id) => {
                self.in_flight.push_back(id);
                self.done.posts += 1;
                self.done.requests += self.items.len();
                self.next = next;
                true
            }
            Posted::Refused(e) if immediate && matches!(*e, Error::QueueFull { .. }) => false,
            Posted::Refused(e) => {
                self.fail(*e);
                false
            }
            Posted::Stuck(id, e) => {
                self.in_flight.push_back(id);
                self.fail(*e);
                false
            }
        }
    }

    /// Records the first error; nothing more is posted. A notification
    /// not yet sent becomes a failure notification, sent at once (best
    /// effort: on a broken connection the peer learns of it anyway).
    fn fail(&mut self, e: Error) {
        if self.failed {
            return;
        }
        self.failed = true;
        if let Some(note) = self.note.as_mut().filter(|n| !n.sent) {
            notify::encode(NotifyStatus::Failed, &notify::Cover::default(), e.to_string().as_bytes(), &mut note.msg);
            note.sent = true;
            // Never waits (this may be the engine's thread): with no room
            // in the send queue or the peer's ring, the peer's wait ends at
            // its own timeout instead.
            match Self::send_note(&self.shared, note, Deadline::immediate("room in the send queue")) {
                Posted::Ok(id) | Posted::Stuck(id, _) => {
                    note.id = Some(id);
                    self.in_flight.push_back(id);
                }
                Posted::Refused(why) => {
                    tracing::warn!("a failed list's notification (tag {}) could not go out: {why}", note.tag);
                }
            }
        }
        self.error = Some(e);
        // Nothing more of it goes out: what was posted after it may.
        self.release_turn();
    }

    /// Records a chain's outcome.
    fn record(&mut self, outcome: crate::ops::OpOutcome) {
        let id = self.in_flight.pop_front();
        if let Some(note) = self.note.as_mut().filter(|n| n.id.is_some() && n.id == id) {
            if let Some(region) = note.region.take() {
                let mut pool = self.shared.note_pool.lock().unwrap_or_else(|e| e.into_inner());
                if pool.len() < NOTE_POOL {
                    pool.push(region);
                }
            }
        }
        if let Err(e) = outcome {
            self.fail(*e);
        }
    }

    /// Takes the outcomes of chains already finished, oldest first, polling once.
    fn reap(&mut self) {
        while let Some(&id) = self.in_flight.front() {
            match self.shared.transport.poll_take(id) {
                Ok(Some(outcome)) => self.record(outcome),
                Ok(None) => return,
                Err(e) => {
                    self.fail(e);
                    return;
                }
            }
        }
    }

    /// Whether nothing is in flight and nothing more will be posted.
    fn settled(&self) -> bool {
        let note_out = self.note.as_ref().is_none_or(|n| n.sent);
        self.in_flight.is_empty()
            && self.staged_active() == 0
            && (self.failed || (self.plan.done(&self.next) && note_out))
    }

    /// The outcome of a settled transfer (an error is handed out once).
    fn outcome(&mut self) -> Result<Transferred> {
        if let Some(e) = self.error.take() {
            self.reported = true;
            return Err(e);
        }
        if self.reported {
            return Err(Error::AlreadyReported);
        }
        if let Some(after) = self.after.take() {
            if let Err(e) = after() {
                self.failed = true;
                self.reported = true;
                return Err(e);
            }
        }
        Ok(Transferred { bytes: self.bytes, ..self.done })
    }

    /// [`Transfer::wait`].
    fn wait(&mut self) -> Result<Transferred> {
        self.wait_inner(None)
    }

    /// [`Transfer::wait_timeout`].
    fn wait_timeout(&mut self, timeout: Duration) -> Result<Transferred> {
        self.wait_inner(Some(timeout))
    }

    fn wait_inner(&mut self, total: Option<Duration>) -> Result<Transferred> {
        let started = Instant::now();
        loop {
            let left = match total {
                Some(t) if started.elapsed() >= t => return Err(Error::Timeout { what: WHAT, after: t }),
                Some(t) => Some(t - started.elapsed()),
                None => None,
            };
            if let Some(done) = self.wait_step(left)? {
                return Ok(done);
            }
        }
    }

    /// Posts what fits, then waits for one post in flight to finish
    /// (bounded as [`wait_timeout`](Self::wait_timeout) with `total`, or
    /// the operation timeout): `Some` once all of it is done. For a caller
    /// that keeps several lists going on one thread.
    pub(crate) fn wait_step(&mut self, total: Option<Duration>) -> Result<Option<Transferred>> {
        let started = total.map(|t| (Instant::now(), t));
        let mut waited = false;
        loop {
            self.pump();
            self.reap();
            if self.settled() {
                return self.outcome().map(Some);
            }
            if waited {
                return Ok(None);
            }
            waited = true;
            let slice = match started {
                Some((at, t)) => {
                    let left = t.saturating_sub(at.elapsed());
                    if left.is_zero() {
                        return Err(Error::Timeout { what: WHAT, after: t });
                    }
                    left.min(self.shared.op_timeout)
                }
                None => self.shared.op_timeout,
            };
            #[cfg(feature = "cuda")]
            if self.staged_active() > 0 {
                match self.nap_staged() {
                    Err(e @ Error::Timeout { .. }) => return Err(e),
                    Err(e) => self.fail(e),
                    Ok(()) => {}
                }
                continue;
            }
            let Some(&id) = self.in_flight.front() else {
                // Nothing of ours in flight, and the queue full of other
                // operations: wait for room, as any post does.
                let due = Deadline::lazy(slice, "room in the send queue");
                if !self.plan.done(&self.next) {
                    self.post_chain(due);
                } else {
                    self.post_note(due);
                }
                continue;
            };
            let mut due = Deadline::lazy(slice, WHAT);
            match self.shared.transport.wait_take(id, &mut due) {
                Ok(c) => self.record(Ok(c)),
                Err(WaitError::Failed(e)) => self.record(Err(e)),
                Err(WaitError::Unfinished(e)) if matches!(*e, Error::Timeout { .. }) => return Err(*e),
                Err(WaitError::Unfinished(e)) => self.fail(*e),
            }
        }
    }

    /// [`Transfer::poll`].
    fn poll(&mut self) -> Result<Option<Transferred>> {
        self.pump();
        self.reap();
        if self.settled() { self.outcome().map(Some) } else { Ok(None) }
    }

    /// Waits, then hands out what moved and the buffer.
    fn finish(&mut self) -> std::result::Result<(Transferred, B), Failed<B>> {
        match self.wait() {
            Ok(done) => Ok((done, self.buf.take().expect("the buffer is present until taken"))),
            Err(error) => {
                let buffer = if self.settled() { self.buf.take() } else { None };
                Err(Failed { error, buffer })
            }
        }
    }

    /// Leaves the engine a way back: its waker on the oldest post in flight
    /// (taking outcomes that are already in), or a short timer while staged
    /// copies run or the queue is full of other operations. Wakes an
    /// awaiting future once the list is settled.
    fn arm(&mut self) {
        let Some(driver) = self.driver.clone() else { return };
        let shared = Arc::clone(&self.shared);
        let engine = shared.domain.engine();
        // Where the device finishes requests as fast as they are posted
        // (soft-RoCE), taking outcomes and posting more could go on for the
        // whole list: after a queue's worth, the engine takes over.
        let mut turns = self.shared.info.send_queue_depth.max(1) as usize / self.chain + 1;
        loop {
            if self.settled() {
                if let Some(w) = self.awaiter.take() {
                    w.wake();
                }
                return;
            }
            let front = if self.staged_active() > 0 { None } else { self.in_flight.front().copied() };
            let Some(id) = front.filter(|_| turns > 0) else {
                engine.timer(Instant::now() + LOOK_AGAIN, driver);
                return;
            };
            turns -= 1;
            match shared.transport.poll_register(id, &driver, engine) {
                Ok(Some(outcome)) => {
                    self.record(outcome);
                    self.pump();
                    self.reap();
                }
                Ok(None) => return,
                Err(e) => {
                    self.fail(e);
                    // The same request cannot be asked again: let the engine look later.
                    engine.timer(Instant::now() + LOOK_AGAIN, driver);
                    return;
                }
            }
        }
    }

    /// The engine's turn: post what fits, take what finished, arm again,
    /// and tell an awaiting future.
    fn drive(&mut self) {
        self.pump();
        self.reap();
        self.arm();
        if let Some(w) = &self.awaiter {
            w.wake_by_ref();
        }
    }
}

impl<B: Send + 'static> List<B> {
    /// One look: posts what fits, takes what finished; when not done,
    /// `waker` is registered on the oldest post in flight and a timer armed
    /// at the deadline (the operation timeout without progress).
    fn poll_waker(&mut self, waker: &Waker) -> Poll<Result<Transferred>> {
        let posted = self.next;
        let before = self.in_flight.len();
        self.pump();
        self.reap();
        // The engine's waker goes on the oldest post; this future is woken
        // by the engine whenever it moved the list.
        match &self.awaiter {
            Some(w) if w.will_wake(waker) => {}
            _ => self.awaiter = Some(waker.clone()),
        }
        self.arm();
        if self.settled() {
            self.awaiter = None;
            if let Some(aw) = self.awaiting.take() {
                aw.disarm(self.shared.domain.engine());
            }
            return Poll::Ready(self.outcome());
        }
        let timeout = self.shared.op_timeout;
        if self.next != posted || self.in_flight.len() != before {
            // Progress: the deadline (no progress for the timeout) starts again.
            if let Some(aw) = self.awaiting.take() {
                aw.disarm(self.shared.domain.engine());
            }
        }
        let aw = self.awaiting.get_or_insert_with(|| Awaiting::new(timeout));
        if Instant::now() >= aw.deadline {
            if let Some(aw) = self.awaiting.take() {
                aw.disarm(self.shared.domain.engine());
            }
            return Poll::Ready(Err(Error::Timeout { what: "a transfer list to complete", after: timeout }));
        }
        let at = aw.deadline;
        aw.arm(self.shared.domain.engine(), at, waker);
        Poll::Pending
    }
}

impl<B: Send + Unpin + 'static> Future for Transfer<B> {
    type Output = Result<Transferred>;

    /// Awaits the whole list (bounded by the operation timeout without
    /// progress); the buffer comes back with
    /// [`finish`](Transfer::finish) (at once, once done). Await it by
    /// `&mut` to keep the `Transfer`.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().lock().poll_waker(cx.waker())
    }
}

/// An operation or transfer list failed: the error, and the buffer back
/// ([`Transfer::finish`], [`Pending::into_result`](crate::Pending::into_result)).
/// Converts into [`Error`], so `?` works.
pub struct Failed<B> {
    /// What went wrong.
    pub error: Error,
    /// The buffer; `None` when it is still with the connection (a timeout
    /// with requests in flight).
    pub buffer: Option<B>,
}

impl<B> fmt::Debug for Failed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Failed")
            .field("error", &self.error)
            .field("buffer", &self.buffer.as_ref().map(|_| "returned"))
            .finish()
    }
}

impl<B> fmt::Display for Failed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<B> std::error::Error for Failed<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<Failed<B>> for Error {
    fn from(f: Failed<B>) -> Error {
        f.error
    }
}

impl<B: Send + 'static> List<B> {
    /// What a dropped handle does: nothing more is posted; staged pieces'
    /// copies are waited for (the GPU buffer may go then) and their slots
    /// still on the network stay with the connection; the buffer is freed
    /// now, or, while posts are in flight, held by them and freed by the
    /// last one done. Once is enough: a second call finds nothing to do.
    fn let_go(&mut self) {
        self.failed = true;
        self.release_turn();
        if let Some(aw) = self.awaiting.take() {
            aw.disarm(self.shared.domain.engine());
        }
        let note = self.note.as_mut().and_then(|n| n.region.take());
        #[cfg(feature = "cuda")]
        let copying = self.staged.as_ref().is_some_and(|st| !st.active.is_empty());
        #[cfg(not(feature = "cuda"))]
        let copying = false;
        if self.in_flight.is_empty() && !copying {
            drop((self.buf.take(), note));
            return;
        }
        // Several posts and copies may still read or write the buffer: each
        // holds a share of it, and the last one done drops it.
        let holder = Arc::new(Mutex::new((self.buf.take(), note)));
        #[cfg(feature = "cuda")]
        if let Some(st) = self.staged.as_mut() {
            for mut p in st.active.drain(..) {
                p.abandon(&self.shared.transport, Some(Box::new(Arc::clone(&holder))));
            }
            // Released from the engine once the copies are done.
            self.shared.drive_soon();
        }
        for id in self.in_flight.drain(..) {
            self.shared.transport.orphan(id, Box::new(Arc::clone(&holder)));
        }
    }
}

impl<B: Send + 'static> Drop for List<B> {
    fn drop(&mut self) {
        self.let_go();
    }
}

impl<B: Send + 'static> Drop for Transfer<B> {
    /// The engine may be driving the list at this moment, keeping it a
    /// little longer: the list lets go of its buffer here, so that once the
    /// handle is gone the buffer is freed, or held only by the connection's
    /// posts in flight, not freed later on the engine's thread.
    fn drop(&mut self) {
        self.list.lock().unwrap_or_else(|e| e.into_inner()).let_go();
    }
}

impl<B: Send + 'static> fmt::Debug for Transfer<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let this = self.lock();
        List::fmt(&this, f)
    }
}

impl<B: Send + 'static> fmt::Debug for List<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("direction", &self.direction)
            .field("requests", &self.plan.requests())
            .field("posted", &self.next.taken)
            .field("in_flight", &self.in_flight.len())
            .field("failed", &self.failed)
            .finish()
    }
}
