//! A ring of receives into the slots of one buffer: each message is lent
//! out in turn, and its slot is posted again when the loan ends.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::{ConnShared, Connection};
use crate::completion::Completion;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::{HostMemory, LocalBuffer, LocalParts, LocalSlice, Region};
use crate::ops::{OpId, OpOutcome, WaitError};
use crate::protocol::op::{self, Look, Operation, Until};
use crate::protocol::order::{DataReady, Deferred, What};
use crate::transport::Posted;
use crate::transport::engine::AwaitClock;

/// What a ring's wait is for, in its timeout.
const WHAT: &str = "a message for the receive ring";

/// Receives into the slots of one buffer, handed out in the order the
/// messages arrive: each [`next`](Self::next) lends the oldest message
/// out as a [`Received`], and dropping that loan posts its slot again.
///
/// This is how a stream of messages is received without building a
/// handle per message (as UCX's active messages land in a pool of
/// receive buffers, and as perftest reposts its prebuilt receives): every
/// slot is posted once by [`Connection::recv_ring`], and the loop is
///
/// ```no_run
/// # fn f(conn: &gpu_rdma::Connection, domain: &gpu_rdma::Domain) -> gpu_rdma::Result<()> {
/// // Eight receives of up to 4 KiB each, posted at once.
/// let mut ring = conn.recv_ring(domain.alloc(8 * 4096)?, 4096, 8);
/// loop {
///     let msg = ring.next()?;
///     if msg.imm() == Some(0) {
///         break;
///     }
///     let bytes: &[u8] = &msg; // the message, in its slot
///     # let _ = bytes;
///     // ... use it; dropping `msg` posts its slot again ...
/// }
/// # Ok(()) }
/// ```
///
/// The slots are apart, so a message lent out is never written while it
/// is read: its slot is posted again only when the loan ends. Messages
/// come out in the order the peer sent them: a connection consumes its
/// receives in the order they were posted, so while the ring is the
/// connection's only receiver, message *n* is the ring's *n*-th. (A
/// [`Connection::recv`] posted beside it takes the message its place in
/// that order gives it.)
///
/// [`recv`](Self::recv) awaits the next message instead, as a
/// [`Pending`](crate::Pending) is awaited: no thread blocks waiting for a
/// message. (In GPU memory, a staged message's copy into the GPU is waited
/// for in place.)
///
/// No post of the ring blocks its poster: a slot whose memory GPU work
/// still reads (the ring's own fences, or the buffer's consumer fence on a
/// direct path) is kept at the receive queue's gate until that work is
/// done, and so is a slot posted behind another receive kept there. The
/// receives posted after a kept one wait behind it, so each message still
/// lands in the receive posted for it; [`posted`](Self::posted) counts kept
/// slots.
///
/// The buffer stays with the connection while any slot is posted, also when
/// the ring is dropped: it is freed once the device is done with every
/// slot (in the end, when the connection is torn down).
///
/// Host memory, or GPU memory: a message lent out from GPU memory is there
/// and visible to CUDA work (read it at [`Received::range`]), and a slot
/// is overwritten only after the buffer's consumer fence
/// ([`CudaBuffer::ready_after`](crate::cuda::CudaBuffer::ready_after): the
/// work still reading an earlier message in it). How, by path:
/// - GPU memory the NIC reaches directly (dma-buf or nvidia-peermem, on a
///   verbs connection): a slot is posted only once the fence is done
///   (kept until then, without blocking), and each message is flushed
///   where the device needs that before it is lent out;
/// - GPU memory reached only through host staging (no GPUDirect path, or a
///   TCP connection): the receives land in pinned host slots the ring holds
///   (one per slot, taken once), and each message is copied into its GPU
///   slot, after the fence, before it is lent out: one copy per message,
///   as the staged path costs.
#[must_use = "a ring's receives are posted; its messages come out of next()"]
pub struct RecvRing<B: LocalBuffer> {
    shared: Arc<ConnShared>,
    /// `Some` until the ring is taken apart.
    buf: Option<B>,
    /// Slot 0, resolved once, as receives are posted into it (the staging,
    /// for staged GPU memory); each slot is `slot_len` bytes after the last.
    first: LocalParts,
    /// Staged GPU memory: the pinned host slots the receives land in.
    staging: Option<Box<Staging>>,
    /// Where slot 0 starts in the buffer.
    start: usize,
    slot_len: usize,
    /// The receives in flight, oldest first: the order the connection
    /// fills them in.
    posted: VecDeque<(u32, OpId)>,
    /// Slots kept at the receive queue's gate (for GPU work still reading
    /// their memory, or behind another receive kept there), oldest first;
    /// each was posted after every one in `posted`.
    kept: VecDeque<(u32, Arc<Deferred>)>,
    /// The ring's own fences (`LocalSlice::after`), until its first post:
    /// that slot is kept until they are done, and the rest go behind it.
    own_fences: Option<DataReady>,
    /// Slots not posted: retired by [`Received::retire`], or refused.
    idle: VecDeque<u32>,
    /// Why a post was refused, reported once nothing older is in flight.
    refused: Option<Box<Error>>,
    /// Receives that broke the connection halfway through their post: in
    /// flight until it is torn down.
    stuck: Vec<OpId>,
    /// While awaited ([`recv`](Self::recv)): its deadline and timer.
    clock: AwaitClock,
}

