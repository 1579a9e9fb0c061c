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
//! [`RailConnection::write_notify`] sends its notification only then.
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

#![forbid(unsafe_code)]

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::access::Access;
use crate::completion::Failure;
use crate::config::{DomainConfig, TransportPolicy};
use crate::connection::{Connection, Direction, Inbox, Listener, Note, Transfer};
use crate::domain::{BufError, Domain};
use crate::error::{BootstrapError, Error, Result};
use crate::host_memory::HostMemory;
use crate::memory::alias::{Alias, aliases};
use crate::memory::path::MemPath;
use crate::memory::{Exposed, Memory, RemoteRegion};
use crate::options::ConnectOptions;
use crate::protocol::list::Piece;
use crate::remote::REGION_LEN;

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
        let mut done: Vec<Exposed<Alias<M>>> = Vec::with_capacity(self.domains.len());
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
                Ok(region) => match domain.expose(region, access, tag) {
                    Ok(exposed) => {
                        done.push(exposed);
                        continue;
                    }
                    Err(BufError { error, buffer }) => (error, buffer.into_memory().ok()),
                },
                Err(BufError { error, buffer }) => (error, Some(buffer)),
            };
            let (error, alias) = failed;
            left.extend(alias);
            for e in done {
                if let Ok(alias) = e.withdraw().map_err(|_| ()).and_then(|r| r.into_memory().map_err(|_| ())) {
                    left.push(alias);
                }
            }
            // The last alias gives the memory back; one kept by a registration
            // that could not be undone stays leaked with it.
            return Err(BufError { error, buffer: left.into_iter().find_map(Alias::into_inner) });
        }
        Ok(RailRegion { rails: done })
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

/// Host (or GPU) memory registered with every rail of a set, exposed to
/// peers under one key per rail. Cheap to clone.
///
/// Like an [`Exposed`] region it offers no `&[u8]`: a peer may write it at
/// any time. Copy with [`read_at`](RailRegion::read_at) and
/// [`write_at`](RailRegion::write_at).
pub struct RailRegion<M: Memory = HostMemory> {
    /// One registration per rail, in rail order; all of the same bytes.
    rails: Vec<Exposed<Alias<M>>>,
}

impl<M: Memory> Clone for RailRegion<M> {
    fn clone(&self) -> Self {
        RailRegion { rails: self.rails.clone() }
    }
}

impl<M: Memory> std::fmt::Debug for RailRegion<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailRegion").field("len", &self.len()).field("rails", &self.rails.len()).finish()
    }
}

impl<M: Memory> RailRegion<M> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.rails[0].len()
    }

    /// Whether the length is zero (never: empty memory is not registered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What a peer needs to reach it on every rail.
    pub fn descriptor(&self) -> RailDescriptor {
        RailDescriptor { rails: self.rails.iter().map(Exposed::descriptor).collect() }
    }
}

impl RailRegion<HostMemory> {
    /// Copies `out.len()` bytes at `offset` out (see [`Exposed::read_at`]).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.rails[0].copy_out(offset, out)
    }

    /// Copies `data` in at `offset` (see [`Exposed::write_at`]).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.rails[0].copy_in(offset, data)
    }
}

/// A peer's [`RailRegion`]: one [`RemoteRegion`] per rail, all of one
/// length and rights. Sent as bytes ([`to_bytes`](Self::to_bytes)) over
/// whatever control plane the application has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailDescriptor {
    rails: Vec<RemoteRegion>,
}

/// Leading byte of an encoded [`RailDescriptor`].
const DESCRIPTOR_VERSION: u8 = 1;

impl RailDescriptor {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.rails[0].len()
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each rail's descriptor, in rail order.
    pub fn rails(&self) -> &[RemoteRegion] {
        &self.rails
    }

