//! [`Connection`]: the high-level, safe API. Operations take their buffer by
//! value and return a [`Pending`] that gives it back once the device is done.

#![forbid(unsafe_code)]

mod establish;
mod inbox;
mod persistent;
mod ring;
mod transfer;
mod waiting;

pub use crate::options::{ConnectOptions, ConnectionInfo};
pub use establish::{Interrupt, Listener, MAX_CONCURRENT_HANDSHAKES};
pub use inbox::{Inbox, InboxStats, MAX_QUEUED_BYTES, MAX_QUEUED_NOTES, NOTE_OVERHEAD, Note};
pub use persistent::{Persistent, PersistentRecv, PersistentSend};
pub use ring::{Received, RecvRing};
pub(crate) use transfer::Direction;
pub use transfer::{Failed, Transfer, Transferred};
pub use waiting::{CompletionSet, Finished};

use std::fmt;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::completion::Completion;
use crate::deadline::Deadline;
use crate::domain::Domain;
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::memory::LocalParts;
use crate::memory::{Counter, Live};
use crate::memory::{Exposed, LocalBuffer, LocalSlice, Memory, RemoteRegion, RemoteSlice};
use crate::ops::{OpId, OpOutcome, WaitError, Waited};
use crate::protocol::order::{Deferred, Gate, What};
use crate::transport::{self, ConnTransport, Posted, PostedInline, QuietSend, RemoteOp, WorkItem};

pub(crate) struct ConnShared {
    transport: ConnTransport,
    info: ConnectionInfo,
    peer_regions: Vec<RemoteRegion>,
    op_timeout: Duration,
    /// How long a post waits for room in the send queue.
    post_timeout: Duration,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    staging: (usize, usize),
    /// How long a wait looks again at once before sleeping
    /// ([`ConnectOptions::spin`](crate::ConnectOptions::spin)).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    spin: Duration,
    domain: Domain,
    /// Registered buffers for notification messages too long to go inline.
    note_pool: std::sync::Mutex<Vec<crate::Region<crate::HostMemory>>>,
    /// Staged GPU operations in progress, moved along by every wait.
    #[cfg(feature = "cuda")]
    staged: crate::protocol::staged::StagedSet,
    /// The order of this connection's operations ([`crate::protocol::order`]).
    pub(crate) gate: Arc<Gate>,
    /// Moves the connection along from the engine while posts wait at the
    /// gate and nobody may be waiting on what holds it.
    driver: Arc<ConnDriver>,
    _live: Live,
}

/// Moves a connection along on the domain's engine while an operation holds
/// its gate: a staged operation must hand over all its requests whether or
/// not anyone waits on it (a post kept behind it may have no handle at all:
/// an untracked send), and so must what is kept behind it. It also lets go
/// of what dropped staged operations' copies held once they end. Looks
/// again on a short timer (copies end without waking anyone) until the gate
/// is open and no such copy is left.
#[derive(Default)]
struct ConnDriver {
    shared: std::sync::OnceLock<std::sync::Weak<ConnShared>>,
    engine: std::sync::OnceLock<crate::transport::engine::EngineHandle>,
    /// Running, or a run is due: asking again changes nothing.
    busy: std::sync::atomic::AtomicBool,
}

impl ConnDriver {
    /// Has the engine drive `shared` soon, unless it already will.
    fn ask(self: &Arc<Self>, shared: &Arc<ConnShared>) {
        use std::sync::atomic::Ordering::AcqRel;
        let _ = self.shared.set(Arc::downgrade(shared));
        let engine = self.engine.get_or_init(|| shared.domain.inner.engine.handle());
        if !self.busy.swap(true, AcqRel) {
            engine.spawn(Arc::clone(self) as Arc<dyn crate::transport::engine::Task>);
        }
    }
}

impl std::task::Wake for ConnDriver {
    fn wake(self: Arc<Self>) {
        if let Some(engine) = self.engine.get() {
            engine.clone().spawn(self);
        }
    }
}

impl crate::transport::engine::Task for ConnDriver {
    fn run(self: Arc<Self>) {
        use crate::transport::engine::{LOOK_AGAIN, LOOK_AGAIN_COPYING};
        use std::sync::atomic::Ordering::AcqRel;
        let Some(shared) = self.shared.get().and_then(std::sync::Weak::upgrade) else { return };
        let copying = shared.drive();
        // Copies of dropped staged operations: what they hold goes once they end.
        #[cfg(feature = "cuda")]
        let retiring = shared.domain.inner.staging.reap();
        #[cfg(not(feature = "cuda"))]
        let retiring = false;
        if shared.gate.is_open() && !retiring {
            self.busy.store(false, std::sync::atomic::Ordering::Release);
            // Held since the look above, which asked nothing (busy was set).
            if shared.gate.is_open() || self.busy.swap(true, AcqRel) {
                return;
            }
        }
        let again = if copying { LOOK_AGAIN_COPYING } else { LOOK_AGAIN };
        shared.domain.inner.engine.timer(Instant::now() + again, std::task::Waker::from(self));
    }
}

impl ConnShared {
    fn deadline(&self) -> Deadline {
        Deadline::lazy(self.post_timeout, "room in the send queue")
    }

