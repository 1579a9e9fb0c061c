//! What registering memory gave: the handle that keeps it registered (a
//! verbs memory region, a staged region's pinned mirror, or nothing where
//! there is nothing to register), deregistered before the memory goes.

use crate::error::Result;

/// A memory registration.
pub(crate) enum Registration {
    /// Host memory, or GPU memory on a direct path (dma-buf, nvidia-peermem).
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::MemoryRegion),
    /// Host memory in a domain without verbs: nothing to register.
    Plain,
    /// GPU memory on the staged path: nothing is registered; operations go
    /// through the domain's pinned, registered staging buffers.
    #[cfg(feature = "cuda")]
    Staged,
    /// A staged GPU region exposed to peers: a pinned host mirror with its
    /// own registration (remote rights). Peers read and write the mirror;
    /// the owner copies between it and the GPU.
    #[cfg(all(feature = "verbs", feature = "cuda"))]
    Mirror {
        // Declared first: deregistered before the mirror is freed.
        mr: crate::verbs::MemoryRegion,
        mem: crate::cuda::PinnedHost,
    },
    /// A staged region's mirror in a domain without verbs.
    #[cfg(feature = "cuda")]
    PlainMirror { mem: crate::cuda::PinnedHost },
    /// The registration of the whole GPU block this memory lies in, shared
    /// with every region inside it ([`reg_cache`](super::reg_cache)).
    #[cfg(feature = "cuda")]
    Shared(std::sync::Arc<Registration>),
    /// The registration of a declared host arena this memory lies in
    /// ([`arena`](super::arena)); the arena deregisters when the last
    /// holder lets go.
    Arena(std::sync::Arc<super::arena::ArenaCore>),
}

impl Registration {
    pub(crate) fn lkey(&self) -> u32 {
        match self {
            #[cfg(feature = "verbs")]
            Registration::Verbs(mr) => mr.lkey(),
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mr, .. } => mr.lkey(),
            #[cfg(feature = "cuda")]
            Registration::Shared(reg) => reg.lkey(),
            Registration::Arena(arena) => arena.registration().lkey(),
            _ => 0,
        }
    }

    /// The verbs remote key, when there is one.
    pub(crate) fn rkey(&self) -> Option<u32> {
        match self {
            #[cfg(feature = "verbs")]
            Registration::Verbs(mr) => Some(mr.rkey()),
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mr, .. } => Some(mr.rkey()),
            #[cfg(feature = "cuda")]
            Registration::Shared(reg) => reg.rkey(),
            Registration::Arena(arena) => arena.registration().rkey(),
            _ => None,
        }
    }

    /// Where peers address it, when that is not the registered memory
    /// itself (a staged region's host mirror).
    pub(crate) fn mirror(&self) -> Option<(u64, usize)> {
        #[cfg(feature = "cuda")]
        use crate::memory::Memory;
        match self {
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mem, .. } => Some((mem.as_ptr() as u64, mem.len())),
            #[cfg(feature = "cuda")]
            Registration::PlainMirror { mem } => Some((mem.as_ptr() as u64, mem.len())),
            _ => None,
        }
    }

    /// Deregisters; on failure the memory must be leaked, not freed.
    pub(crate) fn deregister(self) -> Result<()> {
        match self {
            #[cfg(feature = "verbs")]
            Registration::Verbs(mr) => mr.deregister(),
            Registration::Plain => Ok(()),
            #[cfg(feature = "cuda")]
            Registration::Staged => Ok(()),
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mr, mem } => match mr.deregister() {
                Ok(()) => Ok(()),
                Err(e) => {
                    std::mem::forget(mem);
                    Err(e)
                }
            },
            #[cfg(feature = "cuda")]
            Registration::PlainMirror { mem } => {
                drop(mem);
                Ok(())
            }
            // The block's registration is deregistered by whoever holds it
            // last (the cache, or the last region inside the block).
            #[cfg(feature = "cuda")]
            Registration::Shared(reg) => match std::sync::Arc::try_unwrap(reg) {
                Ok(reg) => reg.deregister(),
                Err(_) => Ok(()),
            },
            Registration::Arena(arena) => {
                drop(arena);
                Ok(())
            }
        }
    }
}
