"""The cachegen fast paths: direct float16/bfloat16 output, warm-up, one decode signature."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kvstore.codec import get
from kvstore.codec.cachegen import CacheGenCodec, warm_up
from kvstore.codec.cachegen_kernels import _bf16_bits, _f16_bits, _f16_value, choose_tables


@njit(cache=False)
def _convert(x, o16, ob):
    for i in range(x.shape[0]):
        o16[i] = _f16_bits(x[i])
        ob[i] = _bf16_bits(x[i])


def test_half_conversions_match_torch_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array(
        [0.0, 65504, 65519.99, 65520, 65536, 6.1035e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-10, np.inf, 3.4e38],
        np.float32,
    )
    x = np.concatenate([x[np.isfinite(x)], edges, -edges, np.linspace(-7e4, 7e4, 100_001, dtype=np.float32)])
    o16 = np.empty(x.shape, np.uint16)
    ob = np.empty(x.shape, np.uint16)
    _convert(x, o16, ob)
    t = torch.from_numpy(x)
    assert (o16 == t.half().view(torch.int16).numpy().view(np.uint16)).all()
    assert (ob == t.bfloat16().view(torch.int16).numpy().view(np.uint16)).all()


@njit(cache=False)
def _widen(bits, out):
    for i in range(bits.shape[0]):
        out[i] = _f16_value(np.uint32(bits[i]))


def test_float16_input_is_widened_exactly_as_torch_widens_it():
    """The encoder reads float16 bits arithmetically (no table): every one of the 65536
    patterns must give torch's float32, subnormals, signed zeros and infinities included."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, np.float32)
    _widen(bits, out)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.float16).float().numpy()
    nan = np.isnan(want)
    assert (np.isnan(out) == nan).all()
    assert (out.view(np.uint32)[~nan] == want.view(np.uint32)[~nan]).all()


def test_every_16_bit_input_pattern_codes_like_its_float32_value():
    """A float16 / bfloat16 chunk holding every finite bit pattern encodes to the same
    payload as the same values given as float32 (the quantizer works on float32)."""
    c = get("cachegen", preset="lmcache")
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
        x = x[torch.isfinite(x)]
        x = x[: x.numel() // 64 * 64].view(2, 1, -1, 32)
        got = c.decode(c.encode(x))
        want = c.decode(c.encode(x.float())).to(dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_decode_into_strided_or_float32_out_equals_plain_decode():
    torch.manual_seed(0)
    c = get("cachegen", preset="lmcache")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(2, 12, 20, 64).to(dtype)
        buf = c.encode(x)
        y = c.decode(buf)
        big = torch.zeros(2, 12, 20, 128, dtype=dtype)
        frame_view = big[..., :64]  # not contiguous: decoded as float32, then copied
        from kvstore.frame import decode_frame

        f = decode_frame(buf)
        c.decode_payload(f.payload, f.header, out=frame_view)
        assert torch.equal(frame_view, y)
        assert torch.equal(c.decode_payload(f.payload, f.header), y)


def test_writable_and_read_only_buffers_decode_alike():
    c = get("cachegen", preset="lmcache")
    x = torch.randn(2, 10, 16, 64).half()
    buf = c.encode(x)
    assert torch.equal(c.decode(buf), c.decode(bytearray(buf)))


def test_warm_up_runs_once_and_codecs_wait_for_it():
    warm_up()  # synchronous, the preset
    c = CacheGenCodec(profile="smollm2-135m")
    c.wait_warm()
    assert c._warming is None
    cold = CacheGenCodec(preset="lmcache", warm=0)
    assert cold._warming is None
    x = torch.randn(2, 30, 8, 192).half()
    assert torch.equal(cold.decode(c.encode(x)), c.decode(c.encode(x)))


def test_table_choice_is_the_cheapest_table_and_the_first_of_equal_cost():
    # Code lengths in quarter bits and small counts: every cost is exact in float32, so
    # numpy's argmin (first index of the minimum) is the reference, ties included.
    rng = np.random.default_rng(1)
    S, C, A, K = 3, 64, 15, 200
    clt = (rng.integers(1, 48, (A, K + 7)) / 4).astype(np.float32)
    clt[:, 7 + 150] = clt[:, 7 + 40]  # tables 40 and 150 always tie
    clt[:, 7 + 199] = clt[:, 7 + 3]  # and so do 3 and 199, the last table
    hist = rng.integers(0, 5, (S, C, A)).astype(np.int32)
    hist[:, :, 0] = 0  # symbols never seen are skipped
    hist[0, 0] = 0  # a channel with nothing in it costs 0 under every table: table 0
    base = np.array([7, 7, 7], np.int64)
    tab = np.full((S, C), -1, np.int32)
    choose_tables(hist, np.full(S, A, np.int64), base, np.full(S, K, np.int64), clt, tab, 0, S)
    cost = hist.astype(np.float64) @ clt[:, 7:].astype(np.float64)  # [S, C, K], exact
    assert (tab == 7 + cost.argmin(axis=2)).all()
    assert tab[0, 0] == 7
    # A channel whose cheapest tables are a tie is coded with the first of them.
    ties = (cost == cost.min(axis=2, keepdims=True)).sum(axis=2) > 1
    assert ties.sum() > 1


def test_a_warm_up_that_starts_at_once_does_not_fail(monkeypatch, caplog):
    """The warm-up thread codes through the new codec at once; where it ran before the
    constructor had finished (here: a thread that runs as soon as it is started) it
    failed on a codec without its state, and the first chunk paid the kernels' load."""
    import logging
    import threading

    import kvstore.codec.cachegen as cg

    class AtOnce(threading.Thread):
        def start(self) -> None:
            self.run()

        def is_alive(self) -> bool:
            return False

    monkeypatch.setattr(cg, "_WARM", {})
    monkeypatch.setattr(cg.threading, "Thread", AtOnce)
    with caplog.at_level(logging.WARNING, logger="kvstore.codec"):
        c = CacheGenCodec(preset="lmcache")
    assert not [r for r in caplog.records if "warm-up failed" in r.getMessage()]
    assert c._warming is None


def test_the_warm_up_s_own_calls_leave_others_waiting(monkeypatch):
    """A codec the warm-up codes through is still warming for every other thread: their
    first call waits for the whole warm-up, not only until the warm-up's first call."""
    import threading

    import kvstore.codec.cachegen as cg

    release, own_calls_done = threading.Event(), threading.Event()
    real = cg.warm_up

    def slow(codec=None):
        real(codec)  # its own encode/decode calls `wait_warm` on this codec
        own_calls_done.set()
        release.wait(10)

    monkeypatch.setattr(cg, "_WARM", {})
    monkeypatch.setattr(cg, "warm_up", slow)
    c = CacheGenCodec(preset="lmcache")
    assert own_calls_done.wait(60)
    waited = threading.Event()
    t = threading.Thread(target=lambda: (c.wait_warm(), waited.set()))
    t.start()
    assert not waited.wait(1.0)
    release.set()
    assert waited.wait(10)
    t.join(10)