    /// The encoded form: a version byte, the rail count, then each rail's
    /// [`RemoteRegion::to_bytes`].
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + self.rails.len() * REGION_LEN);
        out.push(DESCRIPTOR_VERSION);
        out.push(self.rails.len() as u8);
        for r in &self.rails {
            out.extend_from_slice(&r.to_bytes());
        }
        out
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' form, checking it whole.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] ([`BootstrapError::Malformed`]) for a wrong
    /// version, length or rail count, a bad region, or rails that disagree
    /// on length or rights.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = |detail: String| Error::Bootstrap(BootstrapError::Malformed { what: "rail descriptor", detail });
        let [version, count, rest @ ..] = bytes else {
            return Err(bad(format!("{} bytes, shorter than its header", bytes.len())));
        };
        if *version != DESCRIPTOR_VERSION {
            return Err(bad(format!("version {version}, this side reads {DESCRIPTOR_VERSION}")));
        }
        let count = *count as usize;
        if count == 0 || count > MAX_RAILS {
            return Err(bad(format!("{count} rails (1 to {MAX_RAILS} allowed)")));
        }
        if rest.len() != count * REGION_LEN {
            return Err(bad(format!("{} bytes for {count} rails, which take {}", rest.len(), count * REGION_LEN)));
        }
        let rails = rest.chunks(REGION_LEN).map(RemoteRegion::from_bytes).collect::<Result<Vec<_>>>()?;
        let first = &rails[0];
        if let Some(r) = rails.iter().find(|r| r.len() != first.len() || r.access() != first.access()) {
            return Err(bad(format!(
                "rails disagree: {} bytes {:?} against {} bytes {:?}",
                r.len(),
                r.access(),
                first.len(),
                first.access()
            )));
        }
        Ok(RailDescriptor { rails })
    }
}

/// Listens on every rail of a set: see [`Rails::listen`].
#[derive(Debug)]
pub struct RailListener {
    rails: Rails,
    listeners: Vec<Listener>,
}

impl RailListener {
    /// Where each rail listens, in rail order: what the dialer passes to
    /// [`Rails::connect`].
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn addrs(&self) -> Result<Vec<SocketAddr>> {
        self.listeners.iter().map(Listener::local_addr).collect()
    }

    /// Accepts a dialer's connections: `opts.queue_pairs` per rail, each
    /// checked for its place; within `opts.connect.handshake_timeout` each.
    ///
    /// # Errors
    /// [`Error::RailMismatch`] when the dialer has another number of rails
    /// or queue pairs; as [`Listener::accept_timeout`].
    pub fn accept(&self, opts: &RailOptions) -> Result<RailConnection> {
        opts.check()?;
        let n = self.rails.len();
        let mut links = Vec::new();
        for q in 0..opts.queue_pairs {
            for (r, l) in self.listeners.iter().enumerate() {
                let want = place(r, n, q, opts.queue_pairs);
                // Named after the place it expects, so a dialer set up
                // otherwise finds out at once too.
                let mut c = opts.connect.clone();
                c.name = want.clone().into_bytes();
                let conn = l.accept_timeout(&c, opts.connect.handshake_timeout)?;
                let got = String::from_utf8_lossy(&conn.info().peer_name).into_owned();
                if got != want {
                    return Err(Error::RailMismatch {
                        detail: format!("expected the dialer's \"{want}\", it says \"{got}\""),
                    });
                }
                links.push(RailLink::new(r, conn));
            }
        }
        Ok(RailConnection::new(&self.rails, links, opts))
    }
}

/// One queue pair of a rail connection.
struct RailLink {
    rail: usize,
    conn: Connection,
    dead: AtomicBool,
}

impl RailLink {
    fn new(rail: usize, conn: Connection) -> Self {
        RailLink { rail, conn, dead: AtomicBool::new(false) }
    }

    fn alive(&self) -> bool {
        !self.dead.load(Ordering::Acquire) && self.conn.broken().is_none()
    }
}

/// One rail's counters.
struct RailState {
    device: String,
    bytes: AtomicU64,
    failure: Mutex<Option<String>>,
}

