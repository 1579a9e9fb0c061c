//! The TCP transport: the semantics of a verbs reliable connection over the
//! handshake's TCP stream, so the same code and tests run without RDMA.
//!
//! - Two threads per connection. The sender writes this side's messages
//!   (sends, writes, read requests) and the control frames the receiver
//!   asks for (acknowledgements, read responses), straight from registered
//!   memory with `sendmsg`. The receiver reads frames and carries them out:
//!   a send lands in the next posted receive, a write or read is checked
//!   against the domain's table of exposed regions (key, bounds, access)
//!   and done directly in that memory, a response lands in the waiting
//!   read's buffer. The receiver never writes to the socket, so two busy
//!   directions cannot deadlock.
//! - A waiter that spins (for the connection's spin window) reads small
//!   frames itself while the receiver thread is not at the socket (two
//!   calls a frame: one look that shows whether it is whole and whether
//!   more follow, one read of it all), and
//!   acknowledges them itself with one write that never blocks (what the
//!   socket does not take, the sender finishes): no thread hand-over on the
//!   latency path, as a verbs waiter polls its own completion queue. One
//!   thread at a time reads (the reader token); large, partial or waiting
//!   frames stay the receiver thread's. While waiters spin, the receiver
//!   thread naps instead of waking at every frame (which on a busy machine
//!   takes a CPU from a spinner): a spinner that meets a frame it leaves,
//!   or a thread that goes to sleep, ends the nap, and it lasts at most
//!   [`NAP`] in any case.
//! - Payloads travel in segments of at most 1 MiB, so control frames are
//!   not stuck behind a large write.
//! - An operation completes when the peer acknowledged it (a write: the
//!   data is in the peer's memory), in posting order, as on RC. An error
//!   (bad key, out of bounds, missing right, a send larger than the
//!   receive, no receive within the receiver-not-ready budget) fails the
//!   operation with the verbs status and breaks the connection on both
//!   ends, as a queue pair in the error state does. The exception is an
//!   untracked inline send, which asks for no acknowledgement and is done
//!   once the socket has it (see [`TcpConn::post_inline`]).
//! - After the first error (a refused request either way, a lost peer, a
//!   garbled frame) the receiver carries out nothing more from the peer;
//!   the sender delivers the replies already queued (the refusal among
//!   them) and hangs up, or is cut off after [`LINGER`] if the peer does
//!   not read. Both threads then end; the socket closes when the
//!   connection is dropped.
//! - A peer's message waiting for a receive does not stop the receiver
//!   from watching the socket: a peer that dies meanwhile is seen within
//!   [`WATCH`].
//! - Everything held for the peer is bounded: at most the peer's announced
//!   send-queue depth of replies is queued (a peer that exceeds it, by
//!   sending more or by not reading its acknowledgements, breaks the
//!   connection); see [`memory_bound`].
//! - Only the thread that touches an operation's memory completes it, and
//!   teardown joins both threads before anything still owned is released:
//!   no memory is touched after its operation completed.
//!
//! Here the connection's state, shared by both threads and the posters;
//! `frame` the frame header (no I/O), `replies` the socket-free ledger of
//! the replies this side waits for, `socket` the raw reads and writes,
//! `sender` and `receiver` the two threads (the rules a reliable
//! connection keeps are carried out in `receiver`), `conn` the operations.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::queue::{Limits, Posted, QueueCore, RemoteOp, WorkItem};
use crate::bootstrap::{self, MAX_TCP_QUEUE_DEPTH, TcpEndpoint};
use crate::completion::{Opcode, WcStatus};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::LocalParts;
use crate::memory::keys::{KeyEntry, KeyTable};
use crate::ops::{OpId, OpOutcome, RawCompletion, WaitError, Waited, is_final, op_of, waited};
use crate::options::{ConnectOptions, ConnectionInfo, Transport};
use replies::{OnAck, Progress, Replies, Reply, Request};

mod conn;
mod frame;
mod receiver;
mod replies;
mod responder;
mod sender;
mod socket;
#[cfg(test)]
mod tests;

use frame::*;
use socket::*;

