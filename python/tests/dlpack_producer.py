"""A small DLPack producer over libcuda (ctypes, the standard library
only): device memory from cuMemAlloc offered as a uint8 tensor. Used by
the pytest suite (with the CUDA stand-in) and by `gpu_check.py` (on a GPU
machine, where nothing but the wheel and Python is installed)."""

import ctypes


def _libcuda():
    for name in ("libcuda.so", "libcuda.so.1"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    return None


CUDA = _libcuda()


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


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


# Every tensor handed out, with its producer and deleter, kept for the
# process's life: the consumer may call a deleter after the test dropped
# the producer (DLPack's contract: the tensor lives until its deleter ran;
# a real producer frees it there).
_EXPORTED = []


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

    def upload(self, data):
        buf = (ctypes.c_char * len(data)).from_buffer_copy(bytes(data))
        check(CUDA.cuMemcpyHtoD_v2(self.ptr, buf, ctypes.c_size_t(len(data))), "HtoD")

    def download(self):
        out = (ctypes.c_char * self.n)()
        check(CUDA.cuMemcpyDtoH_v2(out, self.ptr, ctypes.c_size_t(self.n)), "DtoH")
        return bytes(out)

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
        _EXPORTED.append((self, mt, d))
        return _new_capsule(ctypes.addressof(mt), b"dltensor", None)




class HostArray:
    """`n` bytes of host memory offered through DLPack as a uint8 tensor on
    `device` (3: kDLCUDAHost, pinned host memory a CUDA copy may fill; 13:
    kDLCUDAManaged); with `pinned`, from cuMemAllocHost (a real driver's
    asynchronous copies into pageable memory are synchronous). Counts the
    producer's `__dlpack__` calls."""

    def __init__(self, n, device=3, pinned=False):
        if pinned:  # page-locked by the driver, as kDLCUDAHost memory is
            ptr = ctypes.c_void_p()
            check(CUDA.cuMemAllocHost_v2(ctypes.byref(ptr), ctypes.c_size_t(n)), "cuMemAllocHost")
            self.buf = (ctypes.c_uint8 * n).from_address(ptr.value)
        else:
            self.buf = (ctypes.c_uint8 * n)()
        self.n = n
        self.device = device
        self.exported = 0
        self.shape = (ctypes.c_int64 * 1)(n)

    def __dlpack_device__(self):
        return (self.device, 0)

    def __dlpack__(self, stream=None):
        self.exported += 1
        mt = DlManagedTensor()
        mt.dl_tensor.data = ctypes.addressof(self.buf)
        mt.dl_tensor.device = DlDevice(self.device, 0)
        mt.dl_tensor.ndim = 1
        mt.dl_tensor.dtype = DlDataType(1, 8, 1)  # uint8
        mt.dl_tensor.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        d = DELETER(lambda _: None)
        mt.deleter = d
        _EXPORTED.append((self, mt, d))
        return _new_capsule(ctypes.addressof(mt), b"dltensor", None)
