//! Reliable-connected queue pairs (`ibv_qp`): creation, the
//! RESET -> INIT -> RTR -> RTS transition, and posting.

use std::fmt;
use std::io;
use std::ptr::NonNull;

use rdma_sys as ffi;

use super::loader::ibverbs;

use super::context::DeviceAttr;
use super::cq::CompletionQueue;
use super::mr::to_ibv_access;
use super::pd::ProtectionDomain;
use super::port::{Gid, LinkLayer, Mtu};
use super::result::{self, zeroed};
use super::wr::{RecvWr, SendOp, SendWr, Sge};
use crate::access::Access;
use crate::error::{Error, Result};

/// Queue sizes asked for at creation; the device may round them up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send-queue requests.
    pub max_send_wr: u32,
    /// Outstanding receive-queue requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 }
    }
}

/// A queue pair's state (`enum ibv_qp_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Just created, or reset.
    Reset,
    /// Initialized: receives may be posted.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send: fully connected.
    ReadyToSend,
    /// Send queue drained.
    SendQueueDrained,
    /// Send queue error.
    SendQueueError,
    /// Error: every outstanding request is flushed.
    Error,
    /// Unknown.
    Unknown(u32),
}

impl QpState {
    fn from_raw(raw: u32) -> Self {
        use ffi::ibv_qp_state as s;
        match raw {
            s::IBV_QPS_RESET => QpState::Reset,
            s::IBV_QPS_INIT => QpState::Init,
            s::IBV_QPS_RTR => QpState::ReadyToReceive,
            s::IBV_QPS_RTS => QpState::ReadyToSend,
            s::IBV_QPS_SQD => QpState::SendQueueDrained,
            s::IBV_QPS_SQE => QpState::SendQueueError,
            s::IBV_QPS_ERR => QpState::Error,
            n => QpState::Unknown(n),
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QpState::Reset => f.write_str("RESET"),
            QpState::Init => f.write_str("INIT"),
            QpState::ReadyToReceive => f.write_str("RTR"),
            QpState::ReadyToSend => f.write_str("RTS"),
            QpState::SendQueueDrained => f.write_str("SQD"),
            QpState::SendQueueError => f.write_str("SQE"),
            QpState::Error => f.write_str("ERR"),
            QpState::Unknown(n) => write!(f, "state {n}"),
        }
    }
}

/// How to reach the peer's queue pair, and how to treat it:
/// the INIT -> RTR attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtrAttr {
    /// Local port.
    pub port: u8,
    /// Path MTU: no larger than either end's active MTU.
    pub path_mtu: Mtu,
    /// The peer's queue pair number.
    pub dest_qp_num: u32,
    /// The first packet sequence number expected from the peer (24 bits).
    pub rq_psn: u32,
    /// Reads and atomics the peer may have outstanding at this queue pair.
    pub max_dest_rd_atomic: u8,
    /// Receiver-not-ready NAK timer code (0..=31).
    pub min_rnr_timer: u8,
    /// The peer's LID (InfiniBand).
    pub dest_lid: u16,
    /// The peer's GID (RoCE, or InfiniBand across subnets).
    pub dest_gid: Gid,
    /// Route by GID (required on RoCE).
    pub is_global: bool,
    /// Index of the local GID to send from.
    pub sgid_index: u8,
    /// Hop limit for routed (global) packets.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Service level.
    pub service_level: u8,
}

/// The RTR -> RTS attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttr {
    /// The first packet sequence number this side sends (24 bits).
    pub sq_psn: u32,
    /// Local ACK timeout code: 4.096 us * 2^timeout (0..=31; 14 is about 67 ms).
    pub timeout: u8,
    /// Transport retries before an error completion (0..=7).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (0..=7; 7 means forever).
    pub rnr_retry: u8,
    /// Reads and atomics this side may have outstanding.
    pub max_rd_atomic: u8,
}

/// Builds a reliable-connected queue pair.
#[derive(Debug)]
pub struct QueuePairBuilder<'a> {
    pd: &'a ProtectionDomain,
    send_cq: &'a CompletionQueue,
    recv_cq: &'a CompletionQueue,
    caps: QpCaps,
}

impl<'a> QueuePairBuilder<'a> {
    /// A builder with default capacities.
    pub fn new(pd: &'a ProtectionDomain, send_cq: &'a CompletionQueue, recv_cq: &'a CompletionQueue) -> Self {
        QueuePairBuilder { pd, send_cq, recv_cq, caps: QpCaps::default() }
    }

