//! # A stand-in for `libcuda`, for tests only
//!
//! **Never use this outside tests.** It lets gpu-rdma's CUDA code paths run
//! on machines without a GPU (CI, the soft-RoCE VM): the real code, loaded
//! the real way (cudarc's run-time loading of `libcuda.so`), against a
//! library that implements only the driver calls gpu-rdma makes, with host
//! memory behind the "device" pointers.
//!
//! The test harness exposes it as `libcuda.so` in a private directory
//! (`target/cuda-stub/`) and puts that directory on `LD_LIBRARY_PATH` of
//! the test processes that ask for it, never anywhere a real driver could
//! be shadowed.
//!
//! What it models:
//! - devices (`GPU_RDMA_STUB_DEVICES`, default 1) with the GPUDirect
//!   attributes gpu-rdma reads; `GPU_RDMA_STUB_DMABUF=0` turns the dma-buf
//!   attribute off;
//! - allocations in 64 KiB-aligned `mmap`ed host memory, tracked, with
//!   `SYNC_MEMOPS` recorded; bad pointers and ranges are errors, as in the
//!   driver;
//! - streams as worker threads that run copies and event records in order,
//!   asynchronously, so a caller that does not wait for a copy sees stale
//!   data, as it would on a GPU;
//! - dma-buf export as a memfd of the right size (an RDMA driver that
//!   supports dma-buf would reject it; soft-RoCE refuses dma-buf anyway,
//!   which is the fallback gpu-rdma must handle).

#![allow(non_snake_case)]
// Every exported function has the CUDA driver's contract (see the comment
// above them): callers are C code or cudarc, which uphold it.
#![allow(clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;

type CUresult = u32;
const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_READY: CUresult = 600;

const GPU_PAGE: usize = 64 * 1024;

struct Alloc {
    len: usize,
    map_len: usize,
    base: usize,
    sync_memops: u32,
}

struct State {
    initialized: AtomicBool,
    allocs: Mutex<BTreeMap<u64, Alloc>>,
    host_registered: Mutex<BTreeMap<usize, usize>>,
    flushes: AtomicU64,
}

