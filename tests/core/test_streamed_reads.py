"""Disk reads that land straight in the caller's tensor: verified before they are handed
back, sized from the index in one hop, and falling back to whole reads when they must."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from kvstore.backends.disk import DiskBackend
from kvstore.frame_sink import FrameSink
from kvstore.tiered import TieredStore

NAME = "ns/m/f-1-0/1"


def _store(tmp_path: Path) -> TieredStore:
    return TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"])


async def test_streamed_read_lands_in_out_bytes_equal(tmp_path: Path) -> None:
    st = _store(tmp_path)
    t = torch.randn(64, 1024).to(torch.bfloat16)  # 128 KiB: less than one stream block
    big = torch.randn(1024, 1024)  # 4 MiB: many blocks
    assert await st.put_many([(NAME, t), ("ns/m/f-1-0/2", big)]) == [True, True]
    outs = [torch.zeros_like(t), torch.zeros_like(big)]
    got = await st.get_many([NAME, "ns/m/f-1-0/2"], out=outs)
    assert got[0] is outs[0] and torch.equal(outs[0], t)
    assert got[1] is outs[1] and torch.equal(outs[1], big)
    assert st.pool.pooled_bytes == 0, "streamed: no intermediate buffer was used"
    await st.close()


async def test_a_flipped_payload_bit_is_a_quarantined_miss(tmp_path: Path) -> None:
    st = _store(tmp_path)
    t = torch.arange(1 << 18, dtype=torch.float32)
    await st.put_many([(NAME, t)])
    backend: DiskBackend = st.tiers[0].backend  # type: ignore[assignment]
    path = backend.path_of(NAME)
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x40
    path.write_bytes(bytes(data))
    # (a read quarantines only a file older than its start, by a margin for the kernel's
    # coarse clock; bit rot leaves a file's change time as it was, this write does not)
    await asyncio.sleep(0.1)
    handed: list[torch.Tensor] = []

    def alloc(header):
        handed.append(torch.empty(header.shape, dtype=torch.float32))
        return handed[-1]

    assert await st.get_many([NAME], out=[alloc]) == [None], "unverified bytes are never handed back"
    assert st.tiers[0].counters.corrupt == 1
    assert any((tmp_path / "d" / "quarantine").iterdir())
    assert await st.contains_many([NAME]) == [False]
    await st.close()


async def test_long_headers_are_read_whole(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path / "d", fsync=False)
    from kvstore.frame import encode_frame

    payload = os.urandom(10_000)
    parts = encode_frame([payload], codec="raw", shape=(10_000,), key=NAME, meta={"pad": "x" * 8000})
    assert await be.put_many([(NAME, parts)]) == [True]
    dst = bytearray(10_000)
    sink = FrameSink(NAME, lambda header: memoryview(dst))
    (verdict,) = await be.read_streamed([NAME], lambda _name: sink)
    assert verdict is sink and sink.too_long and not sink.placed, "the caller reads it whole instead"

    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}"], discover=True)
    out = torch.empty(10_000, dtype=torch.uint8)
    (got,) = await st.get_many([NAME], out=[out])
    assert got is out and bytes(out.numpy()) == payload
    await st.close()


async def test_known_size_reads_in_one_hop_and_a_rewritten_file_still_reads(tmp_path: Path) -> None:
    be = DiskBackend(tmp_path / "d", fsync=False)
    await be.put_many([(NAME, b"a" * 100)])
    other = DiskBackend(tmp_path / "d", fsync=False)  # another process rewrites it, longer
    await other.put_many([(NAME, b"b" * 300)])
    sizes: list[int] = []

    def alloc(n: int) -> memoryview:
        sizes.append(n)
        return memoryview(bytearray(n))

    (got,) = await be.get_many([NAME], alloc)
    assert bytes(got) == b"b" * 300
    assert sizes == [100, 300], "sized from the index first, then from the file"


async def test_a_cancelled_read_returns_only_after_the_writes_into_out_end(tmp_path: Path) -> None:
    st = _store(tmp_path)
    names = [f"ns/m/f-1-0/{i}" for i in range(12)]
    await st.put_many([(n, torch.randint(1, 1 << 30, (1024, 1024), dtype=torch.int32)) for n in names])
    backend: DiskBackend = st.tiers[0].backend  # type: ignore[assignment]
    outs = [torch.zeros(1024, 1024, dtype=torch.int32) for _ in names]  # bits, not floats: NaN != NaN
    reader: asyncio.Future = asyncio.ensure_future(st.get_many(names, out=outs))
    while not backend._reading:  # the reads have reached the worker threads
        await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    seen = [o.clone() for o in outs]
    await asyncio.sleep(0.3)
    assert all(torch.equal(o, s) for o, s in zip(outs, seen)), "a worker thread wrote into `out` after cancel"
    assert any(not o.any() for o in outs), "the objects not begun when it was cancelled are not read"
    await st.close()


@pytest.mark.parametrize("key", ["", "ns/m/f-1-0/other"])
async def test_a_keyless_or_misplaced_frame_is_a_miss_on_the_streamed_path(tmp_path: Path, key: str) -> None:
    from kvstore import codec as codecs

    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"], discover=True)
    t = torch.randn(256, 1024)
    parts = codecs.get("raw").frame_parts(t, key=key)
    assert await st.tiers[0].backend.put_many([(NAME, parts)]) == [True]
    out = torch.zeros_like(t)
    assert await st.get_many([NAME], out=[out]) == [None]
    assert not out.any(), "nothing of the other key's tensor reaches the caller"
    await st.close()


async def test_a_frame_whose_payload_is_shorter_than_its_shape_is_a_miss(tmp_path: Path) -> None:
    """A raw frame whose checksum and key hold but whose payload is shorter than its
    shape would fill only the head of the caller's tensor, its tail keeping whatever a
    reused buffer held: refused on the streamed path as on the whole one."""
    from kvstore.frame import encode_frame

    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"], discover=True)
    t = torch.randn(256, 1024)
    short = memoryview(t[:128].contiguous().numpy()).cast("B")
    parts = encode_frame([short], codec="raw", dtype="float32", shape=tuple(t.shape), layout="KV_2LTD", key=NAME)
    assert await st.tiers[0].backend.put_many([(NAME, parts)]) == [True]
    out = torch.full_like(t, 7.0)  # a reused buffer's old bytes
    assert await st.get_many([NAME], out=[out]) == [None]
    await st.close()


async def test_a_frame_naming_its_codec_with_options_is_not_decoded(tmp_path: Path) -> None:
    """Frames name their codec bare; a stored frame naming options (a profile path to
    open, a thread count) does not get to choose how the reader builds its codec: a
    miss, the codec never built, nothing raised into the caller."""
    from kvstore.frame import encode_frame
    from kvstore.tier import codec_for

    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false"], discover=True)
    spec = f"cachegen?profile={tmp_path / 'nowhere.json'}&threads=64"
    parts = encode_frame([b"\x00" * 64], codec=spec, dtype="float32", shape=(16,), layout="KV_2LTD", key=NAME)
    assert await st.tiers[0].backend.put_many([(NAME, parts)]) == [True]
    assert await st.get_many([NAME]) == [None]
    with pytest.raises(Exception, match="not one of"):
        codec_for(spec)
    await st.close()


@pytest.mark.parametrize("mmap", ["true", "false"])
async def test_mapped_and_pread_reads_hand_back_the_same_bytes(
    tmp_path: Path, mmap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk tier copies payloads through a mapping of the file by default and with
    pread under ``mmap=false``: the same bytes, the same checks (a flipped bit is a miss)."""
    import kvstore.frame_sink
    from kvstore import checksum

    mapped: list[bool] = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        got = checksum.mapped_crc32c(*args, **kwargs)
        mapped.append(got is not None)
        return got

    monkeypatch.setattr(kvstore.frame_sink, "mapped_crc32c", spy)
    st = TieredStore.from_urls([f"file://{tmp_path / 'd'}?fsync=false&mmap={mmap}"])
    backend: DiskBackend = st.tiers[0].backend  # type: ignore[assignment]
    assert backend.mmap is (mmap == "true")
    chunks = {f"ns/m/f-1-0/{i}": torch.randn(256, 1024 + i).to(torch.bfloat16) for i in range(6)}
    await st.put_many(list(chunks.items()))
    outs = [torch.empty_like(t) for t in chunks.values()]
    got = await st.get_many(list(chunks), out=outs)
    assert all(g is o and torch.equal(o, t) for g, o, t in zip(got, outs, chunks.values()))
    if mmap == "false":
        assert mapped == [], "mmap=false never maps"
    elif checksum.fast():
        assert mapped == [True] * len(chunks), "warm objects are copied through the mapping"
    path = backend.path_of("ns/m/f-1-0/3")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    outs = [torch.empty_like(t) for t in chunks.values()]
    got = await st.get_many(list(chunks), out=outs)
    assert [g is None for g in got] == [False, False, False, True, False, False]
    assert st.tiers[0].counters.corrupt == 1
    await st.close()


