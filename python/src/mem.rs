//! The memory a Python region is: a host buffer, or CUDA device memory
//! from a DLPack producer.

use gpu_rdma::cuda::CudaBuffer;
use gpu_rdma::{ForeignHost, Memory, MemoryKind};

pub(crate) enum PyMem {
    Host(ForeignHost),
    Cuda(CudaBuffer),
}

// SAFETY: each variant is a `Memory` of its own, whose contract it keeps;
// this only forwards to it.
unsafe impl Memory for PyMem {
    fn as_ptr(&self) -> *mut u8 {
        match self {
            PyMem::Host(m) => m.as_ptr(),
            PyMem::Cuda(m) => m.as_ptr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            PyMem::Host(m) => m.len(),
            PyMem::Cuda(m) => m.len(),
        }
    }

    fn kind(&self) -> MemoryKind {
        match self {
            PyMem::Host(m) => m.kind(),
            PyMem::Cuda(m) => m.kind(),
        }
    }

    fn cuda_buffer(&self) -> Option<&CudaBuffer> {
        match self {
            PyMem::Host(_) => None,
            PyMem::Cuda(m) => Some(m),
        }
    }
}

/// A region as the crate holds it.
pub(crate) type RustRegion = gpu_rdma::Region<PyMem>;

/// Where a Python region's memory is while no operation has it.
pub(crate) type Slot = std::sync::Arc<parking_lot::Mutex<Option<RustRegion>>>;