    /// Sets the capacities to ask for.
    pub fn caps(mut self, caps: QpCaps) -> Self {
        self.caps = caps;
        self
    }

    /// `ibv_create_qp`: the queue pair starts in RESET.
    ///
    /// # Errors
    /// [`Error::Verbs`] (for example `EINVAL` when a capacity exceeds the
    /// device's limits).
    pub fn build(self) -> Result<QueuePair> {
        let mut init: ffi::ibv_qp_init_attr = zeroed();
        init.send_cq = self.send_cq.as_raw();
        init.recv_cq = self.recv_cq.as_raw();
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap = ffi::ibv_qp_cap {
            max_send_wr: self.caps.max_send_wr,
            max_recv_wr: self.caps.max_recv_wr,
            max_send_sge: self.caps.max_send_sge,
            max_recv_sge: self.caps.max_recv_sge,
            max_inline_data: self.caps.max_inline_data,
        };
        // SAFETY: valid PD and CQs; `init` is fully initialized; the QP is
        // destroyed in Drop and keeps the PD and CQs alive until then.
        let qp = unsafe { (ibverbs()?.ibv_create_qp)(self.pd.as_raw(), &mut init) };
        let qp = result::nonnull(qp, "ibv_create_qp")?;
        let caps = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        let device = self.pd.context().query_device()?;
        Ok(QueuePair {
            qp,
            caps,
            state: QpState::Reset,
            device,
            send_wrs: Vec::with_capacity(16),
            recv_wrs: Vec::with_capacity(16),
            _send_cq: self.send_cq.clone(),
            _recv_cq: self.recv_cq.clone(),
            pd: self.pd.clone(),
        })
    }
}

/// A reliable-connected queue pair.
///
/// Posting takes `&mut self`: one thread posts at a time, which is also what
/// lets posting reuse its scratch space without locks or allocation.
pub struct QueuePair {
    qp: NonNull<ffi::ibv_qp>,
    caps: QpCaps,
    state: QpState,
    device: DeviceAttr,
    send_wrs: Vec<ffi::ibv_send_wr>,
    recv_wrs: Vec<ffi::ibv_recv_wr>,
    // Destroyed after the QP (fields drop after Drop::drop runs).
    _send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
    pd: ProtectionDomain,
}

// SAFETY: the QP handle may be used from any thread; the scratch vectors hold
// no live pointers between calls (they are cleared after each post).
unsafe impl Send for QueuePair {}
// SAFETY: `&self` methods only read immutable fields or call thread-safe verbs
// (ibv_query_qp).
unsafe impl Sync for QueuePair {}

/// A post that failed part-way: the first `posted` requests were accepted
/// and will complete; the rest were not.
#[derive(Debug)]
pub struct PostError {
    /// Requests accepted before the failing one.
    pub posted: usize,
    /// Why the next one was refused.
    pub error: Error,
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Self {
        e.error
    }
}

const PSN_MASK: u32 = 0x00ff_ffff;