impl Connection {
    /// Posts `slots` receives of `slot_len` bytes each into consecutive
    /// slots of `local`, from its start: see [`RecvRing`].
    ///
    /// The layout is checked here and nothing is posted when it is wrong;
    /// the ring's first [`next`](RecvRing::next) reports why
    /// ([`Error::OutOfBounds`] when the slots do not fit in the range,
    /// [`Error::RingRefused`] for no slots or empty slots, or why the host
    /// staging for staged GPU memory could not be taken), and
    /// [`into_buffer`](RecvRing::into_buffer) gives the buffer back.
    pub fn recv_ring<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        slot_len: usize,
        slots: usize,
    ) -> RecvRing<B> {
        RecvRing::new(&self.shared, local.into(), slot_len, slots)
    }
}

impl<B: LocalBuffer> RecvRing<B> {
    fn new(shared: &Arc<ConnShared>, local: LocalSlice<B>, slot_len: usize, slots: usize) -> Self {
        // Fences given to the ring itself (`LocalSlice::after`): the work
        // still reading its memory, which no slot is posted before.
        #[cfg(feature = "cuda")]
        let own_fences = if local.has_own_fences() { super::shared::fences_pending(local.fences()) } else { None };
        #[cfg(not(feature = "cuda"))]
        let own_fences = None;
        let laid = layout(&local, slot_len, slots).and_then(|(start, parts)| {
            let staging = staging(shared, &local, &parts, slot_len * slots)?;
            let first = staging.as_ref().map_or(parts, |s| s.parts(slot_len));
            Ok((start, first, staging))
        });
        let (start, first, staging, refused) = match laid {
            Ok((start, first, staging)) => (start, first, staging, None),
            Err(e) => (0, LocalParts { addr: 0, len: 0, lkey: 0, domain: 0, path: None }, None, Some(Box::new(e))),
        };
        let mut ring = RecvRing {
            shared: Arc::clone(shared),
            buf: Some(local.into_inner()),
            first,
            staging,
            start,
            slot_len,
            posted: VecDeque::with_capacity(slots),
            kept: VecDeque::new(),
            own_fences,
            idle: VecDeque::with_capacity(slots),
            refused,
            stuck: Vec::new(),
            clock: Default::default(),
        };
        if ring.refused.is_none() {
            ring.idle.extend(0..slots as u32);
            ring.post_idle();
        }
        ring
    }

    /// Posts `slot`, at the end of the order the connection fills its
    /// receives in: whether it was posted or kept at the receive queue's
    /// gate (if neither, the slot is idle and the refusal kept).
    #[inline]
    fn post(&mut self, slot: u32) -> bool {
        let parts = LocalParts { addr: self.first.addr + u64::from(slot) * self.slot_len as u64, ..self.first };
        if !self.shared.recv_gate.is_open() || self.is_gpu() || self.own_fences.is_some() {
            return self.post_or_keep(slot, parts);
        }
        self.post_now(slot, parts)
    }

