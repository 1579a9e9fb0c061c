//! # A stand-in for `libcuda`, for tests only
//!
//! **Never use this outside tests.** It lets gpu-rdma's CUDA code paths run
//! on machines without a GPU (CI, the soft-RoCE VM): the real code, loaded
//! the real way (cudarc's run-time loading of `libcuda.so`), against a
//! library that implements only the driver calls gpu-rdma makes.
//!
//! The test harness exposes it as `libcuda.so` in a private directory
//! (`target/cuda-stub/`) and puts that directory on `LD_LIBRARY_PATH` of
//! the test processes that ask for it, never anywhere a real driver could
//! be shadowed.
//!
//! ## Never kinder than a real driver
//!
//! By default it behaves as strictly as a real driver where a lenient
//! stand-in would hide a bug; no switch is needed for that.
//!
//! - **Device memory is not CPU memory.** Each allocation is a memfd mapped
//!   twice: at the device address with `PROT_NONE`, so any load or store by
//!   the CPU through a device pointer faults (SIGSEGV), as it would on a
//!   GPU; and once more, read-write, at a private alias only this library
//!   knows, through which its copies, memsets and producers reach the bytes.
//! - **The nvidia-peermem call path.** A NIC registering a device pointer
//!   (`ibv_reg_mr` on GPU memory) works on a real machine only because the
//!   `nvidia_peermem` kernel module resolves GPU addresses. Here the same
//!   role is played by this library when it is *preloaded*
//!   (`LD_PRELOAD=.../libcuda.so`): it then interposes `ibv_reg_mr` and
//!   `ibv_reg_mr_iova2`, and registers a device range by its alias's pages
//!   with the device address as the I/O virtual address, so the NIC (soft-
//!   RoCE pins the pages and copies in the kernel) reaches the memory at
//!   the device address while the CPU still faults there. Not preloaded,
//!   nothing resolves device addresses: `ibv_reg_mr` on GPU memory fails
//!   (EFAULT), as it does on a machine without nvidia-peermem.
//! - **Addresses like a real driver's**: `cuMemAlloc` guarantees 256-byte
//!   alignment, and that is all this library gives: successive allocations
//!   start at varying offsets inside their mapping, rarely page-aligned.
//! - **VMM memory** (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`,
//!   `cuMemSetAccess`, ...): `cuPointerSetAttribute(SYNC_MEMOPS)` fails on
//!   it with `CUDA_ERROR_NOT_SUPPORTED`, as on a real driver; its
//!   `IS_GPU_DIRECT_RDMA_CAPABLE` attribute is what `cuMemCreate` was asked
//!   for (`allocFlags.gpuDirectRDMACapable`); copies before
//!   `cuMemSetAccess` fail with `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! - **Asynchronous producers**: `cuMemsetD8Async`/`cuMemsetD32Async` run
//!   on their stream's worker, and [`gpu_rdma_stub_produce`] queues a
//!   "kernel" that fills device memory some time later, so a missing or
//!   stale fence shows up as wrong data.
//!   `cuCtxSynchronize` and `cuMemFree` wait for every stream, as on a GPU.
//! - **dma-buf export** requires a page-aligned range, as the driver does.
//! - **Device attributes chosen per test** ([`gpu_rdma_stub_set_attribute`];
//!   `GPU_RDMA_STUB_DMABUF=0` turns dma-buf off for a whole process), so
//!   every branch of the flush and path logic runs in CI.
//!
//! Devices: `GPU_RDMA_STUB_DEVICES` (default 1).

#![allow(non_snake_case)]
// Every exported function has the CUDA driver's contract (see the comment
// above them): callers are C code or cudarc, which uphold it.
#![allow(clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::Duration;

type CUresult = u32;
const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_READY: CUresult = 600;
const ILLEGAL_ADDRESS: CUresult = 700;
const NOT_SUPPORTED: CUresult = 801;

/// cuMemAlloc's alignment contract.
const ALLOC_ALIGN: usize = 256;
/// VMM allocation granularity (as on current GPUs).
const VMM_GRANULARITY: usize = 2 << 20;
const CTX_SYNC_MEMOPS: u32 = 128;

fn host_page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

/// One mapping of device memory: a `cuMemAlloc` allocation, or a VMM
/// handle mapped at a reserved address.
struct Alloc {
    /// The device address handed out (`cuMemAlloc`: inside the mapping, at
    /// a 256-byte-aligned offset; VMM: the mapping's start).
    dptr: u64,
    /// Bytes valid at `dptr`.
    len: usize,
    /// The `PROT_NONE` mapping at device addresses.
    map: usize,
    map_len: usize,
    /// The read-write alias of the same pages.
    alias: usize,
    /// The memfd behind both (owned: closed on free or unmap).
    fd: i32,
    sync_memops: u32,
    /// Made by `cuMemMap` (VMM), not `cuMemAlloc`.
    vmm: bool,
    /// `IS_GPU_DIRECT_RDMA_CAPABLE`.
    gdr: bool,
    /// VMM: `cuMemSetAccess` granted read-write.
    accessible: bool,
    /// `BUFFER_ID`: unique to this allocation for the life of the process,
    /// as the driver's is (an allocation freed and made again at the same
    /// address gets a new one).
    id: u64,
}

impl Alloc {
    fn alias_of(&self, ptr: u64) -> usize {
        self.alias + (ptr as usize - self.map)
    }
}

/// A `cuMemCreate` handle: physical memory, not yet (or also) mapped.
struct Physical {
    fd: i32,
    len: usize,
    gdr: bool,
}

