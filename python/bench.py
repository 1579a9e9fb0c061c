"""What Python costs over Rust, on the same transport, side by side:

  send-lat 4 KiB: ping-pong between two processes, one-way time (half the
                  round trip, as perftest and `gpu-rdma bench` report it);
                  Python's per-operation overhead is the difference.
  list-bw 1 MiB:  2048 writes, each from the same 1 MiB into the same 1 MiB
                  at the peer, as transfer lists of 64 pieces, two lists in
                  flight: the Rust bench's `list-bw --list 64`, operation
                  for operation. Python over Rust: what the binding costs.
  write-bw 1 MiB: the same Python figure against the Rust bench's
                  `write-bw` (-t 128 -Q 32: chains of 32 raw writes, 128 in
                  flight), which Python has no call for: what the binding
                  and the transfer list cost together over raw writes.

    python python/bench.py --rust target/release/gpu-rdma [--transport tcp] [--rounds 5]

Each round runs the Rust benches, the Python one, and the Rust benches
again, back to back; Python is judged against both Rust runs of its round
(their geometric mean), and each second Rust run against its first is that
row's null: what the machine alone does to a ratio. Medians and per-round
ranges are printed. `cargo xtask compare --host` runs it after its own
table.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

# numpy's OpenBLAS starts worker threads that spin-wait for work they never
# get here, taking a core from the transport's threads (on this 2-core
# machine, 14% of all samples in `perf record -a`); the Rust bench has
# none. One BLAS thread: no workers. Set before numpy is imported, and
# inherited by the spawned server.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

# The installed package, not the source folder this script sits beside.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
import gpu_rdma  # noqa: E402

LAT_SIZE, LAT_ITERS = 4096, 2000


def aligned(n, fill):
    """`n` bytes filled with `fill`, starting on a page, as the Rust
    bench's buffers do (numpy's own start 16 bytes into one)."""
    raw = np.full(n + 4096, fill, dtype=np.uint8)
    at = -raw.ctypes.data % 4096
    return raw[at:at + n]
BW_SIZE, BW_ITERS, LIST, LISTS = 1 << 20, 2048, 64, 2


def _serve(transport, port_q, test):
    d = gpu_rdma.Domain(transport=transport)
    if test == "write-bw":
        # Touched, as the Rust bench's buffer is: no page faults in the run.
        target = aligned(BW_SIZE, 7)
        exposed = d.expose(d.register(target), "w", tag=1)
        listener = d.listen("127.0.0.1:0")
        port_q.put(listener.address())
        conn = listener.accept(advertise=[exposed], timeout=60)
        # The client's "done", waited for as the Rust bench's server waits
        # (asleep on a receive; an inbox would look at its ring meanwhile).
        conn.recv_imm().wait(timeout=120)
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
        conn = d.connect(addr, queue_depth=(LIST * LISTS, 16))
        remote = conn.remote_region(1)
        # As the Rust bench's list-bw posts: LISTS transfer lists of LIST
        # pieces in flight, every piece from the same 1 MiB into the same
        # 1 MiB; the front list waited for, the next one posted.
        region = d.register(aligned(BW_SIZE, 1))
        pieces = [(0, 0, BW_SIZE)] * LIST
        t0 = time.perf_counter()
        inflight = []
        for i in range(BW_ITERS // LIST):
            if len(inflight) == LISTS:
                inflight.pop(0).wait(timeout=60)
            inflight.append(conn.write_list(region, remote, pieces))
        for op in inflight:
            op.wait(timeout=60)
        secs = time.perf_counter() - t0
        conn.write_with_imm(d.register(bytearray(1)), remote, 9).wait(timeout=60)
        return BW_SIZE * (BW_ITERS // LIST * LIST) / secs / (1 << 20)  # MiB/s
    finally:
        server.join(timeout=60)


def rust_round(rust, transport, test, port):
    size, iters = (LAT_SIZE, LAT_ITERS) if test == "send-lat" else (BW_SIZE, BW_ITERS)
    common = [test, "--transport", transport, "-s", str(size), "-n", str(iters), "-p", str(port), "--json"]
    if test == "list-bw":
        common += ["--list", str(LIST)]
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
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    port = 18600
    # Per row: Rust's first runs, Python's, Rust's second runs.
    runs = {t: ([], [], []) for t in ("send-lat", "list-bw", "write-bw")}

    def rust(test):
        nonlocal port
        port += 1
        return rust_round(args.rust, args.transport, test, port)

    for _ in range(args.rounds):
        # Rust, Python, Rust again: Python against both Rust runs of its
        # round, and the second Rust run against the first (the null: how
        # far the machine alone moves a ratio).
        first = rust("send-lat")
        runs["send-lat"][0].append(first)
        runs["send-lat"][1].append(python_round(args.transport, "send-lat"))
        runs["send-lat"][2].append(rust("send-lat"))
        firsts = {t: rust(t) for t in ("list-bw", "write-bw")}
        py = python_round(args.transport, "write-bw")
        for t in ("list-bw", "write-bw"):
            runs[t][0].append(firsts[t])
            runs[t][1].append(py)
            runs[t][2].append(rust(t))
    print(f"gpu_rdma {gpu_rdma.__version__}, {args.transport}, medians of {args.rounds} rounds "
          "(Rust: gpu-rdma bench, run before and after Python in each round)")
    print(f"{'test':10} {'bytes':>8} {'rust':>12} {'python':>12}   verdict")
    for test, (rust_runs, py, again) in runs.items():
        both = [(a * b) ** 0.5 for a, b in zip(rust_runs, again)]
        r, p = statistics.median(both), statistics.median(py)
        if test == "send-lat":
            unit = "us"
            over = [b - a for a, b in zip(both, py)]
            null = [b - a for a, b in zip(rust_runs, again)]
            verdict = (f"Python adds {statistics.median(over):.1f} us a one-way operation "
                       f"(rounds {min(over):.1f} to {max(over):.1f}; null: Rust's second run "
                       f"{statistics.median(null):+.1f} us, {min(null):.1f} to {max(null):.1f})")
            size = LAT_SIZE
        else:
            unit = "MiB/s"
            ratio = [b / a for a, b in zip(both, py)]
            null = [b / a for a, b in zip(rust_runs, again)]
            met = "met" if statistics.median(ratio) >= 0.95 else "MISSED"
            noise = (", inside the null's range" if met == "MISSED" and min(null) <= statistics.median(ratio)
                     else "")
            what = "same operations" if test == "list-bw" else "Rust's raw write chains"
            verdict = (f"{statistics.median(ratio):.2f}x Rust's {test} ({what}; rounds {min(ratio):.2f}-"
                       f"{max(ratio):.2f}); goal >= 0.95x {met}{noise}; null: Rust's second run "
                       f"{statistics.median(null):.2f}x its first ({min(null):.2f}-{max(null):.2f})")
            size = BW_SIZE
        print(f"{test:10} {size:>8} {r:>9.1f} {unit:<5}{p:>9.1f} {unit:<5} {verdict}")
        print(f"{'':10} {'':>8} rounds: rust {', '.join(f'{x:.1f}' for x in rust_runs)}; "
              f"python {', '.join(f'{x:.1f}' for x in py)}; rust again {', '.join(f'{x:.1f}' for x in again)}")


if __name__ == "__main__":
    main()
