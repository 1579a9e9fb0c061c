//! The staged path: GPU memory the NIC cannot reach moves through pinned,
//! registered host buffers ("slots") with CUDA copies on their own streams,
//! chunked and pipelined so copies overlap the network.
//!
//! - write: per chunk, copy GPU -> slot (device-to-host stream), then RDMA
//!   WRITE slot -> peer; chunks are posted in order, so a final write with
//!   immediate arrives after all the data.
//! - read: per chunk, RDMA READ peer -> slot, then copy slot -> GPU
//!   (host-to-device stream).
//! - send: copy the message GPU -> slot, then SEND (a message cannot be
//!   split: one slot of the message's size).
//! - recv: RECV into a slot, then copy the bytes that arrived slot -> GPU.
//!
//! Up to `depth` chunks are in flight. The operation completes when the last
//! copy into the GPU is done, so its completion means "visible to CUDA".
//!
//! A staged operation moves when its handle is waited on or polled, when
//! any other operation of its connection is ([`StagedSet`]), so a
//! ping-pong that waits only for the reply still gets its send out, and,
//! while it holds its connection's gate (its requests are not all handed
//! over: [`order`](super::order)), on the domain's engine. A handle dropped
//! early cancels what had not reached the network yet.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::completion::{Completion, Opcode, WcStatus};
use crate::cuda::{CudaDevice, CudaEvent, CudaStream, copy_dtoh_async, copy_htod_async};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::LocalParts;
use crate::ops::OpId;
use crate::protocol::order::{Gate, Place};
use crate::transport::{ConnTransport, Posted, RemoteOp, WorkItem};

mod gather;
pub(crate) use crate::memory::staging::StagingHome;
use crate::memory::staging::{CopyEvent, MIN_SLOT, Retired, Slot, Stager};
pub(crate) use gather::{Gather, GatherPiece};

/// What a staged operation does: the operation as posted (`None`: a
/// receive). The same [`RemoteOp`] the direct path posts, so the kind is
/// never converted back and forth.
type NextOp = Option<RemoteOp>;

fn opcode(op: NextOp) -> Opcode {
    op.map_or(Opcode::Recv, RemoteOp::opcode)
}

/// Whether the data flows GPU -> network (copy out first).
fn outbound(op: NextOp) -> bool {
    op.is_some_and(RemoteOp::outbound)
}

/// Whether the operation is one message (one slot, one step).
fn single(op: NextOp) -> bool {
    matches!(op, None | Some(RemoteOp::Send | RemoteOp::SendWithImm(_)))
}

enum StepState {
    /// Copying GPU -> slot.
    CopyOut(CopyEvent),
    /// On the network.
    Net(OpId),
    /// Copying slot -> GPU.
    CopyIn(CopyEvent),
    Done,
}

struct Step {
    off: usize,
    len: usize,
    slot: Option<Slot>,
    state: StepState,
}

/// One staged operation in progress.
pub(crate) struct Pipeline {
    op: NextOp,
    stager: Arc<Stager>,
    domain_id: u64,
    dev: u64,
    len: usize,
    chunk: usize,
    depth: usize,
    next: usize,
    started: bool,
    steps: VecDeque<Step>,
    moved: u64,
    last: Option<Completion>,
    error: Option<Error>,
    /// A CUDA failure met while another handle moved this one along; its
    /// owner reports it.
    deferred: Option<Error>,
    /// Its handle was dropped: nothing more may start (the GPU buffer may
    /// be gone).
    abandoned: bool,
    post_timeout: std::time::Duration,
    /// Its place at the connection's gate (an operation that reaches the
    /// peer: not a receive): its requests go to the transport only while it
    /// is first, so it takes effect after everything posted before it and
    /// before everything posted after it. Its own, or its list's.
    turn: Option<Turn>,
    /// Its own stream, from its stager's: its copies wait for its fences
    /// and nothing else.
    stream: Option<CudaStream>,
    /// The fences its first copy waits for (the producers of the data it
    /// sends, or the work still reading what it overwrites), queued on its
    /// stream just before that copy.
    fences: Vec<Arc<CudaEvent>>,
}

