"""Reads off the event loop (`TieredStore.read_now`): a batch one disk tier holds is read
on worker threads started from the caller's thread.  A clean batch lands bytes equal and
goes on the books as a regular read would (hits, promotions); anything else is handed
back untouched for the regular path, which finds and settles what is wrong."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import torch

from kvstore.backends.base import ReadsNow
from kvstore.backends.disk import DiskBackend
from kvstore.tier_stream import ByteTarget
from kvstore.tiered import TieredStore

NAMES = [f"ns/m/f-1-0/{i}" for i in range(4)]


def _tensors(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(256, 1024, generator=g).to(torch.bfloat16) for _ in range(n)]  # 512 KiB each


async def _read_now(st: TieredStore, names, outs) -> tuple[bool, list[int] | None, str]:
    """(started, what `done` was told, the thread that told it)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[list[int] | None, str]] = loop.create_future()

    def done(sizes: list[int] | None) -> None:
        told = (sizes, threading.current_thread().name)
        loop.call_soon_threadsafe(fut.set_result, told)

    started = await asyncio.to_thread(st.read_now, names, outs, done, loop)  # from another thread, as LMCache's
    if not started:
        return False, None, ""
    sizes, thread = await asyncio.wait_for(fut, 30)
    return True, sizes, thread


async def test_a_clean_batch_lands_bytes_equal_off_the_loop_and_counts_as_hits(tmp_path: Path) -> None:
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors()
    assert await st.put_many(list(zip(NAMES, data))) == [True] * 4
    outs = [torch.zeros_like(t) for t in data]
    hits0 = st.stats().tiers[0].hits
    started, sizes, thread = await _read_now(st, NAMES, outs)
    assert started and sizes == [t.nbytes for t in data]
    assert thread.startswith("kvstore-read"), "answered from a worker thread, not the loop"
    assert all(torch.equal(a, b) for a, b in zip(data, outs))
    assert st.stats().tiers[0].hits == hits0 + 4, "the reads went on the books as hits"
    assert st.tiers[0].backend.counters.hits == 4
    await st.close()


async def test_hits_off_the_loop_reach_the_books_by_themselves_soon_after(tmp_path: Path) -> None:
    """Nobody asks for stats or drains: the batches' hits are gathered and kept by the
    loop within `SETTLE_S` (seen here through counters that do not settle them)."""
    from kvstore.tiered.direct import SETTLE_S

    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors()
    assert await st.put_many(list(zip(NAMES, data))) == [True] * 4
    outs = [torch.zeros_like(t) for t in data]
    for k in range(4):  # four batches of one
        started, sizes, _ = await _read_now(st, NAMES[k : k + 1], outs[k : k + 1])
        assert started and sizes == [data[k].nbytes]
    await asyncio.sleep(SETTLE_S * 10)
    assert st.tiers[0].backend.counters.hits == 4 and st.placement.tiers[0].counters.hits == 4
    assert all(torch.equal(a, b) for a, b in zip(data, outs))
    await st.close()


def _byte_target(t: torch.Tensor, shape=None, dtype: str = "bfloat16") -> ByteTarget:
    return ByteTarget(tuple(shape or t.shape), dtype, t.view(-1).view(torch.uint8).numpy().data)


async def test_byte_targets_take_the_payload_as_tensors_do(tmp_path: Path) -> None:
    """Targets described by shape, dtype and bytes (LMCache's MemoryObjs, no tensor view
    made) land bytes equal; one whose shape or dtype is not the frame's is not written
    into, and the batch is handed back for the regular path."""
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors(2)
    assert await st.put_many(list(zip(NAMES[:2], data))) == [True] * 2
    outs = [torch.zeros_like(t) for t in data]
    started, sizes, _ = await _read_now(st, NAMES[:2], [_byte_target(o) for o in outs])
    assert started and sizes == [t.nbytes for t in data]
    assert all(torch.equal(a, b) for a, b in zip(data, outs))
    for shape, dtype in (((1024, 256), "bfloat16"), ((256, 1024), "float16")):
        out = torch.zeros_like(data[0])
        started, sizes, _ = await _read_now(st, NAMES[:1], [_byte_target(out, shape, dtype)])
        assert started and sizes is None, "handed back"
        assert out.count_nonzero() == 0, "a target of another geometry is never written into"
    await st.close()


