"""DLPack CUDA tensors: a small DLPack producer (ctypes over libcuda: the
CUDA stand-in in CI, the driver on a GPU machine) hands device memory to
gpu_rdma, which registers it on the GPU paths (staged over TCP; with
GPU_RDMA_MEM_PATH=peermem on rxe0, the peermem path) and moves it,
verified on the device. Without a libcuda these tests skip, saying so;
`cargo xtask test` runs them with the stand-in and counts them."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dlpack_producer import CUDA, DeviceArray  # noqa: E402
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