    #[inline(always)]
    fn post_now(&mut self, slot: u32, parts: LocalParts) -> bool {
        match self.shared.transport.post_recv(Some(parts)) {
            Posted::Ok(id) => {
                self.posted.push_back((slot, id));
                true
            }
            other => {
                self.post_failed(slot, other);
                false
            }
        }
    }

    /// A slot that may have to wait: for GPU work still reading its memory
    /// (the ring's own fences, the buffer's consumer fence), or behind a
    /// receive kept at the gate. It is kept there, in its place, and the
    /// connection's driver posts it once that work is done; nobody waits.
    #[cold]
    #[inline(never)]
    fn post_or_keep(&mut self, slot: u32, parts: LocalParts) -> bool {
        self.promote();
        let ready = self.own_fences.take().or_else(|| self.consumer_fence());
        let (gate, due) = (&self.shared.recv_gate, Instant::now() + self.shared.post_timeout);
        let kept = match ready {
            Some(ready) => gate.keep_until(What::Recv(Some(parts)), due, ready),
            None => match gate.keep(What::Recv(Some(parts)), due) {
                Ok(kept) => kept,
                // Nothing is kept in front of it (any more).
                Err(_) => return self.post_now(slot, parts),
            },
        };
        self.kept.push_back((slot, kept));
        self.shared.drive_soon();
        true
    }

    /// Moves the kept slots the connection's driver posted since into
    /// `posted`, in order (a kept slot whose post failed goes idle, its
    /// refusal kept).
    fn promote(&mut self) {
        while let Some((_, kept)) = self.kept.front() {
            let Some(posted) = kept.take() else { return };
            let (slot, _) = self.kept.pop_front().expect("looked at");
            match posted {
                Posted::Ok(id) => self.posted.push_back((slot, id)),
                other => self.post_failed(slot, other),
            }
        }
    }

    /// Takes the slots still kept at the gate back (never to be posted);
    /// those posted meanwhile are in flight.
    fn cancel_kept(&mut self) {
        // The newest first: none goes to the transport between two cancels.
        while let Some((slot, kept)) = self.kept.pop_back() {
            match self.shared.recv_gate.cancel(&kept, &self.shared.transport) {
                Some(Posted::Ok(id)) => self.posted.push_back((slot, id)),
                Some(Posted::Stuck(id, _)) => self.stuck.push(id),
                Some(Posted::Refused(_)) | None => {}
            }
        }
    }

    /// GPU memory on a direct path: each post waits for the buffer's
    /// consumer fence, and each message is flushed before it is lent out.
    /// (Staged GPU memory is posted as the host memory it lands in.)
    #[inline(always)]
    fn is_gpu(&self) -> bool {
        self.first.path.is_some()
    }

    /// GPU memory on a direct path: the work still reading the buffer (its
    /// consumer fence, [`CudaBuffer::ready_after`](crate::cuda::CudaBuffer::ready_after)),
    /// which must be done before the NIC may overwrite a slot; `None` when
    /// there is none left.
    fn consumer_fence(&self) -> Option<DataReady> {
        #[cfg(feature = "cuda")]
        if self.is_gpu() {
            if let Some(cuda) = self.buf.as_ref().and_then(|b| b.cuda()) {
                return super::shared::fences_pending(cuda.fences());
            }
        }
        None
    }

