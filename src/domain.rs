//! [`Domain`]: this process's endpoint on one RDMA device port. Memory is
//! registered with a domain, and connections are made from it.

use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::connection::{ConnectOptions, Connection};
use crate::error::{Error, Result};
use crate::memory::path::PathPolicy;
use crate::memory::{Access, Exposed, HostMemory, Memory, MemoryKind, Region};
use crate::transport::{self, Backend, TransportPolicy};

/// Where to find the device. [`DomainConfig::from_env`] reads
/// `GPU_RDMA_DEVICE`, `GPU_RDMA_PORT`, `GPU_RDMA_GID_INDEX` and
/// `GPU_RDMA_TRANSPORT`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DomainConfig {
    /// Verbs, TCP, or the best that exists (default): with `Auto` a
    /// machine without a usable RDMA device gets a TCP-only domain, and says
    /// why in [`DomainInfo::fallback`].
    pub transport: TransportPolicy,
    /// The device by name (`mlx5_0`, `rxe0`); `None`: the first with an active port.
    pub device: Option<String>,
    /// The port; `None`: the device's first active port.
    pub port: Option<u8>,
    /// The GID index to use; `None`: chosen (RoCE v2 with IPv4 first).
    pub gid_index: Option<u32>,
}

impl DomainConfig {
    /// Defaults overridden by the environment.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a port or GID index that is not a number.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let parse = |name: &'static str| -> Result<Option<u32>> {
            var(name)
                .map(|v| {
                    v.trim().parse::<u32>().map_err(|_| Error::InvalidArgument(format!("{name}={v} is not a number")))
                })
                .transpose()
        };
        let port = parse("GPU_RDMA_PORT")?
            .map(|p| u8::try_from(p).map_err(|_| Error::InvalidArgument(format!("GPU_RDMA_PORT={p} is too large"))))
            .transpose()?;
        Ok(DomainConfig {
            transport: TransportPolicy::from_env()?,
            device: var("GPU_RDMA_DEVICE"),
            port,
            gid_index: parse("GPU_RDMA_GID_INDEX")?,
        })
    }

    /// Uses the device called `name`.
    pub fn device(mut self, name: impl Into<String>) -> Self {
        self.device = Some(name.into());
        self
    }

    /// Uses port `port`.
    pub fn port(mut self, port: u8) -> Self {
        self.port = Some(port);
        self
    }

    /// Uses `transport`.
    pub fn transport(mut self, transport: TransportPolicy) -> Self {
        self.transport = transport;
        self
    }

    /// Uses GID index `index`.
    pub fn gid_index(mut self, index: u32) -> Self {
        self.gid_index = Some(index);
        self
    }
}

/// Live resources of a domain, for leak checks and monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DomainStats {
    /// Registered [`Region`]s (including those inside [`Exposed`] ones).
    pub regions: usize,
    /// [`Exposed`] regions (remote keys outstanding).
    pub exposed: usize,
    /// Open connections (queue pairs).
    pub connections: usize,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    regions: AtomicUsize,
    exposed: AtomicUsize,
    connections: AtomicUsize,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    Regions,
    Exposed,
    Connections,
}

impl Counters {
    fn get(&self, c: Counter) -> &AtomicUsize {
        match c {
            Counter::Regions => &self.regions,
            Counter::Exposed => &self.exposed,
            Counter::Connections => &self.connections,
        }
    }
}

/// Counts one live resource until dropped.
#[derive(Debug)]
pub(crate) struct Live {
    counters: Arc<Counters>,
    which: Counter,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.counters.get(self.which).fetch_sub(1, Ordering::AcqRel);
    }
}

/// This process's endpoint on one RDMA device port: a protection domain,
/// the port and GID it addresses peers with, and the memory registered in
/// it. Cheap to clone; shared by every region and connection made from it.
#[derive(Clone)]
pub struct Domain {
    pub(crate) inner: Arc<DomainInner>,
}

