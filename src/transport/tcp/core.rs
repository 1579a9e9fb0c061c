//! The RDMA-over-TCP rules, with no I/O: a connection's state (its send
//! queue, the receives posted, the replies owed to the peer and awaited
//! from it, who is writing what) and the rules that change it: a message
//! is started and ended by its writer, an operation completes only once
//! its bytes were handed to the socket and the peer acknowledged them,
//! in posting order; an acknowledgement that answers nothing, comes
//! early or twice, or a refusal, breaks the connection; a break fails
//! what no thread is touching and leaves the rest to the thread that is;
//! a peer that keeps more requests waiting for replies than its
//! announced depth breaks it; the sender's choice of what goes next.
//!
//! No socket, thread or system call here: the connection's threads (and
//! spinning waiters, and posting threads sending directly) hold this state
//! under one lock and carry out its decisions; what they must be told
//! (waiters to wake, the sender to look again, the receiver to stop
//! carrying out frames) comes back through [`Signals`]. So the rules are
//! tested without sockets (`tests.rs`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Waker;

use super::frame::{ACK, FrameHeader, FrameOp, HEADER, Handled, IMM, OutFrame, segments, wire_len};
use super::replies::{OnAck, Progress, Replies, Reply, Request, Segment};
use super::responder::Refusal;
use super::socket::STEP;
use crate::completion::{Opcode, WcStatus};
use crate::memory::keys::KeyEntry;
use crate::ops::{OpId, RawCompletion, is_final, op_of};
use crate::transport::queue::{Limits, QueueCore};

/// The most bytes of a message one write call hands to the socket: the
/// rest of a header and a step of payload.
pub(super) const MAX_CALL: u64 = (HEADER + STEP) as u64;

/// What the state's owner must do when the rules change it.
pub(super) trait Signals {
    /// Wakes the threads asleep on completions, queue room, posted
    /// receives or a lost connection (called only when some sleep).
    fn wake_waiters(&self);
    /// Wakes the sender thread: there is something to write, or to hang up.
    fn wake_sender(&self);
    /// Wakes the threads asleep until the peer's next write lands (called
    /// only when some sleep).
    fn wake_ring_waiters(&self);
    /// The connection broke: from now on nothing more from the peer is
    /// carried out (the receiving threads look before each frame).
    fn broken(&self);
}

pub(super) enum OutKind {
    Send {
        imm: Option<u32>,
    },
    Write {
        raddr: u64,
        key: u32,
        imm: Option<u32>,
    },
    ReadReq {
        raddr: u64,
        key: u32,
    },
    /// `unacked`: the peer sends no acknowledgement, and the send is done
    /// once the socket has its frame (see [`TcpConn::post_inline`]).
    Inline {
        data: Vec<u8>,
        imm: Option<u32>,
        unacked: bool,
    },
}

/// A message of this side's send queue.
pub(super) struct Out {
    pub(super) seq: u32,
    pub(super) wr_id: u64,
    pub(super) kind: OutKind,
    pub(super) addr: u64,
    pub(super) len: u64,
    /// Bytes of its first frame already on the wire: a posting thread sent
    /// them and the socket took no more (see [`TcpConn::send_direct`]).
    pub(super) skip: usize,
    /// The sequence number of the first message of its operation (its own
    /// for a single message): the chain an error acknowledgement falls in.
    pub(super) first: u32,
}

impl Out {
    /// An inline send the peer does not acknowledge.
    pub(super) fn unacked(&self) -> bool {
        matches!(self.kind, OutKind::Inline { unacked: true, .. })
    }

    /// Where its payload comes from (a registered buffer, or its inline
    /// copy) and its length; none for a read request.
    fn payload(&self) -> (u64, u64) {
        match &self.kind {
            OutKind::Inline { data, .. } => (data.as_ptr() as u64, data.len() as u64),
            OutKind::ReadReq { .. } => (0, 0),
            _ => (self.addr, self.len),
        }
    }

    /// Its bytes on the wire: a frame per segment of payload (one for none).
    pub(super) fn wire_len(&self) -> u64 {
        wire_len(self.payload().1)
    }
}

/// Which thread carries a frame out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Reading {
    /// The receiver thread: its replies go through the sender thread while
    /// that is awake, which sends them while this one reads on.
    Receiver,
    /// A spinning waiter: it writes its replies itself.
    Waiter,
}

