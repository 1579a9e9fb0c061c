//! Host memory a peer writes at any time (a connection's notification
//! ring), read and cleared by this side word by word, never through a Rust
//! reference.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Exposed, HostMemory, Memory};

/// An exposed host region read while the peer may be writing it.
///
/// Every access is through a raw pointer: aligned words as atomics (the
/// peer's NIC, or this process's TCP receiver, stores them as plain
/// writes; an aligned 8-byte load sees either the old or the new word), and
/// byte ranges with volatile copies, so no `&[u8]` to the memory ever
/// exists.
pub(crate) struct PeerWritten {
    region: Exposed<HostMemory>,
    base: *mut u8,
    len: usize,
}

// SAFETY: `base` points into `region`'s mapping, which `region` keeps alive
// and in place (`Memory`'s contract) for as long as `self`; every access
// through it is an atomic or volatile operation on bounds-checked offsets,
// so sharing it between threads races only as the peer's own writes do.
unsafe impl Send for PeerWritten {}
// SAFETY: as for `Send`: `&self` methods only do atomic or volatile
// accesses.
unsafe impl Sync for PeerWritten {}

impl PeerWritten {
    pub(crate) fn new(region: Exposed<HostMemory>) -> Self {
        let base = region.region_memory().as_ptr();
        let len = region.len();
        PeerWritten { region, base, len }
    }

    /// The region (for its descriptor and local key).
    pub(crate) fn region(&self) -> &Exposed<HostMemory> {
        &self.region
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len, "word {off} of {} bytes", self.len);
        // SAFETY: `off` is 8-aligned and in bounds (checked) in a mapping
        // that is page-aligned and live for `&self`'s lifetime; the word is
        // only ever accessed atomically from Rust (the peer's writes come
        // from outside the program: a device, or a syscall).
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast()) }
    }

    /// The little-endian word at `off`, with acquire ordering.
    pub(crate) fn load(&self, off: usize) -> u64 {
        u64::from_le(self.word(off).load(Ordering::Acquire))
    }

    /// Stores `v` little-endian at `off`, with release ordering.
    pub(crate) fn store(&self, off: usize, v: u64) {
        self.word(off).store(v.to_le(), Ordering::Release);
    }

    /// Copies `out.len()` bytes from `off`.
    pub(crate) fn copy_out(&self, off: usize, out: &mut [u8]) {
        assert!(off.checked_add(out.len()).is_some_and(|end| end <= self.len), "bytes {off}+{}", out.len());
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: in bounds (checked above) of the live mapping; a
            // volatile read of a byte the peer may be writing yields some
            // byte value, and the caller checks the record it belongs to.
            *b = unsafe { self.base.add(off + i).read_volatile() };
        }
    }

    /// Zeroes `len` bytes at `off`.
    pub(crate) fn zero(&self, off: usize, len: usize) {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "bytes {off}+{len}");
        for i in 0..len {
            // SAFETY: in bounds (checked above) of the live mapping, which no
            // Rust reference covers.
            unsafe { self.base.add(off + i).write_volatile(0) };
        }
    }
}