impl RailState {
    /// Why the rail was dropped, if it was.
    fn failure(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What one rail of a connection did ([`RailConnection::stats`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RailStats {
    /// The rail's device (`tcp` for a TCP-only domain).
    pub device: String,
    /// Bytes its queue pairs moved in transfers that completed.
    pub bytes: u64,
    /// Its queue pairs.
    pub queue_pairs: usize,
    /// Those still in use.
    pub alive: usize,
    /// Why it was dropped, if it was.
    pub failure: Option<String>,
}

struct RailShared {
    /// Rail-major within each queue-pair round: (r0 q0), (r1 q0), (r0 q1), ...
    links: Vec<RailLink>,
    rails: Vec<RailState>,
    stripe: u64,
    op_timeout: Duration,
}

impl RailShared {
    /// Drops a link for `reason`; the rail is marked failed.
    fn fail(&self, link: usize, reason: &str) {
        let l = &self.links[link];
        if !l.dead.swap(true, Ordering::AcqRel) {
            let rail = &self.rails[l.rail];
            tracing::warn!("rail {} ({}): dropping a queue pair: {reason}", l.rail, rail.device);
            l.conn.shut(&format!("rail {} dropped: {reason}", l.rail));
            rail.failure().get_or_insert_with(|| reason.to_owned());
        }
    }

    /// A link to move a stripe to, other than on a failed rail if possible;
    /// `turn` spreads the choice.
    fn pick(&self, turn: usize) -> Option<usize> {
        self.sweep();
        let live: Vec<usize> = (0..self.links.len()).filter(|&i| self.links[i].alive()).collect();
        let healthy: Vec<usize> =
            live.iter().copied().filter(|&i| self.rails[self.links[i].rail].failure().is_none()).collect();
        let from = if healthy.is_empty() { live } else { healthy };
        (!from.is_empty()).then(|| from[turn % from.len()])
    }

    /// Drops the links whose connections broke on their own.
    fn sweep(&self) {
        for (i, l) in self.links.iter().enumerate() {
            if !l.dead.load(Ordering::Acquire) {
                if let Some(reason) = l.conn.broken() {
                    self.fail(i, &reason);
                }
            }
        }
    }

    fn failures(&self) -> Vec<String> {
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

/// Connections on every rail to one peer: see the [module docs](self).
pub struct RailConnection {
    shared: Arc<RailShared>,
}

impl std::fmt::Debug for RailConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailConnection").field("rails", &self.stats()).finish()
    }
}

impl RailConnection {
    fn new(rails: &Rails, links: Vec<RailLink>, opts: &RailOptions) -> Self {
        let rails = rails
            .names()
            .into_iter()
            .map(|device| RailState { device, bytes: AtomicU64::new(0), failure: Mutex::new(None) })
            .collect();
        RailConnection {
            shared: Arc::new(RailShared { links, rails, stripe: opts.stripe, op_timeout: opts.connect.op_timeout }),
        }
    }

    /// Writes `len` bytes at `local_offset` of `local` to `remote_offset`
    /// of the peer's region, striped over every rail.
    pub fn write<M: Memory>(
        &self,
        local: &RailRegion<M>,
        local_offset: u64,
        remote: &RailDescriptor,
        remote_offset: u64,
        len: u64,
    ) -> Striped<M> {
        let span = Span { local_offset, remote_offset, len };
        Striped::start(self, local, remote, span, Direction::Write, None)
    }

    /// [`write`](Self::write), then a notification with `tag` and `payload`
    /// for the peer's [`RailInbox`], sent once every stripe has landed.
    #[allow(clippy::too_many_arguments)]
    pub fn write_notify<M: Memory>(
        &self,
        local: &RailRegion<M>,
        local_offset: u64,
        remote: &RailDescriptor,
        remote_offset: u64,
        len: u64,
        tag: u32,
        payload: &[u8],
    ) -> Striped<M> {
        let span = Span { local_offset, remote_offset, len };
        Striped::start(self, local, remote, span, Direction::Write, Some((tag, payload.to_vec())))
    }

    /// Reads `len` bytes at `remote_offset` of the peer's region into
    /// `local_offset` of `local`, striped over every rail.
    pub fn read<M: Memory>(
        &self,
        local: &RailRegion<M>,
        local_offset: u64,
        remote: &RailDescriptor,
        remote_offset: u64,
        len: u64,
    ) -> Striped<M> {
        let span = Span { local_offset, remote_offset, len };
        Striped::start(self, local, remote, span, Direction::Read, None)
    }

    /// Lets the peer reach `region` through every queue pair, rail `r`'s
    /// registration on rail `r`; returns the descriptor to send it (see
    /// [`Connection::grant`]: on TCP a peer reaches only what was granted
    /// on its connection).
    ///
    /// # Errors
    /// [`Error::RailMismatch`] when `region` has another number of rails.
    pub fn grant<M: Memory>(&self, region: &RailRegion<M>) -> Result<RailDescriptor> {
        if region.rails.len() != self.shared.rails.len() {
            return Err(Error::RailMismatch {
                detail: format!(
                    "the region has {} rails, the connection {}",
                    region.rails.len(),
                    self.shared.rails.len()
                ),
            });
        }
        for l in &self.shared.links {
            l.conn.grant(&region.rails[l.rail]);
        }
        Ok(region.descriptor())
    }

    /// Starts receiving the peer's notifications on every queue pair
    /// (`slots` receives each; see [`Connection::inbox`]).
    ///
    /// # Errors
    /// As [`Connection::inbox`].
    pub fn inbox(&self, slots: usize) -> Result<RailInbox> {
        let inboxes = self.shared.links.iter().map(|l| l.conn.inbox(slots)).collect::<Result<Vec<_>>>()?;
        Ok(RailInbox { inboxes, timeout: self.shared.op_timeout })
    }

    /// Per rail, in rail order: bytes moved, queue pairs alive, why it
    /// was dropped.
    pub fn stats(&self) -> Vec<RailStats> {
        let s = &self.shared;
        s.sweep();
        s.rails
            .iter()
            .enumerate()
            .map(|(r, state)| {
                let mine = s.links.iter().filter(|l| l.rail == r);
                RailStats {
                    device: state.device.clone(),
                    bytes: state.bytes.load(Ordering::Acquire),
                    queue_pairs: mine.clone().count(),
                    alive: mine.filter(|l| l.alive()).count(),
                    failure: state.failure().clone(),
                }
            })
            .collect()
    }

    /// The connections, with their rails, rail-major within each round of
    /// queue pairs.
    pub fn connections(&self) -> impl Iterator<Item = (usize, &Connection)> {
        self.shared.links.iter().map(|l| (l.rail, &l.conn))
    }
}

/// What a finished striped transfer moved ([`Striped::wait`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Moved {
    /// Bytes moved.
    pub bytes: u64,
    /// Stripes it was cut into.
    pub stripes: usize,
    /// Queue pairs' lists posted again on another rail after theirs failed.
    pub moved_again: usize,
}

/// Where a striped transfer goes: offsets into the local and the remote
/// region, and the length.
#[derive(Clone, Copy, Debug)]
struct Span {
    local_offset: u64,
    remote_offset: u64,
    len: u64,
}

/// The stripes one queue pair carries.
struct Lane<M: Memory> {
    pieces: Vec<Piece>,
    link: usize,
    /// In flight; `None` once landed.
    transfer: Option<Transfer<Exposed<Alias<M>>>>,
}

/// A striped transfer in flight; see [`RailConnection::write`].
pub struct Striped<M: Memory> {
    shared: Arc<RailShared>,
    local: RailRegion<M>,
    remote: RailDescriptor,
    span: Span,
    direction: Direction,
    lanes: Vec<Lane<M>>,
    note: Option<(u32, Vec<u8>)>,
    /// Refused before anything was posted.
    refused: Option<Error>,
    moved: Moved,
    turn: usize,
    finished: bool,
}

impl<M: Memory> std::fmt::Debug for Striped<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Striped").field("span", &self.span).field("lanes", &self.lanes.len()).finish()
    }
}

impl<M: Memory> Striped<M> {
    fn start(
        conn: &RailConnection,
        local: &RailRegion<M>,
        remote: &RailDescriptor,
        span: Span,
        direction: Direction,
        note: Option<(u32, Vec<u8>)>,
    ) -> Self {
        let shared = Arc::clone(&conn.shared);
        let mut s = Striped {
            local: local.clone(),
            remote: remote.clone(),
            span,
            direction,
            lanes: Vec::new(),
            note,
            refused: None,
            moved: Moved::default(),
            turn: 0,
            finished: false,
            shared,
        };
        if let Err(e) = s.plan() {
            s.refused = Some(e);
        }
        s
    }

