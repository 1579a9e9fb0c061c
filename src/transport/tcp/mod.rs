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
//!   read's buffer. The receiver never blocks on a write to the socket,
//!   so two busy directions cannot deadlock: while the sender thread
//!   sleeps (waking it costs more than the write), the receiver makes one
//!   attempt that never blocks at a reply itself, and leaves the rest to
//!   the sender.
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
//!   or a thread that goes to sleep, ends the nap, and it ends at most
//!   [`NAP`](nap::NAP) after the last spinner left.
//! - While a thread writes a stream, the receiver thread does not read the
//!   socket (a read waits for the kernel's socket lock at each of the
//!   writer's calls): it watches it, and hands what arrives to the writer,
//!   which carries out small frames between its calls and leaves the rest
//!   to it (see [`handoff`]).
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
//! `frame` the frame header and segments (no I/O), `core` the rules a
//! reliable connection keeps (no I/O), `replies` the socket-free ledger of
//! the replies this side waits for, `socket` the raw reads and writes,
//! `sender` and `receiver` the two threads (and the replies a reading
//! thread writes itself), `nap` and `handoff` how the receiver thread
//! stands aside for spinning waiters and for writers, `conn` the
//! operations.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::queue::{Limits, Posted, QueueCore, RemoteOp, WorkItem};
use crate::bootstrap::{self, MAX_TCP_QUEUE_DEPTH, TcpEndpoint};
use crate::completion::Opcode;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::LocalParts;
use crate::memory::keys::{KeyEntry, KeyTable};
use crate::ops::{OpId, OpOutcome, WaitError, Waited, waited};
use crate::options::{ConnectOptions, ConnectionInfo, Transport};
use replies::Progress;

mod conn;
mod core;
#[cfg(test)]
mod core_tests;
mod frame;
mod handoff;
mod inbound;
mod nap;
mod receiver;
mod replies;
mod responder;
mod sender;
mod socket;
#[cfg(test)]
mod tests;

use self::core::*;
use frame::*;
use inbound::*;
use socket::*;

/// The largest message (send, or write with immediate) this side accepts.
pub(crate) const MAX_MESSAGE: u32 = 1 << 30;
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

/// The right to read the socket: frames are read whole by one thread at a
/// time, the receiver thread or a waiter that spins (which then carries out
/// what arrived itself, without a hand-over between threads).
struct Reader {
    /// Where refused or withdrawn bytes are read to and dropped.
    scratch: Vec<u8>,
    /// The start of the next frame, read with the end of the last one's
    /// payload (by the receiver thread; a waiter leaves the socket to it
    /// while this holds bytes).
    ahead: Ahead,
}

