//! Transports behind [`crate::Domain`] and [`crate::Connection`]: verbs (RC
//! queue pairs) when both ends have an RDMA port, else TCP with the same
//! semantics. The transport is chosen per connection in the handshake
//! ([`choose`]) and dispatched through an enum, so the fast path stays
//! static.

use std::net::TcpStream;

use crate::bootstrap::{self, Hello};
use crate::deadline::Deadline;
use crate::error::{BootstrapError, Error, Result};
use crate::memory::{LocalParts, MemoryDomain, RemoteRegion};
use crate::ops::{OpId, OpOutcome, Waited};
use crate::options::{ConnectOptions, ConnectionInfo, TransportPolicy};

pub(crate) mod covers;
pub(crate) mod engine;
mod queue;
pub(crate) mod tcp;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;

pub(crate) use queue::{Posted, PostedInline, QuietSend, RemoteOp, WorkItem};

/// A connection's transport state.
pub(crate) enum ConnTransport {
    #[cfg(feature = "verbs")]
    Verbs(std::sync::Arc<verbs::VerbsConn>),
    Tcp(tcp::TcpConn),
}

/// Fixed facts about an established connection.
pub(crate) struct Established {
    pub transport: ConnTransport,
    pub peer_regions: Vec<RemoteRegion>,
    /// The peer's notification ring ([`crate::protocol::mailbox`]).
    pub peer_ring: RemoteRegion,
    pub info: ConnectionInfo,
    /// Covers for writes with immediate (verbs only; see
    /// [`covers`]): whether this side asked for them, and whether the peer did.
    pub covers_in: bool,
    pub covers_out: bool,
}

/// Which transport a connection uses, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Choice {
    pub verbs: bool,
    pub reason: String,
}

/// The choice both ends make from the two hellos (the same on both sides).
pub(crate) fn choose(mine: &Hello, theirs: &Hello, my_reason_no_verbs: Option<&str>) -> Result<Choice> {
    let (mv, tv) = (mine.verbs.is_some(), theirs.verbs.is_some());
    let (mt, tt) = (mine.tcp.is_some(), theirs.tcp.is_some());
    if mv && tv {
        let (a, b) = (mine.verbs.as_ref().map(|v| v.link_layer), theirs.verbs.as_ref().map(|v| v.link_layer));
        let ib = |v: &Hello| v.verbs.as_ref().is_some_and(|e| e.link_layer == 1);
        let same_subnet = !(ib(mine) && ib(theirs))
            || mine.verbs.as_ref().map(|e| &e.gid[..8]) == theirs.verbs.as_ref().map(|e| &e.gid[..8]);
        if a == b && same_subnet {
            return Ok(Choice { verbs: true, reason: "both ends have an active RDMA port on the same fabric".into() });
        }
        let why = if a != b {
            "the two RDMA ports are on different link layers"
        } else {
            "the two InfiniBand ports are on different subnets"
        };
        if mt && tt {
            return Ok(Choice { verbs: false, reason: format!("{why}: they cannot reach each other") });
        }
        return Err(BootstrapError::Incompatible(format!("{why}, and TCP was not allowed")).into());
    }
    if mt && tt {
        let reason = match (mv, tv) {
            (false, _) => my_reason_no_verbs.unwrap_or("this side offers no verbs").to_owned(),
            (true, false) => "the peer has no RDMA device (or asked for TCP)".to_owned(),
            (true, true) => unreachable!(),
        };
        return Ok(Choice { verbs: false, reason });
    }
    Err(BootstrapError::Incompatible(match (mv, tv, mt, tt) {
        (true, false, false, _) => "verbs only was asked for here, and the peer has no RDMA device".to_owned(),
        (false, true, _, false) => "the peer asked for verbs only, and this side has no RDMA device".to_owned(),
        (false, _, false, _) | (_, false, _, false) => "neither verbs nor TCP is common to both ends".to_owned(),
        _ => "no transport is common to both ends".to_owned(),
    })
    .into())
}

