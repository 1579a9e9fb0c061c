//! [`Pending`]: one operation in flight, and every way to wait for it.

#![forbid(unsafe_code)]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::Failed;
use super::shared::ConnShared;
use crate::completion::{Completion, Opcode};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::ops::{OpId, OpOutcome, WaitError, Waited};
use crate::protocol::op::{self, Bound, Look, Operation, Until};
use crate::protocol::order::Deferred;
use crate::transport::{Posted, PostedInline, QuietSend};
use std::task::Waker;

/// An operation in flight. Holds its buffer until the device is done.
///
/// Wait with [`wait`](Pending::wait) (or poll with
/// [`poll`](Pending::poll)), then take the buffer back with
/// [`into_buffer`](Pending::into_buffer), or do both with
/// [`finish`](Pending::finish). Dropping it before it completes is safe:
/// the buffer stays with the connection until the device is done with it.
#[must_use = "an operation's outcome and buffer come back through its Pending"]
pub struct Pending<B: Send + 'static> {
    pub(super) shared: Arc<ConnShared>,
    pub(super) buf: Option<B>,
    pub(super) stage: Stage,
    /// Runs once the operation succeeded, before the success is reported
    /// (flushing remote writes into GPU memory, copying a staged mirror in).
    pub(super) after: Option<Hook>,
    /// While awaited as a future: its deadline and timer.
    pub(super) clock: crate::transport::engine::AwaitClock,
}

pub(super) type Hook = Box<dyn FnOnce() -> Result<()> + Send>;

pub(crate) enum Stage {
    /// Kept at the connection's gate for its turn: not posted yet.
    Deferred(Arc<Deferred>),
    /// Posted; the outcome is not taken yet.
    InFlight(OpId),
    /// Posted unsignaled: done once a signaled request after it is. The
    /// request this handle posted to learn that, if it did (a flush).
    Quiet(QuietSend, Option<OpId>),
    /// A staged GPU operation: copies and network steps in flight.
    #[cfg(feature = "cuda")]
    Staged(Arc<std::sync::Mutex<crate::protocol::staged::Pipeline>>),
    /// Part of it reached the device and the connection broke: the buffer
    /// stays until the connection is torn down. The error is reported once.
    Stuck(OpId, Option<Box<Error>>),
    /// Finished successfully.
    Succeeded(Completion),
    /// Finished with an error (or never posted); `None` once reported.
    Failed(Option<Box<Error>>),
}

