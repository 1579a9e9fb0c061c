//! `gpu_rdma._native`: the Python binding of the crate, a thin layer over
//! its public API (nothing here moves bytes or keeps protocol state). The
//! Python package `gpu_rdma` re-exports it with docstrings and type stubs.

use std::sync::Arc;
use std::time::Duration;

use gpu_rdma::{Access, ConnectOptions, DomainConfig, LocalBuffer, Piece, TransportPolicy};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

mod buffer;
mod dlpack;
mod errors;
mod mem;
mod ops;
mod tasks;

use errors::to_py;
use ops::{Completion, Handle, Op};

/// The memory every Python region is: a Python object's buffer or DLPack
/// tensor (held alive by the region until the device is done with it).
type Mem = mem::PyMem;
use mem::{Held, OpBuffer, Slot};

/// A timeout given in seconds, checked (finite, not negative).
fn seconds(t: f64) -> PyResult<Duration> {
    if t.is_finite() && t >= 0.0 {
        Ok(Duration::from_secs_f64(t))
    } else {
        Err(PyValueError::new_err(format!("a timeout is seconds >= 0, not {t}")))
    }
}

/// A domain: one RDMA device (or TCP where there is none), its registered
/// memory and its connections.
#[pyclass(module = "gpu_rdma", frozen)]
struct Domain {
    inner: gpu_rdma::Domain,
}

#[pymethods]
impl Domain {
    /// Opens the best device here (`GPU_RDMA_DEVICE`, else the first active
    /// port), or the one named; `transport` is "auto", "verbs" or "tcp".
    #[new]
    #[pyo3(signature = (transport=None, device=None))]
    fn new(py: Python<'_>, transport: Option<&str>, device: Option<&str>) -> PyResult<Self> {
        let mut cfg = DomainConfig::from_env().map_err(to_py)?;
        if let Some(t) = transport {
            cfg = cfg.transport(t.parse::<TransportPolicy>().map_err(to_py)?);
        }
        if let Some(d) = device {
            cfg = cfg.device(d);
        }
        let inner = py.detach(|| gpu_rdma::Domain::with_config(&cfg)).map_err(to_py)?;
        Ok(Domain { inner })
    }

