//! The result layer for the CUDA driver: loading it without panicking, and
//! `CUresult` -> [`Result`].
//!
//! cudarc loads `libcuda` at run time and panics on the first call when the
//! library, or a symbol, is missing. So before anything else this module
//! checks that the library loads and that every symbol the crate calls
//! exists; until that check passes no driver function is called, and every
//! entry point returns [`Error::CudaUnavailable`] with the reason instead.
//!
//! The check uses only the dynamic loader, not cudarc's loading functions,
//! which exist in one of cudarc's linking modes only: this crate builds
//! with cudarc in whatever mode the crates beside it chose (see the `cuda`
//! and `cuda-dynamic-loading` features).

use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// `CUresult` -> `Result`: success, or [`Error::Cuda`] with the code's name.
pub(crate) fn check(r: sys::CUresult, op: &'static str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { op, code: r as u32, name: format!("{r:?}") })
    }
}

/// Driver functions every part of the crate needs.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuPointerSetAttribute",
    "cuPointerGetAttribute",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemsetD8_v2",
    "cuMemsetD32_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
];

/// What the driver probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// `cuDriverGetVersion`, for example 12080 for CUDA 12.8.
    pub version: i32,
    /// CUDA devices.
    pub device_count: usize,
    /// Whether `cuMemGetHandleForAddressRange` (dma-buf export, CUDA 11.7+) exists.
    pub has_dmabuf_export: bool,
    /// Whether `cuFlushGPUDirectRDMAWrites` (CUDA 11.3+) exists.
    pub has_flush: bool,
    /// Whether `cuCtxSetFlags` (CUDA 12.1+, the context-wide
    /// `CU_CTX_SYNC_MEMOPS`) and `cuCtxGetFlags` exist.
    pub has_ctx_flags: bool,
}

impl DriverInfo {
    /// The version as `major.minor`.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version / 1000, (self.version % 1000) / 10)
    }
}

static DRIVER: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();

/// The loaded, initialized driver, or why there is none. Probed once per
/// process: cudarc keeps the first library it loads for the process's life.
///
/// # Errors
/// [`Error::CudaUnavailable`].
pub fn driver() -> Result<&'static DriverInfo> {
    DRIVER.get_or_init(init).as_ref().map_err(|reason| Error::CudaUnavailable { reason: reason.clone() })
}

/// The driver library, opened by name as cudarc opens it when it loads the
/// driver at run time (`libcuda.so` first, then the driver's own soname):
/// the same file, so a symbol found here is the one cudarc calls. Looked up
/// here, not through cudarc, so that this works in every cudarc linking
/// mode (with `dynamic-linking`, chosen by a crate beside this one, the
/// library is already loaded and this finds it).
struct DriverLib(std::ptr::NonNull<libc::c_void>);

// SAFETY: a dlopen handle is a process-wide token; dlsym may be called on it
// from any thread (glibc serializes the loader's state).
unsafe impl Send for DriverLib {}
// SAFETY: as above: the handle is only passed to dlsym, never mutated.
unsafe impl Sync for DriverLib {}

/// The names cudarc tries on Linux, in its order (`libcuda.so.1` is the
/// driver's soname: always there where a driver is installed).
const DRIVER_NAMES: &[&std::ffi::CStr] = &[c"libcuda.so", c"libcuda.so.1"];

fn driver_lib() -> Option<&'static DriverLib> {
    static LIB: OnceLock<Option<DriverLib>> = OnceLock::new();
    LIB.get_or_init(|| {
        DRIVER_NAMES.iter().find_map(|name| {
            // SAFETY: a valid C string; loading the driver library runs its
            // initializers as cudarc's own load would, and it stays loaded
            // (the handle is never closed) for the life of the process.
            let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
            std::ptr::NonNull::new(handle).map(DriverLib)
        })
    })
    .as_ref()
}

/// The driver's symbol `name`, if the driver was found and has it.
fn symbol(name: &std::ffi::CStr) -> Option<std::ptr::NonNull<libc::c_void>> {
    let lib = driver_lib()?;
    // SAFETY: a live handle and a valid C string; the symbol is only looked
    // up, never called through this pointer.
    std::ptr::NonNull::new(unsafe { libc::dlsym(lib.0.as_ptr(), name.as_ptr()) })
}

fn has_symbol(name: &str) -> bool {
    std::ffi::CString::new(name).ok().and_then(|name| symbol(&name)).is_some()
}

fn init() -> std::result::Result<DriverInfo, String> {
    if driver_lib().is_none() {
        return Err("the CUDA driver library (libcuda.so) was not found: this machine has no NVIDIA driver, \
                    or it is not on the loader path (LD_LIBRARY_PATH)"
            .to_owned());
    }
    let missing: Vec<&str> = REQUIRED.iter().copied().filter(|s| !has_symbol(s)).collect();
    if !missing.is_empty() {
        return Err(format!("the CUDA driver library lacks {}: the driver is too old", missing.join(", ")));
    }
    // SAFETY: cuInit exists (checked) and takes no pointers.
    match unsafe { sys::cuInit(0) } {
        sys::CUresult::CUDA_SUCCESS => {}
        sys::CUresult::CUDA_ERROR_NO_DEVICE => {
            return Err("the CUDA driver is installed but found no CUDA device".to_owned());
        }
        other => return Err(format!("cuInit failed: {other:?}")),
    }
    let mut version = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { sys::cuDriverGetVersion(&mut version) }, "cuDriverGetVersion").map_err(|e| e.to_string())?;
    let mut count = 0;
    // SAFETY: valid out-pointer; the driver is initialized.
    check(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount").map_err(|e| e.to_string())?;
    if count <= 0 {
        return Err("the CUDA driver is installed but found no CUDA device".to_owned());
    }
    // Functions of newer drivers: each feature that needs one is off without it.
    let newer = newer();
    let info = DriverInfo {
        version,
        device_count: count as usize,
        has_dmabuf_export: newer.get_handle_for_address_range.is_some(),
        has_flush: newer.flush_gpudirect_rdma_writes.is_some(),
        // Set by reading the flags and adding to them: both calls.
        has_ctx_flags: newer.ctx_get_flags.is_some() && newer.ctx_set_flags.is_some(),
    };
    tracing::debug!(?info, "CUDA driver loaded");
    Ok(info)
}

