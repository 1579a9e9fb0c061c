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
use crate::memory::keys::{KeyEntry, KeyTable};
use crate::memory::{Access, LocalParts};
use crate::ops::{OpId, OpOutcome, RawCompletion, WaitError, Waited, is_final, op_of, waited};
use crate::options::{ConnectOptions, ConnectionInfo, Transport};
use replies::{OnAck, Progress, Replies, Reply, Request};

mod replies;

/// The largest message (send, or write with immediate) this side accepts.
pub(crate) const MAX_MESSAGE: u32 = 1 << 30;
/// Payload bytes per frame.
const SEGMENT: usize = 1 << 20;
/// Bytes moved per system call while a gate is held (see [`KeyEntry::alive`]).
const STEP: usize = 1 << 20;
/// The longest one receive call blocks (the socket's receive timeout): the
/// longest a withdrawal waits for a stalled peer's write.
const RECV_WAIT: Duration = Duration::from_millis(10);
const HEADER: usize = 32;
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

// ---- frames ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum FrameOp {
    Send = 1,
    Write = 2,
    ReadReq = 3,
    ReadResp = 4,
    Ack = 5,
    Bye = 6,
}

impl FrameOp {
    fn from_raw(b: u8) -> Option<FrameOp> {
        Some(match b {
            1 => FrameOp::Send,
            2 => FrameOp::Write,
            3 => FrameOp::ReadReq,
            4 => FrameOp::ReadResp,
            5 => FrameOp::Ack,
            6 => FrameOp::Bye,
            _ => return None,
        })
    }
}

const FIRST: u8 = 1;
const LAST: u8 = 2;
const IMM: u8 = 4;
/// Acknowledge this message: set on the final request of an operation.
/// The others of a chain are acknowledged by that one (the receiver
/// carries messages out in order), or fail it with an error
/// acknowledgement of their own, as an unsignaled request does on verbs.
/// An untracked inline send goes without it (see [`wants_ack`]).
const ACK: u8 = 8;

/// A frame header: `op u8, flags u8, 2 reserved, seq u32, key u32, imm u32,
/// addr u64, len u32, total u32`, little-endian. `addr` is the target
/// address of a write segment or read request, the offset of a read
/// response segment; `total` the whole message's length on its first
/// segment, the status on an acknowledgement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct FrameHeader {
    op: u8,
    flags: u8,
    seq: u32,
    key: u32,
    imm: u32,
    addr: u64,
    len: u32,
    total: u32,
}

impl FrameHeader {
    fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0] = self.op;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.key.to_le_bytes());
        b[12..16].copy_from_slice(&self.imm.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..32].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    /// Decodes a header from the peer and checks what needs no context:
    /// known flag bits, a segment no longer than [`SEGMENT`].
    fn parse(b: &[u8; HEADER]) -> std::result::Result<FrameHeader, String> {
        let h = FrameHeader::decode(b);
        if h.flags & !(FIRST | LAST | IMM | ACK) != 0 {
            return Err(format!("a garbled frame (flags {:#04x}): the stream is out of step", h.flags));
        }
        if h.len as usize > SEGMENT {
            return Err(format!(
                "a garbled frame (a segment of {} bytes, at most {SEGMENT}): the stream is out of step",
                h.len
            ));
        }
        Ok(h)
    }

    /// Checks that `self`, read inside a message, continues the message
    /// `first` started (messages are never interleaved on the stream).
    fn continues(&self, first: &FrameHeader) -> Handled {
        if self.op != first.op || self.seq != first.seq || self.flags & FIRST != 0 {
            return Err(format!(
                "a garbled frame (operation {} of request {} inside operation {} of request {}): the stream is out of step",
                self.op, self.seq, first.op, first.seq
            ));
        }
        Ok(())
    }

    fn decode(b: &[u8; HEADER]) -> FrameHeader {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        FrameHeader {
            op: b[0],
            flags: b[1],
            seq: u32_at(4),
            key: u32_at(8),
            imm: u32_at(12),
            addr: u64::from_le_bytes(b[16..24].try_into().unwrap_or_default()),
            len: u32_at(24),
            total: u32_at(28),
        }
    }
}

// ---- raw socket I/O (no Rust references to memory the peer fills) ----

fn wait_fd(fd: RawFd, events: i16) -> io::Result<()> {
    wait_fd_for(fd, events, -1)
}