/// The largest message (send, or write with immediate) this side accepts.
pub(crate) const MAX_MESSAGE: u32 = 1 << 30;
/// The most bytes of a message one write call hands to the socket: the
/// rest of a header and a step of payload.
const MAX_CALL: u64 = (HEADER + STEP) as u64;
/// Inline sends copy at most this much into the request.
const MAX_INLINE: u32 = 1024;
/// Inline copy buffers a connection starts with.
const INLINE_POOL: usize = 8;
/// After the connection broke, how long the sender may take to deliver the
/// replies already queued (a refusal) before the socket is shut under it.
const LINGER: Duration = Duration::from_millis(500);
/// While a peer's message waits for a receive, how often the receiver
/// looks whether the peer is still there.
const WATCH: Duration = Duration::from_millis(5);

/// The send-queue depth a TCP connection uses (and announces) for `opts`.
pub(crate) fn send_depth(opts: &ConnectOptions) -> u32 {
    opts.send_queue_depth.clamp(1, MAX_TCP_QUEUE_DEPTH)
}

/// The most memory one TCP connection holds, whatever its peer does: the
/// receive scratch buffer, the two threads' stacks in use, replies queued
/// for the peer's outstanding requests (`peer_depth` at most; a queue's
/// capacity may double), and this side's own queues (an inline copy of up
/// to [`MAX_INLINE`] bytes per send entry, bookkeeping per entry).
pub(crate) fn memory_bound(peer_depth: u32, send_depth: u32, recv_depth: u32) -> u64 {
    const STACKS: u64 = 2 * 64 * 1024;
    const PER_SEND: u64 = MAX_INLINE as u64 + 256;
    const PER_RECV: u64 = 128;
    let reply = std::mem::size_of::<Ctl>() as u64;
    STEP as u64
        + STACKS
        + 2 * u64::from(peer_depth) * reply
        + 2 * u64::from(send_depth) * PER_SEND
        + 2 * u64::from(recv_depth) * PER_RECV
}

// ---- the connection ----

enum OutKind {
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
struct Out {
    seq: u32,
    wr_id: u64,
    kind: OutKind,
    addr: u64,
    len: u64,
    /// Bytes of its first frame already on the wire: a posting thread sent
    /// them and the socket took no more (see [`TcpConn::send_direct`]).
    skip: usize,
    /// The sequence number of the first message of its operation (its own
    /// for a single message): the chain an error acknowledgement falls in.
    first: u32,
}

impl Out {
    /// An inline send the peer does not acknowledge.
    fn unacked(&self) -> bool {
        matches!(self.kind, OutKind::Inline { unacked: true, .. })
    }

    /// Its bytes on the wire: a frame per segment of payload (one for none).
    fn wire_len(&self) -> u64 {
        let len = match &self.kind {
            OutKind::ReadReq { .. } => 0,
            OutKind::Inline { data, .. } => data.len() as u64,
            _ => self.len,
        };
        len + HEADER as u64 * len.div_ceil(SEGMENT as u64).max(1)
    }
}

/// Message `o` as its writer starts it: what it waits for, its size.
/// Which thread carries a frame out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// The receiver thread: its replies go through the sender thread,
    /// which sends them while this one reads on.
    Receiver,
    /// A spinning waiter: it acknowledges what it read itself.
    Waiter,
}

/// Whether the peer acknowledges `o`: the last message of an operation,
/// unless it is an unacknowledged inline send.
fn wants_ack(o: &Out) -> bool {
    is_final(o.wr_id) && !o.unacked()
}

fn request(o: &Out) -> Request {
    let reply = match o.kind {
        OutKind::ReadReq { .. } => Reply::Read { addr: o.addr, len: o.len },
        _ if wants_ack(o) => Reply::Ack,
        _ => Reply::None,
    };
    Request { seq: o.seq, first: o.first, wr_id: o.wr_id, reply, wire: o.wire_len() }
}

/// A frame the receiver asks the sender to send.
enum Ctl {
    Ack { seq: u32, status: u32 },
    ReadResp { seq: u32, entry: Arc<KeyEntry>, addr: u64, len: u64 },
    Bye,
}

struct Recv {
    wr_id: u64,
    addr: u64,
    len: u64,
}

