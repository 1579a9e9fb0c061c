//! Memory from DLPack producers (`__dlpack__` / `__dlpack_device__`):
//! numpy on the CPU; torch, CuPy and JAX tensors on CUDA devices, which go
//! to the GPU memory paths. The consumer's side of the protocol: take the
//! capsule (renamed `used_dltensor`), read the tensor, and call its deleter
//! once the memory is no longer used (here: when the last registration
//! made from it is gone).

use std::ffi::{CStr, c_void};

use gpu_rdma::ForeignHost;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::buffer::defer_with_gil;
use crate::mem::PyMem;

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

pub(crate) const CPU: i32 = 1;
const CUDA: i32 = 2;
const CUDA_HOST: i32 = 3;
const CUDA_MANAGED: i32 = 13;

const NAME: &CStr = c"dltensor";
const USED: &CStr = c"used_dltensor";

/// A tensor taken from its capsule: its deleter runs (with the GIL, as
/// producers may need it) when this is dropped.
struct Owned(*mut DlManagedTensor);

// SAFETY: the tensor is only read (its pointer, sizes) off the GIL; its
// deleter runs with the GIL held (`defer_with_gil`), as producers expect.
unsafe impl Send for Owned {}
// SAFETY: as above.
unsafe impl Sync for Owned {}

impl Drop for Owned {
    fn drop(&mut self) {
        let managed = Owned(std::mem::replace(&mut self.0, std::ptr::null_mut()));
        if managed.0.is_null() {
            return;
        }
        defer_with_gil(Box::new(move || {
            let managed = std::mem::ManuallyDrop::new(managed);
            // SAFETY: the capsule's tensor, taken once (renamed `used_dltensor`),
            // handed back to its producer once, here, with the GIL held.
            if let Some(deleter) = unsafe { (*managed.0).deleter } {
                unsafe { deleter(managed.0) };
            }
        }));
    }
}

/// Whether `obj` offers DLPack.
pub(crate) fn is_producer(obj: &Bound<'_, PyAny>) -> bool {
    obj.hasattr("__dlpack__").unwrap_or(false) && obj.hasattr("__dlpack_device__").unwrap_or(false)
}

/// The `(device_type, device_id)` the producer says its memory is on.
pub(crate) fn device_of(obj: &Bound<'_, PyAny>) -> PyResult<(i32, i32)> {
    obj.call_method0("__dlpack_device__")?.extract()
}

/// The memory of a DLPack producer on `device` (what its
/// `__dlpack_device__` said): host memory (CPU, CUDA host) as
/// `ForeignHost`, CUDA device memory as a `CudaBuffer` for the GPU paths;
/// CUDA managed memory is refused. For CUDA memory (device or pinned
/// host), work queued on the device so far is waited for once here (the
/// producer is asked for no stream of ours).
pub(crate) fn memory(obj: &Bound<'_, PyAny>, (kind, ordinal): (i32, i32)) -> PyResult<PyMem> {
    let py = obj.py();
    if kind == CUDA_MANAGED {
        // The driver migrates managed pages between host and device on
        // demand: neither a host registration (pinning pages the GPU may
        // want back) nor a GPU path (nvidia-peermem and dma-buf take device
        // allocations only) reaches it safely.
        return Err(PyTypeError::new_err(
            "CUDA managed memory (DLPack kDLCUDAManaged) cannot be registered: the driver moves its pages \
             between host and GPU; copy it into device memory (torch: x.to('cuda'), CuPy: cupy.asarray) \
             or host memory first",
        ));
    }
    if !matches!(kind, CPU | CUDA | CUDA_HOST) {
        return Err(PyTypeError::new_err(format!("DLPack device type {kind} is neither the CPU nor a CUDA device")));
    }
    let capsule = obj.call_method0("__dlpack__")?;
    // SAFETY: `capsule` is a live object; PyCapsule_GetPointer checks its
    // type and name and returns NULL (with an exception) if they differ.
    let managed = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), NAME.as_ptr()) };
    if managed.is_null() {
        return Err(PyErr::take(py).unwrap_or_else(|| PyTypeError::new_err("__dlpack__ gave no dltensor capsule")));
    }
    let managed = managed.cast::<DlManagedTensor>();
    // Taken: the capsule's own destructor must not free it any more.
    // SAFETY: a live capsule; renaming is how a consumer marks it taken.
    if unsafe { pyo3::ffi::PyCapsule_SetName(capsule.as_ptr(), USED.as_ptr()) } != 0 {
        return Err(PyErr::fetch(py));
    }
    let owned = Owned(managed);
    // SAFETY: the producer keeps the tensor (and its shape and strides)
    // valid until its deleter runs, which `owned` does last.
    let t = unsafe { &(*managed).dl_tensor };
    let (ptr, len) = contiguous_extent(t)?;
    match kind {
        CUDA => cuda_memory(ordinal, ptr, len, owned),
        _ => {
            if kind == CUDA_HOST {
                // Pinned host memory a copy on the producer's streams may
                // still be filling: that work, done before the NIC reads.
                cuda_device(ordinal)?.synchronize().map_err(crate::errors::to_py)?;
            }
            // SAFETY: host memory of the producer's, valid until its deleter
            // runs, which the guard moved into the value does last.
            let mem = unsafe { ForeignHost::from_raw(ptr.cast(), len, Box::new(owned)) }
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            Ok(PyMem::Host(mem))
        }
    }
}

