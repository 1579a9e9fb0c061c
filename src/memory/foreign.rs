//! Host memory someone else owns: a framework's pinned pool, a Python
//! buffer, a `Vec` handed over. The owner is kept alive by a guard held
//! inside the value, so no registration made from it can outlive it.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;

use super::{Memory, MemoryKind};
use crate::error::{Error, Result};

/// Host memory the caller owns, kept alive for as long as this value (and
/// so every registration made from it) lives.
///
/// Made from a raw range and its owner (`unsafe`: that the range is the
/// owner's and stays valid is the caller's promise), from a `Vec<u8>`, or
/// as a view of a [`HostArena`](crate::HostArena), which a domain serves
/// from the arena's one registration.
///
/// It hands out no `&[u8]`: views of one arena may overlap, and the owner
/// may keep its own pointers. Copy in and out with
/// [`read_at`](Self::read_at) and [`write_at`](Self::write_at); while an
/// operation may touch the range, such copies see or make mixed bytes,
/// never unsafe memory.
pub struct ForeignHost {
    ptr: NonNull<u8>,
    len: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the range is reached only through raw-pointer copies (no Rust
// references to it are handed out), and the owner guard is itself
// `Send + Sync`.
unsafe impl Send for ForeignHost {}
// SAFETY: as above.
unsafe impl Sync for ForeignHost {}

impl ForeignHost {
    /// Wraps `len` bytes at `ptr`, owned by `keep_alive`, which is dropped
    /// when this value is (after every registration made from it).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be host memory, readable and writable, that
    /// stays mapped at that address and is not freed for as long as
    /// `keep_alive` lives. Others may read or write it meanwhile (bytes then
    /// mix), but none may hold a Rust `&mut` to it while an operation
    /// reads it, or a `&` while one writes it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a null pointer or zero length.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, keep_alive: Box<dyn Any + Send + Sync>) -> Result<Self> {
        let ptr = NonNull::new(ptr).filter(|_| len > 0).ok_or_else(|| {
            Error::InvalidArgument("foreign host memory needs a non-null pointer and a length".into())
        })?;
        // SAFETY: forwarded contract; `len` is not zero (checked).
        Ok(unsafe { ForeignHost::from_non_null(ptr, len, keep_alive) })
    }

    /// [`from_raw`](Self::from_raw) for a pointer and length already checked.
    ///
    /// # Safety
    /// As `from_raw`, and `len > 0`.
    pub(crate) unsafe fn from_non_null(ptr: NonNull<u8>, len: usize, keep_alive: Box<dyn Any + Send + Sync>) -> Self {
        ForeignHost { ptr, len, _owner: keep_alive }
    }

    /// Takes a `Vec`'s bytes as they are, no copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty vector.
    pub fn from_vec(mut bytes: Vec<u8>) -> Result<Self> {
        let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
        // SAFETY: the vector's buffer is `len` initialized bytes that stay at
        // `ptr` while the vector lives unchanged; it moves into the guard,
        // and nothing resizes it there.
        unsafe { ForeignHost::from_raw(ptr, len, Box::new(bytes)) }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        Error::check_local(offset, len, self.len)
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the end.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        // SAFETY: in bounds (checked) of a range valid while `self` lives;
        // `out` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` in at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the end.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: as in `read_at`; no Rust reference to the range exists
        // that this write could break (the type hands none out).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len()) };
        Ok(())
    }
}

// SAFETY: the range is valid and fixed while the owner guard lives, which is
// as long as this value (`from_raw`'s contract, or the Vec or arena it
// holds). The contract's exclusivity is relaxed as for `Alias`: no Rust
// reference to the bytes is made through this value, so overlapping views
// and the owner's own access mix bytes, never break memory safety.
unsafe impl Memory for ForeignHost {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
}

impl fmt::Debug for ForeignHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignHost").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}
