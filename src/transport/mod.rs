//! Transports behind [`crate::Domain`] and [`crate::Connection`], dispatched
//! through enums so the fast path stays static. Today: verbs (RC queue
//! pairs). Each enum has an uninhabited `Never` variant so that the crate
//! still builds, and every match stays exhaustive, without the `verbs`
//! feature.

use std::convert::Infallible;
use std::net::TcpStream;
use std::time::Instant;

use crate::completion::{Completion, Opcode};
use crate::connection::ConnectOptions;
use crate::domain::{Domain, DomainConfig, DomainInfo};
use crate::error::{Error, Result};
use crate::memory::{Access, LocalParts, RemoteRegion, RemoteSlice};
use crate::ops::OpId;

#[cfg(feature = "verbs")]
pub(crate) mod verbs;

/// A memory registration.
pub(crate) enum Registration {
    /// Host memory, or GPU memory on a direct path (dma-buf, nvidia-peermem).
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::MemoryRegion),
    /// GPU memory on the staged path: nothing is registered; operations go
    /// through the domain's pinned, registered staging buffers.
    #[cfg(feature = "cuda")]
    Staged,
    /// A staged GPU region exposed to peers: a pinned host mirror with its
    /// own registration (remote rights). Peers read and write the mirror;
    /// the owner copies between it and the GPU.
    #[cfg(all(feature = "verbs", feature = "cuda"))]
    Mirror {
        // Declared first: deregistered before the mirror is freed.
        mr: crate::verbs::MemoryRegion,
        mem: crate::cuda::PinnedHost,
    },
    #[allow(dead_code)]
    Never(Infallible),
}

impl Registration {
    pub(crate) fn lkey(&self) -> u32 {
        match self {
            #[cfg(feature = "verbs")]
            Registration::Verbs(mr) => mr.lkey(),
            #[cfg(feature = "cuda")]
            Registration::Staged => 0,
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mr, .. } => mr.lkey(),
            Registration::Never(n) => match *n {},
        }
    }

    pub(crate) fn rkey(&self) -> u32 {
        match self {
            #[cfg(feature = "verbs")]
            Registration::Verbs(mr) => mr.rkey(),
            #[cfg(feature = "cuda")]
            Registration::Staged => 0,
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mr, .. } => mr.rkey(),
            Registration::Never(n) => match *n {},
        }
    }

    /// Where peers address it, when that is not the registered memory
    /// itself (a staged region's host mirror).
    pub(crate) fn mirror(&self) -> Option<(u64, usize)> {
        match self {
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mr, .. } => Some((mr.addr(), mr.len())),
            _ => None,
        }
    }

    /// Deregisters; on failure the memory must be leaked, not freed.
    pub(crate) fn deregister(self) -> Result<()> {
        match self {
            #[cfg(feature = "verbs")]
            Registration::Verbs(mr) => mr.deregister(),
            #[cfg(feature = "cuda")]
            Registration::Staged => Ok(()),
            #[cfg(all(feature = "verbs", feature = "cuda"))]
            Registration::Mirror { mr, mem } => match mr.deregister() {
                Ok(()) => Ok(()),
                Err(e) => {
                    std::mem::forget(mem);
                    Err(e)
                }
            },
            Registration::Never(n) => match n {},
        }
    }
}

/// A domain's transport resources.
pub(crate) enum Backend {
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsDomain),
    #[allow(dead_code)]
    Never(Infallible),
}

pub(crate) fn open_backend(config: &DomainConfig) -> Result<Backend> {
    #[cfg(feature = "verbs")]
    {
        Ok(Backend::Verbs(verbs::VerbsDomain::open(config)?))
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = config;
        Err(Error::FeatureDisabled { feature: "verbs" })
    }
}

impl Backend {
    pub(crate) fn info(&self) -> DomainInfo {
        match self {
            #[cfg(feature = "verbs")]
            Backend::Verbs(v) => v.info(),
            Backend::Never(n) => match *n {},
        }
    }

    /// Registers `len` bytes of the dma-buf `fd` at `offset`, addressed as `iova`.
    ///
    /// # Safety
    /// The memory behind the dma-buf range must stay allocated until the
    /// returned registration is deregistered.
    #[cfg(feature = "cuda")]
    pub(crate) unsafe fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Registration> {
        match self {
            #[cfg(feature = "verbs")]
            // SAFETY: forwarded contract.
            Backend::Verbs(v) => unsafe { v.register_dmabuf(fd, offset, len, iova, access) },
            Backend::Never(n) => {
                let _ = (fd, offset, len, iova, access);
                match *n {}
            }
        }
    }

    /// Registers a staged region's host mirror with `access`; the
    /// registration owns the mirror.
    #[cfg(feature = "cuda")]
    pub(crate) fn register_mirror(&self, mem: crate::cuda::PinnedHost, access: Access) -> Result<Registration> {
        match self {
            #[cfg(feature = "verbs")]
            Backend::Verbs(v) => v.register_mirror(mem, access),
            Backend::Never(n) => {
                let _ = (mem, access);
                match *n {}
            }
        }
    }

