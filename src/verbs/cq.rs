//! Completion queues (`ibv_cq`) and completion channels (`ibv_comp_channel`).

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use rdma_sys as ffi;

use super::loader::ibverbs;

use super::context::Context;
use super::result;
use crate::completion::WcStatus;
use crate::error::{Error, Result};

/// A completion channel: a file descriptor that becomes readable when an
/// armed completion queue gets a completion, so a thread can sleep instead
/// of spinning. Its descriptor is non-blocking.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

struct ChannelInner {
    ch: NonNull<ffi::ibv_comp_channel>,
    ctx: Context,
}

// SAFETY: the channel is an fd plus immutable bookkeeping; ibv_get_cq_event is
// thread-safe (it reads the fd).
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        let lib = match ibverbs() {
            Ok(lib) => lib,
            Err(e) => return tracing::error!("cannot destroy a completion channel: {e}"),
        };
        // SAFETY: created by ibv_create_comp_channel; every CQ using it holds an
        // Arc of this and is already destroyed.
        let rc = unsafe { (lib.ibv_destroy_comp_channel)(self.ch.as_ptr()) };
        if let Err(e) = result::errno_rc(rc, "ibv_destroy_comp_channel") {
            tracing::error!(device = self.ctx.name(), "{e}");
        }
    }
}

impl CompletionChannel {
    /// `ibv_create_comp_channel`, with its descriptor set non-blocking.
    ///
    /// # Errors
    /// [`Error::Verbs`].
    pub fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: valid context; destroyed in Drop.
        let ch = unsafe { (ibverbs()?.ibv_create_comp_channel)(ctx.as_raw()) };
        let ch = result::nonnull(ch, "ibv_create_comp_channel")?;
        let chan = CompletionChannel { inner: Arc::new(ChannelInner { ch, ctx: ctx.clone() }) };
        let fd = chan.fd();
        // SAFETY: fcntl on a descriptor owned by the live channel.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(Error::Verbs {
                op: "fcntl(O_NONBLOCK) on the completion channel",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(chan)
    }

    /// Its file descriptor (owned by the channel).
    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is live; `fd` is immutable after creation.
        unsafe { (*self.inner.ch.as_ptr()).fd }
    }

    /// The raw handle.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.ch.as_ptr()
    }
}

impl AsFd for CompletionChannel {
    /// Its descriptor, borrowed for as long as the channel is.
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor belongs to the channel, which stays open
        // (is not destroyed) while `self` is borrowed: the `Arc` this handle
        // holds keeps it alive at least that long.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel").field("fd", &self.fd()).finish()
    }
}

/// The opcode field of a work completion (`enum ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// `IBV_WC_SEND`
    Send,
    /// `IBV_WC_RDMA_WRITE`
    RdmaWrite,
    /// `IBV_WC_RDMA_READ`
    RdmaRead,
    /// `IBV_WC_COMP_SWAP`
    CompSwap,
    /// `IBV_WC_FETCH_ADD`
    FetchAdd,
    /// `IBV_WC_RECV`
    Recv,
    /// `IBV_WC_RECV_RDMA_WITH_IMM`
    RecvRdmaWithImm,
    /// Another value (also: undefined on error completions).
    Other(u32),
}

impl WcOpcode {
    fn from_raw(raw: u32) -> Self {
        use ffi::ibv_wc_opcode as op;
        match raw {
            op::IBV_WC_SEND => WcOpcode::Send,
            op::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            op::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            op::IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
            op::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            op::IBV_WC_RECV => WcOpcode::Recv,
            op::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            other => WcOpcode::Other(other),
        }
    }
}

/// One polled work completion, copied out of `struct ibv_wc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id the work request was posted with.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was (only meaningful on success).
    pub opcode: WcOpcode,
    /// The device's own error code.
    pub vendor_err: u32,
    /// Bytes transferred (receives: the message size).
    pub byte_len: u32,
    /// The immediate, host order, when the completion carries one.
    pub imm: Option<u32>,
    /// The local queue pair.
    pub qp_num: u32,
    /// The remote queue pair (receives).
    pub src_qp: u32,
}

impl WorkCompletion {
    /// A placeholder to fill a poll buffer with.
    pub const EMPTY: WorkCompletion = WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Other(0),
        vendor_err: 0,
        byte_len: 0,
        imm: None,
        qp_num: 0,
        src_qp: 0,
    };

    fn from_raw(wc: &ffi::ibv_wc) -> Self {
        let with_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
        // SAFETY: with IBV_WC_WITH_IMM set the union holds the immediate; it is
        // plain data either way.
        let imm = with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        WorkCompletion {
            wr_id: wc.wr_id,
            status: WcStatus::from_raw(wc.status),
            opcode: WcOpcode::from_raw(wc.opcode),
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            imm,
            qp_num: wc.qp_num,
            src_qp: wc.src_qp,
        }
    }
}

