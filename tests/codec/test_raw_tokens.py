"""Profiles that store each chunk's leading tokens verbatim (``raw_tokens``), and what did
not change for profiles and payloads without them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

import numpy as np
import pytest
import torch

from kvstore.codec.cachegen import CacheGenCodec
from kvstore.codec.cachegen_format import CacheGenPayloadError, parse
from kvstore.codec.cachegen_profile import PROFILE_DIR, ModelFingerprint, Profile
from kvstore.codec.cachegen_tables import CodebookSet, builtin_codebook
from kvstore.frame import decode_frame

# sha256 (first 32 hex digits) of the payload, then of the decoded bits, of `kv(...)` below
# as the codec coded it before raw tokens existed (commit 7371e06): profiles and presets
# without raw tokens still write exactly these bytes.
BEFORE = {
    ("smollm2-135m", torch.float16): ("493ef44d0151ba878b22b694b36a333c", "6d56fdaca864f50eca3ac005921acb67"),
    ("smollm2-135m", torch.bfloat16): (
        "5805106ec6144f636ae45ad88c3c1f74",
        "1b46ba294cefaaaf6aacc04c17a73330",
    ),
    ("smollm2-135m", torch.float32): ("01ffcaac17f94fa95e9b6df29baf3d5c", "f904ec7b37c13fc9dd0c6058402372fb"),
    ("smollm2-135m-lmcache", torch.float16): (
        "80f87c587194b694399b7c11aa175f7b",
        "2dbcaae5843415f4e83fe51045e7312a",
    ),
}


def kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * (0.2 + 3 * torch.rand(shape[0], shape[1], 1, shape[3], generator=g))
    return x.to(dtype)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:32]


def payload(buf: bytes) -> bytes:
    return bytes(decode_frame(buf).payload)


@pytest.mark.parametrize(("name", "dtype"), sorted(BEFORE, key=str))
def test_profiles_without_raw_tokens_write_the_same_payloads(name: str, dtype: torch.dtype) -> None:
    c = CacheGenCodec(profile=name, warm=0)
    assert c.profile is not None and c.profile.raw_tokens == 0
    buf = c.encode(kv((2, 30, 40, 192), dtype, 3))
    assert not parse(memoryview(payload(buf))).layout.raw_tokens
    assert (sha(payload(buf)), sha(c.decode(buf).view(torch.uint8).numpy().tobytes())) == BEFORE[
        (name, dtype)
    ]


def test_old_profile_files_have_no_raw_tokens_field_and_save_unchanged(tmp_path) -> None:
    for f in sorted(PROFILE_DIR.glob("*.json")):
        m = json.loads(f.read_text())
        prof = Profile.from_json(m)
        if "raw_tokens" not in m:
            assert prof.raw_tokens == 0
            assert prof.to_json() == m  # saving an old profile does not add the field


def smollm2(raw: int) -> Profile:
    return dataclasses.replace(Profile.load("smollm2-135m"), raw_tokens=raw)


def test_raw_tokens_round_trip_through_json(tmp_path) -> None:
    p = smollm2(2)
    path = tmp_path / "p.json"
    p.save(path)
    m = json.loads(path.read_text())
    assert m["raw_tokens"] == 2
    q = Profile.load(path)
    assert q.raw_tokens == 2 and q.codebook_set().digest == p.codebook_set().digest
    assert q.bound_to(q.model).raw_tokens == 2  # type: ignore[arg-type]
    for bad in (-1, 65, 1.5, True, "1"):
        with pytest.raises(ValueError, match="raw_tokens"):
            Profile.from_json({**m, "raw_tokens": bad})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("raw", [1, 3])
def test_leading_tokens_are_exact_and_the_rest_decode_as_without(dtype: torch.dtype, raw: int) -> None:
    x = kv((2, 30, 64, 192), dtype, 7)
    plain, rawc = CacheGenCodec(profile=smollm2(0), warm=0), CacheGenCodec(profile=smollm2(raw), warm=0)
    a, b = plain.encode(x), rawc.encode(x)
    lay = parse(memoryview(payload(b))).layout
    assert lay.raw_tokens == raw and lay.coded_tokens == 64 - raw
    ya, yb = plain.decode(a), rawc.decode(b)
    assert torch.equal(yb[:, :, :raw], x[:, :, :raw])
    # Tokens are quantized one by one, so the others decode exactly as without raw tokens.
    assert torch.equal(yb[:, :, raw:], ya[:, :, raw:])
    # Decoding reads the count from the payload, not from the profile.
    assert torch.equal(plain.decode(b), yb)
    # Into a caller's buffer, contiguous or not (the second takes the float32 path).
    out = torch.empty_like(x)
    assert rawc.decode_payload(decode_frame(b).payload, decode_frame(b).header, out=out) is out
    assert torch.equal(out, yb)
    strided = torch.empty((2, 30, 128, 192), dtype=dtype)[:, :, ::2]
    rawc.decode_payload(decode_frame(b).payload, decode_frame(b).header, out=strided)
    assert torch.equal(strided, yb)


def test_chunks_shorter_than_the_raw_count_are_all_raw() -> None:
    c = CacheGenCodec(profile=smollm2(4), warm=0)
    for t in (1, 4, 5):
        x = kv((2, 30, t, 192), torch.float16, t)
        buf = c.encode(x)
        assert parse(memoryview(payload(buf))).layout.raw_tokens == min(4, t)
        y = c.decode(buf)
        assert torch.equal(y[:, :, : min(4, t)], x[:, :, : min(4, t)])


def test_inf_or_nan_in_a_raw_token_is_refused() -> None:
    c = CacheGenCodec(profile=smollm2(1), warm=0)
    x = kv((2, 30, 8, 192), torch.float16, 1)
    x[1, 4, 0, 7] = float("nan")
    with pytest.raises(ValueError, match=r"inf/NaN \(plane 1, layer 4\)"):
        c.encode(x)


def test_damaged_raw_token_headers_are_refused() -> None:
    c = CacheGenCodec(profile=smollm2(1), warm=0)
    x = kv((2, 30, 8, 192), torch.float16, 2)
    frame = decode_frame(c.encode(x))
    p = bytearray(frame.payload)
    lay = parse(memoryview(p)).layout
    at = 34 + len(lay.codebook_id.encode())  # the raw token count follows the codebook id
    for count in (0, 9):
        q = bytearray(p)
        struct.pack_into("<H", q, at, count)
        with pytest.raises(CacheGenPayloadError, match="raw tokens"):
            parse(memoryview(q))
    q = bytearray(p)
    q[11] |= 4  # an unknown flag
    with pytest.raises(CacheGenPayloadError, match="out of range"):
        parse(memoryview(q))
    # A non-finite raw value (the frame checksum would catch this; the payload check too).
    q = bytearray(p)
    sec = parse(memoryview(q))
    raw_at = sec.streams_offset - len(sec.raw)
    q[raw_at : raw_at + 2] = np.array([0x7C00], "<u2").tobytes()  # float16 +inf
    with pytest.raises(CacheGenPayloadError, match="non-finite raw token"):
        c.decode_payload(memoryview(q), frame.header)


def test_channel_scales_of_the_wrong_shape_are_refused_clearly() -> None:
    fp = ModelFingerprint.uniform("m", 2, 8)
    book = {15: builtin_codebook(15)}
    # Not [2, layers, channels].
    for shape in [(2, 8), (3, 2, 8), (1, 2, 8)]:
        with pytest.raises(ValueError, match=r"shaped \[2, layers, channels\]"):
            CodebookSet("cs", book, np.ones(shape, np.float32))
    with pytest.raises(ValueError, match="finite, positive"):
        CodebookSet("cs", book, np.zeros((2, 2, 8), np.float32))
    # The right rank for another model's layout: named with what the model needs.
    for shape in [(2, 2, 6), (2, 3, 8)]:
        with pytest.raises(ValueError, match=r"channel scales are shaped .* needs \(2, 2, 8\)"):
            Profile("p", [16, 16], [16, 16], CodebookSet("cs", book, np.ones(shape, np.float32)), model=fp)


def test_the_shipped_mix_profile_stores_the_first_token_raw_and_is_bound_to_smollm2(monkeypatch) -> None:
    from pathlib import Path

    from kvstore.codec import cachegen_profile
    from kvstore.codec.cachegen_profile import ProfileMismatchError

    prof = Profile.load("smollm2-135m-mix")
    assert prof.raw_tokens == 1 and prof.info["raw_tokens"] == 1
    assert prof.model is not None and prof.model.matches_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    c = CacheGenCodec(profile=prof, warm=0)
    with pytest.raises(ProfileMismatchError, match="kvstore codec calibrate"):
        c.encode(kv((2, 30, 4, 256), torch.float16, 0))
    # A frame written with it when it shipped decodes, in a fresh process, to the same bits.
    buf = (Path(__file__).with_name("data") / "smollm2-135m-mix-raw-tokens.kvsf").read_bytes()
    monkeypatch.setattr(cachegen_profile, "_SETS", {})
    monkeypatch.setattr(cachegen_profile, "_SCANNED", False)
    y = CacheGenCodec(warm=0).decode(buf)
    assert y.shape == (2, 30, 3, 192) and parse(memoryview(payload(buf))).layout.raw_tokens == 1
    assert sha(y.view(torch.int16).numpy().tobytes()) == "717f7fe5826fce01ab2eda8609ce1cf0"


def test_the_shipped_mixq_profile_has_query_weighted_k_scales_and_a_raw_first_token(monkeypatch) -> None:
    from pathlib import Path

    from kvstore.codec import cachegen_profile

    prof = Profile.load("smollm2-135m-mixq")
    cs = prof.codebook_set().channel_scales
    assert prof.raw_tokens == 1 and prof.info["smooth_k"] == 0.5
    assert cs is not None and cs.shape == (2, 30, 192) and np.all(cs[1] == 1.0)
    assert np.allclose(cs[0].mean(-1), 1.0, rtol=1e-4) and float(cs[0].min()) < 0.5 < 1.5 < float(cs[0].max())
    buf = (Path(__file__).with_name("data") / "smollm2-135m-mixq-raw-tokens-channel-scales.kvsf").read_bytes()
    monkeypatch.setattr(cachegen_profile, "_SETS", {})
    monkeypatch.setattr(cachegen_profile, "_SCANNED", False)
    y = CacheGenCodec(warm=0).decode(buf)
    lay = parse(memoryview(payload(buf))).layout
    assert lay.raw_tokens == 1 and lay.channel_scaled and y.shape == (2, 30, 3, 192)
    assert sha(y.view(torch.int16).numpy().tobytes()) == "1143553ab69c89935c718d75554fce9f"