    /// A message of `len` bytes landed in `slot`: in GPU memory it is
    /// made visible to CUDA work first (on a direct path the NIC's writes
    /// are flushed, where the device needs that; staged, it is copied in
    /// from its staging slot). If that fails the slot goes back into the ring.
    #[inline]
    fn landed(&mut self, slot: u32, len: u32) -> Result<()> {
        if self.is_gpu() || self.staging.is_some() {
            if let Err(e) = self.make_visible(slot, len) {
                let _ = self.post(slot);
                return Err(e);
            }
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn make_visible(&self, slot: u32, len: u32) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.buf.as_ref().and_then(|b| b.cuda()) {
            let Some(staging) = &self.staging else { return cuda.device().flush_remote_writes() };
            let off = slot as usize * self.slot_len;
            let len = (len as usize).min(self.slot_len);
            // The slot's receive finished, and the slot is posted again only
            // after this returns: the copy takes the message as it landed.
            return staging.copy_to(off, len, cuda, self.start + off);
        }
        let _ = (slot, len);
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn post_failed(&mut self, slot: u32, posted: Posted) {
        self.idle.push_back(slot);
        let e = match posted {
            Posted::Ok(_) => unreachable!("a post that succeeded is not a failure"),
            Posted::Refused(e) => e,
            Posted::Stuck(id, e) => {
                self.stuck.push(id);
                e
            }
        };
        self.refused.get_or_insert(e);
    }

    /// Waits for the next message, up to the connection's operation
    /// timeout: see [`next_timeout`](Self::next_timeout).
    ///
    /// # Errors
    /// As [`next_timeout`](Self::next_timeout).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Received<'_, B>> {
        let timeout = self.shared.op_timeout;
        self.next_timeout(timeout)
    }

    /// Waits up to `timeout` for the next message and lends it out.
    ///
    /// When no receive is in flight (every slot was retired, or posts were
    /// refused), the idle slots are posted first.
    ///
    /// # Errors
    /// - [`Error::Timeout`]: no message yet; the receive stays posted, and
    ///   the next call waits for it again.
    /// - The receive's error ([`Error::Completion`], for example a message
    ///   longer than a slot, or [`Error::ConnectionLost`]): that receive is
    ///   over and its slot is posted again (a connection that broke
    ///   refuses that, and the next call reports it).
    /// - Why a post was refused, once nothing older is in flight; and
    ///   the layout's error, for a ring that posted nothing.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Received<'_, B>> {
        let mut due = Deadline::lazy(timeout, WHAT);
        let (slot, id) = match self.oldest()? {
            Some(oldest) => oldest,
            None => self.wait_posted(&mut due)?,
        };
        let outcome = match self.shared.transport.wait_take(id, &mut due) {
            Ok(completion) => Ok(completion),
            Err(WaitError::Unfinished(e)) => return Err(*e),
            Err(WaitError::Failed(e)) => Err(e),
        };
        let completion = self.finish(slot, outcome)?;
        Ok(Received { ring: self, slot, completion, repost: true })
    }

    /// The oldest receive in flight (its slot and id), the idle slots
    /// posted first when none is; `None` while the oldest is still kept at
    /// the gate.
    #[inline]
    fn oldest(&mut self) -> Result<Option<(u32, OpId)>> {
        if self.posted.is_empty() {
            self.refill()?;
        }
        match self.posted.front() {
            Some(&oldest) => Ok(Some(oldest)),
            None if !self.kept.is_empty() => Ok(None),
            None => Err(Error::RingRefused { reason: "none of its slots can be posted" }),
        }
    }

    /// Waits, within `due`, until the oldest slot kept at the gate was
    /// posted (the connection moved along meanwhile): its slot and id.
    #[cold]
    #[inline(never)]
    fn wait_posted(&mut self, due: &mut Deadline) -> Result<(u32, OpId)> {
        let total = due.remaining().unwrap_or(self.shared.op_timeout);
        let bound = op::Bound { total: Some(total), idle: total, spin: self.shared.spin, what: WHAT };
        op::wait(&mut Posting(self), &op::NoRequests, bound)
    }

    /// The oldest receive finished as `outcome`: its completion, once the
    /// message is visible where it landed; on an error the device is done
    /// with the slot, which goes into the ring again.
    #[inline]
    fn finish(&mut self, slot: u32, outcome: OpOutcome) -> Result<Completion> {
        self.posted.pop_front();
        match outcome {
            Ok(completion) => self.landed(slot, completion.byte_len).and_then(|()| {
                if completion.opcode == crate::Opcode::RecvWriteWithImm {
                    // What the peer's write with immediate wrote elsewhere.
                    self.shared.make_imm_visible()?;
                }
                Ok(completion)
            }),
            Err(e) => {
                let _ = self.post(slot);
                Err(*e)
            }
        }
    }

