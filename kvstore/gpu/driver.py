"""The few CUDA driver calls a layerwise pass makes per layer, on raw handles.

Owns: :class:`DriverCalls` (``cuMemcpyAsync`` between two addresses, ``cuEventRecord``,
``cuStreamWaitEvent``, through ``cuda.bindings``, which LMCache itself requires) and
:func:`driver_calls`, which gives the process's one instance or ``None`` when the bindings
or a CUDA context are missing. A layer's copies of LMCache-sized pieces take ~85 us on
an H100 or H200; through torch each copy and event record costs the host 4-6 us (plus a
``.tensor`` view of each LMCache object, 6 us), and the engine's forward thread pays it
between layers. These calls take the addresses and handles as plain integers: on an H200,
0.7 us per record or wait and 2.2 us per copy (a layerwise store's host time per pass fell
~40%).

The copies are stream-ordered exactly as ``copy_(non_blocking=True)`` on the same stream
would be; what torch would otherwise track is the caller's job: device memory read or
written here must be kept for the stream (``Tensor.record_stream``), and host memory must
be page-locked (an address of pageable memory makes the copy synchronous) and must outlive
the copy.

Must not touch: torch's streams and events beyond reading their handles; tensors, layouts
and LMCache objects (callers pass addresses and byte counts).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["DriverCalls", "DriverError", "driver_calls"]


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


class DriverCalls:
    """``cuMemcpyAsync`` / ``cuEventRecord`` / ``cuStreamWaitEvent`` on integer handles
    (``torch.cuda.Stream.cuda_stream``, ``torch.cuda.Event.cuda_event``, ``data_ptr()``)."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self._memcpy = driver.cuMemcpyAsync
        self._record = driver.cuEventRecord
        self._wait = driver.cuStreamWaitEvent

    @staticmethod
    def _failed(call: str, err: Any) -> DriverError:
        name = getattr(err, "name", str(err))
        return DriverError(
            f"{call} failed: {name}. The CUDA context is unusable or an address is not one "
            "CUDA knows (a freed buffer, pageable memory the driver cannot read); the "
            "transfer did not happen"
        )

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` from address ``src`` to ``dst`` on ``stream``
        (direction from the addresses: unified addressing)."""
        (err,) = self._memcpy(dst, src, nbytes, stream)
        if err:
            raise self._failed("cuMemcpyAsync", err)

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream`` (marks everything queued there so far)."""
        (err,) = self._record(event, stream)
        if err:
            raise self._failed("cuEventRecord", err)

    def wait(self, stream: int, event: int) -> None:
        """Make ``stream`` wait for the last record of ``event``."""
        (err,) = self._wait(stream, event, 0)
        if err:
            raise self._failed("cuStreamWaitEvent", err)

    def context_device(self) -> int | None:
        """The device of the calling thread's current CUDA context, or None when it has
        none (torch makes a device's primary context current on a thread once it runs
        CUDA work there). Raw handles, the null stream above all, act in that context."""
        err, ctx = self._driver.cuCtxGetCurrent()
        if err or ctx is None or int(ctx) == 0:  # int(): the handle (getPtr() is the wrapper's)
            return None
        err, dev = self._driver.cuCtxGetDevice()
        return None if err else int(dev)


@functools.cache
def _bindings() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def driver_calls(device: int) -> DriverCalls | None:
    """The driver calls for work on CUDA device ``device`` from this thread, or ``None``
    when ``cuda.bindings`` is not installed or the thread's current CUDA context is not
    that device's (none, or another device's): callers then keep torch's copies."""
    driver = _bindings()
    if driver is None:
        return None
    calls = _instance(driver)
    try:
        return calls if calls.context_device() == device else None
    except Exception:  # no driver library (a machine without a GPU): torch's copies
        return None


@functools.cache
def _instance(driver: Any) -> DriverCalls:
    return DriverCalls(driver)
