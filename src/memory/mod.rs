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

#[cfg(feature = "cuda")]
pub mod gpu;
mod host;
pub mod path;
mod region;

pub use host::HostMemory;
pub(crate) use region::LocalParts;
pub use region::{Exposed, LocalBuffer, LocalSlice, Region, Shared, WithdrawError};

use std::fmt;
use std::ops::{Bound, RangeBounds};

use crate::error::{Error, Result};

bitflags::bitflags! {
    /// Access rights of a memory registration. Values match `IBV_ACCESS_*`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local device may write it (receives, read destinations).
        const LOCAL_WRITE = 1;
        /// Peers may write it.
        const REMOTE_WRITE = 2;
        /// Peers may read it.
        const REMOTE_READ = 4;
        /// Peers may run atomics on it.
        const REMOTE_ATOMIC = 8;
    }
}

impl Access {
    /// Local use only: the least privilege, and the default.
    pub const LOCAL: Access = Access::LOCAL_WRITE;

    /// The remote rights alone.
    pub fn remote(self) -> Access {
        self & (Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
    }
}

impl Default for Access {
    fn default() -> Self {
        Access::LOCAL
    }
}

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

/// What a peer needs to read or write one of our regions: sent in the
/// handshake, or in a message of your own (see [`RemoteRegion::to_bytes`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// A tag chosen by the owner, to tell regions apart.
    pub tag: u64,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
    /// The remote rights granted.
    pub access: Access,
}

impl RemoteRegion {
    /// The whole region.
    pub fn whole(&self) -> RemoteSlice {
        RemoteSlice { addr: self.addr, len: self.len, rkey: self.rkey, access: self.access }
    }

    /// A byte range of it.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range does not fit.
    pub fn slice(&self, range: impl RangeBounds<u64>) -> Result<RemoteSlice> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len,
        };
        if start > end || end > self.len {
            return Err(Error::OutOfBounds {
                side: "remote",
                offset: start,
                len: end.saturating_sub(start),
                region_len: self.len,
            });
        }
        Ok(RemoteSlice { addr: self.addr + start, len: end - start, rkey: self.rkey, access: self.access })
    }

    /// The 32-byte wire form (the same as in the handshake).
    pub fn to_bytes(&self) -> [u8; crate::bootstrap::REGION_LEN] {
        crate::bootstrap::encode_region(self)
    }

    /// Parses the wire form.
    ///
    /// # Errors
    /// [`crate::BootstrapError::Malformed`] for a wrong length, an address
    /// range that wraps, or unknown access bits.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Ok(crate::bootstrap::decode_region(bytes)?)
    }
}

impl fmt::Debug for RemoteRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RemoteRegion(tag {} {:#x}+{} rkey {:#x} {:?})",
            self.tag, self.addr, self.len, self.rkey, self.access
        )
    }
}

/// A byte range of a peer's region: the target of a write, the source of a read.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteSlice {
    addr: u64,
    len: u64,
    rkey: u32,
    access: Access,
}

impl RemoteSlice {
    /// A range named by raw address, length and remote key, with no local
    /// check at all: what is wrong is found by the peer's device and
    /// reported as a remote-access error completion. Safe, since only the
    /// peer's memory is at stake, and the peer's device protects it.
    pub fn from_raw_parts(addr: u64, len: u64, rkey: u32) -> Self {
        RemoteSlice { addr, len, rkey, access: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC }
    }

    /// Start address at the peer.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The rights the region grants, as far as this side knows.
    pub fn access(&self) -> Access {
        self.access
    }

    /// `len` bytes at `offset` (the caller checked the range).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn sub(&self, offset: u64, len: u64) -> RemoteSlice {
        RemoteSlice { addr: self.addr + offset, len, ..*self }
    }

    /// The first `len` bytes.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn prefix(&self, len: u64) -> Result<RemoteSlice> {
        if len > self.len {
            return Err(Error::OutOfBounds { side: "remote", offset: 0, len, region_len: self.len });
        }
        Ok(RemoteSlice { len, ..*self })
    }
}

impl fmt::Debug for RemoteSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RemoteSlice({:#x}+{} rkey {:#x})", self.addr, self.len, self.rkey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> RemoteRegion {
        RemoteRegion { tag: 7, addr: 0x1000, len: 100, rkey: 0x42, access: Access::REMOTE_WRITE }
    }

    #[test]
    fn slices_are_bounds_checked() {
        let r = region();
        let s = r.slice(10..20).unwrap();
        assert_eq!((s.addr(), s.len(), s.rkey()), (0x100a, 10, 0x42));
        assert_eq!(r.slice(..).unwrap(), r.whole());
        assert_eq!(r.slice(100..).unwrap().len(), 0);
        assert!(matches!(
            r.slice(90..101),
            Err(Error::OutOfBounds { side: "remote", offset: 90, len: 11, region_len: 100 })
        ));
        let (start, end) = (50, 40);
        assert!(matches!(r.slice(start..end), Err(Error::OutOfBounds { .. })));
        assert!(matches!(r.whole().prefix(101), Err(Error::OutOfBounds { .. })));
    }

    #[test]
    fn access_defaults_to_least_privilege() {
        assert_eq!(Access::default(), Access::LOCAL_WRITE);
        assert!(Access::default().remote().is_empty());
        assert_eq!((Access::LOCAL_WRITE | Access::REMOTE_READ).remote(), Access::REMOTE_READ);
    }

    #[test]
    fn descriptor_round_trips_through_bytes() {
        let r = region();
        assert_eq!(RemoteRegion::from_bytes(&r.to_bytes()).unwrap(), r);
        assert!(RemoteRegion::from_bytes(&r.to_bytes()[..31]).is_err());
    }
}
