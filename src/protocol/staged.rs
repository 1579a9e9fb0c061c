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

use std::collections::{BTreeMap, VecDeque};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::completion::{Completion, Opcode, WcStatus};
use crate::cuda::{CudaBuffer, CudaDevice, CudaEvent, CudaStream, PinnedHost, copy_dtoh_async, copy_htod_async};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::{Access, LocalParts, Memory};
use crate::memory::{MemoryDomain, Registration};
use crate::ops::OpId;
use crate::protocol::order::{Gate, Place};
use crate::transport::{ConnTransport, Posted, RemoteOp, WorkItem};

/// Smallest slot: one GPU page.
const MIN_SLOT: usize = 64 * 1024;
/// Bytes of unreserved slots a GPU's cache keeps at least; it keeps up to
/// the most that were ever on loan at once when that is more.
pub(crate) const CACHE_BYTES: usize = 64 << 20;
/// Slot sizes: powers of two up to this, multiples of it above, so a slot
/// wastes at most this much (a 600 MiB message pins 600 MiB, not 1 GiB).
const SIZE_STEP: usize = 2 << 20;

/// The size class a request of `len` bytes gets.
pub(crate) fn slot_size(len: usize) -> usize {
    let len = len.max(MIN_SLOT);
    if len <= SIZE_STEP { len.next_power_of_two() } else { len.div_ceil(SIZE_STEP) * SIZE_STEP }
}

/// What a domain's staging holds and has done: pinned host memory for GPU
/// memory that the NIC cannot reach ([`Domain::staging_stats`](crate::Domain::staging_stats)).
///
/// Pinning a slot (`cuMemHostRegister` and a memory registration) costs far
/// more than moving a message through it, so `slots_pinned` should stop
/// growing once a workload has run at its full depth; if it keeps growing,
/// [`Domain::reserve_staging`](crate::Domain::reserve_staging) pins what the
/// workload needs ahead of time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct StagingStats {
    /// Bytes of pinned host memory held, on loan and cached.
    pub pinned_bytes: usize,
    /// Of those, bytes cached for reuse (no operation is using them).
    pub cached_bytes: usize,
    /// Of those, bytes pinned ahead by [`Domain::reserve_staging`](crate::Domain::reserve_staging): kept
    /// until the domain is dropped.
    pub reserved_bytes: usize,
    /// Slots pinned since the domain was opened.
    pub slots_pinned: u64,
    /// Slots unpinned and freed since the domain was opened.
    pub slots_freed: u64,
}

/// The counts behind [`StagingStats`], shared by a domain's stagers and
/// their slots.
#[derive(Default)]
struct Counts {
    pinned: AtomicUsize,
    reserved: AtomicUsize,
    made: AtomicU64,
    freed: AtomicU64,
}

/// A domain's staging machinery: a stager per GPU, made on first use, the
/// counts they keep, and the registrar their slots register with.
pub(crate) struct StagingHome {
    stagers: Mutex<Vec<Arc<Stager>>>,
    counts: Arc<Counts>,
    backend: Arc<MemoryDomain>,
    domain_id: u64,
}

impl StagingHome {
    pub(crate) fn new(backend: Arc<MemoryDomain>) -> Self {
        let domain_id = backend.id();
        StagingHome { stagers: Mutex::new(Vec::new()), counts: Arc::default(), backend, domain_id }
    }

    /// Releases what dropped operations' finished copies held; whether
    /// copies of dropped operations are still in flight.
    pub(crate) fn reap(&self) -> bool {
        let stagers: Vec<Arc<Stager>> = self.stagers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        stagers.iter().fold(false, |left, s| {
            s.reap();
            left | !s.retired.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
        })
    }

    /// Pinned bytes held for staging, in use and cached.
    pub(crate) fn pinned_bytes(&self) -> usize {
        self.counts.pinned.load(Ordering::Acquire)
    }