/// [`wait_fd`] for at most `ms` milliseconds (-1: no limit).
fn wait_fd_for(fd: RawFd, events: i16, ms: i32) -> io::Result<()> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Reads up to `len` bytes into `ptr`: what is there, or, with no
/// `MSG_DONTWAIT` in `flags`, what comes before [`RECV_WAIT`] passes
/// (`WouldBlock` when none came); 0 means EOF.
///
/// # Safety
/// `ptr..ptr + len` must be valid for writes and not referenced by Rust code.
unsafe fn recv_some(fd: RawFd, ptr: *mut u8, len: usize, flags: libc::c_int) -> io::Result<usize> {
    loop {
        // SAFETY: the caller guarantees the destination. The socket's receive
        // timeout (RECV_WAIT) bounds a wait. Without MSG_WAITALL: it would
        // wake this thread at every packet only to sleep again until the
        // whole length is there; taking what is there costs fewer wake-ups
        // (measured: 64 KiB lists 0.82x -> 0.92x of a plain socket).
        let n = unsafe { libc::recv(fd, ptr.cast(), len, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Fills `ptr..ptr+len` from the socket. `gate` is held while bytes move
/// and across at most one [`RECV_WAIT`] for the network, so a withdrawal
/// waits at most that long; when it reports the target gone the rest is
/// read and dropped. Returns `Ok(false)` on EOF.
///
/// # Safety
/// While `gate` returns true, `ptr..ptr + len` must be valid for writes and
/// not referenced by Rust code.
unsafe fn recv_into(
    fd: RawFd,
    ptr: *mut u8,
    len: usize,
    gate: Option<&RwLock<bool>>,
    scratch: &mut [u8],
) -> io::Result<bool> {
    let mut got = 0;
    while got < len {
        let want = (len - got).min(STEP);
        let guard = gate.map(|g| g.read().unwrap_or_else(|e| e.into_inner()));
        let n = if guard.as_ref().is_none_or(|alive| **alive) {
            // SAFETY: inside the range the caller vouches for, while the gate holds.
            unsafe { recv_some(fd, ptr.add(got), want, 0) }
        } else {
            // The region was revoked: drop the bytes.
            let k = want.min(scratch.len());
            // SAFETY: `scratch` is our own buffer.
            unsafe { recv_some(fd, scratch.as_mut_ptr(), k, 0) }
        };
        drop(guard);
        match n {
            Ok(0) => return Ok(false),
            Ok(n) => got += n,
            // Nothing for a while: wait for data without holding the gate.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait_fd(fd, libc::POLLIN)?,
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads what is there now, up to `buf.len()` bytes, without waiting
/// (`WouldBlock` when nothing is); with `peek`, leaves it in the socket.
fn recv_now(fd: RawFd, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    let flags = libc::MSG_DONTWAIT | if peek { libc::MSG_PEEK } else { 0 };
    // SAFETY: `buf` is exclusively borrowed for the call, so no Rust code
    // refers to it while the kernel writes it.
    unsafe { recv_some(fd, buf.as_mut_ptr(), buf.len(), flags) }
}

/// One attempt to write `bytes` without waiting: how many the socket took
/// (0 when it is full).
fn send_now(fd: RawFd, bytes: &[u8]) -> io::Result<usize> {
    sent_without_waiting(|| {
        // SAFETY: `bytes` is borrowed for the call; MSG_NOSIGNAL instead of SIGPIPE.
        unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) }
    })
}

/// The bytes a non-blocking send call took: 0 when the socket is full;
/// the call is made again when a signal interrupted it.
fn sent_without_waiting(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::WouldBlock => return Ok(0),
            io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
}

fn recv_buf(fd: RawFd, buf: &mut [u8]) -> io::Result<bool> {
    let (ptr, len) = (buf.as_mut_ptr(), buf.len());
    let mut scratch = [];
    // SAFETY: `buf` is exclusively borrowed for the call.
    unsafe { recv_into(fd, ptr, len, None, &mut scratch) }
}

fn discard(fd: RawFd, mut len: usize, scratch: &mut [u8]) -> io::Result<bool> {
    while len > 0 {
        let k = len.min(scratch.len());
        if !recv_buf(fd, &mut scratch[..k])? {
            return Ok(false);
        }
        len -= k;
    }
    Ok(true)
}

/// Where a message's writer reports its progress: the atomic, and the
/// bytes of the message before this frame.
type Tx<'a> = Option<(&'a AtomicU64, u64)>;

/// Stores a writer's progress (see [`Inner::tx`]).
fn report(tx: Tx<'_>, handed_in_frame: usize, in_call: bool) {
    if let Some((at, base)) = tx {
        at.store(Progress { handed: base + handed_in_frame as u64, in_call }.pack(), Ordering::Release);
    }
}

/// Sends a header and `len` bytes at `ptr`. `gate` is held only while bytes
/// move; if it reports the source gone, `Ok(false)` is returned after the
/// header and the bytes sent so far (the caller then breaks the connection).
/// A message's writer reports through `tx` how much of it the socket has,
/// and when it is inside a call that may hand more.
///
/// # Safety
/// While `gate` returns true, `ptr..ptr + len` must be valid for reads.
#[allow(clippy::too_many_arguments)]
unsafe fn send_frame(
    fd: RawFd,
    header: &FrameHeader,
    ptr: *const u8,
    len: usize,
    gate: Option<&RwLock<bool>>,
    already: usize,
    more: bool,
    tx: Tx<'_>,
) -> io::Result<bool> {
    let head = header.encode();
    // More follows at once: let the kernel fill segments across frames
    // (a 64 KiB payload and its header would otherwise end in a runt).
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
    // The first `already` bytes of the frame went out earlier (a posting
    // thread's attempt that the socket cut short).
    let mut head_sent = already.min(HEADER);
    let mut sent = already.saturating_sub(HEADER).min(len);
    report(tx, head_sent + sent, false);
    while head_sent < HEADER || sent < len {
        let guard = gate.map(|g| g.read().unwrap_or_else(|e| e.into_inner()));
        if guard.as_ref().is_some_and(|alive| !**alive) {
            return Ok(false);
        }
        let mut iov = [
            libc::iovec { iov_base: head[head_sent..].as_ptr() as *mut libc::c_void, iov_len: HEADER - head_sent },
            // SAFETY: inside the range the caller vouches for, while the gate holds.
            libc::iovec { iov_base: unsafe { ptr.add(sent) } as *mut libc::c_void, iov_len: (len - sent).min(STEP) },
        ];
        let (first, count) = if head_sent < HEADER { (0, 2) } else { (1, 1) };
        // SAFETY: a zeroed msghdr is valid; the iovecs outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[first..].as_mut_ptr();
        msg.msg_iovlen = count;
        report(tx, head_sent + sent, true);
        // SAFETY: valid socket, message and buffers; MSG_NOSIGNAL instead of SIGPIPE.
        let n = unsafe { libc::sendmsg(fd, &msg, flags) };
        drop(guard);
        if n < 0 {
            report(tx, head_sent + sent, false);
            let e = io::Error::last_os_error();
            match e.kind() {
                // The socket is full: wait for room without holding the gate.
                io::ErrorKind::WouldBlock => wait_fd(fd, libc::POLLOUT)?,
                io::ErrorKind::Interrupted => {}
                _ => return Err(e),
            }
            continue;
        }
        let mut n = n as usize;
        if head_sent < HEADER {
            let h = n.min(HEADER - head_sent);
            head_sent += h;
            n -= h;
        }
        sent += n;
        report(tx, head_sent + sent, false);
    }
    Ok(true)
}

fn send_header(fd: RawFd, header: &FrameHeader) -> io::Result<()> {
    // SAFETY: no payload.
    unsafe { send_frame(fd, header, std::ptr::null(), 0, None, 0, false, None) }.map(drop)
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

impl TcpConn {
    /// Lets the peer use the region under `key` through this connection.
    pub(crate) fn grant(&self, key: u32) {
        let mut granted = self.inner.granted.write().unwrap_or_else(|e| e.into_inner());
        if !granted.contains(&key) {
            granted.push(key);
        }
    }

    pub(crate) fn establish(
        mem: &crate::memory::MemoryDomain,
        stream: TcpStream,
        theirs: &TcpEndpoint,
        opts: &ConnectOptions,
        deadline: Deadline,
        reason: String,
    ) -> Result<(TcpConn, ConnectionInfo)> {
        bootstrap::exchange_ready(&stream, deadline)?;
        stream.set_read_timeout(Some(RECV_WAIT))?;
        stream.set_write_timeout(None)?;
        stream.set_nonblocking(false)?;
        // Socket buffers stay with the kernel's autotuning: a fixed SO_RCVBUF
        // turns it off and is capped by net.core.rmem_max (208 KiB by default).
        let peer_addr = stream.peer_addr().ok();
        let max_message = u64::from(MAX_MESSAGE.min(theirs.max_message));
        let limits = Limits {
            domain_id: mem.id(),
            send_depth: send_depth(opts),
            recv_depth: opts.recv_queue_depth.max(1),
            max_message,
            qp_num: 0,
        };
        let peer_depth = theirs.send_depth.clamp(1, MAX_TCP_QUEUE_DEPTH) as usize;
        let inner = Arc::new(Inner {
            state: Mutex::new(TcpState {
                q: QueueCore::new(limits),
                stopping: false,
                next_seq: 1,
                // Sized for the send queues, this side's and the peer's (whose
                // messages are acknowledged): nothing allocates in steady state.
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
            }),
            reader: Mutex::new(Reader { scratch: vec![0u8; STEP] }),
            spinners: AtomicUsize::new(0),
            napping: AtomicBool::new(false),
            rx_wake: Condvar::new(),
            work: Condvar::new(),
            events: Condvar::new(),
            fd: stream.as_raw_fd(),
            tx: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            keys: mem.keys.clone(),
            #[cfg(feature = "cuda")]
            visible: mem.visible.clone(),
            granted: RwLock::new(opts.advertise.iter().map(|r| r.rkey).collect()),
            limits,
            peer_depth,
            // A few buffers up front: the sender may still hold the last one
            // when the next inline send is posted (its acknowledgement can
            // beat the sender back to the pool). The pool grows only to the
            // concurrency actually used, then stays.
            inline_pool: Mutex::new((0..INLINE_POOL).map(|_| Vec::with_capacity(MAX_INLINE as usize)).collect()),
            spin: opts.spin,
            // The peer's retry count, this side's timer, as on verbs.
            rnr_budget: (theirs.rnr_retry < 7)
                .then(|| rnr_timer(opts.min_rnr_timer) * (u32::from(theirs.rnr_retry) + 1)),
        });
        let sender = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new().name("gpu-rdma-tcp-tx".into()).spawn(move || sender(&inner))?
        };
        let receiver = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new().name("gpu-rdma-tcp-rx".into()).spawn(move || receiver(&inner))?
        };
        let info = ConnectionInfo {
            peer_name: Vec::new(),
            transport: Transport::Tcp,
            transport_reason: reason,
            peer_addr,
            local_qp_num: 0,
            remote_qp_num: 0,
            mtu: SEGMENT as u32,
            max_message_size: max_message,
            max_inline: MAX_INLINE,
            send_queue_depth: limits.send_depth,
            recv_queue_depth: limits.recv_depth,
            reads_in_flight: limits.send_depth,
            memory_bound: Some(memory_bound(inner.peer_depth as u32, limits.send_depth, limits.recv_depth)),
        };
        Ok((TcpConn { inner, stream, threads: Mutex::new(vec![sender, receiver]) }, info))
    }

    /// Checks a local buffer: in this connection's domain, and not GPU
    /// memory (which goes over TCP through the staging pipeline).
    fn check_local(q: &QueueCore, l: &LocalParts) -> Result<()> {
        q.check_local(l)?;
        if l.path.is_some() {
            return Err(Error::InvalidArgument("GPU memory goes over TCP through the staging pipeline".into()));
        }
        Ok(())
    }

    /// Checks a work item as verbs would; returns its byte count.
    fn check_item(q: &QueueCore, item: &WorkItem) -> Result<u64> {
        if let Some(l) = &item.local {
            Self::check_local(q, l)?;
        }
        q.check_item(item)
    }

    /// The message a checked work item becomes: its kind, source address and length.
    fn message(item: &WorkItem) -> (OutKind, u64, u64) {
        let (addr, len) = item.local.as_ref().map_or((0, 0), |l| (l.addr, l.len as u64));
        let kind = match item.op {
            RemoteOp::Send => OutKind::Send { imm: None },
            RemoteOp::SendWithImm(imm) => OutKind::Send { imm: Some(imm) },
            RemoteOp::Write(r) => OutKind::Write { raddr: r.addr(), key: r.rkey(), imm: None },
            RemoteOp::WriteWithImm(r, imm) => OutKind::Write { raddr: r.addr(), key: r.rkey(), imm: Some(imm) },
            RemoteOp::Read(r) => OutKind::ReadReq { raddr: r.addr(), key: r.rkey() },
        };
        (kind, addr, len)
    }

    /// Queues `count` messages (`next(i)` makes the i-th) as one operation,
    /// waiting for send-queue room up to `due`. Allocates nothing once the
    /// queues have grown to their steady size.
    fn enqueue(
        &self,
        opcode: Opcode,
        count: usize,
        bytes: u64,
        mut due: Deadline,
        mut next: impl FnMut(usize) -> (OutKind, u64, u64),
    ) -> Posted {
        let n = count as u32;
        let mut st = self.inner.lock();
        loop {
            match st.q.send_room(n) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => return Posted::refused(e),
            }
            let now = Instant::now();
            let deadline = due.at_from(now);
            if now >= deadline {
                return Posted::refused(st.q.send_full());
            }
            st = self.inner.sleep(st, deadline - now);
        }
        let id = st.q.start_send(opcode, n, bytes);
        let first = st.next_seq;
        for i in 0..count {
            let (kind, addr, len) = next(i);
            let seq = st.next_seq;
            st.next_seq = st.next_seq.wrapping_add(1).max(1);
            let wr_id = id.wr_id(i + 1 == count);
            st.queue.push_back(Out { seq, wr_id, kind, addr, len, skip: 0, first });
        }
        if count == 1 && st.socket_idle() && st.queue.len() == 1 && matches!(st.queue[0].kind, OutKind::Inline { .. }) {
            if let Some(o) = st.queue.pop_front() {
                return self.send_direct(st, o, id);
            }
        }
        self.inner.work.notify_one();
        Posted::Ok(id)
    }

    /// Sends a small message from the posting thread while the socket is
    /// free: no hand-off to the sender thread, a wake-up saved on the
    /// latency path. Never blocks: what the socket does not take at once,
    /// the sender thread finishes before anything else.
    fn send_direct(&self, mut st: MutexGuard<'_, TcpState>, mut o: Out, id: OpId) -> Posted {
        self.inner.start_write(&mut st, &o);
        drop(st);
        let written = try_send_inline(self.inner.fd, &o, &self.inner.tx);
        let mut st = self.inner.lock();
        let whole = HEADER + o.len as usize;
        let mut done = None;
        match written {
            Ok(n) if n < whole && st.q.lost().is_none() => {
                // Still being written (`sending` stays): the sender thread
                // goes on with it before anything else.
                st.writing = false;
                o.skip = n;
                st.resume = Some(o);
            }
            r => {
                let whole_sent = matches!(r, Ok(n) if n == whole);
                self.inner.end_write(&mut st, &o, !whole_sent);
                if let Err(e) = r {
                    self.inner.break_with(&mut st, format!("sending to the peer failed: {e}"));
                }
                done = Some(o);
            }
        }
        if st.has_work() {
            // The sender thread may wait for the socket to be free.
            self.inner.work.notify_all();
        }
        drop(st);
        if let Some(mut o) = done {
            self.inner.recycle(&mut o);
        }
        Posted::Ok(id)
    }

    pub(crate) fn post_send(&self, items: &[WorkItem], due: Deadline) -> Posted {
        let Some(last) = items.last() else {
            return Posted::refused(Error::EmptyBatch);
        };
        let mut bytes = 0;
        {
            let st = self.inner.lock();
            for item in items {
                match Self::check_item(&st.q, item) {
                    Ok(len) => bytes += len,
                    Err(e) => return Posted::refused(e),
                }
            }
        }
        self.enqueue(last.op.opcode(), items.len(), bytes, due, |i| Self::message(&items[i]))
    }

    /// Posts an inline send. `unacked` (an untracked send, whose outcome
    /// nobody waits for) asks the peer for no acknowledgement: the send is
    /// done once the socket has its frame, as UCX's TCP transport completes
    /// a send, and a ping-pong's ping costs no acknowledgement frame each
    /// way. Delivery is still confirmed in order: the peer carries out frames
    /// in stream order, so the acknowledgement of any later operation covers
    /// it, and a refusal (no receive posted in time) breaks the connection.
    pub(crate) fn post_inline(&self, data: &[u8], imm: Option<u32>, due: Deadline, unacked: bool) -> Posted {
        if data.len() as u64 > u64::from(MAX_INLINE) {
            return Posted::refused(Error::MessageTooLarge { len: data.len() as u64, max: u64::from(MAX_INLINE) });
        }
        let opcode = if imm.is_some() { Opcode::SendWithImm } else { Opcode::Send };
        // The copy goes into a buffer from the connection's pool (returned by
        // the sender once sent), so inline sends allocate nothing in steady state.
        let mut copy = self.inner.inline_pool.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        copy.clear();
        copy.extend_from_slice(data);
        let mut copy = Some(copy);
        self.enqueue(opcode, 1, data.len() as u64, due, |_| {
            (OutKind::Inline { data: copy.take().unwrap_or_default(), imm, unacked }, 0, data.len() as u64)
        })
    }

    pub(crate) fn post_recv(&self, local: Option<LocalParts>) -> Posted {
        let mut st = self.inner.lock();
        let (addr, len) = match &local {
            Some(l) => {
                if let Err(e) = Self::check_local(&st.q, l) {
                    return Posted::refused(e);
                }
                (l.addr, l.len as u64)
            }
            None => (0, 0),
        };
        let id = match st.q.start_recv() {
            Ok(id) => id,
            Err(e) => return Posted::refused(e),
        };
        st.recvs.push_back(Recv { wr_id: id.wr_id(true), addr, len });
        self.inner.wake(&st);
        Posted::Ok(id)
    }

    /// Takes `id`'s outcome if it is done, else registers `waker`: the
    /// connection's threads wake it when they complete the operation.
    pub(crate) fn poll_register(&self, id: OpId, waker: &std::task::Waker) -> Result<Option<OpOutcome>> {
        Ok(self.inner.lock().q.take_or_register(id, waker))
    }

    /// [`QueueCore::done_or_register`](super::queue::QueueCore::done_or_register).
    #[cfg(feature = "cuda")]
    pub(crate) fn done_or_register(&self, id: OpId, waker: &std::task::Waker) -> Result<bool> {
        Ok(self.inner.lock().q.done_or_register(id, waker))
    }

    pub(crate) fn wait_done(&self, id: OpId, due: &mut Deadline) -> Result<()> {
        self.wait_for(due, false, |st| st.q.is_done(id).then_some(()))
    }

    /// Waits until `id` is done, then takes its outcome.
    /// [`WaitError::Unfinished`] when the deadline passed first (the
    /// operation is still in flight).
    pub(crate) fn wait_take(&self, id: OpId, due: &mut Deadline) -> Waited {
        match self.wait_for(due, true, |st| st.q.take(id)) {
            Ok(outcome) => waited(outcome),
            Err(e) => Err(WaitError::unfinished(e)),
        }
    }

    /// Waits until `ready` gives a value, up to `due`. With `spin`, looks
    /// again for the connection's spin time first, yielding the CPU (to this
    /// side's receiver thread, among others), before sleeping: a reply often
    /// lands within microseconds, and waking from a condition variable costs
    /// more than that.
    fn wait_for<T>(
        &self,
        due: &mut Deadline,
        spin: bool,
        mut ready: impl FnMut(&mut TcpState) -> Option<T>,
    ) -> Result<T> {
        let mut st = self.inner.lock();
        if let Some(v) = ready(&mut st) {
            return Ok(v);
        }
        if spin && !self.inner.spin.is_zero() {
            drop(st);
            let _spinning = Spinning::new(&self.inner);
            let now = Instant::now();
            let until = due.at_from(now).min(now + self.inner.spin);
            loop {
                // What arrived is carried out here when the receiver thread
                // is not at it: no wake-up and hand-over per message.
                self.inner.read_ready();
                let mut s = self.inner.lock();
                if let Some(v) = ready(&mut s) {
                    return Ok(v);
                }
                if Instant::now() >= until {
                    st = s;
                    break;
                }
                drop(s);
                std::thread::yield_now();
            }
        }
        loop {
            let now = Instant::now();
            let deadline = due.at_from(now);
            if now >= deadline {
                return Err(due.expired());
            }
            st = self.inner.sleep(st, deadline - now);
            if let Some(v) = ready(&mut st) {
                return Ok(v);
            }
        }
    }

    /// Takes `id`'s outcome if it is done.
    pub(crate) fn poll_take(&self, id: OpId) -> Result<Option<OpOutcome>> {
        Ok(self.inner.lock().q.take(id))
    }

    pub(crate) fn poll_done(&self, id: OpId) -> Result<bool> {
        Ok(self.inner.lock().q.is_done(id))
    }

    pub(crate) fn take(&self, id: OpId) -> Option<OpOutcome> {
        self.inner.lock().q.take(id)
    }

    pub(crate) fn orphan(&self, id: OpId, buffer: Box<dyn std::any::Any + Send>) {
        let released = self.inner.lock().q.orphan(id, buffer);
        drop(released);
    }

    pub(crate) fn progress_now(&self) -> Result<usize> {
        // The transport's threads make progress by themselves.
        Ok(0)
    }

    pub(crate) fn broken(&self) -> Option<String> {
        self.inner.lock().q.lost().map(str::to_owned)
    }

    pub(crate) fn stats(&self) -> (usize, usize) {
        let st = self.inner.lock();
        st.q.stats()
    }

    /// [`shutdown`](Self::shutdown): the bye already follows the
    /// acknowledgements of everything this side received.
    pub(crate) fn close(&self, reason: &str) {
        self.shutdown(reason);
    }

    /// Closes this side: says bye, stops both threads (waiting for them), and
    /// fails what is left. After this no thread touches any buffer.
    pub(crate) fn shutdown(&self, reason: &str) {
        {
            let mut st = self.inner.lock();
            if st.q.lost().is_none() {
                // After what is queued: acknowledgements of messages this side
                // already completed must reach the peer first, as on RC.
                st.control.push_back(Ctl::Bye);
                let r = reason.to_owned();
                self.inner.break_with(&mut st, r);
            }
            self.inner.work.notify_all();
            // Give the sender a moment to say bye before the socket closes.
            let t0 = Instant::now();
            while !st.control.is_empty() && !st.sender_done && t0.elapsed() < Duration::from_millis(200) {
                st = self.inner.sleep(st, Duration::from_millis(10));
            }
            st.stopping = true;
            self.inner.work.notify_all();
            self.inner.wake(&st);
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let threads: Vec<JoinHandle<()>> = self.threads.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // Both threads are gone: fail whatever they left.
        let mut st = self.inner.lock();
        let recvs: Vec<Recv> = st.recvs.drain(..).collect();
        for r in recvs {
            self.inner.complete(&mut st, &raw(r.wr_id, WcStatus::WrFlush));
        }
        for w in st.replies.take_all() {
            self.inner.complete(&mut st, &raw(w, WcStatus::WrFlush));
        }
        self.inner.break_with(&mut st, reason.to_owned());
    }
}

impl Drop for TcpConn {
    fn drop(&mut self) {
        self.shutdown("the connection was dropped");
        // Nothing touches buffers any more: release every orphan.
        let orphans = self.inner.lock().q.take_orphans();
        drop(orphans);
    }
}

// ---- the sender thread ----

enum Work {
    Ctl(Ctl),
    /// The rest of a control frame a reader began: its header and the bytes sent.
    Rest(FrameHeader, usize),
    /// A message, and whether more are queued behind it.
    Out(Out, bool),
}

fn sender(inner: &Inner) {
    let fd = inner.fd;
    loop {
        let work = {
            let mut st = inner.lock();
            loop {
                if st.writing {
                    // A posting thread is sending its message directly.
                    st = inner.work.wait(st).unwrap_or_else(|e| e.into_inner());
                    continue;
                }
                if let Some((h, sent)) = st.ctl_rest.take() {
                    // The rest of a control frame a reader began.
                    st.writing = true;
                    break Work::Rest(h, sent);
                }
                if let Some(o) = st.resume.take() {
                    // The rest of a frame a posting thread began: first, so
                    // the stream stays whole. It is already started.
                    st.writing = true;
                    break Work::Out(o, false);
                }
                if let Some(c) = st.control.pop_front() {
                    if st.q.lost().is_some() {
                        // Shutdown may be waiting for the control queue to drain.
                        inner.wake(&st);
                    }
                    st.writing = true;
                    break Work::Ctl(c);
                }
                if st.stopping || st.q.lost().is_some() {
                    // Broken or closing, and every queued reply went out (or
                    // failed): hang up, so the peer sees the end at once and
                    // the receiver stops reading.
                    st.sender_done = true;
                    inner.wake(&st);
                    drop(st);
                    inner.hang_up();
                    return;
                }
                if let Some(o) = st.queue.pop_front() {
                    inner.start_write(&mut st, &o);
                    let more = !st.queue.is_empty();
                    break Work::Out(o, more);
                }
                st = inner.work.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let outcome = match work {
            Work::Rest(h, sent) => {
                // SAFETY: no payload.
                let r = unsafe { send_frame(fd, &h, std::ptr::null(), 0, None, sent, false, None) }.map(drop);
                inner.lock().writing = false;
                r
            }
            Work::Ctl(c) => {
                let r = match c {
                    Ctl::Ack { seq, status } => send_header(
                        fd,
                        &FrameHeader { op: FrameOp::Ack as u8, seq, total: status, ..FrameHeader::default() },
                    ),
                    Ctl::Bye => {
                        let _ = send_header(fd, &FrameHeader { op: FrameOp::Bye as u8, ..FrameHeader::default() });
                        Ok(())
                    }
                    Ctl::ReadResp { seq, entry, addr, len } => send_read_response(fd, seq, &entry, addr, len),
                };
                inner.lock().writing = false;
                r
            }
            Work::Out(mut o, more) => {
                let r = send_message(fd, &o, more, &inner.tx);
                inner.recycle(&mut o);
                inner.end_write(&mut inner.lock(), &o, r.is_err());
                r
            }
        };
        if let Err(e) = outcome {
            let mut st = inner.lock();
            inner.break_with(&mut st, format!("sending to the peer failed: {e}"));
            // Keep serving the control queue until stopped (the frames fail fast).
        }
    }
}

/// One attempt, without blocking, to write an inline message's whole frame
/// (header and data); how many bytes of it the socket took.
fn try_send_inline(fd: RawFd, o: &Out, tx: &AtomicU64) -> io::Result<usize> {
    let OutKind::Inline { data, imm, .. } = &o.kind else {
        return Ok(0);
    };
    let flags = FIRST | LAST | if imm.is_some() { IMM } else { 0 } | if wants_ack(o) { ACK } else { 0 };
    let h = FrameHeader {
        op: FrameOp::Send as u8,
        flags,
        seq: o.seq,
        key: 0,
        imm: imm.unwrap_or(0),
        addr: 0,
        len: data.len() as u32,
        total: data.len() as u32,
    };
    let head = h.encode();
    let mut iov = [
        libc::iovec { iov_base: head.as_ptr() as *mut libc::c_void, iov_len: HEADER },
        libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() },
    ];
    // SAFETY: a zeroed msghdr is valid; the iovecs and what they point to
    // (the header on this stack, the message's own copy) outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    report(Some((tx, 0)), 0, true);
    let r = sent_without_waiting(|| {
        // SAFETY: valid socket, message and buffers; MSG_NOSIGNAL instead of SIGPIPE.
        unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) }
    });
    report(Some((tx, 0)), *r.as_ref().unwrap_or(&0), false);
    r
}

/// Whether the peer acknowledges `o`: the last message of an operation,
/// unless it is an unacknowledged inline send.
fn wants_ack(o: &Out) -> bool {
    is_final(o.wr_id) && !o.unacked()
}

/// Writes message `o` (from `o.skip` bytes on), reporting its progress
/// through `tx`.
fn send_message(fd: RawFd, o: &Out, more: bool, tx: &AtomicU64) -> io::Result<()> {
    let (op, key, raddr, imm) = match &o.kind {
        OutKind::Send { imm } | OutKind::Inline { imm, .. } => (FrameOp::Send, 0, 0, *imm),
        OutKind::Write { raddr, key, imm } => (FrameOp::Write, *key, *raddr, *imm),
        OutKind::ReadReq { raddr, key } => (FrameOp::ReadReq, *key, *raddr, None),
    };
    let payload: Option<(*const u8, u64)> = match &o.kind {
        OutKind::Inline { data, .. } => Some((data.as_ptr(), data.len() as u64)),
        OutKind::ReadReq { .. } => None,
        _ => Some((o.addr as *const u8, o.len)),
    };
    let total = u32::try_from(o.len).unwrap_or(u32::MAX);
    let imm_flag = if imm.is_some() { IMM } else { 0 } | if wants_ack(o) { ACK } else { 0 };
    let Some((ptr, len)) = payload else {
        let h = FrameHeader { op: op as u8, flags: FIRST | LAST, seq: o.seq, key, imm: 0, addr: raddr, len: 0, total };
        // SAFETY: no payload.
        return unsafe { send_frame(fd, &h, std::ptr::null(), 0, None, o.skip, more, Some((tx, 0))) }.map(drop);
    };
    let mut off = 0u64;
    // The message's bytes on the wire before this frame.
    let mut wire = 0u64;
    loop {
        let n = (len - off).min(SEGMENT as u64);
        let mut flags = imm_flag;
        if off == 0 {
            flags |= FIRST;
        }
        if off + n >= len {
            flags |= LAST;
        }
        let h = FrameHeader {
            op: op as u8,
            flags,
            seq: o.seq,
            key,
            imm: imm.unwrap_or(0),
            addr: raddr + off,
            len: n as u32,
            total,
        };
        let last = off + n >= len;
        // SAFETY: the message's source is a registered buffer owned by its
        // operation until this thread reports the operation complete, or an
        // inline copy owned by `o`.
        unsafe {
            send_frame(
                fd,
                &h,
                ptr.add(off as usize),
                n as usize,
                None,
                if off == 0 { o.skip } else { 0 },
                more || !last,
                Some((tx, wire)),
            )?
        };
        off += n;
        wire += HEADER as u64 + n;
        if off >= len {
            return Ok(());
        }
    }
}

fn send_read_response(fd: RawFd, seq: u32, entry: &KeyEntry, addr: u64, len: u64) -> io::Result<()> {
    let mut off = 0u64;
    loop {
        let n = (len - off).min(SEGMENT as u64);
        let last = off + n >= len;
        let h = FrameHeader {
            op: FrameOp::ReadResp as u8,
            flags: if last { LAST } else { 0 } | if off == 0 { FIRST } else { 0 },
            seq,
            addr: off,
            len: n as u32,
            ..FrameHeader::default()
        };
        // SAFETY: the range was checked against the exposure, whose memory stays
        // valid while its gate says alive (revocation waits for the gate).
        let whole =
            unsafe { send_frame(fd, &h, (addr + off) as *const u8, n as usize, Some(&entry.alive), 0, false, None)? };
        if !whole {
            // Revoked mid-way: the frame is cut, the stream cannot be resynchronized.
            return Err(io::Error::other("an exposed region was withdrawn during a read"));
        }
        off += n;
        if last {
            return Ok(());
        }
    }
}

// ---- the receiver thread ----

const CLOSED: &str = "the peer closed the connection (its process exited or dropped the connection)";

/// The longest the receiver thread naps while waiters spin.
const NAP: Duration = Duration::from_millis(1);

/// A spinning waiter, counted while it lives.
struct Spinning<'a>(&'a Inner);

impl<'a> Spinning<'a> {
    fn new(inner: &'a Inner) -> Self {
        inner.spinners.fetch_add(1, Ordering::AcqRel);
        Spinning(inner)
    }
}

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        self.0.spinners.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The most frames a spinning waiter carries out before it looks at its
/// own condition and deadline again.
const WAITER_FRAMES: usize = 16;

/// How much of the stream a spinning waiter looks at in one call: a
/// header, the largest payload it carries out, and one byte to tell
/// whether anything follows.
const LOOK: usize = HEADER + MAX_INLINE as usize + 1;
// The look lands in the reader's scratch buffer.
const _: () = assert!(LOOK <= STEP);

/// Which thread carries a frame out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// The receiver thread: its replies go through the sender thread,
    /// which sends them while this one reads on.
    Receiver,
    /// A spinning waiter: it acknowledges what it read itself.
    Waiter,
}

