//! The result layer for the CUDA driver: loading it without panicking, and
//! `CUresult` -> [`Result`].
//!
//! cudarc loads `libcuda` at run time and panics on the first call when the
//! library, or a symbol, is missing. So before anything else this module
//! checks that the library loads and that every symbol the crate calls
//! exists; until that check passes no driver function is called, and every
//! entry point returns [`Error::CudaUnavailable`] with the reason instead.

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

/// Functions of newer drivers; each feature that needs one is off without it.
const OPTIONAL: &[&str] =
    &["cuMemGetHandleForAddressRange", "cuFlushGPUDirectRDMAWrites", "cuCtxSetFlags", "cuCtxGetFlags"];

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

fn has_symbol(name: &str) -> bool {
    // SAFETY: only called after is_culib_present() succeeded, so culib() finds
    // the library instead of panicking; looking a symbol up calls nothing.
    let lib = unsafe { sys::culib() };
    // SAFETY: the symbol is only looked up, never called through this pointer.
    unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_ok()
}

fn init() -> std::result::Result<DriverInfo, String> {
    // SAFETY: loads the library by name to see whether it exists; calls nothing in it.
    if !unsafe { sys::is_culib_present() } {
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
    let info = DriverInfo {
        version,
        device_count: count as usize,
        has_dmabuf_export: has_symbol(OPTIONAL[0]),
        has_flush: has_symbol(OPTIONAL[1]),
        // Set by reading the flags and adding to them: both calls.
        has_ctx_flags: has_symbol(OPTIONAL[2]) && has_symbol(OPTIONAL[3]),
    };
    tracing::debug!(?info, "CUDA driver loaded");
    Ok(info)
}
