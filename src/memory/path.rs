//! Which path makes GPU memory reachable by the NIC, and why the others lost.
//!
//! The choice is a pure function ([`plan`]) of what was detected
//! ([`PathCaps`]) and what the user asked for ([`PathPolicy`]); registration
//! then tries the planned paths in order and records each outcome in a
//! [`PathReport`], which regions, logs and tools show.

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// How the NIC reaches a GPU buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemPath {
    /// `cuMemGetHandleForAddressRange` exports the memory as a dma-buf and
    /// `ibv_reg_dmabuf_mr` registers it: direct, no kernel module needed
    /// beyond the GPU and NIC drivers.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer, resolved by the `nvidia_peermem`
    /// kernel module: direct.
    PeerMem,
    /// Pinned host bounce buffers and CUDA copies, pipelined: works
    /// everywhere, costs a copy each way.
    Staged,
}

impl MemPath {
    /// The name used in `GPU_RDMA_MEM_PATH`, logs and tools.
    pub fn name(self) -> &'static str {
        match self {
            MemPath::DmaBuf => "dmabuf",
            MemPath::PeerMem => "peermem",
            MemPath::Staged => "staged",
        }
    }

    /// Whether the NIC touches GPU memory itself (no host copy).
    pub fn is_direct(self) -> bool {
        !matches!(self, MemPath::Staged)
    }

    /// All paths, in the order `auto` tries them.
    pub const ALL: [MemPath; 3] = [MemPath::DmaBuf, MemPath::PeerMem, MemPath::Staged];
}

impl fmt::Display for MemPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The values a path policy is written as.
const POLICIES: &str = "auto, dmabuf, peermem or staged";

impl FromStr for MemPath {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "dmabuf" | "dma-buf" | "dma_buf" => Ok(MemPath::DmaBuf),
            "peermem" | "nvidia-peermem" | "nvidia_peermem" => Ok(MemPath::PeerMem),
            "staged" | "staging" | "host" => Ok(MemPath::Staged),
            other => Err(Error::InvalidArgument(format!("memory path `{other}`: expected {POLICIES}"))),
        }
    }
}

/// Which paths registration may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PathPolicy {
    /// The first that works of dma-buf, nvidia-peermem, staged.
    #[default]
    Auto,
    /// Only this one: failing is an error, not a fallback.
    Force(MemPath),
}

impl FromStr for PathPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") || s.trim().is_empty() {
            Ok(PathPolicy::Auto)
        } else {
            Ok(PathPolicy::Force(s.parse()?))
        }
    }
}

impl PathPolicy {
    /// `GPU_RDMA_MEM_PATH=auto|dmabuf|peermem|staged`, default auto.
    ///
    /// # Errors
    /// [`Error::BadEnv`] for another value.
    pub fn from_env() -> Result<Self> {
        match std::env::var("GPU_RDMA_MEM_PATH") {
            Ok(v) => v.parse().map_err(|_| Error::BadEnv { var: "GPU_RDMA_MEM_PATH", value: v, expected: POLICIES }),
            Err(_) => Ok(PathPolicy::Auto),
        }
    }
}

/// What was detected about the machine, for one GPU and one NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PathCaps {
    /// The rdma-core headers at build time had `ibv_reg_dmabuf_mr`.
    pub rdma_core_dmabuf: bool,
    /// The running kernel is 5.12 or later (RDMA dma-buf support).
    pub kernel_dmabuf: bool,
    /// The CUDA driver has `cuMemGetHandleForAddressRange` (11.7+).
    pub driver_dmabuf: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` is set (the open kernel module).
    pub device_dmabuf: bool,
    /// The nvidia-peermem module is loaded (or the legacy nv_peer_mem).
    pub peermem_loaded: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` is set.
    pub device_gdr: bool,
    /// The domain has an RDMA device (the direct paths register GPU memory
    /// with a NIC; without one only staging is left).
    pub rdma: bool,
    /// The driver says this allocation is not GPUDirect RDMA capable
    /// (`IS_GPU_DIRECT_RDMA_CAPABLE` 0: VMM memory made without
    /// `gpuDirectRDMACapable`): no direct path may be tried.
    pub buffer_not_gdr_capable: bool,
    /// Writes by the NIC into this GPU need a flush before CUDA work sees
    /// them (`WRITES_ORDERING` below owner), and the driver offers none
    /// (no `cuFlushGPUDirectRDMAWrites`, or no host flush option): incoming
    /// data on a direct path could be read stale.
    pub flush_unavailable: bool,
    /// The GPU and the domain's NIC are further apart on PCIe than the
    /// GDR level allows (`GPU_RDMA_GDR_LEVEL`, default PXB, as NCCL):
    /// their link class, when known.
    pub beyond_gdr_level: Option<crate::topology::pci::LinkClass>,
}

