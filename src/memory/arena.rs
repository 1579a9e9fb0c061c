//! The registration cache for host memory: arenas the caller declares. A
//! framework keeps its host tensors in a few large pools (a pinned pool, a
//! KV cache); declaring a pool registers it once, and every later
//! registration of memory inside it is served that registration instead of
//! pinning the pages again.
//!
//! Host memory has no allocation identity the way GPU memory has, and a
//! mapping found by address may be unmapped and mapped again by the
//! allocator behind our back. So the cache holds only what was declared:
//! the arena owns its memory (or a guard of the owner's), which cannot be
//! freed while it is declared or while any region served from it lives.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::foreign::ForeignHost;
use super::{Live, Memory, Registration};
use crate::access::Access;
use crate::error::{Error, Result};

/// What a domain's registration caches did and hold
/// ([`Domain::registration_cache_stats`](crate::Domain::registration_cache_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistrationCacheStats {
    /// Registrations served an existing registration: GPU memory on a
    /// direct path served its block's, host memory its arena's.
    pub hits: u64,
    /// Registrations that registered anew where a cache could serve: a GPU
    /// block on a direct path, or host memory inside a declared arena while
    /// the cache is off or with remote rights asked.
    pub misses: u64,
    /// GPU blocks held registered.
    pub blocks: usize,
    /// Their bytes.
    pub bytes: usize,
    /// Host arenas declared ([`Domain::declare_host_arena`](crate::Domain::declare_host_arena)).
    pub arenas: usize,
    /// Their bytes (registered while declared, whatever the bound).
    pub arena_bytes: usize,
}

/// One declared arena: its registration and its memory, deregistered
/// before the memory goes (leaked if deregistration fails).
pub(crate) struct ArenaCore {
    start: usize,
    len: usize,
    reg: ManuallyDrop<Registration>,
    mem: ManuallyDrop<Box<dyn Memory>>,
    _live: Live,
}

impl ArenaCore {
    pub(crate) fn registration(&self) -> &Registration {
        &self.reg
    }

    fn holds(&self, ptr: usize, len: usize) -> bool {
        ptr >= self.start && ptr.checked_add(len).is_some_and(|end| end <= self.start + self.len)
    }
}

impl Drop for ArenaCore {
    fn drop(&mut self) {
        // SAFETY: both fields are taken exactly once, here.
        let (reg, mem) = unsafe { (ManuallyDrop::take(&mut self.reg), ManuallyDrop::take(&mut self.mem)) };
        if let Err(e) = reg.deregister() {
            tracing::error!(
                "arena deregistration failed, leaking its memory so the device cannot reach freed pages: {e}"
            );
            std::mem::forget(mem);
        }
    }
}

