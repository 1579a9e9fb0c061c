"""gpu_rdma: zero-copy RDMA transfers between GPUs (and host memory) on
different machines, over verbs where there is an RDMA device and over TCP
everywhere else, from Python.

    import numpy as np, gpu_rdma
    d = gpu_rdma.Domain()                      # the best device here, or TCP
    buf = np.arange(1 << 20, dtype=np.uint8)
    region = d.register(buf)                   # registered in place, kept alive
    conn = d.connect("10.0.0.2:7471")
    conn.send(region).wait()                   # or: await conn.send(region)

Every operation returns an `Op`: `op.wait(timeout=None)` releases the GIL
(Ctrl-C interrupts it), `await op` works in asyncio, and so does
`await inbox.wait_async(tag)`. Many operations may read one region at once;
one that writes it (a receive, a read) has it alone until it is done.
"""

from ._native import (  # noqa: F401
    Completion,
    Connection,
    CudaError,
    Domain,
    Exposed,
    GpuRdmaError,
    HAS_ETCD,
    Inbox,
    InvalidArgument,
    Listener,
    NoDevice,
    Op,
    OperationFailed,
    OutOfBounds,
    PeerTransferFailed,
    ReadOnlyBuffer,
    Region,
    RegionInUse,
    RemoteAccessError,
    RemoteRegion,
    Timeout,
    ConnectionLost,
    World,
    __version__,
    doctor,
)

__all__ = [
    "Completion", "Connection", "ConnectionLost", "CudaError", "Domain", "Exposed", "GpuRdmaError", "Inbox",
    "InvalidArgument", "Listener", "NoDevice", "Op", "OperationFailed", "OutOfBounds", "PeerTransferFailed",
    "ReadOnlyBuffer", "Region", "RegionInUse", "RemoteAccessError", "RemoteRegion", "Timeout", "World", "doctor",
]