    /// What this domain runs on: transport, device, port, and why TCP when
    /// it fell back.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = self.inner.info();
        let d = PyDict::new(py);
        d.set_item("transport", info.transport.to_string())?;
        d.set_item("fallback", info.fallback.clone())?;
        d.set_item("device", info.device.clone())?;
        d.set_item("port", info.port)?;
        Ok(d)
    }

    /// Registers the memory of `obj` (a numpy array, `bytearray`,
    /// `memoryview`: anything with the C-contiguous buffer protocol; or a
    /// DLPack producer, whose CUDA tensors take the GPU memory paths) for
    /// local use. The object is kept alive while the region lives; its
    /// bytes are read and written in place. A read-only object can only be
    /// a source (send, write).
    fn register(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Region> {
        let buffer::ObjectMemory { mem, readonly } = buffer::object_memory(obj)?;
        let len = gpu_rdma::Memory::len(&mem);
        let region = py.detach(|| self.inner.register(mem, Access::LOCAL).map_err(|e| e.error)).map_err(to_py)?;
        let path = region.path_report().map(|p| p.chosen.to_string());
        Ok(Region {
            slot: Arc::new(Mutex::new(Held::Open(region.share()))),
            readonly,
            len,
            path,
            obj: obj.clone().unbind(),
        })
    }

    /// Gives peers `access` ("w", "r" or "rw") to `region`, under `tag` in
    /// its descriptor. The region moves into the exposure (it cannot be an
    /// operation's own buffer any more).
    #[pyo3(signature = (region, access="w", tag=0))]
    fn expose(&self, py: Python<'_>, region: &Region, access: &str, tag: u64) -> PyResult<Exposed> {
        let rights = match access {
            "w" => Access::REMOTE_WRITE,
            "r" => Access::REMOTE_READ,
            "rw" | "wr" => Access::REMOTE_READ | Access::REMOTE_WRITE,
            other => return Err(PyValueError::new_err(format!("access `{other}`: expected \"w\", \"r\" or \"rw\""))),
        };
        if region.readonly && rights.contains(Access::REMOTE_WRITE) {
            return Err(errors::ReadOnlyBuffer::new_err("a read-only buffer cannot be exposed for peers' writes"));
        }
        let r = region.alone()?;
        match self.inner.expose(r, rights, tag) {
            Ok(e) => {
                *region.slot.lock() = Held::Exposed;
                Ok(Exposed { inner: e, obj: region.obj.clone_ref(py) })
            }
            Err(e) => {
                mem::give_back(&region.slot, e.buffer.share());
                Err(to_py(e.error))
            }
        }
    }

    /// Listens on `addr` ("host:port"; port 0 picks one).
    fn listen(&self, py: Python<'_>, addr: &str) -> PyResult<Listener> {
        let l = py.detach(|| self.inner.listen(addr)).map_err(to_py)?;
        Ok(Listener { inner: l })
    }

    /// Connects to a listener at `addr`; `advertise` lists exposed regions
    /// the peer may use, `op_timeout` bounds each operation (seconds),
    /// `queue_depth` is (sends, receives) in flight at once (128 each by
    /// default; a receive past it fails, a send waits for room), `spin`
    /// how long a wait busy-polls before it sleeps (seconds; 50 us by
    /// default; perftest and `gpu-rdma bench` poll for the whole wait).
    #[pyo3(signature = (addr, advertise=Vec::new(), op_timeout=None, timeout=None, queue_depth=None, spin=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, each with its default
    fn connect(
        &self,
        py: Python<'_>,
        addr: &str,
        advertise: Vec<PyRef<'_, Exposed>>,
        op_timeout: Option<f64>,
        timeout: Option<f64>,
        queue_depth: Option<(u32, u32)>,
        spin: Option<f64>,
    ) -> PyResult<Connection> {
        let opts = options(&advertise, op_timeout, timeout, queue_depth, spin)?;
        let c = py.detach(|| self.inner.connect(addr, &opts)).map_err(to_py)?;
        Ok(Connection::new(c))
    }

    /// Registrations served from a cache, and made anew.
    fn registration_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.registration_cache_stats();
        let d = PyDict::new(py);
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        Ok(d)
    }
}

fn options(
    advertise: &[PyRef<'_, Exposed>],
    op_timeout: Option<f64>,
    timeout: Option<f64>,
    queue_depth: Option<(u32, u32)>,
    spin: Option<f64>,
) -> PyResult<ConnectOptions> {
    let mut opts = ConnectOptions::default();
    if let Some(t) = spin {
        opts = opts.spin(seconds(t)?);
    }
    if let Some((send, recv)) = queue_depth {
        opts = opts.queue_depth(send, recv);
    }
    if let Some(t) = op_timeout {
        opts = opts.op_timeout(seconds(t)?);
    }
    if let Some(t) = timeout {
        opts = opts.handshake_timeout(seconds(t)?);
    }
    for e in advertise {
        opts = opts.advertise(&e.inner);
    }
    Ok(opts)
}

/// Registered memory for local use: the buffer of operations. Any number
/// of operations may read it at once (sends, writes, transfer lists); one
/// that writes it (a receive, a read) has it alone: while it is in flight,
/// or while others read it, giving it to another is `RegionInUse`. It is
/// back when the operations are done (waited for, awaited or dropped).
#[pyclass(module = "gpu_rdma", frozen)]
struct Region {
    slot: Slot,
    readonly: bool,
    len: usize,
    /// GPU memory: the path the NIC reaches it by ("dmabuf", "peermem",
    /// "staged"); None for host memory.
    path: Option<String>,
    obj: Py<PyAny>,
}

impl Region {
    /// The region alone (to expose it, or for an operation that writes it).
    fn alone(&self) -> PyResult<mem::RustRegion> {
        mem::alone(&self.slot).map_err(errors::RegionInUse::new_err)
    }

    /// The region for an operation that writes it: alone, and writable.
    fn for_writing(&self) -> PyResult<OpBuffer> {
        if self.readonly {
            return Err(errors::ReadOnlyBuffer::new_err(
                "a read-only buffer cannot receive or be read into (register a writable one: bytearray, a numpy array)",
            ));
        }
        Ok(self.alone()?.share())
    }
}

#[pymethods]
impl Region {
    fn __len__(&self) -> usize {
        self.len
    }

    /// Whether an operation has it now, or an exposure.
    #[getter]
    fn in_use(&self) -> bool {
        match mem::alone(&self.slot) {
            Ok(r) => {
                mem::give_back(&self.slot, r.share());
                false
            }
            Err(_) => true,
        }
    }

    /// Whether it can only be a source.
    #[getter]
    fn readonly(&self) -> bool {
        self.readonly
    }

    /// GPU memory: the path the NIC reaches it by ("dmabuf", "peermem" or
    /// "staged"); None for host memory.
    #[getter]
    fn memory_path(&self) -> Option<String> {
        self.path.clone()
    }

    /// The object whose memory this is.
    #[getter]
    fn obj(&self, py: Python<'_>) -> Py<PyAny> {
        self.obj.clone_ref(py)
    }
}

/// A region peers may reach: its descriptor is what they need.
#[pyclass(module = "gpu_rdma", frozen)]
struct Exposed {
    inner: gpu_rdma::Exposed<Mem>,
    obj: Py<PyAny>,
}

#[pymethods]
impl Exposed {
    /// The descriptor peers use (bytes: address, length, key, rights, tag).
    fn descriptor<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.descriptor().to_bytes())
    }

    /// The object whose memory this is.
    #[getter]
    fn obj(&self, py: Python<'_>) -> Py<PyAny> {
        self.obj.clone_ref(py)
    }
}

