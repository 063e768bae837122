"""The ``kvstore_cachegen`` serde of LMCache's MP server (plugins/mp_serde.py).

Round trips of real-shaped bf16 KV within the codec's error, the stored object being the
cold tier's frame plus zero padding, damaged objects refused, the slot bound, and
LMCache's own storage manager + fs adapter + serde wrapper storing and loading through
it across a restart (and a real server process that loads it both supported ways).
"""

from __future__ import annotations

import argparse
import json
import select
import time
from pathlib import Path

import pytest
import torch
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from kvstore import codec as codecs
from kvstore.backends import open_backend
from kvstore.frame import (
    BadMagicError,
    ChecksumMismatchError,
    CorruptHeaderError,
    FrameError,
    LengthMismatchError,
    MisplacedFrameError,
    decode_frame,
)
from kvstore.keys import ChunkKey
from kvstore.lmcache_mp import MPClient, MPServer, MPServerError, fs_l2_adapter, plugin_l2_adapter
from kvstore.tier import Tier
from kvstore_lmcache.keymap import mp_object_key, mp_object_name
from kvstore_lmcache.mp_serde import (
    SERDE_TYPE,
    CacheGenFrameSerde,
    SerdeOptions,
    SlotOverflowError,
    frame_view,
    main,
    verify_fs,
)

LAYOUT = "lmcache:KV_2LTD"
REPO = Path(__file__).resolve().parents[2]


def kv_like(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """KV-like values: per-channel magnitudes spread over an order of magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * (
        0.2 + 3 * torch.rand(shape[0], shape[1], 1, shape[-1], generator=g)
    )
    return x.to(dtype)


def memobj(tensor: torch.Tensor, fmt: MemoryFormat = MemoryFormat.KV_2LTD) -> TensorMemoryObj:
    """A MemoryObj over `tensor`'s memory, shaped like the MP server's L1 objects."""
    t = tensor.contiguous()
    raw = t.view(-1).view(torch.uint8)
    meta = MemoryObjMetadata(
        shape=t.shape,
        dtype=t.dtype,
        address=raw.data_ptr(),
        phy_size=raw.numel(),
        ref_count=1,
        fmt=fmt,
        shapes=[t.shape],
        dtypes=[t.dtype],
    )
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def slot_obj(nbytes: int, fill: int = 0xAB) -> TensorMemoryObj:
    return memobj(torch.full((nbytes,), fill, dtype=torch.uint8), MemoryFormat.BINARY_BUFFER)


def okey(i: int = 1, model: str = "HuggingFaceTB/SmolLM2-135M", salt: str = "") -> ObjectKey:
    return ObjectKey(
        chunk_hash=bytes([i]) * 32, model_name=model, kv_rank=(1 << 24) | (1 << 8), cache_salt=salt
    )


def error_ok(x: torch.Tensor, y: torch.Tensor, serde: CacheGenFrameSerde) -> None:
    """The codec's documented error: half a quantization step of each token's absmax
    (bins per layer from the profile) plus the output dtype's rounding."""
    prof = serde.codec.profile_for(x.shape[1])
    xf, yf = x.float(), y.float()
    for p in range(x.shape[0]):
        for layer in range(x.shape[1]):
            mx = (prof.key_bins if p == 0 else prof.value_bins)[layer] // 2 - 1
            m = xf[p, layer].abs().amax(-1, keepdim=True)
            bound = m / (2 * mx) * 1.01 + m * 2**-7 + 1e-30
            assert ((yf[p, layer] - xf[p, layer]).abs() <= bound).all()


def store(serde: CacheGenFrameSerde, x: torch.Tensor, key: ObjectKey) -> torch.Tensor:
    """What the serde hands LMCache's adapter for `x`: the whole slot."""
    dst = slot_obj(serde.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype])))
    n = serde.serialize(memobj(x), dst, key)
    assert n == dst.get_size()
    return dst.tensor.clone()


