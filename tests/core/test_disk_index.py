"""The disk tier's shared index, on the real file system with real processes: one byte
budget and one LRU order for every process opening a store, eviction at open, an index
lost or corrupt rebuilt with nothing lost, and no directory walk on the event loop."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore.backends.disk import DiskBackend
from kvstore.backends.disk_index import INDEX_FILE
from tests.support.disk import on_disk

MiB = 1 << 20


async def run_python(code: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


WRITER = """
import asyncio, sys
from kvstore.backends.disk import DiskBackend
async def main():
    be = DiskBackend(sys.argv[1], capacity=4 << 20, fsync=False, concurrency=4)
    tag = sys.argv[2]
    ok = 0
    for batch in range(12):
        got = await be.put_many([(f"{tag}/o{batch}-{i}", bytes([i]) * (64 << 10)) for i in range(8)])
        ok += sum(got)
    await be.close()
    print(ok)
asyncio.run(main())
"""


async def test_two_processes_keep_one_byte_budget(tmp_path: Path) -> None:
    root = tmp_path / "store"
    DiskBackend(root)  # create it (and its index) once
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", WRITER, str(root), tag, stdout=asyncio.subprocess.PIPE
        )
        for tag in ("a", "b")
    ]
    peak = 0
    done = asyncio.gather(*(p.communicate() for p in procs))
    while not done.done():
        peak = max(peak, on_disk(root))
        await asyncio.sleep(0.002)
    outs = await done
    assert all(p.returncode == 0 for p in procs)
    assert sum(int(o[0]) for o in outs) == 2 * 12 * 8  # every put fit (after evicting)
    in_flight = 2 * 4 * (64 << 10)  # two processes, four writes each
    assert peak <= 4 * MiB + in_flight, peak
    assert on_disk(root) <= 4 * MiB
    again = DiskBackend(root, capacity=4 * MiB)
    await again.ready()
    assert again.stats().bytes == on_disk(root) <= 4 * MiB
    assert again.stats().objects == 4 * MiB // (64 << 10)
    await again.close()


async def test_reopening_over_budget_evicts_down_to_it_oldest_first(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, fsync=False)
    for i in range(10):
        assert await be.put(f"ns/k{i}", b"x" * 1000)
    await be.close()
    small = DiskBackend(tmp_path, capacity=5000)
    await small.ready()
    assert on_disk(tmp_path) <= 5000
    assert small.stats().bytes <= 5000 and small.stats().objects == 5
    assert await small.contains_many([f"ns/k{i}" for i in range(10)]) == [False] * 5 + [True] * 5
    assert small.counters.evictions == 0  # counted by the index at open, not by a put
    await small.close()


READ_ONE = """
import asyncio, sys
from kvstore.backends.disk import DiskBackend
async def main():
    be = DiskBackend(sys.argv[1])
    print(bytes(await be.get(sys.argv[2])).decode())
    await be.close()