/// A peer's region, as its descriptor says.
#[pyclass(module = "gpu_rdma", frozen)]
#[derive(Clone)]
struct RemoteRegion {
    inner: gpu_rdma::RemoteRegion,
}

#[pymethods]
impl RemoteRegion {
    /// From a descriptor's bytes (checked).
    #[staticmethod]
    fn from_bytes(b: &[u8]) -> PyResult<Self> {
        Ok(RemoteRegion { inner: gpu_rdma::RemoteRegion::from_bytes(b).map_err(to_py)? })
    }

    fn __len__(&self) -> usize {
        self.inner.len() as usize
    }

    #[getter]
    fn tag(&self) -> u64 {
        self.inner.tag()
    }
}

impl RemoteRegion {
    fn slice(&self, offset: u64, len: u64) -> PyResult<gpu_rdma::RemoteSlice> {
        let end = offset.checked_add(len).ok_or_else(|| PyValueError::new_err("offset + length overflows"))?;
        self.inner.slice(offset..end).map_err(to_py)
    }
}

#[pyclass(module = "gpu_rdma", frozen)]
struct Listener {
    inner: gpu_rdma::Listener,
}

#[pymethods]
impl Listener {
    /// The address it listens on ("host:port").
    fn address(&self) -> PyResult<String> {
        Ok(self.inner.local_addr().map_err(to_py)?.to_string())
    }

    /// Accepts one connection within `timeout` seconds (default 30;
    /// Ctrl-C interrupts it); the options as `Domain.connect`'s.
    #[pyo3(signature = (advertise=Vec::new(), op_timeout=None, timeout=None, queue_depth=None, spin=None))]
    fn accept(
        &self,
        py: Python<'_>,
        advertise: Vec<PyRef<'_, Exposed>>,
        op_timeout: Option<f64>,
        timeout: Option<f64>,
        queue_depth: Option<(u32, u32)>,
        spin: Option<f64>,
    ) -> PyResult<Connection> {
        let opts = options(&advertise, op_timeout, None, queue_depth, spin)?;
        let until = std::time::Instant::now() + timeout.map_or(Ok(Duration::from_secs(30)), seconds)?;
        // In slices, so Ctrl-C is seen within 50 ms: a handshake a slice
        // started goes on meanwhile and is kept for the next one.
        loop {
            let slice = until.saturating_duration_since(std::time::Instant::now()).min(Duration::from_millis(50));
            match py.detach(|| self.inner.accept_timeout(&opts, slice)) {
                Ok(c) => return Ok(Connection::new(c)),
                Err(e) if e.is_timeout() && std::time::Instant::now() < until => py.check_signals()?,
                Err(e) => return Err(to_py(e)),
            }
        }
    }
}

