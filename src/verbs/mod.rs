//! Safe ibverbs: the only module that names `rdma_sys`.
//!
//! Layering follows `sys -> result -> safe`: [`rdma_sys`] binds the C API,
//! `result` turns each call's error convention into [`crate::Result`], and the
//! types here own one verbs resource each. Children keep their parents
//! alive (`Arc`), so teardown always runs in dependency order: memory
//! regions and queue pairs before their protection domain, queue pairs
//! before their completion queues, everything before the device context.
//!
//! Registering memory and posting work requests are `unsafe` at this level,
//! with written contracts; [`crate::Connection`] is the safe layer above.

mod context;
mod cq;
mod device;
pub(crate) mod loader;
mod mr;
mod pd;
mod port;
mod qp;
mod result;
mod wr;

pub use context::{Context, DeviceAttr};
pub use cq::{CompletionChannel, CompletionQueue, WaitOutcome, WcOpcode, WorkCompletion};
pub use device::{Device, DeviceList};
pub use mr::MemoryRegion;
pub use pd::ProtectionDomain;
pub use port::{Gid, GidChoice, GidEntry, GidType, LinkLayer, Mtu, PortAttr, PortState, choose_gid};
pub use qp::{PostError, QpCaps, QpState, QueuePair, QueuePairBuilder, RtrAttr, RtsAttr};
pub use wr::{RecvWr, SendOp, SendWr, Sge};

/// The raw bindings, for what this module does not wrap.
pub use rdma_sys as ffi;

use crate::error::{Error, Result};

/// Whether this build can register dma-buf memory (`ibv_reg_dmabuf_mr` was
/// found in the rdma-core headers at build time).
pub const HAS_DMABUF_MR: bool = cfg!(gpu_rdma_dmabuf_mr);

/// The libibverbs version found at build time.
pub const RDMA_CORE_VERSION: &str = env!("GPU_RDMA_RDMA_CORE_VERSION");

/// Opens a device and picks a port.
///
/// With `device`, that device; else the first device that has an active
/// port. With `port`, that port (which must be active); else the device's
/// first active port.
///
/// # Errors
/// [`Error::NoDevice`] when there is no RDMA device or no kernel support,
/// [`Error::DeviceNotFound`], [`Error::NoActivePort`].
pub fn open_device(device: Option<&str>, port: Option<u8>) -> Result<(Context, PortAttr)> {
    let list = DeviceList::new()?;
    if list.is_empty() {
        return Err(Error::NoDevice {
            reason: "no RDMA devices found: no driver has registered one (load mlx5_ib, or rdma_rxe for soft-RoCE)"
                .to_owned(),
        });
    }
    let candidates: Vec<Device<'_>> = match device {
        Some(name) => vec![list.find(name)?],
        None => list.iter().collect(),
    };
    let mut seen = Vec::new();
    for dev in candidates {
        let ctx = dev.open()?;
        let attr = ctx.query_device()?;
        let ports: Vec<u8> = match port {
            Some(p) => vec![p],
            None => (1..=attr.phys_port_cnt).collect(),
        };
        for p in ports {
            match ctx.query_port(p) {
                Ok(pa) if pa.is_active() => return Ok((ctx, pa)),
                Ok(pa) => seen.push(format!("{} port {p}: {}", ctx.name(), pa.state)),
                Err(e) => seen.push(format!("{} port {p}: {e}", ctx.name())),
            }
        }
    }
    Err(Error::NoActivePort {
        device: device.map_or_else(|| list.names().join(", "), str::to_owned),
        detail: if seen.is_empty() { "no ports".to_owned() } else { seen.join("; ") },
    })
}
