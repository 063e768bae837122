"""Staging pool reuse and the host-copy batch on CPU (same bookkeeping as on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kvstore.gpu.staging import DeviceScratch, PinnedPool
from kvstore.gpu.transfer import CopyStream, HostBatch


class _Pending:
    """Stands in for a CUDA event that has not completed yet."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_pool_reuses_buffers_by_size_class():
    pool = PinnedPool(min_buffer_bytes=1024)
    a = pool.acquire(1000)
    assert a.capacity == 1024 and pool.stats.allocations == 1
    pool.release(a)
    b = pool.acquire(700)
    assert b is a and pool.stats.reuses == 1
    c = pool.acquire(3000)  # next size class
    assert c.capacity == 4096 and pool.stats.allocations == 2
    assert b.view((5, 10), torch.float32).shape == (5, 10)
    with pytest.raises(ValueError, match="cannot hold"):
        b.view((1000,), torch.float32)


def test_pool_never_hands_out_a_buffer_still_in_flight():
    pool = PinnedPool(min_buffer_bytes=1024)
    a = pool.acquire(1024)
    event = _Pending()
    pool.release(a, event)
    b = pool.acquire(1024)
    assert b is not a and pool.stats.allocations == 2  # a is busy: a new one is made
    event.done = True
    pool.release(b)
    assert pool.acquire(1024) in (a, b)


def test_pool_at_its_cap_waits_for_the_oldest_copy():
    pool = PinnedPool(max_cached_bytes=2048, min_buffer_bytes=1024)
    a, b = pool.acquire(1024), pool.acquire(1024)
    ea, eb = _Pending(), _Pending()
    pool.release(a, ea)
    pool.release(b, eb)
    c = pool.acquire(1024)
    assert c is a and ea.waited == 1 and pool.stats.waits == 1 and pool.stats.allocations == 2


def test_pool_drops_idle_buffers_over_its_cap():
    pool = PinnedPool(max_cached_bytes=2048, min_buffer_bytes=1024)
    bufs = [pool.acquire(1024) for _ in range(3)]
    for buf in bufs:
        pool.release(buf)
    assert pool.stats.cached_bytes <= 2048 and pool.stats.dropped == 1


def test_host_batch_staged_copies_land_on_complete():
    pool = PinnedPool(min_buffer_bytes=1024)
    batch = HostBatch(CopyStream("cpu"), pool, stage_all=True)
    src = torch.arange(300, dtype=torch.float32)
    dst = torch.zeros(300)
    batch.to_host(src, dst)
    assert torch.count_nonzero(dst) == 0  # still in the staging buffer
    batch.complete()
    assert torch.equal(dst, src)
    back = torch.zeros(300)
    batch.to_device(dst, back)
    batch.complete()
    assert torch.equal(back, src)
    assert pool.stats.allocations == 1 and pool.stats.reuses == 1


def test_device_scratch_grows_and_is_reused():
    scratch = DeviceScratch("cpu")
    a = scratch.get((4, 8), torch.float16)
    first = scratch.nbytes
    b = scratch.get((2, 8), torch.float16)
    assert scratch.nbytes == first and a.data_ptr() == b.data_ptr()
    scratch.get((64, 8), torch.float32)
    assert scratch.nbytes >= 64 * 8 * 4


@pytest.mark.gpu
def test_pool_pins_on_cuda():
    pool = PinnedPool()
    assert pool.acquire(10).data.is_pinned()
