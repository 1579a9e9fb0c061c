//! [`Connection`]: the high-level, safe API. Operations take their buffer by
//! value and return a [`Pending`] that gives it back once the device is done.

#![forbid(unsafe_code)]

mod establish;
mod inbox;
mod notes;
mod pending;
mod persistent;
mod ring;
mod transfer;
mod waiting;

pub use crate::options::{ConnectOptions, ConnectionInfo};
pub use establish::{Interrupt, Listener, MAX_CONCURRENT_HANDSHAKES};
pub use inbox::{Inbox, Looking};
pub use notes::{InboxStats, MAX_QUEUED_BYTES, MAX_QUEUED_NOTES, NOTE_OVERHEAD, Note};
pub use pending::Pending;
pub(crate) use pending::Stage;
pub use persistent::{Persistent, PersistentRecv, PersistentSend};
pub use ring::{Received, RecvRing};
pub(crate) use transfer::Direction;
pub use transfer::{Failed, Transfer, Transferred};
pub(crate) use waiting::member;
pub use waiting::{CompletionSet, Finished, SetMember};

use std::fmt;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

use crate::domain::Domain;
use crate::error::{Error, Result};
use crate::memory::{Exposed, LocalBuffer, LocalSlice, Memory, RemoteRegion, RemoteSlice};
use crate::protocol::order::What;
use crate::transport::{Posted, PostedInline, RemoteOp, WorkItem};

mod batch;
mod shared;

pub use batch::Batch;
pub(crate) use shared::ConnShared;
#[cfg(feature = "cuda")]
pub(crate) use shared::fences_pending;

/// A reliable connection to one peer.
///
/// Every operation takes its local buffer by value and returns a
/// [`Pending`] that hands it back, with a [`Completion`](crate::Completion), when the device
/// is done with it. Thread-safe: operations may be posted and waited on
/// from several threads.
///
/// Zero-byte operations are allowed on every transport (an empty slice, or
/// [`send_inline`](Connection::send_inline) of no bytes): a zero-byte send
/// or write with immediate consumes one receive at the peer, a plain
/// zero-byte write or read touches no memory.
///
/// Dropping the connection (or [`close`](Connection::close)) tells the peer,
/// and fails everything still outstanding with [`Error::ConnectionLost`];
/// buffers of operations still in flight are released once the device can
/// no longer touch them.
pub struct Connection {
    shared: Arc<ConnShared>,
}

impl Connection {
    /// The verbs transport's connection, for the transport's own tests.
    #[cfg(all(test, feature = "verbs"))]
    pub(crate) fn verbs_conn(&self) -> Option<&Arc<crate::transport::verbs::VerbsConn>> {
        use crate::transport::ConnTransport;
        match &self.shared.transport {
            ConnTransport::Verbs(v) => Some(v),
            ConnTransport::Tcp(_) => None,
        }
    }

    /// The TCP transport's connection, for the transport's own tests.
    #[cfg(test)]
    pub(crate) fn tcp_conn(&self) -> Option<&crate::transport::tcp::TcpConn> {
        use crate::transport::ConnTransport;
        match &self.shared.transport {
            ConnTransport::Tcp(t) => Some(t),
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(_) => None,
        }
    }

    pub(crate) fn establish(
        domain: &Domain,
        stream: TcpStream,
        opts: &ConnectOptions,
        is_server: bool,
    ) -> Result<Self> {
        if opts.advertise.iter().any(|r| r.tag == crate::RING_TAG) {
            return Err(Error::InvalidArgument(format!(
                "region tag {:#x} is reserved for the notification ring",
                crate::RING_TAG
            )));
        }
        Ok(Connection { shared: ConnShared::establish(domain, stream, opts, is_server)? })
    }

    /// Facts about the connection.
    pub fn info(&self) -> &ConnectionInfo {
        &self.shared.info
    }

    /// The regions the peer advertised in the handshake.
    pub fn remote_regions(&self) -> &[RemoteRegion] {
        &self.shared.peer_regions
    }

    /// Lets the peer reach `region` through this connection, after the
    /// handshake; returns the descriptor to send it (in a message of your
    /// own). Regions advertised in the handshake need no grant.
    ///
    /// On TCP a peer reaches only the regions advertised or granted on its
    /// connection. On verbs a remote key is valid on every queue pair of the
    /// domain's protection domain: to keep peers apart there, give each its
    /// own [`Domain`] (one protection domain each).
    pub fn grant<M: Memory>(&self, region: &Exposed<M>) -> RemoteRegion {
        let d = region.descriptor();
        self.shared.transport.grant(d.rkey);
        d
    }

