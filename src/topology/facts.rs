//! Facts about this machine read from sysfs, procfs and the environment,
//! as pure functions (no device is opened): what registration needs to
//! decide a path.

use std::path::Path;

use super::pci::LinkClass;
use crate::error::{Error, Result};

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
    matches!((nums.next(), nums.next()), (Some(Ok(a)), Some(Ok(b))) if (a, b) >= (major, minor))
}

/// `GPU_RDMA_GDR_LEVEL` (default PXB, like NCCL).
///
/// # Errors
/// [`Error::BadEnv`] for a value that is not a link class.
pub fn gdr_level_from_env() -> Result<LinkClass> {
    match std::env::var("GPU_RDMA_GDR_LEVEL") {
        Ok(v) => LinkClass::parse(&v).ok_or(Error::BadEnv {
            var: "GPU_RDMA_GDR_LEVEL",
            value: v,
            expected: "PIX, PXB, PHB, NODE or SYS",
        }),
        Err(_) => Ok(LinkClass::Pxb),
    }
}
