//! Is GPUDirect RDMA really active, and if not, why and how to fix it.
//!
//! [`Inputs`] gathers what the checks need (sysfs, procfs, `nvidia-smi topo
//! -m`, `lspci -vvv`, and when present CUDA and the RDMA devices); every
//! check is a pure function of it, so tests feed recorded machines.
//! [`doctor`] turns inputs into a [`Report`]: checks with fixes, the GPU x
//! NIC matrix, and a verdict per GPU. [`nic_for_gpu`] picks the NIC
//! nearest a GPU, for [`crate::Domain::open_near_gpu`].

// Safe code throughout, except the one dma-buf registration of the live
// probe (allowed there, with its argument).
#![deny(unsafe_code)]

pub mod facts;
pub mod pci;
pub mod smi;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

pub use facts::{PEERMEM_MARKERS, gdr_level_from_env, kernel_at_least, peermem_marker};
pub use pci::{LinkClass, PciGpu, PciLocation, PciNic, classify, link_between};
pub use smi::SmiTopo;

/// How sure a check is, and what it found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but costs bandwidth or will surprise someone.
    Warn,
    /// In the way of GPUDirect RDMA.
    Fail,
    /// Could not be told from the inputs.
    Unknown,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Status::Ok => "ok",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
            Status::Unknown => "??",
        })
    }
}

/// One check.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// The outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do, when something is wrong.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub fix: Option<String>,
}

fn check(name: &str, status: Status, detail: impl Into<String>, fix: Option<&str>) -> Check {
    Check { name: name.to_owned(), status, detail: detail.into(), fix: fix.map(str::to_owned) }
}

/// What CUDA says about one GPU (live runs only).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CudaGpu {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// PCI address, lower case (`0000:19:00.0`).
    pub pci: String,
    /// Name.
    pub name: String,
    /// Memory in bytes.
    pub memory: u64,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gdr_supported: bool,
}

/// Everything the checks read. Build it from the live system with
/// [`Inputs::gather`], or fill it in tests.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    /// The sysfs root (`/sys`).
    pub sysfs: PathBuf,
    /// `/proc/modules`.
    pub proc_modules: String,
    /// `/proc/driver/nvidia/version`, when the NVIDIA driver is loaded.
    pub nvidia_version: Option<String>,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel_release: String,
    /// `nvidia-smi topo -m` output, when available.
    pub nvidia_smi_topo: Option<String>,
    /// `lspci -vvv` output, when run as root (ACS is only shown to root).
    pub lspci: Option<String>,
    /// Whether this build has `ibv_reg_dmabuf_mr`.
    pub rdma_core_dmabuf: bool,
    /// CUDA's view of the GPUs, when a driver is loaded.
    pub cuda: Option<Vec<CudaGpu>>,
    /// Why CUDA is not available, when it is not.
    pub cuda_error: Option<String>,
    /// A dma-buf registration probe: `(nic, outcome)`, when both a GPU and a NIC exist.
    pub dmabuf_probe: Option<(String, std::result::Result<(), String>)>,
    /// How much GPU memory will be registered (for the BAR1 check).
    pub register_bytes: Option<u64>,
    /// Active MTU per `(device, port)`, from the verbs (live runs only: sysfs does not show it).
    pub port_mtu: BTreeMap<(String, u8), u32>,
    /// Whether rdma-core's libibverbs loaded, or why not (live runs only).
    pub libibverbs: Option<std::result::Result<(), String>>,
}

impl Inputs {
    /// Reads the live system under `sysfs` and `proc` (normally `/sys`,
    /// `/proc`), `nvidia-smi topo -m` from `smi_file` or by running it, and
    /// `lspci -vvv` when root. With `probe`, also asks CUDA and tries a
    /// dma-buf registration.
    pub fn gather(sysfs: &Path, proc_root: &Path, smi_file: Option<&Path>, probe: bool) -> Inputs {
        let read = |p: PathBuf| std::fs::read_to_string(p).ok();
        let nvidia_smi_topo = match smi_file {
            Some(f) => read(f.to_path_buf()),
            None if probe => run("nvidia-smi", &["topo", "-m"]),
            None => None,
        };
        let is_root = read(proc_root.join("self/status"))
            .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
            .unwrap_or(false);
        let mut inputs = Inputs {
            sysfs: sysfs.to_path_buf(),
            proc_modules: read(proc_root.join("modules")).unwrap_or_default(),
            nvidia_version: read(proc_root.join("driver/nvidia/version")),
            kernel_release: read(proc_root.join("sys/kernel/osrelease")).unwrap_or_default().trim().to_owned(),
            nvidia_smi_topo,
            lspci: if probe && is_root { run("lspci", &["-vvv"]) } else { None },
            rdma_core_dmabuf: cfg!(gpu_rdma_dmabuf_mr),
            ..Inputs::default()
        };
        if probe {
            live::probe(&mut inputs);
        }
        inputs
    }
}