    fn post_items<B: Send + 'static>(self: &Arc<Self>, buf: B, items: Result<&[WorkItem]>) -> Pending<B> {
        match items {
            Ok(items) if self.gate.is_open() => self.pending(buf, self.transport.post_send(items, self.deadline())),
            Ok(items) => self.post_behind(buf, What::Send(items.to_vec())),
            Err(e) => Pending::failed(self, buf, e),
        }
    }

    /// A post that must wait behind an operation still handing over its
    /// requests: kept at the gate, posted when its turn comes.
    #[cold]
    #[inline(never)]
    fn post_behind<B: Send + 'static>(self: &Arc<Self>, buf: B, what: What) -> Pending<B> {
        match self.gate.keep(what, Instant::now() + self.post_timeout) {
            Ok(kept) => {
                self.driver.ask(self);
                Pending::with(self, buf, Stage::Deferred(kept))
            }
            // Its turn came meanwhile.
            Err(What::Send(items)) => self.pending(buf, self.transport.post_send(&items, self.deadline())),
            Err(What::Inline { data, imm }) => {
                self.pending(buf, self.transport.post_inline(&data, imm, self.deadline()))
            }
            Err(What::Untracked { .. }) => unreachable!("untracked sends are kept by send_inline_untracked"),
        }
    }

    /// Has the engine move this connection along soon (see [`ConnDriver`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn drive_soon(self: &Arc<Self>) {
        self.driver.ask(self);
    }

    /// Moves what is held at the gate along: the staged operations, the
    /// posts kept behind them, completions that make room for them.
    /// Whether a copy is in flight.
    pub(crate) fn drive(&self) -> bool {
        #[cfg(feature = "cuda")]
        let copying = self.staged.progress(&self.transport);
        #[cfg(not(feature = "cuda"))]
        let copying = false;
        if !self.gate.is_open() {
            let _ = self.transport.progress();
            self.gate.pump(&self.transport);
        }
        copying
    }

    fn pending<B: Send + 'static>(self: &Arc<Self>, buf: B, posted: Posted) -> Pending<B> {
        Pending::posted(self, buf, posted)
    }

    /// [`Connection::recv`].
    pub(crate) fn recv<B: LocalBuffer>(self: &Arc<Self>, local: LocalSlice<B>) -> Pending<B> {
        match local.resolve() {
            #[cfg(feature = "cuda")]
            Ok(parts) if parts.path.is_some() => self.gpu(local, parts, None),
            Ok(parts) => {
                let posted = self.transport.post_recv(Some(parts));
                self.pending(local.into_inner(), posted)
            }
            Err(e) => Pending::failed(self, local.into_inner(), e),
        }
    }

    /// [`Connection::send_unsignaled`].
    pub(crate) fn send_unsignaled<B: LocalBuffer>(self: &Arc<Self>, local: LocalSlice<B>) -> Pending<B> {
        let parts = match local.resolve() {
            Ok(p) => p,
            Err(e) => return Pending::failed(self, local.into_inner(), e),
        };
        #[cfg(feature = "cuda")]
        if parts.path.is_some() {
            return self.gpu(local, parts, Some(RemoteOp::Send));
        }
        let item = WorkItem { local: Some(parts), op: RemoteOp::Send };
        if !self.gate.is_open() {
            return self.post_items(local.into_inner(), Ok(&[item]));
        }
        match self.transport.post_send_quiet(&item, self.deadline()) {
            PostedInline::Tracked(posted) => self.pending(local.into_inner(), posted),
            PostedInline::Quiet(q) => Pending::with(self, local.into_inner(), Stage::Quiet(q, None)),
        }
    }

    /// GPU memory: a direct path posts like host memory, after the data is
    /// produced (sends, writes) and with a flush before the completion is
    /// reported (receives, reads); the staged path runs a pipeline. `op` is
    /// `None` for a receive.
    #[cfg(feature = "cuda")]
    fn gpu<B: LocalBuffer>(
        self: &Arc<Self>,
        local: LocalSlice<B>,
        parts: LocalParts,
        op: Option<RemoteOp>,
    ) -> Pending<B> {
        use crate::protocol::staged::Pipeline;
        use crate::protocol::{Route, check_staged, route};
        let Some(cuda) = local.buffer().cuda() else {
            return Pending::failed(
                self,
                local.into_inner(),
                Error::InvalidArgument("GPU path without a GPU buffer".into()),
            );
        };
        let device = cuda.device().clone();
        // The TCP transport reaches only host memory: GPU memory goes through
        // the staging pipeline whatever path it is registered by.
        if route(&parts, self.transport.is_tcp()) == Route::Staged {
            // The checks a direct post gets, before anything is copied.
            if let Err(e) = check_staged(op, parts.len as u64, self.info.max_message_size) {
                return Pending::failed(self, local.into_inner(), e);
            }
            let (chunk, depth) = self.staging;
            // Started at once: receives must be posted before the peer sends,
            // and copies should run while the caller does other work. Later
            // steps advance whenever the operation is waited on or polled.
            let mut pipeline =
                match Pipeline::new(op, &self.domain.inner.staging, &device, parts, chunk, depth, self.op_timeout) {
                    Ok(p) => p.in_turn(&self.gate),
                    Err(e) => return Pending::failed(self, local.into_inner(), e),
                };
            if !self.gate.is_open() {
                // Its requests go out with nobody waiting on it.
                self.driver.ask(self);
            }
            // Outgoing: the copies out of the GPU wait for the producer fence.
            // Incoming: the copies into it wait for the consumer fence (work
            // still reading what they overwrite).
            pipeline.after(cuda.fences());
            if let Err(e) = pipeline.advance(&self.transport) {
                // Whatever reached the device stays with the connection.
                pipeline.abandon(&self.transport, None);
                return Pending::failed(self, local.into_inner(), e);
            }
            return Pending::staged(self, pipeline, local.into_inner());
        }
        // Direct: the NIC touches the memory as soon as the request is posted,
        // so the fences (producers for outgoing data, consumers for incoming)
        // come first. An operation of the send queue is kept at the gate until
        // they are done, nobody waiting on them; what is posted after it waits
        // behind it. A receive waits for them here (the receive queue has no
        // gate: a receive kept would let later ones take its message).
        if let Some(op) = op {
            let item = WorkItem { local: Some(parts), op };
            let mut p = match fences_pending(cuda) {
                None => self.post_items(local.into_inner(), Ok(&[item])),
                Some(ready) => {
                    let kept = self.gate.keep_until(What::Send(vec![item]), Instant::now() + self.post_timeout, ready);
                    self.driver.ask(self);
                    Pending::with(self, local.into_inner(), Stage::Deferred(kept))
                }
            };
            if let RemoteOp::Read(_) = op {
                p.after = Some(Box::new(move || device.flush_remote_writes()));
            }
            return p;
        }
        if let Err(e) = cuda.wait_ready() {
            return Pending::failed(self, local.into_inner(), e);
        }
        match op {
            Some(_) => unreachable!("sends, writes and reads went above"),
            None => {
                let posted = self.transport.post_recv(Some(parts));
                let mut p = self.pending(local.into_inner(), posted);
                p.after = Some(Box::new(move || device.flush_remote_writes()));
                p
            }
        }
    }
}

