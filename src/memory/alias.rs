//! One allocation registered in several domains at once: a rail set
//! registers the same bytes with each of its NICs, so every rail can move
//! them. [`Alias`] is the crate-private handle each registration owns.
//!
//! The [`Memory`] contract says a value owns its allocation alone; an alias
//! shares it. What the crate relies on from that contract still holds:
//!
//! - the allocation stays mapped, at the same address, while any alias
//!   lives: the aliases share one `Arc` of the owner, and each
//!   [`Region`](super::Region) deregisters before it drops its alias, so the
//!   memory is freed only after the last registration is gone;
//! - no one writes it through a Rust reference: a region over an alias
//!   offers no `&[u8]` or `&mut [u8]` (those exist only for
//!   `Region<HostMemory>`), and the rail set hands out only shared
//!   (exposed) handles, whose copies go through raw pointers.
//!
//! What an alias gives up is exclusive use: two rails may touch the bytes
//! at once, as two operations on one [`Shared`](super::Shared) region may;
//! overlapping ranges in flight at once mix bytes, memory stays safe.

use std::sync::Arc;

use super::{Memory, MemoryKind};

/// A shared handle on memory owned by an `Arc`, for registering it more
/// than once. Built only by [`aliases`].
pub(crate) struct Alias<M: Memory> {
    mem: Arc<M>,
}

/// `n` aliases of `mem`: the memory is freed when the last one is dropped.
pub(crate) fn aliases<M: Memory>(mem: M, n: usize) -> Vec<Alias<M>> {
    let mem = Arc::new(mem);
    (0..n).map(|_| Alias { mem: Arc::clone(&mem) }).collect()
}

impl<M: Memory> Alias<M> {
    /// The memory back, when this is the last alias.
    pub(crate) fn into_inner(self) -> Option<M> {
        Arc::try_unwrap(self.mem).ok()
    }
}

// SAFETY: the range is `M`'s own, valid and fixed while `M` lives (its
// contract), and `M` lives while any alias does (the shared `Arc`). The
// exclusivity part of the contract is replaced by the module's rules above:
// no Rust reference to the bytes is ever made through an alias.
unsafe impl<M: Memory> Memory for Alias<M> {
    fn as_ptr(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    fn len(&self) -> usize {
        self.mem.len()
    }

    fn kind(&self) -> MemoryKind {
        self.mem.kind()
    }

    #[cfg(feature = "cuda")]
    fn cuda_buffer(&self) -> Option<&crate::cuda::CudaBuffer> {
        self.mem.cuda_buffer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostMemory;

    #[test]
    fn aliases_share_one_allocation_freed_with_the_last() {
        let mem = HostMemory::new(4096).unwrap();
        let addr = mem.as_ptr();
        let mut all = aliases(mem, 3);
        assert!(all.iter().all(|a| a.as_ptr() == addr && a.len() == 4096 && a.kind() == MemoryKind::Host));
        let weak = Arc::downgrade(&all[0].mem);
        all.truncate(1);
        assert!(weak.upgrade().is_some(), "one alias still holds the memory");
        drop(all);
        assert!(weak.upgrade().is_none(), "the last alias frees it");
    }
}
