//! Memory registered with every rail at once, and its descriptor.

#![forbid(unsafe_code)]

use crate::error::{BootstrapError, Error, Result};
use crate::host_memory::HostMemory;
use crate::memory::alias::Alias;
use crate::memory::{Exposed, Memory, RemoteRegion, Shared};
use crate::remote::REGION_LEN;

use super::*;

/// Host (or GPU) memory registered with every rail of a set: exposed to
/// peers under one key per rail ([`Rails::expose`], [`Rails::alloc`]), or
/// for local use only, as the source or destination of this side's
/// transfers ([`Rails::register`]). Cheap to clone.
///
/// Like an [`Exposed`] region it offers no `&[u8]`: a peer, or a transfer
/// in flight, may write it at any time. Copy with
/// [`read_at`](RailRegion::read_at) and [`write_at`](RailRegion::write_at).
pub struct RailRegion<M: Memory = HostMemory> {
    /// One registration per rail, in rail order, all of the same bytes, as
    /// this side's transfers use them.
    pub(super) rails: Vec<Shared<Alias<M>>>,
    /// The same registrations exposed to peers (empty for a local-only
    /// region).
    pub(super) exposed: Vec<Exposed<Alias<M>>>,
}

impl<M: Memory> Clone for RailRegion<M> {
    fn clone(&self) -> Self {
        RailRegion { rails: self.rails.clone(), exposed: self.exposed.clone() }
    }
}

impl<M: Memory> std::fmt::Debug for RailRegion<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailRegion").field("len", &self.len()).field("rails", &self.rails.len()).finish()
    }
}

impl<M: Memory> RailRegion<M> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.rails[0].len()
    }

    /// Whether the length is zero (never: empty memory is not registered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether peers may reach it (it was exposed), or only this side's
    /// transfers use it.
    pub fn is_exposed(&self) -> bool {
        !self.exposed.is_empty()
    }

    /// What a peer needs to reach it on every rail. A local-only region's
    /// ([`Rails::register`]) grants no rights: a peer's every access to it
    /// is refused.
    pub fn descriptor(&self) -> RailDescriptor {
        if self.exposed.is_empty() {
            let none = |r: &Shared<Alias<M>>| {
                let p = crate::memory::parts_of(r);
                RemoteRegion { tag: 0, addr: p.addr, len: p.len as u64, rkey: 0, access: crate::Access::empty() }
            };
            return RailDescriptor { rails: self.rails.iter().map(none).collect() };
        }
        RailDescriptor { rails: self.exposed.iter().map(Exposed::descriptor).collect() }
    }
}

impl RailRegion<HostMemory> {
    /// Copies `out.len()` bytes at `offset` out (see [`Exposed::read_at`]).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.rails[0].copy_out(offset, out)
    }

    /// Copies `data` in at `offset` (see [`Exposed::write_at`]).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.rails[0].copy_in(offset, data)
    }
}

/// A peer's [`RailRegion`]: one [`RemoteRegion`] per rail, all of one
/// length and rights. Sent as bytes ([`to_bytes`](Self::to_bytes)) over
/// whatever control plane the application has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailDescriptor {
    pub(super) rails: Vec<RemoteRegion>,
}

/// Leading byte of an encoded [`RailDescriptor`].
pub(super) const DESCRIPTOR_VERSION: u8 = 1;

impl RailDescriptor {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.rails[0].len()
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each rail's descriptor, in rail order.
    pub fn rails(&self) -> &[RemoteRegion] {
        &self.rails
    }

    /// The encoded form: a version byte, the rail count, then each rail's
    /// [`RemoteRegion::to_bytes`].
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + self.rails.len() * REGION_LEN);
        out.push(DESCRIPTOR_VERSION);
        out.push(self.rails.len() as u8);
        for r in &self.rails {
            out.extend_from_slice(&r.to_bytes());
        }
        out
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' form, checking it whole.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] ([`BootstrapError::Malformed`]) for a wrong
    /// version, length or rail count, a bad region, or rails that disagree
    /// on length or rights.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = |detail: String| Error::Bootstrap(BootstrapError::Malformed { what: "rail descriptor", detail });
        let [version, count, rest @ ..] = bytes else {
            return Err(bad(format!("{} bytes, shorter than its header", bytes.len())));
        };
        if *version != DESCRIPTOR_VERSION {
            return Err(bad(format!("version {version}, this side reads {DESCRIPTOR_VERSION}")));
        }
        let count = *count as usize;
        if count == 0 || count > MAX_RAILS {
            return Err(bad(format!("{count} rails (1 to {MAX_RAILS} allowed)")));
        }
        if rest.len() != count * REGION_LEN {
            return Err(bad(format!("{} bytes for {count} rails, which take {}", rest.len(), count * REGION_LEN)));
        }
        let rails = rest.chunks(REGION_LEN).map(RemoteRegion::from_bytes).collect::<Result<Vec<_>>>()?;
        let first = &rails[0];
        if let Some(r) = rails.iter().find(|r| r.len() != first.len() || r.access() != first.access()) {
            return Err(bad(format!(
                "rails disagree: {} bytes {:?} against {} bytes {:?}",
                r.len(),
                r.access(),
                first.len(),
                first.access()
            )));
        }
        Ok(RailDescriptor { rails })
    }
}