/// `buf`'s fences still running, as a check a post kept at the gate asks
/// (`None`: all done, post now).
#[cfg(feature = "cuda")]
pub(crate) fn fences_pending(buf: &crate::cuda::CudaBuffer) -> Option<crate::protocol::order::DataReady> {
    let fences = buf.fences();
    if fences.iter().all(|f| matches!(f.is_done(), Ok(true))) {
        return None;
    }
    let mut fences = fences;
    Some(Box::new(move || {
        while let Some(f) = fences.last() {
            if !f.is_done()? {
                return Ok(false);
            }
            fences.pop();
        }
        Ok(true)
    }))
}

/// A reliable connection to one peer.
///
/// Every operation takes its local buffer by value and returns a
/// [`Pending`] that hands it back, with a [`Completion`], when the device
/// is done with it. Thread-safe: operations may be posted and waited on
/// from several threads.
///
/// Zero-byte operations are allowed on every transport (an empty slice, or
/// [`send_inline`](Connection::send_inline) of no bytes): a zero-byte send
/// or write with immediate consumes one receive at the peer, a plain
/// zero-byte write or read touches no memory.
///
/// Dropping the connection (or [`close`](Connection::close)) tells the peer,
/// and fails everything still outstanding with [`Error::ConnectionLost`];
/// buffers of operations still in flight are released once the device can
/// no longer touch them.
pub struct Connection {
    shared: Arc<ConnShared>,
}

impl Connection {
    /// The verbs transport's connection, for the transport's own tests.
    #[cfg(all(test, feature = "verbs"))]
    pub(crate) fn verbs_conn(&self) -> Option<&Arc<transport::verbs::VerbsConn>> {
        match &self.shared.transport {
            ConnTransport::Verbs(v) => Some(v),
            ConnTransport::Tcp(_) => None,
        }
    }

    pub(crate) fn establish(
        domain: &Domain,
        stream: TcpStream,
        opts: &ConnectOptions,
        is_server: bool,
    ) -> Result<Self> {
        let est = transport::establish(&domain.inner.mem, stream, opts, is_server)?;
        Ok(Connection {
            shared: Arc::new(ConnShared {
                transport: est.transport,
                info: est.info,
                peer_regions: est.peer_regions,
                op_timeout: opts.op_timeout,
                post_timeout: opts.post_timeout.unwrap_or(opts.op_timeout),
                staging: (opts.staging_chunk, opts.staging_depth),
                spin: opts.spin,
                domain: domain.clone(),
                note_pool: std::sync::Mutex::new(Vec::new()),
                #[cfg(feature = "cuda")]
                staged: crate::protocol::staged::StagedSet::default(),
                gate: Arc::new(Gate::default()),
                driver: Arc::new(ConnDriver::default()),
                _live: domain.live(Counter::Connections),
            }),
        })
    }

    /// Facts about the connection.
    pub fn info(&self) -> &ConnectionInfo {
        &self.shared.info
    }

