from __future__ import annotations

import pytest
import torch

from kvstore import codec


def test_spec_carries_options() -> None:
    assert codec.parse_spec("cachegen?profile=smollm2-135m&threads=2") == (
        "cachegen",
        {"profile": "smollm2-135m", "threads": 2},
    )
    assert codec.parse_spec("raw") == ("raw", {})


def test_spec_builds_a_working_codec_and_plain_decoder_reads_it() -> None:
    enc = codec.get("cachegen?profile=smollm2-135m")
    kv = torch.randn(2, 30, 64, 192, dtype=torch.float16)
    back = codec.get("cachegen").decode(enc.encode(kv))
    assert back.shape == kv.shape and back.dtype == kv.dtype
    cos = torch.nn.functional.cosine_similarity(back.float().flatten(), kv.float().flatten(), dim=0)
    assert cos > 0.99


def test_bad_spec_option_is_an_error() -> None:
    with pytest.raises(TypeError):
        codec.get("raw?level=3")