/// One connection to a peer: every operation returns an `Op` to wait on or
/// await; its region is back when it is done.
#[pyclass(module = "gpu_rdma", frozen)]
struct Connection {
    inner: Mutex<Option<Arc<gpu_rdma::Connection>>>,
}

/// Starts `start`'s operation on `region` and returns its handle. One that
/// writes the region (`writable`) has it alone, and it goes back to its
/// slot when the operation is waited for, awaited or dropped; one that
/// reads it shares it.
fn run_op(
    py: Python<'_>,
    region: &Region,
    writable: bool,
    start: impl FnOnce(OpBuffer) -> Handle + Send,
) -> PyResult<Op> {
    let (r, slot) = if writable {
        (region.for_writing()?, Some(Arc::clone(&region.slot)))
    } else {
        (mem::for_reading(&region.slot).map_err(errors::RegionInUse::new_err)?, None)
    };
    // A post may wait for room in a full queue: never with the GIL held
    // (the operations that make room may need this thread's peer).
    let handle = py.detach(move || start(r));
    Ok(Op::new(handle, slot))
}

/// `offset..offset + length` of a region `len` bytes long (length None:
/// to the end).
fn local_range(len: usize, offset: usize, length: Option<usize>) -> PyResult<std::ops::Range<usize>> {
    let length = length.unwrap_or(len.saturating_sub(offset));
    match offset.checked_add(length) {
        Some(end) if end <= len => Ok(offset..end),
        _ => Err(errors::OutOfBounds::new_err(format!("{length} bytes at offset {offset} of a {len}-byte region"))),
    }
}

/// A one-sided operation's two ranges: `region[offset..offset + length]`
/// and as many bytes of the peer's region at `remote_offset`.
struct Placed {
    local: std::ops::Range<usize>,
    remote: gpu_rdma::RemoteSlice,
}

impl Placed {
    fn new(
        region: &Region,
        remote: &RemoteRegion,
        offset: usize,
        length: Option<usize>,
        remote_offset: u64,
    ) -> PyResult<Placed> {
        let local = local_range(region.len, offset, length)?;
        let remote = remote.slice(remote_offset, local.len() as u64)?;
        Ok(Placed { local, remote })
    }
}

impl Connection {
    /// Starts a one-sided operation (`post`) on `at`; `writable`: it
    /// writes the local range.
    fn one_sided(
        &self,
        py: Python<'_>,
        region: &Region,
        at: Placed,
        writable: bool,
        post: impl FnOnce(
            &gpu_rdma::Connection,
            gpu_rdma::LocalSlice<OpBuffer>,
            &gpu_rdma::RemoteSlice,
        ) -> gpu_rdma::Pending<OpBuffer>
        + Send,
    ) -> PyResult<Op> {
        self.with(|c| run_op(py, region, writable, |r| Handle::One(post(c, r.slice(at.local), &at.remote))))
    }

    fn new(inner: gpu_rdma::Connection) -> Self {
        Connection::shared(Arc::new(inner))
    }

    /// One a `World` keeps (and may hand out again).
    fn shared(inner: Arc<gpu_rdma::Connection>) -> Self {
        Connection { inner: Mutex::new(Some(inner)) }
    }

    /// The connection, unless it was closed.
    fn with<T>(&self, f: impl FnOnce(&gpu_rdma::Connection) -> PyResult<T>) -> PyResult<T> {
        let conn = self.inner.lock();
        let conn = conn.as_ref().ok_or_else(|| errors::ConnectionLost::new_err("the connection was closed"))?;
        f(conn)
    }
}

