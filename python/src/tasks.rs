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

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Turns a finished future's output into the Python future's result, with
/// the GIL (an `Err`: the exception it raises).
pub(crate) type Settle<T> = fn(Python<'_>, T) -> PyResult<Py<PyAny>>;

/// A crate future and the Python future awaiting it.
struct Task<T> {
    future: Mutex<Option<BoxFuture<T>>>,
    settle: Settle<T>,
    py_future: Py<PyAny>,
    py_loop: Py<PyAny>,
    /// Queued to be polled: queued once however often woken meanwhile.
    queued: AtomicBool,
}

/// A task, whatever its output, as the eventfd's reader sees it.
pub(crate) trait Woken: Send + Sync {
    /// Polls the task once, on its loop's thread; settles its Python
    /// future when it ends.
    fn step(self: Arc<Self>, py: Python<'_>) -> PyResult<()>;
    /// The loop it is polled on.
    fn py_loop(&self) -> &Py<PyAny>;
    /// Taken off the queue: the next wake queues it again.
    fn unqueue(&self);
}

/// Starts `future` for `py_future`, of the running loop (this thread):
/// polled once now, then each time the crate wakes it.
pub(crate) fn start<T: Send + 'static>(
    py: Python<'_>,
    future: BoxFuture<T>,
    settle: Settle<T>,
    py_future: Py<PyAny>,
) -> PyResult<()> {
    let py_loop = py_future.bind(py).call_method0("get_loop")?.unbind();
    let task = Task { future: Mutex::new(Some(future)), settle, py_future, py_loop, queued: AtomicBool::new(false) };
    Arc::new(task).step(py)
}

impl<T: Send + 'static> Woken for Task<T> {
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
        match (self.settle)(py, out) {
            Ok(value) => fut.call_method1("set_result", (value,))?,
            Err(e) => fut.call_method1("set_exception", (e.into_value(py),))?,
        };
        Ok(())
    }

    fn py_loop(&self) -> &Py<PyAny> {
        &self.py_loop
    }

    fn unqueue(&self) {
        self.queued.store(false, Ordering::Release);
    }
}

impl<T: Send + 'static> Wake for Task<T> {
    fn wake(self: Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            crate::ops::queue_task(self);
        }
    }
}

/// A woken task's next poll, handed to its loop.
#[pyclass(module = "gpu_rdma", frozen)]
pub(crate) struct Step(Arc<dyn Woken>);

#[pymethods]
impl Step {
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        Arc::clone(&self.0).step(py)
    }
}

/// Hands each of `woken` to its loop for its next poll.
pub(crate) fn hand_back(py: Python<'_>, woken: Vec<Arc<dyn Woken>>) -> PyResult<()> {
    for task in woken {
        task.unqueue();
        let py_loop = task.py_loop().bind(py).clone();
        if py_loop.call_method0("is_closed")?.is_truthy()? {
            continue;
        }
        py_loop.call_method1("call_soon_threadsafe", (Step(task),))?;
    }
    Ok(())
}