asyncio.run(main())
"""


async def test_lru_order_is_shared_across_processes(tmp_path: Path) -> None:
    a = DiskBackend(tmp_path, capacity=4000, fsync=False)
    for i in range(4):
        assert await a.put(f"ns/k{i}", str(i).encode() * 1000)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", READ_ONE, str(tmp_path), "ns/k0", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert out.decode().startswith("0000")  # process B read k0: it is now the most recent
    assert await a.put("ns/k4", b"4" * 1000)
    assert await a.contains_many([f"ns/k{i}" for i in range(5)]) == [True, False, True, True, True]
    assert await a.put("ns/k5", b"5" * 1000)
    assert await a.contains_many([f"ns/k{i}" for i in range(6)]) == [True, False, False, True, True, True]
    await a.close()


async def test_a_read_in_flight_elsewhere_does_not_lose_its_bytes(tmp_path: Path) -> None:
    """POSIX: a file opened before another process evicts it is still read whole."""
    a = DiskBackend(tmp_path, capacity=2000, fsync=False)
    b = DiskBackend(tmp_path, capacity=2000, fsync=False)
    assert await a.put("ns/old", b"o" * 1000) and await a.put("ns/mid", b"m" * 1000)
    fd = os.open(b.path_of("ns/old"), os.O_RDONLY)
    try:
        assert await a.put("ns/new", b"n" * 1000)  # evicts ns/old underneath b's open file
        assert not b.path_of("ns/old").exists()
        assert os.pread(fd, 2000, 0) == b"o" * 1000
    finally:
        os.close(fd)
    await a.close()
    await b.close()


@pytest.mark.parametrize("damage", ["deleted", "corrupt", "truncated", "never"])
async def test_lost_or_corrupt_index_is_rebuilt_at_open_with_nothing_lost(
    tmp_path: Path, damage: str
) -> None:
    be = DiskBackend(tmp_path, fsync=False)
    keys = [f"ns/k{i}" for i in range(50)] + ["~tilde/x", "long/" + "y" * 300]
    assert all(await be.put_many([(k, k.encode()) for k in keys]))
    await be.close()
    index = tmp_path / INDEX_FILE
    if damage in ("deleted", "never"):  # "never": a store an older kvstore wrote
        for f in tmp_path.glob(INDEX_FILE + "*"):
            f.unlink()
    elif damage == "corrupt":
        index.write_bytes(b"this is not a database" * 100)
    else:
        data = index.read_bytes()
        index.write_bytes(data[:100])
    again = DiskBackend(tmp_path, capacity=1 << 30)
    await again.ready()
    assert again.index.rebuilt == 1
    assert again.stats().objects == len(keys)
    assert again.stats().bytes == sum(len(k.encode()) for k in keys)
    assert [bytes(v) for v in await again.get_many(keys)] == [k.encode() for k in keys]
    if damage in ("corrupt", "truncated"):
        assert list(tmp_path.glob(INDEX_FILE + ".corrupt-*"))  # kept for a look, out of the way
    await again.close()
    third = DiskBackend(tmp_path)  # indexed now: no second walk
    await third.ready()
    assert third.index.rebuilt == 0 and third.stats().objects == len(keys)
    await third.close()


async def test_opening_an_indexed_store_walks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = DiskBackend(tmp_path, fsync=False)
    assert all(await be.put_many([(f"ns/k{i}", b"x") for i in range(200)]))
    await be.close()

    def no_walk(*args: object, **kwargs: object) -> None:
        raise AssertionError("an indexed store was walked at open")

    monkeypatch.setattr(DiskBackend, "_entries", no_walk)
    again = DiskBackend(tmp_path)
    assert again.stats().objects == 200  # known from the index's totals as soon as it is constructed
    await again.ready()
    assert len(await again.get_many([f"ns/k{i}" for i in range(200)])) == 200
    await again.close()


async def test_a_store_never_indexed_is_walked_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = DiskBackend(tmp_path, fsync=False)
    assert all(await be.put_many([(f"ns/k{i}", b"x" * 10) for i in range(100)]))
    await be.close()
    for f in tmp_path.glob(INDEX_FILE + "*"):
        f.unlink()
    walked_in: list[str] = []
    real = DiskBackend._entries

    def spy(self: DiskBackend, **kwargs: object) -> object:
        walked_in.append(threading.current_thread().name)
        return real(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskBackend, "_entries", spy)
    t0 = time.monotonic()
    again = DiskBackend(tmp_path)
    assert time.monotonic() - t0 < 5
    got = await again.get_many(["ns/k0", "ns/k99"])  # waits for the index, not for the loop
    assert [bytes(g) for g in got if g is not None] == [b"x" * 10] * 2
    assert walked_in and all(n.startswith("kvstore-disk-index") for n in walked_in)
    assert again.stats().objects == 100
    await again.close()


async def test_row_without_file_is_dropped_and_file_without_row_adopted(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, fsync=False)
    assert await be.put("ns/gone", b"g" * 10) and await be.put("ns/kept", b"k" * 20)
    await be.close()
    other = DiskBackend(tmp_path)
    other.path_of("ns/gone").unlink()  # removed behind the index's back
    db = sqlite3.connect(tmp_path / INDEX_FILE)
    with db:
        db.execute("DELETE FROM objects WHERE name = 'ns/kept'")
    db.close()
    assert await other.get("ns/gone") is None
    assert bytes(await other.get("ns/kept")) == b"k" * 20
    await other.flush()
    assert other.stats().objects == 1 and other.stats().bytes == 20
    await other.close()


async def write_elsewhere(other: DiskBackend, name: str, size: int) -> None:
    """`other` reserves `size` bytes for `name` as if writing it: its row is leased."""
    status, _ = await other.index.run(other.index.reserve, name, size, "other-1", frozenset(), other.capacity, {}, [])
    assert status == "ok"


async def published_elsewhere(other: DiskBackend, name: str, size: int) -> None:
    """That write is done: the row is no longer leased (evictable)."""
    await other.index.run(other.index.reserve, None, 0, "", frozenset(), other.capacity, {}, [(name, size, "other-1")])


async def test_a_put_waits_for_another_process_write_in_flight_rather_than_overshoot(tmp_path: Path) -> None:
    a = DiskBackend(tmp_path, capacity=2000, fsync=False)
    b = DiskBackend(tmp_path, capacity=2000, fsync=False)
    await write_elsewhere(b, "ns/big", 2000)  # then a asks for room
    put = asyncio.ensure_future(a.put("ns/small", b"s" * 100))
    await asyncio.sleep(0.2)
    assert not put.done()  # nothing a can evict: the only row is being written
    await published_elsewhere(b, "ns/big", 2000)
    assert await asyncio.wait_for(put, 10)  # published: evictable now
    assert a.stats().bytes == 100
    await a.close()
    await b.close()


async def test_a_batchs_writes_reserve_in_one_index_transaction_evicting_oldest_first(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, capacity=5000, fsync=False)
    for i in range(4):
        assert await be.put(f"ns/old{i}", b"o" * 1000)
    calls: list[int] = []
    reserve_many = be.index.reserve_many

    def counted(asks: list[tuple[str, int, str]], *rest: object) -> object:
        calls.append(len(asks))
        return reserve_many(asks, *rest)  # type: ignore[arg-type]

    be.index.reserve_many = counted  # type: ignore[method-assign]
    new = [(f"ns/new{i}", bytes([i]) * 1000) for i in range(3)]
    assert await be.put_many(new) == [True] * 3
    assert calls == [3]  # one transaction for the batch, not one hop each in turn
    # room for the batch came from the oldest objects, in order; the budget held
    held = await be.contains_many([f"ns/old{i}" for i in range(4)] + [n for n, _ in new])
    assert held == [False, False, True, True, True, True, True]
    assert be.stats().bytes <= 5000 and on_disk(tmp_path) <= 5000
    for name, data in new:
        assert bytes(await be.get(name)) == data
    await be.close()


async def test_a_write_that_cannot_fit_yet_evicts_nothing_and_the_rest_of_its_batch_is_stored(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, capacity=3000, fsync=False)
    b = DiskBackend(tmp_path, capacity=3000, fsync=False)
    await write_elsewhere(b, "ns/busy", 2500)  # 2500 bytes leased: a 1000-byte object cannot fit
    put = asyncio.ensure_future(be.put_many([("ns/a", b"a" * 400), ("ns/b", b"b" * 1000)]))
    deadline = time.monotonic() + 10
    while not (await be.contains_many(["ns/a"]))[0]:  # ns/a fits and is written...
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # (ns/b's reservation asks again every 20 ms meanwhile)
    assert not put.done()  # ns/b waits for room
    assert bytes(await be.get("ns/a")) == b"a" * 400  # ...and is not evicted for a write that cannot fit anyway
    assert be.counters.evictions == 0
    await published_elsewhere(b, "ns/busy", 2500)
    assert await asyncio.wait_for(put, 10) == [True, True]
    assert be.stats().bytes <= 3000
    await be.close()
    await b.close()


@pytest.mark.parametrize("cancelled", ["before the answer", "after the answer"])
async def test_a_reservation_no_write_will_use_is_given_back_at_once(tmp_path: Path, cancelled: str) -> None:
    """A write reserving the whole budget is cancelled before the index answers, or after
    it answered OK but before the write began: either way no write comes, and the bytes
    go back at once (else its lease would hold the budget for minutes)."""
    a = DiskBackend(tmp_path, capacity=1000, fsync=False)
    b = DiskBackend(tmp_path, capacity=1000, fsync=False)
    await a.ready()
    if cancelled == "before the answer":
        ask = a._ask_index("ns/gone", 1000, "a-1")
        ask.cancel()
        await asyncio.sleep(0)  # (the ask goes to the index)
        assert await a.index.run(a.index.sizes, ["ns/gone"]) == {"ns/gone": 1000}  # reserved: leased
    else:
        answer = a._answer_asks
        task: asyncio.Task[bool] | None = None

        def answered_then_cancelled(*args: object) -> None:
            answer(*args)  # type: ignore[arg-type]
            assert task is not None
            task.cancel()

        a._answer_asks = answered_then_cancelled  # type: ignore[method-assign]
        task = asyncio.ensure_future(a._reserve("ns/gone", 1000, "a-1"))
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await asyncio.wait_for(b.put("ns/b", b"b" * 1000), 10)
    await a.close()
    await b.close()


async def test_a_job_queued_behind_the_index_close_does_not_reopen_it(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, capacity=1000, fsync=False)
    await be.ready()
    index = be.index
    shutdown = index._exec.shutdown
    late: list[object] = []

    def submit_then_shut_down(wait: bool = True, **kw: object) -> None:
        # (a put's reservation sent while the close runs on a worker thread)
        late.append(index.submit(index.reserve_many, [("ns/late", 10, "w-1")], frozenset(), 1000, {}, []))
        shutdown(wait=wait)

    index._exec.shutdown = submit_then_shut_down  # type: ignore[method-assign]
    await be.close()
    with pytest.raises(RuntimeError, match="closed"):
        late[0].result()  # type: ignore[attr-defined]
    assert not (tmp_path / INDEX_FILE).exists()  # an empty store keeps no index: not made again
    assert index._conn is None


async def test_a_put_after_close_is_a_counted_failure(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, fsync=False)
    assert await be.put("ns/a", b"a")
    await be.close()
    errors = be.counters.put_errors
    assert await asyncio.wait_for(be.put("ns/b", b"b"), 5) is False
    assert be.counters.put_errors == errors + 1


async def test_a_failed_index_transaction_keeps_finished_writes_for_the_next(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path, capacity=10_000, fsync=False)
    assert await be.put("ns/a", b"a" * 100)  # written: its row is published with the next transaction
    if be._flush_handle is not None:  # (not by the flush timer: by the transaction that fails)
        be._flush_handle.cancel()
        be._flush_handle = None
    reserve_many = be.index.reserve_many
    fail = [True]
    carried: list[str] = []

    def once_locked(*args: object) -> object:
        if fail.pop() if fail else False:
            carried.extend(name for name, *_ in args[4])  # type: ignore[attr-defined]
            raise sqlite3.OperationalError("database is locked")
        return reserve_many(*args)  # type: ignore[arg-type]

    be.index.reserve_many = once_locked  # type: ignore[method-assign]
    assert await be.put("ns/b", b"b" * 100) is False  # its transaction failed: counted
    assert carried == ["ns/a"]  # (the failed transaction carried ns/a's publish)
    await be.flush()
    with sqlite3.connect(be.index.path) as c:
        (lease,) = c.execute("SELECT lease FROM objects WHERE name = 'ns/a'").fetchone()
    assert lease == 0  # published all the same: not leased for minutes, holding back other writes
    assert await be.put("ns/b", b"b" * 100)
    await be.close()
