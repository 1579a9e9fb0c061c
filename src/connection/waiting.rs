//! Waiting without a thread per operation: [`Pending`] and [`Transfer`]
//! are futures (any runtime; woken by the domain's progress engine on
//! verbs, by the connection's own threads on TCP), a [`CompletionSet`]
//! waits for any or all of many operations from one thread, and
//! [`Pending::on_complete`] runs a callback on the engine's thread.
//!
//! Every await is bounded by the connection's operation timeout (a timer
//! on the engine). Dropping a future keeps the rule of dropping a
//! `Pending`: the buffer stays with the connection until the device is
//! done with it.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use super::{Pending, Stage};
use crate::completion::Completion;
use crate::error::{Error, Result};
use crate::protocol::op;
use crate::transport::engine::{EngineHandle, LOOK_AGAIN, NotYet, Task};

impl<B: Send + 'static> Pending<B> {
    /// One look: done, or `waker` is registered for the completion
    /// (with the engine watching) and, if `bounded`, a timer armed at the
    /// operation's deadline.
    pub(crate) fn poll_waker(&mut self, waker: &Waker, bounded: bool) -> Poll<Result<Completion>> {
        let engine = self.shared.ctx.engine();
        let (outcome, why) = match self.stage {
            // The common cases, straight to the transport.
            Stage::InFlight(id) if !self.staged_in_progress() => {
                match self.shared.transport.poll_register(id, waker, engine) {
                    Ok(Some(outcome)) => (Some(self.settle(outcome)), NotYet::Told),
                    Ok(None) => (None, NotYet::Told),
                    Err(e) => (Some(Err(e)), NotYet::Told),
                }
            }
            Stage::Quiet(q, flush) => {
                let (outcome, told) = self.poll_quiet_waker(q, flush, waker);
                (outcome, if told { NotYet::Told } else { NotYet::LookAgain(LOOK_AGAIN) })
            }
            // Kept at the gate, staged, or behind staged operations: the
            // operation driver's look.
            _ => return self.poll_driven(waker, bounded),
        };
        let engine = self.shared.ctx.engine();
        if let Some(result) = outcome {
            self.clock.stop(engine);
            return Poll::Ready(result);
        }
        let bounded = bounded.then_some(self.shared.op_timeout);
        match self.clock.not_yet(engine, waker, why, bounded, WHAT) {
            // Still in flight: it may be awaited again (with a new deadline).
            Err(e) => Poll::Ready(Err(e)),
            Ok(()) => Poll::Pending,
        }
    }

    /// [`poll_waker`](Self::poll_waker) through the operation driver.
    #[inline(never)]
    fn poll_driven(&mut self, waker: &Waker, bounded: bool) -> Poll<Result<Completion>> {
        let shared = Arc::clone(&self.shared);
        let mut clock = std::mem::take(&mut self.clock);
        let bound = bounded.then_some(shared.op_timeout);
        let polled = op::poll(self, &shared.transport, shared.ctx.engine(), &mut clock, waker, bound, WHAT);
        self.clock = clock;
        polled
    }

    /// Whether `waker` is left to completions: this operation's own (a
    /// request posted while staged ones are in progress) and the network
    /// steps of every staged operation of the connection, which must all
    /// move while this one is awaited. Only when each of those waits on
    /// its network step: a copy's end wakes nobody. Else the caller looks
    /// again on a timer.
    pub(super) fn await_staged_step(&self, waker: &Waker) -> bool {
        #[cfg(feature = "cuda")]
        {
            let engine = self.shared.ctx.engine();
            match self.stage {
                Stage::Staged(_) => {}
                Stage::InFlight(id) => match self.shared.transport.done_or_register(id, waker, engine) {
                    Ok(false) => {}
                    Ok(true) => {
                        waker.wake_by_ref();
                        return true;
                    }
                    Err(_) => return false,
                },
                _ => return false,
            }
            match self.shared.staged.await_steps(&self.shared.transport, waker, engine) {
                Some(false) => true,
                // A step finished meanwhile: polled again at once.
                Some(true) => {
                    waker.wake_by_ref();
                    true
                }
                None => false,
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = waker;
            false
        }
    }

    /// [`poll_waker`](Self::poll_waker) for a quiet send: its outcome, or
    /// `waker` registered on a flush request of its own (posted now if
    /// there is room; else the caller looks again soon). The second value
    /// says whether a wake is arranged.
    fn poll_quiet_waker(
        &mut self,
        q: crate::transport::QuietSend,
        flush: Option<crate::ops::OpId>,
        waker: &Waker,
    ) -> (Option<Result<Completion>>, bool) {
        let transport = &self.shared.transport;
        match transport.poll_quiet(&q) {
            Ok(Some(outcome)) => {
                self.release_flush();
                return (Some(self.settle(outcome)), true);
            }
            Ok(None) => {}
            Err(e) => return (Some(Err(e)), true),
        }
        let flush = match flush {
            Some(id) => id,
            None => {
                let mut now = crate::deadline::Deadline::immediate(WHAT);
                match transport.cover(&q, true, &mut now) {
                    Ok(Some(id)) => {
                        self.stage = Stage::Quiet(q, Some(id));
                        id
                    }
                    // No room yet, or the connection is lost (its flush reports it).
                    _ => return (None, false),
                }
            }
        };
        match transport.poll_register(flush, waker, self.shared.ctx.engine()) {
            Ok(Some(_)) => {
                // The flush is done (and its slot freed): so is every request before it.
                self.stage = Stage::Quiet(q, None);
                match self.shared.transport.quiet_outcome(&q) {
                    Some(outcome) => (Some(self.settle(outcome)), true),
                    None => (None, false),
                }
            }
            Ok(None) => (None, true),
            Err(e) => (Some(Err(e)), true),
        }
    }

    /// Runs `f` on the domain's engine thread when the operation is done,
    /// with its outcome and the buffer (for callers from C or Python, or an
    /// event loop of their own). The buffer is `None` only when the
    /// operation timed out while still in flight: it then stays with the
    /// connection until the device is done. Keep `f` short: it runs on the
    /// thread that wakes every other waiter of the domain, and must not
    /// block on an operation.
    pub fn on_complete(self, f: impl FnOnce(Result<Completion>, Option<B>) + Send + 'static) {
        let engine = self.shared.ctx.engine().handle();
        callback(self, engine, f);
    }
}