/// Carries out one frame whose header was read.
fn on_frame(inner: &Inner, h: &FrameHeader, src: &mut Source<'_>, scratch: &mut [u8], by: Reading) -> Handled {
    match FrameOp::from_raw(h.op) {
        Some(FrameOp::Send | FrameOp::Write) if h.flags & FIRST == 0 => {
            Err(format!("a garbled frame (operation {} without its first segment): the stream is out of step", h.op))
        }
        Some(FrameOp::Send) => on_message(inner, h, None, src, scratch, by),
        Some(FrameOp::Write) => on_write(inner, h, src, scratch, by),
        Some(FrameOp::ReadReq) => on_read_request(inner, h),
        Some(FrameOp::ReadResp) => on_read_response(inner, h, src, scratch),
        Some(FrameOp::Ack) => on_ack(inner, h),
        Some(FrameOp::Bye) => Err("the peer closed the connection (it said bye)".to_owned()),
        None => Err(format!("a garbled frame (operation {}): the stream is out of step", h.op)),
    }
}

impl Inner {
    /// A spinning waiter's turn at the socket: if no other thread reads it,
    /// carries out the small frames (at most [`MAX_INLINE`] bytes of
    /// payload) that are there whole and need nothing to wait for (no
    /// receive to wait for, no further segment), then returns. Anything
    /// else (a large or partial frame, a send with no receive posted, a
    /// message of several segments, the end of the stream, a garbled
    /// header) is left to the receiver thread, which reads with blocking
    /// calls and watches for the receiver-not-ready budget. Never blocks.
    fn read_ready(&self) {
        let Ok(mut reader) = self.reader.try_lock() else { return };
        let fd = self.fd;
        let (look, scratch) = reader.scratch.split_at_mut(LOOK);
        // A few frames a turn: a peer that keeps sending cannot hold a
        // waiter here past its deadline (the wait looks at it between turns).
        for _ in 0..WAITER_FRAMES {
            if self.dead.load(Ordering::Acquire) {
                return;
            }
            // One look shows the header and, for a frame a waiter carries
            // out, the whole frame and whether more follows it: one system
            // call where a look at the header, then one at the queue's
            // length, and one more finding nothing after the frame took three.
            let seen = match recv_now(fd, look, true) {
                Ok(n) if n >= HEADER => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // Part of a header, the end of the stream, an error: the
                // receiver thread's.
                _ => return self.end_nap(),
            };
            let mut head = [0u8; HEADER];
            head.copy_from_slice(&look[..HEADER]);
            let Ok(h) = FrameHeader::parse(&head) else { return self.end_nap() };
            let whole = h.flags & (FIRST | LAST) == FIRST | LAST;
            let (payload, needs_recv) = match FrameOp::from_raw(h.op) {
                Some(FrameOp::Ack | FrameOp::ReadReq) => (0, false),
                Some(FrameOp::ReadResp) => (h.len, false),
                Some(FrameOp::Send) if whole => (h.len, true),
                Some(FrameOp::Write) if whole => (h.len, h.flags & IMM != 0),
                _ => return self.end_nap(),
            };
            // A large frame is the receiver thread's: the copy dwarfs the
            // hand-over, and a waiter polling a stream of them would only
            // contend with it for the socket.
            if payload > MAX_INLINE || needs_recv && self.lock().recvs.is_empty() {
                return self.end_nap();
            }
            let frame = HEADER + payload as usize;
            if seen < frame {
                return self.end_nap();
            }
            // The frame, all there, read by this thread only: one call,
            // and its payload is carried out from here.
            if !matches!(recv_now(fd, &mut look[..frame], false), Ok(n) if n == frame) {
                // Cannot happen with the reader held; the receiver thread
                // would find the stream out of step, so break it here.
                let mut st = self.lock();
                self.break_with(&mut st, "the connection to the peer failed: a peeked frame went missing".into());
                return;
            }
            let mut src = Source::Read(&look[HEADER..frame]);
            if let Err(why) = on_frame(self, &h, &mut src, scratch, Reading::Waiter) {
                // As the receiver thread would: it sees `dead` next and
                // fails what it owns.
                let mut st = self.lock();
                self.break_with(&mut st, why);
                return;
            }
            if seen == frame {
                // Nothing followed it when this side looked; what arrives
                // since, the next turn finds.
                return;
            }
        }
    }
}

