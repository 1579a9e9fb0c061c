"""What Python costs over Rust, on the same transport, side by side:

  send-lat 4 KiB: ping-pong between two processes, one-way time (half the
                  round trip, as perftest and `gpu-rdma bench` report it);
                  Python's per-operation overhead is the difference.
  write-bw 1 MiB: 128 writes in flight in chains of 32 (the Rust bench's
                  -t 128 -Q 32; in Python a transfer list of 32 pieces),
                  512 in all; Python over Rust.

    python python/bench.py --rust target/release/gpu-rdma [--transport tcp] [--rounds 3]

Each round runs the Rust bench and the Python one back to back; the
medians and the per-round ratios are printed.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# The installed package, not the source folder this script sits beside.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
import gpu_rdma  # noqa: E402

LAT_SIZE, LAT_ITERS = 4096, 2000
BW_SIZE, BW_ITERS, BW_DEPTH, CHAIN = 1 << 20, 512, 128, 32


def _serve(transport, port_q, test):
    d = gpu_rdma.Domain(transport=transport)
    if test == "write-bw":
        target = np.zeros(BW_SIZE * BW_DEPTH, dtype=np.uint8)
        exposed = d.expose(d.register(target), "w", tag=1)
        listener = d.listen("127.0.0.1:0")
        port_q.put(listener.address())
        conn = listener.accept(advertise=[exposed], timeout=60)
        conn.inbox().wait(9, timeout=120)  # the client's "done"
        return
    listener = d.listen("127.0.0.1:0")
    port_q.put(listener.address())
    conn = listener.accept(timeout=60)
    rbuf = d.register(np.zeros(LAT_SIZE, dtype=np.uint8))
    sbuf = d.register(np.zeros(LAT_SIZE, dtype=np.uint8))
    for _ in range(LAT_ITERS + 1):
        conn.recv(rbuf).wait(timeout=60)
        conn.send(sbuf).wait(timeout=60)


def python_round(transport, test):
    # Spawned, not forked: this process has the crate's threads running.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_serve, args=(transport, q, test))
    server.start()
    addr = q.get(timeout=60)
    d = gpu_rdma.Domain(transport=transport)
    try:
        if test == "send-lat":
            conn = d.connect(addr)
            rbuf = d.register(np.zeros(LAT_SIZE, dtype=np.uint8))
            sbuf = d.register(np.ones(LAT_SIZE, dtype=np.uint8))
            t0 = None
            for i in range(LAT_ITERS + 1):  # the first round trip warms up
                if i == 1:
                    t0 = time.perf_counter()
                rx = conn.recv(rbuf)
                conn.send(sbuf).wait(timeout=60)
                rx.wait(timeout=60)
            return (time.perf_counter() - t0) / LAT_ITERS / 2 * 1e6  # one way, us
        conn = d.connect(addr, queue_depth=(BW_DEPTH, 16))
        remote = conn.remote_region(1)
        src = np.ones(BW_SIZE * BW_DEPTH, dtype=np.uint8)
        # As the Rust bench posts: chains of CHAIN writes, one completion
        # each (here a transfer list of CHAIN pieces), DEPTH writes in flight.
        chains = BW_DEPTH // CHAIN
        regions = [d.register(src[i * CHAIN * BW_SIZE:(i + 1) * CHAIN * BW_SIZE]) for i in range(chains)]
        pieces = [(j * BW_SIZE, j * BW_SIZE, BW_SIZE) for j in range(CHAIN)]
        t0 = time.perf_counter()
        inflight = []
        for i in range(BW_ITERS // CHAIN):
            if len(inflight) == chains:
                inflight.pop(0).wait(timeout=60)
            k = i % chains
            shifted = [(lo, k * CHAIN * BW_SIZE + ro, n) for lo, ro, n in pieces]
            inflight.append(conn.write_list(regions[k], remote, shifted))
        for op in inflight:
            op.wait(timeout=60)
        secs = time.perf_counter() - t0
        conn.write_list(d.register(bytearray(1)), remote, [], tag=9).wait(timeout=60)
        return BW_SIZE * (BW_ITERS // CHAIN * CHAIN) / secs / (1 << 20)  # MiB/s
    finally:
        server.join(timeout=60)


def rust_round(rust, transport, test, port):
    size, iters = (LAT_SIZE, LAT_ITERS) if test == "send-lat" else (BW_SIZE, BW_ITERS)
    common = [test, "--transport", transport, "-s", str(size), "-n", str(iters), "-p", str(port), "--json"]
    server = subprocess.Popen([rust, "bench", *common, "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    out = subprocess.run([rust, "bench", *common, "127.0.0.1"], capture_output=True, text=True, timeout=300)
    server.wait(timeout=60)
    row = json.loads(out.stdout)["rows"][0]
    return row["t_typical"] if test == "send-lat" else row["bw_average_mib_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rust", default="target/release/gpu-rdma", help="the gpu-rdma tool (cargo build --release --features cli)")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = 18600
    rows = []
    for test, unit in (("send-lat", "us"), ("write-bw", "MiB/s")):
        rust, py = [], []
        for _ in range(args.rounds):
            port += 1
            rust.append(rust_round(args.rust, args.transport, test, port))
            py.append(python_round(args.transport, test))
        rows.append((test, unit, rust, py))
    print(f"gpu_rdma {gpu_rdma.__version__}, {args.transport}, medians of {args.rounds} rounds (Rust: gpu-rdma bench)")
    print(f"{'test':10} {'bytes':>8} {'rust':>12} {'python':>12}   verdict")
    for test, unit, rust, py in rows:
        r, p = statistics.median(rust), statistics.median(py)
        if test == "send-lat":
            over = [b - a for a, b in zip(rust, py)]
            verdict = (f"Python adds {statistics.median(over):.1f} us a one-way operation "
                       f"(rounds {min(over):.1f}-{max(over):.1f})")
            size = LAT_SIZE
        else:
            ratio = [b / a for a, b in zip(rust, py)]
            met = "met" if statistics.median(ratio) >= 0.95 else "MISSED"
            verdict = (f"{statistics.median(ratio):.2f}x Rust (rounds {min(ratio):.2f}-{max(ratio):.2f}); "
                       f"goal >= 0.95x {met}")
            size = BW_SIZE
        print(f"{test:10} {size:>8} {r:>9.1f} {unit:<3}{p:>9.1f} {unit:<3}   {verdict}")
        print(f"{'':10} {'':>8} rounds: rust {', '.join(f'{x:.1f}' for x in rust)}; python {', '.join(f'{x:.1f}' for x in py)}")


if __name__ == "__main__":
    main()
