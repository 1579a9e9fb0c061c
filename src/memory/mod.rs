//! Memory: what can be registered, registered regions, and descriptors of
//! a peer's regions.
//!
//! The ownership rules that keep the device from touching freed memory:
//!
//! - A [`Region`] owns its memory and its registration, and deregisters
//!   before it frees. It is not `Clone`. It gives `&[u8]`/`&mut [u8]` access
//!   (host memory) only while no operation uses it, because operations take
//!   it by value and hand it back with their completion.
//! - An [`Exposed`] region also has a remote key a peer may use at any
//!   time. It is shared (`Clone`) and gives no safe references to its
//!   bytes, only copies; [`Exposed::withdraw`] revokes the remote key and
//!   returns the plain [`Region`].
//! - An operation dropped before it completes keeps its buffer inside the
//!   connection until the device is done with it.

pub(crate) mod alias;
pub(crate) mod arena;
pub(crate) mod domain;
mod foreign;
#[cfg(feature = "cuda")]
pub mod gpu;
mod host;
pub(crate) mod keys;
pub mod path;
pub(crate) mod peer_written;
#[cfg(feature = "cuda")]
pub(crate) mod reg_cache;
mod region;
mod registration;
#[cfg(feature = "cuda")]
pub(crate) mod staging;
#[cfg(feature = "cuda")]
pub(crate) mod visible;

pub use crate::access::Access;
pub use crate::host_memory::HostMemory;
pub use crate::remote::{RemoteRegion, RemoteSlice};
pub use arena::{HostArena, RegistrationCacheStats};
pub use domain::DomainStats;
pub(crate) use domain::{Counter, Live, MemoryDomain};
pub use foreign::ForeignHost;
pub use region::{Exposed, LocalBuffer, LocalSlice, Region, Shared, WithdrawError};
pub(crate) use region::{LocalParts, parts_of};
pub(crate) use registration::Registration;

/// Where memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Host (CPU) memory.
    Host,
    /// CUDA device memory of the GPU with this ordinal.
    Cuda {
        /// The device ordinal.
        ordinal: usize,
    },
}

/// Memory that can be registered with a device.
///
/// # Safety
/// An implementor guarantees that `as_ptr()..as_ptr() + len()`:
/// - is memory the value owns, that no one else frees, remaps or accesses
///   through anything but this value;
/// - stays allocated and at the same address for as long as the value
///   lives, even when the value itself is moved;
/// - is of the [`kind`](Memory::kind) reported.
pub unsafe trait Memory: Send + Sync + 'static {
    /// Start address (host virtual address, or device address for GPU memory).
    fn as_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the length is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where it lives.
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    /// The CUDA buffer, when this is one (how registration finds the GPU
    /// paths). Only [`crate::cuda::CudaBuffer`] answers.
    #[cfg(feature = "cuda")]
    #[doc(hidden)]
    fn cuda_buffer(&self) -> Option<&crate::cuda::CudaBuffer> {
        None
    }
}