impl<B: Send + 'static> Pending<B> {
    pub(super) fn with(shared: &Arc<ConnShared>, buf: B, stage: Stage) -> Self {
        Pending { shared: Arc::clone(shared), buf: Some(buf), stage, after: None, clock: Default::default() }
    }

    pub(super) fn new(shared: &Arc<ConnShared>, id: OpId, buf: B) -> Self {
        Pending::with(shared, buf, Stage::InFlight(id))
    }

    /// The handle for a post that ended as `posted`.
    pub(crate) fn posted(shared: &Arc<ConnShared>, buf: B, posted: Posted) -> Self {
        match posted {
            Posted::Ok(id) => Pending::new(shared, id, buf),
            Posted::Refused(e) => Pending::refused(shared, buf, e),
            Posted::Stuck(id, e) => Pending::stuck(shared, id, buf, e),
        }
    }

    #[cold]
    #[inline(never)]
    pub(super) fn failed(shared: &Arc<ConnShared>, buf: B, error: Error) -> Self {
        Pending::with(shared, buf, Stage::Failed(Some(Box::new(error))))
    }

    #[cold]
    #[inline(never)]
    pub(super) fn refused(shared: &Arc<ConnShared>, buf: B, error: Box<Error>) -> Self {
        Pending::with(shared, buf, Stage::Failed(Some(error)))
    }

    #[cold]
    #[inline(never)]
    pub(super) fn stuck(shared: &Arc<ConnShared>, id: OpId, buf: B, error: Box<Error>) -> Self {
        Pending::with(shared, buf, Stage::Stuck(id, Some(error)))
    }

    #[cfg(feature = "cuda")]
    pub(super) fn staged(shared: &Arc<ConnShared>, pipeline: crate::protocol::staged::Pipeline, buf: B) -> Self {
        let pipeline = Arc::new(std::sync::Mutex::new(pipeline));
        shared.staged.add(&pipeline);
        Pending::with(shared, buf, Stage::Staged(pipeline))
    }

    /// Moves the connection's staged operations along (see
    /// [`StagedSet`](crate::protocol::staged::StagedSet)).
    /// Returns whether a copy is still in flight.
    pub(super) fn progress_staged(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.shared.staged.progress(&self.shared.transport);
        #[cfg(not(feature = "cuda"))]
        false
    }

    #[inline(never)]
    pub(super) fn progress_staged_cold(&self) {
        self.progress_staged();
    }

    /// Whether a wait must also move staged operations along.
    pub(super) fn staged_in_progress(&self) -> bool {
        #[cfg(feature = "cuda")]
        return !self.shared.staged.is_empty();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Whether the device is done with the buffer, polling once for an
    /// outcome not known yet (an error stays to be reported).
    pub(super) fn finished(&mut self) -> bool {
        if let Stage::Deferred(_) = self.stage {
            self.move_deferred();
        }
        match self.stage {
            Stage::InFlight(id) => {
                if let Ok(Some(outcome)) = self.shared.transport.poll_take(id) {
                    self.absorb(outcome);
                }
            }
            Stage::Quiet(q, _) => {
                if let Ok(Some(outcome)) = self.shared.transport.poll_quiet(&q) {
                    self.release_flush();
                    self.absorb(outcome);
                }
            }
            #[cfg(feature = "cuda")]
            Stage::Staged(_) => self.collect(),
            _ => {}
        }
        self.is_done()
    }

    /// Starts this finished handle's next round: the operation posted as
    /// `posted` (`PostedInline::Quiet` for an unsignaled send).
    pub(super) fn restart(&mut self, posted: PostedInline) {
        debug_assert!(self.is_done());
        self.clock.stop(self.shared.ctx.engine());
        let next = match posted {
            PostedInline::Tracked(Posted::Ok(id)) => Stage::InFlight(id),
            PostedInline::Tracked(Posted::Refused(e)) => Stage::Failed(Some(e)),
            PostedInline::Tracked(Posted::Stuck(id, e)) => Stage::Stuck(id, Some(e)),
            PostedInline::Quiet(q) => Stage::Quiet(q, None),
        };
        let last = std::mem::replace(&mut self.stage, next);
        if let Stage::Succeeded(_) = last {
            // Holds nothing to drop (a completion is plain data): the common
            // round skips the drop glue.
            std::mem::forget(last);
        }
    }

    /// Records a success, making what a write with immediate wrote
    /// visible and running the after-hook first.
    pub(super) fn succeed(&mut self, c: Completion) {
        let visible = match c.opcode {
            Opcode::RecvWriteWithImm => self.shared.make_imm_visible(),
            _ => Ok(()),
        };
        self.stage = match visible.and_then(|()| self.after.take().map_or(Ok(()), |hook| hook())) {
            Err(e) => Stage::Failed(Some(Box::new(e))),
            Ok(()) => Stage::Succeeded(c),
        };
    }

    /// Keeps an outcome to report.
    pub(super) fn absorb(&mut self, outcome: OpOutcome) {
        match outcome {
            Ok(c) => self.succeed(c),
            Err(e) => self.stage = Stage::Failed(Some(e)),
        }
    }

    /// A quiet send's outcome is known: the flush request it posted, if
    /// any, is left to the connection (freed at its completion).
    pub(super) fn release_flush(&mut self) {
        if let Stage::Quiet(q, Some(id)) = self.stage {
            self.stage = Stage::Quiet(q, None);
            self.shared.transport.orphan(id, Box::new(()));
        }
    }

    /// A post kept at the gate: moves the connection along, and takes the
    /// post's outcome if its turn came.
    #[cold]
    #[inline(never)]
    pub(super) fn move_deferred(&mut self) -> bool {
        let Stage::Deferred(kept) = &self.stage else { return false };
        let kept = Arc::clone(kept);
        let copying = self.shared.drive();
        if let Some(posted) = kept.take() {
            self.stage = match posted {
                Posted::Ok(id) => Stage::InFlight(id),
                Posted::Refused(e) => Stage::Failed(Some(e)),
                Posted::Stuck(id, e) => Stage::Stuck(id, Some(e)),
            };
        }
        copying
    }

    /// Moves an outcome from the connection's table into this value, if there is one.
    pub(super) fn collect(&mut self) {
        if let Stage::Deferred(_) = self.stage {
            self.move_deferred();
        }
        if let Stage::Quiet(q, _) = self.stage {
            if let Some(outcome) = self.shared.transport.quiet_outcome(&q) {
                self.release_flush();
                self.absorb(outcome);
            }
            return;
        }
        match &mut self.stage {
            Stage::InFlight(id) => {
                if let Some(outcome) = self.shared.transport.take(*id) {
                    self.absorb(outcome);
                }
            }
            #[cfg(feature = "cuda")]
            Stage::Staged(p) => {
                let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = p.advance_owned(&self.shared.transport) {
                    // A CUDA failure: wait for what is in flight, then report it.
                    p.abandon(&self.shared.transport, None);
                    drop(p);
                    self.stage = Stage::Failed(Some(Box::new(e)));
                } else if p.finished() {
                    let outcome = p.outcome();
                    drop(p);
                    self.absorb(outcome.map_err(Box::new));
                }
            }
            _ => {}
        }
    }

    /// The outcome, if known: an error is handed out once.
    pub(super) fn report(&mut self) -> Option<Result<Completion>> {
        self.collect();
        match &mut self.stage {
            Stage::Deferred(_) | Stage::InFlight(_) | Stage::Quiet(..) => None,
            #[cfg(feature = "cuda")]
            Stage::Staged(_) => None,
            Stage::Succeeded(c) => Some(Ok(*c)),
            Stage::Stuck(_, e) | Stage::Failed(e) => Some(Err(e.take().map_or(Error::AlreadyReported, |e| *e))),
        }
    }

    /// Waits for the operation, up to the connection's operation timeout.
    ///
    /// # Errors
    /// The operation's error ([`Error::Completion`] with its status,
    /// [`Error::ConnectionLost`], or what refused it before posting); or
    /// [`Error::Timeout`], after which it is still in flight and may be
    /// waited on again.
    pub fn wait(&mut self) -> Result<Completion> {
        let timeout = self.shared.op_timeout;
        self.wait_timeout(timeout)
    }

    /// Waits up to `timeout`.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Completion> {
        match self.stage {
            Stage::InFlight(id) if !self.staged_in_progress() => {
                // The common case: wait and take the outcome in one step.
                let mut due = Deadline::lazy(timeout, WHAT);
                let waited = self.shared.transport.wait_take(id, &mut due);
                return self.settle_waited(waited);
            }
            Stage::Quiet(q, None) => {
                // Most often known at once, without the lock: a signaled
                // request after it completed a while ago.
                if self.after.is_none() {
                    if let Some(c) = self.shared.transport.quiet_succeeded(&q) {
                        // A quiet stage holds nothing to drop: no drop glue.
                        std::mem::forget(std::mem::replace(&mut self.stage, Stage::Succeeded(c)));
                        return Ok(c);
                    }
                }
                if let Some(outcome) = self.shared.transport.quiet_outcome(&q) {
                    return self.settle(outcome);
                }
                return self.wait_quiet(q, None, timeout);
            }
            Stage::Quiet(q, flush) => return self.wait_quiet(q, flush, timeout),
            _ => {}
        }
        self.wait_slow(timeout)
    }

    /// Waits for a quiet send's outcome: on the signaled request after it,
    /// posting one (a flush) if there is none.
    #[inline(never)]
    pub(super) fn wait_quiet(
        &mut self,
        q: QuietSend,
        mut flush: Option<OpId>,
        timeout: Duration,
    ) -> Result<Completion> {
        let mut due = Deadline::lazy(timeout, WHAT);
        // Staged operations move only while waiting on a request of one's own.
        let staged = self.staged_in_progress();
        if flush.is_none() {
            flush = self.shared.transport.cover(&q, staged, &mut due)?;
            self.stage = Stage::Quiet(q, flush);
        }
        if let Some(id) = flush {
            if staged {
                // Staged operations move only while waiting on a request of one's own.
                let shared = Arc::clone(&self.shared);
                let left = due.remaining().unwrap_or_default();
                let bound = Bound { total: Some(left), idle: left, spin: shared.spin, what: WHAT };
                op::wait(&mut MovingStaged { pending: &*self, id }, &shared.transport, bound)
                    .map_err(|e| Self::overall(e, timeout))?;
            } else {
                self.shared.transport.wait(id, &mut due)?;
            }
            // Done, and so is every request before it: free its slot.
            drop(self.shared.transport.take(id));
            self.stage = Stage::Quiet(q, None);
        }
        let waited = self.shared.transport.wait_quiet(&q, &mut due);
        self.settle_waited(waited)
    }

    /// [`wait_timeout`](Self::wait_timeout) for an operation kept at the
    /// gate, a staged one, one posted while staged ones are in progress, or
    /// one already finished: the operation driver's wait.
    #[inline(never)]
    pub(super) fn wait_slow(&mut self, timeout: Duration) -> Result<Completion> {
        let shared = Arc::clone(&self.shared);
        let bound = Bound { total: Some(timeout), idle: timeout, spin: shared.spin, what: WHAT };
        op::wait(self, &shared.transport, bound)
    }

    /// A wait's timeout, named for the whole wait (`timeout`).
    fn overall(e: Error, timeout: Duration) -> Error {
        match e {
            Error::Timeout { .. } => Error::Timeout { what: WHAT, after: timeout },
            e => e,
        }
    }

    /// Records the outcome just taken from the transport and reports it
    /// (an error once, as [`report`](Self::report) does).
    #[inline]
    pub(super) fn settle(&mut self, outcome: OpOutcome) -> Result<Completion> {
        match outcome {
            Ok(c) if self.after.is_none() && c.opcode != Opcode::RecvWriteWithImm => {
                let before = std::mem::replace(&mut self.stage, Stage::Succeeded(c));
                match before {
                    // Ids: nothing to drop (and no drop glue on the hot path).
                    Stage::InFlight(_) | Stage::Quiet(_, None) => std::mem::forget(before),
                    other => drop(other),
                }
                Ok(c)
            }
            other => self.settle_slow(other),
        }
    }

    /// [`settle`](Self::settle) for what a wait ended with: a wait that
    /// ended first leaves the operation in flight, to be waited for again.
    #[inline(always)]
    pub(super) fn settle_waited(&mut self, waited: Waited) -> Result<Completion> {
        match waited {
            Ok(c) => self.settle(Ok(c)),
            Err(WaitError::Failed(e)) => self.settle(Err(e)),
            Err(WaitError::Unfinished(e)) => Err(*e),
        }
    }

    /// [`settle`](Self::settle) with an after-hook to run, or an error.
    #[cold]
    #[inline(never)]
    pub(super) fn settle_slow(&mut self, outcome: OpOutcome) -> Result<Completion> {
        match outcome {
            Ok(c) => {
                self.succeed(c);
                self.report().unwrap_or(Ok(c))
            }
            Err(e) => {
                self.stage = Stage::Failed(None);
                Err(*e)
            }
        }
    }

    /// Checks once, without blocking: `Some` when finished.
    ///
    /// # Errors
    /// As [`wait`](Self::wait), without the timeout.
    pub fn poll(&mut self) -> Result<Option<Completion>> {
        if self.staged_in_progress() {
            self.progress_staged_cold();
        }
        if let Stage::Deferred(_) = self.stage {
            self.move_deferred();
        }
        self.poll_moved()
    }

    /// [`poll`](Self::poll) once the connection's staged operations were
    /// moved along.
    pub(super) fn poll_moved(&mut self) -> Result<Option<Completion>> {
        match self.stage {
            Stage::InFlight(id) => {
                return match self.shared.transport.poll_take(id)? {
                    None => Ok(None),
                    Some(outcome) => self.settle(outcome).map(Some),
                };
            }
            Stage::Quiet(q, _) => {
                return match self.shared.transport.poll_quiet(&q)? {
                    None => Ok(None),
                    Some(outcome) => {
                        self.release_flush();
                        self.settle(outcome).map(Some)
                    }
                };
            }
            _ => {}
        }
        self.report().transpose()
    }

    /// Whether the device is done with the buffer, as far as this value
    /// knows (it learns by [`wait`](Self::wait), [`poll`](Self::poll) or
    /// [`into_buffer`](Self::into_buffer)).
    pub fn is_done(&self) -> bool {
        matches!(self.stage, Stage::Succeeded(_) | Stage::Failed(_))
    }

    /// The buffer back, once the device is done with it; else `self`.
    ///
    /// # Errors
    /// `Err(self)` while the operation is in flight.
    pub fn into_buffer(mut self) -> std::result::Result<B, Box<Self>> {
        // Picks up an outcome that arrived meanwhile.
        if !self.finished() {
            return Err(Box::new(self));
        }
        Ok(self.buf.take().expect("the buffer is present until taken"))
    }

    /// Waits (up to the operation timeout), then returns the completion and
    /// the buffer, or the error and the buffer.
    ///
    /// # Errors
    /// [`Failed`]: the error (as [`wait`](Self::wait)) and the buffer, which
    /// is `None` only after a timeout with the operation still in flight
    /// (it then stays with the connection until the device is done).
    /// Converts into [`Error`], so `?` works.
    pub fn into_result(mut self) -> std::result::Result<(Completion, B), Failed<B>> {
        match self.wait() {
            Ok(c) => Ok((c, self.buf.take().expect("the buffer is present until taken"))),
            Err(error) => {
                let buffer = if self.is_done() { self.buf.take() } else { None };
                Err(Failed { error, buffer })
            }
        }
    }

    /// Waits (up to the operation timeout), then returns the completion and
    /// the buffer.
    ///
    /// # Errors
    /// As [`wait`](Self::wait). On error the buffer is dropped once the
    /// device is done with it; [`into_result`](Self::into_result) keeps it.
    pub fn finish(mut self) -> Result<(Completion, B)> {
        let c = self.wait()?;
        let buf = self.buf.take().expect("the buffer is present until taken");
        Ok((c, buf))
    }
}