/// What [`CompletionQueue::wait_event`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The queue got a completion event (consumed and acknowledged).
    Event,
    /// The extra descriptor became readable or hung up.
    Extra,
    /// Neither, before the timeout.
    TimedOut,
}

/// A completion queue. Cheap to clone; destroyed when the last clone and
/// every queue pair using it are gone. Polling is thread-safe (providers
/// lock the queue), so it takes `&self`.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

struct CqInner {
    cq: NonNull<ffi::ibv_cq>,
    capacity: u32,
    unacked: AtomicU32,
    channel: Option<CompletionChannel>,
    ctx: Context,
}

// SAFETY: ibv_poll_cq, ibv_req_notify_cq and ibv_ack_cq_events are thread-safe
// (the providers serialize access to a CQ); the handle itself is immutable.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        let lib = match ibverbs() {
            Ok(lib) => lib,
            Err(e) => return tracing::error!(device = self.ctx.name(), "cannot destroy a CQ: {e}"),
        };
        let unacked = *self.unacked.get_mut();
        if unacked > 0 {
            // SAFETY: live CQ; every event counted here was returned for it by
            // ibv_get_cq_event and not yet acknowledged.
            unsafe { (lib.ibv_ack_cq_events)(self.cq.as_ptr(), unacked) };
        }
        // SAFETY: created by ibv_create_cq, destroyed once; every QP using it holds
        // an Arc of this and is already destroyed.
        let rc = unsafe { (lib.ibv_destroy_cq)(self.cq.as_ptr()) };
        if let Err(e) = result::errno_rc(rc, "ibv_destroy_cq") {
            tracing::error!(device = self.ctx.name(), "{e}");
        }
    }
}

