"""The cachegen codec: round trips, damaged payloads, LMCache parity, profiles, tiers."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from kvstore import codec as codecs
from kvstore.codec.cachegen import CacheGenCodec
from kvstore.codec.cachegen_format import CacheGenPayloadError
from kvstore.codec.cachegen_kernels import PROB_SCALE, encoder_tables
from kvstore.codec.cachegen_profile import ModelFingerprint, Profile, UnknownCodebookError
from kvstore.codec.cachegen_tables import CodebookSet, builtin_codebook
from kvstore.frame import FrameError, decode_frame, encode_frame
from tests.support.required import needs


def kv_like(shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * (0.2 + 3 * torch.rand(shape[0], shape[1], 1, shape[3], generator=g))
    return x.to(dtype)


def max_error_ok(x: torch.Tensor, y: torch.Tensor, codec: CacheGenCodec) -> None:
    """Every value within half a quantization step (+ output rounding) of the input."""
    prof = codec.profile_for(x.shape[1])
    xf, yf = x.float(), y.float()
    for p in range(x.shape[0]):
        for layer in range(x.shape[1]):
            mx = (prof.key_bins if p == 0 else prof.value_bins)[layer] // 2 - 1
            m = xf[p, layer].abs().amax(-1, keepdim=True)
            bound = m / (2 * mx) * 1.01 + m * 2**-7 + 1e-30
            assert ((yf[p, layer] - xf[p, layer]).abs() <= bound).all()


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 12, 256, 192), torch.float16),
        ((2, 3, 17, 24), torch.bfloat16),
        ((2, 2, 1, 5), torch.float32),
        ((1, 4, 33, 64), torch.float16),  # MLA layout
    ],
)
def test_round_trip_keeps_shape_dtype_and_error_bound(shape, dtype):
    c = codecs.get("cachegen", preset="lmcache")
    x = kv_like(shape, dtype)
    buf = c.encode(x)
    y = c.decode(buf)
    assert y.shape == x.shape and y.dtype == x.dtype
    max_error_ok(x, y, c)
    if shape[2] == 256:
        assert len(buf) * 4 < x.numel() * x.element_size()


def test_zero_tokens_constant_channels_and_extreme_scales():
    c = CacheGenCodec()
    x = kv_like((2, 3, 9, 16), torch.float32)
    x[:, 2, 2] = 0  # all-zero tokens
    x[0, 1, :, 3] = 7.0  # constant channel
    x[1, 0] = 0  # all-zero layer
    x[0, 2, 4] = torch.linspace(-1e-41, 1e-41, 16)  # subnormal scale: MAX/m overflows float32
    x[1, 2, 5] *= 1e30  # scale far beyond float16
    y = c.decode(c.encode(x))
    assert torch.isfinite(y).all()
    assert (y[:, 2, 2] == 0).all() and (y[1, 0] == 0).all()
    assert (y[0, 1, :, 3] == 7.0).all()
    max_error_ok(x, y, c)
    assert torch.equal(
        c.decode(c.encode(torch.zeros(2, 2, 4, 8, dtype=torch.float16))),
        torch.zeros(2, 2, 4, 8, dtype=torch.float16),
    )


def test_non_finite_input_and_bad_shapes_are_refused():
    c = CacheGenCodec()
    x = kv_like((2, 2, 4, 8))
    x[1, 1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="inf/NaN"):
        c.encode(x)
    x[1, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="inf/NaN"):
        c.encode(x)
    with pytest.raises(ValueError, match="KV_2LTD"):
        c.encode(torch.zeros(3, 2, 4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="float16"):
        c.encode(torch.zeros(2, 2, 4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="configured for 5 layers"):
        CacheGenCodec(num_layers=5).encode(torch.zeros(2, 2, 4, 8, dtype=torch.float16))


def test_two_threads_give_identical_payload_and_result():
    x = kv_like((2, 12, 64, 48))
    one, two = CacheGenCodec(threads=1), CacheGenCodec(threads=2)
    p1 = decode_frame(one.encode(x)).payload
    p2 = decode_frame(two.encode(x)).payload
    assert bytes(p1) == bytes(p2)
    assert torch.equal(one.decode(two.encode(x)), two.decode(one.encode(x)))


def reframe(payload: bytes, like: bytes) -> bytes:
    """A frame with a valid checksum around `payload`, so the codec's own checks are hit."""
    h = decode_frame(like).header
    return b"".join(encode_frame([payload], codec="cachegen", dtype=h.dtype, shape=h.shape, layout=h.layout))


