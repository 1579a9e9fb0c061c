"""Push the KV-cache pages of a few requests from a prefill worker to a
decode worker, as disaggregated inference does: each side has its own
paged pool (numpy; torch CUDA tensors when torch and a GPU are there), the
pages of a request land at the decode side's own page numbers, and one
notification per request says all of its pages are there. Verified.

    python python/examples/kv_push.py [--requests 16] [--page 16384] [--transport tcp]
"""

import argparse
import multiprocessing as mp
import os
import sys

import numpy as np

_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") not in (_here, os.path.dirname(_here))]
import gpu_rdma  # noqa: E402

PAGES = 256


def pool(page, fill):
    """A paged pool: torch CUDA memory when there is a GPU, else numpy."""
    try:
        import torch

        if torch.cuda.is_available():
            t = torch.full((PAGES * page,), fill, dtype=torch.uint8, device="cuda")
            return t, lambda: t.cpu().numpy()
    except ImportError:
        pass
    a = np.full(PAGES * page, fill, dtype=np.uint8)
    return a, lambda: a


def pages_of(request, n):
    """Request r's pages at the prefill side and where decode wants them:
    each side's allocator scattered them its own way (no page is two
    requests')."""
    mine = np.random.default_rng(1).permutation(PAGES)
    theirs = np.random.default_rng(2).permutation(PAGES)
    return mine[request * n:(request + 1) * n], theirs[request * n:(request + 1) * n]


def content(request, i, page):
    return np.full(page, (request * 31 + i * 7) % 251 + 1, dtype=np.uint8)


def decode(args, q):
    d = gpu_rdma.Domain(transport=args.transport)
    mem, host = pool(args.page, 0)
    exposed = d.expose(d.register(mem), "w", tag=1)
    listener = d.listen("127.0.0.1:0")
    q.put(listener.address())
    conn = listener.accept(advertise=[exposed], timeout=60)
    inbox = conn.inbox()
    bad = 0
    for r in range(args.requests):
        note = inbox.wait(r, timeout=60)[0]
        _, theirs = pages_of(r, args.pages)
        got = host()
        for i, p in enumerate(theirs):
            bad += not np.array_equal(got[p * args.page:(p + 1) * args.page], content(r, i, args.page))
        print(f"decode: request {r}: {note.decode()}, {len(theirs)} pages checked")
    q.put(bad)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--pages", type=int, default=8, help="pages per request")
    ap.add_argument("--page", type=int, default=16384, help="bytes per page")
    ap.add_argument("--transport", default=None, help="auto (default), verbs or tcp")
    args = ap.parse_args()
    if args.requests * args.pages > PAGES:
        ap.error(f"at most {PAGES} pages in all")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    worker = ctx.Process(target=decode, args=(args, q))
    worker.start()
    addr = q.get(timeout=60)
    d = gpu_rdma.Domain(transport=args.transport)
    print(f"prefill: {d.info()['transport']}" + (f" ({d.info()['fallback']})" if d.info()["fallback"] else ""))
    src = np.zeros(PAGES * args.page, dtype=np.uint8)
    for r in range(args.requests):
        mine, _ = pages_of(r, args.pages)
        for i, p in enumerate(mine):
            src[p * args.page:(p + 1) * args.page] = content(r, i, args.page)
    conn = d.connect(addr, timeout=60)
    remote = conn.remote_region(1)
    ops = []
    for r in range(args.requests):
        mine, theirs = pages_of(r, args.pages)
        pieces = [(int(m) * args.page, int(t) * args.page, args.page) for m, t in zip(mine, theirs)]
        # Each request's list has its own view of the pool (a region is one
        # operation's at a time): the same bytes, registered again for free.
        ops.append(conn.write_list(d.register(src), remote, pieces, tag=r, payload=f"request {r} ready".encode()))
    for op in ops:
        op.wait(timeout=60)
    bad = q.get(timeout=120)
    worker.join(timeout=60)
    if bad or worker.exitcode != 0:
        print(f"kv_push: {bad} page(s) wrong, decode exit {worker.exitcode}")
        sys.exit(1)
    print(f"kv_push: all {args.requests} requests verified, {args.requests * args.pages} pages")


if __name__ == "__main__":
    main()
