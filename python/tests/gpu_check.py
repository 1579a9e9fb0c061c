"""The Python binding's CUDA check for a GPU machine (run by the bundle of
`cargo xtask gpu-check`, where only Python and the wheel are installed:
no numpy, no pytest). A DLPack tensor in device memory (cuMemAlloc through
ctypes) is registered, received into and sent from over TCP (staged),
verified on the device, and its deleter runs once its region is gone;
and pinned host memory (kDLCUDAHost) that an asynchronous copy behind a
memset is still filling is sent only once the copy is done.
Prints one line per check and exits non-zero on any failure."""

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_rdma  # noqa: E402
from dlpack_producer import CUDA, DeviceArray, HostArray, check  # noqa: E402
from loopback import pair  # noqa: E402


def main():
    if CUDA is None:
        print("python gpu-check: no libcuda on this machine: not run")
        return 1
    d = gpu_rdma.Domain(transport="tcp")
    s, c = pair(d)
    n = 64 << 20
    gpu = DeviceArray(n)
    region = d.register(gpu)
    print(f"python gpu-check: a DLPack CUDA tensor of {n >> 20} MiB registered, path {region.memory_path}")
    data = os.urandom(n)
    rx = s.recv(region)
    c.send(d.register(data)).wait(timeout=120)
    got = rx.wait(timeout=120)
    ok_in = got.bytes == n and gpu.download() == data
    back = bytearray(n)
    rx = c.recv(d.register(back))
    s.send(region).wait(timeout=120)
    rx.wait(timeout=120)
    ok_out = bytes(back) == data
    del region, rx
    d.register(bytearray(1))
    ok_deleter = gpu.deleted == 1
    ok_pinned = pinned_host_after_its_copy(d, s, c, gpu, n)
    for what, ok in (("received into device memory", ok_in), ("sent from device memory", ok_out),
                     ("the producer's deleter ran once", ok_deleter),
                     ("pinned host memory sent after the copy filling it", ok_pinned)):
        print(f"python gpu-check: {what}: {'verified' if ok else 'FAILED'}")
    return 0 if ok_in and ok_out and ok_deleter and ok_pinned else 1


def pinned_host_after_its_copy(d, s, c, gpu, n):
    """A memset of `gpu` and a copy of it into pinned host memory, both on
    a new stream, then that memory registered as kDLCUDAHost and sent at
    once: every byte must be the memset's."""
    stream = ctypes.c_void_p()
    check(CUDA.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")
    check(CUDA.cuMemsetD32Async(gpu.ptr, ctypes.c_uint32(0x5A5A5A5A), ctypes.c_size_t(n // 4), stream), "memset")
    host = HostArray(n, device=3, pinned=True)
    check(CUDA.cuMemcpyDtoHAsync_v2(host.buf, gpu.ptr, ctypes.c_size_t(n), stream), "cuMemcpyDtoHAsync")
    region = d.register(host)
    got = bytearray(n)
    rx = c.recv(d.register(got))
    s.send(region).wait(timeout=120)
    rx.wait(timeout=120)
    return got == b"\x5a" * n


if __name__ == "__main__":
    sys.exit(main())