    /// Checks the ranges, cuts the stripes and posts one list per queue pair.
    fn plan(&mut self) -> Result<()> {
        if let Some((_, payload)) = &self.note {
            if payload.len() > crate::MAX_NOTIFY_PAYLOAD {
                let (len, max) = (payload.len() as u64, crate::MAX_NOTIFY_PAYLOAD as u64);
                return Err(Error::NotifyPayloadTooLarge { len, max });
            }
        }
        let n = self.shared.rails.len();
        if self.local.rails.len() != n || self.remote.rails.len() != n {
            return Err(Error::RailMismatch {
                detail: format!(
                    "the connection has {n} rails, the local region {}, the remote one {}",
                    self.local.rails.len(),
                    self.remote.rails.len()
                ),
            });
        }
        let Span { local_offset, remote_offset, len } = self.span;
        let check = |side: &'static str, offset: u64, region_len: u64| {
            if offset.checked_add(len).is_none_or(|end| end > region_len) {
                return Err(Error::OutOfBounds { side, offset, len, region_len });
            }
            Ok(())
        };
        check("local", local_offset, self.local.len() as u64)?;
        check("remote", remote_offset, self.remote.len())?;
        let needed = match self.direction {
            Direction::Write => Access::REMOTE_WRITE,
            Direction::Read => Access::REMOTE_READ,
        };
        let granted = self.remote.rails[0].access();
        if !granted.contains(needed) {
            return Err(Error::AccessDenied { granted, needed });
        }
        let links: Vec<usize> = (0..self.shared.links.len()).filter(|&i| self.shared.links[i].alive()).collect();
        if links.is_empty() {
            return Err(Error::NoRailLeft { failures: self.shared.failures() });
        }
        let stripe = self.shared.stripe;
        let mut lanes: Vec<Lane<M>> =
            links.iter().map(|&link| Lane { pieces: Vec::new(), link, transfer: None }).collect();
        let mut at = 0;
        let mut k = 0;
        while at < len {
            let n = stripe.min(len - at);
            let lane = &mut lanes[k % links.len()];
            lane.pieces.push(Piece::new(at, at, n));
            at += n;
            k += 1;
        }
        self.moved.stripes = k;
        lanes.retain(|l| !l.pieces.is_empty());
        for lane in &mut lanes {
            lane.transfer = Some(self.post(lane.link, &lane.pieces)?);
        }
        self.lanes = lanes;
        Ok(())
    }