fn receiver(inner: &Inner) {
    let fd = inner.fd;
    let mut reader = inner.reader.lock().unwrap_or_else(|e| e.into_inner());
    let why = loop {
        if inner.dead.load(Ordering::Acquire) {
            // Broken (by this thread, the sender, a waiter, or this side
            // closing): nothing more from the peer is carried out.
            break inner.lock().q.lost().unwrap_or_default().to_owned();
        }
        let mut head = [0u8; HEADER];
        let got = match recv_now(fd, &mut head, false) {
            Ok(0) => break CLOSED.to_owned(),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if inner.spinners.load(Ordering::Acquire) > 0 {
                    // Waiters spin and carry out what arrives: nap until one
                    // leaves a frame to this thread or a thread goes to
                    // sleep, or for a millisecond (the last spinner may have
                    // gone meanwhile).
                    inner.napping.store(true, Ordering::Release);
                    reader = inner.rx_wake.wait_timeout(reader, NAP).unwrap_or_else(|e| e.into_inner()).0;
                    inner.napping.store(false, Ordering::Release);
                    continue;
                }
                // Nothing yet: wait for it without the reader, so that a
                // spinning waiter can take the next frame itself.
                drop(reader);
                let waited = wait_fd_for(fd, libc::POLLIN, RECV_WAIT.as_millis() as i32);
                reader = inner.reader.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = waited {
                    break format!("the connection to the peer failed: {e}");
                }
                continue;
            }
            Err(e) => break format!("the connection to the peer failed: {e}"),
        };
        if got < HEADER {
            match recv_buf(fd, &mut head[got..]) {
                Ok(true) => {}
                Ok(false) => break CLOSED.to_owned(),
                Err(e) => break format!("the connection to the peer failed: {e}"),
            }
        }
        let h = match FrameHeader::parse(&head) {
            Ok(h) => h,
            Err(why) => break why,
        };
        if let Err(why) = on_frame(inner, &h, &mut Source::Socket(fd), &mut reader.scratch, Reading::Receiver) {
            break why;
        }
    };
    // Still the reader: broken before anyone else may read, so no waiter
    // lands a frame from here on (each looks at `dead` first).
    let mut st = inner.lock();
    inner.break_with(&mut st, why);
    // This thread owns receives and reads: fail them.
    let recvs: Vec<Recv> = st.recvs.drain(..).collect();
    for r in recvs {
        inner.complete(&mut st, &raw(r.wr_id, WcStatus::WrFlush));
    }
    for w in st.replies.take_reads() {
        inner.complete(&mut st, &raw(w, WcStatus::WrFlush));
    }
    drop(st);
    drop(reader);
    let mut st = inner.lock();
    // The sender delivers the replies already queued (a refusal), then hangs
    // up. A peer that does not read gets LINGER for that, then the socket is
    // shut under the sender, which ends it: a broken connection holds no
    // thread.
    let until = Instant::now() + LINGER;
    while !st.sender_done {
        let now = Instant::now();
        if now >= until {
            break;
        }
        st = inner.sleep(st, until - now);
    }
    drop(st);
    inner.hang_up();
}