pub(crate) fn establish(
    backend: &MemoryDomain,
    stream: TcpStream,
    opts: &ConnectOptions,
    is_server: bool,
) -> Result<Established> {
    let deadline = Deadline::after(opts.handshake_timeout, "the handshake");
    if opts.name.len() > bootstrap::MAX_NAME {
        return Err(Error::InvalidArgument(format!(
            "a connection name of {} bytes (at most {})",
            opts.name.len(),
            bootstrap::MAX_NAME
        )));
    }
    stream.set_nodelay(true)?;
    if let Some(secret) = &opts.secret {
        bootstrap::authenticate(&stream, secret, is_server, deadline)?;
    }
    let policy = match opts.transport {
        TransportPolicy::Auto => backend.policy,
        p => p,
    };
    if policy == TransportPolicy::Verbs && !backend.has_verbs() {
        return Err(Error::NoDevice {
            reason: format!(
                "verbs was asked for, but {}",
                backend.no_verbs.as_deref().unwrap_or("this domain has no RDMA device")
            ),
        });
    }

    #[cfg(feature = "verbs")]
    let prepared = match (&backend.verbs, policy) {
        (Some(v), TransportPolicy::Auto | TransportPolicy::Verbs) => Some(verbs::Prepared::new(v, opts)?),
        _ => None,
    };
    #[cfg(feature = "verbs")]
    let verbs = prepared.as_ref().map(|p| p.endpoint());
    #[cfg(not(feature = "verbs"))]
    let verbs = None;
    let hello = Hello {
        // Covers matter over verbs only (TCP makes what it writes visible).
        caps: if verbs.is_some() && wants_covers(opts, backend) { bootstrap::CAP_IMM_COVERS } else { 0 },
        verbs,
        tcp: (policy != TransportPolicy::Verbs).then_some(bootstrap::TcpEndpoint {
            rnr_retry: opts.rnr_retry,
            min_rnr_timer: opts.min_rnr_timer,
            max_message: tcp::MAX_MESSAGE,
            send_depth: tcp::send_depth(opts),
        }),
        regions: opts.advertise.clone(),
        name: opts.name.clone(),
    };
    let mut peer = bootstrap::exchange_hello(&stream, &hello, deadline, opts.max_handshake_payload)?;
    let no_verbs_reason = match policy {
        TransportPolicy::Tcp => Some("TCP was asked for on this side".to_owned()),
        _ => backend.no_verbs.as_deref().map(|r| format!("this side has no RDMA: {r}")),
    };
    let choice = match choose(&hello, &peer, no_verbs_reason.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            bootstrap::send_reject(&stream, &e.to_string());
            return Err(e);
        }
    };
    let peer_ring = match bootstrap::take_ring(&mut peer.regions).map_err(Error::from) {
        Ok(r) => r,
        Err(e) => {
            bootstrap::send_reject(&stream, &e.to_string());
            return Err(e);
        }
    };
    tracing::info!(
        "connection to {}: {} ({})",
        stream.peer_addr().map_or("?".into(), |a| a.to_string()),
        if choice.verbs { "verbs" } else { "tcp" },
        choice.reason
    );
    #[cfg(feature = "verbs")]
    if choice.verbs {
        let (Some(p), Some(theirs)) = (prepared, peer.verbs) else { unreachable!("verbs chosen with both endpoints") };
        let (conn, mut info) = p.finish(backend.id(), stream, &theirs, opts, deadline)?;
        info.transport_reason = choice.reason;
        info.peer_name = peer.name;
        return Ok(Established {
            transport: ConnTransport::Verbs(std::sync::Arc::new(conn)),
            peer_regions: peer.regions,
            peer_ring,
            info,
            covers_in: hello.caps & bootstrap::CAP_IMM_COVERS != 0,
            covers_out: peer.caps & bootstrap::CAP_IMM_COVERS != 0,
        });
    }
    let theirs = peer.tcp.ok_or_else(|| Error::from(BootstrapError::Incompatible("the peer offers no TCP".into())))?;
    let (conn, mut info) = tcp::TcpConn::establish(backend, stream, &theirs, opts, deadline, choice.reason)?;
    info.peer_name = peer.name;
    // TCP makes the range of a write with immediate visible as it lands.
    Ok(Established {
        transport: ConnTransport::Tcp(conn),
        peer_regions: peer.regions,
        peer_ring,
        info,
        covers_in: false,
        covers_out: false,
    })
}

