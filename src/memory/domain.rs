//! The memory domain: what registers memory with the NIC (a protection
//! domain on an RDMA device, when there is one), the key table of what
//! peers may touch, and the count of live resources. Transports and
//! connections borrow it; it knows nothing of them.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::Access;
use super::keys::KeyTable;
use super::registration::Registration;
#[cfg(feature = "verbs")]
use crate::config::Transport;
use crate::config::{DomainConfig, DomainInfo, TransportPolicy};
use crate::error::{Error, Result};
#[cfg(feature = "verbs")]
use crate::verbs::{self, Context, DeviceAttr, GidChoice, MemoryRegion, PortAttr, ProtectionDomain, choose_gid};

/// Live resources of a domain, for leak checks and monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DomainStats {
    /// Registered [`Region`](crate::Region)s (including those inside [`Exposed`](crate::Exposed) ones).
    pub regions: usize,
    /// [`Exposed`](crate::Exposed) regions (remote keys outstanding).
    pub exposed: usize,
    /// Open connections (queue pairs).
    pub connections: usize,
}

#[derive(Debug, Default)]
struct Counters {
    regions: AtomicUsize,
    exposed: AtomicUsize,
    connections: AtomicUsize,
    internal: AtomicUsize,
}

/// What a [`Live`] counts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    Regions,
    Exposed,
    Connections,
    /// The crate's own resources (a connection's notification ring):
    /// counted apart, not in [`DomainStats`].
    Internal,
}

impl Counters {
    fn get(&self, c: Counter) -> &AtomicUsize {
        match c {
            Counter::Regions => &self.regions,
            Counter::Exposed => &self.exposed,
            Counter::Connections => &self.connections,
            Counter::Internal => &self.internal,
        }
    }
}

/// Counts one live resource until dropped.
#[derive(Debug)]
pub(crate) struct Live {
    counters: Arc<Counters>,
    which: Counter,
}

impl Live {
    /// Counts the resource as `which` from now on.
    pub(crate) fn recount(&mut self, which: Counter) {
        self.counters.get(which).fetch_add(1, Ordering::AcqRel);
        self.counters.get(self.which).fetch_sub(1, Ordering::AcqRel);
        self.which = which;
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.counters.get(self.which).fetch_sub(1, Ordering::AcqRel);
    }
}

/// A domain's memory side: the RDMA device that registers memory when one
/// is usable, the key table a software transport serves exposed memory
/// from, always, and the count of live resources.
pub(crate) struct MemoryDomain {
    id: u64,
    #[cfg(feature = "verbs")]
    pub(crate) verbs: Option<Nic>,
    pub(crate) keys: KeyTable,
    /// Exposed GPU regions, by key: what makes peers' writes visible.
    #[cfg(feature = "cuda")]
    pub(crate) visible: super::visible::VisibleTable,
    /// Why this domain has no verbs device.
    pub(crate) no_verbs: Option<String>,
    pub(crate) policy: TransportPolicy,
    counters: Arc<Counters>,
    /// Registrations of whole GPU blocks, served to the buffers inside them.
    #[cfg(feature = "cuda")]
    pub(crate) reg_cache: super::reg_cache::RegCache,
    /// Declared host arenas, served to the host memory inside them.
    pub(crate) arenas: Arc<super::arena::Arenas>,
}

static NEXT_DOMAIN_ID: AtomicU64 = AtomicU64::new(1);

