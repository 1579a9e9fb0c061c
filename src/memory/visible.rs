//! What makes the bytes peers wrote into an exposed GPU region visible to
//! CUDA work, found by the key the peers used: a notification names the
//! region (its remote key) and the ranges its transfer wrote, and the
//! receiving side makes those visible before the notification is handed
//! out (a copy from the host mirror on the staged path, a flush of remote
//! writes where the GPU needs one on a direct path). Host memory needs
//! nothing, and is not listed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, Weak};

use crate::error::Result;

/// An exposed region whose remote writes need a step to become visible.
pub(crate) trait Visible: Send + Sync {
    /// Makes the `len` bytes peers wrote at `addr` (an address of the
    /// region's descriptor) visible to CUDA work; waits for the copy.
    fn make_visible(&self, addr: u64, len: u64) -> Result<()>;

    /// On a direct path, flushes the remote writes the NIC made into the
    /// region (where the GPU needs that); nothing on the staged path, which
    /// needs the range written ([`make_visible`](Self::make_visible)).
    fn flush_direct(&self) -> Result<()>;
}

/// A domain's exposed GPU regions, by remote key. Cloning shares the table.
#[derive(Clone, Default)]
pub(crate) struct VisibleTable {
    map: Arc<RwLock<HashMap<u32, Weak<dyn Visible>>>>,
    /// Set once a region was listed: until then every look is one load.
    any: Arc<AtomicBool>,
    /// Set once a region on the staged path was exposed for remote writes:
    /// connections made since ask their peers to cover writes with
    /// immediate ([`crate::bootstrap::CAP_IMM_COVERS`]).
    staged_writable: Arc<AtomicBool>,
}

impl VisibleTable {
    /// Lists `region` under `key` (until it is dropped).
    pub(crate) fn add(&self, key: u32, region: Weak<dyn Visible>) {
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        map.insert(key, region);
        self.any.store(true, Ordering::Release);
    }

    /// A region on the staged path was exposed for remote writes.
    pub(crate) fn mark_staged_writable(&self) {
        self.staged_writable.store(true, Ordering::Release);
    }

    /// Whether a region on the staged path was ever exposed for remote
    /// writes in the domain.
    pub(crate) fn staged_writable(&self) -> bool {
        self.staged_writable.load(Ordering::Acquire)
    }

    /// Whether a GPU region was ever exposed in the domain.
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Makes what peers wrote at `addr..addr + len` under `key` visible;
    /// nothing for a key of host memory (or of a region gone since).
    pub(crate) fn make_visible(&self, key: u32, addr: u64, len: u64) -> Result<()> {
        if !self.any() {
            return Ok(());
        }
        let region = self.map.read().unwrap_or_else(|e| e.into_inner()).get(&key).and_then(Weak::upgrade);
        match region {
            Some(r) => r.make_visible(addr, len),
            None => Ok(()),
        }
    }

    /// Flushes the remote writes into every exposed GPU region on a direct
    /// path ([`Visible::flush_direct`]): for an immediate, which names no
    /// range.
    pub(crate) fn flush_direct(&self) -> Result<()> {
        if !self.any() {
            return Ok(());
        }
        let regions: Vec<Arc<dyn Visible>> =
            self.map.read().unwrap_or_else(|e| e.into_inner()).values().filter_map(Weak::upgrade).collect();
        regions.iter().try_for_each(|r| r.flush_direct())
    }
}
