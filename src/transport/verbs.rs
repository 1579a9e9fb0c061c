//! The verbs transport: one RC queue pair per connection, one completion
//! queue with a completion channel, and the handshake's TCP socket kept
//! open to notice a peer that closes or dies.

use parking_lot::{Mutex, MutexGuard};
use std::hash::{BuildHasher, Hasher};
use std::net::TcpStream;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::queue::{Limits, Posted, PostedInline, QueueCore, QuietSend, RemoteOp, Sleepers, WorkItem};
use crate::bootstrap::{self, VerbsEndpoint};
use crate::completion::{Completion, Opcode};
use crate::deadline::{Deadline, polls_per_clock_read};
use crate::error::{Error, Result};
use crate::memory::domain::Nic;
use crate::memory::{Access, LocalParts};
use crate::ops::{OpId, OpOutcome, RawCompletion, WaitError, Waited, quiet_wr_id, waited};
use crate::options::{ConnectOptions, ConnectionInfo, Transport};
use crate::poll::{self, Bell};
use crate::verbs::{
    self, CompletionChannel, CompletionQueue, LinkLayer, Mtu, PortAttr, QpCaps, QpState, QueuePair, QueuePairBuilder,
    RecvWr, RtrAttr, RtsAttr, SendOp, SendWr, Sge, WcOpcode, WorkCompletion,
};

/// The request for `op` at byte `off` of its remote range (a chunk of a
/// split write or read; sends and writes with immediate are one message).
fn send_op(op: RemoteOp, off: u64) -> SendOp {
    match op {
        RemoteOp::Send => SendOp::Send,
        RemoteOp::SendWithImm(imm) => SendOp::SendWithImm(imm),
        RemoteOp::Write(r) => SendOp::Write { remote_addr: r.addr() + off, rkey: r.rkey() },
        RemoteOp::WriteWithImm(r, imm) => SendOp::WriteWithImm { remote_addr: r.addr(), rkey: r.rkey(), imm },
        RemoteOp::Read(r) => SendOp::Read { remote_addr: r.addr() + off, rkey: r.rkey() },
    }
}

/// The connection broke: a work request failed (the queue pair is in the
/// error state).
#[cold]
#[inline(never)]
fn lose_after(q: &mut QueueCore, status: crate::completion::WcStatus) {
    q.lose(|| format!("the queue pair went to the error state after a work request failed with {status}"));
}

/// A polled completion as the queue core takes it.
#[inline]
fn raw_completion(wc: &WorkCompletion) -> RawCompletion {
    RawCompletion {
        wr_id: wc.wr_id,
        status: wc.status,
        byte_len: wc.byte_len,
        imm: wc.imm,
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
        by_write_imm: wc.opcode == WcOpcode::RecvRdmaWithImm,
    }
}

fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id()));
    (h.finish() as u32) & 0x00ff_ffff
}

/// What one poll of the completion queue reads at most.
const POLL_BATCH: usize = CompletionQueue::POLL_EACH_MAX;

struct VerbsState {
    // Declared first: dropped (destroyed) before the table's orphaned buffers.
    qp: Option<QueuePair>,
    /// Operations, credits, the lost state.
    q: QueueCore,
    /// The peer closed or died at this instant; the queue pair is moved to
    /// the error state after a short grace, so completions already on their
    /// way are still reported.
    peer_gone: Option<Instant>,
    /// Threads asleep in a wait, woken by the bell when another thread
    /// changes the queue under them.
    sleepers: Sleepers,
    sges: Vec<Sge>,
    scratch: Vec<(SendOp, usize, bool)>,
}

/// One connection's verbs resources.
pub(crate) struct VerbsConn {
    state: Mutex<VerbsState>,
    cq: CompletionQueue,
    socket: TcpStream,
    max_inline: u32,
    spin: Duration,
    /// Polls of a busy wait between two clock reads (for this `spin`).
    polls_per_read: u32,
    /// Watched by the domain's progress engine.
    watched: std::sync::atomic::AtomicBool,
    /// The queue core's [`succeeded_mark`](QueueCore::succeeded_mark): a
    /// quiet send placed below it succeeded and the device is done with its
    /// buffer, which a look at this tells without the lock.
    succeeded_below: Arc<AtomicU64>,
    /// The queue pair's number, for those quiet sends' completions.
    qp_num: u32,
    /// Rung to wake the sleepers (made at the first sleep; `None` if no
    /// descriptor was left for it: then sleeps are cut short instead).
    bell: OnceLock<Option<Bell>>,
    /// Tells a tokio task watching this connection that it is closing.
    #[cfg(feature = "tokio")]
    closing: std::sync::Arc<tokio::sync::Notify>,
    /// What covers this side's writes with immediate, where the peer asked
    /// for covers ([`super::covers`]).
    covers: OnceLock<Box<dyn super::covers::ImmCovers>>,
    /// Writes with immediate received successfully, in arrival order
    /// (counted as their completions are polled, under the state's lock).
    imm_writes: AtomicU64,
}

const PEER_GRACE: Duration = Duration::from_millis(50);

/// How long a side that closes first keeps its queue pair up for the
/// peer's requests in flight to be acknowledged (see [`VerbsConn::close`]).
/// Far longer than an acknowledgement takes; the peer closing ends it sooner.
const LINGER: Duration = Duration::from_millis(5);
/// How often a spinning wait looks at the peer's socket.
const PEER_LOOK: Duration = Duration::from_millis(1);
/// The longest a wait sleeps at once without a bell to wake it.
const UNBELLED_SLEEP: Duration = Duration::from_millis(20);

/// A queue pair made and moved to INIT before the hellos are exchanged: its
/// number goes into this side's hello.
pub(crate) struct Prepared {
    qp: QueuePair,
    cq: CompletionQueue,
    psn: u32,
    responder_resources: u8,
    port: PortAttr,
    gid_index: u32,
    gid: verbs::Gid,
    max_init_rd_atom: u32,
}

impl Prepared {
    pub(crate) fn new(vd: &Nic, opts: &ConnectOptions) -> Result<Self> {
        let channel = CompletionChannel::new(&vd.ctx)?;
        let cq = CompletionQueue::new(&vd.ctx, opts.send_queue_depth + opts.recv_queue_depth, Some(&channel))?;
        let mut qp = QueuePairBuilder::new(&vd.pd, &cq, &cq)
            .caps(QpCaps {
                max_send_wr: opts.send_queue_depth,
                max_recv_wr: opts.recv_queue_depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: opts.max_inline,
            })
            .build()?;
        qp.init(vd.port.port, Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)?;
        Ok(Prepared {
            qp,
            cq,
            psn: random_psn(),
            // As many of the peer's reads and atomics in flight as the
            // device takes (perftest's default too): a bandwidth-bound
            // reader is held back by the fewer of the two sides' limits.
            responder_resources: u8::try_from(vd.device.max_qp_rd_atom).unwrap_or(u8::MAX),
            port: vd.port,
            gid_index: vd.gid.entry.index,
            gid: vd.gid.entry.gid,
            max_init_rd_atom: vd.device.max_qp_init_rd_atom,
        })
    }