    /// Registers `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The memory must stay allocated and in place until the returned
    /// registration is deregistered.
    pub(crate) unsafe fn register(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Registration> {
        match self {
            #[cfg(feature = "verbs")]
            // SAFETY: forwarded contract.
            Backend::Verbs(v) => unsafe { v.register(ptr, len, access) },
            Backend::Never(n) => {
                let _ = (ptr, len, access);
                match *n {}
            }
        }
    }
}

/// One operation of a post: the local range it uses and what it does.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkItem {
    pub local: Option<LocalParts>,
    pub op: RemoteOp,
}

/// What an operation does at the peer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RemoteOp {
    Send,
    SendWithImm(u32),
    Write(RemoteSlice),
    WriteWithImm(RemoteSlice, u32),
    Read(RemoteSlice),
}

impl RemoteOp {
    /// Whether the device writes local memory (a read's destination).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn reads_remote(self) -> bool {
        matches!(self, RemoteOp::Read(_))
    }

    pub(crate) fn opcode(self) -> Opcode {
        match self {
            RemoteOp::Send => Opcode::Send,
            RemoteOp::SendWithImm(_) => Opcode::SendWithImm,
            RemoteOp::Write(_) => Opcode::Write,
            RemoteOp::WriteWithImm(..) => Opcode::WriteWithImm,
            RemoteOp::Read(_) => Opcode::Read,
        }
    }
}

/// How a post ended.
pub(crate) enum Posted {
    /// In flight.
    Ok(OpId),
    /// Refused before anything reached the device: the buffer is free.
    Refused(Error),
    /// Part of it reached the device and the connection broke: the buffer
    /// must stay with the connection until it is torn down.
    Stuck(OpId, Error),
}

/// A connection's transport state.
// The other variant is uninhabited: there is no size difference to box away.
#[allow(clippy::large_enum_variant)]
pub(crate) enum ConnTransport {
    #[cfg(feature = "verbs")]
    Verbs(verbs::VerbsConn),
    #[allow(dead_code)]
    Never(Infallible),
}

/// Fixed facts about an established connection.
pub(crate) struct Established {
    pub transport: ConnTransport,
    pub peer_regions: Vec<RemoteRegion>,
    pub info: crate::connection::ConnectionInfo,
}

pub(crate) fn establish(
    domain: &Domain,
    stream: TcpStream,
    opts: &ConnectOptions,
    is_server: bool,
) -> Result<Established> {
    match &domain.inner.backend {
        #[cfg(feature = "verbs")]
        Backend::Verbs(v) => verbs::VerbsConn::establish(domain, v, stream, opts, is_server),
        Backend::Never(n) => {
            let _ = (stream, opts, is_server);
            match *n {}
        }
    }
}

macro_rules! dispatch {
    ($self:ident, $t:ident => $e:expr) => {
        match $self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs($t) => $e,
            ConnTransport::Never(n) => match *n {},
        }
    };
}

// Without the `verbs` feature these enums are uninhabited (no transport is
// compiled in), so arguments go unused and code after a value of them is
// unreachable; the functions still have to exist.
#[cfg_attr(not(feature = "verbs"), allow(unused_variables, unreachable_code))]
impl ConnTransport {
    pub(crate) fn post_send(&self, items: &[WorkItem], deadline: Instant) -> Posted {
        dispatch!(self, t => t.post_send(items, deadline))
    }

    pub(crate) fn post_recv(&self, local: Option<LocalParts>) -> Posted {
        dispatch!(self, t => t.post_recv(local))
    }

    pub(crate) fn post_inline(&self, data: &[u8], imm: Option<u32>, deadline: Instant) -> Posted {
        dispatch!(self, t => t.post_inline(data, imm, deadline))
    }

    /// Drives progress until `id` is done or the deadline passes.
    pub(crate) fn wait(
        &self,
        id: OpId,
        deadline: Instant,
        what: &'static str,
        timeout: std::time::Duration,
    ) -> Result<()> {
        dispatch!(self, t => t.wait_done(id, deadline, what, timeout))
    }

    /// Polls once; whether `id` is done.
    pub(crate) fn poll(&self, id: OpId) -> Result<bool> {
        dispatch!(self, t => t.poll_done(id))
    }

    pub(crate) fn take(&self, id: OpId) -> Option<Result<Completion>> {
        dispatch!(self, t => t.take(id))
    }

    pub(crate) fn orphan(&self, id: OpId, buffer: Box<dyn std::any::Any + Send>) {
        dispatch!(self, t => t.orphan(id, buffer))
    }

    pub(crate) fn progress(&self) -> Result<usize> {
        dispatch!(self, t => t.progress_now())
    }

    pub(crate) fn broken(&self) -> Option<String> {
        dispatch!(self, t => t.broken())
    }

    pub(crate) fn shutdown(&self, reason: &str) {
        dispatch!(self, t => t.shutdown(reason))
    }

    pub(crate) fn stats(&self) -> (usize, usize) {
        dispatch!(self, t => t.stats())
    }
}
