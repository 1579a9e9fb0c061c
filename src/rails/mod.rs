//! Several NICs ("rails") and several queue pairs per rail, used as one.
//!
//! A [`Rails`] set is one [`Domain`] per NIC. Memory is registered with
//! every rail at once ([`Rails::expose`] gives a [`RailRegion`], whose
//! [`RailDescriptor`] carries one remote key per rail). A
//! [`RailConnection`] holds [`RailOptions::queue_pairs`] connections on each
//! rail, rail `r` here to rail `r` of the peer. A large write or read is cut
//! into stripes of [`RailOptions::stripe`] bytes, dealt out over every
//! queue pair of every rail, and posted as one transfer list per queue
//! pair; [`Striped::wait`] returns once all of them have landed, and
//! [`RailConnection::write_notify`] sends its notification only then. The
//! domain's engine drives each striped transfer (the moving of a failed
//! rail's stripes and the notification included), so nobody has to wait on
//! it; its handle is a future, goes in a [`CompletionSet`](crate::CompletionSet)
//! and takes a callback ([`Striped::on_complete`]).
//!
//! A rail that fails mid-transfer (its link goes down, its queue pairs
//! error out, or stall past the operation timeout) is dropped: the stripes
//! it had are posted again on the rails that are left, and the transfer
//! finishes there; with none left it fails with [`Error::NoRailLeft`],
//! each rail's failure named. Writes and reads are idempotent, so a stripe
//! that partly landed on a failed rail is simply moved again. Per-rail
//! byte counters ([`RailConnection::stats`]) count what each rail moved.
//!
//! Both sides must be set up alike: the same number of rails and queue
//! pairs per rail. Each connection names its place (`rail r/R qp q/Q`) in
//! the handshake, and the accepting side refuses a dialer that differs
//! ([`Error::RailMismatch`]).
//!
//! Here the set, its options and what its connections share; `region`
//! registers memory with every rail; `connection` makes and accepts rail
//! connections; `striped` cuts and moves transfers; `inbox` gathers their
//! notifications.

#![forbid(unsafe_code)]

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::access::Access;
use crate::config::{DomainConfig, TransportPolicy};
use crate::connection::Connection;
use crate::domain::{BufError, Domain};
use crate::error::{Error, Result};
use crate::host_memory::HostMemory;
use crate::memory::alias::{Alias, aliases};
use crate::memory::path::MemPath;
use crate::memory::{Exposed, Memory, Shared};
use crate::options::ConnectOptions;

mod connection;
mod inbox;
mod region;
mod striped;

pub use connection::{RailConnection, RailListener, RailStats};
pub use inbox::RailInbox;
pub use region::{RailDescriptor, RailRegion};
pub use striped::{Moved, Striped};

/// The most rails a set holds (and a descriptor carries).
pub const MAX_RAILS: usize = 16;

/// The most queue pairs per rail.
pub const MAX_QUEUE_PAIRS: usize = 64;

/// A set of domains, one per NIC, used together: see the [module docs](self).
#[derive(Clone)]
pub struct Rails {
    domains: Vec<Domain>,
}

impl std::fmt::Debug for Rails {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Rails {
    /// Rails over domains already open (one per NIC; TCP-only domains work
    /// too, as rails over the host's sockets).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for none, or more than [`MAX_RAILS`].
    pub fn from_domains(domains: Vec<Domain>) -> Result<Self> {
        if domains.is_empty() || domains.len() > MAX_RAILS {
            return Err(Error::InvalidArgument(format!(
                "a rail set holds 1 to {MAX_RAILS} domains, got {}",
                domains.len()
            )));
        }
        Ok(Rails { domains })
    }

    /// One verbs domain per named RDMA device, in that order.
    ///
    /// # Errors
    /// As [`Domain::with_config`] for each (no TCP fallback: a device named
    /// is a device required), and as [`Rails::from_domains`].
    pub fn open_devices<S: AsRef<str>>(devices: &[S]) -> Result<Self> {
        let mut domains = Vec::with_capacity(devices.len());
        for d in devices {
            let mut config = DomainConfig::from_env()?;
            config.device = Some(d.as_ref().to_owned());
            config.transport = TransportPolicy::Verbs;
            domains.push(Domain::with_config(&config)?);
        }
        Rails::from_domains(domains)
    }