type Handled = std::result::Result<(), String>;

fn io_err(e: io::Error) -> String {
    format!("the connection to the peer failed: {e}")
}

/// Where a frame's payload is read from.
enum Source<'a> {
    /// The socket, as the payload arrives (the receiver thread).
    Socket(RawFd),
    /// What a spinning waiter read with the header: the payload of a
    /// frame of one segment, whole.
    Read(&'a [u8]),
}

impl Source<'_> {
    /// Fills `ptr..ptr+len` with the payload's next `len` bytes, as
    /// [`recv_into`] does (`gate` as there; `Ok(false)` on EOF).
    ///
    /// # Safety
    /// As [`recv_into`]: while `gate` returns true, `ptr..ptr + len` must
    /// be valid for writes and not referenced by Rust code.
    unsafe fn fill(
        &mut self,
        ptr: *mut u8,
        len: usize,
        gate: Option<&RwLock<bool>>,
        scratch: &mut [u8],
    ) -> io::Result<bool> {
        match self {
            // SAFETY: the caller's promise, passed on.
            Source::Socket(fd) => unsafe { recv_into(*fd, ptr, len, gate, scratch) },
            Source::Read(bytes) => {
                let Some((now, rest)) = bytes.split_at_checked(len) else {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "a payload shorter than its header says"));
                };
                let guard = gate.map(|g| g.read().unwrap_or_else(|e| e.into_inner()));
                if guard.as_ref().is_none_or(|alive| **alive) {
                    // SAFETY: `ptr..ptr + len` is writable and unreferenced while
                    // the gate holds (the caller's promise); `now` is `len` bytes
                    // of this side's scratch buffer, which no region overlaps.
                    unsafe { std::ptr::copy_nonoverlapping(now.as_ptr(), ptr, len) };
                }
                // Revoked: the bytes are dropped, as `recv_into` drops them.
                *bytes = rest;
                Ok(true)
            }
        }
    }

    /// Reads the rest of the message the header `h` starts, dropping it.
    fn drain(&mut self, h: &FrameHeader, scratch: &mut [u8]) -> Handled {
        let mut cur = *h;
        loop {
            match self {
                Source::Socket(fd) => {
                    if !discard(*fd, cur.len as usize, scratch).map_err(io_err)? {
                        return Err("the peer closed the connection".into());
                    }
                }
                Source::Read(bytes) => *bytes = bytes.get(cur.len as usize..).unwrap_or_default(),
            }
            if cur.flags & LAST != 0 {
                return Ok(());
            }
            cur = self.next_segment(h)?;
        }
    }

    /// Reads the header of the next segment of the message `first` started.
    fn next_segment(&mut self, first: &FrameHeader) -> std::result::Result<FrameHeader, String> {
        let Source::Socket(fd) = self else {
            // A waiter carries out messages of one segment only.
            return Err("a garbled frame (a segment after the last): the stream is out of step".into());
        };
        let mut head = [0u8; HEADER];
        if !recv_buf(*fd, &mut head).map_err(io_err)? {
            return Err("the peer closed the connection".into());
        }
        let next = FrameHeader::parse(&head)?;
        next.continues(first)?;
        Ok(next)
    }
}