    /// The peer's region with `tag`.
    pub fn remote_region(&self, tag: u64) -> Option<RemoteRegion> {
        self.shared.peer_regions.iter().find(|r| r.tag == tag).copied()
    }

    fn one<B: LocalBuffer>(&self, local: LocalSlice<B>, op: RemoteOp) -> Pending<B> {
        let parts = match local.resolve() {
            Ok(p) => p,
            Err(e) => return Pending::failed(&self.shared, local.into_inner(), e),
        };
        #[cfg(feature = "cuda")]
        if parts.path.is_some() {
            return self.shared.gpu(local, parts, Some(op));
        }
        #[cfg(feature = "cuda")]
        if local.has_own_fences() {
            return self.shared.host_after(local, parts, Some(op));
        }
        self.shared.post_items(local.into_inner(), Ok(&[WorkItem { local: Some(parts), op }]))
    }

    /// Sends `local` as one message; it lands in the peer's next posted receive.
    pub fn send<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> Pending<B> {
        self.one(local.into(), RemoteOp::Send)
    }

    /// Sends `local` with a 32-bit immediate the peer's receive completion carries.
    pub fn send_with_imm<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>, imm: u32) -> Pending<B> {
        self.one(local.into(), RemoteOp::SendWithImm(imm))
    }

    /// Sends `local` unsignaled where the transport allows it, as perftest
    /// and UCX post sends that follow one another (a ping-pong, a stream):
    /// the device reports no completion of its own for it. The send queue
    /// completes in order, so a later signaled request's completion says
    /// this one is done; at most every few requests one is signaled anyway.
    ///
    /// The `Pending` reports the same outcome as [`send`](Self::send)'s,
    /// and holds the buffer just as long: dropped before its outcome is
    /// known, the buffer stays with the connection until a later completion
    /// says the device is done with it. Waiting on one that no signaled
    /// request follows yet posts a zero-length write to learn its outcome,
    /// so a send waited for at once is cheaper with [`send`](Self::send).
    /// GPU memory and the TCP transport track every send, as `send` does.
    pub fn send_unsignaled<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> Pending<B> {
        self.shared.send_unsignaled(local.into())
    }

    /// Sends a small message copied from `data` at post time (no registered
    /// buffer needed), at most [`ConnectionInfo::max_inline`] bytes; `imm`
    /// rides along if given. An empty `data` sends a zero-byte message.
    ///
    /// On verbs most inline sends go unsignaled, as perftest and UCX post
    /// theirs: the send queue completes in order, so a later signaled
    /// request's completion says this one is done, and no completion of its
    /// own is polled for. The `Pending` reports the same outcome either way;
    /// waiting on one that no signaled request follows yet posts a
    /// zero-length write to learn it.
    pub fn send_inline(&self, data: &[u8], imm: Option<u32>) -> Pending<()> {
        if !self.shared.gate.is_open() {
            return self.shared.post_behind((), What::Inline { data: data.to_vec(), imm });
        }
        match self.shared.transport.post_inline_quiet(data, imm, self.shared.deadline(), false) {
            PostedInline::Tracked(posted) => self.shared.pending((), posted),
            PostedInline::Quiet(q) => Pending::with(&self.shared, (), Stage::Quiet(q, None)),
        }
    }

    /// [`send_inline`](Self::send_inline) with no handle to wait on: the
    /// data is copied into the send queue before this returns, and `Ok`
    /// says only that the send was posted. The cheapest way to send a small
    /// control message or a ping-pong's ping (UCX likewise hands back no
    /// request for a send that completed at once).
    ///
    /// Delivery is confirmed by what follows: the peer's reply, or any later
    /// operation on this connection finishing (the send queue completes in
    /// order). A send that fails breaks the connection: operations posted or
    /// waited on after that fail with [`Error::ConnectionLost`], which says why.
    ///
    /// Over TCP the peer sends no acknowledgement for it (a tracked send gets
    /// one): it is done once the socket has its frame, which frees its place
    /// in the send queue; the peer carries frames out in order, so a later
    /// operation's acknowledgement still covers it.
    ///
    /// # Errors
    /// What refuses the post: [`Error::MessageTooLarge`] past
    /// [`ConnectionInfo::max_inline`], [`Error::ConnectionLost`], or
    /// [`Error::Timeout`] when the send queue stays full for the connection's
    /// post timeout.
    pub fn send_inline_untracked(&self, data: &[u8], imm: Option<u32>) -> Result<()> {
        if !self.shared.gate.is_open() {
            if data.len() as u64 > u64::from(self.shared.info.max_inline) {
                let (len, max) = (data.len() as u64, u64::from(self.shared.info.max_inline));
                return Err(Error::MessageTooLarge { len, max });
            }
            let what = What::Untracked { data: data.to_vec(), imm };
            if self.shared.gate.keep(what, Instant::now() + self.shared.post_timeout).is_ok() {
                // Posted in its turn; a failure then breaks the connection.
                self.shared.driver.ask(&self.shared);
                return Ok(());
            }
        }
        match self.shared.transport.post_inline_quiet(data, imm, self.shared.deadline(), true) {
            PostedInline::Quiet(_) => Ok(()),
            PostedInline::Tracked(posted) => self.untrack(posted),
        }
    }

    /// Leaves a posted operation with no handle to the connection, which
    /// frees its slot at its completion.
    fn untrack(&self, posted: Posted) -> Result<()> {
        match posted {
            Posted::Ok(id) => {
                self.shared.transport.orphan(id, Box::new(()));
                Ok(())
            }
            Posted::Stuck(id, e) => {
                self.shared.transport.orphan(id, Box::new(()));
                Err(*e)
            }
            Posted::Refused(e) => Err(*e),
        }
    }

    /// Posts a receive into `local` for the peer's next send.
    pub fn recv<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> Pending<B> {
        self.shared.recv(local.into())
    }

    /// For a GPU region exposed to this peer: a receive for the peer's
    /// write with immediate (or zero-byte send) that says "done", whose
    /// completion also makes the written data visible to CUDA work: on a
    /// direct path it flushes remote writes where the GPU needs that, on the
    /// staged path it copies the host mirror into GPU memory. A one-sided
    /// write into a staged GPU region reaches GPU memory only this way.
    #[cfg(feature = "cuda")]
    ///
    /// On the staged path this copies the whole region; when the peer wrote
    /// only part of it, [`recv_write_range`](Self::recv_write_range) moves
    /// just that.
    pub fn recv_write(&self, exposed: &Exposed<crate::cuda::CudaBuffer>) -> Pending<()> {
        let mut p = self.recv_imm();
        let target = exposed.clone();
        p.after = Some(Box::new(move || target.pull()));
        p
    }

    /// [`recv_write`](Self::recv_write) for a peer's write into `range` of
    /// `exposed`: on the staged path only that range is copied into GPU
    /// memory (a 4 KiB write into a 1 GiB region moves 4 KiB), and the rest
    /// of GPU memory, which the owner may have changed since, is left alone.
    /// A range past the region fails the operation with
    /// [`Error::OutOfBounds`].
    #[cfg(feature = "cuda")]
    pub fn recv_write_range(
        &self,
        exposed: &Exposed<crate::cuda::CudaBuffer>,
        range: std::ops::Range<usize>,
    ) -> Pending<()> {
        let mut p = self.recv_imm();
        let target = exposed.clone();
        p.after = Some(Box::new(move || target.pull_range(range.clone())));
        p
    }

    /// Posts a receive with no buffer: for the peer's writes with immediate
    /// and zero-byte sends. Its completion carries the immediate.
    ///
    /// A write with immediate into this side's GPU memory is visible to CUDA
    /// work when any receive takes its immediate (this one, a receive with
    /// a buffer, a receive ring's slot): over TCP the written range is
    /// copied from the staging mirror into GPU memory before the receive
    /// completes; over verbs on a direct path the remote writes are flushed
    /// where the device needs it; over verbs into a region on the staged
    /// path the range the writer named in a cover record, put in this
    /// side's notification ring just before its write, is copied in (see
    /// [`ConnectOptions::imm_covers`](crate::ConnectOptions#structfield.imm_covers);
    /// with covers turned off, name the region with
    /// [`recv_write_range`](Self::recv_write_range)).
    ///
    /// Each cover takes 64 bytes of this side's ring until a receive that
    /// took a write with immediate (or an [`Inbox`]) looks at the ring: a
    /// peer with more covered writes in flight than the ring holds waits for
    /// room, within its post timeout.
    pub fn recv_imm(&self) -> Pending<()> {
        self.shared.post_recv((), None)
    }

    /// Writes `local` into the peer's memory at `remote` (same length, else
    /// [`Error::LengthMismatch`] from the wait).
    /// Larger than the maximum message size is fine: it is split.
    pub fn write<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Pending<B> {
        self.one(local.into(), RemoteOp::Write(*remote))
    }

    /// Writes `local` to `remote` and consumes one of the peer's receives,
    /// handing it `imm`: data and notification in one message (at most the
    /// maximum message size).
    pub fn write_with_imm<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        remote: &RemoteSlice,
        imm: u32,
    ) -> Pending<B> {
        self.one(local.into(), RemoteOp::WriteWithImm(*remote, imm))
    }

    /// Reads the peer's memory at `remote` into `local` (same length, else
    /// [`Error::LengthMismatch`] from the wait).
    pub fn read<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Pending<B> {
        self.one(local.into(), RemoteOp::Read(*remote))
    }

    /// Starts a batch: several operations posted with one doorbell, only the
    /// last one signaled, completing together.
    pub fn batch<B: LocalBuffer>(&self) -> Batch<'_, B> {
        Batch { conn: self, items: Vec::new() }
    }

    /// Polls for completions once: releases the buffers of dropped
    /// operations that have finished. [`Pending::wait`] does this too.
    ///
    /// # Errors
    /// [`Error::Verbs`] when polling fails.
    pub fn progress(&self) -> Result<usize> {
        self.shared.transport.progress()
    }

    /// `None` while the connection can carry operations; else why not
    /// (the queue pair went to the error state, or the peer closed or died).
    pub fn broken(&self) -> Option<String> {
        self.shared.transport.broken()
    }

    /// Operations in flight, and how many of those have had their
    /// [`Pending`] dropped: [`stats`](Self::stats) as a pair.
    pub fn in_flight(&self) -> (usize, usize) {
        let s = self.stats();
        (s.in_flight, s.orphaned)
    }

    /// What the connection's queues hold now (completions the device has
    /// already reported count as done: it polls once first).
    pub fn stats(&self) -> ConnectionStats {
        let _ = self.shared.transport.progress();
        let (in_flight, orphaned) = self.shared.transport.stats();
        ConnectionStats { in_flight, orphaned }
    }

    /// A handle to its domain's engine, to drive work built on it.
    pub(crate) fn engine(&self) -> crate::transport::engine::EngineHandle {
        self.shared.ctx.engine().handle()
    }

    /// Breaks the connection for `reason`: tells the peer, and fails what
    /// is outstanding with [`Error::ConnectionLost`] saying why.
    pub(crate) fn shut(&self, reason: &str) {
        self.shared.transport.shutdown(reason);
    }

    /// [`shut`](Self::shut) on a thread of its own: for a caller that must
    /// not wait for it (the engine's thread, which a TCP shutdown could
    /// hold for the moment the sender takes to say goodbye). What is
    /// outstanding fails once it ran.
    pub(crate) fn shut_soon(&self, reason: String) {
        let shared = Arc::clone(&self.shared);
        let shut = move || shared.transport.shutdown(&reason);
        if let Err(e) = std::thread::Builder::new().name("gpu-rdma-shut".into()).spawn(shut) {
            tracing::warn!("no thread to shut a connection on ({e}): shutting it here");
            self.shared.transport.shutdown("a rail was dropped");
        }
    }

    /// Closes the connection: tells the peer, and fails what is outstanding
    /// (dropping it does the same). On verbs, a side that closes first keeps
    /// its queue pair up until the peer closes too, for at most 5 ms, so that
    /// what the peer sent last is still acknowledged: a peer waiting for
    /// its final send learns it arrived instead of seeing it fail.
    pub fn close(self) {
        drop(self)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.shared.transport.close("the connection was closed by this side");
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection").field("info", &self.shared.info).finish()
    }
}

/// What a connection's queues hold ([`Connection::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionStats {
    /// Operations posted whose final completion has not arrived.
    pub in_flight: usize,
    /// Of those, the ones whose [`Pending`] was dropped: their buffers stay
    /// with the connection until the device is done with them.
    pub orphaned: usize,
}
