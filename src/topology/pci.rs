//! The PCI tree from sysfs: where each GPU and RDMA NIC sits, and how far
//! apart a GPU and a NIC are, in nvidia-smi's words.
//!
//! Every function takes the sysfs root (normally `/sys`) so that tests and
//! `--sysfs-root` can feed recorded trees.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

/// How a GPU and a NIC are connected, nearest first (nvidia-smi's legend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum LinkClass {
    /// At most a single PCIe bridge (both under one PCIe switch).
    #[cfg_attr(feature = "serde", serde(rename = "PIX"))]
    Pix,
    /// Several PCIe bridges, without the host bridge.
    #[cfg_attr(feature = "serde", serde(rename = "PXB"))]
    Pxb,
    /// Through a PCIe host bridge (typically the CPU).
    #[cfg_attr(feature = "serde", serde(rename = "PHB"))]
    Phb,
    /// Between PCIe host bridges within one NUMA node.
    #[cfg_attr(feature = "serde", serde(rename = "NODE"))]
    Node,
    /// Across the interconnect between NUMA nodes (QPI/UPI/Infinity Fabric).
    #[cfg_attr(feature = "serde", serde(rename = "SYS"))]
    Sys,
}

impl LinkClass {
    /// Every class, nearest first.
    pub const ALL: [LinkClass; 5] = [LinkClass::Pix, LinkClass::Pxb, LinkClass::Phb, LinkClass::Node, LinkClass::Sys];

    /// nvidia-smi's abbreviation.
    pub fn name(self) -> &'static str {
        match self {
            LinkClass::Pix => "PIX",
            LinkClass::Pxb => "PXB",
            LinkClass::Phb => "PHB",
            LinkClass::Node => "NODE",
            LinkClass::Sys => "SYS",
        }
    }

    /// nvidia-smi's legend text.
    pub fn legend(self) -> &'static str {
        match self {
            LinkClass::Pix => "Connection traversing at most a single PCIe bridge",
            LinkClass::Pxb => "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
            LinkClass::Phb => "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
            LinkClass::Node => {
                "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"
            }
            LinkClass::Sys => {
                "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"
            }
        }
    }

    /// Parses an abbreviation (`PIX`, `pxb`, ...). `SOC`, which older
    /// nvidia-smi versions print where newer ones print `SYS` (the link
    /// between CPU sockets), is `SYS`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("SOC") {
            return Some(LinkClass::Sys);
        }
        LinkClass::ALL.into_iter().find(|c| c.name().eq_ignore_ascii_case(s))
    }
}

impl fmt::Display for LinkClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A PCI device's place in the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PciLocation {
    /// Its address, `0000:19:00.0`.
    pub address: String,
    /// The root complex it hangs off, `pci0000:17`.
    pub root: String,
    /// The PCI bridges from the root complex down to it (root port first), excluding itself.
    pub bridges: Vec<String>,
    /// Its NUMA node, when the kernel knows (-1 in sysfs means unknown).
    pub numa_node: Option<i32>,
}

/// Whether a path component is a PCI address (`0000:19:00.0`).
fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars().filter(|c| c.is_ascii_hexdigit()).count() == 9
}

/// Reads a sysfs file, trimmed.
pub(crate) fn read_trim(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// Where `device_dir` (a device's sysfs directory, possibly a symlink such
/// as `/sys/bus/pci/devices/0000:19:00.0`) sits, resolved under `sysfs_root`.
pub fn locate(sysfs_root: &Path, device_dir: &Path) -> Option<PciLocation> {
    let real = fs::canonicalize(device_dir).ok()?;
    let devices = fs::canonicalize(sysfs_root.join("devices")).ok()?;
    let rel = real.strip_prefix(&devices).ok()?;
    let parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
    let root = parts.first().filter(|p| p.starts_with("pci"))?.clone();
    let chain: Vec<String> = parts[1..].iter().filter(|p| is_pci_address(p)).cloned().collect();
    let (address, bridges) = chain.split_last()?;
    let numa_node = read_trim(&real.join("numa_node")).and_then(|s| s.parse::<i32>().ok()).filter(|n| *n >= 0);
    Some(PciLocation { address: address.clone(), root, bridges: bridges.to_vec(), numa_node })
}

/// The link class between two PCI locations: PIX or PXB below a shared
/// bridge (PIX when at most one switch level separates them), PHB when they
/// share only the root complex, NODE across root complexes of one NUMA node,
/// SYS across NUMA nodes.
pub fn classify(a: &PciLocation, b: &PciLocation) -> LinkClass {
    if a.root != b.root {
        return if a.numa_node == b.numa_node { LinkClass::Node } else { LinkClass::Sys };
    }
    let common = a.bridges.iter().zip(&b.bridges).take_while(|(x, y)| x == y).count();
    if common == 0 {
        return LinkClass::Phb;
    }
    // Bridges each side passes below the deepest shared one: one each is a
    // single switch's downstream ports.
    let below = (a.bridges.len() - common) + (b.bridges.len() - common);
    if below <= 2 { LinkClass::Pix } else { LinkClass::Pxb }
}

/// A PCI link's speed and width, current and maximum.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PcieLink {
    /// `current_link_speed`, for example `16.0 GT/s PCIe`.
    pub speed: Option<String>,
    /// `max_link_speed`.
    pub max_speed: Option<String>,
    /// `current_link_width`.
    pub width: Option<u32>,
    /// `max_link_width`.
    pub max_width: Option<u32>,
}