struct State {
    initialized: AtomicBool,
    /// Mappings by their `map` start.
    allocs: Mutex<BTreeMap<usize, Alloc>>,
    physical: Mutex<BTreeMap<u64, Physical>>,
    next_handle: AtomicU64,
    /// Reserved VA ranges: start -> length.
    reserved: Mutex<BTreeMap<usize, usize>>,
    host_registered: Mutex<BTreeMap<usize, usize>>,
    /// `cuMemAllocHost` mappings: start, length.
    host_allocs: Mutex<BTreeMap<usize, usize>>,
    flushes: AtomicU64,
    allocations: AtomicU64,
    /// Events made, by the device whose context was current (test hook).
    events_created: [AtomicU64; 8],
    /// Device attribute overrides (test hook).
    attrs: Mutex<BTreeMap<u32, i32>>,
    ctx_flags: AtomicU32,
    /// Live streams (their boxes' addresses), for cuCtxSynchronize.
    streams: Mutex<Vec<usize>>,
    /// The flags of the last successful dma-buf export.
    last_export_flags: AtomicU32,
    /// The access flags of the last device-memory registration (peermem stand-in).
    last_device_access: AtomicU32,
    device_registrations: AtomicU64,
}

fn state() -> &'static State {
    static S: OnceLock<State> = OnceLock::new();
    S.get_or_init(|| State {
        initialized: AtomicBool::new(false),
        allocs: Mutex::new(BTreeMap::new()),
        physical: Mutex::new(BTreeMap::new()),
        next_handle: AtomicU64::new(1),
        reserved: Mutex::new(BTreeMap::new()),
        host_registered: Mutex::new(BTreeMap::new()),
        host_allocs: Mutex::new(BTreeMap::new()),
        flushes: AtomicU64::new(0),
        allocations: AtomicU64::new(0),
        events_created: Default::default(),
        attrs: Mutex::new(BTreeMap::new()),
        ctx_flags: AtomicU32::new(0),
        streams: Mutex::new(Vec::new()),
        last_export_flags: AtomicU32::new(u32::MAX),
        last_device_access: AtomicU32::new(0),
        device_registrations: AtomicU64::new(0),
    })
}

fn env_u32(name: &str, default: u32) -> u32 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn devices() -> i32 {
    env_u32("GPU_RDMA_STUB_DEVICES", 1) as i32
}

fn ready() -> Result<(), CUresult> {
    if state().initialized.load(Ordering::Acquire) { Ok(()) } else { Err(NOT_INITIALIZED) }
}

fn code(r: Result<(), CUresult>) -> CUresult {
    match r {
        Ok(()) => SUCCESS,
        Err(e) => e,
    }
}

/// The alias of `ptr..ptr+len` when it lies inside the valid bytes of one
/// allocation (`Err(ILLEGAL_ADDRESS)` for VMM memory without access).
fn device_alias(ptr: u64, len: usize) -> Result<usize, CUresult> {
    let allocs = state().allocs.lock().unwrap();
    let Some((_, a)) = allocs.range(..=ptr as usize).next_back() else { return Err(INVALID_VALUE) };
    if ptr < a.dptr || ptr.checked_add(len as u64).is_none_or(|e| e > a.dptr + a.len as u64) {
        return Err(INVALID_VALUE);
    }
    if a.vmm && !a.accessible {
        return Err(ILLEGAL_ADDRESS);
    }
    Ok(a.alias_of(ptr))
}

/// Like [`device_alias`], for a range anywhere inside the mapping (page
/// rounding of a dma-buf export or a NIC registration may reach past the
/// allocation's valid bytes, never past its mapping).
fn mapping_alias(ptr: u64, len: usize) -> Option<(usize, i32)> {
    let allocs = state().allocs.lock().unwrap();
    let (_, a) = allocs.range(..=ptr as usize).next_back()?;
    let end = ptr.checked_add(len as u64)?;
    (ptr as usize >= a.map && end as usize <= a.map + a.map_len).then(|| (a.alias_of(ptr), a.fd))
}

/// Maps `fd` twice: `PROT_NONE` (at `at` when given, else anywhere) and a
/// read-write alias. Returns (device mapping, alias).
fn map_twice(fd: i32, len: usize, at: Option<usize>) -> Option<(usize, usize)> {
    let fixed = if at.is_some() { libc::MAP_FIXED } else { 0 };
    // SAFETY: a shared mapping of our own memfd; MAP_FIXED only over a range
    // this library reserved (cuMemAddressReserve) and tracks.
    let dev = unsafe {
        libc::mmap(
            at.map_or(std::ptr::null_mut(), |a| a as *mut libc::c_void),
            len,
            libc::PROT_NONE,
            libc::MAP_SHARED | fixed,
            fd,
            0,
        )
    };
    if dev == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: as above, at an address of the kernel's choosing.
    let alias =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if alias == libc::MAP_FAILED {
        if at.is_none() {
            // SAFETY: the mapping just made.
            unsafe { libc::munmap(dev, len) };
        }
        return None;
    }
    Some((dev as usize, alias as usize))
}

fn new_memfd(len: usize) -> Option<i32> {
    // SAFETY: memfd_create with a static NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"gpu-rdma-stub-device-memory".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a descriptor just created here.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        // SAFETY: ours, closed once.
        unsafe { libc::close(fd) };
        return None;
    }
    Some(fd)
}

// ---- streams: a worker thread each, running tasks in order ----

enum Task {
    Copy {
        dst: usize,
        src: usize,
        len: usize,
    },
    /// Fills `len` bytes with `value` (little-endian, repeated), after `delay`.
    Fill {
        dst: usize,
        len: usize,
        value: u32,
        width: usize,
        delay: Duration,
    },
    /// Marks record `generation` of the event complete.
    Signal(Arc<Event>, u64),
    /// Waits until record `generation` of the event is complete.
    Wait(Arc<Event>, u64),
}

/// An event's records: each `cuEventRecord` starts a new one, and the
/// event is complete when its latest record is, as in CUDA. Recording an
/// event again while an earlier record is still queued does not let that
/// earlier record's completion stand for the new one.
struct Event {
    /// (the latest record's generation, the highest generation completed)
    gens: Mutex<(u64, u64)>,
    cv: Condvar,
}