fn state() -> &'static State {
    static S: OnceLock<State> = OnceLock::new();
    S.get_or_init(|| State {
        initialized: AtomicBool::new(false),
        allocs: Mutex::new(BTreeMap::new()),
        host_registered: Mutex::new(BTreeMap::new()),
        flushes: AtomicU64::new(0),
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

/// Whether `ptr..ptr+len` lies inside one allocation.
fn in_device(ptr: u64, len: usize) -> bool {
    let allocs = state().allocs.lock().unwrap();
    allocs.range(..=ptr).next_back().is_some_and(|(&start, a)| ptr + len as u64 <= start + a.len as u64)
}

// ---- streams: a worker thread each, running tasks in order ----

enum Task {
    Copy { dst: usize, src: usize, len: usize },
    Signal(Arc<Event>),
    Wait(Arc<Event>),
}

struct Event {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Event {
    fn new(done: bool) -> Arc<Event> {
        Arc::new(Event { done: Mutex::new(done), cv: Condvar::new() })
    }
    fn set(&self, v: bool) {
        *self.done.lock().unwrap() = v;
        self.cv.notify_all();
    }
    fn is_set(&self) -> bool {
        *self.done.lock().unwrap()
    }
    fn wait(&self) {
        let mut d = self.done.lock().unwrap();
        while !*d {
            d = self.cv.wait(d).unwrap();
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
                // valid until the copy completes (the CUDA contract).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
            }
            Task::Signal(ev) => ev.set(true),
            Task::Wait(ev) => ev.wait(),
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
        let ev = Event::new(false);
        self.push(Task::Signal(Arc::clone(&ev)));
        ev.wait();
    }
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

/// Copies now (null stream) or queues the copy on the stream.
fn copy(dst: usize, src: usize, len: usize, stream: *mut libc::c_void) {
    match stream_ref(stream) {
        Some(s) => s.push(Task::Copy { dst, src, len }),
        // SAFETY: synchronous copy between ranges the caller guarantees valid.
        None => unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) },
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
    write_cstr(name, len, "gpu-rdma CUDA stand-in (host memory, tests only)")
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut i32, attr: u32, dev: i32) -> CUresult {
    if dev < 0 || dev >= devices() {
        return INVALID_DEVICE;
    }
    let value = match attr {
        75 => 9,                                          // compute capability major
        76 => 0,                                          // minor
        116 => 1,                                         // GPU_DIRECT_RDMA_SUPPORTED
        117 => 1,                                         // FLUSH_WRITES_OPTIONS: host flush
        118 => 0,                                         // WRITES_ORDERING: none (flush needed)
        124 => env_u32("GPU_RDMA_STUB_DMABUF", 1) as i32, // DMA_BUF_SUPPORTED
        _ => 0,
    };
    // SAFETY: out-pointer per the driver contract.
    unsafe { *v = value };
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    code(current())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if size == 0 || dptr.is_null() {
        return INVALID_VALUE;
    }
    // Over-allocate to hand out a GPU-page-aligned address, as cuMemAlloc does.
    let map_len = size + GPU_PAGE;
    // SAFETY: an anonymous mapping at an address of the kernel's choosing.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return OUT_OF_MEMORY;
    }
    let base = base as usize;
    let aligned = base.div_ceil(GPU_PAGE) * GPU_PAGE;
    state().allocs.lock().unwrap().insert(aligned as u64, Alloc { len: size, map_len, base, sync_memops: 0 });
    // SAFETY: non-null out-pointer.
    unsafe { *dptr = aligned as u64 };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    match state().allocs.lock().unwrap().remove(&dptr) {
        Some(a) => {
            // SAFETY: the mapping made by cuMemAlloc_v2, unmapped once.
            unsafe { libc::munmap(a.base as *mut libc::c_void, a.map_len) };
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
    match allocs.range_mut(..=ptr).next_back() {
        Some((&start, a)) if ptr < start + a.len as u64 => {
            // SAFETY: SYNC_MEMOPS takes an unsigned int.
            a.sync_memops = unsafe { *(value as *const u32) };
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut libc::c_void, attr: u32, ptr: u64) -> CUresult {
    let allocs = state().allocs.lock().unwrap();
    let Some((&start, a)) = allocs.range(..=ptr).next_back() else { return INVALID_VALUE };
    if ptr >= start + a.len as u64 {
        return INVALID_VALUE;
    }
    match attr {
        // SAFETY: SYNC_MEMOPS is an unsigned int out-value.
        6 => unsafe { *(data as *mut u32) = a.sync_memops },
        // SAFETY: MEMORY_TYPE is an unsigned int: CU_MEMORYTYPE_DEVICE.
        2 => unsafe { *(data as *mut u32) = 2 },
        _ => return INVALID_VALUE,
    }
    SUCCESS
}

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
    if (dst_dev && !in_device(dst as u64, len)) || (src_dev && !in_device(src as u64, len)) {
        return INVALID_VALUE;
    }
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
    if !in_device(dst, n) {
        return INVALID_VALUE;
    }
    // SAFETY: the range is inside a live allocation (checked).
    unsafe { std::ptr::write_bytes(dst as *mut u8, value, n) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: u64, value: u32, n: usize) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if !dst.is_multiple_of(4) || !in_device(dst, n * 4) {
        return INVALID_VALUE;
    }
    for i in 0..n {
        // SAFETY: the range is inside a live allocation (checked) and aligned.
        unsafe { *(dst as *mut u32).add(i) = value };
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut libc::c_void, _flags: u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    // SAFETY: out-pointer per the driver contract; the box is freed by cuStreamDestroy_v2.
    unsafe { *stream = Box::into_raw(Box::new(Stream::new())).cast() };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut libc::c_void) -> CUresult {
    if stream.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: a handle from cuStreamCreate, destroyed once; queued work finishes first.
    let s = unsafe { Box::from_raw(stream as *mut Stream) };
    s.sync();
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut libc::c_void) -> CUresult {
    if let Some(s) = stream_ref(stream) {
        s.sync();
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
    match stream_ref(stream) {
        Some(s) => s.push(Task::Wait(ev)),
        None => ev.wait(),
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut libc::c_void, _flags: u32) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    // An event never recorded counts as complete, as in CUDA.
    // SAFETY: out-pointer per the driver contract; freed by cuEventDestroy_v2.
    unsafe { *event = Box::into_raw(Box::new(Event::new(true))).cast() };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: *mut libc::c_void, stream: *mut libc::c_void) -> CUresult {
    let Some(ev) = event_ref(event) else { return INVALID_HANDLE };
    match stream_ref(stream) {
        Some(s) => {
            ev.set(false);
            s.push(Task::Signal(ev));
        }
        None => ev.set(true),
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
            ev.wait();
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
    state().host_registered.lock().unwrap().insert(p as usize, size);
    SUCCESS
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
    _flags: u64,
) -> CUresult {
    if let Err(e) = current() {
        return e;
    }
    if kind != 1 || handle.is_null() || !in_device(dptr, size) {
        return INVALID_VALUE;
    }
    // SAFETY: memfd_create with a static NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"gpu-rdma-stub-dmabuf".as_ptr(), libc::MFD_CLOEXEC) };
    // SAFETY: a descriptor just created here.
    if fd < 0 || unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
        return OUT_OF_MEMORY;
    }
    // SAFETY: the handle of a DMA_BUF_FD range is an int.
    unsafe { *(handle as *mut i32) = fd };
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
    state().flushes.fetch_add(1, Ordering::Relaxed);
    SUCCESS
}

/// Test hook: how many times `cuFlushGPUDirectRDMAWrites` was called.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_rdma_stub_flush_count() -> u64 {
    state().flushes.load(Ordering::Relaxed)
}
