//! [`ConnShared`]: what a connection's handles share (its transport,
//! limits, gate, staged operations and notification rings), and how one
//! operation is posted: the route chosen once (direct, staged, kept at the
//! gate behind what was posted before it), the fences, and what makes a
//! peer's writes visible.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Pending, Stage, notes};
use crate::deadline::Deadline;
use crate::domain::Domain;
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::memory::LocalParts;
use crate::memory::{Live, LocalBuffer, LocalSlice, RemoteRegion};
use crate::options::ConnectionInfo;
use crate::protocol::context::OpContext;
use crate::protocol::order::{Gate, What};
use crate::transport::{ConnTransport, Posted, PostedInline, RemoteOp, WorkItem};

pub(crate) struct ConnShared {
    pub(super) transport: ConnTransport,
    pub(super) info: ConnectionInfo,
    pub(super) peer_regions: Vec<RemoteRegion>,
    pub(super) op_timeout: Duration,
    /// How long a post waits for room in the send queue.
    pub(super) post_timeout: Duration,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) staging: (usize, usize),
    /// How long a wait looks again at once before sleeping
    /// ([`ConnectOptions::spin`](crate::ConnectOptions::spin)).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) spin: Duration,
    /// What operations need of the domain: registration, staging, the engine.
    pub(super) ctx: Arc<OpContext>,
    /// Registered buffers notifications are written into the peer's ring from.
    pub(super) note_pool: std::sync::Mutex<Vec<crate::Region<crate::HostMemory>>>,
    /// Both notification rings: this side's (an [`Inbox`] reads it) and the peer's.
    pub(super) notes: Arc<notes::NoteRings>,
    /// Staged GPU operations in progress, moved along by every wait.
    #[cfg(feature = "cuda")]
    pub(super) staged: crate::protocol::staged::StagedSet,
    /// The order of this connection's operations ([`crate::protocol::order`]).
    pub(crate) gate: Arc<Gate>,
    /// The receive queue's own gate: a receive kept for its fences (GPU
    /// work still reading its memory) holds the receives posted after it,
    /// so that each message still lands in the receive posted for it.
    pub(crate) recv_gate: Arc<Gate>,
    /// Moves the connection along from the engine while posts wait at the
    /// gate and nobody may be waiting on what holds it.
    pub(super) driver: Arc<ConnDriver>,
    pub(super) _live: Live,
}

/// Moves a connection along on the domain's engine while an operation holds
/// its gate: a staged operation must hand over all its requests whether or
/// not anyone waits on it (a post kept behind it may have no handle at all:
/// an untracked send), and so must what is kept behind it. It also lets go
/// of what dropped staged operations' copies held once they end. Looks
/// again on a short timer (copies end without waking anyone) until the gate
/// is open and no such copy is left.
#[derive(Default)]
pub(super) struct ConnDriver {
    shared: std::sync::OnceLock<std::sync::Weak<ConnShared>>,
    engine: std::sync::OnceLock<crate::transport::engine::EngineHandle>,
    /// Running, or a run is due: asking again changes nothing.
    busy: std::sync::atomic::AtomicBool,
}

impl ConnDriver {
    /// Has the engine drive `shared` soon, unless it already will.
    pub(super) fn ask(self: &Arc<Self>, shared: &Arc<ConnShared>) {
        use std::sync::atomic::Ordering::AcqRel;
        let _ = self.shared.set(Arc::downgrade(shared));
        let engine = self.engine.get_or_init(|| shared.ctx.engine().handle());
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
        let retiring = shared.ctx.staging().reap();
        #[cfg(not(feature = "cuda"))]
        let retiring = false;
        let open = |s: &ConnShared| s.gate.is_open() && s.recv_gate.is_open();
        if open(&shared) && !retiring {
            self.busy.store(false, std::sync::atomic::Ordering::Release);
            // Held since the look above, which asked nothing (busy was set).
            if open(&shared) || self.busy.swap(true, AcqRel) {
                return;
            }
        }
        let again = if copying { LOOK_AGAIN_COPYING } else { LOOK_AGAIN };
        shared.ctx.engine().timer(Instant::now() + again, std::task::Waker::from(self));
    }
}

impl ConnShared {
    /// Makes a connection's shared state over `stream`: its notification
    /// ring, the handshake, and the covers of writes with immediate where
    /// the peer asked for them.
    pub(super) fn establish(
        domain: &Domain,
        stream: std::net::TcpStream,
        opts: &crate::options::ConnectOptions,
        is_server: bool,
    ) -> Result<Arc<Self>> {
        let ring = notes::NoteRings::make(domain, opts.notify_ring)?;
        let mut with_ring = opts.clone();
        with_ring.advertise.push(ring.descriptor());
        let est = crate::transport::establish(domain.mem(), stream, &with_ring, is_server)?;
        let notes = Arc::new(notes::NoteRings::new(ring, est.peer_ring, est.covers_in, est.info.recv_queue_depth));
        if est.covers_in {
            est.transport.count_imm_writes();
        }
        if est.covers_out {
            notes.cover_out(domain.context(), est.info.send_queue_depth)?;
            est.transport.cover_writes(Box::new(notes::RingCovers(Arc::clone(&notes))));
        }
        Ok(Arc::new(ConnShared {
            transport: est.transport,
            info: est.info,
            peer_regions: est.peer_regions,
            op_timeout: opts.op_timeout,
            post_timeout: opts.post_timeout.unwrap_or(opts.op_timeout),
            staging: (opts.staging_chunk, opts.staging_depth),
            spin: opts.spin,
            ctx: Arc::clone(domain.context()),
            note_pool: std::sync::Mutex::new(Vec::new()),
            notes,
            #[cfg(feature = "cuda")]
            staged: crate::protocol::staged::StagedSet::default(),
            gate: Arc::new(Gate::default()),
            recv_gate: Arc::new(Gate::default()),
            driver: Arc::new(ConnDriver::default()),
            _live: domain.context().live(crate::memory::Counter::Connections),
        }))
    }