    /// What the domain's staging holds and has done.
    pub(crate) fn stats(&self) -> StagingStats {
        let cached_bytes = self.stagers.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|s| s.pool().cached).sum();
        StagingStats {
            pinned_bytes: self.counts.pinned.load(Ordering::Acquire),
            cached_bytes,
            reserved_bytes: self.counts.reserved.load(Ordering::Acquire),
            slots_pinned: self.counts.made.load(Ordering::Acquire),
            slots_freed: self.counts.freed.load(Ordering::Acquire),
        }
    }

    /// Frees every cached slot that was not reserved, on every GPU, and
    /// lets each cache start again from what is on loan now. Returns the
    /// bytes freed.
    pub(crate) fn trim(&self) -> usize {
        let stagers: Vec<Arc<Stager>> = self.stagers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut freed = 0;
        for stager in stagers {
            let spare = {
                let mut pool = stager.pool();
                pool.peak = pool.lent;
                pool.take_spare()
            };
            // Unpinned and deregistered outside the lock.
            freed += spare.iter().map(SlotMem::size).sum::<usize>();
        }
        freed
    }

    /// Pins `count` slots for messages (or chunks) of `len` bytes on
    /// `device` now, into its cache, kept until the domain is dropped.
    pub(crate) fn reserve(&self, device: &CudaDevice, len: usize, count: usize) -> Result<()> {
        // No message is larger (a work request's length is 32 bits).
        let max = u64::from(u32::MAX);
        if len as u64 > max {
            return Err(Error::MessageTooLarge { len: len as u64, max });
        }
        let stager = Stager::for_device(self, device)?;
        let size = slot_size(len);
        for _ in 0..count {
            let mut mem = stager.pin(size)?;
            mem.reserved = true;
            self.counts.reserved.fetch_add(size, Ordering::AcqRel);
            stager.pool().put(mem);
        }
        Ok(())
    }
}

/// Per-GPU staging machinery of a domain: streams lent to operations one
/// at a time, and a cache of pinned, registered host buffers.
pub(crate) struct Stager {
    device: CudaDevice,
    /// Idle streams. Each staged operation copies on a stream of its own,
    /// so no copy waits for another operation's fence or copies.
    streams: Mutex<Vec<CudaStream>>,
    /// What dropped operations left behind: copies still in flight, with
    /// the slots and the memory they touch and the stream they run on,
    /// released once the copies are done (a drop never waits for them).
    retired: Mutex<Vec<Retired>>,
    pool: Mutex<Pool>,
    /// Events whose copies are over, for the next copies to record (making
    /// and destroying one per copy costs driver calls a copy need not pay).
    events: Mutex<Vec<CudaEvent>>,
    /// The domain's counts, shared.
    counts: Arc<Counts>,
    /// What slots are registered with.
    backend: Arc<MemoryDomain>,
}

/// A stager's slots not on loan, by size, and what it has lent.
#[derive(Default)]
struct Pool {
    free: BTreeMap<usize, Vec<SlotMem>>,
    /// Bytes in `free`.
    cached: usize,
    /// Bytes in `free` that are not reserved: what the cache's limit counts.
    spare: usize,
    /// Bytes of unreserved slots on loan now, and the most ever at once.
    lent: usize,
    peak: usize,
}

impl Pool {
    /// The smallest free slot of at least `want` bytes.
    fn take(&mut self, want: usize) -> Option<SlotMem> {
        let (&size, list) = self.free.range_mut(want..).next()?;
        let mem = list.pop()?;
        if list.is_empty() {
            self.free.remove(&size);
        }
        self.cached -= size;
        if !mem.reserved {
            self.spare -= size;
        }
        Some(mem)
    }

    fn put(&mut self, mem: SlotMem) {
        self.cached += mem.size();
        if !mem.reserved {
            self.spare += mem.size();
        }
        self.free.entry(mem.size()).or_default().push(mem);
    }

