"""The LMCache connectors driven directly: whole-chunk and layerwise, with and without
the staging path, and the layerwise generator protocol step by step."""

from __future__ import annotations

import os

import pytest
import torch
from gpu_kvgen import make_caches, random_requests
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from kvstore.gpu import PagedKVCache, PinnedPool
from kvstore.gpu.connector import LayerwisePagedKVConnector, PagedKVConnector, make_connector
from kvstore.gpu.rowcopy import uses_kernel

LENGTHS = [16, 16, 16, 5]  # chunks of one request; the last chunk is partial
ALLOC = AdHocMemoryAllocator("cpu")
# The three transfer paths: gather/scatter kernels straight into the objects, the same
# through device scratch and staging buffers, and one row copy by address (on CPU its
# host loop, so the address arithmetic is checked without a GPU).
PATHS = {"gather": {"row_copy": False}, "staged": {"stage_all": True}, "rowcopy": {"row_copy": True}}


# Layerwise adds the two-stream pipeline (kvstore.gpu.pipeline; CUDA with pinned objects
# by default, forced here so its buffer and span bookkeeping runs inline on CPU).
LAYER_PATHS = {**PATHS, "pipeline": {"pipeline": True}}


@pytest.fixture(params=sorted(PATHS))
def path(request) -> str:
    return request.param


@pytest.fixture(params=sorted(LAYER_PATHS))
def layer_path(request) -> str:
    return request.param


def _sequence(layout: str, seed: int):
    """A request's paged caches plus a full-sequence slot mapping over shuffled blocks."""
    caches = make_caches(layout, seed=seed)
    lay = PagedKVCache(caches).layout
    slots = torch.cat(
        random_requests([sum(LENGTHS)], num_blocks=lay.num_blocks, block_size=lay.block_size, seed=seed).slots
    )
    starts, ends, at = [], [], 0
    for n in LENGTHS:
        starts.append(at)
        ends.append(at + n)
        at += n
    return caches, slots, starts, ends


def test_whole_chunk_store_then_retrieve_into_fresh_caches(layout, path):
    caches, slots, starts, ends = _sequence(layout, seed=5)
    pool = PinnedPool(min_buffer_bytes=1024)
    conn = PagedKVConnector(caches, pool=pool, **PATHS[path])
    fmt = MemoryFormat.KV_MLA_FMT if layout == "mla" else MemoryFormat.KV_2LTD
    objs = [ALLOC.allocate(conn.get_shape(e - s), caches[0].dtype, fmt=fmt) for s, e in zip(starts, ends)]
    conn.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
    src = PagedKVCache(caches)
    for obj, s, e in zip(objs, starts, ends):
        assert obj.metadata.fmt == fmt
        assert torch.equal(obj.tensor, src.gather(slots[s:e]))

    fresh = make_caches(layout, fill="zeros")
    lay = src.layout
    fresh_slots = random_requests(
        [sum(LENGTHS)], num_blocks=lay.num_blocks, block_size=lay.block_size, seed=9
    ).slots[0]
    if path == "rowcopy":  # under TRITON_INTERPRET=1 the Triton kernel, else the host loop
        assert conn._copier is not None
        assert uses_kernel(conn.device) == (os.environ.get("TRITON_INTERPRET") == "1")
    loader = PagedKVConnector(pool=pool, **PATHS[path], **_dims(conn))
    loader.batched_to_gpu(objs, starts, ends, kvcaches=fresh, slot_mapping=fresh_slots)
    assert torch.equal(PagedKVCache(fresh).gather(fresh_slots), src.gather(slots))
    if path == "staged":
        assert pool.stats.allocations >= 1 and pool.stats.reuses >= 1  # buffers came back and were reused


def _dims(conn) -> dict:
    return dict(num_layers=conn.num_layers, hidden_dim_size=conn.hidden_dim_size, use_mla=conn.use_mla)


def test_vllm_cached_prefix_is_not_overwritten(path):
    caches, slots, starts, ends = _sequence("flash_attn", seed=6)
    conn = PagedKVConnector(caches)
    objs = [ALLOC.allocate(conn.get_shape(e - s), torch.float32) for s, e in zip(starts, ends)]
    conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots)
    fresh = make_caches("flash_attn", fill="zeros")
    load = PagedKVConnector(fresh, **PATHS[path])
    load.batched_to_gpu(objs, starts, ends, slot_mapping=slots, vllm_cached_tokens=20)
    got = PagedKVCache(fresh).gather(slots)
    want = PagedKVCache(caches).gather(slots)
    assert torch.count_nonzero(got[:, :, :20]) == 0  # vLLM's own tokens left alone
    assert torch.equal(got[:, :, 20:], want[:, :, 20:])


