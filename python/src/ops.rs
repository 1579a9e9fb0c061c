//! Operations as Python sees them: a handle to wait on (the GIL released,
//! Ctrl-C honoured) or to await in asyncio. A blocking wait drives the
//! operation itself, as a Rust caller's does. An awaited (or dropped)
//! operation is carried by the domain's engine, whose thread never takes
//! the GIL: its completion stores the outcome, hands the region back,
//! wakes blocking waiters, and for awaited operations queues the handle
//! and rings one eventfd that every event loop awaiting here watches. The
//! loop's reader resolves the futures: no thread per operation.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;

use crate::buffer::release_pending;
use crate::errors::to_py;
use crate::mem::{OpBuffer, Slot};
use crate::tasks::Task;

/// What a finished operation says.
#[pyclass(module = "gpu_rdma", frozen, get_all)]
#[derive(Clone, Debug)]
pub(crate) struct Completion {
    /// Bytes moved (a receive: the message's length).
    pub(crate) bytes: u64,
    /// The immediate a receive carried, if any.
    pub(crate) imm: Option<u32>,
    /// Requests on the wire (transfer lists; 1 otherwise).
    pub(crate) requests: usize,
}

#[pymethods]
impl Completion {
    fn __repr__(&self) -> String {
        format!("Completion(bytes={}, imm={:?}, requests={})", self.bytes, self.imm, self.requests)
    }
}

enum State {
    Running { futures: Vec<Py<PyAny>> },
    Done(Result<Completion, PyErr>),
}

struct OpShared {
    state: Mutex<State>,
    done: Condvar,
}

impl OpShared {
    fn new() -> Arc<OpShared> {
        Arc::new(OpShared { state: Mutex::new(State::Running { futures: Vec::new() }), done: Condvar::new() })
    }

    /// Called once, by the thread that saw the operation end (never with a
    /// need for the GIL): stores the outcome and wakes whoever waits or
    /// awaits.
    fn finish(self: &Arc<Self>, outcome: Result<Completion, PyErr>) {
        {
            let mut state = self.state.lock();
            if let State::Running { futures } = std::mem::replace(&mut *state, State::Done(outcome)) {
                // Their futures are resolved by the loop's reader (with the
                // GIL): keep them until then.
                if !futures.is_empty() {
                    ready().push(Arc::clone(self), futures);
                }
            }
        }
        self.done.notify_all();
    }
}

/// An awaited operation that finished, with the futures awaiting it.
type Settled = (Arc<OpShared>, Vec<Py<PyAny>>);

/// Awaited operations that finished, and the eventfd that says so.
struct Ready {
    queue: Mutex<VecDeque<Settled>>,
    /// Awaited crate futures woken since the reader last looked.
    tasks: Mutex<Vec<Arc<Task>>>,
    fd: OwnedFd,
}

impl Ready {
    fn push(&self, op: Arc<OpShared>, futures: Vec<Py<PyAny>>) {
        self.queue.lock().push_back((op, futures));
        self.ring();
    }

    fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: an eventfd we own; an 8-byte write of a counter increment.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

static READY: OnceLock<Ready> = OnceLock::new();

/// Makes the eventfd, when the module is imported: an import fails with
/// `OSError` where the kernel refuses one, rather than an await later.
pub(crate) fn init() -> PyResult<()> {
    if READY.get().is_none() {
        // SAFETY: plain eventfd creation; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a fresh fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let _ = READY.set(Ready { queue: Mutex::new(VecDeque::new()), tasks: Mutex::new(Vec::new()), fd });
    }
    Ok(())
}

/// The ready queue, made by [`init`] at import (nothing here runs before).
fn ready() -> &'static Ready {
    READY.get().expect("the module's init made the ready queue before any operation")
}

/// Queues a woken task for the loop's reader (any thread, no GIL).
pub(crate) fn queue_task(task: Arc<Task>) {
    ready().tasks.lock().push(task);
    ready().ring();
}

/// The eventfd an event loop watches (`loop.add_reader`) to learn that
/// awaited operations finished.
#[pyfunction]
pub(crate) fn _ready_fd() -> i32 {
    ready().fd.as_raw_fd()
}

