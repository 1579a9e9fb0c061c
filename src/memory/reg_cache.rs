//! The registration cache for GPU memory on a direct path: a framework's
//! caching allocator hands out tensors as sub-ranges of a few large
//! blocks, and registering each tensor anew is what makes registration a
//! bottleneck (UCX and NCCL register a block once). Here the first
//! registration of any buffer inside a block registers the whole block;
//! every later one inside it is served that registration.
//!
//! Entries are keyed by the block's identity as the driver gives it
//! ([`Allocation`]: start, length and `BUFFER_ID`, never the same for two
//! allocations in a process's life): a block freed and allocated again,
//! even at the same address, is another block, and is never served the old
//! one's keys. The cache holds at most its bound of registered bytes that
//! no region uses (the least recently served go first); what regions use
//! stays registered until the last of them is gone.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::Registration;
use super::arena::RegistrationCacheStats;
use super::path::MemPath;
use crate::access::Access;
use crate::cuda::Allocation;
use crate::error::Result;

/// The bound by default: 64 GiB of registered GPU memory no region uses.
pub(crate) const DEFAULT_BOUND: usize = 64 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    block: Allocation,
    access: Access,
    path: MemPath,
}

struct Cached {
    key: Key,
    reg: Arc<Registration>,
}

/// The cache (see the module documentation).
pub(crate) struct RegCache {
    /// Least recently served first.
    entries: Mutex<VecDeque<Cached>>,
    bound: AtomicUsize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Default for RegCache {
    fn default() -> Self {
        RegCache {
            entries: Mutex::default(),
            bound: AtomicUsize::new(DEFAULT_BOUND),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }
}

impl RegCache {
    /// Whether buffers are served from it (a bound of 0 turns it off).
    pub(crate) fn enabled(&self) -> bool {
        self.bound.load(Ordering::Relaxed) > 0
    }

    /// Counts a registration the cache could have served but may not (it
    /// is off): made anew.
    pub(crate) fn count_miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// Sets the bound, letting go of what no region uses beyond it.
    pub(crate) fn set_bound(&self, bytes: usize) {
        self.bound.store(bytes, Ordering::Relaxed);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        trim(&mut entries, bytes);
    }

    /// The registration of `block` with `access` by `path`: served if it is
    /// there, else made by `register` (which registers the whole block) and
    /// kept. On a miss, entries no region uses whose block is gone
    /// (`still_allocated` says no: freed, perhaps allocated again as
    /// another block) are let go, so that a framework freeing its blocks
    /// does not leave them pinned here until the bound pushes them out.
    pub(crate) fn get_or_register(
        &self,
        block: Allocation,
        access: Access,
        path: MemPath,
        still_allocated: impl Fn(&Allocation) -> bool,
        register: impl FnOnce() -> Result<Registration>,
    ) -> Result<Arc<Registration>> {
        let key = Key { block, access, path };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = entries.iter().position(|e| e.key == key) {
            let e = entries.remove(at).expect("found");
            let reg = Arc::clone(&e.reg);
            entries.push_back(e);
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(reg);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        // A block freed is served to nobody again (regions still using it
        // keep its registration); its entry goes.
        entries.retain(|e| in_use(e) || e.key.block == block || still_allocated(&e.key.block));
        // Registered under the lock: two threads missing on one block at
        // once register it once.
        let reg = Arc::new(register()?);
        let bound = self.bound.load(Ordering::Relaxed);
        if block.len <= bound {
            // Room for it once its caller lets go: within the bound then.
            trim(&mut entries, bound - block.len);
            entries.push_back(Cached { key, reg: Arc::clone(&reg) });
        }
        Ok(reg)
    }

    pub(crate) fn counts(&self) -> RegistrationCacheStats {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        RegistrationCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            blocks: entries.len(),
            bytes: entries.iter().map(|e| e.key.block.len).sum(),
            ..Default::default()
        }
    }
}

/// Whether a region still uses the entry's registration.
fn in_use(e: &Cached) -> bool {
    Arc::strong_count(&e.reg) > 1
}

/// Lets go of the least recently served entries no region uses until
/// those left unused hold at most `bound` bytes.
fn trim(entries: &mut VecDeque<Cached>, bound: usize) {
    let mut idle: usize = entries.iter().filter(|e| !in_use(e)).map(|e| e.key.block.len).sum();
    let mut i = 0;
    while idle > bound && i < entries.len() {
        if in_use(&entries[i]) {
            i += 1;
            continue;
        }
        let e = entries.remove(i).expect("in range");
        idle -= e.key.block.len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(base: u64, len: usize, id: u64) -> Allocation {
        Allocation { base, len, id }
    }

    #[test]
    fn one_registration_per_block_a_new_identity_misses_and_the_bound_holds() {
        let cache = RegCache::default();
        let made = std::cell::Cell::new(0);
        let reg = || {
            made.set(made.get() + 1);
            Ok(Registration::Plain)
        };
        // The blocks the driver still has: all but the one freed (id 1).
        let live = |b: &Allocation| b.id != 1;
        let a = block(0x1000_0000, 1 << 20, 1);
        let held: Vec<_> = (0..1000)
            .map(|_| cache.get_or_register(a, Access::LOCAL_WRITE, MemPath::PeerMem, live, reg).unwrap())
            .collect();
        assert_eq!(made.get(), 1, "one registration for 1,000 buffers in one block");
        assert_eq!((cache.counts().hits, cache.counts().misses), (999, 1));
        // Another path is another registration.
        cache.get_or_register(a, Access::LOCAL_WRITE, MemPath::DmaBuf, live, reg).unwrap();
        assert_eq!(made.get(), 2);
        drop(held);
        // Freed and allocated again at the same address: a new identity, a
        // new registration; the old one is let go.
        let again = block(0x1000_0000, 1 << 20, 2);
        cache.get_or_register(again, Access::LOCAL_WRITE, MemPath::PeerMem, live, reg).unwrap();
        assert_eq!(made.get(), 3);
        assert_eq!(cache.counts().blocks, 1, "the freed block's entries were let go");
        // The bound: unused blocks beyond it go, least recently served first.
        cache.set_bound(3 << 20);
        for id in 10..20 {
            cache
                .get_or_register(
                    block(0x2000_0000 + (id << 24), 1 << 20, id),
                    Access::LOCAL_WRITE,
                    MemPath::PeerMem,
                    live,
                    reg,
                )
                .unwrap();
        }
        assert!(cache.counts().bytes <= 3 << 20, "{:?}", cache.counts());
        // A block in use stays, whatever else comes.
        let in_use = block(0x9000_0000, 1 << 20, 99);
        let kept = cache.get_or_register(in_use, Access::LOCAL_WRITE, MemPath::PeerMem, live, reg).unwrap();
        for id in 20..30 {
            let b = block(0x2000_0000 + (id << 24), 1 << 20, id);
            cache.get_or_register(b, Access::LOCAL_WRITE, MemPath::PeerMem, live, reg).unwrap();
        }
        let before = made.get();
        cache.get_or_register(in_use, Access::LOCAL_WRITE, MemPath::PeerMem, live, reg).unwrap();
        assert_eq!(made.get(), before, "the block in use was still there");
        // A block larger than the bound is registered, never kept.
        let big = block(0xa000_0000, 8 << 20, 100);
        cache.get_or_register(big, Access::LOCAL_WRITE, MemPath::PeerMem, live, reg).unwrap();
        cache.get_or_register(big, Access::LOCAL_WRITE, MemPath::PeerMem, live, reg).unwrap();
        assert_eq!(made.get(), before + 2);
        drop(kept);
        cache.set_bound(0);
        assert_eq!(cache.counts().bytes, 0);
        assert!(!cache.enabled());
    }
}
