//! Protection domains (`ibv_pd`).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::loader::ibverbs;

use super::context::Context;
use super::result;
use crate::error::Result;

/// A protection domain: memory regions and queue pairs in one domain may be
/// used together. Cheap to clone; freed when the last clone and every memory
/// region and queue pair made in it are gone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pd: NonNull<ffi::ibv_pd>,
    ctx: Context,
}

// SAFETY: an ibv_pd is an immutable handle; verbs taking it are thread-safe.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        let lib = match ibverbs() {
            Ok(lib) => lib,
            Err(e) => return tracing::error!("cannot free a protection domain: {e}"),
        };
        // SAFETY: allocated by ibv_alloc_pd, freed once; every MR and QP in it
        // holds an Arc of this and is already destroyed.
        let rc = unsafe { (lib.ibv_dealloc_pd)(self.pd.as_ptr()) };
        if let Err(e) = result::errno_rc(rc, "ibv_dealloc_pd") {
            tracing::error!(device = self.ctx.name(), "{e}");
        }
    }
}

impl ProtectionDomain {
    /// `ibv_alloc_pd`.
    ///
    /// # Errors
    /// [`crate::Error::Verbs`].
    pub fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: valid context; the PD is deallocated in Drop.
        let pd = result::nonnull(unsafe { (ibverbs()?.ibv_alloc_pd)(ctx.as_raw()) }, "ibv_alloc_pd")?;
        Ok(ProtectionDomain { inner: Arc::new(PdInner { pd, ctx: ctx.clone() }) })
    }

    /// The raw handle.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.pd.as_ptr()
    }

    /// The device it belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain").field("device", &self.inner.ctx.name()).finish()
    }
}
