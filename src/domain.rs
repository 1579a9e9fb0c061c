//! [`Domain`]: this process's endpoint on one RDMA device port. Memory is
//! registered with a domain, and connections are made from it.

use std::fmt;
use std::sync::Arc;

pub use crate::config::{DomainConfig, DomainInfo};
use crate::error::{Error, Result};
pub use crate::memory::DomainStats;
use crate::memory::path::PathPolicy;
#[cfg(feature = "cuda")]
pub use crate::memory::staging::StagingStats;
use crate::memory::{Access, Counter, Exposed, HostMemory, Live, Memory, MemoryKind, Region};
pub use crate::memory::{HostArena, RegistrationCacheStats};
use crate::protocol::context::OpContext;

/// This process's endpoint on one RDMA device port: a protection domain,
/// the port and GID it addresses peers with, and the memory registered in
/// it. Cheap to clone; shared by every region and connection made from it.
#[derive(Clone)]
pub struct Domain {
    pub(crate) inner: Arc<DomainInner>,
}

pub(crate) struct DomainInner {
    /// What operations need of the domain (registration, staging, the
    /// engine), shared with its connections.
    pub(crate) ctx: Arc<OpContext>,
    /// GPU registration's per-domain state (path reports logged, GPU-NIC links).
    #[cfg(feature = "cuda")]
    pub(crate) gpu_paths: crate::memory::gpu::GpuPaths,
}

impl Domain {
    /// What a connection of this domain holds of it.
    pub(crate) fn context(&self) -> &Arc<OpContext> {
        &self.inner.ctx
    }

    /// The domain's staging machinery.
    #[cfg(feature = "cuda")]
    pub(crate) fn staging(&self) -> &crate::memory::staging::StagingHome {
        self.inner.ctx.staging()
    }

    /// Registration, the key table and the domain's other memory state.
    pub(crate) fn mem(&self) -> &Arc<crate::memory::MemoryDomain> {
        self.inner.ctx.mem()
    }

    /// Opens the device named by the environment (see [`DomainConfig::from_env`]),
    /// else the first device with an active port; on a machine without a
    /// usable RDMA device, a TCP-only domain that says why
    /// ([`DomainInfo::fallback`]).
    ///
    /// # Errors
    /// See [`Domain::with_config`].
    pub fn open() -> Result<Self> {
        Domain::with_config(&DomainConfig::from_env()?)
    }

    /// Opens the device `config` names.
    ///
    /// # Errors
    /// With a device named, or [`TransportPolicy::Verbs`](crate::TransportPolicy::Verbs): [`Error::DeviceNotFound`],
    /// [`Error::NoDevice`],
    /// [`Error::NoActivePort`], [`Error::NoGid`] or [`Error::Verbs`] instead
    /// of falling back to TCP, or [`Error::FeatureDisabled`] when built
    /// without the `verbs` feature.
    pub fn with_config(config: &DomainConfig) -> Result<Self> {
        let mem = Arc::new(crate::memory::domain::open(config)?);
        let domain = Domain {
            inner: Arc::new(DomainInner {
                ctx: Arc::new(OpContext::new(mem)?),
                #[cfg(feature = "cuda")]
                gpu_paths: Default::default(),
            }),
        };
        tracing::info!("gpu-rdma domain: {}", domain.info());
        Ok(domain)
    }

    /// Opens the RDMA device nearest CUDA device `ordinal` (by the doctor's
    /// ranking: nearest PCIe link, then the same NUMA node, then the fastest
    /// port), else as [`Domain::open`]. Logs which, and why.
    ///
    /// # Errors
    /// As [`Domain::with_config`].
    pub fn open_near_gpu(ordinal: usize) -> Result<Self> {
        let mut config = DomainConfig::from_env()?;
        if config.device.is_none() {
            match crate::topology::nic_for_gpu(ordinal) {
                Ok(Some(nic)) => {
                    tracing::info!("GPU {ordinal}: using {nic}, the nearest RDMA device");
                    config.device = Some(nic);
                }
                Ok(None) => tracing::info!("GPU {ordinal}: no RDMA device found near it; using the first active one"),
                Err(e) => tracing::info!("GPU {ordinal}: cannot place it ({e}); using the first active RDMA device"),
            }
        }
        Domain::with_config(&config)
    }

