"""The demo in LMCache's multiprocess (MP) mode: a real ``lmcache server`` with kvstore as
its L2 adapter, a CPU engine worker storing and loading KV through it.

Owns: the MP passes — (1) prefill each prompt, store its KV through the server, wait
for the L2 writes, stop the server; (2) start a new server process (empty L1, empty
hot tier), retrieve the KV instead of recomputing it and decode again; (3) for a lossy
last tier, the same from that tier alone.  Must not touch: the report's shape and the
resume step (shared with the in-process demo in `kvstore.demo.run`), storage logic.

The KV moves between the worker and the server through shared memory (``/dev/shm``,
LMCache's L1 pool there) where ``/dev/shm`` has room for L1, as an engine's transfer
does not copy KV through its requests; else inside the requests (pickled over ZeroMQ,
several times slower for the demo's 34 MiB prompts).  The report names which.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.demo.run import DemoReport, PassReport, PromptResult, load_demo, per_tier, restart_plans, resume
from kvstore.store_config import TierConfig


def to_chunk_layout(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """HF per-layer ``[(K, V)]`` of ``[1, heads, T, dim]`` -> the MP server's ``[2, L, T, heads*dim]``."""

    def flat(t: torch.Tensor) -> torch.Tensor:
        _, heads, tokens, dim = t.shape
        return t[0].transpose(0, 1).reshape(tokens, heads * dim)

    return torch.stack([torch.stack([flat(k) for k, _ in pairs]), torch.stack([flat(v) for _, v in pairs])])


def from_chunk_layout(kv: torch.Tensor, heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of `to_chunk_layout`."""
    _, layers, tokens, hidden = kv.shape

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(tokens, heads, hidden // heads).transpose(0, 1).unsqueeze(0).contiguous()

    return [(per_head(kv[0, i]), per_head(kv[1, i])) for i in range(layers)]


def adapter_spec(tiers: list[TierConfig]) -> dict:
    """The ``--l2-adapter`` JSON that loads kvstore with `tiers`."""
    from kvstore.lmcache_mp import plugin_l2_adapter

    return plugin_l2_adapter(
        "kvstore_lmcache.l2_adapter",
        "KVStoreL2Adapter",
        {"tiers": [{"url": t.url, "codec": t.codec} for t in tiers], "namespace": "demo", "timeout_s": 20},
    )


L1_SIZE_GB = 0.5
SHM_HEADROOM = 256 * 2**20


def shm_segment(l1_size_gb: float, tag: str) -> str:
    """A name for the server's shared-memory L1 pool, or "" where ``/dev/shm`` cannot
    hold it with room to spare (a container's default 64 MiB, say)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return ""
    if st.f_bavail * st.f_frsize < l1_size_gb * 2**30 + SHM_HEADROOM:
        return ""
    return f"kvstore-demo-{os.getpid()}-{tag}-{secrets.token_hex(4)}"  # LMCache replaces a same-named pool


def run_demo_mp(
    tiers: list[TierConfig],
    *,
    prompts: int = 2,
    prompt_tokens: int = 769,
    new_tokens: int = 12,
    chunk_size: int = 256,
    threads: int | None = None,
    step: Callable[[str], None] = lambda msg: None,
) -> DemoReport:
    from kvstore.lmcache_mp import MPClient, MPServer

    model, ids_list, model_load_s = load_demo(threads, prompts, prompt_tokens, step)
    logs = Path(tempfile.mkdtemp(prefix="kvstore-demo-mp-"))

    def server(ts: list[TierConfig], n: int) -> MPServer:
        return MPServer(
            [adapter_spec(ts)],
            chunk_size=chunk_size,
            l1_size_gb=L1_SIZE_GB,
            log_path=logs / f"server{n}.log",
            shm_name=shm_segment(L1_SIZE_GB, str(n)),
        )

    def client(srv: MPServer) -> MPClient:
        c = MPClient(
            srv.url, model.name, model.num_layers, model.num_kv_heads, model.head_dim, model.dtype, chunk_size
        )
        c.register()
        return c

    def tier_counts(c: MPClient) -> list[tuple[int, int]]:
        (adapter,) = c.l2_status()["l2_adapters"]
        return [(t["hits"], t["bytes_read"]) for t in adapter["tiers"]]

    desc = [{"url": t.redacted(), "codec": t.codec} for t in tiers]
    passes: list[PassReport] = []
    conts: list[list[int]] = []
    transfers: set[str] = set()

    # ---- pass 1: compute, store through the server, wait for kvstore to hold it
    first = PassReport("first run: prefill and store (lmcache server, kvstore L2 adapter)", desc)
    with server(tiers, 1) as srv, client(srv) as c:
        transfers.add(c.transfer)
        for ids in ids_list:
            t = time.perf_counter()
            logits, cache = model.prefill(ids)
            compute_s = time.perf_counter() - t
            c.store(ids.tolist(), to_chunk_layout(model.pairs(cache)))
            conts.append(model.greedy(logits, cache, new_tokens))
            first.prompts.append(PromptResult(len(ids), 0, {}, {}, 0.0, compute_s, 1.0, True))
            step("prefill + store")
        for ids in ids_list:
            if not c.wait_stored(ids.tolist(), timeout=120):
                raise RuntimeError(f"kvstore did not hold the stored KV in 120s; server log: {srv.log_path}")
    passes.append(first)

    # ---- a new server process for each later pass: nothing in L1, nothing in memory
    for n, (name, ts) in enumerate(restart_plans(tiers), start=2):
        rep = PassReport(
            f"{name} (new server process)", [{"url": t.redacted(), "codec": t.codec} for t in ts]
        )
        names = [f"{i}:{d['url'].split('://')[0]}({d['codec']})" for i, d in enumerate(rep.tiers)]
        with server(ts, n) as srv, client(srv) as c:
            transfers.add(c.transfer)
            for ids, ref in zip(ids_list, conts):
                before = tier_counts(c)
                t = time.perf_counter()
                hit, kv = c.retrieve(ids.tolist())
                load_s = time.perf_counter() - t
                by_tier = per_tier(names, before, tier_counts(c), chunk_size)
                pairs = from_chunk_layout(kv, model.num_kv_heads) if hit else []
                rep.prompts.append(resume(model, ids, ref, pairs, hit, load_s, by_tier))
                step(name)
        passes.append(rep)

    return DemoReport(
        model=model.name,
        path="mp",
        async_loading=True,  # the server prefetches from L2 on lookup
        chunk_size=chunk_size,
        new_tokens=new_tokens,
        passes=passes,
        continuations=[model.tokenizer.decode(c) for c in conts],
        model_load_s=model_load_s,
        transfer="/".join(sorted(transfers)),
    )


__all__ = ["adapter_spec", "from_chunk_layout", "run_demo_mp", "to_chunk_layout"]