    /// Takes every free slot that is not reserved out of the pool.
    fn take_spare(&mut self) -> Vec<SlotMem> {
        let mut out = Vec::new();
        for list in self.free.values_mut() {
            let (keep, spare): (Vec<_>, Vec<_>) = list.drain(..).partition(|m| m.reserved);
            *list = keep;
            out.extend(spare);
        }
        self.free.retain(|_, list| !list.is_empty());
        let bytes: usize = out.iter().map(SlotMem::size).sum();
        self.cached -= bytes;
        self.spare -= bytes;
        out
    }

    /// An unreserved slot of `size` bytes goes on loan.
    fn lend(&mut self, size: usize) {
        self.lent += size;
        self.peak = self.peak.max(self.lent);
    }

    /// Whether an unreserved slot of `size` bytes coming back is kept: while
    /// the cache holds no more than the most that was ever on loan at once
    /// (at least [`CACHE_BYTES`]), so a workload's next burst at the same
    /// depth pins nothing.
    fn keeps(&self, size: usize) -> bool {
        self.spare + size <= self.peak.max(CACHE_BYTES)
    }
}

/// Pinned host memory and its registration; deregistered before it is freed.
struct SlotMem {
    reg: ManuallyDrop<Registration>,
    mem: ManuallyDrop<PinnedHost>,
    /// Pinned ahead ([`StagingHome::reserve`]): always goes back to the cache.
    reserved: bool,
    /// The counts this slot is part of.
    counts: Arc<Counts>,
}

// The registration is Send + Sync (its handle is), and so is PinnedHost.
impl Drop for SlotMem {
    fn drop(&mut self) {
        // SAFETY: both fields are taken exactly once, here.
        let (reg, mem) = unsafe { (ManuallyDrop::take(&mut self.reg), ManuallyDrop::take(&mut self.mem)) };
        self.counts.pinned.fetch_sub(mem.len(), Ordering::AcqRel);
        if self.reserved {
            self.counts.reserved.fetch_sub(mem.len(), Ordering::AcqRel);
        }
        self.counts.freed.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = reg.deregister() {
            tracing::error!("staging buffer deregistration failed, leaking it: {e}");
            std::mem::forget(mem);
        }
    }
}

impl SlotMem {
    fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    fn size(&self) -> usize {
        self.mem.len()
    }
}

/// A slot on loan: goes back to its stager's cache when dropped if it was
/// reserved, or if it is no larger than a chunk and the cache has room;
/// else it is freed (a whole large message's slot always is).
pub(crate) struct Slot {
    mem: Option<SlotMem>,
    home: Arc<Stager>,
    /// No larger than a chunk: may be cached.
    keep: bool,
}

impl Slot {
    fn addr(&self) -> u64 {
        self.mem.as_ref().map_or(0, SlotMem::addr)
    }

    fn parts(&self, len: usize, domain: u64) -> LocalParts {
        let lkey = self.mem.as_ref().map_or(0, |m| m.reg.lkey());
        LocalParts { addr: self.addr(), len, lkey, domain, path: None }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(mem) = self.mem.take() else { return };
        let mut pool = self.home.pool();
        if mem.reserved {
            pool.put(mem);
            return;
        }
        pool.lent = pool.lent.saturating_sub(mem.size());
        if self.keep && pool.keeps(mem.size()) {
            pool.put(mem);
            return;
        }
        drop(pool);
        // Freed (deregistered first) as `mem` drops, outside the lock.
        drop(mem);
    }
}

impl Stager {
    /// The domain's stager for `device`, made on first use.
    pub(crate) fn for_device(home: &StagingHome, device: &CudaDevice) -> Result<Arc<Stager>> {
        let mut all = home.stagers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = all.iter().find(|s| s.device.ordinal() == device.ordinal()) {
            return Ok(Arc::clone(s));
        }
        let s = Arc::new(Stager {
            device: device.clone(),
            streams: Mutex::default(),
            retired: Mutex::default(),
            pool: Mutex::default(),
            events: Mutex::default(),
            counts: Arc::clone(&home.counts),
            backend: Arc::clone(&home.backend),
        });
        all.push(Arc::clone(&s));
        Ok(s)
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A stream for one operation's copies (idle: nothing another
    /// operation queued is ahead of them).
    fn stream(&self) -> Result<CudaStream> {
        self.reap();
        match self.streams.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(s) => Ok(s),
            None => CudaStream::new(&self.device),
        }
    }