def test_the_mmap_option_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mmap"):
        DiskBackend.from_url(f"file://{tmp_path}?mmap=perhaps")


async def test_a_fault_in_one_sink_spoils_no_other_read_of_the_batch(tmp_path: Path) -> None:
    """Reads are grouped into worker jobs; a reader's sink that raises for one object
    does not stop the others in its job: they are read and counted, then the fault is
    raised, and no name is left marked as being read."""
    be = DiskBackend(tmp_path / "d", fsync=False, concurrency=1)  # one job: every read shares it
    names = [f"ns/m/f-1-0/{i}" for i in range(4)]
    tensors = [torch.full((4096,), float(i)) for i in range(4)]
    from kvstore import codec

    raw = codec.get("raw")
    await be.put_many([(n, raw.frame_parts(t, key=n, layout="raw")) for n, t in zip(names, tensors)])
    outs = [torch.empty(4096) for _ in names]

    def sink(name: str) -> FrameSink:
        k = names.index(name)

        def place(header):  # type: ignore[no-untyped-def]
            if k == 1:
                raise RuntimeError("reader bug")
            return outs[k].view(torch.uint8).numpy().data

        return FrameSink(name, place)

    with pytest.raises(RuntimeError, match="reader bug"):
        await be.read_streamed(names, sink)
    assert [torch.equal(outs[k], tensors[k]) for k in (0, 2, 3)] == [True, True, True]
    assert be.counters.hits == 3 and be.counters.misses == 1
    assert be._reading == {}
    await be.close()