    /// Posts `pieces` (offsets relative to the transfer) on `link`.
    fn post(&self, link: usize, pieces: &[Piece]) -> Result<Transfer<Exposed<Alias<M>>>> {
        let l = &self.shared.links[link];
        let Span { local_offset, remote_offset, len } = self.span;
        let slice = self.local.rails[l.rail].clone().slice(local_offset as usize..(local_offset + len) as usize);
        let remote = self.remote.rails[l.rail].slice(remote_offset..remote_offset + len)?;
        let pieces = pieces.iter().copied();
        Ok(match self.direction {
            Direction::Write => l.conn.write_list(slice, &remote, pieces),
            Direction::Read => l.conn.read_list(slice, &remote, pieces),
        })
    }

    /// Waits until every stripe has landed (and the notification, if any,
    /// is sent), moving the stripes of a failed rail to the others.
    ///
    /// The stripes move without it (the domains' engines keep each queue
    /// pair's list going); what needs the wait is what comes after a
    /// completion: moving a failed rail's stripes, and the notification,
    /// which is posted here once everything landed. Each queue pair's wait
    /// is bounded by the connection's operation timeout without progress:
    /// past it, that queue pair counts as failed.
    ///
    /// # Errors
    /// What refused the transfer before anything moved
    /// ([`Error::OutOfBounds`], [`Error::AccessDenied`],
    /// [`Error::RailMismatch`]); an operation's error that is not the
    /// rail's fault (a remote access error, say); [`Error::NoRailLeft`]
    /// when every rail failed. Once it returned an error, it returns
    /// [`Error::AlreadyReported`].
    pub fn wait(&mut self) -> Result<Moved> {
        if self.finished {
            return Err(Error::AlreadyReported);
        }
        let out = self.drive();
        self.finished = true;
        out
    }

