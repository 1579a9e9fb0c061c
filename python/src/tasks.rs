//! Futures of the crate awaited from asyncio, with no thread of their
//! own. A [`Task`] is polled on its event loop's thread. Its waker, which
//! the crate calls from any thread and never with the GIL, queues it and
//! rings the eventfd that every loop awaiting here watches; the loop's
//! reader hands each woken task to its own loop (`call_soon_threadsafe`),
//! which polls it again. A task whose Python future is already done (a
//! timeout cancelled it) is dropped unpolled: it takes nothing, such as a
//! notification, that its awaiter would not get.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use parking_lot::Mutex;
use pyo3::prelude::*;

/// What a finished crate future leaves: the Python future's result, made
/// with the GIL (an `Err`: the exception it raises).
pub(crate) type Outcome = Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>;

/// A crate future as a task runs it.
pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// A crate future and the Python future awaiting it.
pub(crate) struct Task {
    future: Mutex<Option<BoxFuture>>,
    py_future: Py<PyAny>,
    py_loop: Py<PyAny>,
    /// Queued to be polled: queued once however often woken meanwhile.
    queued: AtomicBool,
}

/// Starts `future` for `py_future`, of the running loop (this thread):
/// polled once now, then each time the crate wakes it.
pub(crate) fn start(py: Python<'_>, future: BoxFuture, py_future: Py<PyAny>) -> PyResult<()> {
    let py_loop = py_future.bind(py).call_method0("get_loop")?.unbind();
    let task = Task { future: Mutex::new(Some(future)), py_future, py_loop, queued: AtomicBool::new(false) };
    Arc::new(task).step(py)
}

impl Task {
    /// Polls the task once, on its loop's thread; settles its Python future
    /// when it ends.
    fn step(self: Arc<Self>, py: Python<'_>) -> PyResult<()> {
        let fut = self.py_future.bind(py).clone();
        if fut.call_method0("done")?.is_truthy()? {
            self.future.lock().take();
            return Ok(());
        }
        let waker = Waker::from(Arc::clone(&self));
        // Without the GIL: a look may wait on CUDA (making landed GPU data
        // visible) or on a lock a GIL-less thread holds.
        let out = py.detach(|| {
            let mut slot = self.future.lock();
            let future = slot.as_mut()?;
            match future.as_mut().poll(&mut Context::from_waker(&waker)) {
                Poll::Pending => None,
                Poll::Ready(out) => {
                    slot.take();
                    Some(out)
                }
            }
        });
        let Some(out) = out else { return Ok(()) };
        match out(py) {
            Ok(value) => fut.call_method1("set_result", (value,))?,
            Err(e) => fut.call_method1("set_exception", (e.into_value(py),))?,
        };
        Ok(())
    }
}

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            crate::ops::queue_task(self);
        }
    }
}

/// A woken task's next poll, handed to its loop.
#[pyclass(module = "gpu_rdma", frozen)]
pub(crate) struct Step(Arc<Task>);

#[pymethods]
impl Step {
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        Arc::clone(&self.0).step(py)
    }
}

/// Hands each of `woken` to its loop for its next poll; the next wake
/// queues it again.
pub(crate) fn hand_back(py: Python<'_>, woken: Vec<Arc<Task>>) -> PyResult<()> {
    for task in woken {
        task.queued.store(false, Ordering::Release);
        let py_loop = task.py_loop.bind(py).clone();
        if py_loop.call_method0("is_closed")?.is_truthy()? {
            continue;
        }
        py_loop.call_method1("call_soon_threadsafe", (Step(task),))?;
    }
    Ok(())
}
