//! Work requests. Building one is safe; posting it is `unsafe`
//! ([`QueuePair::post_send`](super::QueuePair::post_send)), because the
//! memory it names must stay valid until it completes.

use std::fmt;

use rdma_sys as ffi;

/// A scatter/gather entry: `len` bytes at `addr` in a memory region with
/// local key `lkey`. Layout-identical to `struct ibv_sge`.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct Sge(pub(crate) ffi::ibv_sge);

impl Sge {
    /// An entry. Nothing is checked until the device uses it.
    pub fn new(addr: u64, len: u32, lkey: u32) -> Self {
        Sge(ffi::ibv_sge { addr, length: len, lkey })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.0.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.0.length
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.0.length == 0
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.0.lkey
    }
}

impl fmt::Debug for Sge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sge({:#x}+{} lkey {:#x})", self.addr(), self.len(), self.lkey())
    }
}

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send: consumes a receive at the peer.
    Send,
    /// Send with a 32-bit immediate (host order here, network order on the wire).
    SendWithImm(u32),
    /// One-sided write to `remote_addr` in the peer's region `rkey`.
    Write {
        /// Target address at the peer.
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
    },
    /// Write that also consumes a receive at the peer, handing it `imm`.
    WriteWithImm {
        /// Target address at the peer.
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
        /// The immediate.
        imm: u32,
    },
    /// One-sided read from `remote_addr` in the peer's region `rkey`.
    Read {
        /// Source address at the peer.
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
    },
}

impl SendOp {
    pub(crate) fn raw_opcode(self) -> u32 {
        use ffi::ibv_wr_opcode as op;
        match self {
            SendOp::Send => op::IBV_WR_SEND,
            SendOp::SendWithImm(_) => op::IBV_WR_SEND_WITH_IMM,
            SendOp::Write { .. } => op::IBV_WR_RDMA_WRITE,
            SendOp::WriteWithImm { .. } => op::IBV_WR_RDMA_WRITE_WITH_IMM,
            SendOp::Read { .. } => op::IBV_WR_RDMA_READ,
        }
    }

    /// Whether the device writes local memory (the scatter list is a destination).
    pub fn writes_local(self) -> bool {
        matches!(self, SendOp::Read { .. })
    }
}

/// A send-queue work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Returned in its completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local memory: the source, or for reads the destination.
    pub sges: &'a [Sge],
    /// Generate a completion (`IBV_SEND_SIGNALED`). Unsignaled requests still
    /// occupy the send queue until a later signaled one completes.
    pub signaled: bool,
    /// Copy the data into the request at post time (`IBV_SEND_INLINE`);
    /// only for sends and writes no larger than the queue pair's inline limit.
    pub inline: bool,
    /// Wait for earlier reads to finish first (`IBV_SEND_FENCE`).
    pub fence: bool,
    /// Ask the peer's armed completion queue to wake on this one (`IBV_SEND_SOLICITED`).
    pub solicited: bool,
}

impl<'a> SendWr<'a> {
    /// A signaled request.
    pub fn new(wr_id: u64, op: SendOp, sges: &'a [Sge]) -> Self {
        SendWr { wr_id, op, sges, signaled: true, inline: false, fence: false, solicited: false }
    }

    /// Sets whether it generates a completion.
    pub fn signaled(mut self, yes: bool) -> Self {
        self.signaled = yes;
        self
    }

    /// Sets whether its data is copied in at post time.
    pub fn inline(mut self, yes: bool) -> Self {
        self.inline = yes;
        self
    }

    /// Total bytes in its scatter list.
    pub fn total_len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.len())).sum()
    }

    pub(crate) fn raw_flags(&self) -> u32 {
        use ffi::ibv_send_flags as fl;
        let mut flags = 0;
        if self.signaled {
            flags |= fl::IBV_SEND_SIGNALED.0;
        }
        if self.inline {
            flags |= fl::IBV_SEND_INLINE.0;
        }
        if self.fence {
            flags |= fl::IBV_SEND_FENCE.0;
        }
        if self.solicited {
            flags |= fl::IBV_SEND_SOLICITED.0;
        }
        flags
    }
}

/// A receive-queue work request: where the next incoming send lands.
/// An empty scatter list takes only immediates (writes with immediate, or
/// zero-byte sends).
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Returned in its completion.
    pub wr_id: u64,
    /// Destination memory.
    pub sges: &'a [Sge],
}

impl<'a> RecvWr<'a> {
    /// A receive request.
    pub fn new(wr_id: u64, sges: &'a [Sge]) -> Self {
        RecvWr { wr_id, sges }
    }
}