    /// This domain's identity, unique in the process (what
    /// [`Region::domain_id`] reports).
    pub fn id(&self) -> u64 {
        self.mem().id()
    }

    pub(crate) fn live(&self, which: Counter) -> Live {
        self.mem().live(which)
    }

    /// The device, port and GID in use, and why.
    pub fn info(&self) -> DomainInfo {
        self.mem().info()
    }

    /// Live resources.
    pub fn stats(&self) -> DomainStats {
        self.mem().stats()
    }

    /// Bounds the registration caches. GPU memory on a direct path: a
    /// buffer inside a block (a framework's allocation, as the driver
    /// names it) is served the registration of the whole block, made by
    /// the first buffer registered inside it, so that a model's tensors
    /// carved from a few blocks cost a few registrations. The cache keeps
    /// at most `bytes` of blocks no region uses (64 GiB by default; the
    /// least recently served go first). A block freed and allocated again,
    /// even at the same address, is another block (the driver's
    /// `BUFFER_ID`) and never served the old one's keys. Host memory is
    /// served from the arenas declared ([`Domain::declare_host_arena`]),
    /// which stay registered while declared, whatever the bound.
    /// 0 turns both off. Registrations with remote rights
    /// ([`Domain::expose`]) are made per region, and the staged path keeps
    /// no registration of GPU memory.
    /// [`Domain::registration_cache_stats`] counts hits and misses.
    pub fn set_registration_cache(&self, bytes: usize) {
        #[cfg(feature = "cuda")]
        self.mem().reg_cache.set_bound(bytes);
        self.mem().arenas.set_serving(bytes > 0);
    }

    /// What the registration caches did and hold
    /// ([`set_registration_cache`](Self::set_registration_cache)).
    pub fn registration_cache_stats(&self) -> RegistrationCacheStats {
        #[cfg(feature = "cuda")]
        let mut stats = self.mem().reg_cache.counts();
        #[cfg(not(feature = "cuda"))]
        let mut stats = RegistrationCacheStats::default();
        self.mem().arenas.count_into(&mut stats);
        stats
    }

    /// Bytes of pinned host memory this domain holds for staging GPU
    /// memory, in use and cached for reuse ([`Domain::staging_stats`] has
    /// more). Slots come in size classes (powers of two up to 2 MiB,
    /// multiples of 2 MiB above: a 600 MiB message pins 600 MiB, not
    /// 1 GiB). A slot larger than a chunk (a whole large message's) is
    /// freed when its operation is done, unless it was reserved
    /// ([`Domain::reserve_staging`]); smaller ones are cached, per GPU,
    /// up to the most bytes that were ever on loan at once (at least
    /// 64 MiB), so a workload's next burst at the same depth pins nothing.
    #[cfg(feature = "cuda")]
    pub fn staging_bytes(&self) -> usize {
        self.staging().pinned_bytes()
    }

    /// What this domain's staging holds (pinned, cached, reserved bytes)
    /// and how many slots it has pinned and freed since it was opened.
    /// `slots_pinned` growing while a workload runs at a steady depth means
    /// the staging is pinning on the hot path: see [`Domain::reserve_staging`].
    #[cfg(feature = "cuda")]
    pub fn staging_stats(&self) -> StagingStats {
        self.staging().stats()
    }

    /// Frees the staging slots cached for reuse that were not reserved
    /// ([`Domain::reserve_staging`]), on every GPU, and returns the bytes
    /// freed. Each cache then grows again from what is on loan now: after a
    /// burst deeper than a workload will run again, this gives back the
    /// pinned memory the cache kept for it.
    #[cfg(feature = "cuda")]
    pub fn trim_staging(&self) -> usize {
        self.staging().trim()
    }