struct Inner {
    state: Mutex<Core>,
    /// Taken before `state`, never while holding it.
    reader: Mutex<Reader>,
    /// Waiters spinning now: while there are any, the receiver thread naps
    /// instead of watching the socket, so that it does not take a CPU from
    /// them at every frame they carry out themselves.
    spinners: AtomicUsize,
    /// The receiver thread naps (on `nap`, with the reader released).
    napping: AtomicBool,
    /// Threads writing a stream now ([`handoff::Writing`]): while there are
    /// any, the receiver thread leaves what arrives to them.
    writers: AtomicUsize,
    /// The receiver thread defers to writers (on `nap`, with the reader
    /// released, watching the socket).
    deferring: AtomicBool,
    /// The receiver thread saw the socket readable while a writer streamed
    /// and waits for a writer to read it.
    handed: AtomicBool,
    /// A writer's turn left a frame to the receiver thread.
    left_to_receiver: AtomicBool,
    /// Hand-overs writers took, and of those, the ones that left a frame
    /// to the receiver thread (for the tests).
    #[cfg(test)]
    turns: [AtomicU64; 2],
    /// The receiver thread's id, for the tests.
    #[cfg(test)]
    receiver_tid: std::sync::atomic::AtomicI32,
    /// Where the receiver thread naps: rung when a waiter left it a frame,
    /// a thread goes to sleep on `events` and needs it to watch the socket,
    /// or the connection broke.
    /// Made at the receiver thread's first nap (none when out of
    /// descriptors: it then naps [`NAP`](nap::NAP) at a time, not rung).
    nap: OnceLock<Option<nap::Nap>>,
    /// The sender thread waits here: queued messages, control frames,
    /// stopping.
    work: Condvar,
    /// Everyone else: completions, queue room, posted receives, a drained
    /// control queue at shutdown, a lost connection. Two condition
    /// variables, so a completion does not wake the sender thread and a
    /// queued frame does not wake the waiters.
    events: Condvar,
    /// Waiters on memory the peer writes (a notification ring), woken when
    /// one of the peer's writes lands: apart from `events`, so that a bulk
    /// of writes landing does not wake a thread waiting for a receive at
    /// every frame (five futex calls a frame at a bench's server before).
    ring: Condvar,
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

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`Core::end_write`].
    fn end_write(&self, st: &mut Core, o: &Out, write_failed: bool) {
        st.end_write(o, write_failed, self);
    }

    /// [`Core::start_write`], publishing the writer's progress.
    fn start_write(&self, st: &mut Core, o: &Out) {
        let progress = st.start_write(o);
        self.tx.store(progress.pack(), Ordering::Release);
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
    fn sleep<'a>(&self, mut st: MutexGuard<'a, Core>, d: Duration) -> MutexGuard<'a, Core> {
        // What this thread waits for now comes only through the receiver thread.
        self.end_nap();
        st.sleepers += 1;
        let mut st = self.events.wait_timeout(st, d).unwrap_or_else(|e| e.into_inner()).0;
        st.sleepers -= 1;
        st
    }

    /// Sleeps on `ring` (a write of the peer's landing wakes it), up to `d`.
    fn sleep_on_ring<'a>(&self, mut st: MutexGuard<'a, Core>, d: Duration) -> MutexGuard<'a, Core> {
        self.end_nap();
        st.ring_sleepers += 1;
        let mut st = self.ring.wait_timeout(st, d).unwrap_or_else(|e| e.into_inner()).0;
        st.ring_sleepers -= 1;
        st
    }

    /// The receiver thread's nap, if it was made.
    fn nap(&self) -> Option<&nap::Nap> {
        self.nap.get().and_then(Option::as_ref)
    }

    /// The receiver thread's nap, made now if it was not (none when out of
    /// descriptors).
    fn made_nap(&self) -> Option<&nap::Nap> {
        self.nap.get_or_init(|| nap::Nap::new().ok()).as_ref()
    }

    /// Ends the receiver thread's nap, if it naps (a thread going to
    /// sleep needs the socket watched; a receiver thread deferring to a
    /// writer watches it already).
    fn end_nap(&self) {
        if let Some(nap) = self.nap().filter(|_| self.napping.load(Ordering::SeqCst)) {
            nap.ring();
        }
    }

    /// Calls the receiver thread back to the socket, if it naps or defers
    /// to a writer: a frame was left to it, or the connection broke.
    fn rouse(&self) {
        let away = self.napping.load(Ordering::SeqCst) || self.deferring.load(Ordering::SeqCst);
        if let Some(nap) = self.nap().filter(|_| away) {
            nap.ring();
        }
    }

    /// Wakes the threads asleep on `events`, if any.
    fn wake(&self, st: &Core) {
        st.wake(self);
    }

    /// [`Core::break_with`].
    fn break_with(&self, st: &mut Core, reason: String) {
        st.break_with(reason, self);
    }
}

impl Env for Inner {
    /// The exposed region under `key`, if this connection's peer may use it.
    fn lookup(&self, key: u32) -> Option<Arc<KeyEntry>> {
        if !self.granted.read().unwrap_or_else(|e| e.into_inner()).contains(&key) {
            return None;
        }
        self.keys.lookup(key)
    }
}

impl Inner {
    /// Makes what a write with immediate wrote at `addr..addr + len` under
    /// `key` visible to CUDA work: in GPU memory on the staged path (the
    /// only GPU memory this transport writes, through its host mirror), a
    /// copy in from the mirror.
    fn make_visible(&self, key: u32, addr: u64, len: u64) -> std::result::Result<(), String> {
        #[cfg(feature = "cuda")]
        return self.visible.make_visible(key, addr, len).map_err(|e| e.to_string());
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (key, addr, len);
            Ok(())
        }
    }
}

impl Signals for Inner {
    fn wake_waiters(&self) {
        self.events.notify_all();
    }

    fn wake_sender(&self) {
        self.work.notify_one();
    }

    fn wake_ring_waiters(&self) {
        self.ring.notify_all();
    }

    fn broken(&self) {
        self.dead.store(true, Ordering::Release);
        // A napping receiver thread fails what it owns now.
        self.rouse();
    }
}

impl Inner {
    /// [`Core::reply`].
    fn reply(&self, st: &mut Core, ctl: Ctl) -> Handled {
        st.reply(ctl, self)
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