fn run(program: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(program).args(args).stderr(std::process::Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a kernel module is in `/proc/modules`.
pub fn module_loaded(proc_modules: &str, module: &str) -> bool {
    proc_modules.lines().any(|l| l.split_whitespace().next() == Some(module))
}

/// One GPU-NIC pair.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Link {
    /// `GPU0`.
    pub gpu: String,
    /// `mlx5_0`.
    pub nic: String,
    /// How far apart.
    pub link: LinkClass,
}

/// What the tool says about one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Verdict {
    /// `GPU0`.
    pub gpu: String,
    /// The NIC to use with it.
    pub best_nic: Option<String>,
    /// How far apart they are.
    pub link: Option<LinkClass>,
    /// Whether GPUDirect RDMA works at the configured level.
    pub usable: bool,
    /// Why not, in plain words (empty when usable).
    pub reasons: Vec<String>,
    /// What to do about each reason.
    pub fixes: Vec<String>,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Report {
    /// The farthest link class GPUDirect RDMA is used at.
    pub gdr_level: LinkClass,
    /// The checks, in order.
    pub checks: Vec<Check>,
    /// GPUs found (sysfs, else nvidia-smi).
    pub gpus: Vec<String>,
    /// NICs found (sysfs, else nvidia-smi).
    pub nics: Vec<String>,
    /// Every GPU x NIC pair.
    pub links: Vec<Link>,
    /// Where the matrix came from: `sysfs` or `nvidia-smi`.
    pub links_source: String,
    /// Pairs where sysfs and nvidia-smi disagree.
    pub disagreements: Vec<String>,
    /// One per GPU.
    pub verdicts: Vec<Verdict>,
    /// 0: usable for every GPU asked about; 1: not for some; 2: could not tell.
    pub exit_code: i32,
}

/// The JSON of `gpu-rdma topo`: the matrix and the best NIC per GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct TopoSummary {
    /// GPUs.
    pub gpus: Vec<String>,
    /// NICs.
    pub nics: Vec<String>,
    /// Every GPU x NIC pair.
    pub links: Vec<Link>,
    /// The NIC each GPU should use.
    pub best_nic: BTreeMap<String, String>,
}

impl Report {
    /// The `topo` view of the report.
    pub fn topo(&self) -> TopoSummary {
        TopoSummary {
            gpus: self.gpus.clone(),
            nics: self.nics.clone(),
            links: self.links.clone(),
            best_nic: self.verdicts.iter().filter_map(|v| v.best_nic.clone().map(|n| (v.gpu.clone(), n))).collect(),
        }
    }
}

/// Picks a NIC per GPU: nearest link class first, then the same NUMA node,
/// then the fastest port; GPUs that tie for the same set of NICs are spread
/// over them in order (GPU0 -> first, GPU1 -> second, ...), as on servers
/// with one NIC per GPU behind shared switches.
pub fn best_nics(
    gpus: &[String],
    nics: &[String],
    links: &BTreeMap<(String, String), LinkClass>,
    gpu_numa: &BTreeMap<String, i32>,
    nic_numa: &BTreeMap<String, i32>,
    nic_speed: &BTreeMap<String, f64>,
) -> BTreeMap<String, (String, LinkClass)> {
    let mut out = BTreeMap::new();
    let mut used: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for g in gpus {
        let rank = |n: &String| {
            let class = links.get(&(g.clone(), n.clone())).copied().unwrap_or(LinkClass::Sys);
            let numa_match = match (gpu_numa.get(g), nic_numa.get(n)) {
                (Some(a), Some(b)) => a == b,
                _ => false,
            };
            let speed = nic_speed.get(n).copied().unwrap_or(0.0);
            (class, !numa_match, -(speed as i64))
        };
        let Some(best) = nics.iter().map(rank).min() else { continue };
        let tied: Vec<String> = nics.iter().filter(|n| rank(n) == best).cloned().collect();
        let k = used.entry(tied.clone()).or_insert(0);
        let pick = tied[*k % tied.len()].clone();
        *k += 1;
        out.insert(g.clone(), (pick, best.0));
    }
    out
}

/// Whether the ACS capability of the bridge at `address` redirects
/// peer-to-peer requests (`ReqRedir+` or `CmpltRedir+` in `lspci -vvv`).
pub fn acs_redirect(lspci: &str, address: &str) -> Option<bool> {
    let short = address.strip_prefix("0000:").unwrap_or(address);
    let mut in_device = false;
    for line in lspci.lines() {
        if !line.starts_with(char::is_whitespace) && !line.is_empty() {
            let first = line.split_whitespace().next().unwrap_or("");
            in_device = first == short || first == address;
            continue;
        }
        if in_device && line.contains("ACSCtl:") {
            return Some(line.contains("ReqRedir+") || line.contains("CmpltRedir+"));
        }
    }
    None
}

