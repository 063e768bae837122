"""Gather from random paged caches, scatter into fresh ones: bytes must match."""

from __future__ import annotations

import pytest
import torch
from gpu_kvgen import GEOMETRY, make_caches, random_requests, reference_token

from kvstore.gpu import PagedKVCache

LENGTHS = [37, 8, 21, 1]  # several requests, partial last blocks, a one-token request


def _touched(layout: str, caches, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    return torch.stack([reference_token(layout, caches[0], s, block_size) for s in slots.tolist()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_whole_chunk_round_trip(layout, dtype):
    src = PagedKVCache(make_caches(layout, dtype=dtype))
    lay = src.layout
    reqs = random_requests(LENGTHS, num_blocks=lay.num_blocks, block_size=lay.block_size, seed=1)
    # The same tokens land in different blocks of a fresh pool (as after a restart).
    fresh_reqs = random_requests(LENGTHS, num_blocks=lay.num_blocks, block_size=lay.block_size, seed=2)
    dst = PagedKVCache(make_caches(layout, dtype=dtype, fill="zeros"))
    for slots, fresh_slots in zip(reqs.slots, fresh_reqs.slots):
        chunk = src.gather(slots)
        assert chunk.shape == lay.chunk_shape(len(slots))
        # The chunk holds exactly the right tokens (checked by plain indexing).
        for layer in range(lay.num_layers):
            for i, s in enumerate(slots.tolist()):
                want = reference_token(layout, src.kv_caches[layer], s, lay.block_size)
                assert torch.equal(chunk[:, layer, i], want)
        dst.scatter(fresh_slots, chunk)
        assert torch.equal(dst.gather(fresh_slots), chunk)
    # Nothing outside the requests' slots was written.
    used = torch.cat(fresh_reqs.slots)
    mask = torch.ones(lay.num_slots, dtype=torch.bool)
    mask[used] = False
    untouched = torch.nonzero(mask).flatten()
    assert torch.count_nonzero(dst.gather(untouched)) == 0


def test_layer_round_trip(layout):
    src = PagedKVCache(make_caches(layout))
    lay = src.layout
    reqs = random_requests(LENGTHS, num_blocks=lay.num_blocks, block_size=lay.block_size, seed=3)
    dst = PagedKVCache(make_caches(layout, fill="zeros"))
    slots = torch.cat(reqs.slots)
    rows = src.layer_rows(slots)
    for layer in range(lay.num_layers):
        out = torch.empty(lay.layer_chunk_shape(len(slots)), dtype=lay.dtype)
        src.gather_layer(layer, rows, out)
        # Token-major layer tensor equals the whole-chunk tensor's layer slice.
        whole = src.gather(slots)[:, layer]  # [K, T, W]
        assert torch.equal(out.reshape(len(slots), lay.kv_size, lay.width), whole.transpose(0, 1))
        dst.scatter_layer(layer, dst.layer_rows(slots), out)
    assert torch.equal(dst.gather(slots), src.gather(slots))


def test_gather_into_non_contiguous_out():
    src = PagedKVCache(make_caches("flash_attn"))
    slots = torch.tensor([5, 3, 90])
    big = torch.zeros(2, 3, 3, 2 * src.layout.width)
    out = big[..., : src.layout.width]  # strided view
    src.gather(slots, out=out)
    assert torch.equal(out, src.gather(slots))


def test_wrong_chunk_shapes_and_dtypes_are_rejected():
    src = PagedKVCache(make_caches("flash_infer"))
    slots = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="expected"):
        src.gather(slots, out=torch.empty(2, 3, 4, src.layout.width))
    with pytest.raises(ValueError, match="float16"):
        src.scatter(slots, torch.zeros(src.layout.chunk_shape(3), dtype=torch.float16))
    with pytest.raises(ValueError, match="slots"):
        src.gather(torch.tensor([1, GEOMETRY["flash_infer"]["num_blocks"] * 8]))


@pytest.mark.gpu
def test_round_trip_on_cuda(layout):
    src = PagedKVCache(make_caches(layout, device="cuda", dtype=torch.float16))
    lay = src.layout
    reqs = random_requests(LENGTHS, num_blocks=lay.num_blocks, block_size=lay.block_size, seed=4)
    dst = PagedKVCache(make_caches(layout, device="cuda", dtype=torch.float16, fill="zeros"))
    for slots in reqs.slots:
        chunk = src.gather(slots.cuda())
        dst.scatter(slots.cuda(), chunk)
        assert torch.equal(dst.gather(slots.cuda()).cpu(), src.gather(slots.cuda()).cpu())


def test_misaligned_chunk_tensors_fall_back_to_element_copies():
    """A chunk tensor at an odd offset cannot be read as 8-byte words; still correct."""
    src = PagedKVCache(make_caches("flash_attn"))
    slots = torch.tensor([4, 77, 13])
    shape = src.layout.chunk_shape(3)
    backing = torch.zeros(shape.numel() + 1)
    chunk = backing[1:].view(shape)  # 4-byte aligned, not 8
    src.gather(slots, out=chunk)
    assert torch.equal(chunk, src.gather(slots))
    dst = PagedKVCache(make_caches("flash_attn", fill="zeros"))
    dst.scatter(slots, chunk)
    assert torch.equal(dst.gather(slots), chunk)