/// Fails the connection after a request the peer made was refused: the
/// peer gets `status` (the last reply it gets), this side breaks too, as a
/// responder in the error state does, and the receiver stops: nothing the
/// peer sent after the refused request is carried out.
fn refuse(inner: &Inner, seq: u32, status: WcStatus, why: String) -> Handled {
    let mut st = inner.lock();
    st.control.push_back(Ctl::Ack { seq, status: status.to_raw() });
    inner.work.notify_one();
    inner.break_with(&mut st, why.clone());
    Err(why)
}

/// Takes the next posted receive, waiting up to the receiver-not-ready
/// budget (forever when it is "infinite"). Meanwhile the socket is watched
/// every [`WATCH`]: a peer that closed or died ends the wait, as does this
/// side closing.
fn next_recv(inner: &Inner) -> std::result::Result<Option<Recv>, String> {
    let deadline = inner.rnr_budget.map(|b| Instant::now() + b);
    let mut st = inner.lock();
    loop {
        if st.stopping || st.q.lost().is_some() {
            return Err(st.q.lost().map_or_else(|| "the connection is closing".into(), str::to_owned));
        }
        if let Some(r) = st.recvs.pop_front() {
            return Ok(Some(r));
        }
        let now = Instant::now();
        let slice = match deadline {
            Some(d) if now >= d => return Ok(None),
            Some(d) => (d - now).min(WATCH),
            None => WATCH,
        };
        st = inner.sleep(st, slice);
        if st.recvs.is_empty() && inner.peer_gone() {
            return Err("the peer closed the connection while its message waited for a receive".into());
        }
    }
}

/// A send (or the receive a write with immediate consumes): lands in the
/// next posted receive. `written` is the byte count of a write with
/// immediate whose data already went to its target.
fn on_message(
    inner: &Inner,
    h: &FrameHeader,
    written: Option<u32>,
    src: &mut Source<'_>,
    scratch: &mut [u8],
    by: Reading,
) -> Handled {
    let total = u64::from(written.unwrap_or(h.total));
    let Some(recv) = next_recv(inner)? else {
        if written.is_none() {
            src.drain(h, scratch)?;
        }
        return refuse(
            inner,
            h.seq,
            WcStatus::RnrRetryExceeded,
            "a peer's message found no posted receive in time".into(),
        );
    };
    if written.is_none() && total > recv.len {
        // Failed first (the bytes go to scratch, not to it), so that a
        // stream that breaks while draining cannot leave it pending.
        let mut st = inner.lock();
        inner.complete(&mut st, &RawCompletion { byte_len: h.total, ..raw(recv.wr_id, WcStatus::LocalLength) });
        drop(st);
        src.drain(h, scratch)?;
        return refuse(
            inner,
            h.seq,
            WcStatus::RemoteInvalidRequest,
            format!("a message of {total} bytes arrived for a receive of {} bytes", recv.len),
        );
    }
    if written.is_none() {
        let mut cur = *h;
        let mut off = 0u64;
        loop {
            let n = u64::from(cur.len);
            if off + n > recv.len {
                let mut st = inner.lock();
                inner.complete(&mut st, &raw(recv.wr_id, WcStatus::LocalLength));
                return Err("a message grew past its announced length".into());
            }
            // SAFETY: inside the receive's buffer (checked), which its operation owns
            // until this thread completes it.
            let ok = unsafe { src.fill((recv.addr + off) as *mut u8, n as usize, None, scratch) };
            if let Err(why) = ok
                .map_err(io_err)
                .and_then(|ok| ok.then_some(()).ok_or_else(|| "the peer closed the connection".into()))
            {
                // The receive was taken off the queue: this thread fails it.
                let mut st = inner.lock();
                inner.complete(&mut st, &raw(recv.wr_id, WcStatus::WrFlush));
                return Err(why);
            }
            off += n;
            if cur.flags & LAST != 0 {
                break;
            }
            match src.next_segment(h) {
                Ok(next) => cur = next,
                Err(why) => {
                    // The receive was taken off the queue: this thread fails it.
                    let mut st = inner.lock();
                    inner.complete(&mut st, &raw(recv.wr_id, WcStatus::WrFlush));
                    return Err(why);
                }
            }
        }
        if off != total {
            // Its last segment came early: the receive would report bytes
            // that never arrived.
            let mut st = inner.lock();
            inner.complete(&mut st, &raw(recv.wr_id, WcStatus::WrFlush));
            return Err(short_message(total, off));
        }
    }
    let mut st = inner.lock();
    let c = RawCompletion {
        byte_len: total as u32,
        imm: (h.flags & IMM != 0).then_some(h.imm),
        by_write_imm: written.is_some(),
        ..raw(recv.wr_id, WcStatus::Success)
    };
    inner.complete(&mut st, &c);
    if h.flags & ACK == 0 {
        return Ok(());
    }
    inner.acknowledge(st, h.seq, by)
}

