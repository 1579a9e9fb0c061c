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