const FLUSH_UNAVAILABLE: &str = "NIC writes into this GPU need a flush (WRITES_ORDERING below owner) that the driver \
     does not offer (no cuFlushGPUDirectRDMAWrites host flush): incoming data could be read stale";

/// Why a direct path is not used across `link` (beyond the GDR level).
fn too_far(link: crate::topology::pci::LinkClass) -> &'static str {
    use crate::topology::pci::LinkClass;
    match link {
        LinkClass::Pix | LinkClass::Pxb => {
            "the GPU and the NIC are further apart than GPU_RDMA_GDR_LEVEL allows (a level below PXB was set)"
        }
        LinkClass::Phb => {
            "the GPU and the NIC are PHB apart (the path crosses the CPU's host bridge), beyond the GDR level \
             (GPU_RDMA_GDR_LEVEL, default PXB): staging through host memory is as fast and safer"
        }
        LinkClass::Node => {
            "the GPU and the NIC are NODE apart (between host bridges of one NUMA node), beyond the GDR level \
             (GPU_RDMA_GDR_LEVEL, default PXB): staging through host memory is as fast and safer"
        }
        LinkClass::Sys => {
            "the GPU and the NIC are SYS apart (across CPU sockets), beyond the GDR level \
             (GPU_RDMA_GDR_LEVEL, default PXB): staging through host memory is as fast and safer"
        }
    }
}

/// Why neither direct path may be tried for an allocation the driver says
/// a NIC must not reach.
const NOT_GDR_CAPABLE: &str = "the driver says this allocation is not GPUDirect RDMA capable \
     (IS_GPU_DIRECT_RDMA_CAPABLE is 0: VMM memory made without gpuDirectRDMACapable)";

/// Why neither direct path can work where there is no NIC; the other
/// blockers do not matter then.
const NO_RDMA: &str =
    "this domain has no RDMA device to register GPU memory with (over TCP, GPU memory is staged through host memory)";

impl PathCaps {
    /// What rules out both direct paths, whatever the driver offers.
    fn direct_blockers(&self) -> Vec<&'static str> {
        let mut why = Vec::new();
        if self.buffer_not_gdr_capable {
            why.push(NOT_GDR_CAPABLE);
        }
        if self.flush_unavailable {
            why.push(FLUSH_UNAVAILABLE);
        }
        if let Some(link) = self.beyond_gdr_level {
            why.push(too_far(link));
        }
        why
    }

    /// Why dma-buf cannot work, if it cannot.
    pub fn dmabuf_blockers(&self) -> Vec<&'static str> {
        if !self.rdma {
            return vec![NO_RDMA];
        }
        let mut why = self.direct_blockers();
        if !self.device_dmabuf {
            why.push("dma-buf not supported by this driver (the GPU does not report DMA_BUF_SUPPORTED: the open kernel module is needed)");
        }
        if !self.driver_dmabuf {
            why.push("the CUDA driver has no cuMemGetHandleForAddressRange (CUDA 11.7+)");
        }
        if !self.rdma_core_dmabuf {
            why.push("rdma-core has no ibv_reg_dmabuf_mr (rdma-core 34+)");
        }
        if !self.kernel_dmabuf {
            why.push("the kernel is older than 5.12 (no RDMA dma-buf support)");
        }
        why
    }

    /// Why nvidia-peermem cannot work, if it cannot.
    pub fn peermem_blockers(&self) -> Vec<&'static str> {
        if !self.rdma {
            return vec![NO_RDMA];
        }
        let mut why = self.direct_blockers();
        if !self.peermem_loaded {
            why.push("nvidia_peermem not loaded");
        }
        if !self.device_gdr {
            why.push("the GPU does not support GPUDirect RDMA");
        }
        why
    }
}

/// The paths to try, in order, and those left out with why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Try these, in order.
    pub order: Vec<MemPath>,
    /// Left out, and why.
    pub skipped: Vec<(MemPath, String)>,
    /// Things the user should know (a forced path whose requirements are missing).
    pub warnings: Vec<String>,
}

