"""Drive any LMCache L2 adapter synchronously, as LMCache's store and prefetch controllers
do: submit a task, wait on the task kind's event fd, collect the result.

Owns: `SyncL2` (store / lookup / load / unlock on one adapter, each waiting for its
task) and `memory_obj`, a MemoryObj over a caller's tensor.  Used by kvstore's tests
and its MP-mode benchmark, for kvstore's adapter and LMCache's own alike.  Must not
touch: the adapters' internals.
"""

from __future__ import annotations

import select
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.memory_management import MemoryObj


def memory_obj(t: torch.Tensor) -> MemoryObj:
    """A MemoryObj (KV_2LTD format) whose memory is `t`; nothing is copied."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    meta = MemoryObjMetadata(
        shape=t.shape,
        dtype=t.dtype,
        address=t.data_ptr(),
        phy_size=t.nbytes,
        fmt=MemoryFormat.KV_2LTD,
        ref_count=1,
    )
    return TensorMemoryObj(t, meta, parent_allocator=None)


class TaskTimeout(TimeoutError):
    """An adapter did not signal a task's completion in time (it must always signal)."""


class SyncL2:
    """One adapter, one task at a time."""

    def __init__(self, adapter: L2AdapterInterface, timeout_s: float = 60.0) -> None:
        self.adapter = adapter
        self.timeout_s = timeout_s

    def _wait(self, fd: int, deadline: float) -> None:
        from lmcache.v1.platform import consume_fd

        poll = select.poll()
        poll.register(fd, select.POLLIN)
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(int(left * 1000)):
            raise TaskTimeout(f"{type(self.adapter).__name__} did not complete a task in {self.timeout_s}s")
        try:
            consume_fd(fd)
        except BlockingIOError:
            pass

    def store(self, keys: Sequence[ObjectKey], tensors: Sequence[torch.Tensor]) -> bool:
        """True when the adapter reports the store task successful."""
        ad = self.adapter
        deadline = time.monotonic() + self.timeout_s
        tid = ad.submit_store_task(list(keys), [memory_obj(t) for t in tensors])
        while True:
            done = ad.pop_completed_store_tasks()
            if tid in done:
                return done[tid].is_successful()
            self._wait(ad.get_store_event_fd(), deadline)

    def lookup(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Which keys the adapter holds (and has locked until `unlock`)."""
        ad = self.adapter
        deadline = time.monotonic() + self.timeout_s
        tid = ad.submit_lookup_and_lock_task(list(keys), {})
        while (bm := ad.query_lookup_and_lock_result(tid)) is None:
            self._wait(ad.get_lookup_and_lock_event_fd(), deadline)
        return [bm.test(i) for i in range(len(keys))]

    def load(self, keys: Sequence[ObjectKey], into: Sequence[torch.Tensor]) -> list[bool]:
        """Load into the caller's tensors; which keys landed."""
        ad = self.adapter
        deadline = time.monotonic() + self.timeout_s
        tid = ad.submit_load_task(list(keys), [memory_obj(t) for t in into])
        while (bm := ad.query_load_result(tid)) is None:
            self._wait(ad.get_load_event_fd(), deadline)
        return [bm.test(i) for i in range(len(keys))]

    def unlock(self, keys: Sequence[ObjectKey]) -> None:
        self.adapter.submit_unlock(list(keys))


def object_key(i: int, *, model: str = "bench/model", **fields: Any) -> ObjectKey:
    """A distinct ObjectKey for integer `i` (32-byte hash, as LMCache's blake3 keys)."""
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name=model, kv_rank=fields.pop("kv_rank", 0), **fields)


__all__ = ["SyncL2", "TaskTimeout", "memory_obj", "object_key"]