pub(crate) struct DomainInner {
    id: u64,
    pub(crate) backend: Backend,
    counters: Arc<Counters>,
    /// Staging machinery per GPU (streams, pinned registered buffers).
    #[cfg(feature = "cuda")]
    pub(crate) stagers: std::sync::Mutex<Vec<Arc<crate::staging::Stager>>>,
    /// GPU path reports already logged, so each is logged once.
    #[cfg(feature = "cuda")]
    pub(crate) logged_paths: std::sync::Mutex<Vec<(usize, String)>>,
    /// Pinned staging bytes held (see [`Domain::staging_bytes`]).
    #[cfg(feature = "cuda")]
    pub(crate) staging_pinned: Arc<AtomicUsize>,
    /// The PCIe link class between each GPU (by ordinal) and this domain's
    /// NIC, when known: read once.
    #[cfg(feature = "cuda")]
    pub(crate) gdr_links: std::sync::Mutex<Vec<(usize, Option<crate::topology::LinkClass>)>>,
}

/// What a domain runs on, in plain words.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DomainInfo {
    /// `verbs` (connections use verbs when the peer can, else TCP) or
    /// `tcp` (no usable RDMA device, or TCP asked for).
    pub transport: &'static str,
    /// Why this domain has no verbs device, when it has none.
    pub fallback: Option<String>,
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// Link layer (`InfiniBand`, `Ethernet`).
    pub link_layer: String,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// The GID index used.
    pub gid_index: u32,
    /// The GID, as ibv_devinfo prints it.
    pub gid: String,
    /// Why this GID.
    pub gid_reason: String,
}

impl DomainInfo {
    pub(crate) fn tcp(reason: String) -> DomainInfo {
        DomainInfo {
            transport: "tcp",
            fallback: Some(reason),
            device: String::new(),
            port: 0,
            link_layer: String::new(),
            mtu: 0,
            gid_index: 0,
            gid: String::new(),
            gid_reason: String::new(),
        }
    }
}

impl fmt::Display for DomainInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(why) = &self.fallback {
            return write!(f, "tcp ({why})");
        }
        write!(
            f,
            "{} on {} port {} ({}, MTU {}, GID index {} {}: {})",
            self.transport,
            self.device,
            self.port,
            self.link_layer,
            self.mtu,
            self.gid_index,
            self.gid,
            self.gid_reason
        )
    }
}

static NEXT_DOMAIN_ID: AtomicU64 = AtomicU64::new(1);

impl Domain {
    /// Opens the device named by the environment (see [`DomainConfig::from_env`]),
    /// else the first device with an active port; on a machine without a
    /// usable RDMA device, a TCP-only domain that says why
    /// ([`DomainInfo::fallback`]).
    ///
    /// # Errors
    /// See [`Domain::with_config`].
    pub fn open() -> Result<Self> {
        Domain::with_config(&DomainConfig::from_env()?)
    }

    /// Opens the device `config` names.
    ///
    /// # Errors
    /// With a device named, or [`TransportPolicy::Verbs`]: [`Error::DeviceNotFound`],
    /// [`Error::NoDevice`],
    /// [`Error::NoActivePort`], [`Error::NoGid`] or [`Error::Verbs`] instead
    /// of falling back to TCP, or [`Error::FeatureDisabled`] when built
    /// without the `verbs` feature.
    pub fn with_config(config: &DomainConfig) -> Result<Self> {
        let backend = transport::open_backend(config)?;
        let domain = Domain {
            inner: Arc::new(DomainInner {
                id: NEXT_DOMAIN_ID.fetch_add(1, Ordering::Relaxed),
                backend,
                counters: Arc::default(),
                #[cfg(feature = "cuda")]
                stagers: Default::default(),
                #[cfg(feature = "cuda")]
                logged_paths: Default::default(),
                #[cfg(feature = "cuda")]
                staging_pinned: Arc::default(),
                #[cfg(feature = "cuda")]
                gdr_links: Default::default(),
            }),
        };
        tracing::info!("gpu-rdma domain: {}", domain.info());
        Ok(domain)
    }

