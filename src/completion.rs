//! Completions: the one result type every transport reports.
//!
//! A [`Completion`] is a small `Copy` value. Its [`status`](Completion::status)
//! uses the ibverbs vocabulary (`IBV_WC_*`) whatever carried the operation, so
//! code that matches on a remote-access error works the same on every
//! transport.

use std::fmt;

/// What a completed work request did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Opcode {
    /// A two-sided send.
    Send,
    /// A two-sided send carrying a 32-bit immediate.
    SendWithImm,
    /// A one-sided RDMA write.
    Write,
    /// A one-sided RDMA write that also consumes a receive at the target and
    /// hands it a 32-bit immediate.
    WriteWithImm,
    /// A one-sided RDMA read.
    Read,
    /// A posted receive consumed by a peer's send.
    Recv,
    /// A posted receive consumed by a peer's write with immediate.
    RecvWriteWithImm,
}

impl Opcode {
    /// The name RDMA people use for it.
    pub fn name(self) -> &'static str {
        match self {
            Opcode::Send => "SEND",
            Opcode::SendWithImm => "SEND WITH IMMEDIATE",
            Opcode::Write => "RDMA WRITE",
            Opcode::WriteWithImm => "RDMA WRITE WITH IMMEDIATE",
            Opcode::Read => "RDMA READ",
            Opcode::Recv => "RECV",
            Opcode::RecvWriteWithImm => "RECV (RDMA WRITE WITH IMMEDIATE)",
        }
    }

    /// Whether this is the completion of a posted receive.
    pub fn is_recv(self) -> bool {
        matches!(self, Opcode::Recv | Opcode::RecvWriteWithImm)
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The status of a completed work request, numbered as `enum ibv_wc_status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`
    Success,
    /// `IBV_WC_LOC_LEN_ERR`: a receive buffer was smaller than the message.
    LocalLength,
    /// `IBV_WC_LOC_QP_OP_ERR`
    LocalQpOperation,
    /// `IBV_WC_LOC_EEC_OP_ERR`
    LocalEecOperation,
    /// `IBV_WC_LOC_PROT_ERR`: a local buffer was not in a usable memory region.
    LocalProtection,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because the queue pair went to the error state.
    WrFlush,
    /// `IBV_WC_MW_BIND_ERR`
    MwBind,
    /// `IBV_WC_BAD_RESP_ERR`
    BadResponse,
    /// `IBV_WC_LOC_ACCESS_ERR`
    LocalAccess,
    /// `IBV_WC_REM_INV_REQ_ERR`: the peer found the request invalid
    /// (for example a send larger than its posted receive).
    RemoteInvalidRequest,
    /// `IBV_WC_REM_ACCESS_ERR`: bad rkey, out-of-bounds address or missing
    /// remote access right at the peer.
    RemoteAccess,
    /// `IBV_WC_REM_OP_ERR`
    RemoteOperation,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer stopped answering.
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted, for too long.
    RnrRetryExceeded,
    /// `IBV_WC_LOC_RDD_VIOL_ERR`
    LocalRddViolation,
    /// `IBV_WC_REM_INV_RD_REQ_ERR`
    RemoteInvalidRdRequest,
    /// `IBV_WC_REM_ABORT_ERR`
    RemoteAbort,
    /// `IBV_WC_INV_EECN_ERR`
    InvalidEecn,
    /// `IBV_WC_INV_EEC_STATE_ERR`
    InvalidEecState,
    /// `IBV_WC_FATAL_ERR`
    Fatal,
    /// `IBV_WC_RESP_TIMEOUT_ERR`
    ResponseTimeout,
    /// `IBV_WC_GENERAL_ERR`
    General,
    /// A status this crate does not know, with its number.
    Other(u32),
}

impl WcStatus {
    /// Maps the numeric `ibv_wc_status`.
    pub fn from_raw(raw: u32) -> Self {
        use WcStatus::*;
        match raw {
            0 => Success,
            1 => LocalLength,
            2 => LocalQpOperation,
            3 => LocalEecOperation,
            4 => LocalProtection,
            5 => WrFlush,
            6 => MwBind,
            7 => BadResponse,
            8 => LocalAccess,
            9 => RemoteInvalidRequest,
            10 => RemoteAccess,
            11 => RemoteOperation,
            12 => RetryExceeded,
            13 => RnrRetryExceeded,
            14 => LocalRddViolation,
            15 => RemoteInvalidRdRequest,
            16 => RemoteAbort,
            17 => InvalidEecn,
            18 => InvalidEecState,
            19 => Fatal,
            20 => ResponseTimeout,
            21 => General,
            other => Other(other),
        }
    }