def test_missing_kwargs_and_wrong_formats_say_what_to_do():
    caches, slots, _, _ = _sequence("flash_infer", seed=7)
    conn = PagedKVConnector(num_layers=3, hidden_dim_size=12, use_mla=False)
    obj = ALLOC.allocate(conn.get_shape(16), torch.float32)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(obj, 0, 16, slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.from_gpu(obj, 0, 16, kvcaches=caches)
    obj.metadata.fmt = MemoryFormat.KV_T2D
    with pytest.raises(ValueError, match="KV_T2D"):
        conn.to_gpu(obj, 0, 16, kvcaches=caches, slot_mapping=slots)
    with pytest.raises(ValueError, match="num_layers"):
        PagedKVConnector(caches, num_layers=4)
    with pytest.raises(ValueError, match="num_layers, hidden_dim_size and use_mla"):
        PagedKVConnector()


def _layer_objs(conn, starts, ends, dtype):
    fmt = MemoryFormat.KV_MLA_FMT if conn.use_mla else MemoryFormat.KV_T2D
    return [
        [ALLOC.allocate(conn.get_shape(e - s), dtype, fmt=fmt) for s, e in zip(starts, ends)]
        for _ in range(conn.num_layers)
    ]


def test_layerwise_store_protocol(layout, layer_path):
    """L + 1 next() calls; call c queues layer c and completes layer c - 1 (the engine puts
    that one when the call returns); layers after c are untouched. On CPU the direct and
    pipeline paths finish a layer as it is queued; the staged path only at the next call."""
    caches, slots, starts, ends = _sequence(layout, seed=8)
    conn = LayerwisePagedKVConnector(
        caches, pool=PinnedPool(min_buffer_bytes=1024), **LAYER_PATHS[layer_path]
    )
    objs = _layer_objs(conn, starts, ends, caches[0].dtype)
    for layer_objs in objs:
        for obj in layer_objs:
            obj.tensor.zero_()
    src = PagedKVCache(caches)
    want = [
        [src.gather(slots[s:e])[:, layer].transpose(0, 1) for s, e in zip(starts, ends)]  # [T, K, W]
        for layer in range(conn.num_layers)
    ]
    gen = conn.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots, sync=True)
    num_layers = conn.num_layers
    fmt = MemoryFormat.KV_MLA_FMT if layout == "mla" else MemoryFormat.KV_T2D
    for call in range(num_layers + 1):
        next(gen)
        complete_upto = call - 1 if layer_path == "staged" else call
        for layer in range(num_layers):
            for obj, w in zip(objs[layer], want[layer]):
                got = obj.tensor.reshape(w.shape)
                if layer <= complete_upto:
                    assert torch.equal(got, w), (call, layer)
                    assert obj.metadata.fmt == fmt
                else:
                    assert torch.count_nonzero(got) == 0, (call, layer)
    with pytest.raises(StopIteration):
        next(gen)


def test_layerwise_load_protocol(layout, layer_path):
    """next(), then send(layer i objects) for each layer, then next(): L + 2 steps."""
    caches, slots, starts, ends = _sequence(layout, seed=10)
    store = LayerwisePagedKVConnector(caches)
    objs = _layer_objs(store, starts, ends, caches[0].dtype)
    gen = store.batched_from_gpu(objs, starts, ends, slot_mapping=slots, sync=True)
    for _ in gen:
        pass

    fresh = make_caches(layout, fill="zeros")
    load = LayerwisePagedKVConnector(fresh, pool=PinnedPool(min_buffer_bytes=1024), **LAYER_PATHS[layer_path])
    gen = load.batched_to_gpu(starts, ends, kvcaches=fresh, slot_mapping=slots, sync=True)
    next(gen)
    dst, src = PagedKVCache(fresh), PagedKVCache(caches)
    for layer in range(load.num_layers):
        gen.send(objs[layer])
        # On CPU the copy is synchronous: layer `layer` is in place, the next is not yet.
        assert torch.equal(dst.gather(slots)[:, layer], src.gather(slots)[:, layer])
        if layer + 1 < load.num_layers:
            assert torch.count_nonzero(dst.gather(slots)[:, layer + 1]) == 0
    next(gen)
    with pytest.raises(StopIteration):
        next(gen)
    assert torch.equal(dst.gather(slots), src.gather(slots))


