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

/// A region as an operation holds it: shared, so that any number of
/// operations may read it at once.
pub(crate) type OpBuffer = gpu_rdma::Shared<PyMem>;

/// Who has a Python region's memory now: many operations may read it at
/// once (sends, writes: each holds a clone), one that writes it (a receive,
/// a read) has it alone, and an exposure has it for good.
pub(crate) enum Held {
    /// No operation writes it; operations reading it may be in flight.
    Open(OpBuffer),
    /// An operation writes into it; it comes back when that one is done.
    Writing,
    /// Moved into an exposure.
    Exposed,
}

/// Where a Python region's memory is, shared with the operations that
/// give it back.
pub(crate) type Slot = std::sync::Arc<parking_lot::Mutex<Held>>;

const IN_USE: &str = "the region is in use by an operation (or exposed): wait for it first";

/// The region for an operation that reads it: shared with any others that
/// do; refused while one writes it or once it is exposed.
pub(crate) fn for_reading(slot: &Slot) -> Result<OpBuffer, &'static str> {
    match &*slot.lock() {
        Held::Open(b) => Ok(b.clone()),
        Held::Writing | Held::Exposed => Err(IN_USE),
    }
}

/// The region alone: for an operation that writes it (then it is
/// [`Held::Writing`] until [`give_back`]), refused while any operation
/// has it.
pub(crate) fn alone(slot: &Slot) -> Result<RustRegion, &'static str> {
    let mut held = slot.lock();
    match std::mem::replace(&mut *held, Held::Writing) {
        Held::Open(b) => b.try_into_region().map_err(|b| {
            *held = Held::Open(b);
            IN_USE
        }),
        other => {
            *held = other;
            Err(IN_USE)
        }
    }
}

/// Puts back the region an operation that wrote it had alone.
pub(crate) fn give_back(slot: &Slot, buffer: OpBuffer) {
    *slot.lock() = Held::Open(buffer);
}
