//! A transfer cut into stripes over every queue pair, moved off a rail that fails.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use crate::access::Access;
use crate::completion::Failure;
use crate::connection::{Direction, Transfer};
use crate::error::{Error, Result};
use crate::memory::alias::Alias;
use crate::memory::{LocalBuffer, Memory, Shared};
use crate::protocol::list::Piece;
use crate::transport::engine::{EngineHandle, Task};

use super::*;

/// What a finished striped transfer moved ([`Striped::wait`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Moved {
    /// Bytes moved.
    pub bytes: u64,
    /// Stripes it was cut into.
    pub stripes: usize,
    /// Queue pairs' lists posted again on another rail after theirs failed.
    pub moved_again: usize,
}

/// The stripes one queue pair carries.
pub(super) struct Lane<M: Memory> {
    pub(super) pieces: Vec<Piece>,
    pub(super) link: usize,
    /// In flight; `None` once landed.
    pub(super) transfer: Option<Transfer<Shared<Alias<M>>>>,
}

/// A striped transfer in flight; see [`RailConnection::write`].
///
/// The domain's engine drives it from the moment it is posted: each queue
/// pair's list, the moving of a failed rail's stripes to the rails left,
/// the flush of a queue pair that timed out, then the notification. Nobody
/// needs to wait for any of that to happen. The handle only collects the
/// outcome: wait on it, await it (it is a future), hand it to a
/// [`CompletionSet`](crate::CompletionSet), or give it a callback
/// ([`on_complete`](Self::on_complete)). Dropping the handle does not stop
/// the transfer: it still runs to its end (its notification included),
/// and its outcome is dropped.
#[must_use = "a striped transfer's outcome comes back through its handle"]
pub struct Striped<M: Memory> {
    run: Arc<Run<M>>,
    /// The local region, handed back by a [`CompletionSet`](crate::CompletionSet).
    local: RailRegion<M>,
    len: u64,
    /// What it does, for the completion a set reports.
    opcode: crate::Opcode,
}

/// A striped transfer's state machine: what the engine's task steps.
pub(super) struct Machine<M: Memory> {
    pub(super) shared: Arc<RailShared>,
    pub(super) local: RailRegion<M>,
    pub(super) remote: RailDescriptor,
    pub(super) span: Span,
    pub(super) direction: Direction,
    pub(super) lanes: Vec<Lane<M>>,
    pub(super) note: Option<(u32, Vec<u8>)>,
    /// Refused before anything was posted.
    pub(super) refused: Option<Error>,
    pub(super) moved: Moved,
    pub(super) turn: usize,
    /// Lists of queue pairs that failed by timeout, until they are flushed.
    pub(super) draining: Vec<Transfer<Shared<Alias<M>>>>,
    /// The notification's list, on its queue pair, once everything landed.
    pub(super) note_out: Option<(usize, Transfer<Shared<Alias<M>>>)>,
    /// Queue pairs the notification failed on.
    pub(super) note_tries: usize,
}

impl<M: Memory> std::fmt::Debug for Striped<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.run.lock();
        let lanes = st.machine.as_ref().map_or(0, |m| m.lanes.len());
        f.debug_struct("Striped")
            .field("len", &self.len)
            .field("lanes", &lanes)
            .field("done", &st.machine.is_none())
            .finish()
    }
}

/// The engine's task for one striped transfer, and where its outcome waits.
struct Run<M: Memory> {
    state: Mutex<RunState<M>>,
    engine: EngineHandle,
}

/// A completion callback ([`Striped::on_complete`]).
type Then = Box<dyn FnOnce(Result<Moved>) + Send>;

struct RunState<M: Memory> {
    /// `None` once it ended.
    machine: Option<Machine<M>>,
    /// Until it is taken.
    outcome: Option<Result<Moved>>,
    /// The outcome was taken.
    reported: bool,
    /// Woken when it ends.
    awaiter: Option<Waker>,
    then: Option<Then>,
}

impl<M: Memory> Run<M> {
    fn lock(&self) -> MutexGuard<'_, RunState<M>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<M: Memory> RunState<M> {
    /// The outcome, handed out once ([`Error::AlreadyReported`] after);
    /// `None` while the transfer runs.
    fn take(&mut self) -> Option<Result<Moved>> {
        if let Some(out) = self.outcome.take() {
            self.reported = true;
            return Some(out);
        }
        self.reported.then_some(Err(Error::AlreadyReported))
    }
}

