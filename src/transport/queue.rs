//! What the transports share: a post's work items, what each does at the
//! peer, and how a post ended (the start of the queue core both transports
//! run on).

use crate::access::Access;
use crate::completion::Opcode;
use crate::error::{Error, Result};
use crate::memory::{LocalParts, RemoteSlice};
use crate::ops::OpId;

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

    /// Checks the peer's range against a local range of `len` bytes, as the
    /// device would: the right the operation needs was granted, and the two
    /// ranges are the same length. Sends have no remote range.
    pub(crate) fn check_remote(self, len: u64) -> Result<()> {
        let (r, needed) = match self {
            RemoteOp::Write(r) | RemoteOp::WriteWithImm(r, _) => (r, Access::REMOTE_WRITE),
            RemoteOp::Read(r) => (r, Access::REMOTE_READ),
            RemoteOp::Send | RemoteOp::SendWithImm(_) => return Ok(()),
        };
        if !r.access().contains(needed) {
            return Err(Error::AccessDenied { needed, granted: r.access() });
        }
        if len != r.len() {
            return Err(Error::InvalidArgument(format!(
                "the local range has {len} bytes and the remote range {}",
                r.len()
            )));
        }
        Ok(())
    }
}

/// How a post ended.
pub(crate) enum Posted {
    /// In flight.
    Ok(OpId),
    /// Refused before anything reached the device: the buffer is free.
    Refused(Error),
    /// Part of it reached the device and the connection broke: the buffer
    /// must stay with the connection until it is torn down (verbs only).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Stuck(OpId, Error),
}
