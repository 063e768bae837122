"""Profiles are bound to the model they were fitted on; frames written before that decode."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kvstore import codec as codecs
from kvstore.codec import cachegen_profile
from kvstore.codec.cachegen import CacheGenCodec
from kvstore.codec.cachegen_profile import (
    PROFILE_DIR,
    ModelFingerprint,
    Profile,
    ProfileMismatchError,
    normalize_model_name,
)
from kvstore.codec.cachegen_tables import CodebookSet, builtin_codebook

DATA = Path(__file__).with_name("data")
SHIPPED = ("smollm2-135m", "smollm2-135m-hq", "smollm2-135m-lmcache")
# sha256 (first 32 hex digits) of the int16 bits each fixture frame decoded to when it was
# written, by the codec as it was before profiles carried a model fingerprint.
DECODED = {
    "smollm2-135m": "748fd8e1bf33ecd89a14903f00c2107c",
    "smollm2-135m-hq": "94b4806de25af958cd51afa02f970e10",
    "smollm2-135m-lmcache": "8314528865f45c087e27b15733d33fbb",
}


def kv(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).half()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.view(torch.int16).numpy().tobytes()).hexdigest()[:32]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_carry_the_smollm2_fingerprint(name: str) -> None:
    prof = Profile.load(name)
    fp = prof.model
    assert fp is not None
    assert (fp.num_layers, fp.planes, fp.kv_heads, fp.head_dim) == (30, 2, 3, 64)
    assert fp.key_channels == fp.value_channels == (192,) * 30
    assert fp.matches_name(prof.info["model"]) and fp.matches_name("HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize("name", SHIPPED)
def test_another_models_kv_is_refused_naming_calibrate(name: str) -> None:
    c = codecs.get("cachegen", profile=name)
    assert c.decode(c.encode(kv((2, 30, 16, 192)))).shape == (2, 30, 16, 192)
    # Same layer count, other channel count: this used to encode (at 3.58x) without complaint.
    for shape, why in [
        ((2, 30, 16, 256), "256 channels per layer, the model has 192"),
        ((2, 30, 16, 128), "128 channels per layer"),
        ((2, 24, 16, 192), "24 layers, the model has 30"),
        ((1, 30, 16, 192), "1 plane"),
    ]:
        with pytest.raises(ProfileMismatchError, match=why) as err:
            c.encode(kv(shape))
        assert "kvstore codec calibrate" in str(err.value) and "SmolLM2-135M-Instruct" in str(err.value)


def test_model_name_is_checked_when_given() -> None:
    ok = codecs.get("cachegen?profile=smollm2-135m&model=HuggingFaceTB/SmolLM2-135M-Instruct")
    assert ok.decode(ok.encode(kv((2, 30, 4, 192)))).shape == (2, 30, 4, 192)
    with pytest.raises(ProfileMismatchError, match="kvstore codec calibrate"):
        codecs.get("cachegen", profile="smollm2-135m", model="meta-llama/Llama-3.1-8B")
    assert normalize_model_name("smollm2-135m-instruct-q4_k_m.gguf") == "smollm2-135m-instruct"
    assert normalize_model_name("Qwen/Qwen2.5-0.5B") == "qwen2.5-0.5b"
    # Presets are for any model.
    assert codecs.get("cachegen", model="meta-llama/Llama-3.1-8B").encode(kv((2, 3, 4, 8)))


@pytest.mark.parametrize("name", SHIPPED)
def test_frames_written_before_fingerprints_decode_unchanged(name: str, monkeypatch) -> None:
    buf = (DATA / f"{name}-written-before-fingerprints.kvsf").read_bytes()
    # A fresh process: nothing loaded, the shipped profiles are found by the scan.
    monkeypatch.setattr(cachegen_profile, "_SETS", {})
    monkeypatch.setattr(cachegen_profile, "_SCANNED", False)
    y = CacheGenCodec().decode(buf)
    assert y.shape == (2, 30, 3, 192) and digest(y) == DECODED[name]


def test_binding_keeps_the_codebook_digest_and_round_trips_through_json(tmp_path: Path) -> None:
    book = builtin_codebook(15)
    legacy = Profile("mine", [16] * 3, [16] * 3, CodebookSet("mine-tables", {15: book}))
    path = tmp_path / "mine.json"
    legacy.save(path)
    assert json.loads(path.read_text())["model"] is None
    loaded = Profile.load(path)
    assert loaded.model is None
    # A profile without a fingerprint decodes its frames but will not encode.
    x = kv((2, 3, 8, 16))
    with pytest.raises(ProfileMismatchError, match=r"names no model.*kvstore codec calibrate"):
        CacheGenCodec(profile=loaded).encode(x)

    fp = ModelFingerprint("org/My-Model", 3, 2, (16, 16, 16), (16, 16, 16), 2, 8, "bfloat16")
    bound = loaded.bound_to(fp)
    assert bound.codebook_set().digest == loaded.codebook_set().digest
    bound.save(path)
    again = Profile.load(path)
    assert again.model == fp and again.codebook_set().digest == loaded.codebook_set().digest
    y = CacheGenCodec().decode(CacheGenCodec(profile=again).encode(x))
    assert y.shape == x.shape
    with pytest.raises(ValueError, match="3 layers; its model has 4"):
        loaded.bound_to(ModelFingerprint.uniform("org/My-Model", 4, 16))


def test_per_layer_channel_layouts_and_mla() -> None:
    # K and V of different widths cannot be one KV_2LTD tensor: every such tensor is refused.
    fp = ModelFingerprint("odd", 2, 2, (16, 16), (16, 32))
    prof = Profile("odd", [16, 16], [16, 16], model=fp)
    with pytest.raises(ProfileMismatchError, match="K 16 / V 32"):
        CacheGenCodec(profile=prof).encode(kv((2, 2, 4, 16)))
    mla = Profile("mla", [32] * 2, [32] * 2, model=ModelFingerprint.uniform("deepseek", 2, 64, planes=1))
    c = CacheGenCodec(profile=mla)
    assert c.decode(c.encode(kv((1, 2, 4, 64)))).shape == (1, 2, 4, 64)
    with pytest.raises(ProfileMismatchError, match="2 plane"):
        c.encode(kv((2, 2, 4, 64)))
    with pytest.raises(ValueError, match="every layer"):
        ModelFingerprint("bad", 2, 2, (16,), (16, 16))


def test_shipped_profile_files_are_the_ones_tested() -> None:
    assert {p.stem for p in PROFILE_DIR.glob("*.json")} >= set(SHIPPED)


def test_prompt_kind_mixes_span_kinds_and_keep_sources_apart() -> None:
    from kvstore.codec import kvmodel

    cal = kvmodel.labelled_texts("calibration-mix")
    held = kvmodel.labelled_texts("heldout-mix")
    kinds = [label.split(":")[0] for label, _ in held]
    assert kinds[:2] == ["code", "docs"] and {"code", "docs", "chat"} <= set(kinds)
    assert not {label for label, _ in cal if not label.startswith("chat")} & {label for label, _ in held}
    cal_topics = {t for g in kvmodel.MIX["calibration-mix"]["docs"] for t in g} | {
        t for _, t in kvmodel.MIX["calibration-mix"]["chat"]
    }
    held_topics = {t for g in kvmodel.MIX["heldout-mix"]["docs"] for t in g} | {
        t for _, t in kvmodel.MIX["heldout-mix"]["chat"]
    }
    assert not cal_topics & held_topics
    assert all(len(text) > 2000 for _, text in held)