/// Start and length in bytes of a C-contiguous tensor; an error naming the
/// fix for any other.
fn contiguous_extent(t: &DlTensor) -> PyResult<(*mut u8, usize)> {
    if t.dtype.lanes != 1 || t.dtype.bits % 8 != 0 || t.ndim < 0 {
        return Err(PyTypeError::new_err("a DLPack tensor of whole bytes per element, one lane"));
    }
    let item = i64::from(t.dtype.bits / 8);
    let ndim = t.ndim as usize;
    // SAFETY: `shape` has `ndim` entries (DLPack), `strides` too or is NULL.
    let shape: &[i64] = if ndim == 0 { &[] } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) } };
    let strides: Option<&[i64]> =
        (!t.strides.is_null() && ndim > 0).then(|| unsafe { std::slice::from_raw_parts(t.strides, ndim) });
    let mut elems: i64 = 1;
    for &n in shape {
        elems = elems.checked_mul(n).filter(|&e| e >= 0).ok_or_else(|| PyValueError::new_err("a tensor too large"))?;
    }
    if let Some(strides) = strides {
        let mut want = 1i64;
        for (&n, &s) in shape.iter().zip(strides).rev() {
            if n > 1 && s != want {
                return Err(PyBufferError::new_err(
                    "gpu_rdma needs C-contiguous memory, and this tensor is strided: pass x.contiguous() \
                     (torch) or numpy.ascontiguousarray(x) (a copy)",
                ));
            }
            want = want.saturating_mul(n);
        }
    }
    let len = elems.checked_mul(item).ok_or_else(|| PyValueError::new_err("a tensor too large"))? as usize;
    if len == 0 || t.data.is_null() {
        return Err(PyValueError::new_err("cannot register an empty tensor"));
    }
    Ok((t.data.cast::<u8>().wrapping_add(t.byte_offset as usize), len))
}

/// The CUDA device a DLPack producer names.
fn cuda_device(ordinal: i32) -> PyResult<gpu_rdma::cuda::CudaDevice> {
    gpu_rdma::cuda::CudaDevice::open(usize::try_from(ordinal).unwrap_or(usize::MAX)).map_err(crate::errors::to_py)
}

fn cuda_memory(ordinal: i32, ptr: *mut u8, len: usize, owned: Owned) -> PyResult<PyMem> {
    use gpu_rdma::cuda::CudaBuffer;
    let to_py = crate::errors::to_py;
    let dev = cuda_device(ordinal)?;
    // The producer's work on its own streams, done before the NIC reads.
    dev.synchronize().map_err(to_py)?;
    // SAFETY: device memory of `dev` the producer keeps allocated until its
    // deleter runs, which the guard moved into the buffer does last (after
    // every registration made from the buffer).
    let buf = unsafe { CudaBuffer::from_raw(&dev, ptr as u64, len, Box::new(owned)) }.map_err(to_py)?;
    Ok(PyMem::Cuda(buf))
}
