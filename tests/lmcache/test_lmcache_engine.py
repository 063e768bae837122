"""Both plugin paths through the real LMCache engine on CPU, sync and async loading."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.lmcache.helpers import CHUNK, cpu_bytes_in_use, empty, random_kv

PATHS = [("plugin", False), ("plugin", True), ("remote", False), ("remote", True)]
IDS = ["plugin-sync", "plugin-async", "remote-sync", "remote-async"]
TWO_PATHS = pytest.mark.parametrize(
    ("path", "asyncm"), [("plugin", False), ("remote", True)], ids=["plugin-sync", "remote-async"]
)


def _store(eng, tokens, kv):
    eng.engine.store(tokens, kvcaches=kv)
    assert eng.wait_for_writes(10)


def _names(eng, tokens) -> list[str]:
    """kvstore object names of the chunks of `tokens`, in order."""
    backend = eng.kvstore_backend()
    return [backend._name(k) for _, _, k in eng.engine.token_database.process_tokens(tokens)]


def _same_prefix(a, b, n):
    return all(
        torch.equal(ka[:, :, :n], kb[:, :, :n]) and torch.equal(va[:, :, :n], vb[:, :, :n])
        for (ka, va), (kb, vb) in zip(a, b)
    )


@pytest.mark.parametrize(("path", "asyncm"), PATHS, ids=IDS)
def test_store_lookup_retrieve_is_bytes_equal(make_engine, path, asyncm):
    eng = make_engine(path, asyncm)
    assert eng.kvstore_backend() is not None, "kvstore was not loaded by LMCache"
    tokens = torch.arange(4 * CHUNK)
    kv = random_kv(len(tokens))
    _store(eng, tokens, kv)

    out = empty(len(tokens))
    hit, got = eng.lookup_then_load(tokens, out)
    assert (hit, got) == (len(tokens), len(tokens))
    assert _same_prefix(kv, out, len(tokens))
    assert cpu_bytes_in_use(eng) == 0, "every MemoryObj went back to LMCache's allocator"


@pytest.mark.parametrize(("path", "asyncm"), PATHS, ids=IDS)
def test_partial_hit_returns_the_right_prefix(make_engine, path, asyncm):
    eng = make_engine(path, asyncm)
    tokens = torch.arange(4 * CHUNK)
    kv = random_kv(len(tokens), seed=1)
    _store(eng, tokens, kv)

    # same first 2.5 chunks, then different tokens: exactly two chunks match
    other = torch.cat([tokens[: 2 * CHUNK + CHUNK // 2], torch.arange(10_000, 10_000 + CHUNK + CHUNK // 2)])
    out = empty(len(other))
    hit, got = eng.lookup_then_load(other, out)
    assert (hit, got) == (2 * CHUNK, 2 * CHUNK)
    assert _same_prefix(kv, out, 2 * CHUNK)
    assert not out[0][0][:, :, 2 * CHUNK :].any(), "nothing past the hit may be written"

    fresh = torch.arange(50_000, 50_000 + 2 * CHUNK)
    assert eng.lookup_then_load(fresh, empty(len(fresh))) == (0, 0)
    assert cpu_bytes_in_use(eng) == 0


@TWO_PATHS
def test_a_deleted_chunk_shortens_the_hit(make_engine, path, asyncm):
    eng = make_engine(path, asyncm)
    tokens = torch.arange(4 * CHUNK)
    kv = random_kv(len(tokens), seed=2)
    _store(eng, tokens, kv)
    backend = eng.kvstore_backend()
    # chunk 2 disappears from storage (evicted or lost): the hit stops before it
    names = _names(eng, tokens)[2:3]
    assert backend.runtime.call(backend.runtime.store.delete_many(names), [False], "delete") == [True]
    out = empty(len(tokens))
    assert eng.lookup_then_load(tokens, out) == (2 * CHUNK, 2 * CHUNK)
    assert _same_prefix(kv, out, 2 * CHUNK)


def test_repeated_stores_are_written_once(make_engine):
    eng = make_engine("plugin", False)
    tokens = torch.arange(2 * CHUNK)
    kv = random_kv(len(tokens), seed=3)
    for _ in range(3):
        eng.engine.store(tokens, kvcaches=kv)
    backend = eng.kvstore_backend()
    assert eng.wait_for_writes(10)
    stats = backend.stats()
    assert sum(t["writes"] for t in stats["store"]["tiers"]) == 2, "each chunk reaches the tiers once"
    assert stats["plugin"]["put_failed"] == 0


def test_bad_config_fails_loudly(make_engine, caplog):
    caplog.set_level(logging.ERROR, logger="kvstore.plugins")
    eng = make_engine("plugin", False, tiers=["nosuch://x"])
    # LMCache swallows the constructor's exception and runs without the plugin...
    assert eng.kvstore_backend() is None
    # ...so the error log must say what is wrong and how to fix it
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "NOT loaded" in msg and "unknown backend scheme 'nosuch'" in msg


def test_timeout_must_be_below_lmcache_deadline(make_engine, caplog):
    caplog.set_level(logging.ERROR, logger="kvstore.plugins")
    eng = make_engine("remote", False, extra={"kvstore.timeout_s": 9})
    assert eng.kvstore_backend() is None
    assert "below LMCache's blocking_timeout_secs" in caplog.text


@TWO_PATHS
def test_stored_chunks_carry_their_prefix_chain(make_engine, path, asyncm):
    """The chain policy sees each chunk's parent, also across a lookup and a later store."""
    eng = make_engine(path, asyncm)
    tokens = torch.arange(4 * CHUNK)
    kv = random_kv(len(tokens), seed=5)
    _store(eng, tokens[: 2 * CHUNK], [(k[:, :, : 2 * CHUNK], v[:, :, : 2 * CHUNK]) for k, v in kv])
    assert eng.engine.lookup(tokens) == 2 * CHUNK  # the prompt grew: its first half is cached
    new = torch.ones(len(tokens), dtype=torch.bool)
    new[: 2 * CHUNK] = False  # as vLLM does: store only what was not loaded from the cache
    eng.engine.store(tokens, mask=new, kvcaches=kv)
    assert eng.wait_for_writes(10)
    names = _names(eng, tokens)
    meta = eng.kvstore_backend().runtime.store.placement.meta
    assert [meta[n].parent for n in names] == [None, *names[:3]]
    assert [meta[n].depth for n in names] == [0, 1, 2, 3]