impl<B: Send + 'static> Settle for Pending<B> {
    type Output = Result<Completion>;
    type Buffer = B;

    fn settle(&mut self, waker: &Waker) -> Poll<Result<Completion>> {
        self.poll_waker(waker, true)
    }

    fn into_buf(self) -> Option<B> {
        self.into_buffer().ok()
    }
}

/// What a wait on an operation is for, in its timeout error.
const WHAT: &str = "an operation to complete";

impl<B: Send + Unpin + 'static> Future for Pending<B> {
    type Output = Result<Completion>;

    /// Awaits the operation (bounded by the operation timeout, after which
    /// it is still in flight and may be awaited again); the buffer comes
    /// back with [`into_buffer`](Pending::into_buffer). Await it by
    /// `&mut` to keep the `Pending`.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_waker(cx.waker(), true)
    }
}

/// What a completion callback waits on: a [`Pending`] or a transfer list.
pub(crate) trait Settle: Send + 'static {
    type Output: Send;
    type Buffer: Send;

    /// One look with the callback's `waker`, bounded by the operation
    /// timeout.
    fn settle(&mut self, waker: &Waker) -> Poll<Self::Output>;

    /// The buffer, unless a timeout left it in flight.
    fn into_buf(self) -> Option<Self::Buffer>;
}

/// Runs `f` on `engine`'s thread once `op` settled.
pub(crate) fn callback<T, F>(op: T, engine: EngineHandle, f: F)
where
    T: Settle,
    F: FnOnce(T::Output, Option<T::Buffer>) + Send + 'static,
{
    let task = Arc::new(Callback { state: Mutex::new(Some((op, f))), engine });
    Arc::clone(&task).wake();
}