impl Event {
    /// An event never recorded counts as complete.
    fn new() -> Arc<Event> {
        Arc::new(Event { gens: Mutex::new((0, 0)), cv: Condvar::new() })
    }
    /// A new record: its generation.
    fn record(&self) -> u64 {
        let mut g = self.gens.lock().unwrap();
        g.0 += 1;
        g.0
    }
    fn complete(&self, generation: u64) {
        let mut g = self.gens.lock().unwrap();
        g.1 = g.1.max(generation);
        self.cv.notify_all();
    }
    /// Whether the latest record is complete.
    fn is_set(&self) -> bool {
        let g = self.gens.lock().unwrap();
        g.1 >= g.0
    }
    /// The latest record's generation now.
    fn latest(&self) -> u64 {
        self.gens.lock().unwrap().0
    }
    fn wait_for(&self, generation: u64) {
        let mut g = self.gens.lock().unwrap();
        while g.1 < generation {
            g = self.cv.wait(g).unwrap();
        }
    }
}

struct Stream {
    tx: Mutex<Sender<Task>>,
}

fn worker(rx: Receiver<Task>) {
    for task in rx {
        match task {
            Task::Copy { dst, src, len } => {
                // SAFETY: the caller of the async copy guaranteed both ranges stay
                // valid until the copy completes (the CUDA contract); device
                // ranges were translated to their aliases.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
            }
            Task::Fill { dst, len, value, width, delay } => {
                thread::sleep(delay);
                let bytes = value.to_le_bytes();
                for i in 0..len {
                    // SAFETY: the alias of a live allocation (freeing waits for
                    // every stream first), `len` bytes checked at enqueue time.
                    unsafe { *(dst as *mut u8).add(i) = bytes[i % width] };
                }
            }
            Task::Signal(ev, generation) => ev.complete(generation),
            Task::Wait(ev, generation) => ev.wait_for(generation),
        }
    }
}

impl Stream {
    fn new() -> Stream {
        let (tx, rx) = channel();
        thread::spawn(move || worker(rx));
        Stream { tx: Mutex::new(tx) }
    }
    fn push(&self, t: Task) {
        let _ = self.tx.lock().unwrap().send(t);
    }
    fn sync(&self) {
        let ev = Event::new();
        let generation = ev.record();
        self.push(Task::Signal(Arc::clone(&ev), generation));
        ev.wait_for(generation);
    }
}

/// Waits for the work queued on every live stream (the whole context), up
/// to this call. The streams' list is held only to queue a marker on each:
/// while the markers are waited for, other threads create, destroy and
/// use streams freely (a real driver does not stop them either).
fn sync_all_streams() {
    let markers: Vec<(Arc<Event>, u64)> = {
        let streams = state().streams.lock().unwrap();
        streams
            .iter()
            .map(|&s| {
                // SAFETY: boxes leaked by cuStreamCreate and still registered, so
                // not destroyed (destroying takes this lock to unregister).
                let s = unsafe { &*(s as *const Stream) };
                let ev = Event::new();
                let generation = ev.record();
                s.push(Task::Signal(Arc::clone(&ev), generation));
                (ev, generation)
            })
            .collect()
    };
    // A stream destroyed meanwhile finishes its queue, the marker with it.
    for (ev, generation) in markers {
        ev.wait_for(generation);
    }
}

/// The legacy default stream: work on it is asynchronous too.
fn legacy_stream() -> &'static Stream {
    static L: OnceLock<Stream> = OnceLock::new();
    L.get_or_init(Stream::new)
}

/// Streams and events live in leaked boxes, referenced by raw handle.
fn stream_ref<'a>(h: *mut libc::c_void) -> Option<&'a Stream> {
    // SAFETY: handles are `Box<Stream>` leaked by cuStreamCreate (or null for
    // the legacy stream, handled by the caller).
    if h.is_null() { None } else { Some(unsafe { &*(h as *const Stream) }) }
}

fn event_ref(h: *mut libc::c_void) -> Option<Arc<Event>> {
    if h.is_null() {
        return None;
    }
    // SAFETY: handles are `Box<Arc<Event>>` leaked by cuEventCreate.
    Some(Arc::clone(unsafe { &*(h as *const Arc<Event>) }))
}

/// Copies now (null stream: the synchronous calls) or queues the copy.
fn copy(dst: usize, src: usize, len: usize, stream: *mut libc::c_void) {
    match stream_ref(stream) {
        Some(s) => s.push(Task::Copy { dst, src, len }),
        None => {
            // The synchronous copies are ordered after legacy-stream work.
            legacy_stream().sync();
            // SAFETY: synchronous copy between ranges the caller guarantees valid.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) }
        }
    }
}

thread_local! {
    static CTX_STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn write_cstr(dst: *mut libc::c_char, len: i32, s: &str) -> CUresult {
    if dst.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    let bytes = s.as_bytes();
    let n = bytes.len().min(len as usize - 1);
    // SAFETY: the caller provides `len` writable chars; `n < len`.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast(), dst, n);
        *dst.add(n) = 0;
    }
    SUCCESS
}

