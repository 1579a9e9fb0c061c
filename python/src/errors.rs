//! The exception hierarchy, mirroring the crate's `Error` and `Failure`:
//! every exception is a `GpuRdmaError`, and carries the crate's message.

use gpu_rdma::{Error, Failure};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(gpu_rdma, GpuRdmaError, PyException, "Any error of gpu_rdma.");
create_exception!(gpu_rdma, InvalidArgument, GpuRdmaError, "A call's argument is wrong (nothing was done).");
create_exception!(gpu_rdma, OutOfBounds, InvalidArgument, "A range past a region's end, here or at the peer.");
create_exception!(gpu_rdma, RegionInUse, InvalidArgument, "The region is in an operation: wait for it first.");
create_exception!(gpu_rdma, ReadOnlyBuffer, InvalidArgument, "A read-only buffer was given as an operation's target.");
create_exception!(gpu_rdma, Timeout, GpuRdmaError, "Nothing came within the time given (the operation may still run).");
create_exception!(gpu_rdma, ConnectionLost, GpuRdmaError, "The connection broke or the peer went away.");
create_exception!(gpu_rdma, RemoteAccessError, GpuRdmaError, "The peer refused the access: key, bounds or rights.");
create_exception!(gpu_rdma, OperationFailed, GpuRdmaError, "An operation completed with an error status.");
create_exception!(
    gpu_rdma,
    PeerTransferFailed,
    GpuRdmaError,
    "The peer's transfer list failed (its notification says why)."
);
create_exception!(
    gpu_rdma,
    NoDevice,
    GpuRdmaError,
    "No usable RDMA device (the domain falls back to TCP unless verbs was asked for)."
);
create_exception!(gpu_rdma, CudaError, GpuRdmaError, "CUDA is missing or refused a call.");

/// The Python exception for `e`, with the crate's message.
pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::InvalidArgument(_)
        | Error::LengthMismatch { .. }
        | Error::BadEnv { .. }
        | Error::DomainMismatch { .. } => InvalidArgument::new_err(msg),
        Error::OutOfBounds { .. } => OutOfBounds::new_err(msg),
        Error::Timeout { .. } => Timeout::new_err(msg),
        Error::ConnectionLost { .. } | Error::PeerGone { .. } => ConnectionLost::new_err(msg),
        Error::AccessDenied { .. } => RemoteAccessError::new_err(msg),
        Error::PeerTransferFailed { .. } => PeerTransferFailed::new_err(msg),
        Error::NoDevice { .. } | Error::DeviceNotFound { .. } | Error::NoActivePort { .. } | Error::NoGid { .. } => {
            NoDevice::new_err(msg)
        }
        Error::CudaUnavailable { .. } | Error::Cuda { .. } | Error::NoCudaDevice { .. } => CudaError::new_err(msg),
        Error::Interrupted { .. } => pyo3::exceptions::PyKeyboardInterrupt::new_err(msg),
        _ => match e.failure() {
            Some(Failure::RemoteAccess) => RemoteAccessError::new_err(msg),
            Some(Failure::Flushed | Failure::PeerUnreachable) => ConnectionLost::new_err(msg),
            Some(_) => OperationFailed::new_err(msg),
            None => GpuRdmaError::new_err(msg),
        },
    }
}

/// Adds the exceptions to the module.
pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("GpuRdmaError", py.get_type::<GpuRdmaError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("OutOfBounds", py.get_type::<OutOfBounds>())?;
    m.add("RegionInUse", py.get_type::<RegionInUse>())?;
    m.add("ReadOnlyBuffer", py.get_type::<ReadOnlyBuffer>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("ConnectionLost", py.get_type::<ConnectionLost>())?;
    m.add("RemoteAccessError", py.get_type::<RemoteAccessError>())?;
    m.add("OperationFailed", py.get_type::<OperationFailed>())?;
    m.add("PeerTransferFailed", py.get_type::<PeerTransferFailed>())?;
    m.add("NoDevice", py.get_type::<NoDevice>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    Ok(())
}
