//! The transfer engine: one handle for a list of pieces between one local
//! buffer and one remote range, of any length. The list is planned whole
//! ([`plan`](crate::protocol::list::plan): checked, coalesced, split), then
//! posted in chains of requests with only the last of each signaled, as
//! many chains in flight as the send queue holds, more posted whenever the
//! handle is waited on or polled.
//!
//! Here the handle and the calls that start a list; `drive` posts and
//! completes it (the engine's turns, waits, failure, its notification);
//! `staged` moves its pieces through pinned host slots on the staged GPU
//! path.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::{ConnShared, Connection};
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalParts, LocalSlice, RemoteSlice};
use crate::ops::OpId;
use crate::protocol::list::{Cursor, ListPlan, Piece};
use crate::protocol::notify;
use crate::protocol::order::Place;
use crate::transport::WorkItem;
use crate::transport::engine::AwaitClock;
use crate::{HostMemory, Region};

mod drive;
#[cfg(feature = "cuda")]
mod staged;

/// What a transfer list does with its pieces (a striped transfer too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    Write,
    Read,
}

impl Direction {
    /// The opcode a whole list or striped transfer reports (one going this way).
    pub(crate) fn opcode(self) -> crate::Opcode {
        match self {
            Direction::Write => crate::Opcode::Write,
            Direction::Read => crate::Opcode::Read,
        }
    }
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

/// How long after a caller's last wait or poll of a list the engine takes
/// it over. A caller driving it in a loop (waiting on one list, polling
/// the ones behind) keeps it: the engine neither wakes on its posts nor
/// drives beside it, which cost a tenth of `list-bw`'s bandwidth over TCP
/// in context switches. One that went away hands it over after this.
pub(super) const HANDOFF: std::time::Duration = std::time::Duration::from_millis(5);

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
    /// Grows with every post and completion (and staged piece started or
    /// finished): how far it moved ([`Operation::moved`](crate::protocol::op::Operation::moved)).
    moves: u64,
    bytes: u64,
    /// Runs once everything succeeded (a GPU read's flush).
    after: Option<Box<dyn FnOnce() -> Result<()> + Send>>,
    /// The notification to send after the last piece.
    note: Option<NoteOut>,
    /// While awaited as a future: its deadline and timer.
    clock: AwaitClock,
    /// Wakes the engine's task for this list (registered on the oldest post
    /// in flight, or on a short timer while staged copies run).
    driver: Option<Waker>,
    /// A future awaiting the list, woken when the engine moved it.
    awaiter: Option<Waker>,
    /// When a caller's wait or poll last ended with the list in flight:
    /// the engine leaves the list to that caller until [`HANDOFF`] after.
    caller_left: Option<std::time::Instant>,
    /// When the engine's timer for the hand-over is set to fire, if set.
    handoff_at: Option<std::time::Instant>,
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
/// it along too; a caller that waits or polls keeps it, and the engine
/// takes it back 5 ms after that caller's last call. Dropping it before it
/// is done is safe: nothing more is posted, and the buffer stays with the
/// connection until the device is done with everything that was.
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
        let engine = list.shared.ctx.engine().handle();
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

    /// Runs `f` on the list (a caller's wait or poll), then leaves the
    /// engine ready to take the list over if the caller does not come back
    /// ([`List::arm_behind_caller`]).
    fn with<T>(&self, f: impl FnOnce(&mut List<B>) -> T) -> T {
        let mut l = self.lock();
        let out = f(&mut l);
        l.arm_behind_caller();
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

    /// Runs `f` on the domain's engine thread once all of the list landed
    /// (or failed), with the outcome and the buffer, as
    /// [`Pending::on_complete`](crate::Pending::on_complete) does: the
    /// buffer is `None` only when the list made no progress for the
    /// operation timeout and is still in flight. Keep `f` short, and never
    /// wait on an operation in it.
    pub fn on_complete(self, f: impl FnOnce(Result<Transferred>, Option<B>) + Send + 'static) {
        let engine = self.lock().shared.ctx.engine().handle();
        super::waiting::callback(self, engine, f);
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

impl<B: Send + Unpin + 'static> Future for Transfer<B> {
    type Output = Result<Transferred>;

    /// Awaits the whole list (bounded by the operation timeout without
    /// progress); the buffer comes back with
    /// [`finish`](Transfer::finish) (at once, once done). Await it by
    /// `&mut` to keep the `Transfer`.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().lock().poll_waker(cx.waker(), true)
    }
}

impl<B: Send + 'static> super::waiting::Settle for Transfer<B> {
    type Output = Result<Transferred>;
    type Buffer = B;

    fn settle(&mut self, waker: &Waker) -> Poll<Result<Transferred>> {
        self.lock().poll_waker(waker, true)
    }

    fn into_buf(self) -> Option<B> {
        self.lock().take_buffer()
    }
}

impl<B: Send + 'static> super::waiting::member::Member<B> for Transfer<B> {
    fn look(&mut self, waker: &Waker) -> Poll<Result<crate::Completion>> {
        let mut l = self.lock();
        let opcode = l.direction.opcode();
        l.poll_waker(waker, false).map(|r| r.map(|done| super::waiting::member::whole(opcode, done.bytes)))
    }

    fn buffer(self: Box<Self>) -> Option<B> {
        self.lock().take_buffer()
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