async def test_fp8_chunks_load_on_every_path_alike(tmp_path: Path) -> None:
    """An fp8 KV chunk (vLLM's ``kv_cache_dtype=fp8``) is stored raw and read back bytes
    equal by the loop's read and off the loop alike (before, the loop's read refused
    the dtype it had stored)."""
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    for k, dtype in enumerate((torch.float8_e4m3fn, torch.float8_e5m2)):
        t = torch.randn(256, 1024).to(dtype)
        assert await st.put_many([(NAMES[k], t)]) == [True]
        (got,) = await st.get_many([NAMES[k]])
        assert got is not None and got.dtype == dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
        out = torch.zeros_like(t)
        target = ByteTarget(tuple(t.shape), str(dtype).removeprefix("torch."), out.view(torch.uint8).numpy().data)
        started, sizes, _ = await _read_now(st, NAMES[k : k + 1], [target])
        assert started and sizes == [t.nbytes] and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    await st.close()


async def test_a_hit_on_the_disk_tier_is_promoted_as_a_regular_read_is(tmp_path: Path) -> None:
    data = _tensors(2)
    st = TieredStore.from_urls([f"mem://direct-{tmp_path.name}?capacity=700KiB", f"file://{tmp_path / 'd'}?fsync=false"])
    for name, t in zip(NAMES, data):  # the second moves the first down to the disk tier
        assert await st.put_many([(name, t)]) == [True]
    await st.drain()
    assert st.placement.where(NAMES[0]) == 1
    out = torch.zeros_like(data[0])
    started, sizes, _ = await _read_now(st, NAMES[:1], [out])
    assert started and sizes == [data[0].nbytes] and torch.equal(out, data[0])
    await st.drain()
    assert st.placement.where(NAMES[0]) == 0, "the hit promoted it into the memory tier"
    assert st.stats().tiers[0].promotions_in == 1
    assert await st.tiers[0].contains_many([NAMES[0]]) == [True]
    await st.close()


async def test_a_corrupt_object_is_handed_back_and_the_regular_read_quarantines_it(tmp_path: Path) -> None:
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors()
    await st.put_many(list(zip(NAMES, data)))
    backend: DiskBackend = st.tiers[0].backend  # type: ignore[assignment]
    path = backend.path_of(NAMES[2])
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    await asyncio.sleep(0.1)  # (a read quarantines only a file older than its start)
    outs = [torch.zeros_like(t) for t in data]
    started, sizes, _ = await _read_now(st, NAMES, outs)
    assert started and sizes is None, "not all clean: handed back"
    assert st.tiers[0].counters.corrupt == 0 and backend.counters.hits == 0, "and left no trace on the books"
    got = await st.get_many(NAMES, out=outs)  # what the caller then does
    assert [g is not None for g in got] == [True, True, False, True]
    assert st.tiers[0].counters.corrupt == 1
    assert any((tmp_path / "d" / "quarantine").iterdir())
    await st.close()


async def test_a_file_removed_behind_the_store_is_handed_back_then_a_miss(tmp_path: Path) -> None:
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors(2)
    await st.put_many(list(zip(NAMES[:2], data)))
    backend: DiskBackend = st.tiers[0].backend  # type: ignore[assignment]
    backend.path_of(NAMES[1]).unlink()
    outs = [torch.zeros_like(t) for t in data]
    started, sizes, _ = await _read_now(st, NAMES[:2], outs)
    assert started and sizes is None
    got = await st.get_many(NAMES[:2], out=outs)
    assert got[0] is not None and got[1] is None
    assert await st.contains_many(NAMES[:2]) == [True, False]
    await st.close()


