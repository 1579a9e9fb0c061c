"""The Python binding over the transport this machine has (TCP here; rxe0
in the VM with GPU_RDMA_TEST_DEVICE set): every operation, the asyncio
path with 1,000 operations in flight, and bad input raising the right
exception with nothing leaked."""

import asyncio
import gc
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import _thread
import weakref

import numpy as np
import pytest

import gpu_rdma

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dlpack_producer import HostArray  # noqa: E402
from loopback import domain, pair  # noqa: E402


def exposed_pair(d, target, tag):
    """A connected pair whose server side exposes `target` for writes under
    `tag`: (the exposure, server side, client side, the client's view)."""
    exposed = d.expose(d.register(target), "w", tag=tag)
    s, c = pair(d, server_advertise=[exposed])
    return exposed, s, c, c.remote_region(tag)


def noted_pair(src_len, fill):
    """A pair for notifications: the server exposes a zeroed 4 KiB `target`
    (tag 4), the client sees it as `remote`; the server's inbox, and a
    registered `src` of `src_len` bytes of `fill` at the client."""
    d = domain()
    target = np.zeros(4096, dtype=np.uint8)
    exposed, s, c, remote = exposed_pair(d, target, tag=4)
    src = d.register(np.full(src_len, fill, dtype=np.uint8))
    return target, exposed, s, c, remote, s.inbox(), src


class Ticker:
    """A task on the running loop ticking every millisecond: how often the
    loop ran other work meanwhile."""

    def __init__(self):
        self.ticks = 0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self):
        while True:
            self.ticks += 1
            await asyncio.sleep(0.001)


def test_the_domain_says_what_it_runs_on():
    info = domain().info()
    expected = "verbs" if os.environ.get("GPU_RDMA_TEST_DEVICE") else "tcp"
    assert info["transport"].lower().startswith(expected), info
    if expected == "tcp":
        assert info["fallback"], "a TCP domain says why"


def test_send_and_recv_move_a_numpy_array_in_place():
    d = domain()
    s, c = pair(d)
    src = np.arange(1 << 20, dtype=np.uint32)
    dst = np.zeros_like(src)
    rx = s.recv(d.register(dst))
    done = c.send(d.register(src)).wait(timeout=30)
    got = rx.wait(timeout=30)
    assert done.bytes == src.nbytes and got.bytes == src.nbytes
    assert np.array_equal(src, dst)


def test_write_read_and_write_with_imm_reach_an_exposed_array():
    d = domain()
    target = np.zeros(1 << 16, dtype=np.uint8)
    exposed = d.expose(d.register(target), "rw", tag=7)
    s, c = pair(d, server_advertise=[exposed])
    remote = c.remote_region(7)
    assert remote is not None and len(remote) == target.nbytes
    # The descriptor travels as bytes, and comes back the same.
    assert len(gpu_rdma.RemoteRegion.from_bytes(exposed.descriptor())) == target.nbytes
    data = np.frombuffer(os.urandom(4096), dtype=np.uint8).copy()
    c.write(d.register(data), remote, remote_offset=1024).wait(timeout=30)
    assert np.array_equal(target[1024:1024 + 4096], data)
    back = np.zeros(4096, dtype=np.uint8)
    c.read(d.register(back), remote, remote_offset=1024).wait(timeout=30)
    assert np.array_equal(back, data)
    imm = s.recv_imm()
    c.write_with_imm(d.register(data[:100].copy()), remote, 0xBEEF).wait(timeout=30)
    assert imm.wait(timeout=30).imm == 0xBEEF
    assert np.array_equal(target[:100], data[:100])


def test_a_transfer_list_lands_every_piece_before_its_notification():
    d = domain()
    pool = np.zeros(64 * 4096, dtype=np.uint8)
    exposed = d.expose(d.register(pool), "w", tag=1)
    s, c = pair(d, server_advertise=[exposed])
    inbox = s.inbox()
    src = np.frombuffer(os.urandom(16 * 4096), dtype=np.uint8).copy()
    mine, theirs = list(range(16)), [63 - 3 * i for i in range(16)]
    pieces = [(m * 4096, t * 4096, 4096) for m, t in zip(mine, theirs)]
    op = c.write_list(d.register(src), c.remote_region(1), pieces, tag=5, payload=b"ready")
    assert inbox.wait(5, timeout=30) == [b"ready"]
    for m, t in zip(mine, theirs):
        assert np.array_equal(pool[t * 4096:(t + 1) * 4096], src[m * 4096:(m + 1) * 4096])
    done = op.wait(timeout=30)
    assert done.bytes == 16 * 4096 and done.requests >= 1