/// A pipeline's place at its connection's gate.
struct Turn {
    gate: Arc<Gate>,
    ticket: Place,
    /// Taken by this pipeline (released by it once its last request is
    /// handed over), or its list's (released by the list).
    owned: bool,
}

impl Pipeline {
    /// Plans a staged operation on `local` (a range of GPU memory).
    pub(crate) fn new(
        op: NextOp,
        home: &StagingHome,
        device: &CudaDevice,
        local: LocalParts,
        chunk: usize,
        depth: usize,
        post_timeout: std::time::Duration,
    ) -> Result<Self> {
        let stager = Stager::for_device(home, device)?;
        let stream = Some(stager.stream()?);
        Ok(Pipeline {
            turn: None,
            stream,
            fences: Vec::new(),
            op,
            stager,
            domain_id: home.domain_id,
            dev: local.addr,
            len: local.len,
            chunk: chunk.max(MIN_SLOT),
            depth: depth.max(2),
            next: 0,
            started: false,
            steps: VecDeque::new(),
            moved: 0,
            last: None,
            error: None,
            deferred: None,
            abandoned: false,
            post_timeout,
        })
    }

    /// Takes its place at the connection's gate if it reaches the peer
    /// (not a receive): its requests go to the transport only after every
    /// operation posted before it handed over its last one.
    pub(crate) fn in_turn(mut self, gate: &Arc<Gate>) -> Self {
        self.turn = Some(Turn { gate: Arc::clone(gate), ticket: gate.hold(None), owned: true });
        self
    }

    /// A piece of a transfer list: its requests go to the transport only
    /// while the list's place (`ticket`) is first; the list releases it.
    pub(crate) fn in_turn_of(mut self, gate: &Arc<Gate>, ticket: Place) -> Self {
        self.turn = Some(Turn { gate: Arc::clone(gate), ticket, owned: false });
        self
    }

    /// Whether its requests may go to the transport now.
    fn my_turn(&self) -> bool {
        self.turn.as_ref().is_none_or(|t| t.gate.is_first(t.ticket))
    }

    /// Whether every request it will make was handed to the transport (or
    /// none will be: it failed).
    pub(crate) fn all_posted(&self) -> bool {
        self.error.is_some() || !self.has_more() && !self.steps.iter().any(|s| matches!(s.state, StepState::CopyOut(_)))
    }

    /// Orders its copies after `fences`: the producers of the data it
    /// sends, or the work still reading the memory it overwrites. Waited
    /// for on its own stream, on the GPU: nothing else waits for them.
    pub(crate) fn after(&mut self, fences: Vec<Arc<CudaEvent>>) {
        self.fences.extend(fences);
    }

    /// Its stream, with its fences queued ahead of the first copy.
    fn copy_stream(&mut self) -> Result<&CudaStream> {
        let stream =
            self.stream.as_ref().ok_or_else(|| Error::InvalidArgument("a staged copy with no stream".into()))?;
        for f in self.fences.drain(..) {
            stream.wait_event(&f)?;
        }
        Ok(stream)
    }

    fn has_more(&self) -> bool {
        self.next < self.len || !self.started
    }

    /// Whether nothing is left in flight (successfully or not).
    pub(crate) fn finished(&self) -> bool {
        self.steps.is_empty() && (self.error.is_some() || !self.has_more())
    }

    /// A request on the network to sleep on, if any.
    pub(crate) fn waiting_on(&self) -> Option<OpId> {
        self.steps.iter().find_map(|s| match s.state {
            StepState::Net(id) => Some(id),
            _ => None,
        })
    }

    /// Whether a copy between the GPU and a slot is in flight: something
    /// to look at again soon, which no network completion will signal.
    pub(crate) fn copying(&self) -> bool {
        self.steps.iter().any(|s| matches!(s.state, StepState::CopyOut(_) | StepState::CopyIn(_)))
    }

