//! What the transports share: a post's work items, what each does at the
//! peer, how a post ended, and the queue core both run on ([`QueueCore`]:
//! operations, credits, the lost state and the checks, with no I/O, tested
//! here without sockets, threads or devices).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::access::Access;
use crate::completion::{Completion, Opcode};
use crate::error::{Error, Result};
use crate::memory::{LocalParts, RemoteSlice};
use crate::ops::{Held, OpId, OpOutcome, OpTable, Orphan, RawCompletion, quiet_seq};

/// One operation of a post: the local range it uses and what it does.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkItem {
    pub local: Option<LocalParts>,
    pub op: RemoteOp,
}

/// What an operation does at the peer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RemoteOp {
    Send,
    SendWithImm(u32),
    Write(RemoteSlice),
    WriteWithImm(RemoteSlice, u32),
    Read(RemoteSlice),
}

impl RemoteOp {
    /// Whether the device writes local memory (a read's destination).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn reads_remote(self) -> bool {
        matches!(self, RemoteOp::Read(_))
    }

    /// Whether the data flows from local memory to the peer.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn outbound(self) -> bool {
        matches!(self, RemoteOp::Send | RemoteOp::SendWithImm(_) | RemoteOp::Write(_) | RemoteOp::WriteWithImm(..))
    }

    pub(crate) fn opcode(self) -> Opcode {
        match self {
            RemoteOp::Send => Opcode::Send,
            RemoteOp::SendWithImm(_) => Opcode::SendWithImm,
            RemoteOp::Write(_) => Opcode::Write,
            RemoteOp::WriteWithImm(..) => Opcode::WriteWithImm,
            RemoteOp::Read(_) => Opcode::Read,
        }
    }

    /// Checks the peer's range against a local range of `len` bytes, as the
    /// device would: the right the operation needs was granted, and the two
    /// ranges are the same length. Sends have no remote range.
    pub(crate) fn check_remote(self, len: u64) -> Result<()> {
        let (r, needed) = match self {
            RemoteOp::Write(r) | RemoteOp::WriteWithImm(r, _) => (r, Access::REMOTE_WRITE),
            RemoteOp::Read(r) => (r, Access::REMOTE_READ),
            RemoteOp::Send | RemoteOp::SendWithImm(_) => return Ok(()),
        };
        if !r.access().contains(needed) {
            return Err(Error::AccessDenied { needed, granted: r.access() });
        }
        if len != r.len() {
            return Err(Error::LengthMismatch { local: len, remote: r.len() });
        }
        Ok(())
    }
}

/// How a post ended.
pub(crate) enum Posted {
    /// In flight.
    Ok(OpId),
    /// Refused before anything reached the device: the buffer is free.
    /// (Errors are boxed: a `Posted` is passed by value on every post.)
    Refused(Box<Error>),
    /// Part of it reached the device and the connection broke: the buffer
    /// must stay with the connection until it is torn down (verbs only).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Stuck(OpId, Box<Error>),
}

impl Posted {
    /// Refused with `e`.
    #[cold]
    #[inline(never)]
    pub(crate) fn refused(e: Error) -> Self {
        Posted::Refused(Box::new(e))
    }
}

/// The longest run of requests posted unsignaled: at least every this
/// many, one is signaled.
const MAX_QUIET_RUN: u32 = 64;

/// A send posted unsignaled (a quiet send): no completion reports it, so
/// its outcome follows from the send queue's order (see [`QueueCore`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QuietSend {
    /// Its place in the send queue.
    pub seq: u64,
    pub opcode: Opcode,
    pub len: u32,
    /// Its data was copied at post time (inline): nothing of the caller's
    /// stays with the device. Otherwise the caller's buffer must outlive it.
    pub inline: bool,
}

impl QuietSend {
    /// Its completion once it succeeded, on queue pair `qp_num`.
    #[inline]
    pub(crate) fn success(&self, qp_num: u32) -> Completion {
        Completion {
            wr_id: crate::ops::quiet_wr_id(self.seq),
            opcode: self.opcode,
            status: crate::completion::WcStatus::Success,
            byte_len: self.len,
            imm: None,
            qp_num,
            vendor_err: 0,
        }
    }
}

/// How an inline send was posted: tracked like any operation, or quiet.
pub(crate) enum PostedInline {
    Tracked(Posted),
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Quiet(QuietSend),
}

/// What bounds a connection's queues, fixed when it is established.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The domain whose buffers this connection may use.
    pub domain_id: u64,
    pub send_depth: u32,
    pub recv_depth: u32,
    /// The largest single message (send, or write with immediate).
    pub max_message: u64,
    /// The queue pair's number, for the completions of quiet sends.
    pub qp_num: u32,
}

/// The send queue in request order. A reliable connection completes its
/// send queue in order, so the completion of a signaled request says every
/// request before it is done, and a send posted unsignaled ("quiet", as
/// perftest and UCX post most of theirs) needs no completion of its own:
/// it is done once a signaled request after it is, and its credit comes
/// back with that request's. Any failure is reported whether signaled or
/// not, and the first one in queue order decides the quiet sends after it.
#[derive(Debug, Default)]
struct SendOrder {
    /// The place of the next request posted.
    next: u64,
    /// Every request before this place has completed.
    done: u64,
    /// Quiet sends posted since the last signaled request: the last
    /// `quiet` places, with a signaled request at or after every place
    /// before them.
    quiet: u32,
    /// `next` when a poll last looked for a quiet send's outcome in vain.
    looked: u64,
    /// The first request that failed, in queue order, and its completion.
    failed: Option<(u64, Completion)>,
}

/// The queue core both transports run on, with no I/O: the operation
/// table, the send and receive credits, whether (and why) the connection is
/// lost, and the checks every post passes. A transport holds it under its
/// lock, posts what the core admits, and feeds it the completions it sees.
pub(crate) struct QueueCore {
    table: OpTable,
    limits: Limits,
    send_used: u32,
    recv_used: u32,
    /// Why the connection can no longer be used; the first reason stays.
    lost: Option<String>,
    order: SendOrder,
    /// At most this many requests in a row go unsignaled.
    moderation: u32,
    /// Buffers of quiet sends whose handles were dropped before their
    /// outcome was known, oldest first: each is dropped once a later
    /// signaled request's completion says the device is done with it.
    quiet_orphans: std::collections::VecDeque<(u64, Orphan)>,
    /// Counts what can make a waiter's condition true: completions, the
    /// loss, credits an abort gave back. A waiter that finds the count
    /// unchanged since its last look has nothing new to look at.
    changes: u64,
    /// [`succeeded_below`](Self::succeeded_below), published each time a
    /// send's completion moves it, for a transport to read without its
    /// lock ([`succeeded_mark`](Self::succeeded_mark)).
    succeeded: Arc<AtomicU64>,
}