def test_a_thousand_operations_in_flight_on_one_event_loop():
    d = domain()
    s, c = pair(d, queue_depth=(1024, 1024))
    n = 1000
    srcs = [np.full(64, i % 251, dtype=np.uint8) for i in range(n)]
    dsts = [np.zeros(64, dtype=np.uint8) for _ in range(n)]

    async def main():
        rx = [s.recv(d.register(x)) for x in dsts]
        tx = [c.send(d.register(x)) for x in srcs]
        # A timer task keeps ticking: the loop is never blocked.
        ticker = Ticker()
        done = await asyncio.wait_for(asyncio.gather(*tx, *rx), timeout=60)
        ticker.task.cancel()
        return done, ticker.ticks

    done, ticks = asyncio.run(main())
    assert len(done) == 2 * n and all(x.bytes == 64 for x in done)
    assert ticks >= 1
    for i, x in enumerate(dsts):
        assert x[0] == i % 251, i


def test_an_inbox_is_awaited_while_the_loop_runs_other_work():
    target, exposed, s, c, remote, inbox, src = noted_pair(4096, 3)
    assert inbox.try_take(5) is None

    async def main():
        ticker = Ticker()
        waiting = asyncio.ensure_future(inbox.wait_async(5, 2, timeout=30))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "nothing was sent yet"
        ticks_meanwhile = ticker.ticks
        await c.write_list(src, remote, [(0, 0, 4096)], tag=5, payload=b"a")
        await c.write_list(src, remote, [(0, 0, 2048)], tag=5, payload=b"b")
        notes = await waiting
        # Nothing more comes: a bounded wait ends in Timeout, on time.
        t0 = time.monotonic()
        with pytest.raises(gpu_rdma.Timeout):
            await inbox.wait_async(5, 1, timeout=0.05)
        late = time.monotonic() - t0
        ticker.task.cancel()
        return notes, ticks_meanwhile, late

    notes, ticks, late = asyncio.run(main())
    assert list(notes) == [b"a", b"b"]
    assert ticks >= 10, f"the loop ran other work while the inbox was awaited ({ticks} ticks in 50 ms)"
    assert late < 1.0, late
    assert (target == 3).all()


def test_an_awaited_inbox_that_times_out_or_is_cancelled_takes_nothing():
    target, exposed, s, c, remote, inbox, src = noted_pair(64, 9)

    async def main():
        with pytest.raises(gpu_rdma.Timeout):
            await inbox.wait_async(7, 1, timeout=0.02)
        cancelled = asyncio.ensure_future(inbox.wait_async(8, 1))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        # Both notes come after their waits ended: neither wait takes one.
        await c.write_list(src, remote, [(0, 0, 64)], tag=7, payload=b"seven")
        await c.write_list(src, remote, [(0, 0, 64)], tag=8, payload=b"eight")
        await asyncio.sleep(0.05)
        return cancelled.cancelled()

    assert asyncio.run(main())
    assert inbox.wait(7, timeout=5) == [b"seven"]
    assert inbox.wait(8, timeout=5) == [b"eight"]
    # Made before any loop runs, awaited by asyncio.run's.
    c.write_list(src, remote, [(0, 0, 64)], tag=9, payload=b"nine").wait(timeout=10)
    assert asyncio.run(inbox.wait_async(9, 1, timeout=5)) == [b"nine"]


