//! RDMA-able device memory, streams and events, pinned host memory.

use std::any::Any;
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::device::{CtxGuard, CudaDevice};
use super::result::{check, check_code, driver};
use crate::error::{Error, Result};
use crate::host_memory::HostMemory;

/// GPU page size: [`CudaBuffer::alloc`] rounds lengths up to it, since
/// nvidia-peermem pins GPU memory in 64 KiB pages. Addresses are another
/// matter: `cuMemAlloc` promises 256-byte alignment and nothing more, and
/// memory from a framework's allocator (a tensor inside a larger block)
/// starts wherever it starts; nothing here assumes more.
pub const GPU_PAGE: usize = 64 * 1024;

/// A dma-buf exported for a device range: the descriptor covers whole host
/// pages around the range, which starts `offset` bytes into it.
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf descriptor.
    pub fd: OwnedFd,
    /// Where the requested range starts inside the dma-buf.
    pub offset: u64,
    /// The dma-buf's length (whole host pages).
    pub len: usize,
}

/// A CUDA stream.
pub struct CudaStream {
    stream: sys::CUstream,
    device: CudaDevice,
    owned: bool,
    /// A framework's stream this one stands for, kept alive with it.
    _theirs: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
}

// SAFETY: CUDA streams may be used from any thread (the driver is thread-safe);
// the handle is immutable.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// A new non-blocking stream on `device`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let _ctx = CtxGuard::enter(device)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer; the context is current; destroyed in Drop.
            unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        Ok(CudaStream { stream, device: device.clone(), owned: true, _theirs: None })
    }

    /// Wraps a stream someone else created (a framework's), without taking
    /// ownership: it is not destroyed when this value is dropped.
    ///
    /// # Safety
    /// `stream` must be a live stream of `device`'s primary context (or the
    /// legacy default stream, null) for as long as this value lives.
    pub unsafe fn from_raw(device: &CudaDevice, stream: sys::CUstream) -> Self {
        CudaStream { stream, device: device.clone(), owned: false, _theirs: None }
    }

    /// A framework's cudarc stream, to fence with: what is queued on it
    /// (`CudaBuffer::ready_after`, `LocalSlice::after`). It is kept alive
    /// by this value and never destroyed by it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream of a non-primary context
    /// (this crate works in each device's primary context);
    /// [`Error::CudaUnavailable`], [`Error::NoCudaDevice`].
    pub fn from_cudarc(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<Self> {
        if !stream.context().is_primary() {
            return Err(Error::InvalidArgument(
                "a cudarc stream of a non-primary context: this crate works in each device's primary context".into(),
            ));
        }
        let device = CudaDevice::open(stream.context().ordinal())?;
        Ok(CudaStream {
            stream: stream.cu_stream(),
            device,
            owned: false,
            _theirs: Some(std::sync::Arc::clone(stream)),
        })
    }

    /// The raw handle.
    pub fn as_raw(&self) -> sys::CUstream {
        self.stream
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Blocks until everything queued on it is done.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn synchronize(&self) -> Result<()> {
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: live stream of the current context.
        check(unsafe { sys::cuStreamSynchronize(self.stream) }, "cuStreamSynchronize")
    }

    /// Makes later work on this stream wait for `event` (on the GPU, without blocking the CPU).
    pub(crate) fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: live stream and event.
        check(unsafe { sys::cuStreamWaitEvent(self.stream, event.event, 0) }, "cuStreamWaitEvent")
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(_ctx) = CtxGuard::enter(&self.device) else { return };
        // SAFETY: created by cuStreamCreate and destroyed once; the driver lets
        // queued work finish before releasing the stream.
        if let Err(e) = check(unsafe { sys::cuStreamDestroy_v2(self.stream) }, "cuStreamDestroy") {
            tracing::error!("{e}");
        }
    }
}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStream").field("device", &self.device.ordinal()).field("owned", &self.owned).finish()
    }
}

/// A CUDA event (timing disabled): marks a point in a stream.
pub struct CudaEvent {
    event: sys::CUevent,
    device: CudaDevice,
}