/// Opens the device `config` names (or none, by its policy).
pub(crate) fn open(config: &DomainConfig) -> Result<MemoryDomain> {
    let id = NEXT_DOMAIN_ID.fetch_add(1, Ordering::Relaxed);
    let (keys, counters) = (KeyTable::default(), Arc::default());
    let policy = config.transport;
    #[cfg(feature = "verbs")]
    {
        let (v, no_verbs) = match policy {
            TransportPolicy::Tcp => (None, Some("TCP was asked for (GPU_RDMA_TRANSPORT=tcp, or in code)".to_owned())),
            TransportPolicy::Verbs => (Some(Nic::open(config)?), None),
            TransportPolicy::Auto => match Nic::open(config) {
                Ok(v) => (Some(v), None),
                // A device asked for by name is not replaced by TCP behind the caller's back.
                Err(e) if config.device.is_some() => return Err(e),
                Err(e) => (None, Some(e.to_string())),
            },
        };
        Ok(MemoryDomain {
            id,
            verbs: v,
            keys,
            #[cfg(feature = "cuda")]
            visible: Default::default(),
            no_verbs,
            policy,
            counters,
            #[cfg(feature = "cuda")]
            reg_cache: Default::default(),
            arenas: Default::default(),
        })
    }
    #[cfg(not(feature = "verbs"))]
    {
        if policy == TransportPolicy::Verbs {
            return Err(Error::FeatureDisabled { feature: "verbs" });
        }
        Ok(MemoryDomain {
            id,
            keys,
            #[cfg(feature = "cuda")]
            visible: Default::default(),
            no_verbs: Some("gpu-rdma was built without the `verbs` feature".into()),
            policy,
            counters,
            #[cfg(feature = "cuda")]
            reg_cache: Default::default(),
            arenas: Default::default(),
        })
    }
}

impl MemoryDomain {
    /// This domain's identity, unique in the process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Counts one more live `which` until the returned value is dropped.
    pub(crate) fn live(&self, which: Counter) -> Live {
        self.counters.get(which).fetch_add(1, Ordering::AcqRel);
        Live { counters: Arc::clone(&self.counters), which }
    }

    /// Live resources.
    pub(crate) fn stats(&self) -> DomainStats {
        let c = &self.counters;
        DomainStats {
            regions: c.regions.load(Ordering::Acquire),
            exposed: c.exposed.load(Ordering::Acquire),
            connections: c.connections.load(Ordering::Acquire),
        }
    }

    /// Whether connections from this domain can use verbs.
    pub(crate) fn has_verbs(&self) -> bool {
        #[cfg(feature = "verbs")]
        {
            self.verbs.is_some()
        }
        #[cfg(not(feature = "verbs"))]
        {
            false
        }
    }