def test_a_lookup_does_not_wait_for_the_stores_loop_unless_a_tier_must_be_asked(make_engine):
    """LMCache's scheduler looks up every request: chunks this process holds, and chunks
    no tier has, are answered on its thread (no hop to kvstore's loop, ~0.1 ms each on
    two cores); a chunk another process stored is found and adopted on the loop."""
    import asyncio
    import time
    import uuid

    from kvstore.tiered import TieredStore

    space = f"mem://t-{uuid.uuid4().hex[:8]}"
    eng = make_engine("plugin", False, tiers=[space])
    tokens = torch.arange(4 * CHUNK)
    _store(eng, tokens, random_kv(len(tokens), seed=4))
    other = torch.arange(70_000, 70_000 + CHUNK)
    names = _names(eng, other)

    async def store_elsewhere() -> None:  # another store on the same shared space
        async with TieredStore.from_urls([space]) as st:
            assert await st.put_many([(names[0], torch.zeros(4))]) == [True]

    asyncio.run(store_elsewhere())
    runtime = eng.kvstore_backend().runtime

    async def busy() -> None:
        time.sleep(0.6)  # the loop is stuck in something else

    blocker = runtime.submit(busy())
    time.sleep(0.05)
    t = time.monotonic()
    assert eng.engine.lookup(tokens) == len(tokens)
    assert eng.engine.lookup(torch.arange(90_000, 90_000 + CHUNK)) == 0
    assert time.monotonic() - t < 0.3, "a lookup the books and the tiers answer at once waited for the loop"
    assert not blocker.done()
    assert eng.engine.lookup(other) == CHUNK  # held, but unknown here: asked on the loop
    assert blocker.done()