def test_inboxes_awaited_on_two_loops_in_two_threads_each_get_their_notes():
    """Each awaited inbox is polled on its own loop's thread, whichever
    loop's reader saw the eventfd ring."""
    target, exposed, s, c, remote, inbox, src = noted_pair(64, 2)
    got = {}

    def run(tag):
        async def main():
            return await inbox.wait_async(tag, 2, timeout=30)
        got[tag] = (asyncio.run(main()), threading.get_ident())

    threads = [threading.Thread(target=run, args=(tag,)) for tag in (11, 12)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    for i in range(2):
        for tag in (12, 11):
            c.write_list(src, remote, [(0, 0, 64)], tag=tag, payload=bytes([tag, i])).wait(timeout=10)
    for t in threads:
        t.join(timeout=30)
    assert got[11][0] == [bytes([11, 0]), bytes([11, 1])]
    assert got[12][0] == [bytes([12, 0]), bytes([12, 1])]
    assert got[11][1] != got[12][1]


def test_an_idle_awaited_inbox_leaves_the_loop_asleep():
    """Over TCP the transport wakes an awaited inbox when the peer's
    writes land: 300 ms of waiting cost the process about what 300 ms of
    awaiting nothing cost it (here 1.1-1.5 ms, its threads' own, and
    -0.03-0.16 ms more with the inbox awaited). Looking again every 50 ms
    as a safeguard cost 1.4-2.5 ms more, and every 50 us to 1 ms about
    6 ms, every time. Noise on a shared machine only adds CPU, so the
    least of up to three measurements is judged."""
    target, exposed, s, c, remote, inbox, src = noted_pair(64, 5)

    async def idle_cpu():
        cpu = time.process_time()
        await asyncio.sleep(0.3)
        return time.process_time() - cpu

    async def main():
        extra = []
        for _ in range(3):
            # Nothing awaited, before and after (the quieter of the two).
            before = await idle_cpu()
            waiting = asyncio.ensure_future(inbox.wait_async(3, 1, timeout=30))
            await asyncio.sleep(0)
            cpu = await idle_cpu()
            assert not waiting.done()
            after = await idle_cpu()
            await c.write_list(src, remote, [(0, 0, 64)], tag=3, payload=b"x")
            assert await waiting == [b"x"]
            extra.append(cpu - min(before, after))
            if extra[-1] < 0.001:
                break
        return extra

    extra = asyncio.run(main())
    print("300 ms awaiting the inbox cost " + ", ".join(f"{e * 1e3:.2f}" for e in extra)
          + " ms of the process's CPU more than awaiting nothing")
    if not os.environ.get("GPU_RDMA_TEST_DEVICE"):  # TCP
        assert min(extra) < 0.001, f"an idle await cost {min(extra) * 1e3:.2f} ms of CPU in 300 ms (least of {len(extra)})"


def test_an_operation_awaited_after_it_finished_resolves_at_once():
    d = domain()
    s, c = pair(d)
    dst = bytearray(8)
    rx = s.recv(d.register(dst))
    c.send(d.register(bytearray(b"12345678"))).wait(timeout=30)
    rx.wait(timeout=30)

    async def late():
        return await rx

    assert asyncio.run(late()).bytes == 8
    assert bytes(dst) == b"12345678"


def test_a_region_in_use_and_a_read_only_target_are_refused():
    d = domain()
    s, c = pair(d)
    region = d.register(np.zeros(16, dtype=np.uint8))
    rx = s.recv(region)
    assert region.in_use
    with pytest.raises(gpu_rdma.RegionInUse):
        s.recv(region)
    ro = d.register(b"read only bytes!")
    assert ro.readonly
    with pytest.raises(gpu_rdma.ReadOnlyBuffer):
        s.recv(ro)
    # A read-only buffer is a fine source.
    c.send(ro).wait(timeout=30)
    assert rx.wait(timeout=30).bytes == 16
    assert not region.in_use, "the region came back with the completion"
    assert bytes(region.obj) == b"read only bytes!"
    with pytest.raises(gpu_rdma.GpuRdmaError):
        d.expose(ro, "w")


def test_many_operations_read_one_region_at_once_and_a_writer_has_it_alone():
    d = domain()
    target = np.zeros(8 * 4096, dtype=np.uint8)
    exposed, s, c, remote = exposed_pair(d, target, tag=3)
    data = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()
    src = d.register(data)
    # A send the peer has no receive for yet stays in flight; six writes and
    # a transfer list from the same region go behind it (a weight
    # broadcast's shape): all read it at once.
    ops = [c.send(src)]
    ops += [c.write(src, remote, remote_offset=i * 4096) for i in range(6)]
    ops.append(c.write_list(src, remote, [(0, 6 * 4096, 2048), (2048, 6 * 4096 + 2048, 2048)]))
    assert src.in_use
    # While they read it, nothing may write it: a receive is refused.
    with pytest.raises(gpu_rdma.RegionInUse):
        c.recv(src)
    rx = d.register(bytearray(4096))
    assert s.recv(rx).wait(timeout=30).bytes == 4096
    for op in ops:
        op.wait(timeout=30)
    assert bytes(rx.obj) == bytes(data)
    for i in range(7):
        assert bytes(target[i * 4096:(i + 1) * 4096]) == bytes(data), f"write {i}"
    # Done: a receive may write it now, and has it alone meanwhile.
    assert not src.in_use
    into = c.recv(src)
    with pytest.raises(gpu_rdma.RegionInUse):
        c.send(src)
    s.send(d.register(bytes(4096))).wait(timeout=30)
    assert into.wait(timeout=30).bytes == 4096
    assert not data.any(), "the receive landed in the region it had alone"
    assert not src.in_use


def test_cuda_managed_memory_is_refused_with_the_fix_and_never_exported():
    d = domain()
    managed = HostArray(4096, device=13)  # kDLCUDAManaged
    with pytest.raises(TypeError, match="managed memory"):
        d.register(managed)
    assert managed.exported == 0, "refused before the producer was asked for its tensor"


def test_a_connection_that_busy_polls_moves_messages_and_a_bad_spin_is_refused():
    d = domain()
    listener = d.listen("127.0.0.1:0")
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError):
            d.connect(listener.address(), spin=bad)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("s", listener.accept(timeout=30, spin=0.5)))
    t.start()
    c = d.connect(listener.address(), spin=0.5)
    t.join()
    s = out["s"]
    for i in range(20):
        got = bytearray(8)
        rx = s.recv(d.register(got))
        c.send(d.register(bytes([i]) * 8)).wait(timeout=30)
        assert rx.wait(timeout=30).bytes == 8 and got == bytes([i]) * 8