/// The pure choice: which paths to try, given what was detected and asked.
pub fn plan(caps: &PathCaps, policy: PathPolicy) -> Plan {
    let blockers = |p: MemPath| match p {
        MemPath::DmaBuf => caps.dmabuf_blockers(),
        MemPath::PeerMem => caps.peermem_blockers(),
        MemPath::Staged => Vec::new(),
    };
    match policy {
        PathPolicy::Auto => {
            let mut order = Vec::new();
            let mut skipped = Vec::new();
            for p in MemPath::ALL {
                let why = blockers(p);
                if why.is_empty() {
                    order.push(p);
                } else {
                    skipped.push((p, why.join(", ")));
                }
            }
            Plan { order, skipped, warnings: Vec::new() }
        }
        PathPolicy::Force(p) => {
            let skipped = MemPath::ALL
                .into_iter()
                .filter(|&q| q != p)
                .map(|q| (q, format!("not tried: the path was forced to {p}")))
                .collect();
            let why = blockers(p);
            let warnings =
                if why.is_empty() { Vec::new() } else { vec![format!("{p} was forced although {}", why.join(", "))] };
            Plan { order: vec![p], skipped, warnings }
        }
    }
}

/// How one path fared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Used.
    Chosen,
    /// Not tried, and why.
    Skipped(String),
    /// Tried and failed, and why.
    Failed(String),
}

/// The path a registration uses, and what happened to the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathReport {
    /// The path in use.
    pub chosen: MemPath,
    /// Every path and its outcome, in `auto`'s order.
    pub outcomes: Vec<(MemPath, Outcome)>,
    /// Warnings, for example a forced path whose requirements were missing.
    pub warnings: Vec<String>,
    /// Whether the path was forced (`GPU_RDMA_MEM_PATH` or the caller).
    pub forced: bool,
}

impl PathReport {
    /// Why the paths before the chosen one lost, in plain words.
    pub fn reasons(&self) -> Vec<String> {
        self.outcomes
            .iter()
            .filter_map(|(_, o)| match o {
                Outcome::Skipped(r) | Outcome::Failed(r) => Some(r.clone()),
                Outcome::Chosen => None,
            })
            .collect()
    }
}

impl fmt::Display for PathReport {
    /// For example `staged: nvidia_peermem not loaded and dma-buf not
    /// supported by this driver`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.chosen)?;
        if self.forced {
            f.write_str(" (forced)")?;
            for w in &self.warnings {
                write!(f, " (warning: {w})")?;
            }
            return Ok(());
        }
        let mut losers: Vec<&str> = Vec::new();
        for (_, o) in self.outcomes.iter().take_while(|(p, _)| *p != self.chosen) {
            if let Outcome::Skipped(r) | Outcome::Failed(r) = o {
                // Both direct paths can fail for the same reason: say it once.
                if !losers.contains(&r.as_str()) {
                    losers.push(r);
                }
            }
        }
        if !losers.is_empty() {
            write!(f, ": {}", losers.join(" and "))?;
        } else if self.chosen.is_direct() {
            f.write_str(": the NIC reads and writes GPU memory directly")?;
        }
        for w in &self.warnings {
            write!(f, " (warning: {w})")?;
        }
        Ok(())
    }
}

