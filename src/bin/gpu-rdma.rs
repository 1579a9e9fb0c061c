//! `gpu-rdma`: the command-line tool.
//!
//! - `gpu-rdma devices`: RDMA devices, ports, state, MTU, link layer and
//!   GIDs, like `ibv_devinfo`, plus the GID gpu-rdma would choose and why.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "gpu-rdma", version, about = "Zero-copy RDMA between GPUs: devices, diagnostics, benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List RDMA devices, their ports and GID tables (like ibv_devinfo).
    Devices {
        /// Only this device.
        #[arg(short = 'd', long)]
        device: Option<String>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("GPU_RDMA_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Devices { device } => devices(device.as_deref()),
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
        Err(e) => {
            println!("no RDMA devices: {e}");
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