impl PcieLink {
    /// Reads the link attributes of the device at `dir`.
    pub fn read(dir: &Path) -> PcieLink {
        let num = |f: &str| read_trim(&dir.join(f)).and_then(|s| s.parse().ok());
        PcieLink {
            speed: read_trim(&dir.join("current_link_speed")),
            max_speed: read_trim(&dir.join("max_link_speed")),
            width: num("current_link_width"),
            max_width: num("max_link_width"),
        }
    }

    fn gts(s: &Option<String>) -> Option<f64> {
        s.as_deref()?.split_whitespace().next()?.parse().ok()
    }

    /// Why the link runs below its maximum, if it does.
    pub fn degraded(&self) -> Option<String> {
        let slow = matches!((Self::gts(&self.speed), Self::gts(&self.max_speed)), (Some(c), Some(m)) if c < m);
        let narrow = matches!((self.width, self.max_width), (Some(c), Some(m)) if c < m);
        (slow || narrow).then(|| {
            format!(
                "the PCIe link runs at {} x{}, the device supports {} x{}",
                self.speed.as_deref().unwrap_or("?"),
                self.width.map_or("?".into(), |w| w.to_string()),
                self.max_speed.as_deref().unwrap_or("?"),
                self.max_width.map_or("?".into(), |w| w.to_string()),
            )
        })
    }
}

/// The size of BAR `index` from a PCI `resource` file (one `start end flags` line per BAR).
pub fn bar_size(resource: &str, index: usize) -> Option<u64> {
    let line = resource.lines().nth(index)?;
    let mut f = line.split_whitespace().map(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16));
    let (start, end) = (f.next()?.ok()?, f.next()?.ok()?);
    (end > start).then(|| end - start + 1)
}

/// A GPU found in sysfs.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PciGpu {
    /// `GPU0`, `GPU1`, ... in PCI address order (nvidia-smi's order).
    pub name: String,
    /// Where it sits.
    pub location: PciLocation,
    /// BAR1 size in bytes (the window peers' DMA goes through).
    pub bar1: Option<u64>,
    /// The IOMMU domain type of its group (`identity` is pass-through).
    pub iommu: Option<String>,
    /// Its PCIe link.
    pub link: PcieLink,
}

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: &str = "0x10de";

/// The NVIDIA GPUs under `sysfs_root/bus/pci/devices` (display or 3D controllers).
pub fn find_gpus(sysfs_root: &Path) -> Vec<PciGpu> {
    let dir = sysfs_root.join("bus/pci/devices");
    let mut found: Vec<(String, PathBuf)> = fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let vendor = read_trim(&p.join("vendor"))?;
            let class = read_trim(&p.join("class"))?;
            (vendor == NVIDIA_VENDOR && (class.starts_with("0x0300") || class.starts_with("0x0302")))
                .then(|| (e.file_name().to_string_lossy().into_owned(), p))
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .enumerate()
        .filter_map(|(i, (_, p))| {
            let location = locate(sysfs_root, &p)?;
            let bar1 = read_trim(&p.join("resource")).and_then(|r| bar_size(&r, 1));
            let iommu = read_trim(&p.join("iommu_group/type"));
            Some(PciGpu { name: format!("GPU{i}"), location, bar1, iommu, link: PcieLink::read(&p) })
        })
        .collect()
}

/// An RDMA port as sysfs describes it.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SysfsPort {
    /// Port number.
    pub port: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: String,
    /// For example `100 Gb/sec (4X EDR)`.
    pub rate: String,
    /// The rate in Gb/s, for ranking.
    pub gbps: f64,
    /// Non-empty GIDs with their types.
    pub gids: Vec<(u32, String, String)>,
}

/// An RDMA NIC found in sysfs.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PciNic {
    /// The device name, `mlx5_0`.
    pub name: String,
    /// Where it sits; `None` for a virtual device (soft-RoCE) with no PCI function.
    pub location: Option<PciLocation>,
    /// Its ports.
    pub ports: Vec<SysfsPort>,
    /// Its PCIe link.
    pub link: PcieLink,
}

impl PciNic {
    /// The fastest active port's rate in Gb/s.
    pub fn best_gbps(&self) -> f64 {
        self.ports.iter().filter(|p| p.state.contains("ACTIVE")).map(|p| p.gbps).fold(0.0, f64::max)
    }
}

/// The PCIe link class between the GPU at `gpu_pci` (`0000:17:00.0`) and
/// the RDMA device `nic` (`mlx5_0`), from sysfs under `sysfs_root`; `None`
/// when either is not a PCI device there (soft-RoCE, a CUDA stand-in).
pub fn link_between(sysfs_root: &Path, gpu_pci: &str, nic: &str) -> Option<LinkClass> {
    let gpu = find_gpus(sysfs_root).into_iter().find(|g| g.location.address.eq_ignore_ascii_case(gpu_pci))?;
    let nic = find_nics(sysfs_root).into_iter().find(|n| n.name == nic)?;
    Some(classify(&gpu.location, nic.location.as_ref()?))
}

