//! The staging slots: pinned, registered host buffers that GPU memory the
//! NIC cannot reach moves through, cached per GPU; the streams staged
//! copies run on, lent one operation at a time; what dropped operations'
//! copies still hold, released once they end.

use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::cuda::{CudaBuffer, CudaDevice, CudaEvent, CudaStream, PinnedHost, copy_htod_async};
use crate::error::{Error, Result};
use crate::memory::{Access, LocalParts, Memory};
use crate::memory::{MemoryDomain, Registration};

/// Smallest slot: one GPU page.
pub(crate) const MIN_SLOT: usize = 64 * 1024;
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
pub(crate) struct Counts {
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
    pub(crate) domain_id: u64,
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
pub(crate) struct Pool {
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
    pub(crate) fn take(&mut self, want: usize) -> Option<SlotMem> {
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

    pub(crate) fn put(&mut self, mem: SlotMem) {
        self.cached += mem.size();
        if !mem.reserved {
            self.spare += mem.size();
        }
        self.free.entry(mem.size()).or_default().push(mem);
    }

    /// Takes every free slot that is not reserved out of the pool.
    pub(crate) fn take_spare(&mut self) -> Vec<SlotMem> {
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
    pub(crate) fn lend(&mut self, size: usize) {
        self.lent += size;
        self.peak = self.peak.max(self.lent);
    }

    /// Whether an unreserved slot of `size` bytes coming back is kept: while
    /// the cache holds no more than the most that was ever on loan at once
    /// (at least [`CACHE_BYTES`]), so a workload's next burst at the same
    /// depth pins nothing.
    pub(crate) fn keeps(&self, size: usize) -> bool {
        self.spare + size <= self.peak.max(CACHE_BYTES)
    }
}

/// Pinned host memory and its registration; deregistered before it is freed.
pub(crate) struct SlotMem {
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
    pub(crate) fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    pub(crate) fn size(&self) -> usize {
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
    pub(crate) fn addr(&self) -> u64 {
        self.mem.as_ref().map_or(0, SlotMem::addr)
    }

    pub(crate) fn parts(&self, len: usize, domain: u64) -> LocalParts {
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

    pub(crate) fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A stream for one operation's copies (idle: nothing another
    /// operation queued is ahead of them).
    pub(crate) fn stream(&self) -> Result<CudaStream> {
        self.reap();
        match self.streams.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(s) => Ok(s),
            None => CudaStream::new(&self.device),
        }
    }

    /// An operation's stream back, idle (everything it queued is done).
    pub(crate) fn give_back(&self, stream: CudaStream) {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        if streams.len() < STREAMS_KEPT {
            streams.push(stream);
        }
    }

    /// Keeps what a dropped operation's copies in flight touch until they end.
    pub(crate) fn retire(&self, r: Retired) {
        self.retired.lock().unwrap_or_else(|e| e.into_inner()).push(r);
    }

    /// Releases what retired copies held once they are done (a copy that
    /// failed is done too: its error was the dropped operation's).
    pub(crate) fn reap(&self) {
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
    pub(crate) fn record(self: &Arc<Self>, stream: &CudaStream) -> Result<CopyEvent> {
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
    pub(crate) fn pin(&self, size: usize) -> Result<SlotMem> {
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
    pub(crate) fn take(self: &Arc<Self>, len: usize, chunk: usize) -> Result<Slot> {
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
        Error::check_local(off, len, size)?;
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

/// Events a stager keeps for reuse, at most.
const EVENTS_KEPT: usize = 256;

/// Idle streams a stager keeps for reuse, at most.
const STREAMS_KEPT: usize = 32;

/// A dropped operation's copies still in flight, and what they touch.
pub(crate) struct Retired {
    pub(crate) events: Vec<CopyEvent>,
    /// The slots the copies read or write (back to the cache after them).
    pub(crate) slots: Vec<Slot>,
    /// The stream they run on (back to the stager's streams after them).
    pub(crate) stream: Option<CudaStream>,
    /// The operation's buffer, when a copy may still touch its GPU memory.
    pub(crate) _keep: Option<Box<dyn std::any::Any + Send>>,
}

/// The event marking a copy's end, lent by its stager: back in the pool
/// when dropped.
pub(crate) struct CopyEvent {
    ev: Option<CudaEvent>,
    home: Arc<Stager>,
}

impl CopyEvent {
    pub(crate) fn is_done(&self) -> Result<bool> {
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