/// How many requests of a chain starting at `base` (of `len`) come before
/// `bad`, the one a failed post points at: those were posted.
fn chain_position<T>(base: *const T, bad: *const T, len: usize) -> usize {
    if bad.is_null() {
        return 0;
    }
    let offset = (bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<T>();
    offset.min(len)
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

impl QueuePair {
    /// The queue pair number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: live QP; qp_num is immutable.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    /// The capacities the device granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The state as last set through this value.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// The state as the device reports it now (`ibv_query_qp`): it moves to
    /// ERR by itself after an error completion.
    ///
    /// # Errors
    /// [`Error::Verbs`].
    pub fn query_state(&self) -> Result<QpState> {
        let mut attr: ffi::ibv_qp_attr = zeroed();
        let mut init: ffi::ibv_qp_init_attr = zeroed();
        // SAFETY: live QP and valid out-pointers.
        let rc = unsafe {
            (ibverbs()?.ibv_query_qp)(
                self.qp.as_ptr(),
                &mut attr,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        result::errno_rc(rc, "ibv_query_qp")?;
        Ok(QpState::from_raw(attr.qp_state))
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The raw handle.
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.qp.as_ptr()
    }

    fn modify(
        &mut self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        transition: &'static str,
        to: QpState,
        detail: impl FnOnce() -> String,
    ) -> Result<()> {
        // SAFETY: live QP; `attr` is initialized for every bit in `mask`.
        let rc = unsafe { (ibverbs()?.ibv_modify_qp)(self.qp.as_ptr(), attr, mask.0 as i32) };
        match result::errno_rc(rc, "ibv_modify_qp") {
            Ok(()) => {
                self.state = to;
                Ok(())
            }
            Err(Error::Verbs { source, .. } | Error::NotSupported { source, .. }) => {
                Err(Error::ModifyQp { qp_num: self.qp_num(), transition, attribute: None, detail: detail(), source })
            }
            Err(e) => Err(e),
        }
    }

    fn bad_attr(&self, transition: &'static str, attribute: &'static str, detail: String) -> Error {
        Error::ModifyQp { qp_num: self.qp_num(), transition, attribute: Some(attribute), detail, source: einval() }
    }

    /// RESET -> INIT on `port`, allowing peers the `remote` rights on this
    /// queue pair (regions still need their own rights).
    ///
    /// # Errors
    /// [`Error::ModifyQp`] naming the attribute when the port does not exist
    /// or is not active.
    pub fn init(&mut self, port: u8, remote: Access) -> Result<()> {
        const T: &str = "RESET->INIT";
        if port == 0 || port > self.device.phys_port_cnt {
            return Err(self.bad_attr(
                T,
                "port_num",
                format!("port {port} does not exist (the device has {})", self.device.phys_port_cnt),
            ));
        }
        let pattr = self.pd.context().query_port(port)?;
        if !pattr.is_active() {
            return Err(self.bad_attr(T, "port_num", format!("port {port} is {}, not PORT_ACTIVE", pattr.state)));
        }
        let mut attr: ffi::ibv_qp_attr = zeroed();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.port_num = port;
        attr.pkey_index = 0;
        attr.qp_access_flags =
            to_ibv_access(remote & (Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)) as u32;
        use ffi::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut attr, mask, T, QpState::Init, || format!("port_num={port} pkey_index=0 access={remote:?}"))
    }

    /// INIT -> RTR. Checks each attribute against the device and port first
    /// and names the one that is wrong.
    ///
    /// # Errors
    /// [`Error::ModifyQp`].
    pub fn ready_to_receive(&mut self, rtr: &RtrAttr) -> Result<()> {
        const T: &str = "INIT->RTR";
        let pattr = self.pd.context().query_port(rtr.port)?;
        if rtr.path_mtu > pattr.active_mtu {
            return Err(self.bad_attr(
                T,
                "path_mtu",
                format!("path MTU {} is larger than port {}'s active MTU {}", rtr.path_mtu, rtr.port, pattr.active_mtu),
            ));
        }
        if rtr.dest_qp_num == 0 || rtr.dest_qp_num > PSN_MASK {
            return Err(self.bad_attr(
                T,
                "dest_qp_num",
                format!("{:#x} is not a valid queue pair number", rtr.dest_qp_num),
            ));
        }
        if rtr.rq_psn > PSN_MASK {
            return Err(self.bad_attr(T, "rq_psn", format!("{:#x} does not fit in 24 bits", rtr.rq_psn)));
        }
        if u32::from(rtr.max_dest_rd_atomic) > self.device.max_qp_rd_atom {
            return Err(self.bad_attr(
                T,
                "max_dest_rd_atomic",
                format!(
                    "{} exceeds the device's max_qp_rd_atom {}",
                    rtr.max_dest_rd_atomic, self.device.max_qp_rd_atom
                ),
            ));
        }
        if rtr.min_rnr_timer > 31 {
            return Err(self.bad_attr(T, "min_rnr_timer", format!("{} is above 31", rtr.min_rnr_timer)));
        }
        if pattr.link_layer == LinkLayer::Ethernet && !rtr.is_global {
            return Err(self.bad_attr(
                T,
                "ah_attr.is_global",
                "RoCE (Ethernet) ports address peers by GID: is_global must be set".into(),
            ));
        }
        if rtr.is_global {
            if u32::from(rtr.sgid_index) >= pattr.gid_tbl_len {
                return Err(self.bad_attr(
                    T,
                    "ah_attr.grh.sgid_index",
                    format!(
                        "GID index {} is outside port {}'s table of {}",
                        rtr.sgid_index, rtr.port, pattr.gid_tbl_len
                    ),
                ));
            }
            let gid = self.pd.context().query_gid(rtr.port, u32::from(rtr.sgid_index));
            if gid.map(|g| g.is_zero()).unwrap_or(true) {
                return Err(self.bad_attr(
                    T,
                    "ah_attr.grh.sgid_index",
                    format!("GID index {} of port {} is empty", rtr.sgid_index, rtr.port),
                ));
            }
            if rtr.dest_gid.is_zero() {
                return Err(self.bad_attr(T, "ah_attr.grh.dgid", "the peer's GID is all zero".into()));
            }
        } else if rtr.dest_lid == 0 {
            return Err(self.bad_attr(T, "ah_attr.dlid", "LID 0 on a LID-routed path".into()));
        }

        let mut attr: ffi::ibv_qp_attr = zeroed();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = rtr.path_mtu.to_raw();
        attr.dest_qp_num = rtr.dest_qp_num;
        attr.rq_psn = rtr.rq_psn;
        attr.max_dest_rd_atomic = rtr.max_dest_rd_atomic;
        attr.min_rnr_timer = rtr.min_rnr_timer;
        attr.ah_attr.dlid = rtr.dest_lid;
        attr.ah_attr.sl = rtr.service_level;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = rtr.port;
        attr.ah_attr.is_global = u8::from(rtr.is_global);
        if rtr.is_global {
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: rtr.dest_gid.raw() };
            attr.ah_attr.grh.sgid_index = rtr.sgid_index;
            attr.ah_attr.grh.hop_limit = rtr.hop_limit;
            attr.ah_attr.grh.traffic_class = rtr.traffic_class;
            attr.ah_attr.grh.flow_label = 0;
        }
        use ffi::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, T, QpState::ReadyToReceive, || {
            format!(
                "path_mtu={} dest_qp_num={:#x} rq_psn={:#x} max_dest_rd_atomic={} min_rnr_timer={} dlid={} dgid={} is_global={} sgid_index={} port={}",
                rtr.path_mtu, rtr.dest_qp_num, rtr.rq_psn, rtr.max_dest_rd_atomic, rtr.min_rnr_timer,
                rtr.dest_lid, rtr.dest_gid, rtr.is_global, rtr.sgid_index, rtr.port
            )
        })
    }

    /// RTR -> RTS. Checks each attribute first and names the one that is wrong.
    ///
    /// # Errors
    /// [`Error::ModifyQp`].
    pub fn ready_to_send(&mut self, rts: &RtsAttr) -> Result<()> {
        const T: &str = "RTR->RTS";
        if rts.sq_psn > PSN_MASK {
            return Err(self.bad_attr(T, "sq_psn", format!("{:#x} does not fit in 24 bits", rts.sq_psn)));
        }
        if rts.timeout > 31 {
            return Err(self.bad_attr(T, "timeout", format!("{} is above 31", rts.timeout)));
        }
        if rts.retry_cnt > 7 {
            return Err(self.bad_attr(T, "retry_cnt", format!("{} is above 7", rts.retry_cnt)));
        }
        if rts.rnr_retry > 7 {
            return Err(self.bad_attr(T, "rnr_retry", format!("{} is above 7", rts.rnr_retry)));
        }
        if u32::from(rts.max_rd_atomic) > self.device.max_qp_init_rd_atom {
            return Err(self.bad_attr(
                T,
                "max_rd_atomic",
                format!(
                    "{} exceeds the device's max_qp_init_rd_atom {}",
                    rts.max_rd_atomic, self.device.max_qp_init_rd_atom
                ),
            ));
        }
        let mut attr: ffi::ibv_qp_attr = zeroed();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = rts.sq_psn;
        attr.timeout = rts.timeout;
        attr.retry_cnt = rts.retry_cnt;
        attr.rnr_retry = rts.rnr_retry;
        attr.max_rd_atomic = rts.max_rd_atomic;
        use ffi::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, T, QpState::ReadyToSend, || {
            format!(
                "sq_psn={:#x} timeout={} retry_cnt={} rnr_retry={} max_rd_atomic={}",
                rts.sq_psn, rts.timeout, rts.retry_cnt, rts.rnr_retry, rts.max_rd_atomic
            )
        })
    }

    /// Moves to ERR: every outstanding request completes with
    /// [`WcStatus::WrFlush`](crate::WcStatus::WrFlush), and the device stops
    /// touching their memory once they have.
    ///
    /// # Errors
    /// [`Error::ModifyQp`].
    pub fn set_error(&mut self) -> Result<()> {
        let mut attr: ffi::ibv_qp_attr = zeroed();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE, "->ERR", QpState::Error, String::new)
    }

    /// Posts send-queue requests, chained into one doorbell.
    ///
    /// Inline requests larger than the inline limit are refused before
    /// anything is posted.
    ///
    /// # Safety
    /// Until each request completes (or the queue pair is destroyed, or moved
    /// to ERR and the request flushed), every scatter/gather entry of a
    /// non-inline request must name memory that
    /// - stays allocated and mapped at that address,
    /// - lies inside a live memory region of this queue pair's protection
    ///   domain with that lkey (else the request fails, which is safe, but
    ///   the memory rule still applies to what the lkey covers),
    /// - is not written by anyone else (for sends and writes, which read
    ///   it), and not read or written by anyone else (for reads, which write
    ///   it).
    ///
    /// An unsignaled request is complete once a later signaled request on
    /// this queue pair completes.
    ///
    /// # Errors
    /// [`PostError`], saying how many requests were posted before the one
    /// the provider refused (`ENOMEM`: send queue full; `EINVAL`: a bad
    /// request); [`Error::ExceedsQpCaps`], with none posted, for a request
    /// past the queue pair's inline or scatter/gather limits.
    pub unsafe fn post_send<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> std::result::Result<(), PostError> {
        let mut wrs = wrs.into_iter();
        let Some(first) = wrs.next() else { return Ok(()) };
        let Some(second) = wrs.next() else {
            // SAFETY: the caller's guarantee for this request, as above.
            return unsafe { self.post_send_one(&first) };
        };
        let mut raw: ffi::ibv_send_wr = zeroed();
        fill_send_wr(&self.caps, 0, &first, &mut raw)?;
        self.send_wrs.clear();
        self.send_wrs.push(raw);
        for (i, wr) in std::iter::once(second).chain(wrs).enumerate() {
            self.send_wrs.push(zeroed());
            let last = self.send_wrs.last_mut().expect("just pushed");
            if let Err(e) = fill_send_wr(&self.caps, i + 1, &wr, last) {
                self.send_wrs.clear();
                return Err(e);
            }
        }
        let base = self.send_wrs.as_mut_ptr();
        for i in 0..self.send_wrs.len() - 1 {
            // SAFETY: `i + 1 < len`: both pointers are inside the vector, which is
            // not resized until the post below returns.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; the chain points into `send_wrs` and the caller's
        // scatter lists, all valid for this call; the caller guarantees the
        // memory they name per the contract above.
        let rc = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), base, &mut bad) };
        let posted = chain_position(base, bad, self.send_wrs.len());
        let outcome = result::errno_rc(rc, "ibv_post_send").map_err(|error| PostError { posted, error });
        self.send_wrs.clear();
        outcome
    }

    /// Posts one send-queue request: [`post_send`](Self::post_send) for
    /// the common case, built on the stack with no chain to link.
    ///
    /// # Safety
    /// As [`post_send`](Self::post_send), for `wr`.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    #[inline(always)]
    pub unsafe fn post_send_one(&mut self, wr: &SendWr<'_>) -> std::result::Result<(), PostError> {
        let mut raw: ffi::ibv_send_wr = zeroed();
        fill_send_wr(&self.caps, 0, wr, &mut raw)?;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; `raw` and the caller's scatter list are valid for
        // this call; the caller guarantees the memory they name per the
        // contract of `post_send`.
        let rc = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut raw, &mut bad) };
        result::errno_rc(rc, "ibv_post_send").map_err(|error| PostError { posted: 0, error })
    }

    /// Posts one send (with immediate `imm`, if given) whose data goes
    /// inline: the provider copies `data` into the send queue during this
    /// call and the device never reads it from memory, so this is safe and
    /// `data` may be reused as soon as it returns. Empty data posts a send
    /// with no scatter entry. Signaled or not, as `signaled` says (an
    /// unsignaled request reports only a failure).
    ///
    /// # Errors
    /// [`PostError`]: `data` longer than the queue pair's inline limit
    /// ([`Error::ExceedsQpCaps`]), or the provider's refusal.
    #[inline(always)]
    pub fn post_send_inline(
        &mut self,
        wr_id: u64,
        data: &[u8],
        imm: Option<u32>,
        signaled: bool,
    ) -> std::result::Result<(), PostError> {
        let op = match imm {
            Some(imm) => SendOp::SendWithImm(imm),
            None => SendOp::Send,
        };
        if data.len() > self.caps.max_inline_data as usize {
            return Err(refused_inline(&self.caps, 0, data.len() as u64, op));
        }
        // lkey 0 is never used: inline data is copied at post time.
        let sge = (!data.is_empty()).then(|| Sge::new(data.as_ptr() as u64, data.len() as u32, 0));
        // SAFETY: the one entry (if any) goes inline, within the limit
        // checked above: the provider copies its bytes out of `data`, valid
        // for this call, before returning, and the device never references
        // that memory afterwards.
        unsafe { self.post_send_sge(wr_id, op, sge, sge.is_some(), signaled) }
    }

    /// Posts one send-queue request with at most one scatter entry, built
    /// straight into the provider's request: [`post_send_one`](Self::post_send_one)
    /// without a [`SendWr`] to build and check first. `inline` copies the
    /// entry's bytes at post time; `signaled` asks for a completion on
    /// success.
    ///
    /// # Safety
    /// As [`post_send`](Self::post_send), for the memory `sge` names
    /// (nothing, once the call returns, for an inline entry).
    ///
    /// # Errors
    /// [`PostError`]: an inline entry past the inline limit or for a read
    /// ([`Error::ExceedsQpCaps`]), or the provider's refusal.
    #[inline(always)]
    pub unsafe fn post_send_sge(
        &mut self,
        wr_id: u64,
        op: SendOp,
        mut sge: Option<Sge>,
        inline: bool,
        signaled: bool,
    ) -> std::result::Result<(), PostError> {
        use ffi::ibv_send_flags as fl;
        let len = sge.map_or(0, |s| s.len());
        if inline && (op.writes_local() || len > self.caps.max_inline_data) {
            return Err(refused_inline(&self.caps, 0, u64::from(len), op));
        }
        let mut raw: ffi::ibv_send_wr = zeroed();
        raw.wr_id = wr_id;
        if let Some(s) = sge.as_mut() {
            raw.sg_list = &mut s.0;
            raw.num_sge = 1;
        }
        raw.send_flags =
            if inline { fl::IBV_SEND_INLINE.0 } else { 0 } | if signaled { fl::IBV_SEND_SIGNALED.0 } else { 0 };
        fill_send_op(op, &mut raw);
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; `raw` and `sge` outlive the call; the caller
        // guarantees the memory the entry names per the contract of
        // `post_send` (an inline entry is copied during the call).
        let rc = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut raw, &mut bad) };
        result::errno_rc(rc, "ibv_post_send").map_err(|error| PostError { posted: 0, error })
    }

    /// Posts one receive request: [`post_recv`](Self::post_recv) for the
    /// common case, with no chain to link.
    ///
    /// # Safety
    /// As [`post_recv`](Self::post_recv), for `wr`.
    ///
    /// # Errors
    /// As [`post_recv`](Self::post_recv).
    #[inline(always)]
    pub unsafe fn post_recv_one(&mut self, wr: &RecvWr<'_>) -> std::result::Result<(), PostError> {
        let mut raw = raw_recv_wr(&self.caps, 0, wr)?;
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; `raw` and its scatter list are valid for this
        // call; the caller guarantees the memory per the contract of `post_recv`.
        let rc = unsafe { ffi::ibv_post_recv(self.qp.as_ptr(), &mut raw, &mut bad) };
        result::errno_rc(rc, "ibv_post_recv").map_err(|error| PostError { posted: 0, error })
    }

    /// Posts receive requests, chained.
    ///
    /// # Safety
    /// Until each request completes (or is flushed), its scatter/gather
    /// entries must name memory that stays allocated at that address, lies
    /// in a live memory region of this protection domain with `LOCAL_WRITE`,
    /// and is neither read nor written by anyone else: the device writes it
    /// when a message arrives.
    ///
    /// # Errors
    /// [`PostError`]: the provider's refusal, or [`Error::ExceedsQpCaps`]
    /// for a request with more scatter/gather entries than the queue pair
    /// takes (none of those after it posted).
    pub unsafe fn post_recv<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = RecvWr<'a>>,
    ) -> std::result::Result<(), PostError> {
        let mut wrs = wrs.into_iter();
        let Some(first) = wrs.next() else { return Ok(()) };
        let Some(second) = wrs.next() else {
            // SAFETY: the caller's guarantee for this request, as above.
            return unsafe { self.post_recv_one(&first) };
        };
        let raw = raw_recv_wr(&self.caps, 0, &first)?;
        self.recv_wrs.clear();
        self.recv_wrs.push(raw);
        for (i, wr) in std::iter::once(second).chain(wrs).enumerate() {
            match raw_recv_wr(&self.caps, i + 1, &wr) {
                Ok(raw) => self.recv_wrs.push(raw),
                Err(e) => {
                    self.recv_wrs.clear();
                    return Err(e);
                }
            }
        }
        let base = self.recv_wrs.as_mut_ptr();
        for i in 0..self.recv_wrs.len() - 1 {
            // SAFETY: both pointers are inside the vector, not resized until the post returns.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; the chain and scatter lists are valid for this call;
        // the caller guarantees the memory per the contract above.
        let rc = unsafe { ffi::ibv_post_recv(self.qp.as_ptr(), base, &mut bad) };
        let posted = chain_position(base, bad, self.recv_wrs.len());
        let outcome = result::errno_rc(rc, "ibv_post_recv").map_err(|error| PostError { posted, error });
        self.recv_wrs.clear();
        outcome
    }
}