def load(serde: CacheGenFrameSerde, blob: torch.Tensor, key: ObjectKey, like: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(like, 7.0)
    serde.deserialize(memobj(blob), memobj(out), key)
    return out


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("spec", "shape"),
    [
        ("cachegen", (2, 30, 256, 192)),  # SmolLM2-135M: 30 layers, 3 KV heads x 64, 256-token chunk
        ("cachegen?profile=smollm2-135m", (2, 30, 256, 192)),
        ("cachegen", (2, 4, 256, 1024)),  # 8 KV heads x 128
    ],
)
def test_bf16_round_trip_within_codec_error_and_equal_to_the_codec(spec, shape):
    serde = CacheGenFrameSerde(SerdeOptions.from_kwargs({"codec": spec}))
    x = kv_like(shape)
    blob = store(serde, x, okey())
    y = load(serde, blob, okey(), x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    error_ok(x, y, serde)
    # Exactly what kvstore's own decoder makes of the frame inside the slot.
    assert torch.equal(y, codecs.get("cachegen").decode(frame_view(blob.numpy())))
    raw = x.numel() * x.element_size()
    assert len(blob) * 1.8 < raw, f"slot {len(blob)} for {raw} raw bytes"


def test_mla_objects_round_trip():
    serde = CacheGenFrameSerde()
    x = kv_like((1, 6, 64, 96))[0]  # MLA chunk: [layers, tokens, dim]
    y = load(serde, store(serde, x, okey()), okey(), x)
    error_ok(x.unsqueeze(0), y.unsqueeze(0), serde)


# ---------------------------------------------------------------- same bytes as the cold tier


async def test_object_is_the_cold_tier_frame_plus_zero_padding(tmp_path, monkeypatch):
    import kvstore.frame

    monkeypatch.setattr(kvstore.frame.time, "time", lambda: 1.7e9)  # frames carry ctime
    spec = "cachegen?profile=smollm2-135m"
    serde = CacheGenFrameSerde(SerdeOptions.from_kwargs({"codec": spec, "namespace": "prod"}))
    x = kv_like((2, 30, 256, 192), seed=3)
    key = okey(5, salt="tenant-a")
    name = mp_object_name(key, "prod")
    blob = store(serde, x, key).numpy()

    async with Tier(open_backend(f"file://{tmp_path}/cold"), codec=spec) as tier:
        assert await tier.put_many([(name, x)], layout=LAYOUT) == [True]
        (cold,) = await tier.backend.get_many([name])
        frame = frame_view(blob)
        assert cold is not None and bytes(frame) == bytes(cold)
        assert not blob[len(frame) :].any()  # zero padding, never stale L1 bytes
        # kvstore's frame reader and trust rules accept it under the chunk's own name.
        header = decode_frame(frame, key=name).header
        assert (header.codec, header.layout, header.dtype) == ("cachegen", LAYOUT, "bfloat16")
        # And the serde reads what the cold tier wrote, once padded into a slot.
        padded = torch.zeros(len(blob), dtype=torch.uint8)
        padded[: cold.nbytes] = torch.frombuffer(bytearray(cold), dtype=torch.uint8)
        (back,) = await tier.get_many([name])
    assert torch.equal(load(serde, padded, key, x), back)


# ---------------------------------------------------------------- damage is an error, never data


def test_damaged_truncated_and_misplaced_objects_raise_and_leave_the_buffer_alone():
    serde = CacheGenFrameSerde()
    x = kv_like((2, 4, 256, 128))
    blob = store(serde, x, okey())
    flen = len(frame_view(blob.numpy()))

    def refused(
        b: torch.Tensor, exc: type[Exception], key: ObjectKey | None = None, like: torch.Tensor = x
    ) -> None:
        key = key or okey()
        out = torch.full_like(like, 7.0)
        with pytest.raises(exc):
            serde.deserialize(memobj(b), memobj(out), key)
        assert (out == 7.0).all()

    flipped = blob.clone()
    flipped[flen - 100] ^= 0x10
    refused(flipped, ChecksumMismatchError)
    flipped = blob.clone()
    flipped[40] ^= 0x01
    refused(flipped, CorruptHeaderError)
    refused(torch.zeros_like(blob), BadMagicError)
    truncated = torch.zeros_like(blob)
    truncated[: flen // 2] = blob[: flen // 2]  # a torn write, zero-filled to the slot
    refused(truncated, ChecksumMismatchError)
    refused(blob[: flen - 1].clone(), LengthMismatchError)  # a short object
    refused(blob, MisplacedFrameError, key=okey(2))  # another chunk's object
    refused(blob, MisplacedFrameError, key=okey(1, salt="other-tenant"))
    refused(blob, FrameError, like=x.to(torch.float16))  # same key, another KV layout
    refused(blob, FrameError, like=kv_like((2, 4, 128, 128)))


def test_a_failed_deserialize_is_a_failed_task_in_lmcache_processor():
    proc = create_serde_processor(SerdeConfig(SERDE_TYPE, {}))
    try:
        x = kv_like((2, 2, 64, 64))
        serde = CacheGenFrameSerde()
        good, bad = store(serde, x, okey()), store(serde, x, okey())
        bad[-1 - (len(bad) - len(frame_view(bad.numpy())))] ^= 0xFF  # last payload byte
        outs = [torch.zeros_like(x), torch.zeros_like(x)]
        results = {}
        for name, blob, out in (("good", good, outs[0]), ("bad", bad, outs[1])):
            tid = proc.submit_deserialize([memobj(blob)], [memobj(out)], [okey()])
            fd = proc.get_deserialize_event_fd()
            deadline = time.monotonic() + 30
            while (r := proc.query_deserialize_result(tid)) is None and time.monotonic() < deadline:
                select.select([fd], [], [], 0.5)
            results[name] = r
        assert results == {"good": True, "bad": False}
        error_ok(x, outs[0], serde)
    finally:
        proc.close()


# ---------------------------------------------------------------- slots


@pytest.mark.parametrize(
    "spec", ["cachegen", "cachegen?profile=smollm2-135m", "cachegen?profile=smollm2-135m-hq"]
)
def test_default_slot_holds_adversarial_kv(spec):
    """Symbols spread evenly over the alphabet, and symbols every table finds rare."""
    serde = CacheGenFrameSerde(SerdeOptions.from_kwargs({"codec": spec}))
    shape = (2, 30, 64, 192)
    slot = serde.slot_bytes(shape, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    uniform = (torch.rand(shape, generator=g) * 2 - 1).to(torch.bfloat16)
    signs = torch.randint(0, 2, shape, generator=g) * 2 - 1
    extremes = (signs * (0.5 + 0.5 * torch.rand(shape, generator=g))).to(torch.bfloat16)  # all far from 0
    spikes = (torch.randn(shape, generator=g) * 1e-3).to(torch.bfloat16)
    spikes[..., ::7] = 1.0  # mostly centre symbols, and a full-scale value in every 7th channel
    for x in (uniform, extremes, spikes):
        n = sum(p.nbytes for p in serde.frame_parts(memobj(x), okey()))
        assert n <= slot, (spec, n, slot)


def test_slot_ratio_trades_the_guarantee_and_overflow_is_refused():
    tight = CacheGenFrameSerde(SerdeOptions.from_kwargs({"slot_ratio": 0.05}))
    x = kv_like((2, 4, 256, 128))
    assert tight.slot_bytes(x.shape, x.dtype) == 28672  # 5% of 512 KiB, whole pages
    dst = slot_obj(tight.slot_bytes(x.shape, x.dtype))
    with pytest.raises(SlotOverflowError):
        tight.serialize(memobj(x), dst, okey())
    roomy = CacheGenFrameSerde(SerdeOptions.from_kwargs({"slot_ratio": 0.3}))
    error_ok(x, load(roomy, store(roomy, x, okey()), okey(), x), roomy)


def test_unsupported_layouts_get_a_small_estimate_and_a_failed_serialize():
    serde = CacheGenFrameSerde()
    two_groups = MemoryLayoutDesc([torch.Size([2, 2, 16, 8])] * 2, [torch.bfloat16] * 2)
    fp8ish = MemoryLayoutDesc([torch.Size([2, 2, 16, 8])], [torch.uint8])
    assert serde.estimate_serialized_size(two_groups) == serde.estimate_serialized_size(fp8ish) == 4096
    with pytest.raises(ValueError):
        serde.serialize(memobj(torch.zeros(2, 2, 16, 8, dtype=torch.uint8)), slot_obj(4096), okey())


def test_options_are_checked():
    assert SerdeOptions.from_kwargs({"codec": "cachegen?profile=smollm2-135m&threads=2"}).codec_options == (
        ("profile", "smollm2-135m"),
        ("threads", 2),
    )
    assert CacheGenFrameSerde(SerdeOptions.from_kwargs({"profile": "smollm2-135m"})).codec.profile is not None
    for bad in (
        {"codecs": "cachegen"},
        {"codec": "raw"},
        {"slot_ratio": 0},
        {"max_workers": 0},
        {"namespace": ""},
    ):
        with pytest.raises(ValueError):
            SerdeOptions.from_kwargs(bad)


# ---------------------------------------------------------------- through LMCache's own code


def _storage_manager(base: Path, adapter: dict):
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.storage_manager import StorageManager

    argv = ["--l1-size-gb", "0.1", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)]
    cfg = parse_args_to_config(add_storage_manager_args(argparse.ArgumentParser()).parse_args(argv))
    cfg.l1_manager_config.memory_config.shm_name = ""  # plain memory: nothing left in /dev/shm
    return StorageManager(cfg)


def _prefetch(sm, keys, layout):
    spec = PrefetchTaskSpec([GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
    handle = sm.submit_prefetch_task(spec)
    assert sm.wait_prefetch_status(handle, 60)
    result = sm.query_prefetch_status(handle)
    hits = result.hit_cells[0].get_indices_list()
    got = {}
    if hits:
        hit_keys = [keys[i] for i in hits]
        with sm.read_prefetched_results(hit_keys, result.l1_owners) as objs:
            assert objs is not None
            got = {k: o.tensor.clone() for k, o in zip(hit_keys, objs)}
        sm.finish_read_prefetched(hit_keys, 1, result.l1_owners)
    return got


@pytest.mark.parametrize("route", ["fs", "plugin"])
def test_lmcache_fs_adapter_stores_and_loads_through_the_serde_across_a_restart(tmp_path, route):
    """LMCache's StorageManager (store controller, SerdeL2AdapterWrapper, FSL2Adapter,
    prefetch controller), configured from the server's own ``--l2-adapter`` JSON."""
    base = tmp_path / "l2"
    base.mkdir()
    serde_spec = {"type": SERDE_TYPE, "codec": "cachegen?profile=smollm2-135m"}
    fs = {"type": "fs", "base_path": str(base)}
    if route == "fs":
        adapter = {**fs, "serde": serde_spec}
    else:
        adapter = {
            "type": "plugin",
            "module_path": "kvstore_lmcache.mp_serde",
            "class_name": "LMCacheL2Adapter",
            "adapter_params": fs,
            "serde": serde_spec,
        }
    shape = torch.Size([2, 30, 256, 192])
    layout = MemoryLayoutDesc([shape], [torch.bfloat16])
    keys = [okey(i) for i in range(3)]
    xs = {k: kv_like(shape, seed=i) for i, k in enumerate(keys)}

    sm = _storage_manager(base, adapter)
    try:
        objs = sm.reserve_write(keys, layout)
        for k in keys:
            objs[k].tensor.copy_(xs[k])
        sm.finish_write(keys)
        deadline = time.monotonic() + 60
        while len(list(base.glob("*.data"))) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        sm.close()
    files = sorted(base.glob("*.data"))
    serde = CacheGenFrameSerde(SerdeOptions.from_kwargs({"codec": serde_spec["codec"]}))
    slot = serde.slot_bytes(shape, torch.bfloat16)
    assert len(files) == 3 and {f.stat().st_size for f in files} == {slot}
    expected = {}
    for k in keys:  # every file is a kvstore frame under the chunk's kvstore name
        (f,) = [f for f in files if k.chunk_hash.hex() in f.name]
        frame = frame_view(f.read_bytes())
        assert decode_frame(frame, key=mp_object_name(k, "default")).header.codec == "cachegen"
        expected[k] = codecs.get("cachegen").decode(frame)
        error_ok(xs[k], expected[k], serde)

    sm = _storage_manager(base, adapter)  # a restart: L1 is empty, L2 has the files
    try:
        got = _prefetch(sm, keys, layout)
    finally:
        sm.close()
    assert set(got) == set(keys)
    for k in keys:
        assert torch.equal(got[k], expected[k])

    # A damaged file: never served.  LMCache fails the whole load task of a failed
    # deserialize, so the other keys of that load are misses too, never wrong data.
    (victim,) = [f for f in files if keys[1].chunk_hash.hex() in f.name]
    data = bytearray(victim.read_bytes())
    data[len(frame_view(data)) - 1] ^= 0xFF
    victim.write_bytes(bytes(data))
    sm = _storage_manager(base, adapter)
    try:
        got = _prefetch(sm, keys, layout)
    finally:
        sm.close()
    assert keys[1] not in got
    for k, t in got.items():
        assert torch.equal(t, expected[k])
    assert keys[0] not in got  # LMCache 0.5.6: the good chunk of the same load misses too

    # LMCache keeps the damaged file (its lookup still finds it): verify names it and
    # quarantine takes it out of LMCache's sight, so the chunks before it hit again.
    assert main(["verify", str(base)]) == 1
    report = verify_fs(base, quarantine=True)
    assert report["ok"] == 2 and report["quarantined"] == 1
    assert [c["file"] for c in report["corrupt"]] == [victim.name]
    assert "ChecksumMismatchError" in report["corrupt"][0]["error"]
    assert verify_fs(base) == {"ok": 2, "corrupt": [], "quarantined": 0}
    sm = _storage_manager(base, adapter)
    try:
        got = _prefetch(sm, keys, layout)
    finally:
        sm.close()
    assert list(got) == [keys[0]] and torch.equal(got[keys[0]], expected[keys[0]])


# ---------------------------------------------------------------- a real server process


class _LauncherServer(MPServer):
    """The harness's server, started through ``python -m kvstore_lmcache.mp_serde`` instead."""

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("lmcache.v1.multiprocess.server")] = "kvstore_lmcache.mp_serde"
        return cmd


def _adapter(route: str, base: Path) -> dict:
    serde = {"type": SERDE_TYPE, "codec": "cachegen?profile=smollm2-135m"}
    if route == "plugin":
        return {
            **plugin_l2_adapter("kvstore_lmcache.mp_serde", "LMCacheL2Adapter", fs_l2_adapter(base)),
            "serde": serde,
        }
    return {**fs_l2_adapter(base), "serde": serde}


@pytest.mark.slow  # two server starts per route: ~30 s each on this 2-core machine
@pytest.mark.parametrize("route", ["launcher", "plugin"])
def test_real_server_stores_frames_and_serves_them_after_a_restart(tmp_path, route):
    """``lmcache.v1.multiprocess.server`` with LMCache's fs adapter and the serde, loaded
    either supported way; an engine worker stores two SmolLM2-shaped chunks, the server
    restarts with an empty L1, and the retrieve decodes the files kvstore can read."""
    base = tmp_path / "l2"
    cls = _LauncherServer if route == "launcher" else MPServer
    server = cls([_adapter(route, base)], chunk_size=256, l1_size_gb=0.1, log_path=tmp_path / "server.log")
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 49_000, (2 * 256,), generator=g).tolist()
    kv = kv_like((2, 30, 2 * 256, 192), seed=9)
    serde = CacheGenFrameSerde(SerdeOptions.from_kwargs({"codec": "cachegen?profile=smollm2-135m"}))
    with server:
        client = MPClient(server.url, "HuggingFaceTB/SmolLM2-135M", 30, 3, 64, torch.bfloat16, 256)
        client.register()
        assert client.store(tokens, kv) == 512
        assert client.wait_stored(tokens, timeout=60), server.log_tail()
        files = sorted(base.glob("*.data"))
        assert len(files) == 2
        assert {f.stat().st_size for f in files} == {serde.slot_bytes((2, 30, 256, 192), torch.bfloat16)}
        decoded = {}
        for f in files:
            frame = frame_view(f.read_bytes())
            # The frame names its chunk: the same ObjectKey LMCache filed it under.
            okey_back = mp_object_key(ChunkKey.from_object_name(decode_frame(frame).header.key))
            assert okey_back is not None and okey_back.model_name == "HuggingFaceTB/SmolLM2-135M"
            assert okey_back.chunk_hash.hex() in f.name
            decoded[f.name] = codecs.get("cachegen").decode(frame)

        server.restart()
        client.register()
        hit, got = client.retrieve(tokens)
        client.close()
    assert hit == 512
    error_ok(kv, got, serde)
    # Chunk by chunk, exactly what kvstore's decoder makes of the stored files.
    assert any(torch.equal(got[:, :, :256], t) for t in decoded.values())
    assert any(torch.equal(got[:, :, 256:], t) for t in decoded.values())


def test_stock_server_without_the_module_rejects_the_serde_type(tmp_path):
    server = MPServer(
        [_adapter("fs", tmp_path / "l2")], l1_size_gb=0.1, log_path=tmp_path / "server.log", start_timeout=90
    )
    with pytest.raises(MPServerError):
        server.start()
    assert f"Unknown serde type {SERDE_TYPE!r}" in server.log_text()