    /// The regions the peer advertised in the handshake.
    pub fn remote_regions(&self) -> &[RemoteRegion] {
        &self.shared.peer_regions
    }

    /// Lets the peer reach `region` through this connection, after the
    /// handshake; returns the descriptor to send it (in a message of your
    /// own). Regions advertised in the handshake need no grant.
    ///
    /// On TCP a peer reaches only the regions advertised or granted on its
    /// connection. On verbs a remote key is valid on every queue pair of the
    /// domain's protection domain: to keep peers apart there, give each its
    /// own [`Domain`] (one protection domain each).
    pub fn grant<M: Memory>(&self, region: &Exposed<M>) -> RemoteRegion {
        let d = region.descriptor();
        self.shared.transport.grant(d.rkey);
        d
    }

    /// The peer's region with `tag`.
    pub fn remote_region(&self, tag: u64) -> Option<RemoteRegion> {
        self.shared.peer_regions.iter().find(|r| r.tag == tag).copied()
    }

    fn one<B: LocalBuffer>(&self, local: LocalSlice<B>, op: RemoteOp) -> Pending<B> {
        let parts = match local.resolve() {
            Ok(p) => p,
            Err(e) => return Pending::failed(&self.shared, local.into_inner(), e),
        };
        #[cfg(feature = "cuda")]
        if parts.path.is_some() {
            return self.shared.gpu(local, parts, Some(op));
        }
        self.shared.post_items(local.into_inner(), Ok(&[WorkItem { local: Some(parts), op }]))
    }

    /// Sends `local` as one message; it lands in the peer's next posted receive.
    pub fn send<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> Pending<B> {
        self.one(local.into(), RemoteOp::Send)
    }

