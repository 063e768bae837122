from __future__ import annotations

import pytest
import torch

from kvstore.backends import open_backend
from kvstore.backends.memory import MemoryBackend
from kvstore.buffers import BufferPool
from kvstore.tier import GONE, HIT, Tier


async def test_memory_round_trip_and_zero_copy() -> None:
    be = open_backend("mem://")
    data = bytearray(b"abc" * 1000)
    assert await be.put_many([("a/1", data), ("a/2", [b"x", b"y"])]) == [True, True]
    data[0] = ord("Z")  # the store owns its copy
    v1, v2, miss = await be.get_many(["a/1", "a/2", "a/3"])
    assert bytes(v1) == b"abc" * 1000 and bytes(v2) == b"xy" and miss is None
    v1b = await be.get("a/1")
    assert v1b.obj is v1.obj  # zero-copy: both views share the stored object
    assert v1.readonly


async def test_memory_budget_and_lru() -> None:
    be = MemoryBackend("mem://", capacity=3000)
    for i in range(3):
        await be.put(f"a/{i}", b"x" * 1000)
    await be.get("a/0")
    await be.put("a/3", b"x" * 1000)
    assert await be.contains_many([f"a/{i}" for i in range(4)]) == [True, False, True, True]
    assert be.stats().bytes == 3000 and be.counters.evictions == 1
    assert await be.put("a/big", b"x" * 4000) is False


async def test_named_memory_stores_are_shared() -> None:
    a = open_backend("mem://shared-test")
    b = open_backend("mem://shared-test")
    await a.put("x/y", b"1")
    assert bytes(await b.get("x/y")) == b"1"
    await a.delete_many(["x/y"])


@pytest.mark.parametrize("url", ["mem://", "file://{tmp}"])
async def test_tier_tensor_round_trip_and_out(url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    tier = Tier.open(url.format(tmp=tmp_path))
    t = torch.randn(2, 4, 16, 192, dtype=torch.bfloat16)
    assert await tier.put_many([("ns/t", t)], layout="KV_2LTD") == [True]
    (back,) = await tier.get_many(["ns/t"])
    assert torch.equal(back, t)
    out = torch.empty_like(t)
    (same,) = await tier.get_many(["ns/t"], out=[out])
    assert same is out and torch.equal(out, t)
    frames = await tier.get_frames(["ns/t"])
    assert frames[0].header.layout == "KV_2LTD" and frames[0].header.key == "ns/t"


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
async def test_a_tensor_read_from_memory_without_out_is_the_callers_to_change() -> None:
    """A read without `out` from a tier in memory hands back a tensor the caller may
    write to: the stored object stays as it was stored."""
    from kvstore.tiered import TieredStore

    st = TieredStore.from_urls(["mem://"])
    t = torch.arange(1 << 16, dtype=torch.float32)
    assert await st.put_many([("a/m/f-1-0/x", t)]) == [True]
    (got,) = await st.get_many(["a/m/f-1-0/x"])
    assert got is not None and torch.equal(got, t)
    got.mul_(3)
    (again,) = await st.get_many(["a/m/f-1-0/x"])
    assert again is not None and torch.equal(again, t)
    assert st.tiers[0].counters.corrupt == 0
    await st.close()


async def test_tier_refuses_a_frame_stored_under_another_name() -> None:
    tier = Tier.open("mem://")
    await tier.put_many([("ns/a", torch.ones(3))])
    (raw,) = await tier.backend.get_many(["ns/a"])
    await tier.backend.put("ns/b", raw)  # a mis-filed object
    assert await tier.get_many(["ns/b"]) == [None]
    assert tier.counters.corrupt == 1
    assert await tier.contains_many(["ns/b", "ns/a"]) == [False, True]  # quarantined, the owner kept


async def test_tier_refuses_a_frame_without_a_key() -> None:
    from kvstore.frame import MisplacedFrameError, decode_frame, encode_frame

    tier = Tier.open("mem://")
    await tier.backend.put("ns/k", encode_frame([b"\x00" * 16], codec="raw", dtype="uint8", shape=(16,)))
    assert await tier.get_many(["ns/k"]) == [None]
    assert tier.counters.corrupt == 1
    assert await tier.get_frames(["ns/k"]) == [None]
    with pytest.raises(MisplacedFrameError):
        decode_frame(encode_frame([b"x"], codec="raw")[0].tobytes() + b"x", key="ns/k")


async def test_frame_of_an_unknown_codec_is_a_miss_left_in_place() -> None:
    from kvstore.frame import encode_frame

    tier = Tier.open("mem://")
    parts = encode_frame([b"\x00" * 16], codec="zstd-from-the-future", dtype="uint8", shape=(16,), key="ns/f")
    await tier.backend.put("ns/f", parts)
    assert await tier.get_many(["ns/f"]) == [None]
    assert tier.counters.undecodable == 1 and tier.counters.corrupt == 0
    assert await tier.contains_many(["ns/f"]) == [True]  # not quarantined: a newer kvstore can read it


@pytest.mark.parametrize("codec", ["raw", "cachegen"])
async def test_a_header_claiming_a_huge_shape_is_a_quarantined_miss(codec: str) -> None:
    from kvstore.frame import encode_frame

    tier = Tier.open("mem://")
    name = f"ns/claims-{codec}"
    huge = (1 << 20, 1 << 20, 8)  # 16 TiB of bfloat16 claimed by a 64-byte payload
    parts = encode_frame(
        [b"\x00" * 64], codec=codec, dtype="bfloat16", shape=huge, layout="KV_2LTD", key=name
    )
    await tier.backend.put(name, parts)
    assert await tier.get_many([name, "ns/absent"]) == [None, None]
    assert tier.counters.corrupt == 1 and await tier.contains_many([name]) == [False]


async def test_a_large_batch_from_memory_is_copied_on_worker_jobs_bytes_equal(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    from kvstore import tier_stream
    from kvstore.backends import stream

    monkeypatch.setattr(tier_stream, "_CPUS", 2)
    copiers: list[str] = []
    real = stream.stream_from_buffer

    def spy(raw, sink):  # type: ignore[no-untyped-def]
        copiers.append(threading.current_thread().name)
        return real(raw, sink)

    monkeypatch.setattr(stream, "stream_from_buffer", spy)
    tier = Tier.open("mem://")
    ts = [torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 20,), dtype=torch.int32) for _ in range(5)]  # 4 MiB each
    names = [f"ns/big/{i}" for i in range(5)]
    assert await tier.put_many(list(zip(names, ts))) == [True] * 5
    outs = [torch.zeros_like(t) for t in ts]
    res = await tier.read_into([*names, "ns/big/none"], [*outs, torch.zeros(1)], BufferPool(0))
    assert [r.status for r in res] == [HIT] * 5 + [GONE]
    assert all(r.tensor is o and torch.equal(o, t) for r, o, t in zip(res, outs, ts))
    loop_thread = threading.current_thread().name
    assert len(copiers) == 5 and loop_thread not in copiers and len(set(copiers)) <= 2  # two worker jobs
    copiers.clear()
    small = await tier.read_into(names[:1], [torch.zeros_like(ts[0])], BufferPool(0))  # under 8 MiB: on the loop
    assert small[0].status == HIT and copiers == [loop_thread]
