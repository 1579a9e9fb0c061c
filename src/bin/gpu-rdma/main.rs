//! `gpu-rdma`: the command-line tool.
//!
//! - `gpu-rdma devices`: RDMA devices, ports, state, MTU, link layer and
//!   GIDs, like `ibv_devinfo`, plus the GID gpu-rdma would choose and why.
//! - `gpu-rdma gpu`: GPUs, their GPUDirect attributes, the memory path each
//!   would get; `--bandwidth` measures host<->device copies.
//! - `gpu-rdma doctor`: is GPUDirect RDMA really usable, and if not, why and
//!   how to fix it. Exit 0: usable for every GPU asked about; 1: not; 2:
//!   could not tell.
//! - `gpu-rdma topo`: the GPU x NIC matrix and the best NIC per GPU.
//! - `gpu-rdma bench`: perftest's bandwidth and latency tests and table,
//!   on every transport and memory path.

mod bench;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "gpu-rdma", version, about = "Zero-copy RDMA between GPUs: devices, diagnostics, benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// Where the doctor and topo read the machine from.
#[derive(clap::Args, Debug, Clone)]
struct Sources {
    /// Read sysfs from DIR instead of /sys (a recorded tree).
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs_root: std::path::PathBuf,
    /// Read procfs from DIR instead of /proc.
    #[arg(long, value_name = "DIR", default_value = "/proc")]
    proc_root: std::path::PathBuf,
    /// Use this `nvidia-smi topo -m` output instead of running nvidia-smi.
    #[arg(long, value_name = "FILE")]
    nvidia_smi_topo: Option<std::path::PathBuf>,
    /// Only this GPU (GPUn in PCI order).
    #[arg(long)]
    gpu: Option<usize>,
    /// The farthest GPU-NIC link GPUDirect RDMA is used at: PIX, PXB, PHB,
    /// NODE or SYS (default GPU_RDMA_GDR_LEVEL, else PXB, like NCCL).
    #[arg(long)]
    gdr_level: Option<String>,
    /// Print one JSON document.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// perftest's tests (write-bw, read-bw, send-bw, write-lat, read-lat,
    /// send-lat) with its flags and table. Server: no address; client: the
    /// server's address.
    Bench(bench::BenchArgs),
    /// Is GPUDirect RDMA really usable here? Checks, the GPU x NIC matrix,
    /// and a verdict per GPU with reasons and fixes.
    ///
    /// Exit code: 0 when every GPU asked about has a usable GPUDirect RDMA
    /// path, 1 when some has not, 2 when there is no GPU to judge.
    Doctor {
        #[command(flatten)]
        sources: Sources,
        /// Bytes of GPU memory that will be registered (for the BAR1 check;
        /// default: the GPU's memory when CUDA is present).
        #[arg(long, value_parser = |s: &str| gpu_rdma::units::parse_bytes(s).map_err(|e| e.to_string()))]
        bytes: Option<u64>,
    },
    /// The GPU x NIC matrix (nvidia-smi's legend) and the best NIC per GPU.
    ///
    /// Exit code: 0 when every GPU asked about has a usable GPUDirect RDMA
    /// path, 1 when some has not, 2 when there is no GPU to judge.
    Topo {
        #[command(flatten)]
        sources: Sources,
    },
    /// List RDMA devices, their ports and GID tables (like ibv_devinfo).
    Devices {
        /// Only this device.
        #[arg(short = 'd', long)]
        device: Option<String>,
    },
    /// CUDA devices, their GPUDirect attributes, the memory path each would
    /// get and why; with --bandwidth, host<->device copy bandwidth.
    Gpu {
        /// Only this CUDA device.
        #[arg(long)]
        gpu: Option<usize>,
        /// Measure host<->device copy bandwidth (pinned and pageable).
        #[arg(long)]
        bandwidth: bool,
        /// Bytes per copy for --bandwidth.
        #[arg(long, default_value = "256MiB", value_parser = |s: &str| gpu_rdma::units::parse_bytes(s).map_err(|e| e.to_string()))]
        bytes: u64,
    },
}

fn main() -> ExitCode {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("GPU_RDMA_LOG"))
        .with_writer(std::io::stderr)
        // Colour only for a terminal: no escape codes in pipes and files.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Devices { device } => devices(device.as_deref()),
        Cmd::Gpu { gpu, bandwidth, bytes } => gpu_cmd(gpu, bandwidth, bytes as usize),
        Cmd::Doctor { sources, bytes } => doctor(&sources, bytes, false),
        Cmd::Topo { sources } => doctor(&sources, None, true),
        Cmd::Bench(args) => bench::run(&args),
    }
}