impl<M: Memory> Wake for Run<M> {
    fn wake(self: Arc<Self>) {
        let engine = self.engine.clone();
        engine.spawn(self);
    }
}

impl<M: Memory> Task for Run<M> {
    /// One step of the machine, woken by its lists and timers; once it
    /// ended, the outcome goes to the callback, or wakes the awaiter.
    fn run(self: Arc<Self>) {
        let mut st = self.lock();
        if let Some(m) = st.machine.as_mut() {
            let waker = Waker::from(Arc::clone(&self));
            match m.step(&mut Context::from_waker(&waker)) {
                Poll::Pending => return,
                Poll::Ready(out) => {
                    st.machine = None;
                    st.outcome = Some(out);
                }
            }
        }
        if st.then.is_some() {
            if st.outcome.is_some() {
                let (Some(f), Some(out)) = (st.then.take(), st.outcome.take()) else { return };
                st.reported = true;
                drop(st);
                f(out);
            }
        } else if let Some(w) = st.awaiter.take() {
            drop(st);
            w.wake();
        }
    }
}

impl<M: Memory> Striped<M> {
    pub(super) fn start(
        conn: &RailConnection,
        local: &RailRegion<M>,
        remote: &RailDescriptor,
        span: Span,
        direction: Direction,
        note: Option<(u32, Vec<u8>)>,
    ) -> Self {
        let opcode = direction.opcode();
        let machine = Machine::start(conn, local, remote, span, direction, note);
        // Every link's connection shares the engine of its rail's domain;
        // the first one drives the transfer (it may post on any rail).
        let engine = conn.shared.links[0].conn.engine();
        let state = RunState { machine: Some(machine), outcome: None, reported: false, awaiter: None, then: None };
        let run = Arc::new(Run { state: Mutex::new(state), engine });
        // The first step registers with every list posted.
        Arc::clone(&run).wake();
        Striped { run, local: local.clone(), len: span.len, opcode }
    }

    /// Waits until every stripe has landed (and the notification, if any,
    /// is sent), moving the stripes of a failed rail to the others.
    ///
    /// The engine does the moving and the notification whether or not
    /// anyone waits (see [`Striped`]); the wait only collects the outcome.
    /// Each queue pair's list is bounded by the connection's operation
    /// timeout without progress: past it, that queue pair counts as
    /// failed, its stripes move, and what it still had in flight is
    /// flushed before the transfer completes. So the wait ends.
    ///
    /// # Errors
    /// What refused the transfer before anything moved
    /// ([`Error::OutOfBounds`], [`Error::AccessDenied`],
    /// [`Error::RailMismatch`], [`Error::NotifyPayloadTooLarge`]); an
    /// operation's error that is not the rail's fault (a remote access
    /// error, say); [`Error::NoRailLeft`] when every rail failed. Once it
    /// returned its outcome, it returns [`Error::AlreadyReported`].
    pub fn wait(&mut self) -> Result<Moved> {
        block_on(self)
    }

    /// The outcome, without blocking: `None` while it runs.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn poll(&mut self) -> Result<Option<Moved>> {
        self.run.lock().take().transpose()
    }

    /// Whether it ended (its outcome may still be taken).
    pub fn is_done(&self) -> bool {
        self.run.lock().machine.is_none()
    }

    /// Runs `f` with the outcome on the engine's thread once the transfer
    /// ended (at once if it already had, and its outcome was not taken).
    /// Keep `f` short, and never wait on an operation in it: it runs on
    /// the thread that drives every transfer of the domain.
    pub fn on_complete(self, f: impl FnOnce(Result<Moved>) + Send + 'static) {
        let mut st = self.run.lock();
        if st.reported {
            // Taken already: the callback hears so, on the engine too.
            st.outcome = Some(Err(Error::AlreadyReported));
        }
        st.then = Some(Box::new(f));
        let ended = st.machine.is_none();
        drop(st);
        if ended {
            Arc::clone(&self.run).wake();
        }
    }

    /// Bytes the transfer moves.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it moves nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A look for a waiter with `waker`: the outcome once it ended.
    pub(crate) fn poll_waker(&mut self, waker: &Waker) -> Poll<Result<Moved>> {
        let mut st = self.run.lock();
        if let Some(out) = st.take() {
            return Poll::Ready(out);
        }
        match &st.awaiter {
            Some(w) if w.will_wake(waker) => {}
            _ => st.awaiter = Some(waker.clone()),
        }
        Poll::Pending
    }
}