/// Resolves the futures of the awaited operations that finished (the event
/// loop's reader; each future through its own loop).
#[pyfunction]
pub(crate) fn _drain(py: Python<'_>) -> PyResult<()> {
    release_pending(py);
    let mut n: u64 = 0;
    // SAFETY: an 8-byte read of the eventfd's counter (non-blocking).
    let _ = unsafe { libc::read(ready().fd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
    let done: Vec<_> = ready().queue.lock().drain(..).collect();
    for (op, futures) in done {
        for fut in futures {
            resolve(py, &op, fut.bind(py))?;
        }
    }
    let woken = std::mem::take(&mut *ready().tasks.lock());
    crate::tasks::hand_back(py, woken)
}

/// Sets `fut`'s result or exception from `op`'s outcome, through the
/// future's loop (`call_soon_threadsafe`: any loop, any thread).
fn resolve(py: Python<'_>, op: &OpShared, fut: &Bound<'_, PyAny>) -> PyResult<()> {
    let aio = py.import("gpu_rdma._aio")?;
    let state = op.state.lock();
    let State::Done(outcome) = &*state else { return Ok(()) };
    let (ok, value) = match outcome {
        Ok(c) => (true, Py::new(py, c.clone())?.into_any()),
        Err(e) => (false, e.clone_ref(py).into_value(py).into_any()),
    };
    drop(state);
    aio.call_method1("settle", (fut, ok, value))?;
    Ok(())
}

/// The crate's handle of an operation, until it is waited for (then the
/// waiting thread drives it, as a Rust caller's would), awaited or
/// dropped (then the engine carries it to its end).
pub(crate) enum Handle {
    One(gpu_rdma::Pending<OpBuffer>),
    Imm(gpu_rdma::Pending<()>),
    List(gpu_rdma::Transfer<OpBuffer>),
}

fn completion(c: gpu_rdma::Completion) -> Completion {
    Completion { bytes: u64::from(c.byte_len), imm: c.imm, requests: 1 }
}

fn moved(t: gpu_rdma::Transferred) -> Completion {
    Completion { bytes: t.bytes, imm: None, requests: t.requests }
}

/// Puts the region an operation wrote back where the Python region finds
/// it (an operation that read it has no slot: its clone is dropped).
fn give_back(slot: &Option<Slot>, region: Option<OpBuffer>) {
    if let (Some(slot), Some(region)) = (slot, region) {
        crate::mem::give_back(slot, region);
    }
}

impl Handle {
    /// Hands the operation to the engine: its outcome goes to `shared`,
    /// its region back to `slot`, whenever it ends.
    fn detach_to(self, shared: Arc<OpShared>, slot: Option<Slot>) {
        match self {
            Handle::One(p) => p.on_complete(move |res, buf| {
                give_back(&slot, buf);
                shared.finish(res.map(completion).map_err(to_py));
            }),
            Handle::Imm(p) => p.on_complete(move |res, _| shared.finish(res.map(completion).map_err(to_py))),
            Handle::List(t) => t.on_complete(move |res, buf| {
                give_back(&slot, buf);
                shared.finish(res.map(moved).map_err(to_py));
            }),
        }
    }

    /// Waits up to `slice` for the operation, this thread driving it: its
    /// outcome once it ended (the region back in `slot`), or the handle
    /// while it is still in flight.
    fn wait_for(self, slice: Duration, slot: &Option<Slot>) -> Waited {
        match self {
            Handle::One(mut p) => match p.wait_timeout(slice) {
                Err(e) if e.is_timeout() && !p.is_done() => Waited::Running(Handle::One(p)),
                outcome => {
                    give_back(slot, p.into_buffer().ok());
                    Waited::Ended(outcome.map(completion))
                }
            },
            Handle::Imm(mut p) => match p.wait_timeout(slice) {
                Err(e) if e.is_timeout() && !p.is_done() => Waited::Running(Handle::Imm(p)),
                outcome => Waited::Ended(outcome.map(completion)),
            },
            Handle::List(mut t) => match t.wait_timeout(slice) {
                Err(e) if e.is_timeout() && !t.is_done() => Waited::Running(Handle::List(t)),
                first => {
                    let outcome = match t.finish() {
                        Ok((done, b)) => {
                            give_back(slot, Some(b));
                            Ok(moved(done))
                        }
                        Err(failed) => {
                            give_back(slot, failed.buffer);
                            Err(first.err().unwrap_or(failed.error))
                        }
                    };
                    Waited::Ended(outcome)
                }
            },
        }
    }
}

/// What a wait on a handle found.
enum Waited {
    Ended(Result<Completion, gpu_rdma::Error>),
    Running(Handle),
}

/// An operation in flight, or done.
#[pyclass(module = "gpu_rdma")]
pub(crate) struct Op {
    shared: Arc<OpShared>,
    /// The crate's handle, until the operation is waited for, awaited or
    /// dropped; and where its region goes back.
    lazy: Mutex<Option<Handle>>,
    slot: Option<Slot>,
}

impl Op {
    pub(crate) fn new(handle: Handle, slot: Option<Slot>) -> Op {
        Op { shared: OpShared::new(), lazy: Mutex::new(Some(handle)), slot }
    }

    /// From now on the engine carries it (for `await`, and when dropped).
    fn hand_to_engine(&self) {
        if let Some(h) = self.lazy.lock().take() {
            h.detach_to(Arc::clone(&self.shared), self.slot.clone());
        }
    }

    fn outcome(&self, py: Python<'_>) -> Option<PyResult<Completion>> {
        match &*self.shared.state.lock() {
            State::Done(Ok(c)) => Some(Ok(c.clone())),
            State::Done(Err(e)) => Some(Err(e.clone_ref(py))),
            State::Running { .. } => None,
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        self.hand_to_engine();
    }
}

#[pymethods]
impl Op {
    /// Waits for the operation (the GIL released) and returns its
    /// `Completion`; `timeout` in seconds (None: the connection's operation
    /// timeout applies inside the crate). Ctrl-C interrupts the wait; the
    /// operation stays in flight and may be waited for again.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Completion> {
        release_pending(py);
        let until = timeout.map(crate::seconds).transpose()?.map(|t| Instant::now() + t);
        // Short slices, so Ctrl-C is seen within 50 ms.
        let slice = |now: Instant| {
            until.map_or(Duration::from_millis(50), |u| u.saturating_duration_since(now).min(Duration::from_millis(50)))
        };
        loop {
            if let Some(outcome) = self.outcome(py) {
                return outcome;
            }
            let handle = self.lazy.lock().take();
            match handle {
                // This thread drives it, as a Rust caller's wait does.
                Some(h) => {
                    let wait = slice(Instant::now());
                    let slot = self.slot.clone();
                    let (h, ended) = py.detach(move || match h.wait_for(wait, &slot) {
                        Waited::Ended(outcome) => (None, Some(outcome)),
                        Waited::Running(h) => (Some(h), None),
                    });
                    if let Some(outcome) = ended {
                        self.shared.finish(outcome.map_err(to_py));
                        continue;
                    }
                    *self.lazy.lock() = h;
                }
                // Awaited before: the engine carries it; sleep until it ends.
                None => {
                    let wait = slice(Instant::now());
                    let shared = Arc::clone(&self.shared);
                    py.detach(move || {
                        let mut state = shared.state.lock();
                        if matches!(&*state, State::Running { .. }) {
                            shared.done.wait_for(&mut state, wait);
                        }
                    });
                }
            }
            py.check_signals()?;
            if until.is_some_and(|u| Instant::now() >= u) && self.outcome(py).is_none() {
                return Err(crate::errors::Timeout::new_err(format!(
                    "the operation did not finish within {:.3} s (it is still in flight: wait again)",
                    timeout.unwrap_or(0.0)
                )));
            }
        }
    }

    /// Whether it finished (without waiting).
    fn done(&self, py: Python<'_>) -> bool {
        if self.outcome(py).is_some() {
            return true;
        }
        let handle = self.lazy.lock().take();
        if let Some(h) = handle {
            match h.wait_for(Duration::ZERO, &self.slot) {
                Waited::Ended(outcome) => self.shared.finish(outcome.map_err(to_py)),
                Waited::Running(h) => *self.lazy.lock() = Some(h),
            }
        }
        self.outcome(py).is_some()
    }

    fn __await__(slf: PyRef<'_, Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        slf.hand_to_engine();
        let aio = py.import("gpu_rdma._aio")?;
        let fut = aio.call_method0("future")?;
        let done = match &mut *slf.shared.state.lock() {
            State::Running { futures } => {
                futures.push(fut.clone().unbind());
                false
            }
            State::Done(_) => true,
        };
        if done {
            resolve(py, &slf.shared, &fut)?;
        }
        Ok(fut.call_method0("__await__")?.unbind())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("Op(done={})", self.outcome(py).is_some())
    }
}