def test_a_non_contiguous_array_is_refused_with_the_fix():
    d = domain()
    a = np.zeros((64, 64), dtype=np.float32)[:, ::2]
    with pytest.raises(BufferError, match="ascontiguousarray"):
        d.register(a)
    with pytest.raises(ValueError):
        d.register(bytearray())


def test_bounds_are_checked_here_and_at_the_peer():
    d = domain()
    target = np.zeros(4096, dtype=np.uint8)
    exposed, s, c, remote = exposed_pair(d, target, tag=2)
    src = d.register(np.ones(4096, dtype=np.uint8))
    with pytest.raises(gpu_rdma.OutOfBounds):
        c.send(src, offset=4000, length=200)
    with pytest.raises(gpu_rdma.GpuRdmaError):
        c.write(src, remote, remote_offset=1)  # 4096 bytes at offset 1 of 4096
    assert not src.in_use, "a refused operation took nothing"
    # A forged descriptor: the peer refuses it, typed.
    forged = bytearray(exposed.descriptor())
    with pytest.raises(gpu_rdma.GpuRdmaError):
        gpu_rdma.RemoteRegion.from_bytes(bytes(forged[:10]))
    assert not target.any(), "nothing landed"


def test_a_closed_connection_fails_its_operations_and_gives_buffers_back():
    d = domain()
    s, c = pair(d)
    region = d.register(np.zeros(64, dtype=np.uint8))
    rx = s.recv(region)
    s.close()
    with pytest.raises(gpu_rdma.ConnectionLost):
        rx.wait(timeout=30)
    assert not region.in_use
    with pytest.raises(gpu_rdma.ConnectionLost):
        s.send(region)
    with pytest.raises((gpu_rdma.ConnectionLost, gpu_rdma.OperationFailed)):
        c.send(d.register(bytearray(8))).wait(timeout=30)