/// The RDMA devices under `sysfs_root/class/infiniband`, by name.
pub fn find_nics(sysfs_root: &Path) -> Vec<PciNic> {
    let dir = sysfs_root.join("class/infiniband");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let base = dir.join(&name);
            let dev = base.join("device");
            let location = locate(sysfs_root, &dev);
            let mut ports: Vec<SysfsPort> = fs::read_dir(base.join("ports"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    let port: u8 = e.file_name().to_string_lossy().parse().ok()?;
                    let p = e.path();
                    let state = read_trim(&p.join("state")).unwrap_or_default();
                    let state = state.split_once(": ").map_or(state.clone(), |(_, s)| s.to_owned());
                    let rate = read_trim(&p.join("rate")).unwrap_or_default();
                    let gbps = rate.split_whitespace().next().and_then(|g| g.parse().ok()).unwrap_or(0.0);
                    let mut gids = Vec::new();
                    for e in fs::read_dir(p.join("gids")).into_iter().flatten().flatten() {
                        let Ok(i) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
                        let gid = read_trim(&e.path()).unwrap_or_default();
                        if gid.is_empty() || gid.chars().all(|c| c == '0' || c == ':') {
                            continue;
                        }
                        let kind = read_trim(&p.join(format!("gid_attrs/types/{i}"))).unwrap_or_default();
                        gids.push((i, gid, kind));
                    }
                    gids.sort();
                    Some(SysfsPort {
                        port,
                        state,
                        link_layer: read_trim(&p.join("link_layer")).unwrap_or_default(),
                        rate,
                        gbps,
                        gids,
                    })
                })
                .collect();
            ports.sort_by_key(|p| p.port);
            PciNic { name, location, ports, link: PcieLink::read(&dev) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(root: &str, bridges: &[&str], numa: Option<i32>) -> PciLocation {
        PciLocation {
            address: "0000:ff:00.0".into(),
            root: root.into(),
            bridges: bridges.iter().map(|s| s.to_string()).collect(),
            numa_node: numa,
        }
    }

    #[test]
    fn classification_follows_the_legend() {
        // One switch: root port, switch upstream port, a downstream port each.
        let gpu = loc("pci0000:17", &["0000:17:00.0", "0000:18:00.0", "0000:19:00.0"], Some(0));
        let nic = loc("pci0000:17", &["0000:17:00.0", "0000:18:00.0", "0000:19:01.0"], Some(0));
        assert_eq!(classify(&gpu, &nic), LinkClass::Pix);
        // Two switch levels.
        let deep = loc(
            "pci0000:17",
            &["0000:17:00.0", "0000:18:00.0", "0000:19:02.0", "0000:1c:00.0", "0000:1d:00.0"],
            Some(0),
        );
        assert_eq!(classify(&gpu, &deep), LinkClass::Pxb);
        // Different root ports of one root complex.
        let other_port = loc("pci0000:17", &["0000:17:02.0"], Some(0));
        assert_eq!(classify(&gpu, &other_port), LinkClass::Phb);
        // Another root complex, same NUMA node; then another node.
        assert_eq!(classify(&gpu, &loc("pci0000:3a", &["0000:3a:00.0"], Some(0))), LinkClass::Node);
        assert_eq!(classify(&gpu, &loc("pci0000:ae", &["0000:ae:00.0"], Some(1))), LinkClass::Sys);
        // Unknown NUMA on both sides (single-socket machines): one node.
        assert_eq!(classify(&loc("pci0000:00", &[], None), &loc("pci0000:40", &[], None)), LinkClass::Node);
        assert_eq!(classify(&gpu, &gpu), LinkClass::Pix);
    }

    #[test]
    fn link_classes_order_and_parse() {
        assert!(LinkClass::Pix < LinkClass::Pxb && LinkClass::Node < LinkClass::Sys);
        assert_eq!(LinkClass::parse(" phb "), Some(LinkClass::Phb));
        assert_eq!(LinkClass::parse("NV12"), None);
    }

    #[test]
    fn bar_sizes_and_degraded_links() {
        let resource = "0x00000000f0000000 0x00000000f0ffffff 0x0000000000040200\n\
                        0x0000038000000000 0x0000039fffffffff 0x000000000014220c\n";
        assert_eq!(bar_size(resource, 0), Some(16 << 20));
        assert_eq!(bar_size(resource, 1), Some(128 << 30));
        assert_eq!(bar_size("0x0 0x0 0x0\n", 0), None);
        let l = PcieLink {
            speed: Some("8.0 GT/s PCIe".into()),
            max_speed: Some("16.0 GT/s PCIe".into()),
            width: Some(16),
            max_width: Some(16),
        };
        assert!(l.degraded().unwrap().contains("8.0 GT/s PCIe x16"));
        let ok = PcieLink { speed: l.max_speed.clone(), ..l };
        assert_eq!(ok.degraded(), None);
    }
}
