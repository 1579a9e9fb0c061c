//! Registering CUDA memory: detecting what each path needs, trying the
//! planned paths, and registering a second time for exposure.

use std::os::fd::AsFd;
use std::path::Path;

use crate::topology::facts::{gdr_level_from_env, kernel_at_least, peermem_marker};

use super::Registration;
use super::domain::MemoryDomain;
use super::path::{self, MemPath, PathCaps, PathPolicy, PathReport};
use super::{Access, Memory, MemoryKind};
use crate::cuda::{Allocation, CudaBuffer, PinnedHost, driver};
use crate::error::Result;

/// What this machine offers `device` for each memory path.
pub fn detect_caps(device: &crate::cuda::CudaDevice) -> PathCaps {
    caps_with(device, &machine_caps())
}

/// What `machine` and `device` offer for each memory path.
fn caps_with(device: &crate::cuda::CudaDevice, machine: &MachineCaps) -> PathCaps {
    let attrs = device.attrs();
    PathCaps {
        rdma_core_dmabuf: machine.rdma_core_dmabuf,
        kernel_dmabuf: machine.kernel_dmabuf,
        driver_dmabuf: machine.driver_dmabuf,
        device_dmabuf: attrs.dma_buf_supported,
        peermem_loaded: machine.peermem_loaded,
        device_gdr: attrs.gpu_direct_rdma_supported,
        rdma: true,
        buffer_not_gdr_capable: false,
        flush_unavailable: device.flush_policy() == crate::cuda::FlushPolicy::Unavailable,
        beyond_gdr_level: None,
    }
}

/// Whether this machine may offer GPU memory a direct path at all: the
/// nvidia-peermem module is loaded, or dma-buf is there end to end
/// (rdma-core, kernel, driver). Device-independent, read once per process.
pub(crate) fn direct_path_possible() -> bool {
    static POSSIBLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POSSIBLE.get_or_init(|| {
        let m = machine_caps();
        m.peermem_loaded || (m.rdma_core_dmabuf && m.kernel_dmabuf && m.driver_dmabuf)
    })
}

/// What a direct path needs of the machine, whatever the GPU: read now.
struct MachineCaps {
    rdma_core_dmabuf: bool,
    kernel_dmabuf: bool,
    driver_dmabuf: bool,
    peermem_loaded: bool,
}

fn machine_caps() -> MachineCaps {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    MachineCaps {
        rdma_core_dmabuf: cfg!(gpu_rdma_dmabuf_mr),
        kernel_dmabuf: kernel_at_least(release.trim(), 5, 12),
        driver_dmabuf: driver().is_ok_and(|d| d.has_dmabuf_export),
        peermem_loaded: peermem_marker(Path::new("/sys")).is_some(),
    }
}

/// Whether GPU registrations ask for PCIe relaxed ordering: yes, unless
/// `GPU_RDMA_RELAXED_ORDERING=0` (the opt-out, for a platform where relaxed
/// ordering misbehaves).
pub fn relaxed_ordering() -> bool {
    std::env::var("GPU_RDMA_RELAXED_ORDERING").map_or(true, |v| v.trim() != "0")
}

/// What GPU registration keeps per domain: the path reports already
/// logged (each is logged once), and the PCIe link class between each GPU
/// (by ordinal) and the domain's NIC, read once.
#[derive(Default)]
pub(crate) struct GpuPaths {
    /// The machine's side of the paths, read at the domain's first GPU
    /// registration: a registration (a cache hit above all) reads no file.
    machine: std::sync::OnceLock<MachineCaps>,
    logged: std::sync::Mutex<Vec<(usize, String)>>,
    links: std::sync::Mutex<Vec<(usize, Option<crate::topology::pci::LinkClass>)>>,
}

/// Registers `buf` by one path.
fn register_by(backend: &MemoryDomain, buf: &CudaBuffer, access: Access, p: MemPath) -> Result<Registration> {
    if p.is_direct() && !backend.has_verbs() {
        return Err(backend.no_nic_for_gpu(p.name()));
    }
    if p.is_direct() && !buf.gdr_capable() {
        // Even when forced: the NIC must not be pointed at memory the driver
        // says it cannot reach.
        return Err(crate::error::Error::NotSupported {
            op: "a direct path for GPU memory whose IS_GPU_DIRECT_RDMA_CAPABLE is 0 \
                 (VMM memory made without gpuDirectRDMACapable)",
            source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
        });
    }
    // A local registration on a direct path is the whole block's, kept in
    // the domain's cache and served to every buffer inside the block; a
    // buffer whose block the driver cannot name is registered alone.
    let cacheable = p.is_direct() && access.remote().is_empty();
    if cacheable && !backend.reg_cache.enabled() {
        backend.reg_cache.count_miss();
    } else if cacheable {
        if let Ok(block) = buf.allocation() {
            let live = |b: &Allocation| buf.still_allocated(b);
            let shared = backend.reg_cache.get_or_register(block, access, p, live, || {
                // SAFETY: the block is one allocation the driver named for `buf`
                // (`BUFFER_ID`); the registration is served only to buffers
                // inside it with its identity, each of which keeps it allocated
                // while a region uses the registration; once it is freed its
                // identity is never served again (nvidia-peermem invalidates the
                // registration, a dma-buf keeps its pages until it goes), and
                // nothing reaches it through the registration any more.
                unsafe { register_range(backend, buf, block.base, block.len, access, p) }
            })?;
            return Ok(Registration::Shared(shared));
        }
    }
    // SAFETY: the registration is owned by a Region (or Exposed) that also
    // owns `buf`, and deregisters before the buffer is freed.
    unsafe { register_range(backend, buf, buf.device_ptr(), buf.len(), access, p) }
}