    /// Pins `count` staging slots for messages (or chunks of writes and
    /// reads) of `len` bytes on `gpu` now, ahead of the operations that
    /// will use them, and keeps them until the domain is dropped.
    ///
    /// Staged GPU memory (no GPUDirect path, or a TCP connection) moves
    /// through pinned, registered host slots, taken from a cache or pinned
    /// on first use. Pinning costs far more than a message (page pinning
    /// and a memory registration, hundreds of microseconds a MiB on real
    /// hardware), so a deep pipeline's first burst pays it on the hot path.
    /// Reserve what the pipeline holds at once: `count` = operations in
    /// flight times the slots each takes (a send or a receive: one of the
    /// message's size; a write or read: up to the connection's staging
    /// depth, of `min(len, chunk)` each, see
    /// [`ConnectOptions::staging`](crate::ConnectOptions::staging)).
    ///
    /// A later request takes the smallest cached slot that fits, reserved
    /// or not; each call pins `count` more.
    ///
    /// ```no_run
    /// # fn main() -> gpu_rdma::Result<()> {
    /// let domain = gpu_rdma::Domain::open()?;
    /// let gpu = gpu_rdma::cuda::CudaDevice::open(0)?;
    /// // 128 staged writes of 1 MiB in flight (below the default 4 MiB chunk:
    /// // one slot each).
    /// domain.reserve_staging(&gpu, 1 << 20, 128)?;
    /// let pinned = domain.staging_stats().slots_pinned;
    /// // ... the transfers ...
    /// assert_eq!(domain.staging_stats().slots_pinned, pinned, "nothing pinned on the hot path");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::MessageTooLarge`] for a `len` no message can have (past
    /// `u32::MAX`), nothing pinned; [`Error::Cuda`] or
    /// [`Error::CudaUnavailable`] when the memory cannot be pinned; a
    /// registration error from the device. Slots pinned before the error
    /// stay reserved.
    #[cfg(feature = "cuda")]
    pub fn reserve_staging(&self, gpu: &crate::cuda::CudaDevice, len: usize, count: usize) -> Result<()> {
        self.staging().reserve(gpu, len, count)
    }

    /// Allocates `len` zeroed bytes of page-aligned host memory and registers
    /// them for local use ([`Access::LOCAL`]).
    ///
    /// # Errors
    /// As [`HostMemory::new`] and [`Domain::register`].
    pub fn alloc(&self, len: usize) -> Result<Region<HostMemory>> {
        // Fresh memory lies in no arena: registered as it is.
        self.context().alloc(len)
    }

    /// Registers `mem` with `access` rights. Use [`Access::LOCAL`] unless a
    /// peer needs a key; for that, [`Domain::expose`] the region.
    ///
    /// GPU memory ([`crate::cuda::CudaBuffer`]) goes through the path choice
    /// (dma-buf, then nvidia-peermem, then staged; `GPU_RDMA_MEM_PATH`
    /// forces one): see [`Domain::register_with_path`].
    ///
    /// # Errors
    /// The error and the memory back when the device refuses the
    /// registration (for example `ENOMEM` from the memory-lock limit), or
    /// `GPU_RDMA_MEM_PATH` has an unknown value.
    pub fn register<M: Memory>(&self, mem: M, access: Access) -> std::result::Result<Region<M>, BufError<M>> {
        match PathPolicy::from_env() {
            Ok(policy) => self.register_with_path(mem, access, policy),
            Err(error) => Err(BufError { error, buffer: mem }),
        }
    }

