"""The end-to-end demo: a real model, the real LMCache engine, kvstore underneath.

Owns: the passes — (1) prefill each prompt, store its KV through LMCache, decode a
continuation; (2) after a restart (a fresh engine and an empty hot tier), load the
KV back instead of recomputing it and decode again; (3) when the last tier is lossy
(cachegen), the same from that tier alone — and the report of what each pass saw.
Must not touch: rendering (the CLI), storage logic.  LMCache is configured only
through ``LMCACHE_*`` variables, set here for the engine's lifetime.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from kvstore.store_config import TierConfig

PLUGIN = {
    "storage_plugin.kvstore.module_path": "kvstore_lmcache.storage_plugin",
    "storage_plugin.kvstore.class_name": "KVStoreStoragePlugin",
}
REMOTE = {
    "remote_storage_plugin.kvstore.module_path": "kvstore_lmcache.remote_connector",
    "remote_storage_plugin.kvstore.class_name": "KVStoreRemoteConnector",
}


@dataclass
class PromptResult:
    prompt_tokens: int
    hit_tokens: int
    tokens_by_tier: dict[str, int]
    bytes_by_tier: dict[str, int]
    load_s: float
    compute_s: float  # prefill of what was not loaded (pass 1: the whole prompt)
    agreement: float  # fraction of continuation tokens equal to pass 1's
    identical: bool


@dataclass
class PassReport:
    name: str
    tiers: list[dict]
    prompts: list[PromptResult] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return sum(p.hit_tokens for p in self.prompts)


@dataclass
class DemoReport:
    model: str
    path: str
    async_loading: bool
    chunk_size: int
    new_tokens: int
    passes: list[PassReport]
    continuations: list[str]
    model_load_s: float
    # MP path: how KV moved between worker and server ("shm", or "pickle"/"inline": in the requests)
    transfer: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, rep in zip(d["passes"], self.passes):
            p["hit_tokens"] = rep.hit_tokens
        return d


DEMO_COLD_CODEC = "cachegen?profile=smollm2-135m-mixq"


def default_demo_tiers(home) -> list[TierConfig]:
    """Memory, local disk, and a cold local tier compressed with CacheGen, using the
    profile calibrated on the demo's own model (top-1 agreement 0.97 at 4.6x; see
    docs/benchmarks/codec.md)."""
    return [
        TierConfig("mem://demo-hot?capacity=1GiB"),
        TierConfig(f"file://{home / 'demo' / 'warm'}?capacity=4GiB&fsync=false"),
        TierConfig(f"file://{home / 'demo' / 'cold'}?capacity=4GiB&fsync=false", DEMO_COLD_CODEC),
    ]


@contextmanager
def lmcache_env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("LMCACHE_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(values)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("LMCACHE_")]:
            del os.environ[k]
        os.environ.update(saved)


def _fresh_hot(tier: TierConfig) -> TierConfig:
    """The same hot tier as after a process restart: an empty memory space."""
    from urllib.parse import urlsplit, urlunsplit

    from kvstore.backends import backend_class

    if not backend_class(tier.url).capabilities.in_memory:
        return tier
    parts = urlsplit(tier.url)  # same-named memory tiers share a space: a new name is a new space
    fresh = f"{parts.netloc or 'hot'}-{uuid.uuid4().hex[:6]}"
    return replace(tier, url=urlunsplit(parts._replace(netloc=fresh)))


def per_tier(
    names: list[str], before: list[tuple[int, int]], after: list[tuple[int, int]], chunk_size: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens and bytes each tier served between two (hits, bytes_read) snapshots."""
    tokens = {n: (a[0] - b[0]) * chunk_size for n, a, b in zip(names, after, before) if a[0] > b[0]}
    nbytes = {n: a[1] - b[1] for n, a, b in zip(names, after, before) if a[1] > b[1]}
    return tokens, nbytes


def resume(
    model,
    ids: torch.Tensor,
    ref: list[int],
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    hit: int,
    load_s: float,
    by_tier: tuple[dict[str, int], dict[str, int]],
) -> PromptResult:
    """Prefill what was not loaded after the `hit` loaded tokens, decode, compare with `ref`."""
    new_tokens = len(ref)
    use = min(hit, len(ids) - 1)  # the last prompt token is always computed: it yields the logits
    t = time.perf_counter()
    if use > 0:
        past = [(k[:, :, :use], v[:, :, :use]) for k, v in kv]
        logits, cache = model.prefill(ids[use:], past)
    else:
        logits, cache = model.prefill(ids)
    compute_s = time.perf_counter() - t
    cont = model.greedy(logits, cache, new_tokens)
    same = sum(a == b for a, b in zip(cont, ref))
    return PromptResult(
        prompt_tokens=len(ids),
        hit_tokens=hit,
        tokens_by_tier=by_tier[0],
        bytes_by_tier=by_tier[1],
        load_s=load_s,
        compute_s=compute_s,
        agreement=same / max(len(ref), 1),
        identical=cont == ref,
    )


def load_demo(
    threads: int | None, prompts: int, prompt_tokens: int, step: Callable[[str], None]
) -> tuple[Any, list[torch.Tensor], float]:
    """(the demo model, its prompts' token ids, seconds the model took to load)."""
    from kvstore.demo.model import demo_prompts, load_model

    t0 = time.perf_counter()
    model = load_model(threads)
    model_load_s = time.perf_counter() - t0
    step("model loaded")
    return model, demo_prompts(model.tokenizer, prompts, prompt_tokens), model_load_s