    /// The numeric `ibv_wc_status`.
    pub fn to_raw(self) -> u32 {
        use WcStatus::*;
        match self {
            Success => 0,
            LocalLength => 1,
            LocalQpOperation => 2,
            LocalEecOperation => 3,
            LocalProtection => 4,
            WrFlush => 5,
            MwBind => 6,
            BadResponse => 7,
            LocalAccess => 8,
            RemoteInvalidRequest => 9,
            RemoteAccess => 10,
            RemoteOperation => 11,
            RetryExceeded => 12,
            RnrRetryExceeded => 13,
            LocalRddViolation => 14,
            RemoteInvalidRdRequest => 15,
            RemoteAbort => 16,
            InvalidEecn => 17,
            InvalidEecState => 18,
            Fatal => 19,
            ResponseTimeout => 20,
            General => 21,
            Other(n) => n,
        }
    }

    /// The `IBV_WC_*` name.
    pub fn verbs_name(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "IBV_WC_SUCCESS",
            LocalLength => "IBV_WC_LOC_LEN_ERR",
            LocalQpOperation => "IBV_WC_LOC_QP_OP_ERR",
            LocalEecOperation => "IBV_WC_LOC_EEC_OP_ERR",
            LocalProtection => "IBV_WC_LOC_PROT_ERR",
            WrFlush => "IBV_WC_WR_FLUSH_ERR",
            MwBind => "IBV_WC_MW_BIND_ERR",
            BadResponse => "IBV_WC_BAD_RESP_ERR",
            LocalAccess => "IBV_WC_LOC_ACCESS_ERR",
            RemoteInvalidRequest => "IBV_WC_REM_INV_REQ_ERR",
            RemoteAccess => "IBV_WC_REM_ACCESS_ERR",
            RemoteOperation => "IBV_WC_REM_OP_ERR",
            RetryExceeded => "IBV_WC_RETRY_EXC_ERR",
            RnrRetryExceeded => "IBV_WC_RNR_RETRY_EXC_ERR",
            LocalRddViolation => "IBV_WC_LOC_RDD_VIOL_ERR",
            RemoteInvalidRdRequest => "IBV_WC_REM_INV_RD_REQ_ERR",
            RemoteAbort => "IBV_WC_REM_ABORT_ERR",
            InvalidEecn => "IBV_WC_INV_EECN_ERR",
            InvalidEecState => "IBV_WC_INV_EEC_STATE_ERR",
            Fatal => "IBV_WC_FATAL_ERR",
            ResponseTimeout => "IBV_WC_RESP_TIMEOUT_ERR",
            General => "IBV_WC_GENERAL_ERR",
            Other(_) => "unknown status",
        }
    }

    /// A plain-words description.
    pub fn describe(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "success",
            LocalLength => "local length error (message larger than the posted receive)",
            LocalQpOperation => "local queue pair operation error",
            LocalEecOperation => "local EE context operation error",
            LocalProtection => "local protection error (buffer outside its memory region)",
            WrFlush => "flushed: the queue pair is in the error state",
            MwBind => "memory window bind error",
            BadResponse => "bad response from the peer",
            LocalAccess => "local access error",
            RemoteInvalidRequest => "remote invalid request (for example a send larger than the peer's posted receive)",
            RemoteAccess => {
                "remote access error (bad rkey, address outside the peer's region, or access right not granted)"
            }
            RemoteOperation => "remote operation error",
            RetryExceeded => "transport retry counter exceeded: the peer stopped answering",
            RnrRetryExceeded => "receiver-not-ready retry counter exceeded: the peer posted no receive",
            LocalRddViolation => "local RDD violation",
            RemoteInvalidRdRequest => "remote invalid RD request",
            RemoteAbort => "remote aborted",
            InvalidEecn => "invalid EE context number",
            InvalidEecState => "invalid EE context state",
            Fatal => "fatal error",
            ResponseTimeout => "response timeout",
            General => "general error",
            Other(_) => "unknown completion status",
        }
    }

    /// Whether the operation succeeded.
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Other(n) => write!(f, "{} ({n})", self.describe()),
            _ => write!(f, "{} ({})", self.describe(), self.verbs_name()),
        }
    }
}

/// One finished operation, successful or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request id the operation was posted with.
    pub wr_id: u64,
    /// What the operation was.
    pub opcode: Opcode,
    /// How it ended.
    pub status: WcStatus,
    /// Bytes moved: for a receive, the size of the message that arrived.
    pub byte_len: u32,
    /// The immediate of a send or write with immediate, at the receiver.
    pub imm: Option<u32>,
    /// The local queue pair number (0 on transports without one).
    pub qp_num: u32,
    /// The device's own error code, for its vendor's documentation.
    pub vendor_err: u32,
}

impl Completion {
    /// `Ok(self)` when the status is success, else the typed error naming the
    /// status, the work request and the queue pair.
    pub fn result(self) -> Result<Self, CompletionError> {
        if self.status.is_success() {
            Ok(self)
        } else {
            Err(CompletionError {
                status: self.status,
                opcode: self.opcode,
                wr_id: self.wr_id,
                qp_num: self.qp_num,
                vendor_err: self.vendor_err,
            })
        }
    }
}

