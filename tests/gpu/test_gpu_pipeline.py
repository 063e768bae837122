"""The layerwise two-stream pipeline (kvstore.gpu.pipeline) on CUDA, as LMCache's engine
drives it with objects from its pinned pool: every byte lands where it belongs when the
caller writes each layer just before storing it, when the caller reads each loaded layer
right after its wait, and when requests follow each other without the host waiting.
Pieces are LMCache-sized (1 MiB), so copies and kernels really run side by side."""

from __future__ import annotations

import pytest
import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from kvstore.gpu import PagedKVCache
from kvstore.gpu.connector import LayerwisePagedKVConnector

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 6, 96, 16, 8, 128
CHUNK = 256


def _caches(fill: str = "zeros", seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK, HEADS, HEAD)
    if fill == "zeros":
        return [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    return [torch.randn(shape, generator=gen).to(torch.bfloat16).cuda() for _ in range(LAYERS)]


def _slots(tokens: int, seed: int, after: int = 0) -> torch.Tensor:
    """Slots of ``tokens`` tokens on shuffled blocks; ``after`` skips the first blocks of
    the shuffle (requests with the same seed and disjoint ranges share no slot)."""
    order = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))
    blocks = order[after : after + -(-tokens // BLOCK)]
    assert len(blocks) * BLOCK >= tokens, f"{tokens} tokens after block {after} need more than {BLOCKS} blocks"
    t = torch.arange(tokens)
    return (blocks[t // BLOCK] * BLOCK + t % BLOCK).cuda()


def _objs(conn: LayerwisePagedKVConnector, lengths: list[int]) -> list[list[TensorMemoryObj]]:
    out = []
    for _ in range(LAYERS):
        layer = []
        for n in lengths:
            shape = conn.get_shape(n)
            raw = torch.full((shape.numel() * 2,), 0x7F, dtype=torch.uint8, pin_memory=True)
            meta = MemoryObjMetadata(
                shape=shape,
                dtype=torch.bfloat16,
                address=0,
                phy_size=raw.numel(),
                ref_count=1,
                pin_count=0,
                fmt=MemoryFormat.KV_T2D,
                shapes=[shape],
                dtypes=[torch.bfloat16],
            )
            layer.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))
        out.append(layer)
    return out


def _spans(lengths: list[int]) -> tuple[list[int], list[int]]:
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return starts, [s + n for s, n in zip(starts, lengths)]


def _stored(
    seed: int,
) -> tuple[list[int], list[int], torch.Tensor, list[torch.Tensor], list[list[TensorMemoryObj]]]:
    """A request of four full chunks stored from random caches: its spans, slots, the
    caches and the objects holding their layers."""
    starts, ends = _spans([CHUNK] * 4)
    slots = _slots(ends[-1], seed=seed)
    src = _caches("random", seed=seed + 1)
    store = LayerwisePagedKVConnector(src)
    objs = _objs(store, [CHUNK] * 4)
    for _ in store.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=True):
        pass
    return starts, ends, slots, src, objs


def _want(caches: list[torch.Tensor], slots: torch.Tensor, layer: int, s: int, e: int) -> torch.Tensor:
    return PagedKVCache(caches).gather(slots[s:e])[:, layer].transpose(0, 1).cpu()  # [T, K, W]


# A slow stream (a busy PCIe link, a long kernel) held up with torch.cuda._sleep: each
# wait between the pipeline's streams must then hold, where on an idle GPU the host is
# usually slow enough to hide a missing one.
_HOLD = 20_000_000  # GPU cycles: milliseconds at any clock


def _hold(stream: torch.cuda.Stream | None) -> None:
    assert stream is not None
    with torch.cuda.stream(stream):
        torch.cuda._sleep(_HOLD)


def test_store_reads_each_layer_after_the_caller_wrote_it():
    """The caller writes layer i (after a slow kernel) and then steps the store: the
    gather must wait for that write, so the objects hold the new values, not zeros."""
    lengths = [CHUNK] * 4 + [100]
    starts, ends = _spans(lengths)
    slots = _slots(ends[-1], seed=1)
    caches, values = _caches(), _caches("random", seed=2)
    conn = LayerwisePagedKVConnector(caches)
    objs = _objs(conn, lengths)
    gen = conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=True)
    for layer in range(LAYERS):
        torch.cuda._sleep(2_000_000)  # a slow attention on the caller's stream
        caches[layer].copy_(values[layer])
        next(gen)
        if layer:  # the engine puts layer - 1 right after this step returns
            for obj, s, e in zip(objs[layer - 1], starts, ends):
                assert torch.equal(obj.tensor.view(e - s, 2, -1), _want(values, slots, layer - 1, s, e))
    next(gen)
    for layer in range(LAYERS):
        for obj, s, e in zip(objs[layer], starts, ends):
            assert torch.equal(obj.tensor.view(e - s, 2, -1), _want(values, slots, layer, s, e)), layer
            assert obj.metadata.fmt == MemoryFormat.KV_T2D