/// A `CUresult` as the driver returned it, for the functions this crate
/// calls through the driver's own symbols ([`Newer`]): success, or
/// [`Error::Cuda`] with the code's name where it is a common one.
pub(crate) fn check_code(code: libc::c_uint, op: &'static str) -> Result<()> {
    let name = match code {
        0 => return Ok(()),
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "",
    };
    let name = if name.is_empty() { format!("CUresult {code}") } else { name.to_owned() };
    Err(Error::Cuda { op, code, name })
}

/// `CUDA_ERROR_INVALID_VALUE`, `CUDA_ERROR_NOT_SUPPORTED`: a flag or mode
/// the driver or platform does not take.
pub(crate) const REFUSED_CODES: [libc::c_uint; 2] = [1, 801];

/// `CU_CTX_SYNC_MEMOPS`.
pub(crate) const CTX_SYNC_MEMOPS: libc::c_uint = 0x80;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
pub(crate) const RANGE_HANDLE_DMA_BUF_FD: libc::c_uint = 1;
/// `CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE` (CUDA 12.8+).
pub(crate) const RANGE_FLAG_PCIE: u64 = 0x1;
/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX`.
pub(crate) const FLUSH_TARGET_CURRENT_CTX: libc::c_uint = 0;
/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER`.
pub(crate) const FLUSH_TO_OWNER: libc::c_uint = 100;

/// Driver functions of newer CUDA versions, called
/// through the driver's own symbols: cudarc declares them only in its
/// bindings for the CUDA versions that have them, and the crate beside this
/// one may have chosen older bindings. Each is `None` where the driver
/// lacks it; each returns the raw `CUresult`. The signatures are CUDA's.
pub(crate) struct Newer {
    /// `cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice
    /// dev)`, present in every driver, called here by the attribute's
    /// number: older bindings do not name the newer attributes.
    pub device_get_attribute: Option<unsafe extern "C" fn(*mut libc::c_int, libc::c_int, libc::c_int) -> libc::c_uint>,
    /// `cuCtxGetFlags(unsigned int *flags)` (CUDA 12.1+).
    pub ctx_get_flags: Option<unsafe extern "C" fn(*mut libc::c_uint) -> libc::c_uint>,
    /// `cuCtxSetFlags(unsigned int flags)` (CUDA 12.1+).
    pub ctx_set_flags: Option<unsafe extern "C" fn(libc::c_uint) -> libc::c_uint>,
    /// `cuMemGetHandleForAddressRange(void *handle, CUdeviceptr dptr,
    /// size_t size, CUmemRangeHandleType handleType, unsigned long long
    /// flags)` (CUDA 11.7+).
    #[allow(clippy::type_complexity)]
    pub get_handle_for_address_range:
        Option<unsafe extern "C" fn(*mut libc::c_void, u64, usize, libc::c_uint, u64) -> libc::c_uint>,
    /// `cuFlushGPUDirectRDMAWrites(CUflushGPUDirectRDMAWritesTarget,
    /// CUflushGPUDirectRDMAWritesScope)` (CUDA 11.3+).
    pub flush_gpudirect_rdma_writes: Option<unsafe extern "C" fn(libc::c_uint, libc::c_uint) -> libc::c_uint>,
}

/// The newer driver functions this driver has (none before the driver
/// was found).
pub(crate) fn newer() -> &'static Newer {
    static NEWER: OnceLock<Newer> = OnceLock::new();
    NEWER.get_or_init(|| {
        // Each transmute: the symbol is the driver's function of that name,
        // whose C signature is the one written on its field above; a data
        // pointer from dlsym and a function pointer have the same size and
        // representation on the platforms this crate builds for (POSIX
        // requires it for dlsym).
        Newer {
            // SAFETY: see above.
            device_get_attribute: symbol(c"cuDeviceGetAttribute").map(|p| unsafe { std::mem::transmute(p.as_ptr()) }),
            // SAFETY: see above.
            ctx_get_flags: symbol(c"cuCtxGetFlags").map(|p| unsafe { std::mem::transmute(p.as_ptr()) }),
            // SAFETY: see above.
            ctx_set_flags: symbol(c"cuCtxSetFlags").map(|p| unsafe { std::mem::transmute(p.as_ptr()) }),
            get_handle_for_address_range: symbol(c"cuMemGetHandleForAddressRange")
                // SAFETY: see above.
                .map(|p| unsafe { std::mem::transmute(p.as_ptr()) }),
            flush_gpudirect_rdma_writes: symbol(c"cuFlushGPUDirectRDMAWrites")
                // SAFETY: see above.
                .map(|p| unsafe { std::mem::transmute(p.as_ptr()) }),
        }
    })
}