    /// Every RDMA device as near CUDA device `ordinal` as the nearest one
    /// (the doctor's ranking: the same link class, the best first), or the
    /// devices `GPU_RDMA_RAILS` lists (comma-separated). Where nothing is
    /// found, one rail as [`Domain::open_near_gpu`] opens it, which says
    /// why.
    ///
    /// # Errors
    /// As [`Rails::open_devices`] and [`Domain::open_near_gpu`].
    pub fn open_near_gpu(ordinal: usize) -> Result<Self> {
        if let Some(list) = rails_from_env() {
            return Rails::open_devices(&list);
        }
        let nics = crate::topology::nics_for_gpu(ordinal).unwrap_or_else(|e| {
            tracing::info!("GPU {ordinal}: cannot place it ({e}); one rail");
            Vec::new()
        });
        if nics.is_empty() {
            return Rails::from_domains(vec![Domain::open_near_gpu(ordinal)?]);
        }
        tracing::info!("GPU {ordinal}: rails {}", nics.join(", "));
        let nics: Vec<String> = nics.into_iter().take(MAX_RAILS).collect();
        Rails::open_devices(&nics)
    }

    /// The devices `GPU_RDMA_RAILS` lists, else one rail as [`Domain::open`]
    /// opens it (which falls back to TCP, saying why).
    ///
    /// # Errors
    /// As [`Rails::open_devices`] and [`Domain::open`].
    pub fn open() -> Result<Self> {
        match rails_from_env() {
            Some(list) => Rails::open_devices(&list),
            None => Rails::from_domains(vec![Domain::open()?]),
        }
    }

    /// How many rails.
    pub fn len(&self) -> usize {
        self.domains.len()
    }

    /// Always false: a set holds at least one rail.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// The rails' domains, in order.
    pub fn domains(&self) -> &[Domain] {
        &self.domains
    }

    /// Each rail's device name (`tcp` for a TCP-only domain).
    pub fn names(&self) -> Vec<String> {
        self.domains.iter().map(rail_name).collect()
    }

    /// Allocates `len` zeroed bytes of host memory, registered with every
    /// rail and exposed for remote reads and writes under `tag`.
    ///
    /// # Errors
    /// As [`HostMemory::new`] and [`Rails::expose`].
    pub fn alloc(&self, len: usize, tag: u64) -> Result<RailRegion<HostMemory>> {
        self.expose(HostMemory::new(len)?, Access::REMOTE_READ | Access::REMOTE_WRITE, tag).map_err(|e| e.error)
    }

    /// Registers `mem` with every rail and gives peers `access` (remote
    /// rights only, as [`Domain::expose`]) under one key per rail.
    ///
    /// GPU memory must reach every NIC directly (dma-buf or nvidia-peermem):
    /// on the staged path each domain would expose its own host mirror.
    ///
    /// # Errors
    /// [`Error::NeedsDirectPath`] for GPU memory on the staged path with
    /// more than one rail; as [`Domain::register`] and [`Domain::expose`]
    /// on any rail; every
    /// registration made is undone and the memory comes back (`None` only
    /// if undoing one failed: the memory is then leaked, never freed under
    /// the device).
    #[allow(clippy::result_large_err)]
    pub fn expose<M: Memory>(
        &self,
        mem: M,
        access: Access,
        tag: u64,
    ) -> std::result::Result<RailRegion<M>, BufError<Option<M>>> {
        self.register_all(mem, Some((access, tag)))
    }

    /// Registers `mem` with every rail for this side's transfers only: the
    /// source of a striped write, or the destination of a striped read,
    /// that no peer can reach ([`RailConnection::grant`] refuses it).
    ///
    /// # Errors
    /// As [`Rails::expose`].
    #[allow(clippy::result_large_err)]
    pub fn register<M: Memory>(&self, mem: M) -> std::result::Result<RailRegion<M>, BufError<Option<M>>> {
        self.register_all(mem, None)
    }

