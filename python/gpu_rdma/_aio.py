"""asyncio glue: operations are awaited through one eventfd the crate's
engine rings when awaited operations finish; each event loop watches it
(no thread per operation, no GIL on the engine's thread)."""

import asyncio
import time
import weakref

from . import _native

_watched = weakref.WeakSet()


def _watch(loop):
    if loop not in _watched:
        loop.add_reader(_native._ready_fd(), _native._drain)
        _watched.add(loop)


def future():
    """A future of the running loop, whose loop watches the eventfd."""
    loop = asyncio.get_running_loop()
    _watch(loop)
    return loop.create_future()


def _set(fut, ok, value):
    if fut.done():  # cancelled meanwhile
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def settle(fut, ok, value):
    """Resolves `fut` through its own loop (any thread)."""
    loop = fut.get_loop()
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(_set, fut, ok, value)


async def poll(take, tag, n, timeout):
    """`Inbox.wait_async`: `take(tag, n)` again and again, 50 us apart and
    backing off to 1 ms, until it returns the notes; `Timeout` after
    `timeout` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 50e-6
    while True:
        got = take(tag, n)
        if got is not None:
            return got
        if deadline is not None and time.monotonic() >= deadline:
            raise _native.Timeout(f"{n} notification(s) tagged {tag} did not come within {timeout:.3f} s")
        await asyncio.sleep(pause)
        pause = min(pause * 2, 1e-3)