/// What a wait on an operation is for, in its timeout error.
pub(super) const WHAT: &str = "an operation to complete";

impl<B: Send + 'static> Drop for Pending<B> {
    fn drop(&mut self) {
        self.clock.stop(self.shared.ctx.engine());
        // Finished, or a quiet send with no flush of its own whose data
        // went inline: nothing is left with the connection.
        match self.stage {
            Stage::Succeeded(_) | Stage::Failed(_) => {}
            Stage::Quiet(q, None) if q.inline => {}
            _ => self.drop_unfinished(),
        }
    }
}

impl<B: Send + 'static> Pending<B> {
    /// Dropped before the device was done: the buffer stays with the connection.
    #[cold]
    #[inline(never)]
    pub(super) fn drop_unfinished(&mut self) {
        if let Stage::Deferred(kept) = &self.stage {
            // Never posted: the buffer goes with this value. Posted meanwhile:
            // left with the connection as any operation in flight.
            let gate = if kept.is_receive() { &self.shared.recv_gate } else { &self.shared.gate };
            match gate.cancel(kept, &self.shared.transport) {
                None | Some(Posted::Refused(_)) => return,
                Some(Posted::Ok(id) | Posted::Stuck(id, _)) => self.stage = Stage::InFlight(id),
            }
        }
        #[cfg(feature = "cuda")]
        if let Stage::Staged(p) = &self.stage {
            // Copies in flight keep the buffer until they are done (never
            // waited for here); slots still on the network stay with the
            // connection.
            let keep: Box<dyn std::any::Any + Send> = match self.buf.take() {
                Some(b) => Box::new(b),
                None => Box::new(()),
            };
            p.lock().unwrap_or_else(|e| e.into_inner()).abandon(&self.shared.transport, Some(keep));
            // Released from the engine once the copies are done.
            self.shared.driver.ask(&self.shared);
        }
        // A quiet send's flush request is left to the connection.
        self.release_flush();
        if let Stage::Quiet(q, _) = self.stage {
            // Its outcome is not known here: the connection keeps the
            // buffer until a later completion says the device is done.
            if !q.inline {
                if let Some(b) = self.buf.take() {
                    self.shared.transport.orphan_quiet(&q, Box::new(b));
                }
            }
            return;
        }
        if let Stage::InFlight(id) | Stage::Stuck(id, _) = self.stage {
            // Still tracked: the table keeps the buffer until the final completion
            // (or frees the slot at once if that already happened).
            let buf: Box<dyn std::any::Any + Send> = match self.buf.take() {
                Some(b) => Box::new(b),
                None => Box::new(()),
            };
            self.shared.transport.orphan(id, buf);
        }
    }
}

