"""asyncio glue: operations are awaited through one eventfd the crate's
engine rings when awaited operations finish; each event loop watches it
(no thread per operation, no GIL on the engine's thread)."""

import asyncio
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


async def inbox_wait(start, tag, n, timeout, what):
    """`Inbox.wait_async`: the wait starts here, on the awaiting loop."""
    fut = future()
    start(fut, tag, n)
    return await bounded(fut, timeout, what)


async def bounded(fut, timeout, what):
    """Awaits `fut` for up to `timeout` seconds (None: no limit); past it,
    `fut` is cancelled and `Timeout(what)` raised."""
    if timeout is None:
        return await fut
    try:
        return await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        raise _native.Timeout(what) from None
