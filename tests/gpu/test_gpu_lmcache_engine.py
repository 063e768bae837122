"""LMCache's own engine (run on CPU) stores and retrieves through the connectors:
store a request's KV, retrieve it into fresh paged caches at other slots, compare."""

from __future__ import annotations

import itertools

import pytest
import torch
from gpu_kvgen import GEOMETRY, make_caches, random_requests
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvstore.gpu import PagedKVCache
from kvstore.gpu.connector import LayerwisePagedKVConnector, PagedKVConnector
from kvstore.lmcache_paths import inprocess_module

LMCacheEngineBuilder = inprocess_module("cache_engine").LMCacheEngineBuilder

CHUNK = 16
NUM_TOKENS = 3 * CHUNK + 7  # three full chunks and a partial one
_ids = itertools.count()


@pytest.fixture
def engine_for():
    made = []

    def build(layout: str, layerwise: bool, device: str = "cpu"):
        g = GEOMETRY[layout]
        mla = layout == "mla"
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=True,
            max_local_cpu_size=0.02,
            use_layerwise=layerwise,
            save_unfull_chunk=True,
            extra_config={"save_only_first_rank": False},
        )
        meta = LMCacheMetadata(
            model_name="kvstore-test",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float32,
            kv_shape=(g["num_layers"], 1 if mla else 2, CHUNK, g["heads"], g["head_size"]),
            use_mla=mla,
            chunk_size=CHUNK,
        )
        cls = LayerwisePagedKVConnector if layerwise else PagedKVConnector
        conn = cls.from_metadata(meta, device=device)
        name = f"kvstore-gpu-test-{next(_ids)}"
        engine = LMCacheEngineBuilder.get_or_create(name, cfg, meta, conn, lambda *a: None, lambda *a: None)
        engine.post_init()
        made.append(name)
        return engine

    yield build
    for name in made:
        LMCacheEngineBuilder.destroy(name)


def _request(layout: str, seed: int):
    caches = make_caches(layout, seed=seed)
    lay = PagedKVCache(caches).layout
    slots = random_requests(
        [NUM_TOKENS], num_blocks=lay.num_blocks, block_size=lay.block_size, seed=seed
    ).slots[0]
    return caches, slots


def test_engine_store_and_retrieve(layout, engine_for):
    engine = engine_for(layout, layerwise=False)
    caches, slots = _request(layout, seed=21)
    tokens = torch.arange(1000, 1000 + NUM_TOKENS)
    engine.store(tokens, kvcaches=caches, slot_mapping=slots)
    assert engine.lookup(tokens) == NUM_TOKENS

    fresh, fresh_slots = make_caches(layout, fill="zeros"), _request(layout, seed=22)[1]
    mask = engine.retrieve(tokens, kvcaches=fresh, slot_mapping=fresh_slots)
    assert int(mask.sum()) == NUM_TOKENS
    assert torch.equal(PagedKVCache(fresh).gather(fresh_slots), PagedKVCache(caches).gather(slots))


def test_engine_layerwise_store_and_retrieve(layout, engine_for):
    engine = engine_for(layout, layerwise=True)
    num_layers = GEOMETRY[layout]["num_layers"]
    caches, slots = _request(layout, seed=23)
    tokens = torch.arange(5000, 5000 + NUM_TOKENS)

    storer = engine.store_layer(tokens, kvcaches=caches, slot_mapping=slots, sync=True)
    for _ in range(num_layers + 1):  # one step per layer (after its attention), one to finish
        next(storer)
    with pytest.raises(StopIteration):
        next(storer)
    assert engine.lookup(tokens) == NUM_TOKENS

    fresh, fresh_slots = make_caches(layout, fill="zeros"), _request(layout, seed=24)[1]
    retriever = engine.retrieve_layer(tokens, kvcaches=fresh, slot_mapping=fresh_slots, sync=True)
    steps = list(retriever)  # as vLLM does: two next() up front, then one per layer
    assert len(steps) == num_layers + 2
    # LMCache 0.5.6 yields the retrieved-token count first; 0.5.7 yields None there
    assert steps[0] is None or int(steps[0]) == NUM_TOKENS
    assert int(steps[-1].sum()) == NUM_TOKENS  # final step: the mask
    assert torch.equal(PagedKVCache(fresh).gather(fresh_slots), PagedKVCache(caches).gather(slots))


def test_engine_layerwise_retrieve_overlaps_with_layers(engine_for):
    """Layer i is in the fresh cache by the time the engine yields for layer i + 1."""
    engine = engine_for("flash_attn", layerwise=True)
    num_layers = GEOMETRY["flash_attn"]["num_layers"]
    caches, slots = _request("flash_attn", seed=25)
    tokens = torch.arange(9000, 9000 + NUM_TOKENS)
    for _ in engine.store_layer(tokens, kvcaches=caches, slot_mapping=slots, sync=True):
        pass
    fresh = make_caches("flash_attn", fill="zeros")
    src, dst = PagedKVCache(caches), PagedKVCache(fresh)
    retriever = engine.retrieve_layer(tokens, kvcaches=fresh, slot_mapping=slots, sync=True)
    next(retriever)
    for layer in range(num_layers):
        next(retriever)
        assert torch.equal(dst.gather(slots)[:, layer], src.gather(slots)[:, layer])
    next(retriever)


@pytest.mark.gpu
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_engine_on_cuda_caches(layout, layerwise, engine_for):
    """As vLLM runs it: paged caches and slot mapping on the GPU, chunks in LMCache's
    host pool; what comes back into fresh GPU caches equals what was stored."""
    engine = engine_for(layout, layerwise=layerwise, device="cuda")
    num_layers = GEOMETRY[layout]["num_layers"]
    caches, slots = _request(layout, seed=31)
    caches, slots = [c.cuda() for c in caches], slots.cuda()
    tokens = torch.arange(20000, 20000 + NUM_TOKENS)
    fresh = [c.cuda() for c in make_caches(layout, fill="zeros")]
    fresh_slots = _request(layout, seed=32)[1].cuda()
    if layerwise:
        for _ in engine.store_layer(tokens, kvcaches=caches, slot_mapping=slots, sync=True):
            pass
        assert engine.lookup(tokens) == NUM_TOKENS
        steps = list(engine.retrieve_layer(tokens, kvcaches=fresh, slot_mapping=fresh_slots, sync=True))
        assert len(steps) == num_layers + 2
        assert int(steps[-1].sum()) == NUM_TOKENS
    else:
        engine.store(tokens, kvcaches=caches, slot_mapping=slots)
        assert engine.lookup(tokens) == NUM_TOKENS
        mask = engine.retrieve(tokens, kvcaches=fresh, slot_mapping=fresh_slots)
        assert int(mask.sum()) == NUM_TOKENS
    torch.cuda.synchronize()
    got = PagedKVCache(fresh).gather(fresh_slots).cpu()
    assert torch.equal(got, PagedKVCache(caches).gather(slots).cpu())