    /// Sends `local` with a 32-bit immediate the peer's receive completion carries.
    pub fn send_with_imm<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>, imm: u32) -> Pending<B> {
        self.one(local.into(), RemoteOp::SendWithImm(imm))
    }

    /// Sends `local` unsignaled where the transport allows it, as perftest
    /// and UCX post sends that follow one another (a ping-pong, a stream):
    /// the device reports no completion of its own for it. The send queue
    /// completes in order, so a later signaled request's completion says
    /// this one is done; at most every few requests one is signaled anyway.
    ///
    /// The `Pending` reports the same outcome as [`send`](Self::send)'s,
    /// and holds the buffer just as long: dropped before its outcome is
    /// known, the buffer stays with the connection until a later completion
    /// says the device is done with it. Waiting on one that no signaled
    /// request follows yet posts a zero-length write to learn its outcome,
    /// so a send waited for at once is cheaper with [`send`](Self::send).
    /// GPU memory and the TCP transport track every send, as `send` does.
    pub fn send_unsignaled<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> Pending<B> {
        self.shared.send_unsignaled(local.into())
    }

    /// Sends a small message copied from `data` at post time (no registered
    /// buffer needed), at most [`ConnectionInfo::max_inline`] bytes; `imm`
    /// rides along if given. An empty `data` sends a zero-byte message.
    ///
    /// On verbs most inline sends go unsignaled, as perftest and UCX post
    /// theirs: the send queue completes in order, so a later signaled
    /// request's completion says this one is done, and no completion of its
    /// own is polled for. The `Pending` reports the same outcome either way;
    /// waiting on one that no signaled request follows yet posts a
    /// zero-length write to learn it.
    pub fn send_inline(&self, data: &[u8], imm: Option<u32>) -> Pending<()> {
        if !self.shared.gate.is_open() {
            return self.shared.post_behind((), What::Inline { data: data.to_vec(), imm });
        }
        match self.shared.transport.post_inline_quiet(data, imm, self.shared.deadline(), false) {
            PostedInline::Tracked(posted) => self.shared.pending((), posted),
            PostedInline::Quiet(q) => Pending::with(&self.shared, (), Stage::Quiet(q, None)),
        }
    }

    /// [`send_inline`](Self::send_inline) with no handle to wait on: the
    /// data is copied into the send queue before this returns, and `Ok`
    /// says only that the send was posted. The cheapest way to send a small
    /// control message or a ping-pong's ping (UCX likewise hands back no
    /// request for a send that completed at once).
    ///
    /// Delivery is confirmed by what follows: the peer's reply, or any later
    /// operation on this connection finishing (the send queue completes in
    /// order). A send that fails breaks the connection: operations posted or
    /// waited on after that fail with [`Error::ConnectionLost`], which says why.
    ///
    /// Over TCP the peer sends no acknowledgement for it (a tracked send gets
    /// one): it is done once the socket has its frame, which frees its place
    /// in the send queue; the peer carries frames out in order, so a later
    /// operation's acknowledgement still covers it.
    ///
    /// # Errors
    /// What refuses the post: [`Error::MessageTooLarge`] past
    /// [`ConnectionInfo::max_inline`], [`Error::ConnectionLost`], or
    /// [`Error::Timeout`] when the send queue stays full for the connection's
    /// post timeout.
    pub fn send_inline_untracked(&self, data: &[u8], imm: Option<u32>) -> Result<()> {
        if !self.shared.gate.is_open() {
            if data.len() as u64 > u64::from(self.shared.info.max_inline) {
                let (len, max) = (data.len() as u64, u64::from(self.shared.info.max_inline));
                return Err(Error::MessageTooLarge { len, max });
            }
            let what = What::Untracked { data: data.to_vec(), imm };
            if self.shared.gate.keep(what, Instant::now() + self.shared.post_timeout).is_ok() {
                // Posted in its turn; a failure then breaks the connection.
                self.shared.driver.ask(&self.shared);
                return Ok(());
            }
        }
        match self.shared.transport.post_inline_quiet(data, imm, self.shared.deadline(), true) {
            PostedInline::Quiet(_) => Ok(()),
            PostedInline::Tracked(posted) => self.untrack(posted),
        }
    }

    /// Leaves a posted operation with no handle to the connection, which
    /// frees its slot at its completion.
    fn untrack(&self, posted: Posted) -> Result<()> {
        match posted {
            Posted::Ok(id) => {
                self.shared.transport.orphan(id, Box::new(()));
                Ok(())
            }
            Posted::Stuck(id, e) => {
                self.shared.transport.orphan(id, Box::new(()));
                Err(*e)
            }
            Posted::Refused(e) => Err(*e),
        }
    }

    /// Posts a receive into `local` for the peer's next send.
    pub fn recv<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> Pending<B> {
        self.shared.recv(local.into())
    }

    /// For a GPU region exposed to this peer: a receive for the peer's
    /// write with immediate (or zero-byte send) that says "done", whose
    /// completion also makes the written data visible to CUDA work: on a
    /// direct path it flushes remote writes where the GPU needs that, on the
    /// staged path it copies the host mirror into GPU memory. A one-sided
    /// write into a staged GPU region reaches GPU memory only this way.
    #[cfg(feature = "cuda")]
    ///
    /// On the staged path this copies the whole region; when the peer wrote
    /// only part of it, [`recv_write_range`](Self::recv_write_range) moves
    /// just that.
    pub fn recv_write(&self, exposed: &Exposed<crate::cuda::CudaBuffer>) -> Pending<()> {
        let mut p = self.recv_imm();
        let target = exposed.clone();
        p.after = Some(Box::new(move || target.pull()));
        p
    }

    /// [`recv_write`](Self::recv_write) for a peer's write into `range` of
    /// `exposed`: on the staged path only that range is copied into GPU
    /// memory (a 4 KiB write into a 1 GiB region moves 4 KiB), and the rest
    /// of GPU memory, which the owner may have changed since, is left alone.
    /// A range past the region fails the operation with
    /// [`Error::OutOfBounds`].
    #[cfg(feature = "cuda")]
    pub fn recv_write_range(
        &self,
        exposed: &Exposed<crate::cuda::CudaBuffer>,
        range: std::ops::Range<usize>,
    ) -> Pending<()> {
        let mut p = self.recv_imm();
        let target = exposed.clone();
        p.after = Some(Box::new(move || target.pull_range(range.clone())));
        p
    }

    /// Posts a receive with no buffer: for the peer's writes with immediate
    /// and zero-byte sends. Its completion carries the immediate.
    pub fn recv_imm(&self) -> Pending<()> {
        self.shared.pending((), self.shared.transport.post_recv(None))
    }

    /// Writes `local` into the peer's memory at `remote` (same length, else
    /// [`Error::LengthMismatch`] from the wait).
    /// Larger than the maximum message size is fine: it is split.
    pub fn write<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Pending<B> {
        self.one(local.into(), RemoteOp::Write(*remote))
    }

    /// Writes `local` to `remote` and consumes one of the peer's receives,
    /// handing it `imm`: data and notification in one message (at most the
    /// maximum message size).
    pub fn write_with_imm<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        remote: &RemoteSlice,
        imm: u32,
    ) -> Pending<B> {
        self.one(local.into(), RemoteOp::WriteWithImm(*remote, imm))
    }

    /// Reads the peer's memory at `remote` into `local` (same length, else
    /// [`Error::LengthMismatch`] from the wait).
    pub fn read<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Pending<B> {
        self.one(local.into(), RemoteOp::Read(*remote))
    }

    /// Starts a batch: several operations posted with one doorbell, only the
    /// last one signaled, completing together.
    pub fn batch<B: LocalBuffer>(&self) -> Batch<'_, B> {
        Batch { conn: self, items: Vec::new() }
    }

    /// Polls for completions once: releases the buffers of dropped
    /// operations that have finished. [`Pending::wait`] does this too.
    ///
    /// # Errors
    /// [`Error::Verbs`] when polling fails.
    pub fn progress(&self) -> Result<usize> {
        self.shared.transport.progress()
    }

    /// `None` while the connection can carry operations; else why not
    /// (the queue pair went to the error state, or the peer closed or died).
    pub fn broken(&self) -> Option<String> {
        self.shared.transport.broken()
    }

    /// Operations in flight, and how many of those have had their
    /// [`Pending`] dropped: [`stats`](Self::stats) as a pair.
    pub fn in_flight(&self) -> (usize, usize) {
        let s = self.stats();
        (s.in_flight, s.orphaned)
    }

    /// What the connection's queues hold now (completions the device has
    /// already reported count as done: it polls once first).
    pub fn stats(&self) -> ConnectionStats {
        let _ = self.shared.transport.progress();
        let (in_flight, orphaned) = self.shared.transport.stats();
        ConnectionStats { in_flight, orphaned }
    }

    /// Breaks the connection for `reason`: tells the peer, and fails what
    /// is outstanding with [`Error::ConnectionLost`] saying why.
    pub(crate) fn shut(&self, reason: &str) {
        self.shared.transport.shutdown(reason);
    }

    /// Closes the connection: tells the peer, and fails what is outstanding
    /// (dropping it does the same). On verbs, a side that closes first keeps
    /// its queue pair up until the peer closes too, for at most 5 ms, so that
    /// what the peer sent last is still acknowledged: a peer waiting for
    /// its final send learns it arrived instead of seeing it fail.
    pub fn close(self) {
        drop(self)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.shared.transport.close("the connection was closed by this side");
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection").field("info", &self.shared.info).finish()
    }
}

