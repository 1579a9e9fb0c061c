//! What an operation needs of the domain it runs in, and nothing more: the
//! registrar (keys, the table of exposed GPU regions), the staging pool,
//! and the progress engine. A connection holds this, not the
//! [`Domain`](crate::Domain): it can register buffers for its own use
//! (notification buffers), stage GPU memory and be driven, but it cannot
//! open, expose or reconfigure anything.

use std::sync::Arc;

use crate::access::Access;
use crate::error::{Error, Result};
use crate::host_memory::HostMemory;
use crate::memory::{Counter, Live, Memory, MemoryDomain, Region};
use crate::transport::engine::Engine;

pub(crate) struct OpContext {
    mem: Arc<MemoryDomain>,
    #[cfg(feature = "cuda")]
    staging: crate::memory::staging::StagingHome,
    engine: Engine,
}

impl OpContext {
    /// The context of a domain registering with `mem`; its engine's thread
    /// starts on first use.
    pub(crate) fn new(mem: Arc<MemoryDomain>) -> Result<Self> {
        Ok(OpContext {
            #[cfg(feature = "cuda")]
            staging: crate::memory::staging::StagingHome::new(Arc::clone(&mem)),
            mem,
            engine: Engine::new()?,
        })
    }

    /// The progress engine: wakes what awaits operations.
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Staging machinery per GPU (streams, pinned registered slots).
    #[cfg(feature = "cuda")]
    pub(crate) fn staging(&self) -> &crate::memory::staging::StagingHome {
        &self.staging
    }

    /// Registration, the key table, live counts.
    pub(crate) fn mem(&self) -> &Arc<MemoryDomain> {
        &self.mem
    }

    /// Counts one live resource of the domain until the guard drops.
    pub(crate) fn live(&self, which: Counter) -> Live {
        self.mem.live(which)
    }

    /// `len` zeroed bytes of page-aligned host memory registered for local
    /// use: what [`Domain::alloc`](crate::Domain::alloc) gives.
    pub(crate) fn alloc(&self, len: usize) -> Result<Region<HostMemory>> {
        self.register_host(HostMemory::new(len)?, Access::LOCAL).map_err(|(error, _)| error)
    }

    /// Registers host memory `mem` with `access`: its region, or why not
    /// and the memory back.
    pub(crate) fn register_host<M: Memory>(
        &self,
        mem: M,
        access: Access,
    ) -> std::result::Result<Region<M>, (Error, M)> {
        // SAFETY: `mem` is moved into the Region with the registration, and the
        // Region deregisters before it frees (or leaks) the memory; `Memory`'s
        // contract keeps the address range valid and fixed until then.
        match unsafe { self.mem.register(mem.as_ptr(), mem.len(), access) } {
            Ok(reg) => Ok(Region::from_parts(reg, mem, access, None, self.mem.id(), self.live(Counter::Regions))),
            Err(error) => Err((error, mem)),
        }
    }
}