/// A work request that completed with an error status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{opcode} (work request {wr_id:#x}) on queue pair {qp_num:#x} failed: {status}, vendor error {vendor_err:#x}")]
pub struct CompletionError {
    /// The status the device reported.
    pub status: WcStatus,
    /// The operation that failed.
    pub opcode: Opcode,
    /// Its work request id.
    pub wr_id: u64,
    /// The queue pair it was posted on.
    pub qp_num: u32,
    /// The device's own error code.
    pub vendor_err: u32,
}

/// What a failed operation means, the same on every transport and device.
/// The status a device reports for one condition differs between devices
/// and transports (a receive smaller than its message is `LOC_LEN_ERR` on
/// InfiniBand hardware and on TCP, `LOC_QP_OP_ERR` on soft-RoCE; the
/// sender sees `REM_INV_REQ_ERR` or `REM_OP_ERR`): match on this rather
/// than on [`CompletionError::status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Failure {
    /// A message was longer than the receive posted for it (reported to
    /// both the receiver and the sender).
    MessageTooLong,
    /// The peer refused a remote access: an unknown or withdrawn key, a
    /// range outside its region, or a right it does not grant.
    RemoteAccess,
    /// The peer had no receive posted, for longer than the
    /// receiver-not-ready budget.
    ReceiverNotReady,
    /// The peer stopped answering (transport retries ran out).
    PeerUnreachable,
    /// Not carried out: the connection broke first.
    Flushed,
    /// A local buffer the device could not use.
    LocalProtection,
    /// Anything else: see the status.
    Other,
}

impl CompletionError {
    /// What the failure means, whatever the transport or device.
    pub fn failure(&self) -> Failure {
        use WcStatus as S;
        match (self.status, self.opcode) {
            (S::LocalLength, _) => Failure::MessageTooLong,
            // Soft-RoCE fails a receive too small for its message so.
            (S::LocalQpOperation, Opcode::Recv | Opcode::RecvWriteWithImm) => Failure::MessageTooLong,
            (
                S::RemoteInvalidRequest | S::RemoteOperation,
                Opcode::Send | Opcode::SendWithImm | Opcode::WriteWithImm,
            ) => Failure::MessageTooLong,
            (S::RemoteAccess | S::RemoteInvalidRdRequest, _) => Failure::RemoteAccess,
            (S::RnrRetryExceeded, _) => Failure::ReceiverNotReady,
            (S::RetryExceeded, _) => Failure::PeerUnreachable,
            (S::WrFlush, _) => Failure::Flushed,
            (S::LocalProtection | S::LocalAccess, _) => Failure::LocalProtection,
            _ => Failure::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_condition_has_one_meaning_whatever_the_status() {
        let e = |status, opcode| CompletionError { status, opcode, wr_id: 0, qp_num: 0, vendor_err: 0 };
        for (status, opcode) in [
            (WcStatus::LocalLength, Opcode::Recv),
            (WcStatus::LocalQpOperation, Opcode::Recv),
            (WcStatus::RemoteInvalidRequest, Opcode::Send),
            (WcStatus::RemoteOperation, Opcode::SendWithImm),
            (WcStatus::RemoteOperation, Opcode::WriteWithImm),
        ] {
            assert_eq!(e(status, opcode).failure(), Failure::MessageTooLong, "{status:?} on {opcode:?}");
        }
        assert_eq!(e(WcStatus::RemoteAccess, Opcode::Write).failure(), Failure::RemoteAccess);
        assert_eq!(e(WcStatus::RemoteOperation, Opcode::Read).failure(), Failure::Other, "not a receive too small");
        assert_eq!(e(WcStatus::LocalQpOperation, Opcode::Send).failure(), Failure::Other);
        assert_eq!(e(WcStatus::WrFlush, Opcode::Read).failure(), Failure::Flushed);
    }

    #[test]
    fn status_numbers_round_trip() {
        for raw in 0..40 {
            assert_eq!(WcStatus::from_raw(raw).to_raw(), raw);
        }
        assert_eq!(WcStatus::from_raw(10), WcStatus::RemoteAccess);
        assert_eq!(WcStatus::RemoteAccess.verbs_name(), "IBV_WC_REM_ACCESS_ERR");
    }

    #[test]
    fn error_names_status_request_and_queue_pair() {
        let c = Completion {
            wr_id: 0x2a,
            opcode: Opcode::Write,
            status: WcStatus::RemoteAccess,
            byte_len: 0,
            imm: None,
            qp_num: 0x11,
            vendor_err: 0x88,
        };
        let err = c.result().unwrap_err();
        let text = err.to_string();
        assert!(text.contains("RDMA WRITE"), "{text}");
        assert!(text.contains("0x2a"), "{text}");
        assert!(text.contains("queue pair 0x11"), "{text}");
        assert!(text.contains("IBV_WC_REM_ACCESS_ERR"), "{text}");
        let ok = Completion { status: WcStatus::Success, ..c };
        assert_eq!(ok.result(), Ok(ok));
    }
}