impl QueueCore {
    pub(crate) fn new(limits: Limits) -> Self {
        // A signaled request at least every quarter of the queue (and
        // every MAX_QUIET_RUN): credits come back well before it fills.
        let moderation = (limits.send_depth / 4).clamp(1, MAX_QUIET_RUN);
        QueueCore {
            // Sized once for the queues, as the device sizes its work
            // queues: no operation allocates in steady state, however many
            // are in flight.
            table: OpTable::with_capacity(limits.send_depth as usize + limits.recv_depth as usize),
            limits,
            send_used: 0,
            recv_used: 0,
            lost: None,
            order: SendOrder::default(),
            moderation,
            quiet_orphans: std::collections::VecDeque::new(),
            changes: 0,
            succeeded: Arc::new(AtomicU64::new(0)),
        }
    }

    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Why the connection was lost, if it was.
    pub(crate) fn lost(&self) -> Option<&str> {
        self.lost.as_deref()
    }

    /// Marks the connection lost; the first reason stays. Whether this call
    /// lost it.
    pub(crate) fn lose(&mut self, reason: impl FnOnce() -> String) -> bool {
        if self.lost.is_some() {
            return false;
        }
        self.lost = Some(reason());
        self.changes = self.changes.wrapping_add(1);
        true
    }

    fn lost_error(&self) -> Option<Error> {
        self.lost.as_ref().map(|reason| Error::ConnectionLost { reason: reason.clone() })
    }

    /// Whether a local buffer is registered in this connection's domain.
    pub(crate) fn is_local(&self, local: &LocalParts) -> bool {
        local.domain == self.limits.domain_id
    }

    /// Checks a local buffer: it must be registered in this connection's domain.
    pub(crate) fn check_local(&self, local: &LocalParts) -> Result<()> {
        if !self.is_local(local) {
            return Err(Error::DomainMismatch {
                what: "buffer",
                registered: local.domain,
                used_with: "connection",
                expected: self.limits.domain_id,
            });
        }
        Ok(())
    }

    /// Checks a work item as a device would (its buffer, the remote right
    /// and length, the message limit); returns its byte count.
    pub(crate) fn check_item(&self, item: &WorkItem) -> Result<u64> {
        let len = match &item.local {
            Some(l) => {
                self.check_local(l)?;
                l.len as u64
            }
            None => 0,
        };
        item.op.check_remote(len)?;
        // A send or a write with immediate is one message (the latter consumes one receive).
        let one_message = matches!(item.op, RemoteOp::Send | RemoteOp::SendWithImm(_) | RemoteOp::WriteWithImm(..));
        if one_message && len > self.limits.max_message {
            return Err(Error::MessageTooLarge { len, max: self.limits.max_message });
        }
        Ok(len)
    }

    /// Whether `n` send-queue requests can be posted: `Ok(true)` now,
    /// `Ok(false)` once completions free room. An error when they never
    /// can: the connection is lost, or the queue holds fewer.
    pub(crate) fn send_room(&self, n: u32) -> Result<bool> {
        if self.lost.is_some() || n > self.limits.send_depth {
            return Err(self.send_refused(n));
        }
        Ok(self.send_used + n <= self.limits.send_depth)
    }

    /// Why [`send_room`](Self::send_room) refuses `n` requests: the
    /// connection is lost, or they could never fit.
    #[cold]
    #[inline(never)]
    fn send_refused(&self, n: u32) -> Error {
        self.lost_error().unwrap_or(Error::TooManyRequests { requests: u64::from(n), depth: self.limits.send_depth })
    }

    /// Why [`start_recv`](Self::start_recv) refuses: the connection is
    /// lost, or every receive credit is in use.
    #[cold]
    #[inline(never)]
    fn recv_refused(&self) -> Error {
        self.lost_error().unwrap_or(Error::QueueFull { queue: "receive", depth: self.limits.recv_depth })
    }

    /// The error for a send queue that stayed full until the deadline.
    pub(crate) fn send_full(&self) -> Error {
        Error::QueueFull { queue: "send", depth: self.limits.send_depth }
    }

    /// Starts an operation of `n` send-queue requests moving `bytes`, taking
    /// their credits. Call only after [`send_room`](Self::send_room) said `Ok(true)`.
    pub(crate) fn start_send(&mut self, opcode: Opcode, n: u32, bytes: u64) -> OpId {
        debug_assert!(self.send_used + n <= self.limits.send_depth && self.lost.is_none());
        self.send_used += n;
        let o = &mut self.order;
        let carried = std::mem::take(&mut o.quiet);
        o.next += u64::from(n);
        self.table.start(opcode, Held { send_wrs: n, recv_wrs: 0, carried, sq_end: o.next }, Some(bytes))
    }