impl<B: Send + 'static> fmt::Debug for Pending<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stage = match &self.stage {
            Stage::Deferred(_) => "waiting for the operations posted before it",
            Stage::InFlight(_) | Stage::Quiet(..) => "in flight",
            #[cfg(feature = "cuda")]
            Stage::Staged(_) => "staging",
            Stage::Stuck(..) => "stuck until the connection is dropped",
            Stage::Succeeded(_) => "succeeded",
            Stage::Failed(_) => "failed",
        };
        f.debug_struct("Pending").field("stage", &stage).finish()
    }
}

impl<B: Send + 'static> Operation for Pending<B> {
    type Output = Completion;

    /// One pass over the connection's staged operations, then a look at
    /// this one: kept at the gate (woken when its turn comes, and looked at
    /// again soon: what holds the gate moves by being looked at), posted
    /// (its request, slept on briefly while staged operations must move),
    /// or staged (its network step, or its copies). Awaited, a staged
    /// operation's waker waits on the network steps of every staged
    /// operation of the connection where each waits on one.
    fn step(&mut self, waker: Option<&Waker>) -> Look<Completion> {
        let staged = self.staged_in_progress();
        let mut copying = staged && self.progress_staged();
        if let Stage::Deferred(_) = self.stage {
            copying |= self.move_deferred();
            if let Stage::Deferred(kept) = &self.stage {
                if let Some(w) = waker {
                    kept.wake_when_posted(w);
                }
                return Look::Wait(Until::Soon { copying });
            }
        }
        if let Stage::InFlight(id) = self.stage {
            return match self.shared.transport.poll_take(id) {
                Ok(Some(outcome)) => Look::Done(self.settle(outcome)),
                Ok(None) if waker.is_some_and(|w| self.await_staged_step(w)) => Look::Wait(Until::Woken),
                Ok(None) => Look::Wait(Until::Request { id, briefly: staged.then_some(copying) }),
                Err(e) => Look::Done(Err(e)),
            };
        }
        if let Stage::Quiet(q, _) = self.stage {
            return match self.shared.transport.poll_quiet(&q) {
                Ok(Some(outcome)) => {
                    self.release_flush();
                    Look::Done(self.settle(outcome))
                }
                Ok(None) => Look::Wait(Until::Soon { copying }),
                Err(e) => Look::Done(Err(e)),
            };
        }
        #[cfg(feature = "cuda")]
        if let Stage::Staged(p) = &self.stage {
            let (waiting_on, busy) = {
                let p = p.lock().unwrap_or_else(|e| e.into_inner());
                (p.waiting_on(), p.copying())
            };
            self.collect();
            if matches!(self.stage, Stage::Staged(_)) {
                if waker.is_some_and(|w| self.await_staged_step(w)) {
                    return Look::Wait(Until::Woken);
                }
                let copying = copying | busy;
                return Look::Wait(match waiting_on {
                    Some(id) => Until::Request { id, briefly: Some(copying) },
                    None => Until::Soon { copying },
                });
            }
        }
        match self.report() {
            Some(outcome) => Look::Done(outcome),
            // Not finished after all (a stage above moved on): soon again.
            None => Look::Wait(Until::Soon { copying }),
        }
    }
}

/// A request of `pending`'s own (a quiet send's flush), waited for while
/// the connection's staged operations are moved along.
struct MovingStaged<'a, B: Send + 'static> {
    pending: &'a Pending<B>,
    id: OpId,
}

impl<B: Send + 'static> Operation for MovingStaged<'_, B> {
    type Output = ();

    fn step(&mut self, _: Option<&Waker>) -> Look<()> {
        let copying = self.pending.progress_staged();
        match self.pending.shared.transport.poll(self.id) {
            Ok(true) => Look::Done(Ok(())),
            Ok(false) => Look::Wait(Until::Request { id: self.id, briefly: Some(copying) }),
            Err(e) => Look::Done(Err(e)),
        }
    }
}