/// Whether the peer acknowledges `o`: the last message of an operation,
/// unless it is an unacknowledged inline send.
pub(super) fn wants_ack(o: &Out) -> bool {
    is_final(o.wr_id) && !o.unacked()
}

pub(super) fn request(o: &Out) -> Request {
    let reply = match o.kind {
        OutKind::ReadReq { .. } => Reply::Read { addr: o.addr, len: o.len },
        _ if wants_ack(o) => Reply::Ack,
        _ => Reply::None,
    };
    Request { seq: o.seq, first: o.first, wr_id: o.wr_id, reply, wire: o.wire_len() }
}

/// The message being carried out, between steps.
#[derive(Default)]
pub(super) enum Rx {
    /// Between frames.
    #[default]
    Idle,
    /// A send landing in `recv`: `off` of `total` bytes so far.
    Message { first: FrameHeader, cur: FrameHeader, recv: Recv, off: u64, total: u64 },
    /// A send, or a write with immediate (`written`: its byte count, its
    /// data landed), waiting for a receive.
    WaitingRecv { h: FrameHeader, written: Option<u32> },
    /// A write landing in an exposed region.
    Write { first: FrameHeader, cur: FrameHeader, entry: Arc<KeyEntry>, off: u64 },
    /// A write with immediate whose range is being made visible.
    Visible { h: FrameHeader },
    /// A segment of the response to this side's read.
    ReadResp { h: FrameHeader, seg: Segment },
    /// The rest of a message being dropped; then `then`.
    Draining { first: FrameHeader, cur: FrameHeader, then: AfterDrain },
}

/// How a drained message ends.
pub(super) enum AfterDrain {
    /// The peer's request `seq` is refused (and the connection breaks).
    Refuse(u32, Refusal),
    /// The connection breaks.
    Fail(String),
}

/// A frame the receiver asks the sender to send.
#[derive(Debug)]
pub(super) enum Ctl {
    Ack { seq: u32, status: u32 },
    ReadResp(ReadResponse),
    Bye,
}

/// The response to the peer's read `seq` of `len` bytes at `addr` under
/// `entry`; `sent`: the bytes of its frames the socket already has (from
/// the attempt of the thread that carried out the read).
#[derive(Debug)]
pub(super) struct ReadResponse {
    pub(super) seq: u32,
    pub(super) entry: Arc<KeyEntry>,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) sent: u64,
}

#[derive(Debug)]
pub(super) struct Recv {
    pub(super) wr_id: u64,
    pub(super) addr: u64,
    pub(super) len: u64,
}

pub(super) struct Core {
    /// Operations, credits, the lost state.
    pub(super) q: QueueCore,
    pub(super) stopping: bool,
    pub(super) next_seq: u32,
    pub(super) queue: VecDeque<Out>,
    pub(super) control: VecDeque<Ctl>,
    /// The replies this side waits for, in request order, and who may
    /// complete each request (see [`replies`]). A request enters when its
    /// writer starts it, since a reply may arrive before the writer has
    /// returned from its last call.
    pub(super) replies: Replies,
    /// The message being written now (by the sender thread, or by a posting
    /// thread sending directly, or begun by one and not yet finished by the
    /// other): its memory is in use, so only its writer may fail it.
    pub(super) sending: Option<u32>,
    /// The operation of the message being written: none of its requests is
    /// failed by anyone but the writer (completing its final request would
    /// hand its buffer back while the writer still reads it).
    pub(super) sending_op: Option<u64>,
    /// A thread is writing to the socket: frames never interleave.
    pub(super) writing: bool,
    /// A message whose first bytes a posting thread wrote before the socket
    /// filled up: the sender thread finishes it before anything else.
    pub(super) resume: Option<Out>,
    /// A control frame whose first bytes a reader sent directly before the
    /// socket filled up (the header, and how many of its bytes went): the
    /// sender thread finishes it before anything else.
    pub(super) ctl_rest: Option<(FrameHeader, usize)>,
    pub(super) recvs: VecDeque<Recv>,
    /// The sender thread has ended (after the connection broke or stopped).
    pub(super) sender_done: bool,
    /// The sender thread sleeps, waiting for work.
    pub(super) sender_asleep: bool,
    /// Threads asleep on `events`: waking nobody costs no system call.
    pub(super) sleepers: usize,
    /// Threads asleep until the peer's next write lands.
    pub(super) ring_sleepers: usize,
    /// The peer's send-queue depth: the most replies (acknowledgements, read
    /// responses) its outstanding requests can need.
    pub(super) peer_depth: usize,
    /// The peer's message being carried out, between the reader's steps
    /// (`inbound.rs`).
    pub(super) rx: Rx,
    /// How many of the peer's writes have landed: a waiter on memory the
    /// peer writes (a notification ring) sleeps until it moves.
    pub(super) landed: u64,
    /// Awaited looks at such memory, woken when `landed` moves or the
    /// connection breaks (each look's task once).
    pub(super) ring_wakers: Vec<Waker>,
}