struct TcpState {
    /// Operations, credits, the lost state.
    q: QueueCore,
    stopping: bool,
    next_seq: u32,
    queue: VecDeque<Out>,
    control: VecDeque<Ctl>,
    /// The replies this side waits for, in request order, and who may
    /// complete each request (see [`replies`]). A request enters when its
    /// writer starts it, since a reply may arrive before the writer has
    /// returned from its last call.
    replies: Replies,
    /// The message being written now (by the sender thread, or by a posting
    /// thread sending directly, or begun by one and not yet finished by the
    /// other): its memory is in use, so only its writer may fail it.
    sending: Option<u32>,
    /// The operation of the message being written: none of its requests is
    /// failed by anyone but the writer (completing its final request would
    /// hand its buffer back while the writer still reads it).
    sending_op: Option<u64>,
    /// A thread is writing to the socket: frames never interleave.
    writing: bool,
    /// A message whose first bytes a posting thread wrote before the socket
    /// filled up: the sender thread finishes it before anything else.
    resume: Option<Out>,
    /// A control frame whose first bytes a reader sent directly before the
    /// socket filled up (the header, and how many of its bytes went): the
    /// sender thread finishes it before anything else.
    ctl_rest: Option<(FrameHeader, usize)>,
    recvs: VecDeque<Recv>,
    /// The sender thread has ended (after the connection broke or stopped).
    sender_done: bool,
    /// Threads asleep on `events`: waking nobody costs no system call.
    sleepers: usize,
}

impl TcpState {
    /// A connection's state before anything was posted: its queues sized
    /// for the send queues, this side's (`limits`) and the peer's
    /// (`peer_depth`, whose messages are acknowledged), so nothing
    /// allocates in steady state.
    fn new(limits: Limits, peer_depth: usize) -> Self {
        TcpState {
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
            sleepers: 0,
        }
    }
}

/// The right to read the socket: frames are read whole by one thread at a
/// time, the receiver thread or a waiter that spins (which then carries out
/// what arrived itself, without a hand-over between threads).
struct Reader {
    /// Where refused or withdrawn bytes are read to and dropped.
    scratch: Vec<u8>,
}

struct Inner {
    state: Mutex<TcpState>,
    /// Taken before `state`, never while holding it.
    reader: Mutex<Reader>,
    /// Waiters spinning now: while there are any, the receiver thread naps
    /// instead of watching the socket, so that it does not take a CPU from
    /// them at every frame they carry out themselves.
    spinners: AtomicUsize,
    /// The receiver thread naps (on `rx_wake`, with the reader released).
    napping: AtomicBool,
    /// Ends the receiver thread's nap: a waiter left it a frame, or a
    /// thread goes to sleep on `events` and needs it to watch the socket.
    rx_wake: Condvar,
    /// The sender thread waits here: queued messages, control frames,
    /// stopping.
    work: Condvar,
    /// Everyone else: completions, queue room, posted receives, a drained
    /// control queue at shutdown, a lost connection. Two condition
    /// variables, so a completion does not wake the sender thread and a
    /// queued frame does not wake the waiters.
    events: Condvar,
    fd: RawFd,
    /// How far the writer of the current message is ([`Progress`], packed):
    /// stored by the writer around each call, without the lock, and read
    /// by whoever reads a reply, to tell a reply that came early.
    tx: AtomicU64,
    /// Set with `lost`: read without the lock by the receiver before each
    /// frame, so nothing more from the peer is carried out once broken.
    dead: AtomicBool,
    keys: KeyTable,
    /// The domain's exposed GPU regions: what a write with immediate wrote
    /// is made visible to CUDA work before its receive completes.
    #[cfg(feature = "cuda")]
    visible: crate::memory::visible::VisibleTable,
    /// The keys this connection's peer may use: those advertised on this
    /// connection (in the handshake, or granted since). Another
    /// connection's regions are not reachable through this one.
    granted: RwLock<Vec<u32>>,
    /// The connection's fixed limits (the queue core has them too).
    limits: Limits,
    /// The peer's send-queue depth: the most replies (acknowledgements, read
    /// responses) its outstanding requests can need.
    peer_depth: usize,
    /// How long a wait looks again (yielding) before it sleeps.
    spin: Duration,
    /// Inline copies' buffers, reused (at most the send-queue depth kept).
    inline_pool: Mutex<Vec<Vec<u8>>>,
    /// How long a peer's send waits here for a receive; `None`: forever
    /// (or until the peer is gone, or this side closes).
    rnr_budget: Option<Duration>,
}