def test_a_pinned_lookup_keeps_its_chunks_until_the_retrieve(make_engine):
    """vLLM's scheduler looks up with ``pin=True`` and retrieves later: the chunks the
    lookup promised stay (other stores meanwhile fill the tier), and the retrieve
    delivers all of them; the unpin lets them go again."""
    import uuid

    eng = make_engine("plugin", False, tiers=[f"mem://t-{uuid.uuid4().hex[:6]}?capacity=20KiB"])
    store = eng.kvstore_backend().runtime.store
    a = torch.arange(4 * CHUNK)
    kv = random_kv(len(a), seed=4)
    _store(eng, a, kv)
    hit = eng.engine.lookup(a, lookup_id="req-a", pin=True)
    assert hit == len(a)
    assert store.stats().pinned == len(_names(eng, a))
    b = torch.arange(1000, 1000 + 8 * CHUNK)
    _store(eng, b, random_kv(len(b), seed=5))  # more than the tier holds
    out = empty(len(a))
    mask = eng.engine.retrieve(a, kvcaches=out, req_id="req-a")
    assert int(mask.sum()) == hit
    assert _same_prefix(kv, out, len(a))
    eng.engine.lookup_unpin("req-a")
    assert store.stats().pinned == 0


def test_kv_of_another_geometry_under_the_same_model_name_is_a_miss(monkeypatch, tmp_path):
    """Two deployments share a tier under one model name but differ in KV geometry (an
    alias reused for another model): the checksum and key hold, yet the objects are
    refused (a miss), never handed to LMCache with another model's shape."""
    import os

    from kvstore.demo.cpu_engine import build_cpu_engine
    from tests.lmcache.helpers import HEAD_DIM, HEADS, LAYERS, lmcache_env

    def engine(heads: int):  # type: ignore[no-untyped-def]
        for name in list(os.environ):
            if name.startswith(("LMCACHE_", "KVSTORE_")) and name != "KVSTORE_HOME":
                monkeypatch.delenv(name)
        for k, v in lmcache_env("plugin", False, [f"file://{tmp_path}/shared?fsync=false"]).items():
            monkeypatch.setenv(k, v)
        return build_cpu_engine(
            model_name="shared-alias", num_layers=LAYERS, num_kv_heads=heads, head_dim=HEAD_DIM, dtype=torch.bfloat16
        )

    a = engine(HEADS)
    tokens = torch.arange(2 * CHUNK)
    _store(a, tokens, random_kv(len(tokens), seed=6))
    a.close()
    b = engine(HEADS * 2)
    try:
        backend = b.kvstore_backend()
        keys = [k for _, _, k in b.engine.token_database.process_tokens(tokens)]
        got = backend.batched_get_blocking(keys)
        assert got == [None, None]
        assert backend.runtime.counters.get_hits == 0
        assert cpu_bytes_in_use(b) == 0
    finally:
        b.close()


@pytest.mark.parametrize(("path", "asyncm"), [("plugin", False), ("plugin", True), ("remote", False)], ids=IDS[:3])
def test_a_read_finishing_as_its_deadline_fires_gives_its_memory_back(make_engine, path, asyncm):
    """A read whose last step runs on the store's loop as kvstore's deadline fires: the
    load is a miss, and the MemoryObjs the read allocated go back to LMCache's
    allocator (none is left for the garbage collector), counted as misses."""
    import time

    eng = make_engine(path, asyncm, extra={"kvstore.timeout_s": 0.5})
    tokens = torch.arange(4 * CHUNK)
    _store(eng, tokens, random_kv(len(tokens), seed=7))
    backend = eng.kvstore_backend()
    store = backend.runtime.store
    real = store.get_many

    async def slow_tail(names, out=None):  # type: ignore[no-untyped-def]
        got = await real(names, out)
        time.sleep(0.8)  # a last synchronous step on the store's loop, past the deadline
        return got

    store.get_many = slow_tail
    _, got = eng.lookup_then_load(tokens, empty(len(tokens)))
    assert got == 0
    deadline = time.monotonic() + 5
    while cpu_bytes_in_use(eng) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cpu_bytes_in_use(eng) == 0
    c = backend.runtime.counters
    assert c.timeouts >= 1 and c.get_hits == 0