    /// Whether the next send must be signaled: enough quiet ones went before it.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn must_signal(&self) -> bool {
        self.order.quiet + 1 >= self.moderation
    }

    /// Starts a quiet send of `len` bytes, taking one credit, which comes
    /// back with the next signaled request's completion. Call only after
    /// [`send_room`](Self::send_room) said `Ok(true)` and
    /// [`must_signal`](Self::must_signal) said `false`.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn start_quiet(&mut self, opcode: Opcode, len: u32, inline: bool) -> QuietSend {
        debug_assert!(self.send_used < self.limits.send_depth && self.lost.is_none());
        self.send_used += 1;
        let o = &mut self.order;
        o.quiet += 1;
        o.next += 1;
        QuietSend { seq: o.next - 1, opcode, len, inline }
    }

    /// The handle of quiet send `q` was dropped: keeps `buffer` until the
    /// device is done with `q`, or hands it back at once when it already is.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn orphan_quiet(&mut self, q: &QuietSend, buffer: Orphan) -> Option<Orphan> {
        if q.seq < self.order.done {
            return Some(buffer);
        }
        self.quiet_orphans.push_back((q.seq, buffer));
        None
    }

    /// Drops the quiet sends' orphaned buffers the device is done with.
    fn release_quiet_orphans(&mut self) {
        while self.quiet_orphans.front().is_some_and(|(seq, _)| *seq < self.order.done) {
            self.quiet_orphans.pop_front();
        }
    }

    /// Forgets the quiet send just started, which the device never saw.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn abort_quiet(&mut self, q: QuietSend) {
        debug_assert_eq!(q.seq + 1, self.order.next);
        self.order.next -= 1;
        self.order.quiet -= 1;
        self.send_used -= 1;
        self.changes = self.changes.wrapping_add(1);
    }

    /// Whether nothing was posted since the last call (which found a quiet
    /// send's outcome unknown): then polling alone would not learn it.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn idle_since_last_look(&mut self) -> bool {
        let idle = self.order.looked == self.order.next;
        self.order.looked = self.order.next;
        idle
    }

    /// Quiet sends waiting for a signaled request to carry their credits.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn quiet_waiting(&self) -> u32 {
        self.order.quiet
    }

    /// Whether a signaled request was posted after the quiet send at `seq`
    /// (its completion will say whether that send is done).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn covered(&self, seq: u64) -> bool {
        self.order.next - u64::from(self.order.quiet) > seq
    }

    /// Every quiet send placed below this has succeeded: the send queue
    /// completed up to here, and no request before it failed. It only
    /// grows, so it is published for a look without the lock (see
    /// [`succeeded_mark`](Self::succeeded_mark)).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn succeeded_below(&self) -> u64 {
        match self.order.failed {
            Some((at, _)) => self.order.done.min(at),
            None => self.order.done,
        }
    }

    /// Where [`succeeded_below`](Self::succeeded_below) is published, kept
    /// current by every send completion: a quiet send placed below what it
    /// holds (read with `Acquire`) succeeded, and the device is done with
    /// its buffer; the transport answers it with [`QuietSend::success`].
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn succeeded_mark(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.succeeded)
    }

    /// Publishes [`succeeded_below`](Self::succeeded_below) after a send's
    /// completion. Release: a thread that reads it and reuses a quiet
    /// send's buffer does so after the completion that made it grow.
    fn publish_succeeded(&self) {
        self.succeeded.store(self.succeeded_below(), Ordering::Release);
    }

    /// The outcome of a quiet send, once known: success if every request
    /// up to it completed and none before it failed; its own error if it
    /// failed; the loss if an earlier request failed (it was flushed).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn quiet_outcome(&self, q: &QuietSend) -> Option<OpOutcome> {
        if q.seq >= self.order.done {
            return None;
        }
        let c = q.success(self.limits.qp_num);
        Some(match self.order.failed {
            Some((at, failed)) if at == q.seq => {
                OpTable::outcome(Completion { opcode: q.opcode, ..failed }, self.lost())
            }
            Some((at, _)) if at < q.seq => {
                OpTable::outcome(Completion { status: crate::completion::WcStatus::WrFlush, ..c }, self.lost())
            }
            _ => Ok(c),
        })
    }

    /// Starts a receive, taking a receive credit.
    ///
    /// # Errors
    /// [`Error::ConnectionLost`], or [`Error::QueueFull`] when every receive credit is in use.
    #[inline(always)]
    pub(crate) fn start_recv(&mut self) -> Result<OpId> {
        if self.lost.is_some() || self.recv_used >= self.limits.recv_depth {
            return Err(self.recv_refused());
        }
        self.recv_used += 1;
        Ok(self.table.start(Opcode::Recv, Held { recv_wrs: 1, ..Held::default() }, None))
    }

    /// Forgets an operation the device never saw, giving its credits back.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn abort(&mut self, id: OpId) {
        let held = self.table.abort(id);
        if held.sq_end > 0 {
            // The quiet sends it carried wait for the next signaled request again.
            let o = &mut self.order;
            o.next = held.sq_end - u64::from(held.send_wrs);
            o.quiet += held.carried;
        }
        self.release(Held { carried: 0, ..held });
        self.changes = self.changes.wrapping_add(1);
    }

    fn release(&mut self, held: Held) {
        let send = held.send_wrs + held.carried;
        self.send_used -= send.min(self.send_used);
        self.recv_used -= held.recv_wrs.min(self.recv_used);
    }

    /// Records one completion: at an operation's final request its credits
    /// come back, and an orphaned buffer is handed out to be dropped (the
    /// device is done with it).
    #[inline(always)]
    pub(crate) fn complete(&mut self, raw: &RawCompletion) -> Option<Orphan> {
        self.changes = self.changes.wrapping_add(1);
        if let Some(seq) = quiet_seq(raw.wr_id) {
            // A quiet send reports only a failure (or its flush).
            self.failed_at(seq, raw);
            self.order.done = self.order.done.max(seq + 1);
            self.publish_succeeded();
            self.release_quiet_orphans();
            return None;
        }
        let (held, orphan, failed) = self.table.complete(raw);
        self.settle(held, failed, raw);
        orphan
    }

    /// [`complete`](Self::complete) and [`take`](Self::take) of `want` at
    /// once, when `raw` is its successful final completion and its handle
    /// is the one waiting (see [`OpTable::complete_taking`]): the
    /// completion, handed over without being stored. `None`, with nothing
    /// changed, otherwise: then `raw` is recorded with `complete`.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    #[inline(always)]
    pub(crate) fn complete_taking(&mut self, raw: &RawCompletion, want: OpId) -> Option<Completion> {
        let (held, completion) = self.table.complete_taking(raw, want)?;
        self.changes = self.changes.wrapping_add(1);
        self.settle(held, false, raw);
        Some(completion)
    }

    /// An operation's final completion (`failed`: it failed) gives back
    /// what it held: its place in the send queue's order, its credits.
    #[inline(always)]
    fn settle(&mut self, held: Held, failed: bool, raw: &RawCompletion) {
        if held.sq_end > 0 {
            if failed {
                self.failed_at(held.sq_end - u64::from(held.send_wrs), raw);
            }
            self.order.done = self.order.done.max(held.sq_end);
            self.publish_succeeded();
            if !self.quiet_orphans.is_empty() {
                self.release_quiet_orphans();
            }
        }
        self.release(held);
    }

    /// Records the first failure in the send queue (the earliest: the
    /// queue completes in order).
    fn failed_at(&mut self, seq: u64, raw: &RawCompletion) {
        if self.order.failed.is_none() && !raw.status.is_success() {
            let c = Completion {
                wr_id: raw.wr_id,
                opcode: Opcode::Send,
                status: raw.status,
                byte_len: 0,
                imm: None,
                qp_num: raw.qp_num,
                vendor_err: raw.vendor_err,
            };
            self.order.failed = Some((seq, c));
        }
    }

    /// The count of changes a waiter may be waiting for (see the field):
    /// equal counts, no news.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn changes(&self) -> u64 {
        self.changes
    }

    /// Whether the operation has an outcome to take.
    pub(crate) fn is_done(&self, id: OpId) -> bool {
        self.table.is_done(id)
    }

    /// Takes `id`'s outcome if it is done, else has `waker` woken when it
    /// is (at its final completion, or the flush after a loss).
    pub(crate) fn take_or_register(&mut self, id: OpId, waker: &std::task::Waker) -> Option<OpOutcome> {
        if let Some(outcome) = self.take(id) {
            return Some(outcome);
        }
        if self.table.register(id, waker) {
            None
        } else {
            // Neither done nor in flight: a stale id (never a live operation's).
            Some(Err(Box::new(Error::AlreadyReported)))
        }
    }

    /// Whether `id` is done (or not in flight at all), else has `waker`
    /// woken when it is, leaving its outcome to be taken: for a waiter that
    /// does not own the operation (an awaited staged pipeline's network step).
    pub(crate) fn done_or_register(&mut self, id: OpId, waker: &std::task::Waker) -> bool {
        self.is_done(id) || !self.table.register(id, waker)
    }

    /// Takes a finished operation's outcome.
    pub(crate) fn take(&mut self, id: OpId) -> Option<OpOutcome> {
        self.table.take(id, self.lost.as_deref())
    }

    /// The handle of `id` was dropped: keeps `buffer` until the operation
    /// completes, or hands it back at once when it already has.
    pub(crate) fn orphan(&mut self, id: OpId, buffer: Orphan) -> Option<Orphan> {
        self.table.orphan(id, buffer)
    }

    /// Every orphaned buffer: only once the device can no longer touch them.
    pub(crate) fn take_orphans(&mut self) -> Vec<Orphan> {
        let mut out = self.table.take_orphans();
        out.extend(self.quiet_orphans.drain(..).map(|(_, buffer)| buffer));
        out
    }

    /// Operations in flight that a completion will still report (quiet
    /// sends' orphaned buffers not counted: a successful quiet send reports
    /// nothing of its own).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn reported_in_flight(&self) -> usize {
        self.table.in_flight()
    }

    /// Operations in flight and, of those, orphaned (a quiet send counts
    /// only once orphaned: nothing else tracks it).
    pub(crate) fn stats(&self) -> (usize, usize) {
        let quiet = self.quiet_orphans.len();
        (self.table.in_flight() + quiet, self.table.orphans() + quiet)
    }

    /// Send and receive credits in use.
    #[cfg(test)]
    fn credits(&self) -> (u32, u32) {
        (self.send_used, self.recv_used)
    }
}