/// A completion callback, run on the engine.
struct Callback<T, F> {
    state: Mutex<Option<(T, F)>>,
    engine: EngineHandle,
}

impl<T, F> Wake for Callback<T, F>
where
    T: Settle,
    F: FnOnce(T::Output, Option<T::Buffer>) + Send + 'static,
{
    fn wake(self: Arc<Self>) {
        let engine = self.engine.clone();
        engine.spawn(self);
    }
}

impl<T, F> Task for Callback<T, F>
where
    T: Settle,
    F: FnOnce(T::Output, Option<T::Buffer>) + Send + 'static,
{
    fn run(self: Arc<Self>) {
        let waker = Waker::from(Arc::clone(&self));
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some((op, _)) = state.as_mut() else { return };
        if let Poll::Ready(result) = op.settle(&waker) {
            let Some((op, f)) = state.take() else { return };
            drop(state);
            f(result, op.into_buf());
        }
    }
}

/// An operation of a [`CompletionSet`] that finished.
pub struct Finished<B> {
    /// The key [`CompletionSet::insert`] returned.
    pub key: usize,
    /// Its outcome.
    pub result: Result<Completion>,
    /// Its buffer.
    pub buffer: B,
}

impl<B> fmt::Debug for Finished<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Finished").field("key", &self.key).field("result", &self.result).finish()
    }
}

/// Keys whose operations may have finished.
#[derive(Default)]
struct Ready {
    keys: Mutex<VecDeque<usize>>,
    cv: Condvar,
}

struct SlotWaker {
    key: usize,
    ready: Arc<Ready>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.keys.lock().unwrap_or_else(|e| e.into_inner()).push_back(self.key);
        self.ready.cv.notify_one();
    }
}

/// What a [`CompletionSet`] takes: a [`Pending`] operation, a transfer list
/// ([`Transfer`](crate::Transfer)) or a striped transfer
/// ([`Striped`](crate::rails::Striped), in a set of
/// [`RailRegion`](crate::RailRegion)s). Implemented by the crate only.
pub trait SetMember<B>: member::Member<B> {}

impl<B, T: member::Member<B>> SetMember<B> for T {}

pub(crate) mod member {
    use super::*;

    /// The looks a set takes at what it holds (unnameable outside the
    /// crate: the trait is sealed).
    pub trait Member<B>: Send + 'static {
        /// One look with the set's `waker`, never timing out: the set's
        /// waits are bounded by their own timeouts. A list or striped
        /// transfer reports a [`Completion`] of its whole: its opcode,
        /// `byte_len` its bytes (at most `u32::MAX`), and no work request.
        fn look(&mut self, waker: &Waker) -> Poll<Result<Completion>>;

        /// The buffer, once [`look`](Self::look) was ready.
        fn buffer(self: Box<Self>) -> Option<B>;
    }

    /// The completion that stands for a whole list or striped transfer.
    pub(crate) fn whole(opcode: crate::Opcode, bytes: u64) -> Completion {
        Completion {
            wr_id: 0,
            opcode,
            status: crate::WcStatus::Success,
            byte_len: u32::try_from(bytes).unwrap_or(u32::MAX),
            imm: None,
            qp_num: 0,
            vendor_err: 0,
        }
    }
}

impl<B: Send + 'static> member::Member<B> for Pending<B> {
    fn look(&mut self, waker: &Waker) -> Poll<Result<Completion>> {
        self.poll_waker(waker, false)
    }

    fn buffer(self: Box<Self>) -> Option<B> {
        self.into_buffer().ok()
    }
}

/// What a set holds under one key, and the waker that names the key.
type SetSlot<B> = (Box<dyn member::Member<B>>, Waker);

/// Many operations waited on from one thread: for any one of them to
/// finish, or all. Operations on any connections of any domains may be
/// mixed, and transfer lists and striped transfers with them. Each is
/// looked at only when it may have finished (it wakes the set), so
/// waiting on thousands costs per completion, not per operation.
///
/// Waits are bounded by the timeout given to them, not by the operations'
/// own timeouts. Dropping the set drops its operations as dropping their
/// [`Pending`]s does: buffers stay with their connections until the devices
/// are done.
pub struct CompletionSet<B: Send + 'static> {
    slots: Vec<Option<SetSlot<B>>>,
    free: Vec<usize>,
    ready: Arc<Ready>,
    len: usize,
}

