//! Registering CUDA memory: detecting what each path needs, trying the
//! planned paths, and registering a second time for exposure.

use std::os::fd::AsFd;
use std::path::Path;

use super::path::{self, MemPath, PathCaps, PathPolicy, PathReport};
use super::{Access, Memory};
use crate::cuda::{CudaBuffer, PinnedHost, driver};
use crate::domain::Domain;
use crate::error::Result;
use crate::transport::Registration;

/// The places where a loaded nvidia-peermem (or the legacy nv_peer_mem)
/// shows up, relative to the sysfs root.
pub const PEERMEM_MARKERS: [&str; 4] = [
    "module/nvidia_peermem",
    "kernel/mm/memory_peers/nv_mem/version",
    "kernel/mm/memory_peers/nv_mem_nc/version",
    "module/nv_peer_mem",
];

/// Which peermem marker exists under `sysfs_root` (normally `/sys`).
pub fn peermem_marker(sysfs_root: &Path) -> Option<&'static str> {
    PEERMEM_MARKERS.into_iter().find(|m| sysfs_root.join(m).exists())
}

/// Whether a kernel release (`6.1.0-57-amd64`) is at least `major.minor`.
pub fn kernel_at_least(release: &str, major: u32, minor: u32) -> bool {
    let mut nums = release.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).map(|s| s.parse::<u32>());
    match (nums.next(), nums.next()) {
        (Some(Ok(a)), Some(Ok(b))) => (a, b) >= (major, minor),
        _ => false,
    }
}

/// What this machine offers `device` for each memory path.
pub fn detect_caps(device: &crate::cuda::CudaDevice) -> PathCaps {
    let attrs = device.attrs();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    PathCaps {
        rdma_core_dmabuf: cfg!(gpu_rdma_dmabuf_mr),
        kernel_dmabuf: kernel_at_least(release.trim(), 5, 12),
        driver_dmabuf: driver().map(|d| d.has_dmabuf_export).unwrap_or(false),
        device_dmabuf: attrs.dma_buf_supported,
        peermem_loaded: peermem_marker(Path::new("/sys")).is_some(),
        device_gdr: attrs.gpu_direct_rdma_supported,
    }
}

/// Registers `buf` by one path.
fn register_by(domain: &Domain, buf: &CudaBuffer, access: Access, p: MemPath) -> Result<Registration> {
    match p {
        MemPath::DmaBuf => {
            let fd = buf.export_dmabuf(0, buf.len())?;
            // SAFETY: the registration is owned by a Region (or Exposed) that also
            // owns `buf`, and deregisters before the buffer is freed. The fd is
            // closed when `fd` drops, after registering, as the kernel allows.
            unsafe { domain.inner.backend.register_dmabuf(fd.as_fd(), 0, buf.len(), buf.device_ptr(), access) }
        }
        // SAFETY: as above; with nvidia-peermem loaded the kernel resolves the
        // device pointer to GPU pages, without it the call fails cleanly.
        MemPath::PeerMem => unsafe { domain.inner.backend.register(buf.as_ptr(), buf.len(), access) },
        MemPath::Staged => Ok(Registration::Staged),
    }
}

/// Registers `buf` for local use by the first path of the plan that works.
pub(crate) fn register(
    domain: &Domain,
    buf: &CudaBuffer,
    access: Access,
    policy: PathPolicy,
) -> Result<(Registration, PathReport)> {
    let caps = detect_caps(buf.device());
    let plan = path::plan(&caps, policy);
    for w in &plan.warnings {
        tracing::warn!("GPU {}: {w}", buf.device().ordinal());
    }
    let (reg, report) = path::attempt(&plan, policy, |p| register_by(domain, buf, access, p))?;
    log_once(domain, buf.device().ordinal(), &report);
    Ok((reg, report))
}

/// A second registration of an already registered GPU buffer, with remote
/// rights, by the same path; on the staged path a pinned host mirror.
pub(crate) fn register_remote(domain: &Domain, buf: &CudaBuffer, access: Access, p: MemPath) -> Result<Registration> {
    match p {
        MemPath::Staged => domain.inner.backend.register_mirror(PinnedHost::new(buf.device(), buf.len())?, access),
        direct => register_by(domain, buf, access, direct),
    }
}

fn log_once(domain: &Domain, ordinal: usize, report: &PathReport) {
    let line = report.to_string();
    let mut logged = domain.inner.logged_paths.lock().unwrap_or_else(|e| e.into_inner());
    if !logged.iter().any(|(o, l)| *o == ordinal && *l == line) {
        if report.chosen.is_direct() {
            tracing::info!("GPU {ordinal} memory path: {line}");
        } else {
            tracing::warn!("GPU {ordinal} memory path: {line}");
        }
        logged.push((ordinal, line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_compare() {
        assert!(kernel_at_least("6.1.0-57-amd64", 5, 12));
        assert!(kernel_at_least("5.12.0", 5, 12));
        assert!(!kernel_at_least("5.11.22-generic", 5, 12));
        assert!(!kernel_at_least("4.19.0", 5, 12));
        assert!(!kernel_at_least("garbage", 5, 12));
    }

    #[test]
    fn peermem_is_found_by_any_of_its_markers() {
        let root = std::env::temp_dir().join(format!("gpu-rdma-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        assert_eq!(peermem_marker(&root), None);
        for m in PEERMEM_MARKERS {
            let p = root.join(m);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, "1.0").unwrap();
            assert_eq!(peermem_marker(&root), Some(PEERMEM_MARKERS[0]).filter(|_| m == PEERMEM_MARKERS[0]).or(Some(m)));
            std::fs::remove_file(&p).unwrap();
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