// ---- the driver API ----
//
// SAFETY (for every function below): the CUDA driver's own contract
// applies: pointers passed in are valid for what the function does with
// them. Each checks what the real driver checks (initialization, device
// ordinals, known allocations) and returns the driver's error codes.

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: u32) -> CUresult {
    if flags != 0 {
        return INVALID_VALUE;
    }
    state().initialized.store(true, Ordering::Release);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut i32) -> CUresult {
    if v.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer.
    unsafe { *v = 12080 };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut i32) -> CUresult {
    code(ready().map(|()| {
        // SAFETY: out-pointer per the driver contract.
        unsafe { *n = devices() }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut i32, ordinal: i32) -> CUresult {
    if let Err(e) = ready() {
        return e;
    }
    if ordinal < 0 || ordinal >= devices() {
        return INVALID_DEVICE;
    }
    // SAFETY: out-pointer per the driver contract.
    unsafe { *dev = ordinal };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut libc::c_char, len: i32, dev: i32) -> CUresult {
    if dev < 0 || dev >= devices() {
        return INVALID_DEVICE;
    }
    write_cstr(name, len, "gpu-rdma CUDA stand-in (tests only)")
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus: *mut libc::c_char, len: i32, dev: i32) -> CUresult {
    if dev < 0 || dev >= devices() {
        return INVALID_DEVICE;
    }
    write_cstr(bus, len, &format!("0000:{:02x}:00.0", 0xf0 + dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) -> CUresult {
    if dev < 0 || dev >= devices() {
        return INVALID_DEVICE;
    }
    // SAFETY: out-pointer per the driver contract.
    unsafe { *bytes = 16 << 30 };
    SUCCESS
}

/// The attribute's value: a test's override, else a Hopper-like default.
fn attribute(attr: u32) -> i32 {
    if let Some(v) = state().attrs.lock().unwrap().get(&attr) {
        return *v;
    }
    match attr {
        75 => 9,                                          // compute capability major
        76 => 0,                                          // minor
        102 => 1,                                         // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        103 => 1,                                         // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        110 => 1,                                         // GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
        116 => 1,                                         // GPU_DIRECT_RDMA_SUPPORTED
        117 => 1,                                         // FLUSH_WRITES_OPTIONS: host flush
        118 => 0,                                         // WRITES_ORDERING: none (flush needed)
        124 => env_u32("GPU_RDMA_STUB_DMABUF", 1) as i32, // DMA_BUF_SUPPORTED
        _ => 0,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut i32, attr: u32, dev: i32) -> CUresult {
    if dev < 0 || dev >= devices() {
        return INVALID_DEVICE;
    }
    // SAFETY: out-pointer per the driver contract.
    unsafe { *v = attribute(attr) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut usize, dev: i32) -> CUresult {
    if dev < 0 || dev >= devices() {
        return INVALID_DEVICE;
    }
    // SAFETY: out-pointer per the driver contract.
    unsafe { *ctx = 0x1000 + dev as usize };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: i32) -> CUresult {
    if dev < 0 || dev >= devices() { INVALID_DEVICE } else { SUCCESS }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: usize) -> CUresult {
    if ctx < 0x1000 {
        return INVALID_CONTEXT;
    }
    CTX_STACK.with(|s| s.borrow_mut().push(ctx));
    SUCCESS
}

/// The calling thread's current context (null when none), as cudarc asks
/// before binding its context to a thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut usize) -> CUresult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    let top = CTX_STACK.with(|s| s.borrow().last().copied().unwrap_or(0));
    // SAFETY: non-null out-pointer per the driver contract.
    unsafe { *ctx = top };
    SUCCESS
}

/// Makes `ctx` the calling thread's current context: it replaces the top of
/// the thread's context stack (pushed when the stack is empty); null pops it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: usize) -> CUresult {
    if ctx != 0 && ctx < 0x1000 {
        return INVALID_CONTEXT;
    }
    CTX_STACK.with(|s| {
        let mut s = s.borrow_mut();
        match (ctx, s.last_mut()) {
            (0, Some(_)) => {
                s.pop();
            }
            (0, None) => {}
            (c, Some(top)) => *top = c,
            (c, None) => s.push(c),
        }
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut usize) -> CUresult {
    match CTX_STACK.with(|s| s.borrow_mut().pop()) {
        Some(c) => {
            if !ctx.is_null() {
                // SAFETY: non-null out-pointer.
                unsafe { *ctx = c };
            }
            SUCCESS
        }
        None => INVALID_CONTEXT,
    }
}

fn current() -> Result<(), CUresult> {
    ready()?;
    if CTX_STACK.with(|s| s.borrow().is_empty()) { Err(INVALID_CONTEXT) } else { Ok(()) }
}

/// The device of this thread's current context (the caller checked there is one).
fn current_device() -> usize {
    CTX_STACK.with(|s| s.borrow().last().map_or(usize::MAX, |c| c - 0x1000))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    sync_all_streams();
    legacy_stream().sync();
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if flags.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer.
    unsafe { *flags = state().ctx_flags.load(Ordering::Acquire) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetFlags(flags: u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    // As the driver: the flags it accepts (scheduling, map-host, local
    // memory resize, coredump, SYNC_MEMOPS), and they *replace* the
    // context's flags: a caller that does not read them first drops the
    // framework's own.
    const KNOWN: u32 = 0x07 | 0x08 | 0x10 | 0x20 | 0x40 | CTX_SYNC_MEMOPS;
    if flags & !KNOWN != 0 {
        return INVALID_VALUE;
    }
    state().ctx_flags.store(flags, Ordering::Release);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if size == 0 || dptr.is_null() {
        return INVALID_VALUE;
    }
    // 256-byte alignment is the contract, and all a caller may assume: the
    // offset inside the mapping varies from one allocation to the next.
    let n = state().allocations.fetch_add(1, Ordering::Relaxed) + 1;
    let offset = ((n as usize * 0x2f00) % 0x10000) / ALLOC_ALIGN * ALLOC_ALIGN;
    let page = host_page();
    let map_len = (offset + size).div_ceil(page) * page;
    let Some(fd) = new_memfd(map_len) else { return OUT_OF_MEMORY };
    let Some((map, alias)) = map_twice(fd, map_len, None) else {
        // SAFETY: ours, closed once.
        unsafe { libc::close(fd) };
        return OUT_OF_MEMORY;
    };
    let d = (map + offset) as u64;
    let a = Alloc {
        dptr: d,
        len: size,
        map,
        map_len,
        alias,
        fd,
        sync_memops: 0,
        vmm: false,
        gdr: true,
        accessible: true,
        id: n,
    };
    state().allocs.lock().unwrap().insert(map, a);
    // SAFETY: non-null out-pointer.
    unsafe { *dptr = d };
    SUCCESS
}

fn unmap(a: &Alloc) {
    // SAFETY: both mappings were made by map_twice for this allocation and
    // are unmapped once; the memfd is ours.
    unsafe {
        libc::munmap(a.alias as *mut libc::c_void, a.map_len);
        libc::close(a.fd);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    // Freeing waits for the device, as cuMemFree does.
    sync_all_streams();
    legacy_stream().sync();
    let mut allocs = state().allocs.lock().unwrap();
    let key = allocs.range(..=dptr as usize).next_back().filter(|(_, a)| a.dptr == dptr && !a.vmm).map(|(k, _)| *k);
    match key.and_then(|k| allocs.remove(&k)) {
        Some(a) => {
            unmap(&a);
            // SAFETY: the device mapping made by cuMemAlloc_v2, unmapped once.
            unsafe { libc::munmap(a.map as *mut libc::c_void, a.map_len) };
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerSetAttribute(value: *const libc::c_void, attr: u32, ptr: u64) -> CUresult {
    if attr != 6 || value.is_null() {
        return INVALID_VALUE; // only SYNC_MEMOPS is modelled
    }
    let mut allocs = state().allocs.lock().unwrap();
    match allocs.range_mut(..=ptr as usize).next_back() {
        Some((_, a)) if ptr >= a.dptr && ptr < a.dptr + a.len as u64 => {
            if a.vmm {
                // Not on VMM memory, as on a real driver (the context flag is the way).
                return NOT_SUPPORTED;
            }
            // SAFETY: SYNC_MEMOPS takes an unsigned int.
            a.sync_memops = unsafe { *(value as *const u32) };
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut libc::c_void, attr: u32, ptr: u64) -> CUresult {
    if data.is_null() {
        return INVALID_VALUE;
    }
    let allocs = state().allocs.lock().unwrap();
    let Some((_, a)) = allocs.range(..=ptr as usize).next_back() else { return INVALID_VALUE };
    if ptr < a.dptr || ptr >= a.dptr + a.len as u64 {
        return INVALID_VALUE;
    }
    let value: u64 = match attr {
        2 => 2,                        // MEMORY_TYPE: CU_MEMORYTYPE_DEVICE (unsigned int)
        6 => u64::from(a.sync_memops), // SYNC_MEMOPS (unsigned int)
        7 => a.id,                     // BUFFER_ID (unsigned long long)
        9 => 0,                        // DEVICE_ORDINAL (int)
        11 => a.dptr,                  // RANGE_START_ADDR (CUdeviceptr)
        12 => a.len as u64,            // RANGE_SIZE (size_t)
        15 => u64::from(a.gdr),        // IS_GPU_DIRECT_RDMA_CAPABLE (unsigned int)
        _ => return INVALID_VALUE,
    };
    if matches!(attr, 7 | 11 | 12) {
        // SAFETY: these attributes are 8-byte out-values (unsigned long long,
        // CUdeviceptr, size_t).
        unsafe { *(data as *mut u64) = value };
    } else {
        // SAFETY: the others are 4-byte out-values (unsigned int or int).
        unsafe { *(data as *mut u32) = value as u32 };
    }
    SUCCESS
}

/// A copy between host memory and device memory (translated to its alias).
fn copy_checked(
    dst: usize,
    src: usize,
    len: usize,
    dst_dev: bool,
    src_dev: bool,
    stream: *mut libc::c_void,
) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    let translate = |p: usize, dev: bool| if dev { device_alias(p as u64, len) } else { Ok(p) };
    let (dst, src) = match (translate(dst, dst_dev), translate(src, src_dev)) {
        (Ok(d), Ok(s)) => (d, s),
        (Err(e), _) | (_, Err(e)) => return e,
    };
    if len > 0 {
        copy(dst, src, len, stream);
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const libc::c_void, len: usize) -> CUresult {
    copy_checked(dst as usize, src as usize, len, true, false, std::ptr::null_mut())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut libc::c_void, src: u64, len: usize) -> CUresult {
    copy_checked(dst as usize, src as usize, len, false, true, std::ptr::null_mut())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const libc::c_void,
    len: usize,
    stream: *mut libc::c_void,
) -> CUresult {
    copy_checked(dst as usize, src as usize, len, true, false, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut libc::c_void,
    src: u64,
    len: usize,
    stream: *mut libc::c_void,
) -> CUresult {
    copy_checked(dst as usize, src as usize, len, false, true, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, n: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    let alias = match device_alias(dst, n) {
        Ok(a) => a,
        Err(e) => return e,
    };
    legacy_stream().sync();
    // SAFETY: the alias of a range inside a live allocation (checked).
    unsafe { std::ptr::write_bytes(alias as *mut u8, value, n) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: u64, value: u32, n: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if !dst.is_multiple_of(4) {
        return INVALID_VALUE;
    }
    let alias = match device_alias(dst, n * 4) {
        Ok(a) => a,
        Err(e) => return e,
    };
    legacy_stream().sync();
    for i in 0..n {
        // SAFETY: the alias of a range inside a live allocation (checked),
        // 4-byte aligned as the device address is (mappings are page-aligned).
        unsafe { *(alias as *mut u32).add(i) = value };
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut libc::c_void, _flags: u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    let s = Box::into_raw(Box::new(Stream::new()));
    state().streams.lock().unwrap().push(s as usize);
    // SAFETY: out-pointer per the driver contract; the box is freed by cuStreamDestroy_v2.
    unsafe { *stream = s.cast() };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut libc::c_void) -> CUresult {
    if stream.is_null() {
        return INVALID_HANDLE;
    }
    {
        let mut streams = state().streams.lock().unwrap();
        let Some(i) = streams.iter().position(|&s| s == stream as usize) else { return INVALID_HANDLE };
        streams.swap_remove(i);
    }
    // SAFETY: a handle from cuStreamCreate, destroyed once (unregistered above);
    // queued work finishes first.
    let s = unsafe { Box::from_raw(stream as *mut Stream) };
    s.sync();
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut libc::c_void) -> CUresult {
    match stream_ref(stream) {
        Some(s) => s.sync(),
        None => legacy_stream().sync(),
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: *mut libc::c_void,
    event: *mut libc::c_void,
    _flags: u32,
) -> CUresult {
    let Some(ev) = event_ref(event) else { return INVALID_HANDLE };
    // The wait is for the record the event holds now, not a later one.
    let generation = ev.latest();
    match stream_ref(stream) {
        Some(s) => s.push(Task::Wait(ev, generation)),
        None => legacy_stream().push(Task::Wait(ev, generation)),
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut libc::c_void, _flags: u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if let Some(c) = state().events_created.get(current_device()) {
        c.fetch_add(1, Ordering::AcqRel);
    }
    // An event never recorded counts as complete, as in CUDA.
    // SAFETY: out-pointer per the driver contract; freed by cuEventDestroy_v2.
    unsafe { *event = Box::into_raw(Box::new(Event::new())).cast() };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: *mut libc::c_void, stream: *mut libc::c_void) -> CUresult {
    let Some(ev) = event_ref(event) else { return INVALID_HANDLE };
    let generation = ev.record();
    match stream_ref(stream) {
        Some(s) => s.push(Task::Signal(ev, generation)),
        None => legacy_stream().push(Task::Signal(ev, generation)),
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(event: *mut libc::c_void) -> CUresult {
    match event_ref(event) {
        Some(ev) if ev.is_set() => SUCCESS,
        Some(_) => NOT_READY,
        None => INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: *mut libc::c_void) -> CUresult {
    match event_ref(event) {
        Some(ev) => {
            ev.wait_for(ev.latest());
            SUCCESS
        }
        None => INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut libc::c_void) -> CUresult {
    if event.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: a handle from cuEventCreate, destroyed once.
    drop(unsafe { Box::from_raw(event as *mut Arc<Event>) });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(p: *mut libc::c_void, size: usize, _flags: u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if p.is_null() || size == 0 {
        return INVALID_VALUE;
    }
    // A driver pins every page, faulting in those not yet present, which
    // is what makes pinning cost far more than a copy of the same bytes:
    // populate them (writable, contents unchanged), as pinning does. Best
    // effort: a kernel without MADV_POPULATE_WRITE (5.14) skips it.
    let page = host_page();
    let start = (p as usize) & !(page - 1);
    let end = (p as usize).saturating_add(size).next_multiple_of(page);
    // SAFETY: the caller registers memory it owns, mapped for `size` bytes
    // from `p`; populating its pages changes no byte of it.
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
    state().host_registered.lock().unwrap().insert(p as usize, size);
    SUCCESS
}

/// Page-locked host memory, as `cuMemAllocHost` gives (here: fresh pages,
/// populated as pinning does), freed by [`cuMemFreeHost`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut libc::c_void, size: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if pp.is_null() || size == 0 {
        return INVALID_VALUE;
    }
    // SAFETY: an anonymous private mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return OUT_OF_MEMORY;
    }
    state().host_allocs.lock().unwrap().insert(p as usize, size);
    // SAFETY: out-pointer per the driver contract.
    unsafe { *pp = p };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut libc::c_void) -> CUresult {
    // Freeing waits for the device, as the driver's does.
    sync_all_streams();
    legacy_stream().sync();
    match state().host_allocs.lock().unwrap().remove(&(p as usize)) {
        Some(size) => {
            // SAFETY: the mapping cuMemAllocHost_v2 made, unmapped once.
            unsafe { libc::munmap(p, size) };
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut libc::c_void) -> CUresult {
    if state().host_registered.lock().unwrap().remove(&(p as usize)).is_some() { SUCCESS } else { INVALID_VALUE }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut libc::c_void,
    dptr: u64,
    size: usize,
    kind: u32,
    flags: u64,
) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    // DMA_BUF_FD only; flags 0 or the PCIe mapping type (CUDA 12.8+), which
    // a test can make the "platform" refuse (attribute 0x7fff0001 set to 1).
    if kind != 1 || handle.is_null() || flags > 1 || size == 0 {
        return INVALID_VALUE;
    }
    if flags == 1 && attribute(0x7fff_0001) == 1 {
        return NOT_SUPPORTED;
    }
    state().last_export_flags.store(flags as u32, Ordering::Release);
    // The driver exports whole host pages only.
    let page = host_page() as u64;
    if !dptr.is_multiple_of(page) || !(size as u64).is_multiple_of(page) {
        return INVALID_VALUE;
    }
    let Some((_, fd)) = mapping_alias(dptr, size) else { return INVALID_VALUE };
    // SAFETY: duplicates the allocation's own memfd (an RDMA driver that
    // supports dma-buf would reject a memfd; soft-RoCE refuses dma-buf anyway).
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return OUT_OF_MEMORY;
    }
    // SAFETY: the handle of a DMA_BUF_FD range is an int.
    unsafe { *(handle as *mut i32) = dup };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFlushGPUDirectRDMAWrites(target: u32, scope: u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if target != 0 || !(scope == 100 || scope == 200) {
        return INVALID_VALUE;
    }
    if attribute(117) & 1 == 0 {
        return NOT_SUPPORTED;
    }
    state().flushes.fetch_add(1, Ordering::Relaxed);
    SUCCESS
}

// ---- VMM: cuMemCreate / cuMemAddressReserve / cuMemMap / cuMemSetAccess ----

/// `CUmemAllocationProp`: type u32, requestedHandleTypes u32, location
/// {type u32, id i32}, win32HandleMetaData *void, allocFlags {compressionType
/// u8, gpuDirectRDMACapable u8, usage u16, reserved [u8; 4]}.
#[repr(C)]
struct AllocationProp {
    kind: u32,
    handle_types: u32,
    location_kind: u32,
    location_id: i32,
    win32: *mut libc::c_void,
    compression: u8,
    gdr: u8,
    usage: u16,
    reserved: [u8; 4],
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const libc::c_void,
    _option: u32,
) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if granularity.is_null() || prop.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer.
    unsafe { *granularity = VMM_GRANULARITY };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(handle: *mut u64, size: usize, prop: *const libc::c_void, flags: u64) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if handle.is_null() || prop.is_null() || flags != 0 || size == 0 || !size.is_multiple_of(VMM_GRANULARITY) {
        return INVALID_VALUE;
    }
    // SAFETY: the caller passes a CUmemAllocationProp.
    let p = unsafe { &*(prop as *const AllocationProp) };
    // CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE.
    if p.kind != 1 || p.location_kind != 1 || p.location_id < 0 || p.location_id >= devices() {
        return INVALID_VALUE;
    }
    if p.gdr != 0 && attribute(110) == 0 {
        return NOT_SUPPORTED;
    }
    let Some(fd) = new_memfd(size) else { return OUT_OF_MEMORY };
    let h = state().next_handle.fetch_add(1, Ordering::Relaxed);
    state().physical.lock().unwrap().insert(h, Physical { fd, len: size, gdr: p.gdr != 0 });
    // SAFETY: non-null out-pointer.
    unsafe { *handle = h };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    match state().physical.lock().unwrap().remove(&handle) {
        Some(p) => {
            // SAFETY: ours, closed once; mappings hold their own descriptor.
            unsafe { libc::close(p.fd) };
            SUCCESS
        }
        None => INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    size: usize,
    _alignment: usize,
    addr: u64,
    flags: u64,
) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if ptr.is_null() || addr != 0 || flags != 0 || size == 0 || !size.is_multiple_of(VMM_GRANULARITY) {
        return INVALID_VALUE;
    }
    // Reserve a granularity-aligned range: over-reserve, then trim.
    let over = size + VMM_GRANULARITY;
    // SAFETY: an anonymous PROT_NONE reservation at the kernel's choice.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return OUT_OF_MEMORY;
    }
    let base = base as usize;
    let start = base.div_ceil(VMM_GRANULARITY) * VMM_GRANULARITY;
    // SAFETY: trims the parts of our own reservation outside [start, start+size).
    unsafe {
        if start > base {
            libc::munmap(base as *mut libc::c_void, start - base);
        }
        let end = start + size;
        if base + over > end {
            libc::munmap(end as *mut libc::c_void, base + over - end);
        }
    }
    state().reserved.lock().unwrap().insert(start, size);
    // SAFETY: non-null out-pointer.
    unsafe { *ptr = start as u64 };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(ptr: u64, size: usize) -> CUresult {
    let mut reserved = state().reserved.lock().unwrap();
    if reserved.get(&(ptr as usize)) != Some(&size) {
        return INVALID_VALUE;
    }
    let (lo, hi) = (ptr as usize, ptr as usize + size);
    if state().allocs.lock().unwrap().values().any(|a| a.map < hi && a.map + a.map_len > lo) {
        return INVALID_VALUE; // still mapped
    }
    reserved.remove(&(ptr as usize));
    // SAFETY: our reservation, freed once.
    unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(ptr: u64, size: usize, offset: usize, handle: u64, flags: u64) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if flags != 0 || offset != 0 || size == 0 {
        return INVALID_VALUE;
    }
    let (lo, hi) = (ptr as usize, ptr as usize + size);
    let inside = state().reserved.lock().unwrap().iter().any(|(&s, &l)| lo >= s && hi <= s + l);
    if !inside || state().allocs.lock().unwrap().values().any(|a| a.map < hi && a.map + a.map_len > lo) {
        return INVALID_VALUE;
    }
    let physical = state().physical.lock().unwrap();
    let Some(p) = physical.get(&handle) else { return INVALID_HANDLE };
    if size != p.len {
        return INVALID_VALUE;
    }
    // SAFETY: duplicates the handle's memfd for this mapping.
    let fd = unsafe { libc::fcntl(p.fd, libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return OUT_OF_MEMORY;
    }
    let Some((map, alias)) = map_twice(fd, size, Some(lo)) else {
        // SAFETY: ours, closed once.
        unsafe { libc::close(fd) };
        return OUT_OF_MEMORY;
    };
    let a = Alloc {
        dptr: map as u64,
        len: size,
        map,
        map_len: size,
        alias,
        fd,
        sync_memops: 0,
        vmm: true,
        gdr: p.gdr,
        accessible: false,
        id: state().allocations.fetch_add(1, Ordering::Relaxed) + 1,
    };
    state().allocs.lock().unwrap().insert(map, a);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(ptr: u64, size: usize, desc: *const libc::c_void, count: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if desc.is_null() || count == 0 {
        return INVALID_VALUE;
    }
    // CUmemAccessDesc: location {type u32, id i32}, flags u32 (3: read-write).
    // SAFETY: the caller passes `count` descriptors.
    let d = unsafe { std::slice::from_raw_parts(desc as *const [u32; 3], count) };
    let rw = d.iter().any(|x| x[0] == 1 && x[2] == 3);
    let mut allocs = state().allocs.lock().unwrap();
    let mut found = false;
    for a in allocs.values_mut().filter(|a| a.vmm && a.map >= ptr as usize && a.map + a.map_len <= ptr as usize + size)
    {
        a.accessible = rw;
        found = true;
    }
    if found { SUCCESS } else { INVALID_VALUE }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    sync_all_streams();
    let mut allocs = state().allocs.lock().unwrap();
    let Some(a) = allocs.remove(&(ptr as usize)) else { return INVALID_VALUE };
    if a.map_len != size || !a.vmm {
        allocs.insert(a.map, a);
        return INVALID_VALUE;
    }
    unmap(&a);
    // Back to a plain reservation.
    // SAFETY: MAP_FIXED over our own mapping inside our reservation.
    unsafe {
        libc::mmap(
            a.map as *mut libc::c_void,
            a.map_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    SUCCESS
}

// ---- the nvidia-peermem stand-in (when preloaded) ----

type RegMrIova2 = unsafe extern "C" fn(*mut libc::c_void, *mut libc::c_void, usize, u64, u32) -> *mut libc::c_void;
type RegMr = unsafe extern "C" fn(*mut libc::c_void, *mut libc::c_void, usize, i32) -> *mut libc::c_void;

fn next_symbol(name: &std::ffi::CStr) -> *mut libc::c_void {
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) }
}

fn next_iova2() -> Option<RegMrIova2> {
    let f = next_symbol(c"ibv_reg_mr_iova2");
    // SAFETY: libibverbs' ibv_reg_mr_iova2 has this signature.
    (!f.is_null()).then(|| unsafe { std::mem::transmute::<*mut libc::c_void, RegMrIova2>(f) })
}

/// Registers device memory as nvidia-peermem would let a NIC: the pages
/// behind `addr..addr+len` (through the alias), addressed by `iova`.
fn register_device(pd: *mut libc::c_void, addr: u64, len: usize, iova: u64, access: u32) -> Option<*mut libc::c_void> {
    let (alias, _) = mapping_alias(addr, len)?;
    state().last_device_access.store(access, Ordering::Release);
    state().device_registrations.fetch_add(1, Ordering::AcqRel);
    let Some(reg) = next_iova2() else {
        // SAFETY: errno is thread-local.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return Some(std::ptr::null_mut());
    };
    // SAFETY: forwards to libibverbs with the alias of a live allocation.
    Some(unsafe { reg(pd, alias as *mut libc::c_void, len, iova, access) })
}

/// `ibv_reg_mr`, interposed when this library is preloaded: device memory
/// is registered as nvidia-peermem would resolve it; anything else goes to
/// libibverbs unchanged.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut libc::c_void,
    addr: *mut libc::c_void,
    len: usize,
    access: i32,
) -> *mut libc::c_void {
    if let Some(mr) = register_device(pd, addr as u64, len, addr as u64, access as u32) {
        return mr;
    }
    let f = next_symbol(c"ibv_reg_mr");
    if f.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: libibverbs' ibv_reg_mr has this signature.
    let next = unsafe { std::mem::transmute::<*mut libc::c_void, RegMr>(f) };
    // SAFETY: forwarded unchanged.
    unsafe { next(pd, addr, len, access) }
}

/// `ibv_reg_mr_iova2`, interposed likewise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut libc::c_void,
    addr: *mut libc::c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut libc::c_void {
    if let Some(mr) = register_device(pd, addr as u64, len, iova, access) {
        return mr;
    }
    match next_iova2() {
        // SAFETY: forwarded unchanged.
        Some(next) => unsafe { next(pd, addr, len, iova, access) },
        None => std::ptr::null_mut(),
    }
}

// ---- test hooks ----

/// Test hook: how many times `cuFlushGPUDirectRDMAWrites` was called.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_flush_count() -> u64 {
    state().flushes.load(Ordering::Relaxed)
}

/// Test hook: sets device attribute `attr` of every device to `value`
/// (`cuDeviceGetAttribute` numbering), for devices opened from now on.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_set_attribute(attr: u32, value: i32) {
    state().attrs.lock().unwrap().insert(attr, value);
}

/// Test hook: every attribute back to its default.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_reset_attributes() {
    state().attrs.lock().unwrap().clear();
}

/// Queues a fill on `stream` (null: the legacy stream), after `delay`.
fn fill_async(dptr: u64, value: u32, width: usize, n: usize, stream: *mut libc::c_void, delay: Duration) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if !dptr.is_multiple_of(width as u64) {
        return INVALID_VALUE;
    }
    let len = n * width;
    let dst = match device_alias(dptr, len) {
        Ok(a) => a,
        Err(e) => return e,
    };
    let task = Task::Fill { dst, len, value, width, delay };
    match stream_ref(stream) {
        Some(s) => s.push(task),
        None => legacy_stream().push(task),
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async(dst: u64, value: u8, n: usize, stream: *mut libc::c_void) -> CUresult {
    fill_async(dst, u32::from(value), 1, n, stream, Duration::ZERO)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32Async(dst: u64, value: u32, n: usize, stream: *mut libc::c_void) -> CUresult {
    fill_async(dst, value, 4, n, stream, Duration::ZERO)
}

/// Test hook: a slow "kernel" on `stream` (null: the legacy stream) that,
/// after `delay_us` microseconds, fills `n` 32-bit words at `dptr` with
/// `value`: `cuMemsetD32Async` that lands late, so a missing or stale
/// producer fence shows up as wrong data.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_produce(
    stream: *mut libc::c_void,
    dptr: u64,
    n: usize,
    value: u32,
    delay_us: u32,
) -> CUresult {
    fill_async(dptr, value, 4, n, stream, Duration::from_micros(u64::from(delay_us)))
}

/// Test hook: the access flags of the last registration of device memory
/// through the nvidia-peermem stand-in, and how many there were (0: none).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_last_device_registration(count: *mut u64) -> u32 {
    if !count.is_null() {
        // SAFETY: a non-null out-pointer from the caller.
        unsafe { *count = state().device_registrations.load(Ordering::Acquire) };
    }
    state().last_device_access.load(Ordering::Acquire)
}

/// Test hook: how many events were made with device `dev`'s context
/// current (0 for a device past the eighth).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_events_created(dev: u32) -> u64 {
    state().events_created.get(dev as usize).map_or(0, |c| c.load(Ordering::Acquire))
}

/// Test hook: the flags of the last successful dma-buf export
/// (`u32::MAX`: none yet).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_last_export_flags() -> u32 {
    state().last_export_flags.load(Ordering::Acquire)
}