def test_layerwise_load_skips_vllm_cached_tokens_and_checks_send(layer_path):
    caches, slots, starts, ends = _sequence("mla", seed=11)
    store = LayerwisePagedKVConnector(caches)
    objs = _layer_objs(store, starts, ends, caches[0].dtype)
    for _ in store.batched_from_gpu(objs, starts, ends, slot_mapping=slots):
        pass
    fresh = make_caches("mla", fill="zeros")
    load = make_connector(fresh, layerwise=True, **LAYER_PATHS[layer_path])
    gen = load.batched_to_gpu(starts, ends, slot_mapping=slots, vllm_cached_tokens=33, sync=False)
    next(gen)
    for layer in range(load.num_layers):
        gen.send(objs[layer])
    next(gen)
    got, want = PagedKVCache(fresh).gather(slots), PagedKVCache(caches).gather(slots)
    assert torch.count_nonzero(got[:, :, :33]) == 0
    assert torch.equal(got[:, :, 33:], want[:, :, 33:])

    gen = load.batched_to_gpu(starts, ends, slot_mapping=slots)
    next(gen)
    with pytest.raises(ValueError, match="one per chunk"):
        gen.send(objs[0][:2])


def test_pipeline_refuses_a_later_layer_object_unlike_the_first():
    """The pipeline copies by address, sized from the first layer's objects: an object of a
    later layer that is shorter, in another format (loads) or invalidated is refused
    before any byte moves, and nothing past an object is read or written."""
    caches, slots, starts, ends = _sequence("flash_attn", seed=12)
    dtype = caches[0].dtype
    store = LayerwisePagedKVConnector(caches)
    objs = _layer_objs(store, starts, ends, dtype)
    for _ in store.batched_from_gpu(objs, starts, ends, slot_mapping=slots):
        pass

    def short() -> object:
        return ALLOC.allocate(store.get_shape(ends[0] - starts[0] - 1), dtype, fmt=MemoryFormat.KV_T2D)

    other_fmt = ALLOC.allocate(store.get_shape(ends[0] - starts[0]), dtype, fmt=MemoryFormat.KV_2LTD)
    gone = ALLOC.allocate(store.get_shape(ends[0] - starts[0]), dtype, fmt=MemoryFormat.KV_T2D)
    gone.invalidate()
    fresh = make_caches("flash_attn", fill="zeros")
    for bad in (short(), other_fmt, gone):
        load = LayerwisePagedKVConnector(fresh, pipeline=True)
        gen = load.batched_to_gpu(starts, ends, slot_mapping=slots)
        next(gen)
        gen.send(objs[0])
        with pytest.raises(ValueError, match="must be alike"):
            gen.send([bad, *objs[1][1:]])
    assert torch.count_nonzero(PagedKVCache(fresh).gather(slots)[:, 1:]) == 0

    bad = short()
    bad.tensor.fill_(1.5)
    before = bad.tensor.clone()
    layers = [list(layer) for layer in objs]
    layers[2][0] = bad
    gen = LayerwisePagedKVConnector(caches, pipeline=True).batched_from_gpu(layers, starts, ends, slot_mapping=slots)
    with pytest.raises(ValueError, match="must be alike"):
        for _ in gen:
            pass
    assert torch.equal(bad.tensor, before)