@pytest.mark.parametrize("slow_link", [False, True], ids=["idle", "slow-link"])
def test_load_is_visible_to_the_callers_next_kernel(slow_link):
    """After send(layer i + 1) the caller's stream waits for layer i: a copy of layer i's
    cache queued right then sees the loaded values, not the zeros still there, also when
    every copy is held up from the start (``slow-link``; see ``_hold`` below)."""
    starts, ends, slots, src, objs = _stored(seed=3)
    fresh = _caches()
    load = LayerwisePagedKVConnector(fresh)
    if slow_link:
        _hold(load.load_copies.stream)
    seen = []
    gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=True)
    next(gen)
    gen.send(objs[0])
    for layer in range(LAYERS):
        if layer + 1 < LAYERS:
            gen.send(objs[layer + 1])
        else:
            next(gen)
        seen.append(fresh[layer].clone())  # "attention" on layer `layer`
    with pytest.raises(StopIteration):
        next(gen)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(
            PagedKVCache(seen).gather(slots)[:, layer], PagedKVCache(src).gather(slots)[:, layer]
        )


def test_load_primed_on_another_stream_waits_for_its_rows():
    """A load makes its row indices at the generator's first step, on the stream current
    then (LMCache primes it before fetching the first layer from storage). When its
    objects come on another stream, and the first one is held up behind a slow kernel,
    the scatters must still wait for those rows: every slot ends up right."""
    starts, ends, slots, src, objs = _stored(seed=4)
    fresh = _caches()
    load = LayerwisePagedKVConnector(fresh)
    priming = torch.cuda.Stream()
    priming.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(priming):
        torch.cuda._sleep(_HOLD)  # the rows come after this
        gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=True)
        next(gen)
    for layer in range(LAYERS):
        gen.send(objs[layer])
    next(gen)
    with pytest.raises(StopIteration):
        next(gen)
    torch.cuda.synchronize()
    assert torch.equal(PagedKVCache(fresh).gather(slots), PagedKVCache(src).gather(slots))


def test_row_copy_asked_for_moves_layerwise_loads_of_pinned_objects():
    """``row_copy=True`` takes the one-launch row copy for layerwise loads of pinned
    objects, as it does for stores (the pipeline is the default only): no pipeline plan
    is made, and every slot ends up right."""
    starts, ends, slots, src, objs = _stored(seed=6)
    fresh = _caches()
    load = LayerwisePagedKVConnector(fresh, row_copy=True)
    gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=True)
    next(gen)
    for layer in range(LAYERS):
        gen.send(objs[layer])
    next(gen)
    torch.cuda.synchronize()
    assert torch.equal(PagedKVCache(fresh).gather(slots), PagedKVCache(src).gather(slots))
    assert not load._plans