    /// Registers `mem` with every rail, exposed with `remote` (rights and
    /// tag) or local only; undone whole on a failure.
    #[allow(clippy::result_large_err)]
    fn register_all<M: Memory>(
        &self,
        mem: M,
        remote: Option<(Access, u64)>,
    ) -> std::result::Result<RailRegion<M>, BufError<Option<M>>> {
        let mut rails: Vec<Shared<Alias<M>>> = Vec::with_capacity(self.domains.len());
        let mut exposed: Vec<Exposed<Alias<M>>> = Vec::with_capacity(self.domains.len());
        let mut left = aliases(mem, self.domains.len());
        for domain in &self.domains {
            let alias = left.pop().expect("one alias per rail");
            let failed = match domain.register(alias, Access::LOCAL) {
                // Staged GPU memory is exposed as a host mirror per domain:
                // each rail would see its own copy. Only direct paths stripe.
                Ok(region) if self.domains.len() > 1 && region.memory_path() == Some(MemPath::Staged) => {
                    let reason = region.path_report().map(ToString::to_string).unwrap_or_default();
                    let error = Error::NeedsDirectPath {
                        what: "GPU memory on several rails",
                        reason: format!("{} has the staged path: {reason}", rail_name(domain)),
                    };
                    (error, region.into_memory().ok())
                }
                Ok(region) => match remote {
                    None => {
                        rails.push(region.share());
                        continue;
                    }
                    Some((access, tag)) => match domain.expose(region, access, tag) {
                        Ok(e) => {
                            rails.push(e.local_view());
                            exposed.push(e);
                            continue;
                        }
                        Err(BufError { error, buffer }) => (error, buffer.into_memory().ok()),
                    },
                },
                Err(BufError { error, buffer }) => (error, Some(buffer)),
            };
            let (error, alias) = failed;
            left.extend(alias);
            if exposed.is_empty() {
                for s in rails {
                    if let Ok(alias) = s.try_into_region().map_err(|_| ()).and_then(|r| r.into_memory().map_err(|_| ()))
                    {
                        left.push(alias);
                    }
                }
            } else {
                // The local views first: each withdraw needs the last handle.
                drop(rails);
                for e in exposed {
                    if let Ok(alias) = e.withdraw().map_err(|_| ()).and_then(|r| r.into_memory().map_err(|_| ())) {
                        left.push(alias);
                    }
                }
            }
            // The last alias gives the memory back; one kept by a registration
            // that could not be undone stays leaked with it.
            return Err(BufError { error, buffer: left.into_iter().find_map(Alias::into_inner) });
        }
        Ok(RailRegion { rails, exposed })
    }

    /// Listens on every rail: rail `r` on `addr`'s host, at `addr`'s port
    /// plus `r` (or any free port when it is 0).
    ///
    /// # Errors
    /// [`Error::Io`] when a port cannot be bound.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<RailListener> {
        let base = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| Error::InvalidArgument("the listen address resolves to nothing".into()))?;
        let mut listeners = Vec::with_capacity(self.domains.len());
        for (r, d) in self.domains.iter().enumerate() {
            let mut a = base;
            if base.port() != 0 {
                a.set_port(base.port().checked_add(r as u16).ok_or_else(|| {
                    Error::InvalidArgument(format!("port {} + {r} rails is past 65535", base.port()))
                })?);
            }
            listeners.push(d.listen(a)?);
        }
        Ok(RailListener { rails: self.clone(), listeners })
    }

    /// Connects to a peer's [`RailListener`] at `addrs` (its
    /// [`RailListener::addrs`], in rail order): `opts.queue_pairs`
    /// connections per rail, rail `r` here to `addrs[r]`.
    ///
    /// # Errors
    /// [`Error::RailMismatch`] when `addrs` lists another number of rails,
    /// or the listener expects another number of queue pairs (its hello
    /// names the place it expects, so both sides know at the first
    /// connection); as [`Domain::connect`] for each connection.
    pub fn connect(&self, addrs: &[SocketAddr], opts: &RailOptions) -> Result<RailConnection> {
        opts.check()?;
        if addrs.len() != self.len() {
            return Err(Error::RailMismatch {
                detail: format!("this side has {} rails, the peer listens on {}", self.len(), addrs.len()),
            });
        }
        let mut links = Vec::new();
        for q in 0..opts.queue_pairs {
            for (r, (d, a)) in self.domains.iter().zip(addrs).enumerate() {
                let mut c = opts.connect.clone();
                c.name = place(r, self.len(), q, opts.queue_pairs).into_bytes();
                let conn = d.connect(a, &c)?;
                // The listener names the place it expects this connection at.
                if conn.info().peer_name != c.name {
                    return Err(Error::RailMismatch {
                        detail: format!(
                            "this side dials as \"{}\", the listener expects \"{}\"",
                            String::from_utf8_lossy(&c.name),
                            String::from_utf8_lossy(&conn.info().peer_name)
                        ),
                    });
                }
                links.push(RailLink::new(r, conn));
            }
        }
        Ok(RailConnection::new(self, links, opts))
    }
}

/// A rail's device name (`tcp` for a TCP-only domain).
fn rail_name(d: &Domain) -> String {
    let i = d.info();
    if i.device.is_empty() { i.transport.to_string() } else { i.device }
}

/// The name a rail connection carries in its handshake.
fn place(rail: usize, rails: usize, qp: usize, qps: usize) -> String {
    format!("rail {rail}/{rails} qp {qp}/{qps}")
}

/// `GPU_RDMA_RAILS`, split.
fn rails_from_env() -> Option<Vec<String>> {
    let v = std::env::var("GPU_RDMA_RAILS").ok()?;
    let list: Vec<String> = v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
    (!list.is_empty()).then_some(list)
}

