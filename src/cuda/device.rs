//! A CUDA device and its primary context.

use std::ffi::CStr;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys;

use super::result::{check, driver};
use crate::error::{Error, Result};

/// The GPUDirect-related attributes of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaDeviceAttrs {
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: the device can export dma-bufs.
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` bit mask
    /// (bit 0: `cuFlushGPUDirectRDMAWrites` is available).
    pub flush_writes_options: u32,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`: 0 none, 100 owner, 200 all devices.
    pub writes_ordering: u32,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

/// What to do after a NIC wrote GPU memory, before CUDA work may read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushPolicy {
    /// The device orders remote writes before later CUDA work itself.
    NotNeeded,
    /// Call `cuFlushGPUDirectRDMAWrites` (to the owning device).
    Flush,
    /// Needed but the driver offers no flush: writes may be seen late.
    Unavailable,
}

impl CudaDeviceAttrs {
    /// Whether remote writes need an explicit flush to be visible to CUDA
    /// work, per the device's ordering and flush attributes (and whether
    /// the driver has the flush call).
    pub fn flush_policy(&self, driver_has_flush: bool) -> FlushPolicy {
        const ORDERING_OWNER: u32 = 100;
        const OPTION_HOST: u32 = 1;
        if self.writes_ordering >= ORDERING_OWNER {
            FlushPolicy::NotNeeded
        } else if driver_has_flush && self.flush_writes_options & OPTION_HOST != 0 {
            FlushPolicy::Flush
        } else {
            FlushPolicy::Unavailable
        }
    }
}

/// A CUDA device, with its primary context retained. Cheap to clone.
#[derive(Clone)]
pub struct CudaDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    ordinal: usize,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    pci_bus_id: String,
    total_mem: usize,
    attrs: CudaDeviceAttrs,
}

// SAFETY: a CUcontext may be made current on any thread; the handle is immutable.
unsafe impl Send for DeviceInner {}
// SAFETY: as above.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: retained in `open`, released once; every buffer, stream and event
        // of this device holds an Arc of this and is already gone.
        if let Err(e) = check(unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) }, "cuDevicePrimaryCtxRelease") {
            tracing::error!(ordinal = self.ordinal, "{e}");
        }
    }
}

/// Makes a device's context current on this thread until dropped.
pub(crate) struct CtxGuard(());

impl CtxGuard {
    pub(crate) fn enter(device: &CudaDevice) -> Result<Self> {
        // SAFETY: the context is retained for as long as `device` lives, which
        // outlives this guard at every call site.
        check(unsafe { sys::cuCtxPushCurrent_v2(device.inner.ctx) }, "cuCtxPushCurrent")?;
        Ok(CtxGuard(()))
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread.
        if let Err(e) = check(unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }, "cuCtxPopCurrent") {
            tracing::error!("{e}");
        }
    }
}

/// Device attributes, by number (`CUdevice_attribute`): cudarc's bindings
/// for older CUDA versions do not name the newer ones.
mod attr {
    pub(super) const COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub(super) const COMPUTE_CAPABILITY_MINOR: i32 = 76;
    pub(super) const GPU_DIRECT_RDMA_SUPPORTED: i32 = 116;
    pub(super) const GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: i32 = 117;
    pub(super) const GPU_DIRECT_RDMA_WRITES_ORDERING: i32 = 118;
    pub(super) const DMA_BUF_SUPPORTED: i32 = 124;
}

/// Device attribute `attr` (a `CUdevice_attribute` number) of `dev`; a
/// driver that does not know the attribute says `CUDA_ERROR_INVALID_VALUE`.
fn attribute(dev: sys::CUdevice, attr: i32) -> Result<i32> {
    let Some(get) = crate::cuda::result::newer().device_get_attribute else {
        return Err(Error::CudaUnavailable { reason: "the CUDA driver has no cuDeviceGetAttribute".into() });
    };
    let mut v = 0;
    // SAFETY: the driver's cuDeviceGetAttribute; a valid out-pointer and
    // device handle; an unknown attribute number is refused, not undefined.
    crate::cuda::result::check_code(unsafe { get(&mut v, attr, dev) }, "cuDeviceGetAttribute")?;
    Ok(v)
}

impl CudaDevice {
    /// The number of CUDA devices.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when there is no driver or no device.
    pub fn count() -> Result<usize> {
        Ok(driver()?.device_count)
    }