/// The threads asleep waiting on a connection (the verbs transport's, on
/// its completion channel), and which of the queue's changes they were
/// told of. Another thread can reap the completion a sleeper waits for,
/// taking the channel's event with it, between the sleeper's last look and
/// its poll(2): the sleeper would then sleep through it. So a sleeper lies
/// down at the change count it last looked at, under the queue's lock, and
/// whoever unlocks the queue after changing it rings a bell the sleeper
/// also polls (a ring before the poll is kept). No I/O here: this says
/// when to ring and when to drain.
///
/// The bell is drained once every thread asleep at the last ring has got
/// up. Not sooner: one of them would sleep on. Not only when nobody
/// sleeps: two waiters taking turns would each find the other asleep,
/// leave the bell rung, and wake each other for ever. A thread lying down
/// after the ring may find it still rung and look once more for nothing;
/// those who hold the ring up are already woken and about to get up.
#[derive(Debug, Default)]
pub(crate) struct Sleepers {
    /// Asleep now.
    count: u32,
    /// The change count the sleepers were last told of (or lay down at).
    told: u64,
    /// Rings so far.
    rings: u64,
    /// Of those asleep at the last ring, how many have not got up.
    unwoken: u32,
}

/// When a sleeper lay down: the rings before it (see [`Sleepers::get_up`]).
#[derive(Clone, Copy, Debug)]
#[must_use = "a sleeper gets up with its ticket"]
pub(crate) struct Ticket(u64);