/// Operations to post together; see [`Connection::batch`].
#[derive(Debug)]
#[must_use = "a batch does nothing until posted"]
pub struct Batch<'c, B: LocalBuffer> {
    conn: &'c Connection,
    items: Vec<(LocalSlice<B>, RemoteOp)>,
}

impl<B: LocalBuffer> Batch<'_, B> {
    /// Adds a send.
    pub fn send(mut self, local: impl Into<LocalSlice<B>>) -> Self {
        self.items.push((local.into(), RemoteOp::Send));
        self
    }

    /// Adds a write.
    pub fn write(mut self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Self {
        self.items.push((local.into(), RemoteOp::Write(*remote)));
        self
    }

    /// Adds a write with immediate.
    pub fn write_with_imm(mut self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice, imm: u32) -> Self {
        self.items.push((local.into(), RemoteOp::WriteWithImm(*remote, imm)));
        self
    }

    /// Adds a read.
    pub fn read(mut self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Self {
        self.items.push((local.into(), RemoteOp::Read(*remote)));
        self
    }

    /// Posts them all; the buffers come back together, in order. A batch
    /// needing more send-queue requests than the queue holds fails with
    /// [`Error::TooManyRequests`], an empty one with [`Error::EmptyBatch`],
    /// one with a staged GPU buffer with [`Error::NeedsDirectPath`].
    pub fn post(self) -> Pending<Vec<B>> {
        #[cfg(feature = "cuda")]
        let mut flush: Vec<crate::cuda::CudaDevice> = Vec::new();
        // Fences of GPU buffers still running: the batch is kept at the gate
        // until they are done, nobody blocking on them.
        #[cfg(feature = "cuda")]
        let mut fenced: Vec<crate::protocol::order::DataReady> = Vec::new();
        let items: Result<Vec<WorkItem>> = self
            .items
            .iter()
            .map(|(local, op)| {
                let l = local.resolve()?;
                #[cfg(feature = "cuda")]
                if let (Some(path), Some(cuda)) = (l.path, local.buffer().cuda()) {
                    if !path.is_direct() {
                        return Err(Error::NeedsDirectPath {
                            what: "a batch",
                            reason: "this GPU buffer is staged: post its operations one by one".into(),
                        });
                    }
                    fenced.extend(fences_pending(cuda));
                    if op.reads_remote() {
                        flush.push(cuda.device().clone());
                    }
                }
                Ok(WorkItem { local: Some(l), op: *op })
            })
            .collect();
        let bufs: Vec<B> = self.items.into_iter().map(|(l, _)| l.into_inner()).collect();
        let shared = &self.conn.shared;
        #[allow(unused_mut)]
        let mut pending = match items {
            #[cfg(feature = "cuda")]
            Ok(items) if !fenced.is_empty() => {
                let ready: crate::protocol::order::DataReady =
                    Box::new(move || fenced.iter_mut().try_fold(true, |all, f| Ok(f()? && all)));
                let kept = shared.gate.keep_until(What::Send(items), Instant::now() + shared.post_timeout, ready);
                shared.driver.ask(shared);
                Pending::with(shared, bufs, Stage::Deferred(kept))
            }
            Ok(items) => shared.post_items(bufs, Ok(&items)),
            Err(e) => shared.post_items(bufs, Err(e)),
        };
        #[cfg(feature = "cuda")]
        if !flush.is_empty() {
            pending.after = Some(Box::new(move || flush.iter().try_for_each(|d| d.flush_remote_writes())));
        }
        pending
    }
}

/// What a connection's queues hold ([`Connection::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionStats {
    /// Operations posted whose final completion has not arrived.
    pub in_flight: usize,
    /// Of those, the ones whose [`Pending`] was dropped: their buffers stay
    /// with the connection until the device is done with them.
    pub orphaned: usize,
}