    /// With no receive in flight: the refusal not reported yet, else the
    /// idle slots posted again.
    #[cold]
    #[inline(never)]
    fn refill(&mut self) -> Result<()> {
        self.promote();
        if !self.posted.is_empty() || !self.kept.is_empty() {
            return Ok(());
        }
        if let Some(e) = self.refused.take() {
            return Err(*e);
        }
        self.post_idle();
        if self.posted.is_empty() && self.kept.is_empty() {
            if let Some(e) = self.refused.take() {
                return Err(*e);
            }
        }
        Ok(())
    }

    /// Awaits the next message, as [`next`](Self::next) waits for it: up to
    /// the connection's operation timeout (then [`Error::Timeout`], and the
    /// receive stays posted), with the same errors. The wait is driven as a
    /// [`Pending`](crate::Pending)'s is: no thread blocks. Dropping the
    /// future before it is ready loses nothing: the message stays for the
    /// next call.
    ///
    /// # Errors
    /// As [`next_timeout`](Self::next_timeout).
    pub async fn recv(&mut self) -> Result<Received<'_, B>> {
        // A deadline of its own, not one a dropped future left.
        self.disarm();
        let (slot, completion) = std::future::poll_fn(|cx| self.poll_take(cx)).await?;
        Ok(Received { ring: self, slot, completion, repost: true })
    }

    /// Polls for the next message: [`recv`](Self::recv) for a hand-written
    /// future or poll loop. `Pending` registers `cx`'s waker for the
    /// message and for the timeout.
    ///
    /// # Errors
    /// As [`recv`](Self::recv).
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<Received<'_, B>>> {
        self.poll_take(cx).map_ok(|(slot, completion)| Received { ring: self, slot, completion, repost: true })
    }

    /// The oldest receive's outcome if it is in (its slot and completion),
    /// else the waker registered: the operation driver's look
    /// ([`op::poll`]), bounded by the operation timeout.
    fn poll_take(&mut self, cx: &mut Context<'_>) -> Poll<Result<(u32, Completion)>> {
        let shared = Arc::clone(&self.shared);
        let mut clock = std::mem::take(&mut self.clock);
        let bound = Some(shared.op_timeout);
        let engine = shared.ctx.engine();
        // On a timeout the receive stays posted: the next call waits for it again.
        let polled = op::poll(&mut Oldest(self), &shared.transport, engine, &mut clock, cx.waker(), bound, WHAT);
        self.clock = clock;
        polled
    }

    /// Cancels an awaited wait's timer, if one is armed.
    fn disarm(&mut self) {
        self.clock.stop(self.shared.ctx.engine());
    }

    /// Posts the idle slots again (those whose messages were
    /// [retired](Received::retire)), behind the receives in flight; how
    /// many it posted (or kept at the gate, to be posted once GPU work
    /// reading their memory is done). A post that is refused leaves its
    /// slot idle and is reported by [`next`](Self::next) once nothing
    /// older is in flight.
    #[inline]
    pub fn post_idle(&mut self) -> usize {
        let mut n = 0;
        // Oldest first; after a refusal the rest stay idle too.
        while let Some(slot) = self.idle.pop_front() {
            if !self.post(slot) {
                break;
            }
            n += 1;
        }
        n
    }

    /// How many receives are posted, counting those kept at the receive
    /// queue's gate until GPU work reading their memory is done.
    pub fn posted(&self) -> usize {
        self.posted.len() + self.kept.len() + self.stuck.len()
    }

    /// The length of each slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// The buffer back, once no receive is posted (every slot's message was
    /// [retired](Received::retire), or the ring posted none); else the ring.
    ///
    /// # Errors
    /// `Err(self)` while a receive is posted: the device may still write.
    pub fn into_buffer(mut self) -> std::result::Result<B, Box<Self>> {
        self.cancel_kept();
        if self.posted() == 0 {
            Ok(self.buf.take().expect("the buffer is present until taken"))
        } else {
            Err(Box::new(self))
        }
    }
}