/// Runs every check and forms the verdicts. `only` restricts the verdicts
/// (and the exit code) to one GPU.
pub fn doctor(inputs: &Inputs, level: LinkClass, only: Option<usize>) -> Report {
    let mut checks = Vec::new();

    // ---- driver support ----
    let nvidia_loaded = inputs.nvidia_version.is_some() || module_loaded(&inputs.proc_modules, "nvidia");
    let peermem_marker = peermem_marker(&inputs.sysfs);
    let peermem = module_loaded(&inputs.proc_modules, "nvidia_peermem")
        || peermem_marker.is_some_and(|m| !m.contains("nv_peer_mem"));
    let legacy = module_loaded(&inputs.proc_modules, "nv_peer_mem");
    checks.push(if peermem {
        check("nvidia-peermem", Status::Ok, "nvidia_peermem is loaded: ibv_reg_mr can register GPU memory", None)
    } else if !nvidia_loaded {
        check(
            "nvidia-peermem",
            Status::Fail,
            "not loaded (the NVIDIA driver itself is not loaded)",
            Some("install and load the NVIDIA driver, then `modprobe nvidia-peermem`"),
        )
    } else {
        check(
            "nvidia-peermem",
            Status::Fail,
            "nvidia_peermem not loaded",
            Some("modprobe nvidia-peermem (it ships with the NVIDIA driver; add it to /etc/modules-load.d to keep it)"),
        )
    });
    if legacy {
        checks.push(check(
            "nv_peer_mem (legacy)",
            Status::Warn,
            "the legacy nv_peer_mem module is loaded: it conflicts with nvidia-peermem",
            Some("rmmod nv_peer_mem, then modprobe nvidia-peermem"),
        ));
    }

    let kernel_ok = kernel_at_least(&inputs.kernel_release, 5, 12);
    let open_module = inputs.nvidia_version.as_deref().map(|v| v.contains("Open Kernel Module"));
    let mut dmabuf_blockers: Vec<(String, String)> = Vec::new();
    if !kernel_ok {
        dmabuf_blockers.push((
            format!(
                "kernel {} is older than 5.12",
                if inputs.kernel_release.is_empty() { "?" } else { &inputs.kernel_release }
            ),
            "upgrade to a 5.12+ kernel".into(),
        ));
    }
    match open_module {
        Some(false) => dmabuf_blockers.push((
            "the NVIDIA kernel module is the proprietary one (dma-buf needs the open kernel module)".into(),
            "install the open kernel module for dma-buf (for example nvidia-driver-XXX-open, or NVreg_OpenRmEnableUnsupportedGpus)".into(),
        )),
        None if nvidia_loaded => {}
        None => dmabuf_blockers.push(("the NVIDIA driver is not loaded".into(), "install and load the NVIDIA driver".into())),
        Some(true) => {}
    }
    if !inputs.rdma_core_dmabuf {
        dmabuf_blockers.push((
            "this gpu-rdma was built against an rdma-core without ibv_reg_dmabuf_mr".into(),
            "rebuild against rdma-core 34+ (libibverbs-dev)".into(),
        ));
    }
    if let Some(cuda) = &inputs.cuda {
        for g in cuda.iter().filter(|g| !g.dma_buf_supported) {
            dmabuf_blockers.push((
                format!("CUDA device {} reports no DMA_BUF_SUPPORTED", g.ordinal),
                "install the open kernel module for dma-buf".into(),
            ));
        }
    }
    if let Some((nic, Err(why))) = &inputs.dmabuf_probe {
        dmabuf_blockers.push((
            format!("a probe registration on {nic} was refused: {why}"),
            "use a NIC driver with dma-buf support (mlx5 on a 5.12+ kernel)".into(),
        ));
    }
    let dmabuf = dmabuf_blockers.is_empty();
    checks.push(if dmabuf {
        let mut how = vec![format!("kernel {}", inputs.kernel_release), "rdma-core has ibv_reg_dmabuf_mr".to_owned()];
        if open_module == Some(true) {
            how.push("open kernel module".into());
        }
        if let Some((nic, Ok(()))) = &inputs.dmabuf_probe {
            how.push(format!("a probe registration on {nic} worked"));
        }
        check("dma-buf", Status::Ok, format!("possible: {}", how.join(", ")), None)
    } else {
        Check {
            name: "dma-buf".into(),
            status: Status::Fail,
            detail: dmabuf_blockers.iter().map(|(w, _)| w.clone()).collect::<Vec<_>>().join("; "),
            fix: Some(dmabuf_blockers.iter().map(|(_, f)| f.clone()).collect::<Vec<_>>().join("; ")),
        }
    });
    if let Some(why) = &inputs.cuda_error {
        checks.push(check("CUDA", Status::Unknown, why.clone(), None));
    }

    match &inputs.libibverbs {
        Some(Ok(())) => checks.push(check("libibverbs", Status::Ok, "rdma-core's libibverbs.so.1 loaded", None)),
        Some(Err(why)) => checks.push(check(
            "libibverbs",
            Status::Fail,
            why.clone(),
            Some("install rdma-core's libibverbs1 and ibverbs-providers (Debian, Ubuntu), or rdma-core (RHEL); until then every connection runs over TCP"),
        )),
        None => {}
    }

    // ---- devices ----
    let pci_gpus = pci::find_gpus(&inputs.sysfs);
    let pci_nics = pci::find_nics(&inputs.sysfs);
    let smi = inputs.nvidia_smi_topo.as_deref().and_then(smi::parse);
    if pci_nics.is_empty() && smi.as_ref().is_none_or(|s| s.nics.is_empty()) {
        // Whether the kernel has its RDMA core at all: without it no driver,
        // soft-RoCE's included, can register a device.
        let rdma_core = inputs.sysfs.join("class/infiniband").exists()
            || inputs.sysfs.join("module/ib_core").exists()
            || inputs.proc_modules.lines().any(|l| l.starts_with("ib_core "));
        let (detail, fix) = if rdma_core {
            (
                "no RDMA devices",
                "install an RDMA NIC and load its driver (mlx5_ib); rdma_rxe gives soft-RoCE for testing",
            )
        } else {
            (
                "no RDMA devices, and this kernel has no RDMA support loaded (no ib_core)",
                "load an RDMA driver (modprobe mlx5_ib, or rdma_rxe for soft-RoCE); if modprobe finds neither, \
                 this kernel was built without InfiniBand: use one that has it (Debian's does)",
            )
        };
        checks.push(check("RDMA devices", Status::Fail, detail, Some(fix)));
    } else {
        for n in &pci_nics {
            let ports: Vec<String> = n
                .ports
                .iter()
                .map(|p| {
                    let mtu =
                        inputs.port_mtu.get(&(n.name.clone(), p.port)).map_or(String::new(), |m| format!(", MTU {m}"));
                    format!(
                        "port {} {} {} {}{mtu}, {} GID(s){}",
                        p.port,
                        p.state,
                        p.link_layer,
                        p.rate,
                        p.gids.len(),
                        p.gids
                            .iter()
                            .find(|g| g.2.contains("v2"))
                            .map(|g| format!(" (RoCE v2 at index {})", g.0))
                            .unwrap_or_default()
                    )
                })
                .collect();
            let active = n.ports.iter().any(|p| p.state.contains("ACTIVE"));
            let pci = n.location.as_ref().map_or("virtual, no PCI function".to_owned(), |l| {
                format!("PCI {}, NUMA {}", l.address, l.numa_node.map_or("?".into(), |x| x.to_string()))
            });
            checks.push(Check {
                name: format!("RDMA device {}", n.name),
                status: if active { Status::Ok } else { Status::Fail },
                detail: format!("{pci}; {}", ports.join("; ")),
                fix: (!active).then(|| {
                    "bring a port up: check the cable and, on InfiniBand, the subnet manager (`ibstat`)".to_owned()
                }),
            });
            if let Some(slow) = n.link.degraded() {
                checks.push(check(
                    &format!("{} PCIe link", n.name),
                    Status::Warn,
                    slow,
                    Some("reseat the NIC in a full-width slot of the right generation"),
                ));
            }
        }
    }
    if pci_gpus.is_empty() && smi.as_ref().is_none_or(|s| s.gpus.is_empty()) {
        let detail = match (&inputs.cuda_error, nvidia_loaded) {
            (Some(why), _) => format!("no NVIDIA GPU found ({why})"),
            (None, false) => "no NVIDIA GPU found and the NVIDIA driver is not loaded".to_owned(),
            (None, true) => "no NVIDIA GPU found".to_owned(),
        };
        checks.push(check("GPUs", Status::Fail, detail, Some("run on a machine with an NVIDIA GPU and its driver")));
    }
    for g in &pci_gpus {
        let cuda =
            inputs.cuda.as_ref().and_then(|c| c.iter().find(|c| c.pci.eq_ignore_ascii_case(&g.location.address)));
        let name = cuda.map_or(String::new(), |c| format!(" ({}, CUDA {})", c.name, c.ordinal));
        checks.push(check(
            &g.name,
            Status::Ok,
            format!(
                "PCI {}{name}, NUMA {}",
                g.location.address,
                g.location.numa_node.map_or("?".into(), |x| x.to_string())
            ),
            None,
        ));
        if let Some(kind) = &g.iommu {
            if kind.starts_with("DMA") {
                checks.push(check(&format!("{} IOMMU", g.name), Status::Warn, format!("the IOMMU translates this GPU's DMA (domain type {kind}): peer-to-peer traffic may be slow or blocked"), Some("boot with iommu=pt (or intel_iommu=on iommu=pt / amd_iommu=pt)")));
            }
        }
        let wanted = inputs.register_bytes.or_else(|| cuda.map(|c| c.memory));
        match (g.bar1, wanted) {
            (Some(bar), Some(want)) if bar < want => checks.push(check(
                &format!("{} BAR1", g.name),
                Status::Warn,
                format!(
                    "BAR1 is {} MiB, smaller than the {} MiB to register: registrations beyond it fail",
                    bar >> 20,
                    want >> 20
                ),
                Some("enable resizable BAR / a large BAR1 in the BIOS, or register less at once"),
            )),
            (Some(bar), _) => {
                checks.push(check(&format!("{} BAR1", g.name), Status::Ok, format!("{} MiB", bar >> 20), None))
            }
            _ => {}
        }
    }

    // ---- the matrix ----
    let mut sysfs_links: BTreeMap<(String, String), LinkClass> = BTreeMap::new();
    for g in &pci_gpus {
        for n in &pci_nics {
            if let Some(l) = &n.location {
                sysfs_links.insert((g.name.clone(), n.name.clone()), classify(&g.location, l));
            }
        }
    }
    let (gpus, nics, links, source) = match &smi {
        Some(s) if !s.gpus.is_empty() => (s.gpus.clone(), s.nics.clone(), s.links.clone(), "nvidia-smi"),
        _ => (
            pci_gpus.iter().map(|g| g.name.clone()).collect(),
            pci_nics.iter().filter(|n| n.location.is_some()).map(|n| n.name.clone()).collect(),
            sysfs_links.clone(),
            "sysfs",
        ),
    };
    let mut disagreements = Vec::new();
    if let Some(s) = &smi {
        for ((g, n), class) in &s.links {
            if let Some(ours) = sysfs_links.get(&(g.clone(), n.clone())) {
                if ours != class {
                    disagreements.push(format!("{g} - {n}: nvidia-smi says {class}, sysfs says {ours}"));
                }
            }
        }
        if !sysfs_links.is_empty() {
            checks.push(if disagreements.is_empty() {
                check(
                    "topology cross-check",
                    Status::Ok,
                    "nvidia-smi and sysfs agree on every GPU-NIC pair they both see",
                    None,
                )
            } else {
                check(
                    "topology cross-check",
                    Status::Warn,
                    disagreements.join("; "),
                    Some("trust nvidia-smi for placement; report the sysfs tree if it looks wrong"),
                )
            });
        }
    }

    // ---- ACS ----
    for g in &pci_gpus {
        for n in &pci_nics {
            let Some(l) = &n.location else { continue };
            if g.location.root != l.root {
                continue;
            }
            let common = g.location.bridges.iter().zip(&l.bridges).take_while(|(a, b)| a == b).count();
            let between: Vec<&String> =
                g.location.bridges[common.saturating_sub(1)..].iter().chain(&l.bridges[common..]).collect();
            if let Some(text) = &inputs.lspci {
                let redirecting: Vec<&String> =
                    between.iter().copied().filter(|b| acs_redirect(text, b) == Some(true)).collect();
                if !redirecting.is_empty() {
                    checks.push(check(
                        &format!("ACS {} - {}", g.name, n.name),
                        Status::Warn,
                        format!(
                            "ACS redirect is enabled on {}: GPU-NIC traffic is sent up to the root complex",
                            redirecting.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                        ),
                        Some("disable ACS on those bridges (setpci -s <bridge> ECAP_ACS+0x6.w=0000), or in the BIOS"),
                    ));
                }
            }
        }
    }
    if inputs.lspci.is_none() && !pci_gpus.is_empty() && !pci_nics.is_empty() {
        checks.push(check("ACS", Status::Unknown, "not checked: needs root and lspci", None));
    }

    // ---- verdicts ----
    let gpu_numa: BTreeMap<String, i32> = if source == "sysfs" {
        pci_gpus.iter().filter_map(|g| g.location.numa_node.map(|n| (g.name.clone(), n))).collect()
    } else {
        smi.as_ref().map(|s| s.gpu_numa.clone()).unwrap_or_default()
    };
    let nic_numa: BTreeMap<String, i32> =
        pci_nics.iter().filter_map(|n| n.location.as_ref()?.numa_node.map(|x| (n.name.clone(), x))).collect();
    let nic_speed: BTreeMap<String, f64> = pci_nics.iter().map(|n| (n.name.clone(), n.best_gbps())).collect();
    let best = best_nics(&gpus, &nics, &links, &gpu_numa, &nic_numa, &nic_speed);
    let driver_ok = peermem || dmabuf;
    let mut verdicts = Vec::new();
    for g in &gpus {
        let mut reasons = Vec::new();
        let mut fixes = Vec::new();
        let pick = best.get(g).cloned();
        match &pick {
            None => {
                reasons.push("no RDMA NIC to pair it with".to_owned());
                fixes.push("install an RDMA NIC (ConnectX) and load its driver".to_owned());
            }
            Some((nic, class)) if *class > level => {
                reasons.push(format!(
                    "{g} and its nearest NIC {nic} are {class} apart ({}); GPUDirect RDMA is used up to {level}",
                    class.legend().to_lowercase()
                ));
                fixes.push(format!("move the NIC or GPU under one PCIe switch, or accept the distance with --gdr-level {class} (GPU_RDMA_GDR_LEVEL={class})"));
            }
            Some(_) => {}
        }
        if !driver_ok {
            reasons.push("neither nvidia_peermem is loaded nor dma-buf possible".to_owned());
            fixes.push("modprobe nvidia-peermem, or install the open kernel module for dma-buf".to_owned());
        }
        verdicts.push(Verdict {
            gpu: g.clone(),
            best_nic: pick.as_ref().map(|p| p.0.clone()),
            link: pick.as_ref().map(|p| p.1),
            usable: reasons.is_empty(),
            reasons,
            fixes,
        });
    }
    let asked: Vec<&Verdict> = verdicts.iter().filter(|v| only.is_none_or(|o| v.gpu == format!("GPU{o}"))).collect();
    let exit_code = if asked.is_empty() {
        2
    } else if asked.iter().all(|v| v.usable) {
        0
    } else {
        1
    };
    let links: Vec<Link> = gpus
        .iter()
        .flat_map(|g| nics.iter().map(move |n| (g, n)))
        .filter_map(|(g, n)| {
            links.get(&(g.clone(), n.clone())).map(|c| Link { gpu: g.clone(), nic: n.clone(), link: *c })
        })
        .collect();
    Report {
        gdr_level: level,
        checks,
        gpus,
        nics,
        links,
        links_source: source.to_owned(),
        disagreements,
        verdicts,
        exit_code,
    }
}

