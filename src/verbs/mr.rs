//! Memory regions (`ibv_mr`).
//!
//! Registering is `unsafe` here: this layer does not own the memory. The safe
//! owner is [`crate::Region`], which keeps the memory alive, and in place, for
//! as long as the registration.

use std::fmt;
use std::ptr::NonNull;

use rdma_sys as ffi;

use super::loader::ibverbs;

use super::pd::ProtectionDomain;
use super::result;
use crate::access::Access;
use crate::error::{Error, Result};

/// A registration of memory with the device.
pub struct MemoryRegion {
    mr: NonNull<ffi::ibv_mr>,
    access: Access,
    // Keeps the protection domain (and the device) alive until after deregistration.
    pd: ProtectionDomain,
    /// Where peers address it.
    iova: u64,
}

// SAFETY: an ibv_mr is an immutable handle once registered; ibv_dereg_mr may be
// called from any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: all methods take `&self` and only read immutable fields.
unsafe impl Sync for MemoryRegion {}

pub(crate) fn to_ibv_access(access: Access) -> libc::c_int {
    let mut bits = 0u32;
    if access.contains(Access::LOCAL_WRITE) {
        bits |= ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if access.contains(Access::REMOTE_WRITE) {
        bits |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    }
    if access.contains(Access::REMOTE_READ) {
        bits |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    if access.contains(Access::REMOTE_ATOMIC) {
        bits |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
    }
    bits as libc::c_int
}

fn check_access(access: Access) -> Result<()> {
    // The verbs rule: remote write or atomic rights need local write.
    if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) && !access.contains(Access::LOCAL_WRITE) {
        return Err(Error::InvalidArgument(format!(
            "access {access:?}: remote write and atomic rights need LOCAL_WRITE too"
        )));
    }
    Ok(())
}

impl MemoryRegion {
    /// `ibv_reg_mr` over `len` bytes at `addr` (through `ibv_reg_mr_iova2`,
    /// addressed as `addr`).
    ///
    /// # Safety
    /// `addr..addr + len` must be memory that stays allocated, mapped and at
    /// the same address until this value is dropped, and that nothing else
    /// frees or remaps meanwhile: the device may read or write it, as
    /// `access` allows, at any time until then. For device (GPU) memory the
    /// same holds of the device allocation.
    ///
    /// # Errors
    /// [`Error::Verbs`] (`ENOMEM` when the memory-lock limit is too low,
    /// `EFAULT` for an address the kernel cannot pin), or
    /// [`Error::InvalidArgument`] for an access combination verbs refuses.
    pub unsafe fn register(pd: &ProtectionDomain, addr: *mut u8, len: usize, access: Access) -> Result<Self> {
        // SAFETY: forwarded contract.
        unsafe { Self::register_with(pd, addr, len, access, false) }
    }

    /// As [`register`](Self::register), asking for PCIe relaxed ordering
    /// (`IBV_ACCESS_RELAXED_ORDERING`) when `relaxed`: an optional access
    /// flag, so a device that cannot honour it registers without it. It is
    /// passed through `ibv_reg_mr_iova2`, which keeps optional flags.
    ///
    /// # Safety
    /// As [`register`](Self::register).
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub unsafe fn register_with(
        pd: &ProtectionDomain,
        addr: *mut u8,
        len: usize,
        access: Access,
        relaxed: bool,
    ) -> Result<Self> {
        check_access(access)?;
        let mut bits = to_ibv_access(access) as u32;
        if relaxed {
            bits |= ffi::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
        }
        // SAFETY: the caller guarantees the range stays valid; the PD is live.
        let mr = unsafe { (ibverbs()?.ibv_reg_mr_iova2)(pd.as_raw(), addr.cast(), len, addr as u64, bits) };
        let mr = result::nonnull(mr, "ibv_reg_mr")?;
        Ok(MemoryRegion { mr, access, pd: pd.clone(), iova: addr as u64 })
    }

    /// `ibv_reg_dmabuf_mr`: registers `len` bytes at `offset` of the dma-buf
    /// `fd`, addressed by the peer and in work requests as `iova`.
    ///
    /// # Safety
    /// The memory behind the dma-buf range must stay allocated until this
    /// value is dropped. The fd may be closed once this returns.
    ///
    /// # Errors
    /// [`Error::NotSupported`] when the device or kernel cannot register
    /// dma-bufs (`EOPNOTSUPP`, `EPROTONOSUPPORT`), else [`Error::Verbs`].
    #[cfg(gpu_rdma_dmabuf_mr)]
    pub unsafe fn register_dmabuf(
        pd: &ProtectionDomain,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
        relaxed: bool,
    ) -> Result<Self> {
        use std::os::fd::AsRawFd;
        check_access(access)?;
        let mut bits = to_ibv_access(access);
        if relaxed {
            bits |= ffi::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0 as libc::c_int;
        }
        let reg = ibverbs()?.ibv_reg_dmabuf_mr.ok_or(Error::NotSupported {
            op: "ibv_reg_dmabuf_mr (this libibverbs is older than rdma-core 34)",
            source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
        })?;
        // SAFETY: valid PD and an fd the caller keeps open for this call; the
        // caller guarantees the memory's lifetime.
        let mr = unsafe { reg(pd.as_raw(), offset, len, iova, fd.as_raw_fd(), bits) };
        let mr = result::nonnull(mr, "ibv_reg_dmabuf_mr")?;
        // libibverbs stores the dma-buf offset in `ibv_mr::addr`; peers and
        // work requests address the region by its iova.
        Ok(MemoryRegion { mr, access, pd: pd.clone(), iova })
    }

    fn raw(&self) -> &ffi::ibv_mr {
        // SAFETY: the MR is live until Drop and its public fields are immutable.
        unsafe { self.mr.as_ref() }
    }

    /// The local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.raw().lkey
    }

    /// The remote key, what a peer needs to read or write it.
    pub fn rkey(&self) -> u32 {
        self.raw().rkey
    }

    /// The start address peers and work requests use: the registered
    /// address, or for a dma-buf registration its iova (libibverbs reports
    /// the dma-buf offset in `ibv_mr::addr` there).
    pub fn addr(&self) -> u64 {
        self.iova
    }

    /// The registered length.
    pub fn len(&self) -> usize {
        self.raw().length
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The access rights it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The protection domain it belongs to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The raw handle.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.mr.as_ptr()
    }
}

impl MemoryRegion {
    fn dereg(&mut self) -> Result<()> {
        // SAFETY: registered by ibv_reg_mr / ibv_reg_dmabuf_mr; callers make sure
        // this runs once (Drop, or `deregister` which then forgets self).
        let rc = unsafe { (ibverbs()?.ibv_dereg_mr)(self.mr.as_ptr()) };
        result::errno_rc(rc, "ibv_dereg_mr")
    }

    /// Deregisters, reporting failure. When this fails the registration may
    /// still be live: the caller must not free the memory (leak it instead).
    ///
    /// # Errors
    /// [`Error::Verbs`] from `ibv_dereg_mr`.
    pub fn deregister(self) -> Result<()> {
        let mut this = std::mem::ManuallyDrop::new(self);
        let outcome = this.dereg();
        // SAFETY: `this` is never used again and its Drop does not run; the PD
        // clone is dropped exactly once here.
        unsafe { std::ptr::drop_in_place(&mut this.pd) };
        outcome
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let lkey = self.lkey();
        if let Err(e) = self.dereg() {
            // Never panic in Drop. Owners that free the memory use `deregister`.
            tracing::error!(lkey, "{e}");
        }
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access)
            .finish()
    }
}