/// Builds the report as registration tries the plan: `attempt` is called
/// for each planned path in order and returns `Ok` when it worked, or
/// `Err((reason, fatal))`; a fatal error (or any error of a forced path)
/// stops the search and is returned.
///
/// # Errors
/// The error of the last path tried when none worked (cannot happen with
/// `auto`, where staged always works, unless staging itself fails).
pub fn attempt<T>(
    plan: &Plan,
    policy: PathPolicy,
    mut try_path: impl FnMut(MemPath) -> std::result::Result<T, Error>,
) -> Result<(T, PathReport)> {
    let mut outcomes: Vec<(MemPath, Outcome)> =
        plan.skipped.iter().map(|(p, r)| (*p, Outcome::Skipped(r.clone()))).collect();
    let mut last_err = None;
    for &p in &plan.order {
        match try_path(p) {
            Ok(v) => {
                outcomes.push((p, Outcome::Chosen));
                outcomes.sort_by_key(|(q, _)| MemPath::ALL.iter().position(|x| x == q));
                let forced = matches!(policy, PathPolicy::Force(_));
                return Ok((v, PathReport { chosen: p, outcomes, warnings: plan.warnings.clone(), forced }));
            }
            Err(e) => {
                let reason = match p {
                    MemPath::DmaBuf if e.is_not_supported() => format!("dma-buf refused ({e})"),
                    MemPath::DmaBuf => format!("dma-buf registration failed ({e})"),
                    MemPath::PeerMem => format!("registering the device pointer failed ({e})"),
                    MemPath::Staged => format!("staging failed ({e})"),
                };
                outcomes.push((p, Outcome::Failed(reason)));
                if matches!(policy, PathPolicy::Force(_)) {
                    return Err(e);
                }
                last_err = Some(e);
            }
        }
    }
    Err(last_err.unwrap_or_else(|| Error::InvalidArgument("no memory path to try".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(bits: u8) -> PathCaps {
        PathCaps {
            rdma_core_dmabuf: bits & 1 != 0,
            kernel_dmabuf: bits & 2 != 0,
            driver_dmabuf: bits & 4 != 0,
            device_dmabuf: bits & 8 != 0,
            peermem_loaded: bits & 16 != 0,
            device_gdr: bits & 32 != 0,
            rdma: bits & 64 != 0,
            buffer_not_gdr_capable: false,
            flush_unavailable: false,
            beyond_gdr_level: None,
        }
    }

    #[test]
    fn a_missing_flush_or_a_far_nic_stages_under_auto_and_warns_when_forced() {
        use crate::topology::pci::LinkClass;
        let far = PathCaps { beyond_gdr_level: Some(LinkClass::Sys), ..caps(0b111_1111) };
        let p = plan(&far, PathPolicy::Auto);
        assert_eq!(p.order, vec![MemPath::Staged]);
        assert!(p.skipped.iter().all(|(_, why)| why.contains("SYS apart")), "{:?}", p.skipped);
        let forced = plan(&far, PathPolicy::Force(MemPath::DmaBuf));
        assert_eq!(forced.order, vec![MemPath::DmaBuf]);
        assert!(forced.warnings[0].contains("GDR level"), "{:?}", forced.warnings);
        let noflush = PathCaps { flush_unavailable: true, ..caps(0b111_1111) };
        let p = plan(&noflush, PathPolicy::Auto);
        assert_eq!(p.order, vec![MemPath::Staged]);
        assert!(p.skipped.iter().all(|(_, why)| why.contains("flush")), "{:?}", p.skipped);
        for link in [LinkClass::Phb, LinkClass::Node] {
            let p = plan(&PathCaps { beyond_gdr_level: Some(link), ..caps(0b111_1111) }, PathPolicy::Auto);
            assert!(p.skipped[0].1.contains(&format!("{link} apart")), "{:?}", p.skipped);
        }
    }

    #[test]
    fn an_allocation_that_is_not_gdr_capable_is_staged_and_says_why() {
        let c = PathCaps { buffer_not_gdr_capable: true, ..caps(0b111_1111) };
        let plan = plan(&c, PathPolicy::Auto);
        assert_eq!(plan.order, vec![MemPath::Staged]);
        for (p, why) in &plan.skipped {
            assert!(why.contains("IS_GPU_DIRECT_RDMA_CAPABLE"), "{p}: {why}");
        }
        let forced = super::plan(&c, PathPolicy::Force(MemPath::PeerMem));
        assert!(forced.warnings[0].contains("not GPUDirect RDMA capable"), "{:?}", forced.warnings);
    }

    const DMABUF_BITS: u8 = 0b100_1111;
    const PEERMEM_BITS: u8 = 0b111_0000;

    /// Every combination of the seven capabilities, under every policy.
    #[test]
    fn every_capability_combination_plans_as_specified() {
        let policies = [
            PathPolicy::Auto,
            PathPolicy::Force(MemPath::DmaBuf),
            PathPolicy::Force(MemPath::PeerMem),
            PathPolicy::Force(MemPath::Staged),
        ];
        let mut cases = 0;
        for bits in 0u8..128 {
            let c = caps(bits);
            let dmabuf_ok = bits & DMABUF_BITS == DMABUF_BITS;
            let peermem_ok = bits & PEERMEM_BITS == PEERMEM_BITS;
            for policy in policies {
                cases += 1;
                let p = plan(&c, policy);
                // Every path appears exactly once, planned or skipped.
                let mut seen: Vec<MemPath> = p.order.clone();
                seen.extend(p.skipped.iter().map(|(q, _)| *q));
                seen.sort_by_key(|q| q.name());
                assert_eq!(seen.len(), 3, "{bits:06b} {policy:?}: {p:?}");
                match policy {
                    PathPolicy::Auto => {
                        let mut expect = Vec::new();
                        if dmabuf_ok {
                            expect.push(MemPath::DmaBuf);
                        }
                        if peermem_ok {
                            expect.push(MemPath::PeerMem);
                        }
                        expect.push(MemPath::Staged);
                        assert_eq!(p.order, expect, "{bits:06b}");
                        assert!(p.warnings.is_empty());
                        for (q, why) in &p.skipped {
                            assert!(!why.is_empty());
                            match q {
                                MemPath::DmaBuf => assert!(!dmabuf_ok),
                                MemPath::PeerMem => assert!(!peermem_ok),
                                MemPath::Staged => panic!("staged is never skipped under auto"),
                            }
                        }
                        if !c.peermem_loaded && c.rdma {
                            assert!(
                                p.skipped
                                    .iter()
                                    .any(|(q, w)| *q == MemPath::PeerMem && w.contains("nvidia_peermem not loaded"))
                            );
                        }
                        if !c.device_dmabuf && c.rdma {
                            assert!(
                                p.skipped
                                    .iter()
                                    .any(|(q, w)| *q == MemPath::DmaBuf && w.contains("not supported by this driver"))
                            );
                        }
                    }
                    PathPolicy::Force(f) => {
                        assert_eq!(p.order, vec![f]);
                        let ok = match f {
                            MemPath::DmaBuf => dmabuf_ok,
                            MemPath::PeerMem => peermem_ok,
                            MemPath::Staged => true,
                        };
                        assert_eq!(p.warnings.is_empty(), ok, "{bits:06b} {f}: {p:?}");
                    }
                }
            }
        }
        assert_eq!(cases, 512);
    }

    #[test]
    fn the_report_says_why_in_plain_words() {
        let p = plan(&caps(0b100_0011), PathPolicy::Auto);
        let (_, report) = attempt(&p, PathPolicy::Auto, |path| match path {
            MemPath::Staged => Ok(()),
            _ => unreachable!(),
        })
        .unwrap();
        let text = report.to_string();
        assert!(text.starts_with("staged: "), "{text}");
        assert!(text.contains("nvidia_peermem not loaded"), "{text}");
        assert!(text.contains("dma-buf not supported by this driver"), "{text}");
    }

    #[test]
    fn a_refused_dmabuf_falls_back_with_the_reason() {
        let all = caps(0b111_1111);
        let p = plan(&all, PathPolicy::Auto);
        let refusal = || Error::NotSupported {
            op: "ibv_reg_dmabuf_mr",
            source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
        };
        let (_, report) = attempt(&p, PathPolicy::Auto, |path| match path {
            MemPath::DmaBuf => Err(refusal()),
            _ => Ok(()),
        })
        .unwrap();
        assert_eq!(report.chosen, MemPath::PeerMem);
        assert!(matches!(&report.outcomes[0], (MemPath::DmaBuf, Outcome::Failed(r)) if r.contains("refused")));
        assert!(report.to_string().starts_with("peermem: dma-buf refused"), "{report}");
        // Forced: the failure is the answer, no fallback.
        let p = plan(&all, PathPolicy::Force(MemPath::DmaBuf));
        let err = attempt(&p, PathPolicy::Force(MemPath::DmaBuf), |_| Err::<(), _>(refusal())).unwrap_err();
        assert!(err.is_not_supported());
        // Forced and working: said plainly.
        let p = plan(&caps(0b100_0000), PathPolicy::Force(MemPath::PeerMem));
        let (_, report) = attempt(&p, PathPolicy::Force(MemPath::PeerMem), |_| Ok(())).unwrap();
        assert!(report.forced);
        let text = report.to_string();
        assert!(text.starts_with("peermem (forced)") && text.contains("nvidia_peermem not loaded"), "{text}");
    }

    #[test]
    fn policies_parse() {
        assert_eq!("auto".parse::<PathPolicy>().unwrap(), PathPolicy::Auto);
        assert_eq!("dmabuf".parse::<PathPolicy>().unwrap(), PathPolicy::Force(MemPath::DmaBuf));
        assert_eq!("PeerMem".parse::<PathPolicy>().unwrap(), PathPolicy::Force(MemPath::PeerMem));
        assert_eq!("staged".parse::<PathPolicy>().unwrap(), PathPolicy::Force(MemPath::Staged));
        assert!("gpudirect".parse::<PathPolicy>().is_err());
    }
}