/// CUDA device `ordinal` on this machine: the doctor's report and the
/// GPU's name in it, or `None` when it is not found on PCI.
fn place_gpu(ordinal: usize) -> crate::Result<Option<(Report, String)>> {
    #[cfg(feature = "cuda")]
    {
        let dev = crate::cuda::CudaDevice::open(ordinal)?;
        let inputs = Inputs::gather(Path::new("/sys"), Path::new("/proc"), None, false);
        let gpus = pci::find_gpus(&inputs.sysfs);
        let Some(gpu) = gpus.iter().find(|g| g.location.address.eq_ignore_ascii_case(dev.pci_bus_id())) else {
            return Ok(None);
        };
        Ok(Some((doctor(&inputs, LinkClass::Sys, None), gpu.name.clone())))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(crate::Error::FeatureDisabled { feature: "cuda" })
    }
}

/// The doctor's pick of a NIC for `gpu` in `report`.
fn best_nic_of(report: &Report, gpu: &str) -> Option<String> {
    report.verdicts.iter().find(|v| v.gpu == gpu).and_then(|v| v.best_nic.clone())
}

/// The RDMA device nearest CUDA device `ordinal` on this machine (by the
/// doctor's ranking), or `None` when there is no GPU or no NIC to pair.
///
/// # Errors
/// [`crate::Error::FeatureDisabled`] without the `cuda` feature; CUDA's
/// errors opening the device.
pub fn nic_for_gpu(ordinal: usize) -> crate::Result<Option<String>> {
    Ok(place_gpu(ordinal)?.and_then(|(report, gpu)| best_nic_of(&report, &gpu)))
}

