//! CUDA through `cudarc`'s driver bindings, loaded at run time: the only
//! module that names `cudarc::driver::sys`.
//!
//! Layering follows `sys -> result -> safe`: `result` loads the driver
//! without ever letting cudarc panic (no library, a missing symbol, no
//! device: each is [`Error::CudaUnavailable`](crate::Error::CudaUnavailable)
//! with the reason), and turns `CUresult` into [`crate::Result`]; the types
//! here own one driver resource each and keep their device's primary
//! context alive.

mod buffer;
mod device;
mod result;

pub use buffer::{Allocation, CudaBuffer, CudaEvent, CudaStream, DmaBuf, GPU_PAGE, PinnedHost, SyncMemops};
pub(crate) use buffer::{copy_dtoh_async, copy_htod_async};
pub use device::{CudaDevice, CudaDeviceAttrs, FlushPolicy};
pub use result::{DriverInfo, driver};

/// The raw driver bindings, for what this module does not wrap.
pub use cudarc::driver::sys;