// SAFETY: CUDA events may be used from any thread; the handle is immutable.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Records an event at the current end of `stream`.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn record(stream: &CudaStream) -> Result<Self> {
        let _ctx = CtxGuard::enter(&stream.device)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: valid out-pointer; the context is current; destroyed in Drop.
            unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
            "cuEventCreate",
        )?;
        let ev = CudaEvent { event, device: stream.device.clone() };
        // SAFETY: live event and stream of the current context.
        check(unsafe { sys::cuEventRecord(ev.event, stream.stream) }, "cuEventRecord")?;
        Ok(ev)
    }

    /// Records it again, at the current end of `stream` (any stream of its
    /// device): from now on it stands for that point only, as CUDA's
    /// events do. An earlier record still queued no longer counts.
    ///
    /// # Errors
    /// [`Error::Cuda`], among others when the driver refuses a stream of
    /// another device.
    pub fn record_again(&self, stream: &CudaStream) -> Result<()> {
        let _ctx = CtxGuard::enter(&stream.device)?;
        // SAFETY: live event and stream; the context is current.
        check(unsafe { sys::cuEventRecord(self.event, stream.stream) }, "cuEventRecord")
    }

    /// Whether the work before it is done (never blocks).
    ///
    /// # Errors
    /// [`Error::Cuda`] if that work failed.
    pub fn is_done(&self) -> Result<bool> {
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: live event.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery").map(|()| false),
        }
    }

    /// Blocks until the work before it is done.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn synchronize(&self) -> Result<()> {
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: live event.
        check(unsafe { sys::cuEventSynchronize(self.event) }, "cuEventSynchronize")
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let Ok(_ctx) = CtxGuard::enter(&self.device) else { return };
        // SAFETY: created by cuEventCreate and destroyed once.
        if let Err(e) = check(unsafe { sys::cuEventDestroy_v2(self.event) }, "cuEventDestroy") {
            tracing::error!("{e}");
        }
    }
}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaEvent").field("device", &self.device.ordinal()).finish()
    }
}

enum Owner {
    /// Allocated here with `cuMemAlloc`; freed with `cuMemFree`.
    Ours,
    /// Someone else's memory (a framework's tensor), kept alive by this value.
    Foreign(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

/// The device allocation a buffer lies in ([`CudaBuffer::allocation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Allocation {
    /// Its first device address.
    pub base: sys::CUdeviceptr,
    /// Its length in bytes.
    pub len: usize,
    /// The driver's `BUFFER_ID`: unique to this allocation for the life of
    /// the process.
    pub id: u64,
}

/// How synchronous memory operations on a buffer are ordered with RDMA
/// (`SYNC_MEMOPS`: a `cuMemcpy` returns only once the bytes are where a
/// NIC will see them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMemops {
    /// `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` is set on the pointer
    /// (`cuMemAlloc` memory).
    Pointer,
    /// The pointer refuses the attribute (VMM memory: `cuMemCreate`, as
    /// PyTorch's expandable segments and NCCL's allocator hand out), so the
    /// context flag `CU_CTX_SYNC_MEMOPS` is set instead (CUDA 12.1+).
    Context,
    /// Neither could be set (VMM memory on a driver older than 12.1):
    /// synchronous copies are not ordered with the NIC; fence with
    /// [`CudaBuffer::ready_after`].
    Unavailable,
}