impl Core {
    /// A connection's state before anything was posted: its queues sized
    /// for the send queues, this side's (`limits`) and the peer's
    /// (`peer_depth`, whose messages are acknowledged), so nothing
    /// allocates in steady state.
    pub(super) fn new(limits: Limits, peer_depth: usize) -> Self {
        Core {
            q: QueueCore::new(limits),
            stopping: false,
            next_seq: 1,
            queue: VecDeque::with_capacity(limits.send_depth as usize),
            control: VecDeque::with_capacity(peer_depth),
            replies: Replies::new(limits.send_depth as usize, MAX_CALL),
            sending: None,
            sending_op: None,
            writing: false,
            resume: None,
            ctl_rest: None,
            recvs: VecDeque::new(),
            sender_done: false,
            sender_asleep: false,
            sleepers: 0,
            ring_sleepers: 0,
            peer_depth,
            rx: Default::default(),
            landed: 0,
            ring_wakers: Vec::new(),
        }
    }
}

pub(super) fn raw(wr_id: u64, status: WcStatus) -> RawCompletion {
    RawCompletion { wr_id, status, byte_len: 0, imm: None, qp_num: 0, vendor_err: 0, by_write_imm: false }
}

impl Core {
    /// Whether a new frame could go to the socket now, ahead of nothing:
    /// no thread writes, no frame is half sent, no control frame waits and
    /// the connection is not closing (the operation queue is the caller's
    /// to judge).
    pub(super) fn socket_idle(&self) -> bool {
        !self.writing && self.resume.is_none() && self.ctl_rest.is_none() && self.control.is_empty() && !self.stopping
    }

    /// Whether the sender thread has something to do: a frame to finish or
    /// to send, or a broken or closing connection to hang up.
    pub(super) fn has_work(&self) -> bool {
        self.resume.is_some()
            || self.ctl_rest.is_some()
            || !self.control.is_empty()
            || !self.queue.is_empty()
            || self.stopping
            || self.q.lost().is_some()
    }

    /// Queues `count` messages (`next(i)` makes the i-th: its kind, source
    /// address and length) as one operation of `opcode` carrying `bytes`,
    /// in sequence order; room in the send queue was checked
    /// ([`QueueCore::send_room`]). Allocates nothing once the queues have
    /// grown to their steady size.
    pub(super) fn push(
        &mut self,
        opcode: Opcode,
        count: usize,
        bytes: u64,
        mut next: impl FnMut(usize) -> (OutKind, u64, u64),
    ) -> OpId {
        let id = self.q.start_send(opcode, count as u32, bytes);
        let first = self.next_seq;
        for i in 0..count {
            let (kind, addr, len) = next(i);
            let seq = self.next_seq;
            self.next_seq = self.next_seq.wrapping_add(1).max(1);
            let wr_id = id.wr_id(i + 1 == count);
            self.queue.push_back(Out { seq, wr_id, kind, addr, len, skip: 0, first });
        }
        id
    }

    /// Posts a receive of `len` bytes at `addr` (checked by the caller),
    /// behind those posted before it.
    pub(super) fn post_recv(&mut self, addr: u64, len: u64, sig: &impl Signals) -> crate::error::Result<OpId> {
        let id = self.q.start_recv()?;
        self.recvs.push_back(Recv { wr_id: id.wr_id(true), addr, len });
        self.wake(sig);
        Ok(id)
    }