/// Why request `i` (`len` bytes of `op`) cannot go inline: too long, or a read.
#[cold]
#[inline(never)]
fn refused_inline(caps: &QpCaps, i: usize, len: u64, op: SendOp) -> PostError {
    let (what, max) = match op {
        SendOp::Read { .. } => ("bytes inline in a read (which cannot be inline)", 0),
        _ => ("bytes inline", u64::from(caps.max_inline_data)),
    };
    PostError { posted: 0, error: Error::ExceedsQpCaps { request: "work request", index: i, what, got: len, max } }
}

/// Why `what` `i` cannot be posted: more scatter/gather entries than the
/// queue pair takes.
#[cold]
#[inline(never)]
fn refused_sges(request: &'static str, i: usize, sges: usize, max: u32) -> PostError {
    PostError {
        posted: 0,
        error: Error::ExceedsQpCaps {
            request,
            index: i,
            what: "scatter/gather entries",
            got: sges as u64,
            max: u64::from(max),
        },
    }
}

/// Request `i` of a post as the provider takes it, checked against
/// this queue pair's limits (nothing is posted when one fails).
/// Fills `raw` (zeroed) with it.
#[inline(always)]
fn fill_send_wr(
    caps: &QpCaps,
    i: usize,
    wr: &SendWr<'_>,
    raw: &mut ffi::ibv_send_wr,
) -> std::result::Result<(), PostError> {
    if wr.inline && (wr.op.writes_local() || wr.total_len() > u64::from(caps.max_inline_data)) {
        return Err(refused_inline(caps, i, wr.total_len(), wr.op));
    }
    if wr.sges.len() > caps.max_send_sge as usize {
        return Err(refused_sges("work request", i, wr.sges.len(), caps.max_send_sge));
    }
    raw.wr_id = wr.wr_id;
    raw.sg_list = wr.sges.as_ptr() as *mut ffi::ibv_sge;
    raw.num_sge = wr.sges.len() as libc::c_int;
    raw.send_flags = wr.raw_flags();
    fill_send_op(wr.op, raw);
    Ok(())
}