def restart_plans(tiers: list[TierConfig]) -> list[tuple[str, list[TierConfig]]]:
    """The passes after the first: a restart (empty hot tier), and for a lossy last tier,
    that tier alone."""
    plans = [("after restart: load instead of prefill", [_fresh_hot(tiers[0]), *tiers[1:]])]
    if len(tiers) == 1:
        plans = [("second run: load instead of prefill", tiers)]
    if len(tiers) > 2 and tiers[-1].codec != "raw":
        plans.append((f"cold tier only ({tiers[-1].codec})", [_fresh_hot(tiers[0]), tiers[-1]]))
    return plans


def run_demo(
    tiers: list[TierConfig],
    *,
    prompts: int = 2,
    prompt_tokens: int = 769,
    new_tokens: int = 12,
    chunk_size: int = 256,
    path: str = "plugin",
    async_loading: bool = False,
    threads: int | None = None,
    step: Callable[[str], None] = lambda msg: None,
) -> DemoReport:
    from kvstore.demo.cpu_engine import build_cpu_engine
    from kvstore.demo.hf_connector import empty_kv

    model, ids_list, model_load_s = load_demo(threads, prompts, prompt_tokens, step)

    def engine_env(ts: list[TierConfig]) -> dict[str, str]:
        extra = {
            **(PLUGIN if path == "plugin" else REMOTE),
            "kvstore.tiers": [{"url": t.url, "codec": t.codec} for t in ts],
            "kvstore.namespace": "demo",
        }
        env = {
            "LMCACHE_CHUNK_SIZE": str(chunk_size),
            "LMCACHE_LOCAL_CPU": "False",  # every hit comes from kvstore
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "1.0",
            "LMCACHE_ENABLE_ASYNC_LOADING": str(async_loading),
            "LMCACHE_BLOCKING_TIMEOUT_SECS": "20",
            "LMCACHE_EXTRA_CONFIG": json.dumps(extra),
            "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "ERROR"),
        }
        if path == "plugin":
            env["LMCACHE_STORAGE_PLUGINS"] = "kvstore"
        else:
            env["LMCACHE_REMOTE_STORAGE_PLUGINS"] = "kvstore"
            env["LMCACHE_REMOTE_SERDE"] = "naive"
        return env

    def open_engine(ts: list[TierConfig]):
        with lmcache_env(engine_env(ts)):
            eng = build_cpu_engine(
                model_name=model.name,
                num_layers=model.num_layers,
                num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim,
                dtype=model.dtype,
            )
        if eng.kvstore_backend() is None:
            eng.close()
            raise RuntimeError("LMCache did not load kvstore; run with LMCACHE_LOG_LEVEL=INFO to see why")
        return eng

    tiers = [*tiers]
    desc = [{"url": t.redacted(), "codec": t.codec} for t in tiers]
    passes: list[PassReport] = []
    conts: list[list[int]] = []

    # ---- pass 1: compute, store, decode
    first = PassReport("first run: prefill and store", desc)
    eng = open_engine(tiers)
    try:
        for ids in ids_list:
            t = time.perf_counter()
            logits, cache = model.prefill(ids)
            compute_s = time.perf_counter() - t
            eng.engine.store(ids, kvcaches=model.pairs(cache))
            conts.append(model.greedy(logits, cache, new_tokens))
            first.prompts.append(PromptResult(len(ids), 0, {}, {}, 0.0, compute_s, 1.0, True))
            step("prefill + store")
        eng.wait_for_writes(120)
    finally:
        eng.close()
    passes.append(first)

    # ---- pass 2 (restart) and, for a lossy cold tier, pass 3 (cold tier alone)
    for name, ts in restart_plans(tiers):
        rep = PassReport(name, [{"url": t.redacted(), "codec": t.codec} for t in ts])
        eng = open_engine(ts)
        try:
            stack = eng.kvstore_backend().runtime.store
            for ids, ref in zip(ids_list, conts):
                before = stack.stats()
                buf = empty_kv(model.num_layers, model.num_kv_heads, len(ids), model.head_dim, model.dtype)
                t = time.perf_counter()
                _, hit = eng.lookup_then_load(ids, buf)
                load_s = time.perf_counter() - t
                after = stack.stats()
                tier_names = [
                    f"{i}:{d['url'].split('://')[0]}({d['codec']})" for i, d in enumerate(rep.tiers)
                ]
                hits = [(t.hits, t.bytes_read) for t in before.tiers]
                now = [(t.hits, t.bytes_read) for t in after.tiers]
                rep.prompts.append(
                    resume(model, ids, ref, buf, hit, load_s, per_tier(tier_names, hits, now, chunk_size))
                )
                step(name)
        finally:
            eng.close()
        passes.append(rep)

    return DemoReport(
        model=model.name,
        path=path,
        async_loading=async_loading,
        chunk_size=chunk_size,
        new_tokens=new_tokens,
        passes=passes,
        continuations=[model.tokenizer.decode(c) for c in conts],
        model_load_s=model_load_s,
    )


def steps_total(tiers: list[TierConfig], prompts: int) -> int:
    passes = 2 + (1 if len(tiers) > 2 and tiers[-1].codec != "raw" else 0)
    return 1 + passes * prompts


__all__ = ["DemoReport", "default_demo_tiers", "run_demo", "steps_total", "torch"]