/// Checks the slots against the range: where slot 0 starts in the buffer,
/// and its parts.
fn layout<B: LocalBuffer>(local: &LocalSlice<B>, slot_len: usize, slots: usize) -> Result<(usize, LocalParts)> {
    let refused = |reason| Err(Error::RingRefused { reason });
    if slots == 0 {
        return refused("it has no slots");
    }
    if slot_len == 0 {
        return refused("its slots are empty");
    }
    if u32::try_from(slots).is_err() || u32::try_from(slot_len).is_err() {
        return refused("more than 2^32 - 1 slots, or a slot of 4 GiB or more");
    }
    let parts = local.resolve()?;
    let start = local.start();
    match slot_len.checked_mul(slots) {
        Some(total) if total <= parts.len => Ok((start, LocalParts { len: slot_len, ..parts })),
        total => Err(Error::OutOfBounds {
            side: "local",
            offset: start as u64,
            len: total.map_or(u64::MAX, |t| t as u64),
            region_len: (start + parts.len) as u64,
        }),
    }
}

/// What staged GPU memory lands in first.
#[cfg(feature = "cuda")]
type Staging = crate::memory::staging::RingStaging;
/// No GPU memory without the `cuda` feature: never made.
#[cfg(not(feature = "cuda"))]
enum Staging {}

#[cfg(not(feature = "cuda"))]
impl Staging {
    fn parts(&self, _len: usize) -> LocalParts {
        match *self {}
    }
}

/// The host staging a ring's slots land in first: none for host memory
/// and for GPU memory the NIC reaches directly; for GPU memory reached only
/// through staging (no GPUDirect path, or a TCP connection), `len` bytes
/// from the domain's stager for its device.
fn staging<B: LocalBuffer>(
    shared: &ConnShared,
    local: &LocalSlice<B>,
    parts: &LocalParts,
    len: usize,
) -> Result<Option<Box<Staging>>> {
    if parts.path.is_none() {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        use crate::protocol::{Route, route};
        let Some(cuda) = local.buffer().cuda() else {
            return Err(Error::RingRefused { reason: "its buffer has a GPU path but is not GPU memory" });
        };
        if route(parts, shared.transport.is_tcp()) == Route::Direct {
            return Ok(None);
        }
        let home = &shared.ctx.staging();
        Ok(Some(Box::new(Staging::new(home, cuda.device(), len, shared.staging.0)?)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (shared, local, len);
        Err(Error::RingRefused { reason: "its buffer has a GPU path, and this build has no `cuda` feature" })
    }
}

impl<B: LocalBuffer> Drop for RecvRing<B> {
    fn drop(&mut self) {
        self.disarm();
        self.cancel_kept();
        let Some(buf) = self.buf.take() else { return };
        if self.posted() == 0 {
            return;
        }
        // The device may still write into any posted slot: the buffer (and
        // the staging, which is what it writes into for staged GPU memory)
        // goes with the last of them to complete, which every one holds a
        // share of.
        let kept = Arc::new(std::sync::Mutex::new((buf, self.staging.take())));
        let ids = self.posted.drain(..).map(|(_, id)| id).chain(self.stuck.drain(..));
        for id in ids {
            self.shared.transport.orphan(id, Box::new(Arc::clone(&kept)));
        }
    }
}

impl<B: LocalBuffer> fmt::Debug for RecvRing<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvRing")
            .field("slot_len", &self.slot_len)
            .field("posted", &self.posted())
            .field("idle", &self.idle.len())
            .finish_non_exhaustive()
    }
}

/// A message a [`RecvRing`] lends out: its completion, and its slot until
/// the loan ends. Dropping it posts the slot again; [`retire`](Self::retire)
/// leaves the slot idle.
#[must_use = "dropping the message posts its slot again at once"]
pub struct Received<'a, B: LocalBuffer> {
    ring: &'a mut RecvRing<B>,
    slot: u32,
    completion: Completion,
    repost: bool,
}