/// A request's operation as the provider takes it: its opcode, remote
/// address and key, immediate (network order).
#[inline(always)]
fn fill_send_op(op: SendOp, raw: &mut ffi::ibv_send_wr) {
    raw.opcode = op.raw_opcode();
    match op {
        SendOp::Send => {}
        SendOp::SendWithImm(imm) => raw.imm_data_invalidated_rkey_union.imm_data = imm.to_be(),
        SendOp::Write { remote_addr, rkey } | SendOp::Read { remote_addr, rkey } => {
            raw.wr.rdma = ffi::rdma_t { remote_addr, rkey };
        }
        SendOp::WriteWithImm { remote_addr, rkey, imm } => {
            raw.wr.rdma = ffi::rdma_t { remote_addr, rkey };
            raw.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
    }
}

/// Receive request `i` of a post as the provider takes it, checked
/// against the queue pair's limits (nothing is posted when one fails).
#[inline(always)]
fn raw_recv_wr(caps: &QpCaps, i: usize, wr: &RecvWr<'_>) -> std::result::Result<ffi::ibv_recv_wr, PostError> {
    if wr.sges.len() > caps.max_recv_sge as usize {
        return Err(refused_sges("receive request", i, wr.sges.len(), caps.max_recv_sge));
    }
    let mut raw: ffi::ibv_recv_wr = zeroed();
    raw.wr_id = wr.wr_id;
    raw.sg_list = wr.sges.as_ptr() as *mut ffi::ibv_sge;
    raw.num_sge = wr.sges.len() as libc::c_int;
    Ok(raw)
}

impl QueuePair {
    fn destroy_raw(&mut self) -> Result<()> {
        // SAFETY: created by ibv_create_qp; callers make sure this runs once.
        // After it succeeds the device no longer processes any of the queue
        // pair's requests, so their memory may go.
        let rc = unsafe { (ibverbs()?.ibv_destroy_qp)(self.qp.as_ptr()) };
        result::errno_rc(rc, "ibv_destroy_qp")
    }

    /// Destroys the queue pair, reporting failure. When this fails the
    /// device may still process its requests: the caller must not free the
    /// memory they name (leak it instead).
    ///
    /// # Errors
    /// [`Error::Verbs`] from `ibv_destroy_qp`.
    pub fn destroy(self) -> Result<()> {
        let mut this = std::mem::ManuallyDrop::new(self);
        let outcome = this.destroy_raw();
        // SAFETY: `this` is never used again and its Drop does not run; each
        // remaining field is dropped exactly once here, CQs and PD after the QP.
        unsafe {
            std::ptr::drop_in_place(&mut this.device);
            std::ptr::drop_in_place(&mut this.send_wrs);
            std::ptr::drop_in_place(&mut this.recv_wrs);
            std::ptr::drop_in_place(&mut this._send_cq);
            std::ptr::drop_in_place(&mut this._recv_cq);
            std::ptr::drop_in_place(&mut this.pd);
        }
        outcome
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_raw() {
            tracing::error!("queue pair: {e}");
        }
    }
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &format_args!("{:#x}", self.qp_num()))
            .field("state", &self.state)
            .field("caps", &self.caps)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::wr::Sge;

    /// The limits a queue pair was made with are checked before anything is
    /// posted, each refusal typed with what it has too many of.
    #[test]
    fn requests_past_the_queue_pairs_limits_are_refused_typed() {
        let caps = QpCaps { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 2, max_recv_sge: 1, max_inline_data: 64 };
        let sges = [Sge::new(0x1000, 40, 1), Sge::new(0x2000, 40, 1), Sge::new(0x3000, 8, 1)];
        let refused = |wr: SendWr<'_>| {
            let mut raw: ffi::ibv_send_wr = zeroed();
            fill_send_wr(&caps, 3, &wr, &mut raw).map(|()| raw.wr_id).map_err(|e| (e.posted, e.error))
        };
        assert!(matches!(refused(SendWr::new(7, SendOp::Send, &sges[..1]).inline(true)), Ok(7)), "40 bytes fit inline");
        match refused(SendWr::new(7, SendOp::Send, &sges[..2]).inline(true)) {
            Err((
                0,
                Error::ExceedsQpCaps { request: "work request", index: 3, what: "bytes inline", got: 80, max: 64 },
            )) => {}
            other => panic!("{other:?}"),
        }
        let read = SendOp::Read { remote_addr: 0, rkey: 1 };
        match refused(SendWr::new(7, read, &sges[..1]).inline(true)) {
            Err((0, Error::ExceedsQpCaps { got: 40, max: 0, what, .. })) => assert!(what.contains("read"), "{what}"),
            other => panic!("{other:?}"),
        }
        match refused(SendWr::new(7, SendOp::Send, &sges)) {
            Err((0, e @ Error::ExceedsQpCaps { what: "scatter/gather entries", got: 3, max: 2, .. })) => {
                assert_eq!(e.to_string(), "work request 3: 3 scatter/gather entries, and the queue pair takes 2");
            }
            other => panic!("{other:?}"),
        }
        let recv = RecvWr::new(9, &sges[..2]);
        match raw_recv_wr(&caps, 0, &recv).map(|raw| raw.wr_id).map_err(|e| e.error) {
            Err(Error::ExceedsQpCaps { request: "receive request", got: 2, max: 1, .. }) => {}
            other => panic!("{other:?}"),
        }
    }
}