fn on_write(inner: &Inner, h: &FrameHeader, src: &mut Source<'_>, scratch: &mut [u8], by: Reading) -> Handled {
    let total = u64::from(h.total);
    let entry = inner.lookup(h.key);
    let admitted = entry.as_ref().is_some_and(|e| e.admits(h.addr, total, Access::REMOTE_WRITE));
    if !admitted {
        src.drain(h, scratch)?;
        return refuse(
            inner,
            h.seq,
            WcStatus::RemoteAccess,
            format!(
                "a peer's write to {:#x}+{total} with key {:#x} was refused (bad key, outside the region, or no write right)",
                h.addr, h.key
            ),
        );
    }
    let entry = entry.expect("admitted");
    let mut cur = *h;
    let mut off = 0u64;
    loop {
        let n = u64::from(cur.len);
        if !entry.admits(cur.addr, n, Access::REMOTE_WRITE) {
            src.drain(&cur, scratch)?;
            return refuse(inner, h.seq, WcStatus::RemoteAccess, "a write segment left its region".into());
        }
        // SAFETY: inside the exposed region (checked); its memory stays valid while
        // the gate says alive, and revocation waits for the gate.
        let ok = unsafe { src.fill(cur.addr as *mut u8, n as usize, Some(&entry.alive), scratch) };
        if !ok.map_err(io_err)? {
            return Err("the peer closed the connection".into());
        }
        off += n;
        if cur.flags & LAST != 0 {
            break;
        }
        cur = src.next_segment(h)?;
    }
    if off != total {
        // A write with immediate would report bytes that never arrived.
        return Err(short_message(total, off));
    }
    if !*entry.alive.read().unwrap_or_else(|e| e.into_inner()) {
        return refuse(inner, h.seq, WcStatus::RemoteAccess, "the region was withdrawn during a write".into());
    }
    if h.flags & IMM != 0 {
        // The immediate announces the data: in GPU memory (copied from the
        // staging mirror, the only memory this transport writes), it must be
        // visible to CUDA work before the receive completes. A GPU that
        // cannot take it breaks the connection, loudly.
        #[cfg(feature = "cuda")]
        if let Err(e) = inner.visible.make_visible(h.key, h.addr, total) {
            return Err(format!("the data of a write with immediate could not be made visible in GPU memory: {e}"));
        }
        return on_message(inner, h, Some(h.total), src, scratch, by);
    }
    if h.flags & ACK == 0 {
        return Ok(());
    }
    inner.acknowledge(inner.lock(), h.seq, by)
}

fn on_read_request(inner: &Inner, h: &FrameHeader) -> Handled {
    let total = u64::from(h.total);
    match inner.lookup(h.key) {
        Some(entry) if entry.admits(h.addr, total, Access::REMOTE_READ) => {
            let mut st = inner.lock();
            inner.reply(&mut st, Ctl::ReadResp { seq: h.seq, entry, addr: h.addr, len: total })
        }
        _ => refuse(
            inner,
            h.seq,
            WcStatus::RemoteAccess,
            format!(
                "a peer's read of {:#x}+{total} with key {:#x} was refused (bad key, outside the region, or no read right)",
                h.addr, h.key
            ),
        ),
    }
}

fn on_read_response(inner: &Inner, h: &FrameHeader, src: &mut Source<'_>, scratch: &mut [u8]) -> Handled {
    let n = u64::from(h.len);
    // It must answer the oldest request waiting for a reply, a read that
    // reached the peer whole, and land next in order inside its buffer
    // (the peer sends a read's response in order, from its start).
    let segment = {
        let mut st = inner.lock();
        let progress = Progress::unpack(inner.tx.load(Ordering::Acquire));
        st.replies.on_read_segment(h.seq, h.addr, n, progress)
    };
    let seg = match segment {
        Ok(seg) => seg,
        Err(why) => {
            src.drain(h, scratch)?;
            return Err(why);
        }
    };
    // SAFETY: inside the read's destination (checked), owned by its operation
    // until this thread, the reader, lets go of the read (`read_done`, or
    // `take_reads` when it stops): nobody else completes the operation.
    let ok = unsafe { src.fill((seg.addr + h.addr) as *mut u8, n as usize, None, scratch) };
    if !ok.map_err(io_err)? {
        return Err("the peer closed the connection".into());
    }
    if h.flags & LAST != 0 {
        let mut st = inner.lock();
        let whole = st.replies.read_done().is_some_and(|(_, whole)| whole);
        if !whole {
            // Part of the read's buffer would hold what was there before.
            inner.complete(&mut st, &raw(seg.wr_id, WcStatus::BadResponse));
            return Err(format!("a read response of {} bytes for a read of {}", h.addr + n, seg.len));
        }
        inner.complete(&mut st, &raw(seg.wr_id, WcStatus::Success));
    }
    Ok(())
}

/// Why a message whose segments fell short of its announced length broke
/// the connection.
fn short_message(total: u64, arrived: u64) -> String {
    format!("a garbled frame (a message of {total} bytes announced, {arrived} arrived): the stream is out of step")
}

/// The final request's work request id of the queued operation whose
/// requests include `seq` (a request of it was sent and refused, its final
/// request is still queued).
#[cold]
fn queued_chain_of(st: &TcpState, seq: u32) -> Option<u64> {
    let within = |first: u32, last: u32| seq.wrapping_sub(first) <= last.wrapping_sub(first);
    st.queue.iter().find(|o| is_final(o.wr_id) && within(o.first, o.seq)).map(|o| o.wr_id)
}