/// A domain's declared arenas.
#[derive(Default)]
pub(crate) struct Arenas {
    declared: Mutex<Vec<Arc<ArenaCore>>>,
    /// How many are declared (read without the lock: none is the common case).
    count: AtomicUsize,
    off: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Arenas {
    /// Whether registrations are served from the arenas.
    pub(crate) fn set_serving(&self, on: bool) {
        self.off.store(!on, Ordering::Relaxed);
    }

    /// The arena registration that covers `ptr..ptr + len` for `access`
    /// (a hit); `None` when no arena holds the range, or one does but may
    /// not serve it (the cache is off, or remote rights are asked: a miss).
    pub(crate) fn serve(&self, ptr: *mut u8, len: usize, access: Access) -> Option<Arc<ArenaCore>> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let declared = self.declared.lock().unwrap_or_else(|e| e.into_inner());
        let arena = declared.iter().find(|a| a.holds(ptr as usize, len))?;
        if self.off.load(Ordering::Relaxed) || !access.remote().is_empty() {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(Arc::clone(arena))
    }

    /// Adds this cache's counts to `stats`.
    pub(crate) fn count_into(&self, stats: &mut RegistrationCacheStats) {
        let declared = self.declared.lock().unwrap_or_else(|e| e.into_inner());
        stats.hits += self.hits.load(Ordering::Relaxed);
        stats.misses += self.misses.load(Ordering::Relaxed);
        stats.arenas = declared.len();
        stats.arena_bytes = declared.iter().map(|a| a.len).sum();
    }

    fn withdraw(&self, core: &Arc<ArenaCore>) {
        let mut declared = self.declared.lock().unwrap_or_else(|e| e.into_inner());
        declared.retain(|a| !Arc::ptr_eq(a, core));
        self.count.store(declared.len(), Ordering::Relaxed);
    }
}

/// Host memory registered once, whose sub-ranges a domain registers for
/// free ([`Domain::declare_host_arena`](crate::Domain::declare_host_arena)).
///
/// [`view`](Self::view) hands out [`ForeignHost`] sub-ranges that keep the
/// arena's memory alive; registering one (or any [`Memory`] whose range
/// lies inside the arena) is served the arena's registration and counted
/// as a hit in [`Domain::registration_cache_stats`](crate::Domain::registration_cache_stats).
/// Dropping the arena withdraws it: nothing more is served from it, and
/// its registration and memory go when the last region served from it
/// and the last view do.
pub struct HostArena {
    core: Arc<ArenaCore>,
    arenas: Arc<Arenas>,
    /// All of it, as a view: what copies in and out go through.
    whole: ForeignHost,
}

impl HostArena {
    /// Registers `mem` by `register` as an arena and declares it, unless it
    /// is not host memory of at least one byte, or overlaps one declared (checked under the lock the registration is
    /// made under, so two overlapping declarations cannot both land).
    pub(crate) fn declare<M: Memory>(
        arenas: &Arc<Arenas>,
        mem: M,
        live: Live,
        register: impl FnOnce(&M) -> Result<Registration>,
    ) -> std::result::Result<HostArena, (Error, M)> {
        let (start, len) = (mem.as_ptr() as usize, mem.len());
        let host = mem.kind() == super::MemoryKind::Host;
        let Some(ptr) = std::ptr::NonNull::new(mem.as_ptr()).filter(|_| len > 0 && host) else {
            return Err((Error::InvalidArgument("a host arena is host memory of at least one byte".into()), mem));
        };
        let mut declared = arenas.declared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = declared.iter().find(|a| a.start < start + len && start < a.start + a.len) {
            let error = Error::InvalidArgument(format!(
                "host arena {start:#x}+{len} overlaps the declared arena {:#x}+{}",
                other.start, other.len
            ));
            return Err((error, mem));
        }
        let reg = match register(&mem) {
            Ok(reg) => reg,
            Err(error) => return Err((error, mem)),
        };
        let core = Arc::new(ArenaCore {
            start,
            len,
            reg: ManuallyDrop::new(reg),
            mem: ManuallyDrop::new(Box::new(mem)),
            _live: live,
        });
        // SAFETY: the arena's own memory, which the `Arc<ArenaCore>` guard
        // keeps allocated and mapped while the view lives; no Rust reference
        // to it is handed out.
        let whole = unsafe { ForeignHost::from_non_null(ptr, len, Box::new(Arc::clone(&core))) };
        declared.push(Arc::clone(&core));
        arenas.count.store(declared.len(), Ordering::Relaxed);
        Ok(HostArena { core, arenas: Arc::clone(arenas), whole })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.core.start as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.core.len
    }

    /// Whether the length is zero (never: arenas are not empty).
    pub fn is_empty(&self) -> bool {
        self.core.len == 0
    }

    /// `len` bytes at `offset`, as memory to register: the view keeps the
    /// arena's memory (not its declaration) alive.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the end; [`Error::InvalidArgument`] for
    /// zero bytes.
    pub fn view(&self, offset: usize, len: usize) -> Result<ForeignHost> {
        Error::check_local(offset, len, self.core.len)?;
        // SAFETY: the range is inside the arena's memory (checked), which the
        // `Arc<ArenaCore>` guard keeps allocated and mapped until the view is
        // dropped; the arena hands out no Rust references to it.
        unsafe { ForeignHost::from_raw(self.whole.as_ptr().add(offset), len, Box::new(Arc::clone(&self.core))) }
    }

    /// Copies `data` in at `offset` (bytes mix with any operation touching
    /// the range at once).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the end.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.whole.write_at(offset, data)
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the end.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.whole.read_at(offset, out)
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        self.arenas.withdraw(&self.core);
    }
}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena").field("addr", &self.addr()).field("len", &self.len()).finish()
    }
}