    /// Opens the RDMA device nearest CUDA device `ordinal` (by the doctor's
    /// ranking: nearest PCIe link, then the same NUMA node, then the fastest
    /// port), else as [`Domain::open`]. Logs which, and why.
    ///
    /// # Errors
    /// As [`Domain::with_config`].
    pub fn open_near_gpu(ordinal: usize) -> Result<Self> {
        let mut config = DomainConfig::from_env()?;
        if config.device.is_none() {
            match crate::topology::nic_for_gpu(ordinal) {
                Ok(Some(nic)) => {
                    tracing::info!("GPU {ordinal}: using {nic}, the nearest RDMA device");
                    config.device = Some(nic);
                }
                Ok(None) => tracing::info!("GPU {ordinal}: no RDMA device found near it; using the first active one"),
                Err(e) => tracing::info!("GPU {ordinal}: cannot place it ({e}); using the first active RDMA device"),
            }
        }
        Domain::with_config(&config)
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    pub(crate) fn live(&self, which: Counter) -> Live {
        self.inner.counters.get(which).fetch_add(1, Ordering::AcqRel);
        Live { counters: Arc::clone(&self.inner.counters), which }
    }

    /// The device, port and GID in use, and why.
    pub fn info(&self) -> DomainInfo {
        self.inner.backend.info()
    }

    /// Live resources.
    pub fn stats(&self) -> DomainStats {
        let c = &self.inner.counters;
        DomainStats {
            regions: c.regions.load(Ordering::Acquire),
            exposed: c.exposed.load(Ordering::Acquire),
            connections: c.connections.load(Ordering::Acquire),
        }
    }

    /// Bytes of pinned host memory this domain holds for staging GPU
    /// memory, in use and cached for reuse. Slots come in size classes
    /// (powers of two up to 2 MiB, multiples of 2 MiB above: a 600 MiB
    /// message pins 600 MiB, not 1 GiB); the cache keeps at most 64 MiB per
    /// GPU, and a slot larger than a chunk (a whole large message's) is freed
    /// when its operation is done.
    #[cfg(feature = "cuda")]
    pub fn staging_bytes(&self) -> usize {
        self.inner.staging_pinned.load(Ordering::Acquire)
    }

    /// Allocates `len` zeroed bytes of page-aligned host memory and registers
    /// them for local use ([`Access::LOCAL`]).
    ///
    /// # Errors
    /// As [`HostMemory::new`] and [`Domain::register`].
    pub fn alloc(&self, len: usize) -> Result<Region<HostMemory>> {
        Ok(self.register(HostMemory::new(len)?, Access::LOCAL)?)
    }

    /// Registers `mem` with `access` rights. Use [`Access::LOCAL`] unless a
    /// peer needs a key; for that, [`Domain::expose`] the region.
    ///
    /// GPU memory ([`crate::cuda::CudaBuffer`]) goes through the path choice
    /// (dma-buf, then nvidia-peermem, then staged; `GPU_RDMA_MEM_PATH`
    /// forces one): see [`Domain::register_with_path`].
    ///
    /// # Errors
    /// The error and the memory back when the device refuses the
    /// registration (for example `ENOMEM` from the memory-lock limit), or
    /// `GPU_RDMA_MEM_PATH` has an unknown value.
    pub fn register<M: Memory>(&self, mem: M, access: Access) -> std::result::Result<Region<M>, BufError<M>> {
        match PathPolicy::from_env() {
            Ok(policy) => self.register_with_path(mem, access, policy),
            Err(error) => Err(BufError { error, buffer: mem }),
        }
    }

    /// Registers `mem`, choosing the GPU memory path by `policy` (ignored
    /// for host memory). The region's [`Region::path_report`] says which
    /// path won and why the others lost; the first registration per GPU
    /// logs it.
    ///
    /// # Errors
    /// As [`Domain::register`]; with a forced path, that path's failure.
    pub fn register_with_path<M: Memory>(
        &self,
        mem: M,
        access: Access,
        policy: PathPolicy,
    ) -> std::result::Result<Region<M>, BufError<M>> {
        if mem.is_empty() {
            return Err(BufError { error: Error::InvalidArgument("cannot register zero bytes".into()), buffer: mem });
        }
        #[cfg(feature = "cuda")]
        if let Some(buf) = mem.cuda_buffer() {
            return match crate::memory::gpu::register(self, buf, access, policy) {
                Ok((reg, report)) => {
                    Ok(Region::from_parts(reg, mem, access, Some(report), self.clone(), self.live(Counter::Regions)))
                }
                Err(error) => Err(BufError { error, buffer: mem }),
            };
        }
        let _ = policy;
        if mem.kind() != MemoryKind::Host {
            return Err(BufError {
                error: Error::CudaUnavailable {
                    reason: "GPU memory needs the `cuda` feature and a `CudaBuffer`".into(),
                },
                buffer: mem,
            });
        }
        // SAFETY: `mem` is moved into the Region with the registration, and the
        // Region deregisters before it frees (or leaks) the memory; `Memory`'s
        // contract keeps the address range valid and fixed until then.
        match unsafe { self.inner.backend.register(mem.as_ptr(), mem.len(), access) } {
            Ok(reg) => Ok(Region::from_parts(reg, mem, access, None, self.clone(), self.live(Counter::Regions))),
            Err(error) => Err(BufError { error, buffer: mem }),
        }
    }

    /// Gives peers `access` (any of [`Access::REMOTE_READ`],
    /// [`Access::REMOTE_WRITE`], [`Access::REMOTE_ATOMIC`]) to `region`
    /// under a new remote key, tagged `tag` in its descriptor. Nothing else
    /// is granted: least privilege.
    ///
    /// GPU memory on a direct path is exposed as it is: peers read and write
    /// the GPU. On the staged path peers reach a pinned host mirror instead,
    /// which its owner moves to and from the GPU explicitly (see
    /// [`Exposed::publish`] and [`Connection::recv_write`]).
    ///
    /// # Errors
    /// The error and the region back when `access` has no remote right or
    /// the region belongs to another domain, or the device refuses.
    // The error hands the region back by value, as the caller gave it.
    #[allow(clippy::result_large_err)]
    pub fn expose<M: Memory>(
        &self,
        region: Region<M>,
        access: Access,
        tag: u64,
    ) -> std::result::Result<Exposed<M>, BufError<Region<M>>> {
        let remote = access.remote();
        if remote.is_empty() || remote != access {
            return Err(BufError {
                error: Error::InvalidArgument(format!(
                    "expose takes remote rights only (REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC), got {access:?}"
                )),
                buffer: region,
            });
        }
        if region.domain().id() != self.id() {
            return Err(BufError {
                error: Error::InvalidArgument("the region is registered with another domain".into()),
                buffer: region,
            });
        }
        let mut mr_access = remote;
        if remote.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) {
            mr_access |= Access::LOCAL_WRITE;
        }
        #[cfg(feature = "cuda")]
        let gpu = region.memory().cuda_buffer().zip(region.memory_path());
        #[cfg(not(feature = "cuda"))]
        let gpu: Option<((), ())> = None;
        let reg = match gpu {
            #[cfg(feature = "cuda")]
            Some((buf, path)) => crate::memory::gpu::register_remote(self, buf, mr_access, path),
            #[cfg(not(feature = "cuda"))]
            Some(_) => unreachable!(),
            // SAFETY: the Exposed value owns `region` (and so its memory) and drops
            // this second registration before the region; see `Exposed`'s Drop.
            None => unsafe { self.inner.backend.register(region.memory().as_ptr(), region.len(), mr_access) },
        };
        let reg = match reg {
            Ok(reg) => reg,
            Err(error) => return Err(BufError { error, buffer: region }),
        };
        // The TCP transport serves memory the CPU can reach: host memory, or a
        // staged region's host mirror (not GPU memory on a direct path).
        let cpu_view = match (gpu.is_some(), reg.mirror()) {
            (_, Some((addr, len))) => Some((addr, len as u64)),
            (false, None) => Some((region.memory().as_ptr() as u64, region.len() as u64)),
            (true, None) => None,
        };
        // SAFETY: the exposure handle is dropped (revoked, waiting for transfers
        // in progress) before the registration and the region it serves.
        let tcp = cpu_view.map(|(addr, len)| unsafe { self.inner.backend.tcp.expose(addr, len, remote, reg.rkey()) });
        let tcp = match tcp.transpose() {
            Ok(tcp) => tcp,
            Err(error) => return Err(BufError { error, buffer: region }),
        };
        Ok(Exposed::from_parts(reg, region, remote, tag, self.live(Counter::Exposed), tcp))
    }