/// Every NIC as near `gpu` as its nearest one (the same link class): the
/// rails a GPU's transfers use. `best` (the doctor's pick, by NUMA node and
/// port speed) comes first, the rest in the order given.
pub fn rail_nics(gpu: &str, links: &[Link], best: Option<&str>) -> Vec<String> {
    let mine = links.iter().filter(|l| l.gpu == gpu);
    let Some(nearest) = mine.clone().map(|l| l.link).min() else { return Vec::new() };
    let mut out: Vec<String> = mine.filter(|l| l.link == nearest).map(|l| l.nic.clone()).collect();
    if let Some(at) = best.and_then(|b| out.iter().position(|n| n == b)) {
        let b = out.remove(at);
        out.insert(0, b);
    }
    out
}

/// The rails for CUDA device `ordinal` ([`rail_nics`] on this machine's
/// topology); empty when it cannot be placed.
///
/// # Errors
/// As [`nic_for_gpu`].
pub fn nics_for_gpu(ordinal: usize) -> crate::Result<Vec<String>> {
    Ok(place_gpu(ordinal)?
        .map(|(report, gpu)| rail_nics(&gpu, &report.links, best_nic_of(&report, &gpu).as_deref()))
        .unwrap_or_default())
}

mod live {
    //! What only the live system can say: CUDA's view, and a probe registration.
    use super::*;