    /// Registers `mem`, choosing the GPU memory path by `policy` (ignored
    /// for host memory). The region's [`Region::path_report`] says which
    /// path won and why the others lost; the first registration per GPU
    /// logs it.
    ///
    /// # Errors
    /// As [`Domain::register`]; with a forced path, that path's failure.
    pub fn register_with_path<M: Memory>(
        &self,
        mem: M,
        access: Access,
        policy: PathPolicy,
    ) -> std::result::Result<Region<M>, BufError<M>> {
        if mem.is_empty() {
            return Err(BufError { error: Error::InvalidArgument("cannot register zero bytes".into()), buffer: mem });
        }
        #[cfg(feature = "cuda")]
        if let Some(buf) = mem.cuda_buffer() {
            return match crate::memory::gpu::register(self.mem(), &self.inner.gpu_paths, buf, access, policy) {
                Ok((reg, report)) => {
                    Ok(Region::from_parts(reg, mem, access, Some(report), self.id(), self.live(Counter::Regions)))
                }
                Err(error) => Err(BufError { error, buffer: mem }),
            };
        }
        let _ = policy;
        if mem.kind() != MemoryKind::Host {
            return Err(BufError {
                error: Error::CudaUnavailable {
                    reason: "GPU memory needs the `cuda` feature and a `CudaBuffer`".into(),
                },
                buffer: mem,
            });
        }
        if let Some(arena) = self.mem().arenas.serve(mem.as_ptr(), mem.len(), access) {
            let reg = crate::memory::Registration::Arena(arena);
            return Ok(Region::from_parts(reg, mem, access, None, self.id(), self.live(Counter::Regions)));
        }
        self.context().register_host(mem, access).map_err(|(error, buffer)| BufError { error, buffer })
    }

    /// Registers host memory `mem` once, with local rights, as an arena: a
    /// framework's pinned pool or KV cache. From then on, registering host
    /// memory that lies inside it ([`HostArena::view`], or any [`Memory`]
    /// over its bytes) is served the arena's registration: no pinning, no
    /// call to the device, counted as a hit in
    /// [`registration_cache_stats`](Self::registration_cache_stats).
    /// Registrations with remote rights ([`Domain::expose`]) are made per
    /// region. [`set_registration_cache(0)`](Self::set_registration_cache)
    /// stops the serving.
    ///
    /// # Errors
    /// The error and the memory back for GPU or empty memory, an arena
    /// overlapping one declared before, or the device refusing the
    /// registration.
    pub fn declare_host_arena<M: Memory>(&self, mem: M) -> std::result::Result<HostArena, BufError<M>> {
        let live = self.live(Counter::Regions);
        HostArena::declare(&self.mem().arenas, mem, live, |mem| {
            // SAFETY: `mem` moves into the arena with this registration, and the
            // arena deregisters before it frees (or leaks) the memory; `Memory`'s
            // contract keeps the range valid and fixed until then.
            unsafe { self.mem().register(mem.as_ptr(), mem.len(), Access::LOCAL) }
        })
        .map_err(|(error, buffer)| BufError { error, buffer })
    }