def test_load_holds_each_layers_objects_until_its_transfer_is_complete():
    """A load holds a reference to each object its queued copies read (the engine drops
    its own right after the last send): with every copy held up, no object sent is given
    back before the end; after the last step every reference is back."""
    starts, ends, slots, src, objs = _stored(seed=7)
    fresh = _caches()
    load = LayerwisePagedKVConnector(fresh)
    _hold(load.load_copies.stream)  # every copy waits behind a long kernel
    gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=True)
    next(gen)
    for layer in range(LAYERS):
        gen.send(objs[layer])
        assert all(o.get_ref_count() == 2 for sent in objs[: layer + 1] for o in sent), layer
    next(gen)
    assert all(o.get_ref_count() == 1 for sent in objs for o in sent)
    torch.cuda.synchronize()
    assert torch.equal(PagedKVCache(fresh).gather(slots), PagedKVCache(src).gather(slots))


def test_back_to_back_requests_without_host_waits():
    """Two stores with sync=False queued before either finishes (the scratch buffers and
    events are reused across them), then two loads (one keeping vLLM's cached prefix):
    every object and every slot ends up right."""
    caches = _caches("random", seed=5)
    conn = LayerwisePagedKVConnector(caches)
    a_len, b_len = [CHUNK] * 4, [CHUNK, 37]
    a_slots = _slots(sum(a_len), seed=6)
    b_slots = _slots(sum(b_len), seed=6, after=sum(a_len) // BLOCK)  # disjoint from a's
    a_starts, a_ends = _spans(a_len)
    b_starts, b_ends = _spans(b_len)
    a_objs, b_objs = _objs(conn, a_len), _objs(conn, b_len)
    for objs, starts, ends, slots in (
        (a_objs, a_starts, a_ends, a_slots),
        (b_objs, b_starts, b_ends, b_slots),
    ):
        for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=False):
            pass
    conn.store_copies.synchronize()
    for objs, starts, ends, slots in (
        (a_objs, a_starts, a_ends, a_slots),
        (b_objs, b_starts, b_ends, b_slots),
    ):
        for layer in range(LAYERS):
            for obj, s, e in zip(objs[layer], starts, ends):
                assert torch.equal(obj.tensor.view(e - s, 2, -1), _want(caches, slots, layer, s, e))

    fresh = _caches()
    load = LayerwisePagedKVConnector(fresh)
    for objs, starts, ends, slots, cached in (
        (a_objs, a_starts, a_ends, a_slots, 300),
        (b_objs, b_starts, b_ends, b_slots, 0),
    ):
        gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=False, vllm_cached_tokens=cached)
        next(gen)
        for layer in range(LAYERS):
            gen.send(objs[layer])
        next(gen)
    torch.cuda.synchronize()
    got, want = PagedKVCache(fresh).gather(a_slots), PagedKVCache(caches).gather(a_slots)
    assert torch.count_nonzero(got[:, :, :300]) == 0
    assert torch.equal(got[:, :, 300:], want[:, :, 300:])
    assert torch.equal(PagedKVCache(fresh).gather(b_slots), PagedKVCache(caches).gather(b_slots))


def test_pipeline_and_single_stream_paths_agree():
    lengths = [CHUNK, CHUNK, 11]
    starts, ends = _spans(lengths)
    slots = _slots(ends[-1], seed=8)
    caches = _caches("random", seed=9)
    results = []
    for pipeline in (True, False):
        conn = LayerwisePagedKVConnector(caches, pipeline=pipeline)
        objs = _objs(conn, lengths)
        for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots):
            pass
        results.append([[o.tensor.clone() for o in layer] for layer in objs])
    for a, b in zip(*results):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_store_keeps_a_scratch_buffer_until_its_copies_have_read_it():
    """Copies held up after layer 0: the gathers run ahead, and the gather of layer i + 2
    must not overwrite the buffer layer i's copies have yet to read."""
    lengths = [CHUNK] * 4
    starts, ends = _spans(lengths)
    slots = _slots(ends[-1], seed=10)
    caches = _caches("random", seed=11)
    conn = LayerwisePagedKVConnector(caches)
    objs = _objs(conn, lengths)
    gen = conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=False)
    next(gen)
    _hold(conn.store_copies.stream)
    for _ in gen:
        pass
    conn.store_copies.synchronize()
    for layer in range(LAYERS):
        for obj, s, e in zip(objs[layer], starts, ends):
            assert torch.equal(obj.tensor.view(e - s, 2, -1), _want(caches, slots, layer, s, e)), layer