    /// This side's endpoint, for the hello.
    pub(crate) fn endpoint(&self) -> VerbsEndpoint {
        VerbsEndpoint {
            qp_num: self.qp.qp_num(),
            psn: self.psn,
            max_msg_sz: self.port.max_msg_sz,
            lid: self.port.lid,
            mtu: self.port.active_mtu.to_raw() as u8,
            link_layer: self.port.link_layer.to_raw(),
            responder_resources: self.responder_resources,
            gid: self.gid.raw(),
        }
    }

    /// Connects the queue pair to the peer's (RTR, RTS) and exchanges ready.
    pub(crate) fn finish(
        self,
        domain_id: u64,
        stream: TcpStream,
        theirs: &VerbsEndpoint,
        opts: &ConnectOptions,
        deadline: Deadline,
    ) -> Result<(VerbsConn, ConnectionInfo)> {
        let Prepared { mut qp, cq, psn, responder_resources, port, gid_index, gid: _, max_init_rd_atom } = self;
        let peer_addr = stream.peer_addr().ok();
        let their_mtu = Mtu::from_raw(u32::from(theirs.mtu)).unwrap_or(Mtu::Mtu256);
        let path_mtu = port.active_mtu.min(their_mtu);
        let is_global = port.link_layer != LinkLayer::InfiniBand;
        let rtr = RtrAttr {
            port: port.port,
            path_mtu,
            dest_qp_num: theirs.qp_num,
            rq_psn: theirs.psn,
            max_dest_rd_atomic: responder_resources,
            min_rnr_timer: opts.min_rnr_timer,
            dest_lid: theirs.lid,
            dest_gid: verbs::Gid(theirs.gid),
            is_global,
            sgid_index: u8::try_from(gid_index)
                .map_err(|_| Error::InvalidArgument(format!("GID index {gid_index} does not fit sgid_index")))?,
            hop_limit: 64,
            traffic_class: opts.traffic_class,
            service_level: opts.service_level,
        };
        if let Err(e) = qp.ready_to_receive(&rtr) {
            bootstrap::send_reject(&stream, &e.to_string());
            return Err(e);
        }
        // At least one: with none, this side could post no read at all; a
        // peer that offers none refuses a read instead, a typed error here.
        let reads_in_flight = max_init_rd_atom.min(u32::from(theirs.responder_resources)).max(1) as u8;
        let rts = RtsAttr {
            sq_psn: psn,
            timeout: opts.ack_timeout,
            retry_cnt: opts.retry_count,
            rnr_retry: opts.rnr_retry,
            max_rd_atomic: reads_in_flight,
        };
        if let Err(e) = qp.ready_to_send(&rts) {
            bootstrap::send_reject(&stream, &e.to_string());
            return Err(e);
        }
        bootstrap::exchange_ready(&stream, deadline)?;
        stream.set_nonblocking(true)?;

        let caps = qp.caps();
        let max_message = u64::from(port.max_msg_sz.min(theirs.max_msg_sz)).max(1);
        let info = ConnectionInfo {
            peer_name: Vec::new(),
            transport: Transport::Verbs,
            transport_reason: String::new(),
            peer_addr,
            local_qp_num: qp.qp_num(),
            remote_qp_num: theirs.qp_num,
            mtu: path_mtu.bytes(),
            max_message_size: max_message,
            max_inline: caps.max_inline_data,
            send_queue_depth: caps.max_send_wr,
            recv_queue_depth: caps.max_recv_wr,
            reads_in_flight: u32::from(reads_in_flight),
            memory_bound: None,
        };
        tracing::debug!(?info, "verbs connection established");
        let q = QueueCore::new(Limits {
            domain_id,
            send_depth: caps.max_send_wr,
            recv_depth: caps.max_recv_wr,
            max_message,
            qp_num: info.local_qp_num,
        });
        let succeeded_below = q.succeeded_mark();
        let conn = VerbsConn {
            state: Mutex::new(VerbsState {
                qp: Some(qp),
                q,
                peer_gone: None,
                sleepers: Sleepers::default(),
                sges: Vec::with_capacity(64),
                scratch: Vec::with_capacity(64),
            }),
            cq,
            socket: stream,
            max_inline: caps.max_inline_data,
            spin: opts.spin,
            polls_per_read: polls_per_clock_read(opts.spin),
            watched: std::sync::atomic::AtomicBool::new(false),
            succeeded_below,
            qp_num: info.local_qp_num,
            bell: OnceLock::new(),
            #[cfg(feature = "tokio")]
            closing: Default::default(),
            covers: OnceLock::new(),
            imm_writes: AtomicU64::new(0),
        };
        Ok((conn, info))
    }
}

/// The connection's state, locked. Unlocking it rings the bell when the
/// queue changed under threads asleep in a wait (see [`Sleepers`]): one
/// comparison when nobody sleeps.
struct Locked<'a> {
    st: MutexGuard<'a, VerbsState>,
    bell: &'a OnceLock<Option<Bell>>,
}

impl Deref for Locked<'_> {
    type Target = VerbsState;

    fn deref(&self) -> &VerbsState {
        &self.st
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut VerbsState {
        &mut self.st
    }
}

impl Drop for Locked<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        let st = &mut *self.st;
        if st.sleepers.must_ring(st.q.changes()) {
            // Still locked: a sleeper gets up (and may drain) only after this.
            if let Some(Some(bell)) = self.bell.get() {
                bell.ring();
            }
        }
    }
}

impl VerbsState {
    /// Moves the queue pair to the error state (once): everything
    /// outstanding completes, flushed.
    fn fail_qp(&mut self) {
        if let Some(qp) = self.qp.as_mut() {
            if qp.state() != QpState::Error {
                if let Err(e) = qp.set_error() {
                    tracing::warn!("moving the queue pair to the error state: {e}");
                }
            }
        }
    }

    /// When the grace after the peer left ends, if it has not yet.
    fn grace_end(&self) -> Option<Instant> {
        self.peer_gone.map(|at| at + PEER_GRACE)
    }
}