    pub(crate) fn info(&self) -> DomainInfo {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            return v.info();
        }
        DomainInfo::tcp(self.no_verbs.clone().unwrap_or_default())
    }

    /// Registers `len` bytes of the dma-buf `fd` at `offset`, addressed as `iova`.
    ///
    /// # Safety
    /// The memory behind the dma-buf range must stay allocated until the
    /// returned registration is deregistered.
    #[cfg(feature = "cuda")]
    pub(crate) unsafe fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
        relaxed: bool,
    ) -> Result<Registration> {
        #[cfg(all(feature = "verbs", gpu_rdma_dmabuf_mr))]
        if let Some(v) = &self.verbs {
            // SAFETY: forwarded contract.
            return Ok(Registration::Verbs(unsafe {
                MemoryRegion::register_dmabuf(&v.pd, fd, offset, len, iova, access, relaxed)?
            }));
        }
        let _ = (fd, offset, len, iova, access, relaxed);
        let op = if self.has_verbs() {
            "ibv_reg_dmabuf_mr (absent from the rdma-core headers this crate was built with)"
        } else {
            "ibv_reg_dmabuf_mr (no RDMA device in this domain)"
        };
        Err(Error::NotSupported { op, source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP) })
    }

    /// Registers a staged region's host mirror with `access`; the
    /// registration owns the mirror.
    #[cfg(feature = "cuda")]
    pub(crate) fn register_mirror(&self, mem: crate::cuda::PinnedHost, access: Access) -> Result<Registration> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            use crate::memory::Memory;
            // SAFETY: `mem` moves into the registration, which deregisters before it
            // frees (or leaks) the memory.
            let mr = unsafe { MemoryRegion::register(&v.pd, mem.as_ptr(), mem.len(), access)? };
            return Ok(Registration::Mirror { mr, mem });
        }
        let _ = access;
        Ok(Registration::PlainMirror { mem })
    }

    /// Registers `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The memory must stay allocated and in place until the returned
    /// registration is deregistered.
    pub(crate) unsafe fn register(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Registration> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            // SAFETY: forwarded contract.
            return Ok(Registration::Verbs(unsafe { MemoryRegion::register_with(&v.pd, ptr, len, access, false)? }));
        }
        let _ = (ptr, len, access);
        Ok(Registration::Plain)
    }

    /// Registers GPU memory at its device address with the NIC (the
    /// nvidia-peermem path), with relaxed ordering when `relaxed`.
    ///
    /// # Errors
    /// [`Error::NoDevice`] in a domain without verbs: there is no NIC to
    /// register GPU memory with; else as the verbs registration.
    ///
    /// # Safety
    /// As [`register`](Self::register), of the device allocation.
    #[cfg(feature = "cuda")]
    pub(crate) unsafe fn register_gpu(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
        relaxed: bool,
    ) -> Result<Registration> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            // SAFETY: forwarded contract.
            return Ok(Registration::Verbs(unsafe { MemoryRegion::register_with(&v.pd, ptr, len, access, relaxed)? }));
        }
        let _ = (ptr, len, access, relaxed);
        Err(self.no_nic_for_gpu("peermem"))
    }

    /// Why a direct GPU path cannot be used in this domain.
    #[cfg(feature = "cuda")]
    pub(crate) fn no_nic_for_gpu(&self, path: &str) -> Error {
        Error::NoDevice {
            reason: format!(
                "the {path} path registers GPU memory with an RDMA device, and this domain has none ({}): use the staged path",
                self.no_verbs.as_deref().unwrap_or("TCP only")
            ),
        }
    }
}

#[cfg(feature = "verbs")]
/// A domain's RDMA device: context, protection domain, port and GID.
pub(crate) struct Nic {
    pub(crate) pd: ProtectionDomain,
    pub(crate) ctx: Context,
    pub(crate) port: PortAttr,
    pub(crate) gid: GidChoice,
    pub(crate) device: DeviceAttr,
}

#[cfg(feature = "verbs")]
impl Nic {
    pub(crate) fn open(config: &DomainConfig) -> Result<Self> {
        let (ctx, port) = verbs::open_device(config.device.as_deref(), config.port)?;
        let device = ctx.query_device()?;
        let table = ctx.gid_table(port.port)?;
        let gid = choose_gid(&table, port.link_layer, config.gid_index).ok_or_else(|| Error::NoGid {
            device: ctx.name().to_owned(),
            port: port.port,
            detail: match config.gid_index {
                Some(i) => format!(
                    "GID index {i} is empty or does not exist (non-empty entries: {:?})",
                    table.iter().map(|e| e.index).collect::<Vec<_>>()
                ),
                None => "the GID table is empty: on RoCE, is the network device up?".to_owned(),
            },
        })?;
        let pd = ProtectionDomain::new(&ctx)?;
        Ok(Nic { pd, ctx, port, gid, device })
    }

    pub(crate) fn info(&self) -> DomainInfo {
        DomainInfo {
            transport: Transport::Verbs,
            fallback: None,
            device: self.ctx.name().to_owned(),
            port: self.port.port,
            link_layer: self.port.link_layer.to_string(),
            mtu: self.port.active_mtu.bytes(),
            gid_index: self.gid.entry.index,
            gid: self.gid.entry.gid.to_string(),
            gid_reason: self.gid.reason.clone(),
        }
    }
}

impl fmt::Debug for MemoryDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryDomain").field("id", &self.id).field("info", &self.info()).finish_non_exhaustive()
    }
}