/// RDMA-able device memory: allocated with `cuMemAlloc` (never from the
/// stream-ordered pool, which nvidia-peermem cannot register), rounded up to
/// whole 64 KiB GPU pages, with `SYNC_MEMOPS` set (see [`SyncMemops`]) so
/// that copies and remote accesses are ordered. Register it with
/// [`Domain::register`](crate::Domain::register) to use it in operations.
///
/// **Producer and consumer fences.** The NIC reads and writes this memory
/// outside CUDA's streams. Before an operation reads it (send, write) the
/// kernels producing the contents must be done; before one writes it
/// (receive, read) the kernels still reading the old contents must be done.
/// Call [`ready_after`](Self::ready_after) with the stream that runs that
/// work before posting each such operation, once per stream when several
/// produce it: the operation waits for the work queued on each of them up
/// to its call (on the GPU for staged copies; a direct operation is kept
/// back until they are done, without blocking its poster), and never for
/// anything else. Without it the
/// crate assumes the contents are settled (after a synchronous copy or the
/// caller's own synchronize); it never synchronizes the whole context, which
/// would wait for unrelated work and is illegal during graph capture.
///
/// Its copy methods take `&self`: device memory is not Rust memory, so a
/// copy racing with the NIC (into a buffer a peer may write, say) can mix
/// old and new bytes but never breaks memory safety. Copy when the
/// operations touching the range have completed.
pub struct CudaBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    device: CudaDevice,
    /// The fences operations posted from now on wait for: one per
    /// [`ready_after`](Self::ready_after), until its work is known done.
    ready: std::sync::Mutex<Vec<std::sync::Arc<CudaEvent>>>,
    sync_memops: SyncMemops,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`.
    gdr_capable: bool,
    owner: Owner,
}

// SAFETY: a device allocation may be used from any thread with its context.
unsafe impl Send for CudaBuffer {}
// SAFETY: shared access only reads immutable fields or goes through the
// thread-safe driver.
unsafe impl Sync for CudaBuffer {}

impl CudaBuffer {
    /// The value for `ptr..ptr + len`, before its attributes are asked.
    fn wrap(ptr: sys::CUdeviceptr, len: usize, device: &CudaDevice, owner: Owner) -> Self {
        CudaBuffer {
            ptr,
            len,
            device: device.clone(),
            ready: Default::default(),
            sync_memops: SyncMemops::Pointer,
            gdr_capable: true,
            owner,
        }
    }

    /// Allocates `len` bytes (rounded up to 64 KiB) on `device`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero bytes; [`Error::Cuda`]
    /// (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn alloc(device: &CudaDevice, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate a zero-byte GPU buffer".into()));
        }
        let len = len.div_ceil(GPU_PAGE) * GPU_PAGE;
        let _ctx = CtxGuard::enter(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current; freed in Drop.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
        let buf = CudaBuffer::wrap(ptr, len, device, Owner::Ours);
        // Our own cuMemAlloc memory takes the pointer attribute: failing is an error.
        buf.set_sync_memops()?;
        Ok(buf)
    }

    /// Wraps device memory someone else owns (a framework's tensor) so it
    /// can be registered. `keep_alive` is held until this value is dropped;
    /// the memory is not freed here.
    ///
    /// Any device pointer works: `cuMemAlloc` memory, a sub-allocation at
    /// any offset inside a larger block (as framework allocators hand out),
    /// or VMM memory (`cuMemCreate` + `cuMemMap`). On VMM memory the
    /// `SYNC_MEMOPS` pointer attribute is refused by the driver; the context
    /// flag is used instead where the driver has it ([`SyncMemops`]). The
    /// driver's `IS_GPU_DIRECT_RDMA_CAPABLE` answer is kept
    /// ([`gdr_capable`](Self::gdr_capable)): memory made without
    /// `gpuDirectRDMACapable` is never registered on a direct path, and the
    /// path report says why.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of `device`, allocated with
    /// `cuMemAlloc` or `cuMemCreate` (not the stream-ordered pool if the
    /// nvidia-peermem path is to be used), that stays allocated and is not
    /// used by anything else for as long as this value (and any registration
    /// made from it) lives, which `keep_alive` or the caller must guarantee.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a null pointer or zero length;
    /// [`Error::Cuda`] when the driver does not know the pointer.
    pub unsafe fn from_raw(
        device: &CudaDevice,
        ptr: sys::CUdeviceptr,
        len: usize,
        keep_alive: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        if ptr == 0 || len == 0 {
            return Err(Error::InvalidArgument("a foreign GPU buffer needs a non-null pointer and a length".into()));
        }
        let mut buf = CudaBuffer::wrap(ptr, len, device, Owner::Foreign(keep_alive));
        buf.gdr_capable = buf.query_gdr_capable()?;
        buf.sync_memops = match buf.set_sync_memops() {
            Ok(()) => SyncMemops::Pointer,
            // VMM memory refuses the pointer attribute.
            Err(e @ Error::Cuda { .. }) => buf.set_context_sync_memops(&e)?,
            Err(e) => return Err(e),
        };
        Ok(buf)
    }

    /// `len` bytes at `offset` of `block`, as a buffer of their own: a
    /// tensor carved from a framework's block. The view keeps the block
    /// allocated while it (and any registration made from it) lives.
    /// Registered on a direct path, it is served the whole block's
    /// registration ([`Domain::set_registration_cache`](crate::Domain::set_registration_cache)).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the block's end; [`Error::InvalidArgument`]
    /// for zero bytes; [`Error::Cuda`].
    pub fn view(block: &std::sync::Arc<CudaBuffer>, offset: usize, len: usize) -> Result<Self> {
        Error::check_local(offset, len, block.len)?;
        // SAFETY: the range lies inside `block`'s device memory (checked),
        // which the `Arc` moved into the guard keeps allocated for as long as
        // the view lives; GPU memory is never reached through Rust references,
        // so overlapping views mix bytes, never break memory safety.
        unsafe {
            CudaBuffer::from_raw(&block.device, block.ptr + offset as u64, len, Box::new(std::sync::Arc::clone(block)))
        }
    }

    /// Takes a framework's cudarc `CudaSlice` (candle's `CudaStorage`
    /// holds one) as GPU memory to register: its device memory as it is,
    /// no copy. The slice is freed by cudarc, as it frees it, when this
    /// buffer is dropped, which is after every registration made from it
    /// (and so after the NIC is done with it). The work queued on the
    /// slice's stream so far (its producer) is this buffer's fence
    /// ([`ready_after`](Self::ready_after)): an operation posted from it
    /// waits for that work without blocking its poster.
    ///
    /// Memory from cudarc's stream-ordered pool (`cuMemAllocAsync`, which
    /// cudarc uses where the device supports it) does not register through
    /// nvidia-peermem: the path report says so, and dma-buf or the staged
    /// path serve it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty slice, or one of a context
    /// that is not its device's primary context (this crate works in the
    /// primary context, as cudarc's `CudaContext::new` does);
    /// [`Error::CudaUnavailable`], [`Error::Cuda`].
    pub fn from_cudarc<T: 'static>(slice: cudarc::driver::CudaSlice<T>) -> Result<Self> {
        let (ptr, bytes, producer) = cudarc_parts(&slice)?;
        Self::from_cudarc_parts(ptr, bytes, producer, Box::new(slice))
    }

    /// As [`from_cudarc`](Self::from_cudarc), for a slice the framework
    /// keeps using: this buffer holds one reference, so the memory stays
    /// allocated until both are gone. What the framework writes into it
    /// while an operation reads it is the framework's to order (fence the
    /// operation with `LocalSlice::after`, or the buffer with
    /// [`ready_after`](Self::ready_after)); nothing it does can free it
    /// under the NIC.
    ///
    /// # Errors
    /// As [`from_cudarc`](Self::from_cudarc).
    pub fn from_cudarc_shared<T: 'static>(slice: std::sync::Arc<cudarc::driver::CudaSlice<T>>) -> Result<Self> {
        let (ptr, bytes, producer) = cudarc_parts(&slice)?;
        Self::from_cudarc_parts(ptr, bytes, producer, Box::new(slice))
    }

    fn from_cudarc_parts(
        ptr: sys::CUdeviceptr,
        bytes: usize,
        producer: CudaStream,
        keep: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        let device = producer.device.clone();
        // SAFETY: `ptr..ptr + bytes` is the slice's device memory, allocated by
        // cudarc in its device's primary context (checked by
        // `CudaStream::from_cudarc`, for the slice's stream's context),
        // the context `device` works in; `keep` owns the slice (or a reference
        // to it), which cudarc frees only when that is dropped, which is when
        // this buffer is dropped, after the registrations made from it.
        let buf = unsafe { CudaBuffer::from_raw(&device, ptr, bytes, keep) }?;
        buf.ready_after(&producer)?;
        Ok(buf)
    }

    /// A 4-byte pointer attribute (`unsigned int`: SYNC_MEMOPS,
    /// MEMORY_TYPE, IS_GPU_DIRECT_RDMA_CAPABLE): the driver's result code
    /// and the value.
    fn pointer_attribute(&self, attr: sys::CUpointer_attribute) -> Result<(sys::CUresult, u32)> {
        let _ctx = CtxGuard::enter(&self.device)?;
        let mut v: u32 = 0;
        // SAFETY: `v` is a valid out-pointer of the attribute's size (these
        // attributes are unsigned ints); the device's context is current.
        let rc = unsafe { sys::cuPointerGetAttribute((&mut v as *mut u32).cast(), attr, self.ptr) };
        Ok((rc, v))
    }

    /// The allocation this buffer lies in, as the driver knows it: where
    /// it starts, its length, and its identity (`BUFFER_ID`, never the
    /// same for two allocations in a process's life, even at one address).
    /// A framework's caching allocator hands out sub-ranges of larger
    /// blocks; this finds the block.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver does not know the pointer.
    pub fn allocation(&self) -> Result<Allocation> {
        use sys::CUpointer_attribute::{
            CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        };
        let _ctx = CtxGuard::enter(&self.device)?;
        let wide = |attr, op| self.wide_attribute(attr, self.ptr).and_then(|(rc, v)| check(rc, op).map(|()| v));
        Ok(Allocation {
            base: wide(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, "cuPointerGetAttribute(RANGE_START_ADDR)")?,
            len: wide(CU_POINTER_ATTRIBUTE_RANGE_SIZE, "cuPointerGetAttribute(RANGE_SIZE)")? as usize,
            id: wide(CU_POINTER_ATTRIBUTE_BUFFER_ID, "cuPointerGetAttribute(BUFFER_ID)")?,
        })
    }

    /// Whether `block` is still allocated: the driver names an allocation
    /// at its start with its identity (freed, the address is unknown or
    /// another allocation's).
    pub(crate) fn still_allocated(&self, block: &Allocation) -> bool {
        let Ok(_ctx) = CtxGuard::enter(&self.device) else {
            return false;
        };
        let id = self.wide_attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID, block.base);
        matches!(id, Ok((sys::CUresult::CUDA_SUCCESS, id)) if id == block.id)
    }

    /// An 8-byte pointer attribute of `ptr` (RANGE_START_ADDR, RANGE_SIZE,
    /// BUFFER_ID): the driver's result code and the value. The caller makes
    /// a context current.
    fn wide_attribute(&self, attr: sys::CUpointer_attribute, ptr: sys::CUdeviceptr) -> Result<(sys::CUresult, u64)> {
        let mut v: u64 = 0;
        // SAFETY: these attributes are 8-byte out-values (unsigned long long,
        // CUdeviceptr, size_t); `v` is one. Any address may be asked about:
        // one the driver does not know is answered with an error.
        let rc = unsafe { sys::cuPointerGetAttribute((&mut v as *mut u64).cast(), attr, ptr) };
        Ok((rc, v))
    }

    /// The driver's `IS_GPU_DIRECT_RDMA_CAPABLE` for the pointer; a driver
    /// too old for the attribute knows only `cuMemAlloc` memory, which is.
    fn query_gdr_capable(&self) -> Result<bool> {
        use sys::CUpointer_attribute::{
            CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE as GDR, CU_POINTER_ATTRIBUTE_MEMORY_TYPE as KIND,
        };
        let (rc, v) = self.pointer_attribute(GDR)?;
        match rc {
            sys::CUresult::CUDA_SUCCESS => Ok(v != 0),
            // Not device memory of this driver at all: the error says so.
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                let (known, _) = self.pointer_attribute(KIND)?;
                check(known, "cuPointerGetAttribute(MEMORY_TYPE)")?;
                Ok(true)
            }
            _ => Ok(true),
        }
    }

    /// The context-wide `CU_CTX_SYNC_MEMOPS`, for memory that refuses the
    /// pointer attribute; `Unavailable` (with a warning) where the driver
    /// predates `cuCtxSetFlags`.
    fn set_context_sync_memops(&self, refused: &Error) -> Result<SyncMemops> {
        let newer = crate::cuda::result::newer();
        let (Some(get_flags), Some(set_flags)) = (newer.ctx_get_flags, newer.ctx_set_flags) else {
            tracing::warn!(
                "GPU memory at {:#x}: SYNC_MEMOPS refused ({refused}) and the driver has no cuCtxSetFlags \
                 (CUDA 12.1+): fence each operation with ready_after",
                self.ptr
            );
            return Ok(SyncMemops::Unavailable);
        };
        let _ctx = CtxGuard::enter(&self.device)?;
        // cuCtxSetFlags replaces the context's flags: the framework's own
        // (its scheduling policy, say) are read and kept.
        let mut flags: libc::c_uint = 0;
        // SAFETY: the driver's cuCtxGetFlags; the device's primary context is
        // current; `flags` is a valid out-pointer.
        check_code(unsafe { get_flags(&mut flags) }, "cuCtxGetFlags")?;
        let sync = crate::cuda::result::CTX_SYNC_MEMOPS;
        if flags & sync == 0 {
            check_code(
                // SAFETY: the driver's cuCtxSetFlags; the context is current; the
                // flags take no pointers.
                unsafe { set_flags(flags | sync) },
                "cuCtxSetFlags(CU_CTX_SYNC_MEMOPS)",
            )?;
        }
        Ok(SyncMemops::Context)
    }

    /// How synchronous memory operations are ordered with RDMA for it.
    pub fn sync_memops_by(&self) -> SyncMemops {
        self.sync_memops
    }

    /// Whether the driver says a NIC may reach this memory directly
    /// (`IS_GPU_DIRECT_RDMA_CAPABLE`; always for `cuMemAlloc` memory, for
    /// VMM memory only when made with `gpuDirectRDMACapable`).
    pub fn gdr_capable(&self) -> bool {
        self.gdr_capable
    }

    fn set_sync_memops(&self) -> Result<()> {
        let _ctx = CtxGuard::enter(&self.device)?;
        let one: u32 = 1;
        check(
            // SAFETY: `one` outlives the call; the pointer is a live allocation of the current context.
            unsafe {
                sys::cuPointerSetAttribute(
                    (&one as *const u32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                    self.ptr,
                )
            },
            "cuPointerSetAttribute(SYNC_MEMOPS)",
        )
    }

    /// Whether `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` is set on the pointer, as
    /// the driver reports it (see [`sync_memops_by`](Self::sync_memops_by)
    /// for memory where the context flag stands in).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn sync_memops(&self) -> Result<bool> {
        let (rc, v) = self.pointer_attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS)?;
        check(rc, "cuPointerGetAttribute(SYNC_MEMOPS)")?;
        Ok(v != 0)
    }

    /// The device address.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes (a multiple of 64 KiB for buffers allocated here).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is zero (never, for a live buffer).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// A fence for the operations posted from now on: they wait for the
    /// work queued on `stream` up to this call (a kernel producing the data
    /// a send or write reads, or still reading the memory a receive or read
    /// will overwrite). Call it before each such operation, once for each
    /// stream whose work touches the buffer: fences add up, and an
    /// operation waits for every one recorded before it was posted whose
    /// work is not yet known done (two producers on two streams: both).
    /// Takes `&self`, so it works through a registered
    /// [`Region`](crate::Region) or an [`Exposed`](crate::Exposed) region.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn ready_after(&self, stream: &CudaStream) -> Result<()> {
        let ev = std::sync::Arc::new(CudaEvent::record(stream)?);
        let mut fences = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        // Fences whose work is done are dropped (one whose work failed is
        // kept, for the next operation to report): the set holds only
        // producers that may still run.
        fences.retain(|f| !matches!(f.is_done(), Ok(true)));
        fences.push(ev);
        Ok(())
    }

    /// The fences an operation posted now waits for.
    pub(crate) fn fences(&self) -> Vec<std::sync::Arc<CudaEvent>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits (on the CPU) for every fence; nothing without one. Those
    /// waited for leave the set.
    pub(crate) fn wait_ready(&self) -> Result<()> {
        let fences = self.fences();
        if fences.is_empty() {
            return Ok(());
        }
        for f in &fences {
            f.synchronize()?;
        }
        let mut set = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        set.retain(|f| !fences.iter().any(|w| std::sync::Arc::ptr_eq(f, w)));
        Ok(())
    }

    /// Makes `stream` wait (on the GPU) for every fence; nothing without one.
    pub(crate) fn order_after_ready(&self, stream: &CudaStream) -> Result<()> {
        for f in self.fences() {
            stream.wait_event(&f)?;
        }
        Ok(())
    }

    /// [`Error::OutOfBounds`] unless `offset..offset + len` lies in the buffer.
    pub(crate) fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        Error::check_local(offset, len, self.len)
    }

    /// Copies `data` to `offset` (synchronously).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::Cuda`].
    pub fn copy_from_host(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        let _ctx = CtxGuard::enter(&self.device)?;
        check(
            // SAFETY: the range is inside the allocation (checked); `data` is valid for reads.
            unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, data.as_ptr().cast(), data.len()) },
            "cuMemcpyHtoD",
        )
    }

    /// Copies `out.len()` bytes at `offset` to `out` (synchronously).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::Cuda`].
    pub fn copy_to_host(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        let _ctx = CtxGuard::enter(&self.device)?;
        check(
            // SAFETY: the range is inside the allocation (checked); `out` is valid for writes.
            unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + offset as u64, out.len()) },
            "cuMemcpyDtoH",
        )
    }

    /// Copies `len` bytes at `offset` to raw host memory (synchronously).
    ///
    /// # Safety
    /// `dst..dst + len` must be valid for writes and not referenced by Rust
    /// code meanwhile.
    pub(crate) unsafe fn copy_to_raw(&self, offset: usize, dst: *mut u8, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: range checked; the caller guarantees `dst`.
        check(unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), self.ptr + offset as u64, len) }, "cuMemcpyDtoH")
    }

    /// Copies `len` bytes of raw host memory to `offset` (synchronously).
    ///
    /// # Safety
    /// `src..src + len` must be valid for reads.
    pub(crate) unsafe fn copy_from_raw(&self, offset: usize, src: *const u8, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: range checked; the caller guarantees `src`.
        check(unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.cast(), len) }, "cuMemcpyHtoD")
    }

    /// Sets `count` 32-bit words at `offset` (a multiple of 4) to `value`,
    /// on the GPU (`cuMemsetD32`), synchronously.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::InvalidArgument`] for a misaligned
    /// offset; [`Error::Cuda`].
    pub fn fill_u32(&self, offset: usize, value: u32, count: usize) -> Result<()> {
        if offset % 4 != 0 {
            return Err(Error::InvalidArgument(format!("offset {offset} is not a multiple of 4")));
        }
        self.check_range(offset, count.saturating_mul(4))?;
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: the range is inside the allocation (checked) and 4-byte aligned.
        check(unsafe { sys::cuMemsetD32_v2(self.ptr + offset as u64, value, count) }, "cuMemsetD32")?;
        // SAFETY: the context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// Sets every byte to `value` (synchronously).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn fill(&self, value: u8) -> Result<()> {
        let _ctx = CtxGuard::enter(&self.device)?;
        // SAFETY: the whole allocation, in the current context.
        check(unsafe { sys::cuMemsetD8_v2(self.ptr, value, self.len) }, "cuMemsetD8")?;
        // SAFETY: the context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// Exports the `len` bytes at `offset` as a dma-buf
    /// (`cuMemGetHandleForAddressRange`). The driver exports whole host
    /// pages, so the exported range is the requested one with its start
    /// rounded down and its end rounded up to the page (as perftest, UCX and
    /// NCCL do); [`DmaBuf::offset`] says where the requested bytes begin.
    /// Any pointer works: a sub-allocation at offset 512 as well.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the buffer; [`Error::InvalidArgument`]
    /// for zero bytes; [`Error::Cuda`] (`CUDA_ERROR_NOT_SUPPORTED` when the
    /// driver or GPU cannot, which [`Error::is_not_supported`] tells), or
    /// [`Error::CudaUnavailable`] when the driver predates the call.
    pub fn export_dmabuf(&self, offset: usize, len: usize) -> Result<DmaBuf> {
        self.check_range(offset, len)?;
        self.export_dmabuf_at(self.ptr + offset as u64, len)
    }

    /// [`export_dmabuf`](Self::export_dmabuf) of the `len` bytes at device
    /// address `start`, which the caller checked lie in this buffer's
    /// allocation ([`allocation`](Self::allocation)): a registration of the
    /// whole block.
    pub(crate) fn export_dmabuf_at(&self, start: u64, len: usize) -> Result<DmaBuf> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot export zero bytes as a dma-buf".into()));
        }
        let page = host_page_size() as u64;
        let first = start / page * page;
        let end = (start + len as u64).div_ceil(page) * page;
        let export_len = (end - first) as usize;
        let Some(get_handle) = crate::cuda::result::newer().get_handle_for_address_range else {
            return Err(Error::CudaUnavailable {
                reason: "the driver has no cuMemGetHandleForAddressRange (CUDA 11.7+ is needed for dma-buf)".into(),
            });
        };
        let _ctx = CtxGuard::enter(&self.device)?;
        let export = |flags: u64| {
            let mut fd: libc::c_int = -1;
            // SAFETY: the driver's cuMemGetHandleForAddressRange; `fd` is a
            // valid out-pointer for the handle (an int for DMA_BUF_FD); the
            // page-rounded range lies in the allocation's pages.
            let rc = unsafe {
                get_handle(
                    (&mut fd as *mut libc::c_int).cast(),
                    first,
                    export_len,
                    crate::cuda::result::RANGE_HANDLE_DMA_BUF_FD,
                    flags,
                )
            };
            (rc, fd)
        };
        // On platforms where the NIC can reach GPU memory by more than one path
        // (Grace Hopper: C2C and PCIe), ask for the PCIe mapping, as NCCL does
        // (CUDA 12.8+); a driver or platform that refuses the flag gets the
        // plain export.
        let pcie = crate::cuda::result::RANGE_FLAG_PCIE;
        let (mut rc, mut fd) = if driver()?.version >= 12080 { export(pcie) } else { export(0) };
        if driver()?.version >= 12080 && crate::cuda::result::REFUSED_CODES.contains(&rc) {
            tracing::debug!("dma-buf export with the PCIe mapping type refused (CUresult {rc}); exporting without it");
            (rc, fd) = export(0);
        }
        check_code(rc, "cuMemGetHandleForAddressRange")?;
        if fd < 0 {
            return Err(Error::InvalidArgument("the driver returned no dma-buf descriptor".into()));
        }
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBuf { fd, offset: start - first, len: export_len })
    }
}