    /// Listens for connections on `addr` (TCP, for the handshake).
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<Listener> {
        Listener::new(self.clone(), TcpListener::bind(addr)?)
    }

    /// Connects to a listener at `addr`, with `opts`.
    ///
    /// # Errors
    /// [`Error::Io`] when no TCP connection can be made, [`Error::Timeout`],
    /// [`Error::Bootstrap`] when the handshake fails, [`Error::ModifyQp`]
    /// when the queue pairs cannot be connected.
    pub fn connect(&self, addr: impl ToSocketAddrs, opts: &ConnectOptions) -> Result<Connection> {
        let deadline = Instant::now() + opts.handshake_timeout;
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&a, remaining) {
                Ok(stream) => return Connection::establish(self, stream, opts, false),
                Err(e) => last = Some(e),
            }
        }
        Err(match last {
            Some(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                Error::Timeout { what: "the TCP connection to the peer", after: opts.handshake_timeout }
            }
            Some(e) => Error::Io(e),
            None => Error::InvalidArgument("the address resolved to nothing".into()),
        })
    }
}

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Domain").field("id", &self.inner.id).field("info", &self.info()).finish()
    }
}

/// An error that gives back the value the failed call took.
pub struct BufError<T> {
    /// What went wrong.
    pub error: Error,
    /// The value, unharmed.
    pub buffer: T,
}