impl<B: LocalBuffer> Received<'_, B> {
    /// The receive's completion.
    pub fn completion(&self) -> Completion {
        self.completion
    }

    /// The message's length in bytes.
    pub fn len(&self) -> usize {
        self.completion.byte_len as usize
    }

    /// Whether the message is empty (a zero-byte send, or one that carried
    /// only an immediate).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The immediate the peer sent with it, if any.
    pub fn imm(&self) -> Option<u32> {
        self.completion.imm
    }

    /// Which slot it is in.
    pub fn slot(&self) -> usize {
        self.slot as usize
    }

    /// Where the message is in the ring's buffer.
    pub fn range(&self) -> Range<usize> {
        let at = self.ring.start + self.slot as usize * self.ring.slot_len;
        at..at + self.len()
    }

    /// The ring's buffer: the message is at [`range`](Self::range), and no
    /// receive is posted into that range while this loan lasts.
    pub fn buffer(&self) -> &B {
        self.ring.buf.as_ref().expect("the buffer is present until taken")
    }

    /// Ends the loan without posting the slot again: the ring then has one
    /// receive fewer in flight until [`RecvRing::post_idle`] (or a
    /// [`next`](RecvRing::next) with none in flight) posts it. A ping-pong
    /// posts it after its next send, while the reply is on the way, and
    /// leaves the last one idle, so that no receive is left posted.
    pub fn retire(mut self) {
        self.repost = false;
        self.ring.idle.push_back(self.slot);
    }
}

impl<B: LocalBuffer> Drop for Received<'_, B> {
    #[inline]
    fn drop(&mut self) {
        if self.repost {
            let _ = self.ring.post(self.slot);
        }
    }
}

impl std::ops::Deref for Received<'_, Region<HostMemory>> {
    type Target = [u8];

    /// The message's bytes, in its slot.
    fn deref(&self) -> &[u8] {
        &self.buffer().as_slice()[self.range()]
    }
}

impl<B: LocalBuffer> fmt::Debug for Received<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Received").field("slot", &self.slot).field("completion", &self.completion).finish()
    }
}

/// A ring's oldest receive, as the operation driver sees it.
struct Oldest<'a, B: LocalBuffer>(&'a mut RecvRing<B>);

impl<B: LocalBuffer> Operation for Oldest<'_, B> {
    type Output = (u32, Completion);

    fn step(&mut self, _: Option<&std::task::Waker>) -> Look<(u32, Completion)> {
        let ring = &mut *self.0;
        let (slot, id) = match ring.oldest() {
            Ok(Some(oldest)) => oldest,
            Ok(None) => return ring.kept_look(),
            Err(e) => return Look::Done(Err(e)),
        };
        match ring.shared.transport.poll_take(id) {
            Ok(Some(outcome)) => Look::Done(ring.finish(slot, outcome).map(|c| (slot, c))),
            Ok(None) => Look::Wait(Until::Request { id, briefly: None }),
            Err(e) => Look::Done(Err(e)),
        }
    }
}

/// The oldest slot kept at the gate being posted: the connection moved
/// along at each look (what keeps it wakes nobody when its fences are
/// done).
struct Posting<'a, B: LocalBuffer>(&'a mut RecvRing<B>);

impl<B: LocalBuffer> Operation for Posting<'_, B> {
    type Output = (u32, OpId);

    fn step(&mut self, _: Option<&std::task::Waker>) -> Look<(u32, OpId)> {
        match self.0.oldest() {
            Ok(Some(oldest)) => Look::Done(Ok(oldest)),
            Ok(None) => self.0.kept_look(),
            Err(e) => Look::Done(Err(e)),
        }
    }
}

impl<B: LocalBuffer> RecvRing<B> {
    /// The oldest slot is still kept at the gate: the connection moves
    /// along, and a look comes again soon.
    fn kept_look<T>(&self) -> Look<T> {
        self.shared.drive();
        Look::Wait(Until::Soon { copying: false })
    }
}