    /// The outcome, once finished.
    pub(crate) fn outcome(&mut self) -> Result<Completion> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let last = self.last.unwrap_or(Completion {
            wr_id: 0,
            opcode: opcode(self.op),
            status: WcStatus::Success,
            byte_len: 0,
            imm: None,
            qp_num: 0,
            vendor_err: 0,
        });
        Ok(Completion {
            opcode: if outbound(self.op) || matches!(self.op, Some(RemoteOp::Read(_))) {
                opcode(self.op)
            } else {
                last.opcode
            },
            byte_len: u32::try_from(self.moved).unwrap_or(u32::MAX),
            ..last
        })
    }

    fn fail(&mut self, e: Error) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    /// Its last request was handed over, or never will be: what was
    /// posted after it may go (posted now with `transport`).
    fn release_turn(&mut self, transport: Option<&ConnTransport>) {
        if let Some(t) = self.turn.take_if(|t| t.owned) {
            t.gate.release(t.ticket, transport);
        }
    }

    fn remote_op(&self, off: usize, n: usize, last: bool) -> RemoteOp {
        match self.op {
            None => RemoteOp::Send,
            Some(op @ (RemoteOp::Send | RemoteOp::SendWithImm(_))) => op,
            // Chunks of a write land in order; only the last carries the immediate.
            Some(RemoteOp::WriteWithImm(remote, imm)) if last => {
                RemoteOp::WriteWithImm(remote.sub(off as u64, n as u64), imm)
            }
            Some(RemoteOp::Write(remote) | RemoteOp::WriteWithImm(remote, _)) => {
                RemoteOp::Write(remote.sub(off as u64, n as u64))
            }
            Some(RemoteOp::Read(remote)) => RemoteOp::Read(remote.sub(off as u64, n as u64)),
        }
    }

    fn post(&mut self, t: &ConnTransport, step: usize) {
        let (off, n) = (self.steps[step].off, self.steps[step].len);
        let last = off + n >= self.len;
        let op = self.remote_op(off, n, last);
        let parts = self.steps[step].slot.as_ref().map(|s| s.parts(n, self.domain_id));
        let due = Deadline::lazy(self.post_timeout, "room in the send queue");
        let posted = match (self.op, op) {
            (None, _) => t.post_recv(parts),
            // The immediate goes with the last piece: its cover, where the
            // peer asked for one, names the whole write.
            (Some(RemoteOp::WriteWithImm(whole, _)), RemoteOp::WriteWithImm(..)) => {
                t.post_send_covering(&[WorkItem { local: parts, op }], due, whole)
            }
            (Some(_), _) => t.post_send(&[WorkItem { local: parts, op }], due),
        };
        match posted {
            Posted::Ok(id) => self.steps[step].state = StepState::Net(id),
            Posted::Refused(e) => {
                self.steps[step].state = StepState::Done;
                self.fail(*e);
            }
            Posted::Stuck(id, e) => {
                // Part of it may still reach the slot: the connection keeps it.
                if let Some(slot) = self.steps[step].slot.take() {
                    t.orphan(id, Box::new(slot));
                }
                self.steps[step].state = StepState::Done;
                self.fail(*e);
            }
        }
    }

    /// What its owner does: a CUDA failure met meanwhile, else
    /// [`advance`](Self::advance).
    pub(crate) fn advance_owned(&mut self, t: &ConnTransport) -> Result<()> {
        match self.deferred.take() {
            Some(e) => Err(e),
            None => self.advance(t),
        }
    }

    /// What another handle does for it: advance, keeping a failure for the owner.
    fn advance_for_owner(&mut self, t: &ConnTransport) {
        if self.deferred.is_none() && !self.abandoned && !self.finished() {
            if let Err(e) = self.advance(t) {
                self.deferred = Some(e);
            }
        }
    }

    /// Starts chunks while there is room, moves each along as its copy or
    /// network step finishes. Never blocks.
    pub(crate) fn advance(&mut self, t: &ConnTransport) -> Result<()> {
        if self.abandoned {
            return Ok(());
        }
        // Nothing starts before the operation's turn at the connection's
        // gate: an operation queued behind others holds no slot, and its
        // chunks are posted in order once it is first.
        let turn = self.turn.is_none() || self.my_turn();
        while turn && self.error.is_none() && self.steps.len() < self.depth && self.has_more() {
            let n = if single(self.op) { self.len } else { (self.len - self.next).min(self.chunk) };
            let off = self.next;
            self.next += n;
            self.started = true;
            let slot = match self.stager.take(n, self.chunk) {
                Ok(s) => s,
                Err(e) => {
                    self.fail(e);
                    break;
                }
            };
            let mut step = Step { off, len: n, slot: Some(slot), state: StepState::Done };
            if outbound(self.op) {
                let dst = step.slot.as_ref().map_or(0, Slot::addr) as *mut u8;
                let src = self.dev + off as u64;
                let stager = Arc::clone(&self.stager);
                let copied = self.copy_stream().and_then(|stream| {
                    // SAFETY: the slot stays owned by this step (or, if the pipeline
                    // is abandoned, retired with the copy's event until it is done);
                    // the GPU range is inside the operation's buffer, owned by its
                    // Pending (or retired with the copy likewise).
                    unsafe { copy_dtoh_async(dst, src, n, stream) }.and_then(|()| stager.record(stream))
                });
                match copied {
                    Ok(ev) => {
                        tracing::trace!(off, n, "staged: copy out of the GPU started");
                        step.state = StepState::CopyOut(ev)
                    }
                    Err(e) => {
                        self.fail(e);
                        break;
                    }
                }
                self.steps.push_back(step);
            } else {
                // A read (in its turn), or a receive (the receive queue is
                // not ordered with the sends).
                self.steps.push_back(step);
                let i = self.steps.len() - 1;
                self.post(t, i);
            }
        }

        // Post copied chunks strictly in order, so a final write with
        // immediate is delivered after every chunk before it.
        let mut in_order = true;
        for i in 0..self.steps.len() {
            match &self.steps[i].state {
                StepState::CopyOut(ev) => {
                    if in_order && self.error.is_none() && ev.is_done()? {
                        tracing::trace!(off = self.steps[i].off, "staged: copied out, posting");
                        self.post(t, i);
                    } else {
                        in_order = false;
                        if self.error.is_some() && ev.is_done()? {
                            self.steps[i].state = StepState::Done;
                        }
                    }
                }
                StepState::Net(id) => {
                    let id = *id;
                    if t.poll(id)? {
                        match t.take(id) {
                            Some(Ok(c)) => {
                                tracing::trace!(off = self.steps[i].off, "staged: network step done");
                                self.last = Some(c);
                                if outbound(self.op) {
                                    self.moved += self.steps[i].len as u64;
                                    self.steps[i].state = StepState::Done;
                                } else {
                                    let n = (c.byte_len as usize).min(self.steps[i].len);
                                    let src = self.steps[i].slot.as_ref().map_or(0, Slot::addr) as *const u8;
                                    let dst = self.dev + self.steps[i].off as u64;
                                    let stager = Arc::clone(&self.stager);
                                    let copied = self.copy_stream().and_then(|stream| {
                                        // SAFETY: as for the copy out, the other way round.
                                        unsafe { copy_htod_async(dst, src, n, stream) }
                                            .and_then(|()| stager.record(stream))
                                    });
                                    self.moved += n as u64;
                                    match copied {
                                        Ok(ev) => {
                                            tracing::trace!(
                                                off = self.steps[i].off,
                                                n,
                                                "staged: copy into the GPU queued"
                                            );
                                            self.steps[i].state = StepState::CopyIn(ev)
                                        }
                                        Err(e) => {
                                            self.steps[i].state = StepState::Done;
                                            self.fail(e);
                                        }
                                    }
                                }
                            }
                            Some(Err(e)) => {
                                self.steps[i].state = StepState::Done;
                                self.fail(*e);
                            }
                            None => {}
                        }
                    }
                }
                StepState::CopyIn(ev) => {
                    if ev.is_done()? {
                        tracing::trace!(off = self.steps[i].off, "staged: copied into the GPU");
                        self.steps[i].state = StepState::Done;
                    }
                }
                StepState::Done => {}
            }
        }
        // Finished steps give their slots back.
        self.steps.retain(|s| !matches!(s.state, StepState::Done));
        if self.turn.is_some() && self.all_posted() {
            self.release_turn(Some(t));
        }
        Ok(())
    }

    /// The operation is given up: nothing more starts, and slots still on
    /// the network stay with the connection until the device is done with
    /// them. Its handle dropped (`keep`: the buffer, whose GPU memory its
    /// copies in flight touch), those copies are never waited for: their
    /// slots, its stream and the buffer are retired with their events and
    /// released once they are done. Without `keep` (a CUDA failure, whose
    /// buffer goes back to the caller) its own stream is waited for: its
    /// copies and its own fences, never another operation's.
    pub(crate) fn abandon(&mut self, t: &ConnTransport, keep: Option<Box<dyn std::any::Any + Send>>) {
        self.abandoned = true;
        self.release_turn(Some(t));
        self.fences.clear();
        if keep.is_none() {
            if let Some(stream) = &self.stream {
                if let Err(e) = stream.synchronize() {
                    tracing::error!("waiting for a failed staged operation's copies: {e}");
                }
            }
        }
        let mut retired = Retired { events: Vec::new(), slots: Vec::new(), stream: self.stream.take(), _keep: keep };
        for mut step in self.steps.drain(..) {
            match step.state {
                StepState::Net(id) => {
                    if let Some(slot) = step.slot.take() {
                        t.orphan(id, Box::new(slot));
                    }
                }
                StepState::CopyOut(ev) | StepState::CopyIn(ev) => {
                    retired.events.push(ev);
                    retired.slots.extend(step.slot.take());
                }
                StepState::Done => {}
            }
        }
        self.stager.retire(retired);
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.release_turn(None);
        if let Some(stream) = self.stream.take() {
            if self.steps.is_empty() {
                self.stager.give_back(stream);
            } else {
                // Dropped with copies in flight (not given up first): they
                // are retired with their slots rather than waited for.
                let mut r = Retired { events: Vec::new(), slots: Vec::new(), stream: Some(stream), _keep: None };
                for mut step in self.steps.drain(..) {
                    if let StepState::CopyOut(ev) | StepState::CopyIn(ev) = step.state {
                        r.events.push(ev);
                        r.slots.extend(step.slot.take());
                    }
                }
                self.stager.retire(r);
            }
        }
    }
}