@pytest.mark.parametrize("asyncm", [False, True], ids=["blocking", "non-blocking"])
def test_a_read_waiting_for_a_slow_write_of_its_chunks_keeps_one_deadline(make_engine, asyncm):
    """A read of chunks this process is still writing waits for those writes and reads
    within one ``kvstore.timeout_s`` in all (the engine thread is not held twice as long)."""
    import asyncio
    import time

    eng = make_engine("plugin", asyncm, extra={"kvstore.timeout_s": 1.0})
    backend = eng.kvstore_backend()
    store = backend.runtime.store
    real_put, real_get = store.put_many, store.get_many

    async def slow_put(*a, **k):  # type: ignore[no-untyped-def]
        await asyncio.sleep(4)
        return await real_put(*a, **k)

    async def slow_get(*a, **k):  # type: ignore[no-untyped-def]
        await asyncio.sleep(4)
        return await real_get(*a, **k)

    store.put_many, store.get_many = slow_put, slow_get
    tokens = torch.arange(4 * CHUNK)
    eng.engine.store(tokens, kvcaches=random_kv(len(tokens)))
    keys = [k for _, _, k in eng.engine.token_database.process_tokens(tokens)]
    started = time.monotonic()
    if asyncm:
        read = backend.batched_get_non_blocking("req", keys)
        got = asyncio.run_coroutine_threadsafe(read, eng.engine.storage_manager.loop).result(20)
        assert got == []
    else:
        assert backend.batched_get_blocking(keys) == [None] * len(keys)
    assert time.monotonic() - started < 1.6  # one deadline (the code before took two: 2.0 s)
    assert backend.runtime.counters.timeouts == 1
    store.put_many, store.get_many = real_put, real_get
    assert eng.wait_for_writes(20)


CLOSE_WITH_A_WRITE_UNDER_WAY = """
import asyncio, os, sys
import torch
from tests.lmcache.helpers import CHUNK, HEAD_DIM, HEADS, LAYERS, lmcache_env, random_kv
from kvstore.demo.cpu_engine import build_cpu_engine
os.environ.update(lmcache_env(sys.argv[1], sys.argv[2] == "async", [f"file://{sys.argv[3]}?fsync=false"]))
eng = build_cpu_engine(model_name="tiny-test", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       dtype=torch.bfloat16)
import threading
store = eng.kvstore_backend().runtime.store
real = store.put_many
began = threading.Event()
async def slow(*a, **k):
    began.set()
    await asyncio.sleep(1.0)  # the write reads LMCache's MemoryObjs after this
    return await real(*a, **k)
store.put_many = slow
eng.engine.store(torch.arange(4 * CHUNK), kvcaches=random_kv(4 * CHUNK))
assert began.wait(30), "the write never reached kvstore"  # (a remote connector's puts queue on LMCache's loop)
eng.close()  # LMCache closes its CPU backend (and frees its memory) before kvstore
print("closed", flush=True)
"""


@pytest.mark.parametrize(("path", "asyncm"), [("plugin", False), ("remote", True)], ids=["plugin-sync", "remote-async"])
def test_closing_the_engine_with_a_write_under_way_lets_it_end_first(path, asyncm, tmp_path):
    """LMCache closes its CPU backend, whose allocator holds the MemoryObjs, before
    kvstore: kvstore's writes under way end first (the process does not crash reading
    freed memory), and the chunks they wrote are stored."""
    import subprocess
    import sys

    from kvstore.backends.disk import DiskBackend

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", CLOSE_WITH_A_WRITE_UNDER_WAY, path, "async" if asyncm else "sync", str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]

    async def stored() -> int:
        b = DiskBackend(tmp_path, fsync=False)
        n = len([i async for i in b.list("")])
        await b.close()
        return n

    import asyncio

    assert asyncio.run(stored()) == 4