/// An acknowledgement: completes the oldest request waiting for one, if it
/// answers it (see [`replies`]); a refusal fails the operation it names
/// and breaks the connection; any other acknowledgement breaks it too.
fn on_ack(inner: &Inner, h: &FrameHeader) -> Handled {
    let status = WcStatus::from_raw(h.total);
    let mut st = inner.lock();
    let progress = Progress::unpack(inner.tx.load(Ordering::Acquire));
    let why = match st.replies.on_ack(h.seq, status.is_success(), progress) {
        OnAck::Complete(wr_id) => {
            inner.complete(&mut st, &raw(wr_id, WcStatus::Success));
            return Ok(());
        }
        OnAck::Deferred => return Ok(()),
        OnAck::Violation(why) => why,
        OnAck::Refused(chain) => {
            // The operation: one waiting for a reply, one whose final
            // request is queued, or the one being written (an untracked
            // send refused while its writer is at it).
            let op = chain
                .or_else(|| queued_chain_of(&st, h.seq))
                .map(op_of)
                .or_else(|| st.sending_op.filter(|_| st.sending == Some(h.seq)));
            match op {
                Some(op) => {
                    st.q.lose(|| {
                        format!("the connection went to the error state after a request failed with {status}")
                    });
                    // Recorded as the operation's failure; whoever owns its
                    // final request (a writer, the reader, the break below)
                    // completes it once nothing touches its buffer.
                    inner.complete(&mut st, &raw(op, status));
                    st.q.lost().unwrap_or_default().to_owned()
                }
                None => format!("the peer refused a request with {status}"),
            }
        }
    };
    // The peer broke the connection, or the rules: nothing more from it
    // is carried out.
    inner.break_with(&mut st, why.clone());
    Err(why)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An inline message's frame, as the peer must read it.
    fn inline_out(seq: u32, data: &[u8]) -> (Out, Vec<u8>) {
        let o = Out {
            seq,
            wr_id: 1,
            kind: OutKind::Inline { data: data.to_vec(), imm: Some(7), unacked: false },
            addr: 0,
            len: data.len() as u64,
            skip: 0,
            first: seq,
        };
        let h = FrameHeader {
            op: FrameOp::Send as u8,
            flags: FIRST | LAST | IMM,
            seq,
            key: 0,
            imm: 7,
            addr: 0,
            len: data.len() as u32,
            total: data.len() as u32,
        };
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(data);
        (o, frame)
    }

    fn read_exactly(r: &mut std::os::unix::net::UnixStream, n: usize) -> Vec<u8> {
        use std::io::Read;
        let mut buf = vec![0u8; n];
        r.read_exact(&mut buf).unwrap();
        buf
    }

    #[test]
    fn a_frame_resumed_after_any_prefix_reaches_the_peer_whole() {
        let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
        let data: Vec<u8> = (0..200u8).collect();
        let (mut o, frame) = inline_out(9, &data);
        for skip in [0, 1, HEADER - 1, HEADER, HEADER + 1, HEADER + 150, frame.len()] {
            o.skip = skip;
            // The prefix goes out as a posting thread would have sent it.
            {
                use std::io::Write;
                (&tx).write_all(&frame[..skip]).unwrap();
            }
            let progress = AtomicU64::new(0);
            send_message(tx.as_raw_fd(), &o, false, &progress).unwrap();
            assert_eq!(read_exactly(&mut rx, frame.len()), frame, "resumed after {skip} bytes");
            // The writer said where it was: all of it handed, out of its call.
            let whole = Progress { handed: frame.len() as u64, in_call: false };
            assert_eq!(Progress::unpack(progress.load(Ordering::Acquire)), whole);
            assert_eq!(o.wire_len(), frame.len() as u64);
        }
    }

    #[test]
    fn a_direct_send_into_a_full_socket_is_finished_by_the_writer_and_stays_whole() {
        let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
        let small: libc::c_int = 4096;
        // SAFETY: a valid socket and a c_int option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                tx.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&small as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        // Fill the socket until a direct attempt cannot send a whole frame.
        let data = vec![0xabu8; 1000];
        let mut frames = Vec::new();
        let partial = loop {
            let (mut o, frame) = inline_out(frames.len() as u32 + 1, &data);
            let progress = AtomicU64::new(0);
            let n = try_send_inline(tx.as_raw_fd(), &o, &progress).unwrap();
            assert_eq!(
                Progress::unpack(progress.load(Ordering::Acquire)),
                Progress { handed: n as u64, in_call: false }
            );
            frames.push(frame);
            if n < HEADER + data.len() {
                o.skip = n;
                break o;
            }
            assert!(frames.len() < 10_000, "the socket never filled");
        };
        // The sender thread's part: the rest, blocking until the peer reads.
        let writer =
            std::thread::spawn(move || send_message(tx.as_raw_fd(), &partial, false, &AtomicU64::new(0)).map(|()| tx));
        for (i, frame) in frames.iter().enumerate() {
            assert_eq!(&read_exactly(&mut rx, frame.len()), frame, "frame {i} of {}", frames.len());
        }
        drop(writer.join().unwrap().unwrap());
    }

    #[test]
    fn a_direct_acknowledgement_into_a_full_socket_is_finished_by_the_sender_and_stays_whole() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut rx, _) = listener.accept().unwrap();
        // Acknowledgements sent directly until the socket takes one only in
        // part, or not at all (as a reader's attempt meets a peer that does
        // not read).
        let mut sent = Vec::new();
        let (rest, already) = loop {
            let seq = sent.len() as u32 + 1;
            let h = FrameHeader { op: FrameOp::Ack as u8, seq, ..FrameHeader::default() };
            let n = send_now(tx.as_raw_fd(), &h.encode()).unwrap();
            sent.push(h);
            if n < HEADER {
                break (h, n);
            }
            assert!(sent.len() < 1_000_000, "the socket never filled");
        };
        // The sender thread's part: the rest of that frame (all of it when
        // none went), blocking until the peer reads.
        let writer = std::thread::spawn(move || {
            // SAFETY: no payload.
            unsafe { send_frame(tx.as_raw_fd(), &rest, std::ptr::null(), 0, None, already, false, None) }.map(|_| tx)
        });
        for (i, h) in sent.iter().enumerate() {
            let got: [u8; HEADER] = read_tcp(&mut rx, HEADER).try_into().unwrap();
            assert_eq!(FrameHeader::parse(&got).unwrap(), *h, "acknowledgement {i} of {}", sent.len());
        }
        drop(writer.join().unwrap().unwrap());
    }

    fn read_tcp(r: &mut TcpStream, n: usize) -> Vec<u8> {
        use std::io::Read;
        let mut v = vec![0u8; n];
        r.read_exact(&mut v).unwrap();
        v
    }

    #[test]
    fn a_payload_read_with_its_header_is_carried_out_as_the_socket_would_carry_it() {
        let bytes = [1u8, 2, 3, 4, 5, 6, 7];
        let mut scratch = [0u8; 8];
        let mut src = Source::Read(&bytes);
        let mut out = [0u8; 4];
        // SAFETY: `out` is this test's, 4 bytes, referenced by nothing during the call.
        assert!(unsafe { src.fill(out.as_mut_ptr(), 4, None, &mut scratch) }.unwrap());
        assert_eq!(out, [1, 2, 3, 4]);
        // A withdrawn target: its bytes are dropped, not written.
        let gone = RwLock::new(false);
        let mut two = [9u8; 2];
        // SAFETY: as above; the closed gate keeps it unwritten anyway.
        assert!(unsafe { src.fill(two.as_mut_ptr(), 2, Some(&gone), &mut scratch) }.unwrap());
        assert_eq!(two, [9, 9]);
        // Never past the frame: asking for more than is left is an error.
        // SAFETY: as above.
        assert!(unsafe { src.fill(two.as_mut_ptr(), 2, None, &mut scratch) }.is_err());
        assert_eq!(two, [9, 9]);
        // A message of one segment drains its payload; there is no next segment.
        let h =
            FrameHeader { op: FrameOp::Send as u8, flags: FIRST | LAST, len: 3, total: 3, ..FrameHeader::default() };
        let mut src = Source::Read(&bytes[..3]);
        src.drain(&h, &mut scratch).unwrap();
        assert!(matches!(src, Source::Read(rest) if rest.is_empty()));
        let first = FrameHeader { flags: FIRST, ..h };
        assert!(Source::Read(&bytes).drain(&first, &mut scratch).is_err());
        assert!(Source::Read(&bytes).next_segment(&first).is_err());
    }

    #[test]
    fn headers_round_trip() {
        let h = FrameHeader {
            op: 2,
            flags: FIRST | LAST | IMM,
            seq: 7,
            key: 0xdead,
            imm: 42,
            addr: 0x7f00_1234_5678,
            len: 4096,
            total: 9000,
        };
        assert_eq!(FrameHeader::decode(&h.encode()), h);
    }

    #[test]
    fn a_million_hostile_headers_parse_or_are_refused_without_panicking() {
        // The end-to-end test (tests/hostile.rs) sends hostile streams through
        // a socket; this one covers the header checks a million times.
        let mut x = 0x5eed_0005_u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let first = FrameHeader { op: 1, flags: FIRST, seq: 1, len: 10, total: 20, ..FrameHeader::default() };
        let (mut ok, mut refused, mut continuing) = (0, 0, 0);
        for i in 0..1_000_000 {
            let mut b = [0u8; HEADER];
            for chunk in b.chunks_mut(8) {
                chunk.copy_from_slice(&next().to_le_bytes());
            }
            if i % 2 == 0 {
                // Plausible: a known operation, few flags, a segment-sized length.
                b[0] %= 8;
                b[1] &= 0x1f;
                b[4..8].copy_from_slice(&(next() as u32 % 3).to_le_bytes());
                b[24..28].copy_from_slice(&(next() as u32 % (2 * SEGMENT as u32)).to_le_bytes());
            }
            match FrameHeader::parse(&b) {
                Ok(h) => {
                    ok += 1;
                    assert!(h.len as usize <= SEGMENT && h.flags & !(FIRST | LAST | IMM | ACK) == 0, "{h:?}");
                    assert_eq!(FrameHeader::decode(&h.encode()), h);
                    continuing += usize::from(h.continues(&first).is_ok());
                }
                Err(why) => {
                    refused += 1;
                    assert!(why.contains("garbled"), "{why}");
                }
            }
        }
        assert!(ok > 100_000 && refused > 100_000 && continuing > 0, "{ok} {refused} {continuing}");
    }

    #[test]
    fn rnr_timer_codes_follow_the_encoding() {
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(12), Duration::from_micros(640));
        assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
    }
}
