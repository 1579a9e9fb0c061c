// A framework's crate: its own cudarc context and stream, and gpu-rdma's
// domain and GPU memory, in one build.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

/// What a framework holds: its context and stream, and an RDMA domain.
pub struct Engine {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub domain: gpu_rdma::Domain,
}

/// Opens both, the framework's CUDA context first.
pub fn open(ordinal: usize) -> Result<Engine, Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(ordinal)?;
    let stream = ctx.default_stream();
    let domain = gpu_rdma::Domain::open_near_gpu(ordinal)?;
    Ok(Engine { ctx, stream, domain })
}

/// gpu-rdma's view of the same GPU.
pub fn gpu(ordinal: usize) -> gpu_rdma::Result<gpu_rdma::cuda::CudaDevice> {
    gpu_rdma::cuda::CudaDevice::open(ordinal)
}

/// A tensor's storage, registered as it is, and a fence on the
/// framework's stream for what it queued there.
pub fn register(
    engine: &Engine,
    storage: cudarc::driver::CudaSlice<f32>,
) -> Result<gpu_rdma::Region<gpu_rdma::cuda::CudaBuffer>, Box<dyn std::error::Error>> {
    let fence = gpu_rdma::cuda::CudaStream::from_cudarc(&engine.stream)?;
    let buf = gpu_rdma::cuda::CudaBuffer::from_cudarc(storage)?;
    buf.ready_after(&fence)?;
    Ok(engine.domain.register(buf, gpu_rdma::Access::LOCAL).map_err(|e| e.error)?)
}