#[pymethods]
impl Connection {
    /// Sends `region[offset:offset+length]` to the peer's next receive.
    #[pyo3(signature = (region, offset=0, length=None))]
    fn send(&self, py: Python<'_>, region: &Region, offset: usize, length: Option<usize>) -> PyResult<Op> {
        let range = local_range(region.len, offset, length)?;
        self.with(|c| run_op(py, region, false, |r| Handle::One(c.send(r.slice(range)))))
    }

    /// Sends with a 32-bit immediate the peer's receive completion carries.
    #[pyo3(signature = (region, imm, offset=0, length=None))]
    fn send_with_imm(
        &self,
        py: Python<'_>,
        region: &Region,
        imm: u32,
        offset: usize,
        length: Option<usize>,
    ) -> PyResult<Op> {
        let range = local_range(region.len, offset, length)?;
        self.with(|c| run_op(py, region, false, |r| Handle::One(c.send_with_imm(r.slice(range), imm))))
    }

    /// Posts a receive into `region` (the completion says how many bytes came).
    #[pyo3(signature = (region, offset=0, length=None))]
    fn recv(&self, py: Python<'_>, region: &Region, offset: usize, length: Option<usize>) -> PyResult<Op> {
        let range = local_range(region.len, offset, length)?;
        self.with(|c| run_op(py, region, true, |r| Handle::One(c.recv(r.slice(range)))))
    }

    /// Writes `region[offset:offset+length]` into the peer's region at
    /// `remote_offset`.
    #[pyo3(signature = (region, remote, offset=0, length=None, remote_offset=0))]
    fn write(
        &self,
        py: Python<'_>,
        region: &Region,
        remote: &RemoteRegion,
        offset: usize,
        length: Option<usize>,
        remote_offset: u64,
    ) -> PyResult<Op> {
        let at = Placed::new(region, remote, offset, length, remote_offset)?;
        self.one_sided(py, region, at, false, |c, local, dst| c.write(local, dst))
    }

    /// A write whose immediate the peer's `recv_imm` receives.
    #[pyo3(signature = (region, remote, imm, offset=0, length=None, remote_offset=0))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, each with its default
    fn write_with_imm(
        &self,
        py: Python<'_>,
        region: &Region,
        remote: &RemoteRegion,
        imm: u32,
        offset: usize,
        length: Option<usize>,
        remote_offset: u64,
    ) -> PyResult<Op> {
        let at = Placed::new(region, remote, offset, length, remote_offset)?;
        self.one_sided(py, region, at, false, |c, local, dst| c.write_with_imm(local, dst, imm))
    }

    /// Reads the peer's region at `remote_offset` into `region[offset:...]`.
    #[pyo3(signature = (region, remote, offset=0, length=None, remote_offset=0))]
    fn read(
        &self,
        py: Python<'_>,
        region: &Region,
        remote: &RemoteRegion,
        offset: usize,
        length: Option<usize>,
        remote_offset: u64,
    ) -> PyResult<Op> {
        let at = Placed::new(region, remote, offset, length, remote_offset)?;
        self.one_sided(py, region, at, true, |c, local, src| c.read(local, src))
    }

    /// Receives the peer's next write with immediate (or zero-byte send
    /// with immediate): the completion's `imm`.
    fn recv_imm(&self) -> PyResult<Op> {
        self.with(|c| Ok(Op::new(Handle::Imm(c.recv_imm()), None)))
    }

    /// Writes pieces `(local_offset, remote_offset, length)` of `region`
    /// into `remote` as one transfer list; with `tag`, the peer's inbox
    /// gets a notification (`payload`, at most 4 KiB) once every piece
    /// landed.
    #[pyo3(signature = (region, remote, pieces, tag=None, payload=b"".as_slice()))]
    fn write_list(
        &self,
        py: Python<'_>,
        region: &Region,
        remote: &RemoteRegion,
        pieces: Vec<(u64, u64, u64)>,
        tag: Option<u32>,
        payload: &[u8],
    ) -> PyResult<Op> {
        let dst = remote.inner.whole();
        let pieces: Vec<Piece> = pieces.into_iter().map(|(l, r, n)| Piece::new(l, r, n)).collect();
        self.with(|c| {
            run_op(py, region, false, |r| {
                Handle::List(match tag {
                    Some(tag) => c.write_list_notify(r, &dst, pieces, tag, payload),
                    None => c.write_list(r, &dst, pieces),
                })
            })
        })
    }

