//! Memory from Python objects: anything with the buffer protocol (numpy
//! arrays, `bytearray`, `memoryview`), held alive while the NIC may touch
//! it.
//!
//! The wheel is built for the stable ABI of CPython 3.9, whose limited API
//! gained the buffer protocol only in 3.11; the two functions and the
//! `Py_buffer` struct used here have had this exact layout and these exact
//! exported symbols since CPython 3.3 (3.11 only made them part of the
//! limited API, unchanged), so they are declared here by hand.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

use gpu_rdma::ForeignHost;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;

#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut pyo3::ffi::PyObject,
    len: pyo3::ffi::Py_ssize_t,
    itemsize: pyo3::ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut pyo3::ffi::Py_ssize_t,
    strides: *mut pyo3::ffi::Py_ssize_t,
    suboffsets: *mut pyo3::ffi::Py_ssize_t,
    internal: *mut c_void,
}

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut pyo3::ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
    fn PyObject_CheckBuffer(obj: *mut pyo3::ffi::PyObject) -> c_int;
}

const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

/// A buffer view the exporter keeps valid (and unmoved) until released.
struct Held(PyBufferView);

// SAFETY: the view is only read (its pointer and length) off the GIL, and
// released with the GIL held (`release_pending`), as CPython requires.
unsafe impl Send for Held {}
// SAFETY: as above.
unsafe impl Sync for Held {}

/// Work that needs the GIL, let go of where it was not held (a buffer
/// release, a DLPack deleter): done the next time Python calls in (the
/// thread that drops such a value, the engine's, must never wait for the
/// GIL).
type Deferred = Box<dyn FnOnce() + Send>;
static PENDING: Mutex<Vec<Deferred>> = Mutex::new(Vec::new());

/// Runs `f` the next time Python calls in, with the GIL held.
pub(crate) fn defer_with_gil(f: Deferred) {
    PENDING.lock().unwrap_or_else(|e| e.into_inner()).push(f);
}

impl Drop for Held {
    fn drop(&mut self) {
        let view = std::mem::replace(&mut self.0, empty());
        if view.obj.is_null() {
            return;
        }
        let mut held = std::mem::ManuallyDrop::new(Held(view));
        defer_with_gil(Box::new(move || {
            // SAFETY: a view filled by PyObject_GetBuffer and not yet released,
            // released once here, with the GIL held (`release_pending`).
            unsafe { PyBuffer_Release(&mut held.0) };
        }));
    }
}

fn empty() -> PyBufferView {
    PyBufferView {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    }
}

/// Does the work deferred until the GIL is held; `py` proves it is.
pub(crate) fn release_pending(_py: Python<'_>) {
    let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
    for f in pending {
        f();
    }
}

/// Memory of a Python object, and whether it may be written.
pub(crate) struct ObjectMemory {
    pub(crate) mem: crate::mem::PyMem,
    pub(crate) readonly: bool,
}

/// The memory of `obj` (C-contiguous buffer protocol), writable where the
/// object allows it.
///
/// # Errors
/// `BufferError` for an object that is not C-contiguous (naming the fix:
/// `numpy.ascontiguousarray`), `TypeError` for one without the buffer
/// protocol, `ValueError` for an empty one.
pub(crate) fn object_memory(obj: &Bound<'_, PyAny>) -> PyResult<ObjectMemory> {
    release_pending(obj.py());
    // DLPack first where the memory is not the host's (a CUDA tensor), or
    // where there is no buffer protocol (a torch CPU tensor).
    if crate::dlpack::is_producer(obj) {
        let device = crate::dlpack::device_of(obj)?;
        // SAFETY: a live object; the check has no side effect.
        let has_buffer = unsafe { PyObject_CheckBuffer(obj.as_ptr()) } != 0;
        if device.0 != crate::dlpack::CPU || !has_buffer {
            return Ok(ObjectMemory { mem: crate::dlpack::memory(obj, device)?, readonly: false });
        }
    }
    let mut view = empty();
    // SAFETY: a live object (we hold the GIL and a reference) and a view to
    // fill; on success the view holds a reference to the exporter and pins
    // its memory until released.
    let mut rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut view, PYBUF_C_CONTIGUOUS | PYBUF_WRITABLE) };
    let mut readonly = false;
    if rc != 0 {
        let writable_err = PyErr::take(obj.py());
        // Read-only (bytes, a read-only array): usable as a source only.
        // SAFETY: as above.
        rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut view, PYBUF_C_CONTIGUOUS) };
        if rc != 0 {
            let err = PyErr::take(obj.py()).or(writable_err);
            // Strided but not contiguous (a transposed or sliced array)?
            let mut strided = empty();
            // SAFETY: as above; released at once.
            if unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut strided, PYBUF_STRIDES) } == 0 {
                // SAFETY: filled just now, released once.
                unsafe { PyBuffer_Release(&mut strided) };
                return Err(PyBufferError::new_err(
                    "gpu_rdma needs C-contiguous memory, and this buffer is strided: \
                     pass numpy.ascontiguousarray(x) (a copy), or register the array it is a view of",
                ));
            }
            PyErr::take(obj.py());
            return Err(err.unwrap_or_else(|| PyBufferError::new_err("the object refused its buffer")));
        }
        readonly = true;
    }
    let held = Held(view);
    let (ptr, len) = (held.0.buf.cast::<u8>(), held.0.len as usize);
    if len == 0 || ptr.is_null() {
        return Err(PyValueError::new_err("cannot register an empty buffer"));
    }
    // SAFETY: `ptr..ptr + len` is the exporter's C-contiguous memory, which
    // stays valid and unmoved until the view is released: the view moves
    // into the guard, released only after the last registration made from
    // this memory is gone. Python code may read or write it meanwhile (bytes
    // then mix, as the type documents); no Rust reference to it is made.
    let mem =
        unsafe { ForeignHost::from_raw(ptr, len, Box::new(held)) }.map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(ObjectMemory { mem: crate::mem::PyMem::Host(mem), readonly })
}