def test_pipeline_refuses_first_layer_objects_unlike_the_chunks():
    """The pipeline sizes every copy from the first layer's objects (their shape and
    dtype, no tensor view): a first-layer object too short for its chunk, of another
    dtype, invalidated, of several tensor groups or narrowed to a byte payload is refused
    before any byte moves, in either direction."""
    caches, slots, starts, ends = _sequence("flash_attn", seed=13)
    dtype = caches[0].dtype
    store = LayerwisePagedKVConnector(caches)
    objs = _layer_objs(store, starts, ends, dtype)
    for _ in store.batched_from_gpu(objs, starts, ends, slot_mapping=slots):
        pass
    n = ends[0] - starts[0]
    short = ALLOC.allocate(store.get_shape(n - 1), dtype, fmt=MemoryFormat.KV_T2D)
    same_width = {4: torch.int32, 2: torch.int16}[dtype.itemsize]  # the right bytes, another dtype
    other_dtype = ALLOC.allocate(store.get_shape(n), same_width, fmt=MemoryFormat.KV_T2D)
    gone = ALLOC.allocate(store.get_shape(n), dtype, fmt=MemoryFormat.KV_T2D)
    gone.invalidate()
    groups = ALLOC.allocate([store.get_shape(n), torch.Size([8])], [dtype, dtype], fmt=MemoryFormat.KV_T2D)
    shape = store.get_shape(n)
    raw = torch.zeros(shape.numel() * dtype.itemsize, dtype=torch.uint8)
    meta = MemoryObjMetadata(shape, dtype, 0, raw.numel(), 1, 0, MemoryFormat.KV_T2D, shapes=[shape], dtypes=[dtype])
    narrowed = TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)
    narrowed.set_used_size(raw.numel())  # (an encoded payload's bytes: its tensor is flat uint8)
    short.tensor.fill_(1.5)
    other_dtype.tensor.fill_(7)
    before = [short.tensor.clone(), other_dtype.tensor.clone()]
    fresh = make_caches("flash_attn", fill="zeros")
    for bad, match in (
        (short, "allocate objects"),
        (other_dtype, "allocate objects"),
        (gone, "valid: False|invalidated"),
        (groups, "several tensor groups|must be alike|size"),
        (narrowed, "narrowed|allocate objects"),
    ):
        gen = LayerwisePagedKVConnector(fresh, pipeline=True).batched_to_gpu(starts, ends, slot_mapping=slots)
        next(gen)
        with pytest.raises(ValueError, match=match):
            gen.send([bad, *objs[0][1:]])
        layers = [list(layer) for layer in objs]
        layers[0][0] = bad
        gen = LayerwisePagedKVConnector(caches, pipeline=True).batched_from_gpu(layers, starts, ends, slot_mapping=slots)
        with pytest.raises(ValueError, match=match):
            next(gen)
    assert torch.count_nonzero(PagedKVCache(fresh).gather(slots)) == 0
    assert torch.equal(short.tensor, before[0]) and torch.equal(other_dtype.tensor, before[1])  # nor the stores


def test_kept_slots_copy_a_host_slot_mapping():
    """A host slot mapping is a buffer vLLM refills: what a request keeps of it is a copy
    (a device one back to back is a view, no kernel)."""
    from kvstore.gpu.connector import _kept_slots

    sm = torch.arange(20)
    got = _kept_slots(sm, [0, 4, 8], [4, 8, 12], [0, 0, 0])
    assert torch.equal(got, sm[:12])
    sm.fill_(-1)
    assert torch.equal(got, torch.arange(12))
    assert torch.equal(_kept_slots(torch.arange(20), [0, 8], [4, 12], [1, 0]), torch.tensor([1, 2, 3, 8, 9, 10, 11]))
    assert _kept_slots(torch.arange(20), [], [], []).numel() == 0


def test_layerwise_single_chunk_calls_are_refused():
    conn = LayerwisePagedKVConnector(make_caches("flash_attn"))
    with pytest.raises(NotImplementedError, match="generator"):
        conn.to_gpu(None, 0, 1)
    assert conn.get_shape(7) == torch.Size([7, 2, 12])
    assert PagedKVConnector(make_caches("mla")).get_shape(7) == torch.Size([1, 3, 7, 10])


