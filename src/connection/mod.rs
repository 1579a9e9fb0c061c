//! [`Connection`]: the high-level, safe API. Operations take their buffer by
//! value and return a [`Pending`] that gives it back once the device is done.

#![forbid(unsafe_code)]

mod establish;
mod inbox;
mod notes;
mod pending;
mod persistent;
mod ring;
mod transfer;
mod waiting;

pub use crate::options::{ConnectOptions, ConnectionInfo};
pub use establish::{Interrupt, Listener, MAX_CONCURRENT_HANDSHAKES};
pub use inbox::{Inbox, Looking};
pub use notes::{InboxStats, MAX_QUEUED_BYTES, MAX_QUEUED_NOTES, NOTE_OVERHEAD, Note};
pub use pending::Pending;
pub(crate) use pending::Stage;
pub use persistent::{Persistent, PersistentRecv, PersistentSend};
pub use ring::{Received, RecvRing};
pub(crate) use transfer::Direction;
pub use transfer::{Failed, Transfer, Transferred};
pub(crate) use waiting::member;
pub use waiting::{CompletionSet, Finished, SetMember};

use std::fmt;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::deadline::Deadline;
use crate::domain::Domain;
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::memory::LocalParts;
use crate::memory::{Counter, Live};
use crate::memory::{Exposed, LocalBuffer, LocalSlice, Memory, RemoteRegion, RemoteSlice};
use crate::protocol::order::{Gate, What};
use crate::transport::{self, ConnTransport, Posted, PostedInline, RemoteOp, WorkItem};

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
    /// Registered buffers notifications are written into the peer's ring from.
    note_pool: std::sync::Mutex<Vec<crate::Region<crate::HostMemory>>>,
    /// Both notification rings: this side's (an [`Inbox`] reads it) and the peer's.
    notes: Arc<notes::NoteRings>,
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
        let engine = self.engine.get_or_init(|| shared.domain.engine().handle());
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
        let retiring = shared.domain.staging().reap();
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
        shared.domain.engine().timer(Instant::now() + again, std::task::Waker::from(self));
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

    /// Posts `item` once `ready` (the fences of its data) says so: at once
    /// when there is nothing to wait for, else kept in its place at the
    /// gate, nobody blocking on it, and posted by whoever finds it ready.
    #[cfg(feature = "cuda")]
    fn post_when_ready<B: Send + 'static>(
        self: &Arc<Self>,
        buf: B,
        item: WorkItem,
        ready: Option<crate::protocol::order::DataReady>,
    ) -> Pending<B> {
        match ready {
            None => self.post_items(buf, Ok(&[item])),
            Some(ready) => {
                let kept = self.gate.keep_until(What::Send(vec![item]), Instant::now() + self.post_timeout, ready);
                self.driver.ask(self);
                Pending::with(self, buf, Stage::Deferred(kept))
            }
        }
    }

    /// An operation on host memory with fences of its own
    /// ([`LocalSlice::after`]): a send, write or read is kept at the gate
    /// until they are done; a receive waits for them when posted.
    #[cfg(feature = "cuda")]
    #[cold]
    fn host_after<B: LocalBuffer>(
        self: &Arc<Self>,
        local: LocalSlice<B>,
        parts: LocalParts,
        op: Option<RemoteOp>,
    ) -> Pending<B> {
        match op {
            Some(op) => {
                let ready = fences_pending(local.fences());
                self.post_when_ready(local.into_inner(), WorkItem { local: Some(parts), op }, ready)
            }
            None => {
                if let Err(e) = local.wait_fences() {
                    return Pending::failed(self, local.into_inner(), e);
                }
                let posted = self.transport.post_recv(Some(parts));
                self.pending(local.into_inner(), posted)
            }
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

    /// Makes the data of the peer's writes with immediate received so far
    /// visible to CUDA work: called before a receive that took one is
    /// reported. Over verbs, the covers the peer put in the ring (where this
    /// side asked for them: the staged path) are copied in from the mirror,
    /// and the remote writes into this domain's GPU regions on a direct path
    /// are flushed (an immediate names no range: each is flushed). TCP makes
    /// the range visible itself before completing the receive.
    ///
    /// # Errors
    /// A copy or flush failed; a failed cover or a peer that broke the ring
    /// also breaks the connection, naming why.
    pub(crate) fn make_imm_visible(&self) -> Result<()> {
        if self.transport.is_tcp() {
            return Ok(());
        }
        if self.notes.covers_expected() {
            self.take_notes()?;
        }
        #[cfg(feature = "cuda")]
        if self.domain.mem().visible.any() {
            return self.domain.mem().visible.flush_direct();
        }
        Ok(())
    }

    /// Takes what has landed in this side's notification ring: notes are
    /// kept for an [`Inbox`], covers made visible. How many notes.
    ///
    /// # Errors
    /// [`Error::ConnectionLost`] when the ring or a cover broke the
    /// connection (now shut down with the reason).
    pub(crate) fn take_notes(&self) -> Result<usize> {
        let mut side = self.notes.read_side();
        // Whether the connection was lost before looking: then what the
        // ring holds now is all it will ever hold.
        let broken = self.transport.broken();
        match self.notes.drain(&self.transport, &mut side, |cover| self.make_cover_visible(cover)) {
            Ok(n) => {
                if let Some(reason) = broken {
                    side.state.lose(reason);
                }
                Ok(n)
            }
            Err(reason) => {
                tracing::warn!("{reason}");
                self.transport.shutdown(&reason);
                side.state.lose(reason.clone());
                Err(Error::ConnectionLost { reason })
            }
        }
    }

    /// Makes the ranges a notification or cover names visible to CUDA work
    /// where they are GPU memory of this side (copied in from the staged
    /// mirror, or flushed).
    fn make_cover_visible(&self, cover: &crate::protocol::notify::Cover) -> Result<()> {
        #[cfg(feature = "cuda")]
        for &(addr, len) in &cover.ranges {
            self.domain.mem().visible.make_visible(cover.key, addr, len)?;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = cover;
        Ok(())
    }

    fn pending<B: Send + 'static>(self: &Arc<Self>, buf: B, posted: Posted) -> Pending<B> {
        Pending::posted(self, buf, posted)
    }

    /// [`Connection::recv`].
    pub(crate) fn recv<B: LocalBuffer>(self: &Arc<Self>, local: LocalSlice<B>) -> Pending<B> {
        match local.resolve() {
            #[cfg(feature = "cuda")]
            Ok(parts) if parts.path.is_some() => self.gpu(local, parts, None),
            #[cfg(feature = "cuda")]
            Ok(parts) if local.has_own_fences() => self.host_after(local, parts, None),
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
        #[cfg(feature = "cuda")]
        if local.has_own_fences() {
            return self.host_after(local, parts, Some(RemoteOp::Send));
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
        use crate::protocol::{Route, check_staged, route, route_receive};
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
        // A receive whose consumers' fences still run is staged, so that
        // nothing waits for them here (see `route_receive`).
        let fences = local.fences();
        let chosen = match op {
            Some(_) => route(&parts, self.transport.is_tcp()),
            None => route_receive(&parts, self.transport.is_tcp(), !all_done(&fences)),
        };
        if chosen == Route::Staged {
            // The checks a direct post gets, before anything is copied.
            if let Err(e) = check_staged(op, parts.len as u64, self.info.max_message_size) {
                return Pending::failed(self, local.into_inner(), e);
            }
            let (chunk, depth) = self.staging;
            // Started at once: receives must be posted before the peer sends,
            // and copies should run while the caller does other work. Later
            // steps advance whenever the operation is waited on or polled.
            let mut pipeline =
                match Pipeline::new(op, self.domain.staging(), &device, parts, chunk, depth, self.op_timeout) {
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
            pipeline.after(fences);
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
        // behind it. A receive with fences still running went the staged
        // route above (the receive queue has no gate: a receive kept would
        // let later ones take its message); here its fences are done.
        if let Some(op) = op {
            let item = WorkItem { local: Some(parts), op };
            let mut p = self.post_when_ready(local.into_inner(), item, fences_pending(fences));
            if let RemoteOp::Read(_) = op {
                p.after = Some(Box::new(move || device.flush_remote_writes()));
            }
            return p;
        }
        if let Err(e) = local.wait_fences() {
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

/// Whether the work of every one of `fences` is known done (a fence whose
/// work failed is not: the operation that waits for it reports that).
#[cfg(feature = "cuda")]
fn all_done(fences: &[std::sync::Arc<crate::cuda::CudaEvent>]) -> bool {
    fences.iter().all(|f| matches!(f.is_done(), Ok(true)))
}

/// Which of `fences` (an operation's: see
/// [`LocalSlice::fences`](crate::memory::LocalSlice)) still run, as a check
/// a post kept at the gate asks (`None`: all done, post now).
#[cfg(feature = "cuda")]
pub(crate) fn fences_pending(
    fences: Vec<std::sync::Arc<crate::cuda::CudaEvent>>,
) -> Option<crate::protocol::order::DataReady> {
    if all_done(&fences) {
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
/// [`Pending`] that hands it back, with a [`Completion`](crate::Completion), when the device
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
        if opts.advertise.iter().any(|r| r.tag == crate::RING_TAG) {
            return Err(Error::InvalidArgument(format!(
                "region tag {:#x} is reserved for the notification ring",
                crate::RING_TAG
            )));
        }
        let ring = notes::NoteRings::make(domain, opts.notify_ring)?;
        let mut with_ring = opts.clone();
        with_ring.advertise.push(ring.descriptor());
        let est = transport::establish(domain.mem(), stream, &with_ring, is_server)?;
        let notes = Arc::new(notes::NoteRings::new(ring, est.peer_ring, est.covers_in, est.info.recv_queue_depth));
        if est.covers_out {
            notes.cover_out(domain, est.info.send_queue_depth)?;
            est.transport.cover_writes(Box::new(notes::RingCovers(Arc::clone(&notes))));
        }
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
                notes,
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
        #[cfg(feature = "cuda")]
        if local.has_own_fences() {
            return self.shared.host_after(local, parts, Some(op));
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
    ///
    /// A write with immediate into this side's GPU memory is visible to CUDA
    /// work when any receive takes its immediate (this one, a receive with
    /// a buffer, a receive ring's slot): over TCP the written range is
    /// copied from the staging mirror into GPU memory before the receive
    /// completes; over verbs on a direct path the remote writes are flushed
    /// where the device needs it; over verbs into a region on the staged
    /// path the range the writer named in a cover record, put in this
    /// side's notification ring just before its write, is copied in (see
    /// [`ConnectOptions::imm_covers`](crate::ConnectOptions#structfield.imm_covers);
    /// with covers turned off, name the region with
    /// [`recv_write_range`](Self::recv_write_range)).
    ///
    /// Each cover takes 64 bytes of this side's ring until a receive that
    /// took a write with immediate (or an [`Inbox`]) looks at the ring: a
    /// peer with more covered writes in flight than the ring holds waits for
    /// room, within its post timeout.
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

    /// A handle to its domain's engine, to drive work built on it.
    pub(crate) fn engine(&self) -> crate::transport::engine::EngineHandle {
        self.shared.domain.engine().handle()
    }

    /// Breaks the connection for `reason`: tells the peer, and fails what
    /// is outstanding with [`Error::ConnectionLost`] saying why.
    pub(crate) fn shut(&self, reason: &str) {
        self.shared.transport.shutdown(reason);
    }

    /// [`shut`](Self::shut) on a thread of its own: for a caller that must
    /// not wait for it (the engine's thread, which a TCP shutdown could
    /// hold for the moment the sender takes to say goodbye). What is
    /// outstanding fails once it ran.
    pub(crate) fn shut_soon(&self, reason: String) {
        let shared = Arc::clone(&self.shared);
        let shut = move || shared.transport.shutdown(&reason);
        if let Err(e) = std::thread::Builder::new().name("gpu-rdma-shut".into()).spawn(shut) {
            tracing::warn!("no thread to shut a connection on ({e}): shutting it here");
            self.shared.transport.shutdown("a rail was dropped");
        }
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
                    fenced.extend(fences_pending(local.fences()));
                    if op.reads_remote() {
                        flush.push(cuda.device().clone());
                    }
                } else if local.has_own_fences() {
                    fenced.extend(fences_pending(local.fences()));
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