impl<M: Memory> crate::connection::member::Member<RailRegion<M>> for Striped<M> {
    fn look(&mut self, waker: &Waker) -> Poll<Result<crate::Completion>> {
        let opcode = self.opcode;
        self.poll_waker(waker).map(|r| r.map(|moved| crate::connection::member::whole(opcode, moved.bytes)))
    }

    fn buffer(self: Box<Self>) -> Option<RailRegion<M>> {
        Some(self.local.clone())
    }
}

impl<M: Memory> Machine<M> {
    fn start(
        conn: &RailConnection,
        local: &RailRegion<M>,
        remote: &RailDescriptor,
        span: Span,
        direction: Direction,
        note: Option<(u32, Vec<u8>)>,
    ) -> Self {
        let shared = Arc::clone(&conn.shared);
        let mut s = Machine {
            local: local.clone(),
            remote: remote.clone(),
            span,
            direction,
            lanes: Vec::new(),
            note,
            refused: None,
            moved: Moved::default(),
            turn: 0,
            draining: Vec::new(),
            note_out: None,
            note_tries: 0,
            shared,
        };
        if let Err(e) = s.plan() {
            s.refused = Some(e);
        }
        s
    }

    /// Checks the ranges, cuts the stripes and posts one list per queue pair.
    pub(super) fn plan(&mut self) -> Result<()> {
        if let Some((_, payload)) = &self.note {
            if payload.len() > crate::MAX_NOTIFY_PAYLOAD {
                let (len, max) = (payload.len() as u64, crate::MAX_NOTIFY_PAYLOAD as u64);
                return Err(Error::NotifyPayloadTooLarge { len, max });
            }
        }
        let n = self.shared.rails.len();
        if self.local.rails.len() != n || self.remote.rails.len() != n {
            return Err(Error::RailMismatch {
                detail: format!(
                    "the connection has {n} rails, the local region {}, the remote one {}",
                    self.local.rails.len(),
                    self.remote.rails.len()
                ),
            });
        }
        let Span { local_offset, remote_offset, len } = self.span;
        let check = |side: &'static str, offset: u64, region_len: u64| {
            if offset.checked_add(len).is_none_or(|end| end > region_len) {
                return Err(Error::OutOfBounds { side, offset, len, region_len });
            }
            Ok(())
        };
        check("local", local_offset, self.local.len() as u64)?;
        check("remote", remote_offset, self.remote.len())?;
        let needed = match self.direction {
            Direction::Write => Access::REMOTE_WRITE,
            Direction::Read => Access::REMOTE_READ,
        };
        let granted = self.remote.rails[0].access();
        if !granted.contains(needed) {
            return Err(Error::AccessDenied { granted, needed });
        }
        let links: Vec<usize> = (0..self.shared.links.len()).filter(|&i| self.shared.links[i].alive()).collect();
        if links.is_empty() {
            return Err(Error::NoRailLeft { failures: self.shared.failures() });
        }
        let stripe = self.shared.stripe;
        let mut lanes: Vec<Lane<M>> =
            links.iter().map(|&link| Lane { pieces: Vec::new(), link, transfer: None }).collect();
        let mut at = 0;
        let mut k = 0;
        while at < len {
            let n = stripe.min(len - at);
            let lane = &mut lanes[k % links.len()];
            lane.pieces.push(Piece::new(at, at, n));
            at += n;
            k += 1;
        }
        self.moved.stripes = k;
        lanes.retain(|l| !l.pieces.is_empty());
        for lane in &mut lanes {
            lane.transfer = Some(self.post(lane.link, &lane.pieces)?);
        }
        self.lanes = lanes;
        Ok(())
    }

    /// Posts `pieces` (offsets relative to the transfer) on `link`.
    pub(super) fn post(&self, link: usize, pieces: &[Piece]) -> Result<Transfer<Shared<Alias<M>>>> {
        let l = &self.shared.links[link];
        let Span { local_offset, remote_offset, len } = self.span;
        let slice = self.local.rails[l.rail].clone().slice(local_offset as usize..(local_offset + len) as usize);
        let remote = self.remote.rails[l.rail].slice(remote_offset..remote_offset + len)?;
        let pieces = pieces.iter().copied();
        Ok(match self.direction {
            Direction::Write => l.conn.write_list(slice, &remote, pieces),
            Direction::Read => l.conn.read_list(slice, &remote, pieces),
        })
    }

    /// One look at every queue pair's list (polled with `cx`'s waker when
    /// awaited, else without): takes what landed, moves a failed rail's
    /// stripes, then sends the notification. Ready with the outcome.
    fn step(&mut self, cx: &mut Context<'_>) -> Poll<Result<Moved>> {
        if let Some(e) = self.refused.take() {
            return Poll::Ready(Err(e));
        }
        let shared = Arc::clone(&self.shared);
        let mut pending = false;
        let mut i = 0;
        while i < self.lanes.len() {
            let link = self.lanes[i].link;
            let Some(t) = self.lanes[i].transfer.as_mut() else {
                i += 1;
                continue;
            };
            match Pin::new(t).poll(cx) {
                Poll::Pending => {
                    pending = true;
                    i += 1;
                }
                Poll::Ready(Ok(done)) => {
                    self.lanes[i].transfer = None;
                    shared.rails[shared.links[link].rail].bytes.fetch_add(done.bytes, Ordering::AcqRel);
                    self.moved.bytes += done.bytes;
                    i += 1;
                }
                Poll::Ready(Err(e)) if rail_fault(&e) => {
                    shared.fail(link, &e.to_string());
                    if let Some(old) = self.lanes[i].transfer.take().filter(|_| matches!(e, Error::Timeout { .. })) {
                        // Shut now: what it had in flight is flushed; the
                        // transfer ends only after that.
                        self.draining.push(old);
                    }
                    self.turn += 1;
                    let Some(next) = shared.pick(self.turn) else {
                        return Poll::Ready(Err(Error::NoRailLeft { failures: shared.failures() }));
                    };
                    let transfer = match self.post(next, &self.lanes[i].pieces) {
                        Ok(t) => t,
                        Err(e) => return Poll::Ready(Err(e)),
                    };
                    let lane = &mut self.lanes[i];
                    lane.link = next;
                    lane.transfer = Some(transfer);
                    self.moved.moved_again += 1;
                    // Looked at again at the same index.
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
        // Lists of failed queue pairs, until their flush is seen (any outcome).
        self.draining.retain_mut(|t| Pin::new(t).poll(cx).is_pending());
        if pending || !self.draining.is_empty() {
            return Poll::Pending;
        }
        self.step_note(cx)
    }

    /// Sends the notification on the first queue pair that takes it.
    fn step_note(&mut self, cx: &mut Context<'_>) -> Poll<Result<Moved>> {
        let shared = Arc::clone(&self.shared);
        loop {
            if let Some((link, t)) = self.note_out.as_mut() {
                match Pin::new(t).poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(_)) => {
                        self.note_out = None;
                        self.note = None;
                    }
                    Poll::Ready(Err(e)) if rail_fault(&e) => {
                        shared.fail(*link, &e.to_string());
                        self.note_out = None;
                        self.note_tries += 1;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                }
            }
            let Some((tag, payload)) = self.note.as_ref() else {
                return Poll::Ready(Ok(self.moved));
            };
            self.turn += 1;
            let link = shared.pick(self.turn).filter(|_| self.note_tries < shared.links.len());
            let Some(link) = link else {
                return Poll::Ready(Err(Error::NoRailLeft { failures: shared.failures() }));
            };
            let l = &shared.links[link];
            let local = self.local.rails[l.rail].clone().slice(0..0);
            let remote = match self.remote.rails[l.rail].slice(0..0) {
                Ok(r) => r,
                Err(e) => return Poll::Ready(Err(e)),
            };
            self.note_out = Some((link, l.conn.write_list_notify(local, &remote, [], *tag, payload)));
        }
    }
}

/// Whether an error is the rail's (its queue pair is unusable), so that
/// the stripes it had are moved to another, rather than the transfer's own
/// (bad keys, bad ranges), which another rail would hit as well.
pub(super) fn rail_fault(e: &Error) -> bool {
    match e {
        Error::ConnectionLost { .. } | Error::Timeout { .. } => true,
        Error::Completion(c) => {
            matches!(
                c.failure(),
                Failure::PeerUnreachable | Failure::Flushed | Failure::ReceiverNotReady | Failure::Other
            )
        }
        _ => false,
    }
}

impl<M: Memory> Future for Striped<M> {
    type Output = Result<Moved>;

    /// Awaits the outcome (see [`Striped::wait`]); woken by the engine
    /// when the transfer ended.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Moved>> {
        self.get_mut().poll_waker(cx.waker())
    }
}

/// Runs a future on this thread until it is ready, parked while the
/// engines have nothing for it (every list it waits on wakes it, at the
/// latest at its operation timeout).
fn block_on<F: Future + Unpin>(f: &mut F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = Pin::new(&mut *f).poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}