/// One connection's TCP transport.
pub(crate) struct TcpConn {
    inner: Arc<Inner>,
    stream: TcpStream,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The receiver-not-ready timer, per the InfiniBand encoding (code 0 is the longest).
fn rnr_timer(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120, 7_680,
        10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(u64::from(US[usize::from(code.min(31))]))
}

fn raw(wr_id: u64, status: WcStatus) -> RawCompletion {
    RawCompletion { wr_id, status, byte_len: 0, imm: None, qp_num: 0, vendor_err: 0, by_write_imm: false }
}

impl TcpState {
    /// Whether a new frame could go to the socket now, ahead of nothing:
    /// no thread writes, no frame is half sent, no control frame waits and
    /// the connection is not closing (the operation queue is the caller's
    /// to judge).
    fn socket_idle(&self) -> bool {
        !self.writing && self.resume.is_none() && self.ctl_rest.is_none() && self.control.is_empty() && !self.stopping
    }

    /// Whether the sender thread has something to do: a frame to finish or
    /// to send, or a broken or closing connection to hang up.
    fn has_work(&self) -> bool {
        self.resume.is_some()
            || self.ctl_rest.is_some()
            || !self.control.is_empty()
            || !self.queue.is_empty()
            || self.stopping
            || self.q.lost().is_some()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, TcpState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The exposed region under `key`, if this connection's peer may use it.
    fn lookup(&self, key: u32) -> Option<Arc<KeyEntry>> {
        if !self.granted.read().unwrap_or_else(|e| e.into_inner()).contains(&key) {
            return None;
        }
        self.keys.lookup(key)
    }

    /// The writer of `o` is done with the socket: frees it for the others.
    /// If the write failed, or the connection broke meanwhile (and its flush
    /// skipped this message, which was in use), the writer owned the message,
    /// so it fails it, unless the acknowledgement already completed it.
    /// Written whole, an unacknowledged inline send is done here.
    fn end_write(&self, st: &mut TcpState, o: &Out, write_failed: bool) {
        st.sending = None;
        st.sending_op = None;
        st.writing = false;
        let lost = st.q.lost().is_some();
        match st.replies.finish(o.seq, !write_failed) {
            // An acknowledgement that came while this writer was in its last
            // call: the operation is done now that nothing reads its buffer.
            Some((wr_id, true)) => self.complete(st, &raw(wr_id, WcStatus::Success)),
            Some((wr_id, false)) => self.fail_request(st, wr_id),
            None => {}
        }
        if o.unacked() {
            // The socket has the whole frame, and no acknowledgement will
            // come: done. (A refusal still may: it breaks the connection.)
            if !write_failed && !lost {
                self.complete(st, &raw(o.wr_id, WcStatus::Success));
            } else {
                self.fail_request(st, o.wr_id);
            }
        }
        if lost {
            // What a break left alone while this message was in use.
            let reason = st.q.lost().unwrap_or_default().to_owned();
            self.break_with(st, reason);
        }
    }

    /// Marks `o` as being written, from its first byte or from where a
    /// posting thread that began it left off (`o.skip`).
    fn start_write(&self, st: &mut TcpState, o: &Out) {
        st.writing = true;
        st.sending = Some(o.seq);
        st.sending_op = Some(op_of(o.wr_id));
        st.replies.start(&request(o));
        self.tx.store(Progress { handed: o.skip as u64, in_call: false }.pack(), Ordering::Release);
    }

    /// Fails request `wr_id` (flushed) for a writer or a break. The final
    /// request of an operation with a read whose response the reader may
    /// be landing is parked instead: the reader completes it when it lets
    /// go of the read, so the operation's buffer never comes back while
    /// the reader fills it.
    fn fail_request(&self, st: &mut TcpState, wr_id: u64) {
        if is_final(wr_id) && st.replies.reader_holds(op_of(wr_id)) {
            st.replies.park(wr_id);
        } else {
            self.complete(st, &raw(wr_id, WcStatus::WrFlush));
        }
    }

    /// Returns an inline message's copy to the pool (at most the send-queue
    /// depth kept), so inline sends allocate nothing in steady state.
    fn recycle(&self, o: &mut Out) {
        if let OutKind::Inline { data, .. } = &mut o.kind {
            let mut pool = self.inline_pool.lock().unwrap_or_else(|e| e.into_inner());
            if pool.len() < self.limits.send_depth as usize {
                pool.push(std::mem::take(data));
            }
        }
    }

    /// Sleeps on `events` for at most `d` (counted among the sleepers).
    fn sleep<'a>(&self, mut st: MutexGuard<'a, TcpState>, d: Duration) -> MutexGuard<'a, TcpState> {
        // What this thread waits for now comes only through the receiver thread.
        self.end_nap();
        st.sleepers += 1;
        let mut st = self.events.wait_timeout(st, d).unwrap_or_else(|e| e.into_inner()).0;
        st.sleepers -= 1;
        st
    }