fn host_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        *self.ready.get_mut().unwrap_or_else(|e| e.into_inner()) = Vec::new();
        if let Owner::Ours = self.owner {
            let Ok(_ctx) = CtxGuard::enter(&self.device) else { return };
            // SAFETY: allocated by cuMemAlloc in `alloc` and freed once; a Region
            // deregisters before it drops its memory, so no NIC mapping is left.
            if let Err(e) = check(unsafe { sys::cuMemFree_v2(self.ptr) }, "cuMemFree") {
                tracing::error!("{e}");
            }
        }
    }
}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device.ordinal())
            .field("foreign", &matches!(self.owner, Owner::Foreign(_)))
            .finish()
    }
}

/// Host memory pinned for GPU copies (`cuMemHostRegister`), for staging.
pub struct PinnedHost {
    mem: HostMemory,
    device: CudaDevice,
}

impl PinnedHost {
    /// Maps and pins `len` bytes.
    ///
    /// # Errors
    /// [`Error::Io`] when mapping fails; [`Error::Cuda`] when pinning does.
    pub fn new(device: &CudaDevice, len: usize) -> Result<Self> {
        let mem = HostMemory::new(len)?;
        let _ctx = CtxGuard::enter(device)?;
        check(
            // SAFETY: the mapping is live until Drop, which unregisters it first.
            unsafe { sys::cuMemHostRegister_v2(mem.raw().cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) },
            "cuMemHostRegister",
        )?;
        Ok(PinnedHost { mem, device: device.clone() })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.mem.as_slice()
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }

