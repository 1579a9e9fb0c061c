"""DLPack CUDA tensors: a small DLPack producer (ctypes over libcuda: the
CUDA stand-in in CI, the driver on a GPU machine) hands device memory to
gpu_rdma, which registers it on the GPU paths (staged over TCP; with
GPU_RDMA_MEM_PATH=peermem on rxe0, the peermem path) and moves it,
verified on the device. Without a libcuda these tests skip, saying so;
`cargo xtask test` runs them with the stand-in and counts them."""

import ctypes
import os
import threading

import numpy as np
import pytest

import gpu_rdma


def _libcuda():
    for name in ("libcuda.so", "libcuda.so.1"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    return None


CUDA = _libcuda()
pytestmark = pytest.mark.skipif(CUDA is None, reason="no libcuda here (the CUDA stand-in or a driver): not run")


def check(rc, what):
    assert rc == 0, f"{what} failed: CUresult {rc}"


class DlDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DlDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DlTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DlDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DlDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DlManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DlManagedTensor))
DlManagedTensor._fields_ = [("dl_tensor", DlTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DeviceArray:
    """`n` bytes of device memory (cuMemAlloc), offered through DLPack as a
    uint8 tensor; `strided` offers every other byte (non-contiguous)."""

    def __init__(self, n, strided=False):
        ctx = ctypes.c_void_p()
        check(CUDA.cuInit(0), "cuInit")
        check(CUDA.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
        check(CUDA.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.ptr = ctypes.c_uint64()
        check(CUDA.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(n)), "cuMemAlloc")
        self.n = n
        self.deleted = 0
        self.shape = (ctypes.c_int64 * 1)(n // 2 if strided else n)
        self.strides = (ctypes.c_int64 * 1)(2) if strided else None
        self._keep = []

    def upload(self, data):
        check(CUDA.cuMemcpyHtoD_v2(self.ptr, data.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(data.nbytes)), "HtoD")

    def download(self):
        out = np.zeros(self.n, dtype=np.uint8)
        check(CUDA.cuMemcpyDtoH_v2(out.ctypes.data_as(ctypes.c_void_p), self.ptr, ctypes.c_size_t(self.n)), "DtoH")
        return out

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(self, stream=None):
        mt = DlManagedTensor()
        mt.dl_tensor.data = self.ptr.value
        mt.dl_tensor.device = DlDevice(2, 0)
        mt.dl_tensor.ndim = 1
        mt.dl_tensor.dtype = DlDataType(1, 8, 1)  # uint8
        mt.dl_tensor.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            mt.dl_tensor.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))

        def deleter(_):
            self.deleted += 1

        d = DELETER(deleter)
        mt.deleter = d
        self._keep.append((mt, d))
        return _new_capsule(ctypes.addressof(mt), b"dltensor", None)


def domain():
    dev = os.environ.get("GPU_RDMA_TEST_DEVICE")
    if dev:
        return gpu_rdma.Domain(transport="verbs", device=dev)
    return gpu_rdma.Domain(transport="tcp")


def pair(d):
    listener = d.listen("127.0.0.1:0")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("s", listener.accept()))
    t.start()
    c = d.connect(listener.address())
    t.join()
    return out["s"], c


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
    assert np.array_equal(gpu.download(), data), "the bytes landed in device memory"
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