    pub(super) fn deadline(&self) -> Deadline {
        Deadline::lazy(self.post_timeout, "room in the send queue")
    }

    pub(super) fn post_items<B: Send + 'static>(self: &Arc<Self>, buf: B, items: Result<&[WorkItem]>) -> Pending<B> {
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
    pub(super) fn post_when_ready<B: Send + 'static>(
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
    /// until they are done, a receive at the receive queue's gate.
    #[cfg(feature = "cuda")]
    #[cold]
    pub(super) fn host_after<B: LocalBuffer>(
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
            None => match fences_pending(local.fences()) {
                None => self.post_recv(local.into_inner(), Some(parts)),
                Some(ready) => {
                    // Kept in its place at the receive queue's gate: the
                    // receives posted after it wait behind it, nobody waits
                    // on the fences, and whoever finds them done posts it.
                    let due = Instant::now() + self.post_timeout;
                    let kept = self.recv_gate.keep_until(What::Recv(Some(parts)), due, ready);
                    self.driver.ask(self);
                    Pending::with(self, local.into_inner(), Stage::Deferred(kept))
                }
            },
        }
    }

    /// Posts a receive into `parts` (none: a receive with no buffer), in
    /// its place behind a receive kept for its fences, if there is one.
    #[inline]
    pub(super) fn post_recv<B: Send + 'static>(
        self: &Arc<Self>,
        buf: B,
        parts: Option<crate::memory::LocalParts>,
    ) -> Pending<B> {
        if self.recv_gate.is_open() {
            self.pending(buf, self.transport.post_recv(parts))
        } else {
            self.post_behind(buf, What::Recv(parts))
        }
    }

    /// A post that must wait behind an operation still handing over its
    /// requests: kept at the gate, posted when its turn comes.
    #[cold]
    #[inline(never)]
    pub(super) fn post_behind<B: Send + 'static>(self: &Arc<Self>, buf: B, what: What) -> Pending<B> {
        let gate = if matches!(what, What::Recv(_)) { &self.recv_gate } else { &self.gate };
        match gate.keep(what, Instant::now() + self.post_timeout) {
            Ok(kept) => {
                self.driver.ask(self);
                Pending::with(self, buf, Stage::Deferred(kept))
            }
            // Its turn came meanwhile.
            Err(What::Send(items)) => self.pending(buf, self.transport.post_send(&items, self.deadline())),
            Err(What::Inline { data, imm }) => {
                self.pending(buf, self.transport.post_inline(&data, imm, self.deadline()))
            }
            Err(What::Recv(parts)) => self.pending(buf, self.transport.post_recv(parts)),
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
        if !self.gate.is_open() || !self.recv_gate.is_open() {
            let _ = self.transport.progress();
            self.gate.pump(&self.transport);
            self.recv_gate.pump(&self.transport);
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
        if self.ctx.mem().visible.any() {
            return self.ctx.mem().visible.flush_direct();
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
            self.ctx.mem().visible.make_visible(cover.key, addr, len)?;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = cover;
        Ok(())
    }

    pub(super) fn pending<B: Send + 'static>(self: &Arc<Self>, buf: B, posted: Posted) -> Pending<B> {
        Pending::posted(self, buf, posted)
    }

    /// [`Connection::recv`].
    pub(crate) fn recv<B: LocalBuffer>(self: &Arc<Self>, local: LocalSlice<B>) -> Pending<B> {
        match local.resolve() {
            #[cfg(feature = "cuda")]
            Ok(parts) if parts.path.is_some() => self.gpu(local, parts, None),
            #[cfg(feature = "cuda")]
            Ok(parts) if local.has_own_fences() => self.host_after(local, parts, None),
            Ok(parts) => self.post_recv(local.into_inner(), Some(parts)),
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
    pub(super) fn gpu<B: LocalBuffer>(
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
                match Pipeline::new(op, self.ctx.staging(), &device, parts, chunk, depth, self.op_timeout) {
                    // Sends, writes and reads in their turn at the send
                    // queue's gate, a receive at the receive queue's.
                    Ok(p) => p.in_turn(if op.is_some() { &self.gate } else { &self.recv_gate }),
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
        // route above (its copy into the GPU waits for them); here its
        // fences are done.
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
                let mut p = self.post_recv(local.into_inner(), Some(parts));
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
