//! The table of operations in flight on one connection: which work request
//! id belongs to which operation, what its outcome was, and the buffers of
//! operations whose handle was dropped before they completed ("orphans"),
//! kept until the device is done with them.
//!
//! Transport-neutral; the transport holds it under its lock.

#![forbid(unsafe_code)]

use std::any::Any;
use std::task::Waker;

use crate::completion::{Completion, CompletionError, Opcode, WcStatus};
use crate::error::{Error, Result};

/// A finished operation's outcome as the queue core hands it on: its
/// error boxed, so that the success every wait moves is a 40-byte
/// completion, not a 72-byte `Result<Completion>`.
pub(crate) type OpOutcome = Result<Completion, Box<Error>>;

/// How a wait for one operation ended, flat: its completion, or why not.
/// (One level, not an `OpOutcome` inside a `Result`: the success a wait
/// hands up through each layer is the completion alone.)
pub(crate) type Waited = Result<Completion, WaitError>;

/// Why a wait for an operation ended without its success.
#[derive(Debug)]
pub(crate) enum WaitError {
    /// The operation finished and failed: its error, reported once.
    Failed(Box<Error>),
    /// The wait ended first (its deadline passed, or polling failed): the
    /// operation is still in flight and may be waited for again.
    Unfinished(Box<Error>),
}

impl WaitError {
    /// The wait's own error, boxed.
    #[cold]
    #[inline(never)]
    pub(crate) fn unfinished(e: Error) -> Self {
        WaitError::Unfinished(Box::new(e))
    }
}

/// An operation's outcome as a [`Waited`].
#[inline(always)]
pub(crate) fn waited(outcome: OpOutcome) -> Waited {
    outcome.map_err(WaitError::Failed)
}

/// Identifies one operation: slot index and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpId {
    index: u32,
    generation: u32,
}

const FINAL_BIT: u64 = 1 << 63;
/// Marks a request posted unsignaled on its own (a quiet send): the rest
/// of its id is its place in the send queue, not a slot of the table.
const QUIET_BIT: u64 = 1 << 62;
const GEN_MASK: u32 = 0x3fff_ffff;

impl OpId {
    /// An id with slot `index`, for tests of what holds ids.
    #[cfg(test)]
    pub(crate) fn for_tests(index: u32) -> OpId {
        OpId { index, generation: 0 }
    }

    /// The work request id for one of its work requests. Only the final
    /// request of an operation completes it; earlier ones (unsignaled parts
    /// of a batch) report only errors.
    pub(crate) fn wr_id(self, last: bool) -> u64 {
        (if last { FINAL_BIT } else { 0 }) | (u64::from(self.generation & GEN_MASK) << 32) | u64::from(self.index)
    }

    fn from_wr_id(wr_id: u64) -> (OpId, bool) {
        let id = OpId { index: wr_id as u32, generation: ((wr_id >> 32) as u32) & GEN_MASK };
        (id, wr_id & FINAL_BIT != 0)
    }
}

/// The work request id of the quiet send at place `seq` of the send queue.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) fn quiet_wr_id(seq: u64) -> u64 {
    QUIET_BIT | (seq & (QUIET_BIT - 1))
}

/// The place in the send queue of a quiet send's work request id; `None`
/// for an id of a tracked operation.
pub(crate) fn quiet_seq(wr_id: u64) -> Option<u64> {
    (wr_id & (QUIET_BIT | FINAL_BIT) == QUIET_BIT).then_some(wr_id & (QUIET_BIT - 1))
}

/// Whether `wr_id` names an operation's final request (the one whose
/// completion completes it).
pub(crate) fn is_final(wr_id: u64) -> bool {
    wr_id & FINAL_BIT != 0
}

/// The operation a work request id belongs to, whichever request of it.
pub(crate) fn op_of(wr_id: u64) -> u64 {
    wr_id & !FINAL_BIT
}

/// One completion as a transport reports it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub qp_num: u32,
    pub vendor_err: u32,
    /// For receives: whether a write with immediate (rather than a send) consumed it.
    pub by_write_imm: bool,
}

/// Queue resources an operation held, released when it completes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub send_wrs: u32,
    pub recv_wrs: u32,
    /// Quiet sends posted just before this operation, whose send-queue
    /// credits come back with its completion (nothing else reports theirs).
    pub carried: u32,
    /// For a send-queue operation: the send queue's place just past its
    /// final request (0 for a receive).
    pub sq_end: u64,
}

/// An orphaned buffer: its operation was dropped while the device could
/// still touch it, so it is dropped once the device is done with it.
pub(crate) type Orphan = Box<dyn Any + Send>;

/// Where an entry is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Free,
    /// Posted; completions may arrive.
    Busy,
    /// Finished; the outcome waits to be taken.
    Done,
}