    /// Wakes the threads asleep on this state, if any.
    pub(super) fn wake(&self, sig: &impl Signals) {
        if self.sleepers > 0 {
            sig.wake_waiters();
        }
    }

    /// One more of the peer's writes landed: whoever waits on memory the
    /// peer writes looks again.
    pub(super) fn count_landing(&mut self, sig: &impl Signals) {
        self.landed = self.landed.wrapping_add(1);
        self.wake_ring(sig);
    }

    /// Whether a write of the peer's landed since `landed` read `seen`, or
    /// the connection broke: the caller looks again. Else `waker` is woken
    /// when either happens.
    pub(super) fn landed_or_register(&mut self, seen: u64, waker: &Waker) -> bool {
        if self.landed != seen || self.q.lost().is_some() {
            return true;
        }
        if !self.ring_wakers.iter().any(|w| w.will_wake(waker)) {
            self.ring_wakers.push(waker.clone());
        }
        false
    }

    /// Wakes whoever waits on memory the peer writes: awaited looks and
    /// sleeping threads.
    fn wake_ring(&mut self, sig: &impl Signals) {
        for w in self.ring_wakers.drain(..) {
            w.wake();
        }
        if self.ring_sleepers > 0 {
            sig.wake_ring_waiters();
        }
    }

    /// Records a completion; frees the queue room it held. Wakes waiters.
    pub(super) fn complete(&mut self, c: &RawCompletion, sig: &impl Signals) {
        drop(self.q.complete(c));
        self.wake(sig);
    }

    /// The connection broke: say why, and fail what no thread is touching.
    pub(super) fn break_with(&mut self, reason: String, sig: &impl Signals) {
        if self.q.lose(|| reason.clone()) {
            tracing::info!("TCP connection lost: {reason}");
        }
        sig.broken();
        // The operation being written keeps its requests until its writer
        // is done (end_write fails them then).
        let in_use = self.sending_op;
        let queued: Vec<Out> = self.queue.drain(..).collect();
        for o in queued {
            if in_use == Some(op_of(o.wr_id)) {
                self.queue.push_back(o);
                continue;
            }
            self.fail_request(o.wr_id, sig);
        }
        // Messages sent whole: no code touches their buffers any more.
        // Requests being written stay their writer's, reads the reader's.
        for w in self.replies.take_sent_messages() {
            self.fail_request(w, sig);
        }
        sig.wake_sender();
        self.wake_ring(sig);
        self.wake(sig);
    }

    /// Fails request `wr_id` (flushed) for a writer or a break. The final
    /// request of an operation with a read whose response the reader may
    /// be landing is parked instead: the reader completes it when it lets
    /// go of the read, so the operation's buffer never comes back while
    /// the reader fills it.
    pub(super) fn fail_request(&mut self, wr_id: u64, sig: &impl Signals) {
        if is_final(wr_id) && self.replies.reader_holds(op_of(wr_id)) {
            self.replies.park(wr_id);
        } else {
            self.complete(&raw(wr_id, WcStatus::WrFlush), sig);
        }
    }

    /// Marks `o` as being written, from its first byte or from where a
    /// posting thread that began it left off (`o.skip`): how far its writer
    /// is, for the owner to publish to whoever reads replies.
    pub(super) fn start_write(&mut self, o: &Out) -> Progress {
        self.writing = true;
        self.sending = Some(o.seq);
        self.sending_op = Some(op_of(o.wr_id));
        self.replies.start(&request(o));
        Progress { handed: o.skip as u64, in_call: false }
    }

    /// Whether the reading thread is landing a peer's message or write: its
    /// bytes may be seen already (a ring the peer writes is read from
    /// memory), and its acknowledgement is not queued yet.
    pub(super) fn landing(&self) -> bool {
        matches!(self.rx, Rx::Message { .. } | Rx::Write { .. } | Rx::Visible { .. })
    }