/// An operation in flight. Holds its buffer until the device is done.
///
/// Wait with [`wait`](Pending::wait) (or poll with
/// [`poll`](Pending::poll)), then take the buffer back with
/// [`into_buffer`](Pending::into_buffer), or do both with
/// [`finish`](Pending::finish). Dropping it before it completes is safe:
/// the buffer stays with the connection until the device is done with it.
#[must_use = "an operation's outcome and buffer come back through its Pending"]
pub struct Pending<B: Send + 'static> {
    shared: Arc<ConnShared>,
    buf: Option<B>,
    stage: Stage,
    /// Runs once the operation succeeded, before the success is reported
    /// (flushing remote writes into GPU memory, copying a staged mirror in).
    after: Option<Hook>,
    /// While awaited as a future: its deadline and timer.
    awaiting: Option<Box<crate::transport::engine::Awaiting>>,
}

type Hook = Box<dyn FnOnce() -> Result<()> + Send>;

enum Stage {
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
    fn with(shared: &Arc<ConnShared>, buf: B, stage: Stage) -> Self {
        Pending { shared: Arc::clone(shared), buf: Some(buf), stage, after: None, awaiting: None }
    }

    fn new(shared: &Arc<ConnShared>, id: OpId, buf: B) -> Self {
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
    fn failed(shared: &Arc<ConnShared>, buf: B, error: Error) -> Self {
        Pending::with(shared, buf, Stage::Failed(Some(Box::new(error))))
    }

    #[cold]
    #[inline(never)]
    fn refused(shared: &Arc<ConnShared>, buf: B, error: Box<Error>) -> Self {
        Pending::with(shared, buf, Stage::Failed(Some(error)))
    }

    #[cold]
    #[inline(never)]
    fn stuck(shared: &Arc<ConnShared>, id: OpId, buf: B, error: Box<Error>) -> Self {
        Pending::with(shared, buf, Stage::Stuck(id, Some(error)))
    }

    #[cfg(feature = "cuda")]
    fn staged(shared: &Arc<ConnShared>, pipeline: crate::protocol::staged::Pipeline, buf: B) -> Self {
        let pipeline = Arc::new(std::sync::Mutex::new(pipeline));
        shared.staged.add(&pipeline);
        Pending::with(shared, buf, Stage::Staged(pipeline))
    }

    /// Moves the connection's staged operations along (see
    /// [`StagedSet`](crate::protocol::staged::StagedSet)).
    /// Returns whether a copy is still in flight.
    fn progress_staged(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.shared.staged.progress(&self.shared.transport);
        #[cfg(not(feature = "cuda"))]
        false
    }

    #[inline(never)]
    fn progress_staged_cold(&self) {
        self.progress_staged();
    }

    /// Whether a wait must also move staged operations along.
    fn staged_in_progress(&self) -> bool {
        #[cfg(feature = "cuda")]
        return !self.shared.staged.is_empty();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Whether the device is done with the buffer, polling once for an
    /// outcome not known yet (an error stays to be reported).
    fn finished(&mut self) -> bool {
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
    fn restart(&mut self, posted: PostedInline) {
        debug_assert!(self.is_done());
        if let Some(aw) = self.awaiting.take() {
            aw.disarm(&self.shared.domain.inner.engine);
        }
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

    /// Records a success, running the after-hook first.
    fn succeed(&mut self, c: Completion) {
        self.stage = match self.after.take().map(|hook| hook()) {
            Some(Err(e)) => Stage::Failed(Some(Box::new(e))),
            _ => Stage::Succeeded(c),
        };
    }

    /// Keeps an outcome to report.
    fn absorb(&mut self, outcome: OpOutcome) {
        match outcome {
            Ok(c) => self.succeed(c),
            Err(e) => self.stage = Stage::Failed(Some(e)),
        }
    }

    /// A quiet send's outcome is known: the flush request it posted, if
    /// any, is left to the connection (freed at its completion).
    fn release_flush(&mut self) {
        if let Stage::Quiet(q, Some(id)) = self.stage {
            self.stage = Stage::Quiet(q, None);
            self.shared.transport.orphan(id, Box::new(()));
        }
    }

    /// A post kept at the gate: moves the connection along, and takes the
    /// post's outcome if its turn came.
    #[cold]
    #[inline(never)]
    fn move_deferred(&mut self) -> bool {
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
    fn collect(&mut self) {
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
    fn report(&mut self) -> Option<Result<Completion>> {
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
    fn wait_quiet(&mut self, q: QuietSend, mut flush: Option<OpId>, timeout: Duration) -> Result<Completion> {
        let mut due = Deadline::lazy(timeout, WHAT);
        // Staged operations move only while waiting on a request of one's own.
        let staged = self.staged_in_progress();
        if flush.is_none() {
            flush = self.shared.transport.cover(&q, staged, &mut due)?;
            self.stage = Stage::Quiet(q, flush);
        }
        if let Some(id) = flush {
            if staged {
                self.wait_moving_staged(id, &mut due, timeout)?;
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

    /// [`wait_timeout`](Self::wait_timeout) for a staged operation, one
    /// posted while staged ones are in progress, or one already finished.
    #[inline(never)]
    fn wait_slow(&mut self, timeout: Duration) -> Result<Completion> {
        let mut due = Deadline::lazy(timeout, WHAT);
        if let Stage::Deferred(_) = self.stage {
            self.wait_turn(&mut due, timeout)?;
        }
        if let Stage::InFlight(id) = self.stage {
            self.wait_moving_staged(id, &mut due, timeout)?;
        }
        #[cfg(feature = "cuda")]
        let spin_until = Instant::now() + self.shared.spin;
        #[cfg(feature = "cuda")]
        while let Stage::Staged(p) = &self.stage {
            let (waiting_on, copying) = {
                let p = p.lock().unwrap_or_else(|e| e.into_inner());
                (p.waiting_on(), p.copying())
            };
            let copying = self.progress_staged() | copying;
            self.collect();
            if !matches!(self.stage, Stage::Staged(_)) {
                break;
            }
            // Sleep on the network step, briefly: copies finish meanwhile too.
            self.nap(waiting_on, &mut due, timeout, copying, spin_until)?;
        }
        self.report().unwrap_or(Err(Error::Timeout { what: WHAT, after: timeout }))
    }

    /// Waits for a kept post's turn, moving what holds the gate along.
    fn wait_turn(&mut self, due: &mut Deadline, timeout: Duration) -> Result<()> {
        let spin_until = Instant::now() + self.shared.spin;
        loop {
            let copying = self.move_deferred();
            if !matches!(self.stage, Stage::Deferred(_)) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= due.at_from(now) {
                return Err(Error::Timeout { what: WHAT, after: timeout });
            }
            look_again(copying && now < spin_until);
        }
    }

    /// Records the outcome just taken from the transport and reports it
    /// (an error once, as [`report`](Self::report) does).
    #[inline]
    fn settle(&mut self, outcome: OpOutcome) -> Result<Completion> {
        match outcome {
            Ok(c) if self.after.is_none() => {
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
    fn settle_waited(&mut self, waited: Waited) -> Result<Completion> {
        match waited {
            Ok(c) => self.settle(Ok(c)),
            Err(WaitError::Failed(e)) => self.settle(Err(e)),
            Err(WaitError::Unfinished(e)) => Err(*e),
        }
    }

    /// [`settle`](Self::settle) with an after-hook to run, or an error.
    #[cold]
    #[inline(never)]
    fn settle_slow(&mut self, outcome: OpOutcome) -> Result<Completion> {
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

    /// Waits for a posted request in short slices, moving the connection's
    /// staged operations along in between.
    fn wait_moving_staged(&self, id: OpId, due: &mut Deadline, timeout: Duration) -> Result<()> {
        let spin_until = Instant::now() + self.shared.spin;
        loop {
            let copying = self.progress_staged();
            if self.shared.transport.poll(id)? || self.nap(Some(id), due, timeout, copying, spin_until)? {
                return Ok(());
            }
        }
    }

    /// One short sleep of a wait that also moves staged operations: none
    /// while a copy is in flight before `spin_until` ([`look_again`]), else
    /// on request `id` when there is one (returning whether it finished),
    /// else a moment. [`Error::Timeout`] once `due` has passed.
    fn nap(
        &self,
        id: Option<OpId>,
        due: &mut Deadline,
        timeout: Duration,
        copying: bool,
        spin_until: Instant,
    ) -> Result<bool> {
        let now = Instant::now();
        let deadline = due.at_from(now);
        if now >= deadline {
            return Err(Error::Timeout { what: WHAT, after: timeout });
        }
        if copying && now < spin_until {
            // The caller looks at the copies and at `id` again at once.
            look_again(true);
            return Ok(false);
        }
        let Some(id) = id else {
            look_again(false);
            return Ok(false);
        };
        let mut slice = Deadline::lazy(deadline.min(now + staged_slice(copying)) - now, WHAT);
        match self.shared.transport.wait(id, &mut slice) {
            Ok(()) => Ok(true),
            Err(Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e),
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
    fn poll_moved(&mut self) -> Result<Option<Completion>> {
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
const WHAT: &str = "an operation to complete";

/// How long a wait sleeps on the network before it looks at the staged
/// operations again: briefly while a copy is in flight (no completion will
/// wake it when the copy ends), else up to a millisecond.
fn staged_slice(copying: bool) -> Duration {
    if copying { Duration::from_micros(20) } else { Duration::from_millis(1) }
}

/// The pause of a staged wait between two looks at its copies and its
/// network steps. A copy between the GPU and staging ends unsignalled: no
/// descriptor to sleep on. While `spinning` (a copy in flight, within the
/// connection's [`spin`](crate::ConnectOptions::spin) window) the CPU is
/// only yielded and the caller looks again at once: a 4 KiB copy ends
/// about 8 us after it is queued on an H200, and the shortest sleep costs
/// the timer's slack, 50 us or more (such sleeps were half of a staged
/// 4 KiB message's latency there, 84 us against 42). Else a short sleep.
pub(crate) fn look_again(spinning: bool) {
    if spinning {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

impl<B: Send + 'static> Drop for Pending<B> {
    fn drop(&mut self) {
        if let Some(aw) = self.awaiting.take() {
            aw.disarm(&self.shared.domain.inner.engine);
        }
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
    fn drop_unfinished(&mut self) {
        if let Stage::Deferred(kept) = &self.stage {
            // Never posted: the buffer goes with this value. Posted meanwhile:
            // left with the connection as any operation in flight.
            match self.shared.gate.cancel(kept, &self.shared.transport) {
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