/// One slot, flat: a phase and the fields each phase uses, so the hot
/// operations set fields instead of rewriting a large enum.
struct OpEntry {
    generation: u32,
    phase: Phase,
    opcode: Opcode,
    held: Held,
    /// What a send-queue operation moves in all (its completion reports
    /// it; the device's byte count is only defined for receives); `None`
    /// for a receive.
    bytes: Option<u64>,
    /// Busy: whether an earlier request of the chain failed (`effective`
    /// holds its completion then).
    failed_early: bool,
    /// The completion that decides the outcome: the first error of a
    /// chain, else the final request's; turned into a `Result` only when
    /// taken.
    effective: Completion,
    /// Busy: the buffer of a dropped handle, kept until the final completion.
    orphan: Option<Orphan>,
    /// Busy: who to wake at the final completion (a future awaiting it).
    waker: Option<Waker>,
}

impl OpEntry {
    /// This operation's completion as its request `raw` reports it.
    #[inline(always)]
    fn completion(&self, raw: &RawCompletion) -> Completion {
        Completion {
            wr_id: raw.wr_id & !FINAL_BIT,
            opcode: match self.opcode {
                Opcode::Recv if raw.by_write_imm => Opcode::RecvWriteWithImm,
                other => other,
            },
            status: raw.status,
            byte_len: self.bytes.map_or(raw.byte_len, |b| u32::try_from(b).unwrap_or(u32::MAX)),
            imm: raw.imm,
            qp_num: raw.qp_num,
            vendor_err: raw.vendor_err,
        }
    }
}

const NO_COMPLETION: Completion = Completion {
    wr_id: 0,
    opcode: Opcode::Send,
    status: WcStatus::Success,
    byte_len: 0,
    imm: None,
    qp_num: 0,
    vendor_err: 0,
};

/// A completion for no operation in flight (a stale or foreign work
/// request id): logged, out of the way of the fast path.
#[cold]
#[inline(never)]
fn stray(wr_id: u64) {
    tracing::warn!(wr_id, "completion for a work request that is not in flight");
}

/// The table. Never shrinks; reuses slots.
pub(crate) struct OpTable {
    entries: Vec<OpEntry>,
    free: Vec<u32>,
    busy: usize,
    orphans: usize,
}

impl OpTable {
    /// A table with room for `n` operations in flight before it grows.
    pub(crate) fn with_capacity(n: usize) -> Self {
        OpTable { entries: Vec::with_capacity(n), free: Vec::with_capacity(n), busy: 0, orphans: 0 }
    }

    /// Operations posted and not yet completed.
    pub(crate) fn in_flight(&self) -> usize {
        self.busy
    }

    /// In-flight operations whose handle was dropped.
    pub(crate) fn orphans(&self) -> usize {
        self.orphans
    }

    /// Starts tracking an operation about to be posted. `bytes` is what a
    /// send-queue operation moves in all (its completion reports it; the
    /// device's byte count is only defined for receives), `None` for a
    /// receive.
    #[inline(always)]
    pub(crate) fn start(&mut self, opcode: Opcode, held: Held, bytes: Option<u64>) -> OpId {
        self.busy += 1;
        if let Some(index) = self.free.pop() {
            let e = &mut self.entries[index as usize];
            e.generation = e.generation.wrapping_add(1) & GEN_MASK;
            e.phase = Phase::Busy;
            e.opcode = opcode;
            e.held = held;
            e.bytes = bytes;
            e.failed_early = false;
            OpId { index, generation: e.generation }
        } else {
            let index = self.entries.len() as u32;
            self.entries.push(OpEntry {
                generation: 0,
                phase: Phase::Busy,
                opcode,
                held,
                bytes,
                failed_early: false,
                effective: NO_COMPLETION,
                orphan: None,
                waker: None,
            });
            OpId { index, generation: 0 }
        }
    }

    /// The entry of `id` if it is in `phase`.
    fn entry(&mut self, id: OpId, phase: Phase) -> Option<&mut OpEntry> {
        self.entries.get_mut(id.index as usize).filter(|e| e.generation == id.generation && e.phase == phase)
    }

    fn release(&mut self, index: u32) {
        self.entries[index as usize].phase = Phase::Free;
        self.free.push(index);
    }