    /// The region the peer advertised under `tag`, if any.
    fn remote_region(&self, tag: u64) -> PyResult<Option<RemoteRegion>> {
        self.with(|c| Ok(c.remote_region(tag).map(|inner| RemoteRegion { inner })))
    }

    /// The peer's notifications (`Inbox.wait(tag, n)`).
    fn inbox(&self) -> PyResult<Inbox> {
        self.with(|c| Ok(Inbox { inner: c.inbox(1).map_err(to_py)? }))
    }

    /// Closes the connection: operations in flight fail, their regions
    /// come back. (A `World`'s connection is only let go here: the world
    /// keeps it for its other users.)
    fn close(&self, py: Python<'_>) {
        let conn = self.inner.lock().take();
        if let Some(conn) = conn.and_then(|c| Arc::try_unwrap(c).ok()) {
            py.detach(|| conn.close());
        }
    }
}

/// A connection's notifications, by tag.
#[pyclass(module = "gpu_rdma", frozen)]
struct Inbox {
    /// Cloned for each call: the connection's inboxes all see the same
    /// notifications, so calls from several threads never wait on each
    /// other here.
    inner: gpu_rdma::Inbox,
}

fn payloads(py: Python<'_>, notes: Vec<gpu_rdma::Note>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for note in notes {
        out.append(PyBytes::new(py, &note.payload))?;
    }
    Ok(out)
}

#[pymethods]
impl Inbox {
    /// Takes `n` notifications tagged `tag` if they are all there (their
    /// payloads), else None; never waits.
    #[pyo3(signature = (tag, n=1))]
    fn try_take<'py>(&self, py: Python<'py>, tag: u32, n: usize) -> PyResult<Option<Bound<'py, PyList>>> {
        match py.detach(|| self.inner.clone().try_take(tag, n)).map_err(to_py)? {
            Some(notes) => payloads(py, notes).map(Some),
            None => Ok(None),
        }
    }

    /// `wait` for asyncio: a coroutine of the payloads, woken by the crate
    /// (over TCP when the peer's writes land; over verbs by the engine's
    /// timer, every 200 us, every millisecond once 10 ms passed): no thread
    /// waits, and over TCP the loop is not woken while nothing comes. The
    /// wait starts when the coroutine is first awaited (so
    /// `asyncio.run(inbox.wait_async(t))` works). `timeout` in seconds
    /// (None: no limit); a wait that times out or is cancelled takes
    /// nothing.
    #[pyo3(signature = (tag, n=1, timeout=None))]
    fn wait_async<'py>(
        slf: &Bound<'py, Self>,
        tag: u32,
        n: usize,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let timeout = timeout.map(seconds).transpose()?.map(|t| t.as_secs_f64());
        let what = format!("{n} notification(s) tagged {tag} did not come within {:.3} s", timeout.unwrap_or(0.0));
        let start = slf.getattr("_start_wait")?;
        slf.py().import("gpu_rdma._aio")?.call_method1("inbox_wait", (start, tag, n, timeout, what))
    }

    /// Starts `wait_async`'s wait for `fut`, a future of the running loop.
    fn _start_wait(&self, py: Python<'_>, fut: Bound<'_, PyAny>, tag: u32, n: usize) -> PyResult<()> {
        let mut inbox = self.inner.clone();
        let notes: tasks::BoxFuture = Box::pin(async move {
            let got = loop {
                // Each await is bounded by the connection's operation
                // timeout; this one only by `timeout`, on the Python side.
                match inbox.wait_async(tag, n).await {
                    Err(e) if e.is_timeout() => continue,
                    got => break got,
                }
            };
            let outcome: tasks::Outcome =
                Box::new(move |py| Ok(payloads(py, got.map_err(to_py)?)?.into_any().unbind()));
            outcome
        });
        tasks::start(py, notes, fut.unbind())
    }

    /// Waits for `n` notifications tagged `tag` (the GIL released, Ctrl-C
    /// honoured) and returns their payloads; `timeout` in seconds (None:
    /// no limit; a lost connection ends the wait with its error).
    #[pyo3(signature = (tag, n=1, timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, tag: u32, n: usize, timeout: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let until = timeout.map(seconds).transpose()?.map(|t| std::time::Instant::now() + t);
        loop {
            let got = py.detach(|| self.inner.clone().wait_timeout(tag, n, Duration::from_millis(50)));
            match got {
                Ok(notes) => return payloads(py, notes),
                Err(e) if e.is_timeout() => {
                    py.check_signals()?;
                    if until.is_some_and(|u| std::time::Instant::now() >= u) {
                        return Err(errors::Timeout::new_err(format!(
                            "{n} notification(s) tagged {tag} did not come within {:.3} s",
                            timeout.unwrap_or(0.0)
                        )));
                    }
                }
                Err(e) => return Err(to_py(e)),
            }
        }
    }
}