/// Whether this side asks the peer to cover its writes with immediate
/// ([`bootstrap::CAP_IMM_COVERS`], [`ConnectOptions::imm_covers`]): as
/// asked, or, by default, where a CUDA driver is loaded and this domain
/// may hold GPU memory on the staged path for remote writes (it exposes
/// such memory already, or the machine offers GPU memory no direct path).
fn wants_covers(opts: &ConnectOptions, mem: &MemoryDomain) -> bool {
    #[cfg(feature = "cuda")]
    return match opts.imm_covers {
        Some(asked) => asked,
        None => {
            crate::cuda::driver().is_ok()
                && (mem.visible.staged_writable() || !crate::memory::gpu::direct_path_possible())
        }
    };
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (opts, mem);
        false
    }
}

macro_rules! dispatch {
    ($self:ident, $t:ident => $e:expr) => {
        match $self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs($t) => $e,
            ConnTransport::Tcp($t) => $e,
        }
    };
}

impl ConnTransport {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    #[inline]
    pub(crate) fn is_tcp(&self) -> bool {
        matches!(self, ConnTransport::Tcp(_))
    }

    /// Lets the peer use the region under `key` through this connection
    /// (TCP; a verbs remote key is valid on every queue pair of its
    /// protection domain).
    #[inline]
    pub(crate) fn grant(&self, key: u32) {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(_) => {}
            ConnTransport::Tcp(t) => t.grant(key),
        }
    }

    #[inline]
    pub(crate) fn post_send(&self, items: &[WorkItem], due: Deadline) -> Posted {
        dispatch!(self, t => t.post_send(items, due))
    }

    /// [`post_send`](Self::post_send) of the last piece of a write with
    /// immediate split into several (the staged path): its cover names
    /// `whole`, the range of the whole operation.
    #[cfg(feature = "cuda")]
    pub(crate) fn post_send_covering(
        &self,
        items: &[WorkItem],
        due: Deadline,
        whole: crate::remote::RemoteSlice,
    ) -> Posted {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.post_covered(items, due, Some(whole)),
            ConnTransport::Tcp(t) => {
                let _ = whole;
                t.post_send(items, due)
            }
        }
    }

    /// From now on, writes with immediate are covered by `covers` (verbs:
    /// the peer asked for it). Set once, before any post.
    pub(crate) fn cover_writes(&self, covers: Box<dyn covers::ImmCovers>) {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.cover_writes(covers),
            ConnTransport::Tcp(_) => drop(covers),
        }
    }

    /// Counts the writes with immediate this side receives from now on
    /// (verbs, where it asked the peer for covers).
    pub(crate) fn count_imm_writes(&self) {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.count_imm_writes(),
            ConnTransport::Tcp(_) => {}
        }
    }

    /// Writes with immediate this side received, successfully, so far (in
    /// the order they arrived; verbs: TCP makes each visible as it lands).
    pub(crate) fn imm_writes_seen(&self) -> u64 {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.imm_writes_seen(),
            ConnTransport::Tcp(_) => 0,
        }
    }

    /// Posts a send of `local` that may go unsignaled, as
    /// [`post_send_quiet`](Self::post_send_quiet) posts one: the round of
    /// a persistent send, with no work item to dispatch on.
    #[inline(always)]
    pub(crate) fn post_quiet_send(&self, local: &LocalParts, due: Deadline) -> PostedInline {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.post_quiet_send(local, due),
            // TCP tracks every request: as any send of one item.
            ConnTransport::Tcp(_) => self.post_send_quiet(&WorkItem { local: Some(*local), op: RemoteOp::Send }, due),
        }
    }

    /// Posts one operation that may go unsignaled (verbs; TCP tracks
    /// every request).
    #[inline]
    pub(crate) fn post_send_quiet(&self, item: &WorkItem, due: Deadline) -> PostedInline {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.post_send_quiet(item, due),
            ConnTransport::Tcp(t) => PostedInline::Tracked(t.post_send(std::slice::from_ref(item), due)),
        }
    }

    /// The handle of quiet send `q` was dropped before its outcome was
    /// known: the connection keeps `buffer` until the device is done with it.
    pub(crate) fn orphan_quiet(&self, q: &QuietSend, buffer: Box<dyn std::any::Any + Send>) {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.orphan_quiet(q, buffer),
            // TCP posts no quiet sends.
            ConnTransport::Tcp(_) => {
                let _ = q;
                drop(buffer);
            }
        }
    }

    #[inline(always)]
    pub(crate) fn post_recv(&self, local: Option<LocalParts>) -> Posted {
        dispatch!(self, t => t.post_recv(local))
    }

    /// Posts an inline send tracked like any operation.
    #[inline]
    pub(crate) fn post_inline(&self, data: &[u8], imm: Option<u32>, due: Deadline) -> Posted {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => match t.post_inline(data, imm, due, false) {
                PostedInline::Tracked(posted) => posted,
                // Asked for a tracked send, the transport posts no quiet one.
                PostedInline::Quiet(_) => unreachable!("a tracked inline send was posted quiet"),
            },
            ConnTransport::Tcp(t) => t.post_inline(data, imm, due, false),
        }
    }

    /// Posts an inline send that may go unsignaled (verbs). TCP tracks
    /// every send; one that is `untracked` (nobody waits for its outcome)
    /// goes unacknowledged there, done once the socket has it.
    #[inline]
    pub(crate) fn post_inline_quiet(
        &self,
        data: &[u8],
        imm: Option<u32>,
        due: Deadline,
        untracked: bool,
    ) -> PostedInline {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.post_inline(data, imm, due, true),
            ConnTransport::Tcp(t) => PostedInline::Tracked(t.post_inline(data, imm, due, untracked)),
        }
    }

    /// Quiet send `q`'s outcome, polling once if it is not known yet.
    #[inline]
    pub(crate) fn poll_quiet(&self, q: &QuietSend) -> Result<Option<OpOutcome>> {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.poll_quiet(q),
            ConnTransport::Tcp(_) => {
                let _ = q;
                Ok(Some(Err(Box::new(Error::AlreadyReported))))
            }
        }
    }

    /// Quiet send `q`'s completion if it is known to have succeeded,
    /// without a lock: the common case for a send posted a while ago (see
    /// [`QueueCore::succeeded_mark`](queue::QueueCore::succeeded_mark)).
    /// `None` says only that this look cannot tell.
    #[inline(always)]
    pub(crate) fn quiet_succeeded(&self, q: &QuietSend) -> Option<crate::completion::Completion> {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.succeeded(q),
            ConnTransport::Tcp(_) => {
                let _ = q;
                None
            }
        }
    }

    /// Quiet send `q`'s outcome if known, without polling.
    #[inline]
    pub(crate) fn quiet_outcome(&self, q: &QuietSend) -> Option<OpOutcome> {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.quiet_outcome(q),
            ConnTransport::Tcp(_) => {
                let _ = q;
                Some(Err(Box::new(Error::AlreadyReported)))
            }
        }
    }

    /// Has a signaled request follow quiet send `q`; `Some` when one was
    /// posted for the caller to own (always with `own`).
    pub(crate) fn cover(&self, q: &QuietSend, own: bool, due: &mut Deadline) -> Result<Option<OpId>> {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.cover(q, own, due),
            ConnTransport::Tcp(_) => {
                let _ = (q, own, due);
                Ok(None)
            }
        }
    }

    /// Drives progress until quiet send `q`'s outcome is known.
    pub(crate) fn wait_quiet(&self, q: &QuietSend, due: &mut Deadline) -> Waited {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => t.wait_quiet(q, due),
            ConnTransport::Tcp(_) => {
                let _ = (q, due);
                Err(crate::ops::WaitError::Failed(Box::new(Error::AlreadyReported)))
            }
        }
    }

    /// How many of the peer's writes have landed, where the transport
    /// sees them land (TCP); None where the device places them unseen
    /// (verbs).
    pub(crate) fn landed(&self) -> Option<u64> {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(_) => None,
            ConnTransport::Tcp(t) => Some(t.landed()),
        }
    }

    /// Sleeps until a write of the peer's lands after the first `seen`
    /// ([`landed`](Self::landed)), the connection is lost, or `d` passes.
    pub(crate) fn wait_landed(&self, seen: u64, d: std::time::Duration) {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(_) => std::thread::sleep(d),
            ConnTransport::Tcp(t) => t.wait_landed(seen, d),
        }
    }

    /// Whether a write of the peer's landed after the first `seen`
    /// ([`landed`](Self::landed)) or the connection is lost (`Some(true)`),
    /// else `waker` is woken when either happens (`Some(false)`); None
    /// where the transport does not see writes land (verbs).
    pub(crate) fn landed_or_register(&self, seen: u64, waker: &std::task::Waker) -> Option<bool> {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(_) => {
                let _ = (seen, waker);
                None
            }
            ConnTransport::Tcp(t) => Some(t.landed_or_register(seen, waker)),
        }
    }

    /// Drives progress until `id` is done or the deadline passes.
    #[inline]
    pub(crate) fn wait(&self, id: OpId, due: &mut Deadline) -> Result<()> {
        dispatch!(self, t => t.wait_done(id, due))
    }

    /// Drives progress until `id` is done and takes its outcome
    /// ([`WaitError::Unfinished`](crate::ops::WaitError) when the deadline
    /// passed first: still in flight). Inlined into its callers (a ring's
    /// next message, a handle's wait): the waited completion comes back
    /// through one frame fewer.
    #[inline(always)]
    pub(crate) fn wait_take(&self, id: OpId, due: &mut Deadline) -> Waited {
        dispatch!(self, t => t.wait_take(id, due))
    }

    /// Polls once; `id`'s outcome if it is done.
    #[inline]
    pub(crate) fn poll_take(&self, id: OpId) -> Result<Option<OpOutcome>> {
        dispatch!(self, t => t.poll_take(id))
    }

    /// Takes `id`'s outcome if it is done, else has `waker` woken when it
    /// is: by the connection's own threads (TCP) or by `engine`, which
    /// starts watching this connection (verbs).
    #[inline]
    pub(crate) fn poll_register(
        &self,
        id: OpId,
        waker: &std::task::Waker,
        engine: &engine::Engine,
    ) -> Result<Option<OpOutcome>> {
        self.watched_by(engine);
        dispatch!(self, t => t.poll_register(id, waker))
    }

    /// Whether `id` is done, else has `waker` woken when it is, as
    /// [`poll_register`](Self::poll_register) does, but leaving the outcome
    /// to whoever owns the operation.
    pub(crate) fn done_or_register(&self, id: OpId, waker: &std::task::Waker, engine: &engine::Engine) -> Result<bool> {
        self.watched_by(engine);
        dispatch!(self, t => t.done_or_register(id, waker))
    }

    /// Before a waker is registered: a verbs connection is watched by
    /// `engine` from the first registration on, done or not, since a later
    /// one may find an operation in flight with nobody else polling (the
    /// peer's death shows only to a watcher). TCP's own threads wake its
    /// wakers.
    #[inline]
    fn watched_by(&self, engine: &engine::Engine) {
        match self {
            #[cfg(feature = "verbs")]
            ConnTransport::Verbs(t) => engine.watch(t),
            ConnTransport::Tcp(_) => {
                let _ = engine;
            }
        }
    }

    /// Polls once; whether `id` is done.
    #[inline]
    pub(crate) fn poll(&self, id: OpId) -> Result<bool> {
        dispatch!(self, t => t.poll_done(id))
    }

    #[inline]
    pub(crate) fn take(&self, id: OpId) -> Option<OpOutcome> {
        dispatch!(self, t => t.take(id))
    }

    #[inline]
    pub(crate) fn orphan(&self, id: OpId, buffer: Box<dyn std::any::Any + Send>) {
        dispatch!(self, t => t.orphan(id, buffer))
    }

    #[inline]
    pub(crate) fn progress(&self) -> Result<usize> {
        dispatch!(self, t => t.progress_now())
    }

    #[inline]
    pub(crate) fn broken(&self) -> Option<String> {
        dispatch!(self, t => t.broken())
    }

    #[inline]
    pub(crate) fn shutdown(&self, reason: &str) {
        dispatch!(self, t => t.shutdown(reason))
    }

    /// [`shutdown`](Self::shutdown) for a connection whose handle was
    /// dropped: on verbs, a side that closes first lingers for the peer's
    /// requests in flight to be acknowledged.
    #[inline]
    pub(crate) fn close(&self, reason: &str) {
        dispatch!(self, t => t.close(reason))
    }

    #[inline]
    pub(crate) fn stats(&self) -> (usize, usize) {
        dispatch!(self, t => t.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{TcpEndpoint, VerbsEndpoint};

    fn hello(verbs: Option<u8>, tcp: bool) -> Hello {
        Hello {
            caps: 0,
            verbs: verbs.map(|ll| VerbsEndpoint {
                qp_num: 1,
                psn: 1,
                max_msg_sz: 1 << 20,
                lid: 1,
                mtu: 3,
                link_layer: ll,
                responder_resources: 1,
                gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            }),
            tcp: tcp.then_some(TcpEndpoint { rnr_retry: 7, min_rnr_timer: 12, max_message: 1 << 30, send_depth: 128 }),
            regions: vec![],
            name: vec![],
        }
    }

    #[test]
    fn the_choice_is_verbs_when_both_can_else_tcp_else_an_error() {
        let c = choose(&hello(Some(2), true), &hello(Some(2), true), None).unwrap();
        assert!(c.verbs, "{c:?}");
        let c = choose(&hello(None, true), &hello(Some(2), true), Some("no RDMA device: ENOSYS")).unwrap();
        assert!(!c.verbs && c.reason.contains("ENOSYS"), "{c:?}");
        let c = choose(&hello(Some(2), true), &hello(None, true), None).unwrap();
        assert!(!c.verbs && c.reason.contains("peer has no RDMA"), "{c:?}");
        let c = choose(&hello(Some(1), true), &hello(Some(2), true), None).unwrap();
        assert!(!c.verbs && c.reason.contains("link layers"), "{c:?}");
        let mut other_subnet = hello(Some(1), true);
        other_subnet.verbs.as_mut().unwrap().gid[7] = 9;
        assert!(!choose(&hello(Some(1), true), &other_subnet, None).unwrap().verbs);
        assert!(choose(&hello(Some(2), false), &hello(None, true), None).is_err(), "verbs only vs no RDMA");
        assert!(choose(&hello(None, true), &hello(Some(2), false), None).is_err());
        // Both ends compute the same answer.
        for (a, b) in [(hello(Some(2), true), hello(None, true)), (hello(Some(1), true), hello(Some(2), true))] {
            assert_eq!(choose(&a, &b, None).unwrap().verbs, choose(&b, &a, None).unwrap().verbs);
        }
    }

    #[test]
    fn policies_parse() {
        assert_eq!("auto".parse::<TransportPolicy>().unwrap(), TransportPolicy::Auto);
        assert_eq!("TCP".parse::<TransportPolicy>().unwrap(), TransportPolicy::Tcp);
        assert_eq!("verbs".parse::<TransportPolicy>().unwrap(), TransportPolicy::Verbs);
        assert!("udp".parse::<TransportPolicy>().is_err());
    }
}