    /// Ends the receiver thread's nap, if it naps.
    fn end_nap(&self) {
        if self.napping.load(Ordering::Acquire) {
            self.rx_wake.notify_one();
        }
    }

    /// Wakes the threads asleep on `events`, if any (`st` is their state,
    /// locked: none can be between its check and its sleep).
    fn wake(&self, st: &TcpState) {
        if st.sleepers > 0 {
            self.events.notify_all();
        }
    }

    /// Records a completion; frees the queue room it held. Wakes waiters.
    fn complete(&self, st: &mut TcpState, c: &RawCompletion) {
        drop(st.q.complete(c));
        self.wake(st);
    }

    /// The connection broke: say why, and fail what no thread is touching.
    fn break_with(&self, st: &mut TcpState, reason: String) {
        if st.q.lose(|| reason.clone()) {
            tracing::info!("TCP connection lost: {reason}");
        }
        self.dead.store(true, Ordering::Release);
        // The operation being written keeps its requests until its writer
        // is done (end_write fails them then).
        let in_use = st.sending_op;
        let queued: Vec<Out> = st.queue.drain(..).collect();
        for o in queued {
            if in_use == Some(op_of(o.wr_id)) {
                st.queue.push_back(o);
                continue;
            }
            self.fail_request(st, o.wr_id);
        }
        // Messages sent whole: no code touches their buffers any more.
        // Requests being written stay their writer's, reads the reader's.
        for w in st.replies.take_sent_messages() {
            self.fail_request(st, w);
        }
        self.work.notify_all();
        self.wake(st);
    }
}

impl Inner {
    /// Queues a reply to one of the peer's requests for the sender. A peer
    /// keeps at most its send-queue depth of requests outstanding, so more
    /// queued replies than that means it ignores its depth or does not read
    /// what it is sent: the connection breaks rather than buffering more.
    fn reply(&self, st: &mut TcpState, ctl: Ctl) -> Handled {
        if st.control.len() >= self.peer_depth {
            let why = format!(
                "the peer has more than {} requests awaiting replies (its send-queue depth): \
                 it does not read its acknowledgements, or ignores its depth",
                self.peer_depth
            );
            self.break_with(st, why.clone());
            return Err(why);
        }
        st.control.push_back(ctl);
        self.work.notify_one();
        Ok(())
    }

    /// Acknowledges the peer's message `seq`. A spinning waiter that read
    /// it sends the acknowledgement itself while nobody else writes to the
    /// socket, with the lock released: no hand-over to the sender thread on
    /// the latency path. One attempt that never blocks (a reader never
    /// waits on a peer that does not read); what the socket does not take,
    /// the sender thread sends. The receiver thread hands it over: the
    /// sender sends it while the receiver reads on.
    fn acknowledge(&self, mut st: MutexGuard<'_, TcpState>, seq: u32, by: Reading) -> Handled {
        let socket_free = st.socket_idle() && st.queue.is_empty() && st.q.lost().is_none();
        if by == Reading::Receiver || !socket_free {
            return self.reply(&mut st, Ctl::Ack { seq, status: 0 });
        }
        st.writing = true;
        drop(st);
        let h = FrameHeader { op: FrameOp::Ack as u8, seq, ..FrameHeader::default() };
        let sent = send_now(self.fd, &h.encode());
        let mut st = self.lock();
        st.writing = false;
        match sent {
            Ok(HEADER) => {}
            // Before anything queued meanwhile (a bye goes last); the sender
            // meets the error, if any, and breaks the connection.
            Ok(0) | Err(_) => st.control.push_front(Ctl::Ack { seq, status: 0 }),
            Ok(n) => st.ctl_rest = Some((h, n)),
        }
        if st.has_work() {
            // The sender thread may wait for the socket to be free.
            self.work.notify_one();
        }
        Ok(())
    }

    /// Shuts the socket both ways: the peer sees the end of the stream, and
    /// a thread blocked on it wakes.
    fn hang_up(&self) {
        // SAFETY: `fd` is the connection's socket, open until the `TcpConn`
        // owning it is dropped, which joins both threads first. shutdown(2)
        // neither closes nor reuses the descriptor.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }

    /// Whether the peer closed its end or the connection failed (without
    /// reading anything).
    fn peer_gone(&self) -> bool {
        let mut p = libc::pollfd { fd: self.fd, events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd; a zero timeout never blocks.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}