def test_ctrl_c_interrupts_a_wait_promptly():
    d = domain()
    s, _c = pair(d)
    rx = s.recv(d.register(bytearray(8)))  # nobody sends
    threading.Timer(0.2, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rx.wait()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(gpu_rdma.Timeout):
        rx.wait(timeout=0.1)


def test_ctrl_c_interrupts_an_accept_promptly_and_the_listener_still_accepts():
    d = domain()
    listener = d.listen("127.0.0.1:0")
    threading.Timer(0.2, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        listener.accept(timeout=30)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(gpu_rdma.Timeout):
        listener.accept(timeout=0.1)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("s", listener.accept(timeout=30)))
    t.start()
    c = d.connect(listener.address())
    t.join()
    rx = out["s"].recv(d.register(bytearray(4)))
    c.send(d.register(b"ping")).wait(timeout=30)
    assert rx.wait(timeout=30).bytes == 4


def test_registered_objects_are_let_go_once_their_regions_are():
    d = domain()
    s, c = pair(d)
    a = np.zeros(1 << 16, dtype=np.uint8)
    w = weakref.ref(a)
    region = d.register(a)
    rx = s.recv(region)
    c.send(d.register(np.ones(1 << 16, dtype=np.uint8))).wait(timeout=30)
    rx.wait(timeout=30)
    del a, region, rx
    gc.collect()
    gpu_rdma.Domain(transport="tcp")  # any call into the module releases what is pending
    d.register(bytearray(1))
    assert w() is None, "the array was kept after its region went"


def test_doctor_returns_its_checks():
    r = gpu_rdma.doctor()
    names = [c["name"] for c in r["checks"]]
    assert "libibverbs" in names and any(n.startswith("RDMA device") for n in names), names
    assert all(c["status"] in ("ok", "warn", "fail", "unknown") for c in r["checks"])


def three_ranks_exchange(**meet):
    """Three ranks in threads meet through `meet` (a directory, or etcd)
    and send each higher rank a byte naming the pair; what arrived."""
    size = 3
    got = {}
    errors = []

    def rank(r):
        try:
            d = domain()
            w = gpu_rdma.World(d, rank=r, size=size, listen="127.0.0.1:0", **meet)
            assert (w.rank, w.size) == (r, size)
            ops = []
            for hi in range(r + 1, size):
                ops.append(w.peer(hi).send(d.register(np.full(8, 10 * r + hi, dtype=np.uint8))))
            for lo in range(r):
                buf = np.zeros(8, dtype=np.uint8)
                w.accepted(lo, timeout=30).recv(d.register(buf)).wait(timeout=30)
                got[(lo, r)] = int(buf[0])
            for op in ops:
                op.wait(timeout=30)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert got == {(lo, hi): 10 * lo + hi for lo in range(size) for hi in range(lo + 1, size)}


def test_a_world_of_three_ranks_meets_through_a_directory_and_exchanges(tmp_path):
    three_ranks_exchange(directory=str(tmp_path))


@pytest.fixture
def etcd_endpoint(tmp_path):
    """A real etcd (Debian's etcd-server) on loopback, for this test."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd here (Debian's etcd-server): not run")
    if not gpu_rdma.HAS_ETCD:
        pytest.skip("this wheel was built without etcd (maturin build --features etcd): not run")

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    for attempt in range(5):
        port, peer = free_port(), free_port()
        log = tmp_path / f"etcd-{attempt}.log"
        client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
        with open(log, "w") as err:
            proc = subprocess.Popen(
                ["etcd", "--name", "py", "--data-dir", str(tmp_path / f"etcd-{attempt}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"py={peer_url}"],
                stdout=subprocess.DEVNULL, stderr=err)
        until = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < until:
            if f"serving insecure client requests on 127.0.0.1:{port}" in log.read_text():
                try:
                    yield client
                finally:
                    proc.kill()
                    proc.wait()
                return
            time.sleep(0.02)
        proc.kill()
        proc.wait()
    pytest.fail(f"etcd did not serve in five tries: {log.read_text()[-2000:]}")


def test_a_world_of_three_ranks_meets_through_etcd_and_exchanges(etcd_endpoint):
    three_ranks_exchange(etcd=etcd_endpoint, job=f"py-{os.getpid()}")
    # The endpoint named wrong: a clear error naming it, not a hang.
    with pytest.raises(gpu_rdma.GpuRdmaError):
        gpu_rdma.World(domain(), rank=0, size=1, etcd="http://127.0.0.1:1")
    with pytest.raises(gpu_rdma.InvalidArgument, match="one of them"):
        gpu_rdma.World(domain(), "/tmp", rank=0, size=1, etcd=etcd_endpoint)


def test_a_world_without_ranks_or_a_launcher_says_what_is_missing(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(gpu_rdma.InvalidArgument, match="launcher"):
        gpu_rdma.World(domain(), str(tmp_path))
    with pytest.raises(gpu_rdma.InvalidArgument):
        gpu_rdma.World(domain(), str(tmp_path), rank=1)