    pub(super) fn probe(inputs: &mut Inputs) {
        #[cfg(feature = "cuda")]
        {
            use crate::cuda::{CudaDevice, driver};
            match driver() {
                Ok(info) => {
                    let mut gpus = Vec::new();
                    for ordinal in 0..info.device_count {
                        if let Ok(d) = CudaDevice::open(ordinal) {
                            let a = d.attrs();
                            gpus.push(CudaGpu {
                                ordinal,
                                pci: d.pci_bus_id().to_ascii_lowercase(),
                                name: d.name().to_owned(),
                                memory: d.total_mem() as u64,
                                dma_buf_supported: a.dma_buf_supported,
                                gdr_supported: a.gpu_direct_rdma_supported,
                            });
                        }
                    }
                    inputs.cuda = Some(gpus);
                }
                Err(e) => inputs.cuda_error = Some(e.to_string()),
            }
            #[cfg(feature = "verbs")]
            if inputs.cuda.as_ref().is_some_and(|g| !g.is_empty()) {
                inputs.dmabuf_probe = dmabuf_probe();
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            inputs.cuda_error = Some("gpu-rdma was built without the `cuda` feature".into());
        }
        #[cfg(feature = "verbs")]
        {
            inputs.libibverbs = Some(crate::verbs::loader::ibverbs().map(|_| ()).map_err(|e| match e {
                crate::Error::NoDevice { reason } => reason,
                other => other.to_string(),
            }));
        }
        #[cfg(not(feature = "verbs"))]
        {
            inputs.libibverbs = Some(Err("gpu-rdma was built without the `verbs` feature".into()));
        }
        #[cfg(feature = "verbs")]
        if let Ok(list) = crate::verbs::DeviceList::new() {
            for dev in list.iter() {
                let Ok(ctx) = dev.open() else { continue };
                let ports = ctx.query_device().map_or(0, |a| a.phys_port_cnt);
                for p in 1..=ports {
                    if let Ok(attr) = ctx.query_port(p) {
                        inputs.port_mtu.insert((dev.name(), p), attr.active_mtu.bytes());
                    }
                }
            }
        }
    }

    /// Registers one GPU page by dma-buf with the first RDMA device that
    /// has an active port (as a domain would open it), through the verbs
    /// and CUDA layers directly: a probe needs no domain.
    #[cfg(all(feature = "cuda", feature = "verbs"))]
    fn dmabuf_probe() -> Option<(String, std::result::Result<(), String>)> {
        use crate::verbs::{DeviceList, ProtectionDomain};
        let list = DeviceList::new().ok()?;
        let (name, ctx) = list.iter().find_map(|dev| {
            let ctx = dev.open().ok()?;
            let ports = ctx.query_device().map_or(0, |a| a.phys_port_cnt);
            (1..=ports).any(|p| ctx.query_port(p).is_ok_and(|a| a.is_active())).then(|| (dev.name(), ctx))
        })?;
        let pd = ProtectionDomain::new(&ctx).ok()?;
        let gpu = crate::cuda::CudaDevice::open(0).ok()?;
        let buf = crate::cuda::CudaBuffer::alloc(&gpu, crate::cuda::GPU_PAGE).ok()?;
        let outcome = buf
            .export_dmabuf(0, buf.len())
            .map_err(|e| e.to_string())
            .and_then(|dmabuf| register_dmabuf(&pd, &dmabuf, buf.device_ptr(), buf.len()).map_err(|e| e.to_string()));
        Some((name, outcome))
    }

    #[cfg(all(feature = "cuda", feature = "verbs", gpu_rdma_dmabuf_mr))]
    #[allow(unsafe_code)]
    fn register_dmabuf(
        pd: &crate::verbs::ProtectionDomain,
        dmabuf: &crate::cuda::DmaBuf,
        iova: u64,
        len: usize,
    ) -> crate::Result<()> {
        use std::os::fd::AsFd;
        // SAFETY: the memory behind the dma-buf is the caller's GPU buffer,
        // which lives until after this returns; the registration is dropped
        // (deregistered) here, before that.
        let mr = unsafe {
            crate::verbs::MemoryRegion::register_dmabuf(
                pd,
                dmabuf.fd.as_fd(),
                dmabuf.offset,
                len,
                iova,
                crate::access::Access::LOCAL_WRITE,
                false,
            )
        }?;
        drop(mr);
        Ok(())
    }

    #[cfg(all(feature = "cuda", feature = "verbs", not(gpu_rdma_dmabuf_mr)))]
    fn register_dmabuf(
        _pd: &crate::verbs::ProtectionDomain,
        _dmabuf: &crate::cuda::DmaBuf,
        _iova: u64,
        _len: usize,
    ) -> crate::Result<()> {
        Err(crate::Error::NotSupported {
            op: "ibv_reg_dmabuf_mr (absent from the rdma-core headers this crate was built with)",
            source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rails_are_every_nic_at_the_nearest_class_best_first() {
        let link = |gpu: &str, nic: &str, link| Link { gpu: gpu.into(), nic: nic.into(), link };
        let links = vec![
            link("GPU0", "mlx5_0", LinkClass::Sys),
            link("GPU0", "mlx5_1", LinkClass::Pxb),
            link("GPU0", "mlx5_2", LinkClass::Node),
            link("GPU0", "mlx5_3", LinkClass::Pxb),
            link("GPU1", "mlx5_0", LinkClass::Pix),
        ];
        assert_eq!(rail_nics("GPU0", &links, None), ["mlx5_1", "mlx5_3"]);
        assert_eq!(rail_nics("GPU0", &links, Some("mlx5_3")), ["mlx5_3", "mlx5_1"]);
        // A best pick that is not among the nearest changes nothing.
        assert_eq!(rail_nics("GPU0", &links, Some("mlx5_0")), ["mlx5_1", "mlx5_3"]);
        assert_eq!(rail_nics("GPU1", &links, None), ["mlx5_0"]);
        assert!(rail_nics("GPU2", &links, None).is_empty());
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn ties_are_spread_over_equally_close_nics() {
        let gpus = names(&["GPU0", "GPU1", "GPU2"]);
        let nics = names(&["mlx5_0", "mlx5_1", "mlx5_2"]);
        let mut links = BTreeMap::new();
        for g in &gpus {
            for n in &nics {
                links.insert((g.clone(), n.clone()), LinkClass::Sys);
            }
        }
        for g in ["GPU0", "GPU1"] {
            for n in ["mlx5_0", "mlx5_1"] {
                links.insert((g.to_owned(), n.to_owned()), LinkClass::Pxb);
            }
        }
        links.insert(("GPU2".into(), "mlx5_2".into()), LinkClass::Pix);
        let best = best_nics(&gpus, &nics, &links, &BTreeMap::new(), &BTreeMap::new(), &BTreeMap::new());
        assert_eq!(best["GPU0"], ("mlx5_0".to_owned(), LinkClass::Pxb));
        assert_eq!(best["GPU1"], ("mlx5_1".to_owned(), LinkClass::Pxb));
        assert_eq!(best["GPU2"], ("mlx5_2".to_owned(), LinkClass::Pix));
    }

    #[test]
    fn numa_then_speed_break_ties() {
        let gpus = names(&["GPU0"]);
        let nics = names(&["a", "b", "c"]);
        let links: BTreeMap<_, _> = nics.iter().map(|n| (("GPU0".to_owned(), n.clone()), LinkClass::Sys)).collect();
        let gpu_numa = BTreeMap::from([("GPU0".to_owned(), 1)]);
        let nic_numa = BTreeMap::from([("a".to_owned(), 0), ("b".to_owned(), 1), ("c".to_owned(), 1)]);
        let speed = BTreeMap::from([("a".to_owned(), 400.0), ("b".to_owned(), 100.0), ("c".to_owned(), 200.0)]);
        let best = best_nics(&gpus, &nics, &links, &gpu_numa, &nic_numa, &speed);
        assert_eq!(best["GPU0"].0, "c", "same NUMA node first, then the faster");
    }

    #[test]
    fn acs_redirect_is_read_from_lspci() {
        let text = "17:00.0 PCI bridge: Intel Corporation Device 352a (rev 04)\n\
                    \tCapabilities: [220 v1] Access Control Services\n\
                    \t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-\n\
                    \t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-\n\
                    18:00.0 PCI bridge: PLX Technology, Inc. PEX 8747\n\
                    \t\tACSCtl:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-\n";
        assert_eq!(acs_redirect(text, "0000:17:00.0"), Some(true));
        assert_eq!(acs_redirect(text, "0000:18:00.0"), Some(false));
        assert_eq!(acs_redirect(text, "0000:19:00.0"), None);
    }

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
            assert_eq!(peermem_marker(&root), Some(m));
            std::fs::remove_file(&p).unwrap();
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn modules_are_found_by_name() {
        let m = "nvidia_peermem 16384 0 - Live 0x0\nnvidia 56000000 10 nvidia_peermem, Live 0x0\n";
        assert!(module_loaded(m, "nvidia_peermem"));
        assert!(module_loaded(m, "nvidia"));
        assert!(!module_loaded(m, "nv_peer_mem"));
    }
}