impl CompletionQueue {
    /// `ibv_create_cq` with room for at least `capacity` completions,
    /// attached to `channel` if given.
    ///
    /// # Errors
    /// [`Error::Verbs`] (for example `EINVAL` above the device's `max_cqe`).
    pub fn new(ctx: &Context, capacity: u32, channel: Option<&CompletionChannel>) -> Result<Self> {
        let cqe = libc::c_int::try_from(capacity.max(1))
            .map_err(|_| Error::InvalidArgument(format!("completion queue of {capacity} entries")))?;
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.as_raw());
        // SAFETY: valid context and (optional) channel; destroyed in Drop, and the
        // channel outlives the CQ through the Arc kept below.
        let cq = unsafe { (ibverbs()?.ibv_create_cq)(ctx.as_raw(), cqe, std::ptr::null_mut(), ch, 0) };
        let cq = result::nonnull(cq, "ibv_create_cq")?;
        // SAFETY: live CQ; `cqe` holds the size actually allocated.
        let actual = unsafe { (*cq.as_ptr()).cqe }.max(0) as u32;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                capacity: actual,
                unacked: AtomicU32::new(0),
                channel: channel.cloned(),
                ctx: ctx.clone(),
            }),
        })
    }

    /// The raw handle.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.cq.as_ptr()
    }

    /// Completions it can hold.
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// The channel it is attached to.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// Polls up to `out.len()` completions into `out`, returning how many.
    /// Never blocks, never allocates.
    ///
    /// # Errors
    /// [`Error::Verbs`] when the provider reports a polling failure.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        const BATCH: usize = 16;
        // Not initialized: the provider writes the entries it returns, and
        // only those are read. (Zeroing 16 entries per poll is most of the
        // cost of an empty poll.)
        let mut raw = [const { std::mem::MaybeUninit::<ffi::ibv_wc>::uninit() }; BATCH];
        let mut filled = 0;
        while filled < out.len() {
            let want = (out.len() - filled).min(BATCH);
            // SAFETY: live CQ; `raw` has room for `want` entries, which the
            // provider may write without reading.
            let n = unsafe { ffi::ibv_poll_cq(self.as_raw(), want as libc::c_int, raw.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(result::from_errno("ibv_poll_cq", -n));
            }
            let n = (n as usize).min(want);
            for (dst, src) in out[filled..].iter_mut().zip(&raw[..n]) {
                // SAFETY: ibv_poll_cq returned n, so it wrote the first n entries.
                *dst = WorkCompletion::from_raw(unsafe { src.assume_init_ref() });
            }
            filled += n;
            if n < want {
                break;
            }
        }
        Ok(filled)
    }

    /// The most completions one [`poll_each`](Self::poll_each) reads: when
    /// it returns this many, more may be waiting.
    pub const POLL_EACH_MAX: usize = 16;

    /// Polls once, up to [`POLL_EACH_MAX`](Self::POLL_EACH_MAX) completions, handing each to `f` as it is read
    /// (no buffer of the caller's to fill and read again); returns how many.
    /// Never blocks, never allocates.
    ///
    /// # Errors
    /// [`Error::Verbs`] when the provider reports a polling failure.
    #[inline]
    pub fn poll_each(&self, mut f: impl FnMut(WorkCompletion)) -> Result<usize> {
        const BATCH: usize = CompletionQueue::POLL_EACH_MAX;
        // Not initialized, as in `poll`: only the entries returned are read.
        let mut raw = [const { std::mem::MaybeUninit::<ffi::ibv_wc>::uninit() }; BATCH];
        // SAFETY: live CQ; `raw` has room for BATCH entries, which the
        // provider may write without reading.
        let n = unsafe { ffi::ibv_poll_cq(self.as_raw(), BATCH as libc::c_int, raw.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(result::from_errno("ibv_poll_cq", -n));
        }
        let n = (n as usize).min(BATCH);
        for src in &raw[..n] {
            // SAFETY: ibv_poll_cq returned n, so it wrote the first n entries.
            f(WorkCompletion::from_raw(unsafe { src.assume_init_ref() }));
        }
        Ok(n)
    }

    /// Arms the queue: the next completion makes the channel readable.
    ///
    /// # Errors
    /// [`Error::Verbs`].
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: live CQ.
        let rc = unsafe { ffi::ibv_req_notify_cq(self.as_raw(), i32::from(solicited_only)) };
        result::errno_rc(rc, "ibv_req_notify_cq")
    }

    /// Sleeps until the channel reports an event for an armed queue, `extra`
    /// becomes readable (a socket to watch, for example), or `timeout`
    /// passes. A consumed event is acknowledged (in batches) before the queue
    /// is destroyed. Arm with [`req_notify`](Self::req_notify) and poll once
    /// more before calling this, or a completion can be missed.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] without a channel; [`Error::Verbs`].
    pub fn wait_event(&self, timeout: Duration, extra: Option<BorrowedFd<'_>>) -> Result<WaitOutcome> {
        let chan = self
            .inner
            .channel
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("this completion queue has no completion channel".into()))?;
        use std::os::fd::AsRawFd;
        let mut fds = [
            libc::pollfd { fd: chan.fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd {
                fd: extra.map_or(-1, |f| f.as_raw_fd()),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            },
        ];
        let ms = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fds` is a valid array of two pollfds; a negative fd is ignored by poll(2).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                return Ok(WaitOutcome::TimedOut);
            }
            return Err(Error::Verbs { op: "poll(completion channel)", source: err });
        }
        if fds[0].revents & libc::POLLIN != 0 && self.consume_event(chan) {
            return Ok(WaitOutcome::Event);
        }
        if fds[1].revents != 0 {
            return Ok(WaitOutcome::Extra);
        }
        Ok(WaitOutcome::TimedOut)
    }
}

impl CompletionQueue {
    /// Takes one pending event off the channel without blocking, if there
    /// is one (acknowledged in batches, as [`wait_event`](Self::wait_event)
    /// does). Whether one was taken. For a caller that learned from its own
    /// poll(2) or epoll that the channel is readable.
    pub fn try_take_event(&self) -> bool {
        self.inner.channel.as_ref().is_some_and(|chan| self.consume_event(chan))
    }

    fn consume_event(&self, chan: &CompletionChannel) -> bool {
        let Ok(lib) = ibverbs() else {
            return false;
        };
        let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: live channel, valid out-pointers; the fd is non-blocking so
        // this returns at once (EAGAIN when another thread took the event).
        let rc = unsafe { (lib.ibv_get_cq_event)(chan.as_raw(), &mut cq, &mut ctx) };
        if rc != 0 {
            return false;
        }
        if cq == self.as_raw() {
            let pending = self.inner.unacked.fetch_add(1, Ordering::AcqRel) + 1;
            if pending >= 64
                && self.inner.unacked.compare_exchange(pending, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                // SAFETY: live CQ; `pending` events were returned for it and
                // the counter now owns none of them.
                unsafe { (lib.ibv_ack_cq_events)(self.as_raw(), pending) };
            }
        } else if !cq.is_null() {
            // SAFETY: an event for another live CQ sharing this channel;
            // acknowledged at once so that CQ can be destroyed.
            unsafe { (lib.ibv_ack_cq_events)(cq, 1) };
        }
        true
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("capacity", &self.inner.capacity).finish()
    }
}