def test_a_chunk_of_several_kv_groups_is_not_promised_in_process(make_engine):
    """A hybrid model's chunk (several KV groups) cannot be read back in-process yet: it
    is not stored (a counted failed write), so no lookup promises a chunk every load of
    which would miss."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    eng = make_engine("plugin", False)
    backend = eng.kvstore_backend()
    cpu = eng.engine.storage_manager.storage_backends["LocalCPUBackend"]
    shapes = [torch.Size([2, 2, CHUNK, 16]), torch.Size([2, 1, CHUNK, 8])]
    obj = cpu.allocate(shapes, [torch.bfloat16, torch.bfloat16], MemoryFormat.KV_2LTD)
    assert obj is not None
    key = CacheEngineKey("tiny-test", 1, 0, 12345, torch.bfloat16)
    backend.batched_submit_put_task([key], [obj])
    obj.ref_count_down()
    assert backend.wait_for_writes(10)
    assert backend.batched_contains([key]) == 0
    assert backend.runtime.counters.put_failed == 1
    assert cpu_bytes_in_use(eng) == 0


def test_blocking_reads_from_a_disk_tier_are_read_off_the_stores_loop(make_engine, tmp_path, monkeypatch):
    """The storage plugin's blocking retrieve of chunks on a disk tier reads them on the
    store's worker threads while LMCache's thread waits (no hop to the store's loop),
    each straight into the allocation LMCache's allocator made, through a `ByteTarget`
    over its memory (no tensor view per chunk): bytes equal, and a corrupt chunk is
    handed to the loop's read, which quarantines it (the hit stops before it)."""
    from kvstore.tier_stream import ByteTarget, StreamTargets

    placed: list[type] = []
    real = StreamTargets._place

    def spy(self, k, header):
        view = real(self, k, header)
        placed.append(type(self.targets[k]))
        return view

    monkeypatch.setattr(StreamTargets, "_place", spy)
    eng = make_engine("plugin", False, tiers=[f"file://{tmp_path}/disk?fsync=false"])
    tokens = torch.arange(4 * CHUNK)
    kv = random_kv(len(tokens), seed=11)
    _store(eng, tokens, kv)
    out = empty(len(tokens))
    assert eng.lookup_then_load(tokens, out) == (len(tokens), len(tokens))
    assert _same_prefix(kv, out, len(tokens))
    c = eng.kvstore_backend().runtime.counters
    assert c.reads_off_loop >= 1
    assert placed.count(ByteTarget) == 4, placed
    assert cpu_bytes_in_use(eng) == 0
    names = _names(eng, tokens)
    disk = eng.kvstore_backend().runtime.store.tiers[0].backend
    path = disk.path_of(names[2])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x04
    path.write_bytes(bytes(raw))
    import time

    time.sleep(0.1)  # (a read quarantines only a file older than its start)
    out = empty(len(tokens))
    _, got = eng.lookup_then_load(tokens, out)
    assert got == 2 * CHUNK, "the chunks before the corrupt one load"
    assert _same_prefix(kv, out, 2 * CHUNK)
    assert any((tmp_path / "disk" / "quarantine").iterdir())
    assert cpu_bytes_in_use(eng) == 0


def test_a_blocking_read_off_the_loop_past_its_deadline_is_a_miss_and_gives_its_memory_back(make_engine, tmp_path):
    import time

    from kvstore.backends.base import ReadsNow

    eng = make_engine("plugin", False, tiers=[f"file://{tmp_path}/disk?fsync=false"], extra={"kvstore.timeout_s": 0.5})
    tokens = torch.arange(2 * CHUNK)
    _store(eng, tokens, random_kv(len(tokens), seed=12))
    backend = eng.kvstore_backend()
    disk = backend.runtime.store.tiers[0].backend
    real = disk.reader_now()

    def slow(name, sink):  # type: ignore[no-untyped-def]
        time.sleep(0.8)
        return real.step(name, sink)

    disk.reader_now = lambda: ReadsNow(slow, real.concurrency)
    keys = [k for _, _, k in eng.engine.token_database.process_tokens(tokens)]
    started = time.monotonic()
    assert backend.batched_get_blocking(keys) == [None, None]
    assert time.monotonic() - started < 0.75
    assert backend.runtime.counters.timeouts == 1
    deadline = time.monotonic() + 5
    while cpu_bytes_in_use(eng) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cpu_bytes_in_use(eng) == 0, "what the read allocated went back once it ended"