/// How a [`RailConnection`] is made and stripes its transfers.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RailOptions {
    /// Queue pairs (connections) per rail (default 2).
    pub queue_pairs: usize,
    /// Bytes per stripe (default 1 MiB): transfers are cut into stripes of
    /// this size, dealt out over every queue pair of every rail in turn.
    pub stripe: u64,
    /// What each connection is set up with (its name is set per place).
    pub connect: ConnectOptions,
}

impl Default for RailOptions {
    fn default() -> Self {
        RailOptions { queue_pairs: 2, stripe: 1 << 20, connect: ConnectOptions::default() }
    }
}

impl RailOptions {
    /// `n` queue pairs per rail.
    pub fn queue_pairs(mut self, n: usize) -> Self {
        self.queue_pairs = n;
        self
    }

    /// Stripes of `bytes`.
    pub fn stripe(mut self, bytes: u64) -> Self {
        self.stripe = bytes;
        self
    }

    /// Connections set up with `opts`.
    pub fn connect(mut self, opts: ConnectOptions) -> Self {
        self.connect = opts;
        self
    }

    fn check(&self) -> Result<()> {
        if self.queue_pairs == 0 || self.queue_pairs > MAX_QUEUE_PAIRS {
            return Err(Error::InvalidArgument(format!(
                "queue pairs per rail must be 1 to {MAX_QUEUE_PAIRS}, got {}",
                self.queue_pairs
            )));
        }
        if self.stripe == 0 {
            return Err(Error::InvalidArgument("the stripe size must not be zero".into()));
        }
        Ok(())
    }
}

/// One queue pair of a rail connection.
pub(super) struct RailLink {
    pub(super) rail: usize,
    pub(super) conn: Connection,
    pub(super) dead: AtomicBool,
}

impl RailLink {
    pub(super) fn new(rail: usize, conn: Connection) -> Self {
        RailLink { rail, conn, dead: AtomicBool::new(false) }
    }

    pub(super) fn alive(&self) -> bool {
        !self.dead.load(Ordering::Acquire) && self.conn.broken().is_none()
    }
}

/// One rail's counters.
pub(super) struct RailState {
    pub(super) device: String,
    pub(super) bytes: AtomicU64,
    pub(super) failure: Mutex<Option<String>>,
}

impl RailState {
    /// Why the rail was dropped, if it was.
    pub(super) fn failure(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(super) struct RailShared {
    /// Rail-major within each queue-pair round: (r0 q0), (r1 q0), (r0 q1), ...
    pub(super) links: Vec<RailLink>,
    pub(super) rails: Vec<RailState>,
    pub(super) stripe: u64,
    pub(super) op_timeout: Duration,
}

impl RailShared {
    /// Drops a link for `reason`; the rail is marked failed.
    pub(super) fn fail(&self, link: usize, reason: &str) {
        let l = &self.links[link];
        if !l.dead.swap(true, Ordering::AcqRel) {
            let rail = &self.rails[l.rail];
            tracing::warn!("rail {} ({}): dropping a queue pair: {reason}", l.rail, rail.device);
            // Not waited for: this may run on a domain's engine thread.
            l.conn.shut_soon(format!("rail {} dropped: {reason}", l.rail));
            rail.failure().get_or_insert_with(|| reason.to_owned());
        }
    }

    /// A link to move a stripe to, other than on a failed rail if possible;
    /// `turn` spreads the choice.
    pub(super) fn pick(&self, turn: usize) -> Option<usize> {
        self.sweep();
        let live: Vec<usize> = (0..self.links.len()).filter(|&i| self.links[i].alive()).collect();
        let healthy: Vec<usize> =
            live.iter().copied().filter(|&i| self.rails[self.links[i].rail].failure().is_none()).collect();
        let from = if healthy.is_empty() { live } else { healthy };
        (!from.is_empty()).then(|| from[turn % from.len()])
    }

    /// Drops the links whose connections broke on their own.
    pub(super) fn sweep(&self) {
        for (i, l) in self.links.iter().enumerate() {
            if !l.dead.load(Ordering::Acquire) {
                if let Some(reason) = l.conn.broken() {
                    self.fail(i, &reason);
                }
            }
        }
    }

    pub(super) fn failures(&self) -> Vec<String> {
        self.sweep();
        self.rails
            .iter()
            .enumerate()
            .map(|(r, s)| {
                format!("rail {r} ({}): {}", s.device, s.failure().as_deref().unwrap_or("no live queue pair"))
            })
            .collect()
    }
}

/// Where a striped transfer goes: offsets into the local and the remote
/// region, and the length.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub(super) local_offset: u64,
    pub(super) remote_offset: u64,
    pub(super) len: u64,
}

#[cfg(test)]
mod tests {
    use super::striped::rail_fault;
    use super::*;
    use crate::completion::{CompletionError, Opcode, WcStatus};
    use crate::error::BootstrapError;
    use crate::memory::RemoteRegion;
    use crate::remote::REGION_LEN;