/// A piece of a staged transfer list in flight: a large one through its
/// own pipeline, or a group of small ones gathered into one slot.
pub(crate) enum ListPiece {
    One(Pipeline),
    Many(Gather),
}

impl ListPiece {
    pub(crate) fn advance(&mut self, t: &ConnTransport) -> Result<()> {
        match self {
            ListPiece::One(p) => p.advance_owned(t),
            ListPiece::Many(g) => g.advance(t),
        }
    }

    pub(crate) fn finished(&self) -> bool {
        match self {
            ListPiece::One(p) => p.finished(),
            ListPiece::Many(g) => g.finished(),
        }
    }

    pub(crate) fn all_posted(&self) -> bool {
        match self {
            ListPiece::One(p) => p.all_posted(),
            ListPiece::Many(g) => g.all_posted(),
        }
    }

    pub(crate) fn copying(&self) -> bool {
        match self {
            ListPiece::One(p) => p.copying(),
            ListPiece::Many(g) => g.copying(),
        }
    }

    pub(crate) fn waiting_on(&self) -> Option<OpId> {
        match self {
            ListPiece::One(p) => p.waiting_on(),
            ListPiece::Many(g) => g.waiting_on(),
        }
    }

    pub(crate) fn outcome(&mut self) -> Result<()> {
        match self {
            ListPiece::One(p) => p.outcome().map(drop),
            ListPiece::Many(g) => g.outcome(),
        }
    }