    /// The writer of `o` is done with the socket: frees it for the others.
    /// If the write failed, or the connection broke meanwhile (and its flush
    /// skipped this message, which was in use), the writer owned the message,
    /// so it fails it, unless the acknowledgement already completed it.
    /// Written whole, an unacknowledged inline send is done here.
    pub(super) fn end_write(&mut self, o: &Out, write_failed: bool, sig: &impl Signals) {
        self.sending = None;
        self.sending_op = None;
        self.writing = false;
        let lost = self.q.lost().is_some();
        match self.replies.finish(o.seq, !write_failed) {
            // An acknowledgement that came while this writer was in its last
            // call: the operation is done now that nothing reads its buffer.
            Some((wr_id, true)) => self.complete(&raw(wr_id, WcStatus::Success), sig),
            Some((wr_id, false)) => self.fail_request(wr_id, sig),
            None => {}
        }
        if o.unacked() {
            // The socket has the whole frame, and no acknowledgement will
            // come: done. (A refusal still may: it breaks the connection.)
            if !write_failed && !lost {
                self.complete(&raw(o.wr_id, WcStatus::Success), sig);
            } else {
                self.fail_request(o.wr_id, sig);
            }
        }
        if lost {
            // What a break left alone while this message was in use.
            let reason = self.q.lost().unwrap_or_default().to_owned();
            self.break_with(reason, sig);
        }
    }

    /// Queues a reply to one of the peer's requests for the sender. A peer
    /// keeps at most its send-queue depth of requests outstanding, so more
    /// queued replies than that means it ignores its depth or does not read
    /// what it is sent: the connection breaks rather than buffering more.
    pub(super) fn reply(&mut self, ctl: Ctl, sig: &impl Signals) -> Handled {
        if self.control.len() >= self.peer_depth {
            let why = format!(
                "the peer has more than {} requests awaiting replies (its send-queue depth): \
                 it does not read its acknowledgements, or ignores its depth",
                self.peer_depth
            );
            self.break_with(why.clone(), sig);
            return Err(why);
        }
        self.control.push_back(ctl);
        sig.wake_sender();
        Ok(())
    }

    /// A request the peer made was refused: the peer gets `status` (the
    /// last reply it gets), and this side breaks too, as a responder in the
    /// error state does: nothing the peer sent after it is carried out.
    pub(super) fn refuse(&mut self, seq: u32, status: WcStatus, why: String, sig: &impl Signals) -> Handled {
        self.control.push_back(Ctl::Ack { seq, status: status.to_raw() });
        sig.wake_sender();
        self.break_with(why.clone(), sig);
        Err(why)
    }

    /// The final request's work request id of the queued operation whose
    /// requests include `seq` (a request of it was sent and refused, its
    /// final request is still queued).
    #[cold]
    fn queued_chain_of(&self, seq: u32) -> Option<u64> {
        let within = |first: u32, last: u32| seq.wrapping_sub(first) <= last.wrapping_sub(first);
        self.queue.iter().find(|o| is_final(o.wr_id) && within(o.first, o.seq)).map(|o| o.wr_id)
    }

    /// An acknowledgement of `seq` with `status` (the writer of the current
    /// message at `progress`): completes the oldest request waiting for
    /// one, if it answers it (see [`replies`](super::replies)); a refusal
    /// fails the operation it names and breaks the connection; any other
    /// acknowledgement breaks it too.
    pub(super) fn on_ack(&mut self, seq: u32, status: WcStatus, progress: Progress, sig: &impl Signals) -> Handled {
        let why = match self.replies.on_ack(seq, status.is_success(), progress) {
            OnAck::Complete(wr_id) => {
                self.complete(&raw(wr_id, WcStatus::Success), sig);
                return Ok(());
            }
            OnAck::Deferred => return Ok(()),
            OnAck::Violation(why) => why,
            OnAck::Refused(chain) => {
                // The operation: one waiting for a reply, one whose final
                // request is queued, or the one being written (an untracked
                // send refused while its writer is at it).
                let op = chain
                    .or_else(|| self.queued_chain_of(seq))
                    .map(op_of)
                    .or_else(|| self.sending_op.filter(|_| self.sending == Some(seq)));
                match op {
                    Some(op) => {
                        self.q.lose(|| {
                            format!("the connection went to the error state after a request failed with {status}")
                        });
                        // Recorded as the operation's failure; whoever owns its
                        // final request (a writer, the reader, the break below)
                        // completes it once nothing touches its buffer.
                        self.complete(&raw(op, status), sig);
                        self.q.lost().unwrap_or_default().to_owned()
                    }
                    None => format!("the peer refused a request with {status}"),
                }
            }
        };
        // The peer broke the connection, or the rules: nothing more from it
        // is carried out.
        self.break_with(why.clone(), sig);
        Err(why)
    }

