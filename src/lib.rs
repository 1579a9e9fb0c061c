//! # gpu-rdma
//!
//! Zero-copy RDMA transfers between machines, built to carry GPU memory
//! (GPUDirect RDMA) and host memory through one safe API.
//!
//! (Crate documentation: see the README; the full manual lands with the
//! GPU-memory work.)

#![warn(missing_docs)]

pub mod bootstrap;
mod completion;
mod connection;
mod domain;
mod error;
pub mod memory;
mod ops;
mod transport;
pub mod units;
#[cfg(feature = "verbs")]
pub mod verbs;

pub use completion::{Completion, CompletionError, Opcode, WcStatus};
pub use connection::{Batch, ConnectOptions, Connection, ConnectionInfo, Pending};
pub use domain::{BufError, Domain, DomainConfig, DomainInfo, DomainStats, Listener};
pub use error::{BootstrapError, Error, Result};
pub use memory::{
    Access, Exposed, HostMemory, LocalBuffer, LocalSlice, Memory, MemoryKind, Region, RemoteRegion,
    RemoteSlice, Shared, WithdrawError,
};