    /// Gives peers `access` (any of [`Access::REMOTE_READ`],
    /// [`Access::REMOTE_WRITE`], [`Access::REMOTE_ATOMIC`]) to `region`
    /// under a new remote key, tagged `tag` in its descriptor. Nothing else
    /// is granted: least privilege.
    ///
    /// GPU memory on a direct path is exposed as it is: peers read and write
    /// the GPU, so this waits for its fences first (the work its producers
    /// still have queued, [`CudaBuffer::ready_after`](crate::cuda::CudaBuffer::ready_after);
    /// a cudarc slice's stream), which would otherwise land over what peers
    /// write. On the staged path peers reach a pinned host mirror instead,
    /// which its owner moves to and from the GPU explicitly (see
    /// [`Exposed::publish`] and [`Connection::recv_write`](crate::Connection::recv_write)).
    ///
    /// # Errors
    /// The error and the region back when `access` has no remote right
    /// ([`Error::InvalidArgument`]), the region belongs to another domain
    /// ([`Error::DomainMismatch`]), or the device refuses.
    // The error hands the region back by value, as the caller gave it.
    #[allow(clippy::result_large_err)]
    pub fn expose<M: Memory>(
        &self,
        region: Region<M>,
        access: Access,
        tag: u64,
    ) -> std::result::Result<Exposed<M>, BufError<Region<M>>> {
        let remote = access.remote();
        if remote.is_empty() || remote != access {
            return Err(BufError {
                error: Error::InvalidArgument(format!(
                    "expose takes remote rights only (REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC), got {access:?}"
                )),
                buffer: region,
            });
        }
        if region.domain_id() != self.id() {
            return Err(BufError {
                error: Error::DomainMismatch {
                    what: "region",
                    registered: region.domain_id(),
                    used_with: "domain",
                    expected: self.id(),
                },
                buffer: region,
            });
        }
        let mut mr_access = remote;
        if remote.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) {
            mr_access |= Access::LOCAL_WRITE;
        }
        #[cfg(feature = "cuda")]
        let gpu = region.memory().cuda_buffer().zip(region.memory_path());
        #[cfg(not(feature = "cuda"))]
        let gpu: Option<((), ())> = None;
        let reg = match gpu {
            #[cfg(feature = "cuda")]
            Some((buf, path)) => crate::memory::gpu::register_remote(self.mem(), buf, mr_access, path),
            #[cfg(not(feature = "cuda"))]
            Some(_) => unreachable!(),
            // SAFETY: the Exposed value owns `region` (and so its memory) and drops
            // this second registration before the region; see `Exposed`'s Drop.
            None => unsafe { self.mem().register(region.memory().as_ptr(), region.len(), mr_access) },
        };
        let reg = match reg {
            Ok(reg) => reg,
            Err(error) => return Err(BufError { error, buffer: region }),
        };
        // On a direct path peers reach the GPU memory itself from the moment
        // they have the key: what its producers still have queued (a
        // framework's zeroing memset, a kernel filling it) must be done
        // first, or it lands over what a peer writes, and a peer reads what
        // was not written yet. (On the staged path peers reach the mirror,
        // which `publish` fills and a notification's copy drains, each after
        // the fences.)
        #[cfg(feature = "cuda")]
        if let (Some((buf, _)), None) = (gpu, reg.mirror()) {
            if let Err(error) = buf.wait_ready() {
                return Err(BufError { error, buffer: region });
            }
        }
        #[cfg(feature = "cuda")]
        if reg.mirror().is_some() && remote.contains(Access::REMOTE_WRITE) {
            // Connections made from now on ask for covers of writes with
            // immediate (see `ConnectOptions::imm_covers`).
            self.mem().visible.mark_staged_writable();
        }
        // The TCP transport serves memory the CPU can reach: host memory, or a
        // staged region's host mirror (not GPU memory on a direct path).
        let cpu_view = match (gpu.is_some(), reg.mirror()) {
            (_, Some((addr, len))) => Some((addr, len as u64)),
            (false, None) => Some((region.memory().as_ptr() as u64, region.len() as u64)),
            (true, None) => None,
        };
        // SAFETY: the exposure handle is dropped (revoked, waiting for transfers
        // in progress) before the registration and the region it serves.
        let tcp = cpu_view.map(|(addr, len)| unsafe { self.mem().keys.expose(addr, len, remote, reg.rkey()) });
        let tcp = match tcp.transpose() {
            Ok(tcp) => tcp,
            Err(error) => return Err(BufError { error, buffer: region }),
        };
        #[cfg(feature = "cuda")]
        let on_gpu = gpu.is_some();
        let exposed = Exposed::from_parts(reg, region, remote, tag, self.live(Counter::Exposed), tcp);
        #[cfg(feature = "cuda")]
        if on_gpu && remote.contains(Access::REMOTE_WRITE) {
            // A notification naming it makes what peers wrote visible first.
            // Only where peers may write: a note naming a region they may
            // only read must not bring its mirror back over the GPU's data.
            self.mem().visible.add(exposed.rkey(), exposed.visible());
        }
        Ok(exposed)
    }
}

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Domain").field("id", &self.id()).field("info", &self.info()).finish()
    }
}

/// An error that gives back the value the failed call took.
pub struct BufError<T> {
    /// What went wrong.
    pub error: Error,
    /// The value, unharmed.
    pub buffer: T,
}

impl<T> fmt::Display for BufError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<T> fmt::Debug for BufError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufError").field("error", &self.error).finish_non_exhaustive()
    }
}

impl<T> std::error::Error for BufError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<BufError<T>> for Error {
    fn from(e: BufError<T>) -> Self {
        e.error
    }
}