    fn drive(&mut self) -> Result<Moved> {
        if let Some(e) = self.refused.take() {
            return Err(e);
        }
        let shared = Arc::clone(&self.shared);
        let mut i = 0;
        while i < self.lanes.len() {
            let link = self.lanes[i].link;
            let Some(t) = self.lanes[i].transfer.as_mut() else {
                i += 1;
                continue;
            };
            match t.wait() {
                Ok(done) => {
                    self.lanes[i].transfer = None;
                    shared.rails[shared.links[link].rail].bytes.fetch_add(done.bytes, Ordering::AcqRel);
                    self.moved.bytes += done.bytes;
                    i += 1;
                }
                Err(e) if rail_fault(&e) => {
                    shared.fail(link, &e.to_string());
                    if matches!(e, Error::Timeout { .. }) {
                        // Shut now: what it had in flight is flushed; wait for that.
                        if let Some(t) = self.lanes[i].transfer.as_mut() {
                            let _ = t.wait_timeout(shared.op_timeout);
                        }
                    }
                    self.turn += 1;
                    let Some(next) = shared.pick(self.turn) else {
                        return Err(Error::NoRailLeft { failures: shared.failures() });
                    };
                    let transfer = self.post(next, &self.lanes[i].pieces)?;
                    let lane = &mut self.lanes[i];
                    lane.link = next;
                    lane.transfer = Some(transfer);
                    self.moved.moved_again += 1;
                    // Waited on again at the same index.
                }
                Err(e) => return Err(e),
            }
        }
        if let Some((tag, payload)) = self.note.take() {
            self.notify(tag, &payload)?;
        }
        Ok(self.moved)
    }

    /// Sends the notification on the first queue pair that takes it.
    fn notify(&mut self, tag: u32, payload: &[u8]) -> Result<()> {
        let shared = Arc::clone(&self.shared);
        for _ in 0..shared.links.len() {
            self.turn += 1;
            let Some(link) = shared.pick(self.turn) else { break };
            let l = &shared.links[link];
            let local = self.local.rails[l.rail].clone().slice(0..0);
            let remote = self.remote.rails[l.rail].slice(0..0)?;
            match l.conn.write_list_notify(local, &remote, [], tag, payload).wait() {
                Ok(_) => return Ok(()),
                Err(e) if rail_fault(&e) => shared.fail(link, &e.to_string()),
                Err(e) => return Err(e),
            }
        }
        Err(Error::NoRailLeft { failures: shared.failures() })
    }

    /// Bytes the transfer moves.
    pub fn len(&self) -> u64 {
        self.span.len
    }

    /// Whether it moves nothing.
    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }
}

/// Whether an error is the rail's (its queue pair is unusable), so that
/// the stripes it had are moved to another, rather than the transfer's own
/// (bad keys, bad ranges), which another rail would hit as well.
fn rail_fault(e: &Error) -> bool {
    match e {
        Error::ConnectionLost { .. } | Error::Timeout { .. } => true,
        Error::Completion(c) => {
            matches!(
                c.failure(),
                Failure::PeerUnreachable | Failure::Flushed | Failure::ReceiverNotReady | Failure::Other
            )
        }
        _ => false,
    }
}

/// Notifications arriving on any queue pair of a [`RailConnection`].
#[derive(Debug)]
pub struct RailInbox {
    inboxes: Vec<Inbox>,
    timeout: Duration,
}

impl RailInbox {
    /// Waits until `n` notifications with `tag` have arrived, on whichever
    /// rails, up to the connections' operation timeout.
    ///
    /// # Errors
    /// As [`RailInbox::wait_timeout`].
    pub fn wait(&mut self, tag: u32, n: usize) -> Result<Vec<Note>> {
        self.wait_timeout(tag, n, self.timeout)
    }

    /// Waits up to `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] (nothing taken); [`Error::PeerTransferFailed`];
    /// [`Error::ConnectionLost`] when every queue pair is lost.
    pub fn wait_timeout(&mut self, tag: u32, n: usize, timeout: Duration) -> Result<Vec<Note>> {
        let until = Instant::now() + timeout;
        loop {
            let mut have = 0;
            let mut lost = None;
            for ib in &mut self.inboxes {
                // A lost queue pair still hands over what arrived before.
                if let Err(e) = ib.try_take(tag, usize::MAX) {
                    match e {
                        Error::ConnectionLost { .. } => lost = Some(e),
                        other => return Err(other),
                    }
                }
                have += ib.count(tag);
            }
            if have >= n {
                let mut notes = Vec::with_capacity(n);
                for ib in &mut self.inboxes {
                    let k = ib.count(tag).min(n - notes.len());
                    if k > 0 {
                        notes.extend(ib.try_take(tag, k)?.unwrap_or_default());
                    }
                }
                return Ok(notes);
            }
            if let Some(e) = lost.filter(|_| self.inboxes.iter().all(Inbox::is_lost)) {
                return Err(e);
            }
            if Instant::now() >= until {
                return Err(Error::Timeout { what: "notifications on a rail connection", after: timeout });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::{CompletionError, Opcode, WcStatus};

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
