"""Both ends of a connection in this process, for the tests and for
`gpu_check.py` (the standard library and gpu_rdma only)."""

import os
import threading

import gpu_rdma


def domain():
    """The domain the tests run on: the verbs device GPU_RDMA_TEST_DEVICE
    names (rxe0 in the VM), else TCP."""
    dev = os.environ.get("GPU_RDMA_TEST_DEVICE")
    if dev:
        return gpu_rdma.Domain(transport="verbs", device=dev)
    return gpu_rdma.Domain(transport="tcp")


def pair(d, server_advertise=(), client_advertise=(), queue_depth=None):
    """(server side, client side) of one connection on `d` over loopback."""
    listener = d.listen("127.0.0.1:0")
    out = {}
    accept = lambda: listener.accept(advertise=list(server_advertise), queue_depth=queue_depth)  # noqa: E731
    t = threading.Thread(target=lambda: out.setdefault("s", accept()))
    t.start()
    c = d.connect(listener.address(), advertise=list(client_advertise), queue_depth=queue_depth)
    t.join()
    return out["s"], c