impl<T> fmt::Display for BufError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<T> fmt::Debug for BufError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufError").field("error", &self.error).finish_non_exhaustive()
    }
}

impl<T> std::error::Error for BufError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<BufError<T>> for Error {
    fn from(e: BufError<T>) -> Self {
        e.error
    }
}

/// The most handshakes a [`Listener`] runs at once. Past it, the oldest
/// one still running is cut off (its socket shut) to make room, so a flood
/// of silent peers cannot keep a legitimate client out.
pub const MAX_CONCURRENT_HANDSHAKES: usize = 128;

/// Accepts connections for a [`Domain`].
///
/// Handshakes run concurrently, each on its own short-lived thread and
/// bounded by its [`ConnectOptions::handshake_timeout`], at most
/// [`MAX_CONCURRENT_HANDSHAKES`] at once: a slow, silent or half-sent peer
/// never delays another. Dropping the listener cuts off the handshakes
/// still running; connections it already returned are not affected.
pub struct Listener {
    domain: Domain,
    tcp: TcpListener,
    handshakes: Arc<Handshakes>,
    /// Read end of the wake-up pair: a finished handshake writes a byte.
    wake: std::os::unix::net::UnixStream,
}

/// Handshakes in progress and finished, shared with their threads.
struct Handshakes {
    state: std::sync::Mutex<HandshakeState>,
    /// Write end of the wake-up pair.
    wake: std::os::unix::net::UnixStream,
}

#[derive(Default)]
struct HandshakeState {
    next_id: u64,
    /// Running: id, and a handle on the socket to cut the handshake off.
    running: std::collections::VecDeque<(u64, TcpStream)>,
    /// Finished and not yet returned by an accept call.
    finished: std::collections::VecDeque<Result<Connection>>,
}

impl Handshakes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HandshakeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Listener {
    fn new(domain: Domain, tcp: TcpListener) -> Result<Listener> {
        tcp.set_nonblocking(true)?;
        let (wake, wake_tx) = std::os::unix::net::UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let handshakes = Arc::new(Handshakes { state: Default::default(), wake: wake_tx });
        Ok(Listener { domain, tcp, handshakes, wake })
    }