    /// An operation's stream back, idle (everything it queued is done).
    fn give_back(&self, stream: CudaStream) {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        if streams.len() < STREAMS_KEPT {
            streams.push(stream);
        }
    }

    /// Keeps what a dropped operation's copies in flight touch until they end.
    fn retire(&self, r: Retired) {
        self.retired.lock().unwrap_or_else(|e| e.into_inner()).push(r);
    }

    /// Releases what retired copies held once they are done (a copy that
    /// failed is done too: its error was the dropped operation's).
    fn reap(&self) {
        let done: Vec<Retired> = {
            let mut retired = self.retired.lock().unwrap_or_else(|e| e.into_inner());
            if retired.is_empty() {
                return;
            }
            let (done, left) =
                retired.drain(..).partition(|r| r.events.iter().all(|e| !matches!(e.is_done(), Ok(false))));
            *retired = left;
            done
        };
        for mut r in done {
            if let Some(s) = r.stream.take() {
                self.give_back(s);
            }
        }
    }

    /// An event recorded at the current end of `stream` (one of this
    /// stager's), from the pool or new.
    fn record(self: &Arc<Self>, stream: &CudaStream) -> Result<CopyEvent> {
        let pooled = self.events.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let ev = match pooled {
            // Recorded again, it stands for this point only (its last
            // record was complete when it came back, or is no one's now).
            Some(ev) => ev.record_again(stream).map(|()| ev)?,
            None => CudaEvent::record(stream)?,
        };
        Ok(CopyEvent { ev: Some(ev), home: Arc::clone(self) })
    }

    /// Pins and registers `size` bytes of host memory.
    fn pin(&self, size: usize) -> Result<SlotMem> {
        let mem = PinnedHost::new(&self.device, size)?;
        // SAFETY: the registration and the memory travel together in
        // SlotMem, which deregisters before it frees.
        let reg = unsafe { self.backend.register(mem.as_ptr(), mem.len(), Access::LOCAL_WRITE)? };
        self.counts.pinned.fetch_add(mem.len(), Ordering::AcqRel);
        self.counts.made.fetch_add(1, Ordering::AcqRel);
        tracing::debug!(size, "staging: slot pinned");
        Ok(SlotMem {
            reg: ManuallyDrop::new(reg),
            mem: ManuallyDrop::new(mem),
            reserved: false,
            counts: Arc::clone(&self.counts),
        })
    }

    /// A slot of at least `len` bytes (its size class), from the cache or
    /// newly pinned; cached again when returned only if no larger than
    /// `chunk` (or reserved).
    fn take(self: &Arc<Self>, len: usize, chunk: usize) -> Result<Slot> {
        self.reap();
        let want = slot_size(len);
        let cached = {
            let mut pool = self.pool();
            let mem = pool.take(want);
            if let Some(m) = mem.as_ref().filter(|m| !m.reserved) {
                pool.lend(m.size());
            }
            mem
        };
        let mem = match cached {
            Some(m) => m,
            None => {
                let m = self.pin(want)?;
                self.pool().lend(m.size());
                m
            }
        };
        let keep = mem.size() <= slot_size(chunk);
        Ok(Slot { mem: Some(mem), home: Arc::clone(self), keep })
    }
}

/// Pinned, registered host memory that the slots of a receive ring land
/// in when its GPU memory is reached only through staging (no GPUDirect
/// path, or a TCP connection): each message is copied from here into its
/// GPU slot before it is lent out, so the ring's loans mean what they
/// mean on a direct path (the message is in GPU memory, visible to CUDA).
pub(crate) struct RingStaging {
    slot: Slot,
    domain: u64,
}

