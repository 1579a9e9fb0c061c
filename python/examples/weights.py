"""Weight sync, as RL trainers do it: after each training step rank 0 (the
trainer) pushes its new weights to every inference rank, each of which
waits for the step's notification, checks the weights and acknowledges
before the next step. numpy; torch CUDA tensors when torch and a GPU are
there. Verified at every rank and step.

    python python/examples/weights.py [--ranks 4] [--mib 64] [--steps 3] [--transport tcp]
"""

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") not in (_here, os.path.dirname(_here))]
import gpu_rdma  # noqa: E402


def buffer(n):
    try:
        import torch

        if torch.cuda.is_available():
            t = torch.zeros(n, dtype=torch.uint8, device="cuda")
            return t, lambda: t.cpu().numpy()
    except ImportError:
        pass
    a = np.zeros(n, dtype=np.uint8)
    return a, lambda: a


def weights(step, n):
    return (np.arange(n, dtype=np.uint64) * 2654435761 + step * 97).astype(np.uint8)


def inference(rank, args, q):
    d = gpu_rdma.Domain(transport=args.transport)
    n = args.mib << 20
    mem, host = buffer(n)
    exposed = d.expose(d.register(mem), "w", tag=1)
    listener = d.listen("127.0.0.1:0")
    q.put((rank, listener.address()))
    conn = listener.accept(advertise=[exposed], timeout=60)
    inbox = conn.inbox()
    ack = d.register(bytearray(1))
    bad = 0
    for step in range(args.steps):
        inbox.wait(step, timeout=120)
        ok = np.array_equal(host(), weights(step, n))
        bad += not ok
        print(f"rank {rank}: step {step} weights {'verified' if ok else 'WRONG'}", flush=True)
        conn.send(ack).wait(timeout=60)
    q.put((rank, bad))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="ranks in all, the trainer included")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--transport", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=inference, args=(r, args, q)) for r in range(1, args.ranks)]
    for p in procs:
        p.start()
    addrs = dict(q.get(timeout=60) for _ in procs)
    d = gpu_rdma.Domain(transport=args.transport)
    n = args.mib << 20
    src = np.zeros(n, dtype=np.uint8)
    # Registered once: every rank's write reads it at the same time.
    weights_region = d.register(src)
    conns = {r: d.connect(a, timeout=60) for r, a in sorted(addrs.items())}
    acks = {r: d.register(bytearray(1)) for r in conns}
    for step in range(args.steps):
        src[:] = weights(step, n)
        t0 = time.perf_counter()
        rx = [c.recv(acks[r]) for r, c in conns.items()]
        pushes = [c.write_list(weights_region, c.remote_region(1), [(0, 0, n)], tag=step, payload=b"step")
                  for c in conns.values()]
        for op in pushes + rx:
            op.wait(timeout=120)
        dt = time.perf_counter() - t0
        print(f"rank 0: step {step}: {args.mib} MiB to {len(conns)} ranks, acknowledged, {dt * 1e3:.1f} ms "
              f"({len(conns) * n / dt / (1 << 30):.2f} GiB/s)", flush=True)
    bad = sum(q.get(timeout=120)[1] for _ in procs)
    for p in procs:
        p.join(timeout=60)
    if bad or any(p.exitcode != 0 for p in procs):
        print(f"weights: {bad} wrong step(s)")
        sys.exit(1)
    print(f"weights: {args.steps} steps to {len(conns)} ranks, every one verified ({d.info()['transport']})")


if __name__ == "__main__":
    main()