impl Sleepers {
    /// One more sleeper, who last looked at change count `changes`.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn lie_down(&mut self, changes: u64) -> Ticket {
        self.count += 1;
        // Ringing for what this sleeper saw would wake it for nothing; any
        // change before that rang at the unlock after it, if anyone slept.
        self.told = changes;
        Ticket(self.rings)
    }

    /// The sleeper with `ticket` is up; whether the bell must be drained
    /// now (every thread asleep at the last ring is up).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn get_up(&mut self, ticket: Ticket) -> bool {
        self.count -= 1;
        // A ring since it lay down found it asleep: it was counted.
        if ticket.0 != self.rings {
            self.unwoken -= 1;
            return self.unwoken == 0;
        }
        false
    }

    /// Whether the bell must ring as the queue, now at `changes`, is
    /// unlocked: someone sleeps and was not told of these changes (then
    /// they count as told). One comparison when nobody sleeps.
    #[inline(always)]
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn must_ring(&mut self, changes: u64) -> bool {
        if self.count == 0 || self.told == changes {
            return false;
        }
        self.told = changes;
        self.rings += 1;
        self.unwoken = self.count;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::Access;
    use crate::completion::WcStatus;
    use crate::remote::RemoteRegion;

    fn slice(addr: u64, len: u64, access: Access) -> RemoteSlice {
        RemoteRegion { tag: 0, addr, len, rkey: 5, access }.whole()
    }

    const DOMAIN: u64 = 7;

    fn core(send_depth: u32, recv_depth: u32) -> QueueCore {
        QueueCore::new(Limits { domain_id: DOMAIN, send_depth, recv_depth, max_message: 1 << 20, qp_num: 1 })
    }

    fn completion(wr_id: u64, status: WcStatus) -> RawCompletion {
        RawCompletion { wr_id, status, byte_len: 0, imm: None, qp_num: 1, vendor_err: 0, by_write_imm: false }
    }

    fn done(id: OpId, last: bool, status: WcStatus) -> RawCompletion {
        completion(id.wr_id(last), status)
    }

    fn local(len: usize, domain: u64) -> LocalParts {
        LocalParts { addr: 0x1000, len, lkey: 1, domain, path: None }
    }

    #[test]
    fn send_credits_are_taken_at_start_and_returned_at_the_final_completion() {
        let mut q = core(4, 2);
        assert!(q.send_room(4).unwrap());
        let a = q.start_send(Opcode::Write, 3, 300);
        assert_eq!(q.credits(), (3, 0));
        assert!(q.send_room(1).unwrap());
        assert!(!q.send_room(2).unwrap(), "3 + 2 > 4: wait for completions");
        let b = q.start_send(Opcode::Send, 1, 10);
        assert!(!q.send_room(1).unwrap());
        // Earlier requests of a chain give nothing back; its final one gives all three.
        assert!(q.complete(&done(a, false, WcStatus::Success)).is_none());
        assert_eq!(q.credits(), (4, 0));
        q.complete(&done(a, true, WcStatus::Success));
        assert_eq!(q.credits(), (1, 0));
        assert!(q.send_room(3).unwrap());
        q.complete(&done(b, true, WcStatus::Success));
        assert_eq!(q.credits(), (0, 0));
        // More than the queue holds can never be posted.
        assert!(matches!(q.send_room(5), Err(Error::TooManyRequests { requests: 5, depth: 4 })));
        // A completion seen twice (or a stale one) returns nothing twice.
        q.complete(&done(b, true, WcStatus::Success));
        assert_eq!(q.credits(), (0, 0));
    }

    /// Counts its wakes.
    struct Count(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn a_registered_waker_is_woken_once_at_the_final_completion_or_the_flush() {
        use std::sync::Arc;
        use std::sync::atomic::Ordering::SeqCst;
        let mut q = core(4, 2);
        let count = Arc::new(Count(Default::default()));
        let waker = std::task::Waker::from(Arc::clone(&count));
        let a = q.start_send(Opcode::Write, 2, 8);
        assert!(q.take_or_register(a, &waker).is_none(), "in flight: registered");
        assert!(q.take_or_register(a, &waker).is_none(), "registering again replaces, never doubles");
        q.complete(&done(a, false, WcStatus::Success));
        assert_eq!(count.0.load(SeqCst), 0, "an unsignaled part wakes nobody");
        q.complete(&done(a, true, WcStatus::Success));
        assert_eq!(count.0.load(SeqCst), 1);
        assert!(matches!(q.take_or_register(a, &waker), Some(Ok(_))), "done: the outcome, no registration");
        assert!(
            matches!(q.take_or_register(a, &waker).map(|o| o.map_err(|e| *e)), Some(Err(Error::AlreadyReported))),
            "taken: a stale id"
        );
        // An orphaned operation wakes nobody (its handle is gone).
        let b = q.start_send(Opcode::Send, 1, 1);
        assert!(q.take_or_register(b, &waker).is_none());
        assert!(q.orphan(b, Box::new(())).is_none());
        q.complete(&done(b, true, WcStatus::Success));
        assert_eq!(count.0.load(SeqCst), 1);
        // A loss: the flush wakes with the loss as the outcome.
        let r = q.start_recv().unwrap();
        assert!(q.take_or_register(r, &waker).is_none());
        q.lose(|| "the peer died".into());
        q.complete(&done(r, true, WcStatus::WrFlush));
        assert_eq!(count.0.load(SeqCst), 2);
        assert!(matches!(q.take(r).map(|o| o.map_err(|e| *e)), Some(Err(Error::ConnectionLost { .. }))));
    }

    #[test]
    fn receive_credits_run_out_and_come_back() {
        let mut q = core(4, 2);
        let r1 = q.start_recv().unwrap();
        let _r2 = q.start_recv().unwrap();
        assert!(matches!(q.start_recv(), Err(Error::QueueFull { queue: "receive", depth: 2 })));
        q.complete(&done(r1, true, WcStatus::Success));
        assert_eq!(q.credits(), (0, 1));
        q.start_recv().unwrap();
    }

    #[test]
    fn an_aborted_post_gives_its_credits_and_slot_back() {
        let mut q = core(2, 1);
        let a = q.start_send(Opcode::Write, 2, 8);
        q.abort(a);
        assert_eq!(q.credits(), (0, 0));
        assert_eq!(q.stats(), (0, 0));
        assert!(q.take(a).is_none(), "an aborted operation has no outcome");
        let r = q.start_recv().unwrap();
        q.abort(r);
        assert_eq!(q.credits(), (0, 0));
        q.abort(r);
        assert_eq!(q.credits(), (0, 0), "aborting twice returns nothing twice");
    }

    #[test]
    fn every_change_a_waiter_may_wait_for_moves_the_change_count() {
        let mut q = core(4, 2);
        let mut last = q.changes();
        let mut moved = |q: &QueueCore| {
            let now = q.changes();
            std::mem::replace(&mut last, now) != now
        };
        // Starting, taking and orphaning make no waiter's condition true.
        let a = q.start_send(Opcode::Write, 2, 8);
        let r = q.start_recv().unwrap();
        let quiet = q.start_quiet(Opcode::Send, 1, true);
        assert!(!moved(&q));
        // Giving credits back does: an aborted quiet send and an aborted operation.
        q.abort_quiet(quiet);
        assert!(moved(&q));
        q.abort(r);
        assert!(moved(&q));
        // Every completion does, an early part of a chain included (it may fail it).
        q.complete(&done(a, false, WcStatus::Success));
        assert!(moved(&q));
        q.complete(&done(a, true, WcStatus::Success));
        assert!(moved(&q));
        q.take(a).unwrap().unwrap();
        assert!(!moved(&q));
        // The loss does, once.
        assert!(q.lose(|| "test".into()));
        assert!(moved(&q));
        assert!(!q.lose(|| "again".into()));
        assert!(!moved(&q));
    }

    #[test]
    fn sleepers_are_rung_once_for_each_change_they_were_not_told_of() {
        let mut q = core(4, 2);
        let mut s = Sleepers::default();
        // Nobody asleep: changes ring nothing.
        let a = q.start_send(Opcode::Write, 1, 8);
        q.complete(&done(a, true, WcStatus::Success));
        assert!(!s.must_ring(q.changes()));
        // A sleeper who saw the queue as it is now is not woken for it.
        let first = s.lie_down(q.changes());
        assert!(!s.must_ring(q.changes()));
        // Another thread reaps a completion while it sleeps: one ring, at
        // the first unlock after it, however often the queue is unlocked.
        let b = q.start_send(Opcode::Write, 1, 8);
        assert!(!s.must_ring(q.changes()), "starting an operation wakes no waiter");
        q.complete(&done(b, true, WcStatus::Success));
        assert!(s.must_ring(q.changes()));
        assert!(!s.must_ring(q.changes()));
        // A second sleeper lies down after the ring: the first, rung, is
        // still to get up, so the bell stays rung for it.
        let c = q.start_send(Opcode::Write, 1, 8);
        let second = s.lie_down(q.changes());
        // The loss rings again, for both.
        assert!(q.lose(|| "test".into()));
        assert!(s.must_ring(q.changes()));
        assert!(!s.get_up(first), "the second, asleep at the ring, is not up yet");
        assert!(s.get_up(second), "everyone asleep at the last ring is up: drain");
        // Nobody asleep again: nothing rings.
        q.complete(&done(c, true, WcStatus::WrFlush));
        assert!(!s.must_ring(q.changes()));
    }

    #[test]
    fn two_waiters_taking_turns_do_not_keep_the_bell_rung() {
        let mut q = core(4, 2);
        let mut s = Sleepers::default();
        let a = s.lie_down(q.changes());
        let b = s.lie_down(q.changes());
        let op = q.start_send(Opcode::Write, 1, 8);
        q.complete(&done(op, true, WcStatus::Success));
        assert!(s.must_ring(q.changes()));
        // `a` wakes, finds nothing for itself, and lies down again before
        // `b` is up: someone is always asleep, yet the bell is drained once
        // `b` gets up, so `a` then sleeps, not spins.
        assert!(!s.get_up(a));
        let a = s.lie_down(q.changes());
        assert!(!s.get_up(a), "a came after the ring: it holds nothing up");
        let a = s.lie_down(q.changes());
        assert!(s.get_up(b), "b was the last asleep at the ring");
        assert!(!s.must_ring(q.changes()), "nothing changed since: no ring for a");
        assert!(!s.get_up(a));
    }

    #[test]
    fn completions_in_any_order_reach_their_own_operations() {
        let mut q = core(64, 64);
        let ops: Vec<(OpId, Opcode)> = (0..32)
            .map(|i| match i % 3 {
                0 => (q.start_recv().unwrap(), Opcode::Recv),
                1 => (q.start_send(Opcode::Write, 1, i), Opcode::Write),
                _ => (q.start_send(Opcode::Read, 1, i), Opcode::Read),
            })
            .collect();
        // Completed in reverse, odd ones first.
        let order: Vec<usize> =
            (0..32).rev().filter(|i| i % 2 == 1).chain((0..32).rev().filter(|i| i % 2 == 0)).collect();
        for &i in &order {
            let (id, _) = ops[i];
            let status = if i == 5 { WcStatus::RemoteAccess } else { WcStatus::Success };
            q.complete(&RawCompletion { byte_len: i as u32, ..done(id, true, status) });
        }
        for (i, (id, opcode)) in ops.iter().enumerate() {
            let outcome = q.take(*id).expect("done");
            match outcome {
                Ok(c) => {
                    assert_eq!(c.opcode, *opcode, "op {i}");
                    // Send-queue operations report what they moved; receives what arrived.
                    assert_eq!(u64::from(c.byte_len), i as u64, "op {i}");
                }
                Err(e) => assert!(i == 5 && e.is_remote_access(), "op {i}: {e}"),
            }
        }
        assert_eq!(q.credits(), (0, 0));
        // Slots are reused, and a reused slot's new operation is not the old one.
        let again = q.start_send(Opcode::Send, 1, 0);
        assert!(ops.iter().all(|(id, _)| *id != again));
        q.complete(&done(ops[0].0, true, WcStatus::Success));
        assert!(!q.is_done(again), "a stale completion does not complete the slot's new operation");
    }

    #[test]
    fn the_first_error_in_a_chain_is_the_operation_outcome() {
        let mut q = core(8, 1);
        let a = q.start_send(Opcode::Write, 4, 4096);
        q.complete(&done(a, false, WcStatus::Success));
        q.complete(&done(a, false, WcStatus::RemoteAccess));
        q.complete(&done(a, false, WcStatus::RemoteOperation));
        assert!(!q.is_done(a), "not done before the final request");
        // The connection broke on the error; the rest of the chain is flushed.
        assert!(q.lose(|| "the queue pair went to the error state".into()));
        assert!(!q.lose(|| "a later reason".into()), "the first reason stays");
        q.complete(&done(a, true, WcStatus::WrFlush));
        let err = q.take(a).unwrap().unwrap_err();
        assert!(err.is_remote_access(), "the first error, not the flush: {err}");
        // Operations that were only flushed say the connection was lost, and why.
        let mut q = core(8, 1);
        let b = q.start_send(Opcode::Send, 1, 1);
        q.lose(|| "the peer closed the connection".into());
        q.complete(&done(b, true, WcStatus::WrFlush));
        match q.take(b).unwrap().map_err(|e| *e) {
            Err(Error::ConnectionLost { reason }) => assert!(reason.contains("peer closed"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_lost_connection_refuses_new_posts_and_still_completes_old_ones() {
        let mut q = core(8, 8);
        let a = q.start_send(Opcode::Write, 1, 1);
        let r = q.start_recv().unwrap();
        q.lose(|| "the peer died".into());
        // Credits or not, nothing new starts; the refusal says why.
        assert!(matches!(q.send_room(1), Err(Error::ConnectionLost { reason }) if reason == "the peer died"));
        assert!(matches!(q.start_recv(), Err(Error::ConnectionLost { reason }) if reason == "the peer died"));
        q.complete(&done(a, true, WcStatus::WrFlush));
        q.complete(&done(r, true, WcStatus::WrFlush));
        assert!(q.take(a).unwrap().is_err() && q.take(r).unwrap().is_err());
        assert_eq!(q.credits(), (0, 0));
    }

    /// A buffer that counts its drops.
    struct Tracked(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn a_waiters_success_is_taken_straight_from_the_poll_and_leaves_what_complete_then_take_would() {
        let mut q = core(4, 4);
        let r = q.start_recv().unwrap();
        let s = q.start_send(Opcode::Send, 2, 10);
        let before = q.changes();
        // Another operation's completion, a chain's earlier request, a failure:
        // declined, with nothing changed.
        assert!(q.complete_taking(&done(s, true, WcStatus::Success), r).is_none());
        assert!(q.complete_taking(&done(s, false, WcStatus::Success), s).is_none());
        assert!(q.complete_taking(&done(r, true, WcStatus::LocalLength), r).is_none());
        assert_eq!((q.changes(), q.credits(), q.stats()), (before, (2, 1), (2, 0)));
        // The receive's success: handed over, its credit back, its slot free.
        let raw = RawCompletion { byte_len: 1000, imm: Some(9), ..done(r, true, WcStatus::Success) };
        let c = q.complete_taking(&raw, r).expect("its own successful final completion");
        assert_eq!((c.wr_id, c.opcode, c.byte_len, c.imm), (r.wr_id(false), Opcode::Recv, 1000, Some(9)));
        assert_ne!(q.changes(), before, "a waiter of another operation looks again");
        assert_eq!((q.credits(), q.stats()), ((2, 0), (1, 0)));
        assert!(!q.is_done(r) && q.take(r).is_none(), "nothing left to take");
        assert!(q.complete_taking(&raw, r).is_none(), "a repeat is stale");
        // A send's: the bytes it moved, its credits back, the send queue's order past it.
        assert!(q.complete(&done(s, false, WcStatus::Success)).is_none());
        let c = q.complete_taking(&done(s, true, WcStatus::Success), s).unwrap();
        assert_eq!((c.opcode, c.byte_len, q.credits(), q.stats()), (Opcode::Send, 10, (0, 0), (0, 0)));
        let mark = q.succeeded_mark().load(Ordering::Acquire);
        assert!(q.succeeded_below() >= 2 && mark == q.succeeded_below(), "the send queue's order, published");
        // A chain whose earlier request failed keeps that error: declined, and
        // recorded as usual the error is what it reports.
        let t = q.start_send(Opcode::Write, 2, 20);
        drop(q.complete(&done(t, false, WcStatus::LocalProtection)));
        assert!(q.complete_taking(&done(t, true, WcStatus::Success), t).is_none());
        drop(q.complete(&done(t, true, WcStatus::Success)));
        assert!(matches!(q.take(t), Some(Err(_))));
        // A dropped handle's buffer, or a future to wake: declined (the
        // buffer is released and the future woken by `complete`).
        let o = q.start_recv().unwrap();
        assert!(q.orphan(o, Box::new(())).is_none());
        assert!(q.complete_taking(&done(o, true, WcStatus::Success), o).is_none());
        assert!(q.complete(&done(o, true, WcStatus::Success)).is_some());
        let w = q.start_recv().unwrap();
        let wakes = std::sync::Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)));
        assert!(q.take_or_register(w, &std::task::Waker::from(wakes.clone())).is_none());
        assert!(q.complete_taking(&done(w, true, WcStatus::Success), w).is_none());
        drop(q.complete(&done(w, true, WcStatus::Success)));
        assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(matches!(q.take(w), Some(Ok(_))));
        assert_eq!((q.credits(), q.stats()), ((0, 0), (0, 0)));
    }

    #[test]
    fn orphaned_buffers_are_released_at_the_final_completion_only() {
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = || dropped.load(std::sync::atomic::Ordering::SeqCst);
        let mut q = core(8, 8);
        let a = q.start_send(Opcode::Write, 3, 3);
        assert!(q.orphan(a, Box::new(Tracked(dropped.clone()))).is_none(), "kept while in flight");
        assert_eq!(q.stats(), (1, 1));
        drop(q.complete(&done(a, false, WcStatus::Success)));
        drop(q.complete(&done(a, false, WcStatus::Success)));
        assert_eq!(count(), 0, "not before the final request");
        let released = q.complete(&done(a, true, WcStatus::Success));
        assert!(released.is_some());
        drop(released);
        assert_eq!(count(), 1);
        assert_eq!((q.stats(), q.credits()), ((0, 0), (0, 0)));
        // A finished operation's buffer comes back at once.
        let b = q.start_send(Opcode::Send, 1, 1);
        q.complete(&done(b, true, WcStatus::Success));
        drop(q.orphan(b, Box::new(Tracked(dropped.clone()))));
        assert_eq!(count(), 2);
        // At teardown the core hands over what is still in flight.
        let c = q.start_recv().unwrap();
        assert!(q.orphan(c, Box::new(Tracked(dropped.clone()))).is_none());
        drop(q.take_orphans());
        assert_eq!(count(), 3);
    }

    #[test]
    fn a_dropped_quiet_sends_buffer_is_kept_until_a_later_signaled_request_completes() {
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = || dropped.load(std::sync::atomic::Ordering::SeqCst);
        let mut q = core(64, 1);
        let a = q.start_quiet(Opcode::Send, 8, false);
        let b = q.start_quiet(Opcode::Send, 8, false);
        assert!(q.orphan_quiet(&a, Box::new(Tracked(dropped.clone()))).is_none(), "kept: not known done");
        assert!(q.orphan_quiet(&b, Box::new(Tracked(dropped.clone()))).is_none());
        assert_eq!(q.stats(), (2, 2));
        // A signaled receive says nothing about the send queue.
        let r = q.start_recv().unwrap();
        q.complete(&done(r, true, WcStatus::Success));
        assert_eq!(count(), 0);
        // A signaled send after `a` only: `b` is not covered by it.
        let s = q.start_send(Opcode::Send, 1, 1);
        let c = q.start_quiet(Opcode::Send, 8, false);
        assert!(q.orphan_quiet(&c, Box::new(Tracked(dropped.clone()))).is_none());
        q.complete(&done(s, true, WcStatus::Success));
        assert_eq!(count(), 2, "a and b are done with the signaled send after them");
        assert_eq!(q.stats(), (1, 1), "c is kept (s is done)");
        drop(q.take(s));
        // Known done already: the buffer comes back at once.
        let t = q.start_send(Opcode::Send, 1, 1);
        q.complete(&done(t, true, WcStatus::Success));
        assert_eq!(count(), 3);
        let d = q.start_quiet(Opcode::Send, 8, false);
        let e = q.start_send(Opcode::Send, 1, 1);
        q.complete(&done(e, true, WcStatus::Success));
        assert!(q.orphan_quiet(&d, Box::new(Tracked(dropped.clone()))).is_some());
        // At teardown the core hands over what is still unknown.
        let f = q.start_quiet(Opcode::Send, 8, false);
        assert!(q.orphan_quiet(&f, Box::new(Tracked(dropped.clone()))).is_none());
        let before = count();
        drop(q.take_orphans());
        assert_eq!(count(), before + 1);
        assert_eq!(q.stats().1, 0);
    }

    fn quiet_failed(seq: u64, status: WcStatus) -> RawCompletion {
        completion(crate::ops::quiet_wr_id(seq), status)
    }

    #[test]
    fn quiet_sends_are_done_and_give_credits_back_with_the_next_signaled_request() {
        let mut q = core(8, 1);
        assert_eq!(q.moderation, 2, "a quarter of the queue");
        assert!(!q.must_signal());
        let a = q.start_quiet(Opcode::Send, 4, true);
        assert!(q.must_signal(), "one quiet send, then a signaled one");
        assert_eq!(q.credits(), (1, 0), "a quiet send holds a credit");
        assert!(q.quiet_outcome(&a).is_none() && !q.covered(a.seq));
        let s = q.start_send(Opcode::Send, 1, 2);
        assert!(q.covered(a.seq) && !q.must_signal());
        assert!(q.quiet_outcome(&a).is_none(), "not before the signaled one completes");
        q.complete(&done(s, true, WcStatus::Success));
        let c = q.quiet_outcome(&a).expect("known").expect("succeeded");
        assert_eq!((c.opcode, c.byte_len, c.qp_num), (Opcode::Send, 4, 1));
        assert_eq!(q.credits(), (0, 0), "both credits came back with the one completion");
        // Asking again gives the same answer: the handle keeps it.
        assert!(matches!(q.quiet_outcome(&a), Some(Ok(_))));
    }

    #[test]
    fn a_failed_quiet_send_reports_its_own_error_and_flushes_the_ones_after() {
        let mut q = core(64, 1);
        let sends: Vec<QuietSend> = (0..4).map(|_| q.start_quiet(Opcode::SendWithImm, 1, true)).collect();
        // The third fails (a device reports a failure signaled or not); the
        // connection is lost and the rest are flushed, in queue order.
        q.complete(&quiet_failed(sends[2].seq, WcStatus::RnrRetryExceeded));
        q.lose(|| "the queue pair went to the error state".into());
        q.complete(&quiet_failed(sends[3].seq, WcStatus::WrFlush));
        assert!(matches!(q.quiet_outcome(&sends[0]), Some(Ok(_))), "completed before the failure");
        assert!(matches!(q.quiet_outcome(&sends[1]), Some(Ok(_))));
        match q.quiet_outcome(&sends[2]).map(|o| o.map_err(|e| *e)) {
            Some(Err(Error::Completion(e))) => {
                assert_eq!((e.status, e.opcode), (WcStatus::RnrRetryExceeded, Opcode::SendWithImm))
            }
            other => panic!("{other:?}"),
        }
        match q.quiet_outcome(&sends[3]).map(|o| o.map_err(|e| *e)) {
            Some(Err(Error::ConnectionLost { reason })) => assert!(reason.contains("flushed"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_mark_below_which_quiet_sends_succeeded_grows_with_completions_and_stops_at_a_failure() {
        let mut q = core(64, 1);
        let quiet = |q: &mut QueueCore| q.start_quiet(Opcode::Send, 8, false);
        let a = quiet(&mut q);
        let s = q.start_send(Opcode::Send, 1, 8);
        let mark = q.succeeded_mark();
        assert_eq!(q.succeeded_below(), 0, "nothing completed yet");
        q.complete(&done(s, true, WcStatus::Success));
        assert!(a.seq < q.succeeded_below(), "a is known done without asking for it");
        assert_eq!(mark.load(Ordering::Acquire), q.succeeded_below(), "published as it moved");
        let told = q.quiet_outcome(&a).expect("known").expect("succeeded");
        assert_eq!(told, a.success(1), "what the mark stands for, as the lock would say");
        // Then a failure: sends at or after it never count as succeeded,
        // whatever completes later; the ones before it still do.
        let (b, c, d) = (quiet(&mut q), quiet(&mut q), quiet(&mut q));
        q.complete(&quiet_failed(c.seq, WcStatus::RemoteAccess));
        q.complete(&quiet_failed(d.seq, WcStatus::WrFlush));
        assert_eq!(q.succeeded_below(), c.seq, "b succeeded (completed before c), c failed");
        assert!(matches!(q.quiet_outcome(&b), Some(Ok(_))) && matches!(q.quiet_outcome(&c), Some(Err(_))));
        let e = q.start_send(Opcode::Send, 1, 8);
        q.complete(&done(e, true, WcStatus::WrFlush));
        assert_eq!(q.succeeded_below(), c.seq, "it never passes the first failure");
        assert_eq!(mark.load(Ordering::Acquire), c.seq, "nor does what is published");
    }

    #[test]
    fn a_failed_signaled_request_decides_the_quiet_sends_around_it() {
        let mut q = core(64, 1);
        let before = q.start_quiet(Opcode::Send, 1, true);
        let w = q.start_send(Opcode::Write, 2, 64);
        let after = q.start_quiet(Opcode::Send, 1, true);
        q.complete(&done(w, false, WcStatus::RemoteAccess));
        q.lose(|| "the queue pair went to the error state".into());
        q.complete(&done(w, true, WcStatus::WrFlush));
        assert!(q.take(w).unwrap().unwrap_err().is_remote_access());
        assert!(matches!(q.quiet_outcome(&before), Some(Ok(_))), "before the failed write: done");
        assert!(q.quiet_outcome(&after).is_none(), "its flush has not been seen yet");
        q.complete(&quiet_failed(after.seq, WcStatus::WrFlush));
        assert!(matches!(q.quiet_outcome(&after).map(|o| o.map_err(|e| *e)), Some(Err(Error::ConnectionLost { .. }))));
    }

    #[test]
    fn aborting_a_signaled_request_leaves_the_quiet_sends_before_it_uncovered() {
        let mut q = core(64, 1);
        let a = q.start_quiet(Opcode::Send, 1, true);
        let b = q.start_quiet(Opcode::Send, 1, true);
        let s = q.start_send(Opcode::Send, 3, 3);
        assert!(q.covered(b.seq) && q.quiet_waiting() == 0);
        q.abort(s);
        assert!(!q.covered(a.seq) && !q.covered(b.seq), "nothing signaled follows them now");
        assert_eq!((q.quiet_waiting(), q.credits()), (2, (2, 0)), "their credits wait again");
        // The next signaled request takes the same places and carries them.
        let t = q.start_send(Opcode::Send, 1, 1);
        assert!(q.covered(b.seq));
        q.complete(&done(t, true, WcStatus::Success));
        assert!(matches!(q.quiet_outcome(&a), Some(Ok(_))) && matches!(q.quiet_outcome(&b), Some(Ok(_))));
        assert_eq!(q.credits(), (0, 0));
        // A quiet send the device never saw gives its credit back.
        let c = q.start_quiet(Opcode::Send, 1, true);
        q.abort_quiet(c);
        assert_eq!((q.quiet_waiting(), q.credits()), (0, (0, 0)));
    }

    #[test]
    fn a_poll_after_nothing_was_posted_is_told_to_flush() {
        let mut q = core(64, 1);
        q.start_quiet(Opcode::Send, 1, true);
        assert!(!q.idle_since_last_look(), "the first look: something was posted before it");
        assert!(q.idle_since_last_look(), "nothing posted since");
        q.start_quiet(Opcode::Send, 1, true);
        assert!(!q.idle_since_last_look());
    }

    #[test]
    fn items_are_checked_as_a_device_would() {
        let q = core(8, 8);
        let remote = |access| slice(0x9000, 64, access);
        let ok = WorkItem { local: Some(local(64, DOMAIN)), op: RemoteOp::Write(remote(Access::REMOTE_WRITE)) };
        assert_eq!(q.check_item(&ok).unwrap(), 64);
        let foreign = WorkItem { local: Some(local(64, DOMAIN + 1)), ..ok };
        assert!(matches!(
            q.check_item(&foreign),
            Err(Error::DomainMismatch { registered, expected: DOMAIN, .. }) if registered == DOMAIN + 1
        ));
        let no_right = WorkItem { op: RemoteOp::Read(remote(Access::REMOTE_WRITE)), ..ok };
        assert!(matches!(q.check_item(&no_right), Err(Error::AccessDenied { .. })));
        let short = WorkItem { local: Some(local(32, DOMAIN)), ..ok };
        assert!(matches!(q.check_item(&short), Err(Error::LengthMismatch { local: 32, .. })));
        let big = WorkItem { local: Some(local(2 << 20, DOMAIN)), op: RemoteOp::Send };
        assert!(
            matches!(q.check_item(&big), Err(Error::MessageTooLarge { len, max }) if len == 2 << 20 && max == 1 << 20)
        );
        // A large write is split by the transport, not refused.
        let big_write = WorkItem {
            local: Some(local(2 << 20, DOMAIN)),
            op: RemoteOp::Write(slice(0, 2 << 20, Access::REMOTE_WRITE)),
        };
        assert_eq!(q.check_item(&big_write).unwrap(), 2 << 20);
        let big_imm = WorkItem { op: RemoteOp::WriteWithImm(slice(0, 2 << 20, Access::REMOTE_WRITE), 1), ..big_write };
        assert!(matches!(q.check_item(&big_imm), Err(Error::MessageTooLarge { .. })));
        assert_eq!(q.check_item(&WorkItem { local: None, op: RemoteOp::Send }).unwrap(), 0);
    }
}