#[cfg(feature = "verbs")]
fn devices(only: Option<&str>) -> ExitCode {
    use gpu_rdma::verbs::{self, DeviceList, choose_gid};

    println!(
        "rdma-core {} at build time; dma-buf registration (ibv_reg_dmabuf_mr): {}",
        verbs::RDMA_CORE_VERSION,
        if verbs::HAS_DMABUF_MR { "available" } else { "not in these headers" }
    );
    let list = match DeviceList::new() {
        Ok(l) => l,
        Err(gpu_rdma::Error::NoDevice { reason }) => {
            println!("no RDMA devices: {reason}");
            return ExitCode::from(1);
        }
        Err(e) => {
            println!("cannot list RDMA devices: {e}");
            return ExitCode::from(1);
        }
    };
    if list.is_empty() {
        println!("no RDMA devices found: no driver has registered one (load mlx5_ib, or rdma_rxe for soft-RoCE)");
        return ExitCode::from(1);
    }
    let mut shown = 0;
    for dev in list.iter() {
        let name = dev.name();
        if only.is_some_and(|o| o != name) {
            continue;
        }
        shown += 1;
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                println!("hca_id:\t{name}\n\terror: {e}");
                continue;
            }
        };
        println!("hca_id:\t{name}");
        println!("\tnode_guid:\t\t{:016x}", dev.guid());
        let attr = match ctx.query_device() {
            Ok(a) => a,
            Err(e) => {
                println!("\terror: {e}");
                continue;
            }
        };
        println!("\tfw_ver:\t\t\t{}", attr.fw_ver);
        println!("\tvendor_id:\t\t{:#x}", attr.vendor_id);
        println!("\tvendor_part_id:\t\t{}", attr.vendor_part_id);
        println!("\tphys_port_cnt:\t\t{}", attr.phys_port_cnt);
        println!("\tmax_qp_wr:\t\t{}", attr.max_qp_wr);
        println!("\tmax_sge:\t\t{}", attr.max_sge);
        println!("\tmax_mr_size:\t\t{:#x}", attr.max_mr_size);
        println!("\tmax_qp_rd_atom:\t\t{}", attr.max_qp_rd_atom);
        println!("\tatomics:\t\t{}", if attr.atomics { "supported" } else { "none" });
        println!("\tsysfs:\t\t\t{}", ctx.sysfs_path().display());
        for port in 1..=attr.phys_port_cnt {
            let p = match ctx.query_port(port) {
                Ok(p) => p,
                Err(e) => {
                    println!("\t\tport:\t{port}\n\t\t\terror: {e}");
                    continue;
                }
            };
            println!("\t\tport:\t{port}");
            println!("\t\t\tstate:\t\t\t{}", p.state);
            println!("\t\t\tmax_mtu:\t\t{}", p.max_mtu);
            println!("\t\t\tactive_mtu:\t\t{}", p.active_mtu);
            println!("\t\t\tlink_layer:\t\t{}", p.link_layer);
            println!("\t\t\tlid:\t\t\t{}", p.lid);
            println!("\t\t\trate:\t\t\t{}", p.rate());
            println!("\t\t\tmax_msg_sz:\t\t{:#x}", p.max_msg_sz);
            match ctx.gid_table(port) {
                Ok(table) => {
                    let chosen = choose_gid(&table, p.link_layer, None);
                    for e in &table {
                        let mark =
                            if chosen.as_ref().is_some_and(|c| c.entry.index == e.index) { "  <- default" } else { "" };
                        println!(
                            "\t\t\tGID[{:3}]:\t\t{}, {}{}{mark}",
                            e.index,
                            e.gid,
                            e.gid_type,
                            e.netdev.as_deref().map(|n| format!(", {n}")).unwrap_or_default()
                        );
                    }
                    match chosen {
                        Some(c) => {
                            println!("\t\t\tgpu-rdma uses GID {}: {}", c.entry.index, c.reason)
                        }
                        None => println!("\t\t\tno usable GID: the port cannot be addressed"),
                    }
                }
                Err(e) => println!("\t\t\tGID table: {e}"),
            }
        }
    }
    if shown == 0 {
        println!("no RDMA device called `{}`; found: {}", only.unwrap_or_default(), list.names().join(", "));
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

#[cfg(not(feature = "verbs"))]
fn devices(_only: Option<&str>) -> ExitCode {
    println!("gpu-rdma was built without the `verbs` feature: it cannot list RDMA devices");
    ExitCode::from(1)
}

#[cfg(feature = "cuda")]
fn gpu_cmd(only: Option<usize>, bandwidth: bool, bytes: usize) -> ExitCode {
    use gpu_rdma::cuda::{CudaBuffer, CudaDevice, PinnedHost, driver};
    use gpu_rdma::memory::gpu::detect_caps;
    use gpu_rdma::memory::path::{PathPolicy, plan};
    use gpu_rdma::topology::peermem_marker;
    use std::time::Instant;

    let info = match driver() {
        Ok(i) => i,
        Err(e) => {
            println!("no GPU: {e}");
            return ExitCode::from(1);
        }
    };
    println!("CUDA driver {} ({}), {} device(s)", info.version_string(), info.version, info.device_count);
    println!(
        "driver calls: dma-buf export (cuMemGetHandleForAddressRange) {}, cuFlushGPUDirectRDMAWrites {}",
        if info.has_dmabuf_export { "present" } else { "absent" },
        if info.has_flush { "present" } else { "absent" }
    );
    match peermem_marker(std::path::Path::new("/sys")) {
        Some(m) => println!("nvidia-peermem: loaded (/sys/{m})"),
        None => println!("nvidia-peermem: not loaded"),
    }
    let mut status = ExitCode::SUCCESS;
    for ordinal in 0..info.device_count {
        if only.is_some_and(|o| o != ordinal) {
            continue;
        }
        let dev = match CudaDevice::open(ordinal) {
            Ok(d) => d,
            Err(e) => {
                println!("GPU {ordinal}: {e}");
                status = ExitCode::from(1);
                continue;
            }
        };
        let a = dev.attrs();
        println!(
            "GPU {ordinal}: {} at {}, {} MiB, compute {}.{}",
            dev.name(),
            dev.pci_bus_id(),
            dev.total_mem() >> 20,
            a.compute_capability.0,
            a.compute_capability.1
        );
        println!(
            "\tDMA_BUF_SUPPORTED {}, GPU_DIRECT_RDMA_SUPPORTED {}, FLUSH_WRITES_OPTIONS {:#x}, WRITES_ORDERING {}",
            a.dma_buf_supported as u8, a.gpu_direct_rdma_supported as u8, a.flush_writes_options, a.writes_ordering
        );
        println!("\tafter remote writes: {:?}", dev.flush_policy());
        #[cfg(feature = "verbs")]
        let rdma = gpu_rdma::verbs::DeviceList::new().is_ok_and(|l| !l.is_empty());
        #[cfg(not(feature = "verbs"))]
        let rdma = false;
        let p = plan(&gpu_rdma::memory::path::PathCaps { rdma, ..detect_caps(&dev) }, PathPolicy::Auto);
        println!("\tmemory paths to try: {}", p.order.iter().map(|m| m.name()).collect::<Vec<_>>().join(", "));
        for (m, why) in &p.skipped {
            println!("\t  {m}: {why}");
        }
        if bandwidth {
            let measure = || -> gpu_rdma::Result<()> {
                let buf = CudaBuffer::alloc(&dev, bytes)?;
                let mut pinned = PinnedHost::new(&dev, buf.len())?;
                let mut pageable = vec![0u8; buf.len()];
                let gbs = |n: usize, t: std::time::Duration| n as f64 / t.as_secs_f64() / 1e9;
                let rounds = 5;
                let t = Instant::now();
                for _ in 0..rounds {
                    buf.copy_from_host(0, pinned.as_slice())?;
                }
                let h2d_pinned = gbs(rounds * buf.len(), t.elapsed());
                let t = Instant::now();
                for _ in 0..rounds {
                    buf.copy_to_host(0, pinned.as_mut_slice())?;
                }
                let d2h_pinned = gbs(rounds * buf.len(), t.elapsed());
                let t = Instant::now();
                for _ in 0..rounds {
                    buf.copy_from_host(0, &pageable)?;
                }
                let h2d_pageable = gbs(rounds * buf.len(), t.elapsed());
                let t = Instant::now();
                for _ in 0..rounds {
                    buf.copy_to_host(0, &mut pageable)?;
                }
                let d2h_pageable = gbs(rounds * buf.len(), t.elapsed());
                println!(
                    "\tcopy bandwidth, {} MiB x {rounds}: host->device pinned {h2d_pinned:.2} GB/s, pageable {h2d_pageable:.2} GB/s; device->host pinned {d2h_pinned:.2} GB/s, pageable {d2h_pageable:.2} GB/s",
                    buf.len() >> 20
                );
                // What a staging slot costs to make and to drop, which the
                // staged path pays on its hot path unless the slot is cached
                // or reserved ahead (Domain::reserve_staging).
                let (slot, n) = (1 << 20, 16);
                let t = Instant::now();
                let slots = (0..n).map(|_| PinnedHost::new(&dev, slot)).collect::<gpu_rdma::Result<Vec<_>>>()?;
                let pin = t.elapsed() / n;
                let t = Instant::now();
                drop(slots);
                let unpin = t.elapsed() / n;
                println!(
                    "	pinning host memory, 1 MiB x {n}: {:.1} us to map and pin, {:.1} us to unpin and unmap, each",
                    pin.as_secs_f64() * 1e6,
                    unpin.as_secs_f64() * 1e6
                );
                Ok(())
            };
            if let Err(e) = measure() {
                println!("\tbandwidth: {e}");
                status = ExitCode::from(1);
            }
        }
    }
    status
}

#[cfg(not(feature = "cuda"))]
fn gpu_cmd(_only: Option<usize>, _bandwidth: bool, _bytes: usize) -> ExitCode {
    println!("gpu-rdma was built without the `cuda` feature: it cannot look at GPUs");
    ExitCode::from(1)
}

fn doctor(sources: &Sources, bytes: Option<u64>, topo_only: bool) -> ExitCode {
    use gpu_rdma::topology::{Inputs, LinkClass, Status, doctor, gdr_level_from_env};

    let level = match &sources.gdr_level {
        Some(l) => match LinkClass::parse(l) {
            Some(c) => c,
            None => {
                eprintln!("--gdr-level {l}: expected PIX, PXB, PHB, NODE or SYS");
                return ExitCode::from(2);
            }
        },
        None => match gdr_level_from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        },
    };
    // Probing (CUDA, nvidia-smi, lspci, a registration) only on the live system.
    let live = sources.sysfs_root == std::path::Path::new("/sys") && sources.proc_root == std::path::Path::new("/proc");
    let mut inputs = Inputs::gather(&sources.sysfs_root, &sources.proc_root, sources.nvidia_smi_topo.as_deref(), live);
    inputs.register_bytes = bytes;
    let report = doctor(&inputs, level, sources.gpu);

    if sources.json {
        let json = if topo_only {
            serde_json::to_string_pretty(&report.topo())
        } else {
            serde_json::to_string_pretty(&report)
        };
        match json {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    } else {
        if !topo_only {
            println!("gpu-rdma doctor: is GPUDirect RDMA usable? (used up to {level}; --gdr-level changes it)\n");
            for c in &report.checks {
                println!("  [{:<4}] {}: {}", c.status, c.name, c.detail);
                if let (Some(fix), Status::Warn | Status::Fail) = (&c.fix, c.status) {
                    println!("           fix: {fix}");
                }
            }
            println!();
        }
        if report.gpus.is_empty() || report.nics.is_empty() {
            println!(
                "GPU x NIC matrix: nothing to show ({} GPU(s), {} RDMA NIC(s) on PCI)",
                report.gpus.len(),
                report.nics.len()
            );
        } else {
            println!("GPU x NIC matrix (from {}):", report.links_source);
            let width = report.nics.iter().map(|n| n.len()).max().unwrap_or(4).max(4) + 2;
            print!("{:8}", "");
            for n in &report.nics {
                print!("{n:<width$}");
            }
            println!();
            for g in &report.gpus {
                print!("{g:8}");
                for n in &report.nics {
                    let l = report.links.iter().find(|l| &l.gpu == g && &l.nic == n).map_or("?", |l| l.link.name());
                    print!("{l:<width$}");
                }
                println!();
            }
            println!("\nLegend:\n");
            for c in LinkClass::ALL.iter().rev() {
                println!("  {:<4} = {}", c.name(), c.legend());
            }
        }
        println!();
        for v in &report.verdicts {
            let link = v.link.map_or(String::new(), |l| format!(" ({l})"));
            let nic = v.best_nic.as_deref().unwrap_or("none");
            if topo_only {
                println!("{}: best NIC {nic}{link}", v.gpu);
            } else if v.usable {
                println!("{}: best NIC {nic}{link}: GPUDirect RDMA usable", v.gpu);
            } else {
                println!("{}: best NIC {nic}{link}: GPUDirect RDMA NOT usable", v.gpu);
                for (r, f) in v.reasons.iter().zip(&v.fixes) {
                    println!("    - {r}\n      fix: {f}");
                }
            }
        }
        if !topo_only {
            println!(
                "\n{}",
                match report.exit_code {
                    0 => "verdict: the fast path is usable for every GPU asked about",
                    1 => "verdict: the fast path is NOT usable for every GPU asked about (see above)",
                    _ => "verdict: could not tell: no GPU to judge on this machine",
                }
            );
        }
    }
    if topo_only {
        return ExitCode::from(if report.gpus.is_empty() { 2 } else { 0 });
    }
    ExitCode::from(report.exit_code as u8)
}