@pytest.mark.gpu
@pytest.mark.parametrize("layerwise", [False, True])
def test_cuda_caches_with_host_memory_objects(layout, layerwise):
    """CUDA caches, pageable host memory objects: copy stream + pinned staging path."""
    caches, slots, starts, ends = _sequence(layout, seed=12)
    gpu_caches = [c.cuda() for c in caches]
    gpu_slots = slots.cuda()
    fresh = [torch.zeros_like(c) for c in gpu_caches]
    if layerwise:
        conn = LayerwisePagedKVConnector(gpu_caches)
        objs = _layer_objs(conn, starts, ends, caches[0].dtype)
        for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=gpu_slots, sync=True):
            pass
        load = LayerwisePagedKVConnector(fresh)
        gen = load.batched_to_gpu(starts, ends, slot_mapping=gpu_slots, sync=True)
        next(gen)
        for layer in range(load.num_layers):
            gen.send(objs[layer])
        next(gen)
    else:
        conn = PagedKVConnector(gpu_caches)
        objs = [ALLOC.allocate(conn.get_shape(e - s), caches[0].dtype) for s, e in zip(starts, ends)]
        conn.batched_from_gpu(objs, starts, ends, slot_mapping=gpu_slots)
        for obj, s, e in zip(objs, starts, ends):
            assert torch.equal(obj.tensor, PagedKVCache(caches).gather(slots[s:e]))
        PagedKVConnector(fresh).batched_to_gpu(objs, starts, ends, slot_mapping=gpu_slots)
    torch.cuda.synchronize()
    assert torch.equal(PagedKVCache(fresh).gather(gpu_slots).cpu(), PagedKVCache(caches).gather(slots))


def test_row_copy_refuses_objects_of_the_wrong_shape_or_a_short_slot_mapping():
    """The row copy writes by address: a mis-sized object is an error, never an overrun."""
    caches, slots, starts, ends = _sequence("flash_attn", seed=13)
    conn = PagedKVConnector(caches, row_copy=True)
    objs = [ALLOC.allocate(conn.get_shape(e - s), torch.float32) for s, e in zip(starts, ends)]
    small = ALLOC.allocate(conn.get_shape(4), torch.float32)
    with pytest.raises(ValueError, match="memory object 3 has shape"):
        conn.batched_from_gpu([*objs[:3], small], starts, ends, slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping holds 40 tokens"):
        conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots[:40])
    layerwise = LayerwisePagedKVConnector(caches, row_copy=True)
    layer_objs = _layer_objs(layerwise, starts, ends, torch.float32)
    layer_objs[1][0] = ALLOC.allocate(layerwise.get_shape(3), torch.float32, fmt=MemoryFormat.KV_T2D)
    with pytest.raises(ValueError, match="memory object 0 has shape"):
        next(layerwise.batched_from_gpu(layer_objs, starts, ends, slot_mapping=slots))


@pytest.mark.parametrize(
    "dtype, head_size", [(torch.float16, 6), (torch.bfloat16, 5), (torch.uint8, 3)], ids=["w4", "w2", "w1"]
)
def test_rowcopy_rows_of_every_word_size(dtype, head_size):
    """Rows of 12, 10 and 3 bytes (one head): moved as 4-, 2- and 1-byte words, whole
    chunks and layerwise, with vLLM's cached prefix left alone."""
    kw = dict(dtype=dtype, heads=1, head_size=head_size)
    caches = make_caches("flash_infer", seed=15, **kw)
    lay = PagedKVCache(caches).layout
    slots = random_requests(
        [sum(LENGTHS)], num_blocks=lay.num_blocks, block_size=lay.block_size, seed=15
    ).slots[0]
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    ends = [s + n for s, n in zip(starts, LENGTHS)]
    conn = PagedKVConnector(caches, row_copy=True)
    objs = [ALLOC.allocate(conn.get_shape(e - s), dtype) for s, e in zip(starts, ends)]
    conn.batched_from_gpu(objs, starts, ends, slot_mapping=slots)
    for obj, s, e in zip(objs, starts, ends):
        assert torch.equal(obj.tensor, PagedKVCache(caches).gather(slots[s:e]))
    fresh = make_caches("flash_infer", fill="zeros", **kw)
    PagedKVConnector(fresh, row_copy=True).batched_to_gpu(
        objs, starts, ends, slot_mapping=slots, vllm_cached_tokens=7
    )
    got, want = PagedKVCache(fresh).gather(slots), PagedKVCache(caches).gather(slots)
    assert torch.count_nonzero(got[:, :, :7]) == 0 and torch.equal(got[:, :, 7:], want[:, :, 7:])

    layerwise = LayerwisePagedKVConnector(caches, row_copy=True)
    layer_objs = _layer_objs(layerwise, starts, ends, dtype)
    for _ in layerwise.batched_from_gpu(layer_objs, starts, ends, slot_mapping=slots):
        pass
    fresh = make_caches("flash_infer", fill="zeros", **kw)
    gen = LayerwisePagedKVConnector(fresh, row_copy=True).batched_to_gpu(starts, ends, slot_mapping=slots)
    next(gen)
    for objs_of_layer in layer_objs:
        gen.send(objs_of_layer)
    next(gen)
    assert torch.equal(PagedKVCache(fresh).gather(slots), want)