    /// The mapping's address and length.
    pub(crate) fn raw_parts(&self) -> (*mut u8, usize) {
        (self.mem.raw(), self.mem.mapped_len())
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let Ok(_ctx) = CtxGuard::enter(&self.device) else { return };
        // SAFETY: registered in `new`, unregistered once, before the mapping goes.
        if let Err(e) = check(unsafe { sys::cuMemHostUnregister(self.mem.raw().cast()) }, "cuMemHostUnregister") {
            tracing::error!("{e}");
        }
    }
}

impl fmt::Debug for PinnedHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedHost({:?})", self.mem)
    }
}

/// Queues a device-to-host copy on `stream`.
///
/// # Safety
/// `dst..dst + len` must stay valid host memory, and `src..src + len` valid
/// device memory of the stream's device, until the copy completes.
pub(crate) unsafe fn copy_dtoh_async(dst: *mut u8, src: u64, len: usize, stream: &CudaStream) -> Result<()> {
    let _ctx = CtxGuard::enter(&stream.device)?;
    // SAFETY: forwarded contract.
    check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream.stream) }, "cuMemcpyDtoHAsync")
}

/// Queues a host-to-device copy on `stream`.
///
/// # Safety
/// As [`copy_dtoh_async`], the other way round.
pub(crate) unsafe fn copy_htod_async(dst: u64, src: *const u8, len: usize, stream: &CudaStream) -> Result<()> {
    let _ctx = CtxGuard::enter(&stream.device)?;
    // SAFETY: forwarded contract.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream.stream) }, "cuMemcpyHtoDAsync")
}

/// A cudarc slice's device pointer, its length in bytes, and its stream as
/// the producer to fence on; refused unless it is of a primary context
/// ([`CudaStream::from_cudarc`]) and holds bytes.
fn cudarc_parts<T>(slice: &cudarc::driver::CudaSlice<T>) -> Result<(sys::CUdeviceptr, usize, CudaStream)> {
    use cudarc::driver::DevicePtr;
    let producer = CudaStream::from_cudarc(slice.stream())?;
    let bytes = slice.num_bytes();
    if bytes == 0 {
        return Err(Error::InvalidArgument("an empty cudarc slice".into()));
    }
    // The pointer, read on the slice's own stream (which orders nothing new:
    // the fence is taken from that stream right after).
    let (ptr, _read) = slice.device_ptr(slice.stream());
    Ok((ptr, bytes, producer))
}
