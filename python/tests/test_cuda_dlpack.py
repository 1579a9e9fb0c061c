"""DLPack CUDA tensors: a small DLPack producer (ctypes over libcuda: the
CUDA stand-in in CI, the driver on a GPU machine) hands device memory to
gpu_rdma, which registers it on the GPU paths (staged over TCP; with
GPU_RDMA_MEM_PATH=peermem on rxe0, the peermem path) and moves it,
verified on the device. Without a libcuda these tests skip, saying so;
`cargo xtask test` runs them with the stand-in and counts them."""

import ctypes
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dlpack_producer import CUDA, DeviceArray, HostArray, check  # noqa: E402
from loopback import domain, pair  # noqa: E402

pytestmark = pytest.mark.skipif(CUDA is None, reason="no libcuda here (the CUDA stand-in or a driver): not run")


def expected_path():
    forced = os.environ.get("GPU_RDMA_MEM_PATH")
    if forced:
        return forced
    return "staged" if not os.environ.get("GPU_RDMA_TEST_DEVICE") else None


def test_a_dlpack_cuda_tensor_is_received_into_and_sent_from_on_the_gpu_path():
    d = domain()
    s, c = pair(d)
    n = 1 << 20
    gpu = DeviceArray(n)
    region = d.register(gpu)
    want = expected_path()
    assert region.memory_path is not None, "registered as GPU memory"
    if want:
        assert region.memory_path == want, region.memory_path
    data = np.frombuffer(os.urandom(n), dtype=np.uint8).copy()
    rx = s.recv(region)
    c.send(d.register(data)).wait(timeout=60)
    assert rx.wait(timeout=60).bytes == n
    assert gpu.download() == data.tobytes(), "the bytes landed in device memory"
    # And back out of it.
    back = np.zeros(n, dtype=np.uint8)
    rx = c.recv(d.register(back))
    s.send(region).wait(timeout=60)
    rx.wait(timeout=60)
    assert np.array_equal(back, data)
    # The producer's deleter runs once the region is gone, not before.
    assert gpu.deleted == 0
    del region, rx
    d.register(bytearray(1))  # a call into the module does the deferred work
    assert gpu.deleted == 1, "the DLPack deleter ran once"


def test_a_strided_dlpack_tensor_is_refused_with_the_fix():
    d = domain()
    with pytest.raises(BufferError, match="contiguous"):
        d.register(DeviceArray(4096, strided=True))


def test_pinned_host_memory_a_cuda_copy_fills_is_sent_once_the_copy_is_done():
    d = domain()
    s, c = pair(d)
    n = 1 << 20
    gpu = DeviceArray(n)  # also makes the device's context current
    stream = ctypes.c_void_p()
    check(CUDA.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")
    # A kernel fills device memory (the stand-in's lands 300 ms late), and a
    # copy behind it on the same stream brings it into pinned host memory.
    if hasattr(CUDA, "gpu_rdma_stub_produce"):
        check(CUDA.gpu_rdma_stub_produce(stream, gpu.ptr, ctypes.c_size_t(n // 4), ctypes.c_uint32(0x5A5A5A5A),
                                         ctypes.c_uint32(300_000)), "produce")
    else:
        check(CUDA.cuMemsetD32Async(gpu.ptr, ctypes.c_uint32(0x5A5A5A5A), ctypes.c_size_t(n // 4), stream), "memset")
    host = HostArray(n, device=3)  # kDLCUDAHost
    check(CUDA.cuMemcpyDtoHAsync_v2(host.buf, gpu.ptr, ctypes.c_size_t(n), stream), "cuMemcpyDtoHAsync")
    region = d.register(host)
    assert region.memory_path is None, "registered as host memory"
    got = np.zeros(n, dtype=np.uint8)
    rx = c.recv(d.register(got))
    s.send(region).wait(timeout=60)
    rx.wait(timeout=60)
    assert (got == 0x5A).all(), f"the send read the memory before the copy filled it: {np.count_nonzero(got != 0x5A)} stale bytes"