def _pinned_objs(shapes, dtype, fmt, device=None):
    """Memory objects in pinned host memory (LMCache's pool), or on ``device``."""
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    objs = []
    for shape in shapes:
        nbytes = shape.numel() * dtype.itemsize
        if device is None:
            raw = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        meta = MemoryObjMetadata(
            shape=shape,
            dtype=dtype,
            address=0,
            phy_size=raw.numel(),
            ref_count=1,
            pin_count=0,
            fmt=fmt,
            shapes=[shape],
            dtypes=[dtype],
        )
        objs.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))
    return objs


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["pinned", "device"])
@pytest.mark.parametrize("row_copy", [None, True, False], ids=["default", "rowcopy", "dma"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_cuda_caches_with_pinned_or_device_memory_objects(layout, layerwise, row_copy, where):
    """CUDA caches; memory objects in pinned host memory (LMCache's pool) or on the GPU:
    whole chunks take the one-launch row copy by default (pinned memory through unified
    addressing); row_copy=False, and layerwise by default, the gather + DMA path. Bytes
    equal either way, vLLM's cached prefix untouched, the partial last chunk included."""
    caches, slots, starts, ends = _sequence(layout, seed=14)
    gpu_caches, gpu_slots = [c.cuda() for c in caches], slots.cuda()
    fresh = [torch.zeros_like(c) for c in gpu_caches]
    cls = LayerwisePagedKVConnector if layerwise else PagedKVConnector
    conn, load = cls(gpu_caches, row_copy=row_copy), cls(fresh, row_copy=row_copy)
    dtype = caches[0].dtype
    device = "cuda" if where == "device" else None
    if layerwise:
        fmt = MemoryFormat.KV_MLA_FMT if conn.use_mla else MemoryFormat.KV_T2D
        objs = [
            _pinned_objs([conn.get_shape(e - s) for s, e in zip(starts, ends)], dtype, fmt, device)
            for _ in range(conn.num_layers)
        ]
        for _ in conn.batched_from_gpu(objs, starts, ends, slot_mapping=gpu_slots, sync=True):
            pass
        want = PagedKVCache(caches)
        for layer in range(conn.num_layers):
            for obj, s, e in zip(objs[layer], starts, ends):
                assert torch.equal(
                    obj.tensor.cpu(),
                    want.gather(slots[s:e])[:, layer].transpose(0, 1).reshape(obj.tensor.shape),
                )
        gen = load.batched_to_gpu(starts, ends, slot_mapping=gpu_slots, sync=True, vllm_cached_tokens=20)
        next(gen)
        for layer in range(load.num_layers):
            gen.send(objs[layer])
        next(gen)
    else:
        fmt = MemoryFormat.KV_MLA_FMT if conn.use_mla else MemoryFormat.KV_2LTD
        objs = _pinned_objs([conn.get_shape(e - s) for s, e in zip(starts, ends)], dtype, fmt, device)
        conn.batched_from_gpu(objs, starts, ends, slot_mapping=gpu_slots)
        for obj, s, e in zip(objs, starts, ends):
            assert torch.equal(obj.tensor.cpu(), PagedKVCache(caches).gather(slots[s:e]))
        load.batched_to_gpu(objs, starts, ends, slot_mapping=gpu_slots, vllm_cached_tokens=20)
    torch.cuda.synchronize()
    # The row copy is the default for whole chunks only (layerwise copies stay on DMA).
    assert (conn._copier is not None) == (row_copy is True or (row_copy is None and not layerwise))
    got = PagedKVCache(fresh).gather(gpu_slots).cpu()
    want_all = PagedKVCache(caches).gather(slots)
    assert torch.count_nonzero(got[:, :, :20]) == 0
    assert torch.equal(got[:, :, 20:], want_all[:, :, 20:])


def test_pipeline_reuses_a_requests_plan_only_while_it_fits(layout):
    """A request of the geometry of the one before takes its plan (scratch addresses,
    word views, events) as it is; another geometry or a scratch buffer grown since gets a
    new one; every request's bytes land where they belong either way."""
    caches, slots, starts, ends = _sequence(layout, seed=13)
    dtype = caches[0].dtype
    store = LayerwisePagedKVConnector(caches, pipeline=True)
    objs = _layer_objs(store, starts, ends, dtype)
    fresh = make_caches(layout, fill="zeros")
    load = LayerwisePagedKVConnector(fresh, pipeline=True)
    src, dst = PagedKVCache(caches), PagedKVCache(fresh)

    def round_trip(starts: list[int], ends: list[int], objs) -> None:
        for _ in store.batched_from_gpu(objs, starts, ends, slot_mapping=slots):
            pass
        for c in fresh:
            c.zero_()
        gen = load.batched_to_gpu(starts, ends, slot_mapping=slots)
        next(gen)
        for layer in range(load.num_layers):
            gen.send(objs[layer])
        next(gen)
        kept = torch.cat([slots[s:e] for s, e in zip(starts, ends)])
        assert torch.equal(dst.gather(kept), src.gather(kept))

    round_trip(starts, ends, objs)
    plans = dict(store._plans), dict(load._plans)
    round_trip(starts, ends, objs)
    assert store._plans[True] is plans[0][True] and load._plans[False] is plans[1][False]

    # Fewer chunks: another plan (the spans differ).
    round_trip(starts[:2], ends[:2], [layer[:2] for layer in objs])
    assert load._plans[False] is not plans[1][False]
    # The full request again after its scratch buffers were reallocated: rebuilt, not reused.
    round_trip(starts, ends, objs)
    again = load._plans[False]
    load._load_pipe[1].get((4 * sum(LENGTHS), *caches[0].shape[-2:]), dtype)  # grows it
    round_trip(starts, ends, objs)
    assert load._plans[False] is not again
    # Other caches bound: the plans (which hold the caches bound before) are dropped.
    gen = load.batched_to_gpu(starts, ends, kvcaches=make_caches(layout, fill="zeros"), slot_mapping=slots)
    next(gen)
    assert not load._plans


def test_layer_rows_are_a_copy_of_the_slots(layout):
    """Rows outlive the slot mapping they came from (vLLM refills it for its next step)."""
    src = PagedKVCache(make_caches(layout))
    lay = src.layout
    slots = torch.cat(random_requests([40], num_blocks=lay.num_blocks, block_size=lay.block_size, seed=4).slots)
    rows = src.layer_rows(slots)
    assert torch.equal(rows, lay.rows(slots, token_major=True))
    slots.fill_(0)
    assert not torch.equal(rows, lay.rows(slots, token_major=True))


def test_pipeline_requests_stepped_in_turn(layout):
    """LMCache's vLLM adapter steps every request one layer at a time (A's layer i, B's
    layer i, ...); the pipeline's buffers are taken in turn across them and each request
    keeps its own geometry (here two of different chunk counts): every byte lands right
    (on CPU the steps run inline: this checks the bookkeeping; the CUDA ordering has its
    own tests in test_gpu_pipeline.py)."""
    caches, slots, starts, ends = _sequence(layout, seed=14)
    dtype = caches[0].dtype
    conn = LayerwisePagedKVConnector(caches, pipeline=True)
    requests = [(starts, ends), (starts[:1], ends[:1])]
    objs = [_layer_objs(conn, s, e, dtype) for s, e in requests]
    stores = [
        conn.batched_from_gpu(o, s, e, slot_mapping=slots, sync=i == 0)
        for i, (o, (s, e)) in enumerate(zip(objs, requests))
    ]
    for _ in range(conn.num_layers + 1):
        for gen in stores:
            next(gen)
    for layer in range(conn.num_layers):  # the one-chunk request holds the same first chunk
        assert torch.equal(objs[1][layer][0].tensor, objs[0][layer][0].tensor)
    fresh = make_caches(layout, fill="zeros")
    load = LayerwisePagedKVConnector(fresh, pipeline=True)
    loads = []
    for i, (o, (s, e)) in enumerate(zip(objs, requests)):
        gen = load.batched_to_gpu(s, e, slot_mapping=slots, sync=i == 1)
        next(gen)
        loads.append((gen, o))
    for layer in range(load.num_layers):
        for gen, o in loads:
            gen.send(o[layer])
    for gen, _ in loads:
        next(gen)
    kept = slots[starts[0] : ends[-1]]
    assert torch.equal(PagedKVCache(fresh).gather(kept), PagedKVCache(caches).gather(kept))