    pub(crate) fn abandon(&mut self, t: &ConnTransport, keep: Option<Box<dyn std::any::Any + Send>>) {
        match self {
            ListPiece::One(p) => p.abandon(t, keep),
            ListPiece::Many(g) => g.abandon(t, keep),
        }
    }
}

/// The staged operations of one connection that are still in progress.
///
/// A pipeline advances when its own handle is waited on or polled, and also
/// whenever any other operation of the connection is: a ping-pong posts a
/// staged send and then waits for the reply, and nothing but that wait is
/// running to copy the message out and post it.
#[derive(Default)]
pub(crate) struct StagedSet {
    /// How many entries `list` holds, read without the lock.
    live: AtomicUsize,
    list: Mutex<Vec<Weak<Mutex<Pipeline>>>>,
    /// Tasks awaiting the network steps of the set's operations
    /// ([`await_steps`](Self::await_steps)), woken when another joins.
    awaiters: Mutex<Vec<std::task::Waker>>,
}

impl StagedSet {
    /// Tracks `p` until its handle drops it.
    pub(crate) fn add(&self, p: &Arc<Mutex<Pipeline>>) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(p));
        self.live.store(list.len(), Ordering::Release);
        drop(list);
        // A task awaiting the other operations' network steps must move
        // this one too, which no completion may signal yet: it looks again.
        let woken = std::mem::take(&mut *self.awaiters.lock().unwrap_or_else(|e| e.into_inner()));
        woken.into_iter().for_each(std::task::Waker::wake);
    }

    /// Has `waker` woken when any of the set's operations can move: at the
    /// completion of one of their network steps, or when another operation
    /// joins the set (kept until then; [`add`](Self::add) lists the newcomer
    /// before it takes the wakers, so one of the two sees the other).
    /// `Some(false)`: registered. `Some(true)`: a step finished meanwhile:
    /// look now. `None`: one of them waits on something no completion
    /// signals (a copy, its turn, a step not yet posted): look again on a
    /// timer.
    pub(crate) fn await_steps(
        &self,
        t: &ConnTransport,
        waker: &std::task::Waker,
        engine: &crate::transport::engine::Engine,
    ) -> Option<bool> {
        {
            let mut awaiters = self.awaiters.lock().unwrap_or_else(|e| e.into_inner());
            if !awaiters.iter().any(|w| w.will_wake(waker)) {
                awaiters.push(waker.clone());
            }
        }
        let live: Vec<Arc<Mutex<Pipeline>>> =
            self.list.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).collect();
        for p in live {
            // Being moved by another thread right now: it may need us next.
            let p = p.try_lock().ok()?;
            if p.abandoned || p.finished() {
                continue;
            }
            if p.steps.is_empty() || p.error.is_some() {
                return None;
            }
            for step in &p.steps {
                let StepState::Net(id) = step.state else { return None };
                match t.done_or_register(id, waker, engine) {
                    Ok(false) => {}
                    Ok(true) => return Some(true),
                    Err(_) => return None,
                }
            }
        }
        Some(false)
    }

    /// Whether no staged operation may be in progress (the common case:
    /// then waits need not come here).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.live.load(Ordering::Acquire) == 0
    }

    /// Moves every staged operation of the connection along, except those
    /// another thread is moving right now. Never blocks. Returns whether a
    /// copy is still in flight (a reason to come back soon).
    pub(crate) fn progress(&self, t: &ConnTransport) -> bool {
        if self.is_empty() {
            return false;
        }
        let live: Vec<Arc<Mutex<Pipeline>>> = {
            let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
            list.retain(|w| w.strong_count() > 0);
            self.live.store(list.len(), Ordering::Release);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        let mut copying = false;
        for p in live {
            match p.try_lock() {
                Ok(mut p) => {
                    p.advance_for_owner(t);
                    copying |= !p.abandoned && p.copying();
                }
                Err(_) => copying = true,
            }
        }
        copying
    }
}