/// Registers the `len` bytes at device address `start` of `buf`'s
/// allocation (the buffer itself, or the whole block it lies in) by `p`;
/// the NIC addresses them by their device addresses (the iova).
///
/// # Safety
/// `start..start + len` must lie in `buf`'s allocation, and stay allocated
/// while the registration is used (the callers' comments say how).
unsafe fn register_range(
    backend: &MemoryDomain,
    buf: &CudaBuffer,
    start: u64,
    len: usize,
    access: Access,
    p: MemPath,
) -> Result<Registration> {
    match p {
        MemPath::DmaBuf => {
            // Whole pages around the range, wherever it starts.
            let dmabuf = buf.export_dmabuf_at(start, len)?;
            // SAFETY: the caller's promise, forwarded. The fd is closed when
            // `dmabuf` drops, after registering, as the kernel allows.
            unsafe { backend.register_dmabuf(dmabuf.fd.as_fd(), dmabuf.offset, len, start, access, relaxed_ordering()) }
        }
        // SAFETY: the caller's promise, forwarded; with nvidia-peermem loaded
        // the kernel resolves the device pointer to GPU pages, without it the
        // call fails cleanly.
        MemPath::PeerMem => unsafe { backend.register_gpu(start as *mut u8, len, access, relaxed_ordering()) },
        MemPath::Staged => Ok(Registration::Staged),
    }
}

/// The GPU-NIC link class when it is beyond the GDR level
/// (`GPU_RDMA_GDR_LEVEL`, default PXB), read from sysfs once per domain and
/// GPU; `None` when within it or unknown (no such PCI devices: a soft-RoCE
/// NIC, the CUDA stand-in).
fn beyond_gdr_level(
    backend: &MemoryDomain,
    paths: &GpuPaths,
    device: &crate::cuda::CudaDevice,
) -> Option<crate::topology::pci::LinkClass> {
    if !backend.has_verbs() {
        return None;
    }
    let ordinal = device.ordinal();
    let mut cache = paths.links.lock().unwrap_or_else(|e| e.into_inner());
    let link = match cache.iter().find(|(o, _)| *o == ordinal) {
        Some((_, link)) => *link,
        None => {
            let nic = backend.info().device;
            let link = crate::topology::pci::link_between(std::path::Path::new("/sys"), device.pci_bus_id(), &nic);
            cache.push((ordinal, link));
            link
        }
    };
    let level = gdr_level_from_env().unwrap_or_else(|e| {
        tracing::warn!("{e}; using PXB");
        crate::topology::pci::LinkClass::Pxb
    });
    link.filter(|l| *l > level)
}

/// Registers `buf` for local use by the first path of the plan that works.
pub(crate) fn register(
    backend: &MemoryDomain,
    paths: &GpuPaths,
    buf: &CudaBuffer,
    access: Access,
    policy: PathPolicy,
) -> Result<(Registration, PathReport)> {
    let detected = caps_with(buf.device(), paths.machine.get_or_init(machine_caps));
    let caps = PathCaps {
        rdma: backend.has_verbs(),
        buffer_not_gdr_capable: !buf.gdr_capable(),
        beyond_gdr_level: beyond_gdr_level(backend, paths, buf.device()),
        // A missing flush matters only where the NIC may write: memory
        // registered without write rights only ever goes out.
        flush_unavailable: detected.flush_unavailable && access.intersects(Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        ..detected
    };
    let plan = path::plan(&caps, policy);
    for w in &plan.warnings {
        tracing::warn!("GPU {}: {w}", buf.device().ordinal());
    }
    let (reg, report) = path::attempt(&plan, policy, |p| register_by(backend, buf, access, p))?;
    log_once(paths, buf.device().ordinal(), &report);
    Ok((reg, report))
}

/// A second registration of an already registered GPU buffer, with remote
/// rights, by the same path; on the staged path a pinned host mirror.
pub(crate) fn register_remote(
    backend: &MemoryDomain,
    buf: &CudaBuffer,
    access: Access,
    p: MemPath,
) -> Result<Registration> {
    match p {
        MemPath::Staged => backend.register_mirror(PinnedHost::new(buf.device(), buf.len())?, access),
        direct => register_by(backend, buf, access, direct),
    }
}

fn log_once(paths: &GpuPaths, ordinal: usize, report: &PathReport) {
    let line = report.to_string();
    let mut logged = paths.logged.lock().unwrap_or_else(|e| e.into_inner());
    if !logged.iter().any(|(o, l)| *o == ordinal && *l == line) {
        if report.chosen.is_direct() {
            tracing::info!("GPU {ordinal} memory path: {line}");
        } else {
            tracing::warn!("GPU {ordinal} memory path: {line}");
        }
        logged.push((ordinal, line));
    }
}

// SAFETY: the allocation is owned (or kept alive, for foreign memory) by this
// value until Drop, and never moves; its kind is CUDA device memory.
unsafe impl Memory for CudaBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.device_ptr() as *mut u8
    }

    fn len(&self) -> usize {
        CudaBuffer::len(self)
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Cuda { ordinal: self.device().ordinal() }
    }

    fn cuda_buffer(&self) -> Option<&CudaBuffer> {
        Some(self)
    }
}

// SAFETY: the mapping is owned by the inner HostMemory and never moves.
unsafe impl Memory for PinnedHost {
    fn as_ptr(&self) -> *mut u8 {
        self.raw_parts().0
    }

    fn len(&self) -> usize {
        self.raw_parts().1
    }
}