impl VerbsConn {
    #[inline(always)]
    fn lock(&self) -> Locked<'_> {
        // Not poisoned by a panic while held: a panic cannot leave the table
        // half-updated in a way that breaks memory safety; keep going.
        Locked { st: self.state.lock(), bell: &self.bell }
    }

    /// The bell, made on first use; `None` if it could not be.
    fn bell(&self) -> Option<&Bell> {
        self.bell
            .get_or_init(|| {
                Bell::new()
                    .inspect_err(|e| {
                        tracing::warn!("no eventfd for a waiting thread's bell ({e}): sleeps are cut short")
                    })
                    .ok()
            })
            .as_ref()
    }

    /// Polls the completion queue once and records what it finds.
    fn progress(&self, st: &mut VerbsState) -> Result<usize> {
        self.progress_for(st, None, &mut None)
    }

    /// [`progress`](Self::progress) for a waiter of `want`: its successful
    /// final completion, if this poll finds it, is put in `taken` (which
    /// must be `None`) rather than recorded to be taken (see
    /// [`QueueCore::complete_taking`]); the other completions are recorded
    /// as usual. How many it read.
    ///
    /// `taken` is the waiter's own: the completion is written once, where
    /// the waiter reads it, not returned and copied at each level on the
    /// way from a poll to the next post.
    #[inline(always)]
    fn progress_for(&self, st: &mut VerbsState, want: Option<OpId>, taken: &mut Option<Completion>) -> Result<usize> {
        let q = &mut st.q;
        let n = self.cq.poll_each(|wc| {
            let raw = raw_completion(&wc);
            if raw.by_write_imm && wc.status.is_success() {
                self.imm_writes.fetch_add(1, Ordering::Release);
            }
            if let Some(id) = want.filter(|_| taken.is_none()) {
                if let Some(c) = q.complete_taking(&raw, id) {
                    *taken = Some(c);
                    return;
                }
            }
            if !wc.status.is_success() {
                lose_after(q, wc.status);
            }
            // The device is done with an orphan's memory: its final request completed.
            drop(q.complete(&raw));
        })?;
        self.check_grace(st);
        Ok(n)
    }

    fn check_grace(&self, st: &mut VerbsState) {
        if let Some(at) = st.peer_gone {
            if at.elapsed() >= PEER_GRACE {
                st.peer_gone = None;
                st.fail_qp();
            }
        }
    }

    /// Looks at the socket after poll(2) said it is readable: the peer said
    /// bye, closed, or died.
    fn check_peer(&self, st: &mut VerbsState) {
        if st.q.lost().is_some() {
            return;
        }
        let mut byte = [0u8; 1];
        let reason = match self.socket.peek(&mut byte) {
            Ok(0) => "the peer closed the connection (its process exited or dropped the connection)",
            Ok(_) => "the peer closed the connection (it said bye)",
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(_) => "the connection to the peer was reset",
        };
        tracing::info!("{reason}");
        st.q.lose(|| reason.to_owned());
        st.peer_gone = Some(Instant::now());
    }

    /// Waits, driving progress, until `ready` holds or the deadline passes.
    fn wait_until(&self, due: &mut Deadline, mut ready: impl FnMut(&mut VerbsState) -> bool) -> Result<bool> {
        let seen;
        // Most waits end at the first poll.
        {
            let mut st = self.lock();
            self.progress(&mut st)?;
            if ready(&mut st) {
                return Ok(true);
            }
            seen = st.q.changes();
        }
        self.wait_until_spin(due, seen, ready)
    }

    /// [`wait_until`](Self::wait_until)'s spin in a frame of its own, out
    /// of the posts and waits that inline `wait_until`.
    #[inline(never)]
    fn wait_until_spin(
        &self,
        due: &mut Deadline,
        seen: u64,
        ready: impl FnMut(&mut VerbsState) -> bool,
    ) -> Result<bool> {
        self.wait_until_slow(due, None, &mut None, Some(seen), ready)
    }

    /// [`wait_until`](Self::wait_until) past its first poll: spinning, then
    /// sleeping on the completion channel, the peer's socket and the bell
    /// (rung when another thread changed the queue: reaped a completion,
    /// and perhaps took the channel's event with it, after this one looked).
    /// A sleep lasts until one of those or the deadline.
    ///
    /// With `want`, a poll that finds that operation's successful final
    /// completion puts it in `taken` and ends the wait (`Ok(true)`), as
    /// [`progress_for`](Self::progress_for) hands it over.
    ///
    /// `seen`: the queue's change count when the caller, under the lock,
    /// polled and found `ready` false; the spin starts after that poll, and
    /// `ready` is asked again only once the queue changed since. `None`
    /// polls and asks at once.
    ///
    /// Inlined into the one frame that waits ([`wait_take_slow`](Self::wait_take_slow),
    /// [`wait_until_spin`](Self::wait_until_spin), [`wait_quiet`](Self::wait_quiet)):
    /// a found completion comes back through one return fewer.
    #[inline]
    fn wait_until_slow(
        &self,
        due: &mut Deadline,
        want: Option<OpId>,
        taken: &mut Option<Completion>,
        seen: Option<u64>,
        mut ready: impl FnMut(&mut VerbsState) -> bool,
    ) -> Result<bool> {
        // Both fixed at the first clock read, not before: a wait that ends
        // within `polls_per_read` polls never reads the clock.
        let mut spin_until: Option<Instant> = None;
        let mut peer_look: Option<Instant> = None;
        let polls_per_read = self.polls_per_read;
        let mut polls_to_read = polls_per_read;
        // `ready` is asked again only when the queue changed since it last
        // said no: an empty poll costs the poll alone.
        let mut seen = seen;
        // A caller that passed `seen` polled just before this: the spin's
        // first step starts after that poll, not with another.
        let mut polled = seen.is_some();
        loop {
            let grace_end = {
                let mut st = self.lock();
                if !std::mem::replace(&mut polled, false) {
                    self.progress_for(&mut st, want, taken)?;
                    if taken.is_some() {
                        return Ok(true);
                    }
                }
                let changes = Some(st.q.changes());
                if seen != changes {
                    if ready(&mut st) {
                        return Ok(true);
                    }
                    seen = changes;
                }
                st.grace_end()
            };
            // Reading the clock is not free everywhere (a system call and an
            // emulated timer read on machines without a usable TSC): while
            // spinning, look at it only every `polls_per_read` polls. No
            // PAUSE hint between polls, as perftest and UCX poll: the poll
            // is the spin, and an emulated CPU (QEMU's TCG) leaves its
            // translated code at every PAUSE to let another CPU run, which
            // costs the wait microseconds.
            //
            // Once the peer has left, nothing but the flushes at the end of
            // its grace can still complete: sleep until then, not spin.
            if !self.spin.is_zero() && grace_end.is_none() {
                polls_to_read -= 1;
                if polls_to_read != 0 {
                    continue;
                }
                polls_to_read = polls_per_read;
            }
            let now = Instant::now();
            let deadline = due.at_from(now);
            if now >= deadline {
                return Ok(false);
            }
            if grace_end.is_none() && now < *spin_until.get_or_insert(now + self.spin) {
                // A long spin still notices a peer that closed or died (a
                // sleeping wait watches its socket): its requests would
                // otherwise never be answered.
                if now >= *peer_look.get_or_insert(now + PEER_LOOK) {
                    peer_look = Some(now + PEER_LOOK);
                    self.check_peer(&mut self.lock());
                }
                continue;
            }
            self.cq.req_notify(false)?;
            let (watch_peer, asleep) = {
                let mut st = self.lock();
                // Polled empty after arming: a completion already queued
                // raises no event.
                loop {
                    let n = self.progress_for(&mut st, want, taken)?;
                    if taken.is_some() {
                        return Ok(true);
                    }
                    if ready(&mut st) {
                        return Ok(true);
                    }
                    if n < POLL_BATCH {
                        break;
                    }
                }
                let changes = st.q.changes();
                let asleep = self.bell().map(|bell| (bell, st.sleepers.lie_down(changes)));
                (st.q.lost().is_none(), asleep)
            };
            // Woken at the grace's end at the latest, to flush the queue pair.
            let wake = grace_end.map_or(deadline, |g| g.min(deadline));
            let mut slice = wake.saturating_duration_since(Instant::now());
            if asleep.is_none() {
                // Nothing would wake this thread when another reaps its
                // completion: look again soon.
                slice = slice.min(UNBELLED_SLEEP);
            }
            #[cfg(test)]
            if let Some(hook) = tests::BEFORE_SLEEP.take() {
                hook(self);
            }
            let chan = self.cq.channel().map(AsFd::as_fd);
            let socket = watch_peer.then(|| self.socket.as_fd());
            let slept = poll::readable_of([chan, socket, asleep.map(|(bell, _)| bell.as_fd())], slice);
            if matches!(slept, Ok([true, _, _])) {
                self.cq.try_take_event();
            }
            // Up again (also when poll(2) failed), and the peer looked at,
            // under one lock.
            let peer = matches!(slept, Ok([_, true, _]));
            if asleep.is_some() || peer {
                let mut st = self.lock();
                if let Some((bell, ticket)) = asleep {
                    if st.sleepers.get_up(ticket) {
                        bell.drain();
                    }
                }
                if peer {
                    self.check_peer(&mut st);
                }
            }
            slept.map_err(|source| Error::Verbs { op: "poll(completion channel)", source })?;
        }
    }

    pub(crate) fn wait_done(&self, id: OpId, due: &mut Deadline) -> Result<()> {
        if self.lock().q.is_done(id) || self.wait_until(due, |st| st.q.is_done(id))? {
            Ok(())
        } else {
            Err(due.expired())
        }
    }

    /// Drives progress until `id` is done, then takes its outcome (one
    /// lock for the check and the take). [`WaitError::Unfinished`] when the
    /// deadline passed first (the operation is still in flight) or polling
    /// failed.
    #[inline(always)]
    pub(crate) fn wait_take(&self, id: OpId, due: &mut Deadline) -> Waited {
        let seen;
        {
            // Taken already reaped, or reaped by one poll: one lock either way.
            let mut st = self.lock();
            if let Some(outcome) = st.q.take(id) {
                return waited(outcome);
            }
            // Its success, found by this poll, comes straight back.
            let mut taken = None;
            if let Err(e) = self.progress_for(&mut st, Some(id), &mut taken) {
                return Err(WaitError::unfinished(e));
            }
            if let Some(c) = taken {
                return Ok(c);
            }
            if let Some(outcome) = st.q.take(id) {
                return waited(outcome);
            }
            seen = st.q.changes();
        }
        self.wait_take_slow(id, due, seen)
    }

    /// [`wait_take`](Self::wait_take) past its first poll, which found
    /// nothing to take with the queue at change count `seen`.
    #[inline(never)]
    fn wait_take_slow(&self, id: OpId, due: &mut Deadline, seen: u64) -> Waited {
        self.wait_outcome(due, Some(id), Some(seen), |st| st.q.take(id))
    }

    /// Waits, driving progress, until `outcome` gives one (it is asked
    /// after every poll), or the deadline passes ([`WaitError::Unfinished`]).
    /// With `want` (the operation `outcome` takes), its success comes
    /// straight from the poll that finds it. `seen`: as for
    /// [`wait_until_slow`](Self::wait_until_slow).
    #[inline(always)]
    fn wait_outcome(
        &self,
        due: &mut Deadline,
        want: Option<OpId>,
        seen: Option<u64>,
        mut outcome: impl FnMut(&mut VerbsState) -> Option<OpOutcome>,
    ) -> Waited {
        let mut found = None;
        let mut taken = None;
        match self.wait_until_slow(due, want, &mut taken, seen, |st| {
            found = outcome(st);
            found.is_some()
        }) {
            Ok(_) => match taken {
                Some(c) => Ok(c),
                None => found.map_or_else(|| Err(WaitError::unfinished(due.expired())), waited),
            },
            Err(e) => Err(WaitError::unfinished(e)),
        }
    }

    /// Polls once (unless `id` was already reaped) and takes its outcome if
    /// it is done.
    pub(crate) fn poll_take(&self, id: OpId) -> Result<Option<OpOutcome>> {
        let mut st = self.lock();
        if let Some(outcome) = st.q.take(id) {
            return Ok(Some(outcome));
        }
        self.progress(&mut st)?;
        Ok(st.q.take(id))
    }

    /// Takes `id`'s outcome if it is done (polling once), else registers
    /// `waker` for its completion. The caller has the engine watch this
    /// connection, so the completion is seen without anyone waiting.
    pub(crate) fn poll_register(&self, id: OpId, waker: &std::task::Waker) -> Result<Option<OpOutcome>> {
        let mut st = self.lock();
        if let Some(outcome) = st.q.take(id) {
            return Ok(Some(outcome));
        }
        self.progress(&mut st)?;
        Ok(st.q.take_or_register(id, waker))
    }

    /// [`QueueCore::done_or_register`](super::queue::QueueCore::done_or_register),
    /// after reaping what the completion queue holds.
    #[cfg(feature = "cuda")]
    pub(crate) fn done_or_register(&self, id: OpId, waker: &std::task::Waker) -> Result<bool> {
        let mut st = self.lock();
        if st.q.is_done(id) {
            return Ok(true);
        }
        self.progress(&mut st)?;
        Ok(st.q.done_or_register(id, waker))
    }

    /// What a tokio task watching this connection waits on to let go.
    #[cfg(feature = "tokio")]
    pub(crate) fn closing(&self) -> std::sync::Arc<tokio::sync::Notify> {
        std::sync::Arc::clone(&self.closing)
    }

    /// Marks this connection watched by the engine; whether it was not yet.
    pub(crate) fn mark_watched(&self) -> bool {
        use std::sync::atomic::Ordering;
        // A load first: every registration asks, and all but the first find it set.
        !self.watched.load(Ordering::Acquire) && !self.watched.swap(true, Ordering::AcqRel)
    }

    /// The completion channel's descriptor.
    pub(crate) fn channel_fd(&self) -> Option<std::os::fd::RawFd> {
        self.cq.channel().map(verbs::CompletionChannel::fd)
    }

    /// The peer's socket's descriptor.
    pub(crate) fn socket_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.socket.as_raw_fd()
    }

    /// The engine saw the channel (`event`) or the socket (`peer`) readable,
    /// or sweeps: takes the event, re-arms the queue, polls it empty (which
    /// wakes the operations that finished) and looks at the peer.
    pub(crate) fn engine_progress(&self, event: bool, peer: bool) {
        if event {
            // Every event there is: a watcher woken by an edge sees no
            // second edge for events already queued.
            while self.cq.try_take_event() {}
        }
        if let Err(e) = self.cq.req_notify(false) {
            tracing::warn!("arming the completion queue: {e}");
        }
        let mut st = self.lock();
        while let Ok(POLL_BATCH) = self.progress(&mut st) {}
        if peer {
            self.check_peer(&mut st);
        }
    }

    pub(crate) fn poll_done(&self, id: OpId) -> Result<bool> {
        let mut st = self.lock();
        // Often already reaped while waiting for something else: then the
        // completion queue need not be polled again.
        if st.q.is_done(id) {
            return Ok(true);
        }
        self.progress(&mut st)?;
        Ok(st.q.is_done(id))
    }

    pub(crate) fn progress_now(&self) -> Result<usize> {
        let mut st = self.lock();
        self.progress(&mut st)
    }

    pub(crate) fn take(&self, id: OpId) -> Option<OpOutcome> {
        self.lock().q.take(id)
    }

    pub(crate) fn orphan(&self, id: OpId, buffer: Box<dyn std::any::Any + Send>) {
        let released = self.lock().q.orphan(id, buffer);
        // Dropped outside the lock: deregistering can take a while.
        drop(released);
    }

    pub(crate) fn broken(&self) -> Option<String> {
        let mut st = self.lock();
        let _ = self.progress(&mut st);
        if st.q.lost().is_none() {
            self.check_peer(&mut st);
        }
        st.q.lost().map(str::to_owned)
    }

    pub(crate) fn stats(&self) -> (usize, usize) {
        let st = self.lock();
        st.q.stats()
    }

    /// Breaks this side off: says bye, then moves the queue pair to the
    /// error state so everything outstanding completes (flushed).
    pub(crate) fn shutdown(&self, reason: &str) {
        self.end(reason, false);
    }

    /// Closes this side (its handle was dropped): as
    /// [`shutdown`](Self::shutdown), but when this side closes first the
    /// queue pair stays up after the bye until the peer closes too, for at
    /// most [`LINGER`]. The device still acknowledges what the peer sent
    /// last: a peer waiting for its final send's completion learns that
    /// it arrived, rather than seeing it fail once the connection is gone.
    pub(crate) fn close(&self, reason: &str) {
        self.end(reason, true);
    }

    fn end(&self, reason: &str, linger: bool) {
        // A tokio task watching the completion channel lets go of it (a
        // permit is kept if it is not waiting right now).
        #[cfg(feature = "tokio")]
        self.closing.notify_one();
        let first = {
            let mut st = self.lock();
            let first = st.q.lost().is_none();
            if first {
                bootstrap::send_bye(&self.socket);
                st.q.lose(|| reason.to_owned());
            }
            first
        };
        if first && linger {
            // Unlocked: the peer's bye, its close (both make the socket
            // readable) or LINGER, whichever comes first. Best effort: a
            // failed or interrupted poll ends the linger early.
            let _ = crate::poll::readable([self.socket.as_fd()], LINGER);
        }
        self.lock().fail_qp();
    }

    /// Splits the items into send-queue requests, checking each; returns
    /// the bytes they move.
    fn plan(
        &self,
        q: &QueueCore,
        items: &[WorkItem],
        scratch: &mut Vec<(SendOp, usize, bool)>,
        sges: &mut Vec<Sge>,
    ) -> Result<u64> {
        scratch.clear();
        sges.clear();
        let max_message = q.limits().max_message;
        let mut bytes = 0;
        for item in items {
            let len = q.check_item(item)?;
            bytes += len;
            let (addr, lkey) = item.local.as_ref().map_or((0, 0), |l| (l.addr, l.lkey));
            // Writes and reads longer than a message are split; the rest is
            // one message (`check_item` held them to the limit).
            let chunks = match item.op {
                RemoteOp::Write(_) | RemoteOp::Read(_) => len.div_ceil(max_message).max(1),
                RemoteOp::Send | RemoteOp::SendWithImm(_) | RemoteOp::WriteWithImm(..) => 1,
            };
            for c in 0..chunks {
                let off = c * max_message;
                let n = (len - off).min(max_message);
                let op = send_op(item.op, off);
                let inline = self.goes_inline(item.local.as_ref(), n, op);
                if n > 0 {
                    scratch.push((op, sges.len(), inline));
                    sges.push(Sge::new(addr + off, n as u32, lkey));
                } else {
                    scratch.push((op, usize::MAX, false));
                }
            }
        }
        Ok(bytes)
    }

    /// Waits until `n` send-queue requests fit (driving progress), up to `due`.
    #[inline(always)]
    fn send_room<'a>(&'a self, st: Locked<'a>, n: u32, due: &mut Deadline) -> Result<Locked<'a>> {
        if st.q.send_room(n)? {
            return Ok(st);
        }
        self.send_room_slow(st, n, due)
    }

    /// [`send_room`](Self::send_room) when the queue is full: waits for completions.
    #[inline(never)]
    fn send_room_slow<'a>(&'a self, mut st: Locked<'a>, n: u32, due: &mut Deadline) -> Result<Locked<'a>> {
        loop {
            if st.q.send_room(n)? {
                return Ok(st);
            }
            if st.q.quiet_waiting() > 0 && st.q.send_room(1)? {
                // Quiet sends hold credits that only a signaled request
                // brings back: post one, or the wait could be for nothing.
                self.post_flush(&mut st)?;
                continue;
            }
            if due.is_immediate() {
                // A try-post: one look at the completions, no waiting.
                self.progress(&mut st)?;
                return if st.q.send_room(n)? { Ok(st) } else { Err(st.q.send_full()) };
            }
            drop(st);
            let room = |s: &mut VerbsState| s.q.send_room(n).unwrap_or(true);
            if !self.wait_until(due, room)? {
                return Err(self.lock().q.send_full());
            }
            st = self.lock();
        }
    }

    /// Whether `n` bytes of `item`'s buffer go inline as request `op`.
    /// Inline data is copied by the CPU at post time (the provider memcpy's
    /// from the address): only host memory may go inline (GPU memory is never
    /// CPU-readable through its device address), and never a read's
    /// destination.
    fn goes_inline(&self, local: Option<&LocalParts>, n: u64, op: SendOp) -> bool {
        let cpu_readable = local.is_none_or(|l| l.path.is_none());
        cpu_readable && n > 0 && n <= u64::from(self.max_inline) && !op.writes_local()
    }

    /// One operation of one message (the common case): checked and posted
    /// as a single request built on the stack, with no plan. `None` when it
    /// must be split (a write or read longer than a message). With `quiet`,
    /// a send goes unsignaled unless the moderation says signal (see
    /// [`QueueCore::must_signal`]).
    fn post_single(&self, item: &WorkItem, due: &mut Deadline, quiet: bool) -> Option<PostedInline> {
        if let (Some(local), RemoteOp::Send | RemoteOp::SendWithImm(_)) = (&item.local, item.op) {
            return Some(self.post_one_send(local, item.op, due, quiet));
        }
        let refused = |e| Some(PostedInline::Tracked(Posted::refused(e)));
        let st = self.lock();
        let len = match st.q.check_item(item) {
            Ok(len) => len,
            Err(e) => return refused(e),
        };
        if len > st.q.limits().max_message {
            return None;
        }
        let (addr, lkey) = item.local.as_ref().map_or((0, 0), |l| (l.addr, l.lkey));
        let op = send_op(item.op, 0);
        let inline = self.goes_inline(item.local.as_ref(), len, op);
        Some(self.post_prepared(st, due, quiet, op, item.op.opcode(), Sge::new(addr, len as u32, lkey), inline))
    }

    /// [`post_single`](Self::post_single) for the commonest request: a
    /// send (with or without an immediate) of one registered buffer, with
    /// only the checks a send needs (the buffer's domain, one message).
    #[inline(always)]
    fn post_one_send(&self, local: &LocalParts, op: RemoteOp, due: &mut Deadline, quiet: bool) -> PostedInline {
        let len = local.len as u64;
        let st = self.lock();
        if !st.q.is_local(local) || len > st.q.limits().max_message {
            return PostedInline::Tracked(Posted::refused(Self::send_buffer_refused(&st.q, local, op)));
        }
        let (send, opcode) = match op {
            RemoteOp::SendWithImm(imm) => (SendOp::SendWithImm(imm), Opcode::SendWithImm),
            _ => (SendOp::Send, Opcode::Send),
        };
        let inline = self.goes_inline(Some(local), len, send);
        self.post_prepared(st, due, quiet, send, opcode, Sge::new(local.addr, len as u32, local.lkey), inline)
    }

    /// Why a send of `local` is refused: another domain's buffer, or longer
    /// than a message (the errors of [`QueueCore::check_item`]).
    #[cold]
    #[inline(never)]
    fn send_buffer_refused(q: &QueueCore, local: &LocalParts, op: RemoteOp) -> Error {
        match q.check_item(&WorkItem { local: Some(*local), op }) {
            Err(e) => e,
            Ok(len) => Error::MessageTooLarge { len, max: q.limits().max_message },
        }
    }

    /// Posts one checked request of at most one message: room in the send
    /// queue, quiet (unsignaled) if asked and the moderation allows, then
    /// the request itself, built in place. An empty `sge` posts none; an
    /// `inline` one is copied at post time (from a registered buffer or a
    /// caller's slice alike).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn post_prepared(
        &self,
        st: Locked<'_>,
        due: &mut Deadline,
        quiet: bool,
        op: SendOp,
        opcode: Opcode,
        sge: Sge,
        inline: bool,
    ) -> PostedInline {
        let mut st = match self.send_room(st, 1, due) {
            Ok(st) => st,
            Err(e) => return PostedInline::Tracked(Posted::refused(e)),
        };
        let len = sge.len();
        let (posted, wr_id, signaled) = if quiet && !st.q.must_signal() {
            let q = st.q.start_quiet(opcode, len, inline || len == 0);
            (PostedInline::Quiet(q), quiet_wr_id(q.seq), false)
        } else {
            let id = st.q.start_send(opcode, 1, u64::from(len));
            (PostedInline::Tracked(Posted::Ok(id)), id.wr_id(true), true)
        };
        let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
        // SAFETY: as in `post_send`: an entry that does not go inline names
        // a checked range of a registered buffer of this domain, owned by the
        // caller's `Pending` (or, once that is dropped, by the table, or by
        // the queue core's quiet orphans) until this request completes or
        // the queue pair is destroyed. An inline entry (within the limit,
        // which `post_send_sge` checks) is copied during the call, from
        // memory the caller's borrow keeps valid until it returns.
        match unsafe { qp.post_send_sge(wr_id, op, (len > 0).then_some(sge), inline, signaled) } {
            Ok(()) => posted,
            Err(e) => Self::post_refused(&mut st, posted, e.error),
        }
    }

    /// Posts one operation that may go unsignaled (a send; see
    /// [`post_single`](Self::post_single)); one that must be split is
    /// posted tracked.
    pub(crate) fn post_send_quiet(&self, item: &WorkItem, mut due: Deadline) -> PostedInline {
        match self.post_single(item, &mut due, true) {
            Some(posted) => posted,
            None => PostedInline::Tracked(self.post_send(std::slice::from_ref(item), due)),
        }
    }

    /// [`post_send_quiet`](Self::post_send_quiet) for a send of one
    /// buffer, straight to the one path such a send takes. Not inlined: a
    /// persistent round that posts a receive keeps its own short frame.
    #[inline(never)]
    pub(crate) fn post_quiet_send(&self, local: &LocalParts, mut due: Deadline) -> PostedInline {
        self.post_one_send(local, RemoteOp::Send, &mut due, true)
    }

    pub(crate) fn post_send(&self, items: &[WorkItem], mut due: Deadline) -> Posted {
        if self.covers.get().is_some() && super::covers::any_imm_write(items) {
            return self.post_covered(items, due, None);
        }
        if let [item] = items {
            match self.post_single(item, &mut due, false) {
                Some(PostedInline::Tracked(posted)) => return posted,
                // Asked for a tracked request, it posts no quiet one.
                Some(PostedInline::Quiet(_)) => unreachable!("a tracked request was posted quiet"),
                None => {}
            }
        }
        self.post_chain(items, due, 0)
    }

    /// Covers this side's writes with immediate from now on (see
    /// [`super::covers`]). Set once, before the connection is handed out.
    pub(crate) fn cover_writes(&self, covers: Box<dyn super::covers::ImmCovers>) {
        if self.covers.set(covers).is_err() {
            tracing::warn!("a connection's covers were set twice: the first stays");
        }
    }

    /// Writes with immediate received successfully so far.
    pub(crate) fn imm_writes_seen(&self) -> u64 {
        self.imm_writes.load(Ordering::Acquire)
    }

    /// Posts `items` with each write with immediate behind its cover record
    /// (naming `whole`, when given, else its own range), all in one chain,
    /// made while the covers keep their order. The records' bytes are not
    /// counted in the operation's.
    #[cold]
    #[inline(never)]
    pub(crate) fn post_covered(
        &self,
        items: &[WorkItem],
        mut due: Deadline,
        whole: Option<crate::remote::RemoteSlice>,
    ) -> Posted {
        let Some(covers) = self.covers.get().filter(|_| super::covers::any_imm_write(items)) else {
            return self.post_send(items, due);
        };
        let mut post = covers.begin();
        let mut chain = Vec::with_capacity(items.len() + 2);
        let broken = || self.broken();
        for item in items {
            if let RemoteOp::WriteWithImm(range, _) = item.op {
                if let Err(e) = post.place(whole.unwrap_or(range), &mut due, &broken, &mut chain) {
                    return Posted::refused(e);
                }
            }
            chain.push(*item);
        }
        let records: u64 = chain.iter().filter_map(|i| i.local.map(|l| l.len as u64)).sum::<u64>()
            - items.iter().filter_map(|i| i.local.map(|l| l.len as u64)).sum::<u64>();
        let posted = self.post_chain(&chain, due, records);
        if matches!(posted, Posted::Ok(_) | Posted::Stuck(..)) {
            post.commit();
        }
        posted
    }

    /// Posts `items` as one chain of requests, signaled at its end; the
    /// operation moves their bytes less `uncounted` (cover records).
    fn post_chain(&self, items: &[WorkItem], mut due: Deadline, uncounted: u64) -> Posted {
        let Some(last) = items.last() else {
            return Posted::refused(Error::EmptyBatch);
        };
        let opcode = last.op.opcode();
        let mut st = self.lock();
        // Planned once, outside the wait for room: the plan depends only on
        // the items and the connection's fixed limits.
        let (mut scratch, mut sges) = (std::mem::take(&mut st.scratch), std::mem::take(&mut st.sges));
        let planned = self.plan(&st.q, items, &mut scratch, &mut sges);
        let n = u32::try_from(scratch.len()).unwrap_or(u32::MAX);
        let room = planned.and_then(|bytes| self.send_room(st, n, &mut due).map(|st| (st, bytes)));
        let (mut st, bytes) = match room {
            Ok(ok) => ok,
            Err(e) => {
                let mut st = self.lock();
                st.scratch = scratch;
                st.sges = sges;
                return Posted::refused(e);
            }
        };
        let id = st.q.start_send(opcode, n, bytes - uncounted);
        let outcome = {
            let count = scratch.len();
            let wrs = scratch.iter().enumerate().map(|(i, &(op, sge, inline))| {
                let list: &[Sge] = if sge == usize::MAX { &[] } else { &sges[sge..sge + 1] };
                let last = i + 1 == count;
                SendWr::new(id.wr_id(last), op, list).signaled(last).inline(inline)
            });
            let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
            // SAFETY: every scatter/gather entry names a range of a registered
            // buffer (checked against its length by `LocalSlice::resolve`, with
            // its lkey, in this connection's domain) that the caller's
            // `Pending` owns until this operation's final request completes;
            // if the `Pending` is dropped first, the buffer moves into the
            // table as an orphan and is dropped only at that completion or
            // after the queue pair is destroyed.
            unsafe { qp.post_send(wrs) }
        };
        st.scratch = scratch;
        st.sges = sges;
        match outcome {
            Ok(()) => Posted::Ok(id),
            Err(e) if e.posted == 0 => {
                st.q.abort(id);
                Posted::refused(e.error)
            }
            Err(e) => {
                // Part of the chain is on the wire without a signaled request
                // behind it: break the connection so it flushes, and keep
                // the buffer until teardown.
                let reason = format!("posting failed part-way: {}", e.error);
                st.q.lose(|| reason.clone());
                if let Some(qp) = st.qp.as_mut() {
                    let _ = qp.set_error();
                }
                Posted::Stuck(id, Box::new(Error::ConnectionLost { reason }))
            }
        }
    }

    /// Posts `data` inline as a send. With `quiet`, the send goes
    /// unsignaled unless the moderation says signal (see
    /// [`QueueCore::must_signal`]); its outcome then follows from later
    /// requests' completions.
    #[inline(always)]
    pub(crate) fn post_inline(&self, data: &[u8], imm: Option<u32>, mut due: Deadline, quiet: bool) -> PostedInline {
        let refused = |e| PostedInline::Tracked(Posted::refused(e));
        if data.len() as u64 > u64::from(self.max_inline) {
            return refused(Error::MessageTooLarge { len: data.len() as u64, max: u64::from(self.max_inline) });
        }
        let (op, opcode) = match imm {
            Some(imm) => (SendOp::SendWithImm(imm), Opcode::SendWithImm),
            None => (SendOp::Send, Opcode::Send),
        };
        // lkey 0 is never used: inline data is copied at post time.
        let sge = Sge::new(data.as_ptr() as u64, data.len() as u32, 0);
        self.post_prepared(self.lock(), &mut due, quiet, op, opcode, sge, !data.is_empty())
    }

    /// Why a receive's buffer is refused: another domain's, or longer than
    /// a scatter entry holds.
    #[cold]
    #[inline(never)]
    fn recv_buffer_refused(q: &QueueCore, l: &LocalParts) -> Error {
        match q.check_local(l) {
            Err(e) => e,
            Ok(()) => Error::MessageTooLarge { len: l.len as u64, max: u64::from(u32::MAX) },
        }
    }

    /// The provider refused a single request (quiet or tracked): its
    /// credit and slot go back.
    #[cold]
    #[inline(never)]
    fn post_refused(st: &mut VerbsState, posted: PostedInline, error: Error) -> PostedInline {
        match posted {
            PostedInline::Quiet(q) => st.q.abort_quiet(q),
            PostedInline::Tracked(Posted::Ok(id)) => st.q.abort(id),
            PostedInline::Tracked(_) => {}
        }
        PostedInline::Tracked(Posted::refused(error))
    }

    /// Posts a signaled zero-length RDMA write whose completion says every
    /// request before it is done (the remote address and key of a
    /// zero-length transfer are not checked: nothing is accessed). Its
    /// handle goes to the table as an orphan.
    fn post_flush(&self, st: &mut VerbsState) -> Result<OpId> {
        let id = self.start_flush(st)?;
        drop(st.q.orphan(id, Box::new(())));
        Ok(id)
    }

    /// [`post_flush`](Self::post_flush), handing the operation to the caller.
    fn start_flush(&self, st: &mut VerbsState) -> Result<OpId> {
        let id = st.q.start_send(Opcode::Write, 1, 0);
        let wr = SendWr::new(id.wr_id(true), SendOp::Write { remote_addr: 0, rkey: 0 }, &[]);
        let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
        // SAFETY: a zero-length write names no local memory.
        match unsafe { qp.post_send_one(&wr) } {
            Ok(()) => Ok(id),
            Err(e) => {
                st.q.abort(id);
                Err(e.error)
            }
        }
    }

    /// The outcome of quiet send `q`, polling once if it is not known yet.
    /// A poll that finds nothing posted since the last one has a signaled
    /// request follow `q` if none does: polling alone would never learn
    /// its outcome, and a caller posting more meanwhile needs no extra request.
    pub(crate) fn poll_quiet(&self, q: &QuietSend) -> Result<Option<OpOutcome>> {
        if let Some(done) = self.succeeded(q) {
            return Ok(Some(Ok(done)));
        }
        let mut st = self.lock();
        if let Some(outcome) = st.q.quiet_outcome(q) {
            return Ok(Some(outcome));
        }
        self.progress(&mut st)?;
        let outcome = st.q.quiet_outcome(q);
        if outcome.is_none()
            && !st.q.covered(q.seq)
            && st.q.idle_since_last_look()
            && matches!(st.q.send_room(1), Ok(true))
        {
            // A failed post breaks the connection, whose flush then reports `q`.
            let _ = self.post_flush(&mut st);
        }
        Ok(outcome)
    }

    /// Keeps the buffer of quiet send `q`, whose handle was dropped, until
    /// the device is done with it (dropped at once if it already is).
    pub(crate) fn orphan_quiet(&self, q: &QuietSend, buffer: Box<dyn std::any::Any + Send>) {
        let back = self.lock().q.orphan_quiet(q, buffer);
        drop(back);
    }

    /// The outcome of quiet send `q` if known, without polling.
    pub(crate) fn quiet_outcome(&self, q: &QuietSend) -> Option<OpOutcome> {
        if let Some(done) = self.succeeded(q) {
            return Some(Ok(done));
        }
        self.lock().q.quiet_outcome(q)
    }

    /// Quiet send `q`'s completion if a poll already found that it
    /// succeeded (the common case a lap of sends later), without the lock.
    #[inline(always)]
    pub(crate) fn succeeded(&self, q: &QuietSend) -> Option<Completion> {
        (q.seq < self.succeeded_below.load(Ordering::Acquire)).then(|| q.success(self.qp_num))
    }

    /// Makes sure a signaled request follows quiet send `q`, so its outcome
    /// becomes known: `Some` flush request, which the caller owns, when one
    /// was posted (always when `own`; else only when no signaled request
    /// came after it). `None` also when the connection is lost: the
    /// queue's flush then reports every request.
    pub(crate) fn cover(&self, q: &QuietSend, own: bool, due: &mut Deadline) -> Result<Option<OpId>> {
        let st = self.lock();
        if st.q.quiet_outcome(q).is_some() || (!own && st.q.covered(q.seq)) {
            return Ok(None);
        }
        let mut st = match self.send_room(st, 1, due) {
            Ok(st) => st,
            Err(Error::ConnectionLost { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.start_flush(&mut st).map(Some)
    }

    /// Drives progress until quiet send `q`'s outcome is known (a signaled
    /// request after it must be in flight: see [`cover`](Self::cover)).
    #[inline(never)]
    pub(crate) fn wait_quiet(&self, q: &QuietSend, due: &mut Deadline) -> Waited {
        match self.poll_quiet(q) {
            Ok(Some(outcome)) => waited(outcome),
            Ok(None) => self.wait_outcome(due, None, None, |st| st.q.quiet_outcome(q)),
            Err(e) => Err(WaitError::unfinished(e)),
        }
    }

    #[inline(always)]
    pub(crate) fn post_recv(&self, local: Option<LocalParts>) -> Posted {
        let mut st = self.lock();
        // A receive's scatter entry holds at most u32::MAX bytes.
        let fits = |l: &LocalParts| st.q.is_local(l) && l.len as u64 <= u64::from(u32::MAX);
        if let Some(l) = local.as_ref().filter(|l| !fits(l)) {
            return Posted::refused(Self::recv_buffer_refused(&st.q, l));
        }
        let id = match st.q.start_recv() {
            Ok(id) => id,
            Err(e) => return Posted::refused(e),
        };
        let sge = local.map(|l| Sge::new(l.addr, l.len.min(u32::MAX as usize) as u32, l.lkey));
        let list: &[Sge] = match &sge {
            Some(s) => std::slice::from_ref(s),
            None => &[],
        };
        let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
        // SAFETY: the entry names a checked range of a registered buffer of this
        // domain, owned by the caller's `Pending` (or, once that is dropped, by the
        // table) until this receive completes or the queue pair is destroyed.
        let outcome = unsafe { qp.post_recv_one(&RecvWr::new(id.wr_id(true), list)) };
        match outcome {
            Ok(()) => Posted::Ok(id),
            Err(e) => {
                st.q.abort(id);
                Posted::refused(e.error)
            }
        }
    }
}

impl Drop for VerbsConn {
    fn drop(&mut self) {
        let cq = self.cq.clone();
        let st = self.state.get_mut();
        st.fail_qp();
        // Drain the flushes, briefly: after the queue pair is destroyed the
        // device touches none of its requests' memory anyway.
        let deadline = Instant::now() + Duration::from_secs(2);
        st.q.lose(|| "the connection was dropped".to_owned());
        // Quiet sends' orphans are not waited for: one that succeeded
        // reports nothing; they go with the rest once the queue pair is gone.
        while st.q.reported_in_flight() > 0 && Instant::now() < deadline {
            let q = &mut st.q;
            match cq.poll_each(|wc| drop(q.complete(&raw_completion(&wc)))) {
                Ok(0) => std::thread::sleep(Duration::from_micros(200)),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let orphans = st.q.take_orphans();
        match st.qp.take().map(QueuePair::destroy) {
            Some(Err(e)) => {
                tracing::error!(
                    "destroying the queue pair failed ({e}): leaking {} buffers so the device cannot reach freed memory",
                    orphans.len()
                );
                std::mem::forget(orphans);
            }
            _ => drop(orphans),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConnectOptions, Connection, Domain, DomainConfig, TransportPolicy};
    use std::sync::Arc;

    /// What runs on a waiting thread between its last look at the queue
    /// and its sleep: where another thread's reaping can slip in.
    type Hook = Box<dyn FnOnce(&VerbsConn)>;

    thread_local! {
        pub(super) static BEFORE_SLEEP: std::cell::Cell<Option<Hook>> = const { std::cell::Cell::new(None) };
    }

    /// A connected pair on `GPU_RDMA_TEST_DEVICE` whose waits never spin.
    fn pair() -> (Connection, Connection, Domain) {
        let device = std::env::var("GPU_RDMA_TEST_DEVICE").expect("GPU_RDMA_TEST_DEVICE names the RDMA device");
        let d = Domain::with_config(&DomainConfig::default().device(device).transport(TransportPolicy::Verbs))
            .expect("open the test device");
        let o = ConnectOptions::default().spin(Duration::ZERO);
        let listener = d.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let so = o.clone();
        let accepting = std::thread::spawn(move || listener.accept_timeout(&so, Duration::from_secs(30)));
        let c = d.connect(addr, &o).unwrap();
        let s = accepting.join().unwrap().unwrap();
        (s, c, d)
    }

    #[test]
    #[ignore = "needs an RDMA device: set GPU_RDMA_TEST_DEVICE (cargo xtask test runs it on rxe0)"]
    fn a_sleeper_whose_completion_another_thread_reaped_first_is_rung_awake() {
        let (s, c, d) = pair();
        let conn = Arc::clone(c.verbs_conn().expect("a verbs connection"));
        let s = Arc::new(s);
        // A receive the peer answers only once the wait below is about to sleep.
        let r = c.recv(d.alloc(64).unwrap());
        let before = conn.lock().q.changes();
        let peer = Arc::clone(&s);
        // The thief, between the wait's last look and its sleep: the peer
        // sends, and the engine's progress takes the channel's event and
        // reaps the receive's completion, as a second waiting thread or the
        // engine's thread would. Nothing completes after it.
        BEFORE_SLEEP.set(Some(Box::new(move |conn: &VerbsConn| {
            peer.send_inline(b"now", None).wait().unwrap();
            let until = Instant::now() + Duration::from_secs(10);
            while conn.lock().q.changes() == before {
                assert!(Instant::now() < until, "the receive never completed");
                conn.engine_progress(true, false);
            }
        })));
        // Without the bell, this wait would sleep to its deadline (and only
        // then find the completion): the event it sleeps on is gone, and
        // so is the completion. The deadline is far beyond anything the
        // wait needs; reaching it is the failure.
        let limit = Duration::from_secs(10);
        let until = Instant::now() + limit;
        let mut due = Deadline::after(limit, "the test's receive");
        let woken = conn.wait_until(&mut due, |st| st.q.changes() != before).unwrap();
        assert!(BEFORE_SLEEP.take().is_none(), "the wait never slept, so the thief never ran");
        assert!(woken && Instant::now() < until, "the wait slept through the completion another thread reaped");
        assert_eq!(r.into_buffer().map(|b| b[..3].to_vec()).ok(), Some(b"now".to_vec()));
    }
}