def test_load_keeps_a_scratch_buffer_until_its_scatter_has_read_it():
    """Scatters held up after layer 0: the copies run ahead, and the copies of layer
    i + 2 must not overwrite the buffer layer i's scatter has yet to read."""
    starts, ends, slots, src, objs = _stored(seed=12)
    fresh = _caches()
    load = LayerwisePagedKVConnector(fresh)
    gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=False)
    next(gen)
    gen.send(objs[0])
    _hold(load.load_kernels.stream)
    for layer in range(1, LAYERS):
        gen.send(objs[layer])
    next(gen)
    torch.cuda.synchronize()
    assert torch.equal(PagedKVCache(fresh).gather(slots), PagedKVCache(src).gather(slots))


def _two_requests(seed: int) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Two requests of two full chunks (1 MiB pieces) on disjoint shuffled blocks."""
    lengths = [CHUNK] * 2
    starts, ends = _spans(lengths)
    a_slots = _slots(ends[-1], seed=seed)
    b_slots = _slots(ends[-1], seed=seed, after=ends[-1] // BLOCK)
    return starts, ends, a_slots, b_slots


def test_stores_stepped_in_turn_keep_each_requests_rows():
    """LMCache's vLLM adapter steps every request's store one layer at a time (A's layer
    i, B's layer i, A's layer i + 1, ...; only the first with sync=True), and all of them
    share the direction's two scratch buffers. With the copies held up, a gather of B's
    must not overwrite rows A's copies have yet to read out of the same buffer. Same
    geometry for both, so the second request also reuses the first one's plan."""
    starts, ends, a_slots, b_slots = _two_requests(seed=20)
    caches = _caches("random", seed=21)
    conn = LayerwisePagedKVConnector(caches)
    a_objs, b_objs = _objs(conn, [CHUNK] * 2), _objs(conn, [CHUNK] * 2)
    gens = [
        conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=sync)
        for objs, slots, sync in ((a_objs, a_slots, True), (b_objs, b_slots, False))
    ]
    for step in range(LAYERS + 1):
        if step == 1:
            _hold(conn.store_copies.stream)  # A's copies of layer 1 on, behind it
        for gen in gens:
            next(gen)
    conn.store_copies.synchronize()
    for objs, slots in ((a_objs, a_slots), (b_objs, b_slots)):
        for layer in range(LAYERS):
            for obj, s, e in zip(objs[layer], starts, ends):
                assert torch.equal(obj.tensor.view(e - s, 2, -1), _want(caches, slots, layer, s, e)), layer


def test_loads_stepped_in_turn_keep_each_requests_rows():
    """The adapter's load order: each request started, then one layer of each in turn (A0
    B0, A1 B1, ...; only the last request with sync=True). With the scatters held up
    before each round, B's copies into a buffer must wait for A's scatter out of it, or
    A's cache gets B's bytes."""
    starts, ends, a_slots, b_slots = _two_requests(seed=22)
    src = _caches("random", seed=23)
    store = LayerwisePagedKVConnector(src)
    a_objs, b_objs = _objs(store, [CHUNK] * 2), _objs(store, [CHUNK] * 2)
    for objs, slots in ((a_objs, a_slots), (b_objs, b_slots)):
        for _ in store.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=True):
            pass
    fresh = _caches()
    load = LayerwisePagedKVConnector(fresh)
    gens = []
    for objs, slots, sync in ((a_objs, a_slots, False), (b_objs, b_slots, True)):
        gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, sync=sync)
        next(gen)
        gens.append((gen, objs))
    for layer in range(LAYERS):
        _hold(load.load_kernels.stream)  # this round's scatters queued behind it
        for gen, objs in gens:
            gen.send(objs[layer])
    for gen, _ in gens:
        next(gen)
    torch.cuda.synchronize()
    for slots in (a_slots, b_slots):
        assert torch.equal(PagedKVCache(fresh).gather(slots), PagedKVCache(src).gather(slots))