/// Many peers: each rank publishes its endpoint in a rendezvous (a
/// directory every rank can read: a shared file system, or one machine's
/// /tmp; or etcd), dials a peer on first use and keeps a bounded pool.
#[pyclass(module = "gpu_rdma", frozen)]
struct World {
    inner: gpu_rdma::World,
}

#[pymethods]
impl World {
    /// Joins rank `rank` of `size` (with `rank`/`size` None: from torchrun's,
    /// Slurm's or Open MPI's variables) through the directory `directory`,
    /// or through etcd (`etcd`: its endpoints, "http://host:2379", comma
    /// separated; the job's keys under `job`), listening on `listen`
    /// ("host:port"); `advertise` lists exposed regions every peer may use.
    #[new]
    #[pyo3(signature = (domain, directory=None, rank=None, size=None, job="gpu-rdma", listen=None, advertise=Vec::new(), op_timeout=None, etcd=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, each with its default
    fn new(
        py: Python<'_>,
        domain: &Domain,
        directory: Option<&str>,
        rank: Option<u32>,
        size: Option<u32>,
        job: &str,
        listen: Option<&str>,
        advertise: Vec<PyRef<'_, Exposed>>,
        op_timeout: Option<f64>,
        etcd: Option<&str>,
    ) -> PyResult<Self> {
        let (rank, size) = match (rank, size) {
            (Some(r), Some(s)) => (r, s),
            (None, None) => match gpu_rdma::launch::Rank::from_env().map_err(to_py)? {
                Some(r) => (r.rank, r.world_size),
                None => {
                    return Err(errors::InvalidArgument::new_err(
                        "no rank given and no launcher's variables (RANK/WORLD_SIZE, SLURM_PROCID, OMPI_COMM_WORLD_RANK)",
                    ));
                }
            },
            _ => return Err(errors::InvalidArgument::new_err("give both rank and size, or neither")),
        };
        let rdv: Arc<dyn gpu_rdma::rendezvous::Rendezvous> = match (directory, etcd) {
            (Some(dir), None) => Arc::new(gpu_rdma::rendezvous::DirRendezvous::new(dir).map_err(to_py)?),
            (None, Some(endpoints)) => py.detach(|| etcd_rendezvous(endpoints, job))?,
            _ => return Err(errors::InvalidArgument::new_err("give a directory or etcd endpoints (one of them)")),
        };
        let mut opts = gpu_rdma::WorldOptions::new(job).connect(options(&advertise, op_timeout, None, None, None)?);
        if let Some(addr) = listen {
            opts = opts.listen(addr);
        }
        let inner = py.detach(|| gpu_rdma::World::join(&domain.inner, rank, size, rdv, opts)).map_err(to_py)?;
        Ok(World { inner })
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank()
    }

    #[getter]
    fn size(&self) -> u32 {
        self.inner.size()
    }

    /// The connection to rank `rank`, dialed on first use.
    fn peer(&self, py: Python<'_>, rank: u32) -> PyResult<Connection> {
        Ok(Connection::shared(py.detach(|| self.inner.peer(rank)).map_err(to_py)?))
    }

