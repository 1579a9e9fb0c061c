//! Page-aligned host memory from `mmap` (a leaf: the staging buffers of
//! the CUDA layer use it too).

use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Zeroed, page-aligned host memory mapped with `mmap(MAP_ANONYMOUS)`.
///
/// Pages are zero-filled on first touch, so allocating a large buffer is
/// cheap until it is registered (which pins it) or written.
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned exclusively by this value; access goes through
// `&self`/`&mut self` borrows like a Box<[u8]>.
unsafe impl Send for HostMemory {}
// SAFETY: shared access hands out only `&[u8]`.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Maps `len` zeroed bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero bytes; [`Error::Io`] when the
    /// kernel refuses the mapping.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate a zero-byte buffer".into()));
        }
        // SAFETY: an anonymous private mapping at an address of the kernel's
        // choosing touches no existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::Io(std::io::Error::last_os_error()));
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::Io(std::io::Error::other("mmap returned NULL")))?;
        Ok(HostMemory { ptr, len })
    }

    /// Maps `data.len()` bytes and copies `data` in.
    ///
    /// # Errors
    /// As [`HostMemory::new`].
    pub fn from_slice(data: &[u8]) -> Result<Self> {
        let mut mem = HostMemory::new(data.len())?;
        mem.as_mut_slice().copy_from_slice(data);
        Ok(mem)
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is a live mapping owned by self; `&self` rules
        // out a concurrent `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The mapping's address (for `Memory`, registration and copies).
    pub(crate) fn raw(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Its length.
    pub(crate) fn mapped_len(&self) -> usize {
        self.len
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `new` with this length and is unmapped once.
        if unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) } != 0 {
            tracing::error!("munmap of {} bytes failed: {}", self.len, std::io::Error::last_os_error());
        }
    }
}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostMemory({:p}+{})", self.ptr, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_page_aligned_and_writable() {
        let mut m = HostMemory::new(10_000).unwrap();
        assert_eq!(m.raw() as usize % 4096, 0);
        assert!(m.as_slice().iter().all(|&b| b == 0));
        m.as_mut_slice()[9_999] = 7;
        assert_eq!(m.as_slice()[9_999], 7);
        assert!(matches!(HostMemory::new(0), Err(Error::InvalidArgument(_))));
        assert_eq!(HostMemory::from_slice(b"abc").unwrap().as_slice(), b"abc");
    }
}
