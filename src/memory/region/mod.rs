//! Registered memory: [`Region`] (owned, local use) and [`Exposed`]
//! (shared, with a remote key).

use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{Bound, Deref, DerefMut, RangeBounds};
use std::sync::{Arc, Mutex};

use super::Registration;
use super::domain::Live;
use super::keys::Served;
use super::path::{MemPath, PathReport};
use super::{Access, HostMemory, Memory, MemoryKind, RemoteRegion};
use crate::error::{Error, Result};

/// Memory registered with a [`Domain`](crate::Domain), for local use in operations:
/// the source of sends and writes, the destination of receives and reads.
///
/// It owns its memory and frees it only after deregistering. Operations
/// take it by value and return it with their completion, so while the
/// device may touch it nothing else can. It is registered with
/// [`Access::LOCAL`] by default and never has a remote key; see
/// [`Domain::expose`](crate::Domain::expose) for that.
///
/// Host-memory regions dereference to `[u8]`.
pub struct Region<M: Memory = HostMemory> {
    // Dropped by hand: deregister, then free (or leak, if deregistration failed).
    reg: ManuallyDrop<Registration>,
    mem: ManuallyDrop<M>,
    access: Access,
    path: Option<Box<PathReport>>,
    domain: u64,
    _live: Live,
}

impl<M: Memory> Drop for Region<M> {
    fn drop(&mut self) {
        // SAFETY: both fields are taken exactly once, here, and never used again.
        let (reg, mem) = unsafe { (ManuallyDrop::take(&mut self.reg), ManuallyDrop::take(&mut self.mem)) };
        release(reg, mem);
    }
}

/// Deregisters, then frees. If deregistration fails the device may still
/// reach the memory, so it is leaked rather than freed.
fn release<M>(reg: Registration, mem: M) {
    if let Err(e) = reg.deregister() {
        tracing::error!("memory deregistration failed, leaking the memory so the device cannot reach freed pages: {e}");
        std::mem::forget(mem);
    }
}

impl<M: Memory> Region<M> {
    /// The library's own region (a connection's cover slots): counted as
    /// internal, not in the domain's user-facing stats.
    pub(crate) fn count_as_internal(&mut self) {
        self._live.recount(crate::memory::Counter::Internal);
    }

    pub(crate) fn from_parts(
        reg: Registration,
        mem: M,
        access: Access,
        path: Option<PathReport>,
        domain: u64,
        live: Live,
    ) -> Self {
        Region {
            reg: ManuallyDrop::new(reg),
            mem: ManuallyDrop::new(mem),
            access,
            path: path.map(Box::new),
            domain,
            _live: live,
        }
    }

    /// For GPU memory: the path the NIC reaches it by (dma-buf,
    /// nvidia-peermem or staged). `None` for host memory.
    pub fn memory_path(&self) -> Option<MemPath> {
        self.path.as_ref().map(|p| p.chosen)
    }

    /// For GPU memory: the path chosen and why the others lost.
    pub fn path_report(&self) -> Option<&PathReport> {
        self.path.as_deref()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.mem.len() == 0
    }

    /// The access rights it is registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.mem.kind()
    }

    /// The local key (for the low-level [`crate::verbs`] API).
    pub fn lkey(&self) -> u32 {
        self.reg.lkey()
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    /// The memory it owns.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// A byte range of it, for an operation (the same as
    /// [`LocalBuffer::slice`], without importing the trait).
    pub fn slice(self, range: impl RangeBounds<usize>) -> LocalSlice<Self> {
        LocalSlice::new(self, range)
    }

    /// The identity of the domain it is registered with (as
    /// [`Domain::id`](crate::Domain::id) says).
    pub fn domain_id(&self) -> u64 {
        self.domain
    }

    /// Deregisters and gives the memory back.
    ///
    /// # Errors
    /// When deregistration fails the memory may still be reachable by the
    /// device: it is leaked, and the error returned.
    pub fn into_memory(self) -> Result<M> {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never used again and its Drop does not run; every
        // field is taken or dropped exactly once here.
        let (reg, mem) = unsafe {
            std::ptr::drop_in_place(&mut this.path);
            std::ptr::drop_in_place(&mut this._live);
            (ManuallyDrop::take(&mut this.reg), ManuallyDrop::take(&mut this.mem))
        };
        match reg.deregister() {
            Ok(()) => Ok(mem),
            Err(e) => {
                std::mem::forget(mem);
                Err(e)
            }
        }
    }
}

impl Region<HostMemory> {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.mem.as_slice()
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }
}

impl Deref for Region<HostMemory> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.mem.as_slice()
    }
}

impl DerefMut for Region<HostMemory> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }
}

impl<M: Memory + fmt::Debug> fmt::Debug for Region<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("memory", &self.mem)
            .field("lkey", &format_args!("{:#x}", self.reg.lkey()))
            .field("access", &self.access)
            .finish()
    }
}

mod exposed;
mod local;

pub use exposed::{Exposed, Shared, WithdrawError};
pub use local::{LocalBuffer, LocalSlice};
pub(crate) use local::{LocalParts, parts_of};