def test_damaged_payloads_raise_frame_errors_never_garbage():
    c = CacheGenCodec()
    x = kv_like((2, 3, 40, 16))
    buf = c.encode(x)
    payload = bytes(decode_frame(buf).payload)
    # Bit rot anywhere in the stored object: the frame checksum.
    for pos in range(0, len(buf), max(1, len(buf) // 50)):
        bad = bytearray(buf)
        bad[pos] ^= 0x10
        with pytest.raises(FrameError):
            c.decode(bytes(bad))
    # Truncated or padded payloads that carry a valid checksum: the codec's bounds checks.
    for n in [0, 3, 20, 40, len(payload) // 2, len(payload) - 1]:
        with pytest.raises(CacheGenPayloadError):
            c.decode(reframe(payload[:n], buf))
    with pytest.raises(CacheGenPayloadError):
        c.decode(reframe(payload + b"\0", buf))
    # Mutated stream bytes or header fields: an error or a finite tensor, never a crash.
    rng = np.random.default_rng(0)
    for _ in range(200):
        bad = bytearray(payload)
        pos = int(rng.integers(0, len(bad)))
        bad[pos] = int(rng.integers(0, 256))
        try:
            y = c.decode(reframe(bytes(bad), buf))
        except FrameError:
            continue
        assert y.shape == x.shape and torch.isfinite(y).all()
    # A frame that claims a different shape than its payload.
    h = decode_frame(buf).header
    other = b"".join(encode_frame([payload], codec="cachegen", dtype=h.dtype, shape=(2, 3, 41, 16)))
    with pytest.raises(CacheGenPayloadError, match="frame says"):
        c.decode(other)


def test_encoder_reciprocals_are_exact_divisions():
    freqs = np.arange(1, PROB_SCALE + 1, dtype=np.uint32)[None, :]
    enc = encoder_tables(freqs, np.zeros_like(freqs))[0]
    rng = np.random.default_rng(1)
    xs = np.concatenate([rng.integers(1 << 15, 1 << 31, 2000), [1 << 15, (1 << 31) - 1]]).astype(np.int64)
    for f in [1, 2, 3, 5, 7, 100, 1023, 2047, 2049, 4095, 4096]:
        rcp, shift, bias, cmpl, _ = enc[f - 1]
        lim = xs[xs < (f << 19)]
        q = ((lim * rcp) >> 32) >> shift
        assert (lim + bias + q * cmpl == (lim // f) * PROB_SCALE + lim % f).all()


@needs(importlib.util.find_spec("lmcache") is not None, "lmcache", "bash scripts/setup.sh --test")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bit_identical_to_lmcache_cachegen_at_its_preset(dtype):
    from lmcache.storage_backend.serde.cachegen_basics import CacheGenConfig, QuantizationSpec
    from lmcache.storage_backend.serde.cachegen_decoder import decode_function_gpu, do_dequantize
    from lmcache.storage_backend.serde.cachegen_encoder import encode_function

    L, T, H, D = 12, 64, 3, 16
    kv = kv_like((2, L, T, H * D), dtype, seed=3)
    cfg = CacheGenConfig(
        nlayers=L,
        kspecs=[QuantizationSpec(0, 10, 32), QuantizationSpec(10, L, 16)],
        vspecs=[QuantizationSpec(0, 2, 32), QuantizationSpec(2, L, 16)],
    )
    kb, vb = torch.zeros(L), torch.zeros(L)
    for s in cfg.kspecs:
        kb[s.start_layer : s.end_layer] = s.bins
    for s in cfg.vspecs:
        vb[s.start_layer : s.end_layer] = s.bins
    out = encode_function(kv.view(2, L, T, H, D).permute(1, 0, 2, 3, 4), cfg, kb, vb, T)
    k, v = decode_function_gpu(
        out.cdf, out.data_chunks, L, T, torch.zeros((T, 2 * L * H * D), dtype=torch.uint8)
    )
    ref = torch.stack(
        [do_dequantize(k, kb, out.max_tensors_key), do_dequantize(v, vb, out.max_tensors_value)]
    ).to(dtype)

    c = codecs.get("cachegen", preset="lmcache", num_layers=L)
    ours = c.decode(c.encode(kv))
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))


def test_shipped_profile_round_trips_and_decodes_by_id(tmp_path):
    prof = Profile.load("smollm2-135m")
    c = codecs.get("cachegen", profile="smollm2-135m")
    x = kv_like((2, prof.num_layers, 40, 192))
    y = codecs.get("cachegen").decode(c.encode(x))  # a plain decoder resolves the profile's tables
    max_error_ok(x, y, c)
    with pytest.raises(ValueError, match="4 layers, the model has 30"):
        c.encode(kv_like((2, 4, 8, 192)))


def test_unknown_codebook_fails_clearly(tmp_path):
    book = builtin_codebook(15)
    prof = Profile(
        "private",
        [16] * 2,
        [16] * 2,
        CodebookSet("private-tables", {15: book}),
        model=ModelFingerprint.uniform("tiny", 2, 8),
    )
    path = tmp_path / "private.json"
    prof.save(path)
    buf = codecs.get("cachegen", profile=str(path)).encode(kv_like((2, 2, 8, 8)))
    from kvstore.codec import cachegen_profile

    cachegen_profile._SETS.clear()
    with pytest.raises(UnknownCodebookError, match="private-tables"):
        CacheGenCodec().decode(buf)
    Profile.load(path)
    assert CacheGenCodec().decode(buf).shape == (2, 2, 8, 8)
    assert json.loads(path.read_text())["codebook_id"] == "private-tables"


async def test_cold_tier_stores_cachegen_frames_and_reads_them_back():
    from kvstore.backends import open_backend
    from kvstore.tier import Tier

    x = kv_like((2, 3, 32, 16))
    async with Tier(open_backend("mem://"), codec="cachegen") as tier:
        assert await tier.put_many([("k1", x)]) == [True]
        (y,) = await tier.get_many(["k1"])
    assert y is not None and y.dtype == x.dtype
    max_error_ok(x, y, CacheGenCodec())


def test_channel_scaled_profile_rounds_scales_and_survives_float16_overflow():
    book = builtin_codebook(15)
    cs = np.full((2, 2, 8), 0.5, np.float32)
    cs[0, 1, 3] = 1e-4  # this channel is magnified 10^4 before per-token quantization
    prof = Profile(
        "eq",
        [16, 16],
        [16, 16],
        CodebookSet("eq-tables", {15: book}, cs),
        model=ModelFingerprint.uniform("t", 2, 8),
    )
    c = CacheGenCodec(profile=prof)
    x = kv_like((2, 2, 16, 8), torch.float16, seed=5)
    for scale, scale_dtype in [(1.0, "float16"), (1000.0, "float32")]:
        xs = (x.float() * scale).clamp(-6e4, 6e4).half()
        buf = c.encode(xs)
        payload = decode_frame(buf).payload
        from kvstore.codec.cachegen_format import parse

        assert parse(payload).layout.scale_dtype == scale_dtype and parse(payload).layout.channel_scaled
        y = c.decode(buf)
        assert torch.isfinite(y).all()
        # Error bound: half a step of the scaled row, mapped back through the channel scale.
        inv = torch.from_numpy(1 / cs).view(2, 2, 1, 8)
        m = (xs.float() * inv).abs().amax(-1, keepdim=True)
        bound = m / 14 * 1.01 / inv + xs.float().abs() * 2**-10 + 1e-6
        assert ((y.float() - xs.float()).abs() <= bound).all()


async def test_a_cachegen_tier_encodes_and_decodes_on_worker_threads(monkeypatch):
    """A store whose lower tier keeps CacheGen frames (`cold_codec`) encodes the chunks
    written through to it, decodes the ones read from it, and transcodes the ones it
    promotes on worker threads: the store's event loop serves other calls meanwhile."""
    import threading

    from kvstore.backends import open_backend
    from kvstore.tier import Tier
    from kvstore.tiered import TieredStore, TierSpec

    ran: dict[str, set[bool]] = {"encode": set(), "decode": set()}
    encode, decode = CacheGenCodec.frame_parts, CacheGenCodec.decode_payload

    def frame_parts(self, *a, **kw):  # type: ignore[no-untyped-def]
        ran["encode"].add(threading.current_thread() is threading.main_thread())
        return encode(self, *a, **kw)

    def decode_payload(self, *a, **kw):  # type: ignore[no-untyped-def]
        ran["decode"].add(threading.current_thread() is threading.main_thread())
        return decode(self, *a, **kw)

    monkeypatch.setattr(CacheGenCodec, "frame_parts", frame_parts)
    monkeypatch.setattr(CacheGenCodec, "decode_payload", decode_payload)
    x = kv_like((2, 8, 256, 128))  # 1 MiB (a smaller chunk is encoded at once, on the loop)
    store = TieredStore(
        [
            TierSpec(Tier(open_backend("mem://")), capacity=8 << 20),
            TierSpec(Tier(open_backend("mem://"), codec="cachegen"), capacity=8 << 20, write="through"),
        ]
    )
    name = "ns/m/f-1-0/1"
    assert await store.put_many([(name, x)]) == [True]
    await store.tiers[0].delete_many([name])
    store.placement.forget(name, 0)  # only the CacheGen copy is left
    (y,) = await store.get_many([name])
    assert y is not None
    max_error_ok(x, y, CacheGenCodec())
    await store.close()
    assert ran == {"encode": {False}, "decode": {False}}


async def test_a_cancelled_read_from_a_cachegen_tier_returns_once_its_decode_is_over(monkeypatch):
    """A read decoding CacheGen frames into the caller's tensors on a worker thread, and
    cancelled (its deadline): it returns only once the decode has stopped writing there,
    so the caller can reuse its buffer at once."""
    import asyncio
    import threading
    import time as _time

    from kvstore.backends import open_backend
    from kvstore.tier import Tier

    decode = CacheGenCodec.decode_payload
    began, ended = threading.Event(), []

    def slow_decode(self, *a, **kw):  # type: ignore[no-untyped-def]
        began.set()
        _time.sleep(0.3)
        out = decode(self, *a, **kw)
        ended.append(_time.monotonic())
        return out

    x = kv_like((2, 8, 256, 128))
    async with Tier(open_backend("mem://"), codec="cachegen") as tier:
        assert await tier.put_many([("ns/m/f-1-0/1", x)]) == [True]
        monkeypatch.setattr(CacheGenCodec, "decode_payload", slow_decode)
        out = torch.zeros_like(x)
        reading = asyncio.ensure_future(tier.get_many(["ns/m/f-1-0/1"], out=[out]))
        assert await asyncio.to_thread(began.wait, 5)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        returned = _time.monotonic()
        assert ended and ended[0] <= returned