    /// This side closed and its threads are gone: whatever they left fails,
    /// and the connection is lost for `reason` if it was not already.
    pub(super) fn stopped(&mut self, reason: String, sig: &impl Signals) {
        self.fail_receives(sig);
        for w in self.replies.take_all() {
            self.complete(&raw(w, WcStatus::WrFlush), sig);
        }
        self.break_with(reason, sig);
    }

    /// Every posted receive fails (flushed): nothing will fill it.
    fn fail_receives(&mut self, sig: &impl Signals) {
        let recvs: Vec<Recv> = self.recvs.drain(..).collect();
        for r in recvs {
            self.complete(&raw(r.wr_id, WcStatus::WrFlush), sig);
        }
    }

    /// The receiving side stopped (the peer is gone, or broke the rules):
    /// receives and reads, which only it fills, fail.
    pub(super) fn receiver_stopped(&mut self, sig: &impl Signals) {
        self.fail_receives(sig);
        for w in self.replies.take_reads() {
            self.complete(&raw(w, WcStatus::WrFlush), sig);
        }
    }
}

pub(super) enum Work {
    Ctl(Ctl),
    /// The rest of a control frame a reader began: its header and the bytes sent.
    Rest(FrameHeader, usize),
    /// A message, and whether more are queued behind it.
    Out(Out, bool),
}

/// What the sender thread does next, by the state alone.
pub(super) enum Next {
    /// Nothing to write now, or another thread writes: sleep until told.
    Wait,
    /// Write this (marked as the one being written).
    Write(Work),
    /// Broken or closing, and every queued reply went out (or failed):
    /// hang up, so the peer sees the end at once.
    HangUp,
}

/// The sender's rule, with no I/O: one writer at a time (a posting or
/// reading thread may be writing directly); first what another thread
/// began and the socket did not take whole (the rest of a control frame,
/// then a message: the stream stays whole), then control frames (replies
/// the peer's requests wait for, before this side's own messages), and
/// once broken or closing, after the last control frame, hang up; else the
/// next queued message. Marks the chosen work as being written; a message
/// is started by the caller ([`Inner::start_write`]).
pub(super) fn next(st: &mut Core) -> Next {
    if st.writing {
        return Next::Wait;
    }
    if let Some((h, sent)) = st.ctl_rest.take() {
        st.writing = true;
        return Next::Write(Work::Rest(h, sent));
    }
    if let Some(o) = st.resume.take() {
        // Already started by the thread that began it.
        st.writing = true;
        return Next::Write(Work::Out(o, false));
    }
    if let Some(c) = st.control.pop_front() {
        st.writing = true;
        return Next::Write(Work::Ctl(c));
    }
    if st.stopping || st.q.lost().is_some() {
        return Next::HangUp;
    }
    match st.queue.pop_front() {
        Some(o) => {
            let more = !st.queue.is_empty();
            Next::Write(Work::Out(o, more))
        }
        None => Next::Wait,
    }
}

/// The frames of message `o`: a frame per segment of at most [`SEGMENT`]
/// bytes of payload (one for none), from its source (a registered buffer,
/// or its inline copy).
pub(super) fn message_frames(o: &Out) -> impl Iterator<Item = OutFrame> + '_ {
    let (op, key, raddr, imm) = match &o.kind {
        OutKind::Send { imm } | OutKind::Inline { imm, .. } => (FrameOp::Send, 0, 0, *imm),
        OutKind::Write { raddr, key, imm } => (FrameOp::Write, *key, *raddr, *imm),
        OutKind::ReadReq { raddr, key } => (FrameOp::ReadReq, *key, *raddr, None),
    };
    let (src, len) = o.payload();
    let total = u32::try_from(o.len).unwrap_or(u32::MAX);
    let flags = if imm.is_some() { IMM } else { 0 } | if wants_ack(o) { ACK } else { 0 };
    segments(len).map(move |(off, n, ends, wire)| {
        let h = FrameHeader {
            op: op as u8,
            flags: flags | ends,
            seq: o.seq,
            key,
            imm: imm.unwrap_or(0),
            addr: raddr + off,
            len: n as u32,
            total,
        };
        OutFrame { h, src: src + off, len: n, wire }
    })
}