    fn region(tag: u64, rkey: u32, len: u64, access: Access) -> RemoteRegion {
        RemoteRegion { tag, addr: 0x10_0000, len, rkey, access }
    }

    fn two() -> RailDescriptor {
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        RailDescriptor { rails: vec![region(7, 0x11, 4096, rw), region(7, 0x22, 4096, rw)] }
    }

    #[test]
    fn descriptors_round_trip() {
        let d = two();
        let bytes = d.to_bytes();
        assert_eq!(bytes.len(), 2 + 2 * REGION_LEN);
        assert_eq!(RailDescriptor::from_bytes(&bytes).unwrap(), d);
        assert_eq!(d.len(), 4096);
        assert_eq!(d.rails()[1].rkey(), 0x22);
    }

    #[test]
    fn hostile_descriptors_are_refused_typed() {
        let good = two().to_bytes();
        let malformed =
            |b: &[u8]| matches!(RailDescriptor::from_bytes(b), Err(Error::Bootstrap(BootstrapError::Malformed { .. })));
        // Every truncation and every extension by a byte.
        for n in 0..good.len() {
            assert!(malformed(&good[..n]), "cut to {n} bytes");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(malformed(&long));
        // A wrong version, no rails, too many, a count the bytes do not hold.
        for (at, v) in [(0, 2u8), (0, 0), (1, 0), (1, 17), (1, 3), (1, 1), (1, 255)] {
            let mut b = good.clone();
            b[at] = v;
            assert!(malformed(&b), "byte {at} = {v}");
        }
        // Rails that disagree on length or rights.
        let mut d = two();
        d.rails[1].len = 8192;
        assert!(malformed(&d.to_bytes()));
        let mut d = two();
        d.rails[1].access = Access::REMOTE_READ;
        assert!(malformed(&d.to_bytes()));
        // A region that wraps the address space, unknown access bits.
        let mut b = good.clone();
        b[2 + 8..2 + 16].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(RailDescriptor::from_bytes(&b).is_err());
        let mut b = good;
        b[2 + 28..2 + 32].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(RailDescriptor::from_bytes(&b).is_err());
        // Random bytes never panic.
        let mut x = 0x1234_5678_9abc_def0u64;
        for len in 0..400 {
            let b: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = RailDescriptor::from_bytes(&b);
        }
    }

    #[test]
    fn rail_faults_are_the_queue_pairs_not_the_requests() {
        let c = |status| {
            Error::Completion(CompletionError { status, opcode: Opcode::Write, wr_id: 0, qp_num: 0, vendor_err: 0 })
        };
        assert!(rail_fault(&Error::ConnectionLost { reason: "x".into() }));
        assert!(rail_fault(&Error::Timeout { what: "x", after: Duration::from_secs(1) }));
        assert!(rail_fault(&c(WcStatus::RetryExceeded)));
        assert!(rail_fault(&c(WcStatus::WrFlush)));
        assert!(rail_fault(&c(WcStatus::LocalQpOperation)), "soft-RoCE's error when its link goes down");
        assert!(!rail_fault(&c(WcStatus::RemoteAccess)), "a bad key fails on every rail");
        assert!(!rail_fault(&c(WcStatus::LocalProtection)));
        assert!(!rail_fault(&Error::OutOfBounds { side: "remote", offset: 0, len: 1, region_len: 0 }));
        assert!(!rail_fault(&Error::AccessDenied { granted: Access::REMOTE_READ, needed: Access::REMOTE_WRITE }));
    }

    #[test]
    fn places_name_rail_and_queue_pair() {
        assert_eq!(place(1, 2, 0, 4), "rail 1/2 qp 0/4");
        assert_ne!(place(0, 2, 1, 2), place(1, 2, 0, 2));
    }

    #[test]
    fn options_are_checked() {
        assert!(RailOptions::default().check().is_ok());
        assert!(RailOptions::default().queue_pairs(0).check().is_err());
        assert!(RailOptions::default().queue_pairs(MAX_QUEUE_PAIRS + 1).check().is_err());
        assert!(RailOptions::default().stripe(0).check().is_err());
        assert!(Rails::from_domains(Vec::new()).is_err());
    }
}