    /// The address it listens on (useful after binding port 0).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.tcp.local_addr()?)
    }

    /// Waits, however long, until a handshake finishes, and returns it: the
    /// connection, or why that peer failed. Peers that arrive meanwhile are
    /// handshaken concurrently with `opts` (a handshake keeps the options
    /// of the call during which its peer arrived); one that finishes while
    /// no call waits is kept for the next call.
    ///
    /// # Errors
    /// As [`Domain::connect`], for the peer whose handshake failed; the
    /// listener stays usable. [`Error::Io`] when accepting fails.
    pub fn accept(&self, opts: &ConnectOptions) -> Result<Connection> {
        self.accept_until(opts, None)
    }

    /// Like [`accept`](Self::accept), but gives up after `timeout` without
    /// a finished handshake.
    ///
    /// # Errors
    /// [`Error::Timeout`], or as [`Listener::accept`].
    pub fn accept_timeout(&self, opts: &ConnectOptions, timeout: Duration) -> Result<Connection> {
        self.accept_until(opts, Some((Instant::now() + timeout, timeout)))
    }

    fn accept_until(&self, opts: &ConnectOptions, deadline: Option<(Instant, Duration)>) -> Result<Connection> {
        loop {
            if let Some(done) = self.handshakes.lock().finished.pop_front() {
                return done;
            }
            // Start a handshake for every peer waiting in the backlog.
            loop {
                match self.tcp.accept() {
                    Ok((stream, _)) => self.start(stream, opts)?,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    // A peer that reset before it was accepted is not this listener's failure.
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(done) = self.handshakes.lock().finished.pop_front() {
                return done;
            }
            let wait = match deadline {
                Some((at, after)) => {
                    let now = Instant::now();
                    if now >= at {
                        return Err(Error::Timeout { what: "a peer to connect", after });
                    }
                    at - now
                }
                None => Duration::from_secs(1),
            };
            self.wait(wait)?;
        }
    }

    /// Sleeps until a peer arrives, a handshake finishes, or `wait` passes.
    fn wait(&self, wait: Duration) -> Result<()> {
        use std::os::fd::AsRawFd;
        let mut fds = [
            libc::pollfd { fd: self.tcp.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        let ms = wait.as_millis().clamp(1, 1000) as libc::c_int;
        // SAFETY: two valid pollfds owned by this frame; both descriptors are
        // open for as long as `self` is borrowed.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e.into());
            }
        }
        if fds[1].revents != 0 {
            let mut sink = [0u8; 64];
            while matches!(std::io::Read::read(&mut &self.wake, &mut sink), Ok(n) if n > 0) {}
        }
        Ok(())
    }

    /// Runs the handshake with `stream` on its own thread.
    fn start(&self, stream: TcpStream, opts: &ConnectOptions) -> Result<()> {
        stream.set_nonblocking(false)?;
        let cut = stream.try_clone()?;
        let id = {
            let mut st = self.handshakes.lock();
            while st.running.len() >= MAX_CONCURRENT_HANDSHAKES {
                if let Some((_, oldest)) = st.running.pop_front() {
                    tracing::warn!(
                        "{MAX_CONCURRENT_HANDSHAKES} handshakes running: cutting off the oldest ({:?})",
                        oldest.peer_addr().ok()
                    );
                    let _ = oldest.shutdown(std::net::Shutdown::Both);
                }
            }
            st.next_id += 1;
            let id = st.next_id;
            st.running.push_back((id, cut));
            id
        };
        let (domain, opts, shared) = (self.domain.clone(), opts.clone(), Arc::clone(&self.handshakes));
        let spawned = std::thread::Builder::new().name("gpu-rdma-handshake".into()).spawn(move || {
            let done = Connection::establish(&domain, stream, &opts, true);
            let mut st = shared.lock();
            st.running.retain(|(i, _)| *i != id);
            st.finished.push_back(done);
            drop(st);
            let _ = std::io::Write::write(&mut &shared.wake, &[1]);
        });
        if let Err(e) = spawned {
            self.handshakes.lock().running.retain(|(i, _)| *i != id);
            return Err(e.into());
        }
        Ok(())
    }

    /// The domain it accepts for.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Cut off the handshakes still running: their threads end at once
        // and drop what they made.
        for (_, s) in self.handshakes.lock().running.drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.handshakes.lock();
        f.debug_struct("Listener")
            .field("local_addr", &self.tcp.local_addr().ok())
            .field("handshakes_running", &st.running.len())
            .field("handshakes_finished", &st.finished.len())
            .finish_non_exhaustive()
    }
}