    /// Forgets an operation that could not be posted at all; returns the
    /// queue resources it held.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn abort(&mut self, id: OpId) -> Held {
        let Some(e) = self.entry(id, Phase::Busy) else { return Held::default() };
        let held = e.held;
        self.busy -= 1;
        self.release(id.index);
        held
    }

    /// Records one completion. Returns the queue resources to release (when
    /// it was the operation's final request), an orphaned buffer that may
    /// now be dropped, and whether the operation failed (known at its final
    /// request).
    #[inline(always)]
    pub(crate) fn complete(&mut self, raw: &RawCompletion) -> (Held, Option<Orphan>, bool) {
        let (id, last) = OpId::from_wr_id(raw.wr_id);
        let busy = |e: &&mut OpEntry| e.generation == id.generation && e.phase == Phase::Busy;
        let Some(e) = self.entries.get_mut(id.index as usize).filter(busy) else {
            stray(raw.wr_id);
            return (Held::default(), None, false);
        };
        if !last {
            // An unsignaled part of a batch reports only errors; keep the first.
            if !raw.status.is_success() && !e.failed_early {
                e.effective = e.completion(raw);
                e.failed_early = true;
            }
            return (Held::default(), None, false);
        }
        if !e.failed_early {
            e.effective = e.completion(raw);
        }
        let held = e.held;
        let orphan = e.orphan.take();
        if let Some(waker) = e.waker.take() {
            waker.wake();
        }
        self.busy -= 1;
        if orphan.is_some() {
            e.phase = Phase::Free;
            self.orphans -= 1;
            self.free.push(id.index);
        } else {
            e.phase = Phase::Done;
        }
        (held, orphan, !e.effective.status.is_success())
    }

    /// [`complete`](Self::complete) and [`take`](Self::take) at once, for
    /// the one case a waiter meets most: `raw` is the successful final
    /// completion of `want`, whose handle is waiting for it (no dropped
    /// handle's buffer, no future to wake, no earlier failure in its
    /// chain). Its completion goes straight to the caller and its slot is
    /// freed, with the queue resources it held, as a `complete` then a
    /// `take` would leave them; the completion is never stored to be read
    /// back. `None`, with nothing changed, in every other case.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    #[inline(always)]
    pub(crate) fn complete_taking(&mut self, raw: &RawCompletion, want: OpId) -> Option<(Held, Completion)> {
        if raw.wr_id != want.wr_id(true) || !raw.status.is_success() {
            return None;
        }
        let e = self.entry(want, Phase::Busy)?;
        if e.failed_early || e.orphan.is_some() || e.waker.is_some() {
            return None;
        }
        let (held, completion) = (e.held, e.completion(raw));
        self.busy -= 1;
        self.release(want.index);
        Some((held, completion))
    }

    /// The outcome of a finished operation. `lost` is why the connection
    /// broke, if it did (the first reason, which never changes): a flushed
    /// operation then fails with [`Error::ConnectionLost`] rather than a
    /// flush status.
    #[inline]
    pub(crate) fn outcome(effective: Completion, lost: Option<&str>) -> OpOutcome {
        if effective.status.is_success() {
            return Ok(effective);
        }
        Self::failure(effective, lost)
    }

    /// [`outcome`](Self::outcome)'s error, out of the way of the fast path.
    #[cold]
    #[inline(never)]
    fn failure(effective: Completion, lost: Option<&str>) -> OpOutcome {
        match (effective.result(), lost) {
            (Ok(c), _) => Ok(c),
            (Err(CompletionError { status: WcStatus::WrFlush, opcode, .. }), Some(reason)) => {
                Err(Box::new(Error::ConnectionLost { reason: format!("{reason}; the {opcode} was flushed") }))
            }
            (Err(e), _) => Err(Box::new(Error::Completion(e))),
        }
    }

    /// Wakes `waker` when `id` finishes (replacing an earlier one).
    /// Whether it was registered: `false` when `id` is not in flight.
    pub(crate) fn register(&mut self, id: OpId, waker: &Waker) -> bool {
        let Some(e) = self.entry(id, Phase::Busy) else { return false };
        match &mut e.waker {
            Some(w) if w.will_wake(waker) => {}
            slot => *slot = Some(waker.clone()),
        }
        true
    }

    /// Whether the operation has an outcome to take.
    pub(crate) fn is_done(&self, id: OpId) -> bool {
        self.entries.get(id.index as usize).is_some_and(|e| e.generation == id.generation && e.phase == Phase::Done)
    }

    /// Takes a finished operation's outcome, freeing its slot. `lost` is
    /// why the connection broke, if it did.
    pub(crate) fn take(&mut self, id: OpId, lost: Option<&str>) -> Option<OpOutcome> {
        let e = self.entry(id, Phase::Done)?;
        e.phase = Phase::Free;
        let effective = e.effective;
        self.free.push(id.index);
        Some(Self::outcome(effective, lost))
    }

    /// The handle of an operation was dropped. If it is still in flight its
    /// buffer is kept until it completes; if it finished, the slot is freed
    /// and the buffer handed back to be dropped by the caller.
    pub(crate) fn orphan(&mut self, id: OpId, buffer: Orphan) -> Option<Orphan> {
        let Some(e) = self.entries.get_mut(id.index as usize).filter(|e| e.generation == id.generation) else {
            return Some(buffer);
        };
        match e.phase {
            Phase::Busy => {
                e.waker = None;
                e.orphan = Some(buffer);
                self.orphans += 1;
                None
            }
            Phase::Done => {
                self.release(id.index);
                Some(buffer)
            }
            Phase::Free => Some(buffer),
        }
    }

    /// Takes every orphaned buffer: only once the device can no longer
    /// touch them (the queue pair is destroyed).
    pub(crate) fn take_orphans(&mut self) -> Vec<Orphan> {
        let mut out = Vec::new();
        for e in &mut self.entries {
            if let Some(o) = e.orphan.take() {
                out.push(o);
            }
        }
        self.orphans = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(id: OpId, last: bool, status: WcStatus) -> RawCompletion {
        RawCompletion {
            wr_id: id.wr_id(last),
            status,
            byte_len: 8,
            imm: None,
            qp_num: 1,
            vendor_err: 0,
            by_write_imm: false,
        }
    }

    #[test]
    fn an_operation_completes_once_and_its_slot_is_reused() {
        let mut t = OpTable::with_capacity(0);
        let held = Held { send_wrs: 1, ..Held::default() };
        let a = t.start(Opcode::Write, held, None);
        assert_eq!(t.in_flight(), 1);
        assert!(!t.is_done(a));
        assert_eq!(t.complete(&raw(a, true, WcStatus::Success)).0, held);
        assert!(t.is_done(a));
        assert_eq!(t.take(a, None).unwrap().unwrap().opcode, Opcode::Write);
        assert!(t.take(a, None).is_none());
        let b = t.start(Opcode::Read, held, None);
        assert_eq!(b.index, a.index);
        assert_ne!(b.generation, a.generation);
        // A stale completion for the old generation is ignored.
        assert_eq!(t.complete(&raw(a, true, WcStatus::Success)).0, Held::default());
        assert!(!t.is_done(b));
    }

    #[test]
    fn a_batch_reports_the_first_error_at_its_final_request() {
        let mut t = OpTable::with_capacity(0);
        let a = t.start(Opcode::Write, Held { send_wrs: 3, ..Held::default() }, None);
        t.complete(&raw(a, false, WcStatus::RemoteAccess));
        assert!(!t.is_done(a), "not done before its final request");
        let (held, _, failed) = t.complete(&raw(a, true, WcStatus::WrFlush));
        assert!(failed);
        assert_eq!(held.send_wrs, 3);
        let err = t.take(a, None).unwrap().unwrap_err();
        assert!(err.is_remote_access(), "{err}");
    }

    #[test]
    fn flushes_after_a_lost_connection_say_so() {
        let mut t = OpTable::with_capacity(0);
        let a = t.start(Opcode::Recv, Held { recv_wrs: 1, ..Held::default() }, None);
        t.complete(&raw(a, true, WcStatus::WrFlush));
        match t.take(a, Some("the peer closed the connection")).unwrap().map_err(|e| *e) {
            Err(Error::ConnectionLost { reason }) => {
                assert!(reason.contains("peer closed"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn quiet_ids_never_name_an_operation() {
        for seq in [0, 1, 12_345, (1 << 62) - 1] {
            assert_eq!(quiet_seq(quiet_wr_id(seq)), Some(seq));
        }
        let mut t = OpTable::with_capacity(0);
        for _ in 0..3 {
            let id = t.start(Opcode::Send, Held::default(), None);
            for last in [false, true] {
                assert_eq!(quiet_seq(id.wr_id(last)), None);
            }
        }
        // The generation wraps inside its field, clear of the quiet mark.
        let id = OpId { index: 7, generation: GEN_MASK };
        assert_eq!(quiet_seq(id.wr_id(false)), None);
        assert_eq!(OpId::from_wr_id(id.wr_id(true)), (id, true));
    }

    #[test]
    fn orphans_are_kept_until_completion() {
        let mut t = OpTable::with_capacity(0);
        let a = t.start(Opcode::Send, Held { send_wrs: 1, ..Held::default() }, None);
        assert!(t.orphan(a, Box::new(vec![1u8, 2, 3])).is_none(), "kept while in flight");
        assert_eq!(t.orphans(), 1);
        let (_, orphan, failed) = t.complete(&raw(a, true, WcStatus::Success));
        assert!(!failed);
        assert!(orphan.is_some(), "released at completion");
        assert_eq!((t.orphans(), t.in_flight()), (0, 0));

        let b = t.start(Opcode::Send, Held::default(), None);
        t.complete(&raw(b, true, WcStatus::Success));
        assert!(t.orphan(b, Box::new(1u32)).is_some(), "already done: dropped at once");
        let c = t.start(Opcode::Send, Held::default(), None);
        t.orphan(c, Box::new(2u32));
        assert_eq!(t.take_orphans().len(), 1);
    }
}