    /// The connection rank `rank` dialed to this one, waiting up to
    /// `timeout` seconds (default 30) for it.
    #[pyo3(signature = (rank, timeout=None))]
    fn accepted(&self, py: Python<'_>, rank: u32, timeout: Option<f64>) -> PyResult<Connection> {
        let wait = timeout.map_or(Ok(Duration::from_secs(30)), seconds)?;
        Ok(Connection::shared(py.detach(|| self.inner.accepted(rank, wait)).map_err(to_py)?))
    }
}

/// The etcd rendezvous at `endpoints` (comma separated), the job's keys
/// under `job/`.
#[cfg(feature = "etcd")]
fn etcd_rendezvous(endpoints: &str, job: &str) -> PyResult<Arc<dyn gpu_rdma::rendezvous::Rendezvous>> {
    use gpu_rdma::rendezvous::{EtcdOptions, EtcdRendezvous};
    let opts = EtcdOptions::new(endpoints.split(',').map(str::trim).filter(|e| !e.is_empty()))
        .namespace(format!("gpu-rdma/{job}/"));
    Ok(Arc::new(EtcdRendezvous::connect(opts).map_err(to_py)?))
}

#[cfg(not(feature = "etcd"))]
fn etcd_rendezvous(_: &str, _: &str) -> PyResult<Arc<dyn gpu_rdma::rendezvous::Rendezvous>> {
    Err(errors::InvalidArgument::new_err(
        "this wheel was built without etcd: build it with `maturin build --release --features etcd` in python/ \
         (needs protoc: Debian's protobuf-compiler), or meet through a directory",
    ))
}

/// `gpu-rdma doctor` as a dict: the checks (name, status, detail, fix) and
/// the verdict per GPU.
#[pyfunction]
fn doctor<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    use gpu_rdma::topology::{Inputs, LinkClass};
    let report = py.detach(|| {
        let inputs = Inputs::gather(std::path::Path::new("/sys"), std::path::Path::new("/proc"), None, true);
        gpu_rdma::topology::doctor(&inputs, LinkClass::Pxb, None)
    });
    let d = PyDict::new(py);
    let checks = PyList::empty(py);
    for c in &report.checks {
        let cd = PyDict::new(py);
        cd.set_item("name", &c.name)?;
        cd.set_item("status", format!("{:?}", c.status).to_lowercase())?;
        cd.set_item("detail", &c.detail)?;
        cd.set_item("fix", c.fix.clone())?;
        checks.append(cd)?;
    }
    d.set_item("checks", checks)?;
    let verdicts = PyList::empty(py);
    for v in &report.verdicts {
        let vd = PyDict::new(py);
        vd.set_item("gpu", &v.gpu)?;
        vd.set_item("usable", v.usable)?;
        vd.set_item("nic", v.best_nic.clone())?;
        vd.set_item("reasons", v.reasons.clone())?;
        verdicts.append(vd)?;
    }
    d.set_item("verdicts", verdicts)?;
    d.set_item("gpus", report.gpus.clone())?;
    d.set_item("nics", report.nics.clone())?;
    d.set_item("exit_code", report.exit_code)?;
    Ok(d)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether World can meet through etcd (the wheel built with `--features etcd`).
    m.add("HAS_ETCD", cfg!(feature = "etcd"))?;
    ops::init()?;
    m.add_class::<Domain>()?;
    m.add_class::<Region>()?;
    m.add_class::<Exposed>()?;
    m.add_class::<RemoteRegion>()?;
    m.add_class::<Listener>()?;
    m.add_class::<Connection>()?;
    m.add_class::<Inbox>()?;
    m.add_class::<World>()?;
    m.add_class::<Op>()?;
    m.add_class::<Completion>()?;
    m.add_function(wrap_pyfunction!(doctor, m)?)?;
    m.add_function(wrap_pyfunction!(ops::_ready_fd, m)?)?;
    m.add_function(wrap_pyfunction!(ops::_drain, m)?)?;
    errors::add(m)?;
    Ok(())
}