impl RingStaging {
    /// `len` bytes of staging for a ring whose buffer is on `device`; kept
    /// in the stager's cache afterwards if no larger than `chunk`.
    pub(crate) fn new(home: &StagingHome, device: &CudaDevice, len: usize, chunk: usize) -> Result<Self> {
        let slot = Stager::for_device(home, device)?.take(len, chunk)?;
        Ok(RingStaging { slot, domain: home.domain_id })
    }

    /// The staging's first `len` bytes, as a receive is posted into them.
    pub(crate) fn parts(&self, len: usize) -> LocalParts {
        self.slot.parts(len, self.domain)
    }

    /// Copies the `len` bytes at `off` into `dst` at `dst_off`, after the
    /// GPU work still reading there (`dst`'s consumer fence), and waits
    /// for the copy. The bytes are what the receive that landed there
    /// left, as long as no receive is posted there meanwhile (a ring posts
    /// a slot again only after this returns).
    pub(crate) fn copy_to(&self, off: usize, len: usize, dst: &CudaBuffer, dst_off: usize) -> Result<()> {
        let size = self.slot.mem.as_ref().map_or(0, SlotMem::size);
        if off.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfBounds {
                side: "local",
                offset: off as u64,
                len: len as u64,
                region_len: size as u64,
            });
        }
        dst.check_range(dst_off, len)?;
        // A stream of its own: the copy waits for `dst`'s fences only.
        let stream = self.slot.home.stream()?;
        dst.order_after_ready(&stream)?;
        let src = (self.slot.addr() + off as u64) as *const u8;
        // SAFETY: both ranges were checked above: `src..src + len` inside the
        // slot's pinned memory and `dst_off..dst_off + len` inside `dst`'s
        // allocation, and both outlive the copy, which is waited for before
        // this returns. No Rust reference to the staging is made, so a NIC
        // writing there meanwhile could change only the bytes copied.
        unsafe { copy_htod_async(dst.device_ptr() + dst_off as u64, src, len, &stream) }?;
        stream.synchronize()?;
        self.slot.home.give_back(stream);
        Ok(())
    }
}

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

/// Events a stager keeps for reuse, at most.
const EVENTS_KEPT: usize = 256;

/// Idle streams a stager keeps for reuse, at most.
const STREAMS_KEPT: usize = 32;

/// A dropped operation's copies still in flight, and what they touch.
struct Retired {
    events: Vec<CopyEvent>,
    /// The slots the copies read or write (back to the cache after them).
    slots: Vec<Slot>,
    /// The stream they run on (back to the stager's streams after them).
    stream: Option<CudaStream>,
    /// The operation's buffer, when a copy may still touch its GPU memory.
    _keep: Option<Box<dyn std::any::Any + Send>>,
}

/// The event marking a copy's end, lent by its stager: back in the pool
/// when dropped.
struct CopyEvent {
    ev: Option<CudaEvent>,
    home: Arc<Stager>,
}

impl CopyEvent {
    fn is_done(&self) -> Result<bool> {
        self.ev.as_ref().map_or(Ok(true), CudaEvent::is_done)
    }
}

impl Drop for CopyEvent {
    fn drop(&mut self) {
        if let Some(ev) = self.ev.take() {
            let mut pool = self.home.events.lock().unwrap_or_else(|e| e.into_inner());
            if pool.len() < EVENTS_KEPT {
                pool.push(ev);
            }
        }
    }
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
        if self.op.is_some() {
            self.turn = Some(Turn { gate: Arc::clone(gate), ticket: gate.hold(None), owned: true });
        }
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
        let posted = match self.op {
            None => t.post_recv(parts),
            Some(_) => t.post_send(
                &[WorkItem { local: parts, op }],
                Deadline::lazy(self.post_timeout, "room in the send queue"),
            ),
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