impl<B: Send + 'static> Default for CompletionSet<B> {
    fn default() -> Self {
        CompletionSet { slots: Vec::new(), free: Vec::new(), ready: Arc::default(), len: 0 }
    }
}

impl<B: Send + 'static> CompletionSet<B> {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an operation, a transfer list or a striped transfer; its key
    /// comes back with it when it finishes (keys of finished ones are
    /// reused). A list or striped transfer finishes as a whole: its
    /// [`Completion`] has its opcode (`Write` or `Read`), its bytes in
    /// `byte_len` (at most `u32::MAX`; its own wait gives the full count)
    /// and no work request id.
    pub fn insert(&mut self, pending: impl SetMember<B>) -> usize {
        let key = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let waker = Waker::from(Arc::new(SlotWaker { key, ready: Arc::clone(&self.ready) }));
        self.slots[key] = Some((Box::new(pending), waker));
        self.len += 1;
        // Looked at first by the next wait.
        self.ready.keys.lock().unwrap_or_else(|e| e.into_inner()).push_back(key);
        key
    }

    /// Operations in the set.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Looks at the operation under `key`; its result if it finished.
    fn look(&mut self, key: usize) -> Option<Finished<B>> {
        let (member, waker) = self.slots.get_mut(key)?.as_mut()?;
        let Poll::Ready(result) = member.look(waker) else { return None };
        let (member, _) = self.slots[key].take()?;
        self.free.push(key);
        self.len -= 1;
        // Unbounded looks never time out: what finished keeps its buffer.
        let buffer = member.buffer().unwrap_or_else(|| unreachable!("a finished operation keeps its buffer"));
        Some(Finished { key, result, buffer })
    }

    /// A finished operation, without blocking; `None` if none has finished.
    pub fn poll_any(&mut self) -> Option<Finished<B>> {
        loop {
            let key = self.ready.keys.lock().unwrap_or_else(|e| e.into_inner()).pop_front()?;
            if let Some(done) = self.look(key) {
                return Some(done);
            }
        }
    }

    /// Waits until any operation finishes, up to `timeout`; `None` when
    /// the set is empty.
    ///
    /// # Errors
    /// [`Error::Timeout`] when none finished in time (all stay in the set).
    pub fn wait_any(&mut self, timeout: Duration) -> Result<Option<Finished<B>>> {
        if self.is_empty() {
            return Ok(None);
        }
        let until = Instant::now() + timeout;
        loop {
            if let Some(done) = self.poll_any() {
                return Ok(Some(done));
            }
            let keys = self.ready.keys.lock().unwrap_or_else(|e| e.into_inner());
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: "any operation of the set to complete", after: timeout });
            }
            if keys.is_empty() {
                drop(self.ready.cv.wait_timeout(keys, left).unwrap_or_else(|e| e.into_inner()));
            }
        }
    }

    /// Waits until every operation has finished, up to `timeout` in all;
    /// returns them in the order they finished.
    ///
    /// # Errors
    /// [`Error::Timeout`] when some did not finish in time: those that did
    /// were taken out and are dropped with the error (their buffers with
    /// them), the rest stay in the set. Use [`wait_any`](Self::wait_any)
    /// in a loop to keep every buffer.
    pub fn wait_all(&mut self, timeout: Duration) -> Result<Vec<Finished<B>>> {
        let until = Instant::now() + timeout;
        let mut out = Vec::with_capacity(self.len);
        while !self.is_empty() {
            let left = until.saturating_duration_since(Instant::now());
            match self.wait_any(left)? {
                Some(done) => out.push(done),
                None => break,
            }
        }
        Ok(out)
    }
}

impl<B: Send + 'static> fmt::Debug for CompletionSet<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionSet").field("len", &self.len).finish()
    }
}