    /// Opens device `ordinal` and retains its primary context.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`]; [`Error::NoCudaDevice`] for an ordinal
    /// past the last device; [`Error::Cuda`].
    pub fn open(ordinal: usize) -> Result<Self> {
        let info = driver()?;
        if ordinal >= info.device_count {
            return Err(Error::NoCudaDevice { ordinal, count: info.device_count });
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: valid out-pointer; ordinal checked against the count.
        check(unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) }, "cuDeviceGet")?;
        let mut name = [0 as libc::c_char; 256];
        // SAFETY: the buffer holds 256 chars, the length passed.
        check(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) }, "cuDeviceGetName")?;
        let mut bus = [0 as libc::c_char; 64];
        // SAFETY: as above, 64 chars.
        check(unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 64, dev) }, "cuDeviceGetPCIBusId")?;
        let mut total_mem = 0usize;
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuDeviceTotalMem_v2(&mut total_mem, dev) }, "cuDeviceTotalMem")?;
        let attrs = CudaDeviceAttrs {
            dma_buf_supported: attribute(dev, attr::DMA_BUF_SUPPORTED).unwrap_or(0) != 0,
            gpu_direct_rdma_supported: attribute(dev, attr::GPU_DIRECT_RDMA_SUPPORTED).unwrap_or(0) != 0,
            flush_writes_options: attribute(dev, attr::GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS).unwrap_or(0) as u32,
            writes_ordering: attribute(dev, attr::GPU_DIRECT_RDMA_WRITES_ORDERING).unwrap_or(0) as u32,
            compute_capability: (
                attribute(dev, attr::COMPUTE_CAPABILITY_MAJOR)?,
                attribute(dev, attr::COMPUTE_CAPABILITY_MINOR)?,
            ),
        };
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; released in DeviceInner's Drop.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain")?;
        // SAFETY: both arrays were NUL-terminated by the driver (and zeroed before).
        let (name, pci_bus_id) = unsafe {
            (
                CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                CStr::from_ptr(bus.as_ptr()).to_string_lossy().into_owned(),
            )
        };
        Ok(CudaDevice { inner: Arc::new(DeviceInner { ordinal, dev, ctx, name, pci_bus_id, total_mem, attrs }) })
    }

    /// Its ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Its name, for example `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Its PCI address, for example `0000:19:00.0`.
    pub fn pci_bus_id(&self) -> &str {
        &self.inner.pci_bus_id
    }

    /// Its memory in bytes.
    pub fn total_mem(&self) -> usize {
        self.inner.total_mem
    }

    /// Its GPUDirect-related attributes.
    pub fn attrs(&self) -> CudaDeviceAttrs {
        self.inner.attrs
    }

    /// What remote writes into its memory need before CUDA work may read them.
    pub fn flush_policy(&self) -> FlushPolicy {
        self.inner.attrs.flush_policy(driver().map(|d| d.has_flush).unwrap_or(false))
    }

    /// Blocks until all work in its context is done (`cuCtxSynchronize`).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn synchronize(&self) -> Result<()> {
        let _ctx = CtxGuard::enter(self)?;
        // SAFETY: the device's context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// Makes remote writes into this device's memory visible to its CUDA
    /// work, when its attributes say that is needed.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn flush_remote_writes(&self) -> Result<()> {
        if self.flush_policy() != FlushPolicy::Flush {
            return Ok(());
        }
        use crate::cuda::result::{FLUSH_TARGET_CURRENT_CTX, FLUSH_TO_OWNER, check_code, newer};
        let Some(flush) = newer().flush_gpudirect_rdma_writes else { return Ok(()) };
        let _ctx = CtxGuard::enter(self)?;
        check_code(
            // SAFETY: the driver's cuFlushGPUDirectRDMAWrites; the device's
            // context is current; both arguments are plain enums.
            unsafe { flush(FLUSH_TARGET_CURRENT_CTX, FLUSH_TO_OWNER) },
            "cuFlushGPUDirectRDMAWrites",
        )
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("pci_bus_id", &self.inner.pci_bus_id)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(ordering: u32, options: u32) -> CudaDeviceAttrs {
        CudaDeviceAttrs {
            dma_buf_supported: true,
            gpu_direct_rdma_supported: true,
            flush_writes_options: options,
            writes_ordering: ordering,
            compute_capability: (9, 0),
        }
    }

    #[test]
    fn flush_policy_follows_ordering_and_options() {
        assert_eq!(attrs(100, 0).flush_policy(false), FlushPolicy::NotNeeded);
        assert_eq!(attrs(200, 1).flush_policy(true), FlushPolicy::NotNeeded);
        assert_eq!(attrs(0, 1).flush_policy(true), FlushPolicy::Flush);
        assert_eq!(attrs(0, 1).flush_policy(false), FlushPolicy::Unavailable);
        assert_eq!(attrs(0, 0).flush_policy(true), FlushPolicy::Unavailable);
    }
}