async def test_batches_the_books_cannot_place_on_one_disk_tier_go_the_regular_way(tmp_path: Path) -> None:
    st = TieredStore.from_urls([f"mem://direct2-{tmp_path.name}?capacity=64MiB", f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors(2)
    await st.put_many([(NAMES[0], data[0])])
    outs = [torch.zeros_like(t) for t in data]
    assert (await _read_now(st, NAMES[:1], outs[:1]))[0] is False, "the memory tier reads on the loop"
    assert (await _read_now(st, NAMES[1:2], outs[1:2]))[0] is False, "a name the books do not hold"
    assert (await _read_now(st, [], []))[0] is False
    await st.close()
    st2 = TieredStore.from_urls([f"file://{tmp_path / 'e'}?fsync=false"])
    await st2.put_many([(NAMES[0], data[0])])
    st2.breakers[0].record(False)  # the tier's breaker is open
    assert (await _read_now(st2, NAMES[:1], outs[:1]))[0] is False
    await st2.close()


def _slow(backend: DiskBackend, gate: threading.Event | None, began: threading.Event, sleep_s: float = 0.0) -> list[str]:
    """One object at a time; each step signals `began`, then waits for `gate` (or
    sleeps); returns the names stepped."""
    real = backend.reader_now()
    assert real is not None
    stepped: list[str] = []

    def step(name, sink):
        stepped.append(name)
        began.set()
        if gate is not None:
            assert gate.wait(30)
        time.sleep(sleep_s)
        return real.step(name, sink)

    backend.reader_now = lambda: ReadsNow(step, 1)  # type: ignore[method-assign]
    return stepped


async def test_close_stops_a_batch_under_way_and_waits_for_its_object_in_progress(tmp_path: Path) -> None:
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors(2)
    await st.put_many(list(zip(NAMES[:2], data)))
    backend: DiskBackend = st.tiers[0].backend  # type: ignore[assignment]
    gate, began = threading.Event(), threading.Event()
    stepped = _slow(backend, gate, began)
    loop = asyncio.get_running_loop()
    told: list[list[int] | None] = []
    outs = [torch.zeros_like(t) for t in data]
    assert st.read_now(NAMES[:2], outs, told.append, loop)
    assert await asyncio.to_thread(began.wait, 10)
    closing = asyncio.ensure_future(st.close())
    await asyncio.sleep(0.2)
    assert not closing.done(), "close waits: the object under way still writes into its caller's tensor"
    gate.set()
    await asyncio.wait_for(closing, 10)
    assert stepped == NAMES[:1], "the object not begun was never read"
    assert told == [None], "handed back: the caller's regular read (refused once closed) decides"
    assert not st.read_now(NAMES[:1], outs[:1], told.append, loop), "closed: nothing starts"


async def test_a_batch_past_the_tier_deadline_is_handed_back_and_later_batches_go_the_regular_way(
    tmp_path: Path,
) -> None:
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"], tier_timeout=0.2)
    data = _tensors(3)
    await st.put_many(list(zip(NAMES[:3], data)))
    backend: DiskBackend = st.tiers[0].backend  # type: ignore[assignment]
    began = threading.Event()
    stepped = _slow(backend, None, began, sleep_s=0.5)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[list[int] | None] = loop.create_future()
    outs = [torch.zeros_like(t) for t in data]
    t0 = time.monotonic()
    assert st.read_now(NAMES[:2], outs[:2], lambda s: loop.call_soon_threadsafe(fut.set_result, s), loop)
    assert await asyncio.to_thread(began.wait, 10)
    await asyncio.sleep(0.3)  # the batch is past the tier's deadline, its first object still reading
    assert not st.read_now(NAMES[2:3], outs[2:3], lambda s: None, loop), "overdue: the regular path"
    assert await asyncio.wait_for(fut, 10) is None
    assert time.monotonic() - t0 < 0.9, "one object's time, not the batch's"
    assert stepped == NAMES[:1]
    await st.close()


async def test_a_tier_with_a_codec_reads_on_the_loop(tmp_path: Path) -> None:
    st = TieredStore.from_urls([(f"file://{tmp_path / 'd'}?fsync=false", "cachegen")])
    t = torch.randn(2, 4, 256, 128).to(torch.bfloat16)
    assert await st.put_many([(NAMES[0], t)]) == [True]
    assert (await _read_now(st, NAMES[:1], [torch.zeros_like(t)]))[0] is False
    await st.close()


async def _first_name_failing(tmp_path: Path, monkeypatch) -> tuple[list[bool], list[float], TieredStore, torch.Tensor]:
    """A disk-tier store holding NAMES[0] and NAMES[1], every read of NAMES[0] failing
    with EIO while ``failing[0]``, and the reader's clock at ``now[0]``:
    (failing, now, store, the tensor both hold)."""
    import errno

    import kvstore.backends.disk as disk
    import kvstore.tiered.reads as reads

    real = disk._stream_one
    failing = [True]

    def flaky(path, sink, *a):
        if failing[0] and path.name.endswith(disk.encode_filename(NAMES[0])):
            raise OSError(errno.EIO, "Input/output error")
        return real(path, sink, *a)

    monkeypatch.setattr(disk, "_stream_one", flaky)
    now = [1000.0]
    monkeypatch.setattr(reads, "clock", lambda: now[0])
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"], tier_timeout=5)
    t = torch.randn(64, 64)
    await st.put_many([(NAMES[0], t), (NAMES[1], t)])
    return failing, now, st, t


async def test_clean_reads_off_the_loop_still_let_an_unreadable_object_leave_the_books(
    tmp_path: Path, monkeypatch
) -> None:
    """A chunk every read of which fails (EIO), loaded alone between clean loads of other
    chunks, leaves the books after its streak, as it does when every read is the loop's."""
    _, now, st, t = await _first_name_failing(tmp_path, monkeypatch)
    for _ in range(6):
        out = torch.zeros_like(t)
        started, sizes, _ = await _read_now(st, NAMES[:1], [out])  # (not started once off the books)
        assert sizes is None
        assert await st.get_many(NAMES[:1], out=[out]) == [None]
        started, sizes, _ = await _read_now(st, NAMES[1:2], [out])
        assert started and sizes is not None
        now[0] += 20
    assert st.placement.where(NAMES[0]) is None and await st.contains_many(NAMES[:2]) == [False, True]
    await st.close()


async def test_a_clean_read_off_the_loop_ends_a_failing_streak_before_the_next_failure_counts(
    tmp_path: Path, monkeypatch
) -> None:
    """A name with two failed reads in a row, then read clean off the loop, then failing
    once more at once (before the loop's pass over the gathered hits): a new streak, not
    the third strike of the old one; it stays on the books."""
    failing, now, st, t = await _first_name_failing(tmp_path, monkeypatch)
    out = torch.zeros_like(t)
    for _ in range(3):  # X fails on the loop while the tier answers Y: a streak of two
        assert await st.get_many(NAMES[:1], out=[out]) == [None]
        started, sizes, _ = await _read_now(st, NAMES[1:2], [out])
        assert started and sizes is not None
        now[0] += 20
    failing[0] = False
    started, sizes, _ = await _read_now(st, NAMES[:1], [out])  # X reads clean
    assert started and sizes is not None and torch.equal(out, t)
    failing[0] = True
    assert await st.get_many(NAMES[:1], out=[out]) == [None]  # and fails again at once
    assert st.placement.where(NAMES[0]) is not None, "a clean read in between: the old streak ended"
    await st.close()


async def test_an_lru_victim_chosen_right_after_a_read_off_the_loop_is_not_the_chunk_just_read(
    tmp_path: Path,
) -> None:
    """Put A, put B, load A off the loop, put C at once: the LRU tier evicts B, as it
    would had the loop read A (the hit's touch is on the books before a victim is chosen)."""
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false&capacity=1100KiB&policy=lru"])
    a, b, c = _tensors(3)
    for name, x in zip(NAMES[:2], (a, b)):
        assert await st.put_many([(name, x)]) == [True]
    out = torch.zeros_like(a)
    started, sizes, _ = await _read_now(st, NAMES[:1], [out])
    assert started and sizes == [a.nbytes]
    assert await st.put_many([(NAMES[2], c)]) == [True]
    await st.drain()
    assert [st.placement.where(n) is not None for n in NAMES[:3]] == [True, False, True]
    await st.close()


async def test_a_fault_in_the_books_of_reads_off_the_loop_fails_neither_stats_nor_close(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The reads were answered; a fault keeping their books is logged, and the store's
    `stats`, `drain` and `close` (which keep them first) still work."""
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors(2)
    assert await st.put_many(list(zip(NAMES[:2], data))) == [True] * 2

    def broken(*_a, **_k):
        raise RuntimeError("policy fault")

    monkeypatch.setattr(st.placement, "hit", broken)
    outs = [torch.zeros_like(t) for t in data]
    started, sizes, _ = await _read_now(st, NAMES[:2], outs)
    assert started and sizes is not None and all(torch.equal(a, b) for a, b in zip(data, outs))
    st.stats()
    await st.drain()
    assert "keeping the books of 1 read(s) off the loop failed" in caplog.text
    await st.close()  # (does not raise)


async def test_streamed_reads_leave_nothing_for_the_garbage_collector(tmp_path: Path) -> None:
    """A read's sinks and targets are freed when the read ends, not by the collector: in
    a process holding LMCache and torch a full collection takes ~0.2 s, a stall of
    every load under way."""
    import gc

    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])
    data = _tensors()
    await st.put_many(list(zip(NAMES, data)))
    outs = [torch.zeros_like(t) for t in data]
    await st.get_many(NAMES, out=outs)
    await _read_now(st, NAMES, outs)
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            assert all(g is not None for g in await st.get_many(NAMES, out=outs))
            assert (await _read_now(st, NAMES, outs))[1] is not None
        await asyncio.sleep(0.1)
        assert gc.collect() == 0
    finally:
        gc.enable()
    await st.close()
